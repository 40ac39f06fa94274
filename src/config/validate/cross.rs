//! The rules that span load balancers: names are unique, one VIP:port has
//! one listener per protocol, no backend is one of this daemon's own
//! VIP:ports, and neither a VIP:port nor a backend is `admin.listen`.
//!
//! They are found from the built specs alone ([`conflicts`]), so that a
//! reload which reuses the unchanged load balancers of the last file
//! ([`crate::config::Loader`]) is held to exactly the rules a full read is.
//! Where a conflict is in the file is looked up only when there is one.

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::ops::Range;

use super::Validator;
use crate::config::file::{FileConfig, FileLoadBalancer};
use crate::config::{ListenerKey, LoadBalancerSpec, Protocol};

/// One broken cross-load-balancer rule. Load balancers are named by their
/// index in the file (or the slice given), listeners by their index in the spec.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Conflict {
    /// Two load balancers with one name.
    Name {
        /// The first with it.
        first: usize,
        /// The one that has it again.
        again: usize,
    },
    /// Two listeners on one VIP:port and protocol.
    Address {
        /// The VIP:port.
        addr: SocketAddr,
        /// The protocol both listen with.
        protocol: Protocol,
        /// The first listener there (load balancer, listener).
        first: (usize, usize),
        /// The one there again.
        again: (usize, usize),
    },
    /// A backend whose nodeport is a VIP:port of this daemon: each client
    /// connection would come back into the daemon and be forwarded again.
    Loop {
        /// The load balancer with the backend.
        lb: usize,
        /// The backend.
        backend: IpAddr,
        /// Its listener whose `backend_port` is the VIP's port.
        listener: usize,
        /// The listener that VIP:port is (load balancer, listener).
        target: (usize, usize),
    },
    /// A TCP listener whose VIP:port is `admin.listen` (it could not bind,
    /// or would take the admin API's place), or a backend whose nodeport
    /// is (clients of the VIP would reach the admin API).
    Admin {
        /// The load balancer.
        lb: usize,
        /// The listener.
        listener: usize,
        /// `None`: the listener's VIP:port; `Some`: this backend's nodeport.
        backend: Option<IpAddr>,
    },
}

impl Conflict {
    /// The load balancers that break the rule and must go for the others
    /// to stand: both of two on one VIP:port (neither can be chosen
    /// whatever the order), the one whose backend is a VIP:port or
    /// `admin.listen`, the second of one name.
    pub fn offenders(&self) -> Vec<usize> {
        match *self {
            Conflict::Name { first, again } => vec![first, again],
            Conflict::Address { first, again, .. } => vec![first.0, again.0],
            Conflict::Loop { lb, .. } | Conflict::Admin { lb, .. } => vec![lb],
        }
    }
}

/// Whether a TCP connection to `addr` reaches the admin listener at `admin`
/// on this host, whose own addresses include `vips`: the same address, or
/// any of this host's where the admin listener binds the wildcard.
fn reaches_admin(addr: SocketAddr, admin: SocketAddr, vips: &HashSet<IpAddr>) -> bool {
    if addr.port() != admin.port() {
        return false;
    }
    let ip = addr.ip().to_canonical();
    let admin_ip = admin.ip().to_canonical();
    if ip == admin_ip {
        return true;
    }
    // `0.0.0.0` takes IPv4 only; `::` takes both on Linux's default
    // (`net.ipv6.bindv6only = 0`).
    let wildcard = match admin_ip {
        IpAddr::V4(a) => a.is_unspecified() && ip.is_ipv4(),
        IpAddr::V6(a) => a.is_unspecified(),
    };
    wildcard && (ip.is_loopback() || vips.contains(&ip))
}

/// Every conflict among the load balancers of one file. `names[i]` and
/// `specs[i]` are the file's `load_balancer[i]`: its name if it has a valid
/// one, its spec if it could be built.
///
/// A valid file costs one map insert per load balancer and listener and one
/// lookup per backend and listener.
pub(super) fn conflicts(
    admin: SocketAddr,
    names: &[Option<&str>],
    specs: &[Option<&LoadBalancerSpec>],
) -> Vec<Conflict> {
    let mut found = Vec::new();
    let mut first_named: HashMap<&str, usize> = HashMap::with_capacity(names.len());
    for (i, name) in names.iter().enumerate() {
        if let Some(name) = name
            && let Some(&first) = first_named.get(name)
        {
            found.push(Conflict::Name { first, again: i });
        } else if let Some(name) = name {
            first_named.insert(name, i);
        }
    }
    // One TCP and one UDP listener may share a VIP:port (DNS on 53/tcp and 53/udp).
    let mut addresses: HashMap<ListenerKey, (usize, usize)> = HashMap::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        let Some(spec) = spec else { continue };
        if spec.vip.is_unspecified() {
            // Leased later (`ipam = "dhcp"`): no address to collide on yet.
            continue;
        }
        for (k, l) in spec.listeners.iter().enumerate() {
            let addr = spec.listen_addr(l);
            match addresses.get(&spec.listener_key(l)) {
                Some(&first) => found.push(Conflict::Address {
                    addr,
                    protocol: l.protocol,
                    first,
                    again: (i, k),
                }),
                None => {
                    addresses.insert(spec.listener_key(l), (i, k));
                }
            }
        }
    }
    // Only now is every VIP:port of the file known.
    for (i, spec) in specs.iter().enumerate() {
        let Some(spec) = spec else { continue };
        for &backend in &spec.backends {
            for (k, l) in spec.listeners.iter().enumerate() {
                // A backend's nodeport that is one of this file's listeners.
                let nodeport = ListenerKey {
                    addr: SocketAddr::new(backend, l.backend_port),
                    protocol: l.protocol,
                };
                let Some(&target) = addresses.get(&nodeport) else {
                    continue;
                };
                if spec.listeners[..k]
                    .iter()
                    .any(|e| e.backend_port == l.backend_port && e.protocol == l.protocol)
                {
                    continue; // Two listeners with one nodeport: one problem.
                }
                found.push(Conflict::Loop {
                    lb: i,
                    backend,
                    listener: k,
                    target,
                });
            }
        }
    }
    let vips: HashSet<IpAddr> = specs
        .iter()
        .flatten()
        .map(|s| s.vip)
        .filter(|v| !v.is_unspecified())
        .collect();
    for (i, spec) in specs.iter().enumerate() {
        let Some(spec) = spec else { continue };
        for (k, l) in spec.listeners.iter().enumerate() {
            if l.protocol != Protocol::Tcp {
                continue;
            }
            if !spec.vip.is_unspecified() && reaches_admin(spec.listen_addr(l), admin, &vips) {
                found.push(Conflict::Admin {
                    lb: i,
                    listener: k,
                    backend: None,
                });
            }
            if spec.listeners[..k]
                .iter()
                .any(|e| e.backend_port == l.backend_port && e.protocol == l.protocol)
            {
                continue; // Two listeners with one nodeport: one problem.
            }
            for &backend in &spec.backends {
                if reaches_admin(SocketAddr::new(backend, l.backend_port), admin, &vips) {
                    found.push(Conflict::Admin {
                        lb: i,
                        listener: k,
                        backend: Some(backend),
                    });
                }
            }
        }
    }
    found
}

impl Validator<'_> {
    /// Reports each conflict at its place in `file`.
    pub(super) fn report_conflicts(
        &mut self,
        admin: SocketAddr,
        file: &FileConfig,
        specs: &[Option<LoadBalancerSpec>],
        conflicts: Vec<Conflict>,
    ) {
        let spec = |i: usize| specs[i].as_ref().expect("a conflict names built specs");
        let file_lb = |i: usize| file.load_balancers[i].get_ref();
        // The listener's index in the file (the spec skips invalid ones).
        let file_listener = |i: usize, k: usize| {
            let name = &spec(i).listeners[k].name;
            file_lb(i)
                .listeners
                .iter()
                .position(|fl| fl.get_ref().name.as_ref().map(|n| n.get_ref()) == Some(name))
                .unwrap_or(k)
        };
        let listener_name =
            |(i, k): (usize, usize)| format!("{}/{}", spec(i).name, spec(i).listeners[k].name);
        for conflict in conflicts {
            match conflict {
                Conflict::Name { first, again: i } => {
                    let (Some(first), Some(name)) = (&file_lb(first).name, &file_lb(i).name) else {
                        continue;
                    };
                    let first_line = self.lines.line(first.span().start);
                    self.problem(
                        Some(name.span()),
                        &format!("load_balancer[{i}].name"),
                        format!(
                            "duplicate load balancer name {:?} (first used on line {first_line}); names must be unique",
                            name.get_ref()
                        ),
                    );
                }
                Conflict::Address {
                    addr,
                    protocol,
                    first,
                    again,
                } => {
                    let (i, k) = (again.0, file_listener(again.0, again.1));
                    self.problem(
                        file_lb(i)
                            .listeners
                            .get(k)
                            .and_then(|l| l.get_ref().port.as_ref())
                            .map(|p| p.span()),
                        &format!("load_balancer[{i}].listener[{k}].port"),
                        format!(
                            "{addr}/{protocol} is already a listener of load balancer {:?}; one VIP:port can serve one TCP and one UDP listener",
                            listener_name(first)
                        ),
                    );
                }
                Conflict::Admin {
                    lb: i,
                    listener,
                    backend: None,
                } => {
                    let k = file_listener(i, listener);
                    let l = &spec(i).listeners[listener];
                    self.problem(
                        file_lb(i)
                            .listeners
                            .get(k)
                            .and_then(|l| l.get_ref().port.as_ref())
                            .map(|p| p.span()),
                        &format!("load_balancer[{i}].listener[{k}].port"),
                        format!(
                            "{} is admin.listen ({admin}): the listener could not bind there, or would answer in the admin API's place; give the admin API another address or port",
                            spec(i).listen_addr(l)
                        ),
                    );
                }
                Conflict::Admin {
                    lb: i,
                    listener,
                    backend: Some(backend),
                } => {
                    let (j, span) = written_backend(file_lb(i), backend);
                    let backend_port = spec(i).listeners[listener].backend_port;
                    self.problem(
                        span,
                        &format!("load_balancer[{i}].backends[{j}]"),
                        format!(
                            "backend {backend} on load_balancer[{i}].listener[{}].backend_port {backend_port} reaches admin.listen ({admin}): clients of the VIP would be forwarded to this daemon's admin API; a backend must be a node",
                            file_listener(i, listener),
                        ),
                    );
                }
                Conflict::Loop {
                    lb: i,
                    backend,
                    listener,
                    target,
                } => {
                    let (j, span) = written_backend(file_lb(i), backend);
                    let backend_port = spec(i).listeners[listener].backend_port;
                    self.problem(
                        span,
                        &format!("load_balancer[{i}].backends[{j}]"),
                        format!(
                            "backend {backend} on load_balancer[{i}].listener[{}].backend_port {backend_port} is {}, the VIP:port of load_balancer[{}].listener[{}] ({:?}): the daemon would forward to itself, and one client connection would loop through it until proxy.max_connections is used up; a backend must be a node, not a VIP:port of this daemon",
                            file_listener(i, listener),
                            SocketAddr::new(backend, backend_port),
                            target.0,
                            file_listener(target.0, target.1),
                            listener_name(target)
                        ),
                    );
                }
            }
        }
    }
}

/// The first entry of `lb.backends` that is `backend`, however written,
/// and where it is.
fn written_backend(lb: &FileLoadBalancer, backend: IpAddr) -> (usize, Option<Range<usize>>) {
    lb.backends
        .iter()
        .enumerate()
        .find(|(_, b)| {
            b.get_ref().parse::<IpAddr>().ok().map(|a| a.to_canonical()) == Some(backend)
        })
        .map_or((0, None), |(j, b)| (j, Some(b.span())))
}

//! Readiness of some VIPs (`/readyz?vip=…`) or of one VRRP instance of
//! the keepalived file the daemon renders (`/readyz?vrrp_instance=VRID`):
//! what a front end that moves addresses between hosts (keepalived's track
//! script) asks, so that one tenant's listener that cannot bind moves the
//! VIPs of its instance alone, not every VIP of the host. The instance's
//! VIPs are the ones `host::vmnet::keepalived` renders into it, computed from the
//! same config in force by the same placement: the question stays one
//! short line however many VIPs the instance carries.
//!
//! A VIP none of whose backends is eligible here is ready by default: its
//! listeners are bound and this host answers for it (a client is refused,
//! not left waiting on an address no host holds). Asked with
//! `require=backend` ([`BackendRequirement::Eligible`]), such a VIP is not
//! ready, by the rule announcing withdraws a VIP by (a listener bound with
//! an eligible backend), so keepalived moves it to a host whose backends
//! answer; `keepalived.ready_requires_backend` puts that in the rendered
//! track scripts. docs/design.md, "The all-backends-down decision for a
//! moved VIP", says why the default is the other one.

use std::net::{IpAddr, SocketAddr};

use super::{Daemon, ListenerEntry, State};
use crate::config::Protocol;
use crate::host::vmnet::keepalived;

/// Why a VIP is not ready to take traffic here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VipNotReady {
    /// No load balancer of the config in force has this VIP (a leased VIP
    /// counts once its lease is in force). Not a readiness failure of the
    /// host: the question names something that is not here.
    #[error(
        "no load balancer of the config in force has VIP {0}; ask about a load balancer's `vip` (a leased one once its lease is in force)"
    )]
    Unknown(IpAddr),
    /// The keepalived file rendered from the config in force has no
    /// instance with this VRID (no `[keepalived]`, or no VIP of a load
    /// balancer on a `[[network]]` falls in it). Not a readiness failure of
    /// the host, as [`VipNotReady::Unknown`].
    #[error(
        "the config in force renders no VRRP instance hlb_{0} (virtual_router_id {0}): no [keepalived], or no VIP keepalived moves (on a [[network]], or a management VIP) is in it; ask about an instance of the rendered keepalived.conf"
    )]
    UnknownInstance(u32),
    /// Shutdown has begun: every VIP should leave the host while open
    /// connections drain.
    #[error("stopping")]
    Stopping,
    /// No config has been applied yet.
    #[error("no config applied yet")]
    NoConfig,
    /// Listeners of the VIP that are not bound, each with why.
    #[error("{} listener(s) not bound", .0.len())]
    Unbound(Vec<UnboundListener>),
    /// Asked with [`BackendRequirement::Eligible`]: no listener of the VIP
    /// is bound with an eligible backend here.
    #[error(
        "VIP {vip} has no listener bound with an eligible backend here (load balancer(s) {}): every backend is down, drained or unreachable from this host; /status shows each backend's state and last check",
        .load_balancers.join(", ")
    )]
    NoEligibleBackend {
        /// The VIP asked about.
        vip: IpAddr,
        /// Its load balancers (`<namespace>/<service>`).
        load_balancers: Vec<String>,
    },
    /// The VIP is on an isolated `[[network]]` and the VM-network guard
    /// is not in force: holding the VIP, this host would route for the
    /// network's VMs into every other network. keepalived moves the VIP to
    /// a host whose guard is in force.
    #[error(
        "VIP {vip} is on network {network:?} (interface {interface:?}), whose VM-network guard (nftables table inet harvester_lb_vmnet) is not in force here; /status vm_network_guard says why"
    )]
    Unguarded {
        /// The VIP asked about.
        vip: IpAddr,
        /// Its `[[network]]`.
        network: String,
        /// The network's interface.
        interface: String,
    },
}

/// What `/readyz?vip=` and `?vrrp_instance=` require of a VIP beyond its
/// listeners being bound (the query's `require=backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum BackendRequirement {
    /// Bound listeners are enough: a VIP whose backends are all down here
    /// stays ready (the default: when every host sees them down, as when
    /// the service itself is down, keepalived would otherwise take the VIP
    /// off every host and clients would wait on an address no one holds
    /// instead of being refused at once).
    #[default]
    Bound,
    /// Also at least one listener of the VIP bound with an eligible
    /// backend (healthy, not drained), the rule announcing withdraws a
    /// route by: for sites where a backend can be unreachable from one
    /// host only (its VM-network link down), so keepalived moves the VIP
    /// to a host whose backends answer.
    Eligible,
}

/// A listener of a VIP that is not serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnboundListener {
    /// Its load balancer (`<namespace>/<service>`).
    pub load_balancer: String,
    /// The listener's name.
    pub listener: String,
    /// VIP:port.
    pub address: SocketAddr,
    /// `tcp` or `udp`.
    pub protocol: Protocol,
    /// What the bind said.
    pub error: String,
}

impl std::fmt::Display for UnboundListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "listener {}/{} ({} listener {:?}): {}",
            self.address, self.protocol, self.load_balancer, self.listener, self.error
        )
    }
}

impl Daemon {
    /// Whether every one of `vips` is ready here: the daemon is not
    /// stopping, a config is in force, and every listener of every load
    /// balancer on those VIPs is bound, and the VM-network guard is in
    /// force for the isolated networks they are on, and, as `require`
    /// says, some listener of each has an eligible backend. Other VIPs'
    /// listeners do not count: [`Daemon::is_ready`] is the host-wide
    /// question.
    pub fn vips_ready(
        &self,
        vips: &[IpAddr],
        require: BackendRequirement,
    ) -> Result<(), VipNotReady> {
        self.vips_ready_in(&self.lock(), vips, require)
    }

    /// Whether the VIPs of the VRRP instance whose `virtual_router_id` is
    /// `vrid` are ready here, as [`Daemon::vips_ready`] answers for them:
    /// the instance's VIPs are those `host::vmnet::keepalived::render` puts in it
    /// from the config in force ([`keepalived::instance_vips`]), read under
    /// the same lock as the listeners.
    pub fn instance_ready(
        &self,
        vrid: u32,
        require: BackendRequirement,
    ) -> Result<(), VipNotReady> {
        let st = self.lock();
        let Some(config) = &st.config else {
            return self.vips_ready_in(&st, &[], require);
        };
        let vips = keepalived::instance_vips(config, vrid);
        if vips.is_empty() {
            return Err(VipNotReady::UnknownInstance(vrid));
        }
        self.vips_ready_in(&st, &vips, require)
    }

    fn vips_ready_in(
        &self,
        st: &State,
        vips: &[IpAddr],
        require: BackendRequirement,
    ) -> Result<(), VipNotReady> {
        let Some(config) = &st.config else {
            return Err(if self.is_stopping() {
                VipNotReady::Stopping
            } else {
                VipNotReady::NoConfig
            });
        };
        let mut unbound = Vec::new();
        let mut unguarded = None;
        let mut no_backend = None;
        for vip in vips {
            let vip = vip.to_canonical();
            let mut known = false;
            // A listener bound with an eligible backend (announcing's rule).
            let mut serving = false;
            let mut names = Vec::new();
            for spec in config.load_balancers.iter().filter(|l| l.vip == vip) {
                known = true;
                names.push(spec.name.clone());
                if require == BackendRequirement::Eligible
                    && !serving
                    && let Some(entry) = st.load_balancers.get(&spec.name)
                {
                    let snapshot = entry.lb.snapshot();
                    serving = spec.listeners.iter().any(|l| {
                        st.listeners
                            .get(&spec.listener_key(l))
                            .is_some_and(|e| e.socket.is_ok())
                            && !snapshot.eligible_for(l.backend_port).is_empty()
                    });
                }
                if let Some(net) = config
                    .networks
                    .iter()
                    .find(|n| spec.network.as_deref() == Some(n.name.as_str()))
                    .filter(|n| n.isolate && !self.vmnet.guard.guards(&n.interface))
                {
                    unguarded.get_or_insert(VipNotReady::Unguarded {
                        vip,
                        network: net.name.clone(),
                        interface: net.interface.clone(),
                    });
                }
                for l in &spec.listeners {
                    let address = spec.listen_addr(l);
                    let error = match st.listeners.get(&spec.listener_key(l)) {
                        Some(ListenerEntry { socket: Ok(_), .. }) => continue,
                        Some(ListenerEntry { socket: Err(e), .. }) => e.to_string(),
                        None => "not started".to_string(),
                    };
                    unbound.push(UnboundListener {
                        load_balancer: spec.name.clone(),
                        listener: l.name.clone(),
                        address,
                        protocol: l.protocol,
                        error,
                    });
                }
            }
            if !known {
                return Err(VipNotReady::Unknown(vip));
            }
            if require == BackendRequirement::Eligible && !serving {
                no_backend.get_or_insert(VipNotReady::NoEligibleBackend {
                    vip,
                    load_balancers: names,
                });
            }
        }
        if self.is_stopping() {
            Err(VipNotReady::Stopping)
        } else if let Some(e) = unguarded {
            Err(e)
        } else if !unbound.is_empty() {
            Err(VipNotReady::Unbound(unbound))
        } else if let Some(e) = no_backend {
            Err(e)
        } else {
            Ok(())
        }
    }
}

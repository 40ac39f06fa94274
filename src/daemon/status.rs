//! `/status`: the whole picture an on-call engineer needs, built from the
//! live state under one lock.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::time::SystemTime;

use serde::Serialize;

use super::{Daemon, LbEntry, State};
use crate::config::{
    CheckKind, DhcpSpec, Forwarding, ListenerSpec, LoadBalancerSpec, Protocol, ProxyProtocol,
};
use crate::dataplane::balancer::{AdminState, Backend, Snapshot};
use crate::dataplane::health::Health;
use crate::dataplane::health::prober::{TargetKey, TargetStatus};
use crate::host::announce::announcer::{AnnounceStatus, LbAnnounceStatus};
use crate::host::isolation::IsolationStatus;

impl Daemon {
    /// The JSON document served at `/status`.
    pub fn status(&self) -> StatusDoc {
        let announce = self.announcer.status();
        let kernel_connections = self.kernel_connections_per_backend();
        let st = self.lock();
        let specs = st
            .config
            .as_ref()
            .map(|c| c.load_balancers.as_slice())
            .unwrap_or(&[]);
        let load_balancers = specs
            .iter()
            .filter_map(|spec| {
                let entry = st.load_balancers.get(&spec.name)?;
                Some(self.load_balancer_status(
                    &st,
                    spec,
                    entry,
                    announce.as_ref(),
                    &kernel_connections,
                ))
            })
            .collect();
        let missing_since_unix = st.file_missing_since.map(|t| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        });
        let started_unix = crate::os::process_stats().map(|p| p.start_time_seconds);
        let now_unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        StatusDoc {
            ready: !self.is_stopping()
                && st.config.is_some()
                && st.listeners.values().all(|e| e.socket.is_ok()),
            version: crate::VERSION,
            commit: crate::COMMIT,
            started_unix,
            uptime_seconds: started_unix.map(|s| (now_unix - s).max(0.0)),
            load_balancers,
            config: {
                let record = self.record_status();
                let rejected = record.rejected.as_ref().map(|r| {
                    format!(
                        "the last reload was rejected ({} problem{}, see rejected_reload); the config read before stays in force",
                        r.problems.len(),
                        if r.problems.len() == 1 { "" } else { "s" }
                    )
                });
                let missing = missing_since_unix.map(|_| {
                    "the file is missing (deleted or renamed away); the config read before stays in force until it reappears".to_string()
                });
                ConfigStatus {
                    path: st.file.as_ref().map(|p| p.display().to_string()),
                    problem: missing.or(rejected),
                    missing_since_unix,
                    sha256: record.sha256,
                    rejected_reload: record.rejected,
                    needs_restart: record.needs_restart,
                }
            },
            vip_isolation: self.isolation.status(),
            vm_network_guard: self.vmnet.guard.status(),
            reply_marks: self
                .vmnet
                .reply_marks
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            network_legs: self
                .vmnet
                .legs
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            management_leg: self.mgmt_leg_seen().map(|m| (*m).clone()),
            announce,
            vip_refused: self.vip_guard.refusals(),
            network_refused: self.network_guard.refusals(),
            conntrack_sync: self.sync.status(),
            management_check: self
                .vmnet
                .mgmt_check
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .clone(),
            state_file: self.state_file_status(),
            restart: RestartStatus {
                fd_store: self.fd_store().is_on(),
                stored_fds: self.fd_store().stored_fds(),
                adopted_listening_sockets: self.metrics.hand_over().adopted(),
                last_hand_over: self.metrics.hand_over().last(),
                announced_seconds_ago: self.restart_announced().map(|d| d.as_secs_f64()),
            },
            host_adoption: crate::host::owned::adopt::adoption(),
        }
    }

    /// One load balancer's entry of `/status`: its spec as configured, and
    /// its listeners, backends and lease as they are now.
    fn load_balancer_status(
        &self,
        st: &State,
        spec: &LoadBalancerSpec,
        entry: &LbEntry,
        announce: Option<&AnnounceStatus>,
        kernel_connections: &KernelConnections,
    ) -> LoadBalancerStatus {
        let snapshot = entry.lb.snapshot();
        let udp_flows = udp_flows_per_backend(st, spec);
        LoadBalancerStatus {
            name: spec.name.clone(),
            cluster: spec.cluster.clone(),
            vip: spec.vip,
            ipam: spec.ipam.as_str(),
            algorithm: spec.algorithm.as_str(),
            health_check: spec.health_check.is_some(),
            health_check_port: spec.health_check.as_ref().and_then(|hc| hc.port),
            health_check_per_listener: spec
                .health_check
                .as_ref()
                .is_some_and(|hc| hc.port.is_none()),
            health_check_kind: spec.health_check.as_ref().map(|hc| match hc.check {
                CheckKind::TcpConnect => "tcp",
                CheckKind::Http(_) => "http",
            }),
            session_affinity: if spec.affinity_timeout.is_some() {
                "client_ip"
            } else {
                "none"
            },
            affinity_entries: spec
                .affinity_timeout
                .and(entry.lb.affinity())
                .map(|table| table.len()),
            source_ranges: spec
                .source_ranges
                .ranges()
                .iter()
                .map(|n| n.to_string())
                .collect(),
            eligible_backends: snapshot.eligible.len(),
            dhcp: spec.dhcp.as_ref().map(|d| self.lease_status(spec, d)),
            announce: announce.and_then(|a| a.for_vip(spec.vip)),
            listeners: spec
                .listeners
                .iter()
                .map(|l| self.listener_status(st, spec, l, &snapshot))
                .collect(),
            backends: spec
                .backends
                .iter()
                .map(|ip| {
                    let kernel = kernel_connections
                        .get(spec.name.as_str())
                        .and_then(|m| m.get(ip))
                        .copied();
                    self.backend_status(spec, &entry.backends[ip], *ip, udp_flows.as_ref(), kernel)
                })
                .collect(),
        }
    }

    /// Listener `l` of load balancer `spec`: its socket's state, what it
    /// holds open, and which forwarding path serves it.
    fn listener_status(
        &self,
        st: &State,
        spec: &LoadBalancerSpec,
        l: &ListenerSpec,
        snapshot: &Snapshot,
    ) -> ListenerStatus {
        let le = st.listeners.get(&spec.listener_key(l));
        let open = le
            .and_then(|e| e.socket.as_ref().ok())
            .map_or(0, |s| s.open_connections());
        let kernel = l.forwarding == Forwarding::Kernel;
        let id = (spec.vip, l.protocol, l.port);
        // What the last check of the kernel's tables found broken of it.
        let impaired = kernel.then(|| self.kernel.impaired(&id)).flatten();
        ListenerStatus {
            name: l.name.clone(),
            address: spec.listen_addr(l),
            backend_port: l.backend_port,
            protocol: l.protocol.as_str(),
            proxy_protocol: l.proxy_protocol.map(ProxyProtocol::as_str),
            state: match le.map(|e| &e.socket) {
                Some(Ok(_)) => "listening",
                None if spec.vip.is_unspecified() => "waiting_for_lease",
                _ => "failed",
            },
            error: le.and_then(|e| e.socket.as_ref().err().map(ToString::to_string)),
            active_connections: if l.protocol == Protocol::Tcp { open } else { 0 },
            active_flows: (l.protocol == Protocol::Udp).then_some(open),
            eligible_backends: snapshot.eligible_for(l.backend_port).len(),
            forwarding: if impaired.is_some() {
                "repairing"
            } else if kernel && self.kernel.forwards(&id) {
                Forwarding::Kernel.as_str()
            } else {
                Forwarding::Proxy.as_str()
            },
            kernel_error: kernel
                .then(|| {
                    self.kernel
                        .refusal(&spec.name)
                        .map(|r| r.to_string())
                        .or_else(|| self.kernel.error())
                        .or_else(|| {
                            impaired.map(|why| {
                                format!("the kernel's NAT tables are not as this daemon wrote them ({why}): being written again")
                            })
                        })
                        .or_else(|| self.forwarding_blocked(spec.vip))
                        .or_else(|| {
                            st.config.as_ref().and_then(|c| {
                                self.bridge_stage_blocked(spec, c)
                            })
                        })
                })
                .flatten(),
        }
    }

    /// Backend `ip` of load balancer `spec`: its health, admin state and
    /// load, with its probe and, under per-listener checks, each port's.
    fn backend_status(
        &self,
        spec: &LoadBalancerSpec,
        b: &Backend,
        ip: IpAddr,
        udp_flows: Option<&HashMap<IpAddr, usize>>,
        kernel_connections: Option<u64>,
    ) -> BackendStatus {
        let ports = b
            .checked_ports()
            .into_iter()
            .map(|port| PortStatus {
                backend_port: port,
                listeners: spec
                    .listeners
                    .iter()
                    .filter(|l| l.backend_port == port)
                    .map(|l| l.name.clone())
                    .collect(),
                health: health_of(b.is_healthy_on(port)),
                eligible: b.is_eligible_on(port),
                probe: self
                    .prober
                    .get(&TargetKey::new(&spec.name, ip, Some(port)))
                    .map(|t| t.status()),
            })
            .collect();
        BackendStatus {
            address: ip,
            health: health_of(b.is_healthy()),
            admin_state: b.admin_state(),
            eligible: b.is_eligible(),
            active_connections: b.active_connections(),
            active_flows: udp_flows.map(|m| m.get(&ip).copied().unwrap_or(0)),
            probe: self
                .prober
                .get(&TargetKey::new(&spec.name, ip, None))
                .map(|t| t.status()),
            ports,
            totals: BackendTotals::of(b, kernel_connections),
        }
    }

    /// The kernel's new-connection counts (its named counters, read every
    /// 5 s for `/metrics`), summed per load balancer and backend over its
    /// kernel listeners.
    fn kernel_connections_per_backend(&self) -> KernelConnections {
        let counts = self
            .metrics
            .kernel_backends
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let mut out = KernelConnections::new();
        for k in counts {
            *out.entry(k.load_balancer)
                .or_default()
                .entry(k.backend)
                .or_insert(0) += k.connections;
        }
        out
    }

    /// The DHCP lease of load balancer `spec` (`ipam = "dhcp"`), `init`
    /// until the client has one.
    fn lease_status(&self, spec: &LoadBalancerSpec, d: &DhcpSpec) -> LeaseStatus {
        let lease = self.leases.stats(&spec.name);
        LeaseStatus {
            interface: self.leases.interface(&spec.name).unwrap_or_default(),
            parent: d.interface.clone(),
            mac: crate::host::dhcp::state::colons(d.mac),
            hostname: d.hostname.clone(),
            state: lease.as_ref().map_or("init", |l| l.phase_name()),
            address: lease.as_ref().and_then(|l| l.address()),
            server: lease.as_ref().and_then(|l| l.server()),
            expires_unix: lease.as_ref().and_then(|l| l.expiry_unix()),
            renew_at_unix: lease.as_ref().and_then(|l| l.renew_at_unix()),
            leases_acquired: lease.as_ref().map_or(0, |l| l.acquired.get()),
            renewals: lease.as_ref().map_or(0, |l| l.renewals.get()),
            naks: lease.as_ref().map_or(0, |l| l.naks.get()),
            address_changes: lease.as_ref().map_or(0, |l| l.address_changes.get()),
            offers_refused: lease
                .as_ref()
                .map_or(0, |l| l.refused.iter().map(|c| c.get()).sum()),
            repairs: lease.as_ref().map_or(0, |l| l.repairs.get()),
            error: lease.as_ref().and_then(|l| l.host_error()),
            last_refusal: lease.as_ref().and_then(|l| l.last_refusal()),
        }
    }
}

/// New connections the kernel forwarded, by load balancer name and backend.
type KernelConnections = HashMap<String, HashMap<IpAddr, u64>>;

/// UDP flows per backend over all UDP listeners of load balancer `spec`;
/// `None` when it has no UDP listener (so `/status` leaves the field out).
fn udp_flows_per_backend(st: &State, spec: &LoadBalancerSpec) -> Option<HashMap<IpAddr, usize>> {
    let mut udp_flows: Option<HashMap<IpAddr, usize>> = None;
    for l in spec
        .listeners
        .iter()
        .filter(|l| l.protocol == Protocol::Udp)
    {
        let counts = udp_flows.get_or_insert_with(HashMap::new);
        if let Some(Ok(running)) = st.listeners.get(&spec.listener_key(l)).map(|e| &e.socket) {
            for (ip, s) in running.route().stats.udp().backends() {
                *counts.entry(ip).or_insert(0) +=
                    usize::try_from(s.flows_active.get()).unwrap_or(0);
            }
        }
    }
    udp_flows
}

/// `/status`: the whole picture an on-call engineer needs.
#[derive(Debug, Serialize)]
pub struct StatusDoc {
    /// Same as `/readyz`.
    pub ready: bool,
    /// This build's version, as `--version` says it.
    pub version: &'static str,
    /// The commit it was built from ("unknown" when built outside git):
    /// which build runs on a host, without a shell on it.
    pub commit: &'static str,
    /// When this process started, Unix seconds (a restart's hand-over
    /// starts a new one); `null` when `/proc` cannot be read.
    pub started_unix: Option<f64>,
    /// Seconds since then.
    pub uptime_seconds: Option<f64>,
    /// Every load balancer in config order.
    pub load_balancers: Vec<LoadBalancerStatus>,
    /// The config file, and what is wrong with it while the daemon runs on
    /// what it read before.
    pub config: ConfigStatus,
    /// `vip.isolate`: whether the table is in force, and how large.
    pub vip_isolation: IsolationStatus,
    /// `[[network]] isolate`: whether the VM-network guard table is in
    /// force, for which interfaces, and the last failure.
    pub vm_network_guard: crate::host::vmnet::vmnet_filter::GuardStatus,
    /// Kernel listeners on VM networks: the reply-mark table and `fwmark`
    /// rules the kernel held at the last read-back, and the last failure.
    pub reply_marks: crate::host::vmnet::replymark::ReplyMarkStatus,
    /// Each bridged VM network's leg (`host::vmnet::leg`: the macvlan its kernel
    /// listeners' flows are routed out of), by the network's name, as last
    /// read back: its name, MAC, state and why it is not in place; only the
    /// networks that need one (a bridge, a kernel listener).
    pub network_legs: std::collections::BTreeMap<String, crate::host::vmnet::leg::LegStatus>,
    /// The management VIPs' leg on the bridge of `keepalived.interface`
    /// (`host::vmnet::mgmt_leg`), its table's routes and whether it is in place, as
    /// last read back; absent while no management VIP needs it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub management_leg: Option<crate::host::vmnet::mgmt_leg::MgmtLegStatus>,
    /// `vip.announce = "routes"`: every VIP, announced or not and why;
    /// absent with `none`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub announce: Option<AnnounceStatus>,
    /// Load balancers refused at the last apply: their VIP is the host's
    /// own address, the gateway of one of its routes, or outside
    /// `vip.announce_prefixes`. They are not served, isolated or announced.
    pub vip_refused: Vec<super::VipRefusal>,
    /// `[[network]]`s refused at the last apply: their interface is no VM
    /// network's on this host (its kind, the management address, the
    /// host's routes), with their load balancers, which are not served,
    /// isolated, routed or put in keepalived's file.
    pub network_refused: Vec<super::NetworkRefusal>,
    /// `[conntrackd]`: conntrackd's caches, each VRRP instance's last
    /// transition and commit, and its gate; absent without it.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrack_sync: Option<super::SyncStatus>,
    /// `[keepalived]`: what the management-reachability check pings (the
    /// gateway and where it came from, the peers), why it may fail the
    /// last host alive (`problem`), and this host's
    /// `nf_conntrack_tcp_be_liberal` (`host::vmnet::mgmt_check`).
    pub management_check: Option<crate::host::vmnet::mgmt_check::Discovered>,
    /// The state kept across restarts: the file, what start restored from
    /// it or why it was ignored, and the last write.
    pub state_file: super::StateFileStatus,
    /// The restart (issue 41): systemd's file descriptor store, what this
    /// process adopted from it, what the last process handed over, and a
    /// restart announced by `prepare-stop` and waiting for its SIGTERM.
    pub restart: RestartStatus,
    /// Whether this process started after a hand-over, and how many of
    /// the tables the previous process left it adopted as they were or
    /// wrote again (issue 41).
    pub host_adoption: crate::host::owned::adopt::Adoption,
}

/// `/status` `restart`.
#[derive(Debug, Serialize)]
pub struct RestartStatus {
    /// Whether the daemon runs with a file descriptor store
    /// (`$NOTIFY_SOCKET` set): without one a restart refuses clients for a
    /// moment and drains.
    pub fd_store: bool,
    /// Descriptors this process keeps in the store now.
    pub stored_fds: usize,
    /// Listening sockets taken from the store at start (0: bound anew).
    pub adopted_listening_sockets: u64,
    /// What the last process handed over and the restart's window; `null`
    /// when this process did not start from a hand-over.
    pub last_hand_over: Option<crate::metrics::hand_over::LastHandOver>,
    /// Seconds since `prepare-stop --restart` announced a restart not yet
    /// done; `null` when none is waiting.
    pub announced_seconds_ago: Option<f64>,
}

/// The config file in `/status`: an on-call engineer must see that the
/// daemon serves a config whose file is gone, which nothing else shows.
#[derive(Debug, Serialize)]
pub struct ConfigStatus {
    /// The file's path (absent for a daemon started without one).
    pub path: Option<String>,
    /// What is wrong with the file now; `null` when nothing is.
    pub problem: Option<String>,
    /// Since when the file is missing, Unix seconds; `null` while it exists.
    pub missing_since_unix: Option<f64>,
    /// The SHA-256 of the file in force, as read (compare with `sha256sum`).
    pub sha256: Option<String>,
    /// The last reload rejected since the last good one: when, how asked,
    /// the rejected file's SHA-256 and every problem; `null` when the last
    /// reload succeeded.
    pub rejected_reload: Option<super::RejectedReload>,
    /// Keys the config in force changed that only a restart applies
    /// (`admin.listen`, `admin.socket`, `daemon.state_file`).
    pub needs_restart: Vec<&'static str>,
}

/// One load balancer in `/status`.
#[derive(Debug, Serialize)]
pub struct LoadBalancerStatus {
    /// `<namespace>/<service>`.
    pub name: String,
    /// Owning guest cluster.
    pub cluster: String,
    /// The VIP.
    pub vip: IpAddr,
    /// `pool` or `dhcp`.
    pub ipam: &'static str,
    /// Picking algorithm.
    pub algorithm: &'static str,
    /// Whether backends are health checked.
    pub health_check: bool,
    /// The port probed on every backend for all listeners (one verdict per
    /// backend), when the check names one.
    pub health_check_port: Option<u16>,
    /// Whether each listener's `backend_port` is checked and judged on its
    /// own (a check without `port`): see each backend's `ports`.
    pub health_check_per_listener: bool,
    /// `tcp` or `http`, when they are.
    pub health_check_kind: Option<&'static str>,
    /// `none` or `client_ip`.
    pub session_affinity: &'static str,
    /// Clients remembered, with `client_ip` affinity.
    pub affinity_entries: Option<usize>,
    /// The clients served (`source_ranges`, normalised); absent: everyone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<String>,
    /// Backends taking new connections now (with per-listener checks, on
    /// at least one listener; each listener has its own count).
    pub eligible_backends: usize,
    /// `vip.announce = "routes"`: whether this host announces the VIP, and
    /// why not (the same for every load balancer on the VIP).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub announce: Option<LbAnnounceStatus>,
    /// The VIP's DHCP lease (`ipam = "dhcp"` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<LeaseStatus>,
    /// Listeners.
    pub listeners: Vec<ListenerStatus>,
    /// Backends.
    pub backends: Vec<BackendStatus>,
}

/// A DHCP lease in `/status`: what an on-call engineer needs to tell a
/// VIP that is not leased yet from one that is lost or about to expire.
#[derive(Debug, Serialize)]
pub struct LeaseStatus {
    /// The macvlan interface the lease is held on.
    pub interface: String,
    /// The host interface it is made on.
    pub parent: String,
    /// The client's MAC address.
    pub mac: String,
    /// The hostname option sent.
    pub hostname: String,
    /// `init`, `selecting`, `requesting`, `rebooting`, `bound`, `renewing`
    /// or `rebinding`.
    pub state: &'static str,
    /// The leased address (the VIP); `null` without a lease.
    pub address: Option<std::net::Ipv4Addr>,
    /// The server that leased it.
    pub server: Option<std::net::Ipv4Addr>,
    /// When the lease expires unless renewed, Unix seconds.
    pub expires_unix: Option<f64>,
    /// When it is renewed (T1), Unix seconds.
    pub renew_at_unix: Option<f64>,
    /// Leases obtained.
    pub leases_acquired: u64,
    /// Leases extended.
    pub renewals: u64,
    /// NAKs taken.
    pub naks: u64,
    /// Times the VIP was lost or changed.
    pub address_changes: u64,
    /// Offers and ACKs refused (a rogue or broken server, or a guard that
    /// allows nothing the server has).
    pub offers_refused: u64,
    /// Times the macvlan interface or the leased address was found
    /// deleted or changed by another program and put back.
    pub repairs: u64,
    /// Why the interface or the leased address is not in the host and
    /// could not be put back (the VIP may not answer although `state` is
    /// `bound`); `null` when the last check found them in place.
    pub error: Option<String>,
    /// The last refusal: why a VIP in `selecting` has no lease.
    pub last_refusal: Option<crate::metrics::stats::LastRefusal>,
}

/// One listener in `/status`.
#[derive(Debug, Serialize)]
pub struct ListenerStatus {
    /// Name in the config.
    pub name: String,
    /// VIP:port.
    pub address: SocketAddr,
    /// Nodeport.
    pub backend_port: u16,
    /// Transport.
    pub protocol: &'static str,
    /// `v1` or `v2` when a PROXY protocol header goes to the backends.
    pub proxy_protocol: Option<&'static str>,
    /// `listening` or `failed`.
    pub state: &'static str,
    /// Why it failed to bind.
    pub error: Option<String>,
    /// Connections open through it (0 for a UDP listener).
    pub active_connections: usize,
    /// Backends its new connections may go to now: healthy on its
    /// `backend_port` (or on the check's port) and `ready`.
    pub eligible_backends: usize,
    /// UDP flows open through it; absent for a TCP listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_flows: Option<usize>,
    /// Who forwards its new connections now: `proxy`, or `kernel` once the
    /// NAT table with it is written (a `forwarding = "kernel"` listener
    /// whose table could not be written is served by the proxy), or
    /// `repairing` when the last check found its table, chain or elements
    /// changed by another process, until they are written again
    /// (`kernel_error` says what differs).
    pub forwarding: &'static str,
    /// Why a `forwarding = "kernel"` listener is served by the proxy.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kernel_error: Option<String>,
}

/// One backend in `/status`.
#[derive(Debug, Serialize)]
pub struct BackendStatus {
    /// Node address.
    pub address: IpAddr,
    /// The health checker's verdict (the last one before `maint`); with
    /// per-listener checks, `healthy` only while every port is.
    pub health: Health,
    /// The operator's state: `ready`, `drain` or `maint`.
    pub admin_state: AdminState,
    /// Whether it takes new connections: healthy and `ready`; with
    /// per-listener checks, for at least one listener (`ports` says which).
    pub eligible: bool,
    /// Connections open to it (its UDP flows included: least_connections
    /// weighs both).
    pub active_connections: usize,
    /// UDP flows open to it through the UDP listeners; absent when its load
    /// balancer has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_flows: Option<usize>,
    /// Health-check detail; absent without a health check, and with
    /// per-listener checks (each port has its own).
    pub probe: Option<TargetStatus>,
    /// Per-listener checks only: the verdict on each listener's nodeport.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortStatus>,
    /// Its numbers since the daemon started (HAProxy's `show stat`).
    pub totals: BackendTotals,
}

/// One backend's totals in `/status`, over every listener kind of its load
/// balancer, since this process started (a restart starts them again).
/// The field names are a contract: the status page renders them.
#[derive(Debug, Serialize)]
pub struct BackendTotals {
    /// Connections opened to it: the proxy's TCP connections and UDP
    /// flows, plus the new connections the kernel forwarded on kernel
    /// listeners (their named counters, as last read: every 5 s).
    pub connections: u64,
    /// Payload bytes the proxy moved from clients to it (kernel listeners'
    /// bytes are not counted: the NAT chain sees a flow's first packet only).
    pub bytes_to_backend: u64,
    /// Payload bytes the proxy moved from it to clients.
    pub bytes_to_client: u64,
    /// The proxy's failed connect attempts to it, retries included (the
    /// kernel path cannot tell one).
    pub connect_failures: u64,
    /// Health probes of it that failed (every result but `ok` and
    /// `skipped`, which was never sent).
    pub check_failures: u64,
    /// Seconds the health check found it unhealthy, the current period
    /// included.
    pub down_seconds: f64,
    /// When its health or operator's state last changed, Unix seconds;
    /// `null` if it has not changed since its numbers were made.
    pub last_change_unix: Option<f64>,
}

impl BackendTotals {
    fn of(b: &Backend, kernel_connections: Option<u64>) -> Self {
        use crate::metrics::by_label::Label;
        use crate::metrics::stats::{CheckResult, Direction};
        let s = b.stats();
        let sum = |c: &[crate::metrics::Counter]| c.iter().map(|c| c.get()).sum::<u64>();
        // Each counter read once: a probe counted meanwhile cannot make
        // the difference negative.
        let not_failures = [CheckResult::Ok.index(), CheckResult::Skipped.index()];
        Self {
            connections: s.connections.get() + kernel_connections.unwrap_or(0),
            bytes_to_backend: s.bytes[Direction::ClientToBackend].get(),
            bytes_to_client: s.bytes[Direction::BackendToClient].get(),
            connect_failures: sum(s.connect_failures.as_slice()),
            check_failures: s
                .checks
                .as_slice()
                .iter()
                .enumerate()
                .filter(|(i, _)| !not_failures.contains(i))
                .map(|(_, c)| c.get())
                .sum(),
            down_seconds: s.times.down_seconds(),
            last_change_unix: s.times.last_change_unix(),
        }
    }
}

/// One backend port in `/status`, for a health check without `port`: the
/// port's own verdict decides whether the listeners on it use the backend.
#[derive(Debug, Serialize)]
pub struct PortStatus {
    /// The nodeport.
    pub backend_port: u16,
    /// The listeners forwarding to it.
    pub listeners: Vec<String>,
    /// The verdict on this port.
    pub health: Health,
    /// Whether those listeners' new connections may go to the backend.
    pub eligible: bool,
    /// Health-check detail; absent while the backend is in `maint`.
    pub probe: Option<TargetStatus>,
}

fn health_of(healthy: bool) -> Health {
    if healthy {
        Health::Healthy
    } else {
        Health::Unhealthy
    }
}

//! Configuration: the controller's contract, read from one TOML file.
//!
//! Two layers, as in sozu and linkerd: [`file`] holds the serde types that
//! mirror the file; `validate` checks all of it in one pass and builds the
//! runtime types below (`Duration`, `NonZeroU32`, `IpAddr`…). Once a
//! [`Config`] exists it is valid, and nothing downstream checks it again.
//!
//! This module does no I/O beyond reading the file ([`read_regular_file`]:
//! a regular file of at most [`MAX_FILE_BYTES`], never a FIFO or a device), so `harvester-lb check`,
//! the daemon's start and every reload share exactly the same verdict.

mod admin_keys;
mod error;
mod file;
mod ranges;
mod read;
mod sync;
#[cfg(test)]
pub(crate) mod test_fixtures;
mod validate;
mod vmnet;

use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::num::{NonZeroU32, NonZeroUsize};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

pub use admin_keys::{AdminEndpoints, AdminKeyError, admin_endpoints};
pub use error::{ConfigError, Problem};
pub use ranges::{MAX_SOURCE_RANGES, SourceRanges};
pub use read::{FileKind, ReadError, read_regular_file};
pub use sync::{
    ConntrackdSettings, DEFAULT_CONNTRACKD_CONFIG, DEFAULT_CONNTRACKD_LOCK, DEFAULT_CONNTRACKD_LOG,
    DEFAULT_CONNTRACKD_SOCKET, DEFAULT_HASH_SIZE, DEFAULT_MULTICAST_GROUP, DEFAULT_NOTIFY_SCRIPT,
    DEFAULT_SYNC_PORT, DEFAULT_SYNC_STATE_DIR, MIN_HASH_SIZE, SyncTransport,
};
pub use validate::conf_word_problem;
pub use validate::{
    Conflict, DEFAULT_ADMIN_SOCKET, MAX_CLUSTER_BYTES, MAX_LISTENER_NAME_BYTES, MAX_NAME_BYTES,
    conflicts,
};
pub use vmnet::DEFAULT_MANAGEMENT_TABLE;
pub use vmnet::{
    DEFAULT_ADVERT_INTERVAL_MS, DEFAULT_IPV6_PREFIX_LENGTH, DEFAULT_KEEPALIVED_CONFIG,
    DEFAULT_KEEPALIVED_PID_FILE, DEFAULT_MANAGEMENT_CHECK_SCRIPT, DEFAULT_NETWORK_ISOLATE,
    DEFAULT_NETWORK_TABLE_BASE, DEFAULT_VRID_BASE, DEFAULT_VRRP_VERSION, KeepalivedSettings,
    NetworkSpec,
};
pub use vmnet::{
    DEFAULT_MANAGEMENT_VIPS, DEFAULT_READY_REQUIRES_BACKEND, LEG_PREFIX, OTHER_FAMILY_ALONE,
    REPLY_MARK_MASK, is_other_family_alone, leg_name, leg_table, not_a_vm_network_interface,
    reply_mark_of,
};

/// Where the daemon looks for its configuration unless told otherwise.
pub const DEFAULT_PATH: &str = "/etc/harvester-lb/config.toml";

/// The largest config file accepted. A thousand load balancers take well under
/// one MiB; anything near this is a mistake (or an attack) worth naming.
pub const MAX_FILE_BYTES: u64 = 16 * 1024 * 1024;

/// A validated configuration.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Config {
    /// The admin HTTP server.
    pub admin: AdminSettings,
    /// Process-wide forwarding settings.
    pub proxy: ProxySettings,
    /// What `/metrics` exposes beyond the default series.
    pub metrics: MetricsSettings,
    /// What the daemon does to the VIPs themselves.
    pub vip: VipSettings,
    /// Process-wide settings of the DHCP client (`[dhcp]`).
    pub dhcp: DhcpSettings,
    /// The connection log's process-wide bound (`[log]`).
    pub log: LogSettings,
    /// The process itself (`[daemon]`).
    pub daemon: DaemonSettings,
    /// Every load balancer, in file order; names are unique.
    pub load_balancers: Vec<Arc<LoadBalancerSpec>>,
    /// `[[network]]`: the VM networks VIPs can live on, names unique.
    pub networks: Vec<NetworkSpec>,
    /// `[keepalived]`: set when VIPs on VM networks are moved by the
    /// keepalived this daemon configures.
    pub keepalived: Option<KeepalivedSettings>,
    /// `[conntrackd]`: set when the kernel listeners' flows are synced
    /// with the other keepalived host, so they survive a VIP's move.
    pub conntrackd: Option<ConntrackdSettings>,
}

/// `[admin]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminSettings {
    /// Where `/metrics`, `/healthz`, `/readyz`, `/status` and `/reload` are served.
    pub listen: SocketAddr,
    /// The Unix socket that also serves the state-changing endpoints
    /// (`POST /backends/state`). A Unix socket because its file mode decides
    /// who may drain a backend; the TCP listener is open to every process on
    /// the host, `hostNetwork` pods included.
    pub socket: PathBuf,
}

/// `[daemon]`: the process itself.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct DaemonSettings {
    /// `daemon.state_file`: where the state that survives a restart is
    /// kept (`crate::state_file`); `None`: systemd's `$STATE_DIRECTORY`
    /// decides, and without it none is kept. Read at start only.
    pub state_file: Option<PathBuf>,
}

/// `[metrics]`: the opt-in series, each costly at scale.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MetricsSettings {
    /// `harvester_lb_health_check_duration_seconds` per backend (19 series
    /// each) instead of one histogram for the whole daemon.
    pub per_backend_health_check_duration: bool,
}

/// `[vip]`: the VIPs' own protection on this host, and their announcement.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct VipSettings {
    /// Let traffic to a VIP reach only its listeners' ports: without it,
    /// every service the host runs on a wildcard address (the kubelet, SSH,
    /// the Kubernetes API) answers on every VIP too.
    pub isolate: bool,
    /// What happens to the rest of the traffic addressed to a VIP.
    pub isolate_action: IsolateAction,
    /// Whether and where the VIPs are announced for a BGP speaker.
    pub announce: AnnounceSettings,
}

/// The route protocol number of the daemon's announcing routes
/// (`proto 252` in `ip route`; name it in `/etc/iproute2/rt_protos.d/`).
/// Unassigned by iproute2 and the kernel, so no other routing daemon
/// writes it: the daemon deletes only routes of this protocol.
pub const ROUTE_PROTOCOL: u8 = 252;

/// Default `vip.announce_table`.
pub const DEFAULT_ANNOUNCE_TABLE: u32 = 100;

/// Default `vip.withdraw_grace_seconds`: BIRD's kernel protocol with
/// `learn` sees the route go in milliseconds and the router's FIB follows
/// in tens of milliseconds over BFD-backed sessions (measured in
/// `/work/shared/notes/bgp-anycast.md`: 3-32 ms); 5 s leaves room for a
/// slower router and a `scan time` without netlink notifications.
pub const DEFAULT_WITHDRAW_GRACE_SECONDS: u64 = 5;

/// `vip.announce` and the keys with it: the daemon's half of anycast VIPs
/// (every host announces the VIP's host route to its BGP speaker while it
/// can serve the VIP; the router spreads flows by ECMP).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnnounceSettings {
    /// `none` (default: the daemon touches no address and no route) or `routes`.
    pub mode: AnnounceMode,
    /// Where each VIP is put as a /32 (/128) address so the host accepts
    /// its traffic (default `lo`).
    pub interface: String,
    /// The routing table the announcing routes go to (default 100); never
    /// 0, 253, 254 or 255.
    pub table: u32,
    /// `vip.announce_prefixes`: the only ranges a VIP may be announced
    /// from (like MetalLB's address pools), so a VIP a guest cluster
    /// chose cannot pull the host's own or its router's address. Required
    /// with `routes` (empty only with `none`).
    pub prefixes: Vec<ipnet::IpNet>,
    /// How long a VIP's conditions must hold before it is announced;
    /// `None`: 3 × the longest probe period of the VIP's load balancers
    /// (3 s without health checks).
    pub delay: Option<Duration>,
    /// How long a stopping daemon waits between withdrawing every VIP and
    /// closing its listeners, for the router to move new flows away.
    pub withdraw_grace: Duration,
}

impl Default for AnnounceSettings {
    fn default() -> Self {
        Self {
            mode: AnnounceMode::None,
            interface: "lo".to_string(),
            table: DEFAULT_ANNOUNCE_TABLE,
            prefixes: Vec::new(),
            delay: None,
            withdraw_grace: Duration::from_secs(DEFAULT_WITHDRAW_GRACE_SECONDS),
        }
    }
}

impl AnnounceSettings {
    /// Whether routes are announced.
    pub fn enabled(&self) -> bool {
        self.mode == AnnounceMode::Routes
    }

    /// Whether `vip` is inside `announce_prefixes` (its IPv4 form for an
    /// IPv4-mapped address).
    pub fn allows(&self, vip: std::net::IpAddr) -> bool {
        let vip = vip.to_canonical();
        self.prefixes.iter().any(|p| p.contains(&vip))
    }

    /// `announce_prefixes` for a message: `a, b, c`.
    pub fn prefixes_text(&self) -> String {
        self.prefixes
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// `vip.announce`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum AnnounceMode {
    /// No route is touched (keepalived or kube-vip move the VIP).
    #[default]
    None,
    /// Each VIP is made local by an AnyIP route through `announce_interface`
    /// (`local VIP dev lo table local`), and a host route in
    /// `announce_table` announces it while this host can serve it.
    Routes,
}

/// How a packet to a VIP's closed port is refused.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum IsolateAction {
    /// Silently: a scanner learns nothing, a client waits for its timeout.
    #[default]
    Drop,
    /// A TCP reset (ICMP port unreachable for other protocols): a client
    /// fails at once, as if nothing listened.
    Reject,
}

/// `[dhcp]`: where the DHCP client keeps its leases, so that a restarted
/// daemon asks for the address it had (INIT-REBOOT) instead of a new one.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DhcpSettings {
    /// One JSON file per load balancer with `ipam = "dhcp"`.
    pub state_directory: PathBuf,
    /// The guard of every `[load_balancer.dhcp]` that sets none of its own.
    pub guard: DhcpGuard,
}

/// Which DHCP offers a client may take: what keeps a rogue or broken DHCP
/// server on the segment from handing the host an address it already
/// holds, its router's address, or a subnet that reroutes it
/// (`dhcp.allowed_ranges`, `dhcp.min_prefix_length`, globally in `[dhcp]`
/// or per load balancer in `[load_balancer.dhcp]`). Not part of the
/// client's identity: a change applies to the next offer or ACK without
/// releasing the lease.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DhcpGuard {
    /// The ranges a leased address must lie in; empty: any address the other
    /// rules allow.
    pub allowed_ranges: Vec<ipnet::Ipv4Net>,
    /// Offers with a subnet mask shorter than this prefix length are
    /// refused (default [`DEFAULT_DHCP_MIN_PREFIX_LENGTH`]).
    pub min_prefix_length: u8,
}

/// Default `dhcp.min_prefix_length`: a /16 is the largest subnet a real
/// VIP segment uses (a whole RFC 1918 `192.168.0.0/16`); a wider mask from
/// a server is a mistake or an attack.
pub const DEFAULT_DHCP_MIN_PREFIX_LENGTH: u8 = 16;

impl Default for DhcpGuard {
    fn default() -> Self {
        Self {
            allowed_ranges: Vec::new(),
            min_prefix_length: DEFAULT_DHCP_MIN_PREFIX_LENGTH,
        }
    }
}

/// `[load_balancer.dhcp]`: how the VIP of an `ipam = "dhcp"` load balancer
/// is leased. Everything here but the guard keys is part of the client's
/// identity: a change releases the old lease and starts a new client.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct DhcpSpec {
    /// The host interface the macvlan interface is created on.
    pub interface: String,
    /// The macvlan interface's MAC address and the DHCP client hardware
    /// address: stable, so a restart (or another host taking over with the
    /// same config) asks for the same lease.
    pub mac: [u8; 6],
    /// Sent as option 12 (the server may register it in DNS; Harvester #7561).
    pub hostname: String,
    /// Servers whose offers and answers are taken; empty: any server.
    pub servers: Vec<std::net::Ipv4Addr>,
    /// The address to ask for when no lease was kept (the `vip` the
    /// controller wrote, if it was not `0.0.0.0`).
    pub requested: Option<std::net::Ipv4Addr>,
    /// `allowed_ranges` of this table; `None`: `[dhcp]`'s.
    pub allowed_ranges: Option<Vec<ipnet::Ipv4Net>>,
    /// `min_prefix_length` of this table; `None`: `[dhcp]`'s.
    pub min_prefix_length: Option<u8>,
}

impl DhcpSpec {
    /// The guard of this client: its own keys, else `global`'s (`[dhcp]`).
    pub fn guard(&self, global: &DhcpGuard) -> DhcpGuard {
        DhcpGuard {
            allowed_ranges: self
                .allowed_ranges
                .clone()
                .unwrap_or_else(|| global.allowed_ranges.clone()),
            min_prefix_length: self.min_prefix_length.unwrap_or(global.min_prefix_length),
        }
    }

    /// Whether `other` is the same DHCP client (everything but the guard
    /// equal): a reload that changes only the guard keeps the lease.
    pub fn same_client(&self, other: &Self) -> bool {
        self.interface == other.interface
            && self.mac == other.mac
            && self.hostname == other.hostname
            && self.servers == other.servers
            && self.requested == other.requested
    }
}

/// `[log]`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LogSettings {
    /// Connection log lines written per second at most, all load balancers
    /// together (a burst of one second's worth is let through); the excess
    /// is counted, not written, so a flood of failing clients cannot flood
    /// the journal (whose own rate limit would drop the daemon's other
    /// messages with them) or slow the forwarder. Default 1000.
    pub max_connection_lines_per_second: NonZeroU32,
}

/// Which connections of a load balancer get a line in the connection log
/// (`log_connections`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum LogConnections {
    /// None (the default): the log says nothing per connection.
    #[default]
    None,
    /// Every connection that did not end with both sides closing normally:
    /// refused, failed, reset, timed out, drained, cut.
    Errors,
    /// Every connection.
    All,
}

/// `[proxy]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ProxySettings {
    /// `listen(2)` backlog of each VIP listener (the kernel caps it at `somaxconn`).
    pub backlog: u32,
    /// How long a removed listener, a removed backend or a stopping daemon lets
    /// open connections run before closing them.
    pub drain_timeout: Duration,
    /// Cap on concurrently forwarded connections; `None` = derived from the
    /// process's open-file limit at start.
    pub max_connections: Option<NonZeroUsize>,
    /// Cap on client-affinity entries, all load balancers together.
    pub max_affinity_entries: usize,
    /// Cap on UDP flows, all UDP listeners together; `None` = derived from
    /// the open-file limit at start (each flow holds one socket).
    pub max_udp_flows: Option<NonZeroUsize>,
    /// Cap on the flows of one source (an IPv4 address, an IPv6 /64) on one
    /// UDP listener, so a client that floods new source ports or addresses
    /// fills only its share of the table.
    pub max_udp_flows_per_source: NonZeroUsize,
}

/// One Kubernetes `LoadBalancer` service.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadBalancerSpec {
    /// `<namespace>/<service>`; unique; the key that survives reloads.
    pub name: String,
    /// Guest cluster that owns this load balancer; a label on every metric.
    pub cluster: String,
    /// The virtual IP every listener binds to. With `ipam = "dhcp"` it is
    /// `0.0.0.0` in a loaded config, and the daemon puts the leased address
    /// in its place (listeners of an unleased VIP are not bound).
    pub vip: IpAddr,
    /// How the VIP is obtained: from the controller's pool, or leased by
    /// this daemon.
    pub ipam: Ipam,
    /// How the VIP is leased; `Some` exactly when `ipam` is `Dhcp`.
    pub dhcp: Option<DhcpSpec>,
    /// The `[[network]]` (by name) its VIP lives on, moved between hosts
    /// by keepalived; `None`: the VIP is brought to the host otherwise.
    pub network: Option<String>,
    /// Node addresses, in file order, without duplicates.
    pub backends: Vec<IpAddr>,
    /// How a backend is picked for a new connection.
    pub algorithm: Algorithm,
    /// The state of a backend before its first probe completes.
    pub initial_state: InitialState,
    /// Timeout of one connect attempt to a backend.
    pub connect_timeout: Duration,
    /// How many distinct backends one client connection may try; `None` = all eligible.
    pub connect_attempts: Option<NonZeroU32>,
    /// A connection with no byte moving either way for this long is closed.
    pub idle_timeout: Duration,
    /// `sessionAffinity: ClientIP`: how long a client keeps its backend after
    /// its last connection; `None` = no affinity.
    pub affinity_timeout: Option<Duration>,
    /// What happens to open connections of a backend the health check marks down.
    pub on_backend_down: OnBackendDown,
    /// Which of its connections get a line in the connection log.
    pub log_connections: LogConnections,
    /// VIP port -> nodeport mappings.
    pub listeners: Vec<ListenerSpec>,
    /// Active health checking; `None` = every backend always eligible.
    pub health_check: Option<HealthCheckSpec>,
    /// The clients it serves (`loadBalancerSourceRanges`); others are reset
    /// at accept.
    pub source_ranges: SourceRanges,
    /// How its UDP listeners end flows; here, per load balancer, because a
    /// DNS service and a game service behind one daemon want different ones.
    pub udp: UdpSettings,
    /// Cap on its concurrent TCP connections, all its listeners together;
    /// `None`: its default share of `proxy.max_connections` (see
    /// [`default_share`]).
    pub max_connections: Option<NonZeroUsize>,
    /// Cap on its UDP flows, all its listeners together; `None`: its
    /// default share of `proxy.max_udp_flows`.
    pub max_udp_flows: Option<NonZeroUsize>,
}

/// A load balancer's default share of a process-wide cap (`proxy.max_connections`,
/// `proxy.max_udp_flows`) when its own is not set, given how many load
/// balancers have listeners of that protocol: the whole cap when it is the
/// only one, else half of it, rounded up. No one tenant can
/// then hold every slot and starve the others (150 idle connections to one
/// VIP no longer refuse every other VIP), while a busy tenant can still use
/// far more than an even split when the others are quiet. An explicit
/// per-load-balancer cap is used as it is, never above the process-wide one.
pub fn default_share(global: usize, load_balancers: usize) -> usize {
    if load_balancers <= 1 {
        global
    } else {
        global.div_ceil(2).max(1)
    }
}

/// How a load balancer's UDP listeners end their flows. UDP has no
/// connection close, so the only ends are silence and a known answer count.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct UdpSettings {
    /// A flow with no datagram either way for this long ends (default 60 s,
    /// like common conntrack setups).
    pub idle_timeout: Duration,
    /// A flow ends once every client datagram had this many answers
    /// (nginx's `proxy_responses`; 1 for DNS frees the flow at the answer);
    /// `None` = only the idle timeout ends it.
    pub responses: Option<NonZeroU32>,
}

impl LoadBalancerSpec {
    /// The socket address a listener of this load balancer binds.
    pub fn listen_addr(&self, listener: &ListenerSpec) -> SocketAddr {
        SocketAddr::new(self.vip, listener.port)
    }

    /// What a listener of this load balancer is known by.
    pub fn listener_key(&self, listener: &ListenerSpec) -> ListenerKey {
        ListenerKey {
            addr: self.listen_addr(listener),
            protocol: listener.protocol,
        }
    }

    /// The backend ports checked one by one, sorted and distinct: its
    /// listeners' `backend_port`s when the health check has no `port`
    /// (per-listener eligibility); empty when the check has a `port` or
    /// there is no check (one verdict per backend, or none). Two listeners
    /// with one nodeport share one verdict: it is one socket on the node.
    /// Only TCP listeners' nodeports: a UDP port answers no handshake, so a
    /// UDP listener uses the verdict of a TCP listener on its nodeport, or
    /// else the backends eligible on any checked port.
    pub fn checked_ports(&self) -> Vec<u16> {
        match &self.health_check {
            Some(hc) if hc.port.is_none() => {
                let mut ports: Vec<u16> = self
                    .listeners
                    .iter()
                    .filter(|l| l.protocol == Protocol::Tcp)
                    .map(|l| l.backend_port)
                    .collect();
                ports.sort_unstable();
                ports.dedup();
                ports
            }
            _ => Vec::new(),
        }
    }
}

/// `[[load_balancer.listener]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListenerSpec {
    /// The service port's name.
    pub name: String,
    /// Port on the VIP.
    pub port: u16,
    /// The service's nodeport on every backend.
    pub backend_port: u16,
    /// Transport: one VIP:port may have one TCP and one UDP listener.
    pub protocol: Protocol,
    /// The PROXY protocol header sent to the backend first, if any.
    pub proxy_protocol: Option<ProxyProtocol>,
    /// `TCP_DEFER_ACCEPT` (`defer_accept_seconds`): the kernel hands a
    /// client over only once its first bytes have arrived, or after this
    /// long; `None` (the default) hands it over at the handshake. TCP
    /// listeners only. Wrong for protocols where the server speaks first
    /// (SMTP, MySQL, SSH): their clients wait this long for a greeting.
    pub defer_accept: Option<Duration>,
    /// Who forwards this listener's connections (`forwarding`): the
    /// daemon's own proxy, or the kernel's NAT programmed by the daemon.
    pub forwarding: Forwarding,
    /// What a kernel listener does to the client's source address
    /// (`source_nat`); always [`SourceNat::Masquerade`] on proxy listeners,
    /// where it has no meaning.
    pub source_nat: SourceNat,
}

/// Who forwards a listener's connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum Forwarding {
    /// The daemon accepts each connection and copies its bytes (the
    /// default): every feature, every count, PROXY protocol.
    #[default]
    Proxy,
    /// The daemon programs nftables DNAT and the kernel forwards: no byte
    /// passes through user space, so no per-connection feature exists. The
    /// listener's socket stays bound as the fallback.
    Kernel,
}

impl Forwarding {
    /// Every value, in the order the config's error message lists them.
    pub const ALL: [Forwarding; 2] = [Forwarding::Proxy, Forwarding::Kernel];

    /// The name used in the config and `/status`.
    pub fn as_str(self) -> &'static str {
        match self {
            Forwarding::Proxy => "proxy",
            Forwarding::Kernel => "kernel",
        }
    }
}

/// The source address a backend sees on a kernel listener's connections.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub enum SourceNat {
    /// The host's own address (the default, as with the proxy): replies
    /// come back through this host whatever the backends' routes.
    #[default]
    Masquerade,
    /// The client's own address (`externalTrafficPolicy: Local` users want
    /// it); the backends must route their replies through this host.
    None,
    /// The VIP, keeping the client's port where it can (`snat to VIP`):
    /// the same source from every host, so a backend still knows a flow
    /// that another host picks up, and replies go to whichever host holds
    /// the VIP now. For a VIP that moves by keepalived (`network`); refused
    /// with anycast, whose router spreads the replies over all hosts,
    /// unless `[conntrackd]` syncs the flows between the two anycast hosts.
    Vip,
}

/// `[load_balancer.health_check]`.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HealthCheckSpec {
    /// What one probe does: a TCP handshake, or an HTTP `GET` of
    /// kube-proxy's `healthCheckNodePort`.
    pub check: CheckKind,
    /// Port probed on each backend, one verdict for all its listeners
    /// (`healthcheck-port`, the cloud provider's guest-cluster model);
    /// `None` = each listener's own `backend_port` is probed and a backend
    /// is eligible per listener (Harvester's `LoadBalancer` v1beta1, where
    /// the health port is a listener's backend port).
    pub port: Option<u16>,
    /// Consecutive successes before a backend takes traffic.
    pub success_threshold: NonZeroU32,
    /// Consecutive failures before it stops taking traffic.
    pub failure_threshold: NonZeroU32,
    /// Time between the starts of two probes of one backend.
    pub period: Duration,
    /// Timeout of one probe; never longer than `period`.
    pub timeout: Duration,
}

/// How the VIP is obtained. Harvester forbids changing it after creation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ipam {
    /// From an IP pool.
    Pool,
    /// Leased by this daemon over DHCP (`[load_balancer.dhcp]`).
    Dhcp,
}

impl Ipam {
    /// Every value, in the order the config's error message lists them.
    pub const ALL: [Ipam; 2] = [Ipam::Pool, Ipam::Dhcp];

    /// The name used in the config (`ipam`) and `/status`: spelled here
    /// alone, so what validation accepts and what `/status` shows agree.
    pub fn as_str(self) -> &'static str {
        match self {
            Ipam::Pool => "pool",
            Ipam::Dhcp => "dhcp",
        }
    }
}

/// Picking algorithm of a load balancer.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Algorithm {
    /// Each new connection goes to the next eligible backend.
    RoundRobin,
    /// The eligible backend with the fewest open connections (ties: file order).
    LeastConnections,
    /// Rendezvous hash of the client IP: a client sticks to one backend, and
    /// only clients of a backend that leaves are moved.
    SourceIp,
    /// Rendezvous hash of the whole flow (client address and port): one
    /// client's connections still spread, and every host with the same
    /// config and health picks the same backend for a flow, so a flow that
    /// reaches another host mid-stream (a BGP rehash, a VIP's failover)
    /// lands on the backend it had. Only backends that leave move flows.
    FlowHash,
}

impl Algorithm {
    /// Every value, in the order the config's error message lists them.
    pub const ALL: [Algorithm; 4] = [
        Algorithm::RoundRobin,
        Algorithm::LeastConnections,
        Algorithm::SourceIp,
        Algorithm::FlowHash,
    ];

    /// The name used in the config (`algorithm`) and `/status`: spelled
    /// here alone, so what validation accepts and what `/status` shows
    /// agree.
    pub fn as_str(self) -> &'static str {
        match self {
            Algorithm::RoundRobin => "round_robin",
            Algorithm::LeastConnections => "least_connections",
            Algorithm::SourceIp => "source_ip",
            Algorithm::FlowHash => "flow_hash",
        }
    }
}

/// What happens to the connections open to a backend when its health check
/// marks it down (HAProxy's `on-marked-down`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum OnBackendDown {
    /// They continue (the default): a node that fails its probe may still
    /// serve the connections it has, and they end on their own if it cannot.
    #[default]
    Keep,
    /// They are closed with a reset at once (HAProxy's
    /// `on-marked-down shutdown-sessions`): clients reconnect and are sent to
    /// an eligible backend instead of waiting on a dead one.
    Close,
}

/// What a listener is known by, in the file and across reloads: its VIP:port
/// and protocol (one TCP and one UDP listener may share a VIP:port, DNS on
/// 53/tcp and 53/udp; two of one protocol may not). The key of every map of
/// listeners (the daemon's sockets, the file's conflicts, the importer's
/// holders): named fields, where a tuple let any address-and-protocol pair in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ListenerKey {
    /// VIP:port the listener binds.
    pub addr: SocketAddr,
    /// Its transport.
    pub protocol: Protocol,
}

/// Transport of a listener: part of a listener's identity, with the VIP
/// and port, so DNS can serve 53/tcp and 53/udp on one VIP.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Protocol {
    /// TCP, forwarded byte for byte.
    Tcp,
    /// UDP, forwarded datagram by datagram along per-client flows.
    Udp,
}

impl Protocol {
    /// Every value, in the order the config's error message lists them.
    pub const ALL: [Protocol; 2] = [Protocol::Tcp, Protocol::Udp];

    /// The name used in the config, `/status` and logs; also nft's name of
    /// the protocol (`meta l4proto tcp`), which the VIP filters write.
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Tcp => "tcp",
            Protocol::Udp => "udp",
        }
    }
}

impl fmt::Display for Protocol {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// The PROXY protocol version a listener speaks to its backends
/// (HAProxy's `send-proxy` / `send-proxy-v2`): the client's address and
/// port and the VIP's reach the node, which would otherwise see the host's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ProxyProtocol {
    /// The text header (`PROXY TCP4 <client> <vip> <cport> <vport>\r\n`).
    V1,
    /// The binary header.
    V2,
}

impl ProxyProtocol {
    /// Every value, in the order the config's error message lists them.
    pub const ALL: [ProxyProtocol; 2] = [ProxyProtocol::V1, ProxyProtocol::V2];

    /// The name used in the config (`proxy_protocol`) and `/status`:
    /// spelled here alone, so what validation accepts and what `/status`
    /// shows agree.
    pub fn as_str(self) -> &'static str {
        match self {
            ProxyProtocol::V1 => "v1",
            ProxyProtocol::V2 => "v2",
        }
    }
}

/// The kind of a health probe, and everything that makes two probes of one
/// address and port the same: it is part of the key under which the prober
/// shares one probe stream between load balancers.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum CheckKind {
    /// A TCP connect that completes within the timeout (`kind = "tcp"`).
    TcpConnect,
    /// One HTTP/1.1 `GET` whose status must be expected (`kind = "http"`),
    /// as kube-proxy's `healthCheckNodePort` answers for
    /// `externalTrafficPolicy: Local`. Behind an `Arc` so that the prober's
    /// stream key stays cheap to clone and hash.
    Http(Arc<HttpCheck>),
}

/// What an HTTP probe asks and what answer counts as healthy.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HttpCheck {
    /// Request target: starts with `/`, visible ASCII only (validated).
    pub path: String,
    /// The `Host` header; `None` = the probed address and port
    /// (`10.0.0.1:10256`, `[fd00::1]:10256`), as curl would send it.
    pub host: Option<String>,
    /// The statuses that mean healthy.
    pub expect_status: StatusSet,
    /// Send a PROXY protocol v2 header with the `LOCAL` command first, for
    /// a node whose server accepts nothing without one (ingress-nginx with
    /// `use-proxy-protocol`), as HAProxy's `check-send-proxy` does.
    pub send_proxy: bool,
}

/// A set of HTTP status codes, kept as sorted, merged, inclusive ranges so
/// that `[200, 201]` and `["200-201"]` are one probe (and one stream).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct StatusSet(Vec<(u16, u16)>);

impl StatusSet {
    /// The set of the inclusive ranges given (in any order, overlapping or not).
    pub fn new(ranges: impl IntoIterator<Item = (u16, u16)>) -> Self {
        let mut ranges: Vec<(u16, u16)> = ranges
            .into_iter()
            .map(|(a, b)| (a.min(b), a.max(b)))
            .collect();
        ranges.sort_unstable();
        let mut merged: Vec<(u16, u16)> = Vec::with_capacity(ranges.len());
        for (from, to) in ranges {
            match merged.last_mut() {
                Some(last) if u32::from(from) <= u32::from(last.1) + 1 => last.1 = last.1.max(to),
                _ => merged.push((from, to)),
            }
        }
        Self(merged)
    }

    /// Whether `status` is in the set.
    pub fn contains(&self, status: u16) -> bool {
        self.0
            .iter()
            .any(|&(from, to)| (from..=to).contains(&status))
    }

    /// The merged ranges, lowest first.
    pub fn ranges(&self) -> &[(u16, u16)] {
        &self.0
    }
}

impl fmt::Display for StatusSet {
    /// `200`, `200-399`, `200, 204, 300-399`: as an operator would write it.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, &(from, to)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            if from == to {
                write!(f, "{from}")?;
            } else {
                write!(f, "{from}-{to}")?;
            }
        }
        Ok(())
    }
}

/// State of a backend before its first probe result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum InitialState {
    /// Takes traffic at once (HAProxy's and Pingora's choice; see the README).
    Healthy,
    /// Takes traffic after `success_threshold` successful probes.
    Unhealthy,
}

/// A valid configuration and the warnings that came with it.
#[derive(Debug, Clone)]
pub struct Loaded {
    /// The configuration to run.
    pub config: Config,
    /// Things that are allowed but probably not meant (e.g. no backends).
    pub warnings: Vec<Problem>,
    /// Values taken as meant though spelled otherwise (Kubernetes' `"TCP"`
    /// for `"tcp"`): `check` tells them so the file can be written in its
    /// own spelling; they never refuse a file.
    pub notes: Vec<Problem>,
    /// How many load balancers were taken unchanged from the last file a
    /// [`Loader`] read, without parsing their tables again.
    pub reused: usize,
}

/// Reads and validates the file at `path`.
///
/// Every failure names the file; a file with several problems reports all of
/// them, each with its line and key path.
pub fn load(path: &Path) -> Result<Loaded, ConfigError> {
    let text = read(path)?;
    parse(&text).map_err(|problems| ConfigError::Invalid {
        path: path.display().to_string(),
        problems,
    })
}

/// Reads the file again and again, as the daemon does at every reload,
/// parsing only the `[[load_balancer]]` tables whose text changed since the
/// last read. The verdict is always [`load`]'s: a table is reused only if
/// the new file is valid with it, and a broken file is read in full so its
/// problems are reported exactly as `check` reports them.
///
/// Keeps the text of the last good file's tables (about its size in memory)
/// and shares their specs with the [`Config`] it returned.
#[derive(Debug, Default)]
pub struct Loader {
    known: validate::Known,
    /// The SHA-256 of the text the last [`Loader::load`] read, valid or not.
    read_sha256: Option<String>,
}

impl Loader {
    /// A loader that remembers nothing yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Reads and validates the file at `path`, like [`load`].
    pub fn load(&mut self, path: &Path) -> Result<Loaded, ConfigError> {
        self.read_sha256 = None;
        let text = read(path)?;
        self.read_sha256 = Some(sha256_hex(text.as_bytes()));
        self.parse(&text).map_err(|problems| ConfigError::Invalid {
            path: path.display().to_string(),
            problems,
        })
    }

    /// The SHA-256 (lowercase hex, as `sha256sum` prints it) of the file
    /// the last [`Loader::load`] read, whatever its verdict; `None` when it
    /// could not be read.
    pub fn last_read_sha256(&self) -> Option<&str> {
        self.read_sha256.as_deref()
    }

    /// Validates a config held in memory, like [`parse`].
    pub fn parse(&mut self, text: &str) -> Result<Loaded, Vec<Problem>> {
        validate::parse_reusing(text, &mut self.known)
    }

    /// How many load balancers of the last good file it remembers.
    pub fn remembered(&self) -> usize {
        self.known.len()
    }
}

/// The file's text, refused if it is not a regular file (a FIFO, a device,
/// a directory), larger than [`MAX_FILE_BYTES`] or not UTF-8.
/// `bytes`' SHA-256 in lowercase hex.
fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::Digest as _;
    sha2::Sha256::digest(bytes)
        .iter()
        .fold(String::with_capacity(64), |mut hex, b| {
            use std::fmt::Write as _;
            let _ = write!(hex, "{b:02x}");
            hex
        })
}

fn read(path: &Path) -> Result<String, ConfigError> {
    let shown = path.display().to_string();
    let bytes = read_regular_file(path, MAX_FILE_BYTES).map_err(|e| match e {
        ReadError::Io(source) => ConfigError::Read {
            path: shown.clone(),
            source,
        },
        ReadError::NotRegular(kind) => ConfigError::NotRegular {
            path: shown.clone(),
            kind,
        },
        ReadError::TooLarge { size, .. } => ConfigError::TooLarge {
            path: shown.clone(),
            size,
        },
    })?;
    String::from_utf8(bytes).map_err(|e| ConfigError::NotUtf8 {
        path: shown,
        offset: e.utf8_error().valid_up_to(),
    })
}

/// Validates a config held in memory; the problems carry lines of `text`.
pub fn parse(text: &str) -> Result<Loaded, Vec<Problem>> {
    validate::parse(text)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_status_set_is_the_same_however_it_was_written() {
        let a = StatusSet::new([(200, 200), (201, 201), (300, 399), (204, 204)]);
        let b = StatusSet::new([(300, 399), (200, 201), (204, 204)]);
        assert_eq!(a, b);
        assert_eq!(a.to_string(), "200-201, 204, 300-399");
        assert!(a.contains(201) && a.contains(204) && a.contains(399));
        assert!(!a.contains(202) && !a.contains(400) && !a.contains(503));
        let merged = StatusSet::new([(200, 299), (250, 350), (351, 351)]);
        assert_eq!(merged.ranges(), &[(200, 351)]);
    }
}

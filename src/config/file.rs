//! The file layer of the configuration: the TOML schema exactly as the
//! controller writes it.
//!
//! These types only describe the *shape* of the file. Numbers are kept wide
//! (`i64`) and addresses as strings so that a bad value reaches
//! [`super::validate`], which reports every problem at once with its key path
//! and line, instead of serde stopping at the first one. Every value carries
//! its [`Spanned`] position for that purpose.
//!
//! Unknown keys are not rejected here: the loader collects all of them with
//! `serde_ignored` and reports them together with the other problems. Required keys are
//! `Option` here for the same reason: a missing one is one problem among many.

use serde::Deserialize;
use toml::Spanned;

/// The whole file.
#[derive(Debug, Default, Deserialize)]
pub struct FileConfig {
    /// `[admin]`: the metrics and status listener.
    #[serde(default)]
    pub admin: FileAdmin,
    /// `[proxy]`: process-wide forwarding settings.
    #[serde(default)]
    pub proxy: FileProxy,
    /// `[metrics]`: what `/metrics` exposes beyond the default series.
    #[serde(default)]
    pub metrics: FileMetrics,
    /// `[vip]`: what the daemon does to the VIPs themselves.
    #[serde(default)]
    pub vip: FileVip,
    /// `[dhcp]`: where leases of `ipam = "dhcp"` load balancers are kept.
    #[serde(default)]
    pub dhcp: FileDhcpSettings,
    /// `[log]`: what the daemon writes to its log beyond its own events.
    #[serde(default)]
    pub log: FileLog,
    /// `[daemon]`: the process itself (the state file kept across restarts).
    #[serde(default)]
    pub daemon: FileDaemon,
    /// `[[load_balancer]]`: one per Kubernetes `LoadBalancer` service.
    #[serde(default, rename = "load_balancer")]
    pub load_balancers: Vec<Spanned<FileLoadBalancer>>,
    /// `[[network]]`: the VM networks load balancers put their VIPs on.
    #[serde(default, rename = "network")]
    pub networks: Vec<Spanned<FileNetwork>>,
    /// `[keepalived]`: this host's part in moving VM-network VIPs.
    pub keepalived: Option<Spanned<FileKeepalived>>,
    /// `[conntrackd]`: conntrack state synced with the other keepalived host.
    pub conntrackd: Option<Spanned<FileConntrackd>>,
}

/// `[conntrackd]`.
#[derive(Debug, Deserialize)]
pub struct FileConntrackd {
    /// The sync link's interface; default `keepalived.interface`.
    pub interface: Option<Spanned<String>>,
    /// This host's address on the sync link; default `keepalived.address`.
    pub address: Option<Spanned<String>>,
    /// The other host's address on the sync link (unicast only); default
    /// the one `keepalived.peers`.
    pub peer: Option<Spanned<String>>,
    /// `"unicast"` (one peer) or `"multicast"` (any number of hosts);
    /// default unicast with one peer, multicast otherwise.
    pub transport: Option<Spanned<String>>,
    /// The IPv4 multicast group of the multicast transport.
    pub multicast_group: Option<Spanned<String>>,
    /// The UDP port of the sync link (the group's port with multicast).
    pub port: Option<Spanned<i64>>,
    /// Where the rendered conntrackd.conf is written.
    pub config_path: Option<Spanned<String>>,
    /// Where the rendered notify script is written.
    pub notify_script: Option<Spanned<String>>,
    /// conntrackd's control socket.
    pub socket: Option<Spanned<String>>,
    /// conntrackd's lock file.
    pub lock_file: Option<Spanned<String>>,
    /// conntrackd's log file.
    pub log_file: Option<Spanned<String>>,
    /// Where the notify script records transitions and commits.
    pub state_directory: Option<Spanned<String>>,
    /// conntrackd's `HashSize`.
    pub hash_size: Option<Spanned<i64>>,
    /// Run after conntrackd's file changed.
    pub restart_command: Option<Spanned<Vec<Spanned<String>>>>,
}

/// `[[network]]`: one L2 network of guest VMs a VIP can live on.
#[derive(Debug, Deserialize)]
pub struct FileNetwork {
    /// What load balancers call it (`network = "default/vlan100"`).
    pub name: Option<Spanned<String>>,
    /// The host interface on that L2 (a bridge or a VLAN device).
    pub interface: Option<Spanned<String>>,
    /// The prefix length of the network's subnet.
    pub prefix_length: Option<Spanned<i64>>,
    /// The network's IPv4 gateway (replies to clients outside the subnet).
    pub gateway: Option<Spanned<String>>,
    /// The network's IPv6 gateway, if it has one.
    pub ipv6_gateway: Option<Spanned<String>>,
    /// The prefix length of the network's IPv6 subnet (the gateway's).
    pub ipv6_prefix_length: Option<Spanned<i64>>,
    /// The routing table replies from its VIPs are looked up in.
    pub table: Option<Spanned<i64>>,
    /// Whether the host refuses to route for this network's VMs
    /// (`host::vmnet::vmnet_filter`); default true.
    pub isolate: Option<Spanned<bool>>,
}

/// `[keepalived]`.
#[derive(Debug, Deserialize)]
pub struct FileKeepalived {
    /// This host's name (keepalived's `router_id`).
    pub name: Option<Spanned<String>>,
    /// This host's address on the management network (`unicast_src_ip`).
    pub address: Option<Spanned<String>>,
    /// The management interface VRRP adverts go out of.
    pub interface: Option<Spanned<String>>,
    /// The other hosts' management addresses (`unicast_peer`).
    pub peers: Option<Spanned<Vec<Spanned<String>>>>,
    /// How many VRRP instances the VIPs are spread over.
    pub instances: Option<Spanned<i64>>,
    /// The first instance's virtual router id.
    pub vrid_base: Option<Spanned<i64>>,
    /// VRRP advertisement interval, milliseconds.
    pub advert_interval_ms: Option<Spanned<i64>>,
    /// The VRRP version keepalived speaks (2 or 3).
    pub vrrp_version: Option<Spanned<i64>>,
    /// Where the rendered keepalived.conf is written.
    pub config_path: Option<Spanned<String>>,
    /// keepalived's pid file (SIGHUP goes to that pid).
    pub pid_file: Option<Spanned<String>>,
    /// A command run instead of the SIGHUP.
    pub reload_command: Option<Spanned<Vec<Spanned<String>>>>,
    /// The management network's gateway the reachability check pings
    /// (default: the default route's through `interface`).
    pub management_gateway: Option<Spanned<String>>,
    /// Where the reachability check's script is written.
    pub management_check_script: Option<Spanned<String>>,
    /// Whether load balancers on no `[[network]]` get their VIP on
    /// `interface` too (default true).
    pub management_vips: Option<Spanned<bool>>,
    /// Whether the rendered track scripts ask `/readyz` with
    /// `require=backend` (default false).
    pub ready_requires_backend: Option<Spanned<bool>>,
    /// The routing table of the management VIPs' leg (default 999).
    pub management_table: Option<Spanned<i64>>,
}

/// `[admin]`.
#[derive(Debug, Default, Deserialize)]
pub struct FileAdmin {
    /// Address of the admin HTTP server; default `127.0.0.1:9901`.
    pub listen: Option<Spanned<String>>,
    /// Path of the Unix socket that serves the state-changing endpoints;
    /// default `/run/harvester-lb/admin.sock`.
    pub socket: Option<Spanned<String>>,
}

/// `[daemon]`.
#[derive(Debug, Default, Deserialize)]
pub struct FileDaemon {
    /// The state file kept across restarts; default `$STATE_DIRECTORY/state.json`
    /// under systemd, else none.
    pub state_file: Option<Spanned<String>>,
}

/// `[dhcp]`: process-wide settings of the DHCP client.
#[derive(Debug, Default, Deserialize)]
pub struct FileDhcpSettings {
    /// Directory of the lease state files; default `$STATE_DIRECTORY`
    /// (systemd's `StateDirectory=`), else `/var/lib/harvester-lb`.
    pub state_directory: Option<Spanned<String>>,
    /// CIDRs a leased VIP must lie in; default: any.
    pub allowed_ranges: Option<Spanned<Vec<Spanned<String>>>>,
    /// Offers with a wider subnet mask are refused; default 16.
    pub min_prefix_length: Option<Spanned<i64>>,
}

/// `[log]`.
#[derive(Debug, Default, Deserialize)]
pub struct FileLog {
    /// Cap on connection log lines, all load balancers together.
    pub max_connection_lines_per_second: Option<Spanned<i64>>,
}

/// `[metrics]`.
#[derive(Debug, Default, Deserialize)]
pub struct FileMetrics {
    /// One probe-duration histogram per backend instead of one for the daemon.
    pub per_backend_health_check_duration: Option<Spanned<bool>>,
}

/// `[vip]`.
#[derive(Debug, Default, Deserialize)]
pub struct FileVip {
    /// Only the listeners' ports answer on a VIP (an nftables table).
    pub isolate: Option<Spanned<bool>>,
    /// `drop` or `reject`: what the other traffic to a VIP meets.
    pub isolate_action: Option<Spanned<String>>,
    /// `none` or `routes`: whether the daemon announces its VIPs as host
    /// routes in a table a BGP speaker exports.
    pub announce: Option<Spanned<String>>,
    /// The interface of the VIPs' local and announce routes (`lo`).
    pub announce_interface: Option<Spanned<String>>,
    /// The CIDR ranges a VIP must be inside to be announced (required
    /// with `announce = "routes"`).
    pub announce_prefixes: Option<Spanned<Vec<Spanned<String>>>>,
    /// The routing table the announcing routes are written to.
    pub announce_table: Option<Spanned<i64>>,
    /// How long a VIP's conditions must hold before it is announced.
    pub announce_delay_seconds: Option<Spanned<i64>>,
    /// How long a stopping daemon waits after withdrawing before it drains.
    pub withdraw_grace_seconds: Option<Spanned<i64>>,
}

/// `[proxy]`.
#[derive(Debug, Default, Deserialize)]
pub struct FileProxy {
    /// `listen(2)` backlog of every VIP listener.
    pub backlog: Option<Spanned<i64>>,
    /// How long removed listeners and a stopping daemon wait for open connections.
    pub drain_timeout_seconds: Option<Spanned<i64>>,
    /// Cap on concurrently forwarded connections (each holds two descriptors).
    pub max_connections: Option<Spanned<i64>>,
    /// Cap on client-affinity entries across all load balancers.
    pub max_affinity_entries: Option<Spanned<i64>>,
    /// Cap on UDP flows, all UDP listeners together (each holds a socket).
    pub max_udp_flows: Option<Spanned<i64>>,
    /// Cap on the UDP flows of one client address on one listener.
    pub max_udp_flows_per_source: Option<Spanned<i64>>,
}

/// `[[load_balancer]]`: mirrors Harvester's `LoadBalancer` object.
#[derive(Debug, Default, Deserialize)]
pub struct FileLoadBalancer {
    /// `<namespace>/<service>`, unique in the file.
    pub name: Option<Spanned<String>>,
    /// Guest cluster that owns the load balancer.
    pub cluster: Option<Spanned<String>>,
    /// The virtual IP the listeners bind to.
    pub vip: Option<Spanned<String>>,
    /// `pool` or `dhcp`.
    pub ipam: Option<Spanned<String>>,
    /// Node addresses of the guest cluster.
    #[serde(default)]
    pub backends: Vec<Spanned<String>>,
    /// Picking algorithm name.
    pub algorithm: Option<Spanned<String>>,
    /// `healthy` or `unhealthy`: state of a backend before its first probe.
    pub initial_state: Option<Spanned<String>>,
    /// Timeout of one connect attempt to a backend, in milliseconds.
    pub connect_timeout_ms: Option<Spanned<i64>>,
    /// How many backends one client connection may try.
    pub connect_attempts: Option<Spanned<i64>>,
    /// Close a connection after this long without a byte either way.
    pub idle_timeout_seconds: Option<Spanned<i64>>,
    /// `none` or `client_ip`: the Service's `sessionAffinity`.
    pub session_affinity: Option<Spanned<String>>,
    /// The Service's `sessionAffinityConfig.clientIP.timeoutSeconds`.
    pub affinity_timeout_seconds: Option<Spanned<i64>>,
    /// `loadBalancerSourceRanges`: CIDRs of the clients served; empty: everyone.
    #[serde(default)]
    pub source_ranges: Vec<Spanned<String>>,
    /// `keep` or `close`: what happens to open connections of a backend the
    /// health check marks down.
    pub on_backend_down: Option<Spanned<String>>,
    /// `none`, `errors` or `all`: which connections get a line in the log.
    pub log_connections: Option<Spanned<String>>,
    /// A UDP flow ends after this long without a datagram either way.
    pub udp_idle_timeout_seconds: Option<Spanned<i64>>,
    /// A UDP flow ends once each client datagram had this many answers
    /// (nginx's `proxy_responses`).
    pub udp_responses: Option<Spanned<i64>>,
    /// Cap on this load balancer's concurrent TCP connections (its share
    /// of `proxy.max_connections`).
    pub max_connections: Option<Spanned<i64>>,
    /// Cap on this load balancer's UDP flows (its share of `proxy.max_udp_flows`).
    pub max_udp_flows: Option<Spanned<i64>>,
    /// `[[load_balancer.listener]]`.
    #[serde(default, rename = "listener")]
    pub listeners: Vec<Spanned<FileListener>>,
    /// `[load_balancer.health_check]`.
    pub health_check: Option<Spanned<FileHealthCheck>>,
    /// `[load_balancer.dhcp]`: where and as whom the VIP is leased
    /// (`ipam = "dhcp"` only).
    pub dhcp: Option<Spanned<FileDhcp>>,
    /// The `[[network]]` its VIP lives on (keepalived moves it).
    pub network: Option<Spanned<String>>,
}

/// `[load_balancer.dhcp]`.
#[derive(Debug, Deserialize)]
pub struct FileDhcp {
    /// The host interface the macvlan interface is made on.
    pub interface: Option<Spanned<String>>,
    /// A fixed MAC address; default: derived from the name and cluster.
    pub mac: Option<Spanned<String>>,
    /// The hostname option sent; default: derived from the name and cluster.
    pub hostname: Option<Spanned<String>>,
    /// DHCP servers whose offers are taken; empty: any server.
    #[serde(default)]
    pub servers: Vec<Spanned<String>>,
    /// CIDRs the leased VIP must lie in; default: `[dhcp]`'s.
    pub allowed_ranges: Option<Spanned<Vec<Spanned<String>>>>,
    /// Offers with a wider subnet mask are refused; default: `[dhcp]`'s.
    pub min_prefix_length: Option<Spanned<i64>>,
}

/// `[[load_balancer.listener]]`: VIP port -> service nodeport.
#[derive(Debug, Deserialize)]
pub struct FileListener {
    /// Name of the port in the service.
    pub name: Option<Spanned<String>>,
    /// Port on the VIP.
    pub port: Option<Spanned<i64>>,
    /// The nodeport on every backend.
    pub backend_port: Option<Spanned<i64>>,
    /// `tcp` (default) or `udp`.
    pub protocol: Option<Spanned<String>>,
    /// `v1` or `v2`: a PROXY protocol header to the backend before the client's bytes.
    pub proxy_protocol: Option<Spanned<String>>,
    /// `TCP_DEFER_ACCEPT` on the listening socket, in seconds; absent: off.
    pub defer_accept_seconds: Option<Spanned<i64>>,
    /// `proxy` (default) or `kernel`: who forwards the connections.
    pub forwarding: Option<Spanned<String>>,
    /// `masquerade` (default) or `none`: kernel listeners only.
    pub source_nat: Option<Spanned<String>>,
}

/// `[load_balancer.health_check]`: Harvester's `healthcheck-*` annotations.
#[derive(Debug, Deserialize)]
pub struct FileHealthCheck {
    /// `healthcheck-port`.
    pub port: Option<Spanned<i64>>,
    /// `healthcheck-success-threshold`.
    pub success_threshold: Option<Spanned<i64>>,
    /// `healthcheck-failure-threshold`.
    pub failure_threshold: Option<Spanned<i64>>,
    /// `healthcheck-periodseconds`.
    pub period_seconds: Option<Spanned<i64>>,
    /// `healthcheck-timeoutseconds`.
    pub timeout_seconds: Option<Spanned<i64>>,
    /// `tcp` (default) or `http`.
    pub kind: Option<Spanned<String>>,
    /// `http` only: the request path.
    pub path: Option<Spanned<String>>,
    /// `http` only: statuses that mean healthy, each an integer code or a
    /// string range; kept as raw values so a wrong item is named, not a
    /// serde message about an untagged enum.
    pub expect_status: Option<Spanned<Vec<Spanned<toml::Value>>>>,
    /// `http` only: the `Host` header.
    pub host: Option<Spanned<String>>,
    /// `http` only: a PROXY protocol v2 `LOCAL` header before the request.
    pub send_proxy: Option<Spanned<bool>>,
}

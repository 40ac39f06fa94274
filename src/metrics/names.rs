//! Every metric family the daemon exposes: name, type and help text, each
//! written once here so the README's metrics reference, the code and
//! `promtool check metrics` agree.

/// The Prometheus type of a family.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// Only goes up (and restarts from 0 when its object is created anew).
    Counter,
    /// Goes up and down.
    Gauge,
    /// Buckets, sum and count.
    Histogram,
}

impl Kind {
    fn as_str(self) -> &'static str {
        match self {
            Kind::Counter => "counter",
            Kind::Gauge => "gauge",
            Kind::Histogram => "histogram",
        }
    }
}

/// One metric family: what `# HELP` and `# TYPE` say about it.
#[derive(Debug)]
pub struct Family {
    /// The full name (counters end in `_total`; a histogram's samples add
    /// `_bucket`, `_sum` and `_count`).
    pub name: &'static str,
    /// Counter, gauge or histogram.
    pub kind: Kind,
    /// One sentence for `# HELP`.
    pub help: &'static str,
}

impl Family {
    const fn new(name: &'static str, kind: Kind, help: &'static str) -> Self {
        Self { name, kind, help }
    }

    /// The `# HELP` and `# TYPE` lines.
    pub(crate) fn write_header(&self, out: &mut Vec<u8>) {
        for part in [
            "# HELP ",
            self.name,
            " ",
            self.help,
            "\n# TYPE ",
            self.name,
            " ",
            self.kind.as_str(),
            "\n",
        ] {
            out.extend_from_slice(part.as_bytes());
        }
    }
}

use Kind::{Counter, Gauge, Histogram};

// Per load balancer: labels `cluster`, `load_balancer`.

/// 1 while a load balancer has no eligible backend and refuses clients.
pub static NO_ELIGIBLE_BACKEND: Family = Family::new(
    "harvester_lb_no_eligible_backend",
    Gauge,
    "1 while the load balancer has no eligible backend and refuses clients.",
);
/// Times a load balancer entered the no-eligible-backend state.
pub static NO_ELIGIBLE_BACKEND_EVENTS: Family = Family::new(
    "harvester_lb_no_eligible_backend_events_total",
    Counter,
    "Times the load balancer was left with no eligible backend.",
);

/// The DHCP client's phase, one series with value 1 (`ipam = "dhcp"` only).
pub static DHCP_LEASE_STATE: Family = Family::new(
    "harvester_lb_dhcp_lease_state",
    Gauge,
    "The DHCP client's state for the VIP (label state), value 1; ipam = dhcp only.",
);
/// The lease in force: address and server as labels, value 1.
pub static DHCP_LEASE_INFO: Family = Family::new(
    "harvester_lb_dhcp_lease_info",
    Gauge,
    "The VIP's DHCP lease in force (labels address, server), value 1; absent without a lease.",
);
/// When the lease in force expires.
pub static DHCP_LEASE_EXPIRY: Family = Family::new(
    "harvester_lb_dhcp_lease_expiry_timestamp_seconds",
    Gauge,
    "Unix time at which the VIP's DHCP lease expires unless renewed.",
);
/// Leases obtained by DISCOVER or INIT-REBOOT.
pub static DHCP_LEASES_ACQUIRED: Family = Family::new(
    "harvester_lb_dhcp_leases_acquired_total",
    Counter,
    "DHCP leases obtained for the VIP (DISCOVER..ACK or INIT-REBOOT).",
);
/// Leases extended by RENEW or REBIND.
pub static DHCP_RENEWALS: Family = Family::new(
    "harvester_lb_dhcp_renewals_total",
    Counter,
    "DHCP leases of the VIP extended by a RENEW or REBIND.",
);
/// NAKs taken.
pub static DHCP_NAKS: Family = Family::new(
    "harvester_lb_dhcp_naks_total",
    Counter,
    "DHCPNAKs taken for the VIP (each starts the lease over).",
);
/// Times the VIP was lost or changed.
pub static DHCP_ADDRESS_CHANGES: Family = Family::new(
    "harvester_lb_dhcp_address_changes_total",
    Counter,
    "Times the VIP's leased address was lost or replaced (NAK, expiry, a new address).",
);
/// DHCP packets ignored, by reason.
pub static DHCP_PACKETS_IGNORED: Family = Family::new(
    "harvester_lb_dhcp_packets_ignored_total",
    Counter,
    "DHCP packets ignored (label reason: malformed, xid, chaddr, rogue, unexpected, quarantined).",
);
/// DHCP offers and ACKs refused, by reason (a rogue or broken server).
pub static DHCP_OFFERS_REFUSED: Family = Family::new(
    "harvester_lb_dhcp_offers_refused_total",
    Counter,
    "DHCP offers and ACKs refused (label reason: reserved, mask_too_wide, outside_allowed_ranges, host_address, gateway, host_unreadable); the server is not listened to for 60 s.",
);

/// Times the VIP's macvlan interface or leased address was put back.
pub static DHCP_REPAIRS: Family = Family::new(
    "harvester_lb_dhcp_repairs_total",
    Counter,
    "Times the VIP's macvlan interface or leased address was found deleted or changed by another program and put back (read back every 10 s while a lease is held).",
);

/// Clients remembered by a load balancer with `session_affinity = "client_ip"`.
pub static AFFINITY_ENTRIES: Family = Family::new(
    "harvester_lb_affinity_entries",
    Gauge,
    "Client addresses the load balancer remembers a backend for (session_affinity = client_ip).",
);
/// Clients not remembered because `proxy.max_affinity_entries` was reached.
pub static AFFINITY_TABLE_FULL: Family = Family::new(
    "harvester_lb_affinity_table_full_total",
    Counter,
    "New clients served without affinity because proxy.max_affinity_entries was reached.",
);

// Per listener: labels `cluster`, `load_balancer`, `listener`.

/// 1 when a listener's socket is bound and accepting, 0 when binding failed.
pub static LISTENER_UP: Family = Family::new(
    "harvester_lb_listener_up",
    Gauge,
    "1 when the listener's socket is bound and accepting, 0 when it could not be bound.",
);
/// Client connections accepted on a listener.
pub static CONNECTIONS_ACCEPTED: Family = Family::new(
    "harvester_lb_connections_accepted_total",
    Counter,
    "Client connections accepted on the listener.",
);
/// Client connections that could not be forwarded, by `reason`.
pub static CONNECTIONS_FAILED: Family = Family::new(
    "harvester_lb_connections_failed_total",
    Counter,
    "Client connections closed without reaching a backend, by reason of the last attempt.",
);
/// Client connections refused by policy right after accept, by `reason`.
pub static CONNECTIONS_REJECTED: Family = Family::new(
    "harvester_lb_connections_rejected_total",
    Counter,
    "Client connections reset right after accept by the load balancer's policy (reason source_range: the client is outside source_ranges; load_balancer_limit: the load balancer holds its share of connections, its max_connections), before any backend connect.",
);
/// Client connections being forwarded now, per listener.
pub static CONNECTIONS_ACTIVE: Family = Family::new(
    "harvester_lb_connections_active",
    Gauge,
    "Client connections being forwarded now.",
);
/// Bytes forwarded, by `direction`.
pub static BYTES: Family = Family::new(
    "harvester_lb_bytes_total",
    Counter,
    "Bytes forwarded, by direction.",
);
/// Errors from `accept(2)`, by `kind`.
pub static ACCEPT_ERRORS: Family = Family::new(
    "harvester_lb_accept_errors_total",
    Counter,
    "Errors returned by accept(2) on the listener, by kind.",
);
/// Accepts delayed because `proxy.max_connections` was reached.
pub static CONNECTION_LIMIT_REACHED: Family = Family::new(
    "harvester_lb_connection_limit_reached_total",
    Counter,
    "Accepts on the listener delayed because proxy.max_connections was reached.",
);

// Per UDP listener: labels `cluster`, `load_balancer`, `listener`; present
// only for UDP listeners (which have none of the connection families).

/// Datagrams forwarded by a UDP listener, by `direction`.
pub static UDP_DATAGRAMS: Family = Family::new(
    "harvester_lb_udp_datagrams_total",
    Counter,
    "Datagrams forwarded by the UDP listener, by direction.",
);
/// Payload bytes forwarded by a UDP listener, by `direction`.
pub static UDP_BYTES: Family = Family::new(
    "harvester_lb_udp_bytes_total",
    Counter,
    "Datagram payload bytes forwarded by the UDP listener, by direction.",
);
/// Datagrams a UDP listener dropped, by `reason`.
pub static UDP_DATAGRAMS_DROPPED: Family = Family::new(
    "harvester_lb_udp_datagrams_dropped_total",
    Counter,
    "Datagrams the UDP listener dropped, by reason (source_range, too_large, send_failed).",
);
/// UDP flows open now.
pub static UDP_FLOWS_ACTIVE: Family = Family::new(
    "harvester_lb_udp_flows_active",
    Gauge,
    "UDP flows (client address to backend) open now.",
);
/// UDP flows made.
pub static UDP_FLOWS_CREATED: Family = Family::new(
    "harvester_lb_udp_flows_created_total",
    Counter,
    "UDP flows made, re-picks after a backend left or refused included.",
);
/// New UDP flows refused, by `reason`.
pub static UDP_FLOWS_DROPPED: Family = Family::new(
    "harvester_lb_udp_flows_dropped_total",
    Counter,
    "New UDP flows refused (their datagram dropped), by reason (table_full, source_limit, no_backend, no_socket, load_balancer_limit: the load balancer holds its share of proxy.max_udp_flows).",
);
/// UDP flows open to a backend now; labels add `backend`.
pub static UDP_BACKEND_FLOWS_ACTIVE: Family = Family::new(
    "harvester_lb_udp_backend_flows_active",
    Gauge,
    "UDP flows of the listener open to the backend now: the proxy's, plus, for a forwarding = \"kernel\" listener, its conntrack entries answered by the backend (counted every 5 s).",
);
/// ICMP errors (port unreachable) from a backend; labels add `backend`.
pub static UDP_BACKEND_ICMP_ERRORS: Family = Family::new(
    "harvester_lb_udp_backend_icmp_errors_total",
    Counter,
    "ICMP errors (port unreachable: ECONNREFUSED on the flow's socket) from the backend; the flow is re-picked.",
);

// Per backend: labels `cluster`, `load_balancer`, `backend`.

/// 1 when a backend's health check finds it healthy, else 0.
pub static BACKEND_UP: Family = Family::new(
    "harvester_lb_backend_up",
    Gauge,
    "1 when the health check finds the backend healthy (on every checked backend port, for per-listener checks), 0 when not.",
);
/// Per-listener checks only (a health check without `port`): 1 when the
/// backend's nodeport `backend_port` is healthy, else 0. Labels `cluster`,
/// `load_balancer`, `backend`, `backend_port`.
pub static BACKEND_PORT_UP: Family = Family::new(
    "harvester_lb_backend_port_up",
    Gauge,
    "Per-listener health checks only: 1 when the backend's backend_port answers its check, 0 when not.",
);
/// Connections open to a backend now.
pub static BACKEND_CONNECTIONS_ACTIVE: Family = Family::new(
    "harvester_lb_backend_connections_active",
    Gauge,
    "Connections open to the backend now: the proxy's, plus the TCP connections of kernel listeners open in conntrack (counted every 5 s).",
);
/// Connections (TCP) and flows (UDP) the proxy opened to a backend.
pub static BACKEND_CONNECTIONS: Family = Family::new(
    "harvester_lb_backend_connections_total",
    Counter,
    "Connections and UDP flows the proxy opened to the backend since the daemon started (kernel listeners': harvester_lb_kernel_backend_connections_total).",
);
/// Bytes the proxy moved to and from a backend, by `direction`.
pub static BACKEND_BYTES: Family = Family::new(
    "harvester_lb_backend_bytes_total",
    Counter,
    "Payload bytes the proxy moved between the clients and the backend, TCP and UDP, by direction (kernel listeners count none).",
);
/// Seconds a backend has been unhealthy.
pub static BACKEND_DOWN_SECONDS: Family = Family::new(
    "harvester_lb_backend_down_seconds_total",
    Counter,
    "Seconds the health check has found the backend unhealthy since the daemon started, the current period included.",
);
/// When a backend's health or operator's state last changed.
pub static BACKEND_LAST_CHANGE: Family = Family::new(
    "harvester_lb_backend_last_change_timestamp_seconds",
    Gauge,
    "Unix time of the backend's last change of health or operator's state; absent until it changes.",
);
/// The operator's state of a backend: one series, `state` = the current one.
pub static BACKEND_ADMIN_STATE: Family = Family::new(
    "harvester_lb_backend_admin_state",
    Gauge,
    "The operator's state of the backend (ready, drain or maint) in the state label; the value is always 1.",
);
/// Open connections the daemon closed, by `reason`.
pub static BACKEND_CONNECTIONS_CLOSED: Family = Family::new(
    "harvester_lb_backend_connections_closed_total",
    Counter,
    "Open connections to the backend closed by the daemon, by reason (marked_down: on_backend_down = close).",
);
/// Failed connect attempts to one backend, by `reason`.
pub static BACKEND_CONNECT_FAILURES: Family = Family::new(
    "harvester_lb_backend_connect_failures_total",
    Counter,
    "Failed connect attempts to the backend (retries included), by reason.",
);
/// Health probes, by `result`.
pub static HEALTH_CHECKS: Family = Family::new(
    "harvester_lb_health_checks_total",
    Counter,
    "Health probes of the backend, by result.",
);
/// Health state changes of a backend, by `to`.
pub static HEALTH_TRANSITIONS: Family = Family::new(
    "harvester_lb_health_transitions_total",
    Counter,
    "Health state changes of the backend, by new state.",
);
/// Duration of health probes: one histogram for the daemon, or one per
/// backend when `metrics.per_backend_health_check_duration` is set.
pub static HEALTH_CHECK_DURATION: Family = Family::new(
    "harvester_lb_health_check_duration_seconds",
    Histogram,
    "Duration of one health probe.",
);

// Per process: no labels unless named.

/// Load balancers in the config in force.
pub static CONFIG_LOAD_BALANCERS: Family = Family::new(
    "harvester_lb_config_load_balancers",
    Gauge,
    "Load balancers in the configuration in force.",
);
/// Distinct health probes sent each period.
pub static HEALTH_CHECK_STREAMS: Family = Family::new(
    "harvester_lb_health_check_streams",
    Gauge,
    "Distinct health probes sent each period, shared by the load balancers that check the same address and port alike.",
);
/// 1 when the last (re)load succeeded.
pub static CONFIG_LAST_RELOAD_SUCCESSFUL: Family = Family::new(
    "harvester_lb_config_last_reload_successful",
    Gauge,
    "1 when the last configuration reload succeeded.",
);
/// Unix time of the last successful (re)load.
pub static CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP: Family = Family::new(
    "harvester_lb_config_last_reload_success_timestamp_seconds",
    Gauge,
    "Unix time of the last successful configuration load.",
);
/// `vip.isolate`: 1 when the nftables table in the kernel is the one the
/// config in force asks for (as last read back), 0 when writing it failed
/// or the kernel's differs and could not be repaired; absent when isolation
/// is off.
pub static VIP_ISOLATION_UP: Family = Family::new(
    "harvester_lb_vip_isolation_up",
    Gauge,
    "1 when the VIP isolation table in the kernel is the one of the configuration in force, 0 when writing it failed or it differs and could not be repaired.",
);
/// `vip.isolate`: times the table was found changed or gone in the kernel
/// (another process wrote it: a second daemon, `nft flush ruleset`) and
/// written again; each is logged at warn with what differed.
pub static VIP_ISOLATION_REPAIRS: Family = Family::new(
    "harvester_lb_vip_isolation_repairs_total",
    Counter,
    "Times the VIP isolation table was found changed or removed in the kernel by another process and written again.",
);
/// Load balancers refused at the last apply because their VIP is the
/// host's own address, the gateway of one of its routes, or outside
/// `vip.announce_prefixes` (`/status` `vip_refused` names each).
pub static VIP_REFUSED: Family = Family::new(
    "harvester_lb_vip_refused_load_balancers",
    Gauge,
    "Load balancers refused at the last apply because their VIP is this host's own address, the gateway of one of its routes, or outside vip.announce_prefixes; /status vip_refused names each.",
);
/// Repairs of the objects the daemon writes into the host, by `kind`
/// (see `crate::host::owned`): each a read-back that found an object not as this
/// daemon wrote it, logged at warn with what differed, and written again.
pub static HOST_REPAIRS: Family = Family::new(
    "harvester_lb_host_repairs_total",
    Counter,
    "Objects this daemon wrote into the host (isolation_table, nat_tables, announce_route, vip_local_route, dhcp_lease, network_route) found changed or removed by another process and written again, by kind; each logged at warn with what differed.",
);
/// `vip.announce = "routes"`: 1 while this host's route for the VIP is
/// in the announcing table.
pub static VIP_ANNOUNCED: Family = Family::new(
    "harvester_lb_vip_announced",
    Gauge,
    "1 while this host announces the VIP (its route is in vip.announce_table), else 0.",
);
/// `vip.announce = "routes"`: routes written and deleted, by `direction`.
pub static VIP_ANNOUNCE_TRANSITIONS: Family = Family::new(
    "harvester_lb_vip_announce_transitions_total",
    Counter,
    "Times this host announced (direction=announce) or withdrew (direction=withdraw) the VIP's route.",
);
/// `vip.announce = "routes"`: 1 for the reason the VIP is not announced.
pub static VIP_ANNOUNCE_REASON: Family = Family::new(
    "harvester_lb_vip_announce_reason",
    Gauge,
    "1 for the reason this host does not announce the VIP now (no_eligible_backend, drained, stopping, damped, waiting), 0 for the others; all 0 while announced.",
);
/// `vip.announce = "routes"`: writes the kernel refused.
pub static VIP_ANNOUNCE_ERRORS: Family = Family::new(
    "harvester_lb_vip_announce_errors_total",
    Counter,
    "Route or address writes for vip.announce the kernel refused (each logged at error and retried).",
);
/// `vip.announce = "routes"`: repairs of the announce table.
pub static VIP_ANNOUNCE_REPAIRS: Family = Family::new(
    "harvester_lb_vip_announce_repairs_total",
    Counter,
    "Read-backs of vip.announce_table that found this daemon's routes not as it wrote them (one deleted or added by another process), each repaired and logged at warn.",
);
/// Connection log lines dropped by the rate bound (see
/// `crate::metrics::CONNECTION_LOG_LINES_DROPPED`).
pub static CONNECTION_LOG_LINES_DROPPED: Family = Family::new(
    "harvester_lb_connection_log_lines_dropped_total",
    Counter,
    "Connection log lines not written because log.max_connection_lines_per_second was reached.",
);
/// Log lines lost because stderr was not read fast enough (the queue of
/// `crate::logging` was full) or could not be written at all.
pub static LOG_LINES_DROPPED: Family = Family::new(
    "harvester_lb_log_lines_dropped_total",
    Counter,
    "Log lines lost because stderr was not being read (the log queue was full) or could not be written; the log says how many once the writer catches up.",
);
/// `forwarding = "kernel"`: 1 when the nftables NAT table of the config
/// in force is in the kernel, 0 when the last write failed (the kernel
/// listeners' new connections go to the proxy); absent before any kernel
/// listener.
pub static KERNEL_FORWARDING_UP: Family = Family::new(
    "harvester_lb_kernel_forwarding_up",
    Gauge,
    "1 when the kernel NAT table of the configuration in force and the current health verdicts is in the kernel, 0 when writing it failed and the proxy serves the kernel listeners, or a check found it changed by another process until it is written again.",
);
/// `forwarding = "kernel"`: 1 while another program's forward chain
/// (Docker's `policy drop`) would drop what the kernel forwards, so the
/// kernel listeners of that family are served by the proxy.
pub static KERNEL_FORWARD_BLOCKED: Family = Family::new(
    "harvester_lb_kernel_forward_blocked",
    Gauge,
    "1 while a forward chain of another program (e.g. Docker's policy drop) drops the connections the kernel forwards; the kernel listeners of that family are served by the proxy meanwhile (see /status kernel_error).",
);
/// `forwarding = "kernel"`: load balancers narrowed out of the NAT
/// tables' write because the kernel refuses their listeners.
pub static KERNEL_REFUSED: Family = Family::new(
    "harvester_lb_kernel_refused_load_balancers",
    Gauge,
    "Load balancers whose kernel listeners the kernel refused at the last write of the NAT tables: narrowed out of it and served by the proxy (retried every 30 s and at each reload); /status kernel_error names the cause.",
);
/// Writes of the kernel NAT table, by `result`.
pub static KERNEL_SYNCS: Family = Family::new(
    "harvester_lb_kernel_syncs_total",
    Counter,
    "Transactions written to the kernel NAT table (one per coalesced change of kernel listeners or of their eligible backends), by result.",
);
/// `forwarding = "kernel"`: times a check (every 10 s and at each reload)
/// found the kernel NAT tables not as this daemon wrote them (a table,
/// chain, rule or element changed or deleted by another process) and
/// wrote them again; each is logged at warn with what differed.
pub static KERNEL_REPAIRS: Family = Family::new(
    "harvester_lb_kernel_repairs_total",
    Counter,
    "Times the kernel NAT tables were found changed or removed by another process (a table, chain, rule or element) and written again.",
);
/// How long the last successful write of the kernel NAT table took.
pub static KERNEL_SYNC_DURATION: Family = Family::new(
    "harvester_lb_kernel_sync_duration_seconds",
    Gauge,
    "How long the last successful transaction to the kernel NAT table took, nft included.",
);
/// New connections the kernel sent to a backend of a kernel listener.
pub static KERNEL_BACKEND_CONNECTIONS: Family = Family::new(
    "harvester_lb_kernel_backend_connections_total",
    Counter,
    "New connections the kernel forwarded to a backend of a forwarding = \"kernel\" listener (its nftables named counter, read every 5 s).",
);
/// The host's conntrack entries now (`nf_conntrack_count`).
pub static CONNTRACK_ENTRIES: Family = Family::new(
    "harvester_lb_conntrack_entries",
    Gauge,
    "Connection tracking entries in use on this host (net.netfilter.nf_conntrack_count); kernel listeners hold one per flow, and a closed TCP connection for 120 s more.",
);
/// The host's conntrack table size (`nf_conntrack_max`).
pub static CONNTRACK_MAX: Family = Family::new(
    "harvester_lb_conntrack_max",
    Gauge,
    "Size of this host's connection tracking table (net.netfilter.nf_conntrack_max): a new flow beyond it is dropped.",
);
/// The state file at start (issue 41): 1 on the series of its outcome.
pub static STATE_FILE_OUTCOME: Family = Family::new(
    "harvester_lb_state_file_outcome",
    Gauge,
    "What start made of the state file: 1 on the outcome (restored, missing, none, or why it was ignored: corrupt, stale, future, other_config, unknown_version, unreadable).",
);
/// Entries the state file put back at start, by `kind`.
pub static STATE_RESTORED: Family = Family::new(
    "harvester_lb_state_restored",
    Gauge,
    "Entries the state file put back at start, by kind (operator_state, verdict, affinity_entry).",
);
/// Writes of the state file, by `result`.
pub static STATE_FILE_WRITES: Family = Family::new(
    "harvester_lb_state_file_writes_total",
    Counter,
    "Writes of the state file, by result (success, failure).",
);
/// Reloads, by `result`.
pub static CONFIG_RELOADS: Family = Family::new(
    "harvester_lb_config_reloads_total",
    Counter,
    "Configuration (re)loads, the initial load included, by result.",
);
/// The connection cap in force (`proxy.max_connections`, or what the
/// open-file limit allows): what `connections_active` summed over every
/// listener is measured against.
pub static CONNECTIONS_LIMIT: Family = Family::new(
    "harvester_lb_connections_limit",
    Gauge,
    "The cap on forwarded connections across all listeners (proxy.max_connections, or what the open-file limit allows).",
);
/// `[keepalived]`: writes of the rendered keepalived.conf and reloads of
/// keepalived that failed (each logged at error and retried).
pub static KEEPALIVED_RELOAD_FAILURES: Family = Family::new(
    "harvester_lb_keepalived_reload_failures_total",
    Counter,
    "Times writing the rendered keepalived configuration or telling keepalived to reload it failed (each logged at error and retried every 10 s and at every reload).",
);
/// `[[network]] isolate`: 1 when the VM-network guard table
/// (`inet harvester_lb_vmnet`) in the kernel is the one of the config in
/// force (as last read back), 0 when writing or reading it failed; absent
/// when no network is isolated.
pub static VM_NETWORK_GUARD_UP: Family = Family::new(
    "harvester_lb_vm_network_guard_up",
    Gauge,
    "1 when the VM-network guard table (inet harvester_lb_vmnet) in the kernel is the one of the configuration in force, 0 when writing or reading it back failed (the isolated networks' VIPs are then not ready).",
);
/// `[[network]] isolate`: writes and read-backs of the guard table that
/// failed (each logged at error and retried every 10 s and at every apply).
pub static VM_NETWORK_GUARD_FAILURES: Family = Family::new(
    "harvester_lb_vm_network_guard_failures_total",
    Counter,
    "Times writing or reading back the VM-network guard table failed (each logged at error and retried every 10 s and at every reload).",
);
/// `[conntrackd]`: whether conntrackd answered the last `-s` (every 10 s).
pub static CONNTRACK_SYNC_UP: Family = Family::new(
    "harvester_lb_conntrack_sync_up",
    Gauge,
    "Whether conntrackd answered `conntrackd -C conntrackd.config_path -s` at the last check (every 10 s): 0 means no flow is synced and a VIP's move resets its open connections.",
);
/// `[conntrackd]`: the sync's transport, by `transport` (the one in use).
pub static CONNTRACK_SYNC_TRANSPORT: Family = Family::new(
    "harvester_lb_conntrack_sync_transport",
    Gauge,
    "1 for the sync's transport (conntrackd.transport): unicast (FTFW: acknowledged and resent, an alive message every second) or multicast (NOTRACK, for three and more hosts: nothing is sent while no synced flow changes, and nothing is resent).",
);
/// `[conntrackd]`: entries of conntrackd's caches, by `cache`.
pub static CONNTRACK_SYNC_ENTRIES: Family = Family::new(
    "harvester_lb_conntrack_sync_entries",
    Gauge,
    "Flows in conntrackd's caches: internal (this host's own kernel listeners' flows, sent to the peer) and external (the peer's, committed when a VIP moves here).",
);
/// `[conntrackd]`: packets on the sync link, by `direction`.
pub static CONNTRACK_SYNC_PACKETS: Family = Family::new(
    "harvester_lb_conntrack_sync_packets_total",
    Counter,
    "Packets conntrackd sent to and received from the peer on the sync link (FTFW sends an alive message every second when idle: received not moving means the link or the peer is down).",
);
/// `[conntrackd]`: send errors on the sync link.
pub static CONNTRACK_SYNC_SEND_ERRORS: Family = Family::new(
    "harvester_lb_conntrack_sync_send_errors_total",
    Counter,
    "Packets conntrackd failed to send on the sync link.",
);
/// `[conntrackd]`: sync messages the peer sent that never arrived.
pub static CONNTRACK_SYNC_LOST: Family = Family::new(
    "harvester_lb_conntrack_sync_lost_messages_total",
    Counter,
    "Sync messages from the peer that conntrackd found missing (FTFW asks for them again).",
);
/// `[conntrackd]`: commits of the external cache at a takeover, by
/// `instance` and `result`.
pub static CONNTRACK_SYNC_COMMITS: Family = Family::new(
    "harvester_lb_conntrack_sync_commits_total",
    Counter,
    "Commits of the flows synced from the peer into this host's kernel when keepalived made it master of an instance (conntrackd -c in the notify script), by result; a failed one resets the moved connections.",
);
/// `[conntrackd]`: how long the last commit of an instance took.
pub static CONNTRACK_SYNC_COMMIT_DURATION: Family = Family::new(
    "harvester_lb_conntrack_sync_last_commit_duration_seconds",
    Gauge,
    "How long the last commit (conntrackd -c) took when this host became master of the instance; new flows of its VIPs wait at the gate meanwhile.",
);
/// `[conntrackd]`: when the last commit of an instance ended.
pub static CONNTRACK_SYNC_COMMIT_TIME: Family = Family::new(
    "harvester_lb_conntrack_sync_last_commit_timestamp_seconds",
    Gauge,
    "When the last commit of the instance ended (Unix time), as the notify script recorded it.",
);
/// `[conntrackd]`: an instance's last keepalived transition, by `state`.
pub static VRRP_STATE: Family = Family::new(
    "harvester_lb_vrrp_state",
    Gauge,
    "The last keepalived transition of each VRRP instance on this host, as its notify script recorded it: 1 for the state it is in (MASTER, BACKUP, FAULT, STOP).",
);
/// `[conntrackd]`: when an instance's last transition happened.
pub static VRRP_TRANSITION_TIME: Family = Family::new(
    "harvester_lb_vrrp_last_transition_timestamp_seconds",
    Gauge,
    "When the instance's last keepalived transition happened (Unix time).",
);
/// `[conntrackd]`: whether an instance's gate lets new flows in.
pub static CONNTRACK_SYNC_GATE_OPEN: Family = Family::new(
    "harvester_lb_conntrack_sync_gate_open",
    Gauge,
    "Whether the instance's gate (nftables table inet harvester_lb_gate, as read back) lets new flows of its kernel listeners in: 1 open (master after its commit), 0 closed (backup, fault, or master waiting for its commit).",
);
/// `[conntrackd]`: failed writes of conntrackd.conf or the notify script,
/// failed restarts of conntrackd, failed writes of the gate.
pub static CONNTRACK_SYNC_FAILURES: Family = Family::new(
    "harvester_lb_conntrack_sync_config_failures_total",
    Counter,
    "Times writing conntrackd.conf or the notify script, running conntrackd.restart_command or writing the gate table failed (each logged at error and retried every 10 s).",
);
/// `[conntrackd]`: conntrackd runs with an older file than the one
/// written (its filter lacks the backends added since).
pub static CONNTRACK_SYNC_RESTART_PENDING: Family = Family::new(
    "harvester_lb_conntrack_sync_restart_pending",
    Gauge,
    "1 while conntrackd runs with an older conntrackd.conf than the one the daemon wrote (conntrackd reads it only at start, its uptime tells when it started, to the minute): the flows of backends added since are not synced and are reset at a VIP's move until conntrackd restarts.",
);
/// Admin connections closed to make room for a newcomer.
pub static ADMIN_CONNECTIONS_SHED: Family = Family::new(
    "harvester_lb_admin_connections_shed_total",
    Counter,
    "Admin connections (admin.listen or admin.socket) closed to make room for a newcomer: at the cap, the one idle longest without a request in service.",
);
/// Descriptors the process holds now (the name every Prometheus client's
/// process collector uses, so existing descriptor alerts apply as they are).
pub static PROCESS_OPEN_FDS: Family = Family::new(
    "process_open_fds",
    Gauge,
    "Number of open file descriptors.",
);
/// The soft open-file limit in force.
pub static PROCESS_MAX_FDS: Family = Family::new(
    "process_max_fds",
    Gauge,
    "Maximum number of open file descriptors.",
);
/// When the process started (the standard process collector's name).
pub static PROCESS_START_TIME_SECONDS: Family = Family::new(
    "process_start_time_seconds",
    Gauge,
    "Start time of the process since unix epoch in seconds.",
);
/// CPU time the process has spent, user and system.
pub static PROCESS_CPU_SECONDS: Family = Family::new(
    "process_cpu_seconds_total",
    Counter,
    "Total user and system CPU time spent in seconds.",
);
/// Resident memory of the process.
pub static PROCESS_RESIDENT_MEMORY_BYTES: Family = Family::new(
    "process_resident_memory_bytes",
    Gauge,
    "Resident memory size in bytes.",
);
/// Build information, value 1, with `version` and `commit` labels.
pub static BUILD_INFO: Family = Family::new(
    "harvester_lb_build_info",
    Gauge,
    "Build information; the value is always 1.",
);
/// Listening sockets this process took from systemd's store at start
/// instead of binding (issue 41): 0 after a stop and start.
pub static RESTART_ADOPTED_LISTENING_SOCKETS: Family = Family::new(
    "harvester_lb_restart_adopted_listening_sockets",
    Gauge,
    "Listening sockets this process took from systemd's file descriptor store at start instead of binding them (0 after a stop and start, or the first start).",
);
/// What the last process handed over, by `kind`; absent after a start
/// that followed no hand-over.
pub static RESTART_HANDED_OVER: Family = Family::new(
    "harvester_lb_restart_handed_over",
    Gauge,
    "What the last process of the unit handed to this one at its restart, by kind (listening_sockets, connections, flows, lost); absent when this process started after no hand-over.",
);
/// The last restart's window: from the last process's last accept to this
/// one's first.
pub static RESTART_WINDOW_SECONDS: Family = Family::new(
    "harvester_lb_restart_window_seconds",
    Gauge,
    "Seconds from the last process's last accept to this process's first at the restart that started it (new clients waited in the kernel's accept queues meanwhile, none refused); absent when this process started after no hand-over.",
);
/// Hand-overs this process did (0 or 1: it exits after one).
pub static HAND_OVERS: Family = Family::new(
    "harvester_lb_hand_overs_total",
    Counter,
    "Times this process handed its sockets to the next process instead of draining (seen during the hand-over only: the process exits after it).",
);
/// Restarts announced by `prepare-stop` that drained instead, by `reason`.
pub static HAND_OVER_FALLBACKS: Family = Family::new(
    "harvester_lb_hand_over_fallbacks_total",
    Counter,
    "Restarts announced by prepare-stop that fell back to the drain of a stop, by reason (no_store, store_too_small, intent_expired); each is also a warning naming it.",
);

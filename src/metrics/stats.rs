//! The numbers each live object keeps: plain atomics inside the object,
//! labelled by the object's own identity.
//!
//! There is one stats object per identity (a load balancer by cluster and
//! name, a listener by its name within the load balancer, a backend by its
//! address within the load balancer), found through [`Metrics`] while it
//! lives. Whoever serves that identity holds an `Arc` to it: the load
//! balancer, a listener's route, a backend, and through them every open
//! connection. When the last holder goes, the stats go, and their series
//! with them: nothing is kept for an object that no longer exists. A name
//! that returns while its predecessor is still draining finds the same
//! stats, so its counters continue and no series is exposed twice.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU8, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use arc_swap::ArcSwapOption;

use super::Metrics;
use super::by_label::{ByLabel, labels};

/// A monotonic count.
#[derive(Debug, Default)]
pub struct Counter(AtomicU64);

impl Counter {
    /// Zero, for a `static` (a count that belongs to no object).
    pub const fn new() -> Self {
        Self(AtomicU64::new(0))
    }

    /// Adds `n`.
    pub fn increment(&self, n: u64) {
        self.0.fetch_add(n, Ordering::Relaxed);
    }

    /// The count now.
    pub fn get(&self) -> u64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A value that goes up and down (open connections).
#[derive(Debug, Default)]
pub struct Gauge(AtomicI64);

impl Gauge {
    /// One more.
    pub fn increment(&self) {
        self.0.fetch_add(1, Ordering::Relaxed);
    }

    /// One fewer.
    pub fn decrement(&self) {
        self.0.fetch_sub(1, Ordering::Relaxed);
    }
    /// `n` fewer.
    pub fn subtract(&self, n: u64) {
        self.0
            .fetch_sub(i64::try_from(n).unwrap_or(i64::MAX), Ordering::Relaxed);
    }

    /// The value now.
    pub fn get(&self) -> i64 {
        self.0.load(Ordering::Relaxed)
    }
}

/// A 0/1 gauge that exists only while its object is in the config in force
/// (`backend_up`, `listener_up`, `no_eligible_backend`): a removed backend
/// must not keep reporting that it is down and fire alerts.
#[derive(Debug, Default)]
pub struct Presence(AtomicU8);

const ABSENT: u8 = 0;
const FALSE: u8 = 1;
const TRUE: u8 = 2;

impl Presence {
    /// Present with this value.
    pub fn set(&self, value: bool) {
        self.0
            .store(if value { TRUE } else { FALSE }, Ordering::Relaxed);
    }

    /// Absent: the object left the config in force.
    pub fn clear(&self) {
        self.0.store(ABSENT, Ordering::Relaxed);
    }

    /// `None` while absent.
    pub fn get(&self) -> Option<bool> {
        match self.0.load(Ordering::Relaxed) {
            ABSENT => None,
            v => Some(v == TRUE),
        }
    }
}

/// Upper bounds of the probe-duration buckets, in seconds: from a loopback
/// connect (~50 µs) to the longest sensible timeout.
pub const PROBE_BUCKETS: [f64; 16] = [
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

/// A fixed-bucket histogram of durations: one atomic add per bucket hit, no
/// sample kept, so it costs the same whether anybody scrapes or not.
#[derive(Debug, Default)]
pub struct Histogram {
    /// Non-cumulative counts; the last slot is above the last bound (`+Inf`).
    buckets: [AtomicU64; PROBE_BUCKETS.len() + 1],
    sum_nanos: AtomicU64,
}

impl Histogram {
    /// Counts one observation.
    pub fn record(&self, d: Duration) {
        let secs = d.as_secs_f64();
        let slot = PROBE_BUCKETS
            .iter()
            .position(|&le| secs <= le)
            .unwrap_or(PROBE_BUCKETS.len());
        self.buckets[slot].fetch_add(1, Ordering::Relaxed);
        let nanos = u64::try_from(d.as_nanos()).unwrap_or(u64::MAX);
        self.sum_nanos.fetch_add(nanos, Ordering::Relaxed);
    }

    /// Cumulative bucket counts (the last is the total count) and the sum in seconds.
    pub fn read(&self) -> ([u64; PROBE_BUCKETS.len() + 1], f64) {
        let mut out = [0; PROBE_BUCKETS.len() + 1];
        let mut total = 0;
        for (o, b) in out.iter_mut().zip(&self.buckets) {
            total += b.load(Ordering::Relaxed);
            *o = total;
        }
        (out, self.sum_nanos.load(Ordering::Relaxed) as f64 / 1e9)
    }
}

/// A map from an identity to the live stats object of that identity.
pub(crate) type Live<K, V> = Mutex<HashMap<K, Weak<V>>>;

fn lock<K, V>(m: &Live<K, V>) -> std::sync::MutexGuard<'_, HashMap<K, Weak<V>>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// The live object of `key`, or a new one made by `make` and registered.
pub(crate) fn get_or_insert<K: std::hash::Hash + Eq, V>(
    map: &Live<K, V>,
    key: K,
    make: impl FnOnce() -> V,
) -> Arc<V> {
    let mut m = lock(map);
    if let Some(live) = m.get(&key).and_then(Weak::upgrade) {
        return live;
    }
    let new = Arc::new(make());
    m.insert(key, Arc::downgrade(&new));
    new
}

/// Forgets `key` if it still names `this` (a successor registered after
/// `this` began to drop keeps its entry).
pub(crate) fn forget<K: std::hash::Hash + Eq, V>(map: &Live<K, V>, key: &K, this: *const V) {
    let mut m = lock(map);
    if m.get(key).is_some_and(|w| std::ptr::eq(w.as_ptr(), this)) {
        m.remove(key);
    }
}

/// Every live object of `map`. The caller drops them after the lock is
/// released (dropping the last `Arc` takes the lock again).
pub(crate) fn live<K, V>(map: &Live<K, V>) -> Vec<Arc<V>> {
    lock(map).values().filter_map(Weak::upgrade).collect()
}

/// One load balancer's numbers, and the registry of its listeners and backends.
pub struct LbStats {
    /// Where it is registered; `None` for stats nobody renders (tests, benches).
    pub(crate) registry: Option<Arc<Metrics>>,
    /// Label `cluster`.
    pub cluster: Box<str>,
    /// Label `load_balancer`.
    pub name: Box<str>,
    /// `no_eligible_backend`.
    pub no_backend: Presence,
    /// `no_eligible_backend_events_total`.
    pub no_backend_events: Counter,
    /// Whether client affinity is on: `affinity_entries` is exposed only then.
    pub affinity_enabled: AtomicBool,
    /// `affinity_entries`.
    pub affinity_entries: Gauge,
    /// `affinity_table_full_total`.
    pub affinity_full: Counter,
    /// By name and whether it is a UDP listener: a listener that changes
    /// protocol gets fresh numbers, never the other kind's.
    pub(crate) listeners: Live<(Box<str>, bool), ListenerStats>,
    pub(crate) backends: Live<IpAddr, BackendStats>,
    /// The VIP's DHCP lease, for a load balancer with `ipam = "dhcp"`.
    pub dhcp: std::sync::Mutex<Option<Arc<LeaseStats>>>,
}

impl LbStats {
    pub(crate) fn new(registry: Option<Arc<Metrics>>, cluster: &str, name: &str) -> Self {
        Self {
            registry,
            cluster: cluster.into(),
            name: name.into(),
            no_backend: Presence::default(),
            no_backend_events: Counter::default(),
            affinity_enabled: AtomicBool::new(false),
            affinity_entries: Gauge::default(),
            affinity_full: Counter::default(),
            listeners: Live::default(),
            backends: Live::default(),
            dhcp: std::sync::Mutex::new(None),
        }
    }

    /// The lease numbers of this load balancer's VIP, if it is leased.
    pub fn lease(&self) -> Option<Arc<LeaseStats>> {
        self.dhcp.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Attaches (or detaches) the lease numbers shown with this load balancer.
    pub fn set_lease(&self, lease: Option<Arc<LeaseStats>>) {
        *self.dhcp.lock().unwrap_or_else(|p| p.into_inner()) = lease;
    }

    /// Stats that belong to no registry and are never rendered: for unit
    /// tests and benchmarks that build a load balancer by hand.
    pub fn detached() -> Arc<Self> {
        Arc::new(Self::new(None, "", ""))
    }

    /// The stats of TCP listener `name` of this load balancer.
    pub fn listener(self: &Arc<Self>, name: &str) -> Arc<ListenerStats> {
        self.listener_of(name, false)
    }

    /// The stats of UDP listener `name` of this load balancer: the same
    /// numbers as a TCP listener's, plus [`UdpStats`].
    pub fn udp_listener(self: &Arc<Self>, name: &str) -> Arc<ListenerStats> {
        self.listener_of(name, true)
    }

    fn listener_of(self: &Arc<Self>, name: &str, udp: bool) -> Arc<ListenerStats> {
        get_or_insert(&self.listeners, (name.into(), udp), || ListenerStats {
            lb: Arc::clone(self),
            name: name.into(),
            up: Presence::default(),
            accepted: Counter::default(),
            failed: Default::default(),
            rejected: Default::default(),
            active: Gauge::default(),
            client_to_backend: Counter::default(),
            backend_to_client: Counter::default(),
            accept_errors: Default::default(),
            limit_reached: Counter::default(),
            udp: if udp {
                OnceLock::from(Box::default())
            } else {
                OnceLock::new()
            },
        })
    }

    /// The stats of backend `addr` of this load balancer.
    pub fn backend(self: &Arc<Self>, addr: IpAddr) -> Arc<BackendStats> {
        get_or_insert(&self.backends, addr, || BackendStats {
            lb: Arc::clone(self),
            addr,
            up: Presence::default(),
            active: Gauge::default(),
            kernel_active: AtomicU64::new(0),
            connections: Counter::default(),
            bytes: Default::default(),
            connect_failures: Default::default(),
            checks: Default::default(),
            transitions: Default::default(),
            admin_state: AtomicU8::new(0),
            times: StateTimes::default(),
            closed: Default::default(),
            duration: OnceLock::new(),
            ports: ArcSwapOption::empty(),
        })
    }
}

impl Drop for LbStats {
    fn drop(&mut self) {
        if let Some(registry) = &self.registry {
            registry.forget_load_balancer(self);
        }
    }
}

labels! {
    /// Why a client connection got no backend.
    pub enum FailedReason;
    /// `connections_failed_total{reason}`.
    pub const FAILED_REASONS = {
        /// No backend was eligible.
        NoBackend = "no_backend",
        /// The last backend tried refused the connection.
        ConnectRefused = "connect_refused",
        /// The last backend tried did not answer in time.
        ConnectTimeout = "connect_timeout",
        /// Any other failure to connect, or to send the PROXY header.
        ConnectError = "connect_error",
    };
}

labels! {
    /// Why a client was refused at accept.
    pub enum RejectedReason;
    /// `connections_rejected_total{reason}`.
    pub const REJECTED_REASONS = {
        /// Outside the load balancer's `source_ranges`.
        SourceRange = "source_range",
        /// The load balancer's share of the connection cap was taken.
        LoadBalancerLimit = "load_balancer_limit",
    };
}

labels! {
    /// What an accept failed for.
    pub enum AcceptErrorKind;
    /// `accept_errors_total{kind}`.
    pub const ACCEPT_ERROR_KINDS = {
        /// `EMFILE` or `ENFILE`.
        OutOfDescriptors = "out_of_descriptors",
        /// `ENOBUFS` or `ENOMEM`.
        OutOfMemory = "out_of_memory",
        /// Anything else.
        Other = "other",
    };
}

labels! {
    /// A kind of object the daemon writes into the host and owns (reads
    /// back and repairs: see `crate::host::owned`).
    pub enum HostKind;
    /// `host_repairs_total{kind}`.
    pub const HOST_KINDS = {
        /// The VIP isolation table (`inet harvester_lb`).
        IsolationTable = "isolation_table",
        /// The kernel forwarding's NAT tables.
        NatTables = "nat_tables",
        /// A VIP's route in `vip.announce_table`.
        AnnounceRoute = "announce_route",
        /// A VIP's AnyIP local route (`local VIP dev <announce_interface>
        /// table local`), how an announcing host accepts its traffic.
        VipLocalRoute = "vip_local_route",
        /// A DHCP load balancer's macvlan interface or leased address.
        DhcpLease = "dhcp_lease",
        /// A `[[network]]`'s route or a VIP's `from VIP` rule.
        NetworkRoute = "network_route",
        /// The VM-network guard table (`inet harvester_lb_vmnet`).
        VmNetworkGuard = "vm_network_guard",
        /// The conntrackd sync's gate table (`inet harvester_lb_gate`).
        SyncGate = "sync_gate",
        /// The anycast sync's guard table (`inet harvester_lb_anycast_sync`).
        AnycastSyncGuard = "anycast_sync_guard",
        /// The reply-mark table (`inet harvester_lb_reply`) or a
        /// network's `fwmark` rule.
        ReplyMark = "reply_mark",
        /// A bridged VM network's leg (a macvlan on its bridge, `hleg<table>`).
        NetworkLeg = "network_leg",
    };
}

/// Repairs of host objects, by [`HostKind`].
pub type HostRepairs = ByLabel<HostKind, { HOST_KINDS.len() }>;

labels! {
    /// Why one connect attempt to a backend failed (counted against it).
    pub enum ConnectFailureReason;
    /// `backend_connect_failures_total{reason}`.
    pub const CONNECT_FAILURE_REASONS = {
        /// Refused.
        ConnectRefused = "connect_refused",
        /// No answer within `connect_timeout_ms`.
        ConnectTimeout = "connect_timeout",
        /// Any other error.
        ConnectError = "connect_error",
    };
}

labels! {
    /// A probe's result.
    pub enum CheckResult;
    /// `health_checks_total{result}`.
    pub const CHECK_RESULTS = {
        /// Passed.
        Ok = "ok",
        /// Connection refused.
        Refused = "refused",
        /// No answer within the check's timeout.
        Timeout = "timeout",
        /// Any other connect or I/O error.
        Error = "error",
        /// Not sent (no socket could be had, say).
        Skipped = "skipped",
        /// An HTTP answer with a status not expected.
        HttpStatus = "http_status",
        /// An answer that is not HTTP.
        HttpError = "http_error",
    };
}

labels! {
    /// The state a health transition went to.
    pub enum Transition;
    /// `health_transitions_total{to}`.
    pub const TRANSITIONS = {
        /// Became healthy.
        Up = "up",
        /// Became unhealthy.
        Down = "down",
    };
}

labels! {
    /// Which way a datagram went.
    pub enum Direction;
    /// `udp_datagrams_total{direction}` and `udp_bytes_total{direction}`.
    pub const DIRECTIONS = {
        /// From the client to the backend.
        ClientToBackend = "client_to_backend",
        /// From the backend to the client.
        BackendToClient = "backend_to_client",
    };
}

/// The `state` label of `backend_admin_state`, by index: the names of
/// `AdminState::ALL` (a balancer test keeps the two in step).
pub const ADMIN_STATES: [&str; 3] = ["ready", "drain", "maint"];

labels! {
    /// Why the daemon closed a backend's open connections.
    pub enum ClosedReason;
    /// `backend_connections_closed_total{reason}`.
    pub const CLOSED_REASONS = {
        /// The backend was marked down under `on_backend_down = "close"`.
        MarkedDown = "marked_down",
    };
}

/// One listener's numbers.
pub struct ListenerStats {
    /// Its load balancer (labels `cluster`, `load_balancer`).
    pub lb: Arc<LbStats>,
    /// Label `listener`.
    pub name: Box<str>,
    /// `listener_up`.
    pub up: Presence,
    /// `connections_accepted_total`.
    pub accepted: Counter,
    /// `connections_failed_total`, by [`FAILED_REASONS`].
    pub failed: ByLabel<FailedReason, { FAILED_REASONS.len() }>,
    /// `connections_rejected_total`, by [`REJECTED_REASONS`].
    pub rejected: ByLabel<RejectedReason, { REJECTED_REASONS.len() }>,
    /// `connections_active`.
    pub active: Gauge,
    /// `bytes_total{direction="client_to_backend"}`.
    pub client_to_backend: Counter,
    /// `bytes_total{direction="backend_to_client"}`.
    pub backend_to_client: Counter,
    /// `accept_errors_total`, by [`ACCEPT_ERROR_KINDS`].
    pub accept_errors: ByLabel<AcceptErrorKind, { ACCEPT_ERROR_KINDS.len() }>,
    /// `connection_limit_reached_total`.
    pub limit_reached: Counter,
    /// A UDP listener's numbers, set when the stats are made for one
    /// ([`LbStats::udp_listener`]): a TCP listener pays one pointer-sized
    /// slot, not the table.
    pub udp: OnceLock<Box<UdpStats>>,
}

impl ListenerStats {
    /// The UDP numbers of this listener (made at the first call, for
    /// stats that were not made as a UDP listener's).
    pub fn udp(&self) -> &UdpStats {
        self.udp.get_or_init(Box::default)
    }
}

labels! {
    /// Why a UDP datagram was dropped.
    pub enum DatagramDropReason;
    /// `udp_datagrams_dropped_total{reason}`.
    pub const UDP_DATAGRAM_DROP_REASONS = {
        /// From a client outside `source_ranges`.
        SourceRange = "source_range",
        /// Larger than a backend could take whole.
        TooLarge = "too_large",
        /// The send to the backend or the client failed.
        SendFailed = "send_failed",
    };
}

labels! {
    /// Why a new UDP flow was not made.
    pub enum FlowDropReason;
    /// `udp_flows_dropped_total{reason}`.
    pub const UDP_FLOW_DROP_REASONS = {
        /// The flow table is full.
        TableFull = "table_full",
        /// The client has its most flows (`max_flows_per_source`).
        SourceLimit = "source_limit",
        /// No backend was eligible.
        NoBackend = "no_backend",
        /// No socket for the backend side could be had.
        NoSocket = "no_socket",
        /// The load balancer's share of the flow bound was taken.
        LoadBalancerLimit = "load_balancer_limit",
    };
}

/// One UDP listener's numbers.
#[derive(Debug, Default)]
pub struct UdpStats {
    /// `udp_datagrams_total`, by [`DIRECTIONS`].
    pub datagrams: ByLabel<Direction, { DIRECTIONS.len() }>,
    /// `udp_bytes_total`, by [`DIRECTIONS`] (a family of
    /// its own, so a TCP and a UDP listener of one name never write the
    /// same series while one of them drains).
    pub bytes: ByLabel<Direction, { DIRECTIONS.len() }>,
    /// `udp_datagrams_dropped_total`, by [`UDP_DATAGRAM_DROP_REASONS`].
    pub datagrams_dropped: ByLabel<DatagramDropReason, { UDP_DATAGRAM_DROP_REASONS.len() }>,
    /// `udp_flows_active`.
    pub flows_active: Gauge,
    /// `udp_flows_created_total`.
    pub flows_created: Counter,
    /// `udp_flows_dropped_total`, by [`UDP_FLOW_DROP_REASONS`].
    pub flows_dropped: ByLabel<FlowDropReason, { UDP_FLOW_DROP_REASONS.len() }>,
    /// Per backend: made at a backend's first flow, forgotten by the
    /// listener once the backend has left and its last flow ended, so a
    /// removed backend's series go.
    pub backends: Mutex<HashMap<IpAddr, Arc<UdpBackendStats>>>,
}

impl UdpStats {
    /// The numbers of `backend` on this listener.
    pub fn backend(&self, backend: IpAddr) -> Arc<UdpBackendStats> {
        let mut map = self.backends.lock().unwrap_or_else(|p| p.into_inner());
        Arc::clone(
            map.entry(backend)
                .or_insert_with(|| Arc::new(UdpBackendStats::default())),
        )
    }

    /// Drops the entries `keep` rejects whose backend has no flow open.
    pub fn retain_backends(&self, keep: impl Fn(IpAddr) -> bool) {
        let mut map = self.backends.lock().unwrap_or_else(|p| p.into_inner());
        map.retain(|ip, s| {
            keep(*ip) || s.flows_active.get() > 0 || s.kernel_flows.load(Ordering::Relaxed) > 0
        });
    }

    /// The per-backend numbers now, by address (for a scrape and `/status`).
    pub fn backends(&self) -> Vec<(IpAddr, Arc<UdpBackendStats>)> {
        let map = self.backends.lock().unwrap_or_else(|p| p.into_inner());
        let mut v: Vec<_> = map.iter().map(|(ip, s)| (*ip, Arc::clone(s))).collect();
        v.sort_by_key(|(ip, _)| *ip);
        v
    }
}

/// One backend's numbers on one UDP listener.
#[derive(Debug, Default)]
pub struct UdpBackendStats {
    /// `udp_backend_flows_active`.
    pub flows_active: Gauge,
    /// The part of `udp_backend_flows_active` the kernel forwards: the
    /// listener's conntrack entries answered by this backend, from the last
    /// count (every metrics read) while the listener is a kernel one.
    pub kernel_flows: AtomicU64,
    /// `udp_backend_icmp_errors_total`.
    pub icmp_errors: Counter,
}

impl Drop for ListenerStats {
    fn drop(&mut self) {
        let key = (self.name.clone(), self.udp.get().is_some());
        forget(&self.lb.listeners, &key, self);
    }
}

/// One backend's numbers, for one load balancer.
pub struct BackendStats {
    /// Its load balancer (labels `cluster`, `load_balancer`).
    pub lb: Arc<LbStats>,
    /// Label `backend`.
    pub addr: IpAddr,
    /// `backend_up`.
    pub up: Presence,
    /// `backend_connections_active`.
    pub active: Gauge,
    /// The part of `backend_connections_active` the kernel forwards: open
    /// TCP connections of this backend on the load balancer's kernel
    /// listeners, from the last conntrack count (every metrics read).
    pub kernel_active: AtomicU64,
    /// `backend_connections_total`: connections and UDP flows the proxy
    /// opened to it (a handed-over one counted again by the process that
    /// takes it). Beside `active`, which every connection touches at its
    /// start and end: one more relaxed add on a line already written.
    pub connections: Counter,
    /// `backend_bytes_total`, by [`DIRECTIONS`]: what the proxy moved
    /// between its clients and it, TCP and UDP (the kernel path counts no
    /// bytes: see docs/metrics.md).
    pub bytes: ByLabel<Direction, { DIRECTIONS.len() }>,
    /// `backend_connect_failures_total`, by [`CONNECT_FAILURE_REASONS`].
    pub connect_failures: ByLabel<ConnectFailureReason, { CONNECT_FAILURE_REASONS.len() }>,
    /// `health_checks_total`, by [`CHECK_RESULTS`].
    pub checks: ByLabel<CheckResult, { CHECK_RESULTS.len() }>,
    /// `health_transitions_total`, by [`TRANSITIONS`].
    pub transitions: ByLabel<Transition, { TRANSITIONS.len() }>,
    /// `backend_admin_state{state}`: the index of the operator's state in
    /// `AdminState::ALL` (`ready`, `drain`, `maint`).
    pub admin_state: AtomicU8,
    /// `backend_down_seconds_total` and `backend_last_change_timestamp_seconds`.
    pub times: StateTimes,
    /// `backend_connections_closed_total`, by [`CLOSED_REASONS`]: open
    /// connections the daemon closed because of the backend's state.
    pub closed: ByLabel<ClosedReason, { CLOSED_REASONS.len() }>,
    /// Its own probe-duration histogram, made at the first probe after
    /// `metrics.per_backend_health_check_duration` was switched on.
    pub(crate) duration: OnceLock<Box<Histogram>>,
    /// `backend_port_up`, one per checked port, only while its load
    /// balancer checks each listener's backend port on its own: a pointer
    /// that stays empty (no allocation) in the common case of one verdict.
    pub ports: ArcSwapOption<Vec<Arc<PortStats>>>,
}

/// How long a backend has been down and when its state last changed: the
/// `Dwntme` and `Lastchg` of HAProxy's `show stat`. Written only on a
/// health or operator's state change (never per connection), read by
/// scrapes and `/status`.
///
/// Three `u32`s in tenths of a second (13 years of uptime, of time down)
/// and seconds (Unix time until 2106): 12 bytes that share a word with
/// the `u8`s beside them, so the backend's numbers stay in the allocator's
/// 224-byte class (with three `u64`s they took the 256-byte one: 30,000
/// backends, 1 MB more).
#[derive(Debug, Default)]
pub struct StateTimes {
    /// While down: when it went down, tenths of a second on the monotonic
    /// clock plus one; 0 while up.
    down_since: AtomicU32,
    /// Tenths of a second down over the periods that ended.
    down_total: AtomicU32,
    /// The last change of health or operator's state, Unix seconds; 0 =
    /// none since the backend's numbers were made.
    last_change: AtomicU32,
}

/// The monotonic clock in tenths of a second.
fn monotonic_tenths() -> u32 {
    u32::try_from(crate::os::monotonic_now().as_millis() / 100).unwrap_or(u32::MAX - 1)
}

impl StateTimes {
    /// Sets the down clock to a backend made `healthy` or not (its numbers
    /// may be a draining predecessor's, whose clock then follows the new
    /// backend). Not dated: it did not change, it began.
    pub fn begin(&self, healthy: bool) {
        self.set_down(!healthy);
    }

    /// Starts or stops the down clock.
    fn set_down(&self, down: bool) {
        let now = monotonic_tenths();
        if down {
            // Already down (two ports failing at once): the first start stays.
            let _ =
                self.down_since
                    .compare_exchange(0, now + 1, Ordering::AcqRel, Ordering::Relaxed);
        } else {
            let since = self.down_since.swap(0, Ordering::AcqRel);
            if since != 0 {
                self.down_total
                    .fetch_add(now.saturating_sub(since - 1), Ordering::Relaxed);
            }
        }
    }

    /// Records a health verdict that differs from the one before: the down
    /// clock starts or stops, and the change is dated.
    pub fn health_changed(&self, healthy: bool) {
        self.set_down(!healthy);
        self.changed();
    }

    /// Dates a change of state (health or the operator's) now.
    pub fn changed(&self) {
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| u32::try_from(d.as_secs()).unwrap_or(u32::MAX));
        self.last_change.store(now, Ordering::Relaxed);
    }

    /// Seconds down in all, the current period included, to a tenth.
    pub fn down_seconds(&self) -> f64 {
        let since = self.down_since.load(Ordering::Acquire);
        let running = if since == 0 {
            0
        } else {
            monotonic_tenths().saturating_sub(since - 1)
        };
        f64::from(
            self.down_total
                .load(Ordering::Relaxed)
                .saturating_add(running),
        ) / 10.0
    }

    /// When the state last changed, Unix seconds; `None` if it never did.
    pub fn last_change_unix(&self) -> Option<f64> {
        match self.last_change.load(Ordering::Relaxed) {
            0 => None,
            secs => Some(f64::from(secs)),
        }
    }
}

/// The health of one backend on one nodeport (`backend_port_up`), for a
/// load balancer whose health check has no `port`.
#[derive(Debug)]
pub struct PortStats {
    /// Label `backend_port`.
    pub port: u16,
    /// `backend_port_up`; absent once the port or the backend left the config.
    pub up: Presence,
}

impl BackendStats {
    /// Counts one probe: its result and duration.
    pub fn record_probe(&self, result: CheckResult, took: Duration) {
        self.checks[result].increment(1);
        let Some(registry) = &self.lb.registry else {
            return;
        };
        registry.probe_duration.record(took);
        if registry.per_backend_durations.load(Ordering::Relaxed) {
            self.duration.get_or_init(Box::default).record(took);
        }
    }

    /// Counts a health transition.
    pub fn record_transition(&self, to_up: bool) {
        self.transitions[if to_up {
            Transition::Up
        } else {
            Transition::Down
        }]
        .increment(1);
    }
}

impl Drop for BackendStats {
    fn drop(&mut self) {
        forget(&self.lb.backends, &self.addr, self);
    }
}

/// The DHCP client's phases, as `harvester_lb_dhcp_lease_state{state}` and
/// `/status` name them (RFC 2131's states, lower case).
pub const LEASE_PHASES: [&str; 7] = [
    "init",
    "selecting",
    "requesting",
    "rebooting",
    "bound",
    "renewing",
    "rebinding",
];
/// Why a DHCP packet was ignored (`harvester_lb_dhcp_packets_ignored_total{reason}`).
pub const IGNORED_REASONS: [&str; 6] = [
    "malformed",
    "xid",
    "chaddr",
    "rogue",
    "unexpected",
    "quarantined",
];
/// Why a DHCP offer or ACK was refused
/// (`harvester_lb_dhcp_offers_refused_total{reason}`), in the order of
/// `host::dhcp::guard::Refusal`.
pub const REFUSAL_REASONS: [&str; 6] = [
    "reserved",
    "mask_too_wide",
    "outside_allowed_ranges",
    "host_address",
    "gateway",
    "host_unreadable",
];

/// The last offer or ACK refused, for `/status` (why a VIP has no lease),
/// where it is shown as it is kept.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct LastRefusal {
    /// The server that made it.
    pub server: std::net::Ipv4Addr,
    /// The address it offered or acknowledged.
    pub address: std::net::Ipv4Addr,
    /// Its prefix length, if it sent a mask.
    pub prefix: Option<u8>,
    /// The `reason` label.
    pub reason: &'static str,
    /// Why, in words.
    pub why: String,
    /// When, Unix seconds.
    pub at_unix: u64,
}

/// One DHCP client's numbers: written by the client as its lease changes,
/// read by scrapes and `/status`. The lease itself is a few atomics, so a
/// reader never waits on the client; a reader may see the address of a
/// new lease with the expiry of the old one for an instant, never a torn value.
#[derive(Debug, Default)]
pub struct LeaseStats {
    /// Index into [`LEASE_PHASES`].
    pub phase: AtomicU8,
    /// The leased address (`u32` of the IPv4 address); 0 = none.
    pub address: AtomicU32,
    /// Its prefix length (from the subnet mask option).
    pub prefix: AtomicU8,
    /// The server that granted it; 0 = none.
    pub server: AtomicU32,
    /// When the lease expires, Unix seconds as `f64` bits; 0 = no lease.
    pub expiry: AtomicU64,
    /// When it is renewed (T1), Unix seconds as `f64` bits.
    pub renew_at: AtomicU64,
    /// Leases obtained (DISCOVER..ACK or INIT-REBOOT).
    pub acquired: Counter,
    /// Leases extended (RENEW or REBIND answered with an ACK).
    pub renewals: Counter,
    /// NAKs taken from a server.
    pub naks: Counter,
    /// Times the VIP was lost or changed (NAK, expiry, a new address).
    pub address_changes: Counter,
    /// Packets ignored, by [`IGNORED_REASONS`].
    pub ignored: [Counter; IGNORED_REASONS.len()],
    /// Packets that could not be sent (the interface gone, say).
    pub send_errors: Counter,
    /// Offers and ACKs refused, by [`REFUSAL_REASONS`].
    pub refused: [Counter; REFUSAL_REASONS.len()],
    /// The last refusal (kept after a lease is bound: a rogue server is
    /// worth knowing about even when another one served).
    pub last_refusal: std::sync::Mutex<Option<LastRefusal>>,
    /// Times the macvlan interface or the leased address was found changed
    /// by another program and put back.
    pub repairs: Counter,
    /// Why the interface or the address could not be put back; `None` once
    /// a check finds them in place.
    pub host_error: std::sync::Mutex<Option<String>>,
}

impl LeaseStats {
    /// The leased address, if there is one.
    pub fn address(&self) -> Option<std::net::Ipv4Addr> {
        match self.address.load(Ordering::Acquire) {
            0 => None,
            a => Some(a.into()),
        }
    }

    /// The server of the lease, if there is one.
    pub fn server(&self) -> Option<std::net::Ipv4Addr> {
        match self.server.load(Ordering::Relaxed) {
            0 => None,
            a => Some(a.into()),
        }
    }

    /// The phase's name.
    pub fn phase_name(&self) -> &'static str {
        LEASE_PHASES
            .get(usize::from(self.phase.load(Ordering::Relaxed)))
            .copied()
            .unwrap_or("init")
    }

    /// Lease expiry, Unix seconds; `None` without a lease.
    pub fn expiry_unix(&self) -> Option<f64> {
        let v = f64::from_bits(self.expiry.load(Ordering::Relaxed));
        (v > 0.0 && self.address().is_some()).then_some(v)
    }

    /// The last offer or ACK refused.
    pub fn last_refusal(&self) -> Option<LastRefusal> {
        self.last_refusal
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Why the VIP's interface or address is not as the lease has it and
    /// could not be put back, if so.
    pub fn host_error(&self) -> Option<String> {
        self.host_error
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Next renewal (T1), Unix seconds; `None` without a lease.
    pub fn renew_at_unix(&self) -> Option<f64> {
        let v = f64::from_bits(self.renew_at.load(Ordering::Relaxed));
        (v > 0.0 && self.address().is_some()).then_some(v)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The down clock runs only while down, adds up over periods, and a
    /// change is dated; a backend made down starts its clock undated.
    #[test]
    fn down_time_adds_up_over_periods_and_changes_are_dated() {
        let t = StateTimes::default();
        t.begin(true);
        assert_eq!(t.down_seconds(), 0.0);
        assert_eq!(t.last_change_unix(), None);

        t.health_changed(false);
        let changed = t.last_change_unix().expect("dated");
        assert!(changed > 1.0e9, "{changed}");
        // Twice down (two ports failing at once): one period.
        t.health_changed(false);
        std::thread::sleep(Duration::from_millis(250));
        t.health_changed(true);
        let first = t.down_seconds();
        assert!(first >= 0.1, "{first}");
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(t.down_seconds(), first, "the clock runs while up");

        let made_down = StateTimes::default();
        made_down.begin(false);
        std::thread::sleep(Duration::from_millis(250));
        assert!(made_down.down_seconds() >= 0.1);
        assert_eq!(
            made_down.last_change_unix(),
            None,
            "a beginning is no change"
        );
        // A successor made healthy on the same numbers stops the clock.
        made_down.begin(true);
        let stopped = made_down.down_seconds();
        std::thread::sleep(Duration::from_millis(200));
        assert_eq!(made_down.down_seconds(), stopped);
    }

    /// The backend's numbers stay in mimalloc's 224-byte class with the
    /// `Arc`'s two counts (its classes step by a quarter of a power of two:
    /// 192, 224, 256): one more field of 8 bytes costs every backend 32.
    #[test]
    fn backend_stats_fit_the_224_byte_allocation_class() {
        assert!(
            std::mem::size_of::<BackendStats>() + 16 <= 224,
            "{} bytes",
            std::mem::size_of::<BackendStats>()
        );
    }
}

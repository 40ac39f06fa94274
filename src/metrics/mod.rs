//! The daemon's metrics: kept in the objects they describe, written out at
//! scrape time.
//!
//! Each live load balancer, listener and backend holds its numbers as plain
//! atomics ([`stats`]); the hot path adds to an atomic it already holds and
//! never looks anything up. [`Metrics`] only knows where the live objects
//! are (weakly: it never keeps one alive), and a scrape walks them and
//! writes the text exposition ([`exposition`]) in chunks, so its cost in
//! memory is a chunk, not the whole text. Two consequences an operator sees:
//!
//! * The series of a removed object go with it. Its 0/1 state series
//!   (`backend_up`, `listener_up`, `no_eligible_backend`) go at the reload
//!   that removes it; its counters stay while connections it served drain
//!   (at most `proxy.drain_timeout_seconds`), then go, and the memory with
//!   them.
//! * A series split by outcome (`reason`, `result`, `kind`, `to`) appears at
//!   the first event of that outcome: absent means zero. Exporting every
//!   outcome of 30,000 backends at 0 would triple the exposition.
//!
//! Why not the `metrics` facade and `metrics-exporter-prometheus`: their
//! registry keeps an owned copy of every label set per series and a handle
//! per series (measured: 14 KB per backend, 1.08 million lines and 808 MB
//! after one scrape at 30,000 backends), renders the whole text at once, and
//! has no way to delete a series, so a removed object's series stayed for
//! ever.

pub mod by_label;
pub mod exposition;
pub mod hand_over;
pub mod names;
pub mod stats;

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::SystemTime;

pub use exposition::Exposition;
pub use stats::{
    BackendStats, Counter, Gauge, Histogram, HostKind, HostRepairs, LbStats, LeaseStats,
    ListenerStats, Presence, UdpBackendStats, UdpStats,
};

use stats::Live;

/// Connection log lines not written because `log.max_connection_lines_per_second`
/// was reached (`harvester_lb_connection_log_lines_dropped_total`). A
/// process-wide count, as the bound is: the forwarder adds to it without a
/// reference to the registry.
pub static CONNECTION_LOG_LINES_DROPPED: Counter = Counter::new();

/// Where the live objects' stats are, and the daemon-wide numbers.
#[derive(Default)]
pub struct Metrics {
    /// Every live load balancer's stats, by (cluster, name).
    load_balancers: Live<(Box<str>, Box<str>), LbStats>,
    /// `metrics.per_backend_health_check_duration`.
    pub(crate) per_backend_durations: AtomicBool,
    /// Every probe's duration, whatever its backend.
    pub(crate) probe_duration: Histogram,
    reloads_ok: Counter,
    reloads_failed: Counter,
    last_reload_ok: AtomicBool,
    /// Unix time of the last successful load, as `f64` bits.
    last_success: AtomicU64,
    config_load_balancers: AtomicU64,
    health_check_streams: AtomicU64,
    /// `vip.isolate`: 0 off (no series), 1 the table is in force, 2 the
    /// last write of it failed.
    pub(crate) vip_isolation: std::sync::atomic::AtomicU8,
    /// `vip.isolate`: repairs of a table another process changed.
    pub(crate) vip_isolation_repairs: Counter,
    /// The connection cap in force (0: not set yet, not exported).
    connection_limit: AtomicU64,
    /// `admin_connections_shed_total`.
    admin_shed: Counter,
    /// `[keepalived]`: failed writes of its file and reloads.
    keepalived_failures: Counter,
    /// `[[network]] isolate`: 0 no isolated network (no series), 1 the
    /// guard table is in force, 2 the last write or read-back failed.
    vm_network_guard: std::sync::atomic::AtomicU8,
    /// `[[network]] isolate`: failed writes and read-backs of the guard table.
    vm_network_guard_failures: Counter,
    /// Kernel NAT table writes that succeeded, and that failed.
    pub(crate) kernel_syncs_ok: Counter,
    pub(crate) kernel_syncs_failed: Counter,
    /// The last successful write's duration, as `f64` seconds' bits.
    pub(crate) kernel_sync_seconds: AtomicU64,
    /// 0: never written (no series), 1: in force, 2: the last write
    /// failed or a check found the tables not as written.
    pub(crate) kernel_up: std::sync::atomic::AtomicU8,
    /// Checks that found the kernel NAT tables not as written (each
    /// followed by a full resync).
    pub(crate) kernel_repairs: Counter,
    /// Other programs' forward chains: 0 not read (no kernel listener),
    /// 1 none drops what the kernel forwards, 2 one does.
    pub(crate) kernel_forward_blocked: std::sync::atomic::AtomicU8,
    /// The kernel's new-connection counts per backend of each kernel
    /// listener, as last read.
    pub(crate) kernel_backends: std::sync::Mutex<Vec<KernelBackendCount>>,
    /// `vip.announce = "routes"`: one entry per VIP, as last decided;
    /// `None` while announcing is off (no series).
    pub(crate) announce: std::sync::Mutex<Option<Vec<VipAnnounceSample>>>,
    /// `vip.announce = "routes"`: writes the kernel refused.
    pub(crate) announce_errors: Counter,
    /// `vip.announce = "routes"`: read-backs that found the table's routes
    /// of ours not as written (each followed by the repair).
    pub(crate) announce_repairs: Counter,
    /// Load balancers the VIP guard refused at the last apply.
    pub(crate) vip_refused: AtomicU64,
    /// Load balancers whose kernel listeners the kernel refuses (narrowed
    /// out of the NAT tables' write, served by the proxy).
    pub(crate) kernel_refused: AtomicU64,
    /// Repairs of host objects by kind (`host_repairs_total{kind}`);
    /// shared with the DHCP clients, which repair their own.
    pub(crate) host_repairs: Arc<HostRepairs>,
    /// `[conntrackd]`: the last check's findings; `None` without it.
    pub(crate) conntrack_sync: std::sync::Mutex<Option<SyncSample>>,
    /// The state file at start: its outcome and the entries put back per
    /// kind; `None` before start says.
    pub(crate) state_restored: std::sync::Mutex<Option<StateRestoredSample>>,
    /// Writes of the state file that succeeded, and that failed.
    pub(crate) state_writes_ok: Counter,
    pub(crate) state_writes_failed: Counter,
    /// The restart's numbers (issue 41).
    hand_over: hand_over::HandOverStats,
}

/// What start made of the state file, for `/metrics`.
#[derive(Debug, Clone)]
pub(crate) struct StateRestoredSample {
    pub(crate) outcome: &'static str,
    pub(crate) kinds: [(&'static str, usize); 3],
}

/// `[conntrackd]`'s state as the last check found it, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncSample {
    /// conntrackd answered `-s`.
    pub up: bool,
    /// Whether `up` means anything: `false` where conntrackd's control
    /// socket is not the daemon's to use (the shipped unit); then no
    /// `conntrack_sync_up` series.
    pub up_known: bool,
    /// Its internal and external caches' entries.
    pub entries: [u64; 2],
    /// Packets sent and received on the sync link.
    pub packets: [u64; 2],
    /// Send errors on the link.
    pub send_errors: u64,
    /// Messages lost.
    pub lost: u64,
    /// The sync's transport (`conntrackd.transport`): "unicast" or
    /// "multicast" (empty in a sample that does not say).
    pub transport: &'static str,
    /// Per VRRP instance, by name.
    pub instances: Vec<SyncInstanceSample>,
    /// Failed writes and restarts.
    pub failures: u64,
    /// conntrackd runs with an older file than the one written.
    pub restart_pending: bool,
}

/// One VRRP instance's sync state, for `/metrics`.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct SyncInstanceSample {
    /// Label `instance` (`hlb_<vrid>`).
    pub instance: String,
    /// The last transition (`MASTER`, `BACKUP`, `FAULT`, `STOP`); `None`:
    /// none recorded.
    pub state: Option<String>,
    /// When, Unix seconds.
    pub transition_at: Option<f64>,
    /// Commits that succeeded and failed.
    pub commits: [u64; 2],
    /// The last commit's duration and end, seconds.
    pub last_commit: Option<(f64, f64)>,
    /// The gate as read back: open or closed; `None`: not in the kernel.
    pub gate_open: Option<bool>,
}

/// The states `harvester_lb_vrrp_state` lists.
pub const VRRP_STATES: [&str; 4] = ["MASTER", "BACKUP", "FAULT", "STOP"];

/// One VIP's announcement, for `/metrics`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct VipAnnounceSample {
    /// Label `vip`.
    pub vip: IpAddr,
    /// Whether its route is in the table.
    pub announced: bool,
    /// Why not, when not (a `Reason::as_str`).
    pub reason: Option<&'static str>,
    /// Routes written.
    pub announces: u64,
    /// Routes deleted.
    pub withdrawals: u64,
}

/// The reasons a VIP is not announced, as the reason gauge lists them.
pub const ANNOUNCE_REASONS: [&str; 5] = [
    "no_eligible_backend",
    "drained",
    "stopping",
    "damped",
    "waiting",
];

/// One backend's new-connection count on one kernel listener.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelBackendCount {
    /// Label `cluster`.
    pub cluster: String,
    /// Label `load_balancer`.
    pub load_balancer: String,
    /// Label `listener`.
    pub listener: String,
    /// Label `backend`.
    pub backend: IpAddr,
    /// New connections since its counter was made.
    pub connections: u64,
}

impl Metrics {
    /// An empty registry.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The stats of load balancer `name` of `cluster`: the live ones if any
    /// object of that identity still holds them, else new ones.
    pub fn load_balancer(self: &Arc<Self>, cluster: &str, name: &str) -> Arc<LbStats> {
        stats::get_or_insert(&self.load_balancers, (cluster.into(), name.into()), || {
            LbStats::new(Some(Arc::clone(self)), cluster, name)
        })
    }

    pub(crate) fn forget_load_balancer(&self, lb: &LbStats) {
        let key = (lb.cluster.clone(), lb.name.clone());
        stats::forget(&self.load_balancers, &key, lb);
    }

    /// Every live load balancer's stats (for a scrape).
    pub(crate) fn live_load_balancers(&self) -> Vec<Arc<LbStats>> {
        stats::live(&self.load_balancers)
    }

    /// Records the outcome of a config (re)load.
    pub fn record_reload(&self, ok: bool) {
        if ok {
            self.reloads_ok.increment(1);
            let now = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            self.last_success.store(now.to_bits(), Ordering::Relaxed);
        } else {
            self.reloads_failed.increment(1);
        }
        self.last_reload_ok.store(ok, Ordering::Relaxed);
    }

    /// Sets the gauges that describe the config in force.
    pub fn set_config_in_force(&self, load_balancers: usize, health_check_streams: usize) {
        self.config_load_balancers
            .store(load_balancers as u64, Ordering::Relaxed);
        self.health_check_streams
            .store(health_check_streams as u64, Ordering::Relaxed);
    }

    /// Records what start made of the state file: its outcome and the
    /// entries put back per kind.
    pub fn set_state_restored(&self, outcome: &'static str, kinds: [(&'static str, usize); 3]) {
        *self
            .state_restored
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(StateRestoredSample { outcome, kinds });
    }

    /// Counts one write of the state file.
    pub fn state_file_written(&self, ok: bool) {
        if ok {
            self.state_writes_ok.increment(1);
        } else {
            self.state_writes_failed.increment(1);
        }
    }

    /// Records the VIP isolation's state: `None` when it is off, else
    /// whether the table of the config in force is written.
    pub fn set_vip_isolation(&self, in_force: Option<bool>) {
        let v = match in_force {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        };
        self.vip_isolation.store(v, Ordering::Relaxed);
    }

    /// Counts one repair of the VIP isolation table (found changed in the
    /// kernel and written again) in `vip_isolation_repairs_total`; its
    /// `Guard` counts it in `host_repairs_total{kind}`.
    pub fn record_vip_isolation_repair(&self) {
        self.vip_isolation_repairs.increment(1);
    }

    /// The repair counters, for the owners that count their own: every
    /// `host::owned::Driver` and `Guard` (under their kind), the DHCP
    /// clients.
    pub fn host_repairs(&self) -> Arc<HostRepairs> {
        Arc::clone(&self.host_repairs)
    }

    /// The restart's numbers: adopted sockets, the last hand-over, fallbacks.
    pub fn hand_over(&self) -> &hand_over::HandOverStats {
        &self.hand_over
    }

    /// Records a successful write of the kernel NAT table.
    pub fn kernel_synced(&self, took: std::time::Duration) {
        self.kernel_syncs_ok.increment(1);
        self.kernel_sync_seconds
            .store(took.as_secs_f64().to_bits(), Ordering::Relaxed);
        self.kernel_up.store(1, Ordering::Relaxed);
    }

    /// Replaces the kernel's per-backend new-connection counts.
    pub fn set_kernel_backends(&self, counts: Vec<KernelBackendCount>) {
        *self
            .kernel_backends
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = counts;
    }

    /// Replaces the VIPs' announcement series (`None`: announcing off).
    pub fn set_vip_announce(&self, samples: Option<Vec<VipAnnounceSample>>) {
        *self.announce.lock().unwrap_or_else(|p| p.into_inner()) = samples;
    }

    /// Load balancers the VIP guard refused at the last apply (their VIP
    /// is the host's own address, a gateway, or outside the announce
    /// prefixes).
    pub fn set_vip_refused(&self, n: usize) {
        self.vip_refused.store(n as u64, Ordering::Relaxed);
    }

    /// Load balancers whose kernel listeners the kernel refused at the
    /// last write (narrowed out; the proxy serves them).
    pub fn set_kernel_refused(&self, n: usize) {
        self.kernel_refused.store(n as u64, Ordering::Relaxed);
    }

    /// Replaces the `[conntrackd]` sync's state (`None`: not configured).
    pub fn set_conntrack_sync(&self, sample: Option<SyncSample>) {
        *self
            .conntrack_sync
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = sample;
    }

    /// Counts a failed write of the rendered keepalived file or reload of
    /// keepalived (`keepalived_reload_failures_total`).
    pub fn record_keepalived_failure(&self) {
        self.keepalived_failures.increment(1);
    }

    /// Records the VM-network guard's state: `None` when no network is
    /// isolated, else whether the table of the config in force is the
    /// kernel's (as last read back).
    pub fn set_vm_network_guard(&self, in_force: Option<bool>) {
        let v = match in_force {
            None => 0,
            Some(true) => 1,
            Some(false) => 2,
        };
        self.vm_network_guard.store(v, Ordering::Relaxed);
    }

    /// Counts a failed write or read-back of the VM-network guard table
    /// (`vm_network_guard_failures_total`).
    pub fn record_vm_network_guard_failure(&self) {
        self.vm_network_guard_failures.increment(1);
    }

    /// Counts a route or address write for `vip.announce` the kernel refused.
    pub fn record_vip_announce_error(&self) {
        self.announce_errors.increment(1);
    }

    /// Counts one repair of the announce table: a read-back found a route
    /// of ours missing or one nobody wants (another process changed it).
    pub fn record_vip_announce_repair(&self) {
        self.announce_repairs.increment(1);
    }

    /// Counts a check that found the kernel NAT tables not as written:
    /// `kernel_forwarding_up` is 0 until the repair's write succeeds.
    pub fn record_kernel_repair(&self) {
        self.kernel_repairs.increment(1);
        self.host_repairs[HostKind::NatTables].increment(1);
        self.kernel_up.store(2, Ordering::Relaxed);
    }

    /// Records a failed write of the kernel NAT table.
    pub fn kernel_sync_failed(&self) {
        self.kernel_syncs_failed.increment(1);
        self.kernel_up.store(2, Ordering::Relaxed);
    }

    /// Records the connection cap in force (set once at start: changing
    /// `proxy.max_connections` needs a restart).
    pub fn set_connection_limit(&self, limit: usize) {
        self.connection_limit.store(limit as u64, Ordering::Relaxed);
    }

    /// Counts an admin connection shed to make room for a newcomer.
    pub fn record_admin_connection_shed(&self) {
        self.admin_shed.increment(1);
    }

    /// Switches per-backend probe-duration histograms on or off.
    pub fn set_per_backend_health_check_duration(&self, on: bool) {
        self.per_backend_durations.store(on, Ordering::Relaxed);
    }

    /// A scrape: the exposition of everything live now, written chunk by chunk.
    pub fn exposition(self: &Arc<Self>) -> Exposition {
        Exposition::new(Arc::clone(self))
    }

    /// The whole exposition as one string (tests, small daemons).
    pub fn render(self: &Arc<Self>) -> String {
        let mut out = Vec::new();
        let mut e = self
            .exposition()
            .with_open_fds(crate::os::open_fds())
            .with_process(crate::os::process_stats());
        while e.fill(&mut out, usize::MAX) {}
        String::from_utf8(out).expect("the exposition is written from UTF-8 pieces")
    }
}

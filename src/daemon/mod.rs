//! The running daemon: turns a [`Config`] into listeners, load balancers and
//! probe streams, and every later config into the smallest change that gets there.
//!
//! Applying a config is a diff keyed by what survives a reload:
//! load balancers by name, backends by address within their load balancer,
//! listeners by VIP:port and protocol. What stays keeps its socket, health state and
//! counters; what goes drains; what comes starts. The first config is the
//! diff from nothing, so start-up and reload are one code path.

use std::collections::HashMap;
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, ListenerKey, ListenerSpec};
use crate::dataplane::balancer::{AffinityBudget, Backend, LoadBalancer, affinity};
use crate::dataplane::health::prober::Prober;
use crate::dataplane::proxy::Running;
use crate::dataplane::proxy::tcp::ConnectionLimit;
use crate::dataplane::proxy::udp::FlowBudget;
use crate::dataplane::workers::Workers;
use crate::host::dhcp::Leases;
use crate::host::isolation::Isolation;
use crate::metrics::{ListenerStats, Metrics};

mod admin_state;
mod announce;
mod apply;
mod config_record;
mod hand_over;
mod kernel;
mod leases;
mod persist;
mod readiness;
mod status;
mod vmnet;

pub use crate::host::announce::announcer::{
    AnnounceStateChange, AnnounceStateError, AnnounceStatus, LbAnnounceStatus, VipAnnounceStatus,
};
pub use crate::host::conntrack_sync::syncer::{SyncInstanceStatus, SyncStatus};
pub use crate::host::nat::repair::KernelCheckCause;
pub use crate::host::vip_guard::refusals::VipRefusal;
pub use crate::host::vmnet::network_refusals::NetworkRefusal;
pub use admin_state::{AdminStateChange, AdminStateError};
pub use config_record::{RejectedReload, ReloadSource};
pub use hand_over::{
    HandOverMarker, HandOverReport, MARKER_FILE, MARKER_KEPT_FILE, MARKER_MAX_AGE, MarkerError,
    StopKind,
};
pub use persist::{RestoredCounts, StateFileStatus};
pub use readiness::{BackendRequirement, UnboundListener, VipNotReady};
pub use status::{
    BackendStatus, ConfigStatus, LeaseStatus, ListenerStatus, LoadBalancerStatus, PortStatus,
    RestartStatus, StatusDoc,
};
// The restart's word from prepare-stop (issue 41).
pub use hand_over::{INTENT_BOUND, NoHandOver};

/// The daemon's live state, shared by the reload path, the admin server and
/// the signal handlers.
pub struct Daemon {
    metrics: Arc<Metrics>,
    prober: Prober,
    /// Process-wide cap on forwarded connections.
    limit: Arc<ConnectionLimit>,
    /// The runtimes TCP listeners accept on.
    workers: Workers,
    /// Everything a reload changes; locked only by reload, status and shutdown.
    state: Mutex<State>,
    /// The file in force, the last rejected reload, what needs a restart
    /// (`/status` `config`).
    config_record: Mutex<config_record::ConfigRecord>,
    /// Drains of removed listeners still running, awaited at shutdown.
    drains: TaskTracker,
    /// Set when shutdown begins: `/readyz` turns 503 so a front end stops
    /// sending here while open connections drain.
    stopping: AtomicBool,
    /// Cancelled at shutdown once listeners have drained: removed backends
    /// still waiting out their drain time are retired at once.
    retire_now: CancellationToken,
    /// The bound on client-affinity entries, shared by every load balancer
    /// (`proxy.max_affinity_entries`).
    affinity: Arc<AffinityBudget>,
    /// The nftables table that keeps the VIPs to their listeners' ports
    /// (`vip.isolate`); written by the server, beside each apply.
    isolation: Arc<Isolation>,
    /// The DHCP clients of `ipam = "dhcp"` load balancers.
    leases: Leases,
    /// Set once the task that re-applies the config on lease changes runs.
    lease_watcher: AtomicBool,
    /// This daemon, for that task (which must not keep it alive).
    me: Weak<Daemon>,
    /// The bound on UDP flows, shared by every UDP listener
    /// (`proxy.max_udp_flows`).
    udp_flows: Arc<FlowBudget>,
    /// `proxy.max_udp_flows_per_source`, for listeners started later.
    udp_per_source: AtomicUsize,
    /// Bind failures, rate limited per cause (`EADDRINUSE`, ...): 2,000
    /// listeners that cannot bind, retried every 2 s, are a few lines a
    /// minute and a count, not 1,000 lines a second.
    bind_log: crate::log_limit::LogLimit<Option<i32>>,
    /// The nftables NAT table of `forwarding = "kernel"` listeners.
    kernel: Arc<crate::host::nat::KernelTable>,
    /// Woken by every publish of a load balancer and every apply: the
    /// kernel table may have to follow. Only a wake-up: the writer that
    /// waits on it is started once, at the first apply
    /// (`start_kernel_writer`). (The announcer has a `Notify` of its own,
    /// woken by the same publishes.)
    kernel_wake: Arc<tokio::sync::Notify>,
    /// The host's IPv4 and IPv6 forwarding as last seen (two bits per
    /// family, `daemon::kernel::blocked::pack_forwarding`; 0: both on): kernel listeners of
    /// a family the host does not forward, or whose sysctl cannot be read,
    /// stay with the proxy.
    forwarding_off: std::sync::atomic::AtomicU8,
    /// Other programs' forward chains that drop what the kernel forwards:
    /// kernel listeners of that family stay with the proxy.
    forward_chains: crate::host::nat::forward_chains::ForwardChains,
    /// Set once the task that writes the kernel table runs.
    kernel_task: AtomicBool,
    /// `vip.announce = "routes"`: the VIPs' routes and addresses.
    announcer: crate::host::announce::announcer::Announcer,
    /// What the VIP guard refused at the last apply, and which VIPs passed
    /// its last check of the host.
    vip_guard: crate::host::vip_guard::refusals::VipGuard,
    /// The `[[network]]`s' interfaces checked before each apply, and
    /// those refused at the last (`host::vmnet::network_refusals`).
    network_guard: crate::host::vmnet::network_refusals::NetworkGuard,
    /// `[[network]]` and `[keepalived]`: keepalived's file and the
    /// networks' routes and rules.
    vmnet: vmnet::VmNet,
    /// `[conntrackd]`: conntrackd's file, the notify script, the gate.
    sync: crate::host::conntrack_sync::syncer::ConntrackSync,
    /// The claims on the host objects one daemon per namespace may own
    /// (`host::owned::claim`): taken at start and reload before the config
    /// that needs them is applied.
    claims: crate::host::owned::Claims,
    /// The state file: read at start, written on changes and at stop
    /// (`persist`, issue 41).
    persist: persist::Persist,
    /// systemd's file descriptor store and the sockets it handed this
    /// process (issue 41, `hand_over::sockets`).
    fds: std::sync::RwLock<hand_over::Fds>,
    /// A restart announced by `prepare-stop`, until its SIGTERM.
    intent: Mutex<Option<hand_over::Intent>>,
}

#[derive(Default)]
struct State {
    config: Option<Config>,
    /// Counts the configs put in force (reloads, leases): what the kernel
    /// writer's kept state was built from.
    config_generation: u64,
    load_balancers: HashMap<String, LbEntry>,
    listeners: HashMap<ListenerKey, ListenerEntry>,
    /// Where the config in force came from (`/status`).
    file: Option<PathBuf>,
    /// Since when the file is gone while the daemon runs on what it read.
    file_missing_since: Option<SystemTime>,
}

/// A load balancer in force. Its spec is the one in `State::config` (kept
/// once: at 10,000 load balancers a second copy cost 9 MB).
struct LbEntry {
    lb: Arc<LoadBalancer>,
    backends: HashMap<IpAddr, Arc<Backend>>,
}

struct ListenerEntry {
    load_balancer: String,
    spec: ListenerSpec,
    socket: Result<Running, BindError>,
    /// The numbers of the listener it serves now (`listener_up`).
    stats: Arc<ListenerStats>,
}

/// Why a listener is not bound; `/status`, `/readyz` and systemd's status
/// line show it, and it is retried every 2 s.
#[derive(Debug, Clone, thiserror::Error)]
#[error("cannot bind {}/{}: {error}", .key.addr, .key.protocol)]
pub struct BindError {
    /// The listener.
    pub key: ListenerKey,
    /// What the bind (or the socket set-up around it) returned; shared, as
    /// every reader of the state gets a copy.
    pub error: Arc<std::io::Error>,
}

/// Logs an [`ApplyReport`] at `$level` with each count as a field of its
/// own (`listeners_bound=3 listeners_failed=0 …`), which an operator reads
/// and journald filters on, instead of one `Debug` struct; the rest of the
/// arguments are the event's other fields and message.
macro_rules! log_applied {
    ($level:expr, $report:expr, $($rest:tt)*) => {{
        let r: &$crate::daemon::ApplyReport = &$report;
        tracing::event!(
            $level,
            listeners_bound = r.listeners_bound,
            listeners_failed = r.listeners_failed,
            listeners_removed = r.listeners_removed,
            load_balancers_added = r.load_balancers_added,
            load_balancers_removed = r.load_balancers_removed,
            $($rest)*
        )
    }};
}
pub(crate) use log_applied;

/// What a call to [`Daemon::apply`] changed, for the log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Listeners bound now.
    pub listeners_bound: usize,
    /// Listeners whose socket could not be bound (see `/status`).
    pub listeners_failed: usize,
    /// Listeners removed and draining.
    pub listeners_removed: usize,
    /// Load balancers added.
    pub load_balancers_added: usize,
    /// Load balancers removed.
    pub load_balancers_removed: usize,
}

impl Daemon {
    /// A daemon with nothing configured. `max_connections` caps forwarded
    /// connections across all listeners; TCP listeners accept on `workers`.
    pub fn new(metrics: Arc<Metrics>, max_connections: usize, workers: Workers) -> Arc<Self> {
        let isolation = Arc::new(Isolation::new(Arc::clone(&metrics)));
        let leases = Leases::new(metrics.host_repairs());
        let announcer = crate::host::announce::announcer::Announcer::new(Arc::clone(&metrics));
        let sync = crate::host::conntrack_sync::syncer::ConntrackSync::new(Arc::clone(&metrics));
        let vip_guard = crate::host::vip_guard::refusals::VipGuard::new(Arc::clone(&metrics));
        Arc::new_cyclic(|me| Self {
            metrics,
            prober: Prober::new(),
            limit: ConnectionLimit::new(max_connections),
            workers,
            state: Mutex::new(State::default()),
            config_record: Mutex::default(),
            drains: TaskTracker::new(),
            stopping: AtomicBool::new(false),
            retire_now: CancellationToken::new(),
            affinity: AffinityBudget::new(0),
            isolation,
            leases,
            lease_watcher: AtomicBool::new(false),
            me: me.clone(),
            udp_flows: FlowBudget::new(0),
            udp_per_source: AtomicUsize::new(1),
            bind_log: crate::log_limit::LogLimit::new(5, Duration::from_secs(60)),
            kernel: Arc::new(crate::host::nat::KernelTable::new()),
            kernel_wake: Arc::new(tokio::sync::Notify::new()),
            kernel_task: AtomicBool::new(false),
            forwarding_off: std::sync::atomic::AtomicU8::new(0),
            forward_chains: Default::default(),
            announcer,
            vip_guard,
            network_guard: Default::default(),
            vmnet: vmnet::VmNet::default(),
            sync,
            claims: crate::host::owned::Claims::default(),
            persist: persist::Persist::default(),
            fds: Default::default(),
            intent: Mutex::new(None),
        })
    }

    /// The VIP isolation table's owner. It runs `nft`, so the server calls
    /// it on a blocking thread, and at stop.
    pub fn isolation(&self) -> &Arc<Isolation> {
        &self.isolation
    }

    /// `config` without the load balancers the VIP guard refuses (see
    /// [`crate::host::vip_guard::refusals`]), run before each apply.
    pub async fn guard_vips(&self, config: Config) -> Config {
        self.vip_guard.guard(config).await
    }

    /// `config` without the networks whose interface cannot be a VM
    /// network's here, nor their load balancers (see
    /// [`crate::host::vmnet::network_refusals`]), run before each apply.
    pub async fn guard_networks(&self, config: Config) -> Config {
        self.network_guard.guard(config).await
    }

    /// This daemon's claims on host objects (see `host::owned::claim`).
    pub fn claims(&self) -> &crate::host::owned::Claims {
        &self.claims
    }

    /// The metric registry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records the path of the config file, for `/status`.
    pub fn set_config_file(&self, path: &Path) {
        self.lock().file = Some(path.to_path_buf());
    }

    /// Records that the config file has gone (`true`) or is back (`false`);
    /// `/status` says so while it is gone. Returns whether it was missing
    /// before this call.
    pub fn set_config_file_missing(&self, missing: bool) -> bool {
        let mut st = self.lock();
        let was = st.file_missing_since.is_some();
        if !missing {
            st.file_missing_since = None;
        } else if !was {
            st.file_missing_since = Some(SystemTime::now());
        }
        was
    }

    /// Whether a config is in force and every listener is bound, whatever
    /// its VIP (`/readyz`); [`Daemon::vips_ready`] asks about some VIPs.
    pub fn is_ready(&self) -> bool {
        if self.is_stopping() {
            return false;
        }
        let st = self.lock();
        st.config.is_some() && st.listeners.values().all(|e| e.socket.is_ok())
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Listeners whose socket is not bound, with the reason.
    pub fn failed_listeners(&self) -> Vec<BindError> {
        let st = self.lock();
        st.listeners
            .values()
            .filter_map(|e| e.socket.as_ref().err().cloned())
            .collect()
    }

    /// Stops accepting everywhere, stops probing, and waits up to the drain
    /// timeout for open connections before closing them. Returns how many
    /// connections the timeout cut.
    pub async fn shutdown(&self) -> usize {
        self.stopping.store(true, Ordering::Release);
        // Announced VIPs first: the router moves new flows away while the
        // listeners still accept, and only then do they close.
        if let Some(grace) = self.announcer.stop(self).await
            && !grace.is_zero()
        {
            tokio::time::sleep(grace).await;
        }
        let (listeners, drain) = {
            let mut st = self.lock();
            let drain = st
                .config
                .as_ref()
                .map_or(Duration::from_secs(30), |c| c.proxy.drain_timeout);
            let listeners: Vec<Running> = st
                .listeners
                .drain()
                .filter_map(|(key, e)| {
                    e.stats.up.set(false);
                    // Out of the store first: PID 1's copy would keep the
                    // port listening with nobody accepting.
                    if e.socket.is_ok() {
                        self.unstore_listener(&key);
                    }
                    e.socket.ok()
                })
                .collect();
            (listeners, drain)
        };
        self.prober.stop_all();
        let drains = listeners.into_iter().map(|l| l.drain(drain));
        let (proxied, kernel) =
            tokio::join!(futures_sum(drains), self.kernel_drain_and_remove(drain));
        let cut = proxied + kernel;
        self.announcer.remove_local_routes().await;
        self.vmnet_stop().await;
        // After the drain: releasing takes the VIP off the host.
        self.leases.shutdown().await;
        self.retire_now.cancel();
        self.drains.close();
        self.drains.wait().await;
        cut
    }

    /// Drops client-affinity entries older than their load balancer's
    /// timeout, on a blocking thread (a million entries take tens of
    /// milliseconds). The main loop calls it every few seconds.
    pub fn sweep_affinity(&self) {
        let tables: Vec<(Arc<LoadBalancer>, Duration)> = self
            .lock()
            .load_balancers
            .values()
            .filter_map(|e| {
                let timeout = e.lb.snapshot().settings.affinity_timeout?;
                e.lb.affinity().map(|_| (Arc::clone(&e.lb), timeout))
            })
            .collect();
        if tables.is_empty() {
            return;
        }
        tokio::task::spawn_blocking(move || {
            let now = affinity::now_secs();
            for (lb, timeout) in tables {
                if let Some(table) = lb.affinity() {
                    table.sweep(timeout, now);
                }
            }
        });
    }
}

async fn futures_sum<F: std::future::Future<Output = usize> + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> usize {
    let mut set = tokio::task::JoinSet::new();
    for f in futures {
        set.spawn(f);
    }
    let mut total = 0;
    while let Some(r) = set.join_next().await {
        total += r.unwrap_or(0);
    }
    total
}

/// What the unit tests of the daemon's decisions share: a daemon with
/// nothing in force, configs from text, and the VIPs they bind. Each test
/// binds its own VIPs in 127.231.0.0/16 (`tests/support` takes /24s of
/// 127.20-219, so the two never meet) on ports above 1024: no root.
#[cfg(test)]
pub(crate) mod testing {
    use super::*;
    use std::net::SocketAddr;

    /// Marks `d` stopping, as its stop does first (for the parts' tests).
    pub(crate) fn mark_stopping(d: &Daemon) {
        d.stopping.store(true, Ordering::Release);
    }

    /// A daemon with nothing configured, accepting on this runtime.
    pub(crate) fn daemon() -> Arc<Daemon> {
        Daemon::new(Metrics::new(), 1000, Workers::here())
    }

    /// The config of `text`, which must be valid.
    pub(crate) use crate::config::test_fixtures::config;

    /// One `[[load_balancer]]` table: `name` on `vip`, `backends`, one TCP
    /// listener `l<port>` per port, each to nodeport `backend_port`, and
    /// `keys` (TOML lines of its own table).
    pub(crate) fn lb(
        name: &str,
        vip: &str,
        backends: &[&str],
        ports: &[u16],
        backend_port: u16,
        keys: &str,
    ) -> String {
        let backends: Vec<String> = backends.iter().map(|b| format!("{b:?}")).collect();
        let mut t = format!(
            "[[load_balancer]]\nname = {name:?}\nvip = {vip:?}\nbackends = [{}]\n{keys}\n",
            backends.join(", ")
        );
        for port in ports {
            t += &format!(
                "  [[load_balancer.listener]]\n  name = \"l{port}\"\n  port = {port}\n  backend_port = {backend_port}\n"
            );
        }
        t
    }

    /// Whether something accepts TCP connections at `addr` (a loopback
    /// address of the test's own).
    pub(crate) async fn accepts(addr: SocketAddr) -> bool {
        tokio::net::TcpStream::connect(addr).await.is_ok()
    }

    /// Waits (10 s at most) until `addr` refuses connections.
    pub(crate) async fn refused_soon(addr: SocketAddr) {
        tokio::time::timeout(Duration::from_secs(10), async {
            while accepts(addr).await {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
        .await
        .unwrap_or_else(|_| panic!("{addr} still accepts 10 s after its listener went"));
    }
}

#[cfg(test)]
mod tests {
    use super::testing::{accepts, config, daemon, lb, refused_soon};
    use super::*;
    use std::net::SocketAddr;

    #[tokio::test]
    async fn a_daemon_is_ready_once_a_config_is_in_force_with_every_listener_bound() {
        let d = daemon();
        assert!(!d.is_ready(), "no config in force");
        let report = d.apply(config(&lb(
            "a/web",
            "127.231.1.1",
            &["127.231.1.11"],
            &[18080, 18081],
            30080,
            "",
        )));
        assert_eq!(
            report,
            ApplyReport {
                listeners_bound: 2,
                load_balancers_added: 1,
                ..ApplyReport::default()
            }
        );
        assert!(d.is_ready());
        assert!(d.failed_listeners().is_empty());
        assert!(accepts("127.231.1.1:18080".parse().unwrap()).await);
    }

    #[test]
    fn the_config_file_missing_is_said_once_per_disappearance() {
        let d = daemon();
        assert!(!d.set_config_file_missing(true), "was not missing");
        let since = d.lock().file_missing_since;
        assert!(since.is_some());
        assert!(d.set_config_file_missing(true), "still missing");
        assert_eq!(d.lock().file_missing_since, since, "since the first time");
        assert!(d.set_config_file_missing(false), "it was missing");
        assert!(!d.set_config_file_missing(false));
        assert_eq!(d.lock().file_missing_since, None);
    }

    #[tokio::test]
    async fn shutdown_turns_readiness_off_and_closes_every_listener() {
        let d = daemon();
        let vip: SocketAddr = "127.231.2.1:18080".parse().unwrap();
        d.apply(config(&format!(
            "[proxy]\ndrain_timeout_seconds = 1\n{}",
            lb(
                "a/web",
                "127.231.2.1",
                &["127.231.2.11"],
                &[18080],
                30080,
                ""
            )
        )));
        assert!(d.is_ready() && accepts(vip).await);
        assert_eq!(d.shutdown().await, 0, "no connection was open to cut");
        assert!(d.is_stopping());
        assert!(!d.is_ready(), "a stopping daemon is never ready");
        assert!(d.lock().listeners.is_empty());
        refused_soon(vip).await;
    }
}

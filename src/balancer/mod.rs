//! The healthy set: which backends of a load balancer take new connections.
//!
//! Writers (the prober on a health transition, the daemon on reload) rebuild a
//! [`Snapshot`] under a small lock and publish it with one atomic swap. The
//! forwarder only ever does one atomic load of the snapshot per connection and
//! never takes that lock: a pick costs no lock and no allocation.
//!
//! Everything a pick needs (eligible backends, algorithm, timeouts) is in the
//! one snapshot, so a reader can never see a new algorithm with an old set —
//! Pingora keeps these in separate swaps and notes the gap; we close it.
//! Client affinity ([`affinity`]) only chooses which eligible backend
//! comes first; it never makes an ineligible one a candidate.
//!
//! Eligible = healthy *and* [`AdminState::Ready`], as Pingora's `ready =
//! healthy and enabled`: an operator drains a backend without lying about
//! its health, and the health checker never undoes a drain.
//!
//! Health is one verdict per backend when the health check names a port
//! (the common case, which costs no per-port state), or one per backend
//! *port* ([`PortHealth`]) when it does not: each listener's nodeport is
//! then checked on its own and the snapshot holds an eligible list per
//! backend port, so a node whose `https` nodeport is dead still serves
//! `http`. The operator's state stays one per backend address.

pub mod affinity;
pub mod select;

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arc_swap::{ArcSwap, ArcSwapOption};
use tokio_util::sync::CancellationToken;

pub use self::affinity::{AffinityBudget, AffinityTable};
use crate::config::{Algorithm, LoadBalancerSpec, OnBackendDown, SourceRanges};
use crate::metrics::stats::PortStats;
use crate::metrics::{BackendStats, LbStats};

/// The signal that resets the connections open to a backend (or to one of
/// its ports) when the health check marks it down under
/// `on_backend_down = "close"`. Made by the first connection that needs it,
/// so a backend that carries none costs no token (~130 bytes, at 30,000
/// backends 4 MB); connections made after a mark-down get a fresh one.
#[derive(Default)]
struct DownSignal(ArcSwapOption<CancellationToken>);

impl DownSignal {
    /// The token a connection selects on.
    fn get(&self) -> CancellationToken {
        if let Some(token) = self.0.load_full() {
            return CancellationToken::clone(&token);
        }
        let fresh = Arc::new(CancellationToken::new());
        // Two first connections at once: both end up with the one stored.
        let prev = self
            .0
            .compare_and_swap(&None::<Arc<CancellationToken>>, Some(Arc::clone(&fresh)));
        match &*prev {
            Some(token) => CancellationToken::clone(token),
            None => CancellationToken::clone(&fresh),
        }
    }

    /// Cancels the token of every connection that took it; later ones get
    /// a fresh one.
    fn fire(&self) {
        if let Some(old) = self.0.swap(None) {
            old.cancel();
        }
    }
}

/// The health of one backend on one of its nodeports, kept only for a load
/// balancer whose health check has no `port` (each listener's
/// `backend_port` is then checked and judged on its own). Kept across
/// reloads that keep the backend and the port, like the backend itself.
pub struct PortHealth {
    /// The nodeport: one or more listeners' `backend_port`.
    pub port: u16,
    /// The verdict on this port.
    healthy: AtomicBool,
    /// Resets the connections made to this port when it is marked down
    /// (`on_backend_down = "close"`); connections of the backend's other
    /// ports keep going.
    marked_down: DownSignal,
    /// `backend_port_up`.
    stats: Arc<PortStats>,
}

impl PortHealth {
    /// Whether the health checker last found this port healthy.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }
}

/// The operator's state of a backend, apart from its health (HAProxy's
/// `set server state`). Kept in the backend, so it survives every reload
/// that keeps the backend, and only those: a restart starts `ready`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
#[serde(rename_all = "lowercase")]
pub enum AdminState {
    /// Takes new connections while healthy (the default).
    Ready,
    /// No new connections; open ones continue; still probed, so its health
    /// is known when it comes back.
    Drain,
    /// No new connections; open ones continue; not probed (the node may be
    /// down for work, and its failures are nobody's alert).
    Maint,
}

impl AdminState {
    /// Every state, in the order of their index.
    pub const ALL: [AdminState; 3] = [AdminState::Ready, AdminState::Drain, AdminState::Maint];

    /// The name used in the API, `/status` and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            AdminState::Ready => "ready",
            AdminState::Drain => "drain",
            AdminState::Maint => "maint",
        }
    }

    /// The state named `name` (`ready`, `drain` or `maint`).
    pub fn parse(name: &str) -> Option<Self> {
        Self::ALL.into_iter().find(|s| s.as_str() == name)
    }

    fn from_index(i: u8) -> Self {
        Self::ALL
            .get(usize::from(i))
            .copied()
            .unwrap_or(AdminState::Ready)
    }
}

impl std::fmt::Display for AdminState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One backend node of one load balancer, shared by its listeners, the prober
/// and every connection open to it.
pub struct Backend {
    /// The node's address; the listener adds its nodeport.
    pub addr: IpAddr,
    /// Precomputed hash of `addr` for source-IP picking.
    pub(crate) addr_hash: u64,
    /// Last verdict of the health checker (always true without health checks).
    healthy: AtomicBool,
    /// The operator's [`AdminState`], as its index in [`AdminState::ALL`].
    admin_state: AtomicU8,
    /// Fired when the health check marks the backend down under
    /// `on_backend_down = "close"`: the connections open to it then are
    /// reset (with per-port checks, each port has its own).
    marked_down: DownSignal,
    /// Per-port verdicts, only while its load balancer checks each
    /// listener's backend port on its own; empty (no allocation) otherwise.
    /// With them, `healthy` is their conjunction.
    ports: ArcSwapOption<Vec<Arc<PortHealth>>>,
    /// Whether it is a member of its load balancer in the config in force;
    /// once removed, it no longer reports `backend_up`.
    member: AtomicBool,
    /// Connections open to this backend now (least-connections, `/status`).
    active: AtomicUsize,
    /// Cancelled when the backend has been removed and its drain time is up:
    /// connections still open to it then close.
    retired: CancellationToken,
    /// Its numbers, labelled with its load balancer and address.
    stats: Arc<BackendStats>,
}

impl Backend {
    /// A backend whose numbers nobody renders, for tests and benchmarks.
    pub fn new(addr: IpAddr, healthy: bool) -> Arc<Self> {
        Self::with_stats(addr, healthy, LbStats::detached().backend(addr))
    }

    /// A backend reporting to `stats`.
    pub fn with_stats(addr: IpAddr, healthy: bool, stats: Arc<BackendStats>) -> Arc<Self> {
        stats.up.set(healthy);
        stats.admin_state.store(0, Ordering::Relaxed);
        Arc::new(Self {
            addr,
            addr_hash: select::hash_ip(addr),
            healthy: AtomicBool::new(healthy),
            admin_state: AtomicU8::new(0),
            marked_down: DownSignal::default(),
            ports: ArcSwapOption::empty(),
            member: AtomicBool::new(true),
            active: AtomicUsize::new(0),
            retired: CancellationToken::new(),
            stats,
        })
    }

    /// Whether the health checker last found it healthy; with per-port
    /// checks, healthy on every port checked.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::SeqCst)
    }

    /// Records the health checker's verdict. The caller publishes a new
    /// snapshot afterwards.
    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::SeqCst);
        if self.member.load(Ordering::Acquire) {
            self.stats.up.set(healthy);
        }
    }

    /// Makes its ports checked one by one `ports` (sorted, distinct), or
    /// none (one verdict for the backend). A port kept keeps its verdict;
    /// a new one starts `healthy`. The caller publishes afterwards.
    pub fn set_checked_ports(&self, ports: &[u16], healthy: bool) {
        let old = self.ports.load_full();
        if ports.is_empty() {
            if old.is_some() {
                self.ports.store(None);
                self.stats.ports.store(None);
            }
            return;
        }
        let same = old
            .as_ref()
            .is_some_and(|o| o.iter().map(|c| c.port).eq(ports.iter().copied()));
        if same {
            return;
        }
        let member = self.member.load(Ordering::Acquire);
        let cells: Vec<Arc<PortHealth>> = ports
            .iter()
            .map(|&port| {
                old.as_ref()
                    .and_then(|o| o.iter().find(|c| c.port == port).cloned())
                    .unwrap_or_else(|| {
                        let stats = Arc::new(PortStats {
                            port,
                            up: Default::default(),
                        });
                        if member {
                            stats.up.set(healthy);
                        }
                        Arc::new(PortHealth {
                            port,
                            healthy: AtomicBool::new(healthy),
                            marked_down: DownSignal::default(),
                            stats,
                        })
                    })
            })
            .collect();
        self.stats.ports.store(Some(Arc::new(
            cells.iter().map(|c| Arc::clone(&c.stats)).collect(),
        )));
        let all = cells.iter().all(|c| c.is_healthy());
        self.ports.store(Some(Arc::new(cells)));
        self.set_healthy(all);
    }

    /// The ports checked one by one (empty with one verdict per backend).
    pub fn checked_ports(&self) -> Vec<u16> {
        self.ports
            .load()
            .as_ref()
            .map_or_else(Vec::new, |cells| cells.iter().map(|c| c.port).collect())
    }

    /// The verdict on `port`, when ports are checked one by one.
    pub fn port_health(&self, port: u16) -> Option<Arc<PortHealth>> {
        self.ports
            .load()
            .as_ref()
            .and_then(|cells| cells.iter().find(|c| c.port == port).cloned())
    }

    /// Records the health checker's verdict on one port; the backend is
    /// healthy while every port is. The caller publishes afterwards.
    pub fn set_port_healthy(&self, cell: &PortHealth, healthy: bool) {
        cell.healthy.store(healthy, Ordering::SeqCst);
        let member = self.member.load(Ordering::Acquire);
        if member {
            cell.stats.up.set(healthy);
        }
        // Two ports flipping at once both read both verdicts (SeqCst), so
        // the last to finish leaves the true conjunction.
        let all = self
            .ports
            .load()
            .as_ref()
            .is_none_or(|cells| cells.iter().all(|c| c.is_healthy()));
        self.set_healthy(all);
    }

    /// Whether the backend is healthy for connections to `port`: that
    /// port's verdict with per-port checks, else the backend's.
    pub fn is_healthy_on(&self, port: u16) -> bool {
        match &*self.ports.load() {
            Some(cells) => cells
                .iter()
                .find(|c| c.port == port)
                .map_or_else(|| self.is_healthy(), |c| c.is_healthy()),
            None => self.is_healthy(),
        }
    }

    /// Whether it takes new connections to `port`: healthy there and `ready`.
    pub fn is_eligible_on(&self, port: u16) -> bool {
        self.admin_state() == AdminState::Ready && self.is_healthy_on(port)
    }

    /// The operator's state.
    pub fn admin_state(&self) -> AdminState {
        AdminState::from_index(self.admin_state.load(Ordering::Acquire))
    }

    /// Sets the operator's state and returns the previous one. The caller
    /// publishes a new snapshot afterwards.
    pub fn set_admin_state(&self, state: AdminState) -> AdminState {
        let i = AdminState::ALL
            .iter()
            .position(|s| *s == state)
            .unwrap_or(0) as u8;
        let before = AdminState::from_index(self.admin_state.swap(i, Ordering::AcqRel));
        self.stats.admin_state.store(i, Ordering::Relaxed);
        before
    }

    /// Whether it takes new connections: healthy and `ready`; with per-port
    /// checks, healthy on at least one port (the listeners of its other
    /// ports do not pick it: see [`Snapshot::eligible_for`]).
    pub fn is_eligible(&self) -> bool {
        if self.admin_state() != AdminState::Ready {
            return false;
        }
        match &*self.ports.load() {
            Some(cells) => cells.iter().any(|c| c.is_healthy()),
            None => self.is_healthy(),
        }
    }

    /// What a connection to its `port` selects on to learn that it was
    /// marked down under `on_backend_down = "close"`: the port's signal with
    /// per-port checks, else the backend's. Taken before the connect, so a
    /// mark-down while the connection is still being made counts too.
    pub fn marked_down_signal(&self, port: u16) -> CancellationToken {
        match self.port_health(port) {
            Some(cell) => cell.marked_down.get(),
            None => self.marked_down.get(),
        }
    }

    /// Resets every connection open to it now (it was marked down under
    /// `on_backend_down = "close"`), or only those to `port` when that port
    /// alone was marked down; later connections get a fresh signal.
    pub fn close_connections(&self, port: Option<u16>) {
        match port.and_then(|p| self.port_health(p)) {
            Some(cell) => cell.marked_down.fire(),
            None => self.marked_down.fire(),
        }
    }

    /// Connections open to it now.
    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Counts a connection for as long as the returned guard lives.
    pub fn connection_opened(self: &Arc<Self>) -> ConnectionGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.stats.active.increment();
        ConnectionGuard {
            backend: Arc::clone(self),
        }
    }

    /// Its numbers.
    pub fn stats(&self) -> &BackendStats {
        &self.stats
    }

    /// Marks it removed from its load balancer: its `backend_up` series goes
    /// now; its other series stay while its connections drain.
    pub fn leave(&self) {
        self.member.store(false, Ordering::Release);
        self.stats.up.clear();
        if let Some(cells) = &*self.ports.load() {
            for c in cells.iter() {
                c.stats.up.clear();
            }
        }
    }

    /// Resolves when the backend has been removed and its drain time is over.
    pub async fn retired(&self) {
        self.retired.cancelled().await
    }

    /// Closes every connection still open to this removed backend.
    pub fn retire(&self) {
        self.retired.cancel();
    }
}

/// Keeps a backend's connection count up while a connection is open.
pub struct ConnectionGuard {
    backend: Arc<Backend>,
}

impl Drop for ConnectionGuard {
    fn drop(&mut self) {
        self.backend.active.fetch_sub(1, Ordering::Relaxed);
        self.backend.stats.active.decrement();
    }
}

/// Per-load-balancer forwarding settings that can change on reload.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    /// How the first candidate is chosen.
    pub algorithm: Algorithm,
    /// Timeout of one connect attempt.
    pub connect_timeout: Duration,
    /// Bound on backends tried per connection; `None` = every eligible one.
    pub connect_attempts: Option<NonZeroU32>,
    /// Close a connection after this long without traffic.
    pub idle_timeout: Duration,
    /// Client affinity: how long a client keeps its backend; `None` = off.
    pub affinity_timeout: Option<Duration>,
    /// The clients served; the accept loop resets the others before it
    /// takes a connection slot. Here, in the snapshot, so a reload changes
    /// it like any other setting: one swap, no lock on the accept path.
    pub source_ranges: SourceRanges,
    /// Whether connections open to a backend marked down are reset.
    pub on_backend_down: OnBackendDown,
    /// The backend ports judged one by one (a health check without
    /// `port`): the snapshot then holds an eligible list for each. `None`
    /// (the common case, no allocation): one verdict per backend.
    pub checked_ports: Option<Arc<[u16]>>,
}

impl From<&LoadBalancerSpec> for Settings {
    fn from(spec: &LoadBalancerSpec) -> Self {
        Self {
            algorithm: spec.algorithm,
            connect_timeout: spec.connect_timeout,
            connect_attempts: spec.connect_attempts,
            idle_timeout: spec.idle_timeout,
            affinity_timeout: spec.affinity_timeout,
            source_ranges: spec.source_ranges.clone(),
            on_backend_down: spec.on_backend_down,
            checked_ports: Some(spec.checked_ports())
                .filter(|p| !p.is_empty())
                .map(Arc::from),
        }
    }
}

/// Everything one pick needs, published as a unit.
pub struct Snapshot {
    /// Backends taking new connections, in config order; with per-port
    /// checks, those taking connections on at least one port.
    pub eligible: Vec<Arc<Backend>>,
    /// With per-port checks, the backends taking connections on each
    /// checked port (sorted by port); empty otherwise.
    pub by_port: Box<[(u16, Vec<Arc<Backend>>)]>,
    /// The settings in force.
    pub settings: Settings,
}

impl Snapshot {
    /// The backends that take new connections to `backend_port` (a
    /// listener's nodeport). With one verdict per backend that is every
    /// eligible one. A port with no list of its own (a listener whose
    /// nodeport a reload has just changed, still on its old route for a
    /// moment) gets every backend eligible on some port: connect retry
    /// covers that moment, where an empty list would refuse clients.
    #[inline]
    pub fn eligible_for(&self, backend_port: u16) -> &[Arc<Backend>] {
        if self.by_port.is_empty() {
            return &self.eligible;
        }
        self.by_port
            .iter()
            .find(|(p, _)| *p == backend_port)
            .map_or(&self.eligible, |(_, list)| list)
    }

    /// Backends to try for one client of a listener whose nodeport is
    /// `backend_port`, best first: at most `connect_attempts`, never the
    /// same one twice. Empty when none is eligible. `preferred` (the
    /// client's affinity) goes first if it is eligible; otherwise the
    /// algorithm picks.
    pub fn candidates<'a>(
        &'a self,
        client: IpAddr,
        cursor: &AtomicUsize,
        preferred: Option<IpAddr>,
        backend_port: u16,
    ) -> impl Iterator<Item = &'a Arc<Backend>> + 'a {
        let eligible = self.eligible_for(backend_port);
        let n = eligible.len();
        let sticky = preferred.and_then(|ip| eligible.iter().position(|b| b.addr == ip));
        let start = match sticky {
            _ if n == 0 => 0,
            Some(i) => i,
            None => select::first_candidate(self.settings.algorithm, eligible, client, cursor),
        };
        let attempts = self
            .settings
            .connect_attempts
            .map_or(n, |a| n.min(a.get() as usize));
        (0..attempts).map(move |k| &eligible[(start + k) % n])
    }
}

/// One load balancer's members and its published snapshot.
pub struct LoadBalancer {
    /// `<namespace>/<service>`.
    pub name: String,
    /// Owning guest cluster.
    pub cluster: String,
    /// What the forwarder reads.
    snapshot: ArcSwap<Snapshot>,
    /// Round-robin position; survives snapshot swaps so a health flip does
    /// not send the next connections back to the first backend.
    cursor: AtomicUsize,
    /// Writers' state; readers never touch it.
    inner: Mutex<Inner>,
    /// Its numbers (`no_eligible_backend`).
    stats: Arc<LbStats>,
    /// Client affinity entries, made when affinity is first switched on
    /// (most load balancers never pay for a table).
    affinity: OnceLock<AffinityTable>,
}

struct Inner {
    members: Vec<Arc<Backend>>,
    settings: Settings,
    /// Whether the last published snapshot had no eligible backend.
    none_eligible: Option<bool>,
    /// Removed from the config in force: it no longer reports
    /// `no_eligible_backend`.
    left: bool,
}

impl LoadBalancer {
    /// A load balancer with the given members; publishes its first snapshot.
    pub fn new(
        name: String,
        cluster: String,
        settings: Settings,
        members: Vec<Arc<Backend>>,
        stats: Arc<LbStats>,
    ) -> Arc<Self> {
        let lb = Arc::new(Self {
            snapshot: ArcSwap::from_pointee(Snapshot {
                eligible: Vec::new(),
                by_port: Box::default(),
                settings: settings.clone(),
            }),
            cursor: AtomicUsize::new(0),
            inner: Mutex::new(Inner {
                members,
                settings,
                none_eligible: None,
                left: false,
            }),
            stats,
            name,
            cluster,
            affinity: OnceLock::new(),
        });
        lb.publish();
        lb
    }

    /// Its client-affinity table, if affinity was ever switched on. The
    /// forwarder uses it only while the snapshot's settings have a timeout.
    pub fn affinity(&self) -> Option<&AffinityTable> {
        self.affinity.get()
    }

    /// Switches client affinity on (entries drawn from `budget`) or off
    /// (entries dropped), as the settings in force say.
    pub fn configure_affinity(&self, on: bool, budget: &Arc<AffinityBudget>) {
        if on {
            self.affinity
                .get_or_init(|| AffinityTable::new(Arc::clone(budget), Arc::clone(&self.stats)));
            self.stats.affinity_enabled.store(true, Ordering::Relaxed);
        } else {
            self.stats.affinity_enabled.store(false, Ordering::Relaxed);
            if let Some(table) = self.affinity.get() {
                table.clear();
            }
        }
    }

    /// The snapshot in force: one atomic load.
    pub fn snapshot(&self) -> arc_swap::Guard<Arc<Snapshot>> {
        self.snapshot.load()
    }

    /// The snapshot in force, as an owned pointer to hold across awaits.
    pub fn snapshot_full(&self) -> Arc<Snapshot> {
        self.snapshot.load_full()
    }

    /// The round-robin cursor shared by all of this load balancer's listeners.
    pub fn cursor(&self) -> &AtomicUsize {
        &self.cursor
    }

    /// The members now (eligible or not), in config order.
    pub fn members(&self) -> Vec<Arc<Backend>> {
        self.lock().members.clone()
    }

    /// Installs new members and settings (a reload) and publishes.
    pub fn replace(&self, settings: Settings, members: Vec<Arc<Backend>>) {
        let mut inner = self.lock();
        inner.members = members;
        inner.settings = settings;
        self.publish_locked(&mut inner);
    }

    /// Marks it removed from the config in force: its `no_eligible_backend`
    /// series goes now; its counters stay while its connections drain.
    pub fn leave(&self) {
        let mut inner = self.lock();
        inner.left = true;
        self.stats.no_backend.clear();
    }

    /// Its numbers.
    pub fn stats(&self) -> &Arc<LbStats> {
        &self.stats
    }

    /// The health checker marked `backend` down (on `port` alone, with
    /// per-port checks): with `on_backend_down = "close"` in force, the
    /// connections open to it (to that port) are reset now. Returns
    /// whether they were.
    pub fn backend_marked_down(&self, backend: &Backend, port: Option<u16>) -> bool {
        let close = self.lock().settings.on_backend_down == OnBackendDown::Close;
        if close {
            backend.close_connections(port);
        }
        close
    }

    /// Rebuilds the snapshot from the members' health and swaps it in. Called
    /// after a health transition; cheap, and only writers pay for it.
    pub fn publish(&self) {
        let mut inner = self.lock();
        self.publish_locked(&mut inner);
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        // A panic while holding this lock cannot leave `Inner` half-written
        // (every write is a single assignment), so a poisoned lock is usable.
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn publish_locked(&self, inner: &mut Inner) {
        let eligible: Vec<Arc<Backend>> = inner
            .members
            .iter()
            .filter(|b| b.is_eligible())
            .cloned()
            .collect();
        let ports = inner.settings.checked_ports.as_deref().unwrap_or(&[]);
        let by_port: Box<[(u16, Vec<Arc<Backend>>)]> = ports
            .iter()
            .map(|&port| {
                let list = inner
                    .members
                    .iter()
                    .filter(|b| b.is_eligible_on(port))
                    .cloned()
                    .collect();
                (port, list)
            })
            .collect();
        // With per-port checks, a listener whose port has no backend
        // refuses its clients even while the others serve: that is the
        // state to announce (and `no_eligible_backend` shows).
        let starved: Vec<u16> = by_port
            .iter()
            .filter(|(_, list)| list.is_empty())
            .map(|(port, _)| *port)
            .collect();
        let none = eligible.is_empty() || !starved.is_empty();
        if inner.none_eligible != Some(none) {
            if none {
                tracing::warn!(
                    load_balancer = %self.name,
                    cluster = %self.cluster,
                    members = inner.members.len(),
                    backend_ports = ?starved,
                    "no eligible backend: new connections are refused until one is healthy and ready"
                );
                self.stats.no_backend_events.increment(1);
            } else if inner.none_eligible == Some(true) {
                tracing::info!(
                    load_balancer = %self.name,
                    cluster = %self.cluster,
                    eligible = eligible.len(),
                    "eligible backends again: accepting connections"
                );
            }
            inner.none_eligible = Some(none);
        }
        if !inner.left {
            self.stats.no_backend.set(none);
        }
        self.snapshot.store(Arc::new(Snapshot {
            eligible,
            by_port,
            settings: inner.settings.clone(),
        }));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(attempts: Option<u32>) -> Settings {
        Settings {
            algorithm: Algorithm::RoundRobin,
            connect_timeout: Duration::from_secs(1),
            connect_attempts: attempts.and_then(NonZeroU32::new),
            idle_timeout: Duration::from_secs(60),
            affinity_timeout: None,
            source_ranges: SourceRanges::everyone(),
            on_backend_down: OnBackendDown::Keep,
            checked_ports: None,
        }
    }

    #[test]
    fn only_healthy_members_are_eligible_and_flips_publish() {
        let metrics = crate::metrics::Metrics::new();
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        let b = Backend::new(IpAddr::from([10, 0, 0, 2]), false);
        let lb = LoadBalancer::new(
            "ns/svc".into(),
            "c".into(),
            settings(None),
            vec![a.clone(), b.clone()],
            metrics.load_balancer("c", "ns/svc"),
        );
        assert_eq!(lb.snapshot().eligible.len(), 1);
        b.set_healthy(true);
        lb.publish();
        assert_eq!(lb.snapshot().eligible.len(), 2);
        a.set_healthy(false);
        b.set_healthy(false);
        lb.publish();
        assert!(lb.snapshot().eligible.is_empty());
        assert!(metrics.render().contains("harvester_lb_no_eligible_backend_events_total{cluster=\"c\",load_balancer=\"ns/svc\"} 1"));
    }

    #[test]
    fn candidates_are_distinct_and_bounded_by_attempts() {
        let members: Vec<_> = (1..=4)
            .map(|i| Backend::new(IpAddr::from([10, 0, 0, i]), true))
            .collect();
        let lb = LoadBalancer::new(
            "a".into(),
            "c".into(),
            settings(None),
            members.clone(),
            LbStats::detached(),
        );
        let client = IpAddr::from([192, 0, 2, 9]);
        let all: Vec<IpAddr> = lb
            .snapshot()
            .candidates(client, lb.cursor(), None, 80)
            .map(|b| b.addr)
            .collect();
        assert_eq!(all.len(), 4);
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 4);
        lb.replace(settings(Some(2)), members);
        assert_eq!(
            lb.snapshot()
                .candidates(client, lb.cursor(), None, 80)
                .count(),
            2
        );
    }

    #[test]
    fn eligible_means_healthy_and_ready_and_affinity_never_overrides_it() {
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        let b = Backend::new(IpAddr::from([10, 0, 0, 2]), true);
        let lb = LoadBalancer::new(
            "a".into(),
            "c".into(),
            settings(None),
            vec![a.clone(), b.clone()],
            LbStats::detached(),
        );
        assert_eq!(a.set_admin_state(AdminState::Drain), AdminState::Ready);
        lb.publish();
        assert!(a.is_healthy() && !a.is_eligible());
        let client = IpAddr::from([192, 0, 2, 9]);
        // The client's remembered backend is drained: the pick goes elsewhere.
        for _ in 0..4 {
            let first = lb
                .snapshot()
                .candidates(client, lb.cursor(), Some(a.addr), 80)
                .next()
                .map(|b| b.addr);
            assert_eq!(first, Some(b.addr));
        }
        a.set_admin_state(AdminState::Maint);
        b.set_healthy(false);
        lb.publish();
        assert!(lb.snapshot().eligible.is_empty());
        a.set_admin_state(AdminState::Ready);
        lb.publish();
        assert_eq!(lb.snapshot().eligible.len(), 1);
    }

    #[test]
    fn a_mark_down_closes_only_under_close_and_only_once() {
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        let lb = LoadBalancer::new(
            "a".into(),
            "c".into(),
            settings(None),
            vec![a.clone()],
            LbStats::detached(),
        );
        let before = a.marked_down_signal(80);
        assert!(!lb.backend_marked_down(&a, None), "keep is the default");
        assert!(!before.is_cancelled());
        let mut close = settings(None);
        close.on_backend_down = OnBackendDown::Close;
        lb.replace(close, vec![a.clone()]);
        assert!(lb.backend_marked_down(&a, None));
        assert!(before.is_cancelled(), "connections open then are closed");
        assert!(
            !a.marked_down_signal(80).is_cancelled(),
            "later ones get a fresh signal"
        );
    }

    #[test]
    fn per_port_verdicts_give_each_port_its_own_list_and_close_only_that_port() {
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        let b = Backend::new(IpAddr::from([10, 0, 0, 2]), true);
        for backend in [&a, &b] {
            backend.set_checked_ports(&[80, 443], true);
        }
        let mut per_port = settings(None);
        per_port.on_backend_down = OnBackendDown::Close;
        per_port.checked_ports = Some(Arc::from(&[80u16, 443][..]));
        let lb = LoadBalancer::new(
            "a".into(),
            "c".into(),
            per_port.clone(),
            vec![a.clone(), b.clone()],
            LbStats::detached(),
        );
        let http = b.marked_down_signal(80);
        let https = b.marked_down_signal(443);
        let cell = b.port_health(443).expect("a cell per checked port");
        b.set_port_healthy(&cell, false);
        lb.publish();
        assert!(lb.backend_marked_down(&b, Some(443)));
        assert!(https.is_cancelled() && !http.is_cancelled());

        let snap = lb.snapshot();
        let on = |port| -> Vec<IpAddr> { snap.eligible_for(port).iter().map(|b| b.addr).collect() };
        assert_eq!(on(80), vec![a.addr, b.addr]);
        assert_eq!(on(443), vec![a.addr]);
        assert_eq!(
            on(8080),
            vec![a.addr, b.addr],
            "an unknown port: every backend eligible somewhere"
        );
        assert!(!b.is_healthy() && b.is_eligible() && !b.is_eligible_on(443));
        let client = IpAddr::from([192, 0, 2, 9]);
        for _ in 0..4 {
            let first = snap
                .candidates(client, lb.cursor(), Some(b.addr), 443)
                .next();
            assert_eq!(
                first.map(|x| x.addr),
                Some(a.addr),
                "affinity never overrides a port's verdict"
            );
        }
        drop(snap);

        // A reload keeping port 443 keeps its verdict; a new port starts healthy.
        b.set_checked_ports(&[443, 8443], true);
        assert!(Arc::ptr_eq(&cell, &b.port_health(443).expect("kept")));
        assert_eq!(b.checked_ports(), vec![443, 8443]);
        assert!(!b.is_healthy_on(443) && b.is_healthy_on(8443));
        // Back to one verdict: no cells, no per-port lists.
        b.set_checked_ports(&[], true);
        b.set_healthy(true);
        lb.replace(settings(None), vec![a.clone(), b.clone()]);
        assert!(lb.snapshot().by_port.is_empty());
        assert_eq!(lb.snapshot().eligible_for(443).len(), 2);
    }

    #[test]
    fn a_port_with_no_backend_is_no_eligible_backend() {
        let metrics = crate::metrics::Metrics::new();
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        a.set_checked_ports(&[80, 443], true);
        let mut per_port = settings(None);
        per_port.checked_ports = Some(Arc::from(&[80u16, 443][..]));
        let lb = LoadBalancer::new(
            "ns/svc".into(),
            "c".into(),
            per_port,
            vec![a.clone()],
            metrics.load_balancer("c", "ns/svc"),
        );
        a.set_port_healthy(&a.port_health(443).expect("cell"), false);
        lb.publish();
        assert_eq!(lb.snapshot().eligible.len(), 1, "it still serves port 80");
        let text = metrics.render();
        assert!(
            text.contains(
                "harvester_lb_no_eligible_backend{cluster=\"c\",load_balancer=\"ns/svc\"} 1"
            ),
            "{text}"
        );
    }

    #[test]
    fn admin_state_names_match_the_metric_labels() {
        let names: Vec<&str> = AdminState::ALL.iter().map(|s| s.as_str()).collect();
        assert_eq!(names, crate::metrics::stats::ADMIN_STATES);
        for s in AdminState::ALL {
            assert_eq!(AdminState::parse(s.as_str()), Some(s));
        }
        assert_eq!(AdminState::parse("READY"), None);
    }
}

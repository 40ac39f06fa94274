//! One backend (a node address) of a load balancer: its health, per port
//! when each listener's nodeport is checked on its own, the operator's
//! mark, its connections, and the signal that resets them when it goes
//! down.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicUsize, Ordering};

use arc_swap::ArcSwapOption;
use tokio_util::sync::CancellationToken;

use super::select;
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
        stats.times.begin(healthy);
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
        if self.healthy.swap(healthy, Ordering::SeqCst) != healthy {
            self.stats.times.health_changed(healthy);
        }
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
        if before != state {
            self.stats.times.changed();
        }
        before
    }

    /// Whether it takes new connections: healthy and `ready`; with per-port
    /// checks, healthy on at least one port (the listeners of its other
    /// ports do not pick it: see [`Snapshot::eligible_for`](super::Snapshot::eligible_for)).
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

    /// Counts a connection (or a UDP flow) in its totals, and in its open
    /// ones for as long as the returned guard lives.
    pub fn connection_opened(self: &Arc<Self>) -> ConnectionGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.stats.active.increment();
        self.stats.connections.increment(1);
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

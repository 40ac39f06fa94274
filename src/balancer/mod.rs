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

pub mod select;

use std::net::IpAddr;
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use arc_swap::ArcSwap;
use metrics::{Counter, Gauge};
use tokio_util::sync::CancellationToken;

use crate::config::{Algorithm, LoadBalancerSpec};
use crate::metrics::{self as names, Metrics};

/// One backend node of one load balancer, shared by its listeners, the prober
/// and every connection open to it.
pub struct Backend {
    /// The node's address; the listener adds its nodeport.
    pub addr: IpAddr,
    /// Precomputed hash of `addr` for source-IP picking.
    pub(crate) addr_hash: u64,
    /// Last verdict of the health checker (always true without health checks).
    healthy: AtomicBool,
    /// Connections open to this backend now (least-connections, `/status`).
    active: AtomicUsize,
    /// Cancelled when the backend has been removed and its drain time is up:
    /// connections still open to it then close.
    retired: CancellationToken,
    /// Metric handles, labelled with this backend.
    metrics: BackendMetrics,
}

/// Metric handles of one backend.
pub struct BackendMetrics {
    up: Gauge,
    active: Gauge,
    /// Failed connect attempts, by reason.
    pub connect_refused: Counter,
    /// Connect attempts that timed out.
    pub connect_timeout: Counter,
    /// Connect attempts that failed otherwise (unreachable, reset…).
    pub connect_error: Counter,
}

impl BackendMetrics {
    /// Handles registered in `metrics` with the given identity labels.
    pub fn new(metrics: &Metrics, labels: &[(&'static str, String)]) -> Self {
        let with_reason = |reason: &str| {
            let mut l = labels.to_vec();
            l.push(("reason", reason.to_string()));
            metrics.counter(names::BACKEND_CONNECT_FAILURES, &l)
        };
        Self {
            up: metrics.gauge(names::BACKEND_UP, labels),
            active: metrics.gauge(names::BACKEND_CONNECTIONS_ACTIVE, labels),
            connect_refused: with_reason("connect_refused"),
            connect_timeout: with_reason("connect_timeout"),
            connect_error: with_reason("connect_error"),
        }
    }

    /// Handles that record nothing (unit tests, benchmarks).
    pub fn noop() -> Self {
        Self {
            up: Gauge::noop(),
            active: Gauge::noop(),
            connect_refused: Counter::noop(),
            connect_timeout: Counter::noop(),
            connect_error: Counter::noop(),
        }
    }
}

impl Backend {
    /// A backend without metrics, for tests and benchmarks.
    pub fn new(addr: IpAddr, healthy: bool) -> Arc<Self> {
        Self::with_metrics(addr, healthy, BackendMetrics::noop())
    }

    /// A backend reporting to the given metric handles.
    pub fn with_metrics(addr: IpAddr, healthy: bool, metrics: BackendMetrics) -> Arc<Self> {
        metrics.up.set(if healthy { 1.0 } else { 0.0 });
        Arc::new(Self {
            addr,
            addr_hash: select::hash_ip(addr),
            healthy: AtomicBool::new(healthy),
            active: AtomicUsize::new(0),
            retired: CancellationToken::new(),
            metrics,
        })
    }

    /// Whether the health checker last found it healthy.
    pub fn is_healthy(&self) -> bool {
        self.healthy.load(Ordering::Acquire)
    }

    /// Records the health checker's verdict. The caller publishes a new
    /// snapshot afterwards.
    pub fn set_healthy(&self, healthy: bool) {
        self.healthy.store(healthy, Ordering::Release);
        self.metrics.up.set(if healthy { 1.0 } else { 0.0 });
    }

    /// Connections open to it now.
    pub fn active_connections(&self) -> usize {
        self.active.load(Ordering::Relaxed)
    }

    /// Counts a connection for as long as the returned guard lives.
    pub fn connection_opened(self: &Arc<Self>) -> ConnectionGuard {
        self.active.fetch_add(1, Ordering::Relaxed);
        self.metrics.active.increment(1.0);
        ConnectionGuard {
            backend: Arc::clone(self),
        }
    }

    /// The metric handles of this backend.
    pub fn metrics(&self) -> &BackendMetrics {
        &self.metrics
    }

    /// Resolves when the backend has been removed and its drain time is over.
    pub async fn retired(&self) {
        self.retired.cancelled().await
    }

    /// Closes every connection still open to this removed backend.
    pub fn retire(&self) {
        self.metrics.up.set(0.0);
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
        self.backend.metrics.active.decrement(1.0);
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
}

impl From<&LoadBalancerSpec> for Settings {
    fn from(spec: &LoadBalancerSpec) -> Self {
        Self {
            algorithm: spec.algorithm,
            connect_timeout: spec.connect_timeout,
            connect_attempts: spec.connect_attempts,
            idle_timeout: spec.idle_timeout,
        }
    }
}

/// Everything one pick needs, published as a unit.
pub struct Snapshot {
    /// Backends taking new connections, in config order.
    pub eligible: Vec<Arc<Backend>>,
    /// The settings in force.
    pub settings: Settings,
}

impl Snapshot {
    /// Backends to try for one client, best first: at most
    /// `connect_attempts`, never the same one twice. Empty when none is eligible.
    pub fn candidates<'a>(
        &'a self,
        client: IpAddr,
        cursor: &AtomicUsize,
    ) -> impl Iterator<Item = &'a Arc<Backend>> + 'a {
        let n = self.eligible.len();
        let start = if n == 0 {
            0
        } else {
            select::first_candidate(self.settings.algorithm, &self.eligible, client, cursor)
        };
        let attempts = self
            .settings
            .connect_attempts
            .map_or(n, |a| n.min(a.get() as usize));
        (0..attempts).map(move |k| &self.eligible[(start + k) % n])
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
    no_backend: Gauge,
    no_backend_events: Counter,
}

struct Inner {
    members: Vec<Arc<Backend>>,
    settings: Settings,
    /// Whether the last published snapshot had no eligible backend.
    none_eligible: Option<bool>,
}

impl LoadBalancer {
    /// A load balancer with the given members; publishes its first snapshot.
    pub fn new(
        name: String,
        cluster: String,
        settings: Settings,
        members: Vec<Arc<Backend>>,
        metrics: &Metrics,
    ) -> Arc<Self> {
        let labels = [
            ("cluster", cluster.clone()),
            ("load_balancer", name.clone()),
        ];
        let lb = Arc::new(Self {
            snapshot: ArcSwap::from_pointee(Snapshot {
                eligible: Vec::new(),
                settings: settings.clone(),
            }),
            cursor: AtomicUsize::new(0),
            inner: Mutex::new(Inner {
                members,
                settings,
                none_eligible: None,
            }),
            no_backend: metrics.gauge(names::NO_ELIGIBLE_BACKEND, &labels),
            no_backend_events: metrics.counter(names::NO_ELIGIBLE_BACKEND_EVENTS, &labels),
            name,
            cluster,
        });
        lb.publish();
        lb
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
            .filter(|b| b.is_healthy())
            .cloned()
            .collect();
        let none = eligible.is_empty();
        if inner.none_eligible != Some(none) {
            if none {
                tracing::warn!(
                    load_balancer = %self.name,
                    cluster = %self.cluster,
                    members = inner.members.len(),
                    "no eligible backend: new connections are refused until one is healthy"
                );
                self.no_backend_events.increment(1);
            } else if inner.none_eligible == Some(true) {
                tracing::info!(
                    load_balancer = %self.name,
                    cluster = %self.cluster,
                    eligible = eligible.len(),
                    "eligible backends again: accepting connections"
                );
            }
            self.no_backend.set(if none { 1.0 } else { 0.0 });
            inner.none_eligible = Some(none);
        }
        self.snapshot.store(Arc::new(Snapshot {
            eligible,
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
        }
    }

    #[test]
    fn only_healthy_members_are_eligible_and_flips_publish() {
        let metrics = Metrics::new();
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        let b = Backend::new(IpAddr::from([10, 0, 0, 2]), false);
        let lb = LoadBalancer::new(
            "ns/svc".into(),
            "c".into(),
            settings(None),
            vec![a.clone(), b.clone()],
            &metrics,
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
        let metrics = Metrics::new();
        let members: Vec<_> = (1..=4)
            .map(|i| Backend::new(IpAddr::from([10, 0, 0, i]), true))
            .collect();
        let lb = LoadBalancer::new(
            "a".into(),
            "c".into(),
            settings(None),
            members.clone(),
            &metrics,
        );
        let client = IpAddr::from([192, 0, 2, 9]);
        let all: Vec<IpAddr> = lb
            .snapshot()
            .candidates(client, lb.cursor())
            .map(|b| b.addr)
            .collect();
        assert_eq!(all.len(), 4);
        let mut sorted = all.clone();
        sorted.sort();
        sorted.dedup();
        assert_eq!(sorted.len(), 4);
        lb.replace(settings(Some(2)), members);
        assert_eq!(lb.snapshot().candidates(client, lb.cursor()).count(), 2);
    }
}

//! The prober: one probe loop per (load balancer, backend), shared by all of
//! that load balancer's listeners.
//!
//! A loop probes at once when it starts, then at a per-target phase within the
//! period (a stable hash of the target), then once a period: a thousand
//! targets added by one reload do not keep firing in the same millisecond.
//! Parameters can change under a running loop (reload) and take effect on the
//! next probe; the health state is kept. The prober never touches the
//! forwarder except through [`LoadBalancer::publish`], one atomic swap.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use metrics::{Counter, Histogram};
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::check::{self, Outcome};
use super::{Health, HealthState, Thresholds};
use crate::balancer::select::{hash_ip, mix64};
use crate::balancer::{Backend, LoadBalancer};
use crate::config::HealthCheckSpec;
use crate::metrics::{self as names, Metrics};

/// What identifies a probe target: the load balancer's name and the backend's address.
pub type TargetKey = (String, std::net::IpAddr);

/// All running probe loops.
#[derive(Default)]
pub struct Prober {
    targets: DashMap<TargetKey, Arc<Target>>,
}

impl Prober {
    /// An empty prober.
    pub fn new() -> Self {
        Self::default()
    }

    /// The target for `key`, if it is being probed.
    pub fn get(&self, key: &TargetKey) -> Option<Arc<Target>> {
        self.targets.get(key).map(|t| Arc::clone(&t))
    }

    /// Starts probing `backend` of `lb`, or updates the parameters of the loop
    /// already probing it (effective on its next probe, state kept).
    pub fn ensure(
        &self,
        lb: &Arc<LoadBalancer>,
        backend: &Arc<Backend>,
        spec: &HealthCheckSpec,
        initial: HealthState,
        metrics: &Metrics,
    ) -> Arc<Target> {
        let key = (lb.name.clone(), backend.addr);
        if let Some(existing) = self.targets.get(&key)
            && Arc::ptr_eq(&existing.backend, backend)
        {
            existing.spec.store(Arc::new(spec.clone()));
            return Arc::clone(&existing);
        }
        let target = Target::spawn(
            Arc::clone(lb),
            Arc::clone(backend),
            spec.clone(),
            initial,
            metrics,
        );
        if let Some(old) = self.targets.insert(key, Arc::clone(&target)) {
            old.stop();
        }
        target
    }

    /// Stops probing `key`.
    pub fn remove(&self, key: &TargetKey) {
        if let Some((_, target)) = self.targets.remove(key) {
            target.stop();
        }
    }

    /// Stops every loop (shutdown).
    pub fn stop_all(&self) {
        for t in self.targets.iter() {
            t.stop();
        }
        self.targets.clear();
    }

    /// Number of running loops.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether no loop runs.
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }
}

/// One backend being probed for one load balancer.
pub struct Target {
    /// The backend whose eligibility this loop decides.
    pub backend: Arc<Backend>,
    /// The load balancer to republish on a transition.
    lb: Arc<LoadBalancer>,
    /// Parameters in force; swapped on reload, read before every probe.
    spec: ArcSwap<HealthCheckSpec>,
    /// Verdict and last result, for the loop and `/status`.
    state: Mutex<TargetStatus>,
    /// Ends the loop.
    stop: CancellationToken,
    metrics: TargetMetrics,
}

/// What `/status` shows of a target.
#[derive(Debug, Clone, Serialize)]
pub struct TargetStatus {
    /// Verdict and consecutive counts.
    #[serde(flatten)]
    pub health: HealthState,
    /// Result of the last probe (`ok`, `refused`, `timeout`, `error`, `skipped`), if any yet.
    pub last_result: Option<&'static str>,
    /// Why the last probe failed, if it did.
    pub last_error: Option<String>,
    /// Wall-clock time of the last probe, Unix seconds.
    pub last_probe_unix: Option<f64>,
    /// Probes run since the target appeared.
    pub probes: u64,
}

struct TargetMetrics {
    ok: Counter,
    refused: Counter,
    timeout: Counter,
    error: Counter,
    skipped: Counter,
    duration: Histogram,
    to_up: Counter,
    to_down: Counter,
}

impl TargetMetrics {
    fn new(metrics: &Metrics, lb: &LoadBalancer, backend: &Backend) -> Self {
        let base = [
            ("cluster", lb.cluster.clone()),
            ("load_balancer", lb.name.clone()),
            ("backend", backend.addr.to_string()),
        ];
        let with = |k: &'static str, v: &str, name: &'static str| {
            let mut l = base.to_vec();
            l.push((k, v.to_string()));
            metrics.counter(name, &l)
        };
        Self {
            ok: with("result", "ok", names::HEALTH_CHECKS),
            refused: with("result", "refused", names::HEALTH_CHECKS),
            timeout: with("result", "timeout", names::HEALTH_CHECKS),
            error: with("result", "error", names::HEALTH_CHECKS),
            skipped: with("result", "skipped", names::HEALTH_CHECKS),
            duration: metrics.histogram(names::HEALTH_CHECK_DURATION, &base),
            to_up: with("to", "up", names::HEALTH_TRANSITIONS),
            to_down: with("to", "down", names::HEALTH_TRANSITIONS),
        }
    }
}

impl Target {
    fn spawn(
        lb: Arc<LoadBalancer>,
        backend: Arc<Backend>,
        spec: HealthCheckSpec,
        initial: HealthState,
        metrics: &Metrics,
    ) -> Arc<Self> {
        let target = Arc::new(Self {
            metrics: TargetMetrics::new(metrics, &lb, &backend),
            backend,
            lb,
            spec: ArcSwap::from_pointee(spec),
            state: Mutex::new(TargetStatus {
                health: initial,
                last_result: None,
                last_error: None,
                last_probe_unix: None,
                probes: 0,
            }),
            stop: CancellationToken::new(),
        });
        tokio::spawn(Arc::clone(&target).run());
        target
    }

    /// A copy of the current status.
    pub fn status(&self) -> TargetStatus {
        self.lock().clone()
    }

    /// Ends the probe loop (the backend or its health check was removed).
    pub fn stop(&self) {
        self.stop.cancel();
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TargetStatus> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Fraction of the period (in (0, 1]) at which this target's second probe
    /// fires; stable per target so restarts keep the spread.
    fn phase(&self) -> f64 {
        let mut h = hash_ip(self.backend.addr);
        for b in self.lb.name.bytes() {
            h = mix64(h ^ u64::from(b));
        }
        ((h % 1000) + 1) as f64 / 1000.0
    }

    async fn run(self: Arc<Self>) {
        let phase = self.phase();
        let mut next = Instant::now();
        let mut first = true;
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            let started = Instant::now();
            let spec = self.spec.load_full();
            let addr = SocketAddr::new(self.backend.addr, spec.port);
            let (outcome, took) = tokio::select! {
                _ = self.stop.cancelled() => return,
                r = check::probe(spec.check, addr, spec.timeout) => r,
            };
            self.record(&spec, addr, outcome, took);
            next = if first {
                first = false;
                started + spec.period.mul_f64(phase)
            } else {
                next + spec.period
            };
            // A loop that fell behind (suspended host, changed period) resumes
            // from now instead of firing a burst of late probes.
            let now = Instant::now();
            if next < now {
                next = now;
            }
        }
    }

    fn record(&self, spec: &HealthCheckSpec, addr: SocketAddr, outcome: Outcome, took: Duration) {
        self.metrics.duration.record(took.as_secs_f64());
        match outcome {
            Outcome::Ok => &self.metrics.ok,
            Outcome::Refused => &self.metrics.refused,
            Outcome::Timeout => &self.metrics.timeout,
            Outcome::Error(_) => &self.metrics.error,
            Outcome::Skipped(_) => &self.metrics.skipped,
        }
        .increment(1);
        let thresholds = Thresholds {
            success: spec.success_threshold,
            failure: spec.failure_threshold,
        };
        let transition = {
            let mut st = self.lock();
            st.probes += 1;
            st.last_result = Some(outcome.label());
            st.last_error = outcome.describe();
            st.last_probe_unix = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .ok()
                .map(|d| d.as_secs_f64());
            if outcome.is_conclusive() {
                st.health.observe(outcome.is_success(), thresholds)
            } else {
                None
            }
        };
        if let Some(t) = transition {
            // Stop before publishing if the loop was stopped meanwhile: a
            // removed target must not flip a backend that lives on elsewhere.
            if self.stop.is_cancelled() {
                return;
            }
            self.backend.set_healthy(t.to == Health::Healthy);
            self.lb.publish();
            match t.to {
                Health::Healthy => self.metrics.to_up.increment(1),
                Health::Unhealthy => self.metrics.to_down.increment(1),
            }
            tracing::info!(
                load_balancer = %self.lb.name,
                cluster = %self.lb.cluster,
                backend = %addr,
                from = %t.from,
                to = %t.to,
                reason = outcome.label(),
                error = outcome.describe().unwrap_or_default(),
                "backend health changed"
            );
        }
    }
}

//! The prober: one probe stream per distinct check (backend address, health
//! port, check kind, period, timeout), shared by every load balancer and
//! listener whose backends use it. Forty `LoadBalancer` services that all
//! probe kube-proxy's health port on the same three nodes cost three probes
//! a period, not a hundred and twenty.
//!
//! Each load balancer keeps its own verdict per backend ([`Target`]): the
//! thresholds may differ, so each applies its own to the shared results.
//! A stream probes at once when it starts, then at a per-address phase
//! within the period (a stable hash), then once a period: a thousand targets
//! added by one reload do not keep firing in the same millisecond. A load
//! balancer that joins a stream already running takes its verdicts from the
//! stream's next probe. Changed parameters move a target to the stream of
//! its new parameters, its health state kept. The prober never touches the
//! forwarder except through [`LoadBalancer::publish`], one atomic swap.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use serde::Serialize;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::check::{self, Outcome, ProbeSockets};
use super::{Health, HealthState, Thresholds};
use crate::balancer::select::{hash_ip, mix64};
use crate::balancer::{Backend, LoadBalancer};
use crate::config::{CheckKind, HealthCheckSpec};

/// What identifies a probe target: the load balancer's name and the backend's address.
pub type TargetKey = (String, std::net::IpAddr);

/// What makes two checks one: the same probe, sent as often, waited for as long.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct StreamKey {
    addr: SocketAddr,
    check: CheckKind,
    period: Duration,
    timeout: Duration,
}

impl StreamKey {
    fn new(ip: std::net::IpAddr, spec: &HealthCheckSpec) -> Self {
        Self {
            addr: SocketAddr::new(ip, spec.port),
            check: spec.check,
            period: spec.period,
            timeout: spec.timeout,
        }
    }
}

/// All targets, and the probe streams that feed them.
#[derive(Default)]
pub struct Prober {
    targets: DashMap<TargetKey, Arc<Target>>,
    streams: DashMap<StreamKey, Arc<Stream>>,
    /// Sockets every stream's probes share, kept between probes.
    sockets: Arc<ProbeSockets>,
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

    /// Starts probing `backend` of `lb`, or updates the parameters of the
    /// target already probing it (effective on its next probe, state kept).
    pub fn ensure(
        &self,
        lb: &Arc<LoadBalancer>,
        backend: &Arc<Backend>,
        spec: &HealthCheckSpec,
        initial: HealthState,
    ) -> Arc<Target> {
        let key = (lb.name.clone(), backend.addr);
        let existing = self.get(&key);
        if let Some(existing) = existing.filter(|t| Arc::ptr_eq(&t.backend, backend)) {
            existing.spec.store(Arc::new(spec.clone()));
            let to = StreamKey::new(backend.addr, spec);
            let from = std::mem::replace(&mut *existing.lock_stream(), to);
            if from != to {
                self.unsubscribe(from, &existing);
                self.subscribe(to, &existing);
            }
            return existing;
        }
        let target = Target::new(Arc::clone(lb), Arc::clone(backend), spec.clone(), initial);
        if let Some(old) = self.targets.insert(key, Arc::clone(&target)) {
            self.retire(&old);
        }
        let stream = *target.lock_stream();
        self.subscribe(stream, &target);
        target
    }

    /// Stops probing `key`.
    pub fn remove(&self, key: &TargetKey) {
        if let Some((_, target)) = self.targets.remove(key) {
            self.retire(&target);
        }
    }

    /// Stops every stream (shutdown).
    pub fn stop_all(&self) {
        for t in self.targets.iter() {
            t.stop.cancel();
        }
        self.targets.clear();
        for s in self.streams.iter() {
            s.stop.cancel();
        }
        self.streams.clear();
    }

    /// Number of targets (load balancer, backend) with a verdict.
    pub fn len(&self) -> usize {
        self.targets.len()
    }

    /// Whether no target is probed.
    pub fn is_empty(&self) -> bool {
        self.targets.is_empty()
    }

    /// Number of probe streams running: distinct checks actually sent.
    pub fn streams(&self) -> usize {
        self.streams.len()
    }

    fn retire(&self, target: &Arc<Target>) {
        target.stop.cancel();
        let key = *target.lock_stream();
        self.unsubscribe(key, target);
    }

    /// Adds `target` to the stream of `key`, starting the stream (which
    /// probes at once) if none runs.
    fn subscribe(&self, key: StreamKey, target: &Arc<Target>) {
        match self.streams.entry(key) {
            dashmap::Entry::Occupied(e) => {
                e.get().subscribers.rcu(|subs| {
                    let mut v = Vec::clone(subs);
                    v.push(Arc::clone(target));
                    v
                });
            }
            // The first subscriber is in place before the first probe.
            dashmap::Entry::Vacant(e) => {
                e.insert(Stream::spawn(
                    key,
                    Arc::clone(target),
                    Arc::clone(&self.sockets),
                ));
            }
        }
    }

    /// Takes `target` off the stream of `key`; a stream left with no
    /// subscriber stops.
    fn unsubscribe(&self, key: StreamKey, target: &Arc<Target>) {
        let Some(stream) = self.get_stream(&key) else {
            return;
        };
        stream.subscribers.rcu(|subs| {
            subs.iter()
                .filter(|t| !Arc::ptr_eq(t, target))
                .cloned()
                .collect::<Vec<_>>()
        });
        if stream.subscribers.load().is_empty() {
            stream.stop.cancel();
            self.streams.remove_if(&key, |_, s| Arc::ptr_eq(s, &stream));
        }
    }

    fn get_stream(&self, key: &StreamKey) -> Option<Arc<Stream>> {
        self.streams.get(key).map(|s| Arc::clone(&s))
    }
}

/// One probe sent every period to one address, its result handed to every
/// subscribed target.
struct Stream {
    key: StreamKey,
    /// Who takes the results; swapped whole when a target joins or leaves.
    subscribers: ArcSwap<Vec<Arc<Target>>>,
    /// Ends the loop.
    stop: CancellationToken,
    /// Where its probes take their sockets from.
    sockets: Arc<ProbeSockets>,
}

impl Stream {
    fn spawn(key: StreamKey, first: Arc<Target>, sockets: Arc<ProbeSockets>) -> Arc<Self> {
        let stream = Arc::new(Self {
            key,
            subscribers: ArcSwap::from_pointee(vec![first]),
            stop: CancellationToken::new(),
            sockets,
        });
        tokio::spawn(Arc::clone(&stream).run());
        stream
    }

    /// Fraction of the period (in (0, 1]) at which this stream's second
    /// probe fires; stable per address so restarts keep the spread.
    fn phase(&self) -> f64 {
        let mut h = hash_ip(self.key.addr.ip());
        h = mix64(h ^ u64::from(self.key.addr.port()));
        ((h % 1000) + 1) as f64 / 1000.0
    }

    async fn run(self: Arc<Self>) {
        let phase = self.phase();
        let StreamKey {
            addr,
            check,
            period,
            timeout,
        } = self.key;
        let mut next = Instant::now();
        let mut first = true;
        loop {
            tokio::select! {
                _ = self.stop.cancelled() => return,
                _ = tokio::time::sleep_until(next) => {}
            }
            let started = Instant::now();
            let at = SystemTime::now();
            // Boxed: a probe in flight is large, and only a few are in flight
            // at once; kept inline it would sit in every idle stream's task
            // (measured: 1.16 KB per stream, 35 MB at 30,000 backends).
            let probe = Box::pin(check::probe(check, addr, timeout, &self.sockets));
            let (outcome, took) = tokio::select! {
                _ = self.stop.cancelled() => return,
                r = probe => r,
            };
            for target in self.subscribers.load().iter() {
                target.record(addr, at, &outcome, took);
            }
            next = if first {
                first = false;
                started + period.mul_f64(phase)
            } else {
                next + period
            };
            // A stream that fell behind (suspended host) resumes from now
            // instead of firing a burst of late probes.
            let now = Instant::now();
            if next < now {
                next = now;
            }
        }
    }
}

/// One backend being probed for one load balancer.
pub struct Target {
    /// The backend whose eligibility this loop decides.
    pub backend: Arc<Backend>,
    /// The load balancer to republish on a transition.
    lb: Arc<LoadBalancer>,
    /// Parameters in force (its thresholds judge each result); swapped on reload.
    spec: ArcSwap<HealthCheckSpec>,
    /// The stream this target takes its results from.
    stream: Mutex<StreamKey>,
    /// Verdict and last result, for `/status`.
    state: Mutex<TargetStatus>,
    /// Set when the target is removed: a result still in flight must not
    /// flip a backend that lives on elsewhere.
    stop: CancellationToken,
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

impl Target {
    fn new(
        lb: Arc<LoadBalancer>,
        backend: Arc<Backend>,
        spec: HealthCheckSpec,
        initial: HealthState,
    ) -> Arc<Self> {
        Arc::new(Self {
            stream: Mutex::new(StreamKey::new(backend.addr, &spec)),
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
        })
    }

    /// A copy of the current status.
    pub fn status(&self) -> TargetStatus {
        self.lock().clone()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, TargetStatus> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn lock_stream(&self) -> std::sync::MutexGuard<'_, StreamKey> {
        self.stream.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Takes one result of the shared probe (sent at `at`) and judges it
    /// with this load balancer's thresholds.
    fn record(&self, addr: SocketAddr, at: SystemTime, outcome: &Outcome, took: Duration) {
        let spec = self.spec.load();
        // Indices into `CHECK_RESULTS`.
        let result = match outcome {
            Outcome::Ok => 0,
            Outcome::Refused => 1,
            Outcome::Timeout => 2,
            Outcome::Error(_) => 3,
            Outcome::Skipped(_) => 4,
        };
        self.backend.stats().record_probe(result, took);
        let thresholds = Thresholds {
            success: spec.success_threshold,
            failure: spec.failure_threshold,
        };
        let transition = {
            let mut st = self.lock();
            st.probes += 1;
            st.last_result = Some(outcome.label());
            st.last_error = outcome.describe();
            st.last_probe_unix = at
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
            // Stop before publishing if the target was removed meanwhile: it
            // must not flip a backend that lives on elsewhere.
            if self.stop.is_cancelled() {
                return;
            }
            self.backend.set_healthy(t.to == Health::Healthy);
            self.lb.publish();
            self.backend
                .stats()
                .record_transition(t.to == Health::Healthy);
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

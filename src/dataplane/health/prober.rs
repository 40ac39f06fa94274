//! The prober: one probe stream per distinct check (backend address, health
//! port, check kind with an HTTP check's path, host and expected statuses,
//! period, timeout), shared by every load balancer and
//! listener whose backends use it. Forty `LoadBalancer` services that all
//! probe kube-proxy's health port on the same three nodes cost three probes
//! a period, not a hundred and twenty.
//!
//! Each load balancer keeps its own verdict per backend ([`Target`]): the
//! thresholds may differ, so each applies its own to the shared results.
//! A health check without `port` has one target per backend *and* listener
//! nodeport, each deciding that port's eligibility alone; they share streams
//! with every other check of the same node, port and parameters.
//! A stream probes at once when it starts, then at a per-address phase
//! within the period (a stable hash), then once a period: a thousand targets
//! added by one reload do not keep firing in the same millisecond. A load
//! balancer that joins a stream already running takes its verdicts from the
//! stream's next probe. Changed parameters move a target to the stream of
//! its new parameters, its health state kept. One task keeps the schedule of
//! every stream; a probe is a task of its own only while it is in flight. The prober never touches the
//! forwarder except through [`LoadBalancer::publish`], one atomic swap.

use std::collections::BinaryHeap;
use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU8, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use dashmap::DashMap;
use serde::Serialize;
use tokio::sync::{Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::check::{self, Outcome, ProbeSockets};
use super::{Health, HealthState, Thresholds};
use crate::config::{CheckKind, HealthCheckSpec};
use crate::dataplane::balancer::select::{hash_ip, mix64};
use crate::dataplane::balancer::{Backend, LoadBalancer, PortHealth};
use crate::metrics::stats::CheckResult;

/// What identifies a probe target: a backend of a load balancer, and the
/// backend port it judges alone. Kept across reloads, so a target that keeps
/// its key keeps its health state.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct TargetKey {
    /// The load balancer's name.
    pub load_balancer: String,
    /// The backend's address.
    pub backend: IpAddr,
    /// The backend port judged alone; `None`: one verdict for the backend,
    /// whatever port the check probes, so a changed `port` keeps the state.
    pub port: Option<u16>,
}

impl TargetKey {
    /// The target of `backend` of `load_balancer`, on `port` alone or (`None`) as a whole.
    pub fn new(load_balancer: &str, backend: IpAddr, port: Option<u16>) -> Self {
        Self {
            load_balancer: load_balancer.to_string(),
            backend,
            port,
        }
    }
}

/// What makes two checks one: the same probe, sent as often, waited for as long.
/// Not `Copy` since HTTP checks carry a path; their details sit behind an
/// `Arc`, so a clone is still a reference count.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
struct StreamKey {
    addr: SocketAddr,
    check: CheckKind,
    period: Duration,
    timeout: Duration,
}

impl StreamKey {
    fn new(addr: SocketAddr, spec: &HealthCheckSpec) -> Self {
        Self {
            addr,
            check: spec.check.clone(),
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
    /// Hands new streams to the [`schedule`], started with the first one.
    schedule: OnceLock<mpsc::UnboundedSender<Arc<Stream>>>,
    /// Ends the schedule (shutdown).
    stop: CancellationToken,
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

    /// Starts probing `backend` of `lb` on `port`, or updates the parameters
    /// of the target already probing it (effective on its next probe, state
    /// kept). With `cell`, the target judges that port of the backend alone
    /// (a health check without `port`); without, the whole backend.
    pub fn ensure(
        &self,
        lb: &Arc<LoadBalancer>,
        backend: &Arc<Backend>,
        cell: Option<&Arc<PortHealth>>,
        port: u16,
        spec: &HealthCheckSpec,
        initial: HealthState,
    ) -> Arc<Target> {
        let key = TargetKey::new(&lb.name, backend.addr, cell.map(|c| c.port));
        let existing = self.get(&key);
        let same_cell = |t: &Arc<Target>| match (&t.cell, cell) {
            (None, None) => true,
            (Some(a), Some(b)) => Arc::ptr_eq(a, b),
            _ => false,
        };
        if let Some(existing) =
            existing.filter(|t| Arc::ptr_eq(&t.backend, backend) && same_cell(t))
        {
            existing.spec.store(Arc::new(spec.clone()));
            let to = StreamKey::new(SocketAddr::new(backend.addr, port), spec);
            let from = std::mem::replace(&mut *existing.lock_stream(), to.clone());
            if from != to {
                self.unsubscribe(from, &existing);
                self.subscribe(to, &existing);
            }
            return existing;
        }
        let target = Target::new(
            Arc::clone(lb),
            Arc::clone(backend),
            cell.cloned(),
            SocketAddr::new(backend.addr, port),
            spec.clone(),
            initial,
        );
        if let Some(old) = self.targets.insert(key, Arc::clone(&target)) {
            self.retire(&old);
        }
        let stream = target.lock_stream().clone();
        self.subscribe(stream, &target);
        target
    }

    /// Stops probing `key`.
    pub fn remove(&self, key: &TargetKey) {
        if let Some((_, target)) = self.targets.remove(key) {
            self.retire(&target);
        }
    }

    /// Stops every stream and probe, keeping each target with its last
    /// verdict: a hand-over, where no verdict may change anything any more
    /// but the state file's last write still reads them (through
    /// [`Prober::get`]) for the next process.
    pub fn freeze(&self) {
        for t in self.targets.iter() {
            t.stop.cancel();
        }
        for s in self.streams.iter() {
            s.stop();
        }
        self.streams.clear();
        self.stop.cancel();
    }

    /// Stops every stream (shutdown).
    pub fn stop_all(&self) {
        for t in self.targets.iter() {
            t.stop.cancel();
        }
        self.targets.clear();
        for s in self.streams.iter() {
            s.stop();
        }
        self.streams.clear();
        self.stop.cancel();
    }

    /// Number of targets (load balancer, backend, port judged alone) with a verdict.
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
        let key = target.lock_stream().clone();
        self.unsubscribe(key, target);
    }

    /// Adds `target` to the stream of `key`, starting the stream (which
    /// probes at once) if none runs.
    fn subscribe(&self, key: StreamKey, target: &Arc<Target>) {
        match self.streams.entry(key.clone()) {
            dashmap::Entry::Occupied(e) => {
                e.get().subscribers.rcu(|subs| {
                    let mut v = Vec::clone(subs);
                    v.push(Arc::clone(target));
                    v
                });
            }
            // The first subscriber is in place before the first probe.
            dashmap::Entry::Vacant(e) => {
                let stream = Stream::new(key, Arc::clone(target));
                e.insert(Arc::clone(&stream));
                // Fails only when the schedule has ended: shutting down.
                let _ = self.schedule().send(stream);
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
            stream.stop();
            self.streams.remove_if(&key, |_, s| Arc::ptr_eq(s, &stream));
        }
    }

    fn schedule(&self) -> &mpsc::UnboundedSender<Arc<Stream>> {
        self.schedule.get_or_init(|| {
            let (tx, rx) = mpsc::unbounded_channel();
            let in_flight = Arc::new(Semaphore::new(max_probes_in_flight()));
            tokio::spawn(schedule(
                rx,
                Arc::clone(&self.sockets),
                in_flight,
                self.stop.clone(),
            ));
            tx
        })
    }

    fn get_stream(&self, key: &StreamKey) -> Option<Arc<Stream>> {
        self.streams.get(key).map(|s| Arc::clone(&s))
    }
}

/// One probe sent every period to one address, its result handed to every
/// subscribed target. It has no task of its own: the [`schedule`] says when
/// it is due, and its probe runs as a task only while in flight.
struct Stream {
    key: StreamKey,
    /// Who takes the results; swapped whole when a target joins or leaves.
    subscribers: ArcSwap<Vec<Arc<Target>>>,
    /// Set when its last subscriber left: the schedule drops it when it
    /// next comes due, and a probe in flight hands its result to no one.
    stopped: AtomicBool,
    /// Whether a probe is in flight ([`IDLE`], [`RUNNING`], [`OWED`]).
    /// Probes of one stream never overlap: one that comes due while the
    /// last is still out (a timeout as long as the period) is sent the
    /// moment that one ends, as a stream with its own loop would.
    probing: AtomicU8,
}

/// No probe of the stream is in flight.
const IDLE: u8 = 0;
/// A probe is in flight.
const RUNNING: u8 = 1;
/// A probe is in flight and the next one is already due.
const OWED: u8 = 2;

impl Stream {
    fn new(key: StreamKey, first: Arc<Target>) -> Arc<Self> {
        Arc::new(Self {
            key,
            subscribers: ArcSwap::from_pointee(vec![first]),
            stopped: AtomicBool::new(false),
            probing: AtomicU8::new(IDLE),
        })
    }

    fn stop(&self) {
        self.stopped.store(true, Ordering::Release);
    }

    fn is_stopped(&self) -> bool {
        self.stopped.load(Ordering::Acquire)
    }

    /// Fraction of the period (in (0, 1]) at which this stream's second
    /// probe fires; stable per address so restarts keep the spread.
    fn phase(&self) -> f64 {
        let mut h = hash_ip(self.key.addr.ip());
        h = mix64(h ^ u64::from(self.key.addr.port()));
        ((h % 1000) + 1) as f64 / 1000.0
    }

    /// Marks a probe due: true when the caller is to send it (none was in
    /// flight); otherwise the probe in flight sends it when it ends.
    fn come_due(&self) -> bool {
        let was = self
            .probing
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                Some(if s == IDLE { RUNNING } else { OWED })
            })
            .unwrap_or(OWED);
        was == IDLE
    }

    /// Sends the probe due, and hands its result to every subscriber; again
    /// while another came due meanwhile.
    async fn probe(self: Arc<Self>, sockets: Arc<ProbeSockets>) {
        let StreamKey {
            addr,
            ref check,
            timeout,
            ..
        } = self.key;
        loop {
            let at = SystemTime::now();
            let (outcome, took) = check::probe(check, addr, timeout, &sockets).await;
            if self.is_stopped() {
                return;
            }
            for target in self.subscribers.load().iter() {
                target.record(addr, at, &outcome, took);
            }
            let was = self
                .probing
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |s| {
                    Some(if s == OWED { RUNNING } else { IDLE })
                })
                .unwrap_or(IDLE);
            if was != OWED {
                return;
            }
        }
    }
}

/// How many probes may be in flight at once: an eighth of the open-file
/// limit, within [64, 16,384]. Every probe holds a socket until it is
/// answered or times out, and the listeners and forwarded connections need
/// the same descriptors: 30,000 backends that stop answering at once would
/// otherwise hold 30,000 sockets for a whole timeout and leave none for
/// clients (seen at 10,000 load balancers with a 20,000 limit). Probes over
/// the bound wait their turn; a verdict then comes later, never wrongly.
fn max_probes_in_flight() -> usize {
    let limit = crate::os::open_file_limit().unwrap_or(1024);
    usize::try_from(limit / 8)
        .unwrap_or(usize::MAX)
        .clamp(64, 16_384)
}

/// A stream's next probe time, ordered earliest first in the schedule's heap.
struct Due {
    at: Instant,
    stream: Arc<Stream>,
    /// Whether the probe due is the stream's first: the second comes at the
    /// stream's phase within the period, the rest a period apart.
    first: bool,
}

impl PartialEq for Due {
    fn eq(&self, other: &Self) -> bool {
        self.at == other.at
    }
}

impl Eq for Due {}

impl PartialOrd for Due {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Due {
    /// Reversed, so that `BinaryHeap` (a max-heap) yields the earliest.
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        other.at.cmp(&self.at)
    }
}

/// The one task that knows when every stream is due: a heap of due times
/// and a single timer. A task per stream would keep a timer, a
/// cancellation future and a task header for every address probed, idle
/// almost all of the time (measured: ~1 KB per stream, 29 MB at 30,000).
/// New streams arrive on `new` and probe at once; a stopped stream is
/// dropped when it next comes due. Ends when `stop` is cancelled or the
/// prober is gone.
async fn schedule(
    mut new: mpsc::UnboundedReceiver<Arc<Stream>>,
    sockets: Arc<ProbeSockets>,
    in_flight: Arc<Semaphore>,
    stop: CancellationToken,
) {
    let mut due: BinaryHeap<Due> = BinaryHeap::new();
    let timer = tokio::time::sleep_until(Instant::now());
    tokio::pin!(timer);
    let mut armed: Option<Instant> = None;
    loop {
        let next = due.peek().map(|d| d.at);
        if next.is_some() && next != armed {
            timer.as_mut().reset(next.unwrap_or_else(Instant::now));
            armed = next;
        }
        tokio::select! {
            biased;
            _ = stop.cancelled() => return,
            stream = new.recv() => match stream {
                Some(stream) => due.push(Due { at: Instant::now(), stream, first: true }),
                None => return,
            },
            _ = &mut timer, if next.is_some() => {
                armed = None;
                let now = Instant::now();
                while due.peek().is_some_and(|d| d.at <= now) {
                    let Some(Due { at, stream, first }) = due.pop() else { break };
                    if stream.is_stopped() {
                        continue;
                    }
                    let period = stream.key.period;
                    if stream.come_due() {
                        // Waits while the bound is reached: due probes go
                        // out in order as the ones in flight end.
                        let permit = tokio::select! {
                            _ = stop.cancelled() => return,
                            p = Arc::clone(&in_flight).acquire_owned() => p,
                        };
                        let Ok(permit) = permit else { return };
                        let probe = Arc::clone(&stream).probe(Arc::clone(&sockets));
                        tokio::spawn(async move {
                            probe.await;
                            drop(permit);
                        });
                    }
                    let next = if first { at + period.mul_f64(stream.phase()) } else { at + period };
                    // A schedule that fell behind (suspended host) resumes
                    // from now instead of firing a burst of late probes.
                    due.push(Due { at: next.max(now), stream, first: false });
                }
            }
        }
    }
}

/// `outcome`'s `result` label of `health_checks_total`.
fn check_result(outcome: &Outcome) -> CheckResult {
    match outcome {
        Outcome::Ok => CheckResult::Ok,
        Outcome::Refused => CheckResult::Refused,
        Outcome::Timeout => CheckResult::Timeout,
        Outcome::Error(_) => CheckResult::Error,
        Outcome::Skipped(_) => CheckResult::Skipped,
        Outcome::HttpStatus { .. } => CheckResult::HttpStatus,
        Outcome::HttpError(_) => CheckResult::HttpError,
    }
}

/// One backend being probed for one load balancer.
pub struct Target {
    /// The backend whose eligibility this loop decides.
    pub backend: Arc<Backend>,
    /// The backend port it decides alone (a health check without `port`);
    /// `None`: it decides for the whole backend.
    cell: Option<Arc<PortHealth>>,
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
    /// Result of the last probe (`ok`, `refused`, `timeout`, `error`,
    /// `skipped`, `http_status`, `http_error`), if any yet.
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
        cell: Option<Arc<PortHealth>>,
        addr: SocketAddr,
        spec: HealthCheckSpec,
        initial: HealthState,
    ) -> Arc<Self> {
        Arc::new(Self {
            stream: Mutex::new(StreamKey::new(addr, &spec)),
            backend,
            cell,
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
        self.backend
            .stats()
            .record_probe(check_result(outcome), took);
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
            let up = t.to == Health::Healthy;
            match &self.cell {
                Some(cell) => self.backend.set_port_healthy(cell, up),
                None => self.backend.set_healthy(up),
            }
            self.lb.publish();
            // After the publish: no new connection goes there while the
            // open ones are reset.
            let port = self.cell.as_ref().map(|c| c.port);
            let closed = !up
                && self.lb.backend_marked_down(&self.backend, port)
                && self.backend.active_connections() > 0;
            if closed {
                tracing::info!(
                    load_balancer = &*self.lb.name,
                    backend = %addr,
                    open = self.backend.active_connections(),
                    "on_backend_down = close: resetting the connections open to the backend{}",
                    if port.is_some() { " port" } else { "" }
                );
            }
            self.backend
                .stats()
                .record_transition(t.to == Health::Healthy);
            tracing::info!(
                load_balancer = &*self.lb.name,
                cluster = &*self.lb.cluster,
                backend = %addr,
                from = %t.from,
                to = %t.to,
                reason = outcome.label(),
                error = outcome.describe().as_deref(),
                "backend health changed"
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::InitialState;
    use crate::dataplane::balancer::Settings;
    use crate::metrics::LbStats;
    use crate::metrics::by_label::Label;
    use crate::metrics::stats::CHECK_RESULTS;
    use crate::test_clock::run_until;
    use std::num::NonZeroU32;

    const PERIOD: Duration = Duration::from_secs(10);
    /// Margin around a due time: tokio's timers tick in milliseconds.
    const MS2: Duration = Duration::from_millis(2);

    /// A load balancer with one backend at `addr`, healthy, probed with a TCP
    /// check every [`PERIOD`], deciding after `failures` refusals.
    fn probed(prober: &Prober, addr: SocketAddr, failures: u32) -> Arc<Target> {
        let backend = Backend::new(addr.ip(), true);
        let lb = LoadBalancer::new(
            "ns/svc".into(),
            "c".into(),
            Settings::for_tests(),
            vec![Arc::clone(&backend)],
            LbStats::detached(),
        );
        let spec = HealthCheckSpec {
            check: CheckKind::TcpConnect,
            port: Some(addr.port()),
            success_threshold: NonZeroU32::MIN,
            failure_threshold: NonZeroU32::new(failures).unwrap(),
            period: PERIOD,
            timeout: Duration::from_secs(1),
        };
        let initial = HealthState::new(InitialState::Healthy);
        prober.ensure(&lb, &backend, None, addr.port(), &spec, initial)
    }

    /// The stream's second probe, after the first: its phase of the period.
    fn second_probe(prober: &Prober, target: &Target) -> Duration {
        let key = target.lock_stream().clone();
        PERIOD.mul_f64(prober.get_stream(&key).unwrap().phase())
    }

    /// Waits (paused clock standing still) until the target has `n` results.
    async fn probed_times(target: &Target, n: u64) {
        let got = run_until(20_000, || target.status().probes >= n).await;
        assert!(got, "probe {n} never came: {:?}", target.status());
        assert_eq!(target.status().probes, n, "{:?}", target.status());
    }

    /// Lets a probe that should not be due land if it were sent, then
    /// checks it was not.
    async fn still_probed(target: &Target, n: u64) {
        run_until(200, || target.status().probes != n).await;
        assert_eq!(target.status().probes, n, "a probe came early");
    }

    #[tokio::test(start_paused = true)]
    async fn a_stream_probes_at_once_then_at_its_phase_then_once_a_period() {
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let prober = Prober::new();
        let target = probed(&prober, listener.local_addr().unwrap(), 1);
        probed_times(&target, 1).await;
        let second = second_probe(&prober, &target);
        assert!(second > MS2 * 2 && second <= PERIOD, "{second:?}");
        tokio::time::advance(second - MS2).await;
        still_probed(&target, 1).await;
        tokio::time::advance(MS2 * 2).await;
        probed_times(&target, 2).await;
        for n in 3..6 {
            tokio::time::advance(PERIOD - MS2 * 2).await;
            still_probed(&target, n - 1).await;
            tokio::time::advance(MS2 * 2).await;
            probed_times(&target, n).await;
        }
        assert_eq!(target.status().last_result, Some("ok"));
        prober.stop_all();
    }

    #[tokio::test(start_paused = true)]
    async fn the_failure_threshold_flips_the_verdict_at_its_probe() {
        // A port nobody listens on: the kernel refuses at once.
        let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = closed.local_addr().unwrap();
        drop(closed);
        let prober = Prober::new();
        let target = probed(&prober, addr, 3);
        probed_times(&target, 1).await;
        assert_eq!(target.status().last_result, Some("refused"));
        assert!(target.backend.is_healthy(), "flipped after one refusal");
        tokio::time::advance(second_probe(&prober, &target) + MS2).await;
        probed_times(&target, 2).await;
        assert!(target.backend.is_healthy(), "flipped after two refusals");
        assert_eq!(target.lb.snapshot().eligible.len(), 1);
        tokio::time::advance(PERIOD).await;
        probed_times(&target, 3).await;
        assert!(!target.backend.is_healthy(), "not flipped after three");
        assert_eq!(target.status().health.status, Health::Unhealthy);
        assert!(target.lb.snapshot().eligible.is_empty());
        prober.stop_all();
    }

    #[test]
    fn every_outcome_counts_under_its_own_result_label() {
        let outcomes = [
            Outcome::Ok,
            Outcome::Refused,
            Outcome::Timeout,
            Outcome::Error("e".into()),
            Outcome::Skipped("s".into()),
            Outcome::HttpStatus {
                status: 503,
                detail: "d".into(),
            },
            Outcome::HttpError("h".into()),
        ];
        assert_eq!(outcomes.len(), CHECK_RESULTS.len());
        for outcome in &outcomes {
            assert_eq!(
                CHECK_RESULTS[check_result(outcome).index()],
                outcome.label(),
                "{outcome:?}"
            );
        }
    }
}

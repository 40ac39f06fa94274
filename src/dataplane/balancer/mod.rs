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
mod backend;
pub mod select;

use std::net::{IpAddr, SocketAddr};
use std::num::NonZeroU32;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

use arc_swap::ArcSwap;
use tokio_util::sync::CancellationToken;

pub use self::affinity::{AffinityBudget, AffinityTable};
pub use self::backend::{AdminState, Backend, ConnectionGuard, PortHealth};
use crate::config::{Algorithm, LoadBalancerSpec, LogConnections, OnBackendDown, SourceRanges};
use crate::dataplane::budget::Budget;
use crate::metrics::LbStats;

/// The address a client connected from, as the forwarder accepted it.
///
/// A type of its own because a client's and a backend's address sit side
/// by side wherever a pick is made (affinity remembers one for the other,
/// the PROXY protocol header writes the client's beside the VIP's): swapped
/// bare addresses would compile and send one client's traffic by another's
/// key. Affinity and source-IP hashing go by [`ClientAddr::ip`], so a client
/// is one key whichever socket family it arrived on.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ClientAddr(SocketAddr);

impl ClientAddr {
    /// The client at `peer` (an accepted connection's or a datagram's source).
    pub fn new(peer: SocketAddr) -> Self {
        Self(peer)
    }

    /// The client's IP address, IPv4-mapped IPv6 written as IPv4: what
    /// affinity and source-IP hashing key on.
    pub fn ip(self) -> IpAddr {
        self.0.ip().to_canonical()
    }

    /// The client's address and port as the socket reported them.
    pub fn socket(self) -> SocketAddr {
        self.0
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
    /// Which connections get a line in the connection log.
    pub log_connections: LogConnections,
    /// The backend ports judged one by one (a health check without
    /// `port`): the snapshot then holds an eligible list for each. `None`
    /// (the common case, no allocation): one verdict per backend.
    pub checked_ports: Option<Arc<[u16]>>,
}

#[cfg(test)]
impl Settings {
    /// Round robin, 1 s connect timeout, 60 s idle timeout, everything else off.
    pub(crate) fn for_tests() -> Self {
        Self {
            algorithm: Algorithm::RoundRobin,
            connect_timeout: Duration::from_secs(1),
            connect_attempts: None,
            idle_timeout: Duration::from_secs(60),
            affinity_timeout: None,
            source_ranges: SourceRanges::everyone(),
            on_backend_down: OnBackendDown::Keep,
            log_connections: LogConnections::None,
            checked_ports: None,
        }
    }
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
            log_connections: spec.log_connections,
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
        client: ClientAddr,
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
    /// Its share of the process-wide connection cap: every TCP connection
    /// of its listeners holds a slot; set by the daemon at each apply.
    connections: Arc<Budget>,
    /// Its share of the process-wide UDP flow bound, likewise.
    udp_flows: Arc<Budget>,
    /// Cancelled when the last holder lets it go (the config, every
    /// listener's route, every connection and probe): a removed load
    /// balancer's backends and numbers need not wait out the drain time.
    released: CancellationToken,
    /// Woken after every publish, one `Notify` per consumer of the
    /// eligible set outside the proxy (the kernel's NAT writer, the
    /// announcer): each learns of a health flip or a drain on its own,
    /// without the prober or the admin path knowing of it, and without
    /// one consumer passing the news on to the next.
    on_publish: OnceLock<Box<[Arc<tokio::sync::Notify>]>>,
    /// Set by every publish, cleared by [`LoadBalancer::take_published`]:
    /// which load balancers the kernel writer must look at again, so that
    /// a flip among 10,000 costs it one load balancer's work, not 10,000.
    published: std::sync::atomic::AtomicBool,
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

impl Drop for LoadBalancer {
    fn drop(&mut self) {
        self.released.cancel();
    }
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
            connections: Budget::new(usize::MAX),
            udp_flows: Budget::new(usize::MAX),
            released: CancellationToken::new(),
            on_publish: OnceLock::new(),
            published: std::sync::atomic::AtomicBool::new(true),
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

    /// Its cap on TCP connections (all its listeners): a connection
    /// holds a [`Slot`](crate::dataplane::budget::Slot) of it.
    pub fn connections(&self) -> &Arc<Budget> {
        &self.connections
    }

    /// Its cap on UDP flows (all its listeners).
    pub fn udp_flows(&self) -> &Arc<Budget> {
        &self.udp_flows
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

    /// Whether a snapshot was published since the last call (true once at
    /// first), for the kernel writer, one of the consumers woken by
    /// [`Self::notify_on_publish`] (the only one that works per load
    /// balancer; the announcer looks at every VIP at each wake-up).
    pub fn take_published(&self) -> bool {
        self.published
            .swap(false, std::sync::atomic::Ordering::AcqRel)
    }

    /// Wakes each of `consumers` after every publish from now on, and
    /// once now. The set is given once per load balancer (the daemon's
    /// consumers do not change while it lives); a second call changes
    /// nothing but the wake-up now.
    pub fn notify_on_publish(&self, consumers: impl IntoIterator<Item = Arc<tokio::sync::Notify>>) {
        let consumers = self
            .on_publish
            .get_or_init(|| consumers.into_iter().collect());
        for notify in consumers.iter() {
            notify.notify_one();
        }
    }

    /// Its numbers.
    pub fn stats(&self) -> &Arc<LbStats> {
        &self.stats
    }

    /// Resolves once this load balancer is dropped: nothing forwards
    /// through it or probes for it any more.
    pub fn released(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        self.released.clone().cancelled_owned()
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
                    load_balancer = &*self.name,
                    cluster = &*self.cluster,
                    members = inner.members.len(),
                    backend_ports = ?starved,
                    "no eligible backend: new connections are refused until one is healthy and ready"
                );
                self.stats.no_backend_events.increment(1);
            } else if inner.none_eligible == Some(true) {
                tracing::info!(
                    load_balancer = &*self.name,
                    cluster = &*self.cluster,
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
        self.published
            .store(true, std::sync::atomic::Ordering::Release);
        for notify in self.on_publish.get().into_iter().flatten() {
            notify.notify_one();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn settings(attempts: Option<u32>) -> Settings {
        Settings {
            connect_attempts: attempts.and_then(NonZeroU32::new),
            ..Settings::for_tests()
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

    #[tokio::test]
    async fn every_consumer_is_woken_by_each_publish_on_its_own() {
        use tokio::sync::Notify;
        let metrics = crate::metrics::Metrics::new();
        let a = Backend::new(IpAddr::from([10, 0, 0, 1]), true);
        let lb = LoadBalancer::new(
            "ns/svc".into(),
            "c".into(),
            settings(None),
            vec![a.clone()],
            metrics.load_balancer("c", "ns/svc"),
        );
        let (kernel, announcer) = (Arc::new(Notify::new()), Arc::new(Notify::new()));
        lb.notify_on_publish([Arc::clone(&kernel), Arc::clone(&announcer)]);
        // Woken once at subscription; the permit is taken here.
        let woken = |n: &Arc<Notify>| {
            let n = Arc::clone(n);
            async move {
                tokio::time::timeout(std::time::Duration::from_secs(5), n.notified())
                    .await
                    .is_ok()
            }
        };
        assert!(woken(&kernel).await && woken(&announcer).await);
        assert!(lb.take_published());
        // A flip seen by one consumer is still news to the other.
        a.set_healthy(false);
        lb.publish();
        assert!(woken(&kernel).await, "the kernel writer is woken");
        assert!(woken(&announcer).await, "so is the announcer, directly");
        assert!(lb.take_published() && !lb.take_published());
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
        let client = ClientAddr::new(SocketAddr::from(([192, 0, 2, 9], 40000)));
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
        let client = ClientAddr::new(SocketAddr::from(([192, 0, 2, 9], 40000)));
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
        let client = ClientAddr::new(SocketAddr::from(([192, 0, 2, 9], 40000)));
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

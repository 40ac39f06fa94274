//! `vip.announce = "routes"`: deciding per VIP whether this host should
//! attract its traffic, and driving the route writer ([`crate::host::announce::routes`])
//! to match.
//!
//! The conditions of a VIP are read from the live state: at least one of
//! its listeners bound with an eligible backend on its port, the VIP and
//! the host not drained by the operator, the daemon not stopping. Each VIP
//! has a [`super::decide::Hysteresis`] that turns them into announce and withdraw
//! transitions (rise delay, damping); one task feeds it and writes the
//! kernel to match. It wakes on every publish of a load balancer (a health
//! flip, an operator's drain; its own `Notify`, beside the kernel writer's) and every
//! apply, and once a second for what publishes nothing (a listener bound by
//! a retry); every step reads the table back and repairs it (a route of
//! ours deleted by hand comes back, one no VIP wants goes), and the VIPs'
//! local routes at most once a second.
//!
//! One table, one daemon: the first step takes the table's claim
//! ([`crate::host::announce::routes::TableClaim`]); while another live daemon in this
//! network namespace holds it, nothing is written or deleted (no route, no
//! local route), the refusal is in `/status` and the log, and the claim is
//! tried again every 2 s. The interface must be `lo` or a dummy one.
//!
//! What `/status` says is what the kernel holds: every step reads the
//! table back, and a route of ours that is gone is not shown announced (and
//! is written again in the same step). Loopback VIPs and VIPs outside
//! `vip.announce_prefixes` are never announced nor made local
//! (the second kind never gets here: `vip_guard` refuses them at apply).
//!
//! Start: with the claim held, every route of our protocol in the table is
//! a dead daemon's; the first step deletes them, so every VIP starts
//! withdrawn. Stop:
//! `Announcer::stop` withdraws every VIP before the listeners
//! close; the VIPs' local routes go after the drain
//! (`Announcer::remove_local_routes`).
//!
//! [`Announcer`] is the feature's component: its own state and task,
//! stopped in its two phases, its `/status` part; what it reads of the
//! daemon comes through [`AnnounceView`] (the settings in force, which VIPs
//! are served, whether it stops, its claims), so the daemon only holds it,
//! starts its task at apply and passes the operator's marks on.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Weak};
use std::time::{Duration, SystemTime};

use tokio::sync::Notify;
use tokio::time::Instant;

use serde::Serialize;

use crate::config::AnnounceSettings;
use crate::host::announce::routes::{
    AnnounceError, RouteTable, RouteWriter, SeenRoute, TableClaim, VipLocalRoutes,
};
use crate::host::owned::{Backend, Driver, Outcome, StopPhase};
use crate::metrics::{Metrics, VipAnnounceSample};

use super::decide::{Blocker, Hysteresis, Reason, Transition};

/// The rise delay of a VIP none of whose load balancers is health checked.
const DEFAULT_DELAY_WITHOUT_CHECKS: Duration = Duration::from_secs(3);
/// The rise delay is this many probe periods (the longest of the VIP's).
pub(crate) const PERIODS_PER_DELAY: u32 = 3;
/// How often the conditions are read with no wake-up.
const POLL: Duration = Duration::from_secs(1);
/// The protocol of the routes the kernel makes itself (an address's local
/// route): `RTPROT_KERNEL`.
const RTPROT_KERNEL: u8 = 2;

/// The operator's marks: a drained host, drained VIPs.
#[derive(Debug, Default)]
struct Marks {
    host: bool,
    vips: BTreeSet<IpAddr>,
}

/// The part of the daemon that announces VIPs: its own state and task;
/// what it reads of the daemon comes through [`AnnounceView`].
pub struct Announcer {
    /// Where its errors and repairs are counted.
    metrics: Arc<Metrics>,
    /// Woken by publishes and applies.
    wake: Arc<Notify>,
    /// Set once the task runs.
    started: AtomicBool,
    /// Set at a start after a hand-over (issue 41): the first step keeps
    /// the routes the previous process left, announced, instead of
    /// deleting them as a dead predecessor's.
    adopt: AtomicBool,
    marks: std::sync::Mutex<Marks>,
    /// What `/status` shows, as of the last step.
    status: std::sync::Mutex<Option<AnnounceStatus>>,
    /// The writer's side; the task and the stop path take it in turn.
    inner: tokio::sync::Mutex<Inner>,
}

// The stop order below (announce routes withdrawn before the drain, local
// routes removed after it) is the one each kind declares.
const _: () = assert!(
    matches!(RouteTable::STOP, StopPhase::BeforeDrain)
        && matches!(VipLocalRoutes::STOP, StopPhase::AfterDrain)
);

#[derive(Default)]
struct Inner {
    writer: Option<RouteWriter>,
    /// The routes of the claimed table (a dead predecessor's deleted at
    /// the first sync): what the kernel holds, read back every step.
    routes: Option<Driver<RouteTable>>,
    /// This daemon's claim on the routes' table: held while it announces there.
    claim: Option<TableClaim>,
    /// The interface name and index the local and announce routes use.
    interface: Option<(String, u32)>,
    vips: BTreeMap<IpAddr, VipState>,
    /// The VIPs' local routes (AnyIP: how the host accepts their traffic).
    local: Option<Driver<VipLocalRoutes>>,
    /// The VIPs made local by the last sync that left nothing to retry.
    made_local: BTreeSet<IpAddr>,
    /// The VIPs already local through another program's route (an address
    /// on the interface): left alone, warned about once.
    local_elsewhere: BTreeSet<IpAddr>,
    /// The last error of the interface or the local routes.
    error: Option<String>,
    /// Set at stop: nothing is announced again.
    stopped: bool,
    last_check: Option<Instant>,
}

/// What the route step ([`Announcer::announce_route_step`]) reads and changes of
/// [`Inner`]: each VIP's decision and counts, the announce table's driver
/// (`None` until the table is claimed), and the error shown in `/status`.
/// Borrowed apart from `Inner` so the step runs against any
/// [`AnnounceRoutes`] table, the tests' in memory included.
struct RouteStep<'a, R: AnnounceRoutes> {
    vips: &'a mut BTreeMap<IpAddr, VipState>,
    routes: Option<&'a mut Driver<R>>,
    error: &'a mut Option<String>,
}

/// A table of announce routes as the route step drives it: one host route
/// per announced VIP out of the interface of that index, read back as the
/// kernel shows it. [`RouteTable`] (rtnetlink) in the daemon; any kind with
/// these keys and values is one (the tests' table in memory).
trait AnnounceRoutes: Backend<Key = IpAddr, Want = u32, Seen = SeenRoute> {}

impl<B: Backend<Key = IpAddr, Want = u32, Seen = SeenRoute>> AnnounceRoutes for B {}

/// One VIP's announcing: its decision over time and what was done.
struct VipState {
    decision: Hysteresis,
    announces: u64,
    withdrawals: u64,
    /// The last write error, until a write succeeds.
    error: Option<String>,
}

/// `announce` in `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct AnnounceStatus {
    /// `routes` (the section is absent with `none`).
    pub mode: &'static str,
    /// `vip.announce_table`.
    pub table: u32,
    /// `vip.announce_interface`.
    pub interface: String,
    /// The route protocol number of our routes.
    pub protocol: u8,
    /// `harvester-lb host drain` is in force.
    pub host_drained: bool,
    /// A problem with the interface or the VIPs' local routes.
    pub error: Option<String>,
    /// Every VIP of the config in force.
    pub vips: Vec<VipAnnounceStatus>,
}

/// One VIP's announcement in `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct VipAnnounceStatus {
    /// The VIP.
    pub vip: IpAddr,
    /// Whether this host's route for it is in the table, as read back from
    /// the kernel this step.
    pub announced: bool,
    /// Why not: `no_eligible_backend`, `drained`, `stopping`, `damped`,
    /// `waiting`; `null` while announced.
    pub reason: Option<&'static str>,
    /// Announces and withdrawals so far.
    pub transitions: u64,
    /// Since when it is announced or not, Unix seconds.
    pub since: f64,
    /// The rise delay in force now (damping included), seconds.
    pub rise_delay_seconds: f64,
    /// `harvester-lb vip drain` is in force for it.
    pub drained: bool,
    /// The last write the kernel refused, until one succeeds.
    pub error: Option<String>,
}

/// The per-VIP view of the `announce` section, for a load balancer.
#[derive(Debug, Clone, Serialize)]
pub struct LbAnnounceStatus {
    /// Whether this host's route for the VIP is in the table.
    pub announced: bool,
    /// Why not.
    pub reason: Option<&'static str>,
    /// Announces and withdrawals so far.
    pub transitions: u64,
    /// Since when, Unix seconds.
    pub since: f64,
}

/// Why an operator's announce mark could not be set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AnnounceStateError {
    /// The config in force does not announce.
    #[error(
        "vip.announce is not \"routes\" in the config in force: nothing is announced, so nothing can be drained"
    )]
    Off,
    /// No load balancer has that VIP.
    #[error("no load balancer of the config in force has VIP {0}; /status lists them")]
    UnknownVip(IpAddr),
}

/// What an operator's mark changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AnnounceStateChange {
    /// `drain` or `ready`, before.
    pub previous: &'static str,
    /// `drain` or `ready`, now.
    pub state: &'static str,
}

fn mark_name(drained: bool) -> &'static str {
    if drained { "drain" } else { "ready" }
}

/// Unix seconds of a tokio instant (for `/status`).
fn unix_of(t: Instant) -> f64 {
    let ago = Instant::now().saturating_duration_since(t);
    SystemTime::now()
        .checked_sub(ago)
        .and_then(|s| s.duration_since(SystemTime::UNIX_EPOCH).ok())
        .map_or(0.0, |d| d.as_secs_f64())
}

/// One VIP's conditions for being announced, as read from the live state
/// now, and the rise delay they must hold for: what the VIP's
/// [`Hysteresis`] is fed at each step.
struct VipConditions {
    /// `Ok` when this host can serve the VIP; otherwise why not.
    conditions: Result<(), Blocker>,
    /// How long `conditions` must hold before the VIP is announced
    /// (`vip.announce_delay_seconds`, or from the health checks).
    delay: Duration,
}

/// What the announcer reads of the daemon: the settings in force, which
/// VIPs have a listener bound with an eligible backend, whether it stops,
/// and its claims. The announcer decides; the daemon only answers.
pub trait AnnounceView: Sync {
    /// `vip.announce` of the config in force, when it is `routes`.
    fn settings(&self) -> Option<AnnounceSettings>;
    /// Every VIP of the config in force that `settings` allows: whether
    /// one of its listeners is bound with an eligible backend, and the
    /// rise delay its health checks ask for (zero without checks).
    fn serving(&self, settings: &AnnounceSettings) -> BTreeMap<IpAddr, (bool, Duration)>;
    /// Whether the daemon is stopping.
    fn stopping(&self) -> bool;
    /// The daemon's claims on host objects (the announce table's).
    fn claims(&self) -> &crate::host::owned::Claims;
    /// The announcer the daemon holds (its task reaches it through the
    /// daemon, which it holds weakly).
    fn announcer(&self) -> &Announcer;
}

impl Announcer {
    /// Announces nothing yet; counts in `metrics`.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            wake: Arc::default(),
            started: AtomicBool::new(false),
            adopt: AtomicBool::new(false),
            marks: std::sync::Mutex::default(),
            status: std::sync::Mutex::default(),
            inner: tokio::sync::Mutex::default(),
        }
    }

    /// Wakes the announcing task, and spawns it on the first call (the
    /// first apply): every apply calls it, so that a reload is announced at
    /// once. Load balancers wake the task through [`Announcer::notify`]
    /// instead, which never spawns it.
    /// The task holds `view` weakly (the daemon, which holds this
    /// announcer) and ends when it is gone.
    pub(crate) fn start_or_wake<V: AnnounceView + Send + 'static>(&self, view: Weak<V>) {
        self.wake.notify_one();
        if self.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.started.store(false, Ordering::Release);
            return;
        };
        let me = view;
        let wake = Arc::clone(&self.wake);
        runtime.spawn(async move {
            let mut next: Option<Instant> = None;
            loop {
                let poll = Instant::now() + POLL;
                let until = next.map_or(poll, |n| n.min(poll));
                let enabled = {
                    let Some(daemon) = me.upgrade() else { return };
                    AnnounceView::settings(&*daemon).is_some()
                };
                if enabled {
                    tokio::select! {
                        () = wake.notified() => {}
                        () = tokio::time::sleep_until(until) => {}
                    }
                } else {
                    wake.notified().await;
                }
                let Some(daemon) = me.upgrade() else { return };
                let announcer = daemon.announcer();
                let mut inner = announcer.inner.lock().await;
                if inner.stopped {
                    return;
                }
                next = announcer.announce_step(&*daemon, &mut inner).await;
            }
        });
    }

    /// The `Notify` the announcing task waits on, handed to each load
    /// balancer to notify after every publish: a flip may change which
    /// VIPs this host announces. Notifying it wakes a running task and
    /// starts none (that is [`Announcer::start_or_wake`]'s, at apply).
    pub(crate) fn notify(&self) -> Arc<Notify> {
        Arc::clone(&self.wake)
    }

    /// Every VIP of the config in force (`view`'s) with its conditions
    /// (the daemon's facts and the operator's marks) and rise delay.
    fn vip_conditions(
        &self,
        view: &dyn AnnounceView,
        settings: &AnnounceSettings,
    ) -> BTreeMap<IpAddr, VipConditions> {
        let out = view.serving(settings);
        let stopping = view.stopping();
        let marks = self.marks();
        out.into_iter()
            .map(|(vip, (serving, longest))| {
                let conditions = if stopping {
                    Err(Blocker::Stopping)
                } else if marks.host || marks.vips.contains(&vip) {
                    Err(Blocker::Drained)
                } else if !serving {
                    Err(Blocker::NoEligibleBackend)
                } else {
                    Ok(())
                };
                let delay = settings.delay.unwrap_or(if longest.is_zero() {
                    DEFAULT_DELAY_WITHOUT_CHECKS
                } else {
                    longest
                });
                (vip, VipConditions { conditions, delay })
            })
            .collect()
    }

    fn marks(&self) -> std::sync::MutexGuard<'_, Marks> {
        self.marks.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Logs and counts a refused write; `Some(message)` for `/status`.
    fn announce_failed(&self, what: std::fmt::Arguments<'_>, e: &dyn std::fmt::Display) -> String {
        self.metrics.record_vip_announce_error();
        let message = e.to_string();
        tracing::error!("vip.announce: {what}: {message}; retried");
        message
    }

    /// Records a failure of the interface, the local routes or the table in
    /// `error` (`Inner::error`): logged when it differs from the last one,
    /// counted every time (each is retried).
    fn note_error(
        &self,
        error: &mut Option<String>,
        what: std::fmt::Arguments<'_>,
        e: &dyn std::fmt::Display,
    ) {
        if error.as_deref() == Some(e.to_string().as_str()) {
            self.metrics.record_vip_announce_error();
        } else {
            *error = Some(self.announce_failed(what, e));
        }
    }

    /// One pass: settings, interface, local routes, decisions, routes,
    /// status. Returns when it must run again at the latest.
    async fn announce_step(&self, view: &dyn AnnounceView, inner: &mut Inner) -> Option<Instant> {
        let Some(settings) = view.settings() else {
            // Off (or switched off by a reload): take back what is ours.
            if inner.routes.is_some() || inner.local.is_some() {
                self.announce_release(inner).await;
            }
            self.metrics.set_vip_announce(None);
            *self.status.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return None;
        };
        let now = Instant::now();
        if inner.writer.is_none() {
            match RouteWriter::connect() {
                Ok(w) => inner.writer = Some(w),
                Err(e) => {
                    self.note_error(&mut inner.error, format_args!("netlink"), &e);
                    self.announce_publish(inner, &settings, &BTreeMap::new(), now);
                    return Some(now + Duration::from_secs(2));
                }
            }
        }
        let writer = inner.writer.clone().expect("connected above");
        // A new table, or a new interface: start over there, withdrawn.
        let moved = inner.routes.as_ref().map(|r| r.backend().table()) != Some(settings.table)
            || inner.interface.as_ref().map(|(n, _)| n) != Some(&settings.interface);
        if moved
            && !self
                .announce_move(view, inner, &settings, &writer, now)
                .await
        {
            self.announce_publish(inner, &settings, &BTreeMap::new(), now);
            return Some(now + Duration::from_secs(2));
        }
        let (_, index) = inner.interface.clone().expect("set above");
        let wanted = self.vip_conditions(view, &settings);

        // The local routes: every VIP of the file, announced or not; read
        // back and repaired as often as the announce routes, once a second
        // (or at once when the set changed or the last sync failed): an
        // announced VIP without its local route draws traffic the host
        // does not accept, so a route another program deleted must not
        // wait for the 10 s check (42-54 of ~100 new connections timed out
        // in that window).
        let vips: BTreeSet<IpAddr> = wanted.keys().copied().collect();
        let check = inner
            .last_check
            .is_none_or(|t| now.saturating_duration_since(t) >= POLL);
        if check {
            inner.last_check = Some(now);
        }
        if vips != inner.made_local || check || inner.error.is_some() {
            let local = inner.local.get_or_insert_with(|| {
                Driver::new(
                    VipLocalRoutes::new(writer.clone(), index, settings.table),
                    self.metrics.host_repairs(),
                )
            });
            let want: BTreeMap<IpAddr, ()> = vips.iter().map(|v| (*v, ())).collect();
            let out = local.sync(&want).await;
            self.note_local_elsewhere(inner, &out);
            match first_error(&out) {
                Some(e) => self.note_error(
                    &mut inner.error,
                    format_args!("the VIPs' local routes on {:?}", settings.interface),
                    &e,
                ),
                None => {
                    inner.made_local = vips;
                    inner.error = None;
                }
            }
        }

        // Decisions, and the routes to match (read back every step: what
        // `/status` says is the kernel's).
        let next = self
            .announce_route_step(
                RouteStep {
                    vips: &mut inner.vips,
                    routes: inner.routes.as_mut(),
                    error: &mut inner.error,
                },
                &wanted,
                settings.table,
                index,
                now,
            )
            .await;
        self.announce_publish(inner, &settings, &wanted, now);
        next
    }

    /// Warns once about each VIP another program already made local (an
    /// address on the interface, most likely): it is left alone, so the
    /// host accepts the VIP's traffic, but FRR would announce nothing for
    /// it (zebra's connected route beats the imported one).
    fn note_local_elsewhere(&self, inner: &mut Inner, out: &Outcome<VipLocalRoutes>) {
        let now: BTreeSet<IpAddr> = out.foreign.iter().map(|(vip, _)| *vip).collect();
        for (vip, seen) in out
            .foreign
            .iter()
            .filter(|(v, _)| !inner.local_elsewhere.contains(v))
        {
            let len = if vip.is_ipv4() { 32 } else { 128 };
            match seen.protocol {
                // Another daemon's AnyIP route: its metric is its table.
                crate::config::ROUTE_PROTOCOL => tracing::warn!(
                    %vip,
                    protocol = seen.protocol,
                    metric = seen.metric,
                    "vip.announce: {vip} is already local on this host through another harvester-lb's local route (the daemon announcing into table {}, the route's metric); left alone, not removed at stop: that daemon removes it when it stops or its {vip} leaves its file, and this one makes the VIP local itself then",
                    seen.metric
                ),
                // The kernel's own: an address on an interface.
                RTPROT_KERNEL => tracing::warn!(
                    %vip,
                    protocol = seen.protocol,
                    "vip.announce: {vip} is already local on this host because it is an address of an interface (the kernel's route, protocol {}); left alone and not removed at stop. With FRR as the BGP speaker an address hides the announcement: remove it (`ip addr del {vip}/{len} dev <interface>`; `ip -o addr show to {vip}` names it) and the daemon makes the VIP local itself",
                    seen.protocol
                ),
                _ => tracing::warn!(
                    %vip,
                    protocol = seen.protocol,
                    metric = seen.metric,
                    "vip.announce: {vip} is already local on this host through a local route another program wrote (protocol {}, metric {}); left alone and not removed at stop. With FRR as the BGP speaker it may hide the announcement: delete it (`ip route del local {vip}/{len} table local proto {} metric {}`) and the daemon makes the VIP local itself",
                    seen.protocol,
                    seen.metric,
                    seen.protocol,
                    seen.metric
                ),
            }
        }
        inner.local_elsewhere = now;
    }

    /// Takes `settings`' table and interface: our routes leave the old
    /// table (and our local routes the old interface), the stale ones of a
    /// dead predecessor leave the new table, every VIP starts withdrawn.
    /// False (the error noted) when the step must be tried again.
    async fn announce_move(
        &self,
        view: &dyn AnnounceView,
        inner: &mut Inner,
        settings: &AnnounceSettings,
        writer: &RouteWriter,
        now: Instant,
    ) -> bool {
        if let Some(mut old) = inner.routes.take() {
            let out = old.stop().await;
            if let Some(e) = first_error(&out) {
                self.announce_failed(
                    format_args!("deleting the routes of table {}", old.backend().table()),
                    &e,
                );
            }
        }
        inner.interface = None;
        for v in inner.vips.values_mut() {
            v.decision = Hysteresis::new(now);
        }
        // The claim first: with another live daemon in the table, nothing
        // of it is deleted (its routes are its own).
        if inner.claim.as_ref().map(TableClaim::table) != Some(settings.table) {
            inner.claim = None;
            match TableClaim::take(settings.table, &view.claims().identity()).await {
                Ok(c) => inner.claim = Some(c),
                Err(e) => {
                    self.note_error(
                        &mut inner.error,
                        format_args!("table {}", settings.table),
                        &e,
                    );
                    return false;
                }
            }
        }
        // Then the interface: lo or a dummy one, never an uplink.
        let index = match writer.announcing_interface(&settings.interface).await {
            Ok(index) => index,
            Err(e) => {
                self.note_error(
                    &mut inner.error,
                    format_args!("interface {:?}", settings.interface),
                    &e,
                );
                return false;
            }
        };
        // The local routes carry the table as their metric: a new table
        // or interface, new routes.
        if inner
            .local
            .as_ref()
            .is_some_and(|a| a.backend().index() != index || a.backend().table() != settings.table)
            && let Some(mut old) = inner.local.take()
        {
            let out = old.stop().await;
            if let Some(e) = first_error(&out) {
                self.announce_failed(format_args!("removing the VIPs' local routes"), &e);
            }
            inner.made_local.clear();
        }
        let mut routes = Driver::new(
            RouteTable::new(writer.clone(), settings.table),
            self.metrics.host_repairs(),
        );
        // After a hand-over: the previous process's routes to VIPs of the
        // config, out of this interface, stay announced (the next sync
        // adopts them: no delete, no add, no BGP churn); only the others
        // go below.
        if self.adopt.swap(false, Ordering::AcqRel) {
            let wanted = self.vip_conditions(view, settings);
            let mut table = routes.backend().clone();
            match table.read().await {
                Ok(found) => {
                    let kept: Vec<IpAddr> = found
                        .iter()
                        .filter(|(vip, f)| {
                            f.marked && wanted.contains_key(vip) && table.adoptable(&index, &f.seen)
                        })
                        .map(|(vip, _)| *vip)
                        .collect();
                    for vip in &kept {
                        inner.vips.insert(
                            *vip,
                            VipState {
                                decision: Hysteresis::adopted(now),
                                announces: 0,
                                withdrawals: 0,
                                error: None,
                            },
                        );
                    }
                    if !kept.is_empty() {
                        tracing::info!(table = settings.table, vips = ?kept, "vip.announce: the routes the previous process handed over stay announced");
                    }
                    let want: BTreeMap<IpAddr, u32> = kept.iter().map(|v| (*v, index)).collect();
                    let out = routes.sync(&want).await;
                    if let Some(e) = first_error(&out) {
                        self.note_error(
                            &mut inner.error,
                            format_args!("adopting the routes of table {}", settings.table),
                            &e,
                        );
                        return false;
                    }
                    inner.routes = Some(routes);
                    inner.interface = Some((settings.interface.clone(), index));
                    inner.error = None;
                    return true;
                }
                Err(e) => tracing::warn!(
                    table = settings.table,
                    "vip.announce: cannot read the routes the previous process handed over ({e}); every VIP starts withdrawn"
                ),
            }
        }
        // The first sync with nothing wanted deletes a dead predecessor's
        // routes (ours by protocol, in a table this daemon holds).
        let out = routes.sync(&BTreeMap::new()).await;
        if let Some(e) = first_error(&out) {
            self.note_error(
                &mut inner.error,
                format_args!("deleting stale routes of table {}", settings.table),
                &e,
            );
            return false;
        }
        if !out.removed.is_empty() {
            tracing::warn!(
                table = settings.table,
                routes = ?out.removed,
                "vip.announce: deleted routes of protocol {} a previous run left in the table; every VIP starts withdrawn",
                crate::config::ROUTE_PROTOCOL
            );
        }
        inner.routes = Some(routes);
        inner.interface = Some((settings.interface.clone(), index));
        inner.error = None;
        true
    }

    /// The route step: feeds each wanted VIP's conditions to its hysteresis
    /// and makes the table hold the routes of the VIPs it announces (the
    /// driver reads the table back, repairs what another process changed,
    /// writes and deletes the difference). Returns when a decision (or a
    /// failed write's retry) is due at the latest.
    ///
    /// Generic over the table's [`Backend`] so that its decisions
    /// (announce, withdraw, keep, repair) are unit-tested against a table in
    /// memory, as the driver's own branches are; the daemon passes the
    /// [`RouteTable`] of the claimed table.
    async fn announce_route_step<R: AnnounceRoutes>(
        &self,
        step: RouteStep<'_, R>,
        wanted: &BTreeMap<IpAddr, VipConditions>,
        table: u32,
        index: u32,
        now: Instant,
    ) -> Option<Instant> {
        let RouteStep {
            vips,
            routes,
            error,
        } = step;
        let mut next: Option<Instant> = None;
        let retry = now + Duration::from_secs(2);
        // VIPs that left the file: forgotten (their routes go below).
        vips.retain(|vip, _| wanted.contains_key(vip));
        let mut routes_wanted = BTreeMap::new();
        let mut transitions = BTreeMap::new();
        for (vip, w) in wanted {
            let state = vips.entry(*vip).or_insert_with(|| VipState {
                decision: Hysteresis::new(now),
                announces: 0,
                withdrawals: 0,
                error: None,
            });
            transitions.insert(*vip, state.decision.observe(now, w.conditions, w.delay));
            if let Some(d) = state.decision.deadline(w.delay) {
                next = Some(next.map_or(d, |n| n.min(d)));
            }
            if state.decision.announced() {
                routes_wanted.insert(*vip, index);
            }
        }
        let Some(routes) = routes else {
            return Some(retry);
        };
        let out = routes.sync(&routes_wanted).await;
        if !out.repaired.is_empty() {
            self.metrics.record_vip_announce_repair();
        }
        if let Some(e) = &out.unread {
            // Believed no longer: nothing is shown announced that was not
            // read back (written again once the table reads).
            self.note_error(error, format_args!("reading table {table}"), e);
            return Some(retry);
        }
        let repaired: BTreeSet<IpAddr> = out.repaired.iter().map(|(v, _)| *v).collect();
        for vip in &out.written {
            let Some(state) = vips.get_mut(vip) else {
                continue;
            };
            state.error = None;
            if repaired.contains(vip) {
                continue;
            }
            state.announces += 1;
            tracing::info!(
                %vip,
                table = table,
                transitions = state.decision.transitions(),
                "vip.announce: announced (its conditions held for {:?})",
                state.decision.rise_delay(wanted[vip].delay)
            );
        }
        for vip in &out.removed {
            let Some(state) = vips.get_mut(vip) else {
                if !repaired.contains(vip) {
                    tracing::info!(%vip, "vip.announce: withdrawn: the VIP left the config");
                }
                continue;
            };
            state.error = None;
            state.withdrawals += 1;
            let reason = match transitions.get(vip) {
                Some(Some(Transition::Withdraw(b))) => Reason::from(*b).as_str(),
                _ => state.decision.reason().map_or("?", Reason::as_str),
            };
            tracing::warn!(
                %vip,
                table = table,
                reason,
                damping = state.decision.damp_level(),
                "vip.announce: withdrawn"
            );
        }
        for (vip, seen) in &out.foreign {
            let e = AnnounceError::Foreign {
                vip: *vip,
                table,
                protocol: seen.protocol,
            };
            self.vip_failed(vips, *vip, "announcing", &e);
            next = Some(next.map_or(retry, |n| n.min(retry)));
        }
        for (vip, failure) in &out.failed {
            let what = if routes_wanted.contains_key(vip) {
                "announcing"
            } else {
                "withdrawing"
            };
            self.vip_failed(vips, *vip, what, failure);
            next = Some(next.map_or(retry, |n| n.min(retry)));
        }
        next
    }

    /// Records a failed write of `vip`'s route for its `/status`: logged
    /// when the message changes, counted every time (each is retried).
    fn vip_failed(
        &self,
        vips: &mut BTreeMap<IpAddr, VipState>,
        vip: IpAddr,
        what: &str,
        e: &dyn std::fmt::Display,
    ) {
        let Some(state) = vips.get_mut(&vip) else {
            self.announce_failed(format_args!("{what} {vip}"), e);
            return;
        };
        let message = e.to_string();
        if state.error.as_deref() == Some(message.as_str()) {
            self.metrics.record_vip_announce_error();
        } else {
            state.error = Some(self.announce_failed(format_args!("{what} {vip}"), e));
        }
    }

    /// Publishes `/status` and the metrics from `inner`.
    fn announce_publish(
        &self,
        inner: &Inner,
        settings: &AnnounceSettings,
        wanted: &BTreeMap<IpAddr, VipConditions>,
        now: Instant,
    ) {
        let marks = self.marks();
        let mut vips = Vec::new();
        let mut samples = Vec::new();
        for (vip, state) in &inner.vips {
            let announced = inner.routes.as_ref().is_some_and(|r| r.holds(vip));
            let reason = if announced {
                None
            } else {
                Some(state.decision.reason().unwrap_or(Reason::Waiting).as_str())
            };
            let delay = wanted.get(vip).map_or(Duration::ZERO, |w| w.delay);
            vips.push(VipAnnounceStatus {
                vip: *vip,
                announced,
                reason,
                transitions: state.announces + state.withdrawals,
                since: unix_of(state.decision.since().min(now)),
                rise_delay_seconds: state.decision.rise_delay(delay).as_secs_f64(),
                drained: marks.vips.contains(vip),
                error: state.error.clone(),
            });
            samples.push(VipAnnounceSample {
                vip: *vip,
                announced,
                reason,
                announces: state.announces,
                withdrawals: state.withdrawals,
            });
        }
        let doc = AnnounceStatus {
            mode: "routes",
            table: settings.table,
            interface: settings.interface.clone(),
            protocol: crate::config::ROUTE_PROTOCOL,
            host_drained: marks.host,
            error: inner.error.clone(),
            vips,
        };
        drop(marks);
        self.metrics.set_vip_announce(Some(samples));
        *self.status.lock().unwrap_or_else(|p| p.into_inner()) = Some(doc);
    }

    /// Announcing switched off: our announce and local routes go, and the
    /// table's claim with them.
    async fn announce_release(&self, inner: &mut Inner) {
        if let Some(mut routes) = inner.routes.take() {
            let out = routes.stop().await;
            if let Some(e) = first_error(&out) {
                let table = routes.backend().table();
                self.announce_failed(format_args!("deleting the routes of table {table}"), &e);
            }
        }
        if let Some(mut local) = inner.local.take() {
            let out = local.stop().await;
            if let Some(e) = first_error(&out) {
                self.announce_failed(format_args!("removing the VIPs' local routes"), &e);
            }
        }
        inner.claim = None;
        inner.error = None;
        inner.vips.clear();
        inner.made_local.clear();
        inner.interface = None;
        inner.last_check = None;
    }

    /// At stop, before the listeners close: every VIP is withdrawn (the
    /// table's routes of ours deleted) and none is announced again.
    /// Returns the grace to wait for the router to move new flows away:
    /// `None` when announcing is off or no route was in the table (nothing
    /// to move away from), the full grace when routes were deleted or the
    /// table could not be read.
    pub(crate) async fn stop(&self, view: &dyn AnnounceView) -> Option<Duration> {
        let settings = view.settings()?;
        let mut inner = self.inner.lock().await;
        inner.stopped = true;
        let now = Instant::now();
        // Without the table's claim nothing there is ours (another live
        // daemon's routes, or none): nothing to withdraw, no grace.
        let mut wait = false;
        if inner.claim.is_some() {
            let routes = match inner.routes.take() {
                Some(r) => Some(r),
                None => inner
                    .writer
                    .clone()
                    .or_else(|| RouteWriter::connect().ok())
                    .map(|w| {
                        Driver::new(
                            RouteTable::new(w, settings.table),
                            self.metrics.host_repairs(),
                        )
                    }),
            };
            wait = routes.is_none();
            if let Some(mut routes) = routes {
                let out = routes.stop().await;
                if let Some(e) = first_error(&out) {
                    wait = true;
                    self.announce_failed(format_args!("withdrawing every VIP at stop"), &e);
                }
                if out.removed.is_empty() && !wait {
                    tracing::info!(
                        table = settings.table,
                        "stopping: no VIP was announced; no grace"
                    );
                } else if !out.removed.is_empty() {
                    wait = true;
                    for vip in &out.removed {
                        if let Some(state) = inner.vips.get_mut(vip) {
                            state.withdrawals += 1;
                        }
                    }
                    tracing::info!(
                        table = settings.table,
                        vips = ?out.removed,
                        grace = ?settings.withdraw_grace,
                        "stopping: every VIP withdrawn; listeners keep accepting for the grace, then drain"
                    );
                }
            }
        }
        for state in inner.vips.values_mut() {
            state
                .decision
                .observe(now, Err(Blocker::Stopping), Duration::ZERO);
        }
        let wanted = BTreeMap::new();
        self.announce_publish(&inner, &settings, &wanted, now);
        wait.then_some(settings.withdraw_grace)
    }

    /// A hand-over (issue 41): the task stops writing, and nothing is
    /// withdrawn or removed: the routes and local routes stay for the next
    /// process.
    pub(crate) async fn leave(&self) {
        self.inner.lock().await.stopped = true;
    }

    /// At a start after a hand-over: the first step adopts the routes left.
    pub(crate) fn adopt(&self) {
        self.adopt.store(true, Ordering::Release);
    }

    /// At stop, after the drain: the VIPs' local routes this daemon made go.
    pub(crate) async fn remove_local_routes(&self) {
        let mut inner = self.inner.lock().await;
        if let Some(mut local) = inner.local.take() {
            let out = local.stop().await;
            if let Some(e) = first_error(&out) {
                self.announce_failed(format_args!("removing the VIPs' local routes at stop"), &e);
            }
        }
    }

    /// `harvester-lb host drain|ready` (`vip` = `None`) and `harvester-lb
    /// vip drain|ready VIP`: the operator's mark, applied at once.
    pub(crate) fn set_state(
        &self,
        view: &dyn AnnounceView,
        vip: Option<IpAddr>,
        drained: bool,
    ) -> Result<AnnounceStateChange, AnnounceStateError> {
        let settings = view.settings().ok_or(AnnounceStateError::Off)?;
        if let Some(vip) = vip {
            let known = self.vip_conditions(view, &settings).contains_key(&vip);
            if !known {
                return Err(AnnounceStateError::UnknownVip(vip));
            }
        }
        let previous = {
            let mut marks = self.marks();
            match vip {
                None => std::mem::replace(&mut marks.host, drained),
                Some(v) if drained => !marks.vips.insert(v),
                Some(v) => marks.vips.remove(&v),
            }
        };
        tracing::info!(
            vip = vip.map(|v| v.to_string()),
            from = mark_name(previous),
            to = mark_name(drained),
            "vip.announce: operator's mark set"
        );
        self.wake.notify_one();
        Ok(AnnounceStateChange {
            previous: mark_name(previous),
            state: mark_name(drained),
        })
    }

    /// `announce` in `/status`; `None` while announcing is off.
    pub(crate) fn status(&self) -> Option<AnnounceStatus> {
        self.status
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl AnnounceStatus {
    /// The part of it about `vip`, for its load balancers in `/status`.
    pub fn for_vip(&self, vip: IpAddr) -> Option<LbAnnounceStatus> {
        self.vips
            .iter()
            .find(|v| v.vip == vip)
            .map(|v| LbAnnounceStatus {
                announced: v.announced,
                reason: v.reason,
                transitions: v.transitions,
                since: v.since,
            })
    }
}

/// The first thing that went wrong in a sync, in words for the operator.
fn first_error<B: Backend>(out: &Outcome<B>) -> Option<String> {
    out.unread
        .as_ref()
        .map(ToString::to_string)
        .or_else(|| out.failed.first().map(|(k, f)| format!("{k}: {f}")))
}

#[cfg(test)]
mod tests;

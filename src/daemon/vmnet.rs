//! VIPs on VM networks (`[[network]]`, `[keepalived]`): the task that
//! renders keepalived's file and has keepalived reload it, and owns the
//! networks' routes and `from VIP` rules (`host::vmnet::network`) through
//! [`crate::host::owned::Driver`], and the reply marks of kernel listeners on
//! those networks (`host::vmnet::replymark`, kind `reply_mark`) the same way.
//!
//! It also owns the VM-network guard table (`host::vmnet::vmnet_filter`), written
//! first at every step; a failure is logged at error, counted
//! (`vm_network_guard_failures_total`) and makes the isolated networks'
//! VIPs not ready; the table is left at stop.
//!
//! It wakes at every apply (start, reload, lease) and every
//! [`crate::host::owned::CHECK_INTERVAL`]: a failed write or reload of
//! keepalived's file is retried then (logged at error each time, counted
//! in `keepalived_reload_failures_total`), and the routes and rules are read
//! back and repaired (`host_repairs_total{kind="network_route"}`). A
//! reload that removes `[keepalived]` releases the file this process last
//! wrote (`keepalived::release`: no instance left, keepalived reloads and
//! gives up the VIPs), unless someone else's file has replaced it. At stop
//! the routes and rules go after the drain (the open connections' replies
//! use them); keepalived's file is left: `/readyz?vip=` turns 503 at stop,
//! so keepalived moves the VIPs away by itself.

use std::collections::{BTreeMap, BTreeSet};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

use super::Daemon;
use crate::config::Config;
use crate::host::announce::routes::RouteWriter;
use crate::host::owned::{CHECK_INTERVAL, Driver, Object};
use crate::host::vmnet::keepalived::{self, Installed};
use crate::host::vmnet::leg::{LegStatus, NetworkLegs};
use crate::host::vmnet::mgmt_leg::{MgmtLeg, MgmtLegStatus};
use crate::host::vmnet::network::{NetKey, NetworkRoutes, wanted};
use crate::host::vmnet::replymark::{MarkKey, MarkWant, ReplyMarkStatus, ReplyMarks};
use crate::host::vmnet::vmnet_filter::{Rules, VmNetworkGuard};

/// The key of the management VIPs' leg among the networks' legs while
/// they are made: `[` is in no network's name.
const MGMT_LEG: &str = "[keepalived]";

/// The task's state, shared with the daemon.
#[derive(Default)]
pub(super) struct VmNet {
    /// The VM-network guard table (`[[network]] isolate`); readiness asks it.
    pub(super) guard: Arc<VmNetworkGuard>,
    /// The reply marks as last read back, for `/status`.
    pub(super) reply_marks: std::sync::Mutex<ReplyMarkStatus>,
    /// Each network's leg as last read back, by the network's name (only
    /// networks that need one: `host::vmnet::leg`), for `/status` and for the
    /// kernel listeners, which go into the kernel on a bridged network
    /// only while its leg is in place.
    pub(super) legs: std::sync::Mutex<BTreeMap<String, LegStatus>>,
    /// Bumped whenever a network's leg comes into place or leaves it: the
    /// kernel listeners' desired state is rebuilt whole then.
    pub(super) legs_generation: std::sync::atomic::AtomicU64,
    /// The management VIPs' leg and its table (`host::vmnet::mgmt_leg`) as last
    /// read back, while some management VIP needs it: for `/status` and
    /// for the kernel listeners, which go into the kernel only while it is
    /// in place.
    pub(super) mgmt_leg: std::sync::Mutex<Option<Arc<MgmtLegStatus>>>,
    /// Set once the legs were read back (or found not needed).
    legs_read: AtomicBool,
    /// Set once the management VIPs' leg was read back (or found not
    /// needed) by this process.
    mgmt_leg_read: AtomicBool,
    /// Set once [`Daemon::mgmt_leg`] guessed, before the first read-back.
    mgmt_leg_guessed: AtomicBool,
    /// A hash of the main table's IPv4 routes out of the management VIPs'
    /// bridge at the last look ([`Daemon::mgmt_routes_changed`]).
    mgmt_main_routes: std::sync::atomic::AtomicU64,
    /// What the management check pings, as seen at the last apply with
    /// `[keepalived]` (`host::vmnet::mgmt_check::discover`), for `/status`.
    pub(super) mgmt_check: std::sync::Mutex<Option<crate::host::vmnet::mgmt_check::Discovered>>,
    /// Woken at every apply.
    wake: Arc<Notify>,
    /// Set once the task runs.
    started: AtomicBool,
    inner: tokio::sync::Mutex<Inner>,
}

#[derive(Default)]
struct Inner {
    /// The networks' routes and rules, once a network is configured.
    routes: Option<Driver<NetworkRoutes>>,
    /// The bridged networks' legs (`host::vmnet::leg`), once one is needed.
    legs: Option<Driver<NetworkLegs>>,
    /// The marks that route kernel listeners' replies by their network
    /// (`host::vmnet::replymark`), once a kernel listener is on a network.
    marks: Option<Driver<ReplyMarks>>,
    /// The last write or reload of keepalived failed: tell it again.
    reload_failed: bool,
    /// The `[keepalived]` whose file this process last wrote: when the
    /// section is removed, that file is released (`keepalived::release`).
    rendered: Option<crate::config::KeepalivedSettings>,
    /// Set at stop: nothing is written any more.
    stopped: bool,
}

impl Daemon {
    /// Wakes the VM-network task (starting it on first use, when a
    /// runtime runs).
    pub(super) fn vmnet_wake(&self) {
        self.vmnet.wake.notify_one();
        if self.vmnet.started.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.vmnet.started.store(false, Ordering::Release);
            return;
        };
        let me = self.me.clone();
        let wake = Arc::clone(&self.vmnet.wake);
        runtime.spawn(async move {
            loop {
                tokio::select! {
                    () = wake.notified() => {}
                    () = tokio::time::sleep(CHECK_INTERVAL) => {}
                }
                let Some(daemon) = me.upgrade() else { return };
                let mut inner = daemon.vmnet.inner.lock().await;
                if inner.stopped {
                    return;
                }
                let config = daemon
                    .lock()
                    .config
                    .as_ref()
                    .filter(|c| {
                        c.keepalived.is_some() || !c.networks.is_empty() || c.conntrackd.is_some()
                    })
                    .cloned();
                let config = match config {
                    Some(c) => Some(c),
                    // Nothing configured: only what is still held goes.
                    None if inner.routes.is_some()
                        || inner.rendered.is_some()
                        || daemon.vmnet.guard.status().enabled =>
                    {
                        daemon.lock().config.clone()
                    }
                    None => None,
                };
                if let Some(config) = &config {
                    daemon.vmnet_step(&mut inner, config).await;
                }
                // Claims on what is removed by now go (`host::owned::claim`).
                let needed = config.as_ref().map(crate::host::owned::claim::needed);
                daemon
                    .claims
                    .release_unneeded(&needed.unwrap_or_default())
                    .await;
            }
        });
    }

    async fn vmnet_step(&self, inner: &mut Inner, config: &Config) {
        self.vmnet_guard(config).await;
        let job = match (&config.keepalived, keepalived::render(config)) {
            (Some(settings), Some(text)) => {
                inner.rendered = Some(settings.clone());
                Some((settings.clone(), Some(text)))
            }
            // `[keepalived]` removed: its last file is released.
            _ => inner.rendered.clone().map(|old| (old, None)),
        };
        if let Some((settings, text)) = job {
            let force = inner.reload_failed;
            let path = settings.config_path.display().to_string();
            let releasing = text.is_none();
            let handoff = crate::host::vmnet::handoff::dir();
            let result = tokio::task::spawn_blocking(move || match (handoff, text) {
                // Under the shipped unit (the vrrp.conf drop-in): root
                // installs it (`host::vmnet::handoff`); the daemon writes its copy.
                (Some(dir), text) => {
                    let text = text.unwrap_or_else(|| keepalived::render_released(&settings));
                    crate::host::vmnet::handoff::hand_off(
                        &dir,
                        crate::host::vmnet::handoff::KEEPALIVED_FILE,
                        &text,
                    )
                    .map(|written| {
                        if written {
                            Installed::HandedOff
                        } else {
                            Installed::Unchanged
                        }
                    })
                    .map_err(|source| keepalived::KeepalivedError::Write {
                        path: dir
                            .join(crate::host::vmnet::handoff::KEEPALIVED_FILE)
                            .display()
                            .to_string(),
                        source,
                    })
                }
                (None, Some(text)) => keepalived::install(&settings, &text, force),
                (None, None) => keepalived::release(&settings, force),
            })
            .await;
            match result {
                Ok(Ok(Installed::HandedOff)) => {
                    inner.reload_failed = false;
                    if releasing {
                        inner.rendered = None;
                    }
                    tracing::info!(file = %path, "keepalived's configuration handed off for harvester-lb-vrrp.service to install as root (it renders the same from the config file, writes {path} and tells keepalived)");
                }
                Ok(Ok(Installed::Reloaded)) if releasing => {
                    inner.reload_failed = false;
                    inner.rendered = None;
                    tracing::info!(file = %path, "[keepalived] removed: its file now holds no VRRP instance and keepalived was told to reload (it gives up every VIP it moved for this daemon)");
                }
                Ok(Ok(Installed::Reloaded)) => {
                    inner.reload_failed = false;
                    tracing::info!(file = %path, "keepalived configuration written and keepalived told to reload");
                }
                Ok(Ok(Installed::NotOurs)) => {
                    inner.reload_failed = false;
                    inner.rendered = None;
                    tracing::warn!(file = %path, "[keepalived] removed, but the file there is no longer the one this daemon wrote: left alone");
                }
                Ok(Ok(Installed::Unchanged)) => {
                    if releasing {
                        inner.rendered = None;
                    }
                }
                Ok(Err(e)) => {
                    inner.reload_failed = true;
                    self.metrics.record_keepalived_failure();
                    tracing::error!(
                        "{e}; retried in {} s and at every reload",
                        CHECK_INTERVAL.as_secs()
                    );
                }
                Err(e) => {
                    inner.reload_failed = true;
                    self.metrics.record_keepalived_failure();
                    tracing::error!(file = %path, "writing keepalived's configuration stopped: {e}");
                }
            }
        }
        self.mgmt_check_step(config);
        self.vmnet_routes(inner, config).await;
        self.sync.step(config, &self.claims).await;
    }

    /// Sees what the management check pings on this host (the gateway
    /// configured or the default route's), for `/status`; warns once per
    /// change when there is no gateway (the check then always passes:
    /// split brain is not guarded against).
    fn mgmt_check_step(&self, config: &Config) {
        let now = config
            .keepalived
            .as_ref()
            .map(crate::host::vmnet::mgmt_check::discover);
        let mut seen = self
            .vmnet
            .mgmt_check
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let before = seen.as_ref().map(|d| (d.gateway, d.problem.clone()));
        let after = now.as_ref().map(|d| (d.gateway, d.problem.clone()));
        if before != after
            && let Some(d) = &now
        {
            match (&d.problem, d.gateway) {
                (Some(problem), _) => tracing::warn!("keepalived management check: {problem}"),
                (None, Some(gw)) => tracing::info!(
                    gateway = %gw,
                    source = d.gateway_source,
                    "keepalived management check: a host goes to FAULT when neither this gateway nor any peer answers on keepalived.interface"
                ),
                (None, None) => {}
            }
        }
        *seen = now;
    }

    /// Writes, reads back and repairs the VM-network guard table (before
    /// keepalived is told of new VIPs: a VIP on an isolated network is not
    /// ready until its guard is in force).
    async fn vmnet_guard(&self, config: &Config) {
        // The legs this config asks for (a bridged network with a kernel
        // listener), named before they are made.
        let mut links = BTreeMap::new();
        for net in &config.networks {
            links.insert(net.interface.clone(), 0);
        }
        let legs = crate::host::vmnet::leg::wanted(
            config,
            &links,
            crate::host::vmnet::leg::bridge_stage_on,
        )
        .into_keys()
        .collect();
        let rules = Rules::with_legs(config, &legs);
        // Only with the table's claim: another daemon's table is never
        // replaced, nor deleted as a predecessor's leftover.
        if let Err(e) = self.claims.hold(Object::VmNetworkGuard).await {
            if !rules.is_empty() {
                tracing::error!("VM networks: {e}");
            }
            return;
        }
        let guard = Arc::clone(&self.vmnet.guard);
        let metrics = Arc::clone(&self.metrics);
        match tokio::task::spawn_blocking(move || guard.reconcile(rules, &metrics)).await {
            Ok(Ok(())) => {}
            // vm_network_guard_up is 0, the failure counted, /status says
            // why and the isolated networks' VIPs are not ready.
            Ok(Err(e)) => tracing::error!(
                "VM networks: {e}; retried in {} s and at every reload",
                CHECK_INTERVAL.as_secs()
            ),
            Err(e) => {
                self.metrics.record_vm_network_guard_failure();
                tracing::error!("VM networks: writing the guard table stopped: {e}");
            }
        }
    }

    /// Reads back and writes the networks' routes and rules.
    async fn vmnet_routes(&self, inner: &mut Inner, config: &Config) {
        let mgmt = crate::host::vmnet::mgmt_leg::on_this_host(config);
        let used = config.load_balancers.iter().any(|lb| lb.network.is_some()) || mgmt.is_some();
        // Something still held (a leg whose route failed, say) is removed
        // by the steps below once the config no longer asks for it.
        let held = inner
            .routes
            .as_ref()
            .is_some_and(|d| d.held().next().is_some())
            || inner
                .legs
                .as_ref()
                .is_some_and(|d| d.held().next().is_some())
            || inner
                .marks
                .as_ref()
                .is_some_and(|d| d.held().next().is_some());
        if !used && !held {
            return;
        }
        if inner.routes.is_none() {
            match RouteWriter::connect() {
                Ok(w) => {
                    inner.routes = Some(Driver::new(
                        NetworkRoutes::new(w),
                        self.metrics.host_repairs(),
                    ))
                }
                Err(e) => {
                    tracing::error!(
                        "VM networks: {e}; their routes and rules are not written (retried in {} s)",
                        CHECK_INTERVAL.as_secs()
                    );
                    return;
                }
            }
        }
        let Some(driver) = inner.routes.as_mut() else {
            return;
        };
        if let Err(e) = self.claims.hold(Object::NetworkRoutes).await {
            tracing::error!("VM networks: {e}");
            return;
        }
        let mut index_of = BTreeMap::new();
        for net in &config.networks {
            match driver
                .backend()
                .writer()
                .interface_index(&net.interface)
                .await
            {
                Ok(i) => {
                    index_of.insert(net.interface.clone(), i);
                }
                Err(e) => tracing::debug!(network = %net.name, "{e}"),
            }
        }
        let mut tables: BTreeSet<u32> = config.networks.iter().map(|n| n.table).collect();
        tables.extend(config.keepalived.as_ref().map(|k| k.management_table));
        tables.extend(driver.held().filter_map(|k| match k {
            NetKey::Route { table, .. } => Some(*table),
            NetKey::Rule { .. } => None,
        }));
        driver.backend().set_tables(tables);
        let writer = driver.backend().writer().clone();
        let bridge = match &mgmt {
            Some(m) => match writer.interface_index(&m.interface).await {
                Ok(i) => Some(i),
                Err(e) => {
                    tracing::debug!("the management VIPs' leg: {e}");
                    None
                }
            },
            None => None,
        };
        let mgmt_leg = mgmt
            .as_ref()
            .zip(bridge)
            .map(|(m, parent)| (m.key(), crate::host::vmnet::leg::LegWant { parent }));
        let (legs, mgmt_seen) = self
            .vmnet_legs(&mut inner.legs, &writer, config, &index_of, mgmt_leg)
            .await;
        let Some(driver) = inner.routes.as_mut() else {
            return;
        };
        let mut want = wanted(config, &index_of, &legs);
        // The management VIPs' table: the main table's routes out of the
        // bridge, moved onto the leg, once it is in place.
        let mut mgmt_routes = BTreeMap::new();
        let mut mgmt_error = None;
        if let (Some(m), Some(bridge), Some(leg)) =
            (&mgmt, bridge, mgmt_seen.as_ref().and_then(|s| s.1))
        {
            match crate::host::vmnet::mgmt_leg::main_routes(writer.handle(), bridge).await {
                Ok(main) => {
                    // Only the families of the VIPs it routes: a route of
                    // the other family refused would hold them all back.
                    let main: Vec<_> = main
                        .into_iter()
                        .filter(|r| {
                            m.vips
                                .iter()
                                .any(|v| v.is_ipv6() == r.dest.addr().is_ipv6())
                        })
                        .collect();
                    mgmt_routes = crate::host::vmnet::mgmt_leg::table_routes(m.table, leg, &main);
                    if mgmt_routes.is_empty() {
                        mgmt_error = Some(format!(
                            "the main table has no route out of {:?} to copy into table {}",
                            m.interface, m.table
                        ));
                    }
                }
                Err(e) => mgmt_error = Some(e.to_string()),
            }
            want.extend(mgmt_routes.clone());
        }
        let mut out = driver.sync(&want).await;
        // A gateway route refused because its subnet's route (written
        // after it, in key order) was not there yet: once more at once.
        if !out.written.is_empty()
            && out
                .failed
                .iter()
                .any(|(k, _)| matches!(k, NetKey::Route { .. }))
        {
            out = driver.sync(&want).await;
        }
        if let Some(e) = &out.unread {
            tracing::error!(
                "VM networks: {e}; retried in {} s",
                CHECK_INTERVAL.as_secs()
            );
        }
        for (key, failure) in &out.failed {
            tracing::error!(object = %key, "VM networks: {failure}; retried in {} s", CHECK_INTERVAL.as_secs());
        }
        for (key, seen) in &out.foreign {
            tracing::warn!(object = %key, seen = ?seen, "VM networks: another program holds this {key}; left alone, replies from that VIP may leave by another route");
        }
        let mut marks =
            crate::host::vmnet::replymark::wanted(config, &want, &legs.into_keys().collect());
        let routed = !mgmt_routes.is_empty() && mgmt_routes.keys().all(|k| driver.holds(k));
        if let Some(m) = mgmt.as_ref().filter(|_| routed) {
            m.add_marks(&mut marks);
        }
        let held_routes: Vec<String> = mgmt
            .as_ref()
            .map(|m| {
                driver
                    .held()
                    .filter(|k| matches!(k, NetKey::Route { table, .. } if *table == m.table))
                    .map(ToString::to_string)
                    .collect()
            })
            .unwrap_or_default();
        if mgmt_error.is_none() && !mgmt_routes.is_empty() && !routed {
            mgmt_error = mgmt_routes
                .keys()
                .find_map(|k| out.failure(k).map(|f| format!("{k}: {f}")))
                .or_else(|| out.unread.as_ref().map(ToString::to_string));
        }
        self.vmnet_marks(&mut inner.marks, &writer, &marks).await;
        let status = mgmt.map(|m| {
            self.mgmt_leg_status(m, mgmt_seen, held_routes, mgmt_error, inner.marks.as_ref())
        });
        self.set_mgmt_leg(status);
    }

    /// The management VIPs' leg as read back, from its parts: the leg
    /// (`seen`: its status and index), its table's routes (`routes`, held)
    /// and the marks (`marks`, the driver: the `fwmark` rules and the
    /// table).
    fn mgmt_leg_status(
        &self,
        m: MgmtLeg,
        seen: Option<(LegStatus, Option<u32>)>,
        routes: Vec<String>,
        routes_error: Option<String>,
        marks: Option<&Driver<crate::host::vmnet::replymark::ReplyMarks>>,
    ) -> MgmtLegStatus {
        let mark = crate::host::vmnet::replymark::mark_of(m.table);
        let leg = seen.map(|s| s.0).unwrap_or_else(|| LegStatus {
            name: m.key().name(),
            mac: None,
            state: "missing",
            error: Some(format!("{:?} cannot be read on this host", m.interface)),
        });
        let marked = marks.is_some_and(|d| {
            d.holds(&MarkKey::Table)
                && [false, true].iter().all(|v6| {
                    !m.vips.iter().any(|v| v.is_ipv6() == *v6)
                        || d.holds(&MarkKey::Rule { v6: *v6, mark })
                })
        });
        let error = if !leg.up() {
            Some(format!(
                "the leg {:?}: {}",
                leg.name,
                leg.error.as_deref().unwrap_or("not in place")
            ))
        } else if let Some(e) = routes_error {
            Some(format!("table {}: {e}", m.table))
        } else if !marked {
            Some(format!(
                "the marks (table inet {}, ip rule fwmark {mark:#x}): {}",
                crate::host::vmnet::replymark::TABLE,
                self.vmnet
                    .reply_marks
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .error
                    .clone()
                    .unwrap_or_else(|| "not written yet".into())
            ))
        } else {
            None
        };
        MgmtLegStatus {
            interface: m.interface,
            table: m.table,
            leg,
            routes,
            vips: m.vips,
            in_place: error.is_none(),
            error,
        }
    }

    /// Publishes the management VIPs' leg; its coming into place or
    /// leaving it rebuilds the kernel listeners.
    fn set_mgmt_leg(&self, now: Option<MgmtLegStatus>) {
        let mut held = self
            .vmnet
            .mgmt_leg
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        let now = now.map(Arc::new);
        let key = |s: &Option<Arc<MgmtLegStatus>>| {
            s.as_ref()
                .filter(|s| s.in_place)
                .map(|s| (s.interface.clone(), s.vips.clone()))
        };
        let changed =
            key(&held) != key(&now) || !self.vmnet.mgmt_leg_read.swap(true, Ordering::AcqRel);
        if changed && let Some(s) = &now {
            match &s.error {
                None => tracing::info!(
                    leg = %s.leg.name,
                    table = s.table,
                    "the management VIPs' leg is in place: their kernel listeners' flows are routed out of it (the main table's routes out of {:?}, moved onto it)",
                    s.interface
                ),
                Some(e) => tracing::error!(
                    "the management VIPs' leg is not in place ({e}): their kernel listeners are served by the proxy meanwhile (retried in {} s)",
                    CHECK_INTERVAL.as_secs()
                ),
            }
        }
        *held = now;
        drop(held);
        if changed {
            self.vmnet.legs_generation.fetch_add(1, Ordering::AcqRel);
            self.kernel_wake.notify_one();
        }
    }

    /// Whether the main table's IPv4 routes out of the management VIPs'
    /// bridge changed since the last look (the lines of `/proc/net/route`
    /// of that interface, hashed), while the leg is needed: the kernel
    /// writer asks every 5 s with the sysctls and wakes this task, so the
    /// leg's table follows the main table within about 5 s (and at every
    /// step, every 10 s, anyway).
    pub(super) fn mgmt_routes_changed(&self) -> bool {
        use std::hash::{Hash, Hasher};
        let Some(m) = self.mgmt_leg_seen() else {
            return false;
        };
        let text = std::fs::read_to_string("/proc/net/route").unwrap_or_default();
        let mut h = std::collections::hash_map::DefaultHasher::new();
        for line in text
            .lines()
            .filter(|l| l.split_whitespace().next() == Some(m.interface.as_str()))
        {
            line.hash(&mut h);
        }
        let now = h.finish();
        self.vmnet.mgmt_main_routes.swap(now, Ordering::AcqRel) != now
    }

    /// The management VIPs' leg as last read back, while one is needed.
    pub(super) fn mgmt_leg_seen(&self) -> Option<Arc<MgmtLegStatus>> {
        self.vmnet
            .mgmt_leg
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// [`Self::mgmt_leg_seen`], for the kernel listeners of `config`.
    /// Before the VM-network task's first read of it (a start, a
    /// hand-over), a leg already in the host (a predecessor's, which that
    /// read adopts with its table) counts as in place for the VIPs that
    /// need it: their kernel listeners do not go to the proxy and back.
    pub(super) fn mgmt_leg(&self, config: &Config) -> Option<Arc<MgmtLegStatus>> {
        if self.vmnet.mgmt_leg_read.load(Ordering::Acquire) {
            return self.mgmt_leg_seen();
        }
        let mut held = self
            .vmnet
            .mgmt_leg
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        if self.vmnet.mgmt_leg_guessed.swap(true, Ordering::AcqRel) {
            return held.clone();
        }
        let m = crate::host::vmnet::mgmt_leg::on_this_host(config)?;
        let name = m.key().name();
        let guess = std::path::Path::new("/sys/class/net")
            .join(&name)
            .exists()
            .then(|| {
                Arc::new(MgmtLegStatus {
                    interface: m.interface,
                    table: m.table,
                    leg: LegStatus {
                        name,
                        mac: None,
                        state: "up",
                        error: None,
                    },
                    routes: Vec::new(),
                    vips: m.vips,
                    in_place: true,
                    error: None,
                })
            });
        // Kept (and so is finding none) until the first read-back replaces
        // it: a rebuild asks once per load balancer.
        held.clone_from(&guess);
        guess
    }

    /// Reads back and makes the bridged networks' legs (`host::vmnet::leg`);
    /// publishes their state for `/status` and the kernel listeners (and
    /// wakes the kernel writer when a leg comes or goes). Returns the
    /// index of each leg in place, by network.
    async fn vmnet_legs(
        &self,
        slot: &mut Option<Driver<NetworkLegs>>,
        writer: &RouteWriter,
        config: &Config,
        index_of: &BTreeMap<String, u32>,
        mgmt: Option<(
            crate::host::vmnet::leg::LegKey,
            crate::host::vmnet::leg::LegWant,
        )>,
    ) -> (BTreeMap<String, u32>, Option<(LegStatus, Option<u32>)>) {
        let mut by_network = crate::host::vmnet::leg::wanted(
            config,
            index_of,
            crate::host::vmnet::leg::bridge_stage_on,
        );
        if by_network.is_empty()
            && mgmt.is_none()
            && slot.as_ref().is_none_or(|d| d.held().next().is_none())
        {
            self.set_legs(BTreeMap::new());
            return (BTreeMap::new(), None);
        }
        // The management VIPs' leg (`host::vmnet::mgmt_leg`), under a name no
        // network can have, taken out again below.
        if let Some(m) = mgmt {
            by_network.insert(MGMT_LEG.to_string(), m);
        }
        let driver = slot.get_or_insert_with(|| {
            Driver::new(
                NetworkLegs::new(writer.clone()),
                self.metrics.host_repairs(),
            )
        });
        let want: BTreeMap<_, _> = by_network.values().cloned().collect();
        let out = driver.sync(&want).await;
        let retry = CHECK_INTERVAL.as_secs();
        if let Some(e) = &out.unread {
            tracing::error!("VM networks' legs: {e}; retried in {retry} s");
        }
        for (key, failure) in &out.failed {
            tracing::error!(object = %key, "VM networks' legs: {failure}; that network's kernel listeners are served by the proxy meanwhile (retried in {retry} s)");
        }
        for (key, seen) in &out.foreign {
            tracing::warn!(object = %key, seen = ?seen, "VM networks: another program holds an interface named as this {key} (not a macvlan); left alone, and that network's kernel listeners are served by the proxy");
        }
        for key in &out.written {
            tracing::info!(object = %key, "VM networks: leg made (a macvlan on the network's bridge: its kernel listeners' flows are routed out of it)");
        }
        let mut status = BTreeMap::new();
        let mut indexes = BTreeMap::new();
        for (network, (key, _)) in &by_network {
            let name = key.name();
            let up = driver.holds(key);
            let index = if up {
                writer.interface_index(&name).await.ok()
            } else {
                None
            };
            let error = if let Some(f) = out.failure(key) {
                Some(f.to_string())
            } else if let Some((_, seen)) = out.foreign.iter().find(|(k, _)| k == key) {
                Some(format!(
                    "another program holds an interface named {name:?} that is not this daemon's macvlan ({seen:?})"
                ))
            } else {
                out.unread.as_ref().map(ToString::to_string)
            };
            if let Some(i) = index {
                indexes.insert(network.clone(), i);
            }
            status.insert(
                network.clone(),
                LegStatus {
                    name,
                    mac: driver
                        .backend()
                        .mac(key)
                        .filter(|_| index.is_some())
                        .map(crate::host::vmnet::leg::colons),
                    state: if index.is_some() { "up" } else { "missing" },
                    error: if index.is_some() {
                        None
                    } else {
                        Some(error.unwrap_or_else(|| "not made yet".to_string()))
                    },
                },
            );
        }
        let mgmt = status
            .remove(MGMT_LEG)
            .map(|s| (s, indexes.remove(MGMT_LEG)));
        self.set_legs(status);
        (indexes, mgmt)
    }

    /// Publishes the legs' state; a leg that came into place or left it
    /// rebuilds the kernel listeners.
    fn set_legs(&self, now: BTreeMap<String, LegStatus>) {
        let mut legs = self.vmnet.legs.lock().unwrap_or_else(|p| p.into_inner());
        let up = |m: &BTreeMap<String, LegStatus>| -> Vec<String> {
            m.iter()
                .filter(|(_, l)| l.up())
                .map(|(n, _)| n.clone())
                .collect()
        };
        let changed = up(&legs) != up(&now) || !self.vmnet.legs_read.swap(true, Ordering::AcqRel);
        *legs = now;
        drop(legs);
        if changed {
            self.vmnet.legs_generation.fetch_add(1, Ordering::AcqRel);
            self.kernel_wake.notify_one();
        }
    }

    /// Network `net`'s leg as last read back, if it needs one. Before the
    /// VM-network task's first read (a start, a hand-over), a leg already
    /// in the host (a predecessor's, which that read adopts) counts as in
    /// place: the kernel listeners do not go to the proxy and back.
    pub(super) fn leg(&self, net: &crate::config::NetworkSpec) -> Option<LegStatus> {
        if let Some(l) = self
            .vmnet
            .legs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&net.name)
        {
            return Some(l.clone());
        }
        let name = crate::host::vmnet::leg::name_for(net.table);
        (!self.vmnet.legs_read.load(Ordering::Acquire)
            && std::path::Path::new("/sys/class/net").join(&name).exists())
        .then_some(LegStatus {
            name,
            mac: None,
            state: "up",
            error: None,
        })
    }

    /// Reads back and writes the reply marks of kernel listeners on VM
    /// networks (after the networks' tables they route into).
    async fn vmnet_marks(
        &self,
        slot: &mut Option<Driver<ReplyMarks>>,
        writer: &RouteWriter,
        want: &BTreeMap<MarkKey, MarkWant>,
    ) {
        if want.is_empty() && slot.as_ref().is_none_or(|d| d.held().next().is_none()) {
            return;
        }
        if let Err(e) = self.claims.hold(Object::ReplyMarks).await {
            tracing::error!("VM networks' reply marks: {e}");
            return;
        }
        let driver = slot.get_or_insert_with(|| {
            Driver::new(ReplyMarks::new(writer.clone()), self.metrics.host_repairs())
        });
        let out = driver.sync(want).await;
        let retry = CHECK_INTERVAL.as_secs();
        if let Some(e) = &out.unread {
            tracing::error!("VM networks' reply marks: {e}; retried in {retry} s");
        }
        for (key, failure) in &out.failed {
            tracing::error!(object = %key, "VM networks' reply marks: {failure}; a kernel listener's replies to clients behind the network's gateway follow the host's main table until it is written (retried in {retry} s)");
        }
        for (key, seen) in &out.foreign {
            tracing::warn!(object = %key, seen = ?seen, "VM networks: another program holds a {key} on harvester-lb's mark bits; left alone, and the replies of that network's kernel listeners follow it");
        }
        let error = out.unread.as_ref().map(ToString::to_string).or_else(|| {
            out.failed
                .first()
                .map(|(key, failure)| format!("{key}: {failure}"))
        });
        *self
            .vmnet
            .reply_marks
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = ReplyMarkStatus {
            held: driver.held().map(ToString::to_string).collect(),
            error,
        };
    }

    /// A hand-over (issue 41): the task stops, removing nothing (the
    /// routes, rules, reply marks, guard, keepalived's and conntrackd's
    /// files and the gate stay for the next process).
    pub(crate) async fn vmnet_leave(&self) {
        self.vmnet.inner.lock().await.stopped = true;
    }

    /// At stop, after the drain: removes the networks' routes and rules.
    pub(super) async fn vmnet_stop(&self) {
        let mut inner = self.vmnet.inner.lock().await;
        inner.stopped = true;
        // The marks' rules first: they look up the networks' tables.
        if let Some(mut driver) = inner.marks.take() {
            let out = driver.stop().await;
            for (key, failure) in &out.failed {
                tracing::error!(object = %key, "VM networks' reply marks: cannot remove at stop: {failure}");
            }
        }
        if let Some(mut driver) = inner.routes.take() {
            let out = driver.stop().await;
            for (key, failure) in &out.failed {
                tracing::error!(object = %key, "VM networks: cannot remove at stop: {failure}");
            }
        }
        // The legs last: the routes went out of them.
        if let Some(mut driver) = inner.legs.take() {
            let out = driver.stop().await;
            for (key, failure) in &out.failed {
                tracing::error!(object = %key, "VM networks' legs: cannot remove at stop: {failure}");
            }
        }
    }
}

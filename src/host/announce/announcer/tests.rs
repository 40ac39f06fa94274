use super::*;
use crate::daemon::Daemon;
use crate::daemon::testing::{config, daemon, lb, mark_stopping};
use crate::host::owned::Found;
use crate::host::owned::driver::Listing;
use crate::metrics::HostKind;

/// `[vip]` announcing VIPs of 203.0.113.0/24 (the listeners bind them
/// with `IP_FREEBIND`; nothing is sent to them).
const ROUTES: &str = "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"203.0.113.0/24\"]\n";

/// A health check that fails (nothing listens on the loopback
/// backends' port 1) every `period` seconds, from unhealthy.
fn failing_check(period: u32) -> String {
    format!(
        "initial_state = \"unhealthy\"\n  [load_balancer.health_check]\n  port = 1\n  period_seconds = {period}\n  timeout_seconds = 1\n"
    )
}

/// A daemon with `text` in force whose announcing task never starts:
/// these tests look at its decisions, and must not write a route into
/// the host's tables.
fn announcing(text: &str) -> Arc<Daemon> {
    let d = daemon();
    d.announcer().started.store(true, Ordering::Release);
    d.apply(config(text));
    d
}

/// Each wanted VIP's conditions and rise delay now.
fn wanted(d: &Daemon) -> BTreeMap<IpAddr, (Result<(), Blocker>, Duration)> {
    let settings = AnnounceView::settings(d).expect("announcing is on");
    d.announcer()
        .vip_conditions(d, &settings)
        .into_iter()
        .map(|(vip, w)| (vip, (w.conditions, w.delay)))
        .collect()
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[tokio::test]
async fn a_vip_holds_while_one_of_its_listeners_is_bound_with_an_eligible_backend() {
    let d = announcing(
        &[
            ROUTES,
            &lb(
                "a/served",
                "203.0.113.20",
                &["127.231.20.11"],
                &[18080],
                30080,
                "",
            ),
            &lb(
                "a/checked",
                "203.0.113.21",
                &["127.231.20.12"],
                &[18080],
                30080,
                &failing_check(2),
            ),
            // Two load balancers on one VIP: one serving is enough; the
            // delay is the longest check's.
            &lb(
                "b/down",
                "203.0.113.22",
                &["127.231.20.13"],
                &[18080],
                30080,
                &failing_check(4),
            ),
            &lb(
                "b/up",
                "203.0.113.22",
                &["127.231.20.14"],
                &[18081],
                30080,
                "",
            ),
            // Never announced: a loopback VIP reaches only this host.
            &lb(
                "c/loop",
                "127.231.20.1",
                &["127.231.20.15"],
                &[18080],
                30080,
                "",
            ),
        ]
        .concat(),
    );
    let three = Duration::from_secs(3);
    assert_eq!(
        wanted(&d),
        BTreeMap::from([
            (ip("203.0.113.20"), (Ok(()), three)),
            (
                ip("203.0.113.21"),
                (Err(Blocker::NoEligibleBackend), Duration::from_secs(6))
            ),
            (ip("203.0.113.22"), (Ok(()), Duration::from_secs(12))),
        ])
    );
}

#[tokio::test]
async fn a_vip_whose_listener_cannot_bind_has_no_eligible_backend_and_the_delay_set_wins() {
    let vip: std::net::SocketAddr = "203.0.113.23:18080".parse().unwrap();
    let squatter =
        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).expect("socket");
    squatter.set_freebind_v4(true).expect("IP_FREEBIND");
    squatter
        .bind(&vip.into())
        .expect("the squatter binds first");
    squatter.listen(1).expect("listen");
    let d = announcing(
        &[
            "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"203.0.113.0/24\"]\nannounce_delay_seconds = 7\n",
            &lb("a/held", "203.0.113.23", &["127.231.21.11"], &[18080], 30080, ""),
        ]
        .concat(),
    );
    assert_eq!(
        wanted(&d),
        BTreeMap::from([(
            ip("203.0.113.23"),
            (Err(Blocker::NoEligibleBackend), Duration::from_secs(7))
        )])
    );
    drop(squatter);
    assert_eq!(d.retry_failed_listeners(), 1);
    assert_eq!(wanted(&d)[&ip("203.0.113.23")].0, Ok(()));
}

#[tokio::test]
async fn the_operators_marks_block_their_vips_and_stopping_blocks_every_one() {
    let (a, b) = (ip("203.0.113.24"), ip("203.0.113.25"));
    let d = announcing(
        &[
            ROUTES,
            &lb(
                "a/a",
                "203.0.113.24",
                &["127.231.22.11"],
                &[18080],
                30080,
                "",
            ),
            &lb(
                "a/b",
                "203.0.113.25",
                &["127.231.22.12"],
                &[18080],
                30080,
                "",
            ),
        ]
        .concat(),
    );
    let conditions = |d: &Daemon| -> Vec<Result<(), Blocker>> {
        wanted(d).into_values().map(|(c, _)| c).collect()
    };
    assert_eq!(conditions(&d), [Ok(()), Ok(())]);

    let host = d.set_announce_state(None, true).expect("host drain");
    assert_eq!((host.previous, host.state), ("ready", "drain"));
    assert_eq!(
        conditions(&d),
        [Err(Blocker::Drained), Err(Blocker::Drained)]
    );
    d.set_announce_state(None, false).expect("host ready");

    let one = d.set_announce_state(Some(a), true).expect("vip drain");
    assert_eq!((one.previous, one.state), ("ready", "drain"));
    let again = d
        .set_announce_state(Some(a), true)
        .expect("vip drain again");
    assert_eq!(again.previous, "drain", "said as it was");
    assert_eq!(conditions(&d), [Err(Blocker::Drained), Ok(())]);
    assert_eq!(
        d.set_announce_state(Some(ip("203.0.113.99")), true),
        Err(AnnounceStateError::UnknownVip(ip("203.0.113.99")))
    );

    mark_stopping(&d);
    assert_eq!(
        conditions(&d),
        [Err(Blocker::Stopping), Err(Blocker::Stopping)],
        "stopping is said before a drain"
    );
    assert!(wanted(&d).contains_key(&b));
}

#[tokio::test]
async fn with_announcing_off_no_mark_is_taken_and_no_status_is_shown() {
    let d = announcing(&lb(
        "a/a",
        "203.0.113.26",
        &["127.231.23.11"],
        &[18080],
        30080,
        "",
    ));
    assert_eq!(AnnounceView::settings(&*d), None);
    assert_eq!(
        d.set_announce_state(None, true),
        Err(AnnounceStateError::Off)
    );
    assert_eq!(
        d.set_announce_state(Some(ip("203.0.113.26")), true),
        Err(AnnounceStateError::Off)
    );
    assert!(!d.announcer().marks().host, "the refused mark is not kept");
    assert!(d.announcer().status().is_none());
    assert_eq!(
        d.announcer().stop(&*d).await,
        None,
        "nothing to withdraw, no grace"
    );
}

/// The announce table in memory, shared with the test that reads and
/// changes it as another process would; a read can be made to fail.
#[derive(Clone, Default)]
struct MemoryTable {
    routes: Arc<std::sync::Mutex<Listing<MemoryTable>>>,
    /// Every write and removal, in order.
    ops: Arc<std::sync::Mutex<Vec<String>>>,
    unreadable: Arc<AtomicBool>,
}

impl MemoryTable {
    fn routes(&self) -> std::sync::MutexGuard<'_, Listing<MemoryTable>> {
        self.routes.lock().unwrap()
    }

    fn ops(&self) -> Vec<String> {
        std::mem::take(&mut *self.ops.lock().unwrap())
    }
}

impl Backend for MemoryTable {
    const KIND: HostKind = RouteTable::KIND;
    const STOP: StopPhase = RouteTable::STOP;
    const REMOVES_STRAYS: bool = RouteTable::REMOVES_STRAYS;
    type Key = IpAddr;
    type Want = u32;
    type Seen = SeenRoute;
    type Error = String;

    async fn read(&mut self) -> Result<Listing<MemoryTable>, String> {
        if self.unreadable.load(Ordering::Acquire) {
            return Err("cannot dump table 1000".into());
        }
        Ok(self.routes().clone())
    }

    async fn write(&mut self, vip: &IpAddr, interface: &u32) -> Result<(), String> {
        self.ops.lock().unwrap().push(format!("announce {vip}"));
        self.routes().insert(*vip, our_route(*interface));
        Ok(())
    }

    async fn remove(&mut self, vip: &IpAddr) -> Result<(), String> {
        self.ops.lock().unwrap().push(format!("withdraw {vip}"));
        self.routes().remove(vip);
        Ok(())
    }
}

/// The route step's table and interface.
const TABLE: u32 = 1000;
const LO: u32 = 1;

fn our_route(interface: u32) -> Found<SeenRoute> {
    Found {
        seen: SeenRoute {
            interface: Some(interface),
            protocol: crate::config::ROUTE_PROTOCOL,
            metric: 0,
        },
        marked: true,
    }
}

/// The route step's state between steps, over a [`MemoryTable`].
struct Stepper {
    daemon: Arc<Daemon>,
    table: MemoryTable,
    routes: Driver<MemoryTable>,
    vips: BTreeMap<IpAddr, VipState>,
    error: Option<String>,
}

impl Stepper {
    fn new() -> Self {
        let table = MemoryTable::default();
        Self {
            daemon: daemon(),
            routes: Driver::new(table.clone(), Arc::default()),
            table,
            vips: BTreeMap::new(),
            error: None,
        }
    }

    /// One route step at `now` with each VIP's conditions (rise delay
    /// 3 s); returns when the next is due.
    async fn step(
        &mut self,
        now: Instant,
        conditions: &[(IpAddr, Result<(), Blocker>)],
    ) -> Option<Instant> {
        let wanted = conditions
            .iter()
            .map(|(vip, c)| {
                let delay = Duration::from_secs(3);
                (
                    *vip,
                    VipConditions {
                        conditions: *c,
                        delay,
                    },
                )
            })
            .collect();
        let step = RouteStep {
            vips: &mut self.vips,
            routes: Some(&mut self.routes),
            error: &mut self.error,
        };
        self.daemon
            .announcer()
            .announce_route_step(step, &wanted, TABLE, LO, now)
            .await
    }

    /// A stepper whose table holds `vips`' routes, announced over the
    /// rise delay from `t0` (its ops taken).
    async fn announced(t0: Instant, vips: &[IpAddr]) -> Self {
        let mut s = Self::new();
        let holding: Vec<_> = vips.iter().map(|v| (*v, Ok(()))).collect();
        s.step(t0, &holding).await;
        s.step(t0 + Duration::from_secs(3), &holding).await;
        assert_eq!(s.table.routes().len(), vips.len());
        s.table.ops();
        s
    }

    /// `vip`'s announces and withdrawals so far.
    fn counts(&self, vip: IpAddr) -> (u64, u64) {
        let state = &self.vips[&vip];
        (state.announces, state.withdrawals)
    }
}

#[tokio::test(start_paused = true)]
async fn the_route_step_announces_after_the_rise_delay_and_then_writes_nothing() {
    let vip = ip("203.0.113.30");
    let mut s = Stepper::new();
    let t0 = Instant::now();
    let next = s.step(t0, &[(vip, Ok(()))]).await;
    assert_eq!(
        next,
        Some(t0 + Duration::from_secs(3)),
        "due when the delay ends"
    );
    assert!(s.table.routes().is_empty(), "not before the rise delay");
    assert!(!s.routes.holds(&vip));

    s.step(t0 + Duration::from_secs(3), &[(vip, Ok(()))]).await;
    assert_eq!(s.table.ops(), [format!("announce {vip}")]);
    assert_eq!(s.table.routes().get(&vip), Some(&our_route(LO)));
    assert!(s.routes.holds(&vip), "read back: shown announced");
    assert_eq!(s.counts(vip), (1, 0));

    // Kept: the conditions still hold, the kernel has the route.
    let next = s.step(t0 + Duration::from_secs(4), &[(vip, Ok(()))]).await;
    assert_eq!(next, None, "nothing is due");
    assert!(s.table.ops().is_empty(), "nothing written again");
    assert!(s.routes.holds(&vip));
    assert_eq!(s.counts(vip), (1, 0));
    assert_eq!(s.daemon.metrics().announce_repairs.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn the_route_step_withdraws_at_once_when_the_conditions_fail_or_the_vip_leaves() {
    let (a, b) = (ip("203.0.113.31"), ip("203.0.113.32"));
    let t0 = Instant::now();
    let mut s = Stepper::announced(t0, &[a, b]).await;

    let t1 = t0 + Duration::from_secs(4);
    s.step(t1, &[(a, Err(Blocker::NoEligibleBackend)), (b, Ok(()))])
        .await;
    assert_eq!(s.table.ops(), [format!("withdraw {a}")]);
    assert!(!s.routes.holds(&a) && s.routes.holds(&b));
    assert_eq!(s.counts(a), (1, 1));
    assert_eq!(s.counts(b), (1, 0));

    // b leaves the config: its route goes and it is forgotten.
    s.step(t1, &[(a, Err(Blocker::NoEligibleBackend))]).await;
    assert_eq!(s.table.ops(), [format!("withdraw {b}")]);
    assert!(s.table.routes().is_empty());
    assert!(!s.vips.contains_key(&b));
}

#[tokio::test(start_paused = true)]
async fn the_route_step_repairs_a_route_another_process_changed_without_counting_an_announce() {
    let (a, b) = (ip("203.0.113.33"), ip("203.0.113.34"));
    let t0 = Instant::now();
    let mut s = Stepper::announced(t0, &[a, b]).await;
    let both = [(a, Ok(())), (b, Ok(()))];

    // Another process deletes a's route and points b's elsewhere.
    s.table.routes().remove(&a);
    s.table.routes().insert(b, our_route(7));
    s.step(t0 + Duration::from_secs(4), &both).await;
    assert_eq!(
        s.table.ops(),
        [format!("announce {a}"), format!("announce {b}")]
    );
    assert_eq!(s.table.routes().get(&a), Some(&our_route(LO)));
    assert_eq!(s.table.routes().get(&b), Some(&our_route(LO)));
    assert!(s.routes.holds(&a) && s.routes.holds(&b));
    assert_eq!(s.counts(a), (1, 0), "a repair is no announce");
    assert_eq!(s.counts(b), (1, 0), "a repair is no announce");
    assert_eq!(
        s.daemon.metrics().announce_repairs.get(),
        1,
        "one step repaired"
    );

    // A table that cannot be read: nothing shown announced, the error
    // kept for /status, a retry due; read again, all in place.
    s.table.unreadable.store(true, Ordering::Release);
    let t1 = t0 + Duration::from_secs(5);
    assert_eq!(s.step(t1, &both).await, Some(t1 + Duration::from_secs(2)));
    assert!(!s.routes.holds(&a) && !s.routes.holds(&b));
    assert_eq!(s.error.as_deref(), Some("cannot dump table 1000"));
    s.table.unreadable.store(false, Ordering::Release);
    s.step(t1, &both).await;
    assert!(s.routes.holds(&a) && s.routes.holds(&b));
    assert!(s.table.ops().is_empty(), "in place: nothing written");
}

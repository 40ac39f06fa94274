//! Failover across hosts with keepalived: two load-balancer hosts, each
//! with the real daemon and a real keepalived, the same nodes behind them,
//! and a client making new connections all the while.
//!
//! Host A is VRRP master of VIP1, host B of VIP2 (active/active); each
//! daemon serves both VIPs all the time (it binds with `IP_FREEBIND`, so
//! the backup is warm). Each test breaks host A one way and measures how
//! long new connections to VIP1 fail, and checks that a connection through
//! VIP2, on host B, is untouched.

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::netns::keepalived::{Keepalived, keepalived_missing};
use crate::netns::peers::{Exchange, Node, Service, exchange, read_line};
use crate::netns::{Bed, DaemonProc, Ns, config, lb, sa, wait_for};
use crate::require_netns;

const VIP1: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 12);
const VIP2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 13);
const HOST_A: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 4);
const HOST_B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 5);

/// keepalived in one namespace with the shipped example's shape, this
/// host's priorities and `advert` (see [`keepalived_conf`]).
fn start_keepalived(
    bed: &Bed,
    ns: &Ns,
    name: &str,
    priorities: (u8, u8),
    advert: &str,
) -> Keepalived {
    // The daemon of this host (see `Pair::new`) answers on this socket.
    let socket = bed.dir.join(format!("admin-{name}.sock"));
    let conf = bed.write(
        &format!("keepalived-{name}.conf"),
        &keepalived_conf(name, priorities, advert, &socket),
    );
    Keepalived::run(ns, &bed.dir, name, &conf, None)
}

/// The shipped example's shape (`config/keepalived/keepalived.conf`), with
/// this host's priorities and advertisement interval (sub-second ones need
/// VRRP version 3): each instance tracks its own copy of the shipped
/// script, asking this host's daemon over its admin socket (`socket`)
/// about that instance's VIP alone.
fn keepalived_conf(
    name: &str,
    (vip1_priority, vip2_priority): (u8, u8),
    advert: &str,
    socket: &std::path::Path,
) -> String {
    let version = if advert.contains('.') {
        "  vrrp_version 3\n"
    } else {
        ""
    };
    let instance = |n: u8, vip: Ipv4Addr, priority: u8| {
        format!(
            "{}\nvrrp_instance VIP{n} {{\n  state BACKUP\n  interface eth0\n  virtual_router_id {}\n  priority {priority}\n  advert_int {advert}\n  virtual_ipaddress {{\n    {vip}/32 dev eth0\n  }}\n  track_script {{\n    harvester_lb_ready_vip{n}\n  }}\n}}\n",
            shipped_readyz_script(&format!("harvester_lb_ready_vip{n}"), vip, socket),
            50 + n
        )
    };
    format!(
        "global_defs {{\n  router_id {name}\n  enable_script_security\n  script_user root\n{version}}}\n{}{}",
        instance(1, VIP1, vip1_priority),
        instance(2, VIP2, vip2_priority)
    )
}

/// The shipped example's `vrrp_script` block, verbatim but for its name,
/// its VIP and the admin socket's path: what the tests measure is what
/// operators install.
fn shipped_readyz_script(name: &str, vip: Ipv4Addr, socket: &std::path::Path) -> String {
    const SHIPPED_NAME: &str = "harvester_lb_ready_192_168_0_201";
    const SHIPPED_VIP: &str = "vip=192.168.0.201";
    const SHIPPED_SOCKET: &str = "/run/harvester-lb/admin.sock";
    let example = std::fs::read_to_string(EXAMPLE).expect("the shipped keepalived example");
    let start = example
        .find(&format!("vrrp_script {SHIPPED_NAME} {{"))
        .expect("the example has the per-VIP readyz script");
    let end = start
        + example[start..]
            .find("\n}\n")
            .expect("the script block ends")
        + 3;
    let block = &example[start..end];
    assert!(
        block.contains(SHIPPED_VIP) && block.contains(SHIPPED_SOCKET),
        "the shipped script asks the admin socket about its VIP: {block}"
    );
    block
        .replace(SHIPPED_NAME, name)
        .replace(SHIPPED_VIP, &format!("vip={vip}"))
        .replace(SHIPPED_SOCKET, socket.to_str().expect("a UTF-8 path"))
}

const EXAMPLE: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/config/keepalived/keepalived.conf"
);

#[test]
fn the_shipped_keepalived_example_passes_keepalived_s_config_test() {
    if keepalived_missing() {
        return;
    }
    let out = Command::new("keepalived")
        .args(["--config-test", "--use-file", EXAMPLE])
        .output()
        .expect("run keepalived --config-test");
    assert!(
        out.status.success() && out.stderr.is_empty() && out.stdout.is_empty(),
        "keepalived rejects {EXAMPLE}: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Whether `ns` holds `vip` on its eth0.
fn holds(ns: &Ns, vip: Ipv4Addr) -> bool {
    Command::new("ip")
        .args(["-n", &ns.name, "-4", "-o", "addr", "show", "dev", "eth0"])
        .output()
        .is_ok_and(|o| String::from_utf8_lossy(&o.stdout).contains(&format!("{vip}/32")))
}

/// Two load-balancer hosts, each with a daemon (serving VIP1 and VIP2) and
/// keepalived (A master of VIP1, B of VIP2), two nodes behind them.
struct Pair {
    bed: Bed,
    a: Ns,
    a_port: String,
    b: Ns,
    daemon_a: Option<DaemonProc>,
    _daemon_b: DaemonProc,
    keepalived_a: Option<Keepalived>,
    keepalived_b: Keepalived,
    _nodes: Vec<Node>,
    advert: &'static str,
    /// A socket on VIP2:80 inside host A that keeps host A's daemon from
    /// binding VIP2's listener, when the test asked for one.
    squatter: Option<std::net::TcpListener>,
}

impl Pair {
    /// Host A master of VIP1 and backup of VIP2, host B the other way round.
    async fn new(test: &str, advert: &'static str) -> Pair {
        Self::build(test, advert, ((150, 100), (100, 150)), false).await
    }

    /// Two hosts with the VRRP priorities `(host A's, host B's)`, each a
    /// pair `(VIP1, VIP2)`; with `squat`, VIP2:80 is taken on host A before
    /// its daemon starts. Returns once VIP1 is on host A alone and VIP2 on
    /// host B alone, both serving.
    async fn build(
        test: &str,
        advert: &'static str,
        (priorities_a, priorities_b): ((u8, u8), (u8, u8)),
        squat: bool,
    ) -> Pair {
        let mut bed = Bed::new(test, 2);
        let nodes = vec![
            Node::start(&bed, 1, Service::NameThenEcho),
            Node::start(&bed, 2, Service::NameThenEcho),
        ];
        let (a, a_port) = bed.add_host("a", HOST_A);
        let (b, _) = bed.add_host("b", HOST_B);
        let daemon = |bed: &Bed, ns: &Ns, name: &str| {
            let socket = bed.dir.join(format!("admin-{name}.sock"));
            let text = config()
                .socket(&socket)
                .lb(lb("default/vip1", VIP1, &[1, 2]))
                .lb(lb("default/vip2", VIP2, &[1, 2]))
                .to_string();
            let path = bed.write(&format!("config-{name}.toml"), &text);
            DaemonProc::spawn(ns, &path, &bed.dir.join(format!("daemon-{name}.log")), None)
        };
        let squatter = squat.then(|| {
            crate::netns::in_ns(&a.name, || {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
                s.set_freebind_v4(true)?;
                s.bind(&sa(VIP2, 80).into())?;
                s.listen(16)?;
                Ok::<_, std::io::Error>(std::net::TcpListener::from(s))
            })
            .expect("hold VIP2:80 on host A")
        });
        let daemon_a = daemon(&bed, &a, "a");
        let daemon_b = daemon(&bed, &b, "b");
        for d in [&daemon_a, &daemon_b] {
            // VIP1's readiness: host A's VIP2 may be held on purpose.
            wait_for(Duration::from_secs(10), "daemon ready", || async {
                matches!(d.get(&format!("/readyz?vip={VIP1}")).await, Ok((200, _))).then_some(())
            })
            .await;
        }
        let keepalived_a = start_keepalived(&bed, &a, "a", priorities_a, advert);
        let keepalived_b = start_keepalived(&bed, &b, "b", priorities_b, advert);
        let pair = Pair {
            bed,
            a,
            a_port,
            b,
            daemon_a: Some(daemon_a),
            _daemon_b: daemon_b,
            keepalived_a: Some(keepalived_a),
            keepalived_b,
            _nodes: nodes,
            advert,
            squatter,
        };
        // VRRP settles: each VIP on its master only, and both serve.
        wait_for(Duration::from_secs(30), "VRRP masters elected", || async {
            (holds(&pair.a, VIP1)
                && !holds(&pair.b, VIP1)
                && holds(&pair.b, VIP2)
                && !holds(&pair.a, VIP2))
            .then_some(())
        })
        .await;
        for vip in [VIP1, VIP2] {
            wait_for(Duration::from_secs(20), "the VIP serves", || async {
                let e = exchange(&pair.bed.client, sa(vip, 80), 64, Duration::from_secs(2)).await;
                matches!(e, Exchange::Ok(_)).then_some(())
            })
            .await;
        }
        pair
    }

    fn logs(&self) -> String {
        format!(
            "--- keepalived a ---\n{}\n--- keepalived b ---\n{}",
            self.keepalived_a
                .as_ref()
                .map(Keepalived::log)
                .unwrap_or_default(),
            self.keepalived_b.log()
        )
    }
}

/// Each exchange of the watcher: when it started, and whether it was served.
type Seen = Arc<std::sync::Mutex<Vec<(Instant, bool)>>>;

/// New connections to `vip` every 50 ms until stopped (or 60 s), recorded
/// in `seen` as they end.
fn watch(
    client: Ns,
    vip: SocketAddr,
    stop: Arc<AtomicBool>,
    seen: Seen,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        let mut tick = tokio::time::interval(Duration::from_millis(50));
        let end = Instant::now() + Duration::from_secs(60);
        while !stop.load(Ordering::Relaxed) && Instant::now() < end {
            tick.tick().await;
            let t = Instant::now();
            let e = exchange(&client, vip, 64, Duration::from_millis(700)).await;
            seen.lock().unwrap().push((t, matches!(e, Exchange::Ok(_))));
        }
    })
}

/// Waits until the watcher has seen `n` served exchanges that started after `since`.
async fn served_since(seen: &Seen, since: Instant, n: usize, what: &str) {
    wait_for(Duration::from_secs(20), what, || async {
        let count = seen
            .lock()
            .unwrap()
            .iter()
            .filter(|(t, ok)| *t >= since && *ok)
            .count();
        (count >= n).then_some(())
    })
    .await;
}

/// A connection through VIP2 (host B) opened before the fault.
async fn long_connection(bed: &Bed) -> tokio::net::TcpStream {
    let mut s = bed
        .client
        .connect(sa(VIP2, 80), Duration::from_secs(5))
        .await
        .expect("connect through VIP2");
    let name = read_line(&mut s).await.expect("node name");
    assert!(name.starts_with('n'), "{name}");
    s
}

async fn still_echoes(s: &mut tokio::net::TcpStream) -> bool {
    let f = async {
        s.write_all(b"still there?").await?;
        let mut buf = [0u8; 12];
        s.read_exact(&mut buf).await?;
        Ok::<_, std::io::Error>(&buf == b"still there?")
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(5), f).await,
        Ok(Ok(true))
    )
}

/// Breaks host A with `fault` while a client connects to VIP1 every 50 ms;
/// prints how long new connections failed and how many.
async fn failover(pair: &mut Pair, what: &str, fault: impl FnOnce(&mut Pair)) {
    let mut long = long_connection(&pair.bed).await;
    let stop = Arc::new(AtomicBool::new(false));
    let seen: Seen = Arc::default();
    let started = Instant::now();
    let watcher = watch(
        pair.bed.client.clone(),
        sa(VIP1, 80),
        Arc::clone(&stop),
        Arc::clone(&seen),
    );
    served_since(&seen, started, 5, "VIP1 served before the fault").await;
    let at = Instant::now();
    fault(pair);
    wait_for(Duration::from_secs(20), "VIP1 moved to host B", || async {
        holds(&pair.b, VIP1).then_some(())
    })
    .await;
    // Served again for a while after the move.
    let served_again = wait_for(
        Duration::from_secs(20),
        "VIP1 serves from host B",
        || async {
            let e = exchange(&pair.bed.client, sa(VIP1, 80), 64, Duration::from_secs(2)).await;
            matches!(e, Exchange::Ok(_)).then_some(Instant::now())
        },
    )
    .await;
    // The watcher itself sees the service back, several times over.
    served_since(&seen, served_again, 5, "the watcher served after the move").await;
    stop.store(true, Ordering::Relaxed);
    watcher.await.expect("watcher");
    let seen = std::mem::take(&mut *seen.lock().unwrap());
    let after: Vec<&(Instant, bool)> = seen.iter().filter(|(t, _)| *t >= at).collect();
    let failed = after.iter().filter(|(_, ok)| !ok).count();
    let last_failure = after.iter().filter(|(_, ok)| !ok).map(|(t, _)| *t).max();
    let outage = match last_failure {
        None => Duration::ZERO,
        Some(last) => after
            .iter()
            .find(|(t, ok)| *ok && *t > last)
            .map_or(served_again - at, |(t, _)| *t - at),
    };
    assert!(
        seen.iter().filter(|(t, ok)| *t < at && *ok).count() >= 5,
        "VIP1 served before the fault: {seen:?}\n{}",
        pair.logs()
    );
    assert!(
        still_echoes(&mut long).await,
        "the connection through VIP2 on host B was disturbed by {what}"
    );
    eprintln!(
        "FIGURE failover {what}: new connections to the VIP failed for {:.2} s, {failed} of {} failed (advert_int {}, client every 50 ms)",
        outage.as_secs_f64(),
        after.len(),
        pair.advert
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_keepalived_failover_when_the_daemon_dies() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut pair = Pair::new("fodaemon", "1").await;
    failover(&mut pair, "daemon killed (SIGKILL)", |p| {
        if let Some(d) = p.daemon_a.take() {
            d.signal(libc::SIGKILL);
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_keepalived_failover_when_the_host_link_is_cut() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut pair = Pair::new("folink", "1").await;
    failover(&mut pair, "host link cut", |p| {
        p.bed.set_port(&p.a_port, false)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_keepalived_failover_when_keepalived_stops() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut pair = Pair::new("fokeep", "1").await;
    failover(&mut pair, "keepalived stopped (SIGTERM)", |p| {
        if let Some(k) = p.keepalived_a.take() {
            drop(k); // SIGTERM: it gives VIP1 up with a priority-0 advert.
        }
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_keepalived_failover_when_the_host_link_is_cut_with_half_second_adverts() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut pair = Pair::new("folink5", "0.5").await;
    failover(&mut pair, "host link cut", |p| {
        p.bed.set_port(&p.a_port, false)
    })
    .await;
}

/// Host A is the preferred master of both VIPs, but VIP2's listener cannot
/// bind there (a socket holds VIP2:80). Each VRRP instance asks about its
/// own VIP (the shipped example's `/readyz?vip=`), so VIP2 alone goes to
/// host B while VIP1 stays on host A; with the host-wide `/readyz`, both
/// left host A. Once the port is free, the daemon binds it on its retry
/// and VIP2 comes back to host A.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_keepalived_moves_only_the_vip_whose_listener_cannot_bind() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    // `build` returns once VIP1 is on A alone and VIP2 on B alone.
    let mut pair = Pair::build("fopervip", "1", ((150, 150), (100, 100)), true).await;
    let daemon_a = pair.daemon_a.as_ref().expect("host A's daemon");
    let (code, body) = daemon_a.get("/readyz").await.expect("host A's /readyz");
    assert_eq!(code, 503, "host-wide, host A is not ready: {body}");
    let (code, body) = daemon_a
        .get(&format!("/readyz?vip={VIP2}"))
        .await
        .expect("host A's /readyz?vip=VIP2");
    assert!(
        code == 503 && body.contains(&format!("{VIP2}:80")),
        "{code} {body}"
    );

    drop(pair.squatter.take());
    wait_for(
        Duration::from_secs(30),
        "VIP2 back on host A once its listener is bound",
        || async { (holds(&pair.a, VIP2) && !holds(&pair.b, VIP2)).then_some(()) },
    )
    .await;
    assert!(
        holds(&pair.a, VIP1) && !holds(&pair.b, VIP1),
        "VIP1 stayed on host A\n{}",
        pair.logs()
    );
    wait_for(
        Duration::from_secs(20),
        "VIP2 serves from host A",
        || async {
            let e = exchange(&pair.bed.client, sa(VIP2, 80), 64, Duration::from_secs(2)).await;
            matches!(e, Exchange::Ok(_)).then_some(())
        },
    )
    .await;
}

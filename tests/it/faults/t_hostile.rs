//! Hostile and slow clients, and descriptor exhaustion.

use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::netns::peers::{Exchange, Node, Service, exchange, read_line};
use crate::netns::{Bed, VIP, config, node_ip, probed, sa, wait_for};
use crate::require_netns;
use crate::support::Lb;
use crate::support::outcomes;
use harvester_lb::metrics::names;

const HEALTH: &str =
    "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 1\n  failure_threshold = 3";

/// Connects `n` clients at once; returns the connected streams.
async fn connect_many(bed: &Bed, n: usize) -> Vec<TcpStream> {
    let sockets = bed.client.sockets(n).expect("client sockets");
    let mut set = tokio::task::JoinSet::new();
    for (k, s) in sockets.into_iter().enumerate() {
        set.spawn(async move {
            let r = tokio::time::timeout(Duration::from_secs(20), s.connect(sa(VIP, 80))).await;
            (k, r)
        });
    }
    let mut out = Vec::with_capacity(n);
    while let Some(r) = set.join_next().await {
        let (k, r) = r.unwrap();
        match r {
            Ok(Ok(s)) => out.push((k, s)),
            Ok(Err(e)) => panic!("client {k} could not connect: {e}"),
            Err(_) => panic!("client {k} connect timed out"),
        }
    }
    out.sort_by_key(|(k, _)| *k);
    out.into_iter().map(|(_, s)| s).collect()
}

/// Sum of active connections over the backends of `lbn` in `/status`.
async fn active(bed: &Bed, lbn: &str) -> u64 {
    let st = bed.daemon().status().await;
    st["load_balancers"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|l| l["name"] == lbn)
        .flat_map(|l| l["backends"].as_array().unwrap().iter())
        .map(|b| b["active_connections"].as_u64().unwrap_or(0))
        .sum()
}

async fn wait_active(bed: &Bed, lbn: &str, want: u64, timeout: Duration) -> Duration {
    let t = Instant::now();
    loop {
        let a = active(bed, lbn).await;
        if a == want {
            return t.elapsed();
        }
        assert!(
            t.elapsed() < timeout,
            "{a} connections active after {timeout:?}, want {want}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Fault 7: the daemon runs with 200 descriptors (soft and hard) and
/// `max_connections = 1000`, and 120 clients arrive: more than it can hold
/// (about 90). A client accepted when no descriptor is left for its backend
/// socket waits for one, up to `connect_timeout_ms` (10 s here).
///
/// Asserts: it does not crash; while out of descriptors it backs off rather
/// than spin (CPU use and accept-error rate bounded); connections it holds
/// keep moving data; the backends are not marked down for the daemon's own
/// shortage; and as soon as descriptors free up the waiting clients are served.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_descriptor_exhaustion_backs_off_and_resumes() {
    require_netns!();
    let mut bed = Bed::new("fd", 2);
    let _nodes: Vec<Node> = (1..=2)
        .map(|i| Node::start(&bed, i, Service::NameThenEcho))
        .collect();
    let cfg = config()
        .drain_timeout(1)
        .proxy("max_connections = 1000")
        .lb(probed("f7/fds", VIP, &[1, 2], HEALTH).keys("connect_timeout_ms = 10000"))
        .to_string();
    bed.start_daemon_with(&cfg, Some(200)).await;
    let base_fds = bed.daemon().open_fds();
    let clients = connect_many(&bed, 120).await;
    // Which clients get served: read the name line, with a short deadline.
    let mut served = Vec::new();
    let mut waiting = Vec::new();
    let mut set = tokio::task::JoinSet::new();
    for (k, mut s) in clients.into_iter().enumerate() {
        set.spawn(async move {
            let r = tokio::time::timeout(Duration::from_secs(2), read_line(&mut s)).await;
            (k, s, r)
        });
    }
    while let Some(r) = set.join_next().await {
        let (_k, s, r) = r.unwrap();
        match r {
            Ok(Ok(_)) => served.push(s),
            Ok(Err(e)) => panic!("a client was closed instead of waiting: {e}"),
            Err(_) => waiting.push(s),
        }
    }
    let pid = bed.daemon().pid();
    assert!(
        !waiting.is_empty(),
        "120 clients fit in 200 descriptors? served {}",
        served.len()
    );
    // Out of descriptors now: measure CPU over 4 s (longer than
    // failure_threshold x period, so a probe failing for want of a descriptor
    // would have marked the nodes down).
    let fds_full = bed.daemon().open_fds();
    let cpu0 = crate::support::proc_cpu_time(pid);
    let t0 = Instant::now();
    // Held connections keep working meanwhile, many at once.
    let mut set = tokio::task::JoinSet::new();
    for (k, mut s) in served.drain(..).enumerate() {
        set.spawn(async move {
            let mut ok = true;
            for r in 0..3 {
                let data = vec![(k + r) as u8; 2048];
                let mut back = vec![0u8; 2048];
                ok &= s.write_all(&data).await.is_ok()
                    && s.read_exact(&mut back).await.is_ok()
                    && back == data;
                tokio::time::sleep(Duration::from_millis(500)).await;
            }
            (s, ok)
        });
    }
    let mut broken = 0;
    while let Some(r) = set.join_next().await {
        let (s, ok) = r.unwrap();
        if !ok {
            broken += 1;
        }
        served.push(s);
    }
    tokio::time::sleep_until((t0 + Duration::from_secs(4)).into()).await;
    let cpu = crate::support::proc_cpu_time(pid) - cpu0;
    let window = t0.elapsed();
    assert!(
        bed.daemon_mut().exited().is_none(),
        "daemon died: {}",
        bed.daemon().log_tail(20)
    );
    // Free descriptors: the clients it held leave.
    let n_served = served.len();
    let n_waiting = waiting.len();
    drop(served);
    let freed = Instant::now();
    let mut set = tokio::task::JoinSet::new();
    for mut s in waiting.drain(..) {
        set.spawn(async move {
            let r = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s)).await;
            (
                r.map_err(|_| "still waiting after 5 s".to_string())
                    .and_then(|r| r.map_err(|e| e.to_string())),
                freed.elapsed(),
            )
        });
    }
    let mut slowest = Duration::ZERO;
    let mut not_served = Vec::new();
    while let Some(r) = set.join_next().await {
        let (r, t) = r.unwrap();
        match r {
            Ok(_) => slowest = slowest.max(t),
            Err(e) => not_served.push(e),
        }
    }
    let m = bed.daemon().metrics().await;
    let emfile = outcomes(&m, &names::ACCEPT_ERRORS, &[("kind", "out_of_descriptors")]);
    let st = bed.daemon().status().await;
    let downs = outcomes(
        &m,
        &names::HEALTH_TRANSITIONS,
        &[("load_balancer", "f7/fds"), ("to", "down")],
    );
    println!(
        "FIGURE fault7 fd exhaustion: limit 200 fds ({base_fds} at start, {fds_full} when full); held {n_served} clients, {n_waiting} waited (in the backlog, or accepted and waiting for a descriptor); {emfile} EMFILE accept errors, daemon CPU {cpu:?} over {window:?}; {broken} held connections broke; waiting clients all served {slowest:?} after descriptors freed ({not_served:?} not served); health transitions to down: {downs}"
    );
    assert!(
        not_served.is_empty(),
        "waiting clients were not served after fds freed: {not_served:?}"
    );
    assert!(
        slowest < Duration::from_secs(1),
        "service resumed only after {slowest:?}"
    );
    // The shortage shows in accept(2) or, when accept got the last
    // descriptor, in the backend socket; either way it is logged.
    // Else the test did not exhaust descriptors.
    bed.daemon().wait_logged("Too many open files").await;
    let max_errors = window.as_secs_f64() / 0.05 * 1.5 + 10.0;
    assert!(
        emfile <= max_errors,
        "{emfile} accept errors in {window:?}: a busy loop"
    );
    assert!(
        cpu < Duration::from_millis(800),
        "daemon used {cpu:?} CPU in {window:?} while out of descriptors"
    );
    assert_eq!(broken, 0, "connections held while out of descriptors broke");
    // An outcome count: 0 is no `to="down"` sample of the lb.
    assert_eq!(
        downs, 0.0,
        "backends marked down for the daemon's own descriptor shortage: {st}"
    );
}

/// Fault 8a: 3000 clients connect and send nothing.
///
/// Asserts: all are accepted and forwarded, a normal client is still served
/// quickly, the daemon's memory grows by a bounded amount per connection, and
/// all are released when the clients go.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_thousands_of_idle_clients() {
    require_netns!();
    let mut bed = Bed::new("id", 2);
    let _nodes: Vec<Node> = (1..=2)
        .map(|i| Node::start(&bed, i, Service::NameThenEcho))
        .collect();
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f8/idle", VIP, &[1, 2], HEALTH))
        .to_string();
    bed.start_daemon(&cfg).await;
    let rss0 = bed.daemon().rss_kib();
    let idle = connect_many(&bed, 3000).await;
    wait_active(&bed, "f8/idle", 3000, Duration::from_secs(30)).await;
    let rss1 = bed.daemon().rss_kib();
    let t = Instant::now();
    let e = exchange(&bed.client, sa(VIP, 80), 4096, Duration::from_secs(5)).await;
    let normal = t.elapsed();
    assert!(matches!(e, Exchange::Ok(_)), "{e:?}");
    drop(idle);
    let released = wait_active(&bed, "f8/idle", 0, Duration::from_secs(10)).await;
    let per_conn = (rss1.saturating_sub(rss0)) as f64 * 1024.0 / 3000.0;
    println!(
        "FIGURE fault8 idle clients: 3000 silent connections: daemon RSS {rss0} KiB -> {rss1} KiB ({per_conn:.0} bytes per connection); a normal client served in {normal:?}; all released {released:?} after the clients left"
    );
    assert!(
        normal < Duration::from_millis(500),
        "normal client took {normal:?}"
    );
    assert!(
        per_conn < 16.0 * 1024.0,
        "{per_conn} bytes of daemon memory per idle connection"
    );
}

/// Fault 8b: 20 clients ask for an endless download and never read.
///
/// Asserts: backpressure reaches the nodes (they stop being able to write
/// within seconds: bytes in flight per connection are bounded by socket
/// buffers), the daemon's memory does not grow with the data, and another
/// client is served normally meanwhile.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_clients_that_never_read_are_bounded() {
    require_netns!();
    let mut bed = Bed::new("nr", 2);
    let n1 = Node::start(&bed, 1, Service::Source);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f8/source", VIP, &[1], HEALTH))
        .lb(probed("f8/echo", crate::netns::VIP2, &[2], HEALTH))
        .to_string();
    bed.start_daemon(&cfg).await;
    let rss0 = bed.daemon().rss_kib();
    let stuck = connect_many(&bed, 20).await;
    // Wait until the writes stall: no progress for 1 s.
    let t = Instant::now();
    let mut last = n1.written.load(Ordering::Relaxed);
    let plateau = loop {
        tokio::time::sleep(Duration::from_millis(1000)).await;
        let now = n1.written.load(Ordering::Relaxed);
        if now == last && now > 0 {
            break now;
        }
        last = now;
        assert!(
            t.elapsed() < Duration::from_secs(20),
            "nodes kept writing for 20 s: {now} bytes"
        );
    };
    let stalled_after = t.elapsed();
    let rss1 = bed.daemon().rss_kib();
    let t2 = Instant::now();
    let e = exchange(
        &bed.client,
        sa(crate::netns::VIP2, 80),
        4096,
        Duration::from_secs(5),
    )
    .await;
    let normal = t2.elapsed();
    let per_conn = plateau as f64 / 20.0 / 1048576.0;
    println!(
        "FIGURE fault8 never-reading clients: 20 clients, nodes stalled after {plateau} bytes ({per_conn:.1} MiB per connection, all in kernel socket buffers) within {stalled_after:?}; daemon RSS {rss0} KiB -> {rss1} KiB; a normal client served in {normal:?}"
    );
    assert!(matches!(e, Exchange::Ok(_)), "{e:?}");
    assert!(
        per_conn < 32.0,
        "{per_conn} MiB in flight per connection: not bounded by socket buffers"
    );
    assert!(
        rss1.saturating_sub(rss0) < 20 * 1024,
        "daemon RSS grew {} KiB while clients did not read",
        rss1 - rss0
    );
    assert!(normal < Duration::from_millis(500));
    drop(stuck);
}

/// Fault 8c: a client resets in the middle of a large upload.
///
/// Asserts: the daemon drops both legs within a second (its active count goes
/// back to the other connection only), and another connection on the same
/// node keeps moving data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_client_reset_mid_stream() {
    require_netns!();
    let mut bed = Bed::new("cr", 1);
    let n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f8/reset", VIP, &[1], HEALTH))
        .to_string();
    bed.start_daemon(&cfg).await;
    let mut other = bed
        .client
        .connect(sa(VIP, 80), Duration::from_secs(5))
        .await
        .unwrap();
    read_line(&mut other).await.unwrap();
    let mut s = bed
        .client
        .connect(sa(VIP, 80), Duration::from_secs(5))
        .await
        .unwrap();
    read_line(&mut s).await.unwrap();
    // Upload 4 MiB without reading the echo: buffers fill both ways.
    let chunk = vec![7u8; 64 * 1024];
    for _ in 0..64 {
        if tokio::time::timeout(Duration::from_millis(200), s.write_all(&chunk))
            .await
            .is_err()
        {
            break; // the pipe is full: mid-stream
        }
    }
    wait_active(&bed, "f8/reset", 2, Duration::from_secs(5)).await;
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    let gone = wait_active(&bed, "f8/reset", 1, Duration::from_secs(5)).await;
    for k in 0..5 {
        let data = vec![k as u8; 1000];
        other.write_all(&data).await.unwrap();
        let mut back = vec![0u8; 1000];
        tokio::time::timeout(Duration::from_secs(5), other.read_exact(&mut back))
            .await
            .expect("other connection stalled")
            .expect("other connection broke");
        assert_eq!(back, data);
    }
    println!(
        "FIGURE fault8 client reset mid-stream: both legs released {gone:?} after the reset; the other connection unaffected"
    );
    assert!(gone < Duration::from_secs(1), "released after {gone:?}");
    assert_eq!(n1.accepted.load(Ordering::Relaxed), 2);
    let _ = node_ip(1);
}

/// Fault 9: 150 backends hang (every probe to them times out) and the
/// daemon has 128 descriptors. Probes in flight are bounded (an eighth of
/// the limit, at least 64), so the hung backends never take the
/// descriptors that clients and the admin API need; each still gets its
/// verdict, only later than with a probe per backend in flight at once.
///
/// Asserts: the daemon's descriptors stay well under its limit throughout;
/// every client exchange through the one live node succeeds; `/status`
/// answers; every hung backend is probed and marked down.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_hung_backends_never_take_the_clients_descriptors() {
    require_netns!();
    const HUNG: u8 = 150;
    let mut bed = Bed::new("probes", 2);
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    // Node 2 answers ARP for 150 more addresses and drops every packet to
    // the health port: 150 backends whose probes hang for the whole timeout.
    let hung: Vec<std::net::Ipv4Addr> = (0..HUNG)
        .map(|k| std::net::Ipv4Addr::new(198, 51, 100, 100 + k))
        .collect();
    let batch: String = hung
        .iter()
        .map(|ip| format!("addr add {ip}/32 dev eth0\n"))
        .collect();
    let batch_file = bed.write("aliases.batch", &batch);
    bed.node(2)
        .ip(&["-batch", batch_file.to_str().expect("utf-8 path")]);
    bed.blackhole(2, &[crate::netns::HEALTH_PORT]);
    let cfg = config()
        .lb(Lb::new("f9/hung", VIP)
            .backends(std::iter::once(node_ip(1)).chain(hung.iter().copied()))
            .keys("initial_state = \"unhealthy\"")
            .tcp("tcp", 80, crate::netns::NODEPORT)
            .health(&format!(
                "  port = {}\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 2",
                crate::netns::HEALTH_PORT
            )))
        .to_string();
    const LIMIT: u64 = 128;
    bed.start_daemon_with(&cfg, Some(LIMIT)).await;
    bed.daemon()
        .wait_health("f9/hung", node_ip(1), "healthy", Duration::from_secs(10))
        .await;

    // Clients meanwhile, and the daemon's descriptors sampled between them.
    let started = Instant::now();
    let mut most_fds = 0;
    let mut failed = Vec::new();
    let mut exchanges = 0;
    while started.elapsed() < Duration::from_secs(4) && exchanges < 400 {
        most_fds = most_fds.max(bed.daemon().open_fds());
        if let Exchange::Failed(e) =
            exchange(&bed.client, sa(VIP, 80), 256, Duration::from_secs(5)).await
        {
            failed.push(e);
        }
        exchanges += 1;
    }
    // Every hung backend gets its verdict.
    let down = wait_for(
        Duration::from_secs(30),
        "every hung backend to be probed and found down",
        || async {
            let st = bed.daemon().status().await;
            let lb = st["load_balancers"]
                .as_array()?
                .iter()
                .find(|l| l["name"] == "f9/hung")?
                .clone();
            let probed_down = lb["backends"]
                .as_array()?
                .iter()
                .filter(|b| {
                    b["health"] == "unhealthy"
                        && b["probe"]["last_result"] == "timeout"
                        && b["probe"]["probes"].as_u64() >= Some(2)
                })
                .count();
            (probed_down >= usize::from(HUNG)).then_some(probed_down)
        },
    )
    .await;
    let timeouts = outcomes(
        &bed.daemon().metrics().await,
        &names::HEALTH_CHECKS,
        &[("load_balancer", "f9/hung"), ("result", "timeout")],
    );
    println!(
        "FIGURE fault9 hung backends: {HUNG} backends whose probes time out, limit {LIMIT} descriptors: at most {most_fds} open; {exchanges} client exchanges, {} failed; {down} hung backends probed and down ({timeouts} probe timeouts counted) {:?} after start",
        failed.len(),
        started.elapsed(),
    );
    assert!(failed.is_empty(), "clients failed: {failed:?}");
    assert!(exchanges >= 10, "only {exchanges} exchanges in 4 s");
    // 64 probes in flight, the listener, the admin API, the runtime and a
    // client: far from 128. A probe per hung backend would need 150.
    assert!(
        most_fds < 110,
        "{most_fds} descriptors open: probes are not bounded"
    );
}

//! Faults the health checker and the connect retry must handle: a node that
//! blackholes, a node that refuses or resets on its nodeport, all nodes down,
//! a flapping node, and a lossy, slow path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::netns::peers::{
    Exchange, Node, Service, Tally, exchange, load, load_with, time_to_refusal,
};
use crate::netns::{
    Bed, HEALTH_PORT, NODEPORT, VIP, VIP2, backend_of, config, metric, metric_sample, node_ip,
    probed, sa,
};
use crate::require_netns;
use crate::support::outcomes;
use harvester_lb::metrics::names;

const HEALTH_1S: &str =
    "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 1\n  failure_threshold = 3";

/// Fault 1: node 2 drops every packet to its health port and nodeport.
///
/// Asserts: detection within failure_threshold x period + timeout (and not
/// before failure_threshold failures could have been seen); with the default
/// retry rule (every eligible backend once) no client connection fails, before
/// or after detection; with `connect_attempts = 1` the failures are exactly
/// the ones the daemon counts, and none once the node is down; once down,
/// no connection is even attempted to the node.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_blackholed_node_is_detected_and_clients_redispatched() {
    require_netns!();
    let mut bed = Bed::new("bh", 3);
    let nodes: Vec<Node> = (1..=3)
        .map(|i| Node::start(&bed, i, Service::NameThenEcho))
        .collect();
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f1/retry", VIP, &[1, 2, 3], HEALTH_1S).keys("connect_timeout_ms = 300"))
        .lb(probed("f1/single", VIP2, &[1, 2, 3], HEALTH_1S)
            .keys("connect_timeout_ms = 300\nconnect_attempts = 1"))
        .to_string();
    bed.start_daemon(&cfg).await;
    let d = bed.daemon();
    let (v1, v2) = (sa(VIP, 80), sa(VIP2, 80));
    for v in [v1, v2] {
        for _ in 0..9 {
            let e = exchange(&bed.client, v, 256, Duration::from_secs(5)).await;
            assert!(matches!(e, Exchange::Ok(_)), "warm-up: {e:?}");
        }
    }
    assert!(
        nodes
            .iter()
            .all(|n| n.accepted.load(Ordering::Relaxed) >= 6)
    );

    // Clients keep coming while the fault starts and is detected.
    let stop = Arc::new(AtomicBool::new(false));
    let during1 = load(&bed.client, v1, 2, 100_000, Arc::clone(&stop));
    let during2 = load(&bed.client, v2, 2, 100_000, Arc::clone(&stop));
    tokio::time::sleep(Duration::from_millis(300)).await; // let the load start: not a sync point
    let t0 = Instant::now();
    bed.blackhole(2, &[HEALTH_PORT, NODEPORT]);
    let mut detected = [None, None];
    while detected.iter().any(Option::is_none) {
        let st = d.status().await;
        for (k, name) in ["f1/retry", "f1/single"].iter().enumerate() {
            if detected[k].is_none() && backend_of(&st, name, node_ip(2))["health"] == "unhealthy" {
                detected[k] = Some(t0.elapsed());
            }
        }
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "node 2 not marked down within 10s: {st}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    stop.store(true, Ordering::Relaxed);
    let t1: Tally = during1.await.unwrap();
    let t2: Tally = during2.await.unwrap();
    let m = d.metrics().await;
    let n2 = node_ip(2).to_string();
    let attempts_to_n2 = |lbn: &str, m: &str| {
        outcomes(
            m,
            &names::BACKEND_CONNECT_FAILURES,
            &[
                ("load_balancer", lbn),
                ("backend", &n2),
                ("reason", "connect_timeout"),
            ],
        )
    };
    let failed_single = outcomes(
        &m,
        &names::CONNECTIONS_FAILED,
        &[("load_balancer", "f1/single")],
    );
    let failed_retry = outcomes(
        &m,
        &names::CONNECTIONS_FAILED,
        &[("load_balancer", "f1/retry")],
    );
    let (timeouts_retry, timeouts_single) = (
        attempts_to_n2("f1/retry", &m),
        attempts_to_n2("f1/single", &m),
    );

    // After detection: nothing goes to node 2 any more, nothing fails.
    let accepted_before: Vec<usize> = nodes
        .iter()
        .map(|n| n.accepted.load(Ordering::Relaxed))
        .collect();
    let mut after = Tally::default();
    for i in 0..120 {
        let v = if i % 2 == 0 { v1 } else { v2 };
        after.add(exchange(&bed.client, v, 256, Duration::from_secs(5)).await);
    }
    let m2 = d.metrics().await;

    let budget = Duration::from_secs(3 + 1); // failure_threshold x period + timeout
    println!(
        "FIGURE fault1 blackhole: detection {:?} (retry lb) and {:?} (single-attempt lb), budget {:?}",
        detected[0].unwrap(),
        detected[1].unwrap(),
        budget
    );
    println!(
        "FIGURE fault1 blackhole: while detecting, retry lb: {} ok / {} failed to connect / {} cut (open on node 2 when the fault began; {} connect attempts to node 2 timed out and were retried); single-attempt lb: {} ok / {} failed to connect / {} cut (daemon counted {}); after detection {} ok / {} failed",
        t1.ok_total(),
        t1.failed_before_a_node().len(),
        t1.cut_on("n2"),
        timeouts_retry,
        t2.ok_total(),
        t2.failed_before_a_node().len(),
        t2.cut_on("n2"),
        failed_single,
        after.ok_total(),
        after.failed.len()
    );
    for (k, det) in detected.iter().enumerate() {
        let det = det.unwrap();
        assert!(
            det <= budget + Duration::from_millis(600),
            "lb {k}: detection {det:?} over failure_threshold x period + timeout"
        );
        assert!(
            det >= Duration::from_millis(2500),
            "lb {k}: down after {det:?}: fewer than failure_threshold failed probes"
        );
    }
    // An exchange already open on node 2 when its packets start to drop is a
    // connection cut mid-transfer (fault 3): no retry can rescue it. At most
    // one per client worker can be in flight; every other client must be
    // served.
    assert!(
        t1.failed_before_a_node().is_empty(),
        "retry rule: no client may fail while the node is detected: {:?}",
        t1.failed
    );
    for (t, lbn) in [(&t1, "retry"), (&t2, "single")] {
        assert!(
            t.cut_on("n2") <= 2
                && t.cut_on("n2") + t.failed_before_a_node().len() == t.failed.len(),
            "{lbn} lb: only exchanges open on node 2 at the fault may be cut: {:?}",
            t.failed
        );
    }
    // An outcome count: 0 is no sample of the family for the retry lb.
    assert_eq!(
        failed_retry, 0.0,
        "the daemon counted failures on the retry lb"
    );
    assert!(
        timeouts_retry >= 1.0,
        "the retry path was not exercised (no timed-out attempt on node 2)"
    );
    assert!(
        !t2.failed_before_a_node().is_empty(),
        "with connect_attempts = 1 some clients must have hit node 2 while undetected"
    );
    // Every failure the daemon counted reached a client as a reset (the
    // suite's own CPU load can add a client-side timeout on top).
    assert!(
        failed_single >= 1.0 && failed_single <= t2.failed.len() as f64,
        "daemon counted {failed_single} failures, clients saw {:?}",
        t2.failed
    );
    assert!(
        t2.failed_before_a_node().len() as f64 <= timeouts_single,
        "each failure is one timed-out attempt on node 2"
    );
    assert!(
        after.failed.is_empty(),
        "after detection: {:?}",
        after.failed
    );
    assert!(
        !after.ok.contains_key("n2"),
        "node 2 served after it was down"
    );
    assert_eq!(
        nodes[1].accepted.load(Ordering::Relaxed),
        accepted_before[1],
        "node 2 got connections after it was down"
    );
    assert_eq!(
        attempts_to_n2("f1/retry", &m2) + attempts_to_n2("f1/single", &m2),
        timeouts_retry + timeouts_single,
        "connect attempts were still made to node 2 after it was down"
    );
}

/// Fault 2: nodes answer their health port but refuse (nothing listening) or
/// reset (nft `reject with tcp reset`) on the nodeport; a third accepts and
/// resets at once.
///
/// Asserts: refused and reset connects are retried on the healthy node, so
/// clients see zero failures; every attempt is counted per backend and reason.
/// A backend that resets *after* accepting cannot be retried (bytes may have
/// reached it): each such client gets a reset, never a hang or a clean EOF
/// that could pass for a complete answer, and the count matches the node's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_refusing_or_resetting_nodeport_is_retried_elsewhere() {
    require_netns!();
    let mut bed = Bed::new("rf", 4);
    let mut n1 = Node::start(&bed, 1, Service::NameThenEcho);
    n1.kill_nodeport(); // health port answers, nodeport refuses
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    bed.reject_with_reset(2, NODEPORT);
    let n3 = Node::start(&bed, 3, Service::ResetOnAccept);
    let n4 = Node::start(&bed, 4, Service::NameThenEcho);
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f2/refuse", VIP, &[1, 2, 4], HEALTH_1S))
        .lb(probed("f2/reset", VIP2, &[3, 4], HEALTH_1S))
        .to_string();
    bed.start_daemon(&cfg).await;
    let d = bed.daemon();
    let stop = Arc::new(AtomicBool::new(false));
    let t = load(&bed.client, sa(VIP, 80), 4, 300, Arc::clone(&stop))
        .await
        .unwrap();
    let t_reset = load(&bed.client, sa(VIP2, 80), 2, 100, stop).await.unwrap();
    let m = d.metrics().await;
    let st = d.status().await;
    let fails = |ip: usize, reason: &str| {
        outcomes(
            &m,
            &names::BACKEND_CONNECT_FAILURES,
            &[
                ("load_balancer", "f2/refuse"),
                ("backend", &node_ip(ip).to_string()),
                ("reason", reason),
            ],
        )
    };
    println!(
        "FIGURE fault2 refuse/reset: {} ok / {} failed client connections through nodes that refuse ({} attempts) or reset the SYN ({} attempts); accept-then-reset node: {} of {} clients reset (node accepted {})",
        t.ok_total(),
        t.failed.len(),
        fails(1, "connect_refused"),
        fails(2, "connect_refused") + fails(2, "connect_error"),
        t_reset.failed.len(),
        t_reset.ok_total() + t_reset.failed.len(),
        n3.accepted.load(Ordering::Relaxed),
    );
    assert!(t.failed.is_empty(), "clients failed: {:?}", t.failed);
    assert_eq!(t.ok_total(), 300);
    assert_eq!(
        t.ok.get("n4"),
        Some(&300),
        "all served by node 4: {:?}",
        t.ok
    );
    assert!(
        fails(1, "connect_refused") >= 50.0,
        "refusals not retried/counted"
    );
    assert!(
        fails(2, "connect_refused") + fails(2, "connect_error") >= 50.0,
        "resets not retried/counted"
    );
    // The health port answers, so the nodes stay "healthy": only the retry saves clients.
    assert_eq!(
        backend_of(&st, "f2/refuse", node_ip(1))["health"],
        "healthy"
    );
    assert_eq!(
        n4.accepted.load(Ordering::Relaxed),
        300 + t_reset.ok_total(),
        "node 4 served exactly the successful clients"
    );
    let n3_accepted = n3.accepted.load(Ordering::Relaxed);
    let m3 = |reason: &str| {
        outcomes(
            &m,
            &names::BACKEND_CONNECT_FAILURES,
            &[
                ("load_balancer", "f2/reset"),
                ("backend", &node_ip(3).to_string()),
                ("reason", reason),
            ],
        )
    };
    let n3_retried = m3("connect_refused") + m3("connect_error") + m3("connect_timeout");
    println!(
        "FIGURE fault2 accept-then-reset: {} reset before the daemon saw the connect complete (retried on node 4), {} after (client reset)",
        n3_retried,
        t_reset.failed.len()
    );
    assert_eq!(t_reset.ok_total() + t_reset.failed.len(), 100);
    assert!(n3_accepted > 0);
    assert_eq!(
        t_reset.failed.len() as f64 + n3_retried,
        n3_accepted as f64,
        "every connection the resetting node took is either retried elsewhere or reset to its client"
    );
    assert_eq!(t_reset.ok.get("n4"), Some(&t_reset.ok_total()));
    for e in &t_reset.failed {
        assert!(
            e.contains("reset") || e.contains("closed before"),
            "a reset node must give the client a reset or an empty close: {e}"
        );
    }
}

/// Fault 6: every node down. Clients are refused at once, the daemon stays
/// ready, /status and metrics say why, and one node coming back restores
/// service within success_threshold periods.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_all_nodes_down_refuses_fast_and_recovers() {
    require_netns!();
    let mut bed = Bed::new("ad", 3);
    let mut nodes: Vec<Node> = (1..=3)
        .map(|i| Node::start(&bed, i, Service::NameThenEcho))
        .collect();
    let h = "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 2\n  failure_threshold = 2";
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f6/all", VIP, &[1, 2, 3], h))
        .to_string();
    bed.start_daemon(&cfg).await;
    let d = bed.daemon();
    let v = sa(VIP, 80);
    assert!(matches!(
        exchange(&bed.client, v, 64, Duration::from_secs(5)).await,
        Exchange::Ok(_)
    ));
    for n in nodes.iter_mut() {
        n.stop_health();
        n.kill_nodeport();
    }
    for i in 1..=3 {
        d.wait_health("f6/all", node_ip(i), "unhealthy", Duration::from_secs(5))
            .await;
    }
    let mut times = Vec::new();
    for _ in 0..50 {
        times.push(
            time_to_refusal(&bed.client, v, Duration::from_secs(2))
                .await
                .expect("refused"),
        );
    }
    times.sort();
    let (median, max) = (times[times.len() / 2], times[times.len() - 1]);
    println!(
        "FIGURE fault6 all down: clients refused in median {median:?}, max {max:?} (50 tries)"
    );
    assert!(
        max < Duration::from_millis(250),
        "refusal must be immediate, took up to {max:?}"
    );
    let (code, body) = d.get("/readyz").await.unwrap();
    assert_eq!(
        (code, body.trim()),
        (200, "ready"),
        "the daemon itself is fine"
    );
    let st = d.status().await;
    assert_eq!(st["load_balancers"][0]["eligible_backends"], 0);
    for i in 1..=3 {
        let b = backend_of(&st, "f6/all", node_ip(i));
        assert_eq!(b["health"], "unhealthy");
        assert_eq!(b["probe"]["last_result"], "refused", "{b}");
        assert!(
            b["probe"]["last_error"]
                .as_str()
                .is_some_and(|e| !e.is_empty())
        );
    }
    let m = d.metrics().await;
    assert_eq!(
        metric(
            &m,
            "harvester_lb_no_eligible_backend",
            &[("load_balancer", "f6/all")]
        ),
        1.0
    );
    assert!(
        metric_sample(
            &m,
            "harvester_lb_connections_failed_total",
            &[("load_balancer", "f6/all"), ("reason", "no_backend")]
        )
        .is_some_and(|v| v >= 50.0)
    );
    assert_eq!(
        metric(
            &m,
            "harvester_lb_backend_up",
            &[("load_balancer", "f6/all")]
        ),
        0.0
    );
    // The log must say why.
    d.wait_logged("no eligible backend").await;

    // One node returns.
    let t0 = Instant::now();
    nodes[1].start_health();
    nodes[1].start_nodeport(Service::NameThenEcho);
    let back = loop {
        if let Exchange::Ok(n) = exchange(&bed.client, v, 64, Duration::from_secs(2)).await {
            assert_eq!(n, "n2");
            break t0.elapsed();
        }
        assert!(
            t0.elapsed() < Duration::from_secs(8),
            "no recovery within 8s"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    println!(
        "FIGURE fault6 all down: service back {back:?} after one node returned (success_threshold 2 x period 1s)"
    );
    assert!(
        back <= Duration::from_millis(3500),
        "recovery took {back:?}, over success_threshold x period + timeout"
    );
    assert!(
        back >= Duration::from_millis(900),
        "came back before 2 successes: {back:?}"
    );
    let m = d.metrics().await;
    assert_eq!(
        metric(
            &m,
            "harvester_lb_no_eligible_backend",
            &[("load_balancer", "f6/all")]
        ),
        0.0
    );
}

/// One probe seen in `/status`.
#[derive(Debug, Clone)]
struct Seen {
    probes: u64,
    result: String,
    status: String,
    successes: u64,
    failures: u64,
}

/// Every probe of some backends, as `/status` showed them, and `/metrics`
/// taken at the first and the last observation.
struct Recording {
    seen: Vec<Vec<Seen>>,
    metrics_first: String,
    metrics_last: String,
}

/// Records every probe of some backends by polling `/status` (every 20 ms,
/// 50 times per period), until `stop`. The first and last observations are
/// taken together with `/metrics`, in a moment with no probe in between, so
/// counters and replay cover exactly the same probes.
fn record_probes(
    d: &crate::netns::DaemonProc,
    targets: Vec<(&'static str, std::net::Ipv4Addr)>,
    stop: Arc<AtomicBool>,
) -> tokio::task::JoinHandle<Recording> {
    let view = DaemonView { ns: d.ns.clone() };
    tokio::spawn(async move {
        let mut seen: Vec<Vec<Seen>> = vec![Vec::new(); targets.len()];
        let observe = |st: &serde_json::Value, seen: &mut Vec<Vec<Seen>>| {
            for (k, (lbn, ip)) in targets.iter().enumerate() {
                let p = &backend_of(st, lbn, *ip)["probe"];
                let s = Seen {
                    probes: p["probes"].as_u64().unwrap_or(0),
                    result: p["last_result"].as_str().unwrap_or("").to_string(),
                    status: p["status"].as_str().unwrap_or("").to_string(),
                    successes: p["consecutive_successes"].as_u64().unwrap_or(0),
                    failures: p["consecutive_failures"].as_u64().unwrap_or(0),
                };
                if seen[k].last().is_none_or(|l| l.probes != s.probes) {
                    seen[k].push(s);
                }
            }
        };
        let (st, metrics_first) = view.consistent().await;
        observe(&st, &mut seen);
        while !stop.load(Ordering::Relaxed) {
            if let Some(st) = view.json("/status").await {
                observe(&st, &mut seen);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        let (st, metrics_last) = view.consistent().await;
        observe(&st, &mut seen);
        Recording {
            seen,
            metrics_first,
            metrics_last,
        }
    })
}

/// A minimal admin client usable from a spawned task.
struct DaemonView {
    ns: crate::netns::Ns,
}

impl DaemonView {
    async fn get(&self, path: &str) -> Option<String> {
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let addr = sa(std::net::Ipv4Addr::LOCALHOST, crate::netns::ADMIN_PORT);
        let mut s = self.ns.connect(addr, Duration::from_secs(2)).await.ok()?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: a\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await
        .ok()?;
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_end(&mut buf))
            .await
            .ok()?
            .ok()?;
        let text = String::from_utf8_lossy(&buf);
        Some(text.split("\r\n\r\n").nth(1)?.to_string())
    }

    async fn json(&self, path: &str) -> Option<serde_json::Value> {
        serde_json::from_str(&self.get(path).await?).ok()
    }

    /// `/status` and `/metrics` with no probe finishing in between (the
    /// total probe count is the same before and after the metrics).
    async fn consistent(&self) -> (serde_json::Value, String) {
        let total = |st: &serde_json::Value| -> u64 {
            st["load_balancers"]
                .as_array()
                .into_iter()
                .flatten()
                .flat_map(|l| l["backends"].as_array().into_iter().flatten())
                .map(|b| b["probe"]["probes"].as_u64().unwrap_or(0))
                .sum()
        };
        for _ in 0..100 {
            let (Some(a), Some(m), Some(b)) = (
                self.json("/status").await,
                self.get("/metrics").await,
                self.json("/status").await,
            ) else {
                continue;
            };
            if total(&a) == total(&b) {
                return (b, m);
            }
        }
        panic!("no quiet moment between probes in 100 tries");
    }
}

/// Replays the recorded results through the threshold rule and checks that
/// every recorded verdict is the one the rule gives. Returns (transitions to
/// down, transitions to up, failed probes, probes checked, gaps).
fn replay(
    seen: &[Seen],
    success_threshold: u64,
    failure_threshold: u64,
) -> (u64, u64, u64, u64, u64) {
    let (mut down, mut up, mut failed, mut checked, mut gaps) = (0, 0, 0, 0, 0);
    for w in seen.windows(2) {
        let (prev, cur) = (&w[0], &w[1]);
        // Results of the probes since `prev`: a timed-out probe is followed at
        // once by the next, so the recorder can see two at a time. The
        // consecutive counters of `cur` say what the last ones were.
        let k = cur.probes.saturating_sub(prev.probes);
        let last_ok = cur.result == "ok";
        let run = if last_ok { cur.successes } else { cur.failures };
        let results: Vec<bool> = if k == 1 {
            vec![last_ok]
        } else if k >= 2 && run + 1 >= k {
            (0..k)
                .map(|j| if j + run >= k { last_ok } else { !last_ok })
                .collect()
        } else {
            gaps += 1; // cannot tell: resynchronise on what /status says
            continue;
        };
        let (mut s, mut f) = (prev.successes, prev.failures);
        let mut status = prev.status.clone();
        for ok in results {
            checked += 1;
            if ok {
                s += 1;
                f = 0;
                if status == "unhealthy" && s >= success_threshold {
                    status = "healthy".into();
                    up += 1;
                }
            } else {
                failed += 1;
                f += 1;
                s = 0;
                if status == "healthy" && f >= failure_threshold {
                    status = "unhealthy".into();
                    down += 1;
                }
            }
        }
        assert_eq!(
            (status.as_str(), s, f),
            (cur.status.as_str(), cur.successes, cur.failures),
            "verdict after probe {} ({}) is not the threshold rule's (from {prev:?})",
            cur.probes,
            cur.result
        );
    }
    (down, up, failed, checked, gaps)
}

fn transitions(m: &str, lbn: &str, ip: std::net::Ipv4Addr) -> (f64, f64) {
    let ip = ip.to_string();
    let t = |to| {
        outcomes(
            m,
            &names::HEALTH_TRANSITIONS,
            &[("load_balancer", lbn), ("backend", &ip), ("to", to)],
        )
    };
    (t("down"), t("up"))
}

/// Fault 5: node 2 flaps: down 3.5 s, up 3.5 s, three times, plus two
/// glitches shorter than a period. Down means its health listener is closed
/// and its nodeport refuses new connections.
///
/// Asserts: every verdict the daemon reached is the one the thresholds give
/// for the probe results it saw (replayed probe by probe); exactly three
/// transitions each way; glitches cause none; each flip is seen within
/// threshold x period; clients never fail (refused nodeport is retried).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_flapping_node_transitions_follow_thresholds_exactly() {
    require_netns!();
    let mut bed = Bed::new("fl", 2);
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let mut n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let h = "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 2\n  failure_threshold = 2";
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f5/flap", VIP, &[1, 2], h))
        .to_string();
    bed.start_daemon(&cfg).await;
    let d = bed.daemon();
    // Start from a settled state: a few probes done.
    wait_probes(d, "f5/flap", 2, 2).await;
    let stop = Arc::new(AtomicBool::new(false));
    let rec = record_probes(d, vec![("f5/flap", node_ip(2))], Arc::clone(&stop));
    let clients = load(&bed.client, sa(VIP, 80), 2, 100_000, Arc::clone(&stop));

    let mut down_times = Vec::new();
    let mut up_times = Vec::new();
    for cycle in 0..3 {
        let t = Instant::now();
        n2.stop_health();
        bed.refuse_new_connections(2, NODEPORT);
        down_times.push(
            d.wait_health("f5/flap", node_ip(2), "unhealthy", Duration::from_secs(5))
                .await,
        );
        sleep_until(t + Duration::from_millis(3500)).await;
        let t = Instant::now();
        n2.start_health();
        bed.heal(2);
        up_times.push(
            d.wait_health("f5/flap", node_ip(2), "healthy", Duration::from_secs(5))
                .await,
        );
        sleep_until(t + Duration::from_millis(3500)).await;
        if cycle < 2 {
            // A glitch: shorter than one period, so at most one probe fails.
            n2.stop_health();
            tokio::time::sleep(Duration::from_millis(400)).await;
            n2.start_health();
            tokio::time::sleep(Duration::from_millis(1600)).await;
        }
    }
    // Two more periods so the last probes are recorded.
    tokio::time::sleep(Duration::from_millis(2100)).await;
    stop.store(true, Ordering::Relaxed);
    let rec = rec.await.unwrap();
    let tally = clients.await.unwrap();
    let before = transitions(&rec.metrics_first, "f5/flap", node_ip(2));
    let after = transitions(&rec.metrics_last, "f5/flap", node_ip(2));
    let (down, up, failed, checked, gaps) = replay(&rec.seen[0], 2, 2);
    println!(
        "FIGURE fault5 flapping: {checked} probes replayed ({failed} failed, {gaps} missed by the recorder): rule gives {down} down / {up} up, daemon counted {} down / {} up; flips seen after {:?} (down) and {:?} (up); clients {} ok / {} failed",
        after.0 - before.0,
        after.1 - before.1,
        down_times,
        up_times,
        tally.ok_total(),
        tally.failed.len()
    );
    assert_eq!((after.0 - before.0, after.1 - before.1), (3.0, 3.0));
    assert_eq!(
        (down, up),
        (3, 3),
        "the replayed rule must give the same transitions"
    );
    assert!(checked >= 20, "too few probes recorded: {checked}");
    assert!(gaps <= 2, "recorder missed {gaps} probes");
    for t in down_times.iter().chain(&up_times) {
        assert!(
            *t <= Duration::from_millis(2400),
            "a flip took {t:?}: over threshold x period"
        );
    }
    assert!(
        tally.failed.is_empty(),
        "clients failed: {:?}",
        tally.failed
    );
}

async fn sleep_until(t: Instant) {
    tokio::time::sleep_until(t.into()).await;
}

/// Waits until every backend of `lbn` has had at least `min` probes.
async fn wait_probes(d: &crate::netns::DaemonProc, lbn: &str, n: usize, min: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let st = d.status().await;
        if (1..=n)
            .all(|i| backend_of(&st, lbn, node_ip(i))["probe"]["probes"].as_u64() >= Some(min))
        {
            return;
        }
        assert!(Instant::now() < deadline, "probes did not run: {st}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A relay in node `i`'s namespace: listens on the node's nodeport and
/// forwards to `127.0.0.1:target` there, holding every chunk for `delay` in
/// each direction (one-way latency; throughput is kept).
fn delaying_relay(
    bed: &Bed,
    i: usize,
    target: u16,
    delay: Duration,
) -> tokio::task::JoinHandle<()> {
    let ns = bed.node(i).clone();
    let l = ns.listen(sa(node_ip(i), NODEPORT));
    tokio::spawn(async move {
        loop {
            let Ok((inbound, _)) = l.accept().await else {
                continue;
            };
            let ns = ns.clone();
            tokio::spawn(async move {
                let Ok(outbound) = ns
                    .connect(
                        sa(std::net::Ipv4Addr::LOCALHOST, target),
                        Duration::from_secs(2),
                    )
                    .await
                else {
                    return;
                };
                let (ir, iw) = inbound.into_split();
                let (or, ow) = outbound.into_split();
                tokio::join!(delayed_pipe(ir, ow, delay), delayed_pipe(or, iw, delay));
            });
        }
    })
}

async fn delayed_pipe(
    mut r: tokio::net::tcp::OwnedReadHalf,
    mut w: tokio::net::tcp::OwnedWriteHalf,
    delay: Duration,
) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let (tx, mut rx) = tokio::sync::mpsc::channel::<(tokio::time::Instant, Vec<u8>)>(64);
    let reader = async move {
        let mut buf = vec![0u8; 16 * 1024];
        loop {
            match r.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    let at = tokio::time::Instant::now() + delay;
                    if tx.send((at, buf[..n].to_vec())).await.is_err() {
                        break;
                    }
                }
            }
        }
    };
    let writer = async move {
        while let Some((at, data)) = rx.recv().await {
            tokio::time::sleep_until(at).await;
            if w.write_all(&data).await.is_err() {
                return;
            }
        }
        tokio::time::sleep(delay).await; // the FIN is delayed too
        let _ = w.shutdown().await;
    };
    tokio::join!(reader, writer);
}

/// Fault 4: 5% packet loss on both nodes (nft, both directions) and 50 ms
/// one-way delay on the nodeport path (a relay).
///
/// Asserts: for both a tolerant (failure_threshold 3) and a twitchy
/// (failure_threshold 1) load balancer, every recorded verdict is the one the
/// thresholds give for the probe results (so any flapping is exactly what the
/// thresholds allow, and the daemon's transition counters agree); the tolerant
/// one flaps no more than the twitchy one; clients see no failure and the
/// delay is really on the path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_lossy_slow_path_probes_follow_thresholds() {
    require_netns!();
    let mut bed = Bed::new("ls", 2);
    // The real service listens on 127.0.0.1:30081 in each node; the relay
    // on the node address adds the delay.
    let mut services = Vec::new();
    let mut relays = Vec::new();
    let mut healths = Vec::new();
    for i in 1..=2 {
        let l = bed
            .node(i)
            .listen(sa(std::net::Ipv4Addr::LOCALHOST, NODEPORT + 1));
        let name = format!("n{i}\n");
        services.push(tokio::spawn(async move {
            loop {
                let Ok((mut s, _)) = l.accept().await else {
                    continue;
                };
                let name = name.clone();
                tokio::spawn(async move {
                    use tokio::io::AsyncWriteExt;
                    let _ = s.write_all(name.as_bytes()).await;
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        }));
        relays.push(delaying_relay(
            &bed,
            i,
            NODEPORT + 1,
            Duration::from_millis(50),
        ));
        let hl = bed.node(i).listen(sa(node_ip(i), HEALTH_PORT));
        healths.push(tokio::spawn(crate::netns::peers::accept_forever(hl)));
    }
    let tolerant = "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 1\n  failure_threshold = 3";
    let twitchy = "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 1\n  failure_threshold = 1";
    let cfg = config()
        .drain_timeout(1)
        .lb(probed("f4/tolerant", VIP, &[1, 2], tolerant))
        .lb(probed("f4/twitchy", VIP2, &[1, 2], twitchy))
        .to_string();
    bed.start_daemon(&cfg).await;
    let d = bed.daemon();
    wait_probes(d, "f4/tolerant", 2, 1).await;
    let rtt_clean = {
        let t = Instant::now();
        assert!(matches!(
            exchange(&bed.client, sa(VIP, 80), 64, Duration::from_secs(5)).await,
            Exchange::Ok(_)
        ));
        t.elapsed()
    };
    bed.packet_loss(1, 5);
    bed.packet_loss(2, 5);
    let stop = Arc::new(AtomicBool::new(false));
    let targets = vec![
        ("f4/tolerant", node_ip(1)),
        ("f4/tolerant", node_ip(2)),
        ("f4/twitchy", node_ip(1)),
        ("f4/twitchy", node_ip(2)),
    ];
    let rec = record_probes(d, targets.clone(), Arc::clone(&stop));
    // TCP recovers every loss, at the price of retransmission timeouts (3 s
    // after a retransmitted SYN): a client may wait long, but must not fail.
    let slow = Duration::from_secs(40);
    let c1 = load_with(
        &bed.client,
        sa(VIP, 80),
        3,
        100_000,
        Arc::clone(&stop),
        slow,
    );
    let c2 = load_with(
        &bed.client,
        sa(VIP2, 80),
        3,
        100_000,
        Arc::clone(&stop),
        slow,
    );
    tokio::time::sleep(Duration::from_secs(25)).await; // the observation window
    stop.store(true, Ordering::Relaxed);
    let rec = rec.await.unwrap();
    let (seen, m0, m1) = (&rec.seen, &rec.metrics_first, &rec.metrics_last);
    let (t1, t2) = (c1.await.unwrap(), c2.await.unwrap());
    let mut flaps = [0.0, 0.0];
    for (k, (lbn, ip)) in targets.iter().enumerate() {
        let thr = if lbn.ends_with("tolerant") { 3 } else { 1 };
        let (down, up, failed, checked, gaps) = replay(&seen[k], 1, thr);
        let (b, a) = (transitions(m0, lbn, *ip), transitions(m1, lbn, *ip));
        println!(
            "FIGURE fault4 loss+delay: {lbn} node {ip}: {checked} probes, {failed} failed; transitions {down} down / {up} up (daemon counted {} / {}); {gaps} probes missed by the recorder",
            a.0 - b.0,
            a.1 - b.1
        );
        assert!(
            checked >= 15,
            "too few probes recorded for {lbn} {ip}: {checked}"
        );
        if gaps == 0 {
            assert_eq!((a.0 - b.0, a.1 - b.1), (down as f64, up as f64));
        }
        flaps[usize::from(thr == 1)] += a.0 - b.0;
    }
    let mut rtts = Vec::new();
    for _ in 0..5 {
        let t = Instant::now();
        let e = exchange(&bed.client, sa(VIP, 80), 64, Duration::from_secs(10)).await;
        if matches!(e, Exchange::Ok(_)) {
            rtts.push(t.elapsed());
        }
    }
    rtts.sort();
    println!(
        "FIGURE fault4 loss+delay: clients tolerant lb {} ok / {} failed, twitchy lb {} ok / {} failed {:?}; exchange time {:?} clean, median {:?} with loss+delay, slowest {:?}",
        t1.ok_total(),
        t1.failed.len(),
        t2.ok_total(),
        t2.failed.len(),
        t1.failed
            .iter()
            .chain(&t2.failed)
            .take(4)
            .collect::<Vec<_>>(),
        rtt_clean,
        rtts.get(rtts.len() / 2),
        t1.slowest.max(t2.slowest)
    );
    assert!(
        flaps[0] <= flaps[1],
        "failure_threshold 3 flapped more than 1: {flaps:?}"
    );
    // TCP recovers losses, but a connection that loses the same segment
    // several times waits out exponential retransmission timeouts, and one
    // whose connect loses SYN or SYN-ACK on every eligible node within
    // connect_timeout is refused: rare, never silent, bounded here at 2%.
    let total = t1.ok_total() + t1.failed.len() + t2.ok_total() + t2.failed.len();
    let failed = t1.failed.len() + t2.failed.len();
    assert!(
        failed * 50 <= total,
        "{failed} of {total} clients failed under 5% loss: {:?} {:?}",
        t1.failed,
        t2.failed
    );
    assert!(t1.ok_total() >= 50 && t2.ok_total() >= 50);
    assert!(
        rtts.first()
            .is_some_and(|r| *r >= Duration::from_millis(100)),
        "the 2 x 50 ms relay delay is not on the path: {rtts:?}"
    );
    drop((services, relays, healths));
}

//! Faults the health checker and the connect retry must handle: a node that
//! blackholes, a node that refuses or resets on its nodeport, all nodes down,
//! a flapping node, and a lossy, slow path.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use crate::netns::peers::{Exchange, Node, Service, Tally, exchange, load, time_to_refusal};
use crate::netns::{
    Bed, HEALTH_PORT, NODEPORT, VIP, VIP2, backend_of, config, lb, metric, node_ip, sa,
};
use crate::require_netns;

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
    let cfg = config(
        "drain_timeout_seconds = 1",
        &[
            lb(
                "f1/retry",
                VIP,
                &[1, 2, 3],
                "connect_timeout_ms = 300",
                Some(HEALTH_1S),
            ),
            lb(
                "f1/single",
                VIP2,
                &[1, 2, 3],
                "connect_timeout_ms = 300\nconnect_attempts = 1",
                Some(HEALTH_1S),
            ),
        ],
    );
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
        metric(
            m,
            "harvester_lb_backend_connect_failures_total",
            &[
                ("load_balancer", lbn),
                ("backend", &n2),
                ("reason", "connect_timeout"),
            ],
        )
    };
    let failed_single = metric(
        &m,
        "harvester_lb_connections_failed_total",
        &[("load_balancer", "f1/single")],
    );
    let failed_retry = metric(
        &m,
        "harvester_lb_connections_failed_total",
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
        "FIGURE fault1 blackhole: while detecting, retry lb: {} ok / {} failed ({} connect attempts to node 2 timed out and were retried); single-attempt lb: {} ok / {} failed (daemon counted {}); after detection {} ok / {} failed",
        t1.ok_total(),
        t1.failed.len(),
        timeouts_retry,
        t2.ok_total(),
        t2.failed.len(),
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
    assert!(
        t1.failed.is_empty(),
        "retry rule: no client may fail while the node is detected: {:?}",
        t1.failed
    );
    assert_eq!(
        failed_retry, 0.0,
        "the daemon counted failures on the retry lb"
    );
    assert!(
        timeouts_retry >= 1.0,
        "the retry path was not exercised (no timed-out attempt on node 2)"
    );
    assert!(
        !t2.failed.is_empty(),
        "with connect_attempts = 1 some clients must have hit node 2 while undetected"
    );
    assert_eq!(
        t2.failed.len() as f64,
        failed_single,
        "client-seen failures must equal the daemon's count"
    );
    assert!(
        t2.failed.len() as f64 <= timeouts_single,
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
    let cfg = config(
        "drain_timeout_seconds = 1",
        &[
            lb("f2/refuse", VIP, &[1, 2, 4], "", Some(HEALTH_1S)),
            lb("f2/reset", VIP2, &[3, 4], "", Some(HEALTH_1S)),
        ],
    );
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
        metric(
            &m,
            "harvester_lb_backend_connect_failures_total",
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
        metric(
            &m,
            "harvester_lb_backend_connect_failures_total",
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
    let cfg = config(
        "drain_timeout_seconds = 1",
        &[lb("f6/all", VIP, &[1, 2, 3], "", Some(h))],
    );
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
        metric(
            &m,
            "harvester_lb_connections_failed_total",
            &[("load_balancer", "f6/all"), ("reason", "no_backend")]
        ) >= 50.0
    );
    assert_eq!(
        metric(
            &m,
            "harvester_lb_backend_up",
            &[("load_balancer", "f6/all")]
        ),
        0.0
    );
    assert!(
        d.log().contains("no eligible backend"),
        "the log must say why"
    );

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

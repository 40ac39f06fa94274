//! `sessionAffinity: ClientIP`: a client address keeps its backend while
//! that backend is eligible; a client whose backend goes down is picked
//! again and keeps the new one; entries survive a reload that keeps the load
//! balancer; the table is bounded.

use crate::support;

use std::collections::HashSet;
use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use support::*;

const LB: &str = "default/sticky";

fn config(net: &Subnet, extra: &str, proxy: &str) -> String {
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .proxy(&format!("drain_timeout_seconds = 1\n{proxy}"))
        .lb(Lb::new(LB, net.ip(1))
            .backends(net.ips(&[11, 12, 13]))
            .keys(&format!("algorithm = \"round_robin\"\n{extra}"))
            .tcp("echo", 8080, 30080)
            .health("  port = 30080\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1"))
        .to_string()
}

/// The backend that serves one connection from `client`.
async fn served_by(net: &Subnet, client: IpAddr) -> String {
    let mut s = connect_from(client, SocketAddr::new(net.ip(1), 8080))
        .await
        .unwrap();
    read_line(&mut s).await.unwrap()
}

async fn backends_for(net: &Subnet, client: IpAddr, n: usize) -> Vec<String> {
    let mut seen = Vec::new();
    for _ in 0..n {
        seen.push(served_by(net, client).await);
    }
    seen
}

fn all_same(v: &[String]) -> bool {
    v.iter().all(|b| *b == v[0])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_keeps_its_backend_until_it_goes_down_then_keeps_the_new_one() {
    let net = Subnet::new();
    let mut nodes: Vec<Option<Backend>> = Vec::new();
    for h in [11u8, 12, 13] {
        nodes.push(Some(
            Backend::start(SocketAddr::new(net.ip(h), 30080), Behaviour::NameThenEcho).await,
        ));
    }
    let sticky = "session_affinity = \"client_ip\"\naffinity_timeout_seconds = 60";
    let d = Daemon::start(&net, &config(&net, sticky, "")).await;

    // Each client sticks; round robin spreads the clients.
    let mut first = Vec::new();
    for c in 101u8..=106 {
        let seen = backends_for(&net, net.ip(c), 5).await;
        assert!(all_same(&seen), "client .{c} moved: {seen:?}");
        first.push(seen[0].clone());
    }
    let distinct: HashSet<&String> = first.iter().collect();
    assert!(distinct.len() >= 2, "six clients all on {first:?}");
    assert_eq!(d.metric("harvester_lb_affinity_entries{").await, 6.0);
    let status = d.status().await;
    assert_eq!(status["load_balancers"][0]["session_affinity"], "client_ip");
    assert_eq!(
        status["load_balancers"][0]["affinity_entries"], 6,
        "{status}"
    );

    // Client .101's backend goes down: it moves, and stays on the new one,
    // even when the old one comes back.
    let home = first[0].clone();
    let k = nodes
        .iter()
        .position(|n| n.as_ref().is_some_and(|b| b.addr.ip().to_string() == home))
        .unwrap();
    nodes[k].take().unwrap().stop();
    d.wait_health(LB, &home, "unhealthy", Duration::from_secs(8))
        .await;
    let moved = backends_for(&net, net.ip(101), 5).await;
    assert!(
        all_same(&moved) && moved[0] != home,
        "after {home} went down: {moved:?}"
    );
    nodes[k] = Some(
        Backend::start(
            SocketAddr::new(home.parse().unwrap(), 30080),
            Behaviour::NameThenEcho,
        )
        .await,
    );
    d.wait_health(LB, &home, "healthy", Duration::from_secs(8))
        .await;
    assert_eq!(served_by(&net, net.ip(101)).await, moved[0]);

    // A reload that keeps the load balancer keeps the entries.
    let changed = format!("{sticky}\nidle_timeout_seconds = 600");
    std::fs::write(&d.config, config(&net, &changed, "")).unwrap();
    d.server().reload().await.unwrap();
    assert_eq!(served_by(&net, net.ip(101)).await, moved[0]);
    for (c, want) in (102u8..=106).zip(&first[1..]) {
        assert_eq!(
            served_by(&net, net.ip(c)).await,
            *want,
            "client .{c} after reload"
        );
    }

    // Switched off: the entries and their series go.
    std::fs::write(&d.config, config(&net, "", "")).unwrap();
    d.server().reload().await.unwrap();
    let body = d.get("/metrics").await.1;
    assert!(
        !body.contains("harvester_lb_affinity_entries{"),
        "affinity off, entries still exposed:\n{body}"
    );
    let spread: HashSet<String> = backends_for(&net, net.ip(101), 6)
        .await
        .into_iter()
        .collect();
    assert!(
        spread.len() >= 2,
        "affinity off, client still pinned: {spread:?}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_is_bounded_and_a_client_over_the_bound_is_served_unpinned() {
    let net = Subnet::new();
    let _nodes = [
        Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await,
        Backend::start(SocketAddr::new(net.ip(12), 30080), Behaviour::NameThenEcho).await,
        Backend::start(SocketAddr::new(net.ip(13), 30080), Behaviour::NameThenEcho).await,
    ];
    let d = Daemon::start(
        &net,
        &config(
            &net,
            "session_affinity = \"client_ip\"",
            "max_affinity_entries = 2",
        ),
    )
    .await;
    for c in [101u8, 102] {
        let seen = backends_for(&net, net.ip(c), 4).await;
        assert!(all_same(&seen), "client .{c} moved: {seen:?}");
    }
    // A third client is served, round robin, and not remembered.
    let third: HashSet<String> = backends_for(&net, net.ip(103), 6)
        .await
        .into_iter()
        .collect();
    assert!(third.len() >= 2, "over the bound yet pinned: {third:?}");
    assert_eq!(d.metric("harvester_lb_affinity_entries{").await, 2.0);
    assert_eq!(
        d.metric("harvester_lb_affinity_table_full_total{").await,
        6.0,
        "each of the third client's connections found the table full"
    );
    d.stop().await;
}

//! `source_ranges` (Kubernetes' `loadBalancerSourceRanges`) on real sockets:
//! clients bound to different loopback source addresses, a real backend that
//! counts what reaches it, reloads that change the ranges under an open
//! connection, and IPv6 on `::1`.

use crate::support;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::sync::atomic::Ordering;
use std::time::Duration;

use support::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const LB: &str = "default/web";

/// One load balancer on `.1:8080` -> `.11:30080`, with `ranges` as written.
fn config(net: &Subnet, ranges: Option<&str>) -> String {
    with_ranges(net, ranges).to_string()
}

/// [`config`], to add to.
fn with_ranges(net: &Subnet, ranges: Option<&str>) -> Config {
    let ranges = ranges.map_or(String::new(), |r| format!("source_ranges = [{r}]"));
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new(LB, net.ip(1))
            .backends([net.ip(11)])
            .keys(&ranges)
            .tcp("http", 8080, 30080))
}

fn vip(net: &Subnet) -> SocketAddr {
    SocketAddr::new(net.ip(1), 8080)
}

const REJECTED: &str = "harvester_lb_connections_rejected_total{cluster=\"kubernetes\",load_balancer=\"default/web\",listener=\"http\",reason=\"source_range\"}";
const ACCEPTED: &str = "harvester_lb_connections_accepted_total{cluster=\"kubernetes\",load_balancer=\"default/web\",listener=\"http\"}";

/// Asserts the daemon resets `s` at once: no byte, a reset (not a clean end
/// of stream), within a second.
async fn assert_reset(mut s: TcpStream, who: &str) {
    let mut buf = [0u8; 64];
    match tokio::time::timeout(Duration::from_secs(1), s.read(&mut buf)).await {
        Err(_) => panic!("{who}: still open after 1 s"),
        Ok(Ok(0)) => panic!("{who}: clean end of stream, expected a reset"),
        Ok(Ok(n)) => panic!("{who}: got {n} bytes: {:?}", &buf[..n]),
        Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{who}: {e}"),
    }
}

/// Connects from `from` and expects to be reset (the reset may already
/// arrive during `connect`).
async fn expect_rejected(from: IpAddr, to: SocketAddr) {
    match connect_from(from, to).await {
        Ok(s) => assert_reset(s, &format!("client {from}")).await,
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{from}: {e}"),
    }
}

/// Connects from `from` and expects the backend's name line.
async fn expect_served(net: &Subnet, from: IpAddr, to: SocketAddr) -> TcpStream {
    let mut s = connect_from(from, to)
        .await
        .unwrap_or_else(|e| panic!("connect from {from}: {e}"));
    let name = read_line(&mut s)
        .await
        .unwrap_or_else(|e| panic!("client {from} not served: {e}"));
    assert_eq!(name, net.ip_str(11), "client {from}");
    s
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_outside_source_ranges_is_reset_at_accept_and_never_reaches_a_backend() {
    let net = Subnet::new();
    let node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    // .64-.127 in a /26, and .200 alone, written with the IPv4-mapped form.
    let ranges = format!(
        "\"{}/26\", \"::ffff:{}/128\"",
        net.ip_str(64),
        net.ip_str(200)
    );
    let d = Daemon::start(&net, &config(&net, Some(&ranges))).await;

    for host in [64, 100, 127, 200] {
        drop(expect_served(&net, net.ip(host), vip(&net)).await);
    }
    for host in [63, 128, 199, 201, 2] {
        expect_rejected(net.ip(host), vip(&net)).await;
    }
    wait_for(Duration::from_secs(5), "5 rejections counted", || async {
        (d.metric_sample(REJECTED).await == Some(5.0)).then_some(())
    })
    .await;
    // The rejected clients never reached the node, nor count as accepted.
    assert_eq!(node.accepted.load(Ordering::SeqCst), 4);
    assert_eq!(d.metric(ACCEPTED).await, 4.0);
    let (_, body) = d.get("/metrics").await;
    assert!(
        body.contains("# HELP harvester_lb_connections_rejected_total ")
            && body.contains("# TYPE harvester_lb_connections_rejected_total counter"),
        "{body}"
    );
    let status = d.status().await;
    assert_eq!(
        status["load_balancers"][0]["source_ranges"],
        serde_json::json!([
            format!("{}/26", net.ip_str(64)),
            format!("{}/32", net.ip_str(200))
        ])
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_the_ranges_keeps_open_connections() {
    let net = Subnet::new();
    let node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let only = |h: u8| format!("\"{}/32\"", net.ip_str(h));
    let d = Daemon::start(&net, &config(&net, Some(&only(100)))).await;
    // Without ranges no client is rejected: the series, written from its
    // first count on, is absent.
    assert_eq!(d.metric_sample(REJECTED).await, None);

    let mut open = expect_served(&net, net.ip(100), vip(&net)).await;
    expect_rejected(net.ip(200), vip(&net)).await;

    // .100 is out now, .200 in: the open connection from .100 stays.
    net.write("config.toml", &config(&net, Some(&only(200))));
    d.server().reload().await.expect("reload");
    echo(&mut open, "still here").await;
    expect_rejected(net.ip(100), vip(&net)).await;
    drop(expect_served(&net, net.ip(200), vip(&net)).await);
    echo(&mut open, "still here after new clients").await;

    // Ranges removed: everyone again.
    net.write("config.toml", &config(&net, None));
    d.server().reload().await.expect("reload");
    for host in [100, 150, 200] {
        drop(expect_served(&net, net.ip(host), vip(&net)).await);
    }
    echo(&mut open, "and after the ranges went").await;
    assert_eq!(d.metric(REJECTED).await, 2.0);
    assert_eq!(node.accepted.load(Ordering::SeqCst), 5);
    drop(open);
    assert_eq!(d.stop().await, 0);
}

async fn echo(s: &mut TcpStream, line: &str) {
    use tokio::io::AsyncWriteExt;
    s.write_all(format!("{line}\n").as_bytes())
        .await
        .expect("write to the open connection");
    assert_eq!(read_line(s).await.expect("echo"), line);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_clients_are_judged_by_ipv6_ranges() {
    let Ok(probe) = std::net::TcpListener::bind("[::1]:0") else {
        skip_or_fail("ipv6 source ranges", "::1 is not available here");
        return;
    };
    drop(probe);
    let net = Subnet::new();
    let (vip_port, node_port) = (free_port_v6(), free_port_v6());
    let node = Backend::start(
        SocketAddr::from((Ipv6Addr::LOCALHOST, node_port)),
        Behaviour::NameThenEcho,
    )
    .await;
    let cfg = |ranges: &str| {
        Config::new()
            .admin(SocketAddr::new(net.ip(250), 9901))
            .lb(Lb::new(LB, "::1")
                .backends(["::1"])
                .keys(&format!("source_ranges = [{ranges}]"))
                .tcp("http", vip_port, node_port))
            .to_string()
    };
    let vip = SocketAddr::from((Ipv6Addr::LOCALHOST, vip_port));
    let d = Daemon::start(&net, &cfg("\"::1/128\", \"127.0.0.0/8\"")).await;
    assert_eq!(whoami(vip).await.expect("::1 is in ::1/128"), "::1");

    // IPv4 loopback and another IPv6 range: ::1 is out.
    net.write("config.toml", &cfg("\"127.0.0.0/8\", \"2001:db8::/32\""));
    d.server().reload().await.expect("reload");
    match TcpStream::connect(vip).await {
        Ok(s) => assert_reset(s, "::1").await,
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    wait_for(
        Duration::from_secs(5),
        "the IPv6 rejection counted",
        || async { (d.metric_sample(REJECTED).await == Some(1.0)).then_some(()) },
    )
    .await;
    assert_eq!(node.accepted.load(Ordering::SeqCst), 1);
    d.stop().await;
}

/// At `proxy.max_connections`, an in-range client waits for a slot, but a
/// client outside the ranges is reset at once: the check comes before the
/// slot, so outsiders can neither take slots nor queue behind them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rejected_client_takes_no_connection_slot() {
    let net = Subnet::new();
    let _node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let cfg = with_ranges(&net, Some(&format!("\"{}/32\"", net.ip_str(100))))
        .proxy("max_connections = 1");
    let d = Daemon::start(&net, &cfg).await;
    let held = expect_served(&net, net.ip(100), vip(&net)).await;
    for _ in 0..3 {
        expect_rejected(net.ip(200), vip(&net)).await;
    }
    assert_eq!(d.metric(REJECTED).await, 3.0);
    let limit = "harvester_lb_connection_limit_reached_total{cluster=\"kubernetes\",load_balancer=\"default/web\",listener=\"http\"}";
    assert_eq!(
        d.metric_sample(limit).await,
        None,
        "no rejected client waited for a slot (no sample: none counted)"
    );
    drop(held);
    d.stop().await;
}

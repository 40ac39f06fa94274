//! The health port, per Harvester's current rules: a health check without
//! `port` checks each listener's own `backend_port` and makes a backend
//! eligible per listener; with `port`, one verdict serves every listener.
//! Real daemon, real backends on loopback, each test in its own
//! 127.A.B.0/24; every wait polls under a deadline.

use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const LB: &str = "default/web";
/// Generous: the CI machine has 2 busy cores.
const WAIT: Duration = Duration::from_secs(20);
const HTTP: u16 = 30080;
const HTTPS: u16 = 30443;

/// One load balancer on `.1` with listeners `http` (8080 -> 30080) and
/// `https` (8443 -> 30443), backends `.hosts`, and a health check: `port`
/// given (one verdict) or omitted (per listener).
fn config(net: &Subnet, hosts: &[u8], port: Option<u16>, extra: &str) -> String {
    let port = port.map_or(String::new(), |p| format!("  port = {p}\n"));
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new(LB, net.ip(1))
            .backends(net.ips(hosts))
            .keys(extra)
            .tcp("http", 8080, HTTP)
            .tcp("https", 8443, HTTPS)
            .health(&format!(
                "{port}  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1"
            )))
        .to_string()
}

fn vip(net: &Subnet, port: u16) -> SocketAddr {
    SocketAddr::new(net.ip(1), port)
}

fn node(net: &Subnet, host: u8, port: u16) -> SocketAddr {
    SocketAddr::new(net.ip(host), port)
}

/// The fleet of most tests: `.11` serves both nodeports, `.12` only http
/// (nothing listens on its 30443).
async fn nodes(net: &Subnet) -> Vec<Backend> {
    vec![
        Backend::start(node(net, 11, HTTP), Behaviour::NameThenEcho).await,
        Backend::start(node(net, 11, HTTPS), Behaviour::NameThenEcho).await,
        Backend::start(node(net, 12, HTTP), Behaviour::NameThenEcho).await,
    ]
}

/// The backends the next `n` connections through `vip` reach.
async fn names(vip: SocketAddr, n: usize) -> Vec<String> {
    let mut out = Vec::new();
    for _ in 0..n {
        out.push(whoami(vip).await.expect("a connection through the VIP"));
    }
    out
}

/// The `ports` entry of backend `ip` for `backend_port` in `/status`.
async fn port_status(d: &Daemon, ip: &str, backend_port: u16) -> serde_json::Value {
    let b = d.backend_status(LB, ip).await;
    b["ports"]
        .as_array()
        .unwrap_or_else(|| panic!("backend {ip} has no per-port detail: {b}"))
        .iter()
        .find(|p| p["backend_port"] == backend_port)
        .unwrap_or_else(|| panic!("backend {ip} has no port {backend_port}: {b}"))
        .clone()
}

/// Waits until backend `ip` is `health` on `backend_port`.
async fn wait_port(d: &Daemon, ip: &str, backend_port: u16, health: &str) -> serde_json::Value {
    wait_for(
        WAIT,
        &format!("{ip}:{backend_port} to be {health}"),
        || async {
            let p = port_status(d, ip, backend_port).await;
            (p["health"] == health).then_some(p)
        },
    )
    .await
}

/// `eligible_backends` of listener `name` in `/status`.
async fn listener_eligible(d: &Daemon, name: &str) -> u64 {
    let status = d.status().await;
    status["load_balancers"][0]["listeners"]
        .as_array()
        .expect("listeners")
        .iter()
        .find(|l| l["name"] == name)
        .unwrap_or_else(|| panic!("no listener {name}"))["eligible_backends"]
        .as_u64()
        .expect("eligible_backends")
}

fn labels(ip: &str) -> String {
    format!("cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{ip}\"")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodeport_takes_the_node_off_that_listener_only() {
    let net = Subnet::new();
    // .12 has nothing on 30443: its https nodeport is dead.
    let _nodes = nodes(&net).await;
    let d = Daemon::start(&net, &config(&net, &[11, 12], None, "")).await;
    let (a, b) = (net.ip_str(11), net.ip_str(12));

    let dead = wait_port(&d, &b, HTTPS, "unhealthy").await;
    assert_eq!(dead["eligible"], false);
    assert_eq!(dead["listeners"], serde_json::json!(["https"]));
    assert_eq!(dead["probe"]["last_result"], "refused");
    let alive = wait_port(&d, &b, HTTP, "healthy").await;
    assert_eq!(alive["eligible"], true);
    assert_eq!(alive["listeners"], serde_json::json!(["http"]));
    let whole = d.backend_status(LB, &b).await;
    assert_eq!(whole["health"], "unhealthy", "not healthy on every port");
    assert_eq!(whole["eligible"], true, "it still serves http");
    assert!(whole["probe"].is_null(), "each port has its own probe");
    let status = d.status().await;
    assert_eq!(
        status["load_balancers"][0]["health_check_per_listener"],
        true
    );
    assert!(status["load_balancers"][0]["health_check_port"].is_null());
    assert_eq!(listener_eligible(&d, "http").await, 2);
    assert_eq!(listener_eligible(&d, "https").await, 1);

    // https avoids .12 by its health, not by connect retry: no connect to
    // .12:30443 is even tried.
    let refused = format!(
        "harvester_lb_backend_connect_failures_total{{{},reason=\"connect_refused\"}}",
        labels(&b)
    );
    // Absent until a refusal is counted (written from its first count on).
    let before = d.metric_sample(&refused).await;
    for name in names(vip(&net, 8443), 6).await {
        assert_eq!(name, a, "https must not go to the node whose 30443 is dead");
    }
    assert_eq!(
        d.metric_sample(&refused).await,
        before,
        "no attempt on .12:30443"
    );
    // http still uses both nodes (round robin).
    let http = names(vip(&net, 8080), 6).await;
    assert!(http.contains(&a) && http.contains(&b), "{http:?}");

    // Metrics: one backend_up per backend (the conjunction), one
    // backend_port_up per backend and port.
    let (_, metrics) = d.get("/metrics").await;
    let port_up = |ip: &str, port: u16| {
        format!(
            "harvester_lb_backend_port_up{{{},backend_port=\"{port}\"}} ",
            labels(ip)
        )
    };
    assert_eq!(metric_value(&metrics, &port_up(&b, HTTPS)), 0.0);
    assert!(metrics.contains(&port_up(&b, HTTPS)), "{metrics}");
    assert_eq!(metric_value(&metrics, &port_up(&b, HTTP)), 1.0);
    assert_eq!(metric_value(&metrics, &port_up(&a, HTTPS)), 1.0);
    assert!(metrics.contains(&format!("harvester_lb_backend_up{{{}}} 0", labels(&b))));
    assert!(metrics.contains(&format!("harvester_lb_backend_up{{{}}} 1", labels(&a))));
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.starts_with("harvester_lb_backend_port_up{"))
            .count(),
        4,
        "2 backends x 2 ports"
    );
    promtool_accepts(&metrics);

    // The port comes back: https uses .12 again.
    let _b443 = Backend::start(node(&net, 12, HTTPS), Behaviour::NameThenEcho).await;
    wait_port(&d, &b, HTTPS, "healthy").await;
    let https = names(vip(&net, 8443), 6).await;
    assert!(https.contains(&b), "{https:?}");
    assert_eq!(d.backend_status(LB, &b).await["health"], "healthy");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_given_port_keeps_one_verdict_for_every_listener() {
    let net = Subnet::new();
    let _nodes = nodes(&net).await;
    // The check's port is 30443, dead on .12: .12 is down for both listeners.
    let d = Daemon::start(&net, &config(&net, &[11, 12], Some(HTTPS), "")).await;
    let (a, b) = (net.ip_str(11), net.ip_str(12));
    let down = d.wait_health(LB, &b, "unhealthy", WAIT).await;
    assert!(down.get("ports").is_none(), "no per-port detail: {down}");
    assert_eq!(down["probe"]["last_result"], "refused");
    assert_eq!(listener_eligible(&d, "http").await, 1);
    assert_eq!(listener_eligible(&d, "https").await, 1);
    let status = d.status().await;
    assert_eq!(status["load_balancers"][0]["health_check_port"], HTTPS);
    assert_eq!(
        status["load_balancers"][0]["health_check_per_listener"],
        false
    );
    for name in names(vip(&net, 8080), 6).await {
        assert_eq!(name, a, "one verdict: .12 serves no listener");
    }
    let (_, metrics) = d.get("/metrics").await;
    assert!(
        !metrics.contains("harvester_lb_backend_port_up"),
        "no per-port series with a port given"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_switches_between_one_verdict_and_per_listener_keeping_kept_state() {
    let net = Subnet::new();
    let _nodes = nodes(&net).await;
    let d = Daemon::start(&net, &config(&net, &[11, 12], Some(HTTPS), "")).await;
    let (a, b) = (net.ip_str(11), net.ip_str(12));
    d.wait_health(LB, &b, "unhealthy", WAIT).await;
    assert_eq!(listener_eligible(&d, "http").await, 1);

    // Port omitted: .12 returns to http only.
    net.write("config.toml", &config(&net, &[11, 12], None, ""));
    d.server().reload().await.expect("reload to per-listener");
    wait_port(&d, &b, HTTP, "healthy").await;
    wait_port(&d, &b, HTTPS, "unhealthy").await;
    wait_for(WAIT, "http to have both backends", || async {
        (listener_eligible(&d, "http").await == 2).then_some(())
    })
    .await;
    assert_eq!(listener_eligible(&d, "https").await, 1);
    let http = names(vip(&net, 8080), 6).await;
    assert!(http.contains(&b), "{http:?}");
    for name in names(vip(&net, 8443), 4).await {
        assert_eq!(name, a);
    }

    // A reload that keeps the backends keeps each port's verdict and counts.
    let probes_before = port_status(&d, &b, HTTP).await["probe"]["probes"]
        .as_u64()
        .expect("probes");
    net.write(
        "config.toml",
        &config(&net, &[11, 12], None, "connect_timeout_ms = 2000"),
    );
    d.server()
        .reload()
        .await
        .expect("reload keeping the targets");
    let kept = port_status(&d, &b, HTTP).await;
    assert!(
        kept["probe"]["probes"].as_u64().expect("probes") >= probes_before,
        "the target was kept, not started anew: {kept}"
    );
    assert_eq!(port_status(&d, &b, HTTPS).await["health"], "unhealthy");

    // Back to one verdict: .12 leaves both listeners again, and the
    // per-port series go.
    net.write("config.toml", &config(&net, &[11, 12], Some(HTTPS), ""));
    d.server().reload().await.expect("reload to one verdict");
    let down = d.wait_health(LB, &b, "unhealthy", WAIT).await;
    assert!(down.get("ports").is_none(), "{down}");
    wait_for(WAIT, "http to lose .12", || async {
        (listener_eligible(&d, "http").await == 1).then_some(())
    })
    .await;
    for name in names(vip(&net, 8080), 4).await {
        assert_eq!(name, a);
    }
    let (_, metrics) = d.get("/metrics").await;
    assert!(
        !metrics.contains("harvester_lb_backend_port_up"),
        "{metrics}"
    );
    promtool_accepts(&metrics);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn close_resets_only_the_connections_of_the_listener_whose_port_went_down() {
    let net = Subnet::new();
    let _a80 = Backend::start(node(&net, 11, HTTP), Behaviour::NameThenEcho).await;
    let a443 = Backend::start(node(&net, 11, HTTPS), Behaviour::NameThenEcho).await;
    let d = Daemon::start(
        &net,
        &config(&net, &[11], None, "on_backend_down = \"close\""),
    )
    .await;
    let a = net.ip_str(11);
    wait_port(&d, &a, HTTPS, "healthy").await;
    let mut http = TcpStream::connect(vip(&net, 8080)).await.expect("http");
    assert_eq!(read_line(&mut http).await.expect("name"), a);
    let mut https = TcpStream::connect(vip(&net, 8443)).await.expect("https");
    assert_eq!(read_line(&mut https).await.expect("name"), a);
    assert!(still_echoes(&mut http).await && still_echoes(&mut https).await);

    // 30443 stops listening (its open connection lives on at the node).
    a443.stop();
    wait_port(&d, &a, HTTPS, "unhealthy").await;
    let mut buf = [0u8; 16];
    match tokio::time::timeout(WAIT, https.read(&mut buf)).await {
        Ok(Err(_)) | Ok(Ok(0)) => {}
        Ok(Ok(n)) => panic!("expected a reset, got {n} bytes"),
        Err(_) => panic!("the https connection was not closed"),
    }
    assert!(
        still_echoes(&mut http).await,
        "the http connection to the same node goes on"
    );
    assert_eq!(
        d.metric(&format!(
            "harvester_lb_backend_connections_closed_total{{{},reason=\"marked_down\"}}",
            labels(&a)
        ))
        .await,
        1.0
    );
    d.stop().await;
}

/// The backend's name line, waiting for it up to 60 s (the daemon may be
/// trying a node that hangs for that long).
async fn slow_whoami(vip: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect(vip).await?;
    let mut line = Vec::new();
    let read = async {
        let mut byte = [0u8; 1];
        while s.read(&mut byte).await? == 1 && byte[0] != b'\n' {
            line.push(byte[0]);
        }
        Ok::<_, std::io::Error>(())
    };
    tokio::time::timeout(Duration::from_secs(60), read)
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no name in 60 s"))??;
    Ok(String::from_utf8_lossy(&line).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_connection_still_connecting_when_its_backend_is_marked_down_goes_elsewhere() {
    let net = Subnet::new();
    let _a80 = Backend::start(node(&net, 11, HTTP), Behaviour::NameThenEcho).await;
    let _a443 = Backend::start(node(&net, 11, HTTPS), Behaviour::NameThenEcho).await;
    // .12's http nodeport completes no handshake: a connect to it hangs,
    // and so does its probe, until the check marks it down.
    let _hole = BlackHole::new(node(&net, 12, HTTP));
    let _b443 = Backend::start(node(&net, 12, HTTPS), Behaviour::NameThenEcho).await;
    let mut cfg = config(
        &net,
        &[11, 12],
        None,
        "on_backend_down = \"close\"\nconnect_timeout_ms = 120000",
    );
    // Three failed probes (about 3-5 s) before the mark-down: time for
    // the clients below to be connecting to .12 when it comes.
    cfg = cfg.replace("failure_threshold = 1", "failure_threshold = 3");
    let d = Daemon::start(&net, &cfg).await;
    let (a, b) = (net.ip_str(11), net.ip_str(12));
    // Two clients at once: round robin sends one of them to .12 first.
    let clients: Vec<_> = (0..2)
        .map(|_| tokio::spawn(slow_whoami(vip(&net, 8080))))
        .collect();
    let accepted = format!(
        "harvester_lb_connections_accepted_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\"}}"
    );
    wait_for(WAIT, "both clients accepted", || async {
        (d.metric_sample(&accepted).await == Some(2.0)).then_some(())
    })
    .await;
    let was_eligible = port_status(&d, &b, HTTP).await["health"] == "healthy";
    for c in clients {
        // Without the fix this client would wait out the 120 s connect timeout.
        let name = c
            .await
            .expect("client task")
            .expect("the client connecting to .12 is moved when .12 is marked down");
        assert_eq!(name, a);
    }
    assert_eq!(port_status(&d, &b, HTTP).await["health"], "unhealthy");
    let timeouts = format!(
        "harvester_lb_backend_connect_failures_total{{{},reason=\"connect_timeout\"}}",
        labels(&b)
    );
    assert_eq!(
        d.metric_sample(&timeouts).await,
        None,
        "abandoned, not timed out (no sample: none counted)"
    );
    if !was_eligible {
        eprintln!(
            "NOTE: .12 was marked down before the clients were accepted; the hang was not exercised"
        );
    }
    d.stop().await;
}

/// The same on IPv6: the VIP and the node are `::1`, whose https nodeport
/// is dead. Its http listener keeps serving; its https listener has no
/// eligible backend.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn per_listener_verdicts_hold_on_ipv6() {
    let net = Subnet::new();
    let (vip_http, vip_https, node_http, node_https) = (
        free_port_v6(),
        free_port_v6(),
        free_port_v6(),
        free_port_v6(),
    );
    let v6 = |port| SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port));
    let _node = Backend::start(v6(node_http), Behaviour::NameThenEcho).await;
    let text = Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new(LB, "::1")
            .backends(["::1"])
            .tcp("http", vip_http, node_http)
            .tcp("https", vip_https, node_https)
            .health("  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1"));
    let d = Daemon::start(&net, &text).await;
    wait_port(&d, "::1", node_https, "unhealthy").await;
    wait_port(&d, "::1", node_http, "healthy").await;
    assert_eq!(listener_eligible(&d, "http").await, 1);
    assert_eq!(listener_eligible(&d, "https").await, 0);
    assert!(
        whoami(v6(vip_http)).await.is_ok(),
        "http through [::1] serves"
    );
    assert!(
        whoami(v6(vip_https)).await.is_err(),
        "https through [::1] has no eligible backend"
    );
    d.stop().await;
}

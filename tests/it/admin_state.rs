//! A node that goes down, and an operator who drains one: `on_backend_down`,
//! the operator's backend state (`ready | drain | maint`), the admin Unix
//! socket that alone may change it, and `harvester-lb backend`. Real
//! daemon, real backends, real sockets; each test owns a 127.A.B.0/24 and
//! puts its admin socket in its own directory.

use crate::support;

use std::net::SocketAddr;
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::*;
use tokio::io::AsyncReadExt;
use tokio::net::TcpStream;

const LB: &str = "default/web";

/// One load balancer `name` on `.vip_host:8080` forwarding to `backends` on
/// port 30080; `health` adds a check of port 30081 every second.
fn lb(net: &Subnet, name: &str, vip_host: u8, backends: &[u8], extra: &str, health: bool) -> Lb {
    let lb = Lb::new(name, net.ip(vip_host))
        .backends(net.ips(backends))
        .keys(extra)
        .tcp("tcp", 8080, 30080);
    if health {
        lb.health(
            "  port = 30081\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1",
        )
    } else {
        lb
    }
}

fn socket_path(net: &Subnet) -> PathBuf {
    net.dir().join("admin.sock")
}

fn vip(net: &Subnet, host: u8) -> SocketAddr {
    SocketAddr::new(net.ip(host), 8080)
}

fn node(net: &Subnet, host: u8) -> SocketAddr {
    SocketAddr::new(net.ip(host), 30080)
}

fn health_port(net: &Subnet, host: u8) -> SocketAddr {
    SocketAddr::new(net.ip(host), 30081)
}

/// `POST /backends/state` over the socket.
async fn set_state(socket: &Path, lb: &str, backend: &str, state: &str) -> (u16, String) {
    let body =
        format!(r#"{{"load_balancer": "{lb}", "backend": "{backend}", "state": "{state}"}}"#);
    http_unix(socket, "POST", "/backends/state", &body).await
}

/// Opens a connection through `vip` and reads the backend's name line.
async fn open(vip: SocketAddr) -> (TcpStream, String) {
    let mut s = TcpStream::connect(vip).await.expect("connect VIP");
    let name = read_line(&mut s).await.expect("name line");
    (s, name)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marked_down_with_close_resets_open_connections_and_keep_leaves_them() {
    let net = Subnet::new();
    let _node = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let health = Backend::start(health_port(&net, 11), Behaviour::Echo).await;
    let close = "on_backend_down = \"close\"";
    // "down/close" closes; "down/keep" has the lines `keep` (the default
    // keeps).
    let cfg = |keep: &str| {
        Config::on(&net)
            .lb(lb(&net, "down/close", 1, &[11], close, true))
            .lb(lb(&net, "down/keep", 2, &[11], keep, true))
    };
    let d = Daemon::start(&net, &cfg("")).await;
    let ip = net.ip_str(11);
    d.wait_health("down/close", &ip, "healthy", Duration::from_secs(5))
        .await;

    let (mut closed, _) = open(vip(&net, 1)).await;
    let (mut kept, _) = open(vip(&net, 2)).await;
    assert!(still_echoes(&mut closed).await);
    assert!(still_echoes(&mut kept).await);

    // The health port stops answering; the nodeport (and both connections) stay.
    health.stop();
    d.wait_health("down/close", &ip, "unhealthy", Duration::from_secs(5))
        .await;
    d.wait_health("down/keep", &ip, "unhealthy", Duration::from_secs(5))
        .await;

    // close: reset at once (a read sees the reset, or EOF if it raced).
    let mut buf = [0u8; 16];
    match tokio::time::timeout(Duration::from_secs(5), closed.read(&mut buf)).await {
        Ok(Err(e)) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
        Ok(Ok(0)) => {}
        Ok(Ok(n)) => panic!("expected a reset, got {n} bytes"),
        Err(_) => panic!("the connection to a backend marked down was not closed"),
    }
    // keep: the connection goes on.
    assert!(still_echoes(&mut kept).await, "keep must leave it open");

    let closed_series = format!(
        "harvester_lb_backend_connections_closed_total{{cluster=\"kubernetes\",load_balancer=\"down/close\",backend=\"{ip}\",reason=\"marked_down\"}}"
    );
    assert_eq!(d.metric(&closed_series).await, 1.0);
    let (_, metrics) = d.get("/metrics").await;
    assert!(
        !metrics.contains(
            "harvester_lb_backend_connections_closed_total{cluster=\"kubernetes\",load_balancer=\"down/keep\""
        ),
        "keep closes nothing, so its series is absent"
    );
    promtool_accepts(&metrics);

    // Applied by reload: keep becomes close. The next mark-down resets its connections.
    let health = Backend::start(health_port(&net, 11), Behaviour::Echo).await;
    d.wait_health("down/keep", &ip, "healthy", Duration::from_secs(5))
        .await;
    net.write("config.toml", &cfg(close).to_string());
    d.server().reload().await.expect("reload");
    health.stop();
    d.wait_health("down/keep", &ip, "unhealthy", Duration::from_secs(5))
        .await;
    match tokio::time::timeout(Duration::from_secs(5), kept.read(&mut buf)).await {
        Ok(Err(_)) | Ok(Ok(0)) => {}
        Ok(Ok(n)) => panic!("expected a reset, got {n} bytes"),
        Err(_) => panic!("close, applied by reload, did not close the connection"),
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_stops_new_connections_open_ones_continue_and_ready_restores() {
    let net = Subnet::new();
    let _a = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let _b = Backend::start(node(&net, 12), Behaviour::NameThenEcho).await;
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11, 12], "", false));
    let d = Daemon::start(&net, &cfg).await;
    let (a, b) = (net.ip_str(11), net.ip_str(12));

    // A connection held open on .11.
    let mut held = None;
    for _ in 0..4 {
        let (s, name) = open(vip(&net, 1)).await;
        if name == a {
            held = Some(s);
            break;
        }
    }
    let mut held = held.expect("round robin reaches .11");

    // The CLI drains .11 through the socket.
    let socket = socket_path(&net);
    let (code, out, err) = cli(vec![
        "backend".into(),
        "drain".into(),
        "--lb".into(),
        LB.into(),
        a.clone(),
        "--socket".into(),
        socket.display().to_string(),
    ])
    .await;
    assert_eq!(code, 0, "stdout {out} stderr {err}");
    assert!(out.contains("ready -> drain"), "{out}");

    for _ in 0..6 {
        let (_, name) = open(vip(&net, 1)).await;
        assert_eq!(name, b, "a drained backend takes no new connection");
    }
    assert!(still_echoes(&mut held).await, "open connections continue");

    let status = d.backend_status(LB, &a).await;
    assert_eq!(status["admin_state"], "drain");
    assert_eq!(status["eligible"], false);
    assert_eq!(
        status["health"], "healthy",
        "a drain does not lie about health"
    );
    assert_eq!(
        d.metric(&format!(
            "harvester_lb_backend_admin_state{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{a}\",state=\"drain\"}}"
        ))
        .await,
        1.0
    );
    let (_, metrics) = d.get("/metrics").await;
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.starts_with("harvester_lb_backend_admin_state{")
                && l.contains(&format!("backend=\"{a}\"")))
            .count(),
        1,
        "one series per backend, its state in the label"
    );

    // The state survives a reload that keeps the backend (.13 joins).
    let _c = Backend::start(node(&net, 13), Behaviour::NameThenEcho).await;
    net.write(
        "config.toml",
        &Config::on(&net)
            .lb(lb(&net, LB, 1, &[11, 12, 13], "", false))
            .to_string(),
    );
    d.server().reload().await.expect("reload");
    assert_eq!(d.backend_status(LB, &a).await["admin_state"], "drain");
    for _ in 0..6 {
        let (_, name) = open(vip(&net, 1)).await;
        assert_ne!(name, a, "still drained after the reload");
    }
    assert!(still_echoes(&mut held).await);

    // ready: .11 takes connections again.
    let (code, out) = set_state(&socket, LB, &a, "ready").await;
    assert_eq!(code, 200, "{out}");
    let answer: serde_json::Value = serde_json::from_str(&out).expect("JSON answer");
    assert_eq!(answer["previous_state"], "drain");
    assert_eq!(answer["state"], "ready");
    let mut seen = false;
    for _ in 0..6 {
        seen |= open(vip(&net, 1)).await.1 == a;
    }
    assert!(seen, "ready restores the backend");
    drop(held);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_affinity_does_not_send_a_client_to_a_drained_backend() {
    let net = Subnet::new();
    let _a = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let _b = Backend::start(node(&net, 12), Behaviour::NameThenEcho).await;
    let cfg = Config::on(&net).lb(lb(
        &net,
        LB,
        1,
        &[11, 12],
        "session_affinity = \"client_ip\"",
        false,
    ));
    let d = Daemon::start(&net, &cfg).await;
    let client = net.ip(100);
    let mut s = connect_from(client, vip(&net, 1)).await.unwrap();
    let first = read_line(&mut s).await.unwrap();
    drop(s);
    let (code, body) = set_state(&socket_path(&net), LB, &first, "drain").await;
    assert_eq!(code, 200, "{body}");
    for _ in 0..4 {
        let mut s = connect_from(client, vip(&net, 1)).await.unwrap();
        assert_ne!(
            read_line(&mut s).await.unwrap(),
            first,
            "affinity must not override a drain"
        );
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn maint_stops_probes_and_shows_in_status_until_ready() {
    let net = Subnet::new();
    let _n11 = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let _n12 = Backend::start(node(&net, 12), Behaviour::NameThenEcho).await;
    let _h11 = Backend::start(health_port(&net, 11), Behaviour::Echo).await;
    let _h12 = Backend::start(health_port(&net, 12), Behaviour::Echo).await;
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11, 12], "", true));
    let d = Daemon::start(&net, &cfg).await;
    let (a, b) = (net.ip_str(11), net.ip_str(12));
    let probes = |ip: String| {
        let d = &d;
        async move {
            // Written from the first probe on: none yet is no sample.
            d.metric_sample(&format!(
                "harvester_lb_health_checks_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{ip}\",result=\"ok\"}}"
            ))
            .await
            .unwrap_or(0.0)
        }
    };
    wait_for(Duration::from_secs(5), ".11 probed", || async {
        (probes(a.clone()).await >= 1.0).then_some(())
    })
    .await;

    let (code, body) = set_state(&socket_path(&net), LB, &a, "maint").await;
    assert_eq!(code, 200, "{body}");
    let status = d.backend_status(LB, &a).await;
    assert_eq!(status["admin_state"], "maint");
    assert!(status["probe"].is_null(), "maint is not probed: {status}");
    let frozen = probes(a.clone()).await;
    // Three more probes of .12 (a period apart): .11 got none meanwhile.
    let start = probes(b.clone()).await;
    wait_for(Duration::from_secs(10), "three probes of .12", || async {
        (probes(b.clone()).await >= start + 3.0).then_some(())
    })
    .await;
    assert_eq!(
        probes(a.clone()).await,
        frozen,
        "no probe of a backend in maint"
    );
    for _ in 0..4 {
        assert_eq!(open(vip(&net, 1)).await.1, b);
    }

    // ready: probed again, back in service.
    let (code, body) = set_state(&socket_path(&net), LB, &a, "ready").await;
    assert_eq!(code, 200, "{body}");
    wait_for(Duration::from_secs(5), ".11 probed again", || async {
        (probes(a.clone()).await > frozen).then_some(())
    })
    .await;
    let status = d.backend_status(LB, &a).await;
    assert_eq!(status["admin_state"], "ready");
    assert_eq!(status["health"], "healthy");
    let mut seen = false;
    for _ in 0..4 {
        seen |= open(vip(&net, 1)).await.1 == a;
    }
    assert!(seen);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn only_the_private_socket_changes_state() {
    let net = Subnet::new();
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11], "", false));
    let d = Daemon::start(&net, &cfg).await;
    let socket = socket_path(&net);
    assert_eq!(d.socket, socket, "admin.socket from the config is used");

    let mode = std::fs::metadata(&socket).unwrap().permissions().mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");

    // The TCP listener refuses a state change, whatever the body.
    let body = format!(
        r#"{{"load_balancer": "{LB}", "backend": "{}", "state": "drain"}}"#,
        net.ip_str(11)
    );
    let (code, answer) = http_with_body(d.admin, "POST", "/backends/state", &body).await;
    assert_eq!(code, 403, "{answer}");
    assert!(answer.contains("admin.socket"), "{answer}");
    assert_eq!(
        d.backend_status(LB, &net.ip_str(11)).await["admin_state"],
        "ready"
    );
    // Its read-only endpoints and POST /reload are as they were.
    assert_eq!(d.get("/healthz").await.0, 200);
    assert_eq!(http(d.admin, "POST", "/reload").await.0, 200);
    // The socket serves the read-only endpoints too.
    let (code, status) = http_unix(&socket, "GET", "/status", "").await;
    assert_eq!(code, 200);
    assert!(status.contains("\"admin_state\": \"ready\""), "{status}");

    d.stop().await;
    assert!(!socket.exists(), "the socket file goes with the daemon");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_requests_are_refused_with_a_message_naming_the_problem() {
    let net = Subnet::new();
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11, 12], "", false));
    let d = Daemon::start(&net, &cfg).await;
    let socket = socket_path(&net);
    let a = net.ip_str(11);
    let cases: Vec<(String, u16, String)> = vec![
        ("not json".into(), 400, "bad request body".into()),
        ("".into(), 400, "bad request body".into()),
        (
            r#"{"load_balancer": "default/web", "backend": "1.2.3.4"}"#.into(),
            400,
            "missing field `state`".into(),
        ),
        (
            format!(
                r#"{{"load_balancer": "{LB}", "backend": "{a}", "state": "drain", "extra": 1}}"#
            ),
            400,
            "unknown field `extra`".into(),
        ),
        (
            format!(r#"{{"load_balancer": "{LB}", "backend": "{a}", "state": "sleep"}}"#),
            400,
            "\\\"sleep\\\" is not one of".into(),
        ),
        (
            format!(r#"{{"load_balancer": "{LB}", "backend": "node-1", "state": "drain"}}"#),
            400,
            "is not an IP address".into(),
        ),
        (
            format!(r#"{{"load_balancer": "{LB}", "backend": 7, "state": "drain"}}"#),
            400,
            "invalid type".into(),
        ),
        (
            format!(r#"{{"load_balancer": "nope/svc", "backend": "{a}", "state": "drain"}}"#),
            404,
            "unknown load balancer \\\"nope/svc\\\"".into(),
        ),
        (
            format!(
                r#"{{"load_balancer": "{LB}", "backend": "{}", "state": "drain"}}"#,
                net.ip_str(99)
            ),
            404,
            "is not a backend of load balancer".into(),
        ),
        (
            "x".repeat(10_000),
            400,
            "cannot read the request body".into(),
        ),
    ];
    let mut checked = 0;
    for (body, want, message) in &cases {
        let (code, answer) = http_unix(&socket, "POST", "/backends/state", body).await;
        assert_eq!(code, *want, "{body:.60}: {answer}");
        let json: serde_json::Value = serde_json::from_str(&answer)
            .unwrap_or_else(|e| panic!("{body:.60}: the answer is JSON ({e}): {answer}"));
        let text = json["error"].as_str().unwrap_or_default();
        assert!(
            answer.contains(message.as_str()),
            "{body:.60}: expected {message:?} in {text}"
        );
        checked += 1;
    }
    assert_eq!(checked, cases.len());
    let (code, _) = http_unix(&socket, "GET", "/backends/state", "").await;
    assert_eq!(code, 405);
    // Nothing changed, and the daemon still serves.
    assert_eq!(d.backend_status(LB, &a).await["admin_state"], "ready");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_cli_fails_clearly_and_reload_uses_the_socket() {
    let net = Subnet::new();
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11], "", false));
    let d = Daemon::start(&net, &cfg).await;
    let socket = socket_path(&net).display().to_string();

    // A backend that is not a member.
    let (code, out, err) = cli(vec![
        "backend".into(),
        "drain".into(),
        "--lb".into(),
        LB.into(),
        net.ip_str(99),
        "--socket".into(),
        socket.clone(),
    ])
    .await;
    assert_ne!(code, 0, "{out}");
    assert!(err.contains("is not a backend of load balancer"), "{err}");
    // An unknown load balancer.
    let (code, _, err) = cli(vec![
        "backend".into(),
        "maint".into(),
        "--lb".into(),
        "nope/svc".into(),
        net.ip_str(11),
        "--socket".into(),
        socket.clone(),
    ])
    .await;
    assert_ne!(code, 0);
    assert!(err.contains("unknown load balancer"), "{err}");
    // No socket there.
    let missing = net.dir().join("missing.sock").display().to_string();
    let (code, _, err) = cli(vec![
        "backend".into(),
        "drain".into(),
        "--lb".into(),
        LB.into(),
        net.ip_str(11),
        "--socket".into(),
        missing,
    ])
    .await;
    assert_eq!(code, 69, "{err}");
    assert!(err.contains("the daemon is not running"), "{err}");
    // --config finds the socket through admin.socket.
    let (code, out, err) = cli(vec![
        "backend".into(),
        "maint".into(),
        "--lb".into(),
        LB.into(),
        net.ip_str(11),
        "--config".into(),
        d.config.display().to_string(),
    ])
    .await;
    assert_eq!(code, 0, "{out} {err}");
    assert_eq!(
        d.backend_status(LB, &net.ip_str(11)).await["admin_state"],
        "maint"
    );

    // reload goes through the socket: this file's admin.listen has no daemon.
    let elsewhere = net.write(
        "cli.toml",
        &Config::new()
            .admin(SocketAddr::new(net.ip(251), 9))
            .socket(Path::new(&socket))
            .to_string(),
    );
    let (code, out, err) = cli(vec![
        "reload".into(),
        "--config".into(),
        elsewhere.display().to_string(),
    ])
    .await;
    assert_eq!(code, 0, "{out} {err}");
    assert!(out.contains("reloaded"), "{out}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_socket_is_never_taken_and_a_stale_one_is_replaced() {
    let net = Subnet::new();
    let socket = socket_path(&net);
    // A stale socket file (its daemon died): replaced.
    drop(std::os::unix::net::UnixListener::bind(&socket).unwrap());
    assert!(socket.exists());
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11], "", false));
    let d = Daemon::start(&net, &cfg).await;
    assert_eq!(http_unix(&socket, "GET", "/healthz", "").await.0, 200);

    // A second daemon (its own admin.listen) must not take the live socket.
    let err = refused_admin(
        &net,
        ("second.toml", 251),
        &socket,
        "a second daemon took a live admin socket",
    )
    .await;
    assert!(err.contains("another process is serving it"), "{err}");
    assert_eq!(
        http_unix(&socket, "GET", "/healthz", "").await.0,
        200,
        "the first daemon keeps it"
    );

    // A file that is not a socket is never removed.
    let plain = net.write("plain", "keep me");
    let err = refused_admin(
        &net,
        ("third.toml", 252),
        &plain,
        "a regular file was replaced by the socket",
    )
    .await;
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read_to_string(&plain).unwrap(), "keep me");
    d.stop().await;
}

/// The error of a second daemon, written to `file` with only `[admin]`
/// (listen on the subnet's host `.host`, `socket`), which must not start:
/// starting would mean `wrong`.
async fn refused_admin(
    net: &Subnet,
    (file, host): (&str, u8),
    socket: &Path,
    wrong: &str,
) -> String {
    let other = net.write(
        file,
        &Config::new()
            .admin(SocketAddr::new(net.ip(host), 9901))
            .socket(socket)
            .to_string(),
    );
    match harvester_lb::start(harvester_lb::Options::new(&other)).await {
        Ok(_) => panic!("{wrong}"),
        Err(e) => e.to_string(),
    }
}

/// A squatter on `addr` that answers every request "200 reloaded", as a
/// local user who bound admin.listen before the daemon could.
fn squat(addr: SocketAddr) -> std::net::TcpListener {
    let squatter = std::net::TcpListener::bind(addr).expect("squat admin.listen");
    let serving = squatter.try_clone().unwrap();
    std::thread::spawn(move || {
        for s in serving.incoming().take(16) {
            let Ok(mut s) = s else { continue };
            use std::io::{Read, Write};
            let mut buf = [0u8; 4096];
            let _ = s.set_read_timeout(Some(Duration::from_secs(5)));
            let _ = s.read(&mut buf);
            let _ = s.write_all(
                b"HTTP/1.1 200 OK\r\nContent-Length: 9\r\nConnection: close\r\n\r\nreloaded\n",
            );
        }
    });
    squatter
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_squatted_admin_port_neither_starts_the_daemon_nor_answers_the_cli() {
    let net = Subnet::new();
    let addr = SocketAddr::new(net.ip(250), 9901);
    let _squatter = squat(addr);
    let cfg = Config::on(&net).lb(lb(&net, LB, 1, &[11], "", false));
    let path = net.write("config.toml", &cfg.to_string());

    // The daemon refuses to start, naming the port, who holds it and the fix.
    let err = match harvester_lb::start(harvester_lb::Options::new(&path)).await {
        Ok(_) => panic!("started beside a squatter on admin.listen"),
        Err(e) => e.to_string(),
    };
    assert!(
        err.contains(&addr.to_string())
            && err.contains(&format!("a socket of uid {} listens there", {
                #[allow(unsafe_code)]
                // SAFETY: geteuid has no preconditions.
                unsafe {
                    libc::geteuid()
                }
            }))
            && err.contains("set admin.listen to a free address"),
        "{err}"
    );
    assert!(!socket_path(&net).exists(), "the admin socket was left");

    // `reload` never takes the squatter's answer: no socket, no success.
    let (code, out, err) = cli(vec![
        "reload".into(),
        "--config".into(),
        path.display().to_string(),
    ])
    .await;
    assert_eq!(code, 69, "{out} {err}");
    assert!(
        !out.contains("reloaded"),
        "the squatter's answer was printed: {out}"
    );
    assert!(
        err.contains(&socket_path(&net).display().to_string())
            && err.contains("never on admin.listen"),
        "{err}"
    );
}

/// A directory owned by uid 65534 (another user), mode `mode`.
fn foreign_dir(net: &Subnet, name: &str, owner: u32, mode: u32) -> PathBuf {
    let dir = net.dir().join(name);
    std::fs::create_dir_all(&dir).unwrap();
    std::os::unix::fs::chown(&dir, Some(owner), Some(owner)).expect("chown (tests run as root)");
    std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(mode)).unwrap();
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_admin_socket_another_user_could_replace_is_refused_by_daemon_and_cli() {
    if cannot_run(
        "an_admin_socket_another_user_could_replace_is_refused_by_daemon_and_cli",
        [not_root()],
    ) {
        return;
    }
    let net = Subnet::new();
    // Owned by another user; and root's, but writable by everyone (no sticky bit).
    for (dir, says) in [
        (
            foreign_dir(&net, "nobody", 65534, 0o700),
            "owned by another user (owner uid 65534, mode 0700)",
        ),
        (
            foreign_dir(&net, "open", 0, 0o777),
            "writable by group or others without the sticky bit (owner uid 0, mode 0777)",
        ),
    ] {
        let socket = dir.join("admin.sock");
        let cfg = Config::on(&net)
            .socket(&socket)
            .lb(lb(&net, LB, 1, &[11], "", false));
        let path = net.write("config.toml", &cfg.to_string());
        let err = match harvester_lb::start(harvester_lb::Options::new(&path)).await {
            Ok(_) => panic!("started with its admin socket in {}", dir.display()),
            Err(e) => e.to_string(),
        };
        assert!(
            err.contains(&dir.display().to_string())
                && err.contains(says)
                && err.contains("/run/harvester-lb"),
            "{err}"
        );

        // The other user's own socket there, answering success to anything:
        // the CLI must not send to it, nor print a success.
        let fake = std::os::unix::net::UnixListener::bind(&socket).unwrap();
        let answered = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let seen = std::sync::Arc::clone(&answered);
        fake.set_nonblocking(true).unwrap();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = std::sync::Arc::clone(&stop);
        let server = std::thread::spawn(move || {
            use std::io::{Read, Write};
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                match fake.accept() {
                    Ok((mut s, _)) => {
                        seen.store(true, std::sync::atomic::Ordering::Relaxed);
                        let _ = s.set_nonblocking(false);
                        let mut buf = [0u8; 4096];
                        let _ = s.read(&mut buf);
                        let body = r#"{"backend":"x","state":"drain","previous_state":"ready"}"#;
                        let _ = write!(
                            s,
                            "HTTP/1.1 200 OK\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
                            body.len()
                        );
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
        });
        for args in [
            vec![
                "backend".to_string(),
                "drain".into(),
                "--lb".into(),
                LB.into(),
                net.ip_str(11),
                "--socket".into(),
                socket.display().to_string(),
            ],
            vec![
                "reload".to_string(),
                "--config".into(),
                path.display().to_string(),
            ],
            vec![
                "status".to_string(),
                "--config".into(),
                path.display().to_string(),
            ],
        ] {
            let (code, out, err) = cli(args.clone()).await;
            assert_ne!(code, 0, "{args:?}: {out}");
            assert!(
                !out.contains("drain") && !out.contains("reloaded"),
                "{args:?}: {out}"
            );
            assert!(err.contains(says), "{args:?}: {err}");
            assert!(
                args[0] == "status" || err.contains("nothing was sent"),
                "{args:?}: {err}"
            );
        }
        assert!(
            !answered.load(std::sync::atomic::Ordering::Relaxed),
            "the CLI connected to the other user's socket"
        );
        stop.store(true, std::sync::atomic::Ordering::Relaxed);
        server.join().unwrap();
    }
}

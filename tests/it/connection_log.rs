//! The connection log (`log_connections`) from the outside: the real
//! binary, its log read line by line, real clients and backends that
//! cause each termination state (a backend that resets, one that refuses,
//! a black hole, a drain, a source range, a dead pool, a health check that
//! fails under an open connection), and the fields of each line asserted.

use crate::support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use serde_json::Value;
use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const LB: &str = "default/web";
const WAIT: Duration = Duration::from_secs(20);

/// The real daemon, whose log lines the tests read.
struct Logged {
    process: Process,
    admin: SocketAddr,
}

impl Logged {
    /// Starts `harvester-lb run` on `config` with `--log-format format` and
    /// waits until it is ready.
    async fn start(net: &Subnet, config: &str, format: &str) -> Self {
        let path = net.write("config.toml", config);
        let mut process = Process::launch(&path)
            .global_args(&["--log-format", format])
            .spawn();
        let admin = SocketAddr::new(net.ip(250), 9901);
        process.wait_ready(admin).await;
        Self { process, admin }
    }

    /// [`Logged::start`] with `--log-format json`.
    async fn json(net: &Subnet, config: &str) -> Self {
        Self::start(net, config, "json").await
    }

    /// [`Logged::json`] on [`config`]'s file: `top` lines, then the load
    /// balancer on `backends` with its `extra` lines.
    async fn tcp(net: &Subnet, top: &str, backends: &[u8], extra: &str) -> Self {
        Self::json(net, &config(net, top, backends, extra)).await
    }

    /// [`Logged::json`] on [`udp_config`]'s file.
    async fn udp(net: &Subnet, top: &str, extra: &str) -> Self {
        Self::json(net, &udp_config(net, top, extra)).await
    }

    /// Every connection line so far, parsed (JSON format).
    fn connection_lines(&self) -> Vec<Value> {
        self.process
            .lines()
            .iter()
            .filter_map(|l| serde_json::from_str::<Value>(l).ok())
            .filter(|v| v["target"] == "harvester_lb::connection")
            .map(|v| v["fields"].clone())
            .collect()
    }

    /// Waits for the connection line of client `client`.
    async fn line_of(&self, client: SocketAddr) -> Value {
        let want = client.to_string();
        wait_for(WAIT, &format!("the connection line of {want}"), || {
            let found = self
                .connection_lines()
                .into_iter()
                .find(|l| l["client"] == want.as_str());
            async move { found }
        })
        .await
    }

    /// Every log line so far, raw.
    fn raw(&self) -> Vec<String> {
        self.process.lines()
    }

    fn signal(&self, sig: i32) {
        self.process.signal(sig);
    }
}

/// One load balancer `LB` on `.1:8080` -> `backends` on port 30080, with
/// `extra` lines in its table and `top` before it.
fn config(net: &Subnet, top: &str, backends: &[u8], extra: &str) -> String {
    web(
        net,
        top,
        backends,
        extra,
        Listener::new("http", 8080, 30080),
    )
}

/// [`config`] with `listener`.
fn web(net: &Subnet, top: &str, backends: &[u8], extra: &str, listener: Listener) -> String {
    Config::on(net)
        .text(top)
        .lb(Lb::new(LB, net.ip(1))
            .keys("cluster = \"guest\"")
            .backends(net.ips(backends))
            .keys(extra)
            .listener(listener))
        .to_string()
}

fn vip(net: &Subnet) -> SocketAddr {
    SocketAddr::new(net.ip(1), 8080)
}

fn node(net: &Subnet, host: u8) -> SocketAddr {
    SocketAddr::new(net.ip(host), 30080)
}

/// A client from `.100` that has read the backend's name line.
async fn served_client(net: &Subnet) -> TcpStream {
    let mut s = connect_from(net.ip(100), vip(net)).await.expect("connect");
    let name = read_line(&mut s).await.expect("served");
    assert_eq!(name, net.ip_str(11));
    s
}

/// Reads until the stream ends; whether it ended with a reset.
async fn ends_with_reset(s: &mut TcpStream) -> bool {
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(WAIT, s.read(&mut buf)).await {
            Err(_) => panic!("the client's connection did not end"),
            Ok(Ok(0)) => return false,
            Ok(Ok(_)) => {}
            Ok(Err(e)) => {
                assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}");
                return true;
            }
        }
    }
}

/// A client from `from` that the daemon resets right after accept; its
/// address. The reset can reach the client before its `connect` is seen
/// to complete, so `connect` failing with a reset counts as well as a read
/// that meets one.
async fn reset_at_once(from: IpAddr, vip: SocketAddr) -> SocketAddr {
    let socket = tokio::net::TcpSocket::new_v4().expect("socket");
    socket
        .bind(SocketAddr::new(from, 0))
        .expect("bind the client");
    let me = socket.local_addr().expect("client address");
    match socket.connect(vip).await {
        Ok(mut s) => assert!(ends_with_reset(&mut s).await, "not reset"),
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
    me
}

/// A connection that both sides close: every field of the line.
#[tokio::test]
async fn a_normal_close_names_everything() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let d = Logged::tcp(&net, "", &[11], "log_connections = \"all\"").await;
    let mut s = served_client(&net).await;
    let me = s.local_addr().unwrap();
    s.write_all(b"hello").await.unwrap();
    s.shutdown().await.unwrap();
    assert!(!ends_with_reset(&mut s).await);
    let line = d.line_of(me).await;
    assert_eq!(line["message"], "connection");
    assert_eq!(line["state"], "closed");
    assert_eq!(line["vip"], vip(&net).to_string());
    assert_eq!(line["load_balancer"], LB);
    assert_eq!(line["cluster"], "guest");
    assert_eq!(line["listener"], "http");
    assert_eq!(line["backend"], node(&net, 11).to_string());
    assert_eq!(line["tried"], "-");
    assert_eq!(line["bytes_from_client"], 5);
    let name_line = net.ip_str(11).len() as u64 + 1;
    assert_eq!(line["bytes_from_backend"], name_line + 5);
    let connect = line["connect_ms"].as_i64().expect("connect_ms");
    let duration = line["duration_ms"].as_i64().expect("duration_ms");
    assert!(connect >= 0 && connect <= duration, "{line}");
    let accepted = line["accepted"].as_str().expect("accepted");
    assert!(
        accepted.len() == 24 && accepted.ends_with('Z') && accepted.as_bytes()[10] == b'T',
        "accepted is RFC 3339 UTC: {accepted}"
    );
}

/// `"errors"` leaves out a normal close and writes a client's reset.
#[tokio::test]
async fn a_client_reset_is_logged_and_a_normal_close_is_not() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let d = Logged::tcp(&net, "", &[11], "log_connections = \"errors\"").await;
    let mut normal = served_client(&net).await;
    let normal_addr = normal.local_addr().unwrap();
    normal.shutdown().await.unwrap();
    assert!(!ends_with_reset(&mut normal).await);
    drop(normal);

    let mut s = served_client(&net).await;
    let me = s.local_addr().unwrap();
    s.write_all(b"abc").await.unwrap();
    let mut echo = [0u8; 3];
    s.read_exact(&mut echo).await.unwrap();
    socket2::SockRef::from(&s)
        .set_linger(Some(Duration::ZERO))
        .unwrap();
    drop(s);
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "client_reset");
    assert_eq!(line["backend"], node(&net, 11).to_string());
    assert_eq!(line["bytes_from_client"], 3);
    // Lines are written as connections end; the normal one ended first.
    assert!(
        !d.connection_lines()
            .iter()
            .any(|l| l["client"] == normal_addr.to_string().as_str()),
        "a normal close was logged under \"errors\""
    );
}

/// A backend that resets its connection.
#[tokio::test]
async fn a_backend_reset() {
    let net = Subnet::new();
    let backend = TcpListener::bind(node(&net, 11)).await.unwrap();
    let resetter = tokio::spawn(async move {
        let (mut s, _) = backend.accept().await.unwrap();
        let mut buf = [0u8; 4];
        s.read_exact(&mut buf).await.unwrap();
        socket2::SockRef::from(&s)
            .set_linger(Some(Duration::ZERO))
            .unwrap();
        drop(s);
    });
    let d = Logged::tcp(&net, "", &[11], "log_connections = \"errors\"").await;
    let mut s = connect_from(net.ip(100), vip(&net)).await.unwrap();
    let me = s.local_addr().unwrap();
    s.write_all(b"ping").await.unwrap();
    assert!(ends_with_reset(&mut s).await, "the reset is passed on");
    resetter.await.unwrap();
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "backend_reset");
    assert_eq!(line["backend"], node(&net, 11).to_string());
    assert_eq!(line["bytes_from_client"], 4);
    assert_eq!(line["bytes_from_backend"], 0);
}

/// Nothing moves for `idle_timeout_seconds`.
#[tokio::test]
async fn an_idle_timeout() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::Hold).await;
    let d = Logged::tcp(
        &net,
        "",
        &[11],
        "log_connections = \"errors\"\nidle_timeout_seconds = 1",
    )
    .await;
    let mut s = connect_from(net.ip(100), vip(&net)).await.unwrap();
    let me = s.local_addr().unwrap();
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "idle_timeout");
    assert!(line["duration_ms"].as_u64().unwrap() >= 1000, "{line}");
    assert!(!ends_with_reset(&mut s).await);
}

/// A stopping daemon whose drain time runs out cuts the connection.
#[tokio::test]
async fn a_drain_that_runs_out() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let d = Logged::tcp(
        &net,
        "[proxy]\ndrain_timeout_seconds = 0",
        &[11],
        "log_connections = \"errors\"",
    )
    .await;
    let s = served_client(&net).await;
    let me = s.local_addr().unwrap();
    d.signal(libc::SIGTERM);
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "drained");
    assert_eq!(line["backend"], node(&net, 11).to_string());
}

/// `on_backend_down = "close"`: the health check fails under an open
/// connection.
#[tokio::test]
async fn a_backend_marked_down() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let health = TcpListener::bind(SocketAddr::new(net.ip(11), 30081))
        .await
        .unwrap();
    let health_task = tokio::spawn(async move {
        loop {
            let _ = health.accept().await;
        }
    });
    let d = Logged::tcp(&net, "", &[11], "log_connections = \"errors\"\non_backend_down = \"close\"\n  [load_balancer.health_check]\n  port = 30081\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1\n")
    .await;
    let mut s = served_client(&net).await;
    let me = s.local_addr().unwrap();
    health_task.abort();
    let _ = health_task.await;
    assert!(ends_with_reset(&mut s).await);
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "backend_down");
    assert_eq!(line["backend"], node(&net, 11).to_string());
}

/// A client outside `source_ranges` is reset at accept.
#[tokio::test]
async fn a_client_outside_source_ranges() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let ranges = format!(
        "log_connections = \"errors\"\nsource_ranges = [\"{}/32\"]",
        net.ip_str(100)
    );
    let d = Logged::tcp(&net, "", &[11], &ranges).await;
    let me = reset_at_once(net.ip(101), vip(&net)).await;
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "source_refused");
    assert_eq!(line["backend"], "-");
    assert_eq!(line["vip"], vip(&net).to_string());
}

/// The load balancer's own share of connections is full: the next client
/// is reset and its line says why.
#[tokio::test]
async fn a_load_balancer_at_its_connection_share() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let d = Logged::tcp(
        &net,
        "",
        &[11],
        "log_connections = \"errors\"\nmax_connections = 1",
    )
    .await;
    // The one connection the share allows. Once in one of several CI runs
    // the first one was reset right after start (not reproduced in 55
    // runs since, loaded or not); it is tried again, bounded, and each
    // reset's logged state is printed, so a recurrence says why.
    let mut first = None;
    for _ in 0..10 {
        let mut c = connect_from(net.ip(100), vip(&net)).await.unwrap();
        match read_line(&mut c).await {
            Ok(name) => {
                assert_eq!(name, net.ip_str(11));
                first = Some(c);
                break;
            }
            Err(e) => {
                let line = d.line_of(c.local_addr().unwrap()).await;
                eprintln!("the first connection ended ({e}); its line: {line}");
            }
        }
    }
    let _first = first.expect("one connection served within the load balancer's share");
    let me = reset_at_once(net.ip(101), vip(&net)).await;
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "connection_cap");
    assert_eq!(line["backend"], "-");
    assert_eq!(line["load_balancer"], LB);
}

/// Every backend is down: nothing to try.
#[tokio::test]
async fn no_eligible_backend() {
    let net = Subnet::new();
    let d = Logged::tcp(&net, "", &[11, 12], "log_connections = \"errors\"\ninitial_state = \"unhealthy\"\n  [load_balancer.health_check]\n  port = 30081\n  period_seconds = 1\n  timeout_seconds = 1\n")
    .await;
    let me = reset_at_once(net.ip(100), vip(&net)).await;
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "no_backend");
    assert_eq!(line["backend"], "-");
    assert_eq!(line["tried"], "-");
}

/// One backend refuses, the other never answers: both are named with why.
#[tokio::test]
async fn connect_failed_on_every_backend() {
    let net = Subnet::new();
    let _hole = BlackHole::new(node(&net, 12));
    let d = Logged::tcp(
        &net,
        "",
        &[11, 12],
        "log_connections = \"errors\"\nconnect_timeout_ms = 300",
    )
    .await;
    let me = reset_at_once(net.ip(100), vip(&net)).await;
    let line = d.line_of(me).await;
    assert_eq!(line["state"], "connect_failed");
    assert_eq!(line["backend"], "-");
    let tried = line["tried"].as_str().unwrap();
    let mut parts: Vec<&str> = tried.split(',').collect();
    parts.sort_unstable();
    assert_eq!(
        parts,
        [
            format!("{}/refused", node(&net, 11)),
            format!("{}/timeout", node(&net, 12))
        ],
        "{line}"
    );
    assert_eq!(line["connect_ms"], -1);
}

/// A backend that refuses before one that takes the connection: the line
/// names both.
#[tokio::test]
async fn a_retry_names_the_backend_tried_before() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 12), Behaviour::Echo).await;
    let d = Logged::tcp(
        &net,
        "",
        &[11, 12],
        "log_connections = \"all\"\nalgorithm = \"round_robin\"",
    )
    .await;
    // Round robin starts the two clients on different backends: one of
    // them tries .11 first.
    let mut seen_retry = false;
    for _ in 0..2 {
        let mut s = connect_from(net.ip(100), vip(&net)).await.unwrap();
        let me = s.local_addr().unwrap();
        s.write_all(b"x").await.unwrap();
        s.shutdown().await.unwrap();
        assert!(!ends_with_reset(&mut s).await);
        let line = d.line_of(me).await;
        assert_eq!(line["state"], "closed");
        assert_eq!(line["backend"], node(&net, 12).to_string());
        if line["tried"] != "-" {
            assert_eq!(line["tried"], format!("{}/refused", node(&net, 11)));
            seen_retry = true;
        }
    }
    assert!(
        seen_retry,
        "no client was sent to the refusing backend first"
    );
}

/// Past `max_connection_lines_per_second` lines are counted, not written.
#[tokio::test]
async fn lines_past_the_bound_are_counted_not_written() {
    let net = Subnet::new();
    let ranges = format!(
        "log_connections = \"errors\"\nsource_ranges = [\"{}/32\"]",
        net.ip_str(100)
    );
    let d = Logged::tcp(
        &net,
        "[log]\nmax_connection_lines_per_second = 1",
        &[11],
        &ranges,
    )
    .await;
    const CLIENTS: usize = 20;
    for _ in 0..CLIENTS {
        if let Ok(mut s) = connect_from(net.ip(101), vip(&net)).await {
            let _ = ends_with_reset(&mut s).await;
        }
    }
    let admin = d.admin;
    let dropped = wait_for(WAIT, "every refusal to be written or counted", || {
        let written = d.connection_lines().len();
        async move {
            let (_, body) = http(admin, "GET", "/metrics").await;
            let dropped =
                metric_value(&body, "harvester_lb_connection_log_lines_dropped_total") as usize;
            (written + dropped == CLIENTS).then_some(dropped)
        }
    })
    .await;
    assert!(dropped > 0, "20 refusals fit a budget of one a second");
}

/// Text format: a name with a newline or an escape sequence cannot forge
/// a line or colour the terminal.
#[tokio::test]
async fn hostile_names_stay_on_one_line_in_text() {
    // `check` refuses control characters in names, so what a name can
    // still hold is a quote: it must not close the field and let the rest
    // pass for fields of their own (`state=closed` here).
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let text = config(&net, "", &[11], "log_connections = \"all\"").replace(
        "cluster = \"guest\"",
        "cluster = 'guest\\\" FORGED=1 state=closed'",
    );
    let d = Logged::start(&net, &text, "text").await;
    let mut s = served_client(&net).await;
    let me = s.local_addr().unwrap().to_string();
    s.shutdown().await.unwrap();
    assert!(!ends_with_reset(&mut s).await);
    let line = wait_for(WAIT, "the text line", || {
        let found = d
            .raw()
            .into_iter()
            .find(|l| l.contains("harvester_lb::connection") && l.contains(&me));
        async move { found }
    })
    .await;
    assert!(
        line.contains(r#"cluster="guest\\\" FORGED=1 state=closed""#),
        "{line}"
    );
    assert_eq!(line.matches("state=").count(), 2, "{line}");
    assert!(line.contains("state=closed") && line.contains(&format!("client={me}")));
}

/// `config` with a UDP listener instead of the TCP one.
fn udp_config(net: &Subnet, top: &str, extra: &str) -> String {
    web(
        net,
        top,
        &[11],
        extra,
        Listener::new("http", 8080, 30080).udp(),
    )
}

/// A UDP backend on `.11:30080` that echoes each datagram if `answer`.
async fn udp_backend(net: &Subnet, answer: bool) -> tokio::task::JoinHandle<()> {
    let socket = tokio::net::UdpSocket::bind(node(net, 11)).await.unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 2048];
        while let Ok((n, from)) = socket.recv_from(&mut buf).await {
            if answer {
                let _ = socket.send_to(&buf[..n], from).await;
            }
        }
    })
}

async fn udp_client(net: &Subnet) -> tokio::net::UdpSocket {
    let s = tokio::net::UdpSocket::bind(SocketAddr::new(net.ip(100), 0))
        .await
        .unwrap();
    s.connect(vip(net)).await.unwrap();
    s
}

/// A flow closed by its answer (`udp_responses = 1`), as DNS's.
#[tokio::test]
async fn a_udp_flow_answered() {
    let net = Subnet::new();
    let backend = udp_backend(&net, true).await;
    let d = Logged::udp(&net, "", "log_connections = \"all\"\nudp_responses = 1").await;
    let c = udp_client(&net).await;
    c.send(b"query").await.unwrap();
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(WAIT, c.recv(&mut buf))
        .await
        .expect("answered")
        .unwrap();
    assert_eq!(&buf[..n], b"query");
    let line = d.line_of(c.local_addr().unwrap()).await;
    assert_eq!(line["state"], "answered");
    assert_eq!(line["protocol"], "udp");
    assert_eq!(line["backend"], node(&net, 11).to_string());
    assert_eq!(line["bytes_from_client"], 5);
    assert_eq!(line["bytes_from_backend"], 5);
    backend.abort();
}

/// A flow never answered ends idle, and `"errors"` writes it (an answered
/// flow that ends idle is a normal end for UDP).
#[tokio::test]
async fn a_udp_flow_never_answered() {
    let net = Subnet::new();
    let backend = udp_backend(&net, false).await;
    let d = Logged::udp(
        &net,
        "",
        "log_connections = \"errors\"\nudp_idle_timeout_seconds = 1",
    )
    .await;
    let c = udp_client(&net).await;
    c.send(b"hello?").await.unwrap();
    let line = d.line_of(c.local_addr().unwrap()).await;
    assert_eq!(line["state"], "idle");
    assert_eq!(line["bytes_from_client"], 6);
    assert_eq!(line["bytes_from_backend"], 0);
    backend.abort();
}

/// No room in the flow table: the datagram's line says so.
#[tokio::test]
async fn a_udp_flow_table_full() {
    let net = Subnet::new();
    let backend = udp_backend(&net, true).await;
    let d = Logged::udp(
        &net,
        "[proxy]\nmax_udp_flows = 1",
        "log_connections = \"errors\"",
    )
    .await;
    let first = udp_client(&net).await;
    first.send(b"one").await.unwrap();
    let mut buf = [0u8; 64];
    tokio::time::timeout(WAIT, first.recv(&mut buf))
        .await
        .expect("the first flow is served")
        .unwrap();
    let second = udp_client(&net).await;
    second.send(b"two").await.unwrap();
    let line = d.line_of(second.local_addr().unwrap()).await;
    assert_eq!(line["state"], "table_full");
    assert_eq!(line["backend"], "-");
    backend.abort();
}

/// What a thread has read so far from the pipe that is the daemon's stderr.
struct Drained(std::sync::Arc<std::sync::Mutex<Vec<u8>>>);

impl Drained {
    /// Reads `pipe` on a thread of its own until the daemon closes it.
    fn start(mut pipe: std::io::PipeReader) -> Self {
        use std::io::Read;
        let read = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let into = read.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 64 * 1024];
            while let Ok(n @ 1..) = pipe.read(&mut buf) {
                into.lock().unwrap().extend_from_slice(&buf[..n]);
            }
        });
        Self(read)
    }

    /// The complete lines read so far.
    fn lines(&self) -> Vec<String> {
        let text = String::from_utf8_lossy(&self.0.lock().unwrap()).into_owned();
        let end = text.rfind('\n').map_or(0, |e| e + 1);
        text[..end].lines().map(str::to_string).collect()
    }

    /// The connection lines read so far.
    fn connection_lines(&self) -> usize {
        self.lines()
            .iter()
            .filter(|l| l.contains("\"target\":\"harvester_lb::connection\""))
            .count()
    }
}

/// `count` clients of `vip`, `parallel` at a time, each connecting from
/// `from` and waiting for the daemon to end its connection (the tests'
/// load balancer has no backend: reset at once, one `no_backend` line each).
async fn refused_clients(from: IpAddr, vip: SocketAddr, count: usize, parallel: usize) {
    let each = count / parallel;
    let tasks: Vec<_> = (0..parallel)
        .map(|t| {
            tokio::spawn(async move {
                for i in 0..each {
                    let stalled = |what: &str| {
                        format!(
                            "client {} of task {t} to {vip}: {what} within {WAIT:?}; the daemon has stopped forwarding",
                            i + 1
                        )
                    };
                    let connected = tokio::time::timeout(WAIT, connect_from(from, vip))
                        .await
                        .unwrap_or_else(|_| panic!("{}", stalled("no connection")));
                    let Ok(mut s) = connected else { continue };
                    let mut buf = [0u8; 64];
                    // The reset (or, rarely, an EOF) is what the test waits for.
                    let ended = tokio::time::timeout(WAIT, s.read(&mut buf)).await;
                    assert!(ended.is_ok(), "{}", stalled("not reset"));
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.expect("client task");
    }
}

/// A journal that stops reading stalls no tenant: with stderr a pipe the
/// test holds but does not read and one load balancer logging every
/// connection, thousands of lines later another tenant is still served and
/// `/healthz` answers; the lines past the queue are dropped and counted,
/// and once the pipe is read again one line says how many were lost and
/// nothing more is dropped. Lines queued at a clean stop are written.
#[tokio::test]
async fn a_stalled_stderr_stalls_no_tenant() {
    let net = Subnet::new();
    let _b = Backend::start(node(&net, 11), Behaviour::NameThenEcho).await;
    let chatty = SocketAddr::new(net.ip(1), 8080);
    let quiet = SocketAddr::new(net.ip(2), 8080);
    let text = Config::on(&net)
        // The bound must not be what drops lines here.
        .text("[log]\nmax_connection_lines_per_second = 1000000")
        // No backend: every client is reset at once, one line each.
        .lb(Lb::new("default/chatty", net.ip(1))
            .keys("log_connections = \"all\"")
            .listener(Listener::new("http", 8080, 30080)))
        .lb(Lb::new("default/quiet", net.ip(2))
            .backends(net.ips(&[11]))
            .listener(Listener::new("http", 8080, 30080)))
        .to_string();
    let path = net.write("config.toml", &text);
    let (reader, writer) = std::io::pipe().expect("pipe");
    let mut process = Process::launch(&path)
        .global_args(&["--log-format", "json"])
        .stderr(writer)
        .spawn();
    let admin = SocketAddr::new(net.ip(250), 9901);
    process.wait_ready(admin).await;

    // A pipe holds 64 KiB (~150 of these lines); the queue 4,096 lines.
    const LINES: usize = 6000;
    refused_clients(net.ip(100), chatty, LINES, 8).await;

    // The other tenant is served, and the admin plane answers.
    let mut s = tokio::time::timeout(WAIT, connect_from(net.ip(101), quiet))
        .await
        .expect("the quiet tenant accepts while stderr is not read")
        .expect("connect to the quiet tenant");
    assert_eq!(read_line(&mut s).await.expect("served"), net.ip_str(11));
    drop(s);
    let (code, _) = tokio::time::timeout(WAIT, http(admin, "GET", "/healthz"))
        .await
        .expect("/healthz answers while stderr is not read");
    assert_eq!(code, 200);
    let dropped = || async move {
        let (_, body) = http(admin, "GET", "/metrics").await;
        metric_value(&body, "harvester_lb_log_lines_dropped_total ")
    };
    let lost = dropped().await;
    assert!(
        lost > 0.0,
        "{LINES} lines into a pipe nobody reads: some must be dropped"
    );

    // The journal catches up: one line says how many were lost.
    let drained = Drained::start(reader);
    let note = wait_for(WAIT, "the line that says how many were dropped", || {
        let found = drained
            .lines()
            .into_iter()
            .find(|l| l.contains("log lines dropped while stderr was not being read"));
        async move { found }
    })
    .await;
    let note: Value = serde_json::from_str(&note).expect("a JSON line");
    assert_eq!(note["level"], "WARN", "{note}");
    assert!(note["fields"]["dropped"].as_u64() > Some(0), "{note}");
    eprintln!("{LINES} lines, stderr not read: {lost} dropped; then: {note}");

    // Read again, nothing more is dropped.
    let before = drained.connection_lines();
    let lost = dropped().await;
    const MORE: usize = 200;
    refused_clients(net.ip(100), chatty, MORE, 4).await;
    wait_for(WAIT, "the next clients' lines", || {
        let written = drained.connection_lines();
        async move { (written >= before + MORE).then_some(()) }
    })
    .await;
    assert_eq!(dropped().await, lost, "dropped while stderr was read");

    // A clean stop writes what is queued, its last line included.
    process.signal(libc::SIGTERM);
    assert_eq!(process.exit_code(WAIT).await, 0);
    wait_for(WAIT, "the line of the stop", || {
        let found = drained
            .lines()
            .into_iter()
            .any(|l| l.contains("\"message\":\"stopped\""));
        async move { found.then_some(()) }
    })
    .await;
}

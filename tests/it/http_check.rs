//! HTTP health checks, as kube-proxy's `healthCheckNodePort` is asked for
//! `externalTrafficPolicy: Local`: against the test's own server that
//! imitates kube-proxy's answers and flips between 200 and 503 on command,
//! against broken answers, and against a real nginx.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// kube-proxy's health port for services with `externalTrafficPolicy: Local`.
const HEALTH_PORT: u16 = 10256;

/// How the imitated health server answers.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum Answer {
    /// kube-proxy with a ready local endpoint: 200 and its JSON body.
    Ready,
    /// kube-proxy without one: 503 and its JSON body.
    NotReady,
    /// Something that is not HTTP (an SSH banner).
    Garbage,
    /// A status line, then header fields that never end.
    EndlessHead,
    /// Reads the request and closes without a byte.
    CloseEarly,
    /// Reads the request and never answers.
    Silent,
}

impl Answer {
    fn from_u8(n: u8) -> Self {
        [
            Self::Ready,
            Self::NotReady,
            Self::Garbage,
            Self::EndlessHead,
            Self::CloseEarly,
            Self::Silent,
        ][usize::from(n)]
    }
}

/// A tiny HTTP server in the role of kube-proxy's health server: answers as
/// told, records every request head it gets.
struct HealthServer {
    answer: Arc<AtomicU8>,
    requests: Arc<Mutex<Vec<String>>>,
    task: JoinHandle<()>,
}

impl HealthServer {
    async fn start(addr: SocketAddr, answer: Answer) -> Self {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind health server {addr}: {e}"));
        let mode = Arc::new(AtomicU8::new(answer as u8));
        let requests = Arc::new(Mutex::new(Vec::new()));
        let (m, r) = (Arc::clone(&mode), Arc::clone(&requests));
        let task = tokio::spawn(async move {
            loop {
                let Ok((s, _)) = listener.accept().await else {
                    continue;
                };
                let (m, r) = (Arc::clone(&m), Arc::clone(&r));
                tokio::spawn(async move {
                    let _ = answer_one(s, &m, &r).await;
                });
            }
        });
        Self {
            answer: mode,
            requests,
            task,
        }
    }

    fn set(&self, answer: Answer) {
        self.answer.store(answer as u8, Ordering::SeqCst);
    }

    fn requests(&self) -> Vec<String> {
        self.requests.lock().unwrap().clone()
    }
}

impl Drop for HealthServer {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// kube-proxy's answer (pkg/proxy/healthcheck): JSON naming the service and
/// counting the node's ready endpoints.
fn kube_proxy_answer(ready: bool) -> String {
    let body = format!(
        "{{\n  \"service\": {{\n    \"namespace\": \"default\",\n    \"name\": \"web\"\n  }},\n  \"localEndpoints\": {},\n  \"serviceProxyHealthy\": true\n}}",
        u8::from(ready)
    );
    let status = if ready {
        "200 OK"
    } else {
        "503 Service Unavailable"
    };
    format!(
        "HTTP/1.1 {status}\r\nContent-Type: application/json\r\nX-Content-Type-Options: nosniff\r\nDate: Mon, 23 Nov 2026 05:00:00 GMT\r\nContent-Length: {}\r\n\r\n{body}",
        body.len()
    )
}

async fn answer_one(
    mut s: TcpStream,
    mode: &AtomicU8,
    requests: &Mutex<Vec<String>>,
) -> std::io::Result<()> {
    let mut head = Vec::new();
    let mut buf = [0u8; 1024];
    while !head.ends_with(b"\r\n\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf))
            .await
            .map_err(|_| std::io::Error::other("no request head within 5 s"))??;
        if n == 0 || head.len() > 16 * 1024 {
            return Ok(());
        }
        head.extend_from_slice(&buf[..n]);
    }
    requests
        .lock()
        .unwrap()
        .push(String::from_utf8_lossy(&head).into_owned());
    match Answer::from_u8(mode.load(Ordering::SeqCst)) {
        Answer::Ready => s.write_all(kube_proxy_answer(true).as_bytes()).await?,
        Answer::NotReady => s.write_all(kube_proxy_answer(false).as_bytes()).await?,
        Answer::Garbage => s.write_all(b"SSH-2.0-OpenSSH_9.2p1\r\n").await?,
        Answer::EndlessHead => {
            s.write_all(b"HTTP/1.1 200 OK\r\n").await?;
            let line = format!("X-Padding: {}\r\n", "x".repeat(100));
            // Until the probe gives up and closes (the write then fails),
            // or 1 MiB: far past any bound a prober may have.
            for _ in 0..10_000 {
                s.write_all(line.as_bytes()).await?;
            }
        }
        Answer::CloseEarly => return Ok(()),
        Answer::Silent => {
            // Until the probe gives up.
            while s.read(&mut buf).await? > 0 {}
            return Ok(());
        }
    }
    // Connection: close was asked: close after the answer, as servers do.
    s.shutdown().await
}

/// The config header and one load balancer per `(name, vip host, port,
/// backend hosts, health-check lines)`; nodes serve on 30080.
fn config(net: &Subnet, lbs: &[(&str, u8, u16, &[u8], &str)]) -> String {
    let mut c = Config::new().admin(SocketAddr::new(net.ip(250), 9901));
    for (name, vip, port, backends, check) in lbs {
        c = c.lb(Lb::new(name, net.ip(*vip))
            .backends(net.ips(backends))
            .tcp("http", *port, 30080)
            .health(&format!(
                "  kind = \"http\"\n  port = {HEALTH_PORT}\n  period_seconds = 1\n  timeout_seconds = 1\n{check}"
            )));
    }
    c.to_string()
}

/// Where the users of this file connect; every node runs a name-telling
/// service on 30080 and a health server on [`HEALTH_PORT`].
async fn nodes(net: &Subnet, hosts: &[u8], answer: Answer) -> Vec<(Backend, HealthServer)> {
    let mut v = Vec::new();
    for h in hosts {
        v.push((
            Backend::start(SocketAddr::new(net.ip(*h), 30080), Behaviour::NameThenEcho).await,
            HealthServer::start(SocketAddr::new(net.ip(*h), HEALTH_PORT), answer).await,
        ));
    }
    v
}

/// Which backends `n` connections through `vip` reach.
async fn reached(vip: SocketAddr, n: usize) -> std::collections::BTreeSet<String> {
    let mut names = std::collections::BTreeSet::new();
    for _ in 0..n {
        names.insert(whoami(vip).await.expect("served through the VIP"));
    }
    names
}

fn checks_total(lb: &str, ip: &str, result: &str) -> String {
    format!(
        "harvester_lb_health_checks_total{{cluster=\"kubernetes\",load_balancer=\"{lb}\",backend=\"{ip}\",result=\"{result}\"}}"
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_whose_kube_proxy_answers_503_loses_its_traffic_and_gets_it_back_on_200() {
    let net = Subnet::new();
    let nodes = nodes(&net, &[11, 12], Answer::Ready).await;
    let lb = "default/web";
    let cfg = config(
        &net,
        &[(
            lb,
            1,
            8080,
            &[11, 12],
            "  failure_threshold = 2\n  success_threshold = 2\n",
        )],
    );
    let d = Daemon::start(&net, &cfg).await;
    let vip = SocketAddr::new(net.ip(1), 8080);
    let (ip_a, ip_b) = (net.ip_str(11), net.ip_str(12));
    for ip in [&ip_a, &ip_b] {
        wait_for(Duration::from_secs(5), "an ok HTTP probe", || async {
            (d.backend_status(lb, ip).await["probe"]["last_result"] == "ok").then_some(())
        })
        .await;
    }
    assert_eq!(reached(vip, 4).await, [ip_a.clone(), ip_b.clone()].into());

    // The node's last ready endpoint goes: kube-proxy answers 503.
    nodes[1].1.set(Answer::NotReady);
    let b = d
        .wait_health(lb, &ip_b, "unhealthy", Duration::from_secs(6))
        .await;
    assert_eq!(b["probe"]["last_result"], "http_status", "{b}");
    assert_eq!(
        b["probe"]["last_error"], "HTTP status 503 Service Unavailable; expected 200",
        "{b}"
    );
    assert!(
        b["probe"]["consecutive_failures"].as_u64() >= Some(2),
        "{b}"
    );
    assert_eq!(reached(vip, 6).await, [ip_a.clone()].into());
    assert!(
        d.metric_sample(&checks_total(lb, &ip_b, "http_status"))
            .await
            .is_some_and(|v| v >= 2.0)
    );
    assert_eq!(
        d.metric_sample(&checks_total(lb, &ip_a, "http_status"))
            .await,
        None,
        "no failed probe of the healthy backend (no sample: none counted)"
    );

    // An endpoint is ready again: two 200s bring the node back.
    nodes[1].1.set(Answer::Ready);
    let b = d
        .wait_health(lb, &ip_b, "healthy", Duration::from_secs(6))
        .await;
    assert_eq!(b["probe"]["last_result"], "ok", "{b}");
    assert_eq!(b["probe"]["last_error"], serde_json::Value::Null, "{b}");
    assert_eq!(reached(vip, 4).await, [ip_a.clone(), ip_b.clone()].into());
    let (_, body) = d.get("/metrics").await;
    let to = |dir: &str| {
        metric_value(
            &body,
            &format!(
                "harvester_lb_health_transitions_total{{cluster=\"kubernetes\",load_balancer=\"{lb}\",backend=\"{ip_b}\",to=\"{dir}\"}}"
            ),
        )
    };
    assert_eq!((to("down"), to("up")), (1.0, 1.0));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_that_are_not_http_are_http_errors_and_silence_is_a_timeout() {
    let net = Subnet::new();
    let cases = [
        (11, Answer::Garbage, "http_error", "malformed response head"),
        (
            12,
            Answer::EndlessHead,
            "http_error",
            "response head longer than 4096 bytes",
        ),
        (
            13,
            Answer::CloseEarly,
            "http_error",
            "connection closed before a status line",
        ),
        (14, Answer::Silent, "timeout", "timed out"),
    ];
    let mut servers = Vec::new();
    for (host, answer, _, _) in cases {
        servers.push(HealthServer::start(SocketAddr::new(net.ip(host), HEALTH_PORT), answer).await);
    }
    let lb = "default/broken";
    let d = Daemon::start(
        &net,
        &config(
            &net,
            &[(lb, 1, 8080, &[11, 12, 13, 14], "  failure_threshold = 1\n")],
        ),
    )
    .await;
    for (host, _, result, says) in cases {
        let ip = net.ip_str(host);
        let b = d
            .wait_health(lb, &ip, "unhealthy", Duration::from_secs(5))
            .await;
        assert_eq!(b["probe"]["last_result"], result, "{b}");
        let error = b["probe"]["last_error"].as_str().unwrap_or_default();
        assert!(error.contains(says), "{ip}: {error}");
        assert!(
            d.metric_sample(&checks_total(lb, &ip, result))
                .await
                .is_some_and(|v| v >= 1.0)
        );
    }
    let garbage = d.backend_status(lb, &net.ip_str(11)).await;
    assert_eq!(
        garbage["probe"]["last_error"],
        "malformed response head (invalid HTTP version): \"SSH-2.0-OpenSSH_9.2p1\\r\""
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_path_and_host_arrive_as_configured_and_the_default_host_is_the_node() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12], Answer::Ready).await;
    let custom = "  path = \"/healthz/web?verbose=1\"\n  host = \"web.default.svc:10256\"\n";
    let cfg = config(
        &net,
        &[
            ("default/custom", 1, 8080, &[11], custom),
            ("default/plain", 2, 8080, &[12], ""),
        ],
    );
    let d = Daemon::start(&net, &cfg).await;
    let version = env!("CARGO_PKG_VERSION");
    let first_request = |host: u8| {
        let server = &_nodes[usize::from(host - 11)].1;
        async move { server.requests().into_iter().next() }
    };
    let got = wait_for(Duration::from_secs(5), "a probe of .11", || {
        first_request(11)
    })
    .await;
    assert_eq!(
        got,
        format!(
            "GET /healthz/web?verbose=1 HTTP/1.1\r\nHost: web.default.svc:10256\r\nUser-Agent: harvester-lb/{version}\r\nConnection: close\r\n\r\n"
        )
    );
    let got = wait_for(Duration::from_secs(5), "a probe of .12", || {
        first_request(12)
    })
    .await;
    assert_eq!(
        got,
        format!(
            "GET /healthz HTTP/1.1\r\nHost: {}:{HEALTH_PORT}\r\nUser-Agent: harvester-lb/{version}\r\nConnection: close\r\n\r\n",
            net.ip_str(12)
        )
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_ipv6_node_is_asked_with_its_bracketed_address_as_host() {
    let net = Subnet::new();
    let port = free_port_v6();
    let server = HealthServer::start(
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, port)),
        Answer::NotReady,
    )
    .await;
    let cfg = Config::new().admin(SocketAddr::new(net.ip(250), 9901)).lb(
        Lb::new("default/v6", net.ip(1))
            .backends(["::1"])
            .tcp("http", 8080, 30080)
            .health(&format!(
                "  kind = \"http\"\n  port = {port}\n  failure_threshold = 1\n  period_seconds = 1\n  timeout_seconds = 1"
            )),
    );
    let d = Daemon::start(&net, &cfg).await;
    let b = d
        .wait_health("default/v6", "::1", "unhealthy", Duration::from_secs(5))
        .await;
    assert_eq!(b["probe"]["last_result"], "http_status", "{b}");
    let got = server.requests().into_iter().next().expect("a request");
    assert!(
        got.contains(&format!("\r\nHost: [::1]:{port}\r\n")),
        "{got}"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancers_with_the_same_http_check_share_one_probe_and_other_paths_do_not() {
    let net = Subnet::new();
    let nodes = nodes(&net, &[11], Answer::Ready).await;
    let ip = net.ip_str(11);
    // Two services of one guest cluster, both Local, asking the same node
    // the same question; their thresholds differ, which does not matter.
    let shared = [
        ("default/a", 1, 8080, &[11][..], "  failure_threshold = 1\n"),
        ("default/b", 2, 8080, &[11][..], "  failure_threshold = 3\n"),
    ];
    let d = Daemon::start(&net, &config(&net, &shared)).await;
    for lb in ["default/a", "default/b"] {
        wait_for(Duration::from_secs(5), "an ok probe", || async {
            (d.backend_status(lb, &ip).await["probe"]["last_result"] == "ok").then_some(())
        })
        .await;
    }
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 1.0);
    // One request a period for both, not two.
    let before = nodes[0].1.requests().len();
    let probes_before = d.backend_status("default/a", &ip).await["probe"]["probes"]
        .as_u64()
        .unwrap();
    wait_for(Duration::from_secs(10), "three more probes", || async {
        let probes = d.backend_status("default/a", &ip).await["probe"]["probes"]
            .as_u64()
            .unwrap();
        (probes >= probes_before + 3).then_some(())
    })
    .await;
    let a = d.backend_status("default/a", &ip).await["probe"]["probes"]
        .as_u64()
        .unwrap();
    let sent = (nodes[0].1.requests().len() - before) as u64;
    let taken = a - probes_before;
    assert!(
        sent.abs_diff(taken) <= 1,
        "{sent} requests reached the node for {taken} probes of each load balancer"
    );

    // A third service asking another path is another probe; the same path
    // with other expected statuses is too.
    let mut more = shared.to_vec();
    more.push(("default/c", 3, 8080, &[11][..], "  path = \"/livez\"\n"));
    more.push((
        "default/d",
        4,
        8080,
        &[11][..],
        "  expect_status = [\"200-299\"]\n",
    ));
    std::fs::write(&d.config, config(&net, &more)).unwrap();
    let (code, body) = http(d.admin, "POST", "/reload").await;
    assert_eq!(code, 200, "{body}");
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 3.0);
    wait_for(Duration::from_secs(5), "a request for /livez", || async {
        nodes[0]
            .1
            .requests()
            .iter()
            .any(|r| r.starts_with("GET /livez "))
            .then_some(())
    })
    .await;
    d.stop().await;
}

/// nginx, run by the test as a peer on a loopback address: `master_process
/// off` keeps it one process, so stopping it by its pid stops all of it.
struct Nginx {
    child: std::process::Child,
    error_log: std::path::PathBuf,
}

impl Nginx {
    /// Starts nginx with `server` (one `server { … }` block) in `dir` and
    /// waits until it accepts on `listen`; `None` (through
    /// [`skip_or_fail`], the caller returns) if nginx is not installed.
    async fn start(dir: &std::path::Path, server: &str, listen: SocketAddr) -> Option<Self> {
        let Some(binary) = find_tool("nginx") else {
            skip_or_fail(
                "nginx health check",
                "nginx is not installed (.ci/run installs it); this test needs a real nginx",
            );
            return None;
        };
        let dir = dir.join("nginx");
        std::fs::create_dir_all(&dir).expect("nginx dir");
        let d = dir.display();
        let conf = format!(
            r#"
master_process off;
worker_processes 1;
pid {d}/nginx.pid;
error_log {d}/error.log info;
events {{ worker_connections 64; }}
http {{
    access_log {d}/access.log;
    client_body_temp_path {d}/client_body;
    proxy_temp_path {d}/proxy;
    fastcgi_temp_path {d}/fastcgi;
    uwsgi_temp_path {d}/uwsgi;
    scgi_temp_path {d}/scgi;
    {server}
}}
"#
        );
        let file = dir.join("nginx.conf");
        std::fs::write(&file, conf).expect("write nginx.conf");
        let error_log = dir.join("error.log");
        let child = std::process::Command::new(&binary)
            .arg("-p")
            .arg(&dir)
            .arg("-e")
            .arg(&error_log)
            .arg("-c")
            .arg(&file)
            .args(["-g", "daemon off;"])
            .stdin(std::process::Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("run {}: {e}", binary.display()));
        let nginx = Self { child, error_log };
        wait_for(Duration::from_secs(10), "nginx to listen", || async {
            TcpStream::connect(listen).await.ok().map(|_| ())
        })
        .await;
        Some(nginx)
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.error_log).unwrap_or_default()
    }
}

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: nginx's fast shutdown; then reap it, killing it if it lingers.
        if let Ok(pid) = i32::try_from(self.child.id()) {
            // SAFETY: kill(2) touches no memory of ours; the pid is our own
            // child, not reaped yet, so it cannot name another process.
            unsafe {
                libc::kill(pid, libc::SIGTERM);
            }
        }
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        while std::time::Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_answering_503_from_one_location_and_200_from_another_is_judged_by_its_status() {
    let net = Subnet::new();
    let health = SocketAddr::new(net.ip(11), HEALTH_PORT);
    let server = format!(
        r#"server {{
        listen {health};
        location = /healthz {{
            default_type application/json;
            return 200 '{{"service":{{"namespace":"default","name":"up"}},"localEndpoints":1}}';
        }}
        location = /drained {{
            default_type application/json;
            return 503 '{{"service":{{"namespace":"default","name":"down"}},"localEndpoints":0}}';
        }}
        location = /moved {{
            return 302 /healthz;
        }}
    }}"#
    );
    let Some(nginx) = Nginx::start(net.dir(), &server, health).await else {
        return;
    };
    let _node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let cfg = config(
        &net,
        &[
            ("default/up", 1, 8080, &[11], "  failure_threshold = 1\n"),
            (
                "default/down",
                2,
                8080,
                &[11],
                "  path = \"/drained\"\n  failure_threshold = 1\n",
            ),
            (
                "default/redirect-ok",
                3,
                8080,
                &[11],
                "  path = \"/moved\"\n  expect_status = [\"200-399\"]\n  failure_threshold = 1\n",
            ),
        ],
    );
    let d = Daemon::start(&net, &cfg).await;
    let ip = net.ip_str(11);
    let down = d
        .wait_health("default/down", &ip, "unhealthy", Duration::from_secs(5))
        .await;
    assert_eq!(down["probe"]["last_result"], "http_status", "{down}");
    assert_eq!(
        down["probe"]["last_error"],
        "HTTP status 503 Service Temporarily Unavailable; expected 200",
        "{down}\nnginx log:\n{}",
        nginx.log()
    );
    for lb in ["default/up", "default/redirect-ok"] {
        let b = wait_for(
            Duration::from_secs(5),
            "ok probes through nginx",
            || async {
                let b = d.backend_status(lb, &ip).await;
                (b["probe"]["last_result"] == "ok" && b["probe"]["probes"].as_u64() >= Some(2))
                    .then_some(b)
            },
        )
        .await;
        assert_eq!(b["health"], "healthy", "{lb}: {b}");
    }
    // Traffic follows the verdicts: the drained service refuses clients,
    // the other reaches the node.
    assert_eq!(whoami(SocketAddr::new(net.ip(1), 8080)).await.unwrap(), ip);
    assert!(whoami(SocketAddr::new(net.ip(2), 8080)).await.is_err());
    d.stop().await;
    // nginx saw clean requests: every probe logged with its status, none
    // cut short (nginx logs 499 for a client that closed first).
    let access = std::fs::read_to_string(net.dir().join("nginx/access.log")).unwrap();
    assert!(access.contains("\"GET /drained HTTP/1.1\" 503"), "{access}");
    assert!(access.contains("\"GET /healthz HTTP/1.1\" 200"), "{access}");
    assert!(access.contains("\"harvester-lb/"), "{access}");
    assert!(!access.contains("\" 499 "), "{access}");
    drop(nginx);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_from_tcp_to_http_moves_the_node_to_the_http_probe_and_back() {
    let net = Subnet::new();
    // kube-proxy listens on every node, endpoint or not: the TCP handshake
    // succeeds where the HTTP answer is 503.
    let nodes = nodes(&net, &[11], Answer::NotReady).await;
    let lb = "default/web";
    let ip = net.ip_str(11);
    let http_cfg = config(&net, &[(lb, 1, 8080, &[11], "  failure_threshold = 1\n")]);
    let tcp = http_cfg.replace("  kind = \"http\"\n", "  kind = \"tcp\"\n");
    let d = Daemon::start(&net, &tcp).await;
    wait_for(Duration::from_secs(5), "an ok TCP probe", || async {
        (d.backend_status(lb, &ip).await["probe"]["last_result"] == "ok").then_some(())
    })
    .await;
    assert!(
        nodes[0].1.requests().is_empty(),
        "a TCP probe sends nothing"
    );
    let reload = |text: String| {
        let d = &d;
        async move {
            std::fs::write(&d.config, text).unwrap();
            let (code, body) = http(d.admin, "POST", "/reload").await;
            assert_eq!(code, 200, "{body}");
        }
    };
    reload(http_cfg.clone()).await;
    let b = d
        .wait_health(lb, &ip, "unhealthy", Duration::from_secs(5))
        .await;
    assert_eq!(b["probe"]["last_result"], "http_status", "{b}");
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 1.0);
    reload(tcp).await;
    let b = d
        .wait_health(lb, &ip, "healthy", Duration::from_secs(5))
        .await;
    assert_eq!(b["probe"]["last_result"], "ok", "{b}");
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 1.0);
    d.stop().await;
}

/// An ingress that takes nothing without a PROXY header (nginx `listen …
/// proxy_protocol`, as ingress-nginx with `use-proxy-protocol`): its health
/// endpoint is healthy only to a check with `send_proxy = true`, which sends
/// a v2 `LOCAL` header first.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn send_proxy_reaches_a_health_endpoint_that_requires_the_header() {
    let net = Subnet::new();
    let health = SocketAddr::new(net.ip(11), HEALTH_PORT);
    let server = format!(
        r#"server {{
        listen {health} proxy_protocol;
        location = /healthz {{ return 200 'ok'; }}
    }}"#
    );
    let Some(nginx) = Nginx::start(net.dir(), &server, health).await else {
        return;
    };
    let _node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let cfg = config(
        &net,
        &[
            (
                "default/with-header",
                1,
                8080,
                &[11],
                "  send_proxy = true\n  failure_threshold = 1\n",
            ),
            (
                "default/without",
                2,
                8080,
                &[11],
                "  failure_threshold = 1\n",
            ),
        ],
    );
    let d = Daemon::start(&net, &cfg).await;
    let ip = net.ip_str(11);
    let without = d
        .wait_health("default/without", &ip, "unhealthy", Duration::from_secs(5))
        .await;
    assert_eq!(without["probe"]["last_result"], "http_error", "{without}");
    let with = wait_for(
        Duration::from_secs(5),
        "ok probes with the header",
        || async {
            let b = d.backend_status("default/with-header", &ip).await;
            (b["probe"]["last_result"] == "ok" && b["probe"]["probes"].as_u64() >= Some(2))
                .then_some(b)
        },
    )
    .await;
    assert_eq!(
        with["health"],
        "healthy",
        "{with}\nnginx log:\n{}",
        nginx.log()
    );
    // The two checks differ only in the header: two probe streams.
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 2.0);
    d.stop().await;
}

//! The data plane end to end on loopback: real daemon, real backends, real
//! sockets. Each test owns a 127.A.B.0/24 (see `support`).

use crate::support;

use std::collections::HashMap;
use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LB: &str = "default/web";

/// A config with one load balancer on `.1:8080` forwarding to `backends` on port 30080.
fn config(net: &Subnet, backends: &[u8], extra_lb: &str, health: Option<&str>) -> Config {
    let mut lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(backends))
        .keys(extra_lb)
        .tcp("http", 8080, 30080);
    if let Some(h) = health {
        lb = lb.health(&format!("  port = 30080\n{h}"));
    }
    Config::on(net).lb(lb)
}

/// Load balancer `name` on `.vip:8080` to `.11:30080`, as most tests add a second one.
fn other_lb(net: &Subnet, name: &str, vip: u8) -> Lb {
    Lb::new(name, net.ip(vip))
        .backends([net.ip(11)])
        .tcp("http", 8080, 30080)
}

fn vip(net: &Subnet) -> SocketAddr {
    SocketAddr::new(net.ip(1), 8080)
}

fn backend_addr(net: &Subnet, host: u8) -> SocketAddr {
    SocketAddr::new(net.ip(host), 30080)
}

/// Connects to the VIP and asserts the load balancer closes the connection
/// (EOF or reset) within `within`, without data. The reset may already be
/// seen by `connect` itself: the daemon can reset before the client looks.
async fn assert_refused_quickly(vip: SocketAddr, within: Duration) {
    match TcpStream::connect(vip).await {
        Ok(s) => assert_closed_quickly(s, within).await,
        Err(e) => assert_eq!(e.kind(), std::io::ErrorKind::ConnectionReset, "{e}"),
    }
}

/// Asserts the connection is closed (EOF or reset) within `within`, without data.
async fn assert_closed_quickly(mut s: TcpStream, within: Duration) {
    let mut buf = [0u8; 16];
    match tokio::time::timeout(within, s.read(&mut buf)).await {
        Ok(Ok(0)) | Ok(Err(_)) => {}
        Ok(Ok(n)) => panic!("expected a closed connection, got {n} bytes"),
        Err(_) => panic!("connection still open after {within:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn round_robin_spreads_connections_evenly() {
    let net = Subnet::new();
    let _b: Vec<Backend> = futures_start(&net, &[11, 12, 13], Behaviour::NameThenEcho).await;
    let d = Daemon::start(&net, &config(&net, &[11, 12, 13], "", None)).await;

    let mut counts: HashMap<String, usize> = HashMap::new();
    for _ in 0..300 {
        let name = whoami(vip(&net)).await.expect("forwarded");
        *counts.entry(name).or_default() += 1;
    }
    assert_eq!(counts.len(), 3, "{counts:?}");
    for (name, n) in &counts {
        assert_eq!(
            *n, 100,
            "round robin over 3 backends, 300 connections: {name} got {n}"
        );
    }
    assert_eq!(
        d.metric(&format!("harvester_lb_connections_accepted_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\"}}"))
            .await,
        300.0
    );
    d.stop().await;
}

async fn futures_start(net: &Subnet, hosts: &[u8], behaviour: Behaviour) -> Vec<Backend> {
    let mut v = Vec::new();
    for h in hosts {
        v.push(Backend::start(backend_addr(net, *h), behaviour).await);
    }
    v
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_backend_is_taken_out_after_its_failure_threshold_and_returns_after_its_success_threshold()
 {
    let net = Subnet::new();
    let a = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let b = Backend::start(backend_addr(&net, 12), Behaviour::NameThenEcho).await;
    let health = "  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 2\n  success_threshold = 2";
    let d = Daemon::start(&net, &config(&net, &[11, 12], "", Some(health))).await;
    let (ip_a, ip_b) = (net.ip_str(11), net.ip_str(12));

    // Both healthy and both taking traffic.
    d.wait_health(LB, &ip_b, "healthy", Duration::from_secs(5))
        .await;
    let mut seen = HashMap::<String, usize>::new();
    for _ in 0..10 {
        *seen.entry(whoami(vip(&net)).await.unwrap()).or_default() += 1;
    }
    assert_eq!(seen.len(), 2, "{seen:?}");

    // Kill B: it goes down after exactly failure_threshold failures.
    b.stop();
    let down = d
        .wait_health(LB, &ip_b, "unhealthy", Duration::from_secs(6))
        .await;
    assert!(
        down["probe"]["consecutive_failures"].as_u64().unwrap() >= 2,
        "{down}"
    );
    assert_eq!(down["probe"]["last_result"], "refused");
    for _ in 0..20 {
        assert_eq!(
            whoami(vip(&net)).await.unwrap(),
            ip_a,
            "traffic must avoid the unhealthy backend"
        );
    }
    assert_eq!(
        d.metric(&format!(
            "harvester_lb_backend_up{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{ip_b}\"}}"
        ))
        .await,
        0.0
    );

    // Bring B back: healthy again only after success_threshold successes.
    let _b2 = Backend::start(backend_addr(&net, 12), Behaviour::NameThenEcho).await;
    let up = d
        .wait_health(LB, &ip_b, "healthy", Duration::from_secs(6))
        .await;
    assert!(
        up["probe"]["consecutive_successes"].as_u64().unwrap() >= 2,
        "{up}"
    );
    let mut back = false;
    for _ in 0..10 {
        back |= whoami(vip(&net)).await.unwrap() == ip_b;
    }
    assert!(back, "traffic returns to the recovered backend");
    let transitions = d
        .metric(&format!(
            "harvester_lb_health_transitions_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{ip_b}\",to=\"down\"}}"
        ))
        .await;
    assert_eq!(transitions, 1.0);
    drop(a);
    d.stop().await;
}

/// A TCP probe is the handshake alone, as HAProxy's: the backend's kernel
/// answers the SYN, the daemon resets, and the application behind the
/// health port never sees a connection, while an answering port still
/// counts as a success and a closed one as refused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_probe_is_a_handshake_the_backend_application_never_accepts() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let health_port = Backend::start(SocketAddr::new(net.ip(11), 30081), Behaviour::Hold).await;
    let cfg = Config::on(&net).lb(Lb::new(LB, net.ip(1))
        .backends([net.ip(11)])
        .tcp("http", 8080, 30080)
        .health("  port = 30081\n  period_seconds = 1\n  timeout_seconds = 1"));
    let d = Daemon::start(&net, &cfg).await;
    let ip = net.ip_str(11);
    let b = wait_for(
        Duration::from_secs(10),
        "three successful probes",
        || async {
            let b = d.backend_status(LB, &ip).await;
            (b["probe"]["consecutive_successes"].as_u64() >= Some(3)).then_some(b)
        },
    )
    .await;
    assert_eq!(b["health"], "healthy", "{b}");
    assert_eq!(
        health_port
            .accepted
            .load(std::sync::atomic::Ordering::SeqCst),
        0,
        "the application behind the health port accepted a probe"
    );
    health_port.stop();
    let down = d
        .wait_health(LB, &ip, "unhealthy", Duration::from_secs(10))
        .await;
    assert_eq!(down["probe"]["last_result"], "refused", "{down}");
    d.stop().await;
}

/// Two load balancers check the same nodes the same way (the common case:
/// every service probes kube-proxy's health port): one probe per node per
/// period serves both, and each judges it with its own thresholds.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn load_balancers_checking_the_same_port_share_one_probe_and_keep_their_own_verdicts() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let health = Backend::start(SocketAddr::new(net.ip(11), 30081), Behaviour::Hold).await;
    let unchecked = |name: &str, vip: u8| other_lb(&net, name, vip);
    let lb = |name: &str, vip: u8, failure: u32| {
        unchecked(name, vip).health(&format!(
            "  port = 30081\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = {failure}"
        ))
    };
    let cfg = Config::on(&net)
        .lb(lb("a/quick", 1, 1))
        .lb(lb("b/patient", 2, 3));
    let d = Daemon::start(&net, &cfg).await;
    let ip = net.ip_str(11);
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 1.0);
    // Both take every result of the one stream: same probe times, same counts.
    let (a, b) = wait_for(Duration::from_secs(10), "two shared probes", || async {
        let a = d.backend_status("a/quick", &ip).await;
        let b = d.backend_status("b/patient", &ip).await;
        let (pa, pb) = (&a["probe"], &b["probe"]);
        (pa["probes"].as_u64() >= Some(2)
            && pa["probes"] == pb["probes"]
            && pa["last_probe_unix"] == pb["last_probe_unix"])
            .then_some((a, b))
    })
    .await;
    assert_eq!(a["health"], "healthy", "{a}");
    assert_eq!(b["health"], "healthy", "{b}");

    health.stop();
    let a = d
        .wait_health("a/quick", &ip, "unhealthy", Duration::from_secs(5))
        .await;
    let b = d.backend_status("b/patient", &ip).await;
    assert_eq!(b["health"], "healthy", "failure_threshold 3 after {a}: {b}");
    assert!(b["probe"]["consecutive_failures"].as_u64() < Some(3), "{b}");
    let b = d
        .wait_health("b/patient", &ip, "unhealthy", Duration::from_secs(6))
        .await;
    assert_eq!(b["probe"]["consecutive_failures"], 3, "{b}");

    // A reload that drops one of them leaves the stream to the other; one
    // that drops the last check stops it.
    let admin = SocketAddr::new(net.ip(250), 9901);
    net.write(
        "config.toml",
        &Config::on(&net).lb(lb("a/quick", 1, 1)).to_string(),
    );
    let (code, body) = http(admin, "POST", "/reload").await;
    assert_eq!(code, 200, "reload: {body}");
    let seen = d.backend_status("a/quick", &ip).await["probe"]["probes"]
        .as_u64()
        .unwrap();
    wait_for(Duration::from_secs(5), "a/quick still probed", || async {
        let n = d.backend_status("a/quick", &ip).await["probe"]["probes"].as_u64();
        (n > Some(seen)).then_some(())
    })
    .await;
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 1.0);
    net.write(
        "config.toml",
        &Config::on(&net).lb(unchecked("a/quick", 1)).to_string(),
    );
    let (code, body) = http(admin, "POST", "/reload").await;
    assert_eq!(code, 200, "reload: {body}");
    assert_eq!(d.metric("harvester_lb_health_check_streams").await, 0.0);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn initial_state_unhealthy_waits_for_success_threshold() {
    let net = Subnet::new();
    let _a = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let health = "  period_seconds = 1\n  timeout_seconds = 1\n  success_threshold = 2";
    let d = Daemon::start(
        &net,
        &config(&net, &[11], "initial_state = \"unhealthy\"", Some(health)),
    )
    .await;
    // Before the second successful probe, nothing is eligible: the client is refused.
    let first = d.backend_status(LB, &net.ip_str(11)).await;
    if first["health"] == "unhealthy" {
        assert_refused_quickly(vip(&net), Duration::from_secs(2)).await;
    }
    let up = d
        .wait_health(LB, &net.ip_str(11), "healthy", Duration::from_secs(5))
        .await;
    assert_eq!(up["probe"]["consecutive_successes"], 2);
    assert_eq!(whoami(vip(&net)).await.unwrap(), net.ip_str(11));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_refusing_backend_costs_the_client_nothing() {
    let net = Subnet::new();
    // .11 has nothing listening (refuses); .12 works. No health check.
    let _b = Backend::start(backend_addr(&net, 12), Behaviour::NameThenEcho).await;
    let d = Daemon::start(&net, &config(&net, &[11, 12], "", None)).await;
    for _ in 0..40 {
        assert_eq!(
            whoami(vip(&net))
                .await
                .expect("retried onto the live backend"),
            net.ip_str(12)
        );
    }
    let refused = d
        .metric(&format!(
            "harvester_lb_backend_connect_failures_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{}\",reason=\"connect_refused\"}}",
            net.ip_str(11)
        ))
        .await;
    assert_eq!(
        refused, 20.0,
        "round robin sends every other connection to the refusing backend first"
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_accepts_nothing_times_out_and_the_next_one_serves() {
    let net = Subnet::new();
    let hole = BlackHole::new(backend_addr(&net, 11));
    let _b = Backend::start(backend_addr(&net, 12), Behaviour::NameThenEcho).await;
    let d = Daemon::start(
        &net,
        &config(&net, &[11, 12], "connect_timeout_ms = 300", None),
    )
    .await;
    for _ in 0..4 {
        assert_eq!(
            whoami(vip(&net)).await.expect("retried after the timeout"),
            net.ip_str(12)
        );
    }
    let timeouts = d
        .metric(&format!(
            "harvester_lb_backend_connect_failures_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{}\",reason=\"connect_timeout\"}}",
            net.ip_str(11)
        ))
        .await;
    assert_eq!(timeouts, 2.0);
    drop(hole);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn when_every_backend_times_out_the_client_is_closed_and_counted() {
    let net = Subnet::new();
    let _hole = BlackHole::new(backend_addr(&net, 11));
    let d = Daemon::start(&net, &config(&net, &[11], "connect_timeout_ms = 200", None)).await;
    assert_refused_quickly(vip(&net), Duration::from_secs(3)).await;
    let failed = d
        .metric(&format!(
            "harvester_lb_connections_failed_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\",reason=\"connect_timeout\"}}"
        ))
        .await;
    assert_eq!(failed, 1.0);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn no_eligible_backend_closes_the_client_at_once() {
    let net = Subnet::new();
    // Nothing listens on the backend: the health check marks it down.
    let health = "  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1";
    let d = Daemon::start(&net, &config(&net, &[11], "", Some(health))).await;
    d.wait_health(LB, &net.ip_str(11), "unhealthy", Duration::from_secs(5))
        .await;
    let started = tokio::time::Instant::now();
    assert_refused_quickly(vip(&net), Duration::from_secs(1)).await;
    let took = started.elapsed();
    let no_backend = d
        .metric(&format!(
            "harvester_lb_connections_failed_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\",reason=\"no_backend\"}}"
        ))
        .await;
    assert_eq!(no_backend, 1.0);
    assert_eq!(
        d.metric(&format!(
            "harvester_lb_no_eligible_backend{{cluster=\"kubernetes\",load_balancer=\"{LB}\"}}"
        ))
        .await,
        1.0
    );
    // The daemon itself is fine.
    assert_eq!(d.get("/readyz").await.0, 200);
    println!("no-backend close took {took:?}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_empty_backend_list_refuses_every_client() {
    let net = Subnet::new();
    let d = Daemon::start(&net, &config(&net, &[], "", None)).await;
    for _ in 0..3 {
        assert_refused_quickly(vip(&net), Duration::from_secs(1)).await;
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn half_close_delivers_the_whole_response() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::CountThenAnswer).await;
    let d = Daemon::start(&net, &config(&net, &[11], "", None)).await;
    let mut s = TcpStream::connect(vip(&net)).await.unwrap();
    let body = vec![7u8; 300_000];
    s.write_all(&body).await.unwrap();
    s.shutdown().await.unwrap(); // our write side only
    let mut answer = String::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_string(&mut answer))
        .await
        .expect("answer within 10 s")
        .expect("read answer");
    assert_eq!(answer, "got 300000 bytes\n");
    d.stop().await;
}

/// Segments this socket has received so far (`tcpi_segs_in` of `TCP_INFO`)
/// and bytes it has sent that are not acknowledged yet.
fn segments_in_and_unacked(s: &TcpStream) -> (u32, u32) {
    use std::os::fd::AsRawFd;
    // SAFETY: an all-zero tcp_info is valid; getsockopt writes at most `len`
    // bytes into it and the descriptor is open for the call.
    #[allow(unsafe_code)]
    let info = unsafe {
        let mut info: libc::tcp_info = std::mem::zeroed();
        let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
        let rc = libc::getsockopt(
            s.as_raw_fd(),
            libc::IPPROTO_TCP,
            libc::TCP_INFO,
            (&mut info as *mut libc::tcp_info).cast(),
            &mut len,
        );
        assert_eq!(rc, 0, "TCP_INFO: {}", std::io::Error::last_os_error());
        info
    };
    (info.tcpi_segs_in, info.tcpi_unacked)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_last_bytes_and_the_end_of_stream_reach_the_client_in_one_segment() {
    // A backend whose answer and FIN arrive together (as from a server that
    // writes its answer and closes) should cost the client one segment, as
    // through HAProxy: not one for the data and one for the FIN, each
    // acknowledged on its own.
    let net = Subnet::new();
    let listener = tokio::net::TcpListener::bind(backend_addr(&net, 11))
        .await
        .unwrap();
    let (answer_now, answer) = tokio::sync::oneshot::channel::<()>();
    let backend = tokio::spawn(async move {
        let (mut s, _) = listener.accept().await.unwrap();
        let mut req = [0u8; 5];
        s.read_exact(&mut req).await.unwrap();
        answer.await.unwrap();
        // Data and FIN in one segment: MSG_MORE holds the data for the FIN.
        let sock = socket2::SockRef::from(&s);
        assert_eq!(
            sock.send_with_flags(b"answer\n", libc::MSG_MORE).unwrap(),
            7
        );
        sock.shutdown(std::net::Shutdown::Write).unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
    });
    let d = Daemon::start(&net, &config(&net, &[11], "", None)).await;
    let mut s = TcpStream::connect(vip(&net)).await.unwrap();
    s.write_all(b"hello").await.unwrap();
    // Once the request is acknowledged nothing else is due to the client
    // until the answer.
    let before = wait_for(Duration::from_secs(5), "the request's ACK", || async {
        let (segs, unacked) = segments_in_and_unacked(&s);
        (unacked == 0).then_some(segs)
    })
    .await;
    answer_now.send(()).unwrap();
    let mut got = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut got))
        .await
        .expect("answer and end of stream within 5 s")
        .unwrap();
    assert_eq!(got, "answer\n");
    let (after, _) = segments_in_and_unacked(&s);
    assert_eq!(
        after - before,
        1,
        "segments that carried the answer and the FIN to the client"
    );
    drop(s);
    tokio::time::timeout(Duration::from_secs(5), backend)
        .await
        .expect("backend sees the end of stream")
        .unwrap();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_backend_that_resets_after_its_answer_resets_the_client_too() {
    // The answer and the reset arrive close together, in either order with
    // the daemon's wake-up: every client must see the reset after the data,
    // never a clean end of stream the backend did not send.
    const ROUNDS: usize = 30;
    let net = Subnet::new();
    let listener = tokio::net::TcpListener::bind(backend_addr(&net, 11))
        .await
        .unwrap();
    let backend = tokio::spawn(async move {
        for _ in 0..ROUNDS {
            let (mut s, _) = listener.accept().await.unwrap();
            let mut req = [0u8; 5];
            s.read_exact(&mut req).await.unwrap();
            s.write_all(b"answer\n").await.unwrap();
            socket2::SockRef::from(&s)
                .set_linger(Some(Duration::ZERO))
                .unwrap();
            drop(s);
        }
    });
    let d = Daemon::start(&net, &config(&net, &[11], "", None)).await;
    for round in 0..ROUNDS {
        let mut s = TcpStream::connect(vip(&net)).await.unwrap();
        s.write_all(b"hello").await.unwrap();
        let mut got = Vec::new();
        let mut buf = [0u8; 64];
        let end = tokio::time::timeout(Duration::from_secs(5), async {
            loop {
                match s.read(&mut buf).await {
                    Ok(0) => return Ok(()),
                    Ok(n) => got.extend_from_slice(&buf[..n]),
                    Err(e) => return Err(e),
                }
            }
        })
        .await
        .expect("the connection ends within 5 s");
        assert!(
            matches!(&end, Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset),
            "round {round}: the client saw {end:?} after {got:?}, not a reset"
        );
        assert!(
            got.is_empty() || got == b"answer\n",
            "round {round}: {got:?}"
        );
    }
    backend.await.unwrap();
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sixty_four_mebibytes_each_way_arrive_byte_exact() {
    const TOTAL: usize = 64 * 1024 * 1024;
    const BLOCK: usize = 64 * 1024;
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::Echo).await;
    let d = Daemon::start(&net, &config(&net, &[11], "", None)).await;
    let s = TcpStream::connect(vip(&net)).await.unwrap();
    let (mut rd, mut wr) = s.into_split();
    let writer = tokio::spawn(async move {
        let mut p = Rng::new(42);
        let mut block = vec![0u8; BLOCK];
        for _ in 0..TOTAL / BLOCK {
            p.fill(&mut block);
            wr.write_all(&block).await.unwrap();
        }
        wr.shutdown().await.unwrap();
    });
    let reader = tokio::spawn(async move {
        let mut p = Rng::new(42);
        let mut expected = vec![0u8; BLOCK];
        let mut got = vec![0u8; BLOCK];
        let mut total = 0usize;
        for _ in 0..TOTAL / BLOCK {
            rd.read_exact(&mut got).await.unwrap();
            p.fill(&mut expected);
            assert!(got == expected, "mismatch in block at offset {total}");
            total += BLOCK;
        }
        let mut rest = Vec::new();
        rd.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{} bytes too many", rest.len());
        total
    });
    let total = tokio::time::timeout(Duration::from_secs(120), async {
        writer.await.unwrap();
        reader.await.unwrap()
    })
    .await
    .expect("transfer within 120 s");
    assert_eq!(total, TOTAL);
    let lbl = format!("cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\"");
    let up = d
        .metric(&format!(
            "harvester_lb_bytes_total{{{lbl},direction=\"client_to_backend\"}}"
        ))
        .await;
    let down = d
        .metric(&format!(
            "harvester_lb_bytes_total{{{lbl},direction=\"backend_to_client\"}}"
        ))
        .await;
    assert_eq!(up, TOTAL as f64);
    assert_eq!(down, TOTAL as f64);
    d.stop().await;
}

/// One connection moves small messages (the copy path through the worker's
/// buffer), then a bulk stream (which switches the direction to `splice`),
/// then small messages again, then half-closes: every byte comes back in
/// order, and the daemon counts exactly what was sent.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn small_messages_then_bulk_then_small_again_stay_in_order() {
    const BULK: usize = 8 * 1024 * 1024;
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::Echo).await;
    let d = Daemon::start(&net, &config(&net, &[11], "", None)).await;
    let mut s = TcpStream::connect(vip(&net)).await.unwrap();
    let mut sent = 0usize;
    let ping_pong = async |s: &mut TcpStream, round: usize| {
        let msg: Vec<u8> = (0..100 + round).map(|i| (i + round) as u8).collect();
        s.write_all(&msg).await.unwrap();
        let mut back = vec![0u8; msg.len()];
        s.read_exact(&mut back).await.unwrap();
        assert_eq!(back, msg, "echo of small message {round}");
        msg.len()
    };
    let exchange = async {
        for round in 0..50 {
            sent += ping_pong(&mut s, round).await;
        }
        let (mut rd, mut wr) = s.split();
        let write = async {
            let mut p = Rng::new(7);
            let mut block = vec![0u8; 64 * 1024];
            for _ in 0..BULK / block.len() {
                p.fill(&mut block);
                wr.write_all(&block).await.unwrap();
            }
        };
        let read = async {
            let mut p = Rng::new(7);
            let (mut got, mut want) = (vec![0u8; 64 * 1024], vec![0u8; 64 * 1024]);
            for block in 0..BULK / got.len() {
                rd.read_exact(&mut got).await.unwrap();
                p.fill(&mut want);
                assert!(got == want, "bulk block {block} differs");
            }
        };
        tokio::join!(write, read);
        sent += BULK;
        for round in 50..100 {
            sent += ping_pong(&mut s, round).await;
        }
        s.shutdown().await.unwrap();
        let mut rest = Vec::new();
        s.read_to_end(&mut rest).await.unwrap();
        assert!(rest.is_empty(), "{} bytes after the last echo", rest.len());
    };
    tokio::time::timeout(Duration::from_secs(60), exchange)
        .await
        .expect("exchange within 60 s");
    let lbl = format!("cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\"");
    for dir in ["client_to_backend", "backend_to_client"] {
        let name = format!("harvester_lb_bytes_total{{{lbl},direction=\"{dir}\"}}");
        // A byte is counted just after it is written: poll, then compare.
        let counted = wait_for(Duration::from_secs(5), "the byte counter", || async {
            let v = d.metric(&name).await;
            (v >= sent as f64).then_some(v)
        })
        .await;
        assert_eq!(counted, sent as f64, "{dir} bytes counted");
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn least_connections_sends_new_clients_to_the_idlest_backend() {
    let net = Subnet::new();
    let _b = futures_start(&net, &[11, 12], Behaviour::NameThenEcho).await;
    let d = Daemon::start(
        &net,
        &config(&net, &[11, 12], "algorithm = \"least_connections\"", None),
    )
    .await;
    // Hold two connections; wherever they land, the next ones must balance the load.
    let mut held = Vec::new();
    let mut per_backend = HashMap::<String, usize>::new();
    for _ in 0..6 {
        let mut s = TcpStream::connect(vip(&net)).await.unwrap();
        let name = read_line(&mut s).await.unwrap();
        *per_backend.entry(name).or_default() += 1;
        held.push(s);
    }
    assert_eq!(
        per_backend.values().copied().collect::<Vec<_>>(),
        vec![3, 3],
        "{per_backend:?}"
    );
    drop(held);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_ip_keeps_each_client_on_one_backend() {
    let net = Subnet::new();
    let _b = futures_start(&net, &[11, 12, 13], Behaviour::NameThenEcho).await;
    let d = Daemon::start(
        &net,
        &config(&net, &[11, 12, 13], "algorithm = \"source_ip\"", None),
    )
    .await;
    let mut used = std::collections::HashSet::new();
    for client in 100..130u8 {
        let mut names = std::collections::HashSet::new();
        for _ in 0..5 {
            let mut s = connect_from(net.ip(client), vip(&net)).await.unwrap();
            names.insert(read_line(&mut s).await.unwrap());
        }
        assert_eq!(
            names.len(),
            1,
            "client .{client} moved between backends: {names:?}"
        );
        used.extend(names);
    }
    assert_eq!(used.len(), 3, "30 clients spread over all 3 backends");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_listener_that_cannot_bind_fails_alone_and_readyz_says_why() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    // Something else already listens on the second VIP's port.
    let squatter = std::net::TcpListener::bind((net.ip(2), 8080)).unwrap();
    let cfg = config(&net, &[11], "", None).lb(other_lb(&net, "default/other", 2));
    let d = Daemon::start(&net, &cfg).await;
    let (code, body) = d.get("/readyz").await;
    assert_eq!(code, 503);
    assert!(
        body.contains(&format!("{}:8080", net.ip_str(2))) && body.contains("in use"),
        "{body}"
    );
    // The other listener works.
    assert_eq!(whoami(vip(&net)).await.unwrap(), net.ip_str(11));
    let status = d.status().await;
    assert_eq!(
        status["load_balancers"][1]["listeners"][0]["state"],
        "failed"
    );
    // Once the port is free, the daemon binds it by itself.
    drop(squatter);
    wait_for(
        Duration::from_secs(6),
        "the listener to be bound on retry",
        || async { (d.get("/readyz").await.0 == 200).then_some(()) },
    )
    .await;
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_endpoints_answer_and_reject_what_they_should() {
    let net = Subnet::new();
    let d = Daemon::start(&net, &config(&net, &[11], "", None)).await;
    assert_eq!(d.get("/healthz").await, (200, "ok\n".to_string()));
    assert_eq!(d.get("/readyz").await.0, 200);
    assert_eq!(d.get("/nope").await.0, 404);
    assert_eq!(http(d.admin, "DELETE", "/metrics").await.0, 405);
    assert_eq!(http(d.admin, "GET", "/reload").await.0, 405);
    let status = d.status().await;
    assert_eq!(status["ready"], true);
    let lb = &status["load_balancers"][0];
    assert_eq!(lb["name"], LB);
    assert_eq!(lb["ipam"], "pool");
    assert_eq!(lb["listeners"][0]["state"], "listening");
    assert_eq!(lb["backends"][0]["address"], net.ip_str(11));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn metrics_carry_the_documented_names_and_pass_promtool() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let health = "  period_seconds = 1\n  timeout_seconds = 1";
    let cfg = config(&net, &[11, 12], "", Some(health))
        .lb(Lb::new("default/empty", net.ip(2)).tcp("http", 8080, 30080))
        .lb(other_lb(&net, "default/ranged", 3).keys("source_ranges = [\"192.0.2.0/24\"]"));
    let d = Daemon::start(&net, &cfg).await;
    // Every outcome-split family appears at its first event: make one each.
    // A client outside source_ranges: a rejected connection.
    assert_refused_quickly(SocketAddr::new(net.ip(3), 8080), Duration::from_secs(2)).await;
    // Round robin starts one of two clients on the dead .12 (its third
    // failed probe, which takes it out, is a second away): a refused connect.
    for _ in 0..2 {
        assert_eq!(whoami(vip(&net)).await.unwrap(), net.ip_str(11));
    }
    // No backend at all: a failed client connection.
    assert_refused_quickly(SocketAddr::new(net.ip(2), 8080), Duration::from_secs(2)).await;
    // A transition.
    d.wait_health(LB, &net.ip_str(12), "unhealthy", Duration::from_secs(8))
        .await;
    let (code, body) = d.get("/metrics").await;
    assert_eq!(code, 200);
    for name in [
        "harvester_lb_connections_accepted_total",
        "harvester_lb_connections_failed_total",
        "harvester_lb_connections_rejected_total",
        "harvester_lb_connections_active",
        "harvester_lb_bytes_total",
        "harvester_lb_backend_connect_failures_total",
        "harvester_lb_backend_connections_active",
        "harvester_lb_backend_up",
        "harvester_lb_health_checks_total",
        "harvester_lb_health_check_duration_seconds_bucket",
        "harvester_lb_health_transitions_total",
        "harvester_lb_no_eligible_backend",
        "harvester_lb_listener_up",
        "harvester_lb_config_load_balancers",
        "harvester_lb_config_last_reload_successful",
        "harvester_lb_config_last_reload_success_timestamp_seconds",
        "harvester_lb_config_reloads_total",
        "harvester_lb_build_info",
    ] {
        assert!(
            body.lines().any(|l| l.starts_with(name)
                && (l[name.len()..].starts_with('{') || l[name.len()..].starts_with(' '))),
            "metric {name} missing from /metrics:\n{body}"
        );
        assert!(
            body.contains(&format!("# HELP {}", name.trim_end_matches("_bucket"))),
            "no HELP for {name}"
        );
    }
    let ok = metric_value(
        &body,
        &format!(
            "harvester_lb_health_checks_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{}\",result=\"ok\"}}",
            net.ip_str(11)
        ),
    );
    assert!(ok >= 1.0, "probes of the live backend are counted as ok");

    promtool_accepts(&body);
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_vip_forwards_to_ipv6_and_ipv4_backends() {
    let net = Subnet::new();
    let (vip_port, node_port) = (free_port_v6(), free_port_v6());
    let v6 = Backend::start(
        SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, node_port)),
        Behaviour::NameThenEcho,
    )
    .await;
    let v4 = Backend::start(
        SocketAddr::new(net.ip(11), node_port),
        Behaviour::NameThenEcho,
    )
    .await;
    let cfg = Config::on(&net).lb(Lb::new("default/v6", "::1")
        .backends(["::1".to_string(), net.ip_str(11)])
        .tcp("http", vip_port, node_port)
        .health(&format!(
            "  port = {node_port}\n  period_seconds = 1\n  timeout_seconds = 1"
        )));
    let d = Daemon::start(&net, &cfg).await;
    let vip = SocketAddr::from((std::net::Ipv6Addr::LOCALHOST, vip_port));
    let mut names = std::collections::HashSet::new();
    for _ in 0..4 {
        names.insert(whoami(vip).await.unwrap());
    }
    assert_eq!(
        names,
        ["::1".to_string(), net.ip_str(11)].into_iter().collect()
    );
    wait_for(Duration::from_secs(5), "an ok probe of ::1", || async {
        (d.backend_status("default/v6", "::1").await["probe"]["last_result"] == "ok").then_some(())
    })
    .await;
    drop((v6, v4));
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_connections_are_closed_after_the_idle_timeout_and_busy_ones_are_not() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let d = Daemon::start(&net, &config(&net, &[11], "idle_timeout_seconds = 1", None)).await;
    let mut idle = TcpStream::connect(vip(&net)).await.unwrap();
    let mut busy = TcpStream::connect(vip(&net)).await.unwrap();
    read_line(&mut idle).await.unwrap();
    read_line(&mut busy).await.unwrap();
    let started = tokio::time::Instant::now();
    // Keep `busy` talking every 300 ms for 2.5 s; `idle` says nothing.
    for i in 0..8 {
        busy.write_all(format!("ping {i}\n").as_bytes())
            .await
            .unwrap();
        assert_eq!(
            read_line(&mut busy)
                .await
                .expect("busy connection stays open"),
            format!("ping {i}")
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    let mut buf = [0u8; 8];
    let r = tokio::time::timeout(Duration::from_millis(100), idle.read(&mut buf)).await;
    assert!(
        matches!(r, Ok(Ok(0)) | Ok(Err(_))),
        "idle connection still open after {:?}: {r:?}",
        started.elapsed()
    );
    drop(busy);
    d.stop().await;
}

/// `proxy.max_connections` caps connections, not listeners: with more
/// listeners than slots, every listener still serves (a slot is taken after
/// an accept, never held by an idle listener), and a client over the cap
/// is served as soon as a slot frees.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_listeners_than_connection_slots_all_serve() {
    let net = Subnet::new();
    let _b = Backend::start(backend_addr(&net, 11), Behaviour::NameThenEcho).await;
    let mut cfg = Config::on(&net).proxy("max_connections = 2");
    let vips: Vec<SocketAddr> = (1..=5).map(|h| SocketAddr::new(net.ip(h), 8080)).collect();
    for (i, v) in vips.iter().enumerate() {
        cfg = cfg.lb(Lb::new(&format!("default/lb-{i}"), v.ip())
            .backends([net.ip(11)])
            .tcp("http", 8080, 30080));
    }
    let d = Daemon::start(&net, &cfg).await;
    // Each listener in turn, one connection at a time: all five serve.
    for v in &vips {
        let name = tokio::time::timeout(Duration::from_secs(10), whoami(*v))
            .await
            .unwrap_or_else(|_| panic!("listener {v} never served a client"));
        assert_eq!(name.unwrap(), net.ip_str(11));
    }
    // Two held connections fill the cap; a third client waits for a slot...
    let mut held = Vec::new();
    for v in &vips[..2] {
        let mut s = TcpStream::connect(v).await.unwrap();
        assert_eq!(read_line(&mut s).await.unwrap(), net.ip_str(11));
        held.push(s);
    }
    let mut waiting = TcpStream::connect(vips[4]).await.unwrap();
    wait_for(Duration::from_secs(10), "the capped accept to be counted", || async {
        // Written from its first count on.
        let n = d
            .metric_sample("harvester_lb_connection_limit_reached_total{cluster=\"kubernetes\",load_balancer=\"default/lb-4\",listener=\"http\"}")
            .await?;
        (n >= 1.0).then_some(())
    })
    .await;
    // ...and is served once one is closed.
    drop(held.pop());
    let name = tokio::time::timeout(Duration::from_secs(10), read_line(&mut waiting))
        .await
        .expect("the waiting client is served when a slot frees");
    assert_eq!(name.unwrap(), net.ip_str(11));
    drop((held, waiting));
    d.stop().await;
}

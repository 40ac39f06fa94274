//! What one tenant (a load balancer, a guest cluster) cannot take from the
//! others, and what the daemon says to an operator when a cap, a bind or a
//! reload goes wrong: the per-load-balancer share of connections and UDP
//! flows, with real sockets; escaped names and bounded, rate-limited log
//! lines, from the real binary's log.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::SocketAddr;
use std::time::Duration;

use support::*;
use tokio::net::{TcpStream, UdpSocket};

/// `n` load balancers `default/lb-<i>` on VIPs `.1`, `.2`, ..., each a TCP
/// listener on port 8080 to `.11:30080`; `proxy` goes into `[proxy]`,
/// `extra[i]` into load balancer `i`.
fn tcp_config(net: &Subnet, proxy: &str, extra: &[&str]) -> String {
    let mut cfg = Config::on(net).proxy(proxy);
    for (i, extra) in extra.iter().enumerate() {
        cfg = cfg.lb(lb(net, &format!("default/lb-{i}"), 1 + i as u8).keys(extra));
    }
    cfg.to_string()
}

/// Load balancer `name` on `.vip:8080` to `.11:30080`.
fn lb(net: &Subnet, name: &str, vip: u8) -> Lb {
    Lb::new(name, net.ip(vip))
        .backends([net.ip(11)])
        .tcp("http", 8080, 30080)
}

fn rejected(lb: usize) -> String {
    format!(
        "harvester_lb_connections_rejected_total{{cluster=\"kubernetes\",load_balancer=\"default/lb-{lb}\",listener=\"http\",reason=\"load_balancer_limit\"}}"
    )
}

/// Whether a connection to `vip` is closed by the daemon (a reset, seen
/// at the connect or the first read, or an EOF) without ever reaching the
/// backend, which would send its name.
async fn refused(vip: SocketAddr) -> bool {
    match TcpStream::connect(vip).await {
        Err(_) => true,
        Ok(mut s) => read_line(&mut s).await.is_err(),
    }
}

/// `proxy.max_connections = 4` and two load balancers: idle connections to
/// the first take its share (half, 2) and no more; the ones over it are
/// reset and counted, and the second still accepts and forwards. On a
/// global cap alone, the first took all four and the second waited forever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_load_balancer_full_of_idle_connections_does_not_starve_another() {
    let net = Subnet::new();
    let _b = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let d = Daemon::start(&net, &tcp_config(&net, "max_connections = 4", &["", ""])).await;
    let first = SocketAddr::new(net.ip(1), 8080);
    let second = SocketAddr::new(net.ip(2), 8080);

    let mut held = Vec::new();
    for _ in 0..2 {
        let mut s = TcpStream::connect(first).await.unwrap();
        assert_eq!(read_line(&mut s).await.unwrap(), net.ip_str(11));
        held.push(s);
    }
    // Two more to the same VIP: over its share, reset at once.
    for _ in 0..2 {
        assert!(
            refused(first).await,
            "a connection over the load balancer's share is refused"
        );
    }
    assert_eq!(d.metric(&rejected(0)).await, 2.0);

    // The other tenant is served, twice over (its own share).
    let mut other = Vec::new();
    for _ in 0..2 {
        let mut s = tokio::time::timeout(Duration::from_secs(10), TcpStream::connect(second))
            .await
            .expect("connect")
            .unwrap();
        let name = tokio::time::timeout(Duration::from_secs(10), read_line(&mut s))
            .await
            .expect("the second load balancer serves while the first is at its share");
        assert_eq!(name.unwrap(), net.ip_str(11));
        other.push(s);
    }
    assert_eq!(
        d.metric_sample(&rejected(1)).await,
        None,
        "the first load balancer's own share rejected none (no sample: none counted)"
    );

    // A connection of the first that closes gives its slot back.
    drop(held.pop());
    let name = wait_for(
        Duration::from_secs(10),
        "a freed slot to serve again",
        || async { whoami(first).await.ok() },
    )
    .await;
    assert_eq!(name, net.ip_str(11));
    drop((held, other));
    d.stop().await;
}

/// A load balancer's own `max_connections` is its cap (here 1 of 100),
/// and a bad value is refused with its key path.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_load_balancers_own_max_connections_caps_it() {
    let net = Subnet::new();
    let _b = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let cfg = tcp_config(&net, "max_connections = 100", &["max_connections = 1", ""]);
    let d = Daemon::start(&net, &cfg).await;
    let first = SocketAddr::new(net.ip(1), 8080);
    let mut held = TcpStream::connect(first).await.unwrap();
    assert_eq!(read_line(&mut held).await.unwrap(), net.ip_str(11));
    assert!(refused(first).await);
    assert_eq!(d.metric(&rejected(0)).await, 1.0);
    assert_eq!(
        whoami(SocketAddr::new(net.ip(2), 8080)).await.unwrap(),
        net.ip_str(11)
    );
    drop(held);
    d.stop().await;

    let bad = net.write(
        "bad.toml",
        &tcp_config(&net, "", &["max_connections = 0", "max_udp_flows = -3"]),
    );
    let (code, _, err) = run_cli(&["check", "--config", bad.to_str().unwrap()]);
    assert_ne!(code, 0);
    assert!(err.contains("load_balancer[0].max_connections"), "{err}");
    assert!(err.contains("load_balancer[1].max_udp_flows"), "{err}");
}

/// Whether one datagram from `client` through `vip` is answered within 1 s.
async fn udp_answered(client: &UdpSocket, vip: SocketAddr) -> bool {
    if client.send_to(b"ping", vip).await.is_err() {
        return false;
    }
    let mut buf = [0u8; 64];
    matches!(
        tokio::time::timeout(Duration::from_secs(1), client.recv_from(&mut buf)).await,
        Ok(Ok((4, _)))
    )
}

/// `proxy.max_udp_flows = 4` and two UDP load balancers: many sources of
/// the first get its share (2) of the flow table, the rest are dropped and
/// counted, and the second still gets flows.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_load_balancer_cannot_take_the_whole_udp_flow_table() {
    let net = Subnet::new();
    let _echo = udp_echo(SocketAddr::new(net.ip(11), 30700)).await;
    let mut cfg = Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .proxy("max_udp_flows = 4");
    for i in 0..2u8 {
        cfg = cfg.lb(Lb::new(&format!("default/udp-{i}"), net.ip(1 + i))
            .backends([net.ip(11)])
            .listener(Listener::new("game", 7000, 30700).udp()));
    }
    let d = Daemon::start(&net, &cfg).await;
    let (first, second) = (
        SocketAddr::new(net.ip(1), 7000),
        SocketAddr::new(net.ip(2), 7000),
    );
    let mut answered = 0;
    let mut clients = Vec::new();
    for h in 100..106u8 {
        let c = UdpSocket::bind(SocketAddr::new(net.ip(h), 0))
            .await
            .unwrap();
        if udp_answered(&c, first).await {
            answered += 1;
        }
        clients.push(c);
    }
    assert_eq!(
        answered, 2,
        "the first load balancer gets its share, no more"
    );
    let dropped = d
        .metric("harvester_lb_udp_flows_dropped_total{cluster=\"kubernetes\",load_balancer=\"default/udp-0\",listener=\"game\",reason=\"load_balancer_limit\"}")
        .await;
    assert_eq!(dropped, 4.0);
    for h in 110..112u8 {
        let c = UdpSocket::bind(SocketAddr::new(net.ip(h), 0))
            .await
            .unwrap();
        assert!(
            udp_answered(&c, second).await,
            "the second load balancer still gets flows"
        );
        clients.push(c);
    }
    d.stop().await;
}

/// The real binary logging at `info` (the level whose lines these tests
/// read), under `under` (e.g. `prlimit ...`), with `args` after `run`.
fn logged(under: &[&str], config: &std::path::Path, args: &[&str]) -> Process {
    Process::launch(config)
        .under(under)
        .args(args)
        .env("HARVESTER_LB_LOG", "info")
        .spawn()
}

/// 200 listeners whose VIP:port another socket holds: each bind fails at
/// start and again at every 2 s retry, yet the log carries a handful of
/// lines for the cause, not one per listener per retry.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_hundred_unbindable_listeners_log_a_bounded_number_of_lines() {
    let net = Subnet::new();
    let squatters: Vec<std::net::TcpListener> = (1..=200u8)
        .map(|h| std::net::TcpListener::bind(SocketAddr::new(net.ip(h), 8080)).unwrap())
        .collect();
    let mut cfg = Config::on(&net);
    for h in 1..=200u8 {
        cfg = cfg.lb(lb(&net, &format!("default/lb-{h}"), h));
    }
    let path = net.write("config.toml", &cfg.to_string());
    let daemon = logged(&[], &path, &[]);
    daemon
        .line_with(&["harvester-lb running"], Duration::from_secs(30))
        .await;
    // Three retry rounds (every 2 s) at least: 800 failed binds.
    let started = tokio::time::Instant::now();
    wait_for(Duration::from_secs(30), "7 s of retries", || async {
        (started.elapsed() >= Duration::from_secs(7)).then_some(())
    })
    .await;
    // At least one bind error line, which may still be queued; then at most 10.
    daemon.wait_logged("cannot bind listener").await;
    let lines = daemon.lines();
    let bind_errors = lines
        .iter()
        .filter(|l| l.contains("cannot bind listener"))
        .count();
    eprintln!(
        "FIGURE 200 unbindable listeners, 7 s: {bind_errors} bind error lines, {} lines in all",
        lines.len()
    );
    assert!(
        (1..=10).contains(&bind_errors),
        "{bind_errors} bind error lines:\n{}",
        lines.join("\n")
    );
    assert!(
        lines.len() < 100,
        "{} lines in 7 s:\n{}",
        lines.len(),
        lines.join("\n")
    );
    drop(squatters);
}

/// Under `ulimit -n 256` the derived cap is 16 connections: the daemon
/// says so at start, with the limit and how to raise it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cap_derived_from_a_small_open_file_limit_is_said() {
    let net = Subnet::new();
    let path = net.write("config.toml", &tcp_config(&net, "", &[""]));
    let daemon = logged(&["prlimit", "--nofile=256:256"], &path, &[]);
    let line = daemon
        .line_with(&["open-file limit is 256"], Duration::from_secs(30))
        .await;
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("at most 16 connections"), "{line}");
    assert!(line.contains("LimitNOFILE="), "{line}");
}

/// A reload to a file with no load balancer removes every VIP: said as a
/// warning with the count, not as the usual info line.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_drops_every_load_balancer_is_a_warning() {
    let net = Subnet::new();
    let _b = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let path = net.write("config.toml", &tcp_config(&net, "", &["", ""]));
    let mut daemon = logged(&[], &path, &[]);
    daemon.wait_ready(SocketAddr::new(net.ip(250), 9901)).await;
    net.write("config.toml", &tcp_config(&net, "", &[]));
    daemon.signal(libc::SIGHUP);
    let line = daemon
        .line_with(&["no load balancer"], Duration::from_secs(30))
        .await;
    assert!(line.contains("WARN"), "{line}");
    assert!(line.contains("all 2 load balancers"), "{line}");
}

/// A name holding `\n` and `ESC[8m` forges no log line and hides nothing:
/// `check` and `run` (text or JSON logs) refuse the file, naming the key and
/// the character's code point, never the name. (Before names were checked,
/// the text log escaped it and the JSON log carried it whole; the escaping
/// stays for every other text, see `status_table`'s and `text`'s tests.)
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostile_name_cannot_forge_or_hide_a_log_line() {
    let net = Subnet::new();
    let cfg = tcp_config(&net, "", &[""]).replace(
        "default/lb-0",
        "default/web\\nFORGED ERROR harvester_lb: all backends down\\u001b[8m",
    );
    let path = net.write("config.toml", &cfg);
    let (code, stdout, stderr) = run_cli(&["check", "--config", path.to_str().unwrap()]);
    let out = format!("{stdout}{stderr}");
    assert_eq!(code, 78, "{out}");
    assert!(
        out.contains("load_balancer[0].name: holds the control character U+000A"),
        "{out}"
    );
    for args in [&[][..], &["--log-format", "json"][..]] {
        let mut run = logged(&[], &path, args);
        let status = wait_for(Duration::from_secs(30), "run to refuse the file", || {
            let status = run.exited();
            async move { status }
        })
        .await;
        // The last line may still be on its way to the log.
        wait_for(Duration::from_secs(10), "the refusal in the log", || {
            let seen = run.lines().iter().any(|l| l.contains("U+000A"));
            async move { seen.then_some(()) }
        })
        .await;
        assert_eq!(status.code(), Some(78));
        let lines = run.lines();
        assert!(
            lines.iter().any(|l| l.contains("U+000A")),
            "the refusal is not logged:\n{}",
            lines.join("\n")
        );
        assert!(
            !lines
                .iter()
                .any(|l| l.starts_with("FORGED") || l.contains('\u{1b}')),
            "a line was forged or an escape reached the log:\n{}",
            lines.join("\n")
        );
    }
}

/// Eight IPv6 addresses of one /64 are one source for
/// `proxy.max_udp_flows_per_source` (2 here): two get flows, six are
/// dropped as `source_limit`, and an address of another /64 still gets
/// its own. Counted per address, the eight took eight slots of the flow
/// table that every UDP listener shares. Runs the real daemon in a
/// network namespace this test makes, where the addresses live on `lo`.
#[test]
fn ipv6_sources_are_counted_per_64() {
    require_netns!();
    let net = Subnet::new();
    let scratch = netns::Scratch::new("t64");
    let ns = scratch.ns();
    ns.ip(&["link", "set", "lo", "up"]);
    let clients: Vec<String> = (1..=8).map(|i| format!("2001:db8:64:1::{i}")).collect();
    let other = "2001:db8:64:2::1";
    for a in clients
        .iter()
        .map(String::as_str)
        .chain([other, "2001:db8:99::1", "2001:db8:98::1"])
    {
        ns.ip(&[
            "-6",
            "addr",
            "add",
            &format!("{a}/128"),
            "dev",
            "lo",
            "nodad",
        ]);
    }
    let path = net.write(
        "config.toml",
        &Config::new()
            .admin("127.0.0.1:9901".parse().unwrap())
            .socket(&net.dir().join("admin.sock"))
            .proxy("max_udp_flows_per_source = 2")
            .lb(Lb::new("default/dns", "2001:db8:99::1")
                .backends(["2001:db8:98::1"])
                .listener(Listener::new("dns", 53, 30053).udp()))
            .to_string(),
    );
    // The backend: echoes every datagram, on a thread of its own.
    let backend = netns::in_ns(&ns.name, || {
        std::net::UdpSocket::bind("[2001:db8:98::1]:30053").unwrap()
    });
    std::thread::spawn(move || {
        let mut buf = [0u8; 512];
        while let Ok((n, from)) = backend.recv_from(&mut buf) {
            let _ = backend.send_to(&buf[..n], from);
        }
    });
    // Stopped before the namespace goes (dropped first).
    let _daemon = Process::launch(&path)
        .under(&["ip", "netns", "exec", &ns.name])
        .spawn();
    let (answered, other_answered, dropped) = netns::in_ns(&ns.name, move || {
        let admin: SocketAddr = "127.0.0.1:9901".parse().unwrap();
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while !matches!(http_blocking(admin, "/readyz"), Ok((200, _))) {
            assert!(std::time::Instant::now() < deadline, "daemon not ready");
            std::thread::sleep(Duration::from_millis(50));
        }
        let vip: SocketAddr = "[2001:db8:99::1]:53".parse().unwrap();
        let ask = |from: &str| {
            let s = std::net::UdpSocket::bind(format!("[{from}]:0")).unwrap();
            s.set_read_timeout(Some(Duration::from_secs(1))).unwrap();
            s.send_to(b"query", vip).unwrap();
            let mut buf = [0u8; 64];
            matches!(s.recv_from(&mut buf), Ok((5, f)) if f == vip)
        };
        let answered = clients.iter().filter(|c| ask(c)).count();
        let other_answered = ask(other);
        let (_, body) = http_blocking(admin, "/metrics").unwrap();
        let dropped = metric_value(
            &body,
            "harvester_lb_udp_flows_dropped_total{cluster=\"kubernetes\",load_balancer=\"default/dns\",listener=\"dns\",reason=\"source_limit\"}",
        );
        (answered, other_answered, dropped)
    });
    assert_eq!(answered, 2, "one /64 is one source");
    assert!(other_answered, "another /64 is another source");
    assert_eq!(dropped, 6.0);
}

/// Reaching a cap and leaving it again are said: a load balancer's share
/// (warn, with its name) and `proxy.max_connections` (warn, then info once
/// connections close), from the real binary.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reaching_and_leaving_a_connection_cap_is_logged() {
    let net = Subnet::new();
    let _b = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    // Three load balancers, 2 slots: a share of 1 each.
    let path = net.write(
        "config.toml",
        &tcp_config(&net, "max_connections = 2", &["", "", ""]),
    );
    let mut daemon = logged(&[], &path, &[]);
    daemon.wait_ready(SocketAddr::new(net.ip(250), 9901)).await;
    let vip = |i: u8| SocketAddr::new(net.ip(1 + i), 8080);

    let mut first = TcpStream::connect(vip(0)).await.unwrap();
    assert_eq!(read_line(&mut first).await.unwrap(), net.ip_str(11));
    assert!(refused(vip(0)).await);
    let line = daemon
        .line_with(&["reached its connection cap"], Duration::from_secs(10))
        .await;
    assert!(
        line.contains("WARN") && line.contains("default/lb-0") && line.contains("cap=1"),
        "{line}"
    );

    let mut second = TcpStream::connect(vip(1)).await.unwrap();
    assert_eq!(read_line(&mut second).await.unwrap(), net.ip_str(11));
    // Both process slots held: the third load balancer's client waits.
    let mut waiting = TcpStream::connect(vip(2)).await.unwrap();
    let line = daemon
        .line_with(&["proxy.max_connections reached"], Duration::from_secs(10))
        .await;
    assert!(
        line.contains("WARN") && line.contains("max_connections=2"),
        "{line}"
    );
    drop(first);
    assert_eq!(read_line(&mut waiting).await.unwrap(), net.ip_str(11));
    drop((second, waiting));
    daemon
        .line_with(
            &["back under proxy.max_connections"],
            Duration::from_secs(10),
        )
        .await;
    daemon
        .line_with(
            &["default/lb-0", "back under its connection cap"],
            Duration::from_secs(10),
        )
        .await;
}

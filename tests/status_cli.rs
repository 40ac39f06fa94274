//! `harvester-lb status` against a running daemon: the table shows each
//! backend's health, operator state, runs and last probe; `--json` is the
//! daemon's `/status`; the admin socket is used when it can be opened, the
//! TCP listener otherwise; an unreachable daemon is exit 69. Each
//! backend's totals (issue 43: connections, bytes each way, connect and
//! check failures, time down, last change) agree in `/status`, `/metrics`
//! and the table.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use support::{Backend, Behaviour, Config, Daemon, Lb, Listener, Subnet, cli, udp_echo, wait_for};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_shows_what_status_says_through_the_socket_or_tcp() {
    let net = Subnet::new();
    let lb = Lb::new("default/web", net.ip(100))
        .keys("cluster = \"prod\"")
        .backends(net.ips(&[1, 2]))
        .tcp("http", 8080, 30080)
        .health(
            "  port = 30080\n  failure_threshold = 1\n  period_seconds = 1\n  timeout_seconds = 1",
        );
    let config = Config::on(&net).lb(lb.clone());
    let backend = Backend::start(SocketAddr::new(net.ip(1), 30080), Behaviour::NameThenEcho).await;
    let daemon = Daemon::start(&net, &config).await;
    daemon
        .wait_health(
            "default/web",
            &net.ip_str(2),
            "unhealthy",
            Duration::from_secs(10),
        )
        .await;
    let path = daemon.config.to_str().unwrap().to_string();

    let (code, table, stderr) = cli(vec!["status".into(), "--config".into(), path.clone()]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.starts_with("daemon: ready\n"), "{table}");
    let header = table
        .lines()
        .find(|l| l.starts_with("default/web"))
        .expect("lb row");
    assert!(
        header.contains(&net.ip_str(100)) && header.contains("1/2"),
        "{table}"
    );
    let down = table
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{} ", net.ip_str(2))))
        .expect("down backend row");
    let cells: Vec<&str> = down.split_whitespace().collect();
    assert_eq!(&cells[1..4], ["unhealthy", "ready", "no"], "{down}");
    assert_eq!(cells[6], "refused", "{down}");
    assert!(cells[7].ends_with('s'), "an age: {down}");
    let listener = table
        .lines()
        .find(|l| l.contains("listening"))
        .expect("listener row");
    assert!(
        listener.contains(&format!("{}:8080", net.ip_str(100))),
        "{table}"
    );

    // --json is the daemon's /status.
    let (code, json, _) = cli(vec![
        "status".into(),
        "--json".into(),
        "--config".into(),
        path,
    ])
    .await;
    assert_eq!(code, 0);
    let doc: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(doc["load_balancers"][0]["name"], "default/web");

    // Without a socket to open: admin.listen answers.
    let no_socket = net.write(
        "tcp-only.toml",
        &Config::on(&net)
            .socket(Path::new("/nonexistent/harvester-lb.sock"))
            .lb(lb.clone())
            .to_string(),
    );
    let (code, table, stderr) = cli(vec![
        "status".into(),
        "-c".into(),
        no_socket.to_str().unwrap().into(),
    ])
    .await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.contains("default/web"), "{table}");

    // Nobody there: 69, naming where it asked.
    let nowhere = net.write(
        "nowhere.toml",
        &Config::new()
            .admin(SocketAddr::new(net.ip(249), 9901))
            .socket(Path::new("/nonexistent/harvester-lb.sock"))
            .lb(lb)
            .to_string(),
    );
    let (code, _, stderr) = cli(vec![
        "status".into(),
        "-c".into(),
        nowhere.to_str().unwrap().into(),
    ])
    .await;
    assert_eq!(code, 69, "{stderr}");
    assert!(
        stderr.contains("cannot reach the daemon's admin API"),
        "{stderr}"
    );
    daemon.stop().await;
    backend.stop();
}

/// Per-backend totals over a TCP and a UDP listener of the proxy: .1
/// serves both; .2 passes the check (on its own port) but refuses the TCP
/// nodeport, so every connection tried on it first is a connect failure
/// retried onto .1; .3 answers nothing and goes down. `/status`'s
/// `totals` counts exactly what the clients did, `/metrics` says the same,
/// and `status` shows it. Loopback only; about 4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_backend_s_totals_count_what_its_clients_did() {
    const LB: &str = "default/totals";
    const CONNECTIONS: usize = 6;
    let net = Subnet::new();
    let lb = Lb::new(LB, net.ip(100))
        .backends(net.ips(&[1, 2, 3]))
        .keys("algorithm = \"round_robin\"")
        .tcp("http", 8080, 30080)
        .listener(Listener::new("dns", 5353, 30053).udp())
        .health(
            "  port = 30099\n  failure_threshold = 1\n  period_seconds = 1\n  timeout_seconds = 1",
        );
    let config = Config::on(&net).lb(lb);
    let mut kept = Vec::new();
    for h in [1, 2] {
        kept.push(Backend::start(SocketAddr::new(net.ip(h), 30099), Behaviour::NameThenEcho).await);
    }
    kept.push(Backend::start(SocketAddr::new(net.ip(1), 30080), Behaviour::NameThenEcho).await);
    let udp = [
        udp_echo(SocketAddr::new(net.ip(1), 30053)).await,
        udp_echo(SocketAddr::new(net.ip(2), 30053)).await,
    ];
    let daemon = Daemon::start(&net, &config).await;
    let (one, two, three) = (net.ip_str(1), net.ip_str(2), net.ip_str(3));
    daemon
        .wait_health(LB, &three, "unhealthy", Duration::from_secs(10))
        .await;

    // TCP: each client sends 6 bytes and reads to the end (.1's name, a
    // newline, the echo).
    let mut from_backends = 0u64;
    for _ in 0..CONNECTIONS {
        let mut c = tokio::net::TcpStream::connect(SocketAddr::new(net.ip(100), 8080))
            .await
            .expect("connect to the VIP");
        c.write_all(b"hello\n").await.unwrap();
        c.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut got))
            .await
            .expect("the answer within 10 s")
            .unwrap();
        assert!(got.starts_with(format!("{one}\n").as_bytes()), "{got:?}");
        from_backends += got.len() as u64;
    }
    // UDP: one flow, one datagram each way.
    let client = tokio::net::UdpSocket::bind(SocketAddr::new(net.ip(200), 0))
        .await
        .unwrap();
    client
        .send_to(b"ping-1234", SocketAddr::new(net.ip(100), 5353))
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let (n, _) = tokio::time::timeout(Duration::from_secs(10), client.recv_from(&mut buf))
        .await
        .expect("the echo within 10 s")
        .unwrap();
    assert_eq!(&buf[..n], b"ping-1234");

    // Counted as the bytes move: wait until the last ones are in.
    let (to_backends, to_clients) = (6 * CONNECTIONS as u64 + 9, from_backends + 9);
    let totals = wait_for(Duration::from_secs(10), "the totals to add up", || async {
        let mut t = Vec::new();
        for ip in [&one, &two, &three] {
            t.push(daemon.backend_status(LB, ip).await["totals"].clone());
        }
        let sum = |k: &str| t.iter().map(|b| b[k].as_u64().unwrap_or(0)).sum::<u64>();
        // .3's time down counts in tenths of a second.
        let down = t[2]["down_seconds"].as_f64().unwrap_or(0.0) > 0.0;
        (sum("bytes_to_backend") == to_backends && sum("bytes_to_client") == to_clients && down)
            .then_some(t)
    })
    .await;
    let (t1, t2, t3) = (&totals[0], &totals[1], &totals[2]);
    // Every TCP connection on .1; the UDP flow on .1 or .2.
    assert_eq!(
        t1["connections"].as_u64().unwrap() + t2["connections"].as_u64().unwrap(),
        CONNECTIONS as u64 + 1,
        "{totals:?}"
    );
    assert!(
        t1["connections"].as_u64().unwrap() >= CONNECTIONS as u64,
        "{totals:?}"
    );
    assert_eq!(t3["connections"], 0, "{totals:?}");
    // Round robin over .1 and .2 tries .2 first for every other client.
    assert!(t2["connect_failures"].as_u64().unwrap() >= 2, "{totals:?}");
    assert_eq!(t1["connect_failures"], 0, "{totals:?}");
    // .3: its checks fail, it is down and its state changed; .1 is neither.
    assert!(t3["check_failures"].as_u64().unwrap() >= 1, "{totals:?}");
    assert!(t3["down_seconds"].as_f64().unwrap() > 0.0, "{totals:?}");
    let changed = t3["last_change_unix"].as_f64().expect("a change, dated");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        changed <= now && changed > now - 300.0,
        "{changed} vs {now}"
    );
    assert_eq!(t1["check_failures"], 0, "{totals:?}");
    assert_eq!(t1["down_seconds"], 0.0, "{totals:?}");
    assert!(t1["last_change_unix"].is_null(), "{totals:?}");

    // /metrics says the same.
    let (_, metrics) = daemon.get("/metrics").await;
    let series = |family: &str, ip: &str, extra: &str| {
        support::metric_value(
            &metrics,
            &format!(
                "{family}{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{ip}\"{extra}}}"
            ),
        )
    };
    for (ip, t) in [(&one, t1), (&two, t2)] {
        assert_eq!(
            series("harvester_lb_backend_connections_total", ip, ""),
            t["connections"].as_f64().unwrap(),
            "{ip}"
        );
        assert_eq!(
            series(
                "harvester_lb_backend_bytes_total",
                ip,
                ",direction=\"client_to_backend\""
            ),
            t["bytes_to_backend"].as_f64().unwrap(),
            "{ip}"
        );
        assert_eq!(
            series(
                "harvester_lb_backend_bytes_total",
                ip,
                ",direction=\"backend_to_client\""
            ),
            t["bytes_to_client"].as_f64().unwrap(),
            "{ip}"
        );
    }
    assert!(series("harvester_lb_backend_down_seconds_total", &three, "") > 0.0);
    assert!(
        (series(
            "harvester_lb_backend_last_change_timestamp_seconds",
            &three,
            ""
        ) - changed)
            .abs()
            < 0.01
    );
    assert!(
        !metrics.contains(&format!(
            "harvester_lb_backend_last_change_timestamp_seconds{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{one}\""
        )),
        "no change, no series"
    );

    // The table: .1's row carries its connections.
    let path = daemon.config.to_str().unwrap().to_string();
    let (code, table, stderr) = cli(vec!["status".into(), "--config".into(), path]).await;
    assert_eq!(code, 0, "{stderr}");
    let header = table
        .lines()
        .find(|l| l.trim_start().starts_with("BACKEND "))
        .expect("backend header");
    assert!(
        header.contains("TOTAL") && header.contains("BYTES IN/OUT") && header.contains("DOWN"),
        "{header}"
    );
    let row = table
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{one} ")))
        .expect(".1's row");
    assert!(
        row.split_whitespace()
            .any(|c| c.parse::<u64>().ok() == t1["connections"].as_u64()),
        "{row}"
    );
    daemon.stop().await;
    for b in kept {
        b.stop();
    }
    for u in udp {
        u.abort();
    }
}

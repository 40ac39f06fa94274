//! What the daemon says of itself and how it says it (issue 43, "Messages
//! and logs"): `--version`, `/status` and `/metrics` name the build's
//! commit, `/status` the process's uptime, `/metrics` the standard
//! `process_*` series; the package, unit and help say what it balances.

use crate::support;

use std::net::SocketAddr;

use support::{Backend, Behaviour, Config, Daemon, Lb, Subnet, cli, run_cli};

/// The commit this tree is at, as the build script takes it ("unknown"
/// without git).
fn head_commit() -> String {
    std::process::Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_else(|| "unknown".to_string())
}

#[test]
fn version_names_the_commit_and_help_says_tcp_and_udp() {
    let (code, out, err) = run_cli(&["--version"]);
    assert_eq!(code, 0, "{err}");
    assert_eq!(
        out,
        format!(
            "harvester-lb {} (commit {})\n",
            env!("CARGO_PKG_VERSION"),
            head_commit()
        )
    );
    let (code, help, _) = run_cli(&["--help"]);
    assert_eq!(code, 0);
    assert!(
        help.starts_with("TCP and UDP load balancer with active health checks"),
        "{help}"
    );
    // Where the one-line description is written for a package manager,
    // systemctl or a reader of the crate, it says the same.
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    for file in ["Cargo.toml", "systemd/harvester-lb.service", "src/lib.rs"] {
        let text = std::fs::read_to_string(root.join(file)).unwrap();
        assert!(
            !text.contains("TCP load balancer"),
            "{file} still says \"TCP load balancer\""
        );
        assert!(
            text.contains("TCP and UDP load balancer"),
            "{file} does not say \"TCP and UDP load balancer\""
        );
    }
}

/// `/status` and `status` show version, commit and uptime; `/metrics` has
/// `harvester_lb_build_info{version,commit}` and the process collector's
/// standard series, plausible for this (test) process.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_and_metrics_name_the_build_and_the_process() {
    let net = Subnet::new();
    let config = Config::on(&net).lb(Lb::new("default/web", net.ip(100))
        .backends(net.ips(&[1]))
        .tcp("http", 8080, 30080));
    let _backend = Backend::start(SocketAddr::new(net.ip(1), 30080), Behaviour::NameThenEcho).await;
    let daemon = Daemon::start(&net, &config).await;
    let commit = head_commit();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();

    let status = daemon.status().await;
    assert_eq!(status["version"], env!("CARGO_PKG_VERSION"));
    assert_eq!(status["commit"], commit.as_str());
    let started = status["started_unix"].as_f64().expect("started_unix");
    let uptime = status["uptime_seconds"].as_f64().expect("uptime_seconds");
    assert!(
        started > 1.0e9 && started <= now + 1.0,
        "started {started}, now {now}"
    );
    assert!((0.0..86_400.0).contains(&uptime), "uptime {uptime}");

    let (code, table, err) = cli(vec![
        "status".into(),
        "--config".into(),
        daemon.config.to_str().unwrap().into(),
    ])
    .await;
    assert_eq!(code, 0, "{err}");
    let line = table.lines().nth(1).unwrap_or_default();
    assert!(
        line.starts_with(&format!(
            "harvester-lb {} (commit {commit}), up ",
            env!("CARGO_PKG_VERSION")
        )),
        "{table}"
    );

    let (code, metrics) = daemon.get("/metrics").await;
    assert_eq!(code, 200);
    support::promtool_accepts(&metrics);
    assert!(
        metrics.contains(&format!(
            "harvester_lb_build_info{{version=\"{}\",commit=\"{commit}\"}} 1\n",
            env!("CARGO_PKG_VERSION")
        )),
        "{metrics}"
    );
    for (name, kind) in [
        ("process_start_time_seconds", "gauge"),
        ("process_cpu_seconds_total", "counter"),
        ("process_resident_memory_bytes", "gauge"),
        ("process_open_fds", "gauge"),
        ("process_max_fds", "gauge"),
    ] {
        assert!(
            metrics.contains(&format!("# TYPE {name} {kind}\n")),
            "{name} {kind}: {metrics}"
        );
    }
    let start = support::metric_value(&metrics, "process_start_time_seconds ");
    assert!(
        (start - started).abs() < 1.0,
        "{start} vs /status {started}"
    );
    // CPU time counts in clock ticks (10 ms): a quick test may have none.
    assert!(
        metrics.contains("\nprocess_cpu_seconds_total "),
        "{metrics}"
    );
    let cpu = support::metric_value(&metrics, "process_cpu_seconds_total ");
    assert!((0.0..86_400.0).contains(&cpu), "cpu {cpu}");
    let rss = support::metric_value(&metrics, "process_resident_memory_bytes ");
    assert!(rss > 1.0e6 && rss < 1.0e11, "rss {rss}");
}

/// One client from `.100` through `vip` to the name-telling backend at
/// `.11`: reads the name, sends `data`, closes its side and reads to the
/// end (within 20 s). Its address.
async fn one_connection(net: &Subnet, vip: SocketAddr, data: &[u8]) -> SocketAddr {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut s = support::connect_from(net.ip(100), vip)
        .await
        .expect("connect");
    let me = s.local_addr().unwrap();
    assert_eq!(
        support::read_line(&mut s).await.expect("served"),
        net.ip_str(11)
    );
    s.write_all(data).await.unwrap();
    s.shutdown().await.unwrap();
    let mut rest = Vec::new();
    tokio::time::timeout(std::time::Duration::from_secs(20), s.read_to_end(&mut rest))
        .await
        .expect("the connection ends")
        .expect("read");
    me
}

/// `HARVESTER_LB_LOG=debug` writes each connection's steps, with no
/// `log_connections` set: accepted (client, VIP, load balancer, listener),
/// the backend chosen, and its end with the state and bytes each way, all
/// at debug under the connection log's target.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn debug_logs_every_connection_accepted_backend_chosen_and_closed() {
    let net = Subnet::new();
    let backend = SocketAddr::new(net.ip(11), 30080);
    let _b = Backend::start(backend, Behaviour::NameThenEcho).await;
    let config = Config::on(&net).lb(Lb::new("default/web", net.ip(1))
        .backends(net.ips(&[11]))
        .tcp("http", 8080, 30080));
    let path = net.write("config.toml", &config.to_string());
    let mut process = support::Process::launch(&path)
        .global_args(&["--log-format", "json"])
        .env("HARVESTER_LB_LOG", "debug")
        .spawn();
    process.wait_ready(SocketAddr::new(net.ip(250), 9901)).await;

    let vip = SocketAddr::new(net.ip(1), 8080);
    let me = one_connection(&net, vip, b"hello").await;

    let client = me.to_string();
    let lines = support::wait_for(
        std::time::Duration::from_secs(20),
        "the three debug lines of the connection",
        || {
            let lines: Vec<serde_json::Value> = process
                .lines()
                .iter()
                .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
                .filter(|v| {
                    v["target"] == "harvester_lb::connection"
                        && v["fields"]["client"] == client.as_str()
                })
                .collect();
            async move { (lines.len() >= 3).then_some(lines) }
        },
    )
    .await;
    let messages: Vec<&str> = lines
        .iter()
        .map(|l| l["fields"]["message"].as_str().unwrap_or(""))
        .collect();
    assert_eq!(messages, ["accepted", "backend chosen", "connection"]);
    assert!(lines.iter().all(|l| l["level"] == "DEBUG"), "{lines:?}");
    let accepted = &lines[0]["fields"];
    assert_eq!(accepted["vip"], vip.to_string());
    assert_eq!(accepted["load_balancer"], "default/web");
    assert_eq!(accepted["listener"], "http");
    assert_eq!(lines[1]["fields"]["backend"], backend.to_string());
    let closed = &lines[2]["fields"];
    assert_eq!(closed["state"], "closed");
    assert_eq!(closed["backend"], backend.to_string());
    assert_eq!(closed["bytes_from_client"], 5);
    assert_eq!(
        closed["bytes_from_backend"],
        net.ip_str(11).len() as u64 + 1 + 5
    );
}

/// Under systemd (`JOURNAL_STREAM` names stderr) the daemon's text goes to
/// the journal's socket in its native protocol: the load balancer and
/// listener as fields of their own, the priority as before (6 info, 4
/// warning), a `MESSAGE` with neither the daemon's timestamp nor its level;
/// and nothing of it on stderr. A stand-in journal socket (a datagram
/// socket the test binds) takes the place of journald's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn under_the_journal_each_line_is_an_entry_with_its_fields_and_priority() {
    use std::os::unix::fs::MetadataExt;
    let net = Subnet::new();
    let backend = SocketAddr::new(net.ip(11), 30080);
    let _b = Backend::start(backend, Behaviour::NameThenEcho).await;
    let config = Config::on(&net)
        .lb(Lb::new("default/web", net.ip(1))
            .keys("log_connections = \"all\"")
            .backends(net.ips(&[11]))
            .tcp("http", 8080, 30080))
        .lb(Lb::new("default/empty", net.ip(2)).tcp("dns", 8053, 30053));
    let path = net.write("config.toml", &config.to_string());
    let journal = net.dir().join("journal.sock");
    let socket = std::os::unix::net::UnixDatagram::bind(&journal).expect("bind the journal");
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let log = net.dir().join("stderr.log");
    std::fs::write(&log, "").unwrap();
    let meta = std::fs::metadata(&log).unwrap();
    let mut process = support::Process::launch(&path)
        .log(&log)
        .env("JOURNAL_STREAM", format!("{}:{}", meta.dev(), meta.ino()))
        .env("HARVESTER_LB_JOURNAL_SOCKET", &journal)
        .spawn();
    process.wait_ready(SocketAddr::new(net.ip(250), 9901)).await;

    let me = one_connection(&net, SocketAddr::new(net.ip(1), 8080), b"")
        .await
        .to_string();

    // Entries until the connection's (bounded: 20 s per read, 200 entries).
    let entries = entries_until(socket, me).await;
    let field = |entry: &str, name: &str| -> Option<String> {
        entry
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{name}=")).map(str::to_string))
    };
    let connection = entries.last().unwrap();
    assert_eq!(
        field(connection, "PRIORITY").as_deref(),
        Some("6"),
        "{connection}"
    );
    assert_eq!(
        field(connection, "LOAD_BALANCER").as_deref(),
        Some("default/web")
    );
    assert_eq!(field(connection, "LISTENER").as_deref(), Some("http"));
    assert_eq!(field(connection, "CLUSTER").as_deref(), Some("kubernetes"));
    assert_eq!(field(connection, "STATE").as_deref(), Some("closed"));
    assert_eq!(
        field(connection, "SYSLOG_IDENTIFIER").as_deref(),
        Some("harvester-lb")
    );
    let message = field(connection, "MESSAGE").expect("MESSAGE");
    assert!(
        message.starts_with("connection state=closed protocol=\"tcp\" "),
        "no timestamp or level first: {message}"
    );
    // The empty load balancer's warning, at the journal's warning priority.
    let warning = entries
        .iter()
        .find(|e| field(e, "PRIORITY").as_deref() == Some("4"))
        .unwrap_or_else(|| panic!("a warning entry: {entries:#?}"));
    assert!(
        field(warning, "MESSAGE")
            .is_some_and(|m| m.contains("default/empty") || m.contains("backends")),
        "{warning}"
    );
    let stderr = std::fs::read_to_string(&log).unwrap();
    assert!(
        !stderr.contains("connection"),
        "the entries are not on stderr too: {stderr}"
    );

    // journald restarted: its socket is made anew at the same path, and
    // the next entries reach the new one.
    std::fs::remove_file(&journal).unwrap();
    let socket = std::os::unix::net::UnixDatagram::bind(&journal).expect("bind the journal again");
    socket
        .set_read_timeout(Some(std::time::Duration::from_secs(20)))
        .unwrap();
    let me = one_connection(&net, SocketAddr::new(net.ip(1), 8080), b"")
        .await
        .to_string();
    let again = entries_until(socket, me).await;
    assert_eq!(
        field(again.last().unwrap(), "LOAD_BALANCER").as_deref(),
        Some("default/web")
    );
}

/// The entries the stand-in journal `socket` receives until the one naming
/// `client` (at most 200, each within the socket's read timeout).
async fn entries_until(socket: std::os::unix::net::UnixDatagram, client: String) -> Vec<String> {
    tokio::task::spawn_blocking(move || {
        let mut entries = Vec::new();
        let mut buf = vec![0u8; 65_536];
        for _ in 0..200 {
            let n = socket.recv(&mut buf).expect("an entry within 20 s");
            let entry = String::from_utf8_lossy(&buf[..n]).into_owned();
            let done = entry.contains(&format!("CLIENT={client}\n"));
            entries.push(entry);
            if done {
                break;
            }
        }
        entries
    })
    .await
    .unwrap()
}

/// The text log quotes every load balancer, cluster and listener name the
/// same way (the connection log always did; the health, listening and
/// other lines wrote them bare), and a backend's recovery has no empty
/// `error=""`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn names_are_quoted_alike_and_a_recovery_has_no_empty_error() {
    let net = Subnet::new();
    let backend = SocketAddr::new(net.ip(11), 30080);
    let config = Config::on(&net).lb(Lb::new("default/web", net.ip(1))
        .backends(net.ips(&[11]))
        .tcp("http", 8080, 30080)
        .health(
            "  port = 30080\n  failure_threshold = 1\n  period_seconds = 1\n  timeout_seconds = 1",
        ));
    let path = net.write("config.toml", &config.to_string());
    let mut process = support::Process::launch(&path).spawn();
    process.wait_ready(SocketAddr::new(net.ip(250), 9901)).await;
    let wait = std::time::Duration::from_secs(20);
    let line_with = |process: &support::Process, needle: &'static str| {
        let found = process.lines().into_iter().find(|l| l.contains(needle));
        async move { found }
    };
    let down = support::wait_for(wait, "the backend marked down", || {
        line_with(&process, "to=unhealthy")
    })
    .await;
    let _b = Backend::start(backend, Behaviour::NameThenEcho).await;
    let up = support::wait_for(wait, "the backend back up", || {
        line_with(&process, "to=healthy")
    })
    .await;
    let listening = line_with(&process, " listening")
        .await
        .expect("listening line");

    for line in [&down, &up] {
        assert!(
            line.contains("load_balancer=\"default/web\" cluster=\"kubernetes\""),
            "{line}"
        );
    }
    assert!(down.contains("error=\"connection refused\""), "{down}");
    assert!(!up.contains("error="), "{up}");
    assert!(
        listening.contains("load_balancer=\"default/web\" listener=\"http\""),
        "{listening}"
    );
}

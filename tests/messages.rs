//! What the daemon says of itself and how it says it (issue 43, "Messages
//! and logs"): `--version`, `/status` and `/metrics` name the build's
//! commit, `/status` the process's uptime, `/metrics` the standard
//! `process_*` series; the package, unit and help say what it balances.

mod support;

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

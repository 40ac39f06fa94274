//! `harvester-lb status` against a running daemon: the table shows each
//! backend's health, operator state, runs and last probe; `--json` is the
//! daemon's `/status`; the admin socket is used when it can be opened, the
//! TCP listener otherwise; an unreachable daemon is exit 69.

mod support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use support::{Backend, Behaviour, Config, Daemon, Lb, Subnet, cli};

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

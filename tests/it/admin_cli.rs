//! The admin commands when they are needed most: after a bad hand edit
//! (which the running daemon rejected and ignores), with the daemon down,
//! dead, out of reach or hung. Every command that talks to the daemon
//! takes `--socket`; with `--config` it reads only `admin.socket` (and
//! `admin.listen` for `status`) from the file, tolerantly; and each way of
//! not reaching the daemon says which it is and what to do. `/status`
//! carries the running config's hash, the last rejected reload while it
//! stands, and what a reload changed that needs a restart.
//!
//! Real daemon (in this process) and real `harvester-lb` processes on
//! loopback and Unix sockets in the test's own directory.

use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use support::{Backend, Behaviour, Config, Daemon, Lb, Subnet, cli, http_unix, wait_for};

/// One load balancer with one healthy backend (no health check: healthy
/// from the start).
fn web(net: &Subnet) -> Lb {
    Lb::new("default/web", net.ip(100))
        .backends(net.ips(&[1]))
        .tcp("http", 8080, 30080)
}

fn s(parts: &[&str]) -> Vec<String> {
    parts.iter().map(|p| p.to_string()).collect()
}

/// A hand edit the daemon refuses: the file parses, one value is wrong.
const BAD_VALUE: &str = "\n[[load_balancer]]\nname = \"default/broken\"\nvip = \"not-an-ip\"\nbackends = [\"10.0.0.1\"]\n";
/// A hand edit that is not TOML at all.
const BAD_SYNTAX: &str = "\n[[load_balancer]\nname = default/broken\n";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn admin_commands_need_only_the_socket_not_a_valid_file() {
    let net = Subnet::new();
    let good = Config::on(&net).lb(web(&net)).to_string();
    let backend = Backend::start(SocketAddr::new(net.ip(1), 30080), Behaviour::NameThenEcho).await;
    let daemon = Daemon::start(&net, &good).await;
    let config = daemon.config.to_str().unwrap().to_string();
    let socket = daemon.socket.to_str().unwrap().to_string();
    let ip = net.ip_str(1);

    for (what, edit) in [("a bad value", BAD_VALUE), ("a syntax error", BAD_SYNTAX)] {
        std::fs::write(&daemon.config, format!("{good}{edit}")).unwrap();

        let (code, table, stderr) = cli(s(&["status", "--config", &config])).await;
        assert_eq!(code, 0, "status -c after {what}: {stderr}");
        assert!(table.contains("default/web"), "{what}: {table}");

        let (code, table, stderr) = cli(s(&["status", "--socket", &socket])).await;
        assert_eq!(code, 0, "status --socket after {what}: {stderr}");
        assert!(table.contains("default/web"), "{what}: {table}");

        // The file's own admin.socket, not the default one.
        let (code, out, stderr) = cli(s(&[
            "backend",
            "drain",
            "--lb",
            "default/web",
            &ip,
            "-c",
            &config,
        ]))
        .await;
        assert_eq!(code, 0, "backend drain -c after {what}: {stderr}");
        assert!(out.contains("ready -> drain"), "{what}: {out}");
        let (code, _, stderr) = cli(s(&[
            "backend",
            "ready",
            "--lb",
            "default/web",
            &ip,
            "--socket",
            &socket,
        ]))
        .await;
        assert_eq!(code, 0, "backend ready --socket after {what}: {stderr}");

        // The daemon itself refuses the file: its problems, exit 78.
        let (code, _, stderr) = cli(s(&["reload", "--socket", &socket])).await;
        assert_eq!(code, 78, "reload --socket after {what}: {stderr}");
        assert!(
            stderr.contains("default/broken") || stderr.contains("line"),
            "{what}: {stderr}"
        );
    }
    // The unit's ExecStop= too: asked, not refused for the file (no
    // descriptor store in this process: the daemon answers that the stop
    // drains).
    let (code, out, stderr) = cli(s(&["prepare-stop", "--restart", "-c", &config])).await;
    assert_eq!(code, 0, "prepare-stop -c after a bad edit: {out}{stderr}");
    assert!(
        format!("{out}{stderr}").contains("restart"),
        "{out}{stderr}"
    );
    daemon.stop().await;
    backend.stop();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bad_admin_socket_key_is_named_never_replaced_by_the_default() {
    let net = Subnet::new();
    let file = net.write(
        "relative.toml",
        "[admin]\nsocket = \"admin.sock\"\n\n[proxy]\ndrain_timeout_seconds = \"x\"\n",
    );
    let file = file.to_str().unwrap();
    let (code, _, stderr) = cli(s(&[
        "backend",
        "drain",
        "--lb",
        "default/web",
        "10.0.0.1",
        "-c",
        file,
    ]))
    .await;
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("admin.socket")
            && stderr.contains("line 2")
            && stderr.contains("--socket")
            && !stderr.contains("no admin socket at"),
        "{stderr}"
    );
    // A file that cannot be read names itself, and the way around it.
    let missing = net.dir().join("missing.toml");
    let (code, _, stderr) = cli(s(&["host", "drain", "-c", missing.to_str().unwrap()])).await;
    assert_eq!(code, 78, "{stderr}");
    assert!(
        stderr.contains("missing.toml") && stderr.contains("--socket"),
        "{stderr}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_way_of_not_reaching_the_daemon_says_which_and_what_to_do() {
    let net = Subnet::new();
    // No socket file: not running, or another path.
    let none = net.dir().join("none.sock");
    let (code, _, stderr) = cli(s(&["reload", "--socket", none.to_str().unwrap()])).await;
    assert_eq!(code, 69, "{stderr}");
    assert!(
        stderr.contains("not running") && stderr.contains("systemctl status"),
        "{stderr}"
    );

    // A socket file nobody listens on: a daemon that died.
    let stale = net.dir().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    let (code, _, stderr) = cli(s(&["status", "--socket", stale.to_str().unwrap()])).await;
    assert_eq!(code, 69, "{stderr}");
    assert!(
        stderr.contains("stale") && stderr.contains("died"),
        "{stderr}"
    );

    // A socket that accepts and never answers: a hung daemon (status
    // waits 10 s).
    let hung = net.dir().join("hung.sock");
    let _hung = std::os::unix::net::UnixListener::bind(&hung).unwrap();
    let (code, _, stderr) = cli(s(&["status", "--socket", hung.to_str().unwrap()])).await;
    assert_eq!(code, 69, "{stderr}");
    assert!(
        stderr.contains("did not answer") && stderr.contains("hung"),
        "{stderr}"
    );

    // The daemon's socket (mode 0600) for another user: run as root.
    let daemon = Daemon::start(&net, Config::on(&net).lb(web(&net))).await;
    let socket = daemon.socket.to_str().unwrap().to_string();
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("setpriv")
            .args(["--reuid=65534", "--regid=65534", "--clear-groups"])
            .arg(env!("CARGO_BIN_EXE_harvester-lb"))
            .args(["host", "drain", "--socket", &socket])
            .output()
    })
    .await
    .unwrap();
    match out {
        Ok(out) => {
            let (code, _, stderr) = support::outcome(&out);
            assert_eq!(code, 69, "{stderr}");
            assert!(
                stderr.contains("permission denied") && stderr.contains("as root"),
                "{stderr}"
            );
        }
        Err(e) => eprintln!("setpriv cannot run ({e}): the permission case is not tested"),
    }
    daemon.stop().await;
}

/// `sha256sum FILE`'s digest.
fn sha256(path: &Path) -> String {
    let out = std::process::Command::new("sha256sum")
        .arg(path)
        .output()
        .expect("sha256sum");
    String::from_utf8_lossy(&out.stdout)
        .split_whitespace()
        .next()
        .unwrap()
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn status_carries_the_rejected_reload_and_the_running_configs_hash() {
    let net = Subnet::new();
    let good = Config::on(&net).lb(web(&net)).to_string();
    let daemon = Daemon::start(&net, &good).await;
    let config = daemon.config.to_str().unwrap().to_string();
    let first = sha256(&daemon.config);
    let doc = daemon.status().await;
    assert_eq!(doc["config"]["sha256"], first.as_str(), "{doc:#}");
    assert_eq!(doc["config"]["path"], config.as_str());
    assert!(doc["config"]["rejected_reload"].is_null(), "{doc:#}");

    // A bad hand edit, reloaded through the socket: refused, and /status
    // says so (when, how asked, every problem) while it stands.
    std::fs::write(&daemon.config, format!("{good}{BAD_VALUE}")).unwrap();
    let (code, body) = http_unix(&daemon.socket, "POST", "/reload", "").await;
    assert_eq!(code, 422, "{body}");
    let doc = daemon.status().await;
    let rejected = &doc["config"]["rejected_reload"];
    assert_eq!(rejected["source"], "admin socket", "{doc:#}");
    assert!(rejected["at_unix"].as_f64().unwrap() > 1.0e9, "{doc:#}");
    assert_eq!(
        rejected["sha256"],
        sha256(&daemon.config).as_str(),
        "{doc:#}"
    );
    let problems = rejected["problems"].as_array().expect("problems");
    assert!(
        problems
            .iter()
            .any(|p| p.as_str().unwrap().contains("not-an-ip")),
        "{doc:#}"
    );
    // The running config is still the first file.
    assert_eq!(doc["config"]["sha256"], first.as_str(), "{doc:#}");
    let (code, table, stderr) = cli(s(&["status", "-c", &config])).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        table.contains("last reload rejected") && table.contains("not-an-ip"),
        "{table}"
    );
    assert!(table.contains(&first[..12]), "{table}");

    // Fixed and reloaded: the rejection is gone, the hash is the new file's.
    let fixed = format!("{good}\n# fixed\n");
    std::fs::write(&daemon.config, &fixed).unwrap();
    let (code, _, stderr) = cli(s(&["reload", "-c", &config])).await;
    assert_eq!(code, 0, "{stderr}");
    let doc = daemon.status().await;
    assert!(doc["config"]["rejected_reload"].is_null(), "{doc:#}");
    assert_eq!(doc["config"]["sha256"], sha256(&daemon.config).as_str());
    assert_ne!(doc["config"]["sha256"], first.as_str());
    daemon.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_that_changes_admin_listen_says_it_needs_a_restart() {
    let net = Subnet::new();
    let lb = web(&net);
    let daemon = Daemon::start(&net, Config::on(&net).lb(lb.clone())).await;
    let config = daemon.config.to_str().unwrap().to_string();
    let moved = Config::on(&net)
        .admin(SocketAddr::new(net.ip(250), 9902))
        .lb(lb.clone())
        .to_string();
    std::fs::write(&daemon.config, moved).unwrap();
    let (code, out, stderr) = cli(s(&["reload", "-c", &config])).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(
        out.contains("needs a restart: admin.listen"),
        "reload's answer: {out}"
    );
    let doc = daemon.status().await;
    assert_eq!(
        doc["config"]["needs_restart"],
        serde_json::json!(["admin.listen"]),
        "{doc:#}"
    );
    // The API is still where it was: the table says why.
    let (code, table, stderr) =
        cli(s(&["status", "--socket", daemon.socket.to_str().unwrap()])).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.contains("needs a restart: admin.listen"), "{table}");

    // Back to the address in force: nothing to restart for.
    std::fs::write(&daemon.config, Config::on(&net).lb(lb).to_string()).unwrap();
    let (code, _, stderr) = cli(s(&["reload", "-c", &config])).await;
    assert_eq!(code, 0, "{stderr}");
    wait_for(
        Duration::from_secs(10),
        "needs_restart to clear",
        || async {
            let doc = daemon.status().await;
            doc["config"]["needs_restart"]
                .as_array()
                .is_some_and(Vec::is_empty)
                .then_some(())
        },
    )
    .await;
    daemon.stop().await;
}

/// operations.md said `systemctl reload` (`harvester-lb reload`) falls back
/// to `admin.listen` when the socket is missing; it never did, and must
/// not (whoever binds that port first could answer "reloaded"): exit 69
/// naming the socket, and the daemon on `admin.listen` is not asked.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reload_never_falls_back_to_admin_listen() {
    let net = Subnet::new();
    let daemon = Daemon::start(&net, Config::on(&net).lb(web(&net))).await;
    let elsewhere = net.write(
        "elsewhere.toml",
        &Config::on(&net)
            .socket(&net.dir().join("elsewhere.sock"))
            .lb(web(&net))
            .to_string(),
    );
    let before = daemon
        .metric("harvester_lb_config_reloads_total{result=\"success\"}")
        .await;
    let (code, _, stderr) = cli(s(&["reload", "-c", elsewhere.to_str().unwrap()])).await;
    assert_eq!(code, 69, "{stderr}");
    assert!(
        stderr.contains("elsewhere.sock") && stderr.contains("never on admin.listen"),
        "{stderr}"
    );
    let after = daemon
        .metric("harvester_lb_config_reloads_total{result=\"success\"}")
        .await;
    assert_eq!(before, after, "the daemon on admin.listen was asked");
    daemon.stop().await;
}

/// `withdraw --all` (the unit's `ExecStopPost=`) after a hand-over looks for
/// the `handed-over` marker beside the admin socket: a file with a bad hand
/// edit must still lead it to the configured socket's directory, or the
/// restart withdraws every route it was meant to keep. Run in a network
/// namespace of its own, so nothing of this host's is touched either way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn withdraw_finds_the_hand_over_marker_beside_a_broken_files_socket() {
    let net = Subnet::new();
    let socket = net.dir().join("admin.sock");
    let boot_id = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    std::fs::write(
        net.dir().join("handed-over"),
        serde_json::json!({"boot_id": boot_id.trim(), "pid": 4242, "at": now}).to_string(),
    )
    .unwrap();
    let file = net.write(
        "config.toml",
        &format!(
            "[admin]\nsocket = \"{}\"\n\n[vip]\nannounce = \"routes\"\n{BAD_VALUE}",
            socket.display()
        ),
    );
    let out = tokio::task::spawn_blocking(move || {
        std::process::Command::new("unshare")
            .arg("--net")
            .arg(env!("CARGO_BIN_EXE_harvester-lb"))
            .args(["withdraw", "--all", "-c", file.to_str().unwrap()])
            .output()
            .expect("unshare")
    })
    .await
    .unwrap();
    let (code, stdout, stderr) = support::outcome(&out);
    assert_eq!(code, 0, "{stdout}{stderr}");
    assert!(
        stdout.contains("handed over to the next process by process 4242"),
        "{stdout}{stderr}"
    );
}

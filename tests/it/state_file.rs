//! The state file across a stop and a start of the real binary (issue 41,
//! item 2): operator states, health verdicts and their counters come back
//! before the first probe and the first connection; a file that cannot be
//! trusted is one warning and a normal start. Each test owns a
//! 127.A.B.0/24, its config and its state file (`daemon.state_file`), and
//! stops the first process with SIGTERM as systemd does.
//!
//! Left out: systemd itself (`$STATE_DIRECTORY` is a unit test of the
//! path; the unit's `StateDirectory=` is checked by .ci/systemd-check.sh),
//! and a crash in the middle of a write, which a test cannot time: the
//! write's two halves are driven apart in `state_file`'s unit tests, and
//! here a leftover half-written temporary file is met at start.

use crate::support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::*;
use tokio::net::TcpStream;

const LB: &str = "default/web";

fn admin(net: &Subnet) -> SocketAddr {
    SocketAddr::new(net.ip(250), 9901)
}

fn state_path(net: &Subnet) -> PathBuf {
    net.dir().join("state").join("state.json")
}

fn vip(net: &Subnet) -> SocketAddr {
    SocketAddr::new(net.ip(1), 8080)
}

/// The config: `lb` plus `[daemon] state_file` in the test's directory.
fn config(net: &Subnet, lb: Lb) -> Config {
    Config::on(net)
        .drain_timeout(1)
        .text(&format!(
            "[daemon]\nstate_file = {}",
            quote(state_path(net).display())
        ))
        .lb(lb)
}

/// Starts the binary on `cfg` and waits until it is ready.
async fn start(net: &Subnet, cfg: &Path) -> Process {
    let mut p = Process::start(cfg, &[]);
    p.wait_ready(admin(net)).await;
    p
}

/// SIGTERM, and the exit after the drain.
async fn stop(mut p: Process) {
    p.signal(libc::SIGTERM);
    assert_eq!(
        p.exit_code(Duration::from_secs(30)).await,
        0,
        "{}",
        p.log_tail(20)
    );
}

async fn status(net: &Subnet) -> serde_json::Value {
    let (code, body) = http(admin(net), "GET", "/status").await;
    assert_eq!(code, 200, "/status: {body}");
    serde_json::from_str(&body).expect("/status is JSON")
}

fn backend<'a>(status: &'a serde_json::Value, ip: &str) -> &'a serde_json::Value {
    status["load_balancers"]
        .as_array()
        .expect("load_balancers")
        .iter()
        .find(|l| l["name"] == LB)
        .expect("the load balancer")["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .find(|b| b["address"] == ip)
        .unwrap_or_else(|| panic!("no backend {ip}"))
}

/// `POST /backends/state` on the admin socket, for a backend of [`LB`].
async fn set_state(net: &Subnet, backend: &str, state: &str) {
    set_state_of(net, LB, backend, state).await;
}

/// `POST /backends/state` on the admin socket.
async fn set_state_of(net: &Subnet, lb: &str, backend: &str, state: &str) {
    let body =
        format!(r#"{{"load_balancer": "{lb}", "backend": "{backend}", "state": "{state}"}}"#);
    let (code, answer) = http_unix(
        &net.dir().join("admin.sock"),
        "POST",
        "/backends/state",
        &body,
    )
    .await;
    assert_eq!(code, 200, "{answer}");
}

/// Which backend serves a new connection through the VIP (its name
/// line), or the error the client met.
async fn served_by(vip: SocketAddr) -> Result<String, String> {
    let mut s = TcpStream::connect(vip).await.map_err(|e| e.to_string())?;
    tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
        .await
        .map_err(|_| "no name line within 5 s".to_string())?
        .map_err(|e| e.to_string())
}

/// Waits until `/status` says backend `ip` is `health`.
async fn wait_health(net: &Subnet, ip: &str, health: &str, within: Duration) {
    wait_for(within, &format!("{ip} to be {health}"), || async {
        (backend(&status(net).await, ip)["health"] == health).then_some(())
    })
    .await;
}

/// A stop and a start keep an operator's `drain` and `maint`: before this
/// change a restart put every backend back to `ready`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_maint_survive_a_stop_and_a_start() {
    let net = Subnet::new();
    let _nodes: Vec<Backend> = nodes(&net, &[11, 12, 13]).await;
    let lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(&[11, 12, 13]))
        .tcp("web", 8080, 30080);
    let cfg = net.write("config.toml", &config(&net, lb).to_string());
    let p = start(&net, &cfg).await;
    set_state(&net, &net.ip_str(11), "drain").await;
    set_state(&net, &net.ip_str(12), "maint").await;
    stop(p).await;
    assert!(state_path(&net).exists(), "the stop wrote the state file");

    let p = start(&net, &cfg).await;
    let s = status(&net).await;
    assert_eq!(backend(&s, &net.ip_str(11))["admin_state"], "drain", "{s}");
    assert_eq!(backend(&s, &net.ip_str(12))["admin_state"], "maint", "{s}");
    assert_eq!(backend(&s, &net.ip_str(13))["admin_state"], "ready", "{s}");
    assert_eq!(
        s["state_file"]["outcome"], "restored",
        "{}",
        s["state_file"]
    );
    assert_eq!(s["state_file"]["restored"]["operator_states"], 2);
    for _ in 0..6 {
        assert_eq!(served_by(vip(&net)).await, Ok(net.ip_str(13)));
    }
    let (_, metrics) = http(admin(&net), "GET", "/metrics").await;
    assert_eq!(
        metric_value(
            &metrics,
            "harvester_lb_state_restored{kind=\"operator_state\"}"
        ),
        2.0
    );
    assert_eq!(
        metric_value(
            &metrics,
            "harvester_lb_state_file_outcome{outcome=\"restored\"}"
        ),
        1.0
    );
    promtool_accepts(&metrics);
    p.wait_logged("state restored").await;
    stop(p).await;
}

async fn nodes(net: &Subnet, hosts: &[u8]) -> Vec<Backend> {
    let mut v = Vec::new();
    for h in hosts {
        v.push(Backend::start(SocketAddr::new(net.ip(*h), 30080), Behaviour::NameThenEcho).await);
    }
    v
}

/// A first run with a health check whose verdicts take several periods
/// to form (three results either way, every 6 s; `initial` before the
/// first), backend .11 alive and the others of `backends` dead (nothing
/// listens on their nodeport or health port), one connect attempt per
/// client; one verdict per backend on port 30081, or with `per_port` one
/// per nodeport (no `port`: the check probes 30080 itself); stopped once
/// `.watched` is `health`. Without the file a restarted
/// daemon needs at least one period (the second probe comes at a phase of
/// the period, the third a period later) to relearn either verdict. Returns
/// the config file and the live backend's two listeners.
async fn first_run_with_slow_check(
    net: &Subnet,
    backends: &[u8],
    initial: &str,
    per_port: bool,
    watched: (u8, &str),
) -> (PathBuf, [Backend; 2]) {
    let live = [
        Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await,
        Backend::start(SocketAddr::new(net.ip(11), 30081), Behaviour::Echo).await,
    ];
    let lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(backends))
        .tcp("web", 8080, 30080)
        .keys(&format!("initial_state = \"{initial}\"\nconnect_attempts = 1"))
        .health(
            "  period_seconds = 6\n  timeout_seconds = 1\n  success_threshold = 3\n  failure_threshold = 3",
        );
    let lb = if per_port { lb } else { lb.health_port(30081) };
    let cfg = net.write("config.toml", &config(net, lb).to_string());
    let p = start(net, &cfg).await;
    let (host, health) = watched;
    wait_health(net, &net.ip_str(host), health, Duration::from_secs(40)).await;
    stop(p).await;
    (cfg, live)
}

/// A dead backend is not picked in the first moments after a restart: its
/// verdict comes back with the file. Before, it started `healthy` and took
/// every other connection (failing it: one connect attempt) until three
/// probes had failed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_backend_stays_out_right_after_a_restart() {
    dead_backend_stays_out(false).await;
}

/// The same with a check without `port`: the verdict is the nodeport's own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_dead_nodeport_stays_out_right_after_a_restart() {
    dead_backend_stays_out(true).await;
}

async fn dead_backend_stays_out(per_port: bool) {
    let net = Subnet::new();
    let (cfg, _live) =
        first_run_with_slow_check(&net, &[11, 12], "healthy", per_port, (12, "unhealthy")).await;
    // The verdict's detail: the backend's, or its one nodeport's.
    let probe = |s: &serde_json::Value| {
        let b = backend(s, &net.ip_str(12));
        let p = if per_port {
            &b["ports"][0]["probe"]
        } else {
            &b["probe"]
        };
        (b["health"].clone(), p.clone())
    };

    let p = start(&net, &cfg).await;
    let s = status(&net).await;
    let (health, detail) = probe(&s);
    assert_eq!(health, "unhealthy", "{detail}");
    // Three restored, and the first probe of this process may have added
    // one; fewer probes than the threshold since the start, so no verdict
    // of this process could have taken it out yet (no clock asserted: the
    // third probe comes a whole period after the start).
    assert!(
        detail["consecutive_failures"].as_u64() >= Some(3),
        "{detail}"
    );
    assert!(detail["probes"].as_u64() < Some(3), "{detail}");
    for _ in 0..6 {
        assert_eq!(served_by(vip(&net)).await, Ok(net.ip_str(11)));
    }
    assert_eq!(
        s["state_file"]["restored"]["verdicts"], 2,
        "{}",
        s["state_file"]
    );
    stop(p).await;
}

/// With `initial_state = "unhealthy"`, a live backend serves right after a
/// restart: before, the restart was an outage of three successful probes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_backend_serves_right_after_a_restart_with_initial_state_unhealthy() {
    let net = Subnet::new();
    let (cfg, _live) =
        first_run_with_slow_check(&net, &[11], "unhealthy", false, (11, "healthy")).await;

    let p = start(&net, &cfg).await;
    let live = backend(&status(&net).await, &net.ip_str(11)).clone();
    assert_eq!(live["health"], "healthy", "{live}");
    // Healthy before this process could have seen three successes.
    assert!(live["probe"]["probes"].as_u64() < Some(3), "{live}");
    assert_eq!(served_by(vip(&net)).await, Ok(net.ip_str(11)));
    stop(p).await;
}

/// Writes a state file of a first run with backend .11 drained; returns the
/// config file and the state file's JSON.
async fn first_run(net: &Subnet) -> (PathBuf, serde_json::Value) {
    let lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(&[11, 12]))
        .tcp("web", 8080, 30080);
    let cfg = net.write("config.toml", &config(net, lb).to_string());
    let p = start(net, &cfg).await;
    set_state(net, &net.ip_str(11), "drain").await;
    stop(p).await;
    let text = std::fs::read_to_string(state_path(net)).expect("the state file");
    (cfg, serde_json::from_str(&text).expect("JSON"))
}

/// Starts on a state file made `bad`, and checks the one warning naming
/// the file and `reason`, the normal start (the drain not restored) and
/// `/status`'s outcome `kind`.
async fn ignored_with_one_warning(net: &Subnet, cfg: &Path, bad: &[u8], kind: &str, reason: &str) {
    std::fs::write(state_path(net), bad).expect("write the bad file");
    let p = start(net, cfg).await;
    let s = status(net).await;
    assert_eq!(s["state_file"]["outcome"], kind, "{}", s["state_file"]);
    assert_eq!(backend(&s, &net.ip_str(11))["admin_state"], "ready");
    let line = the_state_file_line(&p, "state file ignored").await;
    let file = state_path(net).display().to_string();
    assert!(line.contains(&file) && line.contains(reason), "{line}");
    stop(p).await;
}

/// Waits for the log line holding `needle` and returns it, checking it is
/// the one line about the state file, at warn.
async fn the_state_file_line(p: &Process, needle: &str) -> String {
    let log = p.wait_logged(needle).await;
    let lines: Vec<&str> = log.lines().filter(|l| l.contains("state file")).collect();
    assert_eq!(lines.len(), 1, "one line about the state file: {lines:#?}");
    assert!(lines[0].contains("WARN"), "{}", lines[0]);
    lines[0].to_string()
}

/// A corrupt, a stale and another config's file: each one warning with the
/// file and why, and a start as without it. Before, there was no file.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_corrupt_stale_or_foreign_state_file_is_one_warning_and_a_normal_start() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12]).await;
    let (cfg, good) = first_run(&net).await;
    assert_eq!(
        good["load_balancers"][LB]["backends"][net.ip_str(11)]["admin"],
        "drain"
    );

    let text = serde_json::to_vec(&good).unwrap();
    ignored_with_one_warning(
        &net,
        &cfg,
        &text[..text.len() / 2],
        "corrupt",
        "not a valid state file",
    )
    .await;

    let written = good["written_unix"].as_f64().unwrap();
    let edits = [
        (
            "written_unix",
            serde_json::json!(written - 3.0 * 86400.0),
            "stale",
            "too old to trust",
        ),
        (
            "config",
            serde_json::json!("/etc/other/config.toml"),
            "other_config",
            "/etc/other/config.toml",
        ),
        (
            "version",
            serde_json::json!(99),
            "unknown_version",
            "version 99",
        ),
    ];
    for (key, value, kind, reason) in edits {
        let mut bad = good.clone();
        bad[key] = value;
        let bytes = serde_json::to_vec(&bad).unwrap();
        ignored_with_one_warning(&net, &cfg, &bytes, kind, reason).await;
    }
}

/// A load balancer whose backends changed while the daemon was down loses
/// its entries alone, with one warning naming it; the other keeps its own.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_changed_load_balancer_loses_its_entries_alone() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12, 13]).await;
    let two = |backends: &[u8]| {
        config(
            &net,
            Lb::new(LB, net.ip(1))
                .backends(net.ips(&[11, 12]))
                .tcp("web", 8080, 30080),
        )
        .lb(Lb::new("default/other", net.ip(2))
            .backends(net.ips(backends))
            .tcp("web", 8080, 30080))
        .to_string()
    };
    let cfg = net.write("config.toml", &two(&[11, 12]));
    let p = start(&net, &cfg).await;
    set_state(&net, &net.ip_str(11), "drain").await;
    set_state_of(&net, "default/other", &net.ip_str(11), "drain").await;
    stop(p).await;

    net.write("config.toml", &two(&[11, 12, 13]));
    let p = start(&net, &cfg).await;
    let s = status(&net).await;
    assert_eq!(
        backend(&s, &net.ip_str(11))["admin_state"],
        "drain",
        "kept: {LB} did not change"
    );
    assert_eq!(
        s["state_file"]["load_balancers_changed"],
        serde_json::json!(["default/other"])
    );
    let other = s["load_balancers"]
        .as_array()
        .unwrap()
        .iter()
        .find(|l| l["name"] == "default/other")
        .unwrap();
    assert_eq!(
        other["backends"][0]["admin_state"], "ready",
        "dropped: its backends changed"
    );
    let line = the_state_file_line(&p, "were dropped").await;
    assert!(
        line.contains("default/other") && !line.contains(LB),
        "{line}"
    );
    stop(p).await;
}

/// A write cut short leaves at most a half-written temporary file beside
/// the state file, never a half state file: the next start restores from
/// the whole one, and its first write replaces the leftover.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_half_written_temporary_file_leaves_the_state_file_whole() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12]).await;
    let (cfg, _) = first_run(&net).await;
    let tmp = state_path(&net).with_file_name(".state.json.tmp");
    std::fs::write(&tmp, b"{\"version\": 1, \"written_unix\": 17").expect("a leftover");
    let p = start(&net, &cfg).await;
    let s = status(&net).await;
    assert_eq!(
        backend(&s, &net.ip_str(11))["admin_state"],
        "drain",
        "restored from the whole file"
    );
    wait_for(
        Duration::from_secs(10),
        "the leftover to be replaced",
        || async { (!tmp.exists()).then_some(()) },
    )
    .await;
    // Killed without a chance to write: the file is still the last whole one.
    drop(p);
    let text = std::fs::read_to_string(state_path(&net)).expect("the state file");
    let v: serde_json::Value = serde_json::from_str(&text).expect("whole JSON");
    assert_eq!(
        v["load_balancers"][LB]["backends"][net.ip_str(11)]["admin"],
        "drain"
    );
}

/// The file changes within a couple of seconds of an operator's state
/// change, without a stop: a daemon killed (SIGKILL, a crash) comes back
/// with it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_is_written_within_seconds_and_survives_a_kill() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12]).await;
    let lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(&[11, 12]))
        .tcp("web", 8080, 30080);
    let cfg = net.write("config.toml", &config(&net, lb).to_string());
    let p = start(&net, &cfg).await;
    set_state(&net, &net.ip_str(12), "maint").await;
    let path = state_path(&net);
    let ip = net.ip_str(12);
    wait_for(Duration::from_secs(10), "the maint in the file", || async {
        let text = std::fs::read_to_string(&path).ok()?;
        let v: serde_json::Value = serde_json::from_str(&text).ok()?;
        (v["load_balancers"][LB]["backends"][&ip]["admin"] == "maint").then_some(())
    })
    .await;
    p.signal(libc::SIGKILL);
    drop(p);
    let p = start(&net, &cfg).await;
    assert_eq!(backend(&status(&net).await, &ip)["admin_state"], "maint");
    stop(p).await;
}

/// `sessionAffinity` entries come back: four clients pinned in one run
/// keep their backends after a restart, asked in the reverse order (a fresh
/// round robin would give the first of them the first backend). Before,
/// the table started empty.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn affinity_entries_survive_a_stop_and_a_start() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12]).await;
    let lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(&[11, 12]))
        .keys("session_affinity = \"client_ip\"\naffinity_timeout_seconds = 600")
        .tcp("web", 8080, 30080);
    let cfg = net.write("config.toml", &config(&net, lb).to_string());
    let clients = net.ips(&[101, 102, 103, 104]);
    let to = vip(&net);
    let p = start(&net, &cfg).await;
    let mut before = Vec::new();
    for c in &clients {
        before.push(pinned_to(*c, to).await);
    }
    assert!(
        before.contains(&net.ip_str(11)) && before.contains(&net.ip_str(12)),
        "{before:?}"
    );
    stop(p).await;

    let p = start(&net, &cfg).await;
    for (c, was) in clients.iter().zip(&before).rev() {
        assert_eq!(&pinned_to(*c, to).await, was, "client {c}");
    }
    let s = status(&net).await;
    assert_eq!(
        s["state_file"]["restored"]["affinity_entries"], 4,
        "{}",
        s["state_file"]
    );
    stop(p).await;
}

/// The backend a connection from `client` through `vip` reaches.
async fn pinned_to(client: std::net::IpAddr, vip: SocketAddr) -> String {
    let mut s = connect_from(client, vip).await.expect("connect");
    read_line(&mut s).await.expect("name line")
}

/// A restart by hand-over (`prepare-stop --restart`, SIGTERM, the next
/// process started with the stored sockets, as `systemctl restart` under
/// the unit) keeps a drain and a maint as the stop and start does: the
/// hand-over writes the file, and the next process reads it before it
/// serves on the adopted sockets.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drain_and_maint_survive_a_restart_by_hand_over() {
    let net = Subnet::new();
    let _nodes = nodes(&net, &[11, 12, 13]).await;
    let lb = Lb::new(LB, net.ip(1))
        .backends(net.ips(&[11, 12, 13]))
        .tcp("web", 8080, 30080);
    let cfg = net.write("config.toml", &config(&net, lb).to_string());
    let store = support::fd_store::FakeStore::new(net.dir(), 64);
    let mut p = store.launch(Process::launch(&cfg));
    p.wait_ready(admin(&net)).await;
    set_state(&net, &net.ip_str(11), "drain").await;
    set_state(&net, &net.ip_str(12), "maint").await;
    let (code, out, err) = cli(vec![
        "prepare-stop".into(),
        "--config".into(),
        cfg.display().to_string(),
        "--restart".into(),
    ])
    .await;
    assert_eq!(code, 0, "prepare-stop: {out}{err}");
    p.signal(libc::SIGTERM);
    assert_eq!(
        p.exit_code(Duration::from_secs(30)).await,
        0,
        "{}",
        p.log_tail(20)
    );
    p.wait_logged("handed over").await;

    let mut p = store.launch(Process::launch(&cfg));
    p.wait_ready(admin(&net)).await;
    let s = status(&net).await;
    assert_eq!(backend(&s, &net.ip_str(11))["admin_state"], "drain", "{s}");
    assert_eq!(backend(&s, &net.ip_str(12))["admin_state"], "maint", "{s}");
    assert!(
        s["restart"]["adopted_listening_sockets"].as_u64() > Some(0),
        "{}",
        s["restart"]
    );
    for _ in 0..6 {
        assert_eq!(served_by(vip(&net)).await, Ok(net.ip_str(13)));
    }
    stop(p).await;
}

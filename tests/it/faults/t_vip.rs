//! The VIP itself: with `vip.isolate`, only its listeners' ports answer on
//! it, whatever else the host runs on its wildcard addresses.

use std::io::ErrorKind;
use std::net::Ipv4Addr;
use std::time::Duration;

use tokio::io::AsyncWriteExt;

use crate::netns::peers::{Exchange, Node, Service, exchange, read_line};
use crate::netns::{Bed, LB_IP, VIP, VIP2, config, lb, run, sa, wait_for};
use crate::require_netns;

/// What a client in the client namespace meets at `addr`.
#[derive(Debug, PartialEq, Eq)]
enum Meets {
    /// The host's own service answered (it writes `host\n`).
    HostService,
    /// Connection refused: a reset, at once.
    Refused,
    /// No answer within the timeout: dropped.
    Nothing,
    /// Anything else (a load-balanced node answered, …).
    Other(String),
}

async fn meets(bed: &Bed, ip: Ipv4Addr, port: u16) -> Meets {
    match bed
        .client
        .connect(sa(ip, port), Duration::from_secs(1))
        .await
    {
        Ok(mut s) => match tokio::time::timeout(Duration::from_secs(5), read_line(&mut s)).await {
            Ok(Ok(line)) if line == "host" => Meets::HostService,
            other => Meets::Other(format!("{other:?}")),
        },
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => Meets::Refused,
        Err(e) if e.kind() == ErrorKind::TimedOut => Meets::Nothing,
        Err(e) => Meets::Other(e.to_string()),
    }
}

/// The host's services, on the load-balancer host's wildcard address.
fn host_services(bed: &Bed) {
    for port in [22, 6443] {
        let l = bed.lb.listen(sa(Ipv4Addr::UNSPECIFIED, port));
        tokio::spawn(async move {
            while let Ok((mut s, _)) = l.accept().await {
                tokio::spawn(async move {
                    let _ = s.write_all(b"host\n").await;
                });
            }
        });
    }
}

/// Whether the table exists in the load-balancer namespace.
fn table_exists(bed: &Bed) -> bool {
    bed.lb
        .nft_out(&["list", "table", "inet", "harvester_lb"])
        .is_some()
}

fn isolated_config(action: &str, extra_listener: bool) -> String {
    let mut service = lb("default/web", VIP, &[1]);
    if extra_listener {
        service = service.tcp("alt", 8443, 30080);
    }
    config()
        .vip(&format!("isolate = true\nisolate_action = \"{action}\""))
        .lb(service)
        .to_string()
}

async fn reload(bed: &Bed, text: &str) {
    bed.write("config.toml", text);
    let (code, body) = bed
        .daemon()
        .request("POST", "/reload")
        .await
        .expect("POST /reload");
    assert_eq!(code, 200, "reload: {body}");
    assert!(!body.contains("vip.isolate failed"), "reload: {body}");
}

async fn served(bed: &Bed, port: u16) {
    let e = exchange(&bed.client, sa(VIP, port), 1000, Duration::from_secs(10)).await;
    assert_eq!(
        e,
        Exchange::Ok("n1".into()),
        "VIP:{port} through the daemon"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_vip_isolation_lets_only_the_listener_ports_through() {
    require_netns!();
    let mut bed = Bed::new("vipiso", 1);
    let _node = Node::start(&bed, 1, Service::NameThenEcho);
    host_services(&bed);

    // Without isolation the host's services answer on the VIP: the exposure.
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::HostService);
    assert_eq!(meets(&bed, VIP, 22).await, Meets::HostService);

    bed.start_daemon(&isolated_config("drop", false)).await;
    served(&bed, 80).await;
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Nothing, "dropped");
    assert_eq!(meets(&bed, VIP, 22).await, Meets::Nothing, "dropped");
    // The host's own address, and an address that is no VIP of the config, keep them.
    assert_eq!(meets(&bed, LB_IP, 6443).await, Meets::HostService);
    assert_eq!(meets(&bed, VIP2, 22).await, Meets::HostService);
    let status = bed.daemon().status().await;
    let iso = &status["vip_isolation"];
    assert_eq!(iso["in_force"], true, "{iso}");
    assert_eq!(iso["vips"], 1, "{iso}");
    assert_eq!(iso["open_ports"], 1, "{iso}");
    assert_eq!(iso["action"], "drop", "{iso}");
    assert!(iso["error"].is_null(), "{iso}");
    assert!(
        bed.daemon()
            .metrics()
            .await
            .contains("harvester_lb_vip_isolation_up 1")
    );

    // A reload that adds a listener opens its port; one that removes it
    // closes it again: dropped, where without the table the kernel would
    // refuse it (nothing listens there any more).
    reload(&bed, &isolated_config("drop", true)).await;
    served(&bed, 8443).await;
    reload(&bed, &isolated_config("drop", false)).await;
    assert_eq!(meets(&bed, VIP, 8443).await, Meets::Nothing);

    // `reject`: a closed port refuses at once.
    reload(&bed, &isolated_config("reject", false)).await;
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Refused);
    served(&bed, 80).await;

    // A crash leaves the table: nothing opens up while the daemon is away.
    let mut d = bed.take_daemon();
    d.signal(libc::SIGKILL);
    assert!(
        d.wait_exit(Duration::from_secs(10)).await.is_some(),
        "killed"
    );
    assert!(table_exists(&bed), "the table survives a crash");
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Refused);

    // A new daemon replaces the table whole (here: back to drop); a clean
    // stop removes it, and the host's services answer on the VIP again.
    bed.start_daemon(&isolated_config("drop", false)).await;
    wait_for(
        Duration::from_secs(10),
        "isolation in force after restart",
        || async {
            (bed.daemon().status().await["vip_isolation"]["in_force"] == true).then_some(())
        },
    )
    .await;
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Nothing);
    served(&bed, 80).await;
    let mut d = bed.take_daemon();
    d.signal(libc::SIGTERM);
    let exit = d.wait_exit(Duration::from_secs(40)).await.expect("stopped");
    assert!(exit.success(), "clean stop: {exit:?}\n{}", d.log_tail(20));
    assert!(!table_exists(&bed), "a clean stop removes the table");
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::HostService);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_vip_isolation_that_cannot_be_written_stops_the_start() {
    require_netns!();
    let bed = Bed::new("vipfail", 1);
    // A directory first on PATH whose `nft` always fails, as on a host
    // without nftables or without CAP_NET_ADMIN.
    let bin = bed.dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let fake = bin.join("nft");
    std::fs::write(
        &fake,
        "#!/bin/sh\necho 'Operation not permitted' >&2\nexit 1\n",
    )
    .unwrap();
    run("chmod", &["+x", fake.to_str().unwrap()], None);
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let socket = bed.dir.join("admin.sock");
    let text = isolated_config("drop", false).replacen(
        "[admin]\n",
        &format!("[admin]\nsocket = {socket:?}\n"),
        1,
    );
    let cfg = bed.write("config.toml", &text);
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &bed.lb.name])
        .arg(env!("CARGO_BIN_EXE_harvester-lb"))
        .args(["run", "--config", cfg.to_str().unwrap(), "--no-watch"])
        .env("PATH", path)
        .output()
        .expect("run the daemon");
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "started without its isolation:\n{stderr}"
    );
    assert!(
        stderr.contains("vip.isolate") && stderr.contains("Operation not permitted"),
        "the error names the key and nft's reason:\n{stderr}"
    );
    // Nothing was bound: no admin socket, and the VIP's listener port is closed.
    assert!(!socket.exists(), "the admin socket was bound");
    let refused = bed
        .client
        .connect(sa(VIP, 80), Duration::from_secs(1))
        .await;
    assert!(refused.is_err(), "a listener was bound");
}

/// `harvester-lb run` with `file` in the load-balancer namespace, as an
/// operator trying a file by hand: (exit status, stderr). It must not start.
fn second_run(bed: &Bed, file: &std::path::Path) -> (std::process::ExitStatus, String) {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &bed.lb.name])
        .arg(env!("CARGO_BIN_EXE_harvester-lb"))
        .args(["run", "--no-watch", "--config", file.to_str().unwrap()])
        .stdin(std::process::Stdio::null())
        .output()
        .expect("run a second daemon");
    (
        out.status,
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

async fn repairs(bed: &Bed) -> f64 {
    crate::netns::metric(
        &bed.daemon().metrics().await,
        "harvester_lb_vip_isolation_repairs_total",
        &[],
    )
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_second_daemon_cannot_touch_the_first_ones_table_and_a_changed_table_is_repaired() {
    require_netns!();
    let mut bed = Bed::new("vipown", 1);
    let _node = Node::start(&bed, 1, Service::NameThenEcho);
    host_services(&bed);
    bed.start_daemon(&isolated_config("drop", false)).await;
    served(&bed, 80).await;
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Nothing, "dropped");
    let socket = bed.dir.join("admin.sock");

    // A second daemon whose table would open only 8443 (and so close 80):
    // once with the same [admin] (its port is taken), once with another
    // admin.listen but the same admin.socket (locked). Both fail before
    // they touch the kernel.
    let other = isolated_config("drop", false).replace("port = 80\n", "port = 8443\n");
    let same_admin = other.replacen("[admin]\n", &format!("[admin]\nsocket = {socket:?}\n"), 1);
    let other_port = same_admin.replace("127.0.0.1:9901", "127.0.0.1:9902");
    for (name, text, says) in [
        ("second.toml", &same_admin, "127.0.0.1:9901"),
        ("third.toml", &other_port, "is harvester-lb already running"),
    ] {
        let (status, stderr) = second_run(&bed, &bed.write(name, text));
        assert!(!status.success(), "{name} started:\n{stderr}");
        assert!(
            stderr.contains(says),
            "{name}: the error names why:\n{stderr}"
        );
        assert!(
            !stderr.contains("vip.isolate"),
            "{name} got as far as the table:\n{stderr}"
        );
        served(&bed, 80).await;
        assert_eq!(
            meets(&bed, VIP, 6443).await,
            Meets::Nothing,
            "{name}: still dropped"
        );
        assert_eq!(
            meets(&bed, VIP, 8443).await,
            Meets::Nothing,
            "{name}: not opened"
        );
    }
    assert!(socket.exists(), "the first daemon keeps its socket");
    assert_eq!(repairs(&bed).await, 0.0, "the table was never changed");

    // Changed behind the daemon's back (the set of open ports emptied: the
    // VIP's own port now dropped): the periodic check finds and repairs it.
    bed.lb.nft("flush set inet harvester_lb open4\n");
    assert!(
        bed.client
            .connect(sa(VIP, 80), Duration::from_secs(1))
            .await
            .is_err(),
        "the flushed set still lets port 80 through"
    );
    wait_for(
        Duration::from_secs(60),
        "the periodic check to repair the table",
        || async { (repairs(&bed).await == 1.0).then_some(()) },
    )
    .await;
    served(&bed, 80).await;
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Nothing);
    bed.daemon()
        .wait_log("the repair, with what differed", |log| {
            log.contains("by the periodic check") && log.contains("1 missing")
        })
        .await;

    // Deleted, then SIGHUP at once (the next periodic check is ~10 s
    // away): the reload finds and repairs it.
    run(
        "ip",
        &[
            "netns",
            "exec",
            &bed.lb.name,
            "nft",
            "delete",
            "table",
            "inet",
            "harvester_lb",
        ],
        None,
    );
    assert_eq!(
        meets(&bed, VIP, 6443).await,
        Meets::HostService,
        "the table is gone"
    );
    bed.daemon().signal(libc::SIGHUP);
    wait_for(
        Duration::from_secs(60),
        "the reload to repair the table",
        || async { (repairs(&bed).await == 2.0).then_some(()) },
    )
    .await;
    bed.daemon()
        .wait_log("the repair, found at the reload", |log| {
            log.contains("found=\"at reload\"") || log.contains("found=at reload")
        })
        .await;
    assert_eq!(meets(&bed, VIP, 6443).await, Meets::Nothing);
    served(&bed, 80).await;
    assert!(
        bed.daemon()
            .metrics()
            .await
            .contains("harvester_lb_vip_isolation_up 1")
    );

    // A table nobody touched is never "repaired": over more than one check
    // period (10 s) the count stays. (Not a synchronisation: a check the
    // load delays only makes this assert less, never fail wrongly.)
    tokio::time::sleep(Duration::from_secs(12)).await;
    assert_eq!(repairs(&bed).await, 2.0, "a repair of an untouched table");
}

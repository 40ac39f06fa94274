//! Two daemons on one host, each with its own VM network (issue 40, defect
//! 7): the VM-network guard table `inet harvester_lb_vmnet`, the reply-mark
//! table `inet harvester_lb_reply` with its `fwmark` rules and the networks'
//! `from VIP` rules have one name per host, so the second daemon used to
//! rewrite them every check while the first's `/status` said `in_force`
//! (its guard held 4 of 22 samples). Now the objects are claimed
//! (`owned::claim`): the second daemon refuses to start, naming the first
//! (pid, config file, admin socket), and writes nothing (the same for the
//! sync gate `inet harvester_lb_gate` of a `[conntrackd]`); a second daemon
//! started without VM networks is refused a reload that adds one, the
//! running config staying in force, and gets it once the first is gone.
//!
//! The bed is a Harvester-like host: its VM-network interfaces are Linux
//! bridges `brA` and `brB`, each with an uplink veth into a "switch"
//! namespace, `br_netfilter` on with `bridge-nf-call-iptables=1` and
//! `ip_forward=1`. It leaves out the VMs and keepalived: no traffic is
//! sent, the test reads the kernel objects themselves (keepalived is not
//! running, so each daemon logs that it cannot tell it to reload; the guard,
//! rules and marks are written on every host whether or not it holds a VIP).
//!
//! Run as root with iproute2 and nftables:
//! `cargo test --test it -- vmnet_claims:: --nocapture`.

// These tests time real processes, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::time::Duration;

use netns::{DaemonProc, Ns, config, run, wait_for};
use support::{Lb, Listener, keepalived, network};

/// Network A (the first daemon's): the host's address and VIP on `brA`.
const HOST_A: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
const VIP_A: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
/// Network B (the second daemon's) on `brB`.
const HOST_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 3);
const VIP_B: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The management address (keepalived's interface "mgmt").
const HOST_MGMT: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 3);

/// The host and switch namespaces, deleted (daemons first) at the end.
struct Bed {
    host: Ns,
    dir: PathBuf,
    names: Vec<String>,
}

impl Drop for Bed {
    fn drop(&mut self) {
        netns::remove_bed(&self.names, &self.dir);
    }
}

fn sysctl(ns: &Ns, setting: &str) {
    run(
        "ip",
        &["netns", "exec", &ns.name, "sysctl", "-qw", setting],
        None,
    );
}

impl Bed {
    fn new() -> Bed {
        let (tag, dir) = netns::new_tag("claims");
        let host = Ns {
            name: format!("{tag}-h"),
        };
        let switch = Ns {
            name: format!("{tag}-sw"),
        };
        let mut names = Vec::new();
        for n in [&host, &switch] {
            run("ip", &["netns", "add", &n.name], None);
            names.push(n.name.clone());
            n.ip(&["link", "set", "lo", "up"]);
        }
        sysctl(&host, "net.ipv4.ip_forward=1");
        sysctl(&host, "net.bridge.bridge-nf-call-iptables=1");
        // Each VM network: a bridge on the host with an uplink port into
        // the switch's bridge of that network; the management network a
        // plain interface into the switch.
        for (br, up, addr) in [("brA", "upA", HOST_A), ("brB", "upB", HOST_B)] {
            host.ip(&["link", "add", br, "type", "bridge"]);
            host.ip(&[
                "link",
                "add",
                up,
                "type",
                "veth",
                "peer",
                "name",
                up,
                "netns",
                &switch.name,
            ]);
            host.ip(&["link", "set", up, "master", br, "up"]);
            host.ip(&["link", "set", br, "up"]);
            host.ip(&["addr", "add", &format!("{addr}/24"), "dev", br]);
            let sw = format!("s{br}");
            switch.ip(&["link", "add", &sw, "type", "bridge"]);
            switch.ip(&["link", "set", up, "master", &sw, "up"]);
            switch.ip(&["link", "set", &sw, "up"]);
        }
        host.ip(&[
            "link",
            "add",
            "mgmt",
            "type",
            "veth",
            "peer",
            "name",
            "mgmt",
            "netns",
            &switch.name,
        ]);
        host.ip(&["addr", "add", &format!("{HOST_MGMT}/24"), "dev", "mgmt"]);
        host.ip(&["link", "set", "mgmt", "up"]);
        switch.ip(&["link", "set", "mgmt", "up"]);
        Bed { host, dir, names }
    }

    /// Daemon `who`'s config: `[keepalived]` (its own files), admin on
    /// `port` and its own socket, and, with `net`, network `t/{who}` on
    /// `bridge` with a kernel listener on `vip` (so it has a guard, routes,
    /// a rule and a reply mark); without, one plain proxy listener on
    /// 127.0.0.1.
    fn config(&self, who: &str, port: u16, net: Option<(&str, Ipv4Addr)>) -> String {
        let base = config()
            .admin(SocketAddr::from(([127, 0, 0, 1], port)))
            .socket(&self.socket(who));
        match net {
            Some((bridge, vip)) => base
                .text(
                    &(keepalived(
                        who,
                        HOST_MGMT,
                        ["192.0.2.4"],
                        &self.dir.join(format!("{who}-keepalived")),
                        "",
                    ) + &network(&format!("t/{who}"), bridge, gateway_of(vip), "")),
                )
                .lb(Lb::new(&format!("t/{who}-web"), vip)
                    .backends([backend_of(vip)])
                    .keys(&format!("network = \"t/{who}\""))
                    .listener(Listener::new("http", 80, 30080).forwarding("kernel")))
                .to_string(),
            None => base
                .lb(Lb::new(&format!("{who}/plain"), "127.0.0.1")
                    .backends(["127.0.0.2"])
                    .tcp("http", 18080 + port % 100, 30080))
                .to_string(),
        }
    }

    /// `[keepalived]` of daemon `who` with its own files (for a file with
    /// no network).
    fn keepalived(&self, who: &str) -> String {
        keepalived(
            who,
            HOST_MGMT,
            ["192.0.2.4"],
            &self.dir.join(format!("{who}-keepalived")),
            "",
        )
    }

    /// `[conntrackd]` of daemon `who`, every file its own.
    fn conntrackd(&self, who: &str) -> String {
        let d = |f: &str| self.dir.join(format!("{who}-{f}")).display().to_string();
        format!(
            "\n[conntrackd]\ninterface = \"mgmt\"\naddress = \"{HOST_MGMT}\"\npeer = \"192.0.2.4\"\nconfig_path = {:?}\nnotify_script = {:?}\nsocket = {:?}\nlock_file = {:?}\nlog_file = {:?}\nstate_directory = {:?}\n",
            d("conntrackd.conf"),
            d("notify.sh"),
            d("ctd.ctl"),
            d("ctd.lock"),
            d("ctd.log"),
            d("state"),
        )
    }

    fn socket(&self, who: &str) -> PathBuf {
        self.dir.join(format!("{who}.sock"))
    }

    fn write(&self, who: &str, text: &str) -> PathBuf {
        let path = self.dir.join(format!("{who}.toml"));
        std::fs::write(&path, text).unwrap();
        path
    }

    fn spawn(&self, who: &str, path: &std::path::Path, port: u16) -> DaemonProc {
        DaemonProc::spawn(&self.host, path, &self.dir.join(format!("{who}.log")), None)
            .on_admin_port(port)
    }
}

/// The network's gateway: `.1` of the VIP's /24.
fn gateway_of(vip: Ipv4Addr) -> Ipv4Addr {
    let [a, b, c, _] = vip.octets();
    Ipv4Addr::new(a, b, c, 1)
}

/// A backend on the VIP's network: `.21`.
fn backend_of(vip: Ipv4Addr) -> Ipv4Addr {
    let [a, b, c, _] = vip.octets();
    Ipv4Addr::new(a, b, c, 21)
}

/// The host's VM-network objects as the kernel lists them: the guard,
/// reply-mark and gate tables and the routing rules of both families.
fn objects(host: &Ns) -> String {
    let table = |name: &str| {
        host.nft_out(&["list", "table", "inet", name])
            .unwrap_or_else(|| format!("(no table {name})"))
    };
    let rules = |family: &str| {
        let out = std::process::Command::new("ip")
            .args(["netns", "exec", &host.name, "ip", family, "rule"])
            .output()
            .expect("ip rule");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    format!(
        "{}\n{}\n{}\n{}{}",
        table("harvester_lb_vmnet"),
        table("harvester_lb_reply"),
        table("harvester_lb_gate"),
        rules("-4"),
        rules("-6")
    )
}

/// Waits until daemon `d`'s guard is in force and its objects are all in
/// the kernel: the guard on `bridge`, the rule from `vip`, the reply mark.
async fn wait_in_force(d: &DaemonProc, host: &Ns, bridge: &str, vip: Ipv4Addr) -> String {
    wait_for(
        Duration::from_secs(30),
        "the daemon's VM-network objects in force",
        || async {
            let (_, s) = d.get("/status").await.ok()?;
            let s: serde_json::Value = serde_json::from_str(&s).ok()?;
            let guard = &s["vm_network_guard"];
            let o = objects(host);
            (guard["in_force"] == true
                && o.contains(&format!("\"{bridge}\""))
                && o.contains(&format!("from {vip} lookup"))
                && o.contains("fwmark"))
            .then_some(o)
        },
    )
    .await
}

/// Waits until daemon `b` exits refusing to start; its log and the host's
/// objects then.
async fn refused_to_start(b: &mut DaemonProc, host: &Ns) -> (String, String) {
    let exit = b.wait_exit(Duration::from_secs(30)).await;
    let after = objects(host);
    assert!(
        exit.is_some_and(|s| !s.success()),
        "the second daemon did not refuse to start ({exit:?}); the host's objects now:\n{after}\nits log:\n{}",
        b.log_tail(20)
    );
    (b.log(), after)
}

/// The second daemon's admin port (the first has [`netns::ADMIN_PORT`]).
const PORT_B: u16 = netns::ADMIN_PORT + 1;

/// Starts daemon "a" with network `t/a` on `brA`; returns it, its file and
/// the host's objects once they are all in force.
async fn first_daemon(bed: &Bed) -> (DaemonProc, PathBuf, String) {
    let port = netns::ADMIN_PORT;
    let path = bed.write("a", &bed.config("a", port, Some(("brA", VIP_A))));
    let a = bed.spawn("a", &path, port);
    let objects = wait_in_force(&a, &bed.host, "brA", VIP_A).await;
    (a, path, objects)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_second_daemon_with_its_own_vm_network_refuses_to_start_naming_the_first() {
    require_netns!();
    let bed = Bed::new();
    let (mut a, path_a, before) = first_daemon(&bed).await;
    let port_b = PORT_B;

    let path_b = bed.write("b", &bed.config("b", port_b, Some(("brB", VIP_B))));
    let mut b = bed.spawn("b", &path_b, port_b);
    let (log, after) = refused_to_start(&mut b, &bed.host).await;
    for named in [
        format!("pid {}", a.pid()),
        format!("config {}", path_a.display()),
        format!("admin socket {}", bed.socket("a").display()),
    ] {
        assert!(
            log.contains("held by another harvester-lb") && log.contains(&named),
            "the refusal does not name the first daemon ({named}):\n{log}"
        );
    }
    // It wrote nothing: the first's objects are as they were, and its
    // /status says what the kernel has.
    assert_eq!(after, before, "the first daemon's objects changed");
    assert!(!after.contains("brB") && !after.contains(&VIP_B.to_string()));
    assert_eq!(a.status().await["vm_network_guard"]["in_force"], true);
    a.signal(libc::SIGTERM);
    assert!(a.wait_exit(Duration::from_secs(30)).await.is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_reload_that_adds_a_vm_network_another_daemon_holds_is_refused_until_it_is_gone() {
    require_netns!();
    let bed = Bed::new();
    let (mut a, path_a, before) = first_daemon(&bed).await;
    let port_b = PORT_B;

    // The second starts with no VM network: nothing of the first's is
    // needed, it runs beside it.
    let path_b = bed.write("b", &bed.config("b", port_b, None));
    let mut b = bed.spawn("b", &path_b, port_b);
    wait_for(Duration::from_secs(30), "the second daemon up", || async {
        b.get("/status").await.ok().map(drop)
    })
    .await;
    assert!(b.alive());
    // Its reload into a VM network is refused, naming the first; its
    // running config stays.
    bed.write("b", &bed.config("b", port_b, Some(("brB", VIP_B))));
    let (code, body) = b.request("POST", "/reload").await.expect("POST /reload");
    assert_eq!(code, 422, "{body}");
    assert!(
        body.contains("held by another harvester-lb")
            && body.contains(&format!("pid {}", a.pid()))
            && body.contains(&format!("config {}", path_a.display())),
        "{body}"
    );
    let lbs = b.status().await["load_balancers"].clone();
    assert!(lbs.to_string().contains("b/plain"), "{lbs}");
    assert!(!lbs.to_string().contains("t/b-web"), "{lbs}");
    // Over more than one check (10 s) of both daemons: the first's
    // objects stay as they were.
    let watched = std::time::Instant::now();
    while watched.elapsed() < Duration::from_secs(12) {
        assert_eq!(
            objects(&bed.host),
            before,
            "the first daemon's objects changed after {:?}",
            watched.elapsed()
        );
        tokio::time::sleep(Duration::from_millis(500)).await;
    }
    assert_eq!(a.status().await["vm_network_guard"]["in_force"], true);

    // The first stops: its claims go with it, and the reload succeeds.
    a.signal(libc::SIGTERM);
    assert!(a.wait_exit(Duration::from_secs(30)).await.is_some());
    let (code, body) = b.request("POST", "/reload").await.expect("POST /reload");
    assert_eq!(code, 200, "{body}");
    wait_in_force(&b, &bed.host, "brB", VIP_B).await;
    b.signal(libc::SIGTERM);
    assert!(b.wait_exit(Duration::from_secs(30)).await.is_some());
}

/// The sync gate (`[conntrackd]`): a second daemon with a `[conntrackd]` of
/// its own (its own files) and no VM network still needs the gate table
/// `inet harvester_lb_gate`, which has one name per host: it refuses to
/// start, naming the first, and the first's gate stays as it was.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_second_daemon_with_its_own_conntrackd_is_refused_the_first_s_gate() {
    require_netns!();
    let bed = Bed::new();
    let port = netns::ADMIN_PORT;
    let path_a = bed.write(
        "a",
        &(bed.config("a", port, Some(("brA", VIP_A))) + &bed.conntrackd("a")),
    );
    let mut a = bed.spawn("a", &path_a, port);
    wait_in_force(&a, &bed.host, "brA", VIP_A).await;
    let before = wait_for(
        Duration::from_secs(30),
        "the first's gate table",
        || async {
            let o = objects(&bed.host);
            (!o.contains("(no table harvester_lb_gate)")).then_some(o)
        },
    )
    .await;

    let path_b = bed.write(
        "b",
        &(bed.config("b", PORT_B, None) + &bed.keepalived("b") + &bed.conntrackd("b")),
    );
    let mut b = bed.spawn("b", &path_b, PORT_B);
    let (log, after) = refused_to_start(&mut b, &bed.host).await;
    assert!(
        log.contains("the sync gate table inet harvester_lb_gate is held by another harvester-lb")
            && log.contains(&format!("pid {}", a.pid())),
        "{log}"
    );
    assert_eq!(after, before, "the first daemon's objects changed");
    a.signal(libc::SIGTERM);
    assert!(a.wait_exit(Duration::from_secs(30)).await.is_some());
}

//! VIPs on a VM network, moved by the keepalived the daemon configures:
//! the rendered file passes keepalived's own check, and in network
//! namespaces two load-balancer hosts (a management segment for VRRP, a VM
//! network with a client and two backends) serve a VIP through whichever
//! holds it, move it when the master's daemon dies, and never send VRRP
//! onto the VM network.
//!
//! Run as root with iproute2, nftables and keepalived:
//! `cargo test --test it -- vmnet:: --nocapture` (the failover time is printed
//! as `FIGURE`).

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use netns::keepalived::{Keepalived, keepalived_missing};
use netns::peers::{Exchange, Node, Service, exchange};
use netns::vmnet::{FAR_CLIENT, from_behind_the_gateway, holds, host, ip_out, vrrp_sent};
use netns::{Bed, DaemonProc, Ns, config, lb, sa, wait_for};
use support::{Lb, keepalived, network, quiet_success};

/// The VIPs, on the bed's VM network (198.51.100.0/24, the bridge `br0`).
const VIP1: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 40);
const VIP2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 41);
/// The network's gateway (nobody answers there: the client is on-link).
const GATEWAY: &str = "198.51.100.1";
/// The first network's routing table (the default, 1000).
const TABLE: &str = "1000";

/// The keys every host shares, with this host's `name`, management
/// `address` and `peer`, and its files under `dir`.
fn keys(dir: &std::path::Path, name: &str, address: &str, peer: &str) -> String {
    keepalived(
        name,
        address,
        [peer],
        &dir.join(format!("keepalived-{name}")),
        "instances = 2\n",
    ) + &network("default/vm", "eth0", GATEWAY, "")
}

/// One host's config: `vips` on the VM network, nodes 1 and 2 behind each.
fn host_config(bed: &Bed, name: &str, address: &str, peer: &str, vips: &[Ipv4Addr]) -> String {
    let mut c = config()
        .socket(&bed.dir.join(format!("admin-{name}.sock")))
        .text(&keys(&bed.dir, name, address, peer));
    for (i, vip) in vips.iter().enumerate() {
        c = c.lb(lb(&format!("default/vm{i}"), vip, &[1, 2]).keys("network = \"default/vm\""));
    }
    c.to_string()
}

#[test]
fn the_rendered_keepalived_conf_passes_keepalived_s_config_test() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    // keepalived's check wants the interfaces to exist (and not be `lo`):
    // a namespace of its own with `mgmt` and `eth0`.
    let (tag, dir) = netns::new_tag("vmrender");
    let ns = Ns { name: tag.clone() };
    netns::run("ip", &["netns", "add", &tag], None);
    let _cleanup = Cleanup(vec![tag.clone()], dir.clone());
    ns.ip(&[
        "link", "add", "mgmt", "type", "veth", "peer", "name", "eth0",
    ]);
    // Ten IPv4 VIPs and one IPv6 VIP (an excluded address of an instance).
    let gateway = format!("gateway = \"{GATEWAY}\"\n");
    let mut text = keys(&dir, "a", "10.77.0.1", "10.77.0.2").replace(
        &gateway,
        &format!("{gateway}ipv6_gateway = \"fd00:a::1\"\n"),
    );
    for (i, vip) in (0..10)
        .map(|i| format!("198.51.100.{}", 50 + i))
        .chain(["fd00:a::50".to_string()])
        .enumerate()
    {
        let lb = Lb::new(&format!("default/lb{i}"), vip)
            .keys("network = \"default/vm\"")
            .backends(["198.51.100.21"])
            .tcp("http", 80, 30080);
        text.push_str(&format!("\n{lb}"));
    }
    // As rendered by default, and with keepalived.ready_requires_backend
    // (the track scripts' URL gains &require=backend).
    let mut rendered = String::new();
    for extra in ["", "ready_requires_backend = true\n"] {
        let text = text.replace("instances = 2\n", &format!("instances = 2\n{extra}"));
        let config = harvester_lb::config::parse(&text).expect("valid").config;
        rendered = harvester_lb::host::vmnet::keepalived::render(&config).expect("rendered");
        assert_eq!(
            rendered.contains("&require=backend\""),
            !extra.is_empty(),
            "{extra}{rendered}"
        );
        // The management check's script, as the daemon writes it before the
        // file (keepalived disables a track script it cannot find).
        harvester_lb::host::vmnet::mgmt_check::install(
            config.keepalived.as_ref().expect("[keepalived]"),
        )
        .expect("the management check's script");
        let file = dir.join("rendered.conf");
        std::fs::write(&file, &rendered).unwrap();
        let out = Command::new("ip")
            .args([
                "netns",
                "exec",
                &tag,
                "keepalived",
                "--config-test",
                "--use-file",
            ])
            .arg(&file)
            .output()
            .expect("run keepalived --config-test");
        if let Err(said) = quiet_success(&out) {
            panic!("keepalived rejects the rendered file ({extra:?}): {said}\n{rendered}");
        }
    }
    assert_eq!(rendered.matches("/32 dev eth0").count(), 10, "{rendered}");
    assert_eq!(
        rendered.matches("fd00:a::50/128 dev eth0").count(),
        1,
        "{rendered}"
    );
}

/// Deletes the namespaces and the directory at the end, also on panic.
struct Cleanup(Vec<String>, std::path::PathBuf);

impl Drop for Cleanup {
    fn drop(&mut self) {
        netns::remove_bed(&self.0, &self.1);
    }
}

/// Waits until exactly one of `hosts` holds `vip` and the bed's client is
/// served through it.
async fn up_on_one_host(bed: &Bed, hosts: [&Ns; 2], vip: Ipv4Addr) {
    wait_for(
        Duration::from_secs(30),
        "one host holds the VIP",
        || async { (holds(hosts[0], vip) != holds(hosts[1], vip)).then_some(()) },
    )
    .await;
    wait_for(
        Duration::from_secs(20),
        "the VIP serves the client",
        || async {
            let e = exchange(&bed.client, sa(vip, 80), 64, Duration::from_secs(2)).await;
            matches!(e, Exchange::Ok(_)).then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_vm_network_vip_is_served_moved_and_vrrp_stays_off_the_vm_network() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut bed = Bed::new("vmnet", 2);
    let _nodes = [
        Node::start(&bed, 1, Service::NameThenEcho),
        Node::start(&bed, 2, Service::NameThenEcho),
    ];
    bed.add_bridge("br1");
    // The network's gateway, with a client of another network behind it.
    let (gw, _) = bed.add_host("gw", GATEWAY.parse().unwrap());
    gw.ip(&["addr", "add", &format!("{FAR_CLIENT}/32"), "dev", "lo"]);
    let a = host(&mut bed, "a", Ipv4Addr::new(198, 51, 100, 4), "10.77.0.1");
    let b = host(&mut bed, "b", Ipv4Addr::new(198, 51, 100, 5), "10.77.0.2");
    let hosts = [
        (&a, "a", "10.77.0.1", "10.77.0.2"),
        (&b, "b", "10.77.0.2", "10.77.0.1"),
    ];

    // Each host: the daemon with one load balancer on the VM network; it
    // writes keepalived's file, and keepalived runs on that file.
    let mut daemons = Vec::new();
    let mut keepalived = Vec::new();
    for (ns, name, address, peer) in hosts {
        let path = bed.write(
            &format!("config-{name}.toml"),
            &host_config(&bed, name, address, peer, &[VIP1]),
        );
        let d = DaemonProc::spawn(ns, &path, &bed.dir.join(format!("daemon-{name}.log")), None);
        let conf = bed.dir.join(format!("keepalived-{name}.conf"));
        wait_for(
            Duration::from_secs(20),
            "the daemon writes keepalived's file",
            || async {
                let text = std::fs::read_to_string(&conf).unwrap_or_default();
                text.contains(&format!("{VIP1}/32 dev eth0")).then_some(())
            },
        )
        .await;
        wait_for(
            Duration::from_secs(20),
            "the daemon is ready for VIP1",
            || async {
                matches!(d.get(&format!("/readyz?vip={VIP1}")).await, Ok((200, _))).then_some(())
            },
        )
        .await;
        // The reply path: the network's table and the rule from the VIP
        // (written by the daemon's own task, soon after the apply).
        wait_for(
            Duration::from_secs(20),
            "the rule and table of VIP1",
            || async {
                let rules = ip_out(ns, &["rule", "show"]);
                let routes = ip_out(ns, &["route", "show", "table", TABLE]);
                (rules.contains(&format!("from {VIP1} lookup {TABLE}"))
                    && routes.contains(&format!("default via {GATEWAY} dev eth0"))
                    && routes.contains("198.51.100.0/24 dev eth0"))
                .then_some(())
            },
        )
        .await;
        // keepalived does not run yet: telling it to reload failed, and
        // that is counted (the file is read when it starts).
        wait_for(
            Duration::from_secs(20),
            "the failed reload counted",
            || async {
                let m = d.metrics().await;
                (netns::metric_sample(&m, "harvester_lb_keepalived_reload_failures_total", &[])
                    .is_some_and(|v| v >= 1.0))
                .then_some(())
            },
        )
        .await;
        let pid = bed.dir.join(format!("keepalived-{name}.pid"));
        keepalived.push(Keepalived::run(ns, &bed.dir, name, &conf, Some(&pid)));
        daemons.push(d);
    }
    let logs = |k: &[Keepalived]| -> String {
        k.iter()
            .map(Keepalived::log)
            .collect::<Vec<_>>()
            .join("\n---\n")
    };

    // One master, and the client on the VM network is served through it,
    // as is the client behind the network's gateway (the reply goes back
    // by the network's table: the hosts have no default route).
    up_on_one_host(&bed, [&a, &b], VIP1).await;
    wait_for(
        Duration::from_secs(20),
        "VIP1 serves the client behind the gateway",
        || async { from_behind_the_gateway(&gw, VIP1).await.then_some(()) },
    )
    .await;

    // A reload that adds a load balancer brings its VIP up, with no
    // keepalived line written by hand.
    for ((_, name, address, peer), d) in hosts.iter().zip(&daemons) {
        bed.write(
            &format!("config-{name}.toml"),
            &host_config(&bed, name, address, peer, &[VIP1, VIP2]),
        );
        d.signal(libc::SIGHUP);
    }
    up_on_one_host(&bed, [&a, &b], VIP2).await;

    // The master of VIP1 loses its daemon: keepalived's track script
    // fails and VIP1 moves to the other host.
    let master = if holds(&a, VIP1) { 0 } else { 1 };
    let other = [&a, &b][1 - master];
    let at = Instant::now();
    daemons[master].signal(libc::SIGKILL);
    let served_at = wait_for(
        Duration::from_secs(30),
        "VIP1 served from the other host",
        || async {
            let e = exchange(&bed.client, sa(VIP1, 80), 64, Duration::from_millis(700)).await;
            (matches!(e, Exchange::Ok(_)) && holds(other, VIP1)).then(Instant::now)
        },
    )
    .await;
    assert!(
        !holds([&a, &b][master], VIP1),
        "VIP1 left the host whose daemon died\n{}",
        logs(&keepalived)
    );
    eprintln!(
        "FIGURE vmnet failover (daemon killed, advert_int 1, track script fall 2): VIP1 served again from the other host after {:.2} s",
        (served_at - at).as_secs_f64()
    );

    // VRRP went over the management segment, and never onto the VM network.
    for ns in [&a, &b] {
        assert!(
            vrrp_sent(ns, "mgmt") > 0,
            "{}: no VRRP on mgmt\n{}",
            ns.name,
            logs(&keepalived)
        );
        assert_eq!(
            vrrp_sent(ns, "vm"),
            0,
            "{}: VRRP sent onto the VM network",
            ns.name
        );
    }

    // The surviving daemon stops cleanly: its rules and table go.
    let survivor = &mut daemons[1 - master];
    survivor.signal(libc::SIGTERM);
    assert!(
        survivor.wait_exit(Duration::from_secs(60)).await.is_some(),
        "the daemon stops"
    );
    let rules = ip_out(other, &["rule", "show"]);
    assert!(
        !rules.contains("lookup 1000"),
        "rules left at stop: {rules}"
    );
    drop(keepalived);
}

/// Defect 9 of issue 40: keepalived's pid file names a process that is not
/// keepalived (a stale file whose pid was reused). The daemon must not
/// send it SIGHUP (a `sleep` would die of it, status 129); it counts a
/// failed reload and says why. Leaves out keepalived itself (nothing here
/// needs it) and the VM network's bridge uplink (no traffic is sent).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_stale_keepalived_pid_file_signals_no_other_process() {
    require_netns!();
    let mut bed = Bed::new("vmstale", 1);
    bed.add_bridge("br1");
    let a = host(&mut bed, "a", Ipv4Addr::new(198, 51, 100, 4), "10.77.0.1");
    let mut unrelated = Command::new("sleep").arg("300").spawn().expect("sleep");
    let _reap = KillOnDrop(unrelated.id());
    std::fs::write(
        bed.dir.join("keepalived-a.pid"),
        format!("{}\n", unrelated.id()),
    )
    .unwrap();
    let path = bed.write(
        "config-a.toml",
        &host_config(&bed, "a", "10.77.0.1", "10.77.0.2", &[VIP1]),
    );
    let log = bed.dir.join("daemon-a.log");
    let d = DaemonProc::spawn(&a, &path, &log, None);
    let conf = bed.dir.join("keepalived-a.conf");
    wait_for(Duration::from_secs(20), "the admin API answers", || async {
        d.get("/metrics").await.is_ok().then_some(())
    })
    .await;
    wait_for(
        Duration::from_secs(20),
        "the failed reload counted and its reason logged",
        || async {
            let m = d.metrics().await;
            let said = std::fs::read_to_string(&log).unwrap_or_default();
            (netns::metric_sample(&m, "harvester_lb_keepalived_reload_failures_total", &[])
                .is_some_and(|v| v >= 1.0)
                && said.contains(&format!("pid {} from", unrelated.id()))
                && said.contains("\"sleep\", not keepalived"))
            .then_some(())
        },
    )
    .await;
    assert!(
        std::fs::read_to_string(&conf).is_ok_and(|t| t.contains(&format!("{VIP1}/32"))),
        "keepalived's file is written all the same"
    );
    let said = std::fs::read_to_string(&log).unwrap_or_default();
    assert!(
        !said.contains("keepalived told to reload"),
        "the daemon says keepalived was told:\n{said}"
    );
    // A retry (every 10 s) must not signal it either: the next failure.
    wait_for(
        Duration::from_secs(30),
        "the retry counted as a failure too",
        || async {
            let m = d.metrics().await;
            (netns::metric_sample(&m, "harvester_lb_keepalived_reload_failures_total", &[])
                .is_some_and(|v| v >= 2.0))
            .then_some(())
        },
    )
    .await;
    assert!(
        unrelated.try_wait().unwrap().is_none(),
        "the unrelated process was signalled: {:?}",
        unrelated.try_wait()
    );
}

/// Kills a process of the test's at the end, also on panic.
struct KillOnDrop(u32);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = Command::new("kill").arg(self.0.to_string()).status();
    }
}

//! Kernel listeners (`forwarding = "kernel"`) on a VM network whose host
//! interface is a Linux bridge with an uplink port, `br_netfilter` on
//! (`bridge-nf-call-iptables=1`), as on a Harvester host (issue 40, defect
//! 1), in network namespaces with the real daemon:
//!
//! ```text
//!  switch (br0, 198.51.100.0/24): client .2, backend n1 .21, gateway .1
//!     (client 203.0.113.2 behind it), the uplinks of hosts a and b
//!  host a: bridge eth0 .4 (+ the VIPs .40/.41 by hand), uplink up0;
//!     on its bridge the VM v1 .31 (a backend), and in the holder's tests
//!     the VM cv .32 (a client)
//!  host b: bridge eth0 .5, uplink up0; in the bridging host's test the
//!     VM cv .32 (a client) on its bridge
//!  management (br1): a 10.77.0.1, b 10.77.0.2
//! ```
//!
//! With `br_netfilter`, an IPv4 frame entering a bridge port passes the
//! inet `prerouting` hooks at the bridge stage (`br_nf_pre_routing`), DNAT
//! included, whatever its Ethernet destination; a frame not addressed to
//! this host is then bridged on. So a host that merely bridges a VM's
//! frames to the VIP's holder must not DNAT them: host b holds the
//! listener's table but not the VIP, and its VM's connections are served
//! by host a, with no flow DNATed in b's conntrack table (the backend here
//! a VM that host a routes to, so that the kernel path is taken).
//!
//! On the holder, a DNATed frame whose backend lies behind the very port
//! it entered by (client and backend both behind the uplink, the normal
//! case) was never delivered: `br_nf_pre_routing_finish` bridges it again
//! when the route to the backend leaves by the bridge itself, and the
//! bridge sends no frame back out of its ingress port (issue 40, defect 1:
//! 0 of 10 through the kernel listener). The daemon then handed such
//! listeners to the proxy. Now it makes the network a leg (`hleg<table>`,
//! a macvlan on the bridge, `vip::leg`): the network's table routes by it
//! and both directions of the network's DNATed flows carry its mark, so
//! the frame is routed out of the leg, which the bridge takes as the
//! host's own traffic and sends out of any port: every client reaches
//! every backend through the kernel listener, with the bridge stage on or
//! off, flows DNATed by the holder; the leg is repaired when deleted and
//! removed at a clean stop.
//!
//! Left out: keepalived (the VIP is added by hand: this is about the
//! holder's path, not about moving it), the bridge's VLAN filtering and the
//! bond (this kernel builds neither; docs/vip.md argues what holds there).
//!
//! Run as root with iproute2, nftables and conntrack:
//! `cargo test --test it -- vmnet_bridged:: --nocapture`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::process::Command;
use std::time::Duration;

use netns::peers::{Exchange, Node, Service, exchange, serve_name_then_echo};
use netns::vmnet::{FAR_CLIENT, GATEWAY, ip_out, mgmt_host, routed_vm, sysctl, vm_on_host};
use netns::{Bed, DaemonProc, NODEPORT, Ns, config, node_ip, sa, wait_for};
use support::{Lb, Listener, keepalived, network};

/// The VIP whose backend is behind the uplink (n1), and the VIP whose
/// backend is a VM on the holder's own bridge (v1).
const VIP_UPLINK: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 40);
const VIP_LOCAL: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 41);
/// The VM on host a's bridge (a backend) and the VM on host b's (a client).
const V1: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 31);
/// A backend VM of another subnet that host a routes to, and host a's
/// address there.
const ROUTED: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 21);
const ROUTED_GW: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
const CV: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 32);
/// The kernel listener's port and the proxy listener's, on each VIP.
const KERNEL: u16 = 80;
const PROXY: u16 = 81;

/// Host `name`'s file: the network on its bridge `eth0`, a load balancer
/// per VIP of `vips` (with its backend), each with a kernel and a proxy
/// listener to the same backend port.
fn daemon_config(
    bed: &Bed,
    name: &str,
    mgmt: &str,
    peer: &str,
    vips: &[(Ipv4Addr, Ipv4Addr)],
) -> String {
    let mut c = config()
        .socket(&bed.dir.join(format!("admin-{name}.sock")))
        .text(
            &(keepalived(
                name,
                mgmt,
                [peer],
                &bed.dir.join(format!("keepalived-{name}")),
                "",
            ) + &network("t/a", "eth0", GATEWAY, "")),
        );
    for (i, (vip, backend)) in vips.iter().enumerate() {
        c = c.lb(Lb::new(&format!("t/web{i}"), vip)
            .backends([backend])
            .keys("network = \"t/a\"")
            .listener(Listener::new("kernel", KERNEL, NODEPORT).forwarding("kernel"))
            .listener(Listener::new("proxy", PROXY, NODEPORT)));
    }
    c.to_string()
}

/// The two load-balancer hosts, bridged, forwarding on.
fn hosts(bed: &mut Bed) -> (Ns, Ns) {
    bed.add_bridge("br1");
    let (a, _) = mgmt_host(bed, "a", Ipv4Addr::new(198, 51, 100, 4), "10.77.0.1");
    let (b, _) = mgmt_host(bed, "b", Ipv4Addr::new(198, 51, 100, 5), "10.77.0.2");
    for h in [&a, &b] {
        sysctl(h, "net.ipv4.ip_forward=1");
    }
    (a, b)
}

/// With the bridge stage off and the leg gone: `client` (behind the
/// uplink) is served 10 of 10 through `vip`'s kernel listener, by the
/// bridge. A client that learned the VIP at the leg's MAC sends to a MAC
/// gone until its ARP entry expires (tens of seconds: docs/vip.md); this
/// one asks again at once.
async fn served_again_without_the_leg(client: &Ns, vip: Ipv4Addr) {
    client.ip(&["neigh", "flush", "all"]);
    wait_for(
        Duration::from_secs(30),
        "a client behind the uplink served through the kernel listener, bridge stage off",
        || async { (served(client, None, vip, KERNEL, 1).await == 1).then_some(()) },
    )
    .await;
    assert_eq!(
        served(client, None, vip, KERNEL, 10).await,
        10,
        "a client behind the uplink through the kernel listener, bridge stage off"
    );
}

/// How many of `n` exchanges from `client` (bound to `from` if given)
/// through `vip:port` a backend answered.
async fn served(client: &Ns, from: Option<Ipv4Addr>, vip: Ipv4Addr, port: u16, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let answered = match from {
            None => matches!(
                exchange(client, sa(vip, port), 64, Duration::from_secs(2)).await,
                Exchange::Ok(_)
            ),
            Some(src) => far_exchange(client, src, vip, port).await,
        };
        ok += usize::from(answered);
    }
    ok
}

/// One exchange from `src` (an address of `ns`'s own, the client behind
/// the gateway) to `vip:port`: the backend's name read within 2 s.
async fn far_exchange(ns: &Ns, src: Ipv4Addr, vip: Ipv4Addr, port: u16) -> bool {
    let f = async {
        let s = ns.socket()?;
        s.bind(sa(src, 0))?;
        let mut s = s.connect(sa(vip, port)).await?;
        netns::peers::read_line(&mut s).await
    };
    matches!(
        tokio::time::timeout(Duration::from_secs(2), f).await,
        Ok(Ok(name)) if !name.is_empty()
    )
}

/// The TCP flows to `vip` that `ns` DNATed, in its conntrack table (a host
/// with `br_netfilter` also tracks the flows it only bridges).
fn flows_to(ns: &Ns, vip: Ipv4Addr) -> usize {
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &ns.name,
            "conntrack",
            "-L",
            "--dst-nat",
            "-p",
            "tcp",
            "-d",
        ])
        .arg(vip.to_string())
        .output()
        .expect("conntrack");
    String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("tcp"))
        .count()
}

/// Waits until `d` has written its kernel listeners (its `/status`).
async fn kernel_written(d: &DaemonProc) {
    wait_for(
        Duration::from_secs(30),
        "the kernel listeners written",
        || async {
            let Ok((200, body)) = d.get("/status").await else {
                return None;
            };
            let s: serde_json::Value = serde_json::from_str(&body).ok()?;
            s["load_balancers"]
                .as_array()
                .is_some_and(|lbs| {
                    !lbs.is_empty()
                        && lbs.iter().all(|lb| {
                            lb["listeners"]
                                .as_array()
                                .is_some_and(|ls| ls.iter().any(|l| l["forwarding"] == "kernel"))
                        })
                })
                .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_host_that_bridges_a_vm_s_frames_to_the_vip_s_holder_does_not_dnat_them() {
    require_netns!();
    let mut bed = Bed::new("vmbrpass", 1);
    let (a, b) = hosts(&mut bed);
    // The backend a VM host a routes to (another subnet): the kernel path
    // is taken there (a backend in the network's subnet would be served by
    // the proxy on a bridged host, see the holder's test).
    let rb = routed_vm(&mut bed, &a, "rb", ROUTED_GW, ROUTED);
    let _backend = serve_name_then_echo(&rb, sa(ROUTED, NODEPORT), "rb");
    let cv = vm_on_host(&mut bed, &b, "eth0", "cv", CV);
    // Host a holds the VIP; both hosts have the same load balancer.
    a.ip(&["addr", "add", &format!("{VIP_LOCAL}/32"), "dev", "eth0"]);
    let vips = [(VIP_LOCAL, ROUTED)];
    let mut daemons = Vec::new();
    for (ns, name, mgmt, peer) in [
        (&a, "a", "10.77.0.1", "10.77.0.2"),
        (&b, "b", "10.77.0.2", "10.77.0.1"),
    ] {
        let path = bed.write(
            &format!("config-{name}.toml"),
            &daemon_config(&bed, name, mgmt, peer, &vips),
        );
        let d = DaemonProc::spawn(ns, &path, &bed.dir.join(format!("daemon-{name}.log")), None);
        kernel_written(&d).await;
        daemons.push(d);
    }
    assert!(
        b.nft_out(&["list", "table", "inet", "harvester_lb_nat"])
            .is_some_and(|t| t.contains(&VIP_LOCAL.to_string())),
        "host b has the listener's table"
    );
    wait_for(
        Duration::from_secs(30),
        "the VM on host b's bridge served through the VIP",
        || async {
            matches!(
                exchange(&cv, sa(VIP_LOCAL, KERNEL), 64, Duration::from_secs(2)).await,
                Exchange::Ok(_)
            )
            .then_some(())
        },
    )
    .await;
    let ok = served(&cv, None, VIP_LOCAL, KERNEL, 10).await;
    let (on_a, on_b) = (flows_to(&a, VIP_LOCAL), flows_to(&b, VIP_LOCAL));
    eprintln!(
        "FIGURE vmnet bridged: a VM on a non-holder's bridge served {ok}/10 through the kernel listener; flows to the VIP DNATed by the holder {on_a}, by the bridging host {on_b}"
    );
    assert_eq!(
        ok, 10,
        "the VM on host b's bridge is served through the VIP"
    );
    assert_eq!(
        on_b, 0,
        "host b, which only bridges the VM's frames to host a, NATs none of them ({on_a} on a)"
    );
    assert!(on_a >= 10, "host a serves the VM's flows ({on_a})");
    drop(daemons);
}

/// One row of the holder's measure: the backend's place, the client, and
/// how many of ten exchanges the kernel and the proxy listener served.
struct Row {
    backend: &'static str,
    client: &'static str,
    kernel: usize,
    proxy: usize,
}

/// The reason `/status` gives for a kernel listener of `d`'s first load
/// balancer served by the proxy, once it gives one (`None`: served by the
/// kernel).
async fn proxy_reason(d: &DaemonProc) -> Option<String> {
    let Ok((200, body)) = d.get("/status").await else {
        return None;
    };
    let s: serde_json::Value = serde_json::from_str(&body).ok()?;
    let l = &s["load_balancers"][0]["listeners"]
        .as_array()?
        .iter()
        .find(|l| l["name"] == "kernel")?
        .clone();
    (l["forwarding"] == "proxy").then(|| l["kernel_error"].as_str().unwrap_or("").to_string())
}

/// Ten exchanges from each client to each VIP through the kernel and the
/// proxy listener, on host a (holding both VIPs: one with its backend n1
/// behind the uplink, one with its backend v1 a VM on a's bridge); clients
/// on the network behind the uplink, behind the gateway, and a VM on a's
/// own bridge.
async fn holder_rows(bed: &Bed, gw: &Ns, cv: &Ns) -> Vec<Row> {
    let mut rows = Vec::new();
    for (vip, backend) in [
        (VIP_UPLINK, "behind the uplink"),
        (VIP_LOCAL, "on the holder's bridge"),
    ] {
        for (who, client, from) in [
            ("on the network", &bed.client, None),
            ("behind the gateway", gw, Some(FAR_CLIENT)),
            ("a VM on the holder's bridge", cv, None),
        ] {
            rows.push(Row {
                backend,
                client: who,
                kernel: served(client, from, vip, KERNEL, 10).await,
                proxy: served(client, from, vip, PROXY, 10).await,
            });
        }
    }
    let text: Vec<String> = rows
        .iter()
        .map(|r| {
            format!(
                "backend {}, client {}: kernel listener {}/10, proxy listener {}/10",
                r.backend, r.client, r.kernel, r.proxy
            )
        })
        .collect();
    eprintln!("FIGURE vmnet bridged holder:\n{}", text.join("\n"));
    rows
}

/// The leg of the test's network (`[[network]]` "t/a", table 1000).
const LEG: &str = "hleg1000";

/// Whether host `ns` has interface `name`.
fn has_link(ns: &Ns, name: &str) -> bool {
    Command::new("ip")
        .args(["netns", "exec", &ns.name, "ip", "link", "show", name])
        .output()
        .is_ok_and(|o| o.status.success())
}

/// `d`'s `/status` entry of network "t/a"'s leg, once it reads `up`.
async fn leg_up(d: &DaemonProc, what: &str) -> serde_json::Value {
    wait_for(Duration::from_secs(30), what, || async {
        let Ok((200, body)) = d.get("/status").await else {
            return None;
        };
        let s: serde_json::Value = serde_json::from_str(&body).ok()?;
        let leg = s["network_legs"]["t/a"].clone();
        (leg["state"] == "up").then_some(leg)
    })
    .await
}

/// Issue 40, defect 1, by a routed leg (round 49): on a holder whose
/// VM-network interface is a bridge with `br_netfilter` on, the kernel
/// listeners of a load balancer with backends in the network's subnet are
/// served by the kernel, through the network's leg (`hleg1000`, a macvlan
/// on the bridge: the network's table routes by it, both directions of its
/// flows carry its mark, so `br_nf_pre_routing_finish` routes them instead
/// of bridging them back toward their ingress port), and every client
/// reaches every backend: each row 10 of 10 through the kernel listener,
/// each flow DNATed in the holder's conntrack table (before: the proxy
/// served them, no flow DNATed; without the leg, 0 of 10 where the client
/// and the backend are both behind the uplink). With
/// `bridge-nf-call-iptables=0` they stay in the kernel. The leg deleted by
/// another program is made again, with its MAC, and counted
/// (`host_repairs_total{kind="network_leg"}`); a clean stop leaves no leg.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_kernel_listener_on_a_bridged_vm_network_serves_every_client_and_backend() {
    require_netns!();
    let mut bed = Bed::new("vmbrhold", 1);
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let (gw, _) = bed.add_host("gw", GATEWAY);
    gw.ip(&["addr", "add", &format!("{FAR_CLIENT}/32"), "dev", "lo"]);
    let (a, _b) = hosts(&mut bed);
    let v1 = vm_on_host(&mut bed, &a, "eth0", "v1", V1);
    let _backend = serve_name_then_echo(&v1, sa(V1, NODEPORT), "v1");
    let cv = vm_on_host(&mut bed, &a, "eth0", "cv", CV);
    for vip in [VIP_UPLINK, VIP_LOCAL] {
        a.ip(&["addr", "add", &format!("{vip}/32"), "dev", "eth0"]);
    }
    let path = bed.write(
        "config-a.toml",
        &daemon_config(
            &bed,
            "a",
            "10.77.0.1",
            "10.77.0.2",
            &[(VIP_UPLINK, node_ip(1)), (VIP_LOCAL, V1)],
        ),
    );
    // As on a Harvester host: reverse-path filtering loose (systemd's
    // default), and a default route out of the management network (to a
    // router that knows no client here: the loose check needs some route
    // to a client behind the network's gateway, docs/vip.md).
    sysctl(&a, "net.ipv4.conf.all.rp_filter=2");
    a.ip(&[
        "route",
        "add",
        "default",
        "via",
        "10.77.0.254",
        "dev",
        "mgmt",
        "onlink",
    ]);
    let mut d = DaemonProc::spawn(&a, &path, &bed.dir.join("daemon-a.log"), None);
    kernel_written(&d).await;
    let leg = leg_up(&d, "/status: the network's leg up").await;
    assert_eq!(leg["name"], LEG, "{leg}");
    // The leg answers no ARP request: the bridge answers for the host.
    let arp_ignore = Command::new("ip")
        .args(["netns", "exec", &a.name, "cat"])
        .arg(format!("/proc/sys/net/ipv4/conf/{LEG}/arp_ignore"))
        .output()
        .expect("cat");
    assert_eq!(String::from_utf8_lossy(&arp_ignore.stdout).trim(), "8");
    assert_eq!(
        proxy_reason(&d).await,
        None,
        "the kernel listener in the kernel"
    );
    wait_for(
        Duration::from_secs(30),
        "the kernel listener serves",
        || async { (served(&bed.client, None, VIP_UPLINK, KERNEL, 1).await == 1).then_some(()) },
    )
    .await;
    for r in holder_rows(&bed, &gw, &cv).await {
        assert_eq!(
            (r.kernel, r.proxy),
            (10, 10),
            "kernel and proxy listener, backend {}, client {}",
            r.backend,
            r.client
        );
    }
    let (uplink, local) = (flows_to(&a, VIP_UPLINK), flows_to(&a, VIP_LOCAL));
    eprintln!(
        "FIGURE vmnet bridged holder: flows DNATed to {VIP_UPLINK} {uplink}, to {VIP_LOCAL} {local}"
    );
    assert!(
        uplink >= 30 && local >= 30,
        "the kernel DNATed every row's flows ({uplink} and {local} of 30 each)"
    );
    // Without the bridge stage no leg (the routed path by the bridge
    // works, and what enters an interface without an address is lost to
    // rp_filter), and still the kernel path.
    sysctl(&a, "net.bridge.bridge-nf-call-iptables=0");
    wait_for(
        Duration::from_secs(30),
        "the leg removed with the bridge stage off",
        || async { (!has_link(&a, LEG)).then_some(()) },
    )
    .await;
    kernel_written(&d).await;
    served_again_without_the_leg(&bed.client, VIP_UPLINK).await;
    sysctl(&a, "net.bridge.bridge-nf-call-iptables=1");
    let leg = leg_up(&d, "/status: the leg up again with the bridge stage").await;
    wait_for(
        Duration::from_secs(30),
        "a client behind the uplink served through the kernel listener, bridge stage on again",
        || async { (served(&bed.client, None, VIP_UPLINK, KERNEL, 1).await == 1).then_some(()) },
    )
    .await;
    // Another program deletes the leg: made again with its MAC, counted.
    a.ip(&["link", "del", LEG]);
    wait_for(
        Duration::from_secs(40),
        "the leg made again and its repair counted",
        || async {
            let m = d.metrics().await;
            (netns::metric_sample(
                &m,
                "harvester_lb_host_repairs_total",
                &[("kind", "network_leg")],
            )
            .is_some_and(|v| v >= 1.0)
                && has_link(&a, LEG))
            .then_some(())
        },
    )
    .await;
    let again = leg_up(&d, "/status: the leg up again").await;
    assert_eq!(again["mac"], leg["mac"], "made again with its MAC");
    wait_for(
        Duration::from_secs(30),
        "a client behind the uplink served through the kernel listener after the repair",
        || async { (served(&bed.client, None, VIP_UPLINK, KERNEL, 1).await == 1).then_some(()) },
    )
    .await;
    assert_eq!(
        served(&bed.client, None, VIP_UPLINK, KERNEL, 10).await,
        10,
        "after the leg's repair"
    );
    // A clean stop leaves no leg.
    d.signal(libc::SIGTERM);
    assert!(
        d.wait_exit(Duration::from_secs(60)).await.is_some(),
        "the daemon stops"
    );
    assert!(!has_link(&a, LEG), "the leg is removed at a clean stop");
}

/// The IPv6 test's VIP, its backend (behind the uplink) and client (on
/// the network), in network "t/a"'s IPv6 subnet.
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 0x40);
const BACKEND6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 0x21);
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 0x2);

/// `cidr` on `ns`'s `dev`, without duplicate address detection.
fn add6(ns: &Ns, cidr: &str, dev: &str) {
    ns.ip(&["-6", "addr", "add", cidr, "dev", dev, "nodad"]);
}

/// How many of `n` exchanges from `client` through `[VIP6]:port` the
/// backend answered (its name read within 2 s).
async fn served6(client: &Ns, port: u16, n: usize) -> usize {
    let mut ok = 0;
    for _ in 0..n {
        let f = async {
            let s = client.socket_for(SocketAddr::from((Ipv6Addr::UNSPECIFIED, 0)))?;
            let mut s = s.connect(SocketAddr::from((VIP6, port))).await?;
            netns::peers::read_line(&mut s).await
        };
        ok += usize::from(matches!(
            tokio::time::timeout(Duration::from_secs(2), f).await,
            Ok(Ok(name)) if !name.is_empty()
        ));
    }
    ok
}

/// The IPv6 tests' bed: the backend b6 ([`BACKEND6`]) and the client
/// ([`CLIENT6`]) behind the uplink, host a with IPv6 forwarding and
/// `bridge-nf-call-ip6tables=1`, `fd00:a::4/64` and the VIP on its bridge.
/// Returns host a and the backend's server.
fn ipv6_bed(bed: &mut Bed) -> (Ns, tokio::task::JoinHandle<()>) {
    let (b6, _) = bed.add_host("b6", Ipv4Addr::new(198, 51, 100, 22));
    add6(&b6, &format!("{BACKEND6}/64"), "eth0");
    let backend = serve_name_then_echo(&b6, SocketAddr::from((BACKEND6, NODEPORT)), "b6");
    add6(&bed.client, &format!("{CLIENT6}/64"), "eth0");
    let (a, _b) = hosts(bed);
    sysctl(&a, "net.ipv6.conf.all.forwarding=1");
    sysctl(&a, "net.bridge.bridge-nf-call-ip6tables=1");
    add6(&a, "fd00:a::4/64", "eth0");
    add6(&a, &format!("{VIP6}/128"), "eth0");
    (a, backend)
}

/// Starts host a's daemon on `text` and waits until its first load
/// balancer's first listener is in the kernel (`/status`).
async fn first_listener_in_kernel(bed: &Bed, a: &Ns, text: &str, what: &str) -> DaemonProc {
    let path = bed.write("config-a.toml", text);
    let d = DaemonProc::spawn(a, &path, &bed.dir.join("daemon-a.log"), None);
    wait_for(Duration::from_secs(30), what, || async {
        let Ok((200, body)) = d.get("/status").await else {
            return None;
        };
        let s: serde_json::Value = serde_json::from_str(&body).ok()?;
        (s["load_balancers"][0]["listeners"][0]["forwarding"] == "kernel").then_some(())
    })
    .await;
    d
}

/// Once `client` is served through `[VIP6]:80` at all: ten exchanges all
/// answered by the backend, and as many TCP flows to the VIP DNATed by
/// host `a` (its conntrack table); `figure` names the line printed.
async fn served6_through_kernel(a: &Ns, client: &Ns, figure: &str) {
    wait_for(
        Duration::from_secs(30),
        "the IPv6 kernel listener serves",
        || async { (served6(client, KERNEL, 1).await == 1).then_some(()) },
    )
    .await;
    let ok = served6(client, KERNEL, 10).await;
    let out = Command::new("ip")
        .args([
            "netns",
            "exec",
            &a.name,
            "conntrack",
            "-L",
            "-f",
            "ipv6",
            "--dst-nat",
            "-p",
            "tcp",
            "-d",
        ])
        .arg(VIP6.to_string())
        .output()
        .expect("conntrack");
    let flows = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.starts_with("tcp"))
        .count();
    eprintln!(
        "FIGURE {figure}: backend and client behind the uplink, {ok}/10 through the kernel listener, {flows} flows DNATed"
    );
    assert_eq!(ok, 10, "through the kernel listener");
    assert!(flows >= 10, "the kernel DNATed those flows ({flows})");
}

/// The IPv6 half of the holder's test (`br_nf_pre_routing_finish_ipv6`
/// has the same `bridged_dnat` path): an IPv6 VIP on the bridged network,
/// its backend and its client both behind the uplink,
/// `bridge-nf-call-ip6tables=1`. Through the network's leg the kernel
/// listener serves 10 of 10, each flow DNATed by the holder (before: the
/// proxy served it, no flow DNATed). Left out: a client behind the
/// gateway and a VM on the holder's bridge (the IPv4 test's rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_an_ipv6_kernel_listener_on_a_bridged_vm_network_is_served_through_its_leg() {
    require_netns!();
    let mut bed = Bed::new("vmbrhold6", 1);
    let (a, _backend) = ipv6_bed(&mut bed);
    let text = config()
        .socket(&bed.dir.join("admin-a.sock"))
        .text(
            &(keepalived(
                "a",
                "10.77.0.1",
                ["10.77.0.2"],
                &bed.dir.join("keepalived-a"),
                "",
            ) + &network("t/a", "eth0", GATEWAY, "ipv6_gateway = \"fd00:a::1\"")),
        )
        .lb(Lb::new("t/web6", VIP6)
            .backends([BACKEND6])
            .keys("network = \"t/a\"")
            .listener(Listener::new("kernel", KERNEL, NODEPORT).forwarding("kernel")))
        // keepalived moves an IPv6 VIP only beside an IPv4 one of its
        // instance: this one is served by the proxy alone.
        .lb(Lb::new("t/anchor", VIP_LOCAL)
            .backends([node_ip(1)])
            .keys("network = \"t/a\"")
            .listener(Listener::new("anchor", PROXY, NODEPORT)))
        .to_string();
    let d = first_listener_in_kernel(
        &bed,
        &a,
        &text,
        "/status: the IPv6 VIP's kernel listener in the kernel",
    )
    .await;
    let leg = leg_up(&d, "/status: the network's leg up").await;
    assert_eq!(leg["name"], LEG, "{leg}");
    served6_through_kernel(&a, &bed.client, "vmnet bridged IPv6").await;
    drop(d);
}

/// Host a's file with `keepalived.interface` its bridge `eth0` (standing
/// for `mgmt-br`), load balancers to follow.
fn mgmt_config(bed: &Bed) -> support::Config {
    config().socket(&bed.dir.join("admin-a.sock")).text(
        &keepalived(
            "a",
            "198.51.100.4",
            ["198.51.100.5"],
            &bed.dir.join("keepalived-a"),
            "",
        )
        .replace("interface = \"mgmt\"", "interface = \"eth0\""),
    )
}

/// The management VIPs' leg's table (`keepalived.management_table`'s
/// default), its leg and its mark.
const MGMT_TABLE: &str = "999";
const MGMT_LEG: &str = "hleg999";
const MGMT_MARK: &str = "0xea";
/// A backend behind the management network's router (on its `lo`).
const BEHIND_GATEWAY: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 21);

/// What host `a` holds of the management VIPs' leg: the leg, its table's
/// subnet route out of it, and the `fwmark` rule into the table.
fn mgmt_leg_in_place(a: &Ns) -> (bool, bool, bool) {
    let leg = ip_out(a, &["-o", "link", "show"]).contains(&format!("{MGMT_LEG}@eth0"));
    let route = ip_out(a, &["route", "show", "table", MGMT_TABLE])
        .contains(&format!("198.51.100.0/24 dev {MGMT_LEG}"));
    let rule = ip_out(a, &["rule", "show"])
        .contains(&format!("fwmark {MGMT_MARK}/0xff lookup {MGMT_TABLE}"));
    (leg, route, rule)
}

/// Issue 42 (h42-bridge, then h49-mgmtleg): a management VIP (a load
/// balancer on no `[[network]]`, moved by the configured keepalived on
/// `keepalived.interface`) whose interface is a bridge with `br_netfilter`
/// on, and whose backend is routed out of that same bridge (n1, behind the
/// uplink, and g1 behind the network's router): the same bridge stage as a
/// network VIP's. First 0 of 10
/// clients on the network behind the uplink were served through the
/// kernel listener (each timed out); then the proxy served it (10 of 10,
/// its connections lost at a move); now the kernel does, through the
/// management VIPs' leg (`hleg999`, a macvlan on the bridge) and its
/// table 999 (the main table's routes out of the bridge, moved onto the
/// leg: its subnet and `default via` the router): 10 of 10 DNATed from a
/// client on the network and one behind the router, to either backend,
/// `/status` `forwarding: "kernel"`, the host's own traffic by the main
/// table. While another program's interface holds the leg's name the
/// proxy serves them, `kernel_error` naming the leg; once it is gone the
/// leg is made and the kernel serves. A route of that
/// table deleted by another program is put back and counted
/// (`host_repairs_total{kind="network_route"}`), a change of the main
/// table's default route followed; with
/// `bridge-nf-call-iptables=0` no leg, table or rule and the kernel path
/// by the bridge (10 of 10), and they come back with it at 1; a clean stop
/// leaves no leg, route or rule. The bridge here is host a's `eth0` standing for
/// `mgmt-br`; keepalived itself is left out (the VIP is added by hand, as
/// in the holder's test).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_kernel_listener_on_a_management_vip_over_a_bridge_is_served_by_the_kernel() {
    require_netns!();
    let mut bed = Bed::new("vmbrmgmt", 1);
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    // The management network's router, with a client and a backend behind it.
    let (gw, _) = bed.add_host("gw", GATEWAY);
    for ip in [FAR_CLIENT, BEHIND_GATEWAY] {
        gw.ip(&["addr", "add", &format!("{ip}/32"), "dev", "lo"]);
    }
    let _g1 = serve_name_then_echo(&gw, sa(BEHIND_GATEWAY, NODEPORT), "g1");
    let (a, _b) = hosts(&mut bed);
    a.ip(&[
        "route",
        "add",
        "default",
        "via",
        &GATEWAY.to_string(),
        "dev",
        "eth0",
    ]);
    // Loose reverse-path filtering, as a Harvester host's (systemd's default).
    sysctl(&a, "net.ipv4.conf.all.rp_filter=2");
    for vip in [VIP_UPLINK, VIP_LOCAL] {
        a.ip(&["addr", "add", &format!("{vip}/32"), "dev", "eth0"]);
    }
    let text = mgmt_config(&bed)
        .lb(Lb::new("t/mgmt", VIP_UPLINK)
            .backends([node_ip(1)])
            .listener(Listener::new("kernel", KERNEL, NODEPORT).forwarding("kernel"))
            .listener(Listener::new("proxy", PROXY, NODEPORT)))
        .lb(Lb::new("t/mgmt-gw", VIP_LOCAL)
            .backends([BEHIND_GATEWAY])
            .listener(Listener::new("kernel", KERNEL, NODEPORT).forwarding("kernel"))
            .listener(Listener::new("proxy", PROXY, NODEPORT)))
        .to_string();
    let path = bed.write("config-a.toml", &text);
    // Another program's interface holds the leg's name: no leg, so the
    // proxy serves the kernel listeners, the reason naming the leg.
    a.ip(&[
        "link", "add", MGMT_LEG, "type", "veth", "peer", "name", "hlegpeer",
    ]);
    let mut d = DaemonProc::spawn(&a, &path, &bed.dir.join("daemon-a.log"), None);
    wait_for(
        Duration::from_secs(30),
        "the proxy listener serves",
        || async { (served(&bed.client, None, VIP_UPLINK, PROXY, 1).await == 1).then_some(()) },
    )
    .await;
    let reason = wait_for(
        Duration::from_secs(30),
        "/status: the kernel listener with the proxy, the leg named",
        || async {
            proxy_reason(&d)
                .await
                .filter(|r| r.contains("another program"))
        },
    )
    .await;
    assert!(
        reason.contains(&format!("leg \"{MGMT_LEG}\"")),
        "the reason names the leg: {reason}"
    );
    assert_eq!(
        served(&bed.client, None, VIP_UPLINK, KERNEL, 10).await,
        10,
        "by the proxy meanwhile"
    );
    // Gone: the leg is made at the next step (every 10 s; a reload, as
    // here, wakes it at once), its table and marks, and the kernel serves.
    a.ip(&["link", "del", MGMT_LEG]);
    d.signal(libc::SIGHUP);
    kernel_written(&d).await;
    let mut rows = Vec::new();
    for (vip, backend) in [
        (VIP_UPLINK, "behind the uplink"),
        (VIP_LOCAL, "behind the gateway"),
    ] {
        for (who, client, from) in [
            ("on the network", &bed.client, None),
            ("behind the gateway", &gw, Some(FAR_CLIENT)),
        ] {
            let ok = served(client, from, vip, KERNEL, 10).await;
            rows.push(format!(
                "backend {backend}, client {who}: {ok}/10 through the kernel listener"
            ));
            assert_eq!(ok, 10, "backend {backend}, client {who}: {rows:?}");
        }
        assert!(flows_to(&a, vip) >= 20, "the kernel DNATed those flows");
    }
    eprintln!("FIGURE vmnet bridged management VIP:\n{}", rows.join("\n"));
    // The host's own traffic still follows the main table, by the bridge.
    let own = ip_out(&a, &["route", "get", &BEHIND_GATEWAY.to_string()]);
    assert!(own.contains("dev eth0 "), "{own}");
    assert_eq!(mgmt_leg_in_place(&a), (true, true, true));

    // Another program deletes the leg's subnet route: put back, counted.
    a.ip(&["route", "del", "198.51.100.0/24", "table", MGMT_TABLE]);
    wait_for(
        Duration::from_secs(40),
        "the leg's table's route put back and counted",
        || async {
            let m = d.metrics().await;
            (mgmt_leg_in_place(&a).1
                && netns::metric_sample(
                    &m,
                    "harvester_lb_host_repairs_total",
                    &[("kind", "network_route")],
                )
                .is_some_and(|v| v >= 1.0))
            .then_some(())
        },
    )
    .await;
    assert_eq!(
        served(&bed.client, None, VIP_UPLINK, KERNEL, 10).await,
        10,
        "through the kernel listener again"
    );

    // The main table's default route changes gateway: the leg's table
    // follows (the routes are looked at every 5 s).
    for gateway in ["198.51.100.9".to_string()] {
        let changed = std::time::Instant::now();
        a.ip(&[
            "route", "replace", "default", "via", &gateway, "dev", "eth0",
        ]);
        let want = format!("default via {gateway} dev {MGMT_LEG}");
        wait_for(
            Duration::from_secs(30),
            "the leg's table follows the main table's default route",
            || async {
                ip_out(&a, &["route", "show", "table", MGMT_TABLE])
                    .contains(&want)
                    .then_some(())
            },
        )
        .await;
        eprintln!(
            "FIGURE vmnet bridged management VIP: table {MGMT_TABLE} followed the main table's default route via {gateway} after {:?}",
            changed.elapsed()
        );
    }

    // Without the bridge stage no leg, table or rule (as a network's), and
    // still the kernel path, by the bridge; with it again, the leg back.
    sysctl(&a, "net.bridge.bridge-nf-call-iptables=0");
    wait_for(
        Duration::from_secs(30),
        "the leg, its table and rule removed with the bridge stage off",
        || async { (mgmt_leg_in_place(&a) == (false, false, false)).then_some(()) },
    )
    .await;
    kernel_written(&d).await;
    served_again_without_the_leg(&bed.client, VIP_UPLINK).await;
    sysctl(&a, "net.bridge.bridge-nf-call-iptables=1");
    wait_for(
        Duration::from_secs(30),
        "the leg, its table and rule back with the bridge stage",
        || async { (mgmt_leg_in_place(&a) == (true, true, true)).then_some(()) },
    )
    .await;
    kernel_written(&d).await;

    // A clean stop leaves no leg, route or rule.
    d.signal(libc::SIGTERM);
    assert!(
        d.wait_exit(Duration::from_secs(60)).await.is_some(),
        "the daemon stops"
    );
    assert_eq!(mgmt_leg_in_place(&a), (false, false, false), "left at stop");
}

/// The IPv6 half of the management VIP's test: an IPv6 management VIP on
/// `keepalived.interface` (host a's bridge), its backend and its client
/// both behind the uplink, `bridge-nf-call-ip6tables=1`. Through the
/// management VIPs' leg and its table (the main table's IPv6 subnet route
/// by the bridge, moved onto the leg; `ip -6 rule fwmark 0xea`) the kernel
/// listener serves 10 of 10, each flow DNATed by the holder (before: the
/// proxy served it, the reason saying an IPv6 VIP gets no leg). Left out:
/// a client or backend behind a router (the IPv4 test's rows).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_an_ipv6_kernel_listener_on_a_management_vip_over_a_bridge_is_served_by_the_kernel() {
    require_netns!();
    let mut bed = Bed::new("vmbrmgmt6", 1);
    let (a, _backend) = ipv6_bed(&mut bed);
    let text = mgmt_config(&bed)
        .lb(Lb::new("t/mgmt6", VIP6)
            .backends([BACKEND6])
            .listener(Listener::new("kernel", KERNEL, NODEPORT).forwarding("kernel")))
        // keepalived moves an IPv6 VIP only beside an IPv4 one of its
        // instance: this one is served by the proxy alone.
        .lb(Lb::new("t/anchor", VIP_LOCAL)
            .backends([node_ip(1)])
            .listener(Listener::new("anchor", PROXY, NODEPORT)))
        .to_string();
    let d = first_listener_in_kernel(
        &bed,
        &a,
        &text,
        "/status: the IPv6 management VIP's kernel listener in the kernel",
    )
    .await;
    let rules = ip_out(&a, &["-6", "rule", "show"]);
    assert!(
        rules.contains(&format!("fwmark {MGMT_MARK}/0xff lookup {MGMT_TABLE}")),
        "{rules}"
    );
    served6_through_kernel(&a, &bed.client, "vmnet bridged IPv6 management VIP").await;
    drop(d);
}

//! A kernel listener (`forwarding = "kernel"`) on a VM network's VIP
//! serves a client behind the network's gateway, on a real kernel in
//! network namespaces: the backend's reply is routed while its source is
//! still the backend, so without the daemon's reply mark it follows the
//! host's main table, which here has no route to the client at all, and
//! then a default route out of the management network to a router that
//! does not know the client. With the mark (`vip::replymark`) the reply
//! leaves through the network's gateway, over TCP and UDP; the `fwmark`
//! rule and the mark table deleted by hand are put back and counted; a
//! clean stop removes both.
//!
//! ```text
//!  network A (br0, 198.51.100.0/24): client .2, host .3 (VIP .10 on eth0,
//!     the daemon), backends n1 .21, n2 .22, gateway .1 (client 203.0.113.2
//!     behind it, on its lo)
//!  management (br1, 10.77.0.0/24): host .3 (`mgmt`), router .254 (no
//!     route to 203.0.113.2)
//! ```
//!
//! Run as root with iproute2 and nftables:
//! `cargo test --test it -- vmnet_replies:: --nocapture`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::Ipv4Addr;
use std::time::Duration;

use netns::peers::{Exchange, Node, Service, exchange};
use netns::vmnet::{
    GATEWAY, from_behind_the_gateway, ip_out, join, sysctl, udp_from_behind_the_gateway,
    udp_name_server,
};
use netns::{Bed, DaemonProc, NODEPORT, Ns, VIP, config, node_ip, sa, wait_for};
use support::{Lb, Listener, keepalived, network};

/// The network's routing table (the first network's default).
const TABLE: u32 = 1000;
/// Its reply mark: 1 + (1000 - 1) mod 255.
const MARK: &str = "0xeb/0xff";
/// The UDP listener's port and its backends' port.
const UDP_PORT: u16 = 53;
const UDP_BACKEND_PORT: u16 = 30053;
/// The host's management address, and the router its default route may
/// point at.
const HOST_MGMT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 3);
const MGMT_ROUTER: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 254);

/// The daemon's config: one network on the host's `eth0`, one load
/// balancer on it with a TCP and a UDP kernel listener.
fn daemon_config(bed: &Bed) -> String {
    config()
        .socket(&bed.dir.join("admin.sock"))
        .text(
            &(keepalived(
                "h",
                HOST_MGMT,
                ["10.77.0.4"],
                &bed.dir.join("keepalived"),
                "",
            ) + &network("t/a", "eth0", GATEWAY, "")),
        )
        .lb(Lb::new("t/web", VIP)
            .backends([node_ip(1), node_ip(2)])
            .keys("network = \"t/a\"")
            .listener(Listener::new("http", 80, NODEPORT).forwarding("kernel"))
            .listener(
                Listener::new("dns", UDP_PORT, UDP_BACKEND_PORT)
                    .udp()
                    .forwarding("kernel"),
            ))
        .to_string()
}

/// Waits until the client behind the gateway is served over TCP and UDP.
async fn far_client_served(gw: &Ns, when: &str) {
    wait_for(
        Duration::from_secs(30),
        &format!("the client behind the gateway served over TCP ({when})"),
        || async { from_behind_the_gateway(gw, VIP).await.then_some(()) },
    )
    .await;
    wait_for(
        Duration::from_secs(30),
        &format!("the client behind the gateway served over UDP ({when})"),
        || async {
            udp_from_behind_the_gateway(gw, VIP, UDP_PORT)
                .await
                .then_some(())
        },
    )
    .await;
}

/// Whether the host holds the network's `fwmark` rule, and the mark table.
fn marks_in_place(host: &Ns) -> (bool, bool) {
    let rules = ip_out(host, &["rule", "show"]);
    let rule = rules.contains(&format!("fwmark {MARK} lookup {TABLE} proto 252"));
    let table = host
        .nft_out(&["list", "table", "inet", "harvester_lb_reply"])
        .is_some();
    (rule, table)
}

/// Waits until both are back and `host_repairs_total{kind="reply_mark"}`
/// reached `repairs`.
async fn repaired(d: &DaemonProc, host: &Ns, repairs: f64, what: &str) {
    wait_for(Duration::from_secs(40), what, || async {
        let m = d.metrics().await;
        (marks_in_place(host) == (true, true)
            && netns::metric_sample(
                &m,
                "harvester_lb_host_repairs_total",
                &[("kind", "reply_mark")],
            )
            .is_some_and(|v| v >= repairs))
        .then_some(())
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_kernel_listener_serves_a_client_behind_the_vm_network_s_gateway() {
    require_netns!();
    let mut bed = Bed::new("vmreply", 2);
    let _nodes = [
        Node::start(&bed, 1, Service::NameThenEcho),
        Node::start(&bed, 2, Service::NameThenEcho),
    ];
    let _udp: Vec<_> = (1..=2)
        .map(|i| {
            udp_name_server(
                bed.node(i),
                sa(node_ip(i), UDP_BACKEND_PORT),
                &format!("n{i}"),
            )
        })
        .collect();
    let (gw, _) = bed.add_host("gw", GATEWAY);
    gw.ip(&[
        "addr",
        "add",
        &format!("{}/32", netns::vmnet::FAR_CLIENT),
        "dev",
        "lo",
    ]);
    // The management segment: the host, and a router that does not know
    // the far client.
    bed.add_bridge("br1");
    let host = bed.lb.clone();
    join(
        &bed,
        &host,
        "br1",
        "mgmt-h",
        "mgmt",
        &format!("{HOST_MGMT}/24"),
    );
    bed.add_host_on("br1", "r", MGMT_ROUTER);
    bed.enable_forwarding();
    // No route to the far client at all: a reverse-path filter would drop
    // its packets before any DNAT, whatever the daemon does (see
    // docs/vip.md), so it is off for this half.
    for conf in ["all", "default", "eth0"] {
        sysctl(&host, &format!("net.ipv4.conf.{conf}.rp_filter=0"));
    }

    let path = bed.write("config.toml", &daemon_config(&bed));
    let mut d = DaemonProc::spawn(&host, &path, &bed.dir.join("daemon.log"), None);
    // The on-link client is served either way (its subnet is on-link in
    // the main table): the bed and the kernel listener work.
    wait_for(
        Duration::from_secs(30),
        "the on-link client served through the VIP",
        || async {
            let e = exchange(&bed.client, sa(VIP, 80), 64, Duration::from_secs(2)).await;
            matches!(e, Exchange::Ok(_)).then_some(())
        },
    )
    .await;
    // The far client: its replies go by the network's table only with the
    // mark (the main table has no route to it).
    far_client_served(&gw, "no route to it in the main table").await;
    assert_eq!(marks_in_place(&host), (true, true));
    // /status reports what the kernel holds.
    let held = d.status().await["reply_marks"]["held"].clone();
    assert!(
        held.as_array().is_some_and(|h| h.len() == 2
            && h.iter().any(|k| k == "ip rule fwmark 0xeb/0xff")
            && h.iter().any(|k| k == "table inet harvester_lb_reply")),
        "{held}"
    );
    let nat = std::process::Command::new("ip")
        .args(["netns", "exec", &host.name, "nft", "list", "ruleset"])
        .output()
        .expect("nft");
    let ruleset = String::from_utf8_lossy(&nat.stdout);
    assert!(
        ruleset.contains("ct mark set ct mark & 0xffffffeb | 0x000000eb"),
        "the flows' mark keeps the other bits: {ruleset}"
    );

    // Deleted by hand: the rule, then the table; each put back, counted.
    host.ip(&["rule", "del", "fwmark", MARK, "lookup", &TABLE.to_string()]);
    assert!(!marks_in_place(&host).0);
    repaired(&d, &host, 1.0, "the fwmark rule put back").await;
    netns::run(
        "ip",
        &[
            "netns",
            "exec",
            &host.name,
            "nft",
            "delete",
            "table",
            "inet",
            "harvester_lb_reply",
        ],
        None,
    );
    assert!(!marks_in_place(&host).1);
    repaired(&d, &host, 2.0, "the mark table put back").await;
    far_client_served(&gw, "after the repairs").await;

    // A default route out of the management network, to a router that
    // does not know the far client, and loose reverse-path filtering (a
    // Harvester host's): without the mark the replies would leave there.
    host.ip(&[
        "route",
        "add",
        "default",
        "via",
        &MGMT_ROUTER.to_string(),
        "dev",
        "mgmt",
    ]);
    for conf in ["all", "default", "eth0", "mgmt"] {
        sysctl(&host, &format!("net.ipv4.conf.{conf}.rp_filter=2"));
    }
    far_client_served(&gw, "default route on the management network").await;

    // A clean stop removes the rule and the table.
    d.signal(libc::SIGTERM);
    assert!(
        d.wait_exit(Duration::from_secs(60)).await.is_some(),
        "the daemon stops"
    );
    assert_eq!(marks_in_place(&host), (false, false), "left at stop");
}

//! Issue 42, item 4: an IPv6 VIP on a VM network, served through the
//! kernel path (`forwarding = "kernel"`, TCP and UDP, `source_nat =
//! "none"`), moved between two keepalived hosts with conntrackd's sync,
//! its open connections kept at each fault and at the failback.
//!
//! ```text
//!  switch br0 (network A, 198.51.100.0/24, fd00:a::/64): client .2 / ::2,
//!     the uplinks (up0) of hosts a and b, their bridges eth0 .4/.5, ::4/::5
//!  switch br2 (network B, 192.0.2.0/24, fd00:b::/64): the backends
//!     b1 fd00:b::21 and b2 fd00:b::22 (plain veths), the uplinks (up1) of
//!     hosts a and b, their bridges eth1 ::4/::5
//!  management br1: a 10.77.0.1, b 10.77.0.2 (VRRP v3, advert 0.5 s)
//!  sync link sync0: a 10.99.0.1, b 10.99.0.2 (conntrackd FTFW, unicast)
//! ```
//!
//! Each host is built as a Harvester host (/work/shared/notes/harvester-host.md):
//! its interface on each VM network is a Linux bridge with an uplink veth
//! into the switch, `br_netfilter` on for both families
//! (`bridge-nf-call-ip6tables=1`). The backends are on network B, routed
//! from the VIP's network A, so the daemon takes the kernel path (with
//! backends in network A's subnet a bridged holder serves the listeners by
//! the proxy: `tests/it/vmnet_bridged.rs`). The load balancers, all in one
//! VRRP instance (`instances = 1`):
//!
//! - `default/db6`, VIP `fd00:a::40` on network A: a kernel TCP listener
//!   (80 → 30080) and a kernel UDP one (5353 → 30053), backends b1, b2;
//! - `default/gw6`, VIP `fd00:b::40` on network B: the backends' route to
//!   the client (`fd00:a::/64 via fd00:b::40`), an address that moves with
//!   the VIP, so their replies go through whichever host holds it;
//! - `default/anchor`, VIP `198.51.100.40`: the instance's IPv4 VIP
//!   (keepalived carries IPv6 VIPs under IPv4 adverts only as excluded
//!   addresses of an instance with one of its own; docs/vip.md, "IPv6").
//!
//! Each host runs the real daemon, keepalived 2.2.7 and conntrackd 1.4.7
//! on the files the daemon renders, keepalived running the rendered notify
//! script. Traffic: 20 TCP connections echoing a line every 100 ms and 4
//! UDP flows from fixed client ports, one datagram every 100 ms, all to
//! the IPv6 VIP. Host a is master; it fails (killed, graceful stop, links
//! cut), b takes over; a comes back and takes the VIP back. Asserted at
//! both moves: 20 of 20 connections alive, no UDP flow on another backend,
//! 0 lines lost. `FIGURE` lines carry the measures.
//!
//! Left out: the bridges' VLAN filtering and the bond under the uplink
//! (this kernel builds neither), a third host (the two-host unicast sync;
//! the N-host sync is h42-nhosts's), and a backend on a host's own bridge.
//!
//! Run as root with iproute2, nftables, keepalived, conntrackd, conntrack:
//! `cargo test --test it -- conntrack_sync_v6:: --nocapture --test-threads 1`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::{Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, BufReader};

use netns::keepalived::{
    Conntrackd, Keepalived, conntrackd_missing, gate_open, keepalived_missing,
};
use netns::peers::{accept_forever, serve_name_then_echo};
use netns::traffic::{CONNS, FLOWS, Target, Traffic, assert_kept};
use netns::vmnet::{
    holds_on, ip_out, join_bridged, mac_of, mgmt_host, mgmt_port, sysctl, udp_name_server,
};
use netns::{Bed, DaemonProc, NODEPORT, Ns, config, wait_for};
use support::{Lb, Listener, conntrackd, keepalived, network};

/// The IPv6 VIP of the kernel listeners, on network A.
const VIP6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 0x40);
/// The backends' gateway to the client: a VIP on network B.
const GW6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, 0x40);
/// The instance's IPv4 VIP.
const ANCHOR: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 40);
/// The client on network A.
const CLIENT6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 2);
/// Network A's IPv6 router (`ipv6_gateway`), and a client behind it that
/// the hosts reach only through it (no route in their main table): the
/// replies to it take the network's table.
const ROUTER6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xa, 0, 0, 0, 0, 0, 1);
const FAR6: Ipv6Addr = Ipv6Addr::new(0xfd00, 0xf, 0, 0, 0, 0, 0, 2);
/// The UDP listener's port and the backends' UDP port.
const UDP_PORT: u16 = 5353;
const UDP_NODEPORT: u16 = 30053;
/// The backends' health port (the daemon's default probe).
const HEALTH_PORT: u16 = netns::HEALTH_PORT;
/// The one VRRP instance.
const VRID: &str = "50";

/// Backend `i` (1 or 2) on network B.
fn backend(i: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, 0x20 + i)
}

fn sa6(ip: Ipv6Addr, port: u16) -> SocketAddr {
    SocketAddr::from((ip, port))
}

/// How the master fails.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Fault {
    /// Its daemon and keepalived (both processes) are killed (SIGKILL).
    Killed,
    /// Its links (both VM networks and management) are cut.
    LinkCut,
    /// Its daemon stops gracefully (SIGTERM): `/readyz` turns 503, the
    /// track script fails, keepalived gives the VIPs up.
    GracefulStop,
}

/// One load-balancer host.
struct Host {
    ns: Ns,
    name: &'static str,
    /// Its switch ports: network A, network B, management.
    ports: [String; 3],
    config: PathBuf,
    keepalived_conf: PathBuf,
    conntrackd_conf: PathBuf,
    daemon: Option<DaemonProc>,
    keepalived: Option<Keepalived>,
    conntrackd: Option<Conntrackd>,
}

/// The bed, its hosts and backends.
struct V6Bed {
    bed: Bed,
    /// Network A's router, [`FAR6`] on its `lo`.
    router: Ns,
    hosts: Vec<Host>,
    backends: Vec<Ns>,
    services: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for V6Bed {
    fn drop(&mut self) {
        for s in &self.services {
            s.abort();
        }
    }
}

/// The daemon's file for host `name`.
fn host_config(bed: &Bed, name: &str, me: (&str, &str), peer: (&str, &str)) -> String {
    let mut text = keepalived(
        name,
        me.0,
        [peer.0],
        &bed.dir.join(format!("keepalived-{name}")),
        "instances = 1\nadvert_interval_ms = 500\n",
    ) + &network(
        "default/vma",
        "eth0",
        "198.51.100.1",
        "ipv6_gateway = \"fd00:a::1\"",
    ) + &network(
        "default/vmb",
        "eth1",
        "192.0.2.1",
        "ipv6_gateway = \"fd00:b::1\"",
    );
    text.push_str(&conntrackd(
        &bed.dir,
        name,
        &format!(
            "interface = \"sync0\"\naddress = \"{}\"\npeer = \"{}\"\n",
            me.1, peer.1
        ),
    ));
    let backends = [backend(1), backend(2)];
    let db = Lb::new("default/db6", VIP6)
        .backends(backends)
        .keys("network = \"default/vma\"")
        .listener(
            Listener::new("tcp", 80, NODEPORT)
                .forwarding("kernel")
                .source_nat("none"),
        )
        .listener(
            Listener::new("udp", UDP_PORT, UDP_NODEPORT)
                .udp()
                .forwarding("kernel")
                .source_nat("none"),
        );
    // Served by the proxy: their listeners only make the VIPs exist.
    let gw = Lb::new("default/gw6", GW6)
        .backends(backends)
        .keys("network = \"default/vmb\"")
        .listener(Listener::new("gw", 81, NODEPORT));
    let anchor = Lb::new("default/anchor", ANCHOR)
        .backends(backends)
        .keys("network = \"default/vma\"")
        .listener(Listener::new("anchor", 81, NODEPORT));
    config()
        .socket(&bed.dir.join(format!("admin-{name}.sock")))
        .text(&text)
        .lb(db)
        .lb(gw)
        .lb(anchor)
        .to_string()
}

/// `ip -6 neigh show ADDR` in `ns` names `lladdr`.
fn neighbour_at(ns: &Ns, addr: Ipv6Addr, lladdr: &str) -> bool {
    ip_out(ns, &["-6", "neigh", "show", &addr.to_string()]).contains(lladdr)
}

/// `ip -6 addr add CIDR dev DEV nodad` in `ns`.
fn add6(ns: &Ns, cidr: &str, dev: &str) {
    ns.ip(&["-6", "addr", "add", cidr, "dev", dev, "nodad"]);
}

impl V6Bed {
    async fn new(tag: &str) -> V6Bed {
        let mut bed = Bed::new(tag, 1);
        add6(&bed.client, &format!("{CLIENT6}/64"), "eth0");
        let (router, _) = bed.add_host("r6", Ipv4Addr::new(198, 51, 100, 1));
        add6(&router, &format!("{ROUTER6}/64"), "eth0");
        add6(&router, &format!("{FAR6}/128"), "lo");
        sysctl(&router, "net.ipv6.conf.all.forwarding=1");
        bed.add_bridge("br1");
        bed.add_bridge("br2");
        let mut backends = Vec::new();
        let mut services = Vec::new();
        for i in 1..=2u16 {
            let (ns, _) = bed.add_host_on(
                "br2",
                &format!("b{i}"),
                Ipv4Addr::new(192, 0, 2, 20 + i as u8),
            );
            add6(&ns, &format!("{}/64", backend(i)), "eth0");
            // Replies to the client through the gateway VIP, so through
            // whichever host holds the instance.
            ns.ip(&["-6", "route", "add", "default", "via", &GW6.to_string()]);
            sysctl(&ns, "net.ipv6.conf.all.accept_redirects=0");
            let name = format!("n{i}");
            services.push(serve_name_then_echo(&ns, sa6(backend(i), NODEPORT), &name));
            services.push(udp_name_server(&ns, sa6(backend(i), UDP_NODEPORT), &name));
            services.push(tokio::spawn(accept_forever(
                ns.listen(sa6(backend(i), HEALTH_PORT)),
            )));
            backends.push(ns);
        }
        let mut hosts = Vec::new();
        for (name, k) in [("a", 4u8), ("b", 5)] {
            let mgmt = format!("10.77.0.{}", k - 3);
            let (ns, port_a) = mgmt_host(&mut bed, name, Ipv4Addr::new(198, 51, 100, k), &mgmt);
            add6(&ns, &format!("fd00:a::{k}/64"), "eth0");
            let port_b = format!("k{name}");
            join_bridged(
                &bed,
                &ns,
                "br2",
                &port_b,
                ("eth1", "up1"),
                &format!("192.0.2.{k}/24"),
            );
            add6(&ns, &format!("fd00:b::{k}/64"), "eth1");
            for s in [
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv4.conf.all.send_redirects=0",
                "net.ipv6.conf.all.accept_dad=0",
            ] {
                sysctl(&ns, s);
            }
            hosts.push(Host {
                ns,
                name,
                ports: [port_a, port_b, mgmt_port(name)],
                config: bed.dir.join(format!("config-{name}.toml")),
                keepalived_conf: bed.dir.join(format!("keepalived-{name}.conf")),
                conntrackd_conf: bed.dir.join(format!("conntrackd.conf-{name}")),
                daemon: None,
                keepalived: None,
                conntrackd: None,
            });
        }
        hosts[0].ns.ip(&[
            "link",
            "add",
            "sync0",
            "type",
            "veth",
            "peer",
            "name",
            "sync0",
            "netns",
            &hosts[1].ns.name,
        ]);
        for (h, addr) in hosts.iter().zip(["10.99.0.1/24", "10.99.0.2/24"]) {
            h.ns.ip(&["addr", "add", addr, "dev", "sync0"]);
            h.ns.ip(&["link", "set", "sync0", "up"]);
        }
        let ends = [("10.77.0.1", "10.99.0.1"), ("10.77.0.2", "10.99.0.2")];
        for (i, h) in hosts.iter().enumerate() {
            std::fs::write(&h.config, host_config(&bed, h.name, ends[i], ends[1 - i])).unwrap();
        }
        let mut vb = V6Bed {
            bed,
            router,
            hosts,
            backends,
            services,
        };
        for i in 0..2 {
            vb.start_daemon(i).await;
            vb.start_conntrackd(i).await;
            vb.start_keepalived(i);
        }
        vb
    }

    /// Starts host `i`'s daemon; waits until it wrote keepalived's and
    /// conntrackd's files and its kernel listeners are in the kernel.
    async fn start_daemon(&mut self, i: usize) {
        let h = &self.hosts[i];
        let d = DaemonProc::spawn(
            &h.ns,
            &h.config,
            &self.bed.dir.join(format!("daemon-{}.log", h.name)),
            None,
        );
        let (kconf, cconf) = (&h.keepalived_conf, &h.conntrackd_conf);
        wait_for(
            Duration::from_secs(30),
            "the daemon writes keepalived's and conntrackd's files",
            || async {
                let k = std::fs::read_to_string(kconf).unwrap_or_default();
                (k.contains(&format!("{VIP6}/128 dev eth0"))
                    && k.contains("notify \"")
                    && cconf.exists())
                .then_some(())
            },
        )
        .await;
        wait_for(
            Duration::from_secs(30),
            "the IPv6 VIP's listeners are kernel ones and the gate is written",
            || async {
                // (refused until its admin socket is up)
                let (_, body) = d.get("/status").await.ok()?;
                let s: serde_json::Value = serde_json::from_str(&body).ok()?;
                let kernel = s["load_balancers"]
                    .as_array()?
                    .iter()
                    .find(|lb| lb["name"] == "default/db6")?["listeners"]
                    .as_array()
                    .is_some_and(|ls| ls.iter().all(|l| l["forwarding"] == "kernel"));
                let gate = s["conntrack_sync"]["instances"][0]["gate"] != "absent";
                (kernel && gate).then_some(())
            },
        )
        .await;
        // The gate holds the IPv6 VIP's flows back in the kernel, both
        // ways (it had no IPv6 map before).
        let ns = &h.ns;
        wait_for(
            Duration::from_secs(30),
            "the gate's IPv6 maps hold the VIP and the backends",
            || async {
                let to = ns.nft_out(&["list", "map", "inet", "harvester_lb_gate", "to6"])?;
                let from = ns.nft_out(&["list", "map", "inet", "harvester_lb_gate", "from6"])?;
                let jump = format!("jump g_{VRID}");
                (to.contains(&format!("{VIP6} . tcp . 80 : {jump}"))
                    && to.contains(&format!("{VIP6} . udp . {UDP_PORT} : {jump}"))
                    && from.contains(&format!("{} . tcp . {NODEPORT} : {jump}", backend(1)))
                    && from.contains(&format!("{} . udp . {UDP_NODEPORT} : {jump}", backend(2))))
                .then_some(())
            },
        )
        .await;
        // The proxy-only load balancers are not said to be moved to the
        // proxy (before: "served by the proxy (\"default/gw6\")").
        let log = d.log();
        assert!(
            !log.contains("are served by the proxy (\"default/gw6\""),
            "a proxy-only load balancer named among kernel listeners moved to the proxy:\n{log}"
        );
        self.hosts[i].daemon = Some(d);
    }

    async fn start_conntrackd(&mut self, i: usize) {
        let h = &self.hosts[i];
        let log = self.bed.dir.join(format!("conntrackd-out-{}.log", h.name));
        let c = Conntrackd::answering(&h.ns, &h.conntrackd_conf, &log).await;
        self.hosts[i].conntrackd = Some(c);
    }

    fn start_keepalived(&mut self, i: usize) {
        let h = &self.hosts[i];
        let k = Keepalived::run_fresh(&h.ns, &self.bed.dir, h.name, &h.keepalived_conf);
        self.hosts[i].keepalived = Some(k);
    }

    /// Waits until host `i` holds both IPv6 VIPs (the other host not,
    /// with `alone`) and its gate is open (its commit done).
    async fn master_is(&self, i: usize, alone: bool, within: Duration) -> Instant {
        let (me, other) = (&self.hosts[i], &self.hosts[1 - i]);
        let state = self.bed.dir.join(format!("state-{}", me.name)).join(VRID);
        let holds = |ns: &Ns| {
            holds_on(ns, "eth0", &VIP6.to_string()) && holds_on(ns, "eth1", &GW6.to_string())
        };
        wait_for(
            within,
            &format!("host {} holds the VIPs, its gate open", me.name),
            || async {
                let committed = std::fs::read_to_string(&state)
                    .is_ok_and(|s| s.contains("state=MASTER"))
                    && gate_open(&me.ns, VRID);
                (holds(&me.ns) && (!alone || !holds(&other.ns)) && committed).then(Instant::now)
            },
        )
        .await
    }

    /// Waits until the client and the backends send to the VIPs through
    /// host `i` (its unsolicited neighbour advertisements reached them).
    async fn traffic_through(&self, i: usize) {
        let h = &self.hosts[i];
        let (a, b) = (mac_of(&h.ns, "eth0"), mac_of(&h.ns, "eth1"));
        wait_for(
            Duration::from_secs(30),
            "the VIPs' neighbours point at the new master",
            || async {
                (neighbour_at(&self.bed.client, VIP6, &a)
                    && self.backends.iter().all(|n| neighbour_at(n, GW6, &b)))
                .then_some(())
            },
        )
        .await;
    }

    fn logs(&self) -> String {
        let mut s = String::new();
        for h in &self.hosts {
            if let Some(k) = &h.keepalived {
                s.push_str(&format!("--- keepalived {}\n{}\n", h.name, k.log()));
            }
            for f in ["conntrackd.log", "conntrackd.conf"] {
                let p = self.bed.dir.join(format!("{f}-{}", h.name));
                s.push_str(&format!(
                    "--- {f} {}\n{}\n",
                    h.name,
                    netns::read_to_string(&p)
                ));
            }
            let ct = std::process::Command::new("ip")
                .args(["netns", "exec", &h.ns.name, "conntrack", "-L", "-f", "ipv6"])
                .output()
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
                .unwrap_or_default();
            s.push_str(&format!("--- conntrack -L -f ipv6 on {}\n{ct}\n", h.name));
        }
        s
    }

    /// Makes host `i` fail as `fault` says.
    fn fail(&self, i: usize, fault: Fault) {
        let h = &self.hosts[i];
        match fault {
            Fault::Killed => {
                if let Some(d) = &h.daemon {
                    d.signal(libc::SIGKILL);
                }
                if let Some(k) = &h.keepalived {
                    k.kill_hard();
                }
            }
            Fault::LinkCut => {
                for p in &h.ports {
                    self.bed.set_port(p, false);
                }
            }
            Fault::GracefulStop => {
                if let Some(d) = &h.daemon {
                    d.signal(libc::SIGTERM);
                }
            }
        }
    }

    /// Brings host `i` back after `fault`.
    async fn restore(&mut self, i: usize, fault: Fault) {
        match fault {
            Fault::Killed => {
                self.hosts[i].daemon = None;
                self.hosts[i].keepalived = None;
                self.start_daemon(i).await;
                self.start_keepalived(i);
            }
            Fault::LinkCut => {
                for p in &self.hosts[i].ports {
                    self.bed.set_port(p, true);
                }
            }
            Fault::GracefulStop => {
                if let Some(mut d) = self.hosts[i].daemon.take() {
                    assert!(
                        d.wait_exit(Duration::from_secs(60)).await.is_some(),
                        "the daemon stops"
                    );
                }
                self.start_daemon(i).await;
            }
        }
    }
}

/// Whether [`FAR6`] (behind network A's router) is served through the
/// IPv6 VIP: a backend's name over TCP and over UDP, each within 3 s.
async fn far_served(router: &Ns) -> bool {
    let tcp = async {
        let s = router.socket_for(sa6(FAR6, 0))?;
        s.bind(sa6(FAR6, 0))?;
        let s = s.connect(sa6(VIP6, 80)).await?;
        let mut name = String::new();
        BufReader::new(s).read_line(&mut name).await?;
        Ok::<_, std::io::Error>(name.starts_with('n'))
    };
    let udp = async {
        let s = netns::bgp::udp_socket(router, sa6(FAR6, 0));
        s.connect(sa6(VIP6, UDP_PORT)).await?;
        s.send(b"far").await?;
        let mut buf = [0u8; 64];
        let n = s.recv(&mut buf).await?;
        Ok::<_, std::io::Error>(buf[..n].starts_with(b"n"))
    };
    let within = Duration::from_secs(3);
    matches!(tokio::time::timeout(within, tcp).await, Ok(Ok(true)))
        && matches!(tokio::time::timeout(within, udp).await, Ok(Ok(true)))
}

// One bed at a time (two daemons, keepalived and conntrackd each).
use crate::netns::HEAVY_BED as SERIAL;

/// Host a fails by `fault`, b takes over, a takes the VIPs back: every
/// connection alive on its backend, every UDP flow on its backend, no line
/// lost, at both moves.
async fn survives(tag: &str, fault: Fault) {
    let _one = SERIAL.lock().await;
    let mut vb = V6Bed::new(tag).await;
    vb.master_is(0, true, Duration::from_secs(60)).await;
    // Replies to a client behind the router leave by the network's table.
    let router = vb.router.clone();
    wait_for(
        Duration::from_secs(20),
        "the far client is served on A",
        || async { far_served(&router).await.then_some(()) },
    )
    .await;
    let traffic = Traffic::start(
        &vb.bed.client,
        &[Target {
            tcp: sa6(VIP6, 80),
            udp: sa6(VIP6, UDP_PORT),
            client: CLIENT6.into(),
            greeting: "n".into(),
        }],
    )
    .await;
    let t0 = traffic.now_ms();
    traffic.settled(t0, Duration::from_secs(10)).await;
    assert_eq!(
        traffic.figures(0).alive,
        CONNS,
        "before the fault\n{}",
        vb.logs()
    );
    // B's conntrackd holds A's flows (not asserted here: the move below
    // is what counts; a bounded wait, then the figure).
    let b = vb.hosts[1].conntrackd.as_ref().unwrap();
    let want = (CONNS + FLOWS) as u64;
    let deadline = Instant::now() + Duration::from_secs(15);
    while b.external_entries() < want && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let synced = b.external_entries();
    let mut report =
        format!("{fault:?}: B's external cache before the fault: {synced} of {want}\n");
    let since = traffic.new_phase();
    let at = Instant::now();
    vb.fail(0, fault);
    let moved = vb
        .master_is(1, fault != Fault::Killed, Duration::from_secs(60))
        .await;
    vb.traffic_through(1).await;
    traffic.settled(since, Duration::from_secs(30)).await;
    tokio::time::sleep(Duration::from_secs(2)).await;
    let over = traffic.figures(0);
    wait_for(
        Duration::from_secs(20),
        "the far client is served on B",
        || async { far_served(&router).await.then_some(()) },
    )
    .await;
    report.push_str(&format!(
        "{fault:?}: failover: VIP on B after {:.2} s; {over}\n",
        (moved - at).as_secs_f64()
    ));
    if fault == Fault::GracefulStop {
        // The old master's own entries of the IPv6 VIP's flows are stale
        // once B carries them (their TCP windows fall behind): its notify
        // script deletes them 15 s (PURGE_S) after leaving master.
        let a = &vb.hosts[0].ns;
        let mine = || {
            let out = std::process::Command::new("ip")
                .args(["netns", "exec", &a.name, "conntrack", "-L", "-f", "ipv6"])
                .args(["--orig-dst", &VIP6.to_string()])
                .output()
                .expect("conntrack");
            String::from_utf8_lossy(&out.stdout).lines().count()
        };
        let left = mine();
        let t = Instant::now();
        wait_for(
            Duration::from_secs(45),
            "A deletes its entries of the moved IPv6 flows",
            || async { (mine() == 0).then_some(()) },
        )
        .await;
        report.push_str(&format!(
            "{fault:?}: A's {left} entries of the VIP deleted {:.1} s after the move\n",
            t.elapsed().as_secs_f64() + (t - moved).as_secs_f64()
        ));
    }
    let mut back = None;
    if over.alive == CONNS && over.udp_moved == 0 {
        let since = traffic.new_phase();
        let at = Instant::now();
        vb.restore(0, fault).await;
        let moved = vb.master_is(0, true, Duration::from_secs(60)).await;
        vb.traffic_through(0).await;
        traffic.settled(since, Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let f = traffic.figures(0);
        report.push_str(&format!(
            "{fault:?}: failback: VIP on A after {:.2} s; {f}\n",
            (moved - at).as_secs_f64()
        ));
        back = Some(f);
    }
    let (lines, datagrams) = traffic.finish().await;
    report.push_str(&format!(
        "{fault:?}: lines lost {lines}, datagrams lost {datagrams}\n"
    ));
    for line in report.lines() {
        eprintln!("FIGURE ipv6 {line}");
    }
    let report = format!("{report}{}", vb.logs());
    assert_kept(&over, back.as_ref(), lines, &report);
}

macro_rules! require_tools {
    () => {
        require_netns!();
        if keepalived_missing() || conntrackd_missing() {
            return;
        }
    };
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_ipv6_kernel_flows_survive_the_master_killed_and_the_failback() {
    require_tools!();
    survives("v6kill", Fault::Killed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_ipv6_kernel_flows_survive_a_graceful_stop_and_the_failback() {
    require_tools!();
    survives("v6term", Fault::GracefulStop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_ipv6_kernel_flows_survive_the_link_cut_and_the_failback() {
    require_tools!();
    survives("v6cut", Fault::LinkCut).await;
}

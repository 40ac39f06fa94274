//! VIPs on two VM networks over three load-balancer hosts, with the real
//! daemon and the keepalived it configures, in network namespaces: a reload
//! that adds a load balancer brings its VIP up (no keepalived line written
//! by hand) and clients on the network and behind its gateway are served;
//! ten VIPs have masters on every host; the master failed three ways
//! (keepalived stopped, daemon killed, management link cut) gives the VIP
//! to another host, timed per fault with `advert_int` 1 s and 0.5 s (VRRP
//! version 3); no VRRP packet goes onto a VM network; a reload that removes
//! `[keepalived]` releases that host's VIPs.
//!
//! ```text
//!  mgmt (br1): hosts h1, h2, h3 10.77.0.1-3 (unicast VRRP)
//!  network A (br0, 198.51.100.0/24): client .2, backends n1 .21, n2 .22,
//!     gateway .1 (client 203.0.113.2 behind it), hosts' eth0 .4-.6
//!  network B (br2, 192.0.2.0/24): client .2, backends b1 .21, b2 .22
//!     (b2 a VM on h1's own bridge), hosts' eth1 .4-.6
//! ```
//!
//! Each host's `eth0` and `eth1` is a bridge with an uplink into the
//! network's switch, `br_netfilter` on (see `tests/it/netns/vmnet.rs`).
//!
//! The hosts' admin sockets are in a directory whose name has a space:
//! the rendered track scripts must quote the path, or keepalived never
//! sees a host ready and no VIP comes up.
//!
//! Run as root with iproute2, nftables, keepalived and curl:
//! `cargo test --test it -- vmnet_hosts:: --nocapture` (figures are printed as
//! `FIGURE`).

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::collections::BTreeSet;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use harvester_lb::host::vmnet::keepalived::instance_of;
use netns::keepalived::{Keepalived, keepalived_missing};
use netns::peers::{Exchange, Node, Service, exchange, read_line, serve_name_then_echo};
use netns::vmnet::{
    FAR_CLIENT, GATEWAY, add_v6, from_behind_the_gateway, holds_on, host, ip_out, join_bridged,
    mgmt_port, net_b, vm_on_host, vrrp_sent,
};
use netns::{Bed, DaemonProc, NODEPORT, Ns, config, node_ip, wait_for};
use support::{Lb, network};
use tokio::task::JoinHandle;

/// The hosts: name and management address (sorted: h1 is rank 0).
const HOSTS: [(&str, &str); 3] = [
    ("h1", "10.77.0.1"),
    ("h2", "10.77.0.2"),
    ("h3", "10.77.0.3"),
];

// The two tests run one after the other: each starts three daemons and
// three keepalived, and the failover figures mean little on a machine the
// other test keeps busy.
use crate::netns::HEAVY_BED as SERIAL;

/// A VIP and the network it is on.
#[derive(Clone, Copy, Debug)]
enum Vip {
    /// On network A (`eth0`), backends n1 and n2.
    A(Ipv4Addr),
    /// On network B (`eth1`), backends b1 and b2 (of the VIP's family).
    B(IpAddr),
}

impl Vip {
    fn addr(self) -> IpAddr {
        match self {
            Vip::A(v) => v.into(),
            Vip::B(v) => v,
        }
    }

    fn dev(self) -> &'static str {
        match self {
            Vip::A(_) => "eth0",
            Vip::B(_) => "eth1",
        }
    }
}

/// The first VIP of network A.
const A0: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 40);

/// VIP `i` of network A (198.51.100.40 + i).
fn a(i: u8) -> Vip {
    Vip::A(Ipv4Addr::new(198, 51, 100, 40 + i))
}

/// VIP `i` of network B (192.0.2.40 + i).
fn b(i: u8) -> Vip {
    Vip::B(net_b(40 + i).into())
}

/// IPv6 VIP `i` of network B (fd00:b::40 + i).
fn b6(i: u8) -> Vip {
    Vip::B(net_b6(0x40 + u16::from(i)).into())
}

/// Host `host` of network B's IPv6 subnet (fd00:b::/64).
fn net_b6(host: u16) -> Ipv6Addr {
    Ipv6Addr::new(0xfd00, 0xb, 0, 0, 0, 0, 0, host)
}

/// The host whose priority is highest (250) for `vip`'s instance: host
/// *r* of the sorted management addresses for the instances *i* with
/// *i* mod 3 = *r* (`vip::keepalived::priority`), here [`HOSTS`]' order.
fn preferred(vip: Vip) -> usize {
    usize::from(instance_of(vip.addr(), 3) % 3)
}

/// One load-balancer host of the bed.
struct Host {
    ns: Ns,
    name: &'static str,
    daemon: Option<DaemonProc>,
    keepalived: Option<Keepalived>,
}

/// The bed: three hosts, two networks, their clients and backends.
struct Three {
    // Dropped first: the processes, then the services, then the bed.
    hosts: Vec<Host>,
    _nodes: [Node; 2],
    _backends_b: Vec<JoinHandle<()>>,
    gw: Ns,
    client_b: Ns,
    /// Where the admin sockets are: a directory with a space in its name.
    sockets: PathBuf,
    bed: Bed,
}

impl Drop for Three {
    fn drop(&mut self) {
        if std::thread::panicking() {
            for h in &self.hosts {
                if let Some(d) = &h.daemon {
                    eprintln!("--- daemon {} ---\n{}", h.name, d.log_tail(30));
                }
                if let Some(k) = &h.keepalived {
                    let log = k.log();
                    let tail: Vec<&str> = log.lines().rev().take(30).collect();
                    eprintln!("--- keepalived {} ---\n{}", h.name, tail.join("\n"));
                }
            }
        }
    }
}

impl Three {
    fn new(test: &str) -> Three {
        let mut bed = Bed::new(test, 2);
        let nodes = [
            Node::start(&bed, 1, Service::NameThenEcho),
            Node::start(&bed, 2, Service::NameThenEcho),
        ];
        bed.add_bridge("br1");
        bed.add_bridge("br2");
        let (gw, _) = bed.add_host("gw", GATEWAY);
        gw.ip(&["addr", "add", &format!("{FAR_CLIENT}/32"), "dev", "lo"]);
        let (client_b, _) = bed.add_host_on("br2", "cb", net_b(2));
        add_v6(&client_b, "eth0", net_b6(2));
        let mut hosts = Vec::new();
        for (k, (name, mgmt)) in HOSTS.into_iter().enumerate() {
            let ns = host(
                &mut bed,
                name,
                Ipv4Addr::new(198, 51, 100, 4 + k as u8),
                mgmt,
            );
            join_bridged(
                &bed,
                &ns,
                "br2",
                &format!("vmb-{name}"),
                ("eth1", "up1"),
                &format!("{}/24", net_b(4 + k as u8)),
            );
            add_v6(&ns, "eth1", net_b6(4 + k as u16));
            hosts.push(Host {
                ns,
                name,
                daemon: None,
                keepalived: None,
            });
        }
        // Network B's backends: b1 behind the switch, b2 a VM on host
        // h1's own bridge (a guest cluster's node on a load-balancer
        // host): the other hosts reach it through h1's uplink.
        let mut backends_b = Vec::new();
        for i in 1..=2u8 {
            let ns = if i == 1 {
                bed.add_host_on("br2", "b1", net_b(21)).0
            } else {
                vm_on_host(&mut bed, &hosts[0].ns, "eth1", "b2", net_b(22))
            };
            add_v6(&ns, "eth0", net_b6(0x20 + u16::from(i)));
            for addr in [
                IpAddr::from(net_b(20 + i)),
                net_b6(0x20 + u16::from(i)).into(),
            ] {
                backends_b.push(serve_name_then_echo(
                    &ns,
                    SocketAddr::new(addr, NODEPORT),
                    &format!("b{i}"),
                ));
            }
        }
        let sockets = bed.dir.join("admin sockets");
        std::fs::create_dir_all(&sockets).expect("socket directory");
        Three {
            hosts,
            _nodes: nodes,
            _backends_b: backends_b,
            gw,
            client_b,
            sockets,
            bed,
        }
    }

    fn keepalived_conf(&self, h: usize) -> PathBuf {
        self.bed
            .dir
            .join(format!("keepalived-{}.conf", self.hosts[h].name))
    }

    fn keepalived_pid(&self, h: usize) -> PathBuf {
        self.bed
            .dir
            .join(format!("keepalived-{}.pid", self.hosts[h].name))
    }

    /// Host `h`'s config: `vips`, on their networks with `[keepalived]`
    /// (adverts every `advert_ms`), or as plain VIPs without it.
    fn config(&self, h: usize, vips: &[Vip], advert_ms: u32, keepalived: bool) -> String {
        let (name, address) = HOSTS[h];
        let peers: Vec<&str> = HOSTS
            .iter()
            .filter(|(n, _)| *n != name)
            .map(|(_, a)| *a)
            .collect();
        let mut c = config().socket(&self.sockets.join(format!("{name}.sock")));
        if keepalived {
            let networks = network("default/a", "eth0", GATEWAY, "")
                + &network(
                    "default/b",
                    "eth1",
                    net_b(1),
                    &format!("ipv6_gateway = \"{}\"\n", net_b6(1)),
                );
            c = c.text(
                &(support::keepalived(
                    name,
                    address,
                    peers,
                    &self.bed.dir.join(format!("keepalived-{name}")),
                    &format!("advert_interval_ms = {advert_ms}\n"),
                ) + &networks),
            );
        }
        for (i, vip) in vips.iter().enumerate() {
            let (net, backends): (_, [IpAddr; 2]) = match vip {
                Vip::A(_) => ("default/a", [node_ip(1).into(), node_ip(2).into()]),
                Vip::B(IpAddr::V4(_)) => ("default/b", [net_b(21).into(), net_b(22).into()]),
                Vip::B(IpAddr::V6(_)) => ("default/b", [net_b6(0x21).into(), net_b6(0x22).into()]),
            };
            let mut l = Lb::new(&format!("default/lb{i}"), vip.addr())
                .backends(backends)
                .tcp("tcp", 80, NODEPORT);
            if keepalived {
                l = l.keys(&format!("network = \"{net}\""));
            }
            c = c.lb(l);
        }
        c.to_string()
    }

    fn write_config(&self, h: usize, vips: &[Vip], advert_ms: u32, keepalived: bool) -> PathBuf {
        self.bed.write(
            &format!("config-{}.toml", self.hosts[h].name),
            &self.config(h, vips, advert_ms, keepalived),
        )
    }

    /// Starts host `h`'s daemon on `vips` and waits until it has written
    /// keepalived's file.
    async fn start_daemon(&mut self, h: usize, vips: &[Vip], advert_ms: u32) {
        let path = self.write_config(h, vips, advert_ms, true);
        let name = self.hosts[h].name;
        let log = self.bed.dir.join(format!("daemon-{name}.log"));
        self.hosts[h].daemon = Some(DaemonProc::spawn(&self.hosts[h].ns, &path, &log, None));
        let conf = self.keepalived_conf(h);
        let first = vips[0].addr();
        wait_for(
            Duration::from_secs(30),
            "the daemon writes keepalived's file",
            || async {
                let text = std::fs::read_to_string(&conf).unwrap_or_default();
                text.contains(&format!("{first}/")).then_some(())
            },
        )
        .await;
    }

    /// Starts host `h`'s keepalived on the file its daemon wrote.
    fn start_keepalived(&mut self, h: usize) {
        let k = Keepalived::run(
            &self.hosts[h].ns,
            &self.bed.dir,
            self.hosts[h].name,
            &self.keepalived_conf(h),
            Some(&self.keepalived_pid(h)),
        );
        self.hosts[h].keepalived = Some(k);
    }

    /// Every host: the daemon on `vips`, then keepalived.
    async fn start(&mut self, vips: &[Vip], advert_ms: u32) {
        for h in 0..self.hosts.len() {
            self.start_daemon(h, vips, advert_ms).await;
            self.start_keepalived(h);
        }
    }

    /// Reloads every daemon on `vips` (SIGHUP, as the controller does).
    fn reload_all(&self, vips: &[Vip], advert_ms: u32) {
        for h in 0..self.hosts.len() {
            self.write_config(h, vips, advert_ms, true);
            self.daemon(h).signal(libc::SIGHUP);
        }
    }

    fn daemon(&self, h: usize) -> &DaemonProc {
        self.hosts[h].daemon.as_ref().expect("daemon running")
    }

    /// The hosts holding `vip` now.
    fn holders(&self, vip: Vip) -> Vec<usize> {
        (0..self.hosts.len())
            .filter(|h| holds_on(&self.hosts[*h].ns, vip.dev(), &vip.addr().to_string()))
            .collect()
    }

    /// The client on `vip`'s network.
    fn client(&self, vip: Vip) -> &Ns {
        match vip {
            Vip::A(_) => &self.bed.client,
            Vip::B(_) => &self.client_b,
        }
    }

    /// Whether the client on `vip`'s network is served through it (a
    /// backend of that network answers and echoes).
    async fn served(&self, vip: Vip, within: Duration) -> bool {
        let backend = match vip {
            Vip::A(_) => "n",
            Vip::B(_) => "b",
        };
        matches!(
            exchange(self.client(vip), SocketAddr::new(vip.addr(), 80), 64, within).await,
            Exchange::Ok(name) if name.starts_with(backend)
        )
    }

    /// Waits until exactly one host holds each of `vips` and each is served
    /// to its network's client; returns the holder of each.
    async fn settled(&self, vips: &[Vip], within: Duration) -> Vec<usize> {
        let holders = wait_for(within, "each VIP on exactly one host", || async {
            let h: Vec<Vec<usize>> = vips.iter().map(|v| self.holders(*v)).collect();
            h.iter()
                .all(|x| x.len() == 1)
                .then(|| h.iter().map(|x| x[0]).collect::<Vec<usize>>())
        })
        .await;
        for vip in vips {
            wait_for(within, "the VIP serves its network's client", || async {
                self.served(*vip, Duration::from_secs(2))
                    .await
                    .then_some(())
            })
            .await;
        }
        holders
    }

    /// Waits until each of `vips` is held by the preferred master of its
    /// instance alone (keepalived preempts: a higher priority takes the
    /// instance back within a few adverts), the steady state.
    async fn on_preferred_masters(&self, vips: &[Vip], within: Duration) {
        wait_for(within, "each VIP on its preferred master", || async {
            vips.iter()
                .all(|v| self.holders(*v) == [preferred(*v)])
                .then_some(())
        })
        .await;
    }

    /// Asserts that every host sent VRRP on the management segment and
    /// none on a VM network.
    fn assert_vrrp_only_on_mgmt(&self) {
        for h in &self.hosts {
            assert!(vrrp_sent(&h.ns, "mgmt") > 0, "{}: no VRRP on mgmt", h.name);
            assert_eq!(
                vrrp_sent(&h.ns, "vm"),
                0,
                "{}: VRRP sent onto a VM network",
                h.name
            );
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_three_hosts_bring_up_a_reloaded_vip_spread_ten_and_release_on_removal() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut t = Three::new("vmnet3");
    // One load balancer on network B to begin with.
    t.start(&[b(0)], 1000).await;
    t.settled(&[b(0)], Duration::from_secs(40)).await;

    // A reload that adds a load balancer on network A: its VIP comes up
    // there, served to the client on A and to the one behind A's gateway
    // (its reply goes back through the network's table: the hosts have no
    // default route), with no keepalived line written by hand.
    let at = Instant::now();
    t.reload_all(&[b(0), a(0)], 1000);
    let holder = t.settled(&[a(0)], Duration::from_secs(30)).await;
    let up = at.elapsed();
    wait_for(
        Duration::from_secs(20),
        "the new VIP serves the client behind network A's gateway",
        || async { from_behind_the_gateway(&t.gw, A0).await.then_some(()) },
    )
    .await;
    eprintln!(
        "FIGURE vmnet3 reload adds a load balancer on network A: VIP up on host {} and served after {:.2} s",
        HOSTS[holder[0]].0,
        up.as_secs_f64()
    );
    assert!(
        up < Duration::from_secs(20),
        "the VIP came up only after {up:?}"
    );

    // Ten VIPs over both networks: chosen so that they fall in all three
    // instances (by the daemon's own hash), so every host is the preferred
    // master of some; all three hold some once keepalived settles.
    let ten: Vec<Vip> = (0..6).map(a).chain((0..4).map(b)).collect();
    let instances: BTreeSet<u8> = ten.iter().map(|v| instance_of(v.addr(), 3)).collect();
    assert_eq!(instances.len(), 3, "the test's VIPs cover every instance");
    t.reload_all(&ten, 1000);
    t.settled(&ten, Duration::from_secs(40)).await;
    t.on_preferred_masters(&ten, Duration::from_secs(40)).await;
    let holders: Vec<usize> = ten.iter().map(|v| preferred(*v)).collect();
    let masters: BTreeSet<usize> = holders.iter().copied().collect();
    eprintln!(
        "FIGURE vmnet3 ten VIPs: held by hosts {:?}",
        holders.iter().map(|h| HOSTS[*h].0).collect::<Vec<_>>()
    );
    assert_eq!(
        masters.len(),
        3,
        "every host is master of some VIP: {holders:?}"
    );
    t.assert_vrrp_only_on_mgmt();

    // IPv6 on network B: a reload adds an IPv6 VIP there; keepalived
    // moves it with its instance (IPv4 adverts carry it as an excluded
    // address), the client on B is served over IPv6, and every host has
    // the IPv6 rule and routes for its replies.
    let eleven: Vec<Vip> = ten.iter().copied().chain([b6(0)]).collect();
    t.reload_all(&eleven, 1000);
    let holder = t.settled(&[b6(0)], Duration::from_secs(40)).await;
    eprintln!(
        "FIGURE vmnet3 IPv6 VIP {} held by host {} and served",
        b6(0).addr(),
        HOSTS[holder[0]].0
    );
    // Each daemon writes its rule and routes soon after its reload (the
    // master's before the VIP could be served, the others' a moment later).
    for h in &t.hosts {
        wait_for(
            Duration::from_secs(20),
            &format!("{}: the IPv6 VIP's rule and routes", h.name),
            || async {
                let rules = ip_out(&h.ns, &["-6", "rule", "show"]);
                let routes = ip_out(&h.ns, &["-6", "route", "show", "table", "1001"]);
                (rules.contains(&format!("from {} lookup 1001", b6(0).addr()))
                    && routes.contains("default via fd00:b::1 dev eth1")
                    && routes.contains("fd00:b::/64 dev eth1"))
                .then_some(())
            },
        )
        .await;
    }
    let ten = eleven;

    // Host h3 drops [keepalived] (its load balancers stay, as plain VIPs
    // its daemon still serves): its file is released, its keepalived gives
    // up every VIP, and hosts h1 and h2 take them over.
    let c = 2;
    t.write_config(c, &ten, 1000, false);
    t.daemon(c).signal(libc::SIGHUP);
    let conf = t.keepalived_conf(c);
    wait_for(
        Duration::from_secs(30),
        "host h3's keepalived file released",
        || async {
            let text = std::fs::read_to_string(&conf).unwrap_or_default();
            (text.contains("[keepalived] was removed") && !text.contains("vrrp_instance"))
                .then_some(())
        },
    )
    .await;
    // The file is written before keepalived has reloaded it: until then h3
    // still holds its VIPs alone, which `settled` would take for the end.
    // Wait for h3 to hold none first (the assertion below stays).
    wait_for(
        Duration::from_secs(40),
        "host h3's keepalived gives up every VIP",
        || async {
            ten.iter()
                .all(|v| !t.holders(*v).contains(&c))
                .then_some(())
        },
    )
    .await;
    let holders = t.settled(&ten, Duration::from_secs(40)).await;
    assert!(
        !holders.contains(&c),
        "host h3 still holds VIPs after [keepalived] was removed: {holders:?}"
    );
    t.assert_vrrp_only_on_mgmt();
}

/// How a master is failed.
#[derive(Clone, Copy, Debug)]
enum Fault {
    /// keepalived stopped (`SIGTERM`: it sends a priority-0 advert).
    KeepalivedStopped,
    /// The daemon killed (`SIGKILL`): the track script fails `fall` times.
    DaemonKilled,
    /// The host's management link cut (its bridge port down).
    LinkCut,
}

/// What [`patient_client`] saw of a failover.
struct Patient {
    /// The longest a new connection was waited for: from the fault, an
    /// answered connection or a lost one to the next answered one.
    longest: Duration,
    /// Answered connections whose connect took longer than 0.5 s (a SYN
    /// sent again).
    slow: usize,
    /// Connections made that never brought the backend's name (made with
    /// the old master as the VIP left it).
    lost: usize,
}

/// A client that opens one connection after another to `addr` and reads
/// the backend's name, each connect given 5 s, so that a lost SYN is sent
/// again by the kernel (1 s, then 2 s later) as an ordinary client's would
/// be, from the fault until its first answered connection after `stop`
/// (or 15 s after it). The failover's own figures ask anew every 0.7 s
/// instead, and so never wait for a SYN sent again.
async fn patient_client(ns: Ns, addr: SocketAddr, stop: Arc<AtomicBool>) -> Patient {
    let mut seen = Patient {
        longest: Duration::ZERO,
        slow: 0,
        lost: 0,
    };
    let mut waiting_since = Instant::now();
    let mut stopped_at = None;
    loop {
        let stopping = stop.load(Ordering::Relaxed);
        if stopping
            && stopped_at.get_or_insert_with(Instant::now).elapsed() > Duration::from_secs(15)
        {
            break;
        }
        let began = Instant::now();
        let Ok(mut s) = ns.connect(addr, Duration::from_secs(5)).await else {
            // Refused or reset returns at once: pace the retries.
            tokio::time::sleep(Duration::from_millis(20)).await;
            continue;
        };
        let connected = Instant::now();
        let name = tokio::time::timeout(Duration::from_secs(2), read_line(&mut s)).await;
        let now = Instant::now();
        if matches!(name, Ok(Ok(ref n)) if !n.is_empty()) {
            seen.longest = seen.longest.max(now - waiting_since);
            waiting_since = now;
            seen.slow += usize::from(connected - began > Duration::from_millis(500));
            if stopping {
                break;
            }
        } else {
            // Made with the old master, lost with the VIP: the client asks
            // anew from now on.
            seen.lost += 1;
            waiting_since = now;
        }
    }
    seen
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_the_master_failed_three_ways_hands_the_vip_to_another_host() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let _serial = SERIAL.lock().await;
    let mut t = Three::new("vmfail");
    let vip = a(0);
    let vips = [vip, b(0)];
    t.start(&vips, 1000).await;
    let mut report = Vec::new();
    for advert_ms in [1000, 500] {
        t.reload_all(&vips, advert_ms);
        let advert = format!("advert_int {}", if advert_ms == 1000 { "1" } else { "0.5" });
        for h in 0..3 {
            let conf = t.keepalived_conf(h);
            wait_for(
                Duration::from_secs(30),
                "the new advert_int written",
                || async {
                    std::fs::read_to_string(&conf)
                        .unwrap_or_default()
                        .contains(&advert)
                        .then_some(())
                },
            )
            .await;
        }
        for fault in [
            Fault::KeepalivedStopped,
            Fault::DaemonKilled,
            Fault::LinkCut,
        ] {
            // From the steady state: the VIP on its preferred master.
            t.on_preferred_masters(&[vip], Duration::from_secs(60))
                .await;
            let master = t.settled(&[vip], Duration::from_secs(60)).await[0];
            let name = HOSTS[master].0;
            // A client as an operator's probe is: one connection after
            // another, each left to the kernel's own SYN retransmits.
            let stop = Arc::new(AtomicBool::new(false));
            let patient = tokio::spawn(patient_client(
                t.client(vip).clone(),
                SocketAddr::new(vip.addr(), 80),
                stop.clone(),
            ));
            let at = Instant::now();
            match fault {
                Fault::KeepalivedStopped => t.hosts[master]
                    .keepalived
                    .as_ref()
                    .expect("keepalived running")
                    .signal(libc::SIGTERM),
                Fault::DaemonKilled => t.daemon(master).signal(libc::SIGKILL),
                Fault::LinkCut => t.bed.set_port(&mgmt_port(name), false),
            }
            let moved = wait_for(
                Duration::from_secs(30),
                "the VIP on another host",
                || async {
                    t.holders(vip)
                        .iter()
                        .any(|h| *h != master)
                        .then(|| at.elapsed())
                },
            )
            .await;
            let served = wait_for(Duration::from_secs(30), "the VIP served again", || async {
                t.served(vip, Duration::from_millis(700))
                    .await
                    .then(|| at.elapsed())
            })
            .await;
            let still = t.holders(vip).contains(&master);
            stop.store(true, Ordering::Relaxed);
            let p = patient.await.expect("the patient client");
            let line = format!(
                "{advert}, {fault:?} on host {name}: VIP on another host after {:.2} s, served after {:.2} s; a patient client waited at most {:.2} s for a new connection ({} answered after a SYN sent again, {} lost with the old master){}",
                moved.as_secs_f64(),
                served.as_secs_f64(),
                p.longest.as_secs_f64(),
                p.slow,
                p.lost,
                if still {
                    " (the failed host still holds it too)"
                } else {
                    ""
                }
            );
            eprintln!("FIGURE vmnet failover: {line}");
            assert!(
                served < Duration::from_secs(25),
                "{line}: far slower than VRRP's arithmetic"
            );
            report.push(line);
            // Repair; the preferred master takes the VIP back (keepalived
            // preempts) before the next fault (waited for above).
            match fault {
                Fault::KeepalivedStopped => {
                    // Reaped (it has stopped by now), then started again.
                    drop(t.hosts[master].keepalived.take());
                    t.start_keepalived(master);
                }
                Fault::DaemonKilled => {
                    let d = t.hosts[master].daemon.take().expect("daemon");
                    let config = d.config.clone();
                    drop(d);
                    let log = t.bed.dir.join(format!("daemon-{name}-again.log"));
                    t.hosts[master].daemon =
                        Some(DaemonProc::spawn(&t.hosts[master].ns, &config, &log, None));
                }
                Fault::LinkCut => t.bed.set_port(&mgmt_port(name), true),
            }
        }
    }
    t.assert_vrrp_only_on_mgmt();
    eprintln!("FIGURE vmnet failover summary:\n{}", report.join("\n"));
}

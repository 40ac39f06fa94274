//! Open connections through kernel listeners across VIP moves among three
//! hosts (and two, for the figures), with the keepalived and conntrackd
//! configuration the daemon renders: `instances` = the number of hosts,
//! so each host is master of one VIP, and conntrackd's sync over
//! multicast (the default with more than one keepalived peer; unicast, the
//! default with one, for two hosts) on the management network.
//!
//! ```text
//!  mgmt (br1): hosts h1, h2, h3 10.77.0.1-3 (VRRP, conntrackd's sync)
//!  network A (br0, 198.51.100.0/24): client .2, the hosts' eth0 .4-.6,
//!     VIP k (one per instance k, kernel TCP :80 and UDP :5353 listeners)
//!  network B (br2, 192.0.2.0/24): the hosts' eth1 .4-.6; backends
//!     v<k>1, v<k>2 of VIP k, routing the client's network through the
//!     gateway VIP k of network B (a second load balancer in instance k)
//! ```
//!
//! Each host is built like a Harvester host (`tests/it/netns/vmnet.rs`): its
//! `eth0` and `eth1` are Linux bridges with an uplink veth into the
//! network's switch, `br_netfilter` on. The backends are on another,
//! routed network (B): a kernel listener whose backends are in the VIP's
//! own subnet is served by the proxy on such a host (docs/vip.md, "On a
//! bridged host"), and this test is about the kernel's flows. The
//! listeners have `source_nat = "none"`, so the backends' replies must go
//! back through the VIP's master: each VIP's backends route the client's
//! network through a gateway VIP on network B that keepalived moves with
//! it (a load balancer on network B in the same instance). Left out: the
//! bridges' VLAN filtering and the bond (this kernel builds neither), a
//! dedicated sync link (the sync shares the management network), and
//! real switches' IGMP snooping (the bed's bridges snoop, with no querier).
//!
//! Traffic: per VIP, 20 TCP connections echoing a line every 100 ms and 4
//! UDP flows from fixed client ports, a datagram every 100 ms. Each host in
//! turn, master of its VIP, fails one way (daemon and keepalived killed;
//! the daemon stopped gracefully; its links cut), another host takes the
//! VIP over, then the host comes back and takes it back (the failback).
//! Counted each time: the time until another host holds the VIP with its
//! flows committed, TCP connections alive (of every VIP), the longest gap
//! a connection of the moved VIP saw, UDP flows whose backend changed;
//! over the run, lines sent and never echoed. Printed as `FIGURE` lines.
//! Asserted: no line lost over the run, and every connection open and
//! flow on its backend after every phase with two hosts, after the first
//! failover with three (the later phases reported: connections lost
//! there are issue 42's open defect, docs/vip.md "Three and more hosts").
//!
//! Run as root with iproute2, nftables, keepalived, conntrackd, conntrack:
//! `cargo test --test it -- conntrack_hosts:: --nocapture --test-threads 1`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::time::{Duration, Instant};

use harvester_lb::host::vmnet::keepalived::instance_of;
use netns::keepalived::{
    Conntrackd, Fault, Keepalived, conntrackd_missing, gate_open, keepalived_missing,
};
use netns::peers::serve_name_then_echo;
use netns::traffic::{CONNS, FLOWS, Target, Traffic};
use netns::vmnet::{
    holds_on, ip_out, join_bridged, mac_of, mgmt_host, mgmt_port, sysctl, udp_name_server,
};
use netns::{Bed, DaemonProc, NODEPORT, Ns, config, sa, wait_for};
use support::{Lb, Listener, conntrackd, keepalived, network};

/// The client's address (the bed's, on network A).
const CLIENT: Ipv4Addr = netns::CLIENT_IP;
/// The UDP listener's port and the backends' UDP port.
const UDP_PORT: u16 = 5353;
const UDP_NODEPORT: u16 = 30053;
/// The gateway load balancers' (proxy) listener port.
const GW_PORT: u16 = 9000;
/// The first VRID (keepalived.vrid_base's default): instance k is 50 + k.
const VRID_BASE: usize = 50;
/// The hosts' names, in the order of their management addresses.
const NAMES: [&str; 3] = ["h1", "h2", "h3"];

fn mgmt(i: usize) -> String {
    format!("10.77.0.{}", i + 1)
}

fn net_a(host: u8) -> Ipv4Addr {
    Ipv4Addr::new(198, 51, 100, host)
}

fn net_b(host: u8) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, host)
}

/// Backend `j` (1, 2) of VIP `k`.
fn backend(k: usize, j: usize) -> Ipv4Addr {
    net_b((20 + 10 * k + j) as u8)
}

/// One address per instance of `n`, from `first` up in `net`: the one
/// whose hash places it in instance k, so host k is its master.
fn per_instance(n: usize, first: u8, net: fn(u8) -> Ipv4Addr) -> Vec<Ipv4Addr> {
    (0..n)
        .map(|k| {
            (first..250)
                .map(net)
                .find(|ip| usize::from(instance_of((*ip).into(), n as u8)) == k)
                .expect("an address for each instance")
        })
        .collect()
}

/// One load-balancer host.
struct Host {
    ns: Ns,
    name: &'static str,
    /// Its bridge ports: network A's, network B's, management's.
    ports: [String; 3],
    config: PathBuf,
    keepalived_conf: PathBuf,
    conntrackd_conf: PathBuf,
    daemon: Option<DaemonProc>,
    keepalived: Option<Keepalived>,
    conntrackd: Option<Conntrackd>,
}

/// The bed: `n` hosts, `n` VIPs on network A (VIP k mastered by host k),
/// their gateway VIPs on network B, two backends each.
struct Cluster {
    bed: Bed,
    hosts: Vec<Host>,
    vips: Vec<Ipv4Addr>,
    gateways: Vec<Ipv4Addr>,
    /// Each VIP's backends' namespaces.
    backends: Vec<Vec<Ns>>,
    services: Vec<tokio::task::JoinHandle<()>>,
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for s in &self.services {
            s.abort();
        }
    }
}

/// The daemon's file of host `i` of `n`.
fn host_config(
    dir: &std::path::Path,
    n: usize,
    i: usize,
    vips: &[Ipv4Addr],
    gws: &[Ipv4Addr],
) -> String {
    let name = NAMES[i];
    let peers: Vec<String> = (0..n).filter(|p| *p != i).map(mgmt).collect();
    let mut text = keepalived(
        name,
        mgmt(i),
        peers,
        &dir.join(format!("keepalived-{name}")),
        &format!("instances = {n}\nadvert_interval_ms = 500\n"),
    ) + &network("default/vm", "eth0", net_a(1), "")
        + &network("default/back", "eth1", net_b(1), "");
    // No transport, peer or group written: multicast with two peers,
    // unicast with one (the defaults under test).
    text.push_str(&conntrackd(dir, name, ""));
    let mut c = config()
        .socket(&dir.join(format!("admin-{name}.sock")))
        .text(&text);
    for k in 0..n {
        let backends = [backend(k, 1), backend(k, 2)];
        c = c
            .lb(Lb::new(&format!("default/vip{k}"), vips[k])
                .backends(backends)
                .keys("network = \"default/vm\"")
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
                ))
            // The backends' gateway back to the client's network: moves
            // with VIP k (the same instance), so replies reach its master.
            .lb(Lb::new(&format!("default/gw{k}"), gws[k])
                .backends(backends)
                .keys("network = \"default/back\"")
                .listener(Listener::new("gw", GW_PORT, NODEPORT)));
    }
    c.to_string()
}

impl Cluster {
    async fn new(tag: &str, n: usize) -> Cluster {
        let mut bed = Bed::new(tag, 1);
        bed.add_bridge("br1");
        bed.add_bridge("br2");
        let vips = per_instance(n, 40, net_a);
        let gateways = per_instance(n, 100, net_b);
        let mut hosts = Vec::new();
        for (i, name) in NAMES.iter().take(n).enumerate() {
            let (ns, port_a) = mgmt_host(&mut bed, name, net_a(4 + i as u8), &mgmt(i));
            let port_b = format!("k{name}");
            join_bridged(
                &bed,
                &ns,
                "br2",
                &port_b,
                ("eth1", "up1"),
                &format!("{}/24", net_b(4 + i as u8)),
            );
            sysctl(&ns, "net.ipv4.ip_forward=1");
            for dev in ["all", "default", "eth0", "eth1"] {
                sysctl(&ns, &format!("net.ipv4.conf.{dev}.send_redirects=0"));
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
        let mut backends = Vec::new();
        let mut services = Vec::new();
        for (k, gateway) in gateways.iter().enumerate() {
            let mut mine = Vec::new();
            for j in 1..=2 {
                let ip = backend(k, j);
                let name = format!("v{k}{j}");
                let ns = netns::vmnet::backend_via(&mut bed, "br2", &name, ip, *gateway);
                services.push(serve_name_then_echo(&ns, sa(ip, NODEPORT), &name));
                services.push(udp_name_server(&ns, sa(ip, UDP_NODEPORT), &name));
                mine.push(ns);
            }
            backends.push(mine);
        }
        for (i, h) in hosts.iter().enumerate() {
            std::fs::write(&h.config, host_config(&bed.dir, n, i, &vips, &gateways)).unwrap();
        }
        let mut c = Cluster {
            bed,
            hosts,
            vips,
            gateways,
            backends,
            services,
        };
        for i in 0..n {
            c.start_daemon(i).await;
            c.start_conntrackd(i).await;
            c.start_keepalived(i);
        }
        c
    }

    fn n(&self) -> usize {
        self.hosts.len()
    }

    /// Starts host `i`'s daemon and waits until it wrote keepalived's and
    /// conntrackd's files, is ready for every VIP, and wrote its kernel
    /// listeners and gates.
    async fn start_daemon(&mut self, i: usize) {
        let h = &self.hosts[i];
        let d = DaemonProc::spawn(
            &h.ns,
            &h.config,
            &self.bed.dir.join(format!("daemon-{}.log", h.name)),
            None,
        );
        let (kconf, cconf, vips) = (&h.keepalived_conf, &h.conntrackd_conf, &self.vips);
        wait_for(
            Duration::from_secs(60),
            "the daemon writes keepalived's and conntrackd's files",
            || async {
                let k = std::fs::read_to_string(kconf).unwrap_or_default();
                (vips.iter().all(|v| k.contains(&format!("{v}/32 dev eth0")))
                    && cconf.exists()
                    && k.contains("notify \""))
                .then_some(())
            },
        )
        .await;
        for v in vips {
            wait_for(
                Duration::from_secs(60),
                "the daemon is ready for the VIP",
                || async {
                    matches!(d.get(&format!("/readyz?vip={v}")).await, Ok((200, _))).then_some(())
                },
            )
            .await;
        }
        let n = self.n();
        wait_for(
            Duration::from_secs(60),
            "the kernel listeners and the gates are written",
            || async {
                let s = d.status().await;
                let kernel = s["load_balancers"].as_array().is_some_and(|lbs| {
                    lbs.iter()
                        .filter(|lb| lb["name"].as_str().is_some_and(|n| n.contains("vip")))
                        .all(|lb| {
                            lb["listeners"]
                                .as_array()
                                .is_some_and(|ls| ls.iter().all(|l| l["forwarding"] == "kernel"))
                        })
                });
                let gates = s["conntrack_sync"]["instances"]
                    .as_array()
                    .is_some_and(|is| is.len() == n && is.iter().all(|i| i["gate"] != "absent"));
                (kernel && gates).then_some(())
            },
        )
        .await;
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

    /// Whether host `i` is master of instance `k` with its flows
    /// committed: it holds VIP k and its gateway VIP, the notify script
    /// recorded MASTER and opened the gate; with `alone`, no other host
    /// holds VIP k.
    fn is_master(&self, i: usize, k: usize, alone: bool) -> bool {
        let h = &self.hosts[i];
        let vrid = VRID_BASE + k;
        let state = self
            .bed
            .dir
            .join(format!("state-{}", h.name))
            .join(vrid.to_string());
        let vip = self.vips[k].to_string();
        holds_on(&h.ns, "eth0", &vip)
            && holds_on(&h.ns, "eth1", &self.gateways[k].to_string())
            && (!alone
                || self
                    .hosts
                    .iter()
                    .enumerate()
                    .all(|(j, o)| j == i || !holds_on(&o.ns, "eth0", &vip)))
            && std::fs::read_to_string(state).is_ok_and(|s| s.contains("state=MASTER"))
            && gate_open(&h.ns, vrid)
    }

    /// Waits until host `i` alone is master of instance `k`; when seen.
    async fn await_master(&self, i: usize, k: usize) -> Instant {
        wait_for(
            Duration::from_secs(60),
            &format!("{} is master of instance {k}", NAMES[i]),
            || async { self.is_master(i, k, true).then(Instant::now) },
        )
        .await
    }

    /// Waits until a host other than `except` (if any) is master of
    /// instance `k`: which one, and when it was seen.
    async fn master_of(&self, k: usize, except: Option<usize>, alone: bool) -> (usize, Instant) {
        wait_for(
            Duration::from_secs(60),
            &format!("a host is master of instance {k} (except {except:?})"),
            || async {
                (0..self.n())
                    .filter(|i| Some(*i) != except)
                    .find(|i| self.is_master(*i, k, alone))
                    .map(|i| (i, Instant::now()))
            },
        )
        .await
    }

    /// Waits until the client sends to VIP `k` and its backends to the
    /// gateway VIP `k` through host `i` (the gratuitous ARPs reached them).
    async fn traffic_through(&self, i: usize, k: usize) {
        let (eth0, eth1) = (
            mac_of(&self.hosts[i].ns, "eth0"),
            mac_of(&self.hosts[i].ns, "eth1"),
        );
        let (vip, gw) = (self.vips[k].to_string(), self.gateways[k].to_string());
        // 75 s: past one `garp_master_refresh` (60 s). Once, at load 18 with
        // two test lanes, 30 s ran out: a host that was master for a moment
        // may send its ARPs after the new master's (unverified); the next
        // refresh corrects them, and what the connections lost meanwhile is
        // what the test then asserts.
        wait_for(
            Duration::from_secs(75),
            "the VIP's neighbours point at the new master",
            || async {
                (ip_out(&self.bed.client, &["neigh", "show", &vip]).contains(&eth0)
                    && self.backends[k]
                        .iter()
                        .all(|b| ip_out(b, &["neigh", "show", &gw]).contains(&eth1)))
                .then_some(())
            },
        )
        .await;
    }

    /// Each host's conntrackd external cache entries of each VIP (every
    /// entry whose original destination is the VIP), as it answers now.
    fn cache_counts(&self) -> Vec<Vec<usize>> {
        let vips: Vec<std::net::IpAddr> = self.vips.iter().map(|v| (*v).into()).collect();
        netns::keepalived::external_per_vip(self.hosts.iter().map(|h| h.conntrackd.as_ref()), &vips)
    }

    /// Waits (up to `within`) until every host's external cache holds,
    /// of each other host's VIP, at least the traffic's flows (counted per
    /// VIP: a host's cache also holds copies of its own flows, which a
    /// commit elsewhere sent, so a total would hide one VIP's shortfall);
    /// whether it did. Every VIP is home (host k carries VIP k) here.
    async fn caches_full(&self, within: Duration) -> bool {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let counts = self.cache_counts();
            if counts.iter().enumerate().all(|(h, per_vip)| {
                per_vip
                    .iter()
                    .enumerate()
                    .all(|(k, n)| k == h || *n >= CONNS + FLOWS)
            }) {
                return true;
            }
            tokio::time::sleep(Duration::from_millis(250)).await;
        }
        false
    }

    /// What host `h` holds of VIP `k`'s flows, for a fault that lost them:
    /// its kernel's entries (`conntrack -L`), its conntrackd's external
    /// and internal cache entries, and what its notify script recorded.
    fn holdings(&self, h: usize, k: usize) -> String {
        let host = &self.hosts[h];
        let vip = self.vips[k].to_string();
        let kernel = std::process::Command::new("ip")
            .args([
                "netns",
                "exec",
                &host.ns.name,
                "conntrack",
                "-L",
                "-d",
                &vip,
            ])
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        let cache = |arg: &str| {
            (host.conntrackd.as_ref()).map_or(0, |c| c.entries_to(arg, &[self.vips[k].into()])[0])
        };
        let state = self.bed.dir.join(format!("state-{}", host.name));
        let records: Vec<String> = (0..self.n())
            .map(|v| {
                let r = netns::read_to_string(&state.join((VRID_BASE + v).to_string()));
                let field = |key: &str| {
                    r.lines()
                        .find_map(|l| l.strip_prefix(&format!("{key}=")))
                        .unwrap_or("")
                        .to_owned()
                };
                format!(
                    "{}: {} {}",
                    VRID_BASE + v,
                    field("state"),
                    field("commit_result")
                )
            })
            .collect();
        format!(
            "{} holds of VIP {k}: kernel entries {} ({}), external {}, internal {}; records {records:?}",
            host.name,
            kernel.lines().count(),
            kernel.lines().take(2).collect::<Vec<_>>().join(" | "),
            cache("-e"),
            cache("-i"),
        )
    }

    /// Each host's conntrackd caches (`-s`), for a failure's report.
    fn caches(&self) -> String {
        let mut s = format!(
            "external cache entries per host and VIP: {:?} (want {} of each other host's VIP)\n",
            self.cache_counts(),
            CONNS + FLOWS
        );
        for h in &self.hosts {
            let stats = h.conntrackd.as_ref().and_then(|c| c.control(&["-s"]));
            s.push_str(&format!(
                "--- conntrackd -s on {}\n{}\n",
                h.name,
                stats.unwrap_or_default()
            ));
        }
        s
    }

    fn logs(&self) -> String {
        let mut s = self.caches();
        for h in &self.hosts {
            if let Some(k) = &h.keepalived {
                s.push_str(&format!("--- keepalived {}\n{}\n", h.name, k.log()));
            }
            let log = self.bed.dir.join(format!("conntrackd.log-{}", h.name));
            s.push_str(&format!(
                "--- conntrackd {}\n{}\n",
                h.name,
                netns::read_to_string(&log)
            ));
        }
        s
    }

    /// Makes host `i` fail as `fault` says.
    fn fail(&mut self, i: usize, fault: Fault) {
        let h = &self.hosts[i];
        fault.strike(
            &self.bed,
            h.daemon.as_ref(),
            h.keepalived.as_ref(),
            &h.ports,
        );
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
            Fault::GracefulStop => {
                if let Some(mut d) = self.hosts[i].daemon.take() {
                    assert!(
                        d.wait_exit(Duration::from_secs(60)).await.is_some(),
                        "the daemon stops"
                    );
                }
                self.start_daemon(i).await;
            }
            Fault::LinkCut => {
                for p in &self.hosts[i].ports {
                    self.bed.set_port(p, true);
                }
            }
        }
    }
}

// One bed at a time: each runs N daemons, keepalived and conntrackd.
use crate::netns::HEAVY_BED as SERIAL;

/// `n` hosts; each master in turn fails by `fault`, another host takes
/// its VIP over, the master comes back and takes it back. Asserts that
/// every connection and flow survived on its backend (every phase with
/// two hosts, the first failover with three: the module's header), no
/// line lost.
async fn each_master_in_turn(tag: &str, n: usize, fault: Fault) {
    let _one = SERIAL.lock().await;
    let mut c = Cluster::new(tag, n).await;
    for k in 0..n {
        // Host k preempts whichever host started first.
        c.await_master(k, k).await;
    }
    let targets: Vec<Target> = (c.vips.iter().enumerate())
        .map(|(v, vip)| Target {
            tcp: sa(*vip, 80),
            udp: sa(*vip, UDP_PORT),
            client: CLIENT.into(),
            greeting: format!("v{v}"),
        })
        .collect();
    let traffic = Traffic::start(&c.bed.client, &targets).await;
    let t0 = traffic.now_ms();
    tokio::time::sleep(Duration::from_secs(1)).await;
    traffic.settled(t0, Duration::from_secs(10)).await;
    assert_eq!(
        traffic.alive(),
        n * CONNS,
        "before the faults\n{}",
        c.logs()
    );
    assert!(
        c.caches_full(Duration::from_secs(30)).await,
        "every host's external cache holds the other hosts' flows\n{}",
        c.logs()
    );
    // The metrics name the transport (the sync-link-down alert leaves
    // multicast hosts out: NOTRACK sends nothing while no flow changes).
    let transport = if n > 2 { "multicast" } else { "unicast" };
    let d = c.hosts[0].daemon.as_ref().expect("started");
    let m = wait_for(
        Duration::from_secs(30),
        "the metrics name the sync's transport",
        || async {
            let m = d.metrics().await;
            (netns::metric_sample(
                &m,
                "harvester_lb_conntrack_sync_transport",
                &[("transport", transport)],
            ) == Some(1.0))
            .then_some(m)
        },
    )
    .await;
    support::promtool_accepts(&m);
    let mut report = String::new();
    // What is asserted kept (connections open, UDP flows on their
    // backend): with two hosts (FTFW to the one peer) every phase; with
    // three, the first failover, the later phases reported as FIGURE
    // lines. Among three hosts conntrackd's commit copies every
    // instance's flows, and their clean-up races the sync: connections
    // were lost at later faults in CI (20 of 20 of the VIP a kill moved
    // after a failback) and in tests/it/mgmt_vips/cluster3.rs; cause
    // open, docs/vip.md "Three and more hosts", issue 42.
    let asserted = |first: bool| n == 2 || first;
    let mut wrong: Vec<String> = Vec::new();
    for (i, name) in NAMES.iter().take(n).enumerate() {
        // Failover: host i fails, another takes VIP i over.
        traffic.new_phase();
        let caches = c.cache_counts();
        let (at, fault_ms) = (Instant::now(), traffic.now_ms());
        c.fail(i, fault);
        let (to, seen) = c.master_of(i, Some(i), fault != Fault::Killed).await;
        c.traffic_through(to, i).await;
        traffic.settled(fault_ms, Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let over = traffic.figures(i);
        let line = format!(
            "N={n} {fault:?} {name} (master of VIP {i}): VIP on {} after {:.2} s; {over}; external cache entries per host and VIP before: {caches:?}",
            NAMES[to],
            (seen - at).as_secs_f64()
        );
        if asserted(i == 0) && (over.alive < n * CONNS || over.udp_moved > 0) {
            wrong.push(line.clone());
        }
        report.push_str(&line);
        report.push('\n');
        if over.moved_alive < CONNS {
            report.push_str(&format!("  lost: {}\n", c.holdings(to, i)));
        }
        // Failback: host i returns and takes VIP i back.
        traffic.new_phase();
        let (at, back_ms) = (Instant::now(), traffic.now_ms());
        c.restore(i, fault).await;
        let back_at = c.await_master(i, i).await;
        c.traffic_through(i, i).await;
        traffic.settled(back_ms, Duration::from_secs(30)).await;
        tokio::time::sleep(Duration::from_secs(2)).await;
        let back = traffic.figures(i);
        if asserted(false) && (back.alive < n * CONNS || back.udp_moved > 0) {
            wrong.push(format!("N={n} {fault:?} {name} back: {back}"));
        }
        // The next fault only once every cache holds the other hosts'
        // flows again: a master killed before its flows reached the host
        // that takes its VIP loses them, which is no failover's fault.
        // Under load (two test lanes beside a benchmark, load 12) the
        // returning host's cache took over 30 s once, and the next kill
        // then reset the 20 connections the refill had not yet brought.
        let refill = Instant::now();
        let full = c.caches_full(Duration::from_secs(90)).await;
        report.push_str(&format!(
            "N={n} {fault:?} {name} back: VIP on {name} after {:.2} s (counted from the restart's start); {back}; caches refilled: {full} after {:.1} s\n",
            (back_at - at).as_secs_f64(),
            refill.elapsed().as_secs_f64()
        ));
        assert!(
            full,
            "the caches did not hold the other hosts' flows 90 s after {name}'s return:\n{report}\n{}",
            c.caches()
        );
        for l in report
            .lines()
            .rev()
            .take(2)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
        {
            eprintln!("FIGURE {l}");
        }
    }
    let (lines, datagrams) = traffic.finish().await;
    let total =
        format!("N={n} {fault:?}: over the run, lines lost {lines}, datagrams lost {datagrams}");
    eprintln!("FIGURE {total}");
    report.push_str(&total);
    assert!(
        wrong.is_empty(),
        "connections lost or flows moved to another backend:\n{}\n\n{report}\n{}",
        wrong.join("\n"),
        c.logs()
    );
    assert_eq!(lines, 0, "lines lost:\n{report}");
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
async fn netns_three_hosts_keep_every_connection_when_each_master_is_killed() {
    require_tools!();
    each_master_in_turn("ct3kill", 3, Fault::Killed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_three_hosts_keep_every_connection_when_each_master_stops() {
    require_tools!();
    each_master_in_turn("ct3term", 3, Fault::GracefulStop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_three_hosts_keep_every_connection_when_each_master_is_cut_off() {
    require_tools!();
    each_master_in_turn("ct3cut", 3, Fault::LinkCut).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_two_hosts_keep_every_connection_when_each_master_is_killed() {
    require_tools!();
    each_master_in_turn("ct2kill", 2, Fault::Killed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_two_hosts_keep_every_connection_when_each_master_stops() {
    require_tools!();
    each_master_in_turn("ct2term", 2, Fault::GracefulStop).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_two_hosts_keep_every_connection_when_each_master_is_cut_off() {
    require_tools!();
    each_master_in_turn("ct2cut", 2, Fault::LinkCut).await;
}

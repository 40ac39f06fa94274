//! Split brain: only one host's management link cut, silently (its port
//! stays up, the management switch drops its frames), in a bed of three
//! load-balancer hosts with the real daemon and the keepalived it
//! configures. What the clients on the VM network see is measured and
//! printed as `FIGURE` lines: which hosts hold the VIP (and so answer ARP
//! for it) sample by sample, ARP who-has probes answered by two MACs,
//! long connections made before the cut, new connections during it.
//!
//! ```text
//!  mgmt (br1): hosts h1, h2, h3 10.77.0.1-3 (unicast VRRP), the
//!     management gateway 10.77.0.254 (the hosts' default route)
//!  network A (br0, 198.51.100.0/24): client .2, backends n1 .21, n2 .22,
//!     hosts' eth0 .4-.6 (each a bridge with an uplink, br_netfilter on)
//! ```
//!
//! Without the management-reachability check (`vip::mgmt_check`), VRRP
//! makes the cut host master too (its peers' adverts no longer reach it):
//! two hosts hold the VIP for as long as the cut lasts. With it, the cut
//! host fails its check (it reaches neither the gateway nor a peer) and
//! goes to FAULT: exactly one host holds the VIP within the stated bound,
//! and when a backup is the one cut, the connections open on the master
//! are never disturbed. With both backups cut, the master reaches only
//! the gateway and keeps the VIP (the gateway is in the check for that).
//!
//! The proxied listener's connections are measured in each case (a
//! connection held by a master that is cut moves nowhere: it is lost with
//! the VIP). The kernel path's are measured when the master is cut
//! (`netns_a_silent_master_cut_keeps_kernel_flows`): a kernel listener
//! with `[conntrackd]` among the three hosts (multicast on the management
//! network, the daemon's defaults), its backends on a second bridged
//! network B (`br2`) routing the client's network back through a gateway
//! VIP that moves with the VIP, as in `tests/it/conntrack_hosts.rs`.
//!
//! Left out: the bridge's VLAN filtering and the bond under the uplink
//! (this kernel cannot build them); a real switch; a sync link apart from
//! the management network (the cut silences conntrackd with VRRP).
//!
//! Run as root with iproute2, nftables, keepalived, ping and arping (and
//! conntrackd and conntrack for the kernel path):
//! `cargo test --test it -- vmnet_split:: --nocapture`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harvester_lb::host::vmnet::keepalived::instance_of;
use netns::keepalived::{Conntrackd, Keepalived, conntrackd_missing, keepalived_missing};
use netns::peers::{Exchange, Node, Service, exchange, read_line, serve_name_then_echo};
use netns::vmnet::{
    GATEWAY, backend_via, holds_on, host, join_bridged, mgmt_port, net_b, silent_cut, sysctl,
};
use netns::{Bed, DaemonProc, NODEPORT, Ns, config, node_ip, sa, wait_for};
use support::{Lb, Listener, network};
use tokio::io::AsyncWriteExt;

/// The hosts: name and management address (sorted: h1 is rank 0).
const HOSTS: [(&str, &str); 3] = [
    ("h1", "10.77.0.1"),
    ("h2", "10.77.0.2"),
    ("h3", "10.77.0.3"),
];

/// The management network's gateway, the hosts' default route.
const MGMT_GATEWAY: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 254);

/// How long the link stays cut: long enough for every timer involved
/// (the check's interval and timeout, 3 adverts and the skew) to have
/// run out several times.
const CUT: Duration = Duration::from_secs(15);

/// The bound this test holds the outcome to: from this long after the cut
/// until the link returns, exactly one host holds the VIP at every sample.
/// What it is made of (docs/vip.md, "Split brain"): the cut host fails its
/// check within interval + timeout (1 + 1 s) and drops the VIP; a backup
/// takes a master's place after 3 adverts and the skew (about 3.6 s at 1 s
/// adverts). Twice that sum leaves room for a busy machine.
const BOUND: Duration = Duration::from_secs(10);

/// The kernel bed's gateway load balancer's (proxy) port: unused, the
/// load balancer is there for its VIP, the backends' route back.
const GW_PORT: u16 = 9000;

/// Which path the VIP's listener takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Path {
    /// A proxied listener, backends on network A.
    Proxy,
    /// A kernel listener (`source_nat = "none"`) with `[conntrackd]`:
    /// backends on network B (`br2`, each host's bridge `eth1`) routing
    /// the client's network back through a gateway VIP in the VIP's
    /// instance, as in `tests/it/conntrack_hosts.rs` (a kernel listener whose
    /// backends are on the VIP's own bridge is served by the proxy on a
    /// bridged host: docs/vip.md, "On a bridged host").
    Kernel,
}

/// An address from `first` up whose instance (of 3) has host h1 as its
/// preferred master.
fn of_h1(first: u8, net: fn(u8) -> Ipv4Addr) -> Ipv4Addr {
    (first..250)
        .map(net)
        .find(|v| instance_of((*v).into(), 3) == 0)
        .expect("an address of instance 0")
}

/// A VIP on network A whose instance (of 3) has host h1 as its preferred
/// master.
fn the_vip() -> Ipv4Addr {
    of_h1(40, |i| Ipv4Addr::new(198, 51, 100, i))
}

/// One load-balancer host of the bed.
struct Host {
    ns: Ns,
    name: &'static str,
    daemon: Option<DaemonProc>,
    keepalived: Option<Keepalived>,
    conntrackd: Option<Conntrackd>,
}

/// The bed: three hosts on network A and the management segment (and on
/// network B, for the kernel path).
struct Split {
    // Dropped first: the processes, then the services, then the bed.
    hosts: Vec<Host>,
    _nodes: Vec<Node>,
    /// The kernel path's backends on network B.
    services: Vec<tokio::task::JoinHandle<()>>,
    path: Path,
    vip: Ipv4Addr,
    /// The kernel path's gateway VIP on network B (in the VIP's instance).
    gateway: Ipv4Addr,
    bed: Bed,
}

impl Drop for Split {
    fn drop(&mut self) {
        for s in &self.services {
            s.abort();
        }
        if std::thread::panicking() {
            for h in &self.hosts {
                if let Some(d) = &h.daemon {
                    eprintln!("--- daemon {} ---\n{}", h.name, d.log_tail(30));
                }
                if let Some(k) = &h.keepalived {
                    let log = k.log();
                    let tail: Vec<&str> = log.lines().rev().take(40).collect();
                    eprintln!("--- keepalived {} ---\n{}", h.name, tail.join("\n"));
                }
            }
        }
    }
}

impl Split {
    fn new(test: &str, path: Path) -> Split {
        let mut bed = Bed::new(test, 2);
        let nodes = match path {
            Path::Proxy => vec![
                Node::start(&bed, 1, Service::NameThenEcho),
                Node::start(&bed, 2, Service::NameThenEcho),
            ],
            Path::Kernel => Vec::new(),
        };
        bed.add_bridge("br1");
        // The management gateway: it answers on br1 as a router would.
        bed.add_host_on("br1", "mg", MGMT_GATEWAY);
        let mut hosts = Vec::new();
        for (k, (name, mgmt)) in HOSTS.into_iter().enumerate() {
            let ns = host(
                &mut bed,
                name,
                Ipv4Addr::new(198, 51, 100, 4 + k as u8),
                mgmt,
            );
            // As on a Harvester host: the default route is the management
            // network's (which the check finds when it is not configured).
            ns.ip(&[
                "route",
                "add",
                "default",
                "via",
                &MGMT_GATEWAY.to_string(),
                "dev",
                "mgmt",
            ]);
            hosts.push(Host {
                ns,
                name,
                daemon: None,
                keepalived: None,
                conntrackd: None,
            });
        }
        let gateway = of_h1(100, net_b);
        let mut services = Vec::new();
        if path == Path::Kernel {
            bed.add_bridge("br2");
            for (k, h) in hosts.iter().enumerate() {
                join_bridged(
                    &bed,
                    &h.ns,
                    "br2",
                    &format!("k{}", h.name),
                    ("eth1", "up1"),
                    &format!("{}/24", net_b(4 + k as u8)),
                );
                sysctl(&h.ns, "net.ipv4.ip_forward=1");
                for dev in ["all", "default", "eth0", "eth1"] {
                    sysctl(&h.ns, &format!("net.ipv4.conf.{dev}.send_redirects=0"));
                }
            }
            for j in 1..=2 {
                let ip = net_b(20 + j);
                let ns = backend_via(&mut bed, "br2", &format!("b{j}"), ip, gateway);
                services.push(serve_name_then_echo(
                    &ns,
                    sa(ip, NODEPORT),
                    &format!("n{j}"),
                ));
            }
        }
        Split {
            hosts,
            _nodes: nodes,
            services,
            path,
            vip: the_vip(),
            gateway,
            bed,
        }
    }

    fn file(&self, h: usize, what: &str) -> std::path::PathBuf {
        self.bed
            .dir
            .join(format!("keepalived-{}{what}", self.hosts[h].name))
    }

    /// Host `h`'s config: the VIP on network A with `[keepalived]`.
    fn config(&self, h: usize) -> String {
        let (name, address) = HOSTS[h];
        let peers: Vec<&str> = HOSTS
            .iter()
            .filter(|(n, _)| *n != name)
            .map(|(_, a)| *a)
            .collect();
        let sockets = self.bed.dir.join("sockets");
        std::fs::create_dir_all(&sockets).expect("socket directory");
        let mut text = support::keepalived(
            name,
            address,
            peers,
            &self.bed.dir.join(format!("keepalived-{name}")),
            "",
        ) + &network("default/a", "eth0", GATEWAY, "");
        let c = config().socket(&sockets.join(format!("{name}.sock")));
        let c = match self.path {
            Path::Proxy => c.text(&text).lb(Lb::new("default/lb", self.vip)
                .backends([node_ip(1), node_ip(2)])
                .tcp("tcp", 80, NODEPORT)
                .keys("network = \"default/a\"")),
            Path::Kernel => {
                // conntrackd's defaults with two peers: FTFW over
                // multicast on the management network.
                text += &network("default/b", "eth1", net_b(1), "");
                text += &support::conntrackd(&self.bed.dir, name, "");
                let backends = [net_b(21), net_b(22)];
                c.text(&text)
                    .lb(Lb::new("default/lb", self.vip)
                        .backends(backends)
                        .keys("network = \"default/a\"")
                        .listener(
                            Listener::new("tcp", 80, NODEPORT)
                                .forwarding("kernel")
                                .source_nat("none"),
                        ))
                    // The backends' way back to the client's network:
                    // moves with the VIP (the same instance).
                    .lb(Lb::new("default/gw", self.gateway)
                        .backends(backends)
                        .keys("network = \"default/b\"")
                        .listener(Listener::new("gw", GW_PORT, NODEPORT)))
            }
        };
        c.to_string()
    }

    /// Every host: the daemon, which writes keepalived's file, then
    /// keepalived on it.
    async fn start(&mut self) {
        for h in 0..self.hosts.len() {
            let name = self.hosts[h].name;
            let path = self
                .bed
                .write(&format!("config-{name}.toml"), &self.config(h));
            let log = self.bed.dir.join(format!("daemon-{name}.log"));
            self.hosts[h].daemon = Some(DaemonProc::spawn(&self.hosts[h].ns, &path, &log, None));
            let conf = self.file(h, ".conf");
            let vip = self.vip;
            wait_for(
                Duration::from_secs(30),
                "the daemon writes keepalived's file",
                || async {
                    let text = std::fs::read_to_string(&conf).unwrap_or_default();
                    text.contains(&format!("{vip}/")).then_some(())
                },
            )
            .await;
            if self.path == Path::Kernel {
                self.start_conntrackd(h).await;
            }
            self.hosts[h].keepalived = Some(Keepalived::run(
                &self.hosts[h].ns,
                &self.bed.dir,
                name,
                &conf,
                Some(&self.file(h, ".pid")),
            ));
        }
    }

    /// Host `h`'s conntrackd, once the daemon wrote its file and its
    /// listener is on the kernel path (not the proxy's fallback).
    async fn start_conntrackd(&mut self, h: usize) {
        let name = self.hosts[h].name;
        let daemon = self.hosts[h].daemon.as_ref().expect("daemon");
        wait_for(
            Duration::from_secs(60),
            "the VIP's listener on the kernel path",
            || async {
                let s = daemon.status().await;
                s["load_balancers"]
                    .as_array()
                    .and_then(|lbs| lbs.iter().find(|lb| lb["name"] == "default/lb"))
                    .is_some_and(|lb| lb["listeners"][0]["forwarding"] == "kernel")
                    .then_some(())
            },
        )
        .await;
        let conf = self.bed.dir.join(format!("conntrackd.conf-{name}"));
        wait_for(
            Duration::from_secs(30),
            "the daemon writes conntrackd's file",
            || async { conf.exists().then_some(()) },
        )
        .await;
        let c = Conntrackd::run(
            &self.hosts[h].ns,
            &conf,
            &self.bed.dir.join(format!("conntrackd-out-{name}.log")),
        );
        wait_for(Duration::from_secs(20), "conntrackd answers", || async {
            c.control(&["-s"]).map(|_| ())
        })
        .await;
        self.hosts[h].conntrackd = Some(c);
    }

    /// The flows host `h`'s conntrackd holds in its external cache (synced
    /// from the master).
    fn synced(&self, h: usize) -> u64 {
        self.hosts[h]
            .conntrackd
            .as_ref()
            .and_then(|c| c.control(&["-s"]))
            .and_then(|s| harvester_lb::host::conntrack_sync::conntrackd::parse_stats(&s))
            .map_or(0, |s| s.external)
    }

    /// Which hosts hold the VIP now (a bit per host).
    fn holders(&self) -> u8 {
        let hosts: Vec<Ns> = self.hosts.iter().map(|h| h.ns.clone()).collect();
        holders(&hosts, self.vip)
    }

    /// Waits until host h1 alone holds the VIP and the client is served.
    async fn on_h1(&self, within: Duration) {
        wait_for(within, "the VIP on host h1 alone", || async {
            (self.holders() == 1).then_some(())
        })
        .await;
        let vip = SocketAddr::new(self.vip.into(), 80);
        wait_for(within, "the VIP serves the client", || async {
            matches!(
                exchange(&self.bed.client, vip, 64, Duration::from_secs(2)).await,
                Exchange::Ok(_)
            )
            .then_some(())
        })
        .await;
    }

    /// Cuts host `h`'s management link silently (`cut`) or restores it
    /// ([`silent_cut`]).
    fn silent_cut(&self, h: usize, cut: bool) {
        silent_cut(&self.bed, &mgmt_port(self.hosts[h].name), cut);
    }
}

/// Sets each flag when dropped.
struct StopOnDrop(Vec<Arc<AtomicBool>>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        for f in &self.0 {
            f.store(true, Ordering::Relaxed);
        }
    }
}

/// What the clients saw over one cut and return.
#[derive(Default)]
struct Seen {
    /// (time since the cut, hosts holding the VIP) per sample.
    samples: Vec<(Duration, u8)>,
    /// ARP probes sent, and those answered by more than one MAC.
    arp_probes: usize,
    arp_two: usize,
    /// New connections during the cut: answered, failed.
    new_ok: usize,
    new_failed: usize,
}

/// Which of `hosts` hold `vip` on their eth0 now (a bit per host).
fn holders(hosts: &[Ns], vip: Ipv4Addr) -> u8 {
    let vip = vip.to_string();
    (0..hosts.len())
        .filter(|h| holds_on(&hosts[*h], "eth0", &vip))
        .fold(0, |m, h| m | 1 << h)
}

/// Samples which of `hosts` hold `vip` every 100 ms from `at` until `stop`.
fn sample(hosts: &[Ns], vip: Ipv4Addr, at: Instant, stop: &AtomicBool, seen: &Mutex<Seen>) {
    while !stop.load(Ordering::Relaxed) {
        let h = holders(hosts, vip);
        seen.lock().unwrap().samples.push((at.elapsed(), h));
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// One ARP who-has for `vip` from the client (arping, 1 s): the MACs that
/// answered.
fn arp_answers(client: &Ns, vip: Ipv4Addr) -> Vec<String> {
    let out = Command::new("ip")
        .args(["netns", "exec", &client.name, "arping", "-I", "eth0"])
        .args(["-c", "2", "-w", "1", &vip.to_string()])
        .output()
        .expect("arping (package arping)");
    let mut macs: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| l.contains("reply from"))
        .filter_map(|l| {
            let a = l.find('[')?;
            let b = l.find(']')?;
            Some(l[a + 1..b].to_lowercase())
        })
        .collect();
    macs.sort();
    macs.dedup();
    macs
}

/// A long connection made before the cut: a line every 300 ms, each echo
/// awaited `patience` (5 s is room for a retransmit; a connection whose
/// flow moves between hosts needs room for TCP's backed-off retransmits
/// past the move); the longest wait for an echo, or how and when it ended.
async fn talk(
    client: Ns,
    vip: SocketAddr,
    at: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
    patience: Duration,
) -> Result<Duration, String> {
    let since = |at: &Arc<Mutex<Option<Instant>>>| {
        at.lock()
            .unwrap()
            .map(|a| format!("{:.2} s after the cut", a.elapsed().as_secs_f64()))
            .unwrap_or_else(|| "before the cut".into())
    };
    let mut s = client
        .connect(vip, Duration::from_secs(5))
        .await
        .map_err(|e| format!("connect: {e}"))?;
    read_line(&mut s).await.map_err(|e| format!("name: {e}"))?;
    let mut lines = 0;
    let mut longest = Duration::ZERO;
    while !stop.load(Ordering::Relaxed) {
        let line = format!("line {lines}\n");
        let sent = Instant::now();
        let echoed = async {
            s.write_all(line.as_bytes()).await?;
            read_line(&mut s).await
        };
        match tokio::time::timeout(patience, echoed).await {
            Ok(Ok(back)) if back == line.trim_end() => lines += 1,
            Ok(Ok(back)) => return Err(format!("wrong echo {back:?} {}", since(&at))),
            Ok(Err(e)) => return Err(format!("{e} {}", since(&at))),
            Err(_) => return Err(format!("no echo within {patience:?} {}", since(&at))),
        }
        longest = longest.max(sent.elapsed());
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(longest)
}

/// `items` as "N× item", alike ones counted together.
fn tally(items: &[String]) -> String {
    let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
    for i in items {
        *counts.entry(i.as_str()).or_default() += 1;
    }
    counts
        .iter()
        .map(|(i, n)| format!("{n}× {i}"))
        .collect::<Vec<_>>()
        .join("; ")
}

/// The longest stretch of samples (from `from` on) with two or more
/// holders, summed over every stretch, and the time from `from` until the
/// last sample whose holder count was not one.
fn overlap(
    samples: &[(Duration, u8)],
    from: Duration,
    to: Duration,
) -> (Duration, Option<Duration>) {
    let mut two = Duration::ZERO;
    let mut last_not_one = None;
    for w in samples.windows(2) {
        let (t, h) = w[0];
        if t < from || t > to {
            continue;
        }
        if h.count_ones() > 1 {
            two += w[1].0 - t;
        }
        if h.count_ones() != 1 {
            last_not_one = Some(w[1].0 - from);
        }
    }
    (two, last_not_one)
}

/// Cuts the management links of the hosts `cut` silently for [`CUT`],
/// restores them, and measures; returns how the outcome differs from what the check
/// promises (empty: as promised).
async fn split(t: &Split, cut: &[usize], case: &str) -> Vec<String> {
    let vip = SocketAddr::new(t.vip.into(), 80);
    t.on_h1(Duration::from_secs(60)).await;
    let stop = Arc::new(AtomicBool::new(false));
    let cut_at: Arc<Mutex<Option<Instant>>> = Arc::default();
    // Ten long connections, all on h1 (the master) now.
    let mut talkers = Vec::new();
    for _ in 0..10 {
        talkers.push(tokio::spawn(talk(
            t.bed.client.clone(),
            vip,
            cut_at.clone(),
            stop.clone(),
            match t.path {
                Path::Proxy => Duration::from_secs(5),
                Path::Kernel => Duration::from_secs(20),
            },
        )));
    }
    // The kernel path: the cut comes once both backups hold the ten flows
    // (conntrackd synced them), as they would after a while.
    if t.path == Path::Kernel {
        let (a, b) = (t.synced(1), t.synced(2));
        wait_for(
            Duration::from_secs(30),
            &format!("both backups hold the ten flows (had {a}, {b})"),
            || async { (t.synced(1) >= 10 && t.synced(2) >= 10).then_some(()) },
        )
        .await;
    }
    let at = Instant::now();
    *cut_at.lock().unwrap() = Some(at);
    let seen = Arc::new(Mutex::new(Seen::default()));
    let sampling = Arc::new(AtomicBool::new(false));
    // New connections, one every 250 ms, and an ARP probe every 0.5 s,
    // until the link returns.
    let probing = Arc::new(AtomicBool::new(false));
    let probes = {
        let (client, seen, probing, v) =
            (t.bed.client.clone(), seen.clone(), probing.clone(), t.vip);
        tokio::task::spawn_blocking(move || {
            while !probing.load(Ordering::Relaxed) {
                let macs = arp_answers(&client, v);
                let mut s = seen.lock().unwrap();
                s.arp_probes += 1;
                s.arp_two += usize::from(macs.len() > 1);
                drop(s);
                std::thread::sleep(Duration::from_millis(500));
            }
        })
    };
    let newconns = {
        let (client, seen, probing) = (t.bed.client.clone(), seen.clone(), probing.clone());
        tokio::spawn(async move {
            while !probing.load(Ordering::Relaxed) {
                let ok = matches!(
                    exchange(&client, vip, 16, Duration::from_secs(2)).await,
                    Exchange::Ok(_)
                );
                {
                    let mut s = seen.lock().unwrap();
                    if ok {
                        s.new_ok += 1;
                    } else {
                        s.new_failed += 1;
                    }
                }
                tokio::time::sleep(Duration::from_millis(250)).await;
            }
        })
    };
    let sampler = {
        let (hosts, v, sampling, seen) = (
            t.hosts.iter().map(|h| h.ns.clone()).collect::<Vec<Ns>>(),
            t.vip,
            sampling.clone(),
            seen.clone(),
        );
        std::thread::spawn(move || sample(&hosts, v, at, &sampling, &seen))
    };
    // However this ends (a failed step panics), the probes and the
    // sampler stop: the runtime waits for its blocking tasks.
    let _stops = StopOnDrop(vec![probing.clone(), sampling.clone(), stop.clone()]);
    for h in cut {
        t.silent_cut(*h, true);
    }
    // The cut lasts CUT (the sampler and probes run meanwhile).
    while at.elapsed() < CUT {
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    for h in cut {
        t.silent_cut(*h, false);
    }
    let returned = at.elapsed();
    probing.store(true, Ordering::Relaxed);
    // After the return: h1 alone again (keepalived preempts), then 5 s
    // more of samples.
    let deadline = Instant::now() + Duration::from_secs(40);
    while t.holders() != 1 && Instant::now() < deadline {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let settled = Instant::now();
    while settled.elapsed() < Duration::from_secs(5) {
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    sampling.store(true, Ordering::Relaxed);
    sampler.join().expect("sampler");
    probes.await.expect("ARP probes");
    newconns.await.expect("new connections");
    stop.store(true, Ordering::Relaxed);
    let mut kept = 0;
    let mut how = Vec::new();
    let mut gap = Duration::ZERO;
    for talker in talkers {
        match talker.await.expect("talker") {
            Ok(longest) => {
                kept += 1;
                gap = gap.max(longest);
            }
            Err(e) => how.push(e),
        }
    }
    let s = seen.lock().unwrap();
    let names = |m: u8| -> String {
        let v: Vec<&str> = (0..3)
            .filter(|h| m & 1 << h != 0)
            .map(|h| HOSTS[h].0)
            .collect();
        if v.is_empty() {
            "none".into()
        } else {
            v.join("+")
        }
    };
    // The holders as a timeline of changes.
    let mut timeline = Vec::new();
    let mut last = None;
    for (when, h) in &s.samples {
        if last != Some(*h) {
            timeline.push(format!("{:.1} s {}", when.as_secs_f64(), names(*h)));
            last = Some(*h);
        }
    }
    let end = s.samples.last().map_or(returned, |x| x.0);
    let (two_cut, unsettled) = overlap(&s.samples, Duration::ZERO, returned);
    let (two_after, _) = overlap(&s.samples, returned, end);
    let final_holder = s.samples.last().map_or(0, |x| x.1);
    eprintln!(
        "FIGURE split {:?} {case}: link cut silently for {:.1} s; holders: {}; two holders for {:.1} s during the cut and {:.1} s after it returned; exactly one holder from {} on; ARP who-has answered by two MACs in {}/{} probes; new connections during the cut {} ok, {} failed; long connections kept {kept}/10 (longest wait for an echo {:.2} s){}",
        t.path,
        returned.as_secs_f64(),
        timeline.join(", "),
        two_cut.as_secs_f64(),
        two_after.as_secs_f64(),
        unsettled.map_or("the cut".into(), |u| format!("+{:.1} s", u.as_secs_f64())),
        s.arp_two,
        s.arp_probes,
        s.new_ok,
        s.new_failed,
        gap.as_secs_f64(),
        if how.is_empty() {
            String::new()
        } else {
            format!(" (lost: {})", tally(&how))
        }
    );
    // The outcome: never two holders for longer than a transition takes,
    // exactly one from BOUND after the cut until the return, and h1 alone
    // at the end.
    let mut wrong = Vec::new();
    if two_cut + two_after >= Duration::from_secs(1) {
        wrong.push(format!(
            "{case}: two hosts held the VIP for {:.1} s (timeline: {})",
            (two_cut + two_after).as_secs_f64(),
            timeline.join(", ")
        ));
    }
    if overlap(&s.samples, BOUND, returned).1.is_some() {
        wrong.push(format!(
            "{case}: not exactly one holder at some time between +{BOUND:?} and the return (timeline: {})",
            timeline.join(", ")
        ));
    }
    if final_holder != 1 {
        wrong.push(format!("{case}: h1 does not hold the VIP alone at the end"));
    }
    // Backups cut: the master never loses the VIP, so nothing moves. The
    // kernel path: the flows move with the VIP (conntrackd), both ways.
    if (!cut.contains(&0) || t.path == Path::Kernel) && kept != 10 {
        wrong.push(format!(
            "{case}: the master's connections were disturbed: {}",
            tally(&how)
        ));
    }
    wrong
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_silent_management_cut_leaves_exactly_one_holder() {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut t = Split::new("split", Path::Proxy);
    t.start().await;
    // No management_gateway in the files: each daemon finds the default
    // route's, says so in /status, and wrote the check's script 0700.
    for h in 0..3 {
        let daemon = t.hosts[h].daemon.as_ref().expect("daemon");
        let check = wait_for(
            Duration::from_secs(30),
            "/status management_check",
            || async {
                let s = daemon.status().await;
                let c = s["management_check"].clone();
                (!c.is_null()).then_some(c)
            },
        )
        .await;
        assert_eq!(check["gateway"], MGMT_GATEWAY.to_string(), "{check}");
        assert_eq!(check["gateway_source"], "default route", "{check}");
        assert!(check["problem"].is_null(), "{check}");
        let script = t.file(h, "-mgmt-check");
        let mode = std::os::unix::fs::PermissionsExt::mode(
            &std::fs::metadata(&script)
                .expect("the check's script")
                .permissions(),
        );
        assert_eq!(mode & 0o777, 0o700, "{}", script.display());
    }
    // The backup h3 cut: it must not take the VIP. The master h1 cut: it
    // must give the VIP up, h2 take it alone. Both are measured before
    // either is judged.
    let mut wrong = split(&t, &[2], "backup h3 cut").await;
    wrong.extend(split(&t, &[0], "master h1 cut").await);
    // Both backups cut: h1 is the last host its peers' adverts could come
    // from and reaches the gateway alone; it keeps the VIP (a check of the
    // peers alone would fault it), h2 and h3 fault.
    wrong.extend(split(&t, &[1, 2], "backups h2 and h3 cut").await);
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

/// The master's management link cut silently with its VIP's flows on the
/// kernel path, synced by conntrackd among the three hosts: the cut host
/// faults (the management check), h2 takes the VIP over and commits the
/// flows it was sent; when the link returns h1 takes the VIP back (its
/// notify script flushed its own, stale, entries on FAULT and asked for a
/// resync as a backup) and commits them again. Every open connection
/// survives both moves. Only this case: the backups' cut moves no flow
/// (the proxied test above measures it), and each case costs a bed's
/// worth of time.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_a_silent_master_cut_keeps_kernel_flows() {
    require_netns!();
    if keepalived_missing() || conntrackd_missing() {
        return;
    }
    let mut t = Split::new("splitk", Path::Kernel);
    t.start().await;
    let wrong = split(&t, &[0], "master h1 cut").await;
    assert!(wrong.is_empty(), "{}", wrong.join("\n"));
}

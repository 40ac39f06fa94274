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
//! Left out: the hosts' proxied listener is the one whose connections are
//! measured (a connection held by a master that is cut moves nowhere: it
//! is lost with the VIP; the kernel path with conntrackd among three hosts
//! is h42-nhosts' bed); the bridge's VLAN filtering and the bond under the
//! uplink (this kernel cannot build them); a real switch.
//!
//! Run as root with iproute2, nftables, keepalived, ping and arping:
//! `cargo test --test vmnet_split -- --nocapture`.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

mod netns;
mod support;

use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use harvester_lb::vip::keepalived::instance_of;
use netns::keepalived::{Keepalived, keepalived_missing};
use netns::peers::{Exchange, Node, Service, exchange, read_line};
use netns::vmnet::{GATEWAY, holds_on, host, mgmt_port};
use netns::{Bed, DaemonProc, NODEPORT, Ns, config, node_ip, wait_for};
use support::{Lb, network};
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

/// A VIP on network A whose instance (of 3) has host h1 as its preferred
/// master.
fn the_vip() -> Ipv4Addr {
    (40..80)
        .map(|i| Ipv4Addr::new(198, 51, 100, i))
        .find(|v| instance_of((*v).into(), 3) == 0)
        .expect("a VIP of instance 0")
}

/// One load-balancer host of the bed.
struct Host {
    ns: Ns,
    name: &'static str,
    daemon: Option<DaemonProc>,
    keepalived: Option<Keepalived>,
}

/// The bed: three hosts on network A and the management segment.
struct Split {
    // Dropped first: the processes, then the services, then the bed.
    hosts: Vec<Host>,
    _nodes: [Node; 2],
    vip: Ipv4Addr,
    bed: Bed,
}

impl Drop for Split {
    fn drop(&mut self) {
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
    fn new(test: &str) -> Split {
        let mut bed = Bed::new(test, 2);
        let nodes = [
            Node::start(&bed, 1, Service::NameThenEcho),
            Node::start(&bed, 2, Service::NameThenEcho),
        ];
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
            });
        }
        Split {
            hosts,
            _nodes: nodes,
            vip: the_vip(),
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
        let c = config()
            .socket(&sockets.join(format!("{name}.sock")))
            .text(
                &(support::keepalived(
                    name,
                    address,
                    peers,
                    &self.bed.dir.join(format!("keepalived-{name}")),
                    "",
                ) + &network("default/a", "eth0", GATEWAY, "")),
            )
            .lb(Lb::new("default/lb", self.vip)
                .backends([node_ip(1), node_ip(2)])
                .tcp("tcp", 80, NODEPORT)
                .keys("network = \"default/a\""));
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
            self.hosts[h].keepalived = Some(Keepalived::run(
                &self.hosts[h].ns,
                &self.bed.dir,
                name,
                &conf,
                Some(&self.file(h, ".pid")),
            ));
        }
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

    /// Cuts host `h`'s management link silently (`cut`) or restores it:
    /// the management switch drops every frame from or to its port, which
    /// stays up (no carrier change for keepalived to see).
    fn silent_cut(&self, h: usize, cut: bool) {
        let table = format!("split_{}", self.hosts[h].name);
        if cut {
            let port = mgmt_port(self.hosts[h].name);
            self.bed.bridge.nft(&format!(
                "table bridge {table} {{\n chain cut {{\n  type filter hook forward priority 0; policy accept;\n  iifname \"{port}\" drop\n  oifname \"{port}\" drop\n }}\n}}\n"
            ));
        } else {
            self.bed
                .bridge
                .nft(&format!("delete table bridge {table}\n"));
        }
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
/// awaited 5 s (room for a retransmit); `Err` says how and when it ended.
async fn talk(
    client: Ns,
    vip: SocketAddr,
    at: Arc<Mutex<Option<Instant>>>,
    stop: Arc<AtomicBool>,
) -> Result<usize, String> {
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
    while !stop.load(Ordering::Relaxed) {
        let line = format!("line {lines}\n");
        let echoed = async {
            s.write_all(line.as_bytes()).await?;
            read_line(&mut s).await
        };
        match tokio::time::timeout(Duration::from_secs(5), echoed).await {
            Ok(Ok(back)) if back == line.trim_end() => lines += 1,
            Ok(Ok(back)) => return Err(format!("wrong echo {back:?} {}", since(&at))),
            Ok(Err(e)) => return Err(format!("{e} {}", since(&at))),
            Err(_) => return Err(format!("no echo within 5 s {}", since(&at))),
        }
        tokio::time::sleep(Duration::from_millis(300)).await;
    }
    Ok(lines)
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
        )));
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
    for talker in talkers {
        match talker.await.expect("talker") {
            Ok(_) => kept += 1,
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
        "FIGURE split {case}: link cut silently for {:.1} s; holders: {}; two holders for {:.1} s during the cut and {:.1} s after it returned; exactly one holder from {} on; ARP who-has answered by two MACs in {}/{} probes; new connections during the cut {} ok, {} failed; long connections kept {kept}/10{}",
        returned.as_secs_f64(),
        timeline.join(", "),
        two_cut.as_secs_f64(),
        two_after.as_secs_f64(),
        unsettled.map_or("the cut".into(), |u| format!("+{:.1} s", u.as_secs_f64())),
        s.arp_two,
        s.arp_probes,
        s.new_ok,
        s.new_failed,
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
    // Backups cut: the master never loses the VIP, so nothing moves.
    if !cut.contains(&0) && kept != 10 {
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
    let mut t = Split::new("split");
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

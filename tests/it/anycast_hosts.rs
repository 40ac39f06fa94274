//! The anycast sync among N announcing hosts: `[conntrackd]` without
//! `[keepalived]`, `transport = "multicast"` (conntrackd's FTFW over one
//! multicast group on the hosts' shared link, every host a member, each
//! flow's state injected into every other host's kernel table), with
//! three hosts and, for the figures, two. Real BIRD 2 on every host and on
//! the router, which spreads flows by ECMP on the 5-tuple; the backends
//! sit on a network of their own behind the router, so their replies go
//! through the router's ECMP too, spread independently of their flows
//! (see `tests/it/netns/bgp.rs`, `BgpBed::bridged_hosts`).
//!
//! Each host's link to the router is a plain veth (`eth0`, the bed of
//! `BgpBed::hosts`), not a Harvester host's bridge with an uplink and
//! `br_netfilter`: on such a bridged host the daemon serves kernel
//! listeners whose backends lie behind the uplink by the proxy (the bridge
//! stage's DNAT cannot send a frame back out of the port it came in by;
//! `tests/it/anycast.rs`, `bgp_kernel_listeners_on_a_bridged_host_are_served_by_the_proxy`),
//! and this test is about the kernel's flows and their sync; the multicast
//! sync and BGP run on `eth0` as they would on `mgmt-br`. Left out besides:
//! the bridge's VLAN filtering and the bond under the uplink (this kernel
//! has neither), a real switch's IGMP snooping (the router's Linux bridge
//! snoops, with no querier), and a host that dies silently (BFD takes it
//! out; covered for two hosts by `tests/it/anycast.rs`).
//!
//! Run as root with bird2, conntrackd and conntrack:
//! `cargo test --test it -- anycast_hosts:: --nocapture` (figures printed as
//! `FIGURE` lines).

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_bgp;

use std::collections::BTreeSet;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use netns::anycast_hosts::{
    echo_traffic, run_conntrackd, start_synced, udp_flow, udp_traffic, wait_synced_ready,
};
use netns::bgp::{BgpBed, PORT, VIP};
use netns::keepalived::Conntrackd;

fn vip() -> SocketAddr {
    SocketAddr::new(IpAddr::V4(VIP), PORT)
}

/// The held TCP connections of a run.
const CONNECTIONS: usize = 20;
/// The fixed-port UDP flows of a run.
const UDP_FLOWS: usize = 8;

/// What one fault did to the flows held across it.
#[derive(Debug)]
struct Step {
    /// The host that failed, and how (`withdraw`: `host drain`, 3 s, then
    /// `host ready`; `kill`: its BIRD, daemon and conntrackd SIGKILLed and
    /// its kernel's conntrack table flushed, as a host that crashed and
    /// rebooted, then all started again).
    host: usize,
    fault: &'static str,
    /// From the fault until the router's route left the host out.
    out: Duration,
    /// From the host's return (`host ready`, or its daemon started again)
    /// until the router had it back.
    back: Duration,
    /// For `kill`: how many held flows the host's kernel table had again
    /// after conntrackd's restart (its startup resync), and when the last
    /// of them came (or 10 s, when some never did).
    resync: Option<(usize, Duration)>,
    /// TCP connections alive after the step, of those held.
    kept: (usize, usize),
    /// Lines written during the step, and lines not echoed.
    lines: (u64, u64),
    /// The longest time between two echoes on one connection.
    gap: Duration,
    /// UDP datagrams sent, unanswered, and answered by another backend
    /// than the flow's first.
    udp: (u64, u64, u64),
}

impl Step {
    /// The `FIGURE` line of this step in a bed of `n` hosts.
    fn figure(&self, n: usize) -> String {
        format!(
            "anycast sync N={n} host {} {}: out of the route {} ms, back {} ms, resync {}, TCP kept {}/{}, lines lost {} of {}, longest echo gap {} ms, UDP lost {} of {}, UDP on another backend {}",
            self.host,
            self.fault,
            self.out.as_millis(),
            self.back.as_millis(),
            self.resync.map_or_else(
                || "-".to_string(),
                |(n, d)| format!("{n}/{} flows in {} ms", self.kept.1, d.as_millis())
            ),
            self.kept.0,
            self.kept.1,
            self.lines.1,
            self.lines.0,
            self.gap.as_millis(),
            self.udp.1,
            self.udp.0,
            self.udp.2,
        )
    }
}

/// Kills every process named `comm` in `ns` with `sig` (by pid, found
/// through `ip netns pids`).
fn kill_in_ns(ns: &str, comm: &str, sig: i32) {
    let out = std::process::Command::new("ip")
        .args(["netns", "pids", ns])
        .output()
        .expect("ip netns pids");
    for pid in String::from_utf8_lossy(&out.stdout).split_whitespace() {
        let name = std::fs::read_to_string(format!("/proc/{pid}/comm")).unwrap_or_default();
        if name.trim() == comm
            && let Ok(p) = pid.parse::<i32>()
        {
            // SAFETY: kill(2) on a pid of a process in the test's own
            // namespace, started by this test.
            unsafe {
                libc::kill(p, sig);
            }
        }
    }
}

/// The bed of `n` synced hosts with traffic held across each host's
/// withdrawal and crash in turn: returns every step's figures.
async fn synced_hosts(tag: &str, n: usize) -> Vec<Step> {
    let mut bed = BgpBed::hosts(tag, n).await;
    bed.route_replies_through_router();
    let all: Vec<usize> = (1..=n).collect();
    let mut confs = Vec::new();
    let mut syncs: Vec<Option<Conntrackd>> = Vec::new();
    for i in 1..=n {
        let conf = start_synced(&mut bed, i, "transport = \"multicast\"\n").await;
        let rendered = std::fs::read_to_string(&conf).expect("conntrackd.conf");
        assert!(
            rendered.contains("Multicast {") && !rendered.contains("IPv4_Destination_Address"),
            "host {i}: not the multicast sync:\n{rendered}"
        );
        syncs.push(Some(run_conntrackd(&bed, i, &conf)));
        confs.push(conf);
    }
    bed.wait_nexthops(&all, Duration::from_secs(30)).await;
    for i in 1..=n {
        wait_synced_ready(&bed, i, syncs[i - 1].as_ref().expect("conntrackd")).await;
        bed.host(i).record_new_flows();
    }
    // Opened all at once, each given 15 s: a handshake packet that outruns
    // the sync is dropped by the guard and resent by TCP.
    let opens = (0..CONNECTIONS).map(|_| bed.connect(vip(), Duration::from_secs(15)));
    let mut conns = Vec::new();
    for c in futures_util::future::join_all(opens).await {
        let (c, _) = c.unwrap_or_else(|e| panic!("open a long connection to {}: {e}", vip()));
        conns.push(c);
    }
    let ports: BTreeSet<u16> = conns
        .iter()
        .map(|c| c.get_ref().local_addr().expect("local address").port())
        .collect();
    let mut udp = Vec::new();
    for _ in 0..UDP_FLOWS {
        udp.push(udp_flow(&bed, vip()).await);
    }
    // Every flow's binding on every host.
    let every_host_holds = |bed: &BgpBed, live: &BTreeSet<u16>| {
        (1..=n).all(|i| {
            let on = bed.host(i).flows("tcp");
            live.iter().all(|p| on.contains_key(p))
        })
    };
    netns::wait_for(
        Duration::from_secs(20),
        "every TCP flow in every host's kernel table",
        || async { every_host_holds(&bed, &ports).then_some(()) },
    )
    .await;
    let carried: Vec<usize> = (1..=n)
        .map(|i| {
            bed.host(i)
                .recorded_flows("tcp")
                .keys()
                .filter(|p| ports.contains(p))
                .count()
        })
        .collect();
    eprintln!("connections opened through hosts 1..={n}: {carried:?}");
    assert!(
        carried.iter().all(|c| *c > 0),
        "the router did not spread the connections over all {n} hosts: {carried:?}"
    );

    let mut steps = Vec::new();
    for i in 1..=n {
        for fault in ["withdraw", "kill"] {
            let stop = Arc::new(AtomicBool::new(false));
            let live = ports.len();
            let tcp: Vec<_> = conns
                .drain(..)
                .map(|c| tokio::spawn(echo_traffic(c, stop.clone())))
                .collect();
            let udp_tasks: Vec<_> = udp
                .drain(..)
                .map(|(s, b)| {
                    let stop = stop.clone();
                    tokio::spawn(async move { (udp_traffic(s, b, stop).await, b) })
                })
                .collect();
            tokio::time::sleep(Duration::from_secs(1)).await;
            let others: Vec<usize> = all.iter().copied().filter(|h| *h != i).collect();
            let began = Instant::now();
            let (out, back, resync);
            if fault == "withdraw" {
                bed.host(i).host_state("drain");
                out = bed.wait_nexthops(&others, Duration::from_secs(10)).await - began;
                tokio::time::sleep(Duration::from_secs(3)).await;
                let t = Instant::now();
                bed.host(i).host_state("ready");
                back = bed.wait_nexthops(&all, Duration::from_secs(30)).await - t;
                resync = None;
            } else {
                let ns = bed.host(i).ns.name.clone();
                // The host crashes: BIRD first (its kernel closes the BGP
                // session, so the router drops the host at once, as BFD
                // would for a silent death), then the daemon and
                // conntrackd; the reboot's kernel table is empty.
                bed.host_mut(i)
                    .bird
                    .take()
                    .expect("bird")
                    .kill(libc::SIGKILL);
                bed.host(i).daemon().signal(libc::SIGKILL);
                kill_in_ns(&ns, "conntrackd", libc::SIGKILL);
                out = bed.wait_nexthops(&others, Duration::from_secs(10)).await - began;
                bed.host_mut(i)
                    .daemon
                    .as_mut()
                    .expect("daemon")
                    .wait_exit(Duration::from_secs(10))
                    .await
                    .expect("the daemon exits at SIGKILL");
                bed.host_mut(i).daemon = None;
                drop(syncs[i - 1].take());
                netns::run("ip", &["netns", "exec", &ns, "conntrack", "-F"], None);
                tokio::time::sleep(Duration::from_secs(3)).await;
                // Back: a reboot's /run holds no lock file; conntrackd
                // starts first and asks the others for their flows
                // (`StartupResync`), then the daemon (which starts
                // withdrawn) and BIRD.
                let _ = std::fs::remove_file(bed.host(i).dir.join("ctd.lock"));
                let t = Instant::now();
                syncs[i - 1] = Some(run_conntrackd(&bed, i, &confs[i - 1]));
                // What the others' resync brings back: a flow whose state
                // never changed on a survivor (it carried it only as an
                // injected entry) is in no survivor's internal cache, so in
                // no bulk update; up to 10 s for the rest.
                let deadline = Instant::now() + Duration::from_secs(10);
                let restored = loop {
                    let on = bed.host(i).flows("tcp");
                    let have = ports.iter().filter(|p| on.contains_key(p)).count();
                    if have == ports.len() || Instant::now() > deadline {
                        break have;
                    }
                    tokio::time::sleep(Duration::from_millis(100)).await;
                };
                resync = Some((restored, t.elapsed()));
                let t = Instant::now();
                bed.host_mut(i).start_daemon().await;
                bed.start_host_bird(i);
                back = bed.wait_nexthops(&all, Duration::from_secs(40)).await - t;
                wait_synced_ready(&bed, i, syncs[i - 1].as_ref().expect("conntrackd")).await;
            }
            // The flows the router moved back to the host go on there.
            tokio::time::sleep(Duration::from_secs(3)).await;
            stop.store(true, Ordering::Relaxed);
            let mut step = Step {
                host: i,
                fault,
                out,
                back,
                resync,
                kept: (0, live),
                lines: (0, 0),
                gap: Duration::ZERO,
                udp: (0, 0, 0),
            };
            for t in tcp {
                let (c, e) = t.await.expect("echo task");
                step.lines.0 += e.sent;
                step.lines.1 += e.sent - e.echoed;
                step.gap = step.gap.max(e.gap);
                if !e.broken {
                    step.kept.0 += 1;
                }
                conns.push(c);
            }
            for t in udp_tasks {
                let ((s, d), b) = t.await.expect("udp task");
                step.udp.0 += d.sent;
                step.udp.1 += d.sent - d.answered;
                step.udp.2 += d.other_backend;
                udp.push((s, b));
            }
            eprintln!("FIGURE {}", step.figure(n));
            steps.push(step);
        }
    }
    drop(syncs);
    steps
}

/// What every step must show: no connection lost, no line lost, no UDP
/// flow on another backend, and enough traffic to tell.
fn assert_lossless(n: usize, steps: &[Step]) {
    assert_eq!(steps.len(), 2 * n, "{steps:#?}");
    for s in steps {
        assert_eq!(s.kept.0, s.kept.1, "connections lost: {s:#?}");
        assert_eq!(s.kept.1, CONNECTIONS, "{s:#?}");
        assert_eq!(s.lines.1, 0, "lines lost: {s:#?}");
        assert!(
            s.lines.0 > (CONNECTIONS as u64) * 30,
            "too few lines to tell: {s:#?}"
        );
        assert_eq!(s.udp.2, 0, "a UDP flow changed backend: {s:#?}");
        assert!(
            s.gap < Duration::from_secs(5),
            "a connection waited {:?}: {s:#?}",
            s.gap
        );
    }
}

/// Three hosts announce the VIP and sync their flows over one multicast
/// group; 20 TCP connections and 8 UDP flows spread over all three by the
/// router. Each host in turn withdraws and comes back, then crashes (BIRD,
/// daemon and conntrackd killed, its conntrack table flushed) and comes
/// back: every connection goes on through every step with no line lost,
/// and every UDP flow keeps its backend. The restarted host gets every
/// flow back from the others (conntrackd's startup resync) before it
/// announces again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_synced_hosts_lose_no_connection_when_each_withdraws_or_crashes() {
    require_bgp!();
    if netns::keepalived::conntrackd_missing() {
        return;
    }
    let steps = synced_hosts("any3", 3).await;
    assert_lossless(3, &steps);
}

/// [`three_synced_hosts_lose_no_connection_when_each_withdraws_or_crashes`]
/// with two hosts on the multicast transport (the figures for N = 2).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn two_synced_hosts_over_multicast_lose_no_connection_when_each_withdraws_or_crashes() {
    require_bgp!();
    if netns::keepalived::conntrackd_missing() {
        return;
    }
    let steps = synced_hosts("any2", 2).await;
    assert_lossless(2, &steps);
}

//! The kernel table writer at scale, without the daemon: a cold sync of N
//! kernel listeners (3 backends each), a sync of the unchanged state, a
//! read of every counter (as `/metrics` does), three checks of the tables
//! against what was written (as the daemon's every 10 s), F
//! health flips (one backend out of a listener, or back), then a node's
//! failure (its backend out of every listener at once), each timed.
//!
//! Run as root in a scratch network namespace, never on a host's own
//! table (it writes `inet harvester_lb_nat` and its shards):
//!
//! ```text
//! ip netns add hlbscale
//! ip netns exec hlbscale target/release/examples/kernel_scale 10000 100
//! ip netns del hlbscale
//! ```
//!
//! `KERNEL_SCALE_JSON=1` prints the cold transaction (nft's JSON) instead,
//! for timing `nft -j -f` alone. `KERNEL_SCALE_UDP_FLOWS=N` instead times
//! the deletion of N UDP flows of a backend that left (beside N flows of
//! one that stays), created with `conntrack -R` (conntrack-tools).

// A measurement of wall time, outside tokio.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use std::net::{IpAddr, Ipv4Addr};
use std::time::Instant;

use harvester_lb::config::{Algorithm, Protocol, SourceNat};
use harvester_lb::host::nat::{Desired, KernelListener, KernelTable, TableObjects, transaction};

fn arg(i: usize, default: usize) -> usize {
    std::env::args()
        .nth(i)
        .map(|s| s.parse().expect("a number"))
        .unwrap_or(default)
}

fn main() {
    let n = arg(1, 10_000);
    let flips = arg(2, 100);
    let mut desired = Desired::new();
    for i in 0..n {
        let (a, b) = ((i / 250) as u8, (i % 250 + 1) as u8);
        let members: Vec<IpAddr> = (0..3)
            .map(|j| Ipv4Addr::new(10, 244 + j, a, b).into())
            .collect();
        desired.insert(
            (Ipv4Addr::new(10, 247, a, b).into(), Protocol::Tcp, 18090),
            KernelListener {
                backend_port: 8080,
                eligible: members.clone(),
                members,
                source_ranges: None,
                source_nat: SourceNat::Masquerade,
                close_down: Vec::new(),
                pick: Algorithm::RoundRobin,
                affinity: None,
            },
        );
    }
    if std::env::var_os("KERNEL_SCALE_JSON").is_some() {
        let t0 = Instant::now();
        let doc = transaction(&desired, &TableObjects::default());
        eprintln!("built in {:?}", t0.elapsed());
        println!("{doc}");
        return;
    }
    if let Some(flows) = std::env::var_os("KERNEL_SCALE_UDP_FLOWS") {
        udp_flows(
            flows
                .to_str()
                .and_then(|f| f.parse().ok())
                .expect("a number"),
        );
        return;
    }
    let table = KernelTable::new();
    let t0 = Instant::now();
    let cold = table.sync(&desired);
    eprintln!("cold sync of {n} listeners: {:?} ({cold:?})", t0.elapsed());
    let t0 = Instant::now();
    let again = table.sync(&desired);
    eprintln!("unchanged: {:?} ({again:?})", t0.elapsed());
    // What the daemon reads for /metrics every 5 s.
    let t0 = Instant::now();
    let counters = harvester_lb::host::nat::counters().map(|c| c.len());
    eprintln!("counters read: {:?} ({counters:?})", t0.elapsed());
    // What the daemon compares every 10 s and at each reload.
    for _ in 0..3 {
        let t0 = Instant::now();
        let checked = table.check();
        eprintln!("check: {:?} ({checked:?})", t0.elapsed());
    }
    let ids: Vec<_> = desired.keys().copied().collect();
    let mut ms = Vec::new();
    for k in 0..flips {
        let l = desired
            .get_mut(&ids[k * 7919 % ids.len()])
            .expect("a listener");
        if l.eligible.len() == l.members.len() {
            l.eligible.remove(1);
        } else {
            l.eligible = l.members.clone();
        }
        let t0 = Instant::now();
        table.sync(&desired).expect("a flip");
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    // A node fails: its backend leaves every listener in one sync.
    for l in desired.values_mut() {
        let first = l.members[0];
        l.eligible.retain(|b| *b != first);
    }
    let t0 = Instant::now();
    let down = table.sync(&desired);
    eprintln!("a node down, every listener: {:?} ({down:?})", t0.elapsed());
    let t0 = Instant::now();
    let checked = table.check();
    eprintln!("check after the flips: {:?} ({checked:?})", t0.elapsed());
    ms.sort_by(f64::total_cmp);
    if let Some(max) = ms.last() {
        let at = |q: f64| ms[((ms.len() as f64 * q) as usize).min(ms.len() - 1)];
        eprintln!(
            "{} flips: p50 {:.1} ms, p99 {:.1} ms, max {max:.1} ms",
            ms.len(),
            at(0.5),
            at(0.99)
        );
    }
}

/// N UDP flows to 10.247.0.1:53 answered by 10.244.0.1, which has left,
/// and N answered by 10.245.0.1, which stays; the sweep's time.
fn udp_flows(n: usize) {
    let mut script = String::new();
    for (backend, sport) in [("10.244.0.1", 40000), ("10.245.0.1", 40001)] {
        for i in 0..n {
            let client = format!("100.64.{}.{}", i / 250, i % 250 + 1);
            script += &format!(
                "-I -p udp -s {client} -d 10.247.0.1 --sport {sport} --dport 53 --reply-src {backend} --reply-dst {client} --reply-port-src 30053 --reply-port-dst {sport} -t 120\n"
            );
        }
    }
    let file = std::env::temp_dir().join(format!("kernel_scale_ct_{}", std::process::id()));
    std::fs::write(&file, script).expect("write the conntrack script");
    let loaded = std::process::Command::new("conntrack")
        .arg("-R")
        .arg(&file)
        .status()
        .expect("run conntrack");
    let _ = std::fs::remove_file(&file);
    assert!(loaded.success(), "conntrack -R failed");
    let members: Vec<IpAddr> = vec![
        Ipv4Addr::new(10, 244, 0, 1).into(),
        Ipv4Addr::new(10, 245, 0, 1).into(),
    ];
    let mut desired = Desired::new();
    desired.insert(
        (Ipv4Addr::new(10, 247, 0, 1).into(), Protocol::Udp, 53),
        KernelListener {
            backend_port: 30053,
            eligible: members[1..].to_vec(),
            members,
            source_ranges: None,
            source_nat: SourceNat::Masquerade,
            close_down: Vec::new(),
            pick: Algorithm::RoundRobin,
            affinity: None,
        },
    );
    let t0 = Instant::now();
    let deleted = harvester_lb::host::nat::delete_stale_flows(&desired);
    eprintln!(
        "deleted {deleted:?} of {} UDP flows in {:?}",
        2 * n,
        t0.elapsed()
    );
}

//! Micro-benchmarks of the hot-path pieces: picking a backend from the healthy
//! set under each algorithm, publishing a new healthy set while readers
//! pick, and the accept path's `source_ranges` check with 1,000 ranges.
//! `cargo bench --bench balancer`.

use std::hint::black_box;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::num::NonZeroU32;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use criterion::{BenchmarkId, Criterion, criterion_group, criterion_main};
use ipnet::IpNet;

use harvester_lb::config::{Algorithm, SourceRanges};
use harvester_lb::dataplane::balancer::{Backend, ClientAddr, LoadBalancer, Settings};
use harvester_lb::metrics::LbStats;

fn lb(algorithm: Algorithm, n: usize) -> (Arc<LoadBalancer>, Vec<Arc<Backend>>) {
    let members: Vec<Arc<Backend>> = (0..n)
        .map(|i| {
            Backend::new(
                IpAddr::V4(Ipv4Addr::new(10, 0, (i / 250) as u8, (i % 250 + 1) as u8)),
                true,
            )
        })
        .collect();
    let settings = Settings {
        algorithm,
        connect_timeout: Duration::from_secs(3),
        connect_attempts: NonZeroU32::new(3),
        idle_timeout: Duration::from_secs(3600),
        affinity_timeout: None,
        source_ranges: SourceRanges::everyone(),
        on_backend_down: Default::default(),
        log_connections: Default::default(),
        checked_ports: None,
    };
    let lb = LoadBalancer::new(
        "bench/lb".into(),
        "kubernetes".into(),
        settings,
        members.clone(),
        LbStats::detached(),
    );
    (lb, members)
}

const ALGORITHMS: [(Algorithm, &str); 3] = [
    (Algorithm::RoundRobin, "round_robin"),
    (Algorithm::LeastConnections, "least_connections"),
    (Algorithm::SourceIp, "source_ip"),
];

/// One pick as the forwarder does it: load the snapshot, take the first
/// candidate.
fn pick(c: &mut Criterion) {
    let mut g = c.benchmark_group("pick");
    for n in [3usize, 16, 100] {
        for (algorithm, name) in ALGORITHMS {
            let (lb, _members) = lb(algorithm, n);
            let mut client = 0u32;
            g.bench_with_input(BenchmarkId::new(name, n), &n, |b, _| {
                b.iter(|| {
                    client = client.wrapping_add(0x9e37_79b9);
                    let ip = ClientAddr::new((Ipv4Addr::from(client), 0).into());
                    let snap = lb.snapshot();
                    let first = snap
                        .candidates(black_box(ip), lb.cursor(), None, 30080)
                        .next();
                    black_box(first.map(|b| b.addr))
                })
            });
        }
    }
    g.finish();
}

/// A pick with `session_affinity = "client_ip"`: the table lookup, then the
/// candidates with the remembered backend first. `hit`: a client among
/// 100,000 remembered ones; `miss`: a client never seen (the lookup that
/// finds nothing, before the algorithm picks).
fn pick_with_affinity(c: &mut Criterion) {
    use harvester_lb::dataplane::balancer::AffinityBudget;
    use harvester_lb::dataplane::balancer::affinity::now_secs;
    // What an entry costs: resident memory before and after a million.
    {
        let (lb, members) = lb(Algorithm::RoundRobin, 3);
        lb.configure_affinity(true, &AffinityBudget::new(1_000_000));
        let table = lb.affinity().expect("affinity on");
        let before = rss_bytes();
        let now = now_secs();
        for k in 0..1_000_000u32 {
            let client = ClientAddr::new((Ipv4Addr::from(0x0b00_0000 + k), 0).into());
            table.remember(client, members[k as usize % 3].addr, now);
        }
        let after = rss_bytes();
        println!(
            "affinity memory: {} entries, RSS +{:.1} MiB, {:.0} bytes per entry",
            table.len(),
            (after - before) as f64 / (1 << 20) as f64,
            (after - before) as f64 / table.len() as f64
        );
    }
    let mut g = c.benchmark_group("pick_affinity");
    let timeout = Duration::from_secs(10_800);
    for n in [3usize, 16] {
        let (lb, members) = lb(Algorithm::RoundRobin, n);
        lb.configure_affinity(true, &AffinityBudget::new(1_000_000));
        let table = lb.affinity().expect("affinity on");
        let now = now_secs();
        const KNOWN: u32 = 100_000;
        for k in 0..KNOWN {
            let client = ClientAddr::new((Ipv4Addr::from(0x0a00_0000 + k), 0).into());
            table.remember(client, members[k as usize % n].addr, now);
        }
        let mut k = 0u32;
        g.bench_with_input(BenchmarkId::new("hit", n), &n, |b, _| {
            b.iter(|| {
                k = (k + 7919) % KNOWN;
                let client = ClientAddr::new((Ipv4Addr::from(0x0a00_0000 + k), 0).into());
                let sticky = table.lookup(black_box(client), timeout, now);
                let snap = lb.snapshot();
                black_box(
                    snap.candidates(client, lb.cursor(), sticky, 30080)
                        .next()
                        .map(|b| b.addr),
                )
            })
        });
        let mut m = 0u32;
        g.bench_with_input(BenchmarkId::new("miss", n), &n, |b, _| {
            b.iter(|| {
                m = m.wrapping_add(0x9e37_79b9) | 0x8000_0000;
                let client = ClientAddr::new((Ipv4Addr::from(m), 0).into());
                let sticky = table.lookup(black_box(client), timeout, now);
                let snap = lb.snapshot();
                black_box(
                    snap.candidates(client, lb.cursor(), sticky, 30080)
                        .next()
                        .map(|b| b.addr),
                )
            })
        });
    }
    g.finish();
}

/// Resident memory of this process, from `/proc/self/statm`.
fn rss_bytes() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap_or_default();
    let pages: i64 = statm
        .split_whitespace()
        .nth(1)
        .and_then(|p| p.parse().ok())
        .unwrap_or(0);
    pages * 4096
}

/// Publishing a new healthy set (one backend flips) with and without a reader
/// thread picking in a loop meanwhile, and picks while a writer publishes.
fn publish(c: &mut Criterion) {
    let mut g = c.benchmark_group("publish");
    for n in [3usize, 100] {
        let (lb, members) = lb(Algorithm::RoundRobin, n);
        let mut flip = false;
        g.bench_with_input(BenchmarkId::new("alone", n), &n, |b, _| {
            b.iter(|| {
                flip = !flip;
                members[0].set_healthy(flip);
                lb.publish();
            })
        });
        members[0].set_healthy(true);
        lb.publish();

        // A reader thread picking as fast as it can while we publish.
        let stop = Arc::new(AtomicBool::new(false));
        let picks = Arc::new(AtomicU64::new(0));
        let reader = {
            let (lb, stop, picks) = (Arc::clone(&lb), Arc::clone(&stop), Arc::clone(&picks));
            std::thread::spawn(move || {
                let ip = ClientAddr::new((Ipv4Addr::LOCALHOST, 0).into());
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) && k < 2_000_000_000 {
                    let snap = lb.snapshot();
                    black_box(
                        snap.candidates(ip, lb.cursor(), None, 30080)
                            .next()
                            .map(|b| b.addr),
                    );
                    k += 1;
                }
                picks.store(k, Ordering::Relaxed);
            })
        };
        g.bench_with_input(BenchmarkId::new("with_reader", n), &n, |b, _| {
            b.iter(|| {
                flip = !flip;
                members[0].set_healthy(flip);
                lb.publish();
            })
        });
        stop.store(true, Ordering::Relaxed);
        let _ = reader.join();
        members[0].set_healthy(true);
        lb.publish();

        // Picks while a writer thread publishes as fast as it can.
        let stop = Arc::new(AtomicBool::new(false));
        let writer = {
            let (lb, members, stop) = (Arc::clone(&lb), members.clone(), Arc::clone(&stop));
            std::thread::spawn(move || {
                let mut k = 0u64;
                while !stop.load(Ordering::Relaxed) && k < 200_000_000 {
                    members[0].set_healthy(k.is_multiple_of(2));
                    lb.publish();
                    k += 1;
                }
            })
        };
        let ip = ClientAddr::new((Ipv4Addr::LOCALHOST, 0).into());
        g.bench_with_input(BenchmarkId::new("pick_while_publishing", n), &n, |b, _| {
            b.iter(|| {
                let snap = lb.snapshot();
                black_box(
                    snap.candidates(ip, lb.cursor(), None, 30080)
                        .next()
                        .map(|b| b.addr),
                )
            })
        });
        stop.store(true, Ordering::Relaxed);
        let _ = writer.join();
    }
    g.finish();
}

/// 1,000 distinct ranges (the most one load balancer may have) spread over
/// the address space, prefixes /16 to /32, of `family` (4 or 6).
fn thousand_ranges(family: u8) -> SourceRanges {
    let nets = (0..1000u32)
        .map(|i| {
            let x = i.wrapping_mul(2_654_435_761);
            let len = (16 + i % 17) as u8;
            let net = if family == 4 {
                IpNet::new(IpAddr::V4(Ipv4Addr::from(x)), len)
            } else {
                let a = (u128::from(x) << 96) | u128::from(i);
                IpNet::new(IpAddr::V6(Ipv6Addr::from(a)), len + 16)
            };
            net.expect("valid prefix").trunc()
        })
        .collect();
    SourceRanges::new(nets)
}

/// The accept-path check of `source_ranges`: one snapshot load and a binary
/// search of the merged intervals, with 1,000 ranges, for clients inside
/// and outside them; and with no ranges (everyone) as the baseline.
fn source_ranges(c: &mut Criterion) {
    let mut g = c.benchmark_group("source_ranges");
    let clients_v4: Vec<IpAddr> = (0..1024u32)
        .map(|i| IpAddr::V4(Ipv4Addr::from(i.wrapping_mul(0x9e37_79b9))))
        .collect();
    let clients_v6: Vec<IpAddr> = (0..1024u32)
        .map(|i| {
            IpAddr::V6(Ipv6Addr::from(
                (u128::from(i.wrapping_mul(2_654_435_761)) << 96) | 7,
            ))
        })
        .collect();
    let cases = [
        ("everyone_v4", SourceRanges::everyone(), &clients_v4),
        ("1000_v4", thousand_ranges(4), &clients_v4),
        ("1000_v6", thousand_ranges(6), &clients_v6),
    ];
    for (name, ranges, clients) in cases {
        let inside = clients.iter().filter(|ip| ranges.allows(**ip)).count();
        let (lb, _members) = lb(Algorithm::RoundRobin, 3);
        let mut settings = lb.snapshot().settings.clone();
        settings.source_ranges = ranges;
        lb.replace(settings, lb.members());
        let mut k = 0usize;
        g.bench_function(BenchmarkId::new("accept_check", name), |b| {
            b.iter(|| {
                k = (k + 1) & 1023;
                let snap = lb.snapshot();
                black_box(snap.settings.source_ranges.allows(black_box(clients[k])))
            })
        });
        eprintln!("source_ranges/{name}: {inside} of 1024 clients inside");
    }
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = pick, pick_with_affinity, publish, source_ranges
}
criterion_main!(benches);

//! Scale measurement of the kernel table writer (run as root, in a scratch
//! network namespace: `ip netns exec NS target/debug/examples/kdump N`).
use harvester_lb::config::{Protocol, SourceNat};
use harvester_lb::kernel::{Desired, KernelListener, KernelTable};
use std::net::{IpAddr, Ipv4Addr};
fn main() {
    let n: usize = std::env::args().nth(1).unwrap().parse().unwrap();
    let flips: usize = std::env::args().nth(2).map(|s| s.parse().unwrap()).unwrap_or(100);
    let mut d = Desired::new();
    for i in 0..n {
        let vip = Ipv4Addr::new(10, 247, (i / 250) as u8, (i % 250 + 1) as u8);
        let be: Vec<IpAddr> = (0..3).map(|j| Ipv4Addr::new(10, 244 + j as u8, (i / 250) as u8, (i % 250 + 1) as u8).into()).collect();
        d.insert((vip.into(), Protocol::Tcp, 18090), KernelListener { backend_port: 8080, members: be.clone(), eligible: be, source_ranges: None, source_nat: SourceNat::Masquerade, close_down: vec![] });
    }
    if std::env::var_os("KDUMP_JSON").is_some() {
        let t0 = std::time::Instant::now();
        let doc = harvester_lb::kernel::transaction(&d, &harvester_lb::kernel::Owned::default());
        let text = serde_json::to_string(&doc).unwrap();
        eprintln!("built in {:?}", t0.elapsed());
        println!("{text}");
        return;
    }
    let table = KernelTable::new();
    let t0 = std::time::Instant::now();
    let r = table.sync(&d);
    eprintln!("cold sync of {n}: {:?} {:?}", t0.elapsed(), r);
    let t0 = std::time::Instant::now();
    let r = table.sync(&d);
    eprintln!("unchanged: {:?} {:?}", t0.elapsed(), r);
    let ids: Vec<_> = d.keys().copied().collect();
    let mut times = Vec::new();
    for k in 0..flips {
        let id = ids[k * 7919 % ids.len()];
        let l = d.get_mut(&id).unwrap();
        if l.eligible.len() == 3 { l.eligible.remove(1); } else { l.eligible = l.members.clone(); }
        let t0 = std::time::Instant::now();
        table.sync(&d).unwrap();
        times.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(|a, b| a.partial_cmp(b).unwrap());
    if !times.is_empty() {
        eprintln!("flips {}: p50 {:.2} ms p99 {:.2} ms max {:.2} ms", times.len(), times[times.len() / 2], times[(times.len() * 99 / 100).min(times.len() - 1)], times[times.len() - 1]);
    }
}

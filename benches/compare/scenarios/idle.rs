//! Scenario 4: idle connections. 5,000 clients connect through each proxy
//! and say nothing; the growth of the proxy's resident memory per
//! connection is what a connection costs it at rest.

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use crate::Opts;
use crate::procfs::rss_tree;
use crate::table::Results;
use crate::targets::{HTTP_PORT, Proc, Target, threads_label};
use crate::util::sa;

/// Every proxy in `procs` (each running `threads` threads) in turn; the rows
/// are "4 idle connections (N threads)". Targets without a process (direct,
/// kernel) have no memory of their own to measure and are not in `procs`.
pub fn idle_scenario(o: &Opts, res: &mut Results, procs: &mut [(Target, Proc)], threads: usize) {
    let scen = format!("4 idle connections ({})", threads_label(threads));
    let scen = scen.as_str();
    for (target, proc) in procs.iter_mut() {
        let pid = proc.pid();
        let before = rss_tree(pid);
        let addr = sa(target.ip(), HTTP_PORT);
        let mut conns = Vec::with_capacity(o.idle_conns);
        let started = Instant::now();
        for _ in 0..o.idle_conns {
            if started.elapsed() > Duration::from_secs(60) {
                break;
            }
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(c) => conns.push(c),
                Err(e) => {
                    res.fail(format!("idle: connect to {} failed: {e}", target.name()));
                    break;
                }
            }
        }
        // Let the proxy connect every one to the backend and settle.
        std::thread::sleep(Duration::from_secs(2));
        let after = rss_tree(pid);
        let opened = conns.len();
        // One request on one of them shows the proxy still forwards.
        let alive = conns.last_mut().map(|c| {
            c.set_read_timeout(Some(Duration::from_secs(5))).ok();
            let _ = c.write_all(b"GET / HTTP/1.1\r\nHost: b\r\n\r\n");
            let mut buf = [0u8; 64];
            matches!(c.read(&mut buf), Ok(n) if n > 12 && buf.starts_with(b"HTTP/1.1 200"))
        });
        drop(conns);
        let per_conn = (after as f64 - before as f64) / opened.max(1) as f64;
        eprintln!(
            "idle {} ({}): {opened} connections, RSS {:.1} -> {:.1} MiB, {per_conn:.0} B/conn, forwarding {:?}",
            target.name(),
            threads_label(threads),
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            alive
        );
        if opened < o.idle_conns || alive != Some(true) {
            res.fail(format!(
                "idle {}: opened {opened}, forwarding {alive:?}",
                target.name()
            ));
        }
        res.add(scen, "RSS B/conn", *target, per_conn);
        res.add(scen, "RSS MiB at 5k", *target, after as f64 / 1048576.0);
        // Give the proxies time to close their backend legs before the next one.
        std::thread::sleep(Duration::from_secs(2));
    }
}

//! Scenario 7k: the kernel path at scale with the real daemon (issue 20's
//! scale targets). `--scale-kernel-lbs` load balancers (10,000) of 3
//! health-checked backends, every listener `forwarding = "kernel"`, plus one
//! UDP load balancer for the flow sweep: start until every listener is in
//! the kernel, 100 health flips timed from the operator's request to the
//! kernel's own event, a reload of the unchanged file, 10,000 UDP flows of
//! a backend that left timed until the kernel has destroyed them all, and
//! the daemon's memory and CPU at rest.
//!
//! Only in the bench's own network namespace ([`crate::host::private_netns`]):
//! the VIPs are 198.19.0.0/16, one `local` route on its `lo` (the daemon's
//! `check` refuses loopback VIPs on kernel listeners), and the namespace's
//! conntrack is turned on by the daemon's NAT table.

use std::fmt::Write as _;
use std::io::{Read, Write as _};
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::os::unix::net::UnixStream;
use std::path::Path;
use std::process::{Command, Stdio};
use std::sync::mpsc::{Receiver, RecvTimeoutError, channel};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::probes::ProbeTargets;
use super::scale::scale_backend;
use crate::Opts;
use crate::procfs::{cpu_seconds_tree, rss_tree};
use crate::table::Results;
use crate::targets::{ADMIN_PORT, HLB_IP, HTTP_PORT, Target, kernel_listeners};
use crate::util::{http_body, http_get_within, sa, which};

/// Load balancer i listens on 198.19.(i / 250).(i % 250 + 1):KSCALE_PORT,
/// its backends are the proxy scale scenario's (127.244–246.x.y), served by
/// the HTTP backend on 0.0.0.0 and checked on KSCALE_PROBE_PORT.
const KSCALE_PORT: u16 = 18090;
const KSCALE_PROBE_PORT: u16 = 30998;
/// The VIPs' route: every address of it is local to the namespace's `lo`.
const VIP_NET: &str = "198.19.0.0/16";
/// Harvester's default check period, seconds.
const PERIOD: u64 = 5;
/// The UDP load balancer: its VIP past every TCP one, its two backends
/// (flows are made for both; the first one leaves).
const UDP_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 250, 1);
const UDP_BACKENDS: [Ipv4Addr; 2] = [Ipv4Addr::new(127, 248, 0, 1), Ipv4Addr::new(127, 248, 0, 2)];
const UDP_PORT: u16 = 53;
const UDP_BACKEND_PORT: u16 = 30053;
/// Flips timed: half a backend out of a listener, half the same back.
const FLIPS: usize = 100;

/// The smallest `--scale-kernel-lbs`: the flips need 50 load balancers
/// besides the warm-up one.
pub const KSCALE_MIN: usize = 100;
/// The largest `--scale-kernel-lbs`: VIPs below [`UDP_VIP`].
pub const KSCALE_MAX: usize = 50_000;

fn kvip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 19, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// The config: `n` TCP load balancers as the Harvester controller writes
/// them (see the proxy scale scenario), every listener in the kernel with
/// no source NAT (the client is on this host, as in the `kernel` target),
/// and the UDP one.
fn config(n: usize) -> String {
    let mut s = format!(
        "[admin]\nlisten = \"{HLB_IP}:{}\"\n[proxy]\nmax_connections = 2000\ndrain_timeout_seconds = 1\n",
        ADMIN_PORT + 4
    );
    let check = format!(
        "  [load_balancer.health_check]\n  port = {KSCALE_PROBE_PORT}\n  period_seconds = {PERIOD}\n  timeout_seconds = 3\n"
    );
    for i in 0..n {
        let _ = write!(
            s,
            "[[load_balancer]]\nname = \"ns-{}/svc-{i}\"\ncluster = \"guest-{}\"\nvip = \"{}\"\nbackends = [\"{}\", \"{}\", \"{}\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = {KSCALE_PORT}\n  backend_port = {HTTP_PORT}\n  forwarding = \"kernel\"\n  source_nat = \"none\"\n{check}",
            i % 50,
            i % 20,
            kvip(i),
            scale_backend(i, 0),
            scale_backend(i, 1),
            scale_backend(i, 2)
        );
    }
    let _ = write!(
        s,
        "[[load_balancer]]\nname = \"bench/udp\"\nvip = \"{UDP_VIP}\"\nbackends = [\"{}\", \"{}\"]\n  [[load_balancer.listener]]\n  name = \"dns\"\n  port = {UDP_PORT}\n  backend_port = {UDP_BACKEND_PORT}\n  protocol = \"udp\"\n  forwarding = \"kernel\"\n  source_nat = \"none\"\n{check}",
        UDP_BACKENDS[0], UDP_BACKENDS[1]
    );
    s
}

/// Notifications read line by line, each line with the instant it was
/// read ([`Watch::nf_tables`]); the reading stops when dropped.
struct Watch {
    lines: Receiver<(Instant, String)>,
    /// Tells the listening thread to stop.
    stop: std::sync::Arc<std::sync::atomic::AtomicBool>,
}

impl Watch {
    /// nf_tables' own change notifications (the multicast group `nft
    /// monitor` listens to), one line per message: `rule TABLE CHAIN ` for
    /// a rule added or deleted, `nf_tables message N` otherwise, each
    /// stamped when received. Not `nft monitor` itself: before it prints
    /// anything it lists the whole ruleset, which at 10,000 listeners in
    /// 16 tables it had not finished after 200 s here.
    fn nf_tables() -> Result<Watch, String> {
        use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};
        const NFNLGRP_NFTABLES: u32 = 7;
        let fail = |e: std::io::Error| format!("nf_tables notifications: {e}");
        let mut socket = Socket::new(NETLINK_NETFILTER).map_err(fail)?;
        socket.bind(&SocketAddr::new(0, 0)).map_err(fail)?;
        socket.add_membership(NFNLGRP_NFTABLES).map_err(fail)?;
        let sock = socket2::SockRef::from(&socket);
        // A node's failure or a start is tens of thousands of messages.
        let _ = sock.set_recv_buffer_size(64 << 20);
        sock.set_read_timeout(Some(Duration::from_millis(100)))
            .map_err(fail)?;
        let (tx, lines) = channel();
        let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
        let stopped = stop.clone();
        std::thread::spawn(move || {
            let mut buf = vec![0u8; 1 << 20];
            while !stopped.load(std::sync::atomic::Ordering::Relaxed) {
                let size = match socket.recv(&mut &mut buf[..], 0) {
                    Ok(n) => n,
                    Err(e) if e.raw_os_error() == Some(libc::ENOBUFS) => {
                        eprintln!("scale-kernel: nf_tables notifications lost (ENOBUFS)");
                        continue;
                    }
                    Err(_) => continue, // the read timeout: look at `stop`
                };
                let at = Instant::now();
                for line in nf_tables_lines(&buf[..size]) {
                    if tx.send((at, line)).is_err() {
                        return;
                    }
                }
            }
        });
        Ok(Watch { lines, stop })
    }

    /// Lines read so far, dropped.
    fn clear(&self) {
        while self.lines.try_recv().is_ok() {}
    }

    /// The instant of the first line for which `hit` holds, within `limit`.
    fn first(&self, limit: Duration, mut hit: impl FnMut(&str) -> bool) -> Option<Instant> {
        let deadline = Instant::now() + limit;
        loop {
            let left = deadline.checked_duration_since(Instant::now())?;
            match self.lines.recv_timeout(left) {
                Ok((t, line)) if hit(&line) => return Some(t),
                Ok(_) => {}
                Err(RecvTimeoutError::Timeout | RecvTimeoutError::Disconnected) => return None,
            }
        }
    }

    /// Reads lines until none came for `quiet` (at most `limit`); how many.
    fn settle(&self, quiet: Duration, limit: Duration) -> usize {
        let deadline = Instant::now() + limit;
        let mut n = 0;
        while Instant::now() < deadline {
            match self.lines.recv_timeout(quiet) {
                Ok(_) => n += 1,
                Err(_) => break,
            }
        }
        n
    }
}

impl Drop for Watch {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Relaxed);
    }
}

/// The lines of [`Watch::nf_tables`] for one datagram of notifications.
fn nf_tables_lines(mut b: &[u8]) -> Vec<String> {
    const NFT_MSG_NEWRULE: u16 = 6;
    const NFT_MSG_DELRULE: u16 = 8;
    let mut out = Vec::new();
    while b.len() >= 20 {
        let len = u32::from_ne_bytes(b[..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes([b[4], b[5]]);
        if len < 20 || len > b.len() {
            break;
        }
        let msg = kind & 0xff;
        if kind >> 8 == 10 && (msg == NFT_MSG_NEWRULE || msg == NFT_MSG_DELRULE) {
            let (mut table, mut chain) = (String::new(), String::new());
            let mut a = &b[20..len];
            while a.len() >= 4 {
                let alen = u16::from_ne_bytes([a[0], a[1]]) as usize;
                let akind = u16::from_ne_bytes([a[2], a[3]]) & 0x7fff;
                if alen < 4 || alen > a.len() {
                    break;
                }
                let text = || {
                    let v = &a[4..alen];
                    String::from_utf8_lossy(v.split(|&c| c == 0).next().unwrap_or(v)).into_owned()
                };
                match akind {
                    1 => table = text(), // NFTA_RULE_TABLE
                    2 => chain = text(), // NFTA_RULE_CHAIN
                    _ => {}
                }
                a = &a[alen.next_multiple_of(4).min(a.len())..];
            }
            out.push(format!("rule {table} {chain} "));
        } else {
            out.push(format!("nf_tables message {kind:#x}"));
        }
        b = &b[len.next_multiple_of(4).min(b.len())..];
    }
    out
}

/// The `local` route of the VIPs on `lo`; deleted when dropped.
struct VipRoute;

impl VipRoute {
    fn add() -> Result<VipRoute, String> {
        let out = Command::new("ip")
            .args(["route", "add", "local", VIP_NET, "dev", "lo"])
            .output()
            .map_err(|e| format!("ip: {e}"))?;
        if !out.status.success() {
            return Err(format!(
                "ip route add local {VIP_NET} dev lo: {}",
                String::from_utf8_lossy(&out.stderr).trim()
            ));
        }
        Ok(VipRoute)
    }
}

impl Drop for VipRoute {
    fn drop(&mut self) {
        let _ = Command::new("ip")
            .args(["route", "del", "local", VIP_NET, "dev", "lo"])
            .status();
    }
}

/// `POST /backends/state` on the daemon's admin socket; Err with the
/// answer when it is not 200.
fn set_state(socket: &Path, lb: &str, backend: Ipv4Addr, state: &str) -> Result<(), String> {
    let body =
        json!({"load_balancer": lb, "backend": backend.to_string(), "state": state}).to_string();
    let mut s = UnixStream::connect(socket).map_err(|e| format!("{}: {e}", socket.display()))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "POST /backends/state HTTP/1.1\r\nHost: bench\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
    .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    if out.starts_with("HTTP/1.1 200") {
        Ok(())
    } else {
        Err(format!("{state} {backend} of {lb}: {}", out.trim()))
    }
}

/// `POST /reload` on the TCP admin port: the same reload as SIGHUP, answered
/// when it is done. Err with the answer when it is not 200.
fn reload(admin: SocketAddr) -> Result<String, String> {
    let mut s =
        TcpStream::connect_timeout(&admin, Duration::from_secs(2)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(60)))
        .map_err(|e| e.to_string())?;
    write!(
        s,
        "POST /reload HTTP/1.1\r\nHost: bench\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    )
    .map_err(|e| e.to_string())?;
    let mut out = String::new();
    s.read_to_string(&mut out).map_err(|e| e.to_string())?;
    let body = out
        .split_once("\r\n\r\n")
        .map_or("", |(_, b)| b)
        .trim()
        .to_string();
    if out.starts_with("HTTP/1.1 200") {
        Ok(body)
    } else {
        Err(out.trim().to_string())
    }
}

/// The successful kernel writes `/metrics` counts so far.
fn kernel_syncs(admin: SocketAddr) -> Option<f64> {
    let resp = http_get_within(admin, "/metrics", Duration::from_secs(120)).ok()?;
    let body = http_body(&resp)?;
    body.lines()
        .filter(|l| l.starts_with("harvester_lb_kernel_syncs_total") && l.contains("success"))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .reduce(|a, b| a + b)
}

/// The kernel write counter once it is at least `at_least` (None: once two
/// readings 1 s apart agree), or its last reading after 20 s.
fn wait_writes(admin: SocketAddr, at_least: Option<f64>) -> Option<f64> {
    let deadline = Instant::now() + Duration::from_secs(20);
    let mut last = kernel_syncs(admin);
    while Instant::now() < deadline {
        if let (Some(want), Some(now)) = (at_least, last)
            && now >= want
        {
            break;
        }
        std::thread::sleep(Duration::from_millis(if at_least.is_some() {
            50
        } else {
            1000
        }));
        let now = kernel_syncs(admin);
        if at_least.is_none() && now == last && now.is_some() {
            break;
        }
        last = now;
    }
    last
}

/// A `GET /healthz` round trip after a `/metrics` scrape: the daemon (one
/// runtime thread here) answers it only once it has finished with the
/// scrape (at 10,000 load balancers, freeing the exposition took ~5 ms
/// after its last byte), so the next flip is timed on a daemon at rest,
/// not behind the bench's own scrape.
fn settle_admin(admin: SocketAddr) {
    let _ = http_get_within(admin, "/healthz", Duration::from_secs(5));
}

/// One GET / through the VIP of load balancer `i`: whether it answered 200.
fn through(i: usize) -> Result<(), String> {
    let addr = sa(kvip(i), KSCALE_PORT);
    let resp =
        http_get_within(addr, "/", Duration::from_secs(5)).map_err(|e| format!("{addr}: {e}"))?;
    http_body(&resp)
        .map(|_| ())
        .ok_or_else(|| format!("{addr}: {}", resp.lines().next().unwrap_or("no answer")))
}

fn quantile(sorted: &[f64], q: f64) -> f64 {
    sorted[((sorted.len() as f64 * q) as usize).min(sorted.len() - 1)]
}

/// Scale, kernel path: see the module's header.
pub fn kscale_scenario(o: &Opts, res: &mut Results, netns: bool) {
    let n = o.scale_kernel_lbs;
    let scen = format!("7k scale, kernel ({n} LBs × 3 backends)");
    let scen = scen.as_str();
    let t = Target::HlbKernel;
    let missing: Vec<&str> = ["nft", "conntrack", "ip"]
        .into_iter()
        .filter(|c| !which(c))
        .collect();
    if !netns || !missing.is_empty() {
        eprintln!(
            "note: no scale-kernel scenario: {}",
            if netns {
                format!("missing {}", missing.join(", "))
            } else {
                "not in the bench's own network namespace (needs root)".into()
            }
        );
        return;
    }
    res.commands.insert(
        "scale-kernel".into(),
        format!(
            "{n} load balancers x 3 backends, forwarding = \"kernel\", checked every {PERIOD} s, + 1 UDP: harvester-lb run with its default threads (one per core); flips by POST /backends/state (admin socket), seen by nf_tables' notifications (nft monitor's source); reload by POST /reload; UDP flows by conntrack -R, deletions seen by conntrack -E"
        ),
    );
    let route = match VipRoute::add() {
        Ok(r) => r,
        Err(e) => return res.fail(format!("scale-kernel: {e}")),
    };
    // Probes are TCP connections in conntrack once the NAT table exists:
    // 6,000/s would pass nf_conntrack_max within TIME_WAIT's 120 s.
    let _ct = crate::host::conntrack_room();
    let _targets = ProbeTargets::loopback(KSCALE_PROBE_PORT);
    let admin = sa(HLB_IP, ADMIN_PORT + 4);
    let socket = o.work.join("hlb-kscale.sock");
    let mut extra = serde_json::Map::new();
    extra.insert("load_balancers".into(), json!(n));
    // The daemon's own default: one runtime thread per core. (With one
    // thread, a flip's admin request waits out the thread's chunks of
    // probe work, 6,000 probes/s here: up to ~7 ms.)
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    extra.insert("threads".into(), json!(threads));

    // Start: spawn → /readyz → every listener "forwarding": "kernel" in
    // /status (then with an eligible backend), and the table read back.
    let t0 = Instant::now();
    let mut proc = o.hlb().start("hlb-kscale", &config(n), admin, threads);
    let ready_s = t0.elapsed().as_secs_f64();
    let (mut in_kernel_s, mut eligible_s, mut seen) = (None, None, (0, 0, 0));
    let deadline = Instant::now() + Duration::from_secs(120);
    while Instant::now() < deadline && eligible_s.is_none() {
        if let Ok(r) = http_get_within(admin, "/status", Duration::from_secs(60))
            && let Some(body) = http_body(&r)
        {
            seen = kernel_listeners(&body);
            let (total, kernel, eligible) = seen;
            if total == n + 1 && kernel == total && in_kernel_s.is_none() {
                in_kernel_s = Some(t0.elapsed().as_secs_f64());
            }
            if total == n + 1 && eligible == total {
                eligible_s = Some(t0.elapsed().as_secs_f64());
            }
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    let (Some(in_kernel_s), Some(eligible_s)) = (in_kernel_s, eligible_s) else {
        let (total, kernel, eligible) = seen;
        return res.fail(format!(
            "scale-kernel: after 120 s /status has {total} listeners of {}, {kernel} forwarded by the kernel, {eligible} of those with an eligible backend",
            n + 1
        ));
    };
    let chains = Command::new("nft")
        .args(["list", "ruleset"]) // every shard's table
        .output()
        .map(|o| {
            String::from_utf8_lossy(&o.stdout)
                .lines()
                .filter(|l| l.trim_start().starts_with("chain l_"))
                .count()
        })
        .unwrap_or(0);
    eprintln!(
        "scale-kernel: /readyz in {ready_s:.2} s; all {} listeners forwarding = kernel in /status at {in_kernel_s:.2} s, each with an eligible backend at {eligible_s:.2} s; {chains} listener chains in the tables",
        n + 1
    );
    if chains != n + 1 {
        res.fail(format!(
            "scale-kernel: the tables have {chains} listener chains, not {}",
            n + 1
        ));
    }
    res.add(scen, "start → /readyz s", t, ready_s);
    res.add(
        scen,
        "start → all listeners kernel in /status s",
        t,
        in_kernel_s,
    );
    res.add(
        scen,
        "start → all with an eligible backend s",
        t,
        eligible_s,
    );
    res.add(scen, "listener chains in the table", t, chains as f64);
    // A sample of VIPs forwards.
    let sample: Vec<usize> = (0..8).map(|k| k * 1237 % n).collect();
    let mut ok = 0;
    for &i in &sample {
        match through(i) {
            Ok(()) => ok += 1,
            Err(e) => res.fail(format!("scale-kernel: GET / through {}: {e}", kvip(i))),
        }
    }
    res.add(scen, "sample GETs through VIPs ok", t, ok as f64);
    extra.insert(
        "start".into(),
        json!({"readyz_s": ready_s, "all_kernel_s": in_kernel_s, "all_eligible_s": eligible_s,
               "listener_chains": chains, "sample_vips": sample.iter().map(|&i| kvip(i).to_string()).collect::<Vec<_>>(),
               "sample_ok": ok}),
    );

    // At rest: two check periods and more (the counters and conntrack are
    // read every 5 s), then RSS and CPU over a window.
    std::thread::sleep(Duration::from_secs(2 * PERIOD));
    let rss = rss_tree(proc.pid());
    let window = Duration::from_secs(o.scale_window);
    let cpu0 = cpu_seconds_tree(proc.pid());
    let w0 = Instant::now();
    std::thread::sleep(window);
    let cpu_s = cpu_seconds_tree(proc.pid()) - cpu0;
    let wall = w0.elapsed().as_secs_f64();
    let cpu_pct = cpu_s * 100.0 / wall;
    eprintln!(
        "scale-kernel: at rest RSS {:.1} MiB, CPU {cpu_pct:.1} % of one core over {wall:.0} s",
        rss as f64 / 1048576.0
    );
    res.add(scen, "RSS MiB at rest", t, rss as f64 / 1048576.0);
    res.add(scen, "CPU % of one core at rest", t, cpu_pct);
    extra.insert(
        "at_rest".into(),
        json!({"rss_bytes": rss, "cpu_s": cpu_s, "window_s": wall, "cpu_percent_of_one_core": cpu_pct}),
    );

    // Flips: the operator's drain (deterministic; the same publish and
    // kernel write as a health verdict), timed from the request's send to
    // the first notification of the listener's chain that nf_tables sends
    // (what `nft monitor` prints).
    let monitor = match Watch::nf_tables() {
        Ok(m) => m,
        Err(e) => return res.fail(format!("scale-kernel: {e}")),
    };
    let chain_of = |i: usize| format!(" l_tcp_{KSCALE_PORT}_{} ", kvip(i));
    // Warm-up flips (not counted), a backend of the last load balancer out
    // and back until a notification shows one: it listens from then on.
    let warm = n - 1;
    let warm_lb = format!("ns-{}/svc-{warm}", warm % 50);
    let mut warm_seen = false;
    for k in 0..30 {
        let state = if k % 2 == 0 { "drain" } else { "ready" };
        if let Err(e) = set_state(&socket, &warm_lb, scale_backend(warm, 1), state) {
            return res.fail(format!("scale-kernel: warm-up flip: {e}"));
        }
        if monitor
            .first(Duration::from_secs(1), |l| l.contains(&chain_of(warm)))
            .is_some()
        {
            warm_seen = true;
            break;
        }
    }
    if !warm_seen {
        return res.fail("scale-kernel: nf_tables notified none of 30 warm-up flips".into());
    }
    monitor.settle(Duration::from_millis(200), Duration::from_secs(5));
    let mut writes = wait_writes(admin, None);
    settle_admin(admin);
    let mut ms = Vec::new();
    // When the admin request was answered (the state set, the publish done).
    let mut answered = Vec::new();
    // Distinct, spread over the load balancers, never the warm-up one.
    let lbs: Vec<usize> = (0..FLIPS / 2).map(|k| k * (n - 1) / (FLIPS / 2)).collect();
    for (k, state) in (0..FLIPS).map(|k| (k, if k < FLIPS / 2 { "drain" } else { "ready" })) {
        let i = lbs[k % lbs.len()];
        monitor.clear();
        let t0 = Instant::now();
        if let Err(e) = set_state(
            &socket,
            &format!("ns-{}/svc-{i}", i % 50),
            scale_backend(i, 1),
            state,
        ) {
            res.fail(format!("scale-kernel: flip {k}: {e}"));
            continue;
        }
        answered.push(t0.elapsed().as_secs_f64() * 1e3);
        match monitor.first(Duration::from_secs(10), |l| l.contains(&chain_of(i))) {
            Some(at) => ms.push(at.duration_since(t0).as_secs_f64() * 1e3),
            None => res.fail(format!(
                "scale-kernel: flip {k} ({state} of {i}) not in the kernel after 10 s"
            )),
        }
        // The next flip starts once this one's write is done, sweep of
        // conntrack included (the write counter moved): each flip is timed
        // on an idle writer, as the writer-alone figures are.
        writes = wait_writes(admin, writes.map(|w| w + 1.0));
        settle_admin(admin);
        monitor.clear();
    }
    ms.sort_by(f64::total_cmp);
    if !ms.is_empty() {
        let (p50, p99, max) = (quantile(&ms, 0.5), quantile(&ms, 0.99), ms[ms.len() - 1]);
        answered.sort_by(f64::total_cmp);
        eprintln!(
            "scale-kernel: {} flips, request → kernel: p50 {p50:.1} ms, p99 {p99:.1} ms, max {max:.1} ms; the request answered at p50 {:.1} ms, p99 {:.1} ms",
            ms.len(),
            quantile(&answered, 0.5),
            quantile(&answered, 0.99)
        );
        res.add(scen, "flip request → kernel ms (p50)", t, p50);
        res.add(scen, "flip request → kernel ms (p99)", t, p99);
        res.add(scen, "flip request → kernel ms (max)", t, max);
        extra.insert("flips".into(), json!({"count": ms.len(), "sorted_ms": ms, "p50_ms": p50, "p99_ms": p99, "max_ms": max, "answered_sorted_ms": answered}));
    }

    // Reload of the unchanged file: POST /reload answers when it is done;
    // the kernel table must see no event and the write counter not move.
    let syncs0 = wait_writes(admin, None);
    monitor.clear();
    let r0 = Instant::now();
    let reloaded = reload(admin);
    let reload_ms = r0.elapsed().as_secs_f64() * 1e3;
    let events = monitor.settle(Duration::from_secs(2), Duration::from_secs(5));
    let syncs1 = kernel_syncs(admin);
    match &reloaded {
        Ok(body) => eprintln!(
            "scale-kernel: reload of the unchanged file {reload_ms:.1} ms ({body}); {events} nft events after it; kernel writes {syncs0:?} → {syncs1:?}"
        ),
        Err(e) => res.fail(format!("scale-kernel: reload: {e}")),
    }
    if events > 0 || syncs0 != syncs1 || syncs0.is_none() {
        res.fail(format!(
            "scale-kernel: the unchanged reload wrote to the kernel ({events} nft events, writes {syncs0:?} → {syncs1:?})"
        ));
    }
    res.add(scen, "reload, unchanged file ms", t, reload_ms);
    res.add(scen, "reload: nft events", t, events as f64);
    extra.insert(
        "reload".into(),
        json!({"ms": reload_ms, "answer": reloaded.ok(), "nft_events": events,
               "kernel_syncs_ok_before": syncs0, "kernel_syncs_ok_after": syncs1}),
    );
    drop(monitor);

    // UDP: `flows` flows of each backend of the UDP load balancer; the
    // first backend drained; time until conntrack lists none of its flows.
    let flows = o.scale_kernel_lbs.clamp(1, 10_000);
    match udp_sweep(o, &socket, flows) {
        Ok(u) => {
            eprintln!(
                "scale-kernel: {flows} UDP flows of a drained backend gone by {:.0} ms (still there in a listing started at {:.0} ms; {} listings); {} of the other backend's {flows} kept",
                u.gone_by_ms, u.after_ms, u.listings, u.kept
            );
            res.add(scen, "UDP flows of a backend gone by ms", t, u.gone_by_ms);
            res.add(scen, "UDP flows: last seen at ms", t, u.after_ms);
            res.add(scen, "UDP flows deleted", t, flows as f64);
            extra.insert(
                "udp".into(),
                json!({"flows": flows, "gone_by_ms": u.gone_by_ms, "last_seen_at_ms": u.after_ms,
                       "listings": u.listings, "other_backend_kept": u.kept}),
            );
            if u.kept != flows {
                res.fail(format!(
                    "scale-kernel: {} of {flows} flows of the backend that stayed are left",
                    u.kept
                ));
            }
        }
        Err(e) => res.fail(format!("scale-kernel: UDP flows: {e}")),
    }
    if !proc.alive() {
        res.fail("scale-kernel: harvester-lb exited during the run".into());
    }
    drop(proc);
    drop(route);
    res.extra
        .insert("scale_kernel".into(), Value::Object(extra));
}

/// Flows as `examples/kernel_scale.rs` makes them (`conntrack -R`), for
/// both UDP backends; the first drained; how long until a `conntrack -L` of
/// its flows finds none, as (the end of the first empty listing, the start
/// of the last non-empty one), ms after the drain was sent, with how many
/// listings it took; and how many of the second's flows are left.
///
/// Polled, not `conntrack -E`: 10,000 DESTROY events at once overflow
/// its socket (ENOBUFS, events lost) even with a 64 MiB buffer. A listing
/// dumps the namespace's whole table, so the bounds are as far apart as
/// one listing takes.
fn udp_sweep(o: &Opts, socket: &Path, n: usize) -> Result<UdpSweep, String> {
    let mut script = String::new();
    for (b, sport) in [(UDP_BACKENDS[0], 40000), (UDP_BACKENDS[1], 40001)] {
        for i in 0..n {
            let client = format!("100.64.{}.{}", i / 250, i % 250 + 1);
            let _ = writeln!(
                script,
                "-I -p udp -s {client} -d {UDP_VIP} --sport {sport} --dport {UDP_PORT} --reply-src {b} --reply-dst {client} --reply-port-src {UDP_BACKEND_PORT} --reply-port-dst {sport} -t 300"
            );
        }
    }
    let file = o.work.join("kscale-flows.ct");
    std::fs::write(&file, script).map_err(|e| e.to_string())?;
    let st = Command::new("conntrack")
        .arg("-R")
        .arg(&file)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map_err(|e| e.to_string())?;
    if !st.success() {
        return Err("conntrack -R refused the flows".into());
    }
    let count = |b: Ipv4Addr| -> usize {
        Command::new("conntrack")
            .args(["-L", "-p", "udp", "--reply-src", &b.to_string()])
            .stderr(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).lines().count())
            .unwrap_or(0)
    };
    let made = count(UDP_BACKENDS[0]);
    if made != n {
        return Err(format!(
            "{made} flows of {} in conntrack, not {n}",
            UDP_BACKENDS[0]
        ));
    }
    let t0 = Instant::now();
    set_state(socket, "bench/udp", UDP_BACKENDS[0], "drain")?;
    let mut last_nonempty_start = 0.0;
    let mut listings = 0;
    let deadline = t0 + Duration::from_secs(30);
    while Instant::now() < deadline {
        let start = t0.elapsed().as_secs_f64() * 1e3;
        let left = count(UDP_BACKENDS[0]);
        listings += 1;
        if left == 0 {
            return Ok(UdpSweep {
                gone_by_ms: t0.elapsed().as_secs_f64() * 1e3,
                after_ms: last_nonempty_start,
                listings,
                kept: count(UDP_BACKENDS[1]),
            });
        }
        last_nonempty_start = start;
    }
    Err(format!(
        "after 30 s, {} flows of {} are left in conntrack",
        count(UDP_BACKENDS[0]),
        UDP_BACKENDS[0]
    ))
}

/// What [`udp_sweep`] saw.
struct UdpSweep {
    /// The end of the first listing with none left, ms after the drain.
    gone_by_ms: f64,
    /// The start of the last listing with some left (0: the first was empty).
    after_ms: f64,
    listings: usize,
    /// The other backend's flows left.
    kept: usize,
}

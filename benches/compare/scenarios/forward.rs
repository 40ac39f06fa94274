//! The forward topology (`--only forward`): traffic the way it goes on a
//! Harvester host, where the load balancer is a router between the
//! clients and the backend VMs, rather than the loopback path of the other
//! scenarios (client, proxy and backend on one `lo`, the kernel targets'
//! DNAT in the `output` hook).
//!
//! ```text
//!  client netns            the bench's netns: the LB host           backend netns
//!  wrk ── eth0 198.19.1.2 ── fwdc0 198.19.1.1   fwdb0 198.19.2.1 ── eth0 198.19.2.2 (HTTP backend)
//!        default via .1.1    ip_forward = 1, VIPs on lo              default via .2.1
//! ```
//!
//! The client reaches each target from a source address of its own
//! (`198.19.1.10` upwards, by a route with `src`; see [`client_src`]), so
//! no target's run inherits another's `TIME_WAIT` sockets at the backend.
//!
//! The kernel targets' packets go through `prerouting` (DNAT) and
//! `forward`; direct routing (the client to the backend's own address) is
//! forwarded with no NAT; HAProxy and harvester-lb take the connection on
//! the LB host (`input`) and open their own to the backend (`output`).
//! Every target runs with connection tracking in the LB host's namespace
//! on and off, in the same rounds:
//! - **on**: a table `ip hlb_bench_ct` with `ct state established,related
//!   accept; ct state invalid drop` in an `input` and a `forward` chain, as
//!   kube-proxy's KUBE-FORWARD and a host firewall have them on a
//!   Harvester host: every packet of every target is tracked and passes
//!   those two rules.
//! - **off**: nothing in the namespace uses conntrack, so it does not run
//!   for direct, HAProxy and harvester-lb (checked after each run in
//!   `/proc/net/nf_conntrack`: entries to their address added by the run
//!   fail it, as does a tracked run that left none). The kernel targets cannot be untracked
//!   (NAT is conntrack's), so for them "off" is their own table alone.
//!
//! The client and backend namespaces never track. They are unnamed, each
//! held by a `sleep` of ours, so they and the veth pairs go when it is
//! stopped (on drop, on a signal, and with the bench's own namespace).

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::proxy_cpu;
use super::wrk::{wrk_args, wrk_run};
use crate::Opts;
use crate::host::{
    CtErrors, DaemonOn, KernelOn, SysctlGuard, conntrack_count, conntrack_time_wait, nft_table,
    tracked_to,
};
use crate::order::run_order;
use crate::procfs::cpu_seconds_tree;
use crate::table::Results;
use crate::targets::{
    ADMIN_PORT, HLB_KERNEL_IP, HTTP_PORT, KERNEL_IP, Proc, Target, haproxy_config_at,
    hlb_config_to, hlb_kernel_config_to, threads_label,
};
use crate::util::{sa, wait_http_ok, wait_port};

/// The client's address, and the LB host's on the client's link.
const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 2);
const LB_CLIENT_SIDE: Ipv4Addr = Ipv4Addr::new(198, 19, 1, 1);
/// The client's source address towards each target (see [`client_src`]):
/// `198.19.1.10` upwards, in [`TARGETS`]' order.
const CLIENT_SRC_BASE: u8 = 10;
/// The backend's address, and the LB host's on the backend's link.
const BACKEND: Ipv4Addr = Ipv4Addr::new(198, 19, 2, 2);
const LB_BACKEND_SIDE: Ipv4Addr = Ipv4Addr::new(198, 19, 2, 1);
/// The proxies' VIPs here, on the LB host's `lo` (the kernel targets keep
/// theirs, [`KERNEL_IP`] and [`HLB_KERNEL_IP`], already there).
const HLB_VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 12);
const HAPROXY_VIP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 13);

/// The targets of this topology, in the order `run_order` permutes.
const TARGETS: [Target; 5] = [
    Target::Direct,
    Target::Kernel,
    Target::HlbKernel,
    Target::Hlb,
    Target::Haproxy,
];

/// The kernel target's table here: the one-rule DNAT, as kube-proxy's
/// nftables mode writes a Service for traffic from off the node
/// (`prerouting`, dstnat) and, for the bench's own readiness check, from
/// the node itself (`output`).
const KERNEL_TABLE: &str = "hlb_bench_fwd";
/// The "conntrack on" table (see the module doc).
const CT_TABLE: &str = "hlb_bench_ct";

fn kernel_ruleset() -> String {
    let rule = format!("ip daddr {KERNEL_IP} tcp dport {HTTP_PORT} dnat to {BACKEND}");
    format!(
        "table ip {KERNEL_TABLE} {{\n  chain pre {{\n    type nat hook prerouting priority -100; policy accept;\n    {rule}\n  }}\n  chain out {{\n    type nat hook output priority -100; policy accept;\n    {rule}\n  }}\n}}\n"
    )
}

fn ct_ruleset() -> String {
    let rules = "ct state established,related accept\n    ct state invalid drop";
    format!(
        "table ip {CT_TABLE} {{\n  chain input {{\n    type filter hook input priority 0; policy accept;\n    {rules}\n  }}\n  chain forward {{\n    type filter hook forward priority 0; policy accept;\n    {rules}\n  }}\n}}\n"
    )
}

/// The client's own source address towards `t`: one per target, so that
/// no two targets share a TCP 4-tuple at the backend or a conntrack reply
/// tuple on the LB host.
///
/// With one client address, the backend's `TIME_WAIT` sockets (60 s, the
/// backend closes first) are keyed by the client's address and port alone
/// for every NAT target (direct, kernel, harvester-lb (kernel)), while the
/// client's SYN timestamps carry a random offset per destination and port
/// (kernel 6.18): a target whose run came within 60 s of another's found
/// the other's sockets on most ports, and PAWS rejected about half of its
/// SYNs on them (the backend's `PAWSTimewait`; the client answers the
/// `TIME_WAIT` socket's ACK with a RST and sends its SYN again about 10 ms
/// later). Measured on 3 runs in a row: the first NAT target 0 rejects,
/// the second and third 20–32 % of their connections: a tax set by the
/// run order, not by the target. With conntrack on, a direct run right
/// after the kernel targets also counted conntrack insert failures (121 in
/// one run; its flows' tuples are their flows' reply tuples on the same
/// client port); none with a source per target.
fn client_src(t: Target) -> Ipv4Addr {
    let i = TARGETS.iter().position(|x| *x == t).unwrap_or(0) as u8;
    Ipv4Addr::new(198, 19, 1, CLIENT_SRC_BASE + i)
}

/// Where a target is reached from the client.
fn vip(t: Target) -> Ipv4Addr {
    match t {
        Target::Direct => BACKEND,
        Target::Kernel => KERNEL_IP,
        Target::HlbKernel => HLB_KERNEL_IP,
        Target::Hlb => HLB_VIP,
        _ => HAPROXY_VIP,
    }
}

/// An unnamed network namespace held by a `sleep` of ours.
struct Netns {
    holder: Proc,
}

impl Netns {
    fn new(o: &Opts, name: &str) -> Result<Netns, String> {
        let holder = Proc::spawn(
            name,
            Command::new("unshare").args(["--net", "sleep", "1000000"]),
            &o.work.join(format!("{name}.log")),
        );
        let ns = |pid: &str| std::fs::read_link(format!("/proc/{pid}/ns/net")).ok();
        let ours = ns("self");
        let pid = holder.pid().to_string();
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline {
            if let Some(theirs) = ns(&pid)
                && Some(&theirs) != ours.as_ref()
            {
                return Ok(Netns { holder });
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        Err(format!("{name}: unshare --net made no namespace in 10 s"))
    }

    fn path(&self) -> String {
        format!("/proc/{}/ns/net", self.holder.pid())
    }

    /// A TCP counter of this namespace's `/proc/net/netstat` (`TcpExt`),
    /// e.g. `TCPSynRetrans`; `None` when it cannot be read.
    fn tcp_ext(&self, name: &str) -> Option<u64> {
        let out = self.cmd("cat").arg("/proc/net/netstat").output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout);
        let mut lines = text.lines().filter(|l| l.starts_with("TcpExt:"));
        let (names, values) = (lines.next()?, lines.next()?);
        let i = names.split_whitespace().position(|n| n == name)?;
        values.split_whitespace().nth(i)?.parse().ok()
    }

    /// `prog` to be run in this namespace.
    fn cmd(&self, prog: impl AsRef<std::ffi::OsStr>) -> Command {
        let mut c = Command::new("nsenter");
        c.arg(format!("--net={}", self.path())).arg(prog);
        c
    }

    fn ip(&self, args: &str) -> Result<(), String> {
        run(self.cmd("ip").args(args.split_whitespace()))
    }

    /// Whether a TCP connection from here to `addr` completes within
    /// `limit` (bash's /dev/tcp: no other tool needed in the namespace).
    fn connects(&self, ip: Ipv4Addr, port: u16, limit: Duration) -> bool {
        let deadline = Instant::now() + limit;
        while Instant::now() < deadline {
            let ok = self
                .cmd("timeout")
                .args(["2", "bash", "-c", &format!("exec 3<>/dev/tcp/{ip}/{port}")])
                .stderr(std::process::Stdio::null())
                .status()
                .is_ok_and(|s| s.success());
            if ok {
                return true;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        false
    }
}

fn run(cmd: &mut Command) -> Result<(), String> {
    let out = cmd.output().map_err(|e| format!("{cmd:?}: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "{cmd:?}: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

fn ip(args: &str) -> Result<(), String> {
    run(Command::new("ip").args(args.split_whitespace()))
}

/// The topology in force: both namespaces (their veth pairs go with them)
/// and the backend serving in its own.
struct Topology {
    client: Netns,
    // Dropped before the namespace's holder (fields drop in order).
    _backend_server: Proc,
    backend: Netns,
}

fn topology(o: &Opts) -> Result<Topology, String> {
    let client = Netns::new(o, "fwd-client-netns")?;
    let backend = Netns::new(o, "fwd-backend-netns")?;
    for (ns, lb_dev, lb_ip, ns_ip) in [
        (&client, "fwdc0", LB_CLIENT_SIDE, CLIENT_IP),
        (&backend, "fwdb0", LB_BACKEND_SIDE, BACKEND),
    ] {
        ip(&format!(
            "link add {lb_dev} type veth peer name eth0 netns {}",
            ns.holder.pid()
        ))?;
        ip(&format!("addr add {lb_ip}/24 dev {lb_dev}"))?;
        ip(&format!("link set {lb_dev} up"))?;
        ns.ip("link set lo up")?;
        ns.ip(&format!("addr add {ns_ip}/24 dev eth0"))?;
        ns.ip("link set eth0 up")?;
        ns.ip(&format!("route add default via {lb_ip}"))?;
    }
    for vip in [HLB_VIP, HAPROXY_VIP] {
        ip(&format!("addr add {vip}/32 dev lo"))?;
    }
    // One source address per target (see `client_src`), chosen by the
    // client's route to the target, so wrk needs no option for it.
    for t in TARGETS {
        let src = client_src(t);
        client.ip(&format!("addr add {src}/24 dev eth0"))?;
        client.ip(&format!(
            "route add {}/32 via {LB_CLIENT_SIDE} src {src}",
            vip(t)
        ))?;
    }
    let exe = std::env::current_exe().map_err(|e| format!("current exe: {e}"))?;
    let server = Proc::spawn(
        "fwd-http-backend",
        backend
            .cmd(exe)
            .args(["--serve-http", &sa(BACKEND, HTTP_PORT).to_string()]),
        &o.work.join("fwd-http-backend.log"),
    );
    if !client.connects(BACKEND, HTTP_PORT, Duration::from_secs(20)) {
        return Err(format!(
            "the client namespace does not reach the backend {BACKEND}:{HTTP_PORT} through the LB host"
        ));
    }
    Ok(Topology {
        client,
        _backend_server: server,
        backend,
    })
}

/// A kernel target put in force for one run, with its daemon's pid (the
/// daemon's own CPU over the run is a row of its own).
fn kernel_on(o: &Opts, t: Target) -> Option<Result<(KernelOn, Option<i32>), String>> {
    match t {
        Target::Kernel => Some(
            nft_table(KERNEL_TABLE, &kernel_ruleset())
                .map(|on| (KernelOn::Table { _on: on }, None)),
        ),
        Target::HlbKernel => Some(
            o.hlb()
                .start_kernel(
                    "fwd-hlb-kernel",
                    &hlb_kernel_config_to(&[("http", HTTP_PORT, "tcp")], HTTP_PORT, BACKEND),
                )
                .map(|p| {
                    let pid = p.pid();
                    (
                        KernelOn::Daemon {
                            _on: DaemonOn::new(p),
                        },
                        Some(pid),
                    )
                }),
        ),
        _ => None,
    }
}

/// What a reader of the forward rows needs (printed under the table).
pub const NOTES: &str = "5 forward: the client in a network namespace of its own, the bench's namespace as the LB host routing (ip_forward), the backend in a third namespace; the kernel targets DNAT in prerouting and their packets cross forward (the notes above on the output hook are the loopback scenarios'). conntrack on: a table with `ct state established,related accept; ct state invalid drop` in input and forward; off: nothing in the LB host's namespace uses conntrack (the kernel targets' own NAT still does). daemon CPU: harvester-lb (kernel)'s daemon over the run (health checks, the readings every 5 s), per request.\n";

fn loadavg() -> String {
    std::fs::read_to_string("/proc/loadavg")
        .map(|s| s.split_whitespace().take(3).collect::<Vec<_>>().join(" "))
        .unwrap_or_default()
}

/// Waits (10 s at most) until conntrack holds fewer than `n` entries, so
/// every run starts on a table of about the same size rather than on the
/// previous run's TIME_WAIT entries.
fn settle_conntrack(n: u64) {
    let deadline = Instant::now() + Duration::from_secs(10);
    while conntrack_count() >= n && Instant::now() < deadline {
        std::thread::sleep(Duration::from_millis(100));
    }
}

pub fn forward_scenario(o: &Opts, res: &mut Results) {
    let topo = match topology(o) {
        Ok(t) => t,
        Err(e) => {
            res.fail(format!("forward topology: {e}"));
            return;
        }
    };
    // Short TIME_WAIT entries: a proxied connection leaves two, and with
    // tracking on every target's runs fill the table (the host's
    // nf_conntrack_max, 262,144 here, cannot be raised from this namespace).
    let _tw: Option<SysctlGuard> = conntrack_time_wait(3);
    let targets: Vec<Target> = TARGETS
        .into_iter()
        .filter(|t| o.targets.contains(t))
        .filter(|t| o.forward_targets.as_ref().is_none_or(|l| l.contains(t)))
        .collect();
    let d = o.duration;
    res.commands.insert(
        "forward".into(),
        format!(
            "nsenter --net=<client netns> wrk -t1 -c50 -d {d}s --latency [-H 'Connection: close'] http://<target>:{HTTP_PORT}/"
        ),
    );
    let mut runs = Vec::new();
    // The smoke run proves the path once: the first thread count only.
    let counts = if o.smoke {
        &o.threads[..1]
    } else {
        &o.threads[..]
    };
    for &threads in counts {
        let label = threads_label(threads);
        let mut procs: Vec<(Target, Proc)> = Vec::new();
        if targets.contains(&Target::Hlb) {
            let p = o.hlb().start(
                "fwd-hlb",
                &hlb_config_to(HLB_VIP, BACKEND, None),
                sa(HLB_VIP, ADMIN_PORT),
                threads,
            );
            procs.push((Target::Hlb, p));
        }
        if targets.contains(&Target::Haproxy) {
            let cfg: PathBuf = o.work.join("fwd-haproxy.cfg");
            std::fs::write(&cfg, haproxy_config_at(threads, HAPROXY_VIP, BACKEND))
                .expect("write haproxy config");
            let p = Proc::spawn(
                "fwd-haproxy",
                Command::new("haproxy").arg("-db").arg("-f").arg(&cfg),
                &o.work.join("fwd-haproxy.log"),
            );
            wait_port(sa(HAPROXY_VIP, HTTP_PORT), "haproxy");
            procs.push((Target::Haproxy, p));
        }
        for (t, _) in &procs {
            wait_http_ok(sa(vip(*t), HTTP_PORT), "/", Duration::from_secs(10));
        }
        let pids: Vec<(Target, i32)> = procs.iter().map(|(t, p)| (*t, p.pid())).collect();
        for round in 0..o.rounds {
            for &on_mode in &o.forward_conntrack {
                let mode = if on_mode { "on" } else { "off" };
                let ct = if on_mode {
                    match nft_table(CT_TABLE, &ct_ruleset()) {
                        Ok(t) => Some(t),
                        Err(e) => {
                            res.fail(format!("forward: the conntrack-on table: {e}"));
                            continue;
                        }
                    }
                } else {
                    None
                };
                for close in [false, true] {
                    let test = if close {
                        "new connections"
                    } else {
                        "kept-alive requests"
                    };
                    for t in run_order(&targets, round) {
                        let what = format!(
                            "round {} forward conntrack {mode} {test} {} ({label})",
                            round + 1,
                            t.name()
                        );
                        settle_conntrack(20_000);
                        let (on, daemon) = match kernel_on(o, t) {
                            Some(Ok((on, daemon))) => (Some(on), daemon),
                            Some(Err(e)) => {
                                res.fail(format!("{what}: {e}"));
                                continue;
                            }
                            None => (None, None),
                        };
                        if !topo
                            .client
                            .connects(vip(t), HTTP_PORT, Duration::from_secs(10))
                        {
                            res.fail(format!("{what}: the client does not reach {}", vip(t)));
                            continue;
                        }
                        let load = loadavg();
                        let before = CtErrors::read();
                        let tracked_before = tracked_to(vip(t), HTTP_PORT);
                        let retrans0 = topo.client.tcp_ext("TCPSynRetrans");
                        let paws0 = topo.backend.tcp_ext("PAWSTimewait");
                        let cpu0 = proxy_cpu(&pids, t);
                        let daemon0 = daemon.map(cpu_seconds_tree);
                        let mut cmd = topo.client.cmd("wrk");
                        wrk_args(
                            &mut cmd,
                            &format!("http://{}:{HTTP_PORT}/", vip(t)),
                            close,
                            d,
                        );
                        let r = wrk_run(&mut cmd, d);
                        let cpu1 = proxy_cpu(&pids, t);
                        let daemon1 = daemon.map(cpu_seconds_tree);
                        let ct_run = CtErrors::read().since(before);
                        // The bed's own tax (see `client_src`): SYNs the
                        // client sent again, and those the backend's
                        // TIME_WAIT sockets refused by PAWS.
                        let delta =
                            |a: Option<u64>, b: Option<u64>| Some(b?.saturating_sub(a?) as f64);
                        let syn_retrans = delta(retrans0, topo.client.tcp_ext("TCPSynRetrans"));
                        let paws = delta(paws0, topo.backend.tcp_ext("PAWSTimewait"));
                        // Before the kernel target's table goes: its
                        // entries are there either way (TIME_WAIT).
                        let tracked = tracked_to(vip(t), HTTP_PORT);
                        drop(on);
                        let r = match r {
                            Ok(r) => r,
                            Err(e) => {
                                res.fail(format!("{what}: {e}"));
                                continue;
                            }
                        };
                        let (unit, short) = if close {
                            ("conn/s", "new connections")
                        } else {
                            ("req/s", "kept-alive requests")
                        };
                        let scen = format!("5 forward, conntrack {mode}: {short} ({label})");
                        res.add(&scen, unit, t, r.rate);
                        if let (Some(c0), Some(c1)) = (cpu0, cpu1)
                            && r.rate > 0.0
                        {
                            let per = (c1 - c0) * 1e6 / (r.rate * d as f64);
                            res.add(&scen, "proxy CPU µs per request", t, per);
                        }
                        // harvester-lb (kernel)'s daemon: its health checks
                        // and readings while the kernel forwards.
                        if let (Some(c0), Some(c1)) = (daemon0, daemon1)
                            && r.rate > 0.0
                        {
                            let per = (c1 - c0) * 1e6 / (r.rate * d as f64);
                            res.add(&scen, "daemon CPU µs per request", t, per);
                        }
                        res.add(&scen, "p99 ms", t, r.p99_ms);
                        if let Some(n) = syn_retrans {
                            res.add(&scen, "client SYN retransmits", t, n);
                        }
                        if let Some(n) = paws {
                            res.add(&scen, "backend TIME_WAIT PAWS rejects", t, n);
                        }
                        res.add(&scen, "errors", t, r.errors as f64);
                        eprintln!(
                            "{what}: {:.0} {unit}, p99 {:.3} ms, {} errors; conntrack {ct_run:?}; SYN retransmits {syn_retrans:?}, PAWS rejects {paws:?}; load {load}",
                            r.rate, r.p99_ms, r.errors
                        );
                        let kernel = matches!(t, Target::Kernel | Target::HlbKernel);
                        // Entries of an earlier tracked run may linger (they
                        // only age), so untracked means none were added.
                        match tracked {
                            Some(n) if n > tracked_before.unwrap_or(0) && !on_mode && !kernel => {
                                res.fail(format!(
                                    "{what}: {n} conntrack entries to {} in a run meant untracked",
                                    vip(t)
                                ))
                            }
                            Some(0) if on_mode || kernel => res.fail(format!(
                                "{what}: no conntrack entry to {} in a run meant tracked",
                                vip(t)
                            )),
                            _ => {}
                        }
                        // A SYN conntrack could not insert is dropped (the
                        // client sends it again a second later): shown,
                        // not hidden, as on a host it happens too.
                        res.add(
                            &scen,
                            "conntrack insert_failed + drop",
                            t,
                            (ct_run.insert_failed + ct_run.drop + ct_run.early_drop) as f64,
                        );
                        runs.push(json!({"round": round + 1, "conntrack": mode, "test": test,
                            "threads": threads, "target": t.name(), "rate": r.rate,
                            "loadavg": load, "conntrack_entries_to_target": tracked,
                            "insert_failed": ct_run.insert_failed, "drop": ct_run.drop,
                            "early_drop": ct_run.early_drop, "syn_retransmits": syn_retrans,
                            "paws_rejects": paws}));
                        if !o.smoke {
                            std::thread::sleep(Duration::from_millis(300));
                        }
                    }
                }
                drop(ct);
            }
        }
        for (t, p) in procs.iter_mut() {
            if !p.alive() {
                res.fail(format!(
                    "forward: {} ({threads} threads) exited during the run",
                    t.name()
                ));
            }
        }
    }
    res.extra.insert("forward_runs".into(), Value::Array(runs));
}

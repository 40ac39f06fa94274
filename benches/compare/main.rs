//! Side-by-side comparison of harvester-lb with HAProxy, nginx (stream) and
//! the kernel's own forwarding (nftables DNAT, as kube-proxy forwards a
//! Service) on loopback: `cargo bench --bench compare -- [--smoke] [--json
//! FILE]`, usually through `benches/compare.sh`, which installs the peers
//! first.
//!
//! Every address is in 127.0.0.0/8, except the two kernel targets' VIPs,
//! which are on `lo` of a network namespace the bench makes for itself when
//! it runs as root ([`host::private_netns`]; every target runs in it).
//! Everything started here is stopped by
//! pid (on drop, so a panic stops it too); what is changed on the host (an
//! nftables table, conntrack sysctls) is undone on drop and on SIGINT or
//! SIGTERM ([`host`]). Every loop is bounded in count and time. The README's
//! "Benchmarks" section describes the scenarios and carries the latest
//! table.
//!
//! Where things are: this file reads the options and runs the scenarios in
//! order; [`targets`] has the targets, the processes and the traffic
//! scenarios' proxy configs; [`scenarios`] one module per scenario;
//! [`table`] the results and the Markdown table; [`order`] the balanced run
//! order; [`host`] the host changes and their undoing; [`backend`] the tiny
//! HTTP backend; [`util`] and [`procfs`] small helpers.

// The comparison times real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

mod backend;
mod host;
mod order;
mod procfs;
mod scenarios;
mod table;
mod targets;
mod util;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use crate::host::KernelDnat;
use crate::scenarios::scale::{SCALE_MARKER, scale_backend};
use crate::scenarios::traffic::Block;
use crate::table::{Results, median};
use crate::targets::{
    BACKEND_IP, HTTP_PORT, HlbRun, IPERF_PORT, NGINX_STREAM_MODULE, Proc, Target, start_proxies,
};
use crate::util::{sa, sh, wait_http_ok, wait_port, which};

// ---------------------------------------------------------------------------
// Options

struct Opts {
    smoke: bool,
    json: PathBuf,
    rounds: usize,
    duration: u64,
    targets: Vec<Target>,
    scenarios: Vec<String>,
    /// The thread counts of the traffic scenarios (throughput, rps, cps,
    /// idle): each runs once per count, every proxy with that many threads
    /// or worker processes.
    threads: Vec<usize>,
    /// Appended to every `harvester-lb run` (the `HLB_ARGS` environment
    /// variable, split at whitespace), e.g. to A/B a runtime option.
    hlb_args: Vec<String>,
    idle_conns: usize,
    probe_targets: usize,
    probe_window: u64,
    reloads: usize,
    reload_lbs: usize,
    scale_lbs: usize,
    scale_window: u64,
    scale_reloads: usize,
    /// Load balancers of the kernel scale scenario (`scale-kernel`).
    scale_kernel_lbs: usize,
    /// The forward scenario's tracking modes (`--conntrack`): true is
    /// "on", false "off", run in this order within each round.
    forward_conntrack: Vec<bool>,
    /// The forward scenario's targets (`--forward-targets`, by their short
    /// names): all five by default; fewer to tell whether a gap between two
    /// of them comes from the others in the same rounds.
    forward_targets: Option<Vec<Target>>,
    work: PathBuf,
}

impl Opts {
    /// How this run starts harvester-lb.
    fn hlb(&self) -> HlbRun<'_> {
        HlbRun {
            work: &self.work,
            extra_args: &self.hlb_args,
        }
    }

    fn wants(&self, scenario: &str) -> bool {
        self.scenarios.iter().any(|s| s == scenario)
    }
}

/// Every scenario; all but `forward` run by default.
const ALL_SCENARIOS: [&str; 10] = [
    "throughput",
    "rps",
    "cps",
    "idle",
    "health",
    "reload",
    "scale",
    "scale-kernel",
    "udp",
    "forward",
];

fn usage() -> ! {
    eprintln!(
        "usage: compare [--smoke] [--log-modes] [--json FILE] [--rounds N] [--duration SECONDS] [--threads LIST]\n\
         \x20              [--only throughput,rps,cps,idle,health,reload,scale,scale-kernel,udp,forward]\n\
         \x20              [--scale-lbs N] [--scale-kernel-lbs N] [--conntrack on,off]\n\
         \x20              [--forward-targets direct,kernel,hlb-kernel,hlb,haproxy]\n\
         --only: default every scenario but forward\n\
         forward: a client netns, this netns as the LB host routing, a backend netns; kept-alive and\n\
         \x20        new connections (wrk) through direct routing, the kernel's one-rule DNAT, harvester-lb\n\
         \x20        (kernel), harvester-lb and HAProxy, with conntrack on and off (--conntrack: which, default both)\n\
         --smoke: every scenario about a second (scale: 500 load balancers, ~25 s), against harvester-lb,\n\
         \x20        harvester-lb (kernel) and the kernel target alone; a second thread count only in rps and cps; exits\n\
         \x20        non-zero on failure\n\
         --threads: thread counts of the traffic scenarios (throughput, rps, cps, idle), default 1,2\n\
         --log-modes: two more harvester-lb targets in the traffic scenarios, hlb-log-errors and\n\
         \x20        hlb-log-all (log_connections = \"errors\", \"all\"), run in the same rounds as\n\
         \x20        harvester-lb, with their ratios to it\n\
         --scale-lbs: load balancers of 3 backends in the scale scenario (default 10000, at most {})\n\
         --scale-kernel-lbs: load balancers of 3 backends in the scale-kernel scenario (default 10000,\n\
         \x20        smoke 500, {} to {})\n\
         HLB_ARGS (environment): extra arguments appended to every `harvester-lb run`",
        SCALE_MARKER - 1,
        scenarios::kscale::KSCALE_MIN,
        scenarios::kscale::KSCALE_MAX
    );
    std::process::exit(2)
}

fn parse_opts() -> Opts {
    let mut args = std::env::args().skip(1);
    let mut smoke = false;
    let mut json = None;
    let mut rounds = None;
    let mut duration = None;
    let mut only: Option<Vec<String>> = None;
    let mut scale_lbs = None;
    let mut scale_kernel_lbs = None;
    let mut threads: Option<Vec<usize>> = None;
    let mut log_modes = false;
    let mut forward_conntrack = vec![true, false];
    let mut forward_targets = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--smoke" => smoke = true,
            "--log-modes" => log_modes = true,
            "--json" => json = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            "--rounds" => rounds = args.next().and_then(|v| v.parse().ok()),
            "--duration" => duration = args.next().and_then(|v| v.parse().ok()),
            "--scale-lbs" => {
                let n = args.next().and_then(|v| v.parse::<usize>().ok());
                match n {
                    Some(n) if (1..SCALE_MARKER).contains(&n) => scale_lbs = Some(n),
                    _ => usage(),
                }
            }
            "--scale-kernel-lbs" => {
                let n = args.next().and_then(|v| v.parse::<usize>().ok());
                match n {
                    Some(n)
                        if (scenarios::kscale::KSCALE_MIN..=scenarios::kscale::KSCALE_MAX)
                            .contains(&n) =>
                    {
                        scale_kernel_lbs = Some(n)
                    }
                    _ => usage(),
                }
            }
            "--conntrack" => {
                let list: Option<Vec<bool>> = args
                    .next()
                    .unwrap_or_else(|| usage())
                    .split(',')
                    .map(|m| match m.trim() {
                        "on" => Some(true),
                        "off" => Some(false),
                        _ => None,
                    })
                    .collect();
                match list {
                    Some(l) if !l.is_empty() => forward_conntrack = l,
                    _ => usage(),
                }
            }
            "--forward-targets" => {
                let all = [
                    Target::Direct,
                    Target::Kernel,
                    Target::HlbKernel,
                    Target::Hlb,
                    Target::Haproxy,
                ];
                let list: Option<Vec<Target>> = args
                    .next()
                    .unwrap_or_else(|| usage())
                    .split(',')
                    .map(|n| all.into_iter().find(|t| t.short() == n.trim()))
                    .collect();
                match list {
                    Some(l) if !l.is_empty() => forward_targets = Some(l),
                    _ => usage(),
                }
            }
            "--threads" => {
                let list: Option<Vec<usize>> = args
                    .next()
                    .unwrap_or_else(|| usage())
                    .split(',')
                    .map(|t| t.trim().parse().ok().filter(|n| (1..=64).contains(n)))
                    .collect();
                match list {
                    Some(l) if !l.is_empty() => threads = Some(l),
                    _ => usage(),
                }
            }
            "--only" => {
                only = Some(
                    args.next()
                        .unwrap_or_else(|| usage())
                        .split(',')
                        .map(str::to_string)
                        .collect(),
                )
            }
            "--serve-http" => {
                let addr = args.next().unwrap_or_else(|| usage());
                backend::serve_http(addr.parse().unwrap_or_else(|_| usage()));
            }
            "-h" | "--help" => usage(),
            other => {
                eprintln!("unknown argument {other}");
                usage()
            }
        }
    }
    let scenarios = only.unwrap_or_else(|| {
        ALL_SCENARIOS
            .iter()
            .filter(|s| **s != "forward")
            .map(|s| s.to_string())
            .collect()
    });
    for s in &scenarios {
        if !ALL_SCENARIOS.contains(&s.as_str()) {
            eprintln!("unknown scenario {s}");
            usage()
        }
    }
    let mut targets = if smoke {
        vec![Target::Kernel, Target::HlbKernel, Target::Hlb]
    } else {
        vec![
            Target::Direct,
            Target::Kernel,
            Target::HlbKernel,
            Target::Hlb,
            Target::Haproxy,
            Target::Nginx,
        ]
    };
    if log_modes {
        targets.extend([Target::HlbLogErrors, Target::HlbLogAll]);
    }
    let work = std::env::temp_dir().join(format!("hlb-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("create work dir");
    Opts {
        smoke,
        json: json.unwrap_or_else(|| PathBuf::from("bench-compare.json")),
        rounds: rounds.unwrap_or(if smoke { 1 } else { 3 }),
        duration: duration.unwrap_or(if smoke { 1 } else { 5 }),
        targets,
        scenarios,
        threads: threads.unwrap_or_else(|| vec![1, 2]),
        hlb_args: std::env::var("HLB_ARGS")
            .unwrap_or_default()
            .split_whitespace()
            .map(str::to_string)
            .collect(),
        idle_conns: 5000,
        probe_targets: 5000,
        probe_window: if smoke { 2 } else { 20 },
        reloads: if smoke { 3 } else { 20 },
        reload_lbs: 1000,
        scale_lbs: scale_lbs.unwrap_or(if smoke { 500 } else { 10_000 }),
        scale_window: if smoke { 5 } else { 20 },
        scale_reloads: if smoke { 3 } else { 10 },
        scale_kernel_lbs: scale_kernel_lbs.unwrap_or(if smoke { 500 } else { 10_000 }),
        forward_conntrack,
        forward_targets,
        work,
    }
}

// ---------------------------------------------------------------------------
// Orchestration

/// The bench binary re-run as the tiny HTTP backend on `addr`.
fn spawn_http_backend(o: &Opts, addr: &str, log: &str) -> Proc {
    let exe = std::env::current_exe().expect("current exe");
    Proc::spawn(
        "http-backend",
        Command::new(&exe).arg("--serve-http").arg(addr),
        &o.work.join(log),
    )
}

/// Scenarios 1–4, once per thread count: the backends stay up throughout;
/// the proxies are started with each count's threads and stopped after it.
///
/// The targets without a process run in every block too: direct, because
/// the per-round ratios against it need it in the same rounds; the kernel
/// targets (whose forwarding has no threads to set; harvester-lb (kernel)'s
/// daemon, started for each of its runs, has one) for the same reason. The smoke run proves each path once and keeps to its time: the
/// first block as a full run has it, with the kernel; later blocks only
/// the request scenarios (rps, cps) of harvester-lb.
fn traffic_blocks(o: &Opts, res: &mut Results, kernel: Option<&KernelDnat>) {
    let http_backend = spawn_http_backend(
        o,
        &sa(BACKEND_IP, HTTP_PORT).to_string(),
        "http-backend.log",
    );
    let iperf_server = Proc::spawn(
        "iperf3-server",
        Command::new("iperf3").args([
            "-s",
            "-B",
            &BACKEND_IP.to_string(),
            "-p",
            &IPERF_PORT.to_string(),
        ]),
        &o.work.join("iperf3-server.log"),
    );
    wait_port(sa(BACKEND_IP, HTTP_PORT), "http backend");
    wait_port(sa(BACKEND_IP, IPERF_PORT), "iperf3 server");
    for (k, &threads) in o.threads.iter().enumerate() {
        let later_smoke = o.smoke && k > 0;
        let mut procs = start_proxies(&o.hlb(), &o.targets, threads);
        // Every proxy forwards before the first run: a request through
        // each answers 200 (the kernel target's table comes with its runs).
        for (t, _) in &procs {
            wait_http_ok(sa(t.ip(), HTTP_PORT), "/", Duration::from_secs(10));
        }
        let pids: Vec<(Target, i32)> = procs.iter().map(|(t, p)| (*t, p.pid())).collect();
        let targets: Vec<Target> = o
            .targets
            .iter()
            .copied()
            .filter(|t| !(later_smoke && matches!(t, Target::Kernel | Target::HlbKernel)))
            .collect();
        let traffic: Vec<&str> = ["throughput", "rps", "cps"]
            .into_iter()
            .filter(|s| o.wants(s) && !(later_smoke && *s == "throughput"))
            .collect();
        if !traffic.is_empty() {
            let block = Block {
                targets: &targets,
                pids: &pids,
                threads,
                kernel,
                scenarios: &traffic,
            };
            scenarios::traffic::traffic_scenarios(o, res, &block);
        }
        if o.wants("idle") && !later_smoke {
            scenarios::idle::idle_scenario(o, res, &mut procs, threads);
        }
        for (t, p) in procs.iter_mut() {
            if !p.alive() {
                res.fail(format!(
                    "{} ({threads} threads) exited during the run",
                    t.name()
                ));
            }
        }
    }
    drop(iperf_server);
    drop(http_backend);
}

fn main() {
    // First, before any thread: every thread and process of the bench is
    // in its namespace, and Ctrl-C must still undo the host changes.
    // (The bench re-run as a backend stays in the namespace it was started in.)
    let netns = if std::env::args().any(|a| a == "--serve-http") {
        Err("a backend".to_string())
    } else {
        host::private_netns()
    };
    host::undo_on_signal();
    let mut o = parse_opts();
    let needs_peers = !o.smoke;
    // The forward scenario has no nginx target.
    let forward_only = o.scenarios.iter().all(|s| s == "forward");
    if forward_only {
        o.targets.retain(|t| *t != Target::Nginx);
    }
    let mut missing = Vec::new();
    for tool in ["iperf3", "wrk", "tcpdump"] {
        if !which(tool) {
            missing.push(tool);
        }
    }
    if needs_peers {
        if !which("haproxy") {
            missing.push("haproxy");
        }
        if !forward_only && (!which("nginx") || !Path::new(NGINX_STREAM_MODULE).exists()) {
            missing.push("nginx + libnginx-mod-stream");
        }
    }
    if !missing.is_empty() {
        eprintln!(
            "missing: {} — run benches/compare.sh, which installs them with apt-get",
            missing.join(", ")
        );
        std::process::exit(1);
    }
    let started = Instant::now();
    let date = sh("date -u +%Y-%m-%dT%H:%M:%SZ");
    let mut res = Results::default();

    let want_traffic = ["throughput", "rps", "cps", "idle"]
        .iter()
        .any(|s| o.wants(s));
    // The kernel targets: only in the traffic and udp scenarios, only in
    // the bench's own namespace (their VIPs are there) and only where
    // nftables can be used; otherwise they are left out with a note.
    let want_kernel =
        want_traffic || o.wants("udp") || o.wants("scale-kernel") || o.wants("forward");
    if let Err(e) = &netns {
        eprintln!(
            "note: no kernel and harvester-lb (kernel) targets: {e}; every target runs in this namespace"
        );
        o.targets
            .retain(|t| !matches!(t, Target::Kernel | Target::HlbKernel));
    } else if !which("nft") {
        eprintln!("note: no harvester-lb (kernel) target: nft missing (apt-get install nftables)");
        o.targets.retain(|t| *t != Target::HlbKernel);
    }
    if !want_kernel {
        o.targets.retain(|t| *t != Target::HlbKernel);
    }
    let kernel = if (want_traffic || o.wants("udp") || o.wants("forward"))
        && o.targets.contains(&Target::Kernel)
    {
        match KernelDnat::prepare() {
            Ok(k) => Some(k),
            Err(e) => {
                eprintln!("note: no kernel target: {e}");
                None
            }
        }
    } else {
        None
    };
    if kernel.is_none() {
        o.targets.retain(|t| *t != Target::Kernel);
    }
    // The smoke run's single 1 s run cannot fill the conntrack table.
    let any_kernel = kernel.is_some() || o.targets.contains(&Target::HlbKernel);
    let conntrack = if any_kernel && (o.wants("cps") || o.wants("forward")) && !o.smoke {
        host::conntrack_room()
    } else {
        Vec::new()
    };
    if want_traffic {
        traffic_blocks(&o, &mut res, kernel.as_ref());
    }
    if o.wants("udp") {
        scenarios::udp::udp_scenario(&o, &mut res, kernel.as_ref());
    }
    if o.wants("forward") {
        if netns.is_ok() {
            scenarios::forward::forward_scenario(&o, &mut res);
        } else {
            eprintln!("note: no forward scenario: it needs the bench's own network namespace");
        }
    }
    if o.wants("health") {
        scenarios::health::health_scenario(&o, &mut res);
    }
    if o.wants("reload") {
        let http_backend = spawn_http_backend(
            &o,
            &sa(BACKEND_IP, HTTP_PORT).to_string(),
            "http-backend-reload.log",
        );
        wait_port(sa(BACKEND_IP, HTTP_PORT), "http backend");
        scenarios::reload::reload_scenario(&o, &mut res);
        drop(http_backend);
    }
    if o.wants("scale") || o.wants("scale-kernel") {
        // On 0.0.0.0, tied to lo: the backend of every scale backend address.
        let http_backend = spawn_http_backend(
            &o,
            &sa(std::net::Ipv4Addr::UNSPECIFIED, HTTP_PORT).to_string(),
            "http-backend-scale.log",
        );
        wait_port(sa(scale_backend(0, 0), HTTP_PORT), "http backend");
        if o.wants("scale") {
            scenarios::scale::scale_scenario(&o, &mut res);
        }
        if o.wants("scale-kernel") {
            scenarios::kscale::kscale_scenario(&o, &mut res, netns.is_ok());
        }
        drop(http_backend);
    }

    let machine = format!(
        "{}; {} cores; {} GiB RAM; kernel {}; open files limit {}",
        sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"),
        sh("nproc"),
        sh("free -g | awk '/Mem:/{print $2}'"),
        sh("uname -r"),
        sh("ulimit -n")
    );
    let versions = format!(
        "haproxy {}; nginx {}; iperf3 {}; wrk {}; nft {}",
        sh("haproxy -v 2>/dev/null | head -1 | awk '{print $3}'"),
        sh("nginx -v 2>&1 | sed 's/.*nginx\\///'"),
        sh("iperf3 --version 2>/dev/null | head -1 | awk '{print $2}'"),
        sh("wrk -v 2>&1 | head -1 | awk '{print $2}'"),
        sh("nft --version 2>/dev/null | awk '{print $2}'"),
    );
    let command: Vec<String> = std::env::args().collect();
    let tbl = table::table(&res, &o.targets);
    let threads: Vec<String> = o.threads.iter().map(|t| t.to_string()).collect();
    println!(
        "\nharvester-lb comparison, {date}\nmachine: {machine}\nversions: {versions}\nrounds {}, {} s per run; medians over rounds; traffic scenarios with {} thread(s)/worker(s) per proxy, the others with one; 2 cores shared by load generator, proxy and backend{}\n",
        o.rounds,
        o.duration,
        threads.join(" and "),
        if o.hlb_args.is_empty() {
            String::new()
        } else {
            format!("; HLB_ARGS: {}", o.hlb_args.join(" "))
        }
    );
    println!("{tbl}");
    println!("{}", table::notes(&o.targets));
    if o.wants("forward") {
        println!("{}", scenarios::forward::NOTES);
    }
    let samples: Vec<Value> = res
        .samples
        .iter()
        .map(|((scen, metric, t), v)| {
            json!({"scenario": scen, "metric": metric, "target": t.name(), "samples": v, "median": median(v)})
        })
        .collect();
    let doc = json!({
        "date": date,
        "machine": machine,
        "versions": versions,
        "command": command,
        "smoke": o.smoke,
        "rounds": o.rounds,
        "duration_s": o.duration,
        "threads": o.threads,
        "hlb_args": o.hlb_args,
        "targets": o.targets.iter().map(|t| t.name()).collect::<Vec<_>>(),
        "elapsed_s": started.elapsed().as_secs_f64(),
        "commands": res.commands,
        "results": samples,
        "details": res.extra,
        "failures": res.failures,
        "table_markdown": tbl,
    });
    if let Some(dir) = o.json.parent()
        && !dir.as_os_str().is_empty()
    {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&o.json, serde_json::to_string_pretty(&doc).expect("json"))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", o.json.display()));
    println!("raw results: {}", o.json.display());
    let _ = std::fs::remove_dir_all(&o.work);
    // Undo the host changes before exit(), which runs no destructors.
    drop(conntrack);
    if !res.failures.is_empty() {
        eprintln!("{} failure(s):", res.failures.len());
        for f in &res.failures {
            eprintln!("  {f}");
        }
        std::process::exit(1);
    }
}

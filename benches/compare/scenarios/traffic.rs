//! Scenarios 1–3: throughput (iperf3), kept-alive requests and new
//! connections (wrk), for one thread count. Each round runs every test
//! against every target in the round's balanced order
//! ([`crate::order::run_order`]), so the targets share the machine's drift
//! and a ratio within one round cancels it.
//!
//! The kernel targets forward only during their own runs: the `kernel`
//! target's nftables table (see [`KernelDnat`]) and harvester-lb (kernel),
//! the daemon started for each run and stopped after it (its clean stop
//! removes its table), so neither's NAT hooks turn conntrack on for the
//! proxies' runs. Conntrack is watched for entries and errors after each of
//! their runs.

use std::time::Duration;

use serde_json::{Value, json};

use super::proxy_cpu;
use super::throughput::iperf;
use super::wrk::{wrk, wrk_cmd};
use crate::Opts;
use crate::host::{CtErrors, DaemonOn, KernelDnat, KernelOn, conntrack_count};
use crate::order::run_order;
use crate::table::Results;
use crate::targets::{HTTP_PORT, IPERF_PORT, Target, hlb_kernel_config, threads_label};
use crate::util::{sa, try_wait_port};

/// harvester-lb (kernel)'s listeners in the traffic scenarios: the same
/// ports as every other target's.
const TCP_LISTENERS: &[(&str, u16, &str)] =
    &[("iperf", IPERF_PORT, "tcp"), ("http", HTTP_PORT, "tcp")];

/// What one thread-count block runs against.
pub struct Block<'a> {
    /// The targets of this block, in the order run_order permutes.
    pub targets: &'a [Target],
    /// The proxies' pids (targets without a process are absent).
    pub pids: &'a [(Target, i32)],
    /// Threads (or worker processes) each proxy runs.
    pub threads: usize,
    /// The kernel target's means, when it is among `targets`.
    pub kernel: Option<&'a KernelDnat>,
    /// Which of throughput, rps and cps this block runs.
    pub scenarios: &'a [&'a str],
}

pub fn traffic_scenarios(o: &Opts, res: &mut Results, b: &Block) {
    let d = o.duration;
    let label = threads_label(b.threads);
    res.commands.insert(
        "throughput".into(),
        format!("iperf3 -c <target> -p {IPERF_PORT} -t {d} -P <1|8> [-R] -J"),
    );
    res.commands.insert(
        "rps".into(),
        format!("{:?}", wrk_cmd(Target::Hlb, false, d)).replace('"', ""),
    );
    res.commands.insert(
        "cps".into(),
        format!("{:?}", wrk_cmd(Target::Hlb, true, d)).replace('"', ""),
    );
    let mut tests: Vec<&str> = Vec::new();
    if b.scenarios.contains(&"throughput") {
        tests.extend(["iperf-1-up", "iperf-1-down", "iperf-8-up", "iperf-8-down"]);
    }
    if b.scenarios.contains(&"rps") {
        tests.push("rps");
    }
    if b.scenarios.contains(&"cps") {
        tests.push("cps");
    }
    let mut conntrack = Vec::new();
    for round in 0..o.rounds {
        for test in &tests {
            for target in run_order(b.targets, round) {
                let what = format!("round {} {test} {} ({label})", round + 1, target.name());
                // The smoke run proves harvester-lb (kernel)'s TCP path with
                // one iperf3 run, not four: each run starts a daemon.
                if o.smoke
                    && target == Target::HlbKernel
                    && test.starts_with("iperf-")
                    && *test != "iperf-1-up"
                {
                    continue;
                }
                // The kernel targets forward only while in force.
                let on = match (target, b.kernel) {
                    (Target::Kernel, Some(k)) => Some(
                        k.install("a TCP connection to the HTTP port", |limit| {
                            try_wait_port(sa(target.ip(), HTTP_PORT), limit)
                        })
                        .map(|on| KernelOn::Table { _on: on }),
                    ),
                    (Target::HlbKernel, _) => Some(
                        o.hlb()
                            .start_kernel(
                                "hlb-kernel",
                                &hlb_kernel_config(TCP_LISTENERS, HTTP_PORT),
                            )
                            .map(|p| KernelOn::Daemon {
                                _on: DaemonOn::new(p),
                            }),
                    ),
                    _ => None,
                };
                let dnat = match on {
                    Some(Ok(on)) => Some((on, CtErrors::read())),
                    Some(Err(e)) => {
                        res.fail(format!("{what}: {e}"));
                        continue;
                    }
                    None => None,
                };
                let outcome = match *test {
                    "rps" | "cps" => wrk_run(res, b, target, *test == "cps", d, &label),
                    _ => iperf_run(res, b, target, test, d, &label),
                };
                match outcome {
                    Ok(s) => eprintln!("{what}: {s}"),
                    Err(e) => res.fail(format!("{what}: {e}")),
                }
                if let Some((on, before)) = dnat {
                    // Read before the table goes: entries of this run still
                    // live (TIME_WAIT), errors counted since its start.
                    let entries = conntrack_count();
                    let errors = CtErrors::read().since(before);
                    drop(on);
                    eprintln!("{what}: conntrack {entries} entries after the run, {errors:?}");
                    if errors.any() {
                        res.fail(format!(
                            "{what}: conntrack lost connections ({errors:?}, {entries} entries): the table, not forwarding, limited this run"
                        ));
                    }
                    conntrack.push(
                        json!({"round": round + 1, "test": test, "threads": b.threads,
                        "entries_after": entries, "insert_failed": errors.insert_failed,
                        "drop": errors.drop, "early_drop": errors.early_drop}),
                    );
                }
                // The next run starts on a settled machine; the smoke run
                // measures nothing and does not wait.
                if !o.smoke {
                    std::thread::sleep(Duration::from_millis(300));
                }
            }
        }
    }
    if !conntrack.is_empty() {
        let runs = res
            .extra
            .entry("kernel_conntrack")
            .or_insert_with(|| Value::Array(Vec::new()));
        if let Value::Array(a) = runs {
            a.extend(conntrack);
        }
    }
}

/// One wrk run (kept-alive or `Connection: close`) and its rows.
fn wrk_run(
    res: &mut Results,
    b: &Block,
    target: Target,
    close: bool,
    d: u64,
    label: &str,
) -> Result<String, String> {
    let cpu0 = proxy_cpu(b.pids, target);
    let r = wrk(target, close, d)?;
    let (scen, unit) = if close {
        (format!("3 new connections ({label})"), "conn/s")
    } else {
        (format!("2 kept-alive requests ({label})"), "req/s")
    };
    let scen = scen.as_str();
    res.add(scen, unit, target, r.rate);
    // Proxy CPU per request: what a request costs,
    // whatever the scheduler did with the 2 cores.
    if let (Some(c0), Some(c1)) = (cpu0, proxy_cpu(b.pids, target))
        && r.rate > 0.0
    {
        // wrk's rate is its requests over its d seconds.
        let per = (c1 - c0) * 1e6 / (r.rate * d as f64);
        res.add(scen, "proxy CPU µs per request", target, per);
    }
    res.add(scen, "p50 ms", target, r.p50_ms);
    res.add(scen, "p99 ms", target, r.p99_ms);
    res.add(scen, "errors", target, r.errors as f64);
    Ok(format!(
        "{:.0} {unit}, p99 {:.3} ms, {} errors",
        r.rate, r.p99_ms, r.errors
    ))
}

/// One iperf3 run (`iperf-<streams>-<up|down>`) and its rows.
fn iperf_run(
    res: &mut Results,
    b: &Block,
    target: Target,
    test: &str,
    d: u64,
    label: &str,
) -> Result<String, String> {
    let streams = if test.contains("-8-") { 8 } else { 1 };
    let reverse = test.ends_with("down");
    let cpu0 = proxy_cpu(b.pids, target);
    let g = iperf(target, streams, reverse, d)?;
    let what = format!(
        "{streams} stream{} {}",
        if streams > 1 { "s" } else { "" },
        if reverse {
            "backend→client"
        } else {
            "client→backend"
        }
    );
    let scen = format!("1 throughput ({label})");
    res.add(&scen, &format!("Gbit/s {what}"), target, g);
    // What a Gbit costs the proxy: its CPU over the run (connection set-up
    // included, a few ms) over the Gbit iperf3 received in d seconds.
    if let (Some(c0), Some(c1)) = (cpu0, proxy_cpu(b.pids, target))
        && g > 0.0
    {
        let per = (c1 - c0) * 1e3 / (g * d as f64);
        res.add(
            &scen,
            &format!("proxy CPU ms per Gbit, {what}"),
            target,
            per,
        );
    }
    Ok(format!("{g:.2} Gbit/s"))
}

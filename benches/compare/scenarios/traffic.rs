//! Scenarios 1–3: throughput (iperf3), kept-alive requests and new
//! connections (wrk). Each round runs every test against every target in
//! the round's balanced order ([`crate::order::run_order`]), so the targets
//! share the machine's drift and a ratio within one round cancels it.

use std::time::Duration;

use super::proxy_cpu;
use super::throughput::iperf;
use super::wrk::{wrk, wrk_cmd};
use crate::Opts;
use crate::order::run_order;
use crate::table::Results;
use crate::targets::{IPERF_PORT, Target};

pub fn traffic_scenarios(o: &Opts, res: &mut Results, pids: &[(Target, i32)]) {
    let d = o.duration;
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
    if o.scenarios.iter().any(|s| s == "throughput") {
        tests.extend(["iperf-1-up", "iperf-1-down", "iperf-8-up", "iperf-8-down"]);
    }
    if o.scenarios.iter().any(|s| s == "rps") {
        tests.push("rps");
    }
    if o.scenarios.iter().any(|s| s == "cps") {
        tests.push("cps");
    }
    for round in 0..o.rounds {
        for test in &tests {
            for target in run_order(&o.targets, round) {
                let outcome = match *test {
                    "rps" | "cps" => {
                        let close = *test == "cps";
                        let cpu0 = proxy_cpu(pids, target);
                        wrk(target, close, d).map(|r| {
                            let (scen, unit) = if close {
                                ("3 new connections", "conn/s")
                            } else {
                                ("2 kept-alive requests", "req/s")
                            };
                            res.add(scen, unit, target, r.rate);
                            // Proxy CPU per request: what a request costs,
                            // whatever the scheduler did with the 2 cores.
                            if let (Some(c0), Some(c1)) = (cpu0, proxy_cpu(pids, target))
                                && r.rate > 0.0
                            {
                                // wrk's rate is its requests over its d seconds.
                                let per = (c1 - c0) * 1e6 / (r.rate * d as f64);
                                res.add(scen, "proxy CPU µs per request", target, per);
                            }
                            res.add(scen, "p50 ms", target, r.p50_ms);
                            res.add(scen, "p99 ms", target, r.p99_ms);
                            res.add(scen, "errors", target, r.errors as f64);
                            format!(
                                "{:.0} {unit}, p99 {:.3} ms, {} errors",
                                r.rate, r.p99_ms, r.errors
                            )
                        })
                    }
                    _ => {
                        let streams = if test.contains("-8-") { 8 } else { 1 };
                        let reverse = test.ends_with("down");
                        iperf(target, streams, reverse, d).map(|g| {
                            let metric = format!(
                                "Gbit/s {streams} stream{} {}",
                                if streams > 1 { "s" } else { "" },
                                if reverse {
                                    "backend→client"
                                } else {
                                    "client→backend"
                                }
                            );
                            res.add("1 throughput", &metric, target, g);
                            format!("{g:.2} Gbit/s")
                        })
                    }
                };
                match outcome {
                    Ok(s) => eprintln!("round {} {test} {}: {s}", round + 1, target.name()),
                    Err(e) => {
                        res.fail(format!("round {} {test} {}: {e}", round + 1, target.name()))
                    }
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    }
}

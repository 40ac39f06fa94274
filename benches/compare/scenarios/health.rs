//! Scenario 5: health checks at scale. 5,000 targets checked every second
//! by harvester-lb and by HAProxy: the prober's CPU (without a capture
//! running), then how late the probes fire (their SYNs captured in a second
//! window).

use std::fmt::Write as _;
use std::net::Ipv4Addr;
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::probes::{ProbeTargets, SynCapture};
use crate::Opts;
use crate::procfs::cpu_seconds_tree;
use crate::table::{Results, percentile};
use crate::targets::{ADMIN_PORT, HAPROXY_IP, HLB_IP, Proc, Target};
use crate::util::{sa, wait_port};

/// Targets are 127.250.(i / 250).(i % 250 + 1):PROBE_PORT.
const PROBE_PORT: u16 = 30999;

fn probe_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 250, (i / 250) as u8, (i % 250 + 1) as u8)
}

fn hlb_probe_config(n: usize) -> String {
    let mut s = format!(
        "[admin]\nlisten = \"{HLB_IP}:{}\"\n[[load_balancer]]\nname = \"bench/probes\"\nvip = \"{HLB_IP}\"\nbackends = [",
        ADMIN_PORT + 1
    );
    for i in 0..n {
        let _ = write!(s, "{}\"{}\"", if i > 0 { ", " } else { "" }, probe_ip(i));
    }
    let _ = write!(
        s,
        "]\n  [[load_balancer.listener]]\n  name = \"probe\"\n  port = {}\n  backend_port = {PROBE_PORT}\n  [load_balancer.health_check]\n  port = {PROBE_PORT}\n  period_seconds = 1\n  timeout_seconds = 1\n",
        PROBE_PORT - 1
    );
    s
}

fn haproxy_probe_config(n: usize) -> String {
    let mut s = format!(
        "global\n  nbthread 1\n  maxconn 2000\n  log stderr format short local0 err\ndefaults\n  mode tcp\n  timeout connect 1s\n  timeout client 1h\n  timeout server 1h\nfrontend probes\n  bind {HAPROXY_IP}:{}\n  default_backend probes\nbackend probes\n  default-server check inter 1s fall 3 rise 1\n",
        PROBE_PORT - 1
    );
    for i in 0..n {
        let _ = writeln!(s, "  server t{i} {}:{PROBE_PORT}", probe_ip(i));
    }
    s
}

pub fn health_scenario(o: &Opts, res: &mut Results) {
    let _targets = ProbeTargets::start(o.probe_targets, probe_ip, PROBE_PORT);
    let warmup = Duration::from_secs(if o.smoke { 2 } else { 4 });
    let window = Duration::from_secs(o.probe_window);
    let mut who = vec![Target::Hlb];
    if !o.smoke {
        who.push(Target::Haproxy);
    }
    let mut extra = serde_json::Map::new();
    for target in who {
        let proc = match target {
            Target::Hlb => o.hlb().start(
                "hlb-probes",
                &hlb_probe_config(o.probe_targets),
                sa(HLB_IP, ADMIN_PORT + 1),
                1,
            ),
            _ => {
                let cfg = o.work.join("haproxy-probes.cfg");
                std::fs::write(&cfg, haproxy_probe_config(o.probe_targets)).expect("write");
                let p = Proc::spawn(
                    "haproxy-probes",
                    Command::new("haproxy").arg("-db").arg("-f").arg(&cfg),
                    &o.work.join("haproxy-probes.log"),
                );
                wait_port(sa(HAPROXY_IP, PROBE_PORT - 1), "haproxy (probes)");
                p
            }
        };
        std::thread::sleep(warmup);
        let cpu0 = cpu_seconds_tree(proc.pid());
        let t0 = Instant::now();
        std::thread::sleep(window);
        let cpu1 = cpu_seconds_tree(proc.pid());
        let wall = t0.elapsed().as_secs_f64();
        let capture = SynCapture::start(
            o.probe_targets,
            &o.work,
            PROBE_PORT,
            "127.250.0.0/16",
            |ip| {
                let [_, _, c, d] = ip.octets();
                Some(c as usize * 250 + (d as usize).checked_sub(1)?)
            },
        );
        let c0 = Instant::now();
        std::thread::sleep(window);
        let capture_wall = c0.elapsed().as_secs_f64();
        let arrivals = capture.finish();
        drop(proc);
        let cpu_pct = (cpu1 - cpu0) / wall * 100.0;
        // Lateness two ways, in ms: (a) each gap between two probes of one
        // target minus the period; (b) against a fixed 1 s schedule anchored at
        // that target's earliest-firing probe in the window.
        let mut gaps = Vec::new();
        let mut anchored = Vec::new();
        let mut probes = 0usize;
        let mut silent = 0usize;
        for a in &arrivals {
            probes += a.len();
            if a.is_empty() {
                silent += 1;
                continue;
            }
            for w in a.windows(2) {
                gaps.push((w[1] - w[0]) * 1000.0 - 1000.0);
            }
            let offs: Vec<f64> = a
                .iter()
                .enumerate()
                .map(|(k, t)| (*t - a[0]) * 1000.0 - k as f64 * 1000.0)
                .collect();
            let min = offs.iter().copied().fold(f64::INFINITY, f64::min);
            anchored.extend(offs.iter().map(|x| x - min));
        }
        let rate = probes as f64 / capture_wall;
        let p99_gap = percentile(&mut gaps, 99.0);
        let max_gap = gaps.last().copied().unwrap_or(f64::NAN);
        let p99_anch = percentile(&mut anchored, 99.0);
        eprintln!(
            "health {}: {} targets, {rate:.0} probes/s, CPU {cpu_pct:.2}% of one core, gap-lateness p99 {p99_gap:.1} ms max {max_gap:.1} ms, anchored p99 {p99_anch:.1} ms, {silent} targets unprobed",
            target.name(),
            o.probe_targets
        );
        let scen = format!("5 health checks ({} targets, 1 s)", o.probe_targets);
        let scen = scen.as_str();
        res.add(scen, "CPU % of one core", target, cpu_pct);
        res.add(scen, "probes/s", target, rate);
        res.add(scen, "p99 lateness ms (gap)", target, p99_gap);
        res.add(scen, "p99 lateness ms (schedule)", target, p99_anch);
        extra.insert(
            target.name().into(),
            json!({"targets": o.probe_targets, "window_s": wall, "cpu_percent_of_one_core": cpu_pct,
                   "probes_per_s": rate, "gap_lateness_ms_p99": p99_gap, "gap_lateness_ms_max": max_gap,
                   "schedule_lateness_ms_p99": p99_anch, "unprobed_targets": silent}),
        );
        if target == Target::Hlb && (silent > 0 || rate < 0.9 * o.probe_targets as f64) {
            res.fail(format!(
                "health: harvester-lb probed {rate:.0}/s of {} targets, {silent} never",
                o.probe_targets
            ));
        }
    }
    res.extra.insert("health".into(), Value::Object(extra));
}

//! Scenarios 2 and 3's measurement: one wrk run through a target, kept-alive
//! or one connection per request (`Connection: close`).

use std::process::Command;
use std::time::Duration;

use crate::targets::{HTTP_PORT, Target};
use crate::util::run_with_timeout;

pub struct WrkResult {
    pub rate: f64,
    pub p50_ms: f64,
    pub p99_ms: f64,
    pub errors: u64,
}

pub fn wrk_cmd(target: Target, close: bool, secs: u64) -> Command {
    let mut cmd = Command::new("wrk");
    wrk_args(
        &mut cmd,
        &format!("http://{}:{HTTP_PORT}/", target.ip()),
        close,
        secs,
    );
    cmd
}

/// wrk's arguments against `url`, appended to `cmd` (which may run wrk in
/// another network namespace: the forward topology's client).
pub fn wrk_args(cmd: &mut Command, url: &str, close: bool, secs: u64) {
    cmd.args(["-t1", "-c50", "-d", &format!("{secs}s"), "--latency"]);
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(url);
}

pub fn wrk(target: Target, close: bool, secs: u64) -> Result<WrkResult, String> {
    wrk_run(&mut wrk_cmd(target, close, secs), secs)
}

/// Runs a wrk `cmd` of `secs` seconds (killed 20 s after) and reads its
/// rate, latency and errors.
pub fn wrk_run(cmd: &mut Command, secs: u64) -> Result<WrkResult, String> {
    let out = run_with_timeout(cmd, Duration::from_secs(secs + 20)).ok_or("wrk did not run")?;
    let mut r = WrkResult {
        rate: f64::NAN,
        p50_ms: f64::NAN,
        p99_ms: f64::NAN,
        errors: 0,
    };
    for line in out.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("Requests/sec:") {
            r.rate = v.trim().parse().unwrap_or(f64::NAN);
        } else if let Some(v) = t.strip_prefix("50%") {
            r.p50_ms = wrk_ms(v.trim());
        } else if let Some(v) = t.strip_prefix("99%") {
            r.p99_ms = wrk_ms(v.trim());
        } else if let Some(v) = t.strip_prefix("Socket errors:") {
            r.errors += v
                .split(',')
                .filter_map(|p| p.split_whitespace().last()?.parse::<u64>().ok())
                .sum::<u64>();
        } else if let Some(v) = t.strip_prefix("Non-2xx or 3xx responses:") {
            r.errors += v.trim().parse::<u64>().unwrap_or(0);
        }
    }
    if r.rate.is_nan() || r.rate <= 0.0 {
        return Err(format!("wrk gave no rate:\n{out}"));
    }
    Ok(r)
}

fn wrk_ms(v: &str) -> f64 {
    let split = v.find(|c: char| c.is_ascii_alphabetic()).unwrap_or(v.len());
    let n: f64 = v[..split].parse().unwrap_or(f64::NAN);
    match &v[split..] {
        "us" => n / 1000.0,
        "ms" => n,
        "s" => n * 1000.0,
        "m" => n * 60_000.0,
        _ => f64::NAN,
    }
}

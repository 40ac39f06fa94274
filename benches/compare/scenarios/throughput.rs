//! Scenario 1's measurement: one iperf3 run through a target.

use std::process::Command;
use std::time::Duration;

use serde_json::Value;

use crate::targets::{IPERF_PORT, Target};
use crate::util::run_with_timeout;

/// One iperf3 run; Gbit/s received.
pub fn iperf(target: Target, streams: u32, reverse: bool, secs: u64) -> Result<f64, String> {
    let mut cmd = Command::new("iperf3");
    cmd.args([
        "-c",
        &target.ip().to_string(),
        "-p",
        &IPERF_PORT.to_string(),
    ])
    .args(["-t", &secs.to_string(), "-P", &streams.to_string(), "-J"]);
    if reverse {
        cmd.arg("-R");
    }
    let out =
        run_with_timeout(&mut cmd, Duration::from_secs(secs + 20)).ok_or("iperf3 did not run")?;
    let json_end = out.rfind('}').ok_or("no JSON from iperf3")?;
    let v: Value = serde_json::from_str(&out[..=json_end]).map_err(|e| e.to_string())?;
    if let Some(e) = v.get("error") {
        return Err(format!("iperf3: {e}"));
    }
    v.pointer("/end/sum_received/bits_per_second")
        .and_then(Value::as_f64)
        .map(|b| b / 1e9)
        .ok_or_else(|| "iperf3 JSON has no end.sum_received".into())
}

//! The scenarios, one module each. The traffic scenarios (throughput,
//! requests, new connections) interleave their runs in [`traffic`]; every
//! other scenario starts and stops what it needs itself.

pub mod forward;
pub mod health;
pub mod idle;
pub mod kscale;
mod probes;
pub mod reload;
pub mod scale;
mod throughput;
pub mod traffic;
pub mod udp;
mod wrk;

use crate::procfs::cpu_seconds_tree;
use crate::targets::Target;

/// CPU seconds used so far by `target`'s process tree; None for a target
/// without a process (direct, kernel).
fn proxy_cpu(pids: &[(Target, i32)], target: Target) -> Option<f64> {
    pids.iter()
        .find(|(t, _)| *t == target)
        .map(|(_, pid)| cpu_seconds_tree(*pid))
}

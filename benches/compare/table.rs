//! What the scenarios measured and how it is summed up: [`Results`] holds
//! one sample per round for each (scenario, metric, target); [`table`]
//! prints medians and the ratios between targets as the README's Markdown
//! table.

use std::collections::BTreeMap;
use std::fmt::Write as _;

use serde_json::Value;

use crate::targets::Target;

#[derive(Default)]
pub struct Results {
    /// (scenario, metric, target) -> samples, one per round.
    pub samples: BTreeMap<(String, String, Target), Vec<f64>>,
    /// Scenario-specific extra results (health, reload, idle, kernel).
    pub extra: serde_json::Map<String, Value>,
    /// Commands run, for the README.
    pub commands: BTreeMap<String, String>,
    pub failures: Vec<String>,
}

impl Results {
    pub fn add(&mut self, scenario: &str, metric: &str, target: Target, v: f64) {
        self.samples
            .entry((scenario.to_string(), metric.to_string(), target))
            .or_default()
            .push(v);
    }

    pub fn fail(&mut self, what: String) {
        eprintln!("FAILED: {what}");
        self.failures.push(what);
    }
}

pub fn median(v: &[f64]) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    let mut s = v.to_vec();
    s.sort_by(|a, b| a.total_cmp(b));
    let n = s.len();
    if n % 2 == 1 {
        s[n / 2]
    } else {
        (s[n / 2 - 1] + s[n / 2]) / 2.0
    }
}

pub fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

fn fmt_num(v: f64) -> String {
    if v.is_nan() {
        "–".into()
    } else if v.abs() >= 1000.0 {
        format!("{v:.0}")
    } else if v.abs() >= 10.0 {
        format!("{v:.1}")
    } else {
        format!("{v:.3}")
    }
}

/// The rows whose ratios carry the spread of the per-round ratios: the
/// rates and what they cost, the figures a claim against a peer rests on.
/// A claimed gap means something only when it is wider than this spread.
fn shows_spread(metric: &str) -> bool {
    metric.starts_with("Gbit/s")
        || metric.starts_with("proxy CPU")
        || ["req/s", "conn/s", "queries/s"].contains(&metric)
}

/// The ratio columns, numerator over denominator.
const RATIOS: [(Target, Target); 5] = [
    (Target::Hlb, Target::Haproxy),
    (Target::Hlb, Target::Direct),
    (Target::Hlb, Target::Kernel),
    (Target::Nginx, Target::Haproxy),
    (Target::Nginx, Target::Direct),
];

/// harvester-lb (kernel) against the peers of issue 20's targets (HAProxy
/// for requests and connections, the kernel for everything, nginx for UDP),
/// columns shown only when it ran.
const KERNEL_RATIOS: [(Target, Target); 3] = [
    (Target::HlbKernel, Target::Haproxy),
    (Target::HlbKernel, Target::Kernel),
    (Target::HlbKernel, Target::Nginx),
];

/// The connection log's cost (`--log-modes`): each logging harvester-lb
/// over the plain one, columns shown only when those targets ran.
const LOG_RATIOS: [(Target, Target); 2] = [
    (Target::HlbLogErrors, Target::Hlb),
    (Target::HlbLogAll, Target::Hlb),
];

/// The ratio of `a` to `b` in one row: the median of the per-round ratios
/// when both have every round (rounds interleave the targets, so the ratio
/// within one round cancels the machine's drift between rounds), with their
/// min–max when `spread` and there are two rounds or more; otherwise the
/// ratio of the medians. "–" when `b`'s median is zero.
fn ratio(m: &BTreeMap<Target, &Vec<f64>>, a: Target, b: Target, spread: bool) -> String {
    let (Some(x), Some(y)) = (m.get(&a), m.get(&b)) else {
        return "–".into();
    };
    // Against a median of zero (errors, lost queries: mostly-zero counts)
    // a ratio of the few non-zero rounds would mislead.
    if median(y) == 0.0 {
        return "–".into();
    }
    if x.len() != y.len() {
        let r = median(x) / median(y);
        return if r.is_finite() {
            format!("{r:.2}x")
        } else {
            "–".into()
        };
    }
    let per_round: Vec<f64> = x
        .iter()
        .zip(y.iter())
        .filter(|(_, b)| **b != 0.0)
        .map(|(a, b)| a / b)
        .filter(|r| r.is_finite())
        .collect();
    let r = median(&per_round);
    if !r.is_finite() {
        return "–".into();
    }
    let lo = per_round.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = per_round.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if spread && per_round.len() >= 2 {
        format!("{r:.2}x ({lo:.2}–{hi:.2})")
    } else {
        format!("{r:.2}x")
    }
}

/// The Markdown table: one row per (scenario, metric), the median of each
/// target's rounds, then the ratio columns (see [`ratio`]).
pub fn table(res: &Results, targets: &[Target]) -> String {
    let mut rows: BTreeMap<(String, String), BTreeMap<Target, &Vec<f64>>> = BTreeMap::new();
    for ((scen, metric, t), v) in &res.samples {
        rows.entry((scen.clone(), metric.clone()))
            .or_default()
            .insert(*t, v);
    }
    let shown: Vec<Target> = Target::ALL
        .iter()
        .copied()
        .filter(|t| targets.contains(t) || *t == Target::Hlb)
        .collect();
    let ratios: Vec<(Target, Target)> = RATIOS
        .into_iter()
        .chain(
            KERNEL_RATIOS
                .into_iter()
                .chain(LOG_RATIOS)
                .filter(|(a, _)| targets.contains(a)),
        )
        .collect();
    let mut s = String::from("| scenario | metric |");
    for t in &shown {
        let _ = write!(s, " {} |", t.name());
    }
    for (a, b) in &ratios {
        let _ = write!(s, " {} / {} |", a.short(), b.short());
    }
    s.push_str("\n|---|---|");
    for _ in 0..shown.len() + ratios.len() {
        s.push_str("---:|");
    }
    s.push('\n');
    for ((scen, metric), m) in &rows {
        let _ = write!(s, "| {scen} | {metric} |");
        for t in &shown {
            let _ = write!(
                s,
                " {} |",
                m.get(t).map_or("–".into(), |v| fmt_num(median(v)))
            );
        }
        for &(a, b) in &ratios {
            let _ = write!(s, " {} |", ratio(m, a, b, shows_spread(metric)));
        }
        s.push('\n');
    }
    s
}

/// What a reader of the table needs to know about its empty cells and
/// brackets.
pub fn notes(targets: &[Target]) -> String {
    let mut s = String::from(
        "Ratios of rates and CPU: median of the per-round ratios (min–max over the rounds).\n",
    );
    if targets.contains(&Target::HlbLogAll) || targets.contains(&Target::HlbLogErrors) {
        s.push_str(
            "hlb-log-errors, hlb-log-all: harvester-lb with log_connections = \"errors\" and \"all\" (--log-modes), each its own process on its own VIP, run in the same rounds as harvester-lb (log_connections = \"none\" unless HLB_LOG_CONNECTIONS says otherwise).\n",
        );
    }
    if targets.contains(&Target::Kernel) {
        s.push_str(
            "kernel: nftables DNAT in the output hook, no process of its own: its forwarding is softirq time on the client's and the backend's threads, so its CPU and RSS cells are –.\n",
        );
    }
    if targets.contains(&Target::HlbKernel) {
        s.push_str(
            "harvester-lb (kernel): the daemon with its listeners forwarding = \"kernel\" (source_nat = \"none\"), started for each of its runs and stopped after it; the kernel forwards (its nftables DNAT, in the output hook as the kernel target's), so its CPU and RSS cells are – as the kernel's. Both kernel targets' VIPs are on lo of the bench's own network namespace, where every target runs.\n",
        );
    }
    s
}

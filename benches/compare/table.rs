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
    /// Scenario-specific extra results (health, reload, idle).
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

/// The Markdown table: one row per (scenario, metric), the median of each
/// target's rounds, then the ratio columns.
pub fn table(res: &Results, targets: &[Target]) -> String {
    let mut rows: BTreeMap<(String, String), BTreeMap<Target, &Vec<f64>>> = BTreeMap::new();
    for ((scen, metric, t), v) in &res.samples {
        rows.entry((scen.clone(), metric.clone()))
            .or_default()
            .insert(*t, v);
    }
    let all = [Target::Direct, Target::Hlb, Target::Haproxy, Target::Nginx];
    let shown: Vec<Target> = all
        .iter()
        .copied()
        .filter(|t| targets.contains(t) || *t == Target::Hlb)
        .collect();
    let mut s = String::from("| scenario | metric |");
    for t in &shown {
        let _ = write!(s, " {} |", t.name());
    }
    s.push_str(" hlb / haproxy | hlb / direct | nginx / haproxy | nginx / direct |\n|---|---|");
    for _ in 0..shown.len() + 4 {
        s.push_str("---:|");
    }
    s.push('\n');
    let ratio = |m: &BTreeMap<Target, &Vec<f64>>, a: Target, b: Target| {
        let (Some(x), Some(y)) = (m.get(&a), m.get(&b)) else {
            return "–".into();
        };
        // Rounds interleave the targets, so the ratio within one round
        // cancels the machine's drift between rounds: the median of the
        // per-round ratios, when both have every round.
        let r = if x.len() == y.len() {
            median(
                &x.iter()
                    .zip(y.iter())
                    .filter(|(_, b)| **b != 0.0)
                    .map(|(a, b)| a / b)
                    .collect::<Vec<_>>(),
            )
        } else {
            median(x) / median(y)
        };
        if r.is_finite() {
            format!("{r:.2}x")
        } else {
            "–".into()
        }
    };
    for ((scen, metric), m) in &rows {
        let _ = write!(s, "| {scen} | {metric} |");
        for t in &shown {
            let _ = write!(
                s,
                " {} |",
                m.get(t).map_or("–".into(), |v| fmt_num(median(v)))
            );
        }
        let _ = writeln!(
            s,
            " {} | {} | {} | {} |",
            ratio(m, Target::Hlb, Target::Haproxy),
            ratio(m, Target::Hlb, Target::Direct),
            ratio(m, Target::Nginx, Target::Haproxy),
            ratio(m, Target::Nginx, Target::Direct)
        );
    }
    s
}

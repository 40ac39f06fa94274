//! `harvester-lb status`: the daemon's `/status` as a table for a terminal,
//! as `haproxy`'s `show stat` or `ipvsadm -L -n` show theirs: each load
//! balancer with its VIP, its listeners, and each backend's health, operator
//! state, consecutive counts, last probe result and age, and open
//! connections.
//!
//! It only renders the JSON the daemon serves (read by
//! [`super::admin_client::status`]); it computes nothing the daemon did
//! not say, so the table and `--json` never disagree.

use std::fmt::Write as _;

use serde_json::Value;

/// The config in force (path and SHA-256, to compare with `sha256sum`),
/// the last rejected reload with every problem while it stands, and the
/// keys that wait for a restart.
fn config_lines(out: &mut String, config: &Value, now_unix: f64) {
    let esc = |v: &Value| harvester_lb::text::escape(v.as_str().unwrap_or("-")).into_owned();
    let _ = writeln!(
        out,
        "config: {} sha256 {}",
        esc(&config["path"]),
        esc(&config["sha256"])
    );
    let rejected = &config["rejected_reload"];
    if rejected.is_object() {
        let ago = rejected["at_unix"]
            .as_f64()
            .map(|t| format!(" {}s ago", ((now_unix - t).max(0.0)).round()))
            .unwrap_or_default();
        let _ = writeln!(
            out,
            "last reload rejected{ago} (asked by {}; file sha256 {}); the config above stays in force:",
            esc(&rejected["source"]),
            esc(&rejected["sha256"])
        );
        for p in rejected["problems"].as_array().into_iter().flatten() {
            for line in p.as_str().unwrap_or_default().lines() {
                let _ = writeln!(out, "  {}", harvester_lb::text::escape(line));
            }
        }
    }
    let keys: Vec<String> = config["needs_restart"]
        .as_array()
        .into_iter()
        .flatten()
        .map(esc)
        .collect();
    if !keys.is_empty() {
        let _ = writeln!(
            out,
            "needs a restart: {} (the value in force stays until `systemctl restart harvester-lb`)",
            keys.join(", ")
        );
    }
}

/// A cell's text. Every cell goes through `text::escape`: a name holding
/// `\n` or `ESC[8m` (from a guest cluster's objects) cannot add a row or
/// hide one.
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => harvester_lb::text::escape(s).into_owned(),
        other => harvester_lb::text::escape(&other.to_string()).into_owned(),
    }
}

/// Renders `/status` (as JSON text) as tables; `now_unix` ages the probes.
pub fn render(status: &Value, now_unix: f64) -> String {
    let mut out = String::new();
    let ready = status["ready"].as_bool().unwrap_or(false);
    let _ = writeln!(
        out,
        "daemon: {}{}",
        if ready { "ready" } else { "NOT READY" },
        match status["config"]["problem"].as_str() {
            Some(p) => format!("; config: {}", harvester_lb::text::escape(p)),
            None => String::new(),
        }
    );
    if let Some(version) = status["version"].as_str() {
        let _ = writeln!(
            out,
            "harvester-lb {} (commit {}){}",
            harvester_lb::text::escape(version),
            text(&status["commit"]),
            status["uptime_seconds"]
                .as_f64()
                .map(|s| format!(", up {}", uptime(s)))
                .unwrap_or_default()
        );
    }
    let empty = Vec::new();
    config_lines(&mut out, &status["config"], now_unix);
    announce_lines(&mut out, status);
    // Load balancers the VIP guard refused: not served at all, so they
    // have no table of their own below.
    for r in status["vip_refused"].as_array().unwrap_or(&empty) {
        let _ = writeln!(
            out,
            "REFUSED {} (VIP {}, {}): {}",
            text(&r["load_balancer"]),
            text(&r["vip"]),
            text(&r["kind"]),
            text(&r["reason"])
        );
    }
    let lbs = status["load_balancers"].as_array().unwrap_or(&empty);
    if lbs.is_empty() {
        let _ = writeln!(out, "no load balancers");
    }
    for lb in lbs {
        load_balancer_tables(&mut out, lb, now_unix);
    }
    out
}

/// `vip.announce = "routes"`: one line per VIP, announced or why not.
fn announce_lines(out: &mut String, status: &Value) {
    let empty = Vec::new();
    if let Some(a) = status["announce"].as_object() {
        let _ = writeln!(
            out,
            "announce: routes in table {} on {}{}{}",
            text(&a["table"]),
            text(&a["interface"]),
            if a["host_drained"].as_bool() == Some(true) {
                "; host drained"
            } else {
                ""
            },
            a["error"]
                .as_str()
                .map(|e| format!("; error: {}", harvester_lb::text::escape(e)))
                .unwrap_or_default()
        );
        for v in a["vips"].as_array().unwrap_or(&empty) {
            let state = if v["announced"].as_bool() == Some(true) {
                "announced".to_string()
            } else {
                format!("withdrawn ({})", text(&v["reason"]))
            };
            let _ = writeln!(
                out,
                "  {} {state}, {} transitions{}",
                text(&v["vip"]),
                text(&v["transitions"]),
                v["error"]
                    .as_str()
                    .map(|e| format!("; error: {}", harvester_lb::text::escape(e)))
                    .unwrap_or_default()
            );
        }
    }
}

/// One load balancer's tables: itself, its listeners, its backends.
fn load_balancer_tables(out: &mut String, lb: &Value, now_unix: f64) {
    let empty = Vec::new();
    let backends = lb["backends"].as_array().unwrap_or(&empty);
    let _ = writeln!(out);
    let mut head = vec![
        row(&[
            "LOAD BALANCER",
            "CLUSTER",
            "VIP",
            "IPAM",
            "ALGORITHM",
            "CHECK",
            "AFFINITY",
            "ELIGIBLE",
        ]),
        vec![
            text(&lb["name"]),
            text(&lb["cluster"]),
            text(&lb["vip"]),
            text(&lb["ipam"]),
            text(&lb["algorithm"]),
            text(&lb["health_check_kind"]),
            text(&lb["session_affinity"]),
            format!("{}/{}", text(&lb["eligible_backends"]), backends.len()),
        ],
    ];
    table(out, "", &mut head);
    let mut listeners = vec![row(&[
        "LISTENER",
        "ADDRESS",
        "BACKEND PORT",
        "PROTO",
        "STATE",
        "CONNS",
        "ERROR",
    ])];
    for l in lb["listeners"].as_array().unwrap_or(&empty) {
        listeners.push(vec![
            text(&l["name"]),
            text(&l["address"]),
            text(&l["backend_port"]),
            text(&l["protocol"]),
            text(&l["state"]),
            text(&l["active_connections"]),
            text(&l["error"]),
        ]);
    }
    table(out, "  ", &mut listeners);
    let mut rows = vec![row(&[
        "BACKEND",
        "HEALTH",
        "ADMIN",
        "ELIGIBLE",
        "OK RUN",
        "FAIL RUN",
        "LAST",
        "AGE",
        "PROBES",
        "CONNS",
        "TOTAL",
        "BYTES IN/OUT",
        "CONN FAIL",
        "CHK FAIL",
        "DOWN",
        "CHANGED",
        "LAST ERROR",
    ])];
    for b in backends {
        let p = &b["probe"];
        // Absent from a daemon older than the totals: every cell `-`.
        let t = &b["totals"];
        let age = p["last_probe_unix"].as_f64().map_or("-".to_string(), |t| {
            format!("{:.1}s", (now_unix - t).max(0.0))
        });
        rows.push(vec![
            text(&b["address"]),
            text(&b["health"]),
            text(&b["admin_state"]),
            if b["eligible"].as_bool() == Some(true) {
                "yes"
            } else {
                "no"
            }
            .to_string(),
            text(&p["consecutive_successes"]),
            text(&p["consecutive_failures"]),
            text(&p["last_result"]),
            age,
            text(&p["probes"]),
            text(&b["active_connections"]),
            text(&t["connections"]),
            match (
                t["bytes_to_backend"].as_u64(),
                t["bytes_to_client"].as_u64(),
            ) {
                (Some(up), Some(down)) => format!("{}/{}", bytes(up), bytes(down)),
                _ => "-".to_string(),
            },
            text(&t["connect_failures"]),
            text(&t["check_failures"]),
            t["down_seconds"].as_f64().map_or("-".to_string(), uptime),
            t["last_change_unix"]
                .as_f64()
                .map_or("-".to_string(), |at| {
                    format!("{} ago", uptime(now_unix - at))
                }),
            text(&p["last_error"]),
        ]);
    }
    table(out, "  ", &mut rows);
}

fn row(cells: &[&str]) -> Vec<String> {
    cells.iter().map(|c| c.to_string()).collect()
}

/// Appends rows with every column as wide as its widest cell; trailing
/// spaces trimmed.
fn table(out: &mut String, indent: &str, rows: &mut [Vec<String>]) {
    let columns = rows.iter().map(Vec::len).max().unwrap_or(0);
    let widths: Vec<usize> = (0..columns)
        .map(|c| {
            rows.iter()
                .filter_map(|r| r.get(c))
                .map(|s| s.chars().count())
                .max()
                .unwrap_or(0)
        })
        .collect();
    for r in rows.iter() {
        let mut line = indent.to_string();
        for (c, cell) in r.iter().enumerate() {
            let _ = write!(line, "{cell:<w$}  ", w = widths[c]);
        }
        let _ = writeln!(out, "{}", line.trim_end());
    }
}

/// Bytes in binary units, three digits at most: "512", "1.5K", "23M", "4.0G".
fn bytes(n: u64) -> String {
    const UNITS: [&str; 6] = ["K", "M", "G", "T", "P", "E"];
    if n < 1024 {
        return n.to_string();
    }
    let mut v = n as f64 / 1024.0;
    let mut unit = 0;
    while v >= 1024.0 && unit + 1 < UNITS.len() {
        v /= 1024.0;
        unit += 1;
    }
    if v < 10.0 {
        format!("{v:.1}{}", UNITS[unit])
    } else {
        format!("{v:.0}{}", UNITS[unit])
    }
}

/// Seconds as the two largest units: "3d 4h", "2h 5m", "5m 12s", "12s".
fn uptime(seconds: f64) -> String {
    let s = seconds.max(0.0) as u64;
    let (d, h, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    match (d, h, m) {
        (0, 0, 0) => format!("{sec}s"),
        (0, 0, _) => format!("{m}m {sec}s"),
        (0, _, _) => format!("{h}h {m}m"),
        _ => format!("{d}d {h}h"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_backend_row_shows_health_admin_state_counts_and_age() {
        let status = serde_json::json!({
            "ready": true,
            "config": {"path": "/etc/x", "problem": null, "missing_since_unix": null},
            "load_balancers": [{
                "name": "default/web", "cluster": "prod", "vip": "10.0.0.10", "ipam": "pool",
                "algorithm": "round_robin", "health_check": true, "health_check_kind": "tcp",
                "session_affinity": "none", "eligible_backends": 1,
                "listeners": [{"name": "http", "address": "10.0.0.10:80", "backend_port": 30080,
                    "protocol": "tcp", "proxy_protocol": null, "state": "listening", "error": null,
                    "active_connections": 3}],
                "backends": [{"address": "10.0.0.1", "health": "unhealthy", "admin_state": "drain",
                    "eligible": false, "active_connections": 2,
                    "probe": {"status": "unhealthy", "consecutive_successes": 0, "consecutive_failures": 4,
                        "last_result": "refused", "last_error": "connection refused",
                        "last_probe_unix": 100.0, "probes": 9},
                    "totals": {"connections": 17, "bytes_to_backend": 1536,
                        "bytes_to_client": 5_000_000, "connect_failures": 3, "check_failures": 4,
                        "down_seconds": 75.4, "last_change_unix": 40.0}}]
            }]
        });
        let text = render(&status, 102.5);
        assert!(text.starts_with("daemon: ready\n"), "{text}");
        let line = text
            .lines()
            .find(|l| l.contains("10.0.0.1 "))
            .expect("backend row");
        let cells: Vec<&str> = line.split_whitespace().collect();
        assert_eq!(
            cells,
            [
                "10.0.0.1",
                "unhealthy",
                "drain",
                "no",
                "0",
                "4",
                "refused",
                "2.5s",
                "9",
                "2",
                "17",
                "1.5K/4.8M",
                "3",
                "4",
                "1m",
                "15s",
                "1m",
                "2s",
                "ago",
                "connection",
                "refused"
            ]
        );
        assert!(text.contains("  http      10.0.0.10:80  30080"), "{text}");
    }

    #[test]
    fn announced_vips_are_listed_with_why_not() {
        let status = serde_json::json!({
            "ready": true,
            "config": {"path": "/etc/x", "problem": null, "missing_since_unix": null},
            "load_balancers": [],
            "announce": {"mode": "routes", "table": 100, "interface": "lo", "protocol": 252,
                "host_drained": false, "error": null,
                "vips": [
                    {"vip": "203.0.113.50", "announced": true, "reason": null, "transitions": 1,
                        "since": 1.0, "rise_delay_seconds": 3.0, "drained": false, "error": null},
                    {"vip": "203.0.113.51", "announced": false, "reason": "no_eligible_backend",
                        "transitions": 2, "since": 1.0, "rise_delay_seconds": 6.0, "drained": false,
                        "error": null}
                ]}
        });
        let text = render(&status, 2.0);
        assert!(
            text.contains("announce: routes in table 100 on lo\n"),
            "{text}"
        );
        assert!(
            text.contains("  203.0.113.50 announced, 1 transitions\n"),
            "{text}"
        );
        assert!(
            text.contains("  203.0.113.51 withdrawn (no_eligible_backend), 2 transitions\n"),
            "{text}"
        );
    }

    #[test]
    fn refused_load_balancers_and_an_announce_error_are_shown() {
        let status = serde_json::json!({
            "ready": true,
            "config": {"path": "/etc/x", "problem": null, "missing_since_unix": null},
            "load_balancers": [],
            "vip_refused": [
                {"load_balancer": "t1/router", "vip": "192.0.2.1", "kind": "gateway",
                    "reason": "the gateway of this host's route `default via 192.0.2.1 dev eth0`"}
            ],
            "announce": {"mode": "routes", "table": 100, "interface": "lo", "protocol": 252,
                "host_drained": false, "error": "table 100 is announced by another daemon (pid 7)",
                "vips": []}
        });
        let text = render(&status, 2.0);
        assert!(
            text.contains("announce: routes in table 100 on lo; error: table 100 is announced by another daemon (pid 7)\n"),
            "{text}"
        );
        assert!(
            text.contains("REFUSED t1/router (VIP 192.0.2.1, gateway): the gateway of this host's route `default via 192.0.2.1 dev eth0`\n"),
            "{text}"
        );
    }

    #[test]
    fn hostile_names_cannot_add_or_hide_rows() {
        let status = serde_json::json!({
            "ready": false,
            "config": {"path": "/etc/x", "problem": "bad\nfile\u{1b}[2J", "missing_since_unix": null},
            "load_balancers": [{
                "name": "default/web\nFAKE ROW\u{1b}[8m", "cluster": "c\u{1b}]0;title\u{7}",
                "vip": "10.0.0.10", "ipam": "pool",
                "algorithm": "round_robin", "health_check": true, "health_check_kind": "tcp",
                "session_affinity": "none", "eligible_backends": 0,
                "listeners": [{"name": "h\rttp", "address": "10.0.0.10:80", "backend_port": 30080,
                    "protocol": "tcp", "proxy_protocol": null, "state": "failed",
                    "error": "cannot bind\n\u{9b}8m", "active_connections": 0}],
                "backends": [{"address": "10.0.0.1", "health": "unhealthy", "admin_state": "ready",
                    "eligible": false, "active_connections": 0,
                    "probe": {"status": "unhealthy", "consecutive_successes": 0, "consecutive_failures": 4,
                        "last_result": "refused", "last_error": "refused\u{1b}[8m",
                        "last_probe_unix": 100.0, "probes": 9}}]
            }]
        });
        let text = render(&status, 102.5);
        assert!(
            !text.chars().any(|c| c.is_control() && c != '\n'),
            "no control character but the row ends: {text:?}"
        );
        assert!(text.contains("default/web\\nFAKE ROW\\x1b[8m"), "{text}");
        assert!(text.contains("h\\rttp"), "{text}");
        assert!(
            text.starts_with("daemon: NOT READY; config: bad\\nfile\\x1b[2J\n"),
            "{text}"
        );
        assert!(!text.lines().any(|l| l.starts_with("FAKE ROW")), "{text}");
        let backend = text.lines().find(|l| l.contains("10.0.0.1 ")).expect("row");
        assert!(
            backend.contains("unhealthy") && backend.ends_with("refused\\x1b[8m"),
            "{backend}"
        );
    }
}

//! The Prometheus rules and the Grafana dashboard shipped in `config/`,
//! judged by the real tools:
//!
//! * `promtool check rules` and `promtool test rules` (the unit tests in
//!   `config/prometheus/harvester-lb.rules.test.yml`), and every metric the
//!   rules name is one the daemon exports;
//! * a real Prometheus server (Debian's `prometheus` package) on loopback,
//!   with a temporary storage directory and a 1 s scrape interval, scrapes
//!   a running daemon that forwards TCP and UDP, refuses, rejects and marks
//!   a backend down; every query of every dashboard panel and variable must return
//!   data, and every rule of the rules file must evaluate without error.
//!
//! CI (`CI` set) must have promtool and prometheus; elsewhere a missing tool
//! skips its test, saying so.

use crate::support;

use std::collections::BTreeSet;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use support::{
    Backend, Behaviour, Config, Daemon, Lb, Listener, Subnet, cannot_run, missing_tool,
    split_response, whoami,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::time::Instant;

const RULES: &str = "config/prometheus/harvester-lb.rules.yml";
const RULE_TESTS: &str = "config/prometheus/harvester-lb.rules.test.yml";
const DASHBOARD: &str = "config/grafana/harvester-lb.json";

fn repo(path: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(path)
}

/// Whether `tool` can be run; in CI a missing tool is a failure.
fn have(tool: &str) -> bool {
    !cannot_run(tool, [missing_tool(tool, "prometheus")])
}

/// Runs promtool with `args`; asserts it succeeds and returns what it said.
fn promtool(args: &[&str]) -> String {
    let out = Command::new("promtool")
        .args(args)
        .current_dir(repo("."))
        .output()
        .expect("run promtool");
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.status.success(), "promtool {args:?} failed:\n{said}");
    said
}

/// Every metric family name `src/metrics/names.rs` declares.
fn exported_families() -> BTreeSet<String> {
    let names = std::fs::read_to_string(repo("src/metrics/names.rs")).expect("read names.rs");
    let families: BTreeSet<String> = names
        .lines()
        .map(str::trim)
        .filter(|l| l.starts_with('"') && l.ends_with("\",") && !l.contains(' '))
        .map(|l| l.trim_matches(|c| c == '"' || c == ',').to_string())
        .collect();
    assert!(
        families.len() > 20,
        "read only {} names from names.rs",
        families.len()
    );
    families
}

/// The metric names an expression refers to (a histogram's `_bucket`,
/// `_sum` and `_count` named as their family). Recording rules' own names
/// (with a colon) are not metrics.
fn metric_names(expr: &str) -> BTreeSet<String> {
    let mut out = BTreeSet::new();
    let bytes = expr.as_bytes();
    let mut i = 0;
    while i < bytes.len() {
        let start = i;
        while i < bytes.len() && (bytes[i].is_ascii_alphanumeric() || bytes[i] == b'_') {
            i += 1;
        }
        if i > start {
            let word = &expr[start..i];
            let in_label_or_string = start > 0 && matches!(bytes[start - 1], b'"' | b'$' | b':');
            if (word.starts_with("harvester_lb_") || word.starts_with("process_"))
                && !in_label_or_string
                && bytes.get(i) != Some(&b':')
            {
                let family = ["_bucket", "_sum", "_count"]
                    .iter()
                    .find_map(|s| word.strip_suffix(s))
                    .unwrap_or(word);
                out.insert(family.to_string());
            }
        } else {
            i += 1;
        }
    }
    out
}

#[test]
fn rules_pass_promtool_check_and_their_unit_tests() {
    if !have("promtool") {
        return;
    }
    let said = promtool(&["check", "rules", RULES]);
    assert!(said.contains("SUCCESS"), "promtool check rules:\n{said}");
    let said = promtool(&["test", "rules", RULE_TESTS]);
    assert!(said.contains("SUCCESS"), "promtool test rules:\n{said}");

    // promtool checks syntax; a misspelt metric would only never fire.
    let rules = std::fs::read_to_string(repo(RULES)).expect("read rules");
    let families = exported_families();
    let used = metric_names(&rules);
    assert!(used.len() > 10, "found only {used:?} in the rules");
    let unknown: Vec<_> = used.difference(&families).collect();
    assert!(
        unknown.is_empty(),
        "the rules name metrics the daemon does not export: {unknown:?}"
    );

    // Every alert has at least one unit test that expects it to fire.
    let tests = std::fs::read_to_string(repo(RULE_TESTS)).expect("read rule tests");
    let alerts: Vec<&str> = rules
        .lines()
        .filter_map(|l| l.trim().strip_prefix("- alert: "))
        .collect();
    assert!(alerts.len() >= 10, "found only {alerts:?}");
    for alert in alerts {
        let fires = tests
            .split("alertname: ")
            .skip(1)
            .any(|case| case.starts_with(&format!("{alert}\n")) && case.contains("exp_labels:"));
        assert!(
            fires,
            "no unit test in {RULE_TESTS} expects {alert} to fire"
        );
    }
}

/// Every `expr` in the dashboard (panels, rows' panels), and each query
/// variable's `label_values(METRIC, LABEL)` as the PromQL that answers it.
fn dashboard_queries() -> Vec<(String, String)> {
    let text = std::fs::read_to_string(repo(DASHBOARD)).expect("read dashboard");
    let dash: serde_json::Value = serde_json::from_str(&text).expect("the dashboard is JSON");
    let mut out = Vec::new();
    fn walk(v: &serde_json::Value, title: &str, out: &mut Vec<(String, String)>) {
        match v {
            serde_json::Value::Object(map) => {
                let title = map.get("title").and_then(|t| t.as_str()).unwrap_or(title);
                if let Some(expr) = map.get("expr").and_then(|e| e.as_str()) {
                    out.push((title.to_string(), expr.to_string()));
                }
                for (k, child) in map {
                    if k != "templating" {
                        walk(child, title, out);
                    }
                }
            }
            serde_json::Value::Array(items) => items.iter().for_each(|i| walk(i, title, out)),
            _ => {}
        }
    }
    walk(&dash["panels"], "", &mut out);
    let panels = out.len();
    assert!(panels >= 25, "only {panels} panel queries in {DASHBOARD}");
    for var in dash["templating"]["list"].as_array().expect("templating") {
        if var["type"] != "query" {
            continue;
        }
        let query = var["query"]["query"].as_str().expect("variable query");
        let inner = query
            .strip_prefix("label_values(")
            .and_then(|q| q.strip_suffix(')'))
            .unwrap_or_else(|| panic!("variable {} is not label_values(): {query}", var["name"]));
        let (metric, label) = inner.rsplit_once(',').expect("label_values(METRIC, LABEL)");
        out.push((
            format!("variable {}", var["name"]),
            format!("count by ({}) ({})", label.trim(), metric.trim()),
        ));
    }
    out
}

/// The expression with Grafana's variables set as the dashboard's "All"
/// and a 1 s scrape interval would set them.
fn instantiate(expr: &str) -> String {
    let mut e = expr
        .replace("$__rate_interval", "15s")
        .replace("$__interval", "5s")
        .replace("$__range", "1m");
    for var in ["load_balancer", "instance", "cluster", "job"] {
        e = e
            .replace(&format!("${{{var}}}"), ".*")
            .replace(&format!("${var}"), ".*");
    }
    assert!(!e.contains('$'), "an unknown Grafana variable in {expr}");
    e
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'A'..=b'Z' | b'a'..=b'z' | b'0'..=b'9' | b'-' | b'_' | b'.' | b'~' => {
                (b as char).to_string()
            }
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// One `GET` with `Connection: close`: status and body, or why not (a
/// server that is still starting refuses the connection).
async fn get(addr: SocketAddr, path: &str) -> Result<(u16, String), String> {
    let exchange = async {
        let mut s = tokio::net::TcpStream::connect(addr).await?;
        s.write_all(
            format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes(),
        )
        .await?;
        let mut raw = Vec::new();
        s.read_to_end(&mut raw).await?;
        Ok::<_, std::io::Error>(split_response(&String::from_utf8_lossy(&raw)))
    };
    match tokio::time::timeout(Duration::from_secs(10), exchange).await {
        Ok(Ok(answer)) => Ok(answer),
        Ok(Err(e)) => Err(format!("GET http://{addr}{path}: {e}")),
        Err(_) => Err(format!("GET http://{addr}{path}: no answer within 10 s")),
    }
}

/// A Prometheus server of our own; killed (by its pid) when dropped.
struct Prometheus {
    child: Child,
    addr: SocketAddr,
    log: PathBuf,
}

impl Prometheus {
    fn start(net: &Subnet, target: SocketAddr) -> Self {
        let addr = SocketAddr::new(net.ip(251), 9090);
        let config = net.write(
            "prometheus.yml",
            &format!(
                "global:\n  scrape_interval: 1s\n  scrape_timeout: 1s\n  evaluation_interval: 1s\n\
                 rule_files:\n  - {rules}\n\
                 scrape_configs:\n  - job_name: harvester-lb\n    static_configs:\n      - targets: [\"{target}\"]\n",
                rules = repo(RULES).display()
            ),
        );
        let storage = net.dir().join("tsdb");
        let log = net.dir().join("prometheus.log");
        let child = Command::new("prometheus")
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", storage.display()))
            .arg(format!("--web.listen-address={addr}"))
            .arg("--log.level=warn")
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&log).expect("log file"))
            .stderr(std::fs::File::create(net.dir().join("prometheus.err")).expect("log"))
            .spawn()
            .expect("start prometheus");
        Self { child, addr, log }
    }

    fn logs(&self) -> String {
        let err = self.log.with_file_name("prometheus.err");
        format!(
            "{}{}",
            std::fs::read_to_string(&self.log).unwrap_or_default(),
            std::fs::read_to_string(err).unwrap_or_default()
        )
    }

    /// An instant query; the JSON answer's `data.result`, if the query ran.
    async fn query(&self, expr: &str) -> Result<Vec<serde_json::Value>, String> {
        let (code, body) = get(
            self.addr,
            &format!("/api/v1/query?query={}", url_encode(expr)),
        )
        .await?;
        let v: serde_json::Value = serde_json::from_str(&body)
            .map_err(|e| format!("HTTP {code}, not JSON ({e}): {body}"))?;
        if v["status"] != "success" {
            return Err(format!("HTTP {code}: {body}"));
        }
        Ok(v["data"]["result"].as_array().cloned().unwrap_or_default())
    }
}

impl Drop for Prometheus {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn config(net: &Subnet) -> String {
    let lb = |name: &str, vip: u8, backends: &[u8]| {
        Lb::new(name, net.ip(vip))
            .keys("cluster = \"prod\"")
            .backends(net.ips(backends))
            .tcp("http", 8080, 30080)
    };
    // A UDP listener beside the TCP one.
    let udp = || Listener::new("dns", 8053, 30053).udp();
    let check = |port: u16| {
        format!(
            "  port = {port}\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1"
        )
    };
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        // Forwards to .11 (TCP and UDP); .13 has no listener: marked down (a
        // transition).
        .lb(lb("default/web", 1, &[11, 13])
            .health(&check(30080))
            .listener(udp()))
        // .12 answers its health port but refuses the nodeport: connect
        // failures; nothing on its UDP port either: ICMP errors.
        .lb(lb("default/refusing", 2, &[12])
            .health(&check(30081))
            .listener(udp()))
        // No backend at all: clients fail with no_backend, UDP flows too.
        .lb(lb("default/empty", 3, &[]).listener(udp()))
        // A per-listener check (no port): backend_port_up.
        .lb(lb("default/per-port", 5, &[11]).health("  period_seconds = 1\n  timeout_seconds = 1"))
        // Every client here is outside the source ranges: rejected.
        .lb(lb("default/ranged", 4, &[11])
            .keys("source_ranges = [\"192.0.2.0/24\"]")
            .listener(udp()))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_dashboard_query_returns_data_from_a_real_prometheus() {
    if !have("prometheus") {
        return;
    }
    let queries = dashboard_queries();
    let net = Subnet::new();
    let _web = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let _health_only =
        Backend::start(SocketAddr::new(net.ip(12), 30081), Behaviour::NameThenEcho).await;
    let udp_echo = support::udp_echo(SocketAddr::new(net.ip(11), 30053)).await;
    let daemon = Daemon::start(&net, &config(&net)).await;
    let prometheus = Prometheus::start(&net, daemon.admin);

    // Every metric the dashboard names is one the daemon exports.
    let (_, exposition) = daemon.get("/metrics").await;
    let families = exported_families();
    for (title, expr) in &queries {
        for name in metric_names(expr) {
            assert!(
                families.contains(&name),
                "panel {title:?} names {name}, which the daemon does not export"
            );
        }
    }
    // The descriptor gauges are this (test) process's own, and plausible.
    let open = support::metric_value(&exposition, "process_open_fds ");
    let max = support::metric_value(&exposition, "process_max_fds ");
    assert!(
        open >= 10.0 && open < max,
        "process_open_fds {open}, process_max_fds {max}"
    );
    let limit = support::metric_value(&exposition, "harvester_lb_connections_limit ");
    assert!(limit >= 16.0, "harvester_lb_connections_limit {limit}");

    // Traffic until the queries are answered: forwarded, refused by the
    // backend, without a backend, outside the source ranges.
    let stop = Arc::new(AtomicBool::new(false));
    let traffic = {
        let stop = Arc::clone(&stop);
        let vips: Vec<SocketAddr> = (1..=5).map(|h| SocketAddr::new(net.ip(h), 8080)).collect();
        let client_ip = net.ip(200);
        tokio::spawn(async move {
            let udp = tokio::net::UdpSocket::bind(SocketAddr::new(client_ip, 0))
                .await
                .expect("bind the UDP client");
            let mut buf = [0u8; 2048];
            while !stop.load(Ordering::Relaxed) {
                // UDP: answered through default/web, refused by .12,
                // dropped without a backend or outside the source ranges.
                for vip in &vips[..4] {
                    let _ = udp.send_to(b"query", SocketAddr::new(vip.ip(), 8053)).await;
                }
                let _ =
                    tokio::time::timeout(Duration::from_millis(200), udp.recv_from(&mut buf)).await;
                if let Ok(mut s) = tokio::net::TcpStream::connect(vips[0]).await {
                    let _ = s.write_all(b"hello through the load balancer\n").await;
                }
                let _ = whoami(vips[0]).await;
                for vip in &vips[1..] {
                    let _ = tokio::time::timeout(
                        Duration::from_secs(2),
                        tokio::net::TcpStream::connect(vip),
                    )
                    .await;
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        })
    };

    // Prometheus up and scraping (until then, its port refuses).
    let deadline = Instant::now() + Duration::from_secs(30);
    loop {
        if let Ok(r) = prometheus.query("up{job=\"harvester-lb\"} == 1").await
            && !r.is_empty()
        {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "prometheus did not scrape the daemon within 30 s:\n{}",
            prometheus.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }

    // Every query answers with data, within a deadline: rates need two
    // scrapes, the transition needs the probe of the dead backend.
    let mut pending: Vec<(String, String, String)> = queries
        .iter()
        .map(|(t, e)| (t.clone(), instantiate(e), String::new()))
        .collect();
    let total = pending.len();
    let deadline = Instant::now() + Duration::from_secs(40);
    while !pending.is_empty() && Instant::now() < deadline {
        let mut still = Vec::new();
        for (title, expr, _) in pending {
            match prometheus.query(&expr).await {
                Ok(result) if !result.is_empty() => {}
                Ok(_) => still.push((title, expr, "empty result".to_string())),
                Err(e) => {
                    // A query Prometheus rejects will not get better.
                    panic!("panel {title:?}: Prometheus rejected `{expr}`: {e}")
                }
            }
        }
        pending = still;
        if !pending.is_empty() {
            tokio::time::sleep(Duration::from_millis(500)).await;
        }
    }
    assert!(
        pending.is_empty(),
        "{} of {total} dashboard queries returned no data within 40 s:\n{}",
        pending.len(),
        pending
            .iter()
            .map(|(t, e, why)| format!("  {t}: {e} ({why})"))
            .collect::<Vec<_>>()
            .join("\n")
    );

    // The rules loaded and every one evaluates without error on real data.
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let (_, body) = get(prometheus.addr, "/api/v1/rules")
            .await
            .expect("prometheus answers");
        let v: serde_json::Value = serde_json::from_str(&body).expect("rules JSON");
        let rules: Vec<&serde_json::Value> = v["data"]["groups"]
            .as_array()
            .map(|g| {
                g.iter()
                    .flat_map(|g| g["rules"].as_array().into_iter().flatten())
                    .collect()
            })
            .unwrap_or_default();
        let bad: Vec<String> = rules
            .iter()
            .filter(|r| r["health"] != "ok")
            .map(|r| format!("{} {}: {}", r["name"], r["health"], r["lastError"]))
            .collect();
        let errors: Vec<&String> = bad.iter().filter(|b| b.contains("\"err\"")).collect();
        assert!(errors.is_empty(), "rules failed to evaluate: {errors:?}");
        if rules.len() >= 20 && bad.is_empty() {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "rules not all evaluated within 20 s ({} loaded): {bad:?}\n{}",
            rules.len(),
            prometheus.logs()
        );
        tokio::time::sleep(Duration::from_millis(300)).await;
    }

    stop.store(true, Ordering::Relaxed);
    traffic.await.expect("traffic task");
    udp_echo.abort();
    drop(prometheus);
    daemon.stop().await;
}

//! Scenario 7: scale. 10,000 load balancers of 3 health-checked backends
//! each: start to ready, memory and probe CPU at rest, `/metrics` scrapes,
//! reloads under load; HAProxy with the same frontends for reference.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr};
use std::process::Command;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

use super::probes::{ProbeTargets, SynCapture};
use super::reload::reloads_under_load;
use crate::Opts;
use crate::procfs::{cpu_seconds_tree, rss_tree};
use crate::table::Results;
use crate::targets::{ADMIN_PORT, HAPROXY_IP, HLB_IP, HTTP_PORT, Proc, Target};
use crate::util::{http_body, http_get_within, sa, sh, try_wait_port};

/// Load balancer i listens on 127.247.(i / 250).(i % 250 + 1):SCALE_PORT
/// and forwards to HTTP_PORT on its backends 127.(244 + j).(i / 250).(i % 250 + 1),
/// j = 0..3, which are checked on SCALE_PROBE_PORT: one address per backend,
/// the three backend /16s together one /14 for the capture filter.
const SCALE_PORT: u16 = 18090;
const SCALE_PROBE_PORT: u16 = 30998;
/// The load balancer that reloads of the scale scenario add and remove; its
/// index is past every other one (`--scale-lbs` stays below it).
pub const SCALE_MARKER: usize = 63_999;
/// Harvester's default check period (healthcheck-periodseconds), seconds.
const SCALE_PERIOD: u64 = 5;

fn scale_vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 247, (i / 250) as u8, (i % 250 + 1) as u8)
}

pub fn scale_backend(i: usize, j: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 244 + j as u8, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// The capture's number of backend `j` of load balancer `i`: `j * n + i`.
fn scale_target_index(ip: Ipv4Addr, n: usize) -> Option<usize> {
    let [_, b, c, d] = ip.octets();
    let j = usize::from(b.checked_sub(244)?);
    let i = usize::from(c) * 250 + usize::from(d).checked_sub(1)?;
    (j < 3 && i < n).then_some(j * n + i)
}

/// harvester-lb config of the scale scenario: `n` load balancers the way the
/// Harvester controller writes them (namespaced names, 20 guest clusters,
/// one listener, 3 nodes, the default 5 s check), plus the marker one that
/// reloads add and remove. `max_connections = 2000`: 10,000 listeners plus
/// up to three descriptors per connection stay under the open-file limit of
/// 20,000.
fn hlb_scale_config(n: usize, marker: bool) -> String {
    let mut s = format!(
        "[admin]\nlisten = \"{HLB_IP}:{}\"\n[proxy]\nmax_connections = 2000\n",
        ADMIN_PORT + 3
    );
    for i in (0..n).chain(marker.then_some(SCALE_MARKER)) {
        let name = if i == SCALE_MARKER {
            "bench/marker".to_string()
        } else {
            format!("ns-{}/svc-{i}", i % 50)
        };
        let _ = write!(
            s,
            "[[load_balancer]]\nname = \"{name}\"\ncluster = \"guest-{}\"\nvip = \"{}\"\nbackends = [\"{}\", \"{}\", \"{}\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = {SCALE_PORT}\n  backend_port = {HTTP_PORT}\n  [load_balancer.health_check]\n  port = {SCALE_PROBE_PORT}\n  period_seconds = {SCALE_PERIOD}\n  timeout_seconds = 3\n",
            i % 20,
            scale_vip(i),
            scale_backend(i, 0),
            scale_backend(i, 1),
            scale_backend(i, 2)
        );
    }
    s
}

/// HAProxy config of the same load balancers: a `listen` section (frontend
/// and backend in one) each, HAProxy's default TCP check of the same port
/// every 5 s, timing out with the connect timeout (3 s) and with the same
/// thresholds; one thread as in the health scenario, `maxconn` as
/// harvester-lb's `max_connections`. The Prometheus exporter (when built in)
/// has a frontend of its own, bound last: once it accepts, every listener is.
/// `no strict-limits`: HAProxy reserves a descriptor per listener and per
/// check besides two per connection (54,014 here) and by default refuses to
/// start when the hard limit (20,000) is lower; the checks are short-lived,
/// so it runs well within the limit it gets.
fn haproxy_scale_config(n: usize, promex: bool) -> String {
    let mut s = String::from(
        "global\n  nbthread 1\n  maxconn 2000\n  no strict-limits\n  log stderr format short local0 err\ndefaults\n  mode tcp\n  timeout connect 3s\n  timeout client 1h\n  timeout server 1h\n",
    );
    for i in 0..n {
        let _ = write!(
            s,
            "listen ns-{}_svc-{i}\n  bind {}:{SCALE_PORT}\n  default-server check port {SCALE_PROBE_PORT} inter {SCALE_PERIOD}s fall 3 rise 1\n",
            i % 50,
            scale_vip(i)
        );
        for j in 0..3 {
            let _ = writeln!(s, "  server b{j} {}:{HTTP_PORT}", scale_backend(i, j));
        }
    }
    let _ = write!(
        s,
        "frontend stats\n  bind {HAPROXY_IP}:{}\n  timeout client 30s\n",
        ADMIN_PORT + 3
    );
    if promex {
        s.push_str(
            "  mode http\n  http-request use-service prometheus-exporter if { path /metrics }\n",
        );
    }
    s
}

/// A proxy of the scale scenario at rest: resident memory after two probe
/// periods; its CPU over a window; then the probes it sends, counted by
/// their SYNs in a second window (the capture's cost lands on the sender,
/// so it stays out of the CPU window, as in the health scenario).
struct AtRest {
    rss: u64,
    cpu_s: f64,
    cpu_wall_s: f64,
    probes: usize,
    capture_wall_s: f64,
    unprobed: usize,
}

impl AtRest {
    fn measure(o: &Opts, pid: i32) -> AtRest {
        let n = o.scale_lbs;
        std::thread::sleep(Duration::from_secs(2 * SCALE_PERIOD));
        let rss = rss_tree(pid);
        let window = Duration::from_secs(o.scale_window);
        let cpu0 = cpu_seconds_tree(pid);
        let t0 = Instant::now();
        std::thread::sleep(window);
        let cpu_s = cpu_seconds_tree(pid) - cpu0;
        let cpu_wall_s = t0.elapsed().as_secs_f64();
        let capture = SynCapture::start(
            3 * n,
            &o.work,
            SCALE_PROBE_PORT,
            "127.244.0.0/14",
            move |ip| scale_target_index(ip, n),
        );
        let c0 = Instant::now();
        std::thread::sleep(window);
        let capture_wall_s = c0.elapsed().as_secs_f64();
        let arrivals = capture.finish();
        AtRest {
            rss,
            cpu_s,
            cpu_wall_s,
            probes: arrivals.iter().map(Vec::len).sum(),
            capture_wall_s,
            unprobed: arrivals.iter().filter(|a| a.is_empty()).count(),
        }
    }

    fn probes_per_s(&self) -> f64 {
        self.probes as f64 / self.capture_wall_s
    }

    /// CPU per probe, µs: the CPU window's seconds over the probes the
    /// captured rate puts in it.
    fn cpu_per_probe_us(&self) -> f64 {
        self.cpu_s * 1e6 / (self.probes_per_s() * self.cpu_wall_s)
    }
}

/// One GET of `path`: wall time, the body's lines, samples (lines that are
/// not comments) and bytes, and how much the process tree grew over it (RSS
/// right after the last byte minus right before the request).
struct Scrape {
    ms: f64,
    lines: usize,
    samples: usize,
    bytes: usize,
    rss_growth: i64,
}

fn scrape(addr: SocketAddr, path: &str, pid: i32) -> Result<Scrape, String> {
    let before = rss_tree(pid);
    let t0 = Instant::now();
    let resp = http_get_within(addr, path, Duration::from_secs(120))
        .map_err(|e| format!("GET {path}: {e}"))?;
    let ms = t0.elapsed().as_secs_f64() * 1000.0;
    let after = rss_tree(pid);
    let body = http_body(&resp)
        .ok_or_else(|| format!("GET {path}: {}", resp.lines().next().unwrap_or("no answer")))?;
    Ok(Scrape {
        ms,
        lines: body.lines().count(),
        samples: body
            .lines()
            .filter(|l| !l.is_empty() && !l.starts_with('#'))
            .count(),
        bytes: body.len(),
        rss_growth: after as i64 - before as i64,
    })
}

/// The rows both proxies have; their figures as JSON.
fn scale_rows(
    res: &mut Results,
    scen: &str,
    target: Target,
    ready_s: f64,
    rest: &AtRest,
    scrapes: &[Scrape],
    backends: usize,
) -> Value {
    let kib = |b: f64| b / 1024.0;
    res.add(scen, "start → ready s", target, ready_s);
    res.add(scen, "RSS MiB at rest", target, kib(kib(rest.rss as f64)));
    res.add(
        scen,
        "RSS KiB per backend at rest",
        target,
        kib(rest.rss as f64) / backends as f64,
    );
    res.add(
        scen,
        "probes/s (SYNs captured)",
        target,
        rest.probes_per_s(),
    );
    res.add(
        scen,
        "probe CPU µs per probe",
        target,
        rest.cpu_per_probe_us(),
    );
    for (k, sc) in scrapes.iter().enumerate() {
        res.add(scen, &format!("scrape {} ms", k + 1), target, sc.ms);
        res.add(
            scen,
            &format!("scrape {} RSS growth KiB", k + 1),
            target,
            kib(sc.rss_growth as f64),
        );
    }
    if let Some(sc) = scrapes.last() {
        res.add(scen, "scrape lines", target, sc.lines as f64);
        res.add(scen, "scrape bytes", target, sc.bytes as f64);
    }
    eprintln!(
        "scale {}: ready in {ready_s:.2} s, RSS {:.1} MiB ({:.2} KiB per backend), {:.0} probes/s ({} of {backends} targets unprobed in {:.0} s), {:.1} µs CPU per probe; scrapes {}",
        target.name(),
        kib(kib(rest.rss as f64)),
        kib(rest.rss as f64) / backends as f64,
        rest.probes_per_s(),
        rest.unprobed,
        rest.capture_wall_s,
        rest.cpu_per_probe_us(),
        scrapes
            .iter()
            .map(|s| format!(
                "{:.0} ms, {} lines, {} bytes, RSS {:+.0} KiB",
                s.ms,
                s.lines,
                s.bytes,
                kib(s.rss_growth as f64)
            ))
            .collect::<Vec<_>>()
            .join("; ")
    );
    json!({"ready_s": ready_s, "rss_bytes": rest.rss, "rss_kib_per_backend": kib(rest.rss as f64) / backends as f64,
           "cpu_window_s": rest.cpu_wall_s, "cpu_s": rest.cpu_s, "capture_window_s": rest.capture_wall_s,
           "probes_captured": rest.probes, "probes_per_s": rest.probes_per_s(),
           "unprobed_targets": rest.unprobed, "cpu_us_per_probe": rest.cpu_per_probe_us(),
           "scrapes": scrapes.iter().map(|s| json!({"ms": s.ms, "lines": s.lines, "samples": s.samples,
               "bytes": s.bytes, "rss_growth_bytes": s.rss_growth})).collect::<Vec<_>>()})
}

/// Scale: `--scale-lbs` load balancers (10,000) of 3 backends each, checked
/// every 5 s, at rest, scraped, and (harvester-lb) reloaded under load.
/// Backends are served by the HTTP backend on `0.0.0.0` and probed on one
/// listener on `0.0.0.0`, both tied to `lo`: 30,000 addresses, a handful of
/// descriptors next to the daemon's 10,000 listeners under the open-file
/// limit of 20,000.
pub fn scale_scenario(o: &Opts, res: &mut Results) {
    let n = o.scale_lbs;
    let backends = 3 * n;
    let scen = format!("7 scale ({n} LBs × 3 backends)");
    let scen = scen.as_str();
    let _targets = ProbeTargets::loopback(SCALE_PROBE_PORT);
    let mut extra = serde_json::Map::new();
    extra.insert("load_balancers".into(), json!(n));
    extra.insert("backends".into(), json!(backends));
    extra.insert("period_s".into(), json!(SCALE_PERIOD));
    extra.insert(
        "probes_per_s_scheduled".into(),
        json!(backends as f64 / SCALE_PERIOD as f64),
    );
    res.commands.insert(
        "scale".into(),
        format!(
            "{n} load balancers x 3 backends, checked every {SCALE_PERIOD} s: harvester-lb run --threads 1; haproxy -db (nbthread 1)"
        ),
    );

    let configs = [hlb_scale_config(n, false), hlb_scale_config(n, true)];
    let admin = sa(HLB_IP, ADMIN_PORT + 3);
    let t0 = Instant::now();
    let mut proc = o.hlb().start("hlb-scale", &configs[0], admin, 1);
    let ready_s = t0.elapsed().as_secs_f64();
    let rest = AtRest::measure(o, proc.pid());
    if rest.probes == 0 {
        res.fail("scale: no probe of harvester-lb captured".into());
    }
    let mut scrapes = Vec::new();
    for k in 1..=2 {
        match scrape(admin, "/metrics", proc.pid()) {
            Ok(s) => scrapes.push(s),
            Err(e) => res.fail(format!("scale: harvester-lb scrape {k}: {e}")),
        }
    }
    match scrape(admin, "/status", proc.pid()) {
        Ok(s) => {
            res.add(scen, "/status bytes", Target::Hlb, s.bytes as f64);
            extra.insert("hlb_status_bytes".into(), json!(s.bytes));
        }
        Err(e) => res.fail(format!("scale: harvester-lb {e}")),
    }
    let mut hlb = scale_rows(res, scen, Target::Hlb, ready_s, &rest, &scrapes, backends);
    // The yardstick for the probe cost: the health scenario's cost
    // per probe at 5,000 targets, when it ran in this run.
    if let Some(h) = res.extra.get("health").and_then(|h| h.get("harvester-lb"))
        && let (Some(pct), Some(rate)) = (
            h.get("cpu_percent_of_one_core").and_then(Value::as_f64),
            h.get("probes_per_s").and_then(Value::as_f64),
        )
    {
        let at_5000 = pct * 1e4 / rate;
        eprintln!(
            "scale harvester-lb: {:.1} µs CPU per probe; {at_5000:.1} µs at {} targets (health scenario)",
            rest.cpu_per_probe_us(),
            o.probe_targets
        );
        hlb["health_scenario_cpu_us_per_probe"] = json!(at_5000);
    }
    // Clients spread over every load balancer.
    let run = reloads_under_load(
        res,
        &proc,
        &o.work.join("hlb-scale.toml"),
        &configs,
        sa(scale_vip(SCALE_MARKER), SCALE_PORT),
        o.scale_reloads,
        &format!("scale reload ({n} LBs)"),
        move |k| sa(scale_vip(k * 7919 % n), SCALE_PORT),
    );
    if !proc.alive() {
        res.fail("scale: harvester-lb exited during the run".into());
    }
    drop(proc);
    let (med, p99, max) = run.stats();
    res.add(scen, "SIGHUP→in force ms (median)", Target::Hlb, med);
    res.add(scen, "SIGHUP→in force ms (max)", Target::Hlb, max);
    res.add(scen, "failed client conns", Target::Hlb, run.failed as f64);
    res.add(scen, "ok client conns", Target::Hlb, run.ok as f64);
    hlb["reload"] = json!({"reloads": o.scale_reloads, "times_ms": run.times_ms, "median_ms": med,
        "p99_ms": p99, "max_ms": max, "client_ok": run.ok, "client_failed": run.failed,
        "first_errors": run.first_errors});
    run.check(res, "scale reload");
    extra.insert(Target::Hlb.name().into(), hlb);

    // HAProxy, after harvester-lb has stopped, for reference. Its reload is
    // left out: it starts a new process (`-sf`), another model than a
    // running daemon taking a new config. nginx is left out of the whole
    // scenario: open-source nginx has no active health checks.
    if o.targets.contains(&Target::Haproxy) {
        let promex = sh("haproxy -vv 2>&1").contains("prometheus-exporter");
        if !promex {
            eprintln!("scale: this HAProxy has no Prometheus exporter; no scrape rows for it");
        }
        let cfg = o.work.join("haproxy-scale.cfg");
        std::fs::write(&cfg, haproxy_scale_config(n, promex)).expect("write");
        let log = o.work.join("haproxy-scale.log");
        let stats = sa(HAPROXY_IP, ADMIN_PORT + 3);
        let t0 = Instant::now();
        let mut proc = Proc::spawn(
            "haproxy-scale",
            Command::new("haproxy").arg("-db").arg("-f").arg(&cfg),
            &log,
        );
        if try_wait_port(stats, Duration::from_secs(120)) {
            let ready_s = t0.elapsed().as_secs_f64();
            let rest = AtRest::measure(o, proc.pid());
            let mut scrapes = Vec::new();
            for k in 1..=2 {
                if !promex {
                    break;
                }
                match scrape(stats, "/metrics", proc.pid()) {
                    Ok(s) => scrapes.push(s),
                    Err(e) => res.fail(format!("scale: haproxy scrape {k}: {e}")),
                }
            }
            let v = scale_rows(
                res,
                scen,
                Target::Haproxy,
                ready_s,
                &rest,
                &scrapes,
                backends,
            );
            extra.insert(Target::Haproxy.name().into(), v);
            if !proc.alive() {
                res.fail("scale: haproxy exited during the run".into());
            }
        } else {
            res.fail(format!(
                "scale: haproxy not listening on {stats} after 120 s"
            ));
        }
        drop(proc);
        // What HAProxy said about the config (descriptor limits, say).
        let said = std::fs::read_to_string(&log).unwrap_or_default();
        for line in said
            .lines()
            .filter(|l| l.contains("ALERT") || l.contains("WARNING"))
            .take(5)
        {
            eprintln!("haproxy-scale: {line}");
        }
    }
    res.extra.insert("scale".into(), Value::Object(extra));
}

//! Scenario 6: reloads. A config of 1,000 load balancers, SIGHUP to a new
//! one, 20 times, timed until the change is in force, while clients keep
//! connecting; [`reloads_under_load`] is shared with the scale scenario.

use std::fmt::Write as _;
use std::net::{Ipv4Addr, SocketAddr, TcpStream};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::json;

use crate::Opts;
use crate::table::{Results, median, percentile};
use crate::targets::{ADMIN_PORT, BACKEND_IP, HLB_IP, HTTP_PORT, Proc, Target};
use crate::util::{http_get, sa, signal};

/// Load balancer i listens on 127.253.(i / 250).(i % 250 + 1):HTTP_PORT;
/// reloads add and remove the one on the marker address.
const RELOAD_MARKER: Ipv4Addr = Ipv4Addr::new(127, 253, 100, 1);

fn reload_lb_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 253, (i / 250) as u8, (i % 250 + 1) as u8)
}

fn hlb_reload_config(n: usize, marker: bool) -> String {
    let mut s = format!(
        "[admin]\nlisten = \"{HLB_IP}:{}\"\n[proxy]\nmax_connections = 15000\n",
        ADMIN_PORT + 2
    );
    let lb = |s: &mut String, name: &str, vip: Ipv4Addr| {
        let _ = write!(
            s,
            "[[load_balancer]]\nname = \"{name}\"\nvip = \"{vip}\"\nbackends = [\"{BACKEND_IP}\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = {HTTP_PORT}\n  backend_port = {HTTP_PORT}\n  [load_balancer.health_check]\n  port = {HTTP_PORT}\n  period_seconds = 5\n  timeout_seconds = 1\n"
        );
    };
    for i in 0..n {
        lb(&mut s, &format!("bench/lb-{i}"), reload_lb_ip(i));
    }
    if marker {
        lb(&mut s, "bench/marker", RELOAD_MARKER);
    }
    s
}

pub fn reload_scenario(o: &Opts, res: &mut Results) {
    let n = o.reload_lbs;
    let path = o.work.join("hlb-reload.toml");
    let configs = [hlb_reload_config(n, false), hlb_reload_config(n, true)];
    let proc = o
        .hlb()
        .start("hlb-reload", &configs[0], sa(HLB_IP, ADMIN_PORT + 2), 1);
    // Spread over 10 of the load balancers.
    let run = reloads_under_load(
        res,
        &proc,
        &path,
        &configs,
        sa(RELOAD_MARKER, HTTP_PORT),
        o.reloads,
        &format!("reload ({n} LBs)"),
        move |k| sa(reload_lb_ip((k * 97) % 1000 % n.max(1)), HTTP_PORT),
    );
    drop(proc);
    let (med, p99, max) = run.stats();
    let scen = format!("6 reload ({n} LBs, {} SIGHUPs)", o.reloads);
    let scen = scen.as_str();
    res.add(scen, "SIGHUP→in force ms (median)", Target::Hlb, med);
    res.add(scen, "SIGHUP→in force ms (max)", Target::Hlb, max);
    res.add(scen, "failed client conns", Target::Hlb, run.failed as f64);
    res.add(scen, "ok client conns", Target::Hlb, run.ok as f64);
    res.extra.insert(
        "reload".into(),
        json!({"load_balancers": n, "reloads": o.reloads, "times_ms": run.times_ms, "median_ms": med,
               "p99_ms": p99, "max_ms": max, "client_ok": run.ok, "client_failed": run.failed,
               "first_errors": run.first_errors}),
    );
    run.check(res, "reload");
}

/// What [`reloads_under_load`] saw.
pub struct ReloadRun {
    /// SIGHUP to the marker load balancer's change in force, per reload.
    pub times_ms: Vec<f64>,
    pub ok: u64,
    pub failed: u64,
    pub first_errors: Vec<String>,
}

impl ReloadRun {
    /// Median, p99 and max of the reload times, ms.
    pub fn stats(&self) -> (f64, f64, f64) {
        let mut sorted = self.times_ms.clone();
        let p99 = percentile(&mut sorted, 99.0);
        let max = sorted.last().copied().unwrap_or(f64::NAN);
        (median(&self.times_ms), p99, max)
    }

    /// Any failed client connection is a failure of the run, and so is none
    /// succeeding.
    pub fn check(&self, res: &mut Results, what: &str) {
        if self.failed > 0 {
            res.fail(format!(
                "{what}: {} client connections failed during reloads",
                self.failed
            ));
        }
        if self.ok == 0 {
            res.fail(format!("{what}: no client connection succeeded"));
        }
    }
}

/// `reloads` SIGHUPs to `proc`, each after writing the next of `configs`
/// (without, then with, the load balancer on `marker`) to its config file
/// `path`; each timed until `marker` accepts or refuses as the new config
/// says. Meanwhile 4 client threads make one request per new connection,
/// to `client(k)` for k = thread, thread + 4, ...
#[allow(clippy::too_many_arguments)]
pub fn reloads_under_load(
    res: &mut Results,
    proc: &Proc,
    path: &Path,
    configs: &[String; 2],
    marker: SocketAddr,
    reloads: usize,
    what: &str,
    client: impl Fn(usize) -> SocketAddr + Send + Sync + 'static,
) -> ReloadRun {
    let client = Arc::new(client);
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let clients: Vec<_> = (0..4)
        .map(|t| {
            let (stop, ok, failed, errs, client) = (
                Arc::clone(&stop),
                Arc::clone(&ok),
                Arc::clone(&failed),
                Arc::clone(&first_errors),
                Arc::clone(&client),
            );
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(600);
                let mut k = t;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let addr = client(k);
                    k += 4;
                    match http_get(addr, "/") {
                        Ok(r) if r.starts_with("HTTP/1.1 200") => {
                            ok.fetch_add(1, Ordering::Relaxed);
                        }
                        other => {
                            failed.fetch_add(1, Ordering::Relaxed);
                            let mut e = errs.lock().unwrap_or_else(|p| p.into_inner());
                            if e.len() < 5 {
                                e.push(format!("{addr}: {other:?}"));
                            }
                        }
                    }
                }
            })
        })
        .collect();
    std::thread::sleep(Duration::from_millis(500));
    let mut times = Vec::new();
    for r in 0..reloads {
        let with_marker = r % 2 == 0;
        std::fs::write(path, &configs[usize::from(with_marker)]).expect("write config");
        let t0 = Instant::now();
        signal(proc.pid(), libc::SIGHUP);
        let limit = Duration::from_secs(30);
        let mut in_force = false;
        while t0.elapsed() < limit {
            let up = TcpStream::connect_timeout(&marker, Duration::from_millis(500)).is_ok();
            if up == with_marker {
                in_force = true;
                break;
            }
            std::thread::sleep(Duration::from_micros(500));
        }
        let ms = t0.elapsed().as_secs_f64() * 1000.0;
        if !in_force {
            res.fail(format!("{what} {r}: not in force after {limit:?}"));
        }
        times.push(ms);
        eprintln!(
            "{what} {}{}: {ms:.1} ms",
            r + 1,
            if with_marker { " + marker" } else { "" }
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    let run = ReloadRun {
        times_ms: times,
        ok: ok.load(Ordering::Relaxed),
        failed: failed.load(Ordering::Relaxed),
        first_errors: std::mem::take(&mut *first_errors.lock().unwrap_or_else(|p| p.into_inner())),
    };
    let (med, _, max) = run.stats();
    eprintln!(
        "{what}: median {med:.1} ms, max {max:.1} ms; client requests ok {}, failed {}",
        run.ok, run.failed
    );
    run
}

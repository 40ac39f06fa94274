//! Scenario 8: UDP (DNS). dnsperf against dnsmasq directly, through
//! harvester-lb's UDP listener, through nginx's stream module, and where the
//! bench may (root, its own namespace) through the kernel targets: the
//! `kernel` target's DNAT and harvester-lb (kernel), each in force only
//! during its own runs, as in the traffic scenarios.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use super::proxy_cpu;
use crate::Opts;
use crate::host::{DaemonOn, KernelDnat, KernelOn};
use crate::order::run_order;
use crate::table::{Results, percentile};
use crate::targets::{
    ADMIN_PORT, BACKEND_IP, HLB_IP, NGINX_IP, NGINX_STREAM_MODULE, Proc, Target, hlb_kernel_config,
    spawn_nginx,
};
use crate::util::{run_with_timeout, sa, which};

/// UDP (DNS): dnsmasq on BACKEND_IP and every proxy's UDP listener.
pub const DNS_PORT: u16 = 15353;

/// harvester-lb's UDP listener: DNS flows freed at their answer, the
/// backend checked on its TCP port (dnsmasq answers TCP on the same port).
fn hlb_udp_config() -> String {
    format!(
        r#"[admin]
listen = "{HLB_IP}:{ADMIN_PORT}"
[[load_balancer]]
name = "bench/dns"
vip = "{HLB_IP}"
backends = ["{BACKEND_IP}"]
udp_responses = 1
  [[load_balancer.listener]]
  name = "dns"
  port = {DNS_PORT}
  backend_port = {DNS_PORT}
  protocol = "udp"
  [load_balancer.health_check]
  port = {DNS_PORT}
  period_seconds = 1
  timeout_seconds = 1
"#
    )
}

/// nginx's stream module for the same job, as its documentation shows DNS.
fn nginx_udp_config(work: &Path) -> String {
    let w = work.display();
    format!(
        r#"load_module {NGINX_STREAM_MODULE};
daemon off;
worker_processes 1;
worker_rlimit_nofile 19000;
pid {w}/nginx-udp.pid;
error_log {w}/nginx-udp-error.log warn;
events {{
  worker_connections 12000;
}}
stream {{
  server {{
    listen {NGINX_IP}:{DNS_PORT} udp;
    proxy_pass {BACKEND_IP}:{DNS_PORT};
    proxy_responses 1;
    proxy_timeout 5s;
  }}
}}
"#
    )
}

/// One `who.test A` query in DNS wire format.
fn dns_query(id: u16) -> Vec<u8> {
    let mut q = id.to_be_bytes().to_vec();
    q.extend_from_slice(&[1, 0, 0, 1, 0, 0, 0, 0, 0, 0]);
    for label in ["who", "test"] {
        q.push(label.len() as u8);
        q.extend_from_slice(label.as_bytes());
    }
    q.extend_from_slice(&[0, 0, 1, 0, 1]);
    q
}

/// Whether `addr` answers a DNS query within `limit` (UDP has no port to
/// connect to: the answer is the readiness).
fn dns_answers(addr: SocketAddr, limit: Duration) -> bool {
    let Ok(s) = std::net::UdpSocket::bind("127.0.0.1:0") else {
        return false;
    };
    let _ = s.set_read_timeout(Some(Duration::from_millis(200)));
    let deadline = Instant::now() + limit;
    let mut buf = [0u8; 512];
    let mut id = 1u16;
    while Instant::now() < deadline {
        id = id.wrapping_add(1);
        if s.send_to(&dns_query(id), addr).is_ok()
            && let Ok((n, from)) = s.recv_from(&mut buf)
            && from == addr
            && n >= 12
            && buf[..2] == id.to_be_bytes()
        {
            return true;
        }
    }
    false
}

struct DnsperfResult {
    qps: f64,
    lost: f64,
    p50_ms: f64,
    p99_ms: f64,
}

fn dnsperf_cmd(target: Target, queries: &Path, secs: u64) -> Command {
    let mut cmd = Command::new("dnsperf");
    cmd.args(["-s", &target.ip().to_string(), "-p", &DNS_PORT.to_string()])
        .arg("-d")
        .arg(queries)
        .args([
            "-l",
            &secs.to_string(),
            "-c",
            "10",
            "-q",
            "100",
            "-t",
            "2",
            "-v",
        ]);
    cmd
}

/// One dnsperf run: as many queries as 10 clients with 100 outstanding
/// get answered; `-v` prints each query's latency, for the percentiles.
fn dnsperf(target: Target, queries: &Path, secs: u64) -> Result<DnsperfResult, String> {
    let out = run_with_timeout(
        &mut dnsperf_cmd(target, queries, secs),
        Duration::from_secs(secs + 30),
    )
    .ok_or("dnsperf did not run")?;
    let mut r = DnsperfResult {
        qps: f64::NAN,
        lost: f64::NAN,
        p50_ms: f64::NAN,
        p99_ms: f64::NAN,
    };
    let mut latencies = Vec::new();
    for line in out.lines() {
        let t = line.trim();
        if let Some(v) = t.strip_prefix("Queries per second:") {
            r.qps = v.trim().parse().unwrap_or(f64::NAN);
        } else if let Some(v) = t.strip_prefix("Queries lost:") {
            r.lost = v
                .split_whitespace()
                .next()
                .and_then(|n| n.parse().ok())
                .unwrap_or(f64::NAN);
        } else if let Some(rest) = t.strip_prefix("> ")
            && let Some(l) = rest
                .split_whitespace()
                .last()
                .and_then(|v| v.parse::<f64>().ok())
        {
            latencies.push(l * 1000.0);
        }
    }
    if r.qps.is_nan() || r.qps <= 0.0 {
        return Err(format!(
            "dnsperf gave no rate:\n{}",
            out.lines().rev().take(20).collect::<Vec<_>>().join("\n")
        ));
    }
    r.p50_ms = percentile(&mut latencies, 50.0);
    r.p99_ms = percentile(&mut latencies, 99.0);
    Ok(r)
}

/// The kernel target `t` in force for one run, once it answers DNS; None
/// for the other targets.
fn kernel_on(o: &Opts, t: Target, kernel: Option<&KernelDnat>) -> Option<Result<KernelOn, String>> {
    let answers = |limit| dns_answers(sa(t.ip(), DNS_PORT), limit);
    match (t, kernel) {
        (Target::Kernel, Some(k)) => Some(
            k.install("a DNS answer", answers)
                .map(|on| KernelOn::Table { _on: on }),
        ),
        (Target::HlbKernel, _) => Some(
            o.hlb()
                .start_kernel(
                    "hlb-kernel-udp",
                    // Checked on dnsmasq's TCP port, as harvester-lb's.
                    &hlb_kernel_config(&[("dns", DNS_PORT, "udp")], DNS_PORT),
                )
                .and_then(|p| {
                    let on = KernelOn::Daemon {
                        _on: DaemonOn::new(p),
                    };
                    if answers(Duration::from_secs(5)) {
                        Ok(on)
                    } else {
                        Err("harvester-lb (kernel) does not answer DNS".into())
                    }
                }),
        ),
        _ => None,
    }
}

pub fn udp_scenario(o: &Opts, res: &mut Results, kernel: Option<&KernelDnat>) {
    const SCEN: &str = "8 udp dns (dnsperf)";
    for tool in ["dnsperf", "dnsmasq"] {
        if !which(tool) {
            res.fail(format!(
                "udp: {tool} missing (apt-get install dnsperf dnsmasq-base)"
            ));
            return;
        }
    }
    let hosts = o.work.join("dns-hosts");
    std::fs::write(&hosts, "10.9.0.1 who.test\n").expect("write hosts");
    let queries = o.work.join("dns-queries");
    std::fs::write(&queries, "who.test A\n".repeat(100)).expect("write queries");
    let backend = sa(BACKEND_IP, DNS_PORT);
    let _dnsmasq = Proc::spawn(
        "dnsmasq",
        Command::new("dnsmasq")
            .args([
                "-k",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                "--bind-interfaces",
                "--user=root",
                "--cache-size=1000",
            ])
            .arg(format!("--addn-hosts={}", hosts.display()))
            .arg(format!("--listen-address={BACKEND_IP}"))
            .arg(format!("--port={DNS_PORT}"))
            .arg(format!(
                "--pid-file={}",
                o.work.join("dnsmasq.pid").display()
            )),
        &o.work.join("dnsmasq.log"),
    );
    if !dns_answers(backend, Duration::from_secs(20)) {
        res.fail("udp: dnsmasq does not answer".into());
        return;
    }
    let mut procs: Vec<(Target, Proc)> = vec![(
        Target::Hlb,
        o.hlb()
            .start("hlb-udp", &hlb_udp_config(), sa(HLB_IP, ADMIN_PORT), 1),
    )];
    if o.targets.contains(&Target::Nginx) {
        procs.push((
            Target::Nginx,
            spawn_nginx(&o.work, "nginx-udp", &nginx_udp_config(&o.work)),
        ));
    }
    let mut targets = vec![Target::Hlb];
    if o.targets.contains(&Target::Direct) {
        targets.insert(0, Target::Direct);
    }
    if o.targets.contains(&Target::Nginx) {
        targets.push(Target::Nginx);
    }
    // Checked at each of their runs, when they are in force.
    let mut kernels = Vec::new();
    if kernel.is_some() {
        kernels.push(Target::Kernel);
    }
    if o.targets.contains(&Target::HlbKernel) {
        kernels.push(Target::HlbKernel);
    }
    for t in &targets {
        if !dns_answers(sa(t.ip(), DNS_PORT), Duration::from_secs(20)) {
            res.fail(format!("udp: {} does not answer DNS", t.name()));
            return;
        }
    }
    res.commands.insert(
        "udp".into(),
        format!(
            "{:?}",
            dnsperf_cmd(Target::Hlb, Path::new("QUERIES"), o.duration)
        )
        .replace('"', ""),
    );
    let pids: Vec<(Target, i32)> = procs.iter().map(|(t, p)| (*t, p.pid())).collect();
    targets.extend(kernels);
    for round in 0..o.rounds {
        let mut qps_round = BTreeMap::new();
        for t in run_order(&targets, round) {
            let _on = match kernel_on(o, t, kernel) {
                Some(Ok(on)) => Some(on),
                Some(Err(e)) => {
                    res.fail(format!("udp round {round} {}: {e}", t.name()));
                    continue;
                }
                None => None,
            };
            let before = proxy_cpu(&pids, t);
            match dnsperf(t, &queries, o.duration) {
                Ok(r) => {
                    eprintln!(
                        "udp round {round} {}: {:.0} q/s, {} lost, p50 {:.3} ms, p99 {:.3} ms",
                        t.name(),
                        r.qps,
                        r.lost,
                        r.p50_ms,
                        r.p99_ms
                    );
                    res.add(SCEN, "queries/s", t, r.qps);
                    res.add(SCEN, "lost queries", t, r.lost);
                    res.add(SCEN, "p50 ms", t, r.p50_ms);
                    res.add(SCEN, "p99 ms", t, r.p99_ms);
                    qps_round.insert(t, r.qps);
                    if let (Some(b), Some(a)) = (before, proxy_cpu(&pids, t)) {
                        let queries_done = r.qps * o.duration as f64;
                        if queries_done > 0.0 {
                            res.add(
                                SCEN,
                                "proxy CPU µs per query",
                                t,
                                (a - b) / queries_done * 1e6,
                            );
                        }
                    }
                }
                Err(e) => res.fail(format!("udp {}: {e}", t.name())),
            }
        }
        // The target of the issue: harvester-lb's rate over nginx's, per round.
        if let (Some(h), Some(n)) = (qps_round.get(&Target::Hlb), qps_round.get(&Target::Nginx)) {
            res.add(
                SCEN,
                "queries/s hlb / nginx (per round)",
                Target::Hlb,
                h / n,
            );
        }
    }
    for (t, p) in procs.iter_mut() {
        if !p.alive() {
            res.fail(format!("{} exited during the udp scenario", t.name()));
        }
    }
    if o.smoke {
        // The smoke run proves the path, not a rate: everything answered.
        let lost: f64 = res
            .samples
            .get(&(SCEN.to_string(), "lost queries".to_string(), Target::Hlb))
            .map_or(0.0, |v| v.iter().sum());
        if lost > 0.0 {
            res.fail(format!(
                "udp smoke: {lost} queries lost through harvester-lb"
            ));
        }
    }
}

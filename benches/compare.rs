//! Side-by-side comparison of harvester-lb with HAProxy and nginx (stream) on
//! loopback: `cargo bench --bench compare -- [--smoke] [--json FILE]`, usually
//! through `benches/compare.sh`, which installs the peers first.
//!
//! Every address is in 127.0.0.0/8. Everything started here is stopped by pid
//! (on drop, so a panic stops it too). Every loop is bounded in count and time.
//! The README's "Benchmarks" section describes the scenarios and carries the
//! latest table.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::{Value, json};

/// The harvester-lb binary Cargo built for this bench (release profile).
const HLB_BIN: &str = env!("CARGO_BIN_EXE_harvester-lb");

/// Addresses: one per role, all on loopback, so every proxy uses the same ports.
const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 1);
const HLB_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 2);
const HAPROXY_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 3);
const NGINX_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 4);
/// Ports, the same on the backend and on every proxy.
const IPERF_PORT: u16 = 15201;
const HTTP_PORT: u16 = 18080;
const ADMIN_PORT: u16 = 19901;
/// Health-check scale: targets are 127.250.(i / 250).(i % 250 + 1):PROBE_PORT.
const PROBE_PORT: u16 = 30999;
/// Reload: load balancer i listens on 127.253.(i / 250).(i % 250 + 1):HTTP_PORT.
const RELOAD_MARKER: Ipv4Addr = Ipv4Addr::new(127, 253, 100, 1);

const NGINX_STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

// ---------------------------------------------------------------------------
// Options

struct Opts {
    smoke: bool,
    json: PathBuf,
    rounds: usize,
    duration: u64,
    targets: Vec<Target>,
    scenarios: Vec<String>,
    idle_conns: usize,
    probe_targets: usize,
    probe_window: u64,
    reloads: usize,
    reload_lbs: usize,
    work: PathBuf,
}

const ALL_SCENARIOS: [&str; 6] = ["throughput", "rps", "cps", "idle", "health", "reload"];

fn usage() -> ! {
    eprintln!(
        "usage: compare [--smoke] [--json FILE] [--rounds N] [--duration SECONDS]\n\
         \x20              [--only throughput,rps,cps,idle,health,reload]\n\
         --smoke: every scenario about a second, against harvester-lb alone; exits non-zero on failure"
    );
    std::process::exit(2)
}

fn parse_opts() -> Opts {
    let mut args = std::env::args().skip(1);
    let mut smoke = false;
    let mut json = None;
    let mut rounds = None;
    let mut duration = None;
    let mut only: Option<Vec<String>> = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--smoke" => smoke = true,
            "--json" => json = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            "--rounds" => rounds = args.next().and_then(|v| v.parse().ok()),
            "--duration" => duration = args.next().and_then(|v| v.parse().ok()),
            "--only" => {
                only = Some(
                    args.next()
                        .unwrap_or_else(|| usage())
                        .split(',')
                        .map(str::to_string)
                        .collect(),
                )
            }
            "--serve-http" => {
                let addr = args.next().unwrap_or_else(|| usage());
                serve_http(addr.parse().unwrap_or_else(|_| usage()));
            }
            "-h" | "--help" => usage(),
            other => {
                eprintln!("unknown argument {other}");
                usage()
            }
        }
    }
    let scenarios = only.unwrap_or_else(|| ALL_SCENARIOS.iter().map(|s| s.to_string()).collect());
    for s in &scenarios {
        if !ALL_SCENARIOS.contains(&s.as_str()) {
            eprintln!("unknown scenario {s}");
            usage()
        }
    }
    let work = std::env::temp_dir().join(format!("hlb-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work).expect("create work dir");
    Opts {
        smoke,
        json: json.unwrap_or_else(|| PathBuf::from("bench-compare.json")),
        rounds: rounds.unwrap_or(if smoke { 1 } else { 3 }),
        duration: duration.unwrap_or(if smoke { 1 } else { 5 }),
        targets: if smoke {
            vec![Target::Hlb]
        } else {
            vec![Target::Direct, Target::Hlb, Target::Haproxy, Target::Nginx]
        },
        scenarios,
        idle_conns: 5000,
        probe_targets: 5000,
        probe_window: if smoke { 2 } else { 20 },
        reloads: if smoke { 3 } else { 20 },
        reload_lbs: 1000,
        work,
    }
}

// ---------------------------------------------------------------------------
// Targets and processes

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
enum Target {
    Direct,
    Hlb,
    Haproxy,
    Nginx,
}

impl Target {
    fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Hlb => "harvester-lb",
            Target::Haproxy => "haproxy",
            Target::Nginx => "nginx",
        }
    }
    fn ip(self) -> Ipv4Addr {
        match self {
            Target::Direct => BACKEND_IP,
            Target::Hlb => HLB_IP,
            Target::Haproxy => HAPROXY_IP,
            Target::Nginx => NGINX_IP,
        }
    }
}

/// A process we started; stopped by pid (SIGTERM, then SIGKILL) when dropped.
struct Proc {
    name: String,
    child: std::process::Child,
}

impl Proc {
    fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Proc {
        let out = std::fs::File::create(log).expect("create log");
        let err = out.try_clone().expect("clone log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e} ({cmd:?})"));
        Proc {
            name: name.to_string(),
            child,
        }
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        if !self.alive() {
            return;
        }
        signal(self.pid(), libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if !self.alive() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        eprintln!(
            "{} (pid {}) did not stop on SIGTERM; killing",
            self.name,
            self.pid()
        );
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[allow(unsafe_code)]
fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid of a child we started and have not reaped.
    unsafe {
        libc::kill(pid, sig);
    }
}

fn wait_port(addr: SocketAddr, what: &str) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{what} is not listening on {addr} after 20 s");
}

fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

fn which(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// Resident memory of `pid` and its children, bytes.
fn rss_tree(pid: i32) -> u64 {
    let mut total = 0;
    let mut stack = vec![pid];
    let mut seen = 0;
    while let Some(p) = stack.pop() {
        seen += 1;
        if seen > 64 {
            break;
        }
        if let Ok(status) = std::fs::read_to_string(format!("/proc/{p}/status")) {
            for line in status.lines() {
                if let Some(v) = line.strip_prefix("VmRSS:") {
                    let kb: u64 = v.trim().trim_end_matches("kB").trim().parse().unwrap_or(0);
                    total += kb * 1024;
                }
            }
        }
        if let Ok(children) = std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")) {
            stack.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
    }
    total
}

/// CPU time (user + system) of `pid` and its children, seconds.
fn cpu_seconds_tree(pid: i32) -> f64 {
    let mut ticks = 0u64;
    let mut stack = vec![pid];
    let mut seen = 0;
    while let Some(p) = stack.pop() {
        seen += 1;
        if seen > 64 {
            break;
        }
        if let Ok(stat) = std::fs::read_to_string(format!("/proc/{p}/stat")) {
            // Fields after the command name (which may hold spaces): state is field 3.
            if let Some(rest) = stat.rfind(')').map(|i| &stat[i + 2..]) {
                let f: Vec<&str> = rest.split_whitespace().collect();
                // utime is field 14, stime 15 (1-based over the whole line).
                ticks += f.get(11).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
                ticks += f.get(12).and_then(|v| v.parse::<u64>().ok()).unwrap_or(0);
            }
        }
        if let Ok(children) = std::fs::read_to_string(format!("/proc/{p}/task/{p}/children")) {
            stack.extend(
                children
                    .split_whitespace()
                    .filter_map(|c| c.parse::<i32>().ok()),
            );
        }
    }
    #[allow(unsafe_code)]
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as f64;
    ticks as f64 / hz
}

// ---------------------------------------------------------------------------
// Configs

/// harvester-lb config: one load balancer on HLB_IP with both listeners.
fn hlb_config() -> String {
    format!(
        r#"[admin]
listen = "{HLB_IP}:{ADMIN_PORT}"
[proxy]
backlog = 4096
max_connections = 15000
[[load_balancer]]
name = "bench/main"
vip = "{HLB_IP}"
backends = ["{BACKEND_IP}"]
algorithm = "round_robin"
  [[load_balancer.listener]]
  name = "iperf"
  port = {IPERF_PORT}
  backend_port = {IPERF_PORT}
  [[load_balancer.listener]]
  name = "http"
  port = {HTTP_PORT}
  backend_port = {HTTP_PORT}
  [load_balancer.health_check]
  port = {HTTP_PORT}
  period_seconds = 1
  timeout_seconds = 1
"#
    )
}

fn haproxy_config() -> String {
    format!(
        r#"global
  nbthread 1
  maxconn 7000
  log stderr format short local0 err

defaults
  mode tcp
  option splice-auto
  timeout connect 3s
  timeout client 1h
  timeout server 1h
  default-server check port {HTTP_PORT} inter 1s fall 3 rise 1

frontend iperf
  bind {HAPROXY_IP}:{IPERF_PORT} backlog 4096
  default_backend iperf
backend iperf
  server b1 {BACKEND_IP}:{IPERF_PORT}

frontend http
  bind {HAPROXY_IP}:{HTTP_PORT} backlog 4096
  default_backend http
backend http
  server b1 {BACKEND_IP}:{HTTP_PORT}
"#
    )
}

fn nginx_config(work: &Path) -> String {
    let w = work.display();
    format!(
        r#"load_module {NGINX_STREAM_MODULE};
daemon off;
worker_processes 1;
worker_rlimit_nofile 19000;
pid {w}/nginx.pid;
error_log {w}/nginx-error.log warn;
events {{
  worker_connections 12000;
}}
stream {{
  server {{
    listen {NGINX_IP}:{IPERF_PORT} backlog=4096;
    proxy_pass {BACKEND_IP}:{IPERF_PORT};
  }}
  server {{
    listen {NGINX_IP}:{HTTP_PORT} backlog=4096;
    proxy_pass {BACKEND_IP}:{HTTP_PORT};
    proxy_timeout 1h;
  }}
}}
"#
    )
}

fn start_hlb(work: &Path, name: &str, config: &str, admin: SocketAddr) -> Proc {
    let path = work.join(format!("{name}.toml"));
    std::fs::write(&path, config).expect("write config");
    let mut cmd = Command::new(HLB_BIN);
    // One thread, like HAProxy's nbthread 1 and nginx's one worker.
    cmd.args(["run", "--no-watch", "--threads", "1", "--config"])
        .arg(&path)
        .env("HARVESTER_LB_LOG", "warn");
    let p = Proc::spawn(name, &mut cmd, &work.join(format!("{name}.log")));
    wait_http_ok(admin, "/readyz", Duration::from_secs(60));
    p
}

/// GETs `path` on `addr` until it answers 200.
fn wait_http_ok(addr: SocketAddr, path: &str, limit: Duration) {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if let Ok(r) = http_get(addr, path)
            && (r.starts_with("HTTP/1.1 200") || r.starts_with("HTTP/1.0 200"))
        {
            return;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    panic!("{addr}{path} did not answer 200 within {limit:?}");
}

fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(5)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: bench\r\nConnection: close\r\n\r\n"
    )?;
    let mut out = String::new();
    s.read_to_string(&mut out)?;
    Ok(out)
}

// ---------------------------------------------------------------------------
// The tiny HTTP backend (this binary re-run with --serve-http ADDR)

const KEEPALIVE_RESPONSE: &[u8] =
    b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\n\r\nok\n";
const CLOSE_RESPONSE: &[u8] = b"HTTP/1.1 200 OK\r\nContent-Type: text/plain\r\nContent-Length: 3\r\nConnection: close\r\n\r\nok\n";

/// Answers every request with a 3-byte 200, on one thread; honours
/// `Connection: close`. Never returns.
fn serve_http(addr: SocketAddr) -> ! {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let socket = tokio::net::TcpSocket::new_v4().expect("socket");
        socket.set_reuseaddr(true).expect("reuseaddr");
        socket.bind(addr).expect("bind http backend");
        let listener = socket.listen(4096).expect("listen");
        loop {
            if let Ok((s, _)) = listener.accept().await {
                tokio::spawn(http_conn(s));
            } else {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
        }
    })
}

async fn http_conn(mut s: tokio::net::TcpStream) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let _ = s.set_nodelay(true);
    let mut buf = vec![0u8; 4096];
    let mut filled = 0;
    let mut out = Vec::with_capacity(256);
    loop {
        let n = match s.read(&mut buf[filled..]).await {
            Ok(0) | Err(_) => return,
            Ok(n) => n,
        };
        filled += n;
        let mut start = 0;
        let mut close = false;
        out.clear();
        while let Some(end) = find(&buf[start..filled], b"\r\n\r\n") {
            let head = &buf[start..start + end];
            start += end + 4;
            if contains_ignore_case(head, b"connection: close") {
                out.extend_from_slice(CLOSE_RESPONSE);
                close = true;
                break;
            }
            out.extend_from_slice(KEEPALIVE_RESPONSE);
        }
        buf.copy_within(start..filled, 0);
        filled -= start;
        if !out.is_empty() && s.write_all(&out).await.is_err() {
            return;
        }
        if close || filled == buf.len() {
            return;
        }
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn contains_ignore_case(hay: &[u8], needle: &[u8]) -> bool {
    hay.windows(needle.len())
        .any(|w| w.eq_ignore_ascii_case(needle))
}

// ---------------------------------------------------------------------------
// Results

#[derive(Default)]
struct Results {
    /// (scenario, metric, target) -> samples, one per round.
    samples: BTreeMap<(String, String, Target), Vec<f64>>,
    /// Scenario-specific extra results (health, reload, idle).
    extra: serde_json::Map<String, Value>,
    /// Commands run, for the README.
    commands: BTreeMap<String, String>,
    failures: Vec<String>,
}

impl Results {
    fn add(&mut self, scenario: &str, metric: &str, target: Target, v: f64) {
        self.samples
            .entry((scenario.to_string(), metric.to_string(), target))
            .or_default()
            .push(v);
    }

    fn fail(&mut self, what: String) {
        eprintln!("FAILED: {what}");
        self.failures.push(what);
    }
}

fn median(v: &[f64]) -> f64 {
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

fn percentile(v: &mut [f64], p: f64) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(|a, b| a.total_cmp(b));
    let i = ((p / 100.0) * (v.len() - 1) as f64).round() as usize;
    v[i.min(v.len() - 1)]
}

// ---------------------------------------------------------------------------
// Scenarios 1–3: iperf3 and wrk

fn run_with_timeout(cmd: &mut Command, limit: Duration) -> Option<String> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let pid = child.id() as i32;
    let done = Arc::new(AtomicBool::new(false));
    let watchdog = {
        let done = Arc::clone(&done);
        std::thread::spawn(move || {
            let deadline = Instant::now() + limit;
            while Instant::now() < deadline {
                if done.load(Ordering::Relaxed) {
                    return;
                }
                std::thread::sleep(Duration::from_millis(50));
            }
            if !done.load(Ordering::Relaxed) {
                eprintln!("command over its {limit:?}; killing pid {pid}");
                signal(pid, libc::SIGKILL);
            }
        })
    };
    let out = child.wait_with_output().ok();
    done.store(true, Ordering::Relaxed);
    let _ = watchdog.join();
    let out = out?;
    let mut s = String::from_utf8_lossy(&out.stdout).into_owned();
    if !out.status.success() {
        eprintln!(
            "command failed ({}): {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        s.push_str("\nFAILED\n");
    }
    Some(s)
}

/// One iperf3 run; Gbit/s received.
fn iperf(target: Target, streams: u32, reverse: bool, secs: u64) -> Result<f64, String> {
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

struct WrkResult {
    rate: f64,
    p50_ms: f64,
    p99_ms: f64,
    errors: u64,
}

fn wrk_cmd(target: Target, close: bool, secs: u64) -> Command {
    let mut cmd = Command::new("wrk");
    cmd.args(["-t1", "-c50", "-d", &format!("{secs}s"), "--latency"]);
    if close {
        cmd.args(["-H", "Connection: close"]);
    }
    cmd.arg(format!("http://{}:{HTTP_PORT}/", target.ip()));
    cmd
}

fn wrk(target: Target, close: bool, secs: u64) -> Result<WrkResult, String> {
    let out = run_with_timeout(
        &mut wrk_cmd(target, close, secs),
        Duration::from_secs(secs + 20),
    )
    .ok_or("wrk did not run")?;
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

/// CPU seconds used so far by each proxy's process tree.
fn proxy_cpu(pids: &[(Target, i32)], target: Target) -> Option<f64> {
    pids.iter()
        .find(|(t, _)| *t == target)
        .map(|(_, pid)| cpu_seconds_tree(*pid))
}

/// The order in which `targets` run in round `round`: a balanced Latin
/// square (Williams design). Over `n` rounds (`2n` for an odd count) every
/// target runs once in each position and follows every other target exactly
/// once, so no proxy always runs first or always right after the direct
/// run, whose load (and the `TIME_WAIT` sockets it leaves) the next run
/// inherits. A plain rotation would put the same target after the direct
/// run in every round.
fn run_order<T: Copy>(targets: &[T], round: usize) -> Vec<T> {
    let n = targets.len();
    if n == 0 {
        return Vec::new();
    }
    // First row 0, 1, n-1, 2, n-2, ...; row r adds r (mod n).
    let first: Vec<usize> = (0..n)
        .map(|j| {
            if j % 2 == 1 {
                j.div_ceil(2)
            } else {
                (n - j / 2) % n
            }
        })
        .collect();
    let rows = if n.is_multiple_of(2) { n } else { 2 * n };
    let r = round % rows;
    let mut order: Vec<T> = first.iter().map(|&j| targets[(j + r) % n]).collect();
    if r >= n {
        // Odd n: the second half of the rounds runs the rows backwards.
        order.reverse();
    }
    order
}

fn traffic_scenarios(o: &Opts, res: &mut Results, pids: &[(Target, i32)]) {
    let d = o.duration;
    res.commands.insert(
        "throughput".into(),
        format!("iperf3 -c <target> -p {IPERF_PORT} -t {d} -P <1|8> [-R] -J"),
    );
    res.commands.insert(
        "rps".into(),
        format!("{:?}", wrk_cmd(Target::Hlb, false, d)).replace('"', ""),
    );
    res.commands.insert(
        "cps".into(),
        format!("{:?}", wrk_cmd(Target::Hlb, true, d)).replace('"', ""),
    );
    let mut tests: Vec<&str> = Vec::new();
    if o.scenarios.iter().any(|s| s == "throughput") {
        tests.extend(["iperf-1-up", "iperf-1-down", "iperf-8-up", "iperf-8-down"]);
    }
    if o.scenarios.iter().any(|s| s == "rps") {
        tests.push("rps");
    }
    if o.scenarios.iter().any(|s| s == "cps") {
        tests.push("cps");
    }
    for round in 0..o.rounds {
        for test in &tests {
            for target in run_order(&o.targets, round) {
                let outcome = match *test {
                    "rps" | "cps" => {
                        let close = *test == "cps";
                        let cpu0 = proxy_cpu(pids, target);
                        wrk(target, close, d).map(|r| {
                            let (scen, unit) = if close {
                                ("3 new connections", "conn/s")
                            } else {
                                ("2 kept-alive requests", "req/s")
                            };
                            res.add(scen, unit, target, r.rate);
                            // Proxy CPU per request: what a request costs,
                            // whatever the scheduler did with the 2 cores.
                            if let (Some(c0), Some(c1)) = (cpu0, proxy_cpu(pids, target))
                                && r.rate > 0.0
                            {
                                // wrk's rate is its requests over its d seconds.
                                let per = (c1 - c0) * 1e6 / (r.rate * d as f64);
                                res.add(scen, "proxy CPU µs per request", target, per);
                            }
                            res.add(scen, "p50 ms", target, r.p50_ms);
                            res.add(scen, "p99 ms", target, r.p99_ms);
                            res.add(scen, "errors", target, r.errors as f64);
                            format!(
                                "{:.0} {unit}, p99 {:.3} ms, {} errors",
                                r.rate, r.p99_ms, r.errors
                            )
                        })
                    }
                    _ => {
                        let streams = if test.contains("-8-") { 8 } else { 1 };
                        let reverse = test.ends_with("down");
                        iperf(target, streams, reverse, d).map(|g| {
                            let metric = format!(
                                "Gbit/s {streams} stream{} {}",
                                if streams > 1 { "s" } else { "" },
                                if reverse {
                                    "backend→client"
                                } else {
                                    "client→backend"
                                }
                            );
                            res.add("1 throughput", &metric, target, g);
                            format!("{g:.2} Gbit/s")
                        })
                    }
                };
                match outcome {
                    Ok(s) => eprintln!("round {} {test} {}: {s}", round + 1, target.name()),
                    Err(e) => {
                        res.fail(format!("round {} {test} {}: {e}", round + 1, target.name()))
                    }
                }
                std::thread::sleep(Duration::from_millis(300));
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Scenario 4: idle connections

fn idle_scenario(o: &Opts, res: &mut Results, procs: &mut [(Target, Proc)]) {
    for (target, proc) in procs.iter_mut() {
        if *target == Target::Direct {
            continue;
        }
        let pid = proc.pid();
        let before = rss_tree(pid);
        let addr = sa(target.ip(), HTTP_PORT);
        let mut conns = Vec::with_capacity(o.idle_conns);
        let started = Instant::now();
        for _ in 0..o.idle_conns {
            if started.elapsed() > Duration::from_secs(60) {
                break;
            }
            match TcpStream::connect_timeout(&addr, Duration::from_secs(2)) {
                Ok(c) => conns.push(c),
                Err(e) => {
                    res.fail(format!("idle: connect to {} failed: {e}", target.name()));
                    break;
                }
            }
        }
        // Let the proxy connect every one to the backend and settle.
        std::thread::sleep(Duration::from_secs(2));
        let after = rss_tree(pid);
        let opened = conns.len();
        // One request on one of them shows the proxy still forwards.
        let alive = conns.last_mut().map(|c| {
            c.set_read_timeout(Some(Duration::from_secs(5))).ok();
            let _ = c.write_all(b"GET / HTTP/1.1\r\nHost: b\r\n\r\n");
            let mut buf = [0u8; 64];
            matches!(c.read(&mut buf), Ok(n) if n > 12 && buf.starts_with(b"HTTP/1.1 200"))
        });
        drop(conns);
        let per_conn = (after as f64 - before as f64) / opened.max(1) as f64;
        eprintln!(
            "idle {}: {opened} connections, RSS {:.1} -> {:.1} MiB, {per_conn:.0} B/conn, forwarding {:?}",
            target.name(),
            before as f64 / 1048576.0,
            after as f64 / 1048576.0,
            alive
        );
        if opened < o.idle_conns || alive != Some(true) {
            res.fail(format!(
                "idle {}: opened {opened}, forwarding {alive:?}",
                target.name()
            ));
        }
        res.add("4 idle connections", "RSS B/conn", *target, per_conn);
        res.add(
            "4 idle connections",
            "RSS MiB at 5k",
            *target,
            after as f64 / 1048576.0,
        );
        // Give the proxies time to close their backend legs before the next one.
        std::thread::sleep(Duration::from_secs(2));
    }
}

// ---------------------------------------------------------------------------
// Scenario 5: health-check scale

fn probe_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 250, (i / 250) as u8, (i % 250 + 1) as u8)
}

/// Listens on every target address. Both probers check the way HAProxy
/// does (SYN, SYN-ACK, reset: the target never accepts), so a probe is seen
/// by capturing SYNs (see [`SynCapture`]), not by accepting; the accept loop
/// only keeps the queues empty for a prober that completes handshakes.
struct ProbeTargets {
    rt: Option<tokio::runtime::Runtime>,
}

impl ProbeTargets {
    fn start(n: usize) -> ProbeTargets {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        for i in 0..n {
            let addr = sa(probe_ip(i), PROBE_PORT);
            let std_l = std::net::TcpListener::bind(addr)
                .unwrap_or_else(|e| panic!("bind probe target {addr}: {e}"));
            std_l.set_nonblocking(true).expect("nonblocking");
            rt.spawn(async move {
                let l = tokio::net::TcpListener::from_std(std_l).expect("tokio listener");
                loop {
                    match l.accept().await {
                        Ok((s, _)) => drop(s),
                        Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
                    }
                }
            });
        }
        ProbeTargets { rt: Some(rt) }
    }
}

impl Drop for ProbeTargets {
    fn drop(&mut self) {
        if let Some(rt) = self.rt.take() {
            rt.shutdown_background();
        }
    }
}

/// `tcpdump` on the loopback interface recording when each target receives
/// a SYN (seconds, kernel timestamps). Runs only in its own window: the
/// capture's per-packet cost lands on the sending process, so the CPU
/// window runs without it.
struct SynCapture {
    proc: Proc,
    arrivals: Arc<Mutex<Vec<Vec<f64>>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl SynCapture {
    fn start(n: usize, work: &Path) -> SynCapture {
        let log = work.join("tcpdump.log");
        let filter = format!(
            "dst port {PROBE_PORT} and dst net 127.250.0.0/16 and tcp[tcpflags] & (tcp-syn|tcp-ack) == tcp-syn"
        );
        let mut cmd = Command::new("tcpdump");
        cmd.args([
            "-i",
            "lo",
            "-n",
            "-tt",
            "-q",
            "-l",
            "--immediate-mode",
            "-B",
            "16384",
            "-s",
            "96",
        ])
        .arg(&filter);
        let out = std::fs::File::create(&log).expect("create log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(out)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start tcpdump: {e}"));
        let mut proc = Proc {
            name: "tcpdump".into(),
            child,
        };
        let stdout = proc.child.stdout.take().expect("tcpdump stdout");
        let arrivals = Arc::new(Mutex::new(vec![Vec::new(); n]));
        let sink = Arc::clone(&arrivals);
        let reader = std::thread::spawn(move || {
            use std::io::BufRead;
            for line in std::io::BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                // "1795335728.251234 IP 127.0.0.1.40000 > 127.250.3.17.30999: tcp 0"
                let mut f = line.split_whitespace();
                let (Some(ts), Some(dst)) = (f.next(), f.nth(3)) else {
                    continue;
                };
                let (Ok(ts), Some((ip, _port))) = (
                    ts.parse::<f64>(),
                    dst.trim_end_matches(':').rsplit_once('.'),
                ) else {
                    continue;
                };
                let Ok(ip) = ip.parse::<Ipv4Addr>() else {
                    continue;
                };
                let [_, _, c, d] = ip.octets();
                let i = c as usize * 250 + d as usize - 1;
                let mut a = sink.lock().unwrap_or_else(|p| p.into_inner());
                if i < a.len() && a[i].len() < 10_000 {
                    a[i].push(ts);
                }
            }
        });
        // tcpdump says "listening on lo" once the capture is in place.
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && !std::fs::read_to_string(&log).is_ok_and(|l| l.contains("listening on"))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        SynCapture {
            proc,
            arrivals,
            reader: Some(reader),
        }
    }

    /// Stops the capture; the SYN times of each target, in order.
    fn finish(mut self) -> Vec<Vec<f64>> {
        signal(self.proc.pid(), libc::SIGINT);
        if let Some(r) = self.reader.take() {
            let _ = r.join();
        }
        let mut a = self.arrivals.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *a)
    }
}

fn hlb_probe_config(n: usize) -> String {
    let mut s = format!(
        "[admin]\nlisten = \"{HLB_IP}:{}\"\n[[load_balancer]]\nname = \"bench/probes\"\nvip = \"{HLB_IP}\"\nbackends = [",
        ADMIN_PORT + 1
    );
    for i in 0..n {
        let _ = write!(s, "{}\"{}\"", if i > 0 { ", " } else { "" }, probe_ip(i));
    }
    let _ = write!(
        s,
        "]\n  [[load_balancer.listener]]\n  name = \"probe\"\n  port = {}\n  backend_port = {PROBE_PORT}\n  [load_balancer.health_check]\n  port = {PROBE_PORT}\n  period_seconds = 1\n  timeout_seconds = 1\n",
        PROBE_PORT - 1
    );
    s
}

fn haproxy_probe_config(n: usize) -> String {
    let mut s = format!(
        "global\n  nbthread 1\n  maxconn 2000\n  log stderr format short local0 err\ndefaults\n  mode tcp\n  timeout connect 1s\n  timeout client 1h\n  timeout server 1h\nfrontend probes\n  bind {HAPROXY_IP}:{}\n  default_backend probes\nbackend probes\n  default-server check inter 1s fall 3 rise 1\n",
        PROBE_PORT - 1
    );
    for i in 0..n {
        let _ = writeln!(s, "  server t{i} {}:{PROBE_PORT}", probe_ip(i));
    }
    s
}

fn health_scenario(o: &Opts, res: &mut Results) {
    let _targets = ProbeTargets::start(o.probe_targets);
    let warmup = Duration::from_secs(if o.smoke { 2 } else { 4 });
    let window = Duration::from_secs(o.probe_window);
    let mut who = vec![Target::Hlb];
    if !o.smoke {
        who.push(Target::Haproxy);
    }
    let mut extra = serde_json::Map::new();
    for target in who {
        let proc = match target {
            Target::Hlb => start_hlb(
                &o.work,
                "hlb-probes",
                &hlb_probe_config(o.probe_targets),
                sa(HLB_IP, ADMIN_PORT + 1),
            ),
            _ => {
                let cfg = o.work.join("haproxy-probes.cfg");
                std::fs::write(&cfg, haproxy_probe_config(o.probe_targets)).expect("write");
                let p = Proc::spawn(
                    "haproxy-probes",
                    Command::new("haproxy").arg("-db").arg("-f").arg(&cfg),
                    &o.work.join("haproxy-probes.log"),
                );
                wait_port(sa(HAPROXY_IP, PROBE_PORT - 1), "haproxy (probes)");
                p
            }
        };
        std::thread::sleep(warmup);
        let cpu0 = cpu_seconds_tree(proc.pid());
        let t0 = Instant::now();
        std::thread::sleep(window);
        let cpu1 = cpu_seconds_tree(proc.pid());
        let wall = t0.elapsed().as_secs_f64();
        let capture = SynCapture::start(o.probe_targets, &o.work);
        let c0 = Instant::now();
        std::thread::sleep(window);
        let capture_wall = c0.elapsed().as_secs_f64();
        let arrivals = capture.finish();
        drop(proc);
        let cpu_pct = (cpu1 - cpu0) / wall * 100.0;
        // Lateness two ways, in ms: (a) each gap between two probes of one
        // target minus the period; (b) against a fixed 1 s schedule anchored at
        // that target's earliest-firing probe in the window.
        let mut gaps = Vec::new();
        let mut anchored = Vec::new();
        let mut probes = 0usize;
        let mut silent = 0usize;
        for a in &arrivals {
            probes += a.len();
            if a.is_empty() {
                silent += 1;
                continue;
            }
            for w in a.windows(2) {
                gaps.push((w[1] - w[0]) * 1000.0 - 1000.0);
            }
            let offs: Vec<f64> = a
                .iter()
                .enumerate()
                .map(|(k, t)| (*t - a[0]) * 1000.0 - k as f64 * 1000.0)
                .collect();
            let min = offs.iter().copied().fold(f64::INFINITY, f64::min);
            anchored.extend(offs.iter().map(|x| x - min));
        }
        let rate = probes as f64 / capture_wall;
        let p99_gap = percentile(&mut gaps, 99.0);
        let max_gap = gaps.last().copied().unwrap_or(f64::NAN);
        let p99_anch = percentile(&mut anchored, 99.0);
        eprintln!(
            "health {}: {} targets, {rate:.0} probes/s, CPU {cpu_pct:.2}% of one core, gap-lateness p99 {p99_gap:.1} ms max {max_gap:.1} ms, anchored p99 {p99_anch:.1} ms, {silent} targets unprobed",
            target.name(),
            o.probe_targets
        );
        let scen = format!("5 health checks ({} targets, 1 s)", o.probe_targets);
        let scen = scen.as_str();
        res.add(scen, "CPU % of one core", target, cpu_pct);
        res.add(scen, "probes/s", target, rate);
        res.add(scen, "p99 lateness ms (gap)", target, p99_gap);
        res.add(scen, "p99 lateness ms (schedule)", target, p99_anch);
        extra.insert(
            target.name().into(),
            json!({"targets": o.probe_targets, "window_s": wall, "cpu_percent_of_one_core": cpu_pct,
                   "probes_per_s": rate, "gap_lateness_ms_p99": p99_gap, "gap_lateness_ms_max": max_gap,
                   "schedule_lateness_ms_p99": p99_anch, "unprobed_targets": silent}),
        );
        if target == Target::Hlb && (silent > 0 || rate < 0.9 * o.probe_targets as f64) {
            res.fail(format!(
                "health: harvester-lb probed {rate:.0}/s of {} targets, {silent} never",
                o.probe_targets
            ));
        }
    }
    res.extra.insert("health".into(), Value::Object(extra));
}

// ---------------------------------------------------------------------------
// Scenario 6: reload

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

fn reload_scenario(o: &Opts, res: &mut Results) {
    let n = o.reload_lbs;
    let path = o.work.join("hlb-reload.toml");
    let configs = [hlb_reload_config(n, false), hlb_reload_config(n, true)];
    let proc = start_hlb(
        &o.work,
        "hlb-reload",
        &configs[0],
        sa(HLB_IP, ADMIN_PORT + 2),
    );
    // Load: 4 client threads, each a new connection and one request at a time,
    // spread over 10 of the load balancers.
    let stop = Arc::new(AtomicBool::new(false));
    let ok = Arc::new(AtomicU64::new(0));
    let failed = Arc::new(AtomicU64::new(0));
    let first_errors = Arc::new(Mutex::new(Vec::<String>::new()));
    let clients: Vec<_> = (0..4)
        .map(|t| {
            let (stop, ok, failed, errs) = (
                Arc::clone(&stop),
                Arc::clone(&ok),
                Arc::clone(&failed),
                Arc::clone(&first_errors),
            );
            std::thread::spawn(move || {
                let deadline = Instant::now() + Duration::from_secs(600);
                let mut k = t;
                while !stop.load(Ordering::Relaxed) && Instant::now() < deadline {
                    let addr = sa(reload_lb_ip((k * 97) % 1000 % n.max(1)), HTTP_PORT);
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
    let marker = sa(RELOAD_MARKER, HTTP_PORT);
    let mut times = Vec::new();
    for r in 0..o.reloads {
        let with_marker = r % 2 == 0;
        std::fs::write(&path, &configs[usize::from(with_marker)]).expect("write config");
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
            res.fail(format!("reload {r}: not in force after {limit:?}"));
        }
        times.push(ms);
        eprintln!(
            "reload {} ({} LBs{}): {ms:.1} ms",
            r + 1,
            n,
            if with_marker { " + marker" } else { "" }
        );
        std::thread::sleep(Duration::from_millis(300));
    }
    std::thread::sleep(Duration::from_millis(500));
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        let _ = c.join();
    }
    drop(proc);
    let failed = failed.load(Ordering::Relaxed);
    let ok = ok.load(Ordering::Relaxed);
    let mut sorted = times.clone();
    let med = median(&times);
    let p99 = percentile(&mut sorted, 99.0);
    let max = sorted.last().copied().unwrap_or(f64::NAN);
    eprintln!(
        "reload: median {med:.1} ms, max {max:.1} ms; client requests ok {ok}, failed {failed}"
    );
    let scen = format!("6 reload ({n} LBs, {} SIGHUPs)", o.reloads);
    let scen = scen.as_str();
    res.add(scen, "SIGHUP→in force ms (median)", Target::Hlb, med);
    res.add(scen, "SIGHUP→in force ms (max)", Target::Hlb, max);
    res.add(scen, "failed client conns", Target::Hlb, failed as f64);
    res.add(scen, "ok client conns", Target::Hlb, ok as f64);
    res.extra.insert(
        "reload".into(),
        json!({"load_balancers": n, "reloads": o.reloads, "times_ms": times, "median_ms": med,
               "p99_ms": p99, "max_ms": max, "client_ok": ok, "client_failed": failed,
               "first_errors": *first_errors.lock().unwrap_or_else(|p| p.into_inner())}),
    );
    if failed > 0 {
        res.fail(format!(
            "reload: {failed} client connections failed during reloads"
        ));
    }
    if ok == 0 {
        res.fail("reload: no client connection succeeded".into());
    }
}

// ---------------------------------------------------------------------------
// Table, JSON, main

fn sh(cmd: &str) -> String {
    Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
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

fn table(res: &Results, targets: &[Target]) -> String {
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

fn main() {
    let o = parse_opts();
    let needs_peers = !o.smoke;
    let mut missing = Vec::new();
    for tool in ["iperf3", "wrk", "tcpdump"] {
        if !which(tool) {
            missing.push(tool);
        }
    }
    if needs_peers {
        if !which("haproxy") {
            missing.push("haproxy");
        }
        if !which("nginx") || !Path::new(NGINX_STREAM_MODULE).exists() {
            missing.push("nginx + libnginx-mod-stream");
        }
    }
    if !missing.is_empty() {
        eprintln!(
            "missing: {} — run benches/compare.sh, which installs them with apt-get",
            missing.join(", ")
        );
        std::process::exit(1);
    }
    let started = Instant::now();
    let date = sh("date -u +%Y-%m-%dT%H:%M:%SZ");
    let mut res = Results::default();

    // Backends and proxies for scenarios 1–4.
    let want_traffic = o
        .scenarios
        .iter()
        .any(|s| ["throughput", "rps", "cps", "idle"].contains(&s.as_str()));
    if want_traffic {
        let exe = std::env::current_exe().expect("current exe");
        let http_backend = Proc::spawn(
            "http-backend",
            Command::new(&exe)
                .arg("--serve-http")
                .arg(sa(BACKEND_IP, HTTP_PORT).to_string()),
            &o.work.join("http-backend.log"),
        );
        let iperf_server = Proc::spawn(
            "iperf3-server",
            Command::new("iperf3").args([
                "-s",
                "-B",
                &BACKEND_IP.to_string(),
                "-p",
                &IPERF_PORT.to_string(),
            ]),
            &o.work.join("iperf3-server.log"),
        );
        wait_port(sa(BACKEND_IP, HTTP_PORT), "http backend");
        wait_port(sa(BACKEND_IP, IPERF_PORT), "iperf3 server");
        let mut procs: Vec<(Target, Proc)> = Vec::new();
        procs.push((
            Target::Hlb,
            start_hlb(&o.work, "hlb", &hlb_config(), sa(HLB_IP, ADMIN_PORT)),
        ));
        if o.targets.contains(&Target::Haproxy) {
            let cfg = o.work.join("haproxy.cfg");
            std::fs::write(&cfg, haproxy_config()).expect("write");
            procs.push((
                Target::Haproxy,
                Proc::spawn(
                    "haproxy",
                    Command::new("haproxy").arg("-db").arg("-f").arg(&cfg),
                    &o.work.join("haproxy.log"),
                ),
            ));
            wait_port(sa(HAPROXY_IP, HTTP_PORT), "haproxy");
        }
        if o.targets.contains(&Target::Nginx) {
            let cfg = o.work.join("nginx.conf");
            std::fs::write(&cfg, nginx_config(&o.work)).expect("write");
            procs.push((
                Target::Nginx,
                Proc::spawn(
                    "nginx",
                    Command::new("nginx")
                        .arg("-p")
                        .arg(&o.work)
                        .arg("-c")
                        .arg(&cfg),
                    &o.work.join("nginx.log"),
                ),
            ));
            wait_port(sa(NGINX_IP, HTTP_PORT), "nginx");
        }
        // Let the first health checks pass everywhere.
        std::thread::sleep(Duration::from_millis(1500));
        let pids: Vec<(Target, i32)> = procs.iter().map(|(t, p)| (*t, p.pid())).collect();
        traffic_scenarios(&o, &mut res, &pids);
        if o.scenarios.iter().any(|s| s == "idle") {
            idle_scenario(&o, &mut res, &mut procs);
        }
        for (t, p) in procs.iter_mut() {
            if !p.alive() {
                res.fail(format!("{} exited during the run", t.name()));
            }
        }
        drop(procs);
        drop(iperf_server);
        drop(http_backend);
    }
    if o.scenarios.iter().any(|s| s == "health") {
        health_scenario(&o, &mut res);
    }
    if o.scenarios.iter().any(|s| s == "reload") {
        let exe = std::env::current_exe().expect("current exe");
        let http_backend = Proc::spawn(
            "http-backend",
            Command::new(&exe)
                .arg("--serve-http")
                .arg(sa(BACKEND_IP, HTTP_PORT).to_string()),
            &o.work.join("http-backend-reload.log"),
        );
        wait_port(sa(BACKEND_IP, HTTP_PORT), "http backend");
        reload_scenario(&o, &mut res);
        drop(http_backend);
    }

    let machine = format!(
        "{}; {} cores; {} GiB RAM; kernel {}; open files limit {}",
        sh("grep -m1 'model name' /proc/cpuinfo | cut -d: -f2"),
        sh("nproc"),
        sh("free -g | awk '/Mem:/{print $2}'"),
        sh("uname -r"),
        sh("ulimit -n")
    );
    let versions = format!(
        "haproxy {}; nginx {}; iperf3 {}; wrk {}",
        sh("haproxy -v 2>/dev/null | head -1 | awk '{print $3}'"),
        sh("nginx -v 2>&1 | sed 's/.*nginx\\///'"),
        sh("iperf3 --version 2>/dev/null | head -1 | awk '{print $2}'"),
        sh("wrk -v 2>&1 | head -1 | awk '{print $2}'"),
    );
    let command: Vec<String> = std::env::args().collect();
    let tbl = table(&res, &o.targets);
    println!(
        "\nharvester-lb comparison, {date}\nmachine: {machine}\nversions: {versions}\nrounds {}, {} s per run; medians over rounds; one worker thread/process each; 2 cores shared by load generator, proxy and backend\n",
        o.rounds, o.duration
    );
    println!("{tbl}");
    let samples: Vec<Value> = res
        .samples
        .iter()
        .map(|((scen, metric, t), v)| {
            json!({"scenario": scen, "metric": metric, "target": t.name(), "samples": v, "median": median(v)})
        })
        .collect();
    let doc = json!({
        "date": date,
        "machine": machine,
        "versions": versions,
        "command": command,
        "smoke": o.smoke,
        "rounds": o.rounds,
        "duration_s": o.duration,
        "elapsed_s": started.elapsed().as_secs_f64(),
        "commands": res.commands,
        "results": samples,
        "details": res.extra,
        "failures": res.failures,
        "table_markdown": tbl,
    });
    if let Some(dir) = o.json.parent()
        && !dir.as_os_str().is_empty()
    {
        let _ = std::fs::create_dir_all(dir);
    }
    std::fs::write(&o.json, serde_json::to_string_pretty(&doc).expect("json"))
        .unwrap_or_else(|e| panic!("cannot write {}: {e}", o.json.display()));
    println!("raw results: {}", o.json.display());
    let _ = std::fs::remove_dir_all(&o.work);
    if !res.failures.is_empty() {
        eprintln!("{} failure(s):", res.failures.len());
        for f in &res.failures {
            eprintln!("  {f}");
        }
        std::process::exit(1);
    }
}

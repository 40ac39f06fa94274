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
/// Scale: load balancer i listens on 127.247.(i / 250).(i % 250 + 1):SCALE_PORT
/// and forwards to HTTP_PORT on its backends 127.(244 + j).(i / 250).(i % 250 + 1),
/// j = 0..3, which are checked on SCALE_PROBE_PORT: one address per backend,
/// the three backend /16s together one /14 for the capture filter.
const SCALE_PORT: u16 = 18090;
const SCALE_PROBE_PORT: u16 = 30998;
/// The load balancer that reloads of the scale scenario add and remove; its
/// index is past every other one (`--scale-lbs` stays below it).
const SCALE_MARKER: usize = 63_999;
/// Harvester's default check period (healthcheck-periodseconds), seconds.
const SCALE_PERIOD: u64 = 5;

/// UDP (DNS): dnsmasq on BACKEND_IP and every proxy's UDP listener.
const DNS_PORT: u16 = 15353;

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
    scale_lbs: usize,
    scale_window: u64,
    scale_reloads: usize,
    work: PathBuf,
}

const ALL_SCENARIOS: [&str; 8] = [
    "throughput",
    "rps",
    "cps",
    "idle",
    "health",
    "reload",
    "scale",
    "udp",
];

fn usage() -> ! {
    eprintln!(
        "usage: compare [--smoke] [--json FILE] [--rounds N] [--duration SECONDS]\n\
         \x20              [--only throughput,rps,cps,idle,health,reload,scale,udp] [--scale-lbs N]\n\
         --smoke: every scenario about a second (scale: 500 load balancers, ~25 s), against harvester-lb alone; exits non-zero on failure\n\
         --scale-lbs: load balancers of 3 backends in the scale scenario (default 10000, at most {})",
        SCALE_MARKER - 1
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
    let mut scale_lbs = None;
    while let Some(a) = args.next() {
        match a.as_str() {
            "--bench" => {} // passed by `cargo bench`
            "--smoke" => smoke = true,
            "--json" => json = Some(PathBuf::from(args.next().unwrap_or_else(|| usage()))),
            "--rounds" => rounds = args.next().and_then(|v| v.parse().ok()),
            "--duration" => duration = args.next().and_then(|v| v.parse().ok()),
            "--scale-lbs" => {
                let n = args.next().and_then(|v| v.parse::<usize>().ok());
                match n {
                    Some(n) if (1..SCALE_MARKER).contains(&n) => scale_lbs = Some(n),
                    _ => usage(),
                }
            }
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
        scale_lbs: scale_lbs.unwrap_or(if smoke { 500 } else { 10_000 }),
        scale_window: if smoke { 5 } else { 20 },
        scale_reloads: if smoke { 3 } else { 10 },
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
    if !try_wait_port(addr, Duration::from_secs(20)) {
        panic!("{what} is not listening on {addr} after 20 s");
    }
}

/// Whether `addr` accepts a connection within `limit`.
fn try_wait_port(addr: SocketAddr, limit: Duration) -> bool {
    let deadline = Instant::now() + limit;
    while Instant::now() < deadline {
        if TcpStream::connect_timeout(&addr, Duration::from_millis(200)).is_ok() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    false
}

/// A listening socket of the bench (backends, probe targets), backlog 4096.
/// On the unspecified address it is tied to `lo` (SO_BINDTODEVICE), so it
/// answers for every address in 127.0.0.0/8 with one descriptor and for
/// nothing outside loopback.
fn bench_listener(addr: SocketAddr) -> std::net::TcpListener {
    use socket2::{Domain, Protocol, Socket, Type};
    let s =
        Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP)).expect("socket");
    s.set_reuse_address(true).expect("reuseaddr");
    if addr.ip().is_unspecified()
        && let Err(e) = s.bind_device(Some(b"lo"))
    {
        eprintln!("note: cannot tie {addr} to lo ({e}); it listens on every interface");
    }
    s.bind(&addr.into())
        .unwrap_or_else(|e| panic!("bind {addr}: {e}"));
    s.listen(4096).expect("listen");
    s.set_nonblocking(true).expect("nonblocking");
    s.into()
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

/// nginx with `config` written to `<name>.conf` in `work`, logging to `<name>.log`.
fn spawn_nginx(work: &Path, name: &str, config: &str) -> Proc {
    let cfg = work.join(format!("{name}.conf"));
    std::fs::write(&cfg, config).expect("write nginx config");
    Proc::spawn(
        name,
        Command::new("nginx")
            .arg("-p")
            .arg(work)
            .arg("-c")
            .arg(&cfg),
        &work.join(format!("{name}.log")),
    )
}

fn start_hlb(work: &Path, name: &str, config: &str, admin: SocketAddr) -> Proc {
    let path = work.join(format!("{name}.toml"));
    // The admin socket in the bench's directory: a harvester-lb serving
    // this host keeps /run/harvester-lb/admin.sock, and a bench daemon
    // must neither take it nor fail on it.
    let socket = format!(
        "[admin]\nsocket = {:?}\n",
        work.join(format!("{name}.sock"))
    );
    let config = config.replacen("[admin]\n", &socket, 1);
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
    http_get_within(addr, path, Duration::from_secs(5))
}

/// [`http_get`] waiting up to `limit` for each read: a scrape at scale is
/// rendered whole before its first byte leaves.
fn http_get_within(addr: SocketAddr, path: &str, limit: Duration) -> std::io::Result<String> {
    let mut s = TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(limit))?;
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
/// `Connection: close`. On `0.0.0.0` it serves every loopback address (the
/// scale scenario's 30,000 backends, see [`bench_listener`]). Never returns.
fn serve_http(addr: SocketAddr) -> ! {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    rt.block_on(async move {
        let listener =
            tokio::net::TcpListener::from_std(bench_listener(addr)).expect("tokio listener");
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
    /// One listener per target, on `probe_ip(i)`.
    fn start(n: usize) -> ProbeTargets {
        let t = ProbeTargets::empty();
        for i in 0..n {
            let addr = sa(probe_ip(i), PROBE_PORT);
            let std_l = std::net::TcpListener::bind(addr)
                .unwrap_or_else(|e| panic!("bind probe target {addr}: {e}"));
            std_l.set_nonblocking(true).expect("nonblocking");
            t.serve(std_l);
        }
        t
    }

    /// One listener on `0.0.0.0:port`, tied to `lo`: every loopback address is
    /// a target. The scale scenario's 30,000 targets would not fit the
    /// open-file limit as listeners of their own.
    fn loopback(port: u16) -> ProbeTargets {
        let t = ProbeTargets::empty();
        t.serve(bench_listener(sa(Ipv4Addr::UNSPECIFIED, port)));
        t
    }

    fn empty() -> ProbeTargets {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        ProbeTargets { rt: Some(rt) }
    }

    /// Accepts and drops on `std_l` (non-blocking) until dropped.
    fn serve(&self, std_l: std::net::TcpListener) {
        let rt = self.rt.as_ref().expect("runtime");
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
/// window runs without it. Targets are the SYNs to `port` in `net`; `index`
/// numbers them (0..n; None: not a target).
struct SynCapture {
    proc: Proc,
    arrivals: Arc<Mutex<Vec<Vec<f64>>>>,
    reader: Option<std::thread::JoinHandle<()>>,
}

impl SynCapture {
    fn start(
        n: usize,
        work: &Path,
        port: u16,
        net: &str,
        index: impl Fn(Ipv4Addr) -> Option<usize> + Send + 'static,
    ) -> SynCapture {
        let log = work.join("tcpdump.log");
        let filter = format!(
            "dst port {port} and dst net {net} and tcp[tcpflags] & (tcp-syn|tcp-ack) == tcp-syn"
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
                let Some(i) = ip.parse::<Ipv4Addr>().ok().and_then(&index) else {
                    continue;
                };
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
        let capture = SynCapture::start(
            o.probe_targets,
            &o.work,
            PROBE_PORT,
            "127.250.0.0/16",
            |ip| {
                let [_, _, c, d] = ip.octets();
                Some(c as usize * 250 + (d as usize).checked_sub(1)?)
            },
        );
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
struct ReloadRun {
    /// SIGHUP to the marker load balancer's change in force, per reload.
    times_ms: Vec<f64>,
    ok: u64,
    failed: u64,
    first_errors: Vec<String>,
}

impl ReloadRun {
    /// Median, p99 and max of the reload times, ms.
    fn stats(&self) -> (f64, f64, f64) {
        let mut sorted = self.times_ms.clone();
        let p99 = percentile(&mut sorted, 99.0);
        let max = sorted.last().copied().unwrap_or(f64::NAN);
        (median(&self.times_ms), p99, max)
    }

    /// Any failed client connection is a failure of the run, and so is none
    /// succeeding.
    fn check(&self, res: &mut Results, what: &str) {
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
fn reloads_under_load(
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

// ---------------------------------------------------------------------------
// Scenario 7: scale

fn scale_vip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(127, 247, (i / 250) as u8, (i % 250 + 1) as u8)
}

fn scale_backend(i: usize, j: usize) -> Ipv4Addr {
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

/// The body of a 200 answer to [`http_get`], de-chunked (HAProxy's exporter
/// sends chunks, harvester-lb a length); None for any other answer.
fn http_body(resp: &str) -> Option<String> {
    let (head, body) = resp.split_once("\r\n\r\n")?;
    if !head.starts_with("HTTP/1.1 200") && !head.starts_with("HTTP/1.0 200") {
        return None;
    }
    if !head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked")
    {
        return Some(body.to_string());
    }
    let mut out = String::with_capacity(body.len());
    let mut rest = body;
    // Bounded: every turn consumes a size line.
    loop {
        let (size, after) = rest.split_once("\r\n")?;
        let size = usize::from_str_radix(size.split(';').next()?.trim(), 16).ok()?;
        if size == 0 {
            return Some(out);
        }
        out.push_str(after.get(..size)?);
        rest = after.get(size..)?.strip_prefix("\r\n")?;
    }
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
fn scale_scenario(o: &Opts, res: &mut Results) {
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
    let mut proc = start_hlb(&o.work, "hlb-scale", &configs[0], admin);
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
    // The issue's yardstick for the probe cost: the health scenario's cost
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

// ---------------------------------------------------------------------------
// Table, JSON, main

// ---------------------------------------------------------------------------
// Scenario 8: UDP (DNS) with dnsperf against dnsmasq

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

fn udp_scenario(o: &Opts, res: &mut Results) {
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
        start_hlb(
            &o.work,
            "hlb-udp",
            &hlb_udp_config(),
            sa(HLB_IP, ADMIN_PORT),
        ),
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
    for round in 0..o.rounds {
        let mut qps_round = BTreeMap::new();
        for t in run_order(&targets, round) {
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
            procs.push((
                Target::Nginx,
                spawn_nginx(&o.work, "nginx", &nginx_config(&o.work)),
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
    if o.scenarios.iter().any(|s| s == "udp") {
        udp_scenario(&o, &mut res);
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
    if o.scenarios.iter().any(|s| s == "scale") {
        // On 0.0.0.0, tied to lo: the backend of every scale backend address.
        let exe = std::env::current_exe().expect("current exe");
        let http_backend = Proc::spawn(
            "http-backend",
            Command::new(&exe)
                .arg("--serve-http")
                .arg(sa(Ipv4Addr::UNSPECIFIED, HTTP_PORT).to_string()),
            &o.work.join("http-backend-scale.log"),
        );
        wait_port(sa(scale_backend(0, 0), HTTP_PORT), "http backend");
        scale_scenario(&o, &mut res);
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

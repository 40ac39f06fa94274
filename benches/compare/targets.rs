//! What the bench measures against: the [`Target`]s, the processes it
//! starts for them ([`Proc`], stopped by pid), and each proxy's config for
//! the traffic scenarios. Scenario-specific configs (health, reload, scale,
//! udp) live with their scenario.

use std::net::{Ipv4Addr, SocketAddr};
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::util::{http_body, http_get, sa, signal, wait_http_ok, wait_port};

/// The harvester-lb binary Cargo built for this bench (release profile).
const HLB_BIN: &str = env!("CARGO_BIN_EXE_harvester-lb");

/// Addresses: one per role, all on loopback, so every proxy uses the same ports.
pub const BACKEND_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 1);
pub const HLB_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 2);
pub const HAPROXY_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 3);
pub const NGINX_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 4);
/// The kernel target's VIP: DNAT to BACKEND_IP on the same ports (see
/// [`crate::host::KernelDnat`]). Not a loopback address: the daemon refuses
/// a loopback VIP on a kernel listener, and both kernel targets must take
/// the same path, so both VIPs are in 198.18.0.0/15 (RFC 2544's benchmark
/// range), on `lo` of the bench's own network namespace
/// ([`crate::host::private_netns`]).
pub const KERNEL_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 5);
/// The VIP of harvester-lb with `forwarding = "kernel"` listeners.
pub const HLB_KERNEL_IP: Ipv4Addr = Ipv4Addr::new(198, 18, 0, 6);
/// The VIPs of the `--log-modes` targets: harvester-lb with
/// `log_connections = "errors"` and `"all"`, each its own process.
pub const HLB_LOG_ERRORS_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 16);
pub const HLB_LOG_ALL_IP: Ipv4Addr = Ipv4Addr::new(127, 252, 0, 17);
/// Ports, the same on the backend and on every proxy.
pub const IPERF_PORT: u16 = 15201;
pub const HTTP_PORT: u16 = 18080;
pub const ADMIN_PORT: u16 = 19901;

pub const NGINX_STREAM_MODULE: &str = "/usr/lib/nginx/modules/ngx_stream_module.so";

#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Debug)]
pub enum Target {
    /// The backend itself: what the client and backend do without a proxy.
    Direct,
    /// The kernel forwarding on its own (nftables DNAT, as kube-proxy does a
    /// Service): the floor a user-space proxy is measured against.
    Kernel,
    /// harvester-lb with its listeners `forwarding = "kernel"`: the daemon
    /// writes nftables DNAT and the kernel forwards. Like [`Target::Kernel`]
    /// it is in force only during its own runs (the daemon is started for
    /// each and stopped after it, which removes its table), so its NAT
    /// hooks do not turn conntrack on for the proxies' runs.
    HlbKernel,
    Hlb,
    /// harvester-lb with `log_connections = "errors"` (`--log-modes`): run
    /// beside [`Target::Hlb`] in the same rounds, so the connection log's
    /// cost is a per-round ratio rather than a gap between separate runs.
    HlbLogErrors,
    /// harvester-lb with `log_connections = "all"` (`--log-modes`).
    HlbLogAll,
    Haproxy,
    Nginx,
}

impl Target {
    /// Every target, in the table's column order.
    pub const ALL: [Target; 8] = [
        Target::Direct,
        Target::Kernel,
        Target::HlbKernel,
        Target::Hlb,
        Target::HlbLogErrors,
        Target::HlbLogAll,
        Target::Haproxy,
        Target::Nginx,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Target::Direct => "direct",
            Target::Kernel => "kernel",
            Target::HlbKernel => "harvester-lb (kernel)",
            Target::Hlb => "harvester-lb",
            Target::HlbLogErrors => "hlb-log-errors",
            Target::HlbLogAll => "hlb-log-all",
            Target::Haproxy => "haproxy",
            Target::Nginx => "nginx",
        }
    }

    /// The name in the ratio columns' headers.
    pub fn short(self) -> &'static str {
        match self {
            Target::Hlb => "hlb",
            Target::HlbKernel => "hlb-kernel",
            t => t.name(),
        }
    }

    pub fn ip(self) -> Ipv4Addr {
        match self {
            Target::Direct => BACKEND_IP,
            Target::Kernel => KERNEL_IP,
            Target::HlbKernel => HLB_KERNEL_IP,
            Target::Hlb => HLB_IP,
            Target::HlbLogErrors => HLB_LOG_ERRORS_IP,
            Target::HlbLogAll => HLB_LOG_ALL_IP,
            Target::Haproxy => HAPROXY_IP,
            Target::Nginx => NGINX_IP,
        }
    }
}

/// A process we started; stopped by pid (SIGTERM, then SIGKILL) when dropped.
pub struct Proc {
    pub name: String,
    pub child: std::process::Child,
}

impl Proc {
    pub fn spawn(name: &str, cmd: &mut Command, log: &Path) -> Proc {
        let out = std::fs::File::create(log).expect("create log");
        let err = out.try_clone().expect("clone log");
        let child = cmd
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e} ({cmd:?})"));
        crate::host::track_child(child.id() as i32);
        Proc {
            name: name.to_string(),
            child,
        }
    }

    pub fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    pub fn alive(&mut self) -> bool {
        matches!(self.child.try_wait(), Ok(None))
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        crate::host::forget_child(self.pid());
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

/// "1 thread", "2 threads": the suffix of the traffic scenarios' rows.
pub fn threads_label(threads: usize) -> String {
    format!("{threads} thread{}", if threads == 1 { "" } else { "s" })
}

// ---------------------------------------------------------------------------
// The traffic scenarios' proxies (throughput, rps, cps, idle)

/// harvester-lb config: one load balancer on `ip` with both listeners, its
/// admin API on the same address. `log` is its `log_connections` (None:
/// not written, the default "none"); the lines go to `<name>.log` in the
/// work directory, as the daemon's stderr. `HLB_LOG_LINES_PER_SECOND` sets
/// `[log] max_connection_lines_per_second`.
fn hlb_config(ip: Ipv4Addr, log: Option<&str>) -> String {
    hlb_config_to(ip, BACKEND_IP, log)
}

/// [`hlb_config`] with its backend at `backend` (the forward topology's).
pub fn hlb_config_to(ip: Ipv4Addr, backend: Ipv4Addr, log: Option<&str>) -> String {
    let log = log.map_or(String::new(), |mode| {
        format!("log_connections = {mode:?}\n")
    });
    // `HLB_LOG_LINES_PER_SECOND`: its bound (`[log]`), default 1000.
    let lines = std::env::var("HLB_LOG_LINES_PER_SECOND").map_or(String::new(), |n| {
        format!("[log]\nmax_connection_lines_per_second = {n}\n")
    });
    format!(
        r#"[admin]
listen = "{ip}:{ADMIN_PORT}"
{lines}[proxy]
backlog = 4096
max_connections = 15000
[[load_balancer]]
name = "bench/main"
vip = "{ip}"
backends = ["{backend}"]
algorithm = "round_robin"
{log}  [[load_balancer.listener]]
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

/// harvester-lb with every listener `forwarding = "kernel"` on
/// [`HLB_KERNEL_IP`] (the `harvester-lb (kernel)` target): `listeners` are
/// (name, port, protocol), each to the same port on [`BACKEND_IP`], checked
/// on `check_port` over TCP. `source_nat = "none"`: the bench's `kernel`
/// target does not masquerade either (kube-proxy does not for a client on
/// the node itself), so both rewrite the same addresses. A 1 s drain: the
/// daemon is stopped after each run and its table goes after the drain.
pub fn hlb_kernel_config(listeners: &[(&str, u16, &str)], check_port: u16) -> String {
    hlb_kernel_config_to(listeners, check_port, BACKEND_IP)
}

/// [`hlb_kernel_config`] with its backend at `backend` (the forward
/// topology's).
pub fn hlb_kernel_config_to(
    listeners: &[(&str, u16, &str)],
    check_port: u16,
    backend: Ipv4Addr,
) -> String {
    let ip = HLB_KERNEL_IP;
    let mut s = format!(
        "[admin]\nlisten = \"{ip}:{ADMIN_PORT}\"\n[proxy]\ndrain_timeout_seconds = 1\n[[load_balancer]]\nname = \"bench/kernel\"\nvip = \"{ip}\"\nbackends = [\"{backend}\"]\nalgorithm = \"round_robin\"\n"
    );
    for (name, port, protocol) in listeners {
        s.push_str(&format!(
            "  [[load_balancer.listener]]\n  name = \"{name}\"\n  port = {port}\n  backend_port = {port}\n  protocol = \"{protocol}\"\n  forwarding = \"kernel\"\n  source_nat = \"none\"\n"
        ));
    }
    s.push_str(&format!(
        "  [load_balancer.health_check]\n  port = {check_port}\n  period_seconds = 1\n  timeout_seconds = 1\n"
    ));
    s
}

/// HAProxy with `threads` threads (`nbthread`), TCP mode, splice when it
/// pays, the same health check as harvester-lb's.
fn haproxy_config(threads: usize) -> String {
    haproxy_config_at(threads, HAPROXY_IP, BACKEND_IP)
}

/// [`haproxy_config`] on `vip`, forwarding to `backend`.
pub fn haproxy_config_at(threads: usize, vip: Ipv4Addr, backend: Ipv4Addr) -> String {
    format!(
        r#"global
  nbthread {threads}
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
  bind {vip}:{IPERF_PORT} backlog 4096
  default_backend iperf
backend iperf
  server b1 {backend}:{IPERF_PORT}

frontend http
  bind {vip}:{HTTP_PORT} backlog 4096
  default_backend http
backend http
  server b1 {backend}:{HTTP_PORT}
"#
    )
}

/// nginx's stream module with `threads` worker processes.
fn nginx_config(work: &Path, threads: usize) -> String {
    let w = work.display();
    format!(
        r#"load_module {NGINX_STREAM_MODULE};
daemon off;
worker_processes {threads};
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
pub fn spawn_nginx(work: &Path, name: &str, config: &str) -> Proc {
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

/// How harvester-lb runs: `harvester-lb run --threads N`, plus whatever
/// `HLB_ARGS` adds (space-separated, appended; e.g. a runtime flag to A/B).
pub struct HlbRun<'a> {
    pub work: &'a Path,
    pub extra_args: &'a [String],
}

impl HlbRun<'_> {
    /// harvester-lb on `config` (written to `<name>.toml`) with `threads`
    /// worker threads; returns once `admin` answers `/readyz`.
    pub fn start(&self, name: &str, config: &str, admin: SocketAddr, threads: usize) -> Proc {
        let path = self.work.join(format!("{name}.toml"));
        // The admin socket in the bench's directory: a harvester-lb serving
        // this host keeps /run/harvester-lb/admin.sock, and a bench daemon
        // must neither take it nor fail on it.
        let socket = format!(
            "[admin]\nsocket = {:?}\n",
            self.work.join(format!("{name}.sock"))
        );
        let config = config.replacen("[admin]\n", &socket, 1);
        std::fs::write(&path, config).expect("write config");
        let mut cmd = Command::new(HLB_BIN);
        cmd.args(["run", "--no-watch", "--threads", &threads.to_string()])
            .arg("--config")
            .arg(&path)
            .args(self.extra_args)
            // Connection log lines (info) pass when a config asks for them.
            .env("HARVESTER_LB_LOG", "warn,harvester_lb::connection=info");
        let p = Proc::spawn(name, &mut cmd, &self.work.join(format!("{name}.log")));
        wait_http_ok(admin, "/readyz", Duration::from_secs(60));
        p
    }
}

impl HlbRun<'_> {
    /// harvester-lb on a [`hlb_kernel_config`], returned once `/status`
    /// shows every listener forwarded by the kernel with its backend
    /// eligible (before that, a connection would be served by the proxy
    /// or refused). Err names what it showed instead.
    pub fn start_kernel(&self, name: &str, config: &str) -> Result<Proc, String> {
        let admin = sa(HLB_KERNEL_IP, ADMIN_PORT);
        let p = self.start(name, config, admin, 1);
        let deadline = Instant::now() + Duration::from_secs(20);
        let mut last = String::new();
        while Instant::now() < deadline {
            if let Ok(r) = http_get(admin, "/status")
                && let Some(body) = http_body(&r)
            {
                if kernel_forwards(&body) {
                    return Ok(p);
                }
                last = body;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        Err(format!(
            "{name}: its listeners are not all forwarded by the kernel with an eligible backend after 20 s; /status: {last}"
        ))
    }
}

/// Whether every listener in a `/status` body has `"forwarding": "kernel"`
/// and an eligible backend (at least one listener).
fn kernel_forwards(status: &str) -> bool {
    let (total, _, eligible) = kernel_listeners(status);
    total > 0 && eligible == total
}

/// The listeners of a `/status` body: how many, how many with
/// `"forwarding": "kernel"`, and how many of those with an eligible
/// backend. All 0 when the body is not JSON.
pub fn kernel_listeners(status: &str) -> (usize, usize, usize) {
    fn listeners<'a>(v: &'a Value, out: &mut Vec<&'a Value>) {
        match v {
            Value::Object(m) => {
                if m.contains_key("forwarding") {
                    out.push(v);
                }
                m.values().for_each(|x| listeners(x, out));
            }
            Value::Array(a) => a.iter().for_each(|x| listeners(x, out)),
            _ => {}
        }
    }
    let Ok(v) = serde_json::from_str::<Value>(status) else {
        return (0, 0, 0);
    };
    let mut ls = Vec::new();
    listeners(&v, &mut ls);
    let kernel = ls.iter().filter(|l| l["forwarding"] == "kernel");
    let eligible = kernel
        .clone()
        .filter(|l| l["eligible_backends"].as_u64().is_some_and(|n| n > 0))
        .count();
    (ls.len(), kernel.count(), eligible)
}

/// The proxies of the traffic scenarios among `targets`, each with
/// `threads` threads or worker processes, listening when this returns.
pub fn start_proxies(hlb: &HlbRun, targets: &[Target], threads: usize) -> Vec<(Target, Proc)> {
    let work = hlb.work;
    let mut procs: Vec<(Target, Proc)> = Vec::new();
    // `HLB_LOG_CONNECTIONS` (environment: `none`, `errors`, `all`) sets the
    // plain harvester-lb target's `log_connections`.
    let log = std::env::var("HLB_LOG_CONNECTIONS").ok();
    let mut hlbs = vec![(Target::Hlb, "hlb", log.as_deref())];
    if targets.contains(&Target::HlbLogErrors) {
        hlbs.push((Target::HlbLogErrors, "hlb-log-errors", Some("errors")));
    }
    if targets.contains(&Target::HlbLogAll) {
        hlbs.push((Target::HlbLogAll, "hlb-log-all", Some("all")));
    }
    for (t, name, log) in hlbs {
        let config = hlb_config(t.ip(), log);
        procs.push((t, hlb.start(name, &config, sa(t.ip(), ADMIN_PORT), threads)));
    }
    if targets.contains(&Target::Haproxy) {
        let cfg = work.join("haproxy.cfg");
        std::fs::write(&cfg, haproxy_config(threads)).expect("write");
        procs.push((
            Target::Haproxy,
            Proc::spawn(
                "haproxy",
                Command::new("haproxy").arg("-db").arg("-f").arg(&cfg),
                &work.join("haproxy.log"),
            ),
        ));
        wait_port(sa(HAPROXY_IP, HTTP_PORT), "haproxy");
    }
    if targets.contains(&Target::Nginx) {
        procs.push((
            Target::Nginx,
            spawn_nginx(work, "nginx", &nginx_config(work, threads)),
        ));
        wait_port(sa(NGINX_IP, HTTP_PORT), "nginx");
    }
    procs
}

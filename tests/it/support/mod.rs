//! Test support: loopback subnets of our own, real backends of every kind a
//! load balancer meets, the daemon started in-process, and polling helpers.
//!
//! Every address is inside 127.0.0.0/8. Each test takes its own /24 there
//! (`127.A.B.0/24`), so tests run in parallel — threads or processes — on fixed
//! ports without colliding, and backends on one port are told apart by address.

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

mod config;
pub mod fd_store;
mod process;
mod skip;
pub use config::{Config, Lb, Listener, quote};
pub use config::{conntrackd, keepalived, network, problems, rendered};
pub use process::{Launch, Process, proc_cpu_time, proc_rss_kib, proc_threads};
pub use skip::skip_or_fail;
pub use skip::{cannot_run, find_tool, missing_tool, not_root};

use std::future::Future;
use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicUsize, Ordering};
use std::time::Duration;

use harvester_lb::metrics::names::{Family, Kind};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpSocket, TcpStream};
use tokio::task::JoinHandle;
use tokio::time::Instant;

/// A /24 inside 127.0.0.0/8 that belongs to one test for its lifetime.
pub struct Subnet {
    a: u8,
    b: u8,
    /// Held to claim the subnet; other tests see the port in use and move on.
    _claim: std::net::TcpListener,
    dir: PathBuf,
}

static NEXT: AtomicU32 = AtomicU32::new(0);

impl Subnet {
    /// Claims a free subnet.
    pub fn new() -> Self {
        let pid = std::process::id();
        for _ in 0..500 {
            let n = (pid
                .wrapping_mul(17)
                .wrapping_add(NEXT.fetch_add(1, Ordering::Relaxed)))
                % (200 * 250);
            let (a, b) = (20 + (n / 250) as u8, (n % 250) as u8);
            let claim_addr = SocketAddr::from(([127, a, b, 254], 65000));
            if let Ok(claim) = std::net::TcpListener::bind(claim_addr) {
                let dir = std::env::temp_dir().join(format!("hlb-test-{a}-{b}-{pid}"));
                let _ = std::fs::remove_dir_all(&dir);
                std::fs::create_dir_all(&dir).expect("create test dir");
                return Self {
                    a,
                    b,
                    _claim: claim,
                    dir,
                };
            }
        }
        panic!("no free 127.x.y.0/24 test subnet after 500 tries");
    }

    /// `127.A.B.host`.
    pub fn ip(&self, host: u8) -> IpAddr {
        IpAddr::V4(Ipv4Addr::new(127, self.a, self.b, host))
    }

    /// `127.A.B.host` of each of `hosts`.
    pub fn ips(&self, hosts: &[u8]) -> Vec<IpAddr> {
        hosts.iter().map(|h| self.ip(*h)).collect()
    }

    /// `127.A.B.host` as a string, for configs.
    pub fn ip_str(&self, host: u8) -> String {
        self.ip(host).to_string()
    }

    /// A scratch directory for this test's files.
    pub fn dir(&self) -> &PathBuf {
        &self.dir
    }

    /// Writes `text` to `name` in the test directory and returns the path.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let path = self.dir.join(name);
        std::fs::write(&path, text).expect("write test file");
        path
    }
}

impl Drop for Subnet {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Polls `check` every 20 ms until it returns `Some`, or panics with `what`
/// after `timeout`.
pub async fn wait_for<T, F, Fut>(timeout: Duration, what: &str, mut check: F) -> T
where
    F: FnMut() -> Fut,
    Fut: Future<Output = Option<T>>,
{
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(v) = check().await {
            return v;
        }
        assert!(
            Instant::now() < deadline,
            "timed out after {timeout:?} waiting for {what}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// What a test backend does with each connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Behaviour {
    /// Writes its name and a newline, then echoes until EOF, then closes.
    NameThenEcho,
    /// Echoes until EOF, then shuts down its write side.
    Echo,
    /// Reads until EOF, then answers `got N bytes\n` and closes (half-close).
    CountThenAnswer,
    /// Accepts and holds the connection without reading or writing.
    Hold,
}

/// A real TCP backend on a loopback address.
pub struct Backend {
    /// Where it listens.
    pub addr: SocketAddr,
    /// Connections accepted so far.
    pub accepted: Arc<AtomicUsize>,
    task: JoinHandle<()>,
}

impl Backend {
    /// Starts a backend on `addr` with `behaviour`; its name is its IP.
    pub async fn start(addr: SocketAddr, behaviour: Behaviour) -> Self {
        let listener = TcpListener::bind(addr)
            .await
            .unwrap_or_else(|e| panic!("bind backend {addr}: {e}"));
        let accepted = Arc::new(AtomicUsize::new(0));
        let count = Arc::clone(&accepted);
        let name = addr.ip().to_string();
        let task = tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let Ok((mut s, _)) = listener.accept().await else {
                    continue;
                };
                count.fetch_add(1, Ordering::SeqCst);
                if behaviour == Behaviour::Hold {
                    held.push(s);
                    continue;
                }
                let name = name.clone();
                tokio::spawn(async move {
                    let _ = serve(&mut s, behaviour, &name).await;
                });
            }
        });
        Self {
            addr,
            accepted,
            task,
        }
    }

    /// Stops listening: new connections are refused.
    pub fn stop(self) {
        self.task.abort();
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.task.abort();
    }
}

async fn serve(s: &mut TcpStream, behaviour: Behaviour, name: &str) -> std::io::Result<()> {
    let mut buf = vec![0u8; 64 * 1024];
    match behaviour {
        Behaviour::NameThenEcho | Behaviour::Echo => {
            if behaviour == Behaviour::NameThenEcho {
                s.write_all(format!("{name}\n").as_bytes()).await?;
            }
            loop {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    s.shutdown().await?;
                    return Ok(());
                }
                s.write_all(&buf[..n]).await?;
            }
        }
        Behaviour::CountThenAnswer => {
            let mut total = 0usize;
            loop {
                let n = s.read(&mut buf).await?;
                if n == 0 {
                    break;
                }
                total += n;
            }
            s.write_all(format!("got {total} bytes\n").as_bytes())
                .await?;
            s.shutdown().await
        }
        Behaviour::Hold => Ok(()),
    }
}

/// A listener that completes no handshake: its accept queue is full and the
/// kernel drops further SYNs, so a connect to it times out — the loopback
/// stand-in for a node that hangs.
pub struct BlackHole {
    _socket: socket2::Socket,
    _fillers: Vec<std::net::TcpStream>,
}

impl BlackHole {
    /// Creates the black hole on `addr`.
    pub fn new(addr: SocketAddr) -> Self {
        use socket2::{Domain, Socket, Type};
        let socket = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
        socket.bind(&addr.into()).expect("bind black hole");
        socket.listen(0).expect("listen");
        // Fill the accept queue (backlog 0 still admits one or two).
        let mut fillers = Vec::new();
        for _ in 0..4 {
            let s = Socket::new(Domain::IPV4, Type::STREAM, None).expect("socket");
            s.set_nonblocking(true).expect("nonblocking");
            let _ = s.connect(&addr.into());
            fillers.push(std::net::TcpStream::from(s));
        }
        // Give the handshakes that will complete time to land in the queue, checked by a probe that must time out.
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            let probe = std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200));
            if probe.is_err() {
                break;
            }
            fillers.push(probe.expect("checked"));
            assert!(
                std::time::Instant::now() < deadline,
                "black hole at {addr} keeps accepting"
            );
        }
        Self {
            _socket: socket,
            _fillers: fillers,
        }
    }
}

/// The daemon running in this process.
pub struct Daemon {
    /// The running server.
    pub server: Option<harvester_lb::Server>,
    /// The admin address.
    pub admin: SocketAddr,
    /// The config file.
    pub config: PathBuf,
    /// The admin Unix socket (state changes are served only there).
    pub socket: PathBuf,
}

impl Daemon {
    /// Writes `config` to the subnet's directory and starts the daemon on it,
    /// without file watching (tests reload explicitly unless they test watching).
    pub async fn start(net: &Subnet, config: impl std::fmt::Display) -> Self {
        Self::start_with(net, config, None).await
    }

    /// As [`Daemon::start`], with a file-watch interval.
    pub async fn start_with(
        net: &Subnet,
        config: impl std::fmt::Display,
        watch: Option<Duration>,
    ) -> Self {
        Self::start_options(net, config, |options| options.watch_interval = watch).await
    }

    /// As [`Daemon::start`], with the TCP listeners accepting on `workers`
    /// (thread per core, in this process: `harvester-lb run --threads`).
    pub async fn start_on(
        net: &Subnet,
        config: impl std::fmt::Display,
        workers: harvester_lb::dataplane::workers::Workers,
    ) -> Self {
        Self::start_options(net, config, |options| options.workers = workers).await
    }

    /// Starts the daemon on `config` with the options `set` changes.
    async fn start_options(
        net: &Subnet,
        config: impl std::fmt::Display,
        set: impl FnOnce(&mut harvester_lb::Options),
    ) -> Self {
        let config = config.to_string();
        let path = net.write("config.toml", &config);
        let mut options = harvester_lb::Options::new(&path);
        options.watch_interval = None;
        set(&mut options);
        // The admin socket in the test's own directory, unless the test's
        // config names one itself: tests run side by side, and none may take
        // /run/harvester-lb/admin.sock.
        if !config.contains("socket =") {
            options.admin_socket = Some(net.dir().join("admin.sock"));
        }
        let server = harvester_lb::start(options)
            .await
            .unwrap_or_else(|e| panic!("daemon start: {e}"));
        let admin = server.admin_addr();
        let socket = server.admin_socket().to_path_buf();
        Self {
            server: Some(server),
            admin,
            config: path,
            socket,
        }
    }

    /// The server.
    pub fn server(&self) -> &harvester_lb::Server {
        self.server.as_ref().expect("running")
    }

    /// GETs an admin path; returns status code and body.
    pub async fn get(&self, path: &str) -> (u16, String) {
        http(self.admin, "GET", path).await
    }

    /// `/status` as JSON.
    pub async fn status(&self) -> serde_json::Value {
        let (code, body) = self.get("/status").await;
        assert_eq!(code, 200, "/status: {body}");
        serde_json::from_str(&body).expect("/status is JSON")
    }

    /// The backend object `ip` of load balancer `lb` in `/status`.
    pub async fn backend_status(&self, lb: &str, ip: &str) -> serde_json::Value {
        let status = self.status().await;
        status["load_balancers"]
            .as_array()
            .expect("load_balancers")
            .iter()
            .find(|l| l["name"] == lb)
            .unwrap_or_else(|| panic!("no load balancer {lb} in /status"))["backends"]
            .as_array()
            .expect("backends")
            .iter()
            .find(|b| b["address"] == ip)
            .unwrap_or_else(|| panic!("no backend {ip} in {lb}"))
            .clone()
    }

    /// Waits until backend `ip` of `lb` reports `health`.
    pub async fn wait_health(
        &self,
        lb: &str,
        ip: &str,
        health: &str,
        timeout: Duration,
    ) -> serde_json::Value {
        wait_for(
            timeout,
            &format!("{lb} backend {ip} to be {health}"),
            || async {
                let b = self.backend_status(lb, ip).await;
                (b["health"] == health).then_some(b)
            },
        )
        .await
    }

    /// The value of the metric sample whose line starts with `prefix`
    /// (name plus labels, as rendered); fails the test if there is none, so
    /// a renamed or missing series cannot pass for a zero.
    #[track_caller]
    pub fn metric(&self, prefix: &str) -> impl Future<Output = f64> + use<> {
        metric_at(self.admin, prefix)
    }

    /// The value of the sample whose line starts with `prefix`, `None` if
    /// /metrics has none: for a series the daemon writes only once it has
    /// happened (an outcome by its `reason`), or one a poll waits for.
    pub async fn metric_sample(&self, prefix: &str) -> Option<f64> {
        let (_, body) = self.get("/metrics").await;
        metric_sample(&body, prefix)
    }

    /// Stops the daemon, draining, and returns how many connections the drain timeout cut.
    pub async fn stop(mut self) -> usize {
        self.server.take().expect("running").shutdown().await
    }
}

/// One HTTP/1.1 request with `Connection: close` and a body over the Unix
/// socket at `socket`; returns status and body.
pub async fn http_unix(
    socket: &std::path::Path,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    let s = tokio::net::UnixStream::connect(socket)
        .await
        .unwrap_or_else(|e| panic!("connect admin socket {}: {e}", socket.display()));
    exchange_with_body(s, "localhost", method, path, body).await
}

/// One HTTP/1.1 request with a body over TCP; returns status and body.
pub async fn http_with_body(
    addr: SocketAddr,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String) {
    let s = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect admin {addr}: {e}"));
    exchange_with_body(s, &addr.to_string(), method, path, body).await
}

/// Sends one request with a JSON body and `Connection: close` on `s`, and
/// reads the answer to its end (within 30 s).
async fn exchange_with_body<S>(
    s: S,
    host: &str,
    method: &str,
    path: &str,
    body: &str,
) -> (u16, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    send_and_read(s, &req).await
}

/// Sends the whole request `req` on `s` and reads the answer to its end
/// (within 30 s): status and body.
async fn send_and_read<S>(mut s: S, req: &str) -> (u16, String)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    s.write_all(req.as_bytes()).await.expect("send request");
    let mut raw = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), s.read_to_end(&mut raw))
        .await
        .expect("admin answers within 30 s")
        .expect("read response");
    split_response(&String::from_utf8_lossy(&raw))
}

/// [`Daemon::metric`] of the daemon whose admin API is `admin` (a daemon
/// run as a [`Process`]).
#[track_caller]
pub fn metric_at(admin: SocketAddr, prefix: &str) -> impl Future<Output = f64> + use<> {
    let caller = std::panic::Location::caller();
    let prefix = prefix.to_string();
    async move {
        let (_, body) = http(admin, "GET", "/metrics").await;
        metric_sample(&body, &prefix).unwrap_or_else(|| absent(caller, &prefix, &body))
    }
}

/// The value of the first sample line starting with `prefix`; fails the
/// test if there is none (a renamed or missing series is not a zero).
#[track_caller]
pub fn metric_value(body: &str, prefix: &str) -> f64 {
    let caller = std::panic::Location::caller();
    metric_sample(body, prefix).unwrap_or_else(|| absent(caller, prefix, body))
}

/// The value of the first sample line starting with `prefix`, `None` if
/// there is none (see [`Daemon::metric_sample`] for when that is expected).
pub fn metric_sample(body: &str, prefix: &str) -> Option<f64> {
    body.lines()
        .filter(|l| !l.starts_with('#'))
        .find(|l| l.starts_with(prefix))
        .and_then(|l| l.rsplit(' ').next())
        .and_then(|v| v.parse().ok())
}

/// Sum of the samples of family `name` whose labels include every
/// `labels` pair, `None` if there is none.
pub fn samples_sum(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let values: Vec<f64> = text
        .lines()
        .filter(|l| !l.starts_with('#'))
        .filter(|l| {
            l.strip_prefix(name)
                .is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' '))
        })
        .filter(|l| {
            labels
                .iter()
                .all(|(k, v)| l.contains(&format!("{k}=\"{v}\"")))
        })
        .filter_map(|l| l.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()))
        .collect();
    (!values.is_empty()).then(|| values.iter().sum())
}

/// How many outcomes of a counter `family` the samples whose labels
/// include every `labels` pair count: the daemon writes such a family (a
/// failure by its `reason`, a transition by its `to`, a repair by its
/// `kind` ...) one sample per outcome from its first count on, so no
/// sample is none yet, 0. Takes the daemon's own [`Family`] (not a name
/// typed here), so a renamed family cannot pass for a zero.
pub fn outcomes(text: &str, family: &'static Family, labels: &[(&str, &str)]) -> f64 {
    assert_eq!(
        family.kind,
        Kind::Counter,
        "{} is not a counter",
        family.name
    );
    samples_sum(text, family.name, labels).unwrap_or(0.0)
}

/// Fails the test for a series `want` that /metrics (`body`) lacks, naming
/// the caller and the family's samples that are there.
pub fn absent(caller: &std::panic::Location<'_>, want: &str, body: &str) -> ! {
    let family = want.split(['{', ' ']).next().unwrap_or(want);
    let near: Vec<&str> = body
        .lines()
        .filter(|l| !l.starts_with('#') && l.starts_with(family))
        .take(10)
        .collect();
    panic!(
        "{caller}: no sample {want} in /metrics (renamed, or never written?); the family's samples: {near:?}"
    )
}

/// One HTTP/1.1 request with `Connection: close`; returns status and body.
pub async fn http(addr: SocketAddr, method: &str, path: &str) -> (u16, String) {
    let s = TcpStream::connect(addr)
        .await
        .unwrap_or_else(|e| panic!("connect admin {addr}: {e}"));
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
    );
    send_and_read(s, &req).await
}

/// Status and body of a whole HTTP/1.1 response; a chunked body (a long
/// `/metrics`) is joined.
pub fn split_response(text: &str) -> (u16, String) {
    let code = text.get(9..12).and_then(|c| c.parse().ok()).unwrap_or(0);
    let (head, body) = text.split_once("\r\n\r\n").unwrap_or((text, ""));
    let chunked = head
        .lines()
        .any(|l| l.eq_ignore_ascii_case("transfer-encoding: chunked"));
    let body = if chunked {
        dechunk(body)
    } else {
        body.to_string()
    };
    (code, body)
}

/// The payload of a `Transfer-Encoding: chunked` body.
fn dechunk(mut body: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = body.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            panic!("bad chunk size line {size:?}");
        };
        if n == 0 {
            break;
        }
        out.push_str(&rest[..n]);
        body = rest[n..].strip_prefix("\r\n").expect("CRLF after a chunk");
    }
    out
}

/// Connects to `vip` from the local address `from` (any port).
pub async fn connect_from(from: IpAddr, vip: SocketAddr) -> std::io::Result<TcpStream> {
    let socket = if from.is_ipv6() {
        TcpSocket::new_v6()?
    } else {
        TcpSocket::new_v4()?
    };
    socket.bind(SocketAddr::new(from, 0))?;
    socket.connect(vip).await
}

/// A port free on `::1` now. `::1` is a single address, so IPv6 tests
/// cannot claim a subnet of their own: they take free ports from the kernel.
pub fn free_port_v6() -> u16 {
    std::net::TcpListener::bind("[::1]:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port on ::1")
}

/// Opens a connection through the load balancer and reads the backend's
/// name line (for `NameThenEcho` backends).
pub async fn whoami(vip: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect(vip).await?;
    read_line(&mut s).await
}

/// Reads one line (without the newline) within 5 s.
pub async fn read_line(s: &mut TcpStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    tokio::time::timeout(Duration::from_secs(5), async {
        loop {
            let n = s.read(&mut byte).await?;
            if n == 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed before a full line",
                ));
            }
            if byte[0] == b'\n' {
                return Ok(());
            }
            line.push(byte[0]);
        }
    })
    .await
    .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no line within 5 s"))??;
    Ok(String::from_utf8_lossy(&line).to_string())
}

/// Whether `s` still forwards: one round trip through an echoing backend.
pub async fn still_echoes(s: &mut TcpStream) -> bool {
    if s.write_all(b"ping\n").await.is_err() {
        return false;
    }
    matches!(read_line(s).await, Ok(l) if l == "ping")
}

/// Runs the `harvester-lb` binary with `args`; returns exit code, stdout, stderr.
pub fn run_cli(args: &[&str]) -> (i32, String, String) {
    outcome(
        &std::process::Command::new(env!("CARGO_BIN_EXE_harvester-lb"))
            .args(args)
            .output()
            .expect("run harvester-lb"),
    )
}

/// A finished process's exit code (-1 for a signal), stdout and stderr.
pub fn outcome(out: &std::process::Output) -> (i32, String, String) {
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// Whether a checker (`promtool check`, `keepalived --config-test`)
/// accepted its input: it succeeded and said nothing; else what it said.
pub fn quiet_success(out: &std::process::Output) -> Result<(), String> {
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    if out.status.success() && said.trim().is_empty() {
        Ok(())
    } else {
        Err(said)
    }
}

/// A UDP echo backend at `addr`: answers every datagram with the datagram
/// itself, until the handle is aborted or the runtime ends.
pub async fn udp_echo(addr: SocketAddr) -> JoinHandle<()> {
    let socket = tokio::net::UdpSocket::bind(addr)
        .await
        .unwrap_or_else(|e| panic!("bind the UDP echo backend {addr}: {e}"));
    tokio::spawn(async move {
        let mut buf = vec![0u8; 65_536];
        loop {
            if let Ok((n, from)) = socket.recv_from(&mut buf).await {
                let _ = socket.send_to(&buf[..n], from).await;
            }
        }
    })
}

/// [`run_cli`] from async code: on a blocking thread, so the daemon the
/// command talks to keeps running on the test's runtime.
pub async fn cli(args: Vec<String>) -> (i32, String, String) {
    tokio::task::spawn_blocking(move || {
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        run_cli(&args)
    })
    .await
    .expect("CLI thread")
}

/// A blocking HTTP GET for use from non-async code; returns status and body.
pub fn http_blocking(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))?;
    s.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(
        s,
        "GET {path} HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n"
    )?;
    let mut text = String::new();
    s.read_to_string(&mut text)?;
    Ok(split_response(&text))
}

/// The one small deterministic generator of the tests (xorshift64): a
/// property test's failure names its seed and a rerun repeats it, and both
/// ends of a byte stream can check every byte without storing it.
pub struct Rng(u64);

impl Rng {
    /// The generator of `seed` (0, which xorshift never leaves, counts as 1).
    pub fn new(seed: u64) -> Self {
        Self(seed.max(1))
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }

    /// A number in `0..n`.
    pub fn below(&mut self, n: usize) -> usize {
        (self.next_u64() % n as u64) as usize
    }

    /// Fills `buf` with the next bytes, eight (one number) at a time, so a
    /// stream filled in whole 8-byte words is the same however it is cut.
    pub fn fill(&mut self, buf: &mut [u8]) {
        for chunk in buf.chunks_mut(8) {
            let bytes = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&bytes[..chunk.len()]);
        }
    }
}

/// Asserts that `promtool check metrics` reports nothing on `body`: promtool
/// is the arbiter of the exposition format. CI installs it and must have it;
/// elsewhere a missing promtool skips the check, saying so.
pub fn promtool_accepts(body: &str) {
    use std::io::Write;
    if cannot_run("promtool check", [missing_tool("promtool", "prometheus")]) {
        return;
    }
    let mut child = std::process::Command::new("promtool")
        .args(["check", "metrics"])
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("run promtool");
    child
        .stdin
        .take()
        .expect("promtool stdin")
        .write_all(body.as_bytes())
        .expect("write to promtool");
    let out = child.wait_with_output().expect("promtool ends");
    if let Err(said) = quiet_success(&out) {
        panic!("promtool check metrics complained:\n{said}");
    }
}

/// Waits until `/readyz` on `admin` answers 200.
pub async fn wait_ready(admin: SocketAddr) {
    wait_for(
        Duration::from_secs(20),
        "the daemon to be ready",
        || async move {
            tokio::task::spawn_blocking(move || http_blocking(admin, "/readyz"))
                .await
                .unwrap()
                .ok()
                .filter(|(c, _)| *c == 200)
                .map(|_| ())
        },
    )
    .await;
}

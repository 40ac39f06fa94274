//! Small helpers every scenario uses: signals to our own children, waiting
//! for a port or an HTTP answer under a deadline, one-shot HTTP GETs, the
//! bench's listening sockets, and running a command with a time limit.
//!
//! Nothing here keeps state or starts anything that outlives the call,
//! except [`run_with_timeout`]'s command, which it waits for or kills.

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

#[allow(unsafe_code)]
pub fn signal(pid: i32, sig: i32) {
    // SAFETY: kill(2) on a pid of a child we started and have not reaped.
    unsafe {
        libc::kill(pid, sig);
    }
}

pub fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

pub fn wait_port(addr: SocketAddr, what: &str) {
    if !try_wait_port(addr, Duration::from_secs(20)) {
        panic!("{what} is not listening on {addr} after 20 s");
    }
}

/// Whether `addr` accepts a connection within `limit`.
pub fn try_wait_port(addr: SocketAddr, limit: Duration) -> bool {
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
pub fn bench_listener(addr: SocketAddr) -> std::net::TcpListener {
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

pub fn which(cmd: &str) -> bool {
    Command::new("sh")
        .args(["-c", &format!("command -v {cmd}")])
        .stdout(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

/// The trimmed standard output of `sh -c cmd` (empty if it cannot run).
pub fn sh(cmd: &str) -> String {
    Command::new("sh")
        .args(["-c", cmd])
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .unwrap_or_default()
}

/// GETs `path` on `addr` until it answers 200.
pub fn wait_http_ok(addr: SocketAddr, path: &str, limit: Duration) {
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

pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<String> {
    http_get_within(addr, path, Duration::from_secs(5))
}

/// [`http_get`] waiting up to `limit` for each read: a scrape at scale is
/// rendered whole before its first byte leaves.
pub fn http_get_within(addr: SocketAddr, path: &str, limit: Duration) -> std::io::Result<String> {
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

/// The body of a 200 answer to [`http_get`], de-chunked (HAProxy's exporter
/// sends chunks, harvester-lb a length); None for any other answer.
pub fn http_body(resp: &str) -> Option<String> {
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

/// Runs `cmd` to its end or for `limit` at most (then SIGKILL); its
/// standard output, with a line `FAILED` appended when it exited non-zero.
/// None: it could not start.
pub fn run_with_timeout(cmd: &mut Command, limit: Duration) -> Option<String> {
    let child = cmd
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .ok()?;
    let pid = child.id() as i32;
    // A load generator is stopped on SIGINT/SIGTERM like the proxies.
    crate::host::track_child(pid);
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
    crate::host::forget_child(pid);
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

//! The peers of the load balancer on the bed: node services (health port and
//! nodeport) and clients. All run in the test's runtime on sockets made inside
//! the right namespace.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::{AbortHandle, JoinHandle};

use super::{Bed, HEALTH_PORT, NODEPORT, Ns, node_ip, sa};
use crate::support::Rng;

/// What a node's nodeport does with each connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Service {
    /// Writes `n<i>\n`, then echoes until EOF, then shuts down its write side.
    NameThenEcho,
    /// Accepts, then resets the connection at once (`SO_LINGER` 0 close).
    ResetOnAccept,
    /// Writes without end as fast as the peer takes it; counts bytes written.
    Source,
    /// Reads the integrity protocol (see the integrity test).
    Integrity,
}

/// The services of one node.
pub struct Node {
    /// 1-based index.
    pub index: usize,
    /// Nodeport connections accepted.
    pub accepted: Arc<AtomicUsize>,
    /// Bytes written by a [`Service::Source`] nodeport.
    pub written: Arc<AtomicU64>,
    /// Integrity checks that failed on the node's side.
    pub mismatches: Arc<AtomicUsize>,
    /// Integrity checks that passed on the node's side.
    pub verified: Arc<AtomicUsize>,
    ns: Ns,
    health: Option<JoinHandle<()>>,
    nodeport: Option<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Node {
    /// Starts node `i`'s health listener and its nodeport service.
    pub fn start(bed: &Bed, i: usize, service: Service) -> Node {
        let mut n = Node {
            index: i,
            accepted: Arc::default(),
            written: Arc::default(),
            mismatches: Arc::default(),
            verified: Arc::default(),
            ns: bed.node(i).clone(),
            health: None,
            nodeport: None,
            conns: Arc::default(),
        };
        n.start_health();
        n.start_nodeport(service);
        n
    }

    /// (Re)starts the health listener: accepts and closes.
    pub fn start_health(&mut self) {
        let l = self.ns.listen(sa(node_ip(self.index), HEALTH_PORT));
        self.health = Some(tokio::spawn(async move {
            loop {
                if let Ok((s, _)) = l.accept().await {
                    drop(s);
                }
            }
        }));
    }

    /// Stops the health listener (probes are refused).
    pub fn stop_health(&mut self) {
        if let Some(h) = self.health.take() {
            h.abort();
        }
    }

    /// (Re)starts the nodeport service.
    pub fn start_nodeport(&mut self, service: Service) {
        let l = self.ns.listen(sa(node_ip(self.index), NODEPORT));
        let name = format!("n{}\n", self.index);
        let accepted = Arc::clone(&self.accepted);
        let written = Arc::clone(&self.written);
        let mismatches = Arc::clone(&self.mismatches);
        let verified = Arc::clone(&self.verified);
        let conns = Arc::clone(&self.conns);
        self.nodeport = Some(tokio::spawn(async move {
            loop {
                let Ok((s, _)) = l.accept().await else {
                    continue;
                };
                accepted.fetch_add(1, Ordering::Relaxed);
                let name = name.clone();
                let written = Arc::clone(&written);
                let mismatches = Arc::clone(&mismatches);
                let verified = Arc::clone(&verified);
                let h = tokio::spawn(async move {
                    let _ = match service {
                        Service::NameThenEcho => name_then_echo(s, &name).await,
                        Service::ResetOnAccept => {
                            let _ = socket2::SockRef::from(&s).set_linger(Some(Duration::ZERO));
                            drop(s);
                            Ok(())
                        }
                        Service::Source => source(s, &written).await,
                        Service::Integrity => {
                            match integrity_node_side(s).await {
                                Ok(true) => verified.fetch_add(1, Ordering::Relaxed),
                                _ => mismatches.fetch_add(1, Ordering::Relaxed),
                            };
                            Ok(())
                        }
                    };
                });
                let mut c = conns.lock().unwrap();
                c.retain(|h| !h.is_finished());
                c.push(h.abort_handle());
            }
        }));
    }

    /// Stops the nodeport service and drops every open connection at once, as
    /// the kernel does when the process holding them dies.
    pub fn kill_nodeport(&mut self) {
        if let Some(h) = self.nodeport.take() {
            h.abort();
        }
        for c in self.conns.lock().unwrap().drain(..) {
            c.abort();
        }
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.stop_health();
        self.kill_nodeport();
    }
}

/// A name-then-echo service on `addr` in `ns` that is no node of the bed
/// (a backend VM of a second network): writes `name` and a newline, then
/// echoes, as [`Service::NameThenEcho`] does; stops when the handle is
/// aborted or dropped with the runtime.
pub fn serve_name_then_echo(ns: &Ns, addr: SocketAddr, name: &str) -> JoinHandle<()> {
    let l = ns.listen(addr);
    let name = format!("{name}\n");
    tokio::spawn(async move {
        loop {
            let Ok((s, _)) = l.accept().await else {
                continue;
            };
            let name = name.clone();
            tokio::spawn(async move { name_then_echo(s, &name).await });
        }
    })
}

async fn name_then_echo(mut s: TcpStream, name: &str) -> std::io::Result<()> {
    s.write_all(name.as_bytes()).await?;
    let (mut r, mut w) = s.split();
    tokio::io::copy(&mut r, &mut w).await?;
    w.shutdown().await
}

async fn source(mut s: TcpStream, written: &AtomicU64) -> std::io::Result<()> {
    let chunk = vec![0x5au8; 16 * 1024];
    loop {
        let n = s.write(&chunk).await?;
        written.fetch_add(n as u64, Ordering::Relaxed);
    }
}

/// Outcome of one client exchange.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Exchange {
    /// Served by node `n<i>`, the echo was intact.
    Ok(String),
    /// Failed (refused, reset, timeout, wrong echo...).
    Failed(String),
}

/// One short client exchange through `vip`: connect, read the node's name,
/// send `len` bytes, half-close, and check the echo. `deadline` bounds it all.
pub async fn exchange(client: &Ns, vip: SocketAddr, len: usize, deadline: Duration) -> Exchange {
    // The node that answered, once known: a failure after that point is a
    // connection cut while it was open, which no connect retry can rescue.
    let mut served_by = None;
    let f = async {
        let mut s = client.connect(vip, deadline).await?;
        let name = read_line(&mut s).await?;
        served_by = Some(name.clone());
        let payload: Vec<u8> = (0..len).map(|i| (i * 7 + len) as u8).collect();
        let (mut r, mut w) = s.split();
        let send = async {
            w.write_all(&payload).await?;
            w.shutdown().await
        };
        let mut back = Vec::with_capacity(len);
        let recv = r.read_to_end(&mut back);
        let (a, b) = tokio::join!(send, recv);
        a?;
        b?;
        if back != payload {
            return Err(std::io::Error::other(format!(
                "echo mismatch: sent {} bytes, got {}",
                payload.len(),
                back.len()
            )));
        }
        Ok::<_, std::io::Error>(name)
    };
    let outcome = tokio::time::timeout(deadline, f).await;
    let failed = |e: String| match &served_by {
        Some(node) => Exchange::Failed(format!("{CUT_ON}{node}: {e}")),
        None => Exchange::Failed(e),
    };
    match outcome {
        Ok(Ok(name)) => Exchange::Ok(name),
        Ok(Err(e)) => failed(e.to_string()),
        Err(_) => failed(format!("exchange timed out after {deadline:?}")),
    }
}

/// How the error of an exchange that failed after a node had answered
/// begins: `"cut on n2: ..."`.
pub const CUT_ON: &str = "cut on ";

/// Reads one `\n`-terminated line, byte by byte (so nothing after it is consumed).
pub async fn read_line(s: &mut TcpStream) -> std::io::Result<String> {
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        let n = s.read(&mut b).await?;
        if n == 0 {
            return Err(std::io::Error::new(
                std::io::ErrorKind::UnexpectedEof,
                format!(
                    "closed before a line (got {:?})",
                    String::from_utf8_lossy(&line)
                ),
            ));
        }
        if b[0] == b'\n' {
            return Ok(String::from_utf8_lossy(&line).into_owned());
        }
        line.push(b[0]);
        if line.len() > 256 {
            return Err(std::io::Error::other("line too long"));
        }
    }
}

/// Counts of a client load run.
#[derive(Debug, Default, Clone)]
pub struct Tally {
    /// Exchanges that succeeded, by node name.
    pub ok: std::collections::BTreeMap<String, usize>,
    /// Failed exchanges with their error.
    pub failed: Vec<String>,
    /// The slowest exchange.
    pub slowest: Duration,
}

impl Tally {
    /// Successful exchanges.
    pub fn ok_total(&self) -> usize {
        self.ok.values().sum()
    }

    /// Failed exchanges that were cut after node `name` had answered (the
    /// connection to it was open when the fault began).
    pub fn cut_on(&self, name: &str) -> usize {
        let prefix = format!("{CUT_ON}{name}:");
        self.failed
            .iter()
            .filter(|e| e.starts_with(&prefix))
            .count()
    }

    /// Failed exchanges that never reached a node: the ones the load
    /// balancer's connect retry is responsible for.
    pub fn failed_before_a_node(&self) -> Vec<&String> {
        self.failed
            .iter()
            .filter(|e| !e.starts_with(CUT_ON))
            .collect()
    }

    /// Records one exchange.
    pub fn add(&mut self, e: Exchange) {
        match e {
            Exchange::Ok(n) => *self.ok.entry(n).or_default() += 1,
            Exchange::Failed(e) => self.failed.push(e),
        }
    }
}

/// Runs exchanges from `workers` parallel clients back to back until `stop`
/// is set or `max` exchanges were made; returns the tally.
pub fn load(
    client: &Ns,
    vip: SocketAddr,
    workers: usize,
    max: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
) -> JoinHandle<Tally> {
    load_with(client, vip, workers, max, stop, Duration::from_secs(10))
}

/// As [`load`], with each exchange bounded by `deadline`.
pub fn load_with(
    client: &Ns,
    vip: SocketAddr,
    workers: usize,
    max: usize,
    stop: Arc<std::sync::atomic::AtomicBool>,
    deadline: Duration,
) -> JoinHandle<Tally> {
    let client = client.clone();
    tokio::spawn(async move {
        let tally = Arc::new(Mutex::new(Tally::default()));
        let count = Arc::new(AtomicUsize::new(0));
        let mut set = tokio::task::JoinSet::new();
        for _ in 0..workers {
            let (client, tally, count, stop) = (
                client.clone(),
                Arc::clone(&tally),
                Arc::clone(&count),
                Arc::clone(&stop),
            );
            set.spawn(async move {
                while !stop.load(Ordering::Relaxed) && count.fetch_add(1, Ordering::Relaxed) < max {
                    let started = Instant::now();
                    let e = exchange(&client, vip, 512, deadline).await;
                    {
                        let mut t = tally.lock().unwrap();
                        t.slowest = t.slowest.max(started.elapsed());
                        t.add(e);
                    }
                    // Pace a little so a run is many exchanges spread in time.
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
            });
        }
        while set.join_next().await.is_some() {}
        tally.lock().unwrap().clone()
    })
}

/// Measures how long a client waits before the load balancer closes a fresh
/// connection (reset or EOF) without data; `Err` if it gets data or waits
/// longer than `limit`.
pub async fn time_to_refusal(
    client: &Ns,
    vip: SocketAddr,
    limit: Duration,
) -> Result<Duration, String> {
    let start = Instant::now();
    let mut s = match client.connect(vip, limit).await {
        Ok(s) => s,
        Err(e) if e.kind() == std::io::ErrorKind::TimedOut => return Err(e.to_string()),
        Err(_) => return Ok(start.elapsed()),
    };
    let mut b = [0u8; 16];
    match tokio::time::timeout(limit, s.read(&mut b)).await {
        Ok(Ok(0)) | Ok(Err(_)) => Ok(start.elapsed()),
        Ok(Ok(n)) => Err(format!("got {n} bytes: the connection was served")),
        Err(_) => Err(format!("still open after {limit:?}")),
    }
}

/// Accepts and discards; for tests that need a listener but no service.
pub async fn accept_forever(l: TcpListener) {
    loop {
        let _ = l.accept().await;
    }
}

/// FNV-1a, 64 bits.
#[derive(Clone, Copy)]
pub struct Fnv(u64);

impl Default for Fnv {
    fn default() -> Self {
        Fnv(0xcbf2_9ce4_8422_2325)
    }
}

impl Fnv {
    /// Adds bytes.
    pub fn update(&mut self, b: &[u8]) {
        for x in b {
            self.0 ^= u64::from(*x);
            self.0 = self.0.wrapping_mul(0x0100_0000_01b3);
        }
    }

    /// The hash so far.
    pub fn value(&self) -> u64 {
        self.0
    }
}

/// The `len` bytes of stream `seed`, in pieces of 64 KiB: the same bytes
/// however they are cut.
struct Stream {
    rng: Rng,
    buf: Vec<u8>,
    left: usize,
}

impl Stream {
    fn new(seed: u64, len: usize) -> Self {
        Stream {
            rng: Rng::new(seed),
            buf: vec![0u8; 64 * 1024],
            left: len,
        }
    }

    /// The next piece, or `None` at the end.
    fn next_piece(&mut self) -> Option<&[u8]> {
        if self.left == 0 {
            return None;
        }
        let n = self.left.min(self.buf.len());
        // Fill whole 8-byte words so the stream is the same however it is cut.
        let fill = n.next_multiple_of(8).min(self.buf.len());
        self.rng.fill(&mut self.buf[..fill]);
        self.left -= n;
        Some(&self.buf[..n])
    }
}

/// Hash of the `len` bytes of stream `seed`.
pub fn stream_hash(seed: u64, len: usize) -> u64 {
    let mut stream = Stream::new(seed, len);
    let mut h = Fnv::default();
    while let Some(piece) = stream.next_piece() {
        h.update(piece);
    }
    h.value()
}

/// Sends `len` bytes of stream `seed` in 64 KiB pieces.
pub async fn send_stream<W: AsyncWriteExt + Unpin>(
    w: &mut W,
    seed: u64,
    len: usize,
) -> std::io::Result<()> {
    let mut stream = Stream::new(seed, len);
    while let Some(piece) = stream.next_piece() {
        w.write_all(piece).await?;
    }
    Ok(())
}

/// Reads to EOF; returns (bytes, hash).
pub async fn hash_to_eof<R: AsyncReadExt + Unpin>(r: &mut R) -> std::io::Result<(usize, u64)> {
    let mut h = Fnv::default();
    let mut buf = vec![0u8; 64 * 1024];
    let mut total = 0;
    loop {
        let n = r.read(&mut buf).await?;
        if n == 0 {
            return Ok((total, h.value()));
        }
        h.update(&buf[..n]);
        total += n;
    }
}

/// The integrity protocol's lengths for `seed`: (client to node, node to client).
pub fn integrity_lengths(seed: u64) -> (usize, usize) {
    let a = 64 * 1024 + (seed.wrapping_mul(0x9E37_79B9) % (448 * 1024)) as usize;
    let b = 64 * 1024 + (seed.wrapping_mul(0x85EB_CA6B) % (448 * 1024)) as usize;
    (a, b)
}

/// The node's side: reads an 8-byte seed, then at the same time hashes what
/// the client sends until its half-close and sends its own stream followed by
/// a half-close. `Ok(true)` when the client's bytes were exactly right.
pub async fn integrity_node_side(mut s: TcpStream) -> std::io::Result<bool> {
    let mut seed = [0u8; 8];
    s.read_exact(&mut seed).await?;
    let seed = u64::from_le_bytes(seed);
    let (up, down) = integrity_lengths(seed);
    let (mut r, mut w) = s.split();
    let send = async {
        send_stream(&mut w, seed ^ 0xD0D0, down).await?;
        w.shutdown().await
    };
    let (sent, got) = tokio::join!(send, hash_to_eof(&mut r));
    sent?;
    let (n, h) = got?;
    Ok(n == up && h == stream_hash(seed, up))
}

/// The client's side for `seed`; `Ok(())` when the node's bytes were exactly right.
pub async fn integrity_client_side(mut s: TcpStream, seed: u64) -> Result<(), String> {
    let (up, down) = integrity_lengths(seed);
    s.write_all(&seed.to_le_bytes())
        .await
        .map_err(|e| format!("send seed: {e}"))?;
    let (mut r, mut w) = s.split();
    let send = async {
        send_stream(&mut w, seed, up).await?;
        w.shutdown().await
    };
    let (sent, got) = tokio::join!(send, hash_to_eof(&mut r));
    sent.map_err(|e| format!("send: {e}"))?;
    let (n, h) = got.map_err(|e| format!("receive: {e}"))?;
    if n != down {
        return Err(format!("received {n} bytes, expected {down}"));
    }
    if h != stream_hash(seed ^ 0xD0D0, down) {
        return Err(format!("hash mismatch over {n} bytes"));
    }
    Ok(())
}

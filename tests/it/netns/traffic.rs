//! A client's long-lived traffic through VIPs while they move between
//! hosts, and what it saw: the one measure of "open connections kept"
//! shared by the beds of `tests/it/conntrack_sync.rs`, `conntrack_sync_v6.rs`
//! and `conntrack_hosts.rs`.
//!
//! Per VIP ([`Target`]): [`CONNS`] TCP connections, each echoing a line
//! every [`TICK`] (the backend greets with its name first), and [`FLOWS`]
//! UDP flows from fixed client ports, one datagram every [`TICK`], each
//! answered by the backend with its name as the first word. Counted per
//! connection and flow: lines or datagrams sent and answered, the longest
//! gap between answers, why a connection ended, the backends that answered
//! a flow in turn. Runs until [`Traffic::finish`]; every wait is bounded.

use std::net::{IpAddr, SocketAddr};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};

use super::Ns;

/// Long-lived TCP connections per VIP.
pub const CONNS: usize = 20;
/// UDP flows per VIP.
pub const FLOWS: usize = 4;
/// One line or datagram per connection or flow this often.
pub const TICK: Duration = Duration::from_millis(100);
/// The first client UDP port; the flows of VIP `v` use the next
/// `FLOWS` ports from `FIRST_UDP_PORT + v * FLOWS`.
const FIRST_UDP_PORT: u16 = 40_001;

/// One VIP's traffic.
pub struct Target {
    /// Where the TCP connections go.
    pub tcp: SocketAddr,
    /// Where the UDP flows go.
    pub udp: SocketAddr,
    /// The client's own address, the UDP flows' fixed source.
    pub client: IpAddr,
    /// What every backend's greeting starts with (which VIP's backends
    /// answer, where several VIPs have their own).
    pub greeting: String,
}

/// What one TCP connection or UDP flow saw.
#[derive(Default)]
pub struct Stats {
    /// Its target's index.
    target: usize,
    sent: AtomicU64,
    answered: AtomicU64,
    /// Milliseconds since the traffic started, at the last answer.
    last_ms: AtomicU64,
    max_gap_ms: AtomicU64,
    /// The backends that answered a UDP flow, in turn.
    backends: Mutex<Vec<String>>,
    /// Why a TCP connection ended, if it did.
    failed: Mutex<Option<String>>,
}

impl Stats {
    fn answer(&self, now: u64) {
        self.answered.fetch_add(1, Ordering::Relaxed);
        let gap = now.saturating_sub(self.last_ms.swap(now, Ordering::Relaxed));
        self.max_gap_ms.fetch_max(gap, Ordering::Relaxed);
    }

    fn fail(&self, why: String) {
        self.failed.lock().unwrap().get_or_insert(why);
    }

    fn alive(&self) -> bool {
        self.failed.lock().unwrap().is_none()
    }

    fn unanswered(&self) -> u64 {
        self.sent
            .load(Ordering::Relaxed)
            .saturating_sub(self.answered.load(Ordering::Relaxed))
    }
}

/// The client's traffic to every target, running until [`Traffic::finish`].
pub struct Traffic {
    start: Instant,
    stop: Arc<AtomicBool>,
    conns: Vec<Arc<Stats>>,
    flows: Vec<Arc<Stats>>,
    tasks: Vec<tokio::task::JoinHandle<()>>,
}

fn ms_since(start: Instant) -> u64 {
    start.elapsed().as_millis() as u64
}

impl Traffic {
    /// Opens every target's connections (each greeted by a backend within
    /// 5 s) and flows from `client`, and starts them.
    pub async fn start(client: &Ns, targets: &[Target]) -> Traffic {
        let mut t = Traffic {
            start: Instant::now(),
            stop: Arc::new(AtomicBool::new(false)),
            conns: Vec::new(),
            flows: Vec::new(),
            tasks: Vec::new(),
        };
        for (v, target) in targets.iter().enumerate() {
            for _ in 0..CONNS {
                t.connection(client, v, target).await;
            }
            for f in 0..FLOWS {
                let port = FIRST_UDP_PORT + (v * FLOWS + f) as u16;
                t.flow(client, v, target, port, f);
            }
        }
        t
    }

    /// Milliseconds since the traffic started.
    pub fn now_ms(&self) -> u64 {
        ms_since(self.start)
    }

    fn stats(&self, target: usize) -> Arc<Stats> {
        let st = Arc::new(Stats {
            target,
            ..Stats::default()
        });
        st.last_ms.store(self.now_ms(), Ordering::Relaxed);
        st
    }

    async fn connection(&mut self, client: &Ns, v: usize, target: &Target) {
        let s = client
            .connect(target.tcp, Duration::from_secs(5))
            .await
            .unwrap_or_else(|e| panic!("connect through {}: {e}", target.tcp));
        let (r, mut w) = s.into_split();
        let mut r = BufReader::new(r);
        let mut name = String::new();
        tokio::time::timeout(Duration::from_secs(5), r.read_line(&mut name))
            .await
            .expect("the backend's name within 5 s")
            .expect("read the backend's name");
        assert!(
            name.starts_with(&target.greeting),
            "{}: {name:?}",
            target.tcp
        );
        let st = self.stats(v);
        self.conns.push(Arc::clone(&st));
        let (wst, stop) = (Arc::clone(&st), Arc::clone(&self.stop));
        self.tasks.push(tokio::spawn(async move {
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                if let Err(e) = w.write_all(format!("{seq}\n").as_bytes()).await {
                    return wst.fail(format!("write: {e}"));
                }
                wst.sent.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(TICK).await;
            }
        }));
        let start = self.start;
        self.tasks.push(tokio::spawn(async move {
            let mut line = String::new();
            loop {
                line.clear();
                match r.read_line(&mut line).await {
                    Ok(0) => return st.fail("closed by the peer".into()),
                    Ok(_) => st.answer(ms_since(start)),
                    Err(e) => return st.fail(format!("read: {e}")),
                }
            }
        }));
    }

    fn flow(&mut self, client: &Ns, v: usize, target: &Target, port: u16, f: usize) {
        let (local, to) = (SocketAddr::new(target.client, port), target.udp);
        let std = super::in_ns(&client.name, move || {
            let s = std::net::UdpSocket::bind(local)?;
            s.connect(to)?;
            s.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(s)
        })
        .expect("bind a client UDP port");
        let s = Arc::new(tokio::net::UdpSocket::from_std(std).expect("register"));
        let st = self.stats(v);
        self.flows.push(Arc::clone(&st));
        let (wst, stop, tx) = (Arc::clone(&st), Arc::clone(&self.stop), Arc::clone(&s));
        self.tasks.push(tokio::spawn(async move {
            let mut seq = 0u64;
            while !stop.load(Ordering::Relaxed) {
                seq += 1;
                // A refused send (ICMP from a host without the VIP) is a
                // lost datagram, counted by its missing answer.
                let _ = tx.send(format!("{f} {seq}").as_bytes()).await;
                wst.sent.fetch_add(1, Ordering::Relaxed);
                tokio::time::sleep(TICK).await;
            }
        }));
        let start = self.start;
        self.tasks.push(tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                let Ok(n) = s.recv(&mut buf).await else {
                    continue;
                };
                let text = String::from_utf8_lossy(&buf[..n]);
                let Some(name) = text.split_whitespace().next() else {
                    continue;
                };
                st.answer(ms_since(start));
                let mut b = st.backends.lock().unwrap();
                if b.last().map(String::as_str) != Some(name) {
                    b.push(name.to_string());
                }
            }
        }));
    }

    /// Starts a phase (a failover or a failback): resets the gaps and the
    /// flows' backend history to the last backend; returns its start
    /// ([`Traffic::now_ms`]).
    pub fn new_phase(&self) -> u64 {
        let now = self.now_ms();
        for s in self.conns.iter().chain(&self.flows) {
            s.max_gap_ms.store(0, Ordering::Relaxed);
            s.last_ms.store(now, Ordering::Relaxed);
            let mut b = s.backends.lock().unwrap();
            let last = b.last().cloned();
            b.clear();
            b.extend(last);
        }
        now
    }

    /// TCP connections still open.
    pub fn alive(&self) -> usize {
        self.conns.iter().filter(|c| c.alive()).count()
    }

    /// Waits (bounded by `within`) until every connection was answered
    /// after `since_ms` or failed, and every flow was answered after it.
    pub async fn settled(&self, since_ms: u64, within: Duration) {
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            let after = |s: &Arc<Stats>| s.last_ms.load(Ordering::Relaxed) > since_ms;
            if self.conns.iter().all(|c| !c.alive() || after(c)) && self.flows.iter().all(after) {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// The phase's figures; the gaps are those of target `moved`'s live
    /// connections and flows (with one target: all).
    pub fn figures(&self, moved: usize) -> Figures {
        let of_moved = |s: &&Arc<Stats>| s.target == moved && s.alive();
        let gap = |v: &[Arc<Stats>]| {
            v.iter()
                .filter(of_moved)
                .map(|s| s.max_gap_ms.load(Ordering::Relaxed))
                .max()
                .unwrap_or(0)
        };
        let mut reasons: Vec<String> = self
            .conns
            .iter()
            .filter_map(|c| c.failed.lock().unwrap().clone())
            .collect();
        reasons.sort();
        reasons.dedup();
        Figures {
            alive: self.alive(),
            total: self.conns.len(),
            moved_alive: self.conns.iter().filter(of_moved).count(),
            alive_per_target: (0..self.conns.len().div_ceil(CONNS))
                .map(|t| {
                    self.conns
                        .iter()
                        .filter(|s| s.target == t && s.alive())
                        .count()
                })
                .collect(),
            reasons,
            max_gap_ms: gap(&self.conns),
            udp_moved: self
                .flows
                .iter()
                .filter(|f| f.backends.lock().unwrap().len() > 1)
                .count(),
            flows: self.flows.len(),
            udp_gap_ms: gap(&self.flows),
        }
    }

    /// Stops the writers, waits (bounded) for the last echoes; the lines
    /// (of connections still open) and datagrams never answered.
    pub async fn finish(self) -> (u64, u64) {
        self.stop.store(true, Ordering::Relaxed);
        let deadline = Instant::now() + Duration::from_secs(10);
        while Instant::now() < deadline
            && self.conns.iter().any(|c| c.alive() && c.unanswered() > 0)
        {
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        tokio::time::sleep(Duration::from_millis(500)).await;
        let lines = self
            .conns
            .iter()
            .filter(|c| c.alive())
            .map(|c| c.unanswered())
            .sum();
        let datagrams = self.flows.iter().map(|f| f.unanswered()).sum();
        for t in &self.tasks {
            t.abort();
        }
        (lines, datagrams)
    }
}

/// One phase (a failover or a failback) as the client saw it.
pub struct Figures {
    /// TCP connections open, of `total`.
    pub alive: usize,
    pub total: usize,
    /// The moved target's connections open (of [`CONNS`]).
    pub moved_alive: usize,
    /// Each target's connections open, in the targets' order (which
    /// VIP's connections a fault ended).
    pub alive_per_target: Vec<usize>,
    /// Why connections ended (sorted, once each).
    pub reasons: Vec<String>,
    /// The moved target's longest gap between echoes.
    pub max_gap_ms: u64,
    /// UDP flows (of `flows`, every target's) answered by another backend.
    pub udp_moved: usize,
    pub flows: usize,
    /// The moved target's longest gap between UDP answers.
    pub udp_gap_ms: u64,
}

impl std::fmt::Display for Figures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TCP {}/{} alive", self.alive, self.total)?;
        if self.total > CONNS {
            write!(
                f,
                " (the moved VIP's {}/{CONNS}; per VIP {:?})",
                self.moved_alive, self.alive_per_target
            )?;
        }
        write!(
            f,
            ", longest gap {:.2} s; UDP {} of {} flows changed backend, longest gap {:.2} s; ended: {:?}",
            self.max_gap_ms as f64 / 1000.0,
            self.udp_moved,
            self.flows,
            self.udp_gap_ms as f64 / 1000.0,
            self.reasons,
        )
    }
}

/// Asserts that a move (`over`) and its failback (`back`) kept every
/// connection, each UDP flow on its backend, and lost no line; `report`
/// goes with a failure.
pub fn assert_kept(over: &Figures, back: Option<&Figures>, lines: u64, report: &str) {
    assert_eq!(over.alive, over.total, "failover: {report}");
    assert_eq!(over.udp_moved, 0, "a UDP flow changed backend: {report}");
    let back = back.expect("failback ran");
    assert_eq!(back.alive, back.total, "failback: {report}");
    assert_eq!(
        back.udp_moved, 0,
        "a UDP flow changed backend at failback: {report}"
    );
    assert_eq!(lines, 0, "lines lost: {report}");
}

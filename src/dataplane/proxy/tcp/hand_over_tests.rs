//! Hand-over of open connections between two listeners of one process, on
//! loopback sockets: what the first pauses and hands over, the second
//! adopts and serves on, as a restarted daemon does with the sockets it
//! gets back from systemd's store.

use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener as TokioListener, TcpStream};
use tokio::sync::watch;
use tokio::time::Instant;

use super::{ConnectionLimit, HandedOver, Listener};
use crate::dataplane::balancer::{Backend, LoadBalancer, Settings};
use crate::dataplane::proxy::Route;
use crate::dataplane::workers::Workers;
use crate::metrics::stats::LbStats;

/// A load balancer of one backend at `backend`, and its listening socket
/// on 127.0.0.1 (kept here, so every listener of the test serves the same
/// port, as the next process gets the same socket from the store).
struct Bed {
    lb: Arc<LoadBalancer>,
    backend: Arc<Backend>,
    port: u16,
    stats: Arc<crate::metrics::ListenerStats>,
    limit: Arc<ConnectionLimit>,
    socket: std::net::TcpListener,
}

impl Bed {
    fn new(backend: SocketAddr, idle: Duration) -> Self {
        Self::with(
            backend,
            Settings {
                idle_timeout: idle,
                ..Settings::for_tests()
            },
        )
    }

    fn with(backend: SocketAddr, settings: Settings) -> Self {
        let b = Backend::new(backend.ip(), true);
        let lb = LoadBalancer::new(
            "ns/svc".into(),
            "c".into(),
            settings,
            vec![Arc::clone(&b)],
            LbStats::detached(),
        );
        let stats = lb.stats().listener("l");
        let mut sockets = super::bind("127.0.0.1:0".parse().unwrap(), 128, 1).unwrap();
        Self {
            lb,
            backend: b,
            port: backend.port(),
            stats,
            limit: ConnectionLimit::new(1000),
            socket: sockets.remove(0),
        }
    }

    fn vip(&self) -> SocketAddr {
        self.socket.local_addr().unwrap()
    }

    /// A listener on (a descriptor of) the bed's socket.
    fn listener(&self) -> Listener {
        let route = Route {
            lb: Arc::clone(&self.lb),
            listener: "l".into(),
            backend_port: self.port,
            stats: Arc::clone(&self.stats),
            proxy_protocol: None,
        };
        Listener::start(
            vec![self.socket.try_clone().unwrap()],
            Workers::here().place(),
            route,
            Arc::clone(&self.limit),
        )
        .unwrap()
    }

    /// Hands `from`'s connections over and has a new listener adopt them.
    async fn hand_over(&self, from: Listener) -> (Listener, usize) {
        let HandedOver { connections, lost } = from
            .hand_over(Instant::now() + Duration::from_secs(30))
            .await;
        assert_eq!(lost, 0, "a connection was lost at the hand-over");
        let next = self.listener();
        let n = next.adopt(connections);
        (next, n)
    }
}

/// Polls `cond` every 5 ms until it holds or `within` passes.
async fn wait_until(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = Instant::now() + within;
    while Instant::now() < deadline {
        if cond() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    cond()
}

/// A backend address on its own loopback IP, with a fixed port free there.
async fn backend_listener(ip: [u8; 4]) -> TokioListener {
    TokioListener::bind(SocketAddr::from((ip, 0)))
        .await
        .unwrap()
}

/// Bytes of a stream whose every position is told from every other within
/// 256 blocks (an odd size, so no shift short of 256 blocks maps the
/// stream onto itself): a lost or repeated byte shows as a mismatch.
const BLOCK: usize = (1 << 20) + 7;

struct Pattern(Vec<u8>);

impl Pattern {
    fn new(seed: u64) -> Self {
        let mut x = seed;
        Self(
            (0..BLOCK)
                .map(|_| {
                    // xorshift64
                    x ^= x << 13;
                    x ^= x >> 7;
                    x ^= x << 17;
                    x as u8
                })
                .collect(),
        )
    }

    fn fill(&self, at: u64, buf: &mut [u8]) {
        for (i, b) in buf.iter_mut().enumerate() {
            let p = at as usize + i;
            *b = self.0[p % BLOCK] ^ (p / BLOCK) as u8;
        }
    }
}

/// Writes `total` bytes of `pattern`; from each of `gates`' thresholds plus
/// `ahead` on, waits for that many hand-overs to be done. Then half-closes.
async fn send(
    mut w: impl tokio::io::AsyncWrite + Unpin,
    pattern: &Pattern,
    total: u64,
    sent: &AtomicU64,
    gates: &[u64],
    ahead: u64,
    mut done: watch::Receiver<usize>,
) {
    let mut buf = vec![0u8; 256 * 1024];
    let mut at = 0u64;
    while at < total {
        let passed = gates.iter().filter(|&&g| at >= g + ahead).count();
        done.wait_for(|d| *d >= passed).await.unwrap();
        let n = buf.len().min((total - at) as usize);
        pattern.fill(at, &mut buf[..n]);
        w.write_all(&buf[..n]).await.unwrap();
        at += n as u64;
        sent.store(at, Ordering::Relaxed);
    }
    w.shutdown().await.unwrap();
}

/// Reads to end of stream, checking every byte against `pattern`; returns
/// how many came.
async fn receive(mut r: impl tokio::io::AsyncRead + Unpin, pattern: &Pattern) -> u64 {
    let mut buf = vec![0u8; 256 * 1024];
    let mut want = vec![0u8; 256 * 1024];
    let mut at = 0u64;
    loop {
        let n = r.read(&mut buf).await.unwrap();
        if n == 0 {
            return at;
        }
        pattern.fill(at, &mut want[..n]);
        assert!(
            buf[..n] == want[..n],
            "wrong bytes at offset {at}..{}: lost or duplicated",
            at + n as u64
        );
        at += n as u64;
    }
}

/// 64 MiB each way through the proxy, handed over three times while both
/// directions are moving (each sender is at most 8 MiB past the point that
/// triggers a hand-over when it happens, so bytes are in flight in the
/// sockets and the splice pipes): every byte arrives once, in order, and
/// the half-closes at the end pass through the last listener.
///
/// Cancelling the copy at any await instead of at its wait for the source
/// (verified by making `relay` take a hand-over's wake for a pause at once)
/// fails this test with wrong bytes: what was in the pipe or the scratch
/// buffer's tail is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_bulk_transfer_both_ways_survives_three_hand_overs_byte_for_byte() {
    const TOTAL: u64 = 64 << 20;
    const GATES: [u64; 3] = [8 << 20, 24 << 20, 40 << 20];
    const AHEAD: u64 = 8 << 20;
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(60));
    let (done_tx, done_rx) = watch::channel(0usize);
    let up = Arc::new(Pattern::new(0x9e37_79b9_7f4a_7c15));
    let down = Arc::new(Pattern::new(0xd1b5_4a32_d192_ed03));
    let sent_up = Arc::new(AtomicU64::new(0));
    let sent_down = Arc::new(AtomicU64::new(0));

    let mut listener = bed.listener();
    let server = {
        let (up, down, sent, done) = (up.clone(), down.clone(), sent_down.clone(), done_rx.clone());
        tokio::spawn(async move {
            let (stream, _) = backend.accept().await.unwrap();
            let (r, w) = stream.into_split();
            let writer =
                tokio::spawn(
                    async move { send(w, &down, TOTAL, &sent, &GATES, AHEAD, done).await },
                );
            let got = receive(r, &up).await;
            writer.await.unwrap();
            got
        })
    };
    let client = {
        let (up, down, sent, done) = (up.clone(), down.clone(), sent_up.clone(), done_rx.clone());
        let vip = bed.vip();
        tokio::spawn(async move {
            let stream = TcpStream::connect(vip).await.unwrap();
            let (r, w) = stream.into_split();
            let writer =
                tokio::spawn(async move { send(w, &up, TOTAL, &sent, &GATES, AHEAD, done).await });
            let got = receive(r, &down).await;
            writer.await.unwrap();
            got
        })
    };

    for (k, gate) in GATES.iter().enumerate() {
        let reached = wait_until(Duration::from_secs(60), || {
            sent_up.load(Ordering::Relaxed) >= *gate && sent_down.load(Ordering::Relaxed) >= *gate
        })
        .await;
        assert!(reached, "the transfer stalled before {gate} bytes");
        let (next, adopted) = bed.hand_over(listener).await;
        assert_eq!(
            adopted, 1,
            "hand-over {k}: the connection was not handed over"
        );
        listener = next;
        done_tx.send(k + 1).unwrap();
    }
    let within = Duration::from_secs(120);
    let got_up = tokio::time::timeout(within, server).await.unwrap().unwrap();
    let got_down = tokio::time::timeout(within, client).await.unwrap().unwrap();
    assert_eq!((got_up, got_down), (TOTAL, TOTAL));
    assert!(
        wait_until(Duration::from_secs(10), || listener.open_connections() == 0).await,
        "the adopted connection did not end with its peers"
    );
    assert_eq!(bed.backend.active_connections(), 0);
    assert_eq!(bed.lb.connections().used(), 0);
}

/// A connected client and backend through `bed`'s `listener`.
async fn connect(bed: &Bed, backend: &TokioListener) -> (TcpStream, TcpStream) {
    let client = TcpStream::connect(bed.vip()).await.unwrap();
    let (server, _) = tokio::time::timeout(Duration::from_secs(10), backend.accept())
        .await
        .unwrap()
        .unwrap();
    (client, server)
}

/// `from` sends `words` and half-closes; `to` gets exactly them, then the
/// end of stream.
async fn last_words(from: &mut TcpStream, to: &mut TcpStream, words: &[u8]) {
    from.write_all(words).await.unwrap();
    from.shutdown().await.unwrap();
    let mut got = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), to.read_to_end(&mut got))
        .await
        .expect("no end of stream")
        .unwrap();
    assert_eq!(got, words);
}

/// A client that has sent its whole request and half-closed: the
/// backend's end of stream was passed on before the hand-over, and after
/// it the answer still comes back to the client, then the end of stream.
#[tokio::test]
async fn a_half_closed_connection_gets_its_answer_after_the_hand_over() {
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(60));
    let listener = bed.listener();
    let (mut client, mut server) = connect(&bed, &backend).await;
    last_words(&mut client, &mut server, b"request").await;
    let (listener, adopted) = bed.hand_over(listener).await;
    assert_eq!(adopted, 1);
    // Sent before the adopting listener's task first runs (one thread):
    // the backend socket has then both sent and received its FIN, and
    // holds the answer unread.
    last_words(&mut server, &mut client, b"answer").await;
    assert!(wait_until(Duration::from_secs(10), || listener.open_connections() == 0).await);
}

/// An idle connection is handed over and goes on both ways; the adopting
/// listener counts it (listener's `active`, the backend's connections, the
/// load balancer's cap) until it ends, and its idle timeout starts again
/// there.
#[tokio::test]
async fn an_idle_connection_is_counted_and_served_on_by_the_adopting_listener() {
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(3));
    let listener = bed.listener();
    let (mut client, mut server) = connect(&bed, &backend).await;
    assert!(wait_until(Duration::from_secs(10), || bed.stats.active.get() == 1).await);

    let (listener, adopted) = bed.hand_over(listener).await;
    assert_eq!(adopted, 1);
    assert!(wait_until(Duration::from_secs(10), || bed.stats.active.get() == 1).await);
    assert_eq!(bed.backend.active_connections(), 1);
    assert_eq!(bed.lb.connections().used(), 1);
    assert_eq!(listener.open_connections(), 1);
    for _ in 0..2 {
        client.write_all(b"ping").await.unwrap();
        let mut got = [0u8; 4];
        server.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"ping");
        server.write_all(b"pong").await.unwrap();
        client.read_exact(&mut got).await.unwrap();
        assert_eq!(&got, b"pong");
    }
    // Idle from now: the adopting listener closes it at its idle timeout.
    let mut rest = Vec::new();
    tokio::time::timeout(Duration::from_secs(30), client.read_to_end(&mut rest))
        .await
        .expect("the adopted connection outlived its idle timeout")
        .unwrap();
    assert!(wait_until(Duration::from_secs(10), || listener.open_connections() == 0).await);
    assert_eq!(bed.stats.active.get(), 0);
    assert_eq!(bed.backend.active_connections(), 0);
    assert_eq!(bed.lb.connections().used(), 0);
}

/// A client that reads nothing while the backend sends: the direction
/// towards it is stuck in its write and never reaches its wait, so the
/// hand-over's deadline closes it and counts it lost.
#[tokio::test]
async fn a_connection_whose_client_does_not_read_is_lost_at_the_deadline() {
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(60));
    let listener = bed.listener();
    let (_client, server) = connect(&bed, &backend).await;
    let sent = Arc::new(AtomicU64::new(0));
    let count = Arc::clone(&sent);
    let writer = tokio::spawn(async move {
        let mut server = server;
        let buf = vec![7u8; 64 * 1024];
        while server.write_all(&buf).await.is_ok() {
            count.fetch_add(buf.len() as u64, Ordering::Relaxed);
        }
    });
    // Every buffer on the way is full once the count stops moving for a
    // while (five looks 100 ms apart).
    let deadline = Instant::now() + Duration::from_secs(60);
    let (mut last, mut same) = (0, 0);
    while same < 5 {
        assert!(
            Instant::now() < deadline,
            "the backend never stopped sending"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        let now = sent.load(Ordering::Relaxed);
        same = if now == last && now > 0 { same + 1 } else { 0 };
        last = now;
    }
    let handed = listener
        .hand_over(Instant::now() + Duration::from_secs(1))
        .await;
    assert_eq!((handed.connections.len(), handed.lost), (0, 1));
    writer.abort();
}

/// A connection still connecting to its backend when the hand-over
/// begins (the backend's accept queue is full, so the connect's SYN is
/// dropped and sent again a second later) finishes its connect, pauses as
/// its copy starts, and is handed over: the next process gets only
/// connections that are copying.
#[tokio::test]
async fn a_connection_still_connecting_is_handed_over_once_connected() {
    let socket = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    socket
        .bind(&SocketAddr::from(([127, 0, 0, 2], 0)).into())
        .unwrap();
    socket.listen(1).unwrap();
    socket.set_nonblocking(true).unwrap();
    let backend = TokioListener::from_std(socket.into()).unwrap();
    let addr = backend.local_addr().unwrap();
    // Linux queues backlog + 1 connections: two fill it.
    let mut fillers = Vec::new();
    for _ in 0..2 {
        fillers.push(TcpStream::connect(addr).await.unwrap());
    }
    let bed = Bed::with(
        addr,
        Settings {
            connect_timeout: Duration::from_secs(10),
            ..Settings::for_tests()
        },
    );
    let listener = bed.listener();
    let mut client = TcpStream::connect(bed.vip()).await.unwrap();
    assert!(wait_until(Duration::from_secs(10), || listener.open_connections() == 1).await);
    assert_eq!(bed.backend.active_connections(), 0, "connected already");
    let handing = tokio::spawn(listener.hand_over(Instant::now() + Duration::from_secs(30)));
    // Room in the queue: the SYN sent again gets through.
    for _ in 0..2 {
        drop(backend.accept().await.unwrap());
    }
    let HandedOver { connections, lost } = handing.await.unwrap();
    assert_eq!((connections.len(), lost), (1, 0));
    let next = bed.listener();
    next.adopt(connections);
    let (mut server, _) = tokio::time::timeout(Duration::from_secs(10), backend.accept())
        .await
        .unwrap()
        .unwrap();
    client.write_all(b"late").await.unwrap();
    let mut got = [0u8; 4];
    server.read_exact(&mut got).await.unwrap();
    assert_eq!(&got, b"late");
    drop(fillers);
}

/// A download to a client slower than the backend: the direction's source
/// always has data queued, so its bulk (splice) loop would never come back
/// to its wait for the source by itself. It pauses all the same (after the
/// chunk in its pipe is written), is handed over, and every byte arrives
/// once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_download_to_a_slow_client_pauses_and_loses_nothing() {
    // More than the socket buffers on the way (about 20 MiB on loopback)
    // and what the client reads during the hand-over's deadline.
    const TOTAL: u64 = 64 << 20;
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(60));
    let listener = bed.listener();
    let (client, mut server) = connect(&bed, &backend).await;
    let pattern = Arc::new(Pattern::new(7));
    // Made beforehand, so the backend writes at memory speed and the
    // proxy's receive queue from it is never empty.
    let mut stream = vec![0u8; TOTAL as usize];
    pattern.fill(0, &mut stream);
    let writer = tokio::spawn(async move {
        server.write_all(&stream).await.unwrap();
        server.shutdown().await.unwrap();
    });
    let got = Arc::new(AtomicU64::new(0));
    let fast = Arc::new(AtomicBool::new(false));
    let reader = {
        let (pattern, got, fast) = (Arc::clone(&pattern), Arc::clone(&got), Arc::clone(&fast));
        tokio::spawn(async move {
            // 64 KiB each 10 ms: about 6 MiB/s, far slower than loopback.
            let mut pace = tokio::time::interval(Duration::from_millis(10));
            pace.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            let slow = SlowReader {
                inner: client,
                pace,
                got,
                fast,
            };
            receive(slow, &pattern).await
        })
    };
    assert!(
        wait_until(Duration::from_secs(60), || got.load(Ordering::Relaxed)
            >= 2 << 20)
        .await,
        "the download did not start"
    );
    let handed = listener
        .hand_over(Instant::now() + Duration::from_secs(2))
        .await;
    assert_eq!(
        (handed.connections.len(), handed.lost),
        (1, 0),
        "the download was not paused"
    );
    assert!(
        got.load(Ordering::Relaxed) < TOTAL - (24 << 20),
        "not mid-download"
    );
    fast.store(true, Ordering::Relaxed);
    let next = bed.listener();
    assert_eq!(next.adopt(handed.connections), 1);
    let got = tokio::time::timeout(Duration::from_secs(120), reader)
        .await
        .unwrap()
        .unwrap();
    assert_eq!(got, TOTAL);
    writer.await.unwrap();
}

/// A reader that takes at most 64 KiB per tick of `pace`, until `fast`.
struct SlowReader {
    inner: TcpStream,
    pace: tokio::time::Interval,
    got: Arc<AtomicU64>,
    fast: Arc<AtomicBool>,
}

impl tokio::io::AsyncRead for SlowReader {
    fn poll_read(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<std::io::Result<()>> {
        if !self.fast.load(Ordering::Relaxed) {
            std::task::ready!(self.pace.poll_tick(cx));
        }
        let want = buf.remaining().min(64 * 1024);
        let mut small = tokio::io::ReadBuf::new(buf.initialize_unfilled_to(want));
        let r = std::pin::Pin::new(&mut self.inner).poll_read(cx, &mut small);
        let n = small.filled().len();
        if r.is_pending() {
            // The tick is spent; the next poll waits for another.
            return std::task::Poll::Pending;
        }
        buf.advance(n);
        self.got.fetch_add(n as u64, Ordering::Relaxed);
        r
    }
}

/// A connection of another VIP:port given to a listener is reset, not
/// served: a wrong match of the store's names cannot cross tenants.
#[tokio::test]
async fn a_connection_of_another_listener_is_reset_not_adopted() {
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(60));
    let listener = bed.listener();
    let elsewhere = TokioListener::bind("127.0.0.1:0").await.unwrap();
    let mut client = TcpStream::connect(elsewhere.local_addr().unwrap())
        .await
        .unwrap();
    let (ours, _) = elsewhere.accept().await.unwrap();
    let (_server, to_backend) = connect(&bed, &backend).await;
    let handed = super::HandedConnection {
        client: ours.into_std().unwrap(),
        backend: to_backend.into_std().unwrap(),
    };
    assert_eq!(listener.adopt(vec![handed]), 0);
    let mut rest = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut rest))
        .await
        .expect("the connection was left open");
    assert_eq!(
        read.unwrap_err().kind(),
        std::io::ErrorKind::ConnectionReset
    );
}

#[test]
fn the_pattern_tells_every_shift_within_the_transfer() {
    let p = Pattern::new(1);
    let (mut a, mut b) = (vec![0u8; 4096], vec![0u8; 4096]);
    for shift in [1u64, 7, 4096, BLOCK as u64, 3 * BLOCK as u64 + 1] {
        p.fill(10 * BLOCK as u64, &mut a);
        p.fill(10 * BLOCK as u64 + shift, &mut b);
        assert_ne!(a, b, "shift {shift}");
    }
}

/// Clients connecting back to back (four threads) while listener after
/// listener hands its connections over (300 hand-overs): every client gets
/// the backend's greeting, none an end of stream. A client an accept loop
/// took just as it was told to stop used to have its task spawned after
/// the hand-over had taken the paused connections, and was closed with the
/// old listener (tests/it/restart.rs: "tcp read: Ok(0)" for 1 of 8 clients,
/// once, in CI's two test lanes).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_accepted_as_the_hand_over_begins_is_handed_over() {
    use std::io::BufRead;
    let backend = backend_listener([127, 0, 0, 2]).await;
    let bed = Bed::new(backend.local_addr().unwrap(), Duration::from_secs(60));
    // The backend greets each connection and keeps it until the client
    // closes it.
    let server = tokio::spawn(async move {
        while let Ok((mut s, _)) = backend.accept().await {
            tokio::spawn(async move {
                if s.write_all(b"hello\n").await.is_ok() {
                    let mut sink = [0u8; 64];
                    while matches!(s.read(&mut sink).await, Ok(n) if n > 0) {}
                }
            });
        }
    });
    let vip = bed.vip();
    let stop = Arc::new(AtomicBool::new(false));
    let (greeted, cut) = (Arc::new(AtomicU64::new(0)), Arc::new(AtomicU64::new(0)));
    let clients: Vec<_> = (0..4)
        .map(|_| {
            let (stop, greeted, cut) = (Arc::clone(&stop), Arc::clone(&greeted), Arc::clone(&cut));
            std::thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(120);
                while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                    let s = std::net::TcpStream::connect_timeout(&vip, Duration::from_secs(10))
                        .expect("the listening socket queues clients between listeners");
                    s.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
                    let mut line = String::new();
                    match std::io::BufReader::new(&s).read_line(&mut line) {
                        Ok(n) if n > 0 => greeted.fetch_add(1, Ordering::Relaxed),
                        _ => cut.fetch_add(1, Ordering::Relaxed),
                    };
                }
            })
        })
        .collect();
    let mut listener = bed.listener();
    for round in 0..300 {
        let before = greeted.load(Ordering::Relaxed);
        assert!(
            wait_until(Duration::from_secs(20), || greeted.load(Ordering::Relaxed)
                > before + 3)
            .await,
            "round {round}: no client greeted for 20 s"
        );
        listener = bed.hand_over(listener).await.0;
    }
    stop.store(true, Ordering::Relaxed);
    for c in clients {
        c.join().unwrap();
    }
    assert_eq!(
        cut.load(Ordering::Relaxed),
        0,
        "clients cut without their greeting, of {} greeted",
        greeted.load(Ordering::Relaxed)
    );
    drop(listener);
    server.abort();
}

//! A restart that refuses nothing (issue 41), with the real binary and a
//! stand-in for systemd's file descriptor store (`support::fd_store`):
//! `prepare-stop --restart`, SIGTERM, and the next process started with the
//! stored descriptors, as `systemctl restart` does under a unit with
//! `FileDescriptorStoreMax=`, while a client connects every 50 ms to a
//! proxied TCP listener (two `SO_REUSEPORT` sockets, thread per core) and
//! sends a UDP query every 50 ms. And the stop's meaning kept: a SIGTERM
//! with no word before it drains, takes the listeners out of the store, and
//! the port refuses afterwards.
//!
//! Ten long connections, each exchanging a line every 100 ms, stay open
//! across all five restarts: the proxy pauses them where no byte is held
//! and the next process serves them on (`daemon::hand_over` `carrier`).
//!
//! Left out here: systemd itself (.ci/systemd-boot.sh runs the unit under
//! systemd 252), kernel listeners and host objects (tests/it/hand_over_host.rs,
//! in namespaces on a bridged host).

// Real processes and sockets, timed by the wall clock.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::support;

use std::io::{BufRead, BufReader, ErrorKind};
use std::net::{SocketAddr, TcpStream, UdpSocket};
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use support::fd_store::FakeStore;
use support::metric_at as metric;
use support::{Backend, Behaviour, Config, Lb, Listener, Process, Subnet};

/// What the clients saw.
#[derive(Default)]
struct Seen {
    /// Connections and queries begun (before the connect or the send).
    tcp_tried: AtomicUsize,
    udp_tried: AtomicUsize,
    /// A connection or query is waiting for its answer now.
    tcp_waiting: AtomicBool,
    udp_waiting: AtomicBool,
    tcp_ok: AtomicUsize,
    tcp_refused: AtomicUsize,
    tcp_failed: AtomicUsize,
    udp_ok: AtomicUsize,
    /// Queries answered only after the retry.
    udp_retried: AtomicUsize,
    udp_unanswered: AtomicUsize,
    /// What went wrong, for the failure message.
    errors: Mutex<Vec<String>>,
}

impl Seen {
    fn line(&self) -> String {
        format!(
            "TCP {} answered, {} refused, {} failed; UDP {} answered ({} after a retry), {} unanswered; first errors: {:?}",
            self.tcp_ok.load(Ordering::SeqCst),
            self.tcp_refused.load(Ordering::SeqCst),
            self.tcp_failed.load(Ordering::SeqCst),
            self.udp_ok.load(Ordering::SeqCst),
            self.udp_retried.load(Ordering::SeqCst),
            self.udp_unanswered.load(Ordering::SeqCst),
            self.errors
                .lock()
                .unwrap()
                .iter()
                .take(5)
                .collect::<Vec<_>>()
        )
    }

    fn error(&self, e: String) {
        self.errors.lock().unwrap().push(e);
    }
}

/// A new TCP connection and a new UDP query every 50 ms, each on a thread
/// of its own, until `stop`; bounded to 10 minutes.
struct Clients {
    /// Whether UDP queries are sent too.
    udp: bool,
    seen: Arc<Seen>,
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Clients {
    /// Without `udp`, TCP clients only.
    fn start(tcp: SocketAddr, udp: Option<SocketAddr>) -> Self {
        let seen = Arc::new(Seen::default());
        let stop = Arc::new(AtomicBool::new(false));
        let tcp_thread = {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            std::thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(600);
                while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                    seen.tcp_tried.fetch_add(1, Ordering::SeqCst);
                    seen.tcp_waiting.store(true, Ordering::SeqCst);
                    match TcpStream::connect_timeout(&tcp, Duration::from_secs(10)) {
                        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {
                            seen.tcp_refused.fetch_add(1, Ordering::SeqCst);
                            seen.error(format!("tcp connect: {e}"));
                        }
                        Err(e) => {
                            seen.tcp_failed.fetch_add(1, Ordering::SeqCst);
                            seen.error(format!("tcp connect: {e}"));
                        }
                        Ok(s) => {
                            s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                            let mut line = String::new();
                            match BufReader::new(s).read_line(&mut line) {
                                Ok(n) if n > 0 && line.ends_with('\n') => {
                                    seen.tcp_ok.fetch_add(1, Ordering::SeqCst);
                                }
                                other => {
                                    seen.tcp_failed.fetch_add(1, Ordering::SeqCst);
                                    seen.error(format!("tcp read: {other:?}"));
                                }
                            }
                        }
                    }
                    seen.tcp_waiting.store(false, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        };
        let udp_thread = udp.map(|udp| {
            let (seen, stop) = (Arc::clone(&seen), Arc::clone(&stop));
            std::thread::spawn(move || {
                let end = Instant::now() + Duration::from_secs(600);
                let mut n = 0u64;
                while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                    n += 1;
                    let socket = UdpSocket::bind(SocketAddr::new(udp.ip(), 0)).unwrap();
                    let query = format!("q{n}");
                    seen.udp_tried.fetch_add(1, Ordering::SeqCst);
                    seen.udp_waiting.store(true, Ordering::SeqCst);
                    socket.send_to(query.as_bytes(), udp).unwrap();
                    let mut buf = [0u8; 64];
                    // A resolver's retry, from the same address after 2 s,
                    // counted: a query the old process had forwarded when it
                    // handed over is answered through its handed-over flow,
                    // so none should be needed.
                    socket
                        .set_read_timeout(Some(Duration::from_secs(2)))
                        .unwrap();
                    let mut answer = socket.recv(&mut buf);
                    if answer.is_err() {
                        seen.udp_retried.fetch_add(1, Ordering::SeqCst);
                        socket
                            .set_read_timeout(Some(Duration::from_secs(10)))
                            .unwrap();
                        socket.send_to(query.as_bytes(), udp).unwrap();
                        answer = socket.recv(&mut buf);
                    }
                    match answer {
                        Ok(len) if &buf[..len] == query.as_bytes() => {
                            seen.udp_ok.fetch_add(1, Ordering::SeqCst);
                        }
                        other => {
                            seen.udp_unanswered.fetch_add(1, Ordering::SeqCst);
                            seen.error(format!("udp {query}: {other:?}"));
                        }
                    }
                    seen.udp_waiting.store(false, Ordering::SeqCst);
                    std::thread::sleep(Duration::from_millis(50));
                }
            })
        });
        Self {
            udp: udp.is_some(),
            seen,
            stop,
            threads: std::iter::once(tcp_thread).chain(udp_thread).collect(),
        }
    }

    /// Waits until `holds` holds of the counts now and those at the call.
    async fn wait(&self, what: &str, holds: impl Fn(&Seen, [usize; 4]) -> bool) {
        let seen = &self.seen;
        let at = [
            seen.tcp_ok.load(Ordering::SeqCst),
            seen.udp_ok.load(Ordering::SeqCst),
            seen.tcp_tried.load(Ordering::SeqCst),
            seen.udp_tried.load(Ordering::SeqCst),
        ];
        let deadline = Instant::now() + Duration::from_secs(60);
        while !holds(seen, at) {
            assert!(
                Instant::now() < deadline,
                "no {what} within 60 s: {}",
                seen.line()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Waits until `n` more TCP and UDP answers than now have come.
    async fn more_answers(&self, n: usize) {
        let udp = self.udp;
        self.wait("new answers", |s, [t, u, _, _]| {
            s.tcp_ok.load(Ordering::SeqCst) >= t + n
                && (!udp || s.udp_ok.load(Ordering::SeqCst) >= u + n)
        })
        .await;
    }

    /// Waits until a connection and a query wait for their answer, begun
    /// now or before: with no process running, they meet the stored sockets
    /// alone.
    async fn waiting(&self) {
        let udp = self.udp;
        self.wait("clients between the processes", |s, [_, _, t, u]| {
            (s.tcp_tried.load(Ordering::SeqCst) > t || s.tcp_waiting.load(Ordering::SeqCst))
                && (!udp
                    || s.udp_tried.load(Ordering::SeqCst) > u
                    || s.udp_waiting.load(Ordering::SeqCst))
        })
        .await;
    }

    fn stop(mut self) -> Arc<Seen> {
        self.stop.store(true, Ordering::SeqCst);
        for t in self.threads.drain(..) {
            t.join().unwrap();
        }
        self.seen
    }
}

/// Long connections through the listener, each sending a numbered line
/// every 100 ms and checking its echo, on a thread of its own; bounded to
/// 10 minutes.
struct LongConnections {
    stop: Arc<AtomicBool>,
    /// Lines echoed, per connection.
    echoed: Arc<Vec<AtomicUsize>>,
    threads: Vec<std::thread::JoinHandle<Result<(), String>>>,
}

impl LongConnections {
    fn open(tcp: SocketAddr, n: usize) -> Self {
        let stop = Arc::new(AtomicBool::new(false));
        let echoed: Arc<Vec<AtomicUsize>> = Arc::new((0..n).map(|_| AtomicUsize::new(0)).collect());
        let threads = (0..n)
            .map(|i| {
                let (stop, echoed) = (Arc::clone(&stop), Arc::clone(&echoed));
                std::thread::spawn(move || -> Result<(), String> {
                    use std::io::Write;
                    let s = TcpStream::connect_timeout(&tcp, Duration::from_secs(10))
                        .map_err(|e| format!("connection {i}: connect: {e}"))?;
                    // A restart pauses a connection for its window: far
                    // under this.
                    s.set_read_timeout(Some(Duration::from_secs(20))).unwrap();
                    let mut w = s.try_clone().unwrap();
                    let mut r = BufReader::new(s);
                    let mut line = String::new();
                    r.read_line(&mut line)
                        .map_err(|e| format!("connection {i}: backend's name: {e}"))?;
                    let end = Instant::now() + Duration::from_secs(600);
                    let mut k = 0u64;
                    while !stop.load(Ordering::SeqCst) && Instant::now() < end {
                        k += 1;
                        let sent = format!("connection {i} line {k}\n");
                        w.write_all(sent.as_bytes())
                            .map_err(|e| format!("connection {i} line {k}: write: {e}"))?;
                        line.clear();
                        match r.read_line(&mut line) {
                            Ok(_) if line == sent => {}
                            other => {
                                return Err(format!(
                                    "connection {i} line {k}: {other:?}, got {line:?}"
                                ));
                            }
                        }
                        echoed[i].fetch_add(1, Ordering::SeqCst);
                        std::thread::sleep(Duration::from_millis(100));
                    }
                    Ok(())
                })
            })
            .collect();
        Self {
            stop,
            echoed,
            threads,
        }
    }

    /// Waits until every connection has echoed `n` more lines than now.
    async fn more_lines(&self, n: usize) {
        let at: Vec<usize> = self
            .echoed
            .iter()
            .map(|e| e.load(Ordering::SeqCst))
            .collect();
        let deadline = Instant::now() + Duration::from_secs(60);
        while self
            .echoed
            .iter()
            .zip(&at)
            .any(|(e, a)| e.load(Ordering::SeqCst) < a + n)
        {
            assert!(
                self.threads.iter().all(|t| !t.is_finished()),
                "a long connection ended: {:?}",
                self.echoed
            );
            assert!(
                Instant::now() < deadline,
                "not every long connection echoed {n} more lines within 60 s: {:?}",
                self.echoed
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Stops them; the error of each that broke.
    fn close(mut self) -> (usize, Vec<String>) {
        self.stop.store(true, Ordering::SeqCst);
        let lines = self.echoed.iter().map(|e| e.load(Ordering::SeqCst)).sum();
        let errors = self
            .threads
            .drain(..)
            .filter_map(|t| t.join().unwrap().err())
            .collect();
        (lines, errors)
    }
}

struct Bed {
    net: Subnet,
    config: std::path::PathBuf,
    admin: SocketAddr,
    tcp: SocketAddr,
    udp: SocketAddr,
    _backend: Backend,
    _udp_backend: tokio::task::JoinHandle<()>,
}

async fn bed() -> Bed {
    let net = Subnet::new();
    let backend = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let udp_backend = support::udp_echo(SocketAddr::new(net.ip(11), 30053)).await;
    // The default drain timeout (30 s): a stop still waits for open
    // connections, a restart does not.
    let text = Config::on(&net).lb(Lb::new("default/web", net.ip(1))
        .backends([net.ip(11)])
        .tcp("web", 8080, 30080)
        .listener(Listener::new("dns", 5353, 30053).udp()));
    let config = net.write("config.toml", &text.to_string());
    Bed {
        admin: SocketAddr::new(net.ip(250), 9901),
        tcp: SocketAddr::new(net.ip(1), 8080),
        udp: SocketAddr::new(net.ip(1), 5353),
        net,
        config,
        _backend: backend,
        _udp_backend: udp_backend,
    }
}

/// Two threads, one `SO_REUSEPORT` socket each per TCP listener.
fn daemon(config: &Path) -> support::Launch {
    Process::launch(config).args(&["--threads", "2", "--scheduler", "thread-per-core"])
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn five_restarts_in_a_row_refuse_no_connection_and_leave_no_query_unanswered() {
    let bed = bed().await;
    let store = FakeStore::new(bed.net.dir(), 64);
    let mut p = store.launch(daemon(&bed.config));
    p.wait_ready(bed.admin).await;
    // Two TCP sockets, the UDP one, the admin listener and socket.
    store.wait_count(5).await;
    assert_eq!(store.notified("READY=1"), 1);
    let clients = Clients::start(bed.tcp, Some(bed.udp));
    clients.more_answers(5).await;
    let long = LongConnections::open(bed.tcp, 10);
    long.more_lines(3).await;
    let config = bed.config.to_str().unwrap().to_string();
    for round in 1..=5 {
        let (code, out, err) = support::cli(vec![
            "prepare-stop".into(),
            "--config".into(),
            config.clone(),
            "--restart".into(),
        ])
        .await;
        assert_eq!(code, 0, "round {round}: prepare-stop: {out}{err}");
        assert!(out.contains("hands its sockets over"), "{out}{err}");
        let old = p.pid();
        p.signal(libc::SIGTERM);
        let status = p.wait_exit(Duration::from_secs(30)).await;
        assert!(
            status.is_some_and(|s| s.success()),
            "round {round}: the old process exits 0 at once: {status:?}\n{}",
            p.log_tail(30)
        );
        p.wait_logged("handed over").await;
        // No process runs now, as while systemd restarts the unit: a
        // client and a query arrive before the next process starts (the
        // first TCP one waits in the stored socket's accept queue, the next
        // one waits for it; the query waits in the receive buffer).
        clients.waiting().await;
        // keepalived's track script: the admin socket's file is there and
        // a request sent now is answered by the next process.
        let socket = bed.net.dir().join("admin.sock");
        let track = tokio::spawn(async move {
            tokio::time::timeout(
                Duration::from_secs(30),
                support::http_unix(&socket, "GET", "/readyz", ""),
            )
            .await
        });
        p = store.launch(daemon(&bed.config));
        assert_ne!(p.pid(), old);
        p.wait_ready(bed.admin).await;
        let (code, body) = track
            .await
            .unwrap()
            .expect("the admin socket answers within 30 s");
        assert_eq!((code, body.trim()), (200, "ready"), "round {round}");
        // Answers through the new process, on its adopted sockets, and the
        // long connections go on through it.
        clients.more_answers(5).await;
        long.more_lines(3).await;
        assert_eq!(
            metric(bed.admin, "harvester_lb_restart_adopted_listening_sockets").await,
            5.0,
            "round {round}: every listening socket adopted, none bound anew"
        );
        assert_eq!(
            metric(
                bed.admin,
                "harvester_lb_restart_handed_over{kind=\"listening_sockets\"}"
            )
            .await,
            2.0,
            "round {round}: the TCP and the UDP listener"
        );
        let window = metric(bed.admin, "harvester_lb_restart_window_seconds").await;
        println!(
            "FIGURE restart round {round}: window {window:.3} s (last accept of the old process to the new one's listeners)"
        );
        store.wait_count(5).await;
        let (_, status) = support::http(bed.admin, "GET", "/status").await;
        let status: serde_json::Value = serde_json::from_str(&status).unwrap();
        let restart = &status["restart"];
        assert_eq!(restart["fd_store"], true, "{restart}");
        assert_eq!(restart["adopted_listening_sockets"], 5, "{restart}");
        assert_eq!(restart["last_hand_over"]["listeners"], 2, "{restart}");
        // A short client's connection open at that moment goes too.
        assert!(
            restart["last_hand_over"]["connections"].as_u64() >= Some(10),
            "the ten long connections handed over: {restart}"
        );
        assert_eq!(restart["last_hand_over"]["lost"], 0, "{restart}");
        assert_eq!(restart["announced_seconds_ago"], serde_json::Value::Null);
    }
    let seen = clients.stop();
    let (lines, broken) = long.close();
    println!(
        "FIGURE restart: 5 restarts, {}; long connections: {} of 10 kept, {lines} lines echoed",
        seen.line(),
        10 - broken.len()
    );
    assert!(broken.is_empty(), "long connections broke: {broken:?}");
    assert_eq!(
        seen.udp_retried.load(Ordering::SeqCst),
        0,
        "a query in flight at a hand-over is answered through its handed-over flow: {}",
        seen.line()
    );
    assert_eq!(
        seen.tcp_refused.load(Ordering::SeqCst),
        0,
        "{}",
        seen.line()
    );
    assert_eq!(seen.tcp_failed.load(Ordering::SeqCst), 0, "{}", seen.line());
    assert_eq!(
        seen.udp_unanswered.load(Ordering::SeqCst),
        0,
        "{}",
        seen.line()
    );
    assert_eq!(store.refused(), 0);

    // A stop: no word before the SIGTERM. It drains, takes every listener
    // out of the store, and the port refuses afterwards.
    p.signal(libc::SIGTERM);
    let status = p.wait_exit(Duration::from_secs(60)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    let left: Vec<String> = store.names();
    assert!(
        left.iter()
            .all(|n| !n.starts_with("listen-") && !n.starts_with("admin-")),
        "a stop leaves nothing of its listeners in the store: {left:?}"
    );
    match TcpStream::connect_timeout(&bed.tcp, Duration::from_secs(5)) {
        Err(e) if e.kind() == ErrorKind::ConnectionRefused => {}
        other => panic!("after a stop the port refuses: {other:?}"),
    }
}

/// The same restart without `prepare-stop`: what a restart did before
/// issue 41 (SIGTERM drains and closes every listener; the next process
/// binds anew), and what a stop followed by a start still does. The
/// clients that arrive between the two processes are refused: what the
/// test above would see on the code before the store (where `prepare-stop`
/// did not exist and every SIGTERM drained).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_without_prepare_stop_drains_and_refuses_new_clients_meanwhile() {
    let bed = bed().await;
    let store = FakeStore::new(bed.net.dir(), 64);
    let mut p = store.launch(daemon(&bed.config));
    p.wait_ready(bed.admin).await;
    let clients = Clients::start(bed.tcp, Some(bed.udp));
    clients.more_answers(5).await;
    p.signal(libc::SIGTERM);
    let status = p.wait_exit(Duration::from_secs(60)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    // The same gap as in the restarts above: clients arrive before the
    // next process starts, and are refused.
    clients.waiting().await;
    assert!(
        store.names().iter().all(|n| !n.starts_with("listen-")),
        "{:?}",
        store.names()
    );
    let mut p = store.launch(daemon(&bed.config));
    p.wait_ready(bed.admin).await;
    clients.more_answers(3).await;
    assert_eq!(
        metric(bed.admin, "harvester_lb_restart_adopted_listening_sockets").await,
        0.0,
        "nothing of the listeners was kept: bound anew"
    );
    let seen = clients.stop();
    println!("FIGURE restart without prepare-stop: {}", seen.line());
    assert!(
        seen.tcp_refused.load(Ordering::SeqCst) > 0,
        "{}",
        seen.line()
    );
}

/// A restart under a 500-listener config (one VIP, ports 20000-20499,
/// two `SO_REUSEPORT` sockets each): every socket adopted (1,002 with the
/// admin listener and socket), and a client every 50 ms to the last
/// listener refused never.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_under_500_listeners_adopts_every_socket_and_refuses_nothing() {
    let net = Subnet::new();
    let _backend =
        Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let mut lb = Lb::new("default/many", net.ip(1)).backends([net.ip(11)]);
    for port in 20000..20500 {
        lb = lb.tcp(&format!("p{port}"), port, 30080);
    }
    let config = net.write("config.toml", &Config::on(&net).lb(lb).to_string());
    let admin = SocketAddr::new(net.ip(250), 9901);
    let last = SocketAddr::new(net.ip(1), 20499);
    let store = FakeStore::new(net.dir(), 16384);
    let mut p = store.launch(daemon(&config));
    p.wait_ready(admin).await;
    store.wait_count(1002).await;
    // TCP only: the UDP side is the test above's.
    let clients = Clients::start(last, None);
    clients.more_answers(3).await;
    let (code, out, err) = support::cli(vec![
        "prepare-stop".into(),
        "--config".into(),
        config.to_str().unwrap().into(),
        "--restart".into(),
    ])
    .await;
    assert_eq!(code, 0, "{out}{err}");
    p.signal(libc::SIGTERM);
    let status = p.wait_exit(Duration::from_secs(60)).await;
    assert!(status.is_some_and(|s| s.success()), "{status:?}");
    clients.waiting().await;
    let started = Instant::now();
    let mut p = store.launch(daemon(&config));
    p.wait_ready(admin).await;
    println!(
        "FIGURE restart under 500 listeners: ready {} ms after the start of the next process, window {:.3} s",
        started.elapsed().as_millis(),
        metric(admin, "harvester_lb_restart_window_seconds").await
    );
    clients.more_answers(3).await;
    assert_eq!(
        metric(admin, "harvester_lb_restart_adopted_listening_sockets").await,
        1002.0
    );
    let seen = clients.stop();
    println!("FIGURE restart under 500 listeners: {}", seen.line());
    assert_eq!(
        seen.tcp_refused.load(Ordering::SeqCst),
        0,
        "{}",
        seen.line()
    );
    assert_eq!(seen.tcp_failed.load(Ordering::SeqCst), 0, "{}", seen.line());
}

/// `prepare-stop` as the unit's `ExecStop=` runs it (no `--restart`: it
/// asks systemd which job stops the unit): for a restart job it resets
/// the unit's start-limit count (`systemctl reset-failed UNIT`) before it
/// announces the restart, so a 6th restart in 2 minutes is not refused
/// after the old process handed over (systemd counts asked-for starts
/// against `StartLimitBurst=`; refused there, the unit fails and its store
/// is closed); for a stop job it touches nothing. `systemctl` is a
/// stand-in on `PATH` that records its arguments; the real one is
/// exercised by `.ci/systemd-boot.sh` (6 restarts in a row under
/// systemd 252). No daemon runs: prepare-stop then exits 69 after asking.
#[test]
fn prepare_stop_resets_the_start_limit_for_a_restart_job_only() {
    let dir = std::env::temp_dir().join(format!("hlb-prepare-stop-{}", std::process::id()));
    let bin = dir.join("bin");
    std::fs::create_dir_all(&bin).unwrap();
    let calls = dir.join("calls");
    let config = dir.join("config.toml");
    std::fs::write(
        &config,
        Config::new()
            .admin("127.0.0.1:0".parse().unwrap())
            .socket(&dir.join("admin.sock"))
            .to_string(),
    )
    .unwrap();
    let systemctl = bin.join("systemctl");
    std::fs::write(
        &systemctl,
        format!(
            "#!/bin/sh\necho \"$*\" >> '{}'\ncase \"$1\" in\n  list-jobs) echo \"7 hlb-test.service $JOB running\" ;;\n  show) echo 16384 ;;\nesac\n",
            calls.display()
        ),
    )
    .unwrap();
    std::fs::set_permissions(
        &systemctl,
        std::os::unix::fs::PermissionsExt::from_mode(0o755),
    )
    .unwrap();
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let run = |job: &str| {
        let _ = std::fs::remove_file(&calls);
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_harvester-lb"))
            .args([
                "prepare-stop",
                "--config",
                config.to_str().unwrap(),
                "--unit",
                "hlb-test.service",
            ])
            .env("PATH", &path)
            .env("JOB", job)
            .output()
            .expect("run harvester-lb prepare-stop");
        let (code, stdout, stderr) = support::outcome(&out);
        (
            code,
            stdout + &stderr,
            std::fs::read_to_string(&calls).unwrap_or_default(),
        )
    };

    let (code, said, calls_made) = run("restart");
    assert!(
        calls_made
            .lines()
            .any(|l| l == "reset-failed hlb-test.service"),
        "a restart job: systemctl reset-failed hlb-test.service, got calls:\n{calls_made}\nprepare-stop said: {said}"
    );
    assert!(said.contains("start limit count reset"), "{said}");
    // No daemon: the restart could not be announced (the stop drains).
    assert_eq!(code, 69, "{said}");

    let (code, said, calls_made) = run("stop");
    assert_eq!(code, 0, "{said}");
    assert!(
        !calls_made.contains("reset-failed"),
        "a stop job resets nothing, got calls:\n{calls_made}"
    );
    assert!(said.contains("a stop, the daemon drains"), "{said}");
    let _ = std::fs::remove_dir_all(&dir);
}

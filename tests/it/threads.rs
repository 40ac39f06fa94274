//! The real binary on more than one thread: the thread-per-core design (one
//! `SO_REUSEPORT` socket per thread per VIP:port) and tokio's work-stealing
//! runtime (one socket, the default). Sockets are counted in
//! `/proc/net/tcp`, as `ss -ltn` would show them to an operator.

use crate::support;

use std::net::{IpAddr, SocketAddr};
use std::time::Duration;

use harvester_lb::dataplane::workers::WorkerThreads;
use support::*;
use tokio::net::TcpStream;

const LB: &str = "default/threads";

fn config(net: &Subnet, port: u16) -> String {
    Config::new()
        .admin(SocketAddr::new(net.ip(1), 9901))
        .socket(&net.dir().join("admin.sock"))
        // Long enough that a connection on a port a reload removed is still in its
        // drain when the test, on a busy machine, gets to it (1 s was not).
        .proxy("drain_timeout_seconds = 8")
        .lb(Lb::new(LB, net.ip(2))
            .backends([net.ip(11)])
            .tcp("echo", port, 30080))
        .to_string()
}

/// Listening TCP sockets on `addr` (IPv4), from `/proc/net/tcp`.
fn listening_sockets(addr: SocketAddr) -> usize {
    let IpAddr::V4(ip) = addr.ip() else {
        panic!("IPv4 only")
    };
    // The kernel prints the address as the 32-bit word in host order.
    let local = format!(
        "{:08X}:{:04X}",
        u32::from_ne_bytes(ip.octets()),
        addr.port()
    );
    std::fs::read_to_string("/proc/net/tcp")
        .expect("read /proc/net/tcp")
        .lines()
        .skip(1)
        .filter(|l| {
            let mut fields = l.split_whitespace();
            let local_field = fields.nth(1);
            let state = fields.nth(1);
            local_field == Some(local.as_str()) && state == Some("0A")
        })
        .count()
}

async fn wait_sockets(addr: SocketAddr, want: usize) {
    wait_for(
        Duration::from_secs(10),
        &format!("{want} listening sockets on {addr}"),
        || async move { (listening_sockets(addr) == want).then_some(()) },
    )
    .await;
}

/// `/readyz` of the daemon of `net`, once it answers at all.
async fn readyz(net: &Subnet) -> (u16, String) {
    let admin = SocketAddr::new(net.ip(1), 9901);
    wait_for(Duration::from_secs(20), "/readyz to answer", || async {
        tokio::task::spawn_blocking(move || http_blocking(admin, "/readyz"))
            .await
            .unwrap()
            .ok()
    })
    .await
}

/// Connects `count` times, one connection after another (each from a new
/// port, so the kernel's hash spreads them over the sockets), and checks each
/// is forwarded to the node.
async fn each_forwarded(net: &Subnet, vip: SocketAddr, count: usize) {
    for i in 0..count {
        let who = tokio::time::timeout(Duration::from_secs(10), whoami(vip))
            .await
            .unwrap_or_else(|_| panic!("connection {i} through {vip} not served in 10 s"))
            .unwrap_or_else(|e| panic!("connection {i} through {vip}: {e}"));
        assert_eq!(who, net.ip_str(11), "connection {i}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thread_per_core_gives_each_thread_a_socket_and_every_one_serves() {
    let net = Subnet::new();
    let _node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let path = net.write("config.toml", &config(&net, 8080));
    let mut p = Process::start(&path, &["--threads", "3", "--scheduler", "thread-per-core"]);
    p.wait_ready(SocketAddr::new(net.ip(1), 9901)).await;
    let vip = SocketAddr::new(net.ip(2), 8080);
    wait_sockets(vip, 3).await;

    // 120 connections: were one thread's accept loop not running, the
    // third or so hashed to its socket would wait unaccepted (the chance
    // that none lands there is (2/3)^120, about 1e-21).
    each_forwarded(&net, vip, 120).await;

    // A connection open across a reload that moves the listener keeps
    // working; the old port's sockets all close, the new port gets three.
    let mut open = TcpStream::connect(vip).await.unwrap();
    assert_eq!(read_line(&mut open).await.unwrap(), net.ip_str(11));
    std::fs::write(&path, config(&net, 8081)).unwrap();
    p.signal(libc::SIGHUP);
    let moved = SocketAddr::new(net.ip(2), 8081);
    wait_sockets(moved, 3).await;
    wait_sockets(vip, 0).await;
    assert!(
        TcpStream::connect(vip).await.is_err(),
        "the removed port still accepts"
    );
    assert!(still_echoes(&mut open).await, "the open connection broke");
    each_forwarded(&net, moved, 30).await;

    // SIGTERM: every socket closes, the open connection is cut after the
    // 8 s drain, and the process exits 0 (its threads joined).
    p.signal(libc::SIGTERM);
    assert_eq!(p.exit_code(Duration::from_secs(40)).await, 0);
    assert_eq!(listening_sockets(moved), 0);
    assert!(!still_echoes(&mut open).await, "open after the drain");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_held_by_another_socket_is_not_shared() {
    // SO_REUSEPORT must not let the daemon join a socket it does not own:
    // the holder here has no SO_REUSEPORT, so the bind fails and /readyz
    // says so, as with one thread.
    let net = Subnet::new();
    let vip = SocketAddr::new(net.ip(2), 8080);
    let holder = std::net::TcpListener::bind(vip).unwrap();
    // In this process: thread per core over two threads, as `--threads 2
    // --scheduler thread-per-core` runs it.
    let threads = WorkerThreads::start(1).unwrap();
    let workers = threads.workers(tokio::runtime::Handle::current());
    let d = Daemon::start_on(&net, config(&net, 8080), workers).await;
    let body = d.get("/readyz").await;
    assert_eq!(body.0, 503, "{}", body.1);
    assert!(body.1.contains(&vip.to_string()), "{}", body.1);
    assert_eq!(listening_sockets(vip), 1, "only the holder listens");
    d.stop().await;
    threads.stop();
    drop(holder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_held_with_so_reuseport_by_another_process_is_not_shared() {
    // The holder sets SO_REUSEPORT itself (as another daemon, or a second
    // harvester-lb, would): the daemon's own SO_REUSEPORT sockets would join
    // its group and the kernel would split the VIP's connections between
    // them. Thread per core must refuse the port as work stealing does.
    let net = Subnet::new();
    let vip = SocketAddr::new(net.ip(2), 8080);
    let holder = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
    holder.set_reuse_address(true).unwrap();
    holder.set_reuse_port(true).unwrap();
    holder.bind(&vip.into()).unwrap();
    holder.listen(16).unwrap();
    let path = net.write("config.toml", &config(&net, 8080));
    for args in [
        &["--threads", "2", "--scheduler", "thread-per-core"][..],
        &["--threads", "2"][..],
    ] {
        let mut p = Process::start(&path, args);
        let body = readyz(&net).await;
        assert_eq!(body.0, 503, "{args:?}: {}", body.1);
        assert!(
            body.1.contains(&format!("listener {vip}: ")) && body.1.contains("in use"),
            "{args:?}: {}",
            body.1
        );
        assert_eq!(
            listening_sockets(vip),
            1,
            "{args:?}: only the holder listens"
        );
        p.signal(libc::SIGTERM);
        assert_eq!(p.exit_code(Duration::from_secs(40)).await, 0, "{args:?}");
    }
    drop(holder);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn work_stealing_the_default_and_one_thread_listen_on_one_socket() {
    let net = Subnet::new();
    let _node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::NameThenEcho).await;
    let path = net.write("config.toml", &config(&net, 8080));
    let vip = SocketAddr::new(net.ip(2), 8080);
    for args in [
        &["--threads", "2"][..],
        &["--threads", "2", "--scheduler", "work-stealing"][..],
        &["--threads", "1", "--scheduler", "thread-per-core"][..],
    ] {
        let mut p = Process::start(&path, args);
        p.wait_ready(SocketAddr::new(net.ip(1), 9901)).await;
        wait_sockets(vip, 1).await;
        each_forwarded(&net, vip, 20).await;
        p.signal(libc::SIGTERM);
        assert_eq!(p.exit_code(Duration::from_secs(40)).await, 0, "{args:?}");
    }
}

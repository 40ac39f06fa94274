//! Per-listener socket options, on real sockets: `defer_accept_seconds`
//! (`TCP_DEFER_ACCEPT`) keeps a client that connects and says nothing away
//! from the daemon, and so from the backend, until it speaks; a reload
//! turns it on for a kept listener without a rebind.
//!
//! The tests run on tokio's current-thread runtime with the daemon inside
//! it, so "did not happen" can be fenced soundly: the kernel's accept queue
//! is first in, first out, the accept loop spawns one task per client in
//! that order, and a single thread runs the tasks in the order spawned. A
//! silent client whose handshake completed before a talking one's would, if
//! handed over, be accepted and counted first; once the talking one has
//! been served, a count that does not include the silent one shows it was
//! never handed over.

use crate::support;

use std::net::SocketAddr;
use std::sync::atomic::Ordering;
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

const LB: &str = "default/defer";

fn config(net: &Subnet, listener_extra: &str) -> String {
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new(LB, net.ip(1))
            .backends([net.ip(11)])
            .listener(Listener::new("http", 8080, 30080).keys(listener_extra)))
        .to_string()
}

/// Sends `line` and waits (5 s at most) for the echo backend to send it back.
async fn echoes(s: &mut TcpStream, line: &[u8]) {
    s.write_all(line).await.expect("write");
    let mut got = vec![0u8; line.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut got))
        .await
        .expect("an echo within 5 s")
        .expect("read the echo");
    assert_eq!(got, line);
}

async fn accepted(d: &Daemon) -> f64 {
    d.metric(&format!(
        "harvester_lb_connections_accepted_total{{cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"http\"}}"
    ))
    .await
}

/// Connects a client that says nothing, then one that talks and is
/// served; returns the silent one after checking it was not handed over:
/// `before` clients had been accepted (and had reached the backend) before
/// these two, and only the talking one is added.
async fn silent_client_held(net: &Subnet, d: &Daemon, node: &Backend, before: usize) -> TcpStream {
    let vip = SocketAddr::new(net.ip(1), 8080);
    // Its handshake completes (the client sees it established) before the
    // talking client starts its own.
    let silent = connect_from(net.ip(101), vip)
        .await
        .expect("silent client connects");
    let mut talker = connect_from(net.ip(102), vip)
        .await
        .expect("talking client connects");
    echoes(&mut talker, b"first\n").await;
    // The fence: the talking client has been served, so a silent client
    // handed over before it would have been accepted and counted, and its
    // backend connect made, before it.
    assert_eq!(
        accepted(d).await,
        (before + 1) as f64,
        "the silent client was accepted"
    );
    assert_eq!(
        node.accepted.load(Ordering::SeqCst),
        before + 1,
        "the silent client reached the backend"
    );
    drop(talker);
    silent
}

#[tokio::test]
async fn defer_accept_holds_a_silent_client_until_it_speaks() {
    let net = Subnet::new();
    let node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::Echo).await;
    let d = Daemon::start(&net, &config(&net, "  defer_accept_seconds = 30\n")).await;

    let mut silent = silent_client_held(&net, &d, &node, 0).await;
    // Its first bytes hand it over: accepted, connected, served.
    echoes(&mut silent, b"late\n").await;
    assert_eq!(node.accepted.load(Ordering::SeqCst), 2);
    assert_eq!(accepted(&d).await, 2.0);
    drop(silent);
    assert_eq!(d.stop().await, 0, "connections cut at stop");
}

/// Without the option (the default) a silent client is accepted and its
/// backend connection made at once: the fence above sees a difference. A
/// reload then turns the option on for the same listener, in place: the
/// connection open since before the reload still works (no rebind), and
/// a new silent client is held.
#[tokio::test]
async fn a_reload_turns_defer_accept_on_in_place() {
    let net = Subnet::new();
    let node = Backend::start(SocketAddr::new(net.ip(11), 30080), Behaviour::Echo).await;
    let d = Daemon::start(&net, &config(&net, "")).await;
    let vip = SocketAddr::new(net.ip(1), 8080);

    let mut early = connect_from(net.ip(103), vip).await.expect("connect");
    wait_for(
        Duration::from_secs(5),
        "the silent client's backend connection (no defer_accept)",
        || async { (node.accepted.load(Ordering::SeqCst) == 1).then_some(()) },
    )
    .await;
    assert_eq!(accepted(&d).await, 1.0);

    std::fs::write(&d.config, config(&net, "  defer_accept_seconds = 30\n")).unwrap();
    d.server().reload().await.expect("reload");
    let mut silent = silent_client_held(&net, &d, &node, 1).await;
    echoes(&mut early, b"kept\n").await;
    echoes(&mut silent, b"late\n").await;
    assert_eq!(node.accepted.load(Ordering::SeqCst), 3);
    drop((early, silent));
    assert_eq!(d.stop().await, 0, "connections cut at stop");
}

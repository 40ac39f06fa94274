//! The TCP check: the handshake alone, on probe sockets kept from one probe
//! to the next. Nothing here may change without re-measuring: it is what
//! makes 5,000 probes a second cost HAProxy's CPU (see the README's
//! "Health checking").

use std::io;
use std::net::SocketAddr;
use std::os::fd::AsRawFd;
use std::sync::Mutex;
use std::time::Duration;

use socket2::Socket;
use tokio::net::TcpStream;

use super::{Outcome, classify};
use crate::net;

/// A TCP check the way HAProxy does a plain one: the handshake is the
/// check. `TCP_QUICKACK` is off, so the kernel holds back the last ACK of the
/// handshake, and the connection is reset as soon as the SYN-ACK arrives.
/// The backend's listening socket answered, which is all a connect can
/// prove; the node's application never sees a connection (no accept, no log
/// line, no `TIME_WAIT` on either host), and each probe costs three packets
/// instead of five.
pub(super) async fn connect(
    target: SocketAddr,
    timeout: Duration,
    sockets: &ProbeSockets,
) -> Outcome {
    let socket = match sockets.take(target) {
        Ok(s) => s,
        Err(e) if net::is_local_shortage(&e) => {
            return Outcome::Skipped(format!("cannot create probe socket: {e}"));
        }
        Err(e) => return Outcome::Error(format!("cannot create probe socket: {e}")),
    };
    // The kernel forgets this setting when a connection is dissolved: set it
    // for every probe. It only saves the handshake's last ACK, so a probe
    // that works without it must not fail for it.
    if let Err(e) = socket.set_tcp_quickack(false) {
        tracing::debug!(error = %e, "cannot turn TCP_QUICKACK off on a probe socket");
    }
    if let Err(e) = net::start_connect(&socket, target) {
        sockets.give_back(socket, target);
        return classify(e);
    }
    // Registered for this probe only: tokio's readiness of a socket never
    // forgets a hang-up, which every dissolved connection leaves behind.
    let stream = match TcpStream::from_std(std::net::TcpStream::from(socket)) {
        Ok(s) => s,
        Err(e) => return classify(e),
    };
    let outcome = match tokio::time::timeout(timeout, net::handshake_done(&stream)).await {
        Ok(Ok(())) => Outcome::Ok,
        Ok(Err(e)) => classify(e),
        Err(_) => Outcome::Timeout,
    };
    if let Ok(socket) = stream.into_std() {
        sockets.give_back(Socket::from(socket), target);
    }
    outcome
}

/// Idle probe sockets kept per address family, at most this many each:
/// more than the probes a host ever has in flight at once.
const MAX_IDLE: usize = 256;

/// Probe sockets kept from one probe to the next.
///
/// A probe's socket is not closed after its check: `connect(AF_UNSPEC)`
/// resets the connection (or abandons a handshake that timed out) and leaves
/// the socket unconnected, its options set, for the next probe to connect
/// anywhere. That saves a `socket`, a `setsockopt` and a `close` per probe,
/// and the kernel's making and tearing down of a socket and its file (see
/// the README's "Health checking" for what it saves). A socket in doubt is
/// closed instead, with a reset (`SO_LINGER` 0).
#[derive(Default)]
pub struct ProbeSockets {
    idle: Mutex<[Vec<Socket>; 2]>,
}

impl ProbeSockets {
    /// An empty set; sockets are made as probes need them.
    pub fn new() -> Self {
        Self::default()
    }

    /// An unconnected socket for `target`'s family: a kept one, or a new one.
    fn take(&self, target: SocketAddr) -> io::Result<Socket> {
        let kept = self.lock()[family(target)].pop();
        match kept {
            Some(socket) => Ok(socket),
            None => {
                let socket = net::tcp_socket_for(target)?;
                socket.set_linger(Some(Duration::ZERO))?;
                Ok(socket)
            }
        }
    }

    /// Dissolves whatever connection `socket` (taken for `target`) has and
    /// keeps it for the next probe; closes it if it cannot be dissolved or
    /// enough are kept.
    fn give_back(&self, socket: Socket, target: SocketAddr) {
        if let Err(e) = crate::os::tcp_disconnect(socket.as_raw_fd()) {
            tracing::debug!(error = %e, "cannot dissolve a probe connection; closing its socket");
            return;
        }
        let mut idle = self.lock();
        let kept = &mut idle[family(target)];
        if kept.len() < MAX_IDLE {
            kept.push(socket);
        }
    }

    /// How many sockets are kept now.
    pub fn idle(&self) -> usize {
        self.lock().iter().map(Vec::len).sum()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, [Vec<Socket>; 2]> {
        self.idle.lock().unwrap_or_else(|p| p.into_inner())
    }
}

fn family(target: SocketAddr) -> usize {
    usize::from(target.is_ipv6())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::CheckKind;
    use crate::dataplane::health::check::probe;

    /// A listening port and a closed one on `ip`.
    fn open_and_closed(ip: &str) -> (std::net::TcpListener, SocketAddr) {
        let listener = std::net::TcpListener::bind((ip, 0)).unwrap();
        listener.set_nonblocking(true).unwrap();
        let closed = std::net::TcpListener::bind((ip, 0)).unwrap();
        let down = closed.local_addr().unwrap();
        (listener, down)
    }

    #[tokio::test]
    async fn one_socket_per_family_serves_probe_after_probe_and_the_target_never_sees_a_connection()
    {
        let targets = [open_and_closed("127.0.0.1"), open_and_closed("::1")];
        let sockets = ProbeSockets::new();
        let timeout = Duration::from_secs(5);
        for round in 0..20 {
            for (listener, down) in &targets {
                let up = listener.local_addr().unwrap();
                let (outcome, _) = probe(&CheckKind::TcpConnect, up, timeout, &sockets).await;
                assert_eq!(outcome, Outcome::Ok, "round {round}, open port {up}");
                let (outcome, _) = probe(&CheckKind::TcpConnect, *down, timeout, &sockets).await;
                assert_eq!(
                    outcome,
                    Outcome::Refused,
                    "round {round}, closed port {down}"
                );
            }
            assert_eq!(sockets.idle(), 2, "round {round}: sockets kept");
        }
        // Every handshake was reset before its last ACK, the reused sockets'
        // included: nothing ever reached an accept queue.
        for (listener, _) in &targets {
            let accepted = listener.accept();
            assert!(
                accepted
                    .as_ref()
                    .is_err_and(|e| e.kind() == io::ErrorKind::WouldBlock),
                "the target accepted {accepted:?}"
            );
        }
    }

    #[tokio::test]
    async fn a_socket_whose_probe_timed_out_serves_the_next_probe() {
        // A listener with a full accept queue: the kernel drops further
        // SYNs, so a handshake with it times out.
        let hole = Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None).unwrap();
        hole.bind(&"127.0.0.1:0".parse::<SocketAddr>().unwrap().into())
            .unwrap();
        hole.listen(0).unwrap();
        let silent = hole.local_addr().unwrap().as_socket().unwrap();
        let mut fillers = Vec::new();
        while let Ok(s) = std::net::TcpStream::connect_timeout(&silent, Duration::from_millis(200))
        {
            fillers.push(s);
            assert!(fillers.len() < 1000, "{silent} keeps accepting");
        }
        let (listener, _) = open_and_closed("127.0.0.1");
        let up = listener.local_addr().unwrap();
        let sockets = ProbeSockets::new();
        for round in 0..3 {
            let (outcome, took) = probe(
                &CheckKind::TcpConnect,
                silent,
                Duration::from_millis(300),
                &sockets,
            )
            .await;
            assert_eq!(outcome, Outcome::Timeout, "round {round}, after {took:?}");
            assert_eq!(
                sockets.idle(),
                1,
                "round {round}: the abandoned socket is kept"
            );
            let (outcome, _) =
                probe(&CheckKind::TcpConnect, up, Duration::from_secs(5), &sockets).await;
            assert_eq!(
                outcome,
                Outcome::Ok,
                "round {round}: the kept socket connects anew"
            );
            assert_eq!(sockets.idle(), 1, "round {round}");
        }
    }
}

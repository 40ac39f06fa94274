//! What one probe does. [`CheckKind`] is the seam: today a TCP connect, next
//! an HTTP GET of kube-proxy's `healthCheckNodePort` for
//! `externalTrafficPolicy: Local`; the prober does not care which.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use socket2::Socket;
use tokio::time::Instant;

use crate::config::CheckKind;
use crate::net;

/// How a probe ended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The check passed.
    Ok,
    /// The backend actively refused (RST): a failure at once.
    Refused,
    /// No answer within the timeout.
    Timeout,
    /// Any other failure (unreachable, reset…), with the OS's words.
    Error(String),
    /// No probe was sent: this process is out of descriptors or socket
    /// memory. Says nothing about the backend, so it changes no verdict.
    Skipped(String),
}

impl Outcome {
    /// Whether the probe says anything about the backend.
    pub fn is_conclusive(&self) -> bool {
        !matches!(self, Outcome::Skipped(_))
    }

    /// Whether this counts as a success.
    pub fn is_success(&self) -> bool {
        matches!(self, Outcome::Ok)
    }

    /// The `result` label value and the `reason` in transition logs.
    pub fn label(&self) -> &'static str {
        match self {
            Outcome::Ok => "ok",
            Outcome::Refused => "refused",
            Outcome::Timeout => "timeout",
            Outcome::Error(_) => "error",
            Outcome::Skipped(_) => "skipped",
        }
    }

    /// A human description for `/status`'s `last_error`.
    pub fn describe(&self) -> Option<String> {
        match self {
            Outcome::Ok => None,
            Outcome::Refused => Some("connection refused".into()),
            Outcome::Timeout => Some("timed out".into()),
            Outcome::Error(e) | Outcome::Skipped(e) => Some(e.clone()),
        }
    }
}

/// Runs one probe of `kind` against `target`, bounded by `timeout`.
/// Returns the outcome and how long it took.
pub async fn probe(kind: CheckKind, target: SocketAddr, timeout: Duration) -> (Outcome, Duration) {
    let started = Instant::now();
    let outcome = match kind {
        CheckKind::TcpConnect => tcp_connect(target, timeout).await,
    };
    (outcome, started.elapsed())
}

/// A TCP check the way HAProxy does a plain one: the handshake is the
/// check. `TCP_QUICKACK` is off, so the kernel holds back the last ACK of the
/// handshake, and the socket is closed with a reset (`SO_LINGER` 0) as soon
/// as the SYN-ACK arrives. The backend's listening socket answered, which is
/// all a connect can prove; the node's application never sees a connection
/// (no accept, no log line, no `TIME_WAIT` on either host), and each probe
/// costs three packets instead of five.
async fn tcp_connect(target: SocketAddr, timeout: Duration) -> Outcome {
    let socket = match new_probe_socket(target) {
        Ok(s) => s,
        Err(e) if net::is_local_shortage(&e) => {
            return Outcome::Skipped(format!("cannot create probe socket: {e}"));
        }
        Err(e) => return Outcome::Error(format!("cannot create probe socket: {e}")),
    };
    match tokio::time::timeout(timeout, net::connect(socket, target)).await {
        // Dropping the stream closes it with a reset.
        Ok(Ok(_stream)) => Outcome::Ok,
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => Outcome::Refused,
        Ok(Err(e)) if net::is_local_shortage(&e) => {
            Outcome::Skipped(format!("cannot connect probe socket: {e}"))
        }
        Ok(Err(e)) => Outcome::Error(e.to_string()),
        Err(_) => Outcome::Timeout,
    }
}

fn new_probe_socket(target: SocketAddr) -> io::Result<Socket> {
    let socket = net::tcp_socket_for(target)?;
    socket.set_linger(Some(Duration::ZERO))?;
    // Only saves the handshake's last ACK: a probe that works without it
    // must not fail for it.
    if let Err(e) = socket.set_tcp_quickack(false) {
        tracing::debug!(error = %e, "cannot turn TCP_QUICKACK off on a probe socket");
    }
    Ok(socket)
}

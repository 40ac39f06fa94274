//! What one probe does. [`CheckKind`] is the seam, matched here once: a TCP
//! handshake (`tcp.rs`) or an HTTP `GET` of kube-proxy's `healthCheckNodePort`
//! for `externalTrafficPolicy: Local` (`http.rs`). The prober does not care
//! which: it gets an [`Outcome`] and a duration either way.

mod http;
mod tcp;

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::time::Instant;

pub use tcp::ProbeSockets;

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
    /// An HTTP check got a well-formed answer whose status is not one of
    /// `expect_status`: kube-proxy's 503 for a node without a ready
    /// endpoint lands here.
    HttpStatus {
        /// The status received.
        status: u16,
        /// What `/status` and the log say: the status, its reason phrase
        /// and what was expected.
        detail: String,
    },
    /// An HTTP check got no usable answer: the connection closed before a
    /// complete response head, or the head was malformed or too large.
    HttpError(String),
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
            Outcome::HttpStatus { .. } => "http_status",
            Outcome::HttpError(_) => "http_error",
        }
    }

    /// A human description for `/status`'s `last_error`.
    pub fn describe(&self) -> Option<String> {
        match self {
            Outcome::Ok => None,
            Outcome::Refused => Some("connection refused".into()),
            Outcome::Timeout => Some("timed out".into()),
            Outcome::Error(e) | Outcome::Skipped(e) | Outcome::HttpError(e) => Some(e.clone()),
            Outcome::HttpStatus { detail, .. } => Some(detail.clone()),
        }
    }
}

/// Runs one probe of `kind` against `target`, bounded by `timeout` (connect
/// and answer together), with a socket from `sockets` where the kind reuses
/// sockets. Returns the outcome and how long it took to know it (an HTTP
/// probe reads the rest of the answer after that, within the same timeout).
pub async fn probe(
    kind: &CheckKind,
    target: SocketAddr,
    timeout: Duration,
    sockets: &ProbeSockets,
) -> (Outcome, Duration) {
    let started = Instant::now();
    let (outcome, known) = match kind {
        CheckKind::TcpConnect => (tcp::connect(target, timeout, sockets).await, Instant::now()),
        CheckKind::Http(check) => http::get(check, target, timeout).await,
    };
    (outcome, known.duration_since(started))
}

/// The outcome of a connect that failed with `e`: refused, the daemon's own
/// shortage (skipped: nothing learned about the backend), or another error.
fn classify(e: io::Error) -> Outcome {
    if e.kind() == io::ErrorKind::ConnectionRefused {
        Outcome::Refused
    } else if net::is_local_shortage(&e) {
        Outcome::Skipped(format!("cannot connect probe socket: {e}"))
    } else {
        Outcome::Error(e.to_string())
    }
}

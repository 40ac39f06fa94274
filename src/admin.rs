//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`, `/status`,
//! `/status.html`, `POST /reload`, and on the Unix socket only `POST /backends/state` and
//! `POST /announce/state`.
//!
//! Two listeners, one service. The TCP listener (`admin.listen`) is open to
//! every process on the host, `hostNetwork` pods included, so it serves
//! only what reads the state, and `POST /reload` (which re-reads the
//! root-owned file, nothing a caller chooses). Changing a backend's state is
//! served on the Unix socket (`admin.socket`, mode 0600 in a 0700
//! directory) alone, like HAProxy's `stats socket … level admin`: who may
//! drain a node is decided by file permissions, not by who can reach
//! loopback.
//!
//! It runs on its own listener, bounded in every way a hostile or broken
//! client could push it (connections, header size, time to send headers,
//! time to serve a request), and it never blocks the forwarder: the only
//! shared things it touches are the live objects' metrics and a short read
//! of the daemon's state. `/healthz` and `/readyz` must answer whatever any local
//! user does to `admin.listen` (keepalived moves VIPs on them): they need
//! no slot, and idle connections are shed for newcomers at the cap.
//!
//! Four parts (three by what each guards, and the page):
//!
//! * `connections`: the bounds of each listener (connection cap, shedding
//!   of idle connections for newcomers, request slots, head size and
//!   timeouts) and its accept loop.
//! * `routes`: what each path answers, and which requests only the socket
//!   may make.
//! * `page`: the status page, `/status` rendered as HTML, paged.
//! * `socket`: the Unix socket's trust and binding ([`AdminSocket`],
//!   [`check_socket_trust`]).
//!
//! The command line's side of the API (the admin client) is in the binary,
//! `src/cli/admin_client.rs`; it checks the socket with
//! [`check_socket_trust`] before it sends anything. A reload requested here
//! goes to the server's reload loop ([`crate::server::ReloadRequest`]).

use std::io;
use std::sync::Arc;

use http_body_util::{Either, Full};
use hyper::body::Bytes;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::TcpListener;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

use crate::daemon::Daemon;
use crate::metrics::exposition::ExpositionBody;
use crate::server::ReloadRequest;

mod connections;
mod page;
mod routes;
mod socket;

pub use socket::{AdminSocket, SocketError, check_socket_trust, daemon_trusts};

/// A response body: a short text or JSON, or `/metrics` written as it is sent.
type Body = Either<Full<Bytes>, ExpositionBody>;

/// Which listener a request came in on, and so what it may do.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Origin {
    /// `admin.listen`: any process on the host. Read-only endpoints and
    /// `POST /reload`.
    Tcp,
    /// `admin.socket`: whoever the socket's mode lets in (root). Everything.
    Socket,
}

/// A listener the admin server accepts on.
trait AdminListener: Send + 'static {
    type Stream: AsyncRead + AsyncWrite + Unpin + Send + 'static;
    const ORIGIN: Origin;
    /// Its config key, for the log.
    const DESCRIPTION: &'static str;
    /// The next connection, with a description of its peer for the log.
    fn next(&self) -> impl std::future::Future<Output = io::Result<(Self::Stream, String)>> + Send;
}

impl AdminListener for TcpListener {
    type Stream = tokio::net::TcpStream;
    const ORIGIN: Origin = Origin::Tcp;
    const DESCRIPTION: &'static str = "admin.listen";
    async fn next(&self) -> io::Result<(Self::Stream, String)> {
        let (s, peer) = self.accept().await?;
        Ok((s, peer.to_string()))
    }
}

impl AdminListener for AdminSocket {
    type Stream = tokio::net::UnixStream;
    const ORIGIN: Origin = Origin::Socket;
    const DESCRIPTION: &'static str = "admin.socket";
    async fn next(&self) -> io::Result<(Self::Stream, String)> {
        self.accept().await
    }
}

/// Serves the admin API on the TCP listener until `stop` is cancelled:
/// everything but state changes.
pub async fn serve(
    listener: TcpListener,
    daemon: Arc<Daemon>,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
) {
    connections::serve_on(listener, daemon, reload, stop).await
}

/// Serves the admin API on the Unix socket until `stop` is cancelled:
/// everything, state changes included.
pub async fn serve_socket(
    socket: AdminSocket,
    daemon: Arc<Daemon>,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
) {
    connections::serve_on(socket, daemon, reload, stop).await
}

//! The command line's one way to the daemon's admin API: hyper's HTTP/1.1
//! client over the admin Unix socket, and over TCP (`admin.listen`) for
//! `status` alone. It lives in the binary: the daemon never calls it; the
//! trust check it applies to the socket is the library's
//! ([`check_socket_trust`]), with the command line's own idea of whom to
//! trust ([`client_trusts`]).
//!
//! One rule for where a request goes, the same for every command:
//!
//! * Everything goes to the admin socket first, after
//!   [`check_socket_trust`] with [`client_trusts`]: a socket that another
//!   user could have put there is never sent to.
//! * A request that changes state (`reload`, `backend drain|maint|ready`:
//!   [`request`]) goes **only** there. `admin.listen` is open to every local
//!   user, who could bind that port before the daemon and answer "done";
//!   when the socket cannot be reached the caller says so ([`Unreachable`])
//!   and nothing else is tried.
//! * `GET /status` ([`status`]) may fall back to `admin.listen`, and only
//!   when the socket is missing, refused or not permitted (the read-only TCP
//!   listener serves the same JSON); the answer then carries a note saying
//!   where it came from, for stderr. An untrusted socket is an error, not a
//!   reason to ask TCP instead, and so is a daemon that accepts on the
//!   socket but does not answer (hung). With `--socket` no `admin.listen`
//!   is known and only the socket is asked.
//! * Where the socket is comes from `--socket` or the config file's
//!   `admin.socket` alone (`harvester_lb::config::admin_endpoints`), so a
//!   file the daemon rejected still leads to it.
//!
//! Every call runs on its own one-thread runtime under a deadline, so a
//! wedged daemon cannot hang the caller.

use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::header::{CONTENT_TYPE, HOST};
use hyper::{Method, Request, StatusCode};
use hyper_util::rt::TokioIo;
use tokio::io::{AsyncRead, AsyncWrite};

use harvester_lb::admin::{SocketError, check_socket_trust, daemon_trusts};

/// systemd's range of `DynamicUser=` ids (the shipped unit runs the daemon
/// as one, and `RuntimeDirectory=` gives that user `/run/harvester-lb`).
const DYNAMIC_USERS: std::ops::RangeInclusive<u32> = 61184..=65519;

/// Who may own the admin socket and its directories for the CLI: root, the
/// caller, and a systemd dynamic user (the daemon under the shipped unit);
/// no ordinary account.
pub fn client_trusts(uid: u32) -> bool {
    daemon_trusts(uid) || DYNAMIC_USERS.contains(&uid)
}

/// How long a state-changing request waits for the daemon's answer (a
/// reload of a large file takes a fraction of a second; a wedged daemon
/// must not hang the caller).
pub const ANSWER_TIMEOUT: Duration = Duration::from_secs(60);
/// How long `status` waits for the daemon, on each way it tries.
pub const STATUS_TIMEOUT: Duration = Duration::from_secs(10);

/// The daemon's answer: its HTTP status and body.
#[derive(Debug)]
pub struct Answer {
    /// The HTTP status.
    pub status: StatusCode,
    /// The body, as text (lossy UTF-8).
    pub body: String,
}

/// The admin socket could not be reached, or is not to be trusted; nothing
/// else was asked. Its text says why in the operator's terms.
#[derive(Debug, thiserror::Error)]
#[error("{}", describe(.socket, .source))]
pub struct Unreachable {
    /// The socket that was tried.
    pub socket: PathBuf,
    /// What connecting (or the trust check) said.
    pub source: io::Error,
}

/// Why `status` could not be read.
#[derive(Debug, thiserror::Error)]
pub enum StatusError {
    /// The socket answered, but not with success.
    #[error("/status answered {status}: {}", .body.trim_end())]
    Refused {
        /// The HTTP status.
        status: StatusCode,
        /// The body.
        body: String,
    },
    /// The socket cannot be used, and TCP is not tried: it is not
    /// trusted, the daemon did not answer on it (hung), or no
    /// `admin.listen` is known (`--socket`).
    #[error(transparent)]
    Socket(#[from] Unreachable),
    /// Neither the socket nor `admin.listen` could be reached.
    #[error("cannot reach the daemon's admin API: {}; nor at admin.listen {listen}: {source}", describe(.socket, .socket_error))]
    Nowhere {
        /// `admin.listen`.
        listen: SocketAddr,
        /// The socket.
        socket: PathBuf,
        /// What the socket said.
        socket_error: io::Error,
        /// What TCP said.
        source: io::Error,
    },
    /// `admin.listen` answered, but not 200.
    #[error("/status at {listen} answered: {line}")]
    ListenRefused {
        /// `admin.listen`.
        listen: SocketAddr,
        /// Its status line (`HTTP/1.1 503 Service Unavailable`).
        line: String,
    },
}

/// `GET /status`'s JSON, and where it came from.
#[derive(Debug)]
pub struct Status {
    /// The JSON text.
    pub body: String,
    /// When it came from `admin.listen`: a note saying so and why (for
    /// stderr: whoever binds that port first could have answered).
    pub note: Option<String>,
}

/// One request on the admin socket only (what every state-changing command
/// uses), waiting at most [`ANSWER_TIMEOUT`].
pub fn request(
    socket: &Path,
    method: Method,
    path: &str,
    body: String,
) -> Result<Answer, Unreachable> {
    block_on(socket_request(socket, method, path, body, ANSWER_TIMEOUT)).map_err(|source| {
        Unreachable {
            socket: socket.to_path_buf(),
            source,
        }
    })
}

/// `GET /status` from the daemon: on the admin socket when it can be
/// opened, else on `admin.listen` when it is known (see the module's rule).
pub fn status(listen: Option<SocketAddr>, socket: &Path) -> Result<Status, StatusError> {
    let answer = block_on(socket_request(
        socket,
        Method::GET,
        "/status",
        String::new(),
        STATUS_TIMEOUT,
    ));
    let why = match answer {
        Ok(a) if a.status.is_success() => {
            return Ok(Status {
                body: a.body,
                note: None,
            });
        }
        Ok(a) => {
            return Err(StatusError::Refused {
                status: a.status,
                body: a.body,
            });
        }
        // Absent, stale, or not ours to open (mode 0600): the TCP listener
        // serves /status too.
        Err(e)
            if matches!(
                e.kind(),
                io::ErrorKind::NotFound
                    | io::ErrorKind::ConnectionRefused
                    | io::ErrorKind::PermissionDenied
            ) =>
        {
            e
        }
        Err(source) => {
            return Err(StatusError::Socket(Unreachable {
                socket: socket.to_path_buf(),
                source,
            }));
        }
    };
    // `--socket`, or an unusable admin.listen: the socket's answer is all.
    let Some(listen) = listen else {
        return Err(StatusError::Socket(Unreachable {
            socket: socket.to_path_buf(),
            source: why,
        }));
    };
    let note = format!(
        "read from admin.listen {listen} (open to every local user), not the admin socket {} ({why})",
        socket.display()
    );
    let exchange = async {
        let stream = tokio::net::TcpStream::connect(listen).await?;
        exchange(
            stream,
            Method::GET,
            "/status",
            &listen.to_string(),
            String::new(),
        )
        .await
    };
    let answer = match block_on(within(STATUS_TIMEOUT, exchange)) {
        Ok(a) => a,
        Err(source) => {
            return Err(StatusError::Nowhere {
                listen,
                socket: socket.to_path_buf(),
                socket_error: why,
                source,
            });
        }
    };
    if answer.status == StatusCode::OK {
        Ok(Status {
            body: answer.body,
            note: Some(note),
        })
    } else {
        Err(StatusError::ListenRefused {
            listen,
            line: format!("HTTP/1.1 {}", answer.status),
        })
    }
}

/// One request to the admin API over its Unix socket. An `Err` means the
/// daemon could not be reached or stopped answering within `timeout`, or
/// that the socket is not to be trusted ([`check_socket_trust`] with
/// [`client_trusts`]: kind `Other`, a [`SocketError`] inside), and then
/// nothing was sent.
pub async fn socket_request(
    socket: &Path,
    method: Method,
    path: &str,
    body: String,
    timeout: Duration,
) -> io::Result<Answer> {
    // A socket another user could have put there is not the daemon's.
    check_socket_trust(socket, client_trusts).map_err(|e| match e {
        SocketError::Io { source, .. } => source,
        untrusted => io::Error::other(untrusted),
    })?;
    within(timeout, async {
        let stream = tokio::net::UnixStream::connect(socket).await?;
        exchange(stream, method, path, "localhost", body).await
    })
    .await
}

/// One HTTP/1.1 exchange on a connected stream through hyper's client.
async fn exchange<S>(
    stream: S,
    method: Method,
    path: &str,
    host: &str,
    body: String,
) -> io::Result<Answer>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
{
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .map_err(io::Error::other)?;
    let conn = tokio::spawn(conn);
    let request = Request::builder()
        .method(method)
        .uri(path)
        .header(HOST, host)
        .header(CONTENT_TYPE, "application/json")
        .body(Full::new(Bytes::from(body)))
        .map_err(io::Error::other)?;
    let response = sender
        .send_request(request)
        .await
        .map_err(io::Error::other)?;
    let status = response.status();
    let bytes = response
        .into_body()
        .collect()
        .await
        .map_err(io::Error::other)?
        .to_bytes();
    conn.abort();
    Ok(Answer {
        status,
        body: String::from_utf8_lossy(&bytes).into_owned(),
    })
}

/// `exchange` under a deadline: past it, `TimedOut`.
async fn within(
    timeout: Duration,
    exchange: impl Future<Output = io::Result<Answer>>,
) -> io::Result<Answer> {
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ))
        })
}

/// Runs one call on a fresh one-thread runtime (the CLI has no other).
fn block_on<T>(call: impl Future<Output = io::Result<T>>) -> io::Result<T> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?
        .block_on(call)
}

/// Why the admin socket could not be reached, in the operator's terms.
fn describe(socket: &Path, e: &io::Error) -> String {
    let shown = socket.display();
    match e.kind() {
        io::ErrorKind::NotFound => format!(
            "no admin socket at {shown}: the daemon is not running (`systemctl status harvester-lb` says why), or it runs with another admin.socket (pass --socket PATH, or --config FILE with that admin.socket)"
        ),
        io::ErrorKind::ConnectionRefused => format!(
            "the admin socket {shown} is stale: nothing listens on it, so the daemon that made it died or was killed before it could remove it; `systemctl status harvester-lb` and `journalctl -u harvester-lb` say why, `systemctl start harvester-lb` starts it again (it replaces the stale file)"
        ),
        io::ErrorKind::PermissionDenied => format!(
            "permission denied on the admin socket {shown}: only root and the daemon's own user may use it (mode 0600 in a 0700 directory); run the command as root (sudo)"
        ),
        io::ErrorKind::TimedOut => format!(
            "the daemon did not answer on its admin socket {shown} ({e}): it is hung or overloaded; `systemctl status harvester-lb` and `journalctl -u harvester-lb -n 50` show what it does, `systemctl restart harvester-lb` restarts it"
        ),
        _ => match e
            .get_ref()
            .and_then(|inner| inner.downcast_ref::<SocketError>())
        {
            Some(untrusted) => format!("{untrusted}; nothing was sent"),
            None => format!("cannot reach the daemon's admin socket {shown}: {e}"),
        },
    }
}

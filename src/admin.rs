//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`, `/status`,
//! `POST /reload`, and on the Unix socket only `POST /backends/state`.
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
//! client could push it (connections, header size, time to send headers), and
//! it never blocks the forwarder: the only shared things it touches are the
//! metric registry and a short read of the daemon's state.

use std::convert::Infallible;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::{Bytes, Incoming};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{Semaphore, mpsc, oneshot};
use tokio_util::sync::CancellationToken;

use crate::balancer::AdminState;
use crate::daemon::{AdminStateError, Daemon};
use crate::metrics::exposition::ExpositionBody;

/// A response body: a short text or JSON, or `/metrics` written as it is sent.
type Body = Either<Full<Bytes>, ExpositionBody>;

/// Admin connections served at once; more wait in the kernel's backlog.
const MAX_CONNECTIONS: usize = 64;
/// Largest request head accepted (hyper answers 431 beyond it).
const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Time a client gets to send its request head.
const HEADER_TIMEOUT: Duration = Duration::from_secs(5);

/// Largest `POST /backends/state` body accepted; a valid one is ~100 bytes.
const MAX_BODY_BYTES: usize = 4096;

/// A request to reload the config, answered with the outcome.
pub type ReloadRequest = oneshot::Sender<Result<String, String>>;

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
    /// The next connection, with a description of its peer for the log.
    fn next(&self) -> impl std::future::Future<Output = io::Result<(Self::Stream, String)>> + Send;
}

impl AdminListener for TcpListener {
    type Stream = tokio::net::TcpStream;
    const ORIGIN: Origin = Origin::Tcp;
    async fn next(&self) -> io::Result<(Self::Stream, String)> {
        let (s, peer) = self.accept().await?;
        Ok((s, peer.to_string()))
    }
}

impl AdminListener for AdminSocket {
    type Stream = tokio::net::UnixStream;
    const ORIGIN: Origin = Origin::Socket;
    async fn next(&self) -> io::Result<(Self::Stream, String)> {
        let (s, _) = self.listener.accept().await?;
        // Who changed a backend's state goes into the log.
        let peer = match s.peer_cred() {
            Ok(c) => format!(
                "unix socket, pid {} uid {}",
                c.pid().map_or_else(|| "?".to_string(), |p| p.to_string()),
                c.uid()
            ),
            Err(_) => "unix socket".to_string(),
        };
        Ok((s, peer))
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
    serve_on(listener, daemon, reload, stop).await
}

/// Serves the admin API on the Unix socket until `stop` is cancelled:
/// everything, state changes included.
pub async fn serve_socket(
    socket: AdminSocket,
    daemon: Arc<Daemon>,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
) {
    serve_on(socket, daemon, reload, stop).await
}

async fn serve_on<L: AdminListener>(
    listener: L,
    daemon: Arc<Daemon>,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
) {
    let slots = Arc::new(Semaphore::new(MAX_CONNECTIONS));
    loop {
        let Ok(permit) = Arc::clone(&slots).acquire_owned().await else {
            return;
        };
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = listener.next() => r,
        };
        let (stream, peer) = match accepted {
            Ok(a) => a,
            Err(e) => {
                tracing::debug!(error = %e, "admin accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        let daemon = Arc::clone(&daemon);
        let reload = reload.clone();
        let stop = stop.clone();
        tokio::spawn(async move {
            let _permit = permit;
            let peer = Arc::new(peer);
            let peer_in_service = Arc::clone(&peer);
            let service = hyper::service::service_fn(move |req| {
                let daemon = Arc::clone(&daemon);
                let reload = reload.clone();
                let peer = Arc::clone(&peer_in_service);
                async move { Ok::<_, Infallible>(route(req, &daemon, &reload, L::ORIGIN, &peer).await) }
            });
            let conn = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                r = conn.as_mut() => if let Err(e) = r {
                    tracing::debug!(client = %peer, error = %e, "admin connection ended with an error");
                },
                _ = stop.cancelled() => {}
            }
        });
    }
}

async fn route(
    req: Request<Incoming>,
    daemon: &Daemon,
    reload: &mpsc::Sender<ReloadRequest>,
    origin: Origin,
    peer: &str,
) -> Response<Body> {
    let path = req.uri().path().to_string();
    let path = path.as_str();
    let allowed: &str = match path {
        "/metrics" | "/healthz" | "/readyz" | "/status" => "GET, HEAD",
        "/reload" => "POST",
        "/backends/state" if origin == Origin::Tcp => {
            return json_error(
                StatusCode::FORBIDDEN,
                "backend state changes are served only on the admin Unix socket (admin.socket, default /run/harvester-lb/admin.sock), not on admin.listen; use `harvester-lb backend drain|ready|maint --lb NAME ADDRESS` or `curl --unix-socket`",
            );
        }
        "/backends/state" => "POST",
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                match origin {
                    Origin::Tcp => {
                        "not found; try /metrics, /healthz, /readyz, /status or POST /reload\n"
                    }
                    Origin::Socket => {
                        "not found; try /metrics, /healthz, /readyz, /status, POST /reload or POST /backends/state\n"
                    }
                },
            );
        }
    };
    let method_ok = match *req.method() {
        Method::GET | Method::HEAD => allowed.contains("GET"),
        Method::POST => allowed == "POST",
        _ => false,
    };
    if !method_ok {
        let mut resp = text(
            StatusCode::METHOD_NOT_ALLOWED,
            &format!("method not allowed; use {allowed}\n"),
        );
        resp.headers_mut()
            .insert(ALLOW, allowed.parse().expect("static header value"));
        return resp;
    }
    match path {
        "/metrics" => {
            // Counting descriptors can take a while on older kernels: on a
            // blocking thread, not on a worker the data plane shares.
            let open_fds = tokio::task::spawn_blocking(crate::os::open_fds)
                .await
                .ok()
                .flatten();
            let body = ExpositionBody::from(daemon.metrics().exposition().with_open_fds(open_fds));
            let mut resp = Response::new(Either::Right(body));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                "text/plain; version=0.0.4; charset=utf-8"
                    .parse()
                    .expect("static header value"),
            );
            resp
        }
        "/healthz" => text(StatusCode::OK, "ok\n"),
        "/readyz" => {
            if daemon.is_ready() {
                text(StatusCode::OK, "ready\n")
            } else {
                let failed = daemon.failed_listeners();
                let mut body = String::from(if daemon.is_stopping() {
                    "stopping\n"
                } else {
                    "not ready\n"
                });
                for (addr, why) in failed {
                    body.push_str(&format!("listener {addr}: {why}\n"));
                }
                text(StatusCode::SERVICE_UNAVAILABLE, &body)
            }
        }
        "/status" => {
            let body = serde_json::to_vec_pretty(&daemon.status())
                .unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}").into_bytes());
            let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body))));
            resp.headers_mut().insert(
                CONTENT_TYPE,
                "application/json".parse().expect("static header value"),
            );
            resp
        }
        "/reload" => {
            let (tx, rx) = oneshot::channel();
            if reload.send(tx).await.is_err() {
                return text(StatusCode::SERVICE_UNAVAILABLE, "the daemon is stopping\n");
            }
            match rx.await {
                Ok(Ok(summary)) => text(StatusCode::OK, &format!("{summary}\n")),
                Ok(Err(problems)) => {
                    text(StatusCode::UNPROCESSABLE_ENTITY, &format!("{problems}\n"))
                }
                Err(_) => text(StatusCode::SERVICE_UNAVAILABLE, "the daemon is stopping\n"),
            }
        }
        "/backends/state" => set_state(req, daemon, peer).await,
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// The body of `POST /backends/state`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct StateRequest {
    /// `<namespace>/<service>`.
    load_balancer: String,
    /// The backend's address, as in the config.
    backend: String,
    /// `ready`, `drain` or `maint`.
    state: String,
}

/// What a valid body looks like, for error messages.
const STATE_BODY_SHAPE: &str = r#"{"load_balancer": "<namespace>/<service>", "backend": "<address>", "state": "ready|drain|maint"}"#;

async fn set_state(req: Request<Incoming>, daemon: &Daemon, peer: &str) -> Response<Body> {
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body (at most {MAX_BODY_BYTES} bytes): {e}"),
            );
        }
    };
    let request: StateRequest = match serde_json::from_slice(&body) {
        Ok(r) => r,
        Err(e) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!("bad request body: {e}; expected {STATE_BODY_SHAPE}"),
            );
        }
    };
    let Some(state) = AdminState::parse(&request.state) else {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!(
                "state {:?} is not one of \"ready\", \"drain\", \"maint\"",
                request.state
            ),
        );
    };
    let Ok(addr) = request.backend.trim().parse::<IpAddr>() else {
        return json_error(
            StatusCode::BAD_REQUEST,
            &format!(
                "backend {:?} is not an IP address; name the backend as in the config, e.g. \"10.52.0.11\"",
                request.backend
            ),
        );
    };
    // As the config does: an IPv4-mapped address is the IPv4 node.
    let addr = addr.to_canonical();
    match daemon.set_admin_state(&request.load_balancer, addr, state) {
        Ok(change) => {
            tracing::info!(
                load_balancer = %request.load_balancer,
                backend = %addr,
                from = %change.previous,
                to = %change.state,
                peer,
                "admin state set through the admin socket"
            );
            json(
                StatusCode::OK,
                &serde_json::json!({
                    "load_balancer": request.load_balancer,
                    "backend": addr,
                    "state": change.state,
                    "previous_state": change.previous,
                }),
            )
        }
        Err(e @ (AdminStateError::UnknownLoadBalancer(_) | AdminStateError::NotAMember { .. })) => {
            json_error(StatusCode::NOT_FOUND, &e.to_string())
        }
    }
}

fn json(status: StatusCode, value: &serde_json::Value) -> Response<Body> {
    let mut body = serde_json::to_vec(value).unwrap_or_else(|_| b"{}".to_vec());
    body.push(b'\n');
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        "application/json".parse().expect("static header value"),
    );
    resp
}

fn json_error(status: StatusCode, message: &str) -> Response<Body> {
    json(status, &serde_json::json!({ "error": message }))
}

/// Why the admin socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another process answers on the socket: a second daemon must not take
    /// it over (its operators would drain the wrong daemon's backends).
    #[error(
        "admin.socket {0}: another process is serving it (is harvester-lb already running?); stop it or set another admin.socket"
    )]
    InUse(PathBuf),
    /// Something that is not a socket sits at the path; it is not removed.
    #[error(
        "admin.socket {0}: a file that is not a socket is in the way; remove it or set another admin.socket"
    )]
    NotASocket(PathBuf),
    /// A directory on the way to the socket, or the socket file itself,
    /// belongs to another user or lets others write into it: that user
    /// could replace the socket with one of their own, and the operator's
    /// `backend drain` would be answered by them.
    #[error(
        "admin.socket {socket}: {what} {path} is {why} (owner uid {owner}, mode {mode:04o}); another user could replace the socket and answer for the daemon. Use a directory owned by root (or the daemon's own user) that only its owner can write, such as /run/harvester-lb (systemd's RuntimeDirectory=)"
    )]
    Untrusted {
        /// The socket's path.
        socket: PathBuf,
        /// "its directory", "the directory above it" or "the socket file".
        what: &'static str,
        /// The directory or file at fault.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
        /// Its owner.
        owner: u32,
        /// Its permission bits (with the sticky bit).
        mode: u32,
    },
    /// Creating, binding or securing the socket failed.
    #[error("admin.socket {path}: cannot {what}: {source}")]
    Io {
        /// The path from `admin.socket`.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// What the OS said.
        source: io::Error,
    },
}

/// Who may own the admin socket's directories for the daemon: root and the
/// daemon's own user.
pub fn daemon_trusts(uid: u32) -> bool {
    uid == 0 || uid == crate::os::effective_uid()
}

/// systemd's range of `DynamicUser=` ids (the shipped unit runs the daemon
/// as one, and `RuntimeDirectory=` gives that user `/run/harvester-lb`).
const DYNAMIC_USERS: std::ops::RangeInclusive<u32> = 61184..=65519;

/// Who may own the admin socket and its directories for the CLI: root, the
/// caller, and a systemd dynamic user (the daemon under the shipped unit);
/// no ordinary account.
pub fn client_trusts(uid: u32) -> bool {
    daemon_trusts(uid) || DYNAMIC_USERS.contains(&uid)
}

/// Refuses an admin socket that another user could replace: each directory
/// from the socket's own up to `/` must be owned by a user `trusts` and be
/// writable by nobody else (group- or world-writable only with the sticky
/// bit, as `/tmp`, where no one may rename another's file); the socket file,
/// if it exists, must be owned by a user `trusts`. Directories that do not
/// exist yet are skipped (the daemon creates them, 0700, as its own).
/// Symbolic links are resolved first, so the directories checked are the
/// ones the socket is really in. A check, not a lock: it cannot stop root
/// from changing the modes afterwards, which root may do anyway.
pub fn check_socket_trust(socket: &Path, trusts: impl Fn(u32) -> bool) -> Result<(), SocketError> {
    let untrusted = |what, path: &Path, why, meta: &std::fs::Metadata| SocketError::Untrusted {
        socket: socket.to_path_buf(),
        what,
        path: path.to_path_buf(),
        why,
        owner: meta.uid(),
        mode: meta.mode() & 0o7777,
    };
    let io_err = |what: &'static str| {
        let path = socket.to_path_buf();
        move |source| SocketError::Io { path, what, source }
    };
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if !trusts(meta.uid()) => {
            return Err(untrusted(
                "the socket file",
                socket,
                "owned by another user",
                &meta,
            ));
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("inspect the socket file")(e)),
    }
    let parent = match socket.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => p.to_path_buf(),
        None => PathBuf::from("."),
    };
    // The deepest directory that exists, with its links resolved.
    let mut dir = parent.as_path();
    let real = loop {
        match std::fs::canonicalize(dir) {
            Ok(real) => break real,
            Err(e) if e.kind() == io::ErrorKind::NotFound => match dir.parent() {
                Some(up) if !up.as_os_str().is_empty() => dir = up,
                _ => {
                    break std::env::current_dir().map_err(io_err("find the current directory"))?;
                }
            },
            Err(e) => return Err(io_err("inspect its directory")(e)),
        }
    };
    for (i, d) in real.ancestors().enumerate() {
        let meta = std::fs::metadata(d).map_err(io_err("inspect its directory"))?;
        let what = if i == 0 && dir == parent {
            "its directory"
        } else {
            "the directory above it"
        };
        if !trusts(meta.uid()) {
            return Err(untrusted(what, d, "owned by another user", &meta));
        }
        if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
            return Err(untrusted(
                what,
                d,
                "writable by group or others without the sticky bit",
                &meta,
            ));
        }
    }
    Ok(())
}

/// The admin Unix socket, bound, mode 0600. Its file is removed when it is
/// dropped, unless another process has replaced it meanwhile.
pub struct AdminSocket {
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file we made, to remove only ours.
    id: (u64, u64),
    /// `<socket>.lock`, locked (`flock`) while this process runs.
    _lock: std::fs::File,
}

impl AdminSocket {
    /// Binds the admin socket at `path`, mode 0600. A stale socket file (no
    /// process answers on it: a daemon that died) is replaced; a live one
    /// is left alone and is an error. A missing parent directory is created
    /// with mode 0700 (systemd's `RuntimeDirectory=` normally made it).
    ///
    /// The socket is bound under a temporary name, given mode 0600, then
    /// renamed into place: no moment exists at which it is at `path` with
    /// looser permissions.
    pub fn bind(path: &Path) -> Result<Self, SocketError> {
        let io_err = |what: &'static str| {
            let path = path.to_path_buf();
            move |source| SocketError::Io { path, what, source }
        };
        check_socket_trust(path, daemon_trusts)?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.exists()
        {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(io_err("create its directory"))?;
        }
        // One daemon per socket, decided by the kernel rather than by who
        // answers: the lock is held until the process ends, however it
        // ends. The file stays (removing it would let two daemons lock two
        // different files of one name).
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err("open its lock file (the socket's path with .lock)"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(SocketError::InUse(path.to_path_buf()));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(io_err("lock its lock file (the socket's path with .lock)")(
                    e,
                ));
            }
        }
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(SocketError::InUse(path.to_path_buf()));
                }
                tracing::info!(socket = %path.display(), "removing a stale admin socket (no process answers on it)");
                std::fs::remove_file(path).map_err(io_err("remove the stale socket"))?;
            }
            Ok(_) => return Err(SocketError::NotASocket(path.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("inspect the path")(e)),
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let _ = std::fs::remove_file(&tmp);
        let std_listener =
            std::os::unix::net::UnixListener::bind(&tmp).map_err(io_err("bind the socket"))?;
        let secured = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = secured {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err("set mode 0600 and move the socket into place")(e));
        }
        let meta = std::fs::symlink_metadata(path).map_err(io_err("inspect the socket"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(io_err("make the socket non-blocking"))?;
        let listener =
            UnixListener::from_std(std_listener).map_err(io_err("register the socket"))?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            id: (meta.dev(), meta.ino()),
            _lock: lock,
        })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }
}

impl Drop for AdminSocket {
    fn drop(&mut self) {
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id);
        if ours && let Err(e) = std::fs::remove_file(&self.path) {
            tracing::debug!(socket = %self.path.display(), error = %e, "cannot remove the admin socket");
        }
    }
}

fn text(status: StatusCode, body: &str) -> Response<Body> {
    let mut resp = Response::new(Either::Left(Full::new(Bytes::from(body.to_string()))));
    *resp.status_mut() = status;
    resp.headers_mut().insert(
        CONTENT_TYPE,
        "text/plain; charset=utf-8"
            .parse()
            .expect("static header value"),
    );
    resp
}

/// One request to the admin API over its Unix socket (the CLI's way in):
/// HTTP/1.1 through hyper's client on a tokio `UnixStream`. Returns the
/// status and body; an `Err` means the daemon could not be reached or
/// stopped answering within `timeout`, or that the socket is not to be
/// trusted ([`check_socket_trust`] with [`client_trusts`]: kind `Other`,
/// a [`SocketError`] inside), and then nothing was sent.
pub async fn socket_request(
    socket: &Path,
    method: Method,
    path: &str,
    body: String,
    timeout: Duration,
) -> io::Result<(StatusCode, String)> {
    // A socket another user could have put there is not the daemon's.
    check_socket_trust(socket, client_trusts).map_err(|e| match e {
        SocketError::Io { source, .. } => source,
        untrusted => io::Error::other(untrusted),
    })?;
    let exchange = async {
        let stream = tokio::net::UnixStream::connect(socket).await?;
        let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
            .await
            .map_err(io::Error::other)?;
        let conn = tokio::spawn(conn);
        let request = Request::builder()
            .method(method)
            .uri(path)
            .header(hyper::header::HOST, "localhost")
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
        Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
    };
    tokio::time::timeout(timeout, exchange)
        .await
        .unwrap_or_else(|_| {
            Err(io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ))
        })
}

//! The admin HTTP server: `/metrics`, `/healthz`, `/readyz`, `/status`,
//! `POST /reload`, and on the Unix socket only `POST /backends/state` and
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
//! shared things it touches are the metric registry and a short read of the
//! daemon's state. `/healthz` and `/readyz` must answer whatever any local
//! user does to `admin.listen` (keepalived moves VIPs on them): they need
//! no slot, and idle connections are shed for newcomers at the cap.
//!
//! The command line's side of the API is [`client`].

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::io;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::{Bytes, Frame, Incoming, SizeHint};
use hyper::header::{ALLOW, CONTENT_TYPE};
use hyper::{Method, Request, Response, StatusCode};
use hyper_util::rt::{TokioIo, TokioTimer};
use serde::Deserialize;
use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc, oneshot};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use crate::balancer::AdminState;
use crate::daemon::{AdminStateError, AnnounceStateError, Daemon, VipNotReady};
use crate::metrics::exposition::ExpositionBody;

pub mod client;

/// A response body: a short text or JSON, or `/metrics` written as it is sent.
type Body = Either<Full<Bytes>, ExpositionBody>;

/// Connections one admin listener holds open at once. Past it, each
/// newcomer sheds the connection that has waited longest without a request
/// in service (one still sending its head, or idle between requests, or
/// waiting for a slot): idle connections from a local user can never keep
/// a probe out, and the daemon's descriptors stay bounded (both listeners
/// together within the 256 that `os::connections_for` keeps for the daemon
/// itself). Twice [`MAX_SERVING`], so half of them can always be shed.
const MAX_OPEN: usize = 128;
/// Requests other than `/healthz` and `/readyz` in service at once, their
/// responses' bodies included (a stalled reader of `/metrics` holds one);
/// more wait for a slot. Health answers take none: they are a few bytes
/// from a short read of the daemon's state.
const MAX_SERVING: usize = 64;
/// Largest request head accepted (hyper answers 431 beyond it).
const MAX_HEAD_BYTES: usize = 16 * 1024;
/// Time a client gets to send its request head, from the moment the
/// connection is accepted or its last response was sent: a local client
/// sends it at once, an idle or trickling one is closed soon.
const HEADER_TIMEOUT: Duration = Duration::from_secs(2);
/// Time a request may take once its head is in, its response sent
/// included: a client that stops reading gives its slot back then.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);

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
    let conns = Connections::new();
    let slots = Arc::new(Semaphore::new(MAX_SERVING));
    // Sheds since the last warning, and when that was: one line a minute
    // at most says the cap is being hit (the counter has every one).
    let mut shed_since_warning = 0u64;
    let mut last_warning: Option<Instant> = None;
    loop {
        // Never waits for a slot before accepting: a newcomer is taken off
        // the kernel's backlog at once, so a probe is never queued behind
        // idle connections there.
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
        let open = match Arc::clone(&conns.open).try_acquire_owned() {
            Ok(p) => p,
            Err(_) => {
                if conns.shed_oldest_waiting() {
                    daemon.metrics().record_admin_connection_shed();
                    shed_since_warning += 1;
                    if last_warning.is_none_or(|t| t.elapsed() >= Duration::from_secs(60)) {
                        tracing::warn!(
                            listener = L::DESCRIPTION,
                            cap = MAX_OPEN,
                            shed = shed_since_warning,
                            "admin connections at their cap: shedding the ones idle longest for newcomers (a local client may be flooding the admin port)"
                        );
                        shed_since_warning = 0;
                        last_warning = Some(Instant::now());
                    }
                }
                tokio::select! {
                    _ = stop.cancelled() => return,
                    p = Arc::clone(&conns.open).acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => return,
                    },
                }
            }
        };
        let me = conns.register(open);
        let daemon = Arc::clone(&daemon);
        let reload = reload.clone();
        let stop = stop.clone();
        let slots = Arc::clone(&slots);
        tokio::spawn(async move {
            let peer = Arc::new(peer);
            let peer_in_service = Arc::clone(&peer);
            let conn = Arc::clone(&me.conn);
            let service = hyper::service::service_fn(move |req: Request<Incoming>| {
                let daemon = Arc::clone(&daemon);
                let reload = reload.clone();
                let peer = Arc::clone(&peer_in_service);
                let conn = Arc::clone(&conn);
                let slots = Arc::clone(&slots);
                async move {
                    // Health answers take no slot; the rest wait for one
                    // (and may be shed while they wait).
                    let slot = if is_health(req.uri().path()) {
                        None
                    } else {
                        slots.acquire_owned().await.ok()
                    };
                    let serving = InService::begin(conn);
                    let resp = route(req, &daemon, &reload, L::ORIGIN, &peer).await;
                    Ok::<_, Infallible>(resp.map(|body| Served {
                        body,
                        _slot: slot,
                        _serving: serving,
                    }))
                }
            });
            let http = hyper::server::conn::http1::Builder::new()
                .timer(TokioTimer::new())
                .header_read_timeout(HEADER_TIMEOUT)
                .max_buf_size(MAX_HEAD_BYTES)
                .keep_alive(true)
                .serve_connection(TokioIo::new(stream), service);
            tokio::pin!(http);
            tokio::select! {
                r = http.as_mut() => if let Err(e) = r {
                    tracing::debug!(client = %peer, error = %e, "admin connection ended with an error");
                },
                _ = me.conn.shed.cancelled() => {
                    tracing::debug!(client = %peer, "admin connection shed for a newcomer (at the cap, waiting longest)");
                }
                _ = me.conn.overran() => {
                    tracing::debug!(client = %peer, timeout = ?REQUEST_TIMEOUT, "admin request not done in time: connection closed");
                }
                _ = stop.cancelled() => {}
            }
            drop(me);
        });
    }
}

/// Whether `path` is a health endpoint: answered without a slot, from a
/// short read of the daemon's state.
fn is_health(path: &str) -> bool {
    matches!(path, "/healthz" | "/readyz")
}

/// The connections one admin listener holds, by order of arrival, so that
/// at the cap the one that has waited longest can make room.
struct Connections {
    /// One permit per open connection ([`MAX_OPEN`]).
    open: Arc<Semaphore>,
    /// Every open connection, by a number that grows with arrival.
    table: Mutex<BTreeMap<u64, Arc<Conn>>>,
    next: AtomicU64,
}

/// One open admin connection, as shedding and the request timeout see it.
struct Conn {
    /// Since when a request is in service on it (its head in and, unless
    /// it is a health check, a slot taken), until its response is sent;
    /// `None` while it waits. Only a waiting connection is ever shed.
    serving_since: Mutex<Option<Instant>>,
    /// Cancelled to shed it.
    shed: CancellationToken,
}

impl Connections {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            open: Arc::new(Semaphore::new(MAX_OPEN)),
            table: Mutex::new(BTreeMap::new()),
            next: AtomicU64::new(0),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Arc<Conn>>> {
        self.table.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Records a connection accepted now, holding `open`; it leaves the
    /// table (and gives `open` back) when the returned value is dropped.
    fn register(self: &Arc<Self>, open: OwnedSemaphorePermit) -> Registered {
        let id = self.next.fetch_add(1, Ordering::Relaxed);
        let conn = Arc::new(Conn {
            serving_since: Mutex::new(None),
            shed: CancellationToken::new(),
        });
        self.lock().insert(id, Arc::clone(&conn));
        Registered {
            id,
            conn,
            owner: Arc::clone(self),
            _open: open,
        }
    }

    /// Sheds the oldest connection that has no request in service.
    /// Returns false when every one has (at most [`MAX_SERVING`] plus
    /// health answers, so not at [`MAX_OPEN`] unless those are many).
    fn shed_oldest_waiting(&self) -> bool {
        let mut table = self.lock();
        let oldest = table
            .iter()
            .find(|(_, c)| c.serving_since().is_none())
            .map(|(id, _)| *id);
        match oldest.and_then(|id| table.remove(&id)) {
            Some(conn) => {
                conn.shed.cancel();
                true
            }
            None => false,
        }
    }
}

impl Conn {
    fn serving_since(&self) -> Option<Instant> {
        *self.serving_since.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Resolves once a request has been in service for [`REQUEST_TIMEOUT`].
    async fn overran(&self) {
        loop {
            let check_at = self.serving_since().unwrap_or_else(Instant::now) + REQUEST_TIMEOUT;
            tokio::time::sleep_until(check_at).await;
            if self
                .serving_since()
                .is_some_and(|t| t.elapsed() >= REQUEST_TIMEOUT)
            {
                return;
            }
        }
    }
}

/// An open connection's place in [`Connections`].
struct Registered {
    id: u64,
    conn: Arc<Conn>,
    owner: Arc<Connections>,
    _open: OwnedSemaphorePermit,
}

impl Drop for Registered {
    fn drop(&mut self) {
        self.owner.lock().remove(&self.id);
    }
}

/// Marks a connection in service from its creation until it is dropped
/// (with the response's body: once the last byte is handed to the socket).
struct InService {
    conn: Arc<Conn>,
    since: Instant,
}

impl InService {
    fn begin(conn: Arc<Conn>) -> Self {
        let since = Instant::now();
        *conn.serving_since.lock().unwrap_or_else(|p| p.into_inner()) = Some(since);
        Self { conn, since }
    }
}

impl Drop for InService {
    fn drop(&mut self) {
        let mut at = self
            .conn
            .serving_since
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        // Only its own mark: a later request on the connection has its own.
        if *at == Some(self.since) {
            *at = None;
        }
    }
}

/// A response body that keeps its request's slot and in-service mark
/// until it has been sent (or dropped).
struct Served {
    body: Body,
    _slot: Option<OwnedSemaphorePermit>,
    _serving: InService,
}

impl hyper::body::Body for Served {
    type Data = Bytes;
    type Error = <Body as hyper::body::Body>::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        Pin::new(&mut self.get_mut().body).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
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
        "/announce/state" if origin == Origin::Tcp => {
            return json_error(
                StatusCode::FORBIDDEN,
                "announce state changes are served only on the admin Unix socket (admin.socket, default /run/harvester-lb/admin.sock), not on admin.listen; use `harvester-lb host drain|ready` or `harvester-lb vip drain|ready VIP`",
            );
        }
        "/announce/state" => "POST",
        _ => {
            return text(
                StatusCode::NOT_FOUND,
                match origin {
                    Origin::Tcp => {
                        "not found; try /metrics, /healthz, /readyz, /status or POST /reload\n"
                    }
                    Origin::Socket => {
                        "not found; try /metrics, /healthz, /readyz, /status, POST /reload, POST /backends/state or POST /announce/state\n"
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
        "/readyz" => readyz(daemon, req.uri().query()),
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
        "/announce/state" => set_announce_state(req, daemon, peer).await,
        _ => text(StatusCode::NOT_FOUND, "not found\n"),
    }
}

/// `/readyz`: the host-wide answer, or with `vip=ADDRESS` (repeatable)
/// the answer for those VIPs alone.
fn readyz(daemon: &Daemon, query: Option<&str>) -> Response<Body> {
    let vips = match readyz_vips(query.unwrap_or("")) {
        Ok(v) => v,
        Err(e) => return text(StatusCode::BAD_REQUEST, &format!("{e}\n")),
    };
    if vips.is_empty() {
        if daemon.is_ready() {
            return text(StatusCode::OK, "ready\n");
        }
        let mut body = String::from(if daemon.is_stopping() {
            "stopping\n"
        } else {
            "not ready\n"
        });
        for (addr, why) in daemon.failed_listeners() {
            body.push_str(&format!("listener {addr}: {why}\n"));
        }
        return text(StatusCode::SERVICE_UNAVAILABLE, &body);
    }
    match daemon.vips_ready(&vips) {
        Ok(()) => text(StatusCode::OK, "ready\n"),
        Err(e @ VipNotReady::Unknown(_)) => text(StatusCode::NOT_FOUND, &format!("{e}\n")),
        Err(VipNotReady::Unbound(listeners)) => {
            let mut body = String::from("not ready\n");
            for l in listeners {
                body.push_str(&format!("{l}\n"));
            }
            text(StatusCode::SERVICE_UNAVAILABLE, &body)
        }
        Err(e) => text(StatusCode::SERVICE_UNAVAILABLE, &format!("{e}\n")),
    }
}

/// The VIPs a `/readyz` query names (`vip=ADDRESS`, repeatable; IPv6 bare,
/// in brackets or percent-encoded), or what is wrong with it.
fn readyz_vips(query: &str) -> Result<Vec<IpAddr>, String> {
    let mut vips = Vec::new();
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        if key != "vip" {
            return Err(format!(
                "unknown query parameter {:?}; /readyz takes only vip=ADDRESS (repeatable), e.g. /readyz?vip=192.168.0.201",
                percent_decode(key)
            ));
        }
        let value = percent_decode(value);
        let bare = value
            .strip_prefix('[')
            .and_then(|v| v.strip_suffix(']'))
            .unwrap_or(&value);
        match bare.parse::<IpAddr>() {
            Ok(ip) if !ip.is_unspecified() => vips.push(ip.to_canonical()),
            _ => {
                return Err(format!(
                    "vip {value:?} is not a VIP address; write e.g. vip=192.168.0.201 or vip=fd00::201"
                ));
            }
        }
    }
    Ok(vips)
}

/// `%XX` escapes decoded; anything else as it is.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .filter(|h| h.iter().all(u8::is_ascii_hexdigit))
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
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
    let request: StateRequest = match read_json(req, STATE_BODY_SHAPE).await {
        Ok(r) => r,
        Err(resp) => return resp,
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

/// A request's JSON body (at most [`MAX_BODY_BYTES`]), or the 400 answer
/// that says what is wrong and what `shape` is expected.
async fn read_json<T: serde::de::DeserializeOwned>(
    req: Request<Incoming>,
    shape: &str,
) -> Result<T, Response<Body>> {
    let body = match Limited::new(req.into_body(), MAX_BODY_BYTES)
        .collect()
        .await
    {
        Ok(b) => b.to_bytes(),
        Err(e) => {
            return Err(json_error(
                StatusCode::BAD_REQUEST,
                &format!("cannot read the request body (at most {MAX_BODY_BYTES} bytes): {e}"),
            ));
        }
    };
    serde_json::from_slice(&body).map_err(|e| {
        json_error(
            StatusCode::BAD_REQUEST,
            &format!("bad request body: {e}; expected {shape}"),
        )
    })
}

/// The body of `POST /announce/state`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
struct AnnounceRequest {
    /// One VIP; absent: the whole host.
    vip: Option<String>,
    /// `drain` or `ready`.
    state: String,
}

/// What a valid body looks like, for error messages.
const ANNOUNCE_BODY_SHAPE: &str =
    r#"{"state": "drain|ready"} or {"vip": "<address>", "state": "drain|ready"}"#;

async fn set_announce_state(req: Request<Incoming>, daemon: &Daemon, peer: &str) -> Response<Body> {
    let request: AnnounceRequest = match read_json(req, ANNOUNCE_BODY_SHAPE).await {
        Ok(r) => r,
        Err(resp) => return resp,
    };
    let drained = match request.state.as_str() {
        "drain" => true,
        "ready" => false,
        other => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!("state {other:?} is not one of \"drain\", \"ready\""),
            );
        }
    };
    let vip = match request.vip.as_deref().map(|v| v.trim().parse::<IpAddr>()) {
        None => None,
        Some(Ok(ip)) => Some(ip.to_canonical()),
        Some(Err(_)) => {
            return json_error(
                StatusCode::BAD_REQUEST,
                &format!(
                    "vip {:?} is not an IP address; name the VIP as in the config, e.g. \"192.168.0.201\"",
                    request.vip.unwrap_or_default()
                ),
            );
        }
    };
    match daemon.set_announce_state(vip, drained) {
        Ok(change) => {
            tracing::info!(
                vip = vip.map(|v| v.to_string()),
                from = change.previous,
                to = change.state,
                peer,
                "announce state set through the admin socket"
            );
            let mut answer = serde_json::json!({
                "state": change.state,
                "previous_state": change.previous,
            });
            if let Some(v) = vip {
                answer["vip"] = serde_json::json!(v);
            }
            json(StatusCode::OK, &answer)
        }
        Err(e @ AnnounceStateError::UnknownVip(_)) => {
            json_error(StatusCode::NOT_FOUND, &e.to_string())
        }
        Err(e @ AnnounceStateError::Off) => json_error(StatusCode::CONFLICT, &e.to_string()),
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

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn readyz_query_names_vips_in_every_spelling_and_refuses_the_rest() {
        let v4: IpAddr = "192.168.0.201".parse().unwrap();
        let v6: IpAddr = "fd00::201".parse().unwrap();
        assert_eq!(readyz_vips(""), Ok(vec![]));
        assert_eq!(readyz_vips("vip=192.168.0.201"), Ok(vec![v4]));
        // IPv4-mapped is the IPv4 VIP, as in the config.
        assert_eq!(readyz_vips("vip=::ffff:192.168.0.201"), Ok(vec![v4]));
        for spelled in [
            "vip=fd00::201",
            "vip=[fd00::201]",
            "vip=%5Bfd00%3A%3A201%5D",
        ] {
            assert_eq!(readyz_vips(spelled), Ok(vec![v6]), "{spelled}");
        }
        assert_eq!(
            readyz_vips("vip=192.168.0.201&vip=fd00::201"),
            Ok(vec![v4, v6])
        );
        for bad in ["vip=", "vip=0.0.0.0", "vip=::", "vip=10.0.0.300", "vip=%ZZ"] {
            let e = readyz_vips(bad).unwrap_err();
            assert!(e.contains("is not a VIP address"), "{bad}: {e}");
        }
        let e = readyz_vips("vip=192.168.0.201&host=x").unwrap_err();
        assert!(e.contains("\"host\"") && e.contains("vip=ADDRESS"), "{e}");
    }
}

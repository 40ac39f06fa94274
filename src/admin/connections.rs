//! What bounds the admin listeners, whatever a hostile or broken local
//! client does: how many connections one listener holds ([`MAX_OPEN`]), how
//! many requests are in service at once ([`MAX_SERVING`]), how large a
//! request head may be, how long a client gets to send it and how long a
//! request may take. At the cap a newcomer sheds the connection that has
//! waited longest without a request in service, so idle connections can
//! never keep a probe of `/healthz` or `/readyz` out (keepalived moves VIPs
//! on them); those two need no slot. The accept loop never exits on an
//! accept error and never waits for a slot before accepting.

use std::collections::BTreeMap;
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Duration;

use hyper::Request;
use hyper::body::{Bytes, Frame, Incoming, SizeHint};
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::sync::{OwnedSemaphorePermit, Semaphore, mpsc};
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::{AdminListener, Body, routes};
use crate::daemon::Daemon;
use crate::server::ReloadRequest;

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
/// How long the connections already accepted get to finish the request
/// they carry when the listener stops (a stop, or a hand-over whose next
/// process accepts what comes later): keepalived's track script, accepted
/// just before, still gets its answer instead of a closed connection.
const STOP_GRACE: Duration = Duration::from_secs(1);

/// Accepts on `listener` until `stop` is cancelled and serves each
/// connection within the bounds above.
pub(super) async fn serve_on<L: AdminListener>(
    listener: L,
    daemon: Arc<Daemon>,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
) {
    let conns = Connections::new();
    let slots = Arc::new(Semaphore::new(MAX_SERVING));
    let tasks = tokio_util::task::TaskTracker::new();
    // Sheds since the last warning, and when that was: one line a minute
    // at most says the cap is being hit (the counter has every one).
    let mut shed_since_warning = 0u64;
    let mut last_warning: Option<Instant> = None;
    'accept: loop {
        // Never waits for a slot before accepting: a newcomer is taken off
        // the kernel's backlog at once, so a probe is never queued behind
        // idle connections there.
        let accepted = tokio::select! {
            _ = stop.cancelled() => break 'accept,
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
                    _ = stop.cancelled() => break 'accept,
                    p = Arc::clone(&conns.open).acquire_owned() => match p {
                        Ok(p) => p,
                        Err(_) => break 'accept,
                    },
                }
            }
        };
        let me = conns.register(open);
        let daemon = Arc::clone(&daemon);
        let reload = reload.clone();
        let stop = stop.clone();
        let slots = Arc::clone(&slots);
        tasks.spawn(async move {
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
                    let resp = routes::route(req, &daemon, &reload, L::ORIGIN, &peer).await;
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
                _ = stop.cancelled() => {
                    // The request it carries (or the one it is about to
                    // send) is answered; then the connection closes.
                    http.as_mut().graceful_shutdown();
                    let _ = tokio::time::timeout(STOP_GRACE, http.as_mut()).await;
                }
            }
            drop(me);
        });
    }
    tasks.close();
    let _ = tokio::time::timeout(STOP_GRACE, tasks.wait()).await;
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

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::{TcpListener, TcpStream};

    /// What a whole HTTP/1.1 exchange on `c` answers (its status line).
    async fn status_line(c: &mut TcpStream) -> String {
        let mut got = Vec::new();
        let mut buf = [0u8; 1024];
        while !got.windows(4).any(|w| w == b"\r\n\r\n") {
            match tokio::time::timeout(Duration::from_secs(10), c.read(&mut buf)).await {
                Ok(Ok(0)) | Err(_) => break,
                Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
                Ok(Err(e)) => return format!("error: {e}"),
            }
        }
        String::from_utf8_lossy(&got)
            .lines()
            .next()
            .unwrap_or("closed with no answer")
            .to_string()
    }

    /// keepalived's track script at a hand-over: its connection was
    /// accepted by the process that is stopping, its request not yet read.
    /// It gets its answer, not a closed connection (before: dropped at once).
    #[tokio::test]
    async fn a_connection_accepted_before_the_stop_still_gets_its_answer() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let stop = CancellationToken::new();
        let (reload, _keep) = mpsc::channel(1);
        let d = crate::daemon::testing::daemon();
        let served = tokio::spawn(serve_on(listener, d, reload, stop.clone()));
        // The track script's connection, its request head half sent.
        let mut track = TcpStream::connect(addr).await.unwrap();
        track
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        // Another connection answered: the listener accepts in the order of
        // its queue, so the first one is accepted by now.
        let mut other = TcpStream::connect(addr).await.unwrap();
        other
            .write_all(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        assert_eq!(status_line(&mut other).await, "HTTP/1.1 200 OK");
        stop.cancel();
        track.write_all(b"\r\n").await.unwrap();
        assert_eq!(status_line(&mut track).await, "HTTP/1.1 200 OK");
        tokio::time::timeout(Duration::from_secs(10), served)
            .await
            .expect("the listener ends within its grace")
            .unwrap();
    }
}

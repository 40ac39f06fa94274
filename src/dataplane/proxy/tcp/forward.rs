//! One client connection: pick, connect with retry, copy, account.
//!
//! The forwarder reads the load balancer's snapshot once, so a connection sees
//! one consistent healthy set even if the prober swaps a new one meanwhile.
//! A client that cannot be given a backend is closed at once with a reset —
//! never left hanging and never passed to anything else on the host.

use std::io;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use socket2::{SockRef, Socket, TcpKeepalive};
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;

use super::copy::{self, ByteCounters, Ended, Moved, Peer};
use super::proxy_protocol;
use crate::config::{OnBackendDown, ProxyProtocol};
use crate::dataplane::balancer::{Backend, ClientAddr, ConnectionGuard, affinity};
use crate::dataplane::proxy::Route;
use crate::dataplane::proxy::log::{AttemptFailure, Bytes, Origin, Record, Termination};
use crate::metrics::stats::{ClosedReason, ConnectFailureReason, Direction, FailedReason};
use crate::net;

/// TCP keepalive on both legs: a peer that vanished without a FIN (a node VM
/// powered off, a cut link) is found within about a minute, not hours.
const KEEPALIVE_TIME: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
/// `TCP_USER_TIMEOUT` on both legs: data unacknowledged this long (a link cut
/// mid-transfer, a node VM frozen) aborts the connection, instead of TCP's
/// retransmission limit of about 15 minutes. On Linux it also decides when
/// unanswered keepalive probes give up (it overrides `TCP_KEEPCNT`, so that
/// option is not set): idle 30 s, then probes every 10 s, abort at 60 s.
const USER_TIMEOUT: Duration = Duration::from_secs(60);
/// When the backend leg gets its keepalive and `TCP_USER_TIMEOUT`: this long
/// after the copy starts, if the connection is still open. Both only act on
/// a connection idle for `KEEPALIVE_TIME` or with data unacknowledged for
/// `USER_TIMEOUT`, so a connection shorter than this never needs them and
/// saves their four `setsockopt` (20.6 system calls per proxied
/// `Connection: close` request before, 16.6 after). Arming them later
/// changes nothing observable as long as this is at most `KEEPALIVE_TIME`:
/// setting `TCP_KEEPIDLE` on an open connection counts the idle time from
/// its last received segment, and the kernel reads `TCP_USER_TIMEOUT` when
/// each retransmission or probe timer fires, so a vanished node is still
/// found 60 s after the connection went quiet.
const LIVENESS_AFTER: Duration = Duration::from_secs(10);

/// Why a connect attempt failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ConnectFailure {
    Refused,
    Timeout,
    Other,
    /// This process is out of descriptors or socket memory.
    Local,
}

/// Serves one accepted client until it is done. `control` closes it when
/// the listener's drain time is over, or pauses it for a hand-over;
/// `_held` holds a slot of the process-wide connection limit and one of
/// the load balancer's for the connection's lifetime.
pub(crate) async fn serve(
    client: TcpStream,
    peer: SocketAddr,
    route: Arc<Route>,
    control: Arc<super::Control>,
    _held: super::Held,
) {
    let m = &route.stats;
    m.accepted.increment(1);
    // TCP_NODELAY, keepalive and TCP_USER_TIMEOUT came with the accept:
    // Linux copies them from the listening socket (see `dataplane::proxy::tcp::bind`).

    let snapshot = route.lb.snapshot_full();
    let mut record = Record::start(snapshot.settings.log_connections, peer);
    if record.is_debug() {
        record.accepted(&Origin {
            load_balancer: &route.lb.name,
            cluster: &route.lb.cluster,
            listener: &route.listener,
            vip: client.local_addr().ok(),
            protocol: "tcp",
        });
    }
    // Client affinity: the backend this client was given last, if recent.
    let client_addr = ClientAddr::new(peer);
    let affinity = snapshot
        .settings
        .affinity_timeout
        .and_then(|timeout| route.lb.affinity().map(|table| (table, timeout)));
    let now = affinity.map_or(0, |_| affinity::now_secs());
    let sticky = affinity.and_then(|(table, timeout)| table.lookup(client_addr, timeout, now));
    let mut last_failure = None;
    let mut connected = None;
    let close_on_down = snapshot.settings.on_backend_down == OnBackendDown::Close;
    let port = route.backend_port;
    for backend in snapshot.candidates(client_addr, route.lb.cursor(), sticky, port) {
        let addr = SocketAddr::new(backend.addr, port);
        // Taken before the connect: a mark-down under `on_backend_down =
        // "close"` while this connection is still being made resets it
        // too, and one between the snapshot and here is seen below.
        let marked_down = backend.marked_down_signal(port);
        if close_on_down && !backend.is_healthy_on(port) {
            tracing::debug!(backend = %addr, "backend marked down since the pick; trying the next one");
            record.failed(addr, AttemptFailure::MarkedDown);
            continue;
        }
        let attempt = tokio::select! {
            r = connect(addr, snapshot.settings.connect_timeout) => r,
            _ = marked_down.cancelled() => {
                // No byte has reached the backend: the client can still
                // be served by another one.
                tracing::debug!(backend = %addr, "backend marked down while connecting; trying the next one");
                record.failed(addr, AttemptFailure::MarkedDown);
                continue;
            }
        };
        match attempt {
            Ok(stream) => {
                record.connected(addr);
                connected = Some((stream, Arc::clone(backend), marked_down));
                break;
            }
            Err((failure, e)) => {
                count_attempt_failure(backend, failure);
                record.failed(addr, failure.into());
                last_failure = Some(failure);
                if failure == ConnectFailure::Local {
                    // Every other backend would need a socket too.
                    tracing::warn!(error = %e, "no socket for a backend connection; resetting the client");
                    break;
                }
                tracing::debug!(backend = %addr, error = %e, "connect to backend failed; trying the next one");
            }
        }
    }
    let idle_timeout = snapshot.settings.idle_timeout;
    drop(snapshot);

    let Some((server, backend, marked_down)) = connected else {
        no_backend_took_it(record, last_failure, &route, &client);
        return;
    };

    if let Some((table, _)) = affinity
        && sticky != Some(backend.addr)
    {
        table.remember(client_addr, backend.addr, now);
    }
    let backend_count = backend.connection_opened();
    if let Some(version) = route.proxy_protocol {
        match send_proxy_header(version, client_addr, &client, &server).await {
            Ok(first) => {
                m.client_to_backend.increment(first as u64);
                backend.stats().bytes[Direction::ClientToBackend].increment(first as u64);
            }
            Err(e) => {
                tracing::debug!(error = %e, "cannot send the PROXY header; resetting both sides");
                // The backend took no header.
                m.failed[FailedReason::ConnectError].increment(1);
                reset(&client);
                reset(&server);
                log_end(record, Termination::BackendReset, &route, &client, None);
                return;
            }
        }
    }
    let to = ToBackend {
        backend: &backend,
        marked_down,
        _count: backend_count,
    };
    relay(
        client,
        server,
        &route,
        &control,
        Some(to),
        record,
        idle_timeout,
    )
    .await;
}

/// Serves a connection another process handed over (see
/// [`super::HandedConnection`]): its copy goes on where that process
/// paused it, with this process's counters, its caps' slots (`held`) and,
/// when the backend is still a member of `route`'s load balancer, its
/// connection count and its mark-down and removal signals. A backend no
/// longer in the config is served to the connection's end all the same,
/// counted in the listener's `active` and the caps, in no backend's count.
pub(crate) async fn serve_adopted(
    handed: super::HandedConnection,
    route: Arc<Route>,
    control: Arc<super::Control>,
    held: super::Held,
) {
    let _held = held;
    let adopted = TcpStream::from_std(handed.client)
        .and_then(|client| Ok((client, TcpStream::from_std(handed.backend)?)));
    let (client, server) = match adopted {
        Ok(a) => a,
        Err(e) => {
            // No room in the reactor: both sockets close.
            tracing::warn!(error = %e, "handed-over connection cannot be served; closed");
            control.note_lost();
            return;
        }
    };
    // A socket that has both sent and received its FIN since the pause
    // (the last bytes of a half-closed connection wait in it, unread) is
    // closed for the kernel and has no peer address any more: such a
    // connection is served on all the same, in no backend's count.
    let peer = client
        .peer_addr()
        .unwrap_or_else(|_| SocketAddr::from(([0, 0, 0, 0], 0)));
    let backend_addr = server.peer_addr().ok();
    let snapshot = route.lb.snapshot_full();
    let mut record = Record::start(snapshot.settings.log_connections, peer);
    if let Some(addr) = backend_addr {
        record.connected(addr);
    }
    let idle_timeout = snapshot.settings.idle_timeout;
    drop(snapshot);
    // By address: the backend object of this process, if the config still
    // has it.
    let backend = backend_addr.and_then(|addr| {
        let found = route.lb.members().into_iter().find(|b| b.addr == addr.ip());
        if found.is_none() {
            tracing::debug!(backend = %addr, "handed-over connection to a backend no longer configured: served to its end");
        }
        found.map(|b| (b, addr.port()))
    });
    // Keepalive and TCP_USER_TIMEOUT on the backend leg now: the
    // connection has lasted, maybe less than `LIVENESS_AFTER`. The client
    // leg kept the options it was accepted with.
    set_liveness_or_warn(&SockRef::from(&server));
    let to = backend.as_ref().map(|(b, port)| ToBackend {
        backend: b,
        marked_down: b.marked_down_signal(*port),
        _count: b.connection_opened(),
    });
    relay(client, server, &route, &control, to, record, idle_timeout).await;
}

/// The backend of a connection being copied, when it is one of the load
/// balancer's members: what cuts the connection, and its count.
struct ToBackend<'a> {
    backend: &'a Arc<Backend>,
    /// Fires when it is marked down under `on_backend_down = "close"`.
    marked_down: CancellationToken,
    /// Counts the connection in the backend's open connections.
    _count: ConnectionGuard,
}

/// Copies between `client` and `server` until the connection ends, is cut
/// (drain time over, backend removed or marked down) or is paused for a
/// hand-over, then writes its line or passes its sockets on.
async fn relay(
    client: TcpStream,
    server: TcpStream,
    route: &Route,
    control: &super::Control,
    to: Option<ToBackend<'_>>,
    record: Record,
    idle_timeout: Duration,
) {
    let m = &route.stats;
    let backend = to.as_ref().map(|t| t.backend);
    let marked_down = to.as_ref().map(|t| &t.marked_down);
    m.active.increment();
    let moved = Moved::default();
    let pause = AtomicBool::new(false);
    // In a block: the copy borrows the sockets, which a hand-over moves.
    let ended = {
        let copy = copy::bidirectional(
            &client,
            &server,
            idle_timeout,
            ByteCounters {
                client_to_backend: &m.client_to_backend,
                backend_to_client: &m.backend_to_client,
                backend: backend.map(|b| {
                    let bytes = &b.stats().bytes;
                    [
                        &bytes[Direction::ClientToBackend],
                        &bytes[Direction::BackendToClient],
                    ]
                }),
                moved: &moved,
            },
            copy::Later {
                after: LIVENESS_AFTER,
                run: || set_liveness_or_warn(&SockRef::from(&server)),
            },
            &pause,
        );
        tokio::pin!(copy);
        let retired = async {
            match backend {
                Some(b) => b.retired().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(retired);
        let marked = async {
            match marked_down {
                Some(signal) => signal.cancelled().await,
                None => std::future::pending().await,
            }
        };
        tokio::pin!(marked);
        // One signal of the listener wakes every connection, for a drain's
        // end or a hand-over (one future polled per wake-up, as before the
        // hand-over existed); a hand-over then polls the close signal too.
        let mut pausing = false;
        loop {
            break tokio::select! {
                ended = &mut copy => Cut::Copy(ended),
                _ = control.wake.cancelled(), if !pausing => {
                    if control.close.is_cancelled() {
                        // A drain's end, or a hand-over's deadline passed
                        // while this connection was still connecting.
                        tracing::debug!("drain timeout: closing connection");
                        control.note_closed();
                        Cut::Drained
                    } else {
                        // Seen by each direction at its next wait, when the
                        // copy is polled again right below.
                        pause.store(true, Ordering::Relaxed);
                        pausing = true;
                        continue;
                    }
                }
                _ = control.close.cancelled(), if pausing => {
                    tracing::debug!("hand-over deadline passed before the copy could pause: closing connection");
                    control.note_lost();
                    Cut::Drained
                }
                _ = &mut retired => {
                    tracing::debug!("backend removed and drained: closing connection");
                    Cut::Drained
                }
                _ = &mut marked => {
                    tracing::debug!(backend = ?backend.map(|b| b.addr), "backend marked down (on_backend_down = close): resetting both sides");
                    if let Some(b) = backend {
                        b.stats().closed[ClosedReason::MarkedDown].increment(1);
                    }
                    reset(&client);
                    reset(&server);
                    Cut::BackendDown
                }
            };
        }
    };
    m.active.decrement();
    if let Cut::Copy(Ended::Paused) = ended {
        control.hand_on(client, server);
        return;
    }
    let state = termination(ended, idle_timeout, &client, &server);
    log_end(record, state, route, &client, Some(&moved));
}

/// Ends a connection no backend took: counted by why, the client reset,
/// and its line written.
fn no_backend_took_it(
    record: Record,
    last_failure: Option<ConnectFailure>,
    route: &Route,
    client: &TcpStream,
) {
    let reason = match last_failure {
        None => FailedReason::NoBackend,
        Some(ConnectFailure::Refused) => FailedReason::ConnectRefused,
        Some(ConnectFailure::Timeout) => FailedReason::ConnectTimeout,
        Some(ConnectFailure::Other | ConnectFailure::Local) => FailedReason::ConnectError,
    };
    route.stats.failed[reason].increment(1);
    tracing::debug!(
        reason = ?last_failure,
        "no backend could take the connection; resetting the client"
    );
    reset(client);
    // Nothing tried: none was eligible (or all were marked down since).
    let state = match last_failure {
        None => Termination::NoBackend,
        Some(_) => Termination::ConnectFailed,
    };
    log_end(record, state, route, client, None);
}

/// Sends the PROXY protocol header for the client at `client_addr`, with
/// what the client has sent so far; returns how many client bytes went with it.
async fn send_proxy_header(
    version: ProxyProtocol,
    client_addr: ClientAddr,
    client: &TcpStream,
    server: &TcpStream,
) -> io::Result<usize> {
    let vip = client.local_addr()?;
    let header = proxy_protocol::header(version, client_addr, vip);
    proxy_protocol::send(server, client, header).await
}

/// How a forwarded connection ended, for its line; a copy that failed
/// passes the abort on to both sides.
fn termination(
    ended: Cut,
    idle_timeout: Duration,
    client: &TcpStream,
    server: &TcpStream,
) -> Termination {
    match ended {
        Cut::Drained => Termination::Drained,
        Cut::BackendDown => Termination::BackendDown,
        Cut::Copy(Ended::Completed) => Termination::Closed,
        // Handed on before this is reached; a pause that could not hand
        // the sockets on closes them as a drain does.
        Cut::Copy(Ended::Paused) => Termination::Drained,
        Cut::Copy(Ended::IdleTimeout) => {
            tracing::debug!(?idle_timeout, "idle timeout: closing connection");
            Termination::IdleTimeout
        }
        Cut::Copy(Ended::Failed(peer, e)) => {
            tracing::debug!(error = %e, ?peer, "connection failed; resetting both sides");
            // Pass the abort on: a client must not take a cut-off response
            // for a complete one.
            reset(client);
            reset(server);
            match peer {
                Peer::Client => Termination::ClientReset,
                Peer::Backend => Termination::BackendReset,
            }
        }
    }
}

/// Writes the line of a client refused at accept (`state` says why), if
/// its load balancer logs connections.
pub(crate) fn log_refused(route: &Route, client: &TcpStream, peer: SocketAddr, state: Termination) {
    let mode = route.lb.snapshot().settings.log_connections;
    log_end(Record::start(mode, peer), state, route, client, None);
}

/// How the copy of a connection ended: on its own, or cut by the daemon.
enum Cut {
    Copy(Ended),
    /// The drain time of its listener or backend ran out.
    Drained,
    /// Its backend was marked down under `on_backend_down = "close"`.
    BackendDown,
}

/// Writes the connection's log line, if its load balancer logs it (the
/// VIP is asked of the socket only then).
fn log_end(
    record: Record,
    state: Termination,
    route: &Route,
    client: &TcpStream,
    moved: Option<&Moved>,
) {
    if !record.wants(state, false) {
        return;
    }
    let bytes = moved.map_or(Bytes::default(), |m| Bytes {
        client_to_backend: m
            .client_to_backend
            .load(std::sync::atomic::Ordering::Relaxed),
        backend_to_client: m
            .backend_to_client
            .load(std::sync::atomic::Ordering::Relaxed),
    });
    let origin = Origin {
        load_balancer: &route.lb.name,
        cluster: &route.lb.cluster,
        listener: &route.listener,
        vip: client.local_addr().ok(),
        protocol: "tcp",
    };
    record.finish(state, &origin, bytes, false);
}

/// Connects to `addr` within `timeout` (see [`net::connect`]).
async fn connect(
    addr: SocketAddr,
    timeout: Duration,
) -> Result<TcpStream, (ConnectFailure, io::Error)> {
    let deadline = tokio::time::Instant::now() + timeout;
    let socket = new_socket(addr, deadline)
        .await
        .map_err(|e| (ConnectFailure::Local, e))?;
    // Keepalive and TCP_USER_TIMEOUT come later, if the connection lasts
    // (see `LIVENESS_AFTER`); Nagle must be off before the first byte.
    set_nodelay_or_warn(&socket);
    match tokio::time::timeout_at(deadline, net::connect(socket, addr)).await {
        Ok(Ok(stream)) => Ok(stream),
        Ok(Err(e)) if e.kind() == io::ErrorKind::ConnectionRefused => {
            Err((ConnectFailure::Refused, e))
        }
        Ok(Err(e)) if e.kind() == io::ErrorKind::TimedOut => Err((ConnectFailure::Timeout, e)),
        Ok(Err(e)) if net::is_local_shortage(&e) => Err((ConnectFailure::Local, e)),
        Ok(Err(e)) => Err((ConnectFailure::Other, e)),
        Err(_) => Err((
            ConnectFailure::Timeout,
            io::Error::new(
                io::ErrorKind::TimedOut,
                format!("no answer within {timeout:?}"),
            ),
        )),
    }
}

/// How long to wait before trying again to get a socket when the process is
/// out of descriptors or socket memory.
const LOCAL_SHORTAGE_RETRY: Duration = Duration::from_millis(20);

/// The socket for a backend connection. Running out of descriptors (or of
/// socket memory) is the daemon's own shortage, not the backend's, and the
/// client is already accepted: wait for one to free up until `deadline`
/// rather than reset the client at once.
async fn new_socket(addr: SocketAddr, deadline: tokio::time::Instant) -> io::Result<Socket> {
    loop {
        match net::tcp_socket_for(addr) {
            Err(e)
                if net::is_local_shortage(&e)
                    && tokio::time::Instant::now() + LOCAL_SHORTAGE_RETRY < deadline =>
            {
                warn_shortage(&e);
                if copy::release_spare_pipes() == 0 {
                    tokio::time::sleep(LOCAL_SHORTAGE_RETRY).await;
                }
            }
            r => return r,
        }
    }
}

/// Logs a descriptor shortage at most once a second (it can hit every
/// connection at once).
fn warn_shortage(e: &io::Error) {
    use std::sync::atomic::{AtomicU64, Ordering};
    static LAST: AtomicU64 = AtomicU64::new(0);
    let now = crate::os::monotonic_now().as_secs() + 1;
    if LAST.swap(now, Ordering::Relaxed) != now {
        tracing::warn!(error = %e, "no socket for a backend connection; the client waits until one frees up (up to connect_timeout)");
    }
}

impl From<ConnectFailure> for AttemptFailure {
    fn from(f: ConnectFailure) -> Self {
        match f {
            ConnectFailure::Refused => AttemptFailure::Refused,
            ConnectFailure::Timeout => AttemptFailure::Timeout,
            ConnectFailure::Other => AttemptFailure::Error,
            ConnectFailure::Local => AttemptFailure::NoSocket,
        }
    }
}

fn count_attempt_failure(backend: &Backend, failure: ConnectFailure) {
    let reason = match failure {
        ConnectFailure::Refused => ConnectFailureReason::ConnectRefused,
        ConnectFailure::Timeout => ConnectFailureReason::ConnectTimeout,
        ConnectFailure::Other => ConnectFailureReason::ConnectError,
        // Not the backend's fault: not counted against it.
        ConnectFailure::Local => return,
    };
    backend.stats().connect_failures[reason].increment(1);
}

/// `TCP_NODELAY` (forward small writes at once), keepalive and
/// `TCP_USER_TIMEOUT` on a listening socket: accepted sockets inherit them,
/// so the client leg costs no system call for them. A failure costs
/// efficiency, not correctness: warn and go on.
pub(crate) fn set_options_or_warn(socket: SockRef<'_>) {
    set_nodelay_or_warn(&socket);
    set_liveness_or_warn(&socket);
}

/// `TCP_NODELAY`: a small write leaves at once, not after the ACK of the
/// previous one (Nagle with the peer's delayed ACK stalls 40 ms).
fn set_nodelay_or_warn(socket: &Socket) {
    if let Err(e) = socket.set_tcp_nodelay(true) {
        tracing::warn!(error = %e, "cannot set TCP_NODELAY");
    }
}

/// Keepalive (`SO_KEEPALIVE`, `TCP_KEEPIDLE`, `TCP_KEEPINTVL`) and
/// `TCP_USER_TIMEOUT`: a peer that vanished is found within a minute, idle
/// or not. Four system calls; see `LIVENESS_AFTER` for when the backend leg
/// pays them.
pub(crate) fn set_liveness_or_warn(socket: &Socket) {
    let keepalive = TcpKeepalive::new()
        .with_time(KEEPALIVE_TIME)
        .with_interval(KEEPALIVE_INTERVAL);
    if let Err(e) = socket.set_tcp_keepalive(&keepalive) {
        tracing::warn!(error = %e, "cannot set TCP keepalive");
    }
    if let Err(e) = socket.set_tcp_user_timeout(Some(USER_TIMEOUT)) {
        tracing::warn!(error = %e, "cannot set TCP_USER_TIMEOUT");
    }
}

/// Makes the coming close a reset (`SO_LINGER` 0): a refused client must
/// not take a clean end of stream for an answer.
pub(crate) fn reset(stream: &TcpStream) {
    if let Err(e) = SockRef::from(stream).set_linger(Some(Duration::ZERO)) {
        tracing::debug!(error = %e, "cannot set SO_LINGER");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::AtomicUsize;

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;
    use crate::metrics::Counter;
    use crate::test_clock::run_until;

    /// A connected loopback pair: (the end the copy uses, the peer's end).
    async fn pair() -> (TcpStream, TcpStream) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let peer = TcpStream::connect(listener.local_addr().unwrap())
            .await
            .unwrap();
        let (ours, _) = listener.accept().await.unwrap();
        (ours, peer)
    }

    /// A connection shorter than `Later::after` never runs it (so never
    /// pays the backend leg's four `setsockopt`); one that lasts runs it
    /// once, which arms keepalive and `TCP_USER_TIMEOUT` on the backend
    /// socket, and goes on forwarding until its idle timeout.
    #[tokio::test]
    async fn liveness_is_set_only_on_a_connection_that_lasts() {
        let counters = (Counter::default(), Counter::default());
        let moved = Moved::default();
        let byte_counters = || ByteCounters {
            client_to_backend: &counters.0,
            backend_to_client: &counters.1,
            backend: None,
            moved: &moved,
        };

        // Short: both peers end at once; `later` is far off.
        let ran = AtomicUsize::new(0);
        let ((client, client_peer), (backend, backend_peer)) = (pair().await, pair().await);
        drop((client_peer, backend_peer));
        let ended = copy::bidirectional(
            &client,
            &backend,
            Duration::from_secs(60),
            byte_counters(),
            copy::Later {
                after: Duration::from_secs(10),
                run: || {
                    ran.fetch_add(1, Ordering::SeqCst);
                },
            },
            &AtomicBool::new(false),
        )
        .await;
        assert!(
            matches!(ended, Ended::Completed | Ended::Failed(..)),
            "{ended:?}"
        );
        assert_eq!(
            ran.load(Ordering::SeqCst),
            0,
            "a short connection armed liveness"
        );
        let backend_ref = SockRef::from(&backend);
        assert!(!backend_ref.keepalive().unwrap());

        // Lasting: `later` runs once, then the copy goes on until idle.
        let ran = AtomicUsize::new(0);
        let no_pause = AtomicBool::new(false);
        let ((client, mut client_peer), (backend, mut backend_peer)) = (pair().await, pair().await);
        let copy = copy::bidirectional(
            &client,
            &backend,
            Duration::from_millis(500),
            byte_counters(),
            copy::Later {
                after: Duration::from_millis(50),
                run: || {
                    ran.fetch_add(1, Ordering::SeqCst);
                    set_liveness_or_warn(&SockRef::from(&backend));
                },
            },
            &no_pause,
        );
        let peers = async {
            // Bytes still move after the options are set.
            while ran.load(Ordering::SeqCst) == 0 {
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            client_peer.write_all(b"ping").await.unwrap();
            let mut got = [0u8; 4];
            backend_peer.read_exact(&mut got).await.unwrap();
            assert_eq!(&got, b"ping");
        };
        let (ended, ()) =
            tokio::time::timeout(Duration::from_secs(10), async { tokio::join!(copy, peers) })
                .await
                .expect("the copy ends at its idle timeout");
        assert!(matches!(ended, Ended::IdleTimeout), "{ended:?}");
        assert_eq!(ran.load(Ordering::SeqCst), 1);
        let backend_ref = SockRef::from(&backend);
        assert!(backend_ref.keepalive().unwrap());
        assert_eq!(backend_ref.tcp_keepalive_time().unwrap(), KEEPALIVE_TIME);
        assert_eq!(
            backend_ref.tcp_keepalive_interval().unwrap(),
            KEEPALIVE_INTERVAL
        );
        assert_eq!(backend_ref.tcp_user_timeout().unwrap(), Some(USER_TIMEOUT));
    }

    /// The idle timeout counts from the last byte moved, on tokio's clock:
    /// a byte at 59 s of a 60 s timeout keeps the connection until 119 s.
    #[tokio::test(start_paused = true)]
    async fn the_idle_timeout_counts_from_the_last_byte_on_a_paused_clock() {
        const IDLE: Duration = Duration::from_secs(60);
        let ((client, client_peer), (backend, backend_peer)) = (pair().await, pair().await);
        let started = Arc::new(AtomicUsize::new(0));
        let start = Arc::clone(&started);
        let copy = tokio::spawn(async move {
            start.store(1, Ordering::SeqCst);
            let counters = (Counter::default(), Counter::default());
            let moved = Moved::default();
            let byte_counters = ByteCounters {
                client_to_backend: &counters.0,
                backend_to_client: &counters.1,
                backend: None,
                moved: &moved,
            };
            let later = copy::Later {
                after: Duration::from_secs(3600),
                run: || {},
            };
            let pause = AtomicBool::new(false);
            copy::bidirectional(&client, &backend, IDLE, byte_counters, later, &pause).await
        });
        // The copy's clock starts at its first poll, which runs on through
        // its first wait before the test sees `started`: at 0 s.
        assert!(run_until(20_000, || started.load(Ordering::SeqCst) == 1).await);
        tokio::time::advance(IDLE - Duration::from_secs(1)).await;
        let ended = run_until(200, || copy.is_finished()).await;
        assert!(!ended, "ended before its idle timeout");
        // One byte at 59 s, read by the backend's peer.
        assert_eq!(client_peer.try_write(b"x").unwrap(), 1);
        let mut got = [0u8; 1];
        let read = run_until(20_000, || {
            backend_peer.try_read(&mut got).is_ok_and(|n| n == 1)
        })
        .await;
        assert!(read, "the byte never reached the backend");
        // 118 s: idle for 59 s only.
        // The copy's clock starts at its first poll, which runs on through
        // its first wait before the test sees `started`: at 0 s.
        assert!(run_until(20_000, || started.load(Ordering::SeqCst) == 1).await);
        tokio::time::advance(IDLE - Duration::from_secs(1)).await;
        let ended = run_until(200, || copy.is_finished()).await;
        assert!(!ended, "the idle timeout counted from the start");
        // 120 s: idle for 61 s.
        tokio::time::advance(Duration::from_secs(2)).await;
        let ended = run_until(20_000, || copy.is_finished()).await;
        assert!(ended, "still open after the idle timeout");
        let ended = copy.await.unwrap();
        assert!(matches!(ended, Ended::IdleTimeout), "{ended:?}");
    }

    /// Arming liveness late changes nothing only if it comes before the
    /// first keepalive probe would.
    #[test]
    fn liveness_comes_before_the_first_probe() {
        const { assert!(LIVENESS_AFTER.as_secs() <= KEEPALIVE_TIME.as_secs()) };
    }
}

//! TCP listeners: a listening socket per VIP:port, its accept loop, and the
//! connections it serves (connect with retry, the PROXY protocol header,
//! zero-copy forwarding).
//!
//! The accept loop never exits on an error: out of descriptors it backs off
//! briefly and goes on (tokio's proxy example stops the whole server there).
//! A listener keeps its sockets for its whole life (one, or one per thread
//! with the thread-per-core design of [`crate::dataplane::workers`]); a reload only swaps its
//! [`Route`], so no connection is refused during a reload.
//!
//! A restart hands the open connections to the next process instead of
//! draining them ([`Listener::hand_over`], [`Listener::adopt`]): each copy
//! pauses where it holds no byte, and its two sockets are all the next
//! process needs.

pub mod copy;
pub mod forward;
#[cfg(test)]
mod hand_over_tests;
pub mod listen_options;
pub mod proxy_protocol;
pub mod splice;

use std::io;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, LazyLock, Mutex, Weak};
use std::time::Duration;

use arc_swap::ArcSwap;
use socket2::{Domain, Socket, Type};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use super::Route;
use super::log::Termination::{ConnectionCap, SourceRefused};
use super::{CAP_LOG, Cap, note_lb_cap};
use crate::dataplane::budget::Slot;
use crate::dataplane::workers::Placement;
use crate::log_limit::{LogLimit, Verdict, left_out};
use crate::metrics::stats::{AcceptErrorKind, RejectedReason};

/// The process-wide cap on forwarded connections (`proxy.max_connections`):
/// a slot is taken after each accept and held for the connection's life.
/// Reaching it and leaving it again are logged (warn, then info; rate
/// limited), never each connection that waits.
pub struct ConnectionLimit {
    slots: Arc<Semaphore>,
    max: usize,
    /// Set when an accept found no slot; cleared at 90% of the cap.
    full: AtomicBool,
}

impl ConnectionLimit {
    /// A cap of `max` connections.
    pub fn new(max: usize) -> Arc<Self> {
        let max = max.min(Semaphore::MAX_PERMITS);
        Arc::new(Self {
            slots: Arc::new(Semaphore::new(max)),
            max,
            full: AtomicBool::new(false),
        })
    }

    /// The cap.
    pub fn max(&self) -> usize {
        self.max
    }

    fn note_full(&self) {
        if !self.full.swap(true, Ordering::AcqRel)
            && let Verdict::Write { suppressed } = CAP_LOG.check((None, true))
        {
            tracing::warn!(
                max_connections = self.max,
                "proxy.max_connections reached: new connections wait in the listen backlog for a slot{}",
                left_out(suppressed)
            );
        }
    }

    fn note_release(&self) {
        let in_use = self.max - self.slots.available_permits().min(self.max);
        if self.full.load(Ordering::Relaxed)
            && in_use.saturating_mul(10) <= self.max.saturating_mul(9)
            && self.full.swap(false, Ordering::AcqRel)
            && let Verdict::Write { suppressed } = CAP_LOG.check((None, false))
        {
            tracing::info!(
                max_connections = self.max,
                in_use,
                "back under proxy.max_connections{}",
                left_out(suppressed)
            );
        }
    }
}

/// What one connection holds of the caps: a slot of its load balancer's
/// and one of the process's. Dropping it gives both back and says when a
/// cap that was reached is left.
pub struct Held {
    lb: Arc<crate::dataplane::balancer::LoadBalancer>,
    lb_slot: Option<Slot>,
    limit: Arc<ConnectionLimit>,
    permit: Option<OwnedSemaphorePermit>,
}

impl Drop for Held {
    fn drop(&mut self) {
        drop(self.lb_slot.take());
        note_lb_cap(&self.lb, Cap::Connections, false);
        drop(self.permit.take());
        self.limit.note_release();
    }
}

/// What a listener's connections are told by the daemon: their drain time
/// is over (close), or they are handed to the next process (pause). One
/// signal wakes them for either, so a connection polls one future per
/// wake-up for both, as it did for the drain alone.
pub(crate) struct Control {
    /// Cancelled to wake every connection: a drain's end (with `close`
    /// cancelled first) or a hand-over (without).
    pub(crate) wake: CancellationToken,
    /// Cancelled when the connections still open must close now: the drain
    /// time, or the hand-over's deadline, is over.
    pub(crate) close: CancellationToken,
    /// The connections paused for a hand-over, their sockets taken out of
    /// this process's reactor.
    handed: Mutex<Vec<HandedConnection>>,
    /// Set before `wake` for a hand-over (not for a drain).
    handing_over: AtomicBool,
    /// Connections a hand-over could not pass on (not paused by the
    /// deadline, or their sockets unusable).
    lost: AtomicUsize,
}

impl Control {
    fn new() -> Arc<Self> {
        Arc::new(Self {
            wake: CancellationToken::new(),
            close: CancellationToken::new(),
            handed: Mutex::new(Vec::new()),
            handing_over: AtomicBool::new(false),
            lost: AtomicUsize::new(0),
        })
    }

    /// Counts a connection the hand-over could not pass on.
    pub(crate) fn note_lost(&self) {
        self.lost.fetch_add(1, Ordering::Relaxed);
    }

    /// A connection closed because its listener's time is over: counted
    /// lost when that was a hand-over's deadline, not a drain's.
    pub(crate) fn note_closed(&self) {
        if self.handing_over.load(Ordering::Relaxed) {
            self.note_lost();
        }
    }

    /// Passes a paused connection's sockets on to the hand-over: they leave
    /// this process's reactor, open.
    pub(crate) fn hand_on(&self, client: TcpStream, backend: TcpStream) {
        match (client.into_std(), backend.into_std()) {
            (Ok(client), Ok(backend)) => self
                .handed
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(HandedConnection { client, backend }),
            (c, b) => {
                let e = c.err().or(b.err());
                tracing::warn!(error = ?e, "a paused connection's sockets cannot leave the reactor: closed");
                self.note_lost();
            }
        }
    }
}

/// One proxied TCP connection passed from one process to the next by a
/// hand-over ([`Listener::hand_over`] → [`Listener::adopt`]).
///
/// The two sockets are the whole of it: both directions were paused with
/// no byte held outside them, so whatever was sent and not yet forwarded
/// waits in their receive queues, and a direction that had ended is seen
/// ended again (its source reads end of stream). The rest is read from the
/// sockets: the VIP:port is the client socket's local address (which
/// listener adopts it), the client its peer address, the backend the
/// backend socket's peer address (its load balancer is the adopting
/// listener's). Both sockets are non-blocking.
///
/// Kept between two processes (systemd's store), each socket stays open
/// while any copy of it is: the next process must have the store forget
/// both once it adopted them, or closing them would not end the
/// connection. A store that drops a socket on `POLLHUP` loses a connection
/// whose socket was shut both ways during the gap (one direction had ended
/// before the pause, the other's end arrived after it) with its last bytes
/// unread; the other socket of such a pair is then alone, and is best
/// reset (`SO_LINGER` 0) rather than closed.
#[derive(Debug)]
pub struct HandedConnection {
    /// The client's socket, accepted on the VIP:port.
    pub client: std::net::TcpStream,
    /// The socket connected to the backend's nodeport.
    pub backend: std::net::TcpStream,
}

impl HandedConnection {
    /// Closes both sockets with a reset, for a connection no listener of
    /// the next process adopts (its VIP:port is gone from the config): a
    /// client must not take a clean end of stream for a complete answer.
    pub fn reset(self) {
        for s in [&self.client, &self.backend] {
            if let Err(e) = socket2::SockRef::from(s).set_linger(Some(Duration::ZERO)) {
                tracing::debug!(error = %e, "cannot set SO_LINGER");
            }
        }
    }
}

/// What [`Listener::hand_over`] passed on.
#[derive(Debug, Default)]
pub struct HandedOver {
    /// The connections paused by the deadline, for the next process.
    pub connections: Vec<HandedConnection>,
    /// Connections still open at the deadline (a peer not reading the
    /// bytes in flight, a connect still under way), closed as a drain
    /// closes them.
    pub lost: usize,
}

/// Accept failures that back off, one line a second per cause (errno) for
/// the whole process.
static ACCEPT_LOG: LazyLock<LogLimit<Option<i32>>> =
    LazyLock::new(|| LogLimit::new(1, Duration::from_secs(1)));

/// How long the accept loop pauses when the process or system is out of
/// descriptors or memory, so it does not spin while connections close.
const ACCEPT_BACKOFF: Duration = Duration::from_millis(50);

/// Opens the listening sockets of `addr`: `count` of them, one per runtime
/// of a [`Placement`], each with its own accept queue of `backlog`.
///
/// `IP_FREEBIND` lets the daemon bind a VIP that keepalived or kube-vip has not
/// moved onto this host yet; `SO_REUSEADDR` lets a restarted daemon bind while
/// old connections are in `TIME_WAIT`. More than one socket takes
/// `SO_REUSEPORT`, so the kernel spreads new connections among them; one
/// socket does not, so a port held by another process is an error, not a
/// share.
///
/// `SO_REUSEPORT` would also join a group another process of the same user
/// already listens in (the kernel would then split the VIP's connections
/// with it), so before binding more than one socket a plain socket, without
/// `SO_REUSEPORT`, is bound to `addr` and closed: any listener there, with
/// the option or without, makes it fail with `EADDRINUSE`, the very error
/// one socket meets. What remains is a window of a few system calls between
/// the probe and our sockets in which another process of the same user
/// could bind with `SO_REUSEPORT` first; a process of another user cannot
/// join at all (the kernel requires one effective uid in a group).
pub fn bind(
    addr: SocketAddr,
    backlog: u32,
    count: usize,
) -> io::Result<Vec<std::net::TcpListener>> {
    if count > 1 {
        drop(unshared(addr)?);
    }
    (0..count.max(1))
        .map(|_| bind_one(addr, backlog, count > 1))
        .collect()
}

/// A socket bound to `addr` as one listener's socket would be (without
/// `SO_REUSEPORT`): it fails where `addr` is taken.
fn unshared(addr: SocketAddr) -> io::Result<Socket> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM.nonblocking(), None)?;
    prepare(&socket, addr, false)?;
    socket.bind(&addr.into())?;
    Ok(socket)
}

fn prepare(socket: &Socket, addr: SocketAddr, reuse_port: bool) -> io::Result<()> {
    socket.set_reuse_address(true)?;
    if reuse_port {
        socket.set_reuse_port(true)?;
    }
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
        socket.set_freebind_v6(true)?;
    } else {
        socket.set_freebind_v4(true)?;
    }
    Ok(())
}

fn bind_one(addr: SocketAddr, backlog: u32, reuse_port: bool) -> io::Result<std::net::TcpListener> {
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM.nonblocking(), None)?;
    prepare(&socket, addr, reuse_port)?;
    // Accepted sockets inherit TCP_NODELAY, keepalive and TCP_USER_TIMEOUT
    // from here: set once per listener, not per connection.
    forward::set_options_or_warn(socket2::SockRef::from(&socket));
    socket.bind(&addr.into())?;
    socket.listen(backlog.min(i32::MAX as u32) as i32)?;
    Ok(socket.into())
}

/// A running listener: its accept loop and the connections it accepted.
pub struct Listener {
    /// The VIP:port it is bound to.
    pub addr: SocketAddr,
    /// Its share of the socket budget, given back with the listener.
    placement: Placement,
    /// Where new connections go; swapped on reload.
    route: Arc<ArcSwap<Route>>,
    /// Ends the accept loop (and closes this process's descriptor of the
    /// listening socket).
    stop_accepting: CancellationToken,
    /// Closes the connections still open (drain time over) or pauses them
    /// (hand-over).
    control: Arc<Control>,
    /// The process-wide connection cap, for adopted connections.
    limit: Arc<ConnectionLimit>,
    /// The connection tasks, to wait for them on drain.
    connections: TaskTracker,
    /// The accept loops, waited for once told to stop: a client a loop
    /// accepted just as it was told has its task spawned before the drain
    /// or hand-over counts the connections (else a hand-over could take
    /// the paused ones first and that client's connection would close
    /// with this process, seen by the client as an EOF).
    accepting: TaskTracker,
    /// The listening sockets, to change their options on reload; the accept
    /// loops own them, so they close when the loops end, not when this does.
    sockets: Vec<Weak<TcpListener>>,
}

impl Listener {
    /// Starts accepting on `sockets` (from [`bind`]), socket `i` on
    /// runtime `i` of `placement`, forwarding along `route`. `limit` caps
    /// connections across all listeners of the process; the route's load
    /// balancer caps its own ([`crate::dataplane::balancer::LoadBalancer::connections`]). Fails only if a
    /// socket cannot join its runtime's reactor (out of memory or
    /// descriptors); the sockets are closed then.
    pub fn start(
        sockets: Vec<std::net::TcpListener>,
        placement: Placement,
        route: Route,
        limit: Arc<ConnectionLimit>,
    ) -> io::Result<Self> {
        let addr = sockets
            .first()
            .and_then(|s| s.local_addr().ok())
            .unwrap_or_else(|| "0.0.0.0:0".parse().expect("literal"));
        // Every socket joins its runtime's reactor before any accept loop
        // starts, so a failure leaves nothing running.
        let sockets = sockets
            .into_iter()
            .enumerate()
            .map(|(i, socket)| {
                let runtime = placement.runtime(i).clone();
                let joined = {
                    let _in = runtime.enter();
                    TcpListener::from_std(socket)
                };
                joined.map(|socket| (runtime, Arc::new(socket)))
            })
            .collect::<io::Result<Vec<_>>>()?;
        let listener = Self {
            sockets: sockets.iter().map(|(_, s)| Arc::downgrade(s)).collect(),
            addr,
            placement,
            route: Arc::new(ArcSwap::from_pointee(route)),
            stop_accepting: CancellationToken::new(),
            control: Control::new(),
            limit: Arc::clone(&limit),
            connections: TaskTracker::new(),
            accepting: TaskTracker::new(),
        };
        for (runtime, socket) in sockets {
            listener.accepting.spawn_on(
                accept_loop(
                    socket,
                    Arc::clone(&listener.route),
                    listener.stop_accepting.clone(),
                    Arc::clone(&listener.control),
                    listener.connections.clone(),
                    Arc::clone(&limit),
                )
                .instrument(tracing::info_span!("listener", listen = %addr)),
                &runtime,
            );
        }
        listener.accepting.close();
        Ok(listener)
    }

    /// Sets the operator's socket options (`defer_accept_seconds`) on the
    /// live listening sockets: a reload changes them in place, without a
    /// rebind, for the handshakes from then on. A failure is logged: the
    /// socket keeps serving with the options it had.
    pub fn set_options(&self, options: &listen_options::ListenerOptions) {
        for socket in self.sockets.iter().filter_map(Weak::upgrade) {
            if let Err(e) = options.apply(&*socket) {
                tracing::warn!(listen = %self.addr, error = %e, "listener options not changed");
            }
        }
    }

    /// Sends new connections along `route` from now on; open ones keep theirs.
    pub fn set_route(&self, route: Route) {
        self.route.store(Arc::new(route));
    }

    /// The route in force.
    pub fn route(&self) -> Arc<Route> {
        self.route.load_full()
    }

    /// Connections open now.
    pub fn open_connections(&self) -> usize {
        self.connections.len()
    }

    /// Stops accepting at once (the socket closes, so new clients are refused
    /// by the kernel), lets open connections finish for up to `timeout`, then
    /// closes the rest. Returns how many were closed by the timeout.
    pub async fn drain(self, timeout: Duration) -> usize {
        self.stop_accepting().await;
        self.connections.close();
        if tokio::time::timeout(timeout, self.connections.wait())
            .await
            .is_ok()
        {
            return 0;
        }
        let cut = self.connections.len();
        self.control.close.cancel();
        self.control.wake.cancel();
        self.connections.wait().await;
        cut
    }

    /// Hands the open connections over instead of draining them (the first
    /// half of a restart): stops accepting (this process's descriptors of
    /// the listening sockets close; the copies kept for the next process,
    /// e.g. in systemd's store, keep the port listening and queue new
    /// clients), then pauses every connection where it holds no byte (see
    /// [`copy::bidirectional`]) and returns their sockets.
    ///
    /// A connection still connecting to a backend is let finish its connect
    /// (bounded by `connect_timeout` per attempt) and pauses as soon as its
    /// copy starts: the next process gets only connections that are
    /// copying, never one without its backend. A connection not paused by
    /// `deadline` (a peer that does not read what is in flight, a connect
    /// still under way) is closed as the drain closes it and counted in
    /// [`HandedOver::lost`]; the call returns once those have closed too.
    pub async fn hand_over(self, deadline: tokio::time::Instant) -> HandedOver {
        self.stop_accepting().await;
        self.connections.close();
        self.control.handing_over.store(true, Ordering::Relaxed);
        self.control.wake.cancel();
        if tokio::time::timeout_at(deadline, self.connections.wait())
            .await
            .is_err()
        {
            self.control.close.cancel();
            self.connections.wait().await;
        }
        let connections = std::mem::take(
            &mut *self
                .control
                .handed
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        HandedOver {
            connections,
            lost: self.control.lost.load(Ordering::Relaxed),
        }
    }

    /// Tells the accept loops to stop and waits until they have: each
    /// returns at its next wait, so this is as quick as a wake-up, and
    /// every client accepted before has its connection task.
    async fn stop_accepting(&self) {
        self.stop_accepting.cancel();
        self.accepting.wait().await;
    }

    /// Whether a connection accepted on `vip` is this listener's (its own
    /// address, or any of its family's with the port, for a wildcard one).
    fn serves(&self, vip: SocketAddr) -> bool {
        vip == self.addr
            || (self.addr.ip().is_unspecified()
                && vip.port() == self.addr.port()
                && vip.is_ipv4() == self.addr.is_ipv4())
    }

    /// Serves connections another process handed over (see
    /// [`HandedConnection`]) as if this listener had accepted them: their
    /// copy goes on, counted in the listener's `active`, holding a slot of
    /// the process's and the load balancer's caps and, when the backend
    /// (by the backend socket's peer address) is a member of the route's
    /// load balancer, counted in its connections and cut by its mark-down
    /// or removal as any connection. Their idle timeout starts again;
    /// keepalive and `TCP_USER_TIMEOUT` are set on the backend leg (the
    /// client leg has the listener's). A backend no longer in the config:
    /// served to the connection's end, in no backend's count. A cap
    /// already full (a config that lowered it): served all the same,
    /// without a slot. Connections are spread over the listener's runtimes
    /// in turn. The caller matches each to this listener by the client
    /// socket's local address; one whose local address is not this
    /// listener's VIP:port (or that is no TCP socket) is reset, warned and
    /// not counted in the number returned, which is how many are served.
    pub fn adopt(&self, connections: Vec<HandedConnection>) -> usize {
        let route = self.route.load_full();
        let lb = &route.lb;
        let mut count = 0;
        let mut over_cap = 0;
        for handed in connections {
            match handed.client.local_addr() {
                Ok(vip) if self.serves(vip) => {}
                other => {
                    tracing::warn!(listen = %self.addr, vip = ?other, "a handed-over connection of another listener: reset");
                    handed.reset();
                    continue;
                }
            }
            let lb_slot = Slot::take(lb.connections());
            let permit = Arc::clone(&self.limit.slots).try_acquire_owned().ok();
            if lb_slot.is_none() || permit.is_none() {
                over_cap += 1;
            }
            let held = Held {
                lb: Arc::clone(lb),
                lb_slot,
                limit: Arc::clone(&self.limit),
                permit,
            };
            let runtime = self.placement.runtime(count % self.placement.sockets());
            count += 1;
            let span = tracing::debug_span!("conn", adopted = true);
            self.connections.spawn_on(
                forward::serve_adopted(handed, Arc::clone(&route), Arc::clone(&self.control), held)
                    .instrument(span),
                runtime,
            );
        }
        if over_cap > 0 {
            tracing::warn!(
                listen = %self.addr,
                over_cap,
                "handed-over connections beyond a connection cap: served to their end without a slot"
            );
        }
        count
    }
}

async fn accept_loop(
    socket: Arc<TcpListener>,
    route: Arc<ArcSwap<Route>>,
    stop: CancellationToken,
    control: Arc<Control>,
    connections: TaskTracker,
    limit: Arc<ConnectionLimit>,
) {
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            r = socket.accept() => r,
        };
        match accepted {
            Ok((stream, peer)) => {
                // `source_ranges` first: a client outside them is reset
                // before it can take a connection slot, a task or a backend
                // connect (one atomic load of the snapshot and a binary search).
                {
                    let current = route.load();
                    if !current
                        .lb
                        .snapshot()
                        .settings
                        .source_ranges
                        .allows(peer.ip())
                    {
                        current.stats.rejected[RejectedReason::SourceRange].increment(1);
                        tracing::debug!(client = %peer, "client outside source_ranges: reset");
                        forward::reset(&stream);
                        forward::log_refused(&current, &stream, peer, SourceRefused);
                        continue;
                    }
                }
                // The load balancer's share first: a tenant at its cap is
                // refused at once (its other clients keep their
                // connections; other tenants keep accepting), before it
                // can queue for a process-wide slot.
                let lb = Arc::clone(&route.load().lb);
                let Some(lb_slot) = Slot::take(lb.connections()) else {
                    route.load().stats.rejected[RejectedReason::LoadBalancerLimit].increment(1);
                    note_lb_cap(&lb, Cap::Connections, true);
                    tracing::debug!(client = %peer, "load balancer at its connection cap: reset");
                    forward::reset(&stream);
                    forward::log_refused(&route.load(), &stream, peer, ConnectionCap);
                    continue;
                };
                // The slot is taken after the accept, never held while
                // waiting for one: with more listeners than slots, idle
                // listeners holding slots would starve the busy ones.
                let permit = match Arc::clone(&limit.slots).try_acquire_owned() {
                    Ok(p) => p,
                    Err(_) => {
                        // At the cap: this client waits here for a slot,
                        // the ones behind it in the kernel's backlog.
                        route.load().stats.limit_reached.increment(1);
                        limit.note_full();
                        tokio::select! {
                            _ = stop.cancelled() => return,
                            p = Arc::clone(&limit.slots).acquire_owned() => match p {
                                Ok(p) => p,
                                Err(_) => return, // semaphore closed: process is stopping
                            },
                        }
                    }
                };
                let held = Held {
                    lb,
                    lb_slot: Some(lb_slot),
                    limit: Arc::clone(&limit),
                    permit: Some(permit),
                };
                let route = route.load_full();
                let span = tracing::debug_span!("conn", client = %peer);
                connections.spawn(
                    forward::serve(stream, peer, route, Arc::clone(&control), held)
                        .instrument(span),
                );
            }
            Err(e) => {
                let (kind, back_off) = match e.raw_os_error() {
                    Some(libc::EMFILE) | Some(libc::ENFILE) => {
                        (AcceptErrorKind::OutOfDescriptors, true)
                    }
                    Some(libc::ENOBUFS) | Some(libc::ENOMEM) => {
                        (AcceptErrorKind::OutOfMemory, true)
                    }
                    _ => (AcceptErrorKind::Other, false),
                };
                route.load().stats.accept_errors[kind].increment(1);
                if back_off {
                    // Spare pipes hold descriptors: give them back first.
                    copy::release_spare_pipes();
                    // Warn at most once a second per cause, across every
                    // listener: out of descriptors, 2,000 listeners fail
                    // together, 20 times a second each.
                    if let Verdict::Write { suppressed } = ACCEPT_LOG.check(e.raw_os_error()) {
                        tracing::warn!(
                            error = %e,
                            "accept failed; backing off until resources free up{}",
                            left_out(suppressed)
                        );
                    }
                    tokio::select! {
                        _ = stop.cancelled() => return,
                        _ = tokio::time::sleep(ACCEPT_BACKOFF) => {}
                    }
                } else {
                    tracing::debug!(error = %e, "accept failed (client gone before accept)");
                }
            }
        }
    }
}

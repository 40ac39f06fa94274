//! UDP listeners: datagrams forwarded along flows, one flow per client
//! address (IP and port) and listener.
//!
//! A flow's first datagram picks a backend from the same snapshot the TCP
//! path reads (algorithm, affinity, eligible set), and gets a socket of its
//! own, connected to that backend: the kernel then delivers only that
//! backend's answers to it and reports its ICMP port-unreachable as
//! `ECONNREFUSED`. Answers go back to the client through the listener's
//! socket, which is bound to the VIP:port itself (never the wildcard), so
//! they come from the address the client wrote to, as DNS resolvers check.
//!
//! What this module must never do: grow without bound (the [`table`] refuses
//! flows past `proxy.max_udp_flows`, the load balancer's share and the
//! per-source share), hold a buffer
//! for an idle flow (answers are read into the worker thread's scratch
//! buffer only once the socket is readable), or cut a datagram (the
//! buffers hold the largest UDP payload there is).
//!
//! A reload that keeps the listener keeps its socket and its flows; a flow
//! whose backend is no longer eligible (down, drained, removed) or refused
//! (ICMP) is re-picked at its next datagram. UDP has no connection to
//! drain: a removed listener ends its flows at once.

pub mod flow;
#[cfg(test)]
mod hand_over_tests;
pub mod table;

use std::cell::RefCell;
use std::io;
use std::net::{IpAddr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use arc_swap::ArcSwap;
use socket2::{Domain, SockRef, Socket, Type};
use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;
use tracing::Instrument;

use self::flow::FlowState;
pub use self::table::{FlowBudget, default_max_flows};
use self::table::{FlowTable, Refusal};
use super::{Cap, Route, note_lb_cap};
use crate::config::UdpSettings;
use crate::dataplane::balancer::{Backend, ClientAddr, ConnectionGuard, LoadBalancer, affinity};
use crate::dataplane::proxy::log::{AttemptFailure, Bytes, Origin, Record, Termination};
use crate::metrics::stats::{DatagramDropReason, Direction, FlowDropReason, UdpBackendStats};

/// The largest UDP payload over IPv4 (65,535 − 8 − 20). Every datagram up
/// to it is forwarded whole.
pub const MAX_DATAGRAM: usize = 65_507;
/// Receive buffers hold a little more than any UDP payload (IPv6 allows
/// 65,527 bytes), so the kernel never truncates what it hands over.
const BUFFER: usize = 65_536;
/// The listening socket's receive buffer asked for: a burst of queries
/// waits in the kernel while the listener task is busy (the kernel caps it
/// at `net.core.rmem_max`).
const LISTEN_RCVBUF: usize = 4 << 20;
/// How often a listener forgets the per-backend numbers of backends that
/// left and have no flow.
const PRUNE_EVERY: Duration = Duration::from_secs(10);
/// How long the receive loop pauses after a resource error.
const ERROR_BACKOFF: Duration = Duration::from_millis(50);

/// Opens a UDP socket bound to `addr` itself, so every answer leaves from
/// the VIP:port the client wrote to. `IP_FREEBIND` as for TCP listeners;
/// no `SO_REUSEADDR`, which for UDP would let a second daemon share the
/// port and take half of the datagrams.
pub fn bind(addr: SocketAddr) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(addr), Type::DGRAM.nonblocking(), None)?;
    if addr.is_ipv6() {
        socket.set_only_v6(true)?;
        socket.set_freebind_v6(true)?;
    } else {
        socket.set_freebind_v4(true)?;
    }
    if let Err(e) = socket.set_recv_buffer_size(LISTEN_RCVBUF) {
        tracing::warn!(listen = %addr, error = %e, "cannot enlarge the UDP receive buffer; bursts may be dropped by the kernel");
    }
    socket.bind(&addr.into())?;
    UdpSocket::from_std(socket.into())
}

/// What a UDP listener forwards to: the route every listener has, and the
/// flow rules of its load balancer. Swapped as one on reload.
struct UdpRoute {
    route: Route,
    settings: UdpSettings,
}

/// A running UDP listener: its socket, its receive loop and its flows.
pub struct UdpListener {
    /// The VIP:port it is bound to.
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    /// The receive loop and the flows' tasks.
    tasks: TaskTracker,
}

/// What the receive loop and every flow task of one listener share.
struct Shared {
    socket: UdpSocket,
    route: ArcSwap<UdpRoute>,
    table: FlowTable<Flow>,
    per_source: AtomicU64,
    /// Cancelled when the listener stops: the loop and every flow end.
    stop: CancellationToken,
    /// The zero of the flows' `last_seen` clocks.
    epoch: Instant,
    /// Set before `stop` for a hand-over: the flows stop without closing.
    handing_over: AtomicBool,
}

/// One client address's flow to one backend.
struct Flow {
    client: SocketAddr,
    /// The load balancer whose snapshot picked it: a route to another one
    /// (a listener moved between load balancers) re-picks.
    lb: Arc<LoadBalancer>,
    backend: Arc<Backend>,
    /// Connected to the backend's nodeport.
    socket: UdpSocket,
    state: FlowState,
    /// Milliseconds since the listener's epoch at the last datagram either way.
    last_seen: AtomicU64,
    /// The backend answered with ICMP port-unreachable: re-pick at the next
    /// datagram.
    refused: AtomicBool,
    /// Wakes the task when someone else closed the flow.
    closed: Notify,
    backend_stats: Arc<UdpBackendStats>,
    /// Its connection log line, written when it ends (empty when its load
    /// balancer logs nothing).
    record: Record,
    /// Payload bytes client to backend and back, and whether the backend
    /// answered at all, for that line.
    bytes_up: AtomicU64,
    bytes_down: AtomicU64,
    answered: AtomicBool,
    /// Counts the flow with the backend's connections (least_connections,
    /// `/status`) for as long as the flow lives.
    _guard: ConnectionGuard,
}

impl Flow {
    /// A flow of `client` to `backend` (a member of `lb`) over `socket`,
    /// connected to it at `target`, last seen `now`; counted with the
    /// backend's connections from now on.
    fn new(
        (client, target): (SocketAddr, SocketAddr),
        lb: &Arc<LoadBalancer>,
        backend: &Arc<Backend>,
        socket: UdpSocket,
        log: crate::config::LogConnections,
        now: u64,
        udp: &crate::metrics::stats::UdpStats,
    ) -> Arc<Self> {
        let mut record = Record::start(log, client);
        record.connected(target);
        Arc::new(Flow {
            client,
            record,
            bytes_up: AtomicU64::new(0),
            bytes_down: AtomicU64::new(0),
            answered: AtomicBool::new(false),
            lb: Arc::clone(lb),
            socket,
            state: FlowState::default(),
            last_seen: AtomicU64::new(now),
            refused: AtomicBool::new(false),
            closed: Notify::new(),
            backend_stats: udp.backend(backend.addr),
            _guard: backend.connection_opened(),
            backend: Arc::clone(backend),
        })
    }
}

/// One UDP flow passed from one process to the next by a hand-over
/// ([`UdpListener::hand_over`] → [`UdpListener::adopt`]): the client's
/// address, which no socket holds (the listener's socket is shared by all
/// clients), and the flow's own socket, connected to the backend (its peer
/// address says which). Answers the backend sent meanwhile wait in that
/// socket; the client's datagrams wait in the listener's socket, which the
/// next process receives on its own. The socket is non-blocking.
#[derive(Debug)]
pub struct HandedFlow {
    /// The client's address and port, as the listener's socket saw it.
    pub client: SocketAddr,
    /// The flow's socket, connected to the backend's nodeport.
    pub backend: std::net::UdpSocket,
}

/// What [`UdpListener::adopt`] did with the flows it was given.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct AdoptedFlows {
    /// Flows served on, each with its backend.
    pub adopted: usize,
    /// Flows closed instead: their backend is no longer a member of the
    /// load balancer, a cap is full, or the socket was unusable. The
    /// client's next datagram makes a new flow, as after a reload that
    /// removed the backend.
    pub dropped: usize,
}

impl UdpListener {
    /// Starts serving `socket` along `route` with the flow rules `settings`;
    /// flows are bounded by `budget`, the load balancer's share and
    /// `per_source` per source (IPv4 address, IPv6 /64).
    pub fn start(
        socket: UdpSocket,
        route: Route,
        settings: UdpSettings,
        budget: Arc<FlowBudget>,
        per_source: usize,
    ) -> Self {
        Self::adopt(socket, route, settings, budget, per_source, Vec::new()).0
    }

    /// [`start`](Self::start), serving on the flows another process
    /// handed over (see [`HandedFlow`]) from the first datagram: they are
    /// in the table before the receive loop starts, so a client's next
    /// datagram goes to its backend, not to a new pick. An adopted flow
    /// keeps its backend while the backend stays eligible (as any flow),
    /// holds a slot of each flow cap, counts in the backend's connections,
    /// and its idle timeout starts again. With `udp_responses` set, the
    /// answers it still expected are not known here: its next answer
    /// closes it, unless a datagram is sent on it first.
    pub fn adopt(
        socket: UdpSocket,
        route: Route,
        settings: UdpSettings,
        budget: Arc<FlowBudget>,
        per_source: usize,
        flows: Vec<HandedFlow>,
    ) -> (Self, AdoptedFlows) {
        let addr = socket
            .local_addr()
            .unwrap_or_else(|_| "0.0.0.0:0".parse().expect("literal"));
        // Made now, so the listener's series exist before its first datagram.
        route.stats.udp();
        let shared = Arc::new(Shared {
            socket,
            route: ArcSwap::from_pointee(UdpRoute { route, settings }),
            table: FlowTable::new(budget),
            per_source: AtomicU64::new(per_source as u64),
            stop: CancellationToken::new(),
            epoch: Instant::now(),
            handing_over: AtomicBool::new(false),
        });
        let tasks = TaskTracker::new();
        let mut report = AdoptedFlows::default();
        for handed in flows {
            match adopt_flow(&shared, handed) {
                Some(flow) => {
                    report.adopted += 1;
                    tasks.spawn(run_flow(Arc::clone(&shared), flow));
                }
                None => report.dropped += 1,
            }
        }
        tasks.spawn(
            receive_loop(Arc::clone(&shared), tasks.clone())
                .instrument(tracing::info_span!("udp_listener", listen = %addr)),
        );
        (
            Self {
                addr,
                shared,
                tasks,
            },
            report,
        )
    }

    /// Hands the flows over instead of ending them (the first half of a
    /// restart): the receive loop and every flow's task stop, and each
    /// flow's socket is taken out, open, with its client's address. This
    /// process's descriptor of the listener's socket closes; the copy kept
    /// for the next process (e.g. in systemd's store) queues the clients'
    /// datagrams meanwhile. Nothing waits on a peer, so this takes no
    /// deadline.
    pub async fn hand_over(self) -> Vec<HandedFlow> {
        self.shared.handing_over.store(true, Ordering::Release);
        self.shared.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        let mut handed = Vec::new();
        for flow in self.shared.table.all() {
            if !flow.state.close() {
                continue;
            }
            retire(&self.shared, &flow, false);
            let client = flow.client;
            let socket = match Arc::try_unwrap(flow) {
                Ok(flow) => flow.socket.into_std(),
                // Still shared (not expected once the tasks ended): a
                // duplicate of the descriptor goes instead.
                Err(flow) => SockRef::from(&flow.socket)
                    .try_clone()
                    .map(std::net::UdpSocket::from),
            };
            match socket {
                Ok(backend) => handed.push(HandedFlow { client, backend }),
                Err(e) => {
                    tracing::warn!(client = %client, error = %e, "a UDP flow's socket cannot be handed over: closed");
                }
            }
        }
        handed
    }

    /// New flows follow `route` and every flow `settings` from now on; open
    /// flows keep their backend while it stays eligible.
    pub fn set_route(&self, route: Route, settings: UdpSettings) {
        route.stats.udp();
        self.shared
            .route
            .store(Arc::new(UdpRoute { route, settings }));
    }

    /// Sets the per-source cap (a reload).
    pub fn set_per_source(&self, per_source: usize) {
        self.shared
            .per_source
            .store(per_source as u64, Ordering::Relaxed);
    }

    /// The route in force.
    pub fn route(&self) -> Arc<Route> {
        // `Route` is shared by value with the TCP side; hand out a copy of
        // the handles (a few `Arc` clones, only on reload and status).
        let r = self.shared.route.load();
        Arc::new(Route {
            lb: Arc::clone(&r.route.lb),
            listener: r.route.listener.clone(),
            backend_port: r.route.backend_port,
            stats: Arc::clone(&r.route.stats),
            proxy_protocol: r.route.proxy_protocol,
        })
    }

    /// The flow rules in force.
    pub fn settings(&self) -> UdpSettings {
        self.shared.route.load().settings
    }

    /// Flows open now.
    pub fn flows(&self) -> usize {
        self.shared.table.len()
    }

    /// Stops at once: the socket closes and every flow ends (UDP has no
    /// connection to drain, and an answer could not reach the client
    /// through a closed socket anyway). Returns how many flows were ended.
    pub async fn stop(self) -> usize {
        let open = self.shared.table.len();
        self.shared.stop.cancel();
        self.tasks.close();
        self.tasks.wait().await;
        open
    }
}

thread_local! {
    /// The worker thread's buffer for backends' answers: a flow holds none
    /// while it waits.
    static SCRATCH: RefCell<Vec<u8>> = RefCell::new(vec![0; BUFFER]);
}

async fn receive_loop(shared: Arc<Shared>, tasks: TaskTracker) {
    let mut buf = vec![0u8; BUFFER];
    let mut prune = tokio::time::interval(PRUNE_EVERY);
    prune.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut last_warning: Option<Instant> = None;
    loop {
        let received = tokio::select! {
            _ = shared.stop.cancelled() => break,
            _ = prune.tick() => {
                prune_backend_stats(&shared);
                continue;
            }
            r = shared.socket.recv_from(&mut buf) => r,
        };
        match received {
            Ok((n, client)) => forward(&shared, &tasks, &buf[..n], client),
            Err(e) => {
                let resource = matches!(
                    e.raw_os_error(),
                    Some(libc::ENOMEM | libc::ENOBUFS | libc::EMFILE | libc::ENFILE)
                );
                if resource {
                    let now = Instant::now();
                    if last_warning.is_none_or(|t| now.duration_since(t) >= Duration::from_secs(1))
                    {
                        tracing::warn!(error = %e, "UDP receive failed; backing off");
                        last_warning = Some(now);
                    }
                    tokio::select! {
                        _ = shared.stop.cancelled() => break,
                        _ = tokio::time::sleep(ERROR_BACKOFF) => {}
                    }
                } else {
                    tracing::debug!(error = %e, "UDP receive failed");
                }
            }
        }
    }
    if shared.handing_over.load(Ordering::Acquire) {
        // The flows go to the next process open.
        return;
    }
    for flow in shared.table.all() {
        if flow.state.close() {
            retire(&shared, &flow, true);
            log_flow_end(&shared, &flow, Termination::Drained);
        }
    }
}

/// Puts a handed-over flow into the table, with its backend looked up by
/// the socket's peer address among the load balancer's members. `None`
/// (the socket closed) when the backend is gone, a cap is full or the
/// socket is unusable.
fn adopt_flow(shared: &Shared, handed: HandedFlow) -> Option<Arc<Flow>> {
    let HandedFlow { client, backend } = handed;
    let route = shared.route.load();
    let udp = route.route.stats.udp();
    let lb = &route.route.lb;
    let target = match backend.peer_addr() {
        Ok(t) => t,
        Err(e) => {
            tracing::debug!(client = %client, error = %e, "handed-over UDP flow without a connected socket: dropped");
            return None;
        }
    };
    let Some(member) = lb.members().into_iter().find(|b| b.addr == target.ip()) else {
        tracing::debug!(client = %client, backend = %target, "handed-over UDP flow to a backend no longer configured: dropped; the next datagram picks anew");
        return None;
    };
    let log = lb.snapshot().settings.log_connections;
    let per_source = shared.per_source.load(Ordering::Relaxed) as usize;
    let now = now_ms(shared.epoch);
    let admitted = shared.table.insert(client, per_source, lb.udp_flows(), || {
        match UdpSocket::from_std(backend) {
            Ok(socket) => Some(Flow::new(
                (client, target),
                lb,
                &member,
                socket,
                log,
                now,
                udp,
            )),
            Err(e) => {
                tracing::debug!(client = %client, error = %e, "handed-over UDP flow's socket cannot join the reactor: dropped");
                None
            }
        }
    });
    match admitted {
        Ok(Some(flow)) => {
            udp.flows_active.increment();
            flow.backend_stats.flows_active.increment();
            Some(flow)
        }
        Ok(None) => None,
        Err(refusal) => {
            tracing::warn!(client = %client, ?refusal, "handed-over UDP flow over a flow cap: dropped; the next datagram is refused or picks anew");
            None
        }
    }
}

/// Forgets the per-backend numbers of backends that left their load
/// balancer and have no flow, so their series go.
fn prune_backend_stats(shared: &Shared) {
    let route = shared.route.load();
    let members: Vec<IpAddr> = route.route.lb.members().iter().map(|b| b.addr).collect();
    route
        .route
        .stats
        .udp()
        .retain_backends(|ip| members.contains(&ip));
}

/// Sends one client datagram along its flow, making or re-picking the flow
/// when needed.
fn forward(shared: &Arc<Shared>, tasks: &TaskTracker, datagram: &[u8], client: SocketAddr) {
    let route = shared.route.load();
    let udp = route.route.stats.udp();
    if datagram.len() > MAX_DATAGRAM {
        // Only IPv6 carries more; an IPv4 backend could not take it whole.
        udp.datagrams_dropped[DatagramDropReason::TooLarge].increment(1);
        return;
    }
    let answers = route.settings.responses.map_or(0, |n| n.get());
    let now = now_ms(shared.epoch);
    let mut avoid = None;
    if let Some(flow) = shared.table.get(&client) {
        if flow_usable(&flow, &route.route) {
            flow.last_seen.store(now, Ordering::Relaxed);
            if flow.state.begin_send(answers) {
                match send(&flow, datagram, &route) {
                    Sent::Ok => return,
                    Sent::Refused => avoid = Some(flow.backend.addr),
                    Sent::Dropped => return,
                }
            }
        } else if !flow.state.is_closed() {
            // Refused, ineligible, or another load balancer's: not again.
            avoid = Some(flow.backend.addr);
        }
        // Closed, refused, or its backend left: a new flow replaces it.
        if flow.state.close() {
            retire(shared, &flow, true);
            let state = if flow.refused.load(Ordering::Acquire) {
                Termination::BackendReset
            } else {
                Termination::BackendDown
            };
            log_flow_end(shared, &flow, state);
        } else {
            // Closed by its task a moment ago; the task retires it.
            shared.table.remove(&flow.client, &flow);
        }
    }
    let Some(flow) = new_flow(shared, &route, client, avoid, now) else {
        return;
    };
    let task_flow = Arc::clone(&flow);
    let task_shared = Arc::clone(shared);
    tasks.spawn(run_flow(task_shared, task_flow));
    if flow.state.begin_send(answers) {
        let _ = send(&flow, datagram, &route);
    }
}

/// Whether a flow can carry the next datagram: open, not refused, and its
/// backend still eligible in the load balancer the listener serves.
fn flow_usable(flow: &Flow, route: &Route) -> bool {
    !flow.state.is_closed()
        && !flow.refused.load(Ordering::Acquire)
        && Arc::ptr_eq(&flow.lb, &route.lb)
        && route
            .lb
            .snapshot()
            .eligible_for(route.backend_port)
            .iter()
            .any(|b| Arc::ptr_eq(b, &flow.backend))
}

enum Sent {
    Ok,
    /// ICMP port-unreachable reported on this send: re-pick.
    Refused,
    Dropped,
}

fn send(flow: &Flow, datagram: &[u8], route: &UdpRoute) -> Sent {
    let udp = route.route.stats.udp();
    // Straight to the kernel: tokio's `try_send` answers `WouldBlock` on a
    // socket whose first readiness event has not been polled yet, which a
    // new flow's socket never has.
    match SockRef::from(&flow.socket).send(datagram) {
        Ok(n) => {
            udp.datagrams[Direction::ClientToBackend].increment(1);
            udp.bytes[Direction::ClientToBackend].increment(n as u64);
            flow.backend.stats().bytes[Direction::ClientToBackend].increment(n as u64);
            flow.bytes_up.fetch_add(n as u64, Ordering::Relaxed);
            Sent::Ok
        }
        Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
            flow.backend_stats.icmp_errors.increment(1);
            flow.refused.store(true, Ordering::Release);
            tracing::debug!(client = %flow.client, backend = %flow.backend.addr, "backend port unreachable; re-picking the flow");
            Sent::Refused
        }
        Err(e) => {
            let reason = if e.raw_os_error() == Some(libc::EMSGSIZE) {
                DatagramDropReason::TooLarge
            } else {
                DatagramDropReason::SendFailed
            };
            udp.datagrams_dropped[reason].increment(1);
            tracing::debug!(client = %flow.client, error = %e, "datagram to backend dropped");
            Sent::Dropped
        }
    }
}

/// Admits and makes a flow for `client`: source ranges, the per-source
/// share, the budget, a backend (not `avoid` while another is eligible),
/// a connected socket. `None` (counted) when any of them says no.
fn new_flow(
    shared: &Shared,
    route: &UdpRoute,
    client: SocketAddr,
    avoid: Option<IpAddr>,
    now: u64,
) -> Option<Arc<Flow>> {
    let udp = route.route.stats.udp();
    let lb = &route.route.lb;
    let snapshot = lb.snapshot();
    let client_addr = ClientAddr::new(client);
    let log = snapshot.settings.log_connections;
    if !snapshot.settings.source_ranges.allows(client.ip()) {
        udp.datagrams_dropped[DatagramDropReason::SourceRange].increment(1);
        refused(
            shared,
            route,
            Record::start(log, client),
            Termination::SourceRefused,
        );
        return None;
    }
    let affinity = snapshot
        .settings
        .affinity_timeout
        .and_then(|timeout| lb.affinity().map(|table| (table, timeout)));
    let now_secs = affinity.map_or(0, |_| affinity::now_secs());
    let sticky = affinity.and_then(|(table, timeout)| table.lookup(client_addr, timeout, now_secs));
    let backend = {
        let mut candidates =
            snapshot.candidates(client_addr, lb.cursor(), sticky, route.route.backend_port);
        let first = candidates.next();
        match (first, avoid) {
            (Some(b), Some(a)) if b.addr == a => candidates.next().or(first),
            (b, _) => b,
        }
        .cloned()
    };
    let Some(backend) = backend else {
        udp.flows_dropped[FlowDropReason::NoBackend].increment(1);
        refused(
            shared,
            route,
            Record::start(log, client),
            Termination::NoBackend,
        );
        return None;
    };
    drop(snapshot);
    let target = SocketAddr::new(backend.addr, route.route.backend_port);
    let per_source = shared.per_source.load(Ordering::Relaxed) as usize;
    let mut socket_error = None;
    let mut record = Record::start(log, client);
    let admitted = shared.table.insert(client, per_source, lb.udp_flows(), || {
        let socket = match connect(target) {
            Ok(s) => s,
            Err(e) => {
                socket_error = Some(e);
                return None;
            }
        };
        Some(Flow::new(
            (client, target),
            lb,
            &backend,
            socket,
            log,
            now,
            udp,
        ))
    });
    match admitted {
        Ok(Some(flow)) => {
            udp.flows_created.increment(1);
            udp.flows_active.increment();
            flow.backend_stats.flows_active.increment();
            if let Some((table, _)) = affinity
                && sticky != Some(backend.addr)
            {
                table.remember(client_addr, backend.addr, now_secs);
            }
            Some(flow)
        }
        Ok(None) => {
            udp.flows_dropped[FlowDropReason::NoSocket].increment(1);
            if let Some(e) = socket_error {
                tracing::debug!(client = %client, backend = %target, error = %e, "no socket for a UDP flow; datagram dropped");
            }
            record.failed(target, AttemptFailure::NoSocket);
            refused(shared, route, record, Termination::ConnectFailed);
            None
        }
        Err(refusal) => {
            let reason = match refusal {
                Refusal::TableFull => FlowDropReason::TableFull,
                Refusal::SourceLimit => FlowDropReason::SourceLimit,
                Refusal::LoadBalancerLimit => {
                    note_lb_cap(lb, Cap::UdpFlows, true);
                    FlowDropReason::LoadBalancerLimit
                }
            };
            udp.flows_dropped[reason].increment(1);
            refused(shared, route, record, Termination::TableFull);
            None
        }
    }
}

/// Writes the line of a datagram whose flow could not be made (`state`
/// says why), if the load balancer logs connections.
fn refused(shared: &Shared, route: &UdpRoute, record: Record, state: Termination) {
    if !record.wants(state, false) {
        return;
    }
    let origin = Origin {
        load_balancer: &route.route.lb.name,
        cluster: &route.route.lb.cluster,
        listener: &route.route.listener,
        vip: shared.socket.local_addr().ok(),
        protocol: "udp",
    };
    record.finish(state, &origin, Bytes::default(), false);
}

/// Writes the line of a flow that ended (`state` says how), if its load
/// balancer logs connections.
fn log_flow_end(shared: &Shared, flow: &Flow, state: Termination) {
    let answered = flow.answered.load(Ordering::Relaxed);
    if !flow.record.wants(state, answered) {
        return;
    }
    let route = shared.route.load();
    let origin = Origin {
        load_balancer: &flow.lb.name,
        cluster: &flow.lb.cluster,
        listener: &route.route.listener,
        vip: shared.socket.local_addr().ok(),
        protocol: "udp",
    };
    let bytes = Bytes {
        client_to_backend: flow.bytes_up.load(Ordering::Relaxed),
        backend_to_client: flow.bytes_down.load(Ordering::Relaxed),
    };
    flow.record.finish(state, &origin, bytes, answered);
}

/// A socket connected to `target`: it receives only that backend's
/// datagrams, and the backend's ICMP errors.
fn connect(target: SocketAddr) -> io::Result<UdpSocket> {
    let socket = Socket::new(Domain::for_address(target), Type::DGRAM.nonblocking(), None)?;
    socket.connect(&target.into())?;
    UdpSocket::from_std(socket.into())
}

/// Takes a closed flow out of the table and its numbers (once: only the
/// caller that closed it calls this), and wakes its task if `wake`.
fn retire(shared: &Shared, flow: &Arc<Flow>, wake: bool) {
    shared.table.remove(&flow.client, flow);
    note_lb_cap(&flow.lb, Cap::UdpFlows, false);
    let route = shared.route.load();
    route.route.stats.udp().flows_active.decrement();
    flow.backend_stats.flows_active.decrement();
    if wake {
        flow.closed.notify_one();
    }
}

fn now_ms(epoch: Instant) -> u64 {
    epoch.elapsed().as_millis() as u64
}

/// A flow's task: passes the backend's answers to the client until the
/// flow is closed, idle, or answered as often as `udp_responses` says.
async fn run_flow(shared: Arc<Shared>, flow: Arc<Flow>) {
    loop {
        let (idle, close_when_answered) = {
            let r = shared.route.load();
            (r.settings.idle_timeout, r.settings.responses.is_some())
        };
        let seen = flow.state.observe();
        let last = flow.last_seen.load(Ordering::Relaxed);
        let deadline = shared.epoch + Duration::from_millis(last) + idle;
        tokio::select! {
            _ = flow.closed.notified() => return,
            _ = shared.stop.cancelled() => {
                if shared.handing_over.load(Ordering::Acquire) {
                    // Left open for the hand-over to take.
                    return;
                }
                if flow.state.close() {
                    retire(&shared, &flow, false);
                    log_flow_end(&shared, &flow, Termination::Drained);
                }
                return;
            }
            _ = tokio::time::sleep_until(deadline) => {
                let last_now = flow.last_seen.load(Ordering::Relaxed);
                if last_now == last && flow.state.close_if_unchanged(seen) {
                    retire(&shared, &flow, false);
                    log_flow_end(&shared, &flow, Termination::Idle);
                    return;
                }
            }
            r = flow.socket.readable() => {
                if r.is_err() {
                    continue;
                }
                if relay_answers(&shared, &flow, close_when_answered) {
                    retire(&shared, &flow, false);
                    log_flow_end(&shared, &flow, Termination::Answered);
                    return;
                }
            }
        }
        if flow.state.is_closed() {
            return;
        }
    }
}

/// Passes every answer waiting on the flow's socket to the client. Returns
/// `true` when the last expected answer closed the flow.
fn relay_answers(shared: &Shared, flow: &Flow, close_when_answered: bool) -> bool {
    SCRATCH.with(|scratch| {
        let mut buf = scratch.borrow_mut();
        loop {
            match flow.socket.try_recv(&mut buf) {
                Ok(n) => {
                    flow.last_seen
                        .store(now_ms(shared.epoch), Ordering::Relaxed);
                    flow.answered.store(true, Ordering::Relaxed);
                    let route = shared.route.load();
                    let udp = route.route.stats.udp();
                    // As in `send`: one system call, whatever tokio last saw.
                    let to = socket2::SockAddr::from(flow.client);
                    match SockRef::from(&shared.socket).send_to(&buf[..n], &to) {
                        Ok(sent) => {
                            udp.datagrams[Direction::BackendToClient].increment(1);
                            udp.bytes[Direction::BackendToClient].increment(sent as u64);
                            flow.backend.stats().bytes[Direction::BackendToClient]
                                .increment(sent as u64);
                            flow.bytes_down.fetch_add(sent as u64, Ordering::Relaxed);
                        }
                        Err(e) => {
                            // Too large for the client's family (an IPv6
                            // backend's jumbo answer to an IPv4 client), or
                            // the socket's buffer is full: dropped, never cut.
                            let reason = if e.raw_os_error() == Some(libc::EMSGSIZE) {
                                DatagramDropReason::TooLarge
                            } else {
                                DatagramDropReason::SendFailed
                            };
                            udp.datagrams_dropped[reason].increment(1);
                            tracing::debug!(client = %flow.client, error = %e, "answer to client dropped");
                        }
                    }
                    if flow.state.answered(close_when_answered) {
                        return true;
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => return false,
                Err(e) if e.raw_os_error() == Some(libc::ECONNREFUSED) => {
                    flow.backend_stats.icmp_errors.increment(1);
                    flow.refused.store(true, Ordering::Release);
                    tracing::debug!(client = %flow.client, backend = %flow.backend.addr, "backend port unreachable; the flow is re-picked at its next datagram");
                }
                Err(e) => {
                    tracing::debug!(client = %flow.client, error = %e, "receive from backend failed");
                    return false;
                }
            }
        }
    })
}

//! Listeners, connections and UDP flows into systemd's store, and back.
//!
//! Listening sockets go into the store when they are bound (or adopted) and
//! stay there for the listener's life; the next process takes them by name
//! (`fd_store::listener_name`) instead of binding. A listener a reload
//! removes, and every listener when a stop's drain begins, is taken out of
//! the store first (`FDSTOREREMOVE=1`), so its port refuses new clients as
//! soon as this process closes its own copy, as before the store existed.
//!
//! At hand-over the accept loops stop and nothing is taken out of the
//! store: PID 1's copies keep every port listening, and clients that
//! connect until the next process accepts wait in the kernel's queues.
//!
//! Open connections and UDP flows: at hand-over they go to the next
//! process in one parcel through the carrier (`carrier`, the socket pair
//! stored as `fd_store::CARRIER`; [`Daemon::hand_over_sockets`], the
//! `connections` step); at start the next process receives the parcel
//! (`open_handed`) and each listener takes its own (`adopt_connections`,
//! `take_handed_flows`). The proxy's `hand_over` and `adopt` fill and
//! empty it.

use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, OwnedFd};
use std::time::Duration;

use super::{HandOverReport, NoHandOver, carrier};
use crate::config::{ListenerKey, Protocol};
use crate::daemon::Daemon;
use crate::dataplane::proxy::{Handed, Running};
use crate::fd_store::{self, FdName, Transport};

/// How long open connections get to pause at a hand-over (each direction at
/// its wait for data, with nothing in flight): a connection whose peer
/// takes none of the bytes in flight for that long is closed as the drain
/// would, and counted lost. Short, since new clients wait in the accept
/// queues meanwhile.
const PAUSE_BOUND: Duration = Duration::from_secs(2);

/// The store name of the listener `key`.
fn name_of(key: &ListenerKey) -> FdName {
    let transport = match key.protocol {
        Protocol::Tcp => Transport::Tcp,
        Protocol::Udp => Transport::Udp,
    };
    fd_store::listener_name(transport, key.addr)
}

impl Daemon {
    /// The listening sockets of the TCP listener `addr`: those the last
    /// process left in the store when there are any (every one of its
    /// `SO_REUSEPORT` group, whatever `count` is now: a socket of the group
    /// left without an accept loop would take its share of the clients and
    /// never answer them), else `count` new ones ([`crate::dataplane::proxy::bind`]).
    /// Either way they are (again) in the store under the listener's name.
    pub(in crate::daemon) fn tcp_listener_sockets(
        &self,
        addr: SocketAddr,
        backlog: u32,
        count: usize,
    ) -> io::Result<Vec<std::net::TcpListener>> {
        let name = fd_store::listener_name(Transport::Tcp, addr);
        let store = self.fd_store();
        let inherited = self.inherited().take(&name);
        if !inherited.is_empty() {
            match adopt_tcp(inherited, addr) {
                Ok(sockets) => {
                    self.metrics()
                        .hand_over()
                        .adopted_listening_sockets(sockets.len());
                    tracing::info!(listen = %addr, sockets = sockets.len(), "listening sockets adopted from the last process (no rebind)");
                    // In the store already: not sent again.
                    store.note_stored(&name, sockets.len());
                    return Ok(sockets);
                }
                Err(why) => {
                    tracing::warn!(listen = %addr, "the stored listening sockets are not usable ({why}): binding new ones");
                    store.remove_or_warn(&name);
                }
            }
        }
        let sockets = crate::dataplane::proxy::bind(addr, backlog, count)?;
        let fds: Vec<_> = sockets.iter().map(AsFd::as_fd).collect();
        store.store_or_warn(&name, &fds);
        Ok(sockets)
    }

    /// The socket of the UDP listener `addr`: the stored one when there is
    /// one, else a new one ([`crate::dataplane::proxy::udp::bind`]); in the store
    /// either way. Datagrams that came while no process read wait in its
    /// receive buffer.
    pub(in crate::daemon) fn udp_listener_socket(
        &self,
        addr: SocketAddr,
    ) -> io::Result<tokio::net::UdpSocket> {
        let name = fd_store::listener_name(Transport::Udp, addr);
        let store = self.fd_store();
        let mut inherited = self.inherited().take(&name);
        let adopted = match inherited.len() {
            0 => None,
            1 => match adopt_udp(inherited.remove(0), addr) {
                Ok(s) => Some(s),
                Err(why) => {
                    tracing::warn!(listen = %addr, "the stored UDP socket is not usable ({why}): binding a new one");
                    store.remove_or_warn(&name);
                    None
                }
            },
            n => {
                tracing::warn!(listen = %addr, "{n} stored UDP sockets under one name: binding a new one");
                store.remove_or_warn(&name);
                drop(inherited);
                None
            }
        };
        if let Some(s) = adopted {
            self.metrics().hand_over().adopted_listening_sockets(1);
            tracing::info!(listen = %addr, "UDP socket adopted from the last process (no rebind)");
            store.note_stored(&name, 1);
            return tokio::net::UdpSocket::from_std(s);
        }
        let socket = crate::dataplane::proxy::udp::bind(addr)?;
        store.store_or_warn(&name, &[socket.as_fd()]);
        Ok(socket)
    }

    /// Takes the listener `key` out of the store before it drains (a reload
    /// removed it, or the daemon stops): once this process closes its
    /// sockets, its port refuses.
    pub(in crate::daemon) fn unstore_listener(&self, key: &ListenerKey) {
        self.fd_store().remove_or_warn(&name_of(key));
    }

    /// Stores what the next process needs to serve every client: the
    /// listening sockets are in the store already, so their accept loops
    /// stop here without taking them out (the ports keep listening in
    /// PID 1's copies); every open connection and flow pauses where no byte
    /// is held (`dataplane::proxy::Running::hand_over`) and goes into the store through
    /// one carrier (`carrier`).
    pub(super) async fn hand_over_sockets(&self, report: &mut HandOverReport) {
        let listeners: Vec<(ListenerKey, Running)> = {
            let mut st = self.lock();
            st.listeners
                .drain()
                .filter_map(|(key, e)| {
                    e.stats.up.set(false);
                    e.socket.ok().map(|s| (key, s))
                })
                .collect()
        };
        report.listeners = listeners.len();
        // Every listener pauses at once, against one deadline.
        let deadline = tokio::time::Instant::now() + PAUSE_BOUND;
        let mut paused = tokio::task::JoinSet::new();
        for (key, listener) in listeners {
            paused.spawn(async move { (key, listener.hand_over(deadline).await) });
        }
        let mut parcel = carrier::Parcel::default();
        while let Some(done) = paused.join_next().await {
            let Ok((key, handed)) = done else { continue };
            match handed {
                Handed::Tcp(tcp) => {
                    report.lost += tcp.lost;
                    parcel.tcp.extend(tcp.connections);
                }
                Handed::Udp(flows) => parcel
                    .udp
                    .extend(flows.into_iter().map(|flow| (key.addr, flow))),
            }
        }
        let sent = carrier::send(&self.fd_store(), parcel);
        report.connections = sent.connections;
        report.flows = sent.flows;
        report.lost += sent.lost;
    }

    /// The open connections the last process handed over for the TCP
    /// listener now serving `addr`, served on by it.
    pub(in crate::daemon) fn adopt_connections(
        &self,
        listener: &crate::dataplane::proxy::Listener,
    ) {
        let handed = self
            .open_handed()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .tcp
            .remove(&listener.addr);
        if let Some(handed) = handed {
            let n = handed.len();
            let served = listener.adopt(handed);
            tracing::info!(listen = %listener.addr, connections = n, served, "open connections adopted from the last process");
        }
    }

    /// The UDP flows the last process handed over for `addr`, if any.
    pub(in crate::daemon) fn take_handed_flows(
        &self,
        addr: SocketAddr,
    ) -> Vec<crate::dataplane::proxy::udp::HandedFlow> {
        self.open_handed()
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .udp
            .remove(&addr)
            .unwrap_or_default()
    }

    /// The open connections and flows handed over and not yet taken.
    pub(super) fn open_handed(&self) -> std::sync::Arc<std::sync::Mutex<super::carrier::Received>> {
        std::sync::Arc::clone(&self.fds.read().unwrap_or_else(|p| p.into_inner()).open)
    }

    /// Why a hand-over cannot be done now, if it cannot: no store, or one
    /// too small for what must go into it (`max`: the unit's
    /// `FileDescriptorStoreMax=`, as `prepare-stop` read it).
    pub(crate) fn hand_over_refusal(&self, max: Option<usize>) -> Option<NoHandOver> {
        let store = self.fd_store();
        if !store.is_on() {
            return Some(NoHandOver::NoStore);
        }
        let needed = store.stored_fds();
        match max {
            Some(max) if needed > max => Some(NoHandOver::StoreTooSmall { needed, max }),
            _ => None,
        }
    }
}

/// Once the first config is in force (or, with leased VIPs, once their
/// leases had time to come back): what no listener took of `open` (its
/// listener is gone from the config, or did not bind) is closed, the
/// connections with a reset, and said.
pub(super) fn close_unadopted(open: &std::sync::Mutex<carrier::Received>) {
    let rest = std::mem::take(&mut *open.lock().unwrap_or_else(|p| p.into_inner()));
    let (connections, flows) = rest.len();
    if connections + flows == 0 {
        return;
    }
    for c in rest.tcp.into_values().flatten() {
        c.reset();
    }
    tracing::warn!(
        connections,
        flows,
        "handed-over connections and flows of listeners this config does not serve (removed, or not bound): reset"
    );
}

/// Why an inherited socket is not the listener it is stored as.
#[derive(Debug, thiserror::Error)]
enum UnusableSocket {
    /// The descriptor is not a socket.
    #[error("not a socket: {0}")]
    NotASocket(#[source] io::Error),
    /// A socket of another type (datagram for stream, say).
    #[error("a socket of type {got:?}, not {want:?}")]
    WrongType {
        got: socket2::Type,
        want: socket2::Type,
    },
    /// A socket not bound to an IP address (a Unix socket, say).
    #[error("a socket with no IP address")]
    NoIpAddress,
    /// A socket bound to another address.
    #[error("bound to {local}, not {addr}")]
    WrongAddress { local: SocketAddr, addr: SocketAddr },
    /// Whether it listens could not be read.
    #[error(transparent)]
    ListeningUnknown(io::Error),
    /// A TCP socket that does not listen.
    #[error("a socket that does not listen")]
    NotListening,
    /// It could not be made non-blocking.
    #[error(transparent)]
    Blocking(io::Error),
}

/// The inherited sockets of a TCP listener at `addr`, each checked: a
/// listening TCP socket bound to `addr` exactly.
fn adopt_tcp(
    fds: Vec<OwnedFd>,
    addr: SocketAddr,
) -> Result<Vec<std::net::TcpListener>, UnusableSocket> {
    fds.into_iter()
        .map(|fd| {
            let socket = socket2::Socket::from(fd);
            check(&socket, addr, socket2::Type::STREAM)?;
            if !socket
                .is_listener()
                .map_err(UnusableSocket::ListeningUnknown)?
            {
                return Err(UnusableSocket::NotListening);
            }
            socket
                .set_nonblocking(true)
                .map_err(UnusableSocket::Blocking)?;
            Ok(socket.into())
        })
        .collect()
}

/// The inherited socket of a UDP listener at `addr`, checked.
fn adopt_udp(fd: OwnedFd, addr: SocketAddr) -> Result<std::net::UdpSocket, UnusableSocket> {
    let socket = socket2::Socket::from(fd);
    check(&socket, addr, socket2::Type::DGRAM)?;
    socket
        .set_nonblocking(true)
        .map_err(UnusableSocket::Blocking)?;
    Ok(socket.into())
}

fn check(
    socket: &socket2::Socket,
    addr: SocketAddr,
    kind: socket2::Type,
) -> Result<(), UnusableSocket> {
    let got = socket.r#type().map_err(UnusableSocket::NotASocket)?;
    if got != kind {
        return Err(UnusableSocket::WrongType { got, want: kind });
    }
    let local = socket
        .local_addr()
        .ok()
        .and_then(|a| a.as_socket())
        .ok_or(UnusableSocket::NoIpAddress)?;
    if local != addr {
        return Err(UnusableSocket::WrongAddress { local, addr });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::os::unix::net::UnixDatagram;
    use std::sync::Arc;

    use super::super::{INTENT_BOUND, NoHandOver, StopKind};
    use crate::daemon::testing::{config, daemon, lb};
    use crate::fd_store::{FdStore, Inherited};
    use crate::metrics::hand_over::FallbackReason;

    /// A daemon whose store is a socket the test reads, as PID 1 would.
    fn with_store(name: &str) -> (Arc<crate::daemon::Daemon>, UnixDatagram, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("hlb-unit-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let holder = UnixDatagram::bind(&path).unwrap();
        holder
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        let d = daemon();
        d.use_fd_store(FdStore::at(&path), Inherited::none());
        (d, holder, dir)
    }

    fn next(holder: &UnixDatagram) -> (String, usize) {
        let (text, fds) = crate::fd_store::receive(holder).expect("a message within 5 s");
        (String::from_utf8_lossy(&text).into_owned(), fds.len())
    }

    #[tokio::test]
    async fn listeners_are_stored_when_bound_and_removed_when_a_reload_removes_them() {
        let (d, holder, dir) = with_store("store-reload");
        let two = lb(
            "a/web",
            "127.231.41.1",
            &["127.231.41.11"],
            &[18080, 18081],
            30080,
            "",
        );
        d.apply(config(&two));
        let mut stored = vec![next(&holder), next(&holder)];
        stored.sort();
        assert_eq!(
            stored,
            [
                (
                    "FDSTORE=1\nFDNAME=listen-tcp-127.231.41.1-18080".to_string(),
                    1
                ),
                (
                    "FDSTORE=1\nFDNAME=listen-tcp-127.231.41.1-18081".to_string(),
                    1
                ),
            ]
        );
        assert_eq!(d.fd_store().stored_fds(), 2);
        let one = lb(
            "a/web",
            "127.231.41.1",
            &["127.231.41.11"],
            &[18080],
            30080,
            "",
        );
        d.apply(config(&one));
        assert_eq!(
            next(&holder),
            (
                "FDSTOREREMOVE=1\nFDNAME=listen-tcp-127.231.41.1-18081".to_string(),
                0
            )
        );
        assert_eq!(d.fd_store().stored_fds(), 1);
        // A stop's drain takes the rest out first.
        d.shutdown().await;
        assert_eq!(
            next(&holder),
            (
                "FDSTOREREMOVE=1\nFDNAME=listen-tcp-127.231.41.1-18080".to_string(),
                0
            )
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(start_paused = true)]
    async fn a_restart_is_announced_only_with_a_store_large_enough_and_expires() {
        // No store: refused, counted, the stop drains.
        let d = daemon();
        assert_eq!(d.announce_restart(None), Err(NoHandOver::NoStore));
        assert_eq!(d.stop_kind(), StopKind::Drain);
        let (d, _holder, dir) = with_store("store-intent");
        d.apply(config(&lb(
            "a/web",
            "127.231.42.1",
            &["127.231.42.11"],
            &[18080, 18081],
            30080,
            "",
        )));
        // Two listeners stored: FileDescriptorStoreMax=1 cannot keep them.
        assert_eq!(
            d.announce_restart(Some(1)),
            Err(NoHandOver::StoreTooSmall { needed: 2, max: 1 })
        );
        assert_eq!(d.stop_kind(), StopKind::Drain);
        assert_eq!(d.announce_restart(Some(16384)), Ok(INTENT_BOUND));
        assert!(d.restart_announced().is_some());
        assert_eq!(d.stop_kind(), StopKind::HandOver);
        assert_eq!(d.stop_kind(), StopKind::Drain, "one word, one stop");
        d.announce_restart(None).unwrap();
        tokio::time::advance(INTENT_BOUND + std::time::Duration::from_secs(1)).await;
        assert_eq!(d.stop_kind(), StopKind::Drain, "expired");
        let mut text = Vec::new();
        d.metrics().hand_over().write(&mut text);
        let text = String::from_utf8(text).unwrap();
        for (reason, n) in [
            (FallbackReason::StoreTooSmall, 1),
            (FallbackReason::Expired, 1),
            (FallbackReason::NoStore, 0),
        ] {
            let line = format!(
                "harvester_lb_hand_over_fallbacks_total{{reason=\"{}\"}} {n}",
                reason.label()
            );
            assert!(text.contains(&line), "{line} in\n{text}");
        }
        d.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}

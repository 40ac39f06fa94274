//! The open connections and UDP flows of a hand-over, carried to the next
//! process through one socket pair in systemd's store.
//!
//! Why not one store entry per socket: systemd 252 compares every
//! descriptor it is sent with every one it holds (2 s of PID 1's CPU for
//! 2,000 listeners, measured: the cost grows with the square of the count),
//! and it drops a stored socket that reports `POLLHUP`, so a connection
//! whose client finished during the restart would vanish with its last
//! bytes unread. Descriptors in flight on a Unix socket are neither compared
//! nor polled: the sockets are sent as `SCM_RIGHTS` messages into one end of
//! a `SOCK_SEQPACKET` pair, and both ends go into the store (an end whose
//! peer is closed hangs up, and would be dropped). The next process takes
//! both ends, reads every message, and takes the pair out of the store.
//!
//! Each message says what its descriptors are ([`Manifest`], JSON): TCP
//! connections as (client, backend) pairs first, then one backend socket
//! per UDP flow with its listener's VIP:port and its client's address,
//! which no socket of the flow knows.

use std::collections::HashMap;
use std::io;
use std::net::SocketAddr;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};

use serde::{Deserialize, Serialize};

use crate::dataplane::proxy::tcp::HandedConnection;
use crate::dataplane::proxy::udp::HandedFlow;
use crate::fd_store::{self, CARRIER, FdName, FdStore, Inherited, MAX_FDS_PER_MESSAGE};

/// The longest message: a manifest of [`MAX_FDS_PER_MESSAGE`] flows, with
/// two IPv6 socket addresses each, fits.
const MAX_MESSAGE: usize = 64 * 1024;

/// The send buffer asked for the carrier's sending end: messages queue
/// there until the next process reads them (the kernel caps it at
/// `net.core.wmem_max` without `CAP_NET_ADMIN`; each message takes about
/// a kilobyte of it plus its manifest, so the default cap of 208 KiB holds
/// well over 10,000 connections).
const SEND_BUFFER: usize = 64 << 20;

/// What one message's descriptors are, in order.
#[derive(Debug, Default, Serialize, Deserialize, PartialEq, Eq)]
struct Manifest {
    /// TCP connections: `2 × tcp` descriptors, client then backend.
    tcp: usize,
    /// UDP flows, one descriptor each, after the TCP ones.
    udp: Vec<FlowLabel>,
}

/// What the next process needs to know of a flow beside its socket.
#[derive(Debug, Serialize, Deserialize, PartialEq, Eq)]
struct FlowLabel {
    /// The VIP:port of its UDP listener.
    listener: SocketAddr,
    /// The client's address.
    client: SocketAddr,
}

/// The open connections and flows one process hands over.
#[derive(Default)]
pub(crate) struct Parcel {
    /// Proxied TCP connections, paused.
    pub(crate) tcp: Vec<HandedConnection>,
    /// UDP flows with their listener's VIP:port.
    pub(crate) udp: Vec<(SocketAddr, HandedFlow)>,
}

/// What [`send`] carried.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sent {
    /// TCP connections in the carrier.
    pub(crate) connections: usize,
    /// UDP flows in the carrier.
    pub(crate) flows: usize,
    /// Connections and flows that could not be put in it (reset).
    pub(crate) lost: usize,
}

/// The open connections and flows a process took at start, by the VIP:port
/// of the listener that serves them.
#[derive(Default)]
pub(crate) struct Received {
    /// TCP connections, by their client socket's local address.
    pub(crate) tcp: HashMap<SocketAddr, Vec<HandedConnection>>,
    /// UDP flows, by their listener.
    pub(crate) udp: HashMap<SocketAddr, Vec<HandedFlow>>,
}

impl Received {
    /// How many connections and flows wait for their listener.
    pub(crate) fn len(&self) -> (usize, usize) {
        (
            self.tcp.values().map(Vec::len).sum(),
            self.udp.values().map(Vec::len).sum(),
        )
    }
}

fn carrier_names() -> [FdName; 2] {
    CARRIER.map(|n| FdName::new(n).expect("a valid name"))
}

/// Puts `parcel` into a new carrier and the carrier into `store`. What
/// cannot go (the carrier's buffer is full, the store refuses) is reset
/// and counted as lost; the caller closes its copies either way, which
/// leaves the connections to the carrier's.
pub(crate) fn send(store: &FdStore, parcel: Parcel) -> Sent {
    let total = parcel.tcp.len() + parcel.udp.len();
    if total == 0 {
        return Sent::default();
    }
    let (rx, tx) = match pair() {
        Ok(p) => p,
        Err(e) => {
            tracing::warn!(error = %e, "no socket pair to carry the open connections: they are reset");
            reset_all(parcel);
            return Sent {
                lost: total,
                ..Sent::default()
            };
        }
    };
    let sock = socket2::SockRef::from(&tx);
    if sock.set_send_buffer_size(SEND_BUFFER).is_err() {
        tracing::debug!("carrier: SO_SNDBUF not raised");
    }
    let mut sent = Sent::default();
    let mut failed: Option<io::Error> = None;
    let Parcel { tcp, udp } = parcel;
    let mut tcp = tcp.into_iter().peekable();
    while tcp.peek().is_some() {
        let batch: Vec<HandedConnection> = tcp.by_ref().take(MAX_FDS_PER_MESSAGE / 2).collect();
        if failed.is_none() {
            let fds: Vec<BorrowedFd<'_>> = batch
                .iter()
                .flat_map(|c| [c.client.as_fd(), c.backend.as_fd()])
                .collect();
            let manifest = Manifest {
                tcp: batch.len(),
                udp: Vec::new(),
            };
            match put(&tx, &manifest, &fds) {
                Ok(()) => {
                    sent.connections += batch.len();
                    continue;
                }
                Err(e) => failed = Some(e),
            }
        }
        sent.lost += batch.len();
        batch.into_iter().for_each(HandedConnection::reset);
    }
    let mut udp = udp.into_iter().peekable();
    while udp.peek().is_some() {
        let batch: Vec<(SocketAddr, HandedFlow)> = udp.by_ref().take(MAX_FDS_PER_MESSAGE).collect();
        if failed.is_none() {
            let fds: Vec<BorrowedFd<'_>> = batch.iter().map(|(_, f)| f.backend.as_fd()).collect();
            let manifest = Manifest {
                tcp: 0,
                udp: batch
                    .iter()
                    .map(|(listener, f)| FlowLabel {
                        listener: *listener,
                        client: f.client,
                    })
                    .collect(),
            };
            match put(&tx, &manifest, &fds) {
                Ok(()) => {
                    sent.flows += batch.len();
                    continue;
                }
                Err(e) => failed = Some(e),
            }
        }
        // A flow has nothing to reset: the client's next datagram starts
        // a new one.
        sent.lost += batch.len();
    }
    if let Some(e) = failed {
        tracing::warn!(
            error = %e,
            carried = sent.connections + sent.flows,
            lost = sent.lost,
            "the carrier of the open connections is full: the rest are reset"
        );
    }
    let [rx_name, tx_name] = carrier_names();
    let stored = store
        .store(&rx_name, &[rx.as_fd()])
        .and_then(|()| store.store(&tx_name, &[tx.as_fd()]));
    if let Err(e) = stored {
        tracing::warn!("{e}: the open connections are lost with this process");
        store.remove_or_warn(&rx_name);
        sent.lost += sent.connections + sent.flows;
        sent.connections = 0;
        sent.flows = 0;
    }
    sent
}

/// One message of the carrier.
fn put(tx: &OwnedFd, manifest: &Manifest, fds: &[BorrowedFd<'_>]) -> io::Result<()> {
    let text = serde_json::to_vec(manifest).map_err(io::Error::other)?;
    fd_store::send_on(tx.as_fd(), &text, fds, libc::MSG_DONTWAIT)
}

fn reset_all(parcel: Parcel) {
    parcel.tcp.into_iter().for_each(HandedConnection::reset);
}

/// A `SOCK_SEQPACKET` Unix socket pair, close-on-exec: (receiving end,
/// sending end).
fn pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let (rx, tx) = socket2::Socket::pair(socket2::Domain::UNIX, socket2::Type::SEQPACKET, None)?;
    Ok((rx.into(), tx.into()))
}

/// Takes the carrier the last process left, if any, reads every connection
/// and flow out of it, and takes it out of the store. A message that does
/// not read as one of ours is closed with a warning (its connections
/// close with it).
pub(crate) fn receive(inherited: &Inherited, store: &FdStore) -> Received {
    let [rx_name, tx_name] = carrier_names();
    let mut rx = inherited.take(&rx_name);
    let tx = inherited.take(&tx_name);
    let mut received = Received::default();
    if rx.is_empty() && tx.is_empty() {
        return received;
    }
    if let Some(rx) = rx.pop() {
        loop {
            match fd_store::receive_on(rx.as_fd(), MAX_MESSAGE, libc::MSG_DONTWAIT) {
                Ok((text, fds)) if text.is_empty() && fds.is_empty() => break,
                Ok((text, fds)) => unpack(&text, fds, &mut received),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) => {
                    tracing::warn!(error = %e, "a message of the open connections' carrier is unreadable: its connections are lost");
                    if e.raw_os_error() != Some(libc::EMSGSIZE) {
                        break;
                    }
                }
            }
        }
    }
    drop(tx);
    store.remove_or_warn(&rx_name);
    store.remove_or_warn(&tx_name);
    received
}

/// One message's descriptors into `into`, as its manifest says.
fn unpack(text: &[u8], fds: Vec<OwnedFd>, into: &mut Received) {
    let manifest: Manifest = match serde_json::from_slice(text) {
        Ok(m) => m,
        Err(e) => {
            tracing::warn!(error = %e, descriptors = fds.len(), "a carrier message whose manifest is unreadable: its connections are lost");
            return;
        }
    };
    if fds.len() != manifest.tcp * 2 + manifest.udp.len() {
        tracing::warn!(
            descriptors = fds.len(),
            tcp = manifest.tcp,
            udp = manifest.udp.len(),
            "a carrier message whose descriptors are not what its manifest says: its connections are lost"
        );
        return;
    }
    let mut fds = fds.into_iter();
    for _ in 0..manifest.tcp {
        let (Some(client), Some(backend)) = (fds.next(), fds.next()) else {
            break;
        };
        let client = std::net::TcpStream::from(client);
        let backend = std::net::TcpStream::from(backend);
        let connection = HandedConnection { client, backend };
        match connection.client.local_addr() {
            Ok(vip) => into.tcp.entry(vip).or_default().push(connection),
            // Closed during the restart: nothing left to serve.
            Err(_) => connection.reset(),
        }
    }
    for (label, fd) in manifest.udp.into_iter().zip(fds) {
        into.udp
            .entry(label.listener)
            .or_default()
            .push(HandedFlow {
                client: label.client,
                backend: std::net::UdpSocket::from(fd),
            });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixDatagram;

    /// A store whose messages a test reads, as PID 1 would, keeping the
    /// descriptors by name.
    fn store(name: &str) -> (FdStore, UnixDatagram, std::path::PathBuf) {
        let dir = std::env::temp_dir().join(format!("hlb-carrier-{name}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let holder = UnixDatagram::bind(&path).unwrap();
        holder.set_nonblocking(true).unwrap();
        (FdStore::at(&path), holder, dir)
    }

    /// What the holder was sent, as the next process would inherit it.
    fn inherit(holder: &UnixDatagram) -> Inherited {
        let mut fds = Vec::new();
        while let Ok((text, got)) = fd_store::receive(holder) {
            let text = String::from_utf8(text).unwrap();
            if let Some(name) = text.strip_prefix("FDSTORE=1\nFDNAME=") {
                fds.extend(got.into_iter().map(|fd| (name.to_string(), fd)));
            }
        }
        Inherited::from_fds(fds)
    }

    /// A connected loopback TCP pair: (the side a proxy holds, the peer).
    fn tcp_pair() -> (std::net::TcpStream, std::net::TcpStream) {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let peer = std::net::TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (ours, _) = l.accept().unwrap();
        (ours, peer)
    }

    #[test]
    fn connections_and_flows_cross_the_carrier_and_still_talk_to_their_peers() {
        let (store, holder, dir) = store("cross");
        let mut peers = Vec::new();
        let mut parcel = Parcel::default();
        // More than one message's worth of both kinds.
        for _ in 0..150 {
            let (client, client_peer) = tcp_pair();
            let (backend, backend_peer) = tcp_pair();
            peers.push((client_peer, backend_peer));
            parcel.tcp.push(HandedConnection { client, backend });
        }
        let backend_end = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let listener: SocketAddr = "127.0.0.1:5353".parse().unwrap();
        for i in 0..300u16 {
            let s = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
            s.connect(backend_end.local_addr().unwrap()).unwrap();
            let client = SocketAddr::from(([127, 0, 0, 9], 20000 + i));
            parcel
                .udp
                .push((listener, HandedFlow { client, backend: s }));
        }
        let sent = send(&store, parcel);
        assert_eq!(
            sent,
            Sent {
                connections: 150,
                flows: 300,
                lost: 0
            }
        );
        // This process's copies are gone: only the carrier holds them.
        let inherited = inherit(&holder);
        let mut received = receive(&inherited, &FdStore::off());
        assert_eq!(received.len(), (150, 300));
        let mut tcp: Vec<HandedConnection> = received.tcp.drain().flat_map(|(_, v)| v).collect();
        assert_eq!(tcp.len(), 150);
        // Every pair is still connected to its own peers: a byte each way.
        // Each peer by both ends of its connection: connect() shares an
        // ephemeral port between connections to different listeners, so
        // the port alone can name another pair's peer (whose byte never
        // comes: the read below then waited forever, in about half the runs).
        let five_s = Some(std::time::Duration::from_secs(5));
        for c in &mut tcp {
            let ends = (
                c.client.peer_addr().unwrap(),
                c.client.local_addr().unwrap(),
            );
            let (mut cp, mut bp) = peers
                .iter()
                .find(|(cp, _)| (cp.local_addr().unwrap(), cp.peer_addr().unwrap()) == ends)
                .map(|(cp, bp)| (cp.try_clone().unwrap(), bp.try_clone().unwrap()))
                .expect("the client's peer");
            c.client.set_nonblocking(false).unwrap();
            c.backend.set_nonblocking(false).unwrap();
            c.client.set_read_timeout(five_s).unwrap();
            bp.set_read_timeout(five_s).unwrap();
            cp.write_all(b"c").unwrap();
            let mut b = [0u8; 1];
            c.client.read_exact(&mut b).unwrap();
            c.backend.write_all(&b).unwrap();
            bp.read_exact(&mut b).unwrap();
            assert_eq!(&b, b"c");
        }
        let flows = received
            .udp
            .remove(&listener)
            .expect("the listener's flows");
        assert_eq!(flows.len(), 300);
        let mut clients: Vec<u16> = flows.iter().map(|f| f.client.port()).collect();
        clients.sort();
        assert_eq!(clients, (20000..20300).collect::<Vec<_>>());
        flows[7].backend.send(b"q").unwrap();
        let mut b = [0u8; 4];
        backend_end
            .set_read_timeout(Some(std::time::Duration::from_secs(5)))
            .unwrap();
        assert_eq!(backend_end.recv(&mut b).unwrap(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn nothing_to_carry_stores_nothing_and_no_carrier_receives_nothing() {
        let (store, holder, dir) = store("empty");
        assert_eq!(send(&store, Parcel::default()), Sent::default());
        assert!(fd_store::receive(&holder).is_err(), "nothing was sent");
        let received = receive(&Inherited::default(), &store);
        assert_eq!(received.len(), (0, 0));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_message_that_is_not_a_manifest_is_dropped_with_its_descriptors() {
        let (rx, tx) = pair().unwrap();
        let stray = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        fd_store::send_on(tx.as_fd(), b"not json", &[stray.as_fd()], 0).unwrap();
        let (good, _peer) = tcp_pair();
        let (backend, _bpeer) = tcp_pair();
        let vip = good.local_addr().unwrap();
        put(
            &tx,
            &Manifest {
                tcp: 1,
                udp: Vec::new(),
            },
            &[good.as_fd(), backend.as_fd()],
        )
        .unwrap();
        let inherited =
            Inherited::from_fds([(CARRIER[0].to_string(), rx), (CARRIER[1].to_string(), tx)]);
        let received = receive(&inherited, &FdStore::off());
        assert_eq!(received.len(), (1, 0), "the good message still counts");
        assert!(received.tcp.contains_key(&vip));
    }
}

//! TCP socket helpers shared by the forwarder and the prober: a connect that
//! costs no more system calls than it must, and the test for the daemon's
//! own shortages (descriptors, socket memory), which are never a backend's
//! fault.

use std::io;
use std::net::SocketAddr;

use socket2::{Domain, Socket, Type};
use tokio::io::Interest;
use tokio::net::TcpStream;

/// A new non-blocking, close-on-exec TCP socket for `addr`'s family (one
/// system call).
pub fn tcp_socket_for(addr: SocketAddr) -> io::Result<Socket> {
    Socket::new(Domain::for_address(addr), Type::STREAM.nonblocking(), None)
}

/// Connects `socket` (non-blocking, options already set) to `addr` and
/// waits until the handshake is done or has failed. The caller bounds the
/// wait with its own timeout.
///
/// Success is the writable event alone. A failed connect always raises
/// `EPOLLERR` (and `EPOLLHUP`), so the pending error is read (`SO_ERROR`)
/// only on that path: a successful connect costs no `getsockopt`, as in
/// HAProxy. Connection refused comes back as
/// [`io::ErrorKind::ConnectionRefused`].
pub async fn connect(socket: Socket, addr: SocketAddr) -> io::Result<TcpStream> {
    start_connect(&socket, addr)?;
    let stream = TcpStream::from_std(socket.into())?;
    handshake_done(&stream).await?;
    Ok(stream)
}

/// Starts connecting the non-blocking `socket` to `addr`: `Ok` once the SYN
/// is on its way (`EINPROGRESS`) or the connect is already done.
pub fn start_connect(socket: &Socket, addr: SocketAddr) -> io::Result<()> {
    match socket.connect(&addr.into()) {
        Err(e) if e.raw_os_error() == Some(libc::EINPROGRESS) => Ok(()),
        r => r,
    }
}

/// Waits until the handshake of `stream` (connecting, and registered since
/// its `connect`, so no readiness is left from an earlier connection) is
/// done or has failed. Success is the writable event alone; a failed
/// connect raises `EPOLLERR` and `EPOLLHUP`, and only then is its error read
/// (`SO_ERROR`).
pub async fn handshake_done(stream: &TcpStream) -> io::Result<()> {
    let ready = stream.ready(Interest::WRITABLE | Interest::ERROR).await?;
    if !(ready.is_error() || ready.is_write_closed()) {
        return Ok(());
    }
    Err(stream.take_error()?.unwrap_or_else(|| {
        io::Error::new(
            io::ErrorKind::ConnectionAborted,
            "connection closed while connecting",
        )
    }))
}

/// Whether `e` says this process or host ran out of descriptors or memory:
/// the daemon's own shortage, not the peer's.
pub fn is_local_shortage(e: &io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EMFILE | libc::ENFILE | libc::ENOBUFS | libc::ENOMEM)
    )
}

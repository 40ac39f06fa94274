//! The client's UDP sockets.
//!
//! Why UDP and not a packet socket: before it has an address a client must
//! send from 0.0.0.0 and hear broadcast replies. A UDP socket on
//! `0.0.0.0:68` bound to the macvlan interface (`SO_BINDTODEVICE`) with
//! `SO_BROADCAST` does both, and asking servers to broadcast their replies
//! (the BROADCAST flag) means no reply is sent to an address the interface
//! does not have yet. That needs no `CAP_NET_RAW`, no hand-built Ethernet,
//! IP and UDP headers and no BPF filter. Its limits, documented in the
//! README: a server that ignores the BROADCAST flag is not heard before the
//! first lease, and strict reverse-path filtering (`rp_filter = 1`) on the
//! host can drop broadcast replies to an interface without an address.
//!
//! Once leased, a second socket on `<address>:68` takes the unicast answers
//! to RENEW: the kernel may hand them in on the parent interface (whichever
//! interface answered the server's ARP), where the device-bound socket
//! does not see them. Both sockets set `SO_REUSEADDR` so they, and the
//! sockets of other load balancers' clients on other macvlans, share port 68.

use std::net::{Ipv4Addr, SocketAddr, SocketAddrV4};

use socket2::{Domain, Protocol, Socket, Type};
use tokio::net::UdpSocket;

use super::wire::CLIENT_PORT;

fn udp() -> std::io::Result<Socket> {
    let s = Socket::new(Domain::IPV4, Type::DGRAM, Some(Protocol::UDP))?;
    s.set_reuse_address(true)?;
    s.set_nonblocking(true)?;
    Ok(s)
}

/// `0.0.0.0:68` on `interface` only, broadcast allowed.
pub fn on_interface(interface: &str) -> std::io::Result<UdpSocket> {
    let s = udp()?;
    s.bind_device(Some(interface.as_bytes()))?;
    s.set_broadcast(true)?;
    s.bind(&SocketAddr::from(SocketAddrV4::new(Ipv4Addr::UNSPECIFIED, CLIENT_PORT)).into())?;
    UdpSocket::from_std(s.into())
}

/// `<address>:68`, for unicast exchanges with the server once leased.
/// `IP_FREEBIND` lets it bind before the address is on the interface.
pub fn on_address(address: Ipv4Addr) -> std::io::Result<UdpSocket> {
    let s = udp()?;
    s.set_freebind_v4(true)?;
    s.bind(&SocketAddr::from(SocketAddrV4::new(address, CLIENT_PORT)).into())?;
    UdpSocket::from_std(s.into())
}

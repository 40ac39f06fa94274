//! The PROXY protocol header a listener may send to its backends before the
//! client's first byte (HAProxy's `send-proxy` and `send-proxy-v2`), so a
//! node's server sees the client's address and the VIP instead of the host's.
//!
//! The wire format is the `ppp` crate's; this module only decides what the
//! header says and when it goes out. It never reads from the backend.

use std::io;
use std::net::SocketAddr;

use tokio::net::TcpStream;

use crate::config::ProxyProtocol;
use crate::dataplane::balancer::ClientAddr;

/// How many of the client's first bytes may ride in the header's segment:
/// a request head, not a bulk upload (the copy loop does the rest).
const FIRST_BYTES: usize = 8 * 1024;

/// The header for a client at `client` that connected to `vip`.
///
/// IPv4-mapped IPv6 addresses (a dual-stack socket) are written as IPv4. If
/// the two addresses are still of different families, which no real TCP
/// connection has, the header says so rather than lie: v1 `UNKNOWN`, and v2
/// `LOCAL` with an unspecified family (the receiver then uses the
/// connection's own addresses, as the specification says).
pub fn header(version: ProxyProtocol, client: ClientAddr, vip: SocketAddr) -> Vec<u8> {
    let pair = (unmapped(client.socket()), unmapped(vip));
    match version {
        ProxyProtocol::V1 => ppp::v1::Addresses::from(pair).to_string().into_bytes(),
        ProxyProtocol::V2 => {
            use ppp::v2::{Addresses, Builder, Command, Protocol, Version};
            let addresses = Addresses::from(pair);
            let (command, protocol) = if matches!(addresses, Addresses::Unspecified) {
                (Command::Local, Protocol::Unspecified)
            } else {
                (Command::Proxy, Protocol::Stream)
            };
            Builder::with_addresses(Version::Two | command, protocol, addresses)
                .build()
                // Only a payload over 64 KiB can fail; addresses never are.
                .unwrap_or_default()
        }
    }
}

fn unmapped(addr: SocketAddr) -> SocketAddr {
    SocketAddr::new(addr.ip().to_canonical(), addr.port())
}

/// Sends `header` to `server` ahead of everything else, with whatever the
/// client has already sent in the same write (one segment, as a backend
/// that reads the header and the request together expects of HAProxy). A
/// client that has sent nothing yet (a server-speaks-first protocol) does
/// not hold the header back. Returns how many client bytes went with it.
pub async fn send(
    server: &TcpStream,
    client: &TcpStream,
    mut header: Vec<u8>,
) -> io::Result<usize> {
    let sent_header = header.len();
    header.resize(sent_header + FIRST_BYTES, 0);
    let first = match client.try_read(&mut header[sent_header..]) {
        Ok(n) => n,
        Err(e) if e.kind() == io::ErrorKind::WouldBlock => 0,
        Err(e) => return Err(e),
    };
    header.truncate(sent_header + first);
    let mut written = 0;
    while written < header.len() {
        server.writable().await?;
        match server.try_write(&header[written..]) {
            Ok(n) => written += n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => continue,
            Err(e) => return Err(e),
        }
    }
    Ok(first)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sa(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    fn client(s: &str) -> ClientAddr {
        ClientAddr::new(sa(s))
    }

    #[test]
    fn v1_names_client_then_vip() {
        let h = header(
            ProxyProtocol::V1,
            client("127.0.3.7:40000"),
            sa("127.0.0.1:80"),
        );
        assert_eq!(h, b"PROXY TCP4 127.0.3.7 127.0.0.1 40000 80\r\n");
        let h = header(ProxyProtocol::V1, client("[::1]:40000"), sa("[::1]:443"));
        assert_eq!(h, b"PROXY TCP6 ::1 ::1 40000 443\r\n");
    }

    #[test]
    fn mapped_addresses_are_ipv4_and_mixed_families_unknown() {
        let h = header(
            ProxyProtocol::V1,
            client("[::ffff:10.1.2.3]:5000"),
            sa("[::ffff:10.0.0.1]:80"),
        );
        assert_eq!(h, b"PROXY TCP4 10.1.2.3 10.0.0.1 5000 80\r\n");
        let h = header(
            ProxyProtocol::V1,
            client("[2001:db8::1]:5000"),
            sa("10.0.0.1:80"),
        );
        assert_eq!(h, b"PROXY UNKNOWN\r\n");
        let v2 = header(
            ProxyProtocol::V2,
            client("[2001:db8::1]:5000"),
            sa("10.0.0.1:80"),
        );
        // Signature, then version 2 with LOCAL, family and protocol unspecified, no addresses.
        assert_eq!(&v2[12..16], &[0x20, 0x00, 0x00, 0x00]);
    }

    #[test]
    fn v2_parses_back_to_the_same_addresses() {
        let h = header(
            ProxyProtocol::V2,
            client("127.0.3.7:40000"),
            sa("127.0.0.1:80"),
        );
        let parsed = ppp::v2::Header::try_from(&h[..]).expect("a valid v2 header");
        assert_eq!(parsed.command, ppp::v2::Command::Proxy);
        assert_eq!(
            parsed.addresses,
            ppp::v2::Addresses::from((sa("127.0.3.7:40000"), sa("127.0.0.1:80")))
        );
    }
}

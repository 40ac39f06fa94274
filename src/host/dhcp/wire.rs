//! DHCPv4 messages as this client sends and reads them, on `dhcproto`.
//!
//! Building: every request carries the client identifier (type 1 + MAC,
//! so servers key the lease the same way whichever field they use), the
//! hostname, and the parameter request list. Reading: [`parse`] turns
//! bytes into a [`Reply`] or says why they are not one; it never panics,
//! whatever the bytes (the property test below feeds it garbage).

use std::net::Ipv4Addr;
use std::time::Duration;

use dhcproto::v4::{
    Decodable, Decoder, DhcpOption, Encodable, Encoder, Flags, HType, Message, MessageType, Opcode,
    OptionCode,
};

/// The DHCP server port.
pub const SERVER_PORT: u16 = 67;
/// The DHCP client port.
pub const CLIENT_PORT: u16 = 68;
/// Longest lease honoured: a year. Longer (or infinite, `0xffffffff`)
/// leases are renewed as if they were a year long, which keeps every
/// deadline far from overflow.
pub const MAX_LEASE: Duration = Duration::from_secs(365 * 24 * 3600);

/// Who the client is on the wire.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Identity {
    /// Client hardware address (the macvlan interface's MAC).
    pub mac: [u8; 6],
    /// Option 12.
    pub hostname: String,
}

/// What a request is for; each kind fills `ciaddr`, the broadcast flag and
/// options as RFC 2131's table 5 says.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Request {
    /// DHCPDISCOVER, optionally asking for an address.
    Discover(Option<Ipv4Addr>),
    /// DHCPREQUEST in SELECTING: the offer taken, from the server named.
    Select {
        /// The offered address.
        address: Ipv4Addr,
        /// The server that offered it.
        server: Ipv4Addr,
    },
    /// DHCPREQUEST in INIT-REBOOT: the address held before a restart.
    Reboot(Ipv4Addr),
    /// DHCPREQUEST in RENEWING (unicast to the server).
    Renew(Ipv4Addr),
    /// DHCPREQUEST in REBINDING (broadcast).
    Rebind(Ipv4Addr),
    /// DHCPRELEASE of the address, to its server.
    Release {
        /// The leased address.
        address: Ipv4Addr,
        /// The server that leased it.
        server: Ipv4Addr,
    },
}

/// Encodes request `kind` with transaction id `xid`.
pub fn build(id: &Identity, xid: u32, kind: Request) -> Vec<u8> {
    let ciaddr = match kind {
        Request::Renew(a) | Request::Rebind(a) | Request::Release { address: a, .. } => a,
        _ => Ipv4Addr::UNSPECIFIED,
    };
    let mut msg = Message::new_with_id(
        xid,
        ciaddr,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        Ipv4Addr::UNSPECIFIED,
        &id.mac,
    );
    msg.set_opcode(Opcode::BootRequest).set_htype(HType::Eth);
    // Before an address is configured, replies can only reach this client
    // as broadcasts (it listens on a UDP socket, not a packet socket).
    if matches!(
        kind,
        Request::Discover(_) | Request::Select { .. } | Request::Reboot(_)
    ) {
        msg.set_flags(Flags::default().set_broadcast());
    }
    let opts = msg.opts_mut();
    let ty = match kind {
        Request::Discover(_) => MessageType::Discover,
        Request::Release { .. } => MessageType::Release,
        _ => MessageType::Request,
    };
    opts.insert(DhcpOption::MessageType(ty));
    let mut client_id = vec![1u8];
    client_id.extend_from_slice(&id.mac);
    opts.insert(DhcpOption::ClientIdentifier(client_id));
    match kind {
        Request::Discover(Some(a)) | Request::Reboot(a) => {
            opts.insert(DhcpOption::RequestedIpAddress(a));
        }
        Request::Select { address, server } => {
            opts.insert(DhcpOption::RequestedIpAddress(address));
            opts.insert(DhcpOption::ServerIdentifier(server));
        }
        Request::Release { server, .. } => {
            opts.insert(DhcpOption::ServerIdentifier(server));
        }
        _ => {}
    }
    if !matches!(kind, Request::Release { .. }) {
        opts.insert(DhcpOption::Hostname(id.hostname.clone()));
        opts.insert(DhcpOption::ParameterRequestList(vec![
            OptionCode::SubnetMask,
            OptionCode::AddressLeaseTime,
            OptionCode::ServerIdentifier,
            OptionCode::Renewal,
            OptionCode::Rebinding,
        ]));
        opts.insert(DhcpOption::MaxMessageSize(1500));
    }
    let mut buf = Vec::with_capacity(300);
    // Encoding a message built from valid parts into a Vec cannot fail;
    // were it to, an empty packet is sent and the server ignores it.
    let _ = msg.encode(&mut Encoder::new(&mut buf));
    buf
}

/// The kinds of reply a client acts on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplyKind {
    /// DHCPOFFER.
    Offer,
    /// DHCPACK.
    Ack,
    /// DHCPNAK.
    Nak,
}

/// A server's reply, decoded but not yet judged.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reply {
    /// Offer, ACK or NAK.
    pub kind: ReplyKind,
    /// Transaction id.
    pub xid: u32,
    /// Client hardware address it is for.
    pub chaddr: [u8; 6],
    /// `yiaddr`: the address offered or acknowledged.
    pub address: Ipv4Addr,
    /// Option 54.
    pub server: Option<Ipv4Addr>,
    /// Option 51.
    pub lease: Option<Duration>,
    /// Option 58.
    pub t1: Option<Duration>,
    /// Option 59.
    pub t2: Option<Duration>,
    /// Option 1, as a prefix length (only contiguous masks).
    pub prefix: Option<u8>,
    /// Option 56: why a server said no.
    pub message: Option<String>,
}

/// Why bytes are not a reply to act on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NotReply {
    /// Not a decodable DHCP message, or not one for an Ethernet client.
    Malformed,
    /// A well-formed message that is no reply a client acts on (a request,
    /// an INFORM, a BOOTP reply without a message type).
    Unexpected,
}

/// Whether an option length is valid for its code.
type LengthRule = fn(usize) -> bool;

/// Options whose length `dhcproto` checks only with `debug_assert!` (a
/// debug build panics on a wrong one, a release build reads past it), with
/// the lengths allowed. Found by the property test below.
const FIXED_LENGTHS: [(u8, LengthRule); 7] = [
    (80, |l| l == 0),
    (81, |l| l >= 3),
    (94, |l| l == 3),
    (152, |l| l == 4),
    (153, |l| l == 4),
    (154, |l| l == 4),
    (155, |l| l == 4),
];

/// Whether every option in `area` (a TLV stream) that `dhcproto` trusts
/// the length of has a valid one. Also learns whether option 52 moves
/// options into `sname`/`file`.
fn lengths_ok(area: &[u8], overload: &mut u8) -> bool {
    let mut i = 0;
    while i < area.len() {
        let code = area[i];
        match code {
            0 => {
                i += 1;
                continue;
            }
            255 => return true,
            _ => {}
        }
        let Some(&len) = area.get(i + 1) else {
            return true; // Truncated: the decoder reports it.
        };
        let len = usize::from(len);
        if code == 52 && len == 1 {
            *overload = area.get(i + 2).copied().unwrap_or(0);
        }
        if FIXED_LENGTHS.iter().any(|(c, ok)| *c == code && !ok(len)) {
            return false;
        }
        i += 2 + len;
    }
    true
}

/// Decodes `bytes`. Never panics.
pub fn parse(bytes: &[u8]) -> Result<Reply, NotReply> {
    // The fixed header is 236 bytes and the magic cookie 4.
    let mut overload = 0;
    if bytes.len() > 240 && !lengths_ok(&bytes[240..], &mut overload) {
        return Err(NotReply::Malformed);
    }
    if overload & 1 != 0 && !lengths_ok(&bytes[108..236], &mut 0) {
        return Err(NotReply::Malformed);
    }
    if overload & 2 != 0 && !lengths_ok(&bytes[44..108], &mut 0) {
        return Err(NotReply::Malformed);
    }
    let msg = Message::decode(&mut Decoder::new(bytes)).map_err(|_| NotReply::Malformed)?;
    if msg.htype() != HType::Eth || msg.hlen() != 6 || msg.chaddr().len() < 6 {
        return Err(NotReply::Malformed);
    }
    if msg.opcode() != Opcode::BootReply {
        return Err(NotReply::Unexpected);
    }
    let kind = match msg.opts().msg_type() {
        Some(MessageType::Offer) => ReplyKind::Offer,
        Some(MessageType::Ack) => ReplyKind::Ack,
        Some(MessageType::Nak) => ReplyKind::Nak,
        _ => return Err(NotReply::Unexpected),
    };
    let mut chaddr = [0u8; 6];
    chaddr.copy_from_slice(&msg.chaddr()[..6]);
    let secs = |code| match msg.opts().get(code) {
        Some(
            DhcpOption::AddressLeaseTime(s) | DhcpOption::Renewal(s) | DhcpOption::Rebinding(s),
        ) => Some(Duration::from_secs(u64::from(*s)).min(MAX_LEASE)),
        _ => None,
    };
    let server = match msg.opts().get(OptionCode::ServerIdentifier) {
        Some(DhcpOption::ServerIdentifier(s)) => Some(*s),
        _ => None,
    };
    let prefix = match msg.opts().get(OptionCode::SubnetMask) {
        Some(DhcpOption::SubnetMask(m)) => {
            let bits = u32::from(*m);
            // Contiguous ones only: 255.0.255.0 is not a prefix.
            (bits.leading_ones() + bits.trailing_zeros() == 32).then(|| bits.leading_ones() as u8)
        }
        _ => None,
    };
    let message = match msg.opts().get(OptionCode::Message) {
        Some(DhcpOption::Message(m)) => Some(m.clone()),
        _ => None,
    };
    Ok(Reply {
        kind,
        xid: msg.xid(),
        chaddr,
        address: msg.yiaddr(),
        server,
        lease: secs(OptionCode::AddressLeaseTime),
        t1: secs(OptionCode::Renewal),
        t2: secs(OptionCode::Rebinding),
        prefix,
        message,
    })
}

/// A server-side message, for tests of the client: what dnsmasq would send.
#[cfg(test)]
pub(crate) fn server_reply(
    kind: ReplyKind,
    xid: u32,
    mac: [u8; 6],
    address: Ipv4Addr,
    server: Ipv4Addr,
    lease_secs: Option<u32>,
) -> Vec<u8> {
    let mut msg = Message::new_with_id(
        xid,
        Ipv4Addr::UNSPECIFIED,
        address,
        server,
        Ipv4Addr::UNSPECIFIED,
        &mac,
    );
    msg.set_opcode(Opcode::BootReply).set_htype(HType::Eth);
    let ty = match kind {
        ReplyKind::Offer => MessageType::Offer,
        ReplyKind::Ack => MessageType::Ack,
        ReplyKind::Nak => MessageType::Nak,
    };
    let opts = msg.opts_mut();
    opts.insert(DhcpOption::MessageType(ty));
    opts.insert(DhcpOption::ServerIdentifier(server));
    if let Some(s) = lease_secs {
        opts.insert(DhcpOption::AddressLeaseTime(s));
        opts.insert(DhcpOption::SubnetMask(Ipv4Addr::new(255, 255, 255, 0)));
    }
    let mut buf = Vec::new();
    msg.encode(&mut Encoder::new(&mut buf)).expect("encode");
    buf
}

/// Decodes a request this client built (tests read what it sent).
#[cfg(test)]
pub(crate) fn decode_request(bytes: &[u8]) -> Message {
    Message::decode(&mut Decoder::new(bytes)).expect("our own request decodes")
}

#[cfg(test)]
mod tests {
    use super::*;

    fn id() -> Identity {
        Identity {
            mac: [2, 0, 0, 0, 0, 1],
            hostname: "kubernetes-default-web".into(),
        }
    }

    #[test]
    fn requests_carry_identity_and_the_right_fields() {
        let a = Ipv4Addr::new(198, 51, 100, 150);
        let s = Ipv4Addr::new(198, 51, 100, 2);
        let m = decode_request(&build(&id(), 7, Request::Discover(Some(a))));
        assert_eq!(m.xid(), 7);
        assert!(m.flags().broadcast());
        assert_eq!(m.opts().msg_type(), Some(MessageType::Discover));
        assert_eq!(
            m.opts().get(OptionCode::Hostname),
            Some(&DhcpOption::Hostname("kubernetes-default-web".into()))
        );
        assert_eq!(
            m.opts().get(OptionCode::RequestedIpAddress),
            Some(&DhcpOption::RequestedIpAddress(a))
        );
        let m = decode_request(&build(&id(), 8, Request::Renew(a)));
        assert_eq!(m.ciaddr(), a);
        assert!(!m.flags().broadcast());
        assert!(m.opts().get(OptionCode::ServerIdentifier).is_none());
        let m = decode_request(&build(
            &id(),
            9,
            Request::Release {
                address: a,
                server: s,
            },
        ));
        assert_eq!(m.opts().msg_type(), Some(MessageType::Release));
        assert_eq!(
            m.opts().get(OptionCode::ServerIdentifier),
            Some(&DhcpOption::ServerIdentifier(s))
        );
    }

    #[test]
    fn a_reply_round_trips() {
        let a = Ipv4Addr::new(198, 51, 100, 150);
        let s = Ipv4Addr::new(198, 51, 100, 2);
        let r = parse(&server_reply(
            ReplyKind::Ack,
            5,
            [2, 0, 0, 0, 0, 1],
            a,
            s,
            Some(120),
        ))
        .expect("parses");
        assert_eq!(r.kind, ReplyKind::Ack);
        assert_eq!(r.address, a);
        assert_eq!(r.server, Some(s));
        assert_eq!(r.lease, Some(Duration::from_secs(120)));
        assert_eq!(r.prefix, Some(24));
        // Our own requests are not replies.
        assert_eq!(
            parse(&build(&id(), 1, Request::Discover(None))),
            Err(NotReply::Unexpected)
        );
    }

    /// Property: no input makes `parse` panic. Random bytes, truncations and
    /// single-byte corruptions of a valid reply (which reach deep into the
    /// option decoder), from a fixed-seed generator so a failure repeats.
    #[test]
    fn parse_never_panics() {
        let mut seed: u64 = 0x9e37_79b9_7f4a_7c15;
        let mut next = move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            seed
        };
        let valid = server_reply(
            ReplyKind::Offer,
            1,
            [2, 0, 0, 0, 0, 1],
            Ipv4Addr::new(198, 51, 100, 150),
            Ipv4Addr::new(198, 51, 100, 2),
            Some(120),
        );
        for len in 0..=valid.len() {
            let _ = parse(&valid[..len]);
        }
        for _ in 0..50_000 {
            // Options appended at random after a valid header.
            let mut v = valid[..240].to_vec();
            for _ in 0..(next() % 8) {
                let code = (next() % 256) as u8;
                let len = (next() % 8) as u8;
                v.push(code);
                v.push(len);
                v.extend((0..len).map(|_| next() as u8));
            }
            let _ = parse(&v);
            let mut v = valid.clone();
            for _ in 0..(next() % 4 + 1) {
                let i = (next() as usize) % v.len();
                v[i] = next() as u8;
            }
            let _ = parse(&v);
            let len = (next() % 600) as usize;
            let junk: Vec<u8> = (0..len).map(|_| next() as u8).collect();
            let _ = parse(&junk);
        }
    }
}

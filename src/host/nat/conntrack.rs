//! Deleting the conntrack entries of flows whose backend left, over
//! ctnetlink (no `conntrack` binary).
//!
//! A UDP flow has no close: every datagram refreshes its conntrack entry,
//! and the entry keeps its NAT binding, so a client with a fixed source
//! port would stay on a removed backend for ever (kubernetes#139628). After
//! each sync, the entries whose original destination is a kernel UDP
//! listener and whose reply comes from a backend no longer eligible are
//! deleted; the client's next datagram is a new flow, DNATed again. The
//! kernel cannot filter by destination, so this is one dump and one delete
//! per stale entry, as `conntrack -D` and kube-proxy do.
//!
//! TCP entries are left alone (open connections of a drained or failed
//! backend run on, as IPVS's weight 0), except with `on_backend_down =
//! "close"`: the entries of a backend its health check marked down are
//! deleted, so the client's next segment meets a reset and it reconnects.

use super::{Desired, ListenerId};
use crate::config::Protocol;
use std::collections::HashMap;
use std::io;
use std::net::IpAddr;

use netlink_packet_core::{
    NLA_HEADER_SIZE, NLM_F_ACK, NLM_F_DUMP, NLM_F_REQUEST, NLMSG_DONE, NLMSG_ERROR, NetlinkBuffer,
    NetlinkHeader, NetlinkMessage, NetlinkPayload, NlasIterator,
};
use netlink_packet_netfilter::conntrack::{
    ConntrackAttribute, ConntrackMessage, IPTuple, ProtoInfo, ProtoInfoTCP, ProtoTuple,
    Protocol as CtProtocol, Tuple,
};
use netlink_packet_netfilter::{
    NetfilterHeader, NetfilterMessage, NetfilterMessageInner, NetfilterProtoFamily,
};
use netlink_sys::Socket;

use super::netlink::KeptSocket;

/// One flow as conntrack has it: what the client sent to, and who answers.
/// The default is nothing read yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Flow {
    /// The original tuple, as received: what a delete names.
    original: Vec<Tuple>,
    orig_dst: Option<IpAddr>,
    orig_dport: Option<u16>,
    udp: bool,
    tcp: bool,
    reply_src: Option<IpAddr>,
    /// The TCP state (`TCP_CONNTRACK_*`), for TCP entries.
    tcp_state: Option<u8>,
}

fn flow(attrs: Vec<ConntrackAttribute>) -> Flow {
    let mut f = Flow::default();
    for a in attrs {
        match a {
            ConntrackAttribute::CtaTupleOrig(tuple) => {
                for t in &tuple {
                    match t {
                        Tuple::Ip(ips) => {
                            for ip in ips {
                                if let IPTuple::DestinationAddress(d) = ip {
                                    f.orig_dst = Some(*d);
                                }
                            }
                        }
                        Tuple::Proto(ps) => {
                            for p in ps {
                                match p {
                                    ProtoTuple::Protocol(CtProtocol::Udp) => f.udp = true,
                                    ProtoTuple::Protocol(CtProtocol::Tcp) => f.tcp = true,
                                    ProtoTuple::DestinationPort(port) => f.orig_dport = Some(*port),
                                    _ => {}
                                }
                            }
                        }
                        _ => {}
                    }
                }
                f.original = tuple;
            }
            ConntrackAttribute::CtaProtoInfo(info) => {
                for i in info {
                    if let ProtoInfo::TCP(tcp) = i {
                        for t in tcp {
                            if let ProtoInfoTCP::State(state) = t {
                                f.tcp_state = Some(state);
                            }
                        }
                    }
                }
            }
            ConntrackAttribute::CtaTupleReply(tuple) => {
                for t in &tuple {
                    if let Tuple::Ip(ips) = t {
                        for ip in ips {
                            if let IPTuple::SourceAddress(s) = ip {
                                f.reply_src = Some(*s);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    f
}

/// Per kernel listener (VIP, protocol, port): the backends still
/// eligible, and those whose TCP flows are to be reset.
pub(crate) type Sweep = HashMap<ListenerId, (Vec<IpAddr>, Vec<IpAddr>)>;

/// The listeners of `desired` that may have stale flows: every UDP one,
/// and TCP ones with backends to reset.
pub(crate) fn sweep_of(desired: &Desired) -> Sweep {
    desired
        .iter()
        .filter(|((_, p, _), l)| *p == Protocol::Udp || !l.close_down.is_empty())
        .map(|(id, l)| (*id, (l.eligible.clone(), l.close_down.clone())))
        .collect()
}

/// Whether conntrack entry `f` is to go: a UDP flow of a kernel listener
/// whose backend is no longer eligible (a flow the proxy or the host
/// answers, whose reply comes from the VIP itself, is not), or a TCP flow
/// to a backend to reset.
fn stale(f: &Flow, sweep: &Sweep) -> bool {
    let (Some(dst), Some(port), Some(reply)) = (f.orig_dst, f.orig_dport, f.reply_src) else {
        return false;
    };
    if f.udp {
        reply != dst
            && sweep
                .get(&(dst, Protocol::Udp, port))
                .is_some_and(|(eligible, _)| !eligible.contains(&reply))
    } else if f.tcp {
        sweep
            .get(&(dst, Protocol::Tcp, port))
            .is_some_and(|(_, close)| close.contains(&reply))
    } else {
        false
    }
}

fn request(family: NetfilterProtoFamily, message: ConntrackMessage, flags: u16) -> Vec<u8> {
    let mut header = NetlinkHeader::default();
    header.flags = flags;
    let mut packet = NetlinkMessage::new(
        header,
        NetlinkPayload::from(NetfilterMessage::new(
            NetfilterHeader::new(family, 0, 0),
            message,
        )),
    );
    packet.finalize();
    let mut buf = vec![0; packet.buffer_len()];
    packet.serialize(&mut buf[..]);
    buf
}

/// The socket of the dumps and deletions, kept open (see
/// [`KeptSocket`]): the readings every 5 s and the sweeps after a flip
/// would otherwise stall the next flip's commit when they close one.
static SOCKET: KeptSocket = KeptSocket::new();

/// Every entry of one address family.
fn dump(family: NetfilterProtoFamily) -> io::Result<Vec<Flow>> {
    SOCKET.with(|socket| dump_on(socket, family))
}

fn dump_on(socket: &Socket, family: NetfilterProtoFamily) -> io::Result<Vec<Flow>> {
    let mut flows = Vec::new();
    dump_entries(socket, family, |entry| {
        let full = <NetlinkMessage<NetfilterMessage>>::deserialize(entry.into_inner())
            .map_err(|e| io::Error::other(format!("ctnetlink: {e}")))?;
        if let NetlinkPayload::InnerMessage(NetfilterMessage {
            inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
            ..
        }) = full.payload
        {
            flows.push(flow(attrs));
        }
        Ok(())
    })?;
    Ok(flows)
}

/// One dump of `family`'s table on `socket`: `each` is given every
/// entry's message as the kernel sent it, until the end of the dump (an
/// error message ends it as an error). The one reading loop of [`dump_on`]
/// and [`count_on`].
fn dump_entries(
    socket: &Socket,
    family: NetfilterProtoFamily,
    mut each: impl FnMut(NetlinkBuffer<&[u8]>) -> io::Result<()>,
) -> io::Result<()> {
    socket.send(
        &request(
            family,
            ConntrackMessage::Get(vec![]),
            NLM_F_REQUEST | NLM_F_DUMP,
        ),
        0,
    )?;
    let mut buf = vec![0u8; 1 << 16];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        let mut offset = 0;
        while offset < size {
            let msg = NetlinkBuffer::new_checked(&buf[offset..size])
                .map_err(|e| io::Error::other(format!("ctnetlink: {e}")))?;
            let len = msg.length() as usize;
            match msg.message_type() {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR => {
                    // The full decode names the error.
                    let full = <NetlinkMessage<NetfilterMessage>>::deserialize(&buf[offset..size])
                        .map_err(|e| io::Error::other(format!("ctnetlink: {e}")))?;
                    return Err(io::Error::other(match full.payload {
                        NetlinkPayload::Error(e) => format!("ctnetlink dump: {e:?}"),
                        other => format!("ctnetlink dump: {other:?}"),
                    }));
                }
                // An entry (`IPCTNL_MSG_CT_NEW`).
                CT_ENTRY => each(msg)?,
                _ => {}
            }
            if len == 0 {
                break;
            }
            offset += netlink_align(len);
        }
    }
}

/// Deletes one entry by its original tuple; an entry gone meanwhile is
/// no error.
fn delete(socket: &Socket, family: NetfilterProtoFamily, original: Vec<Tuple>) -> io::Result<()> {
    socket.send(
        &request(
            family,
            ConntrackMessage::Delete(vec![ConntrackAttribute::CtaTupleOrig(original)]),
            NLM_F_REQUEST | NLM_F_ACK,
        ),
        0,
    )?;
    let mut buf = vec![0u8; 4096];
    let size = socket.recv(&mut &mut buf[..], 0)?;
    let msg = <NetlinkMessage<NetfilterMessage>>::deserialize(&buf[..size])
        .map_err(|e| io::Error::other(format!("ctnetlink: {e}")))?;
    match msg.payload {
        NetlinkPayload::Error(e) => match e.code {
            None => Ok(()),
            Some(code) if -code.get() == libc::ENOENT => Ok(()),
            Some(code) => Err(io::Error::from_raw_os_error(-code.get())),
        },
        _ => Ok(()),
    }
}

/// Deletes the conntrack entries of UDP flows whose backend is no longer
/// eligible on their listener, and of TCP flows to backends to reset;
/// returns how many. Nothing to do (no dump) without such a listener.
/// Blocking.
pub fn delete_stale_flows(desired: &Desired) -> io::Result<usize> {
    let listeners = sweep_of(desired);
    if listeners.is_empty() {
        return Ok(0);
    }
    let mut deleted = 0;
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        if !listeners
            .keys()
            .any(|(vip, _, _)| vip.is_ipv4() == (family == NetfilterProtoFamily::IPv4))
        {
            continue;
        }
        let flows = dump(family)?;
        SOCKET.with(|socket| {
            for f in flows.into_iter().filter(|f| stale(f, &listeners)) {
                delete(socket, family, f.original)?;
                deleted += 1;
            }
            Ok(())
        })?;
    }
    Ok(deleted)
}

/// Whether a TCP entry is a connection still open: from the SYN to the
/// last ACK (`TCP_CONNTRACK_SYN_SENT` .. `LAST_ACK`, and `SYN_SENT2`), not
/// `TIME_WAIT` or `CLOSE`, which a closed connection holds for minutes.
fn open_tcp(state: u8) -> bool {
    matches!(state, 1..=6 | 9)
}

/// Every flow of `flows` counted by [`count_one`].
#[cfg(test)]
fn count(flows: &[Flow], listeners: &[ListenerId]) -> HashMap<(ListenerId, IpAddr), u64> {
    let mut counts = HashMap::new();
    for f in flows {
        count_one(&mut counts, f, listeners);
    }
    counts
}

/// Adds flow `f` to `counts` if it is an open flow of a backend of one of
/// the kernel listeners `listeners`: an entry whose original destination
/// is the listener, answered by the backend (DNATed: the reply does not
/// come from the VIP), TCP ones in an open state, UDP ones all (a UDP
/// entry lives while datagrams flow, then times out).
fn count_one(counts: &mut HashMap<(ListenerId, IpAddr), u64>, f: &Flow, listeners: &[ListenerId]) {
    let (Some(dst), Some(port), Some(reply)) = (f.orig_dst, f.orig_dport, f.reply_src) else {
        return;
    };
    let id = match (f.tcp, f.udp) {
        (true, _) if f.tcp_state.is_some_and(open_tcp) => (dst, Protocol::Tcp, port),
        (_, true) => (dst, Protocol::Udp, port),
        _ => return,
    };
    if reply != dst && listeners.contains(&id) {
        *counts.entry((id, reply)).or_insert(0) += 1;
    }
}

// The attributes [`glance`] reads (`linux/netfilter/nfnetlink_conntrack.h`).
const CTA_TUPLE_ORIG: u16 = 1;
const CTA_TUPLE_REPLY: u16 = 2;
const CTA_PROTOINFO: u16 = 4;
const CTA_TUPLE_IP: u16 = 1;
const CTA_TUPLE_PROTO: u16 = 2;
const CTA_IP_V4_SRC: u16 = 1;
const CTA_IP_V4_DST: u16 = 2;
const CTA_IP_V6_SRC: u16 = 3;
const CTA_IP_V6_DST: u16 = 4;
const CTA_PROTO_NUM: u16 = 1;
const CTA_PROTO_DST_PORT: u16 = 3;
const CTA_PROTOINFO_TCP: u16 = 1;
const CTA_PROTOINFO_TCP_STATE: u16 = 1;
const IPPROTO_TCP: u8 = 6;
const IPPROTO_UDP: u8 = 17;

/// The attributes (type, value) nested in `value`; a malformed one ends
/// the walk.
fn nested(value: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    NlasIterator::new(value).map_while(|nla| {
        let n = nla.ok()?;
        let (kind, len) = (n.kind(), usize::from(n.length()));
        n.into_inner().get(NLA_HEADER_SIZE..len).map(|v| (kind, v))
    })
}

fn addr(value: &[u8]) -> Option<IpAddr> {
    match value.len() {
        4 => <[u8; 4]>::try_from(value).ok().map(IpAddr::from),
        16 => <[u8; 16]>::try_from(value).ok().map(IpAddr::from),
        _ => None,
    }
}

/// What [`count_one`] needs of one entry (`attrs`: the message's attributes
/// after its nfgenmsg), read where it lies in the message: no attribute
/// is decoded that the count does not use, nothing is allocated. The
/// readings every 5 s go over every entry of the host's table, and the
/// table holds every connection of the last two minutes (TIME_WAIT), so
/// their cost grows with the rate of new connections: the full decode
/// ([`flow`], which the sweep's deletes need) allocated for every
/// attribute of every entry.
fn glance(attrs: &[u8]) -> Flow {
    let mut f = Flow::default();
    for (kind, value) in nested(attrs) {
        match kind {
            CTA_TUPLE_ORIG => {
                for (k, v) in nested(value) {
                    match k {
                        CTA_TUPLE_IP => {
                            for (k, v) in nested(v) {
                                if k == CTA_IP_V4_DST || k == CTA_IP_V6_DST {
                                    f.orig_dst = addr(v);
                                }
                            }
                        }
                        CTA_TUPLE_PROTO => {
                            for (k, v) in nested(v) {
                                match (k, v) {
                                    (CTA_PROTO_NUM, [p]) => {
                                        f.tcp = *p == IPPROTO_TCP;
                                        f.udp = *p == IPPROTO_UDP;
                                    }
                                    (CTA_PROTO_DST_PORT, [hi, lo]) => {
                                        f.orig_dport = Some(u16::from_be_bytes([*hi, *lo]));
                                    }
                                    _ => {}
                                }
                            }
                        }
                        _ => {}
                    }
                }
            }
            CTA_TUPLE_REPLY => {
                for (k, v) in nested(value) {
                    if k == CTA_TUPLE_IP {
                        for (k, v) in nested(v) {
                            if k == CTA_IP_V4_SRC || k == CTA_IP_V6_SRC {
                                f.reply_src = addr(v);
                            }
                        }
                    }
                }
            }
            CTA_PROTOINFO => {
                for (k, v) in nested(value) {
                    if k == CTA_PROTOINFO_TCP {
                        for (k, v) in nested(v) {
                            if let (CTA_PROTOINFO_TCP_STATE, [state]) = (k, v) {
                                f.tcp_state = Some(*state);
                            }
                        }
                    }
                }
            }
            _ => {}
        }
    }
    f
}

/// One dump of `family`'s table, counted as it is read (see [`glance`]).
fn count_on(
    socket: &Socket,
    family: NetfilterProtoFamily,
    listeners: &[ListenerId],
) -> io::Result<HashMap<(ListenerId, IpAddr), u64>> {
    let mut counts = HashMap::new();
    dump_entries(socket, family, |entry| {
        // Its attributes after the 4-byte nfgenmsg.
        if let Some(attrs) = entry.payload().get(4..) {
            count_one(&mut counts, &glance(attrs), listeners);
        }
        Ok(())
    })?;
    Ok(counts)
}

/// The message type of every entry in a dump: subsystem
/// `NFNL_SUBSYS_CTNETLINK` (1), message `IPCTNL_MSG_CT_NEW` (0).
const CT_ENTRY: u16 = 1 << 8;

/// Netlink messages start on 4-byte boundaries.
fn netlink_align(len: usize) -> usize {
    (len + 3) & !3
}

/// Open TCP connections and UDP flows per (kernel listener, backend), by
/// one conntrack dump per address family that has such a listener (none
/// without one). Blocking; the cost is one pass over the host's whole
/// table.
pub fn open_connections(
    listeners: &[ListenerId],
) -> io::Result<HashMap<(ListenerId, IpAddr), u64>> {
    let mut counts = HashMap::new();
    for family in [NetfilterProtoFamily::IPv4, NetfilterProtoFamily::IPv6] {
        let v4 = family == NetfilterProtoFamily::IPv4;
        let of_family: Vec<ListenerId> = listeners
            .iter()
            .filter(|(vip, _, _)| vip.is_ipv4() == v4)
            .copied()
            .collect();
        if of_family.is_empty() {
            continue;
        }
        counts.extend(SOCKET.with(|socket| count_on(socket, family, &of_family))?);
    }
    Ok(counts)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(dst: &str, port: u16, udp: bool, reply: &str) -> Flow {
        Flow {
            original: Vec::new(),
            orig_dst: Some(dst.parse().unwrap()),
            orig_dport: Some(port),
            udp,
            tcp: !udp,
            reply_src: Some(reply.parse().unwrap()),
            tcp_state: (!udp).then_some(3),
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    /// An entry as the kernel sends it in a dump, with attributes the
    /// glance skips (status, timeout, mark) around those it reads.
    fn entry(dst: &str, dport: u16, tcp: bool, reply: &str, state: u8) -> Vec<u8> {
        let tuple = |src: IpAddr, dst: IpAddr, sport, dport| {
            vec![
                Tuple::Ip(vec![
                    IPTuple::SourceAddress(src),
                    IPTuple::DestinationAddress(dst),
                ]),
                Tuple::Proto(vec![
                    ProtoTuple::Protocol(if tcp {
                        CtProtocol::Tcp
                    } else {
                        CtProtocol::Udp
                    }),
                    ProtoTuple::SourcePort(sport),
                    ProtoTuple::DestinationPort(dport),
                ]),
            ]
        };
        let client = ip("198.51.100.7");
        let mut attrs = vec![
            ConntrackAttribute::CtaTupleOrig(tuple(client, ip(dst), 40000, dport)),
            ConntrackAttribute::CtaTupleReply(tuple(ip(reply), client, 30080, 40000)),
            ConntrackAttribute::CtaTimeout(117),
            ConntrackAttribute::CtaMark(0),
        ];
        if tcp {
            attrs.push(ConntrackAttribute::CtaProtoInfo(vec![ProtoInfo::TCP(
                vec![ProtoInfoTCP::State(state)],
            )]));
        }
        let family = if ip(dst).is_ipv4() {
            NetfilterProtoFamily::IPv4
        } else {
            NetfilterProtoFamily::IPv6
        };
        request(family, ConntrackMessage::New(attrs), 0)
    }

    #[test]
    fn the_glance_reads_what_the_full_decode_reads() {
        for bytes in [
            entry("192.0.2.10", 80, true, "10.0.0.1", 3),
            entry("192.0.2.10", 80, true, "10.0.0.1", 7),
            entry("2001:db8::10", 53, false, "2001:db8::1", 0),
        ] {
            let msg = NetlinkBuffer::new_checked(&bytes[..]).unwrap();
            assert_eq!(msg.message_type(), CT_ENTRY);
            let glanced = glance(&msg.payload()[4..]);
            let NetlinkPayload::InnerMessage(NetfilterMessage {
                inner: NetfilterMessageInner::Conntrack(ConntrackMessage::New(attrs)),
                ..
            }) = <NetlinkMessage<NetfilterMessage>>::deserialize(&bytes)
                .unwrap()
                .payload
            else {
                panic!("not an entry");
            };
            let full = flow(attrs);
            assert_eq!(
                Flow {
                    original: Vec::new(),
                    ..full
                },
                glanced
            );
            assert!(glanced.orig_dst.is_some() && glanced.reply_src.is_some());
        }
        // Counted as the full decode counts: the open TCP flow (state 3,
        // ESTABLISHED) and the UDP flow, not the one in TIME_WAIT (7).
        let listeners = [
            (ip("192.0.2.10"), Protocol::Tcp, 80),
            (ip("2001:db8::10"), Protocol::Udp, 53),
        ];
        let mut counts = HashMap::new();
        for bytes in [
            entry("192.0.2.10", 80, true, "10.0.0.1", 3),
            entry("192.0.2.10", 80, true, "10.0.0.1", 7),
            entry("2001:db8::10", 53, false, "2001:db8::1", 0),
        ] {
            let msg = NetlinkBuffer::new_checked(&bytes[..]).unwrap();
            count_one(&mut counts, &glance(&msg.payload()[4..]), &listeners);
        }
        assert_eq!(counts.get(&(listeners[0], ip("10.0.0.1"))), Some(&1));
        assert_eq!(counts.get(&(listeners[1], ip("2001:db8::1"))), Some(&1));
        assert_eq!(counts.len(), 2);
    }

    #[test]
    fn udp_flows_of_a_backend_that_left_and_tcp_flows_to_reset_are_stale() {
        let mut l = Sweep::new();
        l.insert(
            (ip("192.0.2.10"), Protocol::Udp, 53),
            (vec![ip("10.0.0.1")], vec![]),
        );
        assert!(stale(&f("192.0.2.10", 53, true, "10.0.0.2"), &l));
        assert!(
            !stale(&f("192.0.2.10", 53, true, "10.0.0.1"), &l),
            "eligible"
        );
        assert!(!stale(&f("192.0.2.10", 53, false, "10.0.0.2"), &l), "tcp");
        assert!(
            !stale(&f("192.0.2.10", 54, true, "10.0.0.2"), &l),
            "another port"
        );
        assert!(
            !stale(&f("192.0.2.10", 53, true, "192.0.2.10"), &l),
            "not DNATed"
        );
        l.insert((ip("192.0.2.11"), Protocol::Udp, 53), (vec![], vec![]));
        assert!(
            stale(&f("192.0.2.11", 53, true, "10.0.0.1"), &l),
            "no backend left"
        );
        l.insert(
            (ip("192.0.2.10"), Protocol::Tcp, 80),
            (vec![ip("10.0.0.1")], vec![ip("10.0.0.2")]),
        );
        assert!(
            stale(&f("192.0.2.10", 80, false, "10.0.0.2"), &l),
            "marked down, close"
        );
        assert!(
            !stale(&f("192.0.2.10", 80, false, "10.0.0.3"), &l),
            "drained: kept"
        );
    }

    #[test]
    fn open_connections_are_counted_per_listener_and_backend() {
        let web = (ip("192.0.2.10"), Protocol::Tcp, 80);
        let mut closed = f("192.0.2.10", 80, false, "10.0.0.1");
        closed.tcp_state = Some(7); // TIME_WAIT
        let flows = [
            f("192.0.2.10", 80, false, "10.0.0.1"),
            f("192.0.2.10", 80, false, "10.0.0.1"),
            f("192.0.2.10", 80, false, "10.0.0.2"),
            closed,
            f("192.0.2.10", 80, false, "192.0.2.10"), // the proxy's own
            f("192.0.2.10", 81, false, "10.0.0.1"),   // another listener
            f("192.0.2.10", 80, true, "10.0.0.1"),    // UDP, another listener
            f("192.0.2.10", 53, true, "10.0.0.2"),
            f("192.0.2.10", 53, true, "192.0.2.10"), // the proxy's own
        ];
        let dns = (ip("192.0.2.10"), Protocol::Udp, 53);
        let c = count(&flows, &[web, dns]);
        assert_eq!(c.len(), 3, "{c:?}");
        assert_eq!(c[&(web, ip("10.0.0.1"))], 2);
        assert_eq!(c[&(web, ip("10.0.0.2"))], 1);
        assert_eq!(c[&(dns, ip("10.0.0.2"))], 1);
    }
}

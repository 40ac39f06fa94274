//! A health flip's rewrite of listener chains, sent to nf_tables over
//! netlink: one batch (one atomic transaction) of "flush chain" and "add
//! rule" messages, the same rules [`super::build`] has `nft` write.
//!
//! Why not `nft`: nft 1.0.6 lists every chain, counter and set of the host
//! before it changes anything (its cache), which at 10,000 listeners is
//! ~0.5 s of dump per call, 25 times the budget of a flip. A flip changes
//! only which backends a listener's chain DNATs to, so this module writes
//! exactly that and nothing else; every other change (objects created or
//! deleted, elements, base chains) stays with `nft` and its checks.
//!
//! The kernel still validates the whole table at the commit (the `nat` and
//! `objref` expressions ask for it): that walk, linear in the table's
//! listeners, is why they are spread over [`super::names::SHARDS`] tables. The
//! socket stays open between flips ([`Writer`]). Messages are built by
//! hand: the
//! `netlink-packet-netfilter` crate has no `numgen`, `objref` or `nat`
//! expression.
//!
//! The same socket kind serves the reads that must not wait for nft's
//! cache: the named counters ([`counters`]), the host's forward base
//! chains ([`forward_base_chains`]), and the dumps `read_back` is built on
//! ([`dump`], [`messages`], [`attributes`]).

use super::names::{
    Shard, backend_counter, denied_counter, listener_chain, no_backend_counter, source_set,
    table_of,
};
use super::{KernelListener, ListenerId};
use crate::config::Protocol;
use std::io;
use std::net::IpAddr;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::error::NftError;

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFNL_MSG_BATCH_BEGIN: u16 = 0x10;
const NFNL_MSG_BATCH_END: u16 = 0x11;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_DELRULE: u16 = 8;
const NLM_F_REQUEST: u16 = 0x1;
const NLM_F_ACK: u16 = 0x4;
const NLM_F_APPEND: u16 = 0x800;
const NLM_F_CREATE: u16 = 0x400;
const NLMSG_ERROR: u16 = 0x2;
const NLA_F_NESTED: u16 = 0x8000;
const NFPROTO_INET: u8 = 1;
const NFPROTO_IPV4: u32 = 2;
const NFPROTO_IPV6: u32 = 10;

const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_LIST_ELEM: u16 = 1;
const NFTA_EXPR_NAME: u16 = 1;
const NFTA_EXPR_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CODE: u16 = 1;
const NFT_RETURN: i32 = -5;
/// The first 16-byte register (an address), and the second (a port).
const NFT_REG_1: u32 = 1;
const NFT_REG_2: u32 = 2;

/// A netlink attribute list being built.
#[derive(Default)]
pub(super) struct Attrs(Vec<u8>);

impl Attrs {
    fn put(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(value);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
        self
    }
    pub(super) fn str(&mut self, kind: u16, value: &str) -> &mut Self {
        let mut v = value.as_bytes().to_vec();
        v.push(0);
        self.put(kind, &v)
    }
    /// Numbers in attributes are big endian (network order).
    fn u32(&mut self, kind: u16, value: u32) -> &mut Self {
        self.put(kind, &value.to_be_bytes())
    }
    fn nest(&mut self, kind: u16, inner: &Attrs) -> &mut Self {
        self.put(kind | NLA_F_NESTED, &inner.0)
    }
}

/// One expression: its name and its attributes.
fn expr(name: &str, data: Attrs) -> Attrs {
    let mut e = Attrs::default();
    e.str(NFTA_EXPR_NAME, name).nest(NFTA_EXPR_DATA, &data);
    e
}

fn value(bytes: &[u8]) -> Attrs {
    let mut v = Attrs::default();
    v.put(NFTA_DATA_VALUE, bytes);
    v
}

/// `cmp eq`: register 1 against `bytes`.
fn cmp_eq(bytes: &[u8]) -> Attrs {
    let mut d = Attrs::default();
    d.u32(1, NFT_REG_1) // NFTA_CMP_SREG
        .u32(2, 0) // NFTA_CMP_OP: NFT_CMP_EQ
        .nest(3, &value(bytes)); // NFTA_CMP_DATA
    expr("cmp", d)
}

/// `meta KEY` into register 1.
fn meta(key: u32) -> Attrs {
    let mut d = Attrs::default();
    d.u32(1, NFT_REG_1).u32(2, key); // NFTA_META_DREG, NFTA_META_KEY
    expr("meta", d)
}

/// `counter name NAME`.
fn named_counter(name: &str) -> Attrs {
    let mut d = Attrs::default();
    d.u32(1, 1) // NFTA_OBJREF_IMM_TYPE: NFT_OBJECT_COUNTER
        .str(2, name); // NFTA_OBJREF_IMM_NAME
    expr("objref", d)
}

/// `immediate` data into register `reg`.
fn immediate(reg: u32, bytes: &[u8]) -> Attrs {
    let mut d = Attrs::default();
    d.u32(1, reg).nest(2, &value(bytes)); // NFTA_IMMEDIATE_DREG, _DATA
    expr("immediate", d)
}

/// `return`.
fn ret() -> Attrs {
    let mut code = Attrs::default();
    code.put(NFTA_VERDICT_CODE, &NFT_RETURN.to_be_bytes());
    let mut data = Attrs::default();
    data.nest(NFTA_DATA_VERDICT, &code);
    let mut d = Attrs::default();
    d.u32(1, 0) // NFTA_IMMEDIATE_DREG: NFT_REG_VERDICT
        .nest(2, &data);
    expr("immediate", d)
}

/// The rules [`super::build`]'s `fill_listener` writes into a listener's
/// chain, expression by expression as nft itself encodes them.
fn listener_rules(id: &ListenerId, l: &KernelListener) -> Vec<Vec<Attrs>> {
    let v4 = id.0.is_ipv4();
    let nfproto = if v4 { NFPROTO_IPV4 } else { NFPROTO_IPV6 } as u8;
    let mut rules = Vec::new();
    if l.source_ranges.is_some() {
        // meta nfproto ipv4; ip saddr != @s_…; counter name d_…; return
        let (offset, len) = if v4 { (12, 4) } else { (8, 16) };
        let mut load = Attrs::default();
        load.u32(1, NFT_REG_1) // NFTA_PAYLOAD_DREG
            .u32(2, 1) // NFTA_PAYLOAD_BASE: network header
            .u32(3, offset) // NFTA_PAYLOAD_OFFSET
            .u32(4, len); // NFTA_PAYLOAD_LEN
        let mut lookup = Attrs::default();
        lookup
            .str(1, &source_set(id)) // NFTA_LOOKUP_SET
            .u32(2, NFT_REG_1) // NFTA_LOOKUP_SREG
            .u32(5, 1); // NFTA_LOOKUP_FLAGS: NFT_LOOKUP_F_INV
        rules.push(vec![
            meta(15), // NFT_META_NFPROTO
            cmp_eq(&[nfproto]),
            expr("payload", load),
            expr("lookup", lookup),
            named_counter(&denied_counter(id)),
            ret(),
        ]);
    }
    if l.eligible.is_empty() {
        rules.push(vec![named_counter(&no_backend_counter(id)), ret()]);
    }
    let l4 = match id.1 {
        Protocol::Tcp => 6u8,
        Protocol::Udp => 17,
    };
    for (k, &b) in l.eligible.iter().enumerate() {
        let mut rule = Vec::new();
        let left = (l.eligible.len() - k) as u32;
        if left > 1 {
            let mut ng = Attrs::default();
            ng.u32(1, NFT_REG_1) // NFTA_NG_DREG
                .u32(2, left) // NFTA_NG_MODULUS
                .u32(3, 0) // NFTA_NG_TYPE: incremental
                .u32(4, 0); // NFTA_NG_OFFSET
            rule.push(expr("numgen", ng));
            rule.push(cmp_eq(&0u32.to_ne_bytes()));
        }
        rule.push(named_counter(&backend_counter(id, b)));
        rule.push(meta(16)); // NFT_META_L4PROTO
        rule.push(cmp_eq(&[l4]));
        let (addr, family) = match b {
            IpAddr::V4(a) => (a.octets().to_vec(), NFPROTO_IPV4),
            IpAddr::V6(a) => (a.octets().to_vec(), NFPROTO_IPV6),
        };
        rule.push(immediate(NFT_REG_1, &addr));
        rule.push(immediate(NFT_REG_2, &l.backend_port.to_be_bytes()));
        let mut nat = Attrs::default();
        nat.u32(1, 1) // NFTA_NAT_TYPE: NFT_NAT_DNAT
            .u32(2, family) // NFTA_NAT_FAMILY
            .u32(3, NFT_REG_1) // NFTA_NAT_REG_ADDR_MIN
            .u32(5, NFT_REG_2); // NFTA_NAT_REG_PROTO_MIN
        rule.push(expr("nat", nat));
        rules.push(rule);
    }
    rules
}

/// A batch of nf_tables messages. Only the last asks for an
/// acknowledgement (a refusal is reported whatever the flags): a few
/// hundred acknowledgements would overflow the socket's receive buffer.
struct Batch {
    buf: Vec<u8>,
    seq: u32,
    /// The nf_tables messages (begin and end not counted).
    messages: u32,
    /// Where the last nf_tables message starts in `buf`.
    last: Option<usize>,
}

impl Batch {
    fn new() -> Self {
        let mut b = Batch {
            buf: Vec::new(),
            seq: 0,
            messages: 0,
            last: None,
        };
        b.message(NFNL_MSG_BATCH_BEGIN, NLM_F_REQUEST, 0, &Attrs::default());
        b
    }

    fn message(&mut self, kind: u16, flags: u16, family: u8, attrs: &Attrs) {
        self.seq += 1;
        let len = 16 + 4 + attrs.0.len();
        self.buf.extend_from_slice(&(len as u32).to_ne_bytes());
        self.buf.extend_from_slice(&kind.to_ne_bytes());
        self.buf.extend_from_slice(&flags.to_ne_bytes());
        self.buf.extend_from_slice(&self.seq.to_ne_bytes());
        self.buf.extend_from_slice(&0u32.to_ne_bytes());
        // nfgenmsg: family, version 0, res_id (the batch's subsystem).
        self.buf.push(family);
        self.buf.push(0);
        let res_id = if kind < 0x100 {
            NFNL_SUBSYS_NFTABLES
        } else {
            0
        };
        self.buf.extend_from_slice(&res_id.to_be_bytes());
        self.buf.extend_from_slice(&attrs.0);
    }

    fn nft(&mut self, msg: u16, flags: u16, attrs: &Attrs) {
        self.last = Some(self.buf.len());
        self.message(
            (NFNL_SUBSYS_NFTABLES << 8) | msg,
            NLM_F_REQUEST | flags,
            NFPROTO_INET,
            attrs,
        );
        self.messages += 1;
    }

    fn end(mut self) -> Self {
        if let Some(at) = self.last {
            let flags = &mut self.buf[at + 6..at + 8];
            let acked = u16::from_ne_bytes([flags[0], flags[1]]) | NLM_F_ACK;
            flags.copy_from_slice(&acked.to_ne_bytes());
        }
        self.message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 0, &Attrs::default());
        self
    }
}

/// The most a batch carries before the next listener starts another: a
/// netlink message must fit the socket's send buffer, and a node that
/// fails flips every listener at once. Each batch is one commit, and each
/// commit validates every table it touches (all 16 when a node fails), so
/// batches are as large as the buffer allows.
const BATCH_BYTES: usize = 1024 * 1024;
/// The send buffer asked for (the kernel caps it at `net.core.wmem_max`,
/// 4 MiB by default, and doubles it); below `BATCH_BYTES` plus a margin,
/// the batches shrink to fit (`wmem_default`, 212,992 bytes, at worst).
const SEND_BUFFER: usize = 2 * BATCH_BYTES;

/// The batches that rewrite `changed` listeners' chains: each chain flushed
/// and filled again within one batch (one transaction), so a listener
/// moves atomically; a large flip (every listener of a failed node) is
/// several transactions.
fn rewrite_batches<'a>(
    changed: impl IntoIterator<Item = (&'a ListenerId, &'a KernelListener)>,
    limit: usize,
) -> Vec<Batch> {
    let mut done = Vec::new();
    let mut batch = Batch::new();
    for (id, l) in changed {
        if batch.buf.len() >= limit {
            done.push(std::mem::replace(&mut batch, Batch::new()).end());
        }
        let chain = listener_chain(id);
        let table = table_of(id);
        let mut target = Attrs::default();
        target
            .str(NFTA_RULE_TABLE, &table)
            .str(NFTA_RULE_CHAIN, &chain);
        batch.nft(NFT_MSG_DELRULE, 0, &target);
        for exprs in listener_rules(id, l) {
            let mut list = Attrs::default();
            for e in &exprs {
                list.nest(NFTA_LIST_ELEM, e);
            }
            let mut rule = Attrs::default();
            rule.str(NFTA_RULE_TABLE, &table)
                .str(NFTA_RULE_CHAIN, &chain)
                .nest(NFTA_RULE_EXPRESSIONS, &list);
            batch.nft(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, &rule);
        }
    }
    if batch.messages > 0 {
        done.push(batch.end());
    }
    done
}

/// A netfilter netlink socket kept open between exchanges, for the same
/// reason as [`Writer`]'s: a socket closed soon after a commit stalls the
/// next commit for an RCU grace period. Used by the periodic readings
/// (counters, conntrack), which run beside the flips.
#[derive(Debug, Default)]
pub(super) struct KeptSocket(std::sync::Mutex<Option<Socket>>);

impl KeptSocket {
    /// None opened yet.
    pub(super) const fn new() -> Self {
        Self(std::sync::Mutex::new(None))
    }

    /// Runs one exchange on the kept socket (opened first if there is
    /// none). A failed exchange drops it: it may still hold the rest of
    /// the failed answer.
    pub(super) fn with<T>(&self, exchange: impl FnOnce(&Socket) -> io::Result<T>) -> io::Result<T> {
        let mut kept = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let socket = match kept.take() {
            Some(s) => s,
            None => connected()?,
        };
        let result = exchange(&socket);
        if result.is_ok() {
            *kept = Some(socket);
        }
        result
    }
}

/// A netfilter netlink socket, connected to the kernel.
pub(super) fn connected() -> io::Result<Socket> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    Ok(socket)
}

fn write_error(e: io::Error) -> NftError {
    NftError::new("write", format!("over netlink: {e}"))
}

/// A netlink socket kept open for the flips.
///
/// Why kept: closing a netfilter netlink socket makes nf_tables wait, with
/// its commit lock held, for the release of the last transaction's old
/// rules, which waits for an RCU grace period (`nft_rcv_nl_event`): 12 to
/// 23 ms per flip at 10,000 listeners on the test machine, more than the
/// commit itself. One socket per flip paid that every time.
#[derive(Debug)]
pub(super) struct Writer {
    socket: Socket,
    /// The most one batch carries, from the send buffer granted.
    limit: usize,
}

impl Writer {
    /// A socket connected to nf_tables, its send buffer as large as the
    /// host allows.
    pub(super) fn open() -> Result<Self, NftError> {
        let socket = connected().map_err(write_error)?;
        // Refusals without a copy of the refused message.
        socket.set_cap_ack(true).map_err(write_error)?;
        let sock = socket2::SockRef::from(&socket);
        if let Err(e) = sock.set_send_buffer_size(SEND_BUFFER) {
            tracing::debug!("netlink send buffer: {e}");
        }
        // What the kernel granted (it reports twice what it keeps for
        // data), less room for the listener that crosses the limit.
        let granted = sock.send_buffer_size().map_err(write_error)? / 2;
        let limit = BATCH_BYTES
            .min(granted.saturating_sub(64 * 1024))
            .max(16 * 1024);
        Ok(Self { socket, limit })
    }

    /// Rewrites the chains of `changed` listeners (their objects exist:
    /// only their backend choice changed). After an error the socket may
    /// hold answers to what failed: the caller drops this writer.
    pub(super) fn rewrite_listeners<'a>(
        &self,
        changed: impl IntoIterator<Item = (&'a ListenerId, &'a KernelListener)>,
    ) -> Result<(), NftError> {
        for batch in rewrite_batches(changed, self.limit) {
            send(&self.socket, &batch).map_err(write_error)?;
        }
        Ok(())
    }
}

const NFT_MSG_NEWOBJ: u16 = 18;
const NFT_MSG_GETOBJ: u16 = 19;
const NLM_F_DUMP: u16 = 0x300;
const NLMSG_DONE: u16 = 0x3;
const NFTA_OBJ_TABLE: u16 = 1;
const NFTA_OBJ_NAME: u16 = 2;
const NFTA_OBJ_TYPE: u16 = 3;
const NFTA_OBJ_DATA: u16 = 4;
const NFT_OBJECT_COUNTER: u32 = 1;
const NFTA_COUNTER_PACKETS: u16 = 2;

/// Our tables' named counters, `(name, packets)`: for a NAT chain's
/// counter one packet is one new connection. One netlink dump of the
/// family's counters (the kernel filters by one table or by none),
/// kept when their table is one of ours.
///
/// Why not `nft -j list counters`: `nft` fetches its cache of the whole
/// ruleset first, which at 10,000 listeners (40,000 counters) took 9.5 s of
/// wall time and 2.6 s of CPU per read on the 2-core test machine, every
/// 5 s. The dump reads only the counter objects.
pub fn counters() -> Result<Vec<(String, u64)>, NftError> {
    static SOCKET: KeptSocket = KeptSocket::new();
    SOCKET
        .with(dump_counters)
        .map_err(|e| NftError::new("read", format!("counters over netlink: {e}")))
}

fn dump_counters(socket: &Socket) -> io::Result<Vec<(String, u64)>> {
    let mut attrs = Attrs::default();
    attrs.u32(NFTA_OBJ_TYPE, NFT_OBJECT_COUNTER);
    let mut counters = Vec::new();
    dump(socket, NFT_MSG_GETOBJ, &attrs, NFT_MSG_NEWOBJ, |body| {
        counters.extend(counter_of(body));
    })?;
    Ok(counters)
}

/// One nf_tables dump of family `inet`: `request` with `attrs`, then
/// `each` on the attributes of every `answer` message until the end. A
/// missing table or object is an empty dump.
pub(super) fn dump(
    socket: &Socket,
    request: u16,
    attrs: &Attrs,
    answer: u16,
    mut each: impl FnMut(&[u8]),
) -> io::Result<()> {
    dump_family(socket, NFPROTO_INET, request, attrs, answer, |_, body| {
        each(body)
    })
}

/// [`dump`] of `family` (`NFPROTO_UNSPEC`: every family); `each` gets
/// the family of every answer too.
fn dump_family(
    socket: &Socket,
    family: u8,
    request: u16,
    attrs: &Attrs,
    answer: u16,
    mut each: impl FnMut(u8, &[u8]),
) -> io::Result<()> {
    let mut msg = Vec::with_capacity(20 + attrs.0.len());
    let len = (16 + 4 + attrs.0.len()) as u32;
    msg.extend_from_slice(&len.to_ne_bytes());
    msg.extend_from_slice(&(NFNL_SUBSYS_NFTABLES << 8 | request).to_ne_bytes());
    msg.extend_from_slice(&(NLM_F_REQUEST | NLM_F_DUMP).to_ne_bytes());
    msg.extend_from_slice(&1u32.to_ne_bytes()); // sequence
    msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
    msg.extend_from_slice(&[family, 0, 0, 0]); // nfgenmsg
    msg.extend_from_slice(&attrs.0);
    socket.send(&msg, 0)?;

    let mut buf = vec![0u8; 1 << 20];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        for message in messages(&buf[..size]) {
            let (kind, body) = message?;
            match kind {
                NLMSG_DONE => return Ok(()),
                NLMSG_ERROR if body.len() >= 4 => {
                    let code = i32::from_ne_bytes(body[..4].try_into().expect("4 bytes"));
                    match -code {
                        0 => {}
                        libc::ENOENT => return Ok(()),
                        errno => return Err(io::Error::from_raw_os_error(errno)),
                    }
                }
                k if k == NFNL_SUBSYS_NFTABLES << 8 | answer && body.len() >= 4 => {
                    each(body[0], &body[4..])
                }
                _ => {}
            }
        }
    }
}

const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFPROTO_UNSPEC: u8 = 0;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NF_INET_FORWARD: u32 = 2;

/// A base chain on the forward hook of an IP family (`ip`, `ip6`,
/// `inet`), as the kernel dumps it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ForwardChain {
    /// `ip`, `ip6` or `inet`, as `nft` names it.
    pub family: &'static str,
    /// Its table.
    pub table: String,
    /// Its name.
    pub name: String,
}

/// Every base chain on the forward hook of the IP families, in one
/// netlink dump of the host's chains, without their rules. Why not
/// `nft -j list chains`: with a table of 15,000 chains it took 1.4 s
/// (busy 2-core machine) and printed 1.4 MB, every 5 s: nft fetches its
/// cache of the whole ruleset first.
pub fn forward_base_chains() -> io::Result<Vec<ForwardChain>> {
    let socket = connected()?;
    let mut chains = Vec::new();
    dump_family(
        &socket,
        NFPROTO_UNSPEC,
        NFT_MSG_GETCHAIN,
        &Attrs::default(),
        NFT_MSG_NEWCHAIN,
        |family, body| chains.extend(forward_chain(family, body)),
    )?;
    Ok(chains)
}

/// One dumped chain, if it is a forward base chain of an IP family.
fn forward_chain(family: u8, body: &[u8]) -> Option<ForwardChain> {
    let family = match u32::from(family) {
        f if f == u32::from(NFPROTO_INET) => "inet",
        NFPROTO_IPV4 => "ip",
        NFPROTO_IPV6 => "ip6",
        _ => return None,
    };
    let string = |v: &[u8]| {
        v.split(|&c| c == 0)
            .next()
            .map(|n| String::from_utf8_lossy(n).into_owned())
    };
    let be32 = |v: &[u8]| Some(u32::from_be_bytes(v.get(..4)?.try_into().ok()?));
    let (mut table, mut name, mut hook) = (None, None, None);
    for (kind, value) in attributes(body) {
        match kind {
            NFTA_CHAIN_TABLE => table = string(value),
            NFTA_CHAIN_NAME => name = string(value),
            NFTA_CHAIN_HOOK => {
                hook = attributes(value)
                    .find(|(k, _)| *k == NFTA_HOOK_HOOKNUM)
                    .and_then(|(_, v)| be32(v));
            }
            _ => {}
        }
    }
    (hook? == NF_INET_FORWARD).then_some(())?;
    Some(ForwardChain {
        family,
        table: table?,
        name: name?,
    })
}

/// The netlink messages of one datagram from nf_tables: `(type, body
/// after the 16-byte header)`; an `Err` ends it where a length is wrong.
pub(super) fn messages(mut b: &[u8]) -> impl Iterator<Item = io::Result<(u16, &[u8])>> {
    std::iter::from_fn(move || {
        if b.len() < 16 {
            return None;
        }
        let len = u32::from_ne_bytes(b[..4].try_into().expect("4 bytes")) as usize;
        let kind = u16::from_ne_bytes([b[4], b[5]]);
        if len < 16 || len > b.len() {
            b = &[];
            return Some(Err(io::Error::other("a malformed answer from nf_tables")));
        }
        let body = &b[16..len];
        b = &b[len.next_multiple_of(4).min(b.len())..];
        Some(Ok((kind, body)))
    })
}

/// The attributes of a netlink message body: `(type without flags, value)`.
pub(super) fn attributes(mut b: &[u8]) -> impl Iterator<Item = (u16, &[u8])> {
    std::iter::from_fn(move || {
        if b.len() < 4 {
            return None;
        }
        let len = u16::from_ne_bytes([b[0], b[1]]) as usize;
        let kind = u16::from_ne_bytes([b[2], b[3]]) & !NLA_F_NESTED;
        if len < 4 || len > b.len() {
            return None;
        }
        let value = &b[4..len];
        b = &b[len.next_multiple_of(4).min(b.len())..];
        Some((kind, value))
    })
}

/// One counter object's name and packet count; `None` when it is not in
/// one of our tables.
fn counter_of(attrs: &[u8]) -> Option<(String, u64)> {
    let mut name = None;
    let mut packets = None;
    let mut ours = false;
    for (kind, value) in attributes(attrs) {
        match kind {
            NFTA_OBJ_TABLE => {
                let text = value.split(|&c| c == 0).next()?;
                ours = std::str::from_utf8(text)
                    .ok()
                    .and_then(Shard::from_table)
                    .is_some();
            }
            NFTA_OBJ_NAME => {
                let text = value.split(|&c| c == 0).next()?;
                name = Some(String::from_utf8_lossy(text).into_owned());
            }
            NFTA_OBJ_DATA => {
                packets = attributes(value)
                    .find(|(k, v)| *k == NFTA_COUNTER_PACKETS && v.len() == 8)
                    .map(|(_, v)| u64::from_be_bytes(v.try_into().expect("8 bytes")));
            }
            _ => {}
        }
    }
    ours.then_some((name?, packets?))
}

/// Sends one batch and reads its acknowledgements: `Err` at the first
/// refusal (the kernel then applied none of the batch).
fn send(socket: &Socket, batch: &Batch) -> io::Result<()> {
    socket.send(&batch.buf, 0)?;
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        for message in messages(&buf[..size]) {
            let (kind, body) = message?;
            if kind == NLMSG_ERROR && body.len() >= 4 {
                let code = i32::from_ne_bytes(body[..4].try_into().expect("4 bytes"));
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
                // The acknowledgement of the last message: all applied.
                return Ok(());
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flip_batch_is_one_flush_and_one_rule_per_eligible_backend() {
        let id: ListenerId = ("192.0.2.10".parse().unwrap(), Protocol::Tcp, 80);
        let both = ["10.0.0.1", "10.0.0.2"];
        let l = super::super::test_listener(&both, &both);
        let batches = rewrite_batches([(&id, &l)], BATCH_BYTES);
        assert_eq!(batches.len(), 1);
        let batch = &batches[0];
        // begin, flush, two rules, end.
        assert_eq!((batch.seq, batch.messages), (5, 3));
        let text = String::from_utf8_lossy(&batch.buf);
        assert!(text.contains("n_tcp_80_192.0.2.10_10.0.0.2"));
        assert!(text.contains("numgen"));
        assert_eq!(
            text.matches("numgen").count(),
            1,
            "the last rule takes the rest"
        );
    }

    #[test]
    fn a_flip_of_many_listeners_is_several_batches_each_under_the_limit() {
        let members: Vec<IpAddr> = (1..=3)
            .map(|i| format!("10.0.0.{i}").parse().unwrap())
            .collect();
        let l = KernelListener::round_robin(30080, members.clone(), members[1..].to_vec());
        let ids: Vec<ListenerId> = (0..2_000u16)
            .map(|p| ("192.0.2.10".parse().unwrap(), Protocol::Tcp, p + 1))
            .collect();
        let limit = 128 * 1024;
        let batches = rewrite_batches(ids.iter().map(|id| (id, &l)), limit);
        assert!(batches.len() > 1, "{}", batches.len());
        for b in &batches {
            // One listener more than the limit at most.
            assert!(b.buf.len() < limit + 4096, "{}", b.buf.len());
        }
        let messages: u32 = batches.iter().map(|b| b.messages).sum();
        assert_eq!(messages, 2_000 * 3, "a flush and two rules per listener");
    }
}

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
//! `objref` expressions ask for it): that walk, linear in the listeners, is
//! what a flip costs at scale. Messages are built by hand: the
//! `netlink-packet-netfilter` crate has no `numgen`, `objref` or `nat`
//! expression.

use std::io;
use std::net::IpAddr;

use netlink_sys::{Socket, SocketAddr, protocols::NETLINK_NETFILTER};

use super::nft::NftError;
use super::*;

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
struct Attrs(Vec<u8>);

impl Attrs {
    fn put(&mut self, kind: u16, value: &[u8]) -> &mut Self {
        let len = 4 + value.len();
        self.0.extend_from_slice(&(len as u16).to_ne_bytes());
        self.0.extend_from_slice(&kind.to_ne_bytes());
        self.0.extend_from_slice(value);
        self.0.resize(self.0.len().next_multiple_of(4), 0);
        self
    }
    fn str(&mut self, kind: u16, value: &str) -> &mut Self {
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

/// A batch of nf_tables messages, each acknowledged.
struct Batch {
    buf: Vec<u8>,
    seq: u32,
    acked: u32,
}

impl Batch {
    fn new() -> Self {
        let mut b = Batch {
            buf: Vec::new(),
            seq: 0,
            acked: 0,
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
        self.message(
            (NFNL_SUBSYS_NFTABLES << 8) | msg,
            NLM_F_REQUEST | NLM_F_ACK | flags,
            NFPROTO_INET,
            attrs,
        );
        self.acked += 1;
    }

    fn end(mut self) -> Self {
        self.message(NFNL_MSG_BATCH_END, NLM_F_REQUEST, 0, &Attrs::default());
        self
    }
}

/// The batch that rewrites `changed` listeners' chains: each flushed and
/// filled again, all in one transaction.
fn rewrite_batch<'a>(
    changed: impl IntoIterator<Item = (&'a ListenerId, &'a KernelListener)>,
) -> Batch {
    let mut batch = Batch::new();
    for (id, l) in changed {
        let chain = listener_chain(id);
        let mut target = Attrs::default();
        target
            .str(NFTA_RULE_TABLE, super::TABLE)
            .str(NFTA_RULE_CHAIN, &chain);
        batch.nft(NFT_MSG_DELRULE, 0, &target);
        for exprs in listener_rules(id, l) {
            let mut list = Attrs::default();
            for e in &exprs {
                list.nest(NFTA_LIST_ELEM, e);
            }
            let mut rule = Attrs::default();
            rule.str(NFTA_RULE_TABLE, super::TABLE)
                .str(NFTA_RULE_CHAIN, &chain)
                .nest(NFTA_RULE_EXPRESSIONS, &list);
            batch.nft(NFT_MSG_NEWRULE, NLM_F_CREATE | NLM_F_APPEND, &rule);
        }
    }
    batch.end()
}

/// Rewrites the chains of `changed` listeners (their objects exist: only
/// their backend choice changed) in one transaction.
pub(super) fn rewrite_listeners<'a>(
    changed: impl IntoIterator<Item = (&'a ListenerId, &'a KernelListener)>,
) -> Result<(), NftError> {
    let batch = rewrite_batch(changed);
    send(&batch).map_err(|e| NftError::new("write", format!("over netlink: {e}")))
}

fn send(batch: &Batch) -> io::Result<()> {
    let mut socket = Socket::new(NETLINK_NETFILTER)?;
    socket.bind_auto()?;
    socket.connect(&SocketAddr::new(0, 0))?;
    socket.send(&batch.buf, 0)?;
    let mut acked = 0;
    let mut buf = vec![0u8; 64 * 1024];
    while acked < batch.acked {
        let size = socket.recv(&mut &mut buf[..], 0)?;
        let mut at = 0;
        while at + 16 <= size {
            let len = u32::from_ne_bytes(buf[at..at + 4].try_into().expect("4 bytes")) as usize;
            let kind = u16::from_ne_bytes(buf[at + 4..at + 6].try_into().expect("2 bytes"));
            if len < 16 || at + len > size {
                return Err(io::Error::other("a malformed answer from nf_tables"));
            }
            if kind == NLMSG_ERROR && len >= 20 {
                let code = i32::from_ne_bytes(buf[at + 16..at + 20].try_into().expect("4 bytes"));
                if code != 0 {
                    return Err(io::Error::from_raw_os_error(-code));
                }
                acked += 1;
            }
            at += len.next_multiple_of(4);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_flip_batch_is_one_flush_and_one_rule_per_eligible_backend() {
        let id: ListenerId = ("192.0.2.10".parse().unwrap(), Protocol::Tcp, 80);
        let l = KernelListener {
            backend_port: 30080,
            members: vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()],
            eligible: vec!["10.0.0.1".parse().unwrap(), "10.0.0.2".parse().unwrap()],
            source_ranges: None,
            source_nat: SourceNat::Masquerade,
            close_down: Vec::new(),
        };
        let batch = rewrite_batch([(&id, &l)]);
        // begin, flush, two rules, end; three of them acknowledged.
        assert_eq!((batch.seq, batch.acked), (5, 3));
        let text = String::from_utf8_lossy(&batch.buf);
        assert!(text.contains("n_tcp_80_192.0.2.10_10.0.0.2"));
        assert!(text.contains("numgen"));
        assert_eq!(
            text.matches("numgen").count(),
            1,
            "the last rule takes the rest"
        );
    }
}

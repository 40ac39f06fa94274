//! What one listener writes in its table: its chain (the pick), its
//! backend chains, its bucket map and affinity sets, and the declaration
//! of its own objects.
//!
//! Apart from [`super`] because this is the part that changes with the
//! pick algorithm (round robin, `source_ip` and `flow_hash` buckets,
//! client affinity) and with each listener's options, while the builder
//! itself assembles transactions (full, partial) from the tables' fixed
//! parts, the source NAT elements and these listener parts. Pure, like
//! the builder: desired state in, nft commands out.

use ipnet::IpNet;
use std::borrow::Cow;
use std::net::IpAddr;

use nftables::expr::{Expression, JHash, NamedExpression, NgMode, Numgen, Prefix, SetItem};
use nftables::schema::{
    Element, FlushObject, NfCmd, NfListObject, NfObject, SetFlag, SetTypeValue,
};
use nftables::stmt::{self, JumpTarget, NAT, NATFamily, Operator, Statement, VerdictMap};
use nftables::types::NfFamily;

use super::super::names::{
    FAMILIES, Shard, affinity_set, backend_chain, backend_counter, bucket_map, denied_counter,
    listener_chain, no_backend_counter, source_set,
};
use super::super::{Desired, KernelListener, ListenerId};
use super::{
    TableObjects, add, addr_type, chain, concat, counter, element, goto, ip_proto, is_v4, l4proto,
    listener_key, map, matches, nft_string, payload, proto_name, rule, set_ref, tuple_set,
};
use crate::config::{Algorithm, Protocol};
use crate::dataplane::balancer::select;

/// A listener's rules and elements, into its declared objects. `before`:
/// the listener as the kernel holds it (its bucket map is then edited
/// element-wise); `None`: unknown, so its bucket map is filled afresh.
pub(super) fn fill_listener(
    cmds: &mut Vec<NfObject<'static>>,
    id: &ListenerId,
    l: &KernelListener,
    before: Option<&KernelListener>,
) {
    let v4 = is_v4(id.0);
    let f = &FAMILIES[usize::from(!v4)];
    let t = Shard::of(id);
    let lchain = listener_chain(id);
    cmds.push(element(
        t,
        f.dispatch,
        vec![Expression::Named(NamedExpression::Set(vec![
            SetItem::Mapping(listener_key(id), Expression::Verdict(goto(lchain.clone()))),
        ]))],
    ));
    cmds.push(element(Shard::MAIN, f.refuse, vec![listener_key(id)]));
    if let Some(ranges) = &l.source_ranges {
        let family: Vec<IpNet> = ranges
            .iter()
            .filter(|n| n.addr().is_ipv4() == v4)
            .copied()
            .collect();
        let merged = IpNet::aggregate(&family);
        if !merged.is_empty() {
            cmds.push(element(
                t,
                &source_set(id),
                merged
                    .iter()
                    .map(|n| {
                        Expression::Named(NamedExpression::Prefix(Prefix {
                            addr: Box::new(Expression::String(nft_string(n.addr().to_string()))),
                            len: u32::from(n.prefix_len()),
                        }))
                    })
                    .collect(),
            ));
        }
        cmds.push(rule(
            t,
            &lchain,
            vec![
                matches(
                    payload(ip_proto(v4), "saddr"),
                    Operator::NEQ,
                    set_ref(&source_set(id)),
                ),
                Statement::Counter(stmt::Counter::Named(nft_string(denied_counter(id)))),
                Statement::Return(None),
            ],
        ));
    }
    if l.affinity.is_some() {
        fill_affinity(cmds, id, l);
    }
    if uses_buckets(l.pick) {
        fill_buckets(cmds, id, l, before);
    }
    if picks_up(id, l) {
        cmds.push(element(t, f.pickup, vec![listener_key(id)]));
    }
    // The backend choice. Round robin without a set (an anonymous one per
    // listener makes the kernel's commit quadratic in the listeners) and,
    // unless a map or a set must name a backend, with no chain per backend:
    // a health flip then rewrites this chain alone ([`super::netlink`]
    // writes the same rules).
    let chains = has_backend_chains(l);
    if l.eligible.is_empty() {
        cmds.push(rule(
            t,
            &lchain,
            vec![
                Statement::Counter(stmt::Counter::Named(nft_string(no_backend_counter(id)))),
                Statement::Return(None),
            ],
        ));
    } else if uses_buckets(l.pick) {
        cmds.push(rule(
            t,
            &lchain,
            vec![Statement::VerdictMap(VerdictMap {
                key: Expression::Named(NamedExpression::JHash(JHash {
                    hash_mod: BUCKETS,
                    expr: Box::new(bucket_hash_input(l.pick, v4)),
                    offset: None,
                    seed: Some(BUCKET_SEED),
                })),
                data: set_ref(&bucket_map(id)),
            })],
        ));
    } else {
        for (k, &b) in l.eligible.iter().enumerate() {
            let mut expr = Vec::new();
            // Rule k takes every (E - k)th of the connections that reach
            // it, each rule keeping its own count.
            let left = l.eligible.len() - k;
            if left > 1 {
                expr.push(matches(
                    Expression::Named(NamedExpression::Numgen(Numgen {
                        mode: NgMode::Inc,
                        ng_mod: left as u32,
                        offset: None,
                    })),
                    Operator::EQ,
                    Expression::Number(0),
                ));
            }
            if chains {
                expr.push(Statement::Goto(JumpTarget {
                    target: nft_string(backend_chain(id, b)),
                }));
            } else {
                expr.extend(count_and_dnat(id, l, b));
            }
            cmds.push(rule(t, &lchain, expr));
        }
    }
    if chains {
        for &b in &l.members {
            let remember = l.affinity.map(|_| {
                Statement::Set(stmt::Set {
                    op: stmt::SetOp::Update,
                    elem: payload(ip_proto(v4), "saddr"),
                    set: nft_string(format!("@{}", affinity_set(id, b))),
                })
            });
            cmds.push(rule(
                t,
                &backend_chain(id, b),
                remember
                    .into_iter()
                    .chain(count_and_dnat(id, l, b))
                    .collect(),
            ));
        }
    }
    // The masquerade elements are shared (see [`nat_users`]): written by
    // the caller, each once.
}

/// Whether listener `l` keeps a chain per backend: only where a bucket map
/// (`source_ip`) or an affinity set (`client_ip`) must name a backend as a
/// verdict. Plain round robin does without them, so that a flip is one
/// chain's rules (see [`super::super::netlink`]).
pub(in crate::host::nat) fn has_backend_chains(l: &KernelListener) -> bool {
    uses_buckets(l.pick) || l.affinity.is_some()
}

/// Whether `pick` chooses through a bucket map: `source_ip` and
/// `flow_hash`, whose buckets are filled alike (by [`buckets`]) and differ
/// only in what the kernel hashes to find one ([`bucket_hash_input`]).
pub(super) fn uses_buckets(pick: Algorithm) -> bool {
    matches!(pick, Algorithm::SourceIp | Algorithm::FlowHash)
}

/// What the kernel's `jhash` is given to find a flow's bucket: the client's
/// address for `source_ip` (a client keeps its backend); the client's
/// address and port for `flow_hash` (`ip saddr . th sport`: one client's
/// flows spread, and a flow keeps its backend on every host). The VIP and
/// the listener's port are the same for every flow of the listener's
/// chain, so hashing them too would spread nothing more.
fn bucket_hash_input(pick: Algorithm, v4: bool) -> Expression<'static> {
    let saddr = payload(ip_proto(v4), "saddr");
    if pick == Algorithm::FlowHash {
        concat(vec![saddr, payload("th", "sport")])
    } else {
        saddr
    }
}

/// Whether the kernel must take a TCP segment of listener `id` that is
/// not a SYN, and not one of this host's connections, as a flow to DNAT
/// (an element of the `pickup` set): a `flow_hash` or `source_ip` TCP
/// listener, whose flows may reach this host mid-stream from another (a
/// BGP rehash, a VIP's failover) and go on to the backend the other host
/// chose (round robin's would be another: its own stack resets them).
/// Without the element, the listener's own userspace socket, bound as the
/// fallback, owns such a segment in the socket lookup of
/// [`super::terminated_here`], which keeps it from the DNAT, and answers it with a
/// reset.
pub(in crate::host::nat) fn picks_up(id: &ListenerId, l: &KernelListener) -> bool {
    id.1 == Protocol::Tcp && uses_buckets(l.pick)
}

/// A new flow to backend `b`: its named counter, then the DNAT.
fn count_and_dnat(id: &ListenerId, l: &KernelListener, b: IpAddr) -> [Statement<'static>; 3] {
    [
        Statement::Counter(stmt::Counter::Named(nft_string(backend_counter(id, b)))),
        matches(l4proto(), Operator::EQ, proto_name(id.1)),
        Statement::DNAT(Some(NAT {
            addr: Some(Expression::String(nft_string(b.to_string()))),
            family: Some(if b.is_ipv4() {
                NATFamily::IP
            } else {
                NATFamily::IP6
            }),
            port: Some(Expression::Number(u32::from(l.backend_port))),
            flags: None,
        })),
    ]
}

/// Buckets of a `source_ip` listener's map: the client address's `jhash`
/// modulo this. A few thousand, so that the clients of one backend spread
/// evenly over the others when it leaves (the notes measured a 4093-entry
/// map loading in about 40 ms); prime, as the Maglev tables are.
pub const BUCKETS: u32 = 4093;

/// The `jhash` seed of the bucket maps. Fixed: without one the kernel
/// draws a random seed each time the rule is loaded, and every rewrite of
/// the listener's chain (any health flip) would move every client.
const BUCKET_SEED: u32 = 0x6862_6c62;

/// The backend of every bucket (index = bucket), by the proxy's own
/// rendezvous pick over `eligible` for the bucket's key: the bucket index
/// taken as an IPv4 address ([`bucket_key`]). A bucket keeps its backend
/// while that backend is eligible; when one leaves only its buckets move.
/// Empty without an eligible backend.
pub fn buckets(eligible: &[IpAddr]) -> Vec<IpAddr> {
    if eligible.is_empty() {
        return Vec::new();
    }
    let hashes: Vec<u64> = eligible.iter().map(|b| select::hash_ip(*b)).collect();
    (0..BUCKETS)
        .map(|i| eligible[select::rendezvous(bucket_key(i), hashes.iter().copied())])
        .collect()
}

/// What the rendezvous hash is given for bucket `i` in place of a client
/// address: computable here, for every bucket, without knowing the kernel's
/// `jhash`.
pub fn bucket_key(i: u32) -> IpAddr {
    IpAddr::V4(std::net::Ipv4Addr::from(i))
}

/// A `source_ip` listener's bucket map, edited to `l`'s buckets: only the
/// buckets whose backend changed since `before` are deleted and added
/// again (a health flip moves the buckets of one backend), all of them when
/// `before` is unknown.
fn fill_buckets(
    cmds: &mut Vec<NfObject<'static>>,
    id: &ListenerId,
    l: &KernelListener,
    before: Option<&KernelListener>,
) {
    let t = Shard::of(id);
    let name = bucket_map(id);
    let now = buckets(&l.eligible);
    let was = match before {
        Some(b) if uses_buckets(b.pick) => buckets(&b.eligible),
        Some(_) => Vec::new(),
        None => {
            cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Map(map(
                t, &name,
            )))));
            Vec::new()
        }
    };
    let mut gone = Vec::new();
    let mut new = Vec::new();
    for i in 0..BUCKETS as usize {
        let (old, cur) = (was.get(i), now.get(i));
        if old == cur {
            continue;
        }
        if old.is_some() {
            gone.push(Expression::Number(i as u32));
        }
        if let Some(&b) = cur {
            new.push(SetItem::Mapping(
                Expression::Number(i as u32),
                Expression::Verdict(goto(backend_chain(id, b))),
            ));
        }
    }
    if !gone.is_empty() {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Element(
            Element {
                family: NfFamily::INet,
                table: nft_string(t.table()),
                name: nft_string(&name),
                elem: Cow::Owned(gone),
            },
        ))));
    }
    if !new.is_empty() {
        cmds.push(element(
            t,
            &name,
            vec![Expression::Named(NamedExpression::Set(new))],
        ));
    }
}

/// `session_affinity = "client_ip"`, kube-proxy's way: a client found in
/// an eligible backend's set goes to it before any pick; a backend that is
/// not eligible has no such rule and its set is emptied, so its clients
/// pick again and do not come back when it returns.
fn fill_affinity(cmds: &mut Vec<NfObject<'static>>, id: &ListenerId, l: &KernelListener) {
    let t = Shard::of(id);
    let lchain = listener_chain(id);
    let saddr = payload(ip_proto(is_v4(id.0)), "saddr");
    for &b in &l.eligible {
        cmds.push(rule(
            t,
            &lchain,
            vec![
                matches(saddr.clone(), Operator::EQ, set_ref(&affinity_set(id, b))),
                Statement::Goto(JumpTarget {
                    target: nft_string(backend_chain(id, b)),
                }),
            ],
        ));
    }
    for &b in l.members.iter().filter(|b| !l.eligible.contains(b)) {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(
            Box::new(tuple_set(t, &affinity_set(id, b), Vec::new())),
        ))));
    }
}

/// Adds (idempotent) and empties the listeners' own objects: counters,
/// chains, source-range sets.
pub(super) fn declare(cmds: &mut Vec<NfObject<'static>>, desired: &Desired, wanted: &TableObjects) {
    for o in &wanted.counters {
        cmds.push(add(NfListObject::Counter(counter(o.shard, &o.name))));
    }
    for o in &wanted.chains {
        cmds.push(add(NfListObject::Chain(chain(o.shard, &o.name))));
    }
    for (id, l) in desired {
        if l.source_ranges.is_some() {
            let mut set = tuple_set(Shard::of(id), &source_set(id), Vec::new());
            set.set_type = SetTypeValue::Single(addr_type(is_v4(id.0)));
            set.flags = Some([SetFlag::Interval].into_iter().collect());
            cmds.push(add(NfListObject::Set(Box::new(set))));
        }
    }
    for o in &wanted.chains {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(
            chain(o.shard, &o.name),
        ))));
    }
    for o in &wanted.sets {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(
            Box::new(tuple_set(o.shard, &o.name, Vec::new())),
        ))));
    }
}

//! The pure builder: desired state in, one nft transaction out.
//!
//! The transaction never deletes the table (that would cut every open
//! flow's NAT binding is kept by conntrack, but a deleted table also drops
//! its counters and, for a moment, its rules): it adds what may be missing
//! (`add` is idempotent), flushes every chain, map and set it owns, fills
//! them again, and deletes the objects of listeners and backends that are
//! gone. One `nft -j -f -` call is one atomic transaction: a packet sees the
//! old table or the new one, never half of each.

use ipnet::IpNet;

use super::names::{
    FAMILIES, Family, INPUT, OUTPUT, POSTROUTING, PREROUTING, Shard, affinity_set, backend_chain,
    backend_counter, bucket_map, denied_counter, family_of, listener_chain, no_backend_counter,
    source_set, table_of,
};
use super::{Desired, KernelListener, ListenerId};
use crate::config::{Protocol, SourceNat};
use std::borrow::Cow;
use std::collections::{BTreeMap, BTreeSet, HashSet};
use std::net::IpAddr;

use nftables::expr::{
    CT, Expression, JHash, Meta, MetaKey, NamedExpression, NgMode, Numgen, Payload, PayloadField,
    Prefix, SetItem, Verdict,
};
use nftables::schema::{
    Chain, Counter, Element, FlushObject, Map, NfCmd, NfListObject, NfObject, Nftables, Rule, Set,
    SetFlag, SetType, SetTypeValue, Table,
};
use nftables::stmt::{
    self, JumpTarget, Match, NAT, NATFamily, NATFlag, Operator, Reject, RejectType, Statement,
    VerdictMap,
};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook, RejectCode};

use crate::config::Algorithm;
use crate::dataplane::balancer::select;

/// `dstnat`: NAT before routing, as kube-proxy. Numeric, because nft 1.0.6
/// refuses the name `dstnat` on the output hook.
const PRIO_DSTNAT: i32 = -100;
/// `srcnat`.
const PRIO_SRCNAT: i32 = 100;
/// `filter`: the refusal of what was not forwarded.
const PRIO_FILTER: i32 = 0;

/// One named object in one of our tables (a chain, counter, set or map):
/// the table it is in, and its name there.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct TableObject {
    /// Its table.
    pub shard: Shard,
    /// Its name (unique over all our tables: it carries the listener's).
    pub name: String,
}

impl TableObject {
    fn of(id: &ListenerId, name: String) -> Self {
        Self {
            shard: Shard::of(id),
            name,
        }
    }
}

/// The objects of our tables, by kind: the tables themselves and every
/// named object in them. Built from the desired state ([`Self::of`]: what
/// the tables must hold) or read back from the kernel
/// ([`super::read_back()`]: what they hold); a sync deletes what the
/// second has and the first has not. Not [`crate::host::owned::Owned`] (a whole
/// object the daemon owns and fingerprints): this is an inventory by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TableObjects {
    /// The tables (shards) present; deleting one deletes all it holds.
    pub tables: BTreeSet<Shard>,
    /// Regular chains (`l_…`, `b_…`); base chains are not listed.
    pub chains: BTreeSet<TableObject>,
    /// Named counters.
    pub counters: BTreeSet<TableObject>,
    /// Per-listener source-range sets (`s_…`).
    pub sets: BTreeSet<TableObject>,
    /// `source_ip` listeners' bucket maps (`m_…`): filled element-wise,
    /// never flushed by a partial sync.
    pub maps: BTreeSet<TableObject>,
    /// Client-affinity sets (`a_…`): the kernel fills them; a sync
    /// empties only those of backends that left the choice.
    pub affinity: BTreeSet<TableObject>,
}

impl TableObjects {
    /// The objects `desired` gives the tables: the main table always (it
    /// stays, empty of listeners, until the clean stop), and the table of
    /// each listener.
    pub fn of(desired: &Desired) -> Self {
        let mut o = Self::default();
        o.tables.insert(Shard::MAIN);
        for (id, l) in desired {
            let obj = |name| TableObject::of(id, name);
            o.tables.insert(Shard::of(id));
            o.chains.insert(obj(listener_chain(id)));
            o.counters.insert(obj(no_backend_counter(id)));
            if l.source_ranges.is_some() {
                o.counters.insert(obj(denied_counter(id)));
                o.sets.insert(obj(source_set(id)));
            }
            if uses_buckets(l.pick) {
                o.maps.insert(obj(bucket_map(id)));
            }
            for &b in &l.members {
                o.counters.insert(obj(backend_counter(id, b)));
                if has_backend_chains(l) {
                    o.chains.insert(obj(backend_chain(id, b)));
                }
                if l.affinity.is_some() {
                    o.affinity.insert(obj(affinity_set(id, b)));
                }
            }
        }
        o
    }
}

/// A name or value as the `nftables` crate's schema holds text
/// (`Cow<'static, str>`), from anything that makes a `String`.
fn nft_string(x: impl Into<String>) -> Cow<'static, str> {
    Cow::Owned(x.into())
}

fn add(o: NfListObject<'static>) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Add(o))
}

fn chain(t: Shard, name: &str) -> Chain<'static> {
    Chain {
        family: NfFamily::INet,
        table: nft_string(t.table()),
        name: nft_string(name),
        ..Chain::default()
    }
}

fn base_chain(t: Shard, name: &str, kind: NfChainType, hook: NfHook, prio: i32) -> Chain<'static> {
    Chain {
        _type: Some(kind),
        hook: Some(hook),
        prio: Some(prio),
        policy: Some(NfChainPolicy::Accept),
        ..chain(t, name)
    }
}

fn rule(t: Shard, chain: &str, expr: Vec<Statement<'static>>) -> NfObject<'static> {
    add(NfListObject::Rule(Rule {
        family: NfFamily::INet,
        table: nft_string(t.table()),
        chain: nft_string(chain),
        expr: Cow::Owned(expr),
        ..Rule::default()
    }))
}

fn counter(t: Shard, name: &str) -> Counter<'static> {
    Counter {
        family: NfFamily::INet,
        table: nft_string(t.table()),
        name: nft_string(name),
        handle: None,
        packets: None,
        bytes: None,
    }
}

fn is_v4(ip: IpAddr) -> bool {
    ip.is_ipv4()
}

fn addr_type(v4: bool) -> SetType {
    if v4 {
        SetType::Ipv4Addr
    } else {
        SetType::Ipv6Addr
    }
}

fn ip_proto(v4: bool) -> &'static str {
    if v4 { "ip" } else { "ip6" }
}

fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: nft_string(protocol),
            field: nft_string(field),
        },
    )))
}

fn l4proto() -> Expression<'static> {
    Expression::Named(NamedExpression::Meta(Meta {
        key: MetaKey::L4proto,
    }))
}

fn ct(key: &str, original: bool) -> Expression<'static> {
    Expression::Named(NamedExpression::CT(CT {
        key: nft_string(key),
        family: None,
        dir: original.then_some(nftables::expr::CTDir::Original),
    }))
}

fn concat(items: Vec<Expression<'static>>) -> Expression<'static> {
    Expression::Named(NamedExpression::Concat(items))
}

fn matches(
    left: Expression<'static>,
    op: Operator,
    right: Expression<'static>,
) -> Statement<'static> {
    Statement::Match(Match { left, right, op })
}

fn set_ref(name: &str) -> Expression<'static> {
    Expression::String(nft_string(format!("@{name}")))
}

fn goto(target: String) -> Verdict<'static> {
    Verdict::Goto(JumpTarget {
        target: nft_string(target),
    })
}

fn proto_name(p: Protocol) -> Expression<'static> {
    Expression::String(nft_string(p.as_str()))
}

/// `ip daddr . meta l4proto . th dport` (or `ip6 daddr …`).
fn dispatch_key(v4: bool) -> Expression<'static> {
    concat(vec![
        payload(ip_proto(v4), "daddr"),
        l4proto(),
        payload("th", "dport"),
    ])
}

fn listener_key((vip, protocol, port): &ListenerId) -> Expression<'static> {
    concat(vec![
        Expression::String(nft_string(vip.to_string())),
        proto_name(*protocol),
        Expression::Number(u32::from(*port)),
    ])
}

fn element(t: Shard, name: &str, elem: Vec<Expression<'static>>) -> NfObject<'static> {
    add(NfListObject::Element(Element {
        family: NfFamily::INet,
        table: nft_string(t.table()),
        name: nft_string(name),
        elem: Cow::Owned(elem),
    }))
}

fn tuple_set(t: Shard, name: &str, types: Vec<SetType>) -> Set<'static> {
    Set {
        family: NfFamily::INet,
        table: nft_string(t.table()),
        name: nft_string(name),
        handle: None,
        set_type: SetTypeValue::Concatenated(Cow::Owned(types)),
        policy: None,
        flags: None,
        elem: None,
        timeout: None,
        gc_interval: None,
        size: None,
        comment: None,
    }
}

/// An empty map of ours, to name in a flush or a delete.
fn map(t: Shard, name: &str) -> Box<Map<'static>> {
    Box::new(Map {
        family: NfFamily::INet,
        table: nft_string(t.table()),
        name: nft_string(name),
        ..Map::default()
    })
}

/// Deletes the objects of `present` that `wanted` has not (nothing may
/// refer to them any more), then the tables `wanted` has not, with all
/// they hold: their objects are not deleted one by one.
fn delete_gone(cmds: &mut Vec<NfObject<'static>>, present: &TableObjects, wanted: &TableObjects) {
    let gone = |have: &BTreeSet<TableObject>, want: &BTreeSet<TableObject>| -> Vec<TableObject> {
        have.difference(want)
            .filter(|o| wanted.tables.contains(&o.shard))
            .cloned()
            .collect()
    };
    let maps = gone(&present.maps, &wanted.maps);
    // A bucket map's elements hold its backend chains (EBUSY otherwise):
    // emptied first, deleted once no rule refers to it.
    for o in &maps {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Map(map(
            o.shard, &o.name,
        )))));
    }
    // Listener chains before backend chains: a listener chain's rules
    // refer to its backend chains until it is deleted itself.
    let (listeners, backends): (Vec<TableObject>, Vec<TableObject>) =
        gone(&present.chains, &wanted.chains)
            .into_iter()
            .partition(|o| o.name.starts_with("l_"));
    for o in listeners.into_iter().chain(backends) {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Chain(
            chain(o.shard, &o.name),
        ))));
    }
    for o in &maps {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Map(map(
            o.shard, &o.name,
        )))));
    }
    let sets = gone(&present.sets, &wanted.sets);
    for o in sets
        .iter()
        .chain(&gone(&present.affinity, &wanted.affinity))
    {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Set(
            Box::new(tuple_set(o.shard, &o.name, Vec::new())),
        ))));
    }
    for o in gone(&present.counters, &wanted.counters) {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Counter(
            counter(o.shard, &o.name),
        ))));
    }
    for &t in present.tables.difference(&wanted.tables) {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Table(
            table(t),
        ))));
    }
}

fn table(t: Shard) -> Table<'static> {
    Table {
        family: NfFamily::INet,
        name: nft_string(t.table()),
        handle: None,
    }
}

/// A listener's rules and elements, into its declared objects. `before`:
/// the listener as the kernel holds it (its bucket map is then edited
/// element-wise); `None`: unknown, so its bucket map is filled afresh.
fn fill_listener(
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
/// chain's rules (see [`super::netlink`]).
pub(super) fn has_backend_chains(l: &KernelListener) -> bool {
    uses_buckets(l.pick) || l.affinity.is_some()
}

/// Whether `pick` chooses through a bucket map: `source_ip` and
/// `flow_hash`, whose buckets are filled alike (by [`buckets`]) and differ
/// only in what the kernel hashes to find one ([`bucket_hash_input`]).
fn uses_buckets(pick: Algorithm) -> bool {
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
/// [`terminated_here`], which keeps it from the DNAT, and answers it with a
/// reset.
pub(super) fn picks_up(id: &ListenerId, l: &KernelListener) -> bool {
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

/// What nft 1.0.6's JSON cannot declare, as an nft script (text) to run
/// before the transaction: the bucket maps `desired` needs and `present`
/// lacks (a map keyed by a hash needs `typeof`, which is text only, and
/// `type integer` is refused), and the affinity sets of the listeners that
/// differ from `applied` (all of them without it), whose `dynamic` flag
/// JSON cannot name (a JSON `add` of such a set that exists fails with
/// EEXIST); a text `add` of an existing set only updates its timeout.
/// Once declared, the JSON transaction fills, edits and deletes them.
/// Everything here is `add` (idempotent), and an empty map or set changes
/// no packet's path.
pub fn prelude(
    desired: &Desired,
    applied: Option<&Desired>,
    present: &TableObjects,
) -> Option<String> {
    let mut tables = BTreeSet::new();
    let mut script: Vec<String> = TableObjects::of(desired)
        .maps
        .difference(&present.maps)
        .map(|m| {
            let table = m.shard.table();
            tables.insert(m.shard);
            format!(
                "add map inet {table} {} {{ typeof numgen inc mod {BUCKETS} : verdict ; }}\n",
                m.name
            )
        })
        .collect();
    for (id, l) in desired {
        let Some(timeout) = l.affinity else { continue };
        if applied.is_some_and(|a| a.get(id) == Some(l)) {
            continue;
        }
        let family = if is_v4(id.0) {
            "ipv4_addr"
        } else {
            "ipv6_addr"
        };
        let table = table_of(id);
        tables.insert(Shard::of(id));
        for &b in &l.members {
            script.push(format!(
                "add set inet {table} {} {{ type {family} ; flags dynamic,timeout ; timeout {}s ; }}\n",
                affinity_set(id, b),
                timeout.as_secs().max(1)
            ));
        }
    }
    // Declaring a shard's table here makes no hook: its base chains come
    // with the transaction.
    (!script.is_empty()).then(|| {
        let declared: String = tables
            .iter()
            .map(|t| format!("add table inet {}\n", t.table()))
            .collect();
        declared + &script.concat()
    })
}

/// The one transaction that takes the table from `applied` (what this
/// process last wrote, known to be in the kernel) to `desired`, touching
/// only the listeners that differ: kube-proxy's partial sync. A health
/// flip at 10,000 listeners rewrites one listener's chains, not all.
#[cfg(test)]
pub fn partial_transaction(desired: &Desired, applied: &Desired) -> serde_json::Value {
    verdict_maps(
        serde_json::to_value(partial_commands(desired, applied))
            .expect("nft's schema types always serialize"),
    )
}

/// [`partial_transaction`], encoded for `nft -j -f -`.
pub(super) fn partial_transaction_json(desired: &Desired, applied: &Desired) -> Vec<u8> {
    encode(&partial_commands(desired, applied))
}

/// [`transaction`], encoded for `nft -j -f -`.
pub(super) fn transaction_json(desired: &Desired, present: &TableObjects) -> Vec<u8> {
    encode(&commands(desired, present))
}

/// The document's bytes, object by object: only the dispatch maps' `add`
/// goes through a JSON tree (to give them their `verdict` type), which at
/// 10,000 listeners saves most of the building time (1.6 s when the whole
/// document was a tree).
fn encode(doc: &Nftables<'static>) -> Vec<u8> {
    let mut out = b"{\"nftables\":[".to_vec();
    for (i, o) in doc.objects.iter().enumerate() {
        if i > 0 {
            out.push(b',');
        }
        let written = if matches!(o, NfObject::CmdObject(NfCmd::Add(NfListObject::Map(_)))) {
            let wrapped = serde_json::json!({ "nftables": [o] });
            serde_json::to_writer(&mut out, &verdict_maps(wrapped)["nftables"][0])
        } else {
            serde_json::to_writer(&mut out, o)
        };
        written.expect("nft's schema types always serialize");
    }
    out.extend_from_slice(b"]}");
    out
}

fn partial_commands(desired: &Desired, applied: &Desired) -> Nftables<'static> {
    let mut cmds: Vec<NfObject<'static>> = Vec::new();
    let delete_element = |t: Shard, name: &str, elem: Expression<'static>| {
        NfObject::CmdObject(NfCmd::Delete(NfListObject::Element(Element {
            family: NfFamily::INet,
            table: nft_string(t.table()),
            name: nft_string(name),
            elem: Cow::Owned(vec![elem]),
        })))
    };
    let (before, after) = (TableObjects::of(applied), TableObjects::of(desired));
    // The tables that hold a listener for the first time.
    for &t in after.tables.difference(&before.tables) {
        skeleton(&mut cmds, t);
    }
    // The source NAT rules, rewritten when the kinds in use change (the
    // main table is always in `before`: a partial sync starts from a
    // written state).
    let nats = source_nats_in_use(desired);
    if !before.tables.contains(&Shard::MAIN) || source_nats_in_use(applied) != nats {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(
            chain(Shard::MAIN, POSTROUTING),
        ))));
        source_nat_rules(&mut cmds, &nats);
    }
    // The elements of listeners that go or change (re-added below): their
    // own, keyed by the listener. The shared masquerade elements are
    // counted by their users instead ([`nat_difference`]).
    let mut touched = BTreeSet::new();
    for (id, old) in applied {
        if desired.get(id) == Some(old) {
            continue;
        }
        touched.insert(id.0);
        let f = family_of(id.0);
        cmds.push(delete_element(Shard::of(id), f.dispatch, listener_key(id)));
        cmds.push(delete_element(Shard::MAIN, f.refuse, listener_key(id)));
        if picks_up(id, old) {
            cmds.push(delete_element(Shard::of(id), f.pickup, listener_key(id)));
        }
    }
    let mut changed = Desired::new();
    for (id, l) in desired {
        if applied.get(id) != Some(l) {
            touched.insert(id.0);
            changed.insert(*id, l.clone());
        }
    }
    let mut added = Vec::new();
    for kind in SOURCE_NATS {
        let (gone, new) = nat_difference(applied, desired, &touched, kind);
        for keys in nat_commands(gone, kind) {
            cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Element(
                keys,
            ))));
        }
        added.extend(nat_commands(new, kind));
    }
    let declared = TableObjects::of(&changed);
    declare(&mut cmds, &changed, &declared);
    for (id, l) in &changed {
        fill_listener(&mut cmds, id, l, applied.get(id));
    }
    cmds.extend(added.into_iter().map(|e| add(NfListObject::Element(e))));
    delete_gone(&mut cmds, &before, &after);
    Nftables {
        objects: Cow::Owned(cmds),
    }
}

/// A masquerade element: VIP, backend, protocol, nodeport. After the DNAT
/// the kernel sees no more than these, so every `source_nat =
/// "masquerade"` listener of a VIP that reaches one nodeport (80 → 30080
/// and 8080 → 30080) shares the element of each backend.
pub(super) type MasqKey = (IpAddr, IpAddr, Protocol, u16);

/// The source NATs written in the main table's `postrouting`, each with a
/// set of its own (`masq4`, `snat4`…) keyed alike: `source_nat = "none"`
/// writes nothing.
const SOURCE_NATS: [SourceNat; 2] = [SourceNat::Masquerade, SourceNat::Vip];

/// The elements of source NAT `kind` (masquerade, SNAT to the VIP)
/// `listeners` want, each with the number of its users. An element stays in the kernel while it has one: a listener that
/// goes deletes it only when it was the last user, and a transaction never
/// deletes it twice (nft answers the second delete with ENOENT and refuses
/// the whole transaction).
pub(super) fn nat_users<'a>(
    listeners: impl IntoIterator<Item = (&'a ListenerId, &'a KernelListener)>,
    kind: SourceNat,
) -> BTreeMap<MasqKey, usize> {
    let mut users = BTreeMap::new();
    for (id, l) in listeners {
        if l.source_nat != kind {
            continue;
        }
        // Every member, eligible or not: only new flows are masqueraded
        // and only eligible members get new flows, so a health flip
        // changes no element here.
        for &b in &l.members {
            *users.entry((id.0, b, id.1, l.backend_port)).or_insert(0) += 1;
        }
    }
    users
}

/// The listeners of `state` on `vip`: a range of the map, which is sorted
/// by VIP first (`Protocol::Tcp` is the least protocol, 0 the least port).
fn on_vip(state: &Desired, vip: IpAddr) -> impl Iterator<Item = (&ListenerId, &KernelListener)> {
    state
        .range((vip, Protocol::Tcp, 0)..)
        .take_while(move |(id, _)| id.0 == vip)
}

/// The elements of source NAT `kind` to delete (no user left) and to add
/// (no user before) between `applied` and `desired`, looking only at the VIPs in
/// `vips` (those of the listeners that differ: no other VIP's users
/// change). Each element once.
pub(super) fn nat_difference(
    applied: &Desired,
    desired: &Desired,
    vips: &BTreeSet<IpAddr>,
    kind: SourceNat,
) -> (BTreeSet<MasqKey>, BTreeSet<MasqKey>) {
    let (mut gone, mut new) = (BTreeSet::new(), BTreeSet::new());
    for &vip in vips {
        let before = nat_users(on_vip(applied, vip), kind);
        let after = nat_users(on_vip(desired, vip), kind);
        gone.extend(before.keys().filter(|k| !after.contains_key(k)));
        new.extend(after.keys().filter(|k| !before.contains_key(k)));
    }
    (gone, new)
}

/// `keys` as one element list per set of the source NAT `kind` (`masq4`,
/// `masq6`; `snat4`, `snat6`), for an `add` or a `delete`; none for a
/// family without keys.
fn nat_commands(keys: BTreeSet<MasqKey>, kind: SourceNat) -> Vec<Element<'static>> {
    FAMILIES
        .iter()
        .filter_map(|f| {
            let elem: Vec<Expression<'static>> = keys
                .iter()
                .filter(|k| k.0.is_ipv4() == f.v4)
                .map(|&(vip, backend, protocol, port)| {
                    concat(vec![
                        Expression::String(nft_string(vip.to_string())),
                        Expression::String(nft_string(backend.to_string())),
                        proto_name(protocol),
                        Expression::Number(u32::from(port)),
                    ])
                })
                .collect();
            (!elem.is_empty()).then(|| Element {
                family: NfFamily::INet,
                table: nft_string(Shard::MAIN.table()),
                name: nft_string(if kind == SourceNat::Vip {
                    f.snat
                } else {
                    f.masq
                }),
                elem: Cow::Owned(elem),
            })
        })
        .collect()
}

/// Adds (idempotent) and empties the listeners' own objects: counters,
/// chains, source-range sets.
fn declare(cmds: &mut Vec<NfObject<'static>>, desired: &Desired, wanted: &TableObjects) {
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

/// The one transaction that makes the table `desired`, deleting whatever
/// of `present` (what the kernel holds, read back or last written) is no
/// longer wanted: nft's JSON document, ready for `nft -j -f -`.
pub fn transaction(desired: &Desired, present: &TableObjects) -> serde_json::Value {
    let doc = serde_json::to_value(commands(desired, present))
        .expect("nft's schema types always serialize");
    verdict_maps(doc)
}

/// Gives the dispatch maps their `verdict` data type, which the crate's
/// `SetType` cannot express (it is written as `mark` until here).
fn verdict_maps(mut doc: serde_json::Value) -> serde_json::Value {
    if let Some(objects) = doc.get_mut("nftables").and_then(|o| o.as_array_mut()) {
        for o in objects {
            if let Some(map) = o.pointer_mut("/add/map")
                && map.get("map").is_some()
            {
                map["map"] = serde_json::Value::String("verdict".into());
            }
        }
    }
    doc
}

fn commands(desired: &Desired, present: &TableObjects) -> Nftables<'static> {
    let mut cmds: Vec<NfObject<'static>> = Vec::new();
    let wanted = TableObjects::of(desired);
    // 1. The tables' own parts, emptied and filled again; then every
    // listener's objects, declared (idempotent) and emptied.
    for &t in &wanted.tables {
        skeleton(&mut cmds, t);
    }
    source_nat_rules(&mut cmds, &source_nats_in_use(desired));
    declare(&mut cmds, desired, &wanted);
    // 2. Filled again; the shared masquerade elements each once.
    for (id, l) in desired {
        fill_listener(&mut cmds, id, l, None);
    }
    for kind in SOURCE_NATS {
        let keys = nat_users(desired, kind).into_keys().collect();
        cmds.extend(
            nat_commands(keys, kind)
                .into_iter()
                .map(|e| add(NfListObject::Element(e))),
        );
    }
    // 3. What is gone: after the flushes above, nothing refers to it.
    delete_gone(&mut cmds, present, &wanted);
    Nftables {
        objects: Cow::Owned(cmds),
    }
}

/// `tcp flags & syn == 0 socket transparent 0 return`: a TCP packet that
/// is not a SYN and belongs to a socket of this host is never handed to a
/// backend.
///
/// Why: the NAT chains see a packet only when conntrack takes it for a new
/// flow. A connection the proxy accepted while nothing in this network
/// namespace used conntrack (no NAT table yet: a host with only proxy
/// listeners) was never tracked; when a reload then writes the first
/// kernel listener (conntrack starts with the first NAT table), that
/// connection's next segment is picked up mid-stream as a new flow and,
/// without this rule, DNATed to a backend that knows nothing of it: the
/// client gets a reset (found by
/// `a_reload_switches_between_proxy_and_kernel_under_load_without_a_failure`).
/// The same segment is also a new flow to the main table's `input` chain,
/// which refuses new flows to kernel listeners that were not DNATed: the
/// rule stands there too, before the refusal. A SYN never matches, and the
/// socket lookup runs only for the rare mid-stream pickup, so a new flow's
/// path is unchanged. The rule stands in every table's `prerouting`: a
/// `return` ends only its own table's chain.
///
/// In `prerouting` (`pickup`: the family's set) the rule leaves out the
/// `flow_hash` and `source_ip` TCP listeners ([`picks_up`]): the socket lookup also finds
/// the listener's own userspace socket, bound as the fallback, so without
/// this a flow picked up mid-stream from another host would never reach
/// its DNAT. A connection the proxy accepted for such a listener before
/// this host's first NAT table is then DNATed when it is picked up (and
/// reset by the backend): a listener that moves to the kernel from the
/// proxy with `flow_hash` or `source_ip` loses those connections, as it
/// would lose them to any move between hosts.
fn terminated_here(pickup: Option<&Family>) -> Vec<Statement<'static>> {
    let mut rule = vec![matches(
        Expression::BinaryOperation(Box::new(nftables::expr::BinaryOperation::AND(
            payload("tcp", "flags"),
            Expression::String(nft_string("syn")),
        ))),
        Operator::EQ,
        Expression::Number(0),
    )];
    if let Some(f) = pickup {
        rule.push(matches(
            dispatch_key(f.v4),
            Operator::NEQ,
            set_ref(f.pickup),
        ));
    }
    rule.extend([
        matches(
            Expression::Named(NamedExpression::Socket(nftables::expr::Socket {
                key: Cow::Borrowed(&nftables::expr::SocketAttr::Transparent),
            })),
            Operator::EQ,
            Expression::Number(0),
        ),
        Statement::Return(None),
    ]);
    rule
}

/// `fib daddr type local`: the `prerouting` dispatch acts only on packets
/// addressed to an address this host holds now.
///
/// Why: with `br_netfilter` on (`bridge-nf-call-iptables=1`, as on every
/// Kubernetes host), an IPv4 or IPv6 frame entering a port of a Linux
/// bridge passes the inet `prerouting` hooks at the bridge stage
/// (`br_nf_pre_routing` in `net/bridge/br_netfilter_hooks.c`), whatever
/// its Ethernet destination, with the bridge as input device and its
/// packet type made `host` for the hooks' sake. A host that merely
/// bridges a VM's frame to the VIP's holder (a VM on its own bridge, the
/// VIP held by another host) would otherwise DNAT it itself: it would
/// serve the flow in the holder's stead (its own source NAT, its own
/// conntrack), out of reach of the holder's gate, sync and drain. The
/// holder has the VIP as a local address (keepalived's on the network's
/// interface, the announce mode's `local` route, a lease on its macvlan);
/// a host that lost it stops taking new flows at once (open ones keep
/// their conntrack binding, which this chain never sees again). Not in
/// `output`: a connection this host opens to a VIP is its own.
fn addressed_here() -> Statement<'static> {
    matches(
        Expression::Named(NamedExpression::Fib(nftables::expr::Fib {
            result: nftables::expr::FibResult::Type,
            flags: [nftables::expr::FibFlag::Daddr].into_iter().collect(),
        })),
        Operator::EQ,
        Expression::String(nft_string("local")),
    )
}

/// `ct state != new return`: the main table's `input` chain refuses only
/// new flows, so a packet of an open flow (or an untracked one) leaves it
/// here, after one conntrack read, rather than passing the socket check
/// and the refusal rules of both families (about twenty expressions per
/// packet before). The `input` hook sees every packet addressed to this
/// host; a flow the kernel forwards never crosses it.
fn not_new_returns() -> Vec<Statement<'static>> {
    vec![
        matches(
            ct("state", false),
            Operator::NEQ,
            Expression::String(nft_string("new")),
        ),
        Statement::Return(None),
    ]
}

/// A table's own parts, added (idempotent), emptied and filled: in every
/// shard the dispatch maps and the NAT base chains that look them up; in
/// the main table also the refusal and the masquerade, shared by every
/// listener (so a packet is refused or masqueraded by one rule, whatever
/// the number of tables).
fn skeleton(cmds: &mut Vec<NfObject<'static>>, t: Shard) {
    cmds.push(add(NfListObject::Table(table(t))));
    let mut bases = vec![
        base_chain(
            t,
            PREROUTING,
            NfChainType::NAT,
            NfHook::Prerouting,
            PRIO_DSTNAT,
        ),
        base_chain(t, OUTPUT, NfChainType::NAT, NfHook::Output, PRIO_DSTNAT),
    ];
    if t == Shard::MAIN {
        bases.push(base_chain(
            t,
            POSTROUTING,
            NfChainType::NAT,
            NfHook::Postrouting,
            PRIO_SRCNAT,
        ));
        bases.push(base_chain(
            t,
            INPUT,
            NfChainType::Filter,
            NfHook::Input,
            PRIO_FILTER,
        ));
    }
    for f in &FAMILIES {
        let addr = addr_type(f.v4);
        let tuple = vec![addr, SetType::InetProto, SetType::InetService];
        cmds.push(add(NfListObject::Map(Box::new(Map {
            set_type: SetTypeValue::Concatenated(Cow::Owned(tuple.clone())),
            // Replaced by `verdict` in [`transaction`]: the crate's
            // `SetType` has no verdict type.
            map: SetTypeValue::Single(SetType::Mark),
            ..*map(t, f.dispatch)
        }))));
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Map(map(
            t, f.dispatch,
        )))));
        cmds.push(add(NfListObject::Set(Box::new(tuple_set(
            t,
            f.pickup,
            tuple.clone(),
        )))));
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(
            Box::new(tuple_set(t, f.pickup, Vec::new())),
        ))));
        if t == Shard::MAIN {
            let masq = vec![addr, addr, SetType::InetProto, SetType::InetService];
            for (name, types) in [(f.refuse, tuple), (f.masq, masq.clone()), (f.snat, masq)] {
                cmds.push(add(NfListObject::Set(Box::new(tuple_set(t, name, types)))));
                cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(
                    Box::new(tuple_set(t, name, Vec::new())),
                ))));
            }
        }
    }
    for c in &bases {
        cmds.push(add(NfListObject::Chain(c.clone())));
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(
            c.clone(),
        ))));
    }
    for f in &FAMILIES {
        cmds.push(rule(t, PREROUTING, terminated_here(Some(f))));
    }
    if t == Shard::MAIN {
        // The input chain sees every packet to this host, the proxy's and
        // every other service's: what is not a new flow leaves at its
        // first rule, before the socket check and the refusals.
        cmds.push(rule(t, INPUT, not_new_returns()));
        // Before the refusal of new flows to kernel listeners: the same
        // picked-up segment must reach its socket, not draw a reset.
        cmds.push(rule(t, INPUT, terminated_here(None)));
    }
    for f in &FAMILIES {
        let vmap = Statement::VerdictMap(VerdictMap {
            key: dispatch_key(f.v4),
            data: set_ref(f.dispatch),
        });
        cmds.push(rule(t, PREROUTING, vec![addressed_here(), vmap.clone()]));
        cmds.push(rule(t, OUTPUT, vec![vmap]));
        if t == Shard::MAIN {
            shared_rules(cmds, f);
        }
    }
}

/// The main table's rules of one address family: the refusal of a new
/// flow to a kernel listener that no listener chain DNATed. (Its source
/// NAT rules are [`source_nat_rules`]'.)
fn shared_rules(cmds: &mut Vec<NfObject<'static>>, f: &Family) {
    let t = Shard::MAIN;
    let refused = || {
        vec![
            matches(
                ct("state", false),
                Operator::IN,
                Expression::String(nft_string("new")),
            ),
            matches(dispatch_key(f.v4), Operator::EQ, set_ref(f.refuse)),
        ]
    };
    let mut tcp = refused();
    tcp.push(matches(
        l4proto(),
        Operator::EQ,
        Expression::String(nft_string("tcp")),
    ));
    tcp.push(Statement::Reject(Some(Reject::new(
        Some(RejectType::TCPReset),
        None,
    ))));
    cmds.push(rule(t, INPUT, tcp));
    let mut other = refused();
    other.push(Statement::Reject(Some(Reject::new(
        Some(RejectType::ICMPX),
        Some(RejectCode::PortUnreach),
    ))));
    cmds.push(rule(t, INPUT, other));
}

/// The source NATs `desired` uses, by address family (`true`: IPv4):
/// which rules the main table's `postrouting` holds.
pub(super) fn source_nats_in_use(desired: &Desired) -> HashSet<(bool, SourceNat)> {
    desired
        .iter()
        .filter(|(_, l)| SOURCE_NATS.contains(&l.source_nat))
        .map(|(id, l)| (is_v4(id.0), l.source_nat))
        .collect()
}

/// The main table's `postrouting` rules: per address family, the
/// masquerade of what was DNATed to a member of a `source_nat =
/// "masquerade"` listener and the SNAT to the VIP of a `source_nat =
/// "vip"` one, each written only while a listener of that family uses it
/// ([`source_nats_in_use`]).
///
/// Why not always all four: the chain sees the first packet of every new
/// flow this host forwards or sends, ours and every other's, and each
/// rule is a conntrack read and a lookup of a four-part key (the sets are
/// looked up even when empty). Measured on the forward path (`perf`,
/// 6.18): the four rules cost a new flow ~450 ns of nf_tables time, more
/// than the kernel's one-rule DNAT itself (~400 ns); with `source_nat =
/// "none"` listeners only there is nothing to look up, and the usual
/// IPv4 `masquerade` host looks up one set, not four.
fn source_nat_rules(cmds: &mut Vec<NfObject<'static>>, in_use: &HashSet<(bool, SourceNat)>) {
    let t = Shard::MAIN;
    for f in &FAMILIES {
        let dnated_in = |set: &str| {
            vec![
                matches(
                    ct("status", false),
                    Operator::IN,
                    Expression::String(nft_string("dnat")),
                ),
                matches(
                    concat(vec![
                        ct(&format!("{} daddr", ip_proto(f.v4)), true),
                        payload(ip_proto(f.v4), "daddr"),
                        l4proto(),
                        payload("th", "dport"),
                    ]),
                    Operator::EQ,
                    set_ref(set),
                ),
            ]
        };
        if in_use.contains(&(f.v4, SourceNat::Masquerade)) {
            let mut masq = dnated_in(f.masq);
            masq.push(Statement::Masquerade(Some(NAT {
                addr: None,
                family: None,
                port: None,
                flags: Some([NATFlag::FullyRandom].into_iter().collect()),
            })));
            cmds.push(rule(t, POSTROUTING, masq));
        }
        // `source_nat = "vip"`: to the VIP the client connected to,
        // keeping the client's port where the tuple allows (no
        // `fully-random`), so that every host writes the same source for
        // one flow.
        if in_use.contains(&(f.v4, SourceNat::Vip)) {
            let mut snat = dnated_in(f.snat);
            snat.push(Statement::SNAT(Some(NAT {
                addr: Some(ct(&format!("{} daddr", ip_proto(f.v4)), true)),
                family: Some(if f.v4 { NATFamily::IP } else { NATFamily::IP6 }),
                port: None,
                flags: None,
            })));
            cmds.push(rule(t, POSTROUTING, snat));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::names::{SHARDS, TABLE, listener_tag};
    use super::super::test_listener as listener;
    use super::*;

    fn id(vip: &str, port: u16) -> ListenerId {
        (vip.parse().unwrap(), Protocol::Tcp, port)
    }

    fn text(doc: &serde_json::Value) -> String {
        serde_json::to_string(doc).unwrap()
    }

    #[test]
    fn round_robin_over_the_eligible_backends_only() {
        let mut d = Desired::new();
        let l = id("192.0.2.10", 80);
        d.insert(
            l,
            listener(
                &["10.0.0.1", "10.0.0.3"],
                &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
            ),
        );
        let t = text(&transaction(&d, &TableObjects::default()));
        // Rule 0 takes every second connection, rule 1 the rest: no set.
        assert!(
            t.contains(r#"{"match":{"left":{"numgen":{"mod":2,"mode":"inc"}},"op":"==","right":0}},{"counter":"n_tcp_80_192.0.2.10_10.0.0.1"}"#),
            "{t}"
        );
        assert!(t.contains(r#""expr":[{"counter":"n_tcp_80_192.0.2.10_10.0.0.3"},"#));
        assert!(t.contains(r#"{"dnat":{"addr":"10.0.0.3","family":"ip","port":30080}}"#));
        assert!(!t.contains(r#"{"dnat":{"addr":"10.0.0.2""#));
        assert!(!t.contains("goto\":{\"target\":\"b_"), "no backend chains");
        // Every member keeps its counter, eligible or not.
        assert!(t.contains(r#""name":"n_tcp_80_192.0.2.10_10.0.0.2""#));
        // Masquerade towards every member: a flip changes no element.
        assert!(t.contains(r#"{"concat":["192.0.2.10","10.0.0.1","tcp",30080]}"#));
        assert!(t.contains(r#"{"concat":["192.0.2.10","10.0.0.2","tcp",30080]}"#));
        assert!(t.contains(r#""map":"verdict""#));
        assert!(!t.contains(r#""delete""#));
    }

    #[test]
    fn the_encoded_documents_are_the_json_trees() {
        let mut before = Desired::new();
        before.insert(
            id("192.0.2.10", 80),
            listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]),
        );
        let mut after = before.clone();
        after.insert(id("2001:db8::10", 53), listener(&[], &["2001:db8::1"]));
        let present = TableObjects::of(&before);
        let bytes = transaction_json(&after, &present);
        let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(parsed, transaction(&after, &present));
        assert!(text(&parsed).contains(r#""map":"verdict""#));
        let bytes = partial_transaction_json(&after, &before);
        let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(parsed, partial_transaction(&after, &before));
    }

    /// The rules of chain `name` of the main table, in the order written.
    fn rules_of(doc: &serde_json::Value, name: &str) -> Vec<String> {
        doc["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|o| o.pointer("/add/rule"))
            .filter(|r| r["chain"] == name && r["table"] == TABLE)
            .map(|r| text(&r["expr"]))
            .collect()
    }

    #[test]
    fn an_open_flow_leaves_the_input_chain_at_its_first_rule() {
        let mut d = Desired::new();
        d.insert(id("192.0.2.10", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
        let input = rules_of(&transaction(&d, &TableObjects::default()), "input");
        assert_eq!(
            input[0],
            r#"[{"match":{"left":{"ct":{"key":"state"}},"op":"!=","right":"new"}},{"return":null}]"#,
            "{input:#?}"
        );
        // Then the socket check, then the refusals.
        assert!(
            input[1].contains(r#"{"socket":{"key":"transparent"}}"#),
            "{input:#?}"
        );
        assert!(
            input[2..].iter().all(|r| r.contains("reject")),
            "{input:#?}"
        );
        // The NAT chains see a flow's first packet only: no such gate there.
        let pre = rules_of(&transaction(&d, &TableObjects::default()), "prerouting");
        assert!(pre[0].contains("socket"), "{pre:#?}");
    }

    #[test]
    fn no_eligible_backend_counts_and_returns_to_the_refusal() {
        let mut d = Desired::new();
        let l = id("2001:db8::10", 53);
        d.insert(l, listener(&[], &["2001:db8::1"]));
        let t = text(&transaction(&d, &TableObjects::default()));
        assert!(
            t.contains(r#"{"counter":"z_tcp_53_2001-db8--10"},{"return":null}"#),
            "{t}"
        );
        assert!(!t.contains("numgen"));
        assert!(t.contains(
            r#"{"elem":[{"concat":["2001:db8::10","tcp",53]}],"family":"inet","name":"refuse6""#
        ));
        assert!(t.contains(r#"{"reject":{"type":"tcp reset"}}"#));
    }

    #[test]
    fn source_ranges_are_a_set_of_the_vips_family_merged() {
        let mut d = Desired::new();
        let l = id("192.0.2.10", 80);
        let mut kl = listener(&["10.0.0.1"], &["10.0.0.1"]);
        kl.source_ranges = Some(vec![
            "10.1.0.0/16".parse().unwrap(),
            "10.1.2.0/24".parse().unwrap(),
            "2001:db8::/32".parse().unwrap(),
        ]);
        kl.source_nat = SourceNat::None;
        d.insert(l, kl);
        let t = text(&transaction(&d, &TableObjects::default()));
        assert!(t.contains(r#"{"elem":[{"prefix":{"addr":"10.1.0.0","len":16}}],"family":"inet","name":"s_tcp_80_192.0.2.10""#), "{t}");
        assert!(t.contains(r#"{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"!=","right":"@s_tcp_80_192.0.2.10"}},{"counter":"d_tcp_80_192.0.2.10"},{"return":null}"#));
        assert!(
            !t.contains(r#""name":"masq4","table":"harvester_lb_nat"}}},{"add":{"element""#),
            "source_nat = none: no masquerade"
        );
    }

    /// A port of VIP 192.0.2.10 whose listener is (or is not) in the
    /// same table as port 80's.
    fn port_in(same: bool) -> u16 {
        let home = Shard::of(&id("192.0.2.10", 80));
        (81..2000)
            .find(|&p| (Shard::of(&id("192.0.2.10", p)) == home) == same)
            .unwrap()
    }

    fn deletes(doc: &serde_json::Value) -> Vec<String> {
        // Objects, not elements (a partial sync deletes a changed
        // listener's elements first).
        let cmds = doc["nftables"].as_array().unwrap();
        let object =
            |c: &serde_json::Value| c.get("delete").is_some_and(|d| d.get("element").is_none());
        let first_delete = cmds.iter().position(object);
        let last_flush = cmds.iter().rposition(|c| c.get("flush").is_some());
        assert!(last_flush < first_delete, "deletes after the flushes");
        cmds.iter()
            .filter(|c| object(c))
            .map(|c| c["delete"].to_string())
            .collect()
    }

    #[test]
    fn what_is_gone_is_deleted_after_the_flushes() {
        let mut before = Desired::new();
        before.insert(
            id("192.0.2.10", 80),
            listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]),
        );
        let neighbour = id("192.0.2.10", port_in(true));
        before.insert(neighbour, listener(&["10.0.0.1"], &["10.0.0.1"]));
        let present = TableObjects::of(&before);
        let mut after = Desired::new();
        after.insert(id("192.0.2.10", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
        let deleted = deletes(&transaction(&after, &present));
        // The second listener's chain and two counters; the first
        // listener's second backend's counter; no table (port 80's stays).
        assert_eq!(deleted.len(), 4, "{deleted:?}");
        let tag = listener_tag(&neighbour);
        assert!(deleted.iter().any(|d| d.contains(&format!("l_{tag}"))));
        assert!(
            deleted
                .iter()
                .any(|d| d.contains("n_tcp_80_192.0.2.10_10.0.0.2"))
        );
        assert!(!deleted.iter().any(|d| d.contains(r#"{"table""#)));
        assert_eq!(deleted, deletes(&partial_transaction(&after, &before)));
    }

    /// Every element `op` (`add`, `delete`) of `doc` names, one entry per
    /// element: `(set, element)`.
    fn element_ops(doc: &serde_json::Value, op: &str) -> Vec<(String, String)> {
        doc["nftables"]
            .as_array()
            .unwrap()
            .iter()
            .filter_map(|c| c.get(op)?.get("element"))
            .flat_map(|e| {
                let set = e["name"].as_str().unwrap().to_string();
                e["elem"]
                    .as_array()
                    .unwrap()
                    .iter()
                    .map(move |x| (set.clone(), x.to_string()))
            })
            .collect()
    }

    /// The masquerade elements of `d`, as the transaction writes them.
    fn masq_of(d: &Desired) -> BTreeSet<(String, String)> {
        element_ops(&transaction(d, &TableObjects::default()), "add")
            .into_iter()
            .filter(|(set, _)| set.starts_with("masq"))
            .collect()
    }

    /// What every partial transaction from `before` to `after` must keep:
    /// no element deleted twice, no masquerade element deleted that
    /// `after` still uses, none added twice, and the kernel's masquerade
    /// set afterwards exactly `after`'s.
    fn assert_shared_elements_kept(before: &Desired, after: &Desired) {
        let doc = partial_transaction(after, before);
        let deleted = element_ops(&doc, "delete");
        let unique: BTreeSet<_> = deleted.iter().cloned().collect();
        assert_eq!(unique.len(), deleted.len(), "a delete twice: {deleted:?}");
        let (wanted, had) = (masq_of(after), masq_of(before));
        for d in &deleted {
            assert!(!wanted.contains(d), "deletes {d:?}, which is still used");
        }
        let added: Vec<_> = element_ops(&doc, "add")
            .into_iter()
            .filter(|(set, _)| set.starts_with("masq"))
            .collect();
        let unique_added: BTreeSet<_> = added.iter().cloned().collect();
        assert_eq!(unique_added.len(), added.len(), "an add twice: {added:?}");
        let mut kernel = had;
        for d in &deleted {
            kernel.remove(d);
        }
        kernel.extend(unique_added);
        assert_eq!(kernel, wanted, "the masquerade set afterwards");
    }

    #[test]
    fn a_listener_that_goes_keeps_the_masquerade_element_it_shared() {
        let both = ["10.0.0.1", "10.0.0.2"];
        let mut before = Desired::new();
        before.insert(id("192.0.2.10", 80), listener(&both, &both));
        before.insert(id("192.0.2.10", 8080), listener(&both, &both));
        // The full write: each shared element once.
        let full = element_ops(&transaction(&before, &TableObjects::default()), "add");
        let masq: Vec<_> = full.iter().filter(|(s, _)| s == "masq4").collect();
        assert_eq!(masq.len(), 2, "{masq:?}");

        let mut after = before.clone();
        after.remove(&id("192.0.2.10", 8080));
        let doc = partial_transaction(&after, &before);
        let deleted = element_ops(&doc, "delete");
        assert!(
            !deleted.iter().any(|(set, _)| set == "masq4"),
            "port 80 still uses them: {deleted:?}"
        );
        // 8080's own elements go.
        assert!(deleted.contains(&(
            "refuse4".to_string(),
            r#"{"concat":["192.0.2.10","tcp",8080]}"#.to_string()
        )));
        assert_shared_elements_kept(&before, &after);

        // The last user goes: the elements go, each once.
        let doc = partial_transaction(&Desired::new(), &before);
        let masq: Vec<_> = element_ops(&doc, "delete")
            .into_iter()
            .filter(|(set, _)| set == "masq4")
            .collect();
        assert_eq!(masq.len(), 2, "{masq:?}");
        assert_shared_elements_kept(&before, &Desired::new());
    }

    #[test]
    fn listeners_that_share_elements_change_and_go_together_in_one_transaction() {
        let both = ["10.0.0.1", "10.0.0.2"];
        let vips = ["192.0.2.10", "192.0.2.11", "2001:db8::10"];
        let mut before = Desired::new();
        for vip in vips {
            for port in [80, 8080, 8443, 9090] {
                let members: &[&str] = if vip.contains(':') {
                    &["2001:db8::1", "2001:db8::2"]
                } else {
                    &both
                };
                before.insert(id(vip, port), listener(members, members));
            }
            // A UDP listener on the same nodeport: elements of its own.
            let mut udp = id(vip, 80);
            udp.1 = Protocol::Udp;
            before.insert(udp, before[&id(vip, 80)].clone());
        }
        // Many go, some change (a member leaves, the nodeport moves, no
        // more masquerade), one comes.
        let mut after = before.clone();
        for vip in vips {
            after.remove(&id(vip, 8080));
            after.remove(&id(vip, 8443));
        }
        after.get_mut(&id("192.0.2.10", 9090)).unwrap().backend_port = 30081;
        after.get_mut(&id("192.0.2.11", 80)).unwrap().members.pop();
        after.get_mut(&id("192.0.2.11", 9090)).unwrap().source_nat = SourceNat::None;
        after.insert(id("192.0.2.12", 80), listener(&both, &both));
        assert_shared_elements_kept(&before, &after);
        assert_shared_elements_kept(&after, &before);
        assert_shared_elements_kept(&before, &Desired::new());
        let mut gone_all_but_one = Desired::new();
        gone_all_but_one.insert(
            id("192.0.2.11", 9090),
            before[&id("192.0.2.11", 9090)].clone(),
        );
        assert_shared_elements_kept(&before, &gone_all_but_one);
        // An unchanged state writes nothing.
        assert_shared_elements_kept(&before, &before);
    }

    #[test]
    fn masquerade_users_are_counted_per_vip_backend_and_nodeport() {
        let both = ["10.0.0.1", "10.0.0.2"];
        let mut d = Desired::new();
        d.insert(id("192.0.2.10", 80), listener(&both, &both));
        d.insert(id("192.0.2.10", 8080), listener(&both, &both));
        let mut none = listener(&both, &both);
        none.source_nat = SourceNat::None;
        d.insert(id("192.0.2.10", 81), none);
        let users = nat_users(&d, SourceNat::Masquerade);
        let key = |b: &str| (ip("192.0.2.10"), ip(b), Protocol::Tcp, 30080);
        assert_eq!(users.get(&key("10.0.0.1")), Some(&2));
        assert_eq!(users.get(&key("10.0.0.2")), Some(&2));
        assert_eq!(users.len(), 2, "source_nat = none uses none: {users:?}");
        // Another VIP's users are not looked at.
        let vips: BTreeSet<IpAddr> = [ip("192.0.2.99")].into();
        assert_eq!(
            nat_difference(&d, &Desired::new(), &vips, SourceNat::Masquerade),
            Default::default()
        );
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn listeners_are_spread_over_tables_and_a_table_left_empty_goes_whole() {
        let home = id("192.0.2.10", 80);
        let away = id("192.0.2.10", port_in(false));
        let (t_home, t_away) = (Shard::of(&home), Shard::of(&away));
        let mut before = Desired::new();
        before.insert(home, listener(&["10.0.0.1"], &["10.0.0.1"]));
        let mut after = before.clone();
        after.insert(away, listener(&["10.0.0.1"], &["10.0.0.1"]));

        // A new table gets its parts with its first listener, in the same
        // transaction: the partial sync writes them, and only there.
        let t = text(&partial_transaction(&after, &before));
        let base = |sh: Shard| {
            format!(
                r#""hook":"prerouting","name":"prerouting","policy":"accept","prio":-100,"table":"{}""#,
                sh.table()
            )
        };
        assert!(t.contains(&base(t_away)), "{t}");
        assert!(!t.contains(&base(t_home)), "{t}");
        assert!(t.contains(&format!(
            r#""name":"dispatch4","table":"{}""#,
            t_away.table()
        )));
        // The refusal and the masquerade stay in the main table.
        assert!(t.contains(&format!(r#""name":"refuse4","table":"{TABLE}""#)));
        assert!(!t.contains(r#""name":"refuse4","table":"harvester_lb_nat_"#));
        assert!(!t.contains(
            r#""hook":"input","name":"input","policy":"accept","prio":0,"table":"harvester_lb_nat_"#
        ));

        // The full write: every table's parts once, the main one always.
        let t = text(&transaction(&after, &TableObjects::default()));
        for sh in [Shard::MAIN, t_home, t_away] {
            assert!(t.contains(&base(sh)), "{sh:?}: {t}");
        }
        assert!(!t.contains(
            r#""hook":"input","name":"input","policy":"accept","prio":0,"table":"harvester_lb_nat_"#
        ));

        // The last listener of a table goes: the table goes, whole.
        let deleted = deletes(&partial_transaction(&before, &after));
        assert!(
            deleted.contains(&format!(
                r#"{{"table":{{"family":"inet","name":"{}"}}}}"#,
                t_away.table()
            )),
            "{deleted:?}"
        );
        assert!(
            !deleted.iter().any(|d| d.contains(r#"{"chain""#)),
            "its objects go with it: {deleted:?}"
        );

        // A table of a shard this version does not use is deleted, and the
        // main table kept even without a listener.
        let mut present = TableObjects::of(&before);
        present
            .tables
            .insert(Shard::from_table("harvester_lb_nat_99").unwrap());
        let deleted = deletes(&transaction(&Desired::new(), &present));
        assert!(deleted.iter().any(|d| d.contains("harvester_lb_nat_99")));
        assert!(
            !deleted
                .iter()
                .any(|d| d.contains(&format!(r#""name":"{TABLE}"}}"#)))
        );
    }

    #[test]
    fn a_table_name_is_a_shard_only_as_this_module_writes_it() {
        assert_eq!(Shard::from_table("harvester_lb_nat"), Some(Shard::MAIN));
        let seven = Shard::from_table("harvester_lb_nat_7").unwrap();
        assert_eq!(seven.table(), "harvester_lb_nat_7");
        assert!(seven.in_use());
        assert!(!Shard::from_table("harvester_lb_nat_99").unwrap().in_use());
        for other in [
            "harvester_lb",
            "harvester_lb_nat_07",
            "harvester_lb_nat_0",
            "harvester_lb_nat_x",
            "harvester_lb_nat_300",
        ] {
            assert_eq!(Shard::from_table(other), None, "{other}");
        }
        // Fixed: the same table in every version (a restart finds each
        // listener where it was).
        assert_eq!(
            Shard::of(&id("192.0.2.10", 80)).table(),
            "harvester_lb_nat_15"
        );
        let spread: BTreeSet<Shard> = (1..=200).map(|p| Shard::of(&id("192.0.2.10", p))).collect();
        assert_eq!(spread.len(), usize::from(SHARDS));
    }

    #[test]
    fn a_partial_sync_touches_only_the_listener_that_changed() {
        let mut before = Desired::new();
        before.insert(
            id("192.0.2.10", 80),
            listener(&["10.0.0.1", "10.0.0.2"], &["10.0.0.1", "10.0.0.2"]),
        );
        before.insert(id("192.0.2.11", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
        let mut after = before.clone();
        after.get_mut(&id("192.0.2.10", 80)).unwrap().eligible = vec!["10.0.0.1".parse().unwrap()];
        let t = text(&partial_transaction(&after, &before));
        assert!(
            !t.contains("192.0.2.11"),
            "the other listener is left alone: {t}"
        );
        assert!(
            !t.contains(r#""name":"prerouting""#),
            "base chains untouched"
        );
        assert!(!t.contains("numgen"), "one backend left: {t}");
        assert!(t.contains(r#"{"dnat":{"addr":"10.0.0.1","family":"ip","port":30080}}"#));
        assert!(
            !t.contains(r#""delete":{"chain""#),
            "both members stay configured"
        );
        assert_eq!(
            text(&partial_transaction(&before, &before)),
            r#"{"nftables":[]}"#
        );
    }

    fn ips(list: &[&str]) -> Vec<IpAddr> {
        list.iter().map(|m| m.parse().unwrap()).collect()
    }

    #[test]
    fn every_bucket_goes_where_the_proxy_sends_that_key() {
        use crate::dataplane::balancer::{Backend, ClientAddr};
        use std::net::SocketAddr;
        use std::sync::atomic::AtomicUsize;
        let eligible = ips(&["10.0.0.1", "10.0.0.2", "10.0.0.3", "2001:db8::4"]);
        let arcs: Vec<_> = eligible.iter().map(|&a| Backend::new(a, true)).collect();
        let filled = buckets(&eligible);
        assert_eq!(filled.len(), BUCKETS as usize);
        let cursor = AtomicUsize::new(0);
        for (i, got) in filled.iter().enumerate() {
            let pick = select::first_candidate(
                Algorithm::SourceIp,
                &arcs,
                ClientAddr::new(SocketAddr::new(bucket_key(i as u32), 0)),
                &cursor,
            );
            assert_eq!(*got, eligible[pick], "bucket {i}");
        }
        // Spread: each backend a fair share (4093 / 4 = 1023, +-15 %).
        for b in &eligible {
            let n = filled.iter().filter(|x| *x == b).count();
            assert!((870..=1180).contains(&n), "{b}: {n}");
        }
        assert!(buckets(&[]).is_empty());
    }

    #[test]
    fn a_backend_that_leaves_moves_only_its_own_buckets() {
        let all = ips(&["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
        let before = buckets(&all);
        let after = buckets(&ips(&["10.0.0.1", "10.0.0.3"]));
        let gone: IpAddr = "10.0.0.2".parse().unwrap();
        let mut moved = 0;
        for (b, a) in before.iter().zip(&after) {
            if *b == gone {
                moved += 1;
                assert_ne!(*a, gone);
            } else {
                assert_eq!(a, b, "a bucket of a backend that stayed moved");
            }
        }
        assert!(moved > 0);
        // Coming back takes exactly those buckets again.
        assert_eq!(buckets(&all), before);
    }

    fn source_ip(eligible: &[&str], members: &[&str]) -> KernelListener {
        KernelListener {
            pick: Algorithm::SourceIp,
            ..listener(eligible, members)
        }
    }

    #[test]
    fn source_ip_is_a_jhash_bucket_map_edited_element_wise() {
        let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
        let l = id("192.0.2.10", 80);
        let mut before = Desired::new();
        before.insert(l, source_ip(&members, &members));
        let t = text(&transaction(&before, &TableObjects::default()));
        assert!(
            t.contains(r#"{"vmap":{"data":"@m_tcp_80_192.0.2.10","key":{"jhash":{"expr":{"payload":{"field":"saddr","protocol":"ip"}},"mod":4093,"seed":1751280738}}}}"#),
            "{t}"
        );
        assert!(t.contains(
            r#"{"flush":{"map":{"family":"inet","map":"ipv4_addr","name":"m_tcp_80_192.0.2.10""#
        ));
        assert_eq!(
            t.matches(r#"{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0."#)
                .count(),
            4093
        );
        assert!(!t.contains("numgen"));
        let script = prelude(&before, None, &TableObjects::default()).unwrap();
        assert!(
            script.contains("add map inet harvester_lb_nat_15 m_tcp_80_192.0.2.10 { typeof numgen inc mod 4093 : verdict ; }"),
            "{script}"
        );
        assert_eq!(prelude(&before, None, &TableObjects::of(&before)), None);

        // Node 2 leaves: only its buckets are deleted and given to others.
        let mut after = before.clone();
        after.get_mut(&l).unwrap().eligible = ips(&["10.0.0.1", "10.0.0.3"]);
        let doc = partial_transaction(&after, &before);
        let moved = buckets(&ips(&members))
            .iter()
            .filter(|b| **b == "10.0.0.2".parse::<IpAddr>().unwrap())
            .count();
        let cmds = doc["nftables"].as_array().unwrap();
        let deleted: usize = cmds
            .iter()
            .filter_map(|c| c.pointer("/delete/element"))
            .filter(|e| e["name"] == "m_tcp_80_192.0.2.10")
            .map(|e| e["elem"].as_array().unwrap().len())
            .sum();
        assert_eq!(deleted, moved);
        let t = text(&doc);
        assert_eq!(
            t.matches(r#"{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0."#)
                .count(),
            moved
        );
        assert!(
            !t.contains(r#"{"flush":{"map""#),
            "no flush of the map: {t}"
        );

        // Back to round robin: the map goes, after the chain that used it.
        let mut rr = before.clone();
        rr.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
        let t = text(&partial_transaction(&rr, &before));
        assert!(t.contains(r#"{"delete":{"map":{"family":"inet","map":"ipv4_addr","name":"m_tcp_80_192.0.2.10""#), "{t}");
    }

    fn flow_hash(eligible: &[&str], members: &[&str]) -> KernelListener {
        KernelListener {
            pick: Algorithm::FlowHash,
            ..listener(eligible, members)
        }
    }

    /// The bucket map's elements a document writes: bucket to backend
    /// chain.
    fn written_buckets(doc: &serde_json::Value, map: &str) -> BTreeMap<u64, String> {
        let mut out = BTreeMap::new();
        for c in doc["nftables"].as_array().unwrap() {
            let Some(e) = c.pointer("/add/element").filter(|e| e["name"] == map) else {
                continue;
            };
            for item in e["elem"][0]["set"].as_array().unwrap() {
                let bucket = item[0].as_u64().unwrap();
                let target = item[1]["goto"]["target"].as_str().unwrap().to_string();
                out.insert(bucket, target);
            }
        }
        out
    }

    #[test]
    fn flow_hash_hashes_address_and_port_over_the_same_buckets() {
        let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
        let l = id("192.0.2.10", 80);
        let mut d = Desired::new();
        d.insert(l, flow_hash(&members, &members));
        let t = text(&transaction(&d, &TableObjects::default()));
        assert!(
            t.contains(r#"{"vmap":{"data":"@m_tcp_80_192.0.2.10","key":{"jhash":{"expr":{"concat":[{"payload":{"field":"saddr","protocol":"ip"}},{"payload":{"field":"sport","protocol":"th"}}]},"mod":4093,"seed":1751280738}}}}"#),
            "{t}"
        );
        assert!(!t.contains("numgen"));
        // Its map is declared as source_ip's, and filled alike.
        let script = prelude(&d, None, &TableObjects::default()).unwrap();
        assert!(script.contains("add map inet harvester_lb_nat_15 m_tcp_80_192.0.2.10 { typeof numgen inc mod 4093 : verdict ; }"), "{script}");
        let mut s = Desired::new();
        s.insert(l, source_ip(&members, &members));
        let doc = transaction(&d, &TableObjects::default());
        let map = bucket_map(&l);
        assert_eq!(
            written_buckets(&doc, &map),
            written_buckets(&transaction(&s, &TableObjects::default()), &map)
        );
        // A TCP flow_hash listener's mid-stream segments are DNATed: its
        // key is in the pickup set, which the socket-lookup return skips.
        assert!(t.contains(r#"{"add":{"element":{"elem":[{"concat":["192.0.2.10","tcp",80]}],"family":"inet","name":"pickup4""#), "{t}");
        assert!(t.contains(r#"{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"!=","right":"@pickup4"}},{"match":{"left":{"socket":{"key":"transparent"}},"op":"==","right":0}},{"return":null}"#), "{t}");
        let picked = |d: &Desired| -> Vec<(String, String)> {
            element_ops(&transaction(d, &TableObjects::default()), "add")
                .into_iter()
                .filter(|(set, _)| set == "pickup4")
                .collect()
        };
        assert_eq!(picked(&d).len(), 1);
        // source_ip is picked up too (a client keeps its backend on every
        // host); round robin is not: its listener's key stays out.
        assert_eq!(picked(&s).len(), 1);
        let mut rr = d.clone();
        rr.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
        assert_eq!(picked(&rr), vec![]);
        // A UDP flow_hash listener neither: UDP has no socket to return to.
        let mut udp = Desired::new();
        udp.insert(
            (ip("192.0.2.10"), Protocol::Udp, 53),
            flow_hash(&members, &members),
        );
        assert_eq!(picked(&udp), vec![]);
    }

    #[test]
    fn two_hosts_building_one_config_write_identical_bucket_maps() {
        // Two independent builds (two hosts, the same config and health;
        // members in another order on one) write the same bucket to the
        // same backend, for every bucket.
        let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"];
        let mut reversed = members;
        reversed.reverse();
        let l = id("192.0.2.10", 80);
        let mut a = Desired::new();
        a.insert(l, flow_hash(&members, &members));
        let mut b = Desired::new();
        b.insert(l, flow_hash(&reversed, &reversed));
        let map = bucket_map(&l);
        let on_a = written_buckets(&transaction(&a, &TableObjects::default()), &map);
        let on_b = written_buckets(&transaction(&b, &TableObjects::default()), &map);
        assert_eq!(on_a.len(), BUCKETS as usize);
        assert_eq!(on_a, on_b);
        // And the same after a flip seen by both.
        let down = |d: &Desired| {
            let mut d = d.clone();
            d.get_mut(&l)
                .unwrap()
                .eligible
                .retain(|e| *e != ip("10.0.0.3"));
            d
        };
        assert_eq!(
            buckets(&down(&a)[&l].eligible),
            buckets(&down(&b)[&l].eligible)
        );
    }

    #[test]
    fn a_flow_hash_health_flip_rewrites_only_the_buckets_of_the_backend_that_changed() {
        let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
        let l = id("192.0.2.10", 80);
        let mut before = Desired::new();
        before.insert(l, flow_hash(&members, &members));
        let map = bucket_map(&l);
        let all = written_buckets(&transaction(&before, &TableObjects::default()), &map);
        let chain_of = |b: &str| backend_chain(&l, ip(b));
        let owned_by = |b: &str| {
            all.iter()
                .filter(|(_, c)| **c == chain_of(b))
                .map(|(k, _)| *k)
                .collect::<BTreeSet<u64>>()
        };
        // 10.0.0.2 goes down: exactly its buckets are deleted and written
        // again, each to another backend; no other bucket is touched.
        let mut after = before.clone();
        after.get_mut(&l).unwrap().eligible = ips(&["10.0.0.1", "10.0.0.3"]);
        let doc = partial_transaction(&after, &before);
        let rewritten = written_buckets(&doc, &map);
        assert_eq!(
            rewritten.keys().copied().collect::<BTreeSet<_>>(),
            owned_by("10.0.0.2")
        );
        assert!(rewritten.values().all(|c| *c != chain_of("10.0.0.2")));
        let t = text(&doc);
        assert!(
            !t.contains(r#"{"flush":{"map""#),
            "no flush of the map: {t}"
        );
        // It comes back: it takes exactly its own buckets again.
        let doc = partial_transaction(&before, &after);
        let back = written_buckets(&doc, &map);
        assert_eq!(
            back.keys().copied().collect::<BTreeSet<_>>(),
            owned_by("10.0.0.2")
        );
        assert!(back.values().all(|c| *c == chain_of("10.0.0.2")));
        // A switch between source_ip and flow_hash keeps every bucket (the
        // same fill); only the hash input changes.
        let mut s = before.clone();
        s.get_mut(&l).unwrap().pick = Algorithm::SourceIp;
        assert!(written_buckets(&partial_transaction(&s, &before), &map).is_empty());
    }

    #[test]
    fn a_flow_hash_listener_that_goes_leaves_the_pickup_set() {
        let members = ["10.0.0.1", "10.0.0.2"];
        let l = id("192.0.2.10", 80);
        let mut before = Desired::new();
        before.insert(l, flow_hash(&members, &members));
        let deleted = element_ops(&partial_transaction(&Desired::new(), &before), "delete");
        // The table goes whole with its last listener; with a neighbour
        // left, the element goes by itself.
        let mut with = before.clone();
        let other = id("192.0.2.10", port_in(true));
        with.insert(other, listener(&members, &members));
        let mut after = with.clone();
        after.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
        let deleted_rr = element_ops(&partial_transaction(&after, &with), "delete");
        assert!(
            deleted_rr.contains(&(
                "pickup4".to_string(),
                r#"{"concat":["192.0.2.10","tcp",80]}"#.to_string()
            )),
            "{deleted_rr:?}"
        );
        assert!(
            deleted.iter().any(|(set, _)| set == "pickup4"),
            "{deleted:?}"
        );
        // Round robin to round robin: no delete of an element never written.
        let mut rr2 = after.clone();
        rr2.get_mut(&l).unwrap().eligible.pop();
        let deleted = element_ops(&partial_transaction(&rr2, &after), "delete");
        assert!(
            !deleted.iter().any(|(set, _)| set == "pickup4"),
            "{deleted:?}"
        );
    }

    #[test]
    fn source_nat_vip_snats_to_the_vip_keeping_ports() {
        let both = ["10.0.0.1", "10.0.0.2"];
        let mut d = Desired::new();
        let mut l = listener(&both, &both);
        l.source_nat = SourceNat::Vip;
        d.insert(id("192.0.2.10", 80), l);
        let t = text(&transaction(&d, &TableObjects::default()));
        assert!(
            t.contains(
                r#"{"snat":{"addr":{"ct":{"dir":"original","key":"ip daddr"}},"family":"ip"}}"#
            ),
            "{t}"
        );
        assert!(t.contains(r#"{"elem":[{"concat":["192.0.2.10","10.0.0.1","tcp",30080]},{"concat":["192.0.2.10","10.0.0.2","tcp",30080]}],"family":"inet","name":"snat4""#), "{t}");
        assert!(masq_of(&d).is_empty(), "no masquerade");
        // Switching to masquerade moves the elements between the sets.
        let mut m = d.clone();
        m.values_mut().next().unwrap().source_nat = SourceNat::Masquerade;
        let doc = partial_transaction(&m, &d);
        let deleted = element_ops(&doc, "delete");
        assert_eq!(
            deleted.iter().filter(|(s, _)| s == "snat4").count(),
            2,
            "{deleted:?}"
        );
        let added = element_ops(&doc, "add");
        assert_eq!(
            added.iter().filter(|(s, _)| s == "masq4").count(),
            2,
            "{added:?}"
        );
    }

    #[test]
    fn client_affinity_is_a_dynamic_set_per_backend_tried_first() {
        let l = id("192.0.2.10", 80);
        let mut d = Desired::new();
        let mut kl = listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]);
        kl.affinity = Some(std::time::Duration::from_secs(600));
        d.insert(l, kl);
        let t = text(&transaction(&d, &TableObjects::default()));
        let script = prelude(&d, None, &TableObjects::default()).unwrap();
        assert!(
            script.contains("add set inet harvester_lb_nat_15 a_tcp_80_192.0.2.10_10.0.0.2 { type ipv4_addr ; flags dynamic,timeout ; timeout 600s ; }"),
            "{script}"
        );
        assert_eq!(
            prelude(&d, Some(&d), &TableObjects::of(&d)),
            None,
            "unchanged: nothing"
        );
        // Only the eligible backend's set is looked up, before the pick.
        let lookup = r#"{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"==","right":"@a_tcp_80_192.0.2.10_10.0.0.1"}},{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0.1"}}"#;
        assert!(t.contains(lookup), "{t}");
        assert!(!t.contains(r#""right":"@a_tcp_80_192.0.2.10_10.0.0.2""#));
        // The pick (one eligible backend: a plain goto) comes after it.
        let pick = r#""expr":[{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0.1"}}]"#;
        assert!(t.find(lookup).unwrap() < t.find(pick).expect(pick), "{t}");
        // Every backend chain remembers its clients; a backend out of the
        // choice loses them.
        assert!(t.contains(r#"{"set":{"elem":{"payload":{"field":"saddr","protocol":"ip"}},"op":"update","set":"@a_tcp_80_192.0.2.10_10.0.0.2"}}"#));
        assert!(
            t.contains(r#"{"flush":{"set":{"family":"inet","name":"a_tcp_80_192.0.2.10_10.0.0.2""#)
        );
        assert!(
            !t.contains(
                r#"{"flush":{"set":{"family":"inet","name":"a_tcp_80_192.0.2.10_10.0.0.1""#
            )
        );
    }

    /// Whether `doc` flushes the main table's `postrouting`.
    fn flushes_postrouting(doc: &serde_json::Value) -> bool {
        doc["nftables"].as_array().unwrap().iter().any(|o| {
            o.pointer("/flush/chain")
                .is_some_and(|c| c["name"] == "postrouting" && c["table"] == TABLE)
        })
    }

    #[test]
    fn postrouting_looks_up_only_the_source_nats_in_use() {
        let v4 = id("192.0.2.10", 80);
        let mut none = Desired::new();
        let mut l = listener(&["10.0.0.1"], &["10.0.0.1"]);
        l.source_nat = SourceNat::None;
        none.insert(v4, l.clone());
        // `none` only: the first packet of a new flow meets no rule there.
        let doc = transaction(&none, &TableObjects::default());
        assert_eq!(rules_of(&doc, "postrouting"), Vec::<String>::new());
        // One IPv4 masquerade listener: one rule, the IPv4 masquerade.
        let mut masq = none.clone();
        masq.insert(id("192.0.2.10", 81), listener(&["10.0.0.1"], &["10.0.0.1"]));
        let rules = rules_of(&transaction(&masq, &TableObjects::default()), "postrouting");
        assert_eq!(rules.len(), 1, "{rules:#?}");
        assert!(rules[0].contains("@masq4") && rules[0].contains("masquerade"));
        // Every kind of both families: the four rules, masquerade first.
        let mut all = masq.clone();
        let mut vip = listener(&["10.0.0.1"], &["10.0.0.1"]);
        vip.source_nat = SourceNat::Vip;
        all.insert(id("192.0.2.11", 80), vip.clone());
        all.insert(
            id("2001:db8::10", 80),
            listener(&["2001:db8::1"], &["2001:db8::1"]),
        );
        all.insert(id("2001:db8::11", 80), {
            let mut v = vip.clone();
            v.members = vec!["2001:db8::1".parse().unwrap()];
            v.eligible = v.members.clone();
            v
        });
        let rules = rules_of(&transaction(&all, &TableObjects::default()), "postrouting");
        let sets: Vec<&str> = rules
            .iter()
            .map(|r| {
                ["@masq4", "@snat4", "@masq6", "@snat6"]
                    .into_iter()
                    .find(|s| r.contains(s))
                    .unwrap()
            })
            .collect();
        assert_eq!(sets, ["@masq4", "@snat4", "@masq6", "@snat6"]);
        // A partial sync rewrites the chain when the kinds change, and
        // leaves it alone when they do not.
        let doc = partial_transaction(&masq, &none);
        assert!(flushes_postrouting(&doc));
        assert_eq!(rules_of(&doc, "postrouting").len(), 1);
        let doc = partial_transaction(&none, &masq);
        assert!(flushes_postrouting(&doc));
        assert_eq!(rules_of(&doc, "postrouting"), Vec::<String>::new());
        let mut flipped = masq.clone();
        flipped.get_mut(&v4).unwrap().eligible.clear();
        let doc = partial_transaction(&flipped, &masq);
        assert!(!flushes_postrouting(&doc));
        assert_eq!(rules_of(&doc, "postrouting"), Vec::<String>::new());
    }
}

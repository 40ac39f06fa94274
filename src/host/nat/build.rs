//! The pure builder: desired state in, one nft transaction out.
//!
//! The transaction never deletes the table (that would cut every open
//! flow's NAT binding is kept by conntrack, but a deleted table also drops
//! its counters and, for a moment, its rules): it adds what may be missing
//! (`add` is idempotent), flushes every chain, map and set it owns, fills
//! them again, and deletes the objects of listeners and backends that are
//! gone. One `nft -j -f -` call is one atomic transaction: a packet sees the
//! old table or the new one, never half of each.
//!
//! What one listener writes (its chains, bucket map, affinity sets and
//! the declaration of its objects) is in the `listener` submodule; this
//! file assembles the transactions from those parts, the tables' own parts
//! and the source NAT elements.

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
    CT, Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, Verdict,
};
use nftables::schema::{
    Chain, Counter, Element, FlushObject, Map, NfCmd, NfListObject, NfObject, Nftables, Rule, Set,
    SetType, SetTypeValue, Table,
};
use nftables::stmt::{
    JumpTarget, Match, NAT, NATFamily, NATFlag, Operator, Reject, RejectType, Statement, VerdictMap,
};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook, RejectCode};

mod listener;

pub use listener::{BUCKETS, bucket_key, buckets};
use listener::{declare, fill_listener, uses_buckets};
pub(super) use listener::{has_backend_chains, picks_up};

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
mod tests;

//! The pure builder: desired state in, one nft transaction out.
//!
//! The transaction never deletes the table (that would cut every open
//! flow's NAT binding is kept by conntrack, but a deleted table also drops
//! its counters and, for a moment, its rules): it adds what may be missing
//! (`add` is idempotent), flushes every chain, map and set it owns, fills
//! them again, and deletes the objects of listeners and backends that are
//! gone. One `nft -j -f -` call is one atomic transaction: a packet sees the
//! old table or the new one, never half of each.

use std::borrow::Cow;
use std::collections::BTreeSet;
use std::net::IpAddr;

use nftables::expr::{
    CT, Expression, Meta, MetaKey, NamedExpression, NgMode, Numgen, Payload, PayloadField, Prefix,
    SetItem, Verdict,
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

use super::*;

/// The table's name, in family `inet` (beside `inet harvester_lb`, the
/// VIP isolation table, which it never touches).
pub const TABLE: &str = "harvester_lb_nat";

/// `dstnat`: NAT before routing, as kube-proxy. Numeric, because nft 1.0.6
/// refuses the name `dstnat` on the output hook.
const PRIO_DSTNAT: i32 = -100;
/// `srcnat`.
const PRIO_SRCNAT: i32 = 100;
/// `filter`: the refusal of what was not forwarded.
const PRIO_FILTER: i32 = 0;

/// What the kernel table holds of ours, by name: what a sync deletes when
/// the desired state no longer has it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Owned {
    /// Regular chains (`l_…`, `b_…`); base chains are not listed.
    pub chains: BTreeSet<String>,
    /// Named counters.
    pub counters: BTreeSet<String>,
    /// Per-listener source-range sets (`s_…`).
    pub sets: BTreeSet<String>,
}

impl Owned {
    /// The objects `desired` gives the table.
    pub fn of(desired: &Desired) -> Self {
        let mut o = Self::default();
        for (id, l) in desired {
            o.chains.insert(listener_chain(id));
            o.counters.insert(no_backend_counter(id));
            if l.source_ranges.is_some() {
                o.counters.insert(denied_counter(id));
                o.sets.insert(source_set(id));
            }
            for &b in &l.members {
                o.counters.insert(backend_counter(id, b));
            }
        }
        o
    }
}

fn s(x: impl Into<String>) -> Cow<'static, str> {
    Cow::Owned(x.into())
}

fn add(o: NfListObject<'static>) -> NfObject<'static> {
    NfObject::CmdObject(NfCmd::Add(o))
}

fn chain(name: &str) -> Chain<'static> {
    Chain {
        family: NfFamily::INet,
        table: s(TABLE),
        name: s(name),
        ..Chain::default()
    }
}

fn base_chain(name: &str, kind: NfChainType, hook: NfHook, prio: i32) -> Chain<'static> {
    Chain {
        _type: Some(kind),
        hook: Some(hook),
        prio: Some(prio),
        policy: Some(NfChainPolicy::Accept),
        ..chain(name)
    }
}

fn rule(chain: &str, expr: Vec<Statement<'static>>) -> NfObject<'static> {
    add(NfListObject::Rule(Rule {
        family: NfFamily::INet,
        table: s(TABLE),
        chain: s(chain),
        expr: Cow::Owned(expr),
        ..Rule::default()
    }))
}

fn counter(name: &str) -> Counter<'static> {
    Counter {
        family: NfFamily::INet,
        table: s(TABLE),
        name: s(name),
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
            protocol: s(protocol),
            field: s(field),
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
        key: s(key),
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
    Expression::String(s(format!("@{name}")))
}

fn goto(target: String) -> Verdict<'static> {
    Verdict::Goto(JumpTarget { target: s(target) })
}

fn proto_name(p: Protocol) -> Expression<'static> {
    Expression::String(s(p.as_str()))
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
        Expression::String(s(vip.to_string())),
        proto_name(*protocol),
        Expression::Number(u32::from(*port)),
    ])
}

fn element(name: &str, elem: Vec<Expression<'static>>) -> NfObject<'static> {
    add(NfListObject::Element(Element {
        family: NfFamily::INet,
        table: s(TABLE),
        name: s(name),
        elem: Cow::Owned(elem),
    }))
}

fn tuple_set(name: &str, types: Vec<SetType>) -> Set<'static> {
    Set {
        family: NfFamily::INet,
        table: s(TABLE),
        name: s(name),
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

/// The map and set names of one address family.
struct Family {
    v4: bool,
    dispatch: &'static str,
    refuse: &'static str,
    masq: &'static str,
}

const FAMILIES: [Family; 2] = [
    Family {
        v4: true,
        dispatch: "dispatch4",
        refuse: "refuse4",
        masq: "masq4",
    },
    Family {
        v4: false,
        dispatch: "dispatch6",
        refuse: "refuse6",
        masq: "masq6",
    },
];

/// Deletes the objects of `present` that `wanted` has not; nothing may
/// refer to them any more.
fn delete_gone(cmds: &mut Vec<NfObject<'static>>, present: &Owned, wanted: &Owned) {
    // Listener chains before backend chains: a flushed listener chain
    // still holds its anonymous verdict map (and so its backend chains)
    // until it is deleted itself (EBUSY otherwise, measured on 6.18).
    let (listeners, backends): (Vec<&String>, Vec<&String>) = present
        .chains
        .difference(&wanted.chains)
        .partition(|n| n.starts_with("l_"));
    for name in listeners.into_iter().chain(backends) {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Chain(
            chain(name),
        ))));
    }
    for name in present.sets.difference(&wanted.sets) {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Set(
            Box::new(tuple_set(name, Vec::new())),
        ))));
    }
    for name in present.counters.difference(&wanted.counters) {
        cmds.push(NfObject::CmdObject(NfCmd::Delete(NfListObject::Counter(
            counter(name),
        ))));
    }
}

/// A listener's rules and elements, into its declared objects.
fn fill_listener(cmds: &mut Vec<NfObject<'static>>, id: &ListenerId, l: &KernelListener) {
    let v4 = is_v4(id.0);
    let f = &FAMILIES[usize::from(!v4)];
    let lchain = listener_chain(id);
    cmds.push(element(
        f.dispatch,
        vec![Expression::Named(NamedExpression::Set(vec![
            SetItem::Mapping(listener_key(id), Expression::Verdict(goto(lchain.clone()))),
        ]))],
    ));
    cmds.push(element(f.refuse, vec![listener_key(id)]));
    if let Some(ranges) = &l.source_ranges {
        let family: Vec<IpNet> = ranges
            .iter()
            .filter(|n| n.addr().is_ipv4() == v4)
            .copied()
            .collect();
        let merged = IpNet::aggregate(&family);
        if !merged.is_empty() {
            cmds.push(element(
                &source_set(id),
                merged
                    .iter()
                    .map(|n| {
                        Expression::Named(NamedExpression::Prefix(Prefix {
                            addr: Box::new(Expression::String(s(n.addr().to_string()))),
                            len: u32::from(n.prefix_len()),
                        }))
                    })
                    .collect(),
            ));
        }
        cmds.push(rule(
            &lchain,
            vec![
                matches(
                    payload(ip_proto(v4), "saddr"),
                    Operator::NEQ,
                    set_ref(&source_set(id)),
                ),
                Statement::Counter(stmt::Counter::Named(s(denied_counter(id)))),
                Statement::Return(None),
            ],
        ));
    }
    // The backend choice: no set (an anonymous one per listener makes the
    // kernel's commit quadratic in the listeners) and no chain per backend;
    // a health flip rewrites this chain alone ([`super::netlink`] writes the
    // same rules).
    if l.eligible.is_empty() {
        cmds.push(rule(
            &lchain,
            vec![
                Statement::Counter(stmt::Counter::Named(s(no_backend_counter(id)))),
                Statement::Return(None),
            ],
        ));
    }
    for (k, &b) in l.eligible.iter().enumerate() {
        let mut expr = Vec::new();
        // Round robin without a set: rule k takes every (E - k)th of the
        // connections that reach it, each rule keeping its own count.
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
        expr.extend([
            Statement::Counter(stmt::Counter::Named(s(backend_counter(id, b)))),
            matches(l4proto(), Operator::EQ, proto_name(id.1)),
            Statement::DNAT(Some(NAT {
                addr: Some(Expression::String(s(b.to_string()))),
                family: Some(if b.is_ipv4() {
                    NATFamily::IP
                } else {
                    NATFamily::IP6
                }),
                port: Some(Expression::Number(u32::from(l.backend_port))),
                flags: None,
            })),
        ]);
        cmds.push(rule(&lchain, expr));
    }
    if l.source_nat == SourceNat::Masquerade {
        // Every member, eligible or not: only new flows are masqueraded
        // and only eligible members get new flows, so a health flip
        // changes no element here.
        for &b in &l.members {
            cmds.push(element(f.masq, vec![masq_key(id, b, l.backend_port)]));
        }
    }
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
pub(super) fn transaction_json(desired: &Desired, present: &Owned) -> Vec<u8> {
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
    let delete_element = |name: &str, elem: Expression<'static>| {
        NfObject::CmdObject(NfCmd::Delete(NfListObject::Element(Element {
            family: NfFamily::INet,
            table: s(TABLE),
            name: s(name),
            elem: Cow::Owned(vec![elem]),
        })))
    };
    // The elements of listeners that go or change (re-added below).
    for (id, old) in applied {
        if desired.get(id) == Some(old) {
            continue;
        }
        let f = &FAMILIES[usize::from(!is_v4(id.0))];
        cmds.push(delete_element(f.dispatch, listener_key(id)));
        cmds.push(delete_element(f.refuse, listener_key(id)));
        if old.source_nat == SourceNat::Masquerade {
            for &b in &old.members {
                cmds.push(delete_element(f.masq, masq_key(id, b, old.backend_port)));
            }
        }
    }
    let mut changed = Desired::new();
    for (id, l) in desired {
        if applied.get(id) != Some(l) {
            changed.insert(*id, l.clone());
        }
    }
    let declared = Owned::of(&changed);
    declare(&mut cmds, &changed, &declared);
    for (id, l) in &changed {
        fill_listener(&mut cmds, id, l);
    }
    delete_gone(&mut cmds, &Owned::of(applied), &Owned::of(desired));
    Nftables {
        objects: Cow::Owned(cmds),
    }
}

/// A masquerade element: VIP . backend . protocol . nodeport.
fn masq_key(id: &ListenerId, backend: IpAddr, backend_port: u16) -> Expression<'static> {
    concat(vec![
        Expression::String(s(id.0.to_string())),
        Expression::String(s(backend.to_string())),
        proto_name(id.1),
        Expression::Number(u32::from(backend_port)),
    ])
}

/// Adds (idempotent) and empties the listeners' own objects: counters,
/// chains, source-range sets.
fn declare(cmds: &mut Vec<NfObject<'static>>, desired: &Desired, wanted: &Owned) {
    for name in &wanted.counters {
        cmds.push(add(NfListObject::Counter(counter(name))));
    }
    for name in &wanted.chains {
        cmds.push(add(NfListObject::Chain(chain(name))));
    }
    for (id, l) in desired {
        if l.source_ranges.is_some() {
            let mut set = tuple_set(&source_set(id), Vec::new());
            set.set_type = SetTypeValue::Single(addr_type(is_v4(id.0)));
            set.flags = Some([SetFlag::Interval].into_iter().collect());
            cmds.push(add(NfListObject::Set(Box::new(set))));
        }
    }
    for name in &wanted.chains {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(
            chain(name),
        ))));
    }
    for name in &wanted.sets {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(
            Box::new(tuple_set(name, Vec::new())),
        ))));
    }
}

/// The one transaction that makes the table `desired`, deleting whatever
/// of `present` (what the kernel holds, read back or last written) is no
/// longer wanted: nft's JSON document, ready for `nft -j -f -`.
pub fn transaction(desired: &Desired, present: &Owned) -> serde_json::Value {
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

fn commands(desired: &Desired, present: &Owned) -> Nftables<'static> {
    let mut cmds: Vec<NfObject<'static>> = Vec::new();
    let wanted = Owned::of(desired);

    // 1. Everything that may be missing (idempotent).
    cmds.push(add(NfListObject::Table(Table {
        family: NfFamily::INet,
        name: s(TABLE),
        handle: None,
    })));
    let bases = [
        base_chain(
            "prerouting",
            NfChainType::NAT,
            NfHook::Prerouting,
            PRIO_DSTNAT,
        ),
        base_chain("output", NfChainType::NAT, NfHook::Output, PRIO_DSTNAT),
        base_chain(
            "postrouting",
            NfChainType::NAT,
            NfHook::Postrouting,
            PRIO_SRCNAT,
        ),
        base_chain("input", NfChainType::Filter, NfHook::Input, PRIO_FILTER),
    ];
    for f in &FAMILIES {
        let addr = addr_type(f.v4);
        let tuple = vec![addr, SetType::InetProto, SetType::InetService];
        cmds.push(add(NfListObject::Map(Box::new(Map {
            family: NfFamily::INet,
            table: s(TABLE),
            name: s(f.dispatch),
            set_type: SetTypeValue::Concatenated(Cow::Owned(tuple.clone())),
            // Replaced by `verdict` in [`transaction`]: the crate's
            // `SetType` has no verdict type.
            map: SetTypeValue::Single(SetType::Mark),
            ..Map::default()
        }))));
        cmds.push(add(NfListObject::Set(Box::new(tuple_set(f.refuse, tuple)))));
        cmds.push(add(NfListObject::Set(Box::new(tuple_set(
            f.masq,
            vec![addr, addr, SetType::InetProto, SetType::InetService],
        )))));
    }
    for c in &bases {
        cmds.push(add(NfListObject::Chain(c.clone())));
    }
    declare(&mut cmds, desired, &wanted);

    // 2. Empty what is ours, then fill it again.
    for c in bases.iter().cloned() {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Chain(c))));
    }
    for f in &FAMILIES {
        cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Map(
            Box::new(Map {
                family: NfFamily::INet,
                table: s(TABLE),
                name: s(f.dispatch),
                ..Map::default()
            }),
        ))));
        for name in [f.refuse, f.masq] {
            cmds.push(NfObject::CmdObject(NfCmd::Flush(FlushObject::Set(
                Box::new(tuple_set(name, Vec::new())),
            ))));
        }
    }

    for f in &FAMILIES {
        let vmap = Statement::VerdictMap(VerdictMap {
            key: dispatch_key(f.v4),
            data: set_ref(f.dispatch),
        });
        cmds.push(rule("prerouting", vec![vmap.clone()]));
        cmds.push(rule("output", vec![vmap]));
        cmds.push(rule(
            "postrouting",
            vec![
                matches(
                    ct("status", false),
                    Operator::IN,
                    Expression::String(s("dnat")),
                ),
                matches(
                    concat(vec![
                        ct(&format!("{} daddr", ip_proto(f.v4)), true),
                        payload(ip_proto(f.v4), "daddr"),
                        l4proto(),
                        payload("th", "dport"),
                    ]),
                    Operator::EQ,
                    set_ref(f.masq),
                ),
                Statement::Masquerade(Some(NAT {
                    addr: None,
                    family: None,
                    port: None,
                    flags: Some([NATFlag::FullyRandom].into_iter().collect()),
                })),
            ],
        ));
        let refused = || {
            vec![
                matches(
                    ct("state", false),
                    Operator::IN,
                    Expression::String(s("new")),
                ),
                matches(dispatch_key(f.v4), Operator::EQ, set_ref(f.refuse)),
            ]
        };
        let mut tcp = refused();
        tcp.push(matches(
            l4proto(),
            Operator::EQ,
            Expression::String(s("tcp")),
        ));
        tcp.push(Statement::Reject(Some(Reject::new(
            Some(RejectType::TCPReset),
            None,
        ))));
        cmds.push(rule("input", tcp));
        let mut other = refused();
        other.push(Statement::Reject(Some(Reject::new(
            Some(RejectType::ICMPX),
            Some(RejectCode::PortUnreach),
        ))));
        cmds.push(rule("input", other));
    }

    for (id, l) in desired {
        fill_listener(&mut cmds, id, l);
    }

    // 3. What is gone: after the flushes above, nothing refers to it.
    delete_gone(&mut cmds, present, &wanted);
    Nftables {
        objects: Cow::Owned(cmds),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn listener(eligible: &[&str], members: &[&str]) -> KernelListener {
        KernelListener {
            backend_port: 30080,
            members: members.iter().map(|m| m.parse().unwrap()).collect(),
            eligible: eligible.iter().map(|m| m.parse().unwrap()).collect(),
            source_ranges: None,
            source_nat: SourceNat::Masquerade,
            close_down: Vec::new(),
        }
    }

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
        let t = text(&transaction(&d, &Owned::default()));
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
        let present = Owned::of(&before);
        let bytes = transaction_json(&after, &present);
        let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(parsed, transaction(&after, &present));
        assert!(text(&parsed).contains(r#""map":"verdict""#));
        let bytes = partial_transaction_json(&after, &before);
        let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
        assert_eq!(parsed, partial_transaction(&after, &before));
    }

    #[test]
    fn no_eligible_backend_counts_and_returns_to_the_refusal() {
        let mut d = Desired::new();
        let l = id("2001:db8::10", 53);
        d.insert(l, listener(&[], &["2001:db8::1"]));
        let t = text(&transaction(&d, &Owned::default()));
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
        let t = text(&transaction(&d, &Owned::default()));
        assert!(t.contains(r#"{"elem":[{"prefix":{"addr":"10.1.0.0","len":16}}],"family":"inet","name":"s_tcp_80_192.0.2.10""#), "{t}");
        assert!(t.contains(r#"{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"!=","right":"@s_tcp_80_192.0.2.10"}},{"counter":"d_tcp_80_192.0.2.10"},{"return":null}"#));
        assert!(
            !t.contains(r#""name":"masq4","table":"harvester_lb_nat"}}},{"add":{"element""#),
            "source_nat = none: no masquerade"
        );
    }

    #[test]
    fn what_is_gone_is_deleted_after_the_flushes() {
        let mut before = Desired::new();
        before.insert(
            id("192.0.2.10", 80),
            listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]),
        );
        before.insert(id("192.0.2.11", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
        let present = Owned::of(&before);
        let mut after = Desired::new();
        after.insert(id("192.0.2.10", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
        let doc = transaction(&after, &present);
        let cmds = doc["nftables"].as_array().unwrap();
        let deleted: Vec<String> = cmds
            .iter()
            .filter_map(|c| c.get("delete"))
            .map(|d| d.to_string())
            .collect();
        // The second listener's chain and two counters; the first
        // listener's second backend's counter.
        assert_eq!(deleted.len(), 4, "{deleted:?}");
        assert!(deleted.iter().any(|d| d.contains("l_tcp_80_192.0.2.11")));
        assert!(
            deleted
                .iter()
                .any(|d| d.contains("n_tcp_80_192.0.2.10_10.0.0.2"))
        );
        let first_delete = cmds.iter().position(|c| c.get("delete").is_some()).unwrap();
        let last_flush = cmds.iter().rposition(|c| c.get("flush").is_some()).unwrap();
        assert!(last_flush < first_delete);
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
}

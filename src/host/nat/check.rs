//! Checking the NAT tables against what this process wrote: the read-back
//! half of [`crate::host::owned`]'s rule for `inet harvester_lb_nat` and its
//! shards. Anyone with `CAP_NET_ADMIN` can delete a shard, `nft flush
//! ruleset`, flush a listener's chain or insert a rule at its top; each
//! of these breaks or hijacks tenants while memory says all is written.
//!
//! Two comparisons, both of the kernel's copy as `read_back` reads it over
//! netlink ([`Seen`], the rules' digests):
//!
//! 1. **The structure, from the desired state alone** ([`Expected::of`]):
//!    every table, base chain (its hook, priority, type and policy) and
//!    listener chain that must exist, every dispatch element (VIP .
//!    protocol . port to the listener's chain), refusal element and
//!    masquerade element, and nothing else of those kinds in our tables.
//! 2. **The rules of every chain**, against a digest of what the kernel
//!    listed right after this process wrote that chain: the kernel's own
//!    encoding of the rules, so no second model of it is needed (as
//!    [`crate::host::owned::Fingerprint`]). A write re-reads only the chains it
//!    wrote ([`Expected::carry`]), a flip only the flipped chains.
//!
//! What differs is a list of [`Difference`]s, each naming the table,
//! chain or element and the listeners it breaks ([`Scope`]): logged,
//! shown in `/status` until the repair, and repaired by a full resync.
//!
//! This module reads nothing itself: it compares (and says what it
//! found), so every branch is unit-tested without a kernel. Affinity sets
//! and counters are not
//! compared: the kernel changes them itself. Source-range sets and bucket
//! maps are only checked to exist through the rules that name them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;

use super::build::{
    MasqKey, TableObject, TableObjects, has_backend_chains, picks_up, source_nats_in_use,
};
use super::names::{
    Family, INPUT, OUTPUT, POSTROUTING, PREROUTING, Shard, backend_chain, family_of, listener_chain,
};
use super::read_back::{Head, Rules, Seen, TableSeen};
use super::{Desired, ListenerId};
use crate::config::SourceNat;

/// The base chains of table `t`: name and head, as `build::skeleton`
/// writes them.
fn base_chains(t: Shard) -> Vec<(&'static str, Head)> {
    let head = |hook, priority, kind: &str| Head {
        hook,
        priority,
        kind: kind.to_string(),
        policy: NF_ACCEPT,
    };
    let mut v = vec![
        (PREROUTING, head(0, -100, "nat")),
        (OUTPUT, head(3, -100, "nat")),
    ];
    if t == Shard::MAIN {
        v.push((POSTROUTING, head(4, 100, "nat")));
        v.push((INPUT, head(1, 0, "filter")));
    }
    v
}

const NF_ACCEPT: u32 = 1;

/// What the tables must hold, from the desired state written last, and
/// the digests of the chains' rules as read back after that write.
#[derive(Debug, Clone, Default)]
pub(super) struct Expected {
    tables: BTreeSet<Shard>,
    /// Every chain of each table but the base chains.
    chains: BTreeMap<Shard, BTreeSet<String>>,
    /// The listener a chain serves.
    owner: HashMap<String, ListenerId>,
    /// Each listener's dispatch element: the chain it goes to (in the
    /// listener's table); also its refusal element (in the main table).
    dispatch: HashMap<ListenerId, String>,
    /// The masquerade elements, each with a listener that needs it.
    masq: HashMap<MasqKey, ListenerId>,
    /// The `source_nat = "vip"` elements (sets `snat4`, `snat6`), alike.
    snat: HashMap<MasqKey, ListenerId>,
    /// The listeners whose mid-stream TCP segments are DNATed (sets
    /// `pickup4`, `pickup6` of their table; see `build::picks_up`).
    pickup: HashSet<ListenerId>,
    /// The rules of each chain (base chains included) as the kernel listed
    /// them after this process wrote it; a chain without one is taken as
    /// it is at the next check.
    pub(super) rules: HashMap<TableObject, Rules>,
}

impl Expected {
    /// The structure `desired` gives the tables (no rule digest yet).
    pub(super) fn of(desired: &Desired) -> Self {
        let objects = TableObjects::of(desired);
        let mut e = Expected {
            tables: objects.tables.clone(),
            ..Self::default()
        };
        for o in &objects.chains {
            e.chains.entry(o.shard).or_default().insert(o.name.clone());
        }
        for (id, l) in desired {
            e.owner.insert(listener_chain(id), *id);
            if has_backend_chains(l) {
                for &b in &l.members {
                    e.owner.insert(backend_chain(id, b), *id);
                }
            }
            e.dispatch.insert(*id, listener_chain(id));
            let nat = match l.source_nat {
                SourceNat::Masquerade => Some(&mut e.masq),
                SourceNat::Vip => Some(&mut e.snat),
                SourceNat::None => None,
            };
            if let Some(nat) = nat {
                for &b in &l.members {
                    nat.entry((id.0, b, id.1, l.backend_port)).or_insert(*id);
                }
            }
            if picks_up(id, l) {
                e.pickup.insert(*id);
            }
        }
        e
    }

    /// Whether nothing is forwarded: nothing to check.
    pub(super) fn is_empty(&self) -> bool {
        self.dispatch.is_empty()
    }

    /// Every chain the tables must hold, base chains included.
    fn all_chains(&self) -> impl Iterator<Item = TableObject> + '_ {
        self.tables.iter().flat_map(move |&t| {
            let bases = base_chains(t)
                .into_iter()
                .map(move |(name, _)| TableObject {
                    shard: t,
                    name: name.to_string(),
                });
            let own = self
                .chains
                .get(&t)
                .into_iter()
                .flatten()
                .map(move |n| TableObject {
                    shard: t,
                    name: n.clone(),
                });
            bases.chain(own)
        })
    }

    /// After a write that took the tables from `before` (known to be in
    /// the kernel, with `old` its check's memory) to `desired` (`self`):
    /// keeps the digests of the chains the write did not touch, and
    /// returns the chains it rewrote, to read back. `None` for `before` or
    /// `old`: everything was written, everything is read.
    pub(super) fn carry(
        &mut self,
        desired: &Desired,
        before: Option<&Desired>,
        old: Option<&Expected>,
    ) -> Option<Vec<TableObject>> {
        let (before, old) = (before?, old?);
        let mut rewritten = Vec::new();
        for chain in self.all_chains().collect::<Vec<_>>() {
            let touched = if base_chains(chain.shard)
                .iter()
                .any(|(n, _)| *n == chain.name)
            {
                // A table's base chains are written when it is new; the
                // main table's `postrouting` also when the source NATs in
                // use change (`build::source_nat_rules`).
                !old.tables.contains(&chain.shard)
                    || (chain.shard == Shard::MAIN
                        && chain.name == POSTROUTING
                        && source_nats_in_use(before) != source_nats_in_use(desired))
            } else {
                self.owner
                    .get(&chain.name)
                    .is_none_or(|id| before.get(id) != desired.get(id))
            };
            match old.rules.get(&chain) {
                Some(r) if !touched => {
                    self.rules.insert(chain, *r);
                }
                _ => rewritten.push(chain),
            }
        }
        Some(rewritten)
    }

    /// Which listeners a difference in chain `name` of table `t` breaks.
    fn chain_scope(&self, t: Shard, name: &str) -> Scope {
        match name {
            INPUT | POSTROUTING if t == Shard::MAIN => Scope::All,
            PREROUTING | OUTPUT => Scope::Shard(t),
            _ => self
                .owner
                .get(name)
                .map_or(Scope::Nothing, |id| Scope::Listener(*id)),
        }
    }
}

/// Which listeners a [`Difference`] breaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum Scope {
    /// Every one (the main table's refusal or masquerade).
    All,
    /// Those of one table.
    Shard(Shard),
    /// One.
    Listener(ListenerId),
    /// None: something that is not ours is there.
    Nothing,
}

/// One way the kernel's tables differ from what this process wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Difference {
    /// The listeners it breaks.
    pub scope: Scope,
    /// Written and gone (`true`), or there and not written as it is.
    pub missing: bool,
    /// The table, chain or element, named as `nft` names it.
    pub what: String,
}

/// The differences a check found, for the log: the first few of each side.
pub(super) struct Differences<'a>(pub &'a [Difference]);

impl fmt::Display for Differences<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (missing, other): (Vec<_>, Vec<_>) = self.0.iter().partition(|d| d.missing);
        let drift = crate::host::owned::Drift::Changed {
            missing: missing.into_iter().map(|d| d.what.clone()).collect(),
            unexpected: other.into_iter().map(|d| d.what.clone()).collect(),
        };
        drift.fmt(f)
    }
}

/// What [`compare`] found.
#[derive(Debug, Default)]
pub(super) struct Compared {
    /// Every difference, tables first.
    pub differences: Vec<Difference>,
    /// Chains present as expected that had no digest yet: theirs now.
    pub adopt: Vec<(TableObject, Rules)>,
    /// Chains in our tables that are not ours: the repair deletes them.
    pub foreign: Vec<TableObject>,
}

impl Compared {
    /// One difference more, after those found before it.
    fn differ(&mut self, scope: Scope, missing: bool, what: String) {
        self.differences.push(Difference {
            scope,
            missing,
            what,
        });
    }
}

/// The differences between what the tables must hold and what the kernel
/// has. A table that is gone counts once (not each thing it held).
pub(super) fn compare(e: &Expected, seen: &Seen) -> Compared {
    let mut out = Compared::default();
    for (&t, _) in seen.iter().filter(|(t, _)| !e.tables.contains(t)) {
        out.differ(Scope::Nothing, false, format!("table inet {}", t.table()));
    }
    for &t in &e.tables {
        let table_scope = if t == Shard::MAIN {
            Scope::All
        } else {
            Scope::Shard(t)
        };
        let Some(have) = seen.get(&t) else {
            out.differ(table_scope, true, format!("table inet {}", t.table()));
            continue;
        };
        compare_chains(e, t, table_scope, have, &mut out);
        compare_elements(e, t, have, &mut out);
    }
    for (id, chain) in &e.dispatch {
        let t = Shard::of(id);
        if let Some(have) = seen.get(&t)
            && have.dispatch.get(id) != Some(chain)
        {
            out.differ(
                Scope::Listener(*id),
                true,
                format!(
                    "element {} : goto {chain} of {}",
                    key_text(id),
                    dispatch_map(t, id)
                ),
            );
        }
        if let Some(main) = seen.get(&Shard::MAIN)
            && !main.refuse.contains(id)
        {
            out.differ(
                Scope::Listener(*id),
                true,
                format!("element {} of {}", key_text(id), refuse_set(id)),
            );
        }
    }
    out
}

/// [`compare`] of one table's chains: the base chains' heads, ours
/// present, foreign ones found, and each chain's rules against their digest.
fn compare_chains(
    e: &Expected,
    t: Shard,
    table_scope: Scope,
    have: &TableSeen,
    out: &mut Compared,
) {
    let name = t.table();
    let bases = base_chains(t);
    let own = e.chains.get(&t);
    for (chain, head) in &bases {
        match have.chains.get(*chain) {
            None => out.differ(
                e.chain_scope(t, chain),
                true,
                format!("chain inet {name} {chain}"),
            ),
            Some((h, _)) if h.as_ref() != Some(head) => out.differ(
                e.chain_scope(t, chain),
                false,
                format!("chain inet {name} {chain}: its hook, priority, type or policy"),
            ),
            Some(_) => {}
        }
    }
    for chain in own.into_iter().flatten() {
        if !have.chains.contains_key(chain) {
            out.differ(
                e.chain_scope(t, chain),
                true,
                format!("chain inet {name} {chain}"),
            );
        }
    }
    for (chain, (head, rules)) in &have.chains {
        let ours = bases.iter().any(|(n, _)| n == chain) || own.is_some_and(|c| c.contains(chain));
        if !ours {
            // A foreign base chain in our table sees our packets.
            let scope = if head.is_some() {
                table_scope
            } else {
                Scope::Nothing
            };
            out.differ(scope, false, format!("chain inet {name} {chain}"));
            out.foreign.push(TableObject {
                shard: t,
                name: chain.clone(),
            });
            continue;
        }
        let obj = TableObject {
            shard: t,
            name: chain.clone(),
        };
        match e.rules.get(&obj) {
            Some(written) if written != rules => out.differ(
                e.chain_scope(t, chain),
                false,
                format!(
                    "the rules of chain inet {name} {chain} ({} written, {} now)",
                    written.count, rules.count
                ),
            ),
            Some(_) => {}
            None => out.adopt.push((obj, *rules)),
        }
    }
}

/// [`compare`] of one table's set and map elements: odd sets, the
/// dispatch map, and in the main table the refuse and masquerade sets,
/// then the pickup set.
fn compare_elements(e: &Expected, t: Shard, have: &TableSeen, out: &mut Compared) {
    let name = t.table();
    for (set, n) in &have.odd {
        out.differ(
            Scope::Nothing,
            false,
            format!("{n} elements of set inet {name} {set}"),
        );
    }
    for (id, chain) in &have.dispatch {
        if Shard::of(id) != t || e.dispatch.get(id) != Some(chain) {
            out.differ(
                Scope::Nothing,
                false,
                format!(
                    "element {} : goto {chain} of {}",
                    key_text(id),
                    dispatch_map(t, id)
                ),
            );
        }
    }
    if t == Shard::MAIN {
        for id in have.refuse.iter().filter(|id| !e.dispatch.contains_key(id)) {
            out.differ(
                Scope::Nothing,
                false,
                format!("element {} of {}", key_text(id), refuse_set(id)),
            );
        }
        let masq: fn(&Family) -> &'static str = |f| f.masq;
        let snat: fn(&Family) -> &'static str = |f| f.snat;
        for (set, have, want) in [(masq, &have.masq, &e.masq), (snat, &have.snat, &e.snat)] {
            for m in have.iter().filter(|m| !want.contains_key(m)) {
                out.differ(Scope::Nothing, false, masq_text(set, m));
            }
            for (m, id) in want.iter().filter(|(m, _)| !have.contains(m)) {
                out.differ(Scope::Listener(*id), true, masq_text(set, m));
            }
        }
    }
    let pickup_set = |id: &ListenerId| format!("set inet {name} {}", family_of(id.0).pickup);
    for id in have
        .pickup
        .iter()
        .filter(|id| Shard::of(id) != t || !e.pickup.contains(id))
    {
        out.differ(
            Scope::Nothing,
            false,
            format!("element {} of {}", key_text(id), pickup_set(id)),
        );
    }
    for id in e
        .pickup
        .iter()
        .filter(|id| Shard::of(id) == t && !have.pickup.contains(id))
    {
        out.differ(
            Scope::Listener(*id),
            true,
            format!("element {} of {}", key_text(id), pickup_set(id)),
        );
    }
}

fn dispatch_map(t: Shard, id: &ListenerId) -> String {
    format!("map inet {} {}", t.table(), family_of(id.0).dispatch)
}

fn refuse_set(id: &ListenerId) -> String {
    format!(
        "set inet {} {}",
        Shard::MAIN.table(),
        family_of(id.0).refuse
    )
}

fn key_text((vip, protocol, port): &ListenerId) -> String {
    format!("{vip} . {} . {port}", protocol.as_str())
}

/// An element of the source NAT set `set` of its family (the masquerade,
/// or the SNAT to the VIP).
fn masq_text(set: fn(&Family) -> &'static str, (vip, backend, protocol, port): &MasqKey) -> String {
    format!(
        "element {vip} . {backend} . {} . {port} of set inet {} {}",
        protocol.as_str(),
        Shard::MAIN.table(),
        set(family_of(*vip))
    )
}

/// The listeners a check found not as written, and why; what `/status`
/// says of them until the repair's write.
#[derive(Debug, Default, Clone)]
pub(super) struct Impaired {
    all: Option<String>,
    shards: HashMap<Shard, String>,
    listeners: HashMap<ListenerId, String>,
}

impl Impaired {
    /// The listeners `differences` break, each with the first difference
    /// that does.
    pub(super) fn of(differences: &[Difference]) -> Self {
        let mut i = Self::default();
        for d in differences {
            let said = || {
                let how = if d.missing {
                    "is gone"
                } else {
                    "is not as written"
                };
                format!("{} {how}", d.what)
            };
            match d.scope {
                Scope::All => {
                    i.all.get_or_insert_with(said);
                }
                Scope::Shard(t) => {
                    i.shards.entry(t).or_insert_with(said);
                }
                Scope::Listener(id) => {
                    i.listeners.entry(id).or_insert_with(said);
                }
                Scope::Nothing => {}
            }
        }
        i
    }

    /// Why listener `id` is not forwarded as written; `None`: it is.
    pub(super) fn reason(&self, id: &ListenerId) -> Option<&str> {
        self.all
            .as_deref()
            .or_else(|| self.shards.get(&Shard::of(id)).map(String::as_str))
            .or_else(|| self.listeners.get(id).map(String::as_str))
    }

    /// Whether every listener is as written.
    pub(super) fn is_empty(&self) -> bool {
        self.all.is_none() && self.shards.is_empty() && self.listeners.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Algorithm, Protocol};
    use std::net::IpAddr;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn listener() -> super::super::KernelListener {
        let both = ["10.0.0.1", "10.0.0.2"];
        super::super::test_listener(&both, &both)
    }

    /// Listeners on ports `ports` of one VIP.
    fn desired(ports: &[u16]) -> Desired {
        ports
            .iter()
            .map(|&p| ((ip("192.0.2.10"), Protocol::Tcp, p), listener()))
            .collect()
    }

    /// The tables exactly as `e` wants them, each chain with one rule of
    /// digest 7.
    fn as_written(e: &Expected) -> Seen {
        let mut seen = Seen::new();
        for o in e.all_chains() {
            let head = base_chains(o.shard)
                .into_iter()
                .find(|(n, _)| *n == o.name)
                .map(|(_, h)| h);
            let rules = e.rules.get(&o).copied().unwrap_or(Rules {
                count: 1,
                digest: 7,
            });
            seen.entry(o.shard)
                .or_default()
                .chains
                .insert(o.name, (head, rules));
        }
        for (id, chain) in &e.dispatch {
            seen.entry(Shard::of(id))
                .or_default()
                .dispatch
                .insert(*id, chain.clone());
            seen.entry(Shard::MAIN).or_default().refuse.insert(*id);
        }
        for m in e.masq.keys() {
            seen.entry(Shard::MAIN).or_default().masq.insert(*m);
        }
        for m in e.snat.keys() {
            seen.entry(Shard::MAIN).or_default().snat.insert(*m);
        }
        for id in &e.pickup {
            seen.entry(Shard::of(id)).or_default().pickup.insert(*id);
        }
        seen
    }

    /// `Expected` for `d` with every chain's digest taken from `seen`.
    fn written(d: &Desired) -> (Expected, Seen) {
        let mut e = Expected::of(d);
        let seen = as_written(&e);
        let adopted = compare(&e, &seen);
        assert!(adopted.differences.is_empty(), "{:?}", adopted.differences);
        e.rules.extend(adopted.adopt);
        (e, seen)
    }

    /// The shard of a port's listener other than the main one.
    fn port_in_a_shard() -> u16 {
        (1..)
            .find(|&p| Shard::of(&(ip("192.0.2.10"), Protocol::Tcp, p)) != Shard::MAIN)
            .unwrap()
    }

    #[test]
    fn tables_as_written_differ_in_nothing_and_every_chain_gets_a_digest() {
        let (e, seen) = written(&desired(&[80, 443, port_in_a_shard()]));
        let again = compare(&e, &seen);
        assert!(again.differences.is_empty());
        assert!(again.adopt.is_empty(), "all adopted the first time");
        assert_eq!(e.rules.len(), e.all_chains().count());
    }

    #[test]
    fn a_shard_gone_breaks_its_listeners_only_and_is_named() {
        let p = port_in_a_shard();
        let d = desired(&[p]);
        let id = (ip("192.0.2.10"), Protocol::Tcp, p);
        let (e, mut seen) = written(&d);
        seen.remove(&Shard::of(&id));
        let found = compare(&e, &seen).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].scope, Scope::Shard(Shard::of(&id)));
        assert!(found[0].missing);
        assert_eq!(
            found[0].what,
            format!("table inet {}", Shard::of(&id).table())
        );
        let impaired = Impaired::of(&found);
        assert!(impaired.reason(&id).unwrap().contains("is gone"));
        let elsewhere = (ip("192.0.2.10"), Protocol::Tcp, 80);
        if Shard::of(&elsewhere) != Shard::of(&id) {
            assert_eq!(impaired.reason(&elsewhere), None);
        }
    }

    #[test]
    fn everything_gone_is_the_tables_not_each_object() {
        let (e, _) = written(&desired(&[80, 443, port_in_a_shard()]));
        let found = compare(&e, &Seen::new()).differences;
        assert_eq!(found.len(), e.tables.len(), "{found:?}");
        let impaired = Impaired::of(&found);
        assert!(
            impaired
                .reason(&(ip("192.0.2.10"), Protocol::Tcp, 80))
                .is_some()
        );
    }

    #[test]
    fn a_rule_added_or_a_chain_flushed_is_a_change_of_that_listeners_chain() {
        let d = desired(&[80, 443]);
        let id = (ip("192.0.2.10"), Protocol::Tcp, 80);
        let (e, seen) = written(&d);
        let chain = listener_chain(&id);
        for now in [
            Rules {
                count: 2,
                digest: 9,
            },
            Rules::default(),
        ] {
            let mut tampered = seen.clone();
            tampered
                .get_mut(&Shard::of(&id))
                .unwrap()
                .chains
                .get_mut(&chain)
                .unwrap()
                .1 = now;
            let found = compare(&e, &tampered).differences;
            assert_eq!(found.len(), 1, "{found:?}");
            assert_eq!(found[0].scope, Scope::Listener(id));
            assert!(found[0].what.contains(&chain), "{}", found[0].what);
            let other = (ip("192.0.2.10"), Protocol::Tcp, 443);
            assert_eq!(Impaired::of(&found).reason(&other), None);
        }
    }

    #[test]
    fn the_input_chain_gone_or_its_policy_changed_breaks_every_listener() {
        let (e, seen) = written(&desired(&[80, port_in_a_shard()]));
        let mut gone = seen.clone();
        gone.get_mut(&Shard::MAIN).unwrap().chains.remove("input");
        let found = compare(&e, &gone).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].scope, Scope::All);
        assert_eq!(found[0].what, "chain inet harvester_lb_nat input");
        let mut dropping = seen;
        let input = dropping
            .get_mut(&Shard::MAIN)
            .unwrap()
            .chains
            .get_mut("input")
            .unwrap();
        input.0.as_mut().unwrap().policy = 0;
        let found = compare(&e, &dropping).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(!found[0].missing);
    }

    #[test]
    fn elements_missing_or_foreign_are_differences() {
        let d = desired(&[80, 443]);
        let id = (ip("192.0.2.10"), Protocol::Tcp, 80);
        let (e, seen) = written(&d);
        let mut missing = seen.clone();
        missing
            .get_mut(&Shard::of(&id))
            .unwrap()
            .dispatch
            .remove(&id);
        let found = compare(&e, &missing).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].scope, Scope::Listener(id));
        assert!(found[0].what.contains("dispatch4"), "{}", found[0].what);
        // Another chain for the element: gone as written, and not ours.
        let mut hijacked = seen.clone();
        let t = hijacked.get_mut(&Shard::of(&id)).unwrap();
        t.dispatch.insert(id, "evil".into());
        let found = compare(&e, &hijacked).differences;
        assert_eq!(found.len(), 2, "{found:?}");
        // A foreign VIP's element in a map and a foreign base chain.
        let mut foreign = seen.clone();
        let foreign_id = (ip("192.0.2.99"), Protocol::Tcp, 22);
        let main = foreign.get_mut(&Shard::MAIN).unwrap();
        main.refuse.insert(foreign_id);
        main.chains.insert(
            "sneak".into(),
            (Some(base_chains(Shard::MAIN).remove(0).1), Rules::default()),
        );
        let found = compare(&e, &foreign).differences;
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(
            found
                .iter()
                .any(|f| f.scope == Scope::All && f.what.ends_with("sneak"))
        );
        let mut masq = seen;
        let main = masq.get_mut(&Shard::MAIN).unwrap();
        let one = *main.masq.iter().next().unwrap();
        main.masq.remove(&one);
        let found = compare(&e, &masq).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(found[0].missing && found[0].what.contains("masq4"));
    }

    #[test]
    fn pickup_and_snat_elements_missing_or_foreign_are_differences() {
        let mut d = desired(&[80, 443]);
        let id = (ip("192.0.2.10"), Protocol::Tcp, 80);
        let l = d.get_mut(&id).unwrap();
        l.pick = Algorithm::FlowHash;
        l.source_nat = SourceNat::Vip;
        let (e, seen) = written(&d);
        assert!(seen[&Shard::of(&id)].pickup.contains(&id));
        // The pickup element gone: that listener's mid-stream flows.
        let mut gone = seen.clone();
        gone.get_mut(&Shard::of(&id)).unwrap().pickup.remove(&id);
        let found = compare(&e, &gone).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert_eq!(found[0].scope, Scope::Listener(id));
        assert!(
            found[0].missing && found[0].what.contains("pickup4"),
            "{found:?}"
        );
        // One for a round-robin listener, added by someone else.
        let other = (ip("192.0.2.10"), Protocol::Tcp, 443);
        let mut added = seen.clone();
        added
            .entry(Shard::of(&other))
            .or_default()
            .pickup
            .insert(other);
        let found = compare(&e, &added).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            !found[0].missing && found[0].what.contains("pickup4"),
            "{found:?}"
        );
        // An SNAT element gone.
        let mut snat = seen;
        let main = snat.get_mut(&Shard::MAIN).unwrap();
        let one = *main.snat.iter().next().unwrap();
        main.snat.remove(&one);
        let found = compare(&e, &snat).differences;
        assert_eq!(found.len(), 1, "{found:?}");
        assert!(
            found[0].missing && found[0].what.contains("of set inet harvester_lb_nat snat4"),
            "{found:?}"
        );
    }

    #[test]
    fn a_write_rereads_only_the_chains_it_rewrote() {
        let before = desired(&[80, 443]);
        let (old, _) = written(&before);
        let mut after = before.clone();
        let id = (ip("192.0.2.10"), Protocol::Tcp, 443);
        after.get_mut(&id).unwrap().eligible.pop();
        let mut e = Expected::of(&after);
        let reread = e.carry(&after, Some(&before), Some(&old)).unwrap();
        assert_eq!(
            reread,
            vec![TableObject {
                shard: Shard::of(&id),
                name: listener_chain(&id)
            }]
        );
        assert_eq!(e.rules.len(), old.rules.len() - 1);
        // Unknown before: everything.
        assert_eq!(Expected::of(&after).carry(&after, None, Some(&old)), None);
        // A listener in a new table: that table's base chains too.
        let p = port_in_a_shard();
        let mut grown = before.clone();
        grown.insert((ip("192.0.2.10"), Protocol::Tcp, p), listener());
        let mut e = Expected::of(&grown);
        let reread = e.carry(&grown, Some(&before), Some(&old)).unwrap();
        let new_table = Shard::of(&(ip("192.0.2.10"), Protocol::Tcp, p));
        if !old.tables.contains(&new_table) {
            assert!(
                reread
                    .iter()
                    .any(|o| o.shard == new_table && o.name == "prerouting")
            );
        }
    }
}

//! Checking the NAT tables against what this process wrote: the read-back
//! half of [`crate::owned`]'s rule for `inet harvester_lb_nat` and its
//! shards. Anyone with `CAP_NET_ADMIN` can delete a shard, `nft flush
//! ruleset`, flush a listener's chain or insert a rule at its top; each
//! of these breaks or hijacks tenants while memory says all is written.
//!
//! Two comparisons, both of the kernel's copy read back over netlink:
//!
//! 1. **The structure, from the desired state alone** ([`Expected::of`]):
//!    every table, base chain (its hook, priority, type and policy) and
//!    listener chain that must exist, every dispatch element (VIP .
//!    protocol . port to the listener's chain), refusal element and
//!    masquerade element, and nothing else of those kinds in our tables.
//! 2. **The rules of every chain**, against a digest of what the kernel
//!    listed right after this process wrote that chain: the kernel's own
//!    encoding of the rules, so no second model of it is needed (as
//!    [`crate::owned::Fingerprint`]). A write re-reads only the chains it
//!    wrote ([`Expected::carry`]), a flip only the flipped chains.
//!
//! What differs is a list of [`Difference`]s, each naming the table,
//! chain or element and the listeners it breaks ([`Scope`]): logged,
//! shown in `/status` until the repair, and repaired by a full resync.
//!
//! Why netlink and not `nft -j list`: nft 1.0.6 fetches its cache of the
//! whole ruleset first (2.75 s at 10,000 listeners, see `netlink`); the
//! dumps here read only our tables. Affinity sets and counters are not
//! compared: the kernel changes them itself. Source-range sets and bucket
//! maps are only checked to exist through the rules that name them.

use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::fmt;
use std::hash::{DefaultHasher, Hasher};
use std::io;
use std::net::IpAddr;

use netlink_sys::Socket;

use super::build::{Obj, Owned, has_backend_chains, picks_up, source_nats_in_use};
use super::netlink::{Attrs, KeptSocket, attributes, dump, messages};
use super::nft::NftError;
use super::{Desired, ListenerId, Shard, backend_chain, listener_chain};
use crate::config::{Protocol, SourceNat};

/// `VIP . backend . protocol . nodeport`: one masquerade element.
pub(super) type MasqKey = (IpAddr, IpAddr, Protocol, u16);

/// A chain's rules, as the kernel lists them: how many, and a digest of
/// their expressions in order (handles and positions left out).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub(super) struct Rules {
    /// How many rules.
    pub count: usize,
    /// The expressions of each rule, in the chain's order.
    pub digest: u64,
}

/// A base chain's head: what decides which packets it sees and what
/// becomes of those it does not take.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(super) struct Head {
    /// The netfilter hook number (`NF_INET_*`).
    pub hook: u32,
    /// Its priority.
    pub priority: i32,
    /// `nat` or `filter`.
    pub kind: String,
    /// The verdict of what no rule took (`NF_ACCEPT` = 1).
    pub policy: u32,
}

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
        ("prerouting", head(0, -100, "nat")),
        ("output", head(3, -100, "nat")),
    ];
    if t == Shard::MAIN {
        v.push(("postrouting", head(4, 100, "nat")));
        v.push(("input", head(1, 0, "filter")));
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
    pub(super) rules: HashMap<Obj, Rules>,
}

impl Expected {
    /// The structure `desired` gives the tables (no rule digest yet).
    pub(super) fn of(desired: &Desired) -> Self {
        let owned = Owned::of(desired);
        let mut e = Expected {
            tables: owned.tables.clone(),
            ..Self::default()
        };
        for o in &owned.chains {
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
    fn all_chains(&self) -> impl Iterator<Item = Obj> + '_ {
        self.tables.iter().flat_map(move |&t| {
            let bases = base_chains(t).into_iter().map(move |(name, _)| Obj {
                shard: t,
                name: name.to_string(),
            });
            let own = self.chains.get(&t).into_iter().flatten().map(move |n| Obj {
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
    ) -> Option<Vec<Obj>> {
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
                        && chain.name == "postrouting"
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
            "input" | "postrouting" if t == Shard::MAIN => Scope::All,
            "prerouting" | "output" => Scope::Shard(t),
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
        let drift = crate::owned::Drift::Changed {
            missing: missing.into_iter().map(|d| d.what.clone()).collect(),
            unexpected: other.into_iter().map(|d| d.what.clone()).collect(),
        };
        drift.fmt(f)
    }
}

/// What a read-back found in one of our tables.
#[derive(Debug, Default, Clone)]
pub(super) struct TableSeen {
    /// Every chain, with its head if it is a base chain, and its rules.
    pub chains: BTreeMap<String, (Option<Head>, Rules)>,
    /// The dispatch maps' elements: listener to the chain it goes to.
    pub dispatch: HashMap<ListenerId, String>,
    /// The refusal sets' elements (the main table).
    pub refuse: HashSet<ListenerId>,
    /// The masquerade sets' elements (the main table).
    pub masq: HashSet<MasqKey>,
    /// The `source_nat = "vip"` sets' elements (the main table).
    pub snat: HashSet<MasqKey>,
    /// The pickup sets' elements.
    pub pickup: HashSet<ListenerId>,
    /// Elements of those maps and sets of a shape this daemon never
    /// writes, by set.
    pub odd: BTreeMap<String, usize>,
}

/// Our tables as read back.
pub(super) type Seen = BTreeMap<Shard, TableSeen>;

/// What [`compare`] found.
#[derive(Debug, Default)]
pub(super) struct Compared {
    /// Every difference, tables first.
    pub differences: Vec<Difference>,
    /// Chains present as expected that had no digest yet: theirs now.
    pub adopt: Vec<(Obj, Rules)>,
    /// Chains in our tables that are not ours: the repair deletes them.
    pub foreign: Vec<Obj>,
}

/// The differences between what the tables must hold and what the kernel
/// has. A table that is gone counts once (not each thing it held).
pub(super) fn compare(e: &Expected, seen: &Seen) -> Compared {
    let mut out = Compared::default();
    let mut differ = |scope, missing, what: String| {
        out.differences.push(Difference {
            scope,
            missing,
            what,
        })
    };
    for (&t, _) in seen.iter().filter(|(t, _)| !e.tables.contains(t)) {
        differ(Scope::Nothing, false, format!("table inet {}", t.table()));
    }
    let mut adopt = Vec::new();
    let mut foreign = Vec::new();
    for &t in &e.tables {
        let name = t.table();
        let table_scope = if t == Shard::MAIN {
            Scope::All
        } else {
            Scope::Shard(t)
        };
        let Some(have) = seen.get(&t) else {
            differ(table_scope, true, format!("table inet {name}"));
            continue;
        };
        let bases = base_chains(t);
        let own = e.chains.get(&t);
        for (chain, head) in &bases {
            match have.chains.get(*chain) {
                None => differ(
                    e.chain_scope(t, chain),
                    true,
                    format!("chain inet {name} {chain}"),
                ),
                Some((h, _)) if h.as_ref() != Some(head) => differ(
                    e.chain_scope(t, chain),
                    false,
                    format!("chain inet {name} {chain}: its hook, priority, type or policy"),
                ),
                Some(_) => {}
            }
        }
        for chain in own.into_iter().flatten() {
            if !have.chains.contains_key(chain) {
                differ(
                    e.chain_scope(t, chain),
                    true,
                    format!("chain inet {name} {chain}"),
                );
            }
        }
        for (chain, (head, rules)) in &have.chains {
            let ours =
                bases.iter().any(|(n, _)| n == chain) || own.is_some_and(|c| c.contains(chain));
            if !ours {
                // A foreign base chain in our table sees our packets.
                let scope = if head.is_some() {
                    table_scope
                } else {
                    Scope::Nothing
                };
                differ(scope, false, format!("chain inet {name} {chain}"));
                foreign.push(Obj {
                    shard: t,
                    name: chain.clone(),
                });
                continue;
            }
            let obj = Obj {
                shard: t,
                name: chain.clone(),
            };
            match e.rules.get(&obj) {
                Some(written) if written != rules => differ(
                    e.chain_scope(t, chain),
                    false,
                    format!(
                        "the rules of chain inet {name} {chain} ({} written, {} now)",
                        written.count, rules.count
                    ),
                ),
                Some(_) => {}
                None => adopt.push((obj, *rules)),
            }
        }
        for (set, n) in &have.odd {
            differ(
                Scope::Nothing,
                false,
                format!("{n} elements of set inet {name} {set}"),
            );
        }
        for (id, chain) in &have.dispatch {
            if Shard::of(id) != t || e.dispatch.get(id) != Some(chain) {
                differ(
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
                differ(
                    Scope::Nothing,
                    false,
                    format!("element {} of {}", key_text(id), refuse_set(id)),
                );
            }
            for (set, have, want) in [("masq", &have.masq, &e.masq), ("snat", &have.snat, &e.snat)]
            {
                for m in have.iter().filter(|m| !want.contains_key(m)) {
                    differ(Scope::Nothing, false, masq_text(set, m));
                }
                for (m, id) in want.iter().filter(|(m, _)| !have.contains(m)) {
                    differ(Scope::Listener(*id), true, masq_text(set, m));
                }
            }
        }
        let pickup_set = |id: &ListenerId| format!("set inet {name} pickup{}", family(id.0));
        for id in have
            .pickup
            .iter()
            .filter(|id| Shard::of(id) != t || !e.pickup.contains(id))
        {
            differ(
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
            differ(
                Scope::Listener(*id),
                true,
                format!("element {} of {}", key_text(id), pickup_set(id)),
            );
        }
    }
    for (id, chain) in &e.dispatch {
        let t = Shard::of(id);
        if let Some(have) = seen.get(&t)
            && have.dispatch.get(id) != Some(chain)
        {
            differ(
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
            differ(
                Scope::Listener(*id),
                true,
                format!("element {} of {}", key_text(id), refuse_set(id)),
            );
        }
    }
    out.adopt = adopt;
    out.foreign = foreign;
    out
}

fn family(ip: IpAddr) -> char {
    if ip.is_ipv4() { '4' } else { '6' }
}

fn dispatch_map(t: Shard, id: &ListenerId) -> String {
    format!("map inet {} dispatch{}", t.table(), family(id.0))
}

fn refuse_set(id: &ListenerId) -> String {
    format!("set inet {} refuse{}", Shard::MAIN.table(), family(id.0))
}

fn key_text((vip, protocol, port): &ListenerId) -> String {
    format!("{vip} . {} . {port}", protocol.as_str())
}

/// An element of the source NAT set `set` (`masq`, `snat`).
fn masq_text(set: &str, (vip, backend, protocol, port): &MasqKey) -> String {
    format!(
        "element {vip} . {backend} . {} . {port} of set inet {} {set}{}",
        protocol.as_str(),
        Shard::MAIN.table(),
        family(*vip)
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

// --- The read-back over netlink. ---

const NFNL_SUBSYS_NFTABLES: u16 = 10;
const NFT_MSG_NEWTABLE: u16 = 0;
const NFT_MSG_GETTABLE: u16 = 1;
const NFT_MSG_NEWCHAIN: u16 = 3;
const NFT_MSG_GETCHAIN: u16 = 4;
const NFT_MSG_NEWRULE: u16 = 6;
const NFT_MSG_GETRULE: u16 = 7;
const NFT_MSG_NEWSETELEM: u16 = 12;
const NFT_MSG_GETSETELEM: u16 = 13;
const NFTA_TABLE_NAME: u16 = 1;
const NFTA_CHAIN_TABLE: u16 = 1;
const NFTA_CHAIN_NAME: u16 = 3;
const NFTA_CHAIN_HOOK: u16 = 4;
const NFTA_CHAIN_POLICY: u16 = 5;
const NFTA_CHAIN_TYPE: u16 = 7;
const NFTA_HOOK_HOOKNUM: u16 = 1;
const NFTA_HOOK_PRIORITY: u16 = 2;
const NFTA_RULE_TABLE: u16 = 1;
const NFTA_RULE_CHAIN: u16 = 2;
const NFTA_RULE_EXPRESSIONS: u16 = 4;
const NFTA_RULE_USERDATA: u16 = 7;
const NFTA_SET_ELEM_LIST_TABLE: u16 = 1;
const NFTA_SET_ELEM_LIST_SET: u16 = 2;
const NFTA_SET_ELEM_LIST_ELEMENTS: u16 = 3;
const NFTA_SET_ELEM_KEY: u16 = 1;
const NFTA_SET_ELEM_DATA: u16 = 2;
const NFTA_DATA_VALUE: u16 = 1;
const NFTA_DATA_VERDICT: u16 = 2;
const NFTA_VERDICT_CHAIN: u16 = 2;

fn read_error(e: io::Error) -> NftError {
    NftError::new("read back", format!("over netlink: {e}"))
}

/// A string attribute's text (up to its NUL).
fn text(value: &[u8]) -> String {
    let end = value.iter().position(|&c| c == 0).unwrap_or(value.len());
    String::from_utf8_lossy(&value[..end]).into_owned()
}

fn be32(value: &[u8]) -> Option<u32> {
    Some(u32::from_be_bytes(value.get(..4)?.try_into().ok()?))
}

const NFT_MSG_NEWGEN: u16 = 15;
const NFT_MSG_GETGEN: u16 = 16;
const NFTA_GEN_ID: u16 = 1;
const NLMSG_ERROR: u16 = 2;

/// The ruleset's generation: nf_tables changes it at every commit, of any
/// table by anyone, so while it stays the tables are as last read.
pub(super) fn generation(socket: &KeptSocket) -> Result<u32, NftError> {
    socket
        .with(|s| {
            // A lost answer must not hold the check for ever.
            socket2::SockRef::from(s).set_read_timeout(Some(std::time::Duration::from_secs(5)))?;
            let mut msg = Vec::with_capacity(20);
            msg.extend_from_slice(&20u32.to_ne_bytes());
            msg.extend_from_slice(&(NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_GETGEN).to_ne_bytes());
            msg.extend_from_slice(&1u16.to_ne_bytes()); // NLM_F_REQUEST
            msg.extend_from_slice(&2u32.to_ne_bytes()); // sequence
            msg.extend_from_slice(&0u32.to_ne_bytes()); // port id: the kernel's
            msg.extend_from_slice(&[0, 0, 0, 0]); // nfgenmsg: AF_UNSPEC
            s.send(&msg, 0)?;
            let mut buf = vec![0u8; 4096];
            for _ in 0..8 {
                let size = s.recv(&mut &mut buf[..], 0)?;
                for message in messages(&buf[..size]) {
                    let (kind, body) = message?;
                    if kind == NFNL_SUBSYS_NFTABLES << 8 | NFT_MSG_NEWGEN && body.len() >= 4 {
                        if let Some(id) = attributes(&body[4..])
                            .find(|(k, _)| *k == NFTA_GEN_ID)
                            .and_then(|(_, v)| be32(v))
                        {
                            return Ok(id);
                        }
                    } else if kind == NLMSG_ERROR && body.len() >= 4 {
                        let code = i32::from_ne_bytes(body[..4].try_into().expect("4 bytes"));
                        if code != 0 {
                            return Err(io::Error::from_raw_os_error(-code));
                        }
                    }
                }
            }
            Err(io::Error::other("no generation in nf_tables' answer"))
        })
        .map_err(read_error)
}

/// Our tables present now.
fn our_tables(socket: &Socket) -> io::Result<Vec<Shard>> {
    let mut tables = Vec::new();
    dump(
        socket,
        NFT_MSG_GETTABLE,
        &Attrs::default(),
        NFT_MSG_NEWTABLE,
        |body| {
            if let Some((_, v)) = attributes(body).find(|(k, _)| *k == NFTA_TABLE_NAME) {
                tables.extend(Shard::from_table(&text(v)));
            }
        },
    )?;
    Ok(tables)
}

/// Our tables whole, as the checks compare them: every chain with its
/// rules, the dispatch, refusal and masquerade elements.
/// `socket`: the owner's, kept open (see [`KeptSocket`]) in the network
/// namespace of its tables.
pub(super) fn read_seen(socket: &KeptSocket) -> Result<Seen, NftError> {
    socket.with(seen).map_err(read_error)
}

fn seen(socket: &Socket) -> io::Result<Seen> {
    let mut seen: Seen = our_tables(socket)?
        .into_iter()
        .map(|t| (t, TableSeen::default()))
        .collect();
    // Every chain of the family (the kernel filters chains by nothing).
    dump(
        socket,
        NFT_MSG_GETCHAIN,
        &Attrs::default(),
        NFT_MSG_NEWCHAIN,
        |body| {
            let (mut table, mut name, mut head) = (None, None, None);
            let (mut hook, mut priority, mut kind, mut policy) = (None, None, None, None);
            for (k, v) in attributes(body) {
                match k {
                    NFTA_CHAIN_TABLE => table = Shard::from_table(&text(v)),
                    NFTA_CHAIN_NAME => name = Some(text(v)),
                    NFTA_CHAIN_HOOK => {
                        head = Some(());
                        for (k, v) in attributes(v) {
                            match k {
                                NFTA_HOOK_HOOKNUM => hook = be32(v),
                                NFTA_HOOK_PRIORITY => priority = be32(v).map(|p| p as i32),
                                _ => {}
                            }
                        }
                    }
                    NFTA_CHAIN_POLICY => policy = be32(v),
                    NFTA_CHAIN_TYPE => kind = Some(text(v)),
                    _ => {}
                }
            }
            let (Some(t), Some(name)) = (table, name) else {
                return;
            };
            let head = head.map(|()| Head {
                hook: hook.unwrap_or(u32::MAX),
                priority: priority.unwrap_or(i32::MIN),
                kind: kind.unwrap_or_default(),
                policy: policy.unwrap_or(u32::MAX),
            });
            if let Some(table) = seen.get_mut(&t) {
                table.chains.insert(name, (head, Rules::default()));
            }
        },
    )?;
    let tables: Vec<Shard> = seen.keys().copied().collect();
    for t in tables {
        let rules = rules_of(socket, t, None)?;
        let table = seen.get_mut(&t).expect("listed above");
        for (chain, r) in rules {
            if let Some((_, have)) = table.chains.get_mut(&chain) {
                *have = r;
            }
        }
        let mut sets = vec!["dispatch4", "dispatch6", "pickup4", "pickup6"];
        if t == Shard::MAIN {
            sets.extend(["refuse4", "refuse6", "masq4", "masq6", "snat4", "snat6"]);
        }
        for set in sets {
            elements(socket, t, set, |key, chain| {
                let decoded = match (set, chain) {
                    ("dispatch4" | "dispatch6", Some(chain)) => listener_key(key).map(|id| {
                        table.dispatch.insert(id, chain);
                    }),
                    ("refuse4" | "refuse6", None) => listener_key(key).map(|id| {
                        table.refuse.insert(id);
                    }),
                    ("masq4" | "masq6", None) => masq_key(key).map(|m| {
                        table.masq.insert(m);
                    }),
                    ("snat4" | "snat6", None) => masq_key(key).map(|m| {
                        table.snat.insert(m);
                    }),
                    ("pickup4" | "pickup6", None) => listener_key(key).map(|id| {
                        table.pickup.insert(id);
                    }),
                    _ => None,
                };
                if decoded.is_none() {
                    *table.odd.entry(set.to_string()).or_default() += 1;
                }
            })?;
        }
    }
    Ok(seen)
}

/// The rules of `chains` as the kernel lists them now; every chain of our
/// tables with `None`. A table with many of them is read whole (one dump)
/// rather than chain by chain.
pub(super) fn read_rules(
    socket: &KeptSocket,
    chains: Option<&[Obj]>,
) -> Result<HashMap<Obj, Rules>, NftError> {
    /// Above this many chains of one table, one dump of the table.
    const BY_CHAIN: usize = 16;
    socket
        .with(|socket| {
            let mut wanted: BTreeMap<Shard, Option<HashSet<&str>>> = BTreeMap::new();
            match chains {
                None => {
                    for t in our_tables(socket)? {
                        wanted.insert(t, None);
                    }
                }
                Some(list) => {
                    for o in list {
                        wanted
                            .entry(o.shard)
                            .or_insert_with(|| Some(HashSet::new()))
                            .as_mut()
                            .expect("only chains")
                            .insert(&o.name);
                    }
                }
            }
            let mut out = HashMap::new();
            for (t, names) in wanted {
                let read = match &names {
                    Some(names) if names.len() <= BY_CHAIN => {
                        let mut r = BTreeMap::new();
                        for name in names {
                            r.extend(rules_of(socket, t, Some(name))?);
                        }
                        r
                    }
                    _ => rules_of(socket, t, None)?,
                };
                for (name, rules) in read {
                    if names.as_ref().is_none_or(|n| n.contains(name.as_str())) {
                        out.insert(Obj { shard: t, name }, rules);
                    }
                }
                // A chain with no rule is not in the dump: it has none.
                for name in names.into_iter().flatten() {
                    out.entry(Obj {
                        shard: t,
                        name: name.to_string(),
                    })
                    .or_insert_with(Rules::default);
                }
            }
            Ok(out)
        })
        .map_err(read_error)
}

/// The rules of table `t`'s chains (of `chain` alone when given), by
/// chain, in one dump. A chain without rules is not in the answer.
fn rules_of(socket: &Socket, t: Shard, chain: Option<&str>) -> io::Result<BTreeMap<String, Rules>> {
    let mut filter = Attrs::default();
    filter.str(NFTA_RULE_TABLE, &t.table());
    if let Some(chain) = chain {
        filter.str(NFTA_RULE_CHAIN, chain);
    }
    let mut hashing: BTreeMap<String, (usize, DefaultHasher)> = BTreeMap::new();
    dump(socket, NFT_MSG_GETRULE, &filter, NFT_MSG_NEWRULE, |body| {
        let mut name = None;
        let mut parts: [&[u8]; 2] = [&[], &[]];
        for (k, v) in attributes(body) {
            match k {
                NFTA_RULE_CHAIN => name = Some(text(v)),
                NFTA_RULE_EXPRESSIONS => parts[0] = v,
                NFTA_RULE_USERDATA => parts[1] = v,
                _ => {}
            }
        }
        let Some(name) = name else { return };
        let (count, h) = hashing.entry(name).or_default();
        *count += 1;
        for p in parts {
            h.write_usize(p.len());
            h.write(p);
        }
    })?;
    Ok(hashing
        .into_iter()
        .map(|(name, (count, h))| {
            (
                name,
                Rules {
                    count,
                    digest: h.finish(),
                },
            )
        })
        .collect())
}

/// Calls `each` with every element of set (or map) `set` of table `t`:
/// its key's bytes and, in a verdict map, the chain it jumps to.
fn elements(
    socket: &Socket,
    t: Shard,
    set: &str,
    mut each: impl FnMut(&[u8], Option<String>),
) -> io::Result<()> {
    let mut filter = Attrs::default();
    filter
        .str(NFTA_SET_ELEM_LIST_TABLE, &t.table())
        .str(NFTA_SET_ELEM_LIST_SET, set);
    dump(
        socket,
        NFT_MSG_GETSETELEM,
        &filter,
        NFT_MSG_NEWSETELEM,
        |body| {
            let Some((_, list)) = attributes(body).find(|(k, _)| *k == NFTA_SET_ELEM_LIST_ELEMENTS)
            else {
                return;
            };
            for (_, element) in attributes(list) {
                let mut key: &[u8] = &[];
                let mut chain = None;
                for (k, v) in attributes(element) {
                    match k {
                        NFTA_SET_ELEM_KEY => {
                            if let Some((_, bytes)) =
                                attributes(v).find(|(k, _)| *k == NFTA_DATA_VALUE)
                            {
                                key = bytes;
                            }
                        }
                        NFTA_SET_ELEM_DATA => {
                            chain = attributes(v)
                                .find(|(k, _)| *k == NFTA_DATA_VERDICT)
                                .and_then(|(_, verdict)| {
                                    attributes(verdict).find(|(k, _)| *k == NFTA_VERDICT_CHAIN)
                                })
                                .map(|(_, name)| text(name));
                        }
                        _ => {}
                    }
                }
                each(key, chain);
            }
        },
    )
}

/// A protocol number of ours.
fn protocol(p: u8) -> Option<Protocol> {
    match p {
        6 => Some(Protocol::Tcp),
        17 => Some(Protocol::Udp),
        _ => None,
    }
}

/// An address of 4 or 16 bytes.
fn addr(b: &[u8]) -> Option<IpAddr> {
    match b.len() {
        4 => Some(IpAddr::from(<[u8; 4]>::try_from(b).ok()?)),
        16 => Some(IpAddr::from(<[u8; 16]>::try_from(b).ok()?)),
        _ => None,
    }
}

/// `protocol . port` as a concatenation holds them: each field in 4 bytes.
fn proto_port(b: &[u8]) -> Option<(Protocol, u16)> {
    let b: &[u8; 8] = b.try_into().ok()?;
    Some((protocol(b[0])?, u16::from_be_bytes([b[4], b[5]])))
}

/// A dispatch or refusal key: `address . protocol . port`.
pub(super) fn listener_key(b: &[u8]) -> Option<ListenerId> {
    let n = b.len().checked_sub(8).filter(|n| *n == 4 || *n == 16)?;
    let (protocol, port) = proto_port(&b[n..])?;
    Some((addr(&b[..n])?, protocol, port))
}

/// A masquerade key: `VIP . backend . protocol . port`.
pub(super) fn masq_key(b: &[u8]) -> Option<MasqKey> {
    let n = b.len().checked_sub(8).filter(|n| *n == 8 || *n == 32)? / 2;
    let (protocol, port) = proto_port(&b[2 * n..])?;
    Some((addr(&b[..n])?, addr(&b[n..2 * n])?, protocol, port))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Algorithm;

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
            vec![Obj {
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

    #[test]
    fn keys_decode_as_nft_pads_each_field_to_four_bytes() {
        let v4 = [192, 0, 2, 10, 6, 0, 0, 0, 0, 80, 0, 0];
        assert_eq!(
            listener_key(&v4),
            Some((ip("192.0.2.10"), Protocol::Tcp, 80))
        );
        let mut v6 = ip6_bytes("2001:db8::1").to_vec();
        v6.extend([17, 0, 0, 0, 0, 53, 0, 0]);
        assert_eq!(
            listener_key(&v6),
            Some((ip("2001:db8::1"), Protocol::Udp, 53))
        );
        let masq = [192, 0, 2, 10, 10, 0, 0, 1, 6, 0, 0, 0, 0x75, 0x60, 0, 0];
        assert_eq!(
            masq_key(&masq),
            Some((ip("192.0.2.10"), ip("10.0.0.1"), Protocol::Tcp, 30048))
        );
        assert_eq!(listener_key(&v4[..11]), None);
        assert_eq!(listener_key(&[0; 12][..]).map(|_| ()), None, "protocol 0");
    }

    fn ip6_bytes(s: &str) -> [u8; 16] {
        s.parse::<std::net::Ipv6Addr>().unwrap().octets()
    }
}

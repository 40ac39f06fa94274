//! Reading our NAT tables back from the kernel: what they hold now, as
//! nf_tables lists it, never what this process remembers writing.
//!
//! Two readings, for two uses:
//!
//! * **The inventory** ([`read_back`]): every table, regular chain,
//!   counter, source-range set, bucket map and affinity set of ours, by
//!   name ([`TableObjects`]), so that a sync after a restart or a failed
//!   transaction deletes exactly the objects no longer wanted (a
//!   kube-proxy style "full resync"), and never the table itself. Read with
//!   `nft -j list table`, once per resync.
//! * **What the check compares** ([`read_seen`], [`read_rules`],
//!   [`generation`]): every chain with its head and a digest of its rules,
//!   and the elements of the dispatch, refusal, masquerade and pickup sets
//!   ([`Seen`]), which `check` holds against what was written. Read over
//!   netlink, every few seconds.
//!
//! Why netlink and not `nft -j list` for the second: nft 1.0.6 fetches its
//! cache of the whole ruleset first (2.75 s at 10,000 listeners, see
//! `netlink`); the dumps here read only our tables. The counters are read
//! over netlink too ([`super::netlink::counters`]).
//!
//! Nothing here writes; names come from `names`, errors are
//! [`NftError`]s.

use std::collections::{BTreeMap, HashMap, HashSet};
use std::hash::{DefaultHasher, Hasher};
use std::io;
use std::net::IpAddr;

use netlink_sys::Socket;

use super::ListenerId;
use super::build::{MasqKey, TableObject, TableObjects};
use super::error::NftError;
use super::names::{
    AFFINITY_SET, BUCKET_MAP, DISPATCH4, DISPATCH6, MASQ4, MASQ6, PICKUP4, PICKUP6, REFUSE4,
    REFUSE6, SNAT4, SNAT6, SOURCE_SET, Shard,
};
use super::netlink::{Attrs, KeptSocket, attributes, connected, dump, messages};
use crate::config::Protocol;

/// An inventory read that failed, in the words of the step that failed.
fn read_failed(detail: String) -> NftError {
    NftError::new("read", detail)
}

/// Our tables present now (every shard's, also of a shard this version
/// does not use), on a socket of its own.
pub(super) fn our_tables_now() -> Result<Vec<Shard>, NftError> {
    connected()
        .and_then(|socket| our_tables(&socket))
        .map_err(|e| NftError::new("read", format!("the tables over netlink: {e}")))
}

/// The tables, regular chains, counters and sets ours hold now; empty
/// when there is none (a first start, or a clean stop before).
pub fn read_back() -> Result<TableObjects, NftError> {
    let mut objects = TableObjects::default();
    for shard in our_tables_now()? {
        // Gone between the two calls: nothing to read.
        if let Some(listed) = crate::host::nft::list_inet_table(&shard.table())
            .map_err(|e| read_failed(e.to_string()))?
        {
            parse_listing(shard, &listed, &mut objects)
                .map_err(|e| read_failed(format!("cannot parse nft's listing: {e}")))?;
        }
    }
    Ok(objects)
}

/// The objects of a `nft -j list table` answer for table `shard`, into
/// `objects`. Read as plain JSON: the crate's schema has no verdict map
/// type, so it cannot read our own table.
fn parse_listing(
    shard: Shard,
    listed: &str,
    objects: &mut TableObjects,
) -> Result<(), serde_json::Error> {
    let doc: serde_json::Value = serde_json::from_str(listed)?;
    objects.tables.insert(shard);
    for o in doc["nftables"].as_array().into_iter().flatten() {
        let name = |kind: &str| {
            o.get(kind)?.get("name")?.as_str().map(|n| TableObject {
                shard,
                name: n.to_string(),
            })
        };
        if let Some(n) = name("chain").filter(|_| o["chain"].get("hook").is_none()) {
            objects.chains.insert(n);
        } else if let Some(n) = name("counter") {
            objects.counters.insert(n);
        } else if let Some(n) = name("set").filter(|n| n.name.starts_with(SOURCE_SET)) {
            objects.sets.insert(n);
        } else if let Some(n) = name("set").filter(|n| n.name.starts_with(AFFINITY_SET)) {
            objects.affinity.insert(n);
        } else if let Some(n) = name("map").filter(|n| n.name.starts_with(BUCKET_MAP)) {
            objects.maps.insert(n);
        }
    }
    Ok(())
}

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

// --- What the check compares, over netlink. ---

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
        let mut sets = vec![DISPATCH4, DISPATCH6, PICKUP4, PICKUP6];
        if t == Shard::MAIN {
            sets.extend([REFUSE4, REFUSE6, MASQ4, MASQ6, SNAT4, SNAT6]);
        }
        for set in sets {
            elements(socket, t, set, |key, chain| {
                let decoded = match (set, chain) {
                    (DISPATCH4 | DISPATCH6, Some(chain)) => listener_key(key).map(|id| {
                        table.dispatch.insert(id, chain);
                    }),
                    (REFUSE4 | REFUSE6, None) => listener_key(key).map(|id| {
                        table.refuse.insert(id);
                    }),
                    (MASQ4 | MASQ6, None) => masq_key(key).map(|m| {
                        table.masq.insert(m);
                    }),
                    (SNAT4 | SNAT6, None) => masq_key(key).map(|m| {
                        table.snat.insert(m);
                    }),
                    (PICKUP4 | PICKUP6, None) => listener_key(key).map(|id| {
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
    chains: Option<&[TableObject]>,
) -> Result<HashMap<TableObject, Rules>, NftError> {
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
                        out.insert(TableObject { shard: t, name }, rules);
                    }
                }
                // A chain with no rule is not in the dump: it has none.
                for name in names.into_iter().flatten() {
                    out.entry(TableObject {
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

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
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

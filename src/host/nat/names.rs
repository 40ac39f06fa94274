//! The names of everything the kernel path writes into nf_tables and reads
//! back: its tables (one per [`Shard`]), their base chains, the shared maps
//! and sets of each address family, and the objects of each listener
//! (chains, counters, sets, maps), each named after the listener.
//!
//! Every other file of `host/nat/` takes a name from here and spells none
//! itself (outside tests; `build` tells listener chains from backend
//! chains by the `l_` prefix when it deletes them), so the builder (`build`), the flip writer (`netlink`), the
//! read-back (`read_back`) and the check (`check`) cannot disagree on one.
//! A listener's objects carry its tag (`tcp_80_192.0.2.10`), so a name is
//! unique over all our tables; the one-letter prefix says the kind, and
//! is how the read-back sorts what it lists.

use std::net::IpAddr;

use super::ListenerId;

/// The main table's name, in family `inet` (beside `inet harvester_lb`,
/// the VIP isolation table, which it never touches); the other shards'
/// tables are this name and `_k` ([`Shard`]).
pub const TABLE: &str = "harvester_lb_nat";

/// The NAT base chain on the prerouting hook (every table): traffic from
/// off the host.
pub(super) const PREROUTING: &str = "prerouting";
/// The NAT base chain on the output hook (every table): clients on this
/// host.
pub(super) const OUTPUT: &str = "output";
/// The NAT base chain on the postrouting hook (the main table): the
/// masquerade and the source NAT to the VIP.
pub(super) const POSTROUTING: &str = "postrouting";
/// The filter base chain on the input hook (the main table): the refusal
/// of what was not forwarded.
pub(super) const INPUT: &str = "input";

/// The dispatch verdict maps: `VIP . protocol . port : goto <listener
/// chain>`, one per family in every table.
pub(super) const DISPATCH4: &str = "dispatch4";
/// See [`DISPATCH4`].
pub(super) const DISPATCH6: &str = "dispatch6";
/// The refusal sets (main table): every kernel listener, whose new flows
/// not DNATed are refused.
pub(super) const REFUSE4: &str = "refuse4";
/// See [`REFUSE4`].
pub(super) const REFUSE6: &str = "refuse6";
/// The masquerade sets (main table): `VIP . backend . protocol . port`.
pub(super) const MASQ4: &str = "masq4";
/// See [`MASQ4`].
pub(super) const MASQ6: &str = "masq6";
/// The `source_nat = "vip"` sets (main table), keyed as the masquerade's.
pub(super) const SNAT4: &str = "snat4";
/// See [`SNAT4`].
pub(super) const SNAT6: &str = "snat6";
/// The pickup sets (every table): `flow_hash` TCP listeners, whose
/// mid-stream segments are DNATed.
pub(super) const PICKUP4: &str = "pickup4";
/// See [`PICKUP4`].
pub(super) const PICKUP6: &str = "pickup6";

/// The map and set names of one address family.
pub(super) struct Family {
    /// IPv4 (`true`) or IPv6.
    pub v4: bool,
    /// The dispatch verdict map.
    pub dispatch: &'static str,
    /// The refusal set.
    pub refuse: &'static str,
    /// The masquerade set.
    pub masq: &'static str,
    /// `source_nat = "vip"`: the flows SNATed to their VIP (the key is the
    /// masquerade's).
    pub snat: &'static str,
    /// The `flow_hash` TCP listeners, whose mid-stream segments are DNATed
    /// (`build::picks_up`).
    pub pickup: &'static str,
}

/// IPv4's names, then IPv6's.
pub(super) const FAMILIES: [Family; 2] = [
    Family {
        v4: true,
        dispatch: DISPATCH4,
        refuse: REFUSE4,
        masq: MASQ4,
        snat: SNAT4,
        pickup: PICKUP4,
    },
    Family {
        v4: false,
        dispatch: DISPATCH6,
        refuse: REFUSE6,
        masq: MASQ6,
        snat: SNAT6,
        pickup: PICKUP6,
    },
];

/// The names of `ip`'s family.
pub(super) fn family_of(ip: IpAddr) -> &'static Family {
    &FAMILIES[usize::from(!ip.is_ipv4())]
}

/// The prefix of a listener's chain.
const LISTENER_CHAIN: &str = "l_";
/// The prefix of a backend's chain within a listener.
const BACKEND_CHAIN: &str = "b_";
/// The prefix of a backend's counter within a listener.
const BACKEND_COUNTER: &str = "n_";
/// The prefix of a listener's no-backend counter.
const NO_BACKEND_COUNTER: &str = "z_";
/// The prefix of a listener's `source_ranges` refusal counter.
const DENIED_COUNTER: &str = "d_";
/// The prefix of a listener's bucket map.
pub(super) const BUCKET_MAP: &str = "m_";
/// The prefix of a backend's client-affinity set.
pub(super) const AFFINITY_SET: &str = "a_";
/// The prefix of a listener's source-range set.
pub(super) const SOURCE_SET: &str = "s_";

/// How many tables the kernel listeners are spread over.
///
/// The kernel validates a whole table at every commit that touches a rule
/// with `nat` or `counter name` in it (`nft_table_validate`, a walk from
/// every base chain through every chain it reaches), so a health flip in
/// one table of 10,000 listeners costs a walk of all 10,000: 25 ms of
/// commit, measured on 6.18. Spread over 16 tables, a flip walks one:
/// 2.3 ms (64 tables: 1.2 ms, for four times the hooks). Each table has
/// its own dispatch maps and NAT base chains, so a new flow is looked up
/// once per table that holds a listener; established flows are not
/// looked up at all (a NAT chain sees only a flow's first packet).
pub const SHARDS: u8 = 16;

/// One of the daemon's NAT tables. Shard 0 is `inet harvester_lb_nat`,
/// which also holds what is shared by every listener (the refusal of what
/// was not forwarded, the masquerade), and exists while any kernel
/// listener does; shard k is `inet harvester_lb_nat_k`, present while it
/// holds a listener. A listener's shard is a fixed hash of its identity,
/// the same in every version and process, so a restart finds each
/// listener where it left it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Shard(u8);

impl Shard {
    /// `inet harvester_lb_nat`: the shared parts, and the listeners
    /// hashed to 0.
    pub const MAIN: Shard = Shard(0);

    /// The table that holds listener `id`'s objects (FNV-1a of its tag).
    pub fn of(id: &ListenerId) -> Shard {
        let hash = listener_tag(id).bytes().fold(0x811c_9dc5_u32, |h, b| {
            (h ^ u32::from(b)).wrapping_mul(0x0100_0193)
        });
        Shard((hash % u32::from(SHARDS)) as u8)
    }

    /// The table's name, in family `inet`.
    pub fn table(self) -> String {
        match self.0 {
            0 => TABLE.to_string(),
            k => format!("{TABLE}_{k}"),
        }
    }

    /// The shard whose table is named `name`; `None`: not one of ours
    /// (a shard number this version does not use included, so that a
    /// start deletes it).
    pub fn from_table(name: &str) -> Option<Shard> {
        if name == TABLE {
            return Some(Shard::MAIN);
        }
        let k: u8 = name.strip_prefix(TABLE)?.strip_prefix('_')?.parse().ok()?;
        // `_07` is not ours: only the names `table` gives.
        (k > 0 && Shard(k).table() == name).then_some(Shard(k))
    }

    /// Whether this version puts listeners in it.
    pub fn in_use(self) -> bool {
        self.0 < SHARDS
    }
}

/// The table of listener `id` (`inet` family): where its chains, counters
/// and sets are.
pub fn table_of(id: &ListenerId) -> String {
    Shard::of(id).table()
}

/// The names this module gives a listener's objects.
pub(super) fn listener_tag((vip, protocol, port): &ListenerId) -> String {
    format!("{}_{}_{}", protocol.as_str(), port, addr_tag(*vip))
}

/// An address as an nft identifier piece (`:` is not allowed there).
fn addr_tag(ip: IpAddr) -> String {
    ip.to_string().replace(':', "-")
}

/// The listener's chain.
pub(super) fn listener_chain(id: &ListenerId) -> String {
    format!("{LISTENER_CHAIN}{}", listener_tag(id))
}

/// A backend's chain within a listener: only where a bucket map or an
/// affinity set names it (see `build::has_backend_chains`).
pub(super) fn backend_chain(id: &ListenerId, backend: IpAddr) -> String {
    format!("{BACKEND_CHAIN}{}_{}", listener_tag(id), addr_tag(backend))
}

/// A backend's counter of new connections within a listener.
pub fn backend_counter(id: &ListenerId, backend: IpAddr) -> String {
    format!(
        "{BACKEND_COUNTER}{}_{}",
        listener_tag(id),
        addr_tag(backend)
    )
}

/// The counter of a listener's connections refused for want of an
/// eligible backend.
pub fn no_backend_counter(id: &ListenerId) -> String {
    format!("{NO_BACKEND_COUNTER}{}", listener_tag(id))
}

/// The counter of a listener's connections refused by `source_ranges`.
pub fn denied_counter(id: &ListenerId) -> String {
    format!("{DENIED_COUNTER}{}", listener_tag(id))
}

/// A `source_ip` or `flow_hash` listener's bucket map: bucket (a hash of
/// the client's address, or address and port, modulo [`BUCKETS`](super::BUCKETS)) to the
/// backend chain.
pub(super) fn bucket_map(id: &ListenerId) -> String {
    format!("{BUCKET_MAP}{}", listener_tag(id))
}

/// A backend's client-affinity set within a listener: the clients whose
/// last new connection went to it, each for the listener's timeout.
pub(super) fn affinity_set(id: &ListenerId, backend: IpAddr) -> String {
    format!("{AFFINITY_SET}{}_{}", listener_tag(id), addr_tag(backend))
}

/// The set of a listener's source ranges.
pub(super) fn source_set(id: &ListenerId) -> String {
    format!("{SOURCE_SET}{}", listener_tag(id))
}

//! Forwarding in the kernel: the daemon's `forwarding = "kernel"`
//! listeners as nftables NAT in [`SHARDS`] (16) tables of its own, `inet
//! harvester_lb_nat` and `inet harvester_lb_nat_1` … `_15`, a listener's
//! objects in the table of its [`Shard`] (so a flip's commit walks one
//! table), modelled on kube-proxy's nftables mode (KEP-3866). The main
//! table, as below; every shard has its own dispatch maps, pickup sets,
//! `prerouting` and `output` chains and its listeners' objects, while the
//! refusal, masquerade and source-NAT sets and the `postrouting` and
//! `input` chains are the main table's alone:
//!
//! ```text
//! table inet harvester_lb_nat {
//!   map dispatch4 { ipv4_addr . inet_proto . inet_service : verdict }   # VIP . tcp . 80 : goto l_tcp_80_VIP
//!   set refuse4   { ipv4_addr . inet_proto . inet_service }             # every kernel listener
//!   set masq4     { ipv4_addr . ipv4_addr . inet_proto . inet_service } # VIP . backend . tcp . nodeport
//!   set snat4     { the same }                                          # source_nat = "vip"
//!   (and dispatch6, refuse6, masq6)
//!   chain prerouting  { nat hook prerouting priority dstnat; ip daddr . meta l4proto . th dport vmap @dispatch4 … }
//!   chain output      { nat hook output priority -100; the same }        # clients on this host
//!   chain postrouting { nat hook postrouting priority srcnat;       # each rule only while a listener of its family and kind is there
//!                       ct status dnat ct original ip daddr . ip daddr . meta l4proto . th dport @masq4 masquerade fully-random
//!                       ct status dnat … @snat4 snat ip to ct original ip daddr }
//!   chain input       { filter hook input priority filter;
//!                       ct state != new return                         # an open flow's packet leaves here
//!                       ct state new ip daddr . meta l4proto . th dport @refuse4 reject }  # never falls through to the host
//!   chain l_tcp_80_VIP { ip saddr != @s_tcp_80_VIP counter name d_… return    # source_ranges
//!                        numgen inc mod 3 0 counter name n_…_BE1 meta l4proto tcp dnat ip to BE1:NODEPORT
//!                        numgen inc mod 2 0 counter name n_…_BE2 … dnat ip to BE2:NODEPORT
//!                        counter name n_…_BE3 … dnat ip to BE3:NODEPORT }    # or: counter name z_… return
//!   # source_ip or client_ip affinity: a chain per backend, named by a map or a set
//!   chain l_tcp_81_VIP { ip saddr @a_…_BE1 goto b_…_BE1                     # client_ip affinity, eligible only
//!                        numgen inc mod 2 0 goto b_…_BE1; goto b_…_BE2 }     # round robin, as above
//!                                                                            # source_ip: jhash ip saddr mod 4093 vmap @m_…
//!   map m_tcp_81_VIP { typeof numgen inc mod 4093 : verdict }  # source_ip buckets, by the proxy's rendezvous hash
//!   # flow_hash: the same map and buckets, found by jhash ip saddr . th sport mod 4093
//!   set pickup4 { ipv4_addr . inet_proto . inet_service }  # flow_hash TCP listeners: DNAT mid-stream segments
//!   set a_tcp_81_VIP_BE1 { type ipv4_addr; flags dynamic,timeout; timeout T }  # client_ip affinity
//!   chain b_tcp_81_VIP_BE1 { [update @a_…_BE1 { ip saddr }] counter name n_tcp_81_VIP_BE1; meta l4proto tcp dnat ip to BE1:NODEPORT }
//! }
//! ```
//!
//! The backend choice is a cascade of rules, not a verdict map: rule k
//! takes every (E − k)th connection that reaches it, which is round robin
//! over the E eligible backends. At 10,000 listeners this is what makes
//! the table writable: each anonymous map costs the kernel a walk of the
//! whole transaction when it is bound (`__nft_set_trans_bind`, quadratic:
//! 124 s for a cold start). A flip rewrites one chain over netlink
//! (`netlink`), since `nft` itself lists the whole table before every
//! change (~0.5 s at 10,000 listeners). What a flip still pays is the
//! kernel's validation of the whole table at commit (a rule with `nat` or
//! `counter name` asks for it), linear in the listeners.
//!
//! A NAT chain sees only a flow's first packet, so each named counter
//! counts new connections. A packet the listener chain does not DNAT (no
//! eligible backend, a client outside `source_ranges`) goes on to the
//! local input path, where `refuse` resets it (ICMP port unreachable for
//! UDP): it never reaches the userspace socket or another service of the
//! host. Only new flows are refused, so connections the proxy accepted
//! before the listener became a kernel one run on.
//!
//! Which choice of backend is the same on every host (so that a flow that
//! reaches another host mid-stream, after a BGP rehash or a VIP's
//! failover, lands on the backend it had): `flow_hash` per flow and
//! `source_ip` per client address, both from buckets filled by the proxy's
//! rendezvous function ([`buckets`]) with a fixed `jhash` seed, so equal on
//! every host with the same config and health; a health flip moves only
//! the buckets of the backend that changed. Round robin cannot: each
//! host's `numgen` counters differ. Whether the moved flow then survives
//! is the source NAT's business (`source_nat`, docs/many-hosts.md).
//!
//! The userspace listener stays bound: removing a VIP's `dispatch` element
//! hands its new connections back to the proxy at once (DNAT happens
//! before the local socket), which is how a failed write falls back. A
//! write the kernel refuses is first narrowed to the owners (load
//! balancers) whose listeners it refuses (`narrow`): they alone fall back,
//! and everyone else is written.
//!
//! The tables are read back and compared with what was written every
//! [`crate::host::owned::CHECK_INTERVAL`] and at every reload (`check`); what
//! another process changed is named, counted and written again.
//!
//! This part decides no policy: the daemon hands it the desired state
//! ([`Desired`]: VIPs, ports, eligible backends) and it writes the kernel.
//! What it computes itself is the hash buckets, with the proxy's own
//! rendezvous function (`crate::dataplane::balancer::select`), so the
//! kernel and the proxy pick alike. It never imports `proxy` or `health`.
//!
//! The files, by job, each importing only files listed before it (and
//! this one's types):
//!
//! * `names`: every name written and read back: the tables ([`Shard`],
//!   [`TABLE`]), base chains, each family's maps and sets, and each
//!   listener's chains, counters, sets and maps.
//! * `error`: [`NftError`], the one error of the kernel path.
//! * `build`: the pure builder, desired state in, one `nft` transaction
//!   out; [`TableObjects`], what the tables hold by kind and name.
//! * `netlink`: nf_tables over netlink: a flip's rewrite of listener
//!   chains, the counters ([`counters`]), the dumps the readers use.
//! * `read_back`: our tables as the kernel holds them now: the inventory
//!   a resync diffs ([`read_back()`]) and what the check compares.
//! * `commit`: running the builder's transactions with `nft`, the removal.
//! * `check`: what was written against what was read back, the
//!   differences named with the listeners they break.
//! * `narrow`: a refused write narrowed to the owners it refuses.
//! * `sync`: [`KernelTable`], which keeps the tables equal to the desired
//!   state with the above; `conntrack`: the flows of backends that left.
//! * [`repair`]: when the check runs (every
//!   [`crate::host::owned::CHECK_INTERVAL`], at each reload), and what a
//!   difference is logged, counted and reported as; [`forward_chains`]:
//!   other programs' forward chains that would drop what the kernel
//!   forwards. Both are the daemon's entry points (`daemon::kernel`).
//!
//! A new kind of object in the NAT tables: its name in `names`; declared,
//! filled and deleted in `build` (and listed in [`TableObjects::of`] when a
//! sync must delete it once unwanted); sorted in `read_back`'s inventory,
//! and read and compared in `read_back` and `check` when another process
//! could change it unseen; rewritten in `netlink` only if a health flip
//! changes it. docs/design.md says the same with the tests to add.

mod build;
mod check;
mod commit;
mod conntrack;
mod error;
pub mod forward_chains;
mod names;
mod narrow;
mod netlink;
mod read_back;
pub mod repair;
mod sync;

pub use build::{BUCKETS, TableObject, TableObjects, bucket_key, buckets, transaction};
pub use conntrack::{delete_stale_flows, open_connections};
pub use error::NftError;
pub use names::{
    SHARDS, Shard, TABLE, backend_counter, denied_counter, no_backend_counter, table_of,
};
pub use netlink::{ForwardChain, counters, forward_base_chains};
pub use read_back::read_back;
pub use sync::{Checked, KernelTable, Narrowed, Refused, Synced};

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use ipnet::IpNet;

use crate::config::{Algorithm, Protocol, SourceNat};

/// A kernel listener's identity, as the proxy's: VIP, protocol, port.
pub type ListenerId = (IpAddr, Protocol, u16);

/// What one kernel listener should do now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelListener {
    /// The service's nodeport on every backend.
    pub backend_port: u16,
    /// Every backend of its load balancer, in config order: each keeps a
    /// chain and a named counter while it is configured, so a health flip
    /// does not reset its count.
    pub members: Vec<IpAddr>,
    /// The members that take new connections (healthy and ready), in
    /// config order; a subset of `members`.
    pub eligible: Vec<IpAddr>,
    /// The clients served; `None`: everyone.
    pub source_ranges: Option<Vec<IpNet>>,
    /// What the backends see as the source.
    pub source_nat: SourceNat,
    /// Members marked down by their health check whose open TCP flows are
    /// reset (`on_backend_down = "close"`: their conntrack entries are
    /// deleted); empty otherwise.
    pub close_down: Vec<IpAddr>,
    /// How a new client is given a backend: `source_ip` and `flow_hash`
    /// through the listener's bucket map ([`BUCKETS`] buckets on a hash of
    /// the client address, or of its address and port, each filled by the
    /// proxy's rendezvous pick), anything else round robin (`numgen`);
    /// `check` refuses `least_connections`.
    pub pick: Algorithm,
    /// `session_affinity = "client_ip"`: how long a client keeps the
    /// backend of its last new connection (a dynamic set per backend with
    /// this timeout); `None`: no affinity.
    pub affinity: Option<Duration>,
}

impl KernelListener {
    /// The plain listener on `backend_port`: round robin over `eligible`
    /// (a subset of `members`), every client served, masqueraded, no
    /// affinity, no flow closed (the config's defaults). The one place
    /// tests build a listener from, changing the field they are about
    /// (`KernelListener { pick, ..KernelListener::round_robin(..) }`), so
    /// a new field is added in one place.
    pub fn round_robin(backend_port: u16, members: Vec<IpAddr>, eligible: Vec<IpAddr>) -> Self {
        Self {
            backend_port,
            members,
            eligible,
            source_ranges: None,
            source_nat: SourceNat::Masquerade,
            close_down: Vec::new(),
            pick: Algorithm::RoundRobin,
            affinity: None,
        }
    }
}

/// The unit tests' listener: [`KernelListener::round_robin`] on port 30080
/// with `eligible` among `members`, in words.
#[cfg(test)]
pub(crate) fn test_listener(eligible: &[&str], members: &[&str]) -> KernelListener {
    KernelListener::round_robin(30080, test_ips(members), test_ips(eligible))
}

/// Addresses in words, for the unit tests.
#[cfg(test)]
pub(crate) fn test_ips(v: &[&str]) -> Vec<IpAddr> {
    v.iter().map(|a| a.parse().expect("an address")).collect()
}

/// Every kernel listener, by identity: the whole state of the table.
pub type Desired = BTreeMap<ListenerId, KernelListener>;

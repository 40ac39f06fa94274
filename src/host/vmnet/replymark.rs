//! Replies of a kernel listener's flows routed back through the VIP's VM
//! network: a conntrack mark set on each flow DNATed from a network's VIP,
//! put back on the packet mark of its replies, and a rule `fwmark
//! MARK/MASK lookup <the network's table>` per network and family.
//!
//! Why: the `from VIP` rule of [`crate::host::vmnet::network`] routes what the host
//! sends *from* the VIP, the proxy's replies. A kernel listener's reply
//! (backend → client) is routed while its source is still the backend:
//! the reverse of the DNAT is applied after the routing decision, in
//! `postrouting`. So it follows the host's main table, and a client behind
//! the network's gateway is unreachable where the main table has no route
//! to it (or routes it out of the management network). The mark carries
//! "this flow entered by network N's VIP" from the first packet to every
//! reply, where routing can see it:
//!
//! ```text
//! table inet harvester_lb_reply {
//!   chain mark_flows {      # after the DNAT (dstnat + 10), first packet only
//!     type filter hook prerouting priority dstnat + 10; policy accept;
//!     ct state new ct status dnat ct original ip daddr { VIP, … } ct mark set ct mark & ~0xff | MARK
//!     (ip6 likewise)
//!   }
//!     (a network with a leg: its flows' first packet too)
//!     ct direction original ct mark & 0xff == MARK ct reply ip saddr SUBNET meta mark set meta mark & ~0xff | MARK
//!   }
//!   chain mark_replies {    # before routing, every reply packet
//!     type filter hook prerouting priority mangle; policy accept;
//!     ct direction reply ct mark & 0xff == MARK meta mark set meta mark & ~0xff | MARK
//!     (a network with a leg: every packet of its flows to a backend in its subnet)
//!     ct direction original ct mark & 0xff == MARK ct reply ip saddr SUBNET meta mark set meta mark & ~0xff | MARK
//!   }
//! }
//! ip rule  fwmark MARK/0xff lookup TABLE pref 30000 proto 252
//! ip -6 rule fwmark MARK/0xff lookup TABLE pref 30000 proto 252   (with IPv6 VIPs)
//! ```
//!
//! **The bits.** Only the bits of [`MARK_MASK`] (`0xff`) are read or
//! written, in the conntrack mark and in the packet mark alike; every
//! other bit is kept. Those other programs on a Harvester host use:
//! kube-proxy `0x4000` (masquerade) and `0x8000` (drop); Calico (Canal's
//! policy half) bits of `0xffff0000` (its default `IptablesMarkMask`);
//! Cilium `0x0f00` (its "magic" field, with identities in the other bits
//! only on packets that carry a magic value); keepalived none (an IPVS
//! `fwmark` only where an operator writes one); flannel and Harvester's
//! own components none. A network's value is `1 + (table - 1) mod 255`
//! ([`mark_of`]: its table number for tables up to 255), so it never
//! changes while the table does not, and flows open across a reload keep
//! routing by the table they were marked for; `check` refuses two networks
//! whose tables give one value.
//!
//! Only replies get the packet mark (`ct direction reply`): the client's
//! own packets keep routing to the backend by the host's tables. On a
//! network with a leg ([`crate::host::vmnet::leg`]: a bridged network's macvlan) the
//! client's packets to a backend in the network's subnet get it too (the
//! reply tuple's source is the backend, whatever the priority), so they
//! route by the network's table, out of the leg, even at the bridge stage
//! (`br_nf_pre_routing_finish` routes with the packet's mark): that is what
//! keeps them from being bridged back toward the port they came in by. A
//! backend in another subnet still routes by the host's tables. Only
//! DNATed flows get the conntrack mark (`ct status dnat`): the proxy's
//! connections are answered from a local socket, which the `from VIP`
//! rule routes. Replies to the host itself (a host process that connected
//! to the VIP) go by the `local` table, consulted before every rule.
//!
//! The objects are owned by a [`crate::host::owned::Driver`] (kind
//! `reply_mark`): read back every 10 s and at every apply, repaired when
//! another process changed or deleted them, removed after the drain at a
//! clean stop; the table is compared as `nft -j list` shows it.

use crate::metrics::HostKind;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::{self, Write as _};
use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::IpVersion;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::route::RouteProtocol;
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};

use crate::host::announce::routes::{AnnounceError, ROUTE_PROTOCOL, RouteWriter, errno};
use ipnet::IpNet;

use crate::config::{Config, Forwarding};
use crate::host::owned::driver::Listing;
use crate::host::owned::{Backend, Fingerprint, Found, StopPhase};
use crate::host::vmnet::network::{NetKey, NetState, RULE_PRIORITY};

/// The table's name, in family `inet`.
pub const TABLE: &str = "harvester_lb_reply";

pub use crate::config::{REPLY_MARK_MASK as MARK_MASK, reply_mark_of as mark_of};

/// One object: the nftables table, or one `fwmark` rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum MarkKey {
    /// `inet harvester_lb_reply`.
    Table,
    /// `ip rule fwmark MARK/MASK` (`ip -6 rule` when `v6`).
    Rule {
        /// IPv6.
        v6: bool,
        /// The network's mark value.
        mark: u32,
    },
}

impl fmt::Display for MarkKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MarkKey::Table => write!(f, "table inet {TABLE}"),
            MarkKey::Rule { v6, mark } => write!(
                f,
                "{} fwmark {mark:#x}/{MARK_MASK:#x}",
                if *v6 { "ip -6 rule" } else { "ip rule" }
            ),
        }
    }
}

/// What the table marks: the flows to these VIPs, by mark value, and on
/// the networks with a leg both directions of their flows to a backend in
/// these subnets.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct MarkTable {
    /// The VIPs of kernel listeners, by their network's mark.
    pub vips: BTreeMap<u32, BTreeSet<IpAddr>>,
    /// The subnets (IPv4, IPv6) of the networks with a leg, by mark.
    pub legs: BTreeMap<u32, Vec<IpNet>>,
    /// The interface a mark's flows must come in by to be marked, by mark:
    /// the management VIPs' (`host::vmnet::mgmt_leg`), whose table routes only what
    /// leaves by that bridge; a flow from elsewhere (a pod on the host, by
    /// the CNI's interface) keeps the host's main table.
    pub ingress: BTreeMap<u32, String>,
}

/// What the daemon wants of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkWant {
    /// The table.
    Table(MarkTable),
    /// A rule looking up `table`.
    Rule {
        /// The network's table.
        table: u32,
    },
}

/// What the kernel shows of an object.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MarkSeen {
    /// The table as `nft -j list` shows it.
    Table(Fingerprint),
    /// A rule looking up `table`.
    Rule {
        /// The table.
        table: u32,
    },
}

/// The objects `config` asks for, given the network rules it asks of
/// [`crate::host::vmnet::network::wanted`] (`routes`) and the networks whose leg is in
/// place (`legs`, by name): for every VIP with a `from VIP` rule whose
/// load balancer has a kernel listener, its network's mark on its flows
/// (both directions where the network has a leg), and one `fwmark` rule
/// per network and family. Pure.
pub fn wanted(
    config: &Config,
    routes: &BTreeMap<NetKey, NetState>,
    legs: &BTreeSet<String>,
) -> BTreeMap<MarkKey, MarkWant> {
    let mut marks: BTreeMap<u32, BTreeSet<IpAddr>> = BTreeMap::new();
    let mut out = BTreeMap::new();
    for (key, state) in routes {
        let (NetKey::Rule { vip }, NetState::Rule { table }) = (key, state) else {
            continue;
        };
        let kernel = config.load_balancers.iter().any(|lb| {
            lb.vip == *vip
                && lb.network.is_some()
                && lb
                    .listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
        });
        if !kernel {
            continue;
        }
        let mark = mark_of(*table);
        marks.entry(mark).or_default().insert(*vip);
        out.insert(
            MarkKey::Rule {
                v6: vip.is_ipv6(),
                mark,
            },
            MarkWant::Rule { table: *table },
        );
    }
    if marks.is_empty() {
        return out;
    }
    let mut table = MarkTable {
        legs: BTreeMap::new(),
        vips: marks,
        ingress: BTreeMap::new(),
    };
    for net in config.networks.iter().filter(|n| legs.contains(&n.name)) {
        let mark = mark_of(net.table);
        if !table.vips.contains_key(&mark) {
            continue;
        }
        let subnets = table.legs.entry(mark).or_default();
        subnets.push(IpNet::V4(net.subnet()));
        subnets.extend(net.ipv6_subnet().map(IpNet::V6));
    }
    out.insert(MarkKey::Table, MarkWant::Table(table));
    out
}

/// The whole table as one `nft -f` transaction: create it if missing,
/// delete it, and create it again with its chains.
pub fn render(table: &MarkTable) -> String {
    let marks = &table.vips;
    let keep = !MARK_MASK;
    // A leg network's flows to a backend in its subnet, in the client's
    // direction: routed by the network's table (out of its leg).
    let originals = |t: &mut String| {
        for (mark, subnets) in &table.legs {
            for subnet in subnets {
                let ip = if matches!(subnet, IpNet::V4(_)) {
                    "ip"
                } else {
                    "ip6"
                };
                let _ = writeln!(
                    t,
                    "    ct direction original ct mark and {MARK_MASK:#010x} == {mark:#010x} ct reply {ip} saddr {subnet} meta mark set meta mark and {keep:#010x} or {mark:#010x}"
                );
            }
        }
    };
    let mut t =
        format!("add table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
    t.push_str(
        "  chain mark_flows {\n    type filter hook prerouting priority dstnat + 10; policy accept;\n",
    );
    for (mark, vips) in marks {
        for (ip, v6) in [("ip", false), ("ip6", true)] {
            let list: Vec<String> = vips
                .iter()
                .filter(|v| v.is_ipv6() == v6)
                .map(ToString::to_string)
                .collect();
            if list.is_empty() {
                continue;
            }
            let ingress = table
                .ingress
                .get(mark)
                .map(|i| format!("iifname {i:?} "))
                .unwrap_or_default();
            let _ = writeln!(
                t,
                "    {ingress}ct state new ct status dnat ct original {ip} daddr {{ {} }} ct mark set ct mark and {keep:#010x} or {mark:#010x}",
                list.join(", ")
            );
        }
    }
    // The first packet: its conntrack mark is set just above.
    originals(&mut t);
    t.push_str("  }\n");
    t.push_str(
        "  chain mark_replies {\n    type filter hook prerouting priority mangle; policy accept;\n",
    );
    // Every later packet, before the DNAT and the routing.
    originals(&mut t);
    for mark in marks.keys() {
        let _ = writeln!(
            t,
            "    ct direction reply ct mark and {MARK_MASK:#010x} == {mark:#010x} meta mark set meta mark and {keep:#010x} or {mark:#010x}"
        );
    }
    t.push_str("  }\n}\n");
    t
}

/// What `/status` shows of the reply marks (`reply_marks`): the kernel's
/// objects as last read back, not what was meant.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct ReplyMarkStatus {
    /// The objects of ours the kernel held at the last read-back, as the
    /// log names them (`table inet harvester_lb_reply`, `ip rule fwmark
    /// 0xeb/0xff`); empty without kernel listeners on VM networks.
    pub held: Vec<String>,
    /// The last failure (reading, writing or removing one), while it lasts.
    pub error: Option<String>,
}

/// The marks' table and rules in the kernel (see the module's text).
#[derive(Debug, Clone)]
pub struct ReplyMarks {
    writer: RouteWriter,
}

impl ReplyMarks {
    /// Rules written through `writer`; the table through `nft`.
    pub fn new(writer: RouteWriter) -> Self {
        Self { writer }
    }
}

fn nl(what: String) -> impl FnOnce(rtnetlink::Error) -> ReplyMarkError {
    move |source| ReplyMarkError::Netlink(AnnounceError::Netlink { what, source })
}

/// Why an object could not be read, written or removed.
#[derive(Debug, thiserror::Error)]
pub enum ReplyMarkError {
    /// A rule: the kernel refused, or no netlink socket.
    #[error(transparent)]
    Netlink(#[from] AnnounceError),
    /// The table: `nft` failed.
    #[error(
        "cannot {what} the table inet {TABLE}: {detail} (it needs the `nft` command and CAP_NET_ADMIN; until it is in place a kernel listener's replies to clients behind a VM network's gateway follow the host's main table)"
    )]
    Nft {
        /// What was being done.
        what: &'static str,
        /// nft's words.
        detail: String,
    },
}

fn nft_failed(what: &'static str, detail: impl std::fmt::Display) -> ReplyMarkError {
    ReplyMarkError::Nft {
        what,
        detail: detail.to_string(),
    }
}

/// Why an `nft` call run off the async threads did not do its work.
#[derive(Debug, thiserror::Error)]
enum NftTaskError {
    /// `nft` failed.
    #[error(transparent)]
    Nft(#[from] crate::host::nft::NftCommandError),
    /// The blocking task panicked or was cancelled.
    #[error("the `nft` task stopped: {0}")]
    Stopped(#[source] tokio::task::JoinError),
}

fn rule_message(v6: bool, mark: u32, table: Option<u32>) -> RuleMessage {
    let mut m = RuleMessage::default();
    m.header.family = if v6 {
        AddressFamily::Inet6
    } else {
        AddressFamily::Inet
    };
    m.header.action = RuleAction::ToTable;
    m.attributes.push(RuleAttribute::FwMark(mark));
    m.attributes.push(RuleAttribute::FwMask(MARK_MASK));
    m.attributes.push(RuleAttribute::Priority(RULE_PRIORITY));
    m.attributes
        .push(RuleAttribute::Protocol(RouteProtocol::from(ROUTE_PROTOCOL)));
    if let Some(t) = table {
        m.attributes.push(RuleAttribute::Table(t));
    }
    m
}

/// Runs `f` (which runs `nft`) off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, crate::host::nft::NftCommandError> + Send + 'static,
) -> Result<T, NftTaskError> {
    match tokio::task::spawn_blocking(f).await {
        Ok(done) => Ok(done?),
        Err(e) => Err(NftTaskError::Stopped(e)),
    }
}

impl Backend for ReplyMarks {
    const KIND: HostKind = HostKind::ReplyMark;
    // Replies of the connections the drain waits for go through them.
    const STOP: StopPhase = StopPhase::AfterDrain;
    // The table's name and `proto 252` rules on these bits are this
    // daemon's alone.
    const REMOVES_STRAYS: bool = true;
    type Key = MarkKey;
    type Want = MarkWant;
    type Seen = MarkSeen;
    type Error = ReplyMarkError;

    async fn read(&mut self) -> Result<Listing<Self>, ReplyMarkError> {
        let mut out: Listing<Self> = BTreeMap::new();
        let listed = blocking(|| crate::host::nft::list_inet_table(TABLE))
            .await
            .map_err(|e| nft_failed("read back", e))?;
        if let Some(listed) = listed {
            let print =
                Fingerprint::of_nft_json(&listed).map_err(|e| nft_failed("read back", e))?;
            out.insert(
                MarkKey::Table,
                Found {
                    seen: MarkSeen::Table(print),
                    marked: true,
                },
            );
        }
        let handle = self.writer.handle();
        for (version, v6) in [(IpVersion::V4, false), (IpVersion::V6, true)] {
            let mut rules = handle.rule().get(version).execute();
            while let Some(m) = rules
                .try_next()
                .await
                .map_err(nl("cannot list the routing rules".into()))?
            {
                let attr =
                    |want: fn(&RuleAttribute) -> Option<u32>| m.attributes.iter().find_map(want);
                let mark = attr(|a| match a {
                    RuleAttribute::FwMark(v) => Some(*v),
                    _ => None,
                });
                let mask = attr(|a| match a {
                    RuleAttribute::FwMask(v) => Some(*v),
                    _ => None,
                });
                let (Some(mark), Some(MARK_MASK)) = (mark, mask) else {
                    continue;
                };
                let table = attr(|a| match a {
                    RuleAttribute::Table(t) => Some(*t),
                    _ => None,
                })
                .unwrap_or(u32::from(m.header.table));
                let marked = m.attributes.iter().any(
                    |a| matches!(a, RuleAttribute::Protocol(p) if u8::from(*p) == ROUTE_PROTOCOL),
                );
                let key = MarkKey::Rule { v6, mark };
                if out.get(&key).is_some_and(|f| f.marked) {
                    continue;
                }
                out.insert(
                    key,
                    Found {
                        seen: MarkSeen::Rule { table },
                        marked,
                    },
                );
            }
        }
        Ok(out)
    }

    async fn write(&mut self, key: &MarkKey, want: &MarkWant) -> Result<(), ReplyMarkError> {
        match (key, want) {
            (MarkKey::Table, MarkWant::Table(marks)) => {
                let text = render(marks);
                crate::host::owned::adopt::record(
                    TABLE,
                    crate::host::owned::adopt::digest(text.as_bytes()),
                    None,
                );
                blocking(move || crate::host::nft::run(&["-f", "-"], text.as_bytes()).map(drop))
                    .await
                    .map_err(|e| nft_failed("write", e))
            }
            (MarkKey::Rule { v6, mark }, MarkWant::Rule { table }) => {
                // A rule of ours on this mark to another table goes first.
                self.remove(key).await?;
                let mut req = self.writer.handle().rule().add().v4().replace();
                *req.message_mut() = rule_message(*v6, *mark, Some(*table));
                match req.execute().await {
                    Ok(()) => Ok(()),
                    Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
                    Err(e) => Err(nl(format!("cannot write the {key} lookup {table}"))(e)),
                }
            }
            _ => Ok(()),
        }
    }

    async fn remove(&mut self, key: &MarkKey) -> Result<(), ReplyMarkError> {
        match key {
            MarkKey::Table => {
                // "add" first, so that deleting a table already gone succeeds.
                let text = format!("add table inet {TABLE}\ndelete table inet {TABLE}\n");
                blocking(move || crate::host::nft::run(&["-f", "-"], text.as_bytes()).map(drop))
                    .await
                    .map_err(|e| nft_failed("delete", e))
            }
            MarkKey::Rule { v6, mark } => {
                let handle = self.writer.handle();
                // Every rule of ours on this mark, whatever its table.
                let result = loop {
                    if let Err(e) = handle
                        .rule()
                        .del(rule_message(*v6, *mark, None))
                        .execute()
                        .await
                    {
                        break e;
                    }
                };
                match errno(&result) {
                    Some(libc::ESRCH | libc::ENOENT) => Ok(()),
                    _ => Err(nl(format!("cannot remove the {key}"))(result)),
                }
            }
        }
    }

    /// A predecessor's rule to the same table, or the table it handed over
    /// ([`crate::host::owned::adopt`]) when it is what this process renders.
    fn adoptable(&self, want: &MarkWant, seen: &MarkSeen) -> bool {
        match (want, seen) {
            (MarkWant::Rule { table }, MarkSeen::Rule { table: seen }) => table == seen,
            (MarkWant::Table(marks), MarkSeen::Table(print)) => crate::host::owned::adopt::adopt(
                TABLE,
                crate::host::owned::adopt::digest(render(marks).as_bytes()),
                Some(print),
            ),
            _ => false,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{KEEPALIVED, VLAN100, VLAN200, config, lb};

    #[test]
    fn a_network_s_mark_is_its_table_up_to_255_and_never_zero() {
        assert_eq!(mark_of(100), 100);
        assert_eq!(mark_of(255), 255);
        assert_eq!(mark_of(256), 1);
        assert_eq!(mark_of(1000), 235);
        assert_eq!(mark_of(1001), 236);
        for t in 1..5000 {
            let m = mark_of(t);
            assert!(m != 0 && m & !MARK_MASK == 0, "table {t}: {m:#x}");
        }
    }

    #[test]
    fn only_kernel_listeners_vips_are_marked_per_network_and_family() {
        let kernel = "  forwarding = \"kernel\"\n";
        let text = format!(
            r#"{KEEPALIVED}{VLAN100}ipv6_gateway = "fd00:100::1"
table = 1100
{VLAN200}table = 1200
[[load_balancer]]
name = "default/kernel4"
vip = "10.100.0.50"
network = "vlan100"
  [[load_balancer.listener]]
  name = "dns"
  port = 53
  backend_port = 30053
  protocol = "udp"
{kernel}{}{kernel}{}{}{kernel}"#,
            lb("default/kernel6", "fd00:100::50", "vlan100", &[]),
            lb("default/proxy", "10.100.0.51", "vlan100", &[]),
            lb("default/other", "10.200.0.50", "vlan200", &[]),
        );
        let config = config(&text);
        let index: BTreeMap<String, u32> =
            [("br.100".to_string(), 7), ("br.200".to_string(), 8)].into();
        let routes = crate::host::vmnet::network::wanted(&config, &index, &BTreeMap::new());
        let w = wanted(&config, &routes, &BTreeSet::new());
        let (m100, m200) = (mark_of(1100), mark_of(1200));
        assert_ne!(m100, m200);
        let rules: Vec<String> = w
            .iter()
            .filter(|(k, _)| **k != MarkKey::Table)
            .map(|(k, v)| format!("{k} {v:?}"))
            .collect();
        assert_eq!(
            rules,
            [
                format!("ip rule fwmark {m100:#x}/0xff Rule {{ table: 1100 }}"),
                format!("ip rule fwmark {m200:#x}/0xff Rule {{ table: 1200 }}"),
                format!("ip -6 rule fwmark {m100:#x}/0xff Rule {{ table: 1100 }}"),
            ]
        );
        let Some(MarkWant::Table(marks)) = w.get(&MarkKey::Table) else {
            panic!("no table: {w:?}");
        };
        let text = render(marks);
        // The proxy's VIP is not marked: its replies leave a local socket.
        assert!(!text.contains("10.100.0.51"), "{text}");
        assert!(text.contains(&format!(
            "ct original ip daddr {{ 10.100.0.50 }} ct mark set ct mark and 0xffffff00 or {m100:#010x}"
        )), "{text}");
        assert!(text.contains(&format!(
            "ct original ip6 daddr {{ fd00:100::50 }} ct mark set ct mark and 0xffffff00 or {m100:#010x}"
        )), "{text}");
        assert!(text.contains(&format!(
            "ct direction reply ct mark and 0x000000ff == {m200:#010x} meta mark set meta mark and 0xffffff00 or {m200:#010x}"
        )), "{text}");
        // Only replies get the packet mark: no rule in the original
        // direction touches `meta mark`.
        assert_eq!(text.matches("meta mark set").count(), 2, "{text}");
        assert_eq!(text.matches("ct direction reply").count(), 2, "{text}");
    }

    #[test]
    fn a_network_with_a_leg_marks_its_flows_to_backends_in_its_subnet_both_ways() {
        let text = format!(
            "{KEEPALIVED}{VLAN100}table = 110\n{VLAN200}table = 200\n{}  forwarding = \"kernel\"\n{}  forwarding = \"kernel\"\n",
            lb("default/a", "10.100.0.50", "vlan100", &[]),
            lb("default/b", "10.200.0.50", "vlan200", &[]),
        );
        let config = config(&text);
        let index: BTreeMap<String, u32> =
            [("br.100".to_string(), 7), ("br.200".to_string(), 8)].into();
        let routes = crate::host::vmnet::network::wanted(&config, &index, &BTreeMap::new());
        let w = wanted(&config, &routes, &BTreeSet::from(["vlan100".to_string()]));
        let Some(MarkWant::Table(table)) = w.get(&MarkKey::Table) else {
            panic!("no table: {w:?}");
        };
        let text = render(table);
        let original = "ct direction original ct mark and 0x000000ff == 0x0000006e ct reply ip saddr 10.100.0.0/24 meta mark set meta mark and 0xffffff00 or 0x0000006e";
        // The first packet (after the conntrack mark is set) and every later one.
        assert_eq!(text.matches(original).count(), 2, "{text}");
        // vlan200 has no leg: its original direction is not marked.
        assert!(!text.contains("ct reply ip saddr 10.200.0.0/24"), "{text}");
    }

    #[test]
    fn no_kernel_listener_on_a_network_means_no_table_and_no_rule() {
        let text = format!(
            "{KEEPALIVED}{VLAN100}{}",
            lb("default/p", "10.100.0.50", "vlan100", &[])
        );
        let config = config(&text);
        let index: BTreeMap<String, u32> = [("br.100".to_string(), 7)].into();
        let routes = crate::host::vmnet::network::wanted(&config, &index, &BTreeMap::new());
        assert!(wanted(&config, &routes, &BTreeSet::from(["vlan100".to_string()])).is_empty());
    }
}

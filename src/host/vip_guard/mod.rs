//! The host's own addresses and the gateways of its routes, and whether a
//! VIP may be taken: the guard that keeps a guest cluster's Service from
//! making this host take its router's address or its own.
//!
//! A VIP comes from an object a guest cluster's admin writes. Taken as a
//! VIP, the host's router's address would be put on `lo` (the host's BGP
//! session to that router is refused from then on) and announced; the
//! host's own address would be isolated (everything else sent to it
//! dropped) or DNATed. So neither `import` nor the daemon takes as a VIP:
//!
//! - the gateway of any route of the host, in any table;
//! - an address the host holds on an interface, except one this daemon
//!   added (tagged with address protocol 252, or remembered), and a host
//!   address (/32, /128) that is plainly a VIP: with announcing, one on the
//!   announcing interface inside `announce_prefixes` (put there by hand or
//!   by an earlier run on a kernel without the tag); without announcing,
//!   one on `lo` or beside a subnet address of the same family on its
//!   interface (how keepalived and kube-vip hold a VIP they moved here);
//! - the network or broadcast address of a subnet the host is on (an
//!   IPv4 address's subnet up to /30, an IPv6 one's up to /126: its
//!   subnet-router anycast address): never one machine's;
//! - with announcing, a neighbour in the host's neighbour table (ARP, NDP)
//!   in a state that says it answered (reachable, stale, delay, probe) or
//!   that someone wrote it (permanent): a machine on the host's own link,
//!   most often its router or BGP peer, which has no route via it when the
//!   host learns nothing from it (an export-only BGP session) or when its
//!   routes use nexthop objects (FRR's `nhid`), where no route carries a
//!   gateway. Announced, the VIP is made local (`local VIP dev lo`): the
//!   host would answer for that machine to itself and lose it (its BGP
//!   session first). Without announcing the daemon makes no VIP local,
//!   and a VIP keepalived moves is a neighbour of the host that does not
//!   hold it, so the rule is the announcing one;
//! - with announcing, any VIP outside `vip.announce_prefixes`.
//!
//! Loopback VIPs (127.0.0.0/8, `::1`) are never refused: they reach only
//! this host, as the demo's `127.0.0.1:8080` does; they are never
//! announced nor put on an interface either (the announcer skips them).
//!
//! [`judge`] is the pure decision; [`HostNet::read`] reads what it needs
//! over rtnetlink (no privilege needed to read).

pub mod refusals;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::address::{AddressAttribute, AddressMessage, AddressProtocol};
use rtnetlink::packet_route::link::{InfoKind, LinkAttribute, LinkFlags, LinkInfo};
use rtnetlink::packet_route::neighbour::{NeighbourAddress, NeighbourAttribute, NeighbourState};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteHeader, RouteMessage, RouteType, RouteVia,
};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::config::AnnounceSettings;
use crate::host::announce::routes::{AnnounceError, ROUTE_PROTOCOL};

/// One address the host holds on an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HostAddress {
    /// The address.
    pub ip: IpAddr,
    /// Its prefix length.
    pub prefix_len: u8,
    /// The interface's name.
    pub interface: String,
    /// The interface's index.
    pub index: u32,
    /// Tagged with address protocol [`ROUTE_PROTOCOL`]: a harvester-lb
    /// daemon put it there as a VIP.
    pub tagged: bool,
}

/// The gateway of one of the host's routes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Gateway {
    /// The gateway's address.
    pub ip: IpAddr,
    /// The route, as `ip route` would print it (`default via 192.0.2.1
    /// dev eth0 table 254`).
    pub route: String,
    /// The interface the route (or its nexthop) goes out of.
    pub index: Option<u32>,
}

/// A `local` route (any table): the host answers for every address in it
/// (its own addresses' routes, `ip route add local 10.0.0.0/24 dev lo`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LocalRoute {
    /// The destination.
    pub net: ipnet::IpNet,
    /// The interface it is on.
    pub index: Option<u32>,
}

/// One entry of the host's neighbour table (ARP, NDP) that stands for a
/// machine on one of its links (see [`judge`] for the states kept).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Neighbour {
    /// The neighbour's address.
    pub ip: IpAddr,
    /// The interface it is on.
    pub interface: String,
    /// Its state, as `ip neigh` prints it (`REACHABLE`, `STALE`...).
    pub state: &'static str,
}

/// What the guard needs to know of the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostNet {
    /// Every address of every interface.
    pub addresses: Vec<HostAddress>,
    /// Every gateway of every route (every table, both families).
    pub gateways: Vec<Gateway>,
    /// Every `local` route (every table, both families).
    pub local_routes: Vec<LocalRoute>,
    /// Every neighbour that answered or was written by hand.
    pub neighbours: Vec<Neighbour>,
}

/// Why a VIP cannot be taken: what the host uses the address for.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// The host's own address.
    Address {
        /// Its prefix length there.
        prefix_len: u8,
        /// The interface.
        interface: String,
    },
    /// The gateway of a route of the host.
    Gateway {
        /// The route.
        route: String,
    },
    /// The network or broadcast address of a subnet the host is on.
    SubnetAddress {
        /// The subnet.
        subnet: ipnet::IpNet,
        /// `network` or `broadcast`.
        which: &'static str,
        /// The interface.
        interface: String,
    },
    /// A neighbour of the host (its router, a BGP peer, a machine on its
    /// link), with announcing.
    Neighbour {
        /// The interface it is on.
        interface: String,
        /// Its state in the neighbour table.
        state: &'static str,
    },
    /// Outside `vip.announce_prefixes`, with announcing.
    OutsidePrefixes {
        /// The prefixes, as a list.
        prefixes: String,
    },
}

impl fmt::Display for Refusal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Refusal::Address {
                prefix_len,
                interface,
            } => write!(
                f,
                "an address of this host (on interface {interface}, /{prefix_len}): taken as a VIP it would be isolated, announced or forwarded away from the host's own services"
            ),
            Refusal::Gateway { route } => write!(
                f,
                "the gateway of this host's route `{route}`: taken as a VIP it would cut the host off from its router (and its BGP session)"
            ),
            Refusal::SubnetAddress {
                subnet,
                which,
                interface,
            } => write!(
                f,
                "the {which} address of this host's subnet {subnet} (interface {interface}): no machine has it, and taken as a VIP it would be made local and announced"
            ),
            Refusal::Neighbour { interface, state } => write!(
                f,
                "a neighbour of this host on interface {interface} (neighbour table: {state}), a machine on its own link such as its router or BGP peer: announced, the VIP is made local and the host would lose that machine (and its BGP session with it)"
            ),
            Refusal::OutsidePrefixes { prefixes } => write!(
                f,
                "outside vip.announce_prefixes ({prefixes}): only VIPs inside them are announced"
            ),
        }
    }
}

impl Refusal {
    /// A short name of the kind, for `/status` (`host_address`,
    /// `gateway`, `subnet_address`, `neighbour`, `outside_announce_prefixes`).
    pub fn kind(&self) -> &'static str {
        match self {
            Refusal::Address { .. } => "host_address",
            Refusal::Gateway { .. } => "gateway",
            Refusal::SubnetAddress { .. } => "subnet_address",
            Refusal::Neighbour { .. } => "neighbour",
            Refusal::OutsidePrefixes { .. } => "outside_announce_prefixes",
        }
    }
}

/// The loopback interface, where kube-vip (BGP mode) and hand-written
/// setups hold VIPs as host addresses.
const LOOPBACK: &str = "lo";

fn host_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

/// Whether `vip` may be a VIP on this host, given what it holds (`host`),
/// the addresses this daemon added itself (`ours`) and the announcing
/// settings; `None` when it may, else why not. See the module's header.
pub fn judge(
    vip: IpAddr,
    host: &HostNet,
    ours: &BTreeSet<IpAddr>,
    announce: &AnnounceSettings,
) -> Option<Refusal> {
    let vip = vip.to_canonical();
    if vip.is_unspecified() || vip.is_loopback() {
        return None;
    }
    if let Some(g) = host.gateways.iter().find(|g| g.ip.to_canonical() == vip) {
        return Some(Refusal::Gateway {
            route: g.route.clone(),
        });
    }
    let announcing = announce.enabled();
    for a in host.addresses.iter().filter(|a| a.ip.to_canonical() == vip) {
        if a.tagged || ours.contains(&vip) {
            continue;
        }
        let host_route = a.prefix_len == host_prefix(vip);
        let plainly_a_vip = if announcing {
            host_route && a.interface == announce.interface && announce.allows(vip)
        } else {
            host_route
                && (a.interface == LOOPBACK
                    || host.addresses.iter().any(|o| {
                        o.interface == a.interface
                            && o.ip.is_ipv4() == vip.is_ipv4()
                            && o.prefix_len < host_prefix(vip)
                    }))
        };
        if !plainly_a_vip {
            return Some(Refusal::Address {
                prefix_len: a.prefix_len,
                interface: a.interface.clone(),
            });
        }
    }
    if let Some(r) = subnet_address(vip, host) {
        return Some(r);
    }
    if announcing && let Some(n) = host.neighbours.iter().find(|n| n.ip.to_canonical() == vip) {
        return Some(Refusal::Neighbour {
            interface: n.interface.clone(),
            state: n.state,
        });
    }
    if announcing && !announce.allows(vip) {
        return Some(Refusal::OutsidePrefixes {
            prefixes: announce.prefixes_text(),
        });
    }
    None
}

/// Whether `vip` is the network or broadcast address of a subnet of one of
/// the host's addresses (IPv4 up to /30, IPv6 up to /126, where the edges
/// are no machine's: RFC 3021 makes both of a /31 hosts).
fn subnet_address(vip: IpAddr, host: &HostNet) -> Option<Refusal> {
    host.addresses.iter().find_map(|a| {
        let longest = if a.ip.is_ipv4() { 30 } else { 126 };
        if a.tagged || a.prefix_len > longest || a.ip.is_ipv4() != vip.is_ipv4() {
            return None;
        }
        let subnet = ipnet::IpNet::new(a.ip, a.prefix_len).ok()?.trunc();
        let which = if subnet.network() == vip {
            "network"
        } else if a.ip.is_ipv4() && subnet.broadcast() == vip {
            "broadcast"
        } else {
            return None;
        };
        Some(Refusal::SubnetAddress {
            subnet,
            which,
            interface: a.interface.clone(),
        })
    })
}

/// The states of a neighbour entry that stand for a machine: it answered
/// (reachable, and stale, delay, probe, which follow it) or someone wrote
/// it (permanent). Not incomplete or failed (nobody answered), nor noarp
/// (no resolution at all: loopback, point-to-point, multicast).
fn neighbour_state(state: NeighbourState) -> Option<&'static str> {
    match state {
        NeighbourState::Reachable => Some("REACHABLE"),
        NeighbourState::Stale => Some("STALE"),
        NeighbourState::Delay => Some("DELAY"),
        NeighbourState::Probe => Some("PROBE"),
        NeighbourState::Permanent => Some("PERMANENT"),
        _ => None,
    }
}

/// What an interface is, for `vip.announce_interface`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LinkKind {
    /// The loopback interface.
    Loopback,
    /// A `dummy` interface.
    Dummy,
    /// Anything else (an uplink, a bridge, a veth…): its kind, or
    /// `"device"` for a physical one.
    Other(String),
}

fn netlink(what: String) -> impl FnOnce(rtnetlink::Error) -> AnnounceError {
    move |source| AnnounceError::Netlink { what, source }
}

impl HostNet {
    /// Reads every address, neighbour and route's gateway over `handle`.
    pub async fn read(handle: &Handle) -> Result<Self, AnnounceError> {
        let mut names = BTreeMap::new();
        let mut links = handle.link().get().execute();
        while let Some(m) = links
            .try_next()
            .await
            .map_err(netlink("cannot list the host's interfaces".into()))?
        {
            if let Some(name) = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            }) {
                names.insert(m.header.index, name);
            }
        }
        let name_of = |index: u32| {
            names
                .get(&index)
                .cloned()
                .unwrap_or_else(|| format!("#{index}"))
        };
        let mut out = HostNet::default();
        let mut addrs = handle.address().get().execute();
        while let Some(m) = addrs
            .try_next()
            .await
            .map_err(netlink("cannot list the host's addresses".into()))?
        {
            let Some(ip) = local_address(&m) else {
                continue;
            };
            let tagged = is_tagged(&m);
            out.addresses.push(HostAddress {
                ip,
                prefix_len: m.header.prefix_len,
                interface: name_of(m.header.index),
                index: m.header.index,
                tagged,
            });
        }
        let mut neighbours = handle.neighbours().get().execute();
        while let Some(m) = neighbours
            .try_next()
            .await
            .map_err(netlink("cannot list the host's neighbours".into()))?
        {
            let Some(state) = neighbour_state(m.header.state) else {
                continue;
            };
            let ip = m.attributes.iter().find_map(|a| match a {
                NeighbourAttribute::Destination(NeighbourAddress::Inet(v4)) => {
                    Some(IpAddr::V4(*v4))
                }
                NeighbourAttribute::Destination(NeighbourAddress::Inet6(v6)) => {
                    Some(IpAddr::V6(*v6))
                }
                _ => None,
            });
            if let Some(ip) = ip {
                out.neighbours.push(Neighbour {
                    ip,
                    interface: name_of(m.header.ifindex),
                    state,
                });
            }
        }
        for mut request in [
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            // A dump without a table filter lists every table.
            request.header.table = RouteHeader::RT_TABLE_UNSPEC;
            let mut routes = handle.route().get(request).execute();
            while let Some(m) = routes
                .try_next()
                .await
                .map_err(netlink("cannot list the host's routes".into()))?
            {
                for (gw, oif) in gateways_of(&m) {
                    out.gateways.push(Gateway {
                        ip: gw,
                        route: describe(&m, gw, oif.map(name_of)),
                        index: oif,
                    });
                }
                if m.header.kind == RouteType::Local
                    && let Some(net) = local_net(&m)
                {
                    out.local_routes.push(LocalRoute {
                        net,
                        index: route_oif(&m),
                    });
                }
            }
        }
        Ok(out)
    }

    /// [`HostNet::read`] on a runtime of its own, for a command that has
    /// none (`import`).
    pub fn read_blocking() -> Result<Self, AnnounceError> {
        blocking(|handle| async move { Self::read(&handle).await })
    }
}

/// The names of this host's interfaces, on a runtime of its own, for a
/// command that has none (`import`: a VM network's interface must exist
/// here for its load balancers to be imported).
pub fn interface_names_blocking() -> Result<BTreeSet<String>, AnnounceError> {
    blocking(|handle| async move {
        let mut names = BTreeSet::new();
        let mut links = handle.link().get().execute();
        while let Some(m) = links
            .try_next()
            .await
            .map_err(netlink("cannot list the host's interfaces".into()))?
        {
            names.extend(m.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            }));
        }
        Ok(names)
    })
}

/// Runs `f` with an rtnetlink handle on a runtime of its own.
fn blocking<T, F, Fut>(f: F) -> Result<T, AnnounceError>
where
    F: FnOnce(Handle) -> Fut,
    Fut: std::future::Future<Output = Result<T, AnnounceError>>,
{
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(AnnounceError::Socket)?;
    runtime.block_on(async {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(AnnounceError::Socket)?;
        let task = tokio::spawn(conn);
        let out = f(handle).await;
        task.abort();
        out
    })
}

fn address_of(a: &RouteAddress) -> Option<IpAddr> {
    match a {
        RouteAddress::Inet(v4) => Some(IpAddr::V4(*v4)),
        RouteAddress::Inet6(v6) => Some(IpAddr::V6(*v6)),
        _ => None,
    }
}

/// A route's output interface.
fn route_oif(m: &RouteMessage) -> Option<u32> {
    m.attributes.iter().find_map(|a| match a {
        RouteAttribute::Oif(i) => Some(*i),
        _ => None,
    })
}

/// A `local` route's destination (the whole family when it has none).
fn local_net(m: &RouteMessage) -> Option<ipnet::IpNet> {
    let destination = m
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Destination(d) => address_of(d),
            _ => None,
        })
        .unwrap_or(if m.header.address_family == AddressFamily::Inet6 {
            IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED)
        } else {
            IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)
        });
    ipnet::IpNet::new(destination, m.header.destination_prefix_length).ok()
}

/// The gateways of a route (one, or one per nexthop of a multipath
/// route), each with the interface it goes out of.
fn gateways_of(m: &RouteMessage) -> Vec<(IpAddr, Option<u32>)> {
    let oif = route_oif(m);
    let mut out = Vec::new();
    let mut from = |attrs: &[RouteAttribute], oif: Option<u32>| {
        for a in attrs {
            let gw = match a {
                RouteAttribute::Gateway(g) => address_of(g),
                RouteAttribute::Via(RouteVia::Inet(v4)) => Some(IpAddr::V4(*v4)),
                RouteAttribute::Via(RouteVia::Inet6(v6)) => Some(IpAddr::V6(*v6)),
                _ => None,
            };
            out.extend(gw.map(|g| (g, oif)));
        }
    };
    from(&m.attributes, oif);
    for a in &m.attributes {
        if let RouteAttribute::MultiPath(hops) = a {
            for hop in hops {
                from(&hop.attributes, Some(hop.interface_index));
            }
        }
    }
    out
}

/// `DST via GW dev IF table T`, as `ip route` prints it.
fn describe(m: &RouteMessage, gw: IpAddr, dev: Option<String>) -> String {
    let dst = m
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Destination(d) => address_of(d),
            _ => None,
        })
        .map_or_else(
            || "default".to_string(),
            |d| format!("{d}/{}", m.header.destination_prefix_length),
        );
    let table = m
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(m.header.table));
    let dev = dev.map(|d| format!(" dev {d}")).unwrap_or_default();
    format!("{dst} via {gw}{dev} table {table}")
}

/// The kind of interface `index` (`vip.announce_interface` must be `lo` or
/// a dummy interface: a VIP /32 on an uplink would answer ARP for it there).
pub async fn link_kind(handle: &Handle, index: u32) -> Result<LinkKind, AnnounceError> {
    let mut links = handle.link().get().match_index(index).execute();
    let Some(m) = links
        .try_next()
        .await
        .map_err(netlink(format!("cannot read interface {index}")))?
    else {
        return Ok(LinkKind::Other("gone".into()));
    };
    if m.header.flags.contains(LinkFlags::Loopback) {
        return Ok(LinkKind::Loopback);
    }
    let kind = m.attributes.iter().find_map(|a| match a {
        LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
            LinkInfo::Kind(k) => Some(k.clone()),
            _ => None,
        }),
        _ => None,
    });
    Ok(match kind {
        Some(InfoKind::Dummy) => LinkKind::Dummy,
        Some(k) => LinkKind::Other(k.to_string()),
        None => LinkKind::Other("device".into()),
    })
}

/// The address an address message is about: IPv4's own address is
/// `IFA_LOCAL` (`IFA_ADDRESS` is the peer's on a point-to-point link); IPv6
/// has `IFA_ADDRESS` only.
pub(crate) fn local_address(m: &AddressMessage) -> Option<IpAddr> {
    let local = m.attributes.iter().find_map(|a| match a {
        AddressAttribute::Local(ip) => Some(*ip),
        _ => None,
    });
    local.or_else(|| {
        m.attributes.iter().find_map(|a| match a {
            AddressAttribute::Address(ip) => Some(*ip),
            _ => None,
        })
    })
}

/// Whether an address carries the daemon's mark ([`ROUTE_PROTOCOL`] as its
/// address protocol, `IFA_PROTO`; kernels before 5.18 drop it).
pub(crate) fn is_tagged(m: &AddressMessage) -> bool {
    m.attributes.iter().any(|a| {
        matches!(a, AddressAttribute::Protocol(AddressProtocol::Other(p)) if *p == ROUTE_PROTOCOL)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::AnnounceMode;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn addr(s: &str, len: u8, dev: &str, tagged: bool) -> HostAddress {
        HostAddress {
            ip: ip(s),
            prefix_len: len,
            interface: dev.into(),
            index: 1,
            tagged,
        }
    }

    fn host() -> HostNet {
        HostNet {
            addresses: vec![
                addr("127.0.0.1", 8, "lo", false),
                addr("::1", 128, "lo", false),
                addr("192.0.2.2", 24, "eth0", false),
                addr("2001:db8::2", 64, "eth0", false),
                // keepalived's VIP beside the uplink's address.
                addr("192.0.2.201", 32, "eth0", false),
                // The router id on lo, a /32.
                addr("10.255.0.1", 32, "lo", false),
                // Our VIP (tagged) and one put on lo by hand.
                addr("203.0.113.5", 32, "lo", true),
                addr("203.0.113.6", 32, "lo", false),
                // An address alone on its interface (a cloud VM's /32).
                addr("10.128.0.5", 32, "ens4", false),
            ],
            gateways: vec![
                Gateway {
                    ip: ip("192.0.2.1"),
                    route: "default via 192.0.2.1 dev eth0 table 254".into(),
                    index: Some(2),
                },
                Gateway {
                    ip: ip("fe80::1"),
                    route: "default via fe80::1 dev eth0 table 254".into(),
                    index: Some(2),
                },
            ],
            local_routes: Vec::new(),
            neighbours: vec![
                // The BGP peer on the uplink, with no route via it.
                Neighbour {
                    ip: ip("192.0.2.9"),
                    interface: "eth0".into(),
                    state: "REACHABLE",
                },
                Neighbour {
                    ip: ip("2001:db8::9"),
                    interface: "eth0".into(),
                    state: "STALE",
                },
            ],
        }
    }

    fn routes(prefixes: &[&str]) -> AnnounceSettings {
        AnnounceSettings {
            mode: AnnounceMode::Routes,
            prefixes: prefixes.iter().map(|p| p.parse().unwrap()).collect(),
            ..AnnounceSettings::default()
        }
    }

    fn kind(vip: &str, a: &AnnounceSettings) -> Option<&'static str> {
        judge(ip(vip), &host(), &BTreeSet::new(), a).map(|r| r.kind())
    }

    #[test]
    fn the_hosts_own_address_and_its_gateway_are_refused_in_every_mode() {
        for a in [AnnounceSettings::default(), routes(&["192.0.2.0/24"])] {
            assert_eq!(kind("192.0.2.2", &a), Some("host_address"));
            assert_eq!(kind("::ffff:192.0.2.2", &a), Some("host_address"));
            assert_eq!(kind("192.0.2.1", &a), Some("gateway"));
            assert_eq!(kind("10.128.0.5", &a), Some("host_address"));
        }
        assert_eq!(
            kind("2001:db8::2", &AnnounceSettings::default()),
            Some("host_address")
        );
        let r = judge(
            ip("192.0.2.1"),
            &host(),
            &BTreeSet::new(),
            &AnnounceSettings::default(),
        )
        .unwrap();
        assert!(
            r.to_string().contains("default via 192.0.2.1 dev eth0"),
            "{r}"
        );
    }

    #[test]
    fn without_announcing_a_moved_vip_beside_the_interfaces_address_is_taken() {
        let none = AnnounceSettings::default();
        assert_eq!(kind("192.0.2.201", &none), None, "keepalived's VIP");
        assert_eq!(kind("10.255.0.1", &none), None, "a /32 on lo");
        let mut h = host();
        h.addresses.push(addr("2001:db8:99::1", 128, "lo", false));
        h.addresses.push(addr("2001:db8:77::1", 128, "ens4", false));
        let judge6 = |vip: &str| judge(ip(vip), &h, &BTreeSet::new(), &none).map(|r| r.kind());
        assert_eq!(
            judge6("2001:db8:99::1"),
            None,
            "a /128 on lo (only ::1 beside)"
        );
        assert_eq!(
            judge6("2001:db8:77::1"),
            Some("host_address"),
            "alone on ens4"
        );
        assert_eq!(kind("198.51.100.7", &none), None, "held by nobody");
    }

    #[test]
    fn with_announcing_only_vips_inside_the_prefixes_and_not_the_hosts() {
        let a = routes(&["203.0.113.0/24"]);
        assert_eq!(kind("203.0.113.5", &a), None, "tagged: ours");
        assert_eq!(kind("203.0.113.6", &a), None, "a /32 on lo inside");
        assert_eq!(kind("203.0.113.7", &a), None, "held by nobody");
        assert_eq!(kind("198.51.100.7", &a), Some("outside_announce_prefixes"));
        assert_eq!(kind("10.255.0.1", &a), Some("host_address"), "router id");
        assert_eq!(kind("192.0.2.201", &a), Some("host_address"), "on eth0");
        // Inside the prefixes is no pass for the host's own address.
        let wide = routes(&["10.0.0.0/8", "192.0.2.0/24"]);
        assert_eq!(kind("10.255.0.1", &wide), None, "a /32 on lo inside");
        assert_eq!(kind("192.0.2.2", &wide), Some("host_address"));
        // On another announcing interface, lo's /32 is the host's.
        let dummy = AnnounceSettings {
            interface: "dummy0".into(),
            ..routes(&["203.0.113.0/24"])
        };
        assert_eq!(kind("203.0.113.6", &dummy), Some("host_address"));
        assert_eq!(kind("203.0.113.5", &dummy), None, "tagged");
    }

    #[test]
    fn addresses_this_daemon_added_and_loopback_vips_are_taken() {
        let a = routes(&["203.0.113.0/24"]);
        let ours: BTreeSet<IpAddr> = [ip("203.0.113.6")].into();
        let dummy = AnnounceSettings {
            interface: "dummy0".into(),
            ..a.clone()
        };
        assert_eq!(judge(ip("203.0.113.6"), &host(), &ours, &dummy), None);
        for lo in ["127.0.0.1", "127.0.9.1", "::1"] {
            assert_eq!(kind(lo, &a), None, "{lo}");
            assert_eq!(kind(lo, &AnnounceSettings::default()), None, "{lo}");
        }
        assert_eq!(kind("0.0.0.0", &a), None, "a lease not yet in force");
    }

    #[test]
    fn a_neighbour_is_refused_when_announced_and_a_subnets_edges_always() {
        // Issue 40: announce_prefixes covering the uplink's own subnet.
        let a = routes(&["192.0.2.0/24", "2001:db8::/64"]);
        assert_eq!(kind("192.0.2.9", &a), Some("neighbour"), "the BGP peer");
        assert_eq!(kind("2001:db8::9", &a), Some("neighbour"));
        assert_eq!(kind("192.0.2.10", &a), None, "nobody's");
        let r = judge(ip("192.0.2.9"), &host(), &BTreeSet::new(), &a).unwrap();
        assert!(
            r.to_string()
                .contains("interface eth0 (neighbour table: REACHABLE)"),
            "{r}"
        );
        // Without announcing nothing makes it local (and keepalived's VIP
        // held by the other host is a neighbour here).
        assert_eq!(kind("192.0.2.9", &AnnounceSettings::default()), None);
        for mode in [AnnounceSettings::default(), a.clone()] {
            assert_eq!(kind("192.0.2.0", &mode), Some("subnet_address"));
            assert_eq!(kind("192.0.2.255", &mode), Some("subnet_address"));
            assert_eq!(kind("2001:db8::", &mode), Some("subnet_address"));
        }
        let r = judge(ip("192.0.2.255"), &host(), &BTreeSet::new(), &a).unwrap();
        assert!(
            r.to_string()
                .contains("broadcast address of this host's subnet 192.0.2.0/24"),
            "{r}"
        );
        // A /32 (or a /31's two hosts) has no edge that is no machine's.
        let mut h = host();
        h.addresses.push(addr("10.9.0.0", 31, "p2p0", false));
        assert_eq!(
            judge(
                ip("10.9.0.1"),
                &h,
                &BTreeSet::new(),
                &routes(&["10.9.0.0/31"])
            ),
            None
        );
        assert_eq!(
            kind("10.128.0.5", &AnnounceSettings::default()),
            Some("host_address")
        );
    }
}

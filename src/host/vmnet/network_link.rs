//! What a `[[network]]`'s interface is on this host, and whether a VM
//! network can be on it: the daemon's link-level check at start and at
//! every reload (`check` and import judge the name only, with
//! [`crate::config::not_a_vm_network_interface`]: they run anywhere).
//!
//! A VM network reaches a Harvester host on a bridge (`mgmt-br`,
//! `<cluster network>-br`), a VLAN device on one (`mgmt-br.100`) or a bond
//! (`<cluster network>-bo`); a test bed's or a lab's veth is taken too (its
//! host end of a VM's link). Anything else (the loopback, a macvlan, a
//! tunnel, a physical NIC that is a bond's slave or the host's uplink) is
//! never one, and isolating it (`host::vmnet::vmnet_filter`) would take the host's
//! own traffic there: `lo` stopped every service on 127.0.0.1, the
//! daemon's `/readyz` included.
//!
//! An isolated network may also not be on an interface that carries the
//! host's own traffic: one that holds the management address
//! (`keepalived.address`), or is the way out of a route of the host's that
//! is neither the kernel's route of its own subnet nor this daemon's (`proto
//! 252`), nor in a VM network's own table: the default route above all
//! (the management network), a route through a gateway, a CNI's route to a
//! pod. The guard would drop every new connection entering there, and the
//! reverse-path check would drop what the host routes back out of it.
//!
//! Reads only (rtnetlink dumps of links, addresses and routes); writes
//! nothing.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, LinkInfo};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteType,
};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::config::NetworkSpec;
use crate::host::announce::routes::{AnnounceError, ROUTE_PROTOCOL, table_of};
use crate::host::vip_guard::local_address;

/// The kinds of link a VM network can be on (`IFLA_INFO_KIND`).
pub const VM_NETWORK_KINDS: [&str; 4] = ["bridge", "vlan", "bond", "veth"];

/// The `local` routing table: every address's own routes, never a way out.
const LOCAL_TABLE: u32 = 255;

/// One interface of the host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Link {
    /// Its index.
    pub index: u32,
    /// `IFLA_INFO_KIND` (`bridge`, `vlan`…); `None` for a device without
    /// one (a physical NIC).
    pub kind: Option<String>,
    /// `IFF_LOOPBACK`.
    pub loopback: bool,
}

/// One route of the host that goes out of an interface.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Route {
    /// The interface it goes out of (each nexthop's, for a multipath one).
    pub index: u32,
    /// Its table.
    pub table: u32,
    /// Its protocol (`proto kernel` is 2, this daemon's 252).
    pub protocol: u8,
    /// As `ip route` prints it, for messages.
    pub text: String,
}

/// What the check reads of the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostLinks {
    /// Every interface, by name.
    pub links: BTreeMap<String, Link>,
    /// Every address, with its interface's index.
    pub addresses: Vec<(IpAddr, u32)>,
    /// Every unicast route with an interface, every table.
    pub routes: Vec<Route>,
}

/// Why a network's interface is refused.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Refusal {
    /// `not_a_vm_network_link`, `management_interface` or `host_routes`.
    pub kind: &'static str,
    /// What the host has there, in words.
    pub reason: String,
}

fn netlink(what: &'static str) -> impl FnOnce(rtnetlink::Error) -> AnnounceError {
    move |source| AnnounceError::Netlink {
        what: what.to_string(),
        source,
    }
}

impl HostLinks {
    /// Reads every link, address and route over `handle`.
    pub async fn read(handle: &Handle) -> Result<Self, AnnounceError> {
        let mut out = HostLinks::default();
        let mut links = handle.link().get().execute();
        while let Some(m) = links
            .try_next()
            .await
            .map_err(netlink("cannot list the host's interfaces"))?
        {
            let Some(name) = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => Some(n.clone()),
                _ => None,
            }) else {
                continue;
            };
            let kind = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::LinkInfo(infos) => infos.iter().find_map(|i| match i {
                    LinkInfo::Kind(k) => Some(k.to_string()),
                    _ => None,
                }),
                _ => None,
            });
            out.links.insert(
                name,
                Link {
                    index: m.header.index,
                    kind,
                    loopback: m.header.flags.contains(LinkFlags::Loopback),
                },
            );
        }
        let mut addrs = handle.address().get().execute();
        while let Some(m) = addrs
            .try_next()
            .await
            .map_err(netlink("cannot list the host's addresses"))?
        {
            if let Some(ip) = local_address(&m) {
                out.addresses.push((ip, m.header.index));
            }
        }
        let names: BTreeMap<u32, String> = out
            .links
            .iter()
            .map(|(n, l)| (l.index, n.clone()))
            .collect();
        for mut request in [
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            request.header.table = rtnetlink::packet_route::route::RouteHeader::RT_TABLE_UNSPEC;
            let mut routes = handle.route().get(request).execute();
            while let Some(m) = routes
                .try_next()
                .await
                .map_err(netlink("cannot list the host's routes"))?
            {
                if m.header.kind != RouteType::Unicast {
                    continue;
                }
                for index in oifs(&m) {
                    out.routes.push(Route {
                        index,
                        table: table_of(&m),
                        protocol: u8::from(m.header.protocol),
                        text: describe(&m, names.get(&index).map(String::as_str)),
                    });
                }
            }
        }
        Ok(out)
    }
}

/// The interfaces a route goes out of.
fn oifs(m: &RouteMessage) -> Vec<u32> {
    let mut out: Vec<u32> = m
        .attributes
        .iter()
        .filter_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        })
        .collect();
    for a in &m.attributes {
        if let RouteAttribute::MultiPath(hops) = a {
            out.extend(hops.iter().map(|h| h.interface_index));
        }
    }
    out
}

/// `DST [via GW] dev IF proto P table T`, near enough to `ip route`'s.
fn describe(m: &RouteMessage, dev: Option<&str>) -> String {
    let dst = m
        .attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Destination(RouteAddress::Inet(d)) => Some(IpAddr::V4(*d)),
            RouteAttribute::Destination(RouteAddress::Inet6(d)) => Some(IpAddr::V6(*d)),
            _ => None,
        })
        .map_or_else(
            || "default".to_string(),
            |d| format!("{d}/{}", m.header.destination_prefix_length),
        );
    let via = m
        .attributes
        .iter()
        .any(|a| matches!(a, RouteAttribute::Gateway(_) | RouteAttribute::Via(_)));
    format!(
        "{dst}{} dev {} proto {} table {}",
        if via { " via a gateway" } else { "" },
        dev.unwrap_or("?"),
        u8::from(m.header.protocol),
        table_of(m)
    )
}

/// Whether `net` may be on its interface on a host `host` whose management
/// address is `management` (`keepalived.address`), the VM networks' own
/// tables being `own_tables`. `None`: it may (a missing interface is not
/// judged here: the daemon refuses its load balancers as
/// `no_network_interface`).
pub fn judge(
    net: &NetworkSpec,
    host: &HostLinks,
    management: Option<IpAddr>,
    own_tables: &BTreeSet<u32>,
) -> Option<Refusal> {
    let link = host.links.get(&net.interface)?;
    let kind = link.kind.as_deref();
    if link.loopback || !kind.is_some_and(|k| VM_NETWORK_KINDS.contains(&k)) {
        return Some(Refusal {
            kind: "not_a_vm_network_link",
            reason: format!(
                "interface {:?} is {}, not a bridge, a VLAN device or a bond: no VM network is on it (isolating it would take this host's own traffic there)",
                net.interface,
                if link.loopback {
                    "the loopback".to_string()
                } else {
                    kind.map_or("a device without a link kind (a NIC)".to_string(), |k| {
                        format!("a {k} link")
                    })
                }
            ),
        });
    }
    if !net.isolate {
        return None;
    }
    if let Some(m) = management
        && host
            .addresses
            .iter()
            .any(|(ip, index)| *ip == m && *index == link.index)
    {
        return Some(Refusal {
            kind: "management_interface",
            reason: format!(
                "interface {:?} holds this host's management address {m} (keepalived.address): isolating it would drop every new connection to this host from the management network; a VM network there needs isolate = false, or its own interface",
                net.interface
            ),
        });
    }
    let carried: Vec<&str> = host
        .routes
        .iter()
        .filter(|r| {
            r.index == link.index
                && r.table != LOCAL_TABLE
                && !own_tables.contains(&r.table)
                && r.protocol != u8::from(RouteProtocol::Kernel)
                && r.protocol != u8::from(RouteProtocol::Ra)
                && r.protocol != ROUTE_PROTOCOL
        })
        .map(|r| r.text.as_str())
        .collect();
    if !carried.is_empty() {
        return Some(Refusal {
            kind: "host_routes",
            reason: format!(
                "interface {:?} carries routes of this host ({}): it is the host's own way out (its management or uplink network), not a tenant's VM network; isolating it would drop what the host routes back out of it",
                net.interface,
                carried.join("; ")
            ),
        });
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{config, networks};

    fn host(kind: Option<&str>, routes: &[(u32, u8, &str)]) -> HostLinks {
        let mut h = HostLinks::default();
        h.links.insert(
            "cluster-br.100".into(),
            Link {
                index: 7,
                kind: kind.map(str::to_string),
                loopback: false,
            },
        );
        // A loopback by another name.
        h.links.insert(
            "loopy".into(),
            Link {
                index: 1,
                kind: None,
                loopback: true,
            },
        );
        h.addresses.push(("10.100.0.3".parse().unwrap(), 7));
        for (table, protocol, text) in routes {
            h.routes.push(Route {
                index: 7,
                table: *table,
                protocol: *protocol,
                text: text.to_string(),
            });
        }
        h
    }

    #[test]
    fn only_a_bridge_vlan_bond_or_veth_without_the_host_s_routes_is_a_vm_network() {
        let c = config(&networks("", "interface = \"loopy\"\nisolate = false\n"));
        let (a, b) = (&c.networks[0], &c.networks[1]);
        let tables: BTreeSet<u32> = c.networks.iter().map(|n| n.table).collect();
        let own = [(254, 2, "10.100.0.0/24 dev cluster-br.100 proto 2 table 254")];
        for kind in VM_NETWORK_KINDS {
            assert_eq!(judge(a, &host(Some(kind), &own), None, &tables), None);
        }
        for kind in [None, Some("macvlan"), Some("vxlan")] {
            let r = judge(a, &host(kind, &own), None, &tables).expect("refused");
            assert_eq!(r.kind, "not_a_vm_network_link", "{r:?}");
        }
        // The loopback, even not isolated.
        let r = judge(b, &host(Some("bridge"), &own), None, &tables).expect("refused");
        assert!(r.reason.contains("the loopback"), "{r:?}");
        // The management address, the default route, a CNI's route.
        let r = judge(
            a,
            &host(Some("bridge"), &own),
            Some("10.100.0.3".parse().unwrap()),
            &tables,
        )
        .expect("refused");
        assert_eq!(r.kind, "management_interface");
        for route in [
            (
                254,
                3,
                "default via a gateway dev cluster-br.100 proto 3 table 254",
            ),
            (
                254,
                80,
                "10.42.0.5/32 dev cluster-br.100 proto 80 table 254",
            ),
        ] {
            let r = judge(a, &host(Some("bridge"), &[route]), None, &tables).expect("refused");
            assert_eq!(r.kind, "host_routes");
            assert!(r.reason.contains(route.2), "{r:?}");
        }
        // The daemon's own routes, in the network's table or marked 252.
        for route in [
            (
                a.table,
                252,
                "default via a gateway dev cluster-br.100 proto 252",
            ),
            (254, 252, "x"),
        ] {
            assert_eq!(
                judge(a, &host(Some("bridge"), &[route]), None, &tables),
                None
            );
        }
        // Not isolated: the host's own traffic is not at stake.
        let mut open = a.clone();
        open.isolate = false;
        assert_eq!(
            judge(
                &open,
                &host(Some("bridge"), &[(254, 3, "default")]),
                Some("10.100.0.3".parse().unwrap()),
                &tables
            ),
            None
        );
    }
}

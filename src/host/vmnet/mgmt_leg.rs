//! The management VIPs' **leg**: a network leg (`host::vmnet::leg`) on the bridge
//! of `keepalived.interface`, with a routing table of its own
//! (`keepalived.management_table`) holding **the main table's routes out
//! of that interface, rewritten onto the leg**, through which the
//! management VIPs' kernel-forwarded flows are routed.
//!
//! Why: on a Harvester host the management address and the management
//! VIPs are on `mgmt-br`, a Linux bridge with the uplink bond as its port
//! and `br_netfilter` on. A client's frame to a management VIP is DNATed
//! at the bridge stage, and when the backend's route leaves by the bridge
//! itself (a backend on the management subnet, or behind its gateway) the
//! frame is bridged back toward the port it came in by, which the bridge
//! refuses: nothing reaches the backend. A VM network has its own table
//! to route by the leg; a management VIP has the host's main table, which
//! must stay as it is (the host's own traffic, kubelet's, the CNI's). So
//! its flows get a table of their own, the main table's routes by the
//! bridge copied onto the leg (the connected subnets and the gateways'
//! routes, IPv4 and IPv6), and the mark of that table on both directions
//! (`host::vmnet::replymark`); `snat to` the VIP replaces `masquerade`, as on a
//! leg network (the leg has no address).
//!
//! Which VIPs: those the configured keepalived moves on
//! `keepalived.interface` ([`crate::config::Config::keepalived_interface`]),
//! with a `forwarding = "kernel"` listener and a backend the main table
//! routes out of that interface, when the interface is a Linux bridge and
//! the VIP's family's frames pass the IP hooks at the bridge stage (what
//! `daemon::kernel::blocked`'s `off_network_reason` hands to the proxy without a
//! leg; with the stage off the routed path by the bridge serves, and a leg
//! would only cost the bridge's promiscuity: `host::vmnet::leg`). VIPs announced
//! by BGP (`vip.announce = "routes"`) are not moved by keepalived and keep
//! that fallback.
//!
//! The table follows the main table: [`table_routes`] is derived again
//! from [`main_routes`] at every step of the VM-network task (every apply,
//! every 10 s, and when the kernel writer's 5 s look at the sysctls finds
//! the main table's routes out of the bridge changed), so a route of the
//! main table by the bridge that changes (a DHCP renewal's gateway, an
//! operator's static route) is in the leg's table within about 5 s (an
//! IPv6 one within 10 s: the 5 s look reads `/proc/net/route` only). The routes are owned by the same driver
//! as the networks' tables (`host::vmnet::network`, kind `network_route`): read
//! back, repaired, removed after the drain at a clean stop, kept across a
//! hand-over.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use futures_util::TryStreamExt;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::route::{RouteAddress, RouteAttribute, RouteMessage, RouteType};
use rtnetlink::{Handle, RouteMessageBuilder};

use crate::config::{Config, Forwarding};
use crate::host::announce::routes::{AnnounceError, table_of};
use crate::host::vmnet::leg::{LegKey, LegStatus};
use crate::host::vmnet::network::{NetKey, NetState};
use crate::host::vmnet::replymark::{MarkKey, MarkTable, MarkWant, mark_of};

/// The kernel's main table.
const MAIN_TABLE: u32 = 254;

/// One route of the main table out of the management interface.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct MainRoute {
    /// Its destination (`0.0.0.0/0`, `::/0` for a default route).
    pub dest: IpNet,
    /// Its next hop; `None` for an on-link (connected) route.
    pub gateway: Option<IpAddr>,
}

/// What the management VIPs need of a leg on this host: the bridge it is
/// on, its table and the VIPs whose flows are marked for it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MgmtLeg {
    /// `keepalived.interface`, a Linux bridge.
    pub interface: String,
    /// `keepalived.management_table`.
    pub table: u32,
    /// The management VIPs whose kernel listeners need it.
    pub vips: BTreeSet<IpAddr>,
    /// Their backends the main table routes out of `interface`: the
    /// client's packets to them are routed by the leg's table too.
    pub backends: BTreeSet<IpAddr>,
}

impl MgmtLeg {
    /// The leg, of the network legs' kind (`host::vmnet::leg`), named after the
    /// table (`hleg999` by default).
    pub fn key(&self) -> LegKey {
        LegKey { table: self.table }
    }

    /// Adds the management VIPs' marks to `marks` (`replymark::wanted`'s):
    /// the flows to the VIPs that come in by the bridge get the table's
    /// mark, both directions of those to a backend routed out of the
    /// bridge carry it on the packet, and a `fwmark` rule per family looks
    /// up the leg's table.
    pub fn add_marks(&self, marks: &mut BTreeMap<MarkKey, MarkWant>) {
        let mark = mark_of(self.table);
        for v6 in [false, true] {
            if self.vips.iter().any(|v| v.is_ipv6() == v6) {
                marks.insert(
                    MarkKey::Rule { v6, mark },
                    MarkWant::Rule { table: self.table },
                );
            }
        }
        let entry = marks
            .entry(MarkKey::Table)
            .or_insert_with(|| MarkWant::Table(MarkTable::default()));
        let MarkWant::Table(t) = entry else {
            return;
        };
        t.vips.entry(mark).or_default().extend(&self.vips);
        t.legs
            .entry(mark)
            .or_default()
            .extend(self.backends.iter().map(|b| IpNet::from(*b)));
        t.ingress.insert(mark, self.interface.clone());
    }
}

/// What `/status` shows of the management VIPs' leg (`management_leg`):
/// the kernel's objects as last read back.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct MgmtLegStatus {
    /// `keepalived.interface`, the bridge it is on.
    pub interface: String,
    /// Its routing table (`keepalived.management_table`).
    pub table: u32,
    /// The leg itself: name, MAC, state, error.
    pub leg: LegStatus,
    /// The routes of the table held at the last read-back.
    pub routes: Vec<String>,
    /// The management VIPs whose kernel listeners it routes (a set: the
    /// kernel writer asks it once per load balancer at each rebuild).
    pub vips: BTreeSet<IpAddr>,
    /// Whether the leg, its table's routes, the `fwmark` rule and the
    /// marks' table are all in place: only then are those listeners in
    /// the kernel (else the proxy serves them, `kernel_error` saying why).
    pub in_place: bool,
    /// Why it is not in place, while it is not.
    pub error: Option<String>,
}

/// Whether `config` needs the management VIPs' leg, and for which VIPs:
/// see the module's text. `device_for` is the device the main table routes
/// an address out of (`os::Routes`), `stage_on` whether an interface is
/// a Linux bridge whose IPv4 (`false`) or IPv6 (`true`) frames pass the IP
/// hooks at the bridge stage now ([`crate::host::vmnet::leg::bridge_stage_on`]: as a
/// network's leg, only for a VIP of a family whose stage is on). Pure.
pub fn needed(
    config: &Config,
    device_for: impl Fn(IpAddr) -> Option<String>,
    stage_on: impl Fn(&str, bool) -> bool,
) -> Option<MgmtLeg> {
    let k = config.keepalived.as_ref()?;
    let mut vips = BTreeSet::new();
    let mut backends = BTreeSet::new();
    for lb in &config.load_balancers {
        let kernel = lb
            .listeners
            .iter()
            .any(|l| l.forwarding == Forwarding::Kernel);
        if lb.network.is_some()
            || !stage_on(&k.interface, lb.vip.is_ipv6())
            || !kernel
            || config.keepalived_interface(lb) != Some(k.interface.as_str())
        {
            continue;
        }
        let by_bridge: Vec<IpAddr> = lb
            .backends
            .iter()
            .filter(|b| device_for(**b).as_deref() == Some(k.interface.as_str()))
            .copied()
            .collect();
        if !by_bridge.is_empty() {
            vips.insert(lb.vip);
            backends.extend(by_bridge);
        }
    }
    (!vips.is_empty()).then(|| MgmtLeg {
        interface: k.interface.clone(),
        table: k.management_table,
        vips,
        backends,
    })
}

/// [`needed`] on this host: its main table's routes (`os::Routes`, read
/// at most once a second) and its bridges' switches now.
pub fn on_this_host(config: &Config) -> Option<MgmtLeg> {
    needed(
        config,
        |ip| {
            crate::os::Routes::read_recent(ip.is_ipv6())
                .device_for(ip)
                .map(str::to_string)
        },
        crate::host::vmnet::leg::bridge_stage_on,
    )
}

/// The leg's table: each of `main` (the main table's routes out of the
/// bridge) in `table`, out of the leg (interface index `leg`), through
/// the same next hop. Pure.
pub fn table_routes(table: u32, leg: u32, main: &[MainRoute]) -> BTreeMap<NetKey, NetState> {
    main.iter()
        .map(|r| {
            (
                NetKey::Route {
                    table,
                    dest: r.dest,
                },
                NetState::Route {
                    interface: Some(leg),
                    gateway: r.gateway,
                },
            )
        })
        .collect()
}

/// The main table's unicast routes out of interface `index`, IPv4 and
/// IPv6, as copied onto the leg: multipath routes (no one device), the
/// IPv6 link-local and multicast prefixes (every interface has its own)
/// and a second route to one destination (another metric) are left out.
pub async fn main_routes(handle: &Handle, index: u32) -> Result<Vec<MainRoute>, AnnounceError> {
    let mut out: BTreeMap<IpNet, Option<IpAddr>> = BTreeMap::new();
    let requests = [
        RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
        RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
    ];
    for request in requests {
        let mut routes = handle.route().get(request).execute();
        while let Some(m) = routes
            .try_next()
            .await
            .map_err(|source| AnnounceError::Netlink {
                what: "cannot list the main table's routes".into(),
                source,
            })?
        {
            if let Some(r) = main_route(&m, index) {
                out.entry(r.dest).or_insert(r.gateway);
            }
        }
    }
    Ok(out
        .into_iter()
        .map(|(dest, gateway)| MainRoute { dest, gateway })
        .collect())
}

/// `m` as a route of [`main_routes`], when it is one.
fn main_route(m: &RouteMessage, index: u32) -> Option<MainRoute> {
    if table_of(m) != MAIN_TABLE || m.header.kind != RouteType::Unicast {
        return None;
    }
    let mut oif = None;
    let mut dest = None;
    let mut gateway = None;
    for a in &m.attributes {
        match a {
            RouteAttribute::Oif(i) => oif = Some(*i),
            RouteAttribute::MultiPath(_) => return None,
            RouteAttribute::Destination(RouteAddress::Inet(v4)) => dest = Some(IpAddr::V4(*v4)),
            RouteAttribute::Destination(RouteAddress::Inet6(v6)) => dest = Some(IpAddr::V6(*v6)),
            RouteAttribute::Gateway(RouteAddress::Inet(v4)) => gateway = Some(IpAddr::V4(*v4)),
            RouteAttribute::Gateway(RouteAddress::Inet6(v6)) => gateway = Some(IpAddr::V6(*v6)),
            _ => {}
        }
    }
    if oif != Some(index) {
        return None;
    }
    let len = m.header.destination_prefix_length;
    let dest = match (dest, m.header.address_family) {
        (Some(IpAddr::V4(d)), _) => IpNet::V4(Ipv4Net::new(d, len).ok()?),
        (Some(IpAddr::V6(d)), _) => IpNet::V6(Ipv6Net::new(d, len).ok()?),
        (None, AddressFamily::Inet) if len == 0 => IpNet::V4(Ipv4Net::default()),
        (None, AddressFamily::Inet6) if len == 0 => IpNet::V6(Ipv6Net::default()),
        _ => return None,
    };
    if let IpNet::V6(d) = dest
        && (d.addr().is_unicast_link_local() || d.addr().is_multicast())
    {
        return None;
    }
    Some(MainRoute { dest, gateway })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{KEEPALIVED, config};

    fn mgmt_lb(name: &str, vip: &str, backends: &[&str], kernel: bool) -> String {
        let list: Vec<String> = backends.iter().map(|b| format!("{b:?}")).collect();
        format!(
            "[[load_balancer]]\nname = {name:?}\nvip = {vip:?}\nbackends = [{}]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 8080\n{}",
            list.join(", "),
            if kernel {
                "  forwarding = \"kernel\"\n"
            } else {
                ""
            }
        )
    }

    #[test]
    fn only_kernel_management_vips_with_a_backend_out_of_the_bridge_need_the_leg() {
        let text = format!(
            "{KEEPALIVED}{}{}{}",
            mgmt_lb("default/near", "192.168.0.100", &["192.168.0.20"], true),
            mgmt_lb("default/proxied", "192.168.0.101", &["192.168.0.21"], false),
            mgmt_lb("default/elsewhere", "192.168.0.102", &["10.50.0.20"], true),
        );
        let config = config(&text);
        let interface = config.keepalived.as_ref().unwrap().interface.clone();
        let device_for = |ip: IpAddr| {
            let ip = ip.to_string();
            Some(if ip.starts_with("192.168.0.") {
                interface.clone()
            } else {
                "eth9".to_string()
            })
        };
        let leg = needed(&config, device_for, |i, _| i == interface).expect("a leg");
        assert_eq!(leg.interface, interface);
        assert_eq!(leg.table, crate::config::DEFAULT_MANAGEMENT_TABLE);
        assert_eq!(
            leg.vips.iter().map(ToString::to_string).collect::<Vec<_>>(),
            ["192.168.0.100"]
        );
        // No bridge (a plain NIC or a VLAN device): no leg.
        assert_eq!(needed(&config, device_for, |_, _| false), None);
    }

    #[test]
    fn the_management_vips_flows_from_the_bridge_are_marked_both_ways_to_their_backends() {
        let leg = MgmtLeg {
            interface: "mgmt0".into(),
            table: 999,
            vips: ["192.168.0.100".parse().unwrap()].into(),
            backends: ["10.200.0.20".parse().unwrap()].into(),
        };
        let mut marks = BTreeMap::new();
        leg.add_marks(&mut marks);
        assert_eq!(
            marks.get(&MarkKey::Rule {
                v6: false,
                mark: 0xea
            }),
            Some(&MarkWant::Rule { table: 999 })
        );
        assert!(!marks.contains_key(&MarkKey::Rule {
            v6: true,
            mark: 0xea
        }));
        let Some(MarkWant::Table(t)) = marks.get(&MarkKey::Table) else {
            panic!("no table: {marks:?}");
        };
        let text = crate::host::vmnet::replymark::render(t);
        // Only the flows that come in by the bridge: a pod's (by the CNI's
        // interface) keeps the main table.
        assert!(
            text.contains("iifname \"mgmt0\" ct state new ct status dnat ct original ip daddr { 192.168.0.100 } ct mark set ct mark and 0xffffff00 or 0x000000ea"),
            "{text}"
        );
        // The client's packets to a backend routed out of the bridge, first and later ones.
        assert_eq!(
            text.matches("ct direction original ct mark and 0x000000ff == 0x000000ea ct reply ip saddr 10.200.0.20/32 meta mark set").count(),
            2,
            "{text}"
        );
        assert!(
            text.contains("ct direction reply ct mark and 0x000000ff == 0x000000ea meta mark set"),
            "{text}"
        );
    }

    #[test]
    fn the_leg_s_table_is_the_main_table_s_routes_by_the_bridge_moved_onto_the_leg() {
        let main = [
            MainRoute {
                dest: "0.0.0.0/0".parse().unwrap(),
                gateway: Some("10.0.0.1".parse().unwrap()),
            },
            MainRoute {
                dest: "10.0.0.0/24".parse().unwrap(),
                gateway: None,
            },
            MainRoute {
                dest: "::/0".parse().unwrap(),
                gateway: Some("fe80::1".parse().unwrap()),
            },
        ];
        let got: Vec<String> = table_routes(999, 42, &main)
            .iter()
            .map(|(k, v)| format!("{k} {v:?}"))
            .collect();
        assert_eq!(
            got,
            [
                "route 0.0.0.0/0 table 999 Route { interface: Some(42), gateway: Some(10.0.0.1) }",
                "route 10.0.0.0/24 table 999 Route { interface: Some(42), gateway: None }",
                "route ::/0 table 999 Route { interface: Some(42), gateway: Some(fe80::1) }",
            ]
        );
    }

    #[test]
    fn only_the_main_table_s_unicast_routes_out_of_the_interface_are_copied() {
        let route = |table: u8, oif: u32, dest: &str, gateway: Option<&str>| {
            let net: IpNet = dest.parse().unwrap();
            let mut m = RouteMessage::default();
            m.header.table = table;
            m.header.kind = RouteType::Unicast;
            m.header.destination_prefix_length = net.prefix_len();
            m.header.address_family = match net {
                IpNet::V4(_) => AddressFamily::Inet,
                IpNet::V6(_) => AddressFamily::Inet6,
            };
            m.attributes.push(RouteAttribute::Oif(oif));
            if net.prefix_len() > 0 {
                m.attributes
                    .push(RouteAttribute::Destination(match net.addr() {
                        IpAddr::V4(a) => RouteAddress::Inet(a),
                        IpAddr::V6(a) => RouteAddress::Inet6(a),
                    }));
            }
            if let Some(g) = gateway {
                m.attributes
                    .push(RouteAttribute::Gateway(match g.parse().unwrap() {
                        IpAddr::V4(a) => RouteAddress::Inet(a),
                        IpAddr::V6(a) => RouteAddress::Inet6(a),
                    }));
            }
            m
        };
        let default = route(254, 3, "0.0.0.0/0", Some("10.0.0.1"));
        assert_eq!(
            main_route(&default, 3),
            Some(MainRoute {
                dest: "0.0.0.0/0".parse().unwrap(),
                gateway: Some("10.0.0.1".parse().unwrap()),
            })
        );
        assert_eq!(main_route(&default, 4), None, "another interface's");
        assert_eq!(
            main_route(&route(100, 3, "0.0.0.0/0", Some("10.0.0.1")), 3),
            None,
            "another table's"
        );
        assert_eq!(
            main_route(&route(254, 3, "fe80::/64", None), 3),
            None,
            "link-local"
        );
        let mut local = route(254, 3, "10.0.0.5/32", None);
        local.header.kind = RouteType::Local;
        assert_eq!(main_route(&local, 3), None, "not unicast");
        assert!(main_route(&route(254, 3, "fd00::/64", None), 3).is_some());
    }
}

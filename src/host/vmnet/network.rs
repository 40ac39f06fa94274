//! Replies from a VM-network VIP routed back through that network: a
//! routing table per `[[network]]` (its subnet on its interface, `default
//! via` its gateway; for IPv6 VIPs its IPv6 subnet and `default via` its
//! `ipv6_gateway` in the same table) and a rule `from VIP lookup TABLE`
//! per VIP (`ip -6 rule` for an IPv6 one), as a kind
//! of host object the [`crate::host::owned::Driver`] owns (read back every 10 s,
//! repaired, removed after the drain at stop).
//!
//! Why: keepalived puts the VIP on the network's interface as a /32 (see
//! [`crate::host::vmnet::keepalived`]), which adds no route; without the rule, a reply
//! to a client outside the subnet would leave by the host's default route
//! (the management network), with the VIP as its source, and be dropped by
//! reverse-path filters or answered from the wrong side. With it, every
//! packet sent from the VIP goes out of the network's own interface: to a
//! client of the subnet directly, to any other through the network's
//! gateway, as a VM on that network would.
//!
//! The rules are written on every host, whichever holds the VIP: a rule
//! for an address the host does not hold matches nothing (no local socket
//! sends from it; `IP_FREEBIND` listeners answer only what reaches them),
//! and the master's rule is in place before keepalived brings the address
//! up, so the first reply is already routed right. The address itself is
//! keepalived's: this module never adds it.
//!
//! A VIP leased over DHCP on a network (`ipam = "dhcp"`, its macvlan on
//! the network's interface, `noprefixroute`) gets its rule once leased,
//! on the host holding the lease: its replies and its RENEWs leave by the
//! network too, even where the host has no address of its own there.
//! Unleased (`0.0.0.0`) it gets none.
//!
//! Routes and rules carry protocol [`ROUTE_PROTOCOL`] (`proto 252`), the
//! mark of the daemon's objects; a rule from the VIP another program wrote
//! (unmarked) is left alone and reported. Rules have priority
//! [`RULE_PRIORITY`], before the `main` table (32766).

use crate::metrics::HostKind;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use futures_util::TryStreamExt;
use ipnet::{IpNet, Ipv4Net, Ipv6Net};
use rtnetlink::RouteMessageBuilder;
use rtnetlink::packet_route::AddressFamily;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope,
};
use rtnetlink::packet_route::rule::{RuleAction, RuleAttribute, RuleMessage};
use rtnetlink::{Error as NlError, IpVersion};

use crate::config::Config;
use crate::host::announce::routes::{AnnounceError, ROUTE_PROTOCOL, RouteWriter, errno, table_of};
use crate::host::owned::driver::Listing;
use crate::host::owned::{Backend, Found, StopPhase};

/// Priority of the `from VIP` rules: before `main` (32766) and `default`
/// (32767), after the rules operators and CNIs usually put first.
pub const RULE_PRIORITY: u32 = 30_000;

/// One object: a route of a network's table, or a VIP's rule.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub enum NetKey {
    /// A route to `dest` in `table`.
    Route {
        /// The network's table.
        table: u32,
        /// The subnet, or `0.0.0.0/0` (`::/0`) for the gateway's route.
        dest: IpNet,
    },
    /// The rule `from vip lookup <table>`.
    Rule {
        /// The VIP.
        vip: IpAddr,
    },
}

impl fmt::Display for NetKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            NetKey::Route { table, dest } => write!(f, "route {dest} table {table}"),
            NetKey::Rule { vip } => write!(f, "rule from {vip}"),
        }
    }
}

/// What an object is (wanted, or as the kernel shows it).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NetState {
    /// A route out of interface `interface`, through `gateway` if any.
    Route {
        /// The output interface's index.
        interface: Option<u32>,
        /// The next hop; `None` for the on-link subnet.
        gateway: Option<IpAddr>,
    },
    /// A rule looking up `table`.
    Rule {
        /// The table.
        table: u32,
    },
}

/// The objects `config` asks for, given the index of each network
/// interface this host has (`index_of`, by name) and of each network's
/// leg in place (`legs`, by the network's name: [`crate::host::vmnet::leg`]): for each
/// network used by a load balancer whose interface exists, its subnet and
/// default route in its table, out of its leg where it has one, else out
/// of its interface, and one rule per VIP on it. Pure.
pub fn wanted(
    config: &Config,
    index_of: &BTreeMap<String, u32>,
    legs: &BTreeMap<String, u32>,
) -> BTreeMap<NetKey, NetState> {
    let mut out = BTreeMap::new();
    for lb in &config.load_balancers {
        let Some(name) = &lb.network else {
            continue;
        };
        // A DHCP VIP not leased yet is 0.0.0.0: `from 0.0.0.0` would be a
        // rule for every packet of the host. Leased, its rule is written.
        if lb.vip.is_unspecified() {
            continue;
        }
        let Some(net) = config.networks.iter().find(|n| &n.name == name) else {
            continue;
        };
        let Some(&index) = index_of.get(&net.interface) else {
            continue;
        };
        // A bridged network's leg carries its routes: what leaves by it is
        // routed, never bridged back toward the port it came in by.
        let index = legs.get(&net.name).copied().unwrap_or(index);
        // The VIP's family: its subnet and gateway (an IPv6 VIP is
        // accepted only on a network with an IPv6 gateway).
        let (subnet, any, gateway) = match lb.vip {
            IpAddr::V4(_) => (
                IpNet::V4(net.subnet()),
                IpNet::V4(Ipv4Net::default()),
                IpAddr::V4(net.gateway),
            ),
            IpAddr::V6(_) => match (net.ipv6_subnet(), net.ipv6_gateway) {
                (Some(s), Some(g)) => (IpNet::V6(s), IpNet::V6(Ipv6Net::default()), IpAddr::V6(g)),
                _ => continue,
            },
        };
        let route = |gateway| NetState::Route {
            interface: Some(index),
            gateway,
        };
        out.insert(
            NetKey::Route {
                table: net.table,
                dest: subnet,
            },
            route(None),
        );
        out.insert(
            NetKey::Route {
                table: net.table,
                dest: any,
            },
            route(Some(gateway)),
        );
        out.insert(
            NetKey::Rule { vip: lb.vip },
            NetState::Rule { table: net.table },
        );
    }
    out
}

/// The networks' routes and rules in the kernel (see the module's text).
#[derive(Debug, Clone)]
pub struct NetworkRoutes {
    writer: RouteWriter,
    /// The networks' tables, whose routes are read back; set through a
    /// shared reference (the driver lends only that).
    tables: std::sync::Arc<std::sync::Mutex<BTreeSet<u32>>>,
}

impl NetworkRoutes {
    /// Routes and rules written through `writer`.
    pub fn new(writer: RouteWriter) -> Self {
        Self {
            writer,
            tables: std::sync::Arc::default(),
        }
    }

    /// The tables read back from now on (the config's networks', and
    /// those of what this process still holds).
    pub fn set_tables(&self, tables: BTreeSet<u32>) {
        *self.tables.lock().unwrap_or_else(|p| p.into_inner()) = tables;
    }

    /// The netlink connection, for looking up interfaces.
    pub fn writer(&self) -> &RouteWriter {
        &self.writer
    }
}

fn nl(what: String) -> impl FnOnce(NlError) -> AnnounceError {
    move |source| AnnounceError::Netlink { what, source }
}

fn rule_table(m: &RuleMessage) -> u32 {
    m.attributes
        .iter()
        .find_map(|a| match a {
            RuleAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(m.header.table))
}

fn route_message(table: u32, dest: IpNet, state: Option<&NetState>) -> RouteMessage {
    let (interface, gateway) = match state {
        Some(NetState::Route { interface, gateway }) => (*interface, *gateway),
        _ => (None, None),
    };
    // The family-free parts: table, mark, output interface.
    fn common<T>(
        b: RouteMessageBuilder<T>,
        table: u32,
        interface: Option<u32>,
    ) -> RouteMessageBuilder<T> {
        let b = b
            .table_id(table)
            .protocol(RouteProtocol::from(ROUTE_PROTOCOL));
        match interface {
            Some(i) => b.output_interface(i),
            None => b,
        }
    }
    match dest {
        IpNet::V4(d) => {
            let b = common(
                RouteMessageBuilder::<Ipv4Addr>::new().destination_prefix(d.addr(), d.prefix_len()),
                table,
                interface,
            );
            match (state.is_some(), gateway) {
                // On-link: the gateway is in the network's subnet, out of
                // this interface, whatever the other tables say (a leg, or
                // a bridge without an address of the host's, has no route
                // of the main table to check it against).
                (_, Some(IpAddr::V4(g))) => b.gateway(g).onlink(),
                (true, _) => b.scope(RouteScope::Link),
                // A deletion matches any scope: the kernel compares the
                // scope unless it is "nowhere", and the builder's default
                // (universe) never matched the link-scope route of a
                // network without a gateway, so it was left at stop.
                (false, _) => b.scope(RouteScope::NoWhere),
            }
            .build()
        }
        IpNet::V6(d) => {
            let b = common(
                RouteMessageBuilder::<Ipv6Addr>::new().destination_prefix(d.addr(), d.prefix_len()),
                table,
                interface,
            );
            match gateway {
                Some(IpAddr::V6(g)) => b.gateway(g).onlink(),
                _ => b,
            }
            .build()
        }
    }
}

fn rule_message(vip: IpAddr, table: Option<u32>) -> RuleMessage {
    let mut m = RuleMessage::default();
    (m.header.family, m.header.src_len) = match vip {
        IpAddr::V4(_) => (AddressFamily::Inet, 32),
        IpAddr::V6(_) => (AddressFamily::Inet6, 128),
    };
    m.header.action = RuleAction::ToTable;
    m.attributes.push(RuleAttribute::Source(vip));
    m.attributes.push(RuleAttribute::Priority(RULE_PRIORITY));
    m.attributes
        .push(RuleAttribute::Protocol(RouteProtocol::from(ROUTE_PROTOCOL)));
    if let Some(t) = table {
        m.attributes.push(RuleAttribute::Table(t));
    }
    m
}

impl Backend for NetworkRoutes {
    const KIND: HostKind = HostKind::NetworkRoute;
    // Replies of the connections the drain waits for go through them.
    const STOP: StopPhase = StopPhase::AfterDrain;
    // The networks' tables and `proto 252` rules are this daemon's alone.
    const REMOVES_STRAYS: bool = true;
    type Key = NetKey;
    type Want = NetState;
    type Seen = NetState;
    type Error = AnnounceError;

    async fn read(&mut self) -> Result<Listing<Self>, AnnounceError> {
        let tables = self
            .tables
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let handle = self.writer.handle();
        let mut out: Listing<Self> = BTreeMap::new();
        let requests = [
            RouteMessageBuilder::<Ipv4Addr>::new().build(),
            RouteMessageBuilder::<Ipv6Addr>::new().build(),
        ];
        for request in requests {
            let mut routes = handle.route().get(request).execute();
            while let Some(m) = routes
                .try_next()
                .await
                .map_err(nl("cannot list the routes of the networks' tables".into()))?
            {
                let table = table_of(&m);
                if !tables.contains(&table) {
                    continue;
                }
                let len = m.header.destination_prefix_length;
                let dest = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Destination(RouteAddress::Inet(v4)) => {
                        Ipv4Net::new(*v4, len).ok().map(IpNet::V4)
                    }
                    RouteAttribute::Destination(RouteAddress::Inet6(v6)) => {
                        Ipv6Net::new(*v6, len).ok().map(IpNet::V6)
                    }
                    _ => None,
                });
                // A default route carries no destination.
                let dest = match (dest, m.header.address_family) {
                    (Some(d), _) => d,
                    (None, AddressFamily::Inet) if len == 0 => IpNet::V4(Ipv4Net::default()),
                    (None, AddressFamily::Inet6) if len == 0 => IpNet::V6(Ipv6Net::default()),
                    _ => continue,
                };
                let interface = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                });
                let gateway = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Gateway(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
                    RouteAttribute::Gateway(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
                    _ => None,
                });
                out.insert(
                    NetKey::Route { table, dest },
                    Found {
                        seen: NetState::Route { interface, gateway },
                        marked: u8::from(m.header.protocol) == ROUTE_PROTOCOL,
                    },
                );
            }
        }
        for version in [IpVersion::V4, IpVersion::V6] {
            let mut rules = handle.rule().get(version).execute();
            while let Some(m) = rules
                .try_next()
                .await
                .map_err(nl("cannot list the routing rules".into()))?
            {
                let source = m.attributes.iter().find_map(|a| match a {
                    RuleAttribute::Source(ip) => Some(*ip),
                    _ => None,
                });
                let other_selector = m.header.dst_len != 0
                    || m.attributes.iter().any(|a| {
                        matches!(
                            a,
                            RuleAttribute::Iifname(_)
                                | RuleAttribute::Oifname(_)
                                | RuleAttribute::FwMark(_)
                        )
                    });
                let host_len = match source {
                    Some(IpAddr::V4(_)) => 32,
                    _ => 128,
                };
                let (Some(vip), false) = (source, other_selector) else {
                    continue;
                };
                if m.header.src_len != host_len {
                    continue;
                }
                let marked = m.attributes.iter().any(
                    |a| matches!(a, RuleAttribute::Protocol(p) if u8::from(*p) == ROUTE_PROTOCOL),
                );
                let key = NetKey::Rule { vip };
                // Ours first: a second, foreign rule from the VIP does not hide it.
                if out.get(&key).is_some_and(|f| f.marked) {
                    continue;
                }
                out.insert(
                    key,
                    Found {
                        seen: NetState::Rule {
                            table: rule_table(&m),
                        },
                        marked,
                    },
                );
            }
        }
        Ok(out)
    }

    async fn write(&mut self, key: &NetKey, want: &NetState) -> Result<(), AnnounceError> {
        let handle = self.writer.handle().clone();
        match key {
            NetKey::Route { table, dest } => {
                let message = route_message(*table, *dest, Some(want));
                let onlink = message
                    .header
                    .flags
                    .contains(rtnetlink::packet_route::route::RouteFlags::Onlink);
                match handle
                    .route()
                    .add(message.clone())
                    .replace()
                    .execute()
                    .await
                {
                    // IPv6 checks an on-link gateway against the main
                    // table (`ip6_route_check_nh_onlink`): where that
                    // routes the subnet by the bridge (the host has an
                    // address there) and this route leaves by the leg, it
                    // refuses; without `onlink` the gateway is looked up
                    // in this table, by the subnet's route (written after
                    // this one at the first sync, so this one at the next).
                    Err(e)
                        if onlink && dest.addr().is_ipv6() && errno(&e) == Some(libc::EINVAL) =>
                    {
                        let mut plain = message;
                        plain
                            .header
                            .flags
                            .remove(rtnetlink::packet_route::route::RouteFlags::Onlink);
                        handle
                            .route()
                            .add(plain)
                            .replace()
                            .execute()
                            .await
                            .map_err(nl(format!("cannot write the {key}")))
                    }
                    other => other.map_err(nl(format!("cannot write the {key}"))),
                }
            }
            NetKey::Rule { vip } => {
                let NetState::Rule { table } = want else {
                    return Ok(());
                };
                // A rule of ours from the VIP to another table goes first.
                self.remove(key).await?;
                // The message sets the family (IPv4 or IPv6) itself.
                let mut req = handle.rule().add().v4().replace();
                *req.message_mut() = rule_message(*vip, Some(*table));
                match req.execute().await {
                    Ok(()) => Ok(()),
                    Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
                    Err(e) => Err(nl(format!("cannot write the {key} lookup {table}"))(e)),
                }
            }
        }
    }

    async fn remove(&mut self, key: &NetKey) -> Result<(), AnnounceError> {
        let handle = self.writer.handle();
        let result = match key {
            NetKey::Route { table, dest } => {
                handle
                    .route()
                    .del(route_message(*table, *dest, None))
                    .execute()
                    .await
            }
            NetKey::Rule { vip } => {
                // Every rule of ours from the VIP, whatever its table.
                loop {
                    match handle.rule().del(rule_message(*vip, None)).execute().await {
                        Ok(()) => continue,
                        Err(e) => break Err(e),
                    }
                }
            }
        };
        match result {
            Ok(()) => Ok(()),
            Err(e) if matches!(errno(&e), Some(libc::ESRCH | libc::ENOENT)) => Ok(()),
            Err(e) => Err(nl(format!("cannot remove the {key}"))(e)),
        }
    }

    /// A predecessor's route or rule exactly as wanted is ours as it is.
    fn adoptable(&self, want: &NetState, seen: &NetState) -> bool {
        want == seen
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{KEEPALIVED, VLAN100, VLAN200, config, lb};

    #[test]
    fn a_used_network_with_its_interface_gets_its_table_and_a_rule_per_vip() {
        let text = format!(
            "{KEEPALIVED}{VLAN100}ipv6_gateway = \"fd00:100::1\"\ntable = 1100\n{VLAN200}{}{}{}",
            lb("default/a", "10.100.0.50", "vlan100", &[]),
            lb("default/b", "10.200.0.50", "vlan200", &[]),
            lb("default/c", "fd00:100::50", "vlan100", &[]),
        );
        let config = config(&text);
        // br.200 does not exist on this host: nothing for vlan200.
        let index: BTreeMap<String, u32> = [("br.100".to_string(), 7)].into();
        let w = wanted(&config, &index, &BTreeMap::new());
        let got: Vec<String> = w.iter().map(|(k, v)| format!("{k} {v:?}")).collect();
        assert_eq!(
            got,
            [
                "route 0.0.0.0/0 table 1100 Route { interface: Some(7), gateway: Some(10.100.0.1) }",
                "route 10.100.0.0/24 table 1100 Route { interface: Some(7), gateway: None }",
                "route ::/0 table 1100 Route { interface: Some(7), gateway: Some(fd00:100::1) }",
                "route fd00:100::/64 table 1100 Route { interface: Some(7), gateway: None }",
                "rule from 10.100.0.50 Rule { table: 1100 }",
                "rule from fd00:100::50 Rule { table: 1100 }",
            ]
        );
    }

    #[test]
    fn a_leased_vip_gets_its_rule_once_leased_and_none_before() {
        let text = format!(
            "{KEEPALIVED}{VLAN100}[[load_balancer]]\nname = \"default/d\"\nipam = \"dhcp\"\nnetwork = \"vlan100\"\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n  [load_balancer.dhcp]\n"
        );
        let mut config = config(&text);
        let index: BTreeMap<String, u32> = [("br.100".to_string(), 7)].into();
        assert!(
            wanted(&config, &index, &BTreeMap::new())
                .keys()
                .all(|k| !matches!(k, NetKey::Rule { .. })),
            "no `from 0.0.0.0` rule for an unleased VIP"
        );
        // The daemon puts the leased address in place of 0.0.0.0.
        std::sync::Arc::make_mut(&mut config.load_balancers[0]).vip =
            IpAddr::V4(Ipv4Addr::new(10, 100, 0, 77));
        assert!(
            wanted(&config, &index, &BTreeMap::new()).contains_key(&NetKey::Rule {
                vip: IpAddr::V4(Ipv4Addr::new(10, 100, 0, 77))
            })
        );
        // keepalived does not move it: no instance renders it.
        let rendered = crate::host::vmnet::keepalived::render(&config).expect("[keepalived]");
        assert!(!rendered.contains("10.100.0.77"), "{rendered}");
    }
}

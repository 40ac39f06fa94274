//! `[[network]]`, `[keepalived]` and each load balancer's `network`: the
//! VIPs keepalived moves on VM networks.
//!
//! What is refused, and why: a load balancer naming a network the file
//! does not define, or with no `[keepalived]` to move its VIP; a VIP outside
//! its network's subnet (keepalived would put an address there that no
//! client on the network can reach on-link), the subnet's own or broadcast
//! address, the network's gateway (taking it cuts every VM of the network
//! off its router) or a management address of a host (its VRRP would
//! answer for itself); a gateway that is not a host of its subnet; VRIDs
//! past 255 (VRRP's field is one byte); a routing table the kernel
//! reserves or another network's; an IPv6 VIP on a network without
//! `ipv6_gateway` (its IPv6 subnet is the gateway's) or outside that
//! subnet, or with no IPv4 VIP on any network to ride with (keepalived
//! refuses an instance without a VIP of its adverts' family); DHCP leases
//! and BGP announcing combined with keepalived moving the VIP; an
//! `advert_interval_ms` that is no whole number of seconds with
//! `vrrp_version = 2` (keepalived would round it); an `admin.socket` the
//! rendered track script cannot quote.
//!
//! A load balancer on no network is a management VIP keepalived moves on
//! `keepalived.interface` (`keepalived.management_vips`, default on;
//! `Config::keepalived_interface`): its kernel listeners are told what
//! resets moved flows like a network's (`validate::kernel`), an IPv6 one
//! with no IPv4 VIP to ride with is a warning (it is left out of the file),
//! and one that is a keepalived host is refused (`validate::hosts`).
//!
//! Whether a network's `interface` exists is a fact of the host, not of
//! the file: `check` runs anywhere (CI, the controller), so the daemon
//! checks it at start and at every reload and refuses that network's load
//! balancers alone (`/status` `vip_refused`, kind `no_network_interface`).
//!
//! `[keepalived]`'s own keys (peers, VRRP, the management table, the track
//! script's socket) are checked in `keepalived`; this file checks the
//! networks and the VIPs on them.

use std::collections::{BTreeMap, HashSet};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;

use toml::Spanned;

use super::Validator;
use crate::config::file::{FileConfig, FileLoadBalancer, FileNetwork};
use crate::config::{
    DEFAULT_IPV6_PREFIX_LENGTH, DEFAULT_NETWORK_ISOLATE, DEFAULT_NETWORK_TABLE_BASE, Ipam,
    KeepalivedSettings, LoadBalancerSpec, NetworkSpec, VipSettings,
};

/// Longest network name: Harvester's `namespace/name` of a
/// NetworkAttachmentDefinition fits.
const MAX_NETWORK_NAME_BYTES: usize = 253;

impl Validator<'_> {
    /// Every `[[network]]`; `None` for one too broken to build (its name is
    /// still known, so load balancers naming it are not reported again).
    pub(super) fn networks(
        &mut self,
        file: &FileConfig,
        vip: &VipSettings,
    ) -> (Vec<NetworkSpec>, HashSet<String>) {
        let mut built = Vec::new();
        let mut names = HashSet::new();
        let mut tables: BTreeMap<u32, String> = BTreeMap::new();
        // The reply mark of each network's table (`host::vmnet::replymark`).
        let mut marks: BTreeMap<u32, (String, u32)> = BTreeMap::new();
        for (i, n) in file.networks.iter().enumerate() {
            let key = format!("network[{i}]");
            let span = n.span();
            let net = n.get_ref();
            if let Some(name) = self.network_name(&key, span.clone(), net) {
                if !names.insert(name.clone()) {
                    self.problem(
                        net.name.as_ref().map(Spanned::span),
                        &format!("{key}.name"),
                        format!("{name:?} is defined twice; each [[network]] needs its own name"),
                    );
                }
                if let Some(spec) = self.network(&key, span, net, name, i, vip) {
                    if let Some(other) = tables.insert(spec.table, spec.name.clone()) {
                        self.problem(
                            net.table.as_ref().map(Spanned::span).or(Some(n.span())),
                            &format!("{key}.table"),
                            format!(
                                "table {} is network {other:?}'s too; give each network its own table",
                                spec.table
                            ),
                        );
                    } else if let Some((other, table)) = marks.insert(
                        crate::config::reply_mark_of(spec.table),
                        (spec.name.clone(), spec.table),
                    ) {
                        self.problem(
                            net.table.as_ref().map(Spanned::span).or(Some(n.span())),
                            &format!("{key}.table"),
                            format!(
                                "table {} gives this network the reply mark {:#x}, as network {other:?}'s table {table} does (a network's mark is 1 + (table - 1) mod 255); choose a table that does not differ from {table} by a multiple of 255",
                                spec.table,
                                crate::config::reply_mark_of(spec.table)
                            ),
                        );
                    }
                    built.push(spec);
                }
            }
        }
        (built, names)
    }

    fn network_name(
        &mut self,
        key: &str,
        span: std::ops::Range<usize>,
        net: &FileNetwork,
    ) -> Option<String> {
        let Some(n) = &net.name else {
            self.missing(
                span,
                key,
                "name",
                "what load balancers call it, e.g. \"default/vlan100\"",
            );
            return None;
        };
        let name = n.get_ref();
        let ok = !name.is_empty()
            && name.len() <= MAX_NETWORK_NAME_BYTES
            && name
                .chars()
                .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
        if !ok {
            self.problem(
                Some(n.span()),
                &format!("{key}.name"),
                format!(
                    "{name:?} is not a network name: 1..={MAX_NETWORK_NAME_BYTES} bytes of letters, digits, '-', '_', '.' and '/' (e.g. \"default/vlan100\")"
                ),
            );
        }
        Some(name.clone())
    }

    fn network(
        &mut self,
        key: &str,
        span: std::ops::Range<usize>,
        net: &FileNetwork,
        name: String,
        index: usize,
        vip: &VipSettings,
    ) -> Option<NetworkSpec> {
        let interface = match &net.interface {
            None => {
                self.missing(span.clone(), key, "interface", "the host interface on that L2: its bridge, or a VLAN device such as \"mgmt-br.100\"");
                None
            }
            Some(i) => self
                .rendered_interface(i, format_args!("{key}.interface"))
                .filter(|name| match crate::config::not_a_vm_network_interface(name) {
                    None => true,
                    Some(why) => {
                        self.problem(
                            Some(i.span()),
                            &format!("{key}.interface"),
                            format!("{name:?} is {why}; a VM network is on a bridge, a VLAN device on one, or a bond"),
                        );
                        false
                    }
                }),
        };
        let prefix_length = match &net.prefix_length {
            None => {
                self.missing(
                    span.clone(),
                    key,
                    "prefix_length",
                    "the subnet's prefix length, e.g. 24",
                );
                None
            }
            Some(p) => {
                let n = *p.get_ref();
                if (8..=30).contains(&n) {
                    Some(n as u8)
                } else {
                    self.problem(
                        Some(p.span()),
                        &format!("{key}.prefix_length"),
                        format!("{n} is out of range; an IPv4 VM network's prefix length must be in 8..=30 (a /31 or /32 has no room for a gateway and VIPs)"),
                    );
                    None
                }
            }
        };
        let gateway = match &net.gateway {
            None => {
                self.missing(span.clone(), key, "gateway", "the network's IPv4 router, which replies to clients outside the subnet go through");
                None
            }
            Some(g) => match self.ip(g, format_args!("{key}.gateway")) {
                Some(IpAddr::V4(v4)) => Some((v4, g.span())),
                Some(IpAddr::V6(_)) => {
                    self.problem(
                        Some(g.span()),
                        &format!("{key}.gateway"),
                        format!("{:?} is IPv6; write the IPv4 gateway here and the IPv6 one in ipv6_gateway", g.get_ref()),
                    );
                    None
                }
                None => None,
            },
        };
        if let (Some((gw, gspan)), Some(len)) = (gateway.clone(), prefix_length) {
            let subnet = ipnet::Ipv4Net::new(gw, len).expect("8..=30").trunc();
            if gw == subnet.network() || gw == subnet.broadcast() || !usable(gw) {
                self.problem(
                    Some(gspan),
                    &format!("{key}.gateway"),
                    format!(
                        "{gw} is not a host of its subnet {subnet} (it is the subnet's own address, its broadcast address, or not unicast); give the router's address on the network"
                    ),
                );
            }
        }
        let ipv6_gateway = net.ipv6_gateway.as_ref().and_then(|g| {
            match self.ip(g, format_args!("{key}.ipv6_gateway"))? {
                IpAddr::V6(v6) if !v6.is_multicast() && !v6.is_unspecified() => Some(v6),
                _ => {
                    self.problem(
                        Some(g.span()),
                        &format!("{key}.ipv6_gateway"),
                        format!("{:?} is not an IPv6 unicast address", g.get_ref()),
                    );
                    None
                }
            }
        });
        let ipv6_prefix_length = match &net.ipv6_prefix_length {
            None => DEFAULT_IPV6_PREFIX_LENGTH,
            Some(p) => {
                let n = *p.get_ref();
                if (16..=126).contains(&n) {
                    n as u8
                } else {
                    self.problem(
                        Some(p.span()),
                        &format!("{key}.ipv6_prefix_length"),
                        format!("{n} is out of range; an IPv6 VM network's prefix length must be in 16..=126 (64 on almost every network)"),
                    );
                    DEFAULT_IPV6_PREFIX_LENGTH
                }
            }
        };
        if let (Some(gw), Some(g)) = (ipv6_gateway, &net.ipv6_gateway) {
            let subnet = ipnet::Ipv6Net::new(gw, ipv6_prefix_length)
                .expect("16..=126")
                .trunc();
            if gw == subnet.network() {
                self.problem(
                    Some(g.span()),
                    &format!("{key}.ipv6_gateway"),
                    format!("{gw} is the subnet {subnet}'s own address (its routers' anycast address); give the router's own address on the network"),
                );
            }
        }
        let table = match &net.table {
            None => DEFAULT_NETWORK_TABLE_BASE + index as u32,
            Some(t) => {
                let n = *t.get_ref();
                match u32::try_from(n) {
                    Ok(n) if n != 0 && !(253..=255).contains(&n) => n,
                    _ => {
                        self.problem(
                            Some(t.span()),
                            &format!("{key}.table"),
                            format!("{n} cannot be a network's routing table; use 1..=252 or 256..=4294967295 (0 is unspecified, 253 default, 254 main, 255 local)"),
                        );
                        return None;
                    }
                }
            }
        };
        if table == vip.announce.table {
            self.problem(
                net.table.as_ref().map(Spanned::span).or(Some(span)),
                &format!("{key}.table"),
                format!("table {table} is vip.announce_table too; give the network its own table"),
            );
        }
        Some(NetworkSpec {
            name,
            interface: interface?,
            prefix_length: prefix_length?,
            gateway: gateway?.0,
            ipv6_gateway,
            ipv6_prefix_length,
            table,
            isolate: net
                .isolate
                .as_ref()
                .map_or(DEFAULT_NETWORK_ISOLATE, |v| *v.get_ref()),
        })
    }

    pub(super) fn abs_path(
        &mut self,
        value: &Option<Spanned<String>>,
        key: &str,
        default: &str,
    ) -> PathBuf {
        match value {
            None => PathBuf::from(default),
            Some(v) => {
                let p = v.get_ref();
                if !p.starts_with('/') || p.ends_with('/') || p.contains('\0') {
                    self.problem(
                        Some(v.span()),
                        key,
                        format!("{p:?} is not an absolute file path; write e.g. {default:?}"),
                    );
                }
                PathBuf::from(p)
            }
        }
    }

    /// Each load balancer's `network`: defined, with `[keepalived]`, its
    /// VIP a host of the subnet and none of the addresses it must not be.
    pub(super) fn network_conflicts(
        &mut self,
        file: &FileConfig,
        specs: &mut [Option<LoadBalancerSpec>],
        networks: &[NetworkSpec],
        known: &HashSet<String>,
        keepalived: Option<&KeepalivedSettings>,
        vip: &VipSettings,
    ) {
        let mut used = HashSet::new();
        for (i, (lb, spec)) in file.load_balancers.iter().zip(specs.iter_mut()).enumerate() {
            let lb = lb.get_ref();
            let Some(n) = &lb.network else { continue };
            let key = format!("load_balancer[{i}].network");
            let name = n.get_ref();
            used.insert(name.clone());
            if !known.contains(name) {
                let list: Vec<&str> = networks.iter().map(|n| n.name.as_str()).collect();
                self.problem(
                    Some(n.span()),
                    &key,
                    format!(
                        "{name:?} is not a [[network]] of this file (defined: {}); add a [[network]] with name = {name:?} or name one of those",
                        if list.is_empty() { "none".to_string() } else { list.join(", ") }
                    ),
                );
                continue;
            }
            // Leased by this daemon: the lease path holds the VIP on its
            // macvlan, keepalived does not move it.
            let leased = lb.dhcp.is_some() && spec.as_ref().is_none_or(|s| s.ipam == Ipam::Dhcp);
            if file.keepalived.is_none() && !leased {
                self.problem(
                    Some(n.span()),
                    &key,
                    "needs a [keepalived] section: a VIP on a VM network is moved between hosts by the keepalived this daemon configures (name, address, interface, peers)".into(),
                );
            }
            let Some(net) = networks.iter().find(|x| &x.name == name) else {
                continue;
            };
            let vip_span = lb.vip.as_ref().map(Spanned::span).or(Some(n.span()));
            let vip_key = format!("load_balancer[{i}].vip");
            let Some(s) = spec.as_mut() else { continue };
            if s.ipam == Ipam::Dhcp {
                let global_ranges = file.dhcp.allowed_ranges.is_some();
                if self.leased_on_network(i, lb, s, net, global_ranges) {
                    s.network = Some(name.clone());
                }
                continue;
            }
            if vip.announce.enabled() {
                self.problem(
                    Some(n.span()),
                    &key,
                    "cannot be used with vip.announce = \"routes\": keepalived holds this VIP on one host, announcing it would pull it to every host; set vip.announce = \"none\" or drop network".into(),
                );
            }
            let v4 = match s.vip {
                IpAddr::V4(v4) => v4,
                IpAddr::V6(v6) => {
                    if let Some(why) = ipv6_vip_problem(v6, net) {
                        self.problem(vip_span, &vip_key, format!("{v6} {why}"));
                    } else {
                        s.network = Some(name.clone());
                    }
                    continue;
                }
            };
            let subnet = net.subnet();
            let why = if !subnet.contains(&v4) {
                Some(format!(
                    "is outside network {:?}'s subnet {subnet} (gateway {}, prefix_length {}): no client there could reach it on-link; give a VIP inside it or fix the network",
                    net.name, net.gateway, net.prefix_length
                ))
            } else if v4 == subnet.network() || v4 == subnet.broadcast() {
                Some(format!(
                    "is the subnet {subnet}'s own or broadcast address; give a host address of the subnet"
                ))
            } else if v4 == net.gateway {
                Some(format!(
                    "is network {:?}'s gateway: taking it would cut every VM of the network off its router",
                    net.name
                ))
            } else {
                keepalived.filter(|k| k.hosts().contains(&s.vip)).map(|k| {
                    format!(
                        "is the management address of a keepalived host ({} or its peers): VRRP would answer for itself; give another VIP",
                        k.address
                    )
                })
            };
            if let Some(why) = why {
                self.problem(vip_span, &vip_key, format!("{} {why}", s.vip));
                continue;
            }
            s.network = Some(name.clone());
        }
        if let Some(k) = keepalived {
            self.other_family_alone(file, specs, k, vip);
        }
        for (i, n) in file.networks.iter().enumerate() {
            if let Some(name) = &n.get_ref().name
                && !used.contains(name.get_ref())
            {
                self.warning(
                    Some(name.span()),
                    &format!("network[{i}].name"),
                    format!("{:?} is not used by any load balancer", name.get_ref()),
                );
            }
        }
        let management = keepalived.is_some_and(|k| {
            specs
                .iter()
                .flatten()
                .any(|s| k.moves_management_vip(s, &vip.announce))
        });
        if let (Some(k), true, false) = (&file.keepalived, networks.is_empty(), management) {
            self.warning(
                Some(k.span()),
                "keepalived",
                "no [[network]] is defined and no management VIP is moved (keepalived.management_vips = false, vip.announce = \"routes\", or no load balancer with a pool or static VIP): the rendered keepalived.conf moves no VIP".into(),
            );
        }
    }

    /// keepalived refuses an instance with no VIP of its adverts' family
    /// (`keepalived.address`'s), so VIPs of the other family (IPv6 VIPs
    /// under IPv4 adverts) ride as excluded addresses of instances that
    /// have one: with none at all, they are refused.
    ///
    /// Management VIPs ([`KeepalivedSettings::moves_management_vip`]) are
    /// placed the same way, so an IPv4 one carries IPv6 VIPs too; an IPv6
    /// management VIP with nothing to ride with is a warning, not a
    /// refusal: before `management_vips` such a file was valid (the VIP
    /// held by other means), and it still serves where something else
    /// holds the address.
    fn other_family_alone(
        &mut self,
        file: &FileConfig,
        specs: &[Option<LoadBalancerSpec>],
        k: &KeepalivedSettings,
        vip_settings: &VipSettings,
    ) {
        // (index, VIP, on a network) of every VIP keepalived moves.
        let moved: Vec<(usize, IpAddr, bool)> = specs
            .iter()
            .enumerate()
            .filter_map(|(i, s)| {
                let s = s.as_ref()?;
                if s.network.is_some() {
                    Some((i, s.vip, true))
                } else if k.moves_management_vip(s, &vip_settings.announce) {
                    Some((i, s.vip, false))
                } else {
                    None
                }
            })
            .collect();
        if moved
            .iter()
            .any(|(_, v, _)| v.is_ipv4() == k.address.is_ipv4())
        {
            return;
        }
        let family = if k.address.is_ipv4() { "IPv4" } else { "IPv6" };
        let why = format!(
            "no VIP keepalived moves (on a [[network]], or a management VIP) is {family}, and keepalived (its adverts are {family}: keepalived.address is {}) {}",
            k.address,
            crate::config::OTHER_FAMILY_ALONE
        );
        if let Some(&(i, vip, _)) = moved.iter().find(|(_, _, on_network)| *on_network) {
            self.problem(
                file.load_balancers[i].get_ref().vip.as_ref().map(Spanned::span),
                &format!("load_balancer[{i}].vip"),
                format!(
                    "{vip}: {why}; add an {family} VIP on a network, or give keepalived an address and peers of this VIP's family"
                ),
            );
        } else if let Some(&(i, vip, _)) = moved.first() {
            self.warning(
                file.load_balancers[i].get_ref().vip.as_ref().map(Spanned::span),
                &format!("load_balancer[{i}].vip"),
                format!(
                    "{vip}: {why}, so this management VIP is not put in keepalived's file (something else must hold it); add an {family} VIP keepalived moves, give keepalived an address and peers of this VIP's family, or set keepalived.management_vips = false if another tool holds the management VIPs"
                ),
            );
        }
    }
}

/// Why IPv6 VIP `vip` cannot be on `net`, if it cannot: the network has
/// no IPv6 subnet (no `ipv6_gateway`), or the VIP is outside it, its own
/// (anycast) address, the gateway, or not a global unicast address.
/// Why `ip` cannot be one host's address on a link that VRRP adverts or
/// conntrackd's sync are sent to or from (`keepalived.address`,
/// `keepalived.peers`, `conntrackd.address`, `conntrackd.peer`), or `None`:
/// a unicast peer at a group or broadcast address sends every advert to
/// whatever listens there (224.0.0.18 is VRRP's own group), at the
/// unspecified address to this host, at loopback nowhere.
pub(super) fn host_address_problem(ip: IpAddr) -> Option<&'static str> {
    let ip = ip.to_canonical();
    if ip.is_unspecified() || matches!(ip, IpAddr::V4(v4) if v4.octets()[0] == 0) {
        Some("an unspecified address (0.0.0.0/8, ::), which no host has")
    } else if ip.is_loopback() {
        Some("a loopback address, which never leaves this host")
    } else if ip.is_multicast() {
        Some("a multicast address (224.0.0.0/4, ff00::/8): a group, not one host")
    } else if matches!(ip, IpAddr::V4(v4) if v4.octets()[0] >= 240) {
        Some("the broadcast address or in 240.0.0.0/4 (reserved), not one host's")
    } else {
        None
    }
}

fn ipv6_vip_problem(vip: Ipv6Addr, net: &NetworkSpec) -> Option<String> {
    let Some(subnet) = net.ipv6_subnet() else {
        return Some(format!(
            "is IPv6, and network {:?} has no ipv6_gateway: add the network's IPv6 router as ipv6_gateway (its subnet is the gateway's at ipv6_prefix_length, 64 unless set)",
            net.name
        ));
    };
    if !subnet.contains(&vip) {
        Some(format!(
            "is outside network {:?}'s IPv6 subnet {subnet} (ipv6_gateway, ipv6_prefix_length): no client there could reach it on-link; give a VIP inside it",
            net.name
        ))
    } else if vip == subnet.network() {
        Some(format!(
            "is the subnet {subnet}'s own address (its routers' anycast address); give a host address of the subnet"
        ))
    } else if Some(vip) == net.ipv6_gateway {
        Some(format!(
            "is network {:?}'s IPv6 gateway: taking it would cut every VM of the network off its router",
            net.name
        ))
    } else if vip.is_multicast() || vip.is_loopback() || vip.is_unicast_link_local() {
        Some("is not a global or unique-local unicast address".into())
    } else {
        None
    }
}

impl Validator<'_> {
    /// `ipam = "dhcp"` with `network`: the lease's macvlan goes on the
    /// network's interface (`[load_balancer.dhcp] interface` may be left
    /// out; another interface is refused: the lease would be on another
    /// L2 than the network's VMs). Without `[load_balancer.dhcp]` the VIP
    /// is leased elsewhere, and nothing would hold it on the network.
    /// Whether the load balancer stays on the network.
    fn leased_on_network(
        &mut self,
        i: usize,
        lb: &FileLoadBalancer,
        s: &mut LoadBalancerSpec,
        net: &NetworkSpec,
        global_ranges: bool,
    ) -> bool {
        let Some(d) = s.dhcp.as_mut() else {
            self.problem(
                lb.ipam.as_ref().map(Spanned::span).or(lb.network.as_ref().map(Spanned::span)),
                &format!("load_balancer[{i}].ipam"),
                format!(
                    "ipam = \"dhcp\" without [load_balancer.dhcp] is a VIP leased elsewhere, which nothing would hold on network {:?}; add an empty [load_balancer.dhcp] table (this daemon then leases it on the network's interface {:?}) or drop network",
                    net.name, net.interface
                ),
            );
            return false;
        };
        if d.interface.is_empty() {
            d.interface = net.interface.clone();
        } else if d.interface != net.interface {
            let span = lb
                .dhcp
                .as_ref()
                .and_then(|t| t.get_ref().interface.as_ref().map(Spanned::span));
            self.problem(
                span,
                &format!("load_balancer[{i}].dhcp.interface"),
                format!(
                    "{:?} is not network {:?}'s interface {:?}: the lease would be taken on another L2 than the network's VMs; leave dhcp.interface out (the network's is used) or correct one of the two",
                    d.interface, net.name, net.interface
                ),
            );
            return false;
        }
        if let Some(asked) = d.requested
            && !net.subnet().contains(&asked)
        {
            self.problem(
                lb.vip.as_ref().map(Spanned::span),
                &format!("load_balancer[{i}].vip"),
                format!(
                    "{asked} (the address asked for) is outside network {:?}'s subnet {}; leave vip out or write \"0.0.0.0\" to take what the network's DHCP server offers",
                    net.name,
                    net.subnet()
                ),
            );
            return false;
        }
        // An offer outside the network's subnet would put a VIP there that
        // no VM of the network reaches on-link: refused, unless the
        // operator set the ranges.
        if d.allowed_ranges.is_none() && !global_ranges {
            d.allowed_ranges = Some(vec![net.subnet()]);
        }
        true
    }
}

/// Whether `ip` can be a host of a subnet: unicast, not loopback, not
/// class E.
fn usable(ip: Ipv4Addr) -> bool {
    !(ip.is_unspecified()
        || ip.is_loopback()
        || ip.is_multicast()
        || ip.is_broadcast()
        || ip.octets()[0] >= 240)
}

#[cfg(test)]
mod tests;

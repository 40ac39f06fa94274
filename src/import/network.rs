//! A load balancer's VM network, from Harvester's objects: the
//! `loadbalancer.harvesterhci.io/network` annotation names a
//! NetworkAttachmentDefinition (`default/vlan100`); its `spec.config`
//! (the bridge CNI's JSON) names the host bridge and the VLAN, which give
//! the host interface on that L2; the subnet's prefix length and gateway
//! come from the NAD's `network.harvesterhci.io/route` annotation, else
//! from the `IPPool`s selecting the network, else from the load balancers'
//! `status.allocatedAddress.{mask,gateway}`. Each family is settled on its
//! own, from the sources that speak of it: the route annotation carries one
//! subnet of either family, a pool's ranges and a load balancer's
//! allocation are IPv4 or IPv6 (Harvester's allocator takes both), so a
//! network with an IPv4 and an IPv6 pool gets both gateways. Each becomes
//! one `[[network]]` table (`gateway`, `prefix_length`, and
//! `ipv6_gateway`, `ipv6_prefix_length` when its IPv6 subnet is known) and
//! the load balancer's `network` key. The config needs a network's IPv4
//! subnet even when its VIPs are IPv6 (`[[network]] gateway` is required):
//! a network whose IPv4 subnet no object says is skipped by name, pointing
//! at the `--base` file, where the operator can write it.
//!
//! The interface: an untagged network is its bridge (`mgmt-br`, which
//! Harvester's network controller makes on every host of the cluster
//! network); a VLAN `V` of bridge `B` is the VLAN device `B.V`, which the
//! controller does not make (it only lets the VLAN through the bridge's
//! uplink): the operator makes it, or names the host's own with
//! `--network-interface NETWORK=INTERFACE`, which always wins. A network
//! in the `--base` file is taken as it is.
//!
//! Never half-imported: a load balancer whose network cannot be settled
//! (no NAD and no mapping, an interface this host does not have, sources
//! that disagree on the subnet, its own `allocatedAddress` disagreeing
//! with the network) is skipped, naming the network and why; so is every
//! load balancer of a network whose sources disagree among themselves, as
//! none can be chosen whatever the order (sources that disagree on the
//! IPv6 subnet skip only the network's IPv6 load balancers, and an IPv6 VIP
//! on a network whose IPv6 subnet is unknown is skipped alone). So is a
//! network whose interface
//! is no VM network's by its name (`lo`, the CNI's devices, a lease
//! macvlan: [`crate::config::not_a_vm_network_interface`]), as a tenant's
//! NAD `{"type":"bridge","bridge":"lo"}` would have it. Pure: the host's interfaces are
//! handed in ([`super::Options::interfaces`]).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use serde_json::Value;

use super::documents::Object;
use super::fields::{At, Reason, show};
use super::model::Network;
use super::{Mapped, Options};

/// The annotation Harvester's load-balancer controller reads a load
/// balancer's network from (`namespace/name` of a NAD).
pub const NETWORK_ANNOTATION: &str = "loadbalancer.harvesterhci.io/network";
/// A NetworkAttachmentDefinition's `apiVersion`.
pub const NAD_API_VERSION: &str = "k8s.cni.cncf.io/v1";
/// A NetworkAttachmentDefinition's `kind`.
pub const NAD_KIND: &str = "NetworkAttachmentDefinition";
/// The annotation Harvester's network controller keeps a VM network's
/// subnet and gateway in (`{"mode":"manual","cidr":…,"gateway":…}`).
pub const ROUTE_ANNOTATION: &str = "network.harvesterhci.io/route";
/// Longest interface name the kernel takes.
const MAX_IFNAME_BYTES: usize = 15;
/// Longest network name the config takes.
const MAX_NETWORK_NAME_BYTES: usize = 253;

/// A subnet's prefix length and gateway, of either family (the
/// gateway's).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct L3 {
    /// The prefix length.
    pub prefix_length: u8,
    /// The router.
    pub gateway: IpAddr,
}

impl fmt::Display for L3 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "/{} via {}", self.prefix_length, self.gateway)
    }
}

impl L3 {
    fn subnet(&self) -> Option<ipnet::IpNet> {
        ipnet::IpNet::new(self.gateway, self.prefix_length)
            .ok()
            .map(|n| n.trunc())
    }

    fn is_ipv6(&self) -> bool {
        self.gateway.is_ipv6()
    }
}

/// `IPv6` or `IPv4`, for messages.
fn family(v6: bool) -> &'static str {
    if v6 { "IPv6" } else { "IPv4" }
}

/// A load balancer's claim on a network: its name and what its own
/// `status.allocatedAddress` says of the subnet.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Claim {
    /// The network's name (`namespace/name`).
    pub name: String,
    /// `status.allocatedAddress.mask` and `.gateway`, when both are given.
    pub allocated: Option<L3>,
}

/// The network annotation of a `LoadBalancer` (`None` when absent or
/// empty: Harvester writes an empty one when it found none) and its
/// `allocatedAddress`. A name without a namespace is in the load
/// balancer's own, as Multus reads a VM's network name.
pub fn claim(meta: &At<'_>, allocated: &At<'_>) -> Result<Option<Claim>, Reason> {
    let Some(value) = meta
        .get("annotations")
        .map_entry(NETWORK_ANNOTATION)?
        .map(str::trim)
        .filter(|v| !v.is_empty())
    else {
        return Ok(None);
    };
    let name = if value.contains('/') {
        value.to_string()
    } else {
        let ns = meta.get("namespace").str()?.unwrap_or_default();
        format!("{ns}/{value}")
    };
    let ok = name.len() <= MAX_NETWORK_NAME_BYTES
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.' | '/'));
    if !ok {
        return Err(format!(
            "annotation {NETWORK_ANNOTATION}: {} is not a network name (namespace/name of a NetworkAttachmentDefinition)",
            show(&Value::String(value.to_string()))
        ));
    }
    let mask = allocated.get("mask");
    let gateway = allocated.get("gateway");
    let given = |at: &At<'_>| -> Result<Option<String>, Reason> {
        Ok(at
            .str()?
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string))
    };
    let allocated = (|| {
        Ok(match (given(&mask)?, given(&gateway)?) {
            (Some(m), Some(g)) => {
                let gateway = address(&g, gateway.path())?;
                Some(L3 {
                    prefix_length: prefix_of_mask(&m, mask.path(), gateway.is_ipv6())?,
                    gateway,
                })
            }
            _ => None,
        })
    })()
    .map_err(|e: Reason| {
        format!("on network {name:?} (annotation {NETWORK_ANNOTATION}): {e}; not imported")
    })?;
    Ok(Some(Claim { name, allocated }))
}

/// The prefix length of a subnet mask as Harvester writes it
/// (`255.255.255.0`; an IPv6 subnet's as `ffff:ffff:ffff:ffff::`, Go's
/// form of a 16-byte mask; a bare length is taken too), for a subnet of
/// the family `v6` says (its gateway's). A mask whose one bits are not all
/// first is refused: no prefix length means it.
pub fn prefix_of_mask(text: &str, path: &str, v6: bool) -> Result<u8, Reason> {
    let t = text.trim();
    let max = if v6 { 128 } else { 32 };
    if let Ok(n) = t.trim_start_matches('/').parse::<u8>() {
        return if n <= max {
            Ok(n)
        } else {
            Err(format!(
                "{path}: {t:?} is not a prefix length of an {} subnet (0-{max})",
                family(v6)
            ))
        };
    }
    let (ones, contiguous) = match t.parse::<IpAddr>() {
        Ok(IpAddr::V4(m)) => {
            let bits = u32::from(m);
            (
                bits.leading_ones(),
                bits.leading_ones() + bits.trailing_zeros() == 32,
            )
        }
        Ok(IpAddr::V6(m)) => {
            let bits = u128::from(m);
            (
                bits.leading_ones(),
                bits.leading_ones() + bits.trailing_zeros() == 128,
            )
        }
        Err(_) => {
            return Err(format!(
                "{path}: {t:?} is not a subnet mask (e.g. 255.255.255.0)"
            ));
        }
    };
    if !contiguous {
        return Err(format!(
            "{path}: {t:?} is not a contiguous subnet mask: its one bits must all come first (255.255.255.0 is /24); no prefix length means it"
        ));
    }
    let ipv6_form = t.contains(':');
    match (v6, ipv6_form) {
        (true, false) => Err(format!(
            "{path}: {t:?} is an IPv4 subnet mask, and the gateway is IPv6"
        )),
        // An IPv4 mask in 16 bytes (as Go may hold one): its last 32 bits.
        (false, true) if ones >= 96 => Ok((ones - 96) as u8),
        (false, true) => Err(format!(
            "{path}: {t:?} is an IPv6 subnet mask, and the gateway is IPv4"
        )),
        _ => Ok(ones as u8),
    }
}

/// An address of either family (an IPv4-mapped IPv6 one is IPv4).
fn address(text: &str, path: &str) -> Result<IpAddr, Reason> {
    text.trim()
        .parse::<IpAddr>()
        .map(|ip| ip.to_canonical())
        .map_err(|_| format!("{path}: {text:?} is not an IPv4 or IPv6 address"))
}

/// An address of the family `v6` says (a subnet's), naming `subnet` if it
/// is of the other.
fn address_of(text: &str, path: &str, v6: bool, subnet: &str) -> Result<IpAddr, Reason> {
    let ip = address(text, path)?;
    if ip.is_ipv6() != v6 {
        return Err(format!(
            "{path}: {text:?} is {}, and its subnet {subnet} is {}",
            family(ip.is_ipv6()),
            family(v6)
        ));
    }
    Ok(ip)
}

/// What a NetworkAttachmentDefinition says of its network.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NadFacts {
    /// The host bridge (`spec.config`'s `bridge`).
    pub bridge: String,
    /// The VLAN (`spec.config`'s `vlan`); `None`: untagged.
    pub vlan: Option<u16>,
    /// The route annotation's subnet and gateway, when it has both.
    pub l3: Option<L3>,
}

impl NadFacts {
    /// The host interface on this network: the bridge, or its VLAN device
    /// `bridge.vlan`.
    fn interface(&self, name: &str) -> Result<String, Reason> {
        let Some(vlan) = self.vlan else {
            return Ok(self.bridge.clone());
        };
        let device = format!("{}.{vlan}", self.bridge);
        if device.len() > MAX_IFNAME_BYTES {
            return Err(format!(
                "the VLAN device of bridge {} VLAN {vlan} would be {device:?}, longer than the kernel's {MAX_IFNAME_BYTES} bytes; name this host's device for it with --network-interface {name}=INTERFACE",
                self.bridge
            ));
        }
        Ok(device)
    }

    fn describe(&self) -> String {
        match self.vlan {
            Some(v) => format!("VLAN {v} of bridge {}", self.bridge),
            None => format!("bridge {}, untagged", self.bridge),
        }
    }
}

/// One NetworkAttachmentDefinition of the input.
#[derive(Debug, Clone)]
pub struct Nad {
    /// `namespace/name`.
    pub name: String,
    /// How messages name the object.
    pub object: String,
    /// Its bridge and VLAN, or why they cannot be read.
    pub facts: Result<NadFacts, Reason>,
    /// A route annotation that could not be read (then ignored).
    pub route_problem: Option<Reason>,
}

/// Reads a NetworkAttachmentDefinition.
pub fn nad(obj: &Object) -> Nad {
    let root = At::root(&obj.value);
    let meta = root.get("metadata");
    let name = match (
        meta.get("namespace").str().ok().flatten(),
        meta.get("name").str().ok().flatten(),
    ) {
        (Some(ns), Some(n)) if !ns.is_empty() && !n.is_empty() => format!("{ns}/{n}"),
        _ => String::new(),
    };
    let (l3, route_problem) = match route(&meta) {
        Ok(l3) => (l3, None),
        Err(why) => (None, Some(why)),
    };
    let facts = if name.is_empty() {
        Err("metadata.namespace or metadata.name is missing".to_string())
    } else {
        bridge_config(&root.get("spec").get("config")).map(|(bridge, vlan)| NadFacts {
            bridge,
            vlan,
            l3,
        })
    };
    Nad {
        name,
        object: obj.describe(),
        facts,
        route_problem,
    }
}

/// `spec.config`: the bridge CNI's JSON, `{"type":"bridge","bridge":
/// "mgmt-br","vlan":100,…}`.
fn bridge_config(at: &At<'_>) -> Result<(String, Option<u16>), Reason> {
    let path = at.path().to_string();
    let text = at
        .str()?
        .ok_or_else(|| format!("{path} is missing (the CNI configuration)"))?;
    let config: Value =
        serde_json::from_str(text).map_err(|e| format!("{path}: not JSON ({e})"))?;
    let cni = At::root(&config);
    let kind = cni.get("type").str().map_err(|e| format!("{path}: {e}"))?;
    if kind != Some("bridge") {
        return Err(format!(
            "{path}: type {} is not Harvester's bridge network, whose bridge and VLAN name a host interface",
            show(
                &cni.get("type")
                    .str()
                    .ok()
                    .flatten()
                    .map_or(Value::Null, |k| Value::String(k.into()))
            )
        ));
    }
    let bridge = cni
        .get("bridge")
        .str()
        .map_err(|e| format!("{path}: {e}"))?
        .filter(|b| !b.is_empty())
        .ok_or_else(|| format!("{path}: no \"bridge\""))?;
    if bridge.len() > MAX_IFNAME_BYTES || bridge.contains(['/', ':', ' ']) {
        return Err(format!(
            "{path}: bridge {bridge:?} is not an interface name"
        ));
    }
    // `check` refuses it in keepalived.conf: skipped here by name, so one
    // tenant's NAD cannot make the whole import invalid.
    if let Some(why) = crate::config::conf_word_problem(bridge) {
        return Err(format!("{path}: bridge {bridge:?} {why}"));
    }
    if !cni.get("vlanTrunk").items().unwrap_or_default().is_empty() {
        return Err(format!(
            "{path}: a VLAN trunk (vlanTrunk) carries several VLANs, not one network"
        ));
    }
    let vlan = match cni.get("vlan").int().map_err(|e| format!("{path}: {e}"))? {
        None | Some(0) => None,
        Some(v @ 1..=4094) => Some(v as u16),
        Some(v) => return Err(format!("{path}: vlan {v} is not a VLAN id (1-4094)")),
    };
    Ok((bridge.to_string(), vlan))
}

/// The route annotation's subnet and gateway; `None` when absent or not
/// filled in (`"mode":"auto"` before its DHCP probe).
fn route(meta: &At<'_>) -> Result<Option<L3>, Reason> {
    let Some(text) = meta.get("annotations").map_entry(ROUTE_ANNOTATION)? else {
        return Ok(None);
    };
    let what = format!("annotation {ROUTE_ANNOTATION}");
    let value: Value = serde_json::from_str(text).map_err(|e| format!("{what}: not JSON ({e})"))?;
    let at = At::root(&value);
    let field = |k: &str| -> Result<Option<String>, Reason> {
        Ok(at
            .get(k)
            .str()
            .map_err(|e| format!("{what}: {e}"))?
            .map(str::trim)
            .filter(|s| !s.is_empty())
            .map(str::to_string))
    };
    let (Some(cidr), Some(gateway)) = (field("cidr")?, field("gateway")?) else {
        return Ok(None);
    };
    let net: ipnet::IpNet = cidr
        .parse()
        .map_err(|_| format!("{what}: cidr {cidr:?} is not ADDRESS/PREFIX"))?;
    let v6 = matches!(net, ipnet::IpNet::V6(_));
    Ok(Some(L3 {
        prefix_length: net.prefix_len(),
        gateway: address_of(&gateway, &format!("{what}: gateway"), v6, &cidr)?,
    }))
}

/// One `IPPool` that selects a network (`spec.selector.network`): the
/// subnets and gateways of its ranges.
#[derive(Debug, Clone)]
pub struct Pool {
    /// The network it selects.
    pub network: String,
    /// How messages name the object.
    pub object: String,
    /// Each range's subnet and gateway, IPv4 or IPv6 (Harvester's default
    /// gateway: the subnet's first address).
    pub l3: Vec<L3>,
}

/// Reads an `IPPool`; `None` when it selects no network.
pub fn pool(obj: &Object) -> Result<Option<Pool>, Reason> {
    let root = At::root(&obj.value);
    let spec = root.get("spec");
    let Some(network) = spec
        .get("selector")
        .get("network")
        .str()?
        .map(str::trim)
        .filter(|n| !n.is_empty())
    else {
        return Ok(None);
    };
    let mut l3 = Vec::new();
    for range in spec.get("ranges").each()? {
        let subnet = range.get("subnet");
        let Some(text) = subnet.str()? else { continue };
        let Ok(net) = text.trim().parse::<ipnet::IpNet>() else {
            continue; // Harvester's webhook refuses it; no subnet to take.
        };
        let v6 = matches!(net, ipnet::IpNet::V6(_));
        let gateway = match range.get("gateway").str()?.filter(|g| !g.trim().is_empty()) {
            Some(g) => address_of(g, &format!("{}.gateway", range.path()), v6, text.trim())?,
            // Harvester's default: the subnet's first address (none in a
            // subnet too small to hold a gateway beside a VIP).
            None => match net {
                ipnet::IpNet::V4(n) if n.prefix_len() < 31 => {
                    IpAddr::V4(Ipv4Addr::from(u32::from(n.network()).saturating_add(1)))
                }
                ipnet::IpNet::V6(n) if n.prefix_len() < 127 => {
                    IpAddr::V6(Ipv6Addr::from(u128::from(n.network()).saturating_add(1)))
                }
                _ => continue,
            },
        };
        l3.push(L3 {
            prefix_length: net.prefix_len(),
            gateway,
        });
    }
    Ok(Some(Pool {
        network: network.to_string(),
        object: obj.describe(),
        l3,
    }))
}

/// A network of the `--base` file: its interface and subnets.
struct BaseNetwork {
    interface: String,
    l3: Option<L3>,
    /// `ipv6_gateway` at `ipv6_prefix_length` (64 unless set), if given.
    ipv6: Option<L3>,
}

/// The `[[network]]` tables of the `--base` file, by name.
fn base_networks(options: &Options) -> BTreeMap<String, BaseNetwork> {
    let mut out = BTreeMap::new();
    let Some(table) = options
        .base
        .as_ref()
        .and_then(|b| b.text.parse::<toml::Table>().ok())
    else {
        return out;
    };
    let Some(toml::Value::Array(nets)) = table.get("network") else {
        return out;
    };
    for n in nets {
        let (Some(name), Some(interface)) = (
            n.get("name").and_then(toml::Value::as_str),
            n.get("interface").and_then(toml::Value::as_str),
        ) else {
            continue;
        };
        let l3 = |length: Option<i64>, gateway: &str| {
            let gateway = n
                .get(gateway)
                .and_then(toml::Value::as_str)
                .and_then(|g| g.parse().ok())?;
            let prefix_length = u8::try_from(length?).ok()?;
            Some(L3 {
                prefix_length,
                gateway,
            })
        };
        let ipv6_length = n
            .get("ipv6_prefix_length")
            .and_then(toml::Value::as_integer)
            .unwrap_or(i64::from(crate::config::DEFAULT_IPV6_PREFIX_LENGTH));
        out.insert(
            name.to_string(),
            BaseNetwork {
                interface: interface.to_string(),
                l3: l3(
                    n.get("prefix_length").and_then(toml::Value::as_integer),
                    "gateway",
                )
                .filter(|l| !l.is_ipv6()),
                ipv6: l3(Some(ipv6_length), "ipv6_gateway").filter(L3::is_ipv6),
            },
        );
    }
    out
}

/// What is known of one family's subnet on a network: the subnet and
/// where it came from, nothing (no source speaks of it), or why none can
/// be chosen (its sources disagree).
type FamilySubnet = Result<Option<(L3, String)>, Reason>;

/// A network settled: its table (`None` when the `--base` file has it) and
/// its subnets, as far as known.
#[derive(Debug, Clone)]
struct Settled {
    table: Option<Network>,
    /// The IPv4 subnet and where it came from, for messages.
    v4: Option<(L3, String)>,
    /// The IPv6 subnet: only the network's IPv6 load balancers need it.
    v6: FamilySubnet,
}

/// Settles the network of every mapped load balancer that names one:
/// fills in the `[[network]]` tables to write (returned, by name) and
/// turns each load balancer that cannot be put on its network into a
/// skip (`Err`), naming the network and why.
pub fn resolve(
    results: &mut [(String, Result<Mapped, Reason>)],
    nads: &[Nad],
    pools: &[Pool],
    options: &Options,
    notes: &mut Vec<String>,
) -> BTreeMap<String, Network> {
    let base = base_networks(options);
    let mut claimed: BTreeMap<String, Vec<(String, Option<L3>)>> = BTreeMap::new();
    for (object, result) in results.iter() {
        if let Ok(Mapped { claim: Some(c), .. }) = result {
            claimed
                .entry(c.name.clone())
                .or_default()
                .push((object.clone(), c.allocated));
        }
    }
    let used: BTreeSet<&str> = claimed.keys().map(String::as_str).collect();
    let unused: BTreeSet<&str> = nads
        .iter()
        .map(|n| n.name.as_str())
        .filter(|n| !n.is_empty() && !used.contains(n))
        .collect();
    if !unused.is_empty() {
        let mut shown: Vec<&str> = unused.iter().copied().take(5).collect();
        let more = format!("and {} more", unused.len().saturating_sub(5));
        if unused.len() > 5 {
            shown.push(&more);
        }
        notes.push(format!(
            "{} NetworkAttachmentDefinition(s) named by no LoadBalancer, not written: {}",
            unused.len(),
            shown.join(", ")
        ));
    }
    let mut settled: BTreeMap<String, Result<Settled, Reason>> = BTreeMap::new();
    for (name, lbs) in &claimed {
        let s = settle(name, lbs, base.get(name), nads, pools, options, notes);
        settled.insert(name.clone(), s);
    }
    let mut tables = BTreeMap::new();
    for (object, result) in results.iter_mut() {
        let Ok(mapped) = result else { continue };
        let Some(claim) = mapped.claim.clone() else {
            continue;
        };
        let Some(outcome) = settled.get(&claim.name) else {
            continue; // Every claim was settled above.
        };
        let verdict = match outcome {
            Err(why) => Err(why.clone()),
            Ok(s) => check_claim(&claim, s, mapped, notes, object).map(|()| s),
        };
        match verdict {
            Ok(s) => {
                if let Some(t) = &s.table {
                    tables.insert(t.name.clone(), t.clone());
                }
            }
            Err(why) => {
                *result = Err(format!(
                    "on network {:?} (annotation {NETWORK_ANNOTATION}): {why}; not imported",
                    claim.name
                ));
            }
        }
    }
    tables
}

/// One load balancer against its settled network: its own
/// `allocatedAddress` must agree with the network's subnet of its family;
/// an IPv6 VIP needs the network's IPv6 subnet; a leased VIP outside the
/// subnet is not asked for.
fn check_claim(
    claim: &Claim,
    s: &Settled,
    mapped: &mut Mapped,
    notes: &mut Vec<String>,
    object: &str,
) -> Result<(), Reason> {
    let vip = mapped.lb.vip;
    if let Some(own) = claim.allocated
        && !vip.is_unspecified()
        && own.is_ipv6() != vip.is_ipv6()
    {
        return Err(format!(
            "status.allocatedAddress.gateway {} is {}, and the VIP {vip} is {}",
            own.gateway,
            family(own.is_ipv6()),
            family(vip.is_ipv6())
        ));
    }
    let net = if vip.is_ipv6() {
        match &s.v6 {
            Ok(Some(net)) => Some(net),
            Ok(None) => {
                return Err(format!(
                    "the VIP {vip} is IPv6, and the network's IPv6 subnet is unknown: no {ROUTE_ANNOTATION} annotation with an IPv6 cidr on its NetworkAttachmentDefinition, no IPPool selecting it with an IPv6 range, no status.allocatedAddress IPv6 mask and gateway on its load balancers; give the network an IPv6 IPPool, or define it in the --base file with ipv6_gateway"
                ));
            }
            Err(why) => return Err(why.clone()),
        }
    } else {
        s.v4.as_ref()
    };
    if let (Some(own), Some((net, source))) = (claim.allocated, net)
        && own != *net
    {
        return Err(format!(
            "status.allocatedAddress (mask and gateway: {own}) disagrees with the network's {net} ({source})"
        ));
    }
    if mapped.lb.leased
        && let (IpAddr::V4(v4), Some(ipnet::IpNet::V4(subnet))) =
            (mapped.lb.vip, s.v4.as_ref().and_then(|(l, _)| l.subnet()))
        && !v4.is_unspecified()
        && !subnet.contains(&v4)
    {
        notes.push(format!(
            "{object}: the address Harvester leased, {v4}, is outside network {:?}'s subnet {subnet}; this daemon leases a new one there",
            claim.name
        ));
        mapped.lb.vip = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
    }
    Ok(())
}

/// Settles network `name`, claimed by `lbs` (object, own subnet).
fn settle(
    name: &str,
    lbs: &[(String, Option<L3>)],
    base: Option<&BaseNetwork>,
    nads: &[Nad],
    pools: &[Pool],
    options: &Options,
    notes: &mut Vec<String>,
) -> Result<Settled, Reason> {
    let on_host = |interface: &str, what: &str| -> Result<(), Reason> {
        match &options.interfaces {
            Some(have) if !have.contains(interface) => Err(format!(
                "this host has no interface {interface:?} ({what}), so it is not on that network; {}",
                how_to_make(name, interface, what)
            )),
            _ => Ok(()),
        }
    };
    if let Some(b) = base {
        on_host(&b.interface, "the --base file's [[network]]")?;
        let source = || "the --base file's [[network]]".to_string();
        return Ok(Settled {
            table: None,
            v4: b.l3.map(|l| (l, source())),
            // The file is the operator's word: no object is asked.
            v6: b.ipv6.map(|l| Some((l, source()))).ok_or_else(|| {
                "its IPv6 subnet is unknown: the --base file's [[network]] has no ipv6_gateway; add the network's IPv6 router there".to_string()
            }),
        });
    }
    let mine: Vec<&Nad> = nads.iter().filter(|n| n.name == name).collect();
    for n in &mine {
        if let Some(why) = &n.route_problem {
            notes.push(format!("{}: {why}; ignored", n.object));
        }
    }
    let facts = match mine.as_slice() {
        [] => None,
        [one] => Some((one, one.facts.clone())),
        [first, rest @ ..] if rest.iter().all(|n| n.facts == first.facts) => {
            Some((first, first.facts.clone()))
        }
        many => {
            let objects: Vec<&str> = many.iter().map(|n| n.object.as_str()).collect();
            return Err(format!(
                "{} NetworkAttachmentDefinitions of that name differ ({}); none can be chosen",
                many.len(),
                objects.join("; ")
            ));
        }
    };
    let (interface, what) = match (options.network_interfaces.get(name), &facts) {
        (Some(i), _) => (i.clone(), format!("--network-interface {name}={i}")),
        (None, Some((nad, Ok(f)))) => (
            f.interface(name)?,
            format!("{}, from {}", f.describe(), nad.object),
        ),
        (None, Some((nad, Err(why)))) => {
            return Err(format!(
                "{}: {why}; name the host interface with --network-interface {name}=INTERFACE",
                nad.object
            ));
        }
        (None, None) => {
            return Err(format!(
                "no NetworkAttachmentDefinition {name} in the input and no --network-interface {name}=INTERFACE: the host interface on it is unknown (give `kubectl get net-attach-def -A -o json` too)"
            ));
        }
    };
    if let Some(why) = crate::config::not_a_vm_network_interface(&interface) {
        return Err(format!(
            "its interface {interface:?} ({what}) is {why}; a VM network is on a bridge, a VLAN device on one, or a bond"
        ));
    }
    on_host(&interface, &what)?;
    // Each family's subnet: the NAD's route annotation, else the IPPools
    // selecting the network, else the load balancers' own
    // allocatedAddress; the first that says anything of that family.
    let mut classes: Vec<Vec<(L3, String)>> = vec![Vec::new(), Vec::new(), Vec::new()];
    if let Some((nad, Ok(NadFacts { l3: Some(l3), .. }))) = &facts {
        classes[0].push((*l3, format!("{ROUTE_ANNOTATION} of {}", nad.object)));
    }
    for p in pools.iter().filter(|p| p.network == name) {
        for l3 in &p.l3 {
            classes[1].push((*l3, p.object.clone()));
        }
    }
    for (object, own) in lbs {
        if let Some(l3) = own {
            classes[2].push((*l3, format!("status.allocatedAddress of {object}")));
        }
    }
    let decide = |v6: bool| -> FamilySubnet {
        let Some(class) = classes
            .iter()
            .map(|c| {
                c.iter()
                    .filter(|(l3, _)| l3.is_ipv6() == v6)
                    .collect::<Vec<_>>()
            })
            .find(|c| !c.is_empty())
        else {
            return Ok(None);
        };
        let values: BTreeSet<L3> = class.iter().map(|(l3, _)| *l3).collect();
        if values.len() > 1 {
            let mut said: Vec<String> = class
                .iter()
                .map(|(l3, from)| format!("{l3} ({from})"))
                .collect();
            said.sort();
            return Err(format!(
                "its sources disagree on the {}subnet: {}; none can be chosen",
                if v6 { "IPv6 " } else { "" },
                said.join(", ")
            ));
        }
        Ok(class.first().map(|(l3, from)| (*l3, from.clone())))
    };
    let v6 = decide(true);
    let Some((l3, source)) = decide(false)? else {
        return Err(format!(
            "its IPv4 prefix length and gateway are unknown: no {ROUTE_ANNOTATION} annotation with an IPv4 cidr on its NetworkAttachmentDefinition, no IPPool selecting it with an IPv4 range, no status.allocatedAddress IPv4 mask and gateway{}; a [[network]] needs its IPv4 subnet (gateway, prefix_length), also for IPv6 VIPs: define the network in the --base file",
            match &v6 {
                Ok(Some((l3, from))) => format!(" (its IPv6 subnet is known: {l3}, from {from})"),
                _ => String::new(),
            }
        ));
    };
    let IpAddr::V4(gateway) = l3.gateway else {
        return Err(format!("its IPv4 gateway {} is IPv6", l3.gateway)); // decide(false) keeps IPv4 only
    };
    let ipv6 = match &v6 {
        Ok(Some((
            L3 {
                prefix_length,
                gateway: IpAddr::V6(g),
            },
            _,
        ))) => Some((*prefix_length, *g)),
        _ => None,
    };
    Ok(Settled {
        table: Some(Network {
            name: name.to_string(),
            interface,
            prefix_length: l3.prefix_length,
            gateway,
            ipv6,
        }),
        v4: Some((l3, source)),
        v6,
    })
}

/// How to give this host `interface`, for a skip line.
fn how_to_make(name: &str, interface: &str, what: &str) -> String {
    match interface.rsplit_once('.') {
        Some((bridge, vlan)) if what.starts_with("VLAN") => format!(
            "make the VLAN device (ip link add link {bridge} name {interface} type vlan id {vlan}; bridge vlan add dev {bridge} vid {vlan} self) or name this host's own with --network-interface {name}=INTERFACE"
        ),
        _ => format!(
            "add this host to that cluster network, or name its interface there with --network-interface {name}=INTERFACE"
        ),
    }
}

/// Why a `--network-interface` value is refused ([`parse_mapping`]).
#[derive(Debug, thiserror::Error)]
pub enum NetworkInterfaceFlagError {
    /// No `=` in the value.
    #[error(
        "--network-interface {value:?}: write NETWORK=INTERFACE, e.g. default/vlan100=mgmt-br.100"
    )]
    NoEquals {
        /// The value as given.
        value: String,
    },
    /// Nothing before the `=`.
    #[error(
        "--network-interface {value:?}: no network name before '=' (an interface name is 1-{MAX_IFNAME_BYTES} bytes, no '/', ':' or spaces)"
    )]
    NoNetworkName {
        /// The value as given.
        value: String,
    },
    /// What follows the `=` cannot name an interface.
    #[error(
        "--network-interface {value:?}: not an interface name after '=' (an interface name is 1-{MAX_IFNAME_BYTES} bytes, no '/', ':' or spaces)"
    )]
    BadInterfaceName {
        /// The value as given.
        value: String,
    },
    /// One network given two different interfaces.
    #[error("--network-interface: network {network} is given twice ({first} and {second})")]
    NetworkTwice {
        /// The network.
        network: String,
        /// Its first interface.
        first: String,
        /// The other.
        second: String,
    },
}

/// Parses `--network-interface NETWORK=INTERFACE` values.
pub fn parse_mapping(
    values: &[String],
) -> Result<BTreeMap<String, String>, NetworkInterfaceFlagError> {
    let mut out = BTreeMap::new();
    for v in values {
        let Some((name, interface)) = v.split_once('=') else {
            return Err(NetworkInterfaceFlagError::NoEquals { value: v.clone() });
        };
        let (name, interface) = (name.trim(), interface.trim());
        let bad_if = interface.is_empty()
            || interface.len() > MAX_IFNAME_BYTES
            || interface
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control());
        if name.is_empty() {
            return Err(NetworkInterfaceFlagError::NoNetworkName { value: v.clone() });
        }
        if bad_if {
            return Err(NetworkInterfaceFlagError::BadInterfaceName { value: v.clone() });
        }
        if let Some(old) = out.insert(name.to_string(), interface.to_string())
            && old != interface
        {
            return Err(NetworkInterfaceFlagError::NetworkTwice {
                network: name.to_string(),
                first: old,
                second: interface.to_string(),
            });
        }
    }
    Ok(out)
}

#[cfg(test)]
mod tests;

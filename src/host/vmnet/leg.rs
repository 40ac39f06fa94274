//! A VM network's **leg**: a macvlan on the network's bridge through which
//! the host routes the network's kernel-forwarded flows, so that they are
//! routed, not bridged back toward the port they came in by.
//!
//! Why: on a Harvester host the untagged VM network's interface is a Linux
//! bridge with an uplink port and `br_netfilter` on. A frame to a VIP is
//! DNATed at the bridge stage (`br_nf_pre_routing`), and
//! `br_nf_pre_routing_finish` routes the new destination: when that route
//! leaves by the bridge itself (its `bridged_dnat` path) the frame is
//! bridged again, toward the port it entered by, which the bridge refuses
//! (a client and a backend both behind the uplink got nothing). When the
//! route leaves by the leg instead (the network's table routes its subnet
//! and gateway by it, [`crate::host::vmnet::network`], and both directions of a leg
//! network's DNATed flows carry its mark, [`crate::host::vmnet::replymark`]), the
//! frame takes the routed path: re-addressed to the bridge's MAC, passed up,
//! forwarded out of the leg, whose transmit enters the bridge as the
//! host's own traffic and is bridged out of whichever port leads to the
//! backend, the ingress one included.
//!
//! The leg has no address (its source is the VIP: `snat to` the VIP
//! replaces `masquerade` on a leg network, see `daemon::kernel`) and is
//! made in bridge mode, up, on the network's interface, named
//! [`name_for`] its table (`hleg` and the table in decimal: at most 14
//! bytes, never a lease macvlan's `hlb` + 10 hex digits). A network needs
//! one when its interface is a Linux bridge whose frames pass the IP hooks
//! at the bridge stage (`bridge-nf-call-iptables` or `-ip6tables`, or the
//! bridge's own `nf_call_iptables` or `nf_call_ip6tables` on) and one of
//! its load balancers has a `forwarding = "kernel"` listener (IPv4 or
//! IPv6: `br_nf_pre_routing_finish_ipv6` has the same `bridged_dnat` path). Only while the stage is on:
//! without it the routed path by the bridge works, and a leg would cost
//! the bridge's promiscuity and lose what enters by it, which has no
//! address (with `rp_filter` on, `__fib_validate_source` drops a packet
//! entering an interface without an address unless its reverse route
//! leaves by that interface: a client that learned the VIP at the leg's
//! MAC). Cost: a macvlan adds its MAC to its lower device's unicast list,
//! and a bridge, which has no unicast filter, turns promiscuous: every
//! frame it forwards is also passed up once and dropped.
//!
//! The legs are a kind of the [`crate::host::owned::Driver`] (`network_leg`):
//! read back every 10 s and at every apply, made again with the MAC they
//! had when another program deleted or changed them (so the clients' ARP
//! entries stay right), counted in `host_repairs_total{kind="network_leg"}`,
//! removed after the drain at a clean stop, kept across a hand-over (the
//! next process adopts them as they are).

use crate::metrics::HostKind;
use std::collections::BTreeMap;
use std::fmt;
use std::sync::{Arc, Mutex};

use futures_util::TryStreamExt;
use rtnetlink::LinkMacVlan;
use rtnetlink::packet_route::link::{
    AfSpecInet, AfSpecUnspec, InetDevConf, InfoData, InfoMacVlan, LinkAttribute, LinkFlags,
    LinkInfo, LinkMessage, MacVlanMode,
};

use crate::config::{Config, Forwarding};
use crate::host::announce::routes::{AnnounceError, RouteWriter, errno};
use crate::host::owned::driver::Listing;
use crate::host::owned::{Backend, Found, StopPhase};

pub use crate::config::{LEG_PREFIX as PREFIX, leg_name as name_for, leg_table as table_of_name};

/// One leg, by its network's table.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct LegKey {
    /// The network's routing table.
    pub table: u32,
}

impl LegKey {
    /// The interface's name.
    pub fn name(&self) -> String {
        name_for(self.table)
    }
}

impl fmt::Display for LegKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "leg {}", self.name())
    }
}

/// What a leg must be.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegWant {
    /// The network's interface (the bridge), by index.
    pub parent: u32,
}

/// A leg as the kernel shows it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LegSeen {
    /// Its index.
    pub index: u32,
    /// Its lower device.
    pub parent: Option<u32>,
    /// Its MAC address.
    pub mac: [u8; 6],
    /// Administratively up.
    pub up: bool,
    /// In macvlan bridge mode.
    pub bridge_mode: bool,
    /// Its `arp_ignore` (IPv4 devconf): [`ARP_IGNORE`] as made.
    pub arp_ignore: Option<i32>,
}

/// The leg's `arp_ignore`: never answer an ARP request. The host's
/// addresses (the VIPs, a management address on the bridge) are answered
/// by the bridge alone, so no peer learns one of them at the leg's MAC and
/// sends what the host must receive to an interface without an address
/// (`rp_filter` drops what enters there unless its reverse route leaves by
/// it). Peers still learn a VIP at the leg's MAC from the leg's own ARP
/// requests (sent from the VIP), which the bridge stage routes.
pub const ARP_IGNORE: i32 = 8;

impl LegSeen {
    /// Whether it is what [`NetworkLegs::write`] makes on `want`'s parent.
    fn as_made(&self, want: &LegWant) -> bool {
        self.parent == Some(want.parent)
            && self.up
            && self.bridge_mode
            && self.arp_ignore == Some(ARP_IGNORE)
    }
}

/// Whether `interface` is a Linux bridge whose IPv4 (`ipv6` false) or
/// IPv6 frames pass the IP hooks at the bridge stage now:
/// `bridge-nf-call-iptables` (`-ip6tables`) or the bridge's own
/// `nf_call_iptables` (`nf_call_ip6tables`) is 1 (read at each step of the
/// VM-network task, which the kernel writer wakes when they change).
pub fn bridge_stage_on(interface: &str, ipv6: bool) -> bool {
    crate::os::is_bridge(interface)
        && (crate::os::bridge_nf_calls()[usize::from(ipv6)]
            || crate::os::bridge_nf_call_own(interface, ipv6))
}

/// The networks that need a leg on this host: those whose interface is a
/// Linux bridge here with the bridge stage on (`stage_on`,
/// [`bridge_stage_on`]) for the family of one of its kernel listeners'
/// VIPs, and exists (`index_of`, by name), with a load
/// balancer that has a `forwarding = "kernel"` listener. By the
/// network's name: its table and its bridge's index. Pure.
pub fn wanted(
    config: &Config,
    index_of: &BTreeMap<String, u32>,
    stage_on: impl Fn(&str, bool) -> bool,
) -> BTreeMap<String, (LegKey, LegWant)> {
    let mut out = BTreeMap::new();
    for net in &config.networks {
        // The bridge stage of a family a kernel listener's VIP has.
        let needed = config.load_balancers.iter().any(|lb| {
            lb.network.as_deref() == Some(net.name.as_str())
                && !lb.vip.is_unspecified()
                && lb
                    .listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
                && stage_on(&net.interface, lb.vip.is_ipv6())
        });
        if !needed {
            continue;
        }
        let Some(&parent) = index_of.get(&net.interface) else {
            continue;
        };
        out.insert(
            net.name.clone(),
            (LegKey { table: net.table }, LegWant { parent }),
        );
    }
    out
}

/// The legs in the kernel (see the module's text).
#[derive(Debug, Clone)]
pub struct NetworkLegs {
    writer: RouteWriter,
    /// Each leg's MAC address as first seen (made by this process or
    /// adopted): a leg made again gets it back, so the clients' ARP
    /// entries for the VIP stay right. Shared: the driver lends only a
    /// shared reference for reading it.
    macs: Arc<Mutex<BTreeMap<u32, [u8; 6]>>>,
}

/// Why a leg could not be read, made or removed.
pub type LegError = AnnounceError;

fn nl(what: String) -> impl FnOnce(rtnetlink::Error) -> LegError {
    move |source| AnnounceError::Netlink { what, source }
}

impl NetworkLegs {
    /// Legs made through `writer`.
    pub fn new(writer: RouteWriter) -> Self {
        Self {
            writer,
            macs: Arc::default(),
        }
    }

    /// The netlink connection (the routes' and marks' too).
    pub fn writer(&self) -> &RouteWriter {
        &self.writer
    }

    /// The MAC address leg `key` has or gets back.
    pub fn mac(&self, key: &LegKey) -> Option<[u8; 6]> {
        self.macs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key.table)
            .copied()
    }

    async fn delete_named(&self, name: &str) -> Result<(), LegError> {
        let handle = self.writer.handle();
        let mut found = handle.link().get().match_name(name.to_string()).execute();
        let index = match found.try_next().await {
            Ok(Some(m)) => m.header.index,
            Ok(None) => return Ok(()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => return Ok(()),
            Err(e) => return Err(nl(format!("cannot look up {name:?}"))(e)),
        };
        match handle.link().del(index).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ENODEV) => Ok(()),
            Err(e) => Err(nl(format!("cannot remove the leg {name:?}"))(e)),
        }
    }
}

/// The IPv4 `arp_ignore` a link message carries.
fn arp_ignore_of(attributes: &[LinkAttribute]) -> Option<i32> {
    attributes.iter().find_map(|a| match a {
        LinkAttribute::AfSpecUnspec(specs) => specs.iter().find_map(|s| match s {
            AfSpecUnspec::Inet(inet) => inet.iter().find_map(|i| match i {
                AfSpecInet::DevConf(c) => Some(c.arp_ignore),
                _ => None,
            }),
            _ => None,
        }),
        _ => None,
    })
}

/// `(kind, macvlan bridge mode)` of a link message.
fn kind_of(attributes: &[LinkAttribute]) -> (Option<String>, bool) {
    let mut kind = None;
    let mut bridge_mode = false;
    for a in attributes {
        let LinkAttribute::LinkInfo(infos) = a else {
            continue;
        };
        for i in infos {
            match i {
                LinkInfo::Kind(k) => kind = Some(k.to_string()),
                LinkInfo::Data(InfoData::MacVlan(data)) => {
                    bridge_mode = data
                        .iter()
                        .any(|d| matches!(d, InfoMacVlan::Mode(MacVlanMode::Bridge)));
                }
                _ => {}
            }
        }
    }
    (kind, bridge_mode)
}

impl Backend for NetworkLegs {
    const KIND: HostKind = HostKind::NetworkLeg;
    // The open connections the drain waits for are routed through it.
    const STOP: StopPhase = StopPhase::AfterDrain;
    // `hleg<table>` macvlans are this daemon's alone (the networks' tables
    // are claimed with its routes).
    const REMOVES_STRAYS: bool = true;
    type Key = LegKey;
    type Want = LegWant;
    type Seen = LegSeen;
    type Error = LegError;

    async fn read(&mut self) -> Result<Listing<Self>, LegError> {
        let mut out: Listing<Self> = BTreeMap::new();
        let mut links = self.writer.handle().link().get().execute();
        while let Some(m) = links
            .try_next()
            .await
            .map_err(nl("cannot list the host's interfaces".into()))?
        {
            let Some(table) = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::IfName(n) => table_of_name(n),
                _ => None,
            }) else {
                continue;
            };
            let (kind, bridge_mode) = kind_of(&m.attributes);
            let mac = m
                .attributes
                .iter()
                .find_map(|a| match a {
                    LinkAttribute::Address(a) => <[u8; 6]>::try_from(a.as_slice()).ok(),
                    _ => None,
                })
                .unwrap_or_default();
            let parent = m.attributes.iter().find_map(|a| match a {
                LinkAttribute::Link(i) => Some(*i),
                _ => None,
            });
            let marked = kind.as_deref() == Some("macvlan");
            if marked {
                // The first MAC seen is the one it keeps.
                self.macs
                    .lock()
                    .unwrap_or_else(|p| p.into_inner())
                    .entry(table)
                    .or_insert(mac);
            }
            out.insert(
                LegKey { table },
                Found {
                    seen: LegSeen {
                        index: m.header.index,
                        parent,
                        mac,
                        up: m.header.flags.contains(LinkFlags::Up),
                        bridge_mode,
                        arp_ignore: arp_ignore_of(&m.attributes),
                    },
                    marked,
                },
            );
        }
        Ok(out)
    }

    async fn write(&mut self, key: &LegKey, want: &LegWant) -> Result<(), LegError> {
        let name = key.name();
        // One not as made (down, on another parent, another MAC) goes
        // first: made again whole, with the MAC it had.
        self.delete_named(&name).await?;
        let mut link = LinkMacVlan::new(&name, want.parent, MacVlanMode::Bridge).up();
        if let Some(mac) = self.mac(key) {
            link = link.address(mac.to_vec());
        }
        let handle = self.writer.handle();
        handle
            .link()
            .add(link.build())
            .execute()
            .await
            .map_err(nl(format!(
                "cannot make the leg {name:?} (a macvlan on interface index {})",
                want.parent
            )))?;
        // Over netlink, not /proc/sys (read-only under the unit).
        let mut found = handle.link().get().match_name(name.clone()).execute();
        let index = match found.try_next().await {
            Ok(Some(m)) => m.header.index,
            Ok(None) => return Ok(()),
            Err(e) => return Err(nl(format!("cannot look up the leg {name:?}"))(e)),
        };
        let mut set = LinkMessage::default();
        set.header.index = index;
        // Only the non-zero entries are sent: this one alone.
        let mut conf = InetDevConf::default();
        conf.arp_ignore = ARP_IGNORE;
        set.attributes
            .push(LinkAttribute::AfSpecUnspec(vec![AfSpecUnspec::Inet(vec![
                AfSpecInet::DevConfRequest(conf),
            ])]));
        handle
            .link()
            .set(set)
            .execute()
            .await
            .map_err(nl(format!("cannot set arp_ignore on the leg {name:?}")))
    }

    async fn remove(&mut self, key: &LegKey) -> Result<(), LegError> {
        self.delete_named(&key.name()).await?;
        self.macs
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(&key.table);
        Ok(())
    }

    /// A predecessor's leg (a hand-over, a restart) on the right bridge,
    /// up, in bridge mode: kept with its MAC, so no client's ARP entry
    /// goes stale.
    fn adoptable(&self, want: &LegWant, seen: &LegSeen) -> bool {
        seen.as_made(want)
    }
}

/// What `/status` shows of one network's leg (`networks[].leg`): the
/// kernel's object as last read back.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize)]
pub struct LegStatus {
    /// The interface's name.
    pub name: String,
    /// Its MAC address as read back; `None` while it is not in place.
    pub mac: Option<String>,
    /// `up` (in place as made: up, bridge mode, on the network's bridge),
    /// `missing` (not made yet, or its making failed).
    pub state: &'static str,
    /// Why it is not in place, while it is not.
    pub error: Option<String>,
}

impl LegStatus {
    /// Whether the leg is in place (read back present and up).
    pub fn up(&self) -> bool {
        self.state == "up"
    }
}

/// `aa:bb:cc:dd:ee:ff`.
pub fn colons(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{KEEPALIVED, VLAN100, VLAN200, config, lb};

    #[test]
    fn a_leg_s_name_fits_ifnamsiz_and_is_never_a_lease_macvlan_s() {
        assert_eq!(name_for(1000), "hleg1000");
        assert!(name_for(u32::MAX).len() <= 15);
        assert_eq!(table_of_name("hleg1000"), Some(1000));
        for not in [
            "hleg",
            "hleg01",
            "hleg1x",
            "hlb0a0b0c0d0e",
            "hleg99999999999",
        ] {
            assert_eq!(table_of_name(not), None, "{not}");
        }
        assert!(crate::config::not_a_vm_network_interface("hleg1000").is_some());
    }

    #[test]
    fn only_a_bridged_network_with_a_kernel_listener_gets_a_leg() {
        let kernel = "  forwarding = \"kernel\"\n";
        let text = format!(
            "{KEEPALIVED}{VLAN100}table = 1100\n{VLAN200}table = 1200\n{}{kernel}{}{kernel}",
            lb("default/a", "10.100.0.50", "vlan100", &[]),
            lb("default/b", "10.200.0.50", "vlan200", &[]),
        );
        let c = config(&text);
        let index: BTreeMap<String, u32> =
            [("br.100".to_string(), 7), ("br.200".to_string(), 8)].into();
        // br.200 is no bridge (a VLAN device): no leg there.
        let w = wanted(&c, &index, |i, _| i == "br.100");
        let got: Vec<String> = w
            .iter()
            .map(|(n, (k, v))| format!("{n} {k} {}", v.parent))
            .collect();
        assert_eq!(got, ["vlan100 leg hleg1100 7"]);
        // Proxy listeners only: none.
        let text = format!(
            "{KEEPALIVED}{VLAN100}{}",
            lb("default/p", "10.100.0.50", "vlan100", &[])
        );
        assert!(wanted(&config(&text), &index, |_, _| true).is_empty());
    }
}

//! Why a listener the config gives the kernel is served by the proxy
//! instead: the host does not forward the VIP's family (or its sysctl
//! cannot be read), bridged frames would be NATed at the bridge stage, or
//! a tenant leg's listener has no source NAT. Its own file because these
//! are facts about the host, read and packed into one byte here and judged
//! per listener, while the writer in the parent only asks.

use std::net::IpAddr;
use std::sync::atomic::Ordering;

use super::NAMED_IN_LOG;
use crate::config::{Config, Forwarding, LoadBalancerSpec, SourceNat};
use crate::daemon::Daemon;
use crate::host::vmnet::leg::LegStatus;
use crate::host::vmnet::mgmt_leg::MgmtLegStatus;
use crate::os::Sysctl;

/// The forwarding sysctls, IPv4's then IPv6's (the order of
/// [`crate::os::ip_forwarding`]).
const FORWARDING_SYSCTLS: [&str; 2] = ["net.ipv4.ip_forward", "net.ipv6.conf.all.forwarding"];
/// What to do when a forwarding sysctl cannot be read.
const UNREADABLE_REMEDY: &str = "under systemd, ProcSubset=pid hides /proc/sys; the VIP drop-in (harvester-lb.service.d/vip.conf) sets ProcSubset=all";

/// The two families' forwarding in one byte (`Daemon::forwarding_off`),
/// two bits each, IPv4 in the low ones: 0 on, 1 off, 2 unreadable. Zero
/// means both forward.
pub(super) fn pack_forwarding(states: [Sysctl; 2]) -> u8 {
    let bits = |s: Sysctl| match s {
        Sysctl::On => 0u8,
        Sysctl::Off => 1,
        Sysctl::Unreadable => 2,
    };
    bits(states[0]) | (bits(states[1]) << 2)
}

/// [`pack_forwarding`]'s byte with whether each family's bridged frames
/// pass the IP hooks at the bridge stage by the host's sysctl
/// ([`crate::os::bridge_nf_calls`]) in bits 4 (IPv4) and 5 (IPv6), and
/// whether some bridge has its own switch on for the family
/// ([`crate::os::bridge_nf_calls_own_any`]) in bits 6 and 7: a change of
/// any rebuilds the kernel listeners as a change of forwarding does.
pub(super) fn pack_bridge_stage(packed: u8, calls: [bool; 2], own: [bool; 2]) -> u8 {
    packed
        | (u8::from(calls[0]) << 4)
        | (u8::from(calls[1]) << 5)
        | (u8::from(own[0]) << 6)
        | (u8::from(own[1]) << 7)
}

/// Whether one family's bridged frames pass the IP hooks by the host's
/// sysctl, from [`pack_bridge_stage`]'s byte (0 IPv4, 1 IPv6).
pub(super) fn bridge_stage_of(packed: u8, family: usize) -> bool {
    (packed >> (4 + family)) & 1 == 1
}

/// Whether some bridge has its own switch on for one family, from
/// [`pack_bridge_stage`]'s byte (0 IPv4, 1 IPv6).
pub(super) fn own_bridge_stage_of(packed: u8, family: usize) -> bool {
    (packed >> (6 + family)) & 1 == 1
}

/// The switch that makes `interface`'s frames of `family` pass the IP
/// hooks at the bridge stage, named for the operator: the host's sysctl
/// (`sysctl`) when it is on, else the bridge's own option when that is;
/// `None` when neither is (or `interface` is no bridge).
fn bridge_stage_switch(packed: u8, family: usize, interface: &str, sysctl: &str) -> Option<String> {
    if !crate::os::is_bridge(interface) {
        return None;
    }
    if bridge_stage_of(packed, family) {
        return Some(format!("{sysctl} is 1 on this host"));
    }
    let own = ["nf_call_iptables", "nf_call_ip6tables"][family];
    (own_bridge_stage_of(packed, family) && crate::os::bridge_nf_call_own(interface, family == 1))
        .then(|| {
            format!(
                "the bridge's own {own} is 1 (/sys/class/net/{interface}/bridge/{own}; {sysctl} is 0, but the kernel runs the hooks when either is on)"
            )
        })
}

/// Why `spec`'s kernel listeners cannot work on this host, given the
/// packed host settings `packed`: bridged frames of the VIP's family pass
/// the IP hooks at the bridge stage (`br_netfilter`: the host's sysctl or
/// the bridge's own switch, [`bridge_stage_switch`]), the interface its
/// clients come in by is a Linux bridge, and a backend is reached through
/// that same bridge. For a VIP on a `[[network]]` that is the network's
/// interface and a backend in its subnet; for one on no network see
/// [`off_network_reason`].
///
/// Then the DNAT runs in `br_nf_pre_routing`, before the bridge has chosen
/// a port; `br_nf_pre_routing_finish` routes the new destination, finds it
/// behind the bridge itself and bridges the frame again (its
/// `bridged_dnat` path), and the bridge never sends a frame out of the
/// port it came in by: a client and a backend both behind the uplink (the
/// normal case: the other hosts' VMs) get nothing. Which port a client's
/// frames come by is not known beforehand, so the proxy, which the frame
/// reaches through the local stack, serves every such listener. A tagged
/// network's VLAN device is no bridge: its frames are NATed on it and
/// routed out of it (docs/vip.md, "On a bridged host").
fn bridge_stage_reason(
    packed: u8,
    spec: &LoadBalancerSpec,
    config: &Config,
    leg: &dyn Fn(&crate::config::NetworkSpec) -> Option<LegStatus>,
    mgmt: Option<&MgmtLegStatus>,
) -> Option<String> {
    let family = usize::from(spec.vip.is_ipv6());
    let sysctl = [
        "net.bridge.bridge-nf-call-iptables",
        "net.bridge.bridge-nf-call-ip6tables",
    ][family];
    let Some(name) = spec.network.as_deref() else {
        if !bridge_stage_of(packed, family) && !own_bridge_stage_of(packed, family) {
            return None;
        }
        return off_network_reason(packed, spec, config, sysctl, mgmt);
    };
    let network = config.networks.iter().find(|n| n.name == name)?;
    let in_subnet = |ip: &IpAddr| match ip {
        IpAddr::V4(v4) => network.subnet().contains(v4),
        IpAddr::V6(v6) => network.ipv6_subnet().is_some_and(|n| n.contains(v6)),
    };
    let backend = spec.backends.iter().find(|b| in_subnet(b))?;
    let leg = leg(network);
    match leg {
        // The leg routes the flows (`host::vmnet::leg`), whatever the bridge stage.
        Some(l) if l.up() => leg_source_nat_reason(spec, network, &l),
        leg => {
            let switch = bridge_stage_switch(packed, family, &network.interface, sysctl)?;
            let why = match leg {
                Some(l) => format!(
                    "its leg {:?} (the macvlan that routes these flows) is not in place: {}",
                    l.name,
                    l.error.as_deref().unwrap_or("not made yet")
                ),
                None => "it has no leg (the macvlan that routes these flows)".to_string(),
            };
            Some(format!(
                "network {:?}'s interface {:?} is a bridge and {switch}, and {why}: without it br_netfilter NATs a frame at the bridge stage and a backend in the subnet ({backend}) behind the port a client's frame came in by is never reached (the bridge sends no frame back out of its ingress port), so the proxy serves this listener until the leg is in place (docs/vip.md, \"On a bridged host\")",
                network.name, network.interface,
            ))
        }
    }
}

/// Why `spec`'s kernel listeners on `network`, whose leg `leg` is in
/// place, are served by the proxy: one of them has `source_nat = "none"`.
/// The leg has no address, so the host's ARP for a backend, sent from the
/// client's address (not the host's), would carry another interface's
/// address as its sender (the management address, into the tenant's
/// network). `masquerade` is written as `snat to` the VIP there instead.
fn leg_source_nat_reason(
    spec: &LoadBalancerSpec,
    network: &crate::config::NetworkSpec,
    leg: &LegStatus,
) -> Option<String> {
    let l = spec
        .listeners
        .iter()
        .find(|l| l.forwarding == Forwarding::Kernel && l.source_nat == SourceNat::None)?;
    Some(format!(
        "listener {:?} has source_nat = \"none\" and network {:?} is routed by its leg {:?}, which has no address: the host's ARP for a backend would carry another interface's address (this host's management address) into the tenant's network, so the proxy serves this load balancer's kernel listeners; use source_nat = \"vip\" or \"masquerade\" (written as SNAT to the VIP there) for the kernel path (docs/vip.md, \"On a bridged host\")",
        l.name, network.name, leg.name,
    ))
}

/// [`bridge_stage_reason`] for a VIP on no `[[network]]`. Its clients come
/// in by `keepalived.interface` when the keepalived this daemon configures
/// moves it (a management VIP: it answers ARP there), or, with `vip.announce
/// = "routes"`, by the device of the host's default route of the VIP's
/// family: the router the VIP is announced to is normally the default
/// gateway, and the host's BGP session and the router's flows share that
/// link (a host with its router on another link is told nothing wrong:
/// the default route's bridge then leads to no backend, or it does and the
/// proxy serves a listener the kernel could have). Any other VIP (held by
/// other means, a loopback) is left alone. A management VIP routed by the
/// management VIPs' leg (`mgmt`, in place: `host::vmnet::mgmt_leg`) is not held
/// back: its flows are routed out of the leg, not bridged; while the leg
/// is not in place the reason says what failed. An announced VIP has no
/// leg (out of scope: its clients' link is the router's, not keepalived's). Read from the routes at each
/// whole rebuild of the kernel's desired state (a reload, a change of the
/// forwarding or bridge sysctls), not at every route change.
fn off_network_reason(
    packed: u8,
    spec: &LoadBalancerSpec,
    config: &Config,
    sysctl: &str,
    mgmt: Option<&MgmtLegStatus>,
) -> Option<String> {
    let routes = crate::os::Routes::read_recent(spec.vip.is_ipv6());
    let managed = config.keepalived_interface(spec);
    // A management VIP routed by the management VIPs' leg in place
    // (`host::vmnet::mgmt_leg`): its flows are routed out of the leg, never
    // bridged back, whatever the bridge stage.
    let mgmt = mgmt.filter(|m| managed == Some(m.interface.as_str()));
    if mgmt.is_some_and(|m| m.in_place && m.vips.contains(&spec.vip)) {
        return None;
    }
    let (interface, by) = match managed {
        Some(i) => (
            i,
            "keepalived.interface, where keepalived moves this management VIP",
        ),
        None if config.vip.announce.enabled() && !spec.vip.to_canonical().is_loopback() => (
            routes.default_device()?,
            "the default route's device, the router's link, which this announced VIP's flows come by",
        ),
        None => return None,
    };
    let family = usize::from(spec.vip.is_ipv6());
    let switch = bridge_stage_switch(packed, family, interface, sysctl)?;
    let backend = spec
        .backends
        .iter()
        .find(|b| routes.device_for(**b) == Some(interface))?;
    let remedy = match mgmt {
        Some(m) => format!(
            "the management VIPs' leg {:?} (table {}), which routes these flows, is not in place: {}",
            m.leg.name,
            m.table,
            m.error.as_deref().unwrap_or("not made yet")
        ),
        None if managed.is_some() => "the management VIPs' leg, which routes these flows, is not made yet".to_string(),
        None => "backends on a routed network of their own, or a VLAN device or a dedicated NIC toward the clients, work with the kernel path".to_string(),
    };
    Some(format!(
        "the VIP is on no [[network]] and its clients come in by {interface:?} ({by}); {interface:?} is a bridge and {switch}: br_netfilter NATs a frame at the bridge stage, and a backend routed out of that same bridge ({backend}) behind the port a client's frame came in by is never reached (the bridge sends no frame back out of its ingress port), so the proxy serves this listener; {remedy} (docs/vip.md, \"On a bridged host\")"
    ))
}

/// One family's forwarding from [`pack_forwarding`]'s byte (0 IPv4, 1 IPv6).
pub(super) fn forwarding_of(packed: u8, family: usize) -> Sysctl {
    match (packed >> (2 * family)) & 3 {
        0 => Sysctl::On,
        1 => Sysctl::Off,
        _ => Sysctl::Unreadable,
    }
}

impl Daemon {
    /// Reads the host's forwarding settings; logs a change of them at
    /// error (off or unreadable) or info (on again). Returns whether they
    /// changed.
    pub(super) fn check_ip_forwarding(&self) -> bool {
        let read = crate::os::ip_forwarding();
        let off = pack_bridge_stage(
            pack_forwarding([read[0].0, read[1].0]),
            crate::os::bridge_nf_calls(),
            crate::os::bridge_nf_calls_own_any(),
        );
        let was = self.forwarding_off.swap(off, Ordering::AcqRel);
        if was == off {
            return false;
        }
        // A bridged network's leg comes and goes with the bridge stage.
        self.vmnet_wake();
        // Said only of a family some kernel listener uses: an ERROR about
        // IPv6 forwarding on a host with IPv4 kernel listeners alone
        // misleads (a listener that comes later shows the reason in
        // `/status` `kernel_error`).
        let mut used = [false; 2];
        if let Some(c) = self.lock().config.as_ref() {
            for lb in &c.load_balancers {
                if lb
                    .listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
                {
                    used[usize::from(lb.vip.is_ipv6())] = true;
                }
            }
        }
        for (family, (now, raw)) in read.iter().enumerate() {
            let sysctl = FORWARDING_SYSCTLS[family];
            let before = forwarding_of(was, family);
            if before == *now || !used[family] {
                continue;
            }
            match (now, raw) {
                (Sysctl::Off, _) => tracing::error!(
                    "{sysctl} is 0 on this host: the kernel would drop every packet it forwards, so the forwarding = \"kernel\" listeners of that family are served by the proxy until it is 1 (the daemon does not change it)"
                ),
                (Sysctl::Unreadable, raw) => tracing::error!(
                    "{sysctl} cannot be read ({}: {}), so the forwarding = \"kernel\" listeners of that family are served by the proxy until it reads 1: {UNREADABLE_REMEDY}",
                    crate::os::IP_FORWARDING_FILES[family],
                    match raw {
                        Ok(v) => format!("not a number: {:?}", v.trim()),
                        Err(e) => e.to_string(),
                    }
                ),
                (Sysctl::On, _) => tracing::info!(
                    "{sysctl} is 1 again: kernel listeners of that family go back to the kernel"
                ),
            }
        }
        let held: Vec<String> = self.lock().config.as_ref().map_or_else(Vec::new, |c| {
            let mgmt = self.mgmt_leg(c);
            c.load_balancers
                .iter()
                // Only those with a kernel listener: a proxy-only load
                // balancer is served as it asked (the bed of
                // tests/conntrack_sync_v6.rs was told its proxy-only
                // gateway VIP's listeners were moved to the proxy).
                .filter(|lb| {
                    lb.listeners
                        .iter()
                        .any(|l| l.forwarding == Forwarding::Kernel)
                        && bridge_stage_reason(off, lb, c, &|n| self.leg(n), mgmt.as_deref())
                            .is_some()
                })
                .map(|lb| format!("{:?}", lb.name))
                .collect()
        });
        let families = |packed: u8| packed >> 4;
        if families(was) != families(off) && !held.is_empty() {
            tracing::warn!(
                load_balancers = held.len(),
                "br_netfilter NATs bridged frames at the bridge stage on this host (net.bridge.bridge-nf-call-iptables or -ip6tables = 1, or a bridge's own nf_call_iptables or nf_call_ip6tables): the forwarding = \"kernel\" listeners of load balancers whose clients come in by a bridge that also leads to a backend (a bridged VM network with backends in its subnet, or the bridge of keepalived.interface or of the default route for a VIP on no network) are served by the proxy ({}{}): docs/vip.md, \"On a bridged host\"",
                held.iter()
                    .take(NAMED_IN_LOG)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", "),
                if held.len() > NAMED_IN_LOG {
                    ", …"
                } else {
                    ""
                }
            );
        }
        true
    }

    /// Why load balancer `spec`'s kernel listeners are served by the proxy
    /// on this host although it forwards: see [`bridge_stage_reason`].
    pub(in crate::daemon) fn bridge_stage_blocked(
        &self,
        spec: &LoadBalancerSpec,
        config: &Config,
    ) -> Option<String> {
        bridge_stage_reason(
            self.forwarding_off.load(Ordering::Acquire),
            spec,
            config,
            &|n| self.leg(n),
            self.mgmt_leg(config).as_deref(),
        )
    }

    /// Whether `spec`'s network routes its kernel listeners' flows out of
    /// its leg (in place), to a backend in the network's subnet: their
    /// `masquerade` is then `snat to` the VIP, the leg having no address
    /// of its own. A load balancer whose backends are all elsewhere
    /// (routed out of another interface) keeps `masquerade`, that
    /// interface's address, to which its backends route their replies.
    pub(super) fn on_leg(&self, spec: &LoadBalancerSpec, config: &Config) -> bool {
        let Some(name) = spec.network.as_deref() else {
            // A management VIP routed by the management VIPs' leg.
            return self
                .mgmt_leg(config)
                .is_some_and(|m| m.in_place && m.vips.contains(&spec.vip));
        };
        let Some(network) = config.networks.iter().find(|n| n.name == name) else {
            return false;
        };
        let in_subnet = |ip: &IpAddr| match ip {
            IpAddr::V4(v4) => network.subnet().contains(v4),
            IpAddr::V6(v6) => network.ipv6_subnet().is_some_and(|n| n.contains(v6)),
        };
        spec.backends.iter().any(in_subnet) && self.leg(network).is_some_and(|l| l.up())
    }

    /// Why a kernel listener on `vip` is not in the kernel although its
    /// table is written: the host does not forward its family, or the
    /// daemon cannot read whether it does.
    pub(in crate::daemon) fn forwarding_blocked(&self, vip: IpAddr) -> Option<String> {
        let family = usize::from(vip.is_ipv6());
        let sysctl = FORWARDING_SYSCTLS[family];
        match forwarding_of(self.forwarding_off.load(Ordering::Acquire), family) {
            Sysctl::Off => Some(format!(
                "{sysctl} is 0 on this host: the kernel would drop the packets it forwards; set it to 1 (the daemon does not change it); the proxy serves this listener meanwhile"
            )),
            Sysctl::Unreadable => Some(format!(
                "{sysctl} cannot be read ({}), so the proxy serves this listener: {UNREADABLE_REMEDY}",
                crate::os::IP_FORWARDING_FILES[family]
            )),
            Sysctl::On => self.forward_chains.blocked(vip),
        }
    }
}

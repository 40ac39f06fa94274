//! Which DHCP offers a client may take: the judge between a server on the
//! segment and the host's routing.
//!
//! A DHCP server is whoever answers first on the segment, so what it offers
//! is judged before anything is written into the host: an address the host
//! already holds (on any interface, or inside a `local` route such as an
//! AnyIP range) would hand the host's own connections to a tenant; the
//! address of a gateway of any of the host's routes would cut the host off
//! from it; loopback, link-local, multicast, class E, `0.0.0.0/8` and the
//! broadcast address are no VIP; an address outside the operator's
//! `dhcp.allowed_ranges` is not the operator's; a subnet mask wider than
//! `dhcp.min_prefix_length` is a broken or hostile server. The leased
//! address is added without a prefix route (see [`super::link`]), so the
//! mask decides nothing but the subnet broadcast route the kernel adds for
//! it, which is judged too.
//!
//! [`judge`] is pure: [`HostView`] is read by the driver
//! ([`super::link::Macvlan::host_view`]) and passed in, so every rule is
//! unit-tested without root. What it must never do: take an offer while the
//! host cannot be read (that is refused as [`Refusal::HostUnreadable`]).

use std::net::Ipv4Addr;

use ipnet::Ipv4Net;

use crate::config::DhcpGuard;
use crate::metrics::stats::REFUSAL_REASONS;

/// Why an offer (or an ACK) was refused; the `reason` label of
/// `harvester_lb_dhcp_offers_refused_total` and `/status`'s `last_refusal`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// Loopback, link-local, multicast, class E, `0.0.0.0/8`, broadcast, or
    /// the network or broadcast address of the offered subnet.
    Reserved,
    /// A subnet mask wider than `min_prefix_length`.
    MaskTooWide,
    /// Outside every range of `allowed_ranges`.
    OutsideAllowedRanges,
    /// An address the host holds (on any interface but the client's own
    /// macvlan, or in a `local` route), or the offered subnet's broadcast
    /// address is one.
    HostAddress,
    /// The gateway of one of the host's routes (or the offered subnet's
    /// broadcast address is).
    Gateway,
    /// The host's addresses and routes could not be read; nothing is taken
    /// blind (the server is not held against it).
    HostUnreadable,
}

impl Refusal {
    /// Index into [`REFUSAL_REASONS`] (the metric's labels, in this order).
    pub fn index(self) -> usize {
        self as usize
    }

    /// The metric label.
    pub fn label(self) -> &'static str {
        REFUSAL_REASONS[self.index()]
    }

    /// Why, in words for the log and `/status`.
    pub fn explain(self, guard: &DhcpGuard) -> String {
        match self {
            Self::Reserved => "not a unicast address a VIP can have (loopback, link-local, multicast, class E, 0.0.0.0/8, broadcast, or its subnet's network or broadcast address)".into(),
            Self::MaskTooWide => format!(
                "subnet mask wider than /{} (dhcp.min_prefix_length)",
                guard.min_prefix_length
            ),
            Self::OutsideAllowedRanges => format!(
                "outside dhcp.allowed_ranges {:?}",
                guard
                    .allowed_ranges
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            ),
            Self::HostAddress => {
                "an address this host already holds (or its subnet's broadcast address is one)".into()
            }
            Self::Gateway => {
                "the gateway of one of this host's routes (or its subnet's broadcast address is one)".into()
            }
            Self::HostUnreadable => {
                "this host's addresses and routes could not be read to check it".into()
            }
        }
    }
}

/// What the host holds now, as far as an offer is concerned: read from the
/// kernel, leaving out the client's own macvlan interface (its lease is not
/// a conflict with itself).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct HostView {
    /// Addresses on interfaces and destinations of `local` routes (any
    /// table): a VIP inside one would be an address the host already
    /// answers for.
    pub local: Vec<Ipv4Net>,
    /// Gateways of routes (any table, multipath included).
    pub gateways: Vec<Ipv4Addr>,
}

impl HostView {
    /// The IPv4 part of `host`, without what is on interface `own` (the
    /// client's macvlan: its leased address is not the host's).
    pub fn of(host: &crate::host::vip_guard::HostNet, own: u32) -> Self {
        let mut view = HostView::default();
        for a in host.addresses.iter().filter(|a| a.index != own) {
            if let std::net::IpAddr::V4(v4) = a.ip {
                view.local.push(Ipv4Net::from(v4));
            }
        }
        for r in host.local_routes.iter().filter(|r| r.index != Some(own)) {
            if let ipnet::IpNet::V4(net) = r.net {
                view.local.push(net);
            }
        }
        for g in host.gateways.iter().filter(|g| g.index != Some(own)) {
            if let std::net::IpAddr::V4(v4) = g.ip {
                view.gateways.push(v4);
            }
        }
        view
    }

    fn holds(&self, a: Ipv4Addr) -> bool {
        self.local.iter().any(|n| n.contains(&a))
    }

    fn routes_via(&self, a: Ipv4Addr) -> bool {
        self.gateways.contains(&a)
    }
}

/// Whether `a` can never be a VIP handed out by a server: not a unicast
/// address of an ordinary network (0/8, loopback, link-local, multicast,
/// class E, the broadcast address).
pub fn reserved(a: Ipv4Addr) -> bool {
    a.octets()[0] == 0
        || a.is_loopback()
        || a.is_link_local()
        || a.is_multicast()
        || a.octets()[0] >= 240
        || a.is_broadcast()
}

/// Judges `address` with subnet prefix `prefix` (option 1; `None`: no mask
/// sent, taken as /32) against `guard` and what the host holds (`None`:
/// unreadable). `Ok` means the address may go on the macvlan interface.
pub fn judge(
    address: Ipv4Addr,
    prefix: Option<u8>,
    guard: &DhcpGuard,
    host: Option<&HostView>,
) -> Result<(), Refusal> {
    let prefix = prefix.unwrap_or(32).min(32);
    if reserved(address) {
        return Err(Refusal::Reserved);
    }
    // The kernel adds a `broadcast` route for the subnet's last address
    // (prefixes up to /30), even without a prefix route.
    let subnet = Ipv4Net::new(address, prefix).map_err(|_| Refusal::Reserved)?;
    let broadcast = (prefix < 31).then(|| subnet.broadcast());
    if prefix < 31 && (address == subnet.network() || Some(address) == broadcast) {
        return Err(Refusal::Reserved);
    }
    if prefix < guard.min_prefix_length {
        return Err(Refusal::MaskTooWide);
    }
    if !guard.allowed_ranges.is_empty()
        && !guard.allowed_ranges.iter().any(|r| r.contains(&address))
    {
        return Err(Refusal::OutsideAllowedRanges);
    }
    let host = host.ok_or(Refusal::HostUnreadable)?;
    let touched = std::iter::once(address).chain(broadcast);
    for a in touched {
        if host.holds(a) {
            return Err(Refusal::HostAddress);
        }
        if host.routes_via(a) {
            return Err(Refusal::Gateway);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> Ipv4Addr {
        s.parse().unwrap()
    }

    fn host() -> HostView {
        HostView {
            local: vec![
                "198.51.100.3/32".parse().unwrap(),
                "127.0.0.0/8".parse().unwrap(),
                // An AnyIP range: `ip route add local 203.0.113.0/28 dev lo`.
                "203.0.113.0/28".parse().unwrap(),
            ],
            gateways: vec![ip("198.51.100.1")],
        }
    }

    fn any() -> DhcpGuard {
        DhcpGuard::default()
    }

    #[test]
    fn a_good_offer_is_taken() {
        assert_eq!(
            judge(ip("198.51.100.150"), Some(24), &any(), Some(&host())),
            Ok(())
        );
        // No mask sent: a /32.
        assert_eq!(
            judge(ip("198.51.100.150"), None, &any(), Some(&host())),
            Ok(())
        );
        let ranges = DhcpGuard {
            allowed_ranges: vec!["198.51.100.128/25".parse().unwrap()],
            ..any()
        };
        assert_eq!(
            judge(ip("198.51.100.150"), Some(24), &ranges, Some(&host())),
            Ok(())
        );
    }

    #[test]
    fn a_wide_mask_is_refused_whatever_the_address() {
        for p in [0, 1, 8, 15] {
            assert_eq!(
                judge(ip("198.51.100.150"), Some(p), &any(), Some(&host())),
                Err(Refusal::MaskTooWide),
                "/{p}"
            );
        }
        assert_eq!(
            judge(ip("198.51.100.150"), Some(16), &any(), Some(&host())),
            Ok(())
        );
        let lax = DhcpGuard {
            min_prefix_length: 8,
            ..any()
        };
        assert_eq!(judge(ip("10.1.2.3"), Some(8), &lax, Some(&host())), Ok(()));
    }

    #[test]
    fn the_hosts_own_addresses_and_gateways_are_refused() {
        let h = host();
        assert_eq!(
            judge(ip("198.51.100.3"), Some(24), &any(), Some(&h)),
            Err(Refusal::HostAddress)
        );
        assert_eq!(
            judge(ip("203.0.113.7"), Some(24), &any(), Some(&h)),
            Err(Refusal::HostAddress),
            "inside a local route"
        );
        assert_eq!(
            judge(ip("198.51.100.1"), Some(24), &any(), Some(&h)),
            Err(Refusal::Gateway)
        );
        // A subnet whose broadcast address is the gateway's or the host's.
        let h2 = HostView {
            local: vec!["10.9.255.255/32".parse().unwrap()],
            gateways: vec![ip("10.8.255.255")],
        };
        assert_eq!(
            judge(ip("10.9.0.5"), Some(16), &any(), Some(&h2)),
            Err(Refusal::HostAddress)
        );
        assert_eq!(
            judge(ip("10.8.0.5"), Some(16), &any(), Some(&h2)),
            Err(Refusal::Gateway)
        );
        assert_eq!(judge(ip("10.8.0.5"), Some(24), &any(), Some(&h2)), Ok(()));
    }

    #[test]
    fn reserved_addresses_are_refused() {
        for a in [
            "0.0.0.0",
            "0.1.2.3",
            "127.0.0.1",
            "169.254.1.1",
            "224.0.0.1",
            "239.255.255.250",
            "240.0.0.1",
            "255.255.255.255",
            // The offered subnet's own network and broadcast addresses.
            "198.51.100.0",
            "198.51.100.255",
        ] {
            assert_eq!(
                judge(ip(a), Some(24), &any(), Some(&HostView::default())),
                Err(Refusal::Reserved),
                "{a}"
            );
        }
        // On a /31 both addresses are hosts (RFC 3021).
        assert_eq!(
            judge(ip("198.51.100.0"), Some(31), &any(), Some(&host())),
            Ok(())
        );
    }

    #[test]
    fn outside_the_allowed_ranges_is_refused() {
        let g = DhcpGuard {
            allowed_ranges: vec!["192.0.2.0/24".parse().unwrap()],
            ..any()
        };
        assert_eq!(
            judge(ip("198.51.100.150"), Some(24), &g, Some(&host())),
            Err(Refusal::OutsideAllowedRanges)
        );
        assert_eq!(judge(ip("192.0.2.9"), Some(24), &g, Some(&host())), Ok(()));
    }

    #[test]
    fn nothing_is_taken_blind() {
        assert_eq!(
            judge(ip("198.51.100.150"), Some(24), &any(), None),
            Err(Refusal::HostUnreadable)
        );
        // But what needs no host view is still refused for its own reason.
        assert_eq!(
            judge(ip("127.0.0.1"), Some(24), &any(), None),
            Err(Refusal::Reserved)
        );
    }

    #[test]
    fn every_reason_has_a_label_and_words() {
        for (i, r) in [
            Refusal::Reserved,
            Refusal::MaskTooWide,
            Refusal::OutsideAllowedRanges,
            Refusal::HostAddress,
            Refusal::Gateway,
            Refusal::HostUnreadable,
        ]
        .into_iter()
        .enumerate()
        {
            assert_eq!(r.index(), i);
            assert!(!r.explain(&any()).is_empty());
        }
    }

    #[test]
    fn the_host_is_seen_from_the_client_s_own_interface() {
        use crate::host::vip_guard::{Gateway, HostAddress, HostNet, LocalRoute};
        let addr = |ip: &str, index| HostAddress {
            ip: ip.parse().unwrap(),
            prefix_len: 24,
            interface: format!("if{index}"),
            index,
            tagged: false,
        };
        let host = HostNet {
            addresses: vec![
                addr("192.0.2.2", 2),
                addr("2001:db8::2", 2),
                addr("198.51.100.7", 9),
            ],
            gateways: vec![
                Gateway {
                    ip: "192.0.2.1".parse().unwrap(),
                    route: "default via 192.0.2.1 dev if2 table 254".into(),
                    index: Some(2),
                },
                Gateway {
                    ip: "198.51.100.1".parse().unwrap(),
                    route: "default via 198.51.100.1 dev if9 table 7".into(),
                    index: Some(9),
                },
            ],
            local_routes: vec![
                LocalRoute {
                    net: "10.9.0.0/24".parse().unwrap(),
                    index: Some(1),
                },
                LocalRoute {
                    net: "198.51.100.7/32".parse().unwrap(),
                    index: Some(9),
                },
            ],
            neighbours: Vec::new(),
        };
        // Interface 9 is the client's macvlan: its lease is not the host's.
        let view = HostView::of(&host, 9);
        assert_eq!(
            view.local,
            vec![
                "192.0.2.2/32".parse::<Ipv4Net>().unwrap(),
                "10.9.0.0/24".parse().unwrap()
            ]
        );
        assert_eq!(view.gateways, vec![ip("192.0.2.1")]);
        assert!(view.holds(ip("10.9.0.77")), "an AnyIP range is the host's");
    }
}

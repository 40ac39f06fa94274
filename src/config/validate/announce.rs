//! `vip.announce` and its keys: the daemon's half of anycast VIPs.
//!
//! What is refused, and why: a table the kernel reserves (0 is "unspecified",
//! 253-255 are `default`, `main` and `local`: a host route of a VIP in
//! `main` or `local` would change how this host itself routes); an interface
//! name the kernel would not take; and `ipam = "dhcp"` with announcing,
//! because a DHCP lease belongs to one MAC address on one segment, and
//! announcing that address from every host would pull the leasing server's
//! address to all of them (see docs/vip.md, "Many hosts").
//!
//! `announce_prefixes` is required with `routes`: a VIP comes from a guest
//! cluster's object, and announcing whatever it says would let a guest pull
//! the host's own address, its router's, or any prefix of the operator's
//! network to this host. So an entry is refused when it is shorter than
//! /8 (IPv4) or /16 (IPv6), or overlaps loopback, link-local, multicast,
//! "this network" or reserved space: no set of entries can then cover the
//! whole space (each would hold 127.0.0.1 or ::1). A VIP of the file outside them is a warning here
//! (one tenant's object must not stop the whole file): the daemon and
//! `import` refuse that load balancer alone.

use std::time::Duration;

use ipnet::IpNet;

use toml::Spanned;

use super::Validator;
use crate::config::file::{FileConfig, FileVip};
use crate::config::{
    AnnounceMode, AnnounceSettings, DEFAULT_ANNOUNCE_TABLE, DEFAULT_WITHDRAW_GRACE_SECONDS, Ipam,
    LoadBalancerSpec,
};

/// Longest delay or grace accepted: past an hour either is a typo.
const MAX_ANNOUNCE_SECONDS: i64 = 3600;
/// Most `announce_prefixes`: pools are few and short; more is a list that
/// should have been aggregated.
pub const MAX_ANNOUNCE_PREFIXES: usize = 256;
/// Shortest IPv4 `announce_prefixes` entry: a pool of more than 2^24
/// addresses is a typo or a way around the prefixes' purpose (with
/// `0.0.0.0/1` + `128.0.0.0/1` the `/0` refusal meant nothing).
pub const MIN_ANNOUNCE_PREFIX_V4: u8 = 8;
/// Shortest IPv6 `announce_prefixes` entry, as [`MIN_ANNOUNCE_PREFIX_V4`].
pub const MIN_ANNOUNCE_PREFIX_V6: u8 = 16;

/// Ranges no announced VIP can come from, with what they are: the host's
/// own (loopback, "this network"), the link's (link-local, where clouds
/// serve metadata), groups and reserved space. An `announce_prefixes`
/// entry overlapping one is refused; so, together with the length bounds,
/// no set of entries covers the whole address space (any such set holds
/// 127.0.0.1 or ::1).
const NOT_ANNOUNCED: &[(&str, &str)] = &[
    (
        "0.0.0.0/8",
        "\"this network\" (0.0.0.0 is the unspecified address)",
    ),
    ("127.0.0.0/8", "loopback, this host's own"),
    (
        "169.254.0.0/16",
        "link-local (169.254.169.254 serves cloud metadata)",
    ),
    ("224.0.0.0/4", "multicast"),
    (
        "240.0.0.0/4",
        "reserved (255.255.255.255 is the broadcast address)",
    ),
    ("::/128", "the unspecified address"),
    ("::1/128", "loopback, this host's own"),
    (
        "::ffff:0:0/96",
        "IPv4-mapped (announce the IPv4 range instead)",
    ),
    ("fe80::/10", "link-local"),
    ("ff00::/8", "multicast"),
];

/// Why `net` cannot be an `announce_prefixes` entry, or `None`.
fn announce_prefix_problem(net: IpNet) -> Option<String> {
    let min = match net {
        IpNet::V4(_) => MIN_ANNOUNCE_PREFIX_V4,
        IpNet::V6(_) => MIN_ANNOUNCE_PREFIX_V6,
    };
    if net.prefix_len() == 0 {
        return Some(
            "is every address: it would let any VIP (the host's own, its router's) be announced; list the ranges your VIPs come from".into(),
        );
    }
    if net.prefix_len() < min {
        return Some(format!(
            "is shorter than /{min}: a pool that wide takes in the host's own addresses and its router's (two such halves are the whole space); list the ranges your VIPs come from, each /{min} or longer"
        ));
    }
    NOT_ANNOUNCED.iter().find_map(|(range, what)| {
        let reserved: IpNet = range.parse().expect("static range");
        (reserved.contains(&net.network()) || net.contains(&reserved.network())).then(|| {
            format!(
                "overlaps {range}, {what}: no VIP announced to a router can come from there; list only the ranges your VIPs come from"
            )
        })
    })
}

impl Validator<'_> {
    /// `vip.announce`, `announce_interface`, `announce_table`,
    /// `announce_delay_seconds`, `withdraw_grace_seconds`.
    pub(super) fn announce(&mut self, file: &FileVip) -> AnnounceSettings {
        let mode = self.choice(
            &file.announce,
            format_args!("vip.announce"),
            &[
                ("none", AnnounceMode::None),
                ("routes", AnnounceMode::Routes),
            ],
            AnnounceMode::None,
        );
        let defaults = AnnounceSettings::default();
        let interface = file
            .announce_interface
            .as_ref()
            .and_then(|i| self.interface_name(i, format_args!("vip.announce_interface")))
            .unwrap_or(defaults.interface);
        let table = match &file.announce_table {
            None => defaults.table,
            Some(t) => {
                let n = *t.get_ref();
                match u32::try_from(n) {
                    Ok(n) if n != 0 && !(253..=255).contains(&n) => n,
                    _ => {
                        self.problem(
                            Some(t.span()),
                            "vip.announce_table",
                            format!(
                                "{n} cannot be the announcing table; use 1..=252 or 256..=4294967295 (0 is unspecified, 253 default, 254 main, 255 local), e.g. {DEFAULT_ANNOUNCE_TABLE}"
                            ),
                        );
                        defaults.table
                    }
                }
            }
        };
        let prefixes = self.announce_prefixes(file, mode);
        let delay = file.announce_delay_seconds.as_ref().map(|_| {
            let n = self.int(
                &file.announce_delay_seconds,
                format_args!("vip.announce_delay_seconds"),
                0,
                0,
                MAX_ANNOUNCE_SECONDS,
            );
            Duration::from_secs(n as u64)
        });
        let grace = self.int(
            &file.withdraw_grace_seconds,
            format_args!("vip.withdraw_grace_seconds"),
            DEFAULT_WITHDRAW_GRACE_SECONDS as i64,
            0,
            MAX_ANNOUNCE_SECONDS,
        );
        // The interface and table are read by `withdraw --all` whatever
        // the mode (routes left by a run with "routes" are still found).
        if mode == AnnounceMode::None
            && let Some(d) = &file.announce_delay_seconds
        {
            self.warning(
                Some(d.span()),
                "vip.announce_delay_seconds",
                "has no effect without vip.announce = \"routes\"".into(),
            );
        }
        AnnounceSettings {
            mode,
            interface,
            table,
            prefixes,
            delay,
            withdraw_grace: Duration::from_secs(grace as u64),
        }
    }

    /// `vip.announce_prefixes`: CIDRs without host bits, at least one with
    /// `routes`, at most [`MAX_ANNOUNCE_PREFIXES`].
    fn announce_prefixes(&mut self, file: &FileVip, mode: AnnounceMode) -> Vec<IpNet> {
        let Some(list) = &file.announce_prefixes else {
            if mode == AnnounceMode::Routes {
                self.problem(
                    file.announce.as_ref().map(Spanned::span),
                    "vip.announce_prefixes",
                    ("is required with vip.announce = \"routes\": list the CIDR ranges your VIPs come from, e.g. announce_prefixes = [\"203.0.113.0/24\"] (like MetalLB's address pools); only VIPs inside them are announced, so a guest cluster's Service cannot make this host announce its own or its router's address").into(),
                );
            }
            return Vec::new();
        };
        let values = list.get_ref();
        if values.len() > MAX_ANNOUNCE_PREFIXES {
            self.problem(
                Some(values[MAX_ANNOUNCE_PREFIXES].span()),
                "vip.announce_prefixes",
                format!(
                    "{} ranges; at most {MAX_ANNOUNCE_PREFIXES} are allowed (aggregate neighbouring ranges into shorter prefixes)",
                    values.len()
                ),
            );
        }
        let mut nets = Vec::with_capacity(values.len());
        for (j, v) in values.iter().enumerate() {
            if let Some(net) = self.cidr(v, format_args!("vip.announce_prefixes[{j}]")) {
                if let Some(why) = announce_prefix_problem(net) {
                    self.problem(
                        Some(v.span()),
                        &format!("vip.announce_prefixes[{j}]"),
                        format!("{:?} {why}", v.get_ref()),
                    );
                    continue;
                }
                nets.push(net);
            }
        }
        if mode == AnnounceMode::Routes && values.is_empty() {
            self.problem(
                Some(list.span()),
                "vip.announce_prefixes",
                "is empty, so no VIP could be announced; list the CIDR ranges your VIPs come from, e.g. [\"203.0.113.0/24\"]".into(),
            );
        }
        if mode == AnnounceMode::None {
            self.warning(
                Some(list.span()),
                "vip.announce_prefixes",
                "has no effect without vip.announce = \"routes\"".into(),
            );
        }
        nets
    }

    /// Load balancers whose VIP cannot be announced: `ipam = "dhcp"` ones
    /// (an error), and VIPs outside `announce_prefixes` (a warning: the
    /// daemon refuses that load balancer alone).
    pub(super) fn announce_conflicts(
        &mut self,
        announce: &AnnounceSettings,
        file: &FileConfig,
        specs: &[Option<LoadBalancerSpec>],
    ) {
        if !announce.enabled() {
            return;
        }
        for (i, (lb, spec)) in file.load_balancers.iter().zip(specs).enumerate() {
            if let Some(s) = spec
                && s.ipam != Ipam::Dhcp
                && !s.vip.is_unspecified()
                && !s.vip.to_canonical().is_loopback()
                && !announce.prefixes.is_empty()
                && !announce.allows(s.vip)
            {
                self.warning(
                    lb.get_ref().vip.as_ref().map(Spanned::span),
                    &format!("load_balancer[{i}].vip"),
                    format!(
                        "{} is outside vip.announce_prefixes ({}): the daemon refuses this load balancer (it is not served, not announced); add its range to vip.announce_prefixes or give it a VIP inside them",
                        s.vip,
                        announce.prefixes_text()
                    ),
                );
            }
            if spec.as_ref().is_some_and(|s| s.ipam == Ipam::Dhcp) {
                self.problem(
                    lb.get_ref().ipam.as_ref().map(Spanned::span),
                    &format!("load_balancer[{i}].ipam"),
                    "ipam = \"dhcp\" cannot be used with vip.announce = \"routes\": a leased address belongs to one host's MAC on one segment, and announcing it from every host would steal the leasing server's address; give the load balancer a pool VIP, or set vip.announce = \"none\"".into(),
                );
            }
        }
    }
}

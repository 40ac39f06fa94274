//! `ipam = "dhcp"`: the `[load_balancer.dhcp]` table and the process-wide
//! `[dhcp]` table.
//!
//! The client's identity (MAC address, hostname) is settled here, once: a
//! derived MAC depends only on the load balancer's name and cluster, so
//! every start of every version of the daemon asks the DHCP server for the
//! same lease.

use std::net::{IpAddr, Ipv4Addr};
use std::ops::Range;
use std::path::PathBuf;

use std::fmt;

use ipnet::{IpNet, Ipv4Net};
use toml::Spanned;

use super::{DEFAULT_CLUSTER, Validator};
use crate::config::file::{FileDhcp, FileDhcpSettings, FileLoadBalancer};
use crate::config::{DEFAULT_DHCP_MIN_PREFIX_LENGTH, DhcpGuard, DhcpSettings, DhcpSpec, Ipam};

/// Where lease state files go when neither `[dhcp] state_directory` nor
/// systemd's `$STATE_DIRECTORY` says otherwise.
pub const DEFAULT_STATE_DIRECTORY: &str = "/var/lib/harvester-lb";
/// Longest interface name the kernel takes (`IFNAMSIZ` less its NUL).
const MAX_IFNAME_BYTES: usize = 15;
/// Longest hostname option accepted: one DNS label.
const MAX_HOSTNAME_BYTES: usize = 63;

impl Validator<'_> {
    /// A host interface's name as the kernel takes it: 1..=15 bytes, no
    /// `/`, `:`, space or control character, not `.` or `..`.
    pub(super) fn interface_name(
        &mut self,
        value: &Spanned<String>,
        key: fmt::Arguments<'_>,
    ) -> Option<String> {
        let name = value.get_ref();
        let bad = name.is_empty()
            || name.len() > MAX_IFNAME_BYTES
            || name == "."
            || name == ".."
            || name
                .chars()
                .any(|c| c == '/' || c == ':' || c.is_whitespace() || c.is_control());
        if bad {
            self.problem(
                Some(value.span()),
                &key.to_string(),
                format!(
                    "{name:?} is not an interface name (1..={MAX_IFNAME_BYTES} bytes, no '/', ':' or spaces)"
                ),
            );
            None
        } else {
            Some(name.clone())
        }
    }

    /// `[dhcp]`.
    pub(super) fn dhcp_settings(&mut self, file: &FileDhcpSettings) -> DhcpSettings {
        let state_directory = match &file.state_directory {
            Some(s) => {
                if !s.get_ref().starts_with('/') || s.get_ref().contains('\0') {
                    self.problem(
                        Some(s.span()),
                        "dhcp.state_directory",
                        format!(
                            "{:?} is not an absolute directory path; write e.g. \"/var/lib/harvester-lb\"",
                            s.get_ref()
                        ),
                    );
                }
                PathBuf::from(s.get_ref())
            }
            None => std::env::var_os("STATE_DIRECTORY")
                // systemd passes a colon-separated list; the first is ours.
                .and_then(|v| {
                    v.to_str()
                        .and_then(|v| v.split(':').next())
                        .filter(|v| v.starts_with('/'))
                        .map(PathBuf::from)
                })
                .unwrap_or_else(|| PathBuf::from(DEFAULT_STATE_DIRECTORY)),
        };
        let guard = DhcpGuard {
            allowed_ranges: file
                .allowed_ranges
                .as_ref()
                .map(|r| self.allowed_ranges(r, "dhcp"))
                .unwrap_or_default(),
            min_prefix_length: self.min_prefix_length(&file.min_prefix_length, "dhcp"),
        };
        DhcpSettings {
            state_directory,
            guard,
        }
    }

    /// `<table>.allowed_ranges`: IPv4 CIDRs without host bits, at least one
    /// (an empty list would refuse every offer: leave the key out instead).
    fn allowed_ranges(
        &mut self,
        list: &Spanned<Vec<Spanned<String>>>,
        table: &str,
    ) -> Vec<Ipv4Net> {
        let key = format!("{table}.allowed_ranges");
        if list.get_ref().is_empty() {
            self.problem(
                Some(list.span()),
                &key,
                "is empty, which would refuse every DHCP offer; name the ranges leased VIPs may come from, e.g. [\"192.0.2.0/24\"], or leave the key out to take any address the other checks allow".into(),
            );
        }
        let mut out = Vec::new();
        for (i, v) in list.get_ref().iter().enumerate() {
            match self.cidr(v, format_args!("{key}[{i}]")) {
                Some(IpNet::V4(n)) => out.push(n),
                Some(IpNet::V6(_)) => self.problem(
                    Some(v.span()),
                    &format!("{key}[{i}]"),
                    format!(
                        "{:?} is an IPv6 range; DHCPv4 leases IPv4 addresses only, so write an IPv4 range, e.g. \"192.0.2.0/24\"",
                        v.get_ref()
                    ),
                ),
                None => {}
            }
        }
        out
    }

    /// `<table>.min_prefix_length`: 0..=32, default
    /// [`DEFAULT_DHCP_MIN_PREFIX_LENGTH`].
    fn min_prefix_length(&mut self, value: &Option<Spanned<i64>>, table: &str) -> u8 {
        let n = self.int(
            value,
            format_args!("{table}.min_prefix_length"),
            i64::from(DEFAULT_DHCP_MIN_PREFIX_LENGTH),
            0,
            32,
        );
        u8::try_from(n).unwrap_or(DEFAULT_DHCP_MIN_PREFIX_LENGTH)
    }

    /// `[load_balancer.dhcp]` of load balancer `key`; `None` when there is
    /// none (a table without `ipam = "dhcp"` is reported) or it is unusable.
    pub(super) fn dhcp(
        &mut self,
        key: &str,
        lb: &FileLoadBalancer,
        ipam: Ipam,
    ) -> Option<DhcpSpec> {
        let table = match (&lb.dhcp, ipam) {
            (None, Ipam::Pool) => return None,
            (Some(t), Ipam::Pool) => {
                self.problem(
                    Some(t.span()),
                    &format!("{key}.dhcp"),
                    "is only used with ipam = \"dhcp\"; remove it or set ipam = \"dhcp\"".into(),
                );
                return None;
            }
            // Leased elsewhere: `vip` is checked as a pool VIP.
            (None, Ipam::Dhcp) => return None,
            (Some(t), Ipam::Dhcp) => t,
        };
        let span = table.span();
        let d: &FileDhcp = table.get_ref();
        let dkey = format!("{key}.dhcp");
        let requested = self.requested(key, lb);
        let interface = self.interface(&dkey, span.clone(), d, lb.network.is_some());
        let identity = format!(
            "{}/{}",
            lb.cluster
                .as_ref()
                .map_or(DEFAULT_CLUSTER, |c| c.get_ref().as_str()),
            lb.name.as_ref().map_or("", |n| n.get_ref().as_str())
        );
        let mac = self.mac(&dkey, d, &identity);
        let hostname = match &d.hostname {
            None => derived_hostname(&identity),
            Some(h) => {
                let name = h.get_ref();
                let ok = !name.is_empty()
                    && name.len() <= MAX_HOSTNAME_BYTES
                    && name.chars().all(|c| c.is_ascii_alphanumeric() || c == '-')
                    && !name.starts_with('-')
                    && !name.ends_with('-');
                if !ok {
                    self.problem(
                        Some(h.span()),
                        &format!("{dkey}.hostname"),
                        format!(
                            "{name:?} is not a host name: 1..={MAX_HOSTNAME_BYTES} letters, digits and '-', not starting or ending with '-'"
                        ),
                    );
                }
                name.clone()
            }
        };
        let mut servers = Vec::new();
        for (i, s) in d.servers.iter().enumerate() {
            match s.get_ref().parse::<Ipv4Addr>() {
                Ok(ip) if !ip.is_unspecified() && !ip.is_multicast() && !ip.is_broadcast() => {
                    servers.push(ip)
                }
                _ => self.problem(
                    Some(s.span()),
                    &format!("{dkey}.servers[{i}]"),
                    format!(
                        "{:?} is not a unicast IPv4 address (a DHCP server's identifier)",
                        s.get_ref()
                    ),
                ),
            }
        }
        let allowed_ranges = d
            .allowed_ranges
            .as_ref()
            .map(|r| self.allowed_ranges(r, &dkey));
        let min_prefix_length = d
            .min_prefix_length
            .is_some()
            .then(|| self.min_prefix_length(&d.min_prefix_length, &dkey));
        Some(DhcpSpec {
            interface: interface?,
            mac: mac?,
            hostname,
            servers,
            requested,
            allowed_ranges,
            min_prefix_length,
        })
    }

    /// `vip` of a leased VIP: the IPv4 address to ask for, if any.
    fn requested(&mut self, key: &str, lb: &FileLoadBalancer) -> Option<Ipv4Addr> {
        match &lb.vip {
            None => None,
            Some(v) => match v.get_ref().parse::<IpAddr>().map(|ip| ip.to_canonical()) {
                Ok(IpAddr::V4(ip)) if ip.is_unspecified() => None,
                Ok(IpAddr::V4(ip)) if !ip.is_multicast() && !ip.is_broadcast() => Some(ip),
                _ => {
                    self.problem(
                    Some(v.span()),
                    &format!("{key}.vip"),
                    format!(
                        "{:?} cannot be asked for over DHCPv4; with ipam = \"dhcp\" leave vip out, write \"0.0.0.0\", or give the unicast IPv4 address to ask for",
                        v.get_ref()
                    ),
                );
                    None
                }
            },
        }
    }

    /// `interface`: a name the kernel could have given an interface. On a
    /// `[[network]]` (`network` set) it may be left out: the lease's
    /// macvlan is then made on the network's interface, filled in by
    /// `network_conflicts` once the networks are known.
    fn interface(
        &mut self,
        dkey: &str,
        span: Range<usize>,
        d: &FileDhcp,
        on_network: bool,
    ) -> Option<String> {
        match &d.interface {
            None if on_network => Some(String::new()),
            None => {
                self.missing(
                    span,
                    dkey,
                    "interface",
                    "the host interface the VIP is leased on, e.g. \"eth0\"",
                );
                None
            }
            Some(i) => self.interface_name(i, format_args!("{dkey}.interface")),
        }
    }

    /// `mac`: a unicast MAC address, derived from `identity` when absent.
    fn mac(&mut self, dkey: &str, d: &FileDhcp, identity: &str) -> Option<[u8; 6]> {
        match &d.mac {
            None => Some(derived_mac(identity)),
            Some(m) => {
                let parsed = parse_mac(m.get_ref());
                match parsed {
                    Some(mac) if mac[0] & 1 == 0 && mac != [0; 6] => Some(mac),
                    Some(_) => {
                        self.problem(
                        Some(m.span()),
                        &format!("{dkey}.mac"),
                        format!(
                            "{:?} is a multicast or all-zero address; a client needs a unicast MAC (the low bit of the first byte clear), e.g. \"02:00:00:00:00:01\"",
                            m.get_ref()
                        ),
                    );
                        None
                    }
                    None => {
                        self.problem(
                        Some(m.span()),
                        &format!("{dkey}.mac"),
                        format!(
                            "{:?} is not a MAC address; write six hex bytes separated by ':', e.g. \"02:00:00:00:00:01\"",
                            m.get_ref()
                        ),
                    );
                        None
                    }
                }
            }
        }
    }
}

/// `aa:bb:cc:dd:ee:ff` (or with `-`), case-insensitive.
fn parse_mac(text: &str) -> Option<[u8; 6]> {
    let mut mac = [0u8; 6];
    let mut parts = text.split([':', '-']);
    for byte in &mut mac {
        let p = parts.next()?;
        if p.len() != 2 {
            return None;
        }
        *byte = u8::from_str_radix(p, 16).ok()?;
    }
    parts.next().is_none().then_some(mac)
}

/// FNV-1a, 64 bits: fixed by its definition, unlike `std`'s hashers, so a
/// derived MAC is the same in every build of the daemon.
fn fnv1a(text: &str) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in text.bytes() {
        h ^= u64::from(b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// A locally administered unicast MAC from `<cluster>/<name>`.
pub fn derived_mac(identity: &str) -> [u8; 6] {
    let h = fnv1a(identity).to_be_bytes();
    // 0x02 set: locally administered; 0x01 clear: unicast.
    [(h[0] & 0xfc) | 0x02, h[1], h[2], h[3], h[4], h[5]]
}

/// `<cluster>-<namespace>-<service>` as one DNS label: other characters
/// become `-`, and a long name is cut and given a hash suffix so that two
/// long names stay distinct.
fn derived_hostname(identity: &str) -> String {
    let mut s: String = identity
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_lowercase()
            } else {
                '-'
            }
        })
        .collect();
    if s.len() > MAX_HOSTNAME_BYTES {
        let suffix = format!("-{:08x}", fnv1a(identity) as u32);
        s.truncate(MAX_HOSTNAME_BYTES - suffix.len());
        s.push_str(&suffix);
    }
    let s = s.trim_matches('-').to_string();
    if s.is_empty() {
        "harvester-lb".into()
    } else {
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn derived_mac_is_stable_unicast_and_local() {
        let a = derived_mac("kubernetes/default/web");
        assert_eq!(a, derived_mac("kubernetes/default/web"));
        assert_ne!(a, derived_mac("kubernetes/default/web2"));
        assert_eq!(a[0] & 0x03, 0x02, "{a:02x?}");
        // Pinned: a change here changes every operator's lease.
        assert_eq!(fnv1a("a"), 0xaf63_dc4c_8601_ec8c);
    }

    #[test]
    fn macs_parse_strictly() {
        assert_eq!(
            parse_mac("02:AB:cd:00:00:01"),
            Some([2, 0xab, 0xcd, 0, 0, 1])
        );
        for bad in [
            "",
            "02:ab",
            "02:ab:cd:00:00:01:02",
            "2:ab:cd:0:0:1",
            "zz:00:00:00:00:00",
        ] {
            assert_eq!(parse_mac(bad), None, "{bad}");
        }
    }

    #[test]
    fn hostnames_are_one_label() {
        assert_eq!(
            derived_hostname("kubernetes/default/web"),
            "kubernetes-default-web"
        );
        let long = derived_hostname(&format!("c/ns/{}", "x".repeat(100)));
        assert!(long.len() <= MAX_HOSTNAME_BYTES, "{long}");
        assert_ne!(
            long,
            derived_hostname(&format!("c/ns/{}y", "x".repeat(100)))
        );
    }
}

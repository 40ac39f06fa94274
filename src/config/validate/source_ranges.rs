//! `source_ranges` (`loadBalancerSourceRanges`): CIDRs without host bits,
//! bounded in number, kept sorted and merged for the accept path.

use std::fmt;
use std::net::IpAddr;
use std::ops::Range;

use ipnet::{IpNet, Ipv4Net};
use toml::Spanned;

use super::Validator;
use crate::config::{MAX_SOURCE_RANGES, SourceRanges};

impl Validator<'_> {
    /// `source_ranges`: every entry a CIDR without host bits, at most
    /// [`MAX_SOURCE_RANGES`]. A list with no range of the VIP's family
    /// refuses every client: allowed (it may be on purpose), with a warning.
    pub(super) fn source_ranges(
        &mut self,
        key: &str,
        table_span: Range<usize>,
        values: &[Spanned<String>],
        vip: Option<IpAddr>,
    ) -> SourceRanges {
        if values.len() > MAX_SOURCE_RANGES {
            self.problem(
                Some(values[MAX_SOURCE_RANGES].span()),
                &format!("{key}.source_ranges"),
                format!(
                    "{} ranges; at most {MAX_SOURCE_RANGES} are allowed per load balancer (aggregate neighbouring ranges into shorter prefixes)",
                    values.len()
                ),
            );
        }
        let mut nets = Vec::with_capacity(values.len());
        for (j, v) in values.iter().enumerate() {
            if let Some(net) = self.cidr(v, format_args!("{key}.source_ranges[{j}]")) {
                nets.push(net);
            }
        }
        let ranges = SourceRanges::new(nets);
        if let Some(vip) = vip
            && !ranges.has_family_of(vip)
        {
            let family = if vip.is_ipv4() { "IPv4" } else { "IPv6" };
            self.warning(
                Some(values.first().map_or(table_span, |v| v.span())),
                &format!("{key}.source_ranges"),
                format!(
                    "no {family} range for the {family} VIP {vip}: every client will be refused"
                ),
            );
        }
        ranges
    }

    /// One CIDR range, `ADDRESS/PREFIX`, the address with no host bits set.
    /// An IPv4-mapped IPv6 range (`::ffff:10.0.0.0/104`) is the IPv4 range it
    /// covers: clients are judged by their IPv4 form.
    pub(super) fn cidr(
        &mut self,
        value: &Spanned<String>,
        key: fmt::Arguments<'_>,
    ) -> Option<IpNet> {
        let text = value.get_ref();
        let fail = |v: &mut Self, why: String| {
            v.problem(
                Some(value.span()),
                &key.to_string(),
                format!("{text:?} {why}"),
            );
            None
        };
        let Some((addr, len)) = text.split_once('/') else {
            return fail(
                self,
                "is not a CIDR range; write ADDRESS/PREFIX, e.g. \"203.0.113.0/24\" or \"2001:db8::/32\" (one address is ADDRESS/32 or ADDRESS/128)".into(),
            );
        };
        let Ok(ip) = addr.parse::<IpAddr>() else {
            return fail(
                self,
                format!("is not a CIDR range: {addr:?} is not an IPv4 or IPv6 address"),
            );
        };
        let (family, max) = if ip.is_ipv4() {
            ("IPv4", 32)
        } else {
            ("IPv6", 128)
        };
        let prefix = Some(len)
            .filter(|l| !l.is_empty() && l.bytes().all(|b| b.is_ascii_digit()))
            .and_then(|l| l.parse::<u8>().ok())
            .filter(|&l| l <= max);
        let Some(prefix) = prefix else {
            return fail(
                self,
                format!(
                    "has prefix length {len:?}; an {family} prefix length must be in 0..={max}"
                ),
            );
        };
        let net = IpNet::new(ip, prefix).ok()?;
        if net.trunc() != net {
            return fail(
                self,
                format!(
                    "has host bits set; did you mean \"{}\"? (a range is written with its first address)",
                    net.trunc()
                ),
            );
        }
        if let IpNet::V6(v6) = net
            && v6.prefix_len() >= 96
            && let Some(v4) = v6.network().to_ipv4_mapped()
        {
            return Ipv4Net::new(v4, v6.prefix_len() - 96).ok().map(IpNet::V4);
        }
        Some(net)
    }
}

//! `source_ranges`: the clients a load balancer serves (Kubernetes'
//! `loadBalancerSourceRanges`).
//!
//! kube-proxy does not enforce them for traffic that reaches a nodeport
//! through an external load balancer, so if the load balancer does not,
//! nobody does. The check runs on every accepted connection, so the ranges
//! are kept as sorted, merged, non-overlapping intervals per address family
//! and a lookup is one binary search: 1,000 ranges cost about ten
//! comparisons, and the set is shared (`Arc`) by every snapshot that holds it.
//!
//! Pure data: built by validation, read by the forwarder, never changed.

use std::net::IpAddr;
use std::sync::Arc;

use ipnet::IpNet;

/// Most ranges one load balancer may list: more is almost certainly a
/// generated list that should have been aggregated, and the validation and
/// `/status` cost grows with it.
pub const MAX_SOURCE_RANGES: usize = 1000;

/// The clients a load balancer serves: everyone, or those inside the ranges.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SourceRanges(Option<Arc<Intervals>>);

/// The ranges as written (normalised) and as intervals for lookups.
#[derive(Debug, PartialEq, Eq)]
struct Intervals {
    /// In file order, IPv4-mapped IPv6 ranges written as IPv4 (`/status`).
    written: Box<[IpNet]>,
    /// IPv4 intervals `[first, last]`, sorted, merged, non-overlapping.
    v4: Box<[(u32, u32)]>,
    /// IPv6 intervals, likewise.
    v6: Box<[(u128, u128)]>,
}

impl SourceRanges {
    /// No restriction: every client is served (no `source_ranges`, or `[]`).
    pub fn everyone() -> Self {
        Self(None)
    }

    /// Only clients inside `nets` are served; an empty list means everyone,
    /// as in Kubernetes.
    pub fn new(nets: Vec<IpNet>) -> Self {
        if nets.is_empty() {
            return Self::everyone();
        }
        let mut v4 = Vec::new();
        let mut v6 = Vec::new();
        for net in &nets {
            match net {
                IpNet::V4(n) => v4.push((u32::from(n.network()), u32::from(n.broadcast()))),
                IpNet::V6(n) => v6.push((u128::from(n.network()), u128::from(n.broadcast()))),
            }
        }
        Self(Some(Arc::new(Intervals {
            written: nets.into(),
            v4: merge(v4).into(),
            v6: merge(v6).into(),
        })))
    }

    /// Whether `client` may connect. An IPv4-mapped IPv6 address (a
    /// dual-stack socket seeing an IPv4 client) is served when an IPv4
    /// range holds the IPv4 address it is, or an IPv6 range holds its
    /// mapped form (`::/0` covers every address a dual-stack socket can
    /// see, as with HAProxy's `src` ACL). A plain IPv4 client is judged by
    /// the IPv4 ranges alone, as Kubernetes judges each family by its own.
    #[inline]
    pub fn allows(&self, client: IpAddr) -> bool {
        let Some(r) = &self.0 else { return true };
        match client {
            IpAddr::V4(a) => contains(&r.v4, u32::from(a)),
            IpAddr::V6(a) => match a.to_ipv4_mapped() {
                Some(v4) => contains(&r.v4, u32::from(v4)) || contains(&r.v6, u128::from(a)),
                None => contains(&r.v6, u128::from(a)),
            },
        }
    }

    /// Whether every client is served.
    pub fn is_everyone(&self) -> bool {
        self.0.is_none()
    }

    /// The ranges as configured (normalised); empty for everyone.
    pub fn ranges(&self) -> &[IpNet] {
        self.0.as_ref().map_or(&[], |r| &r.written)
    }

    /// Whether any range is of `ip`'s family (a load balancer whose VIP's
    /// family has no range refuses every client).
    pub fn has_family_of(&self, ip: IpAddr) -> bool {
        match &self.0 {
            None => true,
            Some(r) if ip.is_ipv4() => !r.v4.is_empty(),
            Some(r) => !r.v6.is_empty(),
        }
    }
}

/// An address as an integer, for merging intervals of either family.
trait Bound: Copy + Ord {
    /// The next address, `None` past the last one.
    fn next(self) -> Option<Self>;
}

impl Bound for u32 {
    fn next(self) -> Option<Self> {
        self.checked_add(1)
    }
}

impl Bound for u128 {
    fn next(self) -> Option<Self> {
        self.checked_add(1)
    }
}

/// Sorts intervals and joins those that overlap or touch.
fn merge<T: Bound>(mut v: Vec<(T, T)>) -> Vec<(T, T)> {
    v.sort_unstable();
    let mut out: Vec<(T, T)> = Vec::with_capacity(v.len());
    for (first, last) in v {
        match out.last_mut() {
            Some(prev) if first <= prev.1 || prev.1.next() == Some(first) => {
                prev.1 = prev.1.max(last);
            }
            _ => out.push((first, last)),
        }
    }
    out
}

/// Whether `x` lies in one of the sorted, non-overlapping `intervals`.
#[inline]
fn contains<T: Copy + Ord>(intervals: &[(T, T)], x: T) -> bool {
    let i = intervals.partition_point(|&(first, _)| first <= x);
    i > 0 && intervals[i - 1].1 >= x
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ranges(list: &[&str]) -> SourceRanges {
        SourceRanges::new(list.iter().map(|s| s.parse().unwrap()).collect())
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    #[test]
    fn empty_means_everyone() {
        let r = ranges(&[]);
        assert!(r.is_everyone());
        assert!(r.allows(ip("203.0.113.9")) && r.allows(ip("2001:db8::1")));
    }

    #[test]
    fn inside_and_outside_each_family() {
        let r = ranges(&["10.0.0.0/8", "192.0.2.128/25", "2001:db8::/32"]);
        for inside in [
            "10.0.0.0",
            "10.255.255.255",
            "192.0.2.128",
            "192.0.2.255",
            "2001:db8::1",
            "2001:db8:ffff::",
        ] {
            assert!(r.allows(ip(inside)), "{inside}");
        }
        for outside in [
            "9.255.255.255",
            "11.0.0.0",
            "192.0.2.127",
            "193.0.0.0",
            "2001:db9::",
            "::1",
            "0.0.0.0",
            "255.255.255.255",
        ] {
            assert!(!r.allows(ip(outside)), "{outside}");
        }
    }

    #[test]
    fn ipv4_mapped_clients_match_ipv4_ranges() {
        let r = ranges(&["127.0.18.0/24"]);
        assert!(r.allows(ip("::ffff:127.0.18.2")));
        assert!(!r.allows(ip("::ffff:127.0.19.2")));
    }

    #[test]
    fn overlapping_and_touching_ranges_merge() {
        let r = ranges(&[
            "10.0.1.0/24",
            "10.0.0.0/24",
            "10.0.0.0/16",
            "10.1.0.0/16",
            "0.0.0.0/32",
            "255.255.255.255/32",
        ]);
        let i = r.0.as_ref().unwrap();
        assert_eq!(
            i.v4.as_ref(),
            &[(0, 0), (0x0a00_0000, 0x0a01_ffff), (u32::MAX, u32::MAX)]
        );
        assert_eq!(r.ranges().len(), 6, "the written list is kept for /status");
        let all = ranges(&["0.0.0.0/0", "::/0"]);
        assert!(all.allows(ip("255.255.255.255")) && all.allows(ip("ffff::")));
    }

    #[test]
    fn a_mapped_client_is_served_by_its_ipv4_range_or_an_ipv6_range_holding_its_mapped_form() {
        let mapped = ip("::ffff:192.0.2.7");
        assert!(
            ranges(&["::/0"]).allows(mapped),
            "::/0 holds every mapped address"
        );
        assert!(ranges(&["192.0.2.0/24"]).allows(mapped));
        assert!(!ranges(&["198.51.100.0/24", "2001:db8::/32"]).allows(mapped));
        // A plain IPv4 client is judged by IPv4 ranges only.
        assert!(!ranges(&["::/0"]).allows(ip("192.0.2.7")));
    }

    #[test]
    fn a_thousand_ranges_agree_with_a_linear_scan() {
        let nets: Vec<IpNet> = (0..1000u32)
            .map(|i| {
                let base = i.wrapping_mul(2_654_435_761);
                let len = 16 + (i % 17) as u8;
                IpNet::new(IpAddr::from(base.to_be_bytes()), len)
                    .unwrap()
                    .trunc()
            })
            .collect();
        let r = SourceRanges::new(nets.clone());
        let mut x = 12345u32;
        for _ in 0..100_000 {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            let a = IpAddr::from(x.to_be_bytes());
            assert_eq!(r.allows(a), nets.iter().any(|n| n.contains(&a)), "{a}");
        }
        for n in &nets {
            assert!(r.allows(n.network()) && r.allows(n.broadcast()));
        }
    }
}

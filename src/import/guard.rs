//! What a guest cluster's objects must not do to the host that imports
//! them, and what one import must not do to the config it replaces.
//!
//! Objects are untrusted: a guest cluster's admin writes its `Service`s'
//! status and its `Node`s' addresses. An address that is this host itself
//! (loopback, link-local with the cloud metadata service, `0.0.0.0/8`) as
//! a backend would forward a VIP to the host's own services (etcd, the
//! kubelet, the admin API); as a VIP it would bind them. Such an object is
//! skipped, named. Loopback can be let through for tests and a demo on one
//! machine (`--allow-loopback`); the rest never.
//!
//! The removal guard compares the new load balancers with the file being
//! replaced: a controller bug (an empty list, a filter that matches too
//! little) must not become an outage of every tenant.

use std::collections::BTreeSet;
use std::net::IpAddr;
use std::path::Path;

use super::model::Lb;

/// Why `ip` cannot come from an object as a VIP or a backend; `None` when
/// it can. `allow_loopback` lets 127.0.0.0/8 and `::1` through.
pub fn host_address(ip: IpAddr, allow_loopback: bool) -> Option<&'static str> {
    let ip = ip.to_canonical();
    if ip.is_loopback() {
        return (!allow_loopback).then_some(
            "a loopback address: this host itself, where etcd, the kubelet and the admin API listen",
        );
    }
    if ip.is_unspecified() {
        return Some("the unspecified address: every address of this host");
    }
    if ip.is_multicast() {
        return Some("a multicast address, not one node");
    }
    match ip {
        IpAddr::V4(v4) => {
            let [a, b, ..] = v4.octets();
            if a == 0 {
                Some("in 0.0.0.0/8, which means this host")
            } else if a == 169 && b == 254 {
                Some(
                    "link-local (169.254.0.0/16, where the cloud metadata service answers with this host's credentials)",
                )
            } else if a >= 240 {
                Some("in 240.0.0.0/4 (class E and the broadcast address), which no node has")
            } else {
                None
            }
        }
        IpAddr::V6(v6) => {
            if v6.segments()[0] & 0xffc0 == 0xfe80 {
                Some("link-local (fe80::/10): an address of this host's own link, not a node's")
            } else {
                None
            }
        }
    }
}

/// Why `lb`'s VIP or a backend cannot be imported, naming the address.
pub fn lb_addresses(lb: &Lb, allow_loopback: bool) -> Option<String> {
    if let Some(why) = host_address(lb.vip, allow_loopback) {
        return Some(format!("VIP {} is {why}; not imported", lb.vip));
    }
    backend_addresses(lb, allow_loopback)
}

/// Why a backend of `lb` cannot be imported, naming the address (for a
/// VIP the daemon will lease, still `0.0.0.0`, only the backends are
/// judged).
pub fn backend_addresses(lb: &Lb, allow_loopback: bool) -> Option<String> {
    lb.backends.iter().find_map(|&b| {
        host_address(b, allow_loopback).map(|why| format!("backend {b} is {why}; not imported"))
    })
}

/// Why replacing a file holding `old` load balancers with one holding
/// `new` needs `--allow-removals`: the new one is empty while the old one
/// was not, or more than half of the old ones are gone.
pub fn removals(old: &BTreeSet<String>, new: &BTreeSet<String>) -> Option<String> {
    if old.is_empty() {
        return None;
    }
    let gone: Vec<&String> = old.difference(new).collect();
    let shown = |names: &[&String]| {
        let mut s: Vec<String> = names.iter().take(5).map(|n| format!("{n:?}")).collect();
        if names.len() > 5 {
            s.push(format!("and {} more", names.len() - 5));
        }
        s.join(", ")
    };
    if new.is_empty() {
        Some(format!(
            "the new config has no load balancer and would remove all {} of the current file ({}): every VIP would stop answering",
            old.len(),
            shown(&gone)
        ))
    } else if gone.len() * 2 > old.len() {
        Some(format!(
            "the new config would remove {} of the current file's {} load balancers, more than half ({})",
            gone.len(),
            old.len(),
            shown(&gone)
        ))
    } else {
        None
    }
}

/// The names of the load balancers of the config file at `path`, if it is
/// a regular file of at most the config's size limit holding TOML; `None`
/// otherwise (nothing to compare with, so nothing to guard).
pub fn existing_names(path: &Path) -> Option<BTreeSet<String>> {
    let text = super::write::existing(path)?;
    let table: toml::Table = text.parse().ok()?;
    let names = match table.get("load_balancer") {
        None => BTreeSet::new(),
        Some(toml::Value::Array(lbs)) => lbs
            .iter()
            .filter_map(|lb| lb.get("name")?.as_str().map(str::to_string))
            .collect(),
        Some(_) => return None,
    };
    Some(names)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_of_this_host_are_refused_and_nodes_are_not() {
        for refused in [
            "127.0.0.1",
            "127.1.2.3",
            "::1",
            "::ffff:127.0.0.1",
            "0.0.0.0",
            "0.1.2.3",
            "::",
            "169.254.169.254",
            "169.254.0.1",
            "fe80::1",
            "febf::1",
            "224.0.0.1",
            "ff02::1",
            "240.0.0.1",
            "255.255.255.255",
        ] {
            let ip: IpAddr = refused.parse().unwrap();
            assert!(host_address(ip, false).is_some(), "{refused} passed");
        }
        for node in [
            "10.0.0.1",
            "192.168.1.2",
            "172.16.0.9",
            "2001:db8::1",
            "fd00::1",
            "fec0::1",
            "100.64.0.1",
        ] {
            assert_eq!(host_address(node.parse().unwrap(), false), None, "{node}");
        }
        assert_eq!(host_address("127.0.0.1".parse().unwrap(), true), None);
        assert!(host_address("169.254.169.254".parse().unwrap(), true).is_some());
    }

    #[test]
    fn removing_all_or_more_than_half_is_refused() {
        let set = |n: &[&str]| n.iter().map(|s| s.to_string()).collect::<BTreeSet<_>>();
        assert!(removals(&set(&[]), &set(&[])).is_none());
        assert!(removals(&set(&["a"]), &set(&[])).is_some());
        assert!(
            removals(&set(&["a", "b"]), &set(&["a"])).is_none(),
            "exactly half"
        );
        assert!(removals(&set(&["a", "b", "c"]), &set(&["a"])).is_some());
        assert!(removals(&set(&["a", "b", "c"]), &set(&["a", "b", "x", "y"])).is_none());
        assert!(removals(&set(&["a"]), &set(&["b"])).is_some());
    }
}

//! `[[network]] isolate`: what the VM-network guard (`host::vmnet::vmnet_filter`)
//! cannot do, refused with its line; what it does not do, warned.
//!
//! Refused: an isolated network on `keepalived.interface` (the guard
//! would drop every new connection to this host from the management
//! network, VRRP and SSH included, but the VIPs' listener ports); two
//! networks on one interface, one isolated and one not (the guard matches
//! by interface, so one of them would not get what it says); an isolated
//! network whose interface name nft cannot carry in a quoted string.
//! Warned: `isolate = false`, which leaves this host a router for that
//! network's VMs.

use std::collections::BTreeMap;

use toml::Spanned;

use super::Validator;
use crate::config::KeepalivedSettings;
use crate::config::NetworkSpec;
use crate::config::file::FileConfig;

impl Validator<'_> {
    /// Each `[[network]]`'s `isolate` against the other networks and
    /// `[keepalived]`.
    pub(super) fn network_isolation(
        &mut self,
        file: &FileConfig,
        networks: &[NetworkSpec],
        keepalived: Option<&KeepalivedSettings>,
    ) {
        // Which isolate each interface was first given, by which network.
        let mut by_interface: BTreeMap<&str, (&str, bool)> = BTreeMap::new();
        for (i, n) in file.networks.iter().enumerate() {
            let file_net = n.get_ref();
            let Some(name) = file_net.name.as_ref().map(|s| s.get_ref()) else {
                continue;
            };
            let Some(net) = networks.iter().find(|x| &x.name == name) else {
                continue;
            };
            let key = format!("network[{i}]");
            let isolate_span = file_net.isolate.as_ref().map(Spanned::span);
            let interface_span = file_net.interface.as_ref().map(Spanned::span);
            if let Some((other, isolated)) = by_interface.get(net.interface.as_str()) {
                if *isolated != net.isolate {
                    self.problem(
                        isolate_span.clone().or(interface_span.clone()),
                        &format!("{key}.isolate"),
                        format!(
                            "is {}, but network {other:?} on the same interface {:?} has isolate = {isolated}; the guard works per interface, so give both networks the same isolate",
                            net.isolate, net.interface
                        ),
                    );
                }
            } else {
                by_interface.insert(&net.interface, (&net.name, net.isolate));
            }
            if !net.isolate {
                self.warning(
                    isolate_span,
                    &format!("{key}.isolate"),
                    format!(
                        "is false: with ip_forward on, this host routes for the VMs of network {:?} (interface {:?}) into every other network it has, the management network included, and its own services answer them; leave isolate out (true) unless this host is that network's router",
                        net.name, net.interface
                    ),
                );
                continue;
            }
            if let Some(k) = keepalived.filter(|k| k.interface == net.interface) {
                self.problem(
                    interface_span.or(isolate_span),
                    &format!("{key}.interface"),
                    format!(
                        "{:?} is keepalived.interface, the management network: isolating it would drop every new connection to this host from there (VRRP to its peers, SSH, the Kubernetes API) but the VIPs' listener ports; a VM network on the management bridge needs isolate = false, or give the network its own interface",
                        k.interface
                    ),
                );
                continue;
            }
            if net.interface.contains(['"', '\\', '*']) {
                self.problem(
                    interface_span.or(isolate_span),
                    &format!("{key}.interface"),
                    format!(
                        "{:?} cannot be matched by the guard's nftables rules (no '\"', '\\\\' or '*' in an isolated network's interface); rename the interface or set isolate = false",
                        net.interface
                    ),
                );
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::parse;
    use crate::config::test_fixtures::{lb, networks};

    /// Two networks, a load balancer on each, `[keepalived]` on "mgmt-br".
    fn file(a: &str, b: &str) -> String {
        networks(a, b)
            + &lb("default/a", "10.100.0.50", "default/a", &["10.100.0.21"])
            + &lb("default/b", "10.200.0.50", "default/b", &["10.200.0.21"])
    }

    #[test]
    fn networks_are_isolated_by_default_and_turning_it_off_is_explained() {
        let loaded =
            parse(&file("", "interface = \"cluster-br.200\"\n")).expect("valid with the defaults");
        assert!(loaded.config.networks.iter().all(|n| n.isolate));
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);

        let loaded = parse(&file(
            "isolate = false\n",
            "interface = \"cluster-br.200\"\n",
        ))
        .expect("valid");
        assert!(!loaded.config.networks[0].isolate);
        assert!(loaded.config.networks[1].isolate);
        let w = &loaded.warnings;
        assert_eq!(w.len(), 1, "{w:?}");
        assert_eq!(
            (w[0].key.as_str(), w[0].line),
            ("network[0].isolate", Some(12))
        );
        assert!(
            w[0].message
                .contains("routes for the VMs of network \"default/a\"")
                && w[0].message.contains("management network"),
            "{}",
            w[0].message
        );
    }

    #[test]
    fn isolating_the_management_interface_or_half_an_interface_is_refused() {
        let p = parse(&file("", "interface = \"mgmt-br\"\n")).expect_err("refused");
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(
            (p[0].key.as_str(), p[0].line),
            ("network[1].interface", Some(17))
        );
        assert!(
            p[0].message.contains("\"mgmt-br\" is keepalived.interface")
                && p[0].message.contains("isolate = false"),
            "{}",
            p[0].message
        );
        // The management bridge as a VM network, not isolated: valid, warned.
        let loaded = parse(&file("", "interface = \"mgmt-br\"\nisolate = false\n")).expect("valid");
        assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);

        let p = parse(&file(
            "",
            "interface = \"cluster-br.100\"\nisolate = false\n",
        ))
        .expect_err("refused");
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(
            (p[0].key.as_str(), p[0].line),
            ("network[1].isolate", Some(18))
        );
        assert!(
            p[0].message.contains(
                "network \"default/a\" on the same interface \"cluster-br.100\" has isolate = true"
            ),
            "{}",
            p[0].message
        );

        let p = parse(&file("", "interface = \"br\\\"x\"\n")).expect_err("refused");
        assert!(
            // Refused before the guard's own check: keepalived.conf could
            // not carry it either.
            p.iter()
                .any(|p| p.key == "network[1].interface"
                    && p.message.contains("holds '\"' at byte 2")),
            "{p:?}"
        );
    }
}

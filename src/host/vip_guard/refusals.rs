//! The VIP guard at every apply: a load balancer whose VIP is one of the
//! host's own addresses, the gateway of one of its routes, the network or
//! broadcast address of one of its subnets, or (with announcing) a
//! neighbour of the host (its router, a BGP peer) or outside
//! `vip.announce_prefixes` is refused alone, before
//! the isolation table, the listeners or the announcer see it. The other
//! load balancers are applied as usual.
//!
//! The decision is [`crate::host::vip_guard::judge`]; this module reads the host
//! (over rtnetlink, at start and at every reload, not on a timer), takes
//! the refused load balancers out of the config put in force, and keeps
//! them for `/status` (`vip_refused`), the log (one error per refusal
//! that is new) and the `vip_refused` gauge. A host whose addresses cannot
//! be read (read twice) is logged and the config applied unchecked, except
//! with announcing: then a VIP that passed the last check that could read
//! the host keeps its place, and any other is refused (`unchecked`), so
//! nothing is announced that was never checked and a failed read at a
//! reload does not take every tenant down.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use serde::Serialize;

use std::sync::{Arc, Mutex, MutexGuard};

use super::{HostNet, judge};
use crate::config::Config;
use crate::metrics::Metrics;

/// What the VIP guard's checks found, kept between applies: the refusals
/// to show in `/status` and to log only when new, and the VIPs that passed
/// the last check that could read the host, so that with announcing a
/// failed read at a reload keeps those VIPs and refuses only new ones.
#[derive(Debug, Default)]
struct VipCheckResults {
    /// The refusals of the last apply (`/status`).
    refusals: Vec<VipRefusal>,
    /// The VIPs that passed the last check that read the host.
    passed: BTreeSet<IpAddr>,
}

/// One load balancer the guard refused, in `/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct VipRefusal {
    /// The load balancer.
    pub load_balancer: String,
    /// Its VIP.
    pub vip: IpAddr,
    /// `host_address`, `gateway`, `subnet_address`, `neighbour`,
    /// `outside_announce_prefixes`, `unchecked` (the host could not be read while announcing) or
    /// `no_network_interface` (its `[[network]]`'s interface is missing).
    pub kind: &'static str,
    /// What the host uses the address for, in words.
    pub reason: String,
}

/// The VIP guard's component: the results kept between applies, the
/// refusals shown in `/status` and counted in `vip_refused`.
pub struct VipGuard {
    /// Where the refusals are counted.
    metrics: Arc<Metrics>,
    results: Mutex<VipCheckResults>,
}

impl VipGuard {
    /// Nothing checked yet; counts in `metrics`.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            results: Mutex::default(),
        }
    }

    /// `config` without the load balancers the VIP guard refuses, which are
    /// remembered for `/status` and logged.
    pub async fn guard(&self, mut config: Config) -> Config {
        let checked = config
            .load_balancers
            .iter()
            .any(|lb| lb.dhcp.is_none() && !lb.vip.is_unspecified());
        if !checked {
            self.set_vip_refusals(Vec::new());
            return config;
        }
        let mut host = read_host().await;
        if host.is_err() {
            host = read_host().await;
        }
        // The daemon puts no VIP on an interface (announced VIPs are
        // local through AnyIP routes): only keepalived's are not the host's.
        let mut ours = BTreeSet::new();
        if let Ok(h) = &host {
            ours.extend(keepalived_held(&config, h));
        }
        let passed = self.check_results().passed.clone();
        let host_read = host.as_ref().map_err(|e| e as &dyn std::fmt::Display);
        let mut refusals = refusals(&config, host_read, &ours, &passed);
        refusals.extend(missing_network_interfaces(&config).await);
        if host.is_ok() {
            self.check_results().passed = config
                .load_balancers
                .iter()
                .map(|lb| lb.vip)
                .filter(|vip| !refusals.iter().any(|r| r.vip == *vip))
                .collect();
        }
        if let Err(e) = &host {
            tracing::error!(
                "vip guard: cannot read this host's addresses and routes: {e}; VIPs are not checked against them{}",
                if config.vip.announce.enabled() {
                    " and, with vip.announce = \"routes\", a VIP that did not pass the last check is refused"
                } else {
                    ""
                }
            );
        }
        let refused: BTreeSet<&str> = refusals.iter().map(|r| r.load_balancer.as_str()).collect();
        config
            .load_balancers
            .retain(|lb| !refused.contains(lb.name.as_str()));
        self.set_vip_refusals(refusals);
        config
    }

    /// The results kept between applies (a poisoned lock is taken as it
    /// is: each field is only ever replaced whole).
    fn check_results(&self) -> MutexGuard<'_, VipCheckResults> {
        self.results.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Keeps `now` for `/status` and the gauge; logs each one that is new.
    fn set_vip_refusals(&self, now: Vec<VipRefusal>) {
        let mut results = self.check_results();
        for r in now.iter().filter(|r| !results.refusals.contains(r)) {
            tracing::error!(
                load_balancer = &*r.load_balancer,
                vip = %r.vip,
                kind = r.kind,
                "load balancer refused: its VIP {} is {}; it is not served, isolated or announced (the others are), until a reload with another VIP",
                r.vip,
                r.reason
            );
        }
        self.metrics.set_vip_refused(now.len());
        results.refusals = now;
    }

    /// The load balancers refused at the last apply (`/status`).
    pub fn refusals(&self) -> Vec<VipRefusal> {
        self.check_results().refusals.clone()
    }
}

/// The VIPs keepalived moves that the host holds where keepalived puts
/// them: keepalived put them there (the daemon never does), so they are
/// VIPs, not the host's own addresses. A `[[network]]` load balancer's on
/// its network's interface; a management VIP's
/// ([`Config::keepalived_interface`]) on `keepalived.interface` as the
/// host route keepalived adds (`/32`, `/128`) only: the management
/// interface carries the host's own addresses, and one of those (at its
/// subnet's prefix) given as a VIP is still refused as the host's.
fn keepalived_held(config: &Config, host: &HostNet) -> Vec<IpAddr> {
    config
        .load_balancers
        .iter()
        .filter_map(|lb| {
            let interface = config.keepalived_interface(lb)?;
            let management = lb.network.is_none();
            let host_prefix = if lb.vip.is_ipv4() { 32 } else { 128 };
            host.addresses
                .iter()
                .any(|a| {
                    a.ip == lb.vip
                        && a.interface == interface
                        && (!management || a.prefix_len == host_prefix)
                })
                .then_some(lb.vip)
        })
        .collect()
}

/// Load balancers on a `[[network]]` whose `interface` this host does not
/// have: `check` cannot know (it runs anywhere), so the daemon refuses
/// them here, at start and at every reload, each alone.
async fn missing_network_interfaces(config: &Config) -> Vec<VipRefusal> {
    let used: BTreeSet<&str> = config
        .load_balancers
        .iter()
        .filter_map(|lb| lb.network.as_deref())
        .collect();
    if used.is_empty() {
        return Vec::new();
    }
    let Ok(writer) = crate::host::announce::routes::RouteWriter::connect() else {
        return Vec::new(); // The host guard above has said it cannot read.
    };
    let mut missing = BTreeMap::new();
    for net in config
        .networks
        .iter()
        .filter(|n| used.contains(n.name.as_str()))
    {
        if let Err(e @ crate::host::announce::routes::AnnounceError::NoInterface(_)) =
            writer.interface_index(&net.interface).await
        {
            missing.insert(net.name.as_str(), (net.interface.as_str(), e));
        }
    }
    config
        .load_balancers
        .iter()
        .filter_map(|lb| {
            let (interface, _) = missing.get(lb.network.as_deref()?)?;
            Some(VipRefusal {
                load_balancer: lb.name.clone(),
                vip: lb.vip,
                kind: "no_network_interface",
                reason: format!(
                    "on network {:?}, whose interface {interface:?} does not exist on this host: {} could not put the VIP there; create it (the VM network's bridge, or its VLAN device) or correct network.interface",
                    lb.network.as_deref().unwrap_or_default(),
                    if lb.dhcp.is_some() { "the lease's macvlan" } else { "keepalived" }
                ),
            })
        })
        .collect()
}

/// This host's addresses and routes, over a netlink socket of its own.
async fn read_host() -> Result<HostNet, crate::host::announce::routes::AnnounceError> {
    let writer = crate::host::announce::routes::RouteWriter::connect()?;
    HostNet::read(writer.handle()).await
}

/// The refusals of `config`'s load balancers on a host `host` (or the
/// reason it could not be read), the daemon's own addresses being `ours`
/// and `passed` the VIPs the last check that read the host let through.
fn refusals(
    config: &Config,
    host: Result<&HostNet, &dyn std::fmt::Display>,
    ours: &BTreeSet<IpAddr>,
    passed: &BTreeSet<IpAddr>,
) -> Vec<VipRefusal> {
    let announce = &config.vip.announce;
    config
        .load_balancers
        .iter()
        .filter(|lb| lb.dhcp.is_none() && !lb.vip.is_unspecified())
        .filter_map(|lb| {
            let (kind, reason) = match host {
                Ok(h) => {
                    let r = judge(lb.vip, h, ours, announce)?;
                    (r.kind(), r.to_string())
                }
                Err(ref e)
                    if announce.enabled()
                        && !lb.vip.to_canonical().is_loopback()
                        && !passed.contains(&lb.vip) =>
                {
                    (
                        "unchecked",
                        format!(
                            "not checked against this host's addresses and routes ({e}): nothing unchecked is announced"
                        ),
                    )
                }
                Err(_) => return None,
            };
            Some(VipRefusal {
                load_balancer: lb.name.clone(),
                vip: lb.vip,
                kind,
                reason,
            })
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{KEEPALIVED, VLAN100, config, lb};
    use crate::host::vip_guard::{Gateway, HostAddress};

    fn host() -> HostNet {
        HostNet {
            addresses: vec![HostAddress {
                ip: "192.0.2.2".parse().unwrap(),
                prefix_len: 24,
                interface: "eth0".into(),
                index: 2,
                tagged: false,
            }],
            gateways: vec![Gateway {
                ip: "192.0.2.1".parse().unwrap(),
                route: "default via 192.0.2.1 dev eth0 table 254".into(),
                index: Some(2),
            }],
            local_routes: Vec::new(),
            neighbours: Vec::new(),
        }
    }

    const LBS: &str = "[[load_balancer]]\nname = \"a/own\"\nvip = \"192.0.2.2\"\nbackends = [\"198.51.100.1\"]\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = 80\n  backend_port = 30080\n[[load_balancer]]\nname = \"b/router\"\nvip = \"192.0.2.1\"\nbackends = [\"198.51.100.1\"]\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = 80\n  backend_port = 30080\n[[load_balancer]]\nname = \"c/fine\"\nvip = \"203.0.113.5\"\nbackends = [\"198.51.100.1\"]\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = 80\n  backend_port = 30080\n[[load_balancer]]\nname = \"d/outside\"\nvip = \"198.51.100.77\"\nbackends = [\"198.51.100.1\"]\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = 80\n  backend_port = 30080\n[[load_balancer]]\nname = \"e/loop\"\nvip = \"127.0.9.1\"\nbackends = [\"127.0.0.2\"]\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = 80\n  backend_port = 30080\n";

    fn kinds(r: &[VipRefusal]) -> Vec<(&str, &str)> {
        r.iter()
            .map(|r| (r.load_balancer.as_str(), r.kind))
            .collect()
    }

    #[test]
    fn each_refused_load_balancer_is_named_alone_with_what_the_host_uses_it_for() {
        let plain = config(LBS);
        let r = refusals(&plain, Ok(&host()), &BTreeSet::new(), &BTreeSet::new());
        assert_eq!(
            kinds(&r),
            [("a/own", "host_address"), ("b/router", "gateway")]
        );
        assert!(r[0].reason.contains("interface eth0"), "{}", r[0].reason);
        assert!(
            r[1].reason.contains("default via 192.0.2.1"),
            "{}",
            r[1].reason
        );
        let announcing = config(&format!(
            "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"203.0.113.0/24\", \"192.0.2.0/24\"]\n{LBS}"
        ));
        let r = refusals(&announcing, Ok(&host()), &BTreeSet::new(), &BTreeSet::new());
        assert_eq!(
            kinds(&r),
            [
                ("a/own", "host_address"),
                ("b/router", "gateway"),
                ("d/outside", "outside_announce_prefixes")
            ]
        );
    }

    #[test]
    fn an_unreadable_host_refuses_only_what_would_be_announced_and_never_passed() {
        let none = BTreeSet::new();
        let plain = config(LBS);
        assert!(refusals(&plain, Err(&"no netlink"), &none, &none).is_empty());
        let announcing = config(&format!(
            "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"192.0.2.0/24\", \"198.51.100.0/24\", \"203.0.113.0/24\"]\n{LBS}"
        ));
        let r = refusals(&announcing, Err(&"no netlink"), &none, &none);
        assert_eq!(r.len(), 4, "every VIP but the loopback one: {r:?}");
        assert!(r.iter().all(|r| r.kind == "unchecked"));
        // A failed read at a reload keeps what passed the last check.
        let passed: BTreeSet<IpAddr> = ["203.0.113.5".parse().unwrap()].into();
        let r = refusals(&announcing, Err(&"ENOBUFS"), &none, &passed);
        assert_eq!(r.len(), 3, "{r:?}");
        assert!(r.iter().all(|r| r.vip != passed.first().copied().unwrap()));
    }

    #[test]
    fn a_network_vip_keepalived_put_on_its_interface_is_held_not_the_host_s_own() {
        let c = config(&format!(
            "{KEEPALIVED}{VLAN100}{}",
            lb("default/a", "10.100.0.50", "vlan100", &[])
        ));
        let mut h = host();
        h.addresses.push(HostAddress {
            ip: "10.100.0.50".parse().unwrap(),
            prefix_len: 32,
            interface: "br.100".into(),
            index: 9,
            tagged: false,
        });
        // Alone on an interface with no subnet address, the /32 would be
        // taken for the host's own address.
        let none = BTreeSet::new();
        assert_eq!(refusals(&c, Ok(&h), &none, &none).len(), 1);
        let ours: BTreeSet<IpAddr> = keepalived_held(&c, &h).into_iter().collect();
        assert!(refusals(&c, Ok(&h), &ours, &none).is_empty());
        // On another interface it is not keepalived's.
        h.addresses.last_mut().unwrap().interface = "eth0".into();
        assert!(keepalived_held(&c, &h).is_empty());
    }

    /// A management-network host: 192.168.0.11/24 on "mgmt0" (keepalived's
    /// interface), its default route through 192.168.0.1, and `vip` on
    /// mgmt0 at `prefix_len` if given.
    fn management_host(vip: Option<(&str, u8)>) -> HostNet {
        let mut h = HostNet {
            addresses: vec![HostAddress {
                ip: "192.168.0.11".parse().unwrap(),
                prefix_len: 24,
                interface: "mgmt0".into(),
                index: 3,
                tagged: false,
            }],
            gateways: vec![Gateway {
                ip: "192.168.0.1".parse().unwrap(),
                route: "default via 192.168.0.1 dev mgmt0 table 254".into(),
                index: Some(3),
            }],
            local_routes: Vec::new(),
            neighbours: Vec::new(),
        };
        if let Some((ip, prefix_len)) = vip {
            h.addresses.push(HostAddress {
                ip: ip.parse().unwrap(),
                prefix_len,
                interface: "mgmt0".into(),
                index: 3,
                tagged: false,
            });
        }
        h
    }

    /// A load balancer on no network (a management VIP) on `vip`.
    fn management_lb(name: &str, vip: &str) -> String {
        format!(
            "[[load_balancer]]\nname = {name:?}\nvip = {vip:?}\nbackends = [\"10.100.0.21\"]\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = 80\n  backend_port = 30080\n"
        )
    }

    #[test]
    fn a_management_vip_keepalived_holds_is_a_vip_and_the_host_s_own_address_or_gateway_is_not() {
        let none = BTreeSet::new();
        let c = config(&format!(
            "{KEEPALIVED}{}{}{}",
            management_lb("default/web", "192.168.0.50"),
            management_lb("default/gw", "192.168.0.1"),
            management_lb("default/other", "192.168.0.13"),
        ));
        // keepalived added 192.168.0.50/32 on mgmt0: held, not refused.
        let h = management_host(Some(("192.168.0.50", 32)));
        let ours: BTreeSet<IpAddr> = keepalived_held(&c, &h).into_iter().collect();
        assert_eq!(ours, ["192.168.0.50".parse().unwrap()].into());
        // The default route's gateway is refused whatever holds it.
        assert_eq!(
            kinds(&refusals(&c, Ok(&h), &ours, &none)),
            [("default/gw", "gateway")]
        );
        // The host's own address (at its subnet's prefix, not the /32
        // keepalived adds) is not keepalived's: refused as the host's.
        let h = management_host(Some(("192.168.0.13", 24)));
        let ours: BTreeSet<IpAddr> = keepalived_held(&c, &h).into_iter().collect();
        assert!(ours.is_empty(), "{ours:?}");
        assert_eq!(
            kinds(&refusals(&c, Ok(&h), &ours, &none)),
            [("default/gw", "gateway"), ("default/other", "host_address")]
        );
        // keepalived.management_vips = false: not keepalived's, held by
        // another tool; judged as any VIP (a /32 beside the subnet's
        // address is plainly a VIP).
        let off = config(&format!(
            "{KEEPALIVED}management_vips = false\n{}",
            management_lb("default/web", "192.168.0.50"),
        ));
        let h = management_host(Some(("192.168.0.50", 32)));
        assert!(keepalived_held(&off, &h).is_empty());
        assert!(refusals(&off, Ok(&h), &none, &none).is_empty());
    }
}

//! VIPs that are a machine the file names: never a VIP (issue 40). The
//! daemon's guard refuses what the host holds (its addresses, its routes'
//! gateways, its subnets' edges, its neighbours: `host::vip_guard::judge`); what
//! `check` can know from the file alone is refused here, so that the host
//! that would lose it never sees the file run:
//!
//! - `keepalived.address` and `keepalived.peers`: this host and its VRRP
//!   peers on the management network;
//! - `conntrackd.address` and `conntrackd.peer`: the two hosts of the sync
//!   link (in the anycast mode, the other anycast host: announced, the VIP
//!   would be made local and the sync would talk to itself);
//! - a `[[network]]`'s gateway, and its subnet's network and broadcast
//!   address, for a load balancer on no network (those on one are checked
//!   against it by `vmnet`).
//!
//! The BGP peer of the shipped BIRD and FRR configs is not in this file
//! (it is a site value of those files): the daemon's guard refuses it as
//! the neighbour it is.

use std::net::IpAddr;

use toml::Spanned;

use super::Validator;
use crate::config::file::FileConfig;
use crate::config::{Config, ConntrackdSettings, LoadBalancerSpec};

impl Validator<'_> {
    /// Each load balancer whose VIP is a machine named elsewhere in the file.
    pub(super) fn vips_that_are_hosts(
        &mut self,
        file: &FileConfig,
        config: &Config,
        conntrackd: Option<&ConntrackdSettings>,
        specs: &[Option<LoadBalancerSpec>],
    ) {
        let mut machines: Vec<(IpAddr, String)> = Vec::new();
        if let Some(k) = &config.keepalived {
            machines.push((
                k.address,
                "keepalived.address, this host's management address".into(),
            ));
            for p in &k.peers {
                machines.push((*p, "one of keepalived.peers, a VRRP peer host".into()));
            }
        }
        if let Some(c) = conntrackd {
            machines.push((
                c.address.into(),
                "conntrackd.address, this host's address on the sync link".into(),
            ));
            if let crate::config::SyncTransport::Unicast { peer } = c.transport {
                machines.push((
                    peer.into(),
                    "conntrackd.peer, the other host of the sync link".into(),
                ));
            }
        }
        for n in &config.networks {
            let subnet = n.subnet();
            let name = &n.name;
            machines.push((
                n.gateway.into(),
                format!("network {name:?}'s gateway, the router of its VMs"),
            ));
            if subnet.prefix_len() <= 30 {
                machines.push((
                    subnet.network().into(),
                    format!("the network address of network {name:?}'s subnet {subnet}"),
                ));
                machines.push((
                    subnet.broadcast().into(),
                    format!("the broadcast address of network {name:?}'s subnet {subnet}"),
                ));
            }
        }
        if machines.is_empty() {
            return;
        }
        for (i, (lb, spec)) in file.load_balancers.iter().zip(specs).enumerate() {
            let Some(spec) = spec else { continue };
            // On a network: checked against it by `vmnet`; leased: no
            // address yet.
            if lb.get_ref().network.is_some() || spec.dhcp.is_some() {
                continue;
            }
            let vip = spec.vip.to_canonical();
            if let Some((_, what)) = machines.iter().find(|(m, _)| *m == vip) {
                self.problem(
                    lb.get_ref().vip.as_ref().map(Spanned::span),
                    &format!("load_balancer[{i}].vip"),
                    format!(
                        "{vip} is {what}: a machine, not a VIP; taken (and announced) the host would answer for it to itself and lose it; give another VIP"
                    ),
                );
            }
        }
    }
}

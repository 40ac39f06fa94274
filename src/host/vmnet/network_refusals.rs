//! The `[[network]]` interfaces at every apply: a network whose interface
//! this host shows is no VM network's (not a bridge, a VLAN device, a bond
//! or a veth; the loopback; or, isolated, the interface of the management
//! address or of the host's own routes: [`crate::host::vmnet::network_link::judge`])
//! is taken out of the config put in force with its load balancers, before
//! the VM-network guard, the routes, keepalived's file or the listeners see
//! them. The other networks and load balancers are applied as usual.
//!
//! `check` and import refuse such names where a name shows it (`lo`); what
//! only the host shows is judged here, at start and at every reload (not on
//! a timer: links do not change kind), from one rtnetlink read. The
//! refusals are kept for `/status` (`network_refused`) and logged at error
//! once each while they last. A host that cannot be read is logged and the
//! networks applied unchecked (as the VIP guard does).

use std::collections::BTreeSet;
use std::sync::Mutex;

use serde::Serialize;

use super::network_link::{HostLinks, judge};
use crate::config::Config;

/// One `[[network]]` refused, in `/status`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct NetworkRefusal {
    /// The network.
    pub network: String,
    /// Its interface.
    pub interface: String,
    /// `not_a_vm_network_link`, `management_interface` or `host_routes`.
    pub kind: &'static str,
    /// What the host has there, in words.
    pub reason: String,
    /// Its load balancers, refused with it (not served, isolated,
    /// routed or put in keepalived's file).
    pub load_balancers: Vec<String>,
}

/// The `[[network]]` interfaces' guard: the refusals of the last apply,
/// kept for `/status` and logged once each while they last.
#[derive(Debug, Default)]
pub struct NetworkGuard {
    refusals: Mutex<Vec<NetworkRefusal>>,
}

impl NetworkGuard {
    /// `config` without the networks whose interface cannot be a VM
    /// network's here, nor their load balancers (those on the network, and
    /// those leased on its interface); the refusals are remembered for
    /// `/status` and logged.
    pub async fn guard(&self, mut config: Config) -> Config {
        if config.networks.is_empty() {
            self.set_network_refusals(Vec::new());
            return config;
        }
        let host = match crate::host::announce::routes::RouteWriter::connect() {
            Ok(w) => HostLinks::read(w.handle()).await,
            Err(e) => Err(e),
        };
        let host = match host {
            Ok(h) => h,
            Err(e) => {
                tracing::error!(
                    "VM networks: cannot read this host's interfaces and routes: {e}; the networks' interfaces are not checked"
                );
                return config;
            }
        };
        let management = config.keepalived.as_ref().map(|k| k.address);
        let own_tables: BTreeSet<u32> = config.networks.iter().map(|n| n.table).collect();
        let mut refusals = Vec::new();
        for net in &config.networks {
            let Some(r) = judge(net, &host, management, &own_tables) else {
                continue;
            };
            let load_balancers = config
                .load_balancers
                .iter()
                .filter(|lb| {
                    lb.network.as_deref() == Some(net.name.as_str())
                        || lb
                            .dhcp
                            .as_ref()
                            .is_some_and(|d| d.interface == net.interface)
                })
                .map(|lb| lb.name.clone())
                .collect();
            refusals.push(NetworkRefusal {
                network: net.name.clone(),
                interface: net.interface.clone(),
                kind: r.kind,
                reason: r.reason,
                load_balancers,
            });
        }
        let networks: BTreeSet<&str> = refusals.iter().map(|r| r.network.as_str()).collect();
        let lbs: BTreeSet<&str> = refusals
            .iter()
            .flat_map(|r| r.load_balancers.iter().map(String::as_str))
            .collect();
        config
            .networks
            .retain(|n| !networks.contains(n.name.as_str()));
        config
            .load_balancers
            .retain(|lb| !lbs.contains(lb.name.as_str()));
        self.set_network_refusals(refusals);
        config
    }

    /// Keeps `now` for `/status`; logs each one that is new.
    fn set_network_refusals(&self, now: Vec<NetworkRefusal>) {
        let mut kept = self.refusals.lock().unwrap_or_else(|p| p.into_inner());
        for r in now.iter().filter(|r| !kept.contains(r)) {
            tracing::error!(
                network = %r.network,
                interface = %r.interface,
                kind = r.kind,
                load_balancers = ?r.load_balancers,
                "network refused: {}; it and its load balancers are not isolated, routed, put in keepalived's file or served (the others are), until a reload that changes its interface",
                r.reason
            );
        }
        *kept = now;
    }

    /// The networks refused at the last apply (`/status`).
    pub fn refusals(&self) -> Vec<NetworkRefusal> {
        self.refusals
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

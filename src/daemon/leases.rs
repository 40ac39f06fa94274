//! `ipam = "dhcp"`: DHCP clients per load balancer, their leased
//! addresses put in place of the `0.0.0.0` VIP, and the listeners and the
//! isolation table following a lease change.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;

use super::Daemon;
use crate::config::Config;
use crate::host::dhcp::Want;

impl Daemon {
    /// Applies the config in force again with the DHCP leases as they are
    /// now: a VIP leased, changed or lost re-binds its listeners.
    pub fn reapply_leases(&self) {
        if self.is_stopping() {
            return;
        }
        let mut st = self.lock();
        let Some(config) = st.config.clone() else {
            return;
        };
        let report = self.apply_locked(&mut st, config);
        super::log_applied!(
            tracing::Level::INFO,
            report,
            "applied the DHCP lease change"
        );
        // The isolation table follows the leased address (it runs `nft`).
        // Config and leases are read when the write runs, so writes that
        // run out of order still end with the latest.
        if st.config.as_ref().is_some_and(|c| c.vip.isolate) {
            let me = self.me.clone();
            tokio::task::spawn_blocking(move || {
                let Some(daemon) = me.upgrade() else { return };
                let Some(config) = daemon.lock().config.clone() else {
                    return;
                };
                let leased = daemon.leased_vips();
                // It sets vip_isolation_up itself.
                if let Err(e) = daemon.isolation.reconcile(&config, &leased) {
                    tracing::error!("vip.isolate, after a DHCP lease change: {e}");
                }
            });
        }
    }

    /// The VIPs leased by DHCP now, by load balancer name.
    pub fn leased_vips(&self) -> HashMap<String, IpAddr> {
        self.leases.addresses()
    }

    /// Starts and stops DHCP clients to match `config` and puts each leased
    /// address in place of its load balancer's `0.0.0.0` VIP (back to
    /// `0.0.0.0` while unleased: its listeners are then not bound).
    pub(super) fn lease_vips(&self, mut config: Config) -> Config {
        let wanted: Vec<Want> = config
            .load_balancers
            .iter()
            .filter_map(|lb| {
                lb.dhcp.as_ref().map(|d| Want {
                    name: lb.name.clone(),
                    cluster: lb.cluster.clone(),
                    spec: d.clone(),
                    guard: d.guard(&config.dhcp.guard),
                })
            })
            .collect();
        if wanted.is_empty() && self.leases.is_empty() {
            return config;
        }
        self.leases.reconcile(&wanted, &config.dhcp.state_directory);
        if !self.lease_watcher.swap(true, Ordering::AcqRel) {
            let changed = self.leases.changed();
            let me = self.me.clone();
            tokio::spawn(async move {
                loop {
                    changed.notified().await;
                    let Some(daemon) = me.upgrade() else { return };
                    daemon.reapply_leases();
                }
            });
        }
        for spec in &mut config.load_balancers {
            if spec.dhcp.is_some() {
                let vip = self
                    .leases
                    .address(&spec.name)
                    .map_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), IpAddr::V4);
                if spec.vip != vip {
                    Arc::make_mut(spec).vip = vip;
                }
            }
        }
        config
    }
}

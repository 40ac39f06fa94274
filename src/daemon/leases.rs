//! `ipam = "dhcp"`: DHCP clients per load balancer, their leased
//! addresses put in place of the `0.0.0.0` VIP, and the listeners and the
//! isolation table following a lease change.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;

use super::Daemon;
use crate::config::Config;

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

    /// Puts each leased address in place of its load balancer's `0.0.0.0`
    /// VIP ([`crate::host::dhcp::Leases::lease_vips`]), and starts, once,
    /// the task that applies the config again at every lease change.
    pub(super) fn lease_vips(&self, config: Config) -> Config {
        let active =
            !self.leases.is_empty() || config.load_balancers.iter().any(|lb| lb.dhcp.is_some());
        let config = self.leases.lease_vips(config);
        if active && !self.lease_watcher.swap(true, Ordering::AcqRel) {
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
        config
    }
}

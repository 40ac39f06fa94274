//! The daemon's side of `vip.announce = "routes"`: what the announcer
//! ([`crate::host::announce::announcer`], the feature's component) reads of
//! the daemon ([`AnnounceView`]: the settings in force, which VIPs are
//! served, whether it stops, its claims), and the operator's marks passed
//! on from the admin socket.

use std::collections::BTreeMap;
use std::net::IpAddr;
use std::time::Duration;

use super::Daemon;
use crate::config::AnnounceSettings;
use crate::host::announce::announcer::{
    AnnounceStateChange, AnnounceStateError, AnnounceView, Announcer, PERIODS_PER_DELAY,
};

impl Daemon {
    /// `harvester-lb host drain|ready` (`vip` = `None`) and `harvester-lb
    /// vip drain|ready VIP`: the operator's mark, applied at once.
    pub fn set_announce_state(
        &self,
        vip: Option<IpAddr>,
        drained: bool,
    ) -> Result<AnnounceStateChange, AnnounceStateError> {
        self.announcer.set_state(self, vip, drained)
    }
}

impl AnnounceView for Daemon {
    fn settings(&self) -> Option<AnnounceSettings> {
        self.lock()
            .config
            .as_ref()
            .map(|c| c.vip.announce.clone())
            .filter(AnnounceSettings::enabled)
    }

    fn serving(&self, settings: &AnnounceSettings) -> BTreeMap<IpAddr, (bool, Duration)> {
        let st = self.lock();
        let mut out: BTreeMap<IpAddr, (bool, Duration)> = BTreeMap::new();
        let Some(config) = &st.config else {
            return out;
        };
        for spec in &config.load_balancers {
            // Never announced nor made local: a loopback VIP
            // reaches only this host; one outside the prefixes is refused
            // at apply (and never reaches here).
            if spec.vip.is_unspecified()
                || spec.vip.to_canonical().is_loopback()
                || !settings.allows(spec.vip)
            {
                continue;
            }
            let (serving, longest) = out.entry(spec.vip).or_insert((false, Duration::ZERO));
            if let Some(hc) = &spec.health_check {
                *longest = (*longest).max(hc.period * PERIODS_PER_DELAY);
            }
            if *serving {
                continue;
            }
            let Some(entry) = st.load_balancers.get(&spec.name) else {
                continue;
            };
            let snapshot = entry.lb.snapshot();
            *serving = spec.listeners.iter().any(|l| {
                st.listeners
                    .get(&spec.listener_key(l))
                    .is_some_and(|e| e.socket.is_ok())
                    && !snapshot.eligible_for(l.backend_port).is_empty()
            });
        }
        out
    }

    fn stopping(&self) -> bool {
        self.is_stopping()
    }

    fn claims(&self) -> &crate::host::owned::Claims {
        Daemon::claims(self)
    }

    fn announcer(&self) -> &Announcer {
        &self.announcer
    }
}

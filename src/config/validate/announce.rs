//! `vip.announce` and its keys: the daemon's half of anycast VIPs.
//!
//! What is refused, and why: a table the kernel reserves (0 is "unspecified",
//! 253-255 are `default`, `main` and `local`: a host route of a VIP in
//! `main` or `local` would change how this host itself routes); an interface
//! name the kernel would not take; and `ipam = "dhcp"` with announcing,
//! because a DHCP lease belongs to one MAC address on one segment, and
//! announcing that address from every host would pull the leasing server's
//! address to all of them (see docs/vip.md, "Many hosts").

use super::super::file::FileVip;
use super::*;

/// Longest delay or grace accepted: past an hour either is a typo.
const MAX_ANNOUNCE_SECONDS: i64 = 3600;

impl Validator<'_> {
    /// `vip.announce`, `announce_interface`, `announce_table`,
    /// `announce_delay_seconds`, `withdraw_grace_seconds`.
    pub(super) fn announce(&mut self, file: &FileVip) -> AnnounceSettings {
        let mode = self.choice(
            &file.announce,
            format_args!("vip.announce"),
            &[
                ("none", AnnounceMode::None),
                ("routes", AnnounceMode::Routes),
            ],
            AnnounceMode::None,
        );
        let defaults = AnnounceSettings::default();
        let interface = file
            .announce_interface
            .as_ref()
            .and_then(|i| self.interface_name(i, format_args!("vip.announce_interface")))
            .unwrap_or(defaults.interface);
        let table = match &file.announce_table {
            None => defaults.table,
            Some(t) => {
                let n = *t.get_ref();
                match u32::try_from(n) {
                    Ok(n) if n != 0 && !(253..=255).contains(&n) => n,
                    _ => {
                        self.problem(
                            Some(t.span()),
                            "vip.announce_table",
                            format!(
                                "{n} cannot be the announcing table; use 1..=252 or 256..=4294967295 (0 is unspecified, 253 default, 254 main, 255 local), e.g. {DEFAULT_ANNOUNCE_TABLE}"
                            ),
                        );
                        defaults.table
                    }
                }
            }
        };
        let delay = file.announce_delay_seconds.as_ref().map(|_| {
            let n = self.int(
                &file.announce_delay_seconds,
                format_args!("vip.announce_delay_seconds"),
                0,
                0,
                MAX_ANNOUNCE_SECONDS,
            );
            Duration::from_secs(n as u64)
        });
        let grace = self.int(
            &file.withdraw_grace_seconds,
            format_args!("vip.withdraw_grace_seconds"),
            DEFAULT_WITHDRAW_GRACE_SECONDS as i64,
            0,
            MAX_ANNOUNCE_SECONDS,
        );
        // The interface and table are read by `withdraw --all` whatever
        // the mode (routes left by a run with "routes" are still found).
        if mode == AnnounceMode::None
            && let Some(d) = &file.announce_delay_seconds
        {
            self.warning(
                Some(d.span()),
                "vip.announce_delay_seconds",
                "has no effect without vip.announce = \"routes\"".into(),
            );
        }
        AnnounceSettings {
            mode,
            interface,
            table,
            delay,
            withdraw_grace: Duration::from_secs(grace as u64),
        }
    }

    /// Load balancers whose VIP cannot be announced: `ipam = "dhcp"` ones.
    pub(super) fn announce_conflicts(
        &mut self,
        announce: &AnnounceSettings,
        file: &FileConfig,
        specs: &[Option<LoadBalancerSpec>],
    ) {
        if !announce.enabled() {
            return;
        }
        for (i, (lb, spec)) in file.load_balancers.iter().zip(specs).enumerate() {
            if spec.as_ref().is_some_and(|s| s.ipam == Ipam::Dhcp) {
                self.problem(
                    lb.get_ref().ipam.as_ref().map(Spanned::span),
                    &format!("load_balancer[{i}].ipam"),
                    "ipam = \"dhcp\" cannot be used with vip.announce = \"routes\": a leased address belongs to one host's MAC on one segment, and announcing it from every host would steal the leasing server's address; give the load balancer a pool VIP, or set vip.announce = \"none\"".into(),
                );
            }
        }
    }
}

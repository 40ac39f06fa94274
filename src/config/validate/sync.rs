//! `[conntrackd]`: the sync of kernel listeners' flows between the two
//! keepalived hosts, or, without `[keepalived]` and with `vip.announce =
//! "routes"`, between two anycast hosts (the anycast mode: the sync link's
//! `interface`, `address` and `peer` are required, there being nothing to
//! take them from; `notify_script` and `state_directory` are warned about,
//! having no effect; see `anycast_link`).
//!
//! What is refused, and why: `[conntrackd]` with neither `[keepalived]`
//! nor announcing (no VIP moves and no flow reaches another host); more than one
//! keepalived peer (conntrackd's UDP unicast sync reaches one peer: a VIP
//! moving to a third host would find no state there); a sync address or
//! peer that is not IPv4 (conntrackd's IPv6 sync and IPv6 VIPs are not
//! covered); a `hash_size` of 8192 or fewer (conntrackd 1.4.7 then ignores
//! the flush after a commit); the same address for both ends. A warning,
//! not a refusal: no kernel listener on a VIP keepalived moves (conntrackd
//! then syncs nothing; the proxy's connections cannot be synced at all).

use std::net::{IpAddr, Ipv4Addr};

use toml::Spanned;

use super::Validator;
use crate::config::file::{FileConfig, FileConntrackd};
use crate::config::{
    AnnounceSettings, ConntrackdSettings, DEFAULT_CONNTRACKD_CONFIG, DEFAULT_CONNTRACKD_LOCK,
    DEFAULT_CONNTRACKD_LOG, DEFAULT_CONNTRACKD_SOCKET, DEFAULT_HASH_SIZE, DEFAULT_NOTIFY_SCRIPT,
    DEFAULT_SYNC_PORT, DEFAULT_SYNC_STATE_DIR, Forwarding, KeepalivedSettings, LoadBalancerSpec,
    MIN_HASH_SIZE,
};

/// Whether `ch` may be in a `[conntrackd]` path: `[A-Za-z0-9._/-]`.
pub(crate) fn plain_path_char(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '/' | '-')
}

/// The largest `conntrackd.hash_size` accepted: 2^24 buckets is far past
/// any host's conntrack table.
const MAX_HASH_SIZE: i64 = 1 << 24;

impl Validator<'_> {
    /// `[conntrackd]`, given the validated `[keepalived]` and load balancers.
    pub(super) fn conntrackd(
        &mut self,
        file: &FileConfig,
        keepalived: Option<&KeepalivedSettings>,
        specs: &[Option<LoadBalancerSpec>],
        announce: &AnnounceSettings,
    ) -> Option<ConntrackdSettings> {
        let table = file.conntrackd.as_ref()?;
        let span = table.span();
        let c: &FileConntrackd = table.get_ref();
        // Without [keepalived], the anycast mode (see `anycast_link`).
        let Some(k) = keepalived else {
            if file.keepalived.is_some() {
                return None;
            }
            if !announce.enabled() {
                self.problem(
                    Some(span),
                    "conntrackd",
                    "needs [keepalived] (a VIP that moves between two hosts) or vip.announce = \"routes\" (an anycast VIP on two hosts): without either no flow reaches another host, so there is nothing to sync; add one of them or remove [conntrackd]".into(),
                );
                return None;
            }
            let link = self.anycast_link(c, span.clone())?;
            return self.conntrackd_settings(c, span, specs, Some(announce), link);
        };
        if k.peers.len() != 1 {
            self.problem(
                Some(span.clone()),
                "conntrackd",
                format!(
                    "keepalived.peers lists {} hosts; conntrackd's UDP sync reaches one peer, so a VIP moving to another host would find none of its flows there: sync two hosts only (one peer), or remove [conntrackd]",
                    k.peers.len()
                ),
            );
        }
        let address = self.sync_v4(&c.address, "conntrackd.address", k.address);
        let peer = self.sync_v4(
            &c.peer,
            "conntrackd.peer",
            k.peers.first().copied().unwrap_or(k.address),
        );
        if let (Some(a), Some(p)) = (address, peer)
            && a == p
        {
            self.problem(
                c.peer.as_ref().or(c.address.as_ref()).map(Spanned::span),
                "conntrackd.peer",
                format!("{p} is also conntrackd.address, this host's own; write the other host's address on the sync link"),
            );
        }
        let interface = match &c.interface {
            None => {
                match super::names::conntrackd_interface_problem(&k.interface) {
                    Some(why) => {
                        self.problem(
                        Some(span.clone()),
                        "conntrackd.interface",
                        format!("taken from keepalived.interface: {why}, or set conntrackd.interface"),
                    );
                        None
                    }
                    None => Some(k.interface.clone()),
                }
            }
            Some(i) => self.sync_interface(i),
        };
        let (interface, address, peer) = (interface?, address?, peer?);
        self.conntrackd_settings(c, span, specs, None, (interface, address, peer))
    }

    /// The keys of `[conntrackd]` both modes share, and the settings.
    fn conntrackd_settings(
        &mut self,
        c: &FileConntrackd,
        span: std::ops::Range<usize>,
        specs: &[Option<LoadBalancerSpec>],
        anycast: Option<&AnnounceSettings>,
        (interface, address, peer): (String, Ipv4Addr, Ipv4Addr),
    ) -> Option<ConntrackdSettings> {
        let port = self.int(
            &c.port,
            format_args!("conntrackd.port"),
            i64::from(DEFAULT_SYNC_PORT),
            1,
            65535,
        );
        let hash_size = self.int(
            &c.hash_size,
            format_args!("conntrackd.hash_size"),
            i64::from(DEFAULT_HASH_SIZE),
            i64::from(MIN_HASH_SIZE),
            MAX_HASH_SIZE,
        );
        if let Some(h) = &c.hash_size
            && *h.get_ref() < i64::from(MIN_HASH_SIZE)
        {
            // `int` said it is out of range; say why the floor is there.
            self.problem(
                Some(h.span()),
                "conntrackd.hash_size",
                format!(
                    "conntrackd 1.4.7 ignores the flush (-f) after a commit (\"commit still in progress\") with {} buckets or fewer; the default is {DEFAULT_HASH_SIZE}",
                    MIN_HASH_SIZE - 1
                ),
            );
        }
        let config_path = self.abs_path(
            &c.config_path,
            "conntrackd.config_path",
            DEFAULT_CONNTRACKD_CONFIG,
        );
        let notify_script = self.abs_path(
            &c.notify_script,
            "conntrackd.notify_script",
            DEFAULT_NOTIFY_SCRIPT,
        );
        let socket = self.abs_path(&c.socket, "conntrackd.socket", DEFAULT_CONNTRACKD_SOCKET);
        let lock_file = self.abs_path(
            &c.lock_file,
            "conntrackd.lock_file",
            DEFAULT_CONNTRACKD_LOCK,
        );
        let log_file = self.abs_path(&c.log_file, "conntrackd.log_file", DEFAULT_CONNTRACKD_LOG);
        let state_directory = self.abs_path(
            &c.state_directory,
            "conntrackd.state_directory",
            DEFAULT_SYNC_STATE_DIR,
        );
        for (key, value, path) in [
            ("conntrackd.config_path", &c.config_path, &config_path),
            ("conntrackd.notify_script", &c.notify_script, &notify_script),
            ("conntrackd.socket", &c.socket, &socket),
            ("conntrackd.lock_file", &c.lock_file, &lock_file),
            ("conntrackd.log_file", &c.log_file, &log_file),
            (
                "conntrackd.state_directory",
                &c.state_directory,
                &state_directory,
            ),
        ] {
            // Each is written into the notify script keepalived runs as
            // root, and into conntrackd.conf and keepalived.conf, whose
            // readers split words and cut comments their own ways: only
            // the characters no shell, keepalived or conntrackd treats
            // specially (`;`, `(`, `#`, `$`, quotes, spaces…), whatever
            // quoting the script does.
            let text = path.display().to_string();
            if let Some(bad) = text.chars().find(|ch| !plain_path_char(*ch)) {
                self.problem(
                    value.as_ref().map(Spanned::span).or(Some(span.clone())),
                    key,
                    format!("{text:?} has {bad:?}; a path here may hold only letters, digits and `.`, `_`, `/`, `-` (it is written into the notify script keepalived runs as root, and into conntrackd's and keepalived's files)"),
                );
            }
        }
        let restart_command = c.restart_command.as_ref().and_then(|cmd| {
            let words: Vec<String> = cmd.get_ref().iter().map(|w| w.get_ref().clone()).collect();
            if words.first().is_none_or(|w| !w.starts_with('/'))
                || words.iter().any(|w| w.contains('\0'))
            {
                self.problem(
                    Some(cmd.span()),
                    "conntrackd.restart_command",
                    format!("{words:?} is not a command; write its words with an absolute program path first, e.g. [\"/usr/bin/systemctl\", \"restart\", \"conntrackd\"]"),
                );
                None
            } else {
                Some(words)
            }
        });
        let synced = specs.iter().flatten().any(|lb| {
            let moves = match anycast {
                None => lb.network.is_some(),
                Some(a) => lb.network.is_none() && a.allows(lb.vip),
            };
            // The anycast sync is IPv4's alone; keepalived's moves both.
            moves
                && (lb.vip.is_ipv4() || anycast.is_none())
                && lb
                    .listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
        });
        if anycast.is_some() {
            for (key, value) in [
                ("conntrackd.notify_script", &c.notify_script),
                ("conntrackd.state_directory", &c.state_directory),
            ] {
                if let Some(v) = value {
                    self.warning(
                        Some(v.span()),
                        key,
                        "has no effect without [keepalived]: the anycast sync has no transitions, so no notify script".into(),
                    );
                }
            }
            if !synced {
                self.warning(
                    Some(span.clone()),
                    "conntrackd",
                    "no load balancer with an announced VIP (inside vip.announce_prefixes, on no [[network]]) has a listener with forwarding = \"kernel\": conntrackd syncs nothing (only the kernel's flows can be synced)".into(),
                );
            }
        } else if !synced {
            self.warning(
                Some(span),
                "conntrackd",
                "no load balancer on a [[network]] has a listener with forwarding = \"kernel\": conntrackd syncs nothing (only the kernel's flows can be synced; the proxy's connections end when their VIP moves)".into(),
            );
        }
        Some(ConntrackdSettings {
            interface,
            address,
            peer,
            port: u16::try_from(port).ok().filter(|p| *p != 0)?,
            config_path,
            notify_script,
            socket,
            lock_file,
            log_file,
            state_directory,
            hash_size: u32::try_from(hash_size).unwrap_or(DEFAULT_HASH_SIZE),
            restart_command,
        })
    }

    /// The sync link of the anycast mode (`[conntrackd]` with `vip.announce
    /// = "routes"` and no `[keepalived]`): every flow's state injected into
    /// the other host's kernel table as it changes (conntrackd's
    /// `DisableExternalCache`), so the replies the router sends there and
    /// the flows a withdrawal moves there find their NAT binding. Nothing
    /// defaults the link here (there is no `[keepalived]` to take it
    /// from): `interface`, `address` and `peer` are required.
    fn anycast_link(
        &mut self,
        c: &FileConntrackd,
        span: std::ops::Range<usize>,
    ) -> Option<(String, Ipv4Addr, Ipv4Addr)> {
        let mut missing = Vec::new();
        for (key, value) in [
            ("interface", &c.interface),
            ("address", &c.address),
            ("peer", &c.peer),
        ] {
            if value.is_none() {
                missing.push(key);
            }
        }
        if !missing.is_empty() {
            self.problem(
                Some(span),
                "conntrackd",
                format!(
                    "without [keepalived] (the anycast sync between two announcing hosts) conntrackd.{} must be set: nothing to take the sync link from; e.g. interface = \"eth1\", address = \"10.99.0.1\" (this host), peer = \"10.99.0.2\" (the other host: one peer, so two hosts only)",
                    missing.join(", conntrackd.")
                ),
            );
            return None;
        }
        let interface = self.sync_interface(c.interface.as_ref()?);
        let unspecified = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        let address = self.sync_v4(&c.address, "conntrackd.address", unspecified);
        let peer = self.sync_v4(&c.peer, "conntrackd.peer", unspecified);
        if let (Some(a), Some(p)) = (address, peer)
            && a == p
        {
            self.problem(
                c.peer.as_ref().map(Spanned::span),
                "conntrackd.peer",
                format!("{p} is also conntrackd.address, this host's own; write the other host's address on the sync link"),
            );
            return None;
        }
        Some((interface?, address?, peer?))
    }

    /// `conntrackd.interface`: a name the kernel takes and conntrackd's
    /// parser reads as one word (written bare as `Interface`).
    fn sync_interface(&mut self, value: &Spanned<String>) -> Option<String> {
        let name = self.interface_name(value, format_args!("conntrackd.interface"))?;
        match super::names::conntrackd_interface_problem(&name) {
            Some(why) => {
                self.problem(Some(value.span()), "conntrackd.interface", why);
                None
            }
            None => Some(name),
        }
    }

    /// An IPv4 address of the sync link; `default` when absent.
    fn sync_v4(
        &mut self,
        value: &Option<Spanned<String>>,
        key: &str,
        default: IpAddr,
    ) -> Option<Ipv4Addr> {
        let (ip, span) = match value {
            None => (default, None),
            Some(v) => (self.ip(v, format_args!("{key}"))?, Some(v.span())),
        };
        if let Some(why) = super::vmnet::host_address_problem(ip) {
            self.problem(
                span,
                key,
                format!("{ip} cannot be an end of the sync link: it is {why}; write the host's own unicast IPv4 address on the sync link"),
            );
            return None;
        }
        match ip {
            IpAddr::V4(v4) => Some(v4),
            IpAddr::V6(_) => {
                let whence = if span.is_none() {
                    " (taken from [keepalived]; set it to the host's IPv4 address on the sync link)"
                } else {
                    ""
                };
                self.problem(
                    span,
                    key,
                    format!("{ip} is IPv6{whence}; conntrackd's sync link is rendered for IPv4 only (it carries the flows of IPv6 VIPs too)"),
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::parse;
    use crate::config::test_fixtures::{ANYCAST, ANYCAST_SYNC, KEEPALIVED, VLAN100, db, problems};

    /// Host "a" of a keepalived pair with "default/db" on "vlan100": the
    /// kernel listener "pg" (5432 to 30432, `source_nat = "none"`).
    fn base() -> String {
        format!(
            "{KEEPALIVED}\n{VLAN100}\n{}",
            db(
                r#"# flow_hash: a flow that reaches the other host before its commit still
# finds its backend (round robin is warned about with a moving VIP).
algorithm = "flow_hash"
backends = ["10.100.0.21", "10.100.0.22"]
"#
            )
        )
    }

    #[test]
    fn the_defaults_sync_over_the_management_network_to_the_one_peer() {
        let loaded = parse(&format!("{}\n[conntrackd]\n", base())).expect("valid");
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let c = loaded.config.conntrackd.expect("conntrackd");
        assert_eq!(c.interface, "mgmt0");
        assert_eq!(c.address.to_string(), "192.168.0.11");
        assert_eq!(c.peer.to_string(), "192.168.0.12");
        assert_eq!((c.port, c.hash_size), (3780, 32_768));
        assert_eq!(
            c.config_path.to_str(),
            Some("/etc/conntrackd/conntrackd.conf")
        );
        let dedicated = parse(&format!(
            "{}\n[conntrackd]\ninterface = \"sync0\"\naddress = \"10.99.0.1\"\npeer = \"10.99.0.2\"\n",
            base()
        ))
        .expect("valid")
        .config
        .conntrackd
        .unwrap();
        assert_eq!(
            (dedicated.interface.as_str(), dedicated.peer.to_string()),
            ("sync0", "10.99.0.2".to_string())
        );
    }

    /// Issue 40, defect 10: `state_directory = "/x;id>/tmp/f;:"` passed
    /// and the root notify script ran `id`. Every path key refuses what
    /// is outside `[A-Za-z0-9._/-]`, naming the key and the line.
    #[test]
    fn a_path_with_a_shell_metacharacter_is_refused_by_key_and_line() {
        let keys = [
            "config_path",
            "notify_script",
            "socket",
            "lock_file",
            "log_file",
            "state_directory",
        ];
        let values = [
            "/x;id>/tmp/f;:",
            "/x(",
            "/x#y",
            "/x$(id)",
            "/x`id`",
            "/x&y",
            "/x|y",
            "/x*",
            "/x\\ny",
            "/x~y",
            "/x!y",
            "/x{y}",
            "/é",
        ];
        let mut refused = 0;
        for key in keys {
            for value in values {
                let text = format!(
                    "{}\n[conntrackd]\n{key} = {}\n",
                    base(),
                    toml::Value::String(value.into())
                );
                let line = text.lines().count();
                let p = problems(&text);
                assert!(
                    p.iter().any(|p| p.key == format!("conntrackd.{key}")
                        && p.line == Some(line)
                        && p.message.contains("only letters, digits")),
                    "{key} = {value:?}: {p:?}"
                );
                refused += 1;
            }
            // The plain characters pass.
            let text = format!("{}\n[conntrackd]\n{key} = \"/run/hlb-1/a_b.c\"\n", base());
            parse(&text).unwrap_or_else(|e| panic!("{key}: {e:?}"));
        }
        assert_eq!(refused, keys.len() * values.len());
    }

    #[test]
    fn every_mistake_is_named_with_its_key_and_remedy() {
        let cases: &[(&str, &str, &str)] = &[
            (
                "hash_size = 8192\n",
                "conntrackd.hash_size",
                "commit still in progress",
            ),
            (
                "peer = \"192.168.0.11\"\n",
                "conntrackd.peer",
                "this host's own",
            ),
            ("peer = \"fd00::2\"\n", "conntrackd.peer", "IPv4 only"),
            (
                "interface = \"a b\"\n",
                "conntrackd.interface",
                "not an interface name",
            ),
            (
                "config_path = \"etc/c.conf\"\n",
                "conntrackd.config_path",
                "absolute",
            ),
            (
                "socket = \"/run/a b.ctl\"\n",
                "conntrackd.socket",
                "only letters, digits",
            ),
            (
                "restart_command = [\"systemctl\"]\n",
                "conntrackd.restart_command",
                "absolute program path",
            ),
            ("port = 0\n", "conntrackd.port", "1..=65535"),
            ("multicast = true\n", "conntrackd.multicast", "unknown key"),
        ];
        for (line, key, says) in cases {
            let p = problems(&format!("{}\n[conntrackd]\n{line}", base()));
            assert!(
                p.iter().any(|p| p.key == *key && p.message.contains(says)),
                "{line}: {p:?}"
            );
        }
        // Three hosts: one peer cannot hold a VIP's flows for both others.
        let three = base().replace("[\"192.168.0.12\"]", "[\"192.168.0.12\", \"192.168.0.13\"]");
        let p = problems(&format!("{three}\n[conntrackd]\n"));
        assert!(
            p.iter()
                .any(|p| p.key == "conntrackd" && p.message.contains("one peer")),
            "{p:?}"
        );
        // No keepalived: nothing moves.
        let alone = "[conntrackd]\n";
        let p = problems(alone);
        assert!(
            p.iter()
                .any(|p| p.key == "conntrackd" && p.message.contains("needs [keepalived]")),
            "{p:?}"
        );
    }

    #[test]
    fn without_a_kernel_listener_to_sync_it_warns() {
        let proxy = base()
            .replace("  forwarding = \"kernel\"\n", "")
            .replace("  source_nat = \"none\"\n", "");
        let loaded = parse(&format!("{proxy}\n[conntrackd]\n")).expect("valid");
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.key == "conntrackd" && w.message.contains("syncs nothing")),
            "{:?}",
            loaded.warnings
        );
    }

    /// Issue 42: an IPv6 VIP's kernel listener on a network is synced
    /// (its backends are in the filter), so `check` must not say nothing is.
    #[test]
    fn an_ipv6_vip_s_kernel_listener_is_something_to_sync() {
        let v6 = base()
            .replace("vip = \"10.100.0.50\"", "vip = \"fd00:100::50\"")
            .replace(
                "backends = [\"10.100.0.21\", \"10.100.0.22\"]",
                "backends = [\"fd00:100::21\"]",
            )
            .replace(
                "gateway = \"10.100.0.1\"\n",
                "gateway = \"10.100.0.1\"\nipv6_gateway = \"fd00:100::1\"\n",
            );
        // (an IPv6 VIP needs an IPv4 one for its instance)
        let text = format!(
            "{v6}\n[[load_balancer]]\nname = \"default/v4\"\nvip = \"10.100.0.51\"\nnetwork = \"vlan100\"\n\n[conntrackd]\n"
        );
        let loaded = parse(&text).expect("valid");
        assert!(
            !loaded
                .warnings
                .iter()
                .any(|w| w.message.contains("syncs nothing")),
            "{:?}",
            loaded.warnings
        );
    }

    #[test]
    fn anycast_source_nat_vip_is_allowed_exactly_with_the_sync() {
        // Without the sync: refused, and the message names the remedy.
        let p = problems(ANYCAST);
        assert!(
            p.iter()
                .any(|p| p.key == "load_balancer[0].listener[0].source_nat"
                    && p.message.contains("add [conntrackd]")),
            "{p:?}"
        );
        let loaded = parse(&format!("{ANYCAST}{ANYCAST_SYNC}")).expect("valid");
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let c = loaded.config.conntrackd.expect("conntrackd");
        assert_eq!(
            (
                c.interface.as_str(),
                c.address.to_string(),
                c.peer.to_string()
            ),
            ("eth1", "10.99.0.1".to_string(), "10.99.0.2".to_string())
        );
        // Masquerade with the sync: a warning that says to use "vip".
        let masq = parse(&format!(
            "{}{ANYCAST_SYNC}",
            ANYCAST.replace("source_nat = \"vip\"", "source_nat = \"masquerade\"")
        ))
        .expect("valid");
        assert!(
            masq.warnings
                .iter()
                .any(|w| w.key == "load_balancer[0].listener[0].source_nat"
                    && w.message.contains("even with [conntrackd]")),
            "{:?}",
            masq.warnings
        );
    }

    #[test]
    fn the_anycast_sync_names_what_it_lacks() {
        // No link to default from: all three keys are required.
        let p = problems(&format!("{ANYCAST}\n[conntrackd]\ninterface = \"eth1\"\n"));
        assert!(
            p.iter().any(|p| p.key == "conntrackd"
                && p.message
                    .contains("conntrackd.address, conntrackd.peer must be set")),
            "{p:?}"
        );
        // Neither keepalived nor announcing: nothing moves.
        let alone = ANYCAST.replace("announce = \"routes\"\n", "");
        let p = problems(&format!("{alone}{ANYCAST_SYNC}"));
        assert!(
            p.iter()
                .any(|p| p.key == "conntrackd" && p.message.contains("vip.announce = \"routes\"")),
            "{p:?}"
        );
        // A key of the keepalived mode only: a warning.
        let loaded = parse(&format!(
            "{ANYCAST}{ANYCAST_SYNC}notify_script = \"/etc/keepalived/x.sh\"\n"
        ))
        .expect("valid");
        assert!(
            loaded
                .warnings
                .iter()
                .any(|w| w.key == "conntrackd.notify_script" && w.message.contains("no effect")),
            "{:?}",
            loaded.warnings
        );
    }
}

//! `[conntrackd]`: the sync of kernel listeners' flows among the
//! keepalived hosts, or, without `[keepalived]` and with `vip.announce =
//! "routes"`, among the anycast hosts (the anycast mode: the sync link's
//! `interface` and `address` are required, and `peer` with the unicast
//! transport, there being nothing to take them from; `notify_script` and
//! `state_directory` are warned about, having no effect; see
//! `anycast_link`).
//!
//! The transport (`conntrackd.transport`): UDP unicast to one peer (the
//! default with one keepalived peer, or with `conntrackd.peer` in the
//! anycast mode), or multicast to `conntrackd.multicast_group` (the
//! default otherwise), which every host of the sync link gets whatever
//! their number. The key the other transport uses is warned about.
//!
//! What is refused, and why: `[conntrackd]` with neither `[keepalived]`
//! nor announcing (no VIP moves and no flow reaches another host); unicast
//! with more than one keepalived peer (it reaches one peer: a VIP moving
//! to a third host would find no state there; the message names
//! `transport = "multicast"`); a group outside 224.0.0.0/4 or inside
//! 224.0.0.0/24 (the link-local control block every switch floods); a
//! sync address or peer or group that is not IPv4 (conntrackd's IPv6 sync
//! is not rendered); a `hash_size` of 8192 or fewer (conntrackd 1.4.7
//! then ignores the flush after a commit); the same address for both
//! ends. A warning, not a refusal: no kernel listener on a VIP keepalived
//! moves (conntrackd then syncs nothing; the proxy's connections cannot be
//! synced at all).

use std::net::{IpAddr, Ipv4Addr};

use toml::Spanned;

use super::Validator;
use crate::config::file::{FileConfig, FileConntrackd};
use crate::config::{
    AnnounceSettings, ConntrackdSettings, DEFAULT_CONNTRACKD_CONFIG, DEFAULT_CONNTRACKD_LOCK,
    DEFAULT_CONNTRACKD_LOG, DEFAULT_CONNTRACKD_SOCKET, DEFAULT_HASH_SIZE, DEFAULT_MULTICAST_GROUP,
    DEFAULT_NOTIFY_SCRIPT, DEFAULT_SYNC_PORT, DEFAULT_SYNC_STATE_DIR, Forwarding,
    KeepalivedSettings, LoadBalancerSpec, MIN_HASH_SIZE, SyncTransport,
};

/// Whether `ch` may be in a `[conntrackd]` path: `[A-Za-z0-9._/-]`.
pub(crate) fn plain_path_char(ch: char) -> bool {
    ch.is_ascii_alphanumeric() || matches!(ch, '.' | '_' | '/' | '-')
}

/// `conntrackd.transport`, before its addresses are validated.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// To one peer.
    Unicast,
    /// To a multicast group.
    Multicast,
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
        let default = if k.peers.len() == 1 {
            Kind::Unicast
        } else {
            Kind::Multicast
        };
        let kind = self.transport_kind(c, default);
        let address = self.sync_v4(&c.address, "conntrackd.address", k.address);
        let transport = match kind? {
            Kind::Unicast if k.peers.len() != 1 => {
                self.problem(
                    c.transport.as_ref().map(Spanned::span).or(Some(span.clone())),
                    "conntrackd.transport",
                    format!(
                        "\"unicast\" reaches one peer, and keepalived.peers lists {} hosts: a VIP moving to another host would find none of its flows there; write transport = \"multicast\" (the default with more than one peer: every host gets every update)",
                        k.peers.len()
                    ),
                );
                None
            }
            Kind::Unicast => {
                let peer = self.sync_v4(
                    &c.peer,
                    "conntrackd.peer",
                    k.peers.first().copied().unwrap_or(k.address),
                );
                self.unicast_transport(c, address, peer)
            }
            Kind::Multicast => self.multicast_transport(c),
        };
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
        let (interface, address, transport) = (interface?, address?, transport?);
        self.conntrackd_settings(c, span, specs, None, (interface, address, transport))
    }

    /// The keys of `[conntrackd]` both modes share, and the settings.
    fn conntrackd_settings(
        &mut self,
        c: &FileConntrackd,
        span: std::ops::Range<usize>,
        specs: &[Option<LoadBalancerSpec>],
        anycast: Option<&AnnounceSettings>,
        (interface, address, transport): (String, Ipv4Addr, SyncTransport),
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
            moves
                && lb.vip.is_ipv4()
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
            transport,
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
    /// the other hosts' kernel tables as it changes (conntrackd's
    /// `DisableExternalCache`), so the replies the router sends there and
    /// the flows a withdrawal moves there find their NAT binding. Nothing
    /// defaults the link here (there is no `[keepalived]` to take it
    /// from): `interface` and `address` are required, and `peer` with the
    /// unicast transport (the default when `peer` is set; multicast, for
    /// any number of hosts, otherwise).
    fn anycast_link(
        &mut self,
        c: &FileConntrackd,
        span: std::ops::Range<usize>,
    ) -> Option<(String, Ipv4Addr, SyncTransport)> {
        let default = if c.peer.is_some() {
            Kind::Unicast
        } else {
            Kind::Multicast
        };
        let kind = self.transport_kind(c, default);
        let mut missing = Vec::new();
        for (key, value) in [("interface", &c.interface), ("address", &c.address)] {
            if value.is_none() {
                missing.push(key);
            }
        }
        if kind == Some(Kind::Unicast) && c.peer.is_none() {
            missing.push("peer");
        }
        if !missing.is_empty() {
            self.problem(
                Some(span),
                "conntrackd",
                format!(
                    "without [keepalived] (the anycast sync between announcing hosts) conntrackd.{} must be set: nothing to take the sync link from; e.g. interface = \"eth1\", address = \"10.99.0.1\" (this host), and either peer = \"10.99.0.2\" (the other host: unicast, two hosts only) or transport = \"multicast\" (any number of hosts)",
                    missing.join(", conntrackd.")
                ),
            );
            return None;
        }
        let interface = self.sync_interface(c.interface.as_ref()?);
        let unspecified = IpAddr::V4(Ipv4Addr::UNSPECIFIED);
        let address = self.sync_v4(&c.address, "conntrackd.address", unspecified);
        let transport = match kind? {
            Kind::Unicast => {
                let peer = self.sync_v4(&c.peer, "conntrackd.peer", unspecified);
                self.unicast_transport(c, address, peer)
            }
            Kind::Multicast => self.multicast_transport(c),
        };
        Some((interface?, address?, transport?))
    }

    /// `conntrackd.transport`, or `default` when absent; `None` (reported)
    /// when it is neither word.
    fn transport_kind(&mut self, c: &FileConntrackd, default: Kind) -> Option<Kind> {
        let Some(value) = &c.transport else {
            return Some(default);
        };
        match value.get_ref().as_str() {
            "unicast" => Some(Kind::Unicast),
            "multicast" => Some(Kind::Multicast),
            other => {
                self.problem(
                    Some(value.span()),
                    "conntrackd.transport",
                    format!("{other:?} is not a transport; write \"unicast\" (to one peer: two hosts) or \"multicast\" (to conntrackd.multicast_group: any number of hosts)"),
                );
                None
            }
        }
    }

    /// The unicast transport to `peer`, which is not this host; a
    /// `multicast_group` is warned about (unused).
    fn unicast_transport(
        &mut self,
        c: &FileConntrackd,
        address: Option<Ipv4Addr>,
        peer: Option<Ipv4Addr>,
    ) -> Option<SyncTransport> {
        if let Some(g) = &c.multicast_group {
            self.warning(
                Some(g.span()),
                "conntrackd.multicast_group",
                "has no effect with the unicast transport (conntrackd.transport, or its default with one peer); remove it, or write transport = \"multicast\"".into(),
            );
        }
        let peer = peer?;
        if address == Some(peer) {
            self.problem(
                c.peer.as_ref().or(c.address.as_ref()).map(Spanned::span),
                "conntrackd.peer",
                format!("{peer} is also conntrackd.address, this host's own; write the other host's address on the sync link"),
            );
            return None;
        }
        Some(SyncTransport::Unicast { peer })
    }

    /// The multicast transport to `conntrackd.multicast_group` (default
    /// [`DEFAULT_MULTICAST_GROUP`]); a `peer` is warned about (unused).
    fn multicast_transport(&mut self, c: &FileConntrackd) -> Option<SyncTransport> {
        if let Some(p) = &c.peer {
            self.warning(
                Some(p.span()),
                "conntrackd.peer",
                "has no effect with the multicast transport: every host on the sync link that joined conntrackd.multicast_group gets the updates; remove it, or write transport = \"unicast\" (two hosts only)".into(),
            );
        }
        let Some(value) = &c.multicast_group else {
            return Some(SyncTransport::Multicast {
                group: DEFAULT_MULTICAST_GROUP,
            });
        };
        let key = "conntrackd.multicast_group";
        let why = match self.ip(value, format_args!("{key}"))? {
            IpAddr::V6(_) => {
                "is IPv6; conntrackd's sync is rendered for IPv4 only: write an IPv4 group (224.0.0.0/4), e.g. 225.0.0.50"
            }
            IpAddr::V4(g) if !g.is_multicast() => {
                "is not a multicast group (224.0.0.0/4); write one every host of the sync link joins, e.g. 225.0.0.50"
            }
            IpAddr::V4(g) if g.octets()[..3] == [224, 0, 0] => {
                "is in 224.0.0.0/24, the local network control block (VRRP's adverts are 224.0.0.18, OSPF's, IGMP's…): switches flood it to every port whatever their snooping; write another group, e.g. 225.0.0.50"
            }
            IpAddr::V4(group) => return Some(SyncTransport::Multicast { group }),
        };
        self.problem(
            Some(value.span()),
            key,
            format!("{} {why}", value.get_ref()),
        );
        None
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
                    format!("{ip} is IPv6{whence}; conntrackd's sync is rendered for IPv4 only (IPv6 VIPs are not supported on networks)"),
                );
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use crate::config::test_fixtures::{ANYCAST, ANYCAST_SYNC, KEEPALIVED, VLAN100, db, problems};
    use crate::config::{SyncTransport, parse};

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
        assert_eq!(
            c.transport,
            SyncTransport::Unicast {
                peer: "192.168.0.12".parse().unwrap()
            }
        );
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
            (
                dedicated.interface.as_str(),
                dedicated.transport.destination().to_string()
            ),
            ("sync0", "10.99.0.2".to_string())
        );
    }

    /// Three hosts (two keepalived peers): multicast to the default group
    /// on the same link, with no key written; unicast asked for is refused
    /// with the remedy; multicast asked for with one peer is taken.
    #[test]
    fn more_than_one_peer_syncs_over_multicast() {
        let three = base().replace("[\"192.168.0.12\"]", "[\"192.168.0.12\", \"192.168.0.13\"]");
        let loaded = parse(&format!("{three}\n[conntrackd]\n")).expect("valid");
        assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
        let c = loaded.config.conntrackd.expect("conntrackd");
        assert_eq!(
            (
                c.transport,
                c.interface.as_str(),
                c.address.to_string(),
                c.port
            ),
            (
                SyncTransport::Multicast {
                    group: "225.0.0.50".parse().unwrap()
                },
                "mgmt0",
                "192.168.0.11".to_string(),
                3780
            )
        );
        let text = format!("{three}\n[conntrackd]\ntransport = \"unicast\"\n");
        let line = text.lines().count();
        let p = problems(&text);
        assert!(
            p.iter().any(|p| p.key == "conntrackd.transport"
                && p.line == Some(line)
                && p.message.contains("lists 2 hosts")
                && p.message.contains("transport = \"multicast\"")),
            "{p:?}"
        );
        let two = parse(&format!(
            "{}\n[conntrackd]\ntransport = \"multicast\"\nmulticast_group = \"239.192.0.7\"\n",
            base()
        ))
        .expect("valid");
        assert!(two.warnings.is_empty(), "{:?}", two.warnings);
        assert_eq!(
            two.config.conntrackd.unwrap().transport,
            SyncTransport::Multicast {
                group: "239.192.0.7".parse().unwrap()
            }
        );
    }

    /// A key the chosen transport does not use is a warning naming it.
    #[test]
    fn the_other_transport_s_key_is_warned_about() {
        let three = base().replace("[\"192.168.0.12\"]", "[\"192.168.0.12\", \"192.168.0.13\"]");
        for (text, key, says) in [
            (
                format!("{three}\n[conntrackd]\npeer = \"192.168.0.12\"\n"),
                "conntrackd.peer",
                "no effect with the multicast transport",
            ),
            (
                format!(
                    "{}\n[conntrackd]\nmulticast_group = \"225.0.0.51\"\n",
                    base()
                ),
                "conntrackd.multicast_group",
                "no effect with the unicast transport",
            ),
        ] {
            let loaded = parse(&text).expect("valid");
            assert!(
                loaded
                    .warnings
                    .iter()
                    .any(|w| w.key == key && w.message.contains(says)),
                "{key}: {:?}",
                loaded.warnings
            );
        }
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
            (
                "transport = \"broadcast\"\n",
                "conntrackd.transport",
                "\"unicast\" (to one peer: two hosts) or \"multicast\"",
            ),
            (
                "transport = \"multicast\"\nmulticast_group = \"10.0.0.1\"\n",
                "conntrackd.multicast_group",
                "10.0.0.1 is not a multicast group",
            ),
            (
                "transport = \"multicast\"\nmulticast_group = \"224.0.0.18\"\n",
                "conntrackd.multicast_group",
                "local network control block",
            ),
            (
                "transport = \"multicast\"\nmulticast_group = \"ff02::1\"\n",
                "conntrackd.multicast_group",
                "IPv4 only",
            ),
            (
                "transport = \"multicast\"\nmulticast_group = \"group\"\n",
                "conntrackd.multicast_group",
                "not an IPv4 or IPv6 address",
            ),
        ];
        for (line, key, says) in cases {
            let p = problems(&format!("{}\n[conntrackd]\n{line}", base()));
            assert!(
                p.iter().any(|p| p.key == *key && p.message.contains(says)),
                "{line}: {p:?}"
            );
        }
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
            (c.interface.as_str(), c.address.to_string(), c.transport),
            (
                "eth1",
                "10.99.0.1".to_string(),
                SyncTransport::Unicast {
                    peer: "10.99.0.2".parse().unwrap()
                }
            )
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
        // No link to default from: the interface and address are
        // required, and the peer with unicast.
        let p = problems(&format!(
            "{ANYCAST}\n[conntrackd]\ntransport = \"unicast\"\n"
        ));
        assert!(
            p.iter().any(|p| p.key == "conntrackd"
                && p.message.contains(
                    "conntrackd.interface, conntrackd.address, conntrackd.peer must be set"
                )),
            "{p:?}"
        );
        let p = problems(&format!("{ANYCAST}\n[conntrackd]\ninterface = \"eth1\"\n"));
        assert!(
            p.iter().any(|p| p.key == "conntrackd"
                && p.message.contains("conntrackd.address must be set")
                && p.message
                    .contains("transport = \"multicast\" (any number of hosts)")),
            "{p:?}"
        );
        // No peer: multicast among any number of announcing hosts.
        let multicast = parse(&format!(
            "{ANYCAST}\n[conntrackd]\ninterface = \"eth1\"\naddress = \"10.99.0.1\"\n"
        ))
        .expect("valid");
        assert!(multicast.warnings.is_empty(), "{:?}", multicast.warnings);
        assert_eq!(
            multicast.config.conntrackd.unwrap().transport,
            SyncTransport::Multicast {
                group: "225.0.0.50".parse().unwrap()
            }
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

//! `[conntrackd]`: the sync of kernel listeners' flows between the two
//! keepalived hosts.
//!
//! What is refused, and why: `[conntrackd]` without `[keepalived]` (there
//! is no VIP that moves, so no transition to commit at); more than one
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
    ConntrackdSettings, DEFAULT_CONNTRACKD_CONFIG, DEFAULT_CONNTRACKD_LOCK, DEFAULT_CONNTRACKD_LOG,
    DEFAULT_CONNTRACKD_SOCKET, DEFAULT_HASH_SIZE, DEFAULT_NOTIFY_SCRIPT, DEFAULT_SYNC_PORT,
    DEFAULT_SYNC_STATE_DIR, Forwarding, KeepalivedSettings, LoadBalancerSpec, MIN_HASH_SIZE,
};

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
    ) -> Option<ConntrackdSettings> {
        let table = file.conntrackd.as_ref()?;
        let span = table.span();
        let c: &FileConntrackd = table.get_ref();
        let Some(k) = keepalived else {
            if file.keepalived.is_none() {
                self.problem(
                    Some(span),
                    "conntrackd",
                    "needs [keepalived]: conntrackd commits the synced flows when keepalived moves a VIP here, and without [keepalived] no VIP moves; add [keepalived] or remove [conntrackd]".into(),
                );
            }
            return None;
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
            None => Some(k.interface.clone()),
            Some(i) => self.interface_name(i, format_args!("conntrackd.interface")),
        };
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
        for (key, path) in [
            ("conntrackd.config_path", &config_path),
            ("conntrackd.notify_script", &notify_script),
            ("conntrackd.socket", &socket),
            ("conntrackd.lock_file", &lock_file),
            ("conntrackd.log_file", &log_file),
            ("conntrackd.state_directory", &state_directory),
        ] {
            // The notify script is shell: a quote or a space in a path
            // would split or end its words.
            let text = path.display().to_string();
            if text.chars().any(|ch| {
                ch.is_whitespace() || ch.is_control() || matches!(ch, '"' | '\'' | '\\' | '$' | '`')
            }) {
                self.problem(
                    Some(span.clone()),
                    key,
                    format!("{text:?} has a space, quote, `$`, backquote or backslash; the notify script names it unquoted, choose a plain path"),
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
            lb.network.is_some()
                && lb.vip.is_ipv4()
                && lb
                    .listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
        });
        if !synced {
            self.warning(
                Some(span),
                "conntrackd",
                "no load balancer on a [[network]] has a listener with forwarding = \"kernel\": conntrackd syncs nothing (only the kernel's flows can be synced; the proxy's connections end when their VIP moves)".into(),
            );
        }
        Some(ConntrackdSettings {
            interface: interface?,
            address: address?,
            peer: peer?,
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
    use crate::config::{Problem, parse};

    const BASE: &str = r#"
[keepalived]
name = "a"
address = "192.168.0.11"
interface = "mgmt0"
peers = ["192.168.0.12"]

[[network]]
name = "vlan100"
interface = "br.100"
prefix_length = 24
gateway = "10.100.0.1"

[[load_balancer]]
name = "default/db"
vip = "10.100.0.50"
network = "vlan100"
# flow_hash: a flow that reaches the other host before its commit still
# finds its backend (round robin is warned about with a moving VIP).
algorithm = "flow_hash"
backends = ["10.100.0.21", "10.100.0.22"]
  [[load_balancer.listener]]
  name = "pg"
  port = 5432
  backend_port = 30432
  forwarding = "kernel"
  source_nat = "none"
"#;

    fn problems(text: &str) -> Vec<Problem> {
        match parse(text) {
            Ok(_) => panic!("should be refused:\n{text}"),
            Err(p) => p,
        }
    }

    #[test]
    fn the_defaults_sync_over_the_management_network_to_the_one_peer() {
        let loaded = parse(&format!("{BASE}\n[conntrackd]\n")).expect("valid");
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
            "{BASE}\n[conntrackd]\ninterface = \"sync0\"\naddress = \"10.99.0.1\"\npeer = \"10.99.0.2\"\n"
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
                "plain path",
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
            let p = problems(&format!("{BASE}\n[conntrackd]\n{line}"));
            assert!(
                p.iter().any(|p| p.key == *key && p.message.contains(says)),
                "{line}: {p:?}"
            );
        }
        // Three hosts: one peer cannot hold a VIP's flows for both others.
        let three = BASE.replace("[\"192.168.0.12\"]", "[\"192.168.0.12\", \"192.168.0.13\"]");
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
        let proxy = BASE
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
}

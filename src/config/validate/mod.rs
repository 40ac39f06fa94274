//! One pass from the file layer to the runtime types, collecting every problem.
//!
//! Harvester's defaults live here as named constants, so the README, the
//! example config and the code cannot disagree silently (the tests load the
//! example and compare).
//!
//! This file holds the pass itself and the checks every table shares
//! (integers in range, choices, addresses); `load_balancer` checks a
//! `[[load_balancer]]` table and its listeners, `health` a health check,
//! `source_ranges` the client CIDRs, and `locate` turns positions into the
//! key paths and line numbers a problem is reported with.

use std::collections::HashSet;
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::num::{NonZeroU32, NonZeroUsize};
use std::ops::Range;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;
use toml::de::DeTable;

use super::file::{FileConfig, FileLoadBalancer};
use super::{
    AdminSettings, Config, ConntrackdSettings, DaemonSettings, IsolateAction, LoadBalancerSpec,
    Loaded, LogSettings, MetricsSettings, Problem, ProxySettings, VipSettings,
};

mod announce;
mod cross;
mod dhcp;
mod health;
mod hosts;
mod keepalived;
mod kernel;
mod load_balancer;
mod locate;
mod names;
mod reuse;
mod source_ranges;
mod suggest;
mod sync;
mod types;
mod vmnet;
mod vmnet_isolate;

pub use cross::Conflict;
use locate::{LineIndex, display_path, path_at, segments, span_of};
pub use names::conf_word_problem;
pub use names::{MAX_CLUSTER_BYTES, MAX_LISTENER_NAME_BYTES, MAX_NAME_BYTES};
pub(crate) use reuse::{Known, parse_reusing};

/// Default admin listener: loopback only, so metrics are not exposed by accident.
pub const DEFAULT_ADMIN_LISTEN: &str = "127.0.0.1:9901";
/// Default admin socket, in the directory the systemd unit's
/// `RuntimeDirectory=harvester-lb` creates (mode 0700).
pub const DEFAULT_ADMIN_SOCKET: &str = "/run/harvester-lb/admin.sock";
/// Longest Unix socket path the kernel takes (`sun_path` is 108 bytes with
/// its terminating NUL).
const MAX_SOCKET_PATH_BYTES: usize = 107;

/// What is wrong with `path` as `admin.socket`, if anything (the text
/// follows the quoted value). One verdict for the daemon and for the admin
/// commands, which read this key alone (`config::admin_endpoints`).
pub fn admin_socket_problem(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        Some("is not an absolute path; write e.g. \"/run/harvester-lb/admin.sock\"".to_string())
    } else if path.len() > MAX_SOCKET_PATH_BYTES {
        Some(format!(
            "is {} bytes long; a Unix socket path takes at most {MAX_SOCKET_PATH_BYTES}",
            path.len()
        ))
    } else if path.ends_with('/') || path.contains('\0') {
        Some("is not a file path (it ends with \"/\" or holds a NUL byte)".to_string())
    } else {
        None
    }
}
/// Default `listen(2)` backlog (the kernel caps it at `net.core.somaxconn`).
pub const DEFAULT_BACKLOG: i64 = 4096;
/// Upper bound of `listener.defer_accept_seconds`: ten minutes. The kernel
/// turns the value into SYN-ACK retransmissions (1, 3, 7, 15, 31, 63 s…), and
/// a client that has said nothing for longer is better handed over (and
/// timed out by the backend) than held in the handshake queue.
pub const MAX_DEFER_ACCEPT_SECONDS: i64 = 600;
/// Default drain timeout, seconds.
pub const DEFAULT_DRAIN_TIMEOUT_SECONDS: i64 = 30;
/// Default guest cluster name, as in Harvester's cloud provider.
pub const DEFAULT_CLUSTER: &str = "kubernetes";
/// Default connect timeout to a backend, milliseconds.
pub const DEFAULT_CONNECT_TIMEOUT_MS: i64 = 3000;
/// Default idle timeout, seconds (one hour).
pub const DEFAULT_IDLE_TIMEOUT_SECONDS: i64 = 3600;
/// Kubernetes' default `sessionAffinityConfig.clientIP.timeoutSeconds` (three hours).
pub const DEFAULT_AFFINITY_TIMEOUT_SECONDS: i64 = 10_800;
/// Kubernetes' upper bound on that timeout (one day).
pub const MAX_AFFINITY_TIMEOUT_SECONDS: i64 = 86_400;
/// Default bound on client-affinity entries, all load balancers together
/// (about 90 MiB at the measured 94 bytes per entry; see the README).
pub const DEFAULT_MAX_AFFINITY_ENTRIES: i64 = 1_000_000;
/// Default idle timeout of a UDP flow, seconds (as common conntrack setups).
pub const DEFAULT_UDP_IDLE_TIMEOUT_SECONDS: i64 = 60;
/// Default cap on one client address's flows on one UDP listener: a client
/// flooding new source ports fills this much of the flow table, no more.
pub const DEFAULT_MAX_UDP_FLOWS_PER_SOURCE: i64 = 1024;
/// `log.max_connection_lines_per_second` when unset: a busy load balancer
/// logging every connection is cut here, below journald's default
/// `RateLimitBurst` (10,000 in 30 s) only over a burst.
pub const DEFAULT_MAX_CONNECTION_LINES_PER_SECOND: i64 = 1000;
/// Upper bound on `udp_responses`: more answers per datagram than any
/// protocol sends is a typo.
const MAX_UDP_RESPONSES: i64 = 65_535;
/// Harvester's `healthcheck-success-threshold` default.
pub const DEFAULT_SUCCESS_THRESHOLD: i64 = 1;
/// Harvester's `healthcheck-failure-threshold` default.
pub const DEFAULT_FAILURE_THRESHOLD: i64 = 3;
/// Harvester's `healthcheck-periodseconds` default.
pub const DEFAULT_PERIOD_SECONDS: i64 = 5;
/// Harvester's `healthcheck-timeoutseconds` default.
pub const DEFAULT_TIMEOUT_SECONDS: i64 = 3;

/// Default request path of an HTTP check: kube-proxy's health endpoint.
pub const DEFAULT_HTTP_PATH: &str = "/healthz";
/// Default healthy status of an HTTP check: kube-proxy answers 200 when the
/// node has a ready endpoint and 503 when it has none.
pub const DEFAULT_EXPECT_STATUS: u16 = 200;
/// Status codes an `expect_status` item may name (RFC 9110's classes).
const STATUS_CODES: std::ops::RangeInclusive<u16> = 100..=599;
/// Longest `path` accepted: a probe request stays one small segment.
const MAX_PATH_BYTES: usize = 1024;
/// Longest `host` accepted: a DNS name is at most 253 bytes, plus a port.
const MAX_HOST_BYTES: usize = 260;

/// Upper bound on any duration key, so a typo such as an extra zero does not
/// overflow arithmetic downstream: one year.
const MAX_SECONDS: i64 = 365 * 24 * 3600;

pub(super) fn parse(text: &str) -> Result<Loaded, Vec<Problem>> {
    let lines = LineIndex::new(text);
    if text.trim().is_empty() {
        // Most likely a truncated write; running it would drain every service.
        return Err(vec![Problem {
            line: None,
            key: String::new(),
            message: "the file is empty (a truncated write?); to run with no load balancers on purpose, write `load_balancer = []`".into(),
        }]);
    }
    let parse = || DeTable::parse(text).map_err(|e| vec![lines.toml_error(&e, String::new())]);
    let root = parse()?;

    // The document is deserialized from the parsed tree itself, not a copy
    // (a copy cost a tenth of a 10,000-load-balancer reload); the rare
    // broken file is parsed again to find where its problems are, and one
    // with a type error is read piece by piece to find all of them.
    let mut unknown: Vec<Vec<String>> = Vec::new();
    let deserializer = toml::de::Deserializer::from(root);
    let typed = match serde_ignored::deserialize(deserializer, |path| {
        unknown.push(segments(&path));
    }) {
        Ok(file) => types::Typed {
            file,
            problems: Vec::new(),
            removed: HashSet::new(),
            unknown,
        },
        Err(e) => {
            let key = match (e.span(), parse()) {
                (Some(span), Ok(root)) => display_path(&path_at(root.get_ref(), span.start)),
                _ => String::new(),
            };
            types::each_piece(text, &lines, lines.toml_error(&e, key))
        }
    };

    let mut v = Validator {
        lines: &lines,
        problems: typed.problems,
        warnings: Vec::new(),
        notes: Vec::new(),
        removed: typed.removed,
    };
    let root = if typed.unknown.is_empty() {
        None
    } else {
        parse().ok()
    };
    for path in typed.unknown {
        let span = root.as_ref().and_then(|r| span_of(r.get_ref(), &path));
        let hint = match path.split_last() {
            Some((key, parent)) => suggest::did_you_mean_key(key, suggest::keys_of(parent)),
            None => String::new(),
        };
        v.problem(span, &display_path(&path), format!("unknown key{hint}"));
    }
    let config = v.config(&typed.file);
    if v.problems.is_empty() {
        Ok(Loaded {
            config,
            warnings: v.warnings,
            notes: v.notes,
            reused: 0,
        })
    } else {
        v.problems.sort_by_key(|p| p.line.unwrap_or(usize::MAX));
        Err(v.problems)
    }
}

/// The file's sections as [`Validator::sections`] built them.
struct Sections {
    /// Everything but `load_balancers` and `conntrackd`.
    config: Config,
    /// The names of the `[[network]]`s that were valid enough to be named.
    network_names: HashSet<String>,
}

struct Validator<'a> {
    lines: &'a LineIndex,
    problems: Vec<Problem>,
    warnings: Vec<Problem>,
    /// What was taken as meant but written otherwise (Kubernetes'
    /// spellings): told by `check`, never a reason to refuse.
    notes: Vec<Problem>,
    /// Key paths of values removed for a type error ([`types`]): already
    /// reported, so not reported again as missing.
    removed: HashSet<String>,
}

/// What an address is for, to say why a special address cannot be it.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Role {
    Vip,
    Backend,
}

impl Validator<'_> {
    fn problem(&mut self, span: Option<Range<usize>>, key: &str, message: String) {
        self.problems.push(Problem {
            line: span.map(|s| self.lines.line(s.start)),
            key: key.to_string(),
            message,
        });
    }

    /// A required key that is absent: `table` is the table's key path and
    /// `span` its place; `what` says what the key is for.
    fn missing(&mut self, span: Range<usize>, table: &str, name: &str, what: &str) {
        if !self.removed.contains(&format!("{table}.{name}")) {
            self.problem(Some(span), table, format!("missing key `{name}` ({what})"));
        }
    }

    fn warning(&mut self, span: Option<Range<usize>>, key: &str, message: String) {
        self.warnings.push(Problem {
            line: span.map(|s| self.lines.line(s.start)),
            key: key.to_string(),
            message,
        });
    }

    /// The whole file: its sections, each load balancer, then the checks
    /// [`across`](Self::across) them.
    fn config(&mut self, file: &FileConfig) -> Config {
        let sections = self.sections(file);
        let mut specs = Vec::with_capacity(file.load_balancers.len());
        for (i, lb) in file.load_balancers.iter().enumerate() {
            specs.push(self.load_balancer(&format!("load_balancer[{i}]"), lb));
        }
        let conntrackd = self.across(file, &sections, &mut specs);
        let mut config = sections.config;
        config.conntrackd = conntrackd;
        config.load_balancers = specs.into_iter().flatten().map(Arc::new).collect();
        config
    }

    /// Every section but the load balancers and `[conntrackd]` (which
    /// [`across`](Self::across) builds): what each load balancer is
    /// checked against.
    fn sections(&mut self, file: &FileConfig) -> Sections {
        let admin = self.admin(file);
        let backlog = self.int(
            &file.proxy.backlog,
            format_args!("proxy.backlog"),
            DEFAULT_BACKLOG,
            1,
            65535,
        );
        let drain = self.int(
            &file.proxy.drain_timeout_seconds,
            format_args!("proxy.drain_timeout_seconds"),
            DEFAULT_DRAIN_TIMEOUT_SECONDS,
            0,
            MAX_SECONDS,
        );
        let max_connections = file.proxy.max_connections.as_ref().map(|_| {
            self.int(
                &file.proxy.max_connections,
                format_args!("proxy.max_connections"),
                1,
                1,
                10_000_000,
            )
        });

        let max_affinity_entries = self.int(
            &file.proxy.max_affinity_entries,
            format_args!("proxy.max_affinity_entries"),
            DEFAULT_MAX_AFFINITY_ENTRIES,
            0,
            100_000_000,
        );

        let vip = VipSettings {
            isolate: file.vip.isolate.as_ref().is_some_and(|v| *v.get_ref()),
            isolate_action: self.choice(
                &file.vip.isolate_action,
                format_args!("vip.isolate_action"),
                &[
                    ("drop", IsolateAction::Drop),
                    ("reject", IsolateAction::Reject),
                ],
                IsolateAction::Drop,
            ),
            announce: self.announce(&file.vip),
        };
        if !vip.isolate
            && let Some(a) = &file.vip.isolate_action
        {
            self.warning(
                Some(a.span()),
                "vip.isolate_action",
                "has no effect without vip.isolate = true".into(),
            );
        }
        let max_udp_flows = file.proxy.max_udp_flows.as_ref().map(|_| {
            self.int(
                &file.proxy.max_udp_flows,
                format_args!("proxy.max_udp_flows"),
                1,
                1,
                10_000_000,
            )
        });
        let max_udp_flows_per_source = self.int(
            &file.proxy.max_udp_flows_per_source,
            format_args!("proxy.max_udp_flows_per_source"),
            DEFAULT_MAX_UDP_FLOWS_PER_SOURCE,
            1,
            10_000_000,
        );

        let dhcp = self.dhcp_settings(&file.dhcp);
        let max_connection_lines = self.int(
            &file.log.max_connection_lines_per_second,
            format_args!("log.max_connection_lines_per_second"),
            DEFAULT_MAX_CONNECTION_LINES_PER_SECOND,
            1,
            1_000_000,
        );

        let (networks, network_names) = self.networks(file, &vip);
        let keepalived = self.keepalived(file, &vip);
        self.management_table_clash(file, &networks, keepalived.as_ref());
        let daemon = DaemonSettings {
            state_file: file.daemon.state_file.as_ref().map(|v| {
                let p = v.get_ref();
                if !p.starts_with('/') || p.ends_with('/') || p.contains('\0') {
                    self.problem(
                        Some(v.span()),
                        "daemon.state_file",
                        format!(
                            "{p:?} is not an absolute file path; write e.g. \"/var/lib/harvester-lb/state.json\""
                        ),
                    );
                }
                PathBuf::from(p)
            }),
        };
        let config = Config {
            admin,
            daemon,
            proxy: ProxySettings {
                backlog: backlog as u32,
                drain_timeout: Duration::from_secs(drain as u64),
                max_connections: max_connections
                    .and_then(|n| NonZeroUsize::new(usize::try_from(n).unwrap_or(1))),
                max_affinity_entries: usize::try_from(max_affinity_entries).unwrap_or(0),
                max_udp_flows: max_udp_flows
                    .and_then(|n| NonZeroUsize::new(usize::try_from(n).unwrap_or(1))),
                max_udp_flows_per_source: NonZeroUsize::new(
                    usize::try_from(max_udp_flows_per_source).unwrap_or(1),
                )
                .unwrap_or(NonZeroUsize::MIN),
            },
            metrics: MetricsSettings {
                per_backend_health_check_duration: file
                    .metrics
                    .per_backend_health_check_duration
                    .as_ref()
                    .is_some_and(|v| *v.get_ref()),
            },
            vip,
            dhcp,
            log: LogSettings {
                max_connection_lines_per_second: NonZeroU32::new(max_connection_lines as u32)
                    .unwrap_or(NonZeroU32::MIN),
            },
            load_balancers: Vec::new(),
            networks,
            keepalived,
            conntrackd: None,
        };
        Sections {
            config,
            network_names,
        }
    }

    /// Every check that reads more than one table: load balancers against
    /// each other, and against `[vip]`, `[[network]]`, `[keepalived]` and
    /// `[conntrackd]`; builds `[conntrackd]` (it depends on the load
    /// balancers). `specs[i]` is `file.load_balancers[i]`'s, `None` when it
    /// could not be built. Both reads run it over the whole file
    /// ([`reuse`] over its assembled tables), so no check lives in one
    /// read only: a check that spans sections belongs here.
    fn across(
        &mut self,
        file: &FileConfig,
        sections: &Sections,
        specs: &mut [Option<LoadBalancerSpec>],
    ) -> Option<ConntrackdSettings> {
        let config = &sections.config;
        let (admin, vip, keepalived) = (&config.admin, &config.vip, config.keepalived.as_ref());
        let names: Vec<Option<&str>> = file
            .load_balancers
            .iter()
            .map(|lb| valid_name(lb.get_ref()))
            .collect();
        let built: Vec<Option<&LoadBalancerSpec>> = specs.iter().map(Option::as_ref).collect();
        let found = cross::conflicts(admin.listen, &names, &built);
        self.report_conflicts(admin.listen, file, specs, found);
        self.announce_conflicts(&vip.announce, file, specs);
        self.network_conflicts(
            file,
            specs,
            &config.networks,
            &sections.network_names,
            keepalived,
            vip,
        );
        self.moving_vips(file, specs, &vip.announce, keepalived);
        self.network_isolation(file, &config.networks, keepalived);
        let conntrackd = self.conntrackd(file, keepalived, specs, &vip.announce);
        self.vips_that_are_hosts(file, config, conntrackd.as_ref(), specs);
        conntrackd
    }

    /// `[admin]`: where the admin API listens and its Unix socket's path.
    fn admin(&mut self, file: &FileConfig) -> AdminSettings {
        let admin_listen = match &file.admin.listen {
        None => DEFAULT_ADMIN_LISTEN.parse().expect("default admin address parses"),
        Some(s) => s.get_ref().parse::<SocketAddr>().unwrap_or_else(|_| {
            self.problem(
                Some(s.span()),
                "admin.listen",
                format!(
                    "{:?} is not a socket address; write IP:PORT, e.g. \"127.0.0.1:9901\" or \"[::1]:9901\"",
                    s.get_ref()
                ),
            );
            DEFAULT_ADMIN_LISTEN.parse().expect("default admin address parses")
        }),
    };
        let admin_socket = match &file.admin.socket {
            None => PathBuf::from(DEFAULT_ADMIN_SOCKET),
            Some(s) => {
                let path = s.get_ref();
                if let Some(p) = admin_socket_problem(path) {
                    self.problem(Some(s.span()), "admin.socket", format!("{path:?} {p}"));
                }
                PathBuf::from(path)
            }
        };
        AdminSettings {
            listen: admin_listen,
            socket: admin_socket,
        }
    }

    fn required_port(
        &mut self,
        value: &Option<Spanned<i64>>,
        table_span: Range<usize>,
        table_key: &str,
        name: &str,
        meaning: &str,
    ) -> Option<u16> {
        match value {
            None => {
                self.missing(table_span, table_key, name, meaning);
                None
            }
            Some(_) => {
                let n = self.int(value, format_args!("{table_key}.{name}"), 0, 1, 65535);
                u16::try_from(n).ok().filter(|&p| p != 0)
            }
        }
    }

    /// An integer key in `min..=max`; `default` when absent (and after a problem).
    fn int(
        &mut self,
        value: &Option<Spanned<i64>>,
        key: fmt::Arguments<'_>,
        default: i64,
        min: i64,
        max: i64,
    ) -> i64 {
        let Some(v) = value else { return default };
        let n = *v.get_ref();
        if (min..=max).contains(&n) {
            n
        } else {
            let key = key.to_string();
            let what = if key.ends_with("port") {
                "a port"
            } else {
                "the value"
            };
            self.problem(
                Some(v.span()),
                &key,
                format!("{n} is out of range; {what} must be in {min}..={max}"),
            );
            // Returning 0 makes a required value (a port) fail to build, and
            // a defaulted one harmlessly fall back: either way the problem is reported.
            if key.ends_with("port") { 0 } else { default }
        }
    }

    /// An IP address, IPv4-mapped IPv6 (`::ffff:a.b.c.d`) written as the
    /// IPv4 address it is: one node is one address everywhere (duplicates,
    /// `/status`, metric labels), whichever way the controller wrote it.
    fn ip(&mut self, value: &Spanned<String>, key: fmt::Arguments<'_>) -> Option<IpAddr> {
        match value.get_ref().parse::<IpAddr>() {
            Ok(ip) => Some(ip.to_canonical()),
            Err(_) => {
                self.problem(
                    Some(value.span()),
                    &key.to_string(),
                    format!("{:?} is not an IPv4 or IPv6 address", value.get_ref()),
                );
                None
            }
        }
    }

    /// Whether `ip` can be one node's or one VIP's address: not the
    /// unspecified address (a VIP there binds every address of the host, a
    /// backend there is this host), not multicast, not the IPv4 broadcast,
    /// not the cloud metadata address, not class E. Loopback stays legal:
    /// the file is trusted, and tests and the demo run on it.
    fn unicast(
        &mut self,
        ip: IpAddr,
        value: &Spanned<String>,
        key: fmt::Arguments<'_>,
        role: Role,
    ) -> bool {
        let what = if ip.is_unspecified() {
            match role {
                Role::Vip => {
                    "the unspecified address: the listeners would bind every address of this host. Harvester writes it for a DHCP VIP: set ipam = \"dhcp\" and a [load_balancer.dhcp] table to lease one, or give the VIP's own address"
                }
                Role::Backend => {
                    "the unspecified address, which connects to this host itself; give the node's own address"
                }
            }
        } else if ip.is_multicast() {
            "a multicast address; TCP needs one unicast address"
        } else if ip == IpAddr::V4(std::net::Ipv4Addr::BROADCAST) {
            "the broadcast address; TCP needs one unicast address"
        } else if is_metadata(ip) {
            "the cloud metadata address (instance credentials and configuration are served there); no node or VIP has it"
        } else if matches!(ip, IpAddr::V4(v4) if v4.octets()[0] >= 240) {
            "in 240.0.0.0/4 (class E, reserved): no host has it, and Linux routes it on some hosts only"
        } else {
            return true;
        };
        let role = match role {
            Role::Vip => "a VIP",
            Role::Backend => "a backend",
        };
        self.problem(
            Some(value.span()),
            &key.to_string(),
            format!("{:?} cannot be {role}: it is {what}", value.get_ref()),
        );
        false
    }

    fn choice<T: Copy>(
        &mut self,
        value: &Option<Spanned<String>>,
        key: fmt::Arguments<'_>,
        allowed: &[(&str, T)],
        default: T,
    ) -> T {
        let Some(v) = value else { return default };
        if let Some((_, t)) = allowed.iter().find(|(name, _)| *name == v.get_ref()) {
            return *t;
        }
        let words: Vec<&str> = allowed.iter().map(|(n, _)| *n).collect();
        let key = key.to_string();
        if let Some(meant) = self.spelled_otherwise(v, &key, &words)
            && let Some((_, t)) = allowed.iter().find(|(name, _)| *name == meant)
        {
            return *t;
        }
        let message = self.not_one_of(v.get_ref(), &words);
        self.problem(Some(v.span()), &key, message);
        default
    }

    /// The allowed word `v` means when it is written in another case or
    /// without `_` (Kubernetes' `"TCP"`, `"ClientIP"`), told as a note.
    fn spelled_otherwise<'w>(
        &mut self,
        v: &Spanned<String>,
        key: &str,
        allowed: &[&'w str],
    ) -> Option<&'w str> {
        let meant = suggest::same_spelling(v.get_ref(), allowed)?;
        self.notes.push(Problem {
            line: Some(self.lines.line(v.span().start)),
            key: key.to_string(),
            message: format!(
                "{:?} taken as {meant:?} (the same value in Kubernetes' spelling); this file spells it {meant:?}",
                v.get_ref()
            ),
        });
        Some(meant)
    }

    /// "`value` is not supported; use one of …", with the nearest allowed
    /// value when it looks like a typo of one.
    fn not_one_of(&self, value: &str, allowed: &[&str]) -> String {
        let names: Vec<String> = allowed.iter().map(|n| format!("{n:?}")).collect();
        let near: Vec<String> = suggest::nearest(value, allowed)
            .iter()
            .map(|n| format!("{n:?}"))
            .collect();
        let hint = if near.is_empty() {
            String::new()
        } else {
            format!(" (did you mean {}?)", near.join(" or "))
        };
        format!(
            "{value:?} is not supported{hint}; use one of {}",
            names.join(", ")
        )
    }
}

/// Every conflict among `lbs` as one file: the rules that span load
/// balancers, with `admin` as `admin.listen`. Indices are into `lbs`.
pub fn conflicts(admin: SocketAddr, lbs: &[&LoadBalancerSpec]) -> Vec<Conflict> {
    let names: Vec<Option<&str>> = lbs.iter().map(|l| Some(l.name.as_str())).collect();
    let specs: Vec<Option<&LoadBalancerSpec>> = lbs.iter().map(|l| Some(*l)).collect();
    cross::conflicts(admin, &names, &specs)
}

/// The link-local address clouds serve instance metadata on (IPv4, and
/// AWS's IPv6 one): never a node's or a VIP's, and a config naming it would
/// forward clients to this host's credentials.
fn is_metadata(ip: IpAddr) -> bool {
    const V4: IpAddr = IpAddr::V4(std::net::Ipv4Addr::new(169, 254, 169, 254));
    const V6: IpAddr = IpAddr::V6(std::net::Ipv6Addr::new(0xfd00, 0xec2, 0, 0, 0, 0, 0, 0x254));
    ip == V4 || ip == V6
}

/// A load balancer's name if it has a usable one: the key duplicate names
/// are found by, whether or not the rest of the table is valid.
fn valid_name(lb: &FileLoadBalancer) -> Option<&str> {
    lb.name
        .as_ref()
        .map(|n| n.get_ref().as_str())
        .filter(|n| !n.trim().is_empty() && names::name_problem(n, MAX_NAME_BYTES).is_none())
}

//! One pass from the file layer to the runtime types, collecting every problem.
//!
//! Harvester's defaults live here as named constants, so the README, the
//! example config and the code cannot disagree silently (the tests load the
//! example and compare).
//!
//! This file holds the pass itself and the checks every table shares
//! (integers in range, choices, addresses); `health` checks a health
//! check, `source_ranges` the client CIDRs, and `locate` turns positions
//! into the key paths and line numbers a problem is reported with.

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

use super::file::{FileConfig, FileListener, FileLoadBalancer};
use super::{
    AdminSettings, Algorithm, Config, ConntrackdSettings, DaemonSettings, HealthCheckSpec,
    InitialState, Ipam, IsolateAction, ListenerSpec, LoadBalancerSpec, Loaded, LogConnections,
    LogSettings, MetricsSettings, OnBackendDown, Problem, Protocol, ProxyProtocol, ProxySettings,
    UdpSettings, VipSettings,
};

mod announce;
mod cross;
mod dhcp;
mod health;
mod hosts;
mod kernel;
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

    /// Checks `[[load_balancer]]`; `None` when it is too broken to build.
    fn load_balancer(
        &mut self,
        key: &str,
        lb: &Spanned<FileLoadBalancer>,
    ) -> Option<LoadBalancerSpec> {
        let table_span = lb.span();
        let lb = lb.get_ref();
        let name = self.lb_name(key, table_span.clone(), lb);
        let cluster = self.cluster(key, lb);
        let ipam = self.choice(
            &lb.ipam,
            format_args!("{key}.ipam"),
            &Ipam::ALL.map(|i| (i.as_str(), i)),
            Ipam::Pool,
        );
        // Leased by this daemon: `ipam = "dhcp"` with a `[load_balancer.dhcp]`
        // table. Without the table a DHCP VIP is leased elsewhere (as
        // before this daemon could lease) and `vip` must be its address.
        let leased = ipam == Ipam::Dhcp && lb.dhcp.is_some();
        let vip = self.vip(key, table_span.clone(), lb, leased);
        let dhcp = self.dhcp(key, lb, ipam);
        let algorithm = self.choice(
            &lb.algorithm,
            format_args!("{key}.algorithm"),
            &Algorithm::ALL.map(|a| (a.as_str(), a)),
            Algorithm::RoundRobin,
        );
        let initial_state = self.choice(
            &lb.initial_state,
            format_args!("{key}.initial_state"),
            &[
                ("healthy", InitialState::Healthy),
                ("unhealthy", InitialState::Unhealthy),
            ],
            InitialState::Healthy,
        );
        let connect_timeout_ms = self.int(
            &lb.connect_timeout_ms,
            format_args!("{key}.connect_timeout_ms"),
            DEFAULT_CONNECT_TIMEOUT_MS,
            1,
            MAX_SECONDS * 1000,
        );
        let connect_attempts = lb.connect_attempts.as_ref().map(|_| {
            self.int(
                &lb.connect_attempts,
                format_args!("{key}.connect_attempts"),
                1,
                1,
                1_000_000,
            )
        });
        let idle_timeout = self.int(
            &lb.idle_timeout_seconds,
            format_args!("{key}.idle_timeout_seconds"),
            DEFAULT_IDLE_TIMEOUT_SECONDS,
            1,
            MAX_SECONDS,
        );

        let affinity_timeout = self.affinity(key, lb);
        let on_backend_down = self.on_backend_down(key, lb);
        let log_connections = self.choice(
            &lb.log_connections,
            format_args!("{key}.log_connections"),
            &[
                ("none", LogConnections::None),
                ("errors", LogConnections::Errors),
                ("all", LogConnections::All),
            ],
            LogConnections::None,
        );

        let backends = self.backends(key, table_span.clone(), lb);
        let listeners = self.listeners(key, table_span.clone(), lb);
        self.kernel_combinations(key, lb, vip, algorithm, &listeners);
        let health_check = self.lb_health_check(key, lb, &listeners);
        let source_ranges = self.source_ranges(key, table_span.clone(), &lb.source_ranges, vip);
        let udp = self.udp(key, lb);
        let (max_connections, max_udp_flows) = self.limits(key, lb);

        Some(LoadBalancerSpec {
            name: name?,
            cluster,
            vip: vip?,
            ipam,
            dhcp: if leased { Some(dhcp?) } else { None },
            // Set by `network_conflicts` once the network is known.
            network: None,
            backends,
            algorithm,
            initial_state,
            connect_timeout: Duration::from_millis(connect_timeout_ms as u64),
            connect_attempts: connect_attempts.and_then(|n| NonZeroU32::new(n as u32)),
            idle_timeout: Duration::from_secs(idle_timeout as u64),
            affinity_timeout,
            on_backend_down,
            log_connections,
            listeners,
            health_check,
            source_ranges,
            udp,
            max_connections,
            max_udp_flows,
        })
    }

    /// `session_affinity` and `affinity_timeout_seconds`: how long a client
    /// keeps its backend, `None` when affinity is off.
    fn affinity(&mut self, key: &str, lb: &FileLoadBalancer) -> Option<Duration> {
        let affinity = self.choice(
            &lb.session_affinity,
            format_args!("{key}.session_affinity"),
            &[("none", false), ("client_ip", true)],
            false,
        );
        let affinity_timeout = self.int(
            &lb.affinity_timeout_seconds,
            format_args!("{key}.affinity_timeout_seconds"),
            DEFAULT_AFFINITY_TIMEOUT_SECONDS,
            1,
            MAX_AFFINITY_TIMEOUT_SECONDS,
        );
        if !affinity && let Some(t) = &lb.affinity_timeout_seconds {
            self.warning(
                Some(t.span()),
                &format!("{key}.affinity_timeout_seconds"),
                "has no effect without session_affinity = \"client_ip\"".into(),
            );
        }
        affinity.then(|| Duration::from_secs(affinity_timeout as u64))
    }

    /// `on_backend_down`, warned when no health check can mark one down.
    fn on_backend_down(&mut self, key: &str, lb: &FileLoadBalancer) -> OnBackendDown {
        let on_backend_down = self.choice(
            &lb.on_backend_down,
            format_args!("{key}.on_backend_down"),
            &[
                ("keep", OnBackendDown::Keep),
                ("close", OnBackendDown::Close),
            ],
            OnBackendDown::Keep,
        );
        if on_backend_down == OnBackendDown::Close
            && lb.health_check.is_none()
            && let Some(v) = &lb.on_backend_down
        {
            self.warning(
                Some(v.span()),
                &format!("{key}.on_backend_down"),
                "has no effect without a health_check: no backend is ever marked down".into(),
            );
        }
        on_backend_down
    }

    /// `backends`: unicast addresses, each once.
    fn backends(
        &mut self,
        key: &str,
        table_span: Range<usize>,
        lb: &FileLoadBalancer,
    ) -> Vec<IpAddr> {
        let mut backends = Vec::new();
        let mut seen = HashSet::new();
        for (i, b) in lb.backends.iter().enumerate() {
            let Some(ip) = self.ip(b, format_args!("{key}.backends[{i}]")) else {
                continue;
            };
            if !self.unicast(ip, b, format_args!("{key}.backends[{i}]"), Role::Backend) {
                continue;
            }
            if seen.insert(ip) {
                backends.push(ip);
            } else {
                // Name the written form when it was normalised: the
                // operator looks for the text, not for 127.0.18.2.
                let written = if b.get_ref() == &ip.to_string() {
                    String::new()
                } else {
                    format!(" ({:?} is its IPv4-mapped IPv6 form)", b.get_ref())
                };
                self.problem(
                    Some(b.span()),
                    &format!("{key}.backends[{i}]"),
                    format!("backend {ip} is listed twice{written}"),
                );
            }
        }
        if lb.backends.is_empty() {
            self.warning(
                Some(table_span.clone()),
                &format!("{key}.backends"),
                "no backends: every connection to this load balancer will be refused".into(),
            );
        }
        backends
    }

    /// Every `[[load_balancer.listener]]` that can be built, names unique.
    fn listeners(
        &mut self,
        key: &str,
        table_span: Range<usize>,
        lb: &FileLoadBalancer,
    ) -> Vec<ListenerSpec> {
        let mut listeners = Vec::new();
        let mut listener_names = HashSet::new();
        if lb.listeners.is_empty() {
            self.warning(
                Some(table_span.clone()),
                &format!("{key}.listener"),
                "no listeners: this load balancer accepts nothing".into(),
            );
        }
        for (i, l) in lb.listeners.iter().enumerate() {
            let lkey = format!("{key}.listener[{i}]");
            if let Some(spec) = self.listener(&lkey, l, &mut listener_names) {
                listeners.push(spec);
            }
        }
        listeners
    }

    /// `[load_balancer.health_check]`, warned when it would check nothing.
    fn lb_health_check(
        &mut self,
        key: &str,
        lb: &FileLoadBalancer,
        listeners: &[ListenerSpec],
    ) -> Option<HealthCheckSpec> {
        let health_check = lb
            .health_check
            .as_ref()
            .and_then(|hc| self.health_check(&format!("{key}.health_check"), hc));
        if let (Some(hc), Some(written)) = (&health_check, &lb.health_check)
            && hc.port.is_none()
            && !listeners.is_empty()
            && listeners.iter().all(|l| l.protocol == Protocol::Udp)
        {
            self.warning(
            Some(written.span()),
            &format!("{key}.health_check.port"),
            "missing: without it each TCP listener's nodeport is checked, and this load balancer has only UDP listeners (a UDP port answers no handshake), so nothing is checked and every backend stays in its initial state; give a TCP port of the node (a DNS server answers TCP on its port)".into(),
        );
        }
        health_check
    }

    /// `udp_idle_timeout_seconds` and `udp_responses`.
    fn udp(&mut self, key: &str, lb: &FileLoadBalancer) -> UdpSettings {
        let udp_idle_timeout = self.int(
            &lb.udp_idle_timeout_seconds,
            format_args!("{key}.udp_idle_timeout_seconds"),
            DEFAULT_UDP_IDLE_TIMEOUT_SECONDS,
            1,
            MAX_SECONDS,
        );
        let udp_responses = lb.udp_responses.as_ref().map(|_| {
            self.int(
                &lb.udp_responses,
                format_args!("{key}.udp_responses"),
                1,
                1,
                MAX_UDP_RESPONSES,
            )
        });
        UdpSettings {
            idle_timeout: Duration::from_secs(udp_idle_timeout as u64),
            responses: udp_responses.and_then(|n| NonZeroU32::new(n as u32)),
        }
    }

    /// `max_connections` and `max_udp_flows`: the load balancer's own caps.
    fn limits(
        &mut self,
        key: &str,
        lb: &FileLoadBalancer,
    ) -> (Option<NonZeroUsize>, Option<NonZeroUsize>) {
        let max_connections = lb.max_connections.as_ref().map(|_| {
            self.int(
                &lb.max_connections,
                format_args!("{key}.max_connections"),
                1,
                1,
                10_000_000,
            )
        });
        let max_udp_flows = lb.max_udp_flows.as_ref().map(|_| {
            self.int(
                &lb.max_udp_flows,
                format_args!("{key}.max_udp_flows"),
                1,
                1,
                10_000_000,
            )
        });
        (
            max_connections.and_then(|n| NonZeroUsize::new(usize::try_from(n).unwrap_or(1))),
            max_udp_flows.and_then(|n| NonZeroUsize::new(usize::try_from(n).unwrap_or(1))),
        )
    }

    /// `name`: present, not empty, bounded; `None` when it is not usable.
    fn lb_name(
        &mut self,
        key: &str,
        table_span: Range<usize>,
        lb: &FileLoadBalancer,
    ) -> Option<String> {
        match &lb.name {
            None => {
                self.missing(
                    table_span.clone(),
                    key,
                    "name",
                    "the controller writes <namespace>/<service>",
                );
                None
            }
            Some(n) if n.get_ref().trim().is_empty() => {
                self.problem(
                    Some(n.span()),
                    &format!("{key}.name"),
                    "must not be empty".into(),
                );
                None
            }
            Some(n) => self
                .bounded_name(n, &format!("{key}.name"), MAX_NAME_BYTES)
                .then(|| n.get_ref().clone()),
        }
    }

    /// `cluster`: the default when absent, not empty, bounded.
    fn cluster(&mut self, key: &str, lb: &FileLoadBalancer) -> String {
        match &lb.cluster {
            None => DEFAULT_CLUSTER.to_string(),
            Some(c) if c.get_ref().trim().is_empty() => {
                self.problem(
                    Some(c.span()),
                    &format!("{key}.cluster"),
                    "must not be empty".into(),
                );
                String::new()
            }
            Some(c) => {
                self.bounded_name(c, &format!("{key}.cluster"), MAX_CLUSTER_BYTES);
                c.get_ref().clone()
            }
        }
    }

    /// `vip`: a unicast address, or the unspecified address when the
    /// daemon leases it (`leased`).
    fn vip(
        &mut self,
        key: &str,
        table_span: Range<usize>,
        lb: &FileLoadBalancer,
        leased: bool,
    ) -> Option<IpAddr> {
        match (&lb.vip, leased) {
            // `vip` is absent or what Harvester writes before a lease
            // (`0.0.0.0`); any other address is the one to ask for.
            (_, true) => Some(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED)),
            (None, false) => {
                self.missing(
                table_span.clone(),
                key,
                "vip",
                "the load balancer's IP address; or ipam = \"dhcp\" and a [load_balancer.dhcp] table to lease one",
            );
                None
            }
            (Some(v), false) => self
                .ip(v, format_args!("{key}.vip"))
                .filter(|ip| self.unicast(*ip, v, format_args!("{key}.vip"), Role::Vip)),
        }
    }

    fn listener(
        &mut self,
        key: &str,
        l: &Spanned<FileListener>,
        names: &mut HashSet<String>,
    ) -> Option<ListenerSpec> {
        let span = l.span();
        let l = l.get_ref();
        let name = match &l.name {
            None => {
                self.missing(span.clone(), key, "name", "the service port's name");
                None
            }
            Some(n) => {
                self.bounded_name(n, &format!("{key}.name"), MAX_LISTENER_NAME_BYTES);
                if !names.insert(n.get_ref().clone()) {
                    self.problem(
                        Some(n.span()),
                        &format!("{key}.name"),
                        format!(
                            "duplicate listener name {:?} in this load balancer",
                            n.get_ref()
                        ),
                    );
                }
                Some(n.get_ref().clone())
            }
        };
        let port = self.required_port(&l.port, span.clone(), key, "port", "the port on the VIP");
        let backend_port = self.required_port(
            &l.backend_port,
            span,
            key,
            "backend_port",
            "the service's nodeport on every backend",
        );
        let protocol = self.choice(
            &l.protocol,
            format_args!("{key}.protocol"),
            &Protocol::ALL.map(|p| (p.as_str(), p)),
            Protocol::Tcp,
        );
        let proxy_protocol = self.choice(
            &l.proxy_protocol,
            format_args!("{key}.proxy_protocol"),
            &ProxyProtocol::ALL.map(|p| (p.as_str(), Some(p))),
            None,
        );
        if protocol == Protocol::Udp
            && proxy_protocol.is_some()
            && let Some(v) = &l.proxy_protocol
        {
            self.problem(
                Some(v.span()),
                &format!("{key}.proxy_protocol"),
                format!(
                    "{:?} cannot be sent on a UDP listener: a PROXY protocol header starts a TCP stream, and a datagram carrying one would be garbage to the node; remove it, or use protocol = \"tcp\"",
                    v.get_ref()
                ),
            );
        }
        let defer_accept = match &l.defer_accept_seconds {
            None => None,
            Some(v) if protocol == Protocol::Udp => {
                self.problem(
                    Some(v.span()),
                    &format!("{key}.defer_accept_seconds"),
                    "applies to TCP listeners only: a UDP listener has no handshake to defer; remove it, or use protocol = \"tcp\"".into(),
                );
                None
            }
            Some(_) => {
                let secs = self.int(
                    &l.defer_accept_seconds,
                    format_args!("{key}.defer_accept_seconds"),
                    0,
                    1,
                    MAX_DEFER_ACCEPT_SECONDS,
                );
                (secs > 0).then(|| Duration::from_secs(secs as u64))
            }
        };
        let (forwarding, source_nat) = self.forwarding(key, l);
        Some(ListenerSpec {
            name: name?,
            port: port?,
            backend_port: backend_port?,
            protocol,
            proxy_protocol,
            defer_accept,
            forwarding,
            source_nat,
        })
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

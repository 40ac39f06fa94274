//! `[[load_balancer]]`: one load balancer's table, its listeners and the
//! keys Harvester's annotations map to (name, cluster, VIP, backends,
//! affinity, UDP and limits). Its own file because it is the largest table
//! and the only one checked again alone (`reuse`); the pass and the
//! checks every table shares stay in `mod.rs`.

use std::collections::HashSet;
use std::net::IpAddr;
use std::num::{NonZeroU32, NonZeroUsize};
use std::ops::Range;
use std::time::Duration;

use toml::Spanned;

use super::{
    DEFAULT_AFFINITY_TIMEOUT_SECONDS, DEFAULT_CLUSTER, DEFAULT_CONNECT_TIMEOUT_MS,
    DEFAULT_IDLE_TIMEOUT_SECONDS, DEFAULT_UDP_IDLE_TIMEOUT_SECONDS, MAX_AFFINITY_TIMEOUT_SECONDS,
    MAX_CLUSTER_BYTES, MAX_DEFER_ACCEPT_SECONDS, MAX_LISTENER_NAME_BYTES, MAX_NAME_BYTES,
    MAX_SECONDS, MAX_UDP_RESPONSES, Role, Validator,
};
use crate::config::file::{FileListener, FileLoadBalancer};
use crate::config::{
    Algorithm, HealthCheckSpec, InitialState, Ipam, ListenerSpec, LoadBalancerSpec, LogConnections,
    OnBackendDown, Protocol, ProxyProtocol, UdpSettings,
};

impl Validator<'_> {
    /// Checks `[[load_balancer]]`; `None` when it is too broken to build.
    pub(super) fn load_balancer(
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
}

//! What every source model maps to: one load balancer in our config's
//! terms, and how it is written as TOML.
//!
//! The TOML is written by hand, key by key, in a fixed order, with lists
//! sorted: the same objects give the same bytes in whatever order they came
//! (a timer that re-imports every minute must not make the daemon reload a
//! file that did not change). Strings go through `toml`'s own quoting.

use std::fmt::Write as _;
use std::net::IpAddr;

/// Harvester's health-check defaults (zero or absent fields take them);
/// the same as the config's.
pub const DEFAULT_SUCCESS_THRESHOLD: u32 = 1;
/// See [`DEFAULT_SUCCESS_THRESHOLD`].
pub const DEFAULT_FAILURE_THRESHOLD: u32 = 3;
/// See [`DEFAULT_SUCCESS_THRESHOLD`].
pub const DEFAULT_PERIOD_SECONDS: u32 = 5;
/// See [`DEFAULT_SUCCESS_THRESHOLD`].
pub const DEFAULT_TIMEOUT_SECONDS: u32 = 3;

/// The guest cluster of a load balancer that names none (the config's default).
pub const DEFAULT_CLUSTER: &str = "kubernetes";

/// One `[[load_balancer]]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Lb {
    /// `<namespace>/<name>`.
    pub name: String,
    /// The owning guest cluster.
    pub cluster: String,
    /// The VIP.
    pub vip: IpAddr,
    /// `pool` or `dhcp`.
    pub ipam: &'static str,
    /// Node addresses (sorted and deduplicated when written).
    pub backends: Vec<IpAddr>,
    /// VIP port -> nodeport.
    pub listeners: Vec<Listener>,
    /// The health check, if any.
    pub health_check: Option<Check>,
    /// `sessionAffinity: ClientIP`.
    pub client_ip_affinity: bool,
    /// `sessionAffinityConfig.clientIP.timeoutSeconds`, if given.
    pub affinity_timeout_seconds: Option<u32>,
    /// `loadBalancerSourceRanges`, normalised (`a.b.c.d/n` without host bits).
    pub source_ranges: Vec<ipnet::IpNet>,
    /// The `[[network]]` its VIP lives on (`loadbalancer.harvesterhci.io/network`).
    pub network: Option<String>,
    /// Leased by this daemon (`ipam = "dhcp"` on a network): an empty
    /// `[load_balancer.dhcp]` table is written, so the lease's macvlan is
    /// made on the network's interface.
    pub leased: bool,
    /// Written on each listener: the import's `--forwarding` and
    /// `--source-nat`.
    pub forwarding: super::ListenerChoice,
}

/// One `[[network]]` the import writes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Network {
    /// Its name, as load balancers reference it (`namespace/name` of the
    /// NetworkAttachmentDefinition).
    pub name: String,
    /// The host interface on that L2.
    pub interface: String,
    /// The subnet's prefix length.
    pub prefix_length: u8,
    /// The network's router.
    pub gateway: std::net::Ipv4Addr,
    /// The IPv6 subnet's prefix length and router, when the objects say
    /// them: with them the network takes IPv6 VIPs.
    pub ipv6: Option<(u8, std::net::Ipv6Addr)>,
}

impl Network {
    /// Appends this network as a `[[network]]` table.
    pub fn write_toml(&self, out: &mut String) {
        let _ = writeln!(out, "[[network]]");
        let _ = writeln!(out, "name = {}", quote(&self.name));
        let _ = writeln!(out, "interface = {}", quote(&self.interface));
        let _ = writeln!(out, "prefix_length = {}", self.prefix_length);
        let _ = writeln!(out, "gateway = {}", quote(&self.gateway.to_string()));
        if let Some((prefix_length, gateway)) = self.ipv6 {
            let _ = writeln!(out, "ipv6_prefix_length = {prefix_length}");
            let _ = writeln!(out, "ipv6_gateway = {}", quote(&gateway.to_string()));
        }
    }
}

/// One `[[load_balancer.listener]]`.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Listener {
    /// Port on the VIP (first: the sort key).
    pub port: u16,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
    /// The service port's name.
    pub name: String,
    /// The nodeport.
    pub backend_port: u16,
}

/// `[load_balancer.health_check]`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Check {
    /// `tcp` or `http`.
    pub kind: &'static str,
    /// The probed port; `None` only where the config accepts a check
    /// without one.
    pub port: Option<u16>,
    /// Consecutive successes to become healthy.
    pub success_threshold: u32,
    /// Consecutive failures to become unhealthy.
    pub failure_threshold: u32,
    /// Seconds between probes.
    pub period_seconds: u32,
    /// Seconds a probe may take.
    pub timeout_seconds: u32,
}

impl Check {
    /// A check of `port` with Harvester's defaults for every value not given.
    pub fn with_defaults(
        kind: &'static str,
        port: Option<u16>,
        thresholds: [Option<u32>; 4],
    ) -> Self {
        let [s, f, p, t] = thresholds;
        Self {
            kind,
            port,
            success_threshold: s.unwrap_or(DEFAULT_SUCCESS_THRESHOLD),
            failure_threshold: f.unwrap_or(DEFAULT_FAILURE_THRESHOLD),
            period_seconds: p.unwrap_or(DEFAULT_PERIOD_SECONDS),
            timeout_seconds: t.unwrap_or(DEFAULT_TIMEOUT_SECONDS),
        }
    }
}

impl Lb {
    /// Sorts and deduplicates every list, so equal load balancers are equal
    /// values and are written as equal bytes.
    pub fn normalise(&mut self) {
        self.backends
            .iter_mut()
            .for_each(|ip| *ip = ip.to_canonical());
        self.backends.sort_unstable();
        self.backends.dedup();
        self.listeners.sort();
        self.listeners.dedup();
        self.source_ranges.sort_unstable();
        self.source_ranges.dedup();
    }

    /// Appends this load balancer as a `[[load_balancer]]` table.
    pub fn write_toml(&self, out: &mut String) {
        let _ = writeln!(out, "[[load_balancer]]");
        let _ = writeln!(out, "name = {}", quote(&self.name));
        let _ = writeln!(out, "cluster = {}", quote(&self.cluster));
        let _ = writeln!(out, "vip = {}", quote(&self.vip.to_string()));
        let _ = writeln!(out, "ipam = {}", quote(self.ipam));
        if let Some(network) = &self.network {
            let _ = writeln!(out, "network = {}", quote(network));
        }
        let backends: Vec<String> = self
            .backends
            .iter()
            .map(|b| quote(&b.to_string()))
            .collect();
        let _ = writeln!(out, "backends = [{}]", backends.join(", "));
        if self.client_ip_affinity {
            let _ = writeln!(out, "session_affinity = \"client_ip\"");
            if let Some(t) = self.affinity_timeout_seconds {
                let _ = writeln!(out, "affinity_timeout_seconds = {t}");
            }
        }
        if !self.source_ranges.is_empty() {
            let ranges: Vec<String> = self
                .source_ranges
                .iter()
                .map(|r| quote(&r.to_string()))
                .collect();
            let _ = writeln!(out, "source_ranges = [{}]", ranges.join(", "));
        }
        for l in &self.listeners {
            let _ = writeln!(out);
            let _ = writeln!(out, "  [[load_balancer.listener]]");
            let _ = writeln!(out, "  name = {}", quote(&l.name));
            let _ = writeln!(out, "  port = {}", l.port);
            let _ = writeln!(out, "  backend_port = {}", l.backend_port);
            let _ = writeln!(out, "  protocol = {}", quote(l.protocol));
            if let Some(f) = &self.forwarding.forwarding {
                let _ = writeln!(out, "  forwarding = {}", quote(f));
            }
            if let Some(s) = &self.forwarding.source_nat {
                let _ = writeln!(out, "  source_nat = {}", quote(s));
            }
        }
        if let Some(hc) = &self.health_check {
            let _ = writeln!(out);
            let _ = writeln!(out, "  [load_balancer.health_check]");
            let _ = writeln!(out, "  kind = {}", quote(hc.kind));
            if let Some(port) = hc.port {
                let _ = writeln!(out, "  port = {port}");
            }
            let _ = writeln!(out, "  success_threshold = {}", hc.success_threshold);
            let _ = writeln!(out, "  failure_threshold = {}", hc.failure_threshold);
            let _ = writeln!(out, "  period_seconds = {}", hc.period_seconds);
            let _ = writeln!(out, "  timeout_seconds = {}", hc.timeout_seconds);
        }
        if self.leased {
            let _ = writeln!(out);
            let _ = writeln!(out, "  [load_balancer.dhcp]");
        }
    }
}

/// A one-line TOML basic string (the `toml` crate would write a value with
/// a newline as a multi-line string, breaking the one-key-a-line layout).
fn quote(s: &str) -> String {
    let mut out = String::with_capacity(s.len() + 2);
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\t' => out.push_str("\\t"),
            '\r' => out.push_str("\\r"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", u32::from(c));
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A comment line's text with nothing that could end the comment.
pub fn comment_safe(s: &str) -> String {
    s.chars()
        .map(|c| if c.is_control() { ' ' } else { c })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_with_quotes_and_newlines_stay_one_toml_string() {
        for name in ["a\"b\nc", "back\\slash", "bell\u{7}", "ünïcödé"] {
            let line = format!("k = {}", quote(name));
            assert!(!line.contains('\n'), "{line}");
            let parsed: toml::Table = line.parse().expect("valid TOML");
            assert_eq!(parsed["k"].as_str(), Some(name));
        }
        assert_eq!(comment_safe("x\ny"), "x y");
    }
}

//! `forwarding = "kernel"`: what a listener forwarded by the kernel's NAT
//! can be, and every combination it cannot, refused with the key and the
//! reason.
//!
//! The kernel path sees only a connection's first packet (nftables NAT
//! chains run once per flow), so anything decided per connection in user
//! space has no kernel form: PROXY protocol headers, least connections,
//! deferred accept, answer counting. `source_ip` (a bucket map filled by
//! the proxy's rendezvous hash) and `client_ip` affinity (dynamic sets with
//! a timeout) have one. Keys that only tune the proxy's own forwarding
//! (connect timeout, idle timeouts, caps, connection logs) are not refused:
//! they apply while the listener falls back to the proxy, and a warning
//! says so.

use std::collections::HashMap;
use std::net::IpAddr;

use toml::Spanned;

use super::Validator;
use crate::config::file::{FileListener, FileLoadBalancer};
use crate::config::{Algorithm, Forwarding, ListenerSpec, Protocol, SourceNat};

impl Validator<'_> {
    /// `forwarding` and `source_nat` of one listener.
    pub(super) fn forwarding(&mut self, key: &str, l: &FileListener) -> (Forwarding, SourceNat) {
        let forwarding = self.choice(
            &l.forwarding,
            format_args!("{key}.forwarding"),
            &[("proxy", Forwarding::Proxy), ("kernel", Forwarding::Kernel)],
            Forwarding::Proxy,
        );
        let source_nat = self.choice(
            &l.source_nat,
            format_args!("{key}.source_nat"),
            &[
                ("masquerade", SourceNat::Masquerade),
                ("none", SourceNat::None),
            ],
            SourceNat::Masquerade,
        );
        if forwarding == Forwarding::Proxy
            && let Some(v) = &l.source_nat
        {
            self.problem(
                Some(v.span()),
                &format!("{key}.source_nat"),
                "applies to forwarding = \"kernel\" listeners only: the proxy opens its own connection to the backend, which always comes from this host (send the client's address with proxy_protocol); remove it, or set forwarding = \"kernel\"".into(),
            );
        }
        if forwarding != Forwarding::Kernel {
            return (forwarding, source_nat);
        }
        if let Some(v) = &l.proxy_protocol {
            self.problem(
                Some(v.span()),
                &format!("{key}.proxy_protocol"),
                "cannot be sent by a forwarding = \"kernel\" listener: the kernel rewrites addresses and never writes a byte into the stream; keep forwarding = \"proxy\" for a PROXY protocol listener, or use source_nat = \"none\" so the backend sees the client's address".into(),
            );
        }
        if let Some(v) = &l.defer_accept_seconds {
            self.problem(
                Some(v.span()),
                &format!("{key}.defer_accept_seconds"),
                "has no effect on a forwarding = \"kernel\" listener: the kernel forwards the handshake itself and no socket of this host accepts the connection; remove it".into(),
            );
        }
        (forwarding, source_nat)
    }

    /// The load balancer's keys that a kernel listener cannot honour.
    pub(super) fn kernel_combinations(
        &mut self,
        key: &str,
        lb: &FileLoadBalancer,
        vip: Option<IpAddr>,
        algorithm: Algorithm,
        listeners: &[ListenerSpec],
    ) {
        let Some((index, _)) = lb.listeners.iter().enumerate().find(|(_, l)| {
            l.get_ref()
                .forwarding
                .as_ref()
                .is_some_and(|f| f.get_ref() == "kernel")
        }) else {
            return;
        };
        if !listeners.iter().any(|l| l.forwarding == Forwarding::Kernel) {
            return; // The listener has problems of its own, already told.
        }
        let lkey = format!("{key}.listener[{index}].forwarding");
        if let Some(ip) = vip
            && ip.is_loopback()
            && let Some(v) = &lb.vip
        {
            self.problem(
                Some(v.span()),
                &format!("{key}.vip"),
                format!(
                    "{ip} is a loopback address, and {lkey} is \"kernel\": the kernel cannot DNAT loopback traffic (it would be a martian packet on the way out), so nothing would be forwarded; use forwarding = \"proxy\" for a loopback VIP"
                ),
            );
        }
        if let Some(vip) = vip {
            self.kernel_families(key, lb, vip, &lkey);
        }
        // round_robin is `numgen`, source_ip a bucket map filled by the
        // proxy's rendezvous hash, client_ip affinity a dynamic set per
        // backend: only least_connections has no kernel form.
        if let (Algorithm::LeastConnections, Some(v)) = (algorithm, &lb.algorithm) {
            self.problem(
                Some(v.span()),
                &format!("{key}.algorithm"),
                format!("\"least_connections\" has no kernel form: nftables picks a backend from the first packet alone and keeps no count of open connections; use \"round_robin\" or \"source_ip\", or forwarding = \"proxy\" (for {lkey} = \"kernel\")"),
            );
        }
        if let Some(v) = &lb.udp_responses {
            self.problem(
                Some(v.span()),
                &format!("{key}.udp_responses"),
                format!(
                    "cannot be counted by the kernel: {lkey} is \"kernel\", and conntrack ends a UDP flow on its own timeout only; remove it, or use forwarding = \"proxy\""
                ),
            );
        }
        // The postrouting match sees the connection after DNAT (VIP,
        // backend, protocol, nodeport): two kernel listeners that reach one
        // nodeport cannot be told apart there.
        let mut by_nodeport: HashMap<(Protocol, u16), SourceNat> = HashMap::new();
        for (i, l) in lb.listeners.iter().enumerate() {
            let Some(spec) = listeners.iter().find(|s| {
                l.get_ref()
                    .name
                    .as_ref()
                    .is_some_and(|n| *n.get_ref() == s.name)
            }) else {
                continue;
            };
            if spec.forwarding != Forwarding::Kernel {
                continue;
            }
            match by_nodeport.entry((spec.protocol, spec.backend_port)) {
                std::collections::hash_map::Entry::Vacant(e) => {
                    e.insert(spec.source_nat);
                }
                std::collections::hash_map::Entry::Occupied(e) if *e.get() != spec.source_nat => {
                    let span = l
                        .get_ref()
                        .source_nat
                        .as_ref()
                        .map_or_else(|| l.span(), |v| v.span());
                    self.problem(
                        Some(span),
                        &format!("{key}.listener[{i}].source_nat"),
                        format!(
                            "differs from another kernel listener of this load balancer on backend_port {} ({}): after the DNAT the kernel sees one VIP, backend and nodeport for both, so it cannot masquerade one and not the other; give them the same source_nat",
                            spec.backend_port, spec.protocol
                        ),
                    );
                }
                std::collections::hash_map::Entry::Occupied(_) => {}
            }
        }
        const TIMING: &str =
            "the kernel tries one backend and times flows out by its conntrack settings";
        const CAP: &str =
            "the kernel keeps no count of a load balancer's open flows, so it cannot cap them";
        const LOG: &str =
            "the kernel writes no line per connection; its per-backend counts are in /metrics";
        let logs = lb
            .log_connections
            .as_ref()
            .filter(|v| v.get_ref() != "none");
        let span = |v: Option<&Spanned<i64>>| v.map(|v| v.span());
        for (name, span, why) in [
            (
                "connect_timeout_ms",
                span(lb.connect_timeout_ms.as_ref()),
                TIMING,
            ),
            (
                "connect_attempts",
                span(lb.connect_attempts.as_ref()),
                TIMING,
            ),
            (
                "idle_timeout_seconds",
                span(lb.idle_timeout_seconds.as_ref()),
                TIMING,
            ),
            (
                "udp_idle_timeout_seconds",
                span(lb.udp_idle_timeout_seconds.as_ref()),
                TIMING,
            ),
            ("max_connections", span(lb.max_connections.as_ref()), CAP),
            ("max_udp_flows", span(lb.max_udp_flows.as_ref()), CAP),
            ("log_connections", logs.map(|v| v.span()), LOG),
        ] {
            if let Some(span) = span {
                self.warning(
                    Some(span),
                    &format!("{key}.{name}"),
                    format!(
                        "applies to this load balancer's kernel listeners only while they fall back to the proxy ({lkey} is \"kernel\"): {why}"
                    ),
                );
            }
        }
    }

    /// Backends of the other address family than the VIP's, which a kernel
    /// listener cannot reach: its DNAT rewrites the destination of an IPv4
    /// packet with an IPv4 address (IPv6 alike), and nft refuses the rule.
    /// Were it written, the transaction would fail for every load balancer
    /// at once; the proxy connects to either family, so only kernel
    /// listeners are refused. A DHCP VIP is IPv4 (`0.0.0.0` until leased).
    fn kernel_families(&mut self, key: &str, lb: &FileLoadBalancer, vip: IpAddr, lkey: &str) {
        let name = lb.name.as_ref().map_or("", |n| n.get_ref().as_str());
        let family = |ip: IpAddr| if ip.is_ipv4() { "IPv4" } else { "IPv6" };
        for (i, b) in lb.backends.iter().enumerate() {
            // A backend that is no address is told by `backends`.
            let Ok(ip) = b.get_ref().parse::<IpAddr>().map(|ip| ip.to_canonical()) else {
                continue;
            };
            if ip.is_ipv4() == vip.is_ipv4() {
                continue;
            }
            let vip_said = if vip.is_unspecified() {
                "leased over DHCP".to_string()
            } else {
                vip.to_string()
            };
            self.problem(
                Some(b.span()),
                &format!("{key}.backends[{i}]"),
                format!(
                    "load balancer {name:?}: backend {ip} is {} and the VIP ({vip_said}) is {}, and {lkey} is \"kernel\": the kernel's NAT cannot forward a connection to an address of the other family; give this load balancer {} backends, or use forwarding = \"proxy\" (the proxy connects to either family)",
                    family(ip),
                    family(vip),
                    family(vip),
                ),
            );
        }
    }
}

//! `forwarding = "kernel"`: what a listener forwarded by the kernel's NAT
//! can be, and every combination it cannot, refused with the key and the
//! reason.
//!
//! The kernel path sees only a connection's first packet (nftables NAT
//! chains run once per flow), so anything decided per connection in user
//! space has no kernel form: PROXY protocol headers, least connections,
//! deferred accept, answer counting. `source_ip` and `flow_hash` (a bucket
//! map filled by the proxy's rendezvous hash) and `client_ip` affinity
//! (dynamic sets with a timeout) have one. Keys that only tune the proxy's
//! own forwarding (connect timeout, idle timeouts, caps, connection logs)
//! are not refused: they apply while the listener falls back to the proxy,
//! and a warning says so.
//!
//! A kernel listener whose VIP moves between hosts (keepalived's `network`,
//! a management VIP keepalived moves, or `vip.announce = "routes"`) is also told which of its choices reset
//! the connections a move carries ([`Validator::moving_vips`]).

use std::collections::HashMap;
use std::net::IpAddr;

use toml::Spanned;

use super::Validator;
use crate::config::file::{FileConfig, FileListener, FileLoadBalancer};
use crate::config::{
    Algorithm, AnnounceSettings, Forwarding, KeepalivedSettings, ListenerSpec, LoadBalancerSpec,
    Protocol, SourceNat,
};

/// How a load balancer's VIP leaves a host with its flows still open.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Move {
    /// keepalived moves it to another host of its `network`, which answers
    /// ARP for it from then on.
    Failover,
    /// `vip.announce = "routes"`: every host announces it, and the router
    /// rehashes a withdrawn host's flows to the others by ECMP.
    Anycast,
}

impl Validator<'_> {
    /// `forwarding` and `source_nat` of one listener.
    pub(super) fn forwarding(&mut self, key: &str, l: &FileListener) -> (Forwarding, SourceNat) {
        let forwarding = self.choice(
            &l.forwarding,
            format_args!("{key}.forwarding"),
            &Forwarding::ALL.map(|f| (f.as_str(), f)),
            Forwarding::Proxy,
        );
        let source_nat = self.choice(
            &l.source_nat,
            format_args!("{key}.source_nat"),
            &[
                ("masquerade", SourceNat::Masquerade),
                ("none", SourceNat::None),
                ("vip", SourceNat::Vip),
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
                .is_some_and(|f| f.get_ref() == Forwarding::Kernel.as_str())
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
                format!("\"least_connections\" has no kernel form: nftables picks a backend from the first packet alone and keeps no count of open connections; use \"round_robin\", \"source_ip\" or \"flow_hash\", or forwarding = \"proxy\" (for {lkey} = \"kernel\")"),
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

    /// Kernel listeners whose VIP moves between hosts, in a combination
    /// that resets the connections a move carries to another host (see
    /// docs/many-hosts.md, "Connections across a move"). Warnings where the
    /// combination is what a config said before these keys existed (the
    /// default masquerade, round robin): it worked then and still serves
    /// every connection that does not move. A problem where it never
    /// works: `source_nat = "vip"` on an anycast VIP, whose replies the
    /// router spreads over all hosts, not to the one holding each flow;
    /// allowed when `[conntrackd]` (without `[keepalived]`) puts every
    /// flow on both hosts.
    pub(super) fn moving_vips(
        &mut self,
        file: &FileConfig,
        specs: &[Option<LoadBalancerSpec>],
        announce: &AnnounceSettings,
        keepalived: Option<&KeepalivedSettings>,
    ) {
        // `[conntrackd]` without `[keepalived]`: the anycast sync (every
        // host holds every flow's binding; `validate::sync`).
        let anycast_synced = file.conntrackd.is_some() && file.keepalived.is_none();
        for (i, (lb, spec)) in file.load_balancers.iter().zip(specs).enumerate() {
            let Some(spec) = spec else { continue };
            let management = keepalived.filter(|k| k.moves_management_vip(spec, announce));
            let moves = if spec.network.is_some() || management.is_some() {
                Move::Failover
            } else if announce.enabled() && announce.allows(spec.vip) {
                Move::Anycast
            } else {
                continue;
            };
            let lb = lb.get_ref();
            let key = format!("load_balancer[{i}]");
            let how = match moves {
                Move::Failover => match management {
                    Some(k) => format!(
                        "its VIP moves between hosts (a management VIP keepalived moves on keepalived.interface {:?})",
                        k.interface
                    ),
                    None => format!(
                        "its VIP moves between hosts (network = {:?}, keepalived)",
                        spec.network.as_deref().unwrap_or_default()
                    ),
                },
                Move::Anycast => {
                    "its VIP is announced from every host (vip.announce = \"routes\"), and a withdrawal rehashes flows to the others".to_string()
                }
            };
            let mut kernel = false;
            for (j, l) in spec.listeners.iter().enumerate() {
                if l.forwarding != Forwarding::Kernel {
                    continue;
                }
                kernel = true;
                let file_listener = lb.listeners.iter().find(|f| {
                    f.get_ref()
                        .name
                        .as_ref()
                        .is_some_and(|n| *n.get_ref() == l.name)
                });
                let span = file_listener.map(|f| {
                    f.get_ref()
                        .source_nat
                        .as_ref()
                        .map_or_else(|| f.span(), |v| v.span())
                });
                let lkey = format!("{key}.listener[{j}].source_nat");
                match (l.source_nat, moves) {
                    (SourceNat::Masquerade, Move::Failover) => self.warning(
                        span,
                        &lkey,
                        format!(
                            "is \"masquerade\" and {how}: a failover resets every connection it moves, because the backend knows each flow by the old host's own address; set source_nat = \"vip\" (the backends then see the VIP, whose replies reach its new holder) with algorithm = \"flow_hash\", or \"none\" if the backends route their replies through the VIP's holder"
                        ),
                    ),
                    (SourceNat::Masquerade, Move::Anycast) if anycast_synced => self.warning(
                        span,
                        &lkey,
                        format!(
                            "is \"masquerade\" and {how}: the TCP connections a withdrawal moves are reset, because the backend knows each flow by this host's own address, even with [conntrackd] syncing them; set source_nat = \"vip\" (every host then holds the flow's binding, and the backend answers the VIP) with algorithm = \"flow_hash\""
                        ),
                    ),
                    (SourceNat::Masquerade, Move::Anycast) => self.warning(
                        span,
                        &lkey,
                        format!(
                            "is \"masquerade\" and {how}: the TCP connections a withdrawal moves are reset, because the backend knows each flow by the old host's own address; no source_nat keeps them in anycast without the flows' state on every host (replies must come back to the host that holds each flow, and ECMP does not send them there), so drain before withdrawing, or sync the flows between the two hosts ([conntrackd] with source_nat = \"vip\"); algorithm = \"flow_hash\" keeps moved UDP flows on their backend"
                        ),
                    ),
                    (SourceNat::Vip, Move::Anycast) if anycast_synced => {}
                    (SourceNat::Vip, Move::Anycast) => self.problem(
                        span,
                        &lkey,
                        format!(
                            "cannot be \"vip\" here: {how}, so the backends' replies to the VIP go to whichever host the router's ECMP picks for the reply, not the one that holds the flow, and about half of all connections would fail; add [conntrackd] (interface, address, peer: the other host) so both hosts hold every flow's binding, or use source_nat = \"masquerade\" (or \"none\" if the backends route their replies through this host)"
                        ),
                    ),
                    _ => {}
                }
            }
            if kernel && spec.algorithm == Algorithm::RoundRobin {
                let span = lb
                    .algorithm
                    .as_ref()
                    .map(|a| a.span())
                    .or_else(|| lb.vip.as_ref().map(|v| v.span()));
                self.warning(
                    span,
                    &format!("{key}.algorithm"),
                    format!(
                        "is \"round_robin\" and {how}: each host's kernel counts its own round, so a flow that reaches another host mid-stream is given another backend, which resets it; set algorithm = \"flow_hash\" (every host picks the same backend for a flow) or \"source_ip\" (the same per client address)"
                    ),
                );
            }
        }
    }
}

//! The gate: an nftables table the daemon owns, `inet harvester_lb_gate`,
//! that holds back new flows of a VRRP instance's kernel listeners until
//! conntrackd has committed the flows synced from the other host
//! (docs/vip.md, "Open connections across a VIP's move").
//!
//! ```text
//! table inet harvester_lb_gate {
//!   map to4   { type ipv4_addr . inet_proto . inet_service : verdict; }  # VIP . tcp . 5432 : jump g_51
//!   map from4 { type ipv4_addr . inet_proto . inet_service : verdict; }  # backend . tcp . 30432 : jump g_51
//!   map to6, from6 { type ipv6_addr . inet_proto . inet_service : verdict; }  # the same for IPv6 VIPs
//!   chain g_51 { ct state { invalid, new } drop }                        # closed; empty when open
//!   chain prerouting { type filter hook prerouting priority -150; policy accept;
//!                      fib daddr type local ip daddr . meta l4proto . th dport vmap @to4
//!                      ip saddr . meta l4proto . th sport vmap @from4
//!                      fib daddr type local ip6 daddr . meta l4proto . th dport vmap @to6
//!                      ip6 saddr . meta l4proto . th sport vmap @from6 }
//! }
//! ```
//!
//! Priority -150 is after conntrack (-200), so `ct state` is known, and
//! before DNAT (-100), so a packet it drops never gets a NAT binding. What
//! it drops while closed: a client's packet to the VIP that conntrack sees
//! as new (a flow picked up mid-stream before its synced entry is
//! committed would be DNATed to a backend chosen anew), and a backend's
//! packet from the service port that conntrack sees as new (it would make a
//! reverse entry that remaps the committed one's port). Packets of flows
//! the kernel knows pass; so does everything not of a kernel listener on a
//! moving VIP. `fib daddr type local`: a packet to a VIP this host does
//! not hold is not this host's to hold back (with `br_netfilter`, a VM's
//! frame that this host only bridges to the VIP's holder passes this hook
//! too; a closed gate here would drop it on its way to the master).
//!
//! Who owns what: the daemon owns the table's structure (maps, their
//! elements, the chains, the base chain), written whole and atomically and
//! read back and repaired through [`crate::host::owned::Guard`] like the
//! isolation table. keepalived's notify script owns each gate's *state*
//! (the rule in `g_<vrid>` or none): it closes the gate on backup, fault
//! and stop, and opens it right after `conntrackd -c` on master. The
//! read-back therefore leaves the gate chains' rules out of the comparison,
//! and a (re)write keeps each gate's state as the kernel has it; a gate the
//! kernel does not have yet (a first start, a new instance, a table
//! another process deleted) starts as the notify script last recorded the
//! instance: open if it was master, closed otherwise.
//!
//! At a clean stop the table stays: `/readyz` turns 503, keepalived moves
//! the VIPs away and the script closes the gates; removing the table would
//! open them all.

use crate::metrics::HostKind;
use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use crate::host::conntrack_sync::conntrackd::{GATE_TABLE, Gated, gate_chain};
use crate::host::nft::NftListingError;
use crate::host::owned::{Fingerprint, Owned};

/// The priority of the gate's base chain (see the module's text).
pub const GATE_PRIORITY: i32 = -150;

/// The gate table as the daemon means it: the kernel listeners of moving
/// VIPs, and the state each gate starts in when the kernel has none yet.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Gate {
    /// What the gate matches, by instance.
    pub gated: Vec<Gated>,
    /// Every instance with a gate (those of `gated`, and those with none:
    /// their chains exist so the notify script never fails on them).
    pub vrids: Vec<u32>,
    /// Instances whose last recorded transition was to master: their gate
    /// starts open.
    pub masters: BTreeSet<u32>,
}

/// Why the gate could not be written or read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the sync gate table inet {GATE_TABLE}: {0} (conntrackd sync needs the `nft` command and CAP_NET_ADMIN; without the gate a VIP's flows may be reset at its move)"
)]
pub struct GateError(String);

impl GateError {
    /// The gate's error for what failed (`nft`, or reading its listing).
    fn of(failed: impl std::error::Error) -> Self {
        Self(failed.to_string())
    }
}

impl Gate {
    /// The whole table's nft script, each instance's gate open when it is in
    /// `open`. Pure: unit-tested.
    pub fn script(&self, open: &BTreeSet<u32>) -> String {
        // By family: [IPv4, IPv6]. An IPv6 VIP's flows were not gated
        // before: a takeover picked them up mid-stream (tests/conntrack_sync_v6.rs).
        let mut to: [BTreeMap<String, u32>; 2] = Default::default();
        let mut from: [BTreeMap<String, u32>; 2] = Default::default();
        for g in &self.gated {
            let proto = g.protocol.as_str();
            let f = usize::from(g.vip.is_ipv6());
            to[f]
                .entry(format!("{} . {proto} . {}", g.vip, g.port))
                .or_insert(g.vrid);
            for b in g.backends.iter().filter(|b| b.is_ipv6() == g.vip.is_ipv6()) {
                // One backend port may serve VIPs of two instances: the
                // first keeps it (a map has one verdict per key).
                from[f]
                    .entry(format!("{b} . {proto} . {}", g.backend_port))
                    .or_insert(g.vrid);
            }
        }
        let mut s = format!(
            "add table inet {GATE_TABLE}\ndelete table inet {GATE_TABLE}\ntable inet {GATE_TABLE} {{\n"
        );
        for (name, addr, elems) in [
            ("to4", "ipv4_addr", &to[0]),
            ("from4", "ipv4_addr", &from[0]),
            ("to6", "ipv6_addr", &to[1]),
            ("from6", "ipv6_addr", &from[1]),
        ] {
            let _ = write!(
                s,
                "  map {name} {{\n    type {addr} . inet_proto . inet_service : verdict\n"
            );
            if !elems.is_empty() {
                let list: Vec<String> = elems
                    .iter()
                    .map(|(k, vrid)| format!("{k} : jump {}", gate_chain(*vrid)))
                    .collect();
                let _ = writeln!(s, "    elements = {{ {} }}", list.join(", "));
            }
            s.push_str("  }\n");
        }
        let mut vrids: BTreeSet<u32> = self.vrids.iter().copied().collect();
        vrids.extend(self.gated.iter().map(|g| g.vrid));
        for vrid in vrids {
            let rule = if open.contains(&vrid) {
                ""
            } else {
                " ct state { invalid, new } drop;"
            };
            let _ = writeln!(s, "  chain {} {{{rule} }}", gate_chain(vrid));
        }
        let _ = write!(
            s,
            "  chain prerouting {{\n    type filter hook prerouting priority {GATE_PRIORITY}; policy accept;\n    fib daddr type local ip daddr . meta l4proto . th dport vmap @to4\n    ip saddr . meta l4proto . th sport vmap @from4\n    fib daddr type local ip6 daddr . meta l4proto . th dport vmap @to6\n    ip6 saddr . meta l4proto . th sport vmap @from6\n  }}\n}}\n"
        );
        s
    }

    /// The gates the kernel has now, by instance: `true` open, `false`
    /// closed; empty when there is no table.
    pub fn read_states() -> Result<BTreeMap<u32, bool>, GateError> {
        match crate::host::nft::list_inet_table(GATE_TABLE).map_err(GateError::of)? {
            None => Ok(BTreeMap::new()),
            Some(listed) => states_of(&listed).map_err(GateError::of),
        }
    }
}

/// The gates of an `nft -j list table` answer: every chain `g_<vrid>`,
/// open when it holds no rule.
pub fn states_of(listed: &str) -> Result<BTreeMap<u32, bool>, NftListingError> {
    let doc: serde_json::Value = serde_json::from_str(listed).map_err(NftListingError::NotJson)?;
    let mut states = BTreeMap::new();
    for o in doc["nftables"].as_array().into_iter().flatten() {
        if let Some(vrid) = o
            .get("chain")
            .and_then(|c| c["name"].as_str())
            .and_then(vrid_of)
        {
            states.entry(vrid).or_insert(true);
        }
        if let Some(vrid) = o
            .get("rule")
            .and_then(|r| r["chain"].as_str())
            .and_then(vrid_of)
        {
            states.insert(vrid, false);
        }
    }
    Ok(states)
}

/// The instance of a gate chain's name.
fn vrid_of(chain: &str) -> Option<u32> {
    chain.strip_prefix("g_")?.parse().ok()
}

/// The listing without the gate chains' rules: what the daemon owns.
fn structure(listed: &str) -> Result<Fingerprint, NftListingError> {
    let mut doc: serde_json::Value =
        serde_json::from_str(listed).map_err(NftListingError::NotJson)?;
    if let Some(objects) = doc["nftables"].as_array_mut() {
        objects.retain(|o| {
            o.get("rule")
                .and_then(|r| r["chain"].as_str())
                .and_then(vrid_of)
                .is_none()
        });
    }
    Fingerprint::of_nft_json(&doc.to_string())
}

impl Owned for Gate {
    const KIND: HostKind = HostKind::SyncGate;
    type Error = GateError;

    fn read_back(&self) -> Result<Option<Fingerprint>, GateError> {
        match crate::host::nft::list_inet_table(GATE_TABLE).map_err(GateError::of)? {
            None => Ok(None),
            Some(listed) => structure(&listed).map(Some).map_err(GateError::of),
        }
    }

    /// Writes the table whole, each gate in the state the kernel has it
    /// in, or as [`Gate::masters`] says for a gate the kernel lacks. The
    /// read of the states and the write are two `nft` calls: a transition
    /// between them is undone by the next one of the notify script, and
    /// the window is one `nft` call long.
    fn write(&self) -> Result<(), GateError> {
        let now = Self::read_states()?;
        let mut vrids: BTreeSet<u32> = self.vrids.iter().copied().collect();
        vrids.extend(self.gated.iter().map(|g| g.vrid));
        let open: BTreeSet<u32> = vrids
            .into_iter()
            .filter(|v| {
                now.get(v)
                    .copied()
                    .unwrap_or_else(|| self.masters.contains(v))
            })
            .collect();
        crate::host::nft::run(&["-f", "-"], self.script(&open).as_bytes())
            .map(drop)
            .map_err(GateError::of)
    }
    /// The structure's script (every gate closed): the states are the
    /// kernel's, kept by an adoption as by a write.
    fn identity(&self) -> Option<(&str, u64)> {
        Some((
            GATE_TABLE,
            crate::host::owned::adopt::digest(self.script(&BTreeSet::new()).as_bytes()),
        ))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Protocol;

    fn gate() -> Gate {
        Gate {
            gated: vec![
                Gated {
                    vrid: 51,
                    vip: "10.100.0.50".parse().unwrap(),
                    protocol: Protocol::Tcp,
                    port: 5432,
                    backends: vec![
                        "10.100.0.21".parse().unwrap(),
                        "10.100.0.22".parse().unwrap(),
                    ],
                    backend_port: 30432,
                },
                Gated {
                    vrid: 52,
                    vip: "10.100.0.51".parse().unwrap(),
                    protocol: Protocol::Udp,
                    port: 53,
                    backends: vec!["10.100.0.21".parse().unwrap()],
                    backend_port: 30053,
                },
            ],
            vrids: vec![50, 51, 52],
            masters: BTreeSet::new(),
        }
    }

    #[test]
    fn each_instance_has_its_gate_and_a_closed_one_drops_new_flows_only() {
        let open: BTreeSet<u32> = [52].into();
        let s = gate().script(&open);
        for want in [
            "elements = { 10.100.0.50 . tcp . 5432 : jump g_51, 10.100.0.51 . udp . 53 : jump g_52 }",
            "10.100.0.21 . tcp . 30432 : jump g_51",
            "10.100.0.22 . tcp . 30432 : jump g_51",
            "10.100.0.21 . udp . 30053 : jump g_52",
            "  chain g_50 { ct state { invalid, new } drop; }\n",
            "  chain g_51 { ct state { invalid, new } drop; }\n",
            "  chain g_52 { }\n",
            "type filter hook prerouting priority -150; policy accept;",
        ] {
            assert!(s.contains(want), "{want:?} not in\n{s}");
        }
        // Written whole: created if missing, deleted, made again.
        assert!(s.starts_with(
            "add table inet harvester_lb_gate\ndelete table inet harvester_lb_gate\n"
        ));
        // No kernel listener: the maps are declared empty, the chains exist.
        let empty = Gate {
            gated: vec![],
            vrids: vec![50],
            masters: BTreeSet::new(),
        }
        .script(&BTreeSet::new());
        assert!(!empty.contains("elements"), "{empty}");
        assert!(
            empty.contains("chain g_50 { ct state { invalid, new } drop; }"),
            "{empty}"
        );
    }

    #[test]
    fn the_gates_state_is_read_from_the_listing_and_left_out_of_the_comparison() {
        let listed = |g51: &str| {
            format!(
                r#"{{"nftables": [{{"metainfo": {{"version": "1.0.6"}}}},
                {{"table": {{"family": "inet", "name": "harvester_lb_gate", "handle": 1}}}},
                {{"chain": {{"family": "inet", "table": "harvester_lb_gate", "name": "g_51", "handle": 2}}}},
                {{"chain": {{"family": "inet", "table": "harvester_lb_gate", "name": "g_52", "handle": 3}}}},
                {g51}
                {{"rule": {{"family": "inet", "table": "harvester_lb_gate", "chain": "prerouting", "handle": 9, "expr": [{{"accept": null}}]}}}}]}}"#
            )
        };
        let closed = listed(
            r#"{"rule": {"family": "inet", "table": "harvester_lb_gate", "chain": "g_51", "handle": 7, "expr": [{"drop": null}]}},"#,
        );
        let open = listed("");
        assert_eq!(
            states_of(&closed).unwrap(),
            [(51, false), (52, true)].into()
        );
        assert_eq!(states_of(&open).unwrap(), [(51, true), (52, true)].into());
        // Opening or closing a gate is not drift.
        assert_eq!(
            structure(&closed)
                .unwrap()
                .drift(Some(&structure(&open).unwrap())),
            None
        );
        // A change of the base chain is.
        let changed = open.replace("{\"accept\": null}", "{\"drop\": null}");
        assert!(
            structure(&open)
                .unwrap()
                .drift(Some(&structure(&changed).unwrap()))
                .is_some()
        );
    }
}

//! Another program's `forward` chain that drops what the kernel forwards
//! for the `forwarding = "kernel"` listeners (issue 28, defect 8).
//!
//! Every base chain on a hook sees every packet, whichever table it is in:
//! an `accept` in one chain does not save a packet that another chain
//! drops. Docker (and many firewalls) install `ip filter FORWARD` with
//! `policy drop` and accept only their own bridges' traffic, so every
//! connection the kernel DNATs to a backend dies in the forward hook,
//! while the NAT tables are written (`kernel_forwarding_up` 1). Like
//! `net.ipv4.ip_forward = 0`, this is a host setting the daemon does not
//! change; it reads the forward base chains of the other tables every
//! 5 s (over netlink, then `nft -j list table` for the few tables that
//! have one), and while
//! one would drop DNATed traffic the kernel listeners of that family are
//! served by the proxy (whose traffic is local, not forwarded), `/status`
//! names the chain in `kernel_error`, and `harvester_lb_kernel_forward_blocked`
//! is 1.
//!
//! A chain lets the traffic through when, before anything drops it, a rule
//! accepts `ct status dnat` (the remedy the error names), or accepts
//! everything; rules that match anything else may or may not match the
//! daemon's traffic and are passed over. Jumps are followed within the
//! table. The reading is a judgement of the ruleset, not of packets: a
//! drop on a condition it cannot judge (an address set, a mark) is not
//! seen.
//!
//! It never writes into another program's table.
//!
//! [`ForwardChains`] is the NAT feature's component for this: its own
//! state (what was found, its generation, the last read error), read by
//! the kernel writer ([`ForwardChains::blocked`], [`ForwardChains::generation`])
//! and refreshed by [`ForwardChains::check`]; the daemon only holds it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;

use serde_json::Value;

use crate::host::nat::ForwardChain;
use crate::metrics::Metrics;

/// The prefix of every table the daemon owns: never judged.
const OWN_TABLES: &str = crate::host::nft::TABLE_PREFIX;
/// How deep jumps are followed (nft itself refuses loops).
const MAX_DEPTH: usize = 16;

/// A base chain on the forward hook that drops the kernel listeners'
/// traffic of a family.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Blocking {
    /// `ip`, `ip6` or `inet`.
    family: String,
    table: String,
    chain: String,
    /// `policy drop`, or the rule that drops (`rule handle 7 in CHAIN`).
    why: String,
}

impl Blocking {
    fn blocks(&self, vip: IpAddr) -> bool {
        match self.family.as_str() {
            "inet" => true,
            "ip" => vip.is_ipv4(),
            "ip6" => vip.is_ipv6(),
            _ => false,
        }
    }
}

impl std::fmt::Display for Blocking {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {} {} ({})",
            self.family, self.table, self.chain, self.why
        )
    }
}

/// What the last reading found: the chains that drop, by the daemon's
/// count of changes (what the kernel writer compares to rebuild).
#[derive(Debug, Default)]
pub struct ForwardChains {
    found: std::sync::Mutex<Vec<Blocking>>,
    /// Bumped at every change of `found`.
    generation: std::sync::atomic::AtomicU64,
    /// The last error of reading, said once until it changes.
    read_error: std::sync::Mutex<Option<String>>,
}

impl ForwardChains {
    /// Counts the changes of what was found.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    fn found(&self) -> std::sync::MutexGuard<'_, Vec<Blocking>> {
        self.found.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Why a kernel listener on `vip` would be blackholed by another
    /// program's forward chain, if one drops its traffic.
    pub fn blocked(&self, vip: IpAddr) -> Option<String> {
        let found = self.found();
        let chains: Vec<String> = found
            .iter()
            .filter(|b| b.blocks(vip))
            .map(ToString::to_string)
            .collect();
        let first = found.iter().find(|b| b.blocks(vip))?;
        Some(format!(
            "forward chain {} of another program drops what the kernel forwards to the backends; let it through with `nft insert rule {} {} {} ct status dnat accept` (or remove the drop); the proxy serves this listener meanwhile",
            chains.join(", "),
            first.family,
            first.table,
            first.chain
        ))
    }

    /// Reads the forward chains of the other tables (only while the config
    /// has a kernel listener, `has_kernel`: `nft` is not needed otherwise);
    /// logs and exports a change (`metrics`). Returns whether what blocks
    /// changed.
    pub async fn check(&self, has_kernel: bool, metrics: &Metrics) -> bool {
        let found = if has_kernel {
            match tokio::task::spawn_blocking(read_blocking_chains).await {
                Ok(Ok(found)) => {
                    *self.read_error.lock().unwrap_or_else(|e| e.into_inner()) = None;
                    found
                }
                Ok(Err(e)) => {
                    let e = e.to_string();
                    let mut said = self.read_error.lock().unwrap_or_else(|e| e.into_inner());
                    if said.as_deref() != Some(e.as_str()) {
                        tracing::warn!(
                            "cannot read the host's forward chains ({e}); a firewall that drops forwarded traffic would not be seen; retried every 5 s"
                        );
                        *said = Some(e);
                    }
                    // What was found before stays in force.
                    return false;
                }
                Err(e) => {
                    tracing::error!("the reading of the forward chains ended abnormally: {e}");
                    return false;
                }
            }
        } else {
            Vec::new()
        };
        metrics.kernel_forward_blocked.store(
            if has_kernel {
                1 + u8::from(!found.is_empty())
            } else {
                0
            },
            Ordering::Relaxed,
        );
        let mut kept = self.found();
        if *kept == found {
            return false;
        }
        for b in found.iter().filter(|b| !kept.contains(b)) {
            tracing::error!(
                chain = %b,
                "forward chain {b} of another program drops the connections the kernel forwards for forwarding = \"kernel\" listeners: those of its family are served by the proxy until it lets them through (`nft insert rule {} {} {} ct status dnat accept`; the daemon does not change other programs' tables)",
                b.family,
                b.table,
                b.chain
            );
        }
        for b in kept.iter().filter(|b| !found.contains(b)) {
            tracing::info!(
                chain = %b,
                "forward chain {b} no longer drops forwarded connections: kernel listeners go back to the kernel"
            );
        }
        *kept = found;
        self.generation.fetch_add(1, Ordering::AcqRel);
        true
    }
}

/// Why the host's forward chains could not be read.
#[derive(Debug, thiserror::Error)]
enum ForwardChainsReadError {
    /// The forward base chains could not be dumped over netlink.
    #[error("the host's chains over netlink: {0}")]
    Netlink(#[source] std::io::Error),
    /// `nft -j list table` failed for one table.
    #[error(transparent)]
    Nft(#[from] crate::host::nft::NftCommandError),
    /// One table's listing was not JSON.
    #[error("nft -j list table {family} {table}: {source}")]
    NotJson {
        family: &'static str,
        table: String,
        #[source]
        source: serde_json::Error,
    },
}

/// The forward base chains over netlink, then each other table that has
/// one with `nft -j list table` (cheap: nft lists that table alone): the
/// chains that drop DNATed traffic.
fn read_blocking_chains() -> Result<Vec<Blocking>, ForwardChainsReadError> {
    let chains =
        crate::host::nat::forward_base_chains().map_err(ForwardChainsReadError::Netlink)?;
    let mut found = Vec::new();
    for (family, table) in forward_tables(&chains) {
        let listed = crate::host::nft::run(&["-j", "list", "table", family, &table], b"")?;
        let listed: Value =
            serde_json::from_str(&listed).map_err(|source| ForwardChainsReadError::NotJson {
                family,
                table: table.clone(),
                source,
            })?;
        found.extend(blocking_in_table(&listed));
    }
    Ok(found)
}

/// The objects of an `nft -j` listing.
fn objects(doc: &Value) -> impl Iterator<Item = &Value> {
    doc["nftables"].as_array().into_iter().flatten()
}

/// The (family, table) of every forward base chain but the daemon's own.
fn forward_tables(chains: &[ForwardChain]) -> Vec<(&'static str, String)> {
    let mut out: Vec<(&'static str, String)> = chains
        .iter()
        .filter(|c| !c.table.starts_with(OWN_TABLES))
        .map(|c| (c.family, c.table.clone()))
        .collect();
    out.sort();
    out.dedup();
    out
}

/// What a chain does to DNATed traffic when it decides.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Verdict {
    Accepted,
    /// Dropped by this rule.
    Dropped(String),
}

/// The forward base chains of one listed table that drop DNATed traffic.
fn blocking_in_table(table: &Value) -> Vec<Blocking> {
    let mut rules: HashMap<&str, Vec<&Value>> = HashMap::new();
    let mut bases = Vec::new();
    for o in objects(table) {
        if let Some(c) = o.get("chain") {
            if c["hook"] == "forward" {
                bases.push(c);
            }
        } else if let Some(r) = o.get("rule")
            && let Some(chain) = r["chain"].as_str()
        {
            rules.entry(chain).or_default().push(r);
        }
    }
    bases
        .into_iter()
        .filter_map(|c| {
            let name = c["name"].as_str()?;
            let why = match walk(&rules, name, 0) {
                Some(Verdict::Accepted) => return None,
                Some(Verdict::Dropped(why)) => why,
                None if c["policy"] == "drop" => "policy drop".to_string(),
                None => return None,
            };
            Some(Blocking {
                family: c["family"].as_str()?.to_string(),
                table: c["table"].as_str()?.to_string(),
                chain: name.to_string(),
                why,
            })
        })
        .collect()
}

/// Follows `chain`'s rules as a DNATed packet would, where it can tell;
/// `None`: it reaches the end (the base chain's policy decides).
fn walk(rules: &HashMap<&str, Vec<&Value>>, chain: &str, depth: usize) -> Option<Verdict> {
    if depth > MAX_DEPTH {
        return None;
    }
    for rule in rules.get(chain).into_iter().flatten() {
        let mut conditional = false;
        let mut verdict = None;
        for e in rule["expr"].as_array().into_iter().flatten() {
            let Some((key, value)) = e.as_object().and_then(|o| o.iter().next()) else {
                conditional = true;
                continue;
            };
            match key.as_str() {
                "match" if matches_dnat(value) => {}
                "counter" | "log" | "comment" => {}
                "accept" | "drop" | "reject" | "jump" | "goto" | "return" => {
                    verdict = Some((key.as_str(), value));
                }
                _ => conditional = true,
            }
        }
        if conditional {
            continue;
        }
        let here = || {
            format!(
                "rule handle {} in {chain}",
                rule["handle"].as_u64().unwrap_or(0)
            )
        };
        match verdict {
            Some(("accept", _)) => return Some(Verdict::Accepted),
            Some(("drop" | "reject", _)) => return Some(Verdict::Dropped(here())),
            Some(("return", _)) => return None,
            Some(("jump", target)) => {
                if let Some(v) = target["target"]
                    .as_str()
                    .and_then(|t| walk(rules, t, depth + 1))
                {
                    return Some(v);
                }
            }
            Some(("goto", target)) => {
                return target["target"]
                    .as_str()
                    .and_then(|t| walk(rules, t, depth + 1));
            }
            _ => {}
        }
    }
    None
}

/// Whether a `match` is true of every DNATed packet: `ct status dnat`
/// (`ct status & dnat == dnat`).
fn matches_dnat(m: &Value) -> bool {
    let status = serde_json::json!({"ct": {"key": "status"}});
    let names_dnat = |v: &Value| v == "dnat" || v.as_array().is_some_and(|a| a == &["dnat"]);
    match m["op"].as_str() {
        Some("in" | "==") if m["left"] == status => names_dnat(&m["right"]),
        Some("==") => {
            m["left"]["&"]
                .as_array()
                .is_some_and(|a| a.len() == 2 && a[0] == status && names_dnat(&a[1]))
                && names_dnat(&m["right"])
        }
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listed table: `chains` as (name, Some((policy))) for base chains
    /// on the forward hook, rules as (chain, handle, expr).
    fn table(family: &str, bases: &[(&str, &str)], rules: &[(&str, u64, Value)]) -> Value {
        let mut objects = vec![serde_json::json!({"metainfo": {"version": "1.0.6"}})];
        for (name, policy) in bases {
            objects.push(
                serde_json::json!({"chain": {"family": family, "table": "filter",
                "name": name, "type": "filter", "hook": "forward", "prio": 0, "policy": policy}}),
            );
        }
        for (chain, handle, expr) in rules {
            objects.push(
                serde_json::json!({"rule": {"family": family, "table": "filter",
                "chain": chain, "handle": handle, "expr": expr}}),
            );
        }
        serde_json::json!({ "nftables": objects })
    }

    fn why(found: &[Blocking]) -> Vec<&str> {
        found.iter().map(|b| b.why.as_str()).collect()
    }

    fn docker_forward() -> Vec<(&'static str, u64, Value)> {
        vec![
            (
                "FORWARD",
                3,
                serde_json::json!([{"jump": {"target": "DOCKER-USER"}}]),
            ),
            (
                "FORWARD",
                4,
                serde_json::json!([
                    {"match": {"op": "==", "left": {"meta": {"key": "oifname"}}, "right": "docker0"}},
                    {"match": {"op": "in", "left": {"ct": {"key": "state"}}, "right": ["established", "related"]}},
                    {"accept": null}
                ]),
            ),
        ]
    }

    #[test]
    fn dockers_policy_drop_blocks() {
        let found = blocking_in_table(&table("ip", &[("FORWARD", "drop")], &docker_forward()));
        assert_eq!(why(&found), ["policy drop"]);
        assert_eq!(found[0].to_string(), "ip filter FORWARD (policy drop)");
        assert!(found[0].blocks("10.0.0.1".parse().unwrap()));
        assert!(!found[0].blocks("fd00::1".parse().unwrap()));
    }

    #[test]
    fn a_dnat_accept_before_the_drop_lets_it_through_even_behind_a_jump() {
        let mut rules = docker_forward();
        rules.push((
            "DOCKER-USER",
            5,
            serde_json::json!([{"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}}, {"accept": null}]),
        ));
        assert!(blocking_in_table(&table("ip", &[("FORWARD", "drop")], &rules)).is_empty());
        // The `ct status & dnat == dnat` spelling, with a counter.
        let rules = [(
            "fw",
            2,
            serde_json::json!([{"match": {"op": "==", "left": {"&": [{"ct": {"key": "status"}}, "dnat"]}, "right": "dnat"}}, {"counter": {"packets": 0, "bytes": 0}}, {"accept": null}]),
        )];
        assert!(blocking_in_table(&table("inet", &[("fw", "drop")], &rules)).is_empty());
    }

    #[test]
    fn an_unconditional_drop_blocks_a_conditional_one_does_not() {
        let drop_all = [(
            "fw",
            9,
            serde_json::json!([{"counter": {"packets": 0, "bytes": 0}}, {"drop": null}]),
        )];
        let found = blocking_in_table(&table("inet", &[("fw", "accept")], &drop_all));
        assert_eq!(why(&found), ["rule handle 9 in fw"]);
        assert!(found[0].blocks("fd00::1".parse().unwrap()));
        let drop_some = [(
            "fw",
            9,
            serde_json::json!([{"match": {"op": "==", "left": {"meta": {"key": "iifname"}}, "right": "eth9"}}, {"drop": null}]),
        )];
        assert!(blocking_in_table(&table("inet", &[("fw", "accept")], &drop_some)).is_empty());
        // A dnat accept after the drop comes too late.
        let late = [
            (
                "fw",
                9,
                serde_json::json!([{"reject": {"type": "icmpx", "expr": "admin-prohibited"}}]),
            ),
            (
                "fw",
                10,
                serde_json::json!([{"match": {"op": "in", "left": {"ct": {"key": "status"}}, "right": "dnat"}}, {"accept": null}]),
            ),
        ];
        assert_eq!(
            why(&blocking_in_table(&table(
                "ip6",
                &[("fw", "accept")],
                &late
            ))),
            ["rule handle 9 in fw"]
        );
    }

    #[test]
    fn only_other_tables_are_read_each_once() {
        let chain = |family, table: &str, name: &str| ForwardChain {
            family,
            table: table.to_string(),
            name: name.to_string(),
        };
        let chains = [
            chain("ip", "filter", "FORWARD"),
            chain("inet", "harvester_lb_nat", "fw"),
            chain("inet", "harvester_lb", "fw"),
            chain("inet", "fw", "a"),
            chain("inet", "fw", "b"),
        ];
        assert_eq!(
            forward_tables(&chains),
            [("inet", "fw".to_string()), ("ip", "filter".to_string())]
        );
    }
}

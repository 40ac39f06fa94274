//! Kernel objects the daemon owns, and keeping them as it wrote them.
//!
//! The daemon writes objects into the kernel that outlive a call and that
//! anyone with `CAP_NET_ADMIN` can change behind its back: a second daemon
//! started by hand, an operator's `nft flush ruleset`, a firewall reload,
//! keepalived or a script can replace or delete them while the daemon still
//! reports them in force. Every kind follows one rule:
//!
//! 1. **Single-instance resources first.** The daemon takes its admin port
//!    and its locked admin socket before it writes any kernel object, so a
//!    second daemon fails before it touches the first one's (see
//!    `server::start`); a start that fails after a write undoes it. The
//!    objects named by the host rather than by the config (the VM-network,
//!    reply-mark and gate tables, the VM networks' rules, an announce
//!    table) are [`claim`]ed the same way: a second daemon that needs one
//!    another holds refuses to start, naming the first, and a reload
//!    that newly needs one is refused.
//! 2. **Remember what was written**, as the kernel showed it right after
//!    the write.
//! 3. **Check and repair.** At every reload and on a timer the object is
//!    read back again; if it differs it is written again, what differed
//!    ([`Drift`]) is logged at warn and the repair counted per kind
//!    (`harvester_lb_host_repairs_total{kind}`) by the mechanism itself,
//!    under the kind its object declares ([`Backend::KIND`],
//!    [`Owned::KIND`], one `HostKind` each): no caller counts by hand.
//! 4. **Report the kernel**, not memory: `/status` and the metrics say
//!    what the last read-back found.
//!
//! Three shapes carry it out, by the size of what is owned:
//!
//! * **Many small keyed objects** (a VIP's announce route, a VIP's AnyIP
//!   local route, a VM network's route or rule, a network's leg, the reply
//!   marks): the [`Driver`] ([`driver`]), one for every such kind. Each kind is a [`Backend`] (read all, write one,
//!   remove one, over rtnetlink); the driver reads back, repairs, removes
//!   what is no longer wanted, writes, reads back again, and orders the
//!   stop ([`StopPhase`]). Its branches are unit-tested against an
//!   in-memory kernel, the backends in network namespaces.
//! * **One whole object** (the isolation table, the VM-network guard, the
//!   sync gate, the anycast sync's guard): a [`Guard`] over an
//!   [`Owned`] (below), comparing the kernel's own listing.
//! * **The NAT tables** (10,000 listeners in 16 tables, rewritten many
//!   times a minute): `host::nat::check`, the same rule its own way (below).
//!
//! A DHCP load balancer's macvlan interface and leased address are owned
//! by its client (`host::dhcp::run`), which reads them back over rtnetlink
//! every [`CHECK_INTERVAL`] while a lease is held: their life follows the
//! lease's state machine, not a wanted set.
//!
//! A new keyed kind implements [`Backend`] and is driven by a [`Driver`]; a
//! new whole object implements [`Owned`] (read back, write) and keeps a
//! [`Guard`]. For a whole object what is compared is the kernel's own
//! listing (for nftables `nft -j list table …` with the handles removed), so
//! no second model of nft's output is needed: whatever the kernel shows
//! after our write is what it must keep showing.
//!
//! The NAT tables are too large for that (10,000 listeners in 16 tables,
//! and a health flip rewrites one chain many times a minute), so
//! `host::nat::check` applies the same rule its own way: read back over
//! netlink (`host::nat::read_back`), not `nft` (which lists only a
//! resync's inventory); the structure (tables, base chains, listener chains,
//! dispatch, refusal and masquerade elements) compared with the desired
//! state itself, and each chain's rules with a digest of the kernel's
//! listing taken right after this process wrote that chain; a difference is
//! named in the log, counted (`kernel_repairs_total`), reported in
//! `/status` until repaired, and repaired by a full resync of everything
//! that is ours.
//!
//! Limits: a change made between our write and its read-back (a window of
//! one `nft` call, or of one netlink dump for the driver) would be taken as
//! ours; the check runs every
//! [`CHECK_INTERVAL`], so a change lasts until then (or the next reload).

use std::fmt;
use std::time::Duration;

use crate::host::nft::NftListingError;
use crate::metrics::{HostKind, HostRepairs};

pub mod adopt;
pub mod claim;
pub mod driver;

pub use claim::{Claim, ClaimError, Claims, Object};
pub use driver::{Backend, Driver, Found, Outcome, StopPhase};

/// How often owned kernel objects are read back and compared.
pub const CHECK_INTERVAL: Duration = Duration::from_secs(10);

/// An object as the kernel lists it, in a form that compares equal exactly
/// when the object is the same: its parts in the kernel's order, each
/// without what the kernel renumbers (handles), set elements sorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fingerprint(Vec<String>);

impl Fingerprint {
    /// The fingerprint of `nft -j list …` output: every object but
    /// `metainfo`, without its `handle`, a set's `elem` sorted.
    pub fn of_nft_json(text: &str) -> Result<Self, NftListingError> {
        let doc: serde_json::Value =
            serde_json::from_str(text).map_err(NftListingError::NotJson)?;
        let objects = doc["nftables"]
            .as_array()
            .ok_or(NftListingError::NoNftablesArray)?;
        let mut parts = Vec::with_capacity(objects.len());
        for object in objects {
            let mut object = object.clone();
            let Some(map) = object.as_object_mut() else {
                continue;
            };
            if map.contains_key("metainfo") {
                continue;
            }
            for inner in map
                .values_mut()
                .filter_map(serde_json::Value::as_object_mut)
            {
                inner.remove("handle");
                if let Some(serde_json::Value::Array(elems)) = inner.get_mut("elem") {
                    elems.sort_by_cached_key(serde_json::Value::to_string);
                }
            }
            parts.push(object.to_string());
        }
        Ok(Self(parts))
    }

    /// What differs from `self` (what was written) in `now` (what the kernel
    /// has); `None` when nothing does.
    pub fn drift(&self, now: Option<&Fingerprint>) -> Option<Drift> {
        let Some(now) = now else {
            return Some(Drift::Gone);
        };
        if self == now {
            return None;
        }
        let missing: Vec<String> = self
            .0
            .iter()
            .filter(|p| !now.0.contains(p))
            .cloned()
            .collect();
        let unexpected: Vec<String> = now
            .0
            .iter()
            .filter(|p| !self.0.contains(p))
            .cloned()
            .collect();
        Some(if missing.is_empty() && unexpected.is_empty() {
            Drift::Reordered
        } else {
            Drift::Changed {
                missing,
                unexpected,
            }
        })
    }
}

/// How an owned object differs from what the daemon wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Drift {
    /// It is not in the kernel at all.
    Gone,
    /// The same parts in another order (nftables rules: another meaning).
    Reordered,
    /// Parts were removed or added.
    Changed {
        /// Written by the daemon, no longer there.
        missing: Vec<String>,
        /// There, not written by the daemon.
        unexpected: Vec<String>,
    },
}

impl fmt::Display for Drift {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        /// Parts shown per side: enough to see what happened, bounded for the log.
        const SHOWN: usize = 3;
        let list = |parts: &[String]| {
            let mut s: Vec<&str> = parts.iter().take(SHOWN).map(String::as_str).collect();
            let more = parts.len().saturating_sub(SHOWN);
            let more = (more > 0).then(|| format!("and {more} more"));
            s.extend(more.as_deref());
            s.join(", ")
        };
        match self {
            Drift::Gone => write!(f, "it is gone"),
            Drift::Reordered => write!(f, "its parts are in another order"),
            Drift::Changed {
                missing,
                unexpected,
            } => {
                if !missing.is_empty() {
                    write!(f, "{} missing: {}", missing.len(), list(missing))?;
                }
                if !unexpected.is_empty() {
                    if !missing.is_empty() {
                        write!(f, "; ")?;
                    }
                    write!(f, "{} not ours: {}", unexpected.len(), list(unexpected))?;
                }
                Ok(())
            }
        }
    }
}

/// A kernel object the daemon owns: how to read it back and write it whole.
pub trait Owned {
    /// The kind, under which [`Guard::check`] counts a repair
    /// (`harvester_lb_host_repairs_total{kind}`): no caller counts by hand.
    const KIND: HostKind;
    /// Why reading or writing failed.
    type Error;
    /// The object as the kernel has it now; `None` when it is absent.
    fn read_back(&self) -> Result<Option<Fingerprint>, Self::Error>;
    /// Writes the object whole, as the daemon means it now.
    fn write(&self) -> Result<(), Self::Error>;

    /// The table's name and a digest of what [`Owned::write`] writes
    /// ([`adopt::digest`]), so a restarted daemon can adopt the table its
    /// predecessor left instead of writing it again ([`adopt`]). `None`
    /// (the default): always written.
    fn identity(&self) -> Option<(&str, u64)> {
        None
    }
}

/// What the daemon last wrote of one owned object (its fingerprint), and
/// the check against the kernel.
#[derive(Debug, Default)]
pub struct Guard {
    written: Option<Fingerprint>,
}

/// What a [`Guard::check`] found.
#[derive(Debug, PartialEq, Eq)]
pub enum Checked {
    /// Nothing is owned now (never written, or given up).
    NothingOwned,
    /// The kernel has what was written.
    InPlace,
    /// It differed; it was written again and is in place now.
    Repaired(Drift),
}

impl Guard {
    /// Writes `object` and remembers what the kernel then shows.
    pub fn write<O: Owned>(&mut self, object: &O) -> Result<(), O::Error> {
        self.written = None;
        let identity = object.identity();
        if let Some((table, script)) = identity
            && adopt::inherited(table)
        {
            let now = object.read_back()?;
            if adopt::adopt(table, script, now.as_ref()) {
                self.written = now;
                return Ok(());
            }
        }
        object.write()?;
        self.written = object.read_back()?;
        if let Some((table, script)) = identity {
            adopt::record(table, script, self.written.as_ref());
        }
        Ok(())
    }

    /// Forgets the object (it was deleted, or is no longer ours).
    pub fn forget(&mut self) {
        self.written = None;
    }

    /// Reads `object` back; if it differs from what was written, writes it
    /// again and counts the repair in `repairs` under [`Owned::KIND`]. An
    /// error leaves the object unowned until the next write, so a later
    /// check does not take the kernel's state for ours.
    pub fn check<O: Owned>(
        &mut self,
        object: &O,
        repairs: &HostRepairs,
    ) -> Result<Checked, O::Error> {
        let Some(written) = &self.written else {
            return Ok(Checked::NothingOwned);
        };
        let now = object.read_back()?;
        let Some(drift) = written.drift(now.as_ref()) else {
            return Ok(Checked::InPlace);
        };
        self.write(object)?;
        repairs[O::KIND].increment(1);
        Ok(Checked::Repaired(drift))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const LISTED: &str = r#"{"nftables": [{"metainfo": {"version": "1.0.6"}},
        {"table": {"family": "inet", "name": "t", "handle": 3}},
        {"set": {"family": "inet", "name": "s", "table": "t", "type": "ipv4_addr", "handle": 1, "elem": ["10.0.0.2", "10.0.0.1"]}},
        {"rule": {"family": "inet", "table": "t", "chain": "c", "handle": 5, "expr": [{"accept": null}]}},
        {"rule": {"family": "inet", "table": "t", "chain": "c", "handle": 6, "expr": [{"drop": null}]}}]}"#;

    /// A whole object in memory: the "kernel's" listing, failures to inject.
    #[derive(Default)]
    struct Table {
        kernel: std::cell::RefCell<Option<Vec<String>>>,
        meant: Vec<String>,
        fail_write: std::cell::Cell<bool>,
        writes: std::cell::Cell<u32>,
    }

    impl Owned for Table {
        const KIND: HostKind = HostKind::IsolationTable;
        type Error = String;
        fn read_back(&self) -> Result<Option<Fingerprint>, String> {
            Ok(self.kernel.borrow().clone().map(Fingerprint))
        }
        fn write(&self) -> Result<(), String> {
            self.writes.set(self.writes.get() + 1);
            if self.fail_write.get() {
                return Err("refused".into());
            }
            *self.kernel.borrow_mut() = Some(self.meant.clone());
            Ok(())
        }
    }

    #[test]
    fn a_guard_counts_each_repair_that_succeeded_under_its_object_s_kind() {
        let table = Table {
            meant: vec!["rule a".into()],
            ..Table::default()
        };
        let mut guard = Guard::default();
        let repairs = HostRepairs::default();
        guard.write(&table).unwrap();
        assert_eq!(guard.check(&table, &repairs), Ok(Checked::InPlace));
        *table.kernel.borrow_mut() = None;
        assert_eq!(
            guard.check(&table, &repairs),
            Ok(Checked::Repaired(Drift::Gone))
        );
        *table.kernel.borrow_mut() = None;
        table.fail_write.set(true);
        assert!(guard.check(&table, &repairs).is_err());
        let counted = repairs.counted();
        assert_eq!(
            counted,
            [("isolation_table", 1)],
            "the failed repair is not counted"
        );
    }

    #[test]
    fn a_guard_repairs_what_another_process_changed_and_owns_nothing_after_a_failure() {
        let table = Table {
            meant: vec!["rule a".into(), "rule b".into()],
            ..Table::default()
        };
        let mut guard = Guard::default();
        let repairs = HostRepairs::default();
        assert_eq!(guard.check(&table, &repairs), Ok(Checked::NothingOwned));
        guard.write(&table).unwrap();
        assert_eq!(guard.check(&table, &repairs), Ok(Checked::InPlace));
        assert_eq!(table.writes.get(), 1);

        // Deleted by another process: written again, the drift reported.
        *table.kernel.borrow_mut() = None;
        assert_eq!(
            guard.check(&table, &repairs),
            Ok(Checked::Repaired(Drift::Gone))
        );
        assert_eq!(table.kernel.borrow().as_deref(), Some(&table.meant[..]));

        // Changed: what differed is named.
        *table.kernel.borrow_mut() = Some(vec!["rule a".into(), "rule x".into()]);
        let Ok(Checked::Repaired(drift)) = guard.check(&table, &repairs) else {
            panic!("not repaired")
        };
        assert_eq!(drift.to_string(), "1 missing: rule b; 1 not ours: rule x");

        // A repair that fails: the error returned, nothing owned after it
        // (so the kernel's state is never taken for ours).
        *table.kernel.borrow_mut() = None;
        table.fail_write.set(true);
        assert_eq!(guard.check(&table, &repairs), Err("refused".to_string()));
        *table.kernel.borrow_mut() = Some(vec!["someone else's".into()]);
        assert_eq!(guard.check(&table, &repairs), Ok(Checked::NothingOwned));
        guard.forget();
        assert_eq!(guard.check(&table, &repairs), Ok(Checked::NothingOwned));
    }

    #[test]
    fn handles_and_element_order_do_not_count_rules_order_does() {
        let a = Fingerprint::of_nft_json(LISTED).unwrap();
        let renumbered = LISTED.replace("\"handle\": 5", "\"handle\": 9").replace(
            "[\"10.0.0.2\", \"10.0.0.1\"]",
            "[\"10.0.0.1\", \"10.0.0.2\"]",
        );
        assert_eq!(
            a.drift(Some(&Fingerprint::of_nft_json(&renumbered).unwrap())),
            None
        );
        let swapped = LISTED
            .replace("{\"accept\": null}", "{\"x\": null}")
            .replace("{\"drop\": null}", "{\"accept\": null}")
            .replace("{\"x\": null}", "{\"drop\": null}");
        assert_eq!(
            a.drift(Some(&Fingerprint::of_nft_json(&swapped).unwrap())),
            Some(Drift::Reordered)
        );
        assert_eq!(a.drift(None), Some(Drift::Gone));
        let emptied = LISTED.replace("[\"10.0.0.2\", \"10.0.0.1\"]", "[]");
        let drift = a
            .drift(Some(&Fingerprint::of_nft_json(&emptied).unwrap()))
            .unwrap();
        let said = drift.to_string();
        assert!(
            said.starts_with("1 missing: ") && said.contains("1 not ours: "),
            "{said}"
        );
        assert!(Fingerprint::of_nft_json("nope").is_err());
    }
}

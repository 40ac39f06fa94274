//! Whole nftables tables a restarted daemon adopts instead of writing them
//! again (issue 41): a table is written as `add table; delete table; table
//! {...}`, which gives it a new handle and, for a moment in the kernel's
//! transaction, replaces every chain. After a hand-over the next process
//! finds the tables its predecessor wrote; when the predecessor said (in
//! the hand-over marker, `daemon::hand_over`) what script it wrote and
//! what the kernel held after it, and the kernel still holds exactly that
//! and the new process would write the same script, the table is taken as
//! written: same handle, no write, nothing in `nft monitor`.
//!
//! The registry is process-wide (one daemon per process; the tables'
//! names are per network namespace and claimed, `host::owned::claim`): each
//! write records its table's script digest (and, through a
//! [`super::Guard`], the fingerprint read back after it); the hand-over
//! passes the records on; the next process's first write of each table
//! consults what it inherited once.

use std::collections::BTreeMap;
use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::Fingerprint;

/// What one table's last write was: digests of the script written and of
/// the kernel's copy read back after it (`None`: not read by the writer;
/// the hand-over reads it).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Written {
    /// [`digest`] of the script (or JSON) written.
    pub script: u64,
    /// [`Fingerprint::digest`] of the table as read back after the write.
    pub fingerprint: Option<u64>,
}

static WRITTEN: Mutex<BTreeMap<String, Written>> = Mutex::new(BTreeMap::new());
static INHERITED: Mutex<BTreeMap<String, Written>> = Mutex::new(BTreeMap::new());
static ADOPTED: AtomicU64 = AtomicU64::new(0);
static HANDED_OVER: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static REWRITTEN: AtomicU64 = AtomicU64::new(0);

fn lock(
    m: &Mutex<BTreeMap<String, Written>>,
) -> std::sync::MutexGuard<'_, BTreeMap<String, Written>> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A stable 64-bit digest (FNV-1a): the same bytes give the same digest
/// in every process and build, unlike `std`'s hasher.
pub fn digest(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0100_0000_01b3);
    }
    h
}

impl Fingerprint {
    /// A digest of the fingerprint (its parts in order).
    pub fn digest(&self) -> u64 {
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for part in &self.0 {
            h ^= digest(part.as_bytes());
            h = h.wrapping_mul(0x0100_0000_01b3);
        }
        h
    }
}

/// Records that `table` was written with a script of digest `script`,
/// read back as `fingerprint` (if the writer read it).
pub fn record(table: &str, script: u64, fingerprint: Option<&Fingerprint>) {
    record_digest(table, script, fingerprint.map(Fingerprint::digest));
}

/// As [`record`], with the kernel's copy already digested (the NAT
/// tables, several tables under one name).
pub fn record_digest(table: &str, script: u64, fingerprint: Option<u64>) {
    lock(&WRITTEN).insert(
        table.to_string(),
        Written {
            script,
            fingerprint,
        },
    );
}

/// Forgets `table` (the daemon deleted it).
pub fn forget(table: &str) {
    lock(&WRITTEN).remove(table);
}

/// Every table written by this process, for the hand-over.
pub fn written() -> BTreeMap<String, Written> {
    lock(&WRITTEN).clone()
}

/// At start: what the predecessor handed over.
pub fn inherit(tables: BTreeMap<String, Written>) {
    HANDED_OVER.store(true, Ordering::Relaxed);
    *lock(&INHERITED) = tables;
}

/// Whether the predecessor handed `table` over (not yet consulted).
pub fn inherited(table: &str) -> bool {
    lock(&INHERITED).contains_key(table)
}

/// Whether the kernel's `now` copy of `table` is what the predecessor left
/// and `script` what it wrote: then the table is adopted (counted), and
/// recorded as written by this process. Each inherited table is consulted
/// once: a later write (a reload, a repair) is a plain write.
pub fn adopt(table: &str, script: u64, now: Option<&Fingerprint>) -> bool {
    adopt_digest(table, script, now.map(Fingerprint::digest))
}

/// As [`adopt`], with the kernel's copy already digested.
pub fn adopt_digest(table: &str, script: u64, now: Option<u64>) -> bool {
    let Some(prev) = lock(&INHERITED).remove(table) else {
        return false;
    };
    let same = prev.script == script && prev.fingerprint.is_some() && prev.fingerprint == now;
    if same {
        ADOPTED.fetch_add(1, Ordering::Relaxed);
        record_digest(table, script, now);
    } else {
        REWRITTEN.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            table,
            "the table the previous process handed over differs from what this one writes (a changed config, or another process changed it); written again"
        );
    }
    same
}

/// What `/status` says of the start (`host_adoption`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct Adoption {
    /// Whether this process started after a hand-over (a fresh marker).
    pub after_hand_over: bool,
    /// Tables the previous process handed over that were adopted as they
    /// were (same handle, no write).
    pub tables_adopted: u64,
    /// Tables it handed over that differed (a changed config, another
    /// process's change) and were written again.
    pub tables_rewritten: u64,
}

/// The adoption at this process's start.
pub fn adoption() -> Adoption {
    Adoption {
        after_hand_over: HANDED_OVER.load(Ordering::Relaxed),
        tables_adopted: ADOPTED.load(Ordering::Relaxed),
        tables_rewritten: REWRITTEN.load(Ordering::Relaxed),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_inherited_table_is_adopted_once_and_only_when_script_and_kernel_match() {
        let fp = Fingerprint(vec!["a".into(), "b".into()]);
        let other = Fingerprint(vec!["a".into()]);
        assert_eq!(digest(b"x"), digest(b"x"));
        assert_ne!(fp.digest(), other.digest());
        inherit(BTreeMap::from([
            (
                "t1".to_string(),
                Written {
                    script: 1,
                    fingerprint: Some(fp.digest()),
                },
            ),
            (
                "t2".to_string(),
                Written {
                    script: 1,
                    fingerprint: Some(fp.digest()),
                },
            ),
            (
                "t3".to_string(),
                Written {
                    script: 1,
                    fingerprint: None,
                },
            ),
        ]));
        assert!(!adopt("t0", 1, Some(&fp)), "nothing inherited");
        assert!(adopt("t1", 1, Some(&fp)));
        assert!(!adopt("t1", 1, Some(&fp)), "consulted once");
        assert!(!adopt("t2", 2, Some(&fp)), "another script");
        assert!(!adopt("t3", 1, Some(&fp)), "no fingerprint handed: written");
        inherit(BTreeMap::from([(
            "t4".to_string(),
            Written {
                script: 1,
                fingerprint: Some(fp.digest()),
            },
        )]));
        assert!(!adopt("t4", 1, Some(&other)), "the kernel's copy changed");
        assert_eq!(written().get("t1").map(|w| w.script), Some(1));
    }
}

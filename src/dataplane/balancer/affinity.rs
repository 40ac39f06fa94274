//! `sessionAffinity: ClientIP`: which backend each client address was given,
//! so that its next connections go there too.
//!
//! A client keeps its backend while that backend is eligible and the client
//! was seen within the timeout (Kubernetes' `timeoutSeconds`). A client whose
//! backend is no longer eligible is picked again by the load balancer's
//! algorithm and keeps the new one. The table belongs to the load balancer,
//! so entries survive every reload that keeps it.
//!
//! The table is a concurrent map; a client that already has a fresh entry
//! costs one shard read lock and, once per second at most, one atomic store.
//! All tables together hold at most [`AffinityBudget`]'s entries
//! (`proxy.max_affinity_entries`): past that, new clients are served but not
//! remembered, and counted. Expired entries are swept by the daemon.

use std::net::IpAddr;
use std::sync::Arc;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use dashmap::DashMap;
use tokio::time::Instant;

use super::ClientAddr;
use crate::metrics::LbStats;

/// Seconds since this process first asked, plus [`CLOCK_BASE`]: a coarse
/// monotonic clock that fits an entry's last-seen time in four bytes. On
/// tokio's clock, so that a test with a paused clock drives expiry (outside
/// tests it is the system's monotonic clock, at the same cost).
pub fn now_secs() -> u32 {
    static START: OnceLock<Instant> = OnceLock::new();
    let start = *START.get_or_init(Instant::now);
    u32::try_from(Instant::now().duration_since(start).as_secs())
        .unwrap_or(u32::MAX)
        .saturating_add(CLOCK_BASE)
}

/// Where [`now_secs`] starts: about twelve days, so that an entry restored
/// from the state file at start can be dated before the process began (an
/// affinity timeout is at most a day).
pub const CLOCK_BASE: u32 = 1 << 20;

/// The process-wide bound on affinity entries, shared by every table.
pub type AffinityBudget = crate::dataplane::budget::Budget;

/// One remembered client: its backend and when it last connected.
#[derive(Debug)]
struct Entry {
    backend: IpAddr,
    last_seen: AtomicU32,
}

/// One load balancer's affinity entries.
pub struct AffinityTable {
    /// By the client's IP address ([`ClientAddr::ip`]): a client's every
    /// port is one client.
    entries: DashMap<IpAddr, Entry>,
    budget: Arc<AffinityBudget>,
    /// Its load balancer's numbers (`affinity_entries`, `affinity_table_full_total`).
    stats: Arc<LbStats>,
}

impl AffinityTable {
    /// An empty table drawing on `budget`.
    pub fn new(budget: Arc<AffinityBudget>, stats: Arc<LbStats>) -> Self {
        Self {
            entries: DashMap::new(),
            budget,
            stats,
        }
    }

    /// The backend `client` was given, if it was seen within `timeout`;
    /// marks it seen now.
    pub fn lookup(&self, client: ClientAddr, timeout: Duration, now: u32) -> Option<IpAddr> {
        let entry = self.entries.get(&client.ip())?;
        let seen = entry.last_seen.load(Ordering::Relaxed);
        if u64::from(now.saturating_sub(seen)) > timeout.as_secs() {
            return None;
        }
        if seen != now {
            entry.last_seen.store(now, Ordering::Relaxed);
        }
        Some(entry.backend)
    }

    /// Remembers that `client` was given `backend` now.
    pub fn remember(&self, client: ClientAddr, backend: IpAddr, now: u32) {
        if let Some(mut entry) = self.entries.get_mut(&client.ip()) {
            entry.backend = backend;
            entry.last_seen.store(now, Ordering::Relaxed);
            return;
        }
        if !self.budget.take() {
            self.stats.affinity_full.increment(1);
            return;
        }
        let fresh = Entry {
            backend,
            last_seen: AtomicU32::new(now),
        };
        if self.entries.insert(client.ip(), fresh).is_some() {
            // Another connection of the same client got there first.
            self.budget.give_back(1);
        } else {
            self.stats.affinity_entries.increment();
        }
    }

    /// Drops the entries not seen within `timeout`; returns how many went.
    pub fn sweep(&self, timeout: Duration, now: u32) -> usize {
        let before = self.entries.len();
        self.entries.retain(|_, e| {
            u64::from(now.saturating_sub(e.last_seen.load(Ordering::Relaxed))) <= timeout.as_secs()
        });
        let gone = before.saturating_sub(self.entries.len());
        self.forget(gone);
        gone
    }

    /// Drops every entry (affinity switched off).
    pub fn clear(&self) {
        let n = self.entries.len();
        self.entries.clear();
        self.forget(n);
    }

    /// Every entry as (client, backend, seconds since it was last seen at
    /// `now`), for the state file.
    pub fn export(&self, now: u32) -> Vec<(IpAddr, IpAddr, u32)> {
        self.entries
            .iter()
            .map(|e| {
                let seen = e.value().last_seen.load(Ordering::Relaxed);
                (*e.key(), e.value().backend, now.saturating_sub(seen))
            })
            .collect()
    }

    /// Puts back an entry of the state file: `client` was given `backend`
    /// and last seen `age` seconds before `now`. An entry already there (a
    /// client served since) is kept; the budget bounds the restored ones as
    /// any other. Returns whether it was put back.
    pub fn restore(&self, client: IpAddr, backend: IpAddr, age: u32, now: u32) -> bool {
        if self.entries.contains_key(&client) || !self.budget.take() {
            return false;
        }
        let entry = Entry {
            backend,
            last_seen: AtomicU32::new(now.saturating_sub(age)),
        };
        if self.entries.insert(client, entry).is_some() {
            self.budget.give_back(1);
            return false;
        }
        self.stats.affinity_entries.increment();
        true
    }

    /// Entries held now.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// Whether the table is empty.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn forget(&self, n: usize) {
        self.budget.give_back(n);
        self.stats.affinity_entries.subtract(n as u64);
    }
}

impl Drop for AffinityTable {
    fn drop(&mut self) {
        self.budget.give_back(self.entries.len());
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ip(s: &str) -> IpAddr {
        s.parse().unwrap()
    }

    fn client_at(s: &str) -> ClientAddr {
        ClientAddr::new(std::net::SocketAddr::new(ip(s), 40000))
    }

    #[test]
    fn a_client_keeps_its_backend_within_the_timeout() {
        let t = AffinityTable::new(AffinityBudget::new(10), LbStats::detached());
        let timeout = Duration::from_secs(10);
        t.remember(client_at("10.0.0.1"), ip("192.0.2.1"), 100);
        assert_eq!(
            t.lookup(client_at("10.0.0.1"), timeout, 105),
            Some(ip("192.0.2.1"))
        );
        // Seen at 105: still fresh at 115, gone at 116.
        assert_eq!(
            t.lookup(client_at("10.0.0.1"), timeout, 115),
            Some(ip("192.0.2.1"))
        );
        assert_eq!(t.lookup(client_at("10.0.0.1"), timeout, 126), None);
        assert_eq!(t.lookup(client_at("10.0.0.2"), timeout, 100), None);
    }

    #[tokio::test(start_paused = true)]
    async fn entries_expire_on_tokios_clock() {
        use tokio::time::advance;
        // Past the origin any other test may have set on the real clock
        // since this runtime's clock stopped.
        advance(Duration::from_secs(3600)).await;
        let t = AffinityTable::new(AffinityBudget::new(10), LbStats::detached());
        let timeout = Duration::from_secs(10);
        let (client, backend) = (client_at("10.0.0.1"), ip("192.0.2.1"));
        t.remember(client, backend, now_secs());
        advance(timeout).await;
        assert_eq!(t.lookup(client, timeout, now_secs()), Some(backend));
        // That lookup saw the client again: fresh for another timeout.
        advance(timeout).await;
        assert_eq!(t.sweep(timeout, now_secs()), 0);
        assert_eq!(t.lookup(client, timeout, now_secs()), Some(backend));
        advance(timeout + Duration::from_secs(1)).await;
        assert_eq!(t.sweep(timeout, now_secs()), 1);
        assert_eq!(t.lookup(client, timeout, now_secs()), None);
    }

    #[test]
    fn the_budget_bounds_all_tables_and_sweeps_give_it_back() {
        let budget = AffinityBudget::new(3);
        let a = AffinityTable::new(Arc::clone(&budget), LbStats::detached());
        let b = AffinityTable::new(Arc::clone(&budget), LbStats::detached());
        a.remember(client_at("10.0.0.1"), ip("192.0.2.1"), 0);
        a.remember(client_at("10.0.0.2"), ip("192.0.2.1"), 50);
        b.remember(client_at("10.0.0.3"), ip("192.0.2.1"), 0);
        b.remember(client_at("10.0.0.4"), ip("192.0.2.1"), 0);
        assert_eq!((a.len(), b.len(), budget.used()), (2, 1, 3));
        assert_eq!(b.stats.affinity_full.get(), 1);
        // A known client moves without taking more budget.
        a.remember(client_at("10.0.0.1"), ip("192.0.2.2"), 1);
        assert_eq!(budget.used(), 3);
        assert_eq!(a.sweep(Duration::from_secs(10), 55), 1);
        assert_eq!(budget.used(), 2);
        drop(b);
        assert_eq!(budget.used(), 1);
        a.clear();
        assert_eq!(budget.used(), 0);
    }
}

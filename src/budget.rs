//! [`Budget`]: one process-wide bound on entries that many tables draw
//! from, changed by reload. Client-affinity entries
//! (`proxy.max_affinity_entries`) and UDP flows (`proxy.max_udp_flows`)
//! are each one budget shared by every load balancer or listener.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

/// A bound on entries held across many tables.
#[derive(Debug)]
pub struct Budget {
    max: AtomicUsize,
    used: AtomicUsize,
}

impl Budget {
    /// A budget of `max` entries.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: AtomicUsize::new(max),
            used: AtomicUsize::new(0),
        })
    }

    /// Changes the bound (a reload); entries over a lowered bound stay until
    /// they end, and no new ones are taken meanwhile.
    pub fn set_max(&self, max: usize) {
        self.max.store(max, Ordering::Relaxed);
    }

    /// Entries held now, in all tables.
    pub fn used(&self) -> usize {
        self.used.load(Ordering::Relaxed)
    }

    /// Takes one entry if the bound allows it.
    pub(crate) fn take(&self) -> bool {
        let max = self.max.load(Ordering::Relaxed);
        self.used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |n| {
                (n < max).then_some(n + 1)
            })
            .is_ok()
    }

    /// Gives `n` entries back (never below zero).
    pub(crate) fn give_back(&self, n: usize) {
        let _ = self
            .used
            .fetch_update(Ordering::AcqRel, Ordering::Relaxed, |u| {
                Some(u.saturating_sub(n))
            });
    }
}

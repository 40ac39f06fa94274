//! [`Budget`]: one process-wide bound on entries that many tables draw
//! from, changed by reload. Client-affinity entries
//! (`proxy.max_affinity_entries`) and UDP flows (`proxy.max_udp_flows`)
//! are each one budget shared by every load balancer or listener; each
//! load balancer also has a budget of its own for its TCP connections and
//! its UDP flows (its share, so one tenant cannot take every slot).
//!
//! A budget also remembers whether it was found full, so the first refusal
//! and the return below the bound are each said once (`Budget::note_full`,
//! `Budget::note_release`), not at every refused connection.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

/// A bound on entries held across many tables.
#[derive(Debug)]
pub struct Budget {
    max: AtomicUsize,
    used: AtomicUsize,
    /// Set at the first refusal, cleared once use is back to 90% of the
    /// bound (the gap keeps a budget at its edge from flapping every
    /// connection).
    full: AtomicBool,
}

impl Budget {
    /// A budget of `max` entries.
    pub fn new(max: usize) -> Arc<Self> {
        Arc::new(Self {
            max: AtomicUsize::new(max),
            used: AtomicUsize::new(0),
            full: AtomicBool::new(false),
        })
    }

    /// The bound in force.
    pub fn max(&self) -> usize {
        self.max.load(Ordering::Relaxed)
    }

    /// Records that an entry was refused; `true` when the budget was not
    /// already marked full (the caller says so, once).
    pub(crate) fn note_full(&self) -> bool {
        !self.full.swap(true, Ordering::AcqRel)
    }

    /// After entries were given back: `true` exactly once when a budget
    /// marked full is back to 90% of its bound or less.
    pub(crate) fn note_release(&self) -> bool {
        self.full.load(Ordering::Relaxed)
            && self.used().saturating_mul(10) <= self.max().saturating_mul(9)
            && self.full.swap(false, Ordering::AcqRel)
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

/// One entry of a [`Budget`], given back when dropped: a TCP connection
/// holds one of its load balancer's for its whole life.
#[derive(Debug)]
pub struct Slot(Arc<Budget>);

impl Slot {
    /// Takes an entry of `budget`, if the bound allows it.
    pub fn take(budget: &Arc<Budget>) -> Option<Self> {
        budget.take().then(|| Self(Arc::clone(budget)))
    }

    /// The budget it was taken from.
    pub fn budget(&self) -> &Arc<Budget> {
        &self.0
    }
}

impl Drop for Slot {
    fn drop(&mut self) {
        self.0.give_back(1);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn full_and_back_are_each_noted_once() {
        let b = Budget::new(10);
        let slots: Vec<Slot> = (0..10).filter_map(|_| Slot::take(&b)).collect();
        assert_eq!(slots.len(), 10);
        assert!(Slot::take(&b).is_none());
        assert!(b.note_full(), "the first refusal is news");
        assert!(!b.note_full(), "the next ones are not");
        let mut slots = slots;
        slots.pop();
        assert!(b.note_release(), "9 of 10 is back under the bound");
        assert!(!b.note_release(), "once");
        assert_eq!(b.used(), 9);
        drop(slots);
        assert_eq!(b.used(), 0);
    }
}

//! The restart's numbers (issue 41): what this process adopted from the
//! store at start, what the last process handed over and how long no
//! process accepted, and the hand-overs that fell back to the drain.

use std::sync::Mutex;
use std::sync::atomic::{AtomicU64, Ordering};

use super::exposition::{gauge_family, labelled_family};
use super::names;
use super::stats::Counter;

/// Why a hand-over was asked for but the stop drained instead; the label
/// of `hand_over_fallbacks_total{reason}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FallbackReason {
    /// The daemon runs outside systemd or without `FileDescriptorStoreMax=`.
    NoStore,
    /// More descriptors to keep than `FileDescriptorStoreMax=` allows.
    StoreTooSmall,
    /// `prepare-stop` asked more than the intent's bound before the signal.
    Expired,
}

impl FallbackReason {
    /// Every reason, in the order `/metrics` lists them.
    pub const ALL: [FallbackReason; 3] = [Self::NoStore, Self::StoreTooSmall, Self::Expired];

    /// The label value.
    pub fn label(self) -> &'static str {
        match self {
            Self::NoStore => "no_store",
            Self::StoreTooSmall => "store_too_small",
            Self::Expired => "intent_expired",
        }
    }
}

/// What the last process handed over, as it told the next one.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize)]
pub struct LastHandOver {
    /// Listening sockets left in the store.
    pub listeners: u64,
    /// Connections stored.
    pub connections: u64,
    /// UDP flows stored.
    pub flows: u64,
    /// Connections and flows not kept.
    pub lost: u64,
    /// From the last process's last accept to this one's first, in
    /// milliseconds (clients waited in the accept queues meanwhile).
    pub window_ms: u64,
}

/// The numbers; one per process, in [`super::Metrics`].
#[derive(Default)]
pub struct HandOverStats {
    adopted_listening_sockets: AtomicU64,
    last: Mutex<Option<LastHandOver>>,
    fallbacks: [Counter; 3],
    done: Counter,
}

impl HandOverStats {
    /// `n` more listening sockets taken from the store at start.
    pub fn adopted_listening_sockets(&self, n: usize) {
        self.adopted_listening_sockets
            .fetch_add(n as u64, Ordering::Relaxed);
    }

    /// Listening sockets taken from the store at start.
    pub fn adopted(&self) -> u64 {
        self.adopted_listening_sockets.load(Ordering::Relaxed)
    }

    /// Records what the last process handed over.
    pub fn set_last(&self, last: LastHandOver) {
        *self.last.lock().unwrap_or_else(|p| p.into_inner()) = Some(last);
    }

    /// What the last process handed over, if it did.
    pub fn last(&self) -> Option<LastHandOver> {
        *self.last.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// A hand-over done by this process.
    pub fn record_done(&self) {
        self.done.increment(1);
    }

    /// A hand-over asked for that drained instead.
    pub fn record_fallback(&self, reason: FallbackReason) {
        let i = FallbackReason::ALL
            .iter()
            .position(|r| *r == reason)
            .expect("ALL lists every reason");
        self.fallbacks[i].increment(1);
    }

    /// Writes the families.
    pub(crate) fn write(&self, buf: &mut Vec<u8>) {
        gauge_family(
            buf,
            &names::RESTART_ADOPTED_LISTENING_SOCKETS,
            self.adopted(),
        );
        if let Some(last) = self.last() {
            labelled_family(
                buf,
                &names::RESTART_HANDED_OVER,
                "kind",
                &[
                    ("listening_sockets", last.listeners),
                    ("connections", last.connections),
                    ("flows", last.flows),
                    ("lost", last.lost),
                ],
            );
            gauge_family(
                buf,
                &names::RESTART_WINDOW_SECONDS,
                last.window_ms as f64 / 1000.0,
            );
        }
        gauge_family(buf, &names::HAND_OVERS, self.done.get());
        let by_reason: Vec<(&str, u64)> = FallbackReason::ALL
            .iter()
            .zip(&self.fallbacks)
            .map(|(r, c)| (r.label(), c.get()))
            .collect();
        labelled_family(buf, &names::HAND_OVER_FALLBACKS, "reason", &by_reason);
    }
}

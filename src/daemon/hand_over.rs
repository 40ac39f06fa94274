//! A restart that loses nothing: what the daemon does instead of its drain
//! when the stop it was asked for is the first half of a restart (issue 41).
//!
//! The mechanism is systemd's file descriptor store (`FDSTORE=1`): the
//! listening sockets are stored when they are bound, the open connections
//! and UDP flows when the daemon hands over, and the next process of the
//! unit receives them all (`LISTEN_FDS`, matched by name). A restart is told
//! from a stop before the signal comes: the unit's `ExecStop=` asks systemd
//! which job stops it and, for a restart, tells the daemon over the admin
//! socket. Without that word a SIGTERM keeps today's meaning: drain, then
//! remove everything written into the host.
//!
//! The three parts, one file each:
//! - `sockets`: listeners, connections and flows into the store;
//! - `state`: operator states, health verdicts, affinity and leases into the
//!   state file, which the next process reads back;
//! - `host`: the kernel objects, routes, addresses and keepalived's and
//!   conntrackd's files left in place for the next process to adopt.

use std::time::Duration;

use super::Daemon;

mod host;
mod sockets;
mod state;

pub use host::{HandOverMarker, MARKER_FILE, MARKER_KEPT_FILE, MARKER_MAX_AGE, MarkerError};

/// How long `POST /hand-over` waits for its SIGTERM: a stop that comes
/// later drains (the restart it was asked for did not come).
pub const INTENT_TTL: Duration = Duration::from_secs(60);

/// What a stop does with the daemon's sockets and host objects.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum StopKind {
    /// `systemctl stop`, package removal, a signal with no word before it:
    /// drain the connections, then remove everything written into the host.
    #[default]
    Drain,
    /// The first half of a restart: hand everything to the next process.
    HandOver,
}

/// What a hand-over passed on, for the log, `/status` and the metrics.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct HandOverReport {
    /// Listening sockets left in the store.
    pub listeners: usize,
    /// Proxied TCP connections stored.
    pub connections: usize,
    /// UDP flows stored.
    pub flows: usize,
    /// Connections and flows that could not be stored (the store's
    /// capacity, a peer that would not take the bytes in flight).
    pub lost: usize,
}

impl Daemon {
    /// `POST /hand-over`: the next SIGTERM, within [`INTENT_TTL`], hands
    /// over instead of draining. (A minimal stand-in for h41-store's
    /// intent and `prepare-stop`, which replace it.)
    pub fn request_hand_over(&self) {
        *self
            .hand_over_intent
            .lock()
            .unwrap_or_else(|p| p.into_inner()) = Some(tokio::time::Instant::now());
    }

    /// What the coming stop does: [`StopKind::HandOver`] when asked for
    /// less than [`INTENT_TTL`] ago.
    pub fn stop_kind(&self) -> StopKind {
        let asked = *self
            .hand_over_intent
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        match asked {
            Some(at) if at.elapsed() <= INTENT_TTL => StopKind::HandOver,
            _ => StopKind::Drain,
        }
    }

    /// Hands everything to the next process of the unit instead of draining:
    /// see the module's doc.
    pub async fn hand_over(&self) -> HandOverReport {
        let mut report = HandOverReport::default();
        // First: no writer into the host may act on what follows (a
        // listener leaving, `stopping` set): the announcer would withdraw
        // every VIP of a stopping daemon.
        self.stop_host_writers().await;
        self.hand_over_sockets(&mut report).await;
        self.save_state(&mut report).await;
        self.leave_host_objects(&mut report).await;
        report
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::daemon::testing::daemon;

    #[tokio::test(start_paused = true)]
    async fn a_sigterm_hands_over_only_within_the_intent_s_bound() {
        let d = daemon();
        assert_eq!(d.stop_kind(), StopKind::Drain, "no word: a stop drains");
        d.request_hand_over();
        assert_eq!(d.stop_kind(), StopKind::HandOver);
        tokio::time::advance(INTENT_TTL + Duration::from_secs(1)).await;
        assert_eq!(
            d.stop_kind(),
            StopKind::Drain,
            "the restart never came: a later stop drains"
        );
    }
}

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
//! The three parts, one file each (and the carrier the second part's
//! connections and flows travel in, `carrier`):
//! - `sockets`: listeners, connections and flows into the store;
//! - `state`: operator states, health verdicts, affinity and leases into the
//!   state file, which the next process reads back;
//! - `host`: the kernel objects, routes, addresses and keepalived's and
//!   conntrackd's files left in place for the next process to adopt.

use std::sync::Arc;
use std::time::Duration;

use super::Daemon;
use crate::fd_store::{FdStore, Inherited};
use crate::metrics::hand_over::{FallbackReason, LastHandOver};

mod carrier;
mod host;
mod sockets;
mod state;

pub use host::{HandOverMarker, MARKER_FILE, MARKER_KEPT_FILE, MARKER_MAX_AGE, MarkerError};

/// How long a restart announced by `prepare-stop` waits for its SIGTERM:
/// systemd sends it right after `ExecStop=` ends, so a minute is plenty;
/// a later SIGTERM (the restart failed and an operator stops the unit by
/// hand) drains, as a stop must.
pub const INTENT_BOUND: Duration = Duration::from_secs(60);

/// How long the stored listeners no listener has taken are kept when the
/// config has leased VIPs, for their leases to come back.
pub const LEASE_BOUND: Duration = Duration::from_secs(60);

/// The store name of the memfd in which a process tells the next one what
/// it handed over and when it stopped accepting.
const RECORD: &str = "hand-over";

/// Why a stop drains although a restart was announced; a warning names it,
/// and `hand_over_fallbacks_total{reason}` counts it.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NoHandOver {
    /// No `$NOTIFY_SOCKET`, or a unit without `FileDescriptorStoreMax=`.
    #[error(
        "no file descriptor store: the daemon runs outside systemd or its unit has no FileDescriptorStoreMax= (see docs/operations.md, restart)"
    )]
    NoStore,
    /// More to keep than the unit's store takes.
    #[error(
        "the file descriptor store is too small: {needed} descriptors to keep, FileDescriptorStoreMax={max}; raise it in a drop-in (see docs/operations.md, restart)"
    )]
    StoreTooSmall {
        /// Descriptors this process has in the store.
        needed: usize,
        /// The unit's `FileDescriptorStoreMax=`.
        max: usize,
    },
    /// `prepare-stop` spoke longer than [`INTENT_BOUND`] before the signal.
    #[error("the restart announced by prepare-stop {0:?} ago expired (bound {INTENT_BOUND:?})")]
    Expired(Duration),
}

impl NoHandOver {
    /// The metric's label.
    pub fn reason(&self) -> FallbackReason {
        match self {
            Self::NoStore => FallbackReason::NoStore,
            Self::StoreTooSmall { .. } => FallbackReason::StoreTooSmall,
            Self::Expired(_) => FallbackReason::Expired,
        }
    }
}

/// A restart announced by `prepare-stop`, waiting for its SIGTERM.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Intent {
    at: tokio::time::Instant,
    store_max: Option<usize>,
}

/// The store and what it handed this process (see `sockets`).
#[derive(Default)]
pub(crate) struct Fds {
    pub(crate) store: FdStore,
    pub(crate) inherited: Arc<Inherited>,
    /// The open connections and flows the last process handed over, taken
    /// by their listeners as they start (`sockets`).
    pub(crate) open: Arc<std::sync::Mutex<carrier::Received>>,
}

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
    /// Hands everything to the next process of the unit instead of draining:
    /// see the module's doc.
    ///
    /// `/readyz` stays as it was: for a client (keepalived's track script
    /// among them) the daemon is not going away, its ports keep listening.
    pub async fn hand_over(&self) -> HandOverReport {
        let mut report = HandOverReport::default();
        // First: no writer into the host may act on what follows (a
        // listener leaving, `stopping` set): the announcer would withdraw
        // every VIP of a stopping daemon.
        self.stop_host_writers().await;
        // The restart's window opens here: no process accepts from now on.
        let stopped_accepting = crate::fd_store::unix_millis();
        self.hand_over_sockets(&mut report).await;
        self.save_state(&mut report).await;
        self.leave_host_objects(&mut report).await;
        self.metrics.hand_over().record_done();
        self.store_record(&report, stopped_accepting);
        report
    }

    /// Uses `store` for every socket bound from now on, and takes sockets
    /// by name from `inherited` instead of binding: call before the first
    /// apply.
    pub fn use_fd_store(&self, store: FdStore, inherited: Arc<Inherited>) {
        for problem in inherited.problems() {
            tracing::warn!("inherited descriptors: {problem}");
        }
        // Before any listener starts: each takes its own as it does.
        let open = carrier::receive(&inherited, &store);
        let (connections, flows) = open.len();
        if connections + flows > 0 {
            tracing::info!(
                connections,
                flows,
                "open connections and flows handed over by the last process: each listener takes its own as it starts"
            );
        }
        *self.fds.write().unwrap_or_else(|p| p.into_inner()) = Fds {
            store,
            inherited,
            open: Arc::new(std::sync::Mutex::new(open)),
        };
    }

    /// The store sockets go into (off outside systemd).
    pub fn fd_store(&self) -> FdStore {
        self.fds
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .store
            .clone()
    }

    /// What the store handed this process at start, not taken yet.
    pub fn inherited(&self) -> Arc<Inherited> {
        Arc::clone(&self.fds.read().unwrap_or_else(|p| p.into_inner()).inherited)
    }

    /// `prepare-stop --restart` (`POST /hand-over`): the next SIGTERM, if
    /// it comes within [`INTENT_BOUND`], hands over instead of draining.
    /// `store_max`: the unit's `FileDescriptorStoreMax=`, when known. A
    /// hand-over that cannot be done is refused now, with the reason (the
    /// stop will drain; warned and counted).
    pub fn announce_restart(&self, store_max: Option<usize>) -> Result<Duration, NoHandOver> {
        if let Some(why) = self.hand_over_refusal(store_max) {
            self.fall_back(&why);
            *self.intent.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return Err(why);
        }
        *self.intent.lock().unwrap_or_else(|p| p.into_inner()) = Some(Intent {
            at: tokio::time::Instant::now(),
            store_max,
        });
        tracing::info!(
            stored_fds = self.fd_store().stored_fds(),
            ?store_max,
            "restart announced: the next SIGTERM hands the sockets to the next process instead of draining"
        );
        Ok(INTENT_BOUND)
    }

    /// What the SIGTERM that came now does: hand over when a restart was
    /// announced within [`INTENT_BOUND`] and can still be done, else drain.
    pub fn stop_kind(&self) -> StopKind {
        let Some(intent) = self.intent.lock().unwrap_or_else(|p| p.into_inner()).take() else {
            return StopKind::Drain;
        };
        let age = intent.at.elapsed();
        let refusal = if age > INTENT_BOUND {
            Some(NoHandOver::Expired(age))
        } else {
            self.hand_over_refusal(intent.store_max)
        };
        match refusal {
            Some(why) => {
                self.fall_back(&why);
                StopKind::Drain
            }
            None => StopKind::HandOver,
        }
    }

    /// Whether a restart is announced and waiting for its signal, and since when.
    pub fn restart_announced(&self) -> Option<Duration> {
        self.intent
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .map(|i| i.at.elapsed())
    }

    fn fall_back(&self, why: &NoHandOver) {
        self.metrics.hand_over().record_fallback(why.reason());
        tracing::warn!(
            reason = why.reason().label(),
            "restart without hand-over: {why}; this stop drains as a stop does (new clients refused until the next process binds)"
        );
    }

    /// Leaves the report and the time accepting stopped for the next process.
    fn store_record(&self, report: &HandOverReport, stopped_accepting: u64) {
        let record = LastHandOver {
            listeners: report.listeners as u64,
            connections: report.connections as u64,
            flows: report.flows as u64,
            lost: report.lost as u64,
            window_ms: stopped_accepting,
        };
        let text = format!(
            "{} {} {} {} {}",
            record.window_ms, record.listeners, record.connections, record.flows, record.lost
        );
        let name = crate::fd_store::FdName::new(RECORD).expect("a valid name");
        if let Err(e) = self.fd_store().store_bytes(&name, text.as_bytes()) {
            tracing::warn!("{e}; the next process will not report this restart's window");
        }
    }

    /// At start, after the listeners are in force: reads what the last
    /// process left (the store's record), takes it out of the store,
    /// and records the restart's window (its stop of accepting to now).
    /// Closes the stored listeners the config no longer has.
    ///
    /// With `ipam = "dhcp"` load balancers the stored listeners left are
    /// closed only after a bound (`LEASE_BOUND`, 60 s): a leased VIP's listeners bind once
    /// its lease is back, and adopt their sockets then.
    pub fn adopted(&self) -> Option<LastHandOver> {
        let store = self.fd_store();
        let inherited = self.inherited();
        let leased = self
            .lock()
            .config
            .as_ref()
            .is_some_and(|c| c.load_balancers.iter().any(|l| l.dhcp.is_some()));
        let open = self.open_handed();
        let close_rest = move || {
            sockets::close_unadopted(&open);
            for gone in inherited.close_rest(crate::fd_store::LISTENER_PREFIX, &store) {
                tracing::info!(name = %gone, "a stored listener the config no longer has: closed and taken out of the store");
            }
        };
        if leased && !self.inherited().names().is_empty() {
            tokio::spawn(async move {
                tokio::time::sleep(LEASE_BOUND).await;
                close_rest();
            });
        } else {
            close_rest();
        }
        let store = self.fd_store();
        let inherited = self.inherited();
        let name = crate::fd_store::FdName::new(RECORD).expect("a valid name");
        let bytes = inherited.take_bytes(&name)?;
        store.remove_or_warn(&name);
        let text = String::from_utf8_lossy(&bytes);
        let n: Vec<u64> = text
            .split_whitespace()
            .filter_map(|w| w.parse().ok())
            .collect();
        let [stopped, listeners, connections, flows, lost] = n[..] else {
            tracing::warn!(record = %text, "the last process's hand-over record is not readable; ignored");
            return None;
        };
        let last = LastHandOver {
            listeners,
            connections,
            flows,
            lost,
            window_ms: crate::fd_store::unix_millis().saturating_sub(stopped),
        };
        self.metrics.hand_over().set_last(last);
        tracing::info!(
            listeners,
            connections,
            flows,
            lost,
            window_ms = last.window_ms,
            adopted_listening_sockets = self.metrics.hand_over().adopted(),
            "restarted: the last process's sockets adopted"
        );
        Some(last)
    }
}

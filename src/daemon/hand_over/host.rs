//! The host's objects, left for the next process to adopt.
//!
//! A hand-over stops every task that writes into the host and removes
//! nothing: the NAT tables (open kernel flows and new ones keep their
//! DNAT through the restart), the isolation, VM-network, reply-mark, gate
//! and anycast tables, the VIPs' local routes and the announce routes (no
//! withdraw: no BGP churn), the networks' routes and rules, the leased
//! VIPs' macvlans and addresses (no DHCPRELEASE), keepalived's and
//! conntrackd's files and processes. Then it writes the marker
//! ([`HandOverMarker`], `handed-over` beside the admin socket): the
//! unit's `ExecStopPost=harvester-lb withdraw --all` finds it and leaves
//! the routes, and the next process finds it at start and adopts what it
//! finds instead of deleting and writing it again (the announce routes
//! kept announced, the whole tables of [`crate::host::owned::adopt`] kept with
//! their handles).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use super::HandOverReport;
use crate::daemon::Daemon;
use crate::host::owned::adopt;

/// The marker's file name, beside the admin socket (under the unit:
/// `/run/harvester-lb/handed-over`, kept across a restart by
/// `RuntimeDirectoryPreserve=restart`).
pub const MARKER_FILE: &str = "handed-over";

/// The marker once `withdraw --all` has left the routes for it: a second
/// `withdraw --all` (the `ExecStopPost=` of a next process that failed to
/// start) no longer finds [`MARKER_FILE`] and withdraws; the next process
/// takes either.
pub const MARKER_KEPT_FILE: &str = "handed-over.kept";

/// A marker older than this is stale: the restart it was written for
/// never came (or came and failed). A restart's stop-then-start takes
/// seconds; two minutes leave room for a slow `ExecStopPost=`.
pub const MARKER_MAX_AGE: Duration = Duration::from_secs(120);

/// What a handing-over process leaves for `withdraw --all` and for the
/// next process: who wrote it and when (a marker of another boot, or
/// older than [`MARKER_MAX_AGE`], is stale and ignored), and the tables it
/// wrote ([`adopt::Written`]), which the next process adopts when they
/// are unchanged.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct HandOverMarker {
    /// `/proc/sys/kernel/random/boot_id` when it was written.
    pub boot_id: String,
    /// The process that handed over.
    pub pid: u32,
    /// When, in Unix seconds.
    pub at: u64,
    /// The whole tables it wrote, by name.
    #[serde(default)]
    pub tables: BTreeMap<String, adopt::Written>,
}

/// Why a marker was not taken.
#[derive(Debug, thiserror::Error)]
pub enum MarkerError {
    /// It could not be read or written.
    #[error("the hand-over marker {path}: {source}")]
    Io {
        /// The marker's path.
        path: PathBuf,
        /// What the system said.
        source: std::io::Error,
    },
    /// It is not a marker this daemon writes.
    #[error("the hand-over marker {path} is not valid: {detail}")]
    Invalid {
        /// The marker's path.
        path: PathBuf,
        /// What is wrong.
        detail: String,
    },
    /// It is stale: ignored.
    #[error(
        "the hand-over marker {path} is stale ({why}): ignored, everything starts as after a stop"
    )]
    Stale {
        /// The marker's path.
        path: PathBuf,
        /// Which bound it failed.
        why: String,
    },
}

fn boot_id() -> String {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .map(|s| s.trim().to_string())
        .unwrap_or_default()
}

fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

impl HandOverMarker {
    /// The marker's path for the daemon whose admin socket is `admin_socket`.
    pub fn path(admin_socket: &Path) -> PathBuf {
        admin_socket
            .parent()
            .unwrap_or_else(|| Path::new("."))
            .join(MARKER_FILE)
    }

    /// Where `withdraw --all` moves the marker once it has left the routes
    /// for the next process ([`MARKER_KEPT_FILE`]).
    pub fn kept_path(admin_socket: &Path) -> PathBuf {
        Self::path(admin_socket).with_file_name(MARKER_KEPT_FILE)
    }

    /// `withdraw --all`: the fresh marker for the daemon whose admin socket
    /// is `admin_socket`, moved aside so that only this one `withdraw --all`
    /// leaves the routes (a next process that fails to start before taking
    /// it has its own `ExecStopPost=` withdraw them). `None`: withdraw.
    pub fn keep_routes(admin_socket: &Path) -> Result<Option<Self>, MarkerError> {
        let path = Self::path(admin_socket);
        let Some(marker) = Self::read(&path)? else {
            return Ok(None);
        };
        std::fs::rename(&path, Self::kept_path(admin_socket)).map_err(|source| {
            MarkerError::Io {
                path: path.clone(),
                source,
            }
        })?;
        Ok(Some(marker))
    }

    /// This process, now, with `tables`.
    fn now(tables: BTreeMap<String, adopt::Written>) -> Self {
        Self {
            boot_id: boot_id(),
            pid: std::process::id(),
            at: unix_now(),
            tables,
        }
    }

    /// Writes it at `path` atomically (a temporary file renamed over it).
    pub fn write(&self, path: &Path) -> Result<(), MarkerError> {
        let io = |source| MarkerError::Io {
            path: path.to_path_buf(),
            source,
        };
        let tmp = path.with_extension("tmp");
        let text = serde_json::to_vec(self).map_err(|e| io(std::io::Error::other(e)))?;
        std::fs::write(&tmp, text).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    /// The marker at `path` if there is one and it is fresh: written in
    /// this boot, at most [`MARKER_MAX_AGE`] ago. Leaves the file.
    pub fn read(path: &Path) -> Result<Option<Self>, MarkerError> {
        let text = match std::fs::read(path) {
            Ok(t) => t,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
            Err(source) => {
                return Err(MarkerError::Io {
                    path: path.to_path_buf(),
                    source,
                });
            }
        };
        let marker: Self = serde_json::from_slice(&text).map_err(|e| MarkerError::Invalid {
            path: path.to_path_buf(),
            detail: e.to_string(),
        })?;
        let stale = |why: String| MarkerError::Stale {
            path: path.to_path_buf(),
            why,
        };
        if marker.boot_id != boot_id() {
            return Err(stale(format!(
                "written in another boot, {}",
                marker.boot_id
            )));
        }
        let age = unix_now().saturating_sub(marker.at);
        if age > MARKER_MAX_AGE.as_secs() {
            return Err(stale(format!(
                "written {age} s ago by process {}, more than {} s",
                marker.pid,
                MARKER_MAX_AGE.as_secs()
            )));
        }
        Ok(Some(marker))
    }

    /// At start: the fresh marker at `path`, if any; the file is removed
    /// whatever it holds, so a later stop of this process (or a failed
    /// start's `ExecStopPost=`) withdraws as after any stop.
    pub fn take(path: &Path) -> Option<Self> {
        let marker = Self::read(path);
        match std::fs::remove_file(path) {
            Ok(()) => {}
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => {
                tracing::warn!(path = %path.display(), "cannot remove the hand-over marker: {e}")
            }
        }
        match marker {
            Ok(m) => m,
            Err(e) => {
                tracing::warn!("{e}");
                None
            }
        }
    }
}

impl Daemon {
    /// Stops the daemon's tasks that write into the host, removing nothing
    /// (the first step of a hand-over: before the listeners go).
    pub(super) async fn stop_host_writers(&self) {
        // Each under its own lock, so no step that began before runs on
        // after this: the NAT tables, the announcer (no withdraw), the
        // VM-network task (keepalived's file, the networks' routes, the
        // reply marks, the guard, conntrackd and the gate).
        let kernel = std::sync::Arc::clone(&self.kernel);
        if let Err(e) = tokio::task::spawn_blocking(move || kernel.leave()).await {
            tracing::error!("handing over: the kernel table writer ended abnormally: {e}");
        }
        self.announcer.leave().await;
        self.vmnet_leave().await;
        // No verdict changes anything any more; the last ones stay
        // readable for the state file's last write (`save_state`).
        self.prober.freeze();
        // No RELEASE: the leases, their macvlans and addresses stay.
        self.leases.leave().await;
    }

    /// The last step of a hand-over: the marker for `withdraw --all` and the
    /// next process (see the module's doc).
    pub(super) async fn leave_host_objects(&self, _report: &mut HandOverReport) {
        let Some(socket) = self.claims.identity().admin_socket else {
            tracing::warn!(
                "handing over: no admin socket known, so no hand-over marker: `withdraw --all` withdraws the routes"
            );
            return;
        };
        let path = HandOverMarker::path(&socket);
        let tables = tokio::task::spawn_blocking(|| {
            let mut tables = adopt::written();
            // A table whose writer did not read it back: read it now.
            for (name, w) in tables.iter_mut().filter(|(_, w)| w.fingerprint.is_none()) {
                w.fingerprint = crate::host::nft::list_inet_table(name)
                    .ok()
                    .flatten()
                    .and_then(|l| crate::host::owned::Fingerprint::of_nft_json(&l).ok())
                    .map(|f| f.digest());
            }
            tables
        })
        .await
        .unwrap_or_default();
        let n = tables.len();
        match HandOverMarker::now(tables).write(&path) {
            Ok(()) => tracing::info!(
                marker = %path.display(),
                tables = n,
                "handing over: every object in the host left in place for the next process"
            ),
            Err(e) => tracing::error!(
                "handing over: {e}; the unit's `withdraw --all` will withdraw the routes"
            ),
        }
    }

    /// At start: takes the hand-over marker beside `admin_socket` (removing
    /// it); with a fresh one, the tables it names are adopted when
    /// unchanged and the announce routes are kept announced. Whether one
    /// was taken.
    pub fn take_hand_over_marker(&self, admin_socket: &Path) -> bool {
        let kept = HandOverMarker::take(&HandOverMarker::kept_path(admin_socket));
        let fresh = HandOverMarker::take(&HandOverMarker::path(admin_socket));
        let Some(marker) = fresh.or(kept) else {
            return false;
        };
        tracing::info!(
            from = marker.pid,
            tables = marker.tables.len(),
            "started after a hand-over: adopting what the previous process left in the host"
        );
        adopt::inherit(marker.tables);
        self.announcer.adopt();
        true
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_fresh_marker_is_taken_once_and_a_stale_one_is_ignored_and_removed() {
        let dir = std::env::temp_dir().join(format!("hlb-marker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = HandOverMarker::path(&dir.join("admin.sock"));
        assert_eq!(path, dir.join(MARKER_FILE));
        assert!(HandOverMarker::take(&path).is_none(), "none there");

        let marker = HandOverMarker::now(BTreeMap::new());
        marker.write(&path).unwrap();
        assert_eq!(HandOverMarker::read(&path).unwrap(), Some(marker.clone()));
        assert_eq!(HandOverMarker::take(&path), Some(marker.clone()));
        assert!(!path.exists(), "taken: removed");

        let old = HandOverMarker {
            at: marker.at - MARKER_MAX_AGE.as_secs() - 1,
            ..marker.clone()
        };
        old.write(&path).unwrap();
        assert!(matches!(
            HandOverMarker::read(&path),
            Err(MarkerError::Stale { .. })
        ));
        assert!(HandOverMarker::take(&path).is_none());
        assert!(!path.exists(), "a stale one is removed too");

        let other_boot = HandOverMarker {
            boot_id: "another".into(),
            ..marker
        };
        other_boot.write(&path).unwrap();
        assert!(matches!(
            HandOverMarker::read(&path),
            Err(MarkerError::Stale { .. })
        ));
        std::fs::write(&path, b"nope").unwrap();
        assert!(matches!(
            HandOverMarker::read(&path),
            Err(MarkerError::Invalid { .. })
        ));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

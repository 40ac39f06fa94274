//! What `/status` says about the config file beyond its path: which file
//! is in force (its SHA-256, to compare with `sha256sum` on the host), the
//! last reload that was rejected while it stands (when, how it was asked,
//! every problem), and which keys a reload changed that only a restart
//! applies (`admin.listen`, `admin.socket`, `daemon.state_file`: bound or
//! read once at start).
//!
//! Before this, a rejected reload showed only in a metric and the log, and
//! a new `admin.listen` was taken in silence while the API stayed on the
//! old port. Only the reload path writes here; `/status` reads.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::SystemTime;

use serde::Serialize;

use super::Daemon;
use crate::config::Config;

/// How a reload was asked for (`/status` `config.rejected_reload.source`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum ReloadSource {
    /// `SIGHUP` (`systemctl kill -s HUP`).
    #[serde(rename = "SIGHUP")]
    Signal,
    /// `POST /reload` on the admin socket (`harvester-lb reload`,
    /// `systemctl reload`).
    #[serde(rename = "admin socket")]
    AdminSocket,
    /// `POST /reload` on `admin.listen`.
    #[serde(rename = "admin.listen")]
    AdminListen,
    /// The file watch saw the file change.
    #[serde(rename = "file change")]
    FileChange,
    /// [`crate::Server::reload`], from the embedding program (tests).
    #[serde(rename = "library call")]
    Library,
}

/// A reload that left the running config in force.
#[derive(Debug, Clone, Serialize)]
pub struct RejectedReload {
    /// When, Unix seconds.
    pub at_unix: f64,
    /// How it was asked for.
    pub source: ReloadSource,
    /// The rejected file's SHA-256 (`null` when it could not be read).
    pub sha256: Option<String>,
    /// Every problem, as `check` prints them.
    pub problems: Vec<String>,
}

/// The keys bound or read once at start, as they were then.
#[derive(Debug, Clone, PartialEq, Eq)]
struct AtStart {
    listen: SocketAddr,
    socket: PathBuf,
    state_file: Option<PathBuf>,
}

impl AtStart {
    fn of(config: &Config) -> Self {
        Self {
            listen: config.admin.listen,
            socket: config.admin.socket.clone(),
            state_file: config.daemon.state_file.clone(),
        }
    }

    /// The keys whose value in `new` differs from the one in force.
    fn changed_in(&self, new: &AtStart) -> Vec<&'static str> {
        let mut keys = Vec::new();
        if self.listen != new.listen {
            keys.push("admin.listen");
        }
        if self.socket != new.socket {
            keys.push("admin.socket");
        }
        if self.state_file != new.state_file {
            keys.push("daemon.state_file");
        }
        keys
    }
}

/// The record behind `/status`'s `config` fields of this module.
#[derive(Debug, Default)]
pub(super) struct ConfigRecord {
    /// The SHA-256 of the file in force.
    sha256: Option<String>,
    /// The last reload rejected since the last one that succeeded.
    rejected: Option<RejectedReload>,
    at_start: Option<AtStart>,
    /// Keys of the config in force that differ from what start bound.
    needs_restart: Vec<&'static str>,
}

impl ConfigRecord {
    /// See [`Daemon::config_attention`].
    fn attention(&self) -> String {
        let mut said = String::new();
        if let Some(r) = &self.rejected {
            said += &format!(
                "; last reload rejected ({} problem{}: harvester-lb status)",
                r.problems.len(),
                if r.problems.len() == 1 { "" } else { "s" }
            );
        }
        if !self.needs_restart.is_empty() {
            said += &format!("; needs a restart: {}", self.needs_restart.join(", "));
        }
        said
    }
}

/// What `/status` shows of the record.
pub(super) struct RecordStatus {
    pub sha256: Option<String>,
    pub rejected: Option<RejectedReload>,
    pub needs_restart: Vec<&'static str>,
}

impl Daemon {
    fn record(&self) -> std::sync::MutexGuard<'_, ConfigRecord> {
        self.config_record.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The first config is in force: its file's digest, and the values
    /// only a restart changes.
    pub fn config_started(&self, config: &Config, sha256: Option<String>) {
        let mut r = self.record();
        r.sha256 = sha256;
        r.at_start = Some(AtStart::of(config));
        r.rejected = None;
        r.needs_restart.clear();
    }

    /// `config` (read from a file whose digest is `sha256`) is about to be
    /// put in force by a reload: clears the rejection and returns the keys
    /// whose new value waits for a restart.
    pub fn config_reloaded(&self, config: &Config, sha256: Option<String>) -> Vec<&'static str> {
        let mut r = self.record();
        r.sha256 = sha256;
        r.rejected = None;
        r.needs_restart = r
            .at_start
            .as_ref()
            .map(|start| start.changed_in(&AtStart::of(config)))
            .unwrap_or_default();
        r.needs_restart.clone()
    }

    /// A reload asked by `source` was rejected; `problems` say why.
    pub fn config_rejected(
        &self,
        source: ReloadSource,
        sha256: Option<String>,
        problems: Vec<String>,
    ) {
        let at_unix = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0.0, |d| d.as_secs_f64());
        self.record().rejected = Some(RejectedReload {
            at_unix,
            source,
            sha256,
            problems,
        });
    }

    /// What systemd's status line (`systemctl status`: "Status: serving…")
    /// adds for the config: a rejected reload standing, keys waiting for a
    /// restart; empty when neither.
    pub fn config_attention(&self) -> String {
        self.record().attention()
    }

    pub(super) fn record_status(&self) -> RecordStatus {
        let r = self.record();
        RecordStatus {
            sha256: r.sha256.clone(),
            rejected: r.rejected.clone(),
            needs_restart: r.needs_restart.clone(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn systemds_status_line_says_a_rejected_reload_and_a_restart_needed() {
        let mut r = ConfigRecord::default();
        assert_eq!(r.attention(), "");
        r.rejected = Some(RejectedReload {
            at_unix: 1.0,
            source: ReloadSource::Signal,
            sha256: None,
            problems: vec!["line 3: x".into(), "line 4: y".into()],
        });
        r.needs_restart = vec!["admin.listen"];
        assert_eq!(
            r.attention(),
            "; last reload rejected (2 problems: harvester-lb status); needs a restart: admin.listen"
        );
    }

    #[test]
    fn only_the_keys_bound_at_start_need_a_restart() {
        let start = AtStart {
            listen: "127.0.0.1:9901".parse().unwrap(),
            socket: "/run/a.sock".into(),
            state_file: None,
        };
        assert!(start.changed_in(&start.clone()).is_empty());
        let moved = AtStart {
            listen: "127.0.0.1:9902".parse().unwrap(),
            state_file: Some("/var/lib/x".into()),
            ..start.clone()
        };
        assert_eq!(
            start.changed_in(&moved),
            ["admin.listen", "daemon.state_file"]
        );
    }
}

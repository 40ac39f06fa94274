//! Notices when the config file changes on disk.
//!
//! Controllers replace the file by rename, editors truncate and rewrite it,
//! and Kubernetes swaps a symlink under a mounted ConfigMap. A `stat(2)` of the
//! path every interval (following symlinks) sees all three the same way, where
//! an inotify watch on the file would lose track after the first rename. A
//! change is reported only once the file has stayed the same for one more
//! interval, which debounces bursts of writes and never reads a half-written file.
//! A file that disappears is reported once (not at every check), and its
//! return is a change like any other.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What identifies one version of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Version {
    inode: u64,
    device: u64,
    len: u64,
    modified: Option<SystemTime>,
    changed_nanos: i64,
}

pub(crate) fn version(path: &std::path::Path) -> Option<Version> {
    use std::os::unix::fs::MetadataExt;
    let m = std::fs::metadata(path).ok()?;
    Some(Version {
        inode: m.ino(),
        device: m.dev(),
        len: m.len(),
        modified: m.modified().ok(),
        changed_nanos: m.ctime() * 1_000_000_000 + m.ctime_nsec(),
    })
}

/// What the watch saw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Event {
    /// The file changed (or came back after it was missing) and settled.
    Changed,
    /// The file is gone (deleted, or renamed away). Sent once per
    /// disappearance, not at every check: the daemon warns once and keeps
    /// the config in force.
    Missing,
}

/// Sends an [`Event`] on `changed` each time the file at `path` has changed
/// and settled, or has gone, until `stop` is cancelled. `loaded` is the
/// version taken just before the daemon read the file: a change made
/// between that read and this task's first check is a change too (taking
/// the first version here instead missed it whenever the task started late).
pub async fn watch(
    path: PathBuf,
    loaded: Option<Version>,
    interval: Duration,
    changed: mpsc::Sender<Event>,
    stop: CancellationToken,
) {
    let mut applied = loaded;
    // Whether `Missing` was sent for the absence in `applied` (a file gone
    // before the first check is reported too).
    let mut missing_reported = false;
    let mut pending: Option<Option<Version>> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = version(&path);
        let differs = now != applied || (now.is_none() && !missing_reported);
        match &pending {
            // Settled: the same as one interval ago, and not what was applied.
            Some(seen) if *seen == now => {
                pending = None;
                if differs {
                    let event = if now.is_some() {
                        Event::Changed
                    } else {
                        Event::Missing
                    };
                    missing_reported = now.is_none();
                    applied = now;
                    if changed.send(event).await.is_err() {
                        return;
                    }
                }
            }
            _ if differs => pending = Some(now),
            _ => pending = None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An event within `within`, or `None`.
    async fn next(rx: &mut mpsc::Receiver<Event>, within: Duration) -> Option<Event> {
        tokio::time::timeout(within, rx.recv()).await.ok().flatten()
    }

    /// A deleted file is reported once however many checks follow, and its
    /// return is a change. (Real time with a 10 ms interval: the crate
    /// does not build tokio's paused clock.)
    #[tokio::test]
    async fn a_missing_file_is_reported_once_and_its_return_is_a_change() {
        let dir = std::env::temp_dir().join(format!("hlb-watch-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        std::fs::write(&path, "load_balancer = []\n").unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let stop = CancellationToken::new();
        let interval = Duration::from_millis(10);
        tokio::spawn(watch(
            path.clone(),
            version(&path),
            interval,
            tx,
            stop.clone(),
        ));
        // An event comes within 5 s; absence is judged over 30 checks.
        let soon = Duration::from_secs(5);
        let quiet = interval * 30;

        std::fs::remove_file(&path).unwrap();
        assert_eq!(next(&mut rx, soon).await, Some(Event::Missing));
        // 30 more checks while it stays gone: nothing more.
        assert_eq!(next(&mut rx, quiet).await, None);

        std::fs::write(&path, "load_balancer = []\n").unwrap();
        assert_eq!(next(&mut rx, soon).await, Some(Event::Changed));
        assert_eq!(next(&mut rx, quiet).await, None);

        // Gone again: reported again, once.
        std::fs::remove_file(&path).unwrap();
        assert_eq!(next(&mut rx, soon).await, Some(Event::Missing));
        assert_eq!(next(&mut rx, quiet).await, None);
        stop.cancel();
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A rename over the file between the daemon's read and the watch's
    /// first check is still a change (the flake of
    /// `reload::replacing_the_file_by_rename_triggers_a_reload`, whose
    /// watch task started after the test had already renamed).
    #[tokio::test]
    async fn a_change_before_the_first_check_is_not_missed() {
        let dir = std::env::temp_dir().join(format!("hlb-watch-early-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("config.toml");
        std::fs::write(&path, "load_balancer = []\n").unwrap();
        let loaded = version(&path);
        let tmp = dir.join("config.toml.tmp");
        std::fs::write(&tmp, "load_balancer = []\n# new\n").unwrap();
        std::fs::rename(&tmp, &path).unwrap();
        let (tx, mut rx) = mpsc::channel(4);
        let stop = CancellationToken::new();
        tokio::spawn(watch(
            path.clone(),
            loaded,
            Duration::from_millis(10),
            tx,
            stop.clone(),
        ));
        assert_eq!(
            next(&mut rx, Duration::from_secs(5)).await,
            Some(Event::Changed)
        );
        stop.cancel();
        let _ = std::fs::remove_dir_all(&dir);
    }
}

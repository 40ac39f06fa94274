//! Notices when the config file changes on disk.
//!
//! Controllers replace the file by rename, editors truncate and rewrite it,
//! and Kubernetes swaps a symlink under a mounted ConfigMap. A `stat(2)` of the
//! path every interval (following symlinks) sees all three the same way, where
//! an inotify watch on the file would lose track after the first rename. A
//! change is reported only once the file has stayed the same for one more
//! interval, which debounces bursts of writes and never reads a half-written file.

use std::path::PathBuf;
use std::time::{Duration, SystemTime};

use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;

/// What identifies one version of the file.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Version {
    inode: u64,
    device: u64,
    len: u64,
    modified: Option<SystemTime>,
    changed_nanos: i64,
}

fn version(path: &std::path::Path) -> Option<Version> {
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

/// Sends `()` on `changed` each time the file at `path` has changed and
/// settled, until `stop` is cancelled.
pub async fn watch(
    path: PathBuf,
    interval: Duration,
    changed: mpsc::Sender<()>,
    stop: CancellationToken,
) {
    let mut applied = version(&path);
    let mut pending: Option<Option<Version>> = None;
    let mut ticker = tokio::time::interval(interval);
    ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = ticker.tick() => {}
        }
        let now = version(&path);
        match &pending {
            // Settled: the same as one interval ago, and not what was applied.
            Some(seen) if *seen == now => {
                pending = None;
                if now != applied && now.is_some() {
                    applied = now;
                    if changed.send(()).await.is_err() {
                        return;
                    }
                }
            }
            _ if now != applied => pending = Some(now),
            _ => pending = None,
        }
    }
}

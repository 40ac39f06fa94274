//! The state that must survive a restart, into the state file
//! (`daemon::persist` writes it; here, the last write of a hand-over).

use super::HandOverReport;
use crate::daemon::Daemon;

impl Daemon {
    /// Writes the state file one last time, before anything is handed over
    /// or stopped: the next process restores it before its first probe.
    pub(super) async fn save_state(&self, _report: &mut HandOverReport) {
        self.write_state_last().await;
    }
}

#[cfg(test)]
mod tests {
    use std::net::IpAddr;
    use std::path::Path;

    use std::sync::Arc;

    use crate::daemon::Daemon;
    use crate::daemon::testing::{config, daemon, lb};
    use crate::dataplane::balancer::AdminState;
    use crate::state_file::StateFile;

    const CONFIG: &str = "/etc/harvester-lb/config.toml";

    /// A daemon started on `lb_table` with its state file in `dir` (made
    /// empty), as at a start: restored, applied, restore finished.
    fn with_state_file(dir: &Path, lb_table: &str) -> Arc<Daemon> {
        let _ = std::fs::remove_dir_all(dir);
        let text = format!(
            "[daemon]\nstate_file = {:?}\n{lb_table}",
            dir.join("state.json").display().to_string(),
        );
        let d = daemon();
        let cfg = config(&text);
        d.restore_state(Path::new(CONFIG), &cfg);
        d.apply(cfg);
        d.finish_restore();
        d
    }

    /// The state file in `dir`, as the next process reads it.
    fn kept(dir: &Path) -> StateFile {
        crate::state_file::load(
            &dir.join("state.json"),
            Path::new(CONFIG),
            std::time::SystemTime::now(),
        )
        .expect("trusted")
        .expect("written")
    }

    /// A hand-over writes the file with what is live, and is its last
    /// write: a stop that follows (or the periodic writer) cannot replace
    /// it with the emptied state of a daemon whose probes have stopped.
    #[tokio::test]
    async fn a_hand_over_writes_the_state_file_last() {
        let dir = std::env::temp_dir().join(format!("hlb-hand-over-state-{}", std::process::id()));
        let d = with_state_file(
            &dir,
            &lb(
                "a/web",
                "127.231.41.1",
                &["127.231.41.11", "127.231.41.12"],
                &[18080],
                30080,
                "",
            ),
        );
        let drained: IpAddr = "127.231.41.11".parse().unwrap();
        d.set_admin_state("a/web", drained, AdminState::Drain)
            .unwrap();

        d.hand_over().await;
        let kept = kept(&dir);
        assert_eq!(
            kept.load_balancers["a/web"].backends[&drained]
                .admin
                .as_deref(),
            Some("drain")
        );
        d.set_admin_state("a/web", drained, AdminState::Ready)
            .unwrap();
        assert!(
            !d.write_state_last().await,
            "no write after the hand-over's"
        );
        let again = std::fs::read(dir.join("state.json")).expect("still there");
        assert!(String::from_utf8_lossy(&again).contains("drain"));
        d.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The hand-over's last write keeps the health verdicts: the probes
    /// stop first (no verdict may change what is left in the host), but
    /// their last verdicts are still read for the file, so the next
    /// process starts with the backends it knew healthy (on the code
    /// before, stopping the probes dropped the targets and the file kept
    /// no verdict: with `initial_state = "unhealthy"` the next process
    /// refused new clients until its first probes).
    #[tokio::test]
    async fn a_hand_over_keeps_the_health_verdicts_in_the_state_file() {
        let dir =
            std::env::temp_dir().join(format!("hlb-hand-over-verdicts-{}", std::process::id()));
        let backend: IpAddr = "127.231.44.11".parse().unwrap();
        let probed = std::net::TcpListener::bind((backend, 30080)).unwrap();
        let d = with_state_file(
            &dir,
            &lb(
                "a/web",
                "127.231.44.1",
                &["127.231.44.11"],
                &[18080],
                30080,
                "initial_state = \"unhealthy\"\n  [load_balancer.health_check]\n  period_seconds = 1\n  timeout_seconds = 1",
            ),
        );
        tokio::time::timeout(std::time::Duration::from_secs(10), async {
            while d.lock().load_balancers["a/web"]
                .lb
                .snapshot()
                .eligible
                .is_empty()
            {
                tokio::time::sleep(std::time::Duration::from_millis(10)).await;
            }
        })
        .await
        .expect("the backend probed healthy within 10 s");

        d.hand_over().await;
        let health = kept(&dir)
            .load_balancers
            .get("a/web")
            .and_then(|l| l.backends.get(&backend))
            .map(|b| b.health.clone())
            .unwrap_or_default();
        assert_eq!(health.len(), 1, "the backend's verdict kept: {health:?}");
        assert_eq!(health[0].status, "healthy");
        assert_eq!(health[0].consecutive_successes, 1);
        d.shutdown().await;
        drop(probed);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

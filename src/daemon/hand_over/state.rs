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

    use crate::balancer::AdminState;
    use crate::daemon::testing::{config, daemon, lb};

    /// A hand-over writes the file with what is live, and is its last
    /// write: a stop that follows (or the periodic writer) cannot replace
    /// it with the emptied state of a daemon whose probes have stopped.
    #[tokio::test]
    async fn a_hand_over_writes_the_state_file_last() {
        let dir = std::env::temp_dir().join(format!("hlb-hand-over-state-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let file = dir.join("state.json");
        let text = format!(
            "[daemon]\nstate_file = {:?}\n{}",
            file.display().to_string(),
            lb(
                "a/web",
                "127.231.41.1",
                &["127.231.41.11", "127.231.41.12"],
                &[18080],
                30080,
                ""
            )
        );
        let d = daemon();
        let cfg = config(&text);
        d.restore_state(Path::new("/etc/harvester-lb/config.toml"), &cfg);
        d.apply(cfg);
        d.finish_restore();
        let drained: IpAddr = "127.231.41.11".parse().unwrap();
        d.set_admin_state("a/web", drained, AdminState::Drain)
            .unwrap();

        d.hand_over().await;
        let kept = crate::state_file::load(
            &file,
            Path::new("/etc/harvester-lb/config.toml"),
            std::time::SystemTime::now(),
        )
        .expect("trusted")
        .expect("written");
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
        let again = std::fs::read(&file).expect("still there");
        assert!(String::from_utf8_lossy(&again).contains("drain"));
        d.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}

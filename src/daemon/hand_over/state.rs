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

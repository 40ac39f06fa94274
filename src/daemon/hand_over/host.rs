//! The host's objects, left for the next process to adopt.

use super::HandOverReport;
use crate::daemon::Daemon;

impl Daemon {
    /// Stops the daemon's tasks that write into the host, removing nothing.
    pub(super) async fn leave_host_objects(&self, _report: &mut HandOverReport) {}
}

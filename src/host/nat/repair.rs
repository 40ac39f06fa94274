//! The checks of the kernel NAT tables (see `kernel::check`): every
//! [`crate::host::owned::CHECK_INTERVAL`] and at every reload the tables are
//! read back on a blocking thread (never on the runtime's, never holding
//! the table's lock across the read, so a flip is not delayed); a
//! difference is logged once with what differed, counted in
//! `kernel_repairs_total`, reported in `/status` and
//! `kernel_forwarding_up` until the repair, and repaired by the writer's
//! next sync, a full resync of everything that is ours.

use std::sync::Arc;
use std::time::Duration;

use super::Daemon;
use crate::host::nat::Checked;

/// Why the tables were checked: said in the repair's log line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KernelCheckCause {
    /// A reload (SIGHUP, `POST /reload`, a changed file).
    Reload,
    /// The periodic check.
    Timer,
}

/// How many times a check that a write crossed is tried again in one
/// round, and the wait before each: a flip or a reload's write is over in
/// milliseconds.
const BUSY_TRIES: usize = 5;
const BUSY_WAIT: Duration = Duration::from_millis(100);

impl Daemon {
    /// Reads the kernel NAT tables back and compares them with what this
    /// daemon wrote; on a difference logs it, counts it and wakes the
    /// writer, whose next sync writes everything again.
    pub async fn check_kernel_tables(&self, cause: KernelCheckCause) {
        for _ in 0..BUSY_TRIES {
            let table = Arc::clone(&self.kernel);
            match tokio::task::spawn_blocking(move || table.check()).await {
                Ok(Ok(Checked::Busy)) => {
                    tokio::time::sleep(BUSY_WAIT).await;
                    continue;
                }
                Ok(Ok(Checked::Repairing(what))) => {
                    self.metrics.record_kernel_repair();
                    tracing::warn!(
                        found = match cause {
                            KernelCheckCause::Reload => "at reload",
                            KernelCheckCause::Timer => "by the periodic check",
                        },
                        "the kernel NAT tables are not the ones this daemon wrote ({what}): another process changed them (`nft flush ruleset`, a firewall reload, a second harvester-lb?); the listeners this breaks are not reported as kernel-forwarded until all the tables are written again, now"
                    );
                    self.kernel_wake.notify_one();
                }
                Ok(Ok(Checked::InPlace | Checked::NothingOwned)) => {}
                // Nothing changes: the next check reads again.
                Ok(Err(e)) => tracing::warn!("checking the kernel NAT tables: {e}"),
                Err(e) => tracing::error!("the kernel NAT table check ended abnormally: {e}"),
            }
            return;
        }
        tracing::debug!("every kernel NAT table check of this round was crossed by a write");
    }

    /// [`Self::check_kernel_tables`] for a reload, in a task of its own:
    /// the reload's answer does not wait for the read-back.
    pub fn check_kernel_tables_soon(&self) {
        let Some(me) = self.me.upgrade() else { return };
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            return;
        };
        runtime.spawn(async move { me.check_kernel_tables(KernelCheckCause::Reload).await });
    }
}

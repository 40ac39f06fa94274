//! The checks of the kernel NAT tables (the comparison is `host::nat::check`; this is its task side): every
//! [`crate::host::owned::CHECK_INTERVAL`] and at every reload the tables are
//! read back on a blocking thread (never on the runtime's, never holding
//! the table's lock across the read, so a flip is not delayed); a
//! difference is logged once with what differed, counted in
//! `kernel_repairs_total`, reported in `/status` and
//! `kernel_forwarding_up` until the repair, and repaired by the writer's
//! next sync, a full resync of everything that is ours.

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::Notify;

use super::{Checked, KernelTable};
use crate::metrics::Metrics;

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

/// Reads the kernel NAT tables (`table`) back and compares them with what
/// this daemon wrote; on a difference logs it, counts it (`metrics`) and
/// wakes the writer (`wake`), whose next sync writes everything again.
pub async fn check_and_repair(
    table: &Arc<KernelTable>,
    metrics: &Metrics,
    wake: &Notify,
    cause: KernelCheckCause,
) {
    for _ in 0..BUSY_TRIES {
        let table = Arc::clone(table);
        match tokio::task::spawn_blocking(move || table.check()).await {
            Ok(Ok(Checked::Busy)) => {
                tokio::time::sleep(BUSY_WAIT).await;
                continue;
            }
            Ok(Ok(Checked::Repairing(what))) => {
                metrics.record_kernel_repair();
                tracing::warn!(
                    found = match cause {
                        KernelCheckCause::Reload => "at reload",
                        KernelCheckCause::Timer => "by the periodic check",
                    },
                    "the kernel NAT tables are not the ones this daemon wrote ({what}): another process changed them (`nft flush ruleset`, a firewall reload, a second harvester-lb?); the listeners this breaks are not reported as kernel-forwarded until all the tables are written again, now"
                );
                wake.notify_one();
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

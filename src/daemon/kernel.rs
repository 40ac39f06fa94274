//! Driving the kernel's NAT table (`forwarding = "kernel"` listeners):
//! the desired state from the config and the published eligible sets, one
//! coalesced transaction after each change, a retry after a failure.
//!
//! Every publish of a load balancer's snapshot (a health transition, an
//! operator's drain, a reload) wakes one task; it waits a few
//! milliseconds so that a burst of flips is one transaction, builds the
//! desired state and hands it to [`KernelTable::sync`], which writes
//! nothing when the kernel already has it. The task starts with the first
//! apply, which the server runs after the admin port and socket are bound.

use std::time::Duration;

use crate::config::{Forwarding, OnBackendDown};
use crate::kernel::{Desired, KernelListener, KernelTable, Synced};

use super::*;

/// How long a wake-up waits for more changes before the transaction.
const COALESCE: Duration = Duration::from_millis(5);
/// How long after a failed transaction the next full resync is tried.
const RETRY: Duration = Duration::from_secs(2);
/// How often the kernel's per-backend counters are read for `/metrics`.
const COUNTERS_EVERY: Duration = Duration::from_secs(5);

impl Daemon {
    /// The kernel NAT table's owner.
    pub fn kernel(&self) -> &Arc<KernelTable> {
        &self.kernel
    }

    /// Reads the host's forwarding settings; logs a change of them at
    /// error (off) or info (on again). Returns whether they changed.
    fn check_ip_forwarding(&self) -> bool {
        let (v4, v6) = crate::os::ip_forwarding();
        let off = u8::from(!v4) | (u8::from(!v6) << 1);
        let was = self.forwarding_off.swap(off, Ordering::AcqRel);
        if was == off {
            return false;
        }
        let has_kernel = self.lock().config.as_ref().is_some_and(|c| {
            c.load_balancers.iter().any(|lb| {
                lb.listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
            })
        });
        if !has_kernel {
            return true;
        }
        for (bit, sysctl) in [
            (1u8, "net.ipv4.ip_forward"),
            (2, "net.ipv6.conf.all.forwarding"),
        ] {
            match (was & bit != 0, off & bit != 0) {
                (false, true) => tracing::error!(
                    "{sysctl} is 0 on this host: the kernel would drop every packet it forwards, so the forwarding = \"kernel\" listeners of that family are served by the proxy until it is 1 (the daemon does not change it)"
                ),
                (true, false) => tracing::info!(
                    "{sysctl} is 1 again: kernel listeners of that family go back to the kernel"
                ),
                _ => {}
            }
        }
        true
    }

    /// Why a kernel listener on `vip` is not in the kernel although its
    /// table is written: the host does not forward its family.
    pub(super) fn forwarding_blocked(&self, vip: IpAddr) -> Option<String> {
        let off = self.forwarding_off.load(Ordering::Acquire);
        let (bit, sysctl) = if vip.is_ipv4() {
            (1, "net.ipv4.ip_forward")
        } else {
            (2, "net.ipv6.conf.all.forwarding")
        };
        (off & bit != 0).then(|| {
            format!("{sysctl} is 0 on this host: the kernel would drop the packets it forwards; set it to 1 (the daemon does not change it); the proxy serves this listener meanwhile")
        })
    }

    /// The kernel listeners of the config in force, with the backends
    /// each may send new connections to now.
    pub(super) fn kernel_desired(&self) -> Desired {
        self.check_ip_forwarding();
        let st = self.lock();
        let mut desired = Desired::new();
        let Some(config) = &st.config else {
            return desired;
        };
        for spec in &config.load_balancers {
            if spec.vip.is_unspecified() || self.forwarding_blocked(spec.vip).is_some() {
                continue; // A DHCP VIP not leased yet; a family not forwarded.
            }
            let Some(entry) = st.load_balancers.get(&spec.name) else {
                continue;
            };
            let snapshot = entry.lb.snapshot();
            for l in spec
                .listeners
                .iter()
                .filter(|l| l.forwarding == Forwarding::Kernel)
            {
                desired.insert(
                    (spec.vip, l.protocol, l.port),
                    KernelListener {
                        backend_port: l.backend_port,
                        members: spec.backends.clone(),
                        eligible: snapshot
                            .eligible_for(l.backend_port)
                            .iter()
                            .map(|b| b.addr)
                            .collect(),
                        source_ranges: (!spec.source_ranges.is_everyone())
                            .then(|| spec.source_ranges.ranges().to_vec()),
                        source_nat: l.source_nat,
                        close_down: if spec.on_backend_down == OnBackendDown::Close {
                            spec.backends
                                .iter()
                                .filter(|ip| {
                                    entry
                                        .backends
                                        .get(ip)
                                        .is_some_and(|b| !b.is_healthy_on(l.backend_port))
                                })
                                .copied()
                                .collect()
                        } else {
                            Vec::new()
                        },
                    },
                );
            }
        }
        desired
    }

    /// Asks for a sync, starting the task that runs them on first use.
    pub(super) fn kernel_wake(&self) {
        self.kernel_wake.notify_one();
        if self.kernel_task.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.kernel_task.store(false, Ordering::Release);
            return;
        };
        let me = self.me.clone();
        let wake = Arc::clone(&self.kernel_wake);
        runtime.spawn(async move {
            let mut counters = tokio::time::interval(COUNTERS_EVERY);
            counters.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let sync = tokio::select! {
                    () = wake.notified() => true,
                    _ = counters.tick() => false,
                };
                if !sync {
                    let Some(daemon) = me.upgrade() else { return };
                    if daemon.check_ip_forwarding() {
                        daemon.kernel_wake.notify_one();
                    }
                    daemon.read_kernel_counters().await;
                    continue;
                }
                tokio::time::sleep(COALESCE).await;
                let Some(daemon) = me.upgrade() else { return };
                // A publish may change which VIPs this host should announce.
                daemon.announcer_wake();
                if daemon.is_stopping() {
                    return;
                }
                let desired = daemon.kernel_desired();
                let table = Arc::clone(&daemon.kernel);
                let listeners = desired.len();
                // After a write, the UDP flows of backends that left are
                // deleted: their entries would keep them for ever.
                let result = tokio::task::spawn_blocking(move || {
                    table.sync(&desired).map(|synced| {
                        let swept = matches!(synced, Synced::Written(_))
                            .then(|| crate::kernel::delete_stale_flows(&desired));
                        (synced, swept)
                    })
                })
                .await;
                match result {
                    Ok(Ok((Synced::Unchanged, _))) => {}
                    Ok(Ok((Synced::Written(took), swept))) => {
                        daemon.metrics.kernel_synced(took);
                        tracing::debug!(listeners, ?took, "kernel NAT table written");
                        match swept {
                            Some(Ok(0)) | None => {}
                            Some(Ok(n)) => tracing::info!(
                                flows = n,
                                "deleted the conntrack entries of UDP flows whose backend left, and of TCP flows to reset (on_backend_down = \"close\")"
                            ),
                            Some(Err(e)) => tracing::error!(
                                "could not delete the conntrack entries of flows whose backend left (UDP clients with a fixed source port stay on it until their flow times out): {e}"
                            ),
                        }
                    }
                    Ok(Err(e)) => {
                        daemon.metrics.kernel_sync_failed();
                        tracing::error!(listeners, "{e}; retrying with a full resync in {RETRY:?}");
                        let wake = Arc::clone(&daemon.kernel_wake);
                        tokio::spawn(async move {
                            tokio::time::sleep(RETRY).await;
                            wake.notify_one();
                        });
                    }
                    Err(e) => tracing::error!("the kernel table writer ended abnormally: {e}"),
                }
            }
        });
    }

    /// Reads the kernel's per-backend new-connection counters into
    /// `/metrics` (one `nft` call; none while no listener is in the kernel).
    async fn read_kernel_counters(&self) {
        let wanted: Vec<(String, String, String, crate::kernel::ListenerId, IpAddr)> = {
            let st = self.lock();
            let Some(config) = &st.config else { return };
            config
                .load_balancers
                .iter()
                .filter(|spec| !spec.vip.is_unspecified())
                .flat_map(|spec| {
                    spec.listeners
                        .iter()
                        .filter(|l| l.forwarding == Forwarding::Kernel)
                        .flat_map(move |l| {
                            spec.backends.iter().map(move |b| {
                                (
                                    spec.cluster.clone(),
                                    spec.name.clone(),
                                    l.name.clone(),
                                    (spec.vip, l.protocol, l.port),
                                    *b,
                                )
                            })
                        })
                })
                .collect()
        };
        if !wanted.iter().any(|w| self.kernel.forwards(&w.3)) {
            self.metrics.set_kernel_backends(Vec::new());
            return;
        }
        let read = tokio::task::spawn_blocking(crate::kernel::counters).await;
        let counts: HashMap<String, u64> = match read {
            Ok(Ok(c)) => c.into_iter().collect(),
            Ok(Err(e)) => {
                tracing::warn!("reading the kernel's counters: {e}");
                return;
            }
            Err(e) => {
                tracing::error!("the kernel counter reader ended abnormally: {e}");
                return;
            }
        };
        let out = wanted
            .into_iter()
            .filter_map(|(cluster, load_balancer, listener, id, backend)| {
                let connections = *counts.get(&crate::kernel::backend_counter(&id, backend))?;
                Some(crate::metrics::KernelBackendCount {
                    cluster,
                    load_balancer,
                    listener,
                    backend,
                    connections,
                })
            })
            .collect();
        self.metrics.set_kernel_backends(out);
    }

    /// At a clean stop, after the drain: the table goes, so nothing is
    /// forwarded by rules nobody keeps. (A crash leaves it: the kernel
    /// forwards on the last verdicts until the next start reconciles.)
    pub(super) async fn kernel_remove(&self) {
        let table = Arc::clone(&self.kernel);
        match tokio::task::spawn_blocking(move || table.remove()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("at stop: {e}"),
            Err(e) => tracing::error!("at stop: the kernel table writer ended abnormally: {e}"),
        }
    }
}

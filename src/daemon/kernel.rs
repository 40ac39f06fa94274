//! Driving the kernel's NAT tables (`forwarding = "kernel"` listeners):
//! the desired state from the config and the published eligible sets, one
//! coalesced transaction after each change, a retry after a failure.
//!
//! Every publish of a load balancer's snapshot (a health transition, an
//! operator's drain, a reload) wakes one task; it waits 1 ms (10 ms within
//! 100 ms of its last write, so that a burst of flips is fewer
//! transactions), rebuilds the desired state of what published and hands
//! it to [`KernelTable::sync_changed`], which writes nothing when the
//! kernel already has it. The task starts with the first
//! apply, which the server runs after the admin port and socket are bound.
//!
//! Why a kernel listener is served by the proxy instead (the host's
//! forwarding, the bridge stage, a leg without source NAT) is in `blocked`.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Weak};
use std::time::Duration;

use super::{Daemon, KernelCheckCause, LbEntry};
use crate::config::{Config, Forwarding, LoadBalancerSpec, OnBackendDown, Protocol, SourceNat};
use crate::dataplane::balancer::Backend;
use crate::host::nat::{Desired, KernelListener, KernelTable, ListenerId, Narrowed, Synced};

mod blocked;

/// How long a wake-up waits for more changes before the transaction, when
/// the writer has been quiet for [`QUIET_AFTER`]: a lone health flip goes
/// to the kernel at once (the flip target is 20 ms at 10,000 listeners).
const COALESCE_QUIET: Duration = Duration::from_millis(1);
/// … and within [`QUIET_AFTER`] of the last write: a burst (a node's
/// verdicts arriving probe by probe, an operator draining a host) is
/// batched into fewer transactions, each of which validates the tables it
/// touches.
const COALESCE_BUSY: Duration = Duration::from_millis(10);
/// How long after a write the writer counts as busy.
const QUIET_AFTER: Duration = Duration::from_millis(100);
/// How long after a failed transaction the next full resync is tried.
const RETRY: Duration = Duration::from_secs(2);
/// How long a load balancer whose listeners the kernel refused (while it
/// took everyone else's) stays with the proxy before it is tried again;
/// a reload tries it at once. Longer than [`RETRY`]: a refusal is one
/// tenant's, and each try is a failed transaction.
const REFUSED_RETRY: Duration = Duration::from_secs(30);
/// The most refused load balancers named in one log line.
const NAMED_IN_LOG: usize = 10;
/// How often the kernel's per-backend counters are read for `/metrics`.
const COUNTERS_EVERY: Duration = Duration::from_secs(5);

/// The desired state the kernel-table writer built at its last sync, with
/// the inputs it was built from. The writer keeps it between syncs so that
/// a health flip or a drain rebuilds only the listeners of the load
/// balancers that published (a whole rebuild took ~5 ms at 10,000
/// listeners); a change of any input below (a reload or a lease, the host's
/// forwarding, other programs' forward chains) rebuilds it whole.
struct CachedDesired {
    /// The config it was built from (`State::config_generation`).
    generation: u64,
    /// The host's forwarding it was built with.
    forwarding_off: u8,
    /// The reading of other programs' forward chains it was built with.
    forward_chains: u64,
    /// The networks' legs it was built with (`VmNet::legs_generation`).
    legs: u64,
    desired: Desired,
    /// The load balancers the kernel had refused that this state tries
    /// again (a reload, or [`REFUSED_RETRY`] passed): a write that
    /// succeeds forgets their refusal.
    retried: Vec<String>,
}

/// How far [`Daemon::kernel_desired_update`] changed the cached desired
/// state: whole, or only some listeners. The writer needs it to choose a
/// full sync or one of the changed listeners alone, and to know whether
/// conntrack may hold flows to delete (compared with what was there before).
enum DesiredChange {
    /// Rebuilt whole; the desired state before, if there was one.
    Whole { previous: Option<Desired> },
    /// These listeners, each with what it was before (`None`: new).
    Listeners(Vec<(ListenerId, Option<KernelListener>)>),
}

impl DesiredChange {
    /// Whether the flows of the kernel may now hold entries to delete: see
    /// [`flows_may_be_stale`].
    fn flows_may_be_stale(&self, desired: &Desired) -> bool {
        match self {
            DesiredChange::Whole { previous: None } => true,
            DesiredChange::Whole {
                previous: Some(old),
            } => flows_may_be_stale(desired, old),
            DesiredChange::Listeners(changed) => changed.iter().any(|(id, was)| {
                desired
                    .get(id)
                    .is_some_and(|l| listener_may_leave_stale_flows(id, l, was.as_ref()))
            }),
        }
    }

    /// The listeners that may differ from the desired state before, when
    /// known.
    fn listeners(&self) -> Option<Vec<ListenerId>> {
        match self {
            DesiredChange::Whole { .. } => None,
            DesiredChange::Listeners(changed) => Some(changed.iter().map(|(id, _)| *id).collect()),
        }
    }
}

impl Daemon {
    /// The kernel NAT table's owner.
    pub fn kernel(&self) -> &Arc<KernelTable> {
        &self.kernel
    }

    /// The kernel listeners of the config in force, with the backends
    /// each may send new connections to now.
    pub(super) fn kernel_desired(&self) -> Desired {
        let mut cached = None;
        self.kernel_desired_update(&mut cached);
        cached.map(|k| k.desired).unwrap_or_default()
    }

    /// Brings `cached` up to date: rebuilt whole after a change of config
    /// (a reload, a lease) or of the host's forwarding, and otherwise only
    /// for the load balancers that published since (a health flip, a
    /// drain): at 10,000 listeners the whole rebuild took ~5 ms of a flip.
    fn kernel_desired_update(&self, cached: &mut Option<CachedDesired>) -> DesiredChange {
        self.check_ip_forwarding();
        let forwarding_off = self.forwarding_off.load(Ordering::Acquire);
        let forward_chains = self.forward_chains.generation();
        let legs = self.vmnet.legs_generation.load(Ordering::Acquire);
        let st = self.lock();
        let Some(config) = &st.config else {
            let previous = cached.take().map(|k| k.desired);
            *cached = Some(CachedDesired {
                generation: st.config_generation,
                forwarding_off,
                forward_chains,
                legs,
                desired: Desired::new(),
                retried: Vec::new(),
            });
            return DesiredChange::Whole { previous };
        };
        let mut changed = Vec::new();
        let whole = !cached.as_ref().is_some_and(|k| {
            k.generation == st.config_generation
                && k.forwarding_off == forwarding_off
                && k.forward_chains == forward_chains
                && k.legs == legs
        });
        let mut desired = if whole {
            Desired::new()
        } else {
            std::mem::take(&mut cached.as_mut().expect("cached").desired)
        };
        let refused = self.kernel.refused();
        if whole {
            // Gone from the config: nothing to try again.
            let named: std::collections::HashSet<&str> = config
                .load_balancers
                .iter()
                .map(|lb| lb.name.as_str())
                .collect();
            self.kernel.accept(
                refused
                    .keys()
                    .map(String::as_str)
                    .filter(|o| !named.contains(o)),
            );
        }
        let mut retried = Vec::new();
        for spec in &config.load_balancers {
            let Some(entry) = st.load_balancers.get(&spec.name) else {
                continue;
            };
            let published = entry.lb.take_published();
            if let Some(at) = refused.get(&spec.name) {
                // Left out of the kernel until tried again: at a reload, or
                // when its time comes.
                if !whole && at.elapsed() < REFUSED_RETRY {
                    continue;
                }
                retried.push(spec.name.clone());
            } else if !published && !whole {
                continue;
            }
            for (id, l) in self.kernel_listeners(spec, entry, config) {
                let previous = desired.insert(id, l);
                if !whole {
                    changed.push((id, previous));
                }
            }
        }
        let previous = cached.take().map(|k| k.desired);
        *cached = Some(CachedDesired {
            generation: st.config_generation,
            forwarding_off,
            forward_chains,
            legs,
            desired,
            retried,
        });
        if whole {
            DesiredChange::Whole { previous }
        } else {
            DesiredChange::Listeners(changed)
        }
    }

    /// One load balancer's kernel listeners; none while its DHCP VIP is
    /// not leased or the host does not forward its family.
    fn kernel_listeners(
        &self,
        spec: &LoadBalancerSpec,
        entry: &LbEntry,
        config: &Config,
    ) -> Vec<(ListenerId, KernelListener)> {
        if spec.vip.is_unspecified()
            || self.forwarding_blocked(spec.vip).is_some()
            || self.bridge_stage_blocked(spec, config).is_some()
        {
            return Vec::new();
        }
        let snapshot = entry.lb.snapshot();
        let on_leg = self.on_leg(spec, config);
        spec.listeners
            .iter()
            .filter(|l| l.forwarding == Forwarding::Kernel)
            .map(|l| {
                let listener = KernelListener {
                    backend_port: l.backend_port,
                    members: spec.backends.clone(),
                    eligible: snapshot
                        .eligible_for(l.backend_port)
                        .iter()
                        .map(|b| b.addr)
                        .collect(),
                    source_ranges: (!spec.source_ranges.is_everyone())
                        .then(|| spec.source_ranges.ranges().to_vec()),
                    // The leg has no address: masquerade would take
                    // another interface's (the management address).
                    source_nat: match l.source_nat {
                        SourceNat::Masquerade if on_leg => SourceNat::Vip,
                        other => other,
                    },
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
                    pick: spec.algorithm,
                    affinity: spec.affinity_timeout,
                };
                ((spec.vip, l.protocol, l.port), listener)
            })
            .collect()
    }

    /// Reads the kernel NAT tables back and compares them with what this
    /// daemon wrote; on a difference logs it, counts it and wakes the
    /// writer (see [`crate::host::nat::repair`]).
    pub async fn check_kernel_tables(&self, cause: KernelCheckCause) {
        crate::host::nat::repair::check_and_repair(
            &self.kernel,
            &self.metrics,
            &self.kernel_wake,
            cause,
        )
        .await;
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

    /// Starts, once, the kernel writer's two tasks (at the first apply):
    /// the readings for `/metrics` and the host's facts
    /// ([`kernel_readings`]) and the writes of the NAT tables
    /// ([`kernel_writer`]), which waits on the `kernel_wake` notify. Waking
    /// the writer is `kernel_wake.notify_one()`, nothing else.
    pub(super) fn start_kernel_writer(&self) {
        if self.kernel_task.swap(true, Ordering::AcqRel) {
            return;
        }
        let Ok(runtime) = tokio::runtime::Handle::try_current() else {
            self.kernel_task.store(false, Ordering::Release);
            return;
        };
        runtime.spawn(kernel_readings(self.me.clone()));
        runtime.spawn(kernel_writer(
            self.me.clone(),
            Arc::clone(&self.kernel_wake),
        ));
    }

    /// Reads the kernel's per-backend new-connection counters into
    /// `/metrics` (one `nft` call; none while no listener is in the kernel).
    async fn read_kernel_counters(&self) {
        let wanted: Vec<(String, String, String, crate::host::nat::ListenerId, IpAddr)> = {
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
        let forwarded = self.kernel.forwarded();
        if !wanted.iter().any(|w| forwarded.contains(&w.3)) {
            self.metrics.set_kernel_backends(Vec::new());
            return;
        }
        // The read and the matching (tens of thousands of names at scale)
        // off the runtime's threads, where a flip's request waits.
        let read = tokio::task::spawn_blocking(move || {
            let counts: HashMap<String, u64> = crate::host::nat::counters()?.into_iter().collect();
            Ok::<_, crate::host::nat::NftError>(
                wanted
                    .into_iter()
                    .filter_map(|(cluster, load_balancer, listener, id, backend)| {
                        let connections =
                            *counts.get(&crate::host::nat::backend_counter(&id, backend))?;
                        Some(crate::metrics::KernelBackendCount {
                            cluster,
                            load_balancer,
                            listener,
                            backend,
                            connections,
                        })
                    })
                    .collect(),
            )
        })
        .await;
        match read {
            Ok(Ok(out)) => self.metrics.set_kernel_backends(out),
            Ok(Err(e)) => tracing::warn!("reading the kernel's counters: {e}"),
            Err(e) => tracing::error!("the kernel counter reader ended abnormally: {e}"),
        }
    }

    /// Counts the open TCP connections and UDP flows of each backend on
    /// the kernel listeners forwarded now (one conntrack dump per address
    /// family) into `backend_connections_active` and
    /// `udp_backend_flows_active`, beside the proxy's own; every other
    /// kernel part goes back to 0. No dump without such a listener.
    async fn read_kernel_connections(&self) {
        /// One load balancer: its stats, backends and listeners, with
        /// whether each is forwarded by the kernel now.
        type Group = (
            Arc<crate::metrics::LbStats>,
            Vec<Arc<Backend>>,
            Vec<(String, crate::host::nat::ListenerId, bool)>,
        );
        let forwarded = self.kernel.forwarded();
        let groups: Vec<Group> = {
            let st = self.lock();
            let Some(config) = &st.config else { return };
            config
                .load_balancers
                .iter()
                .filter_map(|spec| {
                    let entry = st.load_balancers.get(&spec.name)?;
                    let listeners = spec
                        .listeners
                        .iter()
                        .map(|l| {
                            let id = (spec.vip, l.protocol, l.port);
                            let kernel =
                                l.forwarding == Forwarding::Kernel && forwarded.contains(&id);
                            (l.name.clone(), id, kernel)
                        })
                        .collect();
                    let backends = entry.backends.values().cloned().collect();
                    Some((Arc::clone(entry.lb.stats()), backends, listeners))
                })
                .collect()
        };
        let kernel: Vec<_> = groups
            .iter()
            .flat_map(|(_, _, ls)| ls.iter().filter(|l| l.2).map(|l| l.1))
            .collect();
        let counts = if kernel.is_empty() {
            HashMap::new()
        } else {
            match tokio::task::spawn_blocking(move || crate::host::nat::open_connections(&kernel))
                .await
            {
                Ok(Ok(c)) => c,
                Ok(Err(e)) => {
                    tracing::warn!("counting the kernel's open flows in conntrack: {e}");
                    return;
                }
                Err(e) => {
                    tracing::error!("the conntrack counter ended abnormally: {e}");
                    return;
                }
            }
        };
        let of = |id: &crate::host::nat::ListenerId, ip: IpAddr| counts.get(&(*id, ip)).copied();
        for (stats, backends, listeners) in groups {
            for b in backends {
                let open: u64 = listeners
                    .iter()
                    .filter(|(_, id, kernel)| *kernel && id.1 == Protocol::Tcp)
                    .filter_map(|(_, id, _)| of(id, b.addr))
                    .sum();
                b.stats().kernel_active.store(open, Ordering::Relaxed);
            }
            for (name, id, kernel) in listeners.iter().filter(|l| l.1.1 == Protocol::Udp) {
                let listener = stats.udp_listener(name);
                let udp = listener.udp();
                // Zero what was counted before; a backend with flows now
                // gets its entry (as the proxy's first flow makes it).
                for (ip, be) in udp.backends() {
                    let n = if *kernel { of(id, ip).unwrap_or(0) } else { 0 };
                    be.kernel_flows.store(n, Ordering::Relaxed);
                }
                if !*kernel {
                    continue;
                }
                for ((l, ip), n) in &counts {
                    if l == id {
                        udp.backend(*ip).kernel_flows.store(*n, Ordering::Relaxed);
                    }
                }
            }
        }
    }

    /// At a clean stop: the kernel's open TCP connections drain beside the
    /// proxy's, then the table goes.
    ///
    /// Deleting the table cuts every flow it NATed at once (the kernel
    /// drops the NAT bindings of conntrack entries when their chains go: a
    /// connection open through the kernel met a reset at the next segment),
    /// so it waits: first every kernel listener keeps its chains with no
    /// eligible backend, which refuses new flows as the closed proxy
    /// listener does (the UDP flows go now: a datagram flow has no end to
    /// wait for); then the open TCP entries of those listeners are counted
    /// in conntrack until none is left or `drain` passes. Returns how many
    /// the timeout cut. (A crash leaves the table: the kernel forwards on
    /// the last verdicts until the next start reconciles.)
    pub(super) async fn kernel_drain_and_remove(&self, drain: Duration) -> usize {
        let deadline = tokio::time::Instant::now() + drain;
        let mut closing = self.kernel_desired();
        closing.retain(|id, _| self.kernel.forwards(id));
        let mut cut = 0;
        if !closing.is_empty() {
            for l in closing.values_mut() {
                l.eligible.clear();
                l.close_down.clear();
            }
            let tcp: Vec<_> = closing
                .keys()
                .filter(|id| id.1 == Protocol::Tcp)
                .copied()
                .collect();
            // The flows of a VIP keepalived moves with `[conntrackd]` stay:
            // they go on to the peer with the VIP.
            let moving = self.kernel_moving_at_stop();
            let sweep = Self::kernel_sweep_at_stop(&closing, &moving);
            let table = Arc::clone(&self.kernel);
            let closed = tokio::task::spawn_blocking(move || {
                table
                    .sync(&closing)
                    .map(|_| crate::host::nat::delete_stale_flows(&sweep))
            })
            .await;
            match closed {
                Ok(Ok(_)) => {
                    tracing::info!(
                        listeners = tcp.len(),
                        "stopping: the kernel listeners refuse new connections; their open ones drain"
                    );
                    cut = self.kernel_wait_closed(tcp, &moving, deadline).await;
                }
                Ok(Err(e)) => tracing::error!("at stop, refusing new kernel connections: {e}"),
                Err(e) => tracing::error!("at stop: the kernel table writer ended abnormally: {e}"),
            }
        }
        let table = Arc::clone(&self.kernel);
        match tokio::task::spawn_blocking(move || table.remove()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("at stop: {e}"),
            Err(e) => tracing::error!("at stop: the kernel table writer ended abnormally: {e}"),
        }
        cut
    }

    /// The kernel listeners on a VIP keepalived moves while `[conntrackd]`
    /// syncs it: their flows go on to the peer with the VIP, so a stop
    /// neither deletes them nor waits for them once the VIP has left.
    fn kernel_moving_at_stop(&self) -> Vec<ListenerId> {
        self.lock()
            .config
            .as_ref()
            .filter(|c| c.conntrackd.is_some())
            .map(|c| {
                crate::host::conntrack_sync::conntrackd::gated(c)
                    .into_iter()
                    .map(|g| (g.vip, g.protocol, g.port))
                    .collect()
            })
            .unwrap_or_default()
    }

    /// The listeners of `closing` whose UDP flows a stop deletes: all but
    /// the `moving` ones. conntrackd syncs the kernel's deletions too:
    /// deleted here before the VIP moved, the peer's copy of those flows
    /// goes with them, and its commit picks each flow up anew on a backend
    /// chosen again (measured: up to 2 of 4 UDP flows moved at a graceful
    /// stop). Left alone, they go on through this host until the VIP
    /// moves, then through the peer on the same backend; the notify script
    /// deletes this host's copies once the peer carries them.
    fn kernel_sweep_at_stop(closing: &Desired, moving: &[ListenerId]) -> Desired {
        closing
            .iter()
            .filter(|(id, _)| !moving.contains(id))
            .map(|(id, l)| (*id, l.clone()))
            .collect()
    }

    /// Polls conntrack until the open TCP connections of `listeners` are
    /// gone or `deadline` passes; returns how many were still open.
    ///
    /// A `moving` listener's connections count only while this host holds
    /// its VIP: once keepalived has given the VIP to another host (the
    /// stop failed the track script), conntrackd has put the flows there
    /// and they go on through that host. Their entries here see no more
    /// packets and would keep the stop waiting for the whole drain
    /// timeout, then be reported as cut although none was.
    async fn kernel_wait_closed(
        &self,
        listeners: Vec<ListenerId>,
        moving: &[ListenerId],
        deadline: tokio::time::Instant,
    ) -> usize {
        const POLL: Duration = Duration::from_millis(200);
        if listeners.is_empty() {
            return 0;
        }
        let mut moved: Vec<IpAddr> = Vec::new();
        loop {
            let ids = listeners.clone();
            let counts =
                match tokio::task::spawn_blocking(move || crate::host::nat::open_connections(&ids))
                    .await
                {
                    Ok(Ok(counts)) => counts,
                    Ok(Err(e)) => {
                        tracing::warn!("at stop, counting the kernel's open connections: {e}");
                        return 0;
                    }
                    Err(e) => {
                        tracing::error!("at stop: the conntrack counter ended abnormally: {e}");
                        return 0;
                    }
                };
            let open_on = |id: &ListenerId| -> usize {
                counts
                    .iter()
                    .filter(|((c, _), _)| c == id)
                    .map(|(_, n)| *n as usize)
                    .sum()
            };
            let waiting_moving: Vec<&ListenerId> = moving
                .iter()
                .filter(|id| listeners.contains(id) && !moved.contains(&id.0) && open_on(id) > 0)
                .collect();
            if !waiting_moving.is_empty() {
                let held = held_addresses().await;
                for id in waiting_moving {
                    if held.as_ref().is_some_and(|h| !h.contains(&id.0)) && !moved.contains(&id.0) {
                        moved.push(id.0);
                        tracing::info!(
                            vip = %id.0,
                            "stopping: the VIP moved to another host; its open kernel connections go on there (conntrackd), not waited for"
                        );
                    }
                }
            }
            let open: usize = listeners
                .iter()
                .filter(|id| id.1 == Protocol::Tcp && !moved.contains(&id.0))
                .map(open_on)
                .sum();
            if open == 0 {
                return 0;
            }
            if tokio::time::Instant::now() + POLL > deadline {
                tracing::warn!(
                    connections = open,
                    "the drain timeout passed with connections open through the kernel; removing the table resets them"
                );
                return open;
            }
            tokio::time::sleep(POLL).await;
        }
    }
}

/// The addresses this host holds now (every interface), or `None` when
/// they cannot be read (then a moving VIP's connections are waited for,
/// as any other's).
async fn held_addresses() -> Option<Vec<IpAddr>> {
    let read = async {
        let writer = crate::host::announce::routes::RouteWriter::connect()?;
        crate::host::vip_guard::HostNet::read(writer.handle()).await
    };
    match read.await {
        Ok(host) => Some(host.addresses.into_iter().map(|a| a.ip).collect()),
        Err(e) => {
            tracing::warn!("at stop, reading the host's addresses (is a VIP still here?): {e}");
            None
        }
    }
}

/// A refused write narrowed to the load balancers that cause it.
impl Daemon {
    /// Each load balancer's kernel listeners in the config in force: whose
    /// objects are whose, for [`crate::host::nat::KernelTable::narrow`].
    fn kernel_owners(&self) -> Vec<(String, Vec<ListenerId>)> {
        let st = self.lock();
        let Some(config) = &st.config else {
            return Vec::new();
        };
        config
            .load_balancers
            .iter()
            .map(|spec| {
                let ids = spec
                    .listeners
                    .iter()
                    .filter(|l| l.forwarding == Forwarding::Kernel)
                    .map(|l| (spec.vip, l.protocol, l.port))
                    .collect();
                (spec.name.clone(), ids)
            })
            .collect()
    }

    /// After the write of `desired` failed with `error`: the load balancers
    /// whose listeners the kernel refuses are left out and the rest
    /// written (blocking: it runs `nft`). Returns the rest's write and what
    /// was left out, or `error` alone when no load balancer is to blame.
    fn kernel_narrow(
        &self,
        table: &KernelTable,
        desired: &Desired,
        error: crate::host::nat::NftError,
    ) -> (
        Result<Synced, crate::host::nat::NftError>,
        Option<(Narrowed, crate::host::nat::NftError)>,
    ) {
        match table.narrow(desired, &self.kernel_owners()) {
            Some(mut narrowed) => {
                let synced = std::mem::replace(&mut narrowed.synced, Ok(Synced::Unchanged));
                (synced, Some((narrowed, error)))
            }
            None => (Err(error), None),
        }
    }

    /// Takes what [`Self::kernel_narrow`] left out from the cached state (it
    /// is not in the kernel), logs and counts the refused write, and
    /// wakes the writer when the refused load balancers are due again.
    fn kernel_refused(
        &self,
        cached: &mut CachedDesired,
        (narrowed, error): (Narrowed, crate::host::nat::NftError),
    ) {
        for id in &narrowed.left_out {
            cached.desired.remove(id);
        }
        self.metrics.kernel_sync_failed();
        let names: Vec<&str> = narrowed.refused.iter().map(|r| r.owner.as_str()).collect();
        let more = names.len().saturating_sub(NAMED_IN_LOG);
        tracing::error!(
            load_balancers = names.len(),
            "the kernel refused a write of the NAT tables ({}); narrowed to the load balancers whose listeners the kernel refuses: {:?}{}; their kernel listeners are served by the proxy (tried again in {REFUSED_RETRY:?} and at every reload), every other load balancer's are written",
            error.detail(),
            &names[..names.len().min(NAMED_IN_LOG)],
            if more > 0 {
                format!(" and {more} more")
            } else {
                String::new()
            },
        );
        for r in narrowed.refused.iter().take(NAMED_IN_LOG) {
            tracing::error!(load_balancer = &*r.owner, "{r}");
        }
        let wake = Arc::clone(&self.kernel_wake);
        tokio::spawn(async move {
            tokio::time::sleep(REFUSED_RETRY).await;
            wake.notify_one();
        });
    }
}

/// Whether going from `old` to `new` may leave conntrack entries that must
/// go: a UDP listener that is new or lost an eligible backend (its flows
/// would stay on it while each datagram refreshes them), or a backend newly
/// marked down with `on_backend_down = "close"` (its TCP flows are reset).
/// Anything else (a backend back, a drain of a TCP listener's backend)
/// leaves every entry valid, and a sweep, a dump of the whole conntrack
/// table, would only delay the next write.
/// The readings for `/metrics` and the host's facts, every
/// `COUNTERS_EVERY`, apart from the writes: a conntrack dump at scale takes
/// long enough to delay a flip. Wakes the writer when a fact it judges by
/// changed (the host's forwarding, another program's forward chains).
async fn kernel_readings(me: Weak<Daemon>) {
    let mut counters = tokio::time::interval(COUNTERS_EVERY);
    counters.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        counters.tick().await;
        let Some(daemon) = me.upgrade() else { return };
        if daemon.is_stopping() {
            return;
        }
        if daemon.check_ip_forwarding() {
            daemon.kernel_wake.notify_one();
        }
        if daemon.mgmt_routes_changed() {
            daemon.vmnet_wake();
        }
        let has_kernel = has_kernel_listener(daemon.lock().config.as_ref());
        if daemon
            .forward_chains
            .check(has_kernel, &daemon.metrics)
            .await
        {
            daemon.kernel_wake.notify_one();
        }
        daemon.read_kernel_counters().await;
        daemon.read_kernel_connections().await;
    }
}

/// The writer of the kernel NAT tables: on every wake (coalesced), the
/// desired state built again from the daemon's verdicts and written,
/// narrowed when the kernel refuses a part, the flows of departed
/// backends swept; a failed write retried with a full resync after `RETRY`.
async fn kernel_writer(me: Weak<Daemon>, wake: Arc<tokio::sync::Notify>) {
    // The desired state, cached between syncs.
    let mut cached: Option<CachedDesired> = None;
    // Until the first write, and after a failed sweep or write: the
    // next write sweeps whatever it changed.
    let mut sweep_all = true;
    // When the last write ended, for the coalescing.
    let mut last_write: Option<tokio::time::Instant> = None;
    loop {
        wake.notified().await;
        let busy = last_write.is_some_and(|t| t.elapsed() < QUIET_AFTER);
        tokio::time::sleep(if busy { COALESCE_BUSY } else { COALESCE_QUIET }).await;
        let Some(daemon) = me.upgrade() else { return };
        if daemon.is_stopping() {
            return;
        }
        // A new config (the first, a reload) may bring the first
        // kernel listener: judge the forward chains before writing.
        let generation = daemon.lock().config_generation;
        if cached.as_ref().is_none_or(|k| k.generation != generation) {
            let has_kernel = has_kernel_listener(daemon.lock().config.as_ref());
            daemon
                .forward_chains
                .check(has_kernel, &daemon.metrics)
                .await;
        }
        let change = daemon.kernel_desired_update(&mut cached);
        let Some(k) = cached.take() else { continue };
        // After a write that took a backend from a UDP listener (or
        // marked one down with on_backend_down = "close"), its flows
        // are deleted: their entries would keep them for ever. A
        // sweep dumps the whole conntrack table, so only then.
        let sweep = sweep_all || change.flows_may_be_stale(&k.desired);
        let changed = change.listeners();
        let table = Arc::clone(&daemon.kernel);
        let listeners = k.desired.len();
        let owner = Arc::clone(&daemon);
        let result = tokio::task::spawn_blocking(move || {
            let synced = match &changed {
                Some(ids) => table.sync_changed(&k.desired, ids),
                None => table.sync(&k.desired),
            };
            let (synced, narrowed) = match synced {
                Err(e) => owner.kernel_narrow(&table, &k.desired, e),
                written => (written, None),
            };
            let outcome = synced.map(|synced| {
                let swept = (sweep && matches!(synced, Synced::Written(_)))
                    .then(|| crate::host::nat::delete_stale_flows(&k.desired));
                (synced, swept)
            });
            (outcome, narrowed, k)
        })
        .await;
        let outcome = match result {
            Ok((outcome, narrowed, mut k)) => {
                let refused: Vec<String> = narrowed
                    .as_ref()
                    .map(|(n, _)| n.refused.iter().map(|r| r.owner.clone()).collect())
                    .unwrap_or_default();
                if let Some(narrowed) = narrowed {
                    daemon.kernel_refused(&mut k, narrowed);
                }
                if outcome.is_ok() {
                    // Tried again and written: no longer refused.
                    let retried = std::mem::take(&mut k.retried);
                    daemon.kernel.accept(
                        retried
                            .iter()
                            .map(String::as_str)
                            .filter(|o| !refused.iter().any(|r| r == o)),
                    );
                }
                daemon
                    .metrics
                    .set_kernel_refused(daemon.kernel.refused().len());
                cached = Some(k);
                outcome
            }
            Err(e) => {
                // `cached` is gone with the task: rebuilt whole next.
                tracing::error!("the kernel table writer ended abnormally: {e}");
                continue;
            }
        };
        match outcome {
            Ok((Synced::Unchanged, _)) => sweep_all = false,
            Ok((Synced::Written(took), swept)) => {
                last_write = Some(tokio::time::Instant::now());
                daemon.metrics.kernel_synced(took);
                tracing::debug!(listeners, ?took, "kernel NAT table written");
                sweep_all = false;
                match swept {
                    Some(Ok(0)) | None => {}
                    Some(Ok(n)) => tracing::info!(
                        flows = n,
                        "deleted the conntrack entries of UDP flows whose backend left, and of TCP flows to reset (on_backend_down = \"close\")"
                    ),
                    Some(Err(e)) => {
                        sweep_all = true;
                        tracing::error!(
                            "could not delete the conntrack entries of flows whose backend left (UDP clients with a fixed source port stay on it until their flow times out; retried at the next write): {e}"
                        );
                    }
                }
            }
            Err(e) => {
                sweep_all = true;
                daemon.metrics.kernel_sync_failed();
                tracing::error!(listeners, "{e}; retrying with a full resync in {RETRY:?}");
                let wake = Arc::clone(&daemon.kernel_wake);
                tokio::spawn(async move {
                    tokio::time::sleep(RETRY).await;
                    wake.notify_one();
                });
            }
        }
    }
}

/// Whether `config` has a `forwarding = "kernel"` listener (the forward
/// chains are read only then).
fn has_kernel_listener(config: Option<&Config>) -> bool {
    config.is_some_and(|c| {
        c.load_balancers
            .iter()
            .flat_map(|lb| &lb.listeners)
            .any(|l| l.forwarding == Forwarding::Kernel)
    })
}

fn flows_may_be_stale(new: &Desired, old: &Desired) -> bool {
    new.iter()
        .any(|(id, l)| listener_may_leave_stale_flows(id, l, old.get(id)))
}

/// [`flows_may_be_stale`] for one listener, `was` before (`None`: new).
fn listener_may_leave_stale_flows(
    id: &ListenerId,
    l: &KernelListener,
    was: Option<&KernelListener>,
) -> bool {
    let Some(was) = was else {
        return id.1 == Protocol::Udp || !l.close_down.is_empty();
    };
    (id.1 == Protocol::Udp && was.eligible.iter().any(|b| !l.eligible.contains(b)))
        || l.close_down.iter().any(|b| !was.close_down.contains(b))
}

#[cfg(test)]
mod tests;

//! The running daemon: turns a [`Config`] into listeners, load balancers and
//! probe streams, and every later config into the smallest change that gets there.
//!
//! Applying a config is a diff keyed by what survives a reload:
//! load balancers by name, backends by address within their load balancer,
//! listeners by VIP:port and protocol. What stays keeps its socket, health state and
//! counters; what goes drains; what comes starts. The first config is the
//! diff from nothing, so start-up and reload are one code path.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};
use std::time::{Duration, SystemTime};

use serde::Serialize;
use tokio::sync::Semaphore;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::balancer::{AdminState, AffinityBudget, Backend, LoadBalancer, Settings, affinity};
use crate::config::{
    Algorithm, CheckKind, Config, Ipam, ListenerSpec, LoadBalancerSpec, Protocol, ProxyProtocol,
    UdpSettings,
};
use crate::health::prober::{Prober, TargetStatus};
use crate::health::{Health, HealthState};
use crate::metrics::{ListenerStats, Metrics};
use crate::proxy::udp::{self, FlowBudget};
use crate::proxy::{self, Listener, Route, Running};
use crate::vip::dhcp::{Leases, Want};
use crate::vip::isolate::{Isolation, IsolationStatus};

/// The daemon's live state, shared by the reload path, the admin server and
/// the signal handlers.
pub struct Daemon {
    metrics: Arc<Metrics>,
    prober: Prober,
    /// Process-wide cap on forwarded connections.
    limit: Arc<Semaphore>,
    /// Everything a reload changes; locked only by reload, status and shutdown.
    state: Mutex<State>,
    /// Drains of removed listeners still running, awaited at shutdown.
    drains: TaskTracker,
    /// Set when shutdown begins: `/readyz` turns 503 so a front end stops
    /// sending here while open connections drain.
    stopping: AtomicBool,
    /// Cancelled at shutdown once listeners have drained: removed backends
    /// still waiting out their drain time are retired at once.
    retire_now: CancellationToken,
    /// The bound on client-affinity entries, shared by every load balancer
    /// (`proxy.max_affinity_entries`).
    affinity: Arc<AffinityBudget>,
    /// The nftables table that keeps the VIPs to their listeners' ports
    /// (`vip.isolate`); written by the server, beside each apply.
    isolation: Arc<Isolation>,
    /// The DHCP clients of `ipam = "dhcp"` load balancers.
    leases: Leases,
    /// Set once the task that re-applies the config on lease changes runs.
    lease_watcher: AtomicBool,
    /// This daemon, for that task (which must not keep it alive).
    me: Weak<Daemon>,
    /// The bound on UDP flows, shared by every UDP listener
    /// (`proxy.max_udp_flows`).
    udp_flows: Arc<FlowBudget>,
    /// `proxy.max_udp_flows_per_source`, for listeners started later.
    udp_per_source: AtomicUsize,
}

/// A listener's identity across reloads: one VIP:port may carry one TCP
/// and one UDP listener.
type ListenerKey = (SocketAddr, Protocol);

#[derive(Default)]
struct State {
    config: Option<Config>,
    load_balancers: HashMap<String, LbEntry>,
    listeners: HashMap<ListenerKey, ListenerEntry>,
    /// Where the config in force came from (`/status`).
    file: Option<PathBuf>,
    /// Since when the file is gone while the daemon runs on what it read.
    file_missing_since: Option<SystemTime>,
}

/// A load balancer in force. Its spec is the one in `State::config` (kept
/// once: at 10,000 load balancers a second copy cost 9 MB).
struct LbEntry {
    lb: Arc<LoadBalancer>,
    backends: HashMap<IpAddr, Arc<Backend>>,
}

struct ListenerEntry {
    load_balancer: String,
    spec: ListenerSpec,
    socket: Result<Running, String>,
    /// The numbers of the listener it serves now (`listener_up`).
    stats: Arc<ListenerStats>,
}

/// What a call to [`Daemon::apply`] changed, for the log.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct ApplyReport {
    /// Listeners bound now.
    pub listeners_bound: usize,
    /// Listeners whose socket could not be bound (see `/status`).
    pub listeners_failed: usize,
    /// Listeners removed and draining.
    pub listeners_removed: usize,
    /// Load balancers added.
    pub load_balancers_added: usize,
    /// Load balancers removed.
    pub load_balancers_removed: usize,
}

impl Daemon {
    /// A daemon with nothing configured. `max_connections` caps forwarded
    /// connections across all listeners.
    pub fn new(metrics: Arc<Metrics>, max_connections: usize) -> Arc<Self> {
        Arc::new_cyclic(|me| Self {
            metrics,
            prober: Prober::new(),
            limit: Arc::new(Semaphore::new(max_connections.min(Semaphore::MAX_PERMITS))),
            state: Mutex::new(State::default()),
            drains: TaskTracker::new(),
            stopping: AtomicBool::new(false),
            retire_now: CancellationToken::new(),
            affinity: AffinityBudget::new(0),
            isolation: Arc::new(Isolation::new()),
            leases: Leases::new(),
            lease_watcher: AtomicBool::new(false),
            me: me.clone(),
            udp_flows: FlowBudget::new(0),
            udp_per_source: AtomicUsize::new(1),
        })
    }

    /// The VIP isolation table's owner. It runs `nft`, so the server calls
    /// it on a blocking thread, and at stop.
    pub fn isolation(&self) -> &Arc<Isolation> {
        &self.isolation
    }

    /// The metric registry.
    pub fn metrics(&self) -> &Arc<Metrics> {
        &self.metrics
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes `config` the one in force, changing only what differs.
    pub fn apply(&self, config: Config) -> ApplyReport {
        let mut st = self.lock();
        self.apply_locked(&mut st, config)
    }

    /// Applies the config in force again with the DHCP leases as they are
    /// now: a VIP leased, changed or lost re-binds its listeners.
    pub fn reapply_leases(&self) {
        if self.is_stopping() {
            return;
        }
        let mut st = self.lock();
        let Some(config) = st.config.clone() else {
            return;
        };
        let report = self.apply_locked(&mut st, config);
        tracing::info!(?report, "applied the DHCP lease change");
        // The isolation table follows the leased address (it runs `nft`).
        // Config and leases are read when the write runs, so writes that
        // run out of order still end with the latest.
        if st.config.as_ref().is_some_and(|c| c.vip.isolate) {
            let me = self.me.clone();
            tokio::task::spawn_blocking(move || {
                let Some(daemon) = me.upgrade() else { return };
                let Some(config) = daemon.lock().config.clone() else {
                    return;
                };
                let leased = daemon.leased_vips();
                let result = daemon.isolation.reconcile(&config, &leased);
                let metrics = &daemon.metrics;
                if let Err(e) = &result {
                    tracing::error!("vip.isolate, after a DHCP lease change: {e}");
                }
                metrics.set_vip_isolation(Some(result.is_ok()));
            });
        }
    }

    /// The VIPs leased by DHCP now, by load balancer name.
    pub fn leased_vips(&self) -> HashMap<String, IpAddr> {
        self.leases.addresses()
    }

    /// Starts and stops DHCP clients to match `config` and puts each leased
    /// address in place of its load balancer's `0.0.0.0` VIP (back to
    /// `0.0.0.0` while unleased: its listeners are then not bound).
    fn lease_vips(&self, mut config: Config) -> Config {
        let wanted: Vec<Want> = config
            .load_balancers
            .iter()
            .filter_map(|lb| {
                lb.dhcp.as_ref().map(|d| Want {
                    name: lb.name.clone(),
                    cluster: lb.cluster.clone(),
                    spec: d.clone(),
                })
            })
            .collect();
        if wanted.is_empty() && self.leases.is_empty() {
            return config;
        }
        self.leases.reconcile(&wanted, &config.dhcp.state_directory);
        if !self.lease_watcher.swap(true, Ordering::AcqRel) {
            let changed = self.leases.changed();
            let me = self.me.clone();
            tokio::spawn(async move {
                loop {
                    changed.notified().await;
                    let Some(daemon) = me.upgrade() else { return };
                    daemon.reapply_leases();
                }
            });
        }
        for spec in &mut config.load_balancers {
            if spec.dhcp.is_some() {
                let vip = self
                    .leases
                    .address(&spec.name)
                    .map_or(IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), IpAddr::V4);
                if spec.vip != vip {
                    Arc::make_mut(spec).vip = vip;
                }
            }
        }
        config
    }

    fn apply_locked(&self, st: &mut State, config: Config) -> ApplyReport {
        let config = self.lease_vips(config);
        let mut report = ApplyReport::default();
        let drain = config.proxy.drain_timeout;
        self.affinity.set_max(config.proxy.max_affinity_entries);
        self.udp_flows
            .set_max(config.proxy.max_udp_flows.map_or_else(
                || udp::default_max_flows(crate::os::open_file_limit().unwrap_or(1024)),
                |n| n.get(),
            ));
        let per_source = config.proxy.max_udp_flows_per_source.get();
        self.udp_per_source.store(per_source, Ordering::Relaxed);
        let old_config = st.config.take();
        // A spec reused from the last file is the same `Arc`, and `Arc`'s
        // equality compares pointers first: unchanged load balancers cost
        // no field-by-field comparison.
        let in_force: HashMap<&str, &Arc<LoadBalancerSpec>> = old_config
            .iter()
            .flat_map(|c| &c.load_balancers)
            .map(|spec| (spec.name.as_str(), spec))
            .collect();

        // Load balancers first: listeners need their `Arc<LoadBalancer>`.
        for spec in &config.load_balancers {
            let old = in_force.get(spec.name.as_str()).copied();
            let recreate = old.is_some_and(|o| o.cluster != spec.cluster);
            if recreate && let Some(old) = st.load_balancers.remove(&spec.name) {
                self.retire_load_balancer(old, drain);
            }
            match st.load_balancers.get_mut(&spec.name) {
                // Unchanged: nothing to do (most of a reload, at scale).
                Some(_) if old == Some(spec) => {}
                Some(entry) => self.update_load_balancer(entry, spec, drain),
                None => {
                    let entry = self.new_load_balancer(spec);
                    st.load_balancers.insert(spec.name.clone(), entry);
                    report.load_balancers_added += 1;
                }
            }
        }
        let wanted: std::collections::HashSet<&str> = config
            .load_balancers
            .iter()
            .map(|l| l.name.as_str())
            .collect();
        let gone: Vec<String> = st
            .load_balancers
            .keys()
            .filter(|n| !wanted.contains(n.as_str()))
            .cloned()
            .collect();
        for name in gone {
            if let Some(entry) = st.load_balancers.remove(&name) {
                self.retire_load_balancer(entry, drain);
                report.load_balancers_removed += 1;
            }
        }

        for spec in config.load_balancers.iter().filter(|l| l.dhcp.is_some()) {
            if let Some(entry) = st.load_balancers.get(&spec.name) {
                entry.lb.stats().set_lease(self.leases.stats(&spec.name));
            }
        }

        // Listeners: keep sockets that stay, bind new ones, drain removed ones.
        let mut desired: HashMap<ListenerKey, (&LoadBalancerSpec, &ListenerSpec)> = HashMap::new();
        for lb in &config.load_balancers {
            if lb.vip.is_unspecified() {
                // A DHCP VIP not leased yet: nothing to bind.
                continue;
            }
            for l in &lb.listeners {
                desired.insert((lb.listen_addr(l), l.protocol), (lb, l));
            }
        }
        let removed: Vec<ListenerKey> = st
            .listeners
            .keys()
            .filter(|a| !desired.contains_key(a))
            .copied()
            .collect();
        for addr in removed {
            if let Some(entry) = st.listeners.remove(&addr) {
                entry.stats.up.clear();
                if let Ok(listener) = entry.socket {
                    self.drain_in_background(listener, drain);
                }
                report.listeners_removed += 1;
            }
        }
        for (addr, (lb_spec, l_spec)) in desired {
            let lb = Arc::clone(&st.load_balancers[&lb_spec.name].lb);
            if let Some(ListenerEntry {
                socket: Ok(listener),
                load_balancer,
                spec,
                ..
            }) = st.listeners.get(&addr)
                && *load_balancer == lb_spec.name
                && spec == l_spec
                && Arc::ptr_eq(&listener.route().lb, &lb)
                && listener.udp_settings().is_none_or(|u| u == lb_spec.udp)
            {
                if let Ok(Running::Udp(l)) = &st.listeners[&addr].socket {
                    l.set_per_source(per_source);
                }
                continue; // The same route would be built again.
            }
            let route = self.route(&lb, l_spec);
            let stats = Arc::clone(&route.stats);
            match st.listeners.get_mut(&addr) {
                Some(ListenerEntry {
                    socket: Ok(listener),
                    load_balancer,
                    spec,
                    stats: serving,
                }) => {
                    match listener {
                        Running::Tcp(l) => l.set_route(route),
                        Running::Udp(l) => {
                            l.set_route(route, lb_spec.udp);
                            l.set_per_source(per_source);
                        }
                    }
                    *load_balancer = lb_spec.name.clone();
                    *spec = l_spec.clone();
                    if !Arc::ptr_eq(serving, &stats) {
                        // Renamed, or now another load balancer's.
                        serving.up.clear();
                        *serving = stats;
                    }
                }
                _ => {
                    let socket =
                        self.start_listener(addr, route, lb_spec.udp, config.proxy.backlog);
                    st.listeners.insert(
                        addr,
                        ListenerEntry {
                            load_balancer: lb_spec.name.clone(),
                            spec: l_spec.clone(),
                            socket,
                            stats,
                        },
                    );
                }
            }
        }
        // After every removal above: a listener's identity may have moved
        // to another VIP:port, whose entry must not be cleared after it is set.
        for entry in st.listeners.values() {
            entry.stats.up.set(entry.socket.is_ok());
            if entry.socket.is_ok() {
                report.listeners_bound += 1;
            } else {
                report.listeners_failed += 1;
            }
        }
        self.metrics
            .set_config_in_force(config.load_balancers.len(), self.prober.streams());
        self.metrics.set_per_backend_health_check_duration(
            config.metrics.per_backend_health_check_duration,
        );
        st.config = Some(config);
        report
    }

    /// Records the path of the config file, for `/status`.
    pub fn set_config_file(&self, path: &Path) {
        self.lock().file = Some(path.to_path_buf());
    }

    /// Records that the config file has gone (`true`) or is back (`false`);
    /// `/status` says so while it is gone. Returns whether it was missing
    /// before this call.
    pub fn set_config_file_missing(&self, missing: bool) -> bool {
        let mut st = self.lock();
        let was = st.file_missing_since.is_some();
        if !missing {
            st.file_missing_since = None;
        } else if !was {
            st.file_missing_since = Some(SystemTime::now());
        }
        was
    }

    /// Tries again to bind listeners that failed (address in use, say).
    /// Returns how many are bound now.
    pub fn retry_failed_listeners(&self) -> usize {
        let mut st = self.lock();
        let backlog = st.config.as_ref().map_or(1024, |c| c.proxy.backlog);
        let failed: Vec<ListenerKey> = st
            .listeners
            .iter()
            .filter(|(_, e)| e.socket.is_err())
            .map(|(a, _)| *a)
            .collect();
        let mut fixed = 0;
        for addr in failed {
            let Some(lb) = st
                .listeners
                .get(&addr)
                .and_then(|e| st.load_balancers.get(&e.load_balancer))
                .map(|e| Arc::clone(&e.lb))
            else {
                continue;
            };
            let Some(udp) = st
                .config
                .as_ref()
                .and_then(|c| c.load_balancers.iter().find(|s| s.name == lb.name))
                .map(|s| s.udp)
            else {
                continue;
            };
            let entry = st.listeners.get_mut(&addr).expect("key from the same map");
            let route = self.route(&lb, &entry.spec);
            if let Ok(listener) = self.start_listener(addr, route, udp, backlog) {
                entry.socket = Ok(listener);
                entry.stats.up.set(true);
                fixed += 1;
            }
        }
        fixed
    }

    /// Whether a config is in force and every listener is bound.
    pub fn is_ready(&self) -> bool {
        if self.is_stopping() {
            return false;
        }
        let st = self.lock();
        st.config.is_some() && st.listeners.values().all(|e| e.socket.is_ok())
    }

    /// Whether shutdown has begun.
    pub fn is_stopping(&self) -> bool {
        self.stopping.load(Ordering::Acquire)
    }

    /// Listeners whose socket is not bound, with the reason.
    pub fn failed_listeners(&self) -> Vec<(SocketAddr, String)> {
        let st = self.lock();
        st.listeners
            .iter()
            .filter_map(|(a, e)| e.socket.as_ref().err().map(|err| (a.0, err.clone())))
            .collect()
    }

    /// Stops accepting everywhere, stops probing, and waits up to the drain
    /// timeout for open connections before closing them. Returns how many
    /// connections the timeout cut.
    pub async fn shutdown(&self) -> usize {
        self.stopping.store(true, Ordering::Release);
        let (listeners, drain) = {
            let mut st = self.lock();
            let drain = st
                .config
                .as_ref()
                .map_or(Duration::from_secs(30), |c| c.proxy.drain_timeout);
            let listeners: Vec<Running> = st
                .listeners
                .drain()
                .filter_map(|(_, e)| {
                    e.stats.up.set(false);
                    e.socket.ok()
                })
                .collect();
            (listeners, drain)
        };
        self.prober.stop_all();
        let drains = listeners.into_iter().map(|l| l.drain(drain));
        let cut: usize = futures_sum(drains).await;
        // After the drain: releasing takes the VIP off the host.
        self.leases.shutdown().await;
        self.retire_now.cancel();
        self.drains.close();
        self.drains.wait().await;
        cut
    }

    /// Sets the operator's state of backend `addr` of load balancer
    /// `load_balancer` (`POST /backends/state`) and publishes the new
    /// eligible set. `maint` takes the backend off its probe stream; leaving
    /// `maint` puts it back, starting from the load balancer's
    /// `initial_state` (its last verdict is stale by then), and probed at
    /// once or by the stream's next probe. Applied under the reload lock, so
    /// a concurrent reload sees it before or after, never half.
    pub fn set_admin_state(
        &self,
        load_balancer: &str,
        addr: IpAddr,
        state: AdminState,
    ) -> Result<AdminStateChange, AdminStateError> {
        let st = self.lock();
        let entry = st
            .load_balancers
            .get(load_balancer)
            .ok_or_else(|| AdminStateError::UnknownLoadBalancer(load_balancer.to_string()))?;
        let backend = entry
            .backends
            .get(&addr)
            .ok_or_else(|| AdminStateError::NotAMember {
                load_balancer: load_balancer.to_string(),
                backend: addr,
            })?;
        let previous = backend.set_admin_state(state);
        let spec = st
            .config
            .as_ref()
            .and_then(|c| c.load_balancers.iter().find(|l| l.name == load_balancer));
        match (previous, state) {
            (AdminState::Maint, AdminState::Maint) => {}
            (_, AdminState::Maint) => self.stop_probing(load_balancer, backend),
            (AdminState::Maint, _) => {
                if let Some(spec) = spec {
                    self.ensure_probes(entry, spec);
                }
            }
            _ => {}
        }
        entry.lb.publish();
        if let Some(config) = &st.config {
            // maint may have stopped a probe stream, leaving it started one.
            self.metrics
                .set_config_in_force(config.load_balancers.len(), self.prober.streams());
        }
        if previous != state {
            tracing::info!(
                load_balancer,
                backend = %addr,
                from = %previous,
                to = %state,
                open = backend.active_connections(),
                "backend admin state changed"
            );
        }
        Ok(AdminStateChange { previous, state })
    }

    /// Drops client-affinity entries older than their load balancer's
    /// timeout, on a blocking thread (a million entries take tens of
    /// milliseconds). The main loop calls it every few seconds.
    pub fn sweep_affinity(&self) {
        let tables: Vec<(Arc<LoadBalancer>, Duration)> = self
            .lock()
            .load_balancers
            .values()
            .filter_map(|e| {
                let timeout = e.lb.snapshot().settings.affinity_timeout?;
                e.lb.affinity().map(|_| (Arc::clone(&e.lb), timeout))
            })
            .collect();
        if tables.is_empty() {
            return;
        }
        tokio::task::spawn_blocking(move || {
            let now = affinity::now_secs();
            for (lb, timeout) in tables {
                if let Some(table) = lb.affinity() {
                    table.sweep(timeout, now);
                }
            }
        });
    }

    fn new_load_balancer(&self, spec: &LoadBalancerSpec) -> LbEntry {
        let healthy_at_start = spec.health_check.is_none()
            || spec.initial_state == crate::config::InitialState::Healthy;
        let stats = self.metrics.load_balancer(&spec.cluster, &spec.name);
        let ports = spec.checked_ports();
        let backends: HashMap<IpAddr, Arc<Backend>> = spec
            .backends
            .iter()
            .map(|ip| {
                let backend = Backend::with_stats(*ip, healthy_at_start, stats.backend(*ip));
                backend.set_checked_ports(&ports, healthy_at_start);
                (*ip, backend)
            })
            .collect();
        let members = spec
            .backends
            .iter()
            .map(|ip| Arc::clone(&backends[ip]))
            .collect();
        let lb = LoadBalancer::new(
            spec.name.clone(),
            spec.cluster.clone(),
            Settings::from(spec),
            members,
            stats,
        );
        lb.configure_affinity(spec.affinity_timeout.is_some(), &self.affinity);
        let entry = LbEntry { lb, backends };
        self.ensure_probes(&entry, spec);
        entry
    }

    fn update_load_balancer(&self, entry: &mut LbEntry, spec: &LoadBalancerSpec, drain: Duration) {
        let healthy_at_start = spec.health_check.is_none()
            || spec.initial_state == crate::config::InitialState::Healthy;
        let mut backends = HashMap::new();
        for ip in &spec.backends {
            let backend = match entry.backends.remove(ip) {
                Some(b) => b,
                None => Backend::with_stats(*ip, healthy_at_start, entry.lb.stats().backend(*ip)),
            };
            backends.insert(*ip, backend);
        }
        for (_, gone) in std::mem::replace(&mut entry.backends, backends) {
            self.stop_probing(&spec.name, &gone);
            gone.leave();
            retire_after(gone, drain, &self.drains, self.retire_now.clone());
        }
        if spec.health_check.is_none() {
            // Health checking switched off: every backend is eligible again.
            for backend in entry.backends.values() {
                self.stop_probing(&spec.name, backend);
                backend.set_checked_ports(&[], true);
                backend.set_healthy(true);
            }
        } else {
            // Targets the new check no longer has go; the rest keep their
            // state. A switch between one verdict per backend and one per
            // port starts the new targets from `initial_state`.
            let ports = spec.checked_ports();
            for backend in entry.backends.values() {
                let name = &spec.name;
                if !ports.is_empty() {
                    self.prober.remove(&(name.clone(), backend.addr, None));
                }
                for old in backend.checked_ports() {
                    if !ports.contains(&old) {
                        self.prober.remove(&(name.clone(), backend.addr, Some(old)));
                    }
                }
                backend.set_checked_ports(&ports, healthy_at_start);
            }
        }
        self.ensure_probes(entry, spec);
        let members = spec
            .backends
            .iter()
            .map(|ip| Arc::clone(&entry.backends[ip]))
            .collect();
        entry
            .lb
            .configure_affinity(spec.affinity_timeout.is_some(), &self.affinity);
        entry.lb.replace(Settings::from(spec), members);
    }

    fn ensure_probes(&self, entry: &LbEntry, spec: &LoadBalancerSpec) {
        let Some(hc) = &spec.health_check else { return };
        for ip in &spec.backends {
            let backend = &entry.backends[ip];
            if backend.admin_state() == AdminState::Maint {
                // Not probed while in maintenance; probing resumes when it leaves.
                continue;
            }
            let initial = HealthState::new(spec.initial_state);
            let healthy = initial.status == Health::Healthy;
            if let Some(port) = hc.port {
                let key = (spec.name.clone(), *ip, None);
                if self.prober.get(&key).is_none() {
                    // A backend gaining a health check starts from the initial state.
                    backend.set_healthy(healthy);
                }
                self.prober
                    .ensure(&entry.lb, backend, None, port, hc, initial);
                continue;
            }
            // No `port`: each listener's nodeport is judged on its own.
            for port in backend.checked_ports() {
                let Some(cell) = backend.port_health(port) else {
                    continue;
                };
                let key = (spec.name.clone(), *ip, Some(port));
                if self.prober.get(&key).is_none() {
                    backend.set_port_healthy(&cell, healthy);
                }
                self.prober
                    .ensure(&entry.lb, backend, Some(&cell), port, hc, initial);
            }
        }
    }

    /// Stops every probe target of `backend` of load balancer `lb`: the
    /// backend's own and each of its ports'.
    fn stop_probing(&self, lb: &str, backend: &Backend) {
        self.prober.remove(&(lb.to_string(), backend.addr, None));
        for port in backend.checked_ports() {
            self.prober
                .remove(&(lb.to_string(), backend.addr, Some(port)));
        }
    }

    fn retire_load_balancer(&self, entry: LbEntry, drain: Duration) {
        entry.lb.leave();
        for (_, backend) in entry.backends {
            self.stop_probing(&entry.lb.name, &backend);
            backend.leave();
            retire_after(backend, drain, &self.drains, self.retire_now.clone());
        }
    }

    fn route(&self, lb: &Arc<LoadBalancer>, spec: &ListenerSpec) -> Route {
        Route {
            lb: Arc::clone(lb),
            listener: spec.name.clone(),
            backend_port: spec.backend_port,
            stats: match spec.protocol {
                Protocol::Tcp => lb.stats().listener(&spec.name),
                Protocol::Udp => lb.stats().udp_listener(&spec.name),
            },
            proxy_protocol: spec.proxy_protocol,
        }
    }

    fn start_listener(
        &self,
        (addr, protocol): ListenerKey,
        route: Route,
        udp: UdpSettings,
        backlog: u32,
    ) -> Result<Running, String> {
        let (lb_name, name) = (route.lb.name.clone(), route.listener.clone());
        let bound = match protocol {
            Protocol::Tcp => proxy::bind(addr, backlog).map(|socket| {
                Running::Tcp(Listener::start(socket, route, Arc::clone(&self.limit)))
            }),
            Protocol::Udp => udp::bind(addr).map(|socket| {
                Running::Udp(udp::UdpListener::start(
                    socket,
                    route,
                    udp,
                    Arc::clone(&self.udp_flows),
                    self.udp_per_source.load(Ordering::Relaxed),
                ))
            }),
        };
        match bound {
            Ok(listener) => {
                tracing::info!(listen = %addr, %protocol, load_balancer = %lb_name, listener = %name, "listening");
                Ok(listener)
            }
            Err(e) => {
                let reason = format!("cannot bind {addr}/{protocol}: {e}");
                tracing::error!(listen = %addr, %protocol, load_balancer = %lb_name, listener = %name, error = %e, "cannot bind listener; other listeners are unaffected");
                Err(reason)
            }
        }
    }

    fn drain_in_background(&self, listener: Running, drain: Duration) {
        let addr = match &listener {
            Running::Tcp(l) => l.addr,
            Running::Udp(l) => l.addr,
        };
        tracing::info!(listen = %addr, open = listener.open_connections(), ?drain, "listener removed: draining");
        self.drains.spawn(async move {
            let cut = listener.drain(drain).await;
            tracing::info!(listen = %addr, closed_by_timeout = cut, "listener drained");
        });
    }

    /// The JSON document served at `/status`.
    pub fn status(&self) -> StatusDoc {
        let st = self.lock();
        let mut load_balancers = Vec::new();
        let specs = st
            .config
            .as_ref()
            .map(|c| c.load_balancers.as_slice())
            .unwrap_or(&[]);
        for spec in specs {
            let Some(entry) = st.load_balancers.get(&spec.name) else {
                continue;
            };
            let snapshot = entry.lb.snapshot();
            let eligible = snapshot.eligible.len();
            // UDP flows per backend, all UDP listeners of this load balancer.
            let mut udp_flows: Option<HashMap<IpAddr, usize>> = None;
            for l in spec
                .listeners
                .iter()
                .filter(|l| l.protocol == Protocol::Udp)
            {
                let counts = udp_flows.get_or_insert_with(HashMap::new);
                if let Some(Ok(running)) = st
                    .listeners
                    .get(&(spec.listen_addr(l), l.protocol))
                    .map(|e| &e.socket)
                {
                    for (ip, s) in running.route().stats.udp().backends() {
                        *counts.entry(ip).or_insert(0) +=
                            usize::try_from(s.flows_active.get()).unwrap_or(0);
                    }
                }
            }
            let listeners = spec
                .listeners
                .iter()
                .map(|l| {
                    let addr = spec.listen_addr(l);
                    let le = st.listeners.get(&(addr, l.protocol));
                    let open = le
                        .and_then(|e| e.socket.as_ref().ok())
                        .map_or(0, |s| s.open_connections());
                    ListenerStatus {
                        name: l.name.clone(),
                        address: addr,
                        backend_port: l.backend_port,
                        protocol: l.protocol.as_str(),
                        proxy_protocol: l.proxy_protocol.map(|v| match v {
                            ProxyProtocol::V1 => "v1",
                            ProxyProtocol::V2 => "v2",
                        }),
                        state: match le.map(|e| &e.socket) {
                            Some(Ok(_)) => "listening",
                            None if spec.vip.is_unspecified() => "waiting_for_lease",
                            _ => "failed",
                        },
                        error: le.and_then(|e| e.socket.as_ref().err().cloned()),
                        active_connections: if l.protocol == Protocol::Tcp { open } else { 0 },
                        active_flows: (l.protocol == Protocol::Udp).then_some(open),
                        eligible_backends: snapshot.eligible_for(l.backend_port).len(),
                    }
                })
                .collect();
            let backends = spec
                .backends
                .iter()
                .map(|ip| {
                    let b = &entry.backends[ip];
                    let probe = self
                        .prober
                        .get(&(spec.name.clone(), *ip, None))
                        .map(|t| t.status());
                    let ports = b
                        .checked_ports()
                        .into_iter()
                        .map(|port| PortStatus {
                            backend_port: port,
                            listeners: spec
                                .listeners
                                .iter()
                                .filter(|l| l.backend_port == port)
                                .map(|l| l.name.clone())
                                .collect(),
                            health: health_of(b.is_healthy_on(port)),
                            eligible: b.is_eligible_on(port),
                            probe: self
                                .prober
                                .get(&(spec.name.clone(), *ip, Some(port)))
                                .map(|t| t.status()),
                        })
                        .collect();
                    BackendStatus {
                        address: *ip,
                        health: health_of(b.is_healthy()),
                        admin_state: b.admin_state(),
                        eligible: b.is_eligible(),
                        active_connections: b.active_connections(),
                        active_flows: udp_flows.as_ref().map(|m| m.get(ip).copied().unwrap_or(0)),
                        probe,
                        ports,
                    }
                })
                .collect();
            load_balancers.push(LoadBalancerStatus {
                name: spec.name.clone(),
                cluster: spec.cluster.clone(),
                vip: spec.vip,
                ipam: match spec.ipam {
                    Ipam::Pool => "pool",
                    Ipam::Dhcp => "dhcp",
                },
                algorithm: match spec.algorithm {
                    Algorithm::RoundRobin => "round_robin",
                    Algorithm::LeastConnections => "least_connections",
                    Algorithm::SourceIp => "source_ip",
                },
                health_check: spec.health_check.is_some(),
                health_check_port: spec.health_check.as_ref().and_then(|hc| hc.port),
                health_check_per_listener: spec
                    .health_check
                    .as_ref()
                    .is_some_and(|hc| hc.port.is_none()),
                health_check_kind: spec.health_check.as_ref().map(|hc| match hc.check {
                    CheckKind::TcpConnect => "tcp",
                    CheckKind::Http(_) => "http",
                }),
                session_affinity: if spec.affinity_timeout.is_some() {
                    "client_ip"
                } else {
                    "none"
                },
                affinity_entries: spec
                    .affinity_timeout
                    .and(entry.lb.affinity())
                    .map(|table| table.len()),
                source_ranges: spec
                    .source_ranges
                    .ranges()
                    .iter()
                    .map(|n| n.to_string())
                    .collect(),
                eligible_backends: eligible,
                dhcp: spec.dhcp.as_ref().map(|d| {
                    let lease = self.leases.stats(&spec.name);
                    LeaseStatus {
                        interface: self.leases.interface(&spec.name).unwrap_or_default(),
                        parent: d.interface.clone(),
                        mac: crate::vip::dhcp::state::colons(d.mac),
                        hostname: d.hostname.clone(),
                        state: lease.as_ref().map_or("init", |l| l.phase_name()),
                        address: lease.as_ref().and_then(|l| l.address()),
                        server: lease.as_ref().and_then(|l| l.server()),
                        expires_unix: lease.as_ref().and_then(|l| l.expiry_unix()),
                        renew_at_unix: lease.as_ref().and_then(|l| l.renew_at_unix()),
                        leases_acquired: lease.as_ref().map_or(0, |l| l.acquired.get()),
                        renewals: lease.as_ref().map_or(0, |l| l.renewals.get()),
                        naks: lease.as_ref().map_or(0, |l| l.naks.get()),
                        address_changes: lease.as_ref().map_or(0, |l| l.address_changes.get()),
                    }
                }),
                listeners,
                backends,
            });
        }
        let missing_since_unix = st.file_missing_since.map(|t| {
            t.duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64())
        });
        StatusDoc {
            ready: !self.is_stopping()
                && st.config.is_some()
                && st.listeners.values().all(|e| e.socket.is_ok()),
            load_balancers,
            config: ConfigStatus {
                path: st.file.as_ref().map(|p| p.display().to_string()),
                problem: missing_since_unix.map(|_| {
                    "the file is missing (deleted or renamed away); the config read before stays in force until it reappears".to_string()
                }),
                missing_since_unix,
            },
            vip_isolation: self.isolation.status(),
        }
    }
}

/// What [`Daemon::set_admin_state`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AdminStateChange {
    /// The state before.
    pub previous: AdminState,
    /// The state now.
    pub state: AdminState,
}

/// Why an admin state could not be set: the request names something the
/// config in force does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminStateError {
    /// No load balancer of that name is in force.
    #[error("unknown load balancer {0:?}; /status lists the load balancers in force")]
    UnknownLoadBalancer(String),
    /// The address is not one of its backends.
    #[error(
        "{backend} is not a backend of load balancer {load_balancer:?}; /status lists its backends"
    )]
    NotAMember {
        /// The load balancer named.
        load_balancer: String,
        /// The address named.
        backend: IpAddr,
    },
}

/// Closes a removed backend's connections once `drain` has passed (or at
/// shutdown, after the listeners have drained).
///
/// It always waits the full drain time, even when no connection is open
/// now: a client that picked this backend from the previous snapshot may
/// still be connecting, and it deserves the same drain as everyone else.
fn retire_after(
    backend: Arc<Backend>,
    drain: Duration,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    tracker.spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(drain) => {}
            _ = shutdown.cancelled() => {}
        }
        backend.retire();
    });
}

async fn futures_sum<F: std::future::Future<Output = usize> + Send + 'static>(
    futures: impl Iterator<Item = F>,
) -> usize {
    let mut set = tokio::task::JoinSet::new();
    for f in futures {
        set.spawn(f);
    }
    let mut total = 0;
    while let Some(r) = set.join_next().await {
        total += r.unwrap_or(0);
    }
    total
}

/// `/status`: the whole picture an on-call engineer needs.
#[derive(Debug, Serialize)]
pub struct StatusDoc {
    /// Same as `/readyz`.
    pub ready: bool,
    /// Every load balancer in config order.
    pub load_balancers: Vec<LoadBalancerStatus>,
    /// The config file, and what is wrong with it while the daemon runs on
    /// what it read before.
    pub config: ConfigStatus,
    /// `vip.isolate`: whether the table is in force, and how large.
    pub vip_isolation: IsolationStatus,
}

/// The config file in `/status`: an on-call engineer must see that the
/// daemon serves a config whose file is gone, which nothing else shows.
#[derive(Debug, Serialize)]
pub struct ConfigStatus {
    /// The file's path (absent for a daemon started without one).
    pub path: Option<String>,
    /// What is wrong with the file now; `null` when nothing is.
    pub problem: Option<String>,
    /// Since when the file is missing, Unix seconds; `null` while it exists.
    pub missing_since_unix: Option<f64>,
}

/// One load balancer in `/status`.
#[derive(Debug, Serialize)]
pub struct LoadBalancerStatus {
    /// `<namespace>/<service>`.
    pub name: String,
    /// Owning guest cluster.
    pub cluster: String,
    /// The VIP.
    pub vip: IpAddr,
    /// `pool` or `dhcp`.
    pub ipam: &'static str,
    /// Picking algorithm.
    pub algorithm: &'static str,
    /// Whether backends are health checked.
    pub health_check: bool,
    /// The port probed on every backend for all listeners (one verdict per
    /// backend), when the check names one.
    pub health_check_port: Option<u16>,
    /// Whether each listener's `backend_port` is checked and judged on its
    /// own (a check without `port`): see each backend's `ports`.
    pub health_check_per_listener: bool,
    /// `tcp` or `http`, when they are.
    pub health_check_kind: Option<&'static str>,
    /// `none` or `client_ip`.
    pub session_affinity: &'static str,
    /// Clients remembered, with `client_ip` affinity.
    pub affinity_entries: Option<usize>,
    /// The clients served (`source_ranges`, normalised); absent: everyone.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub source_ranges: Vec<String>,
    /// Backends taking new connections now (with per-listener checks, on
    /// at least one listener; each listener has its own count).
    pub eligible_backends: usize,
    /// The VIP's DHCP lease (`ipam = "dhcp"` only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dhcp: Option<LeaseStatus>,
    /// Listeners.
    pub listeners: Vec<ListenerStatus>,
    /// Backends.
    pub backends: Vec<BackendStatus>,
}

/// A DHCP lease in `/status`: what an on-call engineer needs to tell a
/// VIP that is not leased yet from one that is lost or about to expire.
#[derive(Debug, Serialize)]
pub struct LeaseStatus {
    /// The macvlan interface the lease is held on.
    pub interface: String,
    /// The host interface it is made on.
    pub parent: String,
    /// The client's MAC address.
    pub mac: String,
    /// The hostname option sent.
    pub hostname: String,
    /// `init`, `selecting`, `requesting`, `rebooting`, `bound`, `renewing`
    /// or `rebinding`.
    pub state: &'static str,
    /// The leased address (the VIP); `null` without a lease.
    pub address: Option<std::net::Ipv4Addr>,
    /// The server that leased it.
    pub server: Option<std::net::Ipv4Addr>,
    /// When the lease expires unless renewed, Unix seconds.
    pub expires_unix: Option<f64>,
    /// When it is renewed (T1), Unix seconds.
    pub renew_at_unix: Option<f64>,
    /// Leases obtained.
    pub leases_acquired: u64,
    /// Leases extended.
    pub renewals: u64,
    /// NAKs taken.
    pub naks: u64,
    /// Times the VIP was lost or changed.
    pub address_changes: u64,
}

/// One listener in `/status`.
#[derive(Debug, Serialize)]
pub struct ListenerStatus {
    /// Name in the config.
    pub name: String,
    /// VIP:port.
    pub address: SocketAddr,
    /// Nodeport.
    pub backend_port: u16,
    /// Transport.
    pub protocol: &'static str,
    /// `v1` or `v2` when a PROXY protocol header goes to the backends.
    pub proxy_protocol: Option<&'static str>,
    /// `listening` or `failed`.
    pub state: &'static str,
    /// Why it failed to bind.
    pub error: Option<String>,
    /// Connections open through it (0 for a UDP listener).
    pub active_connections: usize,
    /// Backends its new connections may go to now: healthy on its
    /// `backend_port` (or on the check's port) and `ready`.
    pub eligible_backends: usize,
    /// UDP flows open through it; absent for a TCP listener.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_flows: Option<usize>,
}

/// One backend in `/status`.
#[derive(Debug, Serialize)]
pub struct BackendStatus {
    /// Node address.
    pub address: IpAddr,
    /// The health checker's verdict (the last one before `maint`); with
    /// per-listener checks, `healthy` only while every port is.
    pub health: Health,
    /// The operator's state: `ready`, `drain` or `maint`.
    pub admin_state: AdminState,
    /// Whether it takes new connections: healthy and `ready`; with
    /// per-listener checks, for at least one listener (`ports` says which).
    pub eligible: bool,
    /// Connections open to it (its UDP flows included: least_connections
    /// weighs both).
    pub active_connections: usize,
    /// UDP flows open to it through the UDP listeners; absent when its load
    /// balancer has none.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub active_flows: Option<usize>,
    /// Health-check detail; absent without a health check, and with
    /// per-listener checks (each port has its own).
    pub probe: Option<TargetStatus>,
    /// Per-listener checks only: the verdict on each listener's nodeport.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub ports: Vec<PortStatus>,
}

/// One backend port in `/status`, for a health check without `port`: the
/// port's own verdict decides whether the listeners on it use the backend.
#[derive(Debug, Serialize)]
pub struct PortStatus {
    /// The nodeport.
    pub backend_port: u16,
    /// The listeners forwarding to it.
    pub listeners: Vec<String>,
    /// The verdict on this port.
    pub health: Health,
    /// Whether those listeners' new connections may go to the backend.
    pub eligible: bool,
    /// Health-check detail; absent while the backend is in `maint`.
    pub probe: Option<TargetStatus>,
}

fn health_of(healthy: bool) -> Health {
    if healthy {
        Health::Healthy
    } else {
        Health::Unhealthy
    }
}

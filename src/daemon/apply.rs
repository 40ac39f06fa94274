//! Applying a config: the diff of load balancers, backends, probes and
//! listeners, and the retirement of what a reload removed.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use super::{ApplyReport, BindError, Daemon, LbEntry, ListenerEntry, State};
use crate::config::{Config, ListenerKey, ListenerSpec, LoadBalancerSpec, Protocol, UdpSettings};
use crate::dataplane::balancer::{AdminState, Backend, LoadBalancer, Settings};
use crate::dataplane::health::prober::TargetKey;
use crate::dataplane::health::{Health, HealthState};
use crate::dataplane::proxy::tcp::listen_options::ListenerOptions;
use crate::dataplane::proxy::udp;
use crate::dataplane::proxy::{Listener, Route, Running};
use crate::log_limit::{Verdict, left_out};

impl Daemon {
    /// Makes `config` the one in force, changing only what differs.
    pub fn apply(&self, config: Config) -> ApplyReport {
        let mut st = self.lock();
        self.apply_locked(&mut st, config)
    }

    pub(super) fn apply_locked(&self, st: &mut State, config: Config) -> ApplyReport {
        let config = self.lease_vips(config);
        let mut report = ApplyReport::default();
        let drain = config.proxy.drain_timeout;
        let (global_flows, per_source) = self.set_process_limits(&config);
        let old_config = st.config.take();
        // Load balancers first: listeners need their `Arc<LoadBalancer>`.
        self.apply_load_balancers(st, &config, old_config.as_ref(), drain, &mut report);
        self.share_limits(st, &config, global_flows);
        for spec in config.load_balancers.iter().filter(|l| l.dhcp.is_some()) {
            if let Some(entry) = st.load_balancers.get(&spec.name) {
                entry.lb.stats().set_lease(self.leases.stats(&spec.name));
            }
        }
        self.apply_listeners(st, &config, drain, per_source, &mut report);
        self.metrics
            .set_config_in_force(config.load_balancers.len(), self.prober.streams());
        self.metrics.set_per_backend_health_check_duration(
            config.metrics.per_backend_health_check_duration,
        );
        st.config = Some(config);
        st.config_generation += 1;
        self.start_kernel_writer();
        self.kernel_wake.notify_one();
        self.announcer.start_or_wake(self.me.clone());
        self.vmnet_wake();
        report
    }

    /// The process-wide settings of `[proxy]` and `[log]`: the affinity
    /// table's and the UDP flow table's sizes, the per-source flow cap and the
    /// connection log's rate. Returns the UDP flow table's size and the
    /// per-source cap, which the load balancers' shares and UDP listeners use.
    fn set_process_limits(&self, config: &Config) -> (usize, usize) {
        self.affinity.set_max(config.proxy.max_affinity_entries);
        self.udp_flows
            .set_max(config.proxy.max_udp_flows.map_or_else(
                || udp::default_max_flows(crate::os::open_file_limit().unwrap_or(1024)),
                |n| n.get(),
            ));
        let per_source = config.proxy.max_udp_flows_per_source.get();
        self.udp_per_source.store(per_source, Ordering::Relaxed);
        crate::dataplane::proxy::log::set_max_lines_per_second(
            config.log.max_connection_lines_per_second,
        );
        (self.udp_flows.max(), per_source)
    }

    /// The diff of load balancers against `old_config`: adds new ones,
    /// updates changed ones in place (recreated when their cluster changed),
    /// retires those the new config no longer names.
    fn apply_load_balancers(
        &self,
        st: &mut State,
        config: &Config,
        old_config: Option<&Config>,
        drain: Duration,
        report: &mut ApplyReport,
    ) {
        // A spec reused from the last file is the same `Arc`, and `Arc`'s
        // equality compares pointers first: unchanged load balancers cost
        // no field-by-field comparison.
        let in_force: HashMap<&str, &Arc<LoadBalancerSpec>> = old_config
            .iter()
            .flat_map(|c| &c.load_balancers)
            .map(|spec| (spec.name.as_str(), spec))
            .collect();
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
    }

    /// Each load balancer's share of the process-wide caps (connections,
    /// UDP flows of a table of `global_flows`), so one tenant cannot hold
    /// every slot (`config::default_share`).
    fn share_limits(&self, st: &State, config: &Config, global_flows: usize) {
        // A share is split among the load balancers that can use it: those
        // with a listener of its protocol.
        let serving = |protocol: Protocol| {
            config
                .load_balancers
                .iter()
                .filter(|lb| lb.listeners.iter().any(|l| l.protocol == protocol))
                .count()
        };
        let (tcp_count, udp_count) = (serving(Protocol::Tcp), serving(Protocol::Udp));
        let share = |own: Option<std::num::NonZeroUsize>, global: usize, count: usize| {
            own.map_or_else(
                || crate::config::default_share(global, count),
                |n| n.get().min(global),
            )
        };
        for spec in &config.load_balancers {
            if let Some(entry) = st.load_balancers.get(&spec.name) {
                entry.lb.connections().set_max(share(
                    spec.max_connections,
                    self.limit.max(),
                    tcp_count,
                ));
                entry
                    .lb
                    .udp_flows()
                    .set_max(share(spec.max_udp_flows, global_flows, udp_count));
            }
        }
    }

    /// Listeners: keeps sockets that stay, binds new ones, drains removed
    /// ones, and counts bound and failed ones into `report`.
    fn apply_listeners(
        &self,
        st: &mut State,
        config: &Config,
        drain: Duration,
        per_source: usize,
        report: &mut ApplyReport,
    ) {
        let mut desired: HashMap<ListenerKey, (&LoadBalancerSpec, &ListenerSpec)> = HashMap::new();
        for lb in &config.load_balancers {
            if lb.vip.is_unspecified() {
                // A DHCP VIP not leased yet: nothing to bind.
                continue;
            }
            for l in &lb.listeners {
                desired.insert(lb.listener_key(l), (lb, l));
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
                    self.unstore_listener(&addr);
                    self.drain_in_background(listener, drain);
                }
                report.listeners_removed += 1;
            }
        }
        for (addr, (lb_spec, l_spec)) in desired {
            self.apply_listener(st, addr, lb_spec, l_spec, per_source, config.proxy.backlog);
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
    }

    /// One listener the config wants at `addr`: left alone when the same
    /// route would be built again, re-routed in place when its socket is
    /// bound, bound (or tried again) otherwise.
    fn apply_listener(
        &self,
        st: &mut State,
        addr: ListenerKey,
        lb_spec: &LoadBalancerSpec,
        l_spec: &ListenerSpec,
        per_source: usize,
        backlog: u32,
    ) {
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
            return; // The same route would be built again.
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
                    Running::Tcp(l) => {
                        l.set_route(route);
                        let options = ListenerOptions::of(l_spec);
                        if options != ListenerOptions::of(spec) {
                            l.set_options(&options);
                        }
                    }
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
                let socket = self.start_listener(
                    addr,
                    route,
                    ListenerOptions::of(l_spec),
                    lb_spec.udp,
                    backlog,
                );
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
            let options = ListenerOptions::of(&entry.spec);
            if let Ok(listener) = self.start_listener(addr, route, options, udp, backlog) {
                entry.socket = Ok(listener);
                entry.stats.up.set(true);
                fixed += 1;
            }
        }
        fixed
    }

    pub(super) fn new_load_balancer(&self, spec: &LoadBalancerSpec) -> LbEntry {
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
        // Before the first snapshot and probe: a backend an operator
        // drained stays out from the first connection after a restart.
        let kept_affinity = self.restore_backends(spec, &backends);
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
        lb.notify_on_publish([Arc::clone(&self.kernel_wake), self.announcer.notify()]);
        let entry = LbEntry { lb, backends };
        self.ensure_probes(&entry, spec);
        self.restore_affinity(&entry, spec, kept_affinity);
        // Restored verdicts were set after the first snapshot.
        entry.lb.publish();
        entry
    }

    pub(super) fn update_load_balancer(
        &self,
        entry: &mut LbEntry,
        spec: &LoadBalancerSpec,
        drain: Duration,
    ) {
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
            retire_after(
                gone,
                drain,
                entry.lb.released(),
                &self.drains,
                self.retire_now.clone(),
            );
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
                    self.prober
                        .remove(&TargetKey::new(name, backend.addr, None));
                }
                for old in backend.checked_ports() {
                    if !ports.contains(&old) {
                        self.prober
                            .remove(&TargetKey::new(name, backend.addr, Some(old)));
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

    pub(super) fn ensure_probes(&self, entry: &LbEntry, spec: &LoadBalancerSpec) {
        let Some(hc) = &spec.health_check else { return };
        for ip in &spec.backends {
            let backend = &entry.backends[ip];
            if backend.admin_state() == AdminState::Maint {
                // Not probed while in maintenance; probing resumes when it leaves.
                continue;
            }
            let configured = HealthState::new(spec.initial_state);
            if let Some(port) = hc.port {
                let key = TargetKey::new(&spec.name, *ip, None);
                let mut initial = configured;
                if self.prober.get(&key).is_none() {
                    // A backend gaining a health check starts from the
                    // verdict the last process left, else the initial state.
                    initial = self.restored_verdict(&key).unwrap_or(configured);
                    backend.set_healthy(initial.status == Health::Healthy);
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
                let key = TargetKey::new(&spec.name, *ip, Some(port));
                let mut initial = configured;
                if self.prober.get(&key).is_none() {
                    initial = self.restored_verdict(&key).unwrap_or(configured);
                    backend.set_port_healthy(&cell, initial.status == Health::Healthy);
                }
                self.prober
                    .ensure(&entry.lb, backend, Some(&cell), port, hc, initial);
            }
        }
    }

    /// Stops every probe target of `backend` of load balancer `lb`: the
    /// backend's own and each of its ports'.
    pub(super) fn stop_probing(&self, lb: &str, backend: &Backend) {
        self.prober.remove(&TargetKey::new(lb, backend.addr, None));
        for port in backend.checked_ports() {
            self.prober
                .remove(&TargetKey::new(lb, backend.addr, Some(port)));
        }
    }

    /// Takes a removed load balancer out of service. Its backends (and
    /// with them the last of its series) are retired once nothing holds
    /// the load balancer any more: at once when no connection is open
    /// through it, when the last one closes, or when the drain time is up,
    /// whichever comes first. A client still connecting through it holds
    /// its route, so it is never cut short by this.
    pub(super) fn retire_load_balancer(&self, entry: LbEntry, drain: Duration) {
        entry.lb.leave();
        for (_, backend) in entry.backends {
            self.stop_probing(&entry.lb.name, &backend);
            backend.leave();
            retire_after(
                backend,
                drain,
                entry.lb.released(),
                &self.drains,
                self.retire_now.clone(),
            );
        }
    }

    pub(super) fn route(&self, lb: &Arc<LoadBalancer>, spec: &ListenerSpec) -> Route {
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

    pub(super) fn start_listener(
        &self,
        key: ListenerKey,
        route: Route,
        options: ListenerOptions,
        udp: UdpSettings,
        backlog: u32,
    ) -> Result<Running, BindError> {
        let ListenerKey { addr, protocol } = key;
        let (lb_name, name) = (route.lb.name.clone(), route.listener.clone());
        let bound = match protocol {
            Protocol::Tcp => {
                let placement = self.workers.place();
                self.tcp_listener_sockets(addr, backlog, placement.sockets())
                    .and_then(|sockets| {
                        // Before the first accept, so no client slips
                        // through without them. Warned, not fatal: the
                        // listener serves either way, as the kernel's
                        // defaults would have it.
                        if options != ListenerOptions::default() {
                            for socket in &sockets {
                                if let Err(e) = options.apply(socket) {
                                    tracing::warn!(listen = %addr, error = %e, "listener options not set");
                                }
                            }
                        }
                        Listener::start(sockets, placement, route, Arc::clone(&self.limit))
                    })
                    .map(|listener| {
                        self.adopt_connections(&listener);
                        Running::Tcp(listener)
                    })
            }
            Protocol::Udp => self.udp_listener_socket(addr).map(|socket| {
                let budget = Arc::clone(&self.udp_flows);
                let per_source = self.udp_per_source.load(Ordering::Relaxed);
                let handed = self.take_handed_flows(addr);
                if handed.is_empty() {
                    return Running::Udp(udp::UdpListener::start(
                        socket, route, udp, budget, per_source,
                    ));
                }
                let (listener, adopted) =
                    udp::UdpListener::adopt(socket, route, udp, budget, per_source, handed);
                tracing::info!(listen = %addr, flows = adopted.adopted, dropped = adopted.dropped, "UDP flows adopted from the last process");
                Running::Udp(listener)
            }),
        };
        match bound {
            Ok(listener) => {
                tracing::info!(listen = %addr, %protocol, load_balancer = &*lb_name, listener = &*name, "listening");
                Ok(listener)
            }
            Err(e) => {
                // Nothing of it may stay listening in PID 1's copy.
                self.unstore_listener(&key);
                // Per cause, a few lines a minute: every failed listener is
                // in `/status` and `/readyz`, and retried every 2 s.
                if let Verdict::Write { suppressed } = self.bind_log.check(e.raw_os_error()) {
                    tracing::error!(
                        listen = %addr,
                        %protocol,
                        load_balancer = &*lb_name,
                        listener = &*name,
                        error = %e,
                        "cannot bind listener; other listeners are unaffected, it is retried every 2 s, /status lists every one not bound{}",
                        left_out(suppressed)
                    );
                }
                Err(BindError {
                    key,
                    error: Arc::new(e),
                })
            }
        }
    }

    pub(super) fn drain_in_background(&self, listener: Running, drain: Duration) {
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
}

/// Closes a removed backend's connections once `drain` has passed (or at
/// shutdown, after the listeners have drained, or once its load balancer
/// is released: then no connection through it can be open any more).
///
/// Otherwise it waits the full drain time, even when no connection is open
/// now: a client that picked this backend from the previous snapshot may
/// still be connecting, and it deserves the same drain as everyone else.
fn retire_after(
    backend: Arc<Backend>,
    drain: Duration,
    released: impl std::future::Future<Output = ()> + Send + 'static,
    tracker: &TaskTracker,
    shutdown: CancellationToken,
) {
    tracker.spawn(async move {
        tokio::select! {
            _ = tokio::time::sleep(drain) => {}
            _ = released => {}
            _ = shutdown.cancelled() => {}
        }
        backend.retire();
    });
}

#[cfg(test)]
mod tests {
    use super::super::testing::{accepts, config, daemon, lb, refused_soon};
    use super::*;
    use std::net::SocketAddr;

    fn addr(s: &str) -> SocketAddr {
        s.parse().unwrap()
    }

    /// The load balancer in force under `name`.
    fn lb_of(d: &Daemon, name: &str) -> Arc<LoadBalancer> {
        Arc::clone(&d.lock().load_balancers[name].lb)
    }

    /// The route of the listener at `addr` (TCP), which must be bound.
    fn route_at(d: &Daemon, addr: SocketAddr) -> Arc<Route> {
        let st = d.lock();
        let key = ListenerKey {
            addr,
            protocol: Protocol::Tcp,
        };
        match &st.listeners[&key].socket {
            Ok(l) => l.route(),
            Err(e) => panic!("{addr} is not bound: {e}"),
        }
    }

    #[tokio::test]
    async fn the_same_config_again_keeps_every_load_balancer_backend_and_listener() {
        let d = daemon();
        let text = [
            lb(
                "a/one",
                "127.231.10.1",
                &["127.231.10.11"],
                &[18080, 18081],
                30080,
                "",
            ),
            lb(
                "a/two",
                "127.231.10.2",
                &["127.231.10.12"],
                &[18080],
                30080,
                "",
            ),
        ]
        .concat();
        let first = d.apply(config(&text));
        assert_eq!(
            first,
            ApplyReport {
                listeners_bound: 3,
                load_balancers_added: 2,
                ..ApplyReport::default()
            }
        );
        let one = lb_of(&d, "a/one");
        let backend = Arc::clone(
            &d.lock().load_balancers["a/one"].backends[&"127.231.10.11".parse().unwrap()],
        );
        // Parsed again: equal specs, new objects, as a reload reads them.
        let again = d.apply(config(&text));
        assert_eq!(
            again,
            ApplyReport {
                listeners_bound: 3,
                ..ApplyReport::default()
            },
            "nothing added, removed or bound anew"
        );
        assert!(
            Arc::ptr_eq(&one, &lb_of(&d, "a/one")),
            "the same load balancer"
        );
        assert!(
            Arc::ptr_eq(
                &backend,
                &d.lock().load_balancers["a/one"].backends[&backend.addr]
            ),
            "the same backend: its health, drain and counters stay"
        );
        assert!(Arc::ptr_eq(
            &route_at(&d, addr("127.231.10.1:18080")).lb,
            &one
        ));
    }

    #[tokio::test]
    async fn a_removed_listener_and_a_removed_load_balancer_stop_accepting_and_the_rest_stay() {
        let d = daemon();
        d.apply(config(&format!(
            "[proxy]\ndrain_timeout_seconds = 1\n{}{}",
            lb(
                "a/one",
                "127.231.11.1",
                &["127.231.11.11"],
                &[18080, 18081],
                30080,
                ""
            ),
            lb(
                "a/two",
                "127.231.11.2",
                &["127.231.11.12"],
                &[18080],
                30080,
                ""
            ),
        )));
        let kept = route_at(&d, addr("127.231.11.1:18080"));
        let report = d.apply(config(&format!(
            "[proxy]\ndrain_timeout_seconds = 1\n{}",
            lb(
                "a/one",
                "127.231.11.1",
                &["127.231.11.11"],
                &[18080],
                30080,
                ""
            ),
        )));
        assert_eq!(
            report,
            ApplyReport {
                listeners_bound: 1,
                listeners_removed: 2,
                load_balancers_removed: 1,
                ..ApplyReport::default()
            }
        );
        refused_soon(addr("127.231.11.1:18081")).await;
        refused_soon(addr("127.231.11.2:18080")).await;
        assert!(
            accepts(addr("127.231.11.1:18080")).await,
            "the listener that stays"
        );
        assert!(
            Arc::ptr_eq(&kept.lb, &route_at(&d, addr("127.231.11.1:18080")).lb),
            "its load balancer unchanged"
        );
        assert!(!d.lock().load_balancers.contains_key("a/two"));
    }

    #[tokio::test]
    async fn a_new_nodeport_or_backend_reroutes_the_bound_listener_in_place() {
        let d = daemon();
        let vip = addr("127.231.12.1:18080");
        d.apply(config(&lb(
            "a/one",
            "127.231.12.1",
            &["127.231.12.11"],
            &[18080],
            30080,
            "",
        )));
        let old =
            d.lock().load_balancers["a/one"].backends[&"127.231.12.11".parse().unwrap()].clone();
        let report = d.apply(config(&lb(
            "a/one",
            "127.231.12.1",
            &["127.231.12.11", "127.231.12.12"],
            &[18080],
            30090,
            "",
        )));
        assert_eq!(
            report,
            ApplyReport {
                listeners_bound: 1,
                ..ApplyReport::default()
            },
            "rerouted, not removed and bound again"
        );
        let route = route_at(&d, vip);
        assert_eq!(route.backend_port, 30090);
        let snapshot = route.lb.snapshot();
        let members: Vec<IpAddr> = snapshot.eligible.iter().map(|b| b.addr).collect();
        assert_eq!(
            members,
            [
                "127.231.12.11".parse::<IpAddr>().unwrap(),
                "127.231.12.12".parse().unwrap()
            ]
        );
        assert!(
            Arc::ptr_eq(&old, &snapshot.eligible[0]),
            "the backend that stays is the same object"
        );
    }

    #[tokio::test]
    async fn a_new_cluster_recreates_the_load_balancer_under_the_same_listener() {
        let d = daemon();
        let vip = addr("127.231.13.1:18080");
        d.apply(config(&lb(
            "a/one",
            "127.231.13.1",
            &["127.231.13.11"],
            &[18080],
            30080,
            "",
        )));
        let before = lb_of(&d, "a/one");
        let report = d.apply(config(&lb(
            "a/one",
            "127.231.13.1",
            &["127.231.13.11"],
            &[18080],
            30080,
            "cluster = \"other\"",
        )));
        assert_eq!(
            report,
            ApplyReport {
                listeners_bound: 1,
                load_balancers_added: 1,
                ..ApplyReport::default()
            }
        );
        let after = lb_of(&d, "a/one");
        assert!(
            !Arc::ptr_eq(&before, &after),
            "another cluster's series start anew"
        );
        assert_eq!(after.cluster, "other");
        assert!(
            Arc::ptr_eq(&route_at(&d, vip).lb, &after),
            "the listener serves the new one"
        );
        assert!(accepts(vip).await);
    }

    #[tokio::test]
    async fn a_listener_that_cannot_bind_is_named_and_bound_by_a_retry_once_its_port_is_free() {
        let d = daemon();
        let vip = addr("127.231.14.1:18080");
        let squatter = std::net::TcpListener::bind(vip).expect("the squatter binds first");
        let report = d.apply(config(&lb(
            "a/one",
            "127.231.14.1",
            &["127.231.14.11"],
            &[18080, 18081],
            30080,
            "",
        )));
        assert_eq!((report.listeners_bound, report.listeners_failed), (1, 1));
        assert!(!d.is_ready());
        let failed = d.failed_listeners();
        assert_eq!(failed.len(), 1);
        assert_eq!(failed[0].key.addr, vip);
        assert_eq!(d.retry_failed_listeners(), 0, "still held");
        drop(squatter);
        assert_eq!(d.retry_failed_listeners(), 1);
        assert!(d.is_ready() && d.failed_listeners().is_empty());
        assert!(Arc::ptr_eq(&route_at(&d, vip).lb, &lb_of(&d, "a/one")));
    }
}

//! The Prometheus text exposition (format 0.0.4), written from the live
//! objects at scrape time, a chunk at a time.
//!
//! A scrape first takes a snapshot of which objects are live (one pointer
//! each, sorted by their labels, so the output is stable and diffable), then
//! writes one family at a time across all of them: every family's samples
//! stay together, as the format requires. The admin server sends each chunk
//! as it is written, so a scrape of 30,000 backends holds a chunk of text in
//! memory, not all of it, and the data plane gets the threads back between
//! chunks.

use std::fmt::Display;
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use hyper::body::{Body, Bytes, Frame, SizeHint};

use super::Metrics;
use super::by_label::{ByLabel, Label};
use super::names::{self, Family};
use super::stats::{
    ADMIN_STATES, BackendStats, Counter, DIRECTIONS, Direction, Histogram, IGNORED_REASONS,
    LbStats, ListenerStats, PROBE_BUCKETS, REFUSAL_REASONS,
};

/// One load balancer's live objects at the start of a scrape.
struct LbSnapshot {
    lb: Arc<LbStats>,
    listeners: Vec<Arc<ListenerStats>>,
    backends: Vec<Arc<BackendStats>>,
}

/// What one step of a scrape writes: one family, over one kind of object.
enum Step {
    /// The daemon-wide families (a handful of lines).
    Daemon,
    Lb(&'static Family, fn(&mut Out<'_>, &LbStats)),
    Listener(&'static Family, fn(&mut Out<'_>, &ListenerStats)),
    Backend(&'static Family, fn(&mut Out<'_>, &BackendStats)),
}

const STEPS: &[Step] = &[
    Step::Daemon,
    Step::Lb(&names::NO_ELIGIBLE_BACKEND, |o, lb| {
        if let Some(v) = lb.no_backend.get() {
            o.sample("", |b| lb_labels(b, lb), u64::from(v));
        }
    }),
    Step::Lb(&names::NO_ELIGIBLE_BACKEND_EVENTS, |o, lb| {
        o.sample("", |b| lb_labels(b, lb), lb.no_backend_events.get());
    }),
    Step::Lb(&names::DHCP_LEASE_STATE, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample(
                "",
                |b| {
                    lb_labels(b, lb);
                    label(b, "state", l.phase_name());
                },
                1,
            );
        }
    }),
    Step::Lb(&names::DHCP_LEASE_INFO, |o, lb| {
        if let Some(l) = lb.lease()
            && let (Some(address), Some(server)) = (l.address(), l.server())
        {
            o.sample(
                "",
                |b| {
                    lb_labels(b, lb);
                    label(b, "address", &address.to_string());
                    label(b, "server", &server.to_string());
                },
                1,
            );
        }
    }),
    Step::Lb(&names::DHCP_LEASE_EXPIRY, |o, lb| {
        if let Some(e) = lb.lease().and_then(|l| l.expiry_unix()) {
            o.sample("", |b| lb_labels(b, lb), e);
        }
    }),
    Step::Lb(&names::DHCP_LEASES_ACQUIRED, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.acquired.get());
        }
    }),
    Step::Lb(&names::DHCP_RENEWALS, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.renewals.get());
        }
    }),
    Step::Lb(&names::DHCP_NAKS, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.naks.get());
        }
    }),
    Step::Lb(&names::DHCP_ADDRESS_CHANGES, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.address_changes.get());
        }
    }),
    Step::Lb(&names::DHCP_PACKETS_IGNORED, |o, lb| {
        if let Some(l) = lb.lease() {
            o.outcomes(&l.ignored, &IGNORED_REASONS, "reason", |b| lb_labels(b, lb));
        }
    }),
    Step::Lb(&names::DHCP_OFFERS_REFUSED, |o, lb| {
        if let Some(l) = lb.lease() {
            o.outcomes(&l.refused, &REFUSAL_REASONS, "reason", |b| lb_labels(b, lb));
        }
    }),
    Step::Lb(&names::DHCP_REPAIRS, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.repairs.get());
        }
    }),
    Step::Lb(&names::AFFINITY_ENTRIES, |o, lb| {
        if lb.affinity_enabled.load(Ordering::Relaxed) {
            o.sample("", |b| lb_labels(b, lb), lb.affinity_entries.get());
        }
    }),
    Step::Lb(&names::AFFINITY_TABLE_FULL, |o, lb| {
        let full = lb.affinity_full.get();
        if full > 0 {
            o.sample("", |b| lb_labels(b, lb), full);
        }
    }),
    Step::Listener(&names::LISTENER_UP, |o, l| {
        if let Some(v) = l.up.get() {
            o.sample("", |b| listener_labels(b, l), u64::from(v));
        }
    }),
    Step::Listener(&names::CONNECTIONS_ACCEPTED, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.sample("", |b| listener_labels(b, l), l.accepted.get());
    }),
    Step::Listener(&names::CONNECTIONS_FAILED, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.labelled(&l.failed, "reason", |b| listener_labels(b, l));
    }),
    Step::Listener(&names::CONNECTIONS_REJECTED, |o, l| {
        o.labelled(&l.rejected, "reason", |b| listener_labels(b, l));
    }),
    Step::Listener(&names::CONNECTIONS_ACTIVE, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.sample("", |b| listener_labels(b, l), l.active.get());
    }),
    Step::Listener(&names::BYTES, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.directions(l, [&l.client_to_backend, &l.backend_to_client]);
    }),
    Step::Listener(&names::ACCEPT_ERRORS, |o, l| {
        o.labelled(&l.accept_errors, "kind", |b| listener_labels(b, l));
    }),
    Step::Listener(&names::CONNECTION_LIMIT_REACHED, |o, l| {
        if l.limit_reached.get() > 0 {
            o.sample("", |b| listener_labels(b, l), l.limit_reached.get());
        }
    }),
    Step::Listener(&names::UDP_DATAGRAMS, |o, l| {
        if let Some(u) = l.udp.get() {
            o.directions(
                l,
                [
                    &u.datagrams[Direction::ClientToBackend],
                    &u.datagrams[Direction::BackendToClient],
                ],
            );
        }
    }),
    Step::Listener(&names::UDP_BYTES, |o, l| {
        if let Some(u) = l.udp.get() {
            o.directions(
                l,
                [
                    &u.bytes[Direction::ClientToBackend],
                    &u.bytes[Direction::BackendToClient],
                ],
            );
        }
    }),
    Step::Listener(&names::UDP_DATAGRAMS_DROPPED, |o, l| {
        if let Some(u) = l.udp.get() {
            o.labelled(&u.datagrams_dropped, "reason", |b| listener_labels(b, l));
        }
    }),
    Step::Listener(&names::UDP_FLOWS_ACTIVE, |o, l| {
        if let Some(u) = l.udp.get() {
            o.sample("", |b| listener_labels(b, l), u.flows_active.get());
        }
    }),
    Step::Listener(&names::UDP_FLOWS_CREATED, |o, l| {
        if let Some(u) = l.udp.get() {
            o.sample("", |b| listener_labels(b, l), u.flows_created.get());
        }
    }),
    Step::Listener(&names::UDP_FLOWS_DROPPED, |o, l| {
        if let Some(u) = l.udp.get() {
            o.labelled(&u.flows_dropped, "reason", |b| listener_labels(b, l));
        }
    }),
    Step::Listener(&names::UDP_BACKEND_FLOWS_ACTIVE, |o, l| {
        let Some(u) = l.udp.get() else { return };
        for (ip, be) in u.backends() {
            let kernel = be.kernel_flows.load(Ordering::Relaxed);
            let kernel = i64::try_from(kernel).unwrap_or(i64::MAX);
            o.sample(
                "",
                |b| udp_backend_labels(b, l, ip),
                be.flows_active.get().saturating_add(kernel),
            );
        }
    }),
    Step::Listener(&names::UDP_BACKEND_ICMP_ERRORS, |o, l| {
        let Some(u) = l.udp.get() else { return };
        for (ip, be) in u.backends() {
            let n = be.icmp_errors.get();
            if n > 0 {
                o.sample("", |b| udp_backend_labels(b, l, ip), n);
            }
        }
    }),
    Step::Backend(&names::BACKEND_UP, |o, be| {
        if let Some(v) = be.up.get() {
            o.sample("", |b| backend_labels(b, be), u64::from(v));
        }
    }),
    Step::Backend(&names::BACKEND_PORT_UP, |o, be| {
        if let Some(ports) = &*be.ports.load() {
            for p in ports.iter() {
                if let Some(v) = p.up.get() {
                    let port = p.port.to_string();
                    o.sample(
                        "",
                        |b| {
                            backend_labels(b, be);
                            label(b, "backend_port", &port);
                        },
                        u64::from(v),
                    );
                }
            }
        }
    }),
    Step::Backend(&names::BACKEND_CONNECTIONS_ACTIVE, |o, be| {
        // The proxy's open connections and the kernel's, as last counted.
        let kernel = be.kernel_active.load(Ordering::Relaxed);
        let kernel = i64::try_from(kernel).unwrap_or(i64::MAX);
        o.sample(
            "",
            |b| backend_labels(b, be),
            be.active.get().saturating_add(kernel),
        );
    }),
    Step::Backend(&names::BACKEND_CONNECTIONS, |o, be| {
        o.sample("", |b| backend_labels(b, be), be.connections.get());
    }),
    Step::Backend(&names::BACKEND_BYTES, |o, be| {
        o.labelled(&be.bytes, "direction", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::BACKEND_DOWN_SECONDS, |o, be| {
        o.sample("", |b| backend_labels(b, be), be.times.down_seconds());
    }),
    Step::Backend(&names::BACKEND_LAST_CHANGE, |o, be| {
        if let Some(t) = be.times.last_change_unix() {
            o.sample("", |b| backend_labels(b, be), t);
        }
    }),
    Step::Backend(&names::BACKEND_ADMIN_STATE, |o, be| {
        // A state series, present while the backend is a member (as `backend_up`).
        if be.up.get().is_some() {
            let state = ADMIN_STATES
                .get(usize::from(be.admin_state.load(Ordering::Relaxed)))
                .copied()
                .unwrap_or("ready");
            o.sample(
                "",
                |b| {
                    backend_labels(b, be);
                    label(b, "state", state);
                },
                1,
            );
        }
    }),
    Step::Backend(&names::BACKEND_CONNECTIONS_CLOSED, |o, be| {
        o.labelled(&be.closed, "reason", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::BACKEND_CONNECT_FAILURES, |o, be| {
        o.labelled(&be.connect_failures, "reason", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::HEALTH_CHECKS, |o, be| {
        o.labelled(&be.checks, "result", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::HEALTH_TRANSITIONS, |o, be| {
        o.labelled(&be.transitions, "to", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::HEALTH_CHECK_DURATION, |o, be| {
        if let Some(h) = be.duration.get() {
            o.histogram(h, |b| backend_labels(b, be));
        }
    }),
];

/// One scrape in progress.
pub struct Exposition {
    metrics: Arc<Metrics>,
    lbs: Vec<LbSnapshot>,
    /// Index into [`STEPS`].
    step: usize,
    /// Next load balancer of the step.
    next_lb: usize,
    /// Whether the step's family has had its `# HELP`/`# TYPE` lines.
    headed: bool,
    /// `process_open_fds`, counted before the scrape (see
    /// [`Exposition::with_open_fds`]); not exported when unknown.
    open_fds: Option<u64>,
    /// The `process_*` series read with it; not exported when unknown.
    process: Option<crate::os::ProcessStats>,
}

impl Exposition {
    /// A scrape of everything live now.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        let mut lbs: Vec<LbSnapshot> = metrics
            .live_load_balancers()
            .into_iter()
            .map(|lb| {
                let mut listeners = super::stats::live(&lb.listeners);
                listeners.sort_by(|a, b| a.name.cmp(&b.name));
                let mut backends = super::stats::live(&lb.backends);
                backends.sort_by_key(|b| b.addr);
                LbSnapshot {
                    lb,
                    listeners,
                    backends,
                }
            })
            .collect();
        lbs.sort_by(|a, b| (&a.lb.cluster, &a.lb.name).cmp(&(&b.lb.cluster, &b.lb.name)));
        Self {
            metrics,
            lbs,
            step: 0,
            next_lb: 0,
            headed: false,
            open_fds: None,
            process: None,
        }
    }

    /// Exports `process_open_fds` as `open_fds`. The count is taken by the
    /// caller, off the data plane's threads: on kernels before 6.2 it reads
    /// the whole of `/proc/self/fd` ([`crate::os::open_fds`]).
    pub fn with_open_fds(mut self, open_fds: Option<u64>) -> Self {
        self.open_fds = open_fds;
        self
    }

    /// Exports `process_start_time_seconds`, `process_cpu_seconds_total`
    /// and `process_resident_memory_bytes` from `process`, read by the
    /// caller with the descriptor count ([`crate::os::process_stats`]).
    pub fn with_process(mut self, process: Option<crate::os::ProcessStats>) -> Self {
        self.process = process;
        self
    }

    /// Appends to `buf` until it holds at least `target` bytes or the
    /// exposition is complete. Returns whether anything is left to write.
    pub fn fill(&mut self, buf: &mut Vec<u8>, target: usize) -> bool {
        while self.step < STEPS.len() {
            if buf.len() >= target {
                return true;
            }
            let step = &STEPS[self.step];
            if let Step::Daemon = step {
                self.daemon(buf);
                self.next_step();
                continue;
            }
            let Some(snap) = self.lbs.get(self.next_lb) else {
                self.next_step();
                continue;
            };
            self.next_lb += 1;
            let (family, headed) = (step_family(step), &mut self.headed);
            let mut out = Out {
                buf,
                family,
                headed,
            };
            match step {
                Step::Daemon => {}
                Step::Lb(_, write) => write(&mut out, &snap.lb),
                Step::Listener(_, write) => snap.listeners.iter().for_each(|l| write(&mut out, l)),
                Step::Backend(_, write) => snap.backends.iter().for_each(|b| write(&mut out, b)),
            }
        }
        false
    }

    fn next_step(&mut self) {
        self.step += 1;
        self.next_lb = 0;
        self.headed = false;
    }

    /// The daemon-wide families.
    fn daemon(&self, buf: &mut Vec<u8>) {
        let m = &self.metrics;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        gauge(
            buf,
            &names::CONFIG_LOAD_BALANCERS,
            &load(&m.config_load_balancers),
        );
        gauge(
            buf,
            &names::HEALTH_CHECK_STREAMS,
            &load(&m.health_check_streams),
        );
        gauge(
            buf,
            &names::CONFIG_LAST_RELOAD_SUCCESSFUL,
            &u64::from(m.last_reload_ok.load(Ordering::Relaxed)),
        );
        gauge(
            buf,
            &names::CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP,
            &f64::from_bits(load(&m.last_success)),
        );
        gauge(
            buf,
            &names::VIP_REFUSED,
            &m.vip_refused.load(Ordering::Relaxed),
        );
        let mut headed = false;
        Out {
            buf,
            family: &names::HOST_REPAIRS,
            headed: &mut headed,
        }
        .labelled(&*m.host_repairs, "kind", |_| {});
        match m.vip_isolation.load(Ordering::Relaxed) {
            0 => {}
            v => {
                gauge(buf, &names::VIP_ISOLATION_UP, &u64::from(v == 1));
                gauge(
                    buf,
                    &names::VIP_ISOLATION_REPAIRS,
                    &m.vip_isolation_repairs.get(),
                );
            }
        }
        self.kernel_families(buf);
        self.announce_families(buf);
        self.sync_families(buf);
        m.hand_over.write(buf);
        let limit = load(&m.connection_limit);
        if limit > 0 {
            gauge(buf, &names::CONNECTIONS_LIMIT, &limit);
        }
        if let Some(open) = self.open_fds {
            gauge(buf, &names::PROCESS_OPEN_FDS, &open);
        }
        if let Some(max) = crate::os::open_file_limit() {
            gauge(buf, &names::PROCESS_MAX_FDS, &max);
        }
        if let Some(p) = self.process {
            gauge(
                buf,
                &names::PROCESS_START_TIME_SECONDS,
                &p.start_time_seconds,
            );
            gauge(buf, &names::PROCESS_CPU_SECONDS, &p.cpu_seconds);
            gauge(
                buf,
                &names::PROCESS_RESIDENT_MEMORY_BYTES,
                &p.resident_bytes,
            );
        }
        gauge(
            buf,
            &names::CONNECTION_LOG_LINES_DROPPED,
            &super::CONNECTION_LOG_LINES_DROPPED.get(),
        );
        gauge(
            buf,
            &names::LOG_LINES_DROPPED,
            &crate::logging::lines_dropped(),
        );
        let mut headed = false;
        let mut out = Out {
            buf,
            family: &names::CONFIG_RELOADS,
            headed: &mut headed,
        };
        for (result, c) in [("success", &m.reloads_ok), ("failure", &m.reloads_failed)] {
            out.sample("", |b| label_first(b, "result", result), c.get());
        }
        self.state_families(buf);
        let mut headed = false;
        Out {
            buf,
            family: &names::ADMIN_CONNECTIONS_SHED,
            headed: &mut headed,
        }
        .sample("", |_| {}, m.admin_shed.get());
        let mut headed = false;
        Out {
            buf,
            family: &names::KEEPALIVED_RELOAD_FAILURES,
            headed: &mut headed,
        }
        .sample("", |_| {}, m.keepalived_failures.get());
        match m.vm_network_guard.load(Ordering::Relaxed) {
            0 => {}
            v => {
                gauge(buf, &names::VM_NETWORK_GUARD_UP, &u64::from(v == 1));
                gauge(
                    buf,
                    &names::VM_NETWORK_GUARD_FAILURES,
                    &m.vm_network_guard_failures.get(),
                );
            }
        }
        let mut headed = false;
        Out {
            buf,
            family: &names::BUILD_INFO,
            headed: &mut headed,
        }
        .sample(
            "",
            |b| {
                label_first(b, "version", crate::VERSION);
                label(b, "commit", crate::COMMIT);
            },
            1u64,
        );
        // With per-backend histograms on, the same family carries those
        // instead: a daemon-wide one beside them would be counted twice by
        // any sum over the family.
        if !m.per_backend_durations.load(Ordering::Relaxed) {
            let mut headed = false;
            Out {
                buf,
                family: &names::HEALTH_CHECK_DURATION,
                headed: &mut headed,
            }
            .histogram(&m.probe_duration, |_| {});
        }
    }

    /// The kernel forwarder's families, when it runs: whether it is up, its
    /// syncs, conntrack's use and the connections per backend.
    fn kernel_families(&self, buf: &mut Vec<u8>) {
        let m = &self.metrics;
        let load = |a: &std::sync::atomic::AtomicU64| a.load(Ordering::Relaxed);
        // Read while the config has a kernel listener, written or not.
        match m.kernel_forward_blocked.load(Ordering::Relaxed) {
            0 => {}
            b => gauge(buf, &names::KERNEL_FORWARD_BLOCKED, &u64::from(b == 2)),
        }
        match m.kernel_up.load(Ordering::Relaxed) {
            0 => {}
            v => {
                gauge(buf, &names::KERNEL_FORWARDING_UP, &u64::from(v == 1));
                gauge(
                    buf,
                    &names::KERNEL_SYNC_DURATION,
                    &f64::from_bits(load(&m.kernel_sync_seconds)),
                );
                let mut headed = false;
                let mut out = Out {
                    buf,
                    family: &names::KERNEL_SYNCS,
                    headed: &mut headed,
                };
                for (result, c) in [
                    ("success", &m.kernel_syncs_ok),
                    ("failure", &m.kernel_syncs_failed),
                ] {
                    out.sample("", |b| label_first(b, "result", result), c.get());
                }
                gauge(buf, &names::KERNEL_REPAIRS, &m.kernel_repairs.get());
                gauge(
                    buf,
                    &names::KERNEL_REFUSED,
                    &m.kernel_refused.load(Ordering::Relaxed),
                );
                if let Some((count, max)) = crate::os::conntrack_usage() {
                    gauge(buf, &names::CONNTRACK_ENTRIES, &count);
                    gauge(buf, &names::CONNTRACK_MAX, &max);
                }
            }
        }
        let kernel = m
            .kernel_backends
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        if !kernel.is_empty() {
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::KERNEL_BACKEND_CONNECTIONS,
                headed: &mut headed,
            };
            for k in &kernel {
                out.sample(
                    "",
                    |b| {
                        label_first(b, "cluster", &k.cluster);
                        label(b, "load_balancer", &k.load_balancer);
                        label(b, "listener", &k.listener);
                        label(b, "backend", &k.backend.to_string());
                    },
                    k.connections,
                );
            }
        }
    }

    /// The VIP announcer's families, when it runs: per VIP whether it is
    /// announced, its transitions and the reason, and its errors.
    /// `[conntrackd]`'s families, when it is configured.
    fn sync_families(&self, buf: &mut Vec<u8>) {
        let sample = self
            .metrics
            .conntrack_sync
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(s) = sample else { return };
        if s.up_known {
            gauge(buf, &names::CONNTRACK_SYNC_UP, &u8::from(s.up));
        }
        gauge(buf, &names::CONNTRACK_SYNC_FAILURES, &s.failures);
        if !s.transport.is_empty() {
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::CONNTRACK_SYNC_TRANSPORT,
                headed: &mut headed,
            };
            out.sample("", |b| label_first(b, "transport", s.transport), 1u8);
        }
        if s.up {
            gauge(
                buf,
                &names::CONNTRACK_SYNC_RESTART_PENDING,
                &u8::from(s.restart_pending),
            );
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::CONNTRACK_SYNC_ENTRIES,
                headed: &mut headed,
            };
            for (cache, n) in ["internal", "external"].into_iter().zip(s.entries) {
                out.sample("", |b| label_first(b, "cache", cache), n);
            }
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::CONNTRACK_SYNC_PACKETS,
                headed: &mut headed,
            };
            for (direction, n) in ["sent", "received"].into_iter().zip(s.packets) {
                out.sample("", |b| label_first(b, "direction", direction), n);
            }
            gauge(buf, &names::CONNTRACK_SYNC_SEND_ERRORS, &s.send_errors);
            gauge(buf, &names::CONNTRACK_SYNC_LOST, &s.lost);
        }
        let mut headed = false;
        let mut out = Out {
            buf,
            family: &names::VRRP_STATE,
            headed: &mut headed,
        };
        for i in s.instances.iter().filter(|i| i.state.is_some()) {
            for state in super::VRRP_STATES {
                out.sample(
                    "",
                    |b| {
                        label_first(b, "vrrp_instance", &i.instance);
                        label(b, "state", state);
                    },
                    u8::from(i.state.as_deref() == Some(state)),
                );
            }
        }
        let mut headed = false;
        let mut out = Out {
            buf,
            family: &names::VRRP_TRANSITION_TIME,
            headed: &mut headed,
        };
        for i in &s.instances {
            if let Some(at) = i.transition_at {
                out.sample("", |b| label_first(b, "vrrp_instance", &i.instance), at);
            }
        }
        let mut headed = false;
        let mut out = Out {
            buf,
            family: &names::CONNTRACK_SYNC_COMMITS,
            headed: &mut headed,
        };
        for i in &s.instances {
            for (result, n) in ["success", "failure"].into_iter().zip(i.commits) {
                out.sample(
                    "",
                    |b| {
                        label_first(b, "vrrp_instance", &i.instance);
                        label(b, "result", result);
                    },
                    n,
                );
            }
        }
        for (family, pick) in [
            (
                &names::CONNTRACK_SYNC_COMMIT_DURATION,
                (|c: (f64, f64)| c.0) as fn((f64, f64)) -> f64,
            ),
            (&names::CONNTRACK_SYNC_COMMIT_TIME, |c: (f64, f64)| c.1),
        ] {
            let mut headed = false;
            let mut out = Out {
                buf,
                family,
                headed: &mut headed,
            };
            for i in &s.instances {
                if let Some(c) = i.last_commit {
                    out.sample(
                        "",
                        |b| label_first(b, "vrrp_instance", &i.instance),
                        pick(c),
                    );
                }
            }
        }
        let mut headed = false;
        let mut out = Out {
            buf,
            family: &names::CONNTRACK_SYNC_GATE_OPEN,
            headed: &mut headed,
        };
        for i in &s.instances {
            if let Some(open) = i.gate_open {
                out.sample(
                    "",
                    |b| label_first(b, "vrrp_instance", &i.instance),
                    u8::from(open),
                );
            }
        }
    }

    fn announce_families(&self, buf: &mut Vec<u8>) {
        let m = &self.metrics;
        let announce = m.announce.lock().unwrap_or_else(|p| p.into_inner()).clone();
        if let Some(vips) = announce {
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::VIP_ANNOUNCED,
                headed: &mut headed,
            };
            for v in &vips {
                out.sample(
                    "",
                    |b| label_first(b, "vip", &v.vip.to_string()),
                    u64::from(v.announced),
                );
            }
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::VIP_ANNOUNCE_TRANSITIONS,
                headed: &mut headed,
            };
            for v in &vips {
                for (direction, n) in [("announce", v.announces), ("withdraw", v.withdrawals)] {
                    out.sample(
                        "",
                        |b| {
                            label_first(b, "vip", &v.vip.to_string());
                            label(b, "direction", direction);
                        },
                        n,
                    );
                }
            }
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::VIP_ANNOUNCE_REASON,
                headed: &mut headed,
            };
            for v in &vips {
                for reason in super::ANNOUNCE_REASONS {
                    out.sample(
                        "",
                        |b| {
                            label_first(b, "vip", &v.vip.to_string());
                            label(b, "reason", reason);
                        },
                        u64::from(v.reason == Some(reason)),
                    );
                }
            }
            gauge(buf, &names::VIP_ANNOUNCE_ERRORS, &m.announce_errors.get());
            gauge(buf, &names::VIP_ANNOUNCE_REPAIRS, &m.announce_repairs.get());
        }
    }
}

/// [`gauge`] for the families of other modules.
pub(super) fn gauge_family(buf: &mut Vec<u8>, family: &'static Family, value: impl Display) {
    gauge(buf, family, &value);
}

/// One family with one label, a sample per `(value, count)`.
pub(super) fn labelled_family(
    buf: &mut Vec<u8>,
    family: &'static Family,
    key: &str,
    samples: &[(&str, u64)],
) {
    let mut headed = false;
    let mut out = Out {
        buf,
        family,
        headed: &mut headed,
    };
    for (value, count) in samples {
        out.sample("", |b| label_first(b, key, value), count);
    }
}

/// One sample of a family without labels (a daemon-wide gauge), with its header.
impl Exposition {
    /// The state file's families (issue 41): absent until start has read
    /// it; the writes only where a file is kept.
    fn state_families(&self, buf: &mut Vec<u8>) {
        let m = &self.metrics;
        let sample = m
            .state_restored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone();
        let Some(sample) = sample else { return };
        let mut headed = false;
        Out {
            buf,
            family: &names::STATE_FILE_OUTCOME,
            headed: &mut headed,
        }
        .sample("", |b| label_first(b, "outcome", sample.outcome), 1);
        let mut headed = false;
        let mut out = Out {
            buf,
            family: &names::STATE_RESTORED,
            headed: &mut headed,
        };
        for (kind, n) in sample.kinds {
            out.sample("", |b| label_first(b, "kind", kind), n);
        }
        if sample.outcome != "none" {
            let mut headed = false;
            let mut out = Out {
                buf,
                family: &names::STATE_FILE_WRITES,
                headed: &mut headed,
            };
            for (result, c) in [
                ("success", &m.state_writes_ok),
                ("failure", &m.state_writes_failed),
            ] {
                out.sample("", |b| label_first(b, "result", result), c.get());
            }
        }
    }
}

fn gauge(buf: &mut Vec<u8>, family: &'static Family, value: &dyn Display) {
    let mut headed = false;
    Out {
        buf,
        family,
        headed: &mut headed,
    }
    .sample("", |_| {}, value);
}

fn step_family(step: &Step) -> &'static Family {
    match step {
        Step::Daemon => &names::BUILD_INFO,
        Step::Lb(f, _) | Step::Listener(f, _) | Step::Backend(f, _) => f,
    }
}

/// Writes samples of one family, its header before the first.
struct Out<'a> {
    buf: &'a mut Vec<u8>,
    family: &'static Family,
    headed: &'a mut bool,
}

impl Out<'_> {
    /// `name<suffix>{labels} value`; `labels` writes `k="v"` pairs
    /// separated by commas, or nothing.
    fn sample(&mut self, suffix: &str, labels: impl FnOnce(&mut Vec<u8>), value: impl Display) {
        if !*self.headed {
            self.family.write_header(self.buf);
            *self.headed = true;
        }
        self.buf.extend_from_slice(self.family.name.as_bytes());
        self.buf.extend_from_slice(suffix.as_bytes());
        let start = self.buf.len();
        self.buf.push(b'{');
        labels(self.buf);
        if self.buf.len() == start + 1 {
            self.buf.truncate(start);
        } else {
            self.buf.push(b'}');
        }
        let _ = writeln!(self.buf, " {value}");
    }

    /// A listener's pair of counters by `direction`: client to backend,
    /// then backend to client.
    fn directions(&mut self, l: &ListenerStats, counters: [&Counter; 2]) {
        for (direction, c) in DIRECTIONS.into_iter().zip(counters) {
            self.sample(
                "",
                |b| {
                    listener_labels(b, l);
                    label(b, "direction", direction);
                },
                c.get(),
            );
        }
    }

    /// One sample per outcome that has happened at least once.
    /// [`Self::outcomes`] of a family counted [`ByLabel`], under its own label texts.
    fn labelled<L: Label, const N: usize>(
        &mut self,
        counters: &ByLabel<L, N>,
        key: &str,
        labels: impl Fn(&mut Vec<u8>),
    ) {
        self.outcomes(counters.as_slice(), L::NAMES, key, labels);
    }

    fn outcomes(
        &mut self,
        counters: &[Counter],
        values: &[&str],
        key: &str,
        labels: impl Fn(&mut Vec<u8>),
    ) {
        for (c, v) in counters.iter().zip(values) {
            let n = c.get();
            if n > 0 {
                self.sample(
                    "",
                    |b| {
                        labels(b);
                        label(b, key, v);
                    },
                    n,
                );
            }
        }
    }

    /// `_bucket` per bound and `+Inf`, then `_sum` and `_count`.
    fn histogram(&mut self, h: &Histogram, labels: impl Fn(&mut Vec<u8>)) {
        let (cumulative, sum) = h.read();
        let bounds = PROBE_BUCKETS.iter().map(|le| le.to_string());
        for (le, n) in bounds
            .chain(std::iter::once("+Inf".to_string()))
            .zip(cumulative)
        {
            self.sample(
                "_bucket",
                |b| {
                    labels(b);
                    label(b, "le", &le);
                },
                n,
            );
        }
        self.sample("_sum", &labels, sum);
        self.sample("_count", &labels, cumulative[PROBE_BUCKETS.len()]);
    }
}

/// `k="v"`, preceded by a comma unless it is the first label.
fn label(buf: &mut Vec<u8>, key: &str, value: &str) {
    if buf.last() != Some(&b'{') {
        buf.push(b',');
    }
    label_first(buf, key, value);
}

/// `k="v"` with the value escaped as the format requires.
fn label_first(buf: &mut Vec<u8>, key: &str, value: &str) {
    buf.extend_from_slice(key.as_bytes());
    buf.extend_from_slice(b"=\"");
    for byte in value.bytes() {
        match byte {
            b'\\' => buf.extend_from_slice(b"\\\\"),
            b'"' => buf.extend_from_slice(b"\\\""),
            b'\n' => buf.extend_from_slice(b"\\n"),
            _ => buf.push(byte),
        }
    }
    buf.push(b'"');
}

fn lb_labels(buf: &mut Vec<u8>, lb: &LbStats) {
    label_first(buf, "cluster", &lb.cluster);
    label(buf, "load_balancer", &lb.name);
}

fn listener_labels(buf: &mut Vec<u8>, l: &ListenerStats) {
    lb_labels(buf, &l.lb);
    label(buf, "listener", &l.name);
}

fn backend_labels(buf: &mut Vec<u8>, be: &BackendStats) {
    lb_labels(buf, &be.lb);
    ip_label(buf, be.addr);
}

fn udp_backend_labels(buf: &mut Vec<u8>, l: &ListenerStats, addr: std::net::IpAddr) {
    listener_labels(buf, l);
    ip_label(buf, addr);
}

/// `backend="<addr>"`, formatted without an allocation.
fn ip_label(buf: &mut Vec<u8>, addr: std::net::IpAddr) {
    let mut ip = [0u8; 48];
    let n = {
        let mut cursor = std::io::Cursor::new(&mut ip[..]);
        let _ = write!(cursor, "{addr}");
        cursor.position() as usize
    };
    label(
        buf,
        "backend",
        std::str::from_utf8(&ip[..n]).unwrap_or_default(),
    );
}

/// How much text one chunk of a scrape holds before it is sent.
const CHUNK: usize = 64 * 1024;

/// The body of a `/metrics` response: the first chunk is written at once,
/// each poll after it writes the next. An exposition that fits in one chunk
/// goes out with a `Content-Length`; a longer one is sent chunked while it
/// is being written.
pub struct ExpositionBody {
    /// Written and not sent yet.
    ready: Option<Bytes>,
    /// What is left to write; `None` once all of it is.
    rest: Option<Exposition>,
}

impl From<Exposition> for ExpositionBody {
    fn from(mut e: Exposition) -> Self {
        let (first, more) = next_chunk(&mut e);
        Self {
            ready: Some(first),
            rest: more.then_some(e),
        }
    }
}

/// The next chunk, and whether more follows.
fn next_chunk(e: &mut Exposition) -> (Bytes, bool) {
    let mut buf = Vec::with_capacity(CHUNK + CHUNK / 4);
    let more = e.fill(&mut buf, CHUNK);
    (Bytes::from(buf), more)
}

impl Body for ExpositionBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(chunk) = self.ready.take() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        let Some(e) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let (chunk, more) = next_chunk(e);
        if !more {
            self.rest = None;
        }
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_none() && self.rest.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.ready, &self.rest) {
            (Some(chunk), None) => SizeHint::with_exact(chunk.len() as u64),
            (None, None) => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

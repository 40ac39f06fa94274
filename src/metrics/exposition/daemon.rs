//! The daemon-wide families: one sample each (or one per kind), written
//! by the scrape's first step ([`Step::Daemon`](super::Step)) from the
//! daemon's own counters, not from a load balancer's objects. Their own
//! file because they are most of the exposition's code and change with
//! the host features they count (NAT writer, announcer, conntrackd, the
//! state file), while the parent's steps and writer do not.

use std::sync::atomic::Ordering;

use super::{Exposition, Out, gauge, label, label_first};
use crate::metrics::names;

impl Exposition {
    /// The daemon-wide families.
    pub(super) fn daemon(&self, buf: &mut Vec<u8>) {
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
            &crate::metrics::CONNECTION_LOG_LINES_DROPPED.get(),
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
            for state in crate::metrics::VRRP_STATES {
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
                for reason in crate::metrics::ANNOUNCE_REASONS {
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

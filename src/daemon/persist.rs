//! The daemon's side of the state file (`crate::state_file`): what it
//! collects from the live load balancers, when it writes, and how a new
//! process puts the entries back before its first probe and its first
//! connection.
//!
//! Written when something kept changes (an operator state, a verdict, a
//! counter below its threshold), at most once a second, and once a minute
//! regardless (so the file's age says how fresh its verdicts and affinity
//! entries are); once more at stop and at hand-over, after which no periodic
//! write may replace it with the emptied state of a stopping daemon.
//! Restored at start only: a reload keeps what is live anyway.

use std::collections::{BTreeMap, HashMap};
use std::net::IpAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use serde::Serialize;

use super::{Daemon, LbEntry};
use crate::config::{Config, LoadBalancerSpec};
use crate::dataplane::balancer::{AdminState, Backend, affinity};
use crate::dataplane::health::prober::TargetKey;
use crate::dataplane::health::{Health, HealthState};
use crate::state_file::{self, AffinityEntry, BackendState, LbState, StateFile, Verdict};

/// How often the writer looks for a change.
const TICK: Duration = Duration::from_secs(1);
/// The longest the file goes unwritten while the daemon runs.
const REFRESH: Duration = Duration::from_secs(60);

/// The state file's place in the daemon.
#[derive(Default)]
pub(super) struct Persist {
    /// The file and the config file it belongs to; `None` until start
    /// says, and when no file is kept.
    target: Mutex<Option<(PathBuf, PathBuf)>>,
    /// Entries read at start, taken by each load balancer as it is made;
    /// dropped once the first config is in force.
    pending: Mutex<Pending>,
    /// Serialises writes; holds what the last one kept.
    writer: tokio::sync::Mutex<Written>,
    /// Set by the last write (stop, hand-over): the periodic writer stops.
    closed: AtomicBool,
    /// What `/status` and the metrics say.
    status: Mutex<StateFileStatus>,
    /// Fingerprints by load balancer, with the spec they were made of.
    fingerprints: Mutex<HashMap<String, (Arc<LoadBalancerSpec>, String)>>,
}

#[derive(Default)]
struct Pending {
    load_balancers: HashMap<String, LbState>,
    verdicts: HashMap<TargetKey, HealthState>,
}

#[derive(Default)]
struct Written {
    /// A digest of what the last write kept, without times.
    digest: Option<u64>,
    /// When (tokio's clock).
    at: Option<tokio::time::Instant>,
}

/// The state file in `/status`.
#[derive(Debug, Clone, Serialize)]
pub struct StateFileStatus {
    /// The file; `null` when none is kept (no `daemon.state_file` and no
    /// `$STATE_DIRECTORY`).
    pub path: Option<String>,
    /// What start made of it: `restored`, `missing` (a first start),
    /// `none` (no file kept), or why it was ignored (`corrupt`, `stale`,
    /// `future`, `other_config`, `unknown_version`, `unreadable`).
    pub outcome: &'static str,
    /// The reason in words, when it was ignored.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reason: Option<String>,
    /// What was put back.
    pub restored: RestoredCounts,
    /// Load balancers whose entries were dropped: their backends, ports or
    /// health check changed while the daemon was down.
    pub load_balancers_changed: Vec<String>,
    /// The last successful write, Unix seconds.
    pub last_write_unix: Option<f64>,
    /// The last failed write, in words; cleared by a success.
    pub last_write_error: Option<String>,
}

impl Default for StateFileStatus {
    /// No file kept (before start says otherwise).
    fn default() -> Self {
        Self {
            path: None,
            outcome: "none",
            reason: None,
            restored: RestoredCounts::default(),
            load_balancers_changed: Vec::new(),
            last_write_unix: None,
            last_write_error: None,
        }
    }
}

/// What start put back, per kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct RestoredCounts {
    /// Backends put back in `drain` or `maint`.
    pub operator_states: usize,
    /// Health verdicts (per backend, or per port judged alone).
    pub verdicts: usize,
    /// Verdicts too old to restore ([`state_file::VERDICT_MAX_AGE`]).
    pub verdicts_expired: usize,
    /// Client-affinity entries.
    pub affinity_entries: usize,
}

impl Daemon {
    /// Reads the state file before the first config is applied: `config`
    /// is that config, `config_path` its file. Never fails: a file it cannot
    /// trust is one warning, and the daemon starts as without one.
    pub fn restore_state(&self, config_path: &Path, config: &Config) {
        let path = state_file::location(
            config.daemon.state_file.as_deref(),
            std::env::var_os("STATE_DIRECTORY").as_deref(),
        );
        let mut status = StateFileStatus {
            path: path.as_ref().map(|p| p.display().to_string()),
            ..Default::default()
        };
        if let Some(path) = &path {
            *lock(&self.persist.target) = Some((path.clone(), config_path.to_path_buf()));
            match state_file::load(path, config_path, SystemTime::now()) {
                Ok(None) => {
                    status.outcome = "missing";
                    tracing::debug!(file = %path.display(), "no state file: nothing to restore");
                }
                Err(reason) => {
                    tracing::warn!(
                        file = %path.display(),
                        reason = reason.kind(),
                        "state file ignored: {reason}; starting as without one"
                    );
                    status.outcome = reason.kind();
                    status.reason = Some(reason.to_string());
                }
                Ok(Some(mut file)) => {
                    let changed = file.keep_matching(config);
                    if !changed.is_empty() {
                        tracing::warn!(
                            file = %path.display(),
                            count = changed.len(),
                            "state file: the entries of {} load balancer(s) were dropped, their backends, ports or health check changed since it was written: {}{}",
                            changed.len(),
                            changed.iter().take(5).cloned().collect::<Vec<_>>().join(", "),
                            if changed.len() > 5 { ", …" } else { "" }
                        );
                    }
                    status.outcome = "restored";
                    status.load_balancers_changed = changed;
                    lock(&self.persist.pending).load_balancers =
                        file.load_balancers.into_iter().collect();
                }
            }
        }
        *lock(&self.persist.status) = status;
    }

    /// Ends the restore once the first config is in force: entries no load
    /// balancer took are dropped, and the outcome is logged and exported.
    pub fn finish_restore(&self) {
        *lock(&self.persist.pending) = Pending::default();
        let status = lock(&self.persist.status).clone();
        if status.outcome == "restored" {
            let r = status.restored;
            tracing::info!(
                file = status.path.as_deref().unwrap_or(""),
                operator_states = r.operator_states,
                verdicts = r.verdicts,
                verdicts_expired = r.verdicts_expired,
                affinity_entries = r.affinity_entries,
                "state restored"
            );
        }
        let r = status.restored;
        self.metrics.set_state_restored(
            status.outcome,
            [
                ("operator_state", r.operator_states),
                ("verdict", r.verdicts),
                ("affinity_entry", r.affinity_entries),
            ],
        );
    }

    /// The state file in `/status`.
    pub fn state_file_status(&self) -> StateFileStatus {
        lock(&self.persist.status).clone()
    }

    /// Puts back the operator states of a new load balancer's `backends`
    /// (before its first snapshot and probe) and keeps its verdicts for
    /// [`Daemon::restored_verdict`]. Returns its affinity entries, for
    /// [`Daemon::restore_affinity`] once its table exists.
    pub(super) fn restore_backends(
        &self,
        spec: &LoadBalancerSpec,
        backends: &HashMap<IpAddr, Arc<Backend>>,
    ) -> Vec<AffinityEntry> {
        let mut pending = lock(&self.persist.pending);
        let Some(lb) = pending.load_balancers.remove(&spec.name) else {
            return Vec::new();
        };
        // Checked at start against the first config; again here, as a
        // load balancer may come later.
        if lb.fingerprint != state_file::fingerprint(spec) {
            return Vec::new();
        }
        let now = SystemTime::now();
        let mut counts = RestoredCounts::default();
        for (ip, kept) in &lb.backends {
            let Some(backend) = backends.get(ip) else {
                continue;
            };
            if let Some(state) = kept.admin.as_deref().and_then(AdminState::parse)
                && state != AdminState::Ready
            {
                backend.set_admin_state(state);
                counts.operator_states += 1;
            }
            let Some(hc) = &spec.health_check else {
                continue;
            };
            for v in &kept.health {
                let status = match v.status.as_str() {
                    "healthy" => Health::Healthy,
                    "unhealthy" => Health::Unhealthy,
                    _ => continue,
                };
                let fresh = v
                    .probed_unix
                    .is_some_and(|t| state_file::age(t, now) <= state_file::VERDICT_MAX_AGE);
                if !fresh {
                    counts.verdicts_expired += 1;
                    continue;
                }
                pending.verdicts.insert(
                    TargetKey::new(&spec.name, *ip, v.port),
                    HealthState {
                        status,
                        consecutive_successes: v
                            .consecutive_successes
                            .min(hc.success_threshold.get()),
                        consecutive_failures: v
                            .consecutive_failures
                            .min(hc.failure_threshold.get()),
                    },
                );
            }
        }
        drop(pending);
        let mut status = lock(&self.persist.status);
        status.restored.operator_states += counts.operator_states;
        status.restored.verdicts_expired += counts.verdicts_expired;
        lb.affinity
    }

    /// The verdict kept for `key`, taken (once) by a target being made.
    pub(super) fn restored_verdict(&self, key: &TargetKey) -> Option<HealthState> {
        let v = lock(&self.persist.pending).verdicts.remove(key)?;
        lock(&self.persist.status).restored.verdicts += 1;
        Some(v)
    }

    /// Puts back a new load balancer's affinity entries still within its
    /// timeout, for backends it still has.
    pub(super) fn restore_affinity(
        &self,
        entry: &LbEntry,
        spec: &LoadBalancerSpec,
        kept: Vec<AffinityEntry>,
    ) {
        let (Some(timeout), Some(table)) = (spec.affinity_timeout, entry.lb.affinity()) else {
            return;
        };
        let now = SystemTime::now();
        let now_secs = affinity::now_secs();
        let mut n = 0;
        for e in kept {
            let age = state_file::age(e.seen_unix, now);
            if age > timeout || !entry.backends.contains_key(&e.backend) {
                continue;
            }
            let age = u32::try_from(age.as_secs()).unwrap_or(u32::MAX);
            if table.restore(e.client, e.backend, age, now_secs) {
                n += 1;
            }
        }
        lock(&self.persist.status).restored.affinity_entries += n;
    }

    /// Starts the task that writes the state file on changes (at most once
    /// a `TICK`) and every `REFRESH`, until `stop` or the last write.
    pub fn start_state_writer(&self, stop: tokio_util::sync::CancellationToken) {
        if lock(&self.persist.target).is_none() {
            return;
        }
        let me = self.me.clone();
        tokio::spawn(async move {
            let mut tick = tokio::time::interval(TICK);
            tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tick.tick() => {}
                }
                let Some(daemon) = me.upgrade() else { return };
                if daemon.persist.closed.load(Ordering::Acquire) {
                    return;
                }
                daemon.write_state(false, false).await;
            }
        });
    }

    /// Writes the state file now, and no more after it (stop, hand-over):
    /// returns whether it was written.
    pub async fn write_state_last(&self) -> bool {
        self.write_state(true, true).await
    }

    /// Collects and writes when something changed, the file is due a
    /// refresh, or `force`; `last` closes the file to later writes.
    async fn write_state(&self, force: bool, last: bool) -> bool {
        let Some((path, config_path)) = lock(&self.persist.target).clone() else {
            return false;
        };
        let mut written = self.persist.writer.lock().await;
        if self.persist.closed.load(Ordering::Acquire) {
            return false;
        }
        if last {
            self.persist.closed.store(true, Ordering::Release);
        }
        let due = written.at.is_none_or(|at| at.elapsed() >= REFRESH);
        if !force && !due {
            // Without the affinity entries (a million of them would be
            // exported every second for nothing): they never make a
            // write, only ride along with one.
            let digest = self.collect_off_runtime(config_path.clone(), false).await;
            if digest.is_none() || written.digest == digest.map(|(_, d)| d) {
                return false;
            }
        }
        let Some((file, digest)) = self.collect_off_runtime(config_path, true).await else {
            return false;
        };
        let result = tokio::task::spawn_blocking({
            let path = path.clone();
            move || state_file::save(&path, &file)
        })
        .await;
        let mut status = lock(&self.persist.status);
        match result {
            Ok(Ok(())) => {
                written.digest = Some(digest);
                written.at = Some(tokio::time::Instant::now());
                status.last_write_unix = Some(state_file::unix(SystemTime::now()));
                status.last_write_error = None;
                self.metrics.state_file_written(true);
                true
            }
            Ok(Err(e)) => {
                if status.last_write_error.is_none() {
                    tracing::warn!(
                        "{e}; the daemon serves on, and a restart would start as without the file"
                    );
                }
                status.last_write_error = Some(e.to_string());
                self.metrics.state_file_written(false);
                false
            }
            Err(e) => {
                tracing::error!(error = %e, file = %path.display(), "the state file writer ended abnormally");
                self.metrics.state_file_written(false);
                false
            }
        }
    }

    /// [`Daemon::collect_state`] on a blocking thread: at thousands of load
    /// balancers it walks every target under the daemon's lock, which no
    /// runtime thread should wait for. `None` when the daemon is gone.
    async fn collect_off_runtime(
        &self,
        config_path: PathBuf,
        affinity: bool,
    ) -> Option<(StateFile, u64)> {
        let me = self.me.upgrade()?;
        match tokio::task::spawn_blocking(move || me.collect_state(config_path, affinity)).await {
            Ok(collected) => Some(collected),
            Err(e) => {
                tracing::error!(error = %e, "collecting the state file's contents ended abnormally");
                None
            }
        }
    }

    /// The state of every load balancer in force (its affinity entries
    /// only with `affinity`), and a digest of what it keeps but times and
    /// affinity entries (a change of it is a reason to write).
    fn collect_state(&self, config_path: PathBuf, affinity: bool) -> (StateFile, u64) {
        let now = SystemTime::now();
        let now_unix = state_file::unix(now);
        let now_secs = affinity::now_secs();
        let mut digest = Digest::default();
        let mut load_balancers = BTreeMap::new();
        let st = self.lock();
        let specs = st.config.iter().flat_map(|c| &c.load_balancers);
        let mut fingerprints = lock(&self.persist.fingerprints);
        for spec in specs {
            let Some(entry) = st.load_balancers.get(&spec.name) else {
                continue;
            };
            let fingerprint = match fingerprints.get(&spec.name) {
                Some((s, f)) if Arc::ptr_eq(s, spec) => f.clone(),
                _ => {
                    let f = state_file::fingerprint(spec);
                    fingerprints.insert(spec.name.clone(), (Arc::clone(spec), f.clone()));
                    f
                }
            };
            digest.add(&spec.name);
            digest.add(&fingerprint);
            let mut backends = BTreeMap::new();
            for ip in &spec.backends {
                let Some(backend) = entry.backends.get(ip) else {
                    continue;
                };
                let kept = self.backend_state(spec, backend, &mut digest);
                if kept.admin.is_some() || !kept.health.is_empty() {
                    backends.insert(*ip, kept);
                }
            }
            let clients = entry
                .lb
                .affinity()
                .filter(|_| affinity && spec.affinity_timeout.is_some())
                .map(|t| {
                    t.export(now_secs)
                        .into_iter()
                        .map(|(client, backend, age)| AffinityEntry {
                            client,
                            backend,
                            seen_unix: now_unix - f64::from(age),
                        })
                        .collect()
                })
                .unwrap_or_default();
            load_balancers.insert(
                spec.name.clone(),
                LbState {
                    fingerprint,
                    backends,
                    affinity: clients,
                },
            );
        }
        fingerprints.retain(|name, _| st.load_balancers.contains_key(name));
        drop(fingerprints);
        drop(st);
        let file = StateFile {
            version: state_file::VERSION,
            written_unix: now_unix,
            boot_id: state_file::boot_id(),
            pid: std::process::id(),
            config: config_path,
            load_balancers,
        };
        (file, digest.0)
    }

    /// What is kept of one backend: its operator state, and each verdict
    /// with a probe behind it, counters capped at their thresholds.
    fn backend_state(
        &self,
        spec: &LoadBalancerSpec,
        backend: &Backend,
        digest: &mut Digest,
    ) -> BackendState {
        let admin = match backend.admin_state() {
            AdminState::Ready => None,
            s => Some(s.as_str().to_string()),
        };
        digest.ip(backend.addr);
        digest.add(backend.admin_state().as_str());
        let mut health = Vec::new();
        if let Some(hc) = &spec.health_check {
            let ports = backend.checked_ports();
            let keys: Vec<Option<u16>> = if ports.is_empty() {
                vec![None]
            } else {
                ports.into_iter().map(Some).collect()
            };
            for port in keys {
                let key = TargetKey::new(&spec.name, backend.addr, port);
                let Some(target) = self.prober.get(&key) else {
                    continue;
                };
                let s = target.status();
                let Some(probed_unix) = s.last_probe_unix else {
                    continue;
                };
                let v = Verdict {
                    port,
                    status: s.health.status.to_string(),
                    consecutive_successes: s
                        .health
                        .consecutive_successes
                        .min(hc.success_threshold.get()),
                    consecutive_failures: s
                        .health
                        .consecutive_failures
                        .min(hc.failure_threshold.get()),
                    probed_unix: Some(probed_unix),
                };
                digest.bytes(&port.map_or([0xff; 2], u16::to_be_bytes));
                digest.add(&v.status);
                digest.bytes(&v.consecutive_successes.to_be_bytes());
                digest.bytes(&v.consecutive_failures.to_be_bytes());
                health.push(v);
            }
        }
        BackendState { admin, health }
    }
}

/// FNV-1a over what a write keeps, field by field.
struct Digest(u64);

impl Default for Digest {
    fn default() -> Self {
        Self(0xcbf2_9ce4_8422_2325)
    }
}

impl Digest {
    /// A string, ended (so that "ab","c" differs from "a","bc").
    fn add(&mut self, s: &str) {
        self.bytes(s.as_bytes());
        self.bytes(&[0]);
    }

    fn ip(&mut self, ip: IpAddr) {
        match ip {
            IpAddr::V4(a) => self.bytes(&a.octets()),
            IpAddr::V6(a) => self.bytes(&a.octets()),
        }
    }

    fn bytes(&mut self, bytes: &[u8]) {
        for b in bytes {
            self.0 ^= u64::from(*b);
            self.0 = self.0.wrapping_mul(0x0000_0100_0000_01b3);
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

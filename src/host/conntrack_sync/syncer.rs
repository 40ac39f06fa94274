//! `[conntrackd]`: conntrackd's file and keepalived's notify script, the
//! gate table, and what `/status` and `/metrics` say of the sync.
//!
//! Run by the VM-network task (`vmnet`) at every apply and every
//! [`CHECK_INTERVAL`], after keepalived's file. Each step:
//!
//! 1. renders conntrackd.conf and the notify script (`host::conntrack_sync::conntrackd`) and
//!    writes what changed; a changed conntrackd.conf is followed by
//!    `conntrackd.restart_command` (conntrackd reads its file only at
//!    start), then, once conntrackd answers, `-B` and `-n` (its caches
//!    start empty). A failure is logged at error, counted
//!    (`conntrack_sync_config_failures_total`) and retried at the next step;
//! 2. reads what the notify script recorded per instance
//!    (`state_directory/<vrid>`);
//! 3. writes the gate table when what it must match changed, else reads it
//!    back and repairs it (`host::conntrack_sync::gate`; repairs logged at warn and counted
//!    in `host_repairs_total{kind="sync_gate"}`), and reads each gate's
//!    state;
//! 4. asks conntrackd for its statistics (`conntrackd -C FILE -s`) and
//!    its uptime (`-s runtime`): a conntrackd started before its file was
//!    last written runs with an older filter (`restart_pending`, warned
//!    once; the daemon never restarts conntrackd without
//!    `restart_command`: it does not know how conntrackd is run).
//!
//! In the anycast mode (`[conntrackd]` without `[keepalived]`) there is no
//! script and no instance: step 1 writes conntrackd.conf alone, and
//! before it the anycast guard table is written when its text changed,
//! else read back and repaired (`anycast_guard`; removed when the mode
//! ends).
//!
//! All of it is blocking (files, `nft`, `conntrackd`) and runs on the
//! blocking pool, never on a worker the data plane shares. Without
//! `[conntrackd]` the gate table, if this process wrote one, is removed
//! (nothing commits any more, so nothing must wait).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::Duration;

use serde::Serialize;

use crate::config::{Config, ConntrackdSettings};
use crate::host::conntrack_sync::conntrackd::{
    self, AnycastGuard, GATE_TABLE, Installed, Recorded, Stats, instance_name, parse_recorded,
    parse_stats,
};
use crate::host::conntrack_sync::gate::Gate;
use crate::host::owned::Claims;
use crate::host::owned::{CHECK_INTERVAL, Checked, Guard};
use crate::metrics::{Metrics, SyncInstanceSample, SyncSample};

/// How long `conntrackd -s` may take before the check gives up on it.
const STATS_TIMEOUT: Duration = Duration::from_secs(2);

/// The conntrackd sync's component: its own state (the gate and the
/// anycast guard as written, the files' retries), its step, its `/status`
/// part. The daemon holds it and calls `step` with the
/// config in force.
pub struct ConntrackSync {
    /// Where its failures and repairs are counted.
    metrics: Arc<Metrics>,
    inner: tokio::sync::Mutex<Inner>,
    /// The last step's findings, for `/status`.
    report: std::sync::Mutex<Option<SyncStatus>>,
}

#[derive(Default)]
struct Inner {
    /// The gate table as last written (what its read-back is compared with).
    guard: Guard,
    /// What the gate was last written from.
    written: Option<Gate>,
    /// The last write of the files or the restart failed: try again.
    retry: bool,
    /// Failures so far (`conntrack_sync_config_failures_total`).
    failures: u64,
    /// The anycast mode's guard table as last written (`None`: not written
    /// by this process, or removed).
    anycast_written: Option<String>,
    /// Its read-back, compared with the kernel at every step.
    anycast_guard: Guard,
    /// Whether the missing `nf_conntrack_tcp_be_liberal` was logged (once
    /// per process).
    liberal_warned: bool,
    /// The last check found conntrackd's file newer than conntrackd (and
    /// said so once).
    pending_warned: bool,
}

/// `/status` `conntrack_sync`: what the last check found.
#[derive(Debug, Clone, Serialize)]
pub struct SyncStatus {
    /// Whether conntrackd answered `-s`.
    pub conntrackd_up: bool,
    /// Whether this daemon may ask conntrackd at all: under the shipped
    /// unit its control socket is root's (0755 under root's umask), so a
    /// `false` `conntrackd_up` there says nothing of conntrackd, and no
    /// `conntrack_sync_up` series is exported (the alert on it would fire
    /// for ever).
    pub conntrackd_readable: bool,
    /// Why not, in its words.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub conntrackd_error: Option<String>,
    /// Its internal cache: this host's flows of kernel listeners.
    pub internal_entries: u64,
    /// Its external cache: the peer's, committed at a takeover.
    pub external_entries: u64,
    /// Packets received from the peer on the sync link.
    pub packets_received: u64,
    /// The sync link: interface, own address, the peer's address or the
    /// multicast group, port, transport.
    pub link: String,
    /// The backends whose flows are synced (conntrackd's filter).
    pub synced_backends: usize,
    /// conntrackd runs with an older file than the one written (it reads
    /// it only at start): the backends added since are not in its filter,
    /// their flows are not synced until conntrackd restarts.
    pub restart_pending: bool,
    /// Each VRRP instance of the rendered keepalived file.
    pub instances: Vec<SyncInstanceStatus>,
    /// The last failure writing the files, restarting conntrackd or
    /// writing the gate, while it stands.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub error: Option<String>,
}

/// One instance in `/status` `conntrack_sync.instances`.
#[derive(Debug, Clone, Serialize)]
pub struct SyncInstanceStatus {
    /// `hlb_<vrid>`.
    pub instance: String,
    /// The last transition the notify script recorded (`MASTER`, `BACKUP`,
    /// `FAULT`, `STOP`); absent: none yet.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub state: Option<String>,
    /// When, Unix seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub since_unix: Option<f64>,
    /// The last commit's result (`ok`, `failed`), at the last move here.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_commit: Option<&'static str>,
    /// Its duration, milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub last_commit_ms: Option<u64>,
    /// The gate as read back: `open`, `closed`, or `absent`.
    pub gate: &'static str,
}

impl ConntrackSync {
    /// Nothing written yet; counts in `metrics`.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            metrics,
            inner: tokio::sync::Mutex::default(),
            report: std::sync::Mutex::default(),
        }
    }

    /// One step of the sync (see the module's text); `config` is the one
    /// in force, `claims` the daemon's (the gate table's is taken here).
    pub(crate) async fn step(&self, config: &Config, claims: &Claims) {
        let mut inner = self.inner.lock().await;
        self.anycast_guard(&mut inner, config).await;
        let Some(settings) = config.conntrackd.clone() else {
            self.remove_gate(&mut inner, "[conntrackd] removed").await;
            self.metrics.set_conntrack_sync(None);
            *self.report.lock().unwrap_or_else(|p| p.into_inner()) = None;
            return;
        };
        // Only with the gate's claim (taken at start and reload): another
        // daemon's gate is never replaced.
        if let Err(e) = claims.hold(crate::host::owned::Object::SyncGate).await {
            tracing::error!("[conntrackd]: {e}");
            return;
        }
        // The anycast mode (no `[keepalived]`) commits nothing, so it has no
        // gate (docs/many-hosts.md): only a keepalived mode's gate, left by
        // a reload that removed `[keepalived]`, is removed.
        let keepalived_mode = config.keepalived.is_some();
        if !keepalived_mode {
            self.remove_gate(&mut inner, "the anycast sync has no gate")
                .await;
        }
        let mut error = None;
        if let Some(conf) = conntrackd::render_conf(config) {
            let script = conntrackd::render_script(config);
            // Under the shipped unit root installs them (`host::vmnet::handoff`).
            let handoff = crate::host::vmnet::handoff::dir();
            let s = match &handoff {
                Some(dir) => crate::host::vmnet::handoff::conntrackd_settings(&settings, dir),
                None => settings.clone(),
            };
            let force = inner.retry;
            let done = tokio::task::spawn_blocking(move || {
                conntrackd::install(&s, &conf, script.as_deref(), force)
            })
            .await;
            match done {
                Ok(Ok(Installed::Unchanged)) => inner.retry = false,
                Ok(Ok(_)) if handoff.is_some() => {
                    inner.retry = false;
                    tracing::info!(
                        file = %settings.config_path.display(),
                        script = %settings.notify_script.display(),
                        "conntrackd's configuration and keepalived's notify script handed off for harvester-lb-vrrp.service to install as root (it renders the same from the config file, and runs conntrackd.restart_command)"
                    );
                }
                Ok(Ok(what)) => {
                    inner.retry = false;
                    let restarted = settings.restart_command.is_some();
                    if restarted && what == Installed::ConfChanged {
                        let conf = settings.config_path.clone();
                        match tokio::task::spawn_blocking(move || resync_after_restart(&conf)).await
                        {
                            Ok(Ok(())) => tracing::info!(
                                "conntrackd restarted: its flows sent to the peer (-B) and the peer's asked for (-n)"
                            ),
                            Ok(Err(e)) => {
                                inner.failures += 1;
                                tracing::error!("after conntrackd.restart_command: {e}");
                                error = Some(e.to_string());
                            }
                            Err(e) => tracing::error!(
                                "the resync after conntrackd's restart stopped: {e}"
                            ),
                        }
                    }
                    match (what, restarted) {
                        (Installed::ConfChanged, false) => tracing::warn!(
                            file = %settings.config_path.display(),
                            "conntrackd's configuration changed (its filter follows the kernel listeners' backends); conntrackd reads it at its next start (set conntrackd.restart_command to restart it now)"
                        ),
                        _ => tracing::info!(
                            file = %settings.config_path.display(),
                            script = %settings.notify_script.display(),
                            "conntrackd's configuration and keepalived's notify script written"
                        ),
                    }
                }
                Ok(Err(e)) => {
                    inner.retry = true;
                    inner.failures += 1;
                    tracing::error!("{e}; retried in {} s", CHECK_INTERVAL.as_secs());
                    error = Some(e.to_string());
                }
                Err(e) => {
                    inner.retry = true;
                    inner.failures += 1;
                    tracing::error!("writing conntrackd's configuration stopped: {e}");
                    error = Some(e.to_string());
                }
            }
        }
        let dir = settings.state_directory.clone();
        let recorded = tokio::task::spawn_blocking(move || read_recorded(&dir))
            .await
            .unwrap_or_default();
        let mut states = BTreeMap::new();
        if keepalived_mode {
            self.write_gate(&mut inner, config, &recorded, &mut states, &mut error)
                .await;
        }
        let conf = settings.config_path.clone();
        let lock = settings.lock_file.clone();
        let (stats, pending) = tokio::task::spawn_blocking(move || {
            let stats = conntrackd_stats(&conf);
            let pending = stats
                .is_ok()
                .then(|| conntrackd_restart_pending(&conf, &lock))
                .flatten();
            (stats, pending)
        })
        .await
        .unwrap_or_else(|e| (Err(ConntrackdStatsError::Stopped(e)), None));
        let pending = pending.unwrap_or(false);
        if pending && !inner.pending_warned {
            tracing::warn!(
                file = %settings.config_path.display(),
                "conntrackd runs with an older file than the one written (it reads it only at start): the flows of backends added since are not synced, and reset at a VIP's move, until conntrackd restarts (conntrackd.restart_command, or by hand on one host at a time)"
            );
        }
        inner.pending_warned = pending;
        let readable = stats.is_ok() || !control_socket_refused(&settings.socket);
        let (mut report, stats) = build_report(&settings, config, &recorded, &states, stats, error);
        report.restart_pending = pending;
        report.conntrackd_readable = readable;
        if !readable {
            report.conntrackd_error = Some(format!(
                "conntrackd's control socket {} is not this daemon's to use (under the shipped unit it is root's): whether conntrackd runs is not known here; watch conntrackd.service (systemctl is-active conntrackd)",
                settings.socket.display()
            ));
        }
        self.metrics.set_conntrack_sync(Some(sample_of(
            &report,
            &stats,
            &recorded,
            (inner.failures, settings.transport.name()),
        )));
        *self.report.lock().unwrap_or_else(|p| p.into_inner()) = Some(report);
    }

    /// `/status` `conntrack_sync`; `None` without `[conntrackd]`.
    pub(crate) fn status(&self) -> Option<SyncStatus> {
        self.report
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

impl ConntrackSync {
    /// Removes the gate table if this process wrote it (`why` says what
    /// made it go, in the log).
    async fn remove_gate(&self, inner: &mut Inner, why: &'static str) {
        if inner.written.take().is_none() {
            return;
        }
        inner.guard.forget();
        let removed = tokio::task::spawn_blocking(|| {
            crate::host::nft::run(
                &["-f", "-"],
                format!("add table inet {GATE_TABLE}\ndelete table inet {GATE_TABLE}\n").as_bytes(),
            )
        })
        .await;
        match removed {
            Ok(Ok(_)) => tracing::info!("{why}: the sync gate table is removed"),
            Ok(Err(e)) => tracing::error!(
                "{why}, but the gate table inet {GATE_TABLE} cannot be removed: {e}"
            ),
            Err(e) => tracing::error!("removing the sync gate table stopped: {e}"),
        }
    }

    /// The keepalived mode's gate: written when what it must match
    /// changed, else read back and repaired; `states` gets each instance's
    /// gate as read, `error` the step's failure.
    async fn write_gate(
        &self,
        inner: &mut Inner,
        config: &Config,
        recorded: &BTreeMap<u32, Recorded>,
        states: &mut BTreeMap<u32, bool>,
        error: &mut Option<String>,
    ) {
        let gate = Gate {
            gated: conntrackd::gated(config),
            vrids: conntrackd::vrids(config),
            masters: recorded
                .iter()
                .filter(|(_, r)| r.state == "MASTER")
                .map(|(v, _)| *v)
                .collect(),
        };
        // The comparison leaves `masters` out: it only seeds new gates.
        let same = inner
            .written
            .as_ref()
            .is_some_and(|w| w.gated == gate.gated && w.vrids == gate.vrids);
        let mut guard = std::mem::take(&mut inner.guard);
        let g = gate.clone();
        let repairs = self.metrics.host_repairs();
        let gated = tokio::task::spawn_blocking(move || {
            let result = if same {
                guard.check(&g, &repairs).map(Some)
            } else {
                guard.write(&g).map(|()| None)
            };
            let states = Gate::read_states();
            (guard, result, states)
        })
        .await;
        match gated {
            Ok((guard, result, read)) => {
                inner.guard = guard;
                match result {
                    Ok(None) => {
                        tracing::info!(
                            listeners = gate.gated.len(),
                            "the sync gate table inet {GATE_TABLE} written"
                        );
                        inner.written = Some(gate.clone());
                    }
                    Ok(Some(Checked::Repaired(drift))) => {
                        tracing::warn!(
                            found = "by the periodic check",
                            "the sync gate table inet {GATE_TABLE} was changed by another process ({drift}); written again"
                        );
                    }
                    Ok(Some(_)) => {}
                    Err(e) => {
                        inner.written = None;
                        inner.failures += 1;
                        tracing::error!("{e}; retried in {} s", CHECK_INTERVAL.as_secs());
                        *error = Some(e.to_string());
                    }
                }
                match read {
                    Ok(s) => *states = s,
                    Err(e) => tracing::debug!("{e}"),
                }
            }
            Err(e) => {
                inner.written = None;
                inner.failures += 1;
                tracing::error!("writing the sync gate table stopped: {e}");
                *error = Some(e.to_string());
            }
        }
    }
}

impl ConntrackSync {
    /// The anycast mode's guard table (`host::conntrack_sync::conntrackd::anycast_table`):
    /// written when its text changed, removed when the mode ends, and
    /// otherwise read back and repaired like the gate (repairs logged at
    /// warn and counted in `host_repairs_total{kind="anycast_sync_guard"}`).
    /// Written whole and atomically by `nft -f`. A failure is logged at
    /// error, counted (`conntrack_sync_config_failures_total`) and retried
    /// at the next step. Also says once when TCP window tracking is strict
    /// (`nf_conntrack_tcp_be_liberal` 0): a flow that comes back to this
    /// host after the other carried it would find its entry's windows
    /// behind and be dropped.
    async fn anycast_guard(&self, inner: &mut Inner, config: &Config) {
        let want = conntrackd::anycast_table(config);
        let same = want == inner.anycast_written;
        let mut guard = std::mem::take(&mut inner.anycast_guard);
        let done = match want.clone() {
            None if same => Ok((guard, Ok(None))),
            None => {
                guard.forget();
                let script = format!(
                    "add table inet {t}\ndelete table inet {t}\n",
                    t = conntrackd::ANYCAST_TABLE
                );
                tokio::task::spawn_blocking(move || {
                    let removed = crate::host::nft::run(&["-f", "-"], script.as_bytes())
                        .map(|_| None)
                        .map_err(|e| e.to_string());
                    (guard, removed)
                })
                .await
            }
            Some(script) => {
                let table = AnycastGuard { script };
                let repairs = self.metrics.host_repairs();
                tokio::task::spawn_blocking(move || {
                    let result = if same {
                        guard.check(&table, &repairs).map(Some)
                    } else {
                        guard.write(&table).map(|()| None)
                    };
                    (guard, result.map_err(|e| e.to_string()))
                })
                .await
            }
        };
        match done {
            Ok((guard, result)) => {
                inner.anycast_guard = guard;
                match result {
                    Ok(None) if !same => {
                        tracing::info!(
                            table = conntrackd::ANYCAST_TABLE,
                            removed = want.is_none(),
                            "the anycast sync's guard table written"
                        );
                        inner.anycast_written = want;
                    }
                    Ok(Some(Checked::Repaired(drift))) => {
                        tracing::warn!(
                            found = "by the periodic check",
                            "the anycast sync's guard table inet {} was changed by another process ({drift}); written again",
                            conntrackd::ANYCAST_TABLE
                        );
                    }
                    Ok(_) => {}
                    Err(e) => {
                        inner.anycast_written = None;
                        inner.failures += 1;
                        tracing::error!("{e}; retried in {} s", CHECK_INTERVAL.as_secs());
                    }
                }
            }
            Err(e) => {
                inner.anycast_written = None;
                inner.failures += 1;
                tracing::error!("writing the anycast sync's guard table stopped: {e}");
            }
        }
        if inner.anycast_written.is_some() && !inner.liberal_warned {
            let liberal = tokio::task::spawn_blocking(|| {
                std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
            })
            .await;
            match liberal {
                Ok(Ok(v)) if v.trim() == "1" => {}
                Ok(Ok(v)) => {
                    inner.liberal_warned = true;
                    tracing::warn!(
                        value = v.trim(),
                        "net.netfilter.nf_conntrack_tcp_be_liberal is not 1: with the anycast sync, a TCP flow that comes back to this host after the other carried it is dropped (its entry's windows fell behind); set it to 1 on both hosts (docs/many-hosts.md)"
                    );
                }
                Ok(Err(e)) => tracing::debug!("nf_conntrack_tcp_be_liberal unreadable: {e}"),
                Err(e) => tracing::debug!("reading nf_conntrack_tcp_be_liberal stopped: {e}"),
            }
        }
    }
}

/// Every instance's record in `dir` (files named by the VRID).
fn read_recorded(dir: &Path) -> BTreeMap<u32, Recorded> {
    let mut out = BTreeMap::new();
    let Ok(entries) = std::fs::read_dir(dir) else {
        return out;
    };
    for e in entries.flatten() {
        let Some(vrid) = e.file_name().to_str().and_then(|n| n.parse::<u32>().ok()) else {
            continue;
        };
        if let Some(r) = std::fs::read_to_string(e.path())
            .ok()
            .as_deref()
            .and_then(parse_recorded)
        {
            out.insert(vrid, r);
        }
    }
    out
}

/// `conntrackd -C FILE -s`, bounded by [`STATS_TIMEOUT`].
/// Whether conntrackd's control socket exists but refuses this process
/// (`EACCES`): the shipped unit's dynamic user and root's conntrackd.
/// Absent or refusing connections is conntrackd down, not this.
fn control_socket_refused(socket: &Path) -> bool {
    matches!(
        std::os::unix::net::UnixStream::connect(socket),
        Err(e) if e.kind() == std::io::ErrorKind::PermissionDenied
    )
}

/// Why conntrackd's statistics could not be read ([`conntrackd_stats`]).
#[derive(Debug, thiserror::Error)]
enum ConntrackdStatsError {
    /// `conntrackd -s` gave no answer.
    #[error("{0} (is conntrackd running with that file?)")]
    Ask(#[source] ConntrackdAskError),
    /// It answered, but not with statistics: the last line it wrote.
    #[error("conntrackd -C {} -s: {said} (is conntrackd running with that file?)", conf.display())]
    NoStatistics { conf: PathBuf, said: String },
    /// The blocking task that asked it panicked or was cancelled.
    #[error(transparent)]
    Stopped(tokio::task::JoinError),
}

fn conntrackd_stats(conf: &Path) -> Result<Stats, ConntrackdStatsError> {
    let (stdout, stderr) = conntrackd_ask(conf, &["-s"]).map_err(ConntrackdStatsError::Ask)?;
    parse_stats(&stdout).ok_or_else(|| ConntrackdStatsError::NoStatistics {
        conf: conf.to_path_buf(),
        said: stderr
            .trim()
            .lines()
            .last()
            .unwrap_or("no statistics")
            .to_string(),
    })
}

/// Whether conntrackd runs with a file older than the one at `conf`;
/// `None` when it cannot be told. conntrackd creates its `lock` file at
/// start (`O_CREAT | O_EXCL`) and deletes it at exit, so the file's time is
/// when the running conntrackd started, to the nanosecond: it runs with an
/// older file exactly when it started before `conf` was last written.
/// Without the lock file (unreadable), its uptime in whole minutes tells
/// ([`conntrackd::restart_pending`]). Comparing with the uptime alone
/// warned about a conntrackd started just after the file (issue 40).
fn conntrackd_restart_pending(conf: &Path, lock: &Path) -> Option<bool> {
    let written = std::fs::metadata(conf).ok()?.modified().ok()?;
    if let Ok(started) = std::fs::metadata(lock).and_then(|m| m.modified()) {
        return Some(started < written);
    }
    let unix = |t: std::time::SystemTime| {
        t.duration_since(std::time::UNIX_EPOCH)
            .ok()
            .map(|d| d.as_secs())
    };
    let written = unix(written)?;
    let now = unix(std::time::SystemTime::now())?;
    let (stdout, _) = conntrackd_ask(conf, &["-s", "runtime"]).ok()?;
    let uptime = conntrackd::parse_uptime_min(&stdout)?;
    Some(conntrackd::restart_pending(written, now, uptime))
}

/// After `conntrackd.restart_command`: once conntrackd answers (10 s at
/// most), `-B` sends this host's flows to the peer and `-n` asks for the
/// peer's. A restart empties both caches; its own start asks the peer
/// once (`StartupResync`), but when both hosts restart at once (the same
/// configuration change reaches both), that request can be answered before
/// the peer's own cache is filled again, and a long-lived flow that sends
/// no new event would then be missing from the copy a takeover commits.
fn resync_after_restart(conf: &Path) -> Result<(), RestartResyncError> {
    const POLL: Duration = Duration::from_millis(200);
    let mut polls = 50;
    while conntrackd_ask(conf, &["-s"]).is_err() {
        if polls == 0 {
            return Err(RestartResyncError::NoAnswer {
                conf: conf.to_path_buf(),
            });
        }
        polls -= 1;
        std::thread::sleep(POLL);
    }
    conntrackd_ask(conf, &["-B"])?;
    conntrackd_ask(conf, &["-n"])?;
    Ok(())
}

/// Why conntrackd did not resync after its restart ([`resync_after_restart`]).
#[derive(Debug, thiserror::Error)]
enum RestartResyncError {
    /// It did not answer `-s` within 10 s.
    #[error("conntrackd -C {} did not answer within 10 s of its restart", conf.display())]
    NoAnswer { conf: PathBuf },
    /// `-B` or `-n` failed.
    #[error(transparent)]
    Ask(#[from] ConntrackdAskError),
}

/// Why `conntrackd -C FILE ARGS` gave no answer ([`conntrackd_ask`]).
#[derive(Debug, thiserror::Error)]
enum ConntrackdAskError {
    /// It could not be started.
    #[error("cannot run conntrackd: {0}")]
    Start(#[source] std::io::Error),
    /// It did not end within [`STATS_TIMEOUT`] (it was killed).
    #[error("conntrackd -C {} {args} did not answer in {} s", conf.display(), STATS_TIMEOUT.as_secs())]
    Timeout { conf: PathBuf, args: String },
    /// Waiting for it failed.
    #[error("waiting for conntrackd {args}: {source}")]
    Wait {
        args: String,
        #[source]
        source: std::io::Error,
    },
    /// Its output could not be read.
    #[error("reading conntrackd {args}: {source}")]
    Read {
        args: String,
        #[source]
        source: std::io::Error,
    },
    /// It failed: its exit status and stderr (trimmed).
    #[error("conntrackd -C {} {args}: {status} {stderr}", conf.display())]
    Failed {
        conf: PathBuf,
        args: String,
        status: std::process::ExitStatus,
        stderr: String,
    },
}

/// `conntrackd -C FILE ARGS`, bounded by [`STATS_TIMEOUT`]: its stdout and
/// stderr; an error when it could not run, timed out or failed.
fn conntrackd_ask(conf: &Path, args: &[&str]) -> Result<(String, String), ConntrackdAskError> {
    let mut child = Command::new("conntrackd")
        .arg("-C")
        .arg(conf)
        .args(args)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(ConntrackdAskError::Start)?;
    // Polled, not timed: a blocking thread, and the clock stays tokio's.
    const POLL: Duration = Duration::from_millis(20);
    let mut polls = STATS_TIMEOUT.as_millis() / POLL.as_millis();
    loop {
        match child.try_wait() {
            Ok(Some(_)) => break,
            Ok(None) if polls > 0 => {
                polls -= 1;
                std::thread::sleep(POLL);
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(ConntrackdAskError::Timeout {
                    conf: conf.to_path_buf(),
                    args: args.join(" "),
                });
            }
            Err(source) => {
                return Err(ConntrackdAskError::Wait {
                    args: args.join(" "),
                    source,
                });
            }
        }
    }
    let out = child
        .wait_with_output()
        .map_err(|source| ConntrackdAskError::Read {
            args: args.join(" "),
            source,
        })?;
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    );
    if !out.status.success() {
        return Err(ConntrackdAskError::Failed {
            conf: conf.to_path_buf(),
            args: args.join(" "),
            status: out.status,
            stderr: stderr.trim().to_string(),
        });
    }
    Ok((stdout, stderr))
}

fn build_report(
    settings: &ConntrackdSettings,
    config: &Config,
    recorded: &BTreeMap<u32, Recorded>,
    states: &BTreeMap<u32, bool>,
    stats: Result<Stats, ConntrackdStatsError>,
    error: Option<String>,
) -> (SyncStatus, Stats) {
    let instances = conntrackd::vrids(config)
        .into_iter()
        .map(|vrid| {
            let r = recorded.get(&vrid);
            SyncInstanceStatus {
                instance: instance_name(vrid),
                state: r.map(|r| r.state.clone()),
                since_unix: r.map(|r| r.at_ms as f64 / 1000.0),
                last_commit: r
                    .and_then(|r| r.commit_ok)
                    .map(|ok| if ok { "ok" } else { "failed" }),
                last_commit_ms: r.and_then(|r| r.commit_ms),
                gate: match states.get(&vrid) {
                    Some(true) => "open",
                    Some(false) => "closed",
                    None => "absent",
                },
            }
        })
        .collect();
    let (up, err, s) = match stats {
        Ok(s) => (true, None, s),
        Err(e) => (false, Some(e.to_string()), Stats::default()),
    };
    let report = SyncStatus {
        conntrackd_up: up,
        conntrackd_readable: true,
        conntrackd_error: err,
        internal_entries: s.internal,
        external_entries: s.external,
        packets_received: s.packets_received,
        link: format!(
            "{} {} -> {}:{} ({})",
            settings.interface,
            settings.address,
            settings.transport.destination(),
            settings.port,
            settings.transport.name()
        ),
        synced_backends: conntrackd::filter_addresses(config).len(),
        restart_pending: false,
        instances,
        error,
    };
    (report, s)
}

fn sample_of(
    report: &SyncStatus,
    stats: &Stats,
    recorded: &BTreeMap<u32, Recorded>,
    (failures, transport): (u64, &'static str),
) -> SyncSample {
    SyncSample {
        up: report.conntrackd_up,
        up_known: report.conntrackd_readable,
        restart_pending: report.restart_pending,
        entries: [stats.internal, stats.external],
        packets: [stats.packets_sent, stats.packets_received],
        send_errors: stats.send_errors,
        lost: stats.lost,
        transport,
        instances: report
            .instances
            .iter()
            .map(|i| {
                let r = i
                    .instance
                    .strip_prefix("hlb_")
                    .and_then(|v| v.parse::<u32>().ok())
                    .and_then(|v| recorded.get(&v));
                SyncInstanceSample {
                    instance: i.instance.clone(),
                    state: i.state.clone(),
                    transition_at: i.since_unix,
                    commits: r.map_or([0, 0], |r| [r.commits_ok, r.commits_failed]),
                    last_commit: r.and_then(|r| {
                        Some((
                            r.commit_ms? as f64 / 1000.0,
                            r.commit_at_ms? as f64 / 1000.0,
                        ))
                    }),
                    gate_open: match i.gate {
                        "open" => Some(true),
                        "closed" => Some(false),
                        _ => None,
                    },
                }
            })
            .collect(),
        failures,
    }
}

//! The state file: what a restarted daemon must not relearn (issue 41),
//! kept on disk between two processes of the unit.
//!
//! It holds, per load balancer, the operator's states (`drain`, `maint`),
//! the health verdicts with their consecutive counters (per backend, and per
//! port where ports are judged alone) and the client-affinity entries. It is
//! JSON, versioned, and says when and for which config file it was written;
//! each load balancer carries a fingerprint of what makes its entries mean
//! something (backends, ports, health check, affinity timeout).
//!
//! This module owns the format, the path, the atomic write and the checks
//! on reading; it knows no daemon, socket or probe (the daemon collects and
//! applies, in `daemon::hand_over::state`). It never refuses a start: a file
//! it cannot trust is an [`Ignored`] reason, which the daemon logs once.
//!
//! Bounds, each chosen so that trusting the file is never worse than
//! starting without it:
//! - the whole file: written at most [`MAX_AGE`] ago (a day: operator states
//!   outlive a long maintenance stop, but not a forgotten host);
//! - a health verdict: its last probe at most [`VERDICT_MAX_AGE`] ago (five
//!   minutes). A restored verdict is only a head start: every stream probes
//!   at once when it starts, so a wrong one is corrected within its
//!   threshold, exactly as a backend that changed while the daemon ran;
//! - an affinity entry: seen within its load balancer's timeout, by the wall
//!   clock;
//! - DHCP leases are not in this file: each client keeps its own
//!   (`host::dhcp::state`, `dhcp-<mac>.json`) and asks for it again at start
//!   (INIT-REBOOT) while it has not expired.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::io::Write as _;
use std::net::IpAddr;
use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::time::{Duration, SystemTime};

use serde::{Deserialize, Serialize};

use crate::config::{CheckKind, Config, LoadBalancerSpec};

/// The format's version; a file of another version is ignored.
pub const VERSION: u32 = 1;

/// A file written longer ago than this is stale and ignored whole.
pub const MAX_AGE: Duration = Duration::from_secs(24 * 3600);

/// A health verdict whose last probe is older than this is not restored
/// (the load balancer's `initial_state` applies, as without a file).
pub const VERDICT_MAX_AGE: Duration = Duration::from_secs(300);

/// The file's name under systemd's `StateDirectory=`.
pub const FILE_NAME: &str = "state.json";

/// The whole file.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StateFile {
    /// [`VERSION`] when written by this daemon.
    pub version: u32,
    /// When it was written, Unix seconds (wall clock: the next process has
    /// no other clock in common with this one).
    pub written_unix: f64,
    /// `/proc/sys/kernel/random/boot_id` at the write, for an operator
    /// reading the file (a reboot does not by itself void the file).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub boot_id: Option<String>,
    /// The process that wrote it.
    #[serde(default)]
    pub pid: u32,
    /// The config file of the daemon that wrote it: a daemon of another
    /// config (a second instance, a test) ignores it.
    pub config: PathBuf,
    /// Per load balancer, by name.
    #[serde(default)]
    pub load_balancers: BTreeMap<String, LbState>,
}

/// One load balancer's entries.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LbState {
    /// [`fingerprint`] of its spec at the write: another one (a backend, a
    /// port or the check changed while the daemon was down) drops this load
    /// balancer's entries, and only them.
    pub fingerprint: String,
    /// Per backend, those with anything to keep.
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub backends: BTreeMap<IpAddr, BackendState>,
    /// `sessionAffinity` entries.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub affinity: Vec<AffinityEntry>,
}

/// One backend's operator state and verdicts.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct BackendState {
    /// `drain` or `maint`; absent: `ready`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub admin: Option<String>,
    /// Its verdicts: one for the backend (`port` absent) or one per port
    /// judged alone.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub health: Vec<Verdict>,
}

/// A health verdict and the run behind it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Verdict {
    /// The backend port judged alone; absent: the whole backend.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// `healthy` or `unhealthy`.
    pub status: String,
    /// Successes in a row, at most the success threshold (more says nothing
    /// more, and would rewrite the file at every probe).
    pub consecutive_successes: u32,
    /// Failures in a row, at most the failure threshold.
    pub consecutive_failures: u32,
    /// When its last probe was sent, Unix seconds; absent: never probed
    /// (a restored verdict not yet confirmed keeps its own time).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub probed_unix: Option<f64>,
}

/// One remembered client.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct AffinityEntry {
    /// The client's address.
    pub client: IpAddr,
    /// The backend it was given.
    pub backend: IpAddr,
    /// When it was last seen, Unix seconds.
    pub seen_unix: f64,
}

/// Why a state file was not used. The daemon logs it once, at warn, with
/// the file's path, and starts as if there were no file.
#[derive(Debug, thiserror::Error)]
pub enum Ignored {
    /// It could not be read (permissions, an I/O error).
    #[error("cannot read it: {0}")]
    Unreadable(std::io::Error),
    /// It is not the JSON of a state file (a truncated or hand-edited file).
    #[error("it is not a valid state file: {0}")]
    Corrupt(serde_json::Error),
    /// Another version of the format (a newer daemon wrote it, then a
    /// downgrade).
    #[error("it is of format version {found}; this daemon reads version {VERSION}")]
    UnknownVersion {
        /// The version it says.
        found: u64,
    },
    /// Written too long ago to trust.
    #[error(
        "it was written {}s ago, more than the bound of {}s: too old to trust",
        .age.as_secs(),
        MAX_AGE.as_secs()
    )]
    Stale {
        /// How long ago.
        age: Duration,
    },
    /// Written in the future: the clock moved back, and no age can be told.
    #[error("it was written {}s in the future (the clock moved back): its ages cannot be told", .ahead.as_secs())]
    Future {
        /// How far ahead.
        ahead: Duration,
    },
    /// Written by a daemon of another config file.
    #[error("it was written for the config file {}, not {}", .written_for.display(), .ours.display())]
    OtherConfig {
        /// The config it names.
        written_for: PathBuf,
        /// This daemon's.
        ours: PathBuf,
    },
}

impl Ignored {
    /// A short name for the reason: `/status` and the metric's label.
    pub fn kind(&self) -> &'static str {
        match self {
            Ignored::Unreadable(_) => "unreadable",
            Ignored::Corrupt(_) => "corrupt",
            Ignored::UnknownVersion { .. } => "unknown_version",
            Ignored::Stale { .. } => "stale",
            Ignored::Future { .. } => "future",
            Ignored::OtherConfig { .. } => "other_config",
        }
    }
}

/// Where the state file is: `daemon.state_file` when the config sets it,
/// else `$STATE_DIRECTORY/state.json` when systemd sets `STATE_DIRECTORY`
/// (`StateDirectory=` of the unit; the first directory when it lists
/// several), else none: a daemon started by hand or by a test keeps no
/// state unless asked to.
pub fn location(
    configured: Option<&Path>,
    state_directory: Option<&std::ffi::OsStr>,
) -> Option<PathBuf> {
    if let Some(p) = configured {
        return Some(p.to_path_buf());
    }
    let dirs = state_directory?.to_str()?;
    let first = dirs.split(':').next().filter(|d| d.starts_with('/'))?;
    Some(Path::new(first).join(FILE_NAME))
}

/// Seconds since the Unix epoch of `t`.
pub fn unix(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// How long before `now` the Unix time `then` was; zero for a time ahead.
pub fn age(then: f64, now: SystemTime) -> Duration {
    Duration::try_from_secs_f64((unix(now) - then).max(0.0)).unwrap_or(Duration::MAX)
}

/// This boot's id, if the kernel tells it.
pub fn boot_id() -> Option<String> {
    std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
        .ok()
        .map(|s| s.trim().to_string())
}

/// Reads `path`: `Ok(None)` when there is none (a first start),
/// `Err(reason)` when there is one this daemon, of config file `config`,
/// must not trust, at `now`.
pub fn load(path: &Path, config: &Path, now: SystemTime) -> Result<Option<StateFile>, Ignored> {
    let text = match std::fs::read(path) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(None),
        Err(e) => return Err(Ignored::Unreadable(e)),
    };
    parse(&text, config, now).map(Some)
}

/// The checks of [`load`] on a file's bytes.
pub fn parse(text: &[u8], config: &Path, now: SystemTime) -> Result<StateFile, Ignored> {
    /// The version alone first: a newer format may not parse as this one,
    /// and "another version" tells the operator more than a parse error.
    #[derive(Deserialize)]
    struct Version {
        version: u64,
    }
    let v: Version = serde_json::from_slice(text).map_err(Ignored::Corrupt)?;
    if v.version != u64::from(VERSION) {
        return Err(Ignored::UnknownVersion { found: v.version });
    }
    let file: StateFile = serde_json::from_slice(text).map_err(Ignored::Corrupt)?;
    let now_unix = unix(now);
    if file.written_unix > now_unix + 60.0 {
        return Err(Ignored::Future {
            ahead: Duration::try_from_secs_f64(file.written_unix - now_unix)
                .unwrap_or(Duration::MAX),
        });
    }
    let age = age(file.written_unix, now);
    if age > MAX_AGE {
        return Err(Ignored::Stale { age });
    }
    if file.config != config {
        return Err(Ignored::OtherConfig {
            written_for: file.config,
            ours: config.to_path_buf(),
        });
    }
    Ok(file)
}

impl StateFile {
    /// Drops the load balancers whose fingerprint differs from their spec
    /// in `config` (those it no longer has go too, silently: nothing would
    /// use them). Returns the names dropped for a changed fingerprint.
    pub fn keep_matching(&mut self, config: &Config) -> Vec<String> {
        let specs: BTreeMap<&str, &LoadBalancerSpec> = config
            .load_balancers
            .iter()
            .map(|s| (s.name.as_str(), &**s))
            .collect();
        let mut changed = Vec::new();
        self.load_balancers
            .retain(|name, lb| match specs.get(name.as_str()) {
                None => false,
                Some(spec) if fingerprint(spec) == lb.fingerprint => true,
                Some(_) => {
                    changed.push(name.clone());
                    false
                }
            });
        changed
    }
}

/// What makes a load balancer's entries meaningful, as a short stable
/// digest (FNV-1a, 64 bits, hex) of a canonical text: its backends, its
/// listeners' protocol, port and backend port, its health check's kind,
/// port, thresholds, period and timeout, and its affinity timeout. Built
/// field by field, never from `Debug`, so that an upgrade that keeps the
/// config keeps the fingerprint.
pub fn fingerprint(spec: &LoadBalancerSpec) -> String {
    let mut text = String::new();
    let mut backends = spec.backends.clone();
    backends.sort();
    for b in &backends {
        let _ = writeln!(text, "b {b}");
    }
    let mut listeners: Vec<(String, u16, u16)> = spec
        .listeners
        .iter()
        .map(|l| (l.protocol.as_str().to_string(), l.port, l.backend_port))
        .collect();
    listeners.sort();
    for (protocol, port, backend_port) in &listeners {
        let _ = writeln!(text, "l {protocol} {port} {backend_port}");
    }
    if let Some(hc) = &spec.health_check {
        let kind = match &hc.check {
            CheckKind::TcpConnect => "tcp".to_string(),
            CheckKind::Http(h) => format!(
                "http {} {} {:?} {}",
                h.path,
                h.host.as_deref().unwrap_or("-"),
                h.expect_status,
                h.send_proxy
            ),
        };
        let _ = writeln!(
            text,
            "h {kind} {} {} {} {} {}",
            hc.port.map_or_else(|| "-".to_string(), |p| p.to_string()),
            hc.success_threshold,
            hc.failure_threshold,
            hc.period.as_millis(),
            hc.timeout.as_millis()
        );
    }
    if let Some(t) = spec.affinity_timeout {
        let _ = writeln!(text, "a {}", t.as_secs());
    }
    format!("{:016x}", fnv1a(text.as_bytes()))
}

fn fnv1a(bytes: &[u8]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in bytes {
        h ^= u64::from(*b);
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

/// Why the state file could not be written; logged and counted, never
/// fatal (the daemon serves on; the next restart relearns).
#[derive(Debug, thiserror::Error)]
#[error("cannot write the state file {}: {what}: {source}", .path.display())]
pub struct WriteError {
    /// The file.
    pub path: PathBuf,
    /// The step that failed.
    pub what: &'static str,
    /// What the OS said.
    pub source: std::io::Error,
}

/// The temporary file a write goes through: beside `path` (the same file
/// system, so the rename is atomic), hidden, named after it.
pub fn tmp_path(path: &Path) -> PathBuf {
    let name = path
        .file_name()
        .map_or_else(|| "state.json".into(), |n| n.to_string_lossy().into_owned());
    path.with_file_name(format!(".{name}.tmp"))
}

/// Writes `file` to `path` so that a crash at any point leaves either the
/// old file or the new one, whole: the bytes go to [`tmp_path`] (mode
/// 0600), which is synced, renamed over `path`, and the directory synced so
/// the rename itself survives a power cut. A missing directory is created
/// (mode 0700).
pub fn save(path: &Path, file: &StateFile) -> Result<(), WriteError> {
    // Compact: 3,000 load balancers of 3 checked backends are 2.6 MB
    // pretty-printed (measured); `jq .` shows it to an operator.
    let bytes = serde_json::to_vec(file).map_err(|e| WriteError {
        path: path.to_path_buf(),
        what: "serialise",
        source: std::io::Error::other(e),
    })?;
    write_tmp(path, &bytes)?;
    commit(path)
}

/// The first half of [`save`]: the bytes into the synced temporary file.
/// `path` itself is untouched.
pub fn write_tmp(path: &Path, bytes: &[u8]) -> Result<(), WriteError> {
    let err = |what: &'static str| {
        let path = path.to_path_buf();
        move |source| WriteError { path, what, source }
    };
    if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(err("create its directory"))?;
    }
    let tmp = tmp_path(path);
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(&tmp)
        .map_err(err("open the temporary file"))?;
    f.write_all(bytes)
        .map_err(err("write the temporary file"))?;
    f.sync_all().map_err(err("sync the temporary file"))
}

/// The second half of [`save`]: the temporary file renamed over `path`,
/// and the directory synced.
pub fn commit(path: &Path) -> Result<(), WriteError> {
    let err = |what: &'static str| {
        let path = path.to_path_buf();
        move |source| WriteError { path, what, source }
    };
    std::fs::rename(tmp_path(path), path).map_err(err("rename the temporary file over it"))?;
    let dir = match path.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(d) => d,
        None => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .map_err(err("sync its directory"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::config;

    fn dir(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("hlb-state-file-{}-{name}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        d
    }

    /// A file written at `written`, to the whole second: serde_json
    /// parses some fractions one unit in the last place off, which a
    /// comparison of the whole file would take for a change.
    fn sample(config: &Path, written: SystemTime) -> StateFile {
        let written = SystemTime::UNIX_EPOCH + Duration::from_secs(unix(written) as u64);
        let mut backends = BTreeMap::new();
        backends.insert(
            "10.0.0.1".parse().unwrap(),
            BackendState {
                admin: Some("drain".into()),
                health: vec![Verdict {
                    port: None,
                    status: "unhealthy".into(),
                    consecutive_successes: 0,
                    consecutive_failures: 3,
                    probed_unix: Some(unix(written)),
                }],
            },
        );
        let mut lbs = BTreeMap::new();
        lbs.insert(
            "a/web".to_string(),
            LbState {
                fingerprint: "0123".into(),
                backends,
                affinity: vec![AffinityEntry {
                    client: "192.0.2.7".parse().unwrap(),
                    backend: "10.0.0.1".parse().unwrap(),
                    seen_unix: unix(written) - 5.0,
                }],
            },
        );
        StateFile {
            version: VERSION,
            written_unix: unix(written),
            boot_id: boot_id(),
            pid: std::process::id(),
            config: config.to_path_buf(),
            load_balancers: lbs,
        }
    }

    #[test]
    fn a_file_round_trips_and_a_missing_one_is_a_first_start() {
        let d = dir("roundtrip");
        let path = d.join("state.json");
        let now = SystemTime::now();
        let cfg = Path::new("/etc/harvester-lb/config.toml");
        assert!(matches!(load(&path, cfg, now), Ok(None)));
        let s = sample(cfg, now);
        save(&path, &s).expect("save");
        assert_eq!(load(&path, cfg, now).expect("trusted"), Some(s));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert!(!tmp_path(&path).exists(), "the temporary file was renamed");
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn every_untrusted_file_is_a_reason_never_a_panic() {
        let now = SystemTime::now();
        let cfg = Path::new("/c.toml");
        let text = |s: &StateFile| serde_json::to_vec(s).unwrap();
        let ok = sample(cfg, now);
        assert!(parse(&text(&ok), cfg, now).is_ok());
        let kind = |bytes: &[u8]| parse(bytes, cfg, now).unwrap_err().kind();
        assert_eq!(kind(b"{\"version\": 1, \"writ"), "corrupt");
        assert_eq!(kind(b""), "corrupt");
        assert_eq!(kind(b"\xff\xfe"), "corrupt");
        assert_eq!(kind(b"{\"version\": 1}"), "corrupt");
        assert_eq!(
            kind(b"{\"version\": 2, \"anything\": []}"),
            "unknown_version"
        );
        let stale = sample(cfg, now - MAX_AGE - Duration::from_secs(60));
        assert_eq!(kind(&text(&stale)), "stale");
        let future = sample(cfg, now + Duration::from_secs(3600));
        assert_eq!(kind(&text(&future)), "future");
        let other = sample(Path::new("/other.toml"), now);
        let e = parse(&text(&other), cfg, now).unwrap_err();
        assert_eq!(e.kind(), "other_config");
        assert!(e.to_string().contains("/other.toml"), "{e}");
    }

    #[test]
    fn a_crash_before_the_rename_leaves_the_old_file_whole() {
        let d = dir("crash");
        let path = d.join("state.json");
        let now = SystemTime::now();
        let cfg = Path::new("/c.toml");
        let old = sample(cfg, now);
        save(&path, &old).expect("save");
        // The next write dies after half its bytes reached the temporary
        // file: the file itself is the old one, whole.
        let mut new = sample(cfg, now);
        new.load_balancers.clear();
        let bytes = serde_json::to_vec_pretty(&new).unwrap();
        write_tmp(&path, &bytes[..bytes.len() / 2]).expect("half a write");
        assert_eq!(load(&path, cfg, now).expect("trusted"), Some(old));
        // The next full write replaces the leftover.
        save(&path, &new).expect("save");
        assert_eq!(load(&path, cfg, now).expect("trusted"), Some(new));
        assert!(!tmp_path(&path).exists());
        let _ = std::fs::remove_dir_all(&d);
    }

    #[test]
    fn the_location_is_the_config_key_else_systemds_state_directory_else_none() {
        use std::ffi::OsStr;
        let key = Path::new("/var/lib/x/s.json");
        assert_eq!(
            location(Some(key), Some(OsStr::new("/var/lib/harvester-lb"))).as_deref(),
            Some(key)
        );
        assert_eq!(
            location(
                None,
                Some(OsStr::new("/var/lib/harvester-lb:/var/lib/other"))
            ),
            Some(PathBuf::from("/var/lib/harvester-lb/state.json"))
        );
        assert_eq!(location(None, None), None);
        assert_eq!(location(None, Some(OsStr::new("relative"))), None);
    }

    #[test]
    fn the_fingerprint_follows_backends_ports_and_the_check_and_nothing_else() {
        let base = "[[load_balancer]]\nname = \"a/web\"\nvip = \"127.231.9.1\"\nbackends = [\"127.231.9.11\", \"127.231.9.12\"]\n{keys}\n  [load_balancer.health_check]\n  port = 10256\n  {hc}\n  [[load_balancer.listener]]\n  name = \"l\"\n  port = 80\n  backend_port = {bp}\n";
        let fp = |keys: &str, hc: &str, bp: u16, backends: &str| {
            let text = base
                .replace("{keys}", keys)
                .replace("{hc}", hc)
                .replace("{bp}", &bp.to_string())
                .replace("[\"127.231.9.11\", \"127.231.9.12\"]", backends);
            fingerprint(&config(&text).load_balancers[0])
        };
        let same = "[\"127.231.9.11\", \"127.231.9.12\"]";
        let a = fp("", "", 30080, same);
        assert_eq!(
            a,
            fp("", "", 30080, "[\"127.231.9.12\", \"127.231.9.11\"]"),
            "order of backends"
        );
        assert_eq!(
            a,
            fp("connect_timeout_ms = 500", "", 30080, same),
            "not a check setting"
        );
        assert_ne!(a, fp("", "", 30081, same), "backend port");
        assert_ne!(a, fp("", "", 30080, "[\"127.231.9.11\"]"), "backends");
        assert_ne!(a, fp("", "period_seconds = 7", 30080, same), "check period");
    }
}

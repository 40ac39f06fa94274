//! A real keepalived in a namespace of the bed, for the failover tests
//! (`tests/it/faults/t_failover.rs` with hand-written files,
//! `tests/it/vmnet.rs` with the files the daemon renders).

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use super::{Bed, DaemonProc, Ns};

/// Whether keepalived can run here; CI must have it (`.ci/run` installs
/// it): skips (or fails under `CI=true`) when it cannot.
pub fn keepalived_missing() -> bool {
    crate::support::cannot_run(
        "keepalived failover",
        [crate::support::missing_tool("keepalived", "keepalived")],
    )
}

/// keepalived in one namespace, stopped (SIGTERM, then SIGKILL) on drop.
pub struct Keepalived {
    child: Child,
    vrrp_pid: PathBuf,
    log: PathBuf,
}

impl Keepalived {
    /// Runs keepalived (VRRP only, in the foreground) in `ns` with the
    /// file `conf`; its pid files and log are `<dir>/keepalived-<name>*`,
    /// unless `pid_file` names the main one.
    pub fn run(ns: &Ns, dir: &Path, name: &str, conf: &Path, pid_file: Option<&Path>) -> Self {
        let log = dir.join(format!("keepalived-{name}.log"));
        let vrrp_pid = dir.join(format!("keepalived-{name}-vrrp.pid"));
        let pid_file = pid_file.map_or_else(
            || dir.join(format!("keepalived-{name}.pid")),
            Path::to_path_buf,
        );
        let logf = std::fs::File::create(&log).expect("keepalived log");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns.name, "keepalived"])
            .args([
                "--dont-fork",
                "--log-console",
                "--log-detail",
                "--no-syslog",
                "--vrrp",
            ])
            .arg("--use-file")
            .arg(conf)
            .arg("--pid")
            .arg(&pid_file)
            .arg("--vrrp_pid")
            .arg(&vrrp_pid)
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup log"))
            .stderr(logf)
            .spawn()
            .expect("spawn keepalived (Debian package keepalived)");
        Keepalived {
            child,
            vrrp_pid,
            log,
        }
    }

    /// [`Keepalived::run`] with its pid file `dir/keepalived-<name>.pid`,
    /// removed first: a stale one naming a reused PID stops keepalived
    /// from starting (a host restarted in a test).
    pub fn run_fresh(ns: &Ns, dir: &Path, name: &str, conf: &Path) -> Self {
        let pid = dir.join(format!("keepalived-{name}.pid"));
        let _ = std::fs::remove_file(&pid);
        Self::run(ns, dir, name, conf, Some(&pid))
    }

    /// Sends `sig` to keepalived's main process.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
    }

    /// Kills keepalived as a dead host's would die: SIGKILL to its VRRP
    /// child (which outlives its parent's SIGKILL unless told), then to
    /// the main process. The child first: one that sees its parent die
    /// first may send a priority-0 advert, a graceful stop's (seen: the
    /// VIP moved in 0.13 s instead of 3 adverts' 1.4 s).
    pub fn kill_hard(&self) {
        if let Some(pid) = std::fs::read_to_string(&self.vrrp_pid)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2); a stale pid file names a process that is gone.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
        self.signal(libc::SIGKILL);
    }

    /// Its log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The last `n` lines of its log, newest first.
    pub fn log_tail(&self, n: usize) -> String {
        let log = self.log();
        log.lines().rev().take(n).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Keepalived {
    fn drop(&mut self) {
        self.signal(libc::SIGTERM);
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                break;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
        // The VRRP child, should it outlive its parent.
        if let Some(pid) = std::fs::read_to_string(&self.vrrp_pid)
            .ok()
            .and_then(|p| p.trim().parse::<i32>().ok())
        {
            // SAFETY: kill(2); a stale pid file names a process that is gone.
            unsafe {
                libc::kill(pid, libc::SIGKILL);
            }
        }
    }
}

/// Whether conntrackd and conntrack can run here; CI must have them
/// (`.ci/run` installs them): skips (or fails under `CI=true`) when not.
pub fn conntrackd_missing() -> bool {
    crate::support::cannot_run(
        "conntrackd sync",
        ["conntrackd", "conntrack"].map(|tool| crate::support::missing_tool(tool, tool)),
    )
}

/// conntrackd in one namespace, in the foreground with the file `conf`,
/// stopped (SIGTERM, then SIGKILL) on drop.
pub struct Conntrackd {
    child: Child,
    conf: PathBuf,
    ns: String,
}

impl Conntrackd {
    /// Runs `conntrackd -C conf` in `ns`, its output to `log`.
    pub fn run(ns: &Ns, conf: &Path, log: &Path) -> Self {
        let logf = std::fs::File::create(log).expect("conntrackd log");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns.name, "conntrackd", "-C"])
            .arg(conf)
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup log"))
            .stderr(logf)
            .spawn()
            .expect("spawn conntrackd (Debian package conntrackd)");
        Conntrackd {
            child,
            conf: conf.to_path_buf(),
            ns: ns.name.clone(),
        }
    }

    /// [`Conntrackd::run`], then waits (bounded) until it answers a
    /// control call.
    pub async fn answering(ns: &Ns, conf: &Path, log: &Path) -> Self {
        let c = Self::run(ns, conf, log);
        crate::support::wait_for(Duration::from_secs(20), "conntrackd answers", || async {
            c.control(&["-s"]).map(|_| ())
        })
        .await;
        c
    }

    /// Entries in its external cache (the flows synced from its peers);
    /// 0 while it does not answer.
    pub fn external_entries(&self) -> u64 {
        self.control(&["-s"])
            .and_then(|s| harvester_lb::host::conntrack_sync::conntrackd::parse_stats(&s))
            .map_or(0, |s| s.external)
    }

    /// How many entries of each cache (`-e` external, `-i` internal) have
    /// each of `vips` as their original destination (a VIP's flows), in
    /// `vips`' order; 0 each while conntrackd does not answer.
    pub fn entries_to(&self, cache: &str, vips: &[std::net::IpAddr]) -> Vec<usize> {
        let dump = self.control(&[cache]).unwrap_or_default();
        vips.iter()
            .map(|v| {
                let dst = format!("dst={v} ");
                dump.lines().filter(|l| l.contains(&dst)).count()
            })
            .collect()
    }

    /// `conntrackd -C conf <args>` (a control call), its stdout; `None`
    /// when it failed (conntrackd not answering).
    pub fn control(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.ns, "conntrackd", "-C"])
            .arg(&self.conf)
            .args(args)
            .output()
            .ok()?;
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }
}

/// Each host's conntrackd external cache entries of each of `vips`
/// ([`Conntrackd::entries_to`]), in the hosts' order; 0 for a host
/// without one.
pub fn external_per_vip<'a>(
    hosts: impl Iterator<Item = Option<&'a Conntrackd>>,
    vips: &[std::net::IpAddr],
) -> Vec<Vec<usize>> {
    hosts
        .map(|c| c.map_or_else(|| vec![0; vips.len()], |c| c.entries_to("-e", vips)))
        .collect()
}

/// Whether `ns`'s gate of VRRP instance `vrid` (the daemon's table
/// `inet harvester_lb_gate`, chain `g_<vrid>`) is open: the chain exists
/// and holds no drop rule (the notify script opens it after the commit).
pub fn gate_open(ns: &Ns, vrid: impl std::fmt::Display) -> bool {
    ns.nft_out(&[
        "list",
        "chain",
        "inet",
        "harvester_lb_gate",
        &format!("g_{vrid}"),
    ])
    .is_some_and(|chain| !chain.contains("drop"))
}

impl Drop for Conntrackd {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's pid, not yet reaped.
        unsafe {
            libc::kill(self.child.id() as i32, libc::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(5);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// How a VIP's master fails in the beds of several hosts
/// (`tests/it/conntrack_hosts.rs`, `tests/it/mgmt_vips.rs`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The host's daemon and keepalived are killed (SIGKILL): the VIP stays
    /// on its interface, but no advert comes from it any more.
    Killed,
    /// The daemon stops (SIGTERM): `/readyz` turns 503, the track script
    /// fails and keepalived gives the VIP up.
    GracefulStop,
    /// The host's links (every switch port of it in `ports`) are cut.
    LinkCut,
}

impl Fault {
    /// Makes a host (its `daemon` and `keepalived`, if running, its
    /// switch `ports` in `bed`) fail this way; bringing it back is the
    /// bed's own (what it restarts differs).
    pub fn strike(
        self,
        bed: &Bed,
        daemon: Option<&DaemonProc>,
        keepalived: Option<&Keepalived>,
        ports: &[String],
    ) {
        match self {
            Fault::Killed => {
                if let Some(d) = daemon {
                    d.signal(libc::SIGKILL);
                }
                if let Some(k) = keepalived {
                    k.kill_hard();
                }
            }
            Fault::GracefulStop => {
                if let Some(d) = daemon {
                    d.signal(libc::SIGTERM);
                }
            }
            Fault::LinkCut => {
                for p in ports {
                    bed.set_port(p, false);
                }
            }
        }
    }
}

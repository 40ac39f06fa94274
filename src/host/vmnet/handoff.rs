//! keepalived's and conntrackd's files under the shipped unit (the
//! `vrrp.conf` drop-in): the daemon runs as a dynamic user on a read-only
//! file system and cannot write `/etc/keepalived` or `/etc/conntrackd`,
//! nor signal root's keepalived. So it *hands them off*: it writes what it
//! rendered into its own runtime directory ([`ENV`], default [`DIR`]:
//! `/run/harvester-lb/vrrp`), and a root oneshot (`harvester-lb-vrrp.service`,
//! started by `harvester-lb-vrrp.path` when that directory changes) runs
//! [`install`].
//!
//! [`install`] never takes the daemon's text as what root installs: it
//! validates `/etc/harvester-lb/config.toml` (root's) itself, renders from
//! it, and installs its own rendering only when the daemon's copy is the
//! same text, i.e. once the daemon has applied that file (so keepalived
//! never asks `/readyz?vip=` of a VIP the daemon does not serve yet). A
//! daemon's user that was taken over can therefore make root install
//! nothing but what root's config says: a keepalived.conf is a program
//! keepalived runs as root (`notify` lines), and the notify script is one
//! outright. Without the drop-in (the daemon run as root by hand, the
//! tests), the daemon writes the files and tells keepalived itself, as
//! before.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use crate::config::{Config, ConntrackdSettings, KeepalivedSettings};
use crate::host::conntrack_sync::conntrackd;
use crate::host::vmnet::keepalived;

/// The environment variable (set by the `vrrp.conf` drop-in) naming the
/// directory the daemon hands its rendered files off to; unset: the
/// daemon writes them where they go and tells keepalived itself.
pub const ENV: &str = "HARVESTER_LB_VRRP_HANDOFF";
/// The directory the shipped drop-in and path unit name.
pub const DIR: &str = "/run/harvester-lb/vrrp";
/// keepalived.conf as the daemon rendered it.
pub const KEEPALIVED_FILE: &str = "keepalived.conf";
/// conntrackd.conf as the daemon rendered it.
pub const CONNTRACKD_FILE: &str = "conntrackd.conf";
/// The notify script as the daemon rendered it (data here, never run).
pub const SCRIPT_FILE: &str = "notify.sh";

/// The hand-off directory when [`ENV`] is set (to an absolute path).
pub fn dir() -> Option<PathBuf> {
    std::env::var_os(ENV)
        .map(PathBuf::from)
        .filter(|p| p.is_absolute())
}

/// The settings the daemon writes keepalived's file with when handing
/// off: the file in `dir`, nobody told (no pid file is read, no command
/// run; [`keepalived::install`] is given `handed_off`).
pub fn keepalived_settings(k: &KeepalivedSettings, dir: &Path) -> KeepalivedSettings {
    KeepalivedSettings {
        config_path: dir.join(KEEPALIVED_FILE),
        reload_command: None,
        ..k.clone()
    }
}

/// The settings the daemon writes conntrackd's file and the notify script
/// with when handing off: both in `dir`, no restart command.
pub fn conntrackd_settings(c: &ConntrackdSettings, dir: &Path) -> ConntrackdSettings {
    ConntrackdSettings {
        config_path: dir.join(CONNTRACKD_FILE),
        notify_script: dir.join(SCRIPT_FILE),
        restart_command: None,
        ..c.clone()
    }
}

/// The daemon's side: writes `text` to `dir/name` (a temporary file and a
/// rename, the directory made if missing) when it differs from what is
/// there. `Ok(true)`: written.
pub fn hand_off(dir: &Path, name: &str, text: &str) -> std::io::Result<bool> {
    let path = dir.join(name);
    if std::fs::read(&path).is_ok_and(|old| old == text.as_bytes()) {
        return Ok(false);
    }
    std::fs::create_dir_all(dir)?;
    keepalived::write_atomically(&path, text).map(|()| true)
}

/// What [`install`] did with one of the two.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Outcome {
    /// The config has no such section.
    NotConfigured,
    /// The daemon's copy is missing or differs from what root's config
    /// renders: the daemon has not applied this config yet (or refused
    /// it, or lost it): nothing installed; its next write starts this
    /// again.
    Waiting,
    /// The files were already so.
    Unchanged,
    /// Written, and keepalived told to reload / conntrackd restarted (if
    /// `restart_command` is set), as the text says.
    Installed(String),
}

/// Why [`install`] failed.
#[derive(Debug, thiserror::Error)]
pub enum HandoffError {
    /// keepalived's file or its reload.
    #[error(transparent)]
    Keepalived(#[from] keepalived::KeepalivedError),
    /// conntrackd's files or its restart.
    #[error(transparent)]
    Conntrackd(#[from] conntrackd::ConntrackdError),
    /// conntrackd restarted but did not take `-B`/`-n`.
    #[error("after conntrackd.restart_command: {0}")]
    Resync(#[source] ResyncError),
}

/// Why conntrackd did not resync after its restart (`resync`).
#[derive(Debug, thiserror::Error)]
pub enum ResyncError {
    /// It did not answer `-s` within 10 s.
    #[error("conntrackd -C {} did not answer within 10 s of its restart", conf.display())]
    NoAnswer {
        /// Its configuration file.
        conf: PathBuf,
    },
    /// `-B` or `-n` failed.
    #[error("conntrackd -C {} {option} failed", conf.display())]
    Refused {
        /// Its configuration file.
        conf: PathBuf,
        /// The option it did not take.
        option: &'static str,
    },
}

/// Run as root (`harvester-lb vrrp-install`): renders keepalived's and
/// conntrackd's files from `config` (root's, validated by the caller) and
/// installs each whose rendering equals the daemon's copy in `from`
/// (see the module's text). Blocking.
pub fn install(config: &Config, from: &Path) -> Result<(Outcome, Outcome), HandoffError> {
    let daemons = |name: &str| std::fs::read_to_string(from.join(name)).ok();
    let keepalived = match (&config.keepalived, keepalived::render(config)) {
        (Some(k), Some(text)) => {
            if daemons(KEEPALIVED_FILE).as_deref() == Some(text.as_str()) {
                match keepalived::install(k, &text, false) {
                    Ok(keepalived::Installed::Unchanged) => Outcome::Unchanged,
                    Ok(_) => Outcome::Installed(format!(
                        "{} written, keepalived told to reload",
                        k.config_path.display()
                    )),
                    // No pid file: keepalived does not run (its unit's
                    // condition wants a file, which is there now); it
                    // reads this one when it starts.
                    Err(keepalived::KeepalivedError::NoPid { why, .. }) => {
                        Outcome::Installed(format!(
                            "{} written; keepalived not told: its pid file {} {why} (it reads the file when it starts)",
                            k.config_path.display(),
                            k.pid_file.display()
                        ))
                    }
                    Err(e) => return Err(e.into()),
                }
            } else {
                Outcome::Waiting
            }
        }
        _ => Outcome::NotConfigured,
    };
    let conntrackd = match (&config.conntrackd, conntrackd::render_conf(config)) {
        (Some(c), Some(conf)) => {
            let script = conntrackd::render_script(config);
            let same_conf = daemons(CONNTRACKD_FILE).as_deref() == Some(conf.as_str());
            let same_script = script.is_none() || daemons(SCRIPT_FILE) == script;
            if same_conf && same_script {
                match conntrackd::install(c, &conf, script.as_deref(), false)? {
                    conntrackd::Installed::Unchanged => Outcome::Unchanged,
                    conntrackd::Installed::ScriptChanged => {
                        Outcome::Installed(format!("{} written", c.notify_script.display()))
                    }
                    conntrackd::Installed::ConfChanged => {
                        let mut said = format!("{} written", c.config_path.display());
                        if c.restart_command.is_some() {
                            resync(&c.config_path).map_err(HandoffError::Resync)?;
                            said.push_str(
                                ", conntrackd restarted, its flows sent to the peer (-B) and the peer's asked for (-n)",
                            );
                        } else {
                            said.push_str(
                                " (conntrackd reads it at its next start: set conntrackd.restart_command to restart it now)",
                            );
                        }
                        Outcome::Installed(said)
                    }
                }
            } else {
                Outcome::Waiting
            }
        }
        _ => Outcome::NotConfigured,
    };
    Ok((keepalived, conntrackd))
}

/// After a restart: waits (10 s at most) for conntrackd to answer, then
/// `-B` and `-n` (its caches start empty; see the daemon's own resync).
fn resync(conf: &Path) -> Result<(), ResyncError> {
    let ask = |args: &[&str]| {
        Command::new("conntrackd")
            .arg("-C")
            .arg(conf)
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    let mut polls = 50;
    while !ask(&["-s"]) {
        if polls == 0 {
            return Err(ResyncError::NoAnswer {
                conf: conf.to_path_buf(),
            });
        }
        polls -= 1;
        std::thread::sleep(std::time::Duration::from_millis(200));
    }
    for args in [["-B"], ["-n"]] {
        if !ask(&args) {
            return Err(ResyncError::Refused {
                conf: conf.to_path_buf(),
                option: args[0],
            });
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;
    use crate::config::test_fixtures::{KEEPALIVED, VLAN100, db};

    /// Root's config for host "a", its files under `dir`, keepalived told
    /// by `/bin/true`.
    fn config(dir: &Path) -> Config {
        let text = format!(
            "{KEEPALIVED}config_path = \"{d}/keepalived.conf\"\nreload_command = [\"/bin/true\"]\n\n[conntrackd]\nconfig_path = \"{d}/conntrackd.conf\"\nnotify_script = \"{d}/notify.sh\"\n\n{VLAN100}\n{}",
            db("algorithm = \"flow_hash\"\nbackends = [\"10.100.0.21\"]\n"),
            d = dir.display()
        );
        parse(&text).expect("valid").config
    }

    #[test]
    fn root_installs_its_own_rendering_once_the_daemon_s_copy_is_the_same() {
        let dir = std::env::temp_dir().join(format!("hlb-handoff-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (etc, from) = (dir.join("etc"), dir.join("from"));
        std::fs::create_dir_all(&etc).unwrap();
        let root = config(&etc);
        let ka = keepalived::render(&root).unwrap();
        let conf = conntrackd::render_conf(&root).unwrap();
        let script = conntrackd::render_script(&root).unwrap();

        // Nothing handed off yet: nothing installed.
        assert_eq!(
            install(&root, &from).unwrap(),
            (Outcome::Waiting, Outcome::Waiting)
        );
        assert!(!etc.join("keepalived.conf").exists());

        // The daemon's copy with one more line (a daemon's user taken over,
        // or an older config): root installs nothing of it.
        let evil = format!("{ka}vrrp_instance x {{\n  notify \"/bin/sh -c id\"\n}}\n");
        assert!(hand_off(&from, KEEPALIVED_FILE, &evil).unwrap());
        assert!(hand_off(&from, CONNTRACKD_FILE, &conf).unwrap());
        assert!(hand_off(&from, SCRIPT_FILE, &format!("{script}id\n")).unwrap());
        assert_eq!(
            install(&root, &from).unwrap(),
            (Outcome::Waiting, Outcome::Waiting)
        );
        assert!(!etc.join("keepalived.conf").exists() && !etc.join("notify.sh").exists());

        // The daemon applied root's config: root's own rendering installed.
        assert!(hand_off(&from, KEEPALIVED_FILE, &ka).unwrap());
        assert!(
            !hand_off(&from, KEEPALIVED_FILE, &ka).unwrap(),
            "unchanged: not rewritten"
        );
        assert!(hand_off(&from, SCRIPT_FILE, &script).unwrap());
        let (k, c) = install(&root, &from).unwrap();
        assert!(
            matches!(k, Outcome::Installed(ref s) if s.contains("told to reload")),
            "{k:?}"
        );
        assert!(matches!(c, Outcome::Installed(_)), "{c:?}");
        assert_eq!(
            std::fs::read_to_string(etc.join("keepalived.conf")).unwrap(),
            ka
        );
        assert_eq!(
            std::fs::read_to_string(etc.join("conntrackd.conf")).unwrap(),
            conf
        );
        assert_eq!(
            std::fs::read_to_string(etc.join("notify.sh")).unwrap(),
            script
        );
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(etc.join("notify.sh"))
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        assert_eq!(
            install(&root, &from).unwrap(),
            (Outcome::Unchanged, Outcome::Unchanged)
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

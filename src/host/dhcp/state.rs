//! The lease kept on disk, one small JSON file per client, so that a
//! restarted daemon asks for the address it had (INIT-REBOOT) and the VIP
//! survives a restart or an upgrade.
//!
//! A missing or unreadable file only costs a DISCOVER: it is logged and
//! never stops the client. Writes go to a temporary file renamed over the
//! old one, so a crash mid-write leaves the old lease or the new, not half.

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

/// What is kept of a lease.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Stored {
    /// The load balancer it belongs to (for an operator reading the file).
    pub load_balancer: String,
    /// Its cluster.
    pub cluster: String,
    /// The client's MAC, `aa:bb:..`.
    pub mac: String,
    /// The leased address.
    pub address: Ipv4Addr,
    /// The server that granted it.
    pub server: Ipv4Addr,
    /// When it expires, Unix seconds.
    pub expires_unix: f64,
}

/// The file of the client with MAC `mac` under `dir`: the MAC, not the
/// name, so that a name with any characters maps to a safe file name.
pub fn path(dir: &Path, mac: [u8; 6]) -> PathBuf {
    dir.join(format!("dhcp-{}.json", hex(mac)))
}

/// `mac` as twelve hex digits.
pub fn hex(mac: [u8; 6]) -> String {
    mac.iter().map(|b| format!("{b:02x}")).collect()
}

/// `mac` as `aa:bb:cc:dd:ee:ff`.
pub fn colons(mac: [u8; 6]) -> String {
    mac.iter()
        .map(|b| format!("{b:02x}"))
        .collect::<Vec<_>>()
        .join(":")
}

/// Reads the kept lease; `None` (logged unless simply absent) when there is
/// none to use.
pub fn load(file: &Path) -> Option<Stored> {
    let text = match std::fs::read(file) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return None,
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "cannot read the kept DHCP lease; asking for a new one");
            return None;
        }
    };
    match serde_json::from_slice(&text) {
        Ok(s) => Some(s),
        Err(e) => {
            tracing::warn!(file = %file.display(), error = %e, "the kept DHCP lease is unreadable; asking for a new one");
            None
        }
    }
}

/// How a client starts from its kept lease at Unix time `now`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Resume {
    /// The address to ask for again at once (INIT-REBOOT: a REQUEST, not a
    /// DISCOVER): the kept lease's, while it has not expired.
    pub reboot_with: Option<Ipv4Addr>,
    /// The address to ask for in a DISCOVER: an expired lease's (the
    /// server may still have it free), else `requested` (the config's).
    pub hint: Option<Ipv4Addr>,
}

/// Decides [`Resume`] from the kept lease: a lease still valid is asked
/// for again (RFC 2131 §3.2: a client that remembers its address), one
/// that has expired is not claimed (the address may be someone else's by
/// now) but asked for first in a DISCOVER.
pub fn resume(kept: Option<&Stored>, requested: Option<Ipv4Addr>, now: f64) -> Resume {
    match kept {
        Some(s) if s.expires_unix > now => Resume {
            reboot_with: Some(s.address),
            hint: requested,
        },
        Some(s) => Resume {
            reboot_with: None,
            hint: Some(s.address),
        },
        None => Resume {
            reboot_with: None,
            hint: requested,
        },
    }
}

/// Writes `stored` to `file` atomically, creating the directory.
pub fn save(file: &Path, stored: &Stored) -> std::io::Result<()> {
    if let Some(dir) = file.parent() {
        std::fs::create_dir_all(dir)?;
    }
    let tmp = file.with_extension("json.tmp");
    let text = serde_json::to_vec_pretty(stored).map_err(std::io::Error::other)?;
    std::fs::write(&tmp, text)?;
    std::fs::rename(&tmp, file)
}

/// Deletes the kept lease (the load balancer is gone for good).
pub fn remove(file: &Path) {
    if let Err(e) = std::fs::remove_file(file)
        && e.kind() != std::io::ErrorKind::NotFound
    {
        tracing::warn!(file = %file.display(), error = %e, "cannot remove the kept DHCP lease");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kept lease of 198.51.100.150 expiring at `expires_unix`.
    fn stored(expires_unix: f64) -> Stored {
        Stored {
            load_balancer: "default/web".into(),
            cluster: "kubernetes".into(),
            mac: colons([2, 0, 0, 0, 0, 1]),
            address: Ipv4Addr::new(198, 51, 100, 150),
            server: Ipv4Addr::new(198, 51, 100, 2),
            expires_unix,
        }
    }

    #[test]
    fn a_valid_lease_is_asked_for_again_and_an_expired_one_only_hinted() {
        let kept = stored(1000.0);
        let configured = Some(Ipv4Addr::new(198, 51, 100, 7));
        assert_eq!(
            resume(Some(&kept), configured, 999.0),
            Resume {
                reboot_with: Some(kept.address),
                hint: configured
            }
        );
        assert_eq!(
            resume(Some(&kept), configured, 1000.5),
            Resume {
                reboot_with: None,
                hint: Some(kept.address)
            },
            "expired: not claimed, but asked for first"
        );
        assert_eq!(
            resume(None, configured, 999.0),
            Resume {
                reboot_with: None,
                hint: configured
            }
        );
    }

    #[test]
    fn a_lease_round_trips_and_junk_is_ignored() {
        let dir = std::env::temp_dir().join(format!("hlb-state-{}", std::process::id()));
        let file = path(&dir, [2, 0, 0, 0, 0, 1]);
        assert!(file.ends_with("dhcp-020000000001.json"));
        let s = stored(1.5e9);
        save(&file, &s).expect("save");
        assert_eq!(load(&file), Some(s));
        std::fs::write(&file, b"{not json").expect("write");
        assert_eq!(load(&file), None);
        remove(&file);
        assert_eq!(load(&file), None);
        let _ = std::fs::remove_dir_all(&dir);
    }
}

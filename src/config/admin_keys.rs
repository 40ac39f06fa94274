//! What an admin command needs from the config file, and nothing more:
//! `admin.socket` (and `admin.listen`, where `status` may fall back to).
//!
//! The admin commands are needed most right after a bad hand edit, which
//! the running daemon rejected and ignores: so this reads the two keys
//! tolerantly. A file whose other keys are wrong, or that is not even valid
//! TOML, still yields its socket (read line by line from `[admin]` then);
//! only a file that cannot be read, or whose `admin.socket` itself is
//! wrong, is an error, and it says so. A file without the key means the
//! default socket, as it does for the daemon. Never a silent guess.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::Deserialize;
use toml::Spanned;

use super::validate::{DEFAULT_ADMIN_LISTEN, admin_socket_problem};
use super::{DEFAULT_ADMIN_SOCKET, MAX_FILE_BYTES, ReadError, read_regular_file};

/// Where the daemon's admin API is, as the config file says.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AdminEndpoints {
    /// `admin.socket` (the default when the file has none).
    pub socket: PathBuf,
    /// `admin.listen` (the default when the file has none); `None` when the
    /// key is there but is no address (then only the socket is asked).
    pub listen: Option<SocketAddr>,
    /// What the caller should say on stderr: the file is not valid TOML
    /// (the keys were read from its lines), or `admin.listen` is unusable.
    pub notes: Vec<String>,
}

/// Why the config file gave no admin socket. Each message names the file
/// and the way around it (`--socket PATH`).
#[derive(Debug, thiserror::Error)]
pub enum AdminKeyError {
    /// The file cannot be read (missing, no permission, not a regular file).
    #[error(
        "cannot read {path} ({source}) to find the daemon's admin socket: pass --socket PATH (the daemon's admin.socket, default {DEFAULT_ADMIN_SOCKET}) or --config FILE"
    )]
    Read {
        /// The file.
        path: String,
        /// Why.
        source: ReadError,
    },
    /// `admin.socket` itself is wrong: no daemon could have bound it.
    #[error(
        "{path}{}: admin.socket {problem}; fix it, or pass --socket PATH (the socket the daemon runs on)",
        .line.map(|l| format!(" line {l}")).unwrap_or_default()
    )]
    Socket {
        /// The file.
        path: String,
        /// The key's line, when known.
        line: Option<usize>,
        /// What is wrong, after the value.
        problem: String,
    },
}

/// Reads `admin.socket` and `admin.listen` from the file at `path`,
/// whatever else the file holds (see the module's doc).
pub fn admin_endpoints(path: &Path) -> Result<AdminEndpoints, AdminKeyError> {
    let shown = path.display().to_string();
    let bytes = read_regular_file(path, MAX_FILE_BYTES).map_err(|source| AdminKeyError::Read {
        path: shown.clone(),
        source,
    })?;
    let text = String::from_utf8_lossy(&bytes);
    let mut notes = Vec::new();
    let (socket, listen) = match toml::from_str::<OnlyAdmin>(&text) {
        Ok(file) => {
            let admin = file.admin.unwrap_or_default();
            let at = |span: std::ops::Range<usize>| line_of(&text, span.start);
            (
                admin.socket.map(|v| (at(v.span()), v.into_inner())),
                admin.listen.map(|v| (at(v.span()), v.into_inner())),
            )
        }
        Err(e) => {
            let (socket, listen) = scan_lines(&text);
            let found = match (&socket, &listen) {
                (None, None) => "no admin.socket or admin.listen found in its lines".to_string(),
                _ => "admin.socket and admin.listen read from its lines".to_string(),
            };
            let what = if toml::from_str::<toml::Table>(&text).is_ok() {
                "its [admin] is not a table of keys"
            } else {
                "it is not valid TOML"
            };
            notes.push(format!(
                "{shown} does not parse: {what} ({}); {found} (`harvester-lb check -c {shown}` names every problem)",
                first_line(&e.to_string())
            ));
            (socket, listen)
        }
    };
    let socket = match socket {
        None => PathBuf::from(DEFAULT_ADMIN_SOCKET),
        Some((line, value)) => {
            let problem = match value.as_str() {
                Some(p) => admin_socket_problem(p).map(|why| format!("{p:?} {why}")),
                None => Some(format!("is {value}, not a string path")),
            };
            if let Some(problem) = problem {
                return Err(AdminKeyError::Socket {
                    path: shown,
                    line: Some(line),
                    problem,
                });
            }
            PathBuf::from(value.as_str().unwrap_or_default())
        }
    };
    let listen = match listen {
        None => DEFAULT_ADMIN_LISTEN.parse().ok(),
        Some((line, value)) => {
            let parsed = value.as_str().and_then(|s| s.parse::<SocketAddr>().ok());
            if parsed.is_none() {
                notes.push(format!(
                    "{shown} line {line}: admin.listen is {value}, not IP:PORT: only the admin socket is asked"
                ));
            }
            parsed
        }
    };
    Ok(AdminEndpoints {
        socket,
        listen,
        notes,
    })
}

/// The file with every key but `[admin]`'s two ignored (no
/// `deny_unknown_fields`: the rest is the daemon's to judge).
#[derive(Deserialize)]
struct OnlyAdmin {
    admin: Option<AdminTable>,
}

#[derive(Deserialize, Default)]
struct AdminTable {
    socket: Option<Spanned<toml::Value>>,
    listen: Option<Spanned<toml::Value>>,
}

type Found = Option<(usize, toml::Value)>;

/// `admin.socket` and `admin.listen` from a file that is not valid TOML:
/// each line of the `[admin]` table (or a top-level `admin.KEY = …`)
/// parsed on its own. The last one wins, as it would have in a table.
fn scan_lines(text: &str) -> (Found, Found) {
    let (mut socket, mut listen) = (None, None);
    let mut table: Option<String> = None;
    for (i, line) in text.lines().enumerate() {
        let trimmed = line.trim();
        if trimmed.starts_with('[') {
            table = Some(
                trimmed
                    .trim_start_matches('[')
                    .split(']')
                    .next()
                    .unwrap_or("")
                    .trim()
                    .to_string(),
            );
            continue;
        }
        let Ok(parsed) = toml::from_str::<toml::Table>(trimmed) else {
            continue;
        };
        let keys = match table.as_deref() {
            Some("admin") => Some(&parsed),
            None => parsed.get("admin").and_then(toml::Value::as_table),
            Some(_) => None,
        };
        if let Some(keys) = keys {
            if let Some(v) = keys.get("socket") {
                socket = Some((i + 1, v.clone()));
            }
            if let Some(v) = keys.get("listen") {
                listen = Some((i + 1, v.clone()));
            }
        }
    }
    (socket, listen)
}

/// The 1-based line of byte `offset` in `text`.
fn line_of(text: &str, offset: usize) -> usize {
    text.get(..offset).map_or(0, |t| t.matches('\n').count()) + 1
}

/// The first line of a (multi-line) parser message.
fn first_line(message: &str) -> &str {
    message.lines().next().unwrap_or(message).trim()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn endpoints(text: &str) -> Result<AdminEndpoints, AdminKeyError> {
        let dir = std::env::temp_dir().join(format!("hlb-admin-keys-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path = dir.join(format!("{n}.toml"));
        std::fs::write(&path, text).unwrap();
        let got = admin_endpoints(&path);
        let _ = std::fs::remove_file(&path);
        // The last test out removes it; the others find it not empty.
        let _ = std::fs::remove_dir(&dir);
        got
    }

    #[test]
    fn the_socket_comes_from_a_file_whose_other_keys_are_wrong() {
        let got = endpoints(
            "[admin]\nsocket = \"/run/x/admin.sock\"\nlisten = \"127.0.0.1:9\"\n[proxy]\nnope = 1\n",
        )
        .unwrap();
        assert_eq!(got.socket, PathBuf::from("/run/x/admin.sock"));
        assert_eq!(got.listen, Some("127.0.0.1:9".parse().unwrap()));
        assert!(got.notes.is_empty(), "{:?}", got.notes);
    }

    #[test]
    fn a_file_that_is_not_toml_still_gives_its_socket_with_a_note() {
        let got =
            endpoints("[admin]\nsocket = \"/run/x/admin.sock\"\n\n[[load_balancer]\nname = oops\n")
                .unwrap();
        assert_eq!(got.socket, PathBuf::from("/run/x/admin.sock"));
        assert!(got.notes[0].contains("not valid TOML"), "{:?}", got.notes);
        let dotted = endpoints("admin.socket = \"/run/y.sock\"\nbroken =\n").unwrap();
        assert_eq!(dotted.socket, PathBuf::from("/run/y.sock"));
        // Valid TOML whose [admin] is no table: the default, said.
        let odd = endpoints("admin = 5\n").unwrap();
        assert_eq!(odd.socket, PathBuf::from(DEFAULT_ADMIN_SOCKET));
        assert!(odd.notes[0].contains("not a table"), "{:?}", odd.notes);
    }

    #[test]
    fn no_key_is_the_default_and_a_bad_key_is_an_error_naming_its_line() {
        let got = endpoints("[proxy]\n").unwrap();
        assert_eq!(got.socket, PathBuf::from(DEFAULT_ADMIN_SOCKET));
        let e = endpoints("# a comment\n[admin]\nsocket = \"relative.sock\"\n").unwrap_err();
        let said = e.to_string();
        assert!(
            said.contains("line 3") && said.contains("not an absolute path"),
            "{said}"
        );
        let e = endpoints("[admin]\nsocket = 5\n").unwrap_err().to_string();
        assert!(e.contains("not a string"), "{e}");
        let listen = endpoints("[admin]\nlisten = \"nope\"\n").unwrap();
        assert_eq!(listen.listen, None);
        assert!(
            listen.notes[0].contains("admin.listen"),
            "{:?}",
            listen.notes
        );
    }
}

//! The admin Unix socket's trust and binding: what guards who may change a
//! backend's or a VIP's state. Those requests are served on this socket
//! alone, so file permissions decide who may drain a node: the socket is
//! made mode 0600 (bound under a temporary name, then renamed into place),
//! in a directory made 0700; a path that another user could replace (a
//! directory on the way owned by them, or writable by others without the
//! sticky bit) is refused before anything is bound ([`check_socket_trust`]);
//! one daemon per socket, by a `flock` held for the process's life; a stale
//! socket left by a dead daemon is replaced, a live one never. The command
//! line applies the same trust check before it sends anything.

use std::io;
use std::os::unix::fs::{DirBuilderExt, FileTypeExt, MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use tokio::net::{UnixListener, UnixStream};

/// Why the admin socket could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// Another process answers on the socket: a second daemon must not take
    /// it over (its operators would drain the wrong daemon's backends).
    #[error(
        "admin.socket {0}: another process is serving it (is harvester-lb already running?); stop it or set another admin.socket"
    )]
    InUse(PathBuf),
    /// Something that is not a socket sits at the path; it is not removed.
    #[error(
        "admin.socket {0}: a file that is not a socket is in the way; remove it or set another admin.socket"
    )]
    NotASocket(PathBuf),
    /// A directory on the way to the socket, or the socket file itself,
    /// belongs to another user or lets others write into it: that user
    /// could replace the socket with one of their own, and the operator's
    /// `backend drain` would be answered by them.
    #[error(
        "admin.socket {socket}: {what} {path} is {why} (owner uid {owner}, mode {mode:04o}); another user could replace the socket and answer for the daemon. Use a directory owned by root (or the daemon's own user) that only its owner can write, such as /run/harvester-lb (systemd's RuntimeDirectory=)"
    )]
    Untrusted {
        /// The socket's path.
        socket: PathBuf,
        /// "its directory", "the directory above it" or "the socket file".
        what: &'static str,
        /// The directory or file at fault.
        path: PathBuf,
        /// What is wrong with it.
        why: &'static str,
        /// Its owner.
        owner: u32,
        /// Its permission bits (with the sticky bit).
        mode: u32,
    },
    /// Creating, binding or securing the socket failed.
    #[error("admin.socket {path}: cannot {what}: {source}")]
    Io {
        /// The path from `admin.socket`.
        path: PathBuf,
        /// What was being done.
        what: &'static str,
        /// What the OS said.
        source: io::Error,
    },
}

/// Who may own the admin socket's directories for the daemon: root and the
/// daemon's own user.
pub fn daemon_trusts(uid: u32) -> bool {
    uid == 0 || uid == crate::os::effective_uid()
}

/// Refuses an admin socket that another user could replace: each directory
/// from the socket's own up to `/` must be owned by a user `trusts` and be
/// writable by nobody else (group- or world-writable only with the sticky
/// bit, as `/tmp`, where no one may rename another's file); the socket file,
/// if it exists, must be owned by a user `trusts`. Directories that do not
/// exist yet are skipped (the daemon creates them, 0700, as its own).
/// Symbolic links are resolved first, so the directories checked are the
/// ones the socket is really in. A check, not a lock: it cannot stop root
/// from changing the modes afterwards, which root may do anyway.
pub fn check_socket_trust(socket: &Path, trusts: impl Fn(u32) -> bool) -> Result<(), SocketError> {
    let untrusted = |what, path: &Path, why, meta: &std::fs::Metadata| SocketError::Untrusted {
        socket: socket.to_path_buf(),
        what,
        path: path.to_path_buf(),
        why,
        owner: meta.uid(),
        mode: meta.mode() & 0o7777,
    };
    let io_err = |what: &'static str| {
        let path = socket.to_path_buf();
        move |source| SocketError::Io { path, what, source }
    };
    match std::fs::symlink_metadata(socket) {
        Ok(meta) if !trusts(meta.uid()) => {
            return Err(untrusted(
                "the socket file",
                socket,
                "owned by another user",
                &meta,
            ));
        }
        Ok(_) => {}
        Err(e) if e.kind() == io::ErrorKind::NotFound => {}
        Err(e) => return Err(io_err("inspect the socket file")(e)),
    }
    let parent = match socket.parent().filter(|p| !p.as_os_str().is_empty()) {
        Some(p) => p.to_path_buf(),
        None => PathBuf::from("."),
    };
    // The deepest directory that exists, with its links resolved.
    let mut dir = parent.as_path();
    let real = loop {
        match std::fs::canonicalize(dir) {
            Ok(real) => break real,
            Err(e) if e.kind() == io::ErrorKind::NotFound => match dir.parent() {
                Some(up) if !up.as_os_str().is_empty() => dir = up,
                _ => {
                    break std::env::current_dir().map_err(io_err("find the current directory"))?;
                }
            },
            Err(e) => return Err(io_err("inspect its directory")(e)),
        }
    };
    for (i, d) in real.ancestors().enumerate() {
        let meta = std::fs::metadata(d).map_err(io_err("inspect its directory"))?;
        let what = if i == 0 && dir == parent {
            "its directory"
        } else {
            "the directory above it"
        };
        if !trusts(meta.uid()) {
            return Err(untrusted(what, d, "owned by another user", &meta));
        }
        if meta.mode() & 0o022 != 0 && meta.mode() & 0o1000 == 0 {
            return Err(untrusted(
                what,
                d,
                "writable by group or others without the sticky bit",
                &meta,
            ));
        }
    }
    Ok(())
}

/// The admin Unix socket, bound, mode 0600. Its file is removed when it is
/// dropped, unless another process has replaced it meanwhile.
pub struct AdminSocket {
    listener: UnixListener,
    path: PathBuf,
    /// Device and inode of the socket file we made, to remove only ours.
    id: (u64, u64),
    /// `<socket>.lock`, locked (`flock`) while this process runs.
    _lock: std::fs::File,
    /// Set at a hand-over: the file stays for the next process, which
    /// adopts the socket from systemd's store ([`AdminSocket::adopt`]).
    keep_file: Arc<AtomicBool>,
}

impl AdminSocket {
    /// Binds the admin socket at `path`, mode 0600. A stale socket file (no
    /// process answers on it: a daemon that died) is replaced; a live one
    /// is left alone and is an error. A missing parent directory is created
    /// with mode 0700 (systemd's `RuntimeDirectory=` normally made it).
    ///
    /// The socket is bound under a temporary name, given mode 0600, then
    /// renamed into place: no moment exists at which it is at `path` with
    /// looser permissions.
    pub fn bind(path: &Path) -> Result<Self, SocketError> {
        let lock = Self::trust_and_lock(path)?;
        Self::bind_locked(path, lock)
    }

    /// The socket the last process left in systemd's store (`inherited`),
    /// when it is a listening Unix socket bound at `path` and the file
    /// there is a socket: adopted as it is, with no unlink and no rebind,
    /// so a client that connected while no process ran (keepalived's track
    /// script) is answered. Otherwise, or with nothing inherited, a new
    /// one as [`AdminSocket::bind`] makes it. The same trust check and
    /// lock either way. Says which in the second value (`Err`: why the
    /// inherited one was not taken).
    pub fn adopt(
        path: &Path,
        inherited: Option<std::os::fd::OwnedFd>,
    ) -> Result<(Self, Option<Result<(), UnadoptableSocket>>), SocketError> {
        let lock = Self::trust_and_lock(path)?;
        let Some(fd) = inherited else {
            return Ok((Self::bind_locked(path, lock)?, None));
        };
        match adoptable(path, fd) {
            Ok((std_listener, id)) => {
                let listener =
                    UnixListener::from_std(std_listener).map_err(|source| SocketError::Io {
                        path: path.to_path_buf(),
                        what: "register the socket",
                        source,
                    })?;
                Ok((
                    Self {
                        listener,
                        path: path.to_path_buf(),
                        id,
                        _lock: lock,
                        keep_file: Arc::default(),
                    },
                    Some(Ok(())),
                ))
            }
            Err(why) => Ok((Self::bind_locked(path, lock)?, Some(Err(why)))),
        }
    }

    /// The flag that keeps the socket's file when this is dropped (set at
    /// a hand-over).
    pub fn keep_file(&self) -> Arc<AtomicBool> {
        Arc::clone(&self.keep_file)
    }

    /// The listening socket's descriptor, for systemd's store.
    pub fn as_fd(&self) -> std::os::fd::BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.listener.as_fd()
    }

    /// The trust check and the lock of [`AdminSocket::bind`].
    fn trust_and_lock(path: &Path) -> Result<std::fs::File, SocketError> {
        let io_err = |what: &'static str| {
            let path = path.to_path_buf();
            move |source| SocketError::Io { path, what, source }
        };
        check_socket_trust(path, daemon_trusts)?;
        if let Some(parent) = path.parent().filter(|p| !p.as_os_str().is_empty())
            && !parent.exists()
        {
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(parent)
                .map_err(io_err("create its directory"))?;
        }
        // One daemon per socket, decided by the kernel rather than by who
        // answers: the lock is held until the process ends, however it
        // ends. The file stays (removing it would let two daemons lock two
        // different files of one name).
        let mut lock_path = path.as_os_str().to_owned();
        lock_path.push(".lock");
        let lock = std::fs::OpenOptions::new()
            .create(true)
            .truncate(false)
            .write(true)
            .mode(0o600)
            .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
            .open(&lock_path)
            .map_err(io_err("open its lock file (the socket's path with .lock)"))?;
        match lock.try_lock() {
            Ok(()) => {}
            Err(std::fs::TryLockError::WouldBlock) => {
                return Err(SocketError::InUse(path.to_path_buf()));
            }
            Err(std::fs::TryLockError::Error(e)) => {
                return Err(io_err("lock its lock file (the socket's path with .lock)")(
                    e,
                ));
            }
        }
        Ok(lock)
    }

    fn bind_locked(path: &Path, lock: std::fs::File) -> Result<Self, SocketError> {
        let io_err = |what: &'static str| {
            let path = path.to_path_buf();
            move |source| SocketError::Io { path, what, source }
        };
        match std::fs::symlink_metadata(path) {
            Ok(meta) if meta.file_type().is_socket() => {
                if std::os::unix::net::UnixStream::connect(path).is_ok() {
                    return Err(SocketError::InUse(path.to_path_buf()));
                }
                tracing::info!(socket = %path.display(), "removing a stale admin socket (no process answers on it)");
                std::fs::remove_file(path).map_err(io_err("remove the stale socket"))?;
            }
            Ok(_) => return Err(SocketError::NotASocket(path.to_path_buf())),
            Err(e) if e.kind() == io::ErrorKind::NotFound => {}
            Err(e) => return Err(io_err("inspect the path")(e)),
        }
        let mut tmp = path.as_os_str().to_owned();
        tmp.push(format!(".{}.tmp", std::process::id()));
        let tmp = PathBuf::from(tmp);
        let _ = std::fs::remove_file(&tmp);
        let std_listener =
            std::os::unix::net::UnixListener::bind(&tmp).map_err(io_err("bind the socket"))?;
        let secured = std::fs::set_permissions(&tmp, std::fs::Permissions::from_mode(0o600))
            .and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = secured {
            let _ = std::fs::remove_file(&tmp);
            return Err(io_err("set mode 0600 and move the socket into place")(e));
        }
        let meta = std::fs::symlink_metadata(path).map_err(io_err("inspect the socket"))?;
        std_listener
            .set_nonblocking(true)
            .map_err(io_err("make the socket non-blocking"))?;
        let listener =
            UnixListener::from_std(std_listener).map_err(io_err("register the socket"))?;
        Ok(Self {
            listener,
            path: path.to_path_buf(),
            id: (meta.dev(), meta.ino()),
            _lock: lock,
            keep_file: Arc::default(),
        })
    }

    /// Where it is.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The next connection, with its peer's pid and uid for the log (who
    /// changed a backend's state goes into the log).
    pub(super) async fn accept(&self) -> io::Result<(UnixStream, String)> {
        let (s, _) = self.listener.accept().await?;
        let peer = match s.peer_cred() {
            Ok(c) => format!(
                "unix socket, pid {} uid {}",
                c.pid().map_or_else(|| "?".to_string(), |p| p.to_string()),
                c.uid()
            ),
            Err(_) => "unix socket".to_string(),
        };
        Ok((s, peer))
    }
}

/// Why the socket the last process stored is not the admin socket at its
/// path ([`AdminSocket::adopt`] binds a new one).
#[derive(Debug, thiserror::Error)]
pub enum UnadoptableSocket {
    /// The descriptor is not a socket.
    #[error("not a socket: {0}")]
    NotASocket(#[source] std::io::Error),
    /// Whether it listens, where it is bound, or making it non-blocking
    /// failed.
    #[error(transparent)]
    Unreadable(std::io::Error),
    /// Not a listening stream socket.
    #[error("not a listening stream socket")]
    NotListening,
    /// Bound at another path (or none).
    #[error("bound at {bound:?}, not {}", path.display())]
    ElsewhereBound {
        /// Where it is bound.
        bound: Option<PathBuf>,
        /// The admin socket's path.
        path: PathBuf,
    },
    /// The file at the path cannot be read.
    #[error("its file: {0}")]
    FileUnreadable(#[source] std::io::Error),
    /// The file at the path is not a socket.
    #[error("the file at its path is not a socket")]
    FileNotASocket,
}

/// `fd` as the admin socket at `path`, if it is one: a listening Unix
/// stream socket bound at `path`, whose file is there.
fn adoptable(
    path: &Path,
    fd: std::os::fd::OwnedFd,
) -> Result<(std::os::unix::net::UnixListener, (u64, u64)), UnadoptableSocket> {
    let socket = socket2::Socket::from(fd);
    if socket.r#type().map_err(UnadoptableSocket::NotASocket)? != socket2::Type::STREAM
        || !socket
            .is_listener()
            .map_err(UnadoptableSocket::Unreadable)?
    {
        return Err(UnadoptableSocket::NotListening);
    }
    // Bound under `<path>.<pid>.tmp` and renamed into place (see `bind`).
    let bound = socket.local_addr().map_err(UnadoptableSocket::Unreadable)?;
    let ours = bound.as_pathname().is_some_and(|b| {
        b == path
            || b.as_os_str()
                .to_str()
                .zip(path.to_str())
                .and_then(|(b, p)| b.strip_prefix(p)?.strip_prefix('.')?.strip_suffix(".tmp"))
                .is_some_and(|pid| !pid.is_empty() && pid.bytes().all(|c| c.is_ascii_digit()))
    });
    if !ours {
        return Err(UnadoptableSocket::ElsewhereBound {
            bound: bound.as_pathname().map(Path::to_path_buf),
            path: path.to_path_buf(),
        });
    }
    let meta = std::fs::symlink_metadata(path).map_err(UnadoptableSocket::FileUnreadable)?;
    if !meta.file_type().is_socket() {
        return Err(UnadoptableSocket::FileNotASocket);
    }
    socket
        .set_nonblocking(true)
        .map_err(UnadoptableSocket::Unreadable)?;
    Ok((socket.into(), (meta.dev(), meta.ino())))
}

impl Drop for AdminSocket {
    fn drop(&mut self) {
        if self.keep_file.load(Ordering::Acquire) {
            return;
        }
        let ours =
            std::fs::symlink_metadata(&self.path).is_ok_and(|m| (m.dev(), m.ino()) == self.id);
        if ours && let Err(e) = std::fs::remove_file(&self.path) {
            tracing::debug!(socket = %self.path.display(), error = %e, "cannot remove the admin socket");
        }
    }
}

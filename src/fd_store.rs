//! systemd's file descriptor store (`FDSTORE=1`): how the daemon's sockets
//! outlive its process across a restart (issue 41).
//!
//! Two halves, both a no-op outside systemd:
//! - [`FdStore`]: sends descriptors to `$NOTIFY_SOCKET` with `SCM_RIGHTS`
//!   under a name (`FDSTORE=1`, `FDNAME=`), and takes a name out again
//!   (`FDSTOREREMOVE=1`). PID 1 keeps a copy of each, so a listening socket
//!   keeps its port, and its accept queue, while no process of the unit runs.
//! - [`Inherited`]: what the store handed to this process at start
//!   (`LISTEN_PID`, `LISTEN_FDS`, `LISTEN_FDNAMES`), taken once from the
//!   environment, by name: whoever rebuilds a socket takes its descriptors
//!   from here instead of binding a new one.
//!
//! A few dozen lines over `libc` rather than the `sd-notify` crate: the
//! daemon's `sd_notify` (`crate::systemd`) is already std alone, the crate
//! would add a dependency for one `sendmsg`, and its `listen_fds` API hands
//! out raw numbers where this module gives `OwnedFd`s matched by name
//! (systemd reorders `LISTEN_FDNAMES` after a daemon-reload).
//!
//! Names are systemd's `FDNAME=`: 1 to 255 bytes of printable ASCII with no
//! `:` ([`FdName`]). The daemon's own: [`listener_name`], [`ADMIN_TCP`],
//! [`ADMIN_UNIX`]; open connections and UDP flows travel together through
//! one socket pair stored under the [`CARRIER`] names.
//!
//! `unsafe` is confined to this module's `sendmsg`, `fcntl` and the
//! environment's removal at start.

#![allow(unsafe_code)]

use std::collections::HashMap;
use std::ffi::OsString;
use std::fmt;
use std::net::SocketAddr;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::sync::{Arc, Mutex};

/// The most descriptors one message carries (the kernel's `SCM_MAX_FD`).
pub(crate) const MAX_FDS_PER_MESSAGE: usize = 253;

/// The first descriptor systemd passes (`SD_LISTEN_FDS_START`).
const LISTEN_FDS_START: i32 = 3;

/// The store name of the admin API's TCP listener (`admin.listen`).
pub const ADMIN_TCP: &str = "admin-tcp";
/// The store name of the admin Unix socket (`admin.socket`).
pub const ADMIN_UNIX: &str = "admin-unix";
/// What every listener's name begins with ([`listener_name`]).
pub const LISTENER_PREFIX: &str = "listen-";
/// The store names of the socket pair that carries the open connections
/// and UDP flows of a hand-over (`daemon::hand_over` `carrier`): one name
/// per end, both kept, as systemd drops a stored socket that hangs up.
pub const CARRIER: [&str; 2] = ["open-connections", "open-connections-peer"];

/// Why a name cannot be a store name.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// Empty, or longer than systemd's 255 bytes.
    #[error("fd store name {name:?}: {len} bytes, systemd takes 1 to 255")]
    Length {
        /// The name.
        name: String,
        /// Its length in bytes.
        len: usize,
    },
    /// A byte systemd refuses (`:`, a control character, non-ASCII).
    #[error(
        "fd store name {name:?}: byte {byte:#04x} at {at} is not allowed (printable ASCII without ':')"
    )]
    Byte {
        /// The name.
        name: String,
        /// The byte.
        byte: u8,
        /// Its offset.
        at: usize,
    },
}

/// A valid `FDNAME=` (systemd's `fdname_is_valid`): checked once, so a
/// name the store would refuse never reaches it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct FdName(String);

impl FdName {
    /// `name`, if systemd takes it.
    pub fn new(name: impl Into<String>) -> Result<Self, NameError> {
        let name = name.into();
        if name.is_empty() || name.len() > 255 {
            let len = name.len();
            return Err(NameError::Length { name, len });
        }
        if let Some((at, &byte)) = name
            .as_bytes()
            .iter()
            .enumerate()
            .find(|(_, b)| **b == b':' || **b < 0x20 || **b >= 0x7f)
        {
            return Err(NameError::Byte { name, byte, at });
        }
        Ok(Self(name))
    }

    /// The name.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for FdName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// The transport of a listener, for its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    /// A TCP listener (all its `SO_REUSEPORT` sockets under one name).
    Tcp,
    /// A UDP listener.
    Udp,
}

/// The name of the listener `addr`: `listen-tcp-127.0.0.1-443`,
/// `listen-udp-fd00--1-53` (an IPv6 address's `:` become `-`, which no
/// address contains, so two addresses never share a name).
pub fn listener_name(transport: Transport, addr: SocketAddr) -> FdName {
    let kind = match transport {
        Transport::Tcp => "tcp",
        Transport::Udp => "udp",
    };
    let ip = addr.ip().to_string().replace(':', "-");
    FdName::new(format!("{LISTENER_PREFIX}{kind}-{ip}-{}", addr.port()))
        .expect("an address with its ':' replaced is a valid name")
}

/// Why a message to the store failed.
#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    /// The socket could not be made, reached or written.
    #[error("fd store ($NOTIFY_SOCKET {socket}): cannot {what} {name}: {source}")]
    Io {
        /// `$NOTIFY_SOCKET`.
        socket: String,
        /// "store" or "remove".
        what: &'static str,
        /// The name.
        name: FdName,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// The sink for descriptors: systemd's store behind `$NOTIFY_SOCKET`, or
/// nothing. Cheap to clone (one shared count of what is stored).
#[derive(Clone, Default)]
pub struct FdStore {
    inner: Option<Arc<StoreInner>>,
}

struct StoreInner {
    socket: OsString,
    /// How many descriptors each name holds in the store, as this process
    /// sent them (the store's own count also has what the last process left).
    stored: Mutex<HashMap<FdName, usize>>,
}

impl fmt::Debug for FdStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.inner {
            Some(i) => write!(f, "FdStore({:?})", i.socket),
            None => f.write_str("FdStore(off)"),
        }
    }
}

impl FdStore {
    /// The store of the unit this process runs under (`$NOTIFY_SOCKET`);
    /// off when it is unset (run by hand, tests in-process).
    pub fn from_env() -> Self {
        std::env::var_os("NOTIFY_SOCKET").map_or_else(Self::off, Self::at)
    }

    /// The store behind the datagram socket `socket` (a path, or `@name`
    /// for an abstract one).
    pub fn at(socket: impl Into<OsString>) -> Self {
        Self {
            inner: Some(Arc::new(StoreInner {
                socket: socket.into(),
                stored: Mutex::new(HashMap::new()),
            })),
        }
    }

    /// No store: every call succeeds and does nothing.
    pub fn off() -> Self {
        Self { inner: None }
    }

    /// Whether descriptors go anywhere.
    pub fn is_on(&self) -> bool {
        self.inner.is_some()
    }

    /// Descriptors this process has stored and not removed.
    pub fn stored_fds(&self) -> usize {
        self.inner.as_ref().map_or(0, |i| {
            i.stored
                .lock()
                .unwrap_or_else(|p| p.into_inner())
                .values()
                .sum()
        })
    }

    /// Puts `fds` into the store under `name` (`FDSTORE=1`). The store
    /// keeps a copy of each; the caller keeps its own. Storing the same
    /// socket again is harmless (systemd keeps one copy).
    pub fn store(&self, name: &FdName, fds: &[BorrowedFd<'_>]) -> Result<(), StoreError> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        let message = format!("FDSTORE=1\nFDNAME={name}");
        for chunk in fds.chunks(MAX_FDS_PER_MESSAGE) {
            send(&inner.socket, message.as_bytes(), chunk).map_err(|source| StoreError::Io {
                socket: inner.socket.to_string_lossy().into_owned(),
                what: "store",
                name: name.clone(),
                source,
            })?;
        }
        let mut stored = inner.stored.lock().unwrap_or_else(|p| p.into_inner());
        stored.insert(name.clone(), fds.len());
        Ok(())
    }

    /// Records that `count` descriptors are in the store under `name`
    /// already (adopted from it at start), without sending them again:
    /// PID 1 compares every descriptor it is sent with every one it holds
    /// (systemd 252 at 2,000 listeners: 2 s of its CPU per start), so what
    /// it holds is not sent twice.
    pub fn note_stored(&self, name: &FdName, count: usize) {
        if let Some(inner) = &self.inner {
            let mut stored = inner.stored.lock().unwrap_or_else(|p| p.into_inner());
            stored.insert(name.clone(), count);
        }
    }

    /// Takes every descriptor named `name` out of the store
    /// (`FDSTOREREMOVE=1`): PID 1 closes its copies, so a listener's port
    /// refuses once this process closes its own.
    pub fn remove(&self, name: &FdName) -> Result<(), StoreError> {
        let Some(inner) = &self.inner else {
            return Ok(());
        };
        inner
            .stored
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .remove(name);
        let message = format!("FDSTOREREMOVE=1\nFDNAME={name}");
        send(&inner.socket, message.as_bytes(), &[]).map_err(|source| StoreError::Io {
            socket: inner.socket.to_string_lossy().into_owned(),
            what: "remove",
            name: name.clone(),
            source,
        })
    }

    /// Stores `bytes` in a sealed-off memory file under `name`: what a
    /// process tells the next one (it reads them with
    /// [`Inherited::take_bytes`]).
    pub fn store_bytes(&self, name: &FdName, bytes: &[u8]) -> Result<(), StoreError> {
        if !self.is_on() {
            return Ok(());
        }
        let file = memfd(bytes).map_err(|source| StoreError::Io {
            socket: String::new(),
            what: "write a memory file for",
            name: name.clone(),
            source,
        })?;
        self.store(name, &[file.as_fd()])
    }

    /// [`FdStore::store`], a failure logged at warn: the socket serves
    /// either way, only a restart would not keep it.
    pub fn store_or_warn(&self, name: &FdName, fds: &[BorrowedFd<'_>]) {
        if let Err(e) = self.store(name, fds) {
            tracing::warn!("{e}; a restart will bind it anew (clients refused for a moment)");
        }
    }

    /// [`FdStore::remove`], a failure logged at warn.
    pub fn remove_or_warn(&self, name: &FdName) {
        if let Err(e) = self.remove(name) {
            tracing::warn!("{e}; systemd keeps its copy until the unit stops");
        }
    }
}

/// A memory file holding `bytes`, read from its start.
fn memfd(bytes: &[u8]) -> std::io::Result<std::fs::File> {
    use std::io::{Seek, Write};
    // SAFETY: a NUL-terminated name and flags; the result is checked.
    let raw = unsafe { libc::memfd_create(c"harvester-lb".as_ptr(), libc::MFD_CLOEXEC) };
    if raw < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: just created, owned by nobody else.
    let mut file = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(raw) });
    file.write_all(bytes)?;
    file.rewind()?;
    Ok(file)
}

/// Milliseconds since the Unix epoch (wall clock: it is compared across
/// two processes).
pub fn unix_millis() -> u64 {
    std::time::SystemTime::now()
        .duration_since(std::time::SystemTime::UNIX_EPOCH)
        .map_or(0, |d| d.as_millis() as u64)
}

/// One datagram with `fds` attached (`SCM_RIGHTS`) to `socket`.
fn send(socket: &OsString, message: &[u8], fds: &[BorrowedFd<'_>]) -> std::io::Result<()> {
    let sender = UnixDatagram::unbound()?;
    let bytes = socket.as_encoded_bytes();
    if let Some(name) = bytes.strip_prefix(b"@") {
        use std::os::linux::net::SocketAddrExt;
        sender.connect_addr(&std::os::unix::net::SocketAddr::from_abstract_name(name)?)?;
    } else {
        sender.connect(socket)?;
    }
    send_on(sender.as_fd(), message, fds, 0)
}

/// One message with `fds` attached (`SCM_RIGHTS`) on the connected Unix
/// socket `socket` (`flags`: e.g. `MSG_DONTWAIT`); at most
/// [`MAX_FDS_PER_MESSAGE`] descriptors.
pub(crate) fn send_on(
    socket: BorrowedFd<'_>,
    message: &[u8],
    fds: &[BorrowedFd<'_>],
    flags: i32,
) -> std::io::Result<()> {
    let mut iov = libc::iovec {
        iov_base: message.as_ptr() as *mut libc::c_void,
        iov_len: message.len(),
    };
    let raw: Vec<i32> = fds.iter().map(AsRawFd::as_raw_fd).collect();
    let payload = std::mem::size_of_val(raw.as_slice()) as u32;
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(payload) } as usize;
    // u64 for the alignment cmsghdr needs.
    let mut control = vec![0u64; space.div_ceil(8)];
    // SAFETY: an all-zero msghdr is valid; every pointer set below points
    // into `iov`, `control` and `raw`, which outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    if !raw.is_empty() {
        msg.msg_control = control.as_mut_ptr().cast();
        msg.msg_controllen = space as _;
        // SAFETY: `control` holds CMSG_SPACE(payload) bytes, so the first
        // header and its data fit in it.
        unsafe {
            let cmsg = libc::CMSG_FIRSTHDR(&msg);
            (*cmsg).cmsg_level = libc::SOL_SOCKET;
            (*cmsg).cmsg_type = libc::SCM_RIGHTS;
            (*cmsg).cmsg_len = libc::CMSG_LEN(payload) as _;
            std::ptr::copy_nonoverlapping(
                raw.as_ptr().cast::<u8>(),
                libc::CMSG_DATA(cmsg),
                payload as usize,
            );
        }
    }
    // SAFETY: `msg` is fully initialised above; the socket is ours.
    let sent = unsafe { libc::sendmsg(socket.as_raw_fd(), &msg, libc::MSG_NOSIGNAL | flags) };
    if sent < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The receiving end, as PID 1 reads a notification: one datagram and the
/// descriptors it carries (close-on-exec). For tests and tools that stand
/// in for systemd's store (`tests/it/support/fd_store.rs`).
pub fn receive(socket: &UnixDatagram) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    receive_on(socket.as_fd(), 4096, 0)
}

/// One message of at most `max_bytes` and the descriptors it carries
/// (close-on-exec) from the Unix socket `socket` (`flags`: e.g.
/// `MSG_DONTWAIT`). A message longer than `max_bytes`, or with more
/// descriptors than one message can carry, is an error (`EMSGSIZE`), its
/// descriptors closed.
pub(crate) fn receive_on(
    socket: BorrowedFd<'_>,
    max_bytes: usize,
    flags: i32,
) -> std::io::Result<(Vec<u8>, Vec<OwnedFd>)> {
    let mut buf = vec![0u8; max_bytes];
    // Room for a full message of descriptors (`SCM_MAX_FD`).
    let mut control = vec![0u64; 160];
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // SAFETY: an all-zero msghdr is valid; its pointers point into `iov`,
    // `buf` and `control`, which outlive the call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(control.as_slice()) as _;
    // SAFETY: `msg` is initialised above; the socket is the caller's.
    let n = unsafe { libc::recvmsg(socket.as_raw_fd(), &mut msg, libc::MSG_CMSG_CLOEXEC | flags) };
    if n < 0 {
        return Err(std::io::Error::last_os_error());
    }
    let mut fds = Vec::new();
    // SAFETY: the kernel wrote `msg_controllen` bytes of control headers;
    // each SCM_RIGHTS one carries descriptors now owned by this process.
    unsafe {
        let mut cmsg = libc::CMSG_FIRSTHDR(&msg);
        while !cmsg.is_null() {
            if (*cmsg).cmsg_level == libc::SOL_SOCKET && (*cmsg).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(cmsg).cast::<i32>();
                let count = ((*cmsg).cmsg_len as usize - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(data.add(i).read_unaligned()));
                }
            }
            cmsg = libc::CMSG_NXTHDR(&msg, cmsg);
        }
    }
    if msg.msg_flags & (libc::MSG_TRUNC | libc::MSG_CTRUNC) != 0 {
        return Err(std::io::Error::from_raw_os_error(libc::EMSGSIZE));
    }
    buf.truncate(n as usize);
    Ok((buf, fds))
}

/// The descriptors the store handed to this process at start, by name.
/// Taken once ([`Inherited::from_env`]); each is given to the first who
/// asks for its name, and what nobody took is closed by
/// [`Inherited::close_rest`].
#[derive(Default)]
pub struct Inherited {
    fds: Mutex<HashMap<String, Vec<OwnedFd>>>,
    /// What was wrong with the environment, said once logging runs.
    problems: Vec<String>,
}

impl fmt::Debug for Inherited {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "Inherited({:?})", self.names())
    }
}

impl Inherited {
    /// Nothing inherited.
    pub fn none() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// Takes `LISTEN_FDS` descriptors from 3 on, named by
    /// `LISTEN_FDNAMES`, when `LISTEN_PID` is this process; sets each
    /// close-on-exec and removes the three variables, so no child of the
    /// daemon (`nft`, `ip`) believes they are its own.
    ///
    /// Call it before any other thread runs: it changes the environment.
    pub fn from_env() -> Self {
        let mut taken = Self::default();
        let var = |k: &str| std::env::var(k).ok();
        let (pid, count, names) = (var("LISTEN_PID"), var("LISTEN_FDS"), var("LISTEN_FDNAMES"));
        // SAFETY: called at the top of `main` before the runtime or any
        // thread that reads the environment starts (see the doc).
        unsafe {
            std::env::remove_var("LISTEN_PID");
            std::env::remove_var("LISTEN_FDS");
            std::env::remove_var("LISTEN_FDNAMES");
        }
        let Some(pid) = pid else {
            return taken;
        };
        if pid.parse::<u32>().ok() != Some(std::process::id()) {
            taken.problems.push(format!(
                "LISTEN_PID={pid} is not this process ({}): the descriptors are another process's, none taken",
                std::process::id()
            ));
            return taken;
        }
        let count: i32 = match count.as_deref().map(str::parse) {
            Some(Ok(n)) if (0..=65_536).contains(&n) => n,
            other => {
                taken.problems.push(format!(
                    "LISTEN_FDS={other:?} is not a count of descriptors: none taken"
                ));
                return taken;
            }
        };
        let names: Vec<&str> = names
            .as_deref()
            .map_or_else(Vec::new, |n| n.split(':').collect());
        if names.len() != count as usize {
            taken.problems.push(format!(
                "LISTEN_FDNAMES has {} names for LISTEN_FDS={count}: the unnamed ones are closed",
                names.len()
            ));
        }
        let fds = taken.fds.get_mut().unwrap_or_else(|p| p.into_inner());
        for i in 0..count {
            let raw = LISTEN_FDS_START + i;
            // SAFETY: fcntl on a number is safe; it fails on a closed one.
            if unsafe { libc::fcntl(raw, libc::F_SETFD, libc::FD_CLOEXEC) } < 0 {
                taken
                    .problems
                    .push(format!("descriptor {raw} of LISTEN_FDS is not open"));
                continue;
            }
            // SAFETY: systemd passed it to this process (LISTEN_PID) and
            // nothing else in the process owns it yet.
            let fd = unsafe { OwnedFd::from_raw_fd(raw) };
            match names.get(i as usize) {
                Some(name) if names.len() == count as usize => {
                    fds.entry((*name).to_string()).or_default().push(fd)
                }
                _ => drop(fd),
            }
        }
        taken
    }

    /// Takes `fds` under their names: for tests, and a process that got
    /// them some other way.
    pub fn from_fds(fds: impl IntoIterator<Item = (String, OwnedFd)>) -> Self {
        let mut map: HashMap<String, Vec<OwnedFd>> = HashMap::new();
        for (name, fd) in fds {
            map.entry(name).or_default().push(fd);
        }
        Self {
            fds: Mutex::new(map),
            problems: Vec::new(),
        }
    }

    /// What was wrong with the environment at start (empty when nothing).
    pub fn problems(&self) -> &[String] {
        &self.problems
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Vec<OwnedFd>>> {
        self.fds.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Every descriptor named `name`, in the order they were passed (empty
    /// when none); they are the caller's from now on.
    pub fn take(&self, name: &FdName) -> Vec<OwnedFd> {
        self.lock().remove(name.as_str()).unwrap_or_default()
    }

    /// Every descriptor whose name begins with `prefix`, with its name:
    /// what a process takes of a family of names at once.
    pub fn take_prefix(&self, prefix: &str) -> Vec<(FdName, OwnedFd)> {
        let mut map = self.lock();
        let names: Vec<String> = map
            .keys()
            .filter(|n| n.starts_with(prefix))
            .cloned()
            .collect();
        let mut out = Vec::new();
        for n in names {
            let fds = map.remove(&n).unwrap_or_default();
            if let Ok(name) = FdName::new(n) {
                out.extend(fds.into_iter().map(|fd| (name.clone(), fd)));
            }
        }
        out
    }

    /// What a memory file stored with [`FdStore::store_bytes`] holds (the
    /// first one of `name`); `None` when there is none or it is unreadable.
    pub fn take_bytes(&self, name: &FdName) -> Option<Vec<u8>> {
        use std::io::{Read, Seek};
        let fd = self.take(name).into_iter().next()?;
        let mut file = std::fs::File::from(fd);
        let mut bytes = Vec::new();
        file.rewind().ok()?;
        file.take(4096).read_to_end(&mut bytes).ok()?;
        Some(bytes)
    }

    /// The names not taken yet.
    pub fn names(&self) -> Vec<String> {
        let mut names: Vec<String> = self.lock().keys().cloned().collect();
        names.sort();
        names
    }

    /// Closes what nobody took whose name begins with `prefix`, and takes
    /// those names out of `store`: a listener the config no longer has
    /// must not keep its port listening in PID 1. Returns the names.
    pub fn close_rest(&self, prefix: &str, store: &FdStore) -> Vec<FdName> {
        let rest = self.take_prefix(prefix);
        let mut names: Vec<FdName> = rest.into_iter().map(|(n, _fd)| n).collect();
        names.dedup();
        for name in &names {
            store.remove_or_warn(name);
        }
        names
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_follow_systemds_rule() {
        assert!(FdName::new("listen-tcp-127.0.0.1-443").is_ok());
        assert!(FdName::new("with space").is_ok());
        assert!(matches!(
            FdName::new("a:b"),
            Err(NameError::Byte {
                byte: b':',
                at: 1,
                ..
            })
        ));
        assert!(matches!(FdName::new(""), Err(NameError::Length { .. })));
        assert!(matches!(
            FdName::new("x".repeat(256)),
            Err(NameError::Length { len: 256, .. })
        ));
        assert!(FdName::new("x".repeat(255)).is_ok());
        assert!(FdName::new("tab\there").is_err());
        assert!(FdName::new("é").is_err());
        let v6 = listener_name(Transport::Udp, "[fd00::1]:53".parse().unwrap());
        assert_eq!(v6.as_str(), "listen-udp-fd00--1-53");
        let mapped = listener_name(Transport::Tcp, "[::ffff:10.0.0.1]:80".parse().unwrap());
        assert_eq!(mapped.as_str(), "listen-tcp---ffff-10.0.0.1-80");
    }

    /// The message and its descriptors as the receiving end (PID 1) sees them.
    #[test]
    fn store_sends_the_name_and_every_descriptor_and_remove_sends_the_name() {
        let dir = std::env::temp_dir().join(format!("hlb-fdstore-unit-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("notify");
        let _ = std::fs::remove_file(&path);
        let holder = UnixDatagram::bind(&path).unwrap();
        let store = FdStore::at(&path);
        let a = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let b = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let name = FdName::new("two").unwrap();
        store.store(&name, &[a.as_fd(), b.as_fd()]).unwrap();
        assert_eq!(store.stored_fds(), 2);
        let (text, fds) = receive(&holder).unwrap();
        assert_eq!(text, b"FDSTORE=1\nFDNAME=two");
        assert_eq!(fds.len(), 2);
        let got = std::net::TcpListener::from(fds.into_iter().next().unwrap());
        assert_eq!(got.local_addr().unwrap(), a.local_addr().unwrap());
        store.remove(&name).unwrap();
        assert_eq!(store.stored_fds(), 0);
        let (text, fds) = receive(&holder).unwrap();
        assert_eq!(text, b"FDSTOREREMOVE=1\nFDNAME=two");
        assert!(fds.is_empty());
        // Off: nothing sent, nothing failed.
        FdStore::off().store(&name, &[a.as_fd()]).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn inherited_descriptors_are_taken_by_name_and_prefix() {
        let fd = |_: u8| -> OwnedFd { std::net::UdpSocket::bind("127.0.0.1:0").unwrap().into() };
        let inherited = Inherited::from_fds([
            ("listen-tcp-a".to_string(), fd(0)),
            ("listen-tcp-a".to_string(), fd(1)),
            ("conn-1-client".to_string(), fd(2)),
            ("conn-1-backend".to_string(), fd(3)),
            ("listen-udp-gone".to_string(), fd(4)),
        ]);
        assert_eq!(
            inherited.take(&FdName::new("listen-tcp-a").unwrap()).len(),
            2
        );
        assert!(
            inherited
                .take(&FdName::new("listen-tcp-a").unwrap())
                .is_empty()
        );
        let mut conns: Vec<String> = inherited
            .take_prefix("conn-")
            .into_iter()
            .map(|(n, _)| n.to_string())
            .collect();
        conns.sort();
        assert_eq!(conns, ["conn-1-backend", "conn-1-client"]);
        let closed = inherited.close_rest(LISTENER_PREFIX, &FdStore::off());
        assert_eq!(closed, [FdName::new("listen-udp-gone").unwrap()]);
        assert!(inherited.names().is_empty());
    }
}

//! A stand-in for systemd's file descriptor store, for tests without a
//! systemd: [`FakeStore`] binds a `NOTIFY_SOCKET` and keeps what the daemon
//! stores there (`FDSTORE=1` + `FDNAME=`, descriptors by `SCM_RIGHTS`),
//! honours `FDSTOREREMOVE=1` and a maximum as systemd 252 does (past it the
//! descriptors are closed, the rest of the message kept), keeps one copy of
//! a socket stored twice, and records every other notification (`READY=1`,
//! `STOPPING=1`). [`FakeStore::launch`] starts the next daemon process with
//! the stored descriptors at 3, 4, ... named by `LISTEN_FDNAMES` and
//! `LISTEN_PID` its own pid (`sh -c 'export LISTEN_PID=$$; exec "$@"'`
//! keeps the pid), as PID 1 does at a restart.
//!
//! What it leaves out of systemd: the store is never emptied by itself
//! (systemd empties it when the unit stops with no job queued; a test of
//! stop semantics checks the port, which the daemon's own FDSTOREREMOVE
//! closes), and POLLHUP of a stored socket is not watched.

use std::os::fd::{AsRawFd, OwnedFd};
use std::os::unix::net::UnixDatagram;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use super::process::{Launch, Process};

#[derive(Default)]
struct Held {
    /// (name, descriptor, (st_dev, st_ino)) in the order stored.
    fds: Vec<(String, OwnedFd, (u64, u64))>,
    /// Every message that was not a store or remove, in order.
    notifications: Vec<String>,
    /// Descriptors closed because the store was full.
    refused: usize,
}

/// The fake store; its thread stops when it is dropped.
pub struct FakeStore {
    path: PathBuf,
    held: Arc<Mutex<Held>>,
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl FakeStore {
    /// A store behind `dir/notify.sock` keeping at most `max` descriptors
    /// (`FileDescriptorStoreMax=`).
    pub fn new(dir: &Path, max: usize) -> Self {
        let path = dir.join("notify.sock");
        let _ = std::fs::remove_file(&path);
        let socket = UnixDatagram::bind(&path)
            .unwrap_or_else(|e| panic!("bind the fake NOTIFY_SOCKET {}: {e}", path.display()));
        socket
            .set_read_timeout(Some(Duration::from_millis(50)))
            .expect("a read timeout");
        let held = Arc::new(Mutex::new(Held::default()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (held, stop) = (Arc::clone(&held), Arc::clone(&stop));
            std::thread::spawn(move || {
                while !stop.load(Ordering::Relaxed) {
                    if let Some((text, fds)) = receive(&socket) {
                        take(&held, max, &text, fds);
                    }
                }
            })
        };
        Self {
            path,
            held,
            stop,
            thread: Some(thread),
        }
    }

    /// The names held, one per descriptor, in the order stored.
    pub fn names(&self) -> Vec<String> {
        let held = self.held.lock().unwrap();
        held.fds.iter().map(|(n, _, _)| n.clone()).collect()
    }

    /// Descriptors held.
    pub fn count(&self) -> usize {
        self.held.lock().unwrap().fds.len()
    }

    /// Waits until it holds `n` descriptors (it reads the datagrams on a
    /// thread of its own, so a store the daemon did is seen a moment
    /// later); panics with the names after 30 s.
    pub async fn wait_count(&self, n: usize) {
        let deadline = std::time::Instant::now() + Duration::from_secs(30);
        while self.count() != n {
            assert!(
                std::time::Instant::now() < deadline,
                "the store holds {} descriptors, not {n}: {:?}",
                self.count(),
                self.names()
            );
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
    }

    /// Descriptors closed because the store was full.
    pub fn refused(&self) -> usize {
        self.held.lock().unwrap().refused
    }

    /// Every notification that was not a store or remove, in order.
    pub fn notifications(&self) -> Vec<String> {
        self.held.lock().unwrap().notifications.clone()
    }

    /// How many notifications so far contain `what` (`READY=1`).
    pub fn notified(&self, what: &str) -> usize {
        self.notifications()
            .iter()
            .filter(|n| n.lines().any(|l| l == what))
            .count()
    }

    /// Starts `launch` as the unit's next process: `NOTIFY_SOCKET` this
    /// store, every held descriptor at 3, 4, ... (copies: the store keeps
    /// its own, as PID 1 does), `LISTEN_FDS`, `LISTEN_FDNAMES`, and
    /// `LISTEN_PID` the daemon's pid.
    pub fn launch(&self, launch: Launch) -> Process {
        let held = self.held.lock().unwrap();
        let names: Vec<&str> = held.fds.iter().map(|(n, _, _)| n.as_str()).collect();
        let fds: Vec<OwnedFd> = held
            .fds
            .iter()
            .map(|(_, fd, _)| fd.try_clone().expect("dup a stored descriptor"))
            .collect();
        let mut launch = launch.env("NOTIFY_SOCKET", &self.path);
        if !fds.is_empty() {
            launch = launch
                .env("LISTEN_FDS", fds.len().to_string())
                .env("LISTEN_FDNAMES", names.join(":"))
                .under(&["sh", "-c", "export LISTEN_PID=$$; exec \"$@\"", "sh"])
                .fds(fds);
        }
        drop(held);
        launch.spawn()
    }
}

impl Drop for FakeStore {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.path);
    }
}

/// What one message does to the store.
fn take(held: &Mutex<Held>, max: usize, text: &str, fds: Vec<OwnedFd>) {
    let mut held = held.lock().unwrap();
    let field = |key: &str| {
        text.lines()
            .find_map(|l| l.strip_prefix(key))
            .map(str::to_string)
    };
    let name = field("FDNAME=").unwrap_or_else(|| "stored".to_string());
    if text.lines().any(|l| l == "FDSTOREREMOVE=1") {
        held.fds.retain(|(n, _, _)| *n != name);
    } else if text.lines().any(|l| l == "FDSTORE=1") {
        for fd in fds {
            let id = identity(&fd);
            if held.fds.iter().any(|(_, _, i)| *i == id) {
                continue; // systemd keeps one copy of a file stored twice
            }
            if held.fds.len() >= max {
                held.refused += 1;
                continue; // "Cannot store more fds than FileDescriptorStoreMax"
            }
            held.fds.push((name.clone(), fd, id));
        }
    } else {
        held.notifications.push(text.to_string());
    }
}

fn identity(fd: &OwnedFd) -> (u64, u64) {
    // SAFETY: fstat fills the struct; the descriptor is open.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    let rc = unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
    assert_eq!(rc, 0, "fstat a stored descriptor");
    (st.st_dev, st.st_ino)
}

/// One datagram and its descriptors; `None` on the read timeout.
fn receive(socket: &UnixDatagram) -> Option<(String, Vec<OwnedFd>)> {
    let (bytes, fds) = harvester_lb::fd_store::receive(socket).ok()?;
    Some((String::from_utf8_lossy(&bytes).into_owned(), fds))
}

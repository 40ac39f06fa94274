//! Zero-copy forwarding with `splice(2)` through a pipe: the bytes go from one
//! socket's receive queue to the other's send queue inside the kernel and
//! never through user memory.
//!
//! Pipes are taken from a small pool only while data is in flight and given
//! back empty, so an idle connection holds no pipe and no buffer: five
//! thousand idle clients cost sockets, nothing else.
//!
//! This is the only module with `unsafe` code: the two system calls.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Mutex;

/// Most bytes moved by one `splice` call: the default pipe capacity.
pub const CHUNK: usize = 64 * 1024;

/// Idle pipes kept for reuse. A pipe costs two descriptors; beyond this many
/// spare ones, returned pipes are closed.
const POOL_MAX: usize = 256;

/// A pipe used as the in-kernel buffer between two sockets.
pub struct Pipe {
    read: OwnedFd,
    write: OwnedFd,
}

impl Pipe {
    fn new() -> io::Result<Self> {
        let mut fds = [0 as libc::c_int; 2];
        // SAFETY: `fds` is a valid array of two ints for pipe2 to fill.
        let rc = unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_NONBLOCK | libc::O_CLOEXEC) };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: pipe2 succeeded, so both descriptors are open and ours alone.
        let (read, write) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
        Ok(Self { read, write })
    }

    /// Moves up to `len` bytes from socket `from` into the pipe. `Ok(0)` is
    /// end of stream.
    pub fn fill_from(&self, from: RawFd, len: usize) -> io::Result<usize> {
        splice(from, self.write.as_raw_fd(), len)
    }

    /// Moves up to `len` bytes from the pipe into socket `to`.
    pub fn drain_into(&self, to: RawFd, len: usize) -> io::Result<usize> {
        splice(self.read.as_raw_fd(), to, len)
    }
}

fn splice(from: RawFd, to: RawFd, len: usize) -> io::Result<usize> {
    // SAFETY: both descriptors are open for the duration of the call (the
    // caller holds the owning objects); null offsets are allowed for sockets
    // and pipes.
    let n = unsafe {
        libc::splice(
            from,
            std::ptr::null_mut(),
            to,
            std::ptr::null_mut(),
            len,
            libc::SPLICE_F_MOVE | libc::SPLICE_F_NONBLOCK,
        )
    };
    if n < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(n as usize)
    }
}

/// Spare empty pipes, shared by all connections.
pub struct PipePool {
    spare: Mutex<Vec<Pipe>>,
}

impl PipePool {
    /// An empty pool.
    pub const fn new() -> Self {
        Self {
            spare: Mutex::new(Vec::new()),
        }
    }

    /// A pipe from the pool, or a new one.
    pub fn take(&self) -> io::Result<Pipe> {
        let spare = self.spare.lock().unwrap_or_else(|p| p.into_inner()).pop();
        match spare {
            Some(p) => Ok(p),
            None => Pipe::new(),
        }
    }

    /// Closes every spare pipe (two descriptors each) and returns how many:
    /// when the process runs out of descriptors, the cache goes first.
    pub fn release_spare(&self) -> usize {
        let spare = std::mem::take(&mut *self.spare.lock().unwrap_or_else(|p| p.into_inner()));
        spare.len()
    }

    /// Returns an *empty* pipe for reuse. A pipe that may still hold bytes
    /// must be dropped instead, never given back.
    pub fn give_back(&self, pipe: Pipe) {
        let mut spare = self.spare.lock().unwrap_or_else(|p| p.into_inner());
        if spare.len() < POOL_MAX {
            spare.push(pipe);
        }
    }
}

impl Default for PipePool {
    fn default() -> Self {
        Self::new()
    }
}

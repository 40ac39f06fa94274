//! Copying both ways between a client and a backend until both are done.
//!
//! Each direction waits for its source to be readable, borrows a pipe, splices
//! as long as data comes, and gives the pipe back before waiting again. End of
//! stream on one side becomes a write shutdown on the other (half-close), so a
//! client that has finished sending still receives the whole response. An
//! error on either side ends both at once. A connection with no byte moving
//! either way for the idle timeout is closed.

use std::io;
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

use metrics::Counter;
use socket2::SockRef;
use tokio::io::Interest;
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::splice::{CHUNK, PipePool};

static PIPES: PipePool = PipePool::new();

/// Closes the spare pipes of the pool (they hold descriptors a new
/// connection may need); returns how many were closed.
pub fn release_spare_pipes() -> usize {
    PIPES.release_spare()
}

/// How a forwarded connection ended.
#[derive(Debug)]
pub enum Ended {
    /// Both sides finished sending.
    Completed,
    /// Nothing moved for the idle timeout.
    IdleTimeout,
    /// A socket error (reset, broken pipe…) on either side.
    Failed(io::Error),
}

/// The counters a copy adds its bytes to.
pub struct ByteCounters<'a> {
    /// Bytes from the client to the backend.
    pub client_to_backend: &'a Counter,
    /// Bytes from the backend to the client.
    pub backend_to_client: &'a Counter,
}

/// Last time a byte moved, as milliseconds since `base` (on tokio's clock).
struct Activity {
    base: Instant,
    last_ms: AtomicU64,
}

impl Activity {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            last_ms: AtomicU64::new(0),
        }
    }

    fn touch(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// Forwards bytes both ways until both directions end, one fails, or the
/// connection is idle for `idle_timeout`.
pub async fn bidirectional(
    client: &TcpStream,
    backend: &TcpStream,
    idle_timeout: Duration,
    counters: ByteCounters<'_>,
) -> Ended {
    let activity = Activity::new();
    let both = async {
        tokio::try_join!(
            one_way(client, backend, counters.client_to_backend, &activity),
            one_way(backend, client, counters.backend_to_client, &activity),
        )
    };
    tokio::select! {
        r = both => match r {
            Ok(_) => Ended::Completed,
            Err(e) => Ended::Failed(e),
        },
        _ = idle(&activity, idle_timeout) => Ended::IdleTimeout,
    }
}

/// Resolves once nothing has moved for `timeout`.
async fn idle(activity: &Activity, timeout: Duration) {
    loop {
        let deadline = activity.last() + timeout;
        if Instant::now() >= deadline {
            return;
        }
        tokio::time::sleep_until(deadline).await;
    }
}

/// Copies `src` to `dst` until `src` ends, then shuts down `dst`'s write side.
async fn one_way(
    src: &TcpStream,
    dst: &TcpStream,
    bytes: &Counter,
    activity: &Activity,
) -> io::Result<()> {
    loop {
        src.readable().await?;
        let pipe = match PIPES.take() {
            Ok(p) => p,
            Err(e) if super::forward::is_local_shortage(&e) => {
                // No descriptor for a pipe: move what is there through user
                // memory instead of failing a connection that is fine.
                if copy_through_buffer(src, dst, bytes, activity).await? {
                    return shutdown_write(dst);
                }
                continue;
            }
            Err(e) => return Err(e),
        };
        loop {
            let n = match src.try_io(Interest::READABLE, || {
                pipe.fill_from(src.as_raw_fd(), CHUNK)
            }) {
                Ok(0) => {
                    PIPES.give_back(pipe);
                    return shutdown_write(dst);
                }
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                // The pipe may hold nothing, but an error path is rare: drop it.
                Err(e) => return Err(e),
            };
            let mut left = n;
            while left > 0 {
                dst.writable().await?;
                match dst.try_io(Interest::WRITABLE, || {
                    pipe.drain_into(dst.as_raw_fd(), left)
                }) {
                    Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                    Ok(m) => left -= m,
                    Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                    Err(e) => return Err(e),
                }
            }
            bytes.increment(n as u64);
            activity.touch();
        }
        PIPES.give_back(pipe);
    }
}

/// Copies what `src` holds now to `dst` through a small heap buffer (the
/// fallback when no pipe can be had); `Ok(true)` at end of stream.
async fn copy_through_buffer(
    src: &TcpStream,
    dst: &TcpStream,
    bytes: &Counter,
    activity: &Activity,
) -> io::Result<bool> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = match src.try_read(&mut buf) {
            Ok(0) => return Ok(true),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) => return Err(e),
        };
        let mut off = 0;
        while off < n {
            dst.writable().await?;
            match dst.try_write(&buf[off..n]) {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(m) => off += m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err(e),
            }
        }
        bytes.increment(n as u64);
        activity.touch();
    }
}

fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    match SockRef::from(stream).shutdown(Shutdown::Write) {
        // The peer is already gone entirely; the other direction will notice.
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        r => r,
    }
}

//! Copying both ways between a client and a backend until both are done.
//!
//! Each direction waits for its source to be readable. Small messages (a
//! read that does not fill the 16 KiB scratch buffer) go through one `recv`
//! and one `send` with the worker thread's buffer; a direction that fills it
//! is bulk and from then on borrows a pipe, splices as long as data comes,
//! and gives the pipe back before waiting again. Either way nothing is held
//! while a connection waits: an idle connection costs its sockets. End of
//! stream on one side becomes a write shutdown on the other (half-close), so a
//! client that has finished sending still receives the whole response. When
//! the source's FIN is already queued behind the data just read, that data
//! and the FIN leave together in one segment, with no `recv` to learn of the
//! end (see `fin_queued`). An error on either side ends both at once. A connection with no byte moving
//! either way for the idle timeout is closed.
//!
//! A hand-over to the next process (issue 41) stops a copy without losing
//! a byte: each direction stops only at its top-of-loop wait for its
//! source, where it holds nothing (the scratch buffer's tail has been
//! written, the pipe is empty and given back). A direction busy writing
//! finishes its write first. See [`bidirectional`]'s `pause`.

use std::cell::RefCell;
use std::io::{self, Read};
use std::net::Shutdown;
use std::os::fd::AsRawFd;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use crate::metrics::Counter;
use socket2::SockRef;
use tokio::io::{Interest, Ready};
use tokio::net::TcpStream;
use tokio::time::Instant;

use super::splice::{CHUNK, Pipe, PipePool};

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
    /// A socket error (reset, broken pipe…) on the socket of `Peer`: the
    /// connection log tells a client's reset from a backend's by it.
    Failed(Peer, io::Error),
    /// Asked to pause, every direction stopped at its wait for its source
    /// or had ended (its half-close passed on): no byte of the connection
    /// is held by this process, only by the two sockets, which the next
    /// process can copy on from.
    Paused,
}

/// How one direction stopped without an error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Way {
    /// Its source ended and the end was passed on.
    Ended,
    /// Paused at its wait for the source, holding nothing.
    Paused,
}

/// One of the two sockets of a forwarded connection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Peer {
    /// The client's socket.
    Client,
    /// The backend's socket.
    Backend,
}

/// The counters a copy adds its bytes to.
pub struct ByteCounters<'a> {
    /// Bytes from the client to the backend.
    pub client_to_backend: &'a Counter,
    /// Bytes from the backend to the client.
    pub backend_to_client: &'a Counter,
    /// The backend's own pair (client to backend, backend to client), when
    /// it is a member of the load balancer: its totals.
    pub backend: Option<[&'a Counter; 2]>,
    /// This connection's bytes each way, for its log line.
    pub moved: &'a Moved,
}

/// The bytes one connection moved each way. Kept outside the copy, so a
/// connection cut before its copy ends (drain, backend marked down) still
/// reports them. One writer per direction: a plain store, no
/// read-modify-write.
#[derive(Debug, Default)]
pub struct Moved {
    /// Client to backend.
    pub client_to_backend: AtomicU64,
    /// Backend to client.
    pub backend_to_client: AtomicU64,
}

/// Where one direction adds the bytes it moved: the listener's counter,
/// the backend's and this connection's count. Once per read (up to 16
/// KiB) or spliced chunk (up to 64 KiB): relaxed adds, no lock.
#[derive(Clone, Copy)]
struct Tally<'a> {
    total: &'a Counter,
    backend: Option<&'a Counter>,
    this: &'a AtomicU64,
}

impl Tally<'_> {
    fn add(self, n: usize) {
        self.total.increment(n as u64);
        if let Some(b) = self.backend {
            b.increment(n as u64);
        }
        let now = self.this.load(Ordering::Relaxed);
        self.this.store(now + n as u64, Ordering::Relaxed);
    }
}

/// Which socket of a direction an error came from.
#[derive(Clone, Copy)]
enum End {
    /// The one read from.
    Src,
    /// The one written to.
    Dst,
}

/// An error of one direction, with the socket it came from.
type DirError = (End, io::Error);

fn at(end: End) -> impl FnOnce(io::Error) -> DirError {
    move |e| (end, e)
}

/// What the two directions of one connection share: the last time a byte
/// moved, as milliseconds since `base` (on tokio's clock), and whether one
/// direction has already reached its end.
struct Activity {
    base: Instant,
    last_ms: AtomicU64,
    one_way_done: AtomicBool,
}

impl Activity {
    fn new() -> Self {
        Self {
            base: Instant::now(),
            last_ms: AtomicU64::new(0),
            one_way_done: AtomicBool::new(false),
        }
    }

    /// Records that one direction reached end of stream; true if the other
    /// one already had. Then the connection is over and both sockets close
    /// right away: the close sends the FIN, so no `shutdown` is needed (the
    /// peer's receive queue is empty, having sent its own FIN, so the close
    /// is clean, not a reset). One system call less per connection.
    fn finish_one_way(&self) -> bool {
        self.one_way_done.swap(true, Ordering::Relaxed)
    }

    fn touch(&self) {
        let ms = self.base.elapsed().as_millis() as u64;
        self.last_ms.store(ms, Ordering::Relaxed);
    }

    fn last(&self) -> Instant {
        self.base + Duration::from_millis(self.last_ms.load(Ordering::Relaxed))
    }
}

/// Something to do once if the connection lasts `after`, on the timer the
/// idle timeout already keeps (no timer of its own). The forwarder sets the
/// backend leg's keepalive and `TCP_USER_TIMEOUT` this way: a connection
/// shorter than that never needs them, and does not pay their system calls.
pub struct Later<F: FnOnce()> {
    /// How long after the copy starts.
    pub after: Duration,
    /// What to do then.
    pub run: F,
}

/// Forwards bytes both ways until both directions end, one fails, or the
/// connection is idle for `idle_timeout`; runs `later` if it lasts that long.
///
/// `pause` asks for [`Ended::Paused`]: once it is set, each direction
/// returns at its next wait for its source (a direction writing finishes
/// its write first; a bulk direction whose source always has data stops
/// after the chunk in its pipe is written). It is read with one relaxed
/// load each time a direction's wait is polled and once per spliced chunk
/// (up to 64 KiB), and wakes nothing: whoever sets it must poll this future
/// again afterwards (the forwarder sets it from its own select over this
/// future, in the same task, then polls on).
pub async fn bidirectional(
    client: &TcpStream,
    backend: &TcpStream,
    idle_timeout: Duration,
    counters: ByteCounters<'_>,
    later: Later<impl FnOnce()>,
    pause: &AtomicBool,
) -> Ended {
    let activity = Activity::new();
    let up = Tally {
        total: counters.client_to_backend,
        backend: counters.backend.map(|[up, _]| up),
        this: &counters.moved.client_to_backend,
    };
    let down = Tally {
        total: counters.backend_to_client,
        backend: counters.backend.map(|[_, down]| down),
        this: &counters.moved.backend_to_client,
    };
    let both = async {
        tokio::try_join!(
            from_to(
                client,
                backend,
                up,
                (&activity, pause),
                [Peer::Client, Peer::Backend]
            ),
            from_to(
                backend,
                client,
                down,
                (&activity, pause),
                [Peer::Backend, Peer::Client]
            ),
        )
    };
    tokio::select! {
        r = both => match r {
            Ok((Way::Ended, Way::Ended)) => Ended::Completed,
            Ok(_) => Ended::Paused,
            Err((peer, e)) => Ended::Failed(peer, e),
        },
        _ = idle(&activity, idle_timeout, later) => Ended::IdleTimeout,
    }
}

/// [`one_way`] from `src` to `dst`, whose peers are `peers` (source,
/// destination): an error names the peer whose socket failed.
async fn from_to(
    src: &TcpStream,
    dst: &TcpStream,
    bytes: Tally<'_>,
    (activity, pause): (&Activity, &AtomicBool),
    [from, to]: [Peer; 2],
) -> Result<Way, (Peer, io::Error)> {
    one_way(src, dst, bytes, activity, pause)
        .await
        .map_err(|(end, e)| match end {
            End::Src => (from, e),
            End::Dst => (to, e),
        })
}

/// Resolves once nothing has moved for `timeout`; on the way, runs `later`
/// once it is due (if the connection is not idle before).
async fn idle(activity: &Activity, timeout: Duration, later: Later<impl FnOnce()>) {
    let later_at = activity.base + later.after;
    let mut later = Some(later);
    loop {
        let deadline = activity.last() + timeout;
        let now = Instant::now();
        if let Some(due) = later.take_if(|_| now >= later_at) {
            (due.run)();
        }
        if now >= deadline {
            return;
        }
        let wake = if later.is_some() {
            deadline.min(later_at)
        } else {
            deadline
        };
        tokio::time::sleep_until(wake).await;
    }
}

/// What a direction waits for on its source: data, its end, or an error.
/// `ERROR` tells a reset from a FIN (see [`fin_queued`]).
const SOURCE: Interest = Interest::READABLE.add(Interest::ERROR);

/// Bytes read per `recv` in copy mode. A read that fills it marks the
/// direction as bulk and moves it to `splice(2)` for the rest of the
/// connection (HAProxy's `splice-auto` does the same).
const SCRATCH: usize = 16 * 1024;

thread_local! {
    /// The copy-mode buffer of this worker thread. It is only borrowed inside
    /// one synchronous step, never across an await, so connections hold no
    /// buffer while they wait: an idle connection costs its sockets only.
    static BUF: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; SCRATCH].into_boxed_slice());
}

/// What one synchronous copy-mode step did.
enum Step {
    /// End of stream from `src`.
    Eof,
    /// Nothing to read now.
    Drained,
    /// `n` bytes read and all sent; `last`: they were the last of `src`.
    Sent { n: usize, last: bool },
    /// `n` bytes read; the tail that `dst` could not take yet.
    Blocked { n: usize, tail: Vec<u8>, last: bool },
}

/// Reads from `src` into `buf`. A short read empties the receive queue, so
/// it also clears tokio's readiness, as `EAGAIN` would, without the extra
/// `recv` that would only say so. The readiness cleared is the one observed
/// before the read: data arriving after it has raised a new event, so no
/// wake-up is lost. `Ok(None)`: nothing to read now.
fn read_some(src: &TcpStream, buf: &mut [u8]) -> io::Result<Option<usize>> {
    let mut got = None;
    let r = src.try_io(Interest::READABLE, || {
        let n = (&*SockRef::from(src)).read(buf)?;
        got = Some(n);
        if n > 0 && n < buf.len() {
            Err(io::ErrorKind::WouldBlock.into())
        } else {
            Ok(n)
        }
    });
    match (got, r) {
        (Some(n), _) => Ok(Some(n)),
        (None, Err(e)) if e.kind() == io::ErrorKind::WouldBlock => Ok(None),
        (None, Err(e)) => Err(e),
        (None, Ok(n)) => Ok(Some(n)),
    }
}

/// Copies `src` to `dst` until `src` ends, then shuts down `dst`'s write side.
///
/// Small messages go through one `recv` into the thread's scratch buffer and
/// one `send`; once a read fills the buffer the direction is bulk and moves
/// to zero-copy `splice(2)` through a pooled pipe for the rest of the
/// connection. When no pipe can be had (the process is out of descriptors)
/// the bytes keep moving through the buffer instead of failing a connection
/// that is fine.
///
/// With `pause` set it returns [`Way::Paused`] at the top of its loop, the
/// only point where it holds no byte: every byte read has been written to
/// `dst` (the scratch buffer's tail included) and the pipe, if any, is
/// empty and back in the pool.
async fn one_way(
    src: &TcpStream,
    dst: &TcpStream,
    bytes: Tally<'_>,
    activity: &Activity,
    pause: &AtomicBool,
) -> Result<Way, DirError> {
    let mut bulk = false;
    loop {
        // The pause first (`biased`): a source that is always readable
        // would otherwise never let its direction stop.
        let ready = tokio::select! {
            biased;
            () = paused(pause) => return Ok(Way::Paused),
            r = src.ready(SOURCE) => r.map_err(at(End::Src))?,
        };
        if ready.is_error() && !(ready.is_readable() || ready.is_read_closed()) {
            // An error raised alone: no read would be tried on it (tokio
            // reads on READABLE only), so take it here, or clear it.
            if let Some(e) = src.take_error().map_err(at(End::Src))? {
                return Err((End::Src, e));
            }
            clear_error(src);
            continue;
        }
        if bulk {
            match PIPES.take() {
                Ok(pipe) => {
                    let more =
                        splice_while_readable(src, dst, &pipe, bytes, activity, pause).await?;
                    // Only an empty pipe goes back (an error above drops it).
                    PIPES.give_back(pipe);
                    if !more {
                        return end_of_stream(dst, activity).map_err(at(End::Dst));
                    }
                    continue;
                }
                Err(e) if crate::net::is_local_shortage(&e) => {}
                // No pipe for another reason: the daemon's, counted against
                // the source, whose data could not move.
                Err(e) => return Err((End::Src, e)),
            }
        }
        let fin_queued = fin_queued(ready);
        let step = BUF.with_borrow_mut(|buf| -> Result<Step, DirError> {
            let n = match read_some(src, buf).map_err(at(End::Src))? {
                Some(0) => return Ok(Step::Eof),
                Some(n) => n,
                None => return Ok(Step::Drained),
            };
            // A short read drained the receive queue up to the FIN.
            let last = fin_queued && n < buf.len();
            match send(dst, &buf[..n], last) {
                Ok(m) if m == n => Ok(Step::Sent { n, last }),
                Ok(m) => Ok(Step::Blocked {
                    n,
                    tail: buf[m..n].to_vec(),
                    last,
                }),
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => Ok(Step::Blocked {
                    n,
                    tail: buf[..n].to_vec(),
                    last,
                }),
                Err(e) => Err((End::Dst, e)),
            }
        })?;
        let (n, last) = match step {
            Step::Eof => return end_of_stream(dst, activity).map_err(at(End::Dst)),
            Step::Drained => continue,
            Step::Sent { n, last } => (n, last),
            Step::Blocked { n, tail, last } => {
                write_all(dst, &tail).await.map_err(at(End::Dst))?;
                (n, last)
            }
        };
        bytes.add(n);
        activity.touch();
        if last {
            return last_data_sent(dst, activity).map_err(at(End::Dst));
        }
        bulk |= n == SCRATCH;
    }
}

/// Resolves once `pause` is set. It registers no waker: see
/// [`bidirectional`] for who polls again after setting it.
fn paused(pause: &AtomicBool) -> impl Future<Output = ()> + '_ {
    std::future::poll_fn(move |_| {
        if pause.load(Ordering::Relaxed) {
            std::task::Poll::Ready(())
        } else {
            std::task::Poll::Pending
        }
    })
}

/// Forgets an `ERROR` readiness that carried no pending error (only the
/// error queue, which this socket does not use), so it cannot wake the
/// direction again.
fn clear_error(src: &TcpStream) {
    let _ = src.try_io(Interest::ERROR, || -> io::Result<()> {
        Err(io::ErrorKind::WouldBlock.into())
    });
}

/// Whether `src`'s peer has sent its FIN and no reset: everything still in
/// the receive queue is then the last of this direction. Linux raises
/// `EPOLLRDHUP` only for a FIN taken in sequence, so all the data before it
/// is already queued; a reset raises `EPOLLERR` with it, and is left to the
/// read to report.
fn fin_queued(ready: Ready) -> bool {
    ready.is_read_closed() && !ready.is_error()
}

/// Sends `data` to `dst`. With `last`, `MSG_MORE` holds it back for the FIN
/// that [`last_data_sent`] queues right after, so the last bytes and the
/// end of stream leave in one segment (as HAProxy does): one packet less
/// each way, and no separate ACK for the data.
fn send(dst: &TcpStream, data: &[u8], last: bool) -> io::Result<usize> {
    if !last {
        return dst.try_write(data);
    }
    dst.try_io(Interest::WRITABLE, || {
        SockRef::from(dst).send_with_flags(data, libc::MSG_MORE)
    })
}

/// The last bytes of `src` are sent: end `dst`'s write side now, without the
/// `recv` that would only return the end of stream. The shutdown is made even
/// when the other direction has ended too, because it is what pushes the
/// data held back by `MSG_MORE`, with the FIN.
fn last_data_sent(dst: &TcpStream, activity: &Activity) -> io::Result<Way> {
    activity.finish_one_way();
    shutdown_write(dst).map(|()| Way::Ended)
}

/// Writes all of `data` to `dst`, waiting for room as needed.
async fn write_all(dst: &TcpStream, mut data: &[u8]) -> io::Result<()> {
    while !data.is_empty() {
        dst.writable().await?;
        match dst.try_write(data) {
            Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
            Ok(m) => data = &data[m..],
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// The bulk mode of [`one_way`]: splices from `src` through `pipe` into
/// `dst` for as long as `src` has data. Returns with the pipe empty:
/// `Ok(true)` when `src` has nothing more for now or `pause` is set (a
/// source that always has data, towards a peer slower than it, would
/// otherwise never come back to its wait), `Ok(false)` at its end of
/// stream. The pipe is held only while data is in flight.
async fn splice_while_readable(
    src: &TcpStream,
    dst: &TcpStream,
    pipe: &Pipe,
    bytes: Tally<'_>,
    activity: &Activity,
    pause: &AtomicBool,
) -> Result<bool, DirError> {
    loop {
        let n = match src.try_io(Interest::READABLE, || {
            pipe.fill_from(src.as_raw_fd(), CHUNK)
        }) {
            Ok(0) => return Ok(false),
            Ok(n) => n,
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(true),
            Err(e) => return Err((End::Src, e)),
        };
        let mut left = n;
        while left > 0 {
            dst.writable().await.map_err(at(End::Dst))?;
            match dst.try_io(Interest::WRITABLE, || {
                pipe.drain_into(dst.as_raw_fd(), left)
            }) {
                Ok(0) => return Err((End::Dst, io::ErrorKind::WriteZero.into())),
                Ok(m) => left -= m,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
                Err(e) => return Err((End::Dst, e)),
            }
        }
        bytes.add(n);
        activity.touch();
        // The pipe is empty: a pause can be taken here (one load a chunk).
        if pause.load(Ordering::Relaxed) {
            return Ok(true);
        }
    }
}

/// `src` has ended: pass the end on to `dst` as a write shutdown (a
/// half-close), unless the other direction has ended too and the close that
/// follows at once sends the FIN anyway.
fn end_of_stream(dst: &TcpStream, activity: &Activity) -> io::Result<Way> {
    if activity.finish_one_way() {
        return Ok(Way::Ended);
    }
    shutdown_write(dst).map(|()| Way::Ended)
}

fn shutdown_write(stream: &TcpStream) -> io::Result<()> {
    match SockRef::from(stream).shutdown(Shutdown::Write) {
        // The peer is already gone entirely; the other direction will notice.
        Err(e) if e.kind() == io::ErrorKind::NotConnected => Ok(()),
        r => r,
    }
}

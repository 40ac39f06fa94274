//! The threads that accept and serve TCP connections.
//!
//! Two designs, chosen by `harvester-lb run --scheduler` (work stealing by
//! default: the two are level in the benchmarks, and it binds one socket per
//! VIP:port):
//!
//! * **Thread per core** ([`WorkerThreads`]): one tokio current-thread
//!   runtime per thread; the main thread's runtime, which also runs the
//!   control plane (prober, admin API, reloads, UDP listeners), is the first
//!   of them. Every TCP listener has one `SO_REUSEPORT` socket per runtime,
//!   the kernel spreads new connections across them by a hash of the
//!   client's address and port, and a connection lives and ends on the
//!   thread that accepted it: no task moves between threads and no wake-up
//!   crosses one (nginx's `reuseport`, HAProxy's `shards by-thread`).
//!   With thousands of listeners, past a budget of descriptors, a listener
//!   gets one socket on one thread instead ([`Workers::place`]).
//! * **Work stealing**: tokio's multi-thread runtime, one socket per
//!   VIP:port; idle threads take tasks from busy ones. [`Workers::here`]
//!   says "accept on the runtime that starts the listener".
//!
//! With one thread both are the same: one current-thread runtime.

use std::io;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// Where TCP listeners accept: the runtime that starts each one, or a set
/// of per-thread runtimes. Cheap to clone.
#[derive(Clone, Default, Debug)]
pub struct Workers {
    /// `None`: the runtime that starts the listener (work stealing, tests).
    per_thread: Option<Arc<PerThread>>,
}

#[derive(Debug)]
struct PerThread {
    runtimes: Box<[Handle]>,
    /// The runtime the next single-socket listener goes to.
    next: AtomicUsize,
    /// Sockets beyond the first of each listener, bound now.
    extra_sockets: AtomicUsize,
}

impl Workers {
    /// Accept on the runtime that starts the listener, with one socket.
    pub fn here() -> Self {
        Self::default()
    }

    /// Decides where a new listener accepts. Call from inside a runtime
    /// (`here` means that one).
    ///
    /// A listener gets one socket per thread while the sockets beyond the
    /// first of each listener stay within [`extra_socket_budget`]; past it
    /// (thousands of VIPs) it gets one socket on one thread, each in turn:
    /// many listeners spread the load over the threads by themselves, and a
    /// socket per thread for each would cost listeners × threads
    /// descriptors.
    pub fn place(&self) -> Placement {
        self.place_within(extra_socket_budget(crate::os::open_file_limit()))
    }

    fn place_within(&self, budget: usize) -> Placement {
        let Some(shared) = &self.per_thread else {
            return Placement {
                runtimes: vec![Handle::current()],
                extra: None,
            };
        };
        let n = shared.runtimes.len();
        let taken =
            shared
                .extra_sockets
                .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |bound| {
                    (bound + n - 1 <= budget).then_some(bound + n - 1)
                });
        if n > 1 && taken.is_ok() {
            return Placement {
                runtimes: shared.runtimes.to_vec(),
                extra: Some(Arc::clone(shared)),
            };
        }
        let i = shared.next.fetch_add(1, Ordering::Relaxed) % n;
        Placement {
            runtimes: vec![shared.runtimes[i].clone()],
            extra: None,
        }
    }
}

/// How many sockets beyond the first of each listener may be bound: an
/// eighth of the open-file limit, between 256 and 16,384 (each is a
/// descriptor and a listening socket's kernel memory).
pub fn extra_socket_budget(open_file_limit: Option<u64>) -> usize {
    (open_file_limit.unwrap_or(1024) / 8).clamp(256, 16_384) as usize
}

/// Where one TCP listener accepts: one socket per runtime listed. Gives its
/// share of the socket budget back when dropped (with the listener).
#[derive(Debug)]
pub struct Placement {
    runtimes: Vec<Handle>,
    /// Set when this placement took extra sockets from the budget.
    extra: Option<Arc<PerThread>>,
}

impl Placement {
    /// How many sockets to bind.
    pub fn sockets(&self) -> usize {
        self.runtimes.len()
    }

    /// The runtime of socket `i`; past [`Placement::sockets`] (a listener
    /// adopted from the last process with more sockets than it would bind
    /// now: every one must accept) the runtimes again, in turn.
    pub fn runtime(&self, i: usize) -> &Handle {
        &self.runtimes[i % self.runtimes.len()]
    }
}

impl Drop for Placement {
    fn drop(&mut self) {
        if let Some(shared) = &self.extra {
            shared
                .extra_sockets
                .fetch_sub(self.runtimes.len() - 1, Ordering::Relaxed);
        }
    }
}

/// How TCP connections are spread over the threads (`harvester-lb run
/// --scheduler`; see the module's text).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Scheduler {
    /// One listening socket per thread per VIP:port; a connection stays on
    /// the thread that accepted it.
    ThreadPerCore,
    /// One socket per VIP:port; tokio moves tasks to idle threads.
    WorkStealing,
}

/// The runtime a command blocks on, and the threads beside it.
pub struct Runtimes {
    /// The runtime the control plane runs on (and, thread per core, the
    /// first of the data plane's).
    pub main: tokio::runtime::Runtime,
    /// Thread per core: the other threads' runtimes (none with one thread).
    /// They stop when this drops, after the drain.
    extra: Option<WorkerThreads>,
}

impl Runtimes {
    /// `threads` threads in all (default: one per core, the CPUs this
    /// process may run on). One thread is tokio's current-thread runtime
    /// either way, which skips the multi-threaded scheduler's cross-thread
    /// bookkeeping: measured about 6% more kept-alive requests per second
    /// than a multi-threaded runtime of one worker.
    pub fn new(threads: Option<std::num::NonZeroUsize>, scheduler: Scheduler) -> io::Result<Self> {
        let threads = threads
            .or_else(|| std::thread::available_parallelism().ok())
            .map_or(1, std::num::NonZeroUsize::get);
        match scheduler {
            Scheduler::WorkStealing if threads > 1 => tokio::runtime::Builder::new_multi_thread()
                .worker_threads(threads)
                .enable_all()
                .build()
                .map(|main| Self { main, extra: None }),
            _ => {
                let main = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                let extra = WorkerThreads::start(threads - 1)?;
                Ok(Self {
                    main,
                    extra: Some(extra),
                })
            }
        }
    }

    /// The runtimes TCP listeners accept on.
    pub fn workers(&self) -> Workers {
        match &self.extra {
            Some(extra) => extra.workers(self.main.handle().clone()),
            None => Workers::here(),
        }
    }
}

/// The extra threads of the thread-per-core design, each running a
/// current-thread runtime until [`WorkerThreads::stop`].
pub struct WorkerThreads {
    runtimes: Vec<Handle>,
    threads: Vec<JoinHandle<()>>,
    stop: CancellationToken,
}

impl WorkerThreads {
    /// Starts `extra` threads beside the main one (so `--threads N` starts
    /// N - 1). Each names itself `hlb-worker-K` (seen in `top -H`).
    pub fn start(extra: usize) -> io::Result<Self> {
        let stop = CancellationToken::new();
        let mut started = Self {
            runtimes: Vec::with_capacity(extra),
            threads: Vec::with_capacity(extra),
            stop: stop.clone(),
        };
        for k in 1..=extra {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            started.runtimes.push(runtime.handle().clone());
            let stop = stop.clone();
            let thread = std::thread::Builder::new()
                .name(format!("hlb-worker-{k}"))
                .spawn(move || runtime.block_on(stop.cancelled()))?;
            started.threads.push(thread);
        }
        Ok(started)
    }

    /// Every runtime, `main` first: what listeners accept on.
    pub fn workers(&self, main: Handle) -> Workers {
        let mut all = Vec::with_capacity(self.runtimes.len() + 1);
        all.push(main);
        all.extend(self.runtimes.iter().cloned());
        Workers {
            per_thread: Some(Arc::new(PerThread {
                runtimes: all.into(),
                next: AtomicUsize::new(0),
                extra_sockets: AtomicUsize::new(0),
            })),
        }
    }

    /// Stops every thread; call after the listeners have drained (the
    /// tasks still on a thread are dropped with its runtime).
    pub fn stop(mut self) {
        self.shut_down();
    }

    fn shut_down(&mut self) {
        self.stop.cancel();
        for t in self.threads.drain(..) {
            let _ = t.join();
        }
    }
}

impl Drop for WorkerThreads {
    /// Every return path of `run` stops the threads, errors included.
    fn drop(&mut self) {
        self.shut_down();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn listeners_get_a_socket_per_thread_until_the_budget_then_one_each_in_turn() {
        let main = tokio::runtime::Builder::new_current_thread()
            .build()
            .unwrap();
        let threads = WorkerThreads::start(2).unwrap();
        let workers = threads.workers(main.handle().clone());
        let ids = |p: &Placement| -> Vec<tokio::runtime::Id> {
            (0..p.sockets()).map(|i| p.runtime(i).id()).collect()
        };
        let all = ids(&workers.place_within(4));
        assert_eq!(all.len(), 3);
        assert_eq!(all[0], main.handle().id(), "the main runtime is the first");

        // Budget 4: two listeners of 3 sockets take 2 extra each.
        let first = workers.place_within(4);
        let second = workers.place_within(4);
        assert_eq!((first.sockets(), second.sockets()), (3, 3));
        // Past it, one socket each, on the runtimes in turn.
        let singles: Vec<_> = (0..4).map(|_| workers.place_within(4)).collect();
        let turn: Vec<_> = singles.iter().map(|p| ids(p)[0]).collect();
        assert!(singles.iter().all(|p| p.sockets() == 1));
        assert_eq!(turn[0], turn[3]);
        assert_ne!(turn[0], turn[1]);
        assert_ne!(turn[1], turn[2]);
        assert_ne!(turn[0], turn[2]);
        // A listener gone gives its extra sockets back.
        drop(first);
        assert_eq!(workers.place_within(4).sockets(), 3);
        threads.stop();
    }

    #[test]
    fn the_budget_is_an_eighth_of_the_descriptors_within_bounds() {
        assert_eq!(extra_socket_budget(Some(20_000)), 2_500);
        assert_eq!(extra_socket_budget(Some(1024)), 256);
        assert_eq!(extra_socket_budget(None), 256);
        assert_eq!(extra_socket_budget(Some(1_048_576)), 16_384);
    }
}

//! The threads that accept and serve TCP connections.
//!
//! Two designs, chosen by `harvester-lb run --scheduler`:
//!
//! * **Thread per core** ([`WorkerThreads`]): one tokio current-thread
//!   runtime per thread; the main thread's runtime, which also runs the
//!   control plane (prober, admin API, reloads, UDP listeners), is the first
//!   of them. Every TCP listener has one `SO_REUSEPORT` socket per runtime,
//!   the kernel spreads new connections across them by a hash of the
//!   client's address and port, and a connection lives and ends on the
//!   thread that accepted it: no task moves between threads and no wake-up
//!   crosses one (nginx's `reuseport`, HAProxy's `shards by-thread`).
//! * **Work stealing**: tokio's multi-thread runtime, one socket per
//!   VIP:port; idle threads take tasks from busy ones. [`Workers::here`]
//!   says "accept on the runtime that starts the listener".
//!
//! With one thread both are the same: one current-thread runtime.

use std::io;
use std::sync::Arc;
use std::thread::JoinHandle;

use tokio::runtime::Handle;
use tokio_util::sync::CancellationToken;

/// The runtimes a TCP listener accepts on: one socket each. Cheap to clone.
#[derive(Clone, Default, Debug)]
pub struct Workers {
    /// Empty: the runtime that starts the listener (work stealing, tests).
    runtimes: Arc<[Handle]>,
}

impl Workers {
    /// Accept on the runtime that starts the listener, with one socket.
    pub fn here() -> Self {
        Self::default()
    }

    /// How many sockets each TCP listener binds: one per runtime.
    pub fn sockets_per_listener(&self) -> usize {
        self.runtimes.len().max(1)
    }

    /// The runtime of socket `i` (0..[`Self::sockets_per_listener`]).
    /// Call from inside a runtime: `here` means that one.
    pub fn runtime(&self, i: usize) -> Handle {
        match self.runtimes.get(i) {
            Some(h) => h.clone(),
            None => Handle::current(),
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
            runtimes: all.into(),
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

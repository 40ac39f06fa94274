//! The real `harvester-lb` binary as a child process: for what only a
//! process shows (signals, exit codes, its threads, its log, a network
//! namespace, an open-file limit). One type for every test crate, so each
//! start, readiness wait, signal and kill is written once.
//!
//! Its stdout and stderr go to a log file (in the config's directory unless
//! the test names one), which a failing wait prints; [`Process::lines`]
//! reads it back for tests that assert log lines. The child is killed and
//! reaped when the [`Process`] is dropped, so a failing test leaves nothing
//! running.
//!
//! The daemon logs through a queue to a writer thread of its own (logging
//! never blocks forwarding), so a line logged before a change the test saw
//! in `/status` or `/metrics` may reach the file after it. A test that
//! asserts a line is there waits for it: [`Process::wait_log`] and its
//! kin, never a bare read of [`Process::log`].

use std::ffi::{OsStr, OsString};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use super::{http_blocking, wait_for};

/// How long a daemon may take to answer `/readyz` 200 after it is spawned.
const READY_WITHIN: Duration = Duration::from_secs(20);

/// How long a line logged before what a test saw may take to reach the
/// log file through the daemon's log queue (generous: CI is a busy 2-core
/// machine).
const LOGGED_WITHIN: Duration = Duration::from_secs(10);

static LOGS: AtomicU32 = AtomicU32::new(0);

/// How to start the binary: `[under...] harvester-lb [global...] run
/// --no-watch --config CONFIG [args...]`. Made by [`Process::launch`].
#[must_use = "a launch does nothing until spawned"]
pub struct Launch {
    config: PathBuf,
    under: Vec<OsString>,
    global: Vec<OsString>,
    args: Vec<OsString>,
    env: Vec<(OsString, OsString)>,
    watch: bool,
    nofile: Option<u64>,
    log: Option<PathBuf>,
    stderr: Option<Stdio>,
    /// Descriptors the child gets at 3, 4, ... (as systemd passes them).
    fds: Vec<std::os::fd::OwnedFd>,
}

impl Launch {
    /// Arguments after `run ... --config CONFIG` (`--threads 1`...).
    pub fn args(mut self, args: &[&str]) -> Self {
        self.args.extend(args.iter().map(OsString::from));
        self
    }

    /// Arguments before `run` (`--log-format json`).
    pub fn global_args(mut self, args: &[&str]) -> Self {
        self.global.extend(args.iter().map(OsString::from));
        self
    }

    /// Runs the binary under a command that execs it (`prlimit ...`,
    /// `ip netns exec NS`), so the child's pid is the daemon's.
    pub fn under(mut self, command: &[&str]) -> Self {
        self.under.extend(command.iter().map(OsString::from));
        self
    }

    /// An environment variable for the child.
    pub fn env(mut self, key: &str, value: impl AsRef<OsStr>) -> Self {
        self.env
            .push((OsString::from(key), value.as_ref().to_os_string()));
        self
    }

    /// Lets the daemon watch its file (without `--no-watch`).
    pub fn watch(mut self) -> Self {
        self.watch = true;
        self
    }

    /// Sets the child's open-file limit, soft and hard, to `n`.
    pub fn nofile(mut self, n: u64) -> Self {
        self.nofile = Some(n);
        self
    }

    /// Sends the child's stderr (its log) to `to` instead of the log file,
    /// e.g. a pipe the test holds and reads when it chooses.
    pub fn stderr(mut self, to: impl Into<Stdio>) -> Self {
        self.stderr = Some(to.into());
        self
    }

    /// Gives the child `fds` at descriptors 3, 4, ... in this order, as
    /// systemd passes `LISTEN_FDS` (the names and `LISTEN_PID` are the
    /// caller's: see `support::fd_store`).
    pub fn fds(mut self, fds: Vec<std::os::fd::OwnedFd>) -> Self {
        self.fds = fds;
        self
    }

    /// Writes the child's output to `path` instead of a new file beside the config.
    pub fn log(mut self, path: &Path) -> Self {
        self.log = Some(path.to_path_buf());
        self
    }

    /// Starts the child.
    pub fn spawn(self) -> Process {
        use std::os::unix::process::CommandExt;
        let bin = OsStr::new(env!("CARGO_BIN_EXE_harvester-lb"));
        let log = self.log.unwrap_or_else(|| {
            let dir = self.config.parent().expect("the config is in a directory");
            dir.join(format!(
                "harvester-lb-{}.log",
                LOGS.fetch_add(1, Ordering::Relaxed)
            ))
        });
        let file = std::fs::File::create(&log)
            .unwrap_or_else(|e| panic!("create daemon log {}: {e}", log.display()));
        let mut c = match self.under.split_first() {
            Some((first, rest)) => {
                let mut c = Command::new(first);
                c.args(rest).arg(bin);
                c
            }
            None => Command::new(bin),
        };
        c.args(&self.global).arg("run");
        if !self.watch {
            c.arg("--no-watch");
        }
        c.arg("--config")
            .arg(&self.config)
            .args(&self.args)
            .envs(self.env)
            .stdin(Stdio::null())
            .stdout(file.try_clone().expect("dup daemon log"))
            .stderr(self.stderr.unwrap_or_else(|| file.into()));
        if let Some(n) = self.nofile {
            // SAFETY: setrlimit is async-signal-safe and touches only the
            // child between fork and exec.
            unsafe {
                c.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: n,
                        rlim_max: n,
                    };
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
        if !self.fds.is_empty() {
            use std::os::fd::AsRawFd;
            let raw: Vec<i32> = self.fds.iter().map(AsRawFd::as_raw_fd).collect();
            let mut moved = vec![0i32; raw.len()];
            // Above every target, so no dup2 below overwrites a source.
            let above = 3 + raw.len() as i32 + 64;
            // SAFETY: fcntl, dup2 and close are async-signal-safe; the
            // closure allocates nothing (both vectors exist before fork).
            unsafe {
                c.pre_exec(move || {
                    for (i, fd) in raw.iter().enumerate() {
                        moved[i] = libc::fcntl(*fd, libc::F_DUPFD_CLOEXEC, above);
                        if moved[i] < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                    }
                    for (i, fd) in moved.iter().enumerate() {
                        // dup2 leaves the new descriptor without CLOEXEC.
                        if libc::dup2(*fd, 3 + i as i32) < 0 {
                            return Err(std::io::Error::last_os_error());
                        }
                        libc::close(*fd);
                    }
                    Ok(())
                });
            }
        }
        let child = c
            .spawn()
            .unwrap_or_else(|e| panic!("spawn harvester-lb: {e}"));
        Process { child, log }
    }
}

/// The running binary; killed and reaped when dropped.
pub struct Process {
    child: Child,
    log: PathBuf,
}

impl Process {
    /// Starts `harvester-lb run --no-watch --config CONFIG ARGS`.
    pub fn start(config: &Path, args: &[&str]) -> Self {
        Self::launch(config).args(args).spawn()
    }

    /// A start to set up further (environment, flags, a command to run under).
    pub fn launch(config: &Path) -> Launch {
        Launch {
            config: config.to_path_buf(),
            under: Vec::new(),
            global: Vec::new(),
            args: Vec::new(),
            env: Vec::new(),
            watch: false,
            nofile: None,
            log: None,
            stderr: None,
            fds: Vec::new(),
        }
    }

    /// Its pid.
    pub fn pid(&self) -> i32 {
        i32::try_from(self.child.id()).expect("a pid fits in i32")
    }

    /// Sends `sig` to it.
    pub fn signal(&self, sig: i32) {
        // SAFETY: kill(2) touches no memory of ours; the pid is our own
        // child, not reaped before Drop, so it names no other process.
        let rc = unsafe { libc::kill(self.pid(), sig) };
        assert_eq!(
            rc,
            0,
            "kill({}, {sig}): {}",
            self.pid(),
            std::io::Error::last_os_error()
        );
    }

    /// Its exit status, if it has exited.
    pub fn exited(&mut self) -> Option<ExitStatus> {
        self.child.try_wait().expect("try_wait")
    }

    /// Whether it still runs.
    pub fn alive(&mut self) -> bool {
        self.exited().is_none()
    }

    /// Its exit status once it exits, polled up to `within`; `None` if it runs on.
    pub async fn wait_exit(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = tokio::time::Instant::now() + within;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if tokio::time::Instant::now() >= deadline {
                return None;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// As [`Process::wait_exit`], for tests without a runtime.
    pub fn wait_exit_blocking(&mut self, within: Duration) -> Option<ExitStatus> {
        let deadline = std::time::Instant::now() + within;
        loop {
            if let Some(s) = self.exited() {
                return Some(s);
            }
            if std::time::Instant::now() >= deadline {
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Its exit code (-1 for a signal), once it exits within `within`;
    /// panics with its log otherwise.
    pub async fn exit_code(&mut self, within: Duration) -> i32 {
        match self.wait_exit(within).await {
            Some(s) => s.code().unwrap_or(-1),
            None => panic!(
                "harvester-lb did not exit within {within:?}; log:\n{}",
                self.log_tail(40)
            ),
        }
    }

    /// Waits until `/readyz` on `admin` answers 200; panics with the log
    /// if the process exits first or is not ready in time.
    pub async fn wait_ready(&mut self, admin: SocketAddr) {
        let deadline = tokio::time::Instant::now() + READY_WITHIN;
        loop {
            let ready = tokio::task::spawn_blocking(move || http_blocking(admin, "/readyz"))
                .await
                .expect("readiness probe thread");
            if matches!(ready, Ok((200, _))) {
                return;
            }
            self.assert_starting(admin, tokio::time::Instant::now() < deadline);
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// As [`Process::wait_ready`], for tests without a runtime.
    pub fn wait_ready_blocking(&mut self, admin: SocketAddr) {
        let deadline = std::time::Instant::now() + READY_WITHIN;
        loop {
            if matches!(http_blocking(admin, "/readyz"), Ok((200, _))) {
                return;
            }
            self.assert_starting(admin, std::time::Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Panics, with the log, when it has exited or `in_time` is false.
    fn assert_starting(&mut self, admin: SocketAddr, in_time: bool) {
        if let Some(status) = self.exited() {
            panic!(
                "harvester-lb exited ({status}) before {admin}/readyz answered 200; log:\n{}",
                self.log_tail(40)
            );
        }
        assert!(
            in_time,
            "harvester-lb not ready on {admin} within {READY_WITHIN:?}; log:\n{}",
            self.log_tail(40)
        );
    }

    /// Its whole output so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// The complete lines of its output so far (a line still being written is left out).
    pub fn lines(&self) -> Vec<String> {
        let text = self.log();
        let complete = match text.rfind('\n') {
            Some(end) => &text[..end],
            None => "",
        };
        complete.lines().map(str::to_string).collect()
    }

    /// The last `n` lines of its output.
    pub fn log_tail(&self, n: usize) -> String {
        let text = self.log();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Its complete lines so far as one text (a line still being written
    /// is left out), for a predicate that must not see half a line.
    fn complete_log(&self) -> String {
        let mut text = self.log();
        text.truncate(text.rfind('\n').map_or(0, |end| end + 1));
        text
    }

    /// Panics, saying what was awaited, with the log's tail.
    fn not_logged(&self, what: &str) -> ! {
        panic!(
            "the log did not show {what} within {LOGGED_WITHIN:?}; its last lines:\n{}",
            self.log_tail(40)
        )
    }

    /// Waits, up to [`LOGGED_WITHIN`], until its complete lines satisfy
    /// `holds`, and returns them; panics with `what` and the log's tail
    /// otherwise. For every assertion that a line *is* logged: the line
    /// may still be in the daemon's log queue when the test sees its effect.
    pub async fn wait_log(&self, what: &str, holds: impl Fn(&str) -> bool) -> String {
        let deadline = tokio::time::Instant::now() + LOGGED_WITHIN;
        loop {
            let text = self.complete_log();
            if holds(&text) {
                return text;
            }
            if tokio::time::Instant::now() >= deadline {
                self.not_logged(what);
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// As [`Process::wait_log`], for tests without a runtime.
    pub fn wait_log_blocking(&self, what: &str, holds: impl Fn(&str) -> bool) -> String {
        let deadline = std::time::Instant::now() + LOGGED_WITHIN;
        loop {
            let text = self.complete_log();
            if holds(&text) {
                return text;
            }
            if std::time::Instant::now() >= deadline {
                self.not_logged(what);
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// Waits until its log holds `needle`, and returns the log.
    pub async fn wait_logged(&self, needle: &str) -> String {
        self.wait_log(&format!("{needle:?}"), |log| log.contains(needle))
            .await
    }

    /// As [`Process::wait_logged`], for tests without a runtime.
    pub fn wait_logged_blocking(&self, needle: &str) -> String {
        self.wait_log_blocking(&format!("{needle:?}"), |log| log.contains(needle))
    }

    /// Waits until its log holds `needle` `n` times, then asserts it holds
    /// it no more often; returns the log. A count read at once could miss
    /// a line still queued; one read after waiting still catches extras.
    pub fn wait_logged_times_blocking(&self, needle: &str, n: usize) -> String {
        let log = self.wait_log_blocking(&format!("{needle:?} {n} times"), |log| {
            log.matches(needle).count() >= n
        });
        assert_logged_times(&log, needle, n);
        log
    }

    /// Waits for a line holding every one of `words`, and returns it.
    pub async fn line_with(&self, words: &[&str], within: Duration) -> String {
        wait_for(within, &format!("a log line with {words:?}"), || async {
            self.lines()
                .into_iter()
                .find(|l| words.iter().all(|w| l.contains(w)))
        })
        .await
    }

    /// Its resident memory, in KiB.
    pub fn rss_kib(&self) -> u64 {
        proc_rss_kib(self.pid())
    }

    /// Its open descriptors.
    pub fn open_fds(&self) -> usize {
        std::fs::read_dir(format!("/proc/{}/fd", self.pid()))
            .map(|d| d.count())
            .unwrap_or(0)
    }
}

/// Asserts `log` holds `needle` exactly `n` times (after a wait for `n`).
fn assert_logged_times(log: &str, needle: &str, n: usize) {
    let seen = log.matches(needle).count();
    assert_eq!(seen, n, "{needle:?} logged {seen} times, not {n}:\n{log}");
}

/// CPU time (user + system) of process `pid`.
pub fn proc_cpu_time(pid: i32) -> Duration {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
    // Fields after the command's closing parenthesis; utime and stime are 14 and 15.
    let after = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = after.split_whitespace().collect();
    let ticks: u64 = f.get(11).and_then(|v| v.parse().ok()).unwrap_or(0)
        + f.get(12).and_then(|v| v.parse().ok()).unwrap_or(0);
    // SAFETY: sysconf has no preconditions.
    let hz = unsafe { libc::sysconf(libc::_SC_CLK_TCK) }.max(1) as u64;
    Duration::from_millis(ticks * 1000 / hz)
}

/// Resident memory of process `pid`, in KiB.
pub fn proc_rss_kib(pid: i32) -> u64 {
    proc_status_number(pid, "VmRSS:")
}

/// Threads of process `pid`: each thread that allocates costs the daemon's
/// allocator a heap of its own, so a memory figure means little without it.
pub fn proc_threads(pid: i32) -> u64 {
    proc_status_number(pid, "Threads:")
}

/// The number after `field` in `/proc/PID/status`.
fn proc_status_number(pid: i32, field: &str) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    status
        .lines()
        .find_map(|l| l.strip_prefix(field))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no {field} in /proc/{pid}/status: has it exited?"))
}

impl Drop for Process {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

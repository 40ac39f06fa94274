//! Where the daemon's log lines go: a bounded queue in memory and a thread
//! of its own that writes them to stderr, so that no forwarding thread and
//! no admin request ever waits for the reader of stderr.
//!
//! stderr is a pipe to journald (or whatever runs the daemon). A pipe holds
//! 64 KiB; when its reader falls behind or stops, a write to it blocks. Log
//! lines used to be written on the runtime's own threads, so with one load
//! balancer on `log_connections = "all"` about 176 connection lines filled
//! the pipe and every thread that logged stopped there: new connections to
//! every tenant timed out and `/healthz` stopped answering.
//!
//! Now a line is formatted on the thread that logs it and handed to the
//! queue without waiting ([`tracing_appender::non_blocking()`], lossy); the
//! writer thread (`harvester-lb-log`) is the only one that ever blocks on
//! stderr. When the queue is full the line is dropped and counted
//! (`harvester_lb_log_lines_dropped_total`, [`lines_dropped`]); so is a line
//! the writer could not write (stderr closed). When the writer next empties
//! the queue it logs once how many lines were lost since it last said so:
//! the journal shows the gap instead of hiding it.
//!
//! What this module must never do: block the thread that logs, or lose the
//! lines of a clean exit. [`queue_to_stderr`] returns a [`Flush`] that
//! `main` holds; dropping it (or [`flush`], before `std::process::exit`)
//! writes what is queued, waiting at most about a second for a stalled
//! reader, so a start-up error still reaches stderr before the exit code.
//!
//! Only `harvester-lb run` logs through the queue; the other commands print
//! their output directly and exit at once.
//!
//! Under systemd (`JOURNAL_STREAM` names stderr's device and inode) every
//! line starts with its syslog priority as `sd-daemon(3)` spells it (`<3>`
//! error, `<4>` warning, `<6>` info, `<7>` debug and trace): the journal
//! strips the prefix and stores the line at that priority, so
//! `journalctl -u harvester-lb -p warning` shows the warnings and errors
//! ([`Prioritized`]).
//!
//! `run`'s text format under systemd goes further: each event is written
//! in the journal's native protocol ([`JournalFormat`],
//! `systemd.journal-fields(7)`) to the journal's socket, by the same queue
//! and writer thread, so the journal stores `PRIORITY` (as the prefixes
//! above), a `MESSAGE` without the daemon's own timestamp and level (the
//! journal has both), and every field of the event as a field of its own
//! (`LOAD_BALANCER`, `LISTENER`, `CLUSTER`, `BACKEND`, ...), for
//! `journalctl LOAD_BALANCER=default/web`. Not `tracing-journald`: its
//! layer sends on the thread that logs, over a blocking socket whose
//! queue (`net.unix.max_dgram_qlen`, 512 by default) a stalled journald
//! fills, which would stop forwarding as the full pipe once did. When the
//! socket cannot be opened, lines go to stderr with their prefixes as
//! before. JSON (`--log-format json`) stays JSON lines on stderr.

use std::io::{self, Write};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};

use tracing::Level;
use tracing_appender::non_blocking::{ErrorCounter, NonBlocking, NonBlockingBuilder, WorkerGuard};
use tracing_subscriber::fmt::FmtContext;
use tracing_subscriber::fmt::format::{FormatEvent, FormatFields, Writer};
use tracing_subscriber::registry::LookupSpan;

/// Lines the queue holds while stderr is not read: 4 s of the connection
/// log at its default bound (`log.max_connection_lines_per_second` = 1000),
/// about 2 MB of JSON lines at most.
pub const QUEUE_LINES: usize = 4096;

/// The name of the writer thread (`ps -T`, `/proc/PID/task/*/comm`).
pub const THREAD_NAME: &str = "harvester-lb-log";

/// Lines the queue was too full to take (the appender's own count).
static QUEUE_FULL: OnceLock<ErrorCounter> = OnceLock::new();
/// Lines the writer took from the queue but could not write (stderr closed
/// or failing).
static WRITE_FAILED: AtomicU64 = AtomicU64::new(0);
/// The writer thread's guard: dropping it writes what is queued and ends it.
static GUARD: Mutex<Option<WorkerGuard>> = Mutex::new(None);

/// Log lines lost since the start: dropped because the queue was full, or
/// not written because stderr failed (`harvester_lb_log_lines_dropped_total`).
/// 0 when the process logs without the queue (tests, the other commands).
pub fn lines_dropped() -> u64 {
    let full = QUEUE_FULL
        .get()
        .map_or(0, |c| u64::try_from(c.dropped_lines()).unwrap_or(u64::MAX));
    full.saturating_add(WRITE_FAILED.load(Ordering::Relaxed))
}

/// Starts the writer thread and returns where `tracing` should write (a
/// handle that queues each line) and the [`Flush`] that `main` must keep
/// until it returns. Call once; a second call gets a queue of its own, but
/// [`lines_dropped`] counts only the first's full queue.
pub fn queue_to_stderr() -> (NonBlocking, Flush) {
    queue_to(io::stderr())
}

/// [`queue_to_stderr`], to the journal's socket at `socket`: each entry
/// the queue takes (one [`JournalFormat`] event) is one datagram. `None`
/// when the socket cannot be reached.
pub fn queue_to_journal(socket: &Path) -> Option<(NonBlocking, Flush)> {
    let datagram = std::os::unix::net::UnixDatagram::unbound().ok()?;
    datagram.connect(socket).ok()?;
    Some(queue_to(JournalSocket {
        socket: datagram,
        path: socket.to_path_buf(),
    }))
}

fn queue_to<W: Write + Send + 'static>(inner: W) -> (NonBlocking, Flush) {
    let (writer, guard) = NonBlockingBuilder::default()
        .buffered_lines_limit(QUEUE_LINES)
        .lossy(true)
        .thread_name(THREAD_NAME)
        .finish(Reporting::new(inner));
    // A second call's counter is not exported; the first stays.
    QUEUE_FULL.get_or_init(|| writer.error_counter());
    *GUARD.lock().unwrap_or_else(|e| e.into_inner()) = Some(guard);
    (writer, Flush(()))
}

/// Writes what is queued and stops the writer thread; waits about a
/// second at most (the appender's bound) when stderr is not read. Lines
/// logged after it are counted as dropped. For the paths that leave by
/// `std::process::exit`, which drops nothing.
pub fn flush() {
    let guard = GUARD.lock().unwrap_or_else(|e| e.into_inner()).take();
    drop(guard);
}

/// Held by `main` for the whole run: dropping it [`flush`]es the queue.
#[must_use = "dropping it at once stops the log writer"]
pub struct Flush(());

impl Drop for Flush {
    fn drop(&mut self) {
        flush();
    }
}

/// Whether stderr is the journal's stream: `JOURNAL_STREAM` (set by
/// systemd for a service whose output goes to the journal) names stderr's
/// device and inode. A child that inherited the variable but not the
/// stream (stderr redirected to a file) gets no prefixes.
pub fn stderr_is_journal() -> bool {
    use std::os::fd::AsFd;
    use std::os::unix::fs::MetadataExt;
    let Some(stream) = std::env::var_os("JOURNAL_STREAM") else {
        return false;
    };
    let Some(stream) = stream.to_str() else {
        return false;
    };
    let Ok(fd) = io::stderr().as_fd().try_clone_to_owned() else {
        return false;
    };
    std::fs::File::from(fd)
        .metadata()
        .is_ok_and(|m| names_stream(stream, m.dev(), m.ino()))
}

/// Whether a `JOURNAL_STREAM` value (`DEVICE:INODE`, decimal) names this
/// device and inode.
fn names_stream(journal_stream: &str, dev: u64, ino: u64) -> bool {
    journal_stream
        .split_once(':')
        .and_then(|(d, i)| Some((d.parse::<u64>().ok()?, i.parse::<u64>().ok()?)))
        == Some((dev, ino))
}

/// The syslog priority of a level, as the journal reads it from a `<N>`
/// prefix: error 3, warning 4, info 6, debug and trace 7.
pub fn priority(level: &Level) -> u8 {
    match *level {
        Level::ERROR => 3,
        Level::WARN => 4,
        Level::INFO => 6,
        _ => 7,
    }
}

/// Prints `text` on stderr as a message of `priority` (3 error, 4
/// warning): under systemd each of its lines starts with `<N>`, so the
/// output of the unit's short commands (`ExecReload=`'s `reload`,
/// `ExecStopPost=`'s `withdraw`) reaches the journal at its priority too.
pub fn eprint_at(priority: u8, text: &str) {
    eprint!(
        "{}",
        at_priority(stderr_is_journal().then_some(priority), text)
    );
}

/// `text` with `<N>` before each line when `priority` is given, ending in
/// a newline.
fn at_priority(priority: Option<u8>, text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 8);
    for line in text.lines() {
        if let Some(p) = priority {
            out.push_str(&format!("<{p}>"));
        }
        out.push_str(line);
        out.push('\n');
    }
    out
}

/// An event format that, when `journal` is set, starts each line with its
/// [`priority`] as `<N>`, then writes it as `inner` does. Lines are one
/// line each (the text format escapes control characters, JSON escapes
/// newlines), so one prefix covers the whole message.
pub struct Prioritized<E> {
    /// The format of the line itself (text or JSON).
    pub inner: E,
    /// Whether to prefix: [`stderr_is_journal`].
    pub journal: bool,
}

impl<S, N, E> FormatEvent<S, N> for Prioritized<E>
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
    E: FormatEvent<S, N>,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        if self.journal {
            write!(writer, "<{}>", priority(event.metadata().level()))?;
        }
        self.inner.format_event(ctx, writer, event)
    }
}

/// Where the journal's native socket is (`sd_journal_print(3)` writes
/// there); `HARVESTER_LB_JOURNAL_SOCKET` names another (tests).
pub fn journal_socket() -> PathBuf {
    std::env::var_os("HARVESTER_LB_JOURNAL_SOCKET")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("/run/systemd/journal/socket"))
}

/// The journal's socket as the writer thread's output: each write is one
/// whole entry, sent as one datagram.
struct JournalSocket {
    socket: std::os::unix::net::UnixDatagram,
    /// Where it is: a restarted journald makes the socket anew, and a
    /// send that fails connects to the new one and tries once more.
    path: PathBuf,
}

impl Write for JournalSocket {
    fn write(&mut self, entry: &[u8]) -> io::Result<usize> {
        match self.socket.send(entry) {
            Ok(n) => Ok(n),
            Err(_) => {
                self.socket.connect(&self.path)?;
                self.socket.send(entry)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// An event in the journal's native protocol: `PRIORITY` (as
/// [`priority`]), `SYSLOG_IDENTIFIER`, `TARGET`, `MESSAGE` (the message
/// and the fields as the text format writes them, without timestamp or
/// level), and each field of the event as a journal field named in upper
/// case (`load_balancer` -> `LOAD_BALANCER`) holding its value. Control
/// characters are escaped everywhere (a name from a guest cluster's
/// objects cannot add a field or an entry).
pub struct JournalFormat;

impl<S, N> FormatEvent<S, N> for JournalFormat
where
    S: tracing::Subscriber + for<'a> LookupSpan<'a>,
    N: for<'w> FormatFields<'w> + 'static,
{
    fn format_event(
        &self,
        _ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &tracing::Event<'_>,
    ) -> std::fmt::Result {
        let mut fields = Fields::default();
        event.record(&mut fields);
        let meta = event.metadata();
        let mut message = fields.message;
        for (name, shown, _) in &fields.others {
            message.push(' ');
            message.push_str(name);
            message.push('=');
            message.push_str(shown);
        }
        journal_field(&mut writer, "PRIORITY", &priority(meta.level()).to_string())?;
        journal_field(&mut writer, "SYSLOG_IDENTIFIER", "harvester-lb")?;
        journal_field(&mut writer, "TARGET", meta.target())?;
        journal_field(&mut writer, "MESSAGE", &message)?;
        for (name, _, raw) in &fields.others {
            journal_field(&mut writer, &journal_name(name), raw)?;
        }
        Ok(())
    }
}

/// An event's message and its other fields: name, the value as the text
/// format shows it (strings quoted), and the value itself.
#[derive(Default)]
struct Fields {
    message: String,
    others: Vec<(&'static str, String, String)>,
}

impl tracing::field::Visit for Fields {
    fn record_str(&mut self, field: &tracing::field::Field, value: &str) {
        if field.name() == "message" {
            self.message = value.to_string();
        } else {
            self.others
                .push((field.name(), format!("{value:?}"), value.to_string()));
        }
    }

    fn record_debug(&mut self, field: &tracing::field::Field, value: &dyn std::fmt::Debug) {
        let shown = format!("{value:?}");
        if field.name() == "message" {
            self.message = shown;
        } else {
            self.others.push((field.name(), shown.clone(), shown));
        }
    }
}

/// A journal field name from a `tracing` one: upper case, `_` for anything
/// but ASCII letters and digits, and `F_` before one this format writes
/// itself (`MESSAGE`, `PRIORITY`, ...) or that does not start with a letter
/// (the journal reserves a leading `_`).
fn journal_name(name: &str) -> String {
    let upper: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() {
                c.to_ascii_uppercase()
            } else {
                '_'
            }
        })
        .take(60)
        .collect();
    let written = ["MESSAGE", "PRIORITY", "SYSLOG_IDENTIFIER", "TARGET"];
    if written.contains(&upper.as_str()) || !upper.starts_with(|c: char| c.is_ascii_alphabetic()) {
        format!("F_{upper}")
    } else {
        upper
    }
}

/// One `NAME=value` line of an entry, the value's control characters
/// escaped (so it stays one line of the protocol's text form).
fn journal_field(out: &mut impl std::fmt::Write, name: &str, value: &str) -> std::fmt::Result {
    out.write_str(name)?;
    out.write_char('=')?;
    crate::text::write_controls_escaped(out, value)?;
    out.write_char('\n')
}

/// The writer thread's end of the queue: writes each line to `inner`,
/// counts the ones it cannot write, and when the queue is empty again
/// (the appender flushes after each run of lines) logs once how many were
/// lost since it last said so.
struct Reporting<W> {
    inner: W,
    /// [`lines_dropped`] when it was last reported.
    reported: u64,
    /// Where the count comes from (a function, so a test can feed one).
    dropped: fn() -> u64,
}

impl<W: Write> Reporting<W> {
    fn new(inner: W) -> Self {
        Self {
            inner,
            reported: 0,
            dropped: lines_dropped,
        }
    }

    /// The lines lost since the last report, if any; marks them reported.
    fn unreported(&mut self) -> Option<u64> {
        let now = (self.dropped)();
        let new = now.checked_sub(self.reported).filter(|n| *n > 0)?;
        self.reported = now;
        Some(new)
    }
}

impl<W: Write> Write for Reporting<W> {
    /// One whole line: the appender hands over each line in one call.
    fn write(&mut self, line: &[u8]) -> io::Result<usize> {
        match self.inner.write_all(line) {
            Ok(()) => Ok(line.len()),
            Err(e) => {
                WRITE_FAILED.fetch_add(1, Ordering::Relaxed);
                Err(e)
            }
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()?;
        if let Some(n) = self.unreported() {
            // Through `tracing`, so it has the run's format; it goes to
            // the queue this thread has just emptied, never blocking.
            tracing::warn!(
                dropped = n,
                total = (self.dropped)(),
                "{n} log lines dropped while stderr was not being read"
            );
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The drop count [`fed`] gives.
    static FED: AtomicU64 = AtomicU64::new(0);

    fn fed() -> u64 {
        FED.load(Ordering::Relaxed)
    }

    /// A writer that fails while `broken`.
    struct Flaky {
        out: Vec<u8>,
        broken: bool,
    }

    impl Write for Flaky {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            if self.broken {
                return Err(io::Error::from(io::ErrorKind::BrokenPipe));
            }
            self.out.extend_from_slice(buf);
            Ok(buf.len())
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn journal_stream_must_name_the_very_device_and_inode() {
        assert!(names_stream("64768:123", 64768, 123));
        assert!(!names_stream("64768:124", 64768, 123), "another inode");
        assert!(!names_stream("1:123", 64768, 123), "another device");
        assert!(!names_stream("", 64768, 123));
        assert!(!names_stream("64768", 64768, 123));
        assert!(!names_stream("64768:123:9", 64768, 123));
    }

    #[test]
    fn every_line_of_a_command_message_carries_the_priority() {
        assert_eq!(
            at_priority(Some(3), "config is invalid (2 problems):\n  a\n  b"),
            "<3>config is invalid (2 problems):\n<3>  a\n<3>  b\n"
        );
        assert_eq!(at_priority(None, "plain\nlines"), "plain\nlines\n");
    }

    #[test]
    fn levels_map_to_the_journals_priorities() {
        assert_eq!(priority(&Level::ERROR), 3);
        assert_eq!(priority(&Level::WARN), 4);
        assert_eq!(priority(&Level::INFO), 6);
        assert_eq!(priority(&Level::DEBUG), 7);
        assert_eq!(priority(&Level::TRACE), 7);
    }

    /// Formats one event of each level with [`Prioritized`] over the text
    /// format, into a buffer.
    fn formatted(journal: bool) -> String {
        use tracing_subscriber::fmt::MakeWriter;
        #[derive(Clone, Default)]
        struct Buf(std::sync::Arc<Mutex<Vec<u8>>>);
        impl Write for Buf {
            fn write(&mut self, b: &[u8]) -> io::Result<usize> {
                self.0.lock().unwrap().extend_from_slice(b);
                Ok(b.len())
            }
            fn flush(&mut self) -> io::Result<()> {
                Ok(())
            }
        }
        impl<'a> MakeWriter<'a> for Buf {
            type Writer = Buf;
            fn make_writer(&'a self) -> Buf {
                self.clone()
            }
        }
        let buf = Buf::default();
        let subscriber = tracing_subscriber::fmt()
            .with_writer(buf.clone())
            .with_ansi(false)
            .with_max_level(Level::DEBUG)
            .event_format(Prioritized {
                inner: tracing_subscriber::fmt::format().without_time(),
                journal,
            })
            .finish();
        tracing::subscriber::with_default(subscriber, || {
            tracing::error!("e");
            tracing::warn!("w");
            tracing::info!("i");
            tracing::debug!("d");
        });
        String::from_utf8(buf.0.lock().unwrap().clone()).unwrap()
    }

    #[test]
    fn each_line_carries_its_priority_only_on_the_journal() {
        let lines: Vec<String> = formatted(true).lines().map(String::from).collect();
        assert_eq!(lines.len(), 4, "{lines:?}");
        for (line, want) in lines.iter().zip(["<3>", "<4>", "<6>", "<7>"]) {
            assert!(line.starts_with(want), "{line:?} should start with {want}");
        }
        let plain = formatted(false);
        assert!(!plain.contains('<'), "no prefix off the journal: {plain:?}");
        assert_eq!(plain.lines().count(), 4);
    }

    #[test]
    fn journal_fields_are_named_in_upper_case_and_stay_one_line() {
        assert_eq!(journal_name("load_balancer"), "LOAD_BALANCER");
        assert_eq!(journal_name("message"), "F_MESSAGE");
        assert_eq!(journal_name("_x"), "F__X");
        assert_eq!(journal_name("a.b-c"), "A_B_C");
        let mut out = String::new();
        journal_field(&mut out, "LOAD_BALANCER", "a\nPRIORITY=0").unwrap();
        assert_eq!(out, "LOAD_BALANCER=a\\nPRIORITY=0\n");
    }

    #[test]
    fn drops_are_reported_once_each() {
        let mut w = Reporting {
            inner: Vec::new(),
            reported: 0,
            dropped: fed,
        };
        assert_eq!(w.unreported(), None, "nothing lost, nothing said");
        FED.store(7, Ordering::Relaxed);
        assert_eq!(w.unreported(), Some(7));
        assert_eq!(w.unreported(), None, "said once");
        FED.store(9, Ordering::Relaxed);
        assert_eq!(w.unreported(), Some(2), "only the ones since");
    }

    #[test]
    fn a_line_that_cannot_be_written_is_counted() {
        let before = WRITE_FAILED.load(Ordering::Relaxed);
        let mut w = Reporting::new(Flaky {
            out: Vec::new(),
            broken: true,
        });
        assert!(w.write_all(b"lost\n").is_err());
        assert_eq!(WRITE_FAILED.load(Ordering::Relaxed), before + 1);
        w.inner.broken = false;
        w.write_all(b"kept\n").unwrap();
        assert_eq!(w.inner.out, b"kept\n");
        assert_eq!(WRITE_FAILED.load(Ordering::Relaxed), before + 1);
    }
}

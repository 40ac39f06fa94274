//! The connection log: one line per client connection (or UDP flow) that
//! says where it went and why it ended, as HAProxy's `tcplog` and nginx's
//! stream access log do.
//!
//! A [`Record`] is filled along the connection's path (backends tried and
//! why each failed, the one that took it, when) and written once, at the
//! end, with one [`Termination`] state from a small fixed table, through
//! `tracing` at target [`TARGET`], so `--log-format` decides text or JSON
//! and journald gets it with the daemon's other messages.
//!
//! What this module must never do: cost a connection anything when its
//! load balancer logs nothing (`log_connections = "none"`: the record is
//! empty, nothing is read from a clock, nothing allocated), or make the
//! forwarder wait. Lines are bounded by one process-wide budget
//! ([`LineBudget`], `log.max_connection_lines_per_second`): past it a line
//! is counted (`harvester_lb_connection_log_lines_dropped_total`) and not
//! written, so a flood of refused clients cannot flood the journal, whose
//! own rate limit would drop the daemon's other messages with them.
//!
//! Names from the config (load balancer, cluster, listener) come from
//! Kubernetes objects a tenant may write. They are written as string fields:
//! the JSON format escapes them, and the text format writes string fields
//! with Rust's `Debug` quoting, so a newline or an escape sequence in a
//! name shows as `\n` or `\u{1b}` inside quotes and cannot forge a line.

use std::fmt;
use std::net::SocketAddr;
use std::sync::OnceLock;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use tokio::time::Instant;

use crate::config::LogConnections;
use crate::metrics::CONNECTION_LOG_LINES_DROPPED;

/// The `tracing` target of every connection line: a filter can keep or
/// silence them alone (`HARVESTER_LB_LOG=info,harvester_lb::connection=off`).
pub const TARGET: &str = "harvester_lb::connection";

/// How a connection or flow ended: one word per line, from this table only
/// (the README's failure section says what the client saw in each case and
/// where to look next).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Termination {
    /// Both sides closed normally (the only state `"errors"` leaves out).
    Closed,
    /// The client reset the connection, or its socket failed.
    ClientReset,
    /// The backend reset the connection, or its socket failed.
    BackendReset,
    /// Nothing moved either way for `idle_timeout_seconds`.
    IdleTimeout,
    /// Closed by the daemon at the end of a drain: its listener or backend
    /// was removed by a reload, or the daemon stopped, and
    /// `proxy.drain_timeout_seconds` ran out.
    Drained,
    /// Reset because the health check marked its backend down
    /// (`on_backend_down = "close"`).
    BackendDown,
    /// Reset at accept: the client is outside `source_ranges`.
    SourceRefused,
    /// Reset at accept: the load balancer had no eligible backend.
    NoBackend,
    /// Refused because a connection cap was reached (the process-wide
    /// `proxy.max_connections` or the load balancer's own).
    ConnectionCap,
    /// Reset after every backend tried failed to connect (see `tried`).
    ConnectFailed,
    /// UDP: the flow ended once its answers came (`udp_responses`).
    Answered,
    /// UDP: the flow ended after `udp_idle_timeout_seconds` of silence.
    Idle,
    /// UDP: no flow could be made, the flow table (or the client's share of
    /// it) is full; the datagram was dropped.
    TableFull,
}

impl Termination {
    /// The word written in the line.
    pub fn as_str(self) -> &'static str {
        match self {
            Termination::Closed => "closed",
            Termination::ClientReset => "client_reset",
            Termination::BackendReset => "backend_reset",
            Termination::IdleTimeout => "idle_timeout",
            Termination::Drained => "drained",
            Termination::BackendDown => "backend_down",
            Termination::SourceRefused => "source_refused",
            Termination::NoBackend => "no_backend",
            Termination::ConnectionCap => "connection_cap",
            Termination::ConnectFailed => "connect_failed",
            Termination::Answered => "answered",
            Termination::Idle => "idle",
            Termination::TableFull => "table_full",
        }
    }

    /// Whether `"errors"` logs it: everything but a normal end.
    fn is_error(self, answered: bool) -> bool {
        match self {
            Termination::Closed | Termination::Answered => false,
            // A UDP flow ends by silence; only one never answered is a problem.
            Termination::Idle => !answered,
            _ => true,
        }
    }
}

impl fmt::Display for Termination {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Why one connect attempt to a backend failed, as the line says it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttemptFailure {
    /// The backend answered with a reset (nothing listens on the nodeport).
    Refused,
    /// No answer within `connect_timeout_ms` (a node that hangs or drops).
    Timeout,
    /// Another error (unreachable network, ...).
    Error,
    /// This process had no socket for it (out of descriptors).
    NoSocket,
    /// Marked down by the health check while connecting (`on_backend_down = "close"`).
    MarkedDown,
}

impl AttemptFailure {
    fn as_str(self) -> &'static str {
        match self {
            AttemptFailure::Refused => "refused",
            AttemptFailure::Timeout => "timeout",
            AttemptFailure::Error => "error",
            AttemptFailure::NoSocket => "no_socket",
            AttemptFailure::MarkedDown => "marked_down",
        }
    }
}

/// What the line of one connection says, filled along its path. Empty
/// (and free) when its load balancer logs nothing.
#[derive(Debug, Default)]
pub struct Record(Option<Inner>);

#[derive(Debug)]
struct Inner {
    mode: LogConnections,
    /// The per-connection debug lines are on ([`debug_on`]): every end
    /// is written, at debug where `mode` would not write it at info.
    debug: bool,
    started: Instant,
    client: SocketAddr,
    /// Backends that failed before the one that took the connection.
    tried: Vec<(SocketAddr, AttemptFailure)>,
    backend: Option<SocketAddr>,
    connect_time: Option<Duration>,
}

/// Where a connection came in: the names of its load balancer, cluster and
/// listener, and the VIP:port.
pub struct Origin<'a> {
    /// The load balancer's name.
    pub load_balancer: &'a str,
    /// Its cluster.
    pub cluster: &'a str,
    /// The listener's name.
    pub listener: &'a str,
    /// The VIP:port the client connected to, if known.
    pub vip: Option<SocketAddr>,
    /// `tcp` or `udp`.
    pub protocol: &'static str,
}

/// The bytes a connection (or a flow's datagrams) moved each way.
#[derive(Debug, Default, Clone, Copy)]
pub struct Bytes {
    /// Client to backend.
    pub client_to_backend: u64,
    /// Backend to client.
    pub backend_to_client: u64,
}

impl Record {
    /// A record for a connection of `client` accepted now, kept only if
    /// `mode` logs anything.
    pub fn start(mode: LogConnections, client: SocketAddr) -> Self {
        let debug = debug_on();
        if mode == LogConnections::None && !debug {
            return Self(None);
        }
        Self(Some(Inner {
            mode,
            debug,
            started: Instant::now(),
            client,
            tried: Vec::new(),
            backend: None,
            connect_time: None,
        }))
    }

    /// Whether the per-connection debug lines are written for this one
    /// (the caller gathers what only they need, the VIP, only then).
    pub fn is_debug(&self) -> bool {
        self.0.as_ref().is_some_and(|r| r.debug)
    }

    /// The debug line of a connection accepted (or a flow made) from
    /// `origin`, when [`is_debug`](Self::is_debug).
    pub fn accepted(&self, origin: &Origin<'_>) {
        let Some(r) = self.0.as_ref().filter(|r| r.debug) else {
            return;
        };
        tracing::debug!(
            target: TARGET,
            protocol = origin.protocol,
            client = %r.client,
            vip = %Shown(origin.vip),
            load_balancer = origin.load_balancer,
            cluster = origin.cluster,
            listener = origin.listener,
            "accepted"
        );
    }

    /// Whether anything is logged for this connection.
    pub fn is_on(&self) -> bool {
        self.0.is_some()
    }

    /// Backend `addr` could not take the connection.
    pub fn failed(&mut self, addr: SocketAddr, why: AttemptFailure) {
        if let Some(r) = &mut self.0 {
            r.tried.push((addr, why));
        }
    }

    /// Backend `addr` took the connection (now).
    pub fn connected(&mut self, addr: SocketAddr) {
        if let Some(r) = &mut self.0 {
            r.backend = Some(addr);
            let connect_time = r.started.elapsed();
            r.connect_time = Some(connect_time);
            if r.debug {
                tracing::debug!(
                    target: TARGET,
                    client = %r.client,
                    backend = %addr,
                    tried = %Tried(&r.tried),
                    connect_ms = connect_time.as_millis() as u64,
                    "backend chosen"
                );
            }
        }
    }

    /// Whether a line is written for an end in `state` (the budget aside):
    /// the caller gathers what only a line needs (the VIP, one system call)
    /// only then. `answered`: for UDP, whether the backend answered at all.
    pub fn wants(&self, state: Termination, answered: bool) -> bool {
        match &self.0 {
            None => false,
            Some(r) => r.debug || r.logs(state, answered),
        }
    }

    /// Writes the line, if [`wants`](Self::wants) says so and the budget
    /// has room; counts it as dropped if not.
    pub fn finish(&self, state: Termination, origin: &Origin<'_>, bytes: Bytes, answered: bool) {
        if !self.wants(state, answered) {
            return;
        }
        let Some(r) = &self.0 else { return };
        // The connection log's line at info, under the budget; otherwise
        // (only the debug lines are on) the same line at debug, which the
        // operator asked for by name and the budget does not cut.
        let info = r.logs(state, answered);
        if info && !BUDGET.take() {
            CONNECTION_LOG_LINES_DROPPED.increment(1);
            return;
        }
        let duration = r.started.elapsed();
        let accepted = SystemTime::now()
            .checked_sub(duration)
            .unwrap_or(UNIX_EPOCH);
        let tried = Tried(&r.tried);
        let backend = Shown(r.backend);
        let vip = Shown(origin.vip);
        let connect_ms = r.connect_time.map_or(-1, |t| t.as_millis() as i64);
        macro_rules! line {
            ($level:ident) => {
                tracing::event!(
                    target: TARGET,
                    tracing::Level::$level,
                    state = %state,
                    protocol = origin.protocol,
                    client = %r.client,
                    vip = %vip,
                    load_balancer = origin.load_balancer,
                    cluster = origin.cluster,
                    listener = origin.listener,
                    backend = %backend,
                    tried = %tried,
                    connect_ms,
                    duration_ms = duration.as_millis() as u64,
                    bytes_from_client = bytes.client_to_backend,
                    bytes_from_backend = bytes.backend_to_client,
                    accepted = %Rfc3339(accepted),
                    "connection"
                )
            };
        }
        if info {
            line!(INFO);
        } else {
            line!(DEBUG);
        }
    }
}

impl Inner {
    /// Whether `mode` logs an end in `state` at info.
    fn logs(&self, state: Termination, answered: bool) -> bool {
        match self.mode {
            LogConnections::None => false,
            LogConnections::All => true,
            LogConnections::Errors => state.is_error(answered),
        }
    }
}

/// Whether the per-connection debug lines are on: `HARVESTER_LB_LOG=debug`
/// (or `harvester_lb::connection=debug`). One look at `tracing`'s cached
/// interest in this call site: off, a connection pays nothing else.
fn debug_on() -> bool {
    tracing::enabled!(target: TARGET, tracing::Level::DEBUG)
}

/// An address, or `-` when there is none (no backend took the connection).
struct Shown(Option<SocketAddr>);

impl fmt::Display for Shown {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self.0 {
            Some(a) => a.fmt(f),
            None => f.write_str("-"),
        }
    }
}

/// The backends tried before the last, in order: `10.0.0.1:30080/refused,10.0.0.2:30080/timeout`;
/// `-` for none.
struct Tried<'a>(&'a [(SocketAddr, AttemptFailure)]);

impl fmt::Display for Tried<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.0.is_empty() {
            return f.write_str("-");
        }
        for (i, (addr, why)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{addr}/{}", why.as_str())?;
        }
        Ok(())
    }
}

/// A time as RFC 3339 in UTC with milliseconds (`2026-11-23T14:02:05.123Z`),
/// the form journald and every log tool read (also the status page's
/// times, `admin::page`).
pub(crate) struct Rfc3339(pub(crate) SystemTime);

impl fmt::Display for Rfc3339 {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let since = self.0.duration_since(UNIX_EPOCH).unwrap_or_default();
        let secs = since.as_secs();
        let (days, rest) = (secs / 86_400, secs % 86_400);
        let (y, m, d) = civil_from_days(days as i64);
        write!(
            f,
            "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}.{:03}Z",
            rest / 3600,
            rest / 60 % 60,
            rest % 60,
            since.subsec_millis()
        )
    }
}

/// The proleptic Gregorian date of a day number since 1970-01-01 (Howard
/// Hinnant's `civil_from_days`).
fn civil_from_days(z: i64) -> (i64, u32, u32) {
    let z = z + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

/// The process-wide bound on connection log lines: a token bucket on
/// tokio's clock as one atomic word (the generic cell rate algorithm), so
/// taking a line is one compare-and-swap and never waits. It lets a burst
/// of one second's worth through, then `rate` a second.
pub struct LineBudget {
    /// Nanoseconds between two lines at the sustained rate.
    interval_ns: AtomicU64,
    /// The theoretical arrival time of the next line, in nanoseconds since
    /// the budget's first use.
    next_ns: AtomicU64,
}

/// The one budget of the process (the bound is process-wide).
static BUDGET: LineBudget = LineBudget::new(1000);

/// Sets the bound of the connection log (`log.max_connection_lines_per_second`);
/// the daemon calls it at every load of the config.
pub fn set_max_lines_per_second(rate: std::num::NonZeroU32) {
    BUDGET.set_rate(rate.get());
}

const SECOND_NS: u64 = 1_000_000_000;

impl LineBudget {
    /// A budget of `rate` lines a second.
    pub const fn new(rate: u32) -> Self {
        Self {
            interval_ns: AtomicU64::new(SECOND_NS / if rate == 0 { 1 } else { rate as u64 }),
            next_ns: AtomicU64::new(0),
        }
    }

    /// Changes the rate; lines already let through stay counted.
    pub fn set_rate(&self, rate: u32) {
        self.interval_ns
            .store(SECOND_NS / u64::from(rate.max(1)), Ordering::Relaxed);
    }

    /// Takes room for one line; `false` when the budget is spent.
    pub fn take(&self) -> bool {
        self.take_at(clock_ns())
    }

    fn take_at(&self, now: u64) -> bool {
        let interval = self.interval_ns.load(Ordering::Relaxed);
        let burst = SECOND_NS.saturating_sub(interval);
        let mut next = self.next_ns.load(Ordering::Relaxed);
        loop {
            let start = next.max(now);
            if start - now > burst {
                return false;
            }
            match self.next_ns.compare_exchange_weak(
                next,
                start + interval,
                Ordering::Relaxed,
                Ordering::Relaxed,
            ) {
                Ok(_) => return true,
                Err(seen) => next = seen,
            }
        }
    }
}

/// Nanoseconds on tokio's clock since the first call.
fn clock_ns() -> u64 {
    static ZERO: OnceLock<Instant> = OnceLock::new();
    ZERO.get_or_init(Instant::now).elapsed().as_nanos() as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_of_one_second_then_the_rate() {
        let b = LineBudget::new(10);
        let taken = (0..100).filter(|_| b.take_at(0)).count();
        assert_eq!(taken, 10, "one second's worth at once");
        assert!(
            !b.take_at(SECOND_NS / 20),
            "nothing more half an interval on"
        );
        assert!(b.take_at(SECOND_NS / 10), "one more an interval later");
        assert!(!b.take_at(SECOND_NS / 10));
        // After a long quiet spell the burst is back, not more.
        let later = 100 * SECOND_NS;
        assert_eq!((0..100).filter(|_| b.take_at(later)).count(), 10);
    }

    #[test]
    fn a_rate_change_applies_to_the_next_line() {
        let b = LineBudget::new(1);
        assert!(b.take_at(0));
        assert!(!b.take_at(0));
        b.set_rate(1000);
        assert!(b.take_at(SECOND_NS));
        assert_eq!((0..2000).filter(|_| b.take_at(SECOND_NS)).count(), 999);
    }

    #[test]
    fn accept_times_are_rfc3339_utc() {
        let t = UNIX_EPOCH + Duration::from_millis(1_795_442_525_123);
        assert_eq!(Rfc3339(t).to_string(), "2026-11-23T14:02:05.123Z");
        assert_eq!(Rfc3339(UNIX_EPOCH).to_string(), "1970-01-01T00:00:00.000Z");
        let leap = UNIX_EPOCH + Duration::from_secs(951_782_400); // 2000-02-29
        assert_eq!(Rfc3339(leap).to_string(), "2000-02-29T00:00:00.000Z");
    }

    #[test]
    fn errors_leave_out_only_normal_ends() {
        assert!(!Termination::Closed.is_error(false));
        assert!(!Termination::Answered.is_error(true));
        assert!(!Termination::Idle.is_error(true));
        assert!(Termination::Idle.is_error(false));
        for s in [
            Termination::ClientReset,
            Termination::BackendReset,
            Termination::IdleTimeout,
            Termination::Drained,
            Termination::BackendDown,
            Termination::SourceRefused,
            Termination::NoBackend,
            Termination::ConnectionCap,
            Termination::ConnectFailed,
            Termination::TableFull,
        ] {
            assert!(s.is_error(true), "{s}");
        }
    }

    #[test]
    fn a_connection_not_logged_keeps_nothing() {
        let mut r = Record::start(LogConnections::None, "127.0.0.1:1".parse().unwrap());
        r.failed("127.0.0.2:2".parse().unwrap(), AttemptFailure::Refused);
        r.connected("127.0.0.3:3".parse().unwrap());
        assert!(!r.is_on());
    }

    #[test]
    fn tried_lists_each_backend_and_why() {
        let list = [
            ("10.0.0.1:30080".parse().unwrap(), AttemptFailure::Refused),
            ("[fd00::2]:30080".parse().unwrap(), AttemptFailure::Timeout),
        ];
        assert_eq!(
            Tried(&list).to_string(),
            "10.0.0.1:30080/refused,[fd00::2]:30080/timeout"
        );
        assert_eq!(Tried(&[]).to_string(), "-");
    }
}

//! The Prometheus text exposition (format 0.0.4), written from the live
//! objects at scrape time, a chunk at a time.
//!
//! A scrape first takes a snapshot of which objects are live (one pointer
//! each, sorted by their labels, so the output is stable and diffable), then
//! writes one family at a time across all of them: every family's samples
//! stay together, as the format requires. The admin server sends each chunk
//! as it is written, so a scrape of 30,000 backends holds a chunk of text in
//! memory, not all of it, and the data plane gets the threads back between
//! chunks.
//!
//! This file holds the steps over load balancers, listeners and backends
//! and the writer; `daemon` writes the daemon-wide families.

use std::fmt::Display;
use std::io::Write;
use std::pin::Pin;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::task::{Context, Poll};

use hyper::body::{Body, Bytes, Frame, SizeHint};

use super::Metrics;
use super::by_label::{ByLabel, Label};
use super::names::{self, Family};
use super::stats::{
    ADMIN_STATES, BackendStats, Counter, DIRECTIONS, Direction, Histogram, IGNORED_REASONS,
    LbStats, ListenerStats, PROBE_BUCKETS, REFUSAL_REASONS,
};

mod daemon;

/// One load balancer's live objects at the start of a scrape.
struct LbSnapshot {
    lb: Arc<LbStats>,
    listeners: Vec<Arc<ListenerStats>>,
    backends: Vec<Arc<BackendStats>>,
}

/// What one step of a scrape writes: one family, over one kind of object.
enum Step {
    /// The daemon-wide families (a handful of lines).
    Daemon,
    Lb(&'static Family, fn(&mut Out<'_>, &LbStats)),
    Listener(&'static Family, fn(&mut Out<'_>, &ListenerStats)),
    Backend(&'static Family, fn(&mut Out<'_>, &BackendStats)),
}

const STEPS: &[Step] = &[
    Step::Daemon,
    Step::Lb(&names::NO_ELIGIBLE_BACKEND, |o, lb| {
        if let Some(v) = lb.no_backend.get() {
            o.sample("", |b| lb_labels(b, lb), u64::from(v));
        }
    }),
    Step::Lb(&names::NO_ELIGIBLE_BACKEND_EVENTS, |o, lb| {
        o.sample("", |b| lb_labels(b, lb), lb.no_backend_events.get());
    }),
    Step::Lb(&names::DHCP_LEASE_STATE, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample(
                "",
                |b| {
                    lb_labels(b, lb);
                    label(b, "state", l.phase_name());
                },
                1,
            );
        }
    }),
    Step::Lb(&names::DHCP_LEASE_INFO, |o, lb| {
        if let Some(l) = lb.lease()
            && let (Some(address), Some(server)) = (l.address(), l.server())
        {
            o.sample(
                "",
                |b| {
                    lb_labels(b, lb);
                    label(b, "address", &address.to_string());
                    label(b, "server", &server.to_string());
                },
                1,
            );
        }
    }),
    Step::Lb(&names::DHCP_LEASE_EXPIRY, |o, lb| {
        if let Some(e) = lb.lease().and_then(|l| l.expiry_unix()) {
            o.sample("", |b| lb_labels(b, lb), e);
        }
    }),
    Step::Lb(&names::DHCP_LEASES_ACQUIRED, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.acquired.get());
        }
    }),
    Step::Lb(&names::DHCP_RENEWALS, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.renewals.get());
        }
    }),
    Step::Lb(&names::DHCP_NAKS, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.naks.get());
        }
    }),
    Step::Lb(&names::DHCP_ADDRESS_CHANGES, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.address_changes.get());
        }
    }),
    Step::Lb(&names::DHCP_PACKETS_IGNORED, |o, lb| {
        if let Some(l) = lb.lease() {
            o.outcomes(&l.ignored, &IGNORED_REASONS, "reason", |b| lb_labels(b, lb));
        }
    }),
    Step::Lb(&names::DHCP_OFFERS_REFUSED, |o, lb| {
        if let Some(l) = lb.lease() {
            o.outcomes(&l.refused, &REFUSAL_REASONS, "reason", |b| lb_labels(b, lb));
        }
    }),
    Step::Lb(&names::DHCP_REPAIRS, |o, lb| {
        if let Some(l) = lb.lease() {
            o.sample("", |b| lb_labels(b, lb), l.repairs.get());
        }
    }),
    Step::Lb(&names::AFFINITY_ENTRIES, |o, lb| {
        if lb.affinity_enabled.load(Ordering::Relaxed) {
            o.sample("", |b| lb_labels(b, lb), lb.affinity_entries.get());
        }
    }),
    Step::Lb(&names::AFFINITY_TABLE_FULL, |o, lb| {
        let full = lb.affinity_full.get();
        if full > 0 {
            o.sample("", |b| lb_labels(b, lb), full);
        }
    }),
    Step::Listener(&names::LISTENER_UP, |o, l| {
        if let Some(v) = l.up.get() {
            o.sample("", |b| listener_labels(b, l), u64::from(v));
        }
    }),
    Step::Listener(&names::CONNECTIONS_ACCEPTED, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.sample("", |b| listener_labels(b, l), l.accepted.get());
    }),
    Step::Listener(&names::CONNECTIONS_FAILED, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.labelled(&l.failed, "reason", |b| listener_labels(b, l));
    }),
    Step::Listener(&names::CONNECTIONS_REJECTED, |o, l| {
        o.labelled(&l.rejected, "reason", |b| listener_labels(b, l));
    }),
    Step::Listener(&names::CONNECTIONS_ACTIVE, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.sample("", |b| listener_labels(b, l), l.active.get());
    }),
    Step::Listener(&names::BYTES, |o, l| {
        if l.udp.get().is_some() {
            return;
        }
        o.directions(l, [&l.client_to_backend, &l.backend_to_client]);
    }),
    Step::Listener(&names::ACCEPT_ERRORS, |o, l| {
        o.labelled(&l.accept_errors, "kind", |b| listener_labels(b, l));
    }),
    Step::Listener(&names::CONNECTION_LIMIT_REACHED, |o, l| {
        if l.limit_reached.get() > 0 {
            o.sample("", |b| listener_labels(b, l), l.limit_reached.get());
        }
    }),
    Step::Listener(&names::UDP_DATAGRAMS, |o, l| {
        if let Some(u) = l.udp.get() {
            o.directions(
                l,
                [
                    &u.datagrams[Direction::ClientToBackend],
                    &u.datagrams[Direction::BackendToClient],
                ],
            );
        }
    }),
    Step::Listener(&names::UDP_BYTES, |o, l| {
        if let Some(u) = l.udp.get() {
            o.directions(
                l,
                [
                    &u.bytes[Direction::ClientToBackend],
                    &u.bytes[Direction::BackendToClient],
                ],
            );
        }
    }),
    Step::Listener(&names::UDP_DATAGRAMS_DROPPED, |o, l| {
        if let Some(u) = l.udp.get() {
            o.labelled(&u.datagrams_dropped, "reason", |b| listener_labels(b, l));
        }
    }),
    Step::Listener(&names::UDP_FLOWS_ACTIVE, |o, l| {
        if let Some(u) = l.udp.get() {
            o.sample("", |b| listener_labels(b, l), u.flows_active.get());
        }
    }),
    Step::Listener(&names::UDP_FLOWS_CREATED, |o, l| {
        if let Some(u) = l.udp.get() {
            o.sample("", |b| listener_labels(b, l), u.flows_created.get());
        }
    }),
    Step::Listener(&names::UDP_FLOWS_DROPPED, |o, l| {
        if let Some(u) = l.udp.get() {
            o.labelled(&u.flows_dropped, "reason", |b| listener_labels(b, l));
        }
    }),
    Step::Listener(&names::UDP_BACKEND_FLOWS_ACTIVE, |o, l| {
        let Some(u) = l.udp.get() else { return };
        for (ip, be) in u.backends() {
            let kernel = be.kernel_flows.load(Ordering::Relaxed);
            let kernel = i64::try_from(kernel).unwrap_or(i64::MAX);
            o.sample(
                "",
                |b| udp_backend_labels(b, l, ip),
                be.flows_active.get().saturating_add(kernel),
            );
        }
    }),
    Step::Listener(&names::UDP_BACKEND_ICMP_ERRORS, |o, l| {
        let Some(u) = l.udp.get() else { return };
        for (ip, be) in u.backends() {
            let n = be.icmp_errors.get();
            if n > 0 {
                o.sample("", |b| udp_backend_labels(b, l, ip), n);
            }
        }
    }),
    Step::Backend(&names::BACKEND_UP, |o, be| {
        if let Some(v) = be.up.get() {
            o.sample("", |b| backend_labels(b, be), u64::from(v));
        }
    }),
    Step::Backend(&names::BACKEND_PORT_UP, |o, be| {
        if let Some(ports) = &*be.ports.load() {
            for p in ports.iter() {
                if let Some(v) = p.up.get() {
                    let port = p.port.to_string();
                    o.sample(
                        "",
                        |b| {
                            backend_labels(b, be);
                            label(b, "backend_port", &port);
                        },
                        u64::from(v),
                    );
                }
            }
        }
    }),
    Step::Backend(&names::BACKEND_CONNECTIONS_ACTIVE, |o, be| {
        // The proxy's open connections and the kernel's, as last counted.
        let kernel = be.kernel_active.load(Ordering::Relaxed);
        let kernel = i64::try_from(kernel).unwrap_or(i64::MAX);
        o.sample(
            "",
            |b| backend_labels(b, be),
            be.active.get().saturating_add(kernel),
        );
    }),
    Step::Backend(&names::BACKEND_CONNECTIONS, |o, be| {
        o.sample("", |b| backend_labels(b, be), be.connections.get());
    }),
    Step::Backend(&names::BACKEND_BYTES, |o, be| {
        o.labelled(&be.bytes, "direction", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::BACKEND_DOWN_SECONDS, |o, be| {
        o.sample("", |b| backend_labels(b, be), be.times.down_seconds());
    }),
    Step::Backend(&names::BACKEND_LAST_CHANGE, |o, be| {
        if let Some(t) = be.times.last_change_unix() {
            o.sample("", |b| backend_labels(b, be), t);
        }
    }),
    Step::Backend(&names::BACKEND_ADMIN_STATE, |o, be| {
        // A state series, present while the backend is a member (as `backend_up`).
        if be.up.get().is_some() {
            let state = ADMIN_STATES
                .get(usize::from(be.admin_state.load(Ordering::Relaxed)))
                .copied()
                .unwrap_or("ready");
            o.sample(
                "",
                |b| {
                    backend_labels(b, be);
                    label(b, "state", state);
                },
                1,
            );
        }
    }),
    Step::Backend(&names::BACKEND_CONNECTIONS_CLOSED, |o, be| {
        o.labelled(&be.closed, "reason", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::BACKEND_CONNECT_FAILURES, |o, be| {
        o.labelled(&be.connect_failures, "reason", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::HEALTH_CHECKS, |o, be| {
        o.labelled(&be.checks, "result", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::HEALTH_TRANSITIONS, |o, be| {
        o.labelled(&be.transitions, "to", |b| backend_labels(b, be));
    }),
    Step::Backend(&names::HEALTH_CHECK_DURATION, |o, be| {
        if let Some(h) = be.duration.get() {
            o.histogram(h, |b| backend_labels(b, be));
        }
    }),
];

/// One scrape in progress.
pub struct Exposition {
    metrics: Arc<Metrics>,
    lbs: Vec<LbSnapshot>,
    /// Index into [`STEPS`].
    step: usize,
    /// Next load balancer of the step.
    next_lb: usize,
    /// Whether the step's family has had its `# HELP`/`# TYPE` lines.
    headed: bool,
    /// `process_open_fds`, counted before the scrape (see
    /// [`Exposition::with_open_fds`]); not exported when unknown.
    open_fds: Option<u64>,
    /// The `process_*` series read with it; not exported when unknown.
    process: Option<crate::os::ProcessStats>,
}

impl Exposition {
    /// A scrape of everything live now.
    pub(crate) fn new(metrics: Arc<Metrics>) -> Self {
        let mut lbs: Vec<LbSnapshot> = metrics
            .live_load_balancers()
            .into_iter()
            .map(|lb| {
                let mut listeners = super::stats::live(&lb.listeners);
                listeners.sort_by(|a, b| a.name.cmp(&b.name));
                let mut backends = super::stats::live(&lb.backends);
                backends.sort_by_key(|b| b.addr);
                LbSnapshot {
                    lb,
                    listeners,
                    backends,
                }
            })
            .collect();
        lbs.sort_by(|a, b| (&a.lb.cluster, &a.lb.name).cmp(&(&b.lb.cluster, &b.lb.name)));
        Self {
            metrics,
            lbs,
            step: 0,
            next_lb: 0,
            headed: false,
            open_fds: None,
            process: None,
        }
    }

    /// Exports `process_open_fds` as `open_fds`. The count is taken by the
    /// caller, off the data plane's threads: on kernels before 6.2 it reads
    /// the whole of `/proc/self/fd` ([`crate::os::open_fds`]).
    pub fn with_open_fds(mut self, open_fds: Option<u64>) -> Self {
        self.open_fds = open_fds;
        self
    }

    /// Exports `process_start_time_seconds`, `process_cpu_seconds_total`
    /// and `process_resident_memory_bytes` from `process`, read by the
    /// caller with the descriptor count ([`crate::os::process_stats`]).
    pub fn with_process(mut self, process: Option<crate::os::ProcessStats>) -> Self {
        self.process = process;
        self
    }

    /// Appends to `buf` until it holds at least `target` bytes or the
    /// exposition is complete. Returns whether anything is left to write.
    pub fn fill(&mut self, buf: &mut Vec<u8>, target: usize) -> bool {
        while self.step < STEPS.len() {
            if buf.len() >= target {
                return true;
            }
            let step = &STEPS[self.step];
            if let Step::Daemon = step {
                self.daemon(buf);
                self.next_step();
                continue;
            }
            let Some(snap) = self.lbs.get(self.next_lb) else {
                self.next_step();
                continue;
            };
            self.next_lb += 1;
            let (family, headed) = (step_family(step), &mut self.headed);
            let mut out = Out {
                buf,
                family,
                headed,
            };
            match step {
                Step::Daemon => {}
                Step::Lb(_, write) => write(&mut out, &snap.lb),
                Step::Listener(_, write) => snap.listeners.iter().for_each(|l| write(&mut out, l)),
                Step::Backend(_, write) => snap.backends.iter().for_each(|b| write(&mut out, b)),
            }
        }
        false
    }

    fn next_step(&mut self) {
        self.step += 1;
        self.next_lb = 0;
        self.headed = false;
    }
}

/// [`gauge`] for the families of other modules.
pub(super) fn gauge_family(buf: &mut Vec<u8>, family: &'static Family, value: impl Display) {
    gauge(buf, family, &value);
}

/// One family with one label, a sample per `(value, count)`.
pub(super) fn labelled_family(
    buf: &mut Vec<u8>,
    family: &'static Family,
    key: &str,
    samples: &[(&str, u64)],
) {
    let mut headed = false;
    let mut out = Out {
        buf,
        family,
        headed: &mut headed,
    };
    for (value, count) in samples {
        out.sample("", |b| label_first(b, key, value), count);
    }
}

/// One sample of a family without labels (a daemon-wide gauge), with its header.
fn gauge(buf: &mut Vec<u8>, family: &'static Family, value: &dyn Display) {
    let mut headed = false;
    Out {
        buf,
        family,
        headed: &mut headed,
    }
    .sample("", |_| {}, value);
}

fn step_family(step: &Step) -> &'static Family {
    match step {
        Step::Daemon => &names::BUILD_INFO,
        Step::Lb(f, _) | Step::Listener(f, _) | Step::Backend(f, _) => f,
    }
}

/// Writes samples of one family, its header before the first.
struct Out<'a> {
    buf: &'a mut Vec<u8>,
    family: &'static Family,
    headed: &'a mut bool,
}

impl Out<'_> {
    /// `name<suffix>{labels} value`; `labels` writes `k="v"` pairs
    /// separated by commas, or nothing.
    fn sample(&mut self, suffix: &str, labels: impl FnOnce(&mut Vec<u8>), value: impl Display) {
        if !*self.headed {
            self.family.write_header(self.buf);
            *self.headed = true;
        }
        self.buf.extend_from_slice(self.family.name.as_bytes());
        self.buf.extend_from_slice(suffix.as_bytes());
        let start = self.buf.len();
        self.buf.push(b'{');
        labels(self.buf);
        if self.buf.len() == start + 1 {
            self.buf.truncate(start);
        } else {
            self.buf.push(b'}');
        }
        let _ = writeln!(self.buf, " {value}");
    }

    /// A listener's pair of counters by `direction`: client to backend,
    /// then backend to client.
    fn directions(&mut self, l: &ListenerStats, counters: [&Counter; 2]) {
        for (direction, c) in DIRECTIONS.into_iter().zip(counters) {
            self.sample(
                "",
                |b| {
                    listener_labels(b, l);
                    label(b, "direction", direction);
                },
                c.get(),
            );
        }
    }

    /// One sample per outcome that has happened at least once.
    /// [`Self::outcomes`] of a family counted [`ByLabel`], under its own label texts.
    fn labelled<L: Label, const N: usize>(
        &mut self,
        counters: &ByLabel<L, N>,
        key: &str,
        labels: impl Fn(&mut Vec<u8>),
    ) {
        self.outcomes(counters.as_slice(), L::NAMES, key, labels);
    }

    fn outcomes(
        &mut self,
        counters: &[Counter],
        values: &[&str],
        key: &str,
        labels: impl Fn(&mut Vec<u8>),
    ) {
        for (c, v) in counters.iter().zip(values) {
            let n = c.get();
            if n > 0 {
                self.sample(
                    "",
                    |b| {
                        labels(b);
                        label(b, key, v);
                    },
                    n,
                );
            }
        }
    }

    /// `_bucket` per bound and `+Inf`, then `_sum` and `_count`.
    fn histogram(&mut self, h: &Histogram, labels: impl Fn(&mut Vec<u8>)) {
        let (cumulative, sum) = h.read();
        let bounds = PROBE_BUCKETS.iter().map(|le| le.to_string());
        for (le, n) in bounds
            .chain(std::iter::once("+Inf".to_string()))
            .zip(cumulative)
        {
            self.sample(
                "_bucket",
                |b| {
                    labels(b);
                    label(b, "le", &le);
                },
                n,
            );
        }
        self.sample("_sum", &labels, sum);
        self.sample("_count", &labels, cumulative[PROBE_BUCKETS.len()]);
    }
}

/// `k="v"`, preceded by a comma unless it is the first label.
fn label(buf: &mut Vec<u8>, key: &str, value: &str) {
    if buf.last() != Some(&b'{') {
        buf.push(b',');
    }
    label_first(buf, key, value);
}

/// `k="v"` with the value escaped as the format requires.
fn label_first(buf: &mut Vec<u8>, key: &str, value: &str) {
    buf.extend_from_slice(key.as_bytes());
    buf.extend_from_slice(b"=\"");
    for byte in value.bytes() {
        match byte {
            b'\\' => buf.extend_from_slice(b"\\\\"),
            b'"' => buf.extend_from_slice(b"\\\""),
            b'\n' => buf.extend_from_slice(b"\\n"),
            _ => buf.push(byte),
        }
    }
    buf.push(b'"');
}

fn lb_labels(buf: &mut Vec<u8>, lb: &LbStats) {
    label_first(buf, "cluster", &lb.cluster);
    label(buf, "load_balancer", &lb.name);
}

fn listener_labels(buf: &mut Vec<u8>, l: &ListenerStats) {
    lb_labels(buf, &l.lb);
    label(buf, "listener", &l.name);
}

fn backend_labels(buf: &mut Vec<u8>, be: &BackendStats) {
    lb_labels(buf, &be.lb);
    ip_label(buf, be.addr);
}

fn udp_backend_labels(buf: &mut Vec<u8>, l: &ListenerStats, addr: std::net::IpAddr) {
    listener_labels(buf, l);
    ip_label(buf, addr);
}

/// `backend="<addr>"`, formatted without an allocation.
fn ip_label(buf: &mut Vec<u8>, addr: std::net::IpAddr) {
    let mut ip = [0u8; 48];
    let n = {
        let mut cursor = std::io::Cursor::new(&mut ip[..]);
        let _ = write!(cursor, "{addr}");
        cursor.position() as usize
    };
    label(
        buf,
        "backend",
        std::str::from_utf8(&ip[..n]).unwrap_or_default(),
    );
}

/// How much text one chunk of a scrape holds before it is sent.
const CHUNK: usize = 64 * 1024;

/// The body of a `/metrics` response: the first chunk is written at once,
/// each poll after it writes the next. An exposition that fits in one chunk
/// goes out with a `Content-Length`; a longer one is sent chunked while it
/// is being written.
pub struct ExpositionBody {
    /// Written and not sent yet.
    ready: Option<Bytes>,
    /// What is left to write; `None` once all of it is.
    rest: Option<Exposition>,
}

impl From<Exposition> for ExpositionBody {
    fn from(mut e: Exposition) -> Self {
        let (first, more) = next_chunk(&mut e);
        Self {
            ready: Some(first),
            rest: more.then_some(e),
        }
    }
}

/// The next chunk, and whether more follows.
fn next_chunk(e: &mut Exposition) -> (Bytes, bool) {
    let mut buf = Vec::with_capacity(CHUNK + CHUNK / 4);
    let more = e.fill(&mut buf, CHUNK);
    (Bytes::from(buf), more)
}

impl Body for ExpositionBody {
    type Data = Bytes;
    type Error = std::convert::Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, Self::Error>>> {
        if let Some(chunk) = self.ready.take() {
            return Poll::Ready(Some(Ok(Frame::data(chunk))));
        }
        let Some(e) = self.rest.as_mut() else {
            return Poll::Ready(None);
        };
        let (chunk, more) = next_chunk(e);
        if !more {
            self.rest = None;
        }
        Poll::Ready(Some(Ok(Frame::data(chunk))))
    }

    fn is_end_stream(&self) -> bool {
        self.ready.is_none() && self.rest.is_none()
    }

    fn size_hint(&self) -> SizeHint {
        match (&self.ready, &self.rest) {
            (Some(chunk), None) => SizeHint::with_exact(chunk.len() as u64),
            (None, None) => SizeHint::with_exact(0),
            _ => SizeHint::default(),
        }
    }
}

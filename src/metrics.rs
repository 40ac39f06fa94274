//! Metric names, their help texts, and the daemon's own Prometheus registry.
//!
//! Every name is a constant here and described once, so the README's metrics
//! reference, the code and `promtool check metrics` agree. Each [`Metrics`]
//! owns its own recorder instead of installing a process-global one: handles
//! are resolved once (per listener, per backend) and kept, so the hot path
//! increments an atomic and never looks a metric up by name; and several
//! daemons can live in one test process without sharing counters.

use std::sync::Arc;
use std::time::Duration;

use metrics::{Counter, Gauge, Histogram, Key, Label, Metadata, Recorder, SharedString, Unit};
use metrics_exporter_prometheus::{PrometheusBuilder, PrometheusRecorder};

/// Counter: client connections accepted on a listener.
pub const CONNECTIONS_ACCEPTED: &str = "harvester_lb_connections_accepted_total";
/// Counter: client connections that could not be forwarded, by `reason`
/// (`no_backend`, `connect_refused`, `connect_timeout`, `connect_error`).
pub const CONNECTIONS_FAILED: &str = "harvester_lb_connections_failed_total";
/// Gauge: client connections being forwarded now, per listener.
pub const CONNECTIONS_ACTIVE: &str = "harvester_lb_connections_active";
/// Counter: bytes forwarded, by `direction` (`client_to_backend`, `backend_to_client`).
pub const BYTES: &str = "harvester_lb_bytes_total";
/// Counter: failed connect attempts to one backend, by `reason`.
pub const BACKEND_CONNECT_FAILURES: &str = "harvester_lb_backend_connect_failures_total";
/// Gauge: connections open to a backend now.
pub const BACKEND_CONNECTIONS_ACTIVE: &str = "harvester_lb_backend_connections_active";
/// Gauge: 1 when a backend is eligible for new connections, else 0.
pub const BACKEND_UP: &str = "harvester_lb_backend_up";
/// Counter: health probes, by `result` (`ok`, `refused`, `timeout`, `error`).
pub const HEALTH_CHECKS: &str = "harvester_lb_health_checks_total";
/// Histogram: duration of one health probe.
pub const HEALTH_CHECK_DURATION: &str = "harvester_lb_health_check_duration_seconds";
/// Counter: health state changes of a backend, by `to` (`up`, `down`).
pub const HEALTH_TRANSITIONS: &str = "harvester_lb_health_transitions_total";
/// Gauge: 1 while a load balancer has no eligible backend.
pub const NO_ELIGIBLE_BACKEND: &str = "harvester_lb_no_eligible_backend";
/// Counter: times a load balancer entered the no-eligible-backend state.
pub const NO_ELIGIBLE_BACKEND_EVENTS: &str = "harvester_lb_no_eligible_backend_events_total";
/// Gauge: 1 when a listener's socket is bound and accepting.
pub const LISTENER_UP: &str = "harvester_lb_listener_up";
/// Counter: errors from `accept(2)`, by `kind`.
pub const ACCEPT_ERRORS: &str = "harvester_lb_accept_errors_total";
/// Counter: accepts delayed because `proxy.max_connections` was reached.
pub const CONNECTION_LIMIT_REACHED: &str = "harvester_lb_connection_limit_reached_total";
/// Gauge: load balancers in the config in force.
pub const CONFIG_LOAD_BALANCERS: &str = "harvester_lb_config_load_balancers";
/// Gauge: distinct health probes sent each period (shared by every load
/// balancer that checks the same address and port the same way).
pub const HEALTH_CHECK_STREAMS: &str = "harvester_lb_health_check_streams";
/// Gauge: 1 when the last reload succeeded.
pub const CONFIG_LAST_RELOAD_SUCCESSFUL: &str = "harvester_lb_config_last_reload_successful";
/// Gauge: Unix time of the last successful (re)load.
pub const CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP: &str =
    "harvester_lb_config_last_reload_success_timestamp_seconds";
/// Counter: reloads, by `result` (`success`, `failure`).
pub const CONFIG_RELOADS: &str = "harvester_lb_config_reloads_total";
/// Gauge: build information, value 1, with a `version` label.
pub const BUILD_INFO: &str = "harvester_lb_build_info";

/// Buckets of the probe-duration histogram, in seconds: from a loopback
/// connect (~50 µs) to the longest sensible timeout.
const PROBE_BUCKETS: &[f64] = &[
    0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5,
    5.0, 10.0,
];

static METADATA: Metadata<'static> =
    Metadata::new(module_path!(), metrics::Level::INFO, Some(module_path!()));

/// The daemon's metric registry and Prometheus renderer.
pub struct Metrics {
    recorder: PrometheusRecorder,
}

impl Metrics {
    /// A registry with every metric described.
    pub fn new() -> Arc<Self> {
        let recorder = PrometheusBuilder::new()
            .set_buckets_for_metric(
                metrics_exporter_prometheus::Matcher::Full(HEALTH_CHECK_DURATION.to_string()),
                PROBE_BUCKETS,
            )
            .expect("probe buckets are not empty")
            .build_recorder();
        let m = Self { recorder };
        m.describe();
        m.gauge(
            BUILD_INFO,
            &[("version", env!("CARGO_PKG_VERSION").to_string())],
        )
        .set(1.0);
        Arc::new(m)
    }

    fn describe(&self) {
        let counters: &[(&'static str, Unit, &'static str)] = &[
            (
                CONNECTIONS_ACCEPTED,
                Unit::Count,
                "Client connections accepted on a listener.",
            ),
            (
                CONNECTIONS_FAILED,
                Unit::Count,
                "Client connections closed without reaching a backend, by reason.",
            ),
            (BYTES, Unit::Bytes, "Bytes forwarded, by direction."),
            (
                BACKEND_CONNECT_FAILURES,
                Unit::Count,
                "Failed connect attempts to a backend, by reason.",
            ),
            (HEALTH_CHECKS, Unit::Count, "Health probes, by result."),
            (
                HEALTH_TRANSITIONS,
                Unit::Count,
                "Health state changes of a backend, by new state.",
            ),
            (
                NO_ELIGIBLE_BACKEND_EVENTS,
                Unit::Count,
                "Times a load balancer was left with no eligible backend.",
            ),
            (
                ACCEPT_ERRORS,
                Unit::Count,
                "Errors returned by accept(2), by kind.",
            ),
            (
                CONNECTION_LIMIT_REACHED,
                Unit::Count,
                "Accepts delayed because proxy.max_connections was reached.",
            ),
            (CONFIG_RELOADS, Unit::Count, "Config reloads, by result."),
        ];
        for (name, unit, help) in counters {
            self.recorder.describe_counter(
                (*name).into(),
                Some(*unit),
                SharedString::const_str(help),
            );
        }
        let gauges: &[(&'static str, &'static str)] = &[
            (
                CONNECTIONS_ACTIVE,
                "Client connections being forwarded now.",
            ),
            (
                BACKEND_CONNECTIONS_ACTIVE,
                "Connections open to a backend now.",
            ),
            (
                BACKEND_UP,
                "1 when the backend is eligible for new connections, 0 when not.",
            ),
            (
                NO_ELIGIBLE_BACKEND,
                "1 while the load balancer has no eligible backend and refuses clients.",
            ),
            (
                LISTENER_UP,
                "1 when the listener's socket is bound and accepting.",
            ),
            (
                CONFIG_LOAD_BALANCERS,
                "Load balancers in the configuration in force.",
            ),
            (
                HEALTH_CHECK_STREAMS,
                "Distinct health probes sent each period, shared by the load balancers that check the same address and port alike.",
            ),
            (
                CONFIG_LAST_RELOAD_SUCCESSFUL,
                "1 when the last configuration reload succeeded.",
            ),
            (
                CONFIG_LAST_RELOAD_SUCCESS_TIMESTAMP,
                "Unix time of the last successful configuration load.",
            ),
            (BUILD_INFO, "Build information; the value is always 1."),
        ];
        for (name, help) in gauges {
            self.recorder
                .describe_gauge((*name).into(), None, SharedString::const_str(help));
        }
        self.recorder.describe_histogram(
            HEALTH_CHECK_DURATION.into(),
            Some(Unit::Seconds),
            "Duration of one health probe.".into(),
        );
    }

    /// A counter handle; keep it, do not call this per event.
    pub fn counter(&self, name: &'static str, labels: &[(&'static str, String)]) -> Counter {
        self.recorder
            .register_counter(&key(name, labels), &METADATA)
    }

    /// A gauge handle; keep it, do not call this per event.
    pub fn gauge(&self, name: &'static str, labels: &[(&'static str, String)]) -> Gauge {
        self.recorder.register_gauge(&key(name, labels), &METADATA)
    }

    /// A histogram handle; keep it, do not call this per event.
    pub fn histogram(&self, name: &'static str, labels: &[(&'static str, String)]) -> Histogram {
        self.recorder
            .register_histogram(&key(name, labels), &METADATA)
    }

    /// The Prometheus text exposition of everything registered.
    pub fn render(&self) -> String {
        self.recorder.handle().render()
    }

    /// Folds the histogram samples recorded since the last call into their
    /// buckets, every `period`, until `stop`. The recorder keeps each sample
    /// until then (a scrape does it too): without this, a daemon that nobody
    /// scrapes would grow by a few bytes per probe for ever, gigabytes a day
    /// at thousands of probes a second.
    pub async fn fold_histograms_every(
        self: Arc<Self>,
        period: Duration,
        stop: tokio_util::sync::CancellationToken,
    ) {
        let handle = self.recorder.handle();
        loop {
            tokio::select! {
                _ = stop.cancelled() => return,
                _ = tokio::time::sleep(period) => handle.run_upkeep(),
            }
        }
    }
}

/// How often [`Metrics::fold_histograms_every`] runs in the daemon: the
/// exporter's own default.
pub const HISTOGRAM_FOLD_PERIOD: Duration = Duration::from_secs(5);

fn key(name: &'static str, labels: &[(&'static str, String)]) -> Key {
    let labels: Vec<Label> = labels
        .iter()
        .map(|(k, v)| Label::new(*k, v.clone()))
        .collect();
    Key::from_parts(name, labels)
}

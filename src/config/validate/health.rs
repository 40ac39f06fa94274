//! `[load_balancer.health_check]`: Harvester's `healthcheck-*` annotations,
//! the check kind, and an HTTP check's path, Host and expected statuses.

use std::num::NonZeroU32;
use std::sync::Arc;
use std::time::Duration;

use toml::Spanned;

use super::{
    DEFAULT_EXPECT_STATUS, DEFAULT_FAILURE_THRESHOLD, DEFAULT_HTTP_PATH, DEFAULT_PERIOD_SECONDS,
    DEFAULT_SUCCESS_THRESHOLD, DEFAULT_TIMEOUT_SECONDS, MAX_HOST_BYTES, MAX_PATH_BYTES,
    MAX_SECONDS, STATUS_CODES, Validator,
};
use crate::config::file::FileHealthCheck;
use crate::config::{CheckKind, HealthCheckSpec, HttpCheck, StatusSet};

impl Validator<'_> {
    pub(super) fn health_check(
        &mut self,
        key: &str,
        hc: &Spanned<FileHealthCheck>,
    ) -> Option<HealthCheckSpec> {
        let span = hc.span();
        let hc = hc.get_ref();
        // Absent: each listener's own backend_port is probed (per-listener
        // eligibility). `required_port` also checks the range of a present one.
        let port = match &hc.port {
            None => Some(None),
            Some(_) => self
                .required_port(
                    &hc.port,
                    span,
                    key,
                    "port",
                    "the port probed on each backend",
                )
                .map(Some),
        };
        let success = self.int(
            &hc.success_threshold,
            format_args!("{key}.success_threshold"),
            DEFAULT_SUCCESS_THRESHOLD,
            1,
            1000,
        );
        let failure = self.int(
            &hc.failure_threshold,
            format_args!("{key}.failure_threshold"),
            DEFAULT_FAILURE_THRESHOLD,
            1,
            1000,
        );
        let period = self.int(
            &hc.period_seconds,
            format_args!("{key}.period_seconds"),
            DEFAULT_PERIOD_SECONDS,
            1,
            MAX_SECONDS,
        );
        let timeout = self.int(
            &hc.timeout_seconds,
            format_args!("{key}.timeout_seconds"),
            DEFAULT_TIMEOUT_SECONDS,
            1,
            MAX_SECONDS,
        );
        if timeout > period {
            self.problem(
                hc.timeout_seconds.as_ref().map(|t| t.span()),
                &format!("{key}.timeout_seconds"),
                format!("{timeout} s is longer than period_seconds ({period} s); a probe must end before the next one starts"),
            );
        }
        let check = self.check_kind(key, hc)?;
        Some(HealthCheckSpec {
            check,
            port: port?,
            success_threshold: NonZeroU32::new(success as u32)?,
            failure_threshold: NonZeroU32::new(failure as u32)?,
            period: Duration::from_secs(period as u64),
            timeout: Duration::from_secs(timeout as u64),
        })
    }

    /// `kind` and the keys of an HTTP check; `None` after a problem.
    fn check_kind(&mut self, key: &str, hc: &FileHealthCheck) -> Option<CheckKind> {
        let http_keys = [
            ("path", hc.path.as_ref().map(|v| v.span())),
            ("expect_status", hc.expect_status.as_ref().map(|v| v.span())),
            ("host", hc.host.as_ref().map(|v| v.span())),
            ("send_proxy", hc.send_proxy.as_ref().map(|v| v.span())),
        ];
        let kind: Option<&str> = match &hc.kind {
            Some(k) if !["tcp", "http"].contains(&k.get_ref().as_str()) => Some(
                self.spelled_otherwise(k, &format!("{key}.kind"), &["tcp", "http"])
                    .unwrap_or(k.get_ref().as_str()),
            ),
            k => k.as_ref().map(|k| k.get_ref().as_str()),
        };
        match kind {
            None | Some("tcp") => {
                let why = if kind.is_none() {
                    "kind = \"tcp\", the default"
                } else {
                    "kind = \"tcp\""
                };
                let mut ok = true;
                for (name, span) in http_keys {
                    if let Some(span) = span {
                        self.problem(
                            Some(span),
                            &format!("{key}.{name}"),
                            format!("applies only to kind = \"http\" (this check is {why}); remove it or set kind = \"http\""),
                        );
                        ok = false;
                    }
                }
                ok.then_some(CheckKind::TcpConnect)
            }
            Some("http") => {
                let path = match &hc.path {
                    None => Some(DEFAULT_HTTP_PATH.to_string()),
                    Some(p) => match path_problem(p.get_ref()) {
                        None => Some(p.get_ref().clone()),
                        Some(why) => {
                            self.problem(Some(p.span()), &format!("{key}.path"), why);
                            None
                        }
                    },
                };
                let host = match &hc.host {
                    None => Some(None),
                    Some(h) => match host_problem(h.get_ref()) {
                        None => Some(Some(h.get_ref().clone())),
                        Some(why) => {
                            self.problem(Some(h.span()), &format!("{key}.host"), why);
                            None
                        }
                    },
                };
                let expect_status = match &hc.expect_status {
                    None => Some(StatusSet::new([(
                        DEFAULT_EXPECT_STATUS,
                        DEFAULT_EXPECT_STATUS,
                    )])),
                    Some(list) => self.expect_status(key, list),
                };
                Some(CheckKind::Http(Arc::new(HttpCheck {
                    path: path?,
                    host: host?,
                    expect_status: expect_status?,
                    send_proxy: hc.send_proxy.as_ref().is_some_and(|v| *v.get_ref()),
                })))
            }
            Some(other) => {
                let message = self.not_one_of(other, &["tcp", "http"]);
                self.problem(
                    hc.kind.as_ref().map(|k| k.span()),
                    &format!("{key}.kind"),
                    message,
                );
                None
            }
        }
    }

    /// `expect_status`: integers in 100..=599 and strings `"FROM-TO"`.
    fn expect_status(
        &mut self,
        key: &str,
        list: &Spanned<Vec<Spanned<toml::Value>>>,
    ) -> Option<StatusSet> {
        if list.get_ref().is_empty() {
            self.problem(
                Some(list.span()),
                &format!("{key}.expect_status"),
                "the list is empty; give the statuses that mean healthy, e.g. [200] or [\"200-399\"]".into(),
            );
            return None;
        }
        let mut ranges = Vec::new();
        let mut ok = true;
        for (i, item) in list.get_ref().iter().enumerate() {
            let range = match item.get_ref() {
                toml::Value::Integer(n) => match u16::try_from(*n) {
                    Ok(code) if STATUS_CODES.contains(&code) => Ok((code, code)),
                    _ => Err(format!(
                        "{n} is out of range; a status code must be in {}..={}",
                        STATUS_CODES.start(),
                        STATUS_CODES.end()
                    )),
                },
                toml::Value::String(s) => status_range(s).ok_or_else(|| {
                    format!(
                        "{s:?} is not a status range; write \"FROM-TO\" with codes in {}..={} and FROM <= TO, e.g. \"200-399\"",
                        STATUS_CODES.start(),
                        STATUS_CODES.end()
                    )
                }),
                other => Err(format!(
                    "{other} (a {}) is not a status; write an integer code such as 200 or a string range such as \"200-399\"",
                    other.type_str()
                )),
            };
            match range {
                Ok(r) => ranges.push(r),
                Err(why) => {
                    self.problem(Some(item.span()), &format!("{key}.expect_status[{i}]"), why);
                    ok = false;
                }
            }
        }
        ok.then(|| StatusSet::new(ranges))
    }
}

/// Why `path` cannot be sent as a request target, if it cannot.
fn path_problem(path: &str) -> Option<String> {
    if !path.starts_with('/') {
        return Some(format!(
            "{path:?} is not a valid path; it must start with \"/\", e.g. \"/healthz\""
        ));
    }
    if path.len() > MAX_PATH_BYTES {
        return Some(format!(
            "the path is {} bytes long; at most {MAX_PATH_BYTES} are allowed",
            path.len()
        ));
    }
    let bad = path.char_indices().find(|(_, c)| !c.is_ascii_graphic())?;
    Some(format!(
        "{path:?} is not a valid path: it contains {} at byte {}; only visible ASCII is allowed (percent-encode the rest, e.g. %20 for a space)",
        describe_char(bad.1),
        bad.0
    ))
}

/// Why `host` cannot be sent as a `Host` header, if it cannot: a host name
/// or address (IPv6 in brackets) with an optional `:port`, the characters
/// RFC 3986 allows there.
fn host_problem(host: &str) -> Option<String> {
    if host.is_empty() {
        return Some(
            "must not be empty; leave the key out to send the backend's address and port".into(),
        );
    }
    if host.len() > MAX_HOST_BYTES {
        return Some(format!(
            "the host is {} bytes long; at most {MAX_HOST_BYTES} are allowed",
            host.len()
        ));
    }
    let allowed = |c: char| c.is_ascii_alphanumeric() || "-._~:[]%!$&'()*+,;=".contains(c);
    let bad = host.char_indices().find(|(_, c)| !allowed(*c))?;
    Some(format!(
        "{host:?} is not a valid Host header: it contains {} at byte {}; write a host name or address with an optional :port, e.g. \"node-1.example:10256\" or \"[fd00::1]:10256\"",
        describe_char(bad.1),
        bad.0
    ))
}

/// A character named so that an operator sees what to remove.
fn describe_char(c: char) -> String {
    match c {
        ' ' => "a space".into(),
        c if c.is_control() => format!("a control character ({c:?})"),
        c if !c.is_ascii() => format!("the non-ASCII character {c:?}"),
        c => format!("{c:?}"),
    }
}

/// `"200-399"` (or a single `"204"`) as an inclusive range of status codes.
fn status_range(s: &str) -> Option<(u16, u16)> {
    let code = |t: &str| {
        let t = t.trim();
        (t.len() == 3 && t.bytes().all(|b| b.is_ascii_digit()))
            .then(|| t.parse::<u16>().ok())
            .flatten()
            .filter(|c| STATUS_CODES.contains(c))
    };
    let (from, to) = match s.split_once('-') {
        Some((a, b)) => (code(a)?, code(b)?),
        None => (code(s)?, code(s)?),
    };
    (from <= to).then_some((from, to))
}

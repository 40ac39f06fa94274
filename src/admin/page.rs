//! `GET /status.html`: the status page, what HAProxy's stats page is to
//! an operator who opens a browser on the host (or an SSH tunnel to
//! `admin.listen`): every load balancer with its VIP's holder and
//! announcement, its listeners, and each backend's state, coloured, with
//! its totals and last change.
//!
//! It is [`render`] of the same document `/status` serves, taken as JSON
//! (`serde_json::Value`), never a second reading of the daemon: the page
//! and `/status` cannot disagree, and a field `/status` gains (each
//! backend's `totals`) shows once it is there, with no change here.
//!
//! What it must never do: load anything from elsewhere (the CSS is inline,
//! there is no script, no image, no font: the page works on a host with no
//! way out) or let a string from the document become markup: every name
//! comes from a guest cluster's objects, so each one is made visible
//! ([`crate::text::escape`]) and then HTML-escaped. Read-only: it has no
//! form but the filter, which is a `GET` of this page.
//!
//! Its size is bounded whatever the number of load balancers: at most
//! [`PAGE_SIZE`] of them a page, filtered by `lb=SUBSTRING` and paged by
//! `page=N` (about 270 KB a page at 3 backends and 2 listeners each, with
//! their totals; the unit test holds it under 400 KB at the 10,000 load
//! balancers of the scale benchmark).

use std::fmt::Write as _;
use std::time::{Duration, UNIX_EPOCH};

use serde_json::Value;

use crate::dataplane::proxy::log::Rfc3339;

/// Load balancers on one page: 100 of them with 3 backends and 2
/// listeners each are about 270 KB of HTML, which any browser shows at
/// once; 10,000 would be 100 pages (or one filter).
pub const PAGE_SIZE: usize = 100;

/// What a `/status.html` query asks for: the load balancers whose name
/// contains `lb` (all when empty), page `page` of them (from 1), and
/// whether the browser loads it again every `refresh` seconds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PageQuery {
    /// A substring of the load balancers' names (`<namespace>/<service>`);
    /// empty: every one.
    pub lb: String,
    /// The page, from 1, [`PAGE_SIZE`] load balancers each.
    pub page: usize,
    /// Seconds between reloads by the browser (HTML's `refresh`, no
    /// script), within [`REFRESH_SECONDS`]; `None`: the page stays as
    /// loaded.
    pub refresh: Option<u32>,
}

/// The reload periods `refresh=` takes: each load builds the whole
/// `/status` document (all 10,000 load balancers at the scale benchmark's
/// size), so a tab left open on the page may not ask more often than
/// every 5 s.
pub const REFRESH_SECONDS: std::ops::RangeInclusive<u32> = 5..=3600;

impl Default for PageQuery {
    fn default() -> Self {
        Self {
            lb: String::new(),
            page: 1,
            refresh: None,
        }
    }
}

/// Why a `/status.html` query cannot be answered (400, naming the part).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PageQueryError {
    /// A parameter other than `lb`, `page` and `refresh`.
    #[error(
        "unknown query parameter {0:?}; /status.html takes lb=SUBSTRING (the load balancers whose name contains it), page=N (from 1, {PAGE_SIZE} load balancers a page) and refresh=SECONDS (5 to 3600), e.g. /status.html?lb=default/&page=2&refresh=10"
    )]
    Parameter(String),
    /// A `page=` value that is no page number.
    #[error(
        "page {0:?} is not a page number; write page=1 for the first {PAGE_SIZE} load balancers, page=2 for the next {PAGE_SIZE}"
    )]
    Page(String),
    /// A `refresh=` value outside [`REFRESH_SECONDS`].
    #[error(
        "refresh {0:?} is not a number of seconds from 5 to 3600; write e.g. refresh=10 (each reload builds the whole status document, so not more often than every 5 s)"
    )]
    Refresh(String),
    /// A parameter more than once.
    #[error("{0}= is given twice; give it once")]
    Twice(&'static str),
}

/// The question a `/status.html` query asks, or what is wrong with it.
/// Values are percent-decoded, `+` is a space (as a browser's form sends).
pub fn parse_query(query: &str) -> Result<PageQuery, PageQueryError> {
    let mut q = PageQuery::default();
    let (mut lb_seen, mut page_seen, mut refresh_seen) = (false, false, false);
    for pair in query.split('&').filter(|p| !p.is_empty()) {
        let (key, value) = pair.split_once('=').unwrap_or((pair, ""));
        let value = super::routes::percent_decode(&value.replace('+', " "));
        match key {
            "lb" if lb_seen => return Err(PageQueryError::Twice("lb")),
            "lb" => {
                lb_seen = true;
                q.lb = value.trim().to_string();
            }
            "page" if page_seen => return Err(PageQueryError::Twice("page")),
            "page" => {
                page_seen = true;
                q.page = match value.trim().parse::<usize>() {
                    Ok(n) if n >= 1 => n,
                    _ => return Err(PageQueryError::Page(value)),
                };
            }
            "refresh" if refresh_seen => return Err(PageQueryError::Twice("refresh")),
            "refresh" => {
                refresh_seen = true;
                q.refresh = match value.trim().parse::<u32>() {
                    Ok(n) if REFRESH_SECONDS.contains(&n) => Some(n),
                    _ => return Err(PageQueryError::Refresh(value)),
                };
            }
            _ => {
                return Err(PageQueryError::Parameter(super::routes::percent_decode(
                    key,
                )));
            }
        }
    }
    Ok(q)
}

/// The inline style: state colours (green: serving, amber: by choice or
/// on the way, red: broken), compact tables.
const STYLE: &str = "\
body{font:13px/1.4 system-ui,sans-serif;margin:1em;color:#222}\
h1{font-size:18px;margin:0 0 .3em}h2{font-size:15px;margin:1.2em 0 .2em}\
table{border-collapse:collapse;margin:.2em 0 .6em}\
th,td{border:1px solid #ccc;padding:2px 6px;text-align:left;vertical-align:top}\
th{background:#eee;font-weight:600}td.n{text-align:right}\
.good{background:#cdeccd}.warn{background:#fbe8b0}.bad{background:#f5c2c2}\
.muted{color:#777}pre{margin:.2em 0;white-space:pre-wrap}\
nav{margin:.8em 0}nav a{margin-right:1em}section.lb{margin-bottom:1em}";

/// The status page for `doc` (the `/status` document), the load balancers
/// `q` asks for.
pub fn render(doc: &Value, q: &PageQuery) -> String {
    let mut out = String::with_capacity(16 * 1024);
    let now = now_of(doc);
    let empty = Vec::new();
    let all = doc["load_balancers"].as_array().unwrap_or(&empty);
    let matched: Vec<&Value> = all
        .iter()
        .filter(|lb| q.lb.is_empty() || lb["name"].as_str().unwrap_or("").contains(&q.lb))
        .collect();
    let pages = matched.len().div_ceil(PAGE_SIZE).max(1);
    let first = (q.page - 1).saturating_mul(PAGE_SIZE);
    let shown: Vec<&Value> = matched
        .iter()
        .skip(first)
        .take(PAGE_SIZE)
        .copied()
        .collect();

    out.push_str("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">");
    out.push_str("<meta name=\"viewport\" content=\"width=device-width\">");
    if let Some(n) = q.refresh {
        let _ = write!(out, "<meta http-equiv=\"refresh\" content=\"{n}\">");
    }
    let _ = writeln!(
        out,
        "<title>harvester-lb status</title><style>{STYLE}</style></head><body>"
    );
    header(&mut out, doc, now);
    config(&mut out, &doc["config"], now);
    vip_section(&mut out, doc, now);
    nav(
        &mut out,
        q,
        all.len(),
        matched.len(),
        first,
        shown.len(),
        pages,
    );
    if shown.is_empty() {
        let _ = writeln!(
            out,
            "<p id=\"none\" class=\"muted\">{}</p>",
            if matched.is_empty() {
                "no load balancer matches".to_string()
            } else {
                format!("no page {}: there are {pages}", q.page)
            }
        );
    }
    for lb in shown {
        load_balancer(&mut out, lb, now);
    }
    if pages > 1 {
        nav(&mut out, q, all.len(), matched.len(), first, 0, pages);
    }
    out.push_str("</body></html>\n");
    out
}

/// The document's "now": started plus uptime (the moment `/status` was
/// built), so ages on the page are as of the document, not of the reader.
fn now_of(doc: &Value) -> Option<f64> {
    Some(doc["started_unix"].as_f64()? + doc["uptime_seconds"].as_f64()?)
}

/// Daemon line: ready or not, build, uptime.
fn header(out: &mut String, doc: &Value, now: Option<f64>) {
    let ready = doc["ready"].as_bool() == Some(true);
    let _ = write!(
        out,
        "<h1>harvester-lb <span id=\"daemon\" class=\"{}\">{}</span></h1><p>version {} (commit {})",
        if ready { "good" } else { "bad" },
        if ready { "ready" } else { "NOT READY" },
        h(&doc["version"]),
        h(&doc["commit"]),
    );
    if let Some(up) = doc["uptime_seconds"].as_f64() {
        let _ = write!(out, ", up {}", span(up));
    }
    if let Some(t) = now {
        let _ = write!(out, "; as of {}", utc(t));
    }
    out.push_str(". The same document as JSON: <a href=\"/status\">/status</a>.</p>\n");
}

/// The config in force, what is wrong with its file, a rejected reload.
fn config(out: &mut String, c: &Value, now: Option<f64>) {
    let _ = write!(
        out,
        "<p id=\"config\">config {} sha256 <code>{}</code>",
        h(&c["path"]),
        h(&c["sha256"])
    );
    if c["problem"].is_string() {
        let _ = write!(out, " <span class=\"bad\">{}</span>", h(&c["problem"]));
    }
    let restart: Vec<String> = c["needs_restart"]
        .as_array()
        .into_iter()
        .flatten()
        .map(h)
        .collect();
    if !restart.is_empty() {
        let _ = write!(
            out,
            " <span class=\"warn\">needs a restart: {}</span>",
            restart.join(", ")
        );
    }
    out.push_str("</p>\n");
    let r = &c["rejected_reload"];
    if r.is_object() {
        let _ = write!(
            out,
            "<p class=\"bad\">last reload rejected {} (asked by {}; file sha256 <code>{}</code>):</p><pre>",
            when(&r["at_unix"], now),
            h(&r["source"]),
            h(&r["sha256"])
        );
        for p in r["problems"].as_array().into_iter().flatten() {
            let _ = writeln!(out, "{}", h(p));
        }
        out.push_str("</pre>\n");
    }
}

/// The VIPs' holders and announcements, host-wide: keepalived's VRRP
/// instances as the notify script last recorded them (MASTER: this host
/// holds their VIPs), the routes announced, the management check's
/// problem, and load balancers and networks refused (not served, so not
/// in the tables below).
fn vip_section(out: &mut String, doc: &Value, now: Option<f64>) {
    let empty = Vec::new();
    out.push_str("<section id=\"vips\">");
    let sync = &doc["conntrack_sync"];
    if let Some(instances) = sync["instances"].as_array().filter(|i| !i.is_empty()) {
        out.push_str(
            "<h2>VRRP instances (keepalived: MASTER holds the VIPs here)</h2><table id=\"vrrp\"><tr><th>instance</th><th>state</th><th>since</th><th>last commit</th><th>gate</th></tr>\n",
        );
        for i in instances {
            let state = i["state"].as_str().unwrap_or("");
            let class = match state {
                "MASTER" => "good",
                "FAULT" | "STOP" => "bad",
                "" => "warn",
                _ => "",
            };
            let _ = writeln!(
                out,
                "<tr><td>{}</td><td class=\"{class}\">{}</td><td>{}</td><td>{}</td><td>{}</td></tr>",
                h(&i["instance"]),
                if state.is_empty() {
                    "none yet".to_string()
                } else {
                    h(&i["state"])
                },
                when(&i["since_unix"], now),
                h(&i["last_commit"]),
                h(&i["gate"])
            );
        }
        out.push_str("</table>\n");
        if sync["conntrackd_up"].as_bool() == Some(false)
            && sync["conntrackd_readable"].as_bool() == Some(true)
        {
            let _ = writeln!(
                out,
                "<p class=\"bad\">conntrackd does not answer: {}</p>",
                h(&sync["conntrackd_error"])
            );
        }
    }
    if let Some(p) = doc["management_check"]["problem"].as_str() {
        let _ = writeln!(
            out,
            "<p class=\"warn\">keepalived management check: {}</p>",
            esc(p)
        );
    }
    let a = &doc["announce"];
    if a.is_object() {
        let _ = write!(
            out,
            "<p id=\"announce\">VIPs announced as routes in table {} on {}",
            h(&a["table"]),
            h(&a["interface"])
        );
        if a["host_drained"].as_bool() == Some(true) {
            out.push_str(" <span class=\"warn\">host drained</span>");
        }
        if a["error"].is_string() {
            let _ = write!(out, " <span class=\"bad\">{}</span>", h(&a["error"]));
        }
        out.push_str("</p>\n");
    }
    for (key, what) in [
        ("vip_isolation", "VIP isolation"),
        ("vm_network_guard", "VM-network guard"),
        ("reply_marks", "reply marks"),
    ] {
        if doc[key]["error"].is_string() {
            let _ = writeln!(
                out,
                "<p class=\"bad\">{what}: {}</p>",
                h(&doc[key]["error"])
            );
        }
    }
    for r in doc["vip_refused"].as_array().unwrap_or(&empty) {
        let _ = writeln!(
            out,
            "<p class=\"bad\">REFUSED load balancer {} (VIP {}, {}): {}</p>",
            h(&r["load_balancer"]),
            h(&r["vip"]),
            h(&r["kind"]),
            h(&r["reason"])
        );
    }
    for r in doc["network_refused"].as_array().unwrap_or(&empty) {
        let _ = writeln!(
            out,
            "<p class=\"bad\">REFUSED network: {}</p>",
            esc(&r.to_string())
        );
    }
    out.push_str("</section>\n");
}

/// The filter form and the page links, with the counts.
fn nav(
    out: &mut String,
    q: &PageQuery,
    total: usize,
    matched: usize,
    first: usize,
    shown: usize,
    pages: usize,
) {
    out.push_str("<nav>");
    if shown > 0 {
        let _ = write!(
            out,
            "<form method=\"get\" action=\"/status.html\">load balancers <span id=\"range\">{}–{} of {matched}</span>{} <input name=\"lb\" value=\"{}\" placeholder=\"name contains\">{} <button>filter</button></form>",
            first + 1,
            first + shown,
            if q.lb.is_empty() {
                String::new()
            } else {
                format!(" matching “{}” ({total} in all)", esc(&q.lb))
            },
            esc(&q.lb),
            q.refresh
                .map(|n| format!("<input type=\"hidden\" name=\"refresh\" value=\"{n}\">"))
                .unwrap_or_default()
        );
    }
    let link = |page: usize| href(&PageQuery { page, ..q.clone() });
    if q.page > 1 && q.page <= pages {
        let _ = write!(
            out,
            "<a rel=\"prev\" href=\"{}\">← previous</a>",
            link(q.page - 1)
        );
    }
    let _ = write!(out, "page {} of {pages}", q.page);
    if q.page < pages {
        let _ = write!(
            out,
            " <a rel=\"next\" href=\"{}\">next →</a>",
            link(q.page + 1)
        );
    }
    // This page again, reloaded every 10 s or no more.
    let again = href(&PageQuery {
        page: q.page.min(pages),
        refresh: if q.refresh.is_some() { None } else { Some(10) },
        ..q.clone()
    });
    let _ = write!(
        out,
        " · <a class=\"refresh\" href=\"{again}\">{}</a>",
        match q.refresh {
            Some(n) => format!("reloads every {n} s: stop"),
            None => "reload every 10 s".to_string(),
        }
    );
    out.push_str("</nav>\n");
}

/// The page `q` as a link (`&` written `&amp;`, for an attribute).
fn href(q: &PageQuery) -> String {
    let mut h = format!("/status.html?page={}", q.page);
    if !q.lb.is_empty() {
        h.push_str("&amp;lb=");
        h.push_str(&url_encode(&q.lb));
    }
    if let Some(n) = q.refresh {
        let _ = write!(h, "&amp;refresh={n}");
    }
    h
}

/// One load balancer: a heading with its VIP and how it is held, then
/// its listeners and backends.
fn load_balancer(out: &mut String, lb: &Value, now: Option<f64>) {
    let empty = Vec::new();
    let backends = lb["backends"].as_array().unwrap_or(&empty);
    let eligible = lb["eligible_backends"].as_u64().unwrap_or(0);
    let class = if eligible == 0 {
        "bad"
    } else if (eligible as usize) < backends.len() {
        "warn"
    } else {
        "good"
    };
    let name = h(&lb["name"]);
    let _ = write!(
        out,
        "<section class=\"lb\" data-lb=\"{name}\"><h2>{name} <span class=\"muted\">cluster {}</span></h2><p>VIP <b>{}</b> ({}) · {} · {} · affinity {} · <span class=\"{class}\">{eligible} of {} backends eligible</span>",
        h(&lb["cluster"]),
        h(&lb["vip"]),
        h(&lb["ipam"]),
        h(&lb["algorithm"]),
        lb["health_check_kind"].as_str().map_or_else(
            || "no health check".to_string(),
            |k| format!("check {}", esc(k))
        ),
        h(&lb["session_affinity"]),
        backends.len()
    );
    let a = &lb["announce"];
    if a.is_object() {
        if a["announced"].as_bool() == Some(true) {
            let _ = write!(
                out,
                " · <span class=\"good\">announced</span> since {}",
                when(&a["since"], now)
            );
        } else {
            let _ = write!(
                out,
                " · <span class=\"warn\">not announced ({})</span> since {}",
                h(&a["reason"]),
                when(&a["since"], now)
            );
        }
    }
    let d = &lb["dhcp"];
    if d.is_object() {
        let class = match d["state"].as_str() {
            Some("bound" | "renewing") => "good",
            Some("rebinding") => "warn",
            _ => "bad",
        };
        let _ = write!(
            out,
            " · lease <span class=\"{class}\">{}</span> {} from {}, expires {}",
            h(&d["state"]),
            h(&d["address"]),
            h(&d["server"]),
            when(&d["expires_unix"], now)
        );
        if d["error"].is_string() {
            let _ = write!(out, " <span class=\"bad\">{}</span>", h(&d["error"]));
        }
    }
    out.push_str("</p>\n");

    let _ = writeln!(
        out,
        "<table class=\"listeners\" data-lb=\"{name}\"><tr><th>listener</th><th>address</th><th>protocol</th><th>backend port</th><th>state</th><th>forwarding</th><th>open</th><th>eligible</th><th>error</th></tr>"
    );
    for l in lb["listeners"].as_array().unwrap_or(&empty) {
        let state_class = match l["state"].as_str() {
            Some("listening") => "good",
            Some("waiting_for_lease") => "warn",
            _ => "bad",
        };
        let kernel_error = l["kernel_error"].as_str();
        let fwd_class = if l["forwarding"] == "repairing" || kernel_error.is_some() {
            "warn"
        } else {
            ""
        };
        let open = match l["active_flows"].as_u64() {
            Some(f) => format!("{f} flows"),
            None => h(&l["active_connections"]),
        };
        let error = [l["error"].as_str(), kernel_error]
            .into_iter()
            .flatten()
            .map(esc)
            .collect::<Vec<_>>()
            .join("; ");
        let _ = writeln!(
            out,
            "<tr><td>{}</td><td>{}</td><td>{}{}</td><td>{}</td><td class=\"{state_class}\">{}</td><td class=\"{fwd_class}\">{}</td><td class=\"n\">{open}</td><td class=\"n\">{}</td><td>{error}</td></tr>",
            h(&l["name"]),
            h(&l["address"]),
            h(&l["protocol"]),
            l["proxy_protocol"]
                .as_str()
                .map(|v| format!(" (PROXY {})", esc(v)))
                .unwrap_or_default(),
            h(&l["backend_port"]),
            h(&l["state"]),
            h(&l["forwarding"]),
            h(&l["eligible_backends"]),
        );
    }
    out.push_str("</table>\n");

    // The totals (issue 43 item 3), when the document has them.
    let totals = backends.iter().any(|b| b["totals"].is_object());
    let _ = write!(
        out,
        "<table class=\"backends\" data-lb=\"{name}\"><tr><th>backend</th><th>health</th><th>admin</th><th>eligible</th><th>open</th><th>last check</th><th>runs ok/fail</th><th>last error</th>"
    );
    if totals {
        out.push_str("<th>connections</th><th>to backend</th><th>to client</th><th>connect failures</th><th>check failures</th><th>down</th><th>last change</th>");
    }
    out.push_str("</tr>\n");
    for b in backends {
        backend_row(out, b, totals, now);
    }
    out.push_str("</table></section>\n");
}

/// One backend's row.
fn backend_row(out: &mut String, b: &Value, totals: bool, now: Option<f64>) {
    let health_class = match b["health"].as_str() {
        Some("healthy") => "good",
        _ => "bad",
    };
    let admin_class = match b["admin_state"].as_str() {
        Some("ready") => "good",
        _ => "warn",
    };
    let eligible = b["eligible"].as_bool() == Some(true);
    // Per-listener checks: each port's verdict, after the backend's.
    let mut health = h(&b["health"]);
    for p in b["ports"].as_array().into_iter().flatten() {
        let _ = write!(
            health,
            "<br><span class=\"{}\">{}: {}</span>",
            if p["health"] == "healthy" {
                "good"
            } else {
                "bad"
            },
            h(&p["backend_port"]),
            h(&p["health"])
        );
    }
    let open = match b["active_flows"].as_u64() {
        Some(f) => format!("{} ({f} flows)", h(&b["active_connections"])),
        None => h(&b["active_connections"]),
    };
    // The probe: the backend's, or the first port's under per-listener checks.
    let probe = if b["probe"].is_object() {
        &b["probe"]
    } else {
        &b["ports"][0]["probe"]
    };
    let check = if probe.is_object() {
        format!(
            "{} {}",
            h(&probe["last_result"]),
            when(&probe["last_probe_unix"], now)
        )
    } else {
        "-".to_string()
    };
    let runs = if probe.is_object() {
        format!(
            "{}/{}",
            h(&probe["consecutive_successes"]),
            h(&probe["consecutive_failures"])
        )
    } else {
        "-".to_string()
    };
    let _ = write!(
        out,
        "<tr><td>{}</td><td class=\"{health_class}\">{health}</td><td class=\"{admin_class}\">{}</td><td class=\"{}\">{}</td><td class=\"n\">{open}</td><td>{check}</td><td class=\"n\">{runs}</td><td>{}</td>",
        h(&b["address"]),
        h(&b["admin_state"]),
        // Not eligible because the operator drained it is by choice.
        match (eligible, admin_class) {
            (true, _) => "good",
            (false, "warn") => "warn",
            (false, _) => "bad",
        },
        if eligible { "yes" } else { "no" },
        h(&probe["last_error"]),
    );
    if totals {
        let t = &b["totals"];
        let down = t["down_seconds"]
            .as_f64()
            .map_or_else(|| "-".to_string(), span);
        let _ = write!(
            out,
            "<td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{}</td><td class=\"n\">{down}</td><td>{}</td>",
            h(&t["connections"]),
            bytes(&t["bytes_to_backend"]),
            bytes(&t["bytes_to_client"]),
            h(&t["connect_failures"]),
            h(&t["check_failures"]),
            when(&t["last_change_unix"], now),
        );
    }
    out.push_str("</tr>\n");
}

/// `s` safe in HTML text and in a double- or single-quoted attribute,
/// control characters made visible first ([`crate::text::escape`]).
fn esc(s: &str) -> String {
    let visible = crate::text::escape(s);
    let mut out = String::with_capacity(visible.len());
    for c in visible.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

/// A value of the document as escaped text: `-` for null or absent.
fn h(v: &Value) -> String {
    match v {
        Value::Null => "-".to_string(),
        Value::String(s) => esc(s),
        other => esc(&other.to_string()),
    }
}

/// A byte count as the person reads it (`1.5 MiB`), exact in the title.
fn bytes(v: &Value) -> String {
    let Some(n) = v.as_u64() else {
        return h(v);
    };
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = n as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit < UNITS.len() - 1 {
        x /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{n} B")
    } else {
        format!("<span title=\"{n} bytes\">{x:.1} {}</span>", UNITS[unit])
    }
}

/// A time of the document: its age as of the document (`5m 12s ago`), the
/// UTC time in the title; `-` when null.
fn when(v: &Value, now: Option<f64>) -> String {
    let Some(t) = v.as_f64() else {
        return "-".to_string();
    };
    match now {
        Some(now) => format!("<span title=\"{}\">{} ago</span>", utc(t), span(now - t)),
        None => utc(t),
    }
}

/// Unix seconds as RFC 3339 UTC.
fn utc(t: f64) -> String {
    let since = Duration::try_from_secs_f64(t.max(0.0)).unwrap_or_default();
    Rfc3339(UNIX_EPOCH + since).to_string()
}

/// Seconds as the two largest units: "3d 4h", "2h 5m", "5m 12s", "12s".
fn span(seconds: f64) -> String {
    let s = seconds.max(0.0).round() as u64;
    let (d, hr, m, sec) = (s / 86_400, s / 3600 % 24, s / 60 % 60, s % 60);
    if d > 0 {
        format!("{d}d {hr}h")
    } else if hr > 0 {
        format!("{hr}h {m}m")
    } else if m > 0 {
        format!("{m}m {sec}s")
    } else {
        format!("{sec}s")
    }
}

/// `s` percent-encoded for a query value.
fn url_encode(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for b in s.bytes() {
        if b.is_ascii_alphanumeric() || b"-._~/".contains(&b) {
            out.push(char::from(b));
        } else {
            let _ = write!(out, "%{b:02X}");
        }
    }
    out
}

#[cfg(test)]
mod tests;

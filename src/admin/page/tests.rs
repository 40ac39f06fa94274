use super::*;
use serde_json::json;

/// A `/status` document as the daemon serves it, `n` load balancers of
/// 2 listeners and 3 backends, the second backend down, `totals` on
/// every backend when `with_totals`.
fn doc(n: usize, with_totals: bool) -> Value {
    let lbs: Vec<Value> = (0..n)
        .map(|i| {
            let vip = format!("10.{}.{}.{}", 100 + i / 65_536, i / 256 % 256, i % 256);
            let backends: Vec<Value> = (1..=3)
                .map(|b| {
                    let healthy = b != 2;
                    let mut backend = json!({
                        "address": format!("10.52.0.{b}"),
                        "health": if healthy { "healthy" } else { "unhealthy" },
                        "admin_state": if b == 3 { "drain" } else { "ready" },
                        "eligible": b == 1,
                        "active_connections": 7 * b,
                        "probe": {
                            "status": if healthy { "healthy" } else { "unhealthy" },
                            "consecutive_successes": if healthy { 12 } else { 0 },
                            "consecutive_failures": if healthy { 0 } else { 4 },
                            "last_result": if healthy { "ok" } else { "refused" },
                            "last_error": if healthy { Value::Null } else { json!("connection refused") },
                            "last_probe_unix": 1_764_999_992.0,
                            "probes": 40
                        }
                    });
                    if with_totals {
                        backend["totals"] = json!({
                            "connections": 1000 * b,
                            "bytes_to_backend": 3_000_000 * b,
                            "bytes_to_client": 512 * b,
                            "connect_failures": b - 1,
                            "check_failures": 4,
                            "down_seconds": 75.0,
                            "last_change_unix": if b == 2 { json!(1_764_999_990.0) } else { Value::Null }
                        });
                    }
                    backend
                })
                .collect();
            json!({
                "name": format!("ns{}/svc-{i}", i % 7),
                "cluster": "prod",
                "vip": vip,
                "ipam": "pool",
                "algorithm": "round_robin",
                "health_check": true,
                "health_check_port": 30080,
                "health_check_per_listener": false,
                "health_check_kind": "tcp",
                "session_affinity": "none",
                "affinity_entries": null,
                "eligible_backends": 1,
                "announce": {"announced": true, "reason": null, "transitions": 1, "since": 1_764_999_000.0},
                "listeners": [
                    {"name": "http", "address": format!("{vip}:80"), "backend_port": 30080, "protocol": "tcp",
                     "proxy_protocol": null, "state": "listening", "error": null, "active_connections": 21,
                     "eligible_backends": 1, "forwarding": "proxy"},
                    {"name": "dns", "address": format!("{vip}:53"), "backend_port": 30053, "protocol": "udp",
                     "proxy_protocol": null, "state": "failed", "error": "Address in use (os error 98)",
                     "active_connections": 0, "active_flows": 3, "eligible_backends": 1, "forwarding": "proxy"}
                ],
                "backends": backends
            })
        })
        .collect();
    json!({
        "ready": true,
        "version": "0.48.0",
        "commit": "09c57cf",
        "started_unix": 1_764_990_000.0,
        "uptime_seconds": 10_001.0,
        "load_balancers": lbs,
        "config": {"path": "/etc/harvester-lb/config.toml", "problem": null, "missing_since_unix": null,
                   "sha256": "ab12", "rejected_reload": null, "needs_restart": []},
        "vip_isolation": {"error": null},
        "vm_network_guard": {"error": null},
        "reply_marks": {"error": null},
        "vip_refused": [],
        "network_refused": [],
        "conntrack_sync": {"conntrackd_up": true, "conntrackd_readable": true, "instances": [
            {"instance": "hlb_50", "state": "MASTER", "since_unix": 1_764_999_999.0, "gate": "open"},
            {"instance": "hlb_51", "state": "BACKUP", "since_unix": 1_764_999_999.0, "gate": "closed"}
        ]},
        "management_check": null
    })
}

/// Rows (`<tr>…</tr>`) of the table of `class` for load balancer `lb`,
/// each row's cells as text, header row left out.
fn rows(page: &str, class: &str, lb: &str) -> Vec<Vec<String>> {
    let open = format!("<table class=\"{class}\" data-lb=\"{lb}\">");
    let start = page.find(&open).unwrap_or_else(|| panic!("no {open}"));
    let table = &page[start..];
    let table = &table[..table.find("</table>").unwrap()];
    table
        .split("<tr>")
        .skip(2)
        .map(|row| {
            row.split("<td")
                .skip(1)
                .map(|cell| {
                    let cell = &cell[cell.find('>').unwrap() + 1..];
                    let cell = &cell[..cell.find("</td>").unwrap()];
                    strip_tags(cell)
                })
                .collect()
        })
        .collect()
}

fn strip_tags(s: &str) -> String {
    let mut out = String::new();
    let mut in_tag = false;
    for c in s.chars() {
        match c {
            '<' => in_tag = true,
            '>' => in_tag = false,
            c if !in_tag => out.push(c),
            _ => {}
        }
    }
    out
}

#[test]
fn every_load_balancer_listener_and_backend_is_on_the_page_coloured() {
    let page = render(&doc(2, false), &PageQuery::default());
    assert!(page.starts_with("<!DOCTYPE html>"), "{page}");
    assert!(page.contains("<span id=\"daemon\" class=\"good\">ready</span>"));
    for lb in ["ns0/svc-0", "ns1/svc-1"] {
        let b = rows(&page, "backends", lb);
        assert_eq!(b.len(), 3, "{b:?}");
        assert_eq!(&b[0][..4], ["10.52.0.1", "healthy", "ready", "yes"]);
        assert_eq!(&b[1][..4], ["10.52.0.2", "unhealthy", "ready", "no"]);
        assert_eq!(b[1][5], "refused 9s ago", "{b:?}");
        assert_eq!(b[1][7], "connection refused");
        assert_eq!(&b[2][..4], ["10.52.0.3", "healthy", "drain", "no"]);
        let l = rows(&page, "listeners", lb);
        assert_eq!(l.len(), 2);
        assert_eq!(l[0][4], "listening");
        assert_eq!(l[1][4], "failed");
        assert_eq!(l[1][6], "3 flows");
        assert_eq!(l[1][8], "Address in use (os error 98)");
    }
    // State colours: green serving, amber by choice, red broken.
    assert!(page.contains("<td class=\"bad\">unhealthy</td>"));
    assert!(page.contains("<td class=\"warn\">drain</td>"));
    // Out of rotation by the operator's choice: amber, not red.
    assert!(page.contains("<td class=\"warn\">drain</td><td class=\"warn\">no</td>"));
    assert!(page.contains("<td class=\"good\">ready</td><td class=\"bad\">no</td>"));
    assert!(page.contains("<td class=\"bad\">failed</td>"));
    assert!(page.contains("<span class=\"warn\">1 of 3 backends eligible</span>"));
    // The VIP's holder and announcement.
    assert!(page.contains("<td class=\"good\">MASTER</td>"), "{page}");
    assert!(page.contains("<span class=\"good\">announced</span> since"));
    // Without totals in the document, no totals columns.
    assert!(!page.contains("<th>connections</th>"));
    // Nothing loaded from elsewhere.
    for external in [
        "<script", "<link", "<img", "src=", "http://", "https://", "@import", "url(",
    ] {
        assert!(!page.contains(external), "{external}");
    }
}

#[test]
fn totals_show_when_the_document_has_them() {
    let page = render(&doc(1, true), &PageQuery::default());
    assert!(page.contains("<th>connections</th><th>to backend</th><th>to client</th><th>connect failures</th><th>check failures</th><th>down</th><th>last change</th>"));
    let b = rows(&page, "backends", "ns0/svc-0");
    assert_eq!(
        &b[1][8..],
        ["2000", "5.7 MiB", "1.0 KiB", "1", "4", "1m 15s", "11s ago"],
        "{b:?}"
    );
    assert_eq!(b[0][14], "-", "no change yet: {b:?}");
}

#[test]
fn every_string_is_escaped() {
    let mut d = doc(1, false);
    let hostile = "<script>alert(1)</script>\"'&\u{1b}[8m";
    d["load_balancers"][0]["name"] = json!(hostile);
    d["load_balancers"][0]["listeners"][1]["error"] = json!(hostile);
    d["load_balancers"][0]["backends"][1]["probe"]["last_error"] = json!(hostile);
    d["config"]["problem"] = json!(hostile);
    d["conntrack_sync"]["instances"][0]["instance"] = json!(hostile);
    let page = render(
        &d,
        &PageQuery {
            lb: "<script>".into(),
            ..PageQuery::default()
        },
    );
    assert!(!page.contains("<script"), "{page}");
    assert!(!page.contains('\u{1b}'));
    assert!(page.contains("&lt;script&gt;alert(1)&lt;/script&gt;&quot;&#39;&amp;\\x1b[8m"));
}

#[test]
fn a_page_at_ten_thousand_load_balancers_is_bounded() {
    let d = doc(10_000, true);
    let page = render(&d, &PageQuery::default());
    let sections = page.matches("<section class=\"lb\"").count();
    assert_eq!(sections, PAGE_SIZE);
    // The bound the module states: under 400 KB at 3 backends and 2
    // listeners each, whatever the number of load balancers.
    assert!(page.len() < 400_000, "{} bytes", page.len());
    assert!(
        page.contains("<span id=\"range\">1–100 of 10000</span>"),
        "{}",
        &page[..3000]
    );
    assert!(page.contains("page 1 of 100 <a rel=\"next\" href=\"/status.html?page=2\">"));

    // The last page; past it, a page that says there is none.
    let last = render(
        &d,
        &PageQuery {
            page: 100,
            ..PageQuery::default()
        },
    );
    assert!(last.contains("data-lb=\"ns3/svc-9999\""));
    assert!(last.contains("<a rel=\"prev\" href=\"/status.html?page=99\">"));
    let past = render(
        &d,
        &PageQuery {
            page: 101,
            ..PageQuery::default()
        },
    );
    assert!(past.contains("no page 101: there are 100"), "{past}");
    assert_eq!(past.matches("<section class=\"lb\"").count(), 0);

    // A filter: its matches alone, paged, the filter kept in the links.
    let q = PageQuery {
        lb: "ns3/".into(),
        page: 2,
        ..PageQuery::default()
    };
    let filtered = render(&d, &q);
    let names: Vec<&str> = filtered
        .split("<section class=\"lb\" data-lb=\"")
        .skip(1)
        .map(|s| &s[..s.find('"').unwrap()])
        .collect();
    assert_eq!(names.len(), PAGE_SIZE);
    assert!(names.iter().all(|n| n.starts_with("ns3/")), "{names:?}");
    assert!(
        filtered
            .contains("<span id=\"range\">101–200 of 1429</span> matching “ns3/” (10000 in all)"),
        "{}",
        &filtered[..3000]
    );
    assert!(filtered.contains("href=\"/status.html?page=3&amp;lb=ns3/\""));
    assert!(!filtered.contains("http-equiv"));
    // Reloading by the browser, kept through the links and the filter.
    let reloading = render(
        &d,
        &PageQuery {
            refresh: Some(10),
            ..q
        },
    );
    assert!(reloading.contains("<meta http-equiv=\"refresh\" content=\"10\">"));
    assert!(reloading.contains("href=\"/status.html?page=3&amp;lb=ns3/&amp;refresh=10\""));
    assert!(reloading.contains("<input type=\"hidden\" name=\"refresh\" value=\"10\">"));
    assert!(
        reloading.contains("href=\"/status.html?page=2&amp;lb=ns3/\">reloads every 10 s: stop</a>")
    );
    assert!(
        filtered.contains(
            "href=\"/status.html?page=2&amp;lb=ns3/&amp;refresh=10\">reload every 10 s</a>"
        )
    );
    let none = render(
        &d,
        &PageQuery {
            lb: "nope".into(),
            ..PageQuery::default()
        },
    );
    assert!(none.contains("no load balancer matches"));
}

#[test]
fn the_query_names_what_is_wrong() {
    assert_eq!(parse_query(""), Ok(PageQuery::default()));
    assert_eq!(
        parse_query("lb=ns%2Fweb+x&page=3"),
        Ok(PageQuery {
            lb: "ns/web x".into(),
            page: 3,
            refresh: None
        })
    );
    assert_eq!(parse_query("refresh=10").map(|q| q.refresh), Ok(Some(10)));
    for bad in ["refresh=4", "refresh=3601", "refresh=", "refresh=1s"] {
        let e = parse_query(bad).unwrap_err().to_string();
        assert!(e.contains("from 5 to 3600"), "{bad}: {e}");
    }
    assert_eq!(parse_query("page=0"), Err(PageQueryError::Page("0".into())));
    assert_eq!(
        parse_query("page=two"),
        Err(PageQueryError::Page("two".into()))
    );
    assert_eq!(parse_query("lb=a&lb=b"), Err(PageQueryError::Twice("lb")));
    let e = parse_query("vip=10.0.0.1").unwrap_err().to_string();
    assert!(
        e.contains("\"vip\"") && e.contains("lb=SUBSTRING") && e.contains("page=N"),
        "{e}"
    );
}

//! `harvester-lb status` against a running daemon: the table shows each
//! backend's health, operator state, runs and last probe; `--json` is the
//! daemon's `/status`; the admin socket is used when it can be opened, the
//! TCP listener otherwise; an unreachable daemon is exit 69. And the same
//! `/status` as a page (`/status.html`), as a real browser (headless
//! Chromium) shows it.

mod support;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{
    Backend, Behaviour, Config, Daemon, Lb, Subnet, cannot_run, cli, find_tool, http_unix,
    missing_tool, whoami,
};

/// `default/web` on `.100:8080`: backends `.1` and `.2` on port 30080,
/// checked every second, down at the first failure.
fn web(net: &Subnet) -> Lb {
    Lb::new("default/web", net.ip(100))
        .keys("cluster = \"prod\"")
        .backends(net.ips(&[1, 2]))
        .tcp("http", 8080, 30080)
        .health(
            "  port = 30080\n  failure_threshold = 1\n  period_seconds = 1\n  timeout_seconds = 1",
        )
}

/// The daemon on `config` (with [`web`]) and a backend on `.1` alone,
/// once `.1` is checked healthy and `.2` (nothing there) unhealthy.
async fn start_checked(net: &Subnet, config: Config) -> (Daemon, Backend) {
    let backend = Backend::start(SocketAddr::new(net.ip(1), 30080), Behaviour::NameThenEcho).await;
    let daemon = Daemon::start(net, &config).await;
    for (host, health) in [(2, "unhealthy"), (1, "healthy")] {
        daemon
            .wait_health(
                "default/web",
                &net.ip_str(host),
                health,
                Duration::from_secs(10),
            )
            .await;
    }
    (daemon, backend)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_table_shows_what_status_says_through_the_socket_or_tcp() {
    let net = Subnet::new();
    let lb = web(&net);
    let (daemon, backend) = start_checked(&net, Config::on(&net).lb(lb.clone())).await;
    let path = daemon.config.to_str().unwrap().to_string();

    let (code, table, stderr) = cli(vec!["status".into(), "--config".into(), path.clone()]).await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.starts_with("daemon: ready\n"), "{table}");
    let header = table
        .lines()
        .find(|l| l.starts_with("default/web"))
        .expect("lb row");
    assert!(
        header.contains(&net.ip_str(100)) && header.contains("1/2"),
        "{table}"
    );
    let down = table
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{} ", net.ip_str(2))))
        .expect("down backend row");
    let cells: Vec<&str> = down.split_whitespace().collect();
    assert_eq!(&cells[1..4], ["unhealthy", "ready", "no"], "{down}");
    assert_eq!(cells[6], "refused", "{down}");
    assert!(cells[7].ends_with('s'), "an age: {down}");
    let listener = table
        .lines()
        .find(|l| l.contains("listening"))
        .expect("listener row");
    assert!(
        listener.contains(&format!("{}:8080", net.ip_str(100))),
        "{table}"
    );

    // --json is the daemon's /status.
    let (code, json, _) = cli(vec![
        "status".into(),
        "--json".into(),
        "--config".into(),
        path,
    ])
    .await;
    assert_eq!(code, 0);
    let doc: serde_json::Value = serde_json::from_str(&json).expect("JSON");
    assert_eq!(doc["load_balancers"][0]["name"], "default/web");

    // Without a socket to open: admin.listen answers.
    let no_socket = net.write(
        "tcp-only.toml",
        &Config::on(&net)
            .socket(Path::new("/nonexistent/harvester-lb.sock"))
            .lb(lb.clone())
            .to_string(),
    );
    let (code, table, stderr) = cli(vec![
        "status".into(),
        "-c".into(),
        no_socket.to_str().unwrap().into(),
    ])
    .await;
    assert_eq!(code, 0, "{stderr}");
    assert!(table.contains("default/web"), "{table}");

    // Nobody there: 69, naming where it asked.
    let nowhere = net.write(
        "nowhere.toml",
        &Config::new()
            .admin(SocketAddr::new(net.ip(249), 9901))
            .socket(Path::new("/nonexistent/harvester-lb.sock"))
            .lb(lb)
            .to_string(),
    );
    let (code, _, stderr) = cli(vec![
        "status".into(),
        "-c".into(),
        nowhere.to_str().unwrap().into(),
    ])
    .await;
    assert_eq!(code, 69, "{stderr}");
    assert!(
        stderr.contains("cannot reach the daemon's admin API"),
        "{stderr}"
    );
    daemon.stop().await;
    backend.stop();
}

/// What headless Chromium made of `url`: the DOM after loading it
/// (`--dump-dom`), or with `screenshot` a PNG written there. Bounded (60 s,
/// then killed), with a profile of its own in a temporary directory that
/// is removed after, and kept off every network but loopback: its own
/// background traffic is off, and whatever it would still send elsewhere
/// goes to a proxy on 127.0.0.1:9 that refuses (loopback is never
/// proxied). `--no-sandbox`: its sandbox refuses to run as root, as the
/// tests do.
async fn chromium(chromium: &Path, url: &str, screenshot: Option<&Path>) -> String {
    let profile = std::env::temp_dir().join(format!(
        "hlb-chromium-{}-{}",
        std::process::id(),
        screenshot.is_some()
    ));
    let _ = std::fs::remove_dir_all(&profile);
    let mut cmd = tokio::process::Command::new(chromium);
    cmd.args([
        "--headless",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",
        "--no-first-run",
        "--no-default-browser-check",
        "--disable-background-networking",
        "--disable-component-update",
        "--disable-sync",
        "--disable-extensions",
        "--proxy-server=127.0.0.1:9",
        "--window-size=1280,900",
    ])
    .arg(format!("--user-data-dir={}", profile.display()));
    match screenshot {
        Some(png) => cmd.arg(format!("--screenshot={}", png.display())),
        None => cmd.arg("--dump-dom"),
    };
    cmd.arg(url).kill_on_drop(true);
    let out = tokio::time::timeout(Duration::from_secs(60), cmd.output())
        .await
        .unwrap_or_else(|_| panic!("chromium did not finish {url} within 60 s"))
        .unwrap_or_else(|e| panic!("run {}: {e}", chromium.display()));
    let _ = std::fs::remove_dir_all(&profile);
    assert!(
        out.status.success(),
        "chromium {url}: {}\n{}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The cells (text, tags removed) and each cell's class, of every row
/// but the header of the table `<table class="{class}" data-lb="{lb}">` in
/// `dom`.
fn table_rows(dom: &str, class: &str, lb: &str) -> Vec<Vec<(String, String)>> {
    let open = format!("<table class=\"{class}\" data-lb=\"{lb}\">");
    let start = dom
        .find(&open)
        .unwrap_or_else(|| panic!("no {open} in the page:\n{dom}"));
    let table = &dom[start..];
    let table = &table[..table.find("</table>").expect("table closed")];
    let mut rows = Vec::new();
    for row in table.split("<tr>").skip(2) {
        let mut cells = Vec::new();
        for cell in row.split("<td").skip(1) {
            let (attrs, rest) = cell.split_once('>').expect("cell tag");
            let class = attrs
                .split_once("class=\"")
                .map(|(_, c)| c[..c.find('"').unwrap_or(0)].to_string())
                .unwrap_or_default();
            let body = &rest[..rest.find("</td>").expect("cell closed")];
            let mut text = String::new();
            let mut in_tag = false;
            for c in body.chars() {
                match c {
                    '<' => in_tag = true,
                    '>' => in_tag = false,
                    c if !in_tag => text.push(c),
                    _ => {}
                }
            }
            cells.push((text, class));
        }
        rows.push(cells);
    }
    rows
}

/// The status page in a real browser: headless Chromium loads
/// `/status.html` from the daemon's `admin.listen`, and the table it
/// rendered has every backend with its state (healthy green, refused red)
/// and every listener; `?lb=` keeps only the matches; a screenshot is
/// written to `target/tmp/status-page.png` (look at it). The admin socket
/// serves the same page; a bad query is a 400 naming it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_status_page_in_a_real_browser_shows_every_backend_coloured() {
    const TEST: &str = "the_status_page_in_a_real_browser_shows_every_backend_coloured";
    if cannot_run(TEST, [missing_tool("chromium", "chromium")]) {
        return;
    }
    let browser = find_tool("chromium").expect("found above");
    let net = Subnet::new();
    let api = Lb::new("other/api", net.ip(101))
        .backends(net.ips(&[1]))
        .tcp("api", 8443, 30080);
    let (daemon, backend) = start_checked(&net, Config::on(&net).lb(web(&net)).lb(api)).await;

    // One connection through default/web (to .1, the one eligible). Where
    // /status has per-backend totals (issue 43 item 3), the page shows
    // them: 1 connection to .1.
    whoami(SocketAddr::new(net.ip(100), 8080))
        .await
        .expect("default/web serves through .1");
    let totals = daemon.backend_status("default/web", &net.ip_str(1)).await["totals"].clone();

    let url = format!("http://{}/status.html", daemon.admin);
    let dom = chromium(&browser, &url, None).await;
    assert!(
        dom.contains("<span id=\"daemon\" class=\"good\">ready</span>"),
        "{dom}"
    );
    let backends = table_rows(&dom, "backends", "default/web");
    assert_eq!(backends.len(), 2, "{backends:?}");
    let up = &backends[0];
    assert_eq!(up[0].0, net.ip_str(1));
    assert_eq!(up[1], ("healthy".into(), "good".into()), "{up:?}");
    assert_eq!(up[2], ("ready".into(), "good".into()), "{up:?}");
    assert_eq!(up[3], ("yes".into(), "good".into()), "{up:?}");
    let down = &backends[1];
    assert_eq!(down[0].0, net.ip_str(2));
    assert_eq!(down[1], ("unhealthy".into(), "bad".into()), "{down:?}");
    assert_eq!(down[3], ("no".into(), "bad".into()), "{down:?}");
    assert!(down[5].0.starts_with("refused "), "{down:?}");
    if totals.is_object() {
        assert_eq!(up.len(), 15, "the totals' 7 columns: {up:?}");
        assert_eq!(up[8].0, "1", "connections to .1: {up:?}");
    } else {
        assert_eq!(
            up.len(),
            8,
            "no totals in /status, none on the page: {up:?}"
        );
    }
    let listeners = table_rows(&dom, "listeners", "default/web");
    assert_eq!(listeners.len(), 1, "{listeners:?}");
    assert_eq!(listeners[0][1].0, format!("{}:8080", net.ip_str(100)));
    assert_eq!(
        listeners[0][4],
        ("listening".into(), "good".into()),
        "{listeners:?}"
    );
    assert!(dom.contains("data-lb=\"other/api\""), "{dom}");
    // Nothing on the page asks for anything beyond it.
    for external in ["<script", "<link", "<img", "src=\"", "url("] {
        assert!(!dom.contains(external), "{external} in {dom}");
    }

    // The filter: the matches alone.
    let dom = chromium(&browser, &format!("{url}?lb=other%2F"), None).await;
    assert!(dom.contains("data-lb=\"other/api\""), "{dom}");
    assert!(!dom.contains("data-lb=\"default/web\""), "{dom}");
    assert_eq!(table_rows(&dom, "backends", "other/api").len(), 1);

    // The screenshot, for a person to look at.
    let png = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join("status-page.png");
    let _ = std::fs::remove_file(&png);
    chromium(&browser, &url, Some(&png)).await;
    let image = std::fs::read(&png).unwrap_or_else(|e| panic!("{}: {e}", png.display()));
    assert!(
        image.starts_with(b"\x89PNG\r\n\x1a\n") && image.len() > 10_000,
        "{}: {} bytes, not a screenshot of a page",
        png.display(),
        image.len()
    );

    // The admin socket serves the same page; a bad query is a 400.
    let (code, page) = http_unix(&daemon.socket, "GET", "/status.html", "").await;
    assert_eq!(code, 200, "{page}");
    assert!(page.contains("<table class=\"backends\" data-lb=\"default/web\">"));
    let (code, body) = daemon.get("/status.html?page=0").await;
    assert_eq!(code, 400, "{body}");
    assert!(body.contains("page \"0\" is not a page number"), "{body}");

    daemon.stop().await;
    backend.stop();
}

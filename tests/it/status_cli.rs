//! `harvester-lb status` against a running daemon: the table shows each
//! backend's health, operator state, runs and last probe; `--json` is the
//! daemon's `/status`; the admin socket is used when it can be opened, the
//! TCP listener otherwise; an unreachable daemon is exit 69. Each
//! backend's totals (issue 43: connections, bytes each way, connect and
//! check failures, time down, last change) agree in `/status`, `/metrics`
//! and the table. And the same `/status` as a page (`/status.html`), as a
//! real browser (headless Chromium) shows it.

use crate::support;

use harvester_lb::metrics::names;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use support::{
    Backend, Behaviour, Config, Daemon, Lb, Listener, Subnet, cannot_run, cli, find_tool,
    http_unix, missing_tool, udp_echo, wait_for, whoami,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

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

/// Per-backend totals over a TCP and a UDP listener of the proxy: .1
/// serves both; .2 passes the check (on its own port) but refuses the TCP
/// nodeport, so every connection tried on it first is a connect failure
/// retried onto .1; .3 answers nothing and goes down. `/status`'s
/// `totals` counts exactly what the clients did, `/metrics` says the same,
/// and `status` shows it. Loopback only; about 4 s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_backend_s_totals_count_what_its_clients_did() {
    const LB: &str = "default/totals";
    const CONNECTIONS: usize = 6;
    let net = Subnet::new();
    let lb = Lb::new(LB, net.ip(100))
        .backends(net.ips(&[1, 2, 3]))
        .keys("algorithm = \"round_robin\"")
        .tcp("http", 8080, 30080)
        .listener(Listener::new("dns", 5353, 30053).udp())
        .health(
            "  port = 30099\n  failure_threshold = 1\n  period_seconds = 1\n  timeout_seconds = 1",
        );
    let config = Config::on(&net).lb(lb);
    let mut kept = Vec::new();
    for h in [1, 2] {
        kept.push(Backend::start(SocketAddr::new(net.ip(h), 30099), Behaviour::NameThenEcho).await);
    }
    kept.push(Backend::start(SocketAddr::new(net.ip(1), 30080), Behaviour::NameThenEcho).await);
    let udp = [
        udp_echo(SocketAddr::new(net.ip(1), 30053)).await,
        udp_echo(SocketAddr::new(net.ip(2), 30053)).await,
    ];
    let daemon = Daemon::start(&net, &config).await;
    let (one, two, three) = (net.ip_str(1), net.ip_str(2), net.ip_str(3));
    daemon
        .wait_health(LB, &three, "unhealthy", Duration::from_secs(10))
        .await;

    // TCP: each client sends 6 bytes and reads to the end (.1's name, a
    // newline, the echo).
    let mut from_backends = 0u64;
    for _ in 0..CONNECTIONS {
        let mut c = tokio::net::TcpStream::connect(SocketAddr::new(net.ip(100), 8080))
            .await
            .expect("connect to the VIP");
        c.write_all(b"hello\n").await.unwrap();
        c.shutdown().await.unwrap();
        let mut got = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), c.read_to_end(&mut got))
            .await
            .expect("the answer within 10 s")
            .unwrap();
        assert!(got.starts_with(format!("{one}\n").as_bytes()), "{got:?}");
        from_backends += got.len() as u64;
    }
    // UDP: one flow, one datagram each way.
    let client = tokio::net::UdpSocket::bind(SocketAddr::new(net.ip(200), 0))
        .await
        .unwrap();
    client
        .send_to(b"ping-1234", SocketAddr::new(net.ip(100), 5353))
        .await
        .unwrap();
    let mut buf = [0u8; 64];
    let (n, _) = tokio::time::timeout(Duration::from_secs(10), client.recv_from(&mut buf))
        .await
        .expect("the echo within 10 s")
        .unwrap();
    assert_eq!(&buf[..n], b"ping-1234");

    // Counted as the bytes move: wait until the last ones are in.
    let (to_backends, to_clients) = (6 * CONNECTIONS as u64 + 9, from_backends + 9);
    let totals = wait_for(Duration::from_secs(10), "the totals to add up", || async {
        let mut t = Vec::new();
        for ip in [&one, &two, &three] {
            t.push(daemon.backend_status(LB, ip).await["totals"].clone());
        }
        let sum = |k: &str| t.iter().map(|b| b[k].as_u64().unwrap_or(0)).sum::<u64>();
        // .3's time down counts in tenths of a second.
        let down = t[2]["down_seconds"].as_f64().unwrap_or(0.0) > 0.0;
        (sum("bytes_to_backend") == to_backends && sum("bytes_to_client") == to_clients && down)
            .then_some(t)
    })
    .await;
    let (t1, t2, t3) = (&totals[0], &totals[1], &totals[2]);
    // Every TCP connection on .1; the UDP flow on .1 or .2.
    assert_eq!(
        t1["connections"].as_u64().unwrap() + t2["connections"].as_u64().unwrap(),
        CONNECTIONS as u64 + 1,
        "{totals:?}"
    );
    assert!(
        t1["connections"].as_u64().unwrap() >= CONNECTIONS as u64,
        "{totals:?}"
    );
    assert_eq!(t3["connections"], 0, "{totals:?}");
    // Round robin over .1 and .2 tries .2 first for every other client.
    assert!(t2["connect_failures"].as_u64().unwrap() >= 2, "{totals:?}");
    assert_eq!(t1["connect_failures"], 0, "{totals:?}");
    // .3: its checks fail, it is down and its state changed; .1 is neither.
    assert!(t3["check_failures"].as_u64().unwrap() >= 1, "{totals:?}");
    assert!(t3["down_seconds"].as_f64().unwrap() > 0.0, "{totals:?}");
    let changed = t3["last_change_unix"].as_f64().expect("a change, dated");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs_f64();
    assert!(
        changed <= now && changed > now - 300.0,
        "{changed} vs {now}"
    );
    assert_eq!(t1["check_failures"], 0, "{totals:?}");
    assert_eq!(t1["down_seconds"], 0.0, "{totals:?}");
    assert!(t1["last_change_unix"].is_null(), "{totals:?}");

    // /metrics says the same.
    let (_, metrics) = daemon.get("/metrics").await;
    let series = |family: &str, ip: &str, extra: &str| {
        support::metric_value(
            &metrics,
            &format!(
                "{family}{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{ip}\"{extra}}}"
            ),
        )
    };
    // Bytes by direction are outcomes: a direction no byte took has no
    // sample (a backend that only accepted, say).
    let bytes = |ip: &str, direction: &str| {
        support::outcomes(
            &metrics,
            &names::BACKEND_BYTES,
            &[
                ("load_balancer", LB),
                ("backend", ip),
                ("direction", direction),
            ],
        )
    };
    for (ip, t) in [(&one, t1), (&two, t2)] {
        assert_eq!(
            series("harvester_lb_backend_connections_total", ip, ""),
            t["connections"].as_f64().unwrap(),
            "{ip}"
        );
        assert_eq!(
            bytes(ip, "client_to_backend"),
            t["bytes_to_backend"].as_f64().unwrap(),
            "{ip}"
        );
        assert_eq!(
            bytes(ip, "backend_to_client"),
            t["bytes_to_client"].as_f64().unwrap(),
            "{ip}"
        );
    }
    assert!(series("harvester_lb_backend_down_seconds_total", &three, "") > 0.0);
    assert!(
        (series(
            "harvester_lb_backend_last_change_timestamp_seconds",
            &three,
            ""
        ) - changed)
            .abs()
            < 0.01
    );
    assert!(
        !metrics.contains(&format!(
            "harvester_lb_backend_last_change_timestamp_seconds{{cluster=\"kubernetes\",load_balancer=\"{LB}\",backend=\"{one}\""
        )),
        "no change, no series"
    );

    // The table: .1's row carries its connections.
    let path = daemon.config.to_str().unwrap().to_string();
    let (code, table, stderr) = cli(vec!["status".into(), "--config".into(), path]).await;
    assert_eq!(code, 0, "{stderr}");
    let header = table
        .lines()
        .find(|l| l.trim_start().starts_with("BACKEND "))
        .expect("backend header");
    assert!(
        header.contains("TOTAL") && header.contains("BYTES IN/OUT") && header.contains("DOWN"),
        "{header}"
    );
    let row = table
        .lines()
        .find(|l| l.trim_start().starts_with(&format!("{one} ")))
        .expect(".1's row");
    assert!(
        row.split_whitespace()
            .any(|c| c.parse::<u64>().ok() == t1["connections"].as_u64()),
        "{row}"
    );
    daemon.stop().await;
    for b in kept {
        b.stop();
    }
    for u in udp {
        u.abort();
    }
}

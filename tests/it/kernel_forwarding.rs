//! `forwarding = "kernel"` on a real kernel: the table the daemon writes
//! loads into `nft`, reconciles after a restart, and forwards by itself
//! (a frozen daemon still serves), following health verdicts and the
//! operator's drain, and refusing when no backend is eligible.
//!
//! These tests need root, iproute2 and nftables (network namespaces); they
//! skip with a printed reason elsewhere, and fail under `CI=true`.

// The test bed times real processes and kernels, not tokio tasks.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::collections::BTreeMap;
use std::io::ErrorKind;
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use harvester_lb::config::{Algorithm, Protocol};
use harvester_lb::host::nat::{self as kernel, KernelListener, KernelTable, Synced};
use netns::peers::{Exchange, Node, Service, exchange, read_line};
use netns::{Bed, HEALTH_PORT, NODEPORT, Scratch, VIP, config, in_ns, node_ip, run, sa, wait_for};
use support::{Config, Lb, Listener};

/// The first listener's `/status` once it shows a `kernel_error` (the
/// reason it is served by the proxy).
async fn served_by_proxy_because(bed: &Bed) -> serde_json::Value {
    wait_for(
        Duration::from_secs(10),
        "a kernel_error in /status",
        || async {
            let s = bed.daemon().status().await;
            let l = s["load_balancers"][0]["listeners"][0].clone();
            l["kernel_error"].is_string().then_some(l)
        },
    )
    .await
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

fn listener(eligible: &[&str], members: &[&str]) -> KernelListener {
    let ips = |v: &[&str]| v.iter().map(|m| ip(m)).collect();
    KernelListener::round_robin(NODEPORT, ips(members), ips(eligible))
}

/// `nft` in namespace `ns`.
fn nft_out(ns: &str, args: &[&str]) -> (bool, String) {
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", ns])
        .arg("nft")
        .args(args)
        .output()
        .expect("run nft");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr),
    )
}

#[test]
fn the_table_loads_reconciles_after_a_restart_and_goes_at_stop() {
    require_netns!();
    let ns = Scratch::new("tbl");
    let a = (ip("192.0.2.10"), Protocol::Tcp, 80);
    let b = (ip("2001:db8::10"), Protocol::Udp, 53);
    let mut first = BTreeMap::new();
    first.insert(
        a,
        listener(&["10.0.0.1", "10.0.0.2"], &["10.0.0.1", "10.0.0.2"]),
    );
    let mut v6 = listener(&[], &["2001:db8::1"]);
    v6.source_ranges = Some(vec!["2001:db8::/48".parse().unwrap()]);
    first.insert(b, v6);

    let name = ns.0.clone();
    let desired = first.clone();
    let (written, again) = in_ns(&name, move || {
        let table = KernelTable::new();
        (table.sync(&desired), table.sync(&desired))
    });
    assert!(matches!(written, Ok(Synced::Written(_))), "{written:?}");
    assert_eq!(
        again,
        Ok(Synced::Unchanged),
        "no nft call when nothing changed"
    );
    let (ok, listing) = nft_out(&ns.0, &["list", "ruleset"]);
    assert!(ok, "{listing}");
    for want in [
        "192.0.2.10 . tcp . 80 : goto l_tcp_80_192.0.2.10",
        "numgen inc mod 2 0 counter name \"n_tcp_80_192.0.2.10_10.0.0.1\" meta l4proto tcp dnat ip to 10.0.0.1:30080",
        "counter name \"n_tcp_80_192.0.2.10_10.0.0.2\" meta l4proto tcp dnat ip to 10.0.0.2:30080",
        "2001:db8::10 . udp . 53 : goto l_udp_53_2001-db8--10",
        "ip6 saddr != @s_udp_53_2001-db8--10 counter name \"d_udp_53_2001-db8--10\" return",
        "counter name \"z_udp_53_2001-db8--10\" return",
        "type nat hook output priority -100",
    ] {
        assert!(listing.contains(want), "want {want:?} in\n{listing}");
    }

    // A restarted daemon (a new table owner) with one listener fewer and
    // one backend fewer: the leftovers go in the same transaction, the
    // table and the counters that stay do not.
    let mut second = BTreeMap::new();
    second.insert(a, listener(&["10.0.0.1"], &["10.0.0.1"]));
    let desired = second.clone();
    let (synced, owned) = in_ns(&name, move || {
        let table = KernelTable::new();
        let synced = table.sync(&desired);
        (synced, kernel::read_back())
    });
    assert!(matches!(synced, Ok(Synced::Written(_))), "{synced:?}");
    assert_eq!(owned.unwrap(), kernel::TableObjects::of(&second));
    let (_, listing) = nft_out(&ns.0, &["list", "ruleset"]);
    assert!(!listing.contains("10.0.0.2"), "{listing}");
    assert!(!listing.contains("2001:db8::10"), "{listing}");

    // The last kernel listener switched back to the proxy: all its objects go.
    let desired = second.clone();
    let emptied = in_ns(&name, move || {
        let table = KernelTable::new();
        table.sync(&desired).unwrap();
        (table.sync(&BTreeMap::new()), kernel::read_back())
    });
    assert!(
        matches!(emptied.0, Ok(Synced::Written(_))),
        "{:?}",
        emptied.0
    );
    // The main table stays, empty, until the clean stop.
    assert_eq!(
        emptied.1.unwrap(),
        kernel::TableObjects::of(&BTreeMap::new()),
        "only the main table is left"
    );

    // A clean stop removes the table.
    let desired = second.clone();
    let removed = in_ns(&name, move || {
        let table = KernelTable::new();
        table.sync(&desired).unwrap();
        table.remove()
    });
    assert_eq!(removed, Ok(()));
    let (_, listing) = nft_out(&ns.0, &["list", "tables"]);
    assert!(
        !listing.contains(kernel::TABLE),
        "every table is gone after a clean stop: {listing}"
    );
}

/// `source_ip` bucket maps and affinity sets, IPv4 and IPv6, load into the
/// kernel and are read back; a restarted owner without them deletes them.
#[test]
fn bucket_maps_and_affinity_sets_load_and_a_restart_without_them_deletes_them() {
    require_netns!();
    let ns = Scratch::new("maps");
    let a = (ip("192.0.2.10"), Protocol::Tcp, 80);
    let b = (ip("2001:db8::10"), Protocol::Udp, 53);
    let mut first = BTreeMap::new();
    let mut v4 = listener(&["10.0.0.1", "10.0.0.2"], &["10.0.0.1", "10.0.0.2"]);
    v4.pick = Algorithm::SourceIp;
    v4.affinity = Some(Duration::from_secs(600));
    first.insert(a, v4);
    let mut v6 = listener(&["2001:db8::1"], &["2001:db8::1", "2001:db8::2"]);
    v6.pick = Algorithm::SourceIp;
    v6.affinity = Some(Duration::from_secs(30));
    first.insert(b, v6);

    let name = ns.0.clone();
    let desired = first.clone();
    let (written, owned) = in_ns(&name, move || {
        let table = KernelTable::new();
        (table.sync(&desired), kernel::read_back())
    });
    assert!(matches!(written, Ok(Synced::Written(_))), "{written:?}");
    assert_eq!(owned.unwrap(), kernel::TableObjects::of(&first));
    let (ok, listing) = nft_out(&ns.0, &["list", "ruleset"]);
    assert!(ok, "{listing}");
    for want in [
        "jhash ip saddr mod 4093 seed 0x68626c62 vmap @m_tcp_80_192.0.2.10",
        "jhash ip6 saddr mod 4093 seed 0x68626c62 vmap @m_udp_53_2001-db8--10",
        "ip saddr @a_tcp_80_192.0.2.10_10.0.0.1 goto b_tcp_80_192.0.2.10_10.0.0.1",
        "update @a_tcp_80_192.0.2.10_10.0.0.2 { ip saddr }",
        "update @a_udp_53_2001-db8--10_2001-db8--2 { ip6 saddr }",
        "timeout 30s",
        "4092 : goto b_tcp_80_192.0.2.10_10.0.0.",
    ] {
        assert!(listing.contains(want), "want {want:?} in\n{listing}");
    }
    assert!(
        !listing.contains("ip6 saddr @a_udp_53_2001-db8--10_2001-db8--2 goto"),
        "not eligible: no affinity lookup"
    );
    // The kernel's buckets are the user-space fill, bucket for bucket.
    let (ok, json) = nft_out(
        &ns.0,
        &[
            "-j",
            "list",
            "map",
            "inet",
            &kernel::table_of(&a),
            "m_tcp_80_192.0.2.10",
        ],
    );
    assert!(ok, "{json}");
    let doc: serde_json::Value = serde_json::from_str(&json).unwrap();
    let elems = doc["nftables"][1]["map"]["elem"].as_array().unwrap();
    let mut got: Vec<(u64, String)> = elems
        .iter()
        .map(|e| {
            (
                e[0].as_u64().unwrap(),
                e[1]["goto"]["target"].as_str().unwrap().to_string(),
            )
        })
        .collect();
    got.sort();
    let want: Vec<(u64, String)> = kernel::buckets(&first[&a].eligible)
        .iter()
        .enumerate()
        .map(|(i, b)| (i as u64, format!("b_tcp_80_192.0.2.10_{b}")))
        .collect();
    assert_eq!(got, want);

    let mut second = BTreeMap::new();
    second.insert(a, listener(&["10.0.0.1"], &["10.0.0.1"]));
    let desired = second.clone();
    let (synced, owned) = in_ns(&name, move || {
        let table = KernelTable::new();
        (table.sync(&desired), kernel::read_back())
    });
    assert!(matches!(synced, Ok(Synced::Written(_))), "{synced:?}");
    assert_eq!(owned.unwrap(), kernel::TableObjects::of(&second));
}

#[test]
fn without_kernel_listeners_nothing_is_written() {
    require_netns!();
    let ns = Scratch::new("none");
    let synced = in_ns(&ns.0.clone(), || KernelTable::new().sync(&BTreeMap::new()));
    assert_eq!(synced, Ok(Synced::Unchanged));
    let (_, listing) = nft_out(&ns.0, &["list", "tables"]);
    assert!(!listing.contains(kernel::TABLE), "{listing}");
}

/// One load balancer on VIP:80 over `nodes`, forwarded by the kernel,
/// checked every second (1 s timeout, one failure marks a node down).
fn kernel_lb(nodes: &[usize]) -> Lb {
    web_lb(
        nodes,
        Listener::new("tcp", 80, NODEPORT).forwarding("kernel"),
    )
}

/// [`kernel_lb`] with `listener` instead of its own.
fn web_lb(nodes: &[usize], listener: Listener) -> Lb {
    Lb::new("default/web", VIP)
        .backends(nodes.iter().map(|i| node_ip(*i)))
        .listener(listener)
        .health_port(HEALTH_PORT)
        .health("  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1")
}

/// [`kernel_lb`] alone in the bed's config.
fn kernel_config(nodes: &[usize]) -> Config {
    config().lb(kernel_lb(nodes))
}

/// Sets node `node`'s operator state through the admin socket, as an
/// operator does.
fn set_state(bed: &Bed, lb: &str, node: usize, state: &str) {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_harvester-lb"))
        .args(["backend", state, "--lb", lb, &node_ip(node).to_string()])
        .arg("--socket")
        .arg(bed.dir.join("admin.sock"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// `nft list <kind> inet <table> <name>` in the bed's load-balancer
/// namespace, from whichever of the daemon's tables holds it (the error
/// text when none does).
fn listed(bed: &Bed, kind: &str, name: &str) -> String {
    let (_, tables) = nft_out(&bed.lb.name, &["list", "tables", "inet"]);
    let mut said = format!("no table of ours holds {kind} {name}: {tables}");
    for table in tables
        .split_whitespace()
        .filter(|t| t.starts_with(kernel::TABLE))
    {
        let (ok, out) = nft_out(&bed.lb.name, &["list", kind, "inet", table, name]);
        if ok {
            return out;
        }
        said = out;
    }
    said
}

/// Waits up to `timeout` until [`listed`] satisfies `ok`.
async fn wait_listed(
    bed: &Bed,
    (kind, name): (&str, &str),
    timeout: Duration,
    what: &str,
    ok: impl Fn(&str) -> bool,
) {
    wait_for(timeout, what, || async {
        ok(&listed(bed, kind, name)).then_some(())
    })
    .await;
}

/// Waits until the chain of the listener on VIP:80/tcp satisfies `ok`.
async fn wait_chain(bed: &Bed, what: &str, ok: impl Fn(&str) -> bool) {
    let chain = ("chain", "l_tcp_80_198.51.100.10");
    wait_listed(bed, chain, Duration::from_secs(5), what, ok).await;
}

/// A connection through VIP:80 that node `name` answered (round robin
/// reaches it within 4 tries).
async fn open_to(bed: &Bed, name: &str) -> tokio::net::TcpStream {
    for _ in 0..4 {
        let mut s = bed
            .client
            .connect(sa(VIP, 80), Duration::from_secs(5))
            .await
            .unwrap();
        if read_line(&mut s).await.unwrap() == name {
            return s;
        }
    }
    panic!("no connection reached {name} within 4 tries");
}

/// Starts the daemon on `config` and waits until the kernel forwards its
/// first listener.
async fn start_kernel(bed: &mut Bed, config: &Config) {
    bed.start_daemon(&config.to_string()).await;
    wait_kernel(bed).await;
}

async fn wait_kernel(bed: &Bed) {
    wait_for(
        Duration::from_secs(10),
        "the listener forwarded by the kernel",
        || async {
            let s = bed.daemon().status().await;
            let l = &s["load_balancers"][0]["listeners"][0];
            (l["forwarding"] == "kernel").then_some(())
        },
    )
    .await;
}

async fn tally(bed: &Bed, n: usize) -> BTreeMap<String, usize> {
    let mut seen = BTreeMap::new();
    for _ in 0..n {
        let key = match exchange(&bed.client, sa(VIP, 80), 100, Duration::from_secs(5)).await {
            Exchange::Ok(node) => node,
            Exchange::Failed(e) => format!("failed: {e}"),
        };
        *seen.entry(key).or_insert(0) += 1;
    }
    seen
}

fn counts(pairs: &[(&str, usize)]) -> BTreeMap<String, usize> {
    pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_kernel_balances_follows_health_and_serves_while_the_daemon_is_frozen() {
    require_netns!();
    let mut bed = Bed::new("kfwd", 2);
    bed.enable_forwarding();
    let n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let mut n2 = Node::start(&bed, 2, Service::NameThenEcho);
    start_kernel(&mut bed, &kernel_config(&[1, 2])).await;

    // Round robin in the kernel: exactly alternating.
    assert_eq!(tally(&bed, 20).await, counts(&[("n1", 10), ("n2", 10)]));
    let (ok, listing) = nft_out(&bed.lb.name, &["list", "counters"]);
    assert!(
        ok && listing.contains("n_tcp_80_198.51.100.10_198.51.100.21"),
        "{listing}"
    );

    // The kernel's counts reach /metrics (read every 5 s), with the
    // host's conntrack use beside them.
    wait_for(
        Duration::from_secs(15),
        "the kernel's counts in /metrics",
        || async {
            let m = bed.daemon().metrics().await;
            let n = |ip: &str| {
                netns::metric_sample(
                    &m,
                    "harvester_lb_kernel_backend_connections_total",
                    &[("backend", ip), ("listener", "tcp")],
                )
            };
            (n("198.51.100.21") == Some(10.0) && n("198.51.100.22") == Some(10.0)).then_some(())
        },
    )
    .await;
    // /status totals: the kernel's new connections (as that read left
    // them), no bytes and no connect failures (the kernel path has none).
    let s = bed.daemon().status().await;
    for (i, ip) in ["198.51.100.21", "198.51.100.22"].iter().enumerate() {
        let b = &s["load_balancers"][0]["backends"][i];
        assert_eq!(b["address"], *ip, "{b}");
        let t = &b["totals"];
        assert_eq!(t["connections"], 10, "{t}");
        assert_eq!(t["bytes_to_backend"], 0, "{t}");
        assert_eq!(t["connect_failures"], 0, "{t}");
    }
    let m = bed.daemon().metrics().await;
    assert!(
        netns::metric_sample(&m, "harvester_lb_conntrack_entries", &[]).is_some_and(|v| v >= 1.0),
        "{m}"
    );
    assert!(netns::metric(&m, "harvester_lb_conntrack_max", &[]) > 0.0);

    // The daemon frozen: no byte can pass through it, yet clients are served.
    bed.daemon().signal(libc::SIGSTOP);
    let frozen = tally(&bed, 10).await;
    bed.daemon().signal(libc::SIGCONT);
    assert_eq!(
        frozen,
        counts(&[("n1", 5), ("n2", 5)]),
        "forwarded by the kernel"
    );

    // Node 2 fails its check: once the verdict is in, every new
    // connection goes to node 1, none fails.
    n2.stop_health();
    bed.daemon()
        .wait_health(
            "default/web",
            node_ip(2),
            "unhealthy",
            Duration::from_secs(10),
        )
        .await;
    // The verdict reaches the kernel a few milliseconds later.
    wait_chain(&bed, "node 2 out of the kernel's choice", |l| {
        !l.contains("198.51.100.22")
    })
    .await;
    assert_eq!(tally(&bed, 10).await, counts(&[("n1", 10)]));
    drop(n1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drain_keeps_the_open_connection_and_no_backend_is_a_reset() {
    require_netns!();
    let mut bed = Bed::new("kdrain", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    start_kernel(&mut bed, &kernel_config(&[1, 2])).await;

    // An open connection to node 1.
    let mut open = open_to(&bed, "n1").await;

    set_state(&bed, "default/web", 1, "drain");
    wait_chain(&bed, "node 1 out of the kernel's choice", |l| {
        !l.contains("198.51.100.21")
    })
    .await;
    assert_eq!(tally(&bed, 6).await, counts(&[("n2", 6)]));
    // The open connection still echoes through node 1.
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    open.write_all(b"still here").await.unwrap();
    let mut buf = [0u8; 10];
    tokio::time::timeout(Duration::from_secs(5), open.read_exact(&mut buf))
        .await
        .expect("echo within 5 s")
        .expect("the drained backend's open connection runs on");
    assert_eq!(&buf, b"still here");

    // No eligible backend: a reset at once, counted; never the host's socket.
    set_state(&bed, "default/web", 2, "maint");
    wait_chain(&bed, "no backend in the kernel's choice", |l| {
        l.contains("counter name \"z_tcp_80_198.51.100.10\" return")
    })
    .await;
    let started = Instant::now();
    let err = bed
        .client
        .connect(sa(VIP, 80), Duration::from_secs(5))
        .await
        .expect_err("no backend: refused");
    assert_eq!(err.kind(), ErrorKind::ConnectionRefused, "{err}");
    assert!(
        started.elapsed() < Duration::from_secs(3),
        "a reset, not a timeout"
    );
    let l = listed(&bed, "counter", "z_tcp_80_198.51.100.10");
    assert!(l.contains("packets 1 "), "{l}");
}

/// conntrack's count of flows in namespace `ns` (0 while nothing there
/// uses conntrack: no NAT table yet).
fn tracked_flows(ns: &netns::Ns) -> u64 {
    let name = ns.name.clone();
    in_ns(&name, || {
        std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_count")
            .ok()
            .and_then(|t| t.trim().parse().ok())
            .unwrap_or(0)
    })
}

/// A connection the proxy accepted while conntrack was not running in the
/// host's namespace (only proxy listeners: no NAT table) is not tracked;
/// the reload that moves its listener to the kernel starts conntrack, and
/// the connection's next segment is taken for a new flow. It must stay
/// with the proxy (its socket is here), not be DNATed to a backend that
/// knows nothing of it and answers with a reset.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_proxied_connection_survives_its_listener_moving_to_the_kernel() {
    require_netns!();
    let mut bed = Bed::new("kpickup", 1);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let proxy = config()
        .lb(web_lb(&[1], Listener::new("tcp", 80, NODEPORT)))
        .to_string();
    bed.start_daemon(&proxy).await;

    let mut open = bed
        .client
        .connect(sa(VIP, 80), Duration::from_secs(5))
        .await
        .expect("connect through the proxy");
    assert_eq!(read_line(&mut open).await.unwrap(), "n1");
    echo(&mut open, b"before").await;
    assert_eq!(
        tracked_flows(&bed.lb),
        0,
        "conntrack already runs in the host's namespace: this test needs it off to show anything"
    );

    bed.write("config.toml", &kernel_config(&[1]).to_string());
    let (code, body) = bed.daemon().request("POST", "/reload").await.unwrap();
    assert_eq!(code, 200, "{body}");
    wait_for(
        Duration::from_secs(10),
        "the listener in the kernel",
        || async {
            let s = bed.daemon().status().await;
            (s["load_balancers"][0]["listeners"][0]["forwarding"] == "kernel").then_some(())
        },
    )
    .await;
    // The open connection goes on through the proxy; a new one is
    // forwarded by the kernel.
    echo(&mut open, b"after").await;
    match exchange(&bed.client, sa(VIP, 80), 64, Duration::from_secs(10)).await {
        Exchange::Ok(n) => assert_eq!(n, "n1"),
        other => panic!("a new connection after the switch: {other:?}"),
    }
    echo(&mut open, b"again").await;
}

/// Writes `data` on an open NameThenEcho connection and reads it back.
async fn echo(s: &mut tokio::net::TcpStream, data: &[u8]) {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(data)
        .await
        .expect("write on the open connection");
    let mut back = vec![0; data.len()];
    tokio::time::timeout(Duration::from_secs(10), s.read_exact(&mut back))
        .await
        .expect("the echo within 10 s")
        .expect("the echo (a reset here: the connection was handed to a backend)");
    assert_eq!(back, data);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_switches_between_proxy_and_kernel_under_load_without_a_failure() {
    require_netns!();
    let mut bed = Bed::new("kswitch", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let proxy = config()
        .lb(web_lb(&[1, 2], Listener::new("tcp", 80, NODEPORT)))
        .to_string();
    let kernel = kernel_config(&[1, 2]).to_string();
    bed.start_daemon(&proxy).await;

    let stop = Arc::new(AtomicBool::new(false));
    let load = netns::peers::load(&bed.client, sa(VIP, 80), 4, 100_000, Arc::clone(&stop));
    for round in 0..3 {
        for (text, forwarding) in [(&kernel, "kernel"), (&proxy, "proxy")] {
            bed.write("config.toml", text);
            let (code, body) = bed.daemon().request("POST", "/reload").await.unwrap();
            assert_eq!(code, 200, "round {round}: {body}");
            wait_for(Duration::from_secs(10), forwarding, || async {
                let s = bed.daemon().status().await;
                (s["load_balancers"][0]["listeners"][0]["forwarding"] == forwarding).then_some(())
            })
            .await;
            // Some exchanges on each path before the next switch.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    stop.store(true, Ordering::Relaxed);
    let tally = load.await.unwrap();
    assert!(tally.ok_total() > 50, "{tally:?}");
    assert!(tally.failed.is_empty(), "{:?}", tally.failed);
    // Every switch was one successful transaction (a switch back to the
    // proxy deletes the listener's chains: none may fail).
    let metrics = bed.daemon().metrics().await;
    assert!(
        netns::metric_sample(
            &metrics,
            "harvester_lb_kernel_syncs_total",
            &[("result", "success")]
        )
        .is_some_and(|v| v >= 6.0),
        "{metrics}"
    );
    assert_eq!(
        netns::metric(
            &metrics,
            "harvester_lb_kernel_syncs_total",
            &[("result", "failure")]
        ),
        0.0,
        "{}",
        bed.daemon().log_tail(20)
    );
}

/// One open connection through the kernel: writes `msg`, expects the echo.
async fn echoes(s: &mut tokio::net::TcpStream, msg: &[u8]) -> std::io::Result<()> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    s.write_all(msg).await?;
    let mut buf = vec![0u8; msg.len()];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut buf))
        .await
        .map_err(|_| std::io::Error::new(ErrorKind::TimedOut, "no echo within 5 s"))??;
    assert_eq!(buf, msg);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_killed_daemon_leaves_the_kernel_forwarding_and_a_restart_keeps_open_flows() {
    require_netns!();
    let mut bed = Bed::new("kkill", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    // With the VIP isolation table too: DNATed packets go to forward, not
    // input, so the two tables do not fight.
    let text = config().vip("isolate = true").lb(kernel_lb(&[1, 2]));
    start_kernel(&mut bed, &text).await;
    assert_eq!(tally(&bed, 4).await, counts(&[("n1", 2), ("n2", 2)]));

    let mut open = open_echoing(&bed, b"before").await;

    let d = kill_daemon(&mut bed).await;
    // No daemon at all: the kernel forwards new and open connections.
    echoes(&mut open, b"while dead").await.unwrap();
    assert_eq!(tally(&bed, 4).await, counts(&[("n1", 2), ("n2", 2)]));

    // A new daemon reconciles the table it finds, without deleting it.
    start_kernel(&mut bed, &text).await;
    echoes(&mut open, b"after restart").await.unwrap();
    assert_eq!(tally(&bed, 4).await.values().sum::<usize>(), 4);
    assert_no_failed_sync(&bed).await;
    drop(d);
}

/// A connection to VIP:80 that has read its node's name and echoed
/// `said`: open, to be held across what a test does next.
async fn open_echoing(bed: &Bed, said: &[u8]) -> tokio::net::TcpStream {
    let mut open = bed
        .client
        .connect(sa(VIP, 80), Duration::from_secs(5))
        .await
        .unwrap();
    read_line(&mut open).await.unwrap();
    echoes(&mut open, said).await.unwrap();
    open
}

/// SIGKILLs the bed's daemon and waits for its exit (the process is
/// returned to be dropped last: it holds the bed's daemon files).
async fn kill_daemon(bed: &mut Bed) -> netns::DaemonProc {
    let mut d = bed.take_daemon();
    d.signal(libc::SIGKILL);
    assert!(d.wait_exit(Duration::from_secs(10)).await.is_some());
    d
}

/// No kernel transaction of the running daemon has failed.
async fn assert_no_failed_sync(bed: &Bed) {
    let metrics = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(
            &metrics,
            "harvester_lb_kernel_syncs_total",
            &[("result", "failure")]
        ),
        0.0
    );
}

/// A daemon of the version before the tables were sharded kept every
/// listener in `inet harvester_lb_nat`. After an upgrade, the first sync
/// moves each listener to its own table in one transaction: the kernel's
/// open connection runs on (the main table's NAT hooks stay throughout),
/// and new connections are forwarded by the kernel from the new table.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_upgrade_moves_listeners_from_the_one_table_layout_with_open_flows_running() {
    require_netns!();
    let mut bed = Bed::new("kupg", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let text = config().lb(kernel_lb(&[1, 2]));
    start_kernel(&mut bed, &text).await;
    let id = (IpAddr::V4(VIP), Protocol::Tcp, 80);
    let shard = kernel::table_of(&id);
    assert_ne!(
        shard,
        kernel::TABLE,
        "the test needs a listener outside the main table"
    );
    let d = kill_daemon(&mut bed).await;

    // The layout of the version before: the listener's chain and counters
    // in the main table, its shard's table gone (one transaction).
    let (n1, n2, t) = (node_ip(1), node_ip(2), kernel::TABLE);
    let tag = format!("tcp_80_{VIP}");
    bed.lb.nft(&format!(
        "table inet {t} {{
  counter n_{tag}_{n1} {{ }}
  counter n_{tag}_{n2} {{ }}
  counter z_{tag} {{ }}
  chain l_{tag} {{
    numgen inc mod 2 0 counter name \"n_{tag}_{n1}\" meta l4proto tcp dnat ip to {n1}:{NODEPORT}
    counter name \"n_{tag}_{n2}\" meta l4proto tcp dnat ip to {n2}:{NODEPORT}
  }}
}}
delete table inet {shard}
add element inet {t} dispatch4 {{ {VIP} . tcp . 80 : goto l_{tag} }}
"
    ));
    let (_, tables) = nft_out(&bed.lb.name, &["list", "tables", "inet"]);
    assert!(!tables.contains(&shard), "{tables}");
    // Forwarded by the old layout, no daemon running.
    let mut open = open_echoing(&bed, b"on the old layout").await;

    // The new daemon moves the listener to its table.
    start_kernel(&mut bed, &text).await;
    let main = nft_out(&bed.lb.name, &["list", "table", "inet", t]).1;
    assert!(!main.contains(&format!("chain l_{tag}")), "{main}");
    let moved = nft_out(
        &bed.lb.name,
        &["list", "chain", "inet", &shard, &format!("l_{tag}")],
    );
    assert!(moved.0 && moved.1.contains("dnat ip to"), "{}", moved.1);
    echoes(&mut open, b"after the upgrade").await.unwrap();
    let seen = tally(&bed, 4).await;
    assert!(seen.keys().all(|k| k == "n1" || k == "n2"), "{seen:?}");
    assert_no_failed_sync(&bed).await;
    drop(d);
}

/// A clean stop (SIGTERM, so also `systemctl restart`) drains the kernel's
/// open connections as it drains the proxy's: deleting the table at once
/// would reset them (the kernel drops the NAT bindings of the flows whose
/// chains go).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_clean_stop_refuses_new_kernel_connections_and_waits_for_the_open_ones() {
    require_netns!();
    let mut bed = Bed::new("kstop", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let text = config().drain_timeout(120).lb(kernel_lb(&[1, 2]));
    start_kernel(&mut bed, &text).await;
    let mut open = open_echoing(&bed, b"before").await;

    let mut d = bed.take_daemon();
    d.signal(libc::SIGTERM);
    // New connections are refused (a reset, as a closed listener's) ...
    wait_for(
        Duration::from_secs(15),
        "new connections refused once the daemon stops",
        || async {
            let refused = bed
                .client
                .connect(sa(VIP, 80), Duration::from_secs(5))
                .await
                .is_err_and(|e| e.kind() == ErrorKind::ConnectionRefused);
            refused.then_some(())
        },
    )
    .await;
    // ... while the open one still runs through the kernel, and the
    // daemon waits for it.
    echoes(&mut open, b"while stopping").await.unwrap();
    assert!(d.alive(), "the daemon waits for the open kernel connection");
    let listing = listed(&bed, "chain", "l_tcp_80_198.51.100.10");
    assert!(
        listing.contains("counter name \"z_tcp_80_198.51.100.10\""),
        "the listener's chain stays, refusing new connections, during the drain: {listing}"
    );

    // The client closes: the drain ends long before its timeout, the table goes.
    drop(open);
    let status = d
        .wait_exit(Duration::from_secs(60))
        .await
        .expect("the stop ends once the kernel's last connection closed");
    assert!(status.success(), "{status:?}");
    let (_, tables) = nft_out(&bed.lb.name, &["list", "tables"]);
    assert!(
        !tables.contains(kernel::TABLE),
        "every table is gone after the drain: {tables}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_table_that_cannot_be_written_leaves_the_proxy_serving_until_a_resync_succeeds() {
    require_netns!();
    let mut bed = Bed::new("kfail", 1);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    // Something else holds a chain of that name with another type: every
    // transaction of the daemon is refused by the kernel.
    bed.lb.nft(&format!(
        "table inet {} {{\n chain prerouting {{ type filter hook prerouting priority 0; policy accept; }}\n}}\n",
        kernel::TABLE
    ));
    bed.start_daemon(&kernel_config(&[1]).to_string()).await;
    let l = served_by_proxy_because(&bed).await;
    assert_eq!(l["forwarding"], "proxy", "{l}");
    assert!(
        l["kernel_error"]
            .as_str()
            .unwrap()
            .contains("could not write the nftables table inet harvester_lb_nat: nft:"),
        "{l}"
    );
    // Counted once the writer has looked for a load balancer to blame
    // (none: the table's own chain is in the way).
    let metrics = wait_for(Duration::from_secs(10), "the failure counted", || async {
        let metrics = bed.daemon().metrics().await;
        let failed = netns::metric_sample(
            &metrics,
            "harvester_lb_kernel_syncs_total",
            &[("result", "failure")],
        )?;
        (failed >= 1.0).then_some(metrics)
    })
    .await;
    assert_eq!(
        netns::metric(&metrics, "harvester_lb_kernel_forwarding_up", &[]),
        0.0
    );
    // The proxy serves meanwhile: nothing is refused, and it accepted them.
    assert_eq!(tally(&bed, 4).await, counts(&[("n1", 4)]));
    let metrics = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(&metrics, "harvester_lb_connections_accepted_total", &[]),
        4.0
    );

    // The obstacle gone, the retry's full resync takes over. `/status`
    // says "kernel" once the table is written; the gauge is set when the
    // writer's blocking task has returned, so it is waited for: read at
    // once, it was still 0 at load 10.
    bed.lb
        .nft(&format!("delete table inet {}\n", kernel::TABLE));
    wait_kernel(&bed).await;
    wait_for(
        Duration::from_secs(10),
        "harvester_lb_kernel_forwarding_up 1",
        || async {
            let metrics = bed.daemon().metrics().await;
            (netns::metric_sample(&metrics, "harvester_lb_kernel_forwarding_up", &[]) == Some(1.0))
                .then_some(())
        },
    )
    .await;
    assert_eq!(tally(&bed, 4).await, counts(&[("n1", 4)]));
    let l = listed(&bed, "counter", "n_tcp_80_198.51.100.10_198.51.100.21");
    assert!(
        l.contains("packets 4 "),
        "the last 4 went through the kernel: {l}"
    );
    let metrics = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(&metrics, "harvester_lb_connections_accepted_total", &[]),
        4.0,
        "the proxy accepted none of them"
    );
}

/// A node service on `port` that writes the address it sees the client at.
fn peer_teller(bed: &Bed, i: usize, port: u16) {
    let l = bed.node(i).listen(sa(node_ip(i), port));
    tokio::spawn(async move {
        use tokio::io::AsyncWriteExt;
        while let Ok((mut s, peer)) = l.accept().await {
            tokio::spawn(async move {
                let _ = s.write_all(format!("{}\n", peer.ip()).as_bytes()).await;
            });
        }
    });
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_nat_none_shows_the_backend_the_clients_own_address() {
    require_netns!();
    let mut bed = Bed::new("ksnat", 1);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho); // its health port
    peer_teller(&bed, 1, 30081);
    peer_teller(&bed, 1, 30082);
    peer_teller(&bed, 1, 30083);
    let (_remote, rc) = remote_client(&bed, "ksnat-rc");

    let listener = |name: &str, port: u16, snat: &str| {
        Listener::new(name, port, 30000 + port)
            .forwarding("kernel")
            .source_nat(snat)
    };
    let lb = Lb::new("default/web", VIP)
        .backends([node_ip(1)])
        .listener(listener("keep", 81, "none")) // to nodeport 30081
        .listener(listener("hide", 82, "masquerade")) // to nodeport 30082
        .listener(listener("vip", 83, "vip")) // to nodeport 30083
        .health_port(HEALTH_PORT);
    bed.start_daemon(&config().lb(lb).to_string()).await;
    wait_for(
        Duration::from_secs(10),
        "both listeners in the kernel",
        || async {
            let s = bed.daemon().status().await;
            let l = &s["load_balancers"][0]["listeners"];
            (l[0]["forwarding"] == "kernel"
                && l[1]["forwarding"] == "kernel"
                && l[2]["forwarding"] == "kernel")
                .then_some(())
        },
    )
    .await;

    assert_eq!(
        seen_at(&rc, VIP, 81).await,
        REMOTE_CLIENT,
        "source_nat = none"
    );
    assert_eq!(
        seen_at(&rc, VIP, 82).await,
        "198.51.100.3",
        "source_nat = masquerade"
    );
    // The VIP, the same from every host (the node answers it on-link).
    assert_eq!(
        seen_at(&rc, VIP, 83).await,
        VIP.to_string(),
        "source_nat = vip"
    );
}

/// The address of [`remote_client`]'s host.
const REMOTE_CLIENT: &str = "203.0.113.2";

/// A client on a network of its own (203.0.113.0/24), routed through the
/// load-balancer host; node 1 routes that network back through it too, so
/// a `source_nat = "none"` listener's backend can answer the client's own
/// address. The namespace goes with the returned guard.
fn remote_client(bed: &Bed, tag: &str) -> (Scratch, netns::Ns) {
    let remote = Scratch::new(tag);
    let rc = netns::Ns {
        name: remote.0.clone(),
    };
    bed.lb.ip(&[
        "link", "add", "rc0", "type", "veth", "peer", "name", "eth0", "netns", &rc.name,
    ]);
    bed.lb.ip(&["addr", "add", "203.0.113.1/24", "dev", "rc0"]);
    bed.lb.ip(&["link", "set", "rc0", "up"]);
    rc.ip(&["link", "set", "lo", "up"]);
    rc.ip(&["addr", "add", &format!("{REMOTE_CLIENT}/24"), "dev", "eth0"]);
    rc.ip(&["link", "set", "eth0", "up"]);
    rc.ip(&["route", "add", "default", "via", "203.0.113.1"]);
    bed.node(1)
        .ip(&["route", "add", "203.0.113.0/24", "via", "198.51.100.3"]);
    (remote, rc)
}

/// The address a [`peer_teller`] behind `vip:port` saw `client` at.
async fn seen_at(client: &netns::Ns, vip: Ipv4Addr, port: u16) -> String {
    let mut s = client
        .connect(sa(vip, port), Duration::from_secs(5))
        .await
        .unwrap_or_else(|e| panic!("connect to {vip}:{port}: {e}"));
    tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
        .await
        .unwrap_or_else(|_| panic!("no answer from {vip}:{port} within 5 s"))
        .unwrap()
}

/// Writes `config` as the daemon's file and reloads it (`POST /reload`).
async fn reload(bed: &Bed, config: &Config) {
    bed.write("config.toml", &config.to_string());
    let (code, body) = bed.daemon().request("POST", "/reload").await.unwrap();
    assert_eq!(code, 200, "{body}");
}

/// The `forwarding` of every listener in `/status`, by load balancer and
/// listener name.
async fn forwarding_of_all(bed: &Bed) -> BTreeMap<String, String> {
    let s = bed.daemon().status().await;
    let mut out = BTreeMap::new();
    for lb in s["load_balancers"].as_array().unwrap() {
        for l in lb["listeners"].as_array().unwrap() {
            out.insert(
                format!(
                    "{}/{}",
                    lb["name"].as_str().unwrap(),
                    l["name"].as_str().unwrap()
                ),
                l["forwarding"].as_str().unwrap().to_string(),
            );
        }
    }
    out
}

/// Listeners 80 -> 30090 and 8080..8089 -> 30090 of one VIP share the
/// masquerade element of each backend (VIP . backend . tcp . 30090). A
/// reload removing 8080 keeps port 80 masqueraded; one removing the nine
/// others at once deletes each shared element once, in one transaction
/// that succeeds: no failed write, no listener shown as proxy.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn listeners_sharing_a_nodeport_keep_each_others_masquerade_across_reloads() {
    require_netns!();
    let mut bed = Bed::new("kshare", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho); // health ports
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    peer_teller(&bed, 1, 30090);
    peer_teller(&bed, 2, 30090);
    let web = |ports: &[u16]| {
        ports.iter().fold(
            Lb::new("default/web", VIP)
                .backends([node_ip(1), node_ip(2)])
                .health_port(HEALTH_PORT),
            |lb, &p| lb.listener(Listener::new(&format!("p{p}"), p, 30090).forwarding("kernel")),
        )
    };
    // Another tenant that stays throughout.
    let other = Lb::new("default/other", netns::VIP2)
        .backends([node_ip(1)])
        .listener(Listener::new("tcp", 80, 30090).forwarding("kernel"))
        .health_port(HEALTH_PORT);
    let all: Vec<u16> = [80].into_iter().chain(8080..8090).collect();
    let conf = |ports: &[u16]| config().lb(web(ports)).lb(other.clone());
    start_kernel(&mut bed, &conf(&all)).await;
    wait_for(
        Duration::from_secs(10),
        "every listener in the kernel",
        || async {
            let f = forwarding_of_all(&bed).await;
            (f.len() == 12 && f.values().all(|v| v == "kernel")).then_some(())
        },
    )
    .await;
    let lb_host = netns::LB_IP.to_string();
    for _ in 0..2 {
        // Round robin: both nodes.
        assert_eq!(seen_at(&bed.client, VIP, 80).await, lb_host);
        assert_eq!(seen_at(&bed.client, VIP, 8080).await, lb_host);
    }
    // `nft -j`'s listing, without its spaces.
    let masq = || {
        let (ok, listed) = nft_out(
            &bed.lb.name,
            &["-j", "list", "set", "inet", kernel::TABLE, "masq4"],
        );
        (ok, listed.replace(' ', ""))
    };
    let element =
        |node: usize| format!(r#"{{"concat":["{VIP}","{}","tcp",30090]}}"#, node_ip(node));
    let refused = || {
        nft_out(
            &bed.lb.name,
            &["list", "set", "inet", kernel::TABLE, "refuse4"],
        )
        .1
    };

    // 8080 goes: port 80 stays masqueraded.
    let without_8080: Vec<u16> = all.iter().copied().filter(|p| *p != 8080).collect();
    reload(&bed, &conf(&without_8080)).await;
    wait_for(
        Duration::from_secs(10),
        "8080 out of the kernel",
        || async { (!refused().contains(". 8080")).then_some(()) },
    )
    .await;
    let (ok, listed) = masq();
    assert!(ok, "{listed}");
    for node in [1, 2] {
        assert!(
            listed.contains(&element(node)),
            "node {node}'s element: {listed}"
        );
    }
    for _ in 0..2 {
        assert_eq!(
            seen_at(&bed.client, VIP, 80).await,
            lb_host,
            "port 80 is still masqueraded"
        );
    }

    // The nine others go at once: one transaction, which succeeds.
    reload(&bed, &conf(&[80])).await;
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        let f = forwarding_of_all(&bed).await;
        assert!(
            f.values().all(|v| v == "kernel"),
            "a listener shown as proxy after the reload: {f:?}\n{}",
            bed.daemon().log_tail(20)
        );
        if f.len() == 2 && !refused().contains(". 8081") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the reload was not written: {f:?}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert_no_failed_sync(&bed).await;
    let (_, listed) = masq();
    for node in [1, 2] {
        assert!(
            listed.contains(&element(node)),
            "node {node}'s element: {listed}"
        );
    }
    for _ in 0..2 {
        assert_eq!(seen_at(&bed.client, VIP, 80).await, lb_host);
    }
    assert_eq!(seen_at(&bed.client, netns::VIP2, 80).await, lb_host);
    assert_no_failed_sync(&bed).await;
}

/// Tenant B's listener cannot be written (another program holds an object
/// of the name of its source-range set, with another type: the kernel
/// refuses the transaction with EEXIST). The write is narrowed to B: B
/// alone falls back to the proxy, named in `/status` and the log, while
/// tenant A stays in the kernel with its client addresses kept
/// (`source_nat = "none"`). Once the object is gone, a reload takes B
/// back into the kernel.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_tenants_refused_objects_leave_every_other_tenant_in_the_kernel() {
    require_netns!();
    let mut bed = Bed::new("knarrow", 1);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho); // 30080 and health
    peer_teller(&bed, 1, 30081);
    let (_remote, rc) = remote_client(&bed, "knarrow-rc");
    let a = Lb::new("tenant-a/web", VIP)
        .backends([node_ip(1)])
        .listener(
            Listener::new("keep", 81, 30081)
                .forwarding("kernel")
                .source_nat("none"),
        )
        .health_port(HEALTH_PORT);
    let b = Lb::new("tenant-b/web", netns::VIP2)
        .backends([node_ip(1)])
        .keys("source_ranges = [\"198.51.100.0/24\", \"203.0.113.0/24\"]")
        .listener(Listener::new("web", 80, NODEPORT).forwarding("kernel"))
        .health_port(HEALTH_PORT);
    let conf = config().lb(a).lb(b);
    let b_id = (IpAddr::V4(netns::VIP2), Protocol::Tcp, 80);
    let b_table = kernel::table_of(&b_id);
    let b_set = format!("s_tcp_80_{}", netns::VIP2);
    bed.lb.nft(&format!(
        "table inet {b_table} {{\n set {b_set} {{ type ipv4_addr; }}\n}}\n"
    ));
    bed.start_daemon(&conf.to_string()).await;
    let status = || async {
        let s = bed.daemon().status().await;
        let of = |i: usize| s["load_balancers"][i]["listeners"][0].clone();
        (of(0), of(1))
    };
    let (la, lb) = wait_for(
        Duration::from_secs(30),
        "A in the kernel, B refused",
        || async {
            let (la, lb) = status().await;
            (la["forwarding"] == "kernel" && lb["kernel_error"].is_string()).then_some((la, lb))
        },
    )
    .await;
    assert!(la["kernel_error"].is_null(), "{la}");
    assert_eq!(lb["forwarding"], "proxy", "{lb}");
    let why = lb["kernel_error"].as_str().unwrap();
    for part in [
        "the kernel refused the NAT objects of load balancer \"tenant-b/web\"",
        // nft finds the other program's set in the way.
        "nft: Error",
        "served by the proxy",
    ] {
        assert!(why.contains(part), "want {part:?} in {why}");
    }
    bed.daemon()
        .wait_logged(
            "narrowed to the load balancers whose listeners the kernel refuses: [\"tenant-b/web\"]",
        )
        .await;
    // A keeps the kernel path and the client's own address; B is served,
    // by the proxy.
    assert_eq!(
        seen_at(&rc, VIP, 81).await,
        REMOTE_CLIENT,
        "A: source_nat = none"
    );
    // The table is written (and /status says so) before the writer's task
    // counts the write: the gauge follows a moment later.
    let metrics = wait_for(
        Duration::from_secs(10),
        "harvester_lb_kernel_forwarding_up 1 after the narrowed write",
        || async {
            let m = bed.daemon().metrics().await;
            (netns::metric_sample(&m, "harvester_lb_kernel_forwarding_up", &[]) == Some(1.0))
                .then_some(m)
        },
    )
    .await;
    wait_for(Duration::from_secs(10), "B counted as refused", || async {
        let m = bed.daemon().metrics().await;
        (netns::metric_sample(&m, "harvester_lb_kernel_refused_load_balancers", &[]) == Some(1.0))
            .then_some(())
    })
    .await;
    let accepted = netns::metric(&metrics, "harvester_lb_connections_accepted_total", &[]);
    let mut s = bed
        .client
        .connect(sa(netns::VIP2, 80), Duration::from_secs(5))
        .await
        .unwrap();
    assert_eq!(read_line(&mut s).await.unwrap(), "n1");
    drop(s);
    let metrics = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(&metrics, "harvester_lb_connections_accepted_total", &[]),
        accepted + 1.0,
        "the proxy served B"
    );
    let (_, chains) = nft_out(&bed.lb.name, &["list", "chains", "inet"]);
    assert!(!chains.contains("l_tcp_80_198.51.100.11"), "{chains}");
    assert!(chains.contains("l_tcp_81_198.51.100.10"), "{chains}");

    // The obstacle gone (the write of the others may have deleted it
    // already: our table, one of our names), a reload takes B back.
    nft_out(&bed.lb.name, &["delete", "set", "inet", &b_table, &b_set]);
    reload(&bed, &conf).await;
    wait_for(Duration::from_secs(10), "B in the kernel", || async {
        let (la, lb) = status().await;
        (la["forwarding"] == "kernel"
            && lb["forwarding"] == "kernel"
            && lb["kernel_error"].is_null())
        .then_some(())
    })
    .await;
    assert_eq!(seen_at(&rc, VIP, 81).await, REMOTE_CLIENT);
    wait_for(Duration::from_secs(10), "B no longer refused", || async {
        let m = bed.daemon().metrics().await;
        (netns::metric_sample(&m, "harvester_lb_kernel_refused_load_balancers", &[]) == Some(0.0))
            .then_some(())
    })
    .await;
}

/// A TCP connection from namespace `ns` to an IPv6 address.
async fn connect6(
    ns: &netns::Ns,
    addr: std::net::SocketAddr,
) -> std::io::Result<tokio::net::TcpStream> {
    let s = in_ns(&ns.name, || {
        let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)?;
        s.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(std::net::TcpStream::from(s))
    })?;
    let s = tokio::net::TcpSocket::from_std_stream(s);
    tokio::time::timeout(Duration::from_secs(5), s.connect(addr))
        .await
        .map_err(|_| std::io::Error::new(ErrorKind::TimedOut, "connect timed out"))?
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_listeners_are_forwarded_by_the_kernel_too() {
    require_netns!();
    let mut bed = Bed::new("kv6", 2);
    let vip6: std::net::Ipv6Addr = "fd00:db8::10".parse().unwrap();
    let node6 = |i: usize| -> std::net::Ipv6Addr { format!("fd00:db8::2{i}").parse().unwrap() };
    for (ns, addr) in [
        (&bed.client, "fd00:db8::2".to_string()),
        (&bed.lb, "fd00:db8::3".to_string()),
        (bed.node(1), node6(1).to_string()),
        (bed.node(2), node6(2).to_string()),
    ] {
        ns.ip(&["addr", "add", &format!("{addr}/64"), "dev", "eth0", "nodad"]);
    }
    bed.lb.ip(&[
        "addr",
        "add",
        &format!("{vip6}/128"),
        "dev",
        "eth0",
        "nodad",
    ]);
    run(
        "ip",
        &[
            "netns",
            "exec",
            &bed.lb.name,
            "sysctl",
            "-qw",
            "net.ipv6.conf.all.forwarding=1",
        ],
        None,
    );
    // Each node tells its name on its nodeport and accepts health probes.
    for i in 1..=2 {
        for (port, name) in [
            (NODEPORT, format!("n{i}\n")),
            (netns::HEALTH_PORT, String::new()),
        ] {
            let l = in_ns(&bed.node(i).name, move || {
                let s = socket2::Socket::new(socket2::Domain::IPV6, socket2::Type::STREAM, None)?;
                s.set_reuse_address(true)?;
                s.bind(&std::net::SocketAddr::new(node6(i).into(), port).into())?;
                s.listen(128)?;
                s.set_nonblocking(true)?;
                Ok::<_, std::io::Error>(std::net::TcpListener::from(s))
            })
            .unwrap();
            let l = tokio::net::TcpListener::from_std(l).unwrap();
            tokio::spawn(async move {
                use tokio::io::AsyncWriteExt;
                while let Ok((mut s, _)) = l.accept().await {
                    let name = name.clone();
                    tokio::spawn(async move {
                        let _ = s.write_all(name.as_bytes()).await;
                    });
                }
            });
        }
    }
    let lb = Lb::new("default/v6", vip6)
        .backends([node6(1), node6(2)])
        .listener(Listener::new("web", 80, NODEPORT).forwarding("kernel"))
        .health_port(HEALTH_PORT);
    start_kernel(&mut bed, &config().lb(lb)).await;
    let mut seen = BTreeMap::new();
    for _ in 0..6 {
        let mut s = connect6(&bed.client, std::net::SocketAddr::new(vip6.into(), 80))
            .await
            .unwrap();
        let name = tokio::time::timeout(Duration::from_secs(5), read_line(&mut s))
            .await
            .expect("an answer within 5 s")
            .unwrap();
        *seen.entry(name).or_insert(0) += 1;
    }
    assert_eq!(seen, counts(&[("n1", 3), ("n2", 3)]));
    let metrics = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(&metrics, "harvester_lb_connections_accepted_total", &[]),
        0.0,
        "the proxy accepted none"
    );
}

/// Node `i` answers every datagram on `port` with its name.
/// `default/dns`: VIP:53/udp over nodes 1 and 2 (nodeport 30053),
/// forwarded by the kernel, checked on TCP every second.
fn udp_kernel_config() -> Config {
    let lb = Lb::new("default/dns", VIP)
        .backends([node_ip(1), node_ip(2)])
        .listener(Listener::new("dns", 53, 30053).udp().forwarding("kernel"))
        .health_port(HEALTH_PORT)
        .health("  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 1");
    config().lb(lb)
}

fn udp_teller(bed: &Bed, i: usize, port: u16) -> tokio::task::JoinHandle<()> {
    let s = in_ns(&bed.node(i).name, move || {
        let s = std::net::UdpSocket::bind(sa(node_ip(i), port))?;
        s.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(s)
    })
    .unwrap();
    let s = tokio::net::UdpSocket::from_std(s).unwrap();
    tokio::spawn(async move {
        let mut buf = [0u8; 512];
        while let Ok((_, from)) = s.recv_from(&mut buf).await {
            let _ = s.send_to(format!("n{i}").as_bytes(), from).await;
        }
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_udp_client_with_a_fixed_port_moves_off_a_backend_that_left() {
    require_netns!();
    let mut bed = Bed::new("kudp", 2);
    bed.enable_forwarding();
    // Health on TCP; the service on UDP.
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let mut n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let _u1 = udp_teller(&bed, 1, 30053);
    let _u2 = udp_teller(&bed, 2, 30053);
    start_kernel(&mut bed, &udp_kernel_config()).await;

    // One client, one source port, for the whole test.
    let client = in_ns(&bed.client.name, || {
        let s = std::net::UdpSocket::bind(sa(netns::CLIENT_IP, 40053))?;
        s.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(s)
    })
    .unwrap();
    let client = tokio::net::UdpSocket::from_std(client).unwrap();
    client.connect(sa(VIP, 53)).await.unwrap();
    let ask = || async {
        client.send(b"who").await.ok()?;
        let mut buf = [0u8; 64];
        let n = tokio::time::timeout(Duration::from_millis(300), client.recv(&mut buf))
            .await
            .ok()?
            .ok()?;
        Some(String::from_utf8_lossy(&buf[..n]).into_owned())
    };
    // Its flow sticks to one backend; make it node 2 (the next flow of
    // another client takes the other one).
    let first = wait_for(Duration::from_secs(5), "a first answer", &ask).await;
    if first == "n1" {
        // Node 1 leaves and comes back: the flow moves to node 2.
        set_state(&bed, "default/dns", 1, "drain");
        wait_for(Duration::from_secs(5), "the flow on node 2", || async {
            (ask().await.as_deref() == Some("n2")).then_some(())
        })
        .await;
        set_state(&bed, "default/dns", 1, "ready");
    }
    for _ in 0..5 {
        assert_eq!(
            ask().await.as_deref(),
            Some("n2"),
            "a flow stays on its backend"
        );
    }

    // Node 2's check fails: within a second of the verdict, the same
    // client port is answered by node 1, although it never stopped sending.
    n2.stop_health();
    bed.daemon()
        .wait_health(
            "default/dns",
            node_ip(2),
            "unhealthy",
            Duration::from_secs(10),
        )
        .await;
    let verdict = Instant::now();
    wait_for(Duration::from_secs(5), "the flow on node 1", || async {
        (ask().await.as_deref() == Some("n1")).then_some(())
    })
    .await;
    let moved = verdict.elapsed();
    println!("FIGURE udp flow moved {moved:?} after the verdict");
    assert!(moved < Duration::from_secs(2), "moved after {moved:?}");

    // No backend at all, then node 2 back: the flow goes to node 2 then,
    // not stuck on the refusal or on node 1's old entry.
    set_state(&bed, "default/dns", 1, "maint");
    wait_for(
        Duration::from_secs(5),
        "no answer with no backend",
        || async { ask().await.is_none().then_some(()) },
    )
    .await;
    n2.start_health();
    bed.daemon()
        .wait_health(
            "default/dns",
            node_ip(2),
            "healthy",
            Duration::from_secs(10),
        )
        .await;
    wait_for(
        Duration::from_secs(5),
        "the flow on node 2 again",
        || async { (ask().await.as_deref() == Some("n2")).then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn on_backend_down_close_resets_the_open_connections_of_a_failed_backend() {
    require_netns!();
    let mut bed = Bed::new("kclose", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let mut n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let text = config().lb(kernel_lb(&[1, 2]).keys("on_backend_down = \"close\""));
    start_kernel(&mut bed, &text).await;
    let mut open = open_to(&bed, "n2").await;
    echoes(&mut open, b"before").await.unwrap();

    n2.stop_health();
    bed.daemon()
        .wait_health(
            "default/web",
            node_ip(2),
            "unhealthy",
            Duration::from_secs(10),
        )
        .await;
    // Its conntrack entry deleted, the connection's next segment is a new
    // flow that meets a reset: the client learns at once and reconnects.
    let deadline = Instant::now() + Duration::from_secs(5);
    let cut = loop {
        if let Err(e) = echoes(&mut open, b"after").await {
            break e;
        }
        assert!(
            Instant::now() < deadline,
            "the open connection still runs after 5 s"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert_ne!(
        cut.kind(),
        ErrorKind::TimedOut,
        "a reset, not silence: {cut}"
    );
    assert_eq!(tally(&bed, 4).await, counts(&[("n1", 4)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_host_that_does_not_forward_keeps_the_listener_with_the_proxy_and_says_why() {
    require_netns!();
    let mut bed = Bed::new("knofwd", 1);
    // net.ipv4.ip_forward stays 0, as in a new namespace.
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    bed.start_daemon(&kernel_config(&[1]).to_string()).await;
    let l = served_by_proxy_because(&bed).await;
    assert_eq!(l["forwarding"], "proxy", "{l}");
    assert!(
        l["kernel_error"]
            .as_str()
            .unwrap()
            .starts_with("net.ipv4.ip_forward is 0"),
        "{l}"
    );
    assert_eq!(
        tally(&bed, 3).await,
        counts(&[("n1", 3)]),
        "served by the proxy"
    );
    bed.daemon()
        .wait_logged("net.ipv4.ip_forward is 0 on this host")
        .await;
    // Turned on by the operator: the listener goes to the kernel (checked
    // every 5 s).
    bed.enable_forwarding();
    tokio::time::timeout(Duration::from_secs(15), wait_kernel(&bed))
        .await
        .expect("in the kernel within 15 s");
    assert_eq!(tally(&bed, 3).await, counts(&[("n1", 3)]));
    // IPv6 forwarding is 0 here too, but no kernel listener is IPv6: no
    // word of it (issue 40: an ERROR about it misled).
    let log = bed.daemon().log();
    assert!(
        !log.contains("net.ipv6.conf.all.forwarding"),
        "a line about IPv6 forwarding with IPv4 kernel listeners only:\n{log}"
    );
}

/// The listener is still the kernel's and no write failed: what a test saw
/// was the kernel's doing, not the proxy's fallback (which picks alike).
async fn still_in_the_kernel(bed: &Bed) {
    let s = bed.daemon().status().await;
    assert_eq!(
        s["load_balancers"][0]["listeners"][0]["forwarding"], "kernel",
        "{s}"
    );
    let m = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(
            &m,
            "harvester_lb_kernel_syncs_total",
            &[("result", "failure")]
        ),
        0.0,
        "{}",
        bed.daemon().log_tail(20)
    );
}

/// The node that answers a connection to VIP:80 made from client address
/// `src` (one of the client namespace's addresses).
async fn served_from(bed: &Bed, src: Ipv4Addr) -> String {
    let s = bed.client.socket().unwrap();
    s.bind(SocketAddr::new(src.into(), 0)).unwrap();
    let mut c = tokio::time::timeout(Duration::from_secs(5), s.connect(sa(VIP, 80)))
        .await
        .unwrap_or_else(|_| panic!("connect from {src} within 5 s"))
        .unwrap_or_else(|e| panic!("connect from {src}: {e}"));
    read_line(&mut c).await.unwrap()
}

/// The node each client address is served by.
async fn by_client(bed: &Bed, clients: &[Ipv4Addr]) -> BTreeMap<Ipv4Addr, String> {
    let mut out = BTreeMap::new();
    for &c in clients {
        out.insert(c, served_from(bed, c).await);
    }
    out
}

/// Waits until the bucket map of the listener on VIP:80/tcp satisfies `ok`.
async fn wait_buckets(bed: &Bed, what: &str, ok: impl Fn(&str) -> bool) {
    let map = ("map", "m_tcp_80_198.51.100.10");
    wait_listed(bed, map, Duration::from_secs(10), what, ok).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn source_ip_keeps_each_client_on_its_node_and_moves_only_the_clients_of_a_node_that_left() {
    require_netns!();
    let mut bed = Bed::new("ksrcip", 3);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let mut n3 = Node::start(&bed, 3, Service::NameThenEcho);
    // 24 client addresses (the bed uses .2, .3, .10, .11, .21-.29).
    let clients: Vec<Ipv4Addr> = (130..154).map(|i| Ipv4Addr::new(198, 51, 100, i)).collect();
    for c in &clients {
        bed.client
            .ip(&["addr", "add", &format!("{c}/32"), "dev", "eth0"]);
    }
    let text = config().lb(kernel_lb(&[1, 2, 3]).keys("algorithm = \"source_ip\""));
    start_kernel(&mut bed, &text).await;

    let before = by_client(&bed, &clients).await;
    assert_eq!(
        by_client(&bed, &clients).await,
        before,
        "each client kept its node"
    );
    let used: std::collections::BTreeSet<&String> = before.values().collect();
    assert_eq!(used.len(), 3, "24 clients over 3 nodes: {before:?}");

    // Node 3 fails its check: its clients move, nobody else's do.
    n3.stop_health();
    bed.daemon()
        .wait_health(
            "default/web",
            node_ip(3),
            "unhealthy",
            Duration::from_secs(15),
        )
        .await;
    wait_buckets(&bed, "node 3 out of the buckets", |m| {
        m.contains("198.51.100.21") && !m.contains("198.51.100.23")
    })
    .await;
    let during = by_client(&bed, &clients).await;
    for (c, was) in &before {
        if was == "n3" {
            assert_ne!(during[c], "n3", "client {c} still on the node that left");
        } else {
            assert_eq!(&during[c], was, "client {c} moved although its node stayed");
        }
    }

    // Node 3 back: exactly its clients come back to it.
    n3.start_health();
    bed.daemon()
        .wait_health(
            "default/web",
            node_ip(3),
            "healthy",
            Duration::from_secs(15),
        )
        .await;
    wait_buckets(&bed, "node 3 back in the buckets", |m| {
        m.contains("198.51.100.23")
    })
    .await;
    assert_eq!(by_client(&bed, &clients).await, before);
    still_in_the_kernel(&bed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn client_affinity_keeps_a_client_on_its_node_until_that_node_leaves() {
    require_netns!();
    let mut bed = Bed::new("kaff", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let text = config()
        .lb(kernel_lb(&[1, 2])
            .keys("session_affinity = \"client_ip\"\naffinity_timeout_seconds = 600"));
    start_kernel(&mut bed, &text).await;

    // Round robin would alternate; affinity keeps the first answer.
    let first = served_from(&bed, netns::CLIENT_IP).await;
    for _ in 0..6 {
        assert_eq!(served_from(&bed, netns::CLIENT_IP).await, first);
    }
    let node = if first == "n1" { 1 } else { 2 };
    let other = if node == 1 { "n2" } else { "n1" };
    let set = listed(
        &bed,
        "set",
        &format!("a_tcp_80_198.51.100.10_{}", node_ip(node)),
    );
    assert!(
        set.contains("timeout 10m") && set.contains("198.51.100.2 expires 9m"),
        "the client is remembered for the listener's timeout: {set}"
    );

    // Its node drained: the client picks again, and keeps the new node,
    // also once the first one is back (it lost its clients on leaving).
    set_state(&bed, "default/web", node, "drain");
    let ip = node_ip(node).to_string();
    wait_chain(&bed, "the drained node out of the choice", |l| {
        !l.contains(&ip)
    })
    .await;
    for _ in 0..6 {
        assert_eq!(served_from(&bed, netns::CLIENT_IP).await, other);
    }
    set_state(&bed, "default/web", node, "ready");
    wait_chain(&bed, "the node back in the choice", |l| l.contains(&ip)).await;
    for _ in 0..6 {
        assert_eq!(served_from(&bed, netns::CLIENT_IP).await, other);
    }
    still_in_the_kernel(&bed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stopped_backend_is_out_of_the_kernel_within_the_detection_time() {
    require_netns!();
    let mut bed = Bed::new("kdetect", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let n2 = Node::start(&bed, 2, Service::NameThenEcho);
    start_kernel(&mut bed, &kernel_config(&[1, 2])).await;
    assert_eq!(tally(&bed, 4).await, counts(&[("n1", 2), ("n2", 2)]));

    // failure_threshold (1) x period (1 s) + timeout (1 s), as the issue
    // states it; the margin covers a machine busy with other tests (the
    // probe's schedule, the 5 ms coalescing, one `nft` run).
    let bound = Duration::from_secs(1) + Duration::from_secs(1);
    let margin = Duration::from_secs(3);
    let started = Instant::now();
    drop(n2); // Its health port and nodeport close at once.
    let deadline = started + Duration::from_secs(30);
    let took = loop {
        let l = listed(&bed, "chain", "l_tcp_80_198.51.100.10");
        if l.contains("dnat") && !l.contains("198.51.100.22") {
            break started.elapsed();
        }
        assert!(Instant::now() < deadline, "node 2 still in the kernel: {l}");
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    eprintln!("node 2 out of the kernel {took:?} after it stopped");
    assert!(
        took <= bound + margin,
        "out of the kernel after {took:?}; bound {bound:?} + margin {margin:?}"
    );
    // From then on, no new connection fails.
    assert_eq!(tally(&bed, 20).await, counts(&[("n1", 20)]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn open_kernel_connections_count_as_active_connections_of_their_backend() {
    require_netns!();
    let mut bed = Bed::new("kactive", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    start_kernel(&mut bed, &kernel_config(&[1, 2])).await;

    // Five connections held open; the node named by each is its backend.
    let mut open = Vec::new();
    let mut want: BTreeMap<String, f64> = BTreeMap::new();
    for _ in 0..5 {
        let mut s = bed
            .client
            .connect(sa(VIP, 80), Duration::from_secs(5))
            .await
            .unwrap();
        let name = read_line(&mut s).await.unwrap();
        let ip = node_ip(name[1..].parse().unwrap()).to_string();
        *want.entry(ip).or_insert(0.0) += 1.0;
        open.push(s);
    }
    assert_eq!(want.len(), 2, "round robin reached both: {want:?}");
    let active = |m: &str, ip: &str| {
        netns::metric(
            m,
            "harvester_lb_backend_connections_active",
            &[("backend", ip)],
        )
    };
    // Counted at each metrics read (every 5 s).
    wait_for(
        Duration::from_secs(20),
        "the open connections in backend_connections_active",
        || async {
            let m = bed.daemon().metrics().await;
            want.iter()
                .all(|(ip, n)| active(&m, ip) == *n)
                .then_some(())
        },
    )
    .await;

    // Closed: TIME_WAIT entries are not open connections.
    drop(open);
    wait_for(
        Duration::from_secs(20),
        "no open connection left",
        || async {
            let m = bed.daemon().metrics().await;
            want.keys().all(|ip| active(&m, ip) == 0.0).then_some(())
        },
    )
    .await;
    still_in_the_kernel(&bed).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kernel_udp_flows_count_as_flows_of_their_backend() {
    require_netns!();
    let mut bed = Bed::new("kudpflows", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    let _u1 = udp_teller(&bed, 1, 30053);
    let _u2 = udp_teller(&bed, 2, 30053);
    start_kernel(&mut bed, &udp_kernel_config()).await;

    // Five clients (five source ports), one answered datagram each.
    let mut want: BTreeMap<String, f64> = BTreeMap::new();
    let mut clients = Vec::new();
    for _ in 0..5 {
        let c = in_ns(&bed.client.name, || {
            let s = std::net::UdpSocket::bind(sa(netns::CLIENT_IP, 0))?;
            s.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(s)
        })
        .unwrap();
        let c = tokio::net::UdpSocket::from_std(c).unwrap();
        c.connect(sa(VIP, 53)).await.unwrap();
        let name = wait_for(Duration::from_secs(5), "an answer", || async {
            c.send(b"who").await.ok()?;
            let mut buf = [0u8; 64];
            let n = tokio::time::timeout(Duration::from_millis(300), c.recv(&mut buf))
                .await
                .ok()?
                .ok()?;
            Some(String::from_utf8_lossy(&buf[..n]).into_owned())
        })
        .await;
        let ip = node_ip(name[1..].parse().unwrap()).to_string();
        *want.entry(ip).or_insert(0.0) += 1.0;
        clients.push(c);
    }
    wait_for(
        Duration::from_secs(20),
        "the kernel's UDP flows in udp_backend_flows_active",
        || async {
            let m = bed.daemon().metrics().await;
            want.iter()
                .all(|(ip, n)| {
                    netns::metric_sample(
                        &m,
                        "harvester_lb_udp_backend_flows_active",
                        &[("listener", "dns"), ("backend", ip)],
                    ) == Some(*n)
                })
                .then_some(())
        },
    )
    .await;
    still_in_the_kernel(&bed).await;
}

/// `nft -f -` with `script` in namespace `ns`, panicking with its output.
fn nft_script(ns: &str, script: &str) {
    run("ip", &["netns", "exec", ns, "nft", "-f", "-"], Some(script));
}

/// The tables as written are read back and compared: each way another
/// process breaks them is found and named, the listeners it breaks are no
/// longer reported as forwarded, and the next sync writes it all again.
#[test]
fn a_check_finds_each_tampering_names_it_and_the_next_sync_repairs_it() {
    require_netns!();
    let ns = Scratch::new("chk");
    let both = ["10.0.0.1", "10.0.0.2"];
    // Listeners over most of the 16 tables, and an IPv6 one (its keys
    // are read back as well).
    let mut desired: kernel::Desired = (1..=40)
        .map(|p| ((ip("192.0.2.10"), Protocol::Tcp, p), listener(&both, &both)))
        .collect();
    let v6 = ["2001:db8::1", "2001:db8::2"];
    desired.insert((ip("2001:db8::10"), Protocol::Udp, 53), listener(&v6, &v6));
    let a = *desired
        .keys()
        .find(|id| kernel::table_of(id) != kernel::TABLE)
        .expect("a listener outside the main table");
    let other = *desired
        .keys()
        .find(|id| kernel::table_of(id) != kernel::table_of(&a))
        .expect("a listener in another table");
    let shard = kernel::table_of(&a);
    let chain = format!("l_tcp_{}_192.0.2.10", a.2);
    let main = kernel::TABLE;
    let cases = [
        (
            format!("delete table inet {shard}"),
            format!("table inet {shard}"),
            false,
        ),
        (
            "flush ruleset".to_string(),
            format!("table inet {main}"),
            true,
        ),
        (
            format!("insert rule inet {shard} {chain} meta l4proto tcp dnat ip to 10.9.9.9:22"),
            format!("the rules of chain inet {shard} {chain} (2 written, 3 now)"),
            false,
        ),
        (
            format!("flush chain inet {shard} {chain}"),
            format!("the rules of chain inet {shard} {chain} (2 written, 0 now)"),
            false,
        ),
        (
            format!("flush chain inet {main} input\ndelete chain inet {main} input"),
            format!("chain inet {main} input"),
            true,
        ),
        (
            format!(
                "delete element inet {shard} dispatch4 {{ 192.0.2.10 . tcp . {} }}",
                a.2
            ),
            format!(
                "192.0.2.10 . tcp . {} : goto {chain} of map inet {shard} dispatch4",
                a.2
            ),
            false,
        ),
        (
            format!("add chain inet {shard} sneak {{ type nat hook prerouting priority -150; }}"),
            format!("chain inet {shard} sneak"),
            false,
        ),
    ];
    let name = ns.0.clone();
    let ns_name = ns.0.clone();
    in_ns(&name, move || {
        let table = KernelTable::new();
        assert!(matches!(table.sync(&desired), Ok(Synced::Written(_))));
        assert_eq!(table.check(), Ok(kernel::Checked::InPlace));
        for (script, named, breaks_all) in cases {
            nft_script(&ns_name, &script);
            let found = table.check();
            let Ok(kernel::Checked::Repairing(what)) = &found else {
                panic!("{script}: {found:?}");
            };
            assert!(what.contains(&named), "{script}: {what}");
            assert!(!table.forwards(&a), "{script}");
            assert!(table.impaired(&a).is_some(), "{script}");
            assert!(!table.forwarded().contains(&a), "{script}");
            assert_eq!(table.forwards(&other), !breaks_all, "{script}");
            // The next sync writes everything: in place again.
            assert!(
                matches!(table.sync(&desired), Ok(Synced::Written(_))),
                "{script}"
            );
            assert_eq!(table.check(), Ok(kernel::Checked::InPlace), "{script}");
            assert!(table.forwards(&a) && table.forwards(&other), "{script}");
            let (ok, listing) = nft_out(&ns_name, &["list", "ruleset"]);
            assert!(ok, "{listing}");
            assert!(!listing.contains("10.9.9.9") && !listing.contains("sneak"));
            for want in [
                format!("192.0.2.10 . tcp . {} : goto {chain}", a.2),
                "chain input".to_string(),
                "dnat ip to 10.0.0.2:30080".to_string(),
            ] {
                assert!(listing.contains(&want), "{script}: no {want} in {listing}");
            }
        }
        // A flip is not taken for a change.
        let mut flipped = desired.clone();
        flipped.insert(a, listener(&["10.0.0.1"], &both));
        assert!(matches!(
            table.sync_changed(&flipped, &[a]),
            Ok(Synced::Written(_))
        ));
        assert_eq!(table.check(), Ok(kernel::Checked::InPlace));
        // Nor what the kernel changes itself: counters.
        table.remove().unwrap();
        assert_eq!(table.check(), Ok(kernel::Checked::NothingOwned));
    });
}

/// What a check costs at scale: the read-back of 2,000 listeners after a
/// commit (anyone's) moved the ruleset's generation, and a check at rest
/// (the figures are printed; the bounds are only against a pathological
/// read).
#[test]
fn a_check_of_two_thousand_listeners_is_one_cheap_read() {
    require_netns!();
    let ns = Scratch::new("chk2k");
    let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    let desired: kernel::Desired = (0..2_000u32)
        .map(|i| {
            let vip = IpAddr::V4(Ipv4Addr::from(0xc000_0200 + i / 100));
            (
                (vip, Protocol::Tcp, 1000 + (i % 100) as u16),
                listener(&members, &members),
            )
        })
        .collect();
    let name = ns.0.clone();
    let (write, checks) = in_ns(&name, move || {
        let table = KernelTable::new();
        let started = Instant::now();
        table.sync(&desired).unwrap();
        let write = started.elapsed();
        let check = || {
            let started = Instant::now();
            assert_eq!(table.check(), Ok(kernel::Checked::InPlace));
            started.elapsed()
        };
        let read: Vec<Duration> = (0..5)
            .map(|i| {
                // Another program's commit: the tables are read again.
                let bump = format!("hlb_test_{i}");
                let added = std::process::Command::new("nft")
                    .args(["add", "table", "inet", &bump])
                    .status()
                    .unwrap();
                assert!(added.success());
                check()
            })
            .collect();
        let at_rest = check();
        (write, (read, at_rest))
    });
    let (read, at_rest) = checks;
    let mut sorted = read.clone();
    sorted.sort();
    println!(
        "2,000 kernel listeners: full write {write:?}, check after a commit: median {:?} (all: {read:?}), at rest {at_rest:?}",
        sorted[2]
    );
    assert!(sorted[2] < Duration::from_secs(2), "{read:?}");
    assert!(at_rest < Duration::from_millis(100), "{at_rest:?}");
}

/// The connections to the kernel listener (VIP:80, in the shard table
/// `inet harvester_lb_nat_4`) and the metric of repairs.
async fn repairs(bed: &Bed) -> f64 {
    netns::metric(
        &bed.daemon().metrics().await,
        "harvester_lb_kernel_repairs_total",
        &[],
    )
}

/// Waits until the kernel balances VIP:80 over both nodes again and
/// `/status` says so.
async fn served_again(bed: &Bed, case: &str) {
    wait_for(
        Duration::from_secs(15),
        &format!("{case}: both nodes served through the kernel again"),
        || async { (tally(bed, 10).await == counts(&[("n1", 5), ("n2", 5)])).then_some(()) },
    )
    .await;
    wait_kernel(bed).await;
    // `/status` shows the listener forwarded once its chain is back, but
    // the gauge turns 1 only when the whole repair's write has gone
    // through (a deleted `input` chain never stopped the traffic): wait
    // for it too rather than read it once.
    wait_for(
        Duration::from_secs(15),
        &format!("{case}: kernel_forwarding_up back to 1"),
        || async {
            let m = bed.daemon().metrics().await;
            (netns::metric_sample(&m, "harvester_lb_kernel_forwarding_up", &[]) == Some(1.0))
                .then_some(())
        },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tampered_tables_are_repaired_within_the_check_interval_and_at_a_reload() {
    require_netns!();
    let mut bed = Bed::new("krep", 2);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    let _n2 = Node::start(&bed, 2, Service::NameThenEcho);
    start_kernel(&mut bed, &kernel_config(&[1, 2])).await;
    assert_eq!(tally(&bed, 10).await, counts(&[("n1", 5), ("n2", 5)]));
    let shard = kernel::table_of(&(IpAddr::V4(VIP), Protocol::Tcp, 80));
    assert_ne!(shard, kernel::TABLE, "the listener is in a shard's table");
    let chain = "l_tcp_80_198.51.100.10";
    let main = kernel::TABLE;
    let cases = [
        (
            "one shard's table deleted",
            format!("delete table inet {shard}"),
            format!("table inet {shard}"),
        ),
        (
            "nft flush ruleset",
            "flush ruleset".to_string(),
            format!("table inet {main}"),
        ),
        (
            "a hijacking dnat at the top of the listener's chain",
            format!(
                "insert rule inet {shard} {chain} meta l4proto tcp dnat ip to {}:{NODEPORT}",
                node_ip(2)
            ),
            format!("chain inet {shard} {chain}"),
        ),
        (
            "the listener's chain flushed",
            format!("flush chain inet {shard} {chain}"),
            format!("chain inet {shard} {chain}"),
        ),
        (
            "the main table's input chain deleted",
            format!("flush chain inet {main} input\ndelete chain inet {main} input"),
            format!("chain inet {main} input"),
        ),
    ];
    for (case, script, named) in &cases {
        let before = repairs(&bed).await;
        bed.lb.nft(script);
        let tampered = Instant::now();
        wait_for(
            Duration::from_secs(30),
            &format!("{case}: a repair counted"),
            || async { (repairs(&bed).await > before).then_some(()) },
        )
        .await;
        bed.daemon()
            .wait_log(
                &format!("{case}: a warning naming {named}, found by the periodic check"),
                |log| {
                    log.lines().any(|l| {
                        l.contains("the kernel NAT tables are not the ones")
                            && l.contains(named.as_str())
                            && l.contains("periodic check")
                    })
                },
            )
            .await;
        served_again(&bed, case).await;
        println!(
            "{case}: repaired and served again {:?} after",
            tampered.elapsed()
        );
    }

    // A reload checks at once (the periodic check is up to 10 s away).
    for reload in ["SIGHUP", "POST /reload"] {
        let before = repairs(&bed).await;
        let at_reload = bed.daemon().log().matches("at reload").count();
        bed.lb.nft(&format!("delete table inet {shard}"));
        if reload == "SIGHUP" {
            bed.daemon().signal(libc::SIGHUP);
        } else {
            let (code, body) = bed.daemon().request("POST", "/reload").await.unwrap();
            assert_eq!(code, 200, "{body}");
        }
        wait_for(
            Duration::from_secs(5),
            &format!("{reload}: the repair, found at reload"),
            || async {
                (repairs(&bed).await > before
                    && bed.daemon().log().matches("at reload").count() > at_reload)
                    .then_some(())
            },
        )
        .await;
        served_again(&bed, reload).await;
    }
}

/// Another program's forward chain with `policy drop` (Docker's `ip filter
/// FORWARD`) would blackhole every connection the kernel forwards while
/// the NAT table is written: the listener stays with the proxy, `/status`
/// and the log name the chain, the metric says so; the remedy the error
/// names (`ct status dnat accept` in that chain) brings it back to the
/// kernel, through the same chain.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_foreign_forward_chain_that_drops_keeps_the_listener_with_the_proxy_and_says_why() {
    require_netns!();
    let mut bed = Bed::new("kfwdrop", 1);
    bed.enable_forwarding();
    let _n1 = Node::start(&bed, 1, Service::NameThenEcho);
    // As Docker leaves it: policy drop, a jump to DOCKER-USER, accepts
    // for its own bridge only.
    bed.lb.nft(
        "table ip filter {
           chain DOCKER-USER {
           }
           chain FORWARD {
             type filter hook forward priority filter; policy drop;
             jump DOCKER-USER
             oifname \"docker0\" ct state related,established accept
           }
         }",
    );
    bed.start_daemon(&kernel_config(&[1]).to_string()).await;
    let l = served_by_proxy_because(&bed).await;
    assert_eq!(l["forwarding"], "proxy", "{l}");
    let why = l["kernel_error"].as_str().unwrap();
    assert!(
        why.starts_with("forward chain ip filter FORWARD (policy drop) of another program"),
        "{l}"
    );
    assert_eq!(
        tally(&bed, 3).await,
        counts(&[("n1", 3)]),
        "served by the proxy"
    );
    let m = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(&m, "harvester_lb_kernel_forward_blocked", &[]),
        1.0
    );
    bed.daemon()
        .wait_logged("forward chain ip filter FORWARD (policy drop) of another program drops")
        .await;

    // The operator lets DNATed traffic through (checked every 5 s).
    bed.lb
        .nft("insert rule ip filter DOCKER-USER ct status dnat accept");
    tokio::time::timeout(Duration::from_secs(15), wait_kernel(&bed))
        .await
        .expect("in the kernel within 15 s");
    assert_eq!(tally(&bed, 3).await, counts(&[("n1", 3)]));
    still_in_the_kernel(&bed).await;
    let m = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(&m, "harvester_lb_kernel_forward_blocked", &[]),
        0.0
    );
}

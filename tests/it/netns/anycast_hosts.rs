//! The anycast sync's pieces shared by `tests/it/anycast.rs` (two hosts) and
//! `tests/it/anycast_hosts.rs` (two and three hosts): a host of the
//! [`BgpBed`] started with `[conntrackd]` in its anycast mode and its
//! conntrackd run as Debian's unit runs it, and the traffic held across a
//! move (a line echoed every 100 ms on a connection, a datagram asked every
//! 100 ms on a fixed-port UDP flow), each handing its socket back so the
//! same flows can be measured again across the next fault.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncWriteExt, BufReader};
use tokio::net::{TcpStream, UdpSocket};

use super::bgp::{BgpBed, TABLE, host_ip};
use super::keepalived::Conntrackd;

/// The `[vip]` body of a host that announces: rise after `delay` seconds,
/// `grace` seconds between withdrawing at SIGTERM and draining.
pub fn announcing(delay: u32, grace: u32) -> String {
    format!(
        "announce = \"routes\"\nannounce_prefixes = [\"198.51.100.0/24\", \"2001:db8:100::/64\"]\nannounce_interface = \"lo\"\nannounce_table = {TABLE}\nannounce_delay_seconds = {delay}\nwithdraw_grace_seconds = {grace}\n"
    )
}

/// How many listeners of a `/status` document say `"forwarding": kind`.
pub fn listeners_forwarding(status: &serde_json::Value, kind: &str) -> usize {
    match status {
        serde_json::Value::Object(m) => {
            usize::from(m.get("forwarding").and_then(|v| v.as_str()) == Some(kind))
                + m.values()
                    .map(|v| listeners_forwarding(v, kind))
                    .sum::<usize>()
        }
        serde_json::Value::Array(a) => a.iter().map(|v| listeners_forwarding(v, kind)).sum(),
        _ => 0,
    }
}

/// Writes host `i`'s config (the shared pool of every host's backend,
/// `flow_hash`, TCP and UDP kernel listeners with `source_nat = "vip"`)
/// with `[conntrackd]` in the anycast mode on the hosts' link `eth0`, its
/// other keys `sync` (TOML lines: the peer, or the transport), turns on
/// the liberal TCP tracking the mode needs, starts the daemon and waits
/// for the conntrackd file it renders (asserted to be the anycast mode's).
/// Returns the file's path.
pub async fn start_synced(bed: &mut BgpBed, i: usize, sync: &str) -> PathBuf {
    let h = bed.host_mut(i);
    h.enable_forwarding();
    // docs/many-hosts.md: the anycast sync needs liberal TCP window
    // tracking on every host (a flow that comes back finds its own entry's
    // windows behind).
    super::run(
        "ip",
        &[
            "netns",
            "exec",
            &h.ns.name,
            "sysctl",
            "-q",
            "-w",
            "net.netfilter.nf_conntrack_tcp_be_liberal=1",
        ],
        None,
    );
    let path = h.write_shared_config(
        &announcing(1, 1),
        "algorithm = \"flow_hash\"",
        "  forwarding = \"kernel\"\n  source_nat = \"vip\"\n",
    );
    let d = h.dir.clone();
    let conf = d.join("conntrackd.conf");
    let text = format!(
        "{}\n[conntrackd]\ninterface = \"eth0\"\naddress = \"{}\"\n{}config_path = \"{}\"\nsocket = \"{}\"\nlock_file = \"{}\"\nlog_file = \"{}\"\n",
        std::fs::read_to_string(&path).expect("read config"),
        host_ip(i),
        sync,
        conf.display(),
        d.join("ctd.ctl").display(),
        d.join("ctd.lock").display(),
        d.join("ctd.log").display(),
    );
    std::fs::write(&path, text).expect("write config");
    let _ = std::fs::remove_file(&conf);
    h.start_daemon().await;
    super::wait_for(
        Duration::from_secs(15),
        "the daemon wrote conntrackd's file",
        || {
            let conf = conf.clone();
            async move { conf.exists().then_some(()) }
        },
    )
    .await;
    let rendered = std::fs::read_to_string(&conf).expect("conntrackd.conf");
    assert!(
        rendered.contains("DisableExternalCache On"),
        "not the anycast mode:\n{rendered}"
    );
    conf
}

/// Runs conntrackd on host `i`'s file `conf` as its unit does (`conntrackd
/// -C FILE`, in the foreground; output to `conntrackd-<n>.out`).
pub fn run_conntrackd(bed: &BgpBed, i: usize, conf: &std::path::Path) -> Conntrackd {
    static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let h = bed.host(i);
    let out = h.dir.join(format!(
        "conntrackd-{}.out",
        RUNS.fetch_add(1, Ordering::Relaxed)
    ));
    Conntrackd::run(&h.ns, conf, &out)
}

/// Waits until host `i`'s daemon forwards both listeners (TCP and UDP)
/// by the kernel.
pub async fn wait_kernel_listeners(bed: &BgpBed, i: usize) {
    let d = bed.host(i).daemon();
    super::wait_for(
        Duration::from_secs(15),
        "both listeners forwarded by the kernel",
        || async {
            let s = d.status().await;
            (listeners_forwarding(&s, "kernel") == 2).then_some(())
        },
    )
    .await;
}

/// A fixed-port UDP flow from the client to `vip`: its socket and the
/// backend that answered its first datagram (asked up to three times).
pub async fn udp_flow(bed: &BgpBed, vip: std::net::SocketAddr) -> (UdpSocket, usize) {
    let s = super::bgp::udp_socket(&bed.client, "0.0.0.0:0".parse().expect("addr"));
    s.connect(vip).await.expect("connect UDP");
    for _ in 0..3 {
        if let Some(backend) = super::bgp::udp_ask(&s).await {
            return (s, backend);
        }
    }
    panic!("a UDP flow got no answer")
}

/// Waits until host `i`'s daemon forwards both listeners by the kernel,
/// its conntrackd `ctd` answers, and its `/status` says conntrackd is up.
pub async fn wait_synced_ready(bed: &BgpBed, i: usize, ctd: &Conntrackd) {
    wait_kernel_listeners(bed, i).await;
    let d = bed.host(i).daemon();
    super::wait_for(Duration::from_secs(15), "conntrackd answers", || async {
        ctd.control(&["-s"]).map(|_| ())
    })
    .await;
    // The daemon reads conntrackd's statistics in this mode too.
    super::wait_for(
        Duration::from_secs(30),
        "/status conntrack_sync.conntrackd_up",
        || async {
            let s = d.status().await;
            (s["conntrack_sync"]["conntrackd_up"] == true).then_some(())
        },
    )
    .await;
}

/// Echo traffic on one held connection (see [`echo_traffic`]).
#[derive(Debug, Default, Clone)]
pub struct Echoes {
    /// Lines written.
    pub sent: u64,
    /// Lines echoed back intact.
    pub echoed: u64,
    /// Whether the connection failed (reset, closed, a wrong echo, or no
    /// echo within 10 s).
    pub broken: bool,
    /// The longest time between two echoes.
    pub gap: Duration,
}

/// Writes a numbered line every 100 ms on `c` and reads its echo, until
/// `stop` (or the connection fails); bounded (at most 3000 lines). Hands
/// the connection back, for the next round.
pub async fn echo_traffic(
    mut c: BufReader<TcpStream>,
    stop: Arc<AtomicBool>,
) -> (BufReader<TcpStream>, Echoes) {
    let mut e = Echoes::default();
    let mut last = Instant::now();
    for n in 0..3000u32 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        let line = format!("line {n}\n");
        let r = tokio::time::timeout(Duration::from_secs(10), async {
            c.get_mut().write_all(line.as_bytes()).await?;
            let mut got = String::new();
            c.read_line(&mut got).await?;
            Ok::<_, std::io::Error>(got)
        })
        .await;
        e.sent += 1;
        match r {
            Ok(Ok(got)) if got == line => {
                e.echoed += 1;
                e.gap = e.gap.max(last.elapsed());
                last = Instant::now();
            }
            _ => {
                e.broken = true;
                break;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (c, e)
}

/// One fixed-port UDP flow's traffic (see [`udp_traffic`]).
#[derive(Debug, Default, Clone)]
pub struct Datagrams {
    /// Datagrams sent.
    pub sent: u64,
    /// Answered within 1 s.
    pub answered: u64,
    /// Answered by another backend than the first answer's.
    pub other_backend: u64,
    /// The longest time between two answers.
    pub gap: Duration,
}

/// Sends a datagram every 100 ms on `s` (connected to the VIP) and reads
/// the answer (its backend's index), until `stop`; bounded. Hands the
/// socket back, for the next round.
pub async fn udp_traffic(
    s: UdpSocket,
    first: usize,
    stop: Arc<AtomicBool>,
) -> (UdpSocket, Datagrams) {
    let mut d = Datagrams::default();
    let mut last = Instant::now();
    let mut buf = [0u8; 64];
    for _ in 0..3000 {
        if stop.load(Ordering::Relaxed) {
            break;
        }
        d.sent += 1;
        if s.send(b"hi").await.is_ok()
            && let Ok(Ok(n)) = tokio::time::timeout(Duration::from_secs(1), s.recv(&mut buf)).await
        {
            d.answered += 1;
            d.gap = d.gap.max(last.elapsed());
            last = Instant::now();
            let text = String::from_utf8_lossy(&buf[..n]).to_string();
            if text.trim().strip_prefix('b').and_then(|i| i.parse().ok()) != Some(first) {
                d.other_backend += 1;
            }
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    (s, d)
}

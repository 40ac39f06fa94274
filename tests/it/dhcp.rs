//! `ipam = "dhcp"` against a real DHCP server: dnsmasq in the client
//! namespace of the test bed, the real daemon in the load-balancer
//! namespace leasing its VIP on a macvlan interface of `eth0`.
//!
//! One test walks the whole life of a lease, because each step needs the
//! one before (and a lease costs seconds): obtained and forwarded; renewed
//! at T1; dnsmasq restarted with its lease file (renewal goes on); dnsmasq
//! restarted without it and with another range (the renewal is NAKed and a
//! new VIP is leased, listeners move); the daemon stopped (RELEASE) and
//! started again (INIT-REBOOT gets the same address); the load balancer
//! removed (RELEASE, interface and state file gone). A kept lease that
//! expired while the daemon was down is asked for in a DISCOVER, not
//! claimed with INIT-REBOOT. dnsmasq's shortest
//! lease is 2 minutes; options 58/59 bring T1/T2 down to 6 s/9 s.
//!
//! The rogue-server tests give dnsmasq one bad offer each (a 128.0.0.0
//! mask, the host's own address, its gateway's, an address outside
//! `dhcp.allowed_ranges`) and check that the host's IPv4 routes are
//! unchanged, the address is not taken, and the refusal is counted and
//! shown in `/status`.
//!
//! Skips with a printed reason without root, iproute2/nftables or dnsmasq.
//! Run: `cargo test --test it -- dhcp:: --nocapture` (prints the timings).

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use netns::peers::{Node, Service};
use netns::{Bed, Ns, sa, wait_for};
use support::{Config, Lb, Listener, cannot_run, missing_tool, network, quote};
use tokio::io::AsyncReadExt;

const T1: u32 = 6;
const T2: u32 = 9;

/// dnsmasq serving DHCP on the client namespace's `eth0`.
struct Dnsmasq {
    child: Child,
    log: PathBuf,
    leases: PathBuf,
}

impl Dnsmasq {
    fn start(ns: &Ns, dir: &Path, range: (u8, u8)) -> Dnsmasq {
        Self::start_with(
            ns,
            dir,
            &[format!(
                "--dhcp-range=198.51.100.{},198.51.100.{},255.255.255.0,2m",
                range.0, range.1
            )],
        )
    }

    /// dnsmasq with `args` (its range, options) added to the bed's own.
    fn start_with(ns: &Ns, dir: &Path, args: &[String]) -> Dnsmasq {
        let log = dir.join("dnsmasq.log");
        let leases = dir.join("dnsmasq.leases");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns.name, "dnsmasq", "-k"])
            .args([
                "--conf-file=/dev/null",
                "--port=0",
                "--interface=eth0",
                "--bind-interfaces",
                "--user=root",
                "--log-dhcp",
                "--dhcp-authoritative",
                &format!("--dhcp-option=58,{T1}"),
                &format!("--dhcp-option=59,{T2}"),
                &format!("--dhcp-leasefile={}", leases.display()),
                &format!("--log-facility={}", log.display()),
                &format!("--pid-file={}", dir.join("dnsmasq.pid").display()),
            ])
            .args(args)
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("spawn dnsmasq");
        Dnsmasq { child, log, leases }
    }

    fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    fn count(&self, needle: &str) -> usize {
        self.log().lines().filter(|l| l.contains(needle)).count()
    }

    fn stop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Whether dnsmasq is missing, in which case the test is skipped (failed
/// under CI, see `skip_or_fail`) and the caller returns.
fn dnsmasq_skipped() -> bool {
    cannot_run(module_path!(), [missing_tool("dnsmasq", "dnsmasq-base")])
}

fn config(bed: &Bed, with_lb: bool) -> Config {
    config_with(bed, with_lb.then(web), "")
}

/// The listener of the leased VIP in most tests.
fn web() -> Listener {
    Listener::new("tcp", 80, netns::NODEPORT)
}

/// The bed's config with `listener` (if any) on a leased VIP, and
/// `dhcp_keys` (lines) added to its `[dhcp]` table.
fn config_with(bed: &Bed, listener: Option<Listener>, dhcp_keys: &str) -> Config {
    let mut c = netns::config().drain_timeout(1).text(&format!(
        "[dhcp]\nstate_directory = {}\n{dhcp_keys}",
        quote(bed.dir.join("state").display())
    ));
    if let Some(listener) = listener {
        c = c.lb(Lb::new("default/web", "0.0.0.0")
            .keys("ipam = \"dhcp\"")
            .backends([netns::node_ip(1)])
            .listener(listener)
            .keys("  [load_balancer.dhcp]\n  interface = \"eth0\""));
    }
    c
}

/// The lease in `/status` once it is bound with renewals >= `renewals`
/// and naks >= `naks`.
async fn lease(bed: &Bed, renewals: u64, naks: u64, within: Duration) -> serde_json::Value {
    let d = bed.daemon();
    wait_for(within, "a bound DHCP lease", || async {
        let s = d.status().await;
        let l = s["load_balancers"][0]["dhcp"].clone();
        (l["state"] == "bound"
            && l["address"].is_string()
            && l["renewals"].as_u64() >= Some(renewals)
            && l["naks"].as_u64() >= Some(naks)
            && s["load_balancers"][0]["listeners"][0]["state"] == "listening")
            .then_some(l)
    })
    .await
}

fn address(lease: &serde_json::Value) -> Ipv4Addr {
    lease["address"]
        .as_str()
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| panic!("no address in {lease}"))
}

/// One connection from the client to `vip:80`, which node 1 answers "n1".
async fn forwarded(bed: &Bed, vip: Ipv4Addr) -> bool {
    forwarded_from(&bed.client, vip).await
}

/// One connection from namespace `ns` to `vip:80`, which node 1 answers "n1".
async fn forwarded_from(ns: &Ns, vip: Ipv4Addr) -> bool {
    let Ok(mut s) = ns.connect(sa(vip, 80), Duration::from_secs(2)).await else {
        return false;
    };
    let mut buf = [0u8; 3];
    matches!(
        tokio::time::timeout(Duration::from_secs(2), s.read_exact(&mut buf)).await,
        Ok(Ok(_))
    ) && &buf == b"n1\n"
}

async fn eventually_forwarded(bed: &Bed, vip: Ipv4Addr) {
    wait_for(
        Duration::from_secs(10),
        &format!("traffic to {vip} forwarded"),
        || async { forwarded(bed, vip).await.then_some(()) },
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lease_renew_nak_reboot_release_against_dnsmasq() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let mut bed = Bed::new("dhcp", 1);
    let _node = Node::start(&bed, 1, Service::NameThenEcho);
    let mut dnsmasq = Dnsmasq::start(&bed.client, &bed.dir, (150, 160));
    let routes_before = ipv4_routes(&bed.lb);

    // Lease obtained; traffic to it forwarded.
    let started = Instant::now();
    bed.start_daemon(&config(&bed, true).to_string()).await;
    let first = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    let leased_in = started.elapsed();
    let vip = address(&first);
    assert!((150..=160).contains(&vip.octets()[3]), "{first}");
    assert_eq!(first["server"], netns::CLIENT_IP.to_string(), "{first}");
    eventually_forwarded(&bed, vip).await;
    // The lease added no route: the /24 the server's mask names is not
    // made on-link on the macvlan interface (noprefixroute).
    assert_eq!(
        ipv4_routes(&bed.lb),
        routes_before,
        "a lease changes none of the host's IPv4 routes but its own local ones"
    );
    assert!(
        leased_addresses(&bed.lb).contains(&format!("{vip}/24")),
        "{}",
        leased_addresses(&bed.lb)
    );
    // The start warns that no servers are named.
    bed.daemon()
        .wait_logged("any DHCP server on the segment is trusted")
        .await;
    let metrics = bed.daemon().metrics().await;
    assert_eq!(
        netns::metric(
            &metrics,
            "harvester_lb_dhcp_lease_info",
            &[("address", &vip.to_string())]
        ),
        1.0,
        "{metrics}"
    );
    assert!(
        dnsmasq.log().contains("kubernetes-default-web"),
        "hostname option sent:\n{}",
        dnsmasq.log()
    );

    // Renewed at T1, unicast to the server, same address.
    let t = Instant::now();
    let renewed = lease(&bed, 1, 0, Duration::from_secs(u64::from(T2) + 10)).await;
    let renewed_in = t.elapsed();
    assert_eq!(address(&renewed), vip);

    // dnsmasq restarted with its lease file: the next renewal is ACKed.
    dnsmasq.stop();
    let mut dnsmasq = Dnsmasq::start(&bed.client, &bed.dir, (150, 160));
    let after = lease(&bed, 2, 0, Duration::from_secs(u64::from(T2) + 10)).await;
    assert_eq!(address(&after), vip, "same lease after a dnsmasq restart");
    assert!(forwarded(&bed, vip).await);

    // dnsmasq restarted without its lease file and with another range: the
    // renewal is NAKed, and the VIP moves to a new lease.
    dnsmasq.stop();
    let _ = std::fs::remove_file(&dnsmasq.leases);
    let t = Instant::now();
    let dnsmasq = Dnsmasq::start(&bed.client, &bed.dir, (170, 180));
    let moved = lease(&bed, 0, 1, Duration::from_secs(u64::from(T2) + 20)).await;
    let moved_in = t.elapsed();
    let vip2 = address(&moved);
    assert!((170..=180).contains(&vip2.octets()[3]), "{moved}");
    eventually_forwarded(&bed, vip2).await;
    assert!(!forwarded(&bed, vip).await, "the old VIP no longer serves");
    bed.daemon()
        .wait_log("a WARN that the VIP lease was lost", |log| {
            log.contains("VIP lease lost") && log.contains("WARN")
        })
        .await;

    // Daemon stopped cleanly (RELEASE) and started again: INIT-REBOOT asks
    // for, and gets, the same address.
    let releases = dnsmasq.count("DHCPRELEASE");
    let mut d = bed.take_daemon();
    d.signal(libc::SIGTERM);
    assert!(
        d.wait_exit(Duration::from_secs(15)).await.is_some(),
        "daemon stopped"
    );
    drop(d);
    wait_for(
        Duration::from_secs(5),
        "DHCPRELEASE at a clean stop",
        || async { (dnsmasq.count("DHCPRELEASE") > releases).then_some(()) },
    )
    .await;
    let discovers = dnsmasq.count("DHCPDISCOVER");
    let t = Instant::now();
    bed.start_daemon(&config(&bed, true).to_string()).await;
    let rebooted = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    let rebooted_in = t.elapsed();
    assert_eq!(address(&rebooted), vip2, "INIT-REBOOT kept the address");
    assert_eq!(
        dnsmasq.count("DHCPDISCOVER"),
        discovers,
        "no DISCOVER after a restart"
    );
    eventually_forwarded(&bed, vip2).await;

    // The load balancer removed: RELEASE, interface and state file gone.
    let releases = dnsmasq.count("DHCPRELEASE");
    let path = bed.write("config.toml", &config(&bed, false).to_string());
    assert_eq!(path, bed.daemon().config);
    bed.daemon().signal(libc::SIGHUP);
    wait_for(
        Duration::from_secs(10),
        "DHCPRELEASE at removal",
        || async { (dnsmasq.count("DHCPRELEASE") > releases).then_some(()) },
    )
    .await;
    wait_for(
        Duration::from_secs(10),
        "the state file removed",
        || async {
            std::fs::read_dir(bed.dir.join("state"))
                .map(|d| d.count() == 0)
                .unwrap_or(true)
                .then_some(())
        },
    )
    .await;
    wait_for(
        Duration::from_secs(5),
        "the macvlan interface removed",
        || async {
            let out = Command::new("ip")
                .args(["-n", &bed.lb.name, "-o", "link", "show", "type", "macvlan"])
                .output()
                .ok()?;
            out.stdout.is_empty().then_some(())
        },
    )
    .await;
    assert!(!forwarded(&bed, vip2).await);

    println!(
        "DHCP timings: leased {leased_in:?} after start; renewed {renewed_in:?} after the lease (T1 = {T1} s); new lease {moved_in:?} after dnsmasq came back without its leases (next T1 + NAK + DISCOVER); INIT-REBOOT lease {rebooted_in:?} after restart"
    );
}

/// The bed of most tests here: node 1 answering "n1", dnsmasq leasing
/// 198.51.100.150-160.
fn leased_bed(name: &str) -> (Bed, Node, Dnsmasq) {
    let bed = Bed::new(name, 1);
    let node = Node::start(&bed, 1, Service::NameThenEcho);
    let dnsmasq = Dnsmasq::start(&bed.client, &bed.dir, (150, 160));
    (bed, node, dnsmasq)
}

/// A kept lease that expired while the daemon was down is not claimed at
/// start (an INIT-REBOOT REQUEST would take an address that may be someone
/// else's by now): the client DISCOVERs, asking for that address first, and
/// gets it back while it is free. Before, the first message after the start
/// was a REQUEST for it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_expired_kept_lease_is_asked_for_in_a_discover_not_claimed() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let (mut bed, _node, dnsmasq) = leased_bed("dhcpexp");
    let text = config(&bed, true).to_string();
    bed.start_daemon(&text).await;
    let vip = address(&lease(&bed, 0, 0, Duration::from_secs(30)).await);
    let mut d = bed.take_daemon();
    d.signal(libc::SIGTERM);
    assert!(
        d.wait_exit(Duration::from_secs(15)).await.is_some(),
        "daemon stopped"
    );
    drop(d);
    // The kept lease, expired ten seconds ago.
    let kept = std::fs::read_dir(bed.dir.join("state"))
        .expect("the state directory")
        .filter_map(Result::ok)
        .map(|e| e.path())
        .find(|p| {
            p.file_name()
                .is_some_and(|n| n.to_string_lossy().starts_with("dhcp-"))
        })
        .expect("a kept lease");
    let mut lease_file: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&kept).expect("read")).expect("JSON");
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .expect("after 1970")
        .as_secs_f64();
    lease_file["expires_unix"] = serde_json::json!(now - 10.0);
    std::fs::write(&kept, lease_file.to_string()).expect("write");

    let seen = dnsmasq.log().lines().count();
    bed.start_daemon(&text).await;
    let again = address(&lease(&bed, 0, 0, Duration::from_secs(30)).await);
    assert_eq!(again, vip, "asked for first, and free");
    let log = dnsmasq.log();
    let first = log
        .lines()
        .skip(seen)
        .find(|l| l.contains("DHCPDISCOVER(") || l.contains("DHCPREQUEST("))
        .unwrap_or_else(|| panic!("no DHCP message after the restart:\n{log}"));
    assert!(
        first.contains("DHCPDISCOVER("),
        "the first message after the restart: {first}"
    );
    bed.daemon()
        .wait_logged("the kept DHCP lease has expired")
        .await;
}

/// A leased VIP is isolated like any other: once the lease is bound, only
/// its listener's port answers on it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_vip_is_isolated_once_it_is_leased() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let (mut bed, _node, _dnsmasq) = leased_bed("dhcpiso");
    // The host's SSH, on its wildcard address.
    let ssh = bed.lb.listen(sa(Ipv4Addr::UNSPECIFIED, 22));
    tokio::spawn(async move {
        while let Ok((mut s, _)) = ssh.accept().await {
            use tokio::io::AsyncWriteExt;
            let _ = s.write_all(b"SSH-2.0\n").await;
        }
    });
    let text = config(&bed, true).vip("isolate = true").to_string();
    bed.start_daemon(&text).await;
    let vip = address(&lease(&bed, 0, 0, Duration::from_secs(30)).await);
    eventually_forwarded(&bed, vip).await;
    let status = wait_for(
        Duration::from_secs(10),
        "the leased VIP in the table",
        || async {
            let s = bed.daemon().status().await;
            (s["vip_isolation"]["vips"] == 1).then_some(s)
        },
    )
    .await;
    assert_eq!(status["vip_isolation"]["open_ports"], 1, "{status}");
    // Dropped: the connect times out instead of reaching SSH.
    let ssh_through_vip = bed
        .client
        .connect(sa(vip, 22), Duration::from_secs(1))
        .await;
    assert!(
        ssh_through_vip
            .as_ref()
            .is_err_and(|e| e.kind() == std::io::ErrorKind::TimedOut),
        "the host's SSH through the leased VIP: {ssh_through_vip:?}"
    );
    // The host's own address still has it.
    assert!(
        bed.client
            .connect(sa(netns::LB_IP, 22), Duration::from_secs(2))
            .await
            .is_ok()
    );
}

/// Another program deletes the leased address, then the macvlan
/// interface: each is read back and put back within the check interval
/// (the interface with its MAC, up on `eth0`; the address with its prefix
/// and `noprefixroute`), logged, counted, and the VIP serves again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_leased_address_or_macvlan_is_put_back() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let (mut bed, _node, _dnsmasq) = leased_bed("dhcprep");
    bed.start_daemon(&config(&bed, true).to_string()).await;
    let leased = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    let vip = address(&leased);
    let interface = leased["interface"].as_str().expect("interface").to_string();
    let link_before = link_of(&bed.lb, &interface);
    eventually_forwarded(&bed, vip).await;

    // The address deleted by hand.
    let t = Instant::now();
    bed.lb
        .ip(&["addr", "del", &format!("{vip}/24"), "dev", &interface]);
    assert_eq!(leased_addresses(&bed.lb), "");
    put_back(&bed, vip, &interface, 1).await;
    let address_in = t.elapsed();
    bed.daemon()
        .wait_logged(&format!("address {vip}/24 missing on {interface}"))
        .await;
    eventually_forwarded(&bed, vip).await;

    // The macvlan interface deleted by hand (and the address with it).
    let t = Instant::now();
    bed.lb.ip(&["link", "del", &interface]);
    put_back(&bed, vip, &interface, 2).await;
    let interface_in = t.elapsed();
    assert_eq!(
        link_of(&bed.lb, &interface),
        link_before,
        "made again with the same MAC, up, on eth0"
    );
    bed.daemon()
        .wait_logged(&format!("interface {interface} missing"))
        .await;
    eventually_forwarded(&bed, vip).await;
    // Renewals sent while the interface was gone failed: the lease is
    // still held (renewing or rebinding until the next retransmission).
    let l = bed.daemon().status().await["load_balancers"][0]["dhcp"].clone();
    assert!(
        ["bound", "renewing", "rebinding"].contains(&l["state"].as_str().unwrap_or("")),
        "{l}"
    );
    assert!(l["error"].is_null(), "{l}");
    assert_eq!(address(&l), vip, "the same lease throughout: {l}");
    println!(
        "DHCP repairs: address put back {address_in:?} after its deletion, interface {interface_in:?} after its deletion"
    );
}

/// Waits (30 s) until `vip/24` is on `interface` again with
/// `noprefixroute` and the daemon counts `repairs` repairs.
async fn put_back(bed: &Bed, vip: Ipv4Addr, interface: &str, repairs: u64) {
    wait_for(
        Duration::from_secs(30),
        &format!("{vip}/24 put back on {interface}, repair {repairs} counted"),
        || async {
            let shown = Command::new("ip")
                .args([
                    "-n",
                    &bed.lb.name,
                    "-4",
                    "-o",
                    "addr",
                    "show",
                    "dev",
                    interface,
                ])
                .output()
                .ok()?;
            let shown = String::from_utf8_lossy(&shown.stdout).to_string();
            let metrics = bed.daemon().metrics().await;
            let counted = netns::metric(&metrics, "harvester_lb_dhcp_repairs_total", &[]);
            let status = bed.daemon().status().await;
            (shown.contains(&format!("inet {vip}/24 "))
                && shown.contains("noprefixroute")
                && counted >= repairs as f64
                && status["load_balancers"][0]["dhcp"]["repairs"].as_u64() >= Some(repairs))
            .then_some(())
        },
    )
    .await;
}

/// `interface`'s MAC, parent and state in namespace `ns`
/// (`"hlb…@eth0 … UP … link/ether 02:…"` without the index).
fn link_of(ns: &Ns, interface: &str) -> String {
    let out = Command::new("ip")
        .args(["-n", &ns.name, "-o", "link", "show", "dev", interface])
        .output()
        .expect("ip link");
    let text = String::from_utf8_lossy(&out.stdout);
    let words: Vec<&str> = text.split_whitespace().collect();
    let at = |key: &str| {
        words
            .iter()
            .position(|w| *w == key)
            .and_then(|i| words.get(i + 1))
            .copied()
            .unwrap_or("")
    };
    format!(
        "{} {} {}",
        words.get(1).copied().unwrap_or(""),
        at("state"),
        at("link/ether")
    )
}

/// The IPv4 routes of namespace `ns`, every table, but the `local` and
/// `broadcast` routes the kernel makes for an address on the macvlan
/// interfaces (a lease's own): what an offer must never change.
fn ipv4_routes(ns: &Ns) -> String {
    let out = Command::new("ip")
        .args(["-n", &ns.name, "-4", "route", "show", "table", "all"])
        .output()
        .expect("ip route");
    let mut lines: Vec<String> = String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter(|l| {
            !((l.starts_with("local ") || l.starts_with("broadcast ")) && l.contains(" dev hlb"))
        })
        .map(str::to_string)
        .collect();
    lines.sort();
    lines.join("\n")
}

/// The IPv4 addresses on the macvlan interfaces of `ns` (`a.b.c.d/len`).
fn leased_addresses(ns: &Ns) -> String {
    let ip = |args: &[&str]| {
        let out = Command::new("ip")
            .args(["-n", &ns.name])
            .args(args)
            .output()
            .expect("ip");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let links = ip(&["-o", "link", "show", "type", "macvlan"]);
    let mut addresses = Vec::new();
    // "5: hlb0123456789@eth0: <BROADCAST,...".
    for name in links
        .lines()
        .filter_map(|l| l.split(": ").nth(1))
        .filter_map(|n| n.split('@').next())
    {
        for line in ip(&["-4", "-o", "addr", "show", "dev", name]).lines() {
            if let Some(a) = line.split_whitespace().skip_while(|w| *w != "inet").nth(1) {
                addresses.push(a.to_string());
            }
        }
    }
    addresses.join(" ")
}

/// One rogue offer: dnsmasq (with `args`) offers what it must not; the
/// daemon (with `keys` added to its config) must refuse it for `reason`:
/// the host's IPv4 routes unchanged, the address not taken, the refusal
/// counted and named in `/status`. `prepare` sets the host up first;
/// `listener` is the leased VIP's, node 1 its backend (answering "n1").
/// Returns the bed and the node (`None`: skipped).
async fn rogue_offer(
    test: &str,
    args: &[String],
    keys: &str,
    prepare: fn(&Bed),
    listener: Listener,
    reason: &str,
) -> Option<(Bed, Node)> {
    if cannot_run(
        module_path!(),
        [
            netns::skip_reason(),
            missing_tool("dnsmasq", "dnsmasq-base"),
        ],
    ) {
        return None;
    }
    let mut bed = Bed::new(test, 1);
    let node = Node::start(&bed, 1, Service::NameThenEcho);
    prepare(&bed);
    let routes_before = ipv4_routes(&bed.lb);
    let dnsmasq = Dnsmasq::start_with(&bed.client, &bed.dir, args);
    bed.start_daemon(&config_with(&bed, Some(listener), keys).to_string())
        .await;
    // Answered: taken (as before the guard) or refused.
    let lease = wait_for(
        Duration::from_secs(30),
        "the offer taken or refused",
        || async {
            let s = bed.daemon().status().await;
            let l = s["load_balancers"][0]["dhcp"].clone();
            (l["state"] == "bound" || l["last_refusal"].is_object()).then_some(l)
        },
    )
    .await;
    assert!(dnsmasq.count("DHCPOFFER") >= 1, "{}", dnsmasq.log());
    assert_eq!(
        ipv4_routes(&bed.lb),
        routes_before,
        "the host's IPv4 routes changed: {lease}"
    );
    assert_eq!(leased_addresses(&bed.lb), "", "address taken: {lease}");
    assert_ne!(lease["state"], "bound", "{lease}");
    assert!(lease["address"].is_null(), "{lease}");
    let refusal = &lease["last_refusal"];
    assert_eq!(refusal["reason"], reason, "{lease}");
    assert_eq!(refusal["server"], netns::CLIENT_IP.to_string(), "{lease}");
    assert!(lease["offers_refused"].as_u64() >= Some(1), "{lease}");
    let metrics = bed.daemon().metrics().await;
    assert!(
        netns::metric_sample(
            &metrics,
            "harvester_lb_dhcp_offers_refused_total",
            &[("reason", reason)]
        )
        .is_some_and(|v| v >= 1.0),
        "{metrics}"
    );
    bed.daemon()
        .wait_log(&format!("\"DHCP offer refused\" and {reason:?}"), |log| {
            log.contains("DHCP offer refused") && log.contains(reason)
        })
        .await;
    assert_eq!(
        bed.daemon().status().await["load_balancers"][0]["listeners"][0]["state"],
        "waiting_for_lease"
    );
    Some((bed, node))
}

fn nothing(_: &Bed) {}

/// A 128.0.0.0 mask would make half the internet on-link on the macvlan.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_mask_of_128_0_0_0_is_refused_and_routes_nothing() {
    rogue_offer(
        "dhcpmask",
        &[
            "--dhcp-range=198.51.100.150,198.51.100.160,255.255.255.0,2m".into(),
            "--dhcp-option=1,128.0.0.0".into(),
        ],
        "",
        nothing,
        web(),
        "mask_too_wide",
    )
    .await;
}

/// The host's own address, with a kernel listener on 443: the host's own
/// `:443` would be forwarded to a tenant's backends. It stays the host's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_of_the_hosts_own_address_is_refused() {
    let Some((bed, _node)) = rogue_offer(
        "dhcpself",
        &[
            format!("--dhcp-range={0},{0},255.255.255.0,2m", netns::LB_IP),
            // dnsmasq would not offer an address that answers its ping.
            "--no-ping".into(),
        ],
        "",
        |bed| {
            // The kernel path forwards only with forwarding on.
            bed.enable_forwarding();
            // The host's own service on its own address.
            let https = bed.lb.listen(sa(netns::LB_IP, 443));
            tokio::spawn(async move {
                while let Ok((mut s, _)) = https.accept().await {
                    use tokio::io::AsyncWriteExt;
                    let _ = s.write_all(b"host\n").await;
                }
            });
        },
        Listener::new("https", 443, netns::NODEPORT).forwarding("kernel"),
        "host_address",
    )
    .await
    else {
        return;
    };
    // The host's :443 still answers itself, not node 1 ("n1"; before the
    // guard the kernel forwarded it there).
    let mut s = bed
        .client
        .connect(sa(netns::LB_IP, 443), Duration::from_secs(5))
        .await
        .expect("the host's own :443");
    let mut greeting = [0u8; 5];
    tokio::time::timeout(Duration::from_secs(5), s.read_exact(&mut greeting))
        .await
        .expect("an answer within 5 s")
        .expect("read");
    assert_eq!(&greeting, b"host\n");
}

/// The gateway's address: the host would be cut off from its router.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_of_the_hosts_gateway_is_refused() {
    rogue_offer(
        "dhcpgw",
        &[
            "--dhcp-range=198.51.100.1,198.51.100.1,255.255.255.0,2m".into(),
            "--no-ping".into(),
        ],
        "",
        |bed| {
            bed.lb
                .ip(&["route", "add", "default", "via", "198.51.100.1"])
        },
        web(),
        "gateway",
    )
    .await;
}

/// An address outside the operator's `dhcp.allowed_ranges`.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_offer_outside_the_allowed_ranges_is_refused() {
    rogue_offer(
        "dhcprange",
        &["--dhcp-range=198.51.100.150,198.51.100.160,255.255.255.0,2m".into()],
        "allowed_ranges = [\"198.51.100.192/26\"]",
        nothing,
        web(),
        "outside_allowed_ranges",
    )
    .await;
}

/// The bed of the VM-network lease tests: the load-balancer host with the
/// VM network's bridge `vm-br` (no address of the host on it), namespace
/// `vm` on it (a VM, and the network's DHCP server and router at .1),
/// dnsmasq leasing 203.0.113.50-60, and the daemon with the isolated
/// network `default/vm` and the leased load balancer `default/web` on it,
/// started.
async fn vm_network_bed(test: &str) -> (Bed, Ns, Node, Dnsmasq) {
    let mut bed = Bed::new(test, 1);
    let node = Node::start(&bed, 1, Service::NameThenEcho);
    // The VM network: namespace `vm` (a VM, and the network's DHCP server
    // and router at .1) on bridge `vm-br` of the load-balancer host. The
    // namespace comes from the bed (so it is cleaned up with it), moved off
    // the bed's own segment onto the VM network.
    let (vm, _) = bed.add_host("vm", Ipv4Addr::new(198, 51, 100, 99));
    vm.ip(&["link", "del", "eth0"]);
    bed.lb.ip(&["link", "add", "vm-br", "type", "bridge"]);
    bed.lb.ip(&[
        "link", "add", "vmport", "type", "veth", "peer", "name", "eth0", "netns", &vm.name,
    ]);
    bed.lb
        .ip(&["link", "set", "vmport", "master", "vm-br", "up"]);
    bed.lb.ip(&["link", "set", "vm-br", "up"]);
    vm.ip(&["addr", "add", "203.0.113.1/24", "dev", "eth0"]);
    vm.ip(&["link", "set", "eth0", "up"]);
    let dnsmasq = Dnsmasq::start_with(
        &vm,
        &bed.dir,
        &["--dhcp-range=203.0.113.50,203.0.113.60,255.255.255.0,2m".to_string()],
    );
    // The lease's table has no interface: the network's is taken.
    let config = netns::config()
        .drain_timeout(1)
        .text(&format!(
            "[dhcp]\nstate_directory = {}\n\n{}",
            quote(bed.dir.join("state").display()),
            network("default/vm", "vm-br", "203.0.113.1", "")
        ))
        .lb(Lb::new("default/web", "0.0.0.0")
            .keys("ipam = \"dhcp\"\nnetwork = \"default/vm\"")
            .backends([netns::node_ip(1)])
            .listener(web())
            .keys("  [load_balancer.dhcp]"));
    bed.start_daemon(&config.to_string()).await;
    (bed, vm, node, dnsmasq)
}

/// A load balancer with `ipam = "dhcp"` on a `[[network]]`: the lease's
/// macvlan is made on the network's interface (a bridge of the host's, as
/// a Harvester host's VM network is, with no address of the host on it),
/// dnsmasq on that network leases the VIP, a VM there is served through
/// it, and its replies leave by the network's routing table (the host has
/// no route to the network but that table: without it they go nowhere).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_vip_on_a_vm_network_is_leased_on_the_network_s_bridge_and_serves_its_vms() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let (bed, vm, _node, _dnsmasq) = vm_network_bed("dhcpvm").await;
    let leased = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    let vip = address(&leased);
    assert!((50..=60).contains(&vip.octets()[3]), "{leased}");
    assert_eq!(leased["server"], "203.0.113.1", "{leased}");
    assert_eq!(
        leased["interface"].as_str().map(|i| i.starts_with("hlb")),
        Some(true),
        "{leased}"
    );
    let link = link_of(&bed.lb, leased["interface"].as_str().unwrap());
    assert!(
        link.contains("@vm-br:"),
        "the macvlan's parent is the network's bridge: {link}"
    );
    // The VM is served through the VIP; its replies need the network's table.
    wait_for(
        Duration::from_secs(15),
        &format!("the VM served through {vip}"),
        || async { forwarded_from(&vm, vip).await.then_some(()) },
    )
    .await;
    let rules = Command::new("ip")
        .args(["-n", &bed.lb.name, "-4", "rule", "show"])
        .output()
        .expect("ip rule");
    let rules = String::from_utf8_lossy(&rules.stdout).to_string();
    assert!(
        rules.contains(&format!("from {vip} lookup 1000")),
        "the leased VIP's rule: {rules}"
    );
    assert!(!rules.contains("from 0.0.0.0 lookup"), "{rules}");
}

/// The datagrams of `count` sent from `from` (inside its namespace) to `to`
/// that a socket bound to `bind` in namespace `at` receives within 3 s.
fn datagrams_through(
    from: &Ns,
    at: &Ns,
    bind: std::net::SocketAddr,
    to: std::net::SocketAddr,
    count: usize,
) -> usize {
    let receiver = netns::in_ns(&at.name, move || {
        let s = std::net::UdpSocket::bind(bind).expect("bind the receiver");
        s.set_read_timeout(Some(Duration::from_millis(200)))
            .unwrap();
        s
    });
    netns::in_ns(&from.name, move || {
        let s = std::net::UdpSocket::bind("0.0.0.0:0").expect("bind the sender");
        for i in 0..count {
            let _ = s.send_to(format!("spoof {i}").as_bytes(), to);
        }
    });
    let deadline = Instant::now() + Duration::from_secs(3);
    let mut got = 0;
    let mut buf = [0u8; 64];
    while got < count && Instant::now() < deadline {
        if receiver.recv_from(&mut buf).is_ok() {
            got += 1;
        }
    }
    got
}

/// Issue 40, defect 2: the lease's macvlan is an interface of its isolated
/// network, so the VM-network guard holds it too. A VM that sends its
/// frames to the macvlan's MAC address (a static neighbour entry: the
/// host answers ARP for the VIP from the macvlan and the bridge alike) is
/// served at the leased VIP's listener port, and reaches neither a host
/// service on another port of the VIP nor, routed through the host, the
/// bed's other segment (node 1's). With the guard of the commit before
/// (the bridge alone in its interface set), both were reached: 10 of 10
/// datagrams each.
///
/// Leaves out: the VLAN-aware bridge (this kernel has none); the VM
/// network's bridge has no uplink, the VM is on the host's bridge itself
/// (the lease's macvlan sees the same frames either way).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leased_vip_s_macvlan_is_guarded_like_its_network_s_bridge() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let (bed, vm, _node, _dnsmasq) = vm_network_bed("dhcpguard").await;
    bed.enable_forwarding();
    for setting in [
        "net.bridge.bridge-nf-call-iptables=1",
        "net.ipv4.conf.all.rp_filter=0",
        "net.ipv4.conf.default.rp_filter=0",
    ] {
        netns::run(
            "ip",
            &["netns", "exec", &bed.lb.name, "sysctl", "-qw", setting],
            None,
        );
    }
    let leased = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    let vip = address(&leased);
    let interface = leased["interface"].as_str().expect("interface").to_string();
    let link = link_of(&bed.lb, &interface);
    let mac = link
        .split_whitespace()
        .last()
        .expect("the macvlan's MAC")
        .to_string();
    // Every frame of the VM to the VIP, and to node 1 routed through the
    // host, goes to the macvlan.
    vm.ip(&[
        "neigh",
        "replace",
        &vip.to_string(),
        "lladdr",
        &mac,
        "dev",
        "eth0",
        "nud",
        "permanent",
    ]);
    vm.ip(&[
        "route",
        "replace",
        &format!("{}/32", netns::node_ip(1)),
        "via",
        &vip.to_string(),
    ]);
    wait_for(
        Duration::from_secs(15),
        &format!("the VM served at {vip}:80 through the macvlan"),
        || async { forwarded_from(&vm, vip).await.then_some(()) },
    )
    .await;
    let to_host = datagrams_through(
        &vm,
        &bed.lb,
        sa(Ipv4Addr::UNSPECIFIED, 2222),
        sa(vip, 2222),
        10,
    );
    let routed = datagrams_through(
        &vm,
        &bed.nodes[0],
        sa(netns::node_ip(1), 5555),
        sa(netns::node_ip(1), 5555),
        10,
    );
    assert_eq!(
        (to_host, routed),
        (0, 0),
        "datagrams through the lease's macvlan to a host service on the VIP, and routed to node 1"
    );
    let status = bed.daemon().status().await;
    let guarded: Vec<&str> = status["vm_network_guard"]["interfaces"]
        .as_array()
        .map(|a| a.iter().filter_map(|v| v.as_str()).collect())
        .unwrap_or_default();
    assert!(
        guarded.contains(&interface.as_str()) && guarded.contains(&"vm-br"),
        "the guard holds the macvlan and the bridge: {status}"
    );
    // The lease is renewed (at T1, 6 s) through the guarded macvlan: the
    // server's answers are the replies of the client's flow, from a source
    // on the network.
    let renewed = lease(&bed, 1, 0, Duration::from_secs(30)).await;
    assert_eq!(address(&renewed), vip, "{renewed}");
}

/// A restart that hands over (issue 41): no DHCPRELEASE, the macvlan (same
/// index) and the leased address stay on the host throughout, and the next
/// process adopts the interface and confirms the same lease (INIT-REBOOT,
/// no DISCOVER). Before, the next start deleted the macvlan a previous run
/// left, taking the VIP off the host until the lease was confirmed again.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_over_keeps_the_leased_address_and_its_macvlan_on_the_host() {
    require_netns!();
    if dnsmasq_skipped() {
        return;
    }
    let mut bed = Bed::new("dhcpho", 1);
    let _node = Node::start(&bed, 1, Service::NameThenEcho);
    let dnsmasq = Dnsmasq::start(&bed.client, &bed.dir, (150, 160));
    // systemd's store, as under the unit: a hand-over needs one.
    let store = support::fd_store::FakeStore::new(&bed.dir, 64);
    bed.start_daemon_stored(&config(&bed, true).to_string(), &store)
        .await;
    let leased = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    let vip = address(&leased);
    let interface = leased["interface"].as_str().expect("interface").to_string();
    let index = |ns: &Ns| -> Option<String> {
        let out = Command::new("ip")
            .args(["-n", &ns.name, "-o", "link", "show", "dev", &interface])
            .output()
            .ok()?;
        let text = String::from_utf8_lossy(&out.stdout).to_string();
        text.split(':')
            .next()
            .map(|s| s.trim().to_string())
            .filter(|s| !s.is_empty())
    };
    let index_before = index(&bed.lb).expect("the macvlan");
    eventually_forwarded(&bed, vip).await;
    let releases = dnsmasq.count("DHCPRELEASE");
    let discovers = dnsmasq.count("DHCPDISCOVER");

    // Sample the address through the restart.
    let stop = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    // The sampler ends however the test does: a failed assertion below
    // must not leave the runtime waiting for it for ever.
    let _end_sampler = StopOnDrop(std::sync::Arc::clone(&stop));
    let sampler = {
        let (ns, stop) = (bed.lb.clone(), std::sync::Arc::clone(&stop));
        let want = format!("{vip}/24");
        tokio::task::spawn_blocking(move || {
            let (mut samples, mut absent) = (0, 0);
            while !stop.load(std::sync::atomic::Ordering::Acquire) {
                samples += 1;
                absent += usize::from(!leased_addresses(&ns).contains(&want));
                std::thread::sleep(Duration::from_millis(50));
            }
            (samples, absent)
        })
    };
    tokio::time::sleep(Duration::from_millis(300)).await;
    let (code, body) =
        support::http_unix(&bed.dir.join("admin.sock"), "POST", "/hand-over", "{}").await;
    assert_eq!(code, 200, "{body}");
    let mut d = bed.take_daemon();
    d.signal(libc::SIGTERM);
    assert!(d.wait_exit(Duration::from_secs(15)).await.is_some());
    drop(d);
    assert!(
        leased_addresses(&bed.lb).contains(&format!("{vip}/24")),
        "the address stays after the hand-over"
    );
    bed.start_daemon_stored(&config(&bed, true).to_string(), &store)
        .await;
    let again = lease(&bed, 0, 0, Duration::from_secs(30)).await;
    eventually_forwarded(&bed, vip).await;
    tokio::time::sleep(Duration::from_secs(1)).await;
    stop.store(true, std::sync::atomic::Ordering::Release);
    let (samples, absent) = sampler.await.unwrap();
    println!("DHCP hand-over: the leased address absent in {absent} of {samples} samples (50 ms)");
    assert_eq!(address(&again), vip, "the same lease");
    assert_eq!(
        dnsmasq.count("DHCPRELEASE"),
        releases,
        "no DHCPRELEASE at a hand-over"
    );
    assert_eq!(
        dnsmasq.count("DHCPDISCOVER"),
        discovers,
        "no DISCOVER after it"
    );
    assert_eq!(
        index(&bed.lb),
        Some(index_before),
        "the same macvlan (its index)"
    );
    assert_eq!(
        absent, 0,
        "the leased address left the host during the restart"
    );
    bed.daemon()
        .wait_logged("adopting the macvlan interface a previous run left")
        .await;
}

/// Sets its flag when dropped (a test's end, passed or failed).
struct StopOnDrop(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }
}

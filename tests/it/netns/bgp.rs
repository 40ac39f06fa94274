//! The anycast test bed: every load-balancer host announces the same VIP to a
//! router over BGP (real BIRD 2 everywhere, or real FRR 8.4 everywhere: see
//! [`Speaker`]), and the router spreads flows by ECMP.
//!
//! ```text
//!   client ns (203.0.113.10, 2001:db8:3::10)
//!      │ c0
//!   router ns: BIRD (ECMP `merge paths`, BFD 100 ms × 3), L4 multipath hash
//!      │ br0 192.0.2.1/24, 2001:db8:2::1/64
//!      ├── lb host 1 (192.0.2.11): harvester-lb + BIRD exporting table 100
//!      ├── lb host 2 (192.0.2.12): the same
//!      ├── backend 1 (192.0.2.21): host 1's backend
//!      └── backend 2 (192.0.2.22): host 2's backend
//! ```
//!
//! Each host has a backend of its own, and a backend greets with its index,
//! so the first line a client reads says which host carried the connection.
//! The hosts and the router run the shipped `config/bird/bird-host.conf` and
//! `config/bird/bird-router.conf` with only their `define` lines replaced,
//! so the tests check the configs operators copy. With [`Speaker::Frr`] they
//! run `config/frr/frr-host.conf` (only `bgp router-id` replaced) and
//! `config/frr/frr-router.conf` as they are: zebra, bfdd and bgpd per
//! namespace as our children, configured by `vtysh -b` as the `frr` service
//! does (no systemd). FRR 8.4 cannot announce IPv6 from a table, so with FRR
//! only the IPv4 VIP reaches the router.
//!
//! The router hashes flows on the packet's 5-tuple
//! (`fib_multipath_hash_policy=3`, `fib_multipath_hash_fields=0x0037`), as
//! hardware does: policy 1 over veth reuses the sender's socket hash, so a
//! SYN retry can land on another host and hide failures.
//!
//! Everything lives in namespaces named after the test and this process; the
//! documentation ranges exist only inside them. [`BgpBed`]'s `Drop` kills
//! every daemon, BIRD and FRR and deletes every namespace, also on panic.

use std::collections::BTreeMap;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt, BufReader};
use tokio::net::TcpStream;
use tokio::task::{AbortHandle, JoinHandle};

use super::{DaemonProc, Ns, run};
use crate::support::{Lb, Listener};

/// The anycast VIP every host announces.
pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 100);
/// The IPv6 VIP every host announces.
pub const VIP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 0x100, 0, 0, 0, 0, 0x100);
/// The client's address (behind the router).
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(203, 0, 113, 10);
/// The client's IPv6 address.
pub const CLIENT_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 3, 0, 0, 0, 0, 0x10);
/// The router's address on the hosts' link.
pub const ROUTER_IP: Ipv4Addr = Ipv4Addr::new(192, 0, 2, 1);
/// The router's IPv6 address on the hosts' link.
pub const ROUTER_IP6: Ipv6Addr = Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 1);
/// The VIP's service port.
pub const PORT: u16 = 80;
/// The backends' port (also their health-check port).
pub const BACKEND_PORT: u16 = 8080;
/// harvester-lb's routing table (`[vip] announce_table`, the default).
pub const TABLE: u32 = 100;
/// The protocol number of harvester-lb's routes; the shipped BIRD config
/// exports only routes with this number.
pub const PROTO: u32 = 252;

/// Address of load-balancer host `i` (1-based): 192.0.2.(10 + i).
pub fn host_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, 10 + i as u8)
}

/// IPv6 address of load-balancer host `i`: 2001:db8:2::(10 + i) (hex digits).
pub fn host_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x10 + i as u16)
}

/// Address of backend `i` (host `i`'s backend): 192.0.2.(20 + i).
pub fn backend_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(192, 0, 2, 20 + i as u8)
}

/// IPv6 address of backend `i`: 2001:db8:2::(20 + i) (hex digits).
pub fn backend_ip6(i: usize) -> Ipv6Addr {
    Ipv6Addr::new(0x2001, 0xdb8, 2, 0, 0, 0, 0, 0x20 + i as u16)
}

/// Why this bed cannot run here, if it cannot (root, `ip`, `bird`, `birdc`).
pub fn skip_reason() -> Option<String> {
    if let Some(why) = super::skip_reason() {
        return Some(why);
    }
    ["bird", "birdc"]
        .into_iter()
        .find_map(|tool| crate::support::missing_tool(tool, "bird2"))
}

/// Returns from the test with a printed reason when the bed cannot be built
/// (and fails under CI).
#[macro_export]
macro_rules! require_bgp {
    () => {
        $crate::require!(
            $crate::netns::bgp::skip_reason(),
            "root, iproute2, nftables and BIRD 2"
        )
    };
}

/// Which BGP speaker the bed runs, on every host and on the router.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Speaker {
    /// BIRD 2 (`config/bird/`).
    Bird,
    /// FRR 8.4 (`config/frr/`).
    Frr,
}

impl Speaker {
    /// Why the bed cannot run with this speaker here, if it cannot.
    pub fn skip_reason(self) -> Option<String> {
        match self {
            Speaker::Bird => skip_reason(),
            Speaker::Frr => frr_skip_reason(),
        }
    }

    /// A namespace tag for test `name` with this speaker (`frr-` prefixed).
    pub fn tag(self, name: &str) -> String {
        match self {
            Speaker::Bird => name.to_string(),
            Speaker::Frr => format!("frr-{name}"),
        }
    }
}

/// FRR's daemons, started in each namespace in this order (zebra first:
/// the others connect to it).
const FRR_DAEMONS: [&str; 3] = ["zebra", "bfdd", "bgpd"];

/// Where Debian's `frr` package puts its daemons.
const FRR_SBIN: &str = "/usr/lib/frr";

/// Why the FRR bed cannot run here, if it cannot (root, `ip`, FRR's
/// daemons, `vtysh`, the user `frr` they drop to).
pub fn frr_skip_reason() -> Option<String> {
    if let Some(why) = super::skip_reason() {
        return Some(why);
    }
    for d in FRR_DAEMONS {
        let p = Path::new(FRR_SBIN).join(d);
        if !p.exists() {
            return Some(format!("{} (package frr) is not installed", p.display()));
        }
    }
    if let Some(why) = crate::support::missing_tool("vtysh", "frr") {
        return Some(why);
    }
    match Command::new("id").arg("frr").output() {
        Ok(o) if o.status.success() => None,
        _ => Some("no user `frr` (package frr creates it)".to_string()),
    }
}

/// Returns from the test with a printed reason when the bed cannot be
/// built with `speaker` (and fails under CI).
#[macro_export]
macro_rules! require_speaker {
    ($speaker:expr) => {
        $crate::require!(
            $speaker.skip_reason(),
            format!("root, iproute2, nftables and {:?}", $speaker)
        )
    };
}

/// FRR in a namespace: zebra, bfdd and bgpd in the foreground (our
/// children), every path of theirs in one directory owned by user `frr`,
/// configured from an integrated `frr.conf` by `vtysh -b`, as the `frr`
/// service does it.
pub struct Frr {
    /// The daemons, zebra first.
    daemons: Vec<(&'static str, Child)>,
    /// Config, vty sockets, pid files and logs.
    pub dir: PathBuf,
    ns: Ns,
}

impl Frr {
    /// Starts FRR in `ns` with the integrated config `conf`, in `dir`
    /// (created), and waits (with a deadline) until every daemon answers
    /// and the config is loaded.
    pub fn spawn(ns: &Ns, conf: &str, dir: &Path) -> Frr {
        std::fs::create_dir_all(dir).expect("frr dir");
        std::fs::write(dir.join("frr.conf"), conf).expect("write frr.conf");
        std::fs::write(dir.join("vtysh.conf"), "service integrated-vtysh-config\n")
            .expect("write vtysh.conf");
        let d = dir.to_str().expect("utf-8 path");
        // The daemons drop to user frr: their directory is theirs.
        run("chown", &["-R", "frr:frr", d], None);
        let mut frr = Frr {
            daemons: Vec::new(),
            dir: dir.to_path_buf(),
            ns: ns.clone(),
        };
        for name in FRR_DAEMONS {
            // Each reads no config of its own (an empty file: never the
            // machine's /etc/frr); `vtysh -b` below gives them theirs.
            let own = dir.join(format!("{name}.conf"));
            std::fs::write(&own, "").expect("write empty daemon config");
            run(
                "chown",
                &["frr:frr", own.to_str().expect("utf-8 path")],
                None,
            );
            let mut args: Vec<String> = [
                "netns",
                "exec",
                &ns.name,
                &format!("{FRR_SBIN}/{name}"),
                "-P",
                "0",
                "-f",
                own.to_str().expect("utf-8 path"),
                "-i",
                &format!("{d}/{name}.pid"),
                "-z",
                &format!("{d}/zserv.api"),
                "--vty_socket",
                d,
                "--log",
                &format!("file:{d}/{name}.log"),
            ]
            .iter()
            .map(|a| a.to_string())
            .collect();
            if name == "bfdd" {
                args.extend(["--bfdctl".to_string(), format!("{d}/bfdd.sock")]);
            }
            let child = Command::new("ip")
                .args(&args)
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .stderr(Stdio::null())
                .spawn()
                .unwrap_or_else(|e| panic!("spawn {name}: {e}"));
            frr.daemons.push((name, child));
            // Each waits for its vty socket (zebra's zserv socket first:
            // the others connect to it at start).
            let vty = dir.join(format!("{name}.vty"));
            let deadline = Instant::now() + Duration::from_secs(15);
            while !vty.exists() {
                assert!(
                    Instant::now() < deadline,
                    "FRR's {name} in {} did not open {} within 15 s; log:\n{}",
                    ns.name,
                    vty.display(),
                    frr.log_tail(20)
                );
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        let out = Command::new("ip")
            .args(["netns", "exec", &ns.name, "vtysh", "--vty_socket", d])
            .args(["--config_dir", d, "-b"])
            .stdin(Stdio::null())
            .output()
            .expect("run vtysh -b");
        assert!(
            out.status.success(),
            "vtysh -b in {} failed: {}{}",
            ns.name,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        frr
    }

    /// `vtysh -c <command>`: its output (empty if FRR does not answer).
    pub fn vtysh(&self, command: &str) -> String {
        let d = self.dir.to_str().expect("utf-8 path");
        output(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns.name,
                "vtysh",
                "--vty_socket",
                d,
                "-c",
                command,
            ],
        )
    }

    /// How many of bgpd's IPv4 sessions are `Established`.
    pub fn established(&self) -> usize {
        let text = self.vtysh("show bgp ipv4 unicast summary json");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        v["peers"].as_object().map_or(0, |peers| {
            peers
                .values()
                .filter(|p| p["state"] == "Established")
                .count()
        })
    }

    /// How many of bfdd's sessions are up.
    pub fn bfd_up(&self) -> usize {
        let text = self.vtysh("show bfd peers json");
        let v: serde_json::Value = serde_json::from_str(&text).unwrap_or_default();
        v.as_array()
            .map_or(0, |a| a.iter().filter(|p| p["status"] == "up").count())
    }

    /// The last lines of bgpd's and zebra's logs.
    pub fn log_tail(&self, n: usize) -> String {
        let mut out = String::new();
        for name in ["bgpd", "zebra", "bfdd"] {
            let text =
                std::fs::read_to_string(self.dir.join(format!("{name}.log"))).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            out.push_str(&format!(
                "[{name}]\n{}\n",
                lines[lines.len().saturating_sub(n)..].join("\n")
            ));
        }
        out
    }
}

impl Drop for Frr {
    fn drop(&mut self) {
        // The last started first.
        for (_, child) in self.daemons.iter_mut().rev() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// A BIRD process in a namespace (`bird -f`, so it is our child).
pub struct Bird {
    child: Child,
    /// Its control socket (for `birdc -s`).
    pub ctl: PathBuf,
    log: PathBuf,
}

impl Bird {
    /// Starts BIRD in `ns` with config file `conf`; its socket and log go
    /// into `dir` under `name`.
    pub fn spawn(ns: &Ns, conf: &Path, dir: &Path, name: &str) -> Bird {
        let ctl = dir.join(format!("{name}.ctl"));
        let log = dir.join(format!("{name}.log"));
        let logf = std::fs::File::create(&log).expect("bird log");
        let child = Command::new("ip")
            .args(["netns", "exec", &ns.name, "bird", "-f", "-c"])
            .arg(conf)
            .arg("-s")
            .arg(&ctl)
            .arg("-P")
            .arg(dir.join(format!("{name}.pid")))
            .stdin(Stdio::null())
            .stdout(logf.try_clone().expect("dup log"))
            .stderr(logf)
            .spawn()
            .expect("spawn bird");
        Bird { child, ctl, log }
    }

    /// `birdc -s <ctl> <args>`: its output (empty if BIRD does not answer).
    pub fn birdc(&self, args: &[&str]) -> String {
        let out = Command::new("birdc")
            .arg("-s")
            .arg(&self.ctl)
            .args(args)
            .stdin(Stdio::null())
            .output()
            .expect("run birdc");
        String::from_utf8_lossy(&out.stdout).to_string()
    }

    /// Names of this BIRD's BGP protocols that are `Established`.
    pub fn established(&self) -> Vec<String> {
        self.birdc(&["show", "protocols"])
            .lines()
            .filter(|l| l.contains(" BGP ") && l.contains("Established"))
            .filter_map(|l| l.split_whitespace().next().map(str::to_string))
            .collect()
    }

    /// The last lines of its log.
    pub fn log_tail(&self, n: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(n)..].join("\n")
    }

    /// Kills it with `sig` and reaps it.
    pub fn kill(mut self, sig: i32) {
        // SAFETY: kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.child.id() as i32, sig);
        }
        let _ = self.child.wait();
    }
}

impl Drop for Bird {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A backend: greets every connection with `b<i>\n`, then echoes.
pub struct Backend {
    /// 1-based index (the host it serves).
    pub index: usize,
    /// Its namespace.
    pub ns: Ns,
    listeners: Vec<JoinHandle<()>>,
    conns: Arc<Mutex<Vec<AbortHandle>>>,
}

impl Backend {
    /// Starts listening on its IPv4 and IPv6 addresses (health checks and
    /// traffic use the same port).
    pub fn start(&mut self) {
        self.stop();
        for addr in [
            SocketAddr::new(IpAddr::V4(backend_ip(self.index)), BACKEND_PORT),
            SocketAddr::new(IpAddr::V6(backend_ip6(self.index)), BACKEND_PORT),
        ] {
            let l = self.ns.listen(addr);
            let greeting = format!("b{}\n", self.index);
            let conns = self.conns.clone();
            self.listeners.push(tokio::spawn(async move {
                loop {
                    let Ok((mut s, _)) = l.accept().await else {
                        continue;
                    };
                    let greeting = greeting.clone();
                    let h = tokio::spawn(async move {
                        if s.write_all(greeting.as_bytes()).await.is_err() {
                            return;
                        }
                        let (mut r, mut w) = s.split();
                        let _ = tokio::io::copy(&mut r, &mut w).await;
                    });
                    conns.lock().expect("conns").push(h.abort_handle());
                }
            }));
        }
        // UDP on the same port: answers every datagram with the greeting.
        let udp = udp_socket(
            &self.ns,
            SocketAddr::new(IpAddr::V4(backend_ip(self.index)), BACKEND_PORT),
        );
        let greeting = format!("b{}\n", self.index);
        self.listeners.push(tokio::spawn(async move {
            let mut buf = [0u8; 512];
            loop {
                if let Ok((_, from)) = udp.recv_from(&mut buf).await {
                    let _ = udp.send_to(greeting.as_bytes(), from).await;
                }
            }
        }));
    }

    /// Closes its listening sockets, TCP and UDP (new connections and
    /// probes are refused); connections already open go on.
    pub fn stop(&mut self) {
        for l in self.listeners.drain(..) {
            l.abort();
        }
    }
}

impl Drop for Backend {
    fn drop(&mut self) {
        self.stop();
        for c in self.conns.lock().expect("conns").drain(..) {
            c.abort();
        }
    }
}

/// One load-balancer host: its namespace, BIRD and daemon.
pub struct LbHost {
    /// 1-based index.
    pub index: usize,
    /// Its namespace.
    pub ns: Ns,
    /// The router's end of its link (a port of the router's bridge).
    pub port: String,
    /// Its scratch directory (configs, logs, admin socket).
    pub dir: PathBuf,
    /// Its BIRD.
    pub bird: Option<Bird>,
    /// Its FRR (with [`Speaker::Frr`]).
    pub frr: Option<Frr>,
    /// Its daemon, once started.
    pub daemon: Option<DaemonProc>,
    /// How many hosts (and backends) the bed has.
    pub hosts: usize,
}

impl LbHost {
    /// The running daemon.
    pub fn daemon(&self) -> &DaemonProc {
        self.daemon.as_ref().expect("daemon started")
    }

    /// The config file of its daemon.
    pub fn config_path(&self) -> PathBuf {
        self.dir.join("harvester-lb.toml")
    }

    /// Writes its daemon's config: one load balancer on the VIP (TCP and
    /// UDP listeners) and one on the IPv6 VIP (TCP), each to this host's
    /// backend, probed every second;
    /// `vip_section` is the `[vip]` table's body; open connections may
    /// finish for `drain` seconds when the daemon stops.
    pub fn write_config(&self, vip_section: &str, drain: u32) -> PathBuf {
        self.write_config_with(vip_section, drain, "")
    }

    /// [`LbHost::write_config`] with `listener` (TOML lines, each indented
    /// two spaces and ending in a newline, e.g. `  forwarding = "kernel"\n`)
    /// added to every listener.
    pub fn write_config_with(&self, vip_section: &str, drain: u32, listener: &str) -> PathBuf {
        let i = self.index;
        // Every listener gets the caller's extra lines.
        let extra = |l: Listener| {
            let lines = listener.trim_end();
            if lines.is_empty() { l } else { l.keys(lines) }
        };
        let lb = |name: &str, vip: IpAddr, backend: IpAddr| {
            Lb::new(name, vip)
                .backends([backend])
                .listener(extra(Listener::new("tcp", PORT, BACKEND_PORT)))
                .health("  kind = \"tcp\"")
                .health_port(BACKEND_PORT)
                .health("  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 2\n  success_threshold = 1")
        };
        let text = super::config()
            .socket(&self.dir.join("admin.sock"))
            .drain_timeout(drain.into())
            .vip(vip_section)
            .lb(lb(
                "default/anycast",
                IpAddr::V4(VIP),
                IpAddr::V4(backend_ip(i)),
            )
            .listener(extra(Listener::new("udp", PORT, BACKEND_PORT).udp())))
            .lb(lb(
                "default/anycast6",
                IpAddr::V6(VIP6),
                IpAddr::V6(backend_ip6(i)),
            ))
            .to_string();
        let p = self.config_path();
        std::fs::write(&p, text).expect("write daemon config");
        p
    }

    /// Writes its daemon's config for a shared pool: one load balancer on
    /// the IPv4 VIP with every host's backend (every host the same list),
    /// TCP and UDP listeners on [`PORT`], each with `listener` lines added
    /// (as [`LbHost::write_config_with`]) and `lb` lines (e.g.
    /// `algorithm = "flow_hash"`) added to the load balancer.
    pub fn write_shared_config(&self, vip_section: &str, lb: &str, listener: &str) -> PathBuf {
        let extra = |l: Listener| {
            let lines = listener.trim_end();
            if lines.is_empty() { l } else { l.keys(lines) }
        };
        let mut pool = Lb::new("default/shared", IpAddr::V4(VIP))
            .backends((1..=self.hosts).map(|b| IpAddr::V4(backend_ip(b))))
            .listener(extra(Listener::new("tcp", PORT, BACKEND_PORT)))
            .listener(extra(Listener::new("udp", PORT, BACKEND_PORT).udp()))
            .health("  kind = \"tcp\"")
            .health_port(BACKEND_PORT)
            .health("  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 2\n  success_threshold = 1");
        if !lb.trim().is_empty() {
            pool = pool.keys(lb.trim_end());
        }
        let text = super::config()
            .socket(&self.dir.join("admin.sock"))
            .drain_timeout(5)
            .vip(vip_section)
            .lb(pool)
            .to_string();
        let p = self.config_path();
        std::fs::write(&p, text).expect("write daemon config");
        p
    }

    /// The flows of `protocol` (`tcp`, `udp`) to the IPv4 VIP's [`PORT`]
    /// in this host's conntrack table: the client's port, and the address
    /// the flow was DNATed to (the VIP itself if it was not).
    pub fn flows(&self, protocol: &str) -> BTreeMap<u16, IpAddr> {
        let text = output(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns.name,
                "conntrack",
                "-L",
                "-p",
                protocol,
                "--orig-dst",
                &VIP.to_string(),
                "--dport",
                &PORT.to_string(),
            ],
        );
        conntrack_flows(&text, protocol)
    }

    /// Loads a table of the test's own into this host's namespace, from
    /// `script` written to `file` in the host's directory.
    fn load_nft(&self, file: &str, script: &str) {
        let path = self.dir.join(file);
        std::fs::write(&path, script).unwrap_or_else(|e| panic!("write {file}: {e}"));
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.ns.name,
                "nft",
                "-f",
                path.to_str().expect("utf-8 path"),
            ],
            None,
        );
    }

    /// Starts recording the flows this host forwards to a backend from
    /// now on (a table of the test's own, `inet hlb_test_seen`: a
    /// `forward` chain that adds each new flow's client port and backend,
    /// after the DNAT and before the source NAT, to a set): a flow its
    /// backend resets leaves no conntrack entry to list afterwards
    /// (conntrack drops a flow whose only answer is a reset), but stays
    /// here. Read with [`LbHost::recorded_flows`].
    pub fn record_new_flows(&self) {
        let script = format!(
            "table inet hlb_test_seen {{\n  set seen_tcp {{ type inet_service . ipv4_addr ; flags dynamic ; }}\n  set seen_udp {{ type inet_service . ipv4_addr ; flags dynamic ; }}\n  chain forward {{\n    type filter hook forward priority 0 ; policy accept ;\n    ct state new ct original ip daddr {VIP} meta l4proto tcp update @seen_tcp {{ th sport . ip daddr }}\n    ct state new ct original ip daddr {VIP} meta l4proto udp update @seen_udp {{ th sport . ip daddr }}\n  }}\n}}\n"
        );
        self.load_nft("seen.nft", &script);
    }

    /// Starts recording the TCP flows to the IPv4 VIP whose replies (a
    /// backend's packets) this host forwards from now on: their client
    /// ports, in the set `replies` of a table of the test's own (`inet
    /// hlb_test_replies`; in `forward` a reply's destination is already
    /// the client's again). Read with [`LbHost::recorded_replies`].
    pub fn record_replies(&self) {
        let script = format!(
            "table inet hlb_test_replies {{\n  set replies {{ type inet_service ; flags dynamic ; }}\n  chain forward {{\n    type filter hook forward priority 0 ; policy accept ;\n    ct direction reply ct original ip daddr {VIP} meta l4proto tcp update @replies {{ th dport }}\n  }}\n}}\n"
        );
        self.load_nft("replies.nft", &script);
    }

    /// The client ports [`LbHost::record_replies`] recorded.
    pub fn recorded_replies(&self) -> std::collections::BTreeSet<u16> {
        self.set_elements("hlb_test_replies", "replies")
            .iter()
            .filter_map(|v| v.as_u64().and_then(|p| u16::try_from(p).ok()))
            .collect()
    }

    /// The flows [`LbHost::record_new_flows`] recorded of `protocol`
    /// (`tcp`, `udp`): the client's port, and the backend it was DNATed to.
    pub fn recorded_flows(&self, protocol: &str) -> BTreeMap<u16, IpAddr> {
        self.set_elements("hlb_test_seen", &format!("seen_{protocol}"))
            .iter()
            .filter_map(|c| {
                // `{"concat": [port, "addr"]}`.
                Some((
                    c["concat"][0]
                        .as_u64()
                        .and_then(|p| u16::try_from(p).ok())?,
                    c["concat"][1].as_str().and_then(|a| a.parse().ok())?,
                ))
            })
            .collect()
    }

    /// The elements of the set `set` of the test's own table `inet table`
    /// (each as nft's JSON writes it, the value itself when it is wrapped
    /// in `{"elem": {"val": …}}`); none when it cannot be read.
    fn set_elements(&self, table: &str, set: &str) -> Vec<serde_json::Value> {
        let text = self.ns.nft_out(&["-j", "list", "set", "inet", table, set]);
        let doc: serde_json::Value =
            serde_json::from_str(&text.unwrap_or_default()).unwrap_or_default();
        let mut elements = Vec::new();
        for o in doc["nftables"].as_array().into_iter().flatten() {
            for e in o["set"]["elem"].as_array().into_iter().flatten() {
                elements.push(e.get("elem").map_or(e, |x| &x["val"]).clone());
            }
        }
        elements
    }

    /// Starts the daemon with the config [`LbHost::write_config`] wrote and
    /// waits (with a deadline) for its admin API.
    pub async fn start_daemon(&mut self) -> &DaemonProc {
        let log = self.dir.join(format!(
            "daemon-{}.log",
            SEQ.fetch_add(1, Ordering::Relaxed)
        ));
        let d = DaemonProc::spawn(&self.ns, &self.config_path(), &log, None);
        let deadline = Instant::now() + Duration::from_secs(15);
        loop {
            if let Ok((200, _)) = d.get("/healthz").await {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "host {}: daemon admin API did not answer within 15s; log:\n{}",
                self.index,
                d.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        self.daemon = Some(d);
        self.daemon()
    }

    /// `harvester-lb withdraw --all --config F` in this host's namespace, as
    /// the unit's `ExecStopPost=` runs it; panics if it fails.
    pub fn withdraw_all(&self) {
        self.cli(&["withdraw", "--all"]);
    }

    /// `harvester-lb host drain|ready --config F`: withdraws every VIP of
    /// this host, or lets them be announced again; panics if it fails.
    pub fn host_state(&self, state: &str) {
        self.cli(&["host", state]);
    }

    /// `harvester-lb <args> --config F` in this host's namespace; panics if
    /// it fails.
    fn cli(&self, args: &[&str]) {
        let config = self.config_path();
        let mut full = vec![
            "netns",
            "exec",
            &self.ns.name,
            env!("CARGO_BIN_EXE_harvester-lb"),
        ];
        full.extend_from_slice(args);
        full.extend(["--config", config.to_str().expect("utf-8 path")]);
        run("ip", &full, None);
    }

    /// The `announce` object of `/status` for the VIP `vip` (wherever the
    /// status puts it: the first object naming the VIP that has one).
    pub async fn announce_status(&self, vip: IpAddr) -> serde_json::Value {
        let status = self.daemon().status().await;
        find_announce(&status, &vip.to_string())
            .unwrap_or_else(|| panic!("no `announce` for {vip} in /status: {status}"))
    }

    /// Routes of harvester-lb's table (`ip route show table 100`), one a line.
    pub fn table_routes(&self) -> String {
        let mut out = output(
            "ip",
            &["-n", &self.ns.name, "route", "show", "table", "100"],
        );
        out.push_str(&output(
            "ip",
            &["-6", "-n", &self.ns.name, "route", "show", "table", "100"],
        ));
        out
    }

    /// Turns IPv4 and IPv6 forwarding on in the host's namespace, as
    /// `forwarding = "kernel"` listeners need (the daemon does not).
    pub fn enable_forwarding(&self) {
        sysctl(
            &self.ns,
            &["net.ipv4.ip_forward=1", "net.ipv6.conf.all.forwarding=1"],
        );
    }

    /// What the daemon does: adds (or deletes) the VIPs' host routes in
    /// table 100 with harvester-lb's protocol number, by hand.
    pub fn announce_by_hand(&self, on: bool) {
        let verb = if on { "add" } else { "del" };
        let proto = PROTO.to_string();
        let table = TABLE.to_string();
        for (family, net) in [("-4", format!("{VIP}/32")), ("-6", format!("{VIP6}/128"))] {
            self.ns.ip(&[
                family, "route", verb, &net, "dev", "lo", "table", &table, "proto", &proto,
            ]);
        }
    }
}

/// The announce state of `vip` in a `/status` document: the first object
/// (depth first) that has `announced` and is keyed by `vip`, or names `vip`
/// in a string member (itself or its `announce` member).
fn find_announce(v: &serde_json::Value, vip: &str) -> Option<serde_json::Value> {
    match v {
        serde_json::Value::Object(m) => {
            if let Some(a) = m.get(vip).filter(|a| a.get("announced").is_some()) {
                return Some(a.clone());
            }
            if m.values().any(|x| x.as_str() == Some(vip)) {
                if m.contains_key("announced") {
                    return Some(v.clone());
                }
                if let Some(a) = m.get("announce").filter(|a| a.get("announced").is_some()) {
                    return Some(a.clone());
                }
            }
            m.values().find_map(|x| find_announce(x, vip))
        }
        serde_json::Value::Array(a) => a.iter().find_map(|x| find_announce(x, vip)),
        _ => None,
    }
}

/// The flows of `protocol` in conntrack's text (`conntrack -L` lines or
/// `-E` events): the client's port, and the reply's source (the backend
/// after a DNAT, the VIP without one).
fn conntrack_flows(text: &str, protocol: &str) -> BTreeMap<u16, IpAddr> {
    let mut flows = BTreeMap::new();
    for line in text.lines() {
        if !line.split_whitespace().any(|w| w == protocol) {
            continue;
        }
        // `src=C dst=VIP sport=P dport=80 … src=BACKEND dst=… sport=…`:
        // the first `sport` is the client's, the second `src` the reply's
        // source.
        let values = |key: &str| -> Vec<&str> {
            line.split_whitespace()
                .filter_map(|w| w.strip_prefix(key))
                .collect()
        };
        let (sports, srcs) = (values("sport="), values("src="));
        if let (Some(port), Some(reply)) = (
            sports.first().and_then(|p| p.parse().ok()),
            srcs.get(1).and_then(|a| a.parse().ok()),
        ) {
            flows.insert(port, reply);
        }
    }
    flows
}

/// Runs a command and returns its stdout (empty on failure).
fn output(cmd: &str, args: &[&str]) -> String {
    Command::new(cmd)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map(|o| String::from_utf8_lossy(&o.stdout).to_string())
        .unwrap_or_default()
}

/// Numbers the daemon logs of a host (one per start).
static SEQ: AtomicU32 = AtomicU32::new(0);

/// The namespaces, BIRDs, daemons and backends of one anycast test.
pub struct BgpBed {
    /// Short unique tag (namespace name prefix).
    pub tag: String,
    /// Scratch directory.
    pub dir: PathBuf,
    /// The router.
    pub router: Ns,
    /// The router's BIRD.
    pub router_bird: Option<Bird>,
    /// The router's FRR (with [`Speaker::Frr`]).
    pub router_frr: Option<Frr>,
    /// The BGP speaker of the hosts and the router.
    pub speaker: Speaker,
    /// The client host.
    pub client: Ns,
    /// The load-balancer hosts, `hosts[0]` is host 1.
    pub hosts: Vec<LbHost>,
    /// The backends, `backends[0]` serves host 1.
    pub backends: Vec<Backend>,
    /// `ip monitor route` in the router's namespace while a fault runs
    /// under traffic (see [`BgpBed::fault_under_traffic`]): its VIP lines
    /// are printed if the test fails, so a failed new connection can be set
    /// against what the router's table did at that moment.
    route_monitor: Option<Child>,
    created: Vec<String>,
}

impl BgpBed {
    /// Builds the bed for `test` with two hosts, starts every BIRD and the
    /// backends, and waits until the router's sessions are up. The VIPs are
    /// on each host's `lo` only if `vip_on_lo` (with `announce = "routes"`
    /// the daemon puts them there).
    pub async fn new(test: &str, vip_on_lo: bool) -> BgpBed {
        Self::with_speaker(test, vip_on_lo, Speaker::Bird).await
    }

    /// [`BgpBed::new`] with `speaker` on every host and on the router. With
    /// FRR, `vip_on_lo` makes the VIP local by an AnyIP route (as the daemon
    /// does), not an address: FRR announces nothing for an address on `lo`.
    pub async fn with_speaker(test: &str, vip_on_lo: bool, speaker: Speaker) -> BgpBed {
        Self::build(test, vip_on_lo, speaker, 2, false).await
    }

    /// The bed with `n` hosts (BIRD everywhere, the VIPs not on `lo`): the
    /// router gets one session per host beyond the shipped config's two,
    /// written as an operator adds them.
    pub async fn hosts(test: &str, n: usize) -> BgpBed {
        Self::build(test, false, Speaker::Bird, n, false).await
    }

    /// [`BgpBed::hosts`] with each host built like a Harvester host
    /// (/work/shared/notes/harvester-host.md): its `eth0` is a Linux bridge
    /// whose uplink port `up0` is the veth into the router's bridge (the
    /// switch), with `br_netfilter` on (`bridge-nf-call-iptables=1`). Left
    /// out, as in `tests/it/netns/vmnet.rs`: VLAN filtering and the bond under
    /// the uplink (this kernel has neither).
    pub async fn bridged_hosts(test: &str, n: usize) -> BgpBed {
        Self::build(test, false, Speaker::Bird, n, true).await
    }

    /// Builds the bed: `n` hosts and `n` backends (see [`BgpBed::new`] and
    /// [`BgpBed::hosts`]; `bridged`: [`BgpBed::bridged_hosts`]).
    async fn build(
        test: &str,
        vip_on_lo: bool,
        speaker: Speaker,
        n: usize,
        bridged: bool,
    ) -> BgpBed {
        assert!((2..=9).contains(&n), "{n} hosts: the bed numbers 2 to 9");
        let (tag, dir) = super::new_tag(test);
        let mut bed = BgpBed {
            router: Ns {
                name: format!("{tag}-r"),
            },
            router_bird: None,
            router_frr: None,
            speaker,
            client: Ns {
                name: format!("{tag}-c"),
            },
            hosts: Vec::new(),
            backends: Vec::new(),
            tag: tag.clone(),
            dir,
            route_monitor: None,
            created: Vec::new(),
        };
        // From here on, Drop cleans up whatever was made.
        bed.add_ns(&bed.router.name.clone());
        let r = bed.router.clone();
        r.ip(&["link", "set", "lo", "up"]);
        r.ip(&["link", "add", "br0", "type", "bridge"]);
        r.ip(&["addr", "add", &format!("{ROUTER_IP}/24"), "dev", "br0"]);
        r.ip(&[
            "addr",
            "add",
            &format!("{ROUTER_IP6}/64"),
            "dev",
            "br0",
            "nodad",
        ]);
        r.ip(&["link", "set", "br0", "up"]);
        sysctl(
            &r,
            &[
                "net.ipv4.ip_forward=1",
                "net.ipv6.conf.all.forwarding=1",
                "net.ipv4.fib_multipath_hash_policy=3",
                "net.ipv4.fib_multipath_hash_fields=0x0037",
                "net.ipv6.fib_multipath_hash_policy=3",
                "net.ipv6.fib_multipath_hash_fields=0x0037",
            ],
        );
        // The client, on a link of its own.
        bed.add_ns(&bed.client.name.clone());
        let c = bed.client.clone();
        r.ip(&[
            "link", "add", "c0", "type", "veth", "peer", "name", "eth0", "netns", &c.name,
        ]);
        r.ip(&["addr", "add", "203.0.113.1/24", "dev", "c0"]);
        r.ip(&["addr", "add", "2001:db8:3::1/64", "dev", "c0", "nodad"]);
        r.ip(&["link", "set", "c0", "up"]);
        c.ip(&["link", "set", "lo", "up"]);
        c.ip(&["addr", "add", &format!("{CLIENT_IP}/24"), "dev", "eth0"]);
        c.ip(&[
            "addr",
            "add",
            &format!("{CLIENT_IP6}/64"),
            "dev",
            "eth0",
            "nodad",
        ]);
        c.ip(&["link", "set", "eth0", "up"]);
        c.ip(&["route", "add", "default", "via", "203.0.113.1"]);
        c.ip(&["-6", "route", "add", "default", "via", "2001:db8:3::1"]);
        for i in 1..=n {
            let ns = bed.wire(&format!("h{i}"), host_ip(i), host_ip6(i), bridged);
            ns.ip(&["route", "add", "default", "via", &ROUTER_IP.to_string()]);
            ns.ip(&[
                "-6",
                "route",
                "add",
                "default",
                "via",
                &ROUTER_IP6.to_string(),
            ]);
            if vip_on_lo && speaker == Speaker::Frr {
                for (family, net) in [("-4", format!("{VIP}/32")), ("-6", format!("{VIP6}/128"))] {
                    ns.ip(&[
                        family, "route", "add", "local", &net, "dev", "lo", "table", "local",
                    ]);
                }
            } else if vip_on_lo {
                ns.ip(&["addr", "add", &format!("{VIP}/32"), "dev", "lo"]);
                ns.ip(&["addr", "add", &format!("{VIP6}/128"), "dev", "lo"]);
            }
            let dir = bed.dir.join(format!("h{i}"));
            std::fs::create_dir_all(&dir).expect("host dir");
            bed.hosts.push(LbHost {
                index: i,
                ns,
                port: format!("ph{i}"),
                dir,
                bird: None,
                frr: None,
                daemon: None,
                hosts: n,
            });
        }
        for i in 1..=n {
            let ns = bed.wire(&format!("b{i}"), backend_ip(i), backend_ip6(i), false);
            let mut b = Backend {
                index: i,
                ns,
                listeners: Vec::new(),
                conns: Arc::default(),
            };
            b.start();
            bed.backends.push(b);
        }
        // The speaker: the router, then every host, from the shipped configs.
        match speaker {
            Speaker::Bird => {
                let mut conf = router_config();
                // The shipped config has sessions for two hosts; an
                // operator adds one pair per further host, as here.
                for i in 3..=n {
                    conf.push_str(&format!(
                        "protocol bgp lb{i} from lbhost4 {{ neighbor {} as HOST_AS; }}\nprotocol bgp lb{i}_v6 from lbhost6 {{ neighbor {} as HOST_AS; }}\n",
                        host_ip(i),
                        host_ip6(i)
                    ));
                }
                let conf = bed.write("router.conf", &conf);
                bed.router_bird = Some(Bird::spawn(&bed.router, &conf, &bed.dir, "router"));
                for i in 1..=n {
                    bed.start_host_bird(i);
                }
            }
            Speaker::Frr => {
                let dir = bed.dir.join("frr-router");
                bed.router_frr = Some(Frr::spawn(&bed.router, &frr_router_config(), &dir));
                for i in 1..=n {
                    bed.start_host_frr(i);
                }
            }
        }
        bed.wait_sessions(Duration::from_secs(30)).await;
        bed
    }

    /// Starts (or restarts) host `i`'s BIRD from the shipped host config.
    pub fn start_host_bird(&mut self, i: usize) {
        let h = &mut self.hosts[i - 1];
        h.bird = None;
        let conf = h.dir.join("bird.conf");
        std::fs::write(&conf, host_config(i)).expect("write bird.conf");
        h.bird = Some(Bird::spawn(&h.ns, &conf, &h.dir, "bird"));
    }

    /// Starts (or restarts) host `i`'s FRR from the shipped host config.
    pub fn start_host_frr(&mut self, i: usize) {
        let h = &mut self.hosts[i - 1];
        h.frr = None;
        h.frr = Some(Frr::spawn(&h.ns, &frr_host_config(i), &h.dir.join("frr")));
    }

    /// The router's FRR.
    pub fn router_frr(&self) -> &Frr {
        self.router_frr.as_ref().expect("router frr")
    }

    /// What the router's speaker says of its sessions and routes, for a
    /// failed assertion.
    pub fn router_diag(&self) -> String {
        match self.speaker {
            Speaker::Bird => format!(
                "router BIRD:\n{}\n{}",
                self.router_bird().birdc(&["show", "protocols"]),
                self.router_bird().birdc(&["show", "route", "all"])
            ),
            Speaker::Frr => format!(
                "router FRR:\n{}\n{}\n{}",
                self.router_frr().vtysh("show bgp summary"),
                self.router_frr().vtysh("show ip route"),
                self.router_frr().vtysh("show bfd peers brief")
            ),
        }
    }

    /// Waits until every BGP session of the router (IPv4 and IPv6 to every
    /// host with BIRD; IPv4, and its BFD session, with FRR) is established.
    pub async fn wait_sessions(&self, timeout: Duration) {
        if self.speaker == Speaker::Frr {
            let want = self.hosts.len();
            let frr = self.router_frr();
            let deadline = Instant::now() + timeout;
            while frr.established() != want || frr.bfd_up() != want {
                assert!(
                    Instant::now() < deadline,
                    "the router's BGP and BFD sessions did not all come up within {timeout:?}; {}\nrouter log:\n{}",
                    self.router_diag(),
                    frr.log_tail(30)
                );
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
            return;
        }
        let want = 2 * self.hosts.len();
        let deadline = Instant::now() + timeout;
        loop {
            let up = self.router_bird().established();
            if up.len() == want {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "the router's BGP sessions did not all come up within {timeout:?} (up: {up:?}); router:\n{}\nrouter log:\n{}",
                self.router_bird().birdc(&["show", "protocols"]),
                self.router_bird().log_tail(30)
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// The router's BIRD.
    pub fn router_bird(&self) -> &Bird {
        self.router_bird.as_ref().expect("router bird")
    }

    /// Host `i` (1-based).
    pub fn host(&self, i: usize) -> &LbHost {
        &self.hosts[i - 1]
    }

    /// Host `i`, mutably.
    pub fn host_mut(&mut self, i: usize) -> &mut LbHost {
        &mut self.hosts[i - 1]
    }

    /// Backend `i`, mutably.
    pub fn backend_mut(&mut self, i: usize) -> &mut Backend {
        &mut self.backends[i - 1]
    }

    /// The hosts (by index) the router's FIB sends the IPv4 VIP to.
    pub fn nexthops(&self) -> Vec<usize> {
        let text = output(
            "ip",
            &[
                "-n",
                &self.router.name,
                "route",
                "show",
                &format!("{VIP}/32"),
            ],
        );
        gateways(&text)
            .into_iter()
            .filter_map(|g| (1..=self.hosts.len()).find(|i| IpAddr::V4(host_ip(*i)) == g))
            .collect()
    }

    /// The router's IPv4 and IPv6 routing tables (`ip route`), as text.
    pub fn router_routes(&self) -> String {
        output("ip", &["-n", &self.router.name, "route"])
            + &output("ip", &["-6", "-n", &self.router.name, "route"])
    }

    /// How many nexthops the router's FIB has for the IPv6 VIP.
    pub fn nexthops6(&self) -> usize {
        let text = output(
            "ip",
            &[
                "-6",
                "-n",
                &self.router.name,
                "route",
                "show",
                &format!("{VIP6}/128"),
            ],
        );
        gateways(&text).len()
    }

    /// Polls the router's FIB every 5 ms until the VIP's nexthops are
    /// exactly `want` (sorted host indexes); returns when that was first seen.
    pub async fn wait_nexthops(&self, want: &[usize], timeout: Duration) -> Instant {
        let deadline = Instant::now() + timeout;
        loop {
            let mut got = self.nexthops();
            got.sort_unstable();
            if got == want {
                return Instant::now();
            }
            assert!(
                Instant::now() < deadline,
                "router's route to {VIP}: nexthops {got:?}, not {want:?}, within {timeout:?}\nrouter FIB:\n{}\n{}",
                output("ip", &["-n", &self.router.name, "route"]),
                self.router_diag()
            );
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    }

    /// Connects from the client to `addr` and reads the greeting: which host
    /// carried the connection.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        timeout: Duration,
    ) -> std::io::Result<(BufReader<TcpStream>, usize)> {
        let s = self.client.socket_for(addr)?;
        let stream = match tokio::time::timeout(timeout, s.connect(addr)).await {
            Ok(r) => r?,
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    format!("connect to {addr} timed out after {timeout:?}"),
                ));
            }
        };
        let mut r = BufReader::new(stream);
        let mut line = String::new();
        match tokio::time::timeout(timeout, r.read_line(&mut line)).await {
            Ok(Ok(n)) if n > 0 => {}
            Ok(Ok(_)) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    "closed before the greeting",
                ));
            }
            Ok(Err(e)) => return Err(e),
            Err(_) => {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    "no greeting",
                ));
            }
        }
        let host = line
            .trim()
            .strip_prefix('b')
            .and_then(|i| i.parse().ok())
            .unwrap_or_else(|| panic!("unexpected greeting {line:?}"));
        Ok((r, host))
    }

    /// Opens `n` connections to `addr` one after another; how many each host
    /// carried (`0` counts failures).
    pub async fn spread(&self, addr: SocketAddr, n: usize) -> BTreeMap<usize, usize> {
        let mut counts = BTreeMap::new();
        for _ in 0..n {
            let host = match self.connect(addr, Duration::from_secs(3)).await {
                Ok((_, h)) => h,
                Err(_) => 0,
            };
            *counts.entry(host).or_insert(0) += 1;
        }
        counts
    }

    /// Opens `n` connections to be held open, returned with their host.
    pub async fn open_long(
        &self,
        addr: SocketAddr,
        n: usize,
    ) -> Vec<(BufReader<TcpStream>, usize)> {
        let mut v = Vec::with_capacity(n);
        for _ in 0..n {
            let c = self
                .connect(addr, Duration::from_secs(3))
                .await
                .unwrap_or_else(|e| panic!("open a long connection to {addr}: {e}"));
            v.push(c);
        }
        v
    }

    /// Starts a client that opens a new connection to `addr` every 10 ms
    /// until stopped. Each attempt gets `attempt_timeout`.
    pub fn prober(&self, addr: SocketAddr, attempt_timeout: Duration) -> Prober {
        let ns = self.client.clone();
        let log: Arc<Mutex<Vec<Attempt>>> = Arc::default();
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let (log2, stop2) = (log.clone(), stop.clone());
        let task = tokio::spawn(async move {
            let mut inflight = tokio::task::JoinSet::new();
            // Bounded: at most 6000 attempts (a minute at 10 ms).
            for _ in 0..6000 {
                if stop2.load(Ordering::Relaxed) {
                    break;
                }
                let ns = ns.clone();
                let log = log2.clone();
                inflight.spawn(async move {
                    let (started, wall) = (Instant::now(), std::time::SystemTime::now());
                    let outcome = attempt(&ns, addr, attempt_timeout).await;
                    log.lock().expect("log").push(Attempt {
                        started,
                        wall,
                        outcome,
                    });
                });
                tokio::time::sleep(Duration::from_millis(10)).await;
            }
            while inflight.join_next().await.is_some() {}
        });
        Prober { log, stop, task }
    }

    /// A fault under traffic: a client opens a new connection to the IPv4
    /// VIP every 10 ms (each given `attempt`); once 30 have finished,
    /// `fault` runs, then this waits (up to 20 s) until the router sends
    /// the VIP to host `survivor` alone. Returns the still running prober,
    /// when the fault began and when the router's route changed.
    pub async fn fault_under_traffic(
        &mut self,
        attempt: Duration,
        survivor: usize,
        fault: impl FnOnce(&mut BgpBed),
    ) -> (Prober, Instant, Instant) {
        let vip = SocketAddr::new(IpAddr::V4(VIP), PORT);
        self.watch_router_routes();
        let prober = self.prober(vip, attempt);
        prober.wait_finished(30, Duration::from_secs(10)).await;
        let began = Instant::now();
        self.mark("the fault begins");
        fault(self);
        let changed = self
            .wait_nexthops(&[survivor], Duration::from_secs(20))
            .await;
        self.mark(&format!("the test saw the route to host {survivor} alone"));
        (prober, began, changed)
    }

    /// Starts recording the router's route changes (`ip -ts monitor
    /// route`, wall-clock stamped) into `router-routes.log` in the scratch
    /// directory, until the bed is dropped; once per bed. [`BgpBed::mark`]
    /// puts the test's events between them.
    fn watch_router_routes(&mut self) {
        if self.route_monitor.is_some() {
            return;
        }
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("router-routes.log"))
            .expect("router route log");
        // Line by line (stdbuf): ip's stdio buffers a file, and the marks
        // must fall between the changes they came between.
        self.route_monitor = Command::new("stdbuf")
            // Stamped in UTC, as `route_changed_after_fault` reads them.
            .env("TZ", "UTC")
            .args([
                "-oL",
                "ip",
                "-ts",
                "-n",
                &self.router.name,
                "monitor",
                "route",
            ])
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(Stdio::null())
            .spawn()
            .ok();
    }

    /// When the router's route to the IPv4 VIP first changed after the
    /// fault began ([`BgpBed::fault_under_traffic`]'s mark), by `ip -ts
    /// monitor route`'s stamp: the moment the router's kernel told its
    /// listeners (seconds since UTC midnight). `None` when the log holds
    /// no change after the mark.
    pub fn route_changed_after_fault(&self) -> Option<f64> {
        let log = std::fs::read_to_string(self.dir.join("router-routes.log")).ok()?;
        let after = log.split("--- the fault begins ---").nth(1)?;
        let vip = VIP.to_string();
        after
            .lines()
            .filter(|l| l.starts_with('[') && l.contains(&vip))
            .find_map(|l| {
                // [2026-12-08T00:58:26.901418] 10.99.0.1 ...
                let stamp = l.get(1..l.find(']')?)?;
                let time = stamp.split('T').nth(1)?;
                let mut hms = time.split(':');
                let h: f64 = hms.next()?.parse().ok()?;
                let m: f64 = hms.next()?.parse().ok()?;
                let s: f64 = hms.next()?.parse().ok()?;
                Some(h * 3600.0 + m * 60.0 + s)
            })
    }

    /// Appends `--- what ---` to the router's route log (between the
    /// route changes before and after it).
    fn mark(&self, what: &str) {
        use std::io::Write as _;
        if let Ok(mut f) = std::fs::OpenOptions::new()
            .append(true)
            .open(self.dir.join("router-routes.log"))
        {
            let _ = writeln!(f, "--- {what} ---");
        }
    }

    /// Writes a file into the scratch directory.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, text).expect("write scratch file");
        p
    }

    /// A namespace on the router's bridge: `<tag>-<suffix>`, its `eth0` (the
    /// peer of bridge port `p<suffix>`) with `ip/24` and `ip6/64`. With
    /// `bridged`, a host built like a Harvester host: the veth's end in the
    /// namespace is `up0`, a port of the bridge `eth0` that holds the
    /// addresses, and `br_netfilter` is on there.
    fn wire(&mut self, suffix: &str, ip: Ipv4Addr, ip6: Ipv6Addr, bridged: bool) -> Ns {
        let ns = Ns {
            name: format!("{}-{suffix}", self.tag),
        };
        self.add_ns(&ns.name);
        let port = format!("p{suffix}");
        let end = if bridged { "up0" } else { "eth0" };
        self.router.ip(&[
            "link", "add", &port, "type", "veth", "peer", "name", end, "netns", &ns.name,
        ]);
        self.router
            .ip(&["link", "set", &port, "master", "br0", "up"]);
        ns.ip(&["link", "set", "lo", "up"]);
        if bridged {
            ns.ip(&["link", "add", "eth0", "type", "bridge"]);
            ns.ip(&["link", "set", "up0", "master", "eth0", "up"]);
            super::vmnet::bridge_netfilter(&ns);
        }
        ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
        ns.ip(&["addr", "add", &format!("{ip6}/64"), "dev", "eth0", "nodad"]);
        ns.ip(&["link", "set", "eth0", "up"]);
        ns
    }

    /// Routes the backends' replies through the router, as on a real
    /// anycast deployment where the backends' network reaches the VIP
    /// through the same ECMP as the clients: each backend's default route
    /// is the router, and the router sends no ICMP redirect (a backend
    /// that took one would send every reply to one host). A reply to the
    /// VIP (`source_nat = "vip"`) is then hashed by the router on its own
    /// 5-tuple, independently of its flow's forward packets: about half
    /// of all flows come back through the host that did not carry them.
    pub fn route_replies_through_router(&self) {
        sysctl(
            &self.router,
            &[
                "net.ipv4.conf.all.send_redirects=0",
                "net.ipv4.conf.br0.send_redirects=0",
            ],
        );
        for b in &self.backends {
            b.ns.ip(&["route", "add", "default", "via", &ROUTER_IP.to_string()]);
        }
    }

    /// Host `i`'s link goes silent: its port on the router's bridge goes
    /// down, so nothing passes either way while the router's `br0` stays up
    /// (a host behind a switch losing power).
    pub fn silence(&self, i: usize) {
        self.router.ip(&["link", "set", &self.host(i).port, "down"]);
    }

    fn add_ns(&mut self, name: &str) {
        run("ip", &["netns", "add", name], None);
        self.created.push(name.to_string());
    }
}

impl Drop for BgpBed {
    fn drop(&mut self) {
        let panicking = std::thread::panicking();
        for h in &mut self.hosts {
            if let Some(d) = h.daemon.take() {
                if panicking {
                    eprintln!(
                        "--- daemon log of host {} ({}) ---\n{}",
                        h.index,
                        self.tag,
                        d.log_tail(40)
                    );
                }
                drop(d);
            }
            if let Some(b) = h.bird.take() {
                if panicking {
                    eprintln!("--- BIRD log of host {} ---\n{}", h.index, b.log_tail(20));
                }
                drop(b);
            }
            if let Some(f) = h.frr.take() {
                if panicking {
                    eprintln!("--- FRR logs of host {} ---\n{}", h.index, f.log_tail(20));
                }
                drop(f);
            }
        }
        if let Some(f) = self.router_frr.take() {
            if panicking {
                eprintln!("--- router FRR logs ---\n{}", f.log_tail(30));
            }
            drop(f);
        }
        if let Some(b) = self.router_bird.take() {
            if panicking {
                eprintln!("--- router BIRD log ---\n{}", b.log_tail(30));
            }
            drop(b);
        }
        if let Some(mut m) = self.route_monitor.take() {
            let _ = m.kill();
            let _ = m.wait();
            if panicking {
                // The VIPs' routes only (a route's nexthop lines follow it).
                let log =
                    std::fs::read_to_string(self.dir.join("router-routes.log")).unwrap_or_default();
                let mut vip = false;
                let lines: Vec<&str> = log
                    .lines()
                    .filter(|l| {
                        if l.starts_with("---") {
                            return true;
                        }
                        if !l.starts_with(char::is_whitespace) {
                            vip = l.contains(&VIP.to_string()) || l.contains(&VIP6.to_string());
                        }
                        vip
                    })
                    .collect();
                eprintln!(
                    "--- the router's VIP routes as they changed (ip -ts monitor route) ---\n{}",
                    lines.join("\n")
                );
            }
        }
        self.backends.clear();
        super::remove_bed(&self.created, &self.dir);
    }
}

/// The gateways of an `ip route show` answer (one route or a multipath one).
fn gateways(text: &str) -> Vec<IpAddr> {
    let words: Vec<&str> = text.split_whitespace().collect();
    words
        .windows(2)
        .filter(|w| w[0] == "via")
        .filter_map(|w| w[1].parse().ok())
        .collect()
}

/// `sysctl -w` each of `settings` inside `ns`.
fn sysctl(ns: &Ns, settings: &[&str]) {
    let mut args = vec!["netns", "exec", &ns.name, "sysctl", "-q", "-w"];
    args.extend_from_slice(settings);
    run("ip", &args, None);
}

/// A UDP socket bound to `addr` in `ns` (on the caller's runtime).
pub fn udp_socket(ns: &Ns, addr: SocketAddr) -> tokio::net::UdpSocket {
    let s = super::in_ns(&ns.name, move || {
        let s = std::net::UdpSocket::bind(addr)?;
        s.set_nonblocking(true)?;
        Ok::<_, std::io::Error>(s)
    })
    .unwrap_or_else(|e| panic!("bind UDP {addr} in {}: {e}", ns.name));
    tokio::net::UdpSocket::from_std(s).expect("register UDP socket")
}

/// Sends one datagram on `s` (connected to a VIP) and reads the answer:
/// which host's backend answered, or `None` without one within 2 s.
pub async fn udp_ask(s: &tokio::net::UdpSocket) -> Option<usize> {
    s.send(b"hi").await.ok()?;
    let mut buf = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(2), s.recv(&mut buf))
        .await
        .ok()?
        .ok()?;
    let text = String::from_utf8_lossy(&buf[..n]).to_string();
    text.trim().strip_prefix('b').and_then(|i| i.parse().ok())
}

/// The repository's `config/bird/<name>`.
fn shipped(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/bird")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Replaces the value of `define NAME = …;` in a BIRD config, asserting
/// the line is there.
fn define(conf: &str, name: &str, value: &str) -> String {
    let prefix = format!("define {name} = ");
    let mut found = false;
    let out: Vec<String> = conf
        .lines()
        .map(|l| {
            if l.starts_with(&prefix) {
                found = true;
                format!("{prefix}{value};")
            } else {
                l.to_string()
            }
        })
        .collect();
    assert!(found, "no `{prefix}…;` line in the shipped BIRD config");
    out.join("\n") + "\n"
}

/// The shipped host config for host `i`, its log sent to stderr.
pub fn host_config(i: usize) -> String {
    let c = shipped("bird-host.conf");
    let c = define(&c, "HOST_IP4", &host_ip(i).to_string());
    let c = define(&c, "HOST_IP6", &host_ip6(i).to_string());
    let c = define(&c, "ROUTER_IP4", &ROUTER_IP.to_string());
    let c = define(&c, "ROUTER_IP6", &ROUTER_IP6.to_string());
    format!("log stderr all;\n{c}")
}

/// The shipped router config (its addresses are the bed's), logging to stderr.
pub fn router_config() -> String {
    let c = shipped("bird-router.conf");
    let c = define(&c, "ROUTER_IP4", &ROUTER_IP.to_string());
    format!("log stderr all;\n{c}")
}

/// The repository's `config/frr/<name>`.
pub fn shipped_frr(name: &str) -> String {
    let p = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("config/frr")
        .join(name);
    std::fs::read_to_string(&p).unwrap_or_else(|e| panic!("read {}: {e}", p.display()))
}

/// Replaces the line of an FRR config that starts with `prefix` (after
/// its indentation) by `prefix value`, asserting there is exactly one.
fn frr_set(conf: &str, prefix: &str, value: &str) -> String {
    let mut found = 0;
    let out: Vec<String> = conf
        .lines()
        .map(|l| {
            let body = l.trim_start();
            if body.starts_with(prefix) {
                found += 1;
                format!("{}{prefix} {value}", &l[..l.len() - body.len()])
            } else {
                l.to_string()
            }
        })
        .collect();
    assert_eq!(found, 1, "`{prefix}` lines in the shipped FRR config");
    out.join("\n") + "\n"
}

/// The shipped FRR host config for host `i`: its router id is its address
/// (the rest, the router's address and the VIP range, are the bed's).
pub fn frr_host_config(i: usize) -> String {
    frr_set(
        &shipped_frr("frr-host.conf"),
        "bgp router-id",
        &host_ip(i).to_string(),
    )
}

/// The shipped FRR router config, as it is (its addresses are the bed's).
pub fn frr_router_config() -> String {
    shipped_frr("frr-router.conf")
}

/// One attempt of a [`Prober`].
#[derive(Debug)]
pub struct Attempt {
    /// When it started.
    pub started: Instant,
    /// The same, by the wall clock (to set beside the router's route log).
    pub wall: std::time::SystemTime,
    /// The host that answered, or the error.
    pub outcome: Result<usize, String>,
}

/// A client opening new connections until stopped (see [`BgpBed::prober`]).
pub struct Prober {
    log: Arc<Mutex<Vec<Attempt>>>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    task: JoinHandle<()>,
}

impl Prober {
    /// How many attempts have finished so far.
    pub fn finished(&self) -> usize {
        self.log.lock().expect("log").len()
    }

    /// Waits until `n` attempts have finished, panicking after `timeout`.
    pub async fn wait_finished(&self, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        while self.finished() < n {
            assert!(
                Instant::now() < deadline,
                "only {} of {n} connection attempts finished within {timeout:?}",
                self.finished()
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Waits until `n` attempts that started after `from` have finished,
    /// panicking after `timeout`. A caller that needs attempts after an
    /// event (a withdrawal) waits on this, not on a count from now: the
    /// attempts in flight when the event was seen may all have started
    /// before it (a slow withdrawal left 38 of 80 after it under load).
    pub async fn wait_started_after(&self, from: Instant, n: usize, timeout: Duration) {
        let deadline = Instant::now() + timeout;
        loop {
            let after = self
                .log
                .lock()
                .expect("log")
                .iter()
                .filter(|a| a.started > from)
                .count();
            if after >= n {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "only {after} of {n} connection attempts started after the event finished within {timeout:?}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// Lets `more` further attempts finish (up to 30 s), then stops it:
    /// every attempt, in the order they started.
    pub async fn finish(self, more: usize) -> Vec<Attempt> {
        let seen = self.finished();
        self.wait_finished(seen + more, Duration::from_secs(30))
            .await;
        self.stop().await
    }

    /// Stops it, waits for the attempts in flight, and returns them all in
    /// the order they started.
    pub async fn stop(self) -> Vec<Attempt> {
        self.stop.store(true, Ordering::Relaxed);
        let _ = tokio::time::timeout(Duration::from_secs(30), self.task).await;
        let mut v = std::mem::take(&mut *self.log.lock().expect("log"));
        v.sort_by_key(|a| a.started);
        v
    }
}

/// One new connection from `ns` to `addr`: the host that greeted, or why not.
async fn attempt(ns: &Ns, addr: SocketAddr, timeout: Duration) -> Result<usize, String> {
    let s = ns.socket_for(addr).map_err(|e| e.to_string())?;
    let r = tokio::time::timeout(timeout, async move {
        let mut stream = s.connect(addr).await?;
        let mut buf = [0u8; 8];
        let n = stream.read(&mut buf).await?;
        let text = String::from_utf8_lossy(&buf[..n]).to_string();
        let _ = stream.shutdown().await;
        Ok::<_, std::io::Error>(text)
    })
    .await;
    match r {
        Ok(Ok(text)) => text
            .trim()
            .strip_prefix('b')
            .and_then(|i| i.parse().ok())
            .ok_or(format!("unexpected greeting {text:?}")),
        Ok(Err(e)) => Err(e.to_string()),
        Err(_) => Err(format!("timed out after {timeout:?}")),
    }
}

/// `t` as seconds since UTC midnight (as [`BgpBed::route_changed_after_fault`]).
pub fn time_of_day(t: std::time::SystemTime) -> f64 {
    let since = t
        .duration_since(std::time::UNIX_EPOCH)
        .expect("a clock after 1970");
    (since.as_secs() % 86_400) as f64 + f64::from(since.subsec_micros()) / 1e6
}

/// `later - earlier` in seconds, both times of day, across a midnight.
pub fn day_seconds_between(earlier: f64, later: f64) -> f64 {
    let d = (later - earlier).rem_euclid(86_400.0);
    if d > 43_200.0 { d - 86_400.0 } else { d }
}

/// The attempts that failed.
pub fn failed(attempts: &[Attempt]) -> Vec<&Attempt> {
    attempts.iter().filter(|a| a.outcome.is_err()).collect()
}

/// Held connections per host (index 1 and 2; 0 unused): how many, and how
/// many no longer work.
#[derive(Debug, Default)]
pub struct Tally {
    /// Connections carried by each host.
    pub total: [usize; 3],
    /// Of those, the ones whose echo round trip failed.
    pub broken: [usize; 3],
}

/// Tries one echo round trip on every held connection.
pub async fn tally(conns: &mut [(BufReader<TcpStream>, usize)]) -> Tally {
    let mut t = Tally::default();
    for (c, h) in conns {
        t.total[*h] += 1;
        if !alive(c).await {
            t.broken[*h] += 1;
        }
    }
    t
}

/// Whether a held connection still works: one echo round trip.
pub async fn alive(c: &mut BufReader<TcpStream>) -> bool {
    let r = tokio::time::timeout(Duration::from_secs(3), async {
        c.get_mut().write_all(b"ping\n").await?;
        let mut line = String::new();
        let n = c.read_line(&mut line).await?;
        Ok::<_, std::io::Error>(n > 0 && line == "ping\n")
    })
    .await;
    matches!(r, Ok(Ok(true)))
}

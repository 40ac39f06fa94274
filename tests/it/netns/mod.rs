//! The fault test bed: real test hosts in Linux network namespaces.
//!
//! One [`Bed`] per test builds, with `ip` and `nft` only:
//!
//! ```text
//!   client ns (198.51.100.2) ─┐
//!   lb ns (198.51.100.3 + VIPs .10/.11, the real daemon) ─┤ bridge ns: br0
//!   node ns 1..N (198.51.100.21..) ─┘
//! ```
//!
//! Every namespace is new and named after the test and this process, so tests
//! run in parallel (threads or processes) with the same addresses: the
//! 198.51.100.0/24 documentation range exists only on the bed's own bridge.
//! Nothing is added to the host's namespace, and the only traffic is between
//! the bed's namespaces (plus 127.0.0.1 inside the load-balancer namespace for
//! the admin API). [`Bed`]'s `Drop` kills the daemon and deletes every
//! namespace, so a failing or panicking test leaves nothing behind.
//!
//! Test code runs in the host namespace; a socket is created inside a
//! namespace by a short-lived thread that `setns(2)`s there, and then used from
//! the test's runtime like any other socket (a socket keeps its namespace).

#![allow(unsafe_code)]
// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

pub mod anycast_hosts;
pub mod bgp;
pub mod keepalived;
pub mod peers;
pub mod traffic;
pub mod vmnet;
// The beds' tests wait through `netns`, and the `require!` macro skips through it.
pub use crate::support::{skip_or_fail, wait_for};

use crate::support::Process;
use crate::support::{Config, Lb};

use std::io::{Read, Write};
use std::net::{IpAddr, Ipv4Addr, SocketAddr};
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

/// Held by each test of the heaviest beds (several daemons, keepalived and
/// conntrackd: conntrack_sync, conntrack_sync_v6, conntrack_hosts,
/// vmnet_hosts) while it runs, so no two of them run at once in one test
/// process: two at once on the 2-core CI machine made failbacks miss their
/// deadlines. Across modules too, since they share one binary (before,
/// each was a binary of its own and `cargo test` ran those one by one).
pub static HEAVY_BED: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// Address of the client host.
pub const CLIENT_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
/// Address of the load-balancer host itself.
pub const LB_IP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
/// First VIP (held by the load-balancer host).
pub const VIP: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 10);
/// Second VIP.
pub const VIP2: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 11);
/// Port of the daemon's admin API, on 127.0.0.1 inside the load-balancer namespace.
pub const ADMIN_PORT: u16 = 9901;
/// The service's nodeport on every node.
pub const NODEPORT: u16 = 30080;
/// The health-check port on every node (kube-proxy's healthz port).
pub const HEALTH_PORT: u16 = 10256;

/// Address of node `i` (1-based): 198.51.100.(20 + i).
pub fn node_ip(i: usize) -> Ipv4Addr {
    Ipv4Addr::new(198, 51, 100, 20 + i as u8)
}

/// Why namespace tests cannot run here, if they cannot.
pub fn skip_reason() -> Option<String> {
    if let Some(why) = crate::support::not_root() {
        return Some(why);
    }
    match Command::new("ip").args(["netns", "list"]).output() {
        Ok(o) if o.status.success() => {}
        Ok(o) => {
            return Some(format!(
                "`ip netns list` failed: {}",
                String::from_utf8_lossy(&o.stderr).trim()
            ));
        }
        Err(e) => return Some(format!("`ip` (iproute2) is not available: {e}")),
    }
    crate::support::missing_tool("nft", "nftables")
}

/// The one guard of the beds' tests: returns from the test through
/// [`skip_or_fail`] (which fails under CI) when `reason` (an
/// `Option<String>`, a bed's `skip_reason()`) says why it cannot run here;
/// `needs` says what the test needs.
#[macro_export]
macro_rules! require {
    ($reason:expr, $needs:expr) => {
        if let Some(why) = $reason {
            $crate::netns::skip_or_fail(module_path!(), &format!("needs {} ({why})", $needs));
            return;
        }
    };
}

/// Returns from the test with a printed reason when namespaces cannot be made.
#[macro_export]
macro_rules! require_netns {
    () => {
        $crate::require!(
            $crate::netns::skip_reason(),
            "root and iproute2/nftables for network namespaces"
        )
    };
}

/// Runs `f` on a new thread inside namespace `ns` and returns its result.
pub fn in_ns<T: Send + 'static>(ns: &str, f: impl FnOnce() -> T + Send + 'static) -> T {
    let path = format!("/run/netns/{ns}");
    std::thread::spawn(move || {
        let file = std::fs::File::open(&path).unwrap_or_else(|e| panic!("open {path}: {e}"));
        // SAFETY: setns on a valid namespace descriptor; only this thread moves.
        let rc = unsafe { libc::setns(file.as_raw_fd(), libc::CLONE_NEWNET) };
        assert_eq!(rc, 0, "setns {path}: {}", std::io::Error::last_os_error());
        f()
    })
    .join()
    .expect("namespace thread panicked")
}

/// A network namespace of the bed.
#[derive(Clone, Debug)]
pub struct Ns {
    /// Its name under /run/netns.
    pub name: String,
}

impl Ns {
    /// A listening socket on `addr` (IPv4, or IPv6 only) inside this
    /// namespace (on the caller's runtime).
    pub fn listen(&self, addr: SocketAddr) -> tokio::net::TcpListener {
        let l = in_ns(&self.name, move || {
            let s = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                None,
            )?;
            s.set_reuse_address(true)?;
            if addr.is_ipv6() {
                s.set_only_v6(true)?;
            }
            s.bind(&addr.into())?;
            s.listen(4096)?;
            s.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(std::net::TcpListener::from(s))
        })
        .unwrap_or_else(|e| panic!("listen on {addr} in {}: {e}", self.name));
        tokio::net::TcpListener::from_std(l).expect("register listener")
    }

    /// An unconnected TCP (IPv4) socket inside this namespace.
    pub fn socket(&self) -> std::io::Result<tokio::net::TcpSocket> {
        self.socket_for(SocketAddr::from((Ipv4Addr::UNSPECIFIED, 0)))
    }

    /// An unconnected TCP socket of `addr`'s family inside this namespace.
    pub fn socket_for(&self, addr: SocketAddr) -> std::io::Result<tokio::net::TcpSocket> {
        let s = in_ns(&self.name, move || {
            let s = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                None,
            )?;
            s.set_nonblocking(true)?;
            Ok::<_, std::io::Error>(std::net::TcpStream::from(s))
        })?;
        Ok(tokio::net::TcpSocket::from_std_stream(s))
    }

    /// Connects from this namespace to `addr` (either family), failing
    /// after `timeout`.
    pub async fn connect(
        &self,
        addr: SocketAddr,
        timeout: Duration,
    ) -> std::io::Result<tokio::net::TcpStream> {
        let s = self.socket_for(addr)?;
        match tokio::time::timeout(timeout, s.connect(addr)).await {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::new(
                std::io::ErrorKind::TimedOut,
                format!("connect to {addr} timed out after {timeout:?}"),
            )),
        }
    }

    /// Many sockets at once (one thread hop instead of one per socket).
    pub fn sockets(&self, n: usize) -> std::io::Result<Vec<tokio::net::TcpSocket>> {
        let v = in_ns(&self.name, move || {
            (0..n)
                .map(|_| {
                    let s =
                        socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
                    s.set_nonblocking(true)?;
                    Ok::<_, std::io::Error>(std::net::TcpStream::from(s))
                })
                .collect::<std::io::Result<Vec<_>>>()
        })?;
        Ok(v.into_iter()
            .map(tokio::net::TcpSocket::from_std_stream)
            .collect())
    }

    /// `ip -n <ns> <args>`, panicking with the output on failure.
    pub fn ip(&self, args: &[&str]) {
        let mut full = vec!["-n", &self.name];
        full.extend_from_slice(args);
        run("ip", &full, None);
    }

    /// `nft <args>` inside this namespace (a listing): its output, or
    /// `None` when nft fails (no such table, chain or set).
    pub fn nft_out(&self, args: &[&str]) -> Option<String> {
        let out = Command::new("ip")
            .args(["netns", "exec", &self.name, "nft"])
            .args(args)
            .output()
            .expect("run nft");
        out.status
            .success()
            .then(|| String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// Loads an nft ruleset inside this namespace.
    pub fn nft(&self, rules: &str) {
        run(
            "ip",
            &["netns", "exec", &self.name, "nft", "-f", "-"],
            Some(rules),
        );
    }
}

/// Runs a command, panicking with its output if it fails.
pub fn run(cmd: &str, args: &[&str], stdin: Option<&str>) {
    let mut c = Command::new(cmd);
    c.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = c
        .spawn()
        .unwrap_or_else(|e| panic!("cannot run {cmd}: {e}"));
    if let Some(input) = stdin {
        child
            .stdin
            .take()
            .expect("piped")
            .write_all(input.as_bytes())
            .expect("write stdin");
    }
    let out = child.wait_with_output().expect("wait");
    assert!(
        out.status.success(),
        "{cmd} {args:?} failed: {}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
}

static SEQ: AtomicU32 = AtomicU32::new(0);

/// A tag unique to this process and bed (`hlb<pid>-<n>-<test>`, the prefix
/// of its namespaces) and a fresh scratch directory named after it.
pub fn new_tag(test: &str) -> (String, PathBuf) {
    let tag = format!(
        "hlb{}-{}-{}",
        std::process::id(),
        SEQ.fetch_add(1, Ordering::Relaxed),
        test
    );
    let dir = std::env::temp_dir().join(&tag);
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("scratch dir");
    (tag, dir)
}

/// Deletes namespaces `names` (last made first) and, unless
/// `HLB_TEST_KEEP_DIR` is set, the scratch directory `dir`; errors are
/// ignored (this runs in `Drop`, also on panic).
pub fn remove_bed(names: &[String], dir: &Path) {
    for ns in names.iter().rev() {
        let _ = Command::new("ip")
            .args(["netns", "del", ns])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status();
    }
    if std::env::var_os("HLB_TEST_KEEP_DIR").is_none() {
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// The namespaces, bridge and daemon of one test.
pub struct Bed {
    /// Short unique tag of this bed (namespace name prefix).
    pub tag: String,
    /// The bridge's namespace.
    pub bridge: Ns,
    /// The client host.
    pub client: Ns,
    /// The load-balancer host.
    pub lb: Ns,
    /// The nodes, `nodes[0]` is node 1.
    pub nodes: Vec<Ns>,
    /// Scratch directory (configs, daemon logs).
    pub dir: PathBuf,
    created: Vec<String>,
    daemon: Option<DaemonProc>,
}

impl Bed {
    /// Turns IPv4 forwarding on in the load-balancer namespace: the kernel
    /// path forwards only with it on.
    pub fn enable_forwarding(&self) {
        run(
            "ip",
            &[
                "netns",
                "exec",
                &self.lb.name,
                "sysctl",
                "-qw",
                "net.ipv4.ip_forward=1",
            ],
            None,
        );
    }

    /// Builds the bed for test `test` with `n` nodes.
    pub fn new(test: &str, n: usize) -> Bed {
        assert!((1..=9).contains(&n), "1..=9 nodes");
        let (tag, dir) = new_tag(test);
        let mut bed = Bed {
            bridge: Ns {
                name: format!("{tag}-br"),
            },
            client: Ns {
                name: format!("{tag}-c"),
            },
            lb: Ns {
                name: format!("{tag}-lb"),
            },
            nodes: (1..=n)
                .map(|i| Ns {
                    name: format!("{tag}-n{i}"),
                })
                .collect(),
            tag,
            dir,
            created: Vec::new(),
            daemon: None,
        };
        // From here on, Drop cleans up whatever was made.
        bed.add_ns(&bed.bridge.name.clone());
        bed.bridge.ip(&["link", "add", "br0", "type", "bridge"]);
        bed.bridge.ip(&["link", "set", "br0", "up"]);
        let mut hosts = vec![
            (bed.client.clone(), CLIENT_IP, vec![]),
            (bed.lb.clone(), LB_IP, vec![VIP, VIP2]),
        ];
        for (i, node) in bed.nodes.iter().enumerate() {
            hosts.push((node.clone(), node_ip(i + 1), vec![]));
        }
        for (k, (ns, ip, extra)) in hosts.into_iter().enumerate() {
            bed.wire("br0", &ns, &format!("v{k}"), ip, &extra);
        }
        bed
    }

    /// Adds one more host on the bridge (for tests with several
    /// load-balancer hosts): namespace `<tag>-<suffix>` with `ip/24` on its
    /// `eth0`, wired to the bridge port `h<suffix>`, returned with the host.
    pub fn add_host(&mut self, suffix: &str, ip: Ipv4Addr) -> (Ns, String) {
        self.add_host_on("br0", suffix, ip)
    }

    /// As [`Bed::add_host`], on another bridge of the bridge namespace
    /// (made with [`Bed::add_bridge`]): a host of a second L2 segment.
    pub fn add_host_on(&mut self, bridge: &str, suffix: &str, ip: Ipv4Addr) -> (Ns, String) {
        let ns = Ns {
            name: format!("{}-{suffix}", self.tag),
        };
        let port = format!("h{suffix}");
        self.wire(bridge, &ns, &port, ip, &[]);
        (ns, port)
    }

    /// One more bridge `name` in the bridge namespace: another L2 segment.
    pub fn add_bridge(&self, name: &str) {
        self.bridge.ip(&["link", "add", name, "type", "bridge"]);
        self.bridge.ip(&["link", "set", name, "up"]);
    }

    /// Makes namespace `ns` a host on `bridge`: its `eth0` (the peer of
    /// bridge port `port`) with `ip/24` and each of `extra` as a /32.
    fn wire(&mut self, bridge: &str, ns: &Ns, port: &str, ip: Ipv4Addr, extra: &[Ipv4Addr]) {
        self.add_ns(&ns.name);
        self.bridge.ip(&[
            "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", &ns.name,
        ]);
        self.bridge
            .ip(&["link", "set", port, "master", bridge, "up"]);
        ns.ip(&["link", "set", "lo", "up"]);
        ns.ip(&["addr", "add", &format!("{ip}/24"), "dev", "eth0"]);
        for e in extra {
            ns.ip(&["addr", "add", &format!("{e}/32"), "dev", "eth0"]);
        }
        ns.ip(&["link", "set", "eth0", "up"]);
    }

    /// Takes bridge port `port` down (the host behind it vanishes) or up.
    pub fn set_port(&self, port: &str, up: bool) {
        self.bridge
            .ip(&["link", "set", port, if up { "up" } else { "down" }]);
    }

    fn add_ns(&mut self, name: &str) {
        run("ip", &["netns", "add", name], None);
        self.created.push(name.to_string());
    }

    /// Node `i` (1-based).
    pub fn node(&self, i: usize) -> &Ns {
        &self.nodes[i - 1]
    }

    /// The bridge port of node `i` (1-based): client is v0, lb v1, nodes v2...
    fn node_port_name(i: usize) -> String {
        format!("v{}", i + 1)
    }

    /// Cuts node `i`'s link (its bridge port goes down: packets vanish).
    pub fn cut_link(&self, i: usize) {
        self.bridge
            .ip(&["link", "set", &Self::node_port_name(i), "down"]);
    }

    /// Node `i` silently drops every TCP packet to `ports` (a hung node VM).
    pub fn blackhole(&self, i: usize, ports: &[u16]) {
        let ports: Vec<String> = ports.iter().map(|p| p.to_string()).collect();
        self.node(i).nft(&format!(
            "table inet fault {{\n chain input {{ type filter hook input priority 0; policy accept;\n  tcp dport {{ {} }} drop\n }}\n}}\n",
            ports.join(", ")
        ));
    }

    /// Node `i` answers a SYN to `port` with a TCP reset (no matter what listens).
    pub fn reject_with_reset(&self, i: usize, port: u16) {
        self.node(i).nft(&format!(
            "table inet fault {{\n chain input {{ type filter hook input priority 0; policy accept;\n  tcp dport {port} reject with tcp reset\n }}\n}}\n"
        ));
    }

    /// Node `i` answers a new connection (a SYN) to `port` with a reset,
    /// as a closed port does; connections already open, and ones its kernel
    /// completed a moment before and has yet to hand to the application, go
    /// on. (Closing the listening socket instead would also reset those
    /// queued connections: the accept-then-reset fault, a different one.)
    pub fn refuse_new_connections(&self, i: usize, port: u16) {
        self.node(i).nft(&format!(
            "table inet fault {{\n chain input {{ type filter hook input priority 0; policy accept;\n  tcp dport {port} tcp flags & (syn | ack) == syn reject with tcp reset\n }}\n}}\n"
        ));
    }

    /// Node `i` drops `percent`% of the packets on its link, both ways, at random.
    pub fn packet_loss(&self, i: usize, percent: u32) {
        self.node(i).nft(&format!(
            "table inet fault {{\n chain input {{ type filter hook input priority 0; policy accept;\n  iifname \"eth0\" numgen random mod 100 < {percent} drop\n }}\n chain output {{ type filter hook output priority 0; policy accept;\n  oifname \"eth0\" numgen random mod 100 < {percent} drop\n }}\n}}\n"
        ));
    }

    /// Removes every fault rule of node `i`.
    pub fn heal(&self, i: usize) {
        self.node(i).nft("delete table inet fault\n");
    }

    /// Writes the config and starts the real daemon in the load-balancer
    /// namespace; waits (with a deadline) until its admin API answers.
    pub async fn start_daemon(&mut self, config: &str) -> &DaemonProc {
        self.start_daemon_with(config, None).await
    }

    /// As [`Bed::start_daemon`], with the daemon's open-file limit (soft and
    /// hard) set to `nofile`.
    pub async fn start_daemon_with(&mut self, config: &str, nofile: Option<u64>) -> &DaemonProc {
        self.start(config, |ns, path, log| {
            DaemonProc::spawn(ns, path, log, nofile)
        })
        .await
    }

    /// As [`Bed::start_daemon`], under `store` (a stand-in for systemd's
    /// file descriptor store): what a restart that hands over needs.
    pub async fn start_daemon_stored(
        &mut self,
        config: &str,
        store: &crate::support::fd_store::FakeStore,
    ) -> &DaemonProc {
        self.start(config, |ns, path, log| {
            DaemonProc::spawn_stored(ns, path, log, store)
        })
        .await
    }

    async fn start(
        &mut self,
        config: &str,
        spawn: impl FnOnce(&Ns, &Path, &Path) -> DaemonProc,
    ) -> &DaemonProc {
        // The admin socket in the bed's directory: beds run side by side
        // and share the file system, so none may take /run/harvester-lb.
        let config = if config.contains("[admin]\n") && !config.contains("socket =") {
            let socket = format!("[admin]\nsocket = {:?}\n", self.dir.join("admin.sock"));
            config.replacen("[admin]\n", &socket, 1)
        } else {
            config.to_string()
        };
        let path = self.write("config.toml", &config);
        let d = spawn(&self.lb, &path, &self.dir.join("daemon.log"));
        self.daemon = Some(d);
        let d = self.daemon.as_ref().expect("just set");
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            if let Ok((200, _)) = d.get("/healthz").await {
                break;
            }
            assert!(
                Instant::now() < deadline,
                "daemon admin API did not answer within 10s; log:\n{}",
                d.log_tail(40)
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        d
    }

    /// The running daemon.
    pub fn daemon(&self) -> &DaemonProc {
        self.daemon.as_ref().expect("daemon started")
    }

    /// The running daemon, mutably (to wait for its exit).
    pub fn daemon_mut(&mut self) -> &mut DaemonProc {
        self.daemon.as_mut().expect("daemon started")
    }

    /// Takes the daemon out of the bed (to stop it by hand).
    pub fn take_daemon(&mut self) -> DaemonProc {
        self.daemon.take().expect("daemon started")
    }

    /// Writes a file into the scratch directory.
    pub fn write(&self, name: &str, text: &str) -> PathBuf {
        let p = self.dir.join(name);
        std::fs::write(&p, text).expect("write scratch file");
        p
    }
}

impl Drop for Bed {
    fn drop(&mut self) {
        if let Some(d) = self.daemon.take() {
            if std::thread::panicking() {
                eprintln!(
                    "--- daemon log of {} (last lines) ---\n{}",
                    self.tag,
                    d.log_tail(60)
                );
            }
            drop(d);
        }
        remove_bed(&self.created, &self.dir);
    }
}

/// The real daemon, running as a child process in the load-balancer
/// namespace: a [`Process`] (signals, exit, log; through `Deref`) with the
/// admin API reached inside the namespace.
pub struct DaemonProc {
    process: Process,
    /// Namespace it runs in (for the admin client).
    pub ns: Ns,
    /// The config file it was started with.
    pub config: PathBuf,
    /// Its `admin.listen` port on 127.0.0.1 in `ns` ([`ADMIN_PORT`]
    /// unless a test runs two daemons in one namespace).
    pub admin_port: u16,
}

impl std::ops::Deref for DaemonProc {
    type Target = Process;

    fn deref(&self) -> &Process {
        &self.process
    }
}

impl std::ops::DerefMut for DaemonProc {
    fn deref_mut(&mut self) -> &mut Process {
        &mut self.process
    }
}

impl DaemonProc {
    /// Starts the daemon in `ns` with `config`, logging to `log`. Beds
    /// start theirs with [`Bed::start_daemon`]; tests with several
    /// load-balancer hosts start the others with this.
    pub fn spawn(ns: &Ns, config: &Path, log: &Path, nofile: Option<u64>) -> DaemonProc {
        let mut launch = Process::launch(config)
            .under(&["ip", "netns", "exec", &ns.name])
            .env("HARVESTER_LB_LOG", "info")
            .log(log);
        if let Some(n) = nofile {
            launch = launch.nofile(n);
        }
        DaemonProc {
            process: launch.spawn(),
            ns: ns.clone(),
            config: config.to_path_buf(),
            admin_port: ADMIN_PORT,
        }
    }

    /// As [`DaemonProc::spawn`], watching its file as the shipped unit's
    /// daemon does (no `--no-watch`): a file written by `import --write`
    /// is reloaded with no signal (`tests/it/mgmt_vips.rs`).
    pub fn spawn_watching(ns: &Ns, config: &Path, log: &Path) -> DaemonProc {
        let process = Process::launch(config)
            .under(&["ip", "netns", "exec", &ns.name])
            .env("HARVESTER_LB_LOG", "info")
            .watch()
            .log(log)
            .spawn();
        let config = config.to_path_buf();
        let (ns, admin_port) = (ns.clone(), ADMIN_PORT);
        DaemonProc {
            process,
            ns,
            config,
            admin_port,
        }
    }

    /// As [`DaemonProc::spawn`], started by the fake file descriptor store
    /// `store` as the unit's next process (`NOTIFY_SOCKET`, the stored
    /// descriptors as `LISTEN_FDS`). `ip netns exec` execs its command
    /// without a fork (iproute2 forks only in batch mode), so the `$$` of
    /// the store's `sh -c` is the daemon's pid and `LISTEN_PID` matches.
    pub fn spawn_stored(
        ns: &Ns,
        config: &Path,
        log: &Path,
        store: &crate::support::fd_store::FakeStore,
    ) -> DaemonProc {
        let launch = Process::launch(config)
            .under(&["ip", "netns", "exec", &ns.name])
            .env("HARVESTER_LB_LOG", "info")
            .log(log);
        DaemonProc {
            process: store.launch(launch),
            ns: ns.clone(),
            config: config.to_path_buf(),
            admin_port: ADMIN_PORT,
        }
    }

    /// As [`DaemonProc::spawn`], with `bin` first in the daemon's `PATH`:
    /// a test's stand-in for a host command (an `nft` that refuses).
    pub fn spawn_with_path_first(ns: &Ns, config: &Path, log: &Path, bin: &Path) -> DaemonProc {
        let path = match std::env::var_os("PATH") {
            Some(p) => {
                let mut dirs = vec![bin.to_path_buf()];
                dirs.extend(std::env::split_paths(&p));
                std::env::join_paths(dirs).expect("a PATH")
            }
            None => bin.as_os_str().to_owned(),
        };
        let launch = Process::launch(config)
            .under(&["ip", "netns", "exec", &ns.name])
            .env("HARVESTER_LB_LOG", "info")
            .env("PATH", path)
            .log(log);
        DaemonProc {
            process: launch.spawn(),
            ns: ns.clone(),
            config: config.to_path_buf(),
            admin_port: ADMIN_PORT,
        }
    }

    /// The same daemon, its admin API asked on `port` (a second daemon in
    /// one namespace listens on another port).
    pub fn on_admin_port(mut self, port: u16) -> DaemonProc {
        self.admin_port = port;
        self
    }

    /// One HTTP request to the admin API: (status, body).
    pub async fn request(&self, method: &str, path: &str) -> std::io::Result<(u16, String)> {
        let addr = SocketAddr::from(([127, 0, 0, 1], self.admin_port));
        let mut s = self.ns.connect(addr, Duration::from_secs(2)).await?;
        let req = format!(
            "{method} {path} HTTP/1.1\r\nHost: admin\r\nContent-Length: 0\r\nConnection: close\r\n\r\n"
        );
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        s.write_all(req.as_bytes()).await?;
        let mut buf = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut buf))
            .await
            .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "admin read"))??;
        Ok(crate::support::split_response(&String::from_utf8_lossy(
            &buf,
        )))
    }

    /// `GET path`.
    pub async fn get(&self, path: &str) -> std::io::Result<(u16, String)> {
        self.request("GET", path).await
    }

    /// `/status` as JSON.
    pub async fn status(&self) -> serde_json::Value {
        let (code, body) = self.get("/status").await.expect("GET /status");
        assert_eq!(code, 200, "/status: {body}");
        serde_json::from_str(&body).expect("/status is JSON")
    }

    /// The `/status` entry of backend `ip` of load balancer `lb`.
    pub async fn backend(&self, lb: &str, ip: Ipv4Addr) -> serde_json::Value {
        backend_of(&self.status().await, lb, ip)
    }

    /// `/metrics` text.
    pub async fn metrics(&self) -> String {
        let (code, body) = self.get("/metrics").await.expect("GET /metrics");
        assert_eq!(code, 200);
        body
    }

    /// Polls `/status` until backend `ip` of `lb` has `health`; returns how long it took.
    pub async fn wait_health(
        &self,
        lb: &str,
        ip: Ipv4Addr,
        health: &str,
        timeout: Duration,
    ) -> Duration {
        let start = Instant::now();
        loop {
            let b = self.backend(lb, ip).await;
            if b["health"] == health {
                return start.elapsed();
            }
            assert!(
                start.elapsed() < timeout,
                "backend {ip} of {lb} not {health} within {timeout:?}: {b}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// The `/status` entry of backend `ip` of load balancer `lb`.
pub fn backend_of(status: &serde_json::Value, lb: &str, ip: Ipv4Addr) -> serde_json::Value {
    let lbs = status["load_balancers"].as_array().expect("load_balancers");
    let l = lbs
        .iter()
        .find(|l| l["name"] == lb)
        .unwrap_or_else(|| panic!("no load balancer {lb} in {status}"));
    l["backends"]
        .as_array()
        .expect("backends")
        .iter()
        .find(|b| b["address"] == ip.to_string())
        .unwrap_or_else(|| panic!("no backend {ip} in {l}"))
        .clone()
}

/// Sum of the samples of metric `name` whose labels include every `labels`
/// pair; fails the test if there is none (a renamed or missing series is
/// not a zero).
#[track_caller]
pub fn metric(text: &str, name: &str, labels: &[(&str, &str)]) -> f64 {
    let caller = std::panic::Location::caller();
    metric_sample(text, name, labels)
        .unwrap_or_else(|| crate::support::absent(caller, &format!("{name} {labels:?}"), text))
}

/// Sum of the samples of metric `name` whose labels include every `labels`
/// pair, `None` if there is none: for a series the daemon writes only once
/// it has happened (an outcome by its `reason`), or one a poll waits for.
pub fn metric_sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    crate::support::samples_sum(text, name, labels)
}

/// The bed's config: the admin API on `127.0.0.1:`[`ADMIN_PORT`] in the
/// daemon's namespace; a test adds its load balancers and keys with the one
/// builder of `tests/support` ([`Config`]).
pub fn config() -> Config {
    Config::new().admin(SocketAddr::new(Ipv4Addr::LOCALHOST.into(), ADMIN_PORT))
}

/// A load balancer `name` on `vip:80` (listener `tcp`) -> `nodes` (1-based)
/// at [`NODEPORT`], with no health check.
pub fn lb(name: &str, vip: impl std::fmt::Display, nodes: &[usize]) -> Lb {
    Lb::new(name, vip)
        .backends(nodes.iter().map(|i| node_ip(*i)))
        .tcp("tcp", 80, NODEPORT)
}

/// [`lb`] probed on [`HEALTH_PORT`], with the health-check keys `health`.
pub fn probed(name: &str, vip: impl std::fmt::Display, nodes: &[usize], health: &str) -> Lb {
    lb(name, vip, nodes).health_port(HEALTH_PORT).health(health)
}

/// Address `ip:port`.
pub fn sa(ip: Ipv4Addr, port: u16) -> SocketAddr {
    SocketAddr::new(IpAddr::V4(ip), port)
}

/// Reads a whole file, for reports.
pub fn read_to_string(p: &Path) -> String {
    let mut s = String::new();
    if let Ok(mut f) = std::fs::File::open(p) {
        let _ = f.read_to_string(&mut s);
    }
    s
}

/// A bare namespace of its own (no bed, no link), deleted on drop: for a
/// table written alone, or a client a test links in by hand.
pub struct Scratch(pub String);

impl Scratch {
    /// Namespace `hlb<pid>-<tag>`.
    pub fn new(tag: &str) -> Self {
        let name = format!("hlb{}-{tag}", std::process::id());
        run("ip", &["netns", "add", &name], None);
        Scratch(name)
    }

    /// The namespace, to run `ip` and sockets in.
    pub fn ns(&self) -> Ns {
        Ns {
            name: self.0.clone(),
        }
    }
}

impl Drop for Scratch {
    fn drop(&mut self) {
        let _ = Command::new("ip").args(["netns", "del", &self.0]).status();
    }
}

//! What the bench changes on the host beyond its own processes, and how it
//! is undone: the network namespace it runs in when it may
//! ([`private_netns`]), the kernel targets' nftables tables and the
//! conntrack sysctls they need. Each change is a guard that undoes it when dropped (so a panic
//! undoes it too) and is also written in a registry, which a signal thread
//! empties on SIGINT or SIGTERM (Ctrl-C ends a process without running its
//! destructors). The processes the bench starts are in it too, so a SIGTERM
//! to the bench alone stops them as [`crate::targets::Proc`]'s drop would.

use std::io::Write as _;
use std::process::{Command, Stdio};
use std::sync::Mutex;
use std::time::Duration;

use crate::scenarios::udp::DNS_PORT;
use crate::targets::{BACKEND_IP, HLB_KERNEL_IP, HTTP_PORT, IPERF_PORT, KERNEL_IP, Proc};
use crate::util::{signal, which};

/// One change to undo.
#[derive(Clone, PartialEq, Eq, Debug)]
enum Undo {
    /// `nft delete table ip NAME`.
    NftTable(&'static str),
    /// Write the old value back to the `/proc/sys` path.
    Sysctl(String, String),
    /// SIGTERM to a child we started and have not reaped.
    Stop(i32),
}

impl Undo {
    fn run(&self) {
        match self {
            Undo::NftTable(name) => {
                let ok = Command::new("nft")
                    .args(["delete", "table", "ip", name])
                    .stderr(Stdio::null())
                    .status()
                    .is_ok_and(|s| s.success());
                if !ok && nft_table_exists(name) {
                    eprintln!("WARNING: cannot delete nftables table ip {name}; delete it by hand");
                }
            }
            Undo::Sysctl(path, old) => {
                if let Err(e) = std::fs::write(path, old) {
                    eprintln!("WARNING: cannot restore {path} to {old}: {e}");
                }
            }
            Undo::Stop(pid) => signal(*pid, libc::SIGTERM),
        }
    }
}

/// Changes in force now, oldest first.
static IN_FORCE: Mutex<Vec<Undo>> = Mutex::new(Vec::new());

fn register(u: Undo) {
    IN_FORCE.lock().unwrap_or_else(|p| p.into_inner()).push(u);
}

/// Registers a child the signal thread must stop; [`forget_child`] when it
/// is being stopped (before it is reaped, so its pid cannot be reused while
/// registered).
pub fn track_child(pid: i32) {
    register(Undo::Stop(pid));
}

pub fn forget_child(pid: i32) {
    let mut reg = IN_FORCE.lock().unwrap_or_else(|p| p.into_inner());
    reg.retain(|u| *u != Undo::Stop(pid));
}

/// Undoes `u` and takes it out of the registry (if the signal thread has
/// not already undone it).
fn undo(u: &Undo) {
    let mut reg = IN_FORCE.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(i) = reg.iter().rposition(|x| x == u) {
        reg.remove(i);
        u.run();
    }
}

/// Starts the thread that takes SIGINT and SIGTERM: it undoes every change
/// in force (newest first) and exits 128 + the signal. Call first thing in
/// `main`. The handlers are tokio's (a self-pipe, no blocked signals), so
/// the children keep the default dispositions: exec resets handled signals,
/// whereas a blocked mask would be inherited and make them deaf to SIGTERM.
pub fn undo_on_signal() {
    use tokio::signal::unix::{SignalKind, signal};
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    // Registered here, before any change is made, not in the thread.
    let streams = {
        let _in_rt = rt.enter();
        [
            (libc::SIGINT, signal(SignalKind::interrupt())),
            (libc::SIGTERM, signal(SignalKind::terminate())),
        ]
    };
    let mut streams: Vec<_> = streams
        .into_iter()
        .filter_map(|(n, s)| match s {
            Ok(s) => Some((n, s)),
            Err(e) => {
                eprintln!("note: no handler for signal {n} ({e}); it would leave host changes");
                None
            }
        })
        .collect();
    if streams.is_empty() {
        return;
    }
    std::thread::spawn(move || {
        let sig = rt.block_on(async {
            let waits = streams.iter_mut().map(|(n, s)| {
                let n = *n;
                Box::pin(async move {
                    s.recv().await;
                    n
                })
            });
            futures_util::future::select_all(waits).await.0
        });
        let reg = std::mem::take(&mut *IN_FORCE.lock().unwrap_or_else(|p| p.into_inner()));
        for u in reg.iter().rev() {
            u.run();
        }
        eprintln!(
            "signal {sig}: {} process(es) stopped or host change(s) undone; exiting",
            reg.len()
        );
        std::process::exit(128 + sig);
    });
}

// ---------------------------------------------------------------------------
// The bench's own network namespace

/// Moves the bench (this thread, and so every process it starts later) into
/// a network namespace of its own, with `lo` up and the two kernel targets'
/// VIPs ([`KERNEL_IP`], [`HLB_KERNEL_IP`]) on it as /32s, and
/// `net.ipv4.ip_forward = 1` in it (the daemon serves kernel listeners only
/// where the host forwards; this namespace's value, not the host's).
///
/// Why: the daemon refuses a loopback VIP on a kernel listener, so both
/// kernel targets need a non-loopback VIP, which must not be added to the
/// host's own interfaces. In this namespace every target keeps the path it
/// had (clients on the same host, packets on `lo`; the kernel targets'
/// DNAT in the `output` hook), and nothing is left behind: an unnamed
/// namespace goes when its last process exits, on a panic, a Ctrl-C and a
/// SIGKILL alike. Its conntrack settings are its own too (except
/// `nf_conntrack_max`, which only the host's namespace may write).
///
/// Call first thing in `main`, before any thread is started (a thread keeps
/// the namespace it was started in). Err: not root, or the namespace could
/// not be made; the bench then runs where it is, without kernel targets.
pub fn private_netns() -> Result<(), String> {
    #[allow(unsafe_code)]
    // SAFETY: geteuid has no preconditions.
    let root = unsafe { libc::geteuid() } == 0;
    if !root {
        return Err(
            "not root: a network namespace and nftables need CAP_SYS_ADMIN and CAP_NET_ADMIN"
                .into(),
        );
    }
    if !which("ip") {
        return Err("ip missing (apt-get install iproute2)".into());
    }
    #[allow(unsafe_code)]
    // SAFETY: unshare(2) with a flag only changes this thread's namespace.
    let rc = unsafe { libc::unshare(libc::CLONE_NEWNET) };
    if rc != 0 {
        return Err(format!(
            "cannot make a network namespace: {}",
            std::io::Error::last_os_error()
        ));
    }
    let lo_up = ["link", "set", "lo", "up"].map(String::from).to_vec();
    let vip = |ip| {
        ["addr", "add", &format!("{ip}/32"), "dev", "lo"]
            .map(String::from)
            .to_vec()
    };
    for args in [lo_up, vip(KERNEL_IP), vip(HLB_KERNEL_IP)] {
        let out = Command::new("ip")
            .args(&args)
            .output()
            .map_err(|e| format!("ip: {e}"))?;
        if !out.status.success() {
            // Already in the namespace: the bench cannot go back, so
            // nothing it runs later may rely on these addresses.
            panic!(
                "ip {}: {}",
                args.join(" "),
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
    }
    std::fs::write("/proc/sys/net/ipv4/ip_forward", "1")
        .unwrap_or_else(|e| panic!("net.ipv4.ip_forward in the bench's namespace: {e}"));
    eprintln!(
        "running in a network namespace of its own (lo up, {KERNEL_IP} and {HLB_KERNEL_IP} on lo)"
    );
    Ok(())
}

// ---------------------------------------------------------------------------
// The kernel target: nftables DNAT

/// Our table's name; one of our own, so nothing else in the host's ruleset
/// is touched, and a stale one (a run killed with SIGKILL) is ours to delete.
const TABLE: &str = "hlb_bench_kernel";

fn nft_table_exists(name: &str) -> bool {
    Command::new("nft")
        .args(["list", "table", "ip", name])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// The rules, the way kube-proxy's nftables mode forwards a Service's
/// ClusterIP on the node itself (locally generated traffic): DNAT in the
/// `output` hook at priority -100 (dstnat). Loopback to loopback needs
/// nothing else: the rerouted packet stays on `lo` with the source the
/// route gave it (127.0.0.1), so `route_localnet` and a masquerade in
/// `postrouting` are not needed (checked on kernel 6.18); conntrack turns
/// the backend's answers back into the VIP's. The VIP is on `lo` of the
/// bench's namespace (not in 127.0.0.0/8, like harvester-lb (kernel)'s):
/// the rerouted packet keeps the VIP as its source and stays on `lo`.
/// UDP to the DNS port for the udp scenario.
fn ruleset() -> String {
    format!(
        "table ip {TABLE} {{\n  chain out {{\n    type nat hook output priority -100; policy accept;\n    ip daddr {KERNEL_IP} tcp dport {{ {IPERF_PORT}, {HTTP_PORT} }} dnat to {BACKEND_IP}\n    ip daddr {KERNEL_IP} udp dport {DNS_PORT} dnat to {BACKEND_IP}\n  }}\n}}\n"
    )
}

/// The kernel target's means: nft present and the right to use it. The
/// table itself exists only while a kernel run is in progress
/// ([`KernelDnat::install`]): its nat chain turns connection tracking on
/// for the whole network namespace, which would otherwise look up every
/// packet of the proxies' two legs too and make their runs dearer than
/// they were before the kernel target existed.
pub struct KernelDnat {
    _private: (),
}

/// The table in force; deleted when dropped.
pub struct DnatOn {
    undo: Undo,
}

impl Drop for DnatOn {
    fn drop(&mut self) {
        undo(&self.undo);
    }
}

impl KernelDnat {
    /// Whether the kernel target can run here; deletes a stale table of
    /// ours. Err says why not (not root, no nft, the table refused).
    pub fn prepare() -> Result<KernelDnat, String> {
        #[allow(unsafe_code)]
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        if !root {
            return Err("not root: nftables needs CAP_NET_ADMIN".into());
        }
        if !which("nft") {
            return Err("nft missing (apt-get install nftables)".into());
        }
        if nft_table_exists(TABLE) {
            eprintln!("note: deleting a stale nftables table ip {TABLE} of an earlier run");
            Undo::NftTable(TABLE).run();
        }
        // Checked by the kernel now (`nft --check`: the whole transaction,
        // not committed), so a kernel without nat support is found before
        // the first round rather than in it.
        nft_load(&ruleset(), true)?;
        Ok(KernelDnat { _private: () })
    }

    /// Puts the table in force and waits until `forwards` (given 5 s) says
    /// the kernel VIP reaches the backend, e.g. a connection through it
    /// completes; `what` names that in the error.
    pub fn install(
        &self,
        what: &str,
        forwards: impl FnOnce(Duration) -> bool,
    ) -> Result<DnatOn, String> {
        let on = nft_table(TABLE, &ruleset())?;
        if !forwards(Duration::from_secs(5)) {
            return Err(format!(
                "{KERNEL_IP} does not reach {BACKEND_IP} through the DNAT ({what})"
            ));
        }
        Ok(on)
    }
}

// ---------------------------------------------------------------------------
// harvester-lb (kernel): the daemon's own table

/// The daemon's NAT tables (`src/host/nat`), family inet: this name, and
/// this name and `_k` for the other shards.
const HLB_TABLE: &str = "harvester_lb_nat";

/// harvester-lb (kernel) in force for one run: the daemon, stopped when
/// dropped. A clean stop removes its table; one that is still there after
/// the stop (the daemon killed after 5 s) is deleted here, so no NAT hook
/// is left to turn conntrack on for the next target's run.
pub struct DaemonOn {
    proc: Option<Proc>,
}

impl DaemonOn {
    pub fn new(p: Proc) -> DaemonOn {
        DaemonOn { proc: Some(p) }
    }
}

impl Drop for DaemonOn {
    fn drop(&mut self) {
        drop(self.proc.take());
        let listed = Command::new("nft")
            .args(["list", "tables", "inet"])
            .stderr(Stdio::null())
            .output()
            .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
            .unwrap_or_default();
        for table in listed
            .split_whitespace()
            .filter(|t| t.starts_with(HLB_TABLE))
        {
            eprintln!(
                "WARNING: harvester-lb (kernel) left table inet {table} after its stop; deleting it"
            );
            let _ = Command::new("nft")
                .args(["delete", "table", "inet", table])
                .status();
        }
    }
}

/// A kernel target in force for one run (its table, or the daemon that
/// writes one); it stops forwarding when dropped.
pub enum KernelOn {
    /// Held for its drop.
    Table {
        _on: DnatOn,
    },
    Daemon {
        _on: DaemonOn,
    },
}

/// Loads `ruleset`, which makes the table `ip NAME` of the bench's own,
/// and returns it in force: deleted when dropped (and on SIGINT/SIGTERM).
pub fn nft_table(name: &'static str, ruleset: &str) -> Result<DnatOn, String> {
    if nft_table_exists(name) {
        Undo::NftTable(name).run();
    }
    nft_load(ruleset, false)?;
    let undo = Undo::NftTable(name);
    register(undo.clone());
    Ok(DnatOn { undo })
}

/// `nft -f -` of `ruleset`; with `check`, only checked (`nft -c`).
fn nft_load(ruleset: &str, check: bool) -> Result<(), String> {
    let mut cmd = Command::new("nft");
    if check {
        cmd.arg("-c");
    }
    let mut child = cmd
        .args(["-f", "-"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .map_err(|e| format!("nft: {e}"))?;
    child
        .stdin
        .take()
        .expect("nft stdin")
        .write_all(ruleset.as_bytes())
        .map_err(|e| format!("nft: {e}"))?;
    let out = child.wait_with_output().map_err(|e| format!("nft: {e}"))?;
    if !out.status.success() {
        return Err(format!(
            "nft -f refused the table: {}",
            String::from_utf8_lossy(&out.stderr).trim()
        ));
    }
    Ok(())
}

// ---------------------------------------------------------------------------
// Conntrack

const CT_MAX: &str = "/proc/sys/net/netfilter/nf_conntrack_max";
const CT_TIME_WAIT: &str = "/proc/sys/net/netfilter/nf_conntrack_tcp_timeout_time_wait";
const CT_COUNT: &str = "/proc/sys/net/netfilter/nf_conntrack_count";

/// A sysctl set for the run; the old value written back when dropped.
pub struct SysctlGuard {
    undo: Undo,
}

impl Drop for SysctlGuard {
    fn drop(&mut self) {
        undo(&self.undo);
    }
}

/// Sets the sysctl at `path` to `value` if `change(old)` says so; None when
/// it was left alone or could not be written (said on stderr: a container
/// may not own it).
fn set_sysctl(path: &str, change: impl Fn(u64) -> Option<u64>) -> Option<SysctlGuard> {
    let old = std::fs::read_to_string(path).ok()?.trim().to_string();
    let new = change(old.parse().ok()?)?;
    if let Err(e) = std::fs::write(path, new.to_string()) {
        eprintln!("note: cannot set {path} to {new} ({e}); leaving {old}");
        return None;
    }
    eprintln!("{path}: {old} -> {new} for this run");
    let undo = Undo::Sysctl(path.to_string(), old);
    register(undo.clone());
    Some(SysctlGuard { undo })
}

/// Room in the conntrack table for the new-connections runs of the kernel
/// targets. Every connection through the DNAT leaves an entry that lives
/// 120 s in TIME_WAIT after it closes; at ~20k connections/s a 5 s run
/// leaves ~100k, and with `--only cps` the next kernel run comes ~30 s
/// later, so four runs' entries would pass this 2-core host's default
/// nf_conntrack_max (262,144) and the kernel would drop SYNs, a cost of the
/// table's size rather than of forwarding. So for the run: TIME_WAIT
/// entries live 10 s (each run's are gone before the next kernel run), and
/// the maximum is at least 524,288 for a faster machine (40k/s over a run
/// plus 10 s). Both are written back on exit. In the bench's own namespace
/// ([`private_netns`]) the timeout is that namespace's, and the maximum,
/// the host's, cannot be written (a note says so): the 10 s alone keep runs
/// of 20k/s under the default (rate × 10 s, 200k entries at most), and conntrack's error
/// counters, read after each run, fail a run that lost a connection to it.
pub fn conntrack_room() -> Vec<SysctlGuard> {
    let mut g = Vec::new();
    g.extend(set_sysctl(CT_TIME_WAIT, |old| (old > 10).then_some(10)));
    g.extend(set_sysctl(CT_MAX, |old| (old < 524_288).then_some(524_288)));
    g
}

/// TIME_WAIT entries live `secs` seconds for the run (if they lived
/// longer); the old value is written back when dropped.
pub fn conntrack_time_wait(secs: u64) -> Option<SysctlGuard> {
    set_sysctl(CT_TIME_WAIT, |old| (old > secs).then_some(secs))
}

/// The conntrack entries of this namespace whose original destination is
/// `dst`:`dport` (TCP), from `/proc/net/nf_conntrack`; None when it
/// cannot be read (conntrack's procfs not built).
pub fn tracked_to(dst: std::net::Ipv4Addr, dport: u16) -> Option<usize> {
    let text = std::fs::read_to_string("/proc/net/nf_conntrack").ok()?;
    let (dst, dport) = (format!("dst={dst}"), format!("dport={dport}"));
    Some(
        text.lines()
            .filter(|l| {
                // The original direction's fields come first.
                let mut f = l.split_whitespace();
                f.find(|w| w.starts_with("dst=")).is_some_and(|w| w == dst)
                    && f.find(|w| w.starts_with("dport="))
                        .is_some_and(|w| w == dport)
            })
            .count(),
    )
}

/// Entries in the conntrack table now (0 when conntrack is not loaded).
pub fn conntrack_count() -> u64 {
    std::fs::read_to_string(CT_COUNT)
        .ok()
        .and_then(|s| s.trim().parse().ok())
        .unwrap_or(0)
}

/// Conntrack's error counters, summed over the CPUs, from
/// `/proc/net/stat/nf_conntrack`: a connection the table could not hold
/// (`drop`, `early_drop`) or insert (`insert_failed`) is a SYN lost.
#[derive(Clone, Copy, Default, Debug)]
pub struct CtErrors {
    pub insert_failed: u64,
    pub drop: u64,
    pub early_drop: u64,
}

impl CtErrors {
    pub fn read() -> CtErrors {
        let Ok(text) = std::fs::read_to_string("/proc/net/stat/nf_conntrack") else {
            return CtErrors::default();
        };
        let mut lines = text.lines();
        let Some(head) = lines.next() else {
            return CtErrors::default();
        };
        let col = |name: &str| head.split_whitespace().position(|c| c == name);
        let (fi, dr, ed) = (col("insert_failed"), col("drop"), col("early_drop"));
        let mut e = CtErrors::default();
        for line in lines {
            let f: Vec<u64> = line
                .split_whitespace()
                .map(|v| u64::from_str_radix(v, 16).unwrap_or(0))
                .collect();
            let get = |i: Option<usize>| i.and_then(|i| f.get(i)).copied().unwrap_or(0);
            e.insert_failed += get(fi);
            e.drop += get(dr);
            e.early_drop += get(ed);
        }
        e
    }

    /// What happened between `before` and `self`.
    pub fn since(self, before: CtErrors) -> CtErrors {
        CtErrors {
            insert_failed: self.insert_failed.saturating_sub(before.insert_failed),
            drop: self.drop.saturating_sub(before.drop),
            early_drop: self.early_drop.saturating_sub(before.early_drop),
        }
    }

    pub fn any(self) -> bool {
        self.insert_failed + self.drop + self.early_drop > 0
    }
}

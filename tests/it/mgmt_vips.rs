//! Management-network VIPs (load balancers on no `[[network]]`, Harvester's
//! default) over three load-balancer hosts, from `import` output alone: on
//! each host the shipped import unit's own pipeline (its `ExecStart`, a
//! stand-in `kubectl` answering with the test's Harvester objects) writes
//! the daemon's config from a `base.toml` carrying `[keepalived]`; the
//! daemon renders keepalived's file with the VIP on `keepalived.interface`
//! and nobody writes a keepalived line. The VIP comes up on exactly one
//! host and serves a client on the management network; a load balancer
//! added by the next import comes up the same way (the daemon's file watch
//! reloads, it renders and has keepalived reload); one removed by the next
//! import goes from every host; the master's daemon killed gives the VIP
//! to another host (the instance's track script asks the daemon about the
//! management VIP) and takes it back once started again; the master killed (its management link
//! cut, then its daemon and keepalived SIGKILLed: a dead host) gives its
//! VIP to exactly one other host, which serves it.
//!
//! ```text
//!  management (br1, 10.77.0.0/24): hosts h1, h2, h3 .1-.3 on their bridge
//!     mgmt-br (uplink into br1), the management client .100, VIPs .50, .51
//!  network A (br0, 198.51.100.0/24): backends n1 .21, n2 .22; the hosts'
//!     eth0 .4-.6 (a bridge with an uplink, as tests/it/netns/vmnet.rs builds)
//! ```
//!
//! Each host's management interface is a Linux bridge with an uplink into
//! the "switch" bridge and `br_netfilter` on, as Harvester's `mgmt-br`
//! (/work/shared/notes/harvester-host.md). Left out: the bridge's VLAN
//! filtering and the bond under the uplink (this kernel builds neither),
//! kernel listeners (their sync among three hosts is `[conntrackd]`'s, the
//! renders are unit-tested in `vip::conntrackd`), a gateway on the
//! management network (the client is on-link).
//!
//! Run as root with iproute2, nftables, keepalived and bash:
//! `cargo test --test it -- mgmt_vips:: --nocapture` (figures are printed as
//! `FIGURE`).

// These tests time real processes and sockets, not tokio timers.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

/// Issue 42's "Done when": management and VM-network VIPs over three
/// hosts with conntrackd, from the import alone, through each fault and a
/// management-link partition (`tests/it/mgmt_vips/cluster3.rs`).
mod cluster3;

use std::net::{Ipv4Addr, SocketAddr};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use harvester_lb::host::vmnet::keepalived::instance_of;
use netns::keepalived::{Keepalived, keepalived_missing};
use netns::peers::{Exchange, Node, Service, exchange};
use netns::vmnet::{
    bridged_host, count_vrrp_on, holds_on, ip_out, join_bridged, mgmt_port, vrrp_sent,
};
use netns::{Bed, DaemonProc, NODEPORT, Ns, node_ip, wait_for};

/// The hosts: name and management address (sorted: h1 is rank 0).
const HOSTS: [(&str, Ipv4Addr); 3] = [
    ("h1", Ipv4Addr::new(10, 77, 0, 1)),
    ("h2", Ipv4Addr::new(10, 77, 0, 2)),
    ("h3", Ipv4Addr::new(10, 77, 0, 3)),
];
/// The management interface on every host, as on a Harvester host.
const MGMT_IF: &str = "mgmt-br";
/// A client on the management network (an operator's machine).
const MGMT_CLIENT: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 100);
/// The first load balancer's VIP, then the second's.
const WEB: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 50);
const API: Ipv4Addr = Ipv4Addr::new(10, 77, 0, 51);

/// One load-balancer host.
struct Host {
    ns: Ns,
    name: &'static str,
    daemon: Option<DaemonProc>,
    keepalived: Option<Keepalived>,
}

/// The bed: three hosts, the management client, two backends.
struct Bed3 {
    // Dropped first: the processes, then the services, then the bed.
    hosts: Vec<Host>,
    _nodes: [Node; 2],
    client: Ns,
    /// The stand-in `kubectl`'s directory (first in the import's PATH).
    bin: PathBuf,
    /// What the stand-in `kubectl` answers (a List of objects).
    objects: PathBuf,
    bed: Bed,
}

impl Drop for Bed3 {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            return;
        }
        for h in &self.hosts {
            let daemon = h.daemon.as_ref().map(|d| d.log_tail(30));
            let keepalived = h.keepalived.as_ref().map(|k| k.log_tail(30));
            eprintln!(
                "--- host {}: daemon ---\n{}\n--- keepalived (newest first) ---\n{}",
                h.name,
                daemon.unwrap_or_default(),
                keepalived.unwrap_or_default()
            );
        }
    }
}

/// A Harvester `LoadBalancer` (v1beta1) `default/NAME` with its pool VIP
/// `vip`, no network (the management network's), listener 80 to the
/// nodes' [`NODEPORT`] on both backends.
fn lb_object(name: &str, vip: Ipv4Addr) -> serde_json::Value {
    serde_json::json!({
        "apiVersion": "loadbalancer.harvesterhci.io/v1beta1",
        "kind": "LoadBalancer",
        "metadata": {"name": name, "namespace": "default"},
        "spec": {
            "ipam": "pool",
            "listeners": [{"name": "http", "port": 80, "protocol": "TCP", "backendPort": NODEPORT}],
        },
        "status": {
            "allocatedAddress": {"ip": vip.to_string()},
            "backendServers": [node_ip(1).to_string(), node_ip(2).to_string()],
        },
    })
}

/// The shipped import unit's script (its `ExecStart`), with the test's
/// binary, base, config and temporary paths in place of the installed
/// ones (the unit has a private `/tmp`).
fn import_pipeline(base: &Path, config: &Path, tmp: &Path) -> String {
    let unit = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/systemd/harvester-lb-import.service"
    ))
    .expect("the import unit");
    let exec = unit
        .lines()
        .find_map(|l| l.strip_prefix("ExecStart=/bin/bash -e -c '"))
        .and_then(|l| l.strip_suffix('\''))
        .expect("the unit's ExecStart is a bash -e -c '...' script");
    // The unit's private /tmp first: the test's own paths are under /tmp.
    let mut cmd = exec.replace("/tmp/", &format!("{}/", tmp.display()));
    for (installed, here) in [
        (
            "/usr/local/bin/harvester-lb",
            env!("CARGO_BIN_EXE_harvester-lb").to_string(),
        ),
        ("/etc/harvester-lb/base.toml", base.display().to_string()),
        (
            "/etc/harvester-lb/config.toml",
            config.display().to_string(),
        ),
    ] {
        assert!(cmd.contains(installed), "{installed} not in {exec}");
        cmd = cmd.replace(installed, &here);
    }
    assert!(cmd.starts_with("kubectl get "), "{cmd}");
    cmd
}

/// Host `h`'s `base.toml`, the only file written by hand: its admin
/// socket, `[keepalived]` on `mgmt-br` with the other two hosts as peers,
/// adverts every 0.5 s and `keepalived` more lines of the section, then
/// the sections `more`. Its files are `dir/<what>-<host>` (keepalived's
/// pid file where [`Keepalived::run`] looks by default); the management
/// check's script is one of its own: the default, beside keepalived's
/// file, would be one file for the bed's three hosts, each naming its own
/// peers (a host pinging itself never faults).
fn base_toml(dir: &Path, h: usize, keepalived: &str, more: &str) -> String {
    let (name, address) = HOSTS[h];
    let peers: Vec<String> = HOSTS
        .iter()
        .filter(|(n, _)| *n != name)
        .map(|(_, a)| format!("\"{a}\""))
        .collect();
    let file = |what: &str| dir.join(format!("{what}-{name}")).display().to_string();
    format!(
        "[admin]\nsocket = \"{}\"\n\n[keepalived]\nname = \"{name}\"\naddress = \"{address}\"\ninterface = \"{MGMT_IF}\"\npeers = [{}]\nadvert_interval_ms = 500\nconfig_path = \"{}\"\npid_file = \"{}\"\nmanagement_check_script = \"{}\"\n{keepalived}\n{more}",
        file("admin.sock"),
        peers.join(", "),
        file("keepalived.conf"),
        dir.join(format!("keepalived-{name}.pid")).display(),
        file("mgmt-check"),
    )
}

/// The stand-in `kubectl` in `bin`: answers the import unit's `get ...
/// -o json` of IPPools with the List in `ippools` and any other `get ...
/// -o json` with the one in `objects` (as the cluster would, at the time
/// the import runs), refuses anything else.
fn stand_in_kubectl(bin: &Path, objects: &Path, ippools: &Path) {
    std::fs::create_dir_all(bin).expect("bin");
    let kubectl = bin.join("kubectl");
    std::fs::write(
        &kubectl,
        format!(
            "#!/bin/sh\ncase \"$1 $*\" in\n*ippools*) exec cat '{}' ;;\n\"get \"*\"-o json\"*) exec cat '{}' ;;\n*) echo \"stand-in kubectl: unexpected: $*\" >&2; exit 2 ;;\nesac\n",
            ippools.display(),
            objects.display()
        ),
    )
    .expect("kubectl");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&kubectl, std::fs::Permissions::from_mode(0o755)).expect("chmod");
}

/// Runs the import unit's pipeline in `ns` (the import checks VIPs and
/// interfaces against the host), as its timer would: the stand-in
/// `kubectl` of `bin` first in `PATH`, `import_args` as the unit's
/// `HARVESTER_LB_IMPORT_ARGS` (from `import.env`). Asserts it succeeded.
fn run_import(ns: &Ns, bin: &Path, base: &Path, config: &Path, tmp: &Path, import_args: &str) {
    std::fs::create_dir_all(tmp).expect("the import's temporary directory");
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.name, "env"])
        .arg(format!("PATH={path}"))
        .arg(format!("HARVESTER_LB_IMPORT_ARGS={import_args}"))
        .args(["/bin/bash", "-e", "-c"])
        .arg(import_pipeline(base, config, tmp))
        .output()
        .expect("run the import pipeline");
    let (code, _, stderr) = support::outcome(&out);
    assert_eq!(code, 0, "{}: import failed: {stderr}", ns.name);
}

impl Bed3 {
    fn new(test: &str) -> Bed3 {
        let mut bed = Bed::new(test, 2);
        let nodes = [
            Node::start(&bed, 1, Service::NameThenEcho),
            Node::start(&bed, 2, Service::NameThenEcho),
        ];
        bed.add_bridge("br1");
        let (client, _) = bed.add_host_on("br1", "mc", MGMT_CLIENT);
        let mut hosts = Vec::new();
        for (k, (name, mgmt)) in HOSTS.into_iter().enumerate() {
            let (ns, _) = bridged_host(&mut bed, name, Ipv4Addr::new(198, 51, 100, 4 + k as u8));
            join_bridged(
                &bed,
                &ns,
                "br1",
                &mgmt_port(name),
                (MGMT_IF, "mup"),
                &format!("{mgmt}/24"),
            );
            count_vrrp_on(&ns, MGMT_IF);
            hosts.push(Host {
                ns,
                name,
                daemon: None,
                keepalived: None,
            });
        }
        let bin = bed.dir.join("bin");
        let objects = bed.dir.join("objects.json");
        let ippools = bed.dir.join("ippools.json");
        std::fs::write(&ippools, r#"{"apiVersion":"v1","kind":"List","items":[]}"#)
            .expect("ippools");
        stand_in_kubectl(&bin, &objects, &ippools);
        Bed3 {
            hosts,
            _nodes: nodes,
            client,
            bin,
            objects,
            bed,
        }
    }

    fn file(&self, h: usize, what: &str) -> PathBuf {
        self.bed.dir.join(format!("{what}-{}", self.hosts[h].name))
    }

    /// Host `h`'s `base.toml` ([`base_toml`]).
    fn write_base(&self, h: usize) -> PathBuf {
        let path = self.file(h, "base.toml");
        std::fs::write(&path, base_toml(&self.bed.dir, h, "", "")).expect("base.toml");
        path
    }

    /// The objects the stand-in kubectl answers from now on: the
    /// management load balancers `lbs` (name, VIP).
    fn set_objects(&self, lbs: &[(&str, Ipv4Addr)]) {
        let items: Vec<serde_json::Value> = lbs.iter().map(|(n, v)| lb_object(n, *v)).collect();
        let list = serde_json::json!({"apiVersion": "v1", "kind": "List", "items": items});
        std::fs::write(&self.objects, list.to_string()).expect("objects");
    }

    /// Runs the import unit's pipeline on host `h` (in its namespace: the
    /// import checks VIPs against the host), as its timer would.
    fn import(&self, h: usize) -> PathBuf {
        let base = self.write_base(h);
        let config = self.file(h, "config.toml");
        let tmp = self.file(h, "tmp");
        run_import(&self.hosts[h].ns, &self.bin, &base, &config, &tmp, "");
        config
    }

    /// Imports on every host (each daemon's file watch reloads it).
    fn import_all(&self) {
        for h in 0..self.hosts.len() {
            self.import(h);
        }
    }

    /// Waits until every live host's daemon has written keepalived's file
    /// with (`present`) or without `vip` on the management interface.
    async fn rendered(&self, vip: Ipv4Addr, present: bool) {
        let line = format!("    {vip}/32 dev {MGMT_IF}\n");
        for h in self.live() {
            let conf = self.file(h, "keepalived.conf");
            wait_for(
                Duration::from_secs(30),
                &format!(
                    "host {}'s keepalived file {} {vip}",
                    self.hosts[h].name,
                    if present { "with" } else { "without" }
                ),
                || async {
                    let text = std::fs::read_to_string(&conf).unwrap_or_default();
                    (text.contains("vrrp_instance") && text.contains(&line) == present)
                        .then_some(())
                },
            )
            .await;
        }
    }

    /// Every host: import, the daemon on what it wrote, then keepalived.
    async fn start(&mut self) {
        for h in 0..self.hosts.len() {
            let config = self.import(h);
            let log = self.file(h, "daemon.log");
            self.hosts[h].daemon =
                Some(DaemonProc::spawn_watching(&self.hosts[h].ns, &config, &log));
        }
        self.rendered(WEB, true).await;
        for h in 0..self.hosts.len() {
            let k = Keepalived::run(
                &self.hosts[h].ns,
                &self.bed.dir,
                self.hosts[h].name,
                &self.file(h, "keepalived.conf"),
                None,
            );
            self.hosts[h].keepalived = Some(k);
        }
    }

    /// The hosts still running.
    fn live(&self) -> Vec<usize> {
        (0..self.hosts.len())
            .filter(|h| self.hosts[*h].daemon.is_some())
            .collect()
    }

    /// The live hosts holding `vip` on the management interface now.
    fn holders(&self, vip: Ipv4Addr) -> Vec<usize> {
        self.live()
            .into_iter()
            .filter(|h| holds_on(&self.hosts[*h].ns, MGMT_IF, &vip.to_string()))
            .collect()
    }

    /// Whether the management client is served through `vip:80` (a
    /// backend answers and echoes).
    async fn served(&self, vip: Ipv4Addr, within: Duration) -> bool {
        matches!(
            exchange(&self.client, SocketAddr::new(vip.into(), 80), 64, within).await,
            Exchange::Ok(name) if name.starts_with('n')
        )
    }

    /// Waits until exactly one live host holds `vip` and the management
    /// client is served through it; returns the holder.
    async fn up_on_one(&self, vip: Ipv4Addr, within: Duration) -> usize {
        wait_for(
            within,
            &format!("{vip} on exactly one host and served"),
            || async {
                let h = self.holders(vip);
                (h.len() == 1 && self.served(vip, Duration::from_secs(2)).await).then(|| h[0])
            },
        )
        .await
    }

    /// Waits until `vip` is held by its instance's preferred master alone
    /// (host *r* of the sorted addresses for the instances *i* with *i* mod
    /// 3 = *r*: `vip::keepalived::priority`) and served; returns it.
    async fn on_preferred(&self, vip: Ipv4Addr, within: Duration) -> usize {
        let preferred = usize::from(instance_of(vip.into(), 3) % 3);
        wait_for(
            within,
            &format!("{vip} on its preferred master"),
            || async {
                (self.holders(vip) == [preferred] && self.served(vip, Duration::from_secs(2)).await)
                    .then_some(preferred)
            },
        )
        .await
    }

    /// Host `h` dies: its management link cut first (no last advert
    /// leaves), then its daemon and keepalived (both processes) SIGKILLed.
    fn kill_host(&mut self, h: usize) {
        let name = self.hosts[h].name;
        self.bed.set_port(&mgmt_port(name), false);
        if let Some(d) = self.hosts[h].daemon.take() {
            d.signal(libc::SIGKILL);
            drop(d);
        }
        if let Some(k) = self.hosts[h].keepalived.take() {
            let vrrp = self.bed.dir.join(format!("keepalived-{name}-vrrp.pid"));
            let child = std::fs::read_to_string(vrrp)
                .ok()
                .and_then(|p| p.trim().parse::<i32>().ok());
            k.signal(libc::SIGKILL);
            if let Some(pid) = child {
                // SAFETY: kill(2) on keepalived's VRRP child, ours.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                }
            }
            drop(k);
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn netns_management_vips_from_import_alone_come_up_once_follow_imports_and_survive_a_dead_master()
 {
    require_netns!();
    if keepalived_missing() {
        return;
    }
    let mut t = Bed3::new("mgmtvip");

    // One load balancer on the management network: imported, rendered on
    // mgmt-br, up on exactly one host, served to the management client.
    t.set_objects(&[("web", WEB)]);
    let at = Instant::now();
    t.start().await;
    let holder = t.up_on_one(WEB, Duration::from_secs(60)).await;
    eprintln!(
        "FIGURE mgmt VIP {WEB} (imported, daemons and keepalived started) on host {} and served after {:.2} s",
        HOSTS[holder].0,
        at.elapsed().as_secs_f64()
    );
    let text = std::fs::read_to_string(t.file(0, "config.toml")).unwrap();
    assert!(
        text.contains("Generated by `harvester-lb import`") && !text.contains("network ="),
        "{text}"
    );

    // A second load balancer added by the next import: the daemons' file
    // watch reloads, the files are rendered anew, keepalived reloads, and
    // its VIP comes up on one host; the first stays where it was.
    t.set_objects(&[("web", WEB), ("api", API)]);
    let at = Instant::now();
    t.import_all();
    let api = t.up_on_one(API, Duration::from_secs(40)).await;
    eprintln!(
        "FIGURE mgmt VIP {API} added by an import: on host {} and served after {:.2} s",
        HOSTS[api].0,
        at.elapsed().as_secs_f64()
    );
    t.up_on_one(WEB, Duration::from_secs(30)).await;

    // One removed by the next import: its VIP leaves every host, the
    // other stays up.
    t.set_objects(&[("api", API)]);
    let at = Instant::now();
    t.import_all();
    t.rendered(WEB, false).await;
    wait_for(
        Duration::from_secs(30),
        "the removed VIP on no host",
        || async { t.holders(WEB).is_empty().then_some(()) },
    )
    .await;
    eprintln!(
        "FIGURE mgmt VIP {WEB} removed by an import: on no host after {:.2} s",
        at.elapsed().as_secs_f64()
    );
    assert!(
        !t.served(WEB, Duration::from_secs(2)).await,
        "the removed VIP is still served"
    );
    t.up_on_one(API, Duration::from_secs(30)).await;

    // The master's daemon killed: its instance's track script (which asks
    // the daemon about the management VIP as about a network's) fails, and
    // the VIP goes to exactly one other host. From the steady state: the VIP
    // on its instance's preferred master (keepalived preempts).
    let api = t.on_preferred(API, Duration::from_secs(60)).await;
    let at = Instant::now();
    t.hosts[api]
        .daemon
        .as_ref()
        .expect("daemon")
        .signal(libc::SIGKILL);
    let new = wait_for(
        Duration::from_secs(30),
        "the VIP leaves the host whose daemon was killed",
        || async {
            let h = t.holders(API);
            (h.len() == 1 && h[0] != api).then(|| h[0])
        },
    )
    .await;
    let moved = at.elapsed();
    wait_for(Duration::from_secs(30), "the VIP served again", || async {
        t.served(API, Duration::from_secs(2)).await.then_some(())
    })
    .await;
    eprintln!(
        "FIGURE mgmt VIP {API}: daemon of master {} killed: on host {} alone after {:.2} s, served after {:.2} s (track script interval 1 s, fall 2)",
        HOSTS[api].0,
        HOSTS[new].0,
        moved.as_secs_f64(),
        at.elapsed().as_secs_f64()
    );
    // Started again on the file it had: the VIP goes back (preempted).
    let d = t.hosts[api].daemon.take().expect("daemon");
    let config = d.config.clone();
    drop(d);
    let log = t.file(api, "daemon-again.log");
    t.hosts[api].daemon = Some(DaemonProc::spawn_watching(&t.hosts[api].ns, &config, &log));
    assert_eq!(t.on_preferred(API, Duration::from_secs(60)).await, api);

    // Adverts (sent by masters only) only ever went out of the management
    // interface.
    let on_mgmt: u64 = (0..3).map(|h| vrrp_sent(&t.hosts[h].ns, "mgmt")).sum();
    assert!(on_mgmt > 0, "no VRRP on mgmt-br");
    for (h, (name, _)) in HOSTS.iter().enumerate() {
        assert_eq!(vrrp_sent(&t.hosts[h].ns, "vm"), 0, "{name}: VRRP elsewhere");
    }

    // The master dies: exactly one other host takes the VIP and serves it.
    let at = Instant::now();
    t.kill_host(api);
    let moved = wait_for(
        Duration::from_secs(30),
        "the VIP on another host",
        || async { (!t.holders(API).is_empty()).then(|| at.elapsed()) },
    )
    .await;
    let new = t.up_on_one(API, Duration::from_secs(30)).await;
    let served = at.elapsed();
    assert_ne!(new, api);
    eprintln!(
        "FIGURE mgmt VIP {API}: master {} dead (link cut, daemon and keepalived SIGKILLed): on host {} after {:.2} s, served after {:.2} s (advert_int 0.5)",
        HOSTS[api].0,
        HOSTS[new].0,
        moved.as_secs_f64(),
        served.as_secs_f64()
    );
    // Still one holder a few adverts later (no second host claims it).
    let settle = Instant::now();
    while settle.elapsed() < Duration::from_secs(3) {
        assert_eq!(
            t.holders(API),
            [new],
            "{}",
            ip_out(&t.hosts[new].ns, &["addr"])
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
}

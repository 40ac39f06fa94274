//! The VM-network guard (`[[network]] isolate`): the filter of what enters
//! from VM networks, one nftables table that keeps a host with an interface
//! on tenants' VM networks from being a router between them. (Not to be
//! confused with `host::vip_guard`, which refuses VIPs the host uses, nor
//! with [`crate::host::isolation`], which filters traffic to the VIPs.)
//!
//! A Harvester host has `ip_forward` on (Kubernetes needs it), and once it
//! holds a VIP on a VM network its MAC answers there. Any VM of that
//! network can then send packets to the host with another network's
//! address as destination (a route `via VIP` is enough) and the host
//! forwards them: into another tenant's VM network, onto the management
//! network, or to its own services (SSH, the Kubernetes API, the kubelet)
//! on any of its addresses. For every `[[network]]` with `isolate` (the
//! default) the daemon owns the table `inet harvester_lb_vmnet`:
//!
//! ```text
//! table inet harvester_lb_vmnet {
//!   set networks { type ifname; elements = { "brA", "hlb…", … } }     # the isolated networks' interfaces
//!   set stay     { type ifname . ifname; elements = { "brA" . "brA", "hlb…" . "brA", "brA" . "hlb…", … } }
//!   set leases   { type ifname; elements = { "hlb…", … } }             # the lease macvlans among them
//!   map from_network { type ifname : verdict; elements = { "brA" : jump reverse_path_0, "hlb…" : jump reverse_path_0, … } }
//!   set dnat4    { type ifname . ipv4_addr . ipv4_addr . inet_proto . inet_service;
//!                  elements = { "brA" . VIP . BACKEND . tcp . BACKEND_PORT, … } }
//!   set open4    { type ifname . ipv4_addr . inet_proto . inet_service; elements = { "brA" . VIP . tcp . PORT, … } }
//!   set vips4    { type ifname . ipv4_addr; elements = { "brA" . VIP, … } }
//!   (and dnat6, open6, vips6)
//!   chain reverse_path_0 {                                 # one per network
//!     fib saddr oifname { "brA", "hlb…" } return           # its source routes back out of the network
//!     drop
//!   }
//!   chain prerouting { type filter hook prerouting priority raw; policy accept;
//!     iifname @networks fib daddr type local iifname vmap @from_network }
//!   chain forward { type filter hook forward priority filter; policy accept;
//!     iifname @networks jump from_network_forward }
//!   chain from_network_forward {
//!     iifname . oifname @stay accept                       # stays on its own network
//!     ct status dnat iifname . ct original ip daddr . ip daddr . meta l4proto . th dport @dnat4 accept
//!     (the same for IPv6)
//!     iifname vmap @from_network                           # the reverse path
//!     ct direction reply accept                            # replies of flows let in
//!     ct state related meta l4proto { icmp, ipv6-icmp } accept
//!     drop
//!   }
//!   chain input { type filter hook input priority filter; policy accept;
//!     iifname @networks jump from_network_input }
//!   chain from_network_input {
//!     iifname @leases udp sport 67 udp dport 68 accept     # the lease's DHCP server (broadcast: no flow)
//!     ct direction reply accept                            # the host's own connections (probes, the proxy)
//!     ct state related meta l4proto { icmp, ipv6-icmp } accept
//!     iifname . ip daddr . meta l4proto . th dport @open4 accept
//!     (the same for IPv6)
//!     icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept
//!     meta l4proto { icmp, ipv6-icmp } iifname . ip daddr @vips4 accept
//!     (the same for IPv6)
//!     drop
//!   }
//! }
//! ```
//!
//! Only packets that *enter* from an isolated network's interface are
//! looked at (`iifname @networks`); the host's management, storage and
//! other traffic never matches. A network's interfaces are its own (the
//! bridge or VLAN device of `[[network]] interface`) and the macvlan of
//! every VIP leased on it (`ipam = "dhcp"`, named `hlb` and its MAC, so
//! the set names it from the config on: before the link exists, and again
//! the moment it is made anew). A VM that sends its frames to a lease
//! macvlan's MAC address enters the host there and meets the same guard.
//! Forwarded, such a packet passes only when it stays on its own network,
//! answers a flow that was let in, or was DNATed from one of the network's
//! own VIPs to a backend of that VIP's load balancer (the kernel path,
//! `forwarding = "kernel"`). Addressed to the host, it passes only to the
//! network's own VIPs at their listener ports (and ICMP to those VIPs,
//! IPv6 neighbour discovery, the replies to the host's own connections:
//! health probes and the proxy's connections to backends on the network,
//! and on a lease macvlan its DHCP server's answers).
//!
//! **Reverse path.** A packet from an isolated network addressed to the
//! host (checked at `prerouting`, before DNAT, so a kernel listener's VIP
//! is still the destination), or forwarded other than within its network
//! or by a VIP's DNAT, must have a source that the host routes back out of
//! that network: `fib saddr oifname` (the route to the source, looked up
//! from the packet's destination, so a VIP's `from VIP lookup <table>`
//! rule applies and a client behind the network's gateway is the
//! network's) must be one of the network's interfaces, else the packet is
//! dropped. So a VM cannot forge the address of a peer the host talks to
//! (conntrackd's sync peer, the Kubernetes API) and have its datagram
//! taken for the reply direction of the host's flow. It is strict
//! reverse-path filtering for these interfaces alone, in the guard's table
//! rather than `rp_filter` (a host-wide setting Kubernetes hosts keep
//! loose). Packets to a broadcast or multicast address are not looked up
//! (a DHCP server's broadcast answer has no route to the lease yet).
//!
//! **Bridged frames.** VM-to-VM traffic on one VM network is switched by
//! the bridge and never reaches the IP stack, unless `br_netfilter` is
//! loaded with `net.bridge.bridge-nf-call-iptables = 1` — as it is on a
//! Harvester host (RKE2's CNI needs it). Then bridged IPv4 frames pass the
//! inet `forward` hook with `iifname` and `oifname` both the bridge; they
//! match `stay` and are accepted (they pass `prerouting` too, but their
//! destination is not the host's, so no reverse path is looked up: a VM
//! behind the network's gateway may talk to another VM on it). A VLAN network whose interface is a VLAN
//! device on the bridge (`mgmt-br.100`) never sees its bridged frames in the
//! guard: they enter on the bridge, not on the VLAN device.
//!
//! The table only drops; its `accept` ends its own chains, so a firewall's
//! table still applies. It is written whole in one `nft` transaction (the
//! same add/delete/create as `host::isolation`), at the first apply (replacing
//! what a crashed daemon left) and whenever its contents change, and read
//! back at every apply and every [`crate::host::owned::CHECK_INTERVAL`]; another
//! process's change is written over, logged at warn and counted
//! (`host_repairs_total{kind="vm_network_guard"}`). A reload without
//! isolated networks deletes it. A stop leaves it, as a crash does, so a
//! restart or an upgrade opens no window in which the host routes for
//! tenants; `nft delete table inet harvester_lb_vmnet` removes it after an
//! uninstall.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;
use std::net::IpAddr;
use std::sync::Mutex;
use std::time::SystemTime;

use crate::config::Config;
use crate::host::owned::{Checked, Drift, Fingerprint, Guard, Owned};
use crate::metrics::{HostKind, HostRepairs, Metrics};

/// The table's name, in family `inet`.
pub const TABLE: &str = "harvester_lb_vmnet";

/// What the table lets through, from the config in force.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Rules {
    /// Each isolated network's interfaces, by the network's own interface
    /// (its bridge or VLAN device): that interface and the macvlan of every
    /// VIP leased on it (`ipam = "dhcp"`), through each of which the
    /// network's packets enter the host.
    groups: BTreeMap<String, BTreeSet<String>>,
    /// The lease macvlans among them, whose DHCP client hears its server.
    leases: BTreeSet<String>,
    /// Interface, VIP, nft's protocol name, listener port.
    open: BTreeSet<(String, IpAddr, &'static str, u16)>,
    /// Interface, VIP, backend, nft's protocol name, backend port.
    dnat: BTreeSet<(String, IpAddr, IpAddr, &'static str, u16)>,
}

impl Rules {
    /// The guard of `config`: every `[[network]]` with `isolate`, each
    /// with its lease macvlans and the VIPs, listener ports and backends of
    /// its load balancers (those on the network, and those leased on its
    /// interface).
    pub fn of(config: &Config) -> Self {
        Self::with_legs(config, &BTreeSet::new())
    }

    /// [`Rules::of`], with the leg (`host::vmnet::leg`) of each network named in
    /// `legs` among its interfaces: a VM's frame to the leg's MAC address
    /// enters the host there and meets the same guard, and a flow routed
    /// out of it stays on its network. Named from the config on, as the
    /// lease macvlans are: before the link exists, and the moment it is
    /// made again.
    pub fn with_legs(config: &Config, legs: &BTreeSet<String>) -> Self {
        let mut r = Self::default();
        for net in config.networks.iter().filter(|n| n.isolate) {
            let group = r.groups.entry(net.interface.clone()).or_default();
            group.insert(net.interface.clone());
            if legs.contains(&net.name) {
                group.insert(crate::host::vmnet::leg::name_for(net.table));
            }
        }
        // A leased VIP's macvlan is named after its MAC address, so the set
        // holds it from the config on: before the link exists, and the
        // moment it is made again after a deletion.
        for lb in &config.load_balancers {
            if let Some(d) = &lb.dhcp
                && let Some(group) = r.groups.get_mut(&d.interface)
            {
                let name = crate::host::dhcp::link::name_for(d.mac);
                group.insert(name.clone());
                r.leases.insert(name);
            }
        }
        for lb in &config.load_balancers {
            let on_network = lb
                .network
                .as_deref()
                .and_then(|name| config.networks.iter().find(|n| n.name == name && n.isolate));
            let parent = on_network
                .map(|n| n.interface.as_str())
                .or_else(|| lb.dhcp.as_ref().map(|d| d.interface.as_str()));
            let Some(interfaces) = parent.and_then(|p| r.groups.get(p)).cloned() else {
                continue;
            };
            for interface in &interfaces {
                for l in &lb.listeners {
                    let proto = l.protocol.as_str();
                    r.open.insert((interface.clone(), lb.vip, proto, l.port));
                    for b in lb
                        .backends
                        .iter()
                        .filter(|b| b.is_ipv4() == lb.vip.is_ipv4())
                    {
                        r.dnat
                            .insert((interface.clone(), lb.vip, *b, proto, l.backend_port));
                    }
                }
            }
        }
        r
    }

    /// Whether no network is isolated (then there is no table).
    pub fn is_empty(&self) -> bool {
        self.groups.is_empty()
    }

    /// The isolated networks' interfaces, lease macvlans included.
    pub fn interfaces(&self) -> impl Iterator<Item = &str> {
        self.groups
            .values()
            .flatten()
            .collect::<BTreeSet<_>>()
            .into_iter()
            .map(String::as_str)
    }

    /// Interface, VIP pairs that answer ICMP.
    fn vips(&self) -> BTreeSet<(&str, IpAddr)> {
        self.open
            .iter()
            .map(|(i, vip, ..)| (i.as_str(), *vip))
            .collect()
    }

    /// The whole table as one `nft -f` transaction: create it if missing,
    /// delete it, and create it again with its sets, chains and rules.
    pub fn render(&self) -> String {
        let mut t =
            format!("add table inet {TABLE}\ndelete table inet {TABLE}\ntable inet {TABLE} {{\n");
        let quoted = |i: &str| format!("\"{i}\"");
        set(&mut t, "networks", "ifname", self.interfaces().map(quoted));
        // Within a network: each interface to itself, and its macvlans to
        // and from the network's own interface.
        let mut stay = BTreeSet::new();
        for (own, group) in &self.groups {
            for i in group {
                stay.insert((i, i));
                stay.insert((i, own));
                stay.insert((own, i));
            }
        }
        set(
            &mut t,
            "stay",
            "ifname . ifname",
            stay.iter()
                .map(|(a, b)| format!("{} . {}", quoted(a), quoted(b))),
        );
        set(
            &mut t,
            "leases",
            "ifname",
            self.leases.iter().map(|i| quoted(i)),
        );
        // Which network an interface's packets come from: its chain
        // `reverse_path_N`.
        let _ = write!(t, "  map from_network {{\n    type ifname : verdict\n");
        let jumps: Vec<String> = self
            .groups
            .values()
            .enumerate()
            .flat_map(|(n, group)| {
                group
                    .iter()
                    .map(move |i| format!("{} : jump reverse_path_{n}", quoted(i)))
            })
            .collect();
        if !jumps.is_empty() {
            let _ = writeln!(t, "    elements = {{ {} }}", jumps.join(", "));
        }
        t.push_str("  }\n");
        for (v6, family) in [(false, "ipv4_addr"), (true, "ipv6_addr")] {
            let n = if v6 { 6 } else { 4 };
            set(
                &mut t,
                &format!("dnat{n}"),
                &format!("ifname . {family} . {family} . inet_proto . inet_service"),
                self.dnat
                    .iter()
                    .filter(|(_, vip, ..)| vip.is_ipv6() == v6)
                    .map(|(i, vip, b, p, port)| {
                        format!("{} . {vip} . {b} . {p} . {port}", quoted(i))
                    }),
            );
            set(
                &mut t,
                &format!("open{n}"),
                &format!("ifname . {family} . inet_proto . inet_service"),
                self.open
                    .iter()
                    .filter(|(_, vip, ..)| vip.is_ipv6() == v6)
                    .map(|(i, vip, p, port)| format!("{} . {vip} . {p} . {port}", quoted(i))),
            );
            set(
                &mut t,
                &format!("vips{n}"),
                &format!("ifname . {family}"),
                self.vips()
                    .into_iter()
                    .filter(|(_, vip)| vip.is_ipv6() == v6)
                    .map(|(i, vip)| format!("{} . {vip}", quoted(i))),
            );
        }
        // The reverse path: a packet whose source the host would not route
        // back out of the network it came from (as the host routes it from
        // the packet's destination, so `from VIP lookup <table>` applies)
        // is not the network's.
        for (n, group) in self.groups.values().enumerate() {
            let names: Vec<String> = group.iter().map(|i| quoted(i)).collect();
            let _ = write!(
                t,
                "  chain reverse_path_{n} {{\n    fib saddr oifname {{ {} }} return\n    drop\n  }}\n",
                names.join(", ")
            );
        }
        // Before conntrack and DNAT: the destination is still the VIP.
        t.push_str(
            "  chain prerouting {\n    type filter hook prerouting priority raw; policy accept;\n    iifname @networks fib daddr type local iifname vmap @from_network\n  }\n",
        );
        t.push_str(
            "  chain forward {\n    type filter hook forward priority filter; policy accept;\n    iifname @networks jump from_network_forward\n  }\n",
        );
        t.push_str("  chain from_network_forward {\n");
        t.push_str("    iifname . oifname @stay accept\n");
        for ip in ["ip", "ip6"] {
            let n = if ip == "ip" { 4 } else { 6 };
            let _ = writeln!(
                t,
                "    ct status dnat iifname . ct original {ip} daddr . {ip} daddr . meta l4proto . th dport @dnat{n} accept"
            );
        }
        t.push_str("    iifname vmap @from_network\n");
        t.push_str("    ct direction reply accept\n");
        t.push_str("    ct state related meta l4proto { icmp, ipv6-icmp } accept\n");
        t.push_str("    drop\n  }\n");
        t.push_str(
            "  chain input {\n    type filter hook input priority filter; policy accept;\n    iifname @networks jump from_network_input\n  }\n",
        );
        t.push_str("  chain from_network_input {\n");
        t.push_str("    iifname @leases udp sport 67 udp dport 68 accept\n");
        t.push_str("    ct direction reply accept\n");
        t.push_str("    ct state related meta l4proto { icmp, ipv6-icmp } accept\n");
        for ip in ["ip", "ip6"] {
            let n = if ip == "ip" { 4 } else { 6 };
            let _ = writeln!(
                t,
                "    iifname . {ip} daddr . meta l4proto . th dport @open{n} accept"
            );
        }
        t.push_str("    icmpv6 type { nd-neighbor-solicit, nd-neighbor-advert } accept\n");
        for ip in ["ip", "ip6"] {
            let n = if ip == "ip" { 4 } else { 6 };
            let _ = writeln!(
                t,
                "    meta l4proto {{ icmp, ipv6-icmp }} iifname . {ip} daddr @vips{n} accept"
            );
        }
        t.push_str("    drop\n  }\n}\n");
        t
    }
}

/// One named set of the table, with its elements when it has any.
fn set(t: &mut String, name: &str, ty: &str, elements: impl Iterator<Item = String>) {
    let elements: Vec<String> = elements.collect();
    let _ = write!(t, "  set {name} {{\n    type {ty}\n");
    if !elements.is_empty() {
        let _ = writeln!(t, "    elements = {{ {} }}", elements.join(", "));
    }
    t.push_str("  }\n");
}

/// Why the table could not be written, read back or removed.
#[derive(Debug, thiserror::Error)]
#[error(
    "could not {what} the VM-network guard table inet {TABLE}: {detail} (it needs the `nft` command and CAP_NET_ADMIN; until it is in place the isolated networks' VIPs are not ready, /readyz?vip= answers 503)"
)]
pub struct GuardError {
    what: &'static str,
    detail: String,
}

/// The VM-network guard table as the daemon means it (its [`Rules`]), as an
/// [`Owned`] kernel object: how the [`crate::host::owned::Guard`] writes it whole
/// and reads it back.
struct VmnetFilterTable<'a>(&'a Rules);

impl Owned for VmnetFilterTable<'_> {
    const KIND: HostKind = HostKind::VmNetworkGuard;
    type Error = GuardError;
    fn read_back(&self) -> Result<Option<Fingerprint>, GuardError> {
        let fail = |detail: String| GuardError {
            what: "read back",
            detail,
        };
        match crate::host::nft::list_inet_table(TABLE).map_err(|e| fail(e.to_string()))? {
            Some(listed) => Fingerprint::of_nft_json(&listed)
                .map(Some)
                .map_err(|e| fail(e.to_string())),
            None => Ok(None),
        }
    }
    fn write(&self) -> Result<(), GuardError> {
        crate::host::nft::run(&["-f", "-"], self.0.render().as_bytes())
            .map(drop)
            .map_err(|e| GuardError {
                what: "write",
                detail: e.to_string(),
            })
    }
    fn identity(&self) -> Option<(&str, u64)> {
        Some((
            TABLE,
            crate::host::owned::adopt::digest(self.0.render().as_bytes()),
        ))
    }
}

/// Deletes the table if there is one.
fn delete() -> Result<(), GuardError> {
    // "add" first, so that deleting a table that is already gone succeeds.
    let text = format!("add table inet {TABLE}\ndelete table inet {TABLE}\n");
    crate::host::nft::run(&["-f", "-"], text.as_bytes())
        .map(drop)
        .map_err(|e| GuardError {
            what: "delete",
            detail: e.to_string(),
        })
}

/// What `/status` shows of the guard.
#[derive(Debug, Clone, serde::Serialize)]
pub struct GuardStatus {
    /// Whether any `[[network]]` is isolated.
    pub enabled: bool,
    /// `inet harvester_lb_vmnet`.
    pub table: String,
    /// Whether the table of the config in force is the kernel's (as last
    /// read back).
    pub in_force: bool,
    /// The isolated networks' interfaces.
    pub interfaces: Vec<String>,
    /// Unix time the table was last written.
    pub applied_unix: Option<u64>,
    /// The last failure, while it lasts.
    pub error: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    /// What the kernel has, as far as this process wrote it.
    applied: Option<Rules>,
    /// How the kernel listed it right after the write.
    guard: Guard,
    /// The last config's rules (for `/status` while not applied).
    wanted: Rules,
    applied_at: Option<SystemTime>,
    /// A table left by an earlier run has been dealt with.
    started: bool,
    error: Option<String>,
}

/// The daemon's side of the table: what it last wrote, writing it, and
/// checking that the kernel still has it.
#[derive(Debug)]
pub struct VmNetworkGuard {
    /// Held while `nft` runs.
    state: Mutex<State>,
    /// The outcome of the last step, read by readiness without waiting
    /// for `nft`.
    report: Mutex<GuardStatus>,
}

impl Default for VmNetworkGuard {
    fn default() -> Self {
        Self {
            state: Mutex::default(),
            report: Mutex::new(GuardStatus {
                enabled: false,
                table: format!("inet {TABLE}"),
                in_force: false,
                interfaces: Vec::new(),
                applied_unix: None,
                error: None,
            }),
        }
    }
}

impl VmNetworkGuard {
    /// Makes the kernel's table match `rules`: written whole when they
    /// changed (or at the first call, replacing a table a crashed daemon
    /// left), deleted when no network is isolated, else read back and
    /// written again if another process changed it. Records the outcome in
    /// `metrics` (`vm_network_guard_up`, failures, repairs). Blocking: it
    /// runs `nft`.
    pub fn reconcile(&self, rules: Rules, metrics: &Metrics) -> Result<(), GuardError> {
        let mut st = lock(&self.state);
        let result = Self::step(&mut st, rules, &metrics.host_repairs);
        st.error = result.as_ref().err().map(ToString::to_string);
        let enabled = !st.wanted.is_empty();
        *lock(&self.report) = GuardStatus {
            enabled,
            table: format!("inet {TABLE}"),
            in_force: enabled && st.applied.is_some() && st.error.is_none(),
            interfaces: st.wanted.interfaces().map(str::to_string).collect(),
            applied_unix: st
                .applied_at
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map(|d| d.as_secs()),
            error: st.error.clone(),
        };
        drop(st);
        metrics.set_vm_network_guard(enabled.then_some(result.is_ok()));
        match result {
            Ok(Some(drift)) => {
                tracing::warn!(
                    table = %format!("inet {TABLE}"),
                    "the VM-network guard table in the kernel is not the one this daemon wrote ({drift}): another process changed it (a second harvester-lb, `nft flush ruleset`, a firewall reload?); written again"
                );
                Ok(())
            }
            Ok(None) => Ok(()),
            Err(e) => {
                metrics.record_vm_network_guard_failure();
                Err(e)
            }
        }
    }

    fn step(
        st: &mut State,
        rules: Rules,
        repairs: &HostRepairs,
    ) -> Result<Option<Drift>, GuardError> {
        st.wanted = rules.clone();
        if rules.is_empty() {
            st.guard.forget();
            if st.applied.take().is_some() || !st.started {
                st.applied_at = None;
                delete()?;
            }
            st.started = true;
            return Ok(None);
        }
        st.started = true;
        if st.applied.as_ref() != Some(&rules) {
            st.applied = None;
            st.guard.write(&VmnetFilterTable(&rules))?;
            st.applied = Some(rules);
            st.applied_at = Some(SystemTime::now());
            return Ok(None);
        }
        match st.guard.check(&VmnetFilterTable(&rules), repairs) {
            Ok(Checked::Repaired(drift)) => {
                st.applied_at = Some(SystemTime::now());
                Ok(Some(drift))
            }
            Ok(Checked::InPlace) => Ok(None),
            Ok(Checked::NothingOwned) => {
                // Written, but gone before its read-back: written again.
                st.applied = None;
                st.guard.write(&VmnetFilterTable(&rules))?;
                st.applied = Some(rules);
                st.applied_at = Some(SystemTime::now());
                Ok(None)
            }
            Err(e) => {
                // Not known to be in place: written whole at the next step.
                st.applied = None;
                Err(e)
            }
        }
    }

    /// Whether traffic entering from `interface` (an isolated network's)
    /// is guarded: the last step wrote or read back a table in force that
    /// has it. `false` before the first step and after a reload adds the
    /// network until the next step has written it, so a VIP is never
    /// ready on a network its host does not guard yet.
    pub fn guards(&self, interface: &str) -> bool {
        let r = lock(&self.report);
        r.in_force && r.interfaces.iter().any(|i| i == interface)
    }

    /// For `/status`.
    pub fn status(&self) -> GuardStatus {
        lock(&self.report).clone()
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::test_fixtures::{lb, networks};

    /// Network "default/a" isolated with a load balancer of a TCP and a
    /// UDP listener, network "default/b" not, with one of its own.
    fn file() -> String {
        networks("", "interface = \"cluster-br.200\"\nisolate = false\n")
            + &lb(
                "default/web",
                "10.100.0.50",
                "default/a",
                &["10.100.0.21", "10.100.0.22"],
            )
            + "  [[load_balancer.listener]]\n  name = \"dns\"\n  port = 53\n  backend_port = 30053\n  protocol = \"udp\"\n"
            + &lb(
                "default/other",
                "10.200.0.50",
                "default/b",
                &["10.200.0.21"],
            )
    }

    #[test]
    fn only_isolated_networks_are_guarded_each_with_its_own_vips_and_backends() {
        let config = crate::config::parse(&file()).expect("valid").config;
        let r = Rules::of(&config);
        assert_eq!(r.interfaces().collect::<Vec<_>>(), ["cluster-br.100"]);
        let text = r.render();
        assert!(
            text.contains("elements = { \"cluster-br.100\" . 10.100.0.50 . tcp . 80, \"cluster-br.100\" . 10.100.0.50 . udp . 53 }"),
            "{text}"
        );
        assert!(
            text.contains("\"cluster-br.100\" . 10.100.0.50 . 10.100.0.22 . udp . 30053"),
            "{text}"
        );
        assert!(
            !text.contains("10.200.0."),
            "network b is not isolated: {text}"
        );
        assert!(text.contains("elements = { \"cluster-br.100\" . \"cluster-br.100\" }"));
        // Sets without elements have no elements line (nft refuses `{ }`).
        assert!(!text.contains("{  }") && !text.contains("{ }"), "{text}");

        let none = crate::config::parse(&file().replace(
            "gateway = \"10.100.0.1\"\n",
            "gateway = \"10.100.0.1\"\nisolate = false\n",
        ))
        .expect("valid")
        .config;
        assert!(Rules::of(&none).is_empty());
    }

    #[test]
    fn a_leased_vip_s_macvlan_belongs_to_its_network_s_guard() {
        let text = file()
            + "[[load_balancer]]\nname = \"default/leased\"\nvip = \"0.0.0.0\"\nipam = \"dhcp\"\nnetwork = \"default/a\"\nbackends = [\"10.100.0.21\"]\n  [load_balancer.dhcp]\n  mac = \"02:00:00:0a:0b:0c\"\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 8080\n  backend_port = 30080\n";
        let config = crate::config::parse(&text).expect("valid").config;
        let r = Rules::of(&config);
        assert_eq!(
            r.interfaces().collect::<Vec<_>>(),
            ["cluster-br.100", "hlb00000a0b0c"]
        );
        let t = r.render();
        for want in [
            "\"hlb00000a0b0c\" . \"cluster-br.100\"",
            "\"cluster-br.100\" . \"hlb00000a0b0c\"",
            "set leases {\n    type ifname\n    elements = { \"hlb00000a0b0c\" }",
            "\"hlb00000a0b0c\" : jump reverse_path_0",
            "fib saddr oifname { \"cluster-br.100\", \"hlb00000a0b0c\" } return",
            // The other VIPs of the network answer on the macvlan too (the
            // host answers ARP for any of its addresses on any interface).
            "\"hlb00000a0b0c\" . 10.100.0.50 . tcp . 80",
            "\"hlb00000a0b0c\" . 0.0.0.0 . tcp . 8080",
            "\"cluster-br.100\" . 0.0.0.0 . tcp . 8080",
        ] {
            assert!(t.contains(want), "{want} in {t}");
        }
    }

    #[test]
    fn an_isolated_network_is_guarded_only_once_its_table_is_in_force() {
        let config = crate::config::parse(&file()).expect("valid").config;
        let g = VmNetworkGuard::default();
        assert!(!g.guards("cluster-br.100"), "before the first step");
        let interfaces: Vec<String> = Rules::of(&config)
            .interfaces()
            .map(str::to_string)
            .collect();
        {
            let mut r = lock(&g.report);
            r.enabled = true;
            r.interfaces = interfaces;
        }
        assert!(!g.guards("cluster-br.100"), "not written yet");
        lock(&g.report).in_force = true;
        assert!(g.guards("cluster-br.100"));
        assert!(
            !g.guards("cluster-br.200"),
            "not in the table (not isolated)"
        );
    }
}

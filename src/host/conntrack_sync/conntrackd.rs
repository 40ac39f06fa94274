//! conntrackd's configuration and keepalived's notify script, rendered
//! from the daemon's own (`[conntrackd]`), so a kernel listener's open
//! connections survive their VIP's move to another keepalived host
//! (docs/vip.md, "Open connections across a VIP's move").
//!
//! Without `[keepalived]` (and with `vip.announce = "routes"`), the
//! **anycast mode** ([`anycast`]): the announcing hosts carry flows at
//! once and the router spreads each flow's packets and replies over all,
//! so conntrackd injects every flow into the others' kernel tables as it
//! changes (`DisableExternalCache On`), syncs the backends of announced
//! VIPs' kernel listeners ([`anycast_addresses`]), runs under its own
//! systemd unit (`Systemd on`), and has no notify script; the daemon's
//! guard table ([`anycast_table`]) drops the handshake packets that outrun
//! the sync instead of letting the local stack reset them.
//!
//! [`render_conf`] and [`render_script`] are pure. What they write, and why
//! (each fact measured in `notes/conntrackd-failover.md` and
//! `tests/it/conntrack_sync.rs`):
//!
//! - **FTFW over UDP unicast** to the one peer of two hosts on the sync
//!   link (`conntrackd.interface`, the management one by default): the
//!   reliable mode (acknowledged, resent). **NOTRACK over multicast**
//!   (`conntrackd.transport`) to a group every host joins, for three and
//!   more: a second `UDP` block is a redundant link, not a second peer
//!   (notes/conntrackd-three-hosts.md), and FTFW drops the messages of all
//!   senders but one (see `mode`). Socket buffers of 1.2 MB as conntrack-tools'
//!   examples; `PurgeTimeout` 15 s (default 60): how long `-t` leaves the
//!   entries of a host that lost its VIPs.
//! - **Only our kernel listeners' flows**: `Filter From Userspace {
//!   Address Accept { backends } }`. conntrackd matches the original source
//!   and the *reply* source, which for a DNATed flow is the real backend,
//!   never the VIP; so the backends' addresses select exactly the flows
//!   our NAT made (listing the VIP under `Ignore`, as the shipped example
//!   does, excludes nothing). TCP and UDP only.
//! - **`HashSize` above 8192** (see `config::MIN_HASH_SIZE`), `Systemd on`
//!   (Debian's `conntrackd.service` is `Type=notify`: with `off` its start
//!   waits for a `READY=1` that never comes and fails; outside systemd, with
//!   no `NOTIFY_SOCKET`, `on` does nothing), its own `LockFile`, `UNIX { Path }` and
//!   `LogFile`, so two conntrackd on one machine (tests) never meet, and
//!   **`-C FILE` on every control call**: without it conntrackd talks to
//!   the default socket, maybe another one's.
//!
//! The notify script is conntrack-tools' primary/backup recipe with the
//! gate (`host::conntrack_sync::gate`) closing the race the recipe leaves: keepalived adds
//! the VIP and sends its gratuitous ARPs *before* it runs the script, so a
//! packet can reach the new master before `conntrackd -c` committed its
//! flow; conntrack would pick it up mid-stream and the NAT choose anew (a
//! wrong backend: a reset), or a backend's packet would create a reverse
//! entry that remaps the committed one's port. The gate drops `ct state
//! new` to the instance's VIPs and from their backends while closed; the
//! script opens it right after the commit. A failback is the same
//! transition on the other host.
//!
//! - master: under the host's lock, delete this host's entries of the
//!   instance's VIPs, `-c` (commit the external cache), open the gate,
//!   `-f`, `-R`, `-B` (the recipe), then `-n` (the peer may be master of
//!   other instances: `-f` emptied our copy of its flows, `-n` asks for it
//!   again); then the delayed tidy;
//! - backup: close the gate, start conntrackd if it does not answer, `-n`,
//!   the delayed tidy;
//! - fault, stop: close the gate, the delayed tidy.
//!
//! The tidy, [`PURGE_S`] after any transition, under the host's lock
//! (`state_directory/.conntrackd.lock`, which every commit takes too):
//! this host's entries of the flows of every instance whose recorded
//! state is not `MASTER` are deleted *without conntrackd telling its
//! peers*: `-f internal` first (conntrackd sends a flow's end only for
//! what its internal cache holds), the deletions, then `-R`, which fills
//! the internal cache again from what is left (the flows this host
//! carries) and sends those to the peers anew; then `-n`, asking the
//! peers for their flows again (a transition's own `-n` is answered once,
//! over a sync that does not resend, and a peer tidying at that moment
//! answers half: measured, a host back from a link cut held none of a
//! third host's flows, in 2 of 3 runs, until the next `-n`). Among three hosts the
//! deletions, sent, took from the third host's cache the flows it needs
//! to take a VIP over: the former master's entries of the flows it gave
//! back, and the copies a commit makes of every instance's flows (`-c`
//! commits the whole external cache; at a host's start its first backup
//! transition's deletion came due right after a commit of another
//! instance). Measured in `tests/it/mgmt_vips/cluster3.rs`: external caches
//! of [2, 54, 4] entries where 96 were wanted, after a graceful stop and
//! its failback, in 2 of 2 runs; the next fault reset every connection of
//! the VIPs it moved. With the tidy, none short in 14 runs.
//!
//! keepalived starts the script at each transition without waiting for
//! the previous one to end, so the transitions of one instance take a
//! lock (`flock` on `state_directory/.<vrid>.lock`), a script that finds a
//! later transition already done exits (ordered by the time since boot,
//! `/proc/uptime`, and the boot id: a step of the wall clock cannot make a
//! new transition look old), and each transition is recorded
//! (with a sequence number) *before* anything is done. The tidy takes the
//! host's lock, which a takeover holds from its deletion to its commit's
//! end, and leaves alone every instance recorded `MASTER`: a takeover
//! that began is left alone, one waiting for the lock deletes and commits
//! after the tidy. Without that, a deletion scheduled at an earlier
//! backup transition (a host's start) that came due while a later
//! takeover was committing deleted the flows just committed (measured: 0
//! of 20 kept, in the failback after a killed host whenever it came 15 s
//! after that host's first start, and the failover of a link cut the same
//! way on the other host).
//!
//! Not the recipe's `-t`: it schedules a purge of *every* synced entry
//! `PurgeTimeout` later, which kills the flows a failback committed within
//! that time (a host back after a kill takes its VIP again 2 s after its
//! backup transition) and, with masters spread over the hosts, the flows
//! of the instances this host still carries. The entries of the
//! instances this host left are deleted instead (`conntrack -D
//! --orig-dst VIP`, the tidy): left there, their TCP windows fall behind
//! while another host carries the flows, and when the VIP comes back the
//! moved packets are invalid, reach the local stack and are reset
//! (measured: 20 of 20 lost at a failback). Not at once: the peer commits
//! first, and a commit's events must have reached conntrackd before its
//! internal cache is emptied. They are deleted again right before the
//! commit, for a host killed without a transition; and the gate drops
//! `invalid` as well as `new` while closed. Each transition is recorded
//! in `state_directory/<vrid>` (state, time, the commit's result and
//! duration, the commits' counts) for the daemon's `/status` and metrics.

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr};
use std::path::Path;

use crate::config::{Config, ConntrackdSettings, Forwarding, Protocol, SyncTransport};

/// How long after leaving master the notify script deletes this host's
/// entries of the instance's flows: the peer has committed them by then
/// (the recipe's `PurgeTimeout`). A later transition cancels it.
pub const PURGE_S: u32 = 15;

/// The nftables table of the gates (family `inet`).
pub const GATE_TABLE: &str = "harvester_lb_gate";

/// The gate chain of VRRP instance `vrid`: a `ct state { invalid, new } drop` rule while
/// closed, empty while open.
pub fn gate_chain(vrid: u32) -> String {
    format!("g_{vrid}")
}

/// How long a returning host waits before it takes an instance back
/// from a lower-priority master (keepalived's `preempt_delay`, with
/// `[conntrackd]`): its backup transition's script closes the instance's
/// gate meanwhile. keepalived adds the VIP and sends its gratuitous ARPs
/// before the master transition's script runs, so the gate must already
/// be closed then; a host whose keepalived was killed kept its gates as
/// they were (a master's open) and its entries of the flows it carried,
/// now stale. Without the delay a host back after a kill took its VIP
/// over 0.8 s after its backup transition began, 60 ms before that
/// script had closed the gate (at load 15), and the moved packets,
/// invalid against the stale entries, reached the local stack and were
/// reset: 20 of 20 connections, in 2 of 8 runs of the failback after a
/// kill (`tests/it/conntrack_sync.rs`). A failover (the master gone) is
/// not a preemption and does not wait.
pub const PREEMPT_DELAY_S: u32 = 3;

/// keepalived's `preempt_delay` line for an instance with `[conntrackd]`
/// (see [`PREEMPT_DELAY_S`]); empty without it.
pub fn preempt_line(config: &Config) -> String {
    if config.conntrackd.is_some() && !anycast(config) {
        format!("  preempt_delay {PREEMPT_DELAY_S}\n")
    } else {
        String::new()
    }
}

/// The lines keepalived's rendered instances carry with `[conntrackd]`
/// (empty without it): the notify script, run at every transition, and
/// `track_interface` on the interfaces the instance's VIPs live on
/// (`interfaces`). Without it a master that lost its network stays master
/// (VRRP runs on the management one) and never transitions: when it comes
/// back, the flows that moved meet its stale conntrack entries (their TCP
/// windows are behind; the kernel marks the packets invalid) and are reset.
/// With it the master goes to FAULT, closes its gates, and takes the VIP
/// back later through a commit like any failback.
pub fn notify_line(config: &Config, interfaces: &[&str]) -> String {
    let Some(c) = &config.conntrackd else {
        return String::new();
    };
    let mut out = format!("  notify \"{}\"\n", c.notify_script.display());
    let mut seen: Vec<&str> = interfaces.to_vec();
    seen.sort_unstable();
    seen.dedup();
    if !seen.is_empty() {
        out.push_str("  track_interface {\n");
        for i in seen {
            let _ = writeln!(out, "    {i}");
        }
        out.push_str("  }\n");
    }
    out
}

/// The VRRP instance name keepalived's rendered file gives `vrid`.
pub fn instance_name(vrid: u32) -> String {
    format!("hlb_{vrid}")
}

/// One kernel listener on a VIP keepalived moves: what the gate matches.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
pub struct Gated {
    /// The VRRP instance the VIP is in (`virtual_router_id`).
    pub vrid: u32,
    /// The VIP (IPv4, or IPv6: an IPv6 VIP rides in an instance of IPv4
    /// VIPs, see [`crate::host::vmnet::keepalived::vrid_by_vip`]).
    pub vip: IpAddr,
    /// TCP or UDP.
    pub protocol: Protocol,
    /// The VIP's port.
    pub port: u16,
    /// The backends of the VIP's family (a kernel listener has no other:
    /// `check` refuses them).
    pub backends: Vec<IpAddr>,
    /// The backends' port.
    pub backend_port: u16,
}

/// Every kernel listener of a load balancer whose VIP the rendered
/// keepalived moves (on a `[[network]]`, or a management VIP on
/// `keepalived.interface`: its flows survive a move the same way), of
/// either family, each in the instance the rendered file puts it in, in a
/// stable order.
pub fn gated(config: &Config) -> Vec<Gated> {
    let vrid_of = crate::host::vmnet::keepalived::vrid_by_vip(config);
    let mut out = Vec::new();
    for lb in &config.load_balancers {
        let Some(&vrid) = config.keepalived_interface(lb).and(vrid_of.get(&lb.vip)) else {
            continue;
        };
        let vip = lb.vip;
        let backends: Vec<IpAddr> = lb
            .backends
            .iter()
            .filter(|b| b.is_ipv4() == vip.is_ipv4())
            .copied()
            .collect();
        for l in lb
            .listeners
            .iter()
            .filter(|l| l.forwarding == Forwarding::Kernel)
        {
            out.push(Gated {
                vrid,
                vip,
                protocol: l.protocol,
                port: l.port,
                backends: backends.clone(),
                backend_port: l.backend_port,
            });
        }
    }
    out.sort();
    out.dedup();
    out
}

/// Every VRRP instance keepalived's rendered file has (its VIDs), whether
/// or not a kernel listener is in it: the notify script runs for each.
pub fn vrids(config: &Config) -> Vec<u32> {
    let Some(k) = &config.keepalived else {
        return Vec::new();
    };
    let mut v: Vec<u32> = config
        .load_balancers
        .iter()
        .filter(|lb| config.keepalived_interface(lb).is_some() && lb.vip.is_ipv4())
        .map(|lb| {
            u32::from(k.vrid_base)
                + u32::from(crate::host::vmnet::keepalived::instance_of(
                    lb.vip,
                    k.instances,
                ))
        })
        .collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The addresses conntrackd's filter accepts: every backend of a kernel
/// listener on a moving VIP, IPv4 and IPv6, sorted (IPv4 first).
pub fn filter_addresses(config: &Config) -> Vec<IpAddr> {
    let mut a: Vec<IpAddr> = gated(config).into_iter().flat_map(|g| g.backends).collect();
    a.sort_unstable();
    a.dedup();
    a
}

/// The anycast mode's lines in its `Mode` block ([`sync_mode`]): every
/// flow's state, as it changes, goes straight into the other hosts' kernel
/// tables (conntrack-tools' Active-Active setup), not into an external
/// cache waiting for a commit; injected TCP entries are marked liberal (no
/// window tracking) by conntrackd itself. No `DisableInternalCache`: FTFW
/// needs the internal cache to resend what a peer missed, and both modes
/// answer a restarted host's resync (`StartupResync`) from it.
const ANYCAST_FTFW: &str = "\t\t# Anycast: every host carries flows and the router spreads their packets,\n\
     \t\t# so each flow's state is injected into the other hosts' kernel tables at once.\n\
     \t\tDisableExternalCache On\n";

/// Whether `[conntrackd]` runs in the anycast mode (no `[keepalived]`: its
/// validation requires `vip.announce = "routes"` then): both hosts hold
/// every synced flow in their kernel tables all the time, nothing is
/// committed, no notify script and no gate exist, and conntrackd runs
/// under its own systemd unit (`Systemd on`; docs/many-hosts.md,
/// "Keeping connections across a withdrawal").
pub fn anycast(config: &Config) -> bool {
    config.conntrackd.is_some() && config.keepalived.is_none()
}

/// The addresses the anycast mode's filter accepts: every IPv4 backend of
/// a kernel listener whose IPv4 VIP is announced (inside
/// `vip.announce_prefixes`, on no `[[network]]`), sorted.
pub fn anycast_addresses(config: &Config) -> Vec<Ipv4Addr> {
    let announce = &config.vip.announce;
    let mut a: Vec<Ipv4Addr> = config
        .load_balancers
        .iter()
        .filter(|lb| {
            lb.network.is_none()
                && lb.vip.is_ipv4()
                && announce.enabled()
                && announce.allows(lb.vip)
                && lb
                    .listeners
                    .iter()
                    .any(|l| l.forwarding == Forwarding::Kernel)
        })
        .flat_map(|lb| lb.backends.iter())
        .filter_map(|b| match b {
            IpAddr::V4(v4) => Some(*v4),
            IpAddr::V6(_) => None,
        })
        .collect();
    a.sort_unstable();
    a.dedup();
    a
}

/// The nftables table of the anycast mode's guard (family `inet`).
pub const ANYCAST_TABLE: &str = "harvester_lb_anycast_sync";

/// The anycast mode's guard: an nft script (the whole table, replaced
/// atomically) that drops, after conntrack and before the NAT (priority
/// -150, as the gate), a client's packet to a kernel listener of an
/// announced VIP that conntrack finds `invalid`, and a backend's packet
/// from its service port that conntrack finds `invalid` or `new`; `None`
/// outside the anycast mode.
///
/// Why: the router hashes a flow's replies independently of its forward
/// packets, so a reply can reach the other host before conntrackd has
/// injected the flow there (a SYN-ACK at a host with no entry is
/// `invalid`; a backend's mid-stream segment would be picked up as a
/// `new` reverse flow that later clashes with the injected one), and a
/// client's ACK can reach the first host before the other host's state
/// change came back (`invalid` in SYN_SENT). Unguarded, each goes to the
/// local stack, which answers with a reset; dropped, TCP resends it, and
/// by then the state is there (measured: docs/many-hosts.md).
pub fn anycast_table(config: &Config) -> Option<String> {
    if !anycast(config) {
        return None;
    }
    let announce = &config.vip.announce;
    let mut to = std::collections::BTreeSet::new();
    let mut from = std::collections::BTreeSet::new();
    for lb in &config.load_balancers {
        let IpAddr::V4(vip) = lb.vip else { continue };
        if lb.network.is_some() || !announce.enabled() || !announce.allows(lb.vip) {
            continue;
        }
        for l in lb
            .listeners
            .iter()
            .filter(|l| l.forwarding == Forwarding::Kernel)
        {
            let proto = l.protocol.as_str();
            to.insert(format!("{vip} . {proto} . {}", l.port));
            for b in &lb.backends {
                if let IpAddr::V4(b) = b {
                    from.insert(format!("{b} . {proto} . {}", l.backend_port));
                }
            }
        }
    }
    let mut s = format!(
        "add table inet {ANYCAST_TABLE}\ndelete table inet {ANYCAST_TABLE}\ntable inet {ANYCAST_TABLE} {{\n"
    );
    for (name, elems) in [("to4", &to), ("from4", &from)] {
        let _ = write!(
            s,
            "  set {name} {{\n    type ipv4_addr . inet_proto . inet_service\n"
        );
        if !elems.is_empty() {
            let list: Vec<&str> = elems.iter().map(String::as_str).collect();
            let _ = writeln!(s, "    elements = {{ {} }}", list.join(", "));
        }
        s.push_str("  }\n");
    }
    s.push_str(
        "  chain prerouting {\n    type filter hook prerouting priority -150; policy accept;\n    ip daddr . meta l4proto . th dport @to4 ct state invalid drop\n    ip saddr . meta l4proto . th sport @from4 ct state { invalid, new } drop\n  }\n}\n",
    );
    Some(s)
}

/// The anycast guard table as an owned object: the script of
/// [`anycast_table`], read back and repaired through
/// [`crate::host::owned::Guard`] like every table the daemon writes (another
/// program's `nft flush ruleset` would otherwise leave the handshakes
/// unguarded until the next change).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AnycastGuard {
    /// The whole table's nft script.
    pub script: String,
}

/// Why the anycast guard table could not be read or written.
#[derive(Debug, thiserror::Error)]
#[error(
    "the anycast sync's guard table inet {ANYCAST_TABLE}: {0} (needs the `nft` command and CAP_NET_ADMIN; without it a reply that reaches this host before its flow's state resets the flow)"
)]
pub struct AnycastGuardError(String);

impl AnycastGuardError {
    /// The guard's error for what failed (`nft`, or reading its listing).
    fn of(failed: impl std::error::Error) -> Self {
        Self(failed.to_string())
    }
}

impl crate::host::owned::Owned for AnycastGuard {
    const KIND: crate::metrics::HostKind = crate::metrics::HostKind::AnycastSyncGuard;
    type Error = AnycastGuardError;

    fn read_back(&self) -> Result<Option<crate::host::owned::Fingerprint>, AnycastGuardError> {
        match crate::host::nft::list_inet_table(ANYCAST_TABLE).map_err(AnycastGuardError::of)? {
            None => Ok(None),
            Some(listed) => crate::host::owned::Fingerprint::of_nft_json(&listed)
                .map(Some)
                .map_err(AnycastGuardError::of),
        }
    }

    fn write(&self) -> Result<(), AnycastGuardError> {
        crate::host::nft::run(&["-f", "-"], self.script.as_bytes())
            .map(drop)
            .map_err(AnycastGuardError::of)
    }

    fn identity(&self) -> Option<(&str, u64)> {
        Some((
            ANYCAST_TABLE,
            crate::host::owned::adopt::digest(self.script.as_bytes()),
        ))
    }
}

/// The conntrackd.conf text for `config`; `None` without `[conntrackd]`.
pub fn render_conf(config: &Config) -> Option<String> {
    let c = config.conntrackd.as_ref()?;
    let mut out = String::new();
    let _ = write!(
        out,
        "# Written by harvester-lb from its configuration; edits are overwritten.\n\
         # {doc}. conntrackd reads it\n\
         # only at start: control it with `conntrackd -C {conf} ...`.\n\
         Sync {{\n\
         \tMode {mode} {{\n\
         \t\tPurgeTimeout 15\n\
         \t\tStartupResync on\n\
         {anycast_ftfw}\
         \t}}\n\
         {transport}\
         \t\tInterface {interface}\n\
         \t\tSndSocketBuffer 1249280\n\
         \t\tRcvSocketBuffer 1249280\n\
         \t\tChecksum on\n\
         \t}}\n\
         }}\n\
         General {{\n\
         \tSystemd on\n\
         \tHashSize {hash}\n\
         \tHashLimit {limit}\n\
         \tLogFile {log}\n\
         \tSyslog off\n\
         \tLockFile {lock}\n\
         \tUNIX {{\n\
         \t\tPath {socket}\n\
         \t}}\n\
         \tNetlinkBufferSize 2097152\n\
         \tNetlinkBufferSizeMaxGrowth 8388608\n\
         \tFilter From Userspace {{\n\
         \t\tProtocol Accept {{\n\
         \t\t\tTCP\n\
         \t\t\tUDP\n\
         \t\t}}\n\
         \t\tAddress Accept {{\n",
        conf = c.config_path.display(),
        doc = if anycast(config) {
            "docs/many-hosts.md, \"Keeping connections across a withdrawal: the anycast sync\""
        } else {
            "docs/vip.md, \"Open connections across a VIP's move\""
        },
        mode = mode(c),
        transport = transport_block(c),
        interface = c.interface,
        hash = c.hash_size,
        limit = u64::from(c.hash_size) * 4,
        log = c.log_file.display(),
        lock = c.lock_file.display(),
        socket = c.socket.display(),
        anycast_ftfw = if anycast(config) { ANYCAST_FTFW } else { "" },
    );
    let addresses = if anycast(config) {
        anycast_addresses(config)
            .into_iter()
            .map(IpAddr::V4)
            .collect()
    } else {
        filter_addresses(config)
    };
    if addresses.is_empty() {
        // No kernel listener: accept an address no flow has (the
        // unspecified one), so nothing is synced.
        out.push_str("\t\t\tIPv4_address 0.0.0.0/32 # nothing to sync: no kernel listener\n");
    }
    // conntrackd's key names the family: an IPv6 backend under
    // `IPv4_address` is a parse error, and without an `IPv6_address` line
    // no IPv6 flow is synced (measured: 0 of 24 in the peer's cache, 0 of
    // 20 connections kept; tests/conntrack_sync_v6.rs).
    for a in addresses {
        let key = if a.is_ipv4() { "IPv4" } else { "IPv6" };
        let _ = writeln!(out, "\t\t\t{key}_address {a}");
    }
    out.push_str("\t\t}\n\t}\n}\n");
    Some(out)
}

/// conntrackd's sync mode for `c`'s transport: FTFW (acknowledged,
/// resent) to the one unicast peer; NOTRACK to a multicast group. FTFW
/// cannot take more than one sender: a receiver keeps one last sequence
/// number for every sender (conntrack-tools' `nethdr_track_seq`) and
/// drops each message numbered before it (`SEQ_BEFORE`: "we don't accept
/// delayed packets"), while each sender numbers its own from its start
/// time, and its acknowledgements mix the senders' numbers. Measured with
/// three hosts each carrying one VIP's 24 flows: the external caches held
/// 35, 31 and 24 of the 48 other hosts' flows. NOTRACK digests every
/// message (it counts the sequence for the statistics only) but resends
/// none: a datagram lost on the sync link leaves that flow out of the
/// copy until its next change or resync (counted in `conntrackd -s` and
/// the metrics as lost).
fn mode(c: &ConntrackdSettings) -> &'static str {
    match c.transport {
        SyncTransport::Unicast { .. } => "FTFW",
        SyncTransport::Multicast { .. } => "NOTRACK",
    }
}

/// The head of the sync block for `c`'s transport, up to its `Interface`:
/// `UDP` to the one peer, or `Multicast` to the group, sent from and
/// joined on this host's address of the sync link (`IPv4_interface`; with
/// `Interface`, it picks the link: no route to the group is needed).
fn transport_block(c: &ConntrackdSettings) -> String {
    match c.transport {
        SyncTransport::Unicast { peer } => format!(
            "\tUDP {{\n\t\tIPv4_address {}\n\t\tIPv4_Destination_Address {peer}\n\t\tPort {}\n",
            c.address, c.port
        ),
        SyncTransport::Multicast { group } => format!(
            "\tMulticast {{\n\t\tIPv4_address {group}\n\t\tGroup {}\n\t\tIPv4_interface {}\n",
            c.port, c.address
        ),
    }
}

/// The notify script's text for `config` (see the module's text);
/// `None` without `[conntrackd]`. One function over 120 lines because
/// most of it is the script's one template, read top to bottom as `sh` runs it.
pub fn render_script(config: &Config) -> Option<String> {
    let c = config.conntrackd.as_ref()?;
    if anycast(config) {
        // No transitions, so nothing for a script to do.
        return None;
    }
    // Quoted whatever they hold (`check` refuses all but
    // `[A-Za-z0-9._/-]` in them, so this is the second line of defence).
    let conf = shell_quote(&c.config_path.display().to_string());
    let dir = shell_quote(&c.state_directory.display().to_string());
    // Each instance's VIPs of kernel listeners: their flows are deleted
    // before the commit (see the MASTER case).
    let mut by_vrid: std::collections::BTreeMap<u32, Vec<IpAddr>> = Default::default();
    for g in gated(config) {
        let v = by_vrid.entry(g.vrid).or_default();
        if !v.contains(&g.vip) {
            v.push(g.vip);
        }
    }
    let mut vips_case = String::new();
    let all: Vec<String> = by_vrid.keys().map(ToString::to_string).collect();
    let all = all.join(" ");
    for (vrid, vips) in by_vrid {
        let list: Vec<String> = vips.iter().map(ToString::to_string).collect();
        let _ = writeln!(vips_case, "\t{vrid}) echo \"{}\" ;;", list.join(" "));
    }
    Some(format!(
        r#"#!/bin/sh
# Written by harvester-lb from its configuration; edits are overwritten.
# keepalived runs it at every transition of every instance it renders:
#   $1 INSTANCE, $2 hlb_<vrid>, $3 MASTER|BACKUP|FAULT|STOP, $4 priority.
# conntrack-tools' primary/backup recipe, with a gate (nftables table
# inet {GATE_TABLE}, owned by the daemon) that drops new flows of the
# instance's VIPs until the commit is done. docs/vip.md, "Open connections
# across a VIP's move".
PATH=/usr/sbin:/usr/bin:/sbin:/bin
# The state files are for the daemon to read, which runs as another user
# (keepalived's own umask would make them root's alone).
umask 022
CONF={conf}
DIR={dir}
[ "$1" = INSTANCE ] || exit 0
case "$2" in
hlb_[0-9]*) vrid=${{2#hlb_}} ;;
*) exit 0 ;;
esac
case "$vrid" in *[!0-9]*) exit 0 ;; esac
inst=$2
# Each instance's VIPs of kernel listeners, and every instance.
vips_of() {{
	case "$1" in
{vips_case}	esac
}}
vrids='{all}'
vips=$(vips_of "$vrid")
mkdir -p "$DIR"
now_ms() {{ date +%s%3N; }}
t0=$(now_ms)
# The order of transitions, by a clock no time step moves: centiseconds
# since this boot, and the boot.
read -r up _ </proc/uptime
t0cs=${{up%.*}}${{up#*.}}
boot=$(cat /proc/sys/kernel/random/boot_id 2>/dev/null)
# One transition of an instance at a time, and none undone by an older one:
# keepalived starts the script at each transition without waiting for the
# last one to end. The lock is on fd 9; whatever outlives the script
# (conntrackd -d, the delayed deletion) closes it.
exec 9>"$DIR/.$vrid.lock"
flock 9
state= at= seq=0 at_boot= at_cs= by= commit_result= commit_at= commit_ms= commits_ok=0 commits_failed=0
[ -r "$DIR/$vrid" ] && . "$DIR/$vrid"
# A later transition already ran (the two raced for the lock): this one
# is stale, and doing it would undo keepalived's present state.
[ "$at_boot" = "$boot" ] && [ -n "$at_cs" ] && [ "$at_cs" -gt "$t0cs" ] && exit 0
# The same state again from the same keepalived process: keepalived
# notifies a change of state, so this is one transition run twice (seen
# with keepalived 2.2.7's startup_script, which ran two VRRP processes),
# and a second MASTER would delete the entries the first committed and
# commit the external cache the first emptied (measured: 0 of 20 kept).
[ "$at_boot" = "$boot" ] && [ "$state" = "$3" ] && [ "$by" = "$PPID" ] && exit 0
seq=$((seq + 1))
record() {{
	printf 'state=%s\nat=%s\nseq=%s\nat_boot=%s\nat_cs=%s\nby=%s\ncommit_result=%s\ncommit_at=%s\ncommit_ms=%s\ncommits_ok=%s\ncommits_failed=%s\n' \
		"$1" "$t0" "$seq" "$boot" "$t0cs" "$PPID" "$commit_result" "$commit_at" "$commit_ms" "$commits_ok" "$commits_failed" >"$DIR/.$vrid.tmp" &&
		mv -f "$DIR/.$vrid.tmp" "$DIR/$vrid"
}}
# Recorded before anything is done: a deletion scheduled by an earlier
# transition sees that this one came, and deletes nothing.
record "$3"
ctd() {{ conntrackd -C "$CONF" "$@" >/dev/null 2>&1 8>&- 9>&- || logger -t harvester-lb-sync "$inst: conntrackd -C $CONF $* failed"; }}
gate_open() {{ nft flush chain inet {GATE_TABLE} g_$vrid 2>/dev/null; }}
gate_close() {{
	nft -f - 2>/dev/null <<EOF
flush chain inet {GATE_TABLE} g_$vrid
add rule inet {GATE_TABLE} g_$vrid ct state {{ invalid, new }} drop
EOF
}}
# This host's entries of the flows to the VIPs given.
forget() {{
	for vip in "$@"; do
		conntrack -D --orig-dst "$vip" >/dev/null 2>&1
	done
}}
# One commit or tidy at a time on this host (every instance's script).
host_lock() {{
	exec 8>"$DIR/.conntrackd.lock"
	flock 8
}}
# {PURGE_S} s after every transition, under the host's lock: this host's
# entries of the flows of every instance it does not carry now are
# deleted, without conntrackd telling its peers. They are stale: a
# former master's (their TCP windows fall behind while another host
# carries them; the moved packets would be invalid here, reach the local
# stack and be reset) and the copies a commit made of every instance's
# flows. Deleted as conntrackd's own (in its internal cache), each would
# be sent as the flow's end to every peer, and a third host would lose
# from its cache the flows it needs to take the VIP over: the internal
# cache is emptied first, and -R fills it again from what is left (the
# flows this host carries, sent to the peers anew). Not at once: the
# peer commits first, and a commit's events must be read by conntrackd
# before its internal cache is emptied. An instance that became master
# meanwhile is left alone (its commit waits for the lock). Then -n asks
# the peers for their flows again: a transition's own -n is answered once,
# over a sync that does not resend (NOTRACK), and a peer tidying at that
# moment answers with its internal cache half filled.
tidy_later() {{
	(
		exec 9>&-
		sleep {PURGE_S}
		host_lock
		gone=
		for v in $vrids; do
			s=
			if [ -r "$DIR/$v" ]; then
				while IFS='=' read -r key value; do
					[ "$key" = state ] && s=$value
				done <"$DIR/$v"
			fi
			[ "$s" = MASTER ] || gone="$gone $(vips_of "$v")"
		done
		set -- $gone
		if [ $# -gt 0 ]; then
			ctd -f internal
			forget "$@"
			ctd -R
		fi
		ctd -n
	) </dev/null >/dev/null 2>&1 &
}}
case "$3" in
MASTER)
	host_lock
	# Entries left from before (a host killed without a transition): the
	# gate is closed, so nothing new comes in meanwhile.
	forget $vips
	if conntrackd -C "$CONF" -c >/dev/null 2>&1 8>&- 9>&-; then
		commit_result=ok commits_ok=$((commits_ok + 1))
	else
		commit_result=failed commits_failed=$((commits_failed + 1))
		logger -t harvester-lb-sync "$inst: conntrackd -C $CONF -c failed; open flows of its VIPs may be reset"
	fi
	commit_at=$(now_ms)
	gate_open
	commit_ms=$((commit_at - t0))
	ctd -f
	ctd -R
	ctd -B
	ctd -n
	exec 8>&-
	tidy_later
	;;
BACKUP)
	gate_close
	tidy_later
	conntrackd -C "$CONF" -s >/dev/null 2>&1 9>&- || conntrackd -C "$CONF" -d 9>&-
	ctd -n
	;;
FAULT|STOP)
	gate_close
	tidy_later
	;;
*) exit 0 ;;
esac
record "$3"
exit 0
"#
    ))
}

/// `value` as one word of `sh`, taken literally: in single quotes, each
/// `'` as `'\''`.
pub fn shell_quote(value: &str) -> String {
    format!("'{}'", value.replace('\'', "'\\''"))
}

/// What the notify script recorded for one instance (`state_directory/<vrid>`).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Recorded {
    /// The instance's last transition: `MASTER`, `BACKUP`, `FAULT` or `STOP`
    /// (recorded as the script begins it, again with the commit's result
    /// when done).
    pub state: String,
    /// When it began (Unix milliseconds).
    pub at_ms: u64,
    /// The last commit's result (`ok`, `failed`); `None`: never master.
    pub commit_ok: Option<bool>,
    /// When the last commit ended (Unix milliseconds).
    pub commit_at_ms: Option<u64>,
    /// How long it took, milliseconds.
    pub commit_ms: Option<u64>,
    /// Commits that succeeded, since the directory was made (a boot).
    pub commits_ok: u64,
    /// Commits that failed.
    pub commits_failed: u64,
}

/// Parses a state file the notify script wrote (`key=value` lines);
/// `None` when it has no state (a file half written by hand).
pub fn parse_recorded(text: &str) -> Option<Recorded> {
    let mut r = Recorded::default();
    for line in text.lines() {
        let Some((key, value)) = line.split_once('=') else {
            continue;
        };
        let num = || value.trim().parse::<u64>().ok();
        match key.trim() {
            "state" => r.state = value.trim().to_string(),
            "at" => r.at_ms = num().unwrap_or(0),
            "commit_result" => {
                r.commit_ok = match value.trim() {
                    "ok" => Some(true),
                    "failed" => Some(false),
                    _ => None,
                }
            }
            "commit_at" => r.commit_at_ms = num(),
            "commit_ms" => r.commit_ms = num(),
            "commits_ok" => r.commits_ok = num().unwrap_or(0),
            "commits_failed" => r.commits_failed = num().unwrap_or(0),
            _ => {}
        }
    }
    (!r.state.is_empty()).then_some(r)
}

/// What `conntrackd -C FILE -s` says, as far as the daemon reports it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Stats {
    /// Entries in the internal cache (this host's own flows).
    pub internal: u64,
    /// Entries in the external cache (the peer's flows, committed at a
    /// takeover).
    pub external: u64,
    /// Sync packets sent and received on the link.
    pub packets_sent: u64,
    /// Sync packets received (FTFW sends an alive message every second
    /// when idle: a count that stops moving is a link that is down).
    pub packets_received: u64,
    /// Send errors on the link.
    pub send_errors: u64,
    /// Messages the peer numbered that never arrived.
    pub lost: u64,
}

/// Parses `conntrackd -s` (conntrack-tools 1.4): the `current active
/// connections` of the `cache internal` and `cache external` sections, and
/// the link's counters. `None` when it has neither cache (not conntrackd's
/// sync statistics).
pub fn parse_stats(text: &str) -> Option<Stats> {
    let mut s = Stats::default();
    let mut section = "";
    let mut caches = 0;
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with("cache internal") {
            section = "internal";
        } else if t.starts_with("cache external") {
            section = "external";
        } else if !line.starts_with(' ') && t.ends_with(':') {
            section = "";
        }
        if let Some(rest) = t.strip_prefix("current active connections:") {
            let n = rest.trim().parse().unwrap_or(0);
            match section {
                "internal" => {
                    s.internal = n;
                    caches += 1;
                }
                "external" => {
                    s.external = n;
                    caches += 1;
                }
                _ => {}
            }
        }
        // "  123 Pckts sent   45 Pckts recv", "0 Error send  0 Error recv",
        // "0 Malformed msgs  0 Lost msgs": numbers before their names.
        let words: Vec<&str> = t.split_whitespace().collect();
        for w in words.windows(3) {
            let Ok(n) = w[0].parse::<u64>() else { continue };
            match (w[1], w[2]) {
                ("Pckts", "sent") => s.packets_sent = n,
                ("Pckts", "recv") => s.packets_received = n,
                ("Error", "send") => s.send_errors = n,
                ("Lost", "msgs") => s.lost = n,
                _ => {}
            }
        }
    }
    (caches > 0).then_some(s)
}

/// conntrackd's uptime in whole minutes, from `conntrackd -s runtime`
/// (`daemon uptime: 12 min`); `None` when the text has none.
pub fn parse_uptime_min(text: &str) -> Option<u64> {
    text.lines()
        .find_map(|l| l.trim().strip_prefix("daemon uptime:"))
        .and_then(|rest| rest.split_whitespace().next())
        .and_then(|n| n.parse().ok())
}

/// Whether conntrackd surely runs with a file older than the one written
/// at `written` (Unix seconds): it reads its file only at start, and its
/// uptime has minute steps, so it counts as started at the latest time its
/// uptime allows; a conntrackd started within the minute before the write
/// is told within a minute, one started after it never (its filter lacks
/// the backends added since the write: their flows are not synced). The
/// daemon asks this only when conntrackd's lock file, whose time is its
/// exact start, cannot be read.
pub fn restart_pending(written: u64, now: u64, uptime_min: u64) -> bool {
    now.saturating_sub(uptime_min * 60) < written
}

/// Why conntrackd's file could not be written or conntrackd not restarted.
#[derive(Debug, thiserror::Error)]
pub enum ConntrackdError {
    /// A file could not be written.
    #[error(
        "cannot write {path}: {source} (conntrackd.config_path / conntrackd.notify_script; the daemon needs write access to their directories; under the shipped unit it has none: install the vrrp.conf drop-in, docs/vip.md \"Under the shipped unit\")"
    )]
    Write {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// `conntrackd.restart_command` failed.
    #[error(
        "conntrackd.restart_command {command:?} failed: {why} (conntrackd keeps its old filter until it restarts)"
    )]
    Restart {
        /// The command.
        command: Vec<String>,
        /// Its exit or spawn error and output.
        #[source]
        why: crate::host::ConfiguredCommandError,
    },
}

/// What [`install`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Installed {
    /// Both files already had this text.
    Unchanged,
    /// conntrackd.conf changed (and `restart_command`, if set, ran).
    ConfChanged,
    /// Only the notify script changed.
    ScriptChanged,
}

/// Writes conntrackd.conf and the notify script, if any (mode 0700: keepalived's
/// `enable_script_security` runs no script others may change) when their
/// text differs, and runs `restart_command` when conntrackd's file changed
/// (or `force`: a restart that failed before). Blocking.
pub fn install(
    settings: &ConntrackdSettings,
    conf: &str,
    script: Option<&str>,
    force: bool,
) -> Result<Installed, ConntrackdError> {
    let same =
        |path: &Path, text: &str| std::fs::read(path).is_ok_and(|old| old == text.as_bytes());
    let write = |path: &Path, text: &str, mode: u32| {
        crate::host::vmnet::keepalived::write_atomically(path, text)
            .and_then(|()| {
                use std::os::unix::fs::PermissionsExt;
                std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            })
            .map_err(|source| ConntrackdError::Write {
                path: path.display().to_string(),
                source,
            })
    };
    let mut done = Installed::Unchanged;
    // The anycast mode has no script (`render_script` is `None`).
    if let Some(script) = script
        && !same(&settings.notify_script, script)
    {
        write(&settings.notify_script, script, 0o700)?;
        done = Installed::ScriptChanged;
    }
    let conf_same = same(&settings.config_path, conf);
    if !conf_same {
        write(&settings.config_path, conf, 0o644)?;
    }
    if !conf_same || force {
        done = Installed::ConfChanged;
        if let Some(command) = &settings.restart_command {
            crate::host::run_configured(command).map_err(|why| ConntrackdError::Restart {
                command: command.clone(),
                why,
            })?;
        }
    }
    Ok(done)
}

#[cfg(test)]
mod tests;

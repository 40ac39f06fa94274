//! keepalived's configuration, rendered from the daemon's own: the VIPs
//! of the load balancers on a `[[network]]`, and (`keepalived.management_vips`,
//! on by default) those on no network, the management network's, moved
//! between hosts by VRRP with no hand-written keepalived line (docs/vip.md,
//! "A VIP on a VM network" and "Management-network VIPs").
//!
//! [`render`] is pure: the same file gives every host the same instances,
//! VRIDs and VIPs; only `router_id`, the unicast addresses and the
//! priorities differ. What it writes, and why:
//!
//! - **Unicast VRRP on the management interface only** (`interface`,
//!   `unicast_src_ip`, `unicast_peer`): adverts never go onto a tenant's
//!   network (a VM there could read them, forge them, or collide with its
//!   own VRIDs; multicast adverts would reach every VM of the VLAN).
//! - **The VIP as `virtual_ipaddress VIP/32 dev <network interface>`**, not
//!   `use_vmac` and not a macvlan the daemon makes: `use_vmac` makes its
//!   macvlan on the instance's `interface`, which is the management one
//!   here, so it cannot put a tenant's VIP on the tenant's network; a
//!   macvlan of ours would add a MAC per host to every VM network (switch
//!   MAC limits, Harvester's bridges learning one more address) and a
//!   second owner of the interface the address lives on, for nothing the
//!   address on the network's own interface does not do. keepalived adds
//!   the address on the master, sends the gratuitous ARPs *on that
//!   interface*, and removes it on the backup; the daemon never adds it.
//!   A /32 adds no subnet route to the main table: how the host itself
//!   routes does not change when a VIP arrives; replies are routed by the
//!   network's own table (`host::vmnet::network`).
//! - **A management VIP** (a load balancer on no network, its VIP the
//!   pool's or static, no `vip.announce = "routes"`;
//!   [`Config::keepalived_interface`]) as `VIP/32 dev <keepalived.interface>`,
//!   in the instances of the same hash as the VM networks' VIPs, tracked
//!   and moved alike: what kube-vip does for Harvester's load balancers by
//!   ARP on `mgmt-br`, without a keepalived line written per VIP.
//! - **VIPs spread over `instances` instances** by a stable hash of the
//!   VIP (FNV-1a of its bytes: the same on every host and every version),
//!   not one instance per VIP (VRIDs are 255 per segment) nor one for all
//!   (one master for every VIP). Host *r* of the sorted management
//!   addresses has priority 250 for the instances *i* with *i* mod hosts =
//!   *r*, 10 less per step away, so each host is the preferred master of
//!   some instances (active/active).
//! - **`track_script`** asking the daemon `/readyz?vrrp_instance=VRID`
//!   over the admin Unix socket: the daemon answers for the instance's VIPs
//!   ([`instance_vips`], the same placement this file is rendered from), so
//!   a host whose daemon cannot serve them, or is stopping, gives them up.
//!   The instance is named, not its VIPs: keepalived 2.2.7 refuses a line
//!   past about 1 KiB ("Unterminated quote") and its VRRP process then
//!   crashes in a loop, which a `vip=` list reached at ~60 VIPs (issue 40).
//!   Every line of the file is bounded whatever the number of VIPs (one
//!   VIP, peer or interface per line). The socket's path is in single
//!   quotes: keepalived splits a script's words at unquoted spaces
//!   (`check` refuses the quotes, backslashes and control characters
//!   single quotes cannot carry).
//! - **`vrrp_version`** as configured (3 by default: `advert_int` in
//!   centiseconds, so sub-second adverts; with 2 keepalived rounds it to
//!   whole seconds, which `check` refuses to leave implicit).
//! - **At most [`ADVERTISED_VIPS`] VIPs in the adverts**: the others of
//!   an instance in `virtual_ipaddress_excluded`, moved with it alike.
//! - **IPv6 VIPs** as `VIP/128 dev <network interface>` in
//!   `virtual_ipaddress_excluded` when the adverts are IPv4 (keepalived
//!   ignores a VIP of the other family in `virtual_ipaddress`, and refuses
//!   an instance with no VIP of its own family): moved with an instance
//!   that carries an IPv4 VIP, added `nodad`, with unsolicited neighbour
//!   advertisements on the network.
//! - **`track_script hlb_mgmt`** in every instance, the management
//!   network's reachability (`host::vmnet::mgmt_check`): a host that reaches
//!   neither the management gateway nor any peer goes to FAULT instead of
//!   becoming a second master of every VIP when its management link fails
//!   silently (docs/vip.md, "Split brain").
//! - **Gratuitous ARP** as keepalived's maintainers advise for switched
//!   networks: a second burst `garp_master_delay` 1 s after taking over
//!   (a switch that was still learning the port misses the first) and a
//!   refresh every 60 s while master (`garp_master_refresh`), so a
//!   neighbour whose entry expired learns it again without asking.
//!
//! [`install`] writes the file (a temporary file, then a rename: keepalived
//! never reads half a file) only when its text changed, and tells
//! keepalived to reload (`SIGHUP` to the pid in its pid file, or the
//! configured command).

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::net::IpAddr;
use std::path::Path;

use crate::config::{Config, KeepalivedSettings};
use crate::host::vmnet::mgmt_check;

/// The first line of every file the daemon writes: what tells its own
/// file from one written by hand at the same path (see [`release`]).
pub const HEADER: &str =
    "# Written by harvester-lb from its configuration; edits are overwritten.\n";

/// The highest priority given (255 is the address owner's, never ours).
const TOP_PRIORITY: u32 = 250;
/// Priority steps between hosts.
pub const PRIORITY_STEP: u32 = 10;

/// The most VIPs of an instance carried in its adverts
/// (`virtual_ipaddress`); the others are `virtual_ipaddress_excluded`,
/// which keepalived adds and removes with the state all the same.
/// keepalived's manual advises excluding most addresses for "large numbers
/// (eg 200) of IPs" on one interface, and above 255 (the advert's address
/// count is one byte) it moves the excess itself with a warning. A
/// receiver also drops an advert whose address count is not its own
/// (`vrrp_in_chk`): with the cap, adding a VIP to an instance of 20 or more
/// leaves its adverts as they were on hosts that have not reloaded yet. The
/// lowest VIPs are carried; a VIP that moves between the two lists on a
/// reload stays on the interface (keepalived 2.2.7, `ip monitor address`
/// showed no event).
pub const ADVERTISED_VIPS: usize = 20;

/// The instance of `vip` among `instances`: FNV-1a of its bytes, stable on
/// every host and across versions (std's hasher is neither).
pub fn instance_of(vip: IpAddr, instances: u8) -> u8 {
    let bytes: Vec<u8> = match vip {
        IpAddr::V4(v4) => v4.octets().to_vec(),
        IpAddr::V6(v6) => v6.octets().to_vec(),
    };
    let mut h: u32 = 0x811c_9dc5;
    for b in bytes {
        h ^= u32::from(b);
        h = h.wrapping_mul(0x0100_0193);
    }
    (h % u32::from(instances.max(1))) as u8
}

/// This host's priority for instance `instance`: 250 where it is the
/// preferred master, 10 less per host after it in the rotation.
pub fn priority(settings: &KeepalivedSettings, instance: u8) -> u32 {
    let hosts = settings.hosts();
    let n = hosts.len() as u32;
    let rank = hosts
        .iter()
        .position(|h| *h == settings.address)
        .unwrap_or(0) as u32;
    let away = (rank + n - u32::from(instance) % n) % n;
    TOP_PRIORITY - PRIORITY_STEP * away
}

/// One VIP of an instance: the address and the interface it goes on.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Placed {
    vip: IpAddr,
    interface: String,
}

impl Placed {
    /// `VIP/32 dev IFACE` or `VIP/128 dev IFACE`.
    fn line(&self) -> String {
        let len = if self.vip.is_ipv4() { 32 } else { 128 };
        format!("    {}/{len} dev {}", self.vip, self.interface)
    }
}

/// Which instance each VIP keepalived moves is in (a VM network's, or a
/// management VIP on `keepalived.interface`: one placement for both, so a
/// management VIP shares instances, masters and track scripts with the
/// VM networks' by the same hash). A VIP of the adverts' family
/// (`keepalived.address`'s) by [`instance_of`] over all instances; one of
/// the other family (an IPv6 VIP under IPv4 adverts), which keepalived can
/// only carry as an excluded address of an instance that has a VIP of its
/// own family, by [`instance_of`] over the instances that have one (none:
/// it is left out, and `check` refuses that file).
fn placement(config: &Config, k: &KeepalivedSettings) -> BTreeMap<u8, Vec<Placed>> {
    let mut by_instance: BTreeMap<u8, Vec<Placed>> = BTreeMap::new();
    let placed: Vec<Placed> = config
        .load_balancers
        .iter()
        .filter_map(|lb| {
            // Its network's interface, or keepalived.interface for a
            // management VIP; none for a VIP this daemon leases (held by
            // the lease path on its own macvlan, on the host that leased
            // it: keepalived must not add it) or one held by other means.
            let interface = config.keepalived_interface(lb)?;
            Some(Placed {
                vip: lb.vip,
                interface: interface.to_string(),
            })
        })
        .collect();
    let carried = |p: &&Placed| p.vip.is_ipv4() == k.address.is_ipv4();
    for p in placed.iter().filter(carried) {
        by_instance
            .entry(instance_of(p.vip, k.instances))
            .or_default()
            .push(p.clone());
    }
    let used: Vec<u8> = by_instance.keys().copied().collect();
    for p in placed.iter().filter(|p| !carried(p)) {
        let Ok(n) = u8::try_from(used.len()) else {
            continue;
        };
        if n == 0 {
            continue;
        }
        let i = used[usize::from(instance_of(p.vip, n))];
        by_instance.entry(i).or_default().push(p.clone());
    }
    for list in by_instance.values_mut() {
        list.sort();
        list.dedup();
    }
    by_instance
}

/// The VIPs the rendered file puts in the instance whose
/// `virtual_router_id` is `vrid` (`virtual_ipaddress` and
/// `virtual_ipaddress_excluded` alike), for the daemon's answer to that
/// instance's track script: computed by the same placement as [`render`],
/// so the daemon and keepalived agree on the set. Empty without
/// `[keepalived]` or when the instance has no VIP (it is not rendered).
pub fn instance_vips(config: &Config, vrid: u32) -> Vec<IpAddr> {
    let Some(k) = config.keepalived.as_ref() else {
        return Vec::new();
    };
    let Some(instance) = vrid
        .checked_sub(u32::from(k.vrid_base))
        .and_then(|i| u8::try_from(i).ok())
    else {
        return Vec::new();
    };
    placement(config, k)
        .remove(&instance)
        .unwrap_or_default()
        .into_iter()
        .map(|p| p.vip)
        .collect()
}

/// The `virtual_router_id` of the instance the rendered file puts each
/// VM-network VIP in, by the same placement as [`render`]: an IPv6 VIP
/// under IPv4 adverts rides in an instance chosen among those in use, not
/// by [`instance_of`] over all of them, so whatever acts per instance (the
/// conntrackd gate, the notify script's deletions) must ask here. Empty
/// without `[keepalived]`.
pub fn vrid_by_vip(config: &Config) -> BTreeMap<IpAddr, u32> {
    let Some(k) = config.keepalived.as_ref() else {
        return BTreeMap::new();
    };
    placement(config, k)
        .into_iter()
        .flat_map(|(instance, placed)| {
            let vrid = u32::from(k.vrid_base) + u32::from(instance);
            placed.into_iter().map(move |p| (p.vip, vrid))
        })
        .collect()
}

/// The keepalived.conf text for `config`; `None` without `[keepalived]`.
/// The admin socket the track scripts ask is `config.admin.socket`.
pub fn render(config: &Config) -> Option<String> {
    let k = config.keepalived.as_ref()?;
    let by_instance = placement(config, k);
    let mut out = String::new();
    let advert = advert_text(k);
    let _ = write!(
        out,
        "{HEADER}\
         # docs/vip.md, \"A VIP on a VM network\".\n\
         global_defs {{\n  router_id {}\n  enable_script_security\n  script_user root\n  vrrp_version {}\n}}\n",
        k.name, k.vrrp_version
    );
    let peers: Vec<IpAddr> = k.peers.clone();
    let socket = config.admin.socket.display();
    // The management-reachability check every instance tracks
    // (`host::vmnet::mgmt_check`: a host cut off its management network silently
    // goes to FAULT instead of becoming a second master).
    if !by_instance.is_empty() {
        out.push_str(&mgmt_check::vrrp_script(k));
    }
    for (instance, vips) in by_instance {
        let vrid = u32::from(k.vrid_base) + u32::from(instance);
        // The instance, not its VIPs: a line that grew with them was
        // refused by keepalived (see the module's doc).
        let require = if k.ready_requires_backend {
            "&require=backend"
        } else {
            ""
        };
        let _ = write!(
            out,
            "\nvrrp_script hlb_ready_{vrid} {{\n  script \"/usr/bin/curl --unix-socket '{socket}' -sf -m 1 -o /dev/null http://localhost/readyz?vrrp_instance={vrid}{require}\"\n  interval 1\n  timeout 1\n  fall 2\n  rise 2\n}}\n"
        );
        let _ = write!(
            out,
            "\nvrrp_instance hlb_{vrid} {{\n  state BACKUP\n  interface {}\n  virtual_router_id {vrid}\n  priority {}\n{}  advert_int {advert}\n  unicast_src_ip {}\n  unicast_peer {{\n",
            k.interface,
            priority(k, instance),
            crate::host::conntrack_sync::conntrackd::preempt_line(config),
            k.address
        );
        for p in &peers {
            let _ = writeln!(out, "    {p}");
        }
        out.push_str(
            "  }\n  garp_master_delay 1\n  garp_master_refresh 60\n  virtual_ipaddress {\n",
        );
        // VIPs of the adverts' family; the others (IPv6 VIPs under IPv4
        // adverts) in `virtual_ipaddress_excluded`, which keepalived adds
        // and removes with the state all the same (unsolicited neighbour
        // adverts included) but cannot carry in an advert of the other
        // family ("address family must match VRRP instance").
        // Past ADVERTISED_VIPS of the adverts' family, the rest are
        // excluded too (see ADVERTISED_VIPS).
        let (mut carried, mut excluded): (Vec<&Placed>, Vec<&Placed>) = vips
            .iter()
            .partition(|p| p.vip.is_ipv4() == k.address.is_ipv4());
        if carried.len() > ADVERTISED_VIPS {
            let rest = carried.split_off(ADVERTISED_VIPS);
            excluded.splice(0..0, rest);
        }
        for p in &carried {
            let _ = writeln!(out, "{}", p.line());
        }
        out.push_str("  }\n");
        if !excluded.is_empty() {
            out.push_str("  virtual_ipaddress_excluded {\n");
            for p in &excluded {
                let _ = writeln!(out, "{}", p.line());
            }
            out.push_str("  }\n");
        }
        let _ = write!(
            out,
            "  track_script {{\n    hlb_ready_{vrid}\n    {}\n  }}\n",
            mgmt_check::SCRIPT_NAME
        );
        // `[conntrackd]`: the transitions commit the synced flows.
        let interfaces: Vec<&str> = vips.iter().map(|p| p.interface.as_str()).collect();
        out.push_str(&crate::host::conntrack_sync::conntrackd::notify_line(
            config,
            &interfaces,
        ));
        out.push_str("}\n");
    }
    Some(out)
}

/// The file left when `[keepalived]` is removed: this host's
/// `global_defs` and no instance, so keepalived (which stays running)
/// gives up every VIP the daemon had it move, and sends a priority-0
/// advert for each instance so a peer takes over at once.
pub fn render_released(k: &KeepalivedSettings) -> String {
    format!(
        "{HEADER}\
         # [keepalived] was removed from harvester-lb's configuration: no VIP is moved\n\
         # from this host any more (docs/vip.md, \"A VIP on a VM network\").\n\
         global_defs {{\n  router_id {}\n  vrrp_version {}\n}}\n",
        k.name, k.vrrp_version
    )
}

/// `advert_int` in seconds, as keepalived reads it (`1`, `0.5`, `0.25`).
fn advert_text(k: &KeepalivedSettings) -> String {
    let ms = k.advert_interval.as_millis();
    if ms.is_multiple_of(1000) {
        (ms / 1000).to_string()
    } else {
        format!("{}.{:02}", ms / 1000, (ms % 1000) / 10)
            .trim_end_matches('0')
            .to_string()
    }
}

/// Why the file could not be written or keepalived not told.
#[derive(Debug, thiserror::Error)]
pub enum KeepalivedError {
    /// The file or its temporary copy could not be written.
    #[error(
        "cannot write keepalived's configuration {path}: {source} (keepalived.config_path; the daemon needs write access to its directory; under the shipped unit it has none: install the vrrp.conf drop-in, docs/vip.md \"Under the shipped unit\")"
    )]
    Write {
        /// The file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// The management check's script could not be written.
    #[error(
        "cannot write the management check's script {path}: {source} (keepalived.management_check_script; keepalived.conf is not written while the script it names is missing)"
    )]
    CheckScript {
        /// The script.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// No pid to signal.
    #[error(
        "cannot tell keepalived to reload: its pid file {path} {why} (keepalived.pid_file; is keepalived running? it reads the new file when it starts)"
    )]
    NoPid {
        /// The pid file.
        path: String,
        /// What was wrong with it.
        why: String,
    },
    /// The pid file names a live process that is not keepalived (a stale
    /// file whose pid was reused): it is not signalled.
    #[error(
        "not telling keepalived to reload: pid {pid} from {path} is {what}, not keepalived (a stale pid file whose pid another process now has; it was not signalled). Is keepalived running with keepalived.pid_file = {path:?}?"
    )]
    NotKeepalived {
        /// The pid.
        pid: i32,
        /// The pid file.
        path: String,
        /// What the process is (its `comm`, or why it could not be read).
        what: NotKeepalivedProcess,
    },
    /// `kill(pid, SIGHUP)` failed.
    #[error("cannot send SIGHUP to keepalived (pid {pid} from {path}): {source}")]
    Signal {
        /// The pid.
        pid: i32,
        /// The pid file.
        path: String,
        /// The error.
        source: std::io::Error,
    },
    /// `keepalived.reload_command` failed.
    #[error("keepalived.reload_command {command:?} failed: {why}")]
    Command {
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
    /// The file already had this text: nothing written, nobody told.
    Unchanged,
    /// Written, and keepalived told to reload.
    Reloaded,
    /// Not written: the file there is not the daemon's (its first line is
    /// not [`HEADER`]), so it is someone else's now and left alone.
    NotOurs,
    /// Under the shipped unit: written to the hand-off directory for root
    /// to install (`host::vmnet::handoff`); nobody told by the daemon.
    HandedOff,
}

/// Writes `text` to `settings.config_path` when it differs from what is
/// there (temporary file in the same directory, fsync, rename), the
/// management check's script first when `text` tracks it
/// (`mgmt_check::install`), and tells
/// keepalived to reload. With `force`, keepalived is told even when the
/// file was already up to date (a reload that failed before is retried).
/// Blocking: run it off the runtime's workers.
pub fn install(
    settings: &KeepalivedSettings,
    text: &str,
    force: bool,
) -> Result<Installed, KeepalivedError> {
    let path = &settings.config_path;
    // The check script first: keepalived reads the file and starts the
    // scripts it names at once.
    if text.contains(&mgmt_check::vrrp_script(settings)) {
        mgmt_check::install(settings).map_err(|source| KeepalivedError::CheckScript {
            path: settings.management_check_script.display().to_string(),
            source,
        })?;
    }
    let same = std::fs::read(path).is_ok_and(|old| old == text.as_bytes());
    if same && !force {
        return Ok(Installed::Unchanged);
    }
    if !same {
        write_atomically(path, text).map_err(|source| KeepalivedError::Write {
            path: path.display().to_string(),
            source,
        })?;
    }
    reload(settings)?;
    Ok(Installed::Reloaded)
}

/// `[keepalived]` was removed: replaces the daemon's own file at
/// `settings.config_path` with [`render_released`]'s and tells keepalived
/// to reload, so it stops holding VIPs the daemon no longer serves on a VM
/// network (and stops sending adverts for VRIDs nobody configures). A file
/// that is not the daemon's (written by hand since, or missing) is left
/// alone: [`Installed::NotOurs`]. `force` as in [`install`].
pub fn release(settings: &KeepalivedSettings, force: bool) -> Result<Installed, KeepalivedError> {
    let ours =
        std::fs::read_to_string(&settings.config_path).is_ok_and(|text| text.starts_with(HEADER));
    if !ours {
        return Ok(Installed::NotOurs);
    }
    install(settings, &render_released(settings), force)
}

/// Writes `text` to `path` through a temporary file in the same directory
/// and a rename, so a reader never sees half a file.
pub(crate) fn write_atomically(path: &Path, text: &str) -> std::io::Result<()> {
    use std::io::Write;
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let tmp = path.with_file_name(format!(".{name}.harvester-lb.tmp"));
    let mut f = std::fs::File::create(&tmp)?;
    f.write_all(text.as_bytes())?;
    f.sync_all()?;
    drop(f);
    std::fs::rename(&tmp, path).inspect_err(|_| {
        let _ = std::fs::remove_file(&tmp);
    })
}

fn reload(settings: &KeepalivedSettings) -> Result<(), KeepalivedError> {
    if let Some(command) = &settings.reload_command {
        crate::host::run_configured(command).map_err(|why| KeepalivedError::Command {
            command: command.clone(),
            why,
        })?;
        return Ok(());
    }
    let path = settings.pid_file.display().to_string();
    let text = std::fs::read_to_string(&settings.pid_file).map_err(|e| KeepalivedError::NoPid {
        path: path.clone(),
        why: format!("cannot be read: {e}"),
    })?;
    let pid: i32 =
        text.trim()
            .parse()
            .ok()
            .filter(|p| *p > 1)
            .ok_or_else(|| KeepalivedError::NoPid {
                path: path.clone(),
                why: format!("holds no pid ({:?})", text.trim()),
            })?;
    // A pid file outlives its process; the pid may since belong to any
    // program, which SIGHUP would kill. Only a keepalived is signalled.
    if let Err(what) = is_keepalived(pid) {
        return Err(KeepalivedError::NotKeepalived { pid, path, what });
    }
    crate::os::send_signal(pid, libc::SIGHUP).map_err(|source| KeepalivedError::Signal {
        pid,
        path,
        source,
    })
}

/// Whether process `pid` is keepalived: its `comm` (the executable's name,
/// as the kernel keeps it) is `keepalived`. `Err` says what it is instead
/// (`"sleep"`), or why that cannot be told (no such process, `/proc`
/// hidden): a process that cannot be shown to be keepalived is never
/// signalled.
fn is_keepalived(pid: i32) -> Result<(), NotKeepalivedProcess> {
    let comm = std::fs::read_to_string(format!("/proc/{pid}/comm"))
        .map_err(|source| NotKeepalivedProcess::Unreadable { pid, source })?;
    let comm = comm.trim_end_matches('\n');
    if comm == "keepalived" {
        Ok(())
    } else {
        Err(NotKeepalivedProcess::Other {
            comm: comm.to_string(),
        })
    }
}

/// What a pid file's process is instead of keepalived, or why that cannot
/// be told (`is_keepalived`).
#[derive(Debug, thiserror::Error)]
pub enum NotKeepalivedProcess {
    /// Its `/proc/<pid>/comm` cannot be read (no such process, `/proc`
    /// hidden).
    #[error("a process whose /proc/{pid}/comm cannot be read ({source})")]
    Unreadable {
        /// The pid.
        pid: i32,
        /// Why the file could not be read.
        #[source]
        source: std::io::Error,
    },
    /// Another program (its `comm`, quoted: `"sleep"`).
    #[error("{comm:?}")]
    Other {
        /// The process's `comm`.
        comm: String,
    },
}

#[cfg(test)]
mod tests;

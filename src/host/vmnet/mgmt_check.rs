//! The management-reachability check: keepalived's `vrrp_script
//! hlb_mgmt`, tracked by every rendered instance, which demotes a host
//! that can reach neither the management network's gateway nor any peer
//! on `keepalived.interface` (docs/vip.md, "Split brain").
//!
//! Why: VRRP runs on the management network only (the adverts never go
//! onto a tenant's network), so a host whose management link fails
//! *silently* (the port stays up, frames are dropped: a switch port in
//! the wrong VLAN, a bad cable half, an ACL) stops hearing its peers and
//! makes itself master of every instance, while its VM networks still
//! work: two hosts hold the VIP and answer ARP for it, and clients follow
//! whichever answered last (measured in `tests/it/vmnet_split.rs`: 12 s of
//! two holders for a 15 s cut, every connection of the master reset when
//! a backup was the one cut). keepalived sees a carrier loss by itself
//! (it tracks the instance's interface), not a silent cut. With the
//! check, the cut host fails it within one interval plus the ping's
//! timeout and goes to FAULT (weight 0): it gives up the VIPs and stays
//! out until the check passes twice (`rise 2`).
//!
//! The gateway is part of the check, not only the peers: the last host
//! alive (its peers all down) would otherwise fail its own check and drop
//! every VIP. It fails only when this host reaches nobody. The gateway is
//! `keepalived.management_gateway`, or else the default route's through
//! the interface, which the script asks each time it runs (a gateway
//! that changes needs no reload). With no gateway at all the check
//! passes: peers alone cannot tell "I am cut off" from "they are all
//! down", and a lone survivor (of two hosts, or the last of three) that
//! faulted would take every VIP down, a worse outage than the split brain
//! it guards against. [`Discovered`] is what the daemon saw at its last
//! apply, for `/status` and a warning when there is none.
//!
//! The script pings every target in parallel, 0.4 s each, and collects
//! each by its own pid (`wait $pid`): `wait $(jobs -p)` missed finished
//! jobs and failed a healthy host (conntrackd-three-hosts.md). It is
//! written like the notify script: mode 0700, and only when its text
//! changed ([`install`]).

use std::fmt::Write as _;
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};

use crate::config::KeepalivedSettings;

/// The `vrrp_script` name every instance tracks.
pub const SCRIPT_NAME: &str = "hlb_mgmt";

/// How long each ping waits for its answer (`ping -W`), seconds: well
/// inside keepalived's `timeout 1` for the script.
const PING_WAIT: &str = "0.4";

/// The `vrrp_script` block of keepalived's file: weight 0 (a failure is
/// FAULT), every second, a failure counted at once (`fall 1`), two
/// passes to return (`rise 2`: one lucky answer on a flapping link does
/// not bring the host back).
pub fn vrrp_script(k: &KeepalivedSettings) -> String {
    format!(
        "\nvrrp_script {SCRIPT_NAME} {{\n  script \"{}\"\n  interval 1\n  timeout 1\n  fall 1\n  rise 2\n}}\n",
        k.management_check_script.display()
    )
}

/// The script's text: succeeds when the gateway (configured, or the
/// default route's through the interface, looked up at each run) or any
/// peer answers a ping on `keepalived.interface`.
pub fn render_script(k: &KeepalivedSettings) -> String {
    let family = if k.address.is_ipv4() { "-4" } else { "-6" };
    let gateway = k
        .management_gateway
        .map(|g| g.to_string())
        .unwrap_or_default();
    let mut peers = String::new();
    for p in &k.peers {
        let _ = write!(peers, " {p}");
    }
    format!(
        "#!/bin/sh\n\
         # Written by harvester-lb from its configuration; edits are overwritten.\n\
         # keepalived's vrrp_script {SCRIPT_NAME} (docs/vip.md, \"Split brain\"): succeeds when the\n\
         # management gateway or any peer answers a ping on {iface}; fails (every\n\
         # instance goes to FAULT and gives up its VIPs) only when none does.\n\
         PATH=/usr/sbin:/usr/bin:/sbin:/bin\n\
         IF='{iface}'\n\
         # keepalived.management_gateway; empty: the default route's through $IF.\n\
         GW='{gateway}'\n\
         if [ -z \"$GW\" ]; then\n\
         \x20 set -- $(ip {family} route show default dev \"$IF\" 2>/dev/null)\n\
         \x20 while [ $# -gt 1 ]; do\n\
         \x20   if [ \"$1\" = via ]; then GW=$2; break; fi\n\
         \x20   shift\n\
         \x20 done\n\
         fi\n\
         # No gateway: a host cut off cannot be told from one whose peers are\n\
         # all down, so no judgement (a lone survivor must keep its VIPs).\n\
         [ -n \"$GW\" ] || exit 0\n\
         # In parallel, each collected by its own pid.\n\
         pids=\n\
         for a in $GW{peers}; do\n\
         \x20 ping -n -q -c 1 -W {PING_WAIT} -I \"$IF\" \"$a\" >/dev/null 2>&1 &\n\
         \x20 pids=\"$pids $!\"\n\
         done\n\
         ok=\n\
         for p in $pids; do\n\
         \x20 if wait \"$p\"; then ok=1; fi\n\
         done\n\
         [ -n \"$ok\" ]\n",
        iface = k.interface,
    )
}

/// Writes the script to `keepalived.management_check_script` when its
/// text differs (a temporary file and a rename), mode 0700: keepalived's
/// `enable_script_security` runs no script others may change. `Ok(true)`:
/// written. Blocking.
pub fn install(k: &KeepalivedSettings) -> std::io::Result<bool> {
    use std::os::unix::fs::PermissionsExt;
    let path = &k.management_check_script;
    let text = render_script(k);
    let mode_ok = std::fs::metadata(path).is_ok_and(|m| m.permissions().mode() & 0o777 == 0o700);
    if mode_ok && std::fs::read(path).is_ok_and(|old| old == text.as_bytes()) {
        return Ok(false);
    }
    crate::host::vmnet::keepalived::write_atomically(path, &text)?;
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o700))?;
    Ok(true)
}

/// Where the check's gateway comes from, as the daemon saw it at its last
/// apply.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Discovered {
    /// The gateway the check pings besides the peers, if any.
    pub gateway: Option<IpAddr>,
    /// `"configured"` (keepalived.management_gateway), `"default route"`
    /// (through keepalived.interface, as the script finds it too) or
    /// `"none"`.
    pub gateway_source: &'static str,
    /// The peers it pings.
    pub peers: Vec<IpAddr>,
    /// The script's path.
    pub script: String,
    /// What an operator should know: with no gateway the check always
    /// passes, so split brain is not guarded against.
    pub problem: Option<String>,
    /// `net.netfilter.nf_conntrack_tcp_be_liberal` on this host (`None`:
    /// unreadable, e.g. no conntrack module): reported, not required
    /// (docs/vip.md, "Split brain", says why).
    pub tcp_be_liberal: Option<bool>,
}

/// What the check will ping on this host: `k`'s gateway, or the default
/// route's through `k.interface` read from `/proc/net/route` (IPv4) or
/// `/proc/net/ipv6_route` (IPv6) of the daemon's network namespace.
pub fn discover(k: &KeepalivedSettings) -> Discovered {
    let (gateway, gateway_source) = match k.management_gateway {
        Some(g) => (Some(g), "configured"),
        None => {
            let found = if k.address.is_ipv4() {
                std::fs::read_to_string("/proc/net/route")
                    .ok()
                    .and_then(|t| default_gateway_v4(&t, &k.interface))
                    .map(IpAddr::V4)
            } else {
                std::fs::read_to_string("/proc/net/ipv6_route")
                    .ok()
                    .and_then(|t| default_gateway_v6(&t, &k.interface))
                    .map(IpAddr::V6)
            };
            match found {
                Some(g) => (Some(g), "default route"),
                None => (None, "none"),
            }
        }
    };
    let problem = gateway.is_none().then(|| {
        format!(
            "no management gateway: keepalived.management_gateway is not set and this host has no default route through keepalived.interface {:?}; without one the management check cannot tell this host cut off from its peers all being down, so it always passes and a silent cut of the management link makes two masters (split brain): set keepalived.management_gateway to a router on that network",
            k.interface
        )
    });
    let tcp_be_liberal =
        std::fs::read_to_string("/proc/sys/net/netfilter/nf_conntrack_tcp_be_liberal")
            .ok()
            .and_then(|t| t.trim().parse::<u8>().ok())
            .map(|v| v != 0);
    Discovered {
        gateway,
        gateway_source,
        peers: k.peers.clone(),
        script: k.management_check_script.display().to_string(),
        problem,
        tcp_be_liberal,
    }
}

/// The gateway of the first default route through `interface` in
/// `/proc/net/route`'s text (fields: Iface, Destination, Gateway, Flags,
/// ..., Mask; addresses in hex, in the kernel's byte order, which is
/// little-endian on the hosts this runs on).
pub fn default_gateway_v4(text: &str, interface: &str) -> Option<Ipv4Addr> {
    text.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 8 || f[0] != interface || f[1] != "00000000" || f[7] != "00000000" {
            return None;
        }
        let gw = u32::from_str_radix(f[2], 16).ok()?;
        let gw = Ipv4Addr::from(gw.to_le_bytes());
        (!gw.is_unspecified()).then_some(gw)
    })
}

/// The gateway of the first default route (`::/0`) through `interface` in
/// `/proc/net/ipv6_route`'s text (fields: destination, its prefix length,
/// source, its prefix length, next hop, metric, refcount, use, flags,
/// device; addresses as 32 hex digits).
pub fn default_gateway_v6(text: &str, interface: &str) -> Option<Ipv6Addr> {
    text.lines().find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        if f.len() < 10 || f[9] != interface || f[0] != "0".repeat(32) || f[1] != "00" {
            return None;
        }
        let gw = u128::from_str_radix(f[4], 16).ok()?;
        let gw = Ipv6Addr::from(gw);
        (!gw.is_unspecified()).then_some(gw)
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::parse;

    fn settings(more: &str) -> KeepalivedSettings {
        let text = format!(
            "[keepalived]\nname = \"h1\"\naddress = \"10.77.0.1\"\ninterface = \"mgmt0\"\npeers = [\"10.77.0.3\", \"10.77.0.2\"]\n{more}\n[[network]]\nname = \"vlan100\"\ninterface = \"br.100\"\nprefix_length = 24\ngateway = \"10.100.0.1\"\n"
        );
        parse(&text).expect("valid").config.keepalived.unwrap()
    }

    /// The script run by `sh` with stand-ins for `ping` (answers for the
    /// addresses in `answering`, after `delay` seconds) and `ip` (prints
    /// `route`), put first on its `PATH`: its exit status, and the
    /// addresses pinged.
    fn run(k: &KeepalivedSettings, answering: &[&str], route: &str) -> (bool, Vec<String>) {
        use std::os::unix::fs::PermissionsExt;
        // One directory per run: the tests run in parallel.
        static RUNS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = RUNS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let dir = std::env::temp_dir().join(format!("hlb-mgmt-check-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let log = dir.join("pinged");
        let ping = format!(
            "#!/bin/sh\nfor a; do last=$a; done\necho \"$last\" >> '{}'\nsleep 0.1\ncase \" {} \" in *\" $last \"*) exit 0;; esac\nexit 1\n",
            log.display(),
            answering.join(" ")
        );
        let ip = format!("#!/bin/sh\nprintf '%s\\n' '{route}'\n");
        for (name, text) in [("ping", ping), ("ip", ip)] {
            let p = dir.join(name);
            std::fs::write(&p, text).unwrap();
            std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let script = render_script(k).replace(
            "PATH=/usr/sbin:/usr/bin:/sbin:/bin\n",
            &format!("PATH={}:/usr/bin:/bin\n", dir.display()),
        );
        let status = std::process::Command::new("sh")
            .arg("-c")
            .arg(&script)
            .status()
            .unwrap();
        let mut pinged: Vec<String> = std::fs::read_to_string(&log)
            .unwrap_or_default()
            .lines()
            .map(str::to_string)
            .collect();
        pinged.sort();
        std::fs::remove_dir_all(&dir).unwrap();
        (status.success(), pinged)
    }

    #[test]
    fn the_check_passes_while_the_gateway_or_any_peer_answers_and_fails_when_none_does() {
        let k = settings("management_gateway = \"10.77.0.254\"\n");
        let script = render_script(&k);
        assert!(
            script.contains("IF='mgmt0'\n") && script.contains("GW='10.77.0.254'\n"),
            "{script}"
        );
        assert!(
            script.contains("for a in $GW 10.77.0.2 10.77.0.3; do"),
            "{script}"
        );
        assert!(
            script.contains("ping -n -q -c 1 -W 0.4 -I \"$IF\""),
            "{script}"
        );
        // Explicit pids, never `jobs -p` (which missed finished jobs).
        assert!(script.contains("pids=\"$pids $!\"") && !script.contains("jobs"));
        let all = ["10.77.0.2", "10.77.0.254", "10.77.0.3"];
        for answering in [&["10.77.0.254"][..], &["10.77.0.3"], &all] {
            let (ok, pinged) = run(&k, answering, "");
            assert!(ok, "{answering:?} answer: the check must pass");
            assert_eq!(pinged, all, "every target asked, in parallel");
        }
        let (ok, pinged) = run(&k, &[], "");
        assert!(!ok, "nobody answers: the check must fail");
        assert_eq!(pinged, all);
    }

    #[test]
    fn without_a_configured_gateway_the_script_asks_the_default_route_each_time() {
        let k = settings("");
        assert!(render_script(&k).contains("GW=''\n"));
        let route = "default via 10.77.0.254 dev mgmt0 proto static metric 100";
        let (ok, pinged) = run(&k, &["10.77.0.254"], route);
        assert!(ok);
        assert_eq!(pinged, ["10.77.0.2", "10.77.0.254", "10.77.0.3"]);
        let (ok, _) = run(&k, &[], route);
        assert!(!ok, "nobody answers: the check fails");
        // No default route: no judgement, nobody asked (a lone survivor
        // whose peers are down keeps its VIPs).
        let (ok, pinged) = run(&k, &[], "");
        assert!(ok, "no gateway: the check passes");
        assert!(pinged.is_empty(), "{pinged:?}");
    }

    #[test]
    fn the_default_gateway_is_read_from_the_kernel_s_route_tables() {
        let v4 = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                  eth0\t00000000\t0100640A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                  mgmt0\t00004D0A\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                  mgmt0\t00000000\tFE004D0A\t0003\t0\t0\t0\t00000000\t0\t0\t0\n";
        assert_eq!(
            default_gateway_v4(v4, "mgmt0"),
            Some(Ipv4Addr::new(10, 77, 0, 254))
        );
        assert_eq!(
            default_gateway_v4(v4, "eth0"),
            Some(Ipv4Addr::new(10, 100, 0, 1))
        );
        assert_eq!(default_gateway_v4(v4, "br.100"), None);
        let v6 = "00000000000000000000000000000000 00 00000000000000000000000000000000 00 fd000000000000000000000000000001 00000400 00000001 00000000 00000003  mgmt0\n\
                  fd000000000000000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001  mgmt0\n";
        assert_eq!(
            default_gateway_v6(v6, "mgmt0"),
            Some("fd00::1".parse().unwrap())
        );
        assert_eq!(default_gateway_v6(v6, "eth0"), None);
    }

    #[test]
    fn a_gateway_that_cannot_be_one_is_refused_by_name() {
        for (value, why) in [
            ("10.77.0.1", "keepalived.address, this host's own"),
            ("10.77.0.2", "a peer in keepalived.peers"),
            ("fd00::1", "not of keepalived.address's family"),
            ("224.0.0.1", "multicast"),
            ("gw", "is not an IPv4 or IPv6 address"),
        ] {
            let text = format!(
                "[keepalived]\nname = \"h1\"\naddress = \"10.77.0.1\"\ninterface = \"mgmt0\"\npeers = [\"10.77.0.2\"]\nmanagement_gateway = \"{value}\"\n"
            );
            let err = parse(&text)
                .expect_err(value)
                .iter()
                .map(ToString::to_string)
                .collect::<Vec<_>>()
                .join("\n");
            assert!(
                err.contains("keepalived.management_gateway") && err.contains(why),
                "{value}: {err}"
            );
        }
        let text = "[keepalived]\nname = \"h1\"\naddress = \"10.77.0.1\"\ninterface = \"mgmt0\"\npeers = [\"10.77.0.2\"]\nmanagement_check_script = \"/etc/keep alived/x\"\n";
        // Unset: beside keepalived's file.
        assert_eq!(
            settings("").management_check_script,
            std::path::Path::new("/etc/keepalived/harvester-lb-management-check")
        );
        assert_eq!(
            settings("config_path = \"/srv/k/keepalived.conf\"\n").management_check_script,
            std::path::Path::new("/srv/k/harvester-lb-management-check")
        );
        let err = parse(text)
            .expect_err("a space")
            .iter()
            .map(ToString::to_string)
            .collect::<Vec<_>>()
            .join("\n");
        assert!(err.contains("keepalived.management_check_script"), "{err}");
    }

    #[test]
    fn the_script_is_written_0700_only_when_it_changes() {
        use std::os::unix::fs::PermissionsExt;
        let dir = std::env::temp_dir().join(format!("hlb-mgmt-install-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let mut k = settings("");
        k.management_check_script = dir.join("check");
        assert!(install(&k).unwrap());
        let mode = std::fs::metadata(&k.management_check_script)
            .unwrap()
            .permissions()
            .mode();
        assert_eq!(mode & 0o777, 0o700);
        assert!(!install(&k).unwrap(), "unchanged: not written");
        std::fs::set_permissions(
            &k.management_check_script,
            std::fs::Permissions::from_mode(0o755),
        )
        .unwrap();
        assert!(install(&k).unwrap(), "a wrong mode is repaired");
        k.management_gateway = Some("10.77.0.254".parse().unwrap());
        assert!(install(&k).unwrap());
        assert!(
            std::fs::read_to_string(&k.management_check_script)
                .unwrap()
                .contains("GW='10.77.0.254'")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! The few small things the standard library does not expose and the daemon
//! needs from the kernel: the raw monotonic clock (for systemd), raising the
//! open-file limit, dissolving a TCP connection while keeping its socket, and
//! `TCP_DEFER_ACCEPT` (which `socket2` does not wrap).
//! `unsafe` is confined to these calls.

#![allow(unsafe_code)]

use std::io;
use std::os::fd::RawFd;
use std::time::Duration;

/// `CLOCK_MONOTONIC` now, which `std::time::Instant` uses but does not expose.
pub fn monotonic_now() -> Duration {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid, writable timespec.
    let rc = unsafe { libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts) };
    if rc != 0 {
        return Duration::ZERO;
    }
    Duration::new(ts.tv_sec as u64, ts.tv_nsec as u32)
}

/// Raises the soft open-file limit to the hard one (as nginx's
/// `worker_rlimit_nofile` and the Go runtime do) and returns the soft limit
/// now in force. Every forwarded connection needs descriptors; the hard limit
/// is the operator's decision (`LimitNOFILE=`), the soft one is an accident.
pub fn raise_open_file_limit() -> io::Result<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    if unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } != 0 {
        return Err(io::Error::last_os_error());
    }
    if lim.rlim_cur < lim.rlim_max {
        let raised = libc::rlimit {
            rlim_cur: lim.rlim_max,
            rlim_max: lim.rlim_max,
        };
        // SAFETY: `raised` is a valid rlimit that only lifts the soft limit.
        if unsafe { libc::setrlimit(libc::RLIMIT_NOFILE, &raised) } == 0 {
            lim.rlim_cur = lim.rlim_max;
        }
    }
    Ok(lim.rlim_cur)
}

/// Connections (or UDP flows) an open-file limit allows by default: a
/// third of what is left once 256 descriptors are kept for the daemon
/// itself and 512 for the pool of spare pipes. A TCP connection holds two
/// sockets and, while bytes move, a pipe; a flow one socket.
pub fn connections_for(open_files: u64) -> usize {
    (open_files.saturating_sub(256 + 512) / 3).max(16) as usize
}

/// The soft open-file limit in force, if it can be read.
pub fn open_file_limit() -> Option<u64> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: `lim` is a valid, writable rlimit.
    (unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut lim) } == 0).then_some(lim.rlim_cur)
}

/// Descriptors this process holds. Linux 6.2 and later report the count
/// as the size of `/proc/self/fd` (one `stat`, ~30 µs at 18,000
/// descriptors); older kernels report 0, and the directory is counted
/// instead, which costs about 3 µs per descriptor: call it off the data
/// plane's threads (`spawn_blocking`).
pub fn open_fds() -> Option<u64> {
    let dir = std::path::Path::new("/proc/self/fd");
    match std::fs::metadata(dir) {
        Ok(m) if m.len() > 0 => Some(m.len()),
        // The directory's own descriptor is one of the entries.
        _ => std::fs::read_dir(dir)
            .ok()
            .map(|d| (d.count() as u64).saturating_sub(1)),
    }
}

/// What the kernel says of this process, for the standard `process_*`
/// series every Prometheus client's process collector exports (so the
/// dashboards and alerts written for them apply as they are).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ProcessStats {
    /// When the process started, seconds since the Unix epoch.
    pub start_time_seconds: f64,
    /// User and system CPU time spent, seconds.
    pub cpu_seconds: f64,
    /// Resident memory, bytes.
    pub resident_bytes: u64,
}

/// This process's [`ProcessStats`], from `/proc/self/stat`,
/// `/proc/self/statm` and the boot time in `/proc/stat` (three small reads,
/// a few microseconds); `None` when `/proc` cannot be read.
pub fn process_stats() -> Option<ProcessStats> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // The command name (field 2) is in parentheses and may hold spaces:
    // the fields are counted from after its closing one, field 3 first.
    let after = &stat[stat.rfind(')')? + 1..];
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| fields.get(n - 3)?.parse::<u64>().ok();
    let (utime, stime, start) = (field(14)?, field(15)?, field(22)?);
    let boot = std::fs::read_to_string("/proc/stat")
        .ok()?
        .lines()
        .find_map(|l| l.strip_prefix("btime ")?.trim().parse::<u64>().ok())?;
    let statm = std::fs::read_to_string("/proc/self/statm").ok()?;
    let resident_pages: u64 = statm.split_whitespace().nth(1)?.parse().ok()?;
    // SAFETY: sysconf has no preconditions.
    let (ticks, page) = unsafe {
        (
            libc::sysconf(libc::_SC_CLK_TCK),
            libc::sysconf(libc::_SC_PAGESIZE),
        )
    };
    if ticks <= 0 || page <= 0 {
        return None;
    }
    let ticks = ticks as f64;
    Some(ProcessStats {
        start_time_seconds: boot as f64 + start as f64 / ticks,
        cpu_seconds: (utime + stime) as f64 / ticks,
        resident_bytes: resident_pages * page as u64,
    })
}

/// Ignores `SIGHUP` until the daemon installs its reload handler. The default
/// action of `SIGHUP` is to exit, and a reload (`systemctl reload`, a
/// controller's `kill -HUP`) can come while the process is still starting:
/// it must never kill it. Call first thing in `main`.
pub fn ignore_hangup_until_handled() {
    // SAFETY: setting a signal's disposition to SIG_IGN has no preconditions;
    // the handler installed later replaces it.
    unsafe {
        libc::signal(libc::SIGHUP, libc::SIG_IGN);
    }
}

/// The process's effective user id: whose files and directories it may
/// trust (the admin socket's directory, see `admin`).
pub fn effective_uid() -> u32 {
    // SAFETY: geteuid has no preconditions and cannot fail.
    unsafe { libc::geteuid() }
}

/// The user that owns a TCP socket listening where `addr` would bind (the
/// same address, or the wildcard of its family, on its port), as
/// `/proc/net/tcp` and `/proc/net/tcp6` tell; `None` when none is seen
/// (or `/proc` cannot be read). For error messages: it names who took a
/// port the daemon needs.
pub fn tcp_listener_owner(addr: std::net::SocketAddr) -> Option<u32> {
    use std::net::IpAddr;
    // The kernel prints each 32-bit word of the address in host order.
    let hex = |ip: IpAddr| -> String {
        let octets: Vec<u8> = match ip {
            IpAddr::V4(v4) => v4.octets().to_vec(),
            IpAddr::V6(v6) => v6.octets().to_vec(),
        };
        octets
            .chunks(4)
            .map(|w| format!("{:08X}", u32::from_ne_bytes([w[0], w[1], w[2], w[3]])))
            .collect()
    };
    let unspecified = match addr.ip() {
        IpAddr::V4(_) => IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED),
        IpAddr::V6(_) => IpAddr::V6(std::net::Ipv6Addr::UNSPECIFIED),
    };
    let wanted = [
        format!("{}:{:04X}", hex(addr.ip()), addr.port()),
        format!("{}:{:04X}", hex(unspecified), addr.port()),
    ];
    let table = if addr.is_ipv4() {
        "/proc/net/tcp"
    } else {
        "/proc/net/tcp6"
    };
    let text = std::fs::read_to_string(table).ok()?;
    text.lines().skip(1).find_map(|line| {
        let f: Vec<&str> = line.split_whitespace().collect();
        // sl local rem st tx:rx tr:when retrnsmt uid ...
        (f.len() > 7 && f[3] == "0A" && wanted.iter().any(|w| w == f[1]))
            .then(|| f[7].parse().ok())
            .flatten()
    })
}

/// `connect(fd, AF_UNSPEC)`: on Linux this dissolves a TCP socket's
/// connection (a reset if it was established, nothing sent if the handshake
/// was still pending) and leaves the socket unconnected, ready for another
/// `connect`, its options and its registration with epoll kept.
pub fn tcp_disconnect(fd: RawFd) -> io::Result<()> {
    // SAFETY: an all-zero sockaddr is valid and has sa_family AF_UNSPEC; the
    // kernel reads only its family from it.
    let rc = unsafe {
        let unspec: libc::sockaddr = std::mem::zeroed();
        libc::connect(
            fd,
            &unspec,
            std::mem::size_of::<libc::sockaddr>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// `TCP_DEFER_ACCEPT` on the listening socket `fd`: the kernel completes a
/// handshake but hands the connection to `accept` only once the client's
/// first bytes arrive, or once about `seconds` have passed (the kernel rounds
/// up to its SYN-ACK retransmission schedule: 1, 3, 7, 15, 31 s…). `0` turns it
/// off; it can change on a listening socket at any time and applies to the
/// handshakes from then on.
pub fn set_tcp_defer_accept(fd: RawFd, seconds: u32) -> io::Result<()> {
    let value = libc::c_int::try_from(seconds).unwrap_or(libc::c_int::MAX);
    // SAFETY: `value` is a valid c_int for the duration of the call, and its
    // size is the length passed.
    let rc = unsafe {
        libc::setsockopt(
            fd,
            libc::IPPROTO_TCP,
            libc::TCP_DEFER_ACCEPT,
            (&value as *const libc::c_int).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if rc == 0 {
        Ok(())
    } else {
        Err(io::Error::last_os_error())
    }
}

/// The host's connection tracking use and size (`nf_conntrack_count`,
/// `nf_conntrack_max`, of this network namespace); `None` without the
/// conntrack module. Two small file reads.
pub fn conntrack_usage() -> Option<(u64, u64)> {
    let read = |name: &str| {
        std::fs::read_to_string(format!("/proc/sys/net/netfilter/{name}"))
            .ok()?
            .trim()
            .parse::<u64>()
            .ok()
    };
    Some((read("nf_conntrack_count")?, read("nf_conntrack_max")?))
}

/// One forwarding sysctl as the daemon read it. An unreadable value is
/// [`Sysctl::Unreadable`], never taken for on: under systemd's
/// `ProcSubset=pid` `/proc/sys` is hidden, and DNAT on a host that does not
/// forward drops every packet while the listener looks healthy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sysctl {
    /// The value is not `0`.
    On,
    /// The value is `0`.
    Off,
    /// The file could not be read or held no number.
    Unreadable,
}

impl Sysctl {
    /// The state a read of a boolean sysctl file gives.
    pub fn from_read(read: &io::Result<String>) -> Sysctl {
        match read.as_deref().map(str::trim) {
            Ok("0") => Sysctl::Off,
            Ok(v) if v.parse::<u64>().is_ok() => Sysctl::On,
            _ => Sysctl::Unreadable,
        }
    }
}

/// The files of `net.ipv4.ip_forward` and `net.ipv6.conf.all.forwarding`.
pub const IP_FORWARDING_FILES: [&str; 2] = [
    "/proc/sys/net/ipv4/ip_forward",
    "/proc/sys/net/ipv6/conf/all/forwarding",
];

/// Whether this host forwards IPv4 and IPv6 packets
/// (`net.ipv4.ip_forward`, `net.ipv6.conf.all.forwarding`): DNAT to
/// another host needs it. Each with the raw read, for the error's text.
pub fn ip_forwarding() -> [(Sysctl, io::Result<String>); 2] {
    IP_FORWARDING_FILES.map(|path| {
        let read = std::fs::read_to_string(path);
        (Sysctl::from_read(&read), read)
    })
}

/// The files of `net.bridge.bridge-nf-call-iptables` and
/// `-ip6tables` (per network namespace; absent while `br_netfilter` is not
/// loaded).
pub const BRIDGE_NF_CALL_FILES: [&str; 2] = [
    "/proc/sys/net/bridge/bridge-nf-call-iptables",
    "/proc/sys/net/bridge/bridge-nf-call-ip6tables",
];

/// Whether bridged IPv4 and IPv6 frames pass the IP hooks at the bridge
/// stage (`br_netfilter` loaded and its switch on, as on every Kubernetes
/// host): the NAT of a frame that entered a bridge port then runs before
/// the bridge decides where the frame goes. Absent or unreadable is off
/// (without `br_netfilter` nothing runs at the bridge stage; an unreadable
/// `/proc/sys` already keeps kernel listeners with the proxy through
/// [`ip_forwarding`]).
pub fn bridge_nf_calls() -> [bool; 2] {
    BRIDGE_NF_CALL_FILES.map(|path| Sysctl::from_read(&std::fs::read_to_string(path)) == Sysctl::On)
}

/// A bridge's own switch for the IP hooks at the bridge stage, per family
/// (IPv4, IPv6): `/sys/class/net/NAME/bridge/nf_call_iptables`
/// (`nf_call_ip6tables`), `ip link set NAME type bridge nf_call_iptables 1`.
/// The kernel runs the hooks for a bridge's frames when the host's sysctl
/// ([`bridge_nf_calls`]) **or** the bridge's own switch is on
/// (`br_nf_pre_routing`: `!brnet->call_iptables &&
/// !br_opt_get(br, BROPT_NF_CALL_IPTABLES)` is the only way out), so a host
/// whose sysctl is 0 still NATs the frames of such a bridge at the bridge
/// stage.
const BRIDGE_OWN_NF_CALL: [&str; 2] = ["nf_call_iptables", "nf_call_ip6tables"];

/// Whether the bridge `interface`'s own switch (`BRIDGE_OWN_NF_CALL`)
/// is on for the family (`ipv6`); absent, unreadable or not a bridge is
/// off.
pub fn bridge_nf_call_own(interface: &str, ipv6: bool) -> bool {
    if !is_bridge(interface) {
        return false;
    }
    let file = std::path::Path::new("/sys/class/net")
        .join(interface)
        .join("bridge")
        .join(BRIDGE_OWN_NF_CALL[usize::from(ipv6)]);
    std::fs::read_to_string(file).is_ok_and(|v| v.trim() == "1")
}

/// Per family, whether some bridge of this network namespace has its own
/// switch on ([`bridge_nf_call_own`]): a scan of `/sys/class/net`, which
/// lists every interface (a Harvester host's VM taps too; only bridges
/// have the file). Read with the sysctls every few seconds, so that a
/// bridge turning its switch on rebuilds the kernel listeners.
pub fn bridge_nf_calls_own_any() -> [bool; 2] {
    let mut any = [false; 2];
    let Ok(dir) = std::fs::read_dir("/sys/class/net") else {
        return any;
    };
    for entry in dir.flatten() {
        let Some(name) = entry.file_name().to_str().map(str::to_owned) else {
            continue;
        };
        for (family, on) in any.iter_mut().enumerate() {
            *on = *on || bridge_nf_call_own(&name, family == 1);
        }
    }
    any
}

/// Whether `interface` is a Linux bridge (`/sys/class/net/NAME/bridge`).
pub fn is_bridge(interface: &str) -> bool {
    if interface.is_empty() || interface.contains('/') || interface.starts_with('.') {
        return false;
    }
    std::path::Path::new("/sys/class/net")
        .join(interface)
        .join("bridge")
        .is_dir()
}

/// One family's routes as this network namespace's `/proc/net/route`
/// (IPv4: the main table) or `/proc/net/ipv6_route` (IPv6: every table)
/// lists them: each destination prefix with its device, routes through
/// `lo` (local and unreachable ones) left out. Enough to tell which device
/// a destination leaves by without policy rules (the daemon's own rules
/// select by source VIP, which a backend's route does not have).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Routes(Vec<(ipnet::IpNet, String)>);

impl Routes {
    /// The routes of the IPv6 (`ipv6`) or IPv4 family; none when the file
    /// cannot be read.
    pub fn read(ipv6: bool) -> Routes {
        if ipv6 {
            Self::parse_v6(&std::fs::read_to_string("/proc/net/ipv6_route").unwrap_or_default())
        } else {
            Self::parse_v4(&std::fs::read_to_string("/proc/net/route").unwrap_or_default())
        }
    }

    /// [`Routes::read`], reusing a reading of the same family younger than
    /// a second: a whole rebuild of the kernel's desired state asks once
    /// per load balancer, and with announced IPv6 VIPs `/proc/net/ipv6_route`
    /// holds a route per VIP (10,000 load balancers would read 10,000
    /// lines 10,000 times).
    pub fn read_recent(ipv6: bool) -> std::sync::Arc<Routes> {
        type Cache = [Option<(Duration, std::sync::Arc<Routes>)>; 2];
        static CACHE: std::sync::Mutex<Cache> = std::sync::Mutex::new([None, None]);
        let now = monotonic_now();
        let mut cache = CACHE
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let slot = &mut cache[usize::from(ipv6)];
        if let Some((at, routes)) = slot
            && now.saturating_sub(*at) < Duration::from_secs(1)
        {
            return routes.clone();
        }
        let routes = std::sync::Arc::new(Self::read(ipv6));
        *slot = Some((now, routes.clone()));
        routes
    }

    /// `/proc/net/route`'s text (fields: Iface, Destination, Gateway,
    /// Flags, RefCnt, Use, Metric, Mask; addresses in hex in the kernel's
    /// byte order, little-endian on the hosts this runs on).
    pub fn parse_v4(text: &str) -> Routes {
        let hex = |f: &str| {
            u32::from_str_radix(f, 16)
                .ok()
                .map(|v| std::net::Ipv4Addr::from(v.to_le_bytes()))
        };
        Routes(
            text.lines()
                .skip(1)
                .filter_map(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    if f.len() < 8 || f[0] == "lo" || f[0] == "*" {
                        return None;
                    }
                    let mask = u32::from(hex(f[7])?);
                    let len = u8::try_from(mask.count_ones()).ok()?;
                    let net = ipnet::Ipv4Net::new(hex(f[1])?, len).ok()?;
                    Some((ipnet::IpNet::V4(net), f[0].to_string()))
                })
                .collect(),
        )
    }

    /// `/proc/net/ipv6_route`'s text (fields: destination, its prefix
    /// length, source, its prefix length, next hop, metric, refcount, use,
    /// flags, device; addresses as 32 hex digits, lengths as 2).
    pub fn parse_v6(text: &str) -> Routes {
        Routes(
            text.lines()
                .filter_map(|line| {
                    let f: Vec<&str> = line.split_whitespace().collect();
                    if f.len() < 10 || f[9] == "lo" {
                        return None;
                    }
                    let dst = std::net::Ipv6Addr::from(u128::from_str_radix(f[0], 16).ok()?);
                    let len = u8::from_str_radix(f[1], 16).ok()?;
                    let net = ipnet::Ipv6Net::new(dst, len).ok()?;
                    Some((ipnet::IpNet::V6(net), f[9].to_string()))
                })
                .collect(),
        )
    }

    /// The device of the longest prefix holding `ip` (the first listed of
    /// equal ones).
    pub fn device_for(&self, ip: std::net::IpAddr) -> Option<&str> {
        let ip = ip.to_canonical();
        self.0
            .iter()
            .filter(|(net, _)| net.contains(&ip))
            .fold(None::<&(ipnet::IpNet, String)>, |best, r| match best {
                Some(b) if b.0.prefix_len() >= r.0.prefix_len() => Some(b),
                _ => Some(r),
            })
            .map(|(_, dev)| dev.as_str())
    }

    /// The device of the first default route (`0.0.0.0/0`, `::/0`).
    pub fn default_device(&self) -> Option<&str> {
        self.0
            .iter()
            .find(|(net, _)| net.prefix_len() == 0)
            .map(|(_, dev)| dev.as_str())
    }
}

/// Sends `signal` to process `pid` (`kill(2)`): how the daemon tells
/// keepalived to reload its configuration (`SIGHUP`).
pub fn send_signal(pid: i32, signal: i32) -> std::io::Result<()> {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    if unsafe { libc::kill(pid, signal) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_destination_s_device_is_its_longest_prefix_s() {
        // The bed's host: default via 192.0.2.1 and 192.0.2.0/24 on the
        // bridge eth0, 10.1.0.0/16 on eth1, a /32 on lo.
        let v4 = "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n\
                  eth0\t00000000\t010200C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n\
                  eth0\t000200C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n\
                  eth1\t0000010A\t00000000\t0001\t0\t0\t0\t0000FFFF\t0\t0\t0\n\
                  lo\t150200C0\t00000000\t0005\t0\t0\t0\tFFFFFFFF\t0\t0\t0\n";
        let r = Routes::parse_v4(v4);
        assert_eq!(r.default_device(), Some("eth0"));
        assert_eq!(
            r.device_for("192.0.2.21".parse().expect("ip")),
            Some("eth0")
        );
        assert_eq!(r.device_for("10.1.2.3".parse().expect("ip")), Some("eth1"));
        assert_eq!(r.device_for("8.8.8.8".parse().expect("ip")), Some("eth0"));
        let v6 = "20010db8000200000000000000000000 40 00000000000000000000000000000000 00 00000000000000000000000000000000 00000100 00000001 00000000 00000001 eth0\n\
                  20010db8000200000000000000000011 80 00000000000000000000000000000000 00 00000000000000000000000000000000 00000000 00000002 00000000 80200001 lo\n\
                  00000000000000000000000000000000 00 00000000000000000000000000000000 00 20010db8000200000000000000000001 00000400 00000001 00000000 00000003 eth1\n";
        let r = Routes::parse_v6(v6);
        assert_eq!(r.default_device(), Some("eth1"));
        assert_eq!(
            r.device_for("2001:db8:2::21".parse().expect("ip")),
            Some("eth0")
        );
        assert_eq!(
            r.device_for("2001:db8:2::11".parse().expect("ip")),
            Some("eth0")
        );
        assert_eq!(
            r.device_for("2001:db8:9::1".parse().expect("ip")),
            Some("eth1")
        );
        assert_eq!(Routes::parse_v4("garbage\nx y"), Routes::default());
    }

    #[test]
    fn an_unreadable_sysctl_is_never_on() {
        let hidden = Err(io::Error::from(io::ErrorKind::NotFound));
        assert_eq!(Sysctl::from_read(&hidden), Sysctl::Unreadable);
        let denied = Err(io::Error::from(io::ErrorKind::PermissionDenied));
        assert_eq!(Sysctl::from_read(&denied), Sysctl::Unreadable);
        assert_eq!(Sysctl::from_read(&Ok(String::new())), Sysctl::Unreadable);
        assert_eq!(Sysctl::from_read(&Ok("yes\n".into())), Sysctl::Unreadable);
        assert_eq!(Sysctl::from_read(&Ok("0\n".into())), Sysctl::Off);
        assert_eq!(Sysctl::from_read(&Ok("1\n".into())), Sysctl::On);
        assert_eq!(Sysctl::from_read(&Ok("2".into())), Sysctl::On);
    }
}

//! `[[network]]` and `[keepalived]`: VIPs on a guest cluster's own VM
//! network, moved between hosts by a keepalived whose configuration the
//! daemon renders from this file (see docs/vip.md, "A VIP on a VM network").
//!
//! Only the validated types live here; `validate::vmnet` builds them and
//! `host::vmnet::keepalived` renders them.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::path::PathBuf;
use std::time::Duration;

use super::{AnnounceSettings, Config, Ipam, LoadBalancerSpec};

/// Why `name` can never be a VM network's interface, from the name alone:
/// the host's loopback, a device of the host's container network (the
/// Kubernetes CNI's), or a lease macvlan of this daemon's. `check` and
/// import judge names here (they run anywhere); the daemon also checks the
/// link itself, its kind and its routes (`host::vmnet::network_refusals`). A VM
/// network is on a bridge, a VLAN device on one, or a bond; isolating
/// anything else takes the host's own traffic there (`lo`: every service
/// on 127.0.0.1). `None`: the name may be one.
pub fn not_a_vm_network_interface(name: &str) -> Option<&'static str> {
    const CNI: [&str; 12] = [
        "cni0",
        "flannel.1",
        "flannel-v6.1",
        "flannel-wg",
        "vxlan.calico",
        "vxlan-v6.calico",
        "tunl0",
        "kube-ipvs0",
        "cilium_host",
        "cilium_net",
        "cilium_vxlan",
        "docker0",
    ];
    let hex_tail = |prefix: &str, digits: usize| {
        name.strip_prefix(prefix)
            .is_some_and(|t| t.len() == digits && t.bytes().all(|b| b.is_ascii_hexdigit()))
    };
    if name == "lo" || name.starts_with("lo.") {
        Some(
            "the host's loopback, not a VM network: isolating it would stop every service on 127.0.0.1 (the daemon's own /readyz included) from answering",
        )
    } else if CNI.contains(&name) || hex_tail("cali", 11) {
        Some(
            "a device of the host's container network (the Kubernetes CNI's), not a VM network: isolating it would cut the pods off this host",
        )
    } else if hex_tail("hlb", 10) {
        Some(
            "a lease macvlan this daemon makes (ipam = \"dhcp\"), not a VM network: name the network's bridge or VLAN device",
        )
    } else if leg_table(name).is_some() {
        Some(
            "a network's leg this daemon makes (the macvlan through which a bridged network's kernel listeners are routed), not a VM network: name the network's bridge or VLAN device",
        )
    } else {
        None
    }
}

/// The words of `check`'s refusal of a VIP keepalived moves on a network
/// with no VIP of keepalived's adverts' family beside it (an IPv6 VIP with
/// no IPv4 one, under IPv4 adverts). `import` checks each load balancer
/// alone, without the others that would carry it, and so leaves this rule
/// to [`is_other_family_alone`] and decides it over the whole file itself.
pub const OTHER_FAMILY_ALONE: &str =
    "moves a VIP of the other family only beside one of its own in the same instance";

/// Whether `problem` is the refusal of [`OTHER_FAMILY_ALONE`].
pub fn is_other_family_alone(problem: &super::Problem) -> bool {
    problem.message.contains(OTHER_FAMILY_ALONE)
}

/// The first bytes of a network's leg (`host::vmnet::leg`): `hleg` and the
/// network's table in decimal, at most 14 bytes, never a lease macvlan's
/// `hlb` + 10 hex digits.
pub const LEG_PREFIX: &str = "hleg";

/// The name of the leg of the network whose routing table is `table`.
pub fn leg_name(table: u32) -> String {
    format!("{LEG_PREFIX}{table}")
}

/// The table of a leg's name, when `name` is one.
pub fn leg_table(name: &str) -> Option<u32> {
    let digits = name.strip_prefix(LEG_PREFIX)?;
    if digits.is_empty() || digits.starts_with('0') || !digits.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    digits.parse().ok()
}

/// Default `keepalived.vrid_base`: keepalived's own examples start at 51,
/// and VRIDs below 50 are what hand-written setups on the management
/// segment tend to use.
pub const DEFAULT_VRID_BASE: u8 = 50;
/// Default `keepalived.advert_interval_ms`: keepalived's default (1 s);
/// a master is declared dead after 3 adverts plus a skew (~3.6 s).
pub const DEFAULT_ADVERT_INTERVAL_MS: u32 = 1000;
/// Default `keepalived.vrrp_version`: version 3 (RFC 5798) counts the
/// advert interval in centiseconds, so sub-second adverts (and failovers
/// under 2 s) are possible; version 2 counts whole seconds.
pub const DEFAULT_VRRP_VERSION: u8 = 3;
/// Default `keepalived.config_path`: where keepalived reads its file.
pub const DEFAULT_KEEPALIVED_CONFIG: &str = "/etc/keepalived/keepalived.conf";
/// Default `keepalived.management_check_script`: this name in the
/// directory of `keepalived.config_path` (`/etc/keepalived` by default),
/// which only root may write (keepalived runs no script that others
/// could change).
pub const DEFAULT_MANAGEMENT_CHECK_SCRIPT: &str = "harvester-lb-management-check";
/// Default `keepalived.pid_file`: Debian's keepalived writes its main pid there.
pub const DEFAULT_KEEPALIVED_PID_FILE: &str = "/run/keepalived.pid";
/// Default `keepalived.management_vips`: with `[keepalived]`, every VIP
/// is moved by the keepalived the daemon configures, the management
/// network's as well as the VM networks' (what a kube-vip or MetalLB user
/// expects: a new load balancer's VIP comes up with nothing written by
/// hand).
pub const DEFAULT_MANAGEMENT_VIPS: bool = true;
/// Default `keepalived.ready_requires_backend`: a VIP whose listeners are
/// bound is ready though none of its backends is eligible (when every host
/// sees them down, a 503 would take the VIP off every host; docs/design.md,
/// "The all-backends-down decision for a moved VIP").
pub const DEFAULT_READY_REQUIRES_BACKEND: bool = false;
/// Default `keepalived.management_table`: the routing table of the
/// management VIPs' leg (`host::vmnet::mgmt_leg`), just below the networks'
/// default tables ([`DEFAULT_NETWORK_TABLE_BASE`]); its mark
/// ([`reply_mark_of`], `0xea`) is none of theirs up to the 254th network.
pub const DEFAULT_MANAGEMENT_TABLE: u32 = 999;
/// First routing table of `[[network]]`s without `table`: table
/// `DEFAULT_NETWORK_TABLE_BASE + n` for the n-th network of the file.
pub const DEFAULT_NETWORK_TABLE_BASE: u32 = 1000;

/// The bits of the conntrack and packet marks harvester-lb owns: the
/// mark of a kernel listener's flows from a VM network's VIP, which routes
/// their replies by the network's table (`host::vmnet::replymark`, which says why
/// these bits). Clear of kube-proxy's (`0xc000`), Calico's (`0xffff0000`)
/// and Cilium's (`0x0f00`).
pub const REPLY_MARK_MASK: u32 = 0x0000_00ff;

/// The reply mark of a network whose routing table is `table`: `1 +
/// (table - 1) mod 255` (its table number for tables up to 255), never 0
/// (no mark), the same for as long as the table is.
pub fn reply_mark_of(table: u32) -> u32 {
    1 + (table.max(1) - 1) % REPLY_MARK_MASK
}

/// Default `[[network]] isolate`: on. A Harvester host has `ip_forward`
/// on (Kubernetes needs it) and, once it holds a VIP, an address on the
/// VM network: without the guard any VM could use the host as a router
/// into other tenants' networks and the management network.
pub const DEFAULT_NETWORK_ISOLATE: bool = true;

/// `[[network]]`: one L2 network of guest VMs that load balancers put
/// their VIP on.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct NetworkSpec {
    /// Its name, as load balancers reference it (`network = "…"`).
    pub name: String,
    /// The host interface on that L2: the bridge of an untagged network or
    /// a VLAN device the host has. keepalived puts the VIPs on it.
    pub interface: String,
    /// The subnet's prefix length (VIPs and the gateway lie in it).
    pub prefix_length: u8,
    /// The network's gateway: replies to clients outside the subnet go
    /// through it, not through the host's default route.
    pub gateway: Ipv4Addr,
    /// The network's IPv6 gateway: with it the network takes IPv6 VIPs
    /// (in its IPv6 subnet), whose replies to clients outside the subnet
    /// go through it.
    pub ipv6_gateway: Option<Ipv6Addr>,
    /// The IPv6 subnet's prefix length (64 unless set).
    pub ipv6_prefix_length: u8,
    /// The routing table of replies from this network's VIPs
    /// (`ip rule from VIP lookup TABLE`).
    pub table: u32,
    /// Whether the host is no router for this network's VMs: traffic that
    /// enters from `interface` is forwarded only when DNATed to the
    /// network's own backends, and reaches the host only at its VIPs'
    /// listener ports (`host::vmnet::vmnet_filter`).
    pub isolate: bool,
}

impl NetworkSpec {
    /// The network's subnet (the gateway's, at `prefix_length`).
    pub fn subnet(&self) -> ipnet::Ipv4Net {
        ipnet::Ipv4Net::new(self.gateway, self.prefix_length)
            .map(|n| n.trunc())
            .unwrap_or_else(|_| ipnet::Ipv4Net::default())
    }

    /// The network's IPv6 subnet (the IPv6 gateway's, at
    /// `ipv6_prefix_length`), if it has an IPv6 gateway.
    pub fn ipv6_subnet(&self) -> Option<ipnet::Ipv6Net> {
        let gw = self.ipv6_gateway?;
        ipnet::Ipv6Net::new(gw, self.ipv6_prefix_length)
            .ok()
            .map(|n| n.trunc())
    }
}

/// Default `network.ipv6_prefix_length`: a VM network's IPv6 subnet is
/// a /64 (SLAAC needs one).
pub const DEFAULT_IPV6_PREFIX_LENGTH: u8 = 64;

/// `[keepalived]`: this host's part in VRRP for the VM-network VIPs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KeepalivedSettings {
    /// This host's name (`router_id`).
    pub name: String,
    /// This host's management address (`unicast_src_ip`).
    pub address: IpAddr,
    /// The management interface: VRRP adverts go out of it only, unicast
    /// to `peers`, never onto a tenant's network.
    pub interface: String,
    /// The other hosts' management addresses (`unicast_peer`), sorted.
    pub peers: Vec<IpAddr>,
    /// How many VRRP instances the VIPs are spread over.
    pub instances: u8,
    /// The virtual router id of instance 0; instance n has `vrid_base + n`.
    pub vrid_base: u8,
    /// VRRP advertisement interval (VRRP version 3: centiseconds).
    pub advert_interval: Duration,
    /// The VRRP version (2 or 3) of every instance (`global_defs
    /// vrrp_version`): every host of the segment must speak the same one.
    pub vrrp_version: u8,
    /// Where the rendered file is written.
    pub config_path: PathBuf,
    /// keepalived's pid file: a changed file is followed by SIGHUP to it.
    pub pid_file: PathBuf,
    /// Run instead of the SIGHUP when set (e.g. `systemctl reload keepalived`).
    pub reload_command: Option<Vec<String>>,
    /// The management network's gateway the reachability check pings
    /// besides the peers (`host::vmnet::mgmt_check`); `None`: the script asks the
    /// host's default route through `interface` each time it runs, so the
    /// last host alive keeps its VIPs while its gateway answers.
    pub management_gateway: Option<IpAddr>,
    /// Where the reachability check's script is written (mode 0700, for
    /// keepalived's `enable_script_security`).
    pub management_check_script: PathBuf,
    /// `keepalived.management_vips`: whether the VIPs of load balancers on
    /// no `[[network]]` (the management network's, Harvester's default)
    /// are moved by this keepalived too, on `interface`
    /// ([`Config::keepalived_interface`]). `false` for a site that holds
    /// them by other means (kube-vip during a migration, a hand-written
    /// keepalived instance).
    pub management_vips: bool,
    /// `keepalived.ready_requires_backend`: the rendered track scripts ask
    /// `/readyz?vrrp_instance=VRID&require=backend`, so an instance one of
    /// whose VIPs has no listener bound with an eligible backend here moves
    /// to a host whose backends answer.
    pub ready_requires_backend: bool,
    /// `keepalived.management_table`: the routing table of the management
    /// VIPs' leg on a bridged `interface` (`host::vmnet::mgmt_leg`): the main
    /// table's routes out of `interface`, rewritten onto the leg, which
    /// the management VIPs' kernel-forwarded flows are routed by (mark
    /// [`reply_mark_of`] this table). No `[[network]]` may use it or its
    /// mark.
    pub management_table: u32,
}

impl Config {
    /// The interface the keepalived this daemon configures puts `lb`'s VIP
    /// on, or `None` when that keepalived does not move it: its
    /// `[[network]]`'s interface; or, for a load balancer on no network,
    /// `keepalived.interface` (the management network) when
    /// [`KeepalivedSettings::moves_management_vip`] says so. The one
    /// answer keepalived's file, its track scripts, conntrackd's filter,
    /// the gates and the VIP guard are computed from.
    pub fn keepalived_interface(&self, lb: &LoadBalancerSpec) -> Option<&str> {
        let k = self.keepalived.as_ref()?;
        if lb.dhcp.is_some() {
            // Leased: held by the lease path on its own macvlan.
            return None;
        }
        match &lb.network {
            Some(name) => self
                .networks
                .iter()
                .find(|n| &n.name == name)
                .map(|n| n.interface.as_str()),
            None => k
                .moves_management_vip(lb, &self.vip.announce)
                .then_some(k.interface.as_str()),
        }
    }
}

impl KeepalivedSettings {
    /// Whether `lb`, a load balancer on no `[[network]]`, is a management
    /// VIP this keepalived moves on `interface`: `management_vips` is on,
    /// its VIP is the pool's or static (not leased by DHCP: the lease path
    /// holds that one), no route announces VIPs (`vip.announce =
    /// "routes"`: every host holds them, anycast), and it is no loopback
    /// or unspecified address (local to every host already; tests use
    /// them).
    pub fn moves_management_vip(&self, lb: &LoadBalancerSpec, announce: &AnnounceSettings) -> bool {
        let vip = lb.vip.to_canonical();
        self.management_vips
            && lb.network.is_none()
            && lb.ipam != Ipam::Dhcp
            && lb.dhcp.is_none()
            && !announce.enabled()
            && !vip.is_loopback()
            && !vip.is_unspecified()
    }

    /// Every host's management address, this one's included, sorted: the
    /// same list on every host, which the priorities are rotated over.
    pub fn hosts(&self) -> Vec<IpAddr> {
        let mut all = self.peers.clone();
        all.push(self.address);
        all.sort();
        all.dedup();
        all
    }
}

//! `[keepalived]`: the VRRP settings (peers, names, VRIDs, version and
//! advert interval), the management VIPs' routing table and whether it
//! clashes with a network's, and the `admin.socket` path the rendered
//! track scripts quote. Its own file because it is the one table of the
//! VIPs keepalived moves that is not a network; `vmnet` checks the
//! `[[network]]`s and how load balancers sit on them.

use std::net::IpAddr;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::time::Duration;

use toml::Spanned;

use super::Validator;
use super::vmnet::host_address_problem;
use crate::config::file::{FileConfig, FileKeepalived};
use crate::config::{
    DEFAULT_ADVERT_INTERVAL_MS, DEFAULT_KEEPALIVED_CONFIG, DEFAULT_KEEPALIVED_PID_FILE,
    DEFAULT_MANAGEMENT_CHECK_SCRIPT, DEFAULT_MANAGEMENT_TABLE, DEFAULT_MANAGEMENT_VIPS,
    DEFAULT_READY_REQUIRES_BACKEND, DEFAULT_VRID_BASE, DEFAULT_VRRP_VERSION, KeepalivedSettings,
    NetworkSpec, VipSettings,
};

/// Most peers: VRRP priorities are rotated over the hosts in steps of
/// [`PRIORITY_STEP`] below 250, and must stay above 0.
pub const MAX_KEEPALIVED_PEERS: usize = 15;
/// Longest `keepalived.name` (`router_id`): a DNS name.
const MAX_ROUTER_ID_BYTES: usize = 253;

impl Validator<'_> {
    /// `[keepalived]`.
    pub(super) fn keepalived(
        &mut self,
        file: &FileConfig,
        vip: &VipSettings,
    ) -> Option<KeepalivedSettings> {
        let table = file.keepalived.as_ref()?;
        let span = table.span();
        let k: &FileKeepalived = table.get_ref();
        let key = "keepalived";
        let name = self.keepalived_name(k, &span);
        let address = match &k.address {
            None => {
                self.missing(span.clone(), key, "address", "this host's address on the management network, which VRRP adverts are sent from");
                None
            }
            Some(a) => self.ip(a, format_args!("keepalived.address")).filter(|ip| {
                let Some(why) = host_address_problem(*ip) else {
                    return true;
                };
                self.problem(Some(a.span()), "keepalived.address", format!("{ip} cannot be this host's management address: it is {why}; write the host's own unicast address on keepalived.interface"));
                false
            }),
        };
        let interface = match &k.interface {
            None => {
                self.missing(
                    span.clone(),
                    key,
                    "interface",
                    "the management interface VRRP adverts go out of, e.g. \"mgmt-br\"",
                );
                None
            }
            Some(i) => self.rendered_interface(i, format_args!("keepalived.interface")),
        };
        let peers = self.keepalived_peers(k, &span, address);
        let hosts = peers.len() + 1;
        let instances = self.int(
            &k.instances,
            format_args!("keepalived.instances"),
            hosts.min(255) as i64,
            1,
            255,
        );
        let vrid_base = self.int(
            &k.vrid_base,
            format_args!("keepalived.vrid_base"),
            i64::from(DEFAULT_VRID_BASE),
            1,
            255,
        );
        if vrid_base + instances - 1 > 255 {
            self.problem(
                k.instances.as_ref().or(k.vrid_base.as_ref()).map(Spanned::span).or(Some(span.clone())),
                "keepalived.instances",
                format!(
                    "{instances} instances from vrid_base {vrid_base} need VRIDs up to {}, past 255 (VRRP's one-byte field); lower vrid_base or instances",
                    vrid_base + instances - 1
                ),
            );
        }
        let advert = self.int(
            &k.advert_interval_ms,
            format_args!("keepalived.advert_interval_ms"),
            i64::from(DEFAULT_ADVERT_INTERVAL_MS),
            10,
            40_950,
        );
        let vrrp_version = self.vrrp_version(k, advert);
        let config_path = self.abs_path(
            &k.config_path,
            "keepalived.config_path",
            DEFAULT_KEEPALIVED_CONFIG,
        );
        let pid_file = self.abs_path(
            &k.pid_file,
            "keepalived.pid_file",
            DEFAULT_KEEPALIVED_PID_FILE,
        );
        self.track_script_socket(file);
        let management_gateway = self.management_gateway(k, address, &peers);
        let management_check_script = self.management_check_script(k, &config_path);
        let reload_command = self.reload_command(k);
        let management_vips = k
            .management_vips
            .as_ref()
            .map_or(DEFAULT_MANAGEMENT_VIPS, |b| *b.get_ref());
        let ready_requires_backend = k
            .ready_requires_backend
            .as_ref()
            .map_or(DEFAULT_READY_REQUIRES_BACKEND, |b| *b.get_ref());
        let management_table = self.management_table(k, vip);
        Some(KeepalivedSettings {
            name: name?,
            address: address?,
            interface: interface?,
            peers,
            instances: instances as u8,
            vrid_base: vrid_base as u8,
            advert_interval: Duration::from_millis(advert as u64),
            vrrp_version,
            config_path,
            pid_file,
            reload_command,
            management_gateway,
            management_check_script,
            management_vips,
            ready_requires_backend,
            management_table,
        })
    }

    /// `keepalived.name`, keepalived's `router_id`.
    fn keepalived_name(&mut self, k: &FileKeepalived, span: &Range<usize>) -> Option<String> {
        let key = "keepalived";
        let span = span.clone();
        match &k.name {
            None => {
                self.missing(
                    span.clone(),
                    key,
                    "name",
                    "this host's name, keepalived's router_id",
                );
                None
            }
            Some(n) => {
                let s = n.get_ref();
                if s.is_empty() || s.len() > MAX_ROUTER_ID_BYTES {
                    self.problem(
                        Some(n.span()),
                        "keepalived.name",
                        format!("{s:?} is not a host name (1..={MAX_ROUTER_ID_BYTES} bytes, no spaces, quotes or braces)"),
                    );
                    None
                } else if self.conf_word(n, "keepalived.name") {
                    Some(s.clone())
                } else {
                    None
                }
            }
        }
    }

    /// `keepalived.peers`, sorted: the other hosts' management addresses,
    /// each a unicast address of `address`'s family, listed once.
    fn keepalived_peers(
        &mut self,
        k: &FileKeepalived,
        span: &Range<usize>,
        address: Option<IpAddr>,
    ) -> Vec<IpAddr> {
        let key = "keepalived";
        let span = span.clone();
        let mut peers = Vec::new();
        match &k.peers {
            None => self.missing(
                span.clone(),
                key,
                "peers",
                "the other hosts' management addresses, e.g. [\"192.168.0.12\"]",
            ),
            Some(list) => {
                let values = list.get_ref();
                if values.is_empty() {
                    self.problem(Some(list.span()), "keepalived.peers", "is empty; list the other hosts' management addresses (VRRP with no peer moves nothing)".into());
                }
                if values.len() > MAX_KEEPALIVED_PEERS {
                    self.problem(Some(list.span()), "keepalived.peers", format!("{} peers; at most {MAX_KEEPALIVED_PEERS} (priorities are rotated over the hosts in steps of 10 below 250)", values.len()));
                }
                for (j, v) in values.iter().enumerate() {
                    let pkey = format!("keepalived.peers[{j}]");
                    let Some(ip) = self.ip(v, format_args!("{pkey}")) else {
                        continue;
                    };
                    if let Some(why) = host_address_problem(ip) {
                        self.problem(Some(v.span()), &pkey, format!("{ip} cannot be a peer's management address: it is {why}; list the other hosts' own unicast addresses, e.g. \"192.168.0.12\""));
                    } else if Some(ip) == address {
                        self.problem(Some(v.span()), &pkey, format!("{ip} is keepalived.address, this host's own; list only the other hosts"));
                    } else if peers.contains(&ip) {
                        self.problem(Some(v.span()), &pkey, format!("{ip} is listed twice"));
                    } else if address.is_some_and(|a| a.is_ipv4() != ip.is_ipv4()) {
                        self.problem(Some(v.span()), &pkey, format!("{ip} is not of keepalived.address's family; unicast VRRP needs one family"));
                    } else {
                        peers.push(ip);
                    }
                }
            }
        }
        peers.sort();
        peers
    }

    /// `keepalived.management_gateway`: a router on the management
    /// network, neither this host nor a peer.
    fn management_gateway(
        &mut self,
        k: &FileKeepalived,
        address: Option<IpAddr>,
        peers: &[IpAddr],
    ) -> Option<IpAddr> {
        k.management_gateway.as_ref().and_then(|g| {
            let gkey = "keepalived.management_gateway";
            let ip = self.ip(g, format_args!("{gkey}"))?;
            let why = if let Some(why) = host_address_problem(ip) {
                format!("it is {why}")
            } else if Some(ip) == address {
                "it is keepalived.address, this host's own (the check would always succeed)".into()
            } else if peers.contains(&ip) {
                "it is a peer in keepalived.peers, which the check pings anyway".into()
            } else if address.is_some_and(|a| a.is_ipv4() != ip.is_ipv4()) {
                "it is not of keepalived.address's family".into()
            } else {
                return Some(ip);
            };
            self.problem(Some(g.span()), gkey, format!("{ip} cannot be the management network's gateway: {why}; write the router this host reaches on keepalived.interface, or leave the key out to use the default route's gateway through it"));
            None
        })
    }

    /// `keepalived.management_check_script`: beside the config by
    /// default; one word on keepalived's script line.
    fn management_check_script(&mut self, k: &FileKeepalived, config_path: &Path) -> PathBuf {
        let management_check_script = match &k.management_check_script {
            None => config_path.with_file_name(DEFAULT_MANAGEMENT_CHECK_SCRIPT),
            some => self.abs_path(
                some,
                "keepalived.management_check_script",
                "/etc/keepalived/harvester-lb-management-check",
            ),
        };
        if let Some(s) = &k.management_check_script
            && let Some(c) = s
                .get_ref()
                .chars()
                .find(|c| matches!(c, '\'' | '"' | '\\' | ' ') || c.is_control())
        {
            self.problem(
                Some(s.span()),
                "keepalived.management_check_script",
                format!("{:?} holds {c:?}, which keepalived's script line cannot carry as one word; choose a path without spaces, quotes, backslashes or control characters", s.get_ref()),
            );
        }
        management_check_script
    }

    /// `keepalived.reload_command`: words with an absolute program first.
    fn reload_command(&mut self, k: &FileKeepalived) -> Option<Vec<String>> {
        k.reload_command.as_ref().and_then(|c| {
            let words: Vec<String> = c.get_ref().iter().map(|w| w.get_ref().clone()).collect();
            if words.first().is_none_or(|w| !w.starts_with('/')) || words.iter().any(|w| w.contains('\0')) {
                self.problem(
                    Some(c.span()),
                    "keepalived.reload_command",
                    format!("{words:?} is not a command; write its words with an absolute program path first, e.g. [\"/usr/bin/systemctl\", \"reload\", \"keepalived\"]"),
                );
                None
            } else {
                Some(words)
            }
        })
    }

    /// `keepalived.management_table`: a table the kernel does not reserve,
    /// not `vip.announce_table` (a `[[network]]`'s table or mark is refused
    /// by [`Self::management_table_clash`]): the management VIPs' flows are
    /// routed by it with its mark (`host::vmnet::mgmt_leg`), and a network's on the
    /// same mark would route them into that network.
    fn management_table(&mut self, k: &FileKeepalived, vip: &VipSettings) -> u32 {
        let key = "keepalived.management_table";
        let Some(t) = &k.management_table else {
            return DEFAULT_MANAGEMENT_TABLE;
        };
        let n = *t.get_ref();
        let table = match u32::try_from(n) {
            Ok(n) if n != 0 && !(253..=255).contains(&n) => n,
            _ => {
                self.problem(
                    Some(t.span()),
                    key,
                    format!("{n} cannot be the management VIPs' routing table; use 1..=252 or 256..=4294967295 (0 is unspecified, 253 default, 254 main, 255 local)"),
                );
                return DEFAULT_MANAGEMENT_TABLE;
            }
        };
        if table == vip.announce.table {
            self.problem(
                Some(t.span()),
                key,
                format!("table {table} is vip.announce_table too; give the management VIPs' leg its own table"),
            );
        }
        table
    }

    /// A `[[network]]` whose table is `keepalived.management_table` or
    /// gives its mark: refused at the network's `table` (or the network,
    /// when its table is the default), after both are built.
    pub(super) fn management_table_clash(
        &mut self,
        file: &FileConfig,
        networks: &[NetworkSpec],
        keepalived: Option<&KeepalivedSettings>,
    ) {
        let Some(k) = keepalived else {
            return;
        };
        let mark = crate::config::reply_mark_of(k.management_table);
        for (i, n) in file.networks.iter().enumerate() {
            let name = n.get_ref().name.as_ref().map(|s| s.get_ref());
            let Some(spec) = networks.iter().find(|s| Some(&s.name) == name) else {
                continue;
            };
            let why = if spec.table == k.management_table {
                format!(
                    "table {} is keepalived.management_table too (the management VIPs' leg's table, default {DEFAULT_MANAGEMENT_TABLE})",
                    spec.table
                )
            } else if crate::config::reply_mark_of(spec.table) == mark {
                format!(
                    "table {} gives this network the mark {mark:#x}, as keepalived.management_table {} does (a table's mark is 1 + (table - 1) mod 255)",
                    spec.table, k.management_table
                )
            } else {
                continue;
            };
            self.problem(
                n.get_ref().table.as_ref().map(Spanned::span).or(Some(n.span())),
                &format!("network[{i}].table"),
                format!("{why}; give the network another table, or set keepalived.management_table to one no network uses"),
            );
        }
    }

    /// `keepalived.vrrp_version`, and whether `advert` (ms) is one that
    /// version can carry: version 3 counts centiseconds, version 2 whole
    /// seconds (keepalived rounds a sub-second `advert_int` of version 2 up
    /// to 1 s, so the interval written would not be the one in force).
    fn vrrp_version(&mut self, k: &FileKeepalived, advert: i64) -> u8 {
        let version = self.int(
            &k.vrrp_version,
            format_args!("keepalived.vrrp_version"),
            i64::from(DEFAULT_VRRP_VERSION),
            2,
            3,
        );
        let Some(a) = &k.advert_interval_ms else {
            return version as u8;
        };
        if version == 2 && advert % 1000 != 0 {
            self.problem(
                Some(a.span()),
                "keepalived.advert_interval_ms",
                format!(
                    "{advert} ms with vrrp_version = 2: VRRP version 2 counts adverts in whole seconds, and keepalived rounds {advert} ms to a whole second, so the failover time would not be the one configured; set vrrp_version = 3 (the default: centiseconds, e.g. 500 for failovers under 2 s) or a multiple of 1000"
                ),
            );
        } else if version == 2 && advert > 255_000 {
            self.problem(
                Some(a.span()),
                "keepalived.advert_interval_ms",
                format!("{advert} ms with vrrp_version = 2: version 2's field holds at most 255 s (255000)"),
            );
        } else if advert % 10 != 0 {
            self.problem(
                Some(a.span()),
                "keepalived.advert_interval_ms",
                format!("{advert} is not a multiple of 10; VRRP version 3 counts in centiseconds"),
            );
        }
        version as u8
    }

    /// `admin.socket` as the rendered track scripts quote it: in single
    /// quotes (keepalived splits a script's words at unquoted spaces), so
    /// a path with spaces works, and one with a quote, a backslash or a
    /// control character cannot be written there and is refused.
    fn track_script_socket(&mut self, file: &FileConfig) {
        let Some(s) = &file.admin.socket else { return };
        let path = s.get_ref();
        if let Some(c) = path
            .chars()
            .find(|c| matches!(c, '\'' | '"' | '\\') || c.is_control())
        {
            self.problem(
                Some(s.span()),
                "admin.socket",
                format!(
                    "{path:?} holds {c:?}, which keepalived's script line cannot carry: with [keepalived] the daemon writes this path into each instance's track script (`curl --unix-socket '<path>'`); choose a path without quotes, backslashes or control characters (spaces are fine)"
                ),
            );
        }
    }
}

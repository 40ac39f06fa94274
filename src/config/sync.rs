//! `[conntrackd]`: conntrack state shared between the two keepalived hosts,
//! so a kernel listener's open connections survive their VIP's move (see
//! docs/vip.md, "Open connections across a VIP's move").
//!
//! Only the validated type lives here; `validate::sync` builds it,
//! `host::conntrack_sync::conntrackd` renders conntrackd's file and the notify script, and
//! `host::conntrack_sync::gate` owns the gate table.

use std::net::Ipv4Addr;
use std::path::PathBuf;

/// Default `conntrackd.port`: the port of conntrack-tools' own examples.
pub const DEFAULT_SYNC_PORT: u16 = 3780;
/// Default `conntrackd.multicast_group`: the group of conntrack-tools' own
/// examples (outside 224.0.0.0/24, which routers and switches treat as
/// link-local control traffic and flood).
pub const DEFAULT_MULTICAST_GROUP: Ipv4Addr = Ipv4Addr::new(225, 0, 0, 50);
/// Default `conntrackd.config_path`: where Debian's conntrackd unit reads
/// its file.
pub const DEFAULT_CONNTRACKD_CONFIG: &str = "/etc/conntrackd/conntrackd.conf";
/// Default `conntrackd.notify_script`: beside keepalived's own file, in a
/// directory only root may write (keepalived's `enable_script_security`
/// refuses a script anyone else could change).
pub const DEFAULT_NOTIFY_SCRIPT: &str = "/etc/keepalived/harvester-lb-sync.sh";
/// Default `conntrackd.socket`: conntrackd's own default control socket.
pub const DEFAULT_CONNTRACKD_SOCKET: &str = "/run/conntrackd.ctl";
/// Default `conntrackd.lock_file`: conntrackd's own default.
pub const DEFAULT_CONNTRACKD_LOCK: &str = "/run/lock/conntrack.lock";
/// Default `conntrackd.log_file`.
pub const DEFAULT_CONNTRACKD_LOG: &str = "/var/log/conntrackd.log";
/// Default `conntrackd.state_directory`: where the notify script leaves
/// each VRRP instance's last transition and commit for the daemon to read.
/// Root's (the script makes it, 0755, its files 0644), and not under the
/// unit's `/run/harvester-lb`, which systemd empties at every stop of the
/// daemon: a restarted daemon would find no instance master and close
/// every gate, dropping its VIPs' new flows until the next transition.
pub const DEFAULT_SYNC_STATE_DIR: &str = "/run/harvester-lb-sync";
/// Default `conntrackd.hash_size`. conntrackd 1.4.7 ignores the flush
/// (`-f`) that follows a commit while the commit is "still in progress"
/// with a hash of 8192 buckets or fewer (Debian's shipped file has 8192);
/// above it the flush is taken.
pub const DEFAULT_HASH_SIZE: u32 = 32_768;
/// The smallest `conntrackd.hash_size` accepted (see [`DEFAULT_HASH_SIZE`]).
pub const MIN_HASH_SIZE: u32 = 8193;

/// How conntrackd reaches the other hosts of the sync link
/// (`conntrackd.transport`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncTransport {
    /// UDP to one peer: two hosts only. conntrackd's second `UDP` block is
    /// a redundant link, not a second peer (one of them is active at a
    /// time: measured, a third host got none of the updates in 2 of 3
    /// runs), so a VIP moving to a third host would find none of its
    /// flows there.
    Unicast {
        /// The other host's address on the sync link.
        peer: Ipv4Addr,
    },
    /// UDP to a multicast group joined on the sync link: every host gets
    /// every update, whatever their number (the default with more than
    /// one keepalived peer). The link must carry the group: IGMP allowed
    /// and a querier on the VLAN, or snooping off.
    Multicast {
        /// The IPv4 group (`conntrackd.multicast_group`).
        group: Ipv4Addr,
    },
}

impl SyncTransport {
    /// Where this host sends its updates: the peer, or the group.
    pub fn destination(&self) -> Ipv4Addr {
        match *self {
            Self::Unicast { peer } => peer,
            Self::Multicast { group } => group,
        }
    }

    /// The value of `conntrackd.transport` this is.
    pub fn name(&self) -> &'static str {
        match self {
            Self::Unicast { .. } => "unicast",
            Self::Multicast { .. } => "multicast",
        }
    }
}

/// `[conntrackd]`: this host's conntrackd, syncing the flows of its kernel
/// listeners with the other hosts over FTFW (UDP unicast to one peer, or
/// multicast to any number).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ConntrackdSettings {
    /// The interface of the sync link: a dedicated link, or the management
    /// one (`keepalived.interface`, the default).
    pub interface: String,
    /// This host's address on the sync link (default `keepalived.address`).
    pub address: Ipv4Addr,
    /// To whom: the one peer (default the one `keepalived.peers`), or a
    /// multicast group (default with more than one keepalived peer).
    pub transport: SyncTransport,
    /// The UDP port every end uses (conntrackd's `Port`, or the multicast
    /// block's `Group`).
    pub port: u16,
    /// Where the rendered conntrackd.conf is written.
    pub config_path: PathBuf,
    /// Where the rendered notify script is written (keepalived runs it at
    /// every transition of every instance).
    pub notify_script: PathBuf,
    /// conntrackd's control socket (`UNIX { Path }`): every control call
    /// names the file with `-C`, so it reaches this conntrackd.
    pub socket: PathBuf,
    /// conntrackd's lock file.
    pub lock_file: PathBuf,
    /// conntrackd's log file.
    pub log_file: PathBuf,
    /// Where the notify script records each instance's last transition and
    /// commit (read by the daemon for `/status` and the metrics).
    pub state_directory: PathBuf,
    /// conntrackd's `HashSize` (see [`MIN_HASH_SIZE`]).
    pub hash_size: u32,
    /// Run after the file changed (conntrackd reads it only at start), e.g.
    /// `systemctl restart conntrackd`; `None`: the change is logged and
    /// waits for the next start of conntrackd.
    pub restart_command: Option<Vec<String>>,
}

//! One object, one daemon: claims on the host objects that have a single
//! name per network namespace.
//!
//! Several objects the daemon owns are named by the host, not by the
//! daemon's config: the nftables tables `inet harvester_lb_vmnet` (the
//! VM-network guard), `inet harvester_lb_reply` (the reply marks, with
//! their `fwmark` rules) and `inet harvester_lb_gate` (the sync gate), the
//! VM networks' `from VIP` rules (every `proto 252` rule from a host
//! address is read back as ours) with their tables, and an announce table.
//! Each owner writes its object whole and repairs what differs, so two
//! daemons on one host would overwrite each other every check, each
//! reporting its own object in force: a tenant's guard held 4 of 22 times.
//!
//! A [`Claim`] is an abstract Unix socket named after the object, bound and
//! listening while the daemon holds it. The kernel keeps one such name per
//! network namespace and removes it when the process ends (even by
//! `SIGKILL`), so a claim never outlives its holder and needs no file. Who
//! connects is told the holder's config file and admin socket (and learns
//! its pid from `SO_PEERCRED`), so a refusal names the first daemon.
//!
//! The daemon takes the claims its config needs ([`needed`]) at start,
//! before any kernel object is written, and refuses to start when another
//! live daemon holds one; a reload that newly needs a held one is refused
//! the same way, the running config staying in force. An object no longer
//! needed is released once the daemon has removed it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::config::{Config, Forwarding};

/// An object that one daemon per network namespace may own.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Object {
    /// The VM-network guard table `inet harvester_lb_vmnet`.
    VmNetworkGuard,
    /// The VM networks' routing tables and their `from VIP` rules.
    NetworkRoutes,
    /// The reply-mark table `inet harvester_lb_reply` and its `fwmark`
    /// rules.
    ReplyMarks,
    /// The sync gate table `inet harvester_lb_gate`.
    SyncGate,
    /// An announce table (`vip.announce_table`), its routes and the VIPs'
    /// local routes with its number as metric.
    AnnounceTable(u32),
}

impl Object {
    /// The abstract socket's name (without the leading NUL).
    fn socket_name(self) -> String {
        match self {
            Object::VmNetworkGuard => "harvester-lb/nft/inet harvester_lb_vmnet".into(),
            Object::NetworkRoutes => "harvester-lb/vm-network-routes".into(),
            Object::ReplyMarks => "harvester-lb/nft/inet harvester_lb_reply".into(),
            Object::SyncGate => "harvester-lb/nft/inet harvester_lb_gate".into(),
            Object::AnnounceTable(t) => format!("harvester-lb/announce-table/{t}"),
        }
    }

    /// What the operator can do about a refusal.
    fn advice(self) -> &'static str {
        match self {
            Object::AnnounceTable(_) => "give each daemon its own vip.announce_table",
            Object::VmNetworkGuard
            | Object::NetworkRoutes
            | Object::ReplyMarks
            | Object::SyncGate => {
                "one daemon per host serves the VM networks ([[network]], [conntrackd]): put every network's load balancers in that daemon's file, or stop the other one"
            }
        }
    }
}

impl fmt::Display for Object {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Object::VmNetworkGuard => {
                f.write_str("the VM-network guard table inet harvester_lb_vmnet")
            }
            Object::NetworkRoutes => {
                f.write_str("the VM networks' routing tables and `from VIP` rules (proto 252)")
            }
            Object::ReplyMarks => {
                f.write_str("the reply-mark table inet harvester_lb_reply and its fwmark rules")
            }
            Object::SyncGate => f.write_str("the sync gate table inet harvester_lb_gate"),
            Object::AnnounceTable(t) => write!(f, "announce table {t}"),
        }
    }
}

/// The claims `config` needs: those of the objects the daemon writes for
/// it. Pure.
pub fn needed(config: &Config) -> BTreeSet<Object> {
    let mut out = BTreeSet::new();
    if config.networks.iter().any(|n| n.isolate) {
        out.insert(Object::VmNetworkGuard);
    }
    let on_network = || {
        config
            .load_balancers
            .iter()
            .filter(|lb| lb.network.is_some())
    };
    if on_network().next().is_some() {
        out.insert(Object::NetworkRoutes);
    }
    let kernel = |lb: &&std::sync::Arc<crate::config::LoadBalancerSpec>| {
        lb.listeners
            .iter()
            .any(|l| l.forwarding == Forwarding::Kernel)
    };
    if on_network().any(|lb| kernel(&lb)) {
        out.insert(Object::ReplyMarks);
    }
    // A management VIP's kernel listener may need the management VIPs'
    // leg (`host::vmnet::mgmt_leg`: whether it does is the host's fact, a bridge),
    // whose table and marks are of these kinds.
    if config
        .load_balancers
        .iter()
        .any(|lb| lb.network.is_none() && config.keepalived_interface(lb).is_some() && kernel(&lb))
    {
        out.insert(Object::NetworkRoutes);
        out.insert(Object::ReplyMarks);
    }
    if config.conntrackd.is_some() {
        out.insert(Object::SyncGate);
    }
    out
}

/// Who a daemon is, as it tells whoever asks who holds its claims.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Identity {
    /// Its config file.
    pub config: Option<PathBuf>,
    /// Its admin Unix socket.
    pub admin_socket: Option<PathBuf>,
}

impl Identity {
    /// A daemon started with `config`, its admin socket at `admin_socket`.
    pub fn new(config: &Path, admin_socket: &Path) -> Self {
        Self {
            config: Some(config.to_path_buf()),
            admin_socket: Some(admin_socket.to_path_buf()),
        }
    }

    /// The answer written to each asker: one `key=value` line each.
    fn render(&self) -> String {
        let mut s = String::new();
        for (key, value) in [
            ("config", &self.config),
            ("admin_socket", &self.admin_socket),
        ] {
            if let Some(v) = value {
                // A newline in a path would end the value early: cut there.
                let v = v.display().to_string();
                let v = v.split('\n').next().unwrap_or_default();
                s += &format!("{key}={v}\n");
            }
        }
        s
    }
}

/// The holder of a claim, as far as it could be learned.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Holder {
    /// Its pid (`SO_PEERCRED`).
    pub pid: Option<i32>,
    /// What it said of itself.
    pub identity: Identity,
}

impl fmt::Display for Holder {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut parts = Vec::new();
        if let Some(p) = self.pid {
            parts.push(format!("pid {p}"));
        }
        if let Some(c) = &self.identity.config {
            parts.push(format!("config {}", c.display()));
        }
        if let Some(s) = &self.identity.admin_socket {
            parts.push(format!("admin socket {}", s.display()));
        }
        if parts.is_empty() {
            f.write_str("a process that did not say who it is")
        } else {
            f.write_str(&parts.join(", "))
        }
    }
}

/// Why a claim could not be taken.
#[derive(Debug, thiserror::Error)]
pub enum ClaimError {
    /// Another live process holds it.
    #[error(
        "{object} is held by another harvester-lb in this network namespace ({holder}); two daemons would overwrite each other's, so this one writes nothing there: {}",
        object.advice()
    )]
    InUse {
        /// The object.
        object: Object,
        /// Who holds it.
        holder: Holder,
    },
    /// The socket could not be made (no `AF_UNIX`?).
    #[error("cannot take the claim on {object} (an abstract Unix socket): {source}")]
    Socket {
        /// The object.
        object: Object,
        /// What the OS said.
        source: std::io::Error,
    },
}

/// How long an asker waits for the holder to say who it is.
const ASK_TIMEOUT: Duration = Duration::from_secs(2);

/// This process's claim on one [`Object`]; released when dropped.
#[derive(Debug)]
pub struct Claim {
    object: Object,
    /// Answers (and closes) the connections of those asking who holds it.
    task: tokio::task::JoinHandle<()>,
}

impl Claim {
    /// Takes the claim on `object`, telling askers `identity`;
    /// [`ClaimError::InUse`] when another live process holds it. Needs a
    /// tokio runtime.
    pub async fn take(object: Object, identity: &Identity) -> Result<Self, ClaimError> {
        use std::os::linux::net::SocketAddrExt;
        let socket = |source| ClaimError::Socket { object, source };
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(object.socket_name())
            .map_err(socket)?;
        let listener = match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(ClaimError::InUse {
                    object,
                    holder: Self::holder(&addr).await,
                });
            }
            Err(e) => return Err(socket(e)),
        };
        listener.set_nonblocking(true).map_err(socket)?;
        let listener = tokio::net::UnixListener::from_std(listener).map_err(socket)?;
        let answer = identity.render();
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((mut stream, _)) => {
                        let answer = answer.clone();
                        tokio::spawn(async move {
                            // The asker may be gone already: nothing to do then.
                            let _ = tokio::time::timeout(ASK_TIMEOUT, async {
                                stream.write_all(answer.as_bytes()).await?;
                                stream.shutdown().await
                            })
                            .await;
                        });
                    }
                    Err(e) => {
                        tracing::debug!(%object, error = %e, "claim: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        Ok(Self { object, task })
    }

    /// Who listens on `addr`: its pid (`SO_PEERCRED`) and what it says.
    async fn holder(addr: &std::os::unix::net::SocketAddr) -> Holder {
        let mut holder = Holder::default();
        let Ok(stream) = std::os::unix::net::UnixStream::connect_addr(addr) else {
            return holder;
        };
        if stream.set_nonblocking(true).is_err() {
            return holder;
        }
        let Ok(mut stream) = tokio::net::UnixStream::from_std(stream) else {
            return holder;
        };
        holder.pid = stream.peer_cred().ok().and_then(|c| c.pid());
        let mut text = Vec::new();
        let mut limited = (&mut stream).take(4096);
        let read = limited.read_to_end(&mut text);
        if let Ok(Ok(_)) = tokio::time::timeout(ASK_TIMEOUT, read).await {
            for line in String::from_utf8_lossy(&text).lines() {
                match line.split_once('=') {
                    Some(("config", v)) => holder.identity.config = Some(v.into()),
                    Some(("admin_socket", v)) => holder.identity.admin_socket = Some(v.into()),
                    _ => {}
                }
            }
        }
        holder
    }

    /// The object claimed.
    pub fn object(&self) -> Object {
        self.object
    }
}

impl Drop for Claim {
    fn drop(&mut self) {
        self.task.abort();
    }
}

/// The claims one daemon holds, and who it says it is.
#[derive(Debug, Default)]
pub struct Claims {
    identity: std::sync::Mutex<Identity>,
    held: tokio::sync::Mutex<Held>,
}

/// The claims held, and those the config last accepted needs.
#[derive(Debug, Default)]
struct Held {
    claims: BTreeMap<Object, Claim>,
    /// What the last successful [`Claims::take_all`] asked for: kept even
    /// while a step of the config before it runs.
    wanted: BTreeSet<Object>,
}

impl Claims {
    /// Sets what askers are told from the next claim on.
    pub fn set_identity(&self, identity: Identity) {
        *self.identity.lock().unwrap_or_else(|p| p.into_inner()) = identity;
    }

    /// Who this daemon says it is.
    pub fn identity(&self) -> Identity {
        self.identity
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Takes every claim of `objects` not held yet (the claims of the
    /// config about to be applied); at the first one another process
    /// holds, releases those this call took and says which and who holds
    /// it (then nothing changed).
    pub async fn take_all(&self, objects: &BTreeSet<Object>) -> Result<(), ClaimError> {
        let mut held = self.held.lock().await;
        self.take_in(&mut held, objects).await?;
        held.wanted = objects.clone();
        Ok(())
    }

    async fn take_in(&self, held: &mut Held, objects: &BTreeSet<Object>) -> Result<(), ClaimError> {
        let identity = self.identity();
        let mut taken = Vec::new();
        for &object in objects {
            if held.claims.contains_key(&object) {
                continue;
            }
            match Claim::take(object, &identity).await {
                Ok(c) => {
                    held.claims.insert(object, c);
                    taken.push(object);
                }
                Err(e) => {
                    for o in taken {
                        held.claims.remove(&o);
                    }
                    return Err(e);
                }
            }
        }
        Ok(())
    }

    /// Holds the claim on `object`, taking it if it is free (e.g. for
    /// removing what a dead predecessor left); `Err` names the holder
    /// otherwise. Taken here, it goes at the next
    /// [`Claims::release_unneeded`] unless a config needs it.
    pub async fn hold(&self, object: Object) -> Result<(), ClaimError> {
        let mut held = self.held.lock().await;
        self.take_in(&mut held, &BTreeSet::from([object])).await
    }

    /// Releases every claim neither the config last accepted needs nor
    /// `still` (what the config just put in force needs): called once the
    /// objects of the others are removed.
    pub async fn release_unneeded(&self, still: &BTreeSet<Object>) {
        let mut held = self.held.lock().await;
        let Held { claims, wanted } = &mut *held;
        claims.retain(|o, _| wanted.contains(o) || still.contains(o));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::config::test_fixtures::{
        ANYCAST, ANYCAST_SYNC, KEEPALIVED, VLAN100, config, db, lb,
    };

    /// An object of its own per test and run (`n` tells the tests apart):
    /// the tests of one binary run in one network namespace, in parallel.
    fn unique(n: u32) -> Object {
        Object::AnnounceTable(4_000_000_000 + n * 1_000_000 + std::process::id() % 1_000_000)
    }

    #[tokio::test]
    async fn a_second_claim_is_refused_naming_the_holder_and_free_once_it_is_dropped() {
        let object = unique(0);
        let first = Identity::new(Path::new("/etc/a.toml"), Path::new("/run/a.sock"));
        let claim = Claim::take(object, &first).await.expect("the first claim");
        assert_eq!(claim.object(), object);
        let e = Claim::take(object, &Identity::default())
            .await
            .expect_err("a second claim");
        let ClaimError::InUse { holder, .. } = &e else {
            panic!("{e}")
        };
        assert_eq!(holder.pid, Some(std::process::id() as i32));
        assert_eq!(holder.identity, first);
        let text = e.to_string();
        assert!(
            text.contains("config /etc/a.toml") && text.contains("admin socket /run/a.sock"),
            "{text}"
        );
        drop(claim);
        // The abort reaches the listener at the task's next poll.
        let mut again = None;
        for _ in 0..100 {
            match Claim::take(object, &Identity::default()).await {
                Ok(c) => {
                    again = Some(c);
                    break;
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(10)).await,
            }
        }
        assert!(again.is_some(), "the claim was not released");
    }

    #[tokio::test]
    async fn take_all_takes_none_when_one_is_held_elsewhere() {
        let held_elsewhere = unique(1);
        let _other = Claim::take(held_elsewhere, &Identity::default())
            .await
            .unwrap();
        let free = unique(2);
        let claims = Claims::default();
        let both = BTreeSet::from([free, held_elsewhere]);
        assert!(claims.take_all(&both).await.is_err());
        assert!(claims.held.lock().await.claims.is_empty());
        // Wanted by the accepted config: kept until a config without it.
        claims.take_all(&BTreeSet::from([free])).await.unwrap();
        claims.release_unneeded(&BTreeSet::new()).await;
        assert_eq!(claims.held.lock().await.claims.len(), 1);
        claims.take_all(&BTreeSet::new()).await.unwrap();
        // Still needed by the config in force until its step removed it.
        claims.release_unneeded(&BTreeSet::from([free])).await;
        assert_eq!(claims.held.lock().await.claims.len(), 1);
        claims.release_unneeded(&BTreeSet::new()).await;
        assert!(claims.held.lock().await.claims.is_empty());
    }

    #[test]
    fn needed_follows_the_config() {
        assert!(needed(&config("load_balancer = []")).is_empty());
        assert_eq!(
            needed(&config(&format!("{ANYCAST}{ANYCAST_SYNC}"))),
            BTreeSet::from([Object::SyncGate])
        );
        let on_network = format!(
            "{KEEPALIVED}\n{VLAN100}\n{}",
            db("backends = [\"10.100.0.21\"]\n")
        );
        assert_eq!(
            needed(&config(&on_network)),
            BTreeSet::from([
                Object::VmNetworkGuard,
                Object::NetworkRoutes,
                Object::ReplyMarks
            ])
        );
        let open = format!(
            "{KEEPALIVED}\n{VLAN100}isolate = false\n{}",
            lb("default/web", "10.100.0.51", "vlan100", &["10.100.0.21"])
        );
        assert_eq!(
            needed(&config(&open)),
            BTreeSet::from([Object::NetworkRoutes])
        );
        // A management VIP's kernel listener: its leg's table and marks.
        let management = format!(
            "{KEEPALIVED}\n{}",
            db("backends = [\"192.168.0.21\"]\n").replace(
                "vip = \"10.100.0.50\"\nnetwork = \"vlan100\"\n",
                "vip = \"192.168.0.50\"\n"
            )
        );
        assert_eq!(
            needed(&config(&management)),
            BTreeSet::from([Object::NetworkRoutes, Object::ReplyMarks])
        );
    }
}

//! Drives one [`Client`]: sockets, timers, the address on the interface,
//! the state file, the numbers and the log.
//!
//! [`drive`] is the loop, written against the [`Net`] trait so that unit
//! tests run it on tokio's paused clock with a scripted server; [`run`]
//! is the whole life of a real client on a macvlan interface.
//!
//! Before an offer or an ACK is handed to the client, the driver reads the
//! host ([`Net::host_view`], at most once per [`HOST_VIEW_MAX_AGE`], so a
//! flood of forged offers costs at most one netlink dump a second) and
//! passes it with the operator's guard to the judge. A refusal is logged
//! once at warning with the server, the address and why, counted in
//! `harvester_lb_dhcp_offers_refused_total{reason}` and kept for `/status`.
//!
//! While a lease is held, the driver follows the rule of [`crate::host::owned`]
//! for the two objects it wrote into the host: every
//! [`crate::host::owned::CHECK_INTERVAL`] [`Net::repair`] reads back the macvlan
//! interface (same name and index, up, on the configured parent, with the
//! client's MAC) and the leased address on it (the lease's prefix,
//! `noprefixroute`), and puts back what another program deleted or
//! changed: the interface made again with the same MAC (so the server still
//! knows the client by its `chaddr`), the address added again. Each repair
//! is logged at warning naming what differed and counted in
//! `harvester_lb_dhcp_repairs_total`; a repair that fails is logged when the
//! failure changes and shown in `/status` (`error`) until a check succeeds.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::{Client, Judge, Output};
use super::guard::HostView;
use super::link::Macvlan;
use super::state::{self, Stored};
use super::wire::{self, Identity, SERVER_PORT};
use super::{socket, unix_now};
use crate::config::{DhcpGuard, DhcpSpec};
use crate::metrics::LeaseStats;
use crate::metrics::stats::LastRefusal;

/// Pause before trying again to set up an interface that failed (the host
/// interface missing, say).
const SETUP_RETRY: Duration = Duration::from_secs(5);
/// How long a reading of the host's addresses and routes is used for
/// judging offers before it is read again.
pub const HOST_VIEW_MAX_AGE: Duration = Duration::from_secs(1);

/// What the loop does I/O with.
pub trait Net {
    /// Why the interface, its address or the host could not be set up,
    /// read or put back.
    type Error: std::fmt::Display + Send;
    /// Sends to 255.255.255.255:67 on the interface.
    fn broadcast(&mut self, packet: &[u8]) -> impl Future<Output = std::io::Result<()>> + Send;
    /// Sends to `server:67` from the leased address.
    fn unicast(
        &mut self,
        packet: &[u8],
        server: Ipv4Addr,
    ) -> impl Future<Output = std::io::Result<()>> + Send;
    /// The next packet; must be cancel-safe.
    fn recv(&mut self, buf: &mut [u8]) -> impl Future<Output = std::io::Result<usize>> + Send;
    /// Puts the lease's address on the interface, or takes it off (`None`).
    fn set_address(
        &mut self,
        address: Option<(Ipv4Addr, u8)>,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// The host's addresses and gateways, for judging an offer.
    fn host_view(&mut self) -> impl Future<Output = Result<HostView, Self::Error>> + Send;
    /// Reads back the interface and the address last set, and puts back
    /// what differs; names what was put back (empty: nothing differed).
    fn repair(&mut self) -> impl Future<Output = Result<Vec<String>, Self::Error>> + Send;
}

/// Why the client's macvlan interface, its address or its sockets could not
/// be set up, read or put back (`HostNet`'s [`Net::Error`]).
#[derive(Debug, thiserror::Error)]
pub enum HostNetError {
    /// The interface or its address: netlink.
    #[error(transparent)]
    Link(#[from] super::link::LinkError),
    /// The socket on the interface for the broadcasts.
    #[error("cannot bind 0.0.0.0:68 on {interface}: {source}")]
    BindInterface {
        /// The macvlan interface.
        interface: String,
        /// The socket's error.
        #[source]
        source: std::io::Error,
    },
    /// The socket on the leased address for the unicasts.
    #[error("cannot bind {address}:68: {source}")]
    BindAddress {
        /// The leased address.
        address: Ipv4Addr,
        /// The socket's error.
        #[source]
        source: std::io::Error,
    },
}

/// Who the client works for, and where it reports.
pub struct Ctx {
    /// The load balancer's name (log field, state file).
    pub name: String,
    /// Its cluster.
    pub cluster: String,
    /// Its `[load_balancer.dhcp]`.
    pub spec: DhcpSpec,
    /// Its state file.
    pub state_file: PathBuf,
    /// The numbers `/metrics` and `/status` show.
    pub stats: Arc<LeaseStats>,
    /// The daemon's repair counters (`host_repairs_total{kind="dhcp_lease"}`).
    pub host_repairs: Arc<crate::metrics::HostRepairs>,
    /// Told whenever the VIP appears, changes or goes.
    pub changed: Arc<Notify>,
    /// Which offers are taken; replaced by a reload without restarting the
    /// client.
    pub guard: Arc<ArcSwap<DhcpGuard>>,
}

impl Ctx {
    fn publish(&self, lease: Option<&super::client::Lease>) {
        let s = &self.stats;
        match lease {
            Some(l) => {
                let now = SystemTime::now();
                let at = |d: Duration| unix_now(now + d.saturating_sub(l.since.elapsed()));
                s.server.store(l.server.into(), Ordering::Relaxed);
                s.prefix.store(l.prefix, Ordering::Relaxed);
                s.expiry.store(at(l.duration).to_bits(), Ordering::Relaxed);
                s.renew_at.store(at(l.t1).to_bits(), Ordering::Relaxed);
                s.address.store(l.address.into(), Ordering::Release);
            }
            None => {
                s.address.store(0, Ordering::Release);
                s.server.store(0, Ordering::Relaxed);
                s.expiry.store(0, Ordering::Relaxed);
                s.renew_at.store(0, Ordering::Relaxed);
            }
        }
    }
}

/// The last reading of the host, reused for [`HOST_VIEW_MAX_AGE`].
#[derive(Default)]
struct HostCache {
    read: Option<(Instant, HostView)>,
}

impl HostCache {
    /// The host now (at most [`HOST_VIEW_MAX_AGE`] old); `None` when it
    /// cannot be read (logged; an offer is then refused, not taken blind).
    async fn get<N: Net>(&mut self, net: &mut N, name: &str) -> Option<&HostView> {
        let fresh = self
            .read
            .as_ref()
            .is_some_and(|(at, _)| at.elapsed() < HOST_VIEW_MAX_AGE);
        if !fresh {
            match net.host_view().await {
                Ok(v) => self.read = Some((Instant::now(), v)),
                Err(e) => {
                    self.read = None;
                    tracing::warn!(load_balancer = %name, error = %e, "cannot read the host's addresses and routes to judge a DHCP offer; it is refused");
                }
            }
        }
        self.read.as_ref().map(|(_, v)| v)
    }
}

/// Runs `client` until `stop`; returns it (for the RELEASE).
pub async fn drive<N: Net>(
    mut client: Client,
    net: &mut N,
    ctx: &Ctx,
    stop: &CancellationToken,
) -> Client {
    let mut buf = vec![0u8; 2048];
    // The address that listeners were last told about, for the log.
    let mut vip: Option<Ipv4Addr> = None;
    let mut host = HostCache::default();
    let mut check = tokio::time::interval_at(
        Instant::now() + crate::host::owned::CHECK_INTERVAL,
        crate::host::owned::CHECK_INTERVAL,
    );
    check.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        ctx.stats
            .phase
            .store(client.phase().index(), Ordering::Relaxed);
        let outputs = tokio::select! {
            biased;
            _ = stop.cancelled() => return client,
            _ = tokio::time::sleep_until(client.deadline()) => client.on_timeout(Instant::now()),
            _ = check.tick() => {
                if ctx.stats.address().is_some() {
                    repair(net, ctx).await;
                }
                Vec::new()
            }
            r = net.recv(&mut buf) => match r {
                Ok(n) => match judged(&mut client, &buf[..n], net, ctx, &mut host).await {
                    Ok(out) => out,
                    Err(why) => {
                        ctx.stats.ignored[why.index()].increment(1);
                        tracing::debug!(load_balancer = %ctx.name, reason = ?why, bytes = n, "DHCP packet ignored");
                        Vec::new()
                    }
                },
                Err(e) => {
                    tracing::warn!(load_balancer = %ctx.name, error = %e, "DHCP socket receive failed");
                    tokio::time::sleep(Duration::from_millis(200)).await;
                    Vec::new()
                }
            },
        };
        for out in outputs {
            apply(out, net, ctx, &mut vip).await;
        }
    }
}

/// Hands the packet `bytes` to `client`, with the host read first when
/// the packet is an offer or ACK it will judge.
async fn judged<N: Net>(
    client: &mut Client,
    bytes: &[u8],
    net: &mut N,
    ctx: &Ctx,
    host: &mut HostCache,
) -> Result<Vec<Output>, super::client::Ignored> {
    let reply = wire::parse(bytes);
    let guard = ctx.guard.load();
    let view = match &reply {
        Ok(r) if client.judges(r, Instant::now()) => host.get(net, &ctx.name).await,
        _ => None,
    };
    client.on_reply(
        reply,
        Instant::now(),
        Judge {
            guard: &guard,
            host: view,
        },
    )
}

/// One read-back of the interface and the leased address: what was put
/// back is logged and counted, a failure kept for `/status` (and logged
/// when it is new or changes, not every check).
async fn repair<N: Net>(net: &mut N, ctx: &Ctx) {
    let result = net.repair().await;
    let mut error = ctx
        .stats
        .host_error
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    match result {
        Ok(repaired) => {
            if !repaired.is_empty() {
                ctx.stats.repairs.increment(1);
                ctx.host_repairs[crate::metrics::HostKind::DhcpLease].increment(1);
                tracing::warn!(load_balancer = %ctx.name, repaired = %repaired.join("; "), "the VIP's macvlan interface or leased address was changed by another program; put back as the lease has it");
            }
            if error.take().is_some() && repaired.is_empty() {
                tracing::info!(load_balancer = %ctx.name, "the VIP's macvlan interface and leased address are in place again");
            }
        }
        Err(e) => {
            let e = e.to_string();
            if error.as_deref() != Some(e.as_str()) {
                tracing::error!(load_balancer = %ctx.name, error = %e, "cannot put back the VIP's macvlan interface or leased address; the VIP may not answer; retrying every 10 s");
            }
            *error = Some(e);
        }
    }
}

async fn apply<N: Net>(out: Output, net: &mut N, ctx: &Ctx, vip: &mut Option<Ipv4Addr>) {
    let name = &ctx.name;
    match out {
        Output::Broadcast(p) => {
            if let Err(e) = net.broadcast(&p).await {
                ctx.stats.send_errors.increment(1);
                tracing::warn!(load_balancer = %name, error = %e, "cannot broadcast a DHCP request");
            }
        }
        Output::Unicast(p, server) => {
            if let Err(e) = net.unicast(&p, server).await {
                ctx.stats.send_errors.increment(1);
                tracing::warn!(load_balancer = %name, %server, error = %e, "cannot send a DHCP request to the server");
            }
        }
        Output::Refused {
            server,
            address,
            prefix,
            reason,
        } => {
            ctx.stats.refused[reason.index()].increment(1);
            let why = reason.explain(&ctx.guard.load());
            let mask = prefix.map_or_else(|| "none".to_string(), |p| format!("/{p}"));
            tracing::warn!(load_balancer = %name, %server, offered = %address, %mask, reason = reason.label(), %why, "DHCP offer refused; this server is not listened to for 60 s, other servers are");
            let at_unix = SystemTime::now()
                .duration_since(SystemTime::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs());
            *ctx.stats
                .last_refusal
                .lock()
                .unwrap_or_else(|p| p.into_inner()) = Some(LastRefusal {
                server,
                address,
                prefix,
                reason: reason.label(),
                why,
                at_unix,
            });
        }
        Output::Nak { reason } => {
            ctx.stats.naks.increment(1);
            tracing::warn!(load_balancer = %name, %reason, "DHCP server said NAK; starting over with DISCOVER");
        }
        Output::Lost { address, reason } => {
            ctx.stats.address_changes.increment(1);
            tracing::warn!(load_balancer = %name, vip = %address, %reason, "VIP lease lost: listeners on it close until a new lease");
            if let Err(e) = net.set_address(None).await {
                tracing::warn!(load_balancer = %name, vip = %address, error = %e, "cannot take the lost VIP off the interface");
            }
            ctx.publish(None);
            ctx.changed.notify_one();
        }
        Output::Leased { lease, renewed } => {
            if renewed {
                ctx.stats.renewals.increment(1);
                tracing::info!(load_balancer = %name, vip = %lease.address, server = %lease.server, lease = ?lease.duration, "DHCP lease renewed");
            } else {
                ctx.stats.acquired.increment(1);
                if let Err(e) = net.set_address(Some((lease.address, lease.prefix))).await {
                    tracing::error!(load_balancer = %name, vip = %lease.address, error = %e, "cannot put the leased VIP on the interface; listeners bind it anyway (IP_FREEBIND)");
                }
                match *vip {
                    Some(old) if old != lease.address => {
                        tracing::warn!(load_balancer = %name, from = %old, to = %lease.address, server = %lease.server, "VIP changed: the DHCP server leased another address; listeners move to it");
                    }
                    _ => {
                        tracing::info!(load_balancer = %name, vip = %lease.address, server = %lease.server, lease = ?lease.duration, t1 = ?lease.t1, t2 = ?lease.t2, "VIP leased");
                    }
                }
                *vip = Some(lease.address);
            }
            ctx.publish(Some(&lease));
            if !renewed {
                ctx.changed.notify_one();
            }
            let stored = Stored {
                load_balancer: ctx.name.clone(),
                cluster: ctx.cluster.clone(),
                mac: state::colons(ctx.spec.mac),
                address: lease.address,
                server: lease.server,
                expires_unix: unix_now(SystemTime::now() + lease.duration),
            };
            if let Err(e) = state::save(&ctx.state_file, &stored) {
                tracing::warn!(load_balancer = %name, file = %ctx.state_file.display(), error = %e, "cannot keep the DHCP lease on disk; a restart will ask for a new one");
            }
        }
    }
}

/// The real network: a macvlan interface and its sockets.
struct HostNet {
    link: Macvlan,
    /// The host interface the macvlan is made on.
    parent: String,
    /// The macvlan's MAC (the client's `chaddr`).
    mac: [u8; 6],
    any: UdpSocket,
    leased: Option<UdpSocket>,
    /// The address last put on the interface, for [`Net::repair`].
    address: Option<(Ipv4Addr, u8)>,
}

impl Net for HostNet {
    type Error = HostNetError;

    async fn broadcast(&mut self, packet: &[u8]) -> std::io::Result<()> {
        self.any
            .send_to(packet, (Ipv4Addr::BROADCAST, SERVER_PORT))
            .await
            .map(|_| ())
    }

    async fn unicast(&mut self, packet: &[u8], server: Ipv4Addr) -> std::io::Result<()> {
        let s = self.leased.as_ref().unwrap_or(&self.any);
        s.send_to(packet, (server, SERVER_PORT)).await.map(|_| ())
    }

    async fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        loop {
            // Readiness first, then a non-blocking read: both waits are
            // cancel-safe and only the ready socket is read.
            let s = match &self.leased {
                None => {
                    self.any.readable().await?;
                    &self.any
                }
                Some(l) => tokio::select! {
                    r = self.any.readable() => { r?; &self.any }
                    r = l.readable() => { r?; l }
                },
            };
            match s.try_recv(buf) {
                Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => continue,
                r => return r,
            }
        }
    }

    async fn set_address(&mut self, address: Option<(Ipv4Addr, u8)>) -> Result<(), HostNetError> {
        self.address = address;
        if let Some(old) = self.leased.take()
            && let Ok(std::net::SocketAddr::V4(a)) = old.local_addr()
        {
            self.link.remove_address(*a.ip()).await?;
        }
        if let Some((a, prefix)) = address {
            self.link.add_address(a, prefix).await?;
            self.leased = Some(
                socket::on_address(a)
                    .map_err(|source| HostNetError::BindAddress { address: a, source })?,
            );
        }
        Ok(())
    }

    async fn host_view(&mut self) -> Result<HostView, HostNetError> {
        Ok(self.link.host_view().await?)
    }

    async fn repair(&mut self) -> Result<Vec<String>, HostNetError> {
        let mut repaired = Vec::new();
        if let Some(what) = self.link.differs(&self.parent, self.mac).await? {
            // Made again whole (`create` removes what has the name), the
            // sockets bound to the new interface, the address put back.
            let link = Macvlan::create(&self.parent, self.mac).await?;
            self.any =
                socket::on_interface(&link.name).map_err(|source| HostNetError::BindInterface {
                    interface: link.name.clone(),
                    source,
                })?;
            self.link = link;
            self.leased = None;
            repaired.push(what);
        }
        if let Some((a, prefix)) = self.address {
            if let Some(what) = self.link.address_differs(a, prefix).await? {
                self.link.remove_address(a).await?;
                self.link.add_address(a, prefix).await?;
                repaired.push(what);
            }
            if self.leased.is_none() {
                self.leased = Some(
                    socket::on_address(a)
                        .map_err(|source| HostNetError::BindAddress { address: a, source })?,
                );
            }
        }
        Ok(repaired)
    }
}

/// How a client's life ends.
#[derive(Debug, Default)]
pub struct Ending {
    /// The load balancer is gone: forget the lease on disk too.
    pub removed: AtomicBool,
    /// A hand-over to the next process (issue 41): no RELEASE, the
    /// macvlan and the address stay, the lease stays on disk.
    pub left: AtomicBool,
}

/// The whole life of one client: interface, lease, and at `stop` the
/// RELEASE and the interface's removal.
pub async fn run(ctx: Ctx, stop: CancellationToken, ending: Arc<Ending>) {
    let mut net = loop {
        match setup(&ctx).await {
            Ok(net) => break net,
            Err(e) => {
                tracing::error!(load_balancer = %ctx.name, interface = %ctx.spec.interface, error = %e, "cannot set up the DHCP client; retrying in 5 s");
                tokio::select! {
                    _ = stop.cancelled() => return,
                    _ = tokio::time::sleep(SETUP_RETRY) => {}
                }
            }
        }
    };
    let kept = state::load(&ctx.state_file);
    let resume = state::resume(
        kept.as_ref(),
        ctx.spec.requested,
        unix_now(SystemTime::now()),
    );
    if let Some(expired) = kept.as_ref().filter(|_| resume.reboot_with.is_none()) {
        tracing::info!(load_balancer = %ctx.name, address = %expired.address, expired_unix = expired.expires_unix, "the kept DHCP lease has expired: asking for its address in a DISCOVER instead of claiming it");
    }
    let last = resume.reboot_with;
    let id = Identity {
        mac: ctx.spec.mac,
        hostname: ctx.spec.hostname.clone(),
    };
    let seed = seed(&ctx.name);
    tracing::info!(load_balancer = %ctx.name, interface = %net.link.name, parent = %ctx.spec.interface, mac = %state::colons(ctx.spec.mac), reboot_with = ?last, "DHCP client started");
    if ctx.spec.servers.is_empty() {
        let guard = ctx.guard.load();
        let ranges = if guard.allowed_ranges.is_empty() {
            "any address (no dhcp.allowed_ranges)".to_string()
        } else {
            format!(
                "addresses in {:?}",
                guard
                    .allowed_ranges
                    .iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
            )
        };
        tracing::warn!(load_balancer = %ctx.name, interface = %ctx.spec.interface, "no [load_balancer.dhcp] servers set: any DHCP server on the segment is trusted to lease this VIP ({ranges}; never the host's own addresses or gateways, nor a mask wider than /{}); set servers = [\"<server identifier>\"] to take answers from named servers only", guard.min_prefix_length);
    }
    let client = Client::new(
        id,
        ctx.spec.servers.clone(),
        last,
        resume.hint,
        seed,
        Instant::now(),
    );
    let mut client = drive(client, &mut net, &ctx, &stop).await;
    if ending.left.load(Ordering::Acquire) {
        tracing::info!(load_balancer = %ctx.name, interface = %net.link.name, "handing over: the lease, its macvlan and its address stay for the next process");
        return;
    }
    let removed = ending.removed.load(Ordering::Acquire);
    if let Some(Output::Unicast(p, server)) = client.release() {
        match net.unicast(&p, server).await {
            Ok(()) => {
                tracing::info!(load_balancer = %ctx.name, %server, removed, "DHCP lease released")
            }
            Err(e) => {
                tracing::warn!(load_balancer = %ctx.name, %server, error = %e, "cannot send DHCPRELEASE")
            }
        }
    }
    ctx.publish(None);
    ctx.changed.notify_one();
    if removed {
        state::remove(&ctx.state_file);
    }
    let name = net.link.name.clone();
    drop(net.leased.take());
    if let Err(e) = net.link.delete().await {
        tracing::warn!(load_balancer = %ctx.name, interface = %name, error = %e, "cannot remove the macvlan interface");
    }
}

async fn setup(ctx: &Ctx) -> Result<HostNet, HostNetError> {
    let link = Macvlan::create(&ctx.spec.interface, ctx.spec.mac).await?;
    let any = socket::on_interface(&link.name).map_err(|source| HostNetError::BindInterface {
        interface: link.name.clone(),
        source,
    })?;
    Ok(HostNet {
        link,
        parent: ctx.spec.interface.clone(),
        mac: ctx.spec.mac,
        any,
        leased: None,
        address: None,
    })
}

/// A seed for transaction ids: different per client and per run.
fn seed(name: &str) -> u64 {
    use std::hash::{BuildHasher, Hash, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    name.hash(&mut h);
    SystemTime::now().hash(&mut h);
    h.finish()
}

#[cfg(test)]
mod tests {
    //! The driver and state machine on tokio's paused clock, against a
    //! scripted server: every timer is exact and the tests take no time.

    use std::sync::Mutex;

    use dhcproto::v4::{DhcpOption, MessageType, OptionCode};

    use super::*;
    use crate::host::dhcp::client::Phase;
    use crate::host::dhcp::wire::{self, ReplyKind, decode_request, server_reply};

    const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
    const SERVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
    const A: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 150);
    const B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 171);
    /// The host's own address and its gateway, as its `host_view` says.
    const HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
    const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

    /// What the fake network saw, and what it will deliver.
    struct Log {
        /// (when, broadcast?, message type, xid, requested/ciaddr).
        sent: Vec<(Instant, bool, MessageType, u32, Ipv4Addr)>,
        address: Option<Ipv4Addr>,
        /// What `host_view` answers (`None`: an error).
        host: Option<HostView>,
        host_reads: usize,
        /// What `repair` answers, and how often it was asked.
        repair: Result<Vec<String>, String>,
        checks: usize,
    }

    impl Default for Log {
        fn default() -> Self {
            Log {
                sent: Vec::new(),
                address: None,
                host: None,
                host_reads: 0,
                repair: Ok(Vec::new()),
                checks: 0,
            }
        }
    }

    struct FakeNet {
        log: Arc<Mutex<Log>>,
        inbox: tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>,
    }

    impl FakeNet {
        fn record(&self, p: &[u8], broadcast: bool) {
            let m = decode_request(p);
            let asked = match m.opts().get(OptionCode::RequestedIpAddress) {
                Some(DhcpOption::RequestedIpAddress(a)) => *a,
                _ => m.ciaddr(),
            };
            let ty = m.opts().msg_type().expect("message type");
            self.log
                .lock()
                .unwrap()
                .sent
                .push((Instant::now(), broadcast, ty, m.xid(), asked));
        }
    }

    impl Net for FakeNet {
        type Error = String;
        async fn broadcast(&mut self, p: &[u8]) -> std::io::Result<()> {
            self.record(p, true);
            Ok(())
        }
        async fn unicast(&mut self, p: &[u8], _: Ipv4Addr) -> std::io::Result<()> {
            self.record(p, false);
            Ok(())
        }
        async fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
            match self.inbox.recv().await {
                Some(p) => {
                    buf[..p.len()].copy_from_slice(&p);
                    Ok(p.len())
                }
                None => std::future::pending().await,
            }
        }
        async fn set_address(&mut self, a: Option<(Ipv4Addr, u8)>) -> Result<(), String> {
            self.log.lock().unwrap().address = a.map(|(a, _)| a);
            Ok(())
        }
        async fn host_view(&mut self) -> Result<HostView, String> {
            let mut log = self.log.lock().unwrap();
            log.host_reads += 1;
            log.host
                .clone()
                .ok_or_else(|| "netlink says no".to_string())
        }
        async fn repair(&mut self) -> Result<Vec<String>, String> {
            let mut log = self.log.lock().unwrap();
            log.checks += 1;
            log.repair.clone()
        }
    }

    struct Harness {
        log: Arc<Mutex<Log>>,
        to_client: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
        stats: Arc<LeaseStats>,
        stop: CancellationToken,
        task: tokio::task::JoinHandle<Client>,
    }

    impl Harness {
        fn start(last: Option<Ipv4Addr>, servers: Vec<Ipv4Addr>) -> Harness {
            Self::start_with(last, servers, DhcpGuard::default())
        }

        fn start_with(last: Option<Ipv4Addr>, servers: Vec<Ipv4Addr>, guard: DhcpGuard) -> Harness {
            let log = Arc::new(Mutex::new(Log {
                host: Some(HostView {
                    local: vec![HOST.into()],
                    gateways: vec![GATEWAY],
                }),
                ..Log::default()
            }));
            let (to_client, inbox) = tokio::sync::mpsc::unbounded_channel();
            let stats = Arc::new(LeaseStats::default());
            let dir = std::env::temp_dir().join(format!("hlb-run-{}", std::process::id()));
            let ctx = Ctx {
                name: "default/web".into(),
                cluster: "kubernetes".into(),
                spec: DhcpSpec {
                    interface: "eth0".into(),
                    mac: MAC,
                    hostname: "web".into(),
                    servers: servers.clone(),
                    requested: None,
                    allowed_ranges: None,
                    min_prefix_length: None,
                },
                state_file: state::path(&dir, MAC),
                stats: Arc::clone(&stats),
                host_repairs: Arc::default(),
                changed: Arc::new(Notify::new()),
                guard: Arc::new(ArcSwap::from_pointee(guard)),
            };
            let client = Client::new(
                Identity {
                    mac: MAC,
                    hostname: "web".into(),
                },
                servers,
                last,
                None,
                42,
                Instant::now(),
            );
            let stop = CancellationToken::new();
            let mut net = FakeNet {
                log: Arc::clone(&log),
                inbox,
            };
            let s2 = stop.clone();
            let task = tokio::spawn(async move { drive(client, &mut net, &ctx, &s2).await });
            Harness {
                log,
                to_client,
                stats,
                stop,
                task,
            }
        }

        fn sent(&self) -> Vec<(Instant, bool, MessageType, u32, Ipv4Addr)> {
            self.log.lock().unwrap().sent.clone()
        }

        fn last(&self) -> (Instant, bool, MessageType, u32, Ipv4Addr) {
            *self.sent().last().expect("something sent")
        }

        fn reply(&self, kind: ReplyKind, xid: u32, address: Ipv4Addr, from: Ipv4Addr) {
            let lease = (kind != ReplyKind::Nak).then_some(120);
            self.to_client
                .send(server_reply(kind, xid, MAC, address, from, lease))
                .unwrap();
        }

        fn address(&self) -> Option<Ipv4Addr> {
            self.log.lock().unwrap().address
        }

        fn phase(&self) -> &'static str {
            self.stats.phase_name()
        }
    }

    /// Lets the driver run everything that is due now.
    async fn settle() {
        for _ in 0..20 {
            tokio::task::yield_now().await;
        }
    }

    async fn bind(h: &Harness, address: Ipv4Addr) {
        settle().await;
        let (_, _, ty, xid, _) = h.last();
        assert_eq!(ty, MessageType::Discover);
        h.reply(ReplyKind::Offer, xid, address, SERVER);
        settle().await;
        let (_, bcast, ty, xid2, asked) = h.last();
        assert_eq!(
            (bcast, ty, xid2, asked),
            (true, MessageType::Request, xid, address)
        );
        h.reply(ReplyKind::Ack, xid, address, SERVER);
        settle().await;
        assert_eq!(h.phase(), "bound");
        assert_eq!(h.address(), Some(address));
    }

    #[tokio::test(start_paused = true)]
    async fn discover_offer_request_ack_then_renew_at_t1_and_rebind_at_t2() {
        let h = Harness::start(None, vec![]);
        let t0 = Instant::now();
        bind(&h, A).await;
        assert_eq!(h.stats.acquired.get(), 1);
        // Nothing until T1 = 60 s (half of 120).
        let before = h.sent().len();
        tokio::time::sleep(Duration::from_secs(59)).await;
        settle().await;
        assert_eq!(h.sent().len(), before);
        tokio::time::sleep(Duration::from_secs(2)).await;
        settle().await;
        let (at, bcast, ty, _, ciaddr) = h.last();
        assert_eq!(
            (bcast, ty, ciaddr),
            (false, MessageType::Request, A),
            "RENEW is unicast"
        );
        assert_eq!(at - t0, Duration::from_secs(60));
        assert_eq!(h.phase(), "renewing");
        // No answer: retransmitted, then at T2 = 105 s broadcast (REBIND).
        tokio::time::sleep(Duration::from_secs(46)).await;
        settle().await;
        let rebinds: Vec<_> = h
            .sent()
            .into_iter()
            .filter(|s| s.1 && s.4 == A && s.0 - t0 > Duration::from_secs(60))
            .collect();
        assert!(!rebinds.is_empty(), "{:?}", h.sent());
        assert_eq!(rebinds[0].0 - t0, Duration::from_secs(105));
        assert_eq!(h.phase(), "rebinding");
        // Any server's ACK extends it; same address, no VIP change.
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Ack, xid, A, SERVER);
        settle().await;
        assert_eq!(h.phase(), "bound");
        assert_eq!(h.stats.renewals.get(), 1);
        assert_eq!(h.stats.address_changes.get(), 0);
        h.stop.cancel();
        let mut client = h.task.await.unwrap();
        assert!(matches!(client.release(), Some(Output::Unicast(_, s)) if s == SERVER));
    }

    #[tokio::test(start_paused = true)]
    async fn a_nak_on_renewal_starts_over_and_the_vip_changes() {
        let h = Harness::start(None, vec![]);
        bind(&h, A).await;
        tokio::time::sleep(Duration::from_secs(61)).await;
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Nak, xid, Ipv4Addr::UNSPECIFIED, SERVER);
        settle().await;
        assert_eq!(h.address(), None, "the VIP comes off at once");
        assert_eq!(h.stats.naks.get(), 1);
        assert_eq!(h.stats.address_changes.get(), 1);
        // After the pause, DISCOVER with a new transaction; a new lease.
        tokio::time::sleep(NAK_PAUSE_FOR_TESTS).await;
        bind(&h, B).await;
        assert_eq!(h.stats.address(), Some(B));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lease_that_nobody_renews_expires() {
        let h = Harness::start(None, vec![]);
        bind(&h, A).await;
        tokio::time::sleep(Duration::from_secs(121)).await;
        settle().await;
        assert_eq!(h.address(), None);
        assert_eq!(h.phase(), "selecting");
        let (_, bcast, ty, _, asked) = h.last();
        assert_eq!(
            (bcast, ty, asked),
            (true, MessageType::Discover, A),
            "asks for the old address"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn init_reboot_asks_for_the_last_address_then_falls_back_to_discover() {
        let h = Harness::start(Some(A), vec![]);
        settle().await;
        let (_, bcast, ty, _, asked) = h.last();
        assert_eq!((bcast, ty, asked), (true, MessageType::Request, A));
        assert_eq!(h.phase(), "rebooting");
        // No answer to three tries (2 + 4 + 8 s): DISCOVER for the same address.
        tokio::time::sleep(Duration::from_secs(15)).await;
        settle().await;
        let reqs = h
            .sent()
            .iter()
            .filter(|s| s.2 == MessageType::Request)
            .count();
        assert_eq!(reqs, 3);
        let (_, _, ty, _, asked) = h.last();
        assert_eq!((ty, asked), (MessageType::Discover, A));

        // And when answered, the ACK binds at once.
        let h = Harness::start(Some(A), vec![]);
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Ack, xid, A, SERVER);
        settle().await;
        assert_eq!(h.phase(), "bound");
        assert_eq!(h.address(), Some(A));
    }

    #[tokio::test(start_paused = true)]
    async fn foreign_malformed_and_rogue_packets_are_counted_never_obeyed() {
        let rogue = Ipv4Addr::new(198, 51, 100, 66);
        let h = Harness::start(None, vec![SERVER]);
        settle().await;
        let (_, _, _, xid, _) = h.last();
        // Another transaction, another client, junk, a server not allowed,
        // an offer of an unusable address.
        h.reply(ReplyKind::Offer, xid ^ 1, A, SERVER);
        h.to_client
            .send(server_reply(
                ReplyKind::Offer,
                xid,
                [2, 9, 9, 9, 9, 9],
                A,
                SERVER,
                Some(120),
            ))
            .unwrap();
        h.to_client.send(vec![1, 2, 3]).unwrap();
        h.reply(ReplyKind::Offer, xid, A, rogue);
        // An ACK while selecting: the right transaction, nothing to act on.
        h.reply(ReplyKind::Ack, xid, A, SERVER);
        settle().await;
        assert_eq!(h.phase(), "selecting");
        assert_eq!(h.address(), None);
        let ignored: Vec<u64> = h.stats.ignored.iter().map(|c| c.get()).collect();
        // malformed, xid, chaddr, rogue, unexpected, quarantined
        assert_eq!(ignored, vec![1, 1, 1, 1, 1, 0]);
        assert_eq!(h.log.lock().unwrap().host_reads, 0, "nothing to judge");
        // Bound, a NAK from a rogue server is ignored too.
        bind(&h, A).await;
        tokio::time::sleep(Duration::from_secs(61)).await;
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Nak, xid, Ipv4Addr::UNSPECIFIED, rogue);
        settle().await;
        assert_eq!(h.address(), Some(A));
        assert_eq!(h.stats.naks.get(), 0);
    }

    #[tokio::test(start_paused = true)]
    async fn discover_backs_off_exponentially_up_to_the_cap() {
        let h = Harness::start(None, vec![]);
        tokio::time::sleep(Duration::from_secs(200)).await;
        settle().await;
        let times: Vec<Instant> = h.sent().iter().map(|s| s.0).collect();
        let gaps: Vec<u64> = times.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
        assert_eq!(&gaps[..6], &[2, 4, 8, 16, 32, 32], "{gaps:?}");
        // One transaction for the whole DISCOVER phase.
        let xids: std::collections::HashSet<u32> = h.sent().iter().map(|s| s.3).collect();
        assert_eq!(xids.len(), 1);
        let _ = wire::MAX_LEASE;
    }

    /// `reply` with its subnet mask option replaced by `mask`.
    fn with_mask(reply: Vec<u8>, mask: Ipv4Addr) -> Vec<u8> {
        use dhcproto::v4::{Decodable, Decoder, Encodable, Encoder, Message};
        let mut m = Message::decode(&mut Decoder::new(&reply)).unwrap();
        m.opts_mut().insert(DhcpOption::SubnetMask(mask));
        let mut buf = Vec::new();
        m.encode(&mut Encoder::new(&mut buf)).unwrap();
        buf
    }

    fn refused(h: &Harness) -> Vec<u64> {
        h.stats.refused.iter().map(|c| c.get()).collect()
    }

    const OTHER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 4);

    #[tokio::test(start_paused = true)]
    async fn an_offer_of_the_hosts_address_is_refused_and_its_server_held_off() {
        let h = Harness::start(None, vec![]);
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Offer, xid, HOST, SERVER);
        settle().await;
        assert_eq!(h.phase(), "selecting", "still selecting: others are heard");
        assert_eq!(h.address(), None);
        // reserved, mask_too_wide, outside_allowed_ranges, host_address, gateway, host_unreadable
        assert_eq!(refused(&h), vec![0, 0, 0, 1, 0, 0]);
        let last = h.stats.last_refusal().expect("kept for /status");
        assert_eq!(
            (last.server, last.address, last.reason),
            (SERVER, HOST, "host_address")
        );
        // The same server's next (good) offer is not listened to...
        h.reply(ReplyKind::Offer, xid, A, SERVER);
        settle().await;
        assert_eq!(h.phase(), "selecting");
        assert_eq!(h.stats.ignored[5].get(), 1, "quarantined");
        // ...another server's is.
        h.reply(ReplyKind::Offer, xid, B, OTHER);
        settle().await;
        assert_eq!(h.phase(), "requesting");
        h.reply(ReplyKind::Ack, xid, B, OTHER);
        settle().await;
        assert_eq!(h.address(), Some(B));
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_off_server_is_heard_again_after_the_quarantine() {
        let h = Harness::start(None, vec![SERVER]);
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Offer, xid, GATEWAY, SERVER);
        settle().await;
        assert_eq!(refused(&h), vec![0, 0, 0, 0, 1, 0]);
        tokio::time::sleep(crate::host::dhcp::client::QUARANTINE + Duration::from_secs(1)).await;
        settle().await;
        let (_, _, ty, xid, _) = h.last();
        assert_eq!(ty, MessageType::Discover, "DISCOVERs went on meanwhile");
        h.reply(ReplyKind::Offer, xid, A, SERVER);
        settle().await;
        assert_eq!(h.phase(), "requesting");
    }

    #[tokio::test(start_paused = true)]
    async fn wide_masks_and_addresses_outside_the_ranges_are_refused() {
        let guard = DhcpGuard {
            allowed_ranges: vec!["198.51.100.128/26".parse().unwrap()],
            min_prefix_length: 16,
        };
        let h = Harness::start_with(None, vec![], guard);
        settle().await;
        let (_, _, _, xid, _) = h.last();
        let half_the_internet = with_mask(
            server_reply(ReplyKind::Offer, xid, MAC, A, SERVER, Some(120)),
            Ipv4Addr::new(128, 0, 0, 0),
        );
        h.to_client.send(half_the_internet).unwrap();
        h.reply(
            ReplyKind::Offer,
            xid,
            Ipv4Addr::new(198, 51, 100, 50),
            OTHER,
        );
        settle().await;
        assert_eq!(refused(&h), vec![0, 1, 1, 0, 0, 0]);
        assert_eq!(h.phase(), "selecting");
        assert_eq!(h.address(), None);
        // One reading of the host served both judgements.
        assert!(h.log.lock().unwrap().host_reads <= 1);
    }

    #[tokio::test(start_paused = true)]
    async fn an_offer_is_not_taken_blind_and_the_server_is_not_blamed() {
        let h = Harness::start(None, vec![]);
        h.log.lock().unwrap().host = None;
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Offer, xid, A, SERVER);
        settle().await;
        assert_eq!(refused(&h), vec![0, 0, 0, 0, 0, 1]);
        assert_eq!(h.phase(), "selecting");
        // The host readable again: the same server's next offer is taken.
        h.log.lock().unwrap().host = Some(HostView::default());
        tokio::time::sleep(HOST_VIEW_MAX_AGE).await;
        h.reply(ReplyKind::Offer, xid, A, SERVER);
        settle().await;
        assert_eq!(h.phase(), "requesting");
    }

    #[tokio::test(start_paused = true)]
    async fn a_renewal_that_moves_the_lease_to_the_gateway_loses_it() {
        let h = Harness::start(None, vec![]);
        bind(&h, A).await;
        tokio::time::sleep(Duration::from_secs(61)).await;
        settle().await;
        let (_, _, _, xid, _) = h.last();
        h.reply(ReplyKind::Ack, xid, GATEWAY, SERVER);
        settle().await;
        assert_eq!(h.address(), None, "nothing of that server's is kept");
        assert_eq!(h.phase(), "selecting");
        assert_eq!(refused(&h), vec![0, 0, 0, 0, 1, 0]);
        let (_, _, ty, _, asked) = h.last();
        assert_eq!(ty, MessageType::Discover);
        assert_eq!(asked, A, "asks for the old address, from other servers");
    }

    #[tokio::test(start_paused = true)]
    async fn a_held_lease_is_read_back_every_check_interval_and_repairs_are_counted() {
        use crate::host::owned::CHECK_INTERVAL;
        let h = Harness::start(None, vec![]);
        settle().await;
        tokio::time::sleep(CHECK_INTERVAL + Duration::from_secs(1)).await;
        settle().await;
        assert_eq!(
            h.log.lock().unwrap().checks,
            0,
            "nothing to check without a lease"
        );
        bind(&h, A).await;
        tokio::time::sleep(CHECK_INTERVAL).await;
        settle().await;
        assert!(h.log.lock().unwrap().checks >= 1);
        assert_eq!(h.stats.repairs.get(), 0, "nothing differed");
        // Another program deleted the address: put back, counted once.
        h.log.lock().unwrap().repair = Ok(vec!["address missing".into()]);
        tokio::time::sleep(CHECK_INTERVAL).await;
        settle().await;
        assert_eq!(h.stats.repairs.get(), 1);
        // The repair fails: kept for /status until a check succeeds.
        h.log.lock().unwrap().repair = Err("netlink says no".into());
        tokio::time::sleep(CHECK_INTERVAL).await;
        settle().await;
        assert_eq!(h.stats.host_error().as_deref(), Some("netlink says no"));
        h.log.lock().unwrap().repair = Ok(vec![]);
        tokio::time::sleep(CHECK_INTERVAL).await;
        settle().await;
        assert_eq!(h.stats.host_error(), None);
        assert_eq!(h.stats.repairs.get(), 1);
    }

    const NAK_PAUSE_FOR_TESTS: Duration = crate::host::dhcp::client::NAK_PAUSE;

    #[test]
    fn renew_waits_follow_rfc_2131_for_long_leases_and_scale_for_short() {
        use crate::host::dhcp::client::renew_wait;
        let day = Duration::from_secs(86_400);
        assert_eq!(
            renew_wait(Duration::from_secs(3600), day),
            Duration::from_secs(1800)
        );
        assert_eq!(
            renew_wait(Duration::from_secs(100), day),
            Duration::from_secs(60)
        );
        assert_eq!(
            renew_wait(Duration::from_secs(30), day),
            Duration::from_secs(30)
        );
        let short = Duration::from_secs(120);
        assert_eq!(
            renew_wait(Duration::from_secs(20), short),
            Duration::from_secs(15)
        );
        let _ = Phase::Init;
    }
}

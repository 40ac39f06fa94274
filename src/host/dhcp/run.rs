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
mod tests;

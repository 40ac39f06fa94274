//! Drives one [`Client`]: sockets, timers, the address on the interface,
//! the state file, the numbers and the log.
//!
//! [`drive`] is the loop, written against the [`Net`] trait so that unit
//! tests run it on tokio's paused clock with a scripted server; [`run`]
//! is the whole life of a real client on a macvlan interface.

use std::net::Ipv4Addr;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, SystemTime};

use tokio::net::UdpSocket;
use tokio::sync::Notify;
use tokio::time::Instant;
use tokio_util::sync::CancellationToken;

use super::client::{Client, Output};
use super::link::Macvlan;
use super::state::{self, Stored};
use super::wire::{Identity, SERVER_PORT};
use super::{socket, unix_now};
use crate::config::DhcpSpec;
use crate::metrics::LeaseStats;

/// Pause before trying again to set up an interface that failed (the host
/// interface missing, say).
const SETUP_RETRY: Duration = Duration::from_secs(5);

/// What the loop does I/O with.
pub trait Net {
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
    ) -> impl Future<Output = Result<(), String>> + Send;
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
    /// Told whenever the VIP appears, changes or goes.
    pub changed: Arc<Notify>,
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
    loop {
        ctx.stats
            .phase
            .store(client.phase().index(), Ordering::Relaxed);
        let outputs = tokio::select! {
            biased;
            _ = stop.cancelled() => return client,
            _ = tokio::time::sleep_until(client.deadline()) => client.on_timeout(Instant::now()),
            r = net.recv(&mut buf) => match r {
                Ok(n) => match client.on_packet(&buf[..n], Instant::now()) {
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
    any: UdpSocket,
    leased: Option<UdpSocket>,
}

impl Net for HostNet {
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

    async fn set_address(&mut self, address: Option<(Ipv4Addr, u8)>) -> Result<(), String> {
        if let Some(old) = self.leased.take()
            && let Ok(std::net::SocketAddr::V4(a)) = old.local_addr()
        {
            self.link
                .remove_address(*a.ip())
                .await
                .map_err(|e| e.to_string())?;
        }
        if let Some((a, prefix)) = address {
            self.link
                .add_address(a, prefix)
                .await
                .map_err(|e| e.to_string())?;
            self.leased =
                Some(socket::on_address(a).map_err(|e| format!("cannot bind {a}:68: {e}"))?);
        }
        Ok(())
    }
}

/// How a client's life ends.
#[derive(Debug, Default)]
pub struct Ending {
    /// The load balancer is gone: forget the lease on disk too.
    pub removed: AtomicBool,
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
    let last = state::load(&ctx.state_file).map(|s| s.address);
    let id = Identity {
        mac: ctx.spec.mac,
        hostname: ctx.spec.hostname.clone(),
    };
    let seed = seed(&ctx.name);
    tracing::info!(load_balancer = %ctx.name, interface = %net.link.name, parent = %ctx.spec.interface, mac = %state::colons(ctx.spec.mac), reboot_with = ?last, "DHCP client started");
    let client = Client::new(
        id,
        ctx.spec.servers.clone(),
        last,
        ctx.spec.requested,
        seed,
        Instant::now(),
    );
    let mut client = drive(client, &mut net, &ctx, &stop).await;
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

async fn setup(ctx: &Ctx) -> Result<HostNet, String> {
    let link = Macvlan::create(&ctx.spec.interface, ctx.spec.mac)
        .await
        .map_err(|e| e.to_string())?;
    let any = socket::on_interface(&link.name)
        .map_err(|e| format!("cannot bind 0.0.0.0:68 on {}: {e}", link.name))?;
    Ok(HostNet {
        link,
        any,
        leased: None,
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

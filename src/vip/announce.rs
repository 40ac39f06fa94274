//! Announcing VIPs for a BGP speaker: host routes in a table of the
//! daemon's own, and the VIP addresses on an interface, over rtnetlink.
//!
//! With `vip.announce = "routes"` a route
//! `VIP/32 dev <interface> table <table> proto 252` (`/128` for IPv6) is the announcement: the BGP speaker
//! (BIRD's `protocol kernel { kernel table 100; learn; }`) exports what is
//! in the table, so writing or deleting one route announces or withdraws
//! one VIP in milliseconds, with no reload of the speaker. The address on
//! the interface is separate: it is how the host accepts the VIP's traffic,
//! announced or not, so open connections keep working after a withdrawal.
//!
//! This module only writes what it is told. Whether a VIP should be
//! announced is decided by the daemon (`daemon::announce`), which drives
//! it; nothing here knows of health checks or listeners.
//!
//! Ownership: every route written carries [`ROUTE_PROTOCOL`], and only
//! routes with that protocol in the configured table are ever deleted. A
//! route another protocol put for the same prefix in that table is never
//! replaced: writing fails with an error that says so. Addresses are
//! removed only when this process added them (see [`VipAddresses`]).
//!
//! Both are kinds of host object that [`crate::owned::Driver`] owns:
//! [`RouteTable`] and [`VipAddresses`] say how to read, write and remove
//! one; the driver reads back, repairs and reports what the kernel holds.
//!
//! One table, one daemon: [`TableClaim`] holds an abstract Unix socket
//! named after the table, which exists once per network namespace and goes
//! with the process however it ends. A daemon announces into a table only
//! while it holds the claim, so every route of our protocol in a table it
//! holds was written by it or by a dead predecessor (deleted at start), and
//! two daemons never delete each other's routes: the second is refused,
//! naming the first's pid, and tries again until the first is gone.
//!
//! Everything here needs `CAP_NET_ADMIN` and an `AF_NETLINK` socket.

use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags, AddressProtocol};
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope,
};
use rtnetlink::{Handle, RouteMessageBuilder};

pub use crate::config::ROUTE_PROTOCOL;
use crate::owned::{Backend, Found, StopPhase};

/// Why a route or an address could not be written or read.
#[derive(Debug, thiserror::Error)]
pub enum AnnounceError {
    /// No netlink socket (no `AF_NETLINK` in the sandbox?).
    #[error(
        "cannot open a netlink socket: {0} (vip.announce needs AF_NETLINK and CAP_NET_ADMIN: see systemd/harvester-lb.service.d/vip.conf)"
    )]
    Socket(std::io::Error),
    /// `vip.announce_interface` names no interface of this host.
    #[error(
        "vip.announce_interface: interface {0:?} does not exist on this host; create it (`ip link add {0} type dummy`) or name another (default \"lo\")"
    )]
    NoInterface(String),
    /// Another live process holds the table's claim ([`TableClaim`]).
    #[error(
        "table {table} is announced into by another harvester-lb in this network namespace{}; two daemons in one table would delete each other's routes, so this one announces nothing there until it is gone: give each daemon its own vip.announce_table",
        holder.map(|p| format!(" (pid {p})")).unwrap_or_default()
    )]
    TableInUse {
        /// The table.
        table: u32,
        /// The holder's pid, when the kernel told it.
        holder: Option<i32>,
    },
    /// `vip.announce_interface` is an interface that carries traffic.
    #[error(
        "vip.announce_interface: {name:?} is a {kind} interface, not lo or a dummy one: a VIP put on an uplink answers ARP and neighbour solicitations there and every VIP /32 would land on it; use \"lo\" (the default) or a dummy interface (`ip link add hlb-vips type dummy`)"
    )]
    NotDummy {
        /// The interface.
        name: String,
        /// What it is (veth, bridge, device…).
        kind: String,
    },
    /// Another protocol's route for the VIP is in the table.
    #[error(
        "table {table} already has a route for {vip} of protocol {protocol}, not harvester-lb's ({ROUTE_PROTOCOL}); it is left alone and the VIP is not announced by this daemon: delete it (`ip route del {vip} table {table}`) or choose another vip.announce_table"
    )]
    Foreign {
        /// The VIP.
        vip: IpAddr,
        /// The table.
        table: u32,
        /// The other route's protocol number.
        protocol: u8,
    },
    /// The kernel refused (no `CAP_NET_ADMIN`, …).
    #[error(
        "{what}: {source} (vip.announce needs CAP_NET_ADMIN: see systemd/harvester-lb.service.d/vip.conf)"
    )]
    Netlink {
        /// What was being done.
        what: String,
        /// The kernel's answer.
        source: rtnetlink::Error,
    },
}

/// The prefix length of a host route or address of `ip`.
fn host_prefix(ip: IpAddr) -> u8 {
    if ip.is_ipv4() { 32 } else { 128 }
}

/// The kernel's errno in a netlink error, if it is one (positive).
pub(crate) fn errno(e: &rtnetlink::Error) -> Option<i32> {
    match e {
        rtnetlink::Error::NetlinkError(m) => m.code.map(|c| -c.get()),
        _ => None,
    }
}

/// A route's table: the `RTA_TABLE` attribute when present (tables above
/// 255 have only that), else the header's byte.
pub(crate) fn table_of(m: &RouteMessage) -> u32 {
    m.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Table(t) => Some(*t),
            _ => None,
        })
        .unwrap_or(u32::from(m.header.table))
}

/// A host route's destination.
fn destination_of(m: &RouteMessage) -> Option<IpAddr> {
    m.attributes.iter().find_map(|a| match a {
        RouteAttribute::Destination(RouteAddress::Inet(v4)) => Some(IpAddr::V4(*v4)),
        RouteAttribute::Destination(RouteAddress::Inet6(v6)) => Some(IpAddr::V6(*v6)),
        _ => None,
    })
}

fn protocol_number(p: RouteProtocol) -> u8 {
    u8::from(p)
}

/// A netlink connection to the kernel's routing tables and addresses.
#[derive(Debug, Clone)]
pub struct RouteWriter {
    handle: Handle,
}

impl RouteWriter {
    /// Opens a netlink socket; its connection runs on the current tokio runtime.
    pub fn connect() -> Result<Self, AnnounceError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(AnnounceError::Socket)?;
        tokio::spawn(conn);
        Ok(Self { handle })
    }

    /// The netlink handle, for the readers of host state ([`super::host`]).
    pub fn handle(&self) -> &Handle {
        &self.handle
    }

    /// The index of interface `name`.
    pub async fn interface_index(&self, name: &str) -> Result<u32, AnnounceError> {
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(name.to_string())
            .execute();
        match links.try_next().await {
            Ok(Some(msg)) => Ok(msg.header.index),
            Ok(None) => Err(AnnounceError::NoInterface(name.to_string())),
            Err(e) if errno(&e) == Some(libc::ENODEV) => {
                Err(AnnounceError::NoInterface(name.to_string()))
            }
            Err(source) => Err(AnnounceError::Netlink {
                what: format!("cannot look up interface {name:?}"),
                source,
            }),
        }
    }

    /// The index of interface `name` when it may carry the VIP addresses:
    /// `lo` or a dummy interface ([`AnnounceError::NotDummy`] otherwise).
    pub async fn announcing_interface(&self, name: &str) -> Result<u32, AnnounceError> {
        use super::host::{LinkKind, link_kind};
        let index = self.interface_index(name).await?;
        match link_kind(&self.handle, index).await? {
            LinkKind::Loopback | LinkKind::Dummy => Ok(index),
            LinkKind::Other(kind) => Err(AnnounceError::NotDummy {
                name: name.to_string(),
                kind,
            }),
        }
    }

    /// Every route in `table`, both families, whoever wrote it.
    async fn routes_in(&self, table: u32) -> Result<Vec<RouteMessage>, AnnounceError> {
        let mut out = Vec::new();
        for request in [
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build(),
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build(),
        ] {
            let mut routes = self.handle.route().get(request).execute();
            loop {
                match routes.try_next().await {
                    Ok(Some(m)) if table_of(&m) == table => out.push(m),
                    Ok(Some(_)) => {}
                    Ok(None) => break,
                    Err(source) => {
                        return Err(AnnounceError::Netlink {
                            what: format!("cannot list the routes of table {table}"),
                            source,
                        });
                    }
                }
            }
        }
        Ok(out)
    }

    /// Every route of [`ROUTE_PROTOCOL`] in `table`, both families.
    pub async fn ours(&self, table: u32) -> Result<Vec<RouteMessage>, AnnounceError> {
        let mut routes = self.routes_in(table).await?;
        routes.retain(|m| protocol_number(m.header.protocol) == ROUTE_PROTOCOL);
        Ok(routes)
    }

    /// The VIPs announced in `table` now (its routes of our protocol).
    pub async fn announced(&self, table: u32) -> Result<BTreeSet<IpAddr>, AnnounceError> {
        Ok(self
            .ours(table)
            .await?
            .iter()
            .filter_map(destination_of)
            .collect())
    }

    /// Deletes every route of [`ROUTE_PROTOCOL`] in `table`; returns the
    /// destinations deleted. A route gone meanwhile is not an error.
    pub async fn flush(&self, table: u32) -> Result<Vec<IpAddr>, AnnounceError> {
        let mut deleted = Vec::new();
        for route in self.ours(table).await? {
            let dst = destination_of(&route);
            match self.handle.route().del(route).execute().await {
                Ok(()) => deleted.extend(dst),
                Err(e) if errno(&e) == Some(libc::ESRCH) => {}
                Err(source) => {
                    return Err(AnnounceError::Netlink {
                        what: format!(
                            "cannot delete the route for {} from table {table}",
                            dst.map_or_else(|| "?".to_string(), |d| d.to_string())
                        ),
                        source,
                    });
                }
            }
        }
        Ok(deleted)
    }

    /// The host route of `vip` in `table` through interface `index`, ours.
    fn route(vip: IpAddr, table: u32, index: u32) -> RouteMessage {
        let b = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(vip, host_prefix(vip))
            .expect("an address and its host prefix length are consistent")
            .output_interface(index)
            .table_id(table)
            .protocol(RouteProtocol::from(ROUTE_PROTOCOL));
        if vip.is_ipv4() {
            b.scope(RouteScope::Link).build()
        } else {
            b.build()
        }
    }

    /// Writes the host route of `vip` into `table` (announces it). One of
    /// ours already there is replaced by the one meant (it may have been
    /// changed); another protocol's is left alone and reported
    /// ([`AnnounceError::Foreign`]).
    pub async fn announce(&self, vip: IpAddr, table: u32, index: u32) -> Result<(), AnnounceError> {
        match self
            .handle
            .route()
            .add(Self::route(vip, table, index))
            .execute()
            .await
        {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EEXIST) => {
                let protocol = self.protocol_of(vip, table).await?.unwrap_or(0);
                if protocol != ROUTE_PROTOCOL {
                    return Err(AnnounceError::Foreign {
                        vip,
                        table,
                        protocol,
                    });
                }
                // Ours, perhaps changed by another process: made as meant.
                self.handle
                    .route()
                    .add(Self::route(vip, table, index))
                    .replace()
                    .execute()
                    .await
                    .map_err(|source| AnnounceError::Netlink {
                        what: format!("cannot replace the route for {vip} in table {table}"),
                        source,
                    })
            }
            Err(source) => Err(AnnounceError::Netlink {
                what: format!("cannot add the route for {vip} to table {table}"),
                source,
            }),
        }
    }

    /// The protocol of the route for `vip` in `table`, whoever wrote it.
    async fn protocol_of(&self, vip: IpAddr, table: u32) -> Result<Option<u8>, AnnounceError> {
        let request = if vip.is_ipv4() {
            RouteMessageBuilder::<std::net::Ipv4Addr>::new().build()
        } else {
            RouteMessageBuilder::<std::net::Ipv6Addr>::new().build()
        };
        let mut routes = self.handle.route().get(request).execute();
        while let Some(m) = routes
            .try_next()
            .await
            .map_err(|source| AnnounceError::Netlink {
                what: format!("cannot list the routes of table {table}"),
                source,
            })?
        {
            if table_of(&m) == table
                && destination_of(&m) == Some(vip)
                && m.header.destination_prefix_length == host_prefix(vip)
            {
                return Ok(Some(protocol_number(m.header.protocol)));
            }
        }
        Ok(None)
    }

    /// Deletes our route of `vip` from `table` (withdraws it); absent is
    /// fine. Only a route of [`ROUTE_PROTOCOL`] matches: the kernel compares
    /// the protocol given.
    pub async fn withdraw(&self, vip: IpAddr, table: u32) -> Result<(), AnnounceError> {
        let mut m = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(vip, host_prefix(vip))
            .expect("an address and its host prefix length are consistent")
            .table_id(table)
            .protocol(RouteProtocol::from(ROUTE_PROTOCOL))
            .build();
        // Any scope: the kernel matches a delete's scope only when it is
        // narrower than "nowhere".
        m.header.scope = RouteScope::NoWhere;
        match self.handle.route().del(m).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ESRCH) => Ok(()),
            Err(source) => Err(AnnounceError::Netlink {
                what: format!("cannot delete the route for {vip} from table {table}"),
                source,
            }),
        }
    }

    /// The addresses of interface `index`: every one, or those that are
    /// `ip` (any prefix). The kernel may answer for other interfaces too
    /// (a dump is filtered in userspace): those are left out.
    async fn addresses_of(
        &self,
        index: u32,
        ip: Option<IpAddr>,
    ) -> Result<Vec<rtnetlink::packet_route::address::AddressMessage>, AnnounceError> {
        let mut request = self.handle.address().get().set_link_index_filter(index);
        if let Some(ip) = ip {
            request = request.set_address_filter(ip);
        }
        let mut found: Vec<_> =
            request
                .execute()
                .try_collect()
                .await
                .map_err(|source| AnnounceError::Netlink {
                    what: format!("cannot list the addresses of interface {index}"),
                    source,
                })?;
        found.retain(|m| m.header.index == index);
        Ok(found)
    }

    /// Puts `ip` on interface `index` as a host address (/32, /128; no
    /// duplicate address detection for IPv6: the address is anycast by
    /// design), tagged with [`ROUTE_PROTOCOL`] as its address protocol so a
    /// restarted daemon knows it for its own (kernels before 5.18 ignore
    /// the tag).
    pub async fn add_address(&self, index: u32, ip: IpAddr) -> Result<(), AnnounceError> {
        let mut request = self.handle.address().add(index, ip, host_prefix(ip));
        request
            .message_mut()
            .attributes
            .push(AddressAttribute::Protocol(AddressProtocol::Other(
                ROUTE_PROTOCOL,
            )));
        if ip.is_ipv6() {
            request
                .message_mut()
                .attributes
                .push(AddressAttribute::Flags(AddressFlags::Nodad));
        }
        match request.execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::EEXIST) => Ok(()),
            Err(source) => Err(AnnounceError::Netlink {
                what: format!("cannot add {ip}/{} to interface {index}", host_prefix(ip)),
                source,
            }),
        }
    }

    /// Takes `ip` off interface `index`; absent is fine.
    pub async fn remove_address(&self, index: u32, ip: IpAddr) -> Result<(), AnnounceError> {
        let msgs = self.addresses_of(index, Some(ip)).await?;
        for m in msgs {
            match self.handle.address().del(m).execute().await {
                Ok(()) => {}
                Err(e) if errno(&e) == Some(libc::EADDRNOTAVAIL) => {}
                Err(source) => {
                    return Err(AnnounceError::Netlink {
                        what: format!("cannot remove {ip} from interface {index}"),
                        source,
                    });
                }
            }
        }
        Ok(())
    }
}

/// The announce routes of one table, as a kind of host object the
/// [`crate::owned::Driver`] owns: one host route per announced VIP, marked with
/// [`ROUTE_PROTOCOL`]. The table is claimed ([`TableClaim`]), so a marked
/// route there that this process did not write is a dead predecessor's and
/// goes ([`Backend::REMOVES_STRAYS`]); that is how every VIP starts
/// withdrawn.
#[derive(Debug, Clone)]
pub struct RouteTable {
    writer: RouteWriter,
    table: u32,
}

impl RouteTable {
    /// The routes of `table`, written through `writer`.
    pub fn new(writer: RouteWriter, table: u32) -> Self {
        Self { writer, table }
    }

    /// The table.
    pub fn table(&self) -> u32 {
        self.table
    }
}

/// A host route as the kernel shows it: what the driver compares.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeenRoute {
    /// The output interface's index.
    pub interface: Option<u32>,
    /// The route's protocol (ours is [`ROUTE_PROTOCOL`]).
    pub protocol: u8,
}

impl Backend for RouteTable {
    const KIND: &'static str = "announce_route";
    const STOP: StopPhase = StopPhase::BeforeDrain;
    const REMOVES_STRAYS: bool = true;
    type Key = IpAddr;
    /// The interface the route goes out of.
    type Want = u32;
    type Seen = SeenRoute;
    type Error = AnnounceError;

    async fn read(&mut self) -> Result<BTreeMap<IpAddr, Found<SeenRoute>>, AnnounceError> {
        let routes = self.writer.routes_in(self.table).await?;
        Ok(routes
            .iter()
            .filter_map(|m| {
                let vip = destination_of(m)?;
                (m.header.destination_prefix_length == host_prefix(vip)).then_some(())?;
                let protocol = protocol_number(m.header.protocol);
                let interface = m.attributes.iter().find_map(|a| match a {
                    RouteAttribute::Oif(i) => Some(*i),
                    _ => None,
                });
                Some((
                    vip,
                    Found {
                        seen: SeenRoute {
                            interface,
                            protocol,
                        },
                        marked: protocol == ROUTE_PROTOCOL,
                    },
                ))
            })
            .collect())
    }

    async fn write(&mut self, vip: &IpAddr, interface: &u32) -> Result<(), AnnounceError> {
        self.writer.announce(*vip, self.table, *interface).await
    }

    async fn remove(&mut self, vip: &IpAddr) -> Result<(), AnnounceError> {
        self.writer.withdraw(*vip, self.table).await
    }
}

/// The VIP addresses on the announcing interface, as a kind of host object
/// the [`crate::owned::Driver`] owns. Each is added as a host address marked with
/// [`ROUTE_PROTOCOL`] (`IFA_PROTO`). The interface is shared (`lo`: a
/// second daemon with its own table, keepalived, the operator), so only
/// what this process added is removed: an address there without our mark
/// stays, and one with our mark that this process did not add is adopted
/// when wanted and otherwise left alone.
#[derive(Debug, Clone)]
pub struct VipAddresses {
    writer: RouteWriter,
    index: u32,
}

impl VipAddresses {
    /// The addresses of interface `index`, written through `writer`.
    pub fn new(writer: RouteWriter, index: u32) -> Self {
        Self { writer, index }
    }

    /// The interface's index.
    pub fn index(&self) -> u32 {
        self.index
    }
}

impl Backend for VipAddresses {
    const KIND: &'static str = "vip_address";
    const STOP: StopPhase = StopPhase::AfterDrain;
    const REMOVES_STRAYS: bool = false;
    type Key = IpAddr;
    type Want = ();
    /// The prefix length.
    type Seen = u8;
    type Error = AnnounceError;

    async fn read(&mut self) -> Result<BTreeMap<IpAddr, Found<u8>>, AnnounceError> {
        let messages = self.writer.addresses_of(self.index, None).await?;
        Ok(messages
            .iter()
            .filter_map(|m| {
                let ip = super::host::local_address(m)?;
                let found = Found {
                    seen: m.header.prefix_len,
                    marked: super::host::is_tagged(m),
                };
                Some((ip, found))
            })
            .collect())
    }

    async fn write(&mut self, ip: &IpAddr, (): &()) -> Result<(), AnnounceError> {
        self.writer.add_address(self.index, *ip).await
    }

    async fn remove(&mut self, ip: &IpAddr) -> Result<(), AnnounceError> {
        self.writer.remove_address(self.index, *ip).await
    }
}

/// `harvester-lb withdraw --all`: deletes every route of
/// [`ROUTE_PROTOCOL`] from `table` when no live daemon announces into it
/// (for systemd's `ExecStopPost=`, after the daemon is gone); with one,
/// [`AnnounceError::TableInUse`] and nothing is deleted. Returns the VIPs
/// withdrawn.
pub async fn withdraw_all(table: u32) -> Result<Vec<IpAddr>, AnnounceError> {
    let _claim = TableClaim::take(table)?;
    RouteWriter::connect()?.flush(table).await
}

/// This process's claim on announcing table `table` in its network
/// namespace: an abstract Unix socket `harvester-lb/announce-table/N`
/// bound and listening. The kernel keeps one such name per network
/// namespace and removes it when the process ends (even by `SIGKILL`), so
/// the claim never outlives its holder and needs no file. Dropped, it is
/// released.
#[derive(Debug)]
pub struct TableClaim {
    table: u32,
    /// Accepts (and closes) the connections of those asking who holds it.
    task: tokio::task::JoinHandle<()>,
}

impl TableClaim {
    fn name(table: u32) -> String {
        format!("harvester-lb/announce-table/{table}")
    }

    /// Takes the claim on `table`; [`AnnounceError::TableInUse`] when
    /// another live process holds it. Needs a tokio runtime.
    pub fn take(table: u32) -> Result<Self, AnnounceError> {
        use std::os::linux::net::SocketAddrExt;
        let addr = std::os::unix::net::SocketAddr::from_abstract_name(Self::name(table))
            .map_err(AnnounceError::Socket)?;
        let listener = match std::os::unix::net::UnixListener::bind_addr(&addr) {
            Ok(l) => l,
            Err(e) if e.kind() == std::io::ErrorKind::AddrInUse => {
                return Err(AnnounceError::TableInUse {
                    table,
                    holder: Self::holder(&addr),
                });
            }
            Err(e) => return Err(AnnounceError::Socket(e)),
        };
        listener
            .set_nonblocking(true)
            .map_err(AnnounceError::Socket)?;
        let listener =
            tokio::net::UnixListener::from_std(listener).map_err(AnnounceError::Socket)?;
        let task = tokio::spawn(async move {
            loop {
                match listener.accept().await {
                    Ok((stream, _)) => drop(stream),
                    Err(e) => {
                        tracing::debug!(table, error = %e, "announce table claim: accept failed");
                        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    }
                }
            }
        });
        Ok(Self { table, task })
    }

    /// The pid of the process listening on `addr` (`SO_PEERCRED`).
    fn holder(addr: &std::os::unix::net::SocketAddr) -> Option<i32> {
        let stream = std::os::unix::net::UnixStream::connect_addr(addr).ok()?;
        stream.set_nonblocking(true).ok()?;
        let stream = tokio::net::UnixStream::from_std(stream).ok()?;
        stream.peer_cred().ok()?.pid()
    }

    /// The table claimed.
    pub fn table(&self) -> u32 {
        self.table
    }
}

impl Drop for TableClaim {
    fn drop(&mut self) {
        self.task.abort();
    }
}

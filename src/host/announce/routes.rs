//! Announcing VIPs for a BGP speaker: host routes in a table of the
//! daemon's own, and AnyIP local routes that make the VIPs local, over
//! rtnetlink.
//!
//! With `vip.announce = "routes"` a route
//! `VIP/32 dev <interface> table <table> proto 252` (`/128` for IPv6) is the announcement: the BGP speaker
//! (BIRD's `protocol kernel { kernel table 100; learn; }`, FRR's
//! `ip import-table 100` with `redistribute table 100`) exports what is
//! in the table, so writing or deleting one route announces or withdraws
//! one VIP, with no reload of the speaker. The local route
//! `local VIP/32 dev <interface> table local proto 252 metric <table>` is
//! separate: it is how the host accepts the VIP's traffic, announced or
//! not, so open connections keep working after a withdrawal. It is a route
//! and not an address on the interface because FRR's zebra makes an
//! address a connected route that always beats the one imported from the
//! table, so FRR would announce nothing ([`VipLocalRoutes`]).
//!
//! This module only writes what it is told. Whether a VIP should be
//! announced is decided by the announcer (`host::announce::announcer`,
//! reading the daemon through `daemon::announce`), which drives it;
//! nothing here knows of health checks or listeners.
//!
//! Ownership: every route written carries [`ROUTE_PROTOCOL`], and only
//! routes with that protocol in the configured table are ever deleted. A
//! route another protocol put for the same prefix in that table is never
//! replaced: writing fails with an error that says so. Local routes carry
//! the protocol and, as their metric, the table: only those of this
//! daemon's table are ever deleted (see [`VipLocalRoutes`]).
//!
//! Both are kinds of host object that [`crate::host::owned::Driver`] owns:
//! [`RouteTable`] and [`VipLocalRoutes`] say how to read, write and remove
//! one; the driver reads back, repairs and reports what the kernel holds.
//!
//! One table, one daemon: [`TableClaim`] holds an abstract Unix socket
//! named after the table, which exists once per network namespace and goes
//! with the process however it ends. A daemon announces into a table only
//! while it holds the claim, so every route of our protocol in a table it
//! holds (and every local route with its table as metric) was written by it
//! or by a dead predecessor (deleted at start), and
//! two daemons never delete each other's routes: the second is refused,
//! naming the first's pid, and tries again until the first is gone.
//!
//! Everything here needs `CAP_NET_ADMIN` and an `AF_NETLINK` socket.

use crate::metrics::HostKind;
use std::collections::{BTreeMap, BTreeSet};
use std::net::IpAddr;

use futures_util::TryStreamExt;
use rtnetlink::packet_route::route::{
    RouteAddress, RouteAttribute, RouteMessage, RouteProtocol, RouteScope, RouteType,
};
use rtnetlink::{Handle, RouteMessageBuilder};

pub use crate::config::ROUTE_PROTOCOL;
use crate::host::owned::{Backend, Found, StopPhase};

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
        "table {table} is announced into by another harvester-lb in this network namespace ({holder}); two daemons in one table would delete each other's routes, so this one announces nothing there until it is gone: give each daemon its own vip.announce_table"
    )]
    TableInUse {
        /// The table.
        table: u32,
        /// Who holds it: its pid, config file and admin socket, as far
        /// as they could be learned.
        holder: crate::host::owned::claim::Holder,
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

    /// The netlink handle, for the readers of host state ([`crate::host::vip_guard`]).
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

    /// The index of interface `name` when it may carry the VIPs' routes:
    /// `lo` or a dummy interface ([`AnnounceError::NotDummy`] otherwise).
    pub async fn announcing_interface(&self, name: &str) -> Result<u32, AnnounceError> {
        use crate::host::vip_guard::{LinkKind, link_kind};
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
        self.delete(m, || {
            format!("cannot delete the route for {vip} from table {table}")
        })
        .await
    }

    /// The AnyIP route that makes `vip` local through interface `index`,
    /// ours: protocol [`ROUTE_PROTOCOL`], metric `table` (the announce
    /// table of the daemon that owns it).
    fn local_route(vip: IpAddr, index: u32, table: u32) -> RouteMessage {
        RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(vip, host_prefix(vip))
            .expect("an address and its host prefix length are consistent")
            .output_interface(index)
            .table_id(LOCAL_TABLE)
            .kind(RouteType::Local)
            .scope(RouteScope::Host)
            .priority(table)
            .protocol(RouteProtocol::from(ROUTE_PROTOCOL))
            .build()
    }

    /// The local routes (table `local`, type `local`) of host prefixes, by
    /// destination; marked when ours for the daemon of `table` (our
    /// protocol, metric `table`). The kernel's own (the host's addresses)
    /// are there unmarked.
    pub async fn local_routes(
        &self,
        table: u32,
    ) -> Result<BTreeMap<IpAddr, Found<SeenRoute>>, AnnounceError> {
        let mut routes = self.routes_in(LOCAL_TABLE).await?;
        routes.retain(|m| m.header.kind == RouteType::Local);
        Ok(host_routes(&routes, |m| {
            protocol_number(m.header.protocol) == ROUTE_PROTOCOL && priority_of(m) == table
        }))
    }

    /// Makes `vip` local through interface `index` for the daemon of
    /// `table` (one of ours already there is replaced by the one meant).
    pub async fn make_local(
        &self,
        vip: IpAddr,
        index: u32,
        table: u32,
    ) -> Result<(), AnnounceError> {
        self.handle
            .route()
            .add(Self::local_route(vip, index, table))
            .replace()
            .execute()
            .await
            .map_err(|source| AnnounceError::Netlink {
                what: format!("cannot add the local route for {vip}"),
                source,
            })
    }

    /// Deletes our local route of `vip` (metric `table`); absent is fine.
    /// The kernel compares type, protocol and metric, so an address's own
    /// local route is never deleted.
    pub async fn unmake_local(&self, vip: IpAddr, table: u32) -> Result<(), AnnounceError> {
        let mut m = RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(vip, host_prefix(vip))
            .expect("an address and its host prefix length are consistent")
            .table_id(LOCAL_TABLE)
            .kind(RouteType::Local)
            .priority(table)
            .protocol(RouteProtocol::from(ROUTE_PROTOCOL))
            .build();
        m.header.scope = RouteScope::NoWhere;
        self.delete(m, || format!("cannot delete the local route for {vip}"))
            .await
    }

    /// Deletes route `m`; absent is fine.
    async fn delete(
        &self,
        m: RouteMessage,
        what: impl FnOnce() -> String,
    ) -> Result<(), AnnounceError> {
        match self.handle.route().del(m).execute().await {
            Ok(()) => Ok(()),
            Err(e) if errno(&e) == Some(libc::ESRCH) => Ok(()),
            Err(source) => Err(AnnounceError::Netlink {
                what: what(),
                source,
            }),
        }
    }
}

/// The host routes among `routes` as the driver sees them, by destination;
/// `ours` says which carry the daemon's mark. Of several for one
/// destination (ours and the kernel's for an address), ours is kept.
fn host_routes(
    routes: &[RouteMessage],
    ours: impl Fn(&RouteMessage) -> bool,
) -> BTreeMap<IpAddr, Found<SeenRoute>> {
    let mut out: BTreeMap<IpAddr, Found<SeenRoute>> = BTreeMap::new();
    for m in routes {
        let Some(vip) = destination_of(m) else {
            continue;
        };
        if m.header.destination_prefix_length != host_prefix(vip) {
            continue;
        }
        let interface = m.attributes.iter().find_map(|a| match a {
            RouteAttribute::Oif(i) => Some(*i),
            _ => None,
        });
        let found = Found {
            seen: SeenRoute {
                interface,
                protocol: protocol_number(m.header.protocol),
                metric: priority_of(m),
            },
            marked: ours(m),
        };
        if out.get(&vip).is_none_or(|f| !f.marked) {
            out.insert(vip, found);
        }
    }
    out
}

/// A route's metric (`RTA_PRIORITY`; 0 without one).
fn priority_of(m: &RouteMessage) -> u32 {
    m.attributes
        .iter()
        .find_map(|a| match a {
            RouteAttribute::Priority(p) => Some(*p),
            _ => None,
        })
        .unwrap_or(0)
}

/// The announce routes of one table, as a kind of host object the
/// [`crate::host::owned::Driver`] owns: one host route per announced VIP, marked with
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
    /// The route's metric: for a local route of ours, the announce table
    /// of the daemon that wrote it (so a warning can name that daemon).
    pub metric: u32,
}

impl Backend for RouteTable {
    const KIND: HostKind = HostKind::AnnounceRoute;
    const STOP: StopPhase = StopPhase::BeforeDrain;
    const REMOVES_STRAYS: bool = true;
    type Key = IpAddr;
    /// The interface the route goes out of.
    type Want = u32;
    type Seen = SeenRoute;
    type Error = AnnounceError;

    async fn read(&mut self) -> Result<BTreeMap<IpAddr, Found<SeenRoute>>, AnnounceError> {
        let routes = self.writer.routes_in(self.table).await?;
        Ok(host_routes(&routes, |m| {
            protocol_number(m.header.protocol) == ROUTE_PROTOCOL
        }))
    }

    async fn write(&mut self, vip: &IpAddr, interface: &u32) -> Result<(), AnnounceError> {
        self.writer.announce(*vip, self.table, *interface).await
    }

    async fn remove(&mut self, vip: &IpAddr) -> Result<(), AnnounceError> {
        self.writer.withdraw(*vip, self.table).await
    }

    /// A predecessor's route out of the same interface is ours as it is.
    fn adoptable(&self, interface: &u32, seen: &SeenRoute) -> bool {
        seen.interface == Some(*interface) && seen.protocol == ROUTE_PROTOCOL
    }
}

/// The kernel's local routing table, where the AnyIP routes go.
pub const LOCAL_TABLE: u32 = 255;

/// The VIPs made local on this host, as a kind of host object the
/// [`crate::host::owned::Driver`] owns: one AnyIP route
/// `local VIP/32 dev <interface> table local proto 252 metric <table>` per
/// VIP (`/128` for IPv6), so the host accepts the VIP's traffic (and the
/// listeners, bound with `IP_FREEBIND`, get it) without the VIP being an
/// address of any interface.
///
/// Why a route and not an address on `lo`: FRR's zebra turns an address
/// into a connected route that always beats the route it imports from the
/// announce table, so FRR announced nothing; BIRD is indifferent. The
/// route is the same object the kernel makes for an address (a `local`
/// route in table `local`), without the address.
///
/// Ownership: the protocol marks the route as harvester-lb's and the
/// metric names the announce table of the daemon that wrote it, so the
/// daemon holding that table's [`TableClaim`] owns exactly those routes: a
/// marked one it did not write is a dead predecessor's and goes
/// ([`Backend::REMOVES_STRAYS`]); another daemon's (another table, another
/// metric) and the kernel's own local routes (the host's addresses) are
/// never touched.
#[derive(Debug, Clone)]
pub struct VipLocalRoutes {
    writer: RouteWriter,
    index: u32,
    table: u32,
}

impl VipLocalRoutes {
    /// The local routes of the daemon announcing into `table`, through
    /// interface `index`, written through `writer`.
    pub fn new(writer: RouteWriter, index: u32, table: u32) -> Self {
        Self {
            writer,
            index,
            table,
        }
    }

    /// The interface's index.
    pub fn index(&self) -> u32 {
        self.index
    }

    /// The announce table whose daemon owns them (their metric).
    pub fn table(&self) -> u32 {
        self.table
    }
}

impl Backend for VipLocalRoutes {
    const KIND: HostKind = HostKind::VipLocalRoute;
    const STOP: StopPhase = StopPhase::AfterDrain;
    const REMOVES_STRAYS: bool = true;
    type Key = IpAddr;
    type Want = ();
    type Seen = SeenRoute;
    type Error = AnnounceError;

    async fn read(&mut self) -> Result<BTreeMap<IpAddr, Found<SeenRoute>>, AnnounceError> {
        self.writer.local_routes(self.table).await
    }

    async fn write(&mut self, vip: &IpAddr, (): &()) -> Result<(), AnnounceError> {
        self.writer.make_local(*vip, self.index, self.table).await
    }

    async fn remove(&mut self, vip: &IpAddr) -> Result<(), AnnounceError> {
        self.writer.unmake_local(*vip, self.table).await
    }

    /// A predecessor's local route on the same interface, of the same
    /// table (its metric), is ours as it is.
    fn adoptable(&self, (): &(), seen: &SeenRoute) -> bool {
        seen.interface == Some(self.index)
            && seen.metric == self.table
            && seen.protocol == ROUTE_PROTOCOL
    }
}

/// What `harvester-lb withdraw --all` took away.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct Withdrawn {
    /// The VIPs whose announce route was deleted.
    pub routes: Vec<IpAddr>,
    /// The VIPs whose local route ([`VipLocalRoutes`]) was deleted.
    pub local: Vec<IpAddr>,
}

/// `harvester-lb withdraw --all`: deletes every route of
/// [`ROUTE_PROTOCOL`] from `table`, then every local route the daemon of
/// `table` made ([`VipLocalRoutes`]), when no live daemon announces into
/// it (for systemd's `ExecStopPost=`, after the daemon is gone, in the
/// order of a clean stop); with one, [`AnnounceError::TableInUse`] and
/// nothing is deleted.
pub async fn withdraw_all(table: u32) -> Result<Withdrawn, AnnounceError> {
    let _claim = TableClaim::take(table, &crate::host::owned::claim::Identity::default()).await?;
    let writer = RouteWriter::connect()?;
    let routes = writer.flush(table).await?;
    let mut local = Vec::new();
    for (vip, found) in writer.local_routes(table).await? {
        if found.marked {
            writer.unmake_local(vip, table).await?;
            local.push(vip);
        }
    }
    Ok(Withdrawn { routes, local })
}

/// This process's claim on announcing table `table` in its network
/// namespace: a [`crate::host::owned::Claim`] on
/// [`crate::host::owned::Object::AnnounceTable`] (an abstract Unix socket
/// `harvester-lb/announce-table/N` bound and listening). The kernel keeps
/// one such name per network namespace and removes it when the process
/// ends (even by `SIGKILL`), so the claim never outlives its holder and
/// needs no file. Dropped, it is released.
#[derive(Debug)]
pub struct TableClaim {
    table: u32,
    _claim: crate::host::owned::Claim,
}

impl TableClaim {
    /// Takes the claim on `table`, telling askers `identity`;
    /// [`AnnounceError::TableInUse`] when another live process holds it.
    /// Needs a tokio runtime.
    pub async fn take(
        table: u32,
        identity: &crate::host::owned::claim::Identity,
    ) -> Result<Self, AnnounceError> {
        use crate::host::owned::{Claim, ClaimError, Object};
        match Claim::take(Object::AnnounceTable(table), identity).await {
            Ok(claim) => Ok(Self {
                table,
                _claim: claim,
            }),
            Err(ClaimError::InUse { holder, .. }) => {
                Err(AnnounceError::TableInUse { table, holder })
            }
            Err(ClaimError::Socket { source, .. }) => Err(AnnounceError::Socket(source)),
        }
    }

    /// The table claimed.
    pub fn table(&self) -> u32 {
        self.table
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `local` route for `dst/len` through interface 1, of `protocol`
    /// with metric `metric`, as a dump of table `local` shows it.
    fn local(dst: &str, len: u8, protocol: u8, metric: u32) -> RouteMessage {
        RouteMessageBuilder::<IpAddr>::new()
            .destination_prefix(dst.parse().unwrap(), len)
            .unwrap()
            .output_interface(1)
            .table_id(LOCAL_TABLE)
            .kind(RouteType::Local)
            .priority(metric)
            .protocol(RouteProtocol::from(protocol))
            .build()
    }

    fn ours_of_table_100(m: &RouteMessage) -> bool {
        protocol_number(m.header.protocol) == ROUTE_PROTOCOL && priority_of(m) == 100
    }

    #[test]
    fn the_local_routes_of_a_table_s_daemon_are_told_by_protocol_and_metric() {
        let routes = [
            // The kernel's own for an address, then ours for the same VIP:
            // ours is what the driver sees (and owns).
            local("198.51.100.1", 32, 2, 0),
            local("198.51.100.1", 32, ROUTE_PROTOCOL, 100),
            // Ours first, then the kernel's: still ours.
            local("198.51.100.2", 32, ROUTE_PROTOCOL, 100),
            local("198.51.100.2", 32, 2, 0),
            // Another table's daemon's, and the kernel's alone: not ours.
            local("198.51.100.3", 32, ROUTE_PROTOCOL, 101),
            local("2001:db8::4", 128, 2, 0),
            // Not a host route: not a VIP's.
            local("127.0.0.0", 8, 2, 0),
        ];
        let seen = host_routes(&routes, ours_of_table_100);
        let marked: Vec<(String, bool)> = seen
            .iter()
            .map(|(ip, f)| (ip.to_string(), f.marked))
            .collect();
        assert_eq!(
            marked,
            [
                ("198.51.100.1".to_string(), true),
                ("198.51.100.2".to_string(), true),
                ("198.51.100.3".to_string(), false),
                ("2001:db8::4".to_string(), false),
            ]
        );
        let one = &seen[&"198.51.100.1".parse::<IpAddr>().unwrap()];
        assert_eq!(
            one.seen,
            SeenRoute {
                interface: Some(1),
                protocol: ROUTE_PROTOCOL,
                metric: 100,
            }
        );
    }

    #[test]
    fn the_local_route_written_is_local_in_table_local_with_the_table_as_metric() {
        let m = RouteWriter::local_route("198.51.100.1".parse().unwrap(), 1, 100);
        assert_eq!(m.header.kind, RouteType::Local);
        assert_eq!(m.header.scope, RouteScope::Host);
        assert_eq!(table_of(&m), LOCAL_TABLE);
        assert_eq!(m.header.destination_prefix_length, 32);
        assert!(ours_of_table_100(&m));
        let v6 = RouteWriter::local_route("2001:db8::1".parse().unwrap(), 1, 100);
        assert_eq!(v6.header.destination_prefix_length, 128);
    }
}

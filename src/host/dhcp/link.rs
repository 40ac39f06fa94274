//! The macvlan interface a VIP is leased on, over rtnetlink.
//!
//! Why a macvlan: the lease belongs to its own MAC address, not the host's,
//! so every VIP is a distinct DHCP client (as kube-vip does it) and the
//! leased address sits on an interface of its own, which is removed with
//! the lease. Why the `rtnetlink` crate: it is the netlink library of the
//! rust-netlink project (used by youki and others), async on tokio, with a
//! macvlan builder; shelling out to `ip` would need the binary in the
//! unit's sandbox and parse its text.
//!
//! The leased address goes on with `IFA_F_NOPREFIXROUTE` (`ip addr add …
//! noprefixroute`): whatever subnet mask a server sends, the kernel adds no
//! route for the subnet to the main table, so an offer cannot make half the
//! internet on-link on a tenant's segment. What the kernel still adds for
//! the address is what every local address gets, in the `local` table: the
//! `local <VIP>` route, and for prefixes up to /30 the subnet's `broadcast`
//! route (which [`super::guard::judge`] checks against the host's addresses
//! and gateways).
//!
//! [`Macvlan::host_view`] reads what an offer is judged against: every
//! IPv4 address and `local` route of the host and every gateway of any
//! route, all tables, except the client's own interface.
//!
//! Everything here needs `CAP_NET_ADMIN`.

use std::net::{IpAddr, Ipv4Addr};

use futures_util::TryStreamExt;
use rtnetlink::packet_route::address::{AddressAttribute, AddressFlags};
use rtnetlink::packet_route::link::{LinkAttribute, LinkFlags, MacVlanMode};
use rtnetlink::{Handle, LinkMacVlan};

use super::guard::HostView;

/// Why an interface could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// No netlink socket (no `AF_NETLINK` in the sandbox?).
    #[error("cannot open a netlink socket: {0}")]
    Socket(std::io::Error),
    /// The host interface named in `[load_balancer.dhcp] interface` is missing.
    #[error("host interface {0:?} does not exist")]
    NoParent(String),
    /// The host's addresses and routes could not be read.
    #[error("cannot read the host's addresses and routes: {0}")]
    HostUnreadable(crate::host::announce::routes::AnnounceError),
    /// The kernel refused (no `CAP_NET_ADMIN`, a name taken by another kind
    /// of interface…).
    #[error("{what}: {source}")]
    Netlink {
        /// What was being done.
        what: String,
        /// The kernel's answer.
        source: rtnetlink::Error,
    },
}

/// The macvlan interface of one client.
#[derive(Debug)]
pub struct Macvlan {
    handle: Handle,
    /// Its name (`hlb` and the MAC's last bytes).
    pub name: String,
    /// Its index.
    pub index: u32,
}

/// The interface name for MAC `mac`: `hlb` + 10 hex digits (IFNAMSIZ is 16).
pub fn name_for(mac: [u8; 6]) -> String {
    format!(
        "hlb{:02x}{:02x}{:02x}{:02x}{:02x}",
        mac[1], mac[2], mac[3], mac[4], mac[5]
    )
}

async fn index_of(handle: &Handle, name: &str) -> Result<Option<u32>, rtnetlink::Error> {
    let mut links = handle.link().get().match_name(name.to_string()).execute();
    match links.try_next().await {
        Ok(Some(msg)) => Ok(Some(msg.header.index)),
        Ok(None) => Ok(None),
        // ENODEV: no such interface.
        Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => Ok(None),
        Err(e) => Err(e),
    }
}

impl Macvlan {
    /// Creates the macvlan interface `name_for(mac)` on `parent` in bridge
    /// mode, with `mac`, up. One a previous run left is adopted when it is
    /// exactly that (on `parent`, `mac`, up), else replaced.
    pub async fn create(parent: &str, mac: [u8; 6]) -> Result<Self, LinkError> {
        let (conn, handle, _) = rtnetlink::new_connection().map_err(LinkError::Socket)?;
        tokio::spawn(conn);
        let name = name_for(mac);
        let nl = |what: String| move |source| LinkError::Netlink { what, source };
        let parent_index = index_of(&handle, parent)
            .await
            .map_err(nl(format!("cannot look up {parent:?}")))?
            .ok_or_else(|| LinkError::NoParent(parent.to_string()))?;
        if let Some(old) = index_of(&handle, &name)
            .await
            .map_err(nl(format!("cannot look up {name:?}")))?
        {
            // A previous run's, exactly as this one makes it (a hand-over
            // left it, with its leased address): kept, so the VIP stays on
            // the host while the client confirms its lease (issue 41).
            let kept = Self {
                handle: handle.clone(),
                name: name.clone(),
                index: old,
            };
            if let Ok(None) = kept.differs(parent, mac).await {
                tracing::info!(interface = %name, "adopting the macvlan interface a previous run left (same parent, MAC, up), with its addresses");
                return Ok(kept);
            }
            tracing::info!(interface = %name, "removing the macvlan interface a previous run left");
            handle
                .link()
                .del(old)
                .execute()
                .await
                .map_err(nl(format!("cannot remove the old {name:?}")))?;
        }
        handle
            .link()
            .add(
                LinkMacVlan::new(&name, parent_index, MacVlanMode::Bridge)
                    .address(mac.to_vec())
                    .up()
                    .build(),
            )
            .execute()
            .await
            .map_err(nl(format!("cannot create macvlan {name:?} on {parent:?}")))?;
        let index = index_of(&handle, &name)
            .await
            .map_err(nl(format!("cannot look up {name:?}")))?
            .ok_or_else(|| LinkError::NoParent(name.clone()))?;
        Ok(Self {
            handle,
            name,
            index,
        })
    }

    /// Puts `address/prefix` on the interface (replacing the same address
    /// with another prefix), without a prefix route (`noprefixroute`).
    pub async fn add_address(&self, address: Ipv4Addr, prefix: u8) -> Result<(), LinkError> {
        let mut request = self
            .handle
            .address()
            .add(self.index, IpAddr::V4(address), prefix)
            .replace();
        request
            .message_mut()
            .attributes
            .push(AddressAttribute::Flags(AddressFlags::Noprefixroute));
        request
            .execute()
            .await
            .map_err(|source| LinkError::Netlink {
                what: format!("cannot add {address}/{prefix} to {}", self.name),
                source,
            })
    }

    /// The interface's entries for `address` (any prefix), as the kernel
    /// lists them.
    fn address_dump(
        &self,
        address: Ipv4Addr,
    ) -> impl futures_util::TryStream<
        Ok = rtnetlink::packet_route::address::AddressMessage,
        Error = rtnetlink::Error,
    > + Unpin
    + '_ {
        self.handle
            .address()
            .get()
            .set_link_index_filter(self.index)
            .set_address_filter(IpAddr::V4(address))
            .execute()
    }

    /// Takes `address` off the interface (any prefix); absent is fine.
    pub async fn remove_address(&self, address: Ipv4Addr) -> Result<(), LinkError> {
        let mut found = self.address_dump(address);
        let mut msgs = Vec::new();
        while let Ok(Some(m)) = found.try_next().await {
            msgs.push(m);
        }
        for m in msgs {
            self.handle
                .address()
                .del(m)
                .execute()
                .await
                .map_err(|source| LinkError::Netlink {
                    what: format!("cannot remove {address} from {}", self.name),
                    source,
                })?;
        }
        Ok(())
    }

    /// Removes the interface (and with it every address on it).
    pub async fn delete(self) -> Result<(), LinkError> {
        self.handle
            .link()
            .del(self.index)
            .execute()
            .await
            .map_err(|source| LinkError::Netlink {
                what: format!("cannot remove {}", self.name),
                source,
            })
    }

    /// What the host holds now (addresses, `local` routes, gateways; all
    /// tables; this interface left out), to judge an offer against: the
    /// VIP guard's reading of the host ([`crate::host::vip_guard::HostNet`]), seen from this
    /// interface.
    pub async fn host_view(&self) -> Result<HostView, LinkError> {
        let host = crate::host::vip_guard::HostNet::read(&self.handle)
            .await
            .map_err(LinkError::HostUnreadable)?;
        Ok(HostView::of(&host, self.index))
    }

    /// What differs between the host's interface of this name and the one
    /// [`Macvlan::create`] made (up, on `parent`, with `mac`): `None` when
    /// nothing does. Another program with `CAP_NET_ADMIN` may delete it or
    /// take it down; the driver reads it back every
    /// [`crate::host::owned::CHECK_INTERVAL`].
    pub async fn differs(&self, parent: &str, mac: [u8; 6]) -> Result<Option<String>, LinkError> {
        let nl = |what: String| move |source| LinkError::Netlink { what, source };
        let parent_index = index_of(&self.handle, parent)
            .await
            .map_err(nl(format!("cannot look up {parent:?}")))?;
        let mut links = self
            .handle
            .link()
            .get()
            .match_name(self.name.clone())
            .execute();
        let link = match links.try_next().await {
            Ok(Some(m)) => m,
            Ok(None) => return Ok(Some(format!("interface {} missing", self.name))),
            Err(rtnetlink::Error::NetlinkError(e)) if e.raw_code() == -libc::ENODEV => {
                return Ok(Some(format!("interface {} missing", self.name)));
            }
            Err(e) => return Err(nl(format!("cannot look up {:?}", self.name))(e)),
        };
        let on = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::Link(i) => Some(*i),
            _ => None,
        });
        let address = link.attributes.iter().find_map(|a| match a {
            LinkAttribute::Address(m) => Some(m.as_slice()),
            _ => None,
        });
        Ok(if link.header.index != self.index {
            Some(format!(
                "interface {} replaced (index {}, was {})",
                self.name, link.header.index, self.index
            ))
        } else if parent_index.is_none() || on != parent_index {
            Some(format!("interface {} not on {parent:?}", self.name))
        } else if address != Some(&mac[..]) {
            Some(format!("interface {} has another MAC address", self.name))
        } else if !link.header.flags.contains(LinkFlags::Up) {
            Some(format!("interface {} down", self.name))
        } else {
            None
        })
    }

    /// What differs between `address/prefix` as [`Macvlan::add_address`]
    /// put it on and what the interface holds: `None` when nothing does.
    pub async fn address_differs(
        &self,
        address: Ipv4Addr,
        prefix: u8,
    ) -> Result<Option<String>, LinkError> {
        let mut found = self.address_dump(address);
        let mut held = None;
        while let Some(m) = found
            .try_next()
            .await
            .map_err(|source| LinkError::Netlink {
                what: format!("cannot read the addresses of {}", self.name),
                source,
            })?
        {
            held = Some(m);
        }
        let Some(m) = held else {
            return Ok(Some(format!(
                "address {address}/{prefix} missing on {}",
                self.name
            )));
        };
        let no_prefix_route = m.attributes.iter().any(
            |a| matches!(a, AddressAttribute::Flags(f) if f.contains(AddressFlags::Noprefixroute)),
        );
        Ok(if m.header.prefix_len != prefix {
            Some(format!(
                "address {address} on {} has prefix /{}, not /{prefix}",
                self.name, m.header.prefix_len
            ))
        } else if !no_prefix_route {
            Some(format!(
                "address {address}/{prefix} on {} lacks noprefixroute",
                self.name
            ))
        } else {
            None
        })
    }

    /// Whether the interface still exists (someone may delete it by hand).
    pub async fn exists(&self) -> bool {
        let mut links = self.handle.link().get().match_index(self.index).execute();
        matches!(links.try_next().await, Ok(Some(m)) if m.attributes.iter().any(|a| matches!(a, LinkAttribute::IfName(n) if *n == self.name)))
    }
}

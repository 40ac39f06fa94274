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
//! Everything here needs `CAP_NET_ADMIN`.

use std::net::{IpAddr, Ipv4Addr};

use futures_util::TryStreamExt;
use rtnetlink::packet_route::link::{LinkAttribute, MacVlanMode};
use rtnetlink::{Handle, LinkMacVlan};

/// Why an interface could not be set up.
#[derive(Debug, thiserror::Error)]
pub enum LinkError {
    /// No netlink socket (no `AF_NETLINK` in the sandbox?).
    #[error("cannot open a netlink socket: {0}")]
    Socket(std::io::Error),
    /// The host interface named in `[load_balancer.dhcp] interface` is missing.
    #[error("host interface {0:?} does not exist")]
    NoParent(String),
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
    /// mode, with `mac`, up. One left by a crashed daemon is replaced.
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
    /// with another prefix).
    pub async fn add_address(&self, address: Ipv4Addr, prefix: u8) -> Result<(), LinkError> {
        self.handle
            .address()
            .add(self.index, IpAddr::V4(address), prefix)
            .replace()
            .execute()
            .await
            .map_err(|source| LinkError::Netlink {
                what: format!("cannot add {address}/{prefix} to {}", self.name),
                source,
            })
    }

    /// Takes `address` off the interface (any prefix); absent is fine.
    pub async fn remove_address(&self, address: Ipv4Addr) -> Result<(), LinkError> {
        let mut found = self
            .handle
            .address()
            .get()
            .set_link_index_filter(self.index)
            .set_address_filter(IpAddr::V4(address))
            .execute();
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

    /// Whether the interface still exists (someone may delete it by hand).
    pub async fn exists(&self) -> bool {
        let mut links = self.handle.link().get().match_index(self.index).execute();
        matches!(links.try_next().await, Ok(Some(m)) if m.attributes.iter().any(|a| matches!(a, LinkAttribute::IfName(n) if *n == self.name)))
    }
}

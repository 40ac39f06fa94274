//! Readiness of one VIP (`/readyz?vip=…`): what a front end that moves
//! addresses between hosts (keepalived, one VRRP instance per VIP) asks,
//! so that one tenant's listener that cannot bind moves that tenant's VIP
//! alone, not every VIP of the host.

use std::net::{IpAddr, SocketAddr};

use super::{Daemon, ListenerEntry};
use crate::config::Protocol;

/// Why a VIP is not ready to take traffic here.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum VipNotReady {
    /// No load balancer of the config in force has this VIP (a leased VIP
    /// counts once its lease is in force). Not a readiness failure of the
    /// host: the question names something that is not here.
    #[error(
        "no load balancer of the config in force has VIP {0}; ask about a load balancer's `vip` (a leased one once its lease is in force)"
    )]
    Unknown(IpAddr),
    /// Shutdown has begun: every VIP should leave the host while open
    /// connections drain.
    #[error("stopping")]
    Stopping,
    /// No config has been applied yet.
    #[error("no config applied yet")]
    NoConfig,
    /// Listeners of the VIP that are not bound, each with why.
    #[error("{} listener(s) not bound", .0.len())]
    Unbound(Vec<UnboundListener>),
    /// The VIP is on an isolated `[[network]]` and the VM-network guard
    /// is not in force: holding the VIP, this host would route for the
    /// network's VMs into every other network. keepalived moves the VIP to
    /// a host whose guard is in force.
    #[error(
        "VIP {vip} is on network {network:?} (interface {interface:?}), whose VM-network guard (nftables table inet harvester_lb_vmnet) is not in force here; /status vm_network_guard says why"
    )]
    Unguarded {
        /// The VIP asked about.
        vip: IpAddr,
        /// Its `[[network]]`.
        network: String,
        /// The network's interface.
        interface: String,
    },
}

/// A listener of a VIP that is not serving.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct UnboundListener {
    /// Its load balancer (`<namespace>/<service>`).
    pub load_balancer: String,
    /// The listener's name.
    pub listener: String,
    /// VIP:port.
    pub address: SocketAddr,
    /// `tcp` or `udp`.
    pub protocol: Protocol,
    /// What the bind said.
    pub error: String,
}

impl std::fmt::Display for UnboundListener {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "listener {}/{} ({} listener {:?}): {}",
            self.address, self.protocol, self.load_balancer, self.listener, self.error
        )
    }
}

impl Daemon {
    /// Whether every one of `vips` is ready here: the daemon is not
    /// stopping, a config is in force, and every listener of every load
    /// balancer on those VIPs is bound, and the VM-network guard is in
    /// force for the isolated networks they are on. Other VIPs' listeners do not
    /// count: [`Daemon::is_ready`] is the host-wide question.
    pub fn vips_ready(&self, vips: &[IpAddr]) -> Result<(), VipNotReady> {
        let st = self.lock();
        let Some(config) = &st.config else {
            return Err(if self.is_stopping() {
                VipNotReady::Stopping
            } else {
                VipNotReady::NoConfig
            });
        };
        let mut unbound = Vec::new();
        let mut unguarded = None;
        for vip in vips {
            let vip = vip.to_canonical();
            let mut known = false;
            for spec in config.load_balancers.iter().filter(|l| l.vip == vip) {
                known = true;
                if let Some(net) = config
                    .networks
                    .iter()
                    .find(|n| spec.network.as_deref() == Some(n.name.as_str()))
                    .filter(|n| n.isolate && !self.vmnet.guard.guards(&n.interface))
                {
                    unguarded.get_or_insert(VipNotReady::Unguarded {
                        vip,
                        network: net.name.clone(),
                        interface: net.interface.clone(),
                    });
                }
                for l in &spec.listeners {
                    let address = spec.listen_addr(l);
                    let error = match st.listeners.get(&spec.listener_key(l)) {
                        Some(ListenerEntry { socket: Ok(_), .. }) => continue,
                        Some(ListenerEntry { socket: Err(e), .. }) => e.to_string(),
                        None => "not started".to_string(),
                    };
                    unbound.push(UnboundListener {
                        load_balancer: spec.name.clone(),
                        listener: l.name.clone(),
                        address,
                        protocol: l.protocol,
                        error,
                    });
                }
            }
            if !known {
                return Err(VipNotReady::Unknown(vip));
            }
        }
        if self.is_stopping() {
            Err(VipNotReady::Stopping)
        } else if let Some(e) = unguarded {
            Err(e)
        } else if unbound.is_empty() {
            Ok(())
        } else {
            Err(VipNotReady::Unbound(unbound))
        }
    }
}

//! An operator's drain, maintenance and ready marks on a backend
//! (`POST /backends/state` on the admin socket).

use std::net::IpAddr;

use serde::Serialize;

use super::Daemon;
use crate::dataplane::balancer::AdminState;

impl Daemon {
    /// Sets the operator's state of backend `addr` of load balancer
    /// `load_balancer` (`POST /backends/state`) and publishes the new
    /// eligible set. `maint` takes the backend off its probe stream; leaving
    /// `maint` puts it back, starting from the load balancer's
    /// `initial_state` (its last verdict is stale by then), and probed at
    /// once or by the stream's next probe. Applied under the reload lock, so
    /// a concurrent reload sees it before or after, never half.
    pub fn set_admin_state(
        &self,
        load_balancer: &str,
        addr: IpAddr,
        state: AdminState,
    ) -> Result<AdminStateChange, AdminStateError> {
        let st = self.lock();
        let entry = st
            .load_balancers
            .get(load_balancer)
            .ok_or_else(|| AdminStateError::UnknownLoadBalancer(load_balancer.to_string()))?;
        let backend = entry
            .backends
            .get(&addr)
            .ok_or_else(|| AdminStateError::NotAMember {
                load_balancer: load_balancer.to_string(),
                backend: addr,
            })?;
        let previous = backend.set_admin_state(state);
        let spec = st
            .config
            .as_ref()
            .and_then(|c| c.load_balancers.iter().find(|l| l.name == load_balancer));
        match (previous, state) {
            (AdminState::Maint, AdminState::Maint) => {}
            (_, AdminState::Maint) => self.stop_probing(load_balancer, backend),
            (AdminState::Maint, _) => {
                if let Some(spec) = spec {
                    self.ensure_probes(entry, spec);
                }
            }
            _ => {}
        }
        entry.lb.publish();
        if let Some(config) = &st.config {
            // maint may have stopped a probe stream, leaving it started one.
            self.metrics
                .set_config_in_force(config.load_balancers.len(), self.prober.streams());
        }
        if previous != state {
            tracing::info!(
                load_balancer,
                backend = %addr,
                from = %previous,
                to = %state,
                open = backend.active_connections(),
                "backend admin state changed"
            );
        }
        Ok(AdminStateChange { previous, state })
    }
}

/// What [`Daemon::set_admin_state`] changed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct AdminStateChange {
    /// The state before.
    pub previous: AdminState,
    /// The state now.
    pub state: AdminState,
}

/// Why an admin state could not be set: the request names something the
/// config in force does not have.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum AdminStateError {
    /// No load balancer of that name is in force.
    #[error("unknown load balancer {0:?}; /status lists the load balancers in force")]
    UnknownLoadBalancer(String),
    /// The address is not one of its backends.
    #[error(
        "{backend} is not a backend of load balancer {load_balancer:?}; /status lists its backends"
    )]
    NotAMember {
        /// The load balancer named.
        load_balancer: String,
        /// The address named.
        backend: IpAddr,
    },
}

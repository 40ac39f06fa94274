//! [`Route`]: what a listener of either transport forwards to.

use std::sync::Arc;

use crate::config::ProxyProtocol;
use crate::dataplane::balancer::LoadBalancer;
use crate::metrics::ListenerStats;

/// What a listener forwards to. Swapped as a whole on reload, so a
/// connection always sees one load balancer and one nodeport that belong together.
pub struct Route {
    /// The load balancer whose snapshot is read.
    pub lb: Arc<LoadBalancer>,
    /// The listener's name in the config.
    pub listener: String,
    /// The nodeport on every backend.
    pub backend_port: u16,
    /// This listener's numbers.
    pub stats: Arc<ListenerStats>,
    /// The PROXY protocol header to send the backend first, if any.
    pub proxy_protocol: Option<ProxyProtocol>,
}

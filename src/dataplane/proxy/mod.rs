//! The forwarder: listeners per VIP:port and protocol, and what they
//! forward to.
//!
//! [`Protocol`](crate::config::Protocol) is the seam between transports:
//! a TCP listener ([`tcp::Listener`]) and a UDP one ([`udp::UdpListener`])
//! read the same load-balancer snapshot through a [`Route`]; [`Running`] is
//! either, as the daemon keeps them.

pub mod log;
pub mod route;
pub mod tcp;
pub mod udp;

use std::sync::{Arc, LazyLock};
use std::time::Duration;

use crate::dataplane::balancer::LoadBalancer;
use crate::log_limit::{LogLimit, Verdict, left_out};

/// Which of a load balancer's caps.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Cap {
    /// `max_connections`: its TCP connections.
    Connections,
    /// `max_udp_flows`: its UDP flows.
    UdpFlows,
}

/// Which cap a log line is about (`None`: the process-wide connection
/// cap), and whether it was reached (`true`) or left.
pub(crate) type CapCause = (Option<(String, Cap)>, bool);

/// Log lines about caps, a few per minute each.
pub(crate) static CAP_LOG: LazyLock<LogLimit<CapCause>> =
    LazyLock::new(|| LogLimit::new(2, Duration::from_secs(60)));

/// After a refusal (`reached`) or a release (`!reached`) of one of `lb`'s
/// caps: says once, rate limited, that it reached the cap (warn) or is
/// back under 90% of it (info). Costs one atomic load when nothing changed.
pub(crate) fn note_lb_cap(lb: &LoadBalancer, cap: Cap, reached: bool) {
    let budget = match cap {
        Cap::Connections => lb.connections(),
        Cap::UdpFlows => lb.udp_flows(),
    };
    let changed = if reached {
        budget.note_full()
    } else {
        budget.note_release()
    };
    if !changed {
        return;
    }
    let Verdict::Write { suppressed } = CAP_LOG.check((Some((lb.name.clone(), cap)), reached))
    else {
        return;
    };
    let (what, meanwhile) = match cap {
        Cap::Connections => (
            "connection",
            "its new connections are reset until some close",
        ),
        Cap::UdpFlows => (
            "UDP flow",
            "datagrams of its new flows are dropped until some end",
        ),
    };
    if reached {
        tracing::warn!(
            load_balancer = &*lb.name,
            cap = budget.max(),
            "load balancer reached its {what} cap: {meanwhile} (other load balancers are unaffected){}",
            left_out(suppressed)
        );
    } else {
        tracing::info!(
            load_balancer = &*lb.name,
            cap = budget.max(),
            "load balancer back under its {what} cap{}",
            left_out(suppressed)
        );
    }
}

pub use route::Route;
pub use tcp::{HandedConnection, HandedOver, Listener, bind};

/// What a listener of either transport passed on at a hand-over.
#[derive(Debug)]
pub enum Handed {
    /// A TCP listener's paused connections, and how many it lost.
    Tcp(tcp::HandedOver),
    /// A UDP listener's flows.
    Udp(Vec<udp::HandedFlow>),
}

/// A bound listener of either transport: what the daemon keeps per
/// (VIP:port, protocol), so the diff on reload is one code path for both.
pub enum Running {
    /// A TCP listener and its connections.
    Tcp(Listener),
    /// A UDP listener and its flows.
    Udp(udp::UdpListener),
}

impl Running {
    /// The route in force.
    pub fn route(&self) -> Arc<Route> {
        match self {
            Running::Tcp(l) => l.route(),
            Running::Udp(l) => l.route(),
        }
    }

    /// Connections open through a TCP listener; flows of a UDP one.
    pub fn open_connections(&self) -> usize {
        match self {
            Running::Tcp(l) => l.open_connections(),
            Running::Udp(l) => l.flows(),
        }
    }

    /// The flow rules of a UDP listener; `None` for TCP.
    pub fn udp_settings(&self) -> Option<crate::config::UdpSettings> {
        match self {
            Running::Tcp(_) => None,
            Running::Udp(l) => Some(l.settings()),
        }
    }

    /// Hands the listener's open connections or flows to the next process
    /// instead of draining them (see [`Listener::hand_over`] and
    /// [`udp::UdpListener::hand_over`]; `deadline` bounds TCP's pause).
    pub async fn hand_over(self, deadline: tokio::time::Instant) -> Handed {
        match self {
            Running::Tcp(l) => Handed::Tcp(l.hand_over(deadline).await),
            Running::Udp(l) => Handed::Udp(l.hand_over().await),
        }
    }

    /// Removes the listener: TCP drains for up to `timeout`; UDP has no
    /// connection to drain and stops at once. Returns how many connections
    /// or flows were cut.
    pub async fn drain(self, timeout: Duration) -> usize {
        match self {
            Running::Tcp(l) => l.drain(timeout).await,
            Running::Udp(l) => l.stop().await,
        }
    }
}

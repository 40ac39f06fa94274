//! `ipam = "dhcp"`: the daemon leases the VIP.
//!
//! Each such load balancer gets a DHCPv4 client of its own ([`client`],
//! the state machine; [`run`], its driver) on a macvlan interface of its
//! own ([`link`]) with a stable MAC address, so the lease is the load
//! balancer's, survives restarts ([`state`]) and goes with it (RELEASE).
//! [`Leases`] keeps one client per load balancer in step with the config;
//! the daemon reads each lease's address from it, puts it in place of the
//! `0.0.0.0` VIP, and re-applies the config whenever [`Leases::changed`]
//! is notified.
//!
//! Never: a panic or a change of VIP on a packet that is not the answer to
//! the client's own request (see [`client`]), nor an address that
//! [`guard`] refuses (the host's own, its gateways', outside the operator's
//! ranges), nor a route the server's subnet mask asks for (see [`link`]).

pub mod client;
pub mod guard;
pub mod link;
pub mod run;
pub mod socket;
pub mod state;
pub mod wire;

use std::collections::HashMap;
use std::net::{IpAddr, Ipv4Addr};
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, SystemTime};

use arc_swap::ArcSwap;
use tokio::sync::Notify;
use tokio_util::sync::CancellationToken;
use tokio_util::task::TaskTracker;

use crate::config::{Config, DhcpGuard, DhcpSpec};
use crate::metrics::{HostRepairs, LeaseStats};

/// How long a clean stop waits for RELEASEs and interface removals.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// One load balancer that wants a lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Want {
    /// Its name.
    pub name: String,
    /// Its cluster.
    pub cluster: String,
    /// Its `[load_balancer.dhcp]`.
    pub spec: DhcpSpec,
    /// Its guard: `spec`'s keys, else `[dhcp]`'s.
    pub guard: DhcpGuard,
}

impl Want {
    /// Whether `other` is served by the same running client (a change of
    /// the guard alone is applied to it in place).
    fn same_client(&self, other: &Want) -> bool {
        self.name == other.name
            && self.cluster == other.cluster
            && self.spec.same_client(&other.spec)
    }
}

struct Running {
    want: Want,
    guard: Arc<ArcSwap<DhcpGuard>>,
    state_dir: PathBuf,
    stats: Arc<LeaseStats>,
    stop: CancellationToken,
    ending: Arc<run::Ending>,
}

/// The running clients, by load balancer name.
#[derive(Default)]
pub struct Leases {
    running: Mutex<HashMap<String, Running>>,
    changed: Arc<Notify>,
    tasks: TaskTracker,
    /// Where each client counts its repairs (`host_repairs_total{kind="dhcp_lease"}`).
    host_repairs: Arc<HostRepairs>,
}

impl Leases {
    /// No clients; their repairs counted in `host_repairs`.
    pub fn new(host_repairs: Arc<HostRepairs>) -> Self {
        Self {
            host_repairs,
            ..Self::default()
        }
    }

    /// Notified whenever a VIP is leased, changes or is lost.
    pub fn changed(&self) -> Arc<Notify> {
        Arc::clone(&self.changed)
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, HashMap<String, Running>> {
        self.running.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Whether any client runs (a config without DHCP then costs nothing).
    pub fn is_empty(&self) -> bool {
        self.lock().is_empty()
    }

    /// Runs exactly one client per `wanted`: starts the new ones, stops
    /// (with a RELEASE) those no longer wanted or whose identity changed,
    /// and hands a changed guard to the running ones (it judges their next
    /// offer or ACK; the lease is kept until then). Must be called inside
    /// the tokio runtime.
    pub fn reconcile(&self, wanted: &[Want], state_dir: &Path) {
        let mut running = self.lock();
        let gone: Vec<String> = running
            .iter()
            .filter(|(name, r)| {
                !wanted
                    .iter()
                    .any(|w| &w.name == *name && w.same_client(&r.want) && r.state_dir == state_dir)
            })
            .map(|(n, _)| n.clone())
            .collect();
        for name in gone {
            if let Some(r) = running.remove(&name) {
                tracing::info!(load_balancer = %name, "DHCP client stopping: load balancer removed or its [load_balancer.dhcp] changed");
                r.ending
                    .removed
                    .store(true, std::sync::atomic::Ordering::Release);
                r.stop.cancel();
            }
        }
        for w in wanted {
            if let Some(r) = running.get_mut(&w.name) {
                if r.want.guard != w.guard {
                    tracing::info!(load_balancer = %w.name, allowed_ranges = ?w.guard.allowed_ranges.iter().map(ToString::to_string).collect::<Vec<_>>(), min_prefix_length = w.guard.min_prefix_length, "DHCP guard changed; it judges the next offer or ACK");
                    r.guard.store(Arc::new(w.guard.clone()));
                    r.want = w.clone();
                }
                continue;
            }
            let stats = Arc::new(LeaseStats::default());
            let guard = Arc::new(ArcSwap::from_pointee(w.guard.clone()));
            let stop = CancellationToken::new();
            let ending = Arc::new(run::Ending::default());
            let ctx = run::Ctx {
                name: w.name.clone(),
                cluster: w.cluster.clone(),
                spec: w.spec.clone(),
                state_file: state::path(state_dir, w.spec.mac),
                stats: Arc::clone(&stats),
                host_repairs: Arc::clone(&self.host_repairs),
                changed: Arc::clone(&self.changed),
                guard: Arc::clone(&guard),
            };
            self.tasks
                .spawn(run::run(ctx, stop.clone(), Arc::clone(&ending)));
            running.insert(
                w.name.clone(),
                Running {
                    want: w.clone(),
                    guard,
                    state_dir: state_dir.to_path_buf(),
                    stats,
                    stop,
                    ending,
                },
            );
        }
    }

    /// Starts and stops the clients to match `config`'s `ipam = "dhcp"`
    /// load balancers and puts each leased address in place of its load
    /// balancer's `0.0.0.0` VIP (back to `0.0.0.0` while unleased: its
    /// listeners are then not bound).
    pub fn lease_vips(&self, mut config: Config) -> Config {
        let wanted: Vec<Want> = config
            .load_balancers
            .iter()
            .filter_map(|lb| {
                lb.dhcp.as_ref().map(|d| Want {
                    name: lb.name.clone(),
                    cluster: lb.cluster.clone(),
                    spec: d.clone(),
                    guard: d.guard(&config.dhcp.guard),
                })
            })
            .collect();
        if wanted.is_empty() && self.is_empty() {
            return config;
        }
        self.reconcile(&wanted, &config.dhcp.state_directory);
        for spec in &mut config.load_balancers {
            if spec.dhcp.is_some() {
                let vip = self
                    .address(&spec.name)
                    .map_or(IpAddr::V4(Ipv4Addr::UNSPECIFIED), IpAddr::V4);
                if spec.vip != vip {
                    Arc::make_mut(spec).vip = vip;
                }
            }
        }
        config
    }

    /// The leased address of load balancer `name`, if it has one now.
    pub fn address(&self, name: &str) -> Option<Ipv4Addr> {
        self.lock().get(name).and_then(|r| r.stats.address())
    }

    /// Every leased address now, by load balancer name.
    pub fn addresses(&self) -> HashMap<String, IpAddr> {
        self.lock()
            .iter()
            .filter_map(|(name, r)| r.stats.address().map(|a| (name.clone(), IpAddr::V4(a))))
            .collect()
    }

    /// The lease numbers of load balancer `name`.
    pub fn stats(&self, name: &str) -> Option<Arc<LeaseStats>> {
        self.lock().get(name).map(|r| Arc::clone(&r.stats))
    }

    /// The macvlan interface of load balancer `name`.
    pub fn interface(&self, name: &str) -> Option<String> {
        self.lock()
            .get(name)
            .map(|r| link::name_for(r.want.spec.mac))
    }

    /// A hand-over (issue 41): every client stops without a RELEASE,
    /// leaving its macvlan, its address and its lease on disk for the next
    /// process; waits up to five seconds.
    pub async fn leave(&self) {
        self.stop_clients(true).await;
    }

    /// Clean stop: every client releases its lease (kept on disk for the
    /// next start's INIT-REBOOT) and removes its interface; waits up to
    /// five seconds.
    pub async fn shutdown(&self) {
        self.stop_clients(false).await;
    }

    async fn stop_clients(&self, leave: bool) {
        for (_, r) in self.lock().drain() {
            r.ending
                .left
                .store(leave, std::sync::atomic::Ordering::Release);
            r.stop.cancel();
        }
        self.tasks.close();
        if tokio::time::timeout(STOP_TIMEOUT, self.tasks.wait())
            .await
            .is_err()
        {
            tracing::warn!("DHCP clients did not finish stopping within 5 s");
        }
    }
}

/// `t` as Unix seconds.
pub(crate) fn unix_now(t: SystemTime) -> f64 {
    t.duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn want(hostname: &str, min_prefix_length: u8) -> Want {
        Want {
            name: "default/web".into(),
            cluster: "kubernetes".into(),
            spec: DhcpSpec {
                // No such interface: the client only retries its setup, so
                // nothing is created and nothing is sent anywhere.
                interface: "hlbnosuchif0".into(),
                mac: [2, 0, 0, 0, 0, 1],
                hostname: hostname.into(),
                servers: vec![],
                requested: None,
                allowed_ranges: None,
                min_prefix_length: Some(min_prefix_length),
            },
            guard: DhcpGuard {
                allowed_ranges: vec![],
                min_prefix_length,
            },
        }
    }

    #[tokio::test]
    async fn a_guard_change_reaches_the_running_client_without_a_restart() {
        let leases = Leases::new(Arc::default());
        let dir = std::env::temp_dir().join(format!("hlb-leases-{}", std::process::id()));
        leases.reconcile(&[want("web", 16)], &dir);
        let (stop, guard) = {
            let r = leases.lock();
            let r = &r["default/web"];
            (r.stop.clone(), Arc::clone(&r.guard))
        };
        leases.reconcile(&[want("web", 24)], &dir);
        assert!(!stop.is_cancelled(), "the lease is kept");
        assert_eq!(guard.load().min_prefix_length, 24, "the new guard judges");
        // A change of identity is a new client (RELEASE, then DISCOVER).
        leases.reconcile(&[want("web2", 24)], &dir);
        assert!(stop.is_cancelled());
        leases.shutdown().await;
    }
}

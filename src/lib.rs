//! harvester-lb: the data plane of Harvester's guest-cluster `LoadBalancer`
//! services. A TCP and UDP load balancer with active health checks,
//! configured by one TOML file that the cloud-provider controller writes.
//!
//! The modules follow the data flow, one folder per feature:
//!
//! ```text
//! config ──► daemon ──► dataplane::proxy (listeners) ──► forward ──► backend
//!               │                   ▲
//!               ├──► dataplane::health (prober)┘ via dataplane::balancer (one ArcSwap)
//!               │          each publish also wakes, each on its own:
//!               │          ├──► daemon::kernel → host::nat (nftables DNAT of kernel listeners)
//!               │          └──► host::announce (routes for the BGP speaker; reads daemon::announce)
//!               └──► host (the VIP guard, isolation, DHCP leases, VM networks, conntrackd)
//! ```
//!
//! Everything the daemon writes into the host (tables, routes, addresses)
//! is owned: remembered, read back, repaired and reported as the kernel
//! holds it; see [`host::owned`] for the rule and the driver every keyed kind uses.
//!
//! * [`config`]: schema, Harvester's defaults, validation; pure.
//! * [`dataplane`]: what a connection meets: the healthy set and the
//!   picking algorithms (`balancer`), probes (`health`), listeners and
//!   forwarding (`proxy`), the threads (`workers`), shared bounds (`budget`).
//! * [`host`]: what the daemon writes into the host, a folder (or file) per feature:
//!   the NAT of kernel listeners (`nat`: names, builder, writes, read-back,
//!   comparison, keeper), announce routes (`announce`), DHCP leases
//!   (`dhcp`), the isolation table (`isolation`), VM networks (`vmnet`:
//!   keepalived, networks, legs, reply marks, the tenant guard), conntrackd's
//!   sync (`conntrack_sync`), the VIP guard (`vip_guard`), the `nft` command
//!   (`nft`) and the owned-object rule (`owned`).
//! * [`daemon`]: applies a config as a diff (start-up and reload alike).
//! * [`server`]: the daemon's life: start, the reload loop, the systemd watchdog, drain.
//! * [`admin`]: the admin API's server, in three parts by what each guards:
//!   each listener's bounds (`connections`), what each path answers and who
//!   may ask (`routes`), the Unix socket's trust and binding (`socket`).
//! * [`metrics`], [`systemd`]: how operators and machines see it; [`fd_store`]:
//!   systemd's file descriptor store, which keeps the sockets across a restart.
//! * [`logging`]: log lines queued to a writer thread of their own, so a
//!   stalled stderr never stalls forwarding.
//! * [`import`]: Harvester's `LoadBalancer` objects (and v0.1.x guest
//!   `Service`s) to a config file; beside `check`, it reads `config` and
//!   the VIP guard's judgement (`host::vip_guard`) and talks to no cluster
//!   and no daemon.
//! * Plumbing below them all: [`net`] (the connect shared by forwarder and
//!   prober), [`os`] (what std does not expose), [`log_limit`], [`text`]
//!   (names made safe to print), [`state_file`], and the config file's
//!   watch (`watch`).
//!
//! docs/design.md has a row for every module, grouped by the data
//! flow; a test holds the table to `src/`.
//!
//! The `harvester-lb` binary's own code is outside this library: `src/main.rs`
//! (the dispatch) and `src/cli.rs` with `src/cli/`: the arguments (`args`),
//! each command's reading, printing and exit code, the admin client
//! (`admin_client`), `demo`, `status`'s table (`status_table`) and
//! `import`'s reading, removal guard and exit codes (`cli/import.rs`). It
//! reaches the daemon only through the library's public API and the admin
//! socket.
//!
//! [`start`] runs the whole daemon on an already validated path; tests start it
//! in-process on loopback addresses they choose.

#![deny(unsafe_code)]
#![warn(missing_docs)]

/// This build's version (Cargo's), as `--version`, `/status` and
/// `harvester_lb_build_info` say it.
pub const VERSION: &str = env!("CARGO_PKG_VERSION");
/// The commit this binary was built from (12 hex digits; the build's
/// `HARVESTER_LB_COMMIT` when set; "unknown" when built outside git): so an
/// operator can tell two builds of one version apart.
pub const COMMIT: &str = env!("HARVESTER_LB_COMMIT");
/// `--version`'s text: version and commit.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("HARVESTER_LB_COMMIT"),
    ")"
);

pub mod admin;
pub mod config;
pub mod daemon;
pub mod dataplane;
pub mod fd_store;
pub mod host;
pub mod import;
pub mod log_limit;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod os;
pub mod server;
pub mod state_file;
pub mod systemd;
#[cfg(test)]
mod test_clock;
pub mod text;
mod watch;

pub use server::{Options, Server, StartError, request_reload, start};

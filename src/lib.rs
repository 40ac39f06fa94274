//! harvester-lb: the data plane of Harvester's guest-cluster `LoadBalancer`
//! services. A TCP and UDP load balancer with active health checks,
//! configured by one TOML file that the cloud-provider controller writes.
//!
//! The modules follow the data flow:
//!
//! ```text
//! config ──► daemon ──► proxy (listeners) ──► forward ──► backend
//!               │                   ▲
//!               ├──► health (prober)┘ via balancer (the healthy set, one ArcSwap)
//!               │          each publish also wakes, each on its own:
//!               │          ├──► kernel (nftables DNAT of kernel listeners)
//!               │          └──► daemon::announce (routes for the BGP speaker)
//!               └──► vip (the VIP guard, isolation table, DHCP leases)
//! ```
//!
//! Everything the daemon writes into the host (tables, routes, addresses)
//! is owned: remembered, read back, repaired and reported as the kernel
//! holds it; see [`owned`] for the rule and the driver every keyed kind uses.
//!
//! * [`config`]: schema, Harvester's defaults, validation; pure.
//! * [`health`]: probes and the per-backend state machine.
//! * [`balancer`]: the healthy set swapped atomically, and the picking algorithms.
//! * [`budget`]: one bound shared by many tables (affinity entries, UDP flows).
//! * [`proxy`]: listeners, accept, connect with retry, zero-copy forwarding.
//! * [`daemon`]: applies a config as a diff (start-up and reload alike).
//! * [`server`]: the daemon's life: start, the reload loop, the systemd watchdog, drain.
//! * [`workers`]: the threads TCP connections run on (thread per core or work stealing).
//! * [`kernel`]: `forwarding = "kernel"` listeners as nftables DNAT, written from the daemon's verdicts;
//!   by job: the names (`names`), the builder (`build`), the writes (`commit`
//!   with `nft`, `netlink` for a flip), the read-back (`read_back`) and its
//!   comparison (`check`), the keeper (`sync`).
//! * [`vip`]: the VIPs themselves: never an address the host uses, only
//!   their listeners' ports answer, leased by DHCP or announced by route.
//! * [`nft`]: the `nft` command, run in one place for every table.
//! * [`owned`]: kernel objects the daemon owns (the isolation table, the
//!   NAT tables, announce routes, the VIPs' local routes), read back and repaired
//!   when another process changed them; one driver for the keyed kinds.
//! * [`admin`]: the admin API's server, in three parts by what each guards:
//!   each listener's bounds (`connections`), what each path answers and who
//!   may ask (`routes`), the Unix socket's trust and binding (`socket`).
//! * [`metrics`], [`systemd`]: how operators and machines see it; [`fd_store`]:
//!   systemd's file descriptor store, which keeps the sockets across a restart.
//! * [`logging`]: log lines queued to a writer thread of their own, so a
//!   stalled stderr never stalls forwarding.
//! * [`import`]: Harvester's `LoadBalancer` objects (and v0.1.x guest
//!   `Service`s) to a config file; beside `check`, it reads only `config`.
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
pub mod balancer;
pub mod budget;
pub mod config;
pub mod daemon;
pub mod fd_store;
pub mod health;
pub mod import;
pub mod kernel;
pub mod log_limit;
pub mod logging;
pub mod metrics;
pub mod net;
pub mod nft;
pub mod os;
pub mod owned;
pub mod proxy;
pub mod server;
pub mod state_file;
pub mod systemd;
#[cfg(test)]
mod test_clock;
pub mod text;
pub mod vip;
mod watch;
pub mod workers;

pub use server::{Options, Server, StartError, request_reload, start};

//! The command line's arguments: every subcommand, flag and help text
//! (clap's derive), apart from `main`'s dispatch so that `main.rs` reads as
//! the list of what each command calls.

use std::path::PathBuf;

use clap::{Parser, Subcommand, ValueEnum};

use harvester_lb::config;
use harvester_lb::dataplane::workers;

/// TCP and UDP load balancer with active health checks for Harvester
/// guest-cluster LoadBalancer services.
#[derive(Parser)]
#[command(version = harvester_lb::LONG_VERSION, about, long_about = None)]
pub(crate) struct Cli {
    #[command(subcommand)]
    pub(crate) command: Command,
    /// Log format on stderr (journald captures it).
    #[arg(long, value_enum, global = true, default_value_t = LogFormat::Text)]
    pub(crate) log_format: LogFormat,
}

#[derive(Subcommand)]
pub(crate) enum Command {
    /// Run the daemon: listen on every VIP, probe every backend, forward.
    ///
    /// Reloads on SIGHUP, on `POST /reload` to the admin API and when the
    /// config file changes. SIGTERM or SIGINT drains open connections (up to
    /// proxy.drain_timeout_seconds) and exits 0; a second signal exits at once.
    Run {
        /// The config file.
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// Do not watch the config file for changes.
        #[arg(long)]
        no_watch: bool,
        /// Worker threads for the data plane, prober and admin API (like
        /// HAProxy's nbthread). 1 runs everything on one thread with no
        /// cross-thread scheduling at all. Default: one per core (the CPUs
        /// this process may run on).
        #[arg(long, value_name = "N")]
        threads: Option<std::num::NonZeroUsize>,
        /// How connections are spread over the threads: work-stealing (one
        /// socket per VIP:port, tokio moves tasks to idle threads) or
        /// thread-per-core (one listening socket per thread per VIP:port, a
        /// connection stays on the thread that accepted it). Level on rates
        /// and tail latency in the benchmarks; work stealing binds fewer sockets.
        #[arg(long, value_enum, default_value_t = Scheduler::WorkStealing)]
        scheduler: Scheduler,
    },
    /// Validate a config file: print every problem and exit non-zero, or exit 0.
    Check {
        /// The config file.
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Show the whole job on loopback: start demo nodes for the config's
    /// backends, run the daemon, stop a node and watch it taken out and back.
    Demo {
        /// A config whose addresses are all on loopback.
        #[arg(long, short, default_value = "config/loopback.toml")]
        config: PathBuf,
    },
    /// Ask the running daemon to reload its config and print the outcome.
    ///
    /// POST /reload on the admin socket (--socket, or the config's
    /// admin.socket), and only there: admin.listen is open to every local
    /// user, so an answer from it proves nothing (exit 69 when the socket
    /// cannot be reached; `systemctl kill -s HUP harvester-lb` reloads
    /// without it). The daemon validates the file: a rejected one is exit 78
    /// with every problem, and stays in `status` until a reload succeeds.
    Reload {
        /// The config file. Only its `admin.socket` is read here, so a file
        /// with other errors still names the socket.
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// The admin socket (the config file is then not read).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
    },
    /// The unit's ExecStop=: tell the daemon whether the coming SIGTERM is
    /// the first half of a restart (hand the sockets to the next process
    /// through systemd's file descriptor store) or a stop (drain).
    ///
    /// Without --restart it asks systemd (as root: `systemctl list-jobs`)
    /// which job stops the unit; only a restart job (`systemctl restart`,
    /// `try-restart`, the packages' upgrade) announces a hand-over, with
    /// the unit's FileDescriptorStoreMax=, over POST /hand-over on the
    /// admin socket. Anything else says nothing: the SIGTERM drains.
    PrepareStop {
        /// The config file (only its `admin.socket` is read).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// The admin socket (the config file is then not read).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Announce a restart without asking systemd (tests; a restart by
        /// hand outside systemd with a store of its own).
        #[arg(long)]
        restart: bool,
        /// The unit stopped (default: found from $MAINPID's cgroup, which
        /// systemd sets for ExecStop=).
        #[arg(long)]
        unit: Option<String>,
    },
    /// Set the operator's state of one backend of one load balancer:
    /// `drain` (no new connections, open ones continue, still probed),
    /// `maint` (the same, and not probed) or `ready` (back in service).
    ///
    /// Talks to the daemon's admin socket (POST /backends/state); needs the
    /// rights to open it (root, or the daemon's own user). The state lasts
    /// until changed or the daemon restarts.
    Backend {
        /// The state to set.
        #[arg(value_enum)]
        state: BackendState,
        /// The load balancer, `<namespace>/<service>`.
        #[arg(long = "lb", value_name = "NAME")]
        load_balancer: String,
        /// The backend's address, as in the config.
        #[arg(value_name = "ADDRESS")]
        address: String,
        /// The admin socket (the config file is then not read). Default:
        /// the config's admin.socket.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// The config file whose admin.socket is used when --socket is not
        /// given (only that key is read: a file with other errors still
        /// names the socket).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Withdraw this host's VIPs (`vip.announce = "routes"`) for
    /// maintenance, or announce them again: `drain` deletes every VIP's
    /// route at once, so the router sends new connections to the other
    /// hosts (open ones it hashes elsewhere too: with stateless ECMP they
    /// are reset, see docs/many-hosts.md); `ready` announces each again
    /// once its conditions have held for its delay.
    ///
    /// Talks to the daemon's admin socket (POST /announce/state). Lasts
    /// until changed or the daemon restarts.
    Host {
        /// `drain` or `ready`.
        #[arg(value_enum)]
        state: AnnounceState,
        /// The admin socket (the config file is then not read). Default:
        /// the config's admin.socket.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// The config file whose admin.socket is used when --socket is not
        /// given (only that key is read: a file with other errors still
        /// names the socket).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Withdraw one VIP from this host (`drain`), or let it be announced
    /// again (`ready`); as `host`, for one VIP.
    Vip {
        /// `drain` or `ready`.
        #[arg(value_enum)]
        state: AnnounceState,
        /// The VIP, as in the config.
        #[arg(value_name = "VIP")]
        vip: String,
        /// The admin socket (the config file is then not read). Default:
        /// the config's admin.socket.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// The config file whose admin.socket is used when --socket is not
        /// given (only that key is read: a file with other errors still
        /// names the socket).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Install keepalived's and conntrackd's files as root, for the daemon
    /// run under the shipped unit (the vrrp.conf drop-in;
    /// harvester-lb-vrrp.service runs it): validates and renders from
    /// --config, and installs each file whose rendering equals the
    /// daemon's copy in --from (the daemon has applied that config), then
    /// tells keepalived to reload and runs conntrackd.restart_command.
    ///
    /// Exits 0 (also when the daemon has not applied the file yet: its
    /// next hand-off runs this again), 78 for an invalid config (nothing
    /// installed), 1 when a write, reload or restart failed.
    VrrpInstall {
        /// The config file (root's).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// The directory the daemon hands its rendered files off to.
        #[arg(long, value_name = "DIR", default_value = harvester_lb::host::vmnet::handoff::DIR)]
        from: PathBuf,
    },
    /// Delete every route harvester-lb announces (protocol 252) from the
    /// configured vip.announce_table, without the daemon: for systemd's
    /// `ExecStopPost=`, so a killed daemon's VIPs stop attracting traffic.
    ///
    /// Exits 0 when there was nothing to delete. Reads only
    /// vip.announce_table from the config (default 100 when the file
    /// cannot be read, said on stderr), and admin.socket, beside which a
    /// hand-over leaves its marker (taken from a file with other errors
    /// too).
    Withdraw {
        /// Every VIP (the only form there is; required so the command is
        /// never run by accident).
        #[arg(long, required = true)]
        all: bool,
        /// The config file (its vip.announce_table).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// The table, instead of the config's.
        #[arg(long, value_name = "N")]
        table: Option<u32>,
    },
    /// Show the running daemon's load balancers, listeners and backends as
    /// a table (health, operator state, consecutive counts, last probe and
    /// its age, connections), like `haproxy show stat` or `ipvsadm -L -n`.
    ///
    /// GET /status on the admin socket (--socket, or the config's
    /// admin.socket) when it can be opened, else on the config's
    /// admin.listen. Shows the running config's hash, the last rejected
    /// reload while it stands, and what needs a restart.
    Status {
        /// The config file. Only its `admin.socket` and `admin.listen` are
        /// read, so a file with other errors still names them.
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// The admin socket (the config file is then not read, and
        /// admin.listen is not tried).
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// Print the daemon's JSON as it is.
        #[arg(long)]
        json: bool,
    },
    /// Write the config from Harvester's objects, as `kubectl get … -o json`
    /// or `-o yaml` prints them: `LoadBalancer`s (loadbalancer.harvesterhci.io
    /// v1beta1 or v1alpha1), or a guest cluster's `Service`s of type
    /// LoadBalancer with its `Node`s (with --cluster); with the
    /// NetworkAttachmentDefinitions (and IPPools) of the VM networks the
    /// LoadBalancers name (loadbalancer.harvesterhci.io/network).
    ///
    /// Prints the config on stdout, or with --write replaces PATH through a
    /// temporary file validated as `check` does (exit 78 and nothing written
    /// if it is invalid). Anything that cannot be imported is named on
    /// stderr and the rest is written (exit 3); --strict makes that an
    /// error (exit 65). An address of this host as a VIP or backend skips
    /// its object; --write never empties the file or removes more than half
    /// of it without --allow-removals (exit 77).
    Import {
        /// Files to read (one object, a List, or several YAML documents
        /// each); none or `-`: standard input.
        #[arg(value_name = "FILE")]
        inputs: Vec<PathBuf>,
        /// The guest cluster the Services and Nodes come from.
        #[arg(long, value_name = "NAME")]
        cluster: Option<String>,
        /// Replace this config file (validated first) instead of printing.
        #[arg(long, value_name = "PATH")]
        write: Option<PathBuf>,
        /// Fail (and write nothing) if any object or listener is skipped.
        #[arg(long)]
        strict: bool,
        /// A TOML file with this host's own settings, copied above the load
        /// balancers: any section but [[load_balancer]] ([admin], [proxy],
        /// [metrics], [log], [daemon], [vip], [dhcp], [[network]],
        /// [keepalived], [conntrackd]).
        #[arg(long, value_name = "PATH")]
        base: Option<PathBuf>,
        /// Let --write empty a non-empty config or remove more than half of
        /// its load balancers (refused otherwise: exit 77, nothing written).
        #[arg(long)]
        allow_removals: bool,
        /// Let loopback addresses (127.0.0.0/8, ::1) be VIPs and backends:
        /// for tests and demos on one machine only; never with a guest
        /// cluster's objects, which could then reach this host's services.
        #[arg(long)]
        allow_loopback: bool,
        /// This host's interface on a VM network, where it cannot be
        /// derived from the NetworkAttachmentDefinition (the bridge of an
        /// untagged network, BRIDGE.VLAN of a VLAN) or is named otherwise
        /// here, e.g. default/vlan100=eth1.100. Repeat it for each network.
        #[arg(long = "network-interface", value_name = "NETWORK=INTERFACE")]
        network_interfaces: Vec<String>,
        /// Every imported listener's `forwarding` (default: the config's,
        /// proxy). `kernel` with --source-nat vip and `[conntrackd]` in the
        /// --base file: open connections survive a VIP's move to another
        /// host, which a proxied connection cannot.
        #[arg(long, value_name = "proxy|kernel", value_parser = ["proxy", "kernel"])]
        forwarding: Option<String>,
        /// Every imported listener's `source_nat` (kernel listeners only;
        /// default: the config's, masquerade).
        #[arg(
            long = "source-nat",
            value_name = "masquerade|none|vip",
            value_parser = ["masquerade", "none", "vip"]
        )]
        source_nat: Option<String>,
    },
}

/// The operator states `harvester-lb backend` sets.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum BackendState {
    /// Back in service (once healthy).
    Ready,
    /// No new connections; open ones continue; still probed.
    Drain,
    /// No new connections; open ones continue; not probed.
    Maint,
}

impl BackendState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            BackendState::Ready => "ready",
            BackendState::Drain => "drain",
            BackendState::Maint => "maint",
        }
    }
}

/// What `harvester-lb host` and `harvester-lb vip` set.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum AnnounceState {
    /// Withdraw now: new connections go to the other hosts.
    Drain,
    /// Announce again after the delay.
    Ready,
}

impl AnnounceState {
    pub(crate) fn as_str(self) -> &'static str {
        match self {
            AnnounceState::Drain => "drain",
            AnnounceState::Ready => "ready",
        }
    }
}

/// See `harvester_lb::dataplane::workers::Scheduler`.
#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum Scheduler {
    ThreadPerCore,
    WorkStealing,
}

impl From<Scheduler> for workers::Scheduler {
    fn from(s: Scheduler) -> Self {
        match s {
            Scheduler::ThreadPerCore => Self::ThreadPerCore,
            Scheduler::WorkStealing => Self::WorkStealing,
        }
    }
}

#[derive(Clone, Copy, ValueEnum)]
pub(crate) enum LogFormat {
    Text,
    Json,
}

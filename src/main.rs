//! The `harvester-lb` command: `run`, `check`, `reload`, `backend`,
//! `status`, `import`, `demo`.
//! Thin by design; the daemon and the admin client live in the library.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};

use harvester_lb::StartError;
use harvester_lb::admin::client;
use harvester_lb::config;
use harvester_lb::server::{self, RunError};
use harvester_lb::workers::{self, Runtimes};
use tracing_subscriber::field::MakeExt as _;

/// mimalloc instead of glibc's malloc: a reload of 10,000 load balancers
/// allocates ~80 MB for a moment, which glibc kept (RSS +125 MB after three
/// reloads, measured) and mimalloc gives back; it also parses the config faster.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Exit code for an unusable config (sysexits' EX_CONFIG). The systemd unit
/// lists it in `RestartPreventExitStatus=` so a bad file does not restart-loop.
const EXIT_CONFIG: u8 = 78;
/// Exit code when the daemon could not start for another reason, or refused
/// a request.
const EXIT_START: u8 = 1;
/// Exit code when the daemon cannot be reached (sysexits' EX_UNAVAILABLE).
const EXIT_UNAVAILABLE: u8 = 69;

/// TCP load balancer with active health checks for Harvester guest-cluster
/// LoadBalancer services.
#[derive(Parser)]
#[command(version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Command,
    /// Log format on stderr (journald captures it).
    #[arg(long, value_enum, global = true, default_value_t = LogFormat::Text)]
    log_format: LogFormat,
}

#[derive(Subcommand)]
enum Command {
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
    /// POST /reload on the admin socket named in the config (admin.socket),
    /// and only there: admin.listen is open to every local user, so an
    /// answer from it proves nothing (exit 69 when the socket cannot be
    /// reached; `systemctl kill -s HUP harvester-lb` reloads without it).
    Reload {
        /// The config file (its `admin.socket` is where the daemon listens).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
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
        /// The admin socket. Default: the config's admin.socket.
        #[arg(long, value_name = "PATH")]
        socket: Option<PathBuf>,
        /// The config file whose admin.socket is used when --socket is not given.
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
    },
    /// Show the running daemon's load balancers, listeners and backends as
    /// a table (health, operator state, consecutive counts, last probe and
    /// its age, connections), like `haproxy show stat` or `ipvsadm -L -n`.
    ///
    /// GET /status on the admin socket of the config (admin.socket) when it
    /// can be opened, else on admin.listen.
    Status {
        /// The config file (its `admin.socket` and `admin.listen`).
        #[arg(long, short, default_value = config::DEFAULT_PATH)]
        config: PathBuf,
        /// Print the daemon's JSON as it is.
        #[arg(long)]
        json: bool,
    },
    /// Write the config from Harvester's objects, as `kubectl get … -o json`
    /// or `-o yaml` prints them: `LoadBalancer`s (loadbalancer.harvesterhci.io
    /// v1beta1 or v1alpha1), or a guest cluster's `Service`s of type
    /// LoadBalancer with its `Node`s (with --cluster).
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
        /// A TOML file with this host's [admin], [proxy] and [metrics]
        /// settings, copied above the load balancers.
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
    },
}

/// The operator states `harvester-lb backend` sets.
#[derive(Clone, Copy, ValueEnum)]
enum BackendState {
    /// Back in service (once healthy).
    Ready,
    /// No new connections; open ones continue; still probed.
    Drain,
    /// No new connections; open ones continue; not probed.
    Maint,
}

impl BackendState {
    fn as_str(self) -> &'static str {
        match self {
            BackendState::Ready => "ready",
            BackendState::Drain => "drain",
            BackendState::Maint => "maint",
        }
    }
}

/// See `harvester_lb::workers::Scheduler`.
#[derive(Clone, Copy, ValueEnum)]
enum Scheduler {
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
enum LogFormat {
    Text,
    Json,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    init_tracing(cli.log_format);
    match cli.command {
        Command::Check { config } => check(&config),
        Command::Reload { config } => reload(&config),
        Command::Backend {
            state,
            load_balancer,
            address,
            socket,
            config,
        } => backend(state, &load_balancer, &address, socket, &config),
        Command::Run {
            config,
            no_watch,
            threads,
            scheduler,
        } => {
            // Before anything slow: a SIGHUP during start-up must not kill it.
            harvester_lb::os::ignore_hangup_until_handled();
            run(config, no_watch, threads, scheduler)
        }
        Command::Demo { config } => demo(&config),
        Command::Status { config, json } => status(&config, json),
        Command::Import {
            inputs,
            cluster,
            write,
            strict,
            base,
            allow_removals,
            allow_loopback,
        } => ExitCode::from(harvester_lb::import::command(&harvester_lb::import::Args {
            inputs,
            cluster,
            write,
            strict,
            base,
            allow_removals,
            allow_loopback,
        })),
    }
}

fn init_tracing(format: LogFormat) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HARVESTER_LB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()));
    match format {
        // Every field and message through `text::escape`: a name from an
        // object that holds `\n` or `ESC[8m` cannot forge a line or hide
        // one (the stock text format writes `%name` fields raw). JSON
        // needs none: serde_json escapes control characters itself.
        LogFormat::Text => builder
            .fmt_fields(
                tracing_subscriber::fmt::format::debug_fn(|w, field, value| {
                    if field.name() != "message" {
                        write!(w, "{}=", field.name())?;
                    }
                    // Control characters only: a string field's `Debug`
                    // form has its quotes and backslashes escaped already.
                    harvester_lb::text::write_controls_escaped(w, &format!("{value:?}"))
                })
                .delimited(" "),
            )
            .init(),
        LogFormat::Json => builder.json().init(),
    }
}

fn check(path: &Path) -> ExitCode {
    match config::load(path) {
        Ok(loaded) => {
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            let c = &loaded.config;
            let listeners: usize = c.load_balancers.iter().map(|l| l.listeners.len()).sum();
            println!(
                "config {} is valid: {} load balancers, {} listeners",
                path.display(),
                c.load_balancers.len(),
                listeners
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

fn demo(path: &Path) -> ExitCode {
    let runtime = match Runtimes::new(None, workers::Scheduler::WorkStealing) {
        Ok(r) => r.main,
        Err(e) => return runtime_failed(&e),
    };
    match runtime.block_on(harvester_lb::demo::run(path)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::from(EXIT_START)
        }
    }
}

fn backend(
    state: BackendState,
    load_balancer: &str,
    address: &str,
    socket: Option<PathBuf>,
    config_path: &Path,
) -> ExitCode {
    // The config is read only for admin.socket; a missing or broken file
    // means the default path (the daemon would not run on a broken one).
    let socket = socket.unwrap_or_else(|| {
        config::load(config_path).map_or_else(
            |_| PathBuf::from(config::DEFAULT_ADMIN_SOCKET),
            |l| l.config.admin.socket,
        )
    });
    let body = serde_json::json!({
        "load_balancer": load_balancer,
        "backend": address,
        "state": state.as_str(),
    })
    .to_string();
    match client::request(&socket, hyper::Method::POST, "/backends/state", body) {
        Ok(client::Answer { status, body }) => {
            let answer: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if status.is_success() {
                println!(
                    "{load_balancer} backend {}: {} -> {}",
                    answer["backend"].as_str().unwrap_or(address),
                    answer["previous_state"].as_str().unwrap_or("?"),
                    answer["state"].as_str().unwrap_or(state.as_str()),
                );
                ExitCode::SUCCESS
            } else {
                let message = answer["error"].as_str().unwrap_or(body.trim_end());
                eprintln!("the daemon refused: {message} (HTTP {status})");
                ExitCode::from(EXIT_START)
            }
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_UNAVAILABLE)
        }
    }
}

fn status(path: &Path, json: bool) -> ExitCode {
    let (admin, socket) = match config::load(path) {
        Ok(l) => (l.config.admin.listen, l.config.admin.socket),
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    let body = match client::status(admin, &socket) {
        Ok(client::Status { body, note }) => {
            if let Some(note) = note {
                eprintln!("note: {note}");
            }
            body
        }
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(EXIT_UNAVAILABLE);
        }
    };
    if json {
        println!("{}", body.trim_end());
        return ExitCode::SUCCESS;
    }
    match serde_json::from_str(&body) {
        Ok(doc) => {
            let now = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0.0, |d| d.as_secs_f64());
            print!("{}", harvester_lb::status_table::render(&doc, now));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("the daemon's /status is not JSON ({e})");
            ExitCode::from(EXIT_START)
        }
    }
}

fn reload(path: &Path) -> ExitCode {
    // Read only admin.socket; the daemon validates the whole file itself.
    let socket = match config::load(path) {
        Ok(l) => l.config.admin.socket,
        Err(e) => {
            eprintln!("{e}");
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    // Only the socket, never admin.listen: any local user can bind that
    // port before the daemon does and answer "reloaded" for it.
    match client::request(&socket, hyper::Method::POST, "/reload", String::new()) {
        Ok(client::Answer { status, body }) => {
            if status.is_success() {
                println!("{}", body.trim_end());
                ExitCode::SUCCESS
            } else {
                eprintln!("{}", body.trim_end());
                ExitCode::from(EXIT_CONFIG)
            }
        }
        Err(e) => {
            eprintln!(
                "{}; not reloaded (reload is asked only on the admin socket, never on admin.listen, which any local user could answer; SIGHUP reloads without it: `systemctl kill -s HUP harvester-lb`)",
                e
            );
            ExitCode::from(EXIT_UNAVAILABLE)
        }
    }
}

fn run(
    config: PathBuf,
    no_watch: bool,
    threads: Option<std::num::NonZeroUsize>,
    scheduler: Scheduler,
) -> ExitCode {
    let runtimes = match Runtimes::new(threads, scheduler.into()) {
        Ok(r) => r,
        Err(e) => return runtime_failed(&e),
    };
    let mut options = harvester_lb::Options::new(config);
    options.workers = runtimes.workers();
    if no_watch {
        options.watch_interval = None;
    }
    match runtimes.main.block_on(server::run(options)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tracing::error!("{e}");
            match e {
                RunError::Start(StartError::Config(_)) => ExitCode::from(EXIT_CONFIG),
                _ => ExitCode::from(EXIT_START),
            }
        }
    }
}

fn runtime_failed(e: &std::io::Error) -> ExitCode {
    eprintln!("cannot start the async runtime: {e}");
    ExitCode::from(EXIT_START)
}

//! The command line's side of each command: what it reads, what it asks
//! the daemon (through [`admin_client`]), what it prints and
//! the exit code. The daemon's logic stays in the library; `main.rs` only
//! parses the arguments and dispatches here.
//!
//! With this file, its submodules are the binary's own code, none of it in
//! the library: the arguments ([`args`]), the admin client
//! ([`admin_client`]), `demo` ([`demo`](mod@demo)), `status`'s table
//! ([`status_table`]) and `import`'s reading, guard and exit codes
//! ([`import`](mod@import)).

pub mod admin_client;
pub mod args;
pub mod demo;
pub mod import;
pub mod status_table;

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use harvester_lb::StartError;
use harvester_lb::config;
use harvester_lb::dataplane::workers::{self, Runtimes};
use harvester_lb::logging;
use harvester_lb::server::{self, RunError};
use harvester_lb::text;
use tracing_subscriber::field::MakeExt as _;
use tracing_subscriber::fmt::writer::BoxMakeWriter;

use self::admin_client as client;
use self::args::{AnnounceState, BackendState, LogFormat, Scheduler};

/// Exit code for an unusable config (sysexits' EX_CONFIG). The systemd unit
/// lists it in `RestartPreventExitStatus=` so a bad file does not restart-loop.
pub const EXIT_CONFIG: u8 = 78;
/// Exit code when the daemon could not start for another reason, or refused
/// a request.
pub const EXIT_START: u8 = 1;
/// Exit code when the daemon cannot be reached (sysexits' EX_UNAVAILABLE).
pub const EXIT_UNAVAILABLE: u8 = 69;

/// Logs to stderr (journald captures it, each line prefixed with its
/// priority when stderr is the journal's stream), filtered by
/// `HARVESTER_LB_LOG`.
/// With `queued` (the daemon) each line goes through the bounded queue of
/// [`harvester_lb::logging`] to a writer thread, so a reader of stderr that
/// falls behind never stalls forwarding: keep the returned [`Flush`] until
/// `main` returns, so queued lines (a start-up error) are written before
/// the exit. The other commands write directly.
///
/// [`Flush`]: harvester_lb::logging::Flush
pub fn init_tracing(format: LogFormat, queued: bool) -> Option<logging::Flush> {
    let filter = tracing_subscriber::EnvFilter::try_from_env("HARVESTER_LB_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info"));
    // Under systemd each line carries its priority for the journal.
    let journal = logging::stderr_is_journal();
    // The daemon's text under systemd: the journal's own protocol, with
    // its fields, through the same queue (stderr when the socket fails).
    if queued
        && journal
        && matches!(format, LogFormat::Text)
        && let Some((queue, flush)) = logging::queue_to_journal(&logging::journal_socket())
    {
        tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(queue)
            .with_ansi(false)
            .event_format(logging::JournalFormat)
            .init();
        return Some(flush);
    }
    let (writer, flush) = if queued {
        let (queue, flush) = logging::queue_to_stderr();
        (BoxMakeWriter::new(queue), Some(flush))
    } else {
        (BoxMakeWriter::new(std::io::stderr), None)
    };
    let builder = tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(writer)
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
            .event_format(logging::Prioritized {
                inner: tracing_subscriber::fmt::format(),
                journal,
            })
            .init(),
        LogFormat::Json => builder
            .json()
            .event_format(logging::Prioritized {
                inner: tracing_subscriber::fmt::format().json(),
                journal,
            })
            .init(),
    }
    flush
}

pub fn check(path: &Path) -> ExitCode {
    match config::load(path) {
        Ok(loaded) => {
            for w in &loaded.warnings {
                eprintln!("warning: {w}");
            }
            for n in &loaded.notes {
                eprintln!("note: {n}");
            }
            let c = &loaded.config;
            let listeners: usize = c.load_balancers.iter().map(|l| l.listeners.len()).sum();
            println!(
                "config {} is valid: {}, {}",
                path.display(),
                text::count(c.load_balancers.len(), "load balancer", "load balancers"),
                text::count(listeners, "listener", "listeners")
            );
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("{e}");
            ExitCode::from(EXIT_CONFIG)
        }
    }
}

/// `harvester-lb vrrp-install`: root's half of the hand-off
/// (`harvester_lb::host::vmnet::handoff`), one line per file set on stdout.
pub fn vrrp_install(path: &Path, from: &Path) -> ExitCode {
    use harvester_lb::host::vmnet::handoff::{self, Outcome};
    let loaded = match config::load(path) {
        Ok(l) => l,
        Err(e) => {
            eprintln!("{e}");
            eprintln!(
                "harvester-lb vrrp-install: nothing installed (the daemon keeps its config in force too)"
            );
            return ExitCode::from(EXIT_CONFIG);
        }
    };
    // systemd starts this once for changes that come while it runs (a
    // start of an active oneshot is merged into its job): passes until
    // one finds nothing to wait for and nothing to install, at most
    // PASSES, a second apart while a copy is not the config's yet.
    const PASSES: u32 = 10;
    for pass in 1..=PASSES {
        let outcomes = match handoff::install(&loaded.config, from) {
            Ok(o) => o,
            Err(e) => {
                eprintln!("harvester-lb vrrp-install: {e}");
                return ExitCode::from(EXIT_START);
            }
        };
        let waiting = [&outcomes.0, &outcomes.1]
            .iter()
            .any(|o| matches!(o, Outcome::Waiting));
        let installed = [&outcomes.0, &outcomes.1]
            .iter()
            .any(|o| matches!(o, Outcome::Installed(_)));
        for (what, outcome) in [("keepalived", outcomes.0), ("conntrackd", outcomes.1)] {
            let said = match outcome {
                Outcome::NotConfigured | Outcome::Unchanged if pass > 1 => continue,
                Outcome::NotConfigured => continue,
                Outcome::Waiting if pass < PASSES => continue,
                Outcome::Waiting => format!(
                    "the daemon's copy in {} is not what {} renders (not applied, or refused): nothing installed",
                    from.display(),
                    path.display()
                ),
                Outcome::Unchanged => "up to date".to_string(),
                Outcome::Installed(said) => said,
            };
            println!("{what}: {said}");
        }
        if !waiting && !installed {
            break;
        }
        if waiting {
            std::thread::sleep(std::time::Duration::from_secs(1));
        }
    }
    ExitCode::SUCCESS
}

/// `harvester-lb import`: says what the import says, in order (messages
/// on stderr, the config on stdout), and exits with its code.
pub fn import(args: &import::Args) -> ExitCode {
    let outcome = import::command(args);
    for output in &outcome.output {
        match output {
            import::ImportOutput::Message(m) => eprintln!("harvester-lb import: {m}"),
            import::ImportOutput::Config(text) => print!("{text}"),
        }
    }
    ExitCode::from(outcome.code)
}

pub fn demo(path: &Path) -> ExitCode {
    let runtime = match Runtimes::new(None, workers::Scheduler::WorkStealing) {
        Ok(r) => r.main,
        Err(e) => return runtime_failed(&e),
    };
    match runtime.block_on(demo::run(path, |line| println!("{line}"))) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("demo failed: {e}");
            ExitCode::from(EXIT_START)
        }
    }
}

pub fn backend(
    state: BackendState,
    load_balancer: &str,
    address: &str,
    socket: Option<PathBuf>,
    config_path: &Path,
) -> ExitCode {
    let socket = match admin_target(socket, config_path) {
        Ok(t) => t.socket,
        Err(code) => return code,
    };
    let body = serde_json::json!({
        "load_balancer": load_balancer,
        "backend": address,
        "state": state.as_str(),
    })
    .to_string();
    post_state(&socket, "/backends/state", body, |answer| {
        format!(
            "{load_balancer} backend {}: {} -> {}",
            answer["backend"].as_str().unwrap_or(address),
            answer["previous_state"].as_str().unwrap_or("?"),
            answer["state"].as_str().unwrap_or(state.as_str()),
        )
    })
}

/// Where an admin command finds the daemon.
struct Target {
    /// The admin socket: every request goes there first.
    socket: PathBuf,
    /// `admin.listen`, where `status` alone may fall back to; `None` with
    /// `--socket` (the file is not read then) or an unusable key.
    listen: Option<std::net::SocketAddr>,
}

/// The admin socket of a command that talks to the daemon: `--socket`
/// (the config file is then not read at all), else the config file's
/// `admin.socket` read on its own (`config::admin_endpoints`: a file the
/// daemon rejects, even one that is not TOML, still gives it). A file that
/// cannot be read or whose `admin.socket` is wrong is an error saying so
/// (exit 78), never a silent fall-back to the default socket.
fn admin_target(socket: Option<PathBuf>, config_path: &Path) -> Result<Target, ExitCode> {
    if let Some(socket) = socket {
        return Ok(Target {
            socket,
            listen: None,
        });
    }
    match config::admin_endpoints(config_path) {
        Ok(found) => {
            for note in &found.notes {
                logging::eprint_at(5, &format!("note: {note}"));
            }
            Ok(Target {
                socket: found.socket,
                listen: found.listen,
            })
        }
        Err(e) => {
            logging::eprint_at(3, &e.to_string());
            Err(ExitCode::from(EXIT_CONFIG))
        }
    }
}

/// `harvester-lb host drain|ready` (`vip` = `None`) and `harvester-lb vip
/// drain|ready VIP`.
pub fn announce_state(
    state: AnnounceState,
    vip: Option<&str>,
    socket: Option<PathBuf>,
    config_path: &Path,
) -> ExitCode {
    let socket = match admin_target(socket, config_path) {
        Ok(t) => t.socket,
        Err(code) => return code,
    };
    let body = match vip {
        Some(v) => serde_json::json!({ "vip": v, "state": state.as_str() }),
        None => serde_json::json!({ "state": state.as_str() }),
    }
    .to_string();
    post_state(&socket, "/announce/state", body, |answer| {
        format!(
            "{}: {} -> {}",
            vip.map_or_else(|| "host".to_string(), |v| format!("vip {v}")),
            answer["previous_state"].as_str().unwrap_or("?"),
            answer["state"].as_str().unwrap_or(state.as_str()),
        )
    })
}

/// POSTs a state change to the admin socket; prints `done(answer)` on
/// success, the daemon's reason on refusal; the exit code says which.
fn post_state(
    socket: &Path,
    path: &str,
    body: String,
    done: impl FnOnce(&serde_json::Value) -> String,
) -> ExitCode {
    match client::request(socket, hyper::Method::POST, path, body) {
        Ok(client::Answer { status, body }) => {
            let answer: serde_json::Value = serde_json::from_str(&body).unwrap_or_default();
            if status.is_success() {
                println!("{}", done(&answer));
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

/// `harvester-lb withdraw --all`: no daemon needed. After a hand-over
/// (the unit's `ExecStopPost=` of a restart) the routes stay for the next
/// process: a fresh `handed-over` marker beside the admin socket says so
/// (`daemon::HandOverMarker`; the next process removes it at start, so a
/// later stop withdraws).
pub fn withdraw_all(config_path: &Path, table: Option<u32>) -> ExitCode {
    let loaded = config::load(config_path);
    // The marker is beside the admin socket: a file with a bad hand edit
    // still names it (`admin_endpoints` reads that key alone), or a restart
    // would withdraw every route it hands over.
    let socket = match &loaded {
        Ok(l) => l.config.admin.socket.clone(),
        Err(_) => match config::admin_endpoints(config_path) {
            Ok(found) => found.socket,
            Err(e) => {
                logging::eprint_at(
                    4,
                    &format!(
                        "warning: {e}; looking for the hand-over marker beside the default {}",
                        config::DEFAULT_ADMIN_SOCKET
                    ),
                );
                std::path::PathBuf::from(config::DEFAULT_ADMIN_SOCKET)
            }
        },
    };
    match harvester_lb::daemon::HandOverMarker::keep_routes(&socket) {
        Ok(Some(m)) => {
            println!(
                "handed over to the next process by process {} ({}): the routes stay announced for it; nothing withdrawn",
                m.pid,
                harvester_lb::daemon::HandOverMarker::path(&socket).display()
            );
            return ExitCode::SUCCESS;
        }
        Ok(None) => {}
        Err(e) => logging::eprint_at(4, &format!("warning: {e}")),
    }
    let table = match table {
        Some(t) => t,
        None => match loaded {
            // Nothing announces: the unit's ExecStopPost= must not need
            // netlink (the default sandbox has none) to do nothing.
            Ok(l) if !l.config.vip.announce.enabled() => {
                println!(
                    "vip.announce is \"none\" in {}: nothing is announced, nothing to withdraw (--table N withdraws from table N anyway)",
                    config_path.display()
                );
                return ExitCode::SUCCESS;
            }
            Ok(l) => l.config.vip.announce.table,
            Err(e) => {
                logging::eprint_at(
                    4,
                    &format!(
                        "warning: cannot read {} ({e}); withdrawing from the default table {}",
                        config_path.display(),
                        config::DEFAULT_ANNOUNCE_TABLE
                    ),
                );
                config::DEFAULT_ANNOUNCE_TABLE
            }
        },
    };
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(r) => r,
        Err(e) => return runtime_failed(&e),
    };
    match runtime.block_on(harvester_lb::host::announce::routes::withdraw_all(table)) {
        Ok(withdrawn) => {
            let list = |vips: &[std::net::IpAddr]| {
                vips.iter()
                    .map(ToString::to_string)
                    .collect::<Vec<_>>()
                    .join(", ")
            };
            if withdrawn.routes.is_empty() {
                println!("table {table}: no harvester-lb route to withdraw");
            } else {
                println!(
                    "table {table}: withdrew {} VIP(s): {}",
                    withdrawn.routes.len(),
                    list(&withdrawn.routes)
                );
            }
            if !withdrawn.local.is_empty() {
                println!(
                    "table {table}: removed the local route of {} VIP(s): {}",
                    withdrawn.local.len(),
                    list(&withdrawn.local)
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            logging::eprint_at(3, &format!("withdraw --all, table {table}: {e}"));
            ExitCode::from(EXIT_START)
        }
    }
}

/// `harvester-lb status`: the daemon's `/status` as a table (or as it is
/// with `--json`). Needs only the socket (see [`admin_target`]): right after
/// a bad edit is when it is needed, and `/status` then says the daemon
/// rejected it.
pub fn status(socket: Option<PathBuf>, path: &Path, json: bool) -> ExitCode {
    let Target { socket, listen } = match admin_target(socket, path) {
        Ok(t) => t,
        Err(code) => return code,
    };
    let body = match client::status(listen, &socket) {
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
            print!("{}", status_table::render(&doc, now));
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("the daemon's /status is not JSON ({e})");
            ExitCode::from(EXIT_START)
        }
    }
}

/// `harvester-lb reload`: asks the daemon to reload and prints its answer
/// (what changed, what needs a restart, or every problem of a rejected
/// file, exit 78).
pub fn reload(socket: Option<PathBuf>, path: &Path) -> ExitCode {
    // Only admin.socket; the daemon validates the whole file itself (and
    // keeps a rejected file's problems in /status).
    let socket = match admin_target(socket, path) {
        Ok(t) => t.socket,
        Err(code) => return code,
    };
    // Only the socket, never admin.listen: any local user can bind that
    // port before the daemon does and answer "reloaded" for it.
    match client::request(&socket, hyper::Method::POST, "/reload", String::new()) {
        Ok(client::Answer { status, body }) => {
            if status.is_success() {
                println!("{}", body.trim_end());
                ExitCode::SUCCESS
            } else {
                logging::eprint_at(3, body.trim_end());
                ExitCode::from(EXIT_CONFIG)
            }
        }
        Err(e) => {
            logging::eprint_at(
                3,
                &format!(
                    "{}; not reloaded (reload is asked only on the admin socket, never on admin.listen, which any local user could answer; SIGHUP reloads without it: `systemctl kill -s HUP harvester-lb`)",
                    e
                ),
            );
            ExitCode::from(EXIT_UNAVAILABLE)
        }
    }
}

/// `harvester-lb prepare-stop`: see its `--help` (`args::Command::PrepareStop`).
/// Exits 0 whenever the stop may go on (a drain is always a correct stop);
/// 69 when a restart could not be announced because the socket is not
/// answering (the SIGTERM then drains, as it would have).
pub fn prepare_stop(
    socket: Option<PathBuf>,
    path: &Path,
    restart: bool,
    unit: Option<&str>,
) -> ExitCode {
    let socket = match admin_target(socket, path) {
        Ok(t) => t.socket,
        Err(code) => return code,
    };
    let store_max = if restart {
        None
    } else {
        let unit = match unit.map(str::to_string).or_else(unit_of_main_pid) {
            Some(u) => u,
            None => {
                logging::eprint_at(
                    4,
                    "prepare-stop: no --unit and no $MAINPID whose cgroup names a service: taken as a stop (the daemon drains)",
                );
                return ExitCode::SUCCESS;
            }
        };
        match systemd_job(&unit) {
            Some(job) if job == "restart" => {
                println!("{unit}: restart job");
                reset_start_limit(&unit);
            }
            job => {
                println!(
                    "{unit}: {} job: a stop, the daemon drains",
                    job.as_deref().unwrap_or("no")
                );
                return ExitCode::SUCCESS;
            }
        }
        let max = systemctl(&["show", "-p", "FileDescriptorStoreMax", "--value", &unit])
            .and_then(|v| v.trim().parse::<usize>().ok());
        Some(max.unwrap_or(0))
    };
    let body = match store_max {
        Some(max) => format!("{{\"store_max\": {max}}}"),
        None => "{}".to_string(),
    };
    match client::request(&socket, hyper::Method::POST, "/hand-over", body) {
        Ok(client::Answer { status, body }) => {
            if status.is_success() {
                println!(
                    "restart: the daemon hands its sockets over at SIGTERM: {}",
                    body.trim_end()
                );
            } else {
                // The daemon has warned with the reason; the stop drains.
                logging::eprint_at(
                    4,
                    &format!(
                        "restart without hand-over (the daemon drains): {}",
                        body.trim_end()
                    ),
                );
            }
            ExitCode::SUCCESS
        }
        Err(e) => {
            logging::eprint_at(
                4,
                &format!("restart without hand-over (the daemon drains): {e}"),
            );
            ExitCode::from(EXIT_UNAVAILABLE)
        }
    }
}

/// A restart asked for (`systemctl restart`, a package's `try-restart`) is
/// not a crash loop: the unit's `StartLimitBurst=` (5 starts in 2 minutes,
/// which systemd counts for every start, asked or automatic) would refuse
/// the start half of the 6th such restart in 2 minutes *after* this
/// process has handed everything over and exited: the unit fails, systemd
/// closes its file descriptor store, and every listener, connection and
/// flow is lost until an operator runs `systemctl reset-failed`. So the
/// count starts again here, as root, before the stop (`systemctl
/// reset-failed` on an active unit resets only that count, the unit's
/// result and `NRestarts`, the automatic restarts counted so far).
/// Automatic restarts (a crash, the watchdog) run no restart job through
/// here and stay bounded by the limit.
fn reset_start_limit(unit: &str) {
    if systemctl(&["reset-failed", unit]).is_some() {
        println!("{unit}: start limit count reset (a restart asked for is not a crash loop)");
    } else {
        logging::eprint_at(
            4,
            &format!(
                "prepare-stop: `systemctl reset-failed {unit}` failed: the unit's StartLimitBurst= may refuse this restart's start"
            ),
        );
    }
}

/// The service whose cgroup holds `$MAINPID` (systemd sets it for
/// `ExecStop=`): the last `*.service` in `/proc/PID/cgroup`.
fn unit_of_main_pid() -> Option<String> {
    let pid = std::env::var("MAINPID").ok()?;
    let cgroup = std::fs::read_to_string(format!("/proc/{pid}/cgroup")).ok()?;
    cgroup
        .lines()
        .flat_map(|l| l.rsplit(':').next().unwrap_or("").split('/'))
        .rfind(|c| c.ends_with(".service"))
        .map(str::to_string)
}

/// The type of the job systemd runs on `unit` now (`restart`, `stop`), if any:
/// `systemctl list-jobs` (as root it reads /run/systemd/private, no D-Bus).
/// `try-restart` shows as `restart`.
fn systemd_job(unit: &str) -> Option<String> {
    let jobs = systemctl(&["list-jobs", "--no-legend", "--no-pager", "--full"])?;
    jobs.lines().find_map(|line| {
        let fields: Vec<&str> = line.split_whitespace().collect();
        (fields.get(1) == Some(&unit)).then(|| fields.get(2).map(|t| t.to_string()))?
    })
}

/// What `systemctl ARGS` printed, when it succeeded.
fn systemctl(args: &[&str]) -> Option<String> {
    match std::process::Command::new("systemctl").args(args).output() {
        Ok(out) if out.status.success() => Some(String::from_utf8_lossy(&out.stdout).into_owned()),
        _ => None,
    }
}

pub fn run(
    config: PathBuf,
    no_watch: bool,
    threads: Option<std::num::NonZeroUsize>,
    scheduler: Scheduler,
    inherited: harvester_lb::fd_store::Inherited,
) -> ExitCode {
    let runtimes = match Runtimes::new(threads, scheduler.into()) {
        Ok(r) => r,
        Err(e) => return runtime_failed(&e),
    };
    let mut options = harvester_lb::Options::new(config);
    options.workers = runtimes.workers();
    options.inherited = std::sync::Arc::new(inherited);
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

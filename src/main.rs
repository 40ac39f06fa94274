//! The `harvester-lb` command: `run`, `check`, `reload`, `backend`,
//! `host`, `vip`, `withdraw`, `status`, `import`, `demo`.
//! Thin by design: it parses the arguments ([`cli::args`]) and dispatches
//! to [`cli`]. The daemon lives in the library; the command line's own
//! code (arguments, admin client, demo, status table, import's reading and
//! exit codes) in `cli` and its submodules, here in the binary.

use std::process::ExitCode;

mod cli;

use clap::Parser;
use cli::args::{Cli, Command};

/// mimalloc instead of glibc's malloc: a reload of 10,000 load balancers
/// allocates ~80 MB for a moment, which glibc kept (RSS +125 MB after three
/// reloads, measured) and mimalloc gives back; it also parses the config faster.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

fn main() -> ExitCode {
    let args = Cli::parse();
    // Before any thread starts (it changes the environment): the sockets
    // systemd's store handed to this process, for `run` to adopt.
    let inherited = matches!(args.command, Command::Run { .. })
        .then(harvester_lb::fd_store::Inherited::from_env)
        .unwrap_or_default();
    // Held to the end of `main`: dropping it writes the queued lines.
    let _flush = cli::init_tracing(args.log_format, matches!(args.command, Command::Run { .. }));
    match args.command {
        Command::Check { config } => cli::check(&config),
        Command::Reload { config, socket } => cli::reload(socket, &config),
        Command::PrepareStop {
            config,
            socket,
            restart,
            unit,
        } => cli::prepare_stop(socket, &config, restart, unit.as_deref()),
        Command::Backend {
            state,
            load_balancer,
            address,
            socket,
            config,
        } => cli::backend(state, &load_balancer, &address, socket, &config),
        Command::Run {
            config,
            no_watch,
            threads,
            scheduler,
        } => {
            // Before anything slow: a SIGHUP during start-up must not kill it.
            harvester_lb::os::ignore_hangup_until_handled();
            cli::run(config, no_watch, threads, scheduler, inherited)
        }
        Command::Demo { config } => cli::demo(&config),
        Command::Host {
            state,
            socket,
            config,
        } => cli::announce_state(state, None, socket, &config),
        Command::Vip {
            state,
            vip,
            socket,
            config,
        } => cli::announce_state(state, Some(&vip), socket, &config),
        Command::Withdraw {
            all: _,
            config,
            table,
        } => cli::withdraw_all(&config, table),
        Command::Status {
            config,
            socket,
            json,
        } => cli::status(socket, &config, json),
        Command::VrrpInstall { config, from } => cli::vrrp_install(&config, &from),
        Command::Import {
            inputs,
            cluster,
            write,
            strict,
            base,
            allow_removals,
            allow_loopback,
            network_interfaces,
            forwarding,
            source_nat,
        } => cli::import(&cli::import::Args {
            inputs,
            cluster,
            write,
            strict,
            base,
            allow_removals,
            allow_loopback,
            network_interfaces,
            forwarding,
            source_nat,
        }),
    }
}

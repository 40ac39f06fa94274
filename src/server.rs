//! The daemon's life: start (load the config, bind the admin API, apply),
//! the main loop (reloads from signals, the admin API and the file watch;
//! listener retries; the systemd watchdog), and shutdown with drain; and
//! [`run`], that life driven by the process's signals (`harvester-lb run`).

use std::net::SocketAddr;
use std::os::fd::AsFd;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::TcpListener;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_util::sync::CancellationToken;

use crate::config::{self, Config, ConfigError};
use crate::daemon::{Daemon, HandOverReport, ReloadSource, StopKind, log_applied};
use crate::dataplane::workers::Workers;
use crate::fd_store::{self, FdName, FdStore, Inherited};
use crate::host::isolation::IsolationError;
use crate::host::owned;
use crate::metrics::Metrics;
use crate::text;
use crate::{admin, os, systemd, watch};

/// How to run the daemon.
#[derive(Debug, Clone)]
pub struct Options {
    /// The config file.
    pub config_path: PathBuf,
    /// How often the file is checked for changes; `None` disables watching
    /// (reload then only by `SIGHUP` or `POST /reload`).
    pub watch_interval: Option<Duration>,
    /// Where the admin Unix socket goes instead of the config's
    /// `admin.socket`: for the demo and tests, which run beside other
    /// daemons and must not take `/run/harvester-lb/admin.sock`.
    pub admin_socket: Option<PathBuf>,
    /// The runtimes TCP listeners accept on: by default the one `start`
    /// runs on (see [`crate::dataplane::workers`]).
    pub workers: Workers,
    /// systemd's file descriptor store every listening socket goes into
    /// (issue 41): `$NOTIFY_SOCKET`'s, off outside systemd.
    pub fd_store: FdStore,
    /// The sockets the last process left in the store, taken at the top of
    /// `main` ([`Inherited::from_env`]): adopted by name instead of bound.
    pub inherited: Arc<Inherited>,
}

impl Options {
    /// Options for `path` with the default file watch (every 500 ms) and the
    /// admin socket the config names.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            config_path: path.into(),
            watch_interval: Some(Duration::from_millis(500)),
            admin_socket: None,
            workers: Workers::here(),
            fd_store: FdStore::from_env(),
            inherited: Inherited::none(),
        }
    }
}

/// Why the daemon could not start.
#[derive(Debug, thiserror::Error)]
pub enum StartError {
    /// The config could not be used; nothing was bound.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// `vip.isolate` is on and its table could not be written; no VIP
    /// listener was bound (so none serves without the isolation asked for),
    /// and the admin listeners taken before it are closed again.
    #[error("vip.isolate: {0}")]
    Isolation(#[from] IsolationError),
    /// The admin listener could not be bound. The daemon does not start
    /// without it: whatever holds the port would answer `/readyz` and
    /// `/status` in its name (a keepalived check would believe it).
    #[error(
        "cannot bind the admin listener {addr} (admin.listen): {source}{}; the daemon does not start without its admin API, since whatever holds the port would answer /readyz and /status for it: stop that process (`ss -ltnp 'sport = :{}'` names it) or set admin.listen to a free address",
        holder.map(|uid| format!(" (a socket of uid {uid} listens there)")).unwrap_or_default(),
        addr.port()
    )]
    AdminBind {
        /// The address from `admin.listen`.
        addr: SocketAddr,
        /// What the OS said.
        source: std::io::Error,
        /// The user whose socket listens there, when `/proc` tells.
        holder: Option<u32>,
    },
    /// The admin Unix socket could not be set up.
    #[error(transparent)]
    AdminSocket(#[from] admin::SocketError),
    /// Another live daemon holds a host object the config needs (the
    /// VM-network guard, reply-mark or gate table, the VM networks' rules);
    /// nothing was written.
    #[error(transparent)]
    Claimed(#[from] owned::ClaimError),
}

/// A request to reload the config, answered with the outcome: a summary
/// of what changed, or why the running config stays in force. The reload
/// loop here takes them from `POST /reload` (the admin API), SIGHUP
/// ([`run`]), the file watch and [`Server::reload`].
#[derive(Debug)]
pub struct ReloadRequest {
    /// How it was asked for (`/status` names it when the file is rejected).
    pub source: ReloadSource,
    /// Where the outcome goes.
    pub reply: oneshot::Sender<Result<String, ReloadError>>,
}

/// Why a reload left the running config in force. The message is what
/// `POST /reload`, `harvester-lb reload` and the log show.
#[derive(Debug, thiserror::Error)]
pub enum ReloadError {
    /// The daemon began to stop before the reload was done.
    #[error("the daemon is stopping")]
    Stopping,
    /// The file could not be read or is not a valid config; every problem
    /// is in it.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The blocking task reading the file ended abnormally.
    #[error("the config loader stopped: {0}")]
    LoaderStopped(tokio::task::JoinError),
    /// The blocking task writing the VIP isolation table ended abnormally.
    #[error("the VIP isolation writer stopped: {0}")]
    IsolationStopped(tokio::task::JoinError),
    /// The new config needs a host object another live daemon holds
    /// (`host::owned::claim`); nothing of it was applied.
    #[error(transparent)]
    Claimed(#[from] owned::ClaimError),
}

impl ReloadError {
    /// Why, one entry per problem: each of a rejected file's problems as
    /// `check` prints it, else the one reason.
    pub fn problems(&self) -> Vec<String> {
        match self {
            ReloadError::Config(ConfigError::Invalid { problems, .. }) => {
                problems.iter().map(ToString::to_string).collect()
            }
            other => vec![other.to_string()],
        }
    }
}

/// A running daemon.
pub struct Server {
    daemon: Arc<Daemon>,
    admin_addr: SocketAddr,
    admin_socket: PathBuf,
    reload: mpsc::Sender<ReloadRequest>,
    stop: CancellationToken,
    admin_stop: CancellationToken,
    /// Serves the admin socket; awaited at shutdown, so its file is gone
    /// when `shutdown` returns.
    socket_task: JoinHandle<()>,
    main_loop: JoinHandle<()>,
    /// Set at a hand-over: the admin socket's file stays for the next process.
    keep_unix_file: Arc<std::sync::atomic::AtomicBool>,
}

/// Loads the config, binds the admin listener and every VIP listener, and
/// starts probing. Returns once the first config is in force (a listener that
/// cannot bind is reported in `/readyz` and retried; it does not fail start).
pub async fn start(options: Options) -> Result<Server, StartError> {
    let mut loader = config::Loader::new();
    // Before the read: a change after this point is seen by the watch.
    let watched = watch::version(&options.config_path);
    let loaded = loader.load(&options.config_path)?;
    for w in &loaded.warnings {
        tracing::warn!(config = %options.config_path.display(), "{w}");
    }
    let config = loaded.config;
    let metrics = Metrics::new();
    let limit = connection_limit(&config);
    metrics.set_connection_limit(limit);
    let daemon = Daemon::new(Arc::clone(&metrics), limit, options.workers.clone());
    // Before any socket: each is adopted from the store by name, or bound
    // and stored.
    daemon.use_fd_store(options.fd_store.clone(), Arc::clone(&options.inherited));
    let store = daemon.fd_store();
    // Every single-instance resource before any kernel object: a second
    // daemon (an operator trying a file by hand) must fail here, before it
    // could replace the first one's isolation table (see `owned`).
    let admin_addr = config.admin.listen;
    let (admin_socket, adopted) = admin_tcp(&daemon, admin_addr).await?;
    let admin_addr = admin_socket.local_addr().unwrap_or(admin_addr);
    if adopted {
        store.note_stored(&admin_name(fd_store::ADMIN_TCP), 1);
    } else {
        store.store_or_warn(&admin_name(fd_store::ADMIN_TCP), &[admin_socket.as_fd()]);
    }
    // Bound once, like admin.listen: a change of admin.socket needs a restart.
    // Locked (a file beside it), so two daemons never both take it.
    let unix_path = options
        .admin_socket
        .clone()
        .unwrap_or_else(|| config.admin.socket.clone());
    let inherited_unix = daemon
        .inherited()
        .take(&admin_name(fd_store::ADMIN_UNIX))
        .into_iter()
        .next();
    let (unix_socket, adopted) = admin::AdminSocket::adopt(&unix_path, inherited_unix)?;
    let unix_name = admin_name(fd_store::ADMIN_UNIX);
    match adopted {
        Some(Ok(())) => {
            daemon.metrics().hand_over().adopted_listening_sockets(1);
            tracing::info!(socket = %unix_path.display(), "admin socket adopted from the last process (its file kept, no rebind)");
            store.note_stored(&unix_name, 1);
        }
        Some(Err(why)) => {
            tracing::warn!(socket = %unix_path.display(), "the stored admin socket is not usable ({why}): bound anew");
            store.remove_or_warn(&unix_name);
            store.store_or_warn(&unix_name, &[unix_socket.as_fd()]);
        }
        None => store.store_or_warn(&unix_name, &[unix_socket.as_fd()]),
    }
    let keep_unix_file = unix_socket.keep_file();
    // The host objects of one daemon per namespace, also before any kernel
    // object: a second daemon with [[network]] is refused here, naming the
    // first, instead of overwriting its guard and rules.
    daemon.claims().set_identity(owned::claim::Identity::new(
        &options.config_path,
        &unix_path,
    ));
    daemon
        .claims()
        .take_all(&owned::claim::needed(&config))
        .await?;
    // With the claims held, before any object is written: after a
    // hand-over the objects the previous process left are adopted, not
    // written again (`daemon::hand_over`).
    daemon.take_hand_over_marker(&unix_path);
    // Before the isolation and the listeners: a load balancer whose VIP is
    // this host's own address or its router's is never written anywhere.
    // First the networks: one whose interface is no VM network's here
    // (`lo`, the management interface) is never isolated or routed.
    let config = daemon.guard_networks(config).await;
    let config = daemon.guard_vips(config).await;
    // Before any VIP listener binds: a VIP must not serve, even for a
    // moment, without the isolation its config asks for. A failure leaves
    // the kernel's table as it was (one nft transaction) and drops the admin
    // listeners: nothing is left behind.
    let isolation = Arc::clone(daemon.isolation());
    let (config, isolated) = tokio::task::spawn_blocking(move || {
        // No lease exists yet: a leased VIP joins the table when it comes.
        let result = isolation.reconcile(&config, &Default::default());
        (config, result)
    })
    .await
    .expect("the isolation writer does not panic");
    isolated?;

    daemon.set_config_file(&options.config_path);
    daemon.config_started(&config, loader.last_read_sha256().map(str::to_string));
    // Before the first load balancer is made: operator states and verdicts
    // are in place before the first probe and the first connection.
    daemon.restore_state(&options.config_path, &config);
    let report = daemon.apply(config);
    daemon.finish_restore();
    log_applied!(tracing::Level::INFO, report, config = %options.config_path.display(), "config applied");
    metrics.record_reload(true);
    // Every listener of the config is accepting: what the last process
    // stored and this config has not is closed, and the restart's window
    // is measured up to here.
    daemon.adopted();

    let (reload_tx, reload_rx) = mpsc::channel::<ReloadRequest>(16);
    let stop = CancellationToken::new();
    let admin_stop = CancellationToken::new();
    tokio::spawn(admin::serve(
        admin_socket,
        Arc::clone(&daemon),
        reload_tx.clone(),
        admin_stop.clone(),
    ));
    let socket_task = tokio::spawn(admin::serve_socket(
        unix_socket,
        Arc::clone(&daemon),
        reload_tx.clone(),
        admin_stop.clone(),
    ));
    tokio::spawn(check_kernel_objects(Arc::clone(&daemon), stop.clone()));
    daemon.start_state_writer(stop.clone());
    let main_loop = tokio::spawn(main_loop(
        options,
        watched,
        loader,
        Arc::clone(&daemon),
        reload_tx.clone(),
        reload_rx,
        stop.clone(),
    ));
    Ok(Server {
        daemon,
        admin_addr,
        admin_socket: unix_path,
        reload: reload_tx,
        stop,
        admin_stop,
        socket_task,
        main_loop,
        keep_unix_file,
    })
}

/// The admin TCP listener at `addr`: the one the last process stored, if
/// it is bound there (`true`), else a new one.
async fn admin_tcp(daemon: &Daemon, addr: SocketAddr) -> Result<(TcpListener, bool), StartError> {
    let name = admin_name(fd_store::ADMIN_TCP);
    if let Some(fd) = daemon.inherited().take(&name).into_iter().next() {
        let socket = socket2::Socket::from(fd);
        let local = socket.local_addr().ok().and_then(|a| a.as_socket());
        let usable = socket.is_listener().unwrap_or(false)
            && (local == Some(addr)
                || (addr.port() == 0 && local.is_some_and(|l| l.ip() == addr.ip())));
        if usable && socket.set_nonblocking(true).is_ok() {
            let std: std::net::TcpListener = socket.into();
            if let Ok(listener) = TcpListener::from_std(std) {
                daemon.metrics().hand_over().adopted_listening_sockets(1);
                tracing::info!(admin = %addr, "admin listener adopted from the last process (no rebind)");
                return Ok((listener, true));
            }
        } else {
            tracing::info!(admin = %addr, stored = ?local, "the stored admin listener is not admin.listen's: bound anew");
            daemon.fd_store().remove_or_warn(&name);
        }
    }
    TcpListener::bind(addr)
        .await
        .map(|l| (l, false))
        .map_err(|source| StartError::AdminBind {
            addr,
            holder: (source.kind() == std::io::ErrorKind::AddrInUse)
                .then(|| os::tcp_listener_owner(addr))
                .flatten(),
            source,
        })
}

fn admin_name(name: &str) -> FdName {
    FdName::new(name).expect("a valid constant")
}

impl Server {
    /// Where the admin API listens (the real port when `admin.listen` used port 0).
    pub fn admin_addr(&self) -> SocketAddr {
        self.admin_addr
    }

    /// Where the admin Unix socket is (state changes are served only there).
    pub fn admin_socket(&self) -> &std::path::Path {
        &self.admin_socket
    }

    /// The running daemon.
    pub fn daemon(&self) -> &Arc<Daemon> {
        &self.daemon
    }

    /// Re-reads the config file and applies it; `Err` carries every problem,
    /// and then the running config is untouched.
    pub async fn reload(&self) -> Result<String, ReloadError> {
        request_reload(&self.reload, ReloadSource::Library).await
    }

    /// A sender that triggers reloads (for signal handlers).
    pub fn reload_sender(&self) -> mpsc::Sender<ReloadRequest> {
        self.reload.clone()
    }

    /// Stops accepting, drains open connections up to the drain timeout, and
    /// stops. Returns how many connections the timeout cut.
    pub async fn shutdown(self) -> usize {
        self.stop.cancel();
        let _ = self.main_loop.await;
        systemd::notify("STOPPING=1");
        tracing::info!("stopping: no new connections; draining open ones");
        // Before the drain stops the probes: the verdicts as they are.
        self.daemon.write_state_last().await;
        let cut = self.daemon.shutdown().await;
        let isolation = Arc::clone(self.daemon.isolation());
        match tokio::task::spawn_blocking(move || isolation.remove()).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => tracing::error!("at stop: {e}"),
            Err(e) => tracing::error!("at stop: the isolation writer ended abnormally: {e}"),
        }
        self.admin_stop.cancel();
        if let Err(e) = self.socket_task.await {
            tracing::warn!(error = %e, "the admin socket task ended abnormally");
        }
        // A stop: nothing of this process stays in the store (systemd
        // empties it too once the unit is stopped).
        let store = self.daemon.fd_store();
        store.remove_or_warn(&admin_name(fd_store::ADMIN_TCP));
        store.remove_or_warn(&admin_name(fd_store::ADMIN_UNIX));
        tracing::info!(closed_by_timeout = cut, "stopped");
        cut
    }

    /// The first half of a restart (`prepare-stop --restart`, then
    /// SIGTERM): stops accepting everywhere, leaves every listening socket
    /// (the admin API's too, and the admin socket's file) in systemd's
    /// store for the next process, and returns what was handed over. The
    /// host's objects are left in place ([`Daemon::hand_over`]).
    pub async fn hand_over(self) -> HandOverReport {
        self.stop.cancel();
        let _ = self.main_loop.await;
        systemd::notify("STOPPING=1");
        tracing::info!(
            "restarting: the listening sockets stay in systemd's store for the next process"
        );
        let report = self.daemon.hand_over().await;
        self.keep_unix_file
            .store(true, std::sync::atomic::Ordering::Release);
        self.admin_stop.cancel();
        if let Err(e) = self.socket_task.await {
            tracing::warn!(error = %e, "the admin socket task ended abnormally");
        }
        tracing::info!(
            listeners = report.listeners,
            connections = report.connections,
            flows = report.flows,
            lost = report.lost,
            stored_fds = self.daemon.fd_store().stored_fds(),
            "handed over"
        );
        report
    }
}

/// Sends a reload request and waits for its outcome.
pub async fn request_reload(
    sender: &mpsc::Sender<ReloadRequest>,
    source: ReloadSource,
) -> Result<String, ReloadError> {
    let (reply, rx) = oneshot::channel();
    sender
        .send(ReloadRequest { source, reply })
        .await
        .map_err(|_| ReloadError::Stopping)?;
    rx.await.map_err(|_| ReloadError::Stopping)?
}

/// Why [`run`] ended with an error.
#[derive(Debug, thiserror::Error)]
pub enum RunError {
    /// The signal handlers could not be installed; nothing was started.
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    /// The daemon could not start.
    #[error(transparent)]
    Start(#[from] StartError),
}

/// `harvester-lb run`: starts the daemon and serves until SIGTERM or SIGINT,
/// then drains. SIGHUP asks for a reload. Every handler is installed before
/// anything can tell systemd READY=1: a SIGHUP must never meet the default
/// action (which exits). A second SIGTERM/SIGINT during the drain exits the
/// process at once (status 1).
pub async fn run(options: Options) -> Result<(), RunError> {
    let mut signals = Signals::new().map_err(RunError::Signals)?;
    let server = start(options).await?;
    tracing::info!(admin = %server.admin_addr(), "harvester-lb running");
    signals.serve_until_stop(&server).await;
    tokio::spawn(async move {
        signals.stop().await;
        tracing::warn!("second stop signal: exiting without waiting for connections");
        // `exit` drops nothing: write the queued lines first.
        crate::logging::flush();
        std::process::exit(1);
    });
    match server.daemon().stop_kind() {
        StopKind::HandOver => {
            server.hand_over().await;
        }
        StopKind::Drain => {
            server.shutdown().await;
        }
    }
    Ok(())
}

/// The signals the daemon answers.
struct Signals {
    hup: tokio::signal::unix::Signal,
    term: tokio::signal::unix::Signal,
    int: tokio::signal::unix::Signal,
}

impl Signals {
    fn new() -> std::io::Result<Self> {
        use tokio::signal::unix::{SignalKind, signal};
        Ok(Self {
            hup: signal(SignalKind::hangup())?,
            term: signal(SignalKind::terminate())?,
            int: signal(SignalKind::interrupt())?,
        })
    }

    /// Resolves at the next SIGTERM or SIGINT.
    async fn stop(&mut self) {
        tokio::select! {
            _ = self.term.recv() => {}
            _ = self.int.recv() => {}
        }
    }

    /// Serves SIGHUP as reloads until SIGTERM or SIGINT arrives.
    async fn serve_until_stop(&mut self, server: &Server) {
        loop {
            tokio::select! {
                _ = self.term.recv() => return,
                _ = self.int.recv() => return,
                _ = self.hup.recv() => {
                    let sender = server.reload_sender();
                    // Do not wait here: a storm of SIGHUPs queues reloads, it does not block stop.
                    tokio::spawn(async move {
                        let _ = request_reload(&sender, ReloadSource::Signal).await;
                    });
                }
            }
        }
    }
}

/// The process-wide connection cap: the config's, or what the open-file
/// limit allows. A connection holds two sockets and, while bytes move, a pipe
/// (two more) per busy direction; an idle one holds only its sockets. Three
/// descriptors per connection is the budget; 256 are kept for the daemon
/// itself and 512 for the pool of spare pipes (256 pipes). Under a burst
/// that still runs short, a connection copies through a small buffer
/// instead of a pipe and accepts back off (see "Failure behaviour").
fn connection_limit(config: &Config) -> usize {
    if let Some(n) = config.proxy.max_connections {
        return n.get();
    }
    let open_files = os::raise_open_file_limit().unwrap_or(1024);
    let limit = os::connections_for(open_files);
    let under_systemd = std::env::var_os("INVOCATION_ID").is_some();
    if let Some(why) = open_file_warning(open_files, limit, under_systemd) {
        tracing::warn!(
            open_file_limit = open_files,
            max_connections = limit,
            "{why}{}",
            if config.proxy.max_udp_flows.is_none() {
                " (the UDP flow cap follows it too)"
            } else {
                ""
            }
        );
    }
    limit
}

/// The one warning at start about the open-file limit, if any: a derived
/// cap below [`SMALL_DERIVED_CAP`], or under systemd a limit below the
/// unit's `LimitNOFILE=` ([`UNIT_OPEN_FILES`]), which systemd lowers
/// without a word to the hard limit it may grant (its own, a container's).
fn open_file_warning(open_files: u64, limit: usize, under_systemd: bool) -> Option<String> {
    if limit < SMALL_DERIVED_CAP {
        return Some(format!(
            "the open-file limit is {open_files}, so at most {limit} connections are forwarded at once: raise the unit's LimitNOFILE= (e.g. LimitNOFILE={UNIT_OPEN_FILES}; `ulimit -n` by hand), or set proxy.max_connections"
        ));
    }
    (under_systemd && open_files < UNIT_OPEN_FILES).then(|| {
        format!(
            "the open-file limit in force is {open_files}, below the unit's LimitNOFILE={UNIT_OPEN_FILES} (systemd lowers it to the most it may grant: its own hard limit, or a container's), so the connection cap is {limit} instead of {}: raise the limit systemd runs under (DefaultLimitNOFILE=, the container's), or set proxy.max_connections",
            os::connections_for(UNIT_OPEN_FILES)
        )
    })
}

/// What `systemd/harvester-lb.service` asks for in `LimitNOFILE=` (the
/// kernel's default `fs.nr_open`).
const UNIT_OPEN_FILES: u64 = 1_048_576;

/// Below this, a connection cap derived from the open-file limit is said
/// at start (a warning): under 1,024 concurrent connections is a limit an
/// operator did not mean (e.g. `ulimit -n 256` gives 16).
const SMALL_DERIVED_CAP: usize = 1024;

async fn main_loop(
    options: Options,
    watched: Option<watch::Version>,
    loader: config::Loader,
    daemon: Arc<Daemon>,
    reload_tx: mpsc::Sender<ReloadRequest>,
    mut reload_rx: mpsc::Receiver<ReloadRequest>,
    stop: CancellationToken,
) {
    let (changed_tx, mut changed_rx) = mpsc::channel(1);
    if let Some(interval) = options.watch_interval {
        tokio::spawn(watch::watch(
            options.config_path.clone(),
            watched,
            interval,
            changed_tx,
            stop.clone(),
        ));
    }
    let mut retry = tokio::time::interval(Duration::from_secs(2));
    retry.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let mut sweep = tokio::time::interval(AFFINITY_SWEEP);
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    let watchdog = systemd::watchdog_interval();
    let mut watchdog_tick = tokio::time::interval(watchdog.unwrap_or(Duration::from_secs(3600)));
    // Reloads are serial (this loop), but each runs on a blocking thread
    // that takes the loader along.
    let loader = Arc::new(std::sync::Mutex::new(loader));
    let mut ready_sent = false;
    if daemon.is_ready() {
        systemd::notify("READY=1\nSTATUS=serving");
        ready_sent = true;
    }
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            Some(ReloadRequest { source, reply }) = reload_rx.recv() => {
                let outcome = reload(&options, &loader, &daemon, ready_sent, &stop, source).await;
                let _ = reply.send(outcome);
            }
            Some(event) = changed_rx.recv() => match event {
                watch::Event::Changed => {
                    if daemon.set_config_file_missing(false) {
                        tracing::info!(config = %options.config_path.display(), "config file is back; reloading it");
                    } else {
                        tracing::info!(config = %options.config_path.display(), "config file changed on disk");
                    }
                    // Go through the channel so watch and signal reloads are serialised.
                    let tx = reload_tx.clone();
                    tokio::spawn(async move { let _ = request_reload(&tx, ReloadSource::FileChange).await; });
                }
                watch::Event::Missing => {
                    // Once per disappearance: the watch reports it once.
                    daemon.set_config_file_missing(true);
                    tracing::warn!(
                        config = %options.config_path.display(),
                        "config file is missing (deleted or renamed away); the running config stays in force, and the file is loaded again when it reappears"
                    );
                }
            },
            _ = retry.tick() => {
                if !daemon.failed_listeners().is_empty() && daemon.retry_failed_listeners() > 0 {
                    tracing::info!("listeners bound on retry");
                }
                if !ready_sent && daemon.is_ready() {
                    systemd::notify("READY=1\nSTATUS=serving");
                    ready_sent = true;
                }
            }
            _ = watchdog_tick.tick(), if watchdog.is_some() => systemd::notify("WATCHDOG=1"),
            _ = sweep.tick() => daemon.sweep_affinity(),
        }
    }
}

/// Reads the kernel objects the daemon owns back every
/// [`host::owned::CHECK_INTERVAL`] and repairs what another process changed
/// (see [`crate::host::owned`]); until `stop`. One check at a time, each on a
/// blocking thread (it runs `nft`).
async fn check_kernel_objects(daemon: Arc<Daemon>, stop: CancellationToken) {
    let mut tick = tokio::time::interval(owned::CHECK_INTERVAL);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    tick.tick().await; // The first tick is now: start has just written them.
    loop {
        tokio::select! {
            _ = stop.cancelled() => return,
            _ = tick.tick() => {}
        }
        let isolation = Arc::clone(daemon.isolation());
        match tokio::task::spawn_blocking(move || isolation.check()).await {
            Ok(Ok(())) => {}
            // vip_isolation_up is 0 and /status says why; the next check tries again.
            Ok(Err(e)) => tracing::error!("vip.isolate, periodic check: {e}"),
            Err(e) => tracing::error!("vip.isolate: the periodic check ended abnormally: {e}"),
        }
        daemon
            .check_kernel_tables(crate::daemon::KernelCheckCause::Timer)
            .await;
    }
}

/// How often expired client-affinity entries are dropped: an entry outlives
/// its timeout by at most this much (memory, never behaviour: an expired
/// entry is ignored at once).
const AFFINITY_SWEEP: Duration = Duration::from_secs(10);

/// Loads and applies the config file; a bad file leaves everything as it was.
/// `ready_sent`: whether systemd has been told READY=1 yet; before that, a
/// reload must not announce readiness (the main loop does, once every
/// listener is bound).
///
/// The file is read, parsed and validated on a blocking thread: at 10,000
/// load balancers that is ~100 ms of CPU, which on a runtime worker would
/// stall every connection that worker serves (all of them with `--threads
/// 1`). Only the apply, a diff of what changed, runs on the runtime.
async fn reload(
    options: &Options,
    loader: &Arc<std::sync::Mutex<config::Loader>>,
    daemon: &Daemon,
    ready_sent: bool,
    stop: &CancellationToken,
    source: ReloadSource,
) -> Result<String, ReloadError> {
    if ready_sent {
        systemd::notify_reloading();
    }
    let started = tokio::time::Instant::now();
    let path = options.config_path.clone();
    let loader = Arc::clone(loader);
    let isolation = Arc::clone(daemon.isolation());
    let leased = daemon.leased_vips();
    // The read alone is given up at stop: the file is a regular one read
    // with a bound (`config::read_regular_file`), but a hung file system
    // must still not hold SIGTERM. The isolation below is never cut short.
    let read = tokio::task::spawn_blocking(move || {
        let mut loader = loader
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let loaded = loader.load(&path);
        (loaded, loader.last_read_sha256().map(str::to_string))
    });
    let read = tokio::select! {
        read = read => read,
        _ = stop.cancelled() => return Err(ReloadError::Stopping),
    };
    let (read, sha256) = match read {
        Ok((read, sha256)) => (Ok(read), sha256),
        Err(e) => (Err(e), None),
    };
    let loaded = match read {
        Err(e) => Err(ReloadError::LoaderStopped(e)),
        Ok(Err(e)) => Err(ReloadError::Config(e)),
        Ok(Ok(mut loaded)) => 'claimed: {
            // Before anything is written: a config that needs another
            // daemon's object is refused whole (see `host::owned::claim`).
            let needed = owned::claim::needed(&loaded.config);
            if let Err(e) = daemon.claims().take_all(&needed).await {
                break 'claimed Err(ReloadError::Claimed(e));
            }
            // Before the isolation and the listeners (see `start`).
            loaded.config = daemon.guard_networks(loaded.config).await;
            loaded.config = daemon.guard_vips(loaded.config).await;
            tokio::task::spawn_blocking(move || {
                // The table follows the new config before its listeners change. A
                // failure leaves the kernel's table as it was (one transaction) and
                // does not stop the reload: it is logged, in /status and a metric.
                let isolated = isolation.reconcile(&loaded.config, &leased);
                (loaded, isolated)
            })
            .await
            .map_err(ReloadError::IsolationStopped)
        }
    };
    let result = match loaded {
        Ok((loaded, isolated)) => {
            let parsed = started.elapsed();
            // The isolation has set vip_isolation_up itself.
            if let Err(e) = &isolated {
                tracing::error!(config = %options.config_path.display(), "vip.isolate: {e}");
            }
            for w in &loaded.warnings {
                tracing::warn!(config = %options.config_path.display(), "{w}");
            }
            let total = loaded.config.load_balancers.len();
            let needs_restart = daemon.config_reloaded(&loaded.config, sha256);
            if !needs_restart.is_empty() {
                tracing::warn!(
                    config = %options.config_path.display(),
                    "the reloaded file changes {}, which only a restart applies (bound or read once at start): the old value stays in force until `systemctl restart harvester-lb`; everything else is applied",
                    needs_restart.join(", ")
                );
            }
            let report = daemon.apply(loaded.config);
            // It was read just now, so it is not missing (whatever the watch
            // has seen yet).
            daemon.set_config_file_missing(false);
            let summary = format!(
                "reloaded in {:?} (read and validated in {parsed:?}, {} of {} unchanged and not parsed again): {} bound, {} failed, {} removed; {} added, {} removed",
                started.elapsed(),
                loaded.reused,
                text::count(total, "load balancer", "load balancers"),
                text::count(report.listeners_bound, "listener", "listeners"),
                report.listeners_failed,
                report.listeners_removed,
                text::count(
                    report.load_balancers_added,
                    "load balancer",
                    "load balancers"
                ),
                report.load_balancers_removed
            ) + &isolated
                .err()
                .map(|e| format!("; vip.isolate failed: {e}"))
                .unwrap_or_default()
                + &if needs_restart.is_empty() {
                    String::new()
                } else {
                    format!(
                        "; needs a restart: {} (bound or read once at start; the value in force stays until `systemctl restart harvester-lb`)",
                        needs_restart.join(", ")
                    )
                };
            if total == 0 && report.load_balancers_removed > 0 {
                // Rarely meant: a controller bug or a truncated file
                // unbinds every VIP of the host.
                log_applied!(
                    tracing::Level::WARN,
                    report,
                    config = %options.config_path.display(),
                    "config reloaded with no load balancer: {} and {} listeners drain",
                    match report.load_balancers_removed {
                        1 => "the one load balancer in force was removed".to_string(),
                        n => format!("all {n} load balancers in force were removed"),
                    },
                    if report.load_balancers_removed == 1 { "its" } else { "their" }
                );
            } else {
                log_applied!(
                    tracing::Level::INFO,
                    report,
                    elapsed_ms = started.elapsed().as_millis() as u64,
                    "config reloaded"
                );
            }
            Ok(summary)
        }
        Err(e) => {
            tracing::error!("reload rejected, the running config stays in force: {e}");
            // Not a stop: nothing was wrong with the file.
            if !matches!(e, ReloadError::Stopping) {
                daemon.config_rejected(source, sha256, e.problems());
            }
            Err(e)
        }
    };
    daemon.metrics().record_reload(result.is_ok());
    // Whether the file was good or not: a reload is when an operator
    // expects the kernel's tables to be set right.
    daemon.check_kernel_tables_soon();
    if ready_sent {
        systemd::notify(&format!("READY=1\nSTATUS={}", status_line(daemon)));
    }
    result
}

/// systemd's one-line status: serving, or which listeners are not bound;
/// then a rejected reload standing and keys waiting for a restart, so
/// `systemctl status` (where an operator looks first) does not say only
/// "serving" after `systemctl reload` failed.
fn status_line(daemon: &Daemon) -> String {
    let failed = daemon.failed_listeners();
    let serving = if failed.is_empty() {
        "serving".to_string()
    } else {
        let list: Vec<String> = failed.iter().map(|f| f.key.addr.to_string()).collect();
        format!("serving; not bound (see /readyz): {}", list.join(", "))
    };
    serving + &daemon.config_attention()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_open_file_limit_below_the_units_is_said_under_systemd_only() {
        let why = open_file_warning(20_000, os::connections_for(20_000), true)
            .expect("20,000 under systemd is below the unit's figure");
        assert!(why.contains("in force is 20000"), "{why}");
        assert!(why.contains("LimitNOFILE=1048576"), "{why}");
        assert!(why.contains("connection cap is 6410"), "{why}");
        assert_eq!(
            open_file_warning(20_000, os::connections_for(20_000), false),
            None,
            "run by hand, nobody asked for more"
        );
        assert_eq!(
            open_file_warning(UNIT_OPEN_FILES, os::connections_for(UNIT_OPEN_FILES), true),
            None,
            "the unit's own figure"
        );
        let small = open_file_warning(256, os::connections_for(256), false).unwrap();
        assert!(small.contains("at most 16 connections"), "{small}");
    }
}

#[cfg(test)]
mod reload_tests {
    use super::*;
    use crate::daemon::testing::{accepts, lb, refused_soon};

    #[tokio::test]
    async fn a_reload_with_a_bad_file_leaves_the_config_in_force_and_a_good_one_applies_its_diff() {
        let dir = std::env::temp_dir().join(format!("hlb-unit-reload-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("scratch dir");
        let path = dir.join("config.toml");
        let file = |ports: &[u16]| {
            format!(
                "[admin]\nlisten = \"127.231.30.250:18099\"\n[proxy]\ndrain_timeout_seconds = 1\n{}",
                lb(
                    "a/web",
                    "127.231.30.1",
                    &["127.231.30.11"],
                    ports,
                    30080,
                    ""
                )
            )
        };
        std::fs::write(&path, file(&[18080])).expect("write the config");
        let server = start(Options {
            watch_interval: None,
            admin_socket: Some(dir.join("admin.sock")),
            ..Options::new(&path)
        })
        .await
        .expect("the daemon starts");
        let (old, new): (SocketAddr, SocketAddr) = (
            "127.231.30.1:18080".parse().unwrap(),
            "127.231.30.1:18081".parse().unwrap(),
        );
        assert!(accepts(old).await);

        std::fs::write(&path, "[[load_balancer]]\nname = 1\n").expect("write a bad file");
        match server.reload().await {
            Err(ReloadError::Config(_)) => {}
            other => panic!("a bad file must be refused as a config error: {other:?}"),
        }
        assert!(server.daemon().is_ready(), "the config in force stays");
        assert!(accepts(old).await, "and its listener with it");

        std::fs::write(&path, file(&[18081])).expect("write a good file");
        let said = server.reload().await.expect("a good file applies");
        assert!(
            said.contains(
                "1 listener bound, 0 failed, 1 removed; 0 load balancers added, 0 removed"
            ),
            "{said}"
        );
        assert!(accepts(new).await);
        refused_soon(old).await;
        server.shutdown().await;
        let _ = std::fs::remove_dir_all(&dir);
    }
}

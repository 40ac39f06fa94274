//! `harvester-lb demo`: the whole job on loopback in one command, for a
//! newcomer. It starts a tiny backend on every node address of the config,
//! runs the real daemon, shows where connections land, stops one node, waits
//! for the health check to take it out, and brings it back.
//!
//! It only ever talks to the loopback addresses in the config it is given and
//! refuses any other.

use std::collections::BTreeMap;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

use harvester_lb::config::{self, LoadBalancerSpec};
use harvester_lb::dataplane::health::Health;

/// Why the demo stopped, for the operator.
#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    /// The config file could not be read or is invalid.
    #[error(transparent)]
    Config(#[from] harvester_lb::config::ConfigError),
    /// No load balancer has backends, a listener and a health check.
    #[error("the demo needs a load balancer with backends, a listener and a health check")]
    NoLoadBalancer,
    /// The chosen load balancer's VIP or a backend is not a loopback
    /// address.
    #[error(
        "the demo only runs on loopback addresses (127.0.0.0/8, ::1); try config/loopback.toml"
    )]
    NotLoopback,
    /// The daemon did not start.
    #[error(transparent)]
    Start(#[from] harvester_lb::StartError),
    /// A demo node's port could not be bound.
    #[error("cannot start demo node on {addr}: {source}")]
    Node {
        /// The node's address and port.
        addr: SocketAddr,
        /// The bind's error.
        #[source]
        source: std::io::Error,
    },
    /// A node's health did not change in time.
    #[error("node {ip} did not become {want} within 60 s")]
    HealthUnchanged {
        /// The node.
        ip: IpAddr,
        /// The health awaited.
        want: Health,
    },
}

/// Runs the demo on the config at `path` (its first load balancer with a
/// health check), handing each line of its story to `say` (the command
/// line prints them). Returns a message for the operator on failure.
pub async fn run(path: &Path, say: impl Fn(String)) -> Result<(), DemoError> {
    let loaded = config::load(path)?;
    let lb = loaded
        .config
        .load_balancers
        .iter()
        .find(|l| l.health_check.is_some() && !l.listeners.is_empty() && !l.backends.is_empty())
        .ok_or(DemoError::NoLoadBalancer)?
        .clone();
    let all_loopback = std::iter::once(lb.vip)
        .chain(lb.backends.iter().copied())
        .all(|ip| ip.is_loopback());
    if !all_loopback {
        return Err(DemoError::NotLoopback);
    }
    let listener = &lb.listeners[0];
    let vip = lb.listen_addr(listener);
    let health_port = lb.health_check.as_ref().and_then(|h| h.port);

    let mut nodes: BTreeMap<IpAddr, Vec<JoinHandle<()>>> = BTreeMap::new();
    for ip in &lb.backends {
        nodes.insert(
            *ip,
            start_node(*ip, listener.backend_port, health_port).await?,
        );
    }
    say(format!(
        "started {} demo nodes on port {}: {:?}",
        nodes.len(),
        listener.backend_port,
        lb.backends
    ));

    // A socket of its own: the demo must not take (or trip over) the one a
    // daemon installed on this host serves.
    let socket_dir = std::env::temp_dir().join(format!("harvester-lb-demo-{}", std::process::id()));
    let server = harvester_lb::start(harvester_lb::Options {
        config_path: path.to_path_buf(),
        watch_interval: None,
        admin_socket: Some(socket_dir.join("admin.sock")),
        workers: harvester_lb::dataplane::workers::Workers::here(),
        // The demo's sockets are its own, never a unit's.
        fd_store: harvester_lb::fd_store::FdStore::off(),
        inherited: harvester_lb::fd_store::Inherited::none(),
    })
    .await?;
    say(format!(
        "harvester-lb is listening on {vip}; admin API on http://{}/status\n",
        server.admin_addr()
    ));

    let say = &say;
    let spread = |label: &'static str| async move {
        let mut counts: BTreeMap<String, usize> = BTreeMap::new();
        for _ in 0..12 {
            let who = ask(vip).await.unwrap_or_else(|e| format!("(failed: {e})"));
            *counts.entry(who).or_default() += 1;
        }
        say(format!(
            "{label}: 12 connections to {vip} landed on {counts:?}"
        ));
    };
    spread("all nodes up").await;

    let victim = lb.backends[0];
    for task in nodes.remove(&victim).unwrap_or_default() {
        task.abort();
    }
    let hc = lb.health_check.as_ref().expect("checked above");
    say(format!(
        "\nstopped node {victim}; the health check marks it down after {} failed probes ({} s apart)...",
        hc.failure_threshold,
        hc.period.as_secs()
    ));
    wait_health(&server, &lb, victim, Health::Unhealthy).await?;
    say(format!("node {victim} is {}", Health::Unhealthy));
    spread("node down").await;

    nodes.insert(
        victim,
        start_node(victim, listener.backend_port, health_port).await?,
    );
    say(format!(
        "\nrestarted node {victim}; waiting for {} successful probe(s)...",
        hc.success_threshold
    ));
    wait_health(&server, &lb, victim, Health::Healthy).await?;
    say(format!("node {victim} is {}", Health::Healthy));
    spread("node back").await;

    say(format!(
        "\nthe same is in the metrics: curl http://{}/metrics | grep harvester_lb_health_transitions",
        server.admin_addr()
    ));
    server.shutdown().await;
    let _ = std::fs::remove_dir(&socket_dir); // Emptied by the shutdown; best effort.
    Ok(())
}

/// Starts a node: a server on the nodeport (and the health port) that
/// answers each connection with its own address.
async fn start_node(
    ip: IpAddr,
    port: u16,
    health_port: Option<u16>,
) -> Result<Vec<JoinHandle<()>>, DemoError> {
    let mut ports = vec![port];
    if let Some(h) = health_port.filter(|h| *h != port) {
        ports.push(h);
    }
    let mut tasks = Vec::new();
    for p in ports {
        let addr = SocketAddr::new(ip, p);
        let listener = TcpListener::bind(addr)
            .await
            .map_err(|source| DemoError::Node { addr, source })?;
        tasks.push(tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                let _ = s.write_all(format!("{ip}\n").as_bytes()).await;
            }
        }));
    }
    Ok(tasks)
}

async fn ask(vip: SocketAddr) -> std::io::Result<String> {
    let mut s = TcpStream::connect(vip).await?;
    let mut out = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out))
        .await
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer"))??;
    if out.is_empty() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::ConnectionAborted,
            "closed",
        ));
    }
    Ok(out.trim().to_string())
}

async fn wait_health(
    server: &harvester_lb::Server,
    lb: &LoadBalancerSpec,
    ip: IpAddr,
    want: Health,
) -> Result<(), DemoError> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    loop {
        let status = server.daemon().status();
        let now = status
            .load_balancers
            .iter()
            .find(|l| l.name == lb.name)
            .and_then(|l| l.backends.iter().find(|b| b.address == ip))
            .map(|b| b.health);
        if now == Some(want) {
            return Ok(());
        }
        if tokio::time::Instant::now() > deadline {
            return Err(DemoError::HealthUnchanged { ip, want });
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

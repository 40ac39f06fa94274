//! One way for tests to write a config file: [`Config`] with its
//! [`Lb`]s and their [`Listener`]s, rendered as the TOML a controller
//! writes. A test says what it sets (a VIP, its backends, a key) and not how
//! a table header is spelled; keys a test sets that the builder has no
//! method for go in as TOML lines (`keys`, `proxy`, `health`), so every key
//! of the reference stays reachable.
//!
//! Tests whose point is the text itself (bad input, `check`, the docs,
//! `import`) keep their literal TOML; they read a refused one with
//! [`problems`] (or [`rendered`], as `check` prints them). The VM-network
//! beds write their hosts' `[keepalived]` and `[[network]]` with
//! [`keepalived`] and [`network`].

use std::fmt::{self, Display, Write as _};
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use super::Subnet;

/// A whole config file; `to_string()` renders it.
#[derive(Clone, Debug, Default)]
pub struct Config {
    admin: Option<SocketAddr>,
    socket: Option<PathBuf>,
    proxy: Vec<String>,
    vip: Vec<String>,
    text: Vec<String>,
    lbs: Vec<Lb>,
}

impl Config {
    /// A file with no table at all (each part is added by a method).
    pub fn new() -> Self {
        Self::default()
    }

    /// The common start of a test on a subnet: the admin API on `.250:9901`
    /// and its socket in the test's directory.
    pub fn on(net: &Subnet) -> Self {
        Self::new()
            .admin(SocketAddr::new(net.ip(250), 9901))
            .socket(&net.dir().join("admin.sock"))
    }

    /// `[admin] listen`.
    pub fn admin(mut self, listen: SocketAddr) -> Self {
        self.admin = Some(listen);
        self
    }

    /// `[admin] socket`.
    pub fn socket(mut self, path: &Path) -> Self {
        self.socket = Some(path.to_path_buf());
        self
    }

    /// TOML lines for `[proxy]` (`drain_timeout_seconds = 1`...).
    pub fn proxy(mut self, lines: &str) -> Self {
        self.proxy.push(lines.to_string());
        self
    }

    /// `[proxy] drain_timeout_seconds`: how long open connections may
    /// finish when a listener goes or the daemon stops.
    pub fn drain_timeout(self, seconds: u64) -> Self {
        self.proxy(&format!("drain_timeout_seconds = {seconds}"))
    }

    /// TOML lines for `[vip]` (`isolate = true`, `announce = "routes"`...).
    pub fn vip(mut self, lines: &str) -> Self {
        self.vip.push(lines.to_string());
        self
    }

    /// TOML at the top level, after `[proxy]` and `[vip]` and before the load balancers
    /// (a table the builder has no method for).
    pub fn text(mut self, toml: &str) -> Self {
        self.text.push(toml.to_string());
        self
    }

    /// Adds a load balancer.
    pub fn lb(mut self, lb: Lb) -> Self {
        self.lbs.push(lb);
        self
    }
}

impl Display for Config {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.admin.is_some() || self.socket.is_some() {
            writeln!(f, "[admin]")?;
            if let Some(listen) = self.admin {
                writeln!(f, "listen = {}", quote(listen))?;
            }
            if let Some(socket) = &self.socket {
                writeln!(f, "socket = {}", quote(socket.display()))?;
            }
        }
        if !self.proxy.is_empty() {
            writeln!(f, "\n[proxy]")?;
            for lines in &self.proxy {
                writeln!(f, "{lines}")?;
            }
        }
        if !self.vip.is_empty() {
            writeln!(f, "\n[vip]")?;
            for lines in &self.vip {
                writeln!(f, "{lines}")?;
            }
        }
        for text in &self.text {
            writeln!(f, "\n{text}")?;
        }
        for lb in &self.lbs {
            write!(f, "\n{lb}")?;
        }
        Ok(())
    }
}

/// One `[[load_balancer]]`.
#[derive(Clone, Debug)]
pub struct Lb {
    name: String,
    vip: String,
    backends: Vec<String>,
    keys: Vec<String>,
    listeners: Vec<Listener>,
    health: Vec<String>,
}

impl Lb {
    /// Load balancer `name` on `vip`, with no backend and no listener yet.
    pub fn new(name: &str, vip: impl Display) -> Self {
        Self {
            name: name.to_string(),
            vip: vip.to_string(),
            backends: Vec::new(),
            keys: Vec::new(),
            listeners: Vec::new(),
            health: Vec::new(),
        }
    }

    /// Its backends (addresses or names).
    pub fn backends<T: Display>(mut self, backends: impl IntoIterator<Item = T>) -> Self {
        self.backends = backends.into_iter().map(|b| b.to_string()).collect();
        self
    }

    /// TOML lines in its table (`algorithm = "round_robin"`...), or a
    /// sub-table of it (`[load_balancer.dhcp]`: TOML lets its listeners follow).
    pub fn keys(mut self, lines: &str) -> Self {
        self.keys.push(lines.to_string());
        self
    }

    /// Adds a listener.
    pub fn listener(mut self, listener: Listener) -> Self {
        self.listeners.push(listener);
        self
    }

    /// Adds TCP listener `name` on `port` to `backend_port`.
    pub fn tcp(self, name: &str, port: u16, backend_port: u16) -> Self {
        self.listener(Listener::new(name, port, backend_port))
    }

    /// TOML lines for its `[load_balancer.health_check]`
    /// (`period_seconds = 1`...); each call adds to the table.
    pub fn health(mut self, lines: &str) -> Self {
        self.health.push(lines.to_string());
        self
    }

    /// `health_check.port`: one probe port for every listener.
    pub fn health_port(self, port: u16) -> Self {
        self.health(&format!("  port = {port}"))
    }
}

impl Display for Lb {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let backends = self
            .backends
            .iter()
            .map(quote)
            .collect::<Vec<_>>()
            .join(", ");
        writeln!(f, "[[load_balancer]]")?;
        writeln!(f, "name = {}", quote(&self.name))?;
        writeln!(f, "vip = {}", quote(&self.vip))?;
        writeln!(f, "backends = [{backends}]")?;
        for lines in &self.keys {
            writeln!(f, "{lines}")?;
        }
        for l in &self.listeners {
            write!(f, "{l}")?;
        }
        if !self.health.is_empty() {
            writeln!(f, "  [load_balancer.health_check]")?;
            for lines in &self.health {
                writeln!(f, "{lines}")?;
            }
        }
        Ok(())
    }
}

/// One `[[load_balancer.listener]]`.
#[derive(Clone, Debug)]
pub struct Listener {
    name: String,
    port: u16,
    backend_port: u16,
    keys: Vec<String>,
}

impl Listener {
    /// Listener `name` on `port` to `backend_port` (TCP unless [`Listener::udp`]).
    pub fn new(name: &str, port: u16, backend_port: u16) -> Self {
        Self {
            name: name.to_string(),
            port,
            backend_port,
            keys: Vec::new(),
        }
    }

    /// `protocol = "udp"`.
    pub fn udp(self) -> Self {
        self.keys("protocol = \"udp\"")
    }

    /// `forwarding`: `"kernel"` or `"proxy"`.
    pub fn forwarding(self, kind: &str) -> Self {
        self.keys(&format!("  forwarding = {}", quote(kind)))
    }

    /// `source_nat` of a kernel-forwarded listener: `"none"` or `"masquerade"`.
    pub fn source_nat(self, mode: &str) -> Self {
        self.keys(&format!("  source_nat = {}", quote(mode)))
    }

    /// TOML lines in its table (`proxy_protocol = "v2"`...).
    pub fn keys(mut self, lines: &str) -> Self {
        self.keys.push(lines.to_string());
        self
    }
}

impl Display for Listener {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "  [[load_balancer.listener]]")?;
        writeln!(f, "  name = {}", quote(&self.name))?;
        writeln!(f, "  port = {}", self.port)?;
        writeln!(f, "  backend_port = {}", self.backend_port)?;
        for lines in &self.keys {
            writeln!(f, "{lines}")?;
        }
        Ok(())
    }
}

/// `value` as a TOML basic string, escaped as TOML wants (not as Rust's `{:?}` does).
pub fn quote(value: impl Display) -> String {
    let mut out = String::from("\"");
    for c in value.to_string().chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if c.is_control() => {
                let _ = write!(out, "\\u{:04X}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// The problems of `text`, a config the test knows to be refused.
pub fn problems(text: &str) -> Vec<harvester_lb::config::Problem> {
    match harvester_lb::config::parse(text) {
        Ok(_) => panic!("config should be invalid:\n{text}"),
        Err(p) => p,
    }
}

/// [`problems`] as `check` prints them, one per line.
pub fn rendered(text: &str) -> String {
    problems(text)
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join("\n")
}

/// `[keepalived]` of host `name` at the management `address` on the
/// interface "mgmt", with its `peers`, keepalived's file at `{files}.conf`,
/// its pid file at `{files}.pid`, the management check's script at
/// `{files}-mgmt-check` (one per host, never /etc's), and `more` lines of
/// the section.
pub fn keepalived<T: Display>(
    name: &str,
    address: impl Display,
    peers: impl IntoIterator<Item = T>,
    files: &Path,
    more: &str,
) -> String {
    let peers: Vec<String> = peers.into_iter().map(quote).collect();
    format!(
        "[keepalived]\nname = {}\naddress = {}\ninterface = \"mgmt\"\npeers = [{}]\n{more}config_path = {}\npid_file = {}\nmanagement_check_script = {}\n\n",
        quote(name),
        quote(address),
        peers.join(", "),
        quote(format_args!("{}.conf", files.display())),
        quote(format_args!("{}.pid", files.display())),
        quote(format_args!("{}-mgmt-check", files.display())),
    )
}

/// `[conntrackd]` of host `host` with `more` lines first (its interface,
/// address, peer ...), every file it names its own in `dir`
/// (`conntrackd.conf-<host>`, `notify.sh-<host>`, `conntrackd.ctl-<host>`,
/// `conntrackd.lock-<host>`, `conntrackd.log-<host>`, `state-<host>`).
pub fn conntrackd(dir: &Path, host: &str, more: &str) -> String {
    let file = |name: &str| quote(dir.join(format!("{name}-{host}")).display());
    format!(
        "\n[conntrackd]\n{more}config_path = {}\nnotify_script = {}\nsocket = {}\nlock_file = {}\nlog_file = {}\nstate_directory = {}\n",
        file("conntrackd.conf"),
        file("notify.sh"),
        file("conntrackd.ctl"),
        file("conntrackd.lock"),
        file("conntrackd.log"),
        file("state"),
    )
}

/// `[[network]]` `name` on `interface`: a /24 via `gateway`, with `more`
/// lines of the network.
pub fn network(name: &str, interface: &str, gateway: impl Display, more: &str) -> String {
    format!(
        "[[network]]\nname = {}\ninterface = {}\nprefix_length = 24\ngateway = {}\n{more}\n",
        quote(name),
        quote(interface),
        quote(gateway),
    )
}

//! The config texts the library's unit tests start from, written once
//! (`#[cfg(test)]` only): a host of a keepalived pair and its VM networks,
//! an anycast host with its sync, load balancers on them, and the two ways
//! a test reads a text (valid, or refused with its problems). A test adds
//! its own lines to these, so what it is about stays in the test.

use super::{Config, Problem, parse};

/// `[keepalived]` of host "a" (192.168.0.11 on "mgmt0") with its one peer,
/// 192.168.0.12.
pub(crate) const KEEPALIVED: &str = r#"[keepalived]
name = "a"
address = "192.168.0.11"
interface = "mgmt0"
peers = ["192.168.0.12"]
"#;

/// `[[network]]` "vlan100" on "br.100": 10.100.0.0/24 via 10.100.0.1. More
/// keys of the network may follow.
pub(crate) const VLAN100: &str = r#"[[network]]
name = "vlan100"
interface = "br.100"
prefix_length = 24
gateway = "10.100.0.1"
"#;

/// `[[network]]` "vlan200" on "br.200": 10.200.0.0/24 via 10.200.0.1. More
/// keys of the network may follow.
pub(crate) const VLAN200: &str = r#"[[network]]
name = "vlan200"
interface = "br.200"
prefix_length = 24
gateway = "10.200.0.1"
"#;

/// "default/db" on 10.100.0.50 in "vlan100" with the lines `more` (its
/// backends, its algorithm) and the kernel listener "pg" (5432 to 30432,
/// `source_nat = "none"`). More listeners may follow.
pub(crate) fn db(more: &str) -> String {
    format!(
        r#"[[load_balancer]]
name = "default/db"
vip = "10.100.0.50"
network = "vlan100"
{more}  [[load_balancer.listener]]
  name = "pg"
  port = 5432
  backend_port = 30432
  forwarding = "kernel"
  source_nat = "none"
"#
    )
}

/// An anycast host, no `[keepalived]`: the announced VIP 198.51.100.100
/// ("default/db", `flow_hash`) with the kernel listener "pg" (5432 to
/// 30432, `source_nat = "vip"`) on the backends 192.0.2.22 and
/// 192.0.2.21 (out of order: what renders them sorts them). More
/// listeners may follow.
pub(crate) const ANYCAST: &str = r#"
[vip]
announce = "routes"
announce_prefixes = ["198.51.100.0/24"]

[[load_balancer]]
name = "default/db"
vip = "198.51.100.100"
algorithm = "flow_hash"
backends = ["192.0.2.22", "192.0.2.21"]
  [[load_balancer.listener]]
  name = "pg"
  port = 5432
  backend_port = 30432
  forwarding = "kernel"
  source_nat = "vip"
"#;

/// `[conntrackd]` of the anycast host: the sync link "eth1" from 10.99.0.1
/// to its peer 10.99.0.2.
pub(crate) const ANYCAST_SYNC: &str =
    "\n[conntrackd]\ninterface = \"eth1\"\naddress = \"10.99.0.1\"\npeer = \"10.99.0.2\"\n";

/// The configuration of a text the test knows to be valid.
pub(crate) fn config(text: &str) -> Config {
    match parse(text) {
        Ok(loaded) => loaded.config,
        Err(p) => panic!("should be valid: {p:?}\n{text}"),
    }
}

/// The problems of a text the test knows to be refused.
pub(crate) fn problems(text: &str) -> Vec<Problem> {
    match parse(text) {
        Ok(_) => panic!("should be refused:\n{text}"),
        Err(p) => p,
    }
}

/// `[keepalived]` on "mgmt-br", network "default/a" on "cluster-br.100"
/// (10.100.0.0/24) with the lines `a`, and network "default/b"
/// (10.200.0.0/24, its interface the test's) with the lines `b`. With `a`
/// empty, `b` starts on line 17; `a` starts on line 12.
pub(crate) fn networks(a: &str, b: &str) -> String {
    format!(
        r#"[keepalived]
name = "lb-1"
address = "192.168.0.11"
interface = "mgmt-br"
peers = ["192.168.0.12"]

[[network]]
name = "default/a"
interface = "cluster-br.100"
prefix_length = 24
gateway = "10.100.0.1"
{a}
[[network]]
name = "default/b"
prefix_length = 24
gateway = "10.200.0.1"
{b}
"#
    )
}

/// Load balancer `name` on `vip` in `network` with `backends` and the
/// listener "http" (80 to 30080); more listeners may follow.
pub(crate) fn lb(name: &str, vip: &str, network: &str, backends: &[&str]) -> String {
    let backends: Vec<String> = backends.iter().map(|b| format!("{b:?}")).collect();
    format!(
        "[[load_balancer]]\nname = {name:?}\nvip = {vip:?}\nnetwork = {network:?}\nbackends = [{}]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n",
        backends.join(", ")
    )
}

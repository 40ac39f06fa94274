//! `harvester-lb import`: from Harvester's own objects, as `kubectl get …
//! -o json|yaml` prints them, to our TOML config.
//!
//! One module per source model (`v1beta1`, `v1alpha1`, and `service` for
//! the guest `Service`s and `Node`s of the v0.1.x cloud provider), all
//! mapping to one load-balancer model (`model`); `documents` reads the
//! text, `write` puts the result in place; `network` settles the VM
//! network a LoadBalancer names (`loadbalancer.harvesterhci.io/network`)
//! from the NetworkAttachmentDefinitions and IPPools given with it, into
//! `[[network]]` tables, skipping by name the load balancers of a network
//! this host has no interface on (the command line reads the host's interfaces
//! over rtnetlink). This module reads only `config` types and does no I/O beyond the
//! file it replaces (read for its guards, written by `write`); it never talks to a cluster or
//! to the daemon (the daemon's file watch picks the new file up). The
//! command's other half, in the binary (`src/cli/import.rs`), reads the
//! input files and the host, prints and chooses the exit code.
//!
//! Nothing is dropped without a word: an object or a listener that cannot
//! be mapped is named (on stderr, by the command line) with the reason (`--strict` makes that an
//! error). Each load balancer is validated on its own with the config's own
//! rules, so one bad object is skipped rather than blocking the others; so
//! is each `Node`, and each object that breaks a rule spanning load
//! balancers (one VIP:port, a backend that is a VIP:port or
//! `admin.listen`), and the largest ones if the file would exceed the
//! config's size limit. Objects are untrusted: an address of this host as
//! a VIP or backend skips the object (`guard`); so does a VIP that is one
//! of the host's own addresses or the gateway of one of its routes, or
//! (with `announce = "routes"` in the base) outside
//! `vip.announce_prefixes`, as the daemon would refuse it
//! ([`crate::host::vip_guard`]: the host as the command line read it over
//! rtnetlink, handed in as [`Options::host`]). The whole file is
//! validated again before it is shown or written. The output depends only
//! on the set of objects, not their order: load balancers sorted by name,
//! lists sorted.

mod common;
mod documents;
mod fields;
mod guard;
mod model;
mod network;
mod service;
mod v1alpha1;
mod v1beta1;
mod write;

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::net::{IpAddr, SocketAddr};
use std::path::Path;
use std::sync::Arc;

use crate::config::{self, Conflict, LoadBalancerSpec, Problem};

pub use documents::{DocumentError, MAX_INPUT_BYTES, Source};
pub use guard::{existing_names, removals};
pub use network::parse_mapping as parse_network_interfaces;
pub use write::{WriteError, WriteOutcome, write_validated};

/// What this build's config accepts beyond TCP listeners with a checked
/// port, found by asking the config's own validation: features that other
/// work adds (UDP listeners, a health check without a port) are imported
/// as soon as the config takes them, with no change here.
#[derive(Debug, Clone, Copy)]
pub struct Accepts {
    /// `protocol = "udp"` listeners.
    pub udp: bool,
    /// `[load_balancer.health_check]` without `port`.
    pub check_without_port: bool,
}

impl Accepts {
    /// Asks the config's validation.
    pub fn probe() -> Self {
        const LB: &str = "[[load_balancer]]\nname = \"probe/probe\"\nvip = \"127.0.0.1\"\nbackends = [\"127.0.0.2\"]\n";
        let udp = format!(
            "{LB}[[load_balancer.listener]]\nname = \"u\"\nport = 1\nbackend_port = 1\nprotocol = \"udp\"\n"
        );
        let no_port = format!(
            "{LB}[[load_balancer.listener]]\nname = \"t\"\nport = 1\nbackend_port = 1\n[load_balancer.health_check]\nsuccess_threshold = 1\n"
        );
        Self {
            udp: config::parse(&udp).is_ok(),
            check_without_port: config::parse(&no_port).is_ok(),
        }
    }
}

/// One object mapped, with what was left out of it and how.
struct Mapped {
    lb: model::Lb,
    /// Parts not imported (errors under `--strict`).
    skipped_parts: Vec<String>,
    /// How things were mapped, worth a line.
    notes: Vec<String>,
    /// The VM network it names, if any (settled by `network::resolve`).
    claim: Option<network::Claim>,
}

/// How the import is asked for.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The guest cluster that `Service`s and `Node`s come from (`--cluster`).
    pub cluster: Option<String>,
    /// Config text written before the load balancers (`--base`): the
    /// `[admin]`, `[proxy]` and `[metrics]` settings of this host.
    pub base: Option<Source>,
    /// Let loopback addresses be VIPs and backends (`--allow-loopback`):
    /// for tests and demos on one machine only, since an object could then
    /// forward a VIP to this host's own services.
    pub allow_loopback: bool,
    /// Who holds each VIP:port in the file that `--write` replaces: when a
    /// new object claims a VIP:port that a load balancer of the current
    /// file holds, the holder keeps it and only the newcomer is skipped, so
    /// one tenant's object cannot take another's VIP off the host.
    pub holders: Holders,
    /// This host's addresses and routes' gateways: a VIP that is one of
    /// them is skipped (see [`crate::host::vip_guard::judge`]). The command
    /// line always reads them; `None` (a library caller) checks nothing.
    pub host: Option<crate::host::vip_guard::HostNet>,
    /// This host's interface for each VM network, by network name
    /// (`--network-interface NETWORK=INTERFACE`): where it cannot be
    /// derived from the NetworkAttachmentDefinition, or is named otherwise
    /// on this host.
    pub network_interfaces: BTreeMap<String, String>,
    /// This host's interfaces: a load balancer on a network whose
    /// interface is not among them is skipped (this host is not on that
    /// network). The command line always reads them; `None` checks nothing.
    pub interfaces: Option<BTreeSet<String>>,
    /// How every imported listener is forwarded (`--forwarding`,
    /// `--source-nat`): Harvester's objects do not say, and a VIP that
    /// moves between hosts keeps its open connections only on kernel
    /// listeners whose flows `[conntrackd]` syncs.
    pub listeners: ListenerChoice,
}

/// The `forwarding` and `source_nat` written on every imported listener;
/// `None` writes no key (the config's default). Values are the config's
/// names; a value the config refuses, or one its load balancer cannot take
/// (a kernel listener with PROXY protocol), skips that object by name.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ListenerChoice {
    /// `proxy` or `kernel`.
    pub forwarding: Option<String>,
    /// `masquerade`, `none` or `vip`.
    pub source_nat: Option<String>,
}

/// The load balancer that holds each VIP:port and protocol in a config
/// file (the one in force), by name.
#[derive(Debug, Clone, Default)]
pub struct Holders(std::collections::HashMap<config::ListenerKey, String>);

impl Holders {
    /// The holders of the config in `text`; none when it does not parse
    /// (then every clash skips both sides, as with no file).
    pub fn of_config_text(text: &str) -> Self {
        let mut held = std::collections::HashMap::new();
        if let Ok(loaded) = config::parse(text) {
            for lb in &loaded.config.load_balancers {
                for l in &lb.listeners {
                    let key = config::ListenerKey {
                        addr: SocketAddr::new(lb.vip.to_canonical(), l.port),
                        protocol: l.protocol,
                    };
                    held.insert(key, lb.name.clone());
                }
            }
        }
        Self(held)
    }

    /// The holders of the config file at `path` (the one `--write`
    /// replaces); none when it is not a regular file of at most the
    /// config's size limit, or does not parse.
    pub fn of_file(path: &Path) -> Self {
        write::existing(path)
            .map(|text| Self::of_config_text(&text))
            .unwrap_or_default()
    }

    fn holder(&self, addr: SocketAddr, protocol: config::Protocol) -> Option<&str> {
        let addr = SocketAddr::new(addr.ip().to_canonical(), addr.port());
        let key = config::ListenerKey { addr, protocol };
        self.0.get(&key).map(String::as_str)
    }
}

/// Something not imported, and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Skip {
    /// The object: its version, kind, name and where it was found.
    pub object: String,
    /// Why, naming the field.
    pub reason: String,
}

impl fmt::Display for Skip {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.object, self.reason)
    }
}

/// What precedes the skips' fingerprint in a generated file's header.
const SKIPS_MARK: &str = "skips ";

/// A fingerprint of what was skipped (the first 16 hex digits of the
/// SHA-256 of the skip lines without where each object was found, sorted),
/// written into the generated file's header; `None` when nothing was
/// skipped. Without the places, the same objects in any order or split
/// give the same file. The import timer runs every
/// minute: `import --write` names each skip only when this differs from
/// the file's ([`recorded_skips`]), so the journal says a skip once per
/// change, not every minute.
pub fn skips_fingerprint(skipped: &[Skip]) -> Option<String> {
    use sha2::Digest as _;
    if skipped.is_empty() {
        return None;
    }
    let mut lines: Vec<String> = skipped
        .iter()
        .map(|skip| without_places(&skip.to_string()))
        .collect();
    lines.sort();
    lines.dedup();
    let digest = sha2::Sha256::digest(lines.join("\n").as_bytes());
    Some(digest[..8].iter().map(|b| format!("{b:02x}")).collect())
}

/// `line` without the places of objects it names (` (FILE, document N,
/// item M)`, as [`documents::Object::describe`] writes them).
fn without_places(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let mut rest = line;
    while let Some(start) = rest.find(" (") {
        let Some(len) = rest[start..].find(')') else {
            break;
        };
        let group = &rest[start..start + len + 1];
        out.push_str(&rest[..start]);
        if !group.contains(", document ") {
            out.push_str(group);
        }
        rest = &rest[start + len + 1..];
    }
    out.push_str(rest);
    out
}

/// The skips' fingerprint the header of the config file at `path` records
/// ([`skips_fingerprint`]); `None` for a file without one (nothing skipped,
/// an older import, a hand-written file, no readable regular file).
pub fn recorded_skips(path: &Path) -> Option<String> {
    header_skips(&write::existing(path)?).map(str::to_string)
}

/// [`recorded_skips`] of a file's text.
fn header_skips(text: &str) -> Option<&str> {
    let header = text.lines().take_while(|l| l.starts_with('#')).nth(1)?;
    let start = header.find(SKIPS_MARK)? + SKIPS_MARK.len();
    let rest = &header[start..];
    let end = rest
        .find(|c: char| !c.is_ascii_hexdigit())
        .unwrap_or(rest.len());
    (end > 0).then(|| &rest[..end])
}

/// The result of an import.
#[derive(Debug, Clone)]
pub struct Imported {
    /// The whole config file.
    pub text: String,
    /// Load balancers in it.
    pub load_balancers: usize,
    /// Their names, for the removal guard of `--write`.
    pub names: BTreeSet<String>,
    /// Objects and parts of objects not imported.
    pub skipped: Vec<Skip>,
    /// How some things were mapped (not errors).
    pub notes: Vec<String>,
    /// The config's warnings about what was imported (e.g. no backends).
    pub warnings: Vec<String>,
}

/// Why there is no config to show or write.
#[derive(Debug, thiserror::Error)]
pub enum ImportError {
    /// The input is not Kubernetes objects.
    #[error(transparent)]
    Document(#[from] DocumentError),
    /// Guest `Service`s were given without the cluster they belong to.
    #[error(
        "{services} Service(s) of type LoadBalancer given without --cluster NAME: the guest cluster they and their Nodes belong to names their load balancers' cluster"
    )]
    NeedCluster {
        /// How many.
        services: usize,
    },
    /// The `--base` file is not usable.
    #[error("--base {path}: {message}")]
    Base {
        /// The file.
        path: String,
        /// What is wrong.
        message: String,
    },
    /// The load balancers together break a rule that spans them (the same
    /// VIP:port twice); nothing is written.
    #[error("the imported config is invalid ({} problem{}):\n{}", problems.len(), if problems.len() == 1 { "" } else { "s" }, problems.join("\n"))]
    Invalid {
        /// Each problem, with the load balancer it is in.
        problems: Vec<String>,
    },
}

/// Maps every object of `sources` to one config file.
pub fn import(sources: &[Source], options: &Options) -> Result<Imported, ImportError> {
    let accepts = Accepts::probe();
    let mut objects = Vec::new();
    for source in sources {
        objects.extend(documents::objects(source)?);
    }
    let mut skipped = Vec::new();
    let mut notes = Vec::new();
    let mut results: Vec<(String, Result<Mapped, fields::Reason>)> = Vec::new();
    let mut services = Vec::new();
    let mut other_services = 0usize;
    let mut nodes: Vec<IpAddr> = Vec::new();
    let mut nads = Vec::new();
    let mut pools = Vec::new();
    for obj in &objects {
        match (obj.api_version(), obj.kind()) {
            (v1beta1::API_VERSION, "LoadBalancer") => results.push((
                obj.describe(),
                common::map_load_balancer(obj, &accepts, &v1beta1::LAYOUT),
            )),
            (v1alpha1::API_VERSION, "LoadBalancer") => results.push((
                obj.describe(),
                common::map_load_balancer(obj, &accepts, &v1alpha1::LAYOUT),
            )),
            ("v1", "Service") if service::is_load_balancer(obj) => services.push(obj),
            ("v1", "Service") => other_services += 1,
            // Each Node is judged alone: one bad address skips that Node,
            // never the Services it would have been a backend of.
            ("v1", "Node") => node(obj, options, &mut nodes, &mut skipped, &mut notes),
            (network::NAD_API_VERSION, network::NAD_KIND) => nads.push(network::nad(obj)),
            (v1beta1::API_VERSION, "IPPool") => match network::pool(obj) {
                Ok(Some(p)) => pools.push(p),
                Ok(None) => notes.push(format!(
                    "{}: spec.selector.network is empty; not used for any network's subnet",
                    obj.describe()
                )),
                Err(reason) => notes.push(format!(
                    "{}: {reason}; not used for any network's subnet",
                    obj.describe()
                )),
            },
            (_, kind) => skipped.push(not_imported(obj, kind)),
        }
    }
    if other_services > 0 {
        notes.push(format!(
            "{other_services} Service(s) not of type LoadBalancer ignored"
        ));
    }
    if !services.is_empty() {
        let Some(cluster) = options.cluster.as_deref() else {
            return Err(ImportError::NeedCluster {
                services: services.len(),
            });
        };
        nodes.iter_mut().for_each(|ip| *ip = ip.to_canonical());
        nodes.sort_unstable();
        nodes.dedup();
        for obj in services {
            results.push((obj.describe(), service::map(obj, cluster, &nodes, &accepts)));
        }
    }

    // Each load balancer on a VM network: its network settled, or skipped.
    let networks = network::resolve(&mut results, &nads, &pools, options, &mut notes);

    // Each load balancer alone against the config's rules.
    let mut by_name: BTreeMap<String, Vec<Entry>> = BTreeMap::new();
    let mut warnings = Vec::new();
    for (object, result) in results {
        if let Some(entry) = alone(
            object,
            result,
            options,
            &networks,
            &mut skipped,
            &mut notes,
            &mut warnings,
        ) {
            by_name
                .entry(entry.lb.name.clone())
                .or_default()
                .push(entry);
        }
    }

    let mut lbs = one_per_name(by_name, &mut skipped);

    skip_conflicts(
        &mut lbs,
        admin_listen(options),
        &options.holders,
        &mut skipped,
    );
    // Until no VIP is left without one of keepalived's family to ride
    // with (the size limit may leave out the last one the others rode
    // with).
    let text = loop {
        let text = fit(
            sources,
            options,
            &networks,
            &mut lbs,
            objects.len(),
            &mut skipped,
        )?;
        if !skip_riderless(&mut lbs, options, &mut skipped) {
            break text;
        }
    };
    let models: Vec<model::Lb> = lbs.iter().map(|e| e.lb.clone()).collect();
    if let Err(problems) = config::parse(&text) {
        return Err(ImportError::Invalid {
            problems: problems.iter().map(|p| with_lb_name(p, &models)).collect(),
        });
    }
    Ok(Imported {
        text,
        load_balancers: lbs.len(),
        names: lbs.iter().map(|e| e.lb.name.clone()).collect(),
        skipped,
        notes,
        warnings,
    })
}

/// A v1 Node: its addresses join the backends, unless one is an address
/// no backend may have (then the Node is skipped, never the Services).
fn node(
    obj: &documents::Object,
    options: &Options,
    nodes: &mut Vec<IpAddr>,
    skipped: &mut Vec<Skip>,
    notes: &mut Vec<String>,
) {
    match service::node_addresses(obj) {
        Ok(addrs) => match addrs.iter().find_map(|&ip| {
            guard::host_address(ip, options.allow_loopback).map(|why| (ip, why))
        }) {
            None => nodes.extend(addrs),
            Some((ip, why)) => skipped.push(Skip {
                object: obj.describe(),
                reason: format!(
                    "status.addresses: InternalIP {ip} is {why}; this Node is no backend of any load balancer"
                ),
            }),
        },
        Err(service::NoBackend::Normal(reason)) => {
            notes.push(format!("{}: {reason}", obj.describe()))
        }
        Err(service::NoBackend::Bad(reason)) => skipped.push(Skip {
            object: obj.describe(),
            reason: format!("{reason}; this Node is no backend of any load balancer"),
        }),
    }
}

/// An object of a kind that is not imported.
fn not_imported(obj: &documents::Object, kind: &str) -> Skip {
    Skip {
        object: obj.describe(),
        reason: format!(
            "{} is not imported (LoadBalancer {} or {}, v1 Service and Node, NetworkAttachmentDefinition and IPPool)",
            if kind.is_empty() {
                "an object without kind"
            } else {
                "this kind"
            },
            v1beta1::API_VERSION,
            v1alpha1::API_VERSION
        ),
    }
}

/// One mapped object checked alone against the config's rules: the load
/// balancer it becomes, or `None` with the reason in `skipped`. Its notes
/// and the config's warnings are named by the object.
fn alone(
    object: String,
    result: Result<Mapped, fields::Reason>,
    options: &Options,
    networks: &BTreeMap<String, model::Network>,
    skipped: &mut Vec<Skip>,
    notes: &mut Vec<String>,
    warnings: &mut Vec<String>,
) -> Option<Entry> {
    let mut mapped = match result {
        Ok(m) => m,
        Err(reason) => {
            skipped.push(Skip { object, reason });
            return None;
        }
    };
    mapped.lb.normalise();
    // A VIP this daemon will lease is 0.0.0.0 until then: nothing to judge.
    let unleased = mapped.lb.leased && mapped.lb.vip.is_unspecified();
    let bad_address = if unleased {
        guard::backend_addresses(&mapped.lb, options.allow_loopback)
    } else {
        guard::lb_addresses(&mapped.lb, options.allow_loopback)
    };
    if let Some(reason) = bad_address {
        skipped.push(Skip { object, reason });
        return None;
    }
    if let Some(host) = options.host.as_ref().filter(|_| !unleased)
        && let Some(why) = crate::host::vip_guard::judge(
            mapped.lb.vip,
            host,
            &BTreeSet::new(),
            &base_announce(options),
        )
    {
        skipped.push(Skip {
            object,
            reason: format!(
                "VIP {} is {why}; not imported (the daemon would refuse it too)",
                mapped.lb.vip
            ),
        });
        return None;
    }
    notes.extend(mapped.notes.iter().map(|n| format!("{object}: {n}")));
    if mapped.lb.listeners.is_empty() {
        // One line for the object: what was left out is why nothing is left.
        let mut why = mapped.skipped_parts;
        why.push("no listener left that can be served: not imported".into());
        skipped.push(Skip {
            object,
            reason: why.join("; "),
        });
        return None;
    }
    for reason in mapped.skipped_parts {
        skipped.push(Skip {
            object: object.clone(),
            reason,
        });
    }
    let mut alone = match network_context(options, networks, &mapped.lb) {
        Ok(context) => context,
        Err(e) => {
            skipped.push(Skip {
                object,
                reason: e.to_string(),
            });
            return None;
        }
    };
    mapped.lb.forwarding = options.listeners.clone();
    let context_len = alone.len();
    mapped.lb.write_toml(&mut alone);
    let mut parsed = config::parse(&alone);
    // Alone, a VIP of the other family than keepalived's adverts (an IPv6
    // one) has nothing to ride with: checked again beside a stand-in of
    // keepalived's family, and decided over the whole file by
    // `skip_riderless`.
    if let (Err(problems), Some(name)) = (&parsed, &mapped.lb.network)
        && problems.iter().any(config::is_other_family_alone)
        && let Some(rider) = rider_stand_in(&alone[..context_len], name)
    {
        parsed = config::parse(&format!("{alone}{rider}"));
    }
    match parsed {
        Ok(loaded) => {
            warnings.extend(
                loaded
                    .warnings
                    .iter()
                    // The context's own (its other networks unused) and the
                    // stand-in's are not this object's.
                    .filter(|w| {
                        w.key.starts_with("load_balancer") && !w.key.starts_with("load_balancer[1]")
                    })
                    .map(|w| format!("{object}: {}", without_index(w))),
            );
            // A valid file has its table first.
            let spec = loaded.config.load_balancers.into_iter().next()?;
            Some(Entry {
                object,
                lb: mapped.lb,
                spec,
            })
        }
        Err(problems) => {
            skipped.push(Skip {
                object,
                reason: problems
                    .iter()
                    // The stand-in's own are not this object's.
                    .filter(|p| !p.key.starts_with("load_balancer[1]"))
                    .map(without_index)
                    .collect::<Vec<_>>()
                    .join("; "),
            });
            None
        }
    }
}

/// What a load balancer on a VM network is checked alone with: the
/// `--base` file's `[keepalived]`, `[vip]`, `[dhcp]` and `[[network]]`, and
/// its network's table. Empty for one on no network. A VIP keepalived
/// moves needs the `--base` file's `[keepalived]`: without it the object
/// is skipped, saying so.
fn network_context(
    options: &Options,
    networks: &BTreeMap<String, model::Network>,
    lb: &model::Lb,
) -> Result<String, NoKeepalivedInBase> {
    let Some(name) = &lb.network else {
        return Ok(String::new());
    };
    let base: toml::Table = options
        .base
        .as_ref()
        .and_then(|b| b.text.parse().ok())
        .unwrap_or_default();
    if !lb.leased && !base.contains_key("keepalived") {
        return Err(NoKeepalivedInBase {
            network: name.clone(),
        });
    }
    let kept: toml::Table = base
        .into_iter()
        .filter(|(k, _)| matches!(k.as_str(), "keepalived" | "vip" | "dhcp" | "network"))
        .collect();
    let mut text = toml::to_string(&kept).unwrap_or_default();
    if let Some(net) = networks.get(name) {
        text.push('\n');
        net.write_toml(&mut text);
    }
    text.push('\n');
    Ok(text)
}

/// Why a load balancer on a VM network keepalived serves cannot be checked
/// alone ([`network_context`]): a skip reason.
#[derive(Debug, thiserror::Error)]
#[error(
    "on network {network:?}, where keepalived moves the VIP between hosts: the --base file has no [keepalived] section (this host's name, management address and interface, and its peers); not imported"
)]
struct NoKeepalivedInBase {
    /// The load balancer's network.
    network: String,
}

/// One name, one load balancer: the same object seen twice (two files,
/// or in both versions) is one; different ones are all left out, since
/// none can be chosen whatever the order.
fn one_per_name(by_name: BTreeMap<String, Vec<Entry>>, skipped: &mut Vec<Skip>) -> Vec<Entry> {
    let mut lbs: Vec<Entry> = Vec::new();
    for (name, group) in by_name {
        if group.iter().all(|e| e.lb == group[0].lb) {
            lbs.extend(group.into_iter().next());
        } else {
            let objects: Vec<&str> = group.iter().map(|e| e.object.as_str()).collect();
            for e in &group {
                skipped.push(Skip {
                    object: e.object.clone(),
                    reason: format!(
                        "{} objects map to load balancer {name:?} differently ({}); none of them is imported",
                        group.len(),
                        objects.join("; ")
                    ),
                });
            }
        }
    }
    lbs
}

/// One object that became a load balancer valid on its own.
struct Entry {
    /// How it is named in skip lines.
    object: String,
    /// What is written.
    lb: model::Lb,
    /// What the config made of it, for the rules that span load balancers.
    spec: Arc<LoadBalancerSpec>,
}

/// A load balancer of keepalived's family on network `network` of
/// `context` (the `[[network]]` tables an object is checked alone with),
/// to check alone a VIP of the other family that needs one to ride with:
/// its VIP the subnet's last host (or the one before, if that is the
/// gateway), its backend the gateway. Never written: `skip_riderless`
/// decides over the real load balancers.
fn rider_stand_in(context: &str, network: &str) -> Option<String> {
    let table: toml::Table = context.parse().ok()?;
    let net = table
        .get("network")?
        .as_array()?
        .iter()
        .find(|n| n.get("name").and_then(toml::Value::as_str) == Some(network))?;
    let gateway: std::net::Ipv4Addr = net.get("gateway")?.as_str()?.parse().ok()?;
    let length = u8::try_from(net.get("prefix_length")?.as_integer()?).ok()?;
    let subnet = ipnet::Ipv4Net::new(gateway, length).ok()?.trunc();
    let last = u32::from(subnet.broadcast()).checked_sub(1)?;
    let vip = std::net::Ipv4Addr::from(if last == u32::from(gateway) {
        last.checked_sub(1)?
    } else {
        last
    });
    let name = toml::Value::String(network.to_string());
    Some(format!(
        "\n[[load_balancer]]\nname = \"harvester-lb-import/rider\"\nvip = \"{vip}\"\nnetwork = {name}\nbackends = [\"{gateway}\"]\n\n  [[load_balancer.listener]]\n  name = \"rider\"\n  port = 1\n  backend_port = 1\n"
    ))
}

/// keepalived moves a VIP of the other family than its adverts' (an IPv6
/// VIP under IPv4 adverts) only beside one of its own in the same
/// instance, so `check` refuses a file whose VIPs keepalived moves are all
/// of the other family. Rather than failing the whole import, the load
/// balancers on a network with such a VIP are skipped by name, saying
/// what they need. Whether any was skipped.
fn skip_riderless(lbs: &mut Vec<Entry>, options: &Options, skipped: &mut Vec<Skip>) -> bool {
    let base = options.base.as_ref().map_or("", |b| b.text.as_str());
    let Ok(loaded) = config::parse(&format!("load_balancer = []\n{base}")) else {
        return false; // The whole file fails on the base anyway.
    };
    let Some(k) = loaded.config.keepalived else {
        return false;
    };
    let address = k.address;
    let announce = loaded.config.vip.announce;
    let moved = |e: &Entry| e.spec.network.is_some() || k.moves_management_vip(&e.spec, &announce);
    let ours = |e: &Entry| e.spec.vip.to_canonical().is_ipv4() == address.is_ipv4();
    if !lbs.iter().any(|e| moved(e) && !ours(e)) || lbs.iter().any(|e| moved(e) && ours(e)) {
        return false;
    }
    let (family, other) = if address.is_ipv4() {
        ("IPv4", "IPv6")
    } else {
        ("IPv6", "IPv4")
    };
    let before = lbs.len();
    lbs.retain(|e| {
        let alone = e.spec.network.is_some() && !ours(e);
        if alone {
            skipped.push(Skip {
                object: e.object.clone(),
                reason: format!(
                    "VIP {} on network {:?} is {other}, and keepalived (its adverts are {family}: keepalived.address is {address}) {}: no {family} VIP keepalived moves is imported (on a network, or a management VIP); not imported until one is",
                    e.spec.vip,
                    e.spec.network.as_deref().unwrap_or_default(),
                    config::OTHER_FAMILY_ALONE
                ),
            });
        }
        !alone
    });
    lbs.len() != before
}

/// `admin.listen` of the `--base` settings (the config's default without
/// one): a VIP:port or a backend there is a conflict.
fn admin_listen(options: &Options) -> SocketAddr {
    let listen = |text: &str| config::parse(text).ok().map(|l| l.config.admin.listen);
    let base = options.base.as_ref().map_or("", |b| b.text.as_str());
    // The key before the tables, so the base's tables stay whole.
    listen(&format!("load_balancer = []\n{base}"))
        .or_else(|| listen("load_balancer = []\n"))
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 9901)))
}

/// `vip.announce` of the `--base` settings (the default, `none`, without
/// one or when it does not parse: then the whole import fails anyway).
fn base_announce(options: &Options) -> config::AnnounceSettings {
    let base = options.base.as_ref().map_or("", |b| b.text.as_str());
    config::parse(&format!("load_balancer = []\n{base}"))
        .map(|l| l.config.vip.announce)
        .unwrap_or_default()
}

/// Skips every load balancer that breaks a rule spanning load balancers
/// (both of two on one VIP:port, one whose backend is a VIP:port of the
/// file or `admin.listen`), with the config's own rules, until none is
/// left: one object cannot block every other tenant's update.
fn skip_conflicts(
    lbs: &mut Vec<Entry>,
    admin: SocketAddr,
    holders: &Holders,
    skipped: &mut Vec<Skip>,
) {
    loop {
        let specs: Vec<&LoadBalancerSpec> = lbs.iter().map(|e| &*e.spec).collect();
        let found = config::conflicts(admin, &specs);
        if found.is_empty() {
            return;
        }
        let mut out: BTreeMap<usize, String> = BTreeMap::new();
        for conflict in &found {
            let held = held_by(conflict, lbs, holders);
            let offenders = match held {
                Some(holder) => vec![newcomer(conflict, holder)],
                None => conflict.offenders(),
            };
            for i in offenders {
                out.entry(i)
                    .or_insert_with(|| conflict_reason(conflict, i, lbs, admin, held));
            }
        }
        for (i, reason) in out.into_iter().rev() {
            let e = lbs.remove(i);
            skipped.push(Skip {
                object: e.object,
                reason,
            });
        }
    }
}

/// In a clash of two load balancers on one VIP:port, the one (by index)
/// that holds it in the current file while the other does not.
fn held_by(conflict: &Conflict, lbs: &[Entry], holders: &Holders) -> Option<usize> {
    let Conflict::Address {
        addr,
        protocol,
        first,
        again,
    } = *conflict
    else {
        return None;
    };
    let holder = holders.holder(addr, protocol)?;
    match (
        lbs[first.0].lb.name == holder,
        lbs[again.0].lb.name == holder,
    ) {
        (true, false) => Some(first.0),
        (false, true) => Some(again.0),
        _ => None,
    }
}

/// The other side of a two-sided `conflict` from `holder`.
fn newcomer(conflict: &Conflict, holder: usize) -> usize {
    match *conflict {
        Conflict::Address { first, again, .. } if first.0 == holder => again.0,
        Conflict::Address { first, .. } => first.0,
        _ => holder,
    }
}

/// Why load balancer `i` goes for `conflict`, naming the other object;
/// `held`: the other one holds the VIP:port in the current file and stays.
fn conflict_reason(
    conflict: &Conflict,
    i: usize,
    lbs: &[Entry],
    admin: SocketAddr,
    held: Option<usize>,
) -> String {
    let listener = |(lb, k): (usize, usize)| &lbs[lb].spec.listeners[k];
    match *conflict {
        Conflict::Name { first, again } => {
            let other = if i == first { again } else { first };
            format!(
                "load balancer {:?} is also {}; neither is imported",
                lbs[i].lb.name, lbs[other].object
            )
        }
        Conflict::Address {
            addr,
            protocol,
            first,
            again,
        } => {
            let (mine, other) = if i == first.0 {
                (first, again)
            } else {
                (again, first)
            };
            if held == Some(other.0) {
                return format!(
                    "listener {:?} on {addr}/{protocol}: {} holds that VIP:port in the config in force (listener {:?}) and keeps it; not imported",
                    listener(mine).name,
                    lbs[other.0].object,
                    listener(other).name
                );
            }
            format!(
                "listener {:?} on {addr}/{protocol}: {} claims that VIP:port too (listener {:?}); two objects on one VIP:port: neither is imported",
                listener(mine).name,
                lbs[other.0].object,
                listener(other).name
            )
        }
        Conflict::Loop {
            backend,
            listener: k,
            target,
            ..
        } => format!(
            "backend {} (listener {:?}) is the VIP:port of {} (listener {:?}): the daemon would forward to itself; not imported",
            SocketAddr::new(backend, lbs[i].spec.listeners[k].backend_port),
            lbs[i].spec.listeners[k].name,
            lbs[target.0].object,
            listener(target).name
        ),
        Conflict::Admin {
            listener: k,
            backend: None,
            ..
        } => format!(
            "listener {:?} on {} is this host's admin.listen ({admin}); not imported",
            lbs[i].spec.listeners[k].name,
            lbs[i].spec.listen_addr(&lbs[i].spec.listeners[k])
        ),
        Conflict::Admin {
            listener: k,
            backend: Some(backend),
            ..
        } => format!(
            "backend {} (listener {:?}) reaches this host's admin.listen ({admin}): clients of the VIP would reach the admin API; not imported",
            SocketAddr::new(backend, lbs[i].spec.listeners[k].backend_port),
            lbs[i].spec.listeners[k].name
        ),
    }
}

/// The file, with the largest load balancers skipped while it would be
/// larger than the config's size limit (the daemon would refuse all of it).
fn fit(
    sources: &[Source],
    options: &Options,
    networks: &BTreeMap<String, model::Network>,
    lbs: &mut Vec<Entry>,
    objects: usize,
    skipped: &mut Vec<Skip>,
) -> Result<String, ImportError> {
    let limit = config::MAX_FILE_BYTES as usize;
    loop {
        let models: Vec<model::Lb> = lbs.iter().map(|e| e.lb.clone()).collect();
        let text = render(sources, options, networks, &models, objects, skipped)?;
        if text.len() <= limit || lbs.is_empty() {
            return Ok(text);
        }
        // Largest first, by name among equals: the same objects, the same file.
        let mut sizes: Vec<(usize, usize)> = models
            .iter()
            .enumerate()
            .map(|(i, lb)| {
                let mut t = String::new();
                lb.write_toml(&mut t);
                (t.len() + 1, i)
            })
            .collect();
        sizes.sort_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(&b.1)));
        // A little more than the excess: the header's counts grow.
        let excess = text.len() - limit + 64;
        let mut freed = 0;
        let mut out = Vec::new();
        for (size, i) in sizes {
            if freed >= excess {
                break;
            }
            freed += size;
            out.push((i, size));
        }
        out.sort_unstable();
        for (i, size) in out.into_iter().rev() {
            let e = lbs.remove(i);
            skipped.push(Skip {
                object: e.object,
                reason: format!(
                    "the config would be {} bytes, over the {limit}-byte limit of a config file; the largest load balancers are left out until the rest fits, and this one's table is {size} bytes; not imported",
                    text.len()
                ),
            });
        }
    }
}

/// The file: header, the `--base` text, the networks the load balancers
/// use (those the `--base` file does not define), the load balancers.
fn render(
    sources: &[Source],
    options: &Options,
    networks: &BTreeMap<String, model::Network>,
    lbs: &[model::Lb],
    objects: usize,
    skipped: &[Skip],
) -> Result<String, ImportError> {
    let mut names: Vec<String> = sources
        .iter()
        .map(|s| model::comment_safe(&s.name))
        .collect();
    names.sort();
    names.dedup();
    let skips = match skips_fingerprint(skipped) {
        Some(fingerprint) => format!(
            "{} skipped (named on stderr by the import that found them; {SKIPS_MARK}{fingerprint})",
            skipped.len()
        ),
        None => "0 skipped".to_string(),
    };
    let mut text = format!(
        "# Generated by `harvester-lb import` (harvester-lb {}) from {}.\n\
         # {} load balancer{} from {objects} object{}; {skips}.\n\
         # Do not edit: the next import replaces this file; put local settings in the --base file.\n",
        env!("CARGO_PKG_VERSION"),
        names.join(", "),
        lbs.len(),
        if lbs.len() == 1 { "" } else { "s" },
        if objects == 1 { "" } else { "s" },
    );
    if let Some(base) = &options.base {
        let table: toml::Table =
            base.text
                .parse()
                .map_err(|e: toml::de::Error| ImportError::Base {
                    path: base.name.clone(),
                    message: format!("not valid TOML: {}", e.message()),
                })?;
        if table.contains_key("load_balancer") {
            return Err(ImportError::Base {
                path: base.name.clone(),
                message: "holds [[load_balancer]] tables; import writes those (keep [admin], [proxy] and [metrics] there)".into(),
            });
        }
        text.push_str(&format!("\n# From {}:\n", model::comment_safe(&base.name)));
        text.push_str(base.text.trim_end());
        text.push('\n');
    }
    let used: BTreeSet<&str> = lbs.iter().filter_map(|lb| lb.network.as_deref()).collect();
    for net in networks.values().filter(|n| used.contains(n.name.as_str())) {
        text.push('\n');
        net.write_toml(&mut text);
    }
    for lb in lbs {
        text.push('\n');
        lb.write_toml(&mut text);
    }
    Ok(text)
}

/// A problem of a one-load-balancer config, without `load_balancer[0].`
/// and without the line (of a text nobody sees).
fn without_index(p: &Problem) -> String {
    let key = p.key.strip_prefix("load_balancer[0]").unwrap_or(&p.key);
    let key = key.strip_prefix('.').unwrap_or(key);
    if key.is_empty() {
        p.message.clone()
    } else {
        format!("{key}: {}", p.message)
    }
}

/// A problem of the whole file, with the name of the load balancer its key
/// path points into.
fn with_lb_name(p: &Problem, lbs: &[model::Lb]) -> String {
    let index = p
        .key
        .strip_prefix("load_balancer[")
        .and_then(|rest| rest.split(']').next())
        .and_then(|n| n.parse::<usize>().ok());
    match index.and_then(|i| lbs.get(i)) {
        Some(lb) => format!("  load balancer {:?}: {p}", lb.name),
        None => format!("  {p}"),
    }
}

#[cfg(test)]
mod tests;

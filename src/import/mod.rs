//! `harvester-lb import`: from Harvester's own objects, as `kubectl get …
//! -o json|yaml` prints them, to our TOML config.
//!
//! One module per source model (`v1beta1`, `v1alpha1`, and `service` for
//! the guest `Service`s and `Node`s of the v0.1.x cloud provider), all
//! mapping to one load-balancer model (`model`); `documents` reads the
//! text, `write` puts the result in place. This module reads only `config` types and does no I/O beyond the
//! files it is given and the one it writes; it never talks to a cluster or
//! to the daemon (the daemon's file watch picks the new file up).
//!
//! Nothing is dropped without a word: an object or a listener that cannot
//! be mapped is named on stderr with the reason (`--strict` makes that an
//! error). Each load balancer is validated on its own with the config's own
//! rules, so one bad object is skipped rather than blocking the others; the
//! whole file is validated again, since some rules span load balancers
//! (one VIP:port, one listener). The output depends only on the set of
//! objects, not their order: load balancers sorted by name, lists sorted.

mod common;
mod documents;
mod fields;
mod model;
mod service;
mod v1alpha1;
mod v1beta1;
mod write;

use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use crate::config::{self, Problem};

pub use documents::{DocumentError, MAX_INPUT_BYTES, Source};
pub use write::{WriteError, WriteOutcome, write_validated};

/// Exit code: the command line is wrong (sysexits' EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// Exit code: the input is not Kubernetes objects, or `--strict` found
/// something it could not import (EX_DATAERR).
pub const EXIT_DATA: u8 = 65;
/// Exit code: an input file cannot be read (EX_NOINPUT).
pub const EXIT_NO_INPUT: u8 = 66;
/// Exit code: `--write` could not create or rename its file (EX_CANTCREAT).
pub const EXIT_CANT_CREATE: u8 = 73;
/// Exit code: the result (or the `--base` file) is not a valid config;
/// nothing was written (EX_CONFIG, as `check`).
pub const EXIT_CONFIG: u8 = 78;

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
}

/// How the import is asked for.
#[derive(Debug, Clone, Default)]
pub struct Options {
    /// The guest cluster that `Service`s and `Node`s come from (`--cluster`).
    pub cluster: Option<String>,
    /// Config text written before the load balancers (`--base`): the
    /// `[admin]`, `[proxy]` and `[metrics]` settings of this host.
    pub base: Option<Source>,
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

/// The result of an import.
#[derive(Debug, Clone)]
pub struct Imported {
    /// The whole config file.
    pub text: String,
    /// Load balancers in it.
    pub load_balancers: usize,
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
    let mut results: Vec<(String, Result<Mapped, String>)> = Vec::new();
    let mut services = Vec::new();
    let mut other_services = 0usize;
    let mut nodes: Vec<IpAddr> = Vec::new();
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
            ("v1", "Node") => match service::node_addresses(obj) {
                Ok(addrs) => nodes.extend(addrs),
                Err(reason) => notes.push(format!("{}: {reason}", obj.describe())),
            },
            (_, kind) => skipped.push(Skip {
                object: obj.describe(),
                reason: format!(
                    "{} is not imported (LoadBalancer {} or {}, or v1 Service and Node)",
                    if kind.is_empty() {
                        "an object without kind"
                    } else {
                        "this kind"
                    },
                    v1beta1::API_VERSION,
                    v1alpha1::API_VERSION
                ),
            }),
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

    // Each load balancer alone against the config's rules.
    let mut by_name: BTreeMap<String, Vec<(String, model::Lb)>> = BTreeMap::new();
    let mut warnings = Vec::new();
    for (object, result) in results {
        let mut mapped = match result {
            Ok(m) => m,
            Err(reason) => {
                skipped.push(Skip { object, reason });
                continue;
            }
        };
        mapped.lb.normalise();
        notes.extend(mapped.notes.iter().map(|n| format!("{object}: {n}")));
        if mapped.lb.listeners.is_empty() {
            // One line for the object: what was left out is why nothing is left.
            let mut why = mapped.skipped_parts;
            why.push("no listener left that can be served: not imported".into());
            skipped.push(Skip {
                object,
                reason: why.join("; "),
            });
            continue;
        }
        for reason in mapped.skipped_parts {
            skipped.push(Skip {
                object: object.clone(),
                reason,
            });
        }
        let mut alone = String::new();
        mapped.lb.write_toml(&mut alone);
        match config::parse(&alone) {
            Ok(loaded) => {
                warnings.extend(
                    loaded
                        .warnings
                        .iter()
                        .map(|w| format!("{object}: {}", without_index(w))),
                );
                by_name
                    .entry(mapped.lb.name.clone())
                    .or_default()
                    .push((object, mapped.lb));
            }
            Err(problems) => skipped.push(Skip {
                object,
                reason: problems
                    .iter()
                    .map(without_index)
                    .collect::<Vec<_>>()
                    .join("; "),
            }),
        }
    }

    // One name, one load balancer: the same object seen twice (two files,
    // or in both versions) is one; different ones are both left out, since
    // neither can be chosen whatever the order.
    let mut lbs = Vec::new();
    for (name, group) in by_name {
        if group.iter().all(|(_, lb)| *lb == group[0].1) {
            lbs.push(group.into_iter().next().expect("non-empty group").1);
        } else {
            let objects: Vec<&str> = group.iter().map(|(o, _)| o.as_str()).collect();
            for (object, _) in &group {
                skipped.push(Skip {
                    object: object.clone(),
                    reason: format!(
                        "{} objects map to load balancer {name:?} differently ({}); none of them is imported",
                        group.len(),
                        objects.join("; ")
                    ),
                });
            }
        }
    }

    let text = render(sources, options, &lbs, objects.len(), skipped.len())?;
    if let Err(problems) = config::parse(&text) {
        return Err(ImportError::Invalid {
            problems: problems.iter().map(|p| with_lb_name(p, &lbs)).collect(),
        });
    }
    Ok(Imported {
        text,
        load_balancers: lbs.len(),
        skipped,
        notes,
        warnings,
    })
}

/// The file: header, the `--base` text, the load balancers.
fn render(
    sources: &[Source],
    options: &Options,
    lbs: &[model::Lb],
    objects: usize,
    skipped: usize,
) -> Result<String, ImportError> {
    let mut names: Vec<String> = sources
        .iter()
        .map(|s| model::comment_safe(&s.name))
        .collect();
    names.sort();
    names.dedup();
    let mut text = format!(
        "# Generated by `harvester-lb import` (harvester-lb {}) from {}.\n\
         # {} load balancer{} from {objects} object{}; {skipped} skipped (each named on stderr by the import).\n\
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

/// The arguments of `harvester-lb import`.
#[derive(Debug, Clone, Default)]
pub struct Args {
    /// Files to read; none or `-`: standard input.
    pub inputs: Vec<PathBuf>,
    /// `--cluster`.
    pub cluster: Option<String>,
    /// `--write PATH`; `None`: the config goes to stdout.
    pub write: Option<PathBuf>,
    /// `--strict`: anything not imported is an error and nothing is written.
    pub strict: bool,
    /// `--base PATH`.
    pub base: Option<PathBuf>,
}

/// Runs `harvester-lb import`: messages on stderr, the config on stdout or
/// in `--write`'s file; returns the exit code.
pub fn command(args: &Args) -> u8 {
    let mut sources = Vec::new();
    let inputs: Vec<&Path> = if args.inputs.is_empty() {
        vec![Path::new("-")]
    } else {
        args.inputs.iter().map(PathBuf::as_path).collect()
    };
    for path in inputs {
        match read_source(path) {
            Ok(s) => sources.push(s),
            Err((code, message)) => {
                eprintln!("harvester-lb import: {message}");
                return code;
            }
        }
    }
    let base = match args.base.as_deref().map(read_source).transpose() {
        Ok(b) => b,
        Err((code, message)) => {
            eprintln!("harvester-lb import: --base: {message}");
            return code;
        }
    };
    let options = Options {
        cluster: args.cluster.clone(),
        base,
    };
    let imported = match import(&sources, &options) {
        Ok(i) => i,
        Err(e) => {
            eprintln!("harvester-lb import: {e}");
            return match e {
                ImportError::Document(_) => EXIT_DATA,
                ImportError::NeedCluster { .. } => EXIT_USAGE,
                ImportError::Base { .. } | ImportError::Invalid { .. } => EXIT_CONFIG,
            };
        }
    };
    for note in &imported.notes {
        eprintln!("harvester-lb import: note: {note}");
    }
    for warning in &imported.warnings {
        eprintln!("harvester-lb import: warning: {warning}");
    }
    for skip in &imported.skipped {
        eprintln!("harvester-lb import: skipped {skip}");
    }
    if args.strict && !imported.skipped.is_empty() {
        eprintln!(
            "harvester-lb import: --strict: {} thing{} not imported (above); nothing written",
            imported.skipped.len(),
            if imported.skipped.len() == 1 { "" } else { "s" }
        );
        return EXIT_DATA;
    }
    let Some(target) = &args.write else {
        print!("{}", imported.text);
        return 0;
    };
    match write_validated(target, &imported.text) {
        Ok(WriteOutcome::Written) => {
            eprintln!(
                "harvester-lb import: wrote {} ({} load balancers)",
                target.display(),
                imported.load_balancers
            );
            0
        }
        Ok(WriteOutcome::Unchanged) => {
            eprintln!(
                "harvester-lb import: {} unchanged ({} load balancers)",
                target.display(),
                imported.load_balancers
            );
            0
        }
        Err(e) => {
            eprintln!("harvester-lb import: {e}");
            match e {
                WriteError::Invalid { .. } => EXIT_CONFIG,
                _ => EXIT_CANT_CREATE,
            }
        }
    }
}

/// Reads a file (or standard input for `-`) whole, at most
/// [`MAX_INPUT_BYTES`], as UTF-8; an error comes with its exit code. A path
/// must name a regular file ([`config::read_regular_file`], as the config
/// itself): a FIFO there would hang an import run by a timer for good; a
/// pipe is given as `-`.
fn read_source(path: &Path) -> Result<Source, (u8, String)> {
    let too_large = |name: &str| {
        (
            EXIT_DATA,
            format!("{name} is larger than {MAX_INPUT_BYTES} bytes; split the input"),
        )
    };
    let (name, bytes) = if path == Path::new("-") {
        let name = "standard input".to_string();
        let mut bytes = Vec::new();
        std::io::stdin()
            .lock()
            .take(MAX_INPUT_BYTES as u64 + 1)
            .read_to_end(&mut bytes)
            .map_err(|e| (EXIT_NO_INPUT, format!("cannot read {name}: {e}")))?;
        if bytes.len() > MAX_INPUT_BYTES {
            return Err(too_large(&name));
        }
        (name, bytes)
    } else {
        let name = path.display().to_string();
        let bytes = match config::read_regular_file(path, MAX_INPUT_BYTES as u64) {
            Ok(bytes) => bytes,
            Err(config::ReadError::Io(e)) => {
                return Err((EXIT_NO_INPUT, format!("cannot read {name}: {e}")));
            }
            Err(e @ config::ReadError::NotRegular(_)) => {
                return Err((
                    EXIT_NO_INPUT,
                    format!("{name} {e}; give a file, or `-` for standard input"),
                ));
            }
            Err(config::ReadError::TooLarge { .. }) => return Err(too_large(&name)),
        };
        (name, bytes)
    };
    let text = String::from_utf8(bytes).map_err(|e| {
        (
            EXIT_DATA,
            format!(
                "{name} is not UTF-8 text (first bad byte at offset {})",
                e.utf8_error().valid_up_to()
            ),
        )
    })?;
    Ok(Source { name, text })
}

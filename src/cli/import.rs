//! `harvester-lb import`'s command-line half: the arguments, reading the
//! input files (or standard input) and this host's interfaces, addresses
//! and routes, the removal guard of `--write`, what is said and the exit
//! code. The mapping from objects to a config, its validation and the
//! atomic write are the library's ([`harvester_lb::import`]).
//!
//! [`command`] says and `cli::import` prints: the outcome is a list of
//! messages and the config in the order they are printed, so a test can
//! check what would be printed without capturing stdout.

use std::io::Read;
use std::path::{Path, PathBuf};

use harvester_lb::config;
use harvester_lb::import::{
    self, Holders, ImportError, MAX_INPUT_BYTES, Options, Source, WriteError, WriteOutcome,
    write_validated,
};

/// Exit code: the config was printed or written (or left unchanged), but
/// some objects or listeners were skipped, each named on stderr. Not an
/// error (an object waiting for its address is skipped until it has one):
/// the shipped unit takes it as success (`SuccessExitStatus=3`).
pub const EXIT_SKIPPED: u8 = 3;
/// Exit code: the command line is wrong (sysexits' EX_USAGE).
pub const EXIT_USAGE: u8 = 64;
/// Exit code: the input is not Kubernetes objects, or `--strict` found
/// something it could not import (EX_DATAERR).
pub const EXIT_DATA: u8 = 65;
/// Exit code: an input file cannot be read (EX_NOINPUT).
pub const EXIT_NO_INPUT: u8 = 66;
/// Exit code: `--write` could not create or rename its file (EX_CANTCREAT).
pub const EXIT_CANT_CREATE: u8 = 73;
/// Exit code: `--write` would empty a non-empty config, or remove more
/// than half of its load balancers, without `--allow-removals`; nothing
/// was written (EX_NOPERM).
pub const EXIT_REMOVALS: u8 = 77;
/// Exit code: this host's addresses and routes cannot be read over
/// rtnetlink, so no VIP can be checked against them; nothing was written
/// (EX_OSERR).
pub const EXIT_HOST: u8 = 71;
/// Exit code: the result (or the `--base` file) is not a valid config;
/// nothing was written (EX_CONFIG, as `check`).
pub const EXIT_CONFIG: u8 = 78;

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
    /// `--allow-removals`: `--write` may empty the file or remove more than
    /// half of its load balancers.
    pub allow_removals: bool,
    /// `--allow-loopback`: see [`Options::allow_loopback`].
    pub allow_loopback: bool,
    /// `--network-interface NETWORK=INTERFACE`, as given: see
    /// [`Options::network_interfaces`].
    pub network_interfaces: Vec<String>,
    /// `--forwarding`: see [`Options::listeners`].
    pub forwarding: Option<String>,
    /// `--source-nat`: see [`Options::listeners`].
    pub source_nat: Option<String>,
}

/// One piece of what `harvester-lb import` prints, in order: a message for
/// stderr or the config for stdout. [`command`] returns them instead of
/// printing (so its tests read exactly what would be printed, in order);
/// [`super::import()`] prints each.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImportOutput {
    /// A line for stderr, after `harvester-lb import: `.
    Message(String),
    /// The config, for stdout (when there is no `--write`).
    Config(String),
}

/// What `harvester-lb import` did: what it says, in order, and its exit code.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    /// Messages and the printed config, in the order they are printed.
    pub output: Vec<ImportOutput>,
    /// The exit code (0, [`EXIT_SKIPPED`] or an error's).
    pub code: u8,
}

impl Outcome {
    fn say(&mut self, message: impl Into<String>) {
        self.output.push(ImportOutput::Message(message.into()));
    }

    fn exit(mut self, code: u8) -> Self {
        self.code = code;
        self
    }
}

/// Runs `harvester-lb import`: reads the inputs, imports, and writes
/// `--write`'s file; returns what to say (messages for stderr, the config
/// for stdout when not written) and the exit code.
pub fn command(args: &Args) -> Outcome {
    let mut out = Outcome::default();
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
                out.say(message);
                return out.exit(code);
            }
        }
    }
    let base = match args.base.as_deref().map(read_source).transpose() {
        Ok(b) => b,
        Err((code, message)) => {
            out.say(format!("--base: {message}"));
            return out.exit(code);
        }
    };
    let holders = args
        .write
        .as_deref()
        .map(Holders::of_file)
        .unwrap_or_default();
    let network_interfaces = match import::parse_network_interfaces(&args.network_interfaces) {
        Ok(m) => m,
        Err(message) => {
            out.say(message.to_string());
            return out.exit(EXIT_USAGE);
        }
    };
    let interfaces = match harvester_lb::host::vip_guard::interface_names_blocking() {
        Ok(names) => names,
        Err(e) => {
            out.say(format!(
                "cannot read this host's interfaces ({e}); a load balancer on a VM network must be on one of them, so nothing is imported unchecked"
            ));
            return out.exit(EXIT_HOST);
        }
    };
    let host = match harvester_lb::host::vip_guard::HostNet::read_blocking() {
        Ok(h) => h,
        Err(e) => {
            out.say(format!(
                "cannot read this host's addresses and routes ({e}); a VIP must not be one of them, so nothing is imported unchecked"
            ));
            return out.exit(EXIT_HOST);
        }
    };
    let options = Options {
        cluster: args.cluster.clone(),
        base,
        allow_loopback: args.allow_loopback,
        holders,
        host: Some(host),
        network_interfaces,
        interfaces: Some(interfaces),
        listeners: import::ListenerChoice {
            forwarding: args.forwarding.clone(),
            source_nat: args.source_nat.clone(),
        },
    };
    let imported = match import::import(&sources, &options) {
        Ok(i) => i,
        Err(e) => {
            out.say(e.to_string());
            return out.exit(match e {
                ImportError::Document(_) => EXIT_DATA,
                ImportError::NeedCluster { .. } => EXIT_USAGE,
                ImportError::Base { .. } | ImportError::Invalid { .. } => EXIT_CONFIG,
            });
        }
    };
    for note in &imported.notes {
        out.say(format!("note: {note}"));
    }
    for warning in &imported.warnings {
        out.say(format!("warning: {warning}"));
    }
    // The timer runs this every minute: skips already named when the
    // file was written (its header records their fingerprint) are said in
    // one line, each again only when they change (or without --write).
    let said_before = !args.strict
        && args.write.as_deref().and_then(import::recorded_skips)
            == import::skips_fingerprint(&imported.skipped)
        && !imported.skipped.is_empty();
    if said_before {
        out.say(format!(
            "the same {} skipped as when {} was written (each named then; `harvester-lb import` without --write names them again)",
            imported.skipped.len(),
            args.write.as_deref().unwrap_or(Path::new("-")).display()
        ));
    } else {
        for skip in &imported.skipped {
            out.say(format!("skipped {skip}"));
        }
    }
    if args.strict && !imported.skipped.is_empty() {
        out.say(format!(
            "--strict: {} thing{} not imported (above); nothing written",
            imported.skipped.len(),
            if imported.skipped.len() == 1 { "" } else { "s" }
        ));
        return out.exit(EXIT_DATA);
    }
    let summary = format!(
        "{}; {} skipped{}",
        harvester_lb::text::count(imported.load_balancers, "load balancer", "load balancers"),
        imported.skipped.len(),
        if imported.skipped.is_empty() {
            ""
        } else if said_before {
            ", the same as before"
        } else {
            ", each named above"
        }
    );
    let done = if imported.skipped.is_empty() {
        0
    } else {
        EXIT_SKIPPED
    };
    let Some(target) = &args.write else {
        out.output.push(ImportOutput::Config(imported.text));
        out.say(format!("printed ({summary})"));
        return out.exit(done);
    };
    if !args.allow_removals
        && let Some(old) = import::existing_names(target)
        && let Some(why) = import::removals(&old, &imported.names)
    {
        out.say(format!(
            "{why}; {} was not changed. A controller or input mistake must not take every VIP down: check the input, and run again with --allow-removals if this is meant",
            target.display()
        ));
        return out.exit(EXIT_REMOVALS);
    }
    match write_validated(target, &imported.text) {
        Ok(WriteOutcome::Written) => {
            out.say(format!("wrote {} ({summary})", target.display()));
            out.exit(done)
        }
        Ok(WriteOutcome::Unchanged) => {
            out.say(format!("{} unchanged ({summary})", target.display()));
            out.exit(done)
        }
        Err(e) => {
            out.say(e.to_string());
            out.exit(match e {
                WriteError::Invalid { .. } => EXIT_CONFIG,
                _ => EXIT_CANT_CREATE,
            })
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

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory of this test's own, removed when dropped.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            let dir = std::env::temp_dir().join(format!(
                "harvester-lb-cli-import-{}-{name}",
                std::process::id()
            ));
            std::fs::create_dir_all(&dir).expect("temp dir");
            Self(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    /// `command` says; it prints nothing: the config once, before the
    /// summary, each skip named before it, and the exit code that says so.
    #[test]
    fn command_says_the_config_once_and_the_summary_last() {
        let dir = TempDir::new("says");
        let input = dir.0.join("objects.json");
        std::fs::write(
            &input,
            r#"{"apiVersion":"v1","kind":"List","items":[
                {"apiVersion":"loadbalancer.harvesterhci.io/v1beta1","kind":"LoadBalancer","metadata":{"name":"web","namespace":"ns"},"spec":{"listeners":[{"name":"http","port":80,"protocol":"TCP","backendPort":30080}]},"status":{"allocatedAddress":{"ip":"127.0.9.101"},"backendServers":["127.0.9.1"]}},
                {"apiVersion":"v1","kind":"ConfigMap","metadata":{"name":"other","namespace":"ns"}}
            ]}"#,
        )
        .expect("write input");
        let outcome = command(&Args {
            inputs: vec![input],
            allow_loopback: true,
            ..Args::default()
        });
        let configs: Vec<&String> = outcome
            .output
            .iter()
            .filter_map(|s| match s {
                ImportOutput::Config(text) => Some(text),
                ImportOutput::Message(_) => None,
            })
            .collect();
        assert_eq!(configs.len(), 1, "{:?}", outcome.output);
        assert!(configs[0].contains("name = \"ns/web\""), "{}", configs[0]);
        assert!(
            outcome.output.iter().any(
                |s| matches!(s, ImportOutput::Message(m) if m.starts_with("skipped ") && m.contains("ConfigMap ns/other"))
            ),
            "{:?}",
            outcome.output
        );
        assert!(
            matches!(outcome.output.last(), Some(ImportOutput::Message(m)) if m == "printed (1 load balancer; 1 skipped, each named above)"),
            "{:?}",
            outcome.output
        );
        assert_eq!(outcome.code, EXIT_SKIPPED);
    }

    /// The import timer runs `--write` every minute: a skip is named by
    /// the run that first finds it, later runs finding the same skips say
    /// so in one line (not each skip again, every minute), and a change of
    /// what is skipped names each again. Before, every run named each.
    #[test]
    fn write_names_the_same_skips_once_per_change() {
        let dir = TempDir::new("skips-once");
        let input = dir.0.join("objects.json");
        let objects = |skipped: &str| {
            format!(
                r#"{{"apiVersion":"v1","kind":"List","items":[
                {{"apiVersion":"loadbalancer.harvesterhci.io/v1beta1","kind":"LoadBalancer","metadata":{{"name":"web","namespace":"ns"}},"spec":{{"listeners":[{{"name":"http","port":80,"protocol":"TCP","backendPort":30080}}]}},"status":{{"allocatedAddress":{{"ip":"127.0.9.101"}},"backendServers":["127.0.9.1"]}}}},
                {{"apiVersion":"v1","kind":"ConfigMap","metadata":{{"name":"{skipped}","namespace":"ns"}}}}
            ]}}"#
            )
        };
        let target = dir.0.join("config.toml");
        let run = |text: &str| {
            std::fs::write(&input, text).expect("write input");
            command(&Args {
                inputs: vec![input.clone()],
                write: Some(target.clone()),
                allow_loopback: true,
                ..Args::default()
            })
        };
        let named = |outcome: &Outcome| -> Vec<String> {
            outcome
                .output
                .iter()
                .filter_map(|s| match s {
                    ImportOutput::Message(m) if m.starts_with("skipped ") => Some(m.clone()),
                    _ => None,
                })
                .collect()
        };
        let last = |outcome: &Outcome| match outcome.output.last() {
            Some(ImportOutput::Message(m)) => m.clone(),
            other => panic!("{other:?}"),
        };

        let first = run(&objects("other"));
        assert_eq!(first.code, EXIT_SKIPPED, "{:?}", first.output);
        assert_eq!(named(&first).len(), 1, "{:?}", first.output);
        assert!(last(&first).starts_with("wrote "), "{:?}", first.output);

        let again = run(&objects("other"));
        assert_eq!(again.code, EXIT_SKIPPED, "{:?}", again.output);
        assert!(named(&again).is_empty(), "named again: {:?}", again.output);
        assert!(
            again
                .output
                .iter()
                .any(|s| matches!(s, ImportOutput::Message(m)
                if m.starts_with("the same 1 skipped as when ") && m.contains("was written"))),
            "{:?}",
            again.output
        );
        assert!(
            last(&again).ends_with("unchanged (1 load balancer; 1 skipped, the same as before)"),
            "{:?}",
            again.output
        );

        let changed = run(&objects("another"));
        let names = named(&changed);
        assert!(
            names.len() == 1 && names[0].contains("ConfigMap ns/another"),
            "{:?}",
            changed.output
        );
        assert!(last(&changed).starts_with("wrote "), "{:?}", changed.output);

        // Printing (no --write) names every skip, always.
        let printed = command(&Args {
            inputs: vec![input.clone()],
            allow_loopback: true,
            ..Args::default()
        });
        assert_eq!(named(&printed).len(), 1, "{:?}", printed.output);
    }

    /// An input that cannot be read ends the command with EX_NOINPUT and
    /// one message naming the file; nothing else is said.
    #[test]
    fn a_missing_input_is_no_input_and_named() {
        let dir = TempDir::new("missing");
        let missing = dir.0.join("absent.json");
        let outcome = command(&Args {
            inputs: vec![missing.clone()],
            ..Args::default()
        });
        assert_eq!(outcome.code, EXIT_NO_INPUT);
        match outcome.output.as_slice() {
            [ImportOutput::Message(m)] => assert!(
                m.starts_with(&format!("cannot read {}", missing.display())),
                "{m}"
            ),
            other => panic!("{other:?}"),
        }
    }
}

//! One verdict for a file, wherever it is read: `harvester-lb check`, the
//! daemon's start (`harvester-lb run`) and a reload refuse the same files
//! with the same problems. Start and reload read the file through
//! `config::Loader`, which reads a file one `[[load_balancer]]` table at a
//! time; a check that spans sections once lived in the full read only, so
//! `run` started with a file `check` refused (issue 40, defect 5).
//!
//! [`cases`] holds refusals of every validator (`src/config/validate/*.rs`,
//! each named by its module; [`every_validator_has_a_refusal_here`] fails
//! when a new validator module has none). The daemon runs in a network
//! namespace of its own only to contain what a wrongly started daemon would
//! do (routes, nftables tables); nothing here sends a packet, so the bed
//! leaves out the Harvester host's bridge and `br_netfilter`.

// The namespace helpers time their deadlines on the wall clock.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;
use crate::support;

use std::net::SocketAddr;
use std::path::Path;
use std::time::Duration;

use harvester_lb::config::{self, Loader, Problem};
use support::{Config, Lb, Listener, http_unix, keepalived, network};

/// One refusal: the validator module that gives it, what is wrong, the file.
struct Case {
    validator: &'static str,
    what: &'static str,
    text: String,
}

/// A valid load balancer on 198.51.100.10:80 (`name`), then `more` lines of
/// the table; listener keys follow as `listener`.
fn lb(name: &str, vip: &str, more: &str, listener: &str) -> String {
    Lb::new(name, vip)
        .backends(["198.51.100.21"])
        .keys(more)
        .listener(Listener::new("http", 80, 30080).keys(listener))
        .to_string()
}

/// `[admin]` with the admin socket in `dir` (beds share the file system).
fn admin(dir: &Path) -> String {
    Config::new()
        .admin(SocketAddr::from(([127, 0, 0, 1], netns::ADMIN_PORT)))
        .socket(&dir.join("admin.sock"))
        .to_string()
}

/// `[conntrackd]` of the anycast mode with every file it names in `dir`.
fn conntrackd(dir: &Path, more: &str) -> String {
    support::conntrackd(
        dir,
        "one",
        &format!(
            "interface = \"eth0\"\naddress = \"198.51.100.3\"\npeer = \"198.51.100.4\"\n{more}\n"
        ),
    ) + "\n"
}

const ANYCAST: &str = "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"198.51.100.0/24\"]\n\n";
const KERNEL_VIP_NAT: &str = "  forwarding = \"kernel\"\n  source_nat = \"vip\"\n";

/// The valid file the reload tests start from.
fn base(dir: &Path) -> String {
    format!(
        "{}{}{}",
        admin(dir),
        lb("default/web", "198.51.100.10", "", ""),
        lb("default/db", "198.51.100.11", "", "")
    )
}

/// Refusals of every validator, each a whole file (with `admin(dir)`).
fn cases(dir: &Path) -> Vec<Case> {
    let web = |more: &str, listener: &str| lb("default/web", "198.51.100.10", more, listener);
    let ka = keepalived(
        "lb-1",
        "192.168.0.11",
        ["192.168.0.12"],
        &dir.join("ka"),
        "",
    );
    let on_net = |vip: &str| lb("default/vm", vip, "network = \"default/a\"", "");
    let body = [
        (
            "mod",
            "proxy.backlog out of range",
            format!("[proxy]\nbacklog = 0\n\n{}", web("", "")),
        ),
        (
            "mod",
            "a multicast VIP",
            lb("default/web", "224.0.0.1", "", ""),
        ),
        (
            "mod",
            "a listener port out of range",
            web("", "").replace("port = 80", "port = 70000"),
        ),
        ("mod", "an unknown key", web("colour = \"red\"", "")),
        (
            "keepalived",
            "a keepalived peer that is this host's own address",
            format!(
                "{}{}",
                keepalived(
                    "lb-1",
                    "192.168.0.11",
                    ["192.168.0.11"],
                    &dir.join("ka"),
                    ""
                ),
                web("", "")
            ),
        ),
        (
            "load_balancer",
            "a backend listed twice",
            web("", "").replace(
                "[\"198.51.100.21\"]",
                "[\"198.51.100.21\", \"198.51.100.21\"]",
            ),
        ),
        (
            "types",
            "a port of the wrong type",
            web("", "").replace("port = 80", "port = \"eighty\""),
        ),
        (
            "names",
            "a control character in a name",
            web("", "").replace("\"default/web\"", "\"default/\\u0007web\""),
        ),
        (
            "health",
            "an HTTP check's status out of range",
            web(
                "  [load_balancer.health_check]\n  port = 30080\n  kind = \"http\"\n  expect_status = [42]",
                "",
            ),
        ),
        (
            "source_ranges",
            "a source range with host bits",
            web("source_ranges = [\"10.0.0.1/8\"]", ""),
        ),
        (
            "dhcp",
            "a lease MAC that is no MAC",
            web(
                "ipam = \"dhcp\"\n  [load_balancer.dhcp]\n  interface = \"eth0\"\n  mac = \"zz\"",
                "",
            ),
        ),
        (
            "kernel",
            "a PROXY header on a kernel listener",
            web("", "  forwarding = \"kernel\"\n  proxy_protocol = \"v1\"\n"),
        ),
        (
            "kernel",
            "source_nat = \"vip\" on an anycast VIP without [conntrackd]",
            format!(
                "{ANYCAST}{}",
                web("algorithm = \"flow_hash\"", KERNEL_VIP_NAT)
            ),
        ),
        (
            "announce",
            "ipam = \"dhcp\" with vip.announce = \"routes\"",
            format!("{ANYCAST}{}", web("ipam = \"dhcp\"", "")),
        ),
        (
            "announce",
            "announce_prefixes covering everything",
            format!(
                "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"0.0.0.0/0\"]\n\n{}",
                web("", "")
            ),
        ),
        (
            "cross",
            "two load balancers with one name",
            format!(
                "{}{}",
                web("", ""),
                lb("default/web", "198.51.100.11", "", "")
            ),
        ),
        (
            "cross",
            "one VIP:port twice",
            format!(
                "{}{}",
                web("", ""),
                lb("default/other", "198.51.100.10", "", "")
            ),
        ),
        (
            "cross",
            "a backend that is admin.listen",
            lb("default/web", "198.51.100.10", "", "")
                .replace("\"198.51.100.21\"", "\"127.0.0.1\"")
                .replace(
                    "backend_port = 30080",
                    &format!("backend_port = {}", netns::ADMIN_PORT),
                ),
        ),
        (
            "sync",
            "[conntrackd] with neither [keepalived] nor announcing",
            format!("{}{}", conntrackd(dir, ""), web("", KERNEL_VIP_NAT)),
        ),
        (
            "sync",
            "a conntrackd hash_size below the floor",
            format!(
                "{ANYCAST}{}{}",
                conntrackd(dir, "hash_size = 16"),
                web("algorithm = \"flow_hash\"", KERNEL_VIP_NAT)
            ),
        ),
        (
            "hosts",
            "a VIP that is conntrackd.peer, the other anycast host",
            format!(
                "{ANYCAST}{}{}",
                conntrackd(dir, ""),
                lb(
                    "default/web",
                    "198.51.100.4",
                    "algorithm = \"flow_hash\"",
                    KERNEL_VIP_NAT
                )
            ),
        ),
        (
            "hosts",
            "a VIP that is a keepalived peer",
            format!("{ka}{}", lb("default/web", "192.168.0.12", "", "")),
        ),
        (
            "vmnet",
            "a load balancer on an unknown network",
            web("network = \"default/nope\"", ""),
        ),
        (
            "vmnet",
            "a VIP that is its network's gateway",
            format!(
                "{ka}{}{}",
                network("default/a", "cluster-br", "10.100.0.1", ""),
                on_net("10.100.0.1")
            ),
        ),
        (
            "vmnet_isolate",
            "an isolated network on keepalived's interface",
            format!(
                "{ka}{}{}",
                network("default/a", "mgmt", "10.100.0.1", "isolate = true"),
                on_net("10.100.0.10")
            ),
        ),
    ];
    body.into_iter()
        .map(|(validator, what, text)| Case {
            validator,
            what,
            text: format!("{}{text}", admin(dir)),
        })
        .collect()
}

/// The problems `check` gives, as it prints them.
fn rendered(problems: &[Problem]) -> Vec<String> {
    problems.iter().map(ToString::to_string).collect()
}

/// Every line of `want` is in `text`.
fn says_all(text: &str, want: &[String]) -> bool {
    want.iter().all(|w| text.contains(w.as_str()))
}

#[test]
fn every_validator_has_a_refusal_here() {
    let dir = std::env::temp_dir();
    let named: Vec<&str> = cases(&dir).iter().map(|c| c.validator).collect();
    let modules = std::fs::read_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/src/config/validate"))
        .expect("read src/config/validate");
    let mut seen = 0;
    for entry in modules {
        let name = entry.expect("a directory entry").file_name();
        let Some(module) = name.to_str().and_then(|n| n.strip_suffix(".rs")) else {
            continue;
        };
        seen += 1;
        // Not validators: where a problem is (`locate`), what it suggests
        // (`suggest`: the "did you mean" of other validators' problems),
        // how the reload reads a file (`reuse`, held to the full read's
        // verdict below).
        if matches!(module, "locate" | "suggest" | "reuse") {
            continue;
        }
        assert!(
            named.contains(&module),
            "validator module {module}.rs has no refusal in tests/it/one_verdict.rs's cases(): add one, so start and reload are held to check's verdict on it"
        );
    }
    assert!(seen > 10, "read {seen} modules of src/config/validate");
}

/// The reads `run` and a reload make (`Loader`, fresh and after a valid
/// file) refuse each case with exactly `check`'s problems, and `check`
/// exits 78 naming them.
#[test]
fn check_and_the_daemons_reads_refuse_every_case_alike() {
    let dir = std::env::temp_dir();
    let file = dir.join(format!("one-verdict-{}.toml", std::process::id()));
    let mut primed = Loader::new();
    primed.parse(&base(&dir)).expect("the base file is valid");
    let mut failed = Vec::new();
    for case in cases(&dir) {
        let label = format!("{} ({})", case.what, case.validator);
        let problems = match config::parse(&case.text) {
            Ok(_) => panic!("{label}: check accepts it:\n{}", case.text),
            Err(p) => p,
        };
        for (how, got) in [
            ("a start (fresh loader)", Loader::new().parse(&case.text)),
            (
                "a reload (loader after a valid file)",
                primed.parse(&case.text),
            ),
        ] {
            match got {
                Ok(_) => failed.push(format!("{label}: {how} accepts it")),
                Err(p) if p != problems => failed.push(format!(
                    "{label}: {how} refuses it with {p:?}, check with {problems:?}"
                )),
                Err(_) => {}
            }
        }
        std::fs::write(&file, &case.text).expect("write the case");
        let (code, _, stderr) = support::run_cli(&["check", "--config", file.to_str().unwrap()]);
        assert_eq!(code, 78, "{label}: check exit code; stderr:\n{stderr}");
        assert!(
            says_all(&stderr, &rendered(&problems)),
            "{label}: check's message misses a problem:\n{stderr}"
        );
    }
    let _ = std::fs::remove_file(&file);
    assert!(failed.is_empty(), "{}", failed.join("\n"));
}

/// What of `/status` a reload changes: each load balancer's name, VIP,
/// algorithm and listeners (not its live counters).
fn in_force(status: &serde_json::Value) -> Vec<String> {
    let lbs = status["load_balancers"]
        .as_array()
        .cloned()
        .unwrap_or_default();
    lbs.iter()
        .map(|lb| {
            format!(
                "{} {} {} {}",
                lb["name"],
                lb["vip"],
                lb["algorithm"],
                lb["listeners"].as_array().map_or(0, Vec::len)
            )
        })
        .collect()
}

/// The real daemon: `run` exits 78 with check's problems on each case, and a
/// running daemon refuses each on reload (422 with the problems) and keeps
/// its load balancers.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn run_and_reload_refuse_what_check_refuses() {
    require_netns!();
    let mut bed = netns::Bed::new("one-verdict", 1);
    let dir = bed.dir.clone();
    let cases = cases(&dir);
    assert!(cases.len() > 10);
    let mut failed = Vec::new();
    for case in &cases {
        let label = format!("{} ({})", case.what, case.validator);
        let want = rendered(&config::parse(&case.text).expect_err("check refuses it"));
        let path = bed.write("run.toml", &case.text);
        let log = dir.join("run.log");
        let mut d = netns::DaemonProc::spawn(&bed.lb, &path, &log, None);
        match d.wait_exit(Duration::from_secs(30)).await {
            Some(status) if status.code() == Some(78) => {
                if !says_all(&d.log(), &want) {
                    failed.push(format!("{label}: run's log misses a problem:\n{}", d.log()));
                }
            }
            Some(status) => failed.push(format!(
                "{label}: run exited with {status}, not 78:\n{}",
                d.log_tail(20)
            )),
            None => failed.push(format!(
                "{label}: run started with a file check refuses:\n{}",
                d.log_tail(20)
            )),
        }
        drop(d); // Kills it if it is still running.
    }

    bed.start_daemon(&base(&dir)).await;
    let socket = dir.join("admin.sock");
    let before = in_force(&bed.daemon().status().await);
    assert_eq!(
        before.len(),
        2,
        "the base file's load balancers: {before:?}"
    );
    for case in &cases {
        let label = format!("{} ({})", case.what, case.validator);
        let want = rendered(&config::parse(&case.text).expect_err("check refuses it"));
        bed.write("config.toml", &case.text);
        let (code, body) = http_unix(&socket, "POST", "/reload", "").await;
        if code != 422 || !says_all(&body, &want) {
            failed.push(format!("{label}: reload answered {code}:\n{body}"));
        }
        let now = in_force(&bed.daemon().status().await);
        if now != before {
            failed.push(format!(
                "{label}: the running load balancers changed: {now:?}"
            ));
            // Back to the base, so the next case starts from it.
            bed.write("config.toml", &base(&dir));
            http_unix(&socket, "POST", "/reload", "").await;
        }
    }
    assert!(failed.is_empty(), "{}", failed.join("\n\n"));
}

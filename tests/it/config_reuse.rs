//! A reload reads only the `[[load_balancer]]` tables that changed
//! (`config::Loader`). These tests hold it to one rule: whatever the file,
//! its verdict (the config, the warnings, or every problem with its line
//! and key) is exactly the full read's, whether the loader has seen a
//! similar file before or not.

use crate::support;

use harvester_lb::config::{self, Loaded, Loader, Problem};
use support::Rng;

/// `n` load balancers as a controller writes them.
fn file(n: usize) -> String {
    let mut s = String::from("[admin]\nlisten = \"127.0.0.1:0\"\n\n[proxy]\nbacklog = 128\n\n");
    for i in 0..n {
        s.push_str(&lb(i, &format!("127.10.0.{}", i + 1)));
    }
    s
}

fn lb(i: usize, backend: &str) -> String {
    format!(
        "[[load_balancer]]\nname = \"ns/svc-{i}\"\ncluster = \"guest\"\nvip = \"127.20.0.{}\"\nbackends = [\"{backend}\", \"127.11.0.1\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 8080\n  backend_port = 30080\n  [load_balancer.health_check]\n  port = 30080\n\n",
        i + 1
    )
}

/// What a read concluded, in a form that compares.
fn verdict(
    r: Result<Loaded, Vec<Problem>>,
) -> Result<(config::Config, Vec<Problem>), Vec<Problem>> {
    r.map(|l| (l.config, l.warnings))
}

/// Asserts the loader's verdict on `text` is the full read's; returns how
/// many load balancers it reused.
fn same_verdict(loader: &mut Loader, text: &str) -> usize {
    let full = verdict(config::parse(text));
    let reading = loader.parse(text);
    let reused = reading.as_ref().map_or(0, |l| l.reused);
    let piecewise = verdict(reading);
    assert_eq!(
        piecewise, full,
        "the loader disagrees with the full read on:\n{text}"
    );
    let fresh = verdict(Loader::new().parse(text));
    assert_eq!(
        fresh, full,
        "a fresh loader disagrees with the full read on:\n{text}"
    );
    reused
}

#[test]
fn unchanged_tables_are_reused_and_changed_ones_read_again() {
    let mut loader = Loader::new();
    let base = file(50);
    assert_eq!(same_verdict(&mut loader, &base), 0, "nothing to reuse yet");
    assert_eq!(loader.remembered(), 50);
    assert_eq!(same_verdict(&mut loader, &base), 50);

    // One backend of one load balancer changes: that table alone is read.
    let changed = base.replace(&lb(7, "127.10.0.8"), &lb(7, "127.12.0.8"));
    assert_ne!(changed, base);
    assert_eq!(same_verdict(&mut loader, &changed), 49);

    // A removed table is forgotten; an added one read.
    let removed = changed.replace(&lb(3, "127.10.0.4"), "");
    assert_eq!(same_verdict(&mut loader, &removed), 49);
    assert_eq!(loader.remembered(), 49);
    let added = format!("{removed}{}", lb(77, "127.10.0.78"));
    assert_eq!(same_verdict(&mut loader, &added), 49);
    assert_eq!(loader.remembered(), 50);
}

#[test]
fn conflicts_with_unchanged_tables_are_found_as_a_full_read_finds_them() {
    let mut loader = Loader::new();
    let base = file(5);
    same_verdict(&mut loader, &base);
    // A new table reusing a name, a VIP:port, or pointing at a VIP:port.
    let dup_name = format!(
        "{base}{}",
        lb(2, "127.10.0.99").replace("127.20.0.3", "127.20.0.99")
    );
    let dup_addr = format!(
        "{base}{}",
        lb(9, "127.10.0.99").replace("127.20.0.10", "127.20.0.1")
    );
    let looping = format!(
        "{base}{}",
        lb(9, "127.10.0.99")
            .replace("backend_port = 30080", "backend_port = 8080")
            .replace("\"127.10.0.99\"", "\"127.20.0.2\"")
    );
    // The tables unchanged, admin.listen moved onto one's VIP:port, or
    // onto a backend's nodeport: the piecewise read must see it too.
    let admin_on_vip = base.replace("127.0.0.1:0", "127.20.0.2:8080");
    let admin_on_backend = base.replace("127.0.0.1:0", "127.10.0.1:30080");
    for text in [dup_name, dup_addr, looping, admin_on_vip, admin_on_backend] {
        let verdict = verdict(loader.parse(&text));
        assert!(verdict.is_err(), "accepted:\n{text}");
        same_verdict(&mut loader, &text);
    }
    // A broken file leaves what the loader remembers as it was.
    assert_eq!(same_verdict(&mut loader, &base), 5);
}

#[test]
fn warnings_are_told_at_every_read_with_their_line() {
    let mut loader = Loader::new();
    let text = format!(
        "{}[[load_balancer]]\nname = \"ns/empty\"\nvip = \"127.20.1.1\"\n",
        file(3)
    );
    for _ in 0..3 {
        same_verdict(&mut loader, &text);
        let loaded = loader.parse(&text).expect("valid");
        assert_eq!(loaded.warnings.len(), 2, "{:?}", loaded.warnings);
        assert_eq!(
            loaded.reused, 3,
            "the table with warnings is read each time"
        );
        let line = text
            .lines()
            .position(|l| l == "name = \"ns/empty\"")
            .unwrap();
        assert_eq!(loaded.warnings[0].line, Some(line), "{:?}", loaded.warnings);
        assert!(loaded.warnings[0].key.starts_with("load_balancer[3]"));
    }
}

#[test]
fn files_the_cut_does_not_fit_are_read_in_full() {
    let mut loader = Loader::new();
    let base = file(3);
    same_verdict(&mut loader, &base);
    let cases = [
        // Settings after the load balancers.
        format!("{base}[proxy]\nmax_connections = 10\n"),
        format!(
            "{}\n[metrics]\nper_backend_health_check_duration = true\n",
            file(2)
        ),
        // A header line inside a multi-line string and inside an array.
        base.replacen(
            "cluster = \"guest\"",
            "cluster = \"\"\"guest\n[[load_balancer]]\n\"\"\"",
            1,
        ),
        base.replacen(
            "backends = [\"127.10.0.1\", \"127.11.0.1\"]",
            "backends = [\"127.10.0.1\",\n[[load_balancer]]\n\"127.11.0.1\"]",
            1,
        ),
        // Headers written differently, CRLF line ends, comments.
        base.replace("[[load_balancer]]\n", "  [[load_balancer]]   # a service\n"),
        base.replace("[[load_balancer]]\n", "[[ load_balancer ]]\n"),
        base.replace('\n', "\r\n"),
        format!("# generated\n{base}# end\n"),
        // The settings spelled as dotted keys or inline, and the array written inline.
        format!(
            "proxy.backlog = 64\n{}",
            base.replace("[proxy]\nbacklog = 128\n", "")
        ),
        "load_balancer = []\n".to_string(),
        format!("load_balancer = []\n{base}"),
        // Unknown keys, type errors, syntax errors in one table.
        base.replacen("cluster = \"guest\"", "clustr = \"guest\"", 2),
        base.replacen("port = 8080", "port = \"8080\"", 2),
        base.replacen("name = \"ns/svc-1\"", "name = \"ns/svc-1", 1),
        base.replacen("[admin]", "[admin", 1),
        // Empty and comment-only files.
        String::new(),
        "# nothing\n".to_string(),
    ];
    for text in &cases {
        same_verdict(&mut loader, text);
        // And back: whatever happened, the loader still agrees.
        same_verdict(&mut loader, &base);
    }
}

#[test]
fn random_edits_of_a_file_never_change_the_verdict() {
    const SNIPPETS: &[&str] = &[
        "[[load_balancer]]",
        "[[load_balancer.listener]]",
        "[load_balancer.health_check]",
        "[proxy]",
        "name = \"ns/svc-1\"",
        "vip = \"127.20.0.1\"",
        "backends = []",
        "port = 8080",
        "backend_port = 8080",
        "\"\"\"",
        "x = [",
        "]",
        "# comment",
        "",
        // Type errors, each now read piece by piece in the full read.
        "port = 80.0",
        "backends = [\"127.10.0.1\", 7]",
        "name = 5",
        "load_balancer = 1",
    ];
    let base = file(6);
    let base_lines: Vec<&str> = base.lines().collect();
    let mut loader = Loader::new();
    same_verdict(&mut loader, &base);
    let mut valid = 0;
    for seed in 1..=400u64 {
        let mut rng = Rng::new(seed.wrapping_mul(0x9E37_79B9_7F4A_7C15));
        let mut lines: Vec<String> = base_lines.iter().map(|l| l.to_string()).collect();
        for _ in 0..1 + rng.below(3) {
            let at = rng.below(lines.len());
            match rng.below(4) {
                0 => {
                    lines.remove(at);
                }
                1 => lines.insert(at, SNIPPETS[rng.below(SNIPPETS.len())].to_string()),
                2 => {
                    let other = rng.below(lines.len());
                    lines.swap(at, other);
                }
                _ => {
                    let copy = lines[at].clone();
                    lines.insert(rng.below(lines.len()), copy);
                }
            }
        }
        let text = lines.join("\n");
        if config::parse(&text).is_ok() {
            valid += 1;
        }
        same_verdict(&mut loader, &text);
        // Now and then go back, so that some edits meet a warm loader.
        if seed % 3 == 0 {
            same_verdict(&mut loader, &base);
        }
    }
    // The edits must reach both sides of the verdict for this to prove anything.
    assert!(valid > 20, "only {valid} of 400 edited files were valid");
    assert!(valid < 380, "{valid} of 400 edited files were valid");
}

/// `n` anycast load balancers (`vip.announce = "routes"`), each with a
/// kernel listener of `source_nat`, and `more` sections after `[vip]`.
fn anycast(n: usize, source_nat: &str, more: &str) -> String {
    let mut s = format!(
        "[admin]\nlisten = \"127.0.0.1:0\"\n\n[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"198.18.0.0/15\"]\n\n{more}"
    );
    for i in 0..n {
        s.push_str(&format!(
            "[[load_balancer]]\nname = \"ns/svc-{i}\"\nvip = \"198.18.{}.{}\"\nalgorithm = \"flow_hash\"\nbackends = [\"127.10.0.1\", \"127.11.0.1\"]\n  [[load_balancer.listener]]\n  name = \"pg\"\n  port = 5432\n  backend_port = 30432\n  forwarding = \"kernel\"\n  source_nat = \"{source_nat}\"\n\n",
            i / 250,
            i % 250 + 1
        ));
    }
    s
}

const SYNC: &str =
    "[conntrackd]\ninterface = \"eth1\"\naddress = \"10.99.0.1\"\npeer = \"10.99.0.2\"\n\n";

/// The checks across sections (an anycast VIP against `[conntrackd]`) give
/// the full read's verdict at start and at reload, and a file they find
/// nothing in is still read piecewise (issue 40: `run` started with
/// `source_nat = "vip"` on an anycast VIP and no `[conntrackd]`, which
/// `check` refuses, and warned at every start of a synced file that
/// conntrackd syncs nothing).
#[test]
fn checks_across_sections_give_the_full_reads_verdict() {
    let mut loader = Loader::new();
    let refused = anycast(20, "vip", "");
    assert!(config::parse(&refused).is_err());
    same_verdict(&mut loader, &refused);
    let synced = anycast(20, "vip", SYNC);
    let loaded = config::parse(&synced).expect("valid with [conntrackd]");
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    assert_eq!(same_verdict(&mut loader, &synced), 0);
    assert_eq!(same_verdict(&mut loader, &synced), 20, "reused");
    // The sync removed again: refused at the reload, the tables unchanged.
    same_verdict(&mut loader, &refused);
    // A warning across sections (masquerade moves reset) is the full read's.
    let warned = anycast(20, "masquerade", "");
    assert!(!config::parse(&warned).unwrap().warnings.is_empty());
    same_verdict(&mut loader, &warned);
}

/// FIGURE: the full read and the loader's at 10,000 load balancers, plain
/// and anycast with `[conntrackd]` (the checks across sections run over
/// the assembled tables). Prints the times; asserts only that all are
/// reused.
#[test]
#[allow(clippy::disallowed_types, clippy::disallowed_methods)] // A wall-clock figure.
fn ten_thousand_load_balancers_are_reused_with_the_checks_across_sections() {
    let plain = anycast(10_000, "masquerade", "").replace(
        "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"198.18.0.0/15\"]\n",
        "",
    );
    for (what, text) in [
        ("plain", plain),
        ("anycast+sync", anycast(10_000, "vip", SYNC)),
    ] {
        let t = std::time::Instant::now();
        let full = config::parse(&text).map_err(|p| p.len());
        assert!(full.is_ok_and(|l| l.warnings.is_empty()), "{what}");
        let full = t.elapsed();
        let mut loader = Loader::new();
        assert!(loader.parse(&text).is_ok(), "{what}");
        let t = std::time::Instant::now();
        let loaded = loader.parse(&text).map_err(|p| p.len()).expect("valid");
        let reused = t.elapsed();
        assert_eq!(loaded.reused, 10_000, "{what}");
        println!(
            "FIGURE config_reuse {what} 10000 load balancers: full read {full:?}, reload with every table reused {reused:?}"
        );
    }
}

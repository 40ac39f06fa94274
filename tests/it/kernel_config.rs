//! `forwarding = "kernel"` and `source_nat` as `check` sees them: the
//! default changes nothing, and every combination the kernel's NAT cannot
//! do is refused with its key, its line and the reason.

use crate::support;

use harvester_lb::config::{self, Forwarding, SourceNat};
use support::{problems, run_cli};

/// One load balancer with one listener; `lb` and `listener` are extra
/// lines in each table.
fn file(vip: &str, lb: &str, listener: &str) -> String {
    format!(
        r#"
[[load_balancer]]
name = "default/dns"
vip = "{vip}"
backends = ["198.51.100.11", "198.51.100.12"]
{lb}
  [[load_balancer.listener]]
  name = "web"
  port = 80
  backend_port = 30080
{listener}
"#
    )
}

#[test]
fn proxy_is_the_default_and_kernel_keys_parse() {
    let loaded = config::parse(&file("192.0.2.10", "", "")).expect("valid");
    let l = &loaded.config.load_balancers[0].listeners[0];
    assert_eq!(l.forwarding, Forwarding::Proxy);
    assert_eq!(l.source_nat, SourceNat::Masquerade);

    let loaded = config::parse(&file("192.0.2.10", "", "  forwarding = \"kernel\"")).unwrap();
    let l = &loaded.config.load_balancers[0].listeners[0];
    assert_eq!(l.forwarding, Forwarding::Kernel);
    assert_eq!(l.source_nat, SourceNat::Masquerade);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);

    // (Backends of the VIP's family: a kernel listener cannot mix them.)
    let loaded = config::parse(
        &file(
            "2001:db8::10",
            "algorithm = \"round_robin\"\nsource_ranges = [\"2001:db8::/32\"]",
            "  forwarding = \"kernel\"\n  source_nat = \"none\"\n  protocol = \"udp\"",
        )
        .replace("198.51.100.1", "2001:db8::1"),
    )
    .unwrap();
    let l = &loaded.config.load_balancers[0].listeners[0];
    assert_eq!(l.forwarding, Forwarding::Kernel);
    assert_eq!(l.source_nat, SourceNat::None);
}

#[test]
fn bad_values_name_the_choices() {
    let p = problems(&file("192.0.2.10", "", "  forwarding = \"ebpf\""));
    assert_eq!(p[0].key, "load_balancer[0].listener[0].forwarding");
    assert!(
        p[0].message
            .contains("\"ebpf\" is not supported; use one of \"proxy\", \"kernel\""),
        "{}",
        p[0]
    );
    let p = problems(&file(
        "192.0.2.10",
        "",
        "  forwarding = \"kernel\"\n  source_nat = \"snat\"",
    ));
    assert_eq!(p[0].key, "load_balancer[0].listener[0].source_nat");
    assert!(
        p[0].message.contains("\"masquerade\", \"none\""),
        "{}",
        p[0]
    );
}

/// Each refused combination: the key reported, a piece of the reason.
#[test]
fn every_combination_the_kernel_cannot_do_is_refused_with_key_and_reason() {
    let kernel = "  forwarding = \"kernel\"";
    let cases: &[(&str, &str, String, &str, &str)] = &[
        (
            "192.0.2.10",
            "",
            "  source_nat = \"none\"".into(),
            "load_balancer[0].listener[0].source_nat",
            "applies to forwarding = \"kernel\" listeners only",
        ),
        (
            "192.0.2.10",
            "algorithm = \"least_connections\"",
            kernel.into(),
            "load_balancer[0].algorithm",
            "\"least_connections\" has no kernel form",
        ),
        (
            "192.0.2.10",
            "",
            format!("{kernel}\n  proxy_protocol = \"v2\""),
            "load_balancer[0].listener[0].proxy_protocol",
            "never writes a byte into the stream",
        ),
        (
            "127.0.0.10",
            "",
            kernel.into(),
            "load_balancer[0].vip",
            "the kernel cannot DNAT loopback traffic",
        ),
        (
            "::1",
            "",
            kernel.into(),
            "load_balancer[0].vip",
            "the kernel cannot DNAT loopback traffic",
        ),
        (
            "192.0.2.10",
            "",
            format!("{kernel}\n  defer_accept_seconds = 5"),
            "load_balancer[0].listener[0].defer_accept_seconds",
            "no socket of this host accepts the connection",
        ),
        (
            "192.0.2.10",
            "udp_responses = 1",
            kernel.into(),
            "load_balancer[0].udp_responses",
            "cannot be counted by the kernel",
        ),
    ];
    let two = format!(
        "{kernel}\n  source_nat = \"none\"\n  [[load_balancer.listener]]\n  name = \"alt\"\n  port = 81\n  backend_port = 30080\n{kernel}"
    );
    let cases = [
        cases,
        &[(
            "192.0.2.10",
            "",
            two,
            "load_balancer[0].listener[1].source_nat",
            "cannot masquerade one and not the other",
        )][..],
    ]
    .concat();
    for (vip, lb, listener, key, reason) in &cases {
        let text = file(vip, lb, listener);
        let p = problems(&text);
        assert!(
            p.iter()
                .any(|p| p.key == *key && p.message.contains(reason) && p.line.is_some()),
            "{key}: want {reason:?} in\n{}",
            p.iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("\n")
        );
    }
}

/// `source_ip` and `client_ip` affinity have a kernel form: accepted,
/// without a warning.
#[test]
fn source_ip_and_client_affinity_are_accepted_on_kernel_listeners() {
    let loaded = config::parse(&file(
        "192.0.2.10",
        "algorithm = \"source_ip\"\nsession_affinity = \"client_ip\"\naffinity_timeout_seconds = 600",
        "  forwarding = \"kernel\"",
    ))
    .expect("valid");
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let lb = &loaded.config.load_balancers[0];
    assert_eq!(lb.algorithm, config::Algorithm::SourceIp);
    assert_eq!(
        lb.affinity_timeout,
        Some(std::time::Duration::from_secs(600))
    );
}

#[test]
fn proxy_only_tuning_is_a_warning_on_kernel_listeners() {
    let loaded = config::parse(&file(
        "192.0.2.10",
        "connect_timeout_ms = 500\nidle_timeout_seconds = 60\nmax_connections = 100\nlog_connections = \"all\"",
        "  forwarding = \"kernel\"",
    ))
    .expect("valid");
    let keys: Vec<&str> = loaded.warnings.iter().map(|w| w.key.as_str()).collect();
    assert_eq!(
        keys,
        [
            "load_balancer[0].connect_timeout_ms",
            "load_balancer[0].idle_timeout_seconds",
            "load_balancer[0].max_connections",
            "load_balancer[0].log_connections"
        ]
    );
    assert!(
        loaded.warnings[3]
            .message
            .contains("no line per connection")
    );
    assert!(
        loaded.warnings[0]
            .message
            .contains("fall back to the proxy")
    );
    // The same keys on a proxy listener say nothing.
    let loaded = config::parse(&file(
        "192.0.2.10",
        "connect_timeout_ms = 500\nidle_timeout_seconds = 60",
        "",
    ))
    .unwrap();
    assert!(loaded.warnings.is_empty());
}

#[test]
fn check_exits_78_naming_the_key() {
    let net = support::Subnet::new();
    let bad = net.write(
        "bad.toml",
        &file(
            "192.0.2.10",
            "algorithm = \"least_connections\"",
            "  forwarding = \"kernel\"",
        ),
    );
    let (code, _, err) = run_cli(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 78, "{err}");
    assert!(
        err.contains(
            "line 6: load_balancer[0].algorithm: \"least_connections\" has no kernel form"
        ),
        "{err}"
    );
}

/// An IPv4 VIP with an IPv6 backend (or the reverse) on a kernel listener:
/// nft refuses the DNAT, and the daemon's write would fail. `check`
/// refuses it, naming the load balancer, the key, the backend and its line;
/// the proxy connects to either family, so a proxy listener keeps it.
#[test]
fn mixed_address_families_are_refused_on_kernel_listeners_only() {
    let mixed = |vip: &str, backends: &str, listener: &str| {
        format!(
            r#"
[[load_balancer]]
name = "tenant-b/web"
vip = "{vip}"
backends = [{backends}]
  [[load_balancer.listener]]
  name = "web"
  port = 80
  backend_port = 30080
{listener}
"#
        )
    };
    let kernel = "  forwarding = \"kernel\"";
    for (vip, backends, key, backend, families) in [
        (
            "192.0.2.10",
            r#""198.51.100.11", "2001:db8::12""#,
            "load_balancer[0].backends[1]",
            "2001:db8::12",
            "is IPv6 and the VIP (192.0.2.10) is IPv4",
        ),
        (
            "2001:db8::10",
            r#""2001:db8::11", "::ffff:198.51.100.12""#,
            "load_balancer[0].backends[1]",
            "198.51.100.12",
            "is IPv4 and the VIP (2001:db8::10) is IPv6",
        ),
    ] {
        let p = problems(&mixed(vip, backends, kernel));
        assert_eq!(p.len(), 1, "{p:?}");
        assert_eq!(p[0].key, key);
        assert_eq!(p[0].line, Some(5), "the backends line");
        let said = &p[0].message;
        for part in [
            "load balancer \"tenant-b/web\"",
            &format!("backend {backend} "),
            families,
            "load_balancer[0].listener[0].forwarding is \"kernel\"",
            "use forwarding = \"proxy\"",
        ] {
            assert!(said.contains(part), "want {part:?} in {said}");
        }
        config::parse(&mixed(vip, backends, "")).expect("the proxy takes both families");
    }
    // A DHCP VIP is IPv4.
    let leased = r#"
[[load_balancer]]
name = "tenant-b/web"
ipam = "dhcp"
backends = ["2001:db8::11"]
  [load_balancer.dhcp]
  interface = "eth0"
  [[load_balancer.listener]]
  name = "web"
  port = 80
  backend_port = 30080
  forwarding = "kernel"
"#;
    let p = problems(leased);
    assert!(
        p.iter().any(|p| p.key == "load_balancer[0].backends[0]"
            && p.message.contains("the VIP (leased over DHCP) is IPv4")),
        "{p:?}"
    );
    // `check` says it with the line, and exits 78.
    let net = support::Subnet::new();
    let bad = net.write(
        "mixed.toml",
        &mixed("192.0.2.10", r#""2001:db8::12""#, kernel),
    );
    let (code, _, err) = run_cli(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 78, "{err}");
    assert!(
        err.contains("line 5: load_balancer[0].backends[0]: load balancer \"tenant-b/web\": backend 2001:db8::12 is IPv6"),
        "{err}"
    );
}

/// Kernel listeners whose VIP moves between hosts: a combination that
/// resets the connections a move carries is a warning where it is what a
/// config said before (the default masquerade, round robin), naming the
/// key and what to set instead; `source_nat = "vip"` on an anycast VIP,
/// which never works, is refused. A VIP that does not move gets none of
/// these, and the combinations that keep connections get no warning.
#[test]
fn a_vip_that_moves_warns_about_what_cannot_keep_its_connections() {
    let kernel = "  forwarding = \"kernel\"";
    let anycast = "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"192.0.2.0/24\"]\n";
    let failover = "[keepalived]\nname = \"lb-a\"\naddress = \"10.0.0.1\"\ninterface = \"mgmt\"\npeers = [\"10.0.0.2\"]\n\n[[network]]\nname = \"default/vm\"\ninterface = \"eth0\"\nprefix_length = 24\ngateway = \"192.0.2.1\"\n";
    let warnings = |head: &str, lb: &str, listener: &str| -> Vec<String> {
        let text = format!("{head}{}", file("192.0.2.10", lb, listener));
        let loaded =
            config::parse(&text).unwrap_or_else(|p| panic!("should be valid: {p:?}\n{text}"));
        loaded.warnings.iter().map(|w| w.to_string()).collect()
    };

    // Not moving: nothing said.
    assert_eq!(warnings("", "", kernel), Vec::<String>::new());

    // keepalived: the default masquerade and round robin both warned.
    let w = warnings(failover, "network = \"default/vm\"", kernel);
    assert_eq!(w.len(), 2, "{w:#?}");
    assert!(
        w[0].contains("load_balancer[0].listener[0].source_nat"),
        "{w:#?}"
    );
    assert!(w[0].contains("is \"masquerade\" and its VIP moves between hosts (network = \"default/vm\", keepalived): a failover resets every connection it moves"), "{w:#?}");
    assert!(w[0].contains("set source_nat = \"vip\""), "{w:#?}");
    assert!(w[1].contains("load_balancer[0].algorithm"), "{w:#?}");
    assert!(
        w[1].contains("is \"round_robin\" and its VIP moves between hosts"),
        "{w:#?}"
    );
    assert!(w[1].contains("set algorithm = \"flow_hash\""), "{w:#?}");
    // ... and what keeps them is quiet.
    let keep = format!("{kernel}\n  source_nat = \"vip\"");
    assert_eq!(
        warnings(
            failover,
            "network = \"default/vm\"\nalgorithm = \"flow_hash\"",
            &keep
        ),
        Vec::<String>::new()
    );
    let none = format!("{kernel}\n  source_nat = \"none\"");
    assert_eq!(
        warnings(
            failover,
            "network = \"default/vm\"\nalgorithm = \"source_ip\"",
            &none
        ),
        Vec::<String>::new()
    );
    // A proxy listener is not the kernel's business: nothing said.
    assert_eq!(
        warnings(failover, "network = \"default/vm\"", ""),
        Vec::<String>::new()
    );

    // Anycast: masquerade warned with what anycast can and cannot do.
    let w = warnings(anycast, "algorithm = \"flow_hash\"", kernel);
    assert_eq!(w.len(), 1, "{w:#?}");
    assert!(
        w[0].contains("load_balancer[0].listener[0].source_nat"),
        "{w:#?}"
    );
    assert!(
        w[0].contains("no source_nat keeps them in anycast"),
        "{w:#?}"
    );
    let w = warnings(anycast, "", kernel);
    assert_eq!(w.len(), 2, "{w:#?}");
    assert!(w[1].contains("vip.announce = \"routes\""), "{w:#?}");

    // source_nat = "vip" on an anycast VIP: refused, naming the key.
    let text = format!(
        "{anycast}{}",
        file("192.0.2.10", "algorithm = \"flow_hash\"", &keep)
    );
    let p = problems(&text);
    assert_eq!(p.len(), 1, "{p:#?}");
    assert_eq!(p[0].key, "load_balancer[0].listener[0].source_nat");
    assert!(
        p[0].message.contains("cannot be \"vip\" here")
            && p[0].message.contains("use source_nat = \"masquerade\""),
        "{}",
        p[0]
    );
    // A VIP outside announce_prefixes is not announced: not anycast.
    let outside = anycast.replace("192.0.2.0/24", "198.51.100.0/24");
    let text = format!("{outside}{}", file("192.0.2.10", "", &keep));
    let loaded = config::parse(&text).expect("valid");
    assert!(
        !loaded.warnings.iter().any(|w| w.key.contains("source_nat")),
        "{:?}",
        loaded.warnings
    );
}

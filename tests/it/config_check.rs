//! Config validation as the operator sees it: every problem at once, each
//! with its line, key path and what is allowed; `harvester-lb check` exit
//! codes; and every shipped example loads.

use crate::support;

use harvester_lb::config::{
    self, Algorithm, CheckKind, HealthCheckSpec, InitialState, OnBackendDown,
};
use support::{Lb, keepalived, network, problems, rendered, run_cli};

const GOOD: &str = r#"
[[load_balancer]]
name = "default/nginx"
vip = "192.0.2.10"
backends = ["198.51.100.11", "198.51.100.12"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  [load_balancer.health_check]
  port = 30080
"#;

#[test]
fn defaults_are_harvesters() {
    let loaded = config::parse(GOOD).expect("valid");
    let c = &loaded.config;
    assert_eq!(c.admin.listen.to_string(), "127.0.0.1:9901");
    let lb = &c.load_balancers[0];
    assert_eq!(lb.cluster, "kubernetes");
    assert_eq!(lb.algorithm, Algorithm::RoundRobin);
    assert_eq!(lb.initial_state, InitialState::Healthy);
    assert_eq!(lb.connect_timeout.as_millis(), 3000);
    assert_eq!(lb.idle_timeout.as_secs(), 3600);
    let hc = lb.health_check.as_ref().unwrap();
    assert_eq!(hc.success_threshold.get(), 1);
    assert_eq!(hc.failure_threshold.get(), 3);
    assert_eq!(hc.period.as_secs(), 5);
    assert_eq!(hc.timeout.as_secs(), 3);
    assert!(loaded.warnings.is_empty());
}

#[test]
fn every_unknown_key_is_reported_with_its_line() {
    let text = r#"
[admin]
listen = "127.0.0.1:9901"
lisen = "oops"

[[load_balancer]]
name = "a"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
algoritm = "round_robin"
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  prot = "tcp"
"#;
    let p = problems(text);
    let keys: Vec<(Option<usize>, &str)> = p.iter().map(|p| (p.line, p.key.as_str())).collect();
    assert_eq!(
        keys,
        vec![
            (Some(4), "admin.lisen"),
            (Some(10), "load_balancer[0].algoritm"),
            (Some(15), "load_balancer[0].listener[0].prot"),
        ]
    );
    let messages: Vec<&str> = p.iter().map(|p| p.message.as_str()).collect();
    assert_eq!(
        messages,
        vec![
            "unknown key; did you mean `listen`?",
            "unknown key; did you mean `algorithm`?",
            "unknown key; did you mean `port` or `protocol`?",
        ]
    );
}

/// The issue's unknown keys each name the key meant, at its line and path;
/// a key near none is named alone; a value near an allowed one is named
/// with it; and Kubernetes' spellings of the same values are taken, with a
/// note from `check`.
#[test]
fn unknown_keys_and_values_say_what_was_meant_and_kubernetes_spellings_are_taken() {
    let text = r#"
[[load_balancer]]
name = "default/nginx"
vip = "192.0.2.10"
backends = ["198.51.100.11"]
algoritm = "round_robin"
colour = "red"
healthcheck = { port = 30080 }
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backendport = 30080
  forwarding = "kernal"
  [load_balancer.health_check]
  port = 30080
  period = 5
"#;
    assert_eq!(
        rendered(text),
        [
            "line 6: load_balancer[0].algoritm: unknown key; did you mean `algorithm`?",
            "line 7: load_balancer[0].colour: unknown key",
            "line 8: load_balancer[0].healthcheck: unknown key; did you mean `health_check`?",
            "line 9: load_balancer[0].listener[0]: missing key `backend_port` (the service's nodeport on every backend)",
            "line 12: load_balancer[0].listener[0].backendport: unknown key; did you mean `backend_port`?",
            "line 13: load_balancer[0].listener[0].forwarding: \"kernal\" is not supported (did you mean \"kernel\"?); use one of \"proxy\", \"kernel\"",
            "line 16: load_balancer[0].health_check.period: unknown key; did you mean `period_seconds`?",
        ]
        .join("\n")
    );

    let k8s = GOOD
        .replace("port = 80\n", "port = 80\n  protocol = \"TCP\"\n")
        .replace(
            "backends = [",
            "session_affinity = \"ClientIP\"\nbackends = [",
        );
    let loaded = config::parse(&k8s).expect("Kubernetes' spellings are taken");
    let lb = &loaded.config.load_balancers[0];
    assert!(lb.affinity_timeout.is_some(), "ClientIP is client_ip");
    assert_eq!(lb.listeners[0].protocol, config::Protocol::Tcp);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
    let net = support::Subnet::new();
    let file = net.write("k8s.toml", &k8s);
    let (code, out, err) = run_cli(&["check", "--config", file.to_str().unwrap()]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains("is valid: 1 load balancer, 1 listener\n"),
        "{out}"
    );
    assert_eq!(
        err,
        "note: line 5: load_balancer[0].session_affinity: \"ClientIP\" taken as \"client_ip\" (the same value in Kubernetes' spelling); this file spells it \"client_ip\"\n\
         note: line 10: load_balancer[0].listener[0].protocol: \"TCP\" taken as \"tcp\" (the same value in Kubernetes' spelling); this file spells it \"tcp\"\n"
    );
    let http = GOOD.replace(
        "  [load_balancer.health_check]\n  port = 30080\n",
        "  [load_balancer.health_check]\n  port = 30080\n  kind = \"HTTP\"\n",
    );
    let loaded = config::parse(&http).expect("HTTP is http");
    assert!(matches!(
        loaded.config.load_balancers[0]
            .health_check
            .as_ref()
            .unwrap()
            .check,
        CheckKind::Http(_)
    ));
    assert_eq!(loaded.notes.len(), 1, "{:?}", loaded.notes);
    let udp = k8s.replace("\"TCP\"", "\"UDP\"");
    let loaded = config::parse(&udp).expect("UDP is udp");
    assert_eq!(
        loaded.config.load_balancers[0].listeners[0].protocol,
        config::Protocol::Udp
    );
}

#[test]
fn semantic_problems_are_all_reported_at_once() {
    let text = r#"
[[load_balancer]]
name = "dup"
vip = "192.0.2.300"
backends = ["198.51.100.1", "not-an-ip", "198.51.100.1"]
algorithm = "random"
ipam = "static"
  [[load_balancer.listener]]
  name = "http"
  port = 0
  backend_port = 70000
  protocol = "sctp"
  [load_balancer.health_check]
  port = 30080
  success_threshold = 0
  failure_threshold = -1
  period_seconds = 2
  timeout_seconds = 5

[[load_balancer]]
name = "dup"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "a"
  port = 80
  backend_port = 30080
  [[load_balancer.listener]]
  name = "a"
  port = 81
  backend_port = 30081

[[load_balancer]]
name = "other"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  [load_balancer.health_check]
  period_seconds = 0
"#;
    let out = rendered(text);
    let expected = [
        "line 4: load_balancer[0].vip: \"192.0.2.300\" is not an IPv4 or IPv6 address",
        "line 5: load_balancer[0].backends[1]: \"not-an-ip\" is not an IPv4 or IPv6 address",
        "line 5: load_balancer[0].backends[2]: backend 198.51.100.1 is listed twice",
        "line 6: load_balancer[0].algorithm: \"random\" is not supported; use one of \"round_robin\", \"least_connections\", \"source_ip\"",
        "line 7: load_balancer[0].ipam: \"static\" is not supported; use one of \"pool\", \"dhcp\"",
        "line 10: load_balancer[0].listener[0].port: 0 is out of range; a port must be in 1..=65535",
        "line 11: load_balancer[0].listener[0].backend_port: 70000 is out of range; a port must be in 1..=65535",
        "line 12: load_balancer[0].listener[0].protocol: \"sctp\" is not supported; use one of \"tcp\", \"udp\"",
        "line 15: load_balancer[0].health_check.success_threshold: 0 is out of range; the value must be in 1..=1000",
        "line 16: load_balancer[0].health_check.failure_threshold: -1 is out of range; the value must be in 1..=1000",
        "line 18: load_balancer[0].health_check.timeout_seconds: 5 s is longer than period_seconds (2 s); a probe must end before the next one starts",
        "line 21: load_balancer[1].name: duplicate load balancer name \"dup\" (first used on line 3); names must be unique",
        "line 29: load_balancer[1].listener[1].name: duplicate listener name \"a\" in this load balancer",
        "load_balancer[2].listener[0].port: 192.0.2.1:80/tcp is already a listener of load balancer \"dup/a\"; one VIP:port can serve one TCP and one UDP listener",
        "load_balancer[2].health_check.period_seconds: 0 is out of range; the value must be in 1..=31536000",
    ];
    for e in expected {
        assert!(out.contains(e), "missing problem:\n  {e}\nin:\n{out}");
    }
    assert_eq!(
        out.lines().count(),
        expected.len(),
        "unexpected extra problems:\n{out}"
    );
}

#[test]
fn syntax_and_type_errors_name_the_line() {
    let p = problems("[[load_balancer]]\nname = \"a\"\nvip = \n");
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].line, Some(3), "{p:?}");

    let p = problems(
        "[[load_balancer]]\nname = \"a\"\nvip = \"192.0.2.1\"\nbackends = \"198.51.100.1\"\n",
    );
    assert_eq!(p.len(), 1);
    assert_eq!(p[0].line, Some(4), "{p:?}");
    assert_eq!(p[0].key, "load_balancer[0].backends", "{p:?}");
    assert!(p[0].message.contains("expected a list"), "{p:?}");
}

#[test]
fn an_empty_file_is_rejected_but_an_explicitly_empty_config_is_not() {
    for empty in ["", "\n  \n"] {
        let p = problems(empty);
        assert!(p[0].message.contains("the file is empty"), "{p:?}");
    }
    let loaded = config::parse("load_balancer = []\n").expect("explicitly empty");
    assert!(loaded.config.load_balancers.is_empty());
}

#[test]
fn missing_required_keys_are_named() {
    let out = rendered(
        "[[load_balancer]]\nbackends = []\n  [[load_balancer.listener]]\n  name = \"x\"\n",
    );
    assert!(
        out.contains("load_balancer[0]: missing key `name`"),
        "{out}"
    );
    assert!(out.contains("load_balancer[0]: missing key `vip`"), "{out}");
    assert!(
        out.contains("load_balancer[0].listener[0]: missing key `port`"),
        "{out}"
    );
    assert!(
        out.contains("load_balancer[0].listener[0]: missing key `backend_port`"),
        "{out}"
    );
}

#[test]
fn an_empty_backend_list_is_a_warning_not_an_error() {
    let text = GOOD.replace(
        r#"backends = ["198.51.100.11", "198.51.100.12"]"#,
        "backends = []",
    );
    let loaded = config::parse(&text).expect("valid with a warning");
    assert_eq!(loaded.warnings.len(), 1);
    assert!(
        loaded.warnings[0]
            .to_string()
            .contains("every connection to this load balancer will be refused")
    );
}

#[test]
fn ipv6_addresses_are_accepted() {
    let text = GOOD.replace("192.0.2.10", "2001:db8::10").replace(
        r#"["198.51.100.11", "198.51.100.12"]"#,
        r#"["2001:db8::11", "198.51.100.12"]"#,
    );
    let loaded = config::parse(&text).expect("valid");
    assert!(loaded.config.load_balancers[0].vip.is_ipv6());
}

#[test]
fn check_command_exit_codes_and_messages() {
    let net = support::Subnet::new();
    let good = net.write("good.toml", GOOD);
    let (code, out, _) = run_cli(&["check", "--config", good.to_str().unwrap()]);
    assert_eq!(code, 0);
    assert!(
        out.contains("is valid: 1 load balancer, 1 listener\n"),
        "{out}"
    );

    let bad = net.write("bad.toml", &GOOD.replace("port = 80\n", "port = 99999\n"));
    let (code, _, err) = run_cli(&["check", "--config", bad.to_str().unwrap()]);
    assert_eq!(code, 78);
    assert!(err.contains("is invalid (1 problem)"), "{err}");
    assert!(
        err.contains("line 8: load_balancer[0].listener[0].port: 99999 is out of range"),
        "{err}"
    );

    let (code, _, err) = run_cli(&["check", "--config", "/nonexistent/harvester-lb.toml"]);
    assert_eq!(code, 78);
    assert!(
        err.contains("cannot read config file /nonexistent/harvester-lb.toml"),
        "{err}"
    );

    let (code, _, err) = run_cli(&["check", "--config", net.dir().to_str().unwrap()]);
    assert_eq!(code, 78);
    assert!(err.contains("is a directory"), "{err}");

    let binary = net.dir().join("binary.toml");
    std::fs::write(&binary, b"name = \"\xff\xfe\"\n").unwrap();
    let (code, _, err) = run_cli(&["check", "--config", binary.to_str().unwrap()]);
    assert_eq!(code, 78);
    assert!(err.contains("not valid UTF-8"), "{err}");
}

#[test]
fn every_shipped_example_config_is_valid() {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("config");
    let mut checked = 0;
    for entry in std::fs::read_dir(&dir).expect("config/ exists") {
        let path = entry.unwrap().path();
        if path.extension().is_some_and(|e| e == "toml") {
            let loaded = config::load(&path).unwrap_or_else(|e| panic!("{e}"));
            // base.toml is the host's settings the import puts above the
            // load balancers it writes: valid, and empty of them.
            let is_base = path.file_name().is_some_and(|n| n == "base.toml");
            assert!(
                is_base == loaded.config.load_balancers.is_empty(),
                "{}: an example with no load balancer, or a base with some",
                path.display()
            );
            checked += 1;
        }
    }
    assert!(
        checked >= 2,
        "expected the reference and the loopback example, found {checked}"
    );
}

#[test]
fn proxy_protocol_takes_v1_or_v2_only() {
    let text = r#"
[[load_balancer]]
name = "pp"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  proxy_protocol = "v3"
  [[load_balancer.listener]]
  name = "https"
  port = 443
  backend_port = 30443
  proxy_protocol = "v2"
"#;
    assert_eq!(
        rendered(text),
        "line 10: load_balancer[0].listener[0].proxy_protocol: \"v3\" is not supported; use one of \"v1\", \"v2\""
    );
}

#[test]
fn session_affinity_keys_are_checked() {
    let text = r#"
[proxy]
max_affinity_entries = -1

[[load_balancer]]
name = "a"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
session_affinity = "cookie"
affinity_timeout_seconds = 86401
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
"#;
    assert_eq!(
        rendered(text),
        [
            "line 3: proxy.max_affinity_entries: -1 is out of range; the value must be in 0..=100000000",
            "line 9: load_balancer[0].session_affinity: \"cookie\" is not supported; use one of \"none\", \"client_ip\"",
            "line 10: load_balancer[0].affinity_timeout_seconds: 86401 is out of range; the value must be in 1..=86400",
        ]
        .join("\n")
    );
    // A timeout without client_ip affinity does nothing: a warning.
    let text = GOOD.replace(
        "[[load_balancer]]\n",
        "[[load_balancer]]\naffinity_timeout_seconds = 60\n",
    );
    let loaded = config::parse(&text).expect("valid with a warning");
    assert_eq!(loaded.warnings.len(), 1, "{:?}", loaded.warnings);
    assert!(
        loaded.warnings[0].to_string().contains(
            "affinity_timeout_seconds: has no effect without session_affinity = \"client_ip\""
        ),
        "{}",
        loaded.warnings[0]
    );
}

#[test]
fn admin_socket_and_on_backend_down_are_checked() {
    let loaded = config::parse(GOOD).expect("valid");
    assert_eq!(
        loaded.config.admin.socket.to_str(),
        Some("/run/harvester-lb/admin.sock")
    );
    assert_eq!(
        loaded.config.load_balancers[0].on_backend_down,
        OnBackendDown::Keep
    );
    let text = GOOD.replace(
        "[[load_balancer]]\n",
        "[[load_balancer]]\non_backend_down = \"close\"\n",
    );
    let loaded = config::parse(&text).expect("valid");
    assert_eq!(
        loaded.config.load_balancers[0].on_backend_down,
        OnBackendDown::Close
    );

    let long = format!("/{}", "s".repeat(120));
    let text = "[admin]\nsocket = \"admin.sock\"\n[proxy]\n[[load_balancer]]\nname = \"a\"\nvip = \"192.0.2.1\"\nbackends = [\"198.51.100.1\"]\non_backend_down = \"shutdown\"\n";
    assert_eq!(
        rendered(text),
        [
            "line 2: admin.socket: \"admin.sock\" is not an absolute path; write e.g. \"/run/harvester-lb/admin.sock\"",
            "line 8: load_balancer[0].on_backend_down: \"shutdown\" is not supported; use one of \"keep\", \"close\"",
        ]
        .join("\n")
    );
    let text = format!("[admin]\nsocket = {long:?}\n");
    assert!(
        rendered(&text).contains("is 121 bytes long; a Unix socket path takes at most 107"),
        "{}",
        rendered(&text)
    );
    // close without a health check does nothing: a warning.
    let text = "[[load_balancer]]\nname = \"a\"\nvip = \"192.0.2.1\"\nbackends = [\"198.51.100.1\"]\non_backend_down = \"close\"\n";
    let loaded = config::parse(text).expect("valid with a warning");
    assert!(
        loaded.warnings.iter().any(|w| w
            .to_string()
            .contains("on_backend_down: has no effect without a health_check")),
        "{:?}",
        loaded.warnings
    );
}

/// `GOOD` with its health check's body replaced by `lines`.
fn with_check(lines: &str) -> String {
    GOOD.replace("  port = 30080\n", &format!("  port = 10256\n{lines}"))
}

#[test]
fn an_http_check_takes_kube_proxys_defaults() {
    let hc = check_of(&with_check("  kind = \"http\"\n"));
    let CheckKind::Http(http) = &hc.check else {
        panic!("not an HTTP check: {hc:?}")
    };
    assert_eq!(hc.port, Some(10256));
    assert_eq!(http.path, "/healthz");
    assert_eq!(http.host, None);
    assert_eq!(http.expect_status.to_string(), "200");

    let hc = check_of(&with_check(
        "  kind = \"http\"\n  path = \"/livez?verbose=1\"\n  host = \"[fd00::1]:10256\"\n  expect_status = [204, \"200-202\", 203]\n",
    ));
    let CheckKind::Http(http) = &hc.check else {
        panic!("not an HTTP check: {hc:?}")
    };
    assert_eq!(http.path, "/livez?verbose=1");
    assert_eq!(http.host.as_deref(), Some("[fd00::1]:10256"));
    assert_eq!(http.expect_status.to_string(), "200-204");

    // However the statuses are written, the same set is the same check
    // (and so the same probe stream).
    assert_eq!(
        check_of(&with_check(
            "  kind = \"http\"\n  expect_status = [200, 201]\n"
        )),
        check_of(&with_check(
            "  kind = \"http\"\n  expect_status = [\"200-201\"]\n"
        ))
    );

    for tcp in [GOOD.to_string(), with_check("  kind = \"tcp\"\n")] {
        assert_eq!(check_of(&tcp).check, CheckKind::TcpConnect, "{tcp}");
    }
}

/// The health check of the first load balancer of `text`, a valid config.
fn check_of(text: &str) -> HealthCheckSpec {
    config::parse(text).expect("valid").config.load_balancers[0]
        .health_check
        .clone()
        .expect("a health check")
}

#[test]
fn http_only_keys_on_a_tcp_check_are_named() {
    let out = rendered(&with_check(
        "  path = \"/healthz\"\n  expect_status = [200]\n  host = \"x\"\n",
    ));
    let expected = [
        "line 12: load_balancer[0].health_check.path: applies only to kind = \"http\" (this check is kind = \"tcp\", the default); remove it or set kind = \"http\"",
        "line 13: load_balancer[0].health_check.expect_status: applies only to kind = \"http\" (this check is kind = \"tcp\", the default); remove it or set kind = \"http\"",
        "line 14: load_balancer[0].health_check.host: applies only to kind = \"http\" (this check is kind = \"tcp\", the default); remove it or set kind = \"http\"",
    ];
    assert_eq!(out, expected.join("\n"));

    let out = rendered(&with_check("  kind = \"tcp\"\n  path = \"/healthz\"\n"));
    assert_eq!(
        out,
        "line 13: load_balancer[0].health_check.path: applies only to kind = \"http\" (this check is kind = \"tcp\"); remove it or set kind = \"http\""
    );
}

#[test]
fn bad_http_check_values_are_all_named_with_what_is_allowed() {
    let out = rendered(&with_check(concat!(
        "  kind = \"http\"\n",
        "  path = \"healthz\"\n",
        "  host = \"node 1\"\n",
        "  expect_status = [200, 600, \"399-200\", \"2xx\", true, 99]\n",
    )));
    let expected = [
        "line 13: load_balancer[0].health_check.path: \"healthz\" is not a valid path; it must start with \"/\", e.g. \"/healthz\"",
        "line 14: load_balancer[0].health_check.host: \"node 1\" is not a valid Host header: it contains a space at byte 4; write a host name or address with an optional :port, e.g. \"node-1.example:10256\" or \"[fd00::1]:10256\"",
        "line 15: load_balancer[0].health_check.expect_status[1]: 600 is out of range; a status code must be in 100..=599",
        "line 15: load_balancer[0].health_check.expect_status[2]: \"399-200\" is not a status range; write \"FROM-TO\" with codes in 100..=599 and FROM <= TO, e.g. \"200-399\"",
        "line 15: load_balancer[0].health_check.expect_status[3]: \"2xx\" is not a status range; write \"FROM-TO\" with codes in 100..=599 and FROM <= TO, e.g. \"200-399\"",
        "line 15: load_balancer[0].health_check.expect_status[4]: true (a boolean) is not a status; write an integer code such as 200 or a string range such as \"200-399\"",
        "line 15: load_balancer[0].health_check.expect_status[5]: 99 is out of range; a status code must be in 100..=599",
    ];
    assert_eq!(out, expected.join("\n"));

    let out = rendered(&with_check("  kind = \"grpc\"\n"));
    assert_eq!(
        out,
        "line 12: load_balancer[0].health_check.kind: \"grpc\" is not supported; use one of \"tcp\", \"http\""
    );

    let out = rendered(&with_check(concat!(
        "  kind = \"http\"\n",
        "  path = \"/a b\\u0007\"\n",
        "  host = \"\"\n",
        "  expect_status = []\n",
    )));
    let expected = [
        "line 13: load_balancer[0].health_check.path: \"/a b\\u{7}\" is not a valid path: it contains a space at byte 2; only visible ASCII is allowed (percent-encode the rest, e.g. %20 for a space)",
        "line 14: load_balancer[0].health_check.host: must not be empty; leave the key out to send the backend's address and port",
        "line 15: load_balancer[0].health_check.expect_status: the list is empty; give the statuses that mean healthy, e.g. [200] or [\"200-399\"]",
    ];
    assert_eq!(out, expected.join("\n"));

    let out = rendered(&with_check("  kind = \"http\"\n  path = \"/héalthz\"\n"));
    assert!(
        out.ends_with("it contains the non-ASCII character 'é' at byte 2; only visible ASCII is allowed (percent-encode the rest, e.g. %20 for a space)"),
        "{out}"
    );
    let out = rendered(&with_check(
        "  kind = \"http\"\n  path = \"/x\\r\\nHost: evil\"\n",
    ));
    assert!(
        out.contains("a control character ('\\r') at byte 2"),
        "{out}"
    );

    // Not a list at all: the parser's words, with the line and the key.
    let p = problems(&with_check("  kind = \"http\"\n  expect_status = 200\n"));
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].line, Some(13));
    assert_eq!(p[0].key, "load_balancer[0].health_check.expect_status");
    assert!(p[0].message.contains("expected a list ([...])"), "{p:?}");
}

#[test]
fn hostile_http_check_values_are_rejected_or_accepted_never_a_panic() {
    let values = [
        "\"\"",
        "\"/\"",
        "\"//\"",
        "\"/\\u0000\"",
        "\"/\\u007f\"",
        "\"/\\u202e\"",
        "\"/%\"",
        "99999999999999999999",
        "-1",
        "1e400",
        "nan",
        "true",
        "[]",
        "[[]]",
        "[{}]",
        "{}",
        "[\"-\"]",
        "[\"200-\"]",
        "[\"-200\"]",
        "[\"200-399-500\"]",
        "[\" 200 - 399 \"]",
        "[\"0200\"]",
        "[\"+200\"]",
        "[\"２００\"]",
        "[200.0]",
        "[65736]",
        "[-200]",
        "[9223372036854775807]",
        "[1979-05-27T07:32:00Z]",
    ];
    let long = format!("\"/{}\"", "a".repeat(100_000));
    let mut checked = 0;
    for key in ["path", "host", "expect_status", "kind"] {
        for value in values.iter().copied().chain([long.as_str()]) {
            let text = with_check(&format!("  kind = \"http\"\n  {key} = {value}\n"));
            let text = if key == "kind" {
                text.replace("  kind = \"http\"\n", "")
            } else {
                text
            };
            match std::panic::catch_unwind(|| config::parse(&text)) {
                Ok(Ok(_)) => {}
                Ok(Err(p)) => assert!(!p.is_empty(), "{key} = {value}: rejected without a problem"),
                Err(_) => panic!("config::parse panicked on {key} = {value}"),
            }
            checked += 1;
        }
    }
    assert_eq!(checked, 4 * (values.len() + 1));
    // The spaced range is accepted as the range it plainly means.
    let loaded = config::parse(&with_check(
        "  kind = \"http\"\n  expect_status = [\" 200 - 399 \"]\n",
    ))
    .expect("valid");
    let CheckKind::Http(http) = &loaded.config.load_balancers[0]
        .health_check
        .as_ref()
        .unwrap()
        .check
    else {
        panic!("not HTTP")
    };
    assert_eq!(http.expect_status.to_string(), "200-399");
}

#[test]
fn send_proxy_belongs_to_http_checks() {
    let text = r#"
[[load_balancer]]
name = "a"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  [load_balancer.health_check]
  port = 30080
  send_proxy = true
"#;
    assert_eq!(
        rendered(text),
        "line 12: load_balancer[0].health_check.send_proxy: applies only to kind = \"http\" (this check is kind = \"tcp\", the default); remove it or set kind = \"http\""
    );
}

/// A backend at a VIP:port of this daemon (its own load balancer's, or
/// another's) would send each client back into the daemon until the
/// connection cap: rejected, naming the backend and the listener it reaches.
#[test]
fn a_backend_that_is_a_vip_port_of_this_daemon_is_rejected_naming_both_ends() {
    let text = r#"
[[load_balancer]]
name = "default/self"
vip = "192.0.2.10"
backends = ["198.51.100.11", "192.0.2.10"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 80

[[load_balancer]]
name = "default/other"
vip = "192.0.2.20"
backends = ["::ffff:192.0.2.10", "192.0.2.21"]
  [[load_balancer.listener]]
  name = "web"
  port = 8080
  backend_port = 80
"#;
    let out = rendered(text);
    let expected = [
        "line 5: load_balancer[0].backends[1]: backend 192.0.2.10 on load_balancer[0].listener[0].backend_port 80 is 192.0.2.10:80, the VIP:port of load_balancer[0].listener[0] (\"default/self/http\"): the daemon would forward to itself",
        "line 14: load_balancer[1].backends[0]: backend 192.0.2.10 on load_balancer[1].listener[0].backend_port 80 is 192.0.2.10:80, the VIP:port of load_balancer[0].listener[0] (\"default/self/http\"): the daemon would forward to itself",
    ];
    for e in expected {
        assert!(out.contains(e), "missing problem:\n  {e}\nin:\n{out}");
    }
    assert_eq!(out.lines().count(), 2, "{out}");

    // The VIP on another port, or another address on the VIP's port, is fine.
    let fine = text
        .replace("backend_port = 80\n\n", "backend_port = 30080\n\n")
        .replace(
            "\"::ffff:192.0.2.10\", \"192.0.2.21\"",
            "\"192.0.2.11\", \"192.0.2.21\"",
        );
    config::parse(&fine).unwrap_or_else(|p| panic!("{p:?}"));
}

/// The wildcard binds every address of the host and a backend there is the
/// host itself; multicast and broadcast are no TCP peer at all.
#[test]
fn unspecified_multicast_and_broadcast_addresses_are_rejected() {
    for (vip, what) in [
        (
            "0.0.0.0",
            "the unspecified address: the listeners would bind every address of this host. Harvester writes it for a DHCP VIP: set ipam = \"dhcp\"",
        ),
        ("::", "the unspecified address"),
        ("::ffff:0.0.0.0", "the unspecified address"),
        ("224.0.0.1", "a multicast address"),
        ("ff02::1", "a multicast address"),
        ("255.255.255.255", "the broadcast address"),
    ] {
        let out = rendered(&GOOD.replace("192.0.2.10", vip));
        let e = format!("line 4: load_balancer[0].vip: {vip:?} cannot be a VIP: it is {what}");
        assert!(out.contains(&e), "missing:\n  {e}\nin:\n{out}");
        assert_eq!(out.lines().count(), 1, "{out}");
    }
    for (backend, what) in [
        (
            "0.0.0.0",
            "the unspecified address, which connects to this host itself",
        ),
        ("::", "the unspecified address"),
        ("239.1.2.3", "a multicast address"),
        ("255.255.255.255", "the broadcast address"),
    ] {
        let out = rendered(&GOOD.replace("198.51.100.12", backend));
        let e = format!(
            "line 5: load_balancer[0].backends[1]: {backend:?} cannot be a backend: it is {what}"
        );
        assert!(out.contains(&e), "missing:\n  {e}\nin:\n{out}");
        assert_eq!(out.lines().count(), 1, "{out}");
    }
}

/// The cloud metadata address and class E are refused outright, as VIP and
/// as backend; loopback stays legal (the file is trusted; tests and the
/// demo run on it).
#[test]
fn the_metadata_address_and_class_e_are_rejected_and_loopback_is_not() {
    for (addr, what) in [
        ("169.254.169.254", "the cloud metadata address"),
        ("fd00:ec2::254", "the cloud metadata address"),
        ("240.0.0.1", "in 240.0.0.0/4 (class E, reserved)"),
        ("250.1.2.3", "in 240.0.0.0/4 (class E, reserved)"),
    ] {
        let out = rendered(&GOOD.replace("192.0.2.10", addr));
        let e = format!("line 4: load_balancer[0].vip: {addr:?} cannot be a VIP: it is {what}");
        assert!(out.contains(&e), "missing:\n  {e}\nin:\n{out}");
        let out = rendered(&GOOD.replace("198.51.100.12", addr));
        let e = format!(
            "line 5: load_balancer[0].backends[1]: {addr:?} cannot be a backend: it is {what}"
        );
        assert!(out.contains(&e), "missing:\n  {e}\nin:\n{out}");
    }
    let loopback = GOOD
        .replace("192.0.2.10", "127.0.0.10")
        .replace("198.51.100.12", "::1");
    assert!(config::parse(&loopback).is_ok());
}

/// A listener on admin.listen could not bind (or would answer in the admin
/// API's place); a backend on it would hand the admin API to the VIP's
/// clients. Both are refused, by `check` and on reload alike.
#[test]
fn a_vip_port_or_a_backend_on_admin_listen_is_rejected() {
    let with_admin = |listen: &str, text: &str| format!("[admin]\nlisten = \"{listen}\"\n{text}");
    // The VIP:port is admin.listen.
    let out = rendered(&with_admin("192.0.2.10:80", GOOD));
    assert!(
        out.contains(
            "load_balancer[0].listener[0].port: 192.0.2.10:80 is admin.listen (192.0.2.10:80)"
        ),
        "{out}"
    );
    // A wildcard admin.listen takes every address of the host, the VIP's too.
    let out = rendered(&with_admin("0.0.0.0:80", GOOD));
    assert!(out.contains("is admin.listen (0.0.0.0:80)"), "{out}");
    // A backend's nodeport is admin.listen, directly or through the wildcard.
    for (listen, backend) in [
        ("198.51.100.12:30080", "198.51.100.12"),
        ("127.0.0.1:30080", "127.0.0.1"),
        ("0.0.0.0:30080", "127.0.0.5"),
        ("[::]:30080", "::1"),
    ] {
        let text = with_admin(listen, &GOOD.replace("198.51.100.12", backend));
        let out = rendered(&text);
        assert!(
            out.contains(&format!(
                "load_balancer[0].backends[1]: backend {backend} on load_balancer[0].listener[0].backend_port 30080 reaches admin.listen ({listen})"
            )),
            "{listen} / {backend}:\n{out}"
        );
    }
    // Another port, another address, or a UDP listener: no conflict.
    for listen in ["192.0.2.10:81", "198.51.100.11:30081", "127.0.0.1:9901"] {
        assert!(config::parse(&with_admin(listen, GOOD)).is_ok(), "{listen}");
    }
    let udp = GOOD
        .replace(
            "backend_port = 30080",
            "backend_port = 30080\n  protocol = \"udp\"",
        )
        .replace("  [load_balancer.health_check]\n  port = 30080\n", "");
    assert!(config::parse(&with_admin("192.0.2.10:80", &udp)).is_ok());

    // `check` says so and exits 78.
    let dir = std::env::temp_dir().join(format!("hlb-admin-clash-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("c.toml");
    std::fs::write(&path, with_admin("192.0.2.10:80", GOOD)).unwrap();
    let (code, stdout, stderr) = run_cli(&["check", "--config", path.to_str().unwrap()]);
    let _ = std::fs::remove_dir_all(&dir);
    assert_eq!(code, 78, "{stdout}{stderr}");
    assert!(
        format!("{stdout}{stderr}").contains("is admin.listen (192.0.2.10:80)"),
        "{stdout}{stderr}"
    );
}

/// Names reach logs, metric labels and the status table: bounded to
/// Kubernetes' limits, no control characters, and never repeated in the
/// message that refuses them.
#[test]
fn names_are_bounded_and_free_of_control_characters() {
    let long_name = format!("{}/{}", "n".repeat(63), "a".repeat(254));
    let long_cluster = "c".repeat(254);
    let long_listener = "l".repeat(64);
    let cases = [
        (
            GOOD.replace("default/nginx", &long_name),
            "load_balancer[0].name: is 318 bytes long; at most 317",
        ),
        (
            GOOD.replace(
                "name = \"default/nginx\"",
                &format!("name = \"default/nginx\"\ncluster = \"{long_cluster}\""),
            ),
            "load_balancer[0].cluster: is 254 bytes long; at most 253",
        ),
        (
            GOOD.replace("name = \"http\"", &format!("name = \"{long_listener}\"")),
            "load_balancer[0].listener[0].name: is 64 bytes long; at most 63",
        ),
        (
            GOOD.replace("default/nginx", "default/ng\\ninx"),
            "load_balancer[0].name: holds the control character U+000A",
        ),
        (
            GOOD.replace(
                "name = \"default/nginx\"",
                "name = \"default/nginx\"\ncluster = \"a\\u001b[8mb\"",
            ),
            "load_balancer[0].cluster: holds the control character U+001B",
        ),
        (
            GOOD.replace("name = \"http\"", "name = \"ht\\u007ftp\""),
            "load_balancer[0].listener[0].name: holds the control character U+007F",
        ),
        (
            GOOD.replace("name = \"http\"", "name = \"ht\\u0085tp\""),
            "load_balancer[0].listener[0].name: holds the control character U+0085",
        ),
    ];
    for (text, said) in cases {
        let out = rendered(&text);
        assert!(out.contains(said), "wanted {said:?} in:\n{out}");
        assert!(out.len() < 400, "the message repeats the name:\n{out}");
    }
    // At the limits: accepted.
    let at_limit = GOOD
        .replace(
            "default/nginx",
            &format!("{}/{}", "n".repeat(63), "a".repeat(253)),
        )
        .replace("name = \"http\"", &format!("name = \"{}\"", "l".repeat(63)));
    assert!(config::parse(&at_limit).is_ok());
}

/// `::ffff:127.0.18.2` is 127.0.18.2: one node, shown in its IPv4 form.
#[test]
fn ipv4_mapped_addresses_are_the_ipv4_address() {
    let out = rendered(&GOOD.replace(
        r#"["198.51.100.11", "198.51.100.12"]"#,
        r#"["127.0.18.2", "::ffff:127.0.18.2"]"#,
    ));
    assert_eq!(
        out,
        "line 5: load_balancer[0].backends[1]: backend 127.0.18.2 is listed twice (\"::ffff:127.0.18.2\" is its IPv4-mapped IPv6 form)"
    );
    let loaded = config::parse(
        &GOOD
            .replace("192.0.2.10", "::ffff:192.0.2.10")
            .replace("198.51.100.12", "::FFFF:198.51.100.12"),
    )
    .expect("valid");
    let lb = &loaded.config.load_balancers[0];
    assert_eq!(lb.vip.to_string(), "192.0.2.10");
    assert_eq!(lb.backends[1].to_string(), "198.51.100.12");
    assert!(lb.backends.iter().all(|b| b.is_ipv4()));
}

/// `source_ranges`: each entry a CIDR with no host bits and a prefix length
/// in range; every problem named with its key path and value.
#[test]
fn source_ranges_are_cidrs_without_host_bits() {
    let with = |list: &str| {
        GOOD.replace(
            "backends = [",
            &format!("source_ranges = [{list}]\nbackends = ["),
        )
    };
    let out = rendered(&with(
        r#""10.0.0.1/8", "10.0.0.0/33", "2001:db8::/129", "10.0.0.0", "nope/8", "10.0.0.0/+8", "10.0.0.0/", "2001:db8::1/32", "192.0.2.0/24""#,
    ));
    let expected = [
        "line 5: load_balancer[0].source_ranges[0]: \"10.0.0.1/8\" has host bits set; did you mean \"10.0.0.0/8\"?",
        "line 5: load_balancer[0].source_ranges[1]: \"10.0.0.0/33\" has prefix length \"33\"; an IPv4 prefix length must be in 0..=32",
        "line 5: load_balancer[0].source_ranges[2]: \"2001:db8::/129\" has prefix length \"129\"; an IPv6 prefix length must be in 0..=128",
        "line 5: load_balancer[0].source_ranges[3]: \"10.0.0.0\" is not a CIDR range; write ADDRESS/PREFIX",
        "line 5: load_balancer[0].source_ranges[4]: \"nope/8\" is not a CIDR range: \"nope\" is not an IPv4 or IPv6 address",
        "line 5: load_balancer[0].source_ranges[5]: \"10.0.0.0/+8\" has prefix length \"+8\"",
        "line 5: load_balancer[0].source_ranges[6]: \"10.0.0.0/\" has prefix length \"\"",
        "line 5: load_balancer[0].source_ranges[7]: \"2001:db8::1/32\" has host bits set; did you mean \"2001:db8::/32\"?",
    ];
    for e in expected {
        assert!(out.contains(e), "missing problem:\n  {e}\nin:\n{out}");
    }
    assert_eq!(out.lines().count(), expected.len(), "{out}");

    let loaded = config::parse(&with(
        r#""192.0.2.0/24", "2001:db8::/32", "::ffff:198.51.100.0/120", "0.0.0.0/0""#,
    ))
    .expect("valid");
    let r = &loaded.config.load_balancers[0].source_ranges;
    let shown: Vec<String> = r.ranges().iter().map(|n| n.to_string()).collect();
    assert_eq!(
        shown,
        [
            "192.0.2.0/24",
            "2001:db8::/32",
            "198.51.100.0/24",
            "0.0.0.0/0"
        ]
    );
    assert!(r.allows("203.0.113.1".parse().unwrap()));
    assert!(!r.allows("2001:db9::1".parse().unwrap()));
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);

    // Absent or empty: everyone.
    for text in [GOOD.to_string(), with("")] {
        let loaded = config::parse(&text).expect("valid");
        assert!(loaded.config.load_balancers[0].source_ranges.is_everyone());
    }
}

/// At most 1,000 ranges per load balancer; ranges of only the other family
/// than the VIP's refuse everyone, which is allowed with a warning.
#[test]
fn source_ranges_are_bounded_and_a_list_that_refuses_everyone_is_a_warning() {
    let list: Vec<String> = (0..1001)
        .map(|i| format!("\"10.{}.{}.0/24\"", i / 256, i % 256))
        .collect();
    let text = GOOD.replace(
        "backends = [",
        &format!("source_ranges = [{}]\nbackends = [", list.join(", ")),
    );
    let out = rendered(&text);
    assert_eq!(
        out,
        "line 5: load_balancer[0].source_ranges: 1001 ranges; at most 1000 are allowed per load balancer (aggregate neighbouring ranges into shorter prefixes)"
    );
    let list = list[..1000].join(", ");
    let text = GOOD.replace(
        "backends = [",
        &format!("source_ranges = [{list}]\nbackends = ["),
    );
    config::parse(&text).expect("1,000 ranges are allowed");

    let text = GOOD.replace(
        "backends = [",
        "source_ranges = [\"2001:db8::/32\"]\nbackends = [",
    );
    let loaded = config::parse(&text).expect("valid with a warning");
    assert_eq!(
        loaded.warnings[0].to_string(),
        "line 5: load_balancer[0].source_ranges: no IPv4 range for the IPv4 VIP 192.0.2.10: every client will be refused"
    );
}

/// A value of the wrong type is named by its key path, in plain words.
#[test]
fn a_value_of_the_wrong_type_names_its_key() {
    let cases = [
        (
            "[admin]\nlisten = 5\n",
            "line 2: admin.listen: invalid type: integer `5`, expected a string",
        ),
        (
            "[[load_balancer]]\nname = \"a\"\nvip = \"192.0.2.1\"\n  [[load_balancer.listener]]\n  name = \"h\"\n  port = \"80\"\n  backend_port = 30080\n",
            "line 6: load_balancer[0].listener[0].port: invalid type: string \"80\", expected an integer",
        ),
        (
            "[metrics]\nper_backend_health_check_duration = \"yes\"\n",
            "line 2: metrics.per_backend_health_check_duration: invalid type: string \"yes\", expected true or false",
        ),
    ];
    for (text, want) in cases {
        assert_eq!(rendered(text), want);
    }
}

#[test]
fn a_health_check_without_port_checks_each_listeners_backend_port() {
    // Two listeners on one nodeport and one on another: two ports checked.
    let text = GOOD.replace("  port = 30080\n", "").replace(
        "[load_balancer.health_check]",
        "[[load_balancer.listener]]\n  name = \"alt\"\n  port = 81\n  backend_port = 30080\n  [[load_balancer.listener]]\n  name = \"tls\"\n  port = 443\n  backend_port = 30443\n  [load_balancer.health_check]",
    );
    let loaded = config::parse(&text).unwrap_or_else(|p| panic!("valid: {p:?}\n{text}"));
    let lb = &loaded.config.load_balancers[0];
    assert_eq!(lb.health_check.as_ref().unwrap().port, None);
    assert_eq!(lb.checked_ports(), vec![30080, 30443]);
    // With a port: one verdict, no port checked alone.
    let given = config::parse(GOOD).expect("valid");
    assert!(given.config.load_balancers[0].checked_ports().is_empty());
    // A port given is still checked, and named.
    let out = rendered(&GOOD.replace("  port = 30080\n", "  port = 0\n"));
    assert!(
        out.contains(
            "load_balancer[0].health_check.port: 0 is out of range; a port must be in 1..=65535"
        ),
        "{out}"
    );
}

const DHCP: &str = r#"
[[load_balancer]]
name = "default/web"
ipam = "dhcp"
vip = "0.0.0.0"
backends = ["198.51.100.11"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  [load_balancer.dhcp]
  interface = "eth0"
"#;

fn valid(text: &str) -> config::Config {
    config::parse(text)
        .unwrap_or_else(|p| panic!("should be valid: {p:?}\n{text}"))
        .config
}

#[test]
fn a_dhcp_load_balancer_is_valid_without_an_address() {
    let c = valid(DHCP);
    let lb = &c.load_balancers[0];
    assert!(lb.vip.is_unspecified());
    let d = lb.dhcp.as_ref().expect("dhcp spec");
    assert_eq!(d.interface, "eth0");
    assert_eq!(d.hostname, "kubernetes-default-web");
    assert_eq!(d.mac[0] & 3, 2, "locally administered unicast");
    // Stable: the same name and cluster give the same MAC.
    assert_eq!(
        valid(DHCP).load_balancers[0].dhcp.as_ref().unwrap().mac,
        d.mac
    );
    valid(&DHCP.replace("vip = \"0.0.0.0\"\n", ""));
    // Two unleased VIPs on the same port do not collide.
    valid(&format!(
        "{DHCP}{}",
        DHCP.replace("default/web", "default/api")
    ));
    let c = valid(&DHCP.replace(
        "interface = \"eth0\"",
        "interface = \"eth0\"\n  mac = \"02:00:5e:00:00:01\"\n  hostname = \"web-vip\"\n  servers = [\"198.51.100.2\"]",
    ));
    let d = c.load_balancers[0].dhcp.as_ref().unwrap();
    assert_eq!(d.mac, [2, 0, 0x5e, 0, 0, 1]);
    assert_eq!(d.hostname, "web-vip");
    assert_eq!(d.servers, vec![std::net::Ipv4Addr::new(198, 51, 100, 2)]);
    // A VIP given with ipam = "dhcp" is the address asked for.
    let c = valid(&DHCP.replace("0.0.0.0", "198.51.100.150"));
    assert_eq!(
        c.load_balancers[0].dhcp.as_ref().unwrap().requested,
        Some(std::net::Ipv4Addr::new(198, 51, 100, 150))
    );
    // Without the table, a DHCP VIP is leased elsewhere: its address is
    // given and used as it is (`harvester-lb import` writes these).
    let elsewhere = DHCP
        .replace("0.0.0.0", "198.51.100.150")
        .replace("  [load_balancer.dhcp]\n  interface = \"eth0\"\n", "");
    let c = valid(&elsewhere);
    assert_eq!(c.load_balancers[0].vip.to_string(), "198.51.100.150");
    assert!(c.load_balancers[0].dhcp.is_none());
}

#[test]
fn bad_dhcp_keys_are_named() {
    for (from, to, e) in [
        (
            "  [load_balancer.dhcp]\n  interface = \"eth0\"\n",
            "",
            "line 5: load_balancer[0].vip: \"0.0.0.0\" cannot be a VIP: it is the unspecified address: the listeners would bind every address of this host. Harvester writes it for a DHCP VIP: set ipam = \"dhcp\" and a [load_balancer.dhcp] table to lease one",
        ),
        (
            "interface = \"eth0\"",
            "interface = \"a/b\"",
            "line 12: load_balancer[0].dhcp.interface: \"a/b\" is not an interface name",
        ),
        (
            "interface = \"eth0\"",
            "mac = \"02:00:00:00:00:01\"",
            "load_balancer[0].dhcp: missing key `interface`",
        ),
        (
            "interface = \"eth0\"",
            "interface = \"eth0\"\n  mac = \"01:00:5e:00:00:01\"",
            "line 13: load_balancer[0].dhcp.mac: \"01:00:5e:00:00:01\" is a multicast or all-zero address",
        ),
        (
            "interface = \"eth0\"",
            "interface = \"eth0\"\n  mac = \"02:00:5e\"",
            "line 13: load_balancer[0].dhcp.mac: \"02:00:5e\" is not a MAC address",
        ),
        (
            "interface = \"eth0\"",
            "interface = \"eth0\"\n  hostname = \"-web\"",
            "line 13: load_balancer[0].dhcp.hostname: \"-web\" is not a host name",
        ),
        (
            "interface = \"eth0\"",
            "interface = \"eth0\"\n  servers = [\"nope\"]",
            "line 13: load_balancer[0].dhcp.servers[0]: \"nope\" is not a unicast IPv4 address",
        ),
        (
            "interface = \"eth0\"",
            "interface = \"eth0\"\n  lease = 5",
            "line 13: load_balancer[0].dhcp.lease: unknown key",
        ),
        (
            "vip = \"0.0.0.0\"",
            "vip = \"2001:db8::1\"",
            "line 5: load_balancer[0].vip: \"2001:db8::1\" cannot be asked for over DHCPv4",
        ),
        (
            "ipam = \"dhcp\"",
            "ipam = \"pool\"",
            "load_balancer[0].dhcp: is only used with ipam = \"dhcp\"",
        ),
    ] {
        let text = DHCP.replace(from, to);
        let out = rendered(&text);
        assert!(out.contains(e), "missing:\n  {e}\nin:\n{out}\nfor:\n{text}");
    }
    let out = rendered(&format!("[dhcp]\nstate_directory = \"relative\"\n{DHCP}"));
    assert!(
        out.contains(
            "line 2: dhcp.state_directory: \"relative\" is not an absolute directory path"
        ),
        "{out}"
    );
}

/// `allowed_ranges` and `min_prefix_length`, in `[dhcp]` and per load
/// balancer: the per-load-balancer keys win, a bad value is named with its
/// line and key.
#[test]
fn dhcp_guard_keys_are_checked_and_the_load_balancers_win() {
    let c = valid(DHCP);
    let d = c.load_balancers[0].dhcp.as_ref().unwrap();
    let g = d.guard(&c.dhcp.guard);
    assert!(g.allowed_ranges.is_empty(), "default: any");
    assert_eq!(g.min_prefix_length, 16);

    let global = "[dhcp]\nallowed_ranges = [\"192.0.2.0/24\", \"198.51.100.128/25\"]\nmin_prefix_length = 20\n";
    let c = valid(&format!("{global}{DHCP}"));
    let g = c.load_balancers[0]
        .dhcp
        .as_ref()
        .unwrap()
        .guard(&c.dhcp.guard);
    assert_eq!(g.allowed_ranges.len(), 2);
    assert_eq!(g.min_prefix_length, 20);
    let own = DHCP.replace(
        "interface = \"eth0\"",
        "interface = \"eth0\"\n  allowed_ranges = [\"203.0.113.0/24\"]\n  min_prefix_length = 24",
    );
    let c = valid(&format!("{global}{own}"));
    let g = c.load_balancers[0]
        .dhcp
        .as_ref()
        .unwrap()
        .guard(&c.dhcp.guard);
    assert_eq!(g.allowed_ranges, vec!["203.0.113.0/24".parse().unwrap()]);
    assert_eq!(g.min_prefix_length, 24);

    for (text, e) in [
        (
            format!("[dhcp]\nallowed_ranges = [\"192.0.2.1/24\"]\n{DHCP}"),
            "line 2: dhcp.allowed_ranges[0]: \"192.0.2.1/24\" has host bits set; did you mean \"192.0.2.0/24\"?",
        ),
        (
            format!("[dhcp]\nallowed_ranges = [\"2001:db8::/32\"]\n{DHCP}"),
            "line 2: dhcp.allowed_ranges[0]: \"2001:db8::/32\" is an IPv6 range; DHCPv4 leases IPv4 addresses only",
        ),
        (
            format!("[dhcp]\nallowed_ranges = []\n{DHCP}"),
            "line 2: dhcp.allowed_ranges: is empty, which would refuse every DHCP offer",
        ),
        (
            format!("[dhcp]\nmin_prefix_length = 33\n{DHCP}"),
            "line 2: dhcp.min_prefix_length: 33 is out of range; the value must be in 0..=32",
        ),
        (
            DHCP.replace(
                "interface = \"eth0\"",
                "interface = \"eth0\"\n  allowed_ranges = [\"nope\"]",
            ),
            "line 13: load_balancer[0].dhcp.allowed_ranges[0]: \"nope\" is not a CIDR range",
        ),
        (
            DHCP.replace(
                "interface = \"eth0\"",
                "interface = \"eth0\"\n  min_prefix_length = -1",
            ),
            "line 13: load_balancer[0].dhcp.min_prefix_length: -1 is out of range; the value must be in 0..=32",
        ),
    ] {
        let out = rendered(&text);
        assert!(out.contains(e), "missing:\n  {e}\nin:\n{out}\nfor:\n{text}");
    }
}

/// `defer_accept_seconds` is a TCP listener's: on a UDP listener, and out
/// of 1..=600, it is an error naming the key; on a TCP listener it is taken.
#[test]
fn defer_accept_seconds_is_checked() {
    let text = |protocol: &str, value: i64| {
        format!(
            r#"
[[load_balancer]]
name = "da"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "dns"
  port = 53
  backend_port = 30053
  protocol = "{protocol}"
  defer_accept_seconds = {value}
"#
        )
    };
    assert_eq!(
        rendered(&text("udp", 5)),
        "line 11: load_balancer[0].listener[0].defer_accept_seconds: applies to TCP listeners only: a UDP listener has no handshake to defer; remove it, or use protocol = \"tcp\""
    );
    assert_eq!(
        rendered(&text("tcp", 0)),
        "line 11: load_balancer[0].listener[0].defer_accept_seconds: 0 is out of range; the value must be in 1..=600"
    );
    assert_eq!(
        rendered(&text("tcp", 601)),
        "line 11: load_balancer[0].listener[0].defer_accept_seconds: 601 is out of range; the value must be in 1..=600"
    );
    let config = config::parse(&text("tcp", 5)).expect("valid");
    assert_eq!(
        config.config.load_balancers[0].listeners[0].defer_accept,
        Some(std::time::Duration::from_secs(5))
    );
}

/// A type error no longer hides the rest (issue 19, item 13): `port = 80.0`
/// in one load balancer, a second type error in another, an unknown key,
/// and an ordinary validation problem in a third are reported together,
/// sorted by line, each with its key path; a removed key is not reported
/// again as missing.
#[test]
fn type_errors_are_reported_with_every_other_problem() {
    let text = r#"[proxy]
backlog = "many"

[[load_balancer]]
name = "ns/a"
vip = "192.0.2.1"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "http"
  port = 80.0
  backend_port = 30080

[[load_balancer]]
name = "ns/b"
vip = "192.0.2.300"
backends = ["198.51.100.1"]
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080

[[load_balancer]]
name = "ns/c"
vip = "192.0.2.3"
backends = ["198.51.100.1", 7]
idle_timeout_seconds = true
colour = "blue"
  [[load_balancer.listener]]
  name = "http"
  port = 80
  backend_port = 30080
  [load_balancer.health_check]
  period_seconds = "5s"
"#;
    let got = rendered(text);
    let want = [
        "line 2: proxy.backlog: invalid type: string \"many\", expected an integer",
        "line 10: load_balancer[0].listener[0].port: invalid type: floating point `80.0`, expected an integer",
        "line 15: load_balancer[1].vip: \"192.0.2.300\" is not an IPv4 or IPv6 address",
        "line 25: load_balancer[2].backends[1]: invalid type: integer `7`, expected a string",
        "line 26: load_balancer[2].idle_timeout_seconds: invalid type: boolean `true`, expected an integer",
        "line 27: load_balancer[2].colour: unknown key",
        "line 33: load_balancer[2].health_check.period_seconds: invalid type: string \"5s\", expected an integer",
    ]
    .join("\n");
    assert_eq!(got, want);
    // `check` says the same, all at once, and exits 78.
    let dir = std::env::temp_dir().join(format!("hlb-types-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let path = dir.join("config.toml");
    std::fs::write(&path, text).unwrap();
    let (code, _, stderr) = run_cli(&["check", "--config", path.to_str().unwrap()]);
    assert_eq!(code, 78, "{stderr}");
    assert!(stderr.contains("(7 problems)"), "{stderr}");
    for line in want.lines() {
        assert!(stderr.contains(line), "{line:?} missing from:\n{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
    // A syntax error is still the first one only (the parser stops there).
    let p = problems("[proxy]\nbacklog = \n[[load_balancer]]\nname = \n");
    assert_eq!(p.len(), 1, "{p:?}");
    assert_eq!(p[0].line, Some(2), "{p:?}");
}

/// A file full of type errors is read with bounded work: at most 16 are
/// looked for in one table and 100 in the file, and the operator is told
/// that more may follow.
#[test]
fn the_search_for_type_errors_is_bounded() {
    let mut text = String::new();
    for i in 0..150 {
        text.push_str(&format!(
            "[[load_balancer]]\nname = \"ns/{i}\"\nvip = \"192.0.2.1\"\nidle_timeout_seconds = 1.5\n"
        ));
    }
    let p = problems(&text);
    assert_eq!(p.len(), 101, "{p:?}");
    assert!(
        p[..100]
            .iter()
            .all(|p| p.message.contains("expected an integer"))
    );
    assert_eq!(p[99].key, "load_balancer[99].idle_timeout_seconds");
    assert!(
        p[100]
            .message
            .contains("more values of the wrong type may follow"),
        "{p:?}"
    );

    let mut one = String::from("[[load_balancer]]\nname = \"ns/a\"\nvip = \"192.0.2.1\"\n");
    for i in 0..40 {
        one.push_str(&format!(
            "[[load_balancer.listener]]\nname = \"l{i}\"\nport = 1.5\nbackend_port = 1\n"
        ));
    }
    let p = problems(&one);
    assert_eq!(p.len(), 17, "{p:?}");
    assert!(p[16].message.contains("at most 16"), "{p:?}");
}

/// The tests' config builder (`tests/it/support/config.rs`) writes what it is
/// told: every table, key and name reads back as set, and a string with
/// quotes, backslashes and control characters round-trips as TOML.
#[test]
fn the_test_config_builder_writes_what_it_is_told() {
    use std::net::IpAddr;
    use support::{Config, Lb, Listener, quote};
    let text = Config::new()
        .admin("127.0.0.1:9901".parse().unwrap())
        .socket(std::path::Path::new("/tmp/hlb-builder/admin.sock"))
        .proxy("drain_timeout_seconds = 3")
        .lb(Lb::new("default/web", "127.0.0.1")
            .backends(["127.0.0.11", "127.0.0.12"])
            .keys("algorithm = \"least_connections\"")
            .tcp("http", 8080, 30080)
            .listener(Listener::new("dns", 53, 30053).udp())
            .health("  port = 30081\n  period_seconds = 2\n  timeout_seconds = 1"))
        .lb(Lb::new("default/empty", "127.0.0.2").tcp("http", 8080, 30080))
        .to_string();
    let c = config::parse(&text)
        .unwrap_or_else(|p| panic!("{p:?}\n{text}"))
        .config;
    assert_eq!(c.admin.listen, "127.0.0.1:9901".parse().unwrap());
    assert_eq!(
        c.admin.socket,
        std::path::Path::new("/tmp/hlb-builder/admin.sock")
    );
    assert_eq!(c.proxy.drain_timeout, std::time::Duration::from_secs(3));
    let names: Vec<&str> = c.load_balancers.iter().map(|l| l.name.as_str()).collect();
    assert_eq!(names, ["default/web", "default/empty"]);
    let web = &c.load_balancers[0];
    assert_eq!(web.vip, "127.0.0.1".parse::<IpAddr>().unwrap());
    let backends: Vec<String> = web.backends.iter().map(ToString::to_string).collect();
    assert_eq!(backends, ["127.0.0.11", "127.0.0.12"]);
    assert_eq!(web.algorithm, Algorithm::LeastConnections);
    let listeners: Vec<(&str, u16, u16, config::Protocol)> = web
        .listeners
        .iter()
        .map(|l| (l.name.as_str(), l.port, l.backend_port, l.protocol))
        .collect();
    assert_eq!(
        listeners,
        [
            ("http", 8080, 30080, config::Protocol::Tcp),
            ("dns", 53, 30053, config::Protocol::Udp)
        ]
    );
    let check = web.health_check.as_ref().expect("a health check");
    assert_eq!(check.port, Some(30081));
    assert_eq!(check.period, std::time::Duration::from_secs(2));
    assert!(c.load_balancers[1].backends.is_empty());
    assert!(c.load_balancers[1].health_check.is_none());

    let hostile = "a\"b\\c\u{1b}[8m\nd";
    let value: toml::Table = toml::from_str(&format!("k = {}", quote(hostile))).unwrap();
    assert_eq!(value["k"].as_str(), Some(hostile));
}

/// Issue 40, defect 4: `check` accepted `interface = "lo"` on a
/// `[[network]]`, which the daemon then isolated (the host's 127.0.0.1
/// services stopped answering). Refused now by name, with its line, for
/// the loopback, the CNI's devices and a lease macvlan; isolated or not
/// (none is ever a VM network). `harvester-lb check` exits 78.
#[test]
fn a_network_on_the_loopback_or_a_cni_device_is_refused_with_its_line() {
    let network = |interface: &str, more: &str| {
        format!(
            "[keepalived]\nname = \"h1\"\naddress = \"192.168.0.11\"\ninterface = \"mgmt-br\"\npeers = [\"192.168.0.12\"]\n\n[[network]]\nname = \"t/a\"\ninterface = \"{interface}\"\nprefix_length = 24\ngateway = \"10.7.0.1\"\n{more}\n[[load_balancer]]\nname = \"t/web\"\nvip = \"10.7.0.50\"\nnetwork = \"t/a\"\nbackends = [\"10.7.0.21\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n"
        )
    };
    assert!(
        config::parse(&network("data-br", "")).is_ok(),
        "a bridge is fine"
    );
    for (interface, more, words) in [
        ("lo", "", "the host's loopback"),
        ("lo", "isolate = false\n", "the host's loopback"),
        ("lo.100", "", "the host's loopback"),
        ("cni0", "", "container network"),
        ("flannel.1", "", "container network"),
        ("cali0123456789a", "", "container network"),
        ("hlb0200000a0b", "", "lease macvlan"),
    ] {
        let p = problems(&network(interface, more));
        assert_eq!(p.len(), 1, "{interface}: {p:?}");
        assert_eq!(p[0].key, "network[0].interface", "{p:?}");
        assert_eq!(p[0].line, Some(9), "{p:?}");
        assert!(
            p[0].message.contains(&format!("{interface:?} is"))
                && p[0].message.contains(words)
                && p[0]
                    .message
                    .contains("a bridge, a VLAN device on one, or a bond"),
            "{interface}: {}",
            p[0].message
        );
    }
    let net = support::Subnet::new();
    let lo = net.write("lo.toml", &network("lo", ""));
    let (code, _, err) = run_cli(&["check", "--config", lo.to_str().unwrap()]);
    assert_eq!(code, 78, "{err}");
    assert!(
        err.contains("line 9: network[0].interface: \"lo\" is the host's loopback"),
        "{err}"
    );
}

/// A VM-network file: `[keepalived]` (interface "mgmt"), the network
/// "default/vlan100" on "mgmt-br.100" and a load balancer on it; `extra`
/// appended (a `[conntrackd]`).
fn vmnet(extra: &str) -> String {
    let files = std::path::Path::new("/run/hlb-test/keepalived");
    format!(
        "{}{}{}{extra}",
        keepalived("lb-1", "192.168.0.11", ["192.168.0.12"], files, ""),
        network("default/vlan100", "mgmt-br.100", "10.100.0.1", ""),
        Lb::new("default/web", "10.100.0.50")
            .backends(["10.100.0.21"])
            .tcp("http", 80, 30080)
            .keys("network = \"default/vlan100\""),
    )
}

/// The 1-based line of `text` holding `needle`.
fn line_of(text: &str, needle: &str) -> usize {
    1 + text
        .lines()
        .position(|l| l.contains(needle))
        .unwrap_or_else(|| panic!("{needle:?} not in\n{text}"))
}

/// Issue 40, defect 11: keepalived read `interface = "br#1"` as `br` (the
/// rest a comment) and put the VIP there. Every name the daemon writes
/// bare into keepalived.conf or conntrackd.conf is refused with a
/// character either file reads specially, naming the key, the line and
/// what to use; conntrackd's interface must also be one word of its parser.
#[test]
fn names_written_into_keepalived_or_conntrackd_s_file_refuse_what_those_files_read_specially() {
    let sync = "\n[conntrackd]\n";
    assert!(config::parse(&vmnet("")).is_ok());
    assert!(config::parse(&vmnet(sync)).is_ok());
    for (from, to, key, shown) in [
        (
            "interface = \"mgmt-br.100\"",
            "interface = \"br#1\"",
            "network[0].interface",
            "'#'",
        ),
        (
            "interface = \"mgmt-br.100\"",
            "interface = \"br!1\"",
            "network[0].interface",
            "'!'",
        ),
        (
            "interface = \"mgmt-br.100\"",
            "interface = \"br$1\"",
            "network[0].interface",
            "'$'",
        ),
        (
            "interface = \"mgmt-br.100\"",
            "interface = \"br{1\"",
            "network[0].interface",
            "'{'",
        ),
        (
            "interface = \"mgmt\"",
            "interface = \"mgmt'1\"",
            "keepalived.interface",
            "'\\''",
        ),
        (
            "interface = \"mgmt\"",
            "interface = \"mgmt\\\\1\"",
            "keepalived.interface",
            "'\\\\'",
        ),
        (
            "interface = \"mgmt\"",
            "interface = \"mgmt\\\"1\"",
            "keepalived.interface",
            "'\"'",
        ),
        (
            "name = \"lb-1\"",
            "name = \"lb#1\"",
            "keepalived.name",
            "'#'",
        ),
        (
            "name = \"lb-1\"",
            "name = \"lb!1\"",
            "keepalived.name",
            "'!'",
        ),
        (
            "name = \"lb-1\"",
            "name = \"lb$1\"",
            "keepalived.name",
            "'$'",
        ),
        (
            "name = \"lb-1\"",
            "name = \"lb'1\"",
            "keepalived.name",
            "'\\''",
        ),
    ] {
        let text = vmnet("").replacen(from, to, 1);
        let out = rendered(&text);
        let line = line_of(&text, to);
        let want = format!("line {line}: {key}: ");
        assert!(
            out.contains(&want)
                && out.contains(&format!("holds {shown} at byte "))
                && out.contains("use letters, digits, '-', '_' and '.'"),
            "{to}: missing {want} ... {shown}\nin:\n{out}"
        );
        assert_eq!(out.lines().count(), 1, "{to}: {out}");
    }
    // conntrackd's parser takes a letter, then letters, digits, '.', '-'
    // and '_': anything else is refused, given or taken from keepalived.
    for given in ["sync#0", "1sync", "sync+0", "sync@0"] {
        let text = vmnet(&format!("{sync}interface = \"{given}\"\n"));
        let out = rendered(&text);
        let line = line_of(&text, given);
        assert!(
            out.contains(&format!("line {line}: conntrackd.interface: "))
                && out.contains("starts with a letter"),
            "{given}: {out}"
        );
    }
    let text = vmnet(sync).replacen("interface = \"mgmt\"", "interface = \"1gbe-br\"", 1);
    let out = rendered(&text);
    assert!(
        out.contains(&format!(
            "line {}: conntrackd.interface: taken from keepalived.interface: ",
            line_of(&text, "[conntrackd]")
        )),
        "{out}"
    );
    // keepalived itself takes a name starting with a digit.
    let text = vmnet("").replacen("interface = \"mgmt\"", "interface = \"1gbe-br\"", 1);
    assert!(config::parse(&text).is_ok());
}

/// Issue 40, defect 11: `keepalived.peers` took `224.0.0.18` (VRRP's own
/// group) and `0.0.0.0`; a unicast peer, this host's address and the sync
/// link's ends are one host's unicast address each.
#[test]
fn vrrp_and_sync_addresses_are_one_host_s_unicast_address() {
    for (bad, what) in [
        ("224.0.0.18", "a multicast address"),
        ("0.0.0.0", "an unspecified address"),
        ("0.1.2.3", "an unspecified address"),
        ("255.255.255.255", "the broadcast address"),
        ("127.0.0.1", "a loopback address"),
    ] {
        let text = vmnet("").replacen(
            "peers = [\"192.168.0.12\"]",
            &format!("peers = [\"{bad}\"]"),
            1,
        );
        let out = rendered(&text);
        let want = format!(
            "line {}: keepalived.peers[0]: {bad} cannot be a peer's management address: it is {what}",
            line_of(&text, "peers =")
        );
        assert!(out.contains(&want), "missing:\n  {want}\nin:\n{out}");
        let text = vmnet("").replacen(
            "address = \"192.168.0.11\"",
            &format!("address = \"{bad}\""),
            1,
        );
        let out = rendered(&text);
        let want = format!(
            "line 3: keepalived.address: {bad} cannot be this host's management address: it is {what}"
        );
        assert!(out.contains(&want), "missing:\n  {want}\nin:\n{out}");
        let text = vmnet(&format!("\n[conntrackd]\npeer = \"{bad}\"\n"));
        let out = rendered(&text);
        let want = format!(
            "line {}: conntrackd.peer: {bad} cannot be an end of the sync link: it is {what}",
            line_of(&text, "peer = \"")
        );
        assert!(out.contains(&want), "missing:\n  {want}\nin:\n{out}");
    }
    for bad in ["ff02::12", "::1", "::"] {
        let text = vmnet("").replacen(
            "peers = [\"192.168.0.12\"]",
            &format!("peers = [\"{bad}\"]"),
            1,
        );
        let out = rendered(&text);
        assert!(
            out.contains(&format!("keepalived.peers[0]: {bad} cannot be a peer's")),
            "{out}"
        );
    }
}

/// Issue 40, defect 11: `announce_prefixes` refused `0.0.0.0/0` but took
/// `0.0.0.0/1` + `128.0.0.0/1` (the same space) and loopback, link-local
/// and multicast ranges. An entry shorter than /8 (IPv6: /16), or
/// overlapping a range no announced VIP can come from, is refused; so no
/// set of entries covers the whole space.
#[test]
fn announce_prefixes_cannot_cover_the_whole_space_or_the_host_s_own_ranges() {
    let with = |prefixes: &str| {
        format!("[vip]\nannounce = \"routes\"\nannounce_prefixes = [{prefixes}]\n{GOOD}")
    };
    for (prefix, why) in [
        ("0.0.0.0/1", "is shorter than /8"),
        ("128.0.0.0/1", "is shorter than /8"),
        ("64.0.0.0/7", "is shorter than /8"),
        ("2000::/3", "is shorter than /16"),
        ("0.0.0.0/0", "is every address"),
        ("127.0.0.0/8", "overlaps 127.0.0.0/8, loopback"),
        ("127.1.0.0/16", "overlaps 127.0.0.0/8, loopback"),
        ("169.254.0.0/16", "overlaps 169.254.0.0/16, link-local"),
        ("169.254.169.0/24", "overlaps 169.254.0.0/16, link-local"),
        ("224.0.0.0/4", "is shorter than /8"),
        ("224.0.0.0/8", "overlaps 224.0.0.0/4, multicast"),
        ("239.1.0.0/16", "overlaps 224.0.0.0/4, multicast"),
        ("0.0.0.0/8", "overlaps 0.0.0.0/8"),
        ("240.0.0.0/8", "overlaps 240.0.0.0/4, reserved"),
        ("::1/128", "overlaps ::1/128, loopback"),
        ("fe80::/16", "overlaps fe80::/10, link-local"),
        ("fe80::/64", "overlaps fe80::/10, link-local"),
        ("ff00::/16", "overlaps ff00::/8, multicast"),
        ("ff02::/16", "overlaps ff00::/8, multicast"),
    ] {
        let out = rendered(&with(&format!("\"203.0.113.0/24\", \"{prefix}\"")));
        let want = format!("line 3: vip.announce_prefixes[1]: \"{prefix}\" {why}");
        assert!(out.contains(&want), "missing:\n  {want}\nin:\n{out}");
        assert_eq!(out.lines().count(), 1, "{prefix}: {out}");
    }
    // Both halves: each is named.
    let out = rendered(&with("\"0.0.0.0/1\", \"128.0.0.0/1\""));
    assert_eq!(out.lines().count(), 2, "{out}");
    // Wide pools that stay clear of those ranges are fine.
    for fine in ["10.0.0.0/8", "100.64.0.0/10", "2001:db8::/32", "fd00::/16"] {
        let text = with(&format!("\"{fine}\""));
        assert!(
            config::parse(&text).is_ok(),
            "{fine}: {:?}",
            config::parse(&text).err()
        );
    }
}

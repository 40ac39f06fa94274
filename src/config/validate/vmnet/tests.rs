use crate::config::parse;
use crate::config::test_fixtures::{self, problems};

const NETWORK: &str = r#"
[keepalived]
name = "lb-1"
address = "192.168.0.11"
interface = "mgmt-br"
peers = ["192.168.0.12", "192.168.0.13"]

[[network]]
name = "default/vlan100"
interface = "mgmt-br.100"
prefix_length = 24
gateway = "10.100.0.1"
"#;

/// "default/web" on `vip` in `network`, after a blank line.
fn lb(vip: &str, network: &str) -> String {
    format!(
        "\n{}",
        test_fixtures::lb("default/web", vip, network, &["10.100.0.21"])
    )
}

/// The one problem of `text`: its key, line and message.
fn one(text: &str) -> (String, Option<usize>, String) {
    let p = problems(text);
    assert_eq!(p.len(), 1, "{p:?}");
    (p[0].key.clone(), p[0].line, p[0].message.clone())
}

#[test]
fn a_load_balancer_on_a_network_is_valid_with_the_defaults() {
    let text = format!("{NETWORK}{}", lb("10.100.0.50", "default/vlan100"));
    let loaded = parse(&text).expect("valid");
    let c = &loaded.config;
    assert_eq!(
        c.load_balancers[0].network.as_deref(),
        Some("default/vlan100")
    );
    let n = &c.networks[0];
    assert_eq!(
        (n.interface.as_str(), n.prefix_length, n.table),
        ("mgmt-br.100", 24, 1000)
    );
    assert_eq!(n.subnet().to_string(), "10.100.0.0/24");
    let k = c.keepalived.as_ref().expect("keepalived");
    assert_eq!(k.instances, 3, "one instance per host by default");
    assert_eq!(k.vrid_base, 50);
    assert_eq!(k.advert_interval.as_millis(), 1000);
    assert_eq!(
        k.config_path.to_str(),
        Some("/etc/keepalived/keepalived.conf")
    );
    assert_eq!(k.hosts().len(), 3);
    assert!(loaded.warnings.is_empty(), "{:?}", loaded.warnings);
}

#[test]
fn an_unknown_network_is_named_with_its_line_and_the_defined_ones() {
    let (key, line, msg) = one(&format!("{NETWORK}{}", lb("10.100.0.50", "vlan200")));
    assert_eq!(key, "load_balancer[0].network");
    assert_eq!(line, Some(17));
    assert!(
        msg.contains("\"vlan200\" is not a [[network]]") && msg.contains("default/vlan100"),
        "{msg}"
    );
}

#[test]
fn a_vip_outside_the_subnet_its_gateway_or_a_host_address_is_refused() {
    for (vip, words) in [
        ("10.101.0.50", "outside network"),
        ("10.100.0.1", "gateway"),
        ("10.100.0.0", "own or broadcast"),
        ("10.100.0.255", "own or broadcast"),
        ("fd00::5", "has no ipv6_gateway"),
    ] {
        let (key, line, msg) = one(&format!("{NETWORK}{}", lb(vip, "default/vlan100")));
        assert_eq!(
            (key.as_str(), line),
            ("load_balancer[0].vip", Some(16)),
            "{vip}"
        );
        assert!(msg.contains(words), "{vip}: {msg}");
    }
    // A management address of a keepalived host, on a network that
    // holds it.
    let text = NETWORK
        .replace("10.100.0.1\"", "192.168.0.1\"")
        .replace("= 24", "= 16");
    let (key, _, msg) = one(&format!("{text}{}", lb("192.168.0.12", "default/vlan100")));
    assert_eq!(key, "load_balancer[0].vip");
    assert!(msg.contains("management address"), "{msg}");
}

#[test]
fn an_ipv6_vip_lives_in_the_ipv6_subnet_of_its_network() {
    let text = NETWORK.replace(
        "gateway = \"10.100.0.1\"",
        "gateway = \"10.100.0.1\"\nipv6_gateway = \"fd00:100::1\"",
    );
    // Alone, an IPv6 VIP has no IPv4 instance to ride in.
    let alone = format!("{text}{}", lb("fd00:100::50", "default/vlan100"));
    let (key, line, msg) = one(&alone);
    assert_eq!((key.as_str(), line), ("load_balancer[0].vip", Some(17)));
    assert!(msg.contains("add an IPv4 VIP on a network"), "{msg}");
    let v4 = lb("10.100.0.50", "default/vlan100").replace("default/web", "default/web4");
    let loaded = parse(&format!("{alone}{v4}")).expect("valid");
    let c = &loaded.config;
    assert_eq!(
        c.load_balancers[0].network.as_deref(),
        Some("default/vlan100")
    );
    assert_eq!(
        c.networks[0]
            .ipv6_subnet()
            .map(|n| n.to_string())
            .as_deref(),
        Some("fd00:100::/64")
    );
    for (vip, words) in [
        ("fd00:101::50", "outside network"),
        ("fd00:100::", "own address"),
        ("fd00:100::1", "IPv6 gateway"),
    ] {
        let (key, line, msg) = one(&format!("{text}{}", lb(vip, "default/vlan100")));
        assert_eq!(
            (key.as_str(), line),
            ("load_balancer[0].vip", Some(17)),
            "{vip}"
        );
        assert!(msg.contains(words), "{vip}: {msg}");
    }
    let (key, _, msg) = one(&format!("{text}ipv6_prefix_length = 127\n"));
    assert_eq!(key, "network[0].ipv6_prefix_length");
    assert!(msg.contains("16..=126"), "{msg}");
}

#[test]
fn a_gateway_that_is_no_host_of_its_subnet_and_bad_keys_are_refused() {
    let text = NETWORK.replace("10.100.0.1\"", "10.100.0.0\"");
    let (key, line, msg) = one(&text);
    assert_eq!((key.as_str(), line), ("network[0].gateway", Some(12)));
    assert!(
        msg.contains("not a host of its subnet 10.100.0.0/24"),
        "{msg}"
    );
    let (key, _, msg) = one(&NETWORK.replace("= 24", "= 31"));
    assert_eq!(key, "network[0].prefix_length");
    assert!(msg.contains("8..=30"), "{msg}");
    let (key, _, msg) = one(&format!("{NETWORK}table = 254\n"));
    assert_eq!(key, "network[0].table");
    assert!(msg.contains("254 main"), "{msg}");
    let (key, _, _) = one(&NETWORK.replace("mgmt-br.100", "a/b"));
    assert_eq!(key, "network[0].interface");
}

#[test]
fn vrids_past_255_and_bad_peers_are_refused() {
    let text = NETWORK.replace(
        "interface = \"mgmt-br\"",
        "interface = \"mgmt-br\"\nvrid_base = 250\ninstances = 8",
    );
    let (key, line, msg) = one(&text);
    assert_eq!((key.as_str(), line), ("keepalived.instances", Some(7)));
    assert!(msg.contains("up to 257, past 255"), "{msg}");
    let text = NETWORK.replace("\"192.168.0.12\", ", "\"192.168.0.11\", ");
    let (key, _, msg) = one(&text);
    assert_eq!(key, "keepalived.peers[0]");
    assert!(msg.contains("this host's own"), "{msg}");
    let (key, _, msg) =
        one(&NETWORK.replace("peers = [\"192.168.0.12\", \"192.168.0.13\"]", "peers = []"));
    assert_eq!(key, "keepalived.peers");
    assert!(msg.contains("is empty"), "{msg}");
    let (key, _, _) = one(&NETWORK.replace(
        "interface = \"mgmt-br\"",
        "interface = \"mgmt-br\"\nadvert_interval_ms = 1005",
    ));
    assert_eq!(key, "keepalived.advert_interval_ms");
}

#[test]
fn a_sub_second_advert_interval_with_vrrp_version_2_is_explained() {
    let with = |keys: &str| {
        NETWORK.replace(
            "interface = \"mgmt-br\"",
            &format!("interface = \"mgmt-br\"\n{keys}"),
        )
    };
    let (key, line, msg) = one(&with("vrrp_version = 2\nadvert_interval_ms = 500"));
    assert_eq!(
        (key.as_str(), line),
        ("keepalived.advert_interval_ms", Some(7))
    );
    assert!(
        msg.contains("whole seconds") && msg.contains("vrrp_version = 3"),
        "{msg}"
    );
    let (key, _, msg) = one(&with("vrrp_version = 4"));
    assert_eq!(key, "keepalived.vrrp_version");
    assert!(msg.contains("2..=3"), "{msg}");
    let k = |text: &str| parse(text).expect("valid").config.keepalived.unwrap();
    let v2 = k(&with("vrrp_version = 2\nadvert_interval_ms = 2000"));
    assert_eq!((v2.vrrp_version, v2.advert_interval.as_millis()), (2, 2000));
    let v3 = k(&with("advert_interval_ms = 500"));
    assert_eq!((v3.vrrp_version, v3.advert_interval.as_millis()), (3, 500));
}

/// "default/mgmt" on `vip`, on no network (a management VIP), with a
/// kernel listener `source_nat = "masquerade"` (the default) and the
/// default round robin, after a blank line.
fn management(vip: &str) -> String {
    format!(
        "\n[[load_balancer]]\nname = \"default/mgmt\"\nvip = \"{vip}\"\nbackends = [\"10.100.0.21\"]\n  [[load_balancer.listener]]\n  name = \"pg\"\n  port = 5432\n  backend_port = 30432\n  forwarding = \"kernel\"\n"
    )
}

#[test]
fn management_vips_is_on_by_default_and_a_moved_management_vip_is_told_what_resets_its_flows() {
    let text = format!("{NETWORK}{}", management("192.168.0.50"));
    let loaded = parse(&text).expect("valid");
    let c = &loaded.config;
    let k = c.keepalived.as_ref().unwrap();
    assert!(k.management_vips);
    assert_eq!(
        c.keepalived_interface(&c.load_balancers[0]),
        Some("mgmt-br")
    );
    // Its kernel listener moves with keepalived now: told what resets
    // moved flows, as a network VIP's is.
    let keys: Vec<&str> = loaded.warnings.iter().map(|w| w.key.as_str()).collect();
    assert!(
        keys.contains(&"load_balancer[0].listener[0].source_nat")
            && keys.contains(&"load_balancer[0].algorithm"),
        "{:?}",
        loaded.warnings
    );
    let w = loaded
        .warnings
        .iter()
        .find(|w| w.key == "load_balancer[0].listener[0].source_nat")
        .unwrap();
    assert!(
        w.message
            .contains("a management VIP keepalived moves on keepalived.interface \"mgmt-br\""),
        "{}",
        w.message
    );
    // management_vips = false: not moved here, no such warning; the
    // file (no network used either) moves nothing, which is said.
    let text = format!(
        "{}{}",
        NETWORK.replace("peers = [", "management_vips = false\npeers = ["),
        management("192.168.0.50")
    );
    let loaded = parse(&text).expect("valid");
    let c = &loaded.config;
    assert!(!c.keepalived.as_ref().unwrap().management_vips);
    assert_eq!(c.keepalived_interface(&c.load_balancers[0]), None);
    assert!(
        !loaded
            .warnings
            .iter()
            .any(|w| w.key.starts_with("load_balancer[0]")),
        "{:?}",
        loaded.warnings
    );
    // A value that is no boolean: named.
    let p = problems(&NETWORK.replace("peers = [", "management_vips = \"yes\"\npeers = ["));
    assert!(
        p.iter()
            .any(|p| p.key == "keepalived.management_vips" && p.line == Some(6)),
        "{p:?}"
    );
}

#[test]
fn a_management_vip_that_is_a_keepalived_host_is_refused_and_an_ipv6_one_alone_is_a_warning() {
    for (vip, what) in [
        ("192.168.0.11", "keepalived.address"),
        ("192.168.0.13", "keepalived.peers"),
        ("10.100.0.1", "gateway"),
    ] {
        let p = problems(&format!("{NETWORK}{}", management(vip)));
        assert!(
            p.iter()
                .any(|p| p.key == "load_balancer[0].vip" && p.message.contains(what)),
            "{vip}: {p:?}"
        );
    }
    // IPv6 under IPv4 adverts with no IPv4 VIP to ride with: not
    // placed, said (a network's IPv6 VIP alone is refused).
    let proxied = management("fd00:1::50").replace("  forwarding = \"kernel\"\n", "");
    let loaded = parse(&format!("{NETWORK}{proxied}")).expect("valid");
    assert!(
        loaded
            .warnings
            .iter()
            .any(|w| w.key == "load_balancer[0].vip"
                && w.message.contains("not put in keepalived's file")),
        "{:?}",
        loaded.warnings
    );
    assert!(
        !crate::host::vmnet::keepalived::render(&loaded.config)
            .unwrap()
            .contains("fd00:1::50")
    );
    // An IPv4 management VIP carries a network's IPv6 VIP.
    let text = format!(
        "{}{}{}",
        NETWORK.replace(
            "gateway = \"10.100.0.1\"\n",
            "gateway = \"10.100.0.1\"\nipv6_gateway = \"fd00:100::1\"\n"
        ),
        lb("fd00:100::50", "default/vlan100"),
        management("192.168.0.50")
    );
    let loaded = parse(&text).expect("valid");
    let rendered = crate::host::vmnet::keepalived::render(&loaded.config).unwrap();
    assert!(
        rendered.contains("fd00:100::50/128 dev mgmt-br.100")
            && rendered.contains("192.168.0.50/32 dev mgmt-br"),
        "{rendered}"
    );
}

#[test]
fn an_admin_socket_the_track_script_cannot_quote_is_refused_with_keepalived() {
    let socket = |path: &str| format!("[admin]\nsocket = {path:?}\n{NETWORK}");
    for bad in ["/run/it's/admin.sock", "/run/a\\b.sock", "/run/a\"b.sock"] {
        let (key, line, msg) = one(&socket(bad));
        assert_eq!((key.as_str(), line), ("admin.socket", Some(2)), "{bad}");
        assert!(msg.contains("track script"), "{msg}");
    }
    // Spaces are fine (quoted in the rendered file); without
    // [keepalived] nothing is rendered, so nothing is refused.
    parse(&socket("/run/harvester lb/admin.sock")).expect("a space is quoted");
    parse("[admin]\nsocket = \"/run/it's/admin.sock\"\n").expect("no keepalived");
}

#[test]
fn a_network_needs_keepalived_and_excludes_dhcp_and_announcing() {
    let without = NETWORK.replace("[keepalived]\nname = \"lb-1\"\naddress = \"192.168.0.11\"\ninterface = \"mgmt-br\"\npeers = [\"192.168.0.12\", \"192.168.0.13\"]\n", "");
    let (key, _, msg) = one(&format!(
        "{without}{}",
        lb("10.100.0.50", "default/vlan100")
    ));
    assert_eq!(key, "load_balancer[0].network");
    assert!(msg.contains("needs a [keepalived] section"), "{msg}");
    let announcing = format!(
        "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"10.100.0.0/24\"]\n{NETWORK}{}",
        lb("10.100.0.50", "default/vlan100")
    );
    let p = problems(&announcing);
    assert!(
        p.iter()
            .any(|p| p.key == "load_balancer[0].network" && p.message.contains("vip.announce")),
        "{p:?}"
    );
}

/// A leased load balancer on `default/vlan100` with `dhcp` (lines of
/// its `[load_balancer.dhcp]`) and `extra` keys.
fn leased(extra: &str, dhcp: &str) -> String {
    format!(
        "\n[[load_balancer]]\nname = \"default/dhcp\"\nipam = \"dhcp\"\nnetwork = \"default/vlan100\"\n{extra}backends = [\"10.100.0.21\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n  [load_balancer.dhcp]\n{dhcp}"
    )
}

#[test]
fn a_leased_vip_on_a_network_is_leased_on_the_network_s_interface() {
    // No [keepalived]: keepalived does not move a leased VIP.
    let network = NETWORK.split("[[network]]").nth(1).unwrap();
    let text = format!("[[network]]{network}{}", leased("", ""));
    let loaded = parse(&text).expect("valid");
    let lb = &loaded.config.load_balancers[0];
    assert_eq!(lb.network.as_deref(), Some("default/vlan100"));
    let d = lb.dhcp.as_ref().expect("leased");
    assert_eq!(d.interface, "mgmt-br.100");
    assert_eq!(
        d.allowed_ranges.as_deref(),
        Some(&["10.100.0.0/24".parse().unwrap()][..]),
        "offers outside the subnet are refused"
    );
    // The same interface, written out, is fine; a global range is kept.
    let text = format!(
        "[dhcp]\nallowed_ranges = [\"10.100.0.128/25\"]\n[[network]]{network}{}",
        leased("vip = \"10.100.0.60\"\n", "  interface = \"mgmt-br.100\"\n")
    );
    let loaded = parse(&text).expect("valid");
    let d = loaded.config.load_balancers[0].dhcp.as_ref().unwrap();
    assert_eq!(d.allowed_ranges, None);
    assert_eq!(d.requested, Some("10.100.0.60".parse().unwrap()));
}

#[test]
fn a_leased_vip_on_another_interface_or_subnet_or_leased_elsewhere_is_explained() {
    let (key, line, msg) = one(&format!(
        "{NETWORK}{}",
        leased("", "  interface = \"eth0\"\n")
    ));
    assert_eq!(
        (key.as_str(), line),
        ("load_balancer[0].dhcp.interface", Some(24))
    );
    assert!(
        msg.contains("\"eth0\" is not network \"default/vlan100\"'s interface \"mgmt-br.100\""),
        "{msg}"
    );
    let (key, _, msg) = one(&format!(
        "{NETWORK}{}",
        leased("vip = \"10.200.0.5\"\n", "")
    ));
    assert_eq!(key, "load_balancer[0].vip");
    assert!(msg.contains("outside network"), "{msg}");
    let elsewhere = leased("vip = \"10.100.0.60\"\n", "").replace("  [load_balancer.dhcp]\n", "");
    let (key, _, msg) = one(&format!("{NETWORK}{elsewhere}"));
    assert_eq!(key, "load_balancer[0].ipam");
    assert!(
        msg.contains("leased elsewhere") && msg.contains("empty [load_balancer.dhcp]"),
        "{msg}"
    );
}

#[test]
fn an_unused_network_is_a_warning() {
    let loaded = parse(NETWORK).expect("valid");
    assert!(
        loaded
            .warnings
            .iter()
            .any(|w| w.key == "network[0].name" && w.message.contains("not used")),
        "{:?}",
        loaded.warnings
    );
}

#[test]
fn two_networks_whose_tables_give_one_reply_mark_are_refused() {
    let text = format!(
        "{NETWORK}\n[[network]]\nname = \"default/vlan200\"\ninterface = \"eth1\"\nprefix_length = 24\ngateway = \"10.9.0.1\"\ntable = 1255\n"
    );
    let problems = problems(&text);
    assert!(
        problems.iter().any(|p| p.key == "network[1].table"
            && p.message.contains("reply mark 0xeb")
            && p.message.contains("table 1000")),
        "{problems:?}"
    );
}

#[test]
fn a_network_on_the_management_table_or_its_mark_is_refused_at_its_table() {
    let c = parse(&format!(
        "{NETWORK}{}",
        lb("10.100.0.50", "default/vlan100")
    ))
    .expect("valid");
    let k = c.config.keepalived.as_ref().expect("[keepalived]");
    assert_eq!(k.management_table, crate::config::DEFAULT_MANAGEMENT_TABLE);
    for (table, says) in [
        ("999", "keepalived.management_table too"),
        ("1254", "mark 0xea"),
    ] {
        let text = format!(
            "{}table = {table}\n{}",
            NETWORK,
            lb("10.100.0.50", "default/vlan100")
        );
        let (key, line, msg) = one(&text);
        assert_eq!(
            (key.as_str(), line),
            ("network[0].table", Some(13)),
            "{msg}"
        );
        assert!(msg.contains(says), "{table}: {msg}");
    }
    // Moved out of the network's way: accepted.
    let text = format!(
        "{}table = 999\n{}",
        NETWORK.replace("peers = [", "management_table = 2000\npeers = ["),
        lb("10.100.0.50", "default/vlan100")
    );
    let c = parse(&text).expect("valid");
    assert_eq!(c.config.keepalived.as_ref().unwrap().management_table, 2000);
    for (value, says) in [("254", "254 main"), ("100", "vip.announce_table")] {
        let text = NETWORK.replace(
            "peers = [",
            &format!("management_table = {value}\npeers = ["),
        );
        let (key, _, msg) = one(&format!("{text}{}", lb("10.100.0.50", "default/vlan100")));
        assert_eq!(key, "keepalived.management_table");
        assert!(msg.contains(says), "{msg}");
    }
}

#[test]
fn two_networks_with_one_name_or_table_are_refused() {
    let twice = format!(
        "{NETWORK}\n[[network]]\nname = \"default/vlan100\"\ninterface = \"eth1\"\nprefix_length = 24\ngateway = \"10.9.0.1\"\ntable = 1000\n"
    );
    let p = problems(&twice);
    assert!(
        p.iter()
            .any(|p| p.key == "network[1].name" && p.message.contains("twice")),
        "{p:?}"
    );
    assert!(
        p.iter()
            .any(|p| p.key == "network[1].table" && p.message.contains("table 1000")),
        "{p:?}"
    );
}

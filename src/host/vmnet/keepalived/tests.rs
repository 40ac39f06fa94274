use super::*;
use crate::config::parse;
use crate::config::test_fixtures::KEEPALIVED;

fn conf(address: &str, peers: &str, lbs: &[(&str, &str)]) -> Config {
    conf_with("", address, peers, lbs)
}

/// [`conf`] with `extra` sections first (`[conntrackd]`).
fn conf_with(extra: &str, address: &str, peers: &str, lbs: &[(&str, &str)]) -> Config {
    let mut text = format!(
        "{extra}[admin]\nsocket = \"/run/hlb/admin.sock\"\n[keepalived]\nname = \"h-{address}\"\naddress = \"{address}\"\ninterface = \"mgmt0\"\npeers = [{peers}]\ninstances = 4\n\n[[network]]\nname = \"vlan100\"\ninterface = \"br.100\"\nprefix_length = 22\ngateway = \"10.100.0.1\"\nipv6_gateway = \"fd00:100::1\"\n"
    );
    for (i, (vip, network)) in lbs.iter().enumerate() {
        text.push_str(&format!(
            "[[load_balancer]]\nname = \"default/lb{i}\"\nvip = \"{vip}\"\nnetwork = \"{network}\"\nbackends = [\"10.100.0.21\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n"
        ));
    }
    parse(&text).expect("valid").config
}

fn ten() -> Vec<(String, &'static str)> {
    (0..10)
        .map(|i| (format!("10.100.0.{}", 50 + i), "vlan100"))
        .collect()
}

#[test]
fn the_vips_are_spread_over_instances_and_every_host_is_preferred_master_of_some() {
    let hosts = ["192.168.0.11", "192.168.0.12", "192.168.0.13"];
    let lbs = ten();
    let lbs: Vec<(&str, &str)> = lbs.iter().map(|(v, n)| (v.as_str(), *n)).collect();
    let mut masters: BTreeMap<u8, Vec<&str>> = BTreeMap::new();
    let mut texts = Vec::new();
    for h in hosts {
        let peers: Vec<String> = hosts
            .iter()
            .filter(|p| **p != h)
            .map(|p| format!("\"{p}\""))
            .collect();
        let c = conf(h, &peers.join(", "), &lbs);
        let k = c.keepalived.as_ref().unwrap();
        for i in 0..k.instances {
            if priority(k, i) == TOP_PRIORITY {
                masters.entry(i).or_default().push(h);
            }
        }
        texts.push(render(&c).unwrap());
    }
    // Each instance has exactly one preferred master, and every host
    // is one of them.
    assert!(masters.values().all(|m| m.len() == 1), "{masters:?}");
    for h in hosts {
        assert!(
            masters.values().any(|m| m[0] == h),
            "{h} is nobody's master: {masters:?}"
        );
    }
    // The same VIPs in the same instances on every host.
    let vips = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.contains("/32 dev"))
            .map(str::to_string)
            .collect()
    };
    assert_eq!(vips(&texts[0]), vips(&texts[1]));
    assert_eq!(vips(&texts[1]), vips(&texts[2]));
    assert_eq!(vips(&texts[0]).len(), 10);
    // Ten VIPs over four instances: more than one instance is used.
    let used: std::collections::BTreeSet<u8> = (0..10)
        .map(|i| instance_of(format!("10.100.0.{}", 50 + i).parse().unwrap(), 4))
        .collect();
    assert!(used.len() >= 3, "{used:?}");
}

#[test]
fn an_instance_is_unicast_on_the_management_interface_with_its_vips_on_the_network() {
    let c = conf(
        "192.168.0.11",
        "\"192.168.0.12\"",
        &[("10.100.0.50", "vlan100")],
    );
    let text = render(&c).unwrap();
    let i = instance_of("10.100.0.50".parse().unwrap(), 4);
    let vrid = 50 + u32::from(i);
    for want in [
        "router_id h-192.168.0.11".to_string(),
        format!("vrrp_instance hlb_{vrid} {{"),
        "  interface mgmt0\n".into(),
        format!("  virtual_router_id {vrid}\n"),
        "  unicast_src_ip 192.168.0.11\n  unicast_peer {\n    192.168.0.12\n  }".into(),
        "    10.100.0.50/32 dev br.100\n".into(),
        format!(
            "--unix-socket '/run/hlb/admin.sock' -sf -m 1 -o /dev/null http://localhost/readyz?vrrp_instance={vrid}\""
        ),
        format!("track_script {{\n    hlb_ready_{vrid}\n    hlb_mgmt\n  }}"),
        "vrrp_script hlb_mgmt {\n  script \"/etc/keepalived/harvester-lb-management-check\"\n  interval 1\n  timeout 1\n  fall 1\n  rise 2\n}".into(),
        "garp_master_delay 1\n  garp_master_refresh 60".into(),
    ] {
        assert!(text.contains(&want), "{want:?} not in\n{text}");
    }
    assert!(
        !text.contains("use_vmac") && !text.contains("mcast"),
        "{text}"
    );
}

#[test]
fn ready_requires_backend_makes_each_track_script_ask_for_an_eligible_backend() {
    let vrid = 50 + u32::from(instance_of("10.100.0.50".parse().unwrap(), 4));
    let asks = |text: &str| {
        text.lines()
            .filter(|l| l.contains("/readyz?"))
            .map(|l| l.split("/readyz?").nth(1).unwrap().to_string())
            .collect::<Vec<_>>()
    };
    let text = render(&with_management("", &["10.100.0.50"], &[])).unwrap();
    assert_eq!(asks(&text), [format!("vrrp_instance={vrid}\"")], "{text}");
    let text = render(&with_management(
        "ready_requires_backend = true",
        &["10.100.0.50"],
        &[],
    ))
    .unwrap();
    assert_eq!(
        asks(&text),
        [format!("vrrp_instance={vrid}&require=backend\"")],
        "{text}"
    );
}

/// [`conf`] plus load balancers on no network (management VIPs) on
/// `vips`, after `keepalived_extra` in `[keepalived]`.
fn with_management(keepalived_extra: &str, network_vips: &[&str], vips: &[&str]) -> Config {
    let mut text = format!(
        "[admin]\nsocket = \"/run/hlb/admin.sock\"\n[keepalived]\nname = \"h1\"\naddress = \"192.168.0.11\"\ninterface = \"mgmt0\"\npeers = [\"192.168.0.12\", \"192.168.0.13\"]\ninstances = 4\n{keepalived_extra}\n[[network]]\nname = \"vlan100\"\ninterface = \"br.100\"\nprefix_length = 22\ngateway = \"10.100.0.1\"\n"
    );
    let lbs = network_vips
        .iter()
        .map(|v| (*v, true))
        .chain(vips.iter().map(|v| (*v, false)));
    for (i, (vip, on_network)) in lbs.enumerate() {
        let network = if on_network {
            "network = \"vlan100\"\n"
        } else {
            ""
        };
        text.push_str(&format!(
            "[[load_balancer]]\nname = \"default/lb{i}\"\nvip = \"{vip}\"\n{network}backends = [\"10.100.0.21\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n"
        ));
    }
    parse(&text).expect("valid").config
}

#[test]
fn a_management_vip_is_placed_on_keepalived_s_interface_in_the_instances_of_the_same_hash() {
    // Two management VIPs and two network VIPs.
    let mgmt = ["192.168.0.50", "192.168.0.51"];
    let net = ["10.100.0.50", "10.100.0.51"];
    let c = with_management("", &net, &mgmt);
    let text = render(&c).unwrap();
    for vip in mgmt {
        let i = instance_of(vip.parse().unwrap(), 4);
        let vrid = 50 + u32::from(i);
        // In its instance's block, on the management interface.
        let block = text
            .split(&format!("vrrp_instance hlb_{vrid} {{"))
            .nth(1)
            .and_then(|b| b.split("\nvrrp_").next())
            .unwrap_or_else(|| panic!("no instance {vrid} for {vip}:\n{text}"));
        assert!(
            block.contains(&format!("    {vip}/32 dev mgmt0\n")),
            "{vip} not in hlb_{vrid}:\n{text}"
        );
        // Tracked by the instance's script, which the daemon answers
        // for it too.
        assert!(
            text.contains(&format!("readyz?vrrp_instance={vrid}\"")),
            "{text}"
        );
        assert!(
            instance_vips(&c, vrid).contains(&vip.parse().unwrap()),
            "{vip} not among instance {vrid}'s VIPs"
        );
    }
    // Every VIP once; the network's on their interface.
    for vip in net {
        assert_eq!(
            text.matches(&format!(" {vip}/32 dev br.100\n")).count(),
            1,
            "{text}"
        );
    }
    assert_eq!(text.matches("/32 dev").count(), 4, "{text}");
    // The same file on every host but router_id, addresses and
    // priorities: the VIP lines are the same.
    let vips = |t: &str| -> Vec<String> {
        t.lines()
            .filter(|l| l.contains(" dev "))
            .map(str::to_string)
            .collect()
    };
    let mut c2 = c.clone();
    let k2 = c2.keepalived.as_mut().unwrap();
    k2.address = "192.168.0.12".parse().unwrap();
    k2.peers = vec![
        "192.168.0.11".parse().unwrap(),
        "192.168.0.13".parse().unwrap(),
    ];
    assert_eq!(vips(&text), vips(&render(&c2).unwrap()));
}

#[test]
fn management_vips_off_leased_announced_or_loopback_vips_are_not_placed() {
    let mgmt = ["192.168.0.50", "127.0.9.1"];
    // management_vips = false: only the network's VIP.
    let c = with_management("management_vips = false\n", &["10.100.0.50"], &mgmt);
    let text = render(&c).unwrap();
    assert!(!text.contains("dev mgmt0"), "{text}");
    assert_eq!(text.matches("/32 dev").count(), 1, "{text}");
    // On (the default), the loopback VIP is local to every host
    // already: never placed.
    let c = with_management("", &["10.100.0.50"], &mgmt);
    let text = render(&c).unwrap();
    assert!(text.contains("    192.168.0.50/32 dev mgmt0\n"), "{text}");
    assert!(!text.contains("127.0.9.1"), "{text}");
    // Only management VIPs: the file moves them alone.
    let c = with_management("", &[], &["192.168.0.50"]);
    let text = render(&c).unwrap();
    assert_eq!(text.matches("vrrp_instance hlb_").count(), 1, "{text}");
    // An IPv6 management VIP under IPv4 adverts rides as an excluded
    // address of an instance with an IPv4 VIP, as a network's does.
    let c = with_management("", &[], &["192.168.0.50", "fd00:1::50"]);
    let text = render(&c).unwrap();
    assert!(
        text.contains("  virtual_ipaddress_excluded {\n    fd00:1::50/128 dev mgmt0\n  }\n"),
        "{text}"
    );
    // With vip.announce = "routes" every host holds its VIPs (anycast):
    // keepalived moves none of them.
    let text = format!(
        "[vip]\nannounce = \"routes\"\nannounce_prefixes = [\"192.168.0.0/24\"]\n{KEEPALIVED}[[load_balancer]]\nname = \"default/a\"\nvip = \"192.168.0.50\"\nbackends = [\"10.100.0.21\"]\n  [[load_balancer.listener]]\n  name = \"http\"\n  port = 80\n  backend_port = 30080\n"
    );
    let loaded = parse(&text).expect("valid");
    let text = render(&loaded.config).unwrap();
    assert!(!text.contains("vrrp_instance"), "{text}");
    let said: Vec<&str> = loaded
        .warnings
        .iter()
        .filter(|w| w.key == "keepalived")
        .map(|w| w.message.as_str())
        .collect();
    assert!(said.iter().any(|m| m.contains("moves no VIP")), "{said:?}");
}

#[test]
fn the_hash_is_stable_and_the_advert_interval_is_in_seconds() {
    // Fixed values: a change here moves every VIP to another instance
    // on an upgrade, which must be on purpose.
    assert_eq!(
        instance_of("10.100.0.50".parse().unwrap(), 255),
        instance_of("10.100.0.50".parse().unwrap(), 255)
    );
    let spread: Vec<u8> = (50..54)
        .map(|i| instance_of(format!("10.100.0.{i}").parse().unwrap(), 4))
        .collect();
    assert_eq!(spread, [1, 2, 3, 0]);
    let mut c = conf("192.168.0.11", "\"192.168.0.12\"", &[]);
    let k = c.keepalived.as_mut().unwrap();
    for (ms, text) in [
        (1000, "1"),
        (500, "0.5"),
        (250, "0.25"),
        (1500, "1.5"),
        (30, "0.03"),
    ] {
        k.advert_interval = std::time::Duration::from_millis(ms);
        assert_eq!(advert_text(k), text);
    }
}

#[test]
fn the_vrrp_version_is_rendered_and_a_socket_path_with_spaces_stays_one_word() {
    let mut c = conf(
        "192.168.0.11",
        "\"192.168.0.12\"",
        &[("10.100.0.50", "vlan100")],
    );
    let text = render(&c).unwrap();
    assert!(text.contains("  vrrp_version 3\n"), "{text}");
    c.admin.socket = "/run/harvester lb/admin #1.sock".into();
    let k = c.keepalived.as_mut().unwrap();
    k.vrrp_version = 2;
    let text = render(&c).unwrap();
    assert!(text.contains("  vrrp_version 2\n"), "{text}");
    assert!(
        text.contains("--unix-socket '/run/harvester lb/admin #1.sock' -sf"),
        "{text}"
    );
}

#[test]
fn an_ipv6_vip_under_ipv4_adverts_is_an_excluded_address_of_its_instance() {
    let c = conf(
        "192.168.0.11",
        "\"192.168.0.12\"",
        &[("fd00:100::50", "vlan100"), ("10.100.0.50", "vlan100")],
    );
    let text = render(&c).unwrap();
    // One instance carries 10.100.0.50; the IPv6 VIP rides in it.
    assert_eq!(text.matches("vrrp_instance hlb_").count(), 1, "{text}");
    assert!(
        text.contains("  virtual_ipaddress {\n    10.100.0.50/32 dev br.100\n  }\n  virtual_ipaddress_excluded {\n    fd00:100::50/128 dev br.100\n  }\n"),
        "{text}"
    );
    let vrid = 50 + u32::from(instance_of("10.100.0.50".parse().unwrap(), 4));
    assert!(
        text.contains(&format!("readyz?vrrp_instance={vrid}\"")),
        "{text}"
    );
    // The daemon answers for both, as the file places them.
    let want: Vec<IpAddr> = vec![
        "10.100.0.50".parse().unwrap(),
        "fd00:100::50".parse().unwrap(),
    ];
    assert_eq!(instance_vips(&c, vrid), want);
}

#[test]
fn every_line_stays_short_with_500_vips_in_one_instance_and_the_daemon_s_set_is_the_file_s() {
    let lbs: Vec<(String, &str)> = (0..500)
        .map(|i| (format!("10.100.{}.{}", 1 + i / 250, 1 + i % 250), "vlan100"))
        .collect();
    let lbs: Vec<(&str, &str)> = lbs.iter().map(|(v, n)| (v.as_str(), *n)).collect();
    let mut c = conf("192.168.0.11", "\"192.168.0.12\"", &lbs);
    c.keepalived.as_mut().unwrap().instances = 1;
    let text = render(&c).unwrap();
    let longest = text.lines().map(str::len).max().unwrap();
    assert!(longest < 200, "a line of {longest} bytes");
    assert_eq!(text.matches("vrrp_instance hlb_").count(), 1);
    assert!(text.contains("readyz?vrrp_instance=50\""), "{text}");
    // The set the daemon answers for is the file's, VIP for VIP.
    let advertised = text
        .split("virtual_ipaddress {\n")
        .nth(1)
        .and_then(|t| t.split("  }").next())
        .unwrap();
    assert_eq!(advertised.lines().count(), ADVERTISED_VIPS, "{text}");
    let in_file: std::collections::BTreeSet<IpAddr> = text
        .lines()
        .filter_map(|l| l.trim().strip_suffix("/32 dev br.100"))
        .map(|v| v.parse().unwrap())
        .collect();
    let asked: std::collections::BTreeSet<IpAddr> = instance_vips(&c, 50).into_iter().collect();
    assert_eq!(in_file.len(), 500);
    assert_eq!(asked, in_file);
    // With [conntrackd] (the notify line and track_interface) and in
    // conntrackd's own file: one interface or address per line.
    let mut c = conf_with("[conntrackd]\n", "192.168.0.11", "\"192.168.0.12\"", &lbs);
    c.keepalived.as_mut().unwrap().instances = 1;
    let text = render(&c).unwrap();
    assert!(
        text.contains("  track_interface {\n    br.100\n  }"),
        "{text}"
    );
    let longest = text.lines().map(str::len).max().unwrap();
    assert!(longest < 200, "a line of {longest} bytes");
    let ct = crate::host::conntrack_sync::conntrackd::render_conf(&c).unwrap();
    let longest = ct.lines().map(str::len).max().unwrap();
    assert!(longest < 200, "conntrackd.conf: a line of {longest} bytes");
    // Instances the file does not have: nothing.
    assert!(instance_vips(&c, 51).is_empty());
    assert!(instance_vips(&c, 49).is_empty());
    assert!(instance_vips(&c, 50 + 256).is_empty());
}

#[test]
fn a_removed_section_releases_the_daemon_s_own_file_and_leaves_anyone_else_s() {
    let dir = std::env::temp_dir().join(format!("hlb-released-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = conf(
        "192.168.0.11",
        "\"192.168.0.12\"",
        &[("10.100.0.50", "vlan100")],
    );
    let text = render(&c).unwrap();
    let k = c.keepalived.as_mut().unwrap();
    k.config_path = dir.join("keepalived.conf");
    k.management_check_script = dir.join("check");
    k.reload_command = Some(vec!["/bin/true".into()]);
    // Nothing there: nothing of ours to release.
    assert_eq!(release(k, false).unwrap(), Installed::NotOurs);
    install(k, &text, false).unwrap();
    assert_eq!(release(k, false).unwrap(), Installed::Reloaded);
    let left = std::fs::read_to_string(&k.config_path).unwrap();
    assert!(left.starts_with(HEADER), "{left}");
    assert!(
        left.contains("router_id h-192.168.0.11") && !left.contains("vrrp_instance"),
        "{left}"
    );
    assert_eq!(release(k, false).unwrap(), Installed::Unchanged);
    // A file written by hand since is someone else's.
    std::fs::write(&k.config_path, "vrrp_instance mine {}\n").unwrap();
    assert_eq!(release(k, true).unwrap(), Installed::NotOurs);
    assert_eq!(
        std::fs::read_to_string(&k.config_path).unwrap(),
        "vrrp_instance mine {}\n"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_pid_file_naming_another_program_signals_nobody() {
    let dir = std::env::temp_dir().join(format!("hlb-stale-pid-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = conf("192.168.0.11", "\"192.168.0.12\"", &[]);
    let k = c.keepalived.as_mut().unwrap();
    k.config_path = dir.join("keepalived.conf");
    k.pid_file = dir.join("keepalived.pid");
    // A stale pid file: its pid now belongs to an unrelated process.
    let mut sleep = std::process::Command::new("sleep")
        .arg("300")
        .spawn()
        .expect("sleep");
    std::fs::write(&k.pid_file, format!("{}\n", sleep.id())).unwrap();
    let err = install(k, "a\n", false).unwrap_err();
    assert!(
        matches!(err, KeepalivedError::NotKeepalived { ref what, .. } if what.to_string() == "\"sleep\""),
        "{err:?}"
    );
    assert!(err.to_string().contains("not keepalived"), "{err}");
    // SIGHUP's default action would have ended it (status 129): give
    // such an end a second to show.
    for _ in 0..20 {
        assert!(sleep.try_wait().unwrap().is_none(), "sleep was signalled");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    sleep.kill().unwrap();
    sleep.wait().unwrap();
    // A pid with no process: not signalled either.
    let err = install(k, "b\n", false).unwrap_err();
    assert!(
        matches!(err, KeepalivedError::NotKeepalived { .. }),
        "{err:?}"
    );
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn the_file_is_written_only_when_it_changes_and_a_missing_pid_file_is_an_error() {
    let dir = std::env::temp_dir().join(format!("hlb-keepalived-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut c = conf("192.168.0.11", "\"192.168.0.12\"", &[]);
    let k = c.keepalived.as_mut().unwrap();
    k.config_path = dir.join("keepalived.conf");
    k.pid_file = dir.join("none.pid");
    let err = install(k, "a\n", false).unwrap_err();
    assert!(err.to_string().contains("none.pid"), "{err}");
    assert_eq!(
        std::fs::read_to_string(&k.config_path).unwrap(),
        "a\n",
        "written before the reload failed"
    );
    k.reload_command = Some(vec!["/bin/true".into()]);
    assert_eq!(install(k, "a\n", false).unwrap(), Installed::Unchanged);
    assert_eq!(install(k, "a\n", true).unwrap(), Installed::Reloaded);
    assert_eq!(install(k, "b\n", false).unwrap(), Installed::Reloaded);
    assert_eq!(std::fs::read_to_string(&k.config_path).unwrap(), "b\n");
    k.reload_command = Some(vec!["/bin/false".into()]);
    assert!(install(k, "c\n", false).is_err());
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left.len(), 1, "no temporary file left: {left:?}");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// With `[conntrackd]` every instance waits `preempt_delay` before it
/// takes its instance back (its backup transition closes the gate
/// meanwhile: `conntrackd::PREEMPT_DELAY_S`); without it, none waits.
#[test]
fn with_the_sync_every_instance_waits_before_it_takes_its_vips_back() {
    let lbs = [("10.100.0.50", "vlan100"), ("10.100.0.51", "vlan100")];
    let synced = render(&conf_with(
        "[conntrackd]\n",
        "192.168.0.11",
        "\"192.168.0.12\"",
        &lbs,
    ))
    .unwrap();
    let instances = synced.matches("vrrp_instance hlb_").count();
    assert!(instances > 0, "{synced}");
    let line = format!(
        "  preempt_delay {}\n",
        crate::host::conntrack_sync::conntrackd::PREEMPT_DELAY_S
    );
    assert_eq!(synced.matches(&line).count(), instances, "{synced}");
    let plain = render(&conf("192.168.0.11", "\"192.168.0.12\"", &lbs)).unwrap();
    assert!(!plain.contains("preempt_delay"), "{plain}");
}

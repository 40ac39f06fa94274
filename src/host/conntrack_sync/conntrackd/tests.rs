use super::*;
use crate::config::parse;
use crate::config::test_fixtures::{ANYCAST, ANYCAST_SYNC, KEEPALIVED, VLAN100, db};

/// Host "a" of a keepalived pair: "default/db" on "vlan100" with the
/// kernel listener "pg" and a proxy listener, and "default/other" on no
/// network.
fn keepalived_text() -> String {
    format!(
        r#"
[admin]
socket = "/run/hlb/admin.sock"
{KEEPALIVED}instances = 2

[conntrackd]
interface = "sync0"
address = "10.99.0.1"
peer = "10.99.0.2"
socket = "/run/hlb/ctd.ctl"

{VLAN100}
{}{}"#,
        db("backends = [\"10.100.0.22\", \"10.100.0.21\"]\n"),
        web_and_other("10.100.0.60", "10.100.0.31")
    )
}

/// The proxy listener "web" (80 to 30080) of the load balancer before,
/// then "default/other" on `vip` with the kernel UDP listener "dns" (53
/// to 30053) on `backend`.
fn web_and_other(vip: &str, backend: &str) -> String {
    format!(
        r#"  [[load_balancer.listener]]
  name = "web"
  port = 80
  backend_port = 30080

[[load_balancer]]
name = "default/other"
vip = "{vip}"
backends = ["{backend}"]
  [[load_balancer.listener]]
  name = "dns"
  port = 53
  protocol = "udp"
  backend_port = 30053
  forwarding = "kernel"
"#
    )
}

#[test]
fn the_filter_holds_the_backends_of_kernel_listeners_on_moving_vips_only() {
    let config = parse(&keepalived_text()).expect("valid").config;
    let conf = render_conf(&config).unwrap();
    for want in [
        "\tMode FTFW {\n\t\tPurgeTimeout 15\n",
        "\t\tIPv4_address 10.99.0.1\n\t\tIPv4_Destination_Address 10.99.0.2\n\t\tPort 3780\n\t\tInterface sync0\n",
        "\tHashSize 32768\n",
        "\tSystemd on\n",
        "\t\tPath /run/hlb/ctd.ctl\n",
        "\t\tAddress Accept {\n\t\t\tIPv4_address 10.100.0.21\n\t\t\tIPv4_address 10.100.0.22\n\t\t\tIPv4_address 10.100.0.31\n\t\t}",
        "\t\t\tTCP\n\t\t\tUDP\n",
    ] {
        assert!(conf.contains(want), "{want:?} not in\n{conf}");
    }
    assert!(
        !conf.contains("10.100.0.50"),
        "the VIP is never in the filter: {conf}"
    );
    // The VIP on no network is a management VIP keepalived moves on
    // keepalived.interface (`management_vips`, default on): its kernel
    // listener's backend is synced and gated like the network's.
    assert!(conf.contains("\t\t\tIPv4_address 10.100.0.31\n"), "{conf}");
    let g = gated(&config);
    assert_eq!(g.len(), 2, "{g:?}");
    let db = g.iter().find(|g| g.port == 5432).expect("db gated");
    assert_eq!(db.backend_port, 30432);
    let other = g.iter().find(|g| g.port == 53).expect("other gated");
    assert_eq!(
        (other.vip, other.backends.as_slice()),
        (
            "10.100.0.60".parse().unwrap(),
            &["10.100.0.31".parse().unwrap()][..]
        )
    );
    let mut want = vec![db.vrid, other.vrid];
    want.sort_unstable();
    want.dedup();
    assert_eq!(vrids(&config), want);
    // With management_vips = false (kube-vip holds it): not moved by
    // this keepalived, so not synced; a proxy listener's backend on its
    // own never is.
    let text = keepalived_text().replace(
        "instances = 2\n",
        "instances = 2\nmanagement_vips = false\n",
    );
    let config = parse(&text).expect("valid").config;
    let conf = render_conf(&config).unwrap();
    assert!(!conf.contains("10.100.0.31"), "{conf}");
    let g = gated(&config);
    assert_eq!(g.len(), 1, "{g:?}");
    assert_eq!((g[0].port, g[0].backend_port), (5432, 30432));
    assert_eq!(vrids(&config), vec![g[0].vrid]);
}

/// More than two hosts: the multicast block of the three-host note
/// (group, its port as `Group`, joined from this host's sync address
/// on the sync link), in both modes; no unicast line is left.
#[test]
fn the_multicast_transport_renders_the_group_block_in_both_modes() {
    let three = keepalived_text()
        .replace(
            "peers = [\"192.168.0.12\"]",
            "peers = [\"192.168.0.12\", \"192.168.0.13\"]",
        )
        .replace(
            "peer = \"10.99.0.2\"\n",
            "multicast_group = \"239.1.2.3\"\nport = 3781\n",
        );
    let config = parse(&three).expect("valid").config;
    let conf = render_conf(&config).unwrap();
    // NOTRACK: FTFW drops the messages of all senders but one.
    assert!(
        conf.contains("\tMode NOTRACK {\n\t\tPurgeTimeout 15\n"),
        "{conf}"
    );
    assert!(!conf.contains("FTFW"), "{conf}");
    let block = "\tMulticast {\n\t\tIPv4_address 239.1.2.3\n\t\tGroup 3781\n\t\tIPv4_interface 10.99.0.1\n\t\tInterface sync0\n\t\tSndSocketBuffer 1249280\n\t\tRcvSocketBuffer 1249280\n\t\tChecksum on\n\t}\n}\nGeneral {\n";
    assert!(conf.contains(block), "{block:?} not in\n{conf}");
    for gone in ["UDP {", "IPv4_Destination_Address", "\tPort "] {
        assert!(!conf.contains(gone), "{gone:?} in\n{conf}");
    }
    // The anycast mode: multicast without a peer, the default group.
    let text = format!(
        "{ANYCAST}{}",
        ANYCAST_SYNC.replace("peer = \"10.99.0.2\"\n", "transport = \"multicast\"\n")
    );
    let config = parse(&text).expect("valid").config;
    assert!(anycast(&config));
    let conf = render_conf(&config).unwrap();
    for want in [
        "\tMode NOTRACK {\n",
        "\t\tDisableExternalCache On\n",
        "\tMulticast {\n\t\tIPv4_address 225.0.0.50\n\t\tGroup 3780\n\t\tIPv4_interface 10.99.0.1\n\t\tInterface eth1\n",
    ] {
        assert!(conf.contains(want), "{want:?} not in\n{conf}");
    }
    assert!(!conf.contains("IPv4_Destination_Address"), "{conf}");
}

/// Issue 42: an IPv6 VIP's kernel listeners were left out of the
/// sync (no `IPv6_address` in the filter), the gate and the notify
/// script's deletions; now each has them, in the instance keepalived's
/// rendered file puts the VIP in (an IPv6 VIP rides in one of the
/// instances with IPv4 VIPs, not by the hash over all of them).
#[test]
fn an_ipv6_vip_s_kernel_flows_are_synced_gated_and_deleted_in_its_instance() {
    let text = format!(
        "{}{}\n[[load_balancer]]\nname = \"default/v6\"\nvip = \"fd00:100::50\"\nnetwork = \"vlan100\"\nbackends = [\"fd00:100::22\", \"fd00:100::21\"]\n  [[load_balancer.listener]]\n  name = \"pg\"\n  port = 5432\n  backend_port = 30432\n  forwarding = \"kernel\"\n  source_nat = \"none\"\n",
        keepalived_text().replace(
            "gateway = \"10.100.0.1\"\n",
            "gateway = \"10.100.0.1\"\nipv6_gateway = \"fd00:100::1\"\n"
        ),
        "",
    )
    .replace("instances = 2", "instances = 8");
    let config = parse(&text).expect("valid").config;
    let conf = render_conf(&config).unwrap();
    assert!(
        conf.contains("\t\t\tIPv4_address 10.100.0.22\n\t\t\tIPv4_address 10.100.0.31\n\t\t\tIPv6_address fd00:100::21\n\t\t\tIPv6_address fd00:100::22\n"),
        "{conf}"
    );
    let vip: IpAddr = "fd00:100::50".parse().unwrap();
    let g: Vec<Gated> = gated(&config)
        .into_iter()
        .filter(|g| g.vip == vip)
        .collect();
    assert_eq!(g.len(), 1, "{g:?}");
    let vrid = g[0].vrid;
    assert_eq!(g[0].backends.len(), 2, "{g:?}");
    // The instance keepalived's file carries it in.
    assert!(
        crate::host::vmnet::keepalived::instance_vips(&config, vrid).contains(&vip),
        "vrid {vrid}"
    );
    assert!(vrids(&config).contains(&vrid));
    let script = render_script(&config).unwrap();
    assert!(
        script
            .lines()
            .any(|l| l.starts_with(&format!("\t{vrid}) echo ")) && l.contains("fd00:100::50")),
        "{script}"
    );
    let gate = crate::host::conntrack_sync::gate::Gate {
        gated: gated(&config),
        vrids: vrids(&config),
        masters: Default::default(),
    }
    .script(&Default::default());
    for want in [
        "type ipv6_addr . inet_proto . inet_service : verdict",
        &format!("fd00:100::50 . tcp . 5432 : jump g_{vrid}"),
        &format!("fd00:100::21 . tcp . 30432 : jump g_{vrid}"),
        "fib daddr type local ip6 daddr . meta l4proto . th dport vmap @to6",
        "ip6 saddr . meta l4proto . th sport vmap @from6",
    ] {
        assert!(gate.contains(want), "{want:?} not in\n{gate}");
    }
}

/// The anycast mode over multicast syncs in NOTRACK (every host sends
/// all the time, and an FTFW receiver drops the messages of whichever
/// sender's sequence is behind), as the keepalived mode over
/// multicast does; over unicast it stays FTFW.
#[test]
fn the_anycast_mode_over_multicast_syncs_in_notrack() {
    let mode = |text: &str| {
        let config = parse(text).expect("valid").config;
        let conf = render_conf(&config).unwrap();
        let mode = conf
            .lines()
            .find_map(|l| l.trim().strip_prefix("Mode "))
            .map(|m| m.trim_end_matches(" {").to_string());
        (mode, conf.contains("DisableExternalCache On"))
    };
    let multicast = format!(
        "{ANYCAST}{}",
        ANYCAST_SYNC.replace("peer = \"10.99.0.2\"\n", "transport = \"multicast\"\n")
    );
    assert_eq!(mode(&multicast), (Some("NOTRACK".into()), true));
    assert_eq!(
        mode(&format!("{ANYCAST}{ANYCAST_SYNC}")),
        (Some("FTFW".into()), true)
    );
    let three = keepalived_text()
        .replace(
            "peers = [\"192.168.0.12\"]",
            "peers = [\"192.168.0.12\", \"192.168.0.13\"]",
        )
        .replace("peer = \"10.99.0.2\"\n", "");
    // The keepalived mode over multicast is NOTRACK too (three masters
    // send at once: `mode`).
    assert_eq!(mode(&three), (Some("NOTRACK".into()), false));
}

#[test]
fn the_script_commits_then_opens_the_gate_and_names_the_file_on_every_call() {
    let config = parse(&keepalived_text()).expect("valid").config;
    let s = render_script(&config).unwrap();
    let master = &s[s.find("MASTER)").unwrap()..s.find("BACKUP)").unwrap()];
    let commit = master.find("-c >/dev/null").unwrap();
    let open = master.find("gate_open").unwrap();
    let flush = master.find("ctd -f").unwrap();
    assert!(commit < open && open < flush, "{master}");
    assert!(
        s.contains("CONF='/etc/conntrackd/conntrackd.conf'\n"),
        "{s}"
    );
    // Every conntrackd call names the file.
    for line in s.lines().filter(|l| l.contains("conntrackd ")) {
        assert!(
            line.contains("-C \"$CONF\"")
                || line.trim_start().starts_with('#')
                || line.contains("logger"),
            "{line}"
        );
    }
    let backup = &s[s.find("BACKUP)").unwrap()..];
    assert!(
        backup.find("gate_close").unwrap() < backup.find("tidy_later").unwrap(),
        "{backup}"
    );
    // Not conntrackd -t (it purges every instance's synced flows), and
    // the stale entries deleted right before the commit.
    assert!(!s.contains("ctd -t"), "{s}");
    assert!(master.find("forget $vips").unwrap() < commit, "{master}");
    // The management VIP ("default/other", on no network) is in the
    // same instance here (two instances): its flows are deleted and
    // committed with it.
    assert!(s.contains(") echo \"10.100.0.50 10.100.0.60\" ;;"), "{s}");
}

/// The rendered script under `sh`, with `conntrack`, `conntrackd`,
/// `nft` and `logger` replaced by recorders, `PURGE_S` by 1 s, and a
/// commit that takes 2 s.
struct Sandbox {
    dir: std::path::PathBuf,
    script: std::path::PathBuf,
    log: std::path::PathBuf,
}

impl Sandbox {
    fn new(name: &str) -> Sandbox {
        Sandbox::with_state_directory(name, "state")
    }

    /// As [`Sandbox::new`], the state directory `state` under its
    /// directory (any text: `check` is not asked).
    fn with_state_directory(name: &str, state: &str) -> Sandbox {
        let dir = std::env::temp_dir().join(format!("hlb-notify-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let fake = dir.join("bin");
        std::fs::create_dir_all(&fake).unwrap();
        let log = dir.join("calls");
        for tool in ["conntrack", "conntrackd", "nft", "logger"] {
            let body = format!(
                "#!/bin/sh\ncase \"$*\" in *' -c') echo \"{tool} commit begin\" >>{log}; sleep 2; echo \"{tool} commit end\" >>{log} ;; *) echo \"{tool} $*\" >>{log} ;; esac\nexit 0\n",
                log = log.display()
            );
            let path = fake.join(tool);
            std::fs::write(&path, body).unwrap();
            use std::os::unix::fs::PermissionsExt;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).unwrap();
        }
        let mut config = parse(&keepalived_text()).expect("valid").config;
        config.conntrackd.as_mut().unwrap().state_directory = dir.join(state);
        let text = render_script(&config)
            .unwrap()
            .replace(
                "PATH=/usr/sbin:/usr/bin:/sbin:/bin",
                &format!("PATH={}:/usr/bin:/bin", fake.display()),
            )
            .replace(&format!("sleep {PURGE_S}"), "sleep 1");
        let script = dir.join("notify.sh");
        std::fs::write(&script, text).unwrap();
        Sandbox { dir, script, log }
    }

    fn run(&self, state: &str) -> std::process::Child {
        let vrid = vrids(&parse(&keepalived_text()).expect("valid").config)[0];
        std::process::Command::new("sh")
            .arg(&self.script)
            .args(["INSTANCE", &instance_name(vrid), state, "100"])
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::null())
            .spawn()
            .expect("sh")
    }

    fn calls(&self) -> Vec<String> {
        std::fs::read_to_string(&self.log)
            .unwrap_or_default()
            .lines()
            .map(String::from)
            .collect()
    }

    /// Polls the calls until `done` says so (`polls` × 50 ms at most).
    fn wait(&self, polls: u32, done: impl Fn(&[String]) -> bool) -> Vec<String> {
        for _ in 0..polls {
            let calls = self.calls();
            if done(&calls) {
                return calls;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        self.calls()
    }
}

impl Drop for Sandbox {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// Whether `flock` (util-linux, which the notify script runs) is
/// missing: the script's tests skip then, except under CI, where a
/// skip would pass a machine that tested nothing.
fn flock_missing() -> bool {
    if std::process::Command::new("flock")
        .arg("-V")
        .output()
        .is_ok()
    {
        return false;
    }
    assert!(
        std::env::var_os("CI").is_none(),
        "flock (util-linux) is missing, and CI must not skip the notify script's tests"
    );
    eprintln!("skipped: no flock (util-linux)");
    true
}

/// Issue 40, defect 10: a path with shell metacharacters (which
/// `check` refuses; here the settings are made directly) is one
/// literal word of the script: nothing in it runs.
#[test]
fn a_path_in_the_notify_script_is_data_never_commands() {
    if flock_missing() {
        return;
    }
    let odd = "s;touch PWNED;:$(touch PWNED2)`touch PWNED3`'q'(";
    let sandbox = Sandbox::with_state_directory("quoted", odd);
    let out = std::process::Command::new("sh")
        .arg(&sandbox.script)
        .args(["INSTANCE", "hlb_0", "FAULT", "100"])
        .current_dir(&sandbox.dir)
        .output()
        .expect("sh");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for made in ["PWNED", "PWNED2", "PWNED3"] {
        assert!(
            !sandbox.dir.join(made).exists(),
            "the path's text ran as a command ({made})"
        );
    }
    // The state went to the directory of that literal name.
    let r =
        parse_recorded(&std::fs::read_to_string(sandbox.dir.join(odd).join("0")).unwrap()).unwrap();
    assert_eq!(r.state, "FAULT");
    assert_eq!(
        shell_quote("a'b"),
        "'a'\\''b'",
        "a quote ends the word, is escaped, and the word goes on"
    );
}

#[test]
fn a_deletion_scheduled_before_a_takeover_never_deletes_what_it_committed() {
    if flock_missing() {
        return;
    }
    let delete = "conntrack -D --orig-dst 10.100.0.50";
    // Alone, a backup transition deletes this host's copies 1 s later,
    // with conntrackd's internal cache emptied first and filled again
    // after (so conntrackd tells its peers of no flow's end: a third
    // host keeps the flows in its cache).
    let alone = Sandbox::new("alone");
    assert!(alone.run("BACKUP").wait().unwrap().success());
    let resync = |c: &[String]| c.iter().position(|l| l.ends_with(" -R"));
    let calls = alone.wait(200, |c| resync(c).is_some());
    let at = |what: &str| calls.iter().position(|l| l.ends_with(what));
    let (emptied, deleted) = (at(" -f internal"), at(delete));
    assert!(
        emptied.is_some() && emptied < deleted && deleted < resync(&calls),
        "{calls:?}"
    );
    // Then the peers are asked for their flows again.
    let calls = alone.wait(200, |c| {
        c.iter().rposition(|l| l.ends_with(" -n")) > resync(c)
    });
    assert!(
        calls.iter().rposition(|l| l.ends_with(" -n")) > resync(&calls),
        "{calls:?}"
    );

    // A takeover whose commit is under way when that deletion comes
    // due: the deletion waits for it, sees a later transition, and
    // deletes nothing; the takeover's own deletion comes before its
    // commit.
    let race = Sandbox::new("race");
    assert!(race.run("BACKUP").wait().unwrap().success());
    assert!(race.run("MASTER").wait().unwrap().success());
    // The deletion was due during the commit; once the lock is free it
    // decides: 3 s for a second deletion to show (none must).
    let calls = race.wait(60, |c| c.iter().filter(|l| *l == delete).count() > 1);
    let commit = calls
        .iter()
        .position(|l| l == "conntrackd commit begin")
        .unwrap_or_else(|| panic!("no commit: {calls:?}"));
    assert_eq!(
        calls.iter().filter(|l| *l == delete).count(),
        1,
        "{calls:?}"
    );
    assert!(
        calls.iter().position(|l| l == delete).unwrap() < commit,
        "{calls:?}"
    );
    let state = std::fs::read_to_string(
        race.dir
            .join("state")
            .join(vrids(&parse(&keepalived_text()).expect("valid").config)[0].to_string()),
    )
    .unwrap();
    let r = parse_recorded(&state).unwrap();
    assert_eq!(
        (r.state.as_str(), r.commit_ok),
        ("MASTER", Some(true)),
        "{state}"
    );

    // A transition that finds a later one of this boot recorded (the
    // two raced for the lock) does nothing; one of another boot does
    // not count.
    let stale = Sandbox::new("stale");
    let vrid = vrids(&parse(&keepalived_text()).expect("valid").config)[0];
    let file = stale.dir.join("state").join(vrid.to_string());
    std::fs::create_dir_all(file.parent().unwrap()).unwrap();
    let boot = std::fs::read_to_string("/proc/sys/kernel/random/boot_id").unwrap();
    std::fs::write(
        &file,
        format!(
            "state=MASTER\nseq=4\nat_boot={}\nat_cs=99999999999\n",
            boot.trim()
        ),
    )
    .unwrap();
    assert!(stale.run("BACKUP").wait().unwrap().success());
    assert_eq!(stale.calls(), Vec::<String>::new());
    std::fs::write(
        &file,
        "state=MASTER\nseq=4\nat_boot=another\nat_cs=99999999999\n",
    )
    .unwrap();
    assert!(stale.run("BACKUP").wait().unwrap().success());
    assert!(
        stale.calls().iter().any(|l| l == "nft -f -"),
        "{:?}",
        stale.calls()
    );
    let r = parse_recorded(&std::fs::read_to_string(&file).unwrap()).unwrap();
    assert_eq!(r.state, "BACKUP");
}

#[test]
fn a_conntrackd_started_before_its_file_was_written_is_pending_a_restart() {
    let text = "daemon uptime: 12 min\n\nnetlink stats:\n\tevents received:\t 76\n";
    assert_eq!(parse_uptime_min(text), Some(12));
    assert_eq!(parse_uptime_min("connect: No such file"), None);
    let now = 1_700_000_000;
    // Started 12-13 min ago, the file written 5 min ago: pending.
    assert!(restart_pending(now - 300, now, 12));
    // Written 20 min ago, started at most 13 min ago: it read it.
    assert!(!restart_pending(now - 1200, now, 12));
    // Uptime 0 min and the file 30 s old: it may have started after
    // the write (uptime has minute steps), so not said (issue 40: a
    // conntrackd started after the file was warned about).
    assert!(!restart_pending(now - 30, now, 0));
    // Uptime 1 min (60-119 s) and the file 30 s old: surely before.
    assert!(restart_pending(now - 30, now, 1));
}

#[test]
fn recorded_states_and_conntrackd_statistics_are_read() {
    let r = parse_recorded(
        "state=MASTER\nat=1700000000123\ncommit_result=ok\ncommit_at=1700000000120\ncommit_ms=4\ncommits_ok=3\ncommits_failed=1\n",
    )
    .unwrap();
    assert_eq!(r.state, "MASTER");
    assert_eq!(
        (r.commit_ok, r.commit_ms, r.commits_ok, r.commits_failed),
        (Some(true), Some(4), 3, 1)
    );
    let b = parse_recorded("state=BACKUP\nat=5\ncommit_result=\ncommit_at=\ncommit_ms=\ncommits_ok=0\ncommits_failed=0\n").unwrap();
    assert_eq!((b.commit_ok, b.commit_ms), (None, None));
    assert_eq!(parse_recorded("junk\n"), None);

    // conntrackd 1.4.7's `-s` of a FTFW daemon (abridged).
    let text = "cache internal:\ncurrent active connections:\t          24\nconnections created:\t\t          30\tfailed:\t           0\n\ncache external:\ncurrent active connections:\t          20\nconnections created:\t\t          20\tfailed:\t           0\n\ntraffic processed:\n                   0 Bytes                         0 Pckts\n\nUDP traffic (active device=sync0):\n                8576 Bytes sent                 1768 Bytes recv\n                  89 Pckts sent                   36 Pckts recv\n                   0 Error send                    0 Error recv\n\nmessage tracking:\n                   0 Malformed msgs                    2 Lost msgs\n";
    let s = parse_stats(text).unwrap();
    assert_eq!(
        s,
        Stats {
            internal: 24,
            external: 20,
            packets_sent: 89,
            packets_received: 36,
            send_errors: 0,
            lost: 2,
        }
    );
    assert_eq!(parse_stats("connect: No such file"), None);
}

#[test]
fn the_anycast_mode_injects_into_the_kernel_and_guards_the_handshake() {
    let text = format!(
        "{ANYCAST}{}{ANYCAST_SYNC}",
        web_and_other("203.0.113.9", "192.0.2.31")
    );
    let config = parse(&text).expect("valid").config;
    assert!(anycast(&config));
    let conf = render_conf(&config).unwrap();
    for want in [
        "\t\tStartupResync on\n\t\t# Anycast",
        "\t\tDisableExternalCache On\n\t}\n",
        "\tSystemd on\n",
        "\t\tIPv4_address 10.99.0.1\n\t\tIPv4_Destination_Address 10.99.0.2\n",
        "\t\tAddress Accept {\n\t\t\tIPv4_address 192.0.2.21\n\t\t\tIPv4_address 192.0.2.22\n\t\t}",
        // Its header points to the mode's own section.
        "# docs/many-hosts.md, \"Keeping connections across a withdrawal: the anycast sync\"",
    ] {
        assert!(conf.contains(want), "{want:?} not in\n{conf}");
    }
    assert!(!conf.contains("DisableInternalCache"), "{conf}");
    // The VIP outside announce_prefixes is not announced: not synced.
    assert!(!conf.contains("192.0.2.31"), "{conf}");
    // No transitions, so no script.
    assert_eq!(render_script(&config), None);
    let guard = anycast_table(&config).unwrap();
    for want in [
        "elements = { 198.51.100.100 . tcp . 5432 }",
        "elements = { 192.0.2.21 . tcp . 30432, 192.0.2.22 . tcp . 30432 }",
        "priority -150;",
        "@to4 ct state invalid drop",
        "@from4 ct state { invalid, new } drop",
    ] {
        assert!(guard.contains(want), "{want:?} not in\n{guard}");
    }
    // The keepalived mode: no guard, the conf as before.
    let keepalived = parse(&keepalived_text()).expect("valid").config;
    assert!(!anycast(&keepalived));
    assert_eq!(anycast_table(&keepalived), None);
    let conf = render_conf(&keepalived).unwrap();
    assert!(
        !conf.contains("DisableExternalCache")
            && conf.contains("\tSystemd on\n")
            && conf.contains("# docs/vip.md, \"Open connections across a VIP's move\""),
        "{conf}"
    );
}

/// The same state notified twice by one keepalived process (the script's
/// parent, recorded as `by`) is one transition: the second run commits
/// nothing (a second MASTER would delete the entries the first
/// committed). The same state from another process (a keepalived started
/// again) runs.
#[test]
fn one_keepalived_notifying_the_same_state_twice_commits_once() {
    if flock_missing() {
        return;
    }
    let twice = Sandbox::new("twice");
    let commits = |c: &[String]| c.iter().filter(|l| *l == "conntrackd commit begin").count();
    // Both children of this test process: one keepalived.
    assert!(twice.run("MASTER").wait().unwrap().success());
    assert!(twice.run("MASTER").wait().unwrap().success());
    assert_eq!(commits(&twice.calls()), 1, "{:?}", twice.calls());
    // From another parent (a shell that stays between): it commits.
    let vrid = vrids(&parse(&keepalived_text()).expect("valid").config)[0];
    let other = std::process::Command::new("sh")
        .arg("-c")
        .arg(format!(
            "sh '{}' INSTANCE {} MASTER 100; true",
            twice.script.display(),
            instance_name(vrid)
        ))
        .status()
        .expect("sh");
    assert!(other.success());
    assert_eq!(commits(&twice.calls()), 2, "{:?}", twice.calls());
}

//! The kernel table's health flips at scale: written over netlink, without
//! `nft` (which lists the whole table before every change), and reading
//! back exactly as `nft` writes the same state.
//!
//! The test takes `nft` off the process's `PATH` for the flip, so it runs
//! in a process of its own: a child of the test binary running this test
//! alone (the other modules' tests in the same binary spawn `ip` and `nft`
//! meanwhile). Needs root, iproute2 and nftables; skips elsewhere, fails
//! under `CI=true`.

// The test bed times real processes and kernels, not tokio tasks.
#![allow(clippy::disallowed_types, clippy::disallowed_methods)]

use crate::netns;
use crate::require_netns;

use std::net::IpAddr;

use harvester_lb::config::{Protocol, SourceNat};
use harvester_lb::host::nat::{self as kernel, Desired, KernelListener, KernelTable, Synced};
use netns::{Scratch, in_ns, run};

/// Deletes every table of the daemon's (each shard's), as an operator's
/// script would.
const DELETE_OUR_TABLES: &str = "nft list tables inet | awk '$3 ~ /^harvester_lb_nat/ { print \"delete table inet \" $3 }' | nft -f -";

/// `nft list chain` of a listener's chain, in its table in namespace
/// `ns`, by the binary's full path.
fn chain(ns: &Scratch, id: &kernel::ListenerId) -> String {
    let name = format!("l_{}", id_tag(id));
    let out = std::process::Command::new("ip")
        .args(["netns", "exec", &ns.0, "/usr/sbin/nft", "list", "chain"])
        .args(["inet", &kernel::table_of(id), &name])
        .output()
        .expect("run nft");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `n` listeners, v4 and v6, TCP and UDP, every fifth with source ranges,
/// three backends each, all eligible.
fn desired(n: usize) -> Desired {
    let mut d = Desired::new();
    for i in 0..n {
        let (a, b) = ((i / 250) as u8, (i % 250 + 1) as u8);
        let v6 = i % 3 == 0;
        let vip: IpAddr = if v6 {
            format!("2001:db8:ff::{a:x}:{b:x}").parse().unwrap()
        } else {
            format!("192.0.{a}.{b}").parse().unwrap()
        };
        let members: Vec<IpAddr> = (0..3)
            .map(|j| {
                if v6 {
                    format!("2001:db8:{j}::{a:x}:{b:x}").parse().unwrap()
                } else {
                    format!("10.{j}.{a}.{b}").parse().unwrap()
                }
            })
            .collect();
        let protocol = if i % 2 == 0 {
            Protocol::Tcp
        } else {
            Protocol::Udp
        };
        d.insert(
            (vip, protocol, 80),
            KernelListener {
                source_ranges: (i % 5 == 0).then(|| {
                    vec![
                        "10.128.0.0/9".parse().unwrap(),
                        "2001:db8:aa::/48".parse().unwrap(),
                    ]
                }),
                source_nat: if i % 4 == 0 {
                    SourceNat::None
                } else {
                    SourceNat::Masquerade
                },
                // Round robin without affinity: the listeners whose flips
                // go over netlink (a bucket map or affinity sets go
                // through `nft`).
                ..KernelListener::round_robin(30080, members.clone(), members)
            },
        );
    }
    d
}

/// Set in the child process that runs the test alone (see the header).
const ALONE: &str = "HLB_KERNEL_SCALE_ALONE";

#[test]
fn health_flips_and_a_failed_node_are_written_without_nft_and_read_back_as_nft_writes_them() {
    require_netns!();
    if std::env::var_os(ALONE).is_none() {
        let name = "kernel_scale::health_flips_and_a_failed_node_are_written_without_nft_and_read_back_as_nft_writes_them";
        let out = std::process::Command::new(std::env::current_exe().expect("current exe"))
            .args([name, "--exact", "--nocapture", "--test-threads=1"])
            .env(ALONE, "1")
            .output()
            .expect("run the test binary");
        let (stdout, stderr) = (
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        print!("{stdout}");
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "the test alone in a child process: {}\n{stdout}\n{stderr}",
            out.status
        );
        return;
    }
    let flipped_ns = Scratch::new("flip");
    let cold_ns = Scratch::new("cold");
    let before = desired(1_000);
    // Flips of every shape: one backend out, all out, two out; with and
    // without source ranges, v4 and v6, TCP and UDP.
    let mut after = before.clone();
    let ids: Vec<_> = after.keys().copied().collect();
    let pick = |v4: bool, protocol: Protocol, ranged: bool| {
        *before
            .iter()
            .find(|(id, l)| {
                id.0.is_ipv4() == v4 && id.1 == protocol && l.source_ranges.is_some() == ranged
            })
            .expect("the mix has every shape")
            .0
    };
    let changed = [
        pick(true, Protocol::Tcp, false),
        pick(true, Protocol::Udp, true),
        pick(false, Protocol::Tcp, true),
        pick(false, Protocol::Udp, false),
        pick(true, Protocol::Tcp, true),
        pick(false, Protocol::Udp, true),
    ];
    for (k, id) in changed.iter().enumerate() {
        let l = after.get_mut(id).unwrap();
        l.eligible = match k % 3 {
            0 => vec![l.members[0], l.members[2]],
            1 => Vec::new(),
            _ => vec![l.members[1]],
        };
    }

    // Then a node fails: its backend leaves every listener at once (far
    // more than one netlink message can carry).
    let mut node_down = after.clone();
    for l in node_down.values_mut() {
        let first = l.members[0];
        l.eligible.retain(|b| *b != first);
    }

    let (b, a, d) = (before.clone(), after.clone(), node_down.clone());
    let (cold, flip, down) = in_ns(&flipped_ns.0, move || {
        let table = KernelTable::new();
        let cold = table.sync(&b);
        // From here on there is no `nft` to run: the flip must not need it.
        let path = std::env::var_os("PATH");
        // SAFETY: this process runs this test alone (`ALONE`); no other
        // thread reads the environment while the flip runs.
        unsafe { std::env::set_var("PATH", "/nonexistent") };
        let flip = table.sync(&a);
        let down = table.sync(&d);
        if let Some(path) = path {
            // SAFETY: as above.
            unsafe { std::env::set_var("PATH", path) };
        }
        (cold, flip, down)
    });
    assert!(matches!(cold, Ok(Synced::Written(_))), "{cold:?}");
    assert!(matches!(flip, Ok(Synced::Written(_))), "{flip:?}");
    assert!(matches!(down, Ok(Synced::Written(_))), "{down:?}");

    // The same state written whole by `nft` in another namespace.
    let a = node_down.clone();
    let written = in_ns(&cold_ns.0, move || KernelTable::new().sync(&a));
    assert!(matches!(written, Ok(Synced::Written(_))), "{written:?}");
    for id in changed.iter().chain([&ids[3], &ids[500], &ids[998]]) {
        let name = format!("l_{}", id_tag(id));
        let got = chain(&flipped_ns, id);
        assert_eq!(got, chain(&cold_ns, id), "chain {name}");
        assert!(got.contains(&name), "{got}");
    }
    // changed[1]: no backend left, and source ranges.
    let none = chain(&flipped_ns, &changed[1]);
    assert!(none.contains("counter name \"z_"), "{none}");
    assert!(none.contains("ip saddr != @s_"), "{none}");
    assert!(!none.contains("dnat"), "{none}");
    let ranged6 = chain(&flipped_ns, &changed[2]);
    assert!(ranged6.contains("ip6 saddr != @s_"), "{ranged6}");
    assert!(ranged6.contains("dnat ip6 to"), "{ranged6}");
    let untouched = chain(&flipped_ns, &ids[500]);
    assert_eq!(untouched.matches("dnat").count(), 2, "{untouched}");

    // The counters, read over netlink as the daemon reads them for
    // /metrics, are every named counter `nft` lists, with its count.
    let read = in_ns(&cold_ns.0, kernel::counters).expect("counters over netlink");
    let names: std::collections::BTreeSet<&str> = read.iter().map(|(n, _)| n.as_str()).collect();
    assert_eq!(names.len(), read.len(), "each counter once");
    let listed = std::process::Command::new("ip")
        .args(["netns", "exec", &cold_ns.0, "nft", "-j", "list", "counters"])
        .output()
        .expect("nft");
    let listed: serde_json::Value = serde_json::from_slice(&listed.stdout).expect("nft's JSON");
    let from_nft: std::collections::BTreeMap<String, u64> = listed["nftables"]
        .as_array()
        .expect("a list")
        .iter()
        .filter_map(|o| {
            let c = o.get("counter")?;
            Some((c["name"].as_str()?.to_string(), c["packets"].as_u64()?))
        })
        .collect();
    assert!(from_nft.len() > 3_000, "{} counters", from_nft.len());
    assert_eq!(
        read.into_iter()
            .collect::<std::collections::BTreeMap<_, _>>(),
        from_nft
    );

    // A table gone behind the daemon's back: the netlink rewrite is refused
    // (and applies nothing), and the next sync is a full write by `nft`.
    run(
        "ip",
        &[
            "netns",
            "exec",
            &flipped_ns.0,
            "sh",
            "-c",
            DELETE_OUR_TABLES,
        ],
        None,
    );
    let (d, back) = (node_down.clone(), before.clone());
    let (refused, rewritten) = in_ns(&flipped_ns.0, move || {
        let table = KernelTable::new();
        table.sync(&d).expect("a full write");
        run("sh", &["-c", DELETE_OUR_TABLES], None);
        (table.sync(&back), table.sync(&back))
    });
    let refused = refused.expect_err("the chains are gone").to_string();
    assert!(refused.contains("over netlink"), "{refused}");
    assert!(matches!(rewritten, Ok(Synced::Written(_))), "{rewritten:?}");
    let restored = chain(&flipped_ns, &ids[500]);
    assert_eq!(restored.matches("dnat").count(), 3, "{restored}");
}

/// The name piece of a listener, as the table has it.
fn id_tag((vip, protocol, port): &kernel::ListenerId) -> String {
    format!(
        "{}_{}_{}",
        protocol.as_str(),
        port,
        vip.to_string().replace(':', "-")
    )
}

use super::super::names::{SHARDS, TABLE, listener_tag};
use super::super::test_listener as listener;
use super::*;

fn id(vip: &str, port: u16) -> ListenerId {
    (vip.parse().unwrap(), Protocol::Tcp, port)
}

fn text(doc: &serde_json::Value) -> String {
    serde_json::to_string(doc).unwrap()
}

#[test]
fn round_robin_over_the_eligible_backends_only() {
    let mut d = Desired::new();
    let l = id("192.0.2.10", 80);
    d.insert(
        l,
        listener(
            &["10.0.0.1", "10.0.0.3"],
            &["10.0.0.1", "10.0.0.2", "10.0.0.3"],
        ),
    );
    let t = text(&transaction(&d, &TableObjects::default()));
    // Rule 0 takes every second connection, rule 1 the rest: no set.
    assert!(
        t.contains(r#"{"match":{"left":{"numgen":{"mod":2,"mode":"inc"}},"op":"==","right":0}},{"counter":"n_tcp_80_192.0.2.10_10.0.0.1"}"#),
        "{t}"
    );
    assert!(t.contains(r#""expr":[{"counter":"n_tcp_80_192.0.2.10_10.0.0.3"},"#));
    assert!(t.contains(r#"{"dnat":{"addr":"10.0.0.3","family":"ip","port":30080}}"#));
    assert!(!t.contains(r#"{"dnat":{"addr":"10.0.0.2""#));
    assert!(!t.contains("goto\":{\"target\":\"b_"), "no backend chains");
    // Every member keeps its counter, eligible or not.
    assert!(t.contains(r#""name":"n_tcp_80_192.0.2.10_10.0.0.2""#));
    // Masquerade towards every member: a flip changes no element.
    assert!(t.contains(r#"{"concat":["192.0.2.10","10.0.0.1","tcp",30080]}"#));
    assert!(t.contains(r#"{"concat":["192.0.2.10","10.0.0.2","tcp",30080]}"#));
    assert!(t.contains(r#""map":"verdict""#));
    assert!(!t.contains(r#""delete""#));
}

#[test]
fn the_encoded_documents_are_the_json_trees() {
    let mut before = Desired::new();
    before.insert(
        id("192.0.2.10", 80),
        listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]),
    );
    let mut after = before.clone();
    after.insert(id("2001:db8::10", 53), listener(&[], &["2001:db8::1"]));
    let present = TableObjects::of(&before);
    let bytes = transaction_json(&after, &present);
    let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(parsed, transaction(&after, &present));
    assert!(text(&parsed).contains(r#""map":"verdict""#));
    let bytes = partial_transaction_json(&after, &before);
    let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(parsed, partial_transaction(&after, &before));
}

/// The rules of chain `name` of the main table, in the order written.
fn rules_of(doc: &serde_json::Value, name: &str) -> Vec<String> {
    doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|o| o.pointer("/add/rule"))
        .filter(|r| r["chain"] == name && r["table"] == TABLE)
        .map(|r| text(&r["expr"]))
        .collect()
}

#[test]
fn an_open_flow_leaves_the_input_chain_at_its_first_rule() {
    let mut d = Desired::new();
    d.insert(id("192.0.2.10", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
    let input = rules_of(&transaction(&d, &TableObjects::default()), "input");
    assert_eq!(
        input[0],
        r#"[{"match":{"left":{"ct":{"key":"state"}},"op":"!=","right":"new"}},{"return":null}]"#,
        "{input:#?}"
    );
    // Then the socket check, then the refusals.
    assert!(
        input[1].contains(r#"{"socket":{"key":"transparent"}}"#),
        "{input:#?}"
    );
    assert!(
        input[2..].iter().all(|r| r.contains("reject")),
        "{input:#?}"
    );
    // The NAT chains see a flow's first packet only: no such gate there.
    let pre = rules_of(&transaction(&d, &TableObjects::default()), "prerouting");
    assert!(pre[0].contains("socket"), "{pre:#?}");
}

#[test]
fn no_eligible_backend_counts_and_returns_to_the_refusal() {
    let mut d = Desired::new();
    let l = id("2001:db8::10", 53);
    d.insert(l, listener(&[], &["2001:db8::1"]));
    let t = text(&transaction(&d, &TableObjects::default()));
    assert!(
        t.contains(r#"{"counter":"z_tcp_53_2001-db8--10"},{"return":null}"#),
        "{t}"
    );
    assert!(!t.contains("numgen"));
    assert!(t.contains(
        r#"{"elem":[{"concat":["2001:db8::10","tcp",53]}],"family":"inet","name":"refuse6""#
    ));
    assert!(t.contains(r#"{"reject":{"type":"tcp reset"}}"#));
}

#[test]
fn source_ranges_are_a_set_of_the_vips_family_merged() {
    let mut d = Desired::new();
    let l = id("192.0.2.10", 80);
    let mut kl = listener(&["10.0.0.1"], &["10.0.0.1"]);
    kl.source_ranges = Some(vec![
        "10.1.0.0/16".parse().unwrap(),
        "10.1.2.0/24".parse().unwrap(),
        "2001:db8::/32".parse().unwrap(),
    ]);
    kl.source_nat = SourceNat::None;
    d.insert(l, kl);
    let t = text(&transaction(&d, &TableObjects::default()));
    assert!(t.contains(r#"{"elem":[{"prefix":{"addr":"10.1.0.0","len":16}}],"family":"inet","name":"s_tcp_80_192.0.2.10""#), "{t}");
    assert!(t.contains(r#"{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"!=","right":"@s_tcp_80_192.0.2.10"}},{"counter":"d_tcp_80_192.0.2.10"},{"return":null}"#));
    assert!(
        !t.contains(r#""name":"masq4","table":"harvester_lb_nat"}}},{"add":{"element""#),
        "source_nat = none: no masquerade"
    );
}

/// A port of VIP 192.0.2.10 whose listener is (or is not) in the
/// same table as port 80's.
fn port_in(same: bool) -> u16 {
    let home = Shard::of(&id("192.0.2.10", 80));
    (81..2000)
        .find(|&p| (Shard::of(&id("192.0.2.10", p)) == home) == same)
        .unwrap()
}

fn deletes(doc: &serde_json::Value) -> Vec<String> {
    // Objects, not elements (a partial sync deletes a changed
    // listener's elements first).
    let cmds = doc["nftables"].as_array().unwrap();
    let object =
        |c: &serde_json::Value| c.get("delete").is_some_and(|d| d.get("element").is_none());
    let first_delete = cmds.iter().position(object);
    let last_flush = cmds.iter().rposition(|c| c.get("flush").is_some());
    assert!(last_flush < first_delete, "deletes after the flushes");
    cmds.iter()
        .filter(|c| object(c))
        .map(|c| c["delete"].to_string())
        .collect()
}

#[test]
fn what_is_gone_is_deleted_after_the_flushes() {
    let mut before = Desired::new();
    before.insert(
        id("192.0.2.10", 80),
        listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]),
    );
    let neighbour = id("192.0.2.10", port_in(true));
    before.insert(neighbour, listener(&["10.0.0.1"], &["10.0.0.1"]));
    let present = TableObjects::of(&before);
    let mut after = Desired::new();
    after.insert(id("192.0.2.10", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
    let deleted = deletes(&transaction(&after, &present));
    // The second listener's chain and two counters; the first
    // listener's second backend's counter; no table (port 80's stays).
    assert_eq!(deleted.len(), 4, "{deleted:?}");
    let tag = listener_tag(&neighbour);
    assert!(deleted.iter().any(|d| d.contains(&format!("l_{tag}"))));
    assert!(
        deleted
            .iter()
            .any(|d| d.contains("n_tcp_80_192.0.2.10_10.0.0.2"))
    );
    assert!(!deleted.iter().any(|d| d.contains(r#"{"table""#)));
    assert_eq!(deleted, deletes(&partial_transaction(&after, &before)));
}

/// Every element `op` (`add`, `delete`) of `doc` names, one entry per
/// element: `(set, element)`.
fn element_ops(doc: &serde_json::Value, op: &str) -> Vec<(String, String)> {
    doc["nftables"]
        .as_array()
        .unwrap()
        .iter()
        .filter_map(|c| c.get(op)?.get("element"))
        .flat_map(|e| {
            let set = e["name"].as_str().unwrap().to_string();
            e["elem"]
                .as_array()
                .unwrap()
                .iter()
                .map(move |x| (set.clone(), x.to_string()))
        })
        .collect()
}

/// The masquerade elements of `d`, as the transaction writes them.
fn masq_of(d: &Desired) -> BTreeSet<(String, String)> {
    element_ops(&transaction(d, &TableObjects::default()), "add")
        .into_iter()
        .filter(|(set, _)| set.starts_with("masq"))
        .collect()
}

/// What every partial transaction from `before` to `after` must keep:
/// no element deleted twice, no masquerade element deleted that
/// `after` still uses, none added twice, and the kernel's masquerade
/// set afterwards exactly `after`'s.
fn assert_shared_elements_kept(before: &Desired, after: &Desired) {
    let doc = partial_transaction(after, before);
    let deleted = element_ops(&doc, "delete");
    let unique: BTreeSet<_> = deleted.iter().cloned().collect();
    assert_eq!(unique.len(), deleted.len(), "a delete twice: {deleted:?}");
    let (wanted, had) = (masq_of(after), masq_of(before));
    for d in &deleted {
        assert!(!wanted.contains(d), "deletes {d:?}, which is still used");
    }
    let added: Vec<_> = element_ops(&doc, "add")
        .into_iter()
        .filter(|(set, _)| set.starts_with("masq"))
        .collect();
    let unique_added: BTreeSet<_> = added.iter().cloned().collect();
    assert_eq!(unique_added.len(), added.len(), "an add twice: {added:?}");
    let mut kernel = had;
    for d in &deleted {
        kernel.remove(d);
    }
    kernel.extend(unique_added);
    assert_eq!(kernel, wanted, "the masquerade set afterwards");
}

#[test]
fn a_listener_that_goes_keeps_the_masquerade_element_it_shared() {
    let both = ["10.0.0.1", "10.0.0.2"];
    let mut before = Desired::new();
    before.insert(id("192.0.2.10", 80), listener(&both, &both));
    before.insert(id("192.0.2.10", 8080), listener(&both, &both));
    // The full write: each shared element once.
    let full = element_ops(&transaction(&before, &TableObjects::default()), "add");
    let masq: Vec<_> = full.iter().filter(|(s, _)| s == "masq4").collect();
    assert_eq!(masq.len(), 2, "{masq:?}");

    let mut after = before.clone();
    after.remove(&id("192.0.2.10", 8080));
    let doc = partial_transaction(&after, &before);
    let deleted = element_ops(&doc, "delete");
    assert!(
        !deleted.iter().any(|(set, _)| set == "masq4"),
        "port 80 still uses them: {deleted:?}"
    );
    // 8080's own elements go.
    assert!(deleted.contains(&(
        "refuse4".to_string(),
        r#"{"concat":["192.0.2.10","tcp",8080]}"#.to_string()
    )));
    assert_shared_elements_kept(&before, &after);

    // The last user goes: the elements go, each once.
    let doc = partial_transaction(&Desired::new(), &before);
    let masq: Vec<_> = element_ops(&doc, "delete")
        .into_iter()
        .filter(|(set, _)| set == "masq4")
        .collect();
    assert_eq!(masq.len(), 2, "{masq:?}");
    assert_shared_elements_kept(&before, &Desired::new());
}

#[test]
fn listeners_that_share_elements_change_and_go_together_in_one_transaction() {
    let both = ["10.0.0.1", "10.0.0.2"];
    let vips = ["192.0.2.10", "192.0.2.11", "2001:db8::10"];
    let mut before = Desired::new();
    for vip in vips {
        for port in [80, 8080, 8443, 9090] {
            let members: &[&str] = if vip.contains(':') {
                &["2001:db8::1", "2001:db8::2"]
            } else {
                &both
            };
            before.insert(id(vip, port), listener(members, members));
        }
        // A UDP listener on the same nodeport: elements of its own.
        let mut udp = id(vip, 80);
        udp.1 = Protocol::Udp;
        before.insert(udp, before[&id(vip, 80)].clone());
    }
    // Many go, some change (a member leaves, the nodeport moves, no
    // more masquerade), one comes.
    let mut after = before.clone();
    for vip in vips {
        after.remove(&id(vip, 8080));
        after.remove(&id(vip, 8443));
    }
    after.get_mut(&id("192.0.2.10", 9090)).unwrap().backend_port = 30081;
    after.get_mut(&id("192.0.2.11", 80)).unwrap().members.pop();
    after.get_mut(&id("192.0.2.11", 9090)).unwrap().source_nat = SourceNat::None;
    after.insert(id("192.0.2.12", 80), listener(&both, &both));
    assert_shared_elements_kept(&before, &after);
    assert_shared_elements_kept(&after, &before);
    assert_shared_elements_kept(&before, &Desired::new());
    let mut gone_all_but_one = Desired::new();
    gone_all_but_one.insert(
        id("192.0.2.11", 9090),
        before[&id("192.0.2.11", 9090)].clone(),
    );
    assert_shared_elements_kept(&before, &gone_all_but_one);
    // An unchanged state writes nothing.
    assert_shared_elements_kept(&before, &before);
}

#[test]
fn masquerade_users_are_counted_per_vip_backend_and_nodeport() {
    let both = ["10.0.0.1", "10.0.0.2"];
    let mut d = Desired::new();
    d.insert(id("192.0.2.10", 80), listener(&both, &both));
    d.insert(id("192.0.2.10", 8080), listener(&both, &both));
    let mut none = listener(&both, &both);
    none.source_nat = SourceNat::None;
    d.insert(id("192.0.2.10", 81), none);
    let users = nat_users(&d, SourceNat::Masquerade);
    let key = |b: &str| (ip("192.0.2.10"), ip(b), Protocol::Tcp, 30080);
    assert_eq!(users.get(&key("10.0.0.1")), Some(&2));
    assert_eq!(users.get(&key("10.0.0.2")), Some(&2));
    assert_eq!(users.len(), 2, "source_nat = none uses none: {users:?}");
    // Another VIP's users are not looked at.
    let vips: BTreeSet<IpAddr> = [ip("192.0.2.99")].into();
    assert_eq!(
        nat_difference(&d, &Desired::new(), &vips, SourceNat::Masquerade),
        Default::default()
    );
}

fn ip(s: &str) -> IpAddr {
    s.parse().unwrap()
}

#[test]
fn listeners_are_spread_over_tables_and_a_table_left_empty_goes_whole() {
    let home = id("192.0.2.10", 80);
    let away = id("192.0.2.10", port_in(false));
    let (t_home, t_away) = (Shard::of(&home), Shard::of(&away));
    let mut before = Desired::new();
    before.insert(home, listener(&["10.0.0.1"], &["10.0.0.1"]));
    let mut after = before.clone();
    after.insert(away, listener(&["10.0.0.1"], &["10.0.0.1"]));

    // A new table gets its parts with its first listener, in the same
    // transaction: the partial sync writes them, and only there.
    let t = text(&partial_transaction(&after, &before));
    let base = |sh: Shard| {
        format!(
            r#""hook":"prerouting","name":"prerouting","policy":"accept","prio":-100,"table":"{}""#,
            sh.table()
        )
    };
    assert!(t.contains(&base(t_away)), "{t}");
    assert!(!t.contains(&base(t_home)), "{t}");
    assert!(t.contains(&format!(
        r#""name":"dispatch4","table":"{}""#,
        t_away.table()
    )));
    // The refusal and the masquerade stay in the main table.
    assert!(t.contains(&format!(r#""name":"refuse4","table":"{TABLE}""#)));
    assert!(!t.contains(r#""name":"refuse4","table":"harvester_lb_nat_"#));
    assert!(!t.contains(
        r#""hook":"input","name":"input","policy":"accept","prio":0,"table":"harvester_lb_nat_"#
    ));

    // The full write: every table's parts once, the main one always.
    let t = text(&transaction(&after, &TableObjects::default()));
    for sh in [Shard::MAIN, t_home, t_away] {
        assert!(t.contains(&base(sh)), "{sh:?}: {t}");
    }
    assert!(!t.contains(
        r#""hook":"input","name":"input","policy":"accept","prio":0,"table":"harvester_lb_nat_"#
    ));

    // The last listener of a table goes: the table goes, whole.
    let deleted = deletes(&partial_transaction(&before, &after));
    assert!(
        deleted.contains(&format!(
            r#"{{"table":{{"family":"inet","name":"{}"}}}}"#,
            t_away.table()
        )),
        "{deleted:?}"
    );
    assert!(
        !deleted.iter().any(|d| d.contains(r#"{"chain""#)),
        "its objects go with it: {deleted:?}"
    );

    // A table of a shard this version does not use is deleted, and the
    // main table kept even without a listener.
    let mut present = TableObjects::of(&before);
    present
        .tables
        .insert(Shard::from_table("harvester_lb_nat_99").unwrap());
    let deleted = deletes(&transaction(&Desired::new(), &present));
    assert!(deleted.iter().any(|d| d.contains("harvester_lb_nat_99")));
    assert!(
        !deleted
            .iter()
            .any(|d| d.contains(&format!(r#""name":"{TABLE}"}}"#)))
    );
}

#[test]
fn a_table_name_is_a_shard_only_as_this_module_writes_it() {
    assert_eq!(Shard::from_table("harvester_lb_nat"), Some(Shard::MAIN));
    let seven = Shard::from_table("harvester_lb_nat_7").unwrap();
    assert_eq!(seven.table(), "harvester_lb_nat_7");
    assert!(seven.in_use());
    assert!(!Shard::from_table("harvester_lb_nat_99").unwrap().in_use());
    for other in [
        "harvester_lb",
        "harvester_lb_nat_07",
        "harvester_lb_nat_0",
        "harvester_lb_nat_x",
        "harvester_lb_nat_300",
    ] {
        assert_eq!(Shard::from_table(other), None, "{other}");
    }
    // Fixed: the same table in every version (a restart finds each
    // listener where it was).
    assert_eq!(
        Shard::of(&id("192.0.2.10", 80)).table(),
        "harvester_lb_nat_15"
    );
    let spread: BTreeSet<Shard> = (1..=200).map(|p| Shard::of(&id("192.0.2.10", p))).collect();
    assert_eq!(spread.len(), usize::from(SHARDS));
}

#[test]
fn a_partial_sync_touches_only_the_listener_that_changed() {
    let mut before = Desired::new();
    before.insert(
        id("192.0.2.10", 80),
        listener(&["10.0.0.1", "10.0.0.2"], &["10.0.0.1", "10.0.0.2"]),
    );
    before.insert(id("192.0.2.11", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
    let mut after = before.clone();
    after.get_mut(&id("192.0.2.10", 80)).unwrap().eligible = vec!["10.0.0.1".parse().unwrap()];
    let t = text(&partial_transaction(&after, &before));
    assert!(
        !t.contains("192.0.2.11"),
        "the other listener is left alone: {t}"
    );
    assert!(
        !t.contains(r#""name":"prerouting""#),
        "base chains untouched"
    );
    assert!(!t.contains("numgen"), "one backend left: {t}");
    assert!(t.contains(r#"{"dnat":{"addr":"10.0.0.1","family":"ip","port":30080}}"#));
    assert!(
        !t.contains(r#""delete":{"chain""#),
        "both members stay configured"
    );
    assert_eq!(
        text(&partial_transaction(&before, &before)),
        r#"{"nftables":[]}"#
    );
}

fn ips(list: &[&str]) -> Vec<IpAddr> {
    list.iter().map(|m| m.parse().unwrap()).collect()
}

#[test]
fn every_bucket_goes_where_the_proxy_sends_that_key() {
    use crate::dataplane::balancer::{Backend, ClientAddr};
    use std::net::SocketAddr;
    use std::sync::atomic::AtomicUsize;
    let eligible = ips(&["10.0.0.1", "10.0.0.2", "10.0.0.3", "2001:db8::4"]);
    let arcs: Vec<_> = eligible.iter().map(|&a| Backend::new(a, true)).collect();
    let filled = buckets(&eligible);
    assert_eq!(filled.len(), BUCKETS as usize);
    let cursor = AtomicUsize::new(0);
    for (i, got) in filled.iter().enumerate() {
        let pick = select::first_candidate(
            Algorithm::SourceIp,
            &arcs,
            ClientAddr::new(SocketAddr::new(bucket_key(i as u32), 0)),
            &cursor,
        );
        assert_eq!(*got, eligible[pick], "bucket {i}");
    }
    // Spread: each backend a fair share (4093 / 4 = 1023, +-15 %).
    for b in &eligible {
        let n = filled.iter().filter(|x| *x == b).count();
        assert!((870..=1180).contains(&n), "{b}: {n}");
    }
    assert!(buckets(&[]).is_empty());
}

#[test]
fn a_backend_that_leaves_moves_only_its_own_buckets() {
    let all = ips(&["10.0.0.1", "10.0.0.2", "10.0.0.3"]);
    let before = buckets(&all);
    let after = buckets(&ips(&["10.0.0.1", "10.0.0.3"]));
    let gone: IpAddr = "10.0.0.2".parse().unwrap();
    let mut moved = 0;
    for (b, a) in before.iter().zip(&after) {
        if *b == gone {
            moved += 1;
            assert_ne!(*a, gone);
        } else {
            assert_eq!(a, b, "a bucket of a backend that stayed moved");
        }
    }
    assert!(moved > 0);
    // Coming back takes exactly those buckets again.
    assert_eq!(buckets(&all), before);
}

fn source_ip(eligible: &[&str], members: &[&str]) -> KernelListener {
    KernelListener {
        pick: Algorithm::SourceIp,
        ..listener(eligible, members)
    }
}

#[test]
fn source_ip_is_a_jhash_bucket_map_edited_element_wise() {
    let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    let l = id("192.0.2.10", 80);
    let mut before = Desired::new();
    before.insert(l, source_ip(&members, &members));
    let t = text(&transaction(&before, &TableObjects::default()));
    assert!(
        t.contains(r#"{"vmap":{"data":"@m_tcp_80_192.0.2.10","key":{"jhash":{"expr":{"payload":{"field":"saddr","protocol":"ip"}},"mod":4093,"seed":1751280738}}}}"#),
        "{t}"
    );
    assert!(t.contains(
        r#"{"flush":{"map":{"family":"inet","map":"ipv4_addr","name":"m_tcp_80_192.0.2.10""#
    ));
    assert_eq!(
        t.matches(r#"{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0."#)
            .count(),
        4093
    );
    assert!(!t.contains("numgen"));
    let script = prelude(&before, None, &TableObjects::default()).unwrap();
    assert!(
        script.contains("add map inet harvester_lb_nat_15 m_tcp_80_192.0.2.10 { typeof numgen inc mod 4093 : verdict ; }"),
        "{script}"
    );
    assert_eq!(prelude(&before, None, &TableObjects::of(&before)), None);

    // Node 2 leaves: only its buckets are deleted and given to others.
    let mut after = before.clone();
    after.get_mut(&l).unwrap().eligible = ips(&["10.0.0.1", "10.0.0.3"]);
    let doc = partial_transaction(&after, &before);
    let moved = buckets(&ips(&members))
        .iter()
        .filter(|b| **b == "10.0.0.2".parse::<IpAddr>().unwrap())
        .count();
    let cmds = doc["nftables"].as_array().unwrap();
    let deleted: usize = cmds
        .iter()
        .filter_map(|c| c.pointer("/delete/element"))
        .filter(|e| e["name"] == "m_tcp_80_192.0.2.10")
        .map(|e| e["elem"].as_array().unwrap().len())
        .sum();
    assert_eq!(deleted, moved);
    let t = text(&doc);
    assert_eq!(
        t.matches(r#"{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0."#)
            .count(),
        moved
    );
    assert!(
        !t.contains(r#"{"flush":{"map""#),
        "no flush of the map: {t}"
    );

    // Back to round robin: the map goes, after the chain that used it.
    let mut rr = before.clone();
    rr.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
    let t = text(&partial_transaction(&rr, &before));
    assert!(
        t.contains(
            r#"{"delete":{"map":{"family":"inet","map":"ipv4_addr","name":"m_tcp_80_192.0.2.10""#
        ),
        "{t}"
    );
}

fn flow_hash(eligible: &[&str], members: &[&str]) -> KernelListener {
    KernelListener {
        pick: Algorithm::FlowHash,
        ..listener(eligible, members)
    }
}

/// The bucket map's elements a document writes: bucket to backend
/// chain.
fn written_buckets(doc: &serde_json::Value, map: &str) -> BTreeMap<u64, String> {
    let mut out = BTreeMap::new();
    for c in doc["nftables"].as_array().unwrap() {
        let Some(e) = c.pointer("/add/element").filter(|e| e["name"] == map) else {
            continue;
        };
        for item in e["elem"][0]["set"].as_array().unwrap() {
            let bucket = item[0].as_u64().unwrap();
            let target = item[1]["goto"]["target"].as_str().unwrap().to_string();
            out.insert(bucket, target);
        }
    }
    out
}

#[test]
fn flow_hash_hashes_address_and_port_over_the_same_buckets() {
    let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    let l = id("192.0.2.10", 80);
    let mut d = Desired::new();
    d.insert(l, flow_hash(&members, &members));
    let t = text(&transaction(&d, &TableObjects::default()));
    assert!(
        t.contains(r#"{"vmap":{"data":"@m_tcp_80_192.0.2.10","key":{"jhash":{"expr":{"concat":[{"payload":{"field":"saddr","protocol":"ip"}},{"payload":{"field":"sport","protocol":"th"}}]},"mod":4093,"seed":1751280738}}}}"#),
        "{t}"
    );
    assert!(!t.contains("numgen"));
    // Its map is declared as source_ip's, and filled alike.
    let script = prelude(&d, None, &TableObjects::default()).unwrap();
    assert!(script.contains("add map inet harvester_lb_nat_15 m_tcp_80_192.0.2.10 { typeof numgen inc mod 4093 : verdict ; }"), "{script}");
    let mut s = Desired::new();
    s.insert(l, source_ip(&members, &members));
    let doc = transaction(&d, &TableObjects::default());
    let map = bucket_map(&l);
    assert_eq!(
        written_buckets(&doc, &map),
        written_buckets(&transaction(&s, &TableObjects::default()), &map)
    );
    // A TCP flow_hash listener's mid-stream segments are DNATed: its
    // key is in the pickup set, which the socket-lookup return skips.
    assert!(t.contains(r#"{"add":{"element":{"elem":[{"concat":["192.0.2.10","tcp",80]}],"family":"inet","name":"pickup4""#), "{t}");
    assert!(t.contains(r#"{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"!=","right":"@pickup4"}},{"match":{"left":{"socket":{"key":"transparent"}},"op":"==","right":0}},{"return":null}"#), "{t}");
    let picked = |d: &Desired| -> Vec<(String, String)> {
        element_ops(&transaction(d, &TableObjects::default()), "add")
            .into_iter()
            .filter(|(set, _)| set == "pickup4")
            .collect()
    };
    assert_eq!(picked(&d).len(), 1);
    // source_ip is picked up too (a client keeps its backend on every
    // host); round robin is not: its listener's key stays out.
    assert_eq!(picked(&s).len(), 1);
    let mut rr = d.clone();
    rr.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
    assert_eq!(picked(&rr), vec![]);
    // A UDP flow_hash listener neither: UDP has no socket to return to.
    let mut udp = Desired::new();
    udp.insert(
        (ip("192.0.2.10"), Protocol::Udp, 53),
        flow_hash(&members, &members),
    );
    assert_eq!(picked(&udp), vec![]);
}

#[test]
fn two_hosts_building_one_config_write_identical_bucket_maps() {
    // Two independent builds (two hosts, the same config and health;
    // members in another order on one) write the same bucket to the
    // same backend, for every bucket.
    let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3", "10.0.0.4"];
    let mut reversed = members;
    reversed.reverse();
    let l = id("192.0.2.10", 80);
    let mut a = Desired::new();
    a.insert(l, flow_hash(&members, &members));
    let mut b = Desired::new();
    b.insert(l, flow_hash(&reversed, &reversed));
    let map = bucket_map(&l);
    let on_a = written_buckets(&transaction(&a, &TableObjects::default()), &map);
    let on_b = written_buckets(&transaction(&b, &TableObjects::default()), &map);
    assert_eq!(on_a.len(), BUCKETS as usize);
    assert_eq!(on_a, on_b);
    // And the same after a flip seen by both.
    let down = |d: &Desired| {
        let mut d = d.clone();
        d.get_mut(&l)
            .unwrap()
            .eligible
            .retain(|e| *e != ip("10.0.0.3"));
        d
    };
    assert_eq!(
        buckets(&down(&a)[&l].eligible),
        buckets(&down(&b)[&l].eligible)
    );
}

#[test]
fn a_flow_hash_health_flip_rewrites_only_the_buckets_of_the_backend_that_changed() {
    let members = ["10.0.0.1", "10.0.0.2", "10.0.0.3"];
    let l = id("192.0.2.10", 80);
    let mut before = Desired::new();
    before.insert(l, flow_hash(&members, &members));
    let map = bucket_map(&l);
    let all = written_buckets(&transaction(&before, &TableObjects::default()), &map);
    let chain_of = |b: &str| backend_chain(&l, ip(b));
    let owned_by = |b: &str| {
        all.iter()
            .filter(|(_, c)| **c == chain_of(b))
            .map(|(k, _)| *k)
            .collect::<BTreeSet<u64>>()
    };
    // 10.0.0.2 goes down: exactly its buckets are deleted and written
    // again, each to another backend; no other bucket is touched.
    let mut after = before.clone();
    after.get_mut(&l).unwrap().eligible = ips(&["10.0.0.1", "10.0.0.3"]);
    let doc = partial_transaction(&after, &before);
    let rewritten = written_buckets(&doc, &map);
    assert_eq!(
        rewritten.keys().copied().collect::<BTreeSet<_>>(),
        owned_by("10.0.0.2")
    );
    assert!(rewritten.values().all(|c| *c != chain_of("10.0.0.2")));
    let t = text(&doc);
    assert!(
        !t.contains(r#"{"flush":{"map""#),
        "no flush of the map: {t}"
    );
    // It comes back: it takes exactly its own buckets again.
    let doc = partial_transaction(&before, &after);
    let back = written_buckets(&doc, &map);
    assert_eq!(
        back.keys().copied().collect::<BTreeSet<_>>(),
        owned_by("10.0.0.2")
    );
    assert!(back.values().all(|c| *c == chain_of("10.0.0.2")));
    // A switch between source_ip and flow_hash keeps every bucket (the
    // same fill); only the hash input changes.
    let mut s = before.clone();
    s.get_mut(&l).unwrap().pick = Algorithm::SourceIp;
    assert!(written_buckets(&partial_transaction(&s, &before), &map).is_empty());
}

#[test]
fn a_flow_hash_listener_that_goes_leaves_the_pickup_set() {
    let members = ["10.0.0.1", "10.0.0.2"];
    let l = id("192.0.2.10", 80);
    let mut before = Desired::new();
    before.insert(l, flow_hash(&members, &members));
    let deleted = element_ops(&partial_transaction(&Desired::new(), &before), "delete");
    // The table goes whole with its last listener; with a neighbour
    // left, the element goes by itself.
    let mut with = before.clone();
    let other = id("192.0.2.10", port_in(true));
    with.insert(other, listener(&members, &members));
    let mut after = with.clone();
    after.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
    let deleted_rr = element_ops(&partial_transaction(&after, &with), "delete");
    assert!(
        deleted_rr.contains(&(
            "pickup4".to_string(),
            r#"{"concat":["192.0.2.10","tcp",80]}"#.to_string()
        )),
        "{deleted_rr:?}"
    );
    assert!(
        deleted.iter().any(|(set, _)| set == "pickup4"),
        "{deleted:?}"
    );
    // Round robin to round robin: no delete of an element never written.
    let mut rr2 = after.clone();
    rr2.get_mut(&l).unwrap().eligible.pop();
    let deleted = element_ops(&partial_transaction(&rr2, &after), "delete");
    assert!(
        !deleted.iter().any(|(set, _)| set == "pickup4"),
        "{deleted:?}"
    );
}

#[test]
fn source_nat_vip_snats_to_the_vip_keeping_ports() {
    let both = ["10.0.0.1", "10.0.0.2"];
    let mut d = Desired::new();
    let mut l = listener(&both, &both);
    l.source_nat = SourceNat::Vip;
    d.insert(id("192.0.2.10", 80), l);
    let t = text(&transaction(&d, &TableObjects::default()));
    assert!(
        t.contains(r#"{"snat":{"addr":{"ct":{"dir":"original","key":"ip daddr"}},"family":"ip"}}"#),
        "{t}"
    );
    assert!(t.contains(r#"{"elem":[{"concat":["192.0.2.10","10.0.0.1","tcp",30080]},{"concat":["192.0.2.10","10.0.0.2","tcp",30080]}],"family":"inet","name":"snat4""#), "{t}");
    assert!(masq_of(&d).is_empty(), "no masquerade");
    // Switching to masquerade moves the elements between the sets.
    let mut m = d.clone();
    m.values_mut().next().unwrap().source_nat = SourceNat::Masquerade;
    let doc = partial_transaction(&m, &d);
    let deleted = element_ops(&doc, "delete");
    assert_eq!(
        deleted.iter().filter(|(s, _)| s == "snat4").count(),
        2,
        "{deleted:?}"
    );
    let added = element_ops(&doc, "add");
    assert_eq!(
        added.iter().filter(|(s, _)| s == "masq4").count(),
        2,
        "{added:?}"
    );
}

#[test]
fn client_affinity_is_a_dynamic_set_per_backend_tried_first() {
    let l = id("192.0.2.10", 80);
    let mut d = Desired::new();
    let mut kl = listener(&["10.0.0.1"], &["10.0.0.1", "10.0.0.2"]);
    kl.affinity = Some(std::time::Duration::from_secs(600));
    d.insert(l, kl);
    let t = text(&transaction(&d, &TableObjects::default()));
    let script = prelude(&d, None, &TableObjects::default()).unwrap();
    assert!(
        script.contains("add set inet harvester_lb_nat_15 a_tcp_80_192.0.2.10_10.0.0.2 { type ipv4_addr ; flags dynamic,timeout ; timeout 600s ; }"),
        "{script}"
    );
    assert_eq!(
        prelude(&d, Some(&d), &TableObjects::of(&d)),
        None,
        "unchanged: nothing"
    );
    // Only the eligible backend's set is looked up, before the pick.
    let lookup = r#"{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"==","right":"@a_tcp_80_192.0.2.10_10.0.0.1"}},{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0.1"}}"#;
    assert!(t.contains(lookup), "{t}");
    assert!(!t.contains(r#""right":"@a_tcp_80_192.0.2.10_10.0.0.2""#));
    // The pick (one eligible backend: a plain goto) comes after it.
    let pick = r#""expr":[{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0.1"}}]"#;
    assert!(t.find(lookup).unwrap() < t.find(pick).expect(pick), "{t}");
    // Every backend chain remembers its clients; a backend out of the
    // choice loses them.
    assert!(t.contains(r#"{"set":{"elem":{"payload":{"field":"saddr","protocol":"ip"}},"op":"update","set":"@a_tcp_80_192.0.2.10_10.0.0.2"}}"#));
    assert!(
        t.contains(r#"{"flush":{"set":{"family":"inet","name":"a_tcp_80_192.0.2.10_10.0.0.2""#)
    );
    assert!(
        !t.contains(r#"{"flush":{"set":{"family":"inet","name":"a_tcp_80_192.0.2.10_10.0.0.1""#)
    );
}

/// Whether `doc` flushes the main table's `postrouting`.
fn flushes_postrouting(doc: &serde_json::Value) -> bool {
    doc["nftables"].as_array().unwrap().iter().any(|o| {
        o.pointer("/flush/chain")
            .is_some_and(|c| c["name"] == "postrouting" && c["table"] == TABLE)
    })
}

#[test]
fn postrouting_looks_up_only_the_source_nats_in_use() {
    let v4 = id("192.0.2.10", 80);
    let mut none = Desired::new();
    let mut l = listener(&["10.0.0.1"], &["10.0.0.1"]);
    l.source_nat = SourceNat::None;
    none.insert(v4, l.clone());
    // `none` only: the first packet of a new flow meets no rule there.
    let doc = transaction(&none, &TableObjects::default());
    assert_eq!(rules_of(&doc, "postrouting"), Vec::<String>::new());
    // One IPv4 masquerade listener: one rule, the IPv4 masquerade.
    let mut masq = none.clone();
    masq.insert(id("192.0.2.10", 81), listener(&["10.0.0.1"], &["10.0.0.1"]));
    let rules = rules_of(&transaction(&masq, &TableObjects::default()), "postrouting");
    assert_eq!(rules.len(), 1, "{rules:#?}");
    assert!(rules[0].contains("@masq4") && rules[0].contains("masquerade"));
    // Every kind of both families: the four rules, masquerade first.
    let mut all = masq.clone();
    let mut vip = listener(&["10.0.0.1"], &["10.0.0.1"]);
    vip.source_nat = SourceNat::Vip;
    all.insert(id("192.0.2.11", 80), vip.clone());
    all.insert(
        id("2001:db8::10", 80),
        listener(&["2001:db8::1"], &["2001:db8::1"]),
    );
    all.insert(id("2001:db8::11", 80), {
        let mut v = vip.clone();
        v.members = vec!["2001:db8::1".parse().unwrap()];
        v.eligible = v.members.clone();
        v
    });
    let rules = rules_of(&transaction(&all, &TableObjects::default()), "postrouting");
    let sets: Vec<&str> = rules
        .iter()
        .map(|r| {
            ["@masq4", "@snat4", "@masq6", "@snat6"]
                .into_iter()
                .find(|s| r.contains(s))
                .unwrap()
        })
        .collect();
    assert_eq!(sets, ["@masq4", "@snat4", "@masq6", "@snat6"]);
    // A partial sync rewrites the chain when the kinds change, and
    // leaves it alone when they do not.
    let doc = partial_transaction(&masq, &none);
    assert!(flushes_postrouting(&doc));
    assert_eq!(rules_of(&doc, "postrouting").len(), 1);
    let doc = partial_transaction(&none, &masq);
    assert!(flushes_postrouting(&doc));
    assert_eq!(rules_of(&doc, "postrouting"), Vec::<String>::new());
    let mut flipped = masq.clone();
    flipped.get_mut(&v4).unwrap().eligible.clear();
    let doc = partial_transaction(&flipped, &masq);
    assert!(!flushes_postrouting(&doc));
    assert_eq!(rules_of(&doc, "postrouting"), Vec::<String>::new());
}

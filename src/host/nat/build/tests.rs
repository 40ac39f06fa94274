use super::super::names::{SHARDS, TABLE, listener_tag};
use super::super::test_listener as listener;
use super::*;
use crate::config::Algorithm;
use crate::dataplane::balancer::select;

fn id(vip: &str, port: u16) -> ListenerId {
    (vip.parse().unwrap(), Protocol::Tcp, port)
}

fn text(doc: &serde_json::Value) -> String {
    serde_json::to_string(doc).unwrap()
}

/// One command of a transaction, or one element of an element command,
/// as a line: `op kind table name[ #place][ body]`. The body is the rest
/// of the object as compact JSON (keys sorted): a rule's statements, one
/// element (one mapping of a map's element list), or any other field. A
/// rule's place is its rank among the rules the transaction adds to its
/// chain, so sorting the lines keeps each chain's order. Lines are
/// compared whole: a field that changes its encoding changes the line.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord)]
struct Line {
    /// `add`, `flush`, `delete`.
    op: String,
    /// `table`, `chain`, `rule`, `counter`, `set`, `map`, `element`.
    kind: String,
    /// The table (for a table, its own name).
    table: String,
    /// The object's name: a rule's chain, an element's set or map; empty
    /// for a table.
    name: String,
    /// A rule's place in its chain.
    place: Option<usize>,
    /// The rest, as JSON; empty when nothing is left.
    body: String,
}

impl std::fmt::Display for Line {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {} {}", self.op, self.kind, self.table)?;
        for part in [
            &self.name,
            &self.place.map(|p| format!("#{p}")).unwrap_or_default(),
            &self.body,
        ] {
            if !part.is_empty() {
                write!(f, " {part}")?;
            }
        }
        Ok(())
    }
}

/// The one key of a JSON object and its value: `{"add": {...}}`.
fn only_entry(v: &serde_json::Value) -> (&str, &serde_json::Value) {
    let o = v.as_object().expect("an object");
    assert_eq!(o.len(), 1, "one key: {v}");
    let (k, v) = o.iter().next().unwrap();
    (k.as_str(), v)
}

/// Every command of `doc` (a transaction) as lines, sorted. Every object
/// must be of the `inet` family: a command of another is refused here.
fn lines(doc: &serde_json::Value) -> Vec<Line> {
    let mut out = Vec::new();
    let mut places: BTreeMap<(String, String), usize> = BTreeMap::new();
    for cmd in doc["nftables"].as_array().expect("a transaction") {
        let (op, obj) = only_entry(cmd);
        let (kind, body) = only_entry(obj);
        let mut rest = body.as_object().expect("an object").clone();
        let mut take = |key: &str| -> String {
            match rest.remove(key) {
                Some(serde_json::Value::String(s)) => s,
                other => panic!("{key} of {cmd}: {other:?}"),
            }
        };
        assert_eq!(take("family"), "inet", "{cmd}");
        let (table, name) = match kind {
            "table" => (take("name"), String::new()),
            "rule" => (take("table"), take("chain")),
            _ => (take("table"), take("name")),
        };
        let line = |place, body: String| Line {
            op: op.to_string(),
            kind: kind.to_string(),
            table: table.clone(),
            name: name.clone(),
            place,
            body,
        };
        let json = |m: serde_json::Map<String, serde_json::Value>| {
            if m.is_empty() {
                String::new()
            } else {
                serde_json::Value::Object(m).to_string()
            }
        };
        match kind {
            "rule" => {
                let place = places.entry((table.clone(), name.clone())).or_insert(0);
                let expr = rest.remove("expr").expect("a rule's statements");
                let more = json(rest);
                let body = [expr.to_string(), more].join(" ").trim_end().to_string();
                out.push(line(Some(*place), body));
                *place += 1;
            }
            "element" => {
                let elem = rest.remove("elem").expect("an element list");
                assert!(rest.is_empty(), "{cmd}");
                for item in elem.as_array().expect("a list") {
                    match item.get("set").and_then(|s| s.as_array()) {
                        Some(mappings) => {
                            out.extend(mappings.iter().map(|m| line(None, m.to_string())))
                        }
                        None => out.push(line(None, item.to_string())),
                    }
                }
            }
            _ => out.push(line(None, json(rest))),
        }
    }
    out.sort();
    out
}

/// The lines of `doc` that `keep` keeps.
fn lines_where(doc: &serde_json::Value, keep: impl Fn(&Line) -> bool) -> Vec<Line> {
    lines(doc).into_iter().filter(|l| keep(l)).collect()
}

/// `actual` is `expected`, line for line (both sorted here); a mismatch
/// shows the lines missing (`-`) and the lines not expected (`+`).
#[track_caller]
fn assert_lines(actual: &[Line], expected: &[impl AsRef<str>]) {
    let mut actual: Vec<String> = actual.iter().map(Line::to_string).collect();
    actual.sort();
    let mut expected: Vec<String> = expected.iter().map(|s| s.as_ref().to_string()).collect();
    expected.sort();
    if actual != expected {
        let mut diff = String::new();
        let (mut a, mut e) = (actual.iter().peekable(), expected.iter().peekable());
        loop {
            match (a.peek(), e.peek()) {
                (None, None) => break,
                (Some(x), Some(y)) if x == y => {
                    a.next();
                    e.next();
                }
                (Some(x), Some(y)) if x < y => diff += &format!("+ {}\n", a.next().unwrap()),
                (Some(_), Some(_)) | (None, Some(_)) => {
                    diff += &format!("- {}\n", e.next().unwrap())
                }
                (Some(_), None) => diff += &format!("+ {}\n", a.next().unwrap()),
            }
        }
        assert_eq!(
            actual, expected,
            "lines missing (-) and not expected (+):\n{diff}"
        );
    }
}

/// Every line the first listener of table `t` brings with it (the
/// table's own parts: base chains, dispatch maps, pickup sets and their
/// rules), written out once, as kube-proxy's tests write their base rules.
fn table_lines(t: &str) -> Vec<String> {
    r#"add table @T
add chain @T output {"hook":"output","policy":"accept","prio":-100,"type":"nat"}
add chain @T prerouting {"hook":"prerouting","policy":"accept","prio":-100,"type":"nat"}
flush chain @T output {"hook":"output","policy":"accept","prio":-100,"type":"nat"}
flush chain @T prerouting {"hook":"prerouting","policy":"accept","prio":-100,"type":"nat"}
add map @T dispatch4 {"map":"verdict","type":["ipv4_addr","inet_proto","inet_service"]}
add map @T dispatch6 {"map":"verdict","type":["ipv6_addr","inet_proto","inet_service"]}
flush map @T dispatch4 {"map":"ipv4_addr","type":"ipv4_addr"}
flush map @T dispatch6 {"map":"ipv4_addr","type":"ipv4_addr"}
add set @T pickup4 {"type":["ipv4_addr","inet_proto","inet_service"]}
add set @T pickup6 {"type":["ipv6_addr","inet_proto","inet_service"]}
flush set @T pickup4 {"type":[]}
flush set @T pickup6 {"type":[]}
add rule @T output #0 [{"vmap":{"data":"@dispatch4","key":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]}}}]
add rule @T output #1 [{"vmap":{"data":"@dispatch6","key":{"concat":[{"payload":{"field":"daddr","protocol":"ip6"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]}}}]
add rule @T prerouting #0 [{"match":{"left":{"&":[{"payload":{"field":"flags","protocol":"tcp"}},"syn"]},"op":"==","right":0}},{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"!=","right":"@pickup4"}},{"match":{"left":{"socket":{"key":"transparent"}},"op":"==","right":0}},{"return":null}]
add rule @T prerouting #1 [{"match":{"left":{"&":[{"payload":{"field":"flags","protocol":"tcp"}},"syn"]},"op":"==","right":0}},{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip6"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"!=","right":"@pickup6"}},{"match":{"left":{"socket":{"key":"transparent"}},"op":"==","right":0}},{"return":null}]
add rule @T prerouting #2 [{"match":{"left":{"fib":{"flags":["daddr"],"result":"type"}},"op":"==","right":"local"}},{"vmap":{"data":"@dispatch4","key":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]}}}]
add rule @T prerouting #3 [{"match":{"left":{"fib":{"flags":["daddr"],"result":"type"}},"op":"==","right":"local"}},{"vmap":{"data":"@dispatch6","key":{"concat":[{"payload":{"field":"daddr","protocol":"ip6"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]}}}]"#
        .lines()
        .map(|l| l.replace("@T", t))
        .collect()
}

/// The main table's lines beyond [`table_lines`]: the `input` chain with
/// its refusals, `postrouting` (its rules depend on the source NATs in
/// use: [`postrouting_rule`]), and the sets they look up.
fn main_lines() -> Vec<String> {
    let mut out = table_lines(TABLE);
    out.extend(
        r#"add chain @T input {"hook":"input","policy":"accept","prio":0,"type":"filter"}
add chain @T postrouting {"hook":"postrouting","policy":"accept","prio":100,"type":"nat"}
flush chain @T input {"hook":"input","policy":"accept","prio":0,"type":"filter"}
flush chain @T postrouting {"hook":"postrouting","policy":"accept","prio":100,"type":"nat"}
add set @T masq4 {"type":["ipv4_addr","ipv4_addr","inet_proto","inet_service"]}
add set @T masq6 {"type":["ipv6_addr","ipv6_addr","inet_proto","inet_service"]}
add set @T refuse4 {"type":["ipv4_addr","inet_proto","inet_service"]}
add set @T refuse6 {"type":["ipv6_addr","inet_proto","inet_service"]}
add set @T snat4 {"type":["ipv4_addr","ipv4_addr","inet_proto","inet_service"]}
add set @T snat6 {"type":["ipv6_addr","ipv6_addr","inet_proto","inet_service"]}
flush set @T masq4 {"type":[]}
flush set @T masq6 {"type":[]}
flush set @T refuse4 {"type":[]}
flush set @T refuse6 {"type":[]}
flush set @T snat4 {"type":[]}
flush set @T snat6 {"type":[]}
add rule @T input #0 [{"match":{"left":{"ct":{"key":"state"}},"op":"!=","right":"new"}},{"return":null}]
add rule @T input #1 [{"match":{"left":{"&":[{"payload":{"field":"flags","protocol":"tcp"}},"syn"]},"op":"==","right":0}},{"match":{"left":{"socket":{"key":"transparent"}},"op":"==","right":0}},{"return":null}]
add rule @T input #2 [{"match":{"left":{"ct":{"key":"state"}},"op":"in","right":"new"}},{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"==","right":"@refuse4"}},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"reject":{"type":"tcp reset"}}]
add rule @T input #3 [{"match":{"left":{"ct":{"key":"state"}},"op":"in","right":"new"}},{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"==","right":"@refuse4"}},{"reject":{"expr":"port-unreachable","type":"icmpx"}}]
add rule @T input #4 [{"match":{"left":{"ct":{"key":"state"}},"op":"in","right":"new"}},{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip6"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"==","right":"@refuse6"}},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"reject":{"type":"tcp reset"}}]
add rule @T input #5 [{"match":{"left":{"ct":{"key":"state"}},"op":"in","right":"new"}},{"match":{"left":{"concat":[{"payload":{"field":"daddr","protocol":"ip6"}},{"meta":{"key":"l4proto"}},{"payload":{"field":"dport","protocol":"th"}}]},"op":"==","right":"@refuse6"}},{"reject":{"expr":"port-unreachable","type":"icmpx"}}]"#
            .lines()
            .map(|l| l.replace("@T", TABLE)),
    );
    out
}

/// Rule `place` of the main table's `postrouting`: source NAT `kind`
/// (masquerade or SNAT to the VIP) of the family `v4` or not.
fn postrouting_rule(place: usize, kind: SourceNat, v4: bool) -> String {
    let (ip, n) = if v4 { ("ip", "4") } else { ("ip6", "6") };
    let (set, nat) = match kind {
        SourceNat::Vip => (
            "snat",
            r#"{"snat":{"addr":{"ct":{"dir":"original","key":"IP daddr"}},"family":"IP"}}"#,
        ),
        _ => ("masq", r#"{"masquerade":{"flags":["fully-random"]}}"#),
    };
    format!(
        r#"add rule {TABLE} postrouting #{place} [{{"match":{{"left":{{"ct":{{"key":"status"}}}},"op":"in","right":"dnat"}}}},{{"match":{{"left":{{"concat":[{{"ct":{{"dir":"original","key":"IP daddr"}}}},{{"payload":{{"field":"daddr","protocol":"IP"}}}},{{"meta":{{"key":"l4proto"}}}},{{"payload":{{"field":"dport","protocol":"th"}}}}]}},"op":"==","right":"@{set}{n}"}}}},{nat}]"#
    )
    .replace("IP", ip)
}

/// A whole full transaction's expected lines: the main table's, those of
/// each of `shards`, and `own` (the listeners' and `postrouting`'s rules).
fn whole(shards: &[Shard], own: &[&str]) -> Vec<String> {
    let mut out = main_lines();
    for s in shards {
        out.extend(table_lines(&s.table()));
    }
    out.extend(own.iter().map(|l| l.to_string()));
    out
}

/// `d`'s full transaction (over tables holding nothing) is, line for line,
/// the main table's, those of each listener's table, and `own`.
#[track_caller]
fn assert_whole(d: &Desired, own: &[&str]) {
    let shards: BTreeSet<Shard> = d.keys().map(Shard::of).collect();
    let shards: Vec<Shard> = shards.into_iter().collect();
    let doc = transaction(d, &TableObjects::default());
    assert_lines(&lines(&doc), &whole(&shards, own));
}

/// The rules of chain `name` (of any table), as lines.
fn rules_in(doc: &serde_json::Value, name: &str) -> Vec<Line> {
    lines_where(doc, |l| l.kind == "rule" && l.name == name)
}

/// The flushes of a partial sync that rewrites the bucket listener of
/// port 80 of 192.0.2.10 with backends 10.0.0.1 to 3: its chains only.
const REWRITTEN_CHAINS: [&str; 4] = [
    "flush chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
    "flush chain harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.1",
    "flush chain harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.2",
    "flush chain harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.3",
];

/// The rules of chain `name` of the main table, with the chain's own
/// `add` and `flush`, as lines.
fn chain_of(doc: &serde_json::Value, name: &str) -> Vec<Line> {
    lines_where(doc, |l| {
        l.table == TABLE && l.name == name && (l.kind == "rule" || l.kind == "chain")
    })
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
    // The whole transaction. Rule 0 takes every second connection, rule 1
    // the rest: no set, no DNAT to 10.0.0.2, no backend chains, no delete.
    // Every member keeps its counter, eligible or not. Masquerade towards
    // every member: a flip changes no element. The dispatch maps are
    // verdict maps (in `table_lines`).
    let masq = postrouting_rule(0, SourceNat::Masquerade, true);
    assert_whole(
        &d,
        &[
            "add chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
            "flush chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
            r#"add counter harvester_lb_nat_15 n_tcp_80_192.0.2.10_10.0.0.1 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 n_tcp_80_192.0.2.10_10.0.0.2 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 n_tcp_80_192.0.2.10_10.0.0.3 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 z_tcp_80_192.0.2.10 {"bytes":null}"#,
            r#"add element harvester_lb_nat masq4 {"concat":["192.0.2.10","10.0.0.1","tcp",30080]}"#,
            r#"add element harvester_lb_nat masq4 {"concat":["192.0.2.10","10.0.0.2","tcp",30080]}"#,
            r#"add element harvester_lb_nat masq4 {"concat":["192.0.2.10","10.0.0.3","tcp",30080]}"#,
            r#"add element harvester_lb_nat refuse4 {"concat":["192.0.2.10","tcp",80]}"#,
            r#"add element harvester_lb_nat_15 dispatch4 [{"concat":["192.0.2.10","tcp",80]},{"goto":{"target":"l_tcp_80_192.0.2.10"}}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #0 [{"match":{"left":{"numgen":{"mod":2,"mode":"inc"}},"op":"==","right":0}},{"counter":"n_tcp_80_192.0.2.10_10.0.0.1"},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"dnat":{"addr":"10.0.0.1","family":"ip","port":30080}}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #1 [{"counter":"n_tcp_80_192.0.2.10_10.0.0.3"},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"dnat":{"addr":"10.0.0.3","family":"ip","port":30080}}]"#,
            &masq,
        ],
    );
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
    // The dispatch maps are verdict maps in the bytes too.
    let maps: Vec<String> = [TABLE, "harvester_lb_nat_15"]
        .into_iter()
        .flat_map(table_lines)
        .filter(|l| l.starts_with("add map "))
        .collect();
    assert_lines(
        &lines_where(&parsed, |l| l.op == "add" && l.kind == "map"),
        &maps,
    );
    let bytes = partial_transaction_json(&after, &before);
    let parsed: serde_json::Value = serde_json::from_slice(&bytes).unwrap();
    assert_eq!(parsed, partial_transaction(&after, &before));
}

#[test]
fn an_open_flow_leaves_the_input_chain_at_its_first_rule() {
    let mut d = Desired::new();
    d.insert(id("192.0.2.10", 80), listener(&["10.0.0.1"], &["10.0.0.1"]));
    let doc = transaction(&d, &TableObjects::default());
    // `ct state != new return` first; then the socket check, then the
    // refusals (every rule of the chain, in order).
    let input: Vec<String> = main_lines()
        .into_iter()
        .filter(|l| l.starts_with(&format!("add rule {TABLE} input ")))
        .collect();
    assert_eq!(input.len(), 6);
    assert!(input[0].ends_with(
        r#"#0 [{"match":{"left":{"ct":{"key":"state"}},"op":"!=","right":"new"}},{"return":null}]"#
    ));
    assert_lines(
        &lines_where(&doc, |l| {
            l.table == TABLE && l.kind == "rule" && l.name == "input"
        }),
        &input,
    );
    // The NAT chains see a flow's first packet only: no such gate there,
    // the socket check comes first.
    let first: Vec<String> = table_lines(TABLE)
        .into_iter()
        .filter(|l| l.starts_with(&format!("add rule {TABLE} prerouting #0 ")))
        .collect();
    assert_lines(
        &lines_where(&doc, |l| {
            l.table == TABLE && l.name == "prerouting" && l.place == Some(0)
        }),
        &first,
    );
}

#[test]
fn no_eligible_backend_counts_and_returns_to_the_refusal() {
    let mut d = Desired::new();
    let l = id("2001:db8::10", 53);
    d.insert(l, listener(&[], &["2001:db8::1"]));
    // The whole transaction: the listener's chain counts and returns (no
    // pick, no numgen); its key is in `refuse6`, whose rules reset TCP
    // (in `main_lines`).
    let masq = postrouting_rule(0, SourceNat::Masquerade, false);
    assert_whole(
        &d,
        &[
            "add chain harvester_lb_nat_15 l_tcp_53_2001-db8--10",
            "flush chain harvester_lb_nat_15 l_tcp_53_2001-db8--10",
            r#"add counter harvester_lb_nat_15 n_tcp_53_2001-db8--10_2001-db8--1 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 z_tcp_53_2001-db8--10 {"bytes":null}"#,
            r#"add element harvester_lb_nat masq6 {"concat":["2001:db8::10","2001:db8::1","tcp",30080]}"#,
            r#"add element harvester_lb_nat refuse6 {"concat":["2001:db8::10","tcp",53]}"#,
            r#"add element harvester_lb_nat_15 dispatch6 [{"concat":["2001:db8::10","tcp",53]},{"goto":{"target":"l_tcp_53_2001-db8--10"}}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_53_2001-db8--10 #0 [{"counter":"z_tcp_53_2001-db8--10"},{"return":null}]"#,
            &masq,
        ],
    );
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
    // The whole transaction: one IPv4 element (the /24 merged into the
    // /16, the IPv6 range left out), a refusal before the pick, and
    // (source_nat = none) no masquerade element and no postrouting rule.
    assert_whole(
        &d,
        &[
            "add chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
            "flush chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
            r#"add counter harvester_lb_nat_15 d_tcp_80_192.0.2.10 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 n_tcp_80_192.0.2.10_10.0.0.1 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 z_tcp_80_192.0.2.10 {"bytes":null}"#,
            r#"add set harvester_lb_nat_15 s_tcp_80_192.0.2.10 {"flags":["interval"],"type":"ipv4_addr"}"#,
            r#"flush set harvester_lb_nat_15 s_tcp_80_192.0.2.10 {"type":[]}"#,
            r#"add element harvester_lb_nat_15 s_tcp_80_192.0.2.10 {"prefix":{"addr":"10.1.0.0","len":16}}"#,
            r#"add element harvester_lb_nat refuse4 {"concat":["192.0.2.10","tcp",80]}"#,
            r#"add element harvester_lb_nat_15 dispatch4 [{"concat":["192.0.2.10","tcp",80]},{"goto":{"target":"l_tcp_80_192.0.2.10"}}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #0 [{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"!=","right":"@s_tcp_80_192.0.2.10"}},{"counter":"d_tcp_80_192.0.2.10"},{"return":null}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #1 [{"counter":"n_tcp_80_192.0.2.10_10.0.0.1"},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"dnat":{"addr":"10.0.0.1","family":"ip","port":30080}}]"#,
        ],
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

fn deletes(doc: &serde_json::Value) -> Vec<Line> {
    // Objects, not elements (a partial sync deletes a changed
    // listener's elements first).
    let cmds = doc["nftables"].as_array().unwrap();
    let object =
        |c: &serde_json::Value| c.get("delete").is_some_and(|d| d.get("element").is_none());
    let first_delete = cmds.iter().position(object);
    let last_flush = cmds.iter().rposition(|c| c.get("flush").is_some());
    assert!(last_flush < first_delete, "deletes after the flushes");
    lines_where(doc, |l| l.op == "delete" && l.kind != "element")
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
    let t = Shard::of(&neighbour).table();
    let tag = listener_tag(&neighbour);
    assert_lines(
        &deleted,
        &[
            format!("delete chain {t} l_{tag}"),
            format!(r#"delete counter {t} n_{tag}_10.0.0.1 {{"bytes":null}}"#),
            format!(r#"delete counter {t} z_{tag} {{"bytes":null}}"#),
            format!(r#"delete counter {t} n_tcp_80_192.0.2.10_10.0.0.2 {{"bytes":null}}"#),
        ],
    );
    assert_eq!(deleted, deletes(&partial_transaction(&after, &before)));
}

/// Every element `op` (`add`, `delete`) of `doc` names, one entry per
/// element: `(set, element)`.
fn element_ops(doc: &serde_json::Value, op: &str) -> Vec<(String, String)> {
    lines_where(doc, |l| l.kind == "element" && l.op == op)
        .into_iter()
        .map(|l| (l.name, l.body))
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
    // transaction: the partial sync writes them, and only there (its base
    // chains, no `input`; its dispatch maps).
    let doc = partial_transaction(&after, &before);
    let away_parts: Vec<String> = table_lines(&t_away.table())
        .into_iter()
        .filter(|l| l.starts_with("add chain ") || l.starts_with("add map "))
        .collect();
    assert_lines(
        &lines_where(&doc, |l| {
            l.op == "add" && (l.kind == "map" || (l.kind == "chain" && !l.body.is_empty()))
        }),
        &away_parts,
    );
    // The refusal and the masquerade stay in the main table.
    let port = away.2;
    assert_lines(
        &lines_where(&doc, |l| l.name == "refuse4" || l.name == "masq4"),
        &[format!(
            r#"add element {TABLE} refuse4 {{"concat":["192.0.2.10","tcp",{port}]}}"#
        )],
    );

    // The full write: every table's parts once, the main one always (its
    // own `input` and `postrouting` there only).
    let doc = transaction(&after, &TableObjects::default());
    let bases: Vec<String> = main_lines()
        .into_iter()
        .chain(table_lines(&t_home.table()))
        .chain(table_lines(&t_away.table()))
        .filter(|l| l.starts_with("add chain "))
        .collect();
    assert_eq!(bases.len(), 8, "{bases:#?}");
    assert_lines(
        &lines_where(&doc, |l| {
            l.op == "add" && l.kind == "chain" && !l.body.is_empty()
        }),
        &bases,
    );

    // The last listener of a table goes: the table goes, whole (its
    // objects go with it, not one by one).
    let deleted = deletes(&partial_transaction(&before, &after));
    assert_lines(&deleted, &[format!("delete table {}", t_away.table())]);

    // A table of a shard this version does not use is deleted, and the
    // main table kept even without a listener.
    let mut present = TableObjects::of(&before);
    present
        .tables
        .insert(Shard::from_table("harvester_lb_nat_99").unwrap());
    let deleted = deletes(&transaction(&Desired::new(), &present));
    assert_lines(
        &deleted,
        &[
            format!("delete table {}", t_home.table()),
            "delete table harvester_lb_nat_99".to_string(),
        ],
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
    // The whole transaction: the other listener is left alone, base
    // chains untouched, one backend left (no numgen), both members stay
    // configured (no chain deleted).
    assert_lines(
        &lines(&partial_transaction(&after, &before)),
        &[
            "add chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
            "flush chain harvester_lb_nat_15 l_tcp_80_192.0.2.10",
            r#"add counter harvester_lb_nat_15 n_tcp_80_192.0.2.10_10.0.0.1 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 n_tcp_80_192.0.2.10_10.0.0.2 {"bytes":null}"#,
            r#"add counter harvester_lb_nat_15 z_tcp_80_192.0.2.10 {"bytes":null}"#,
            r#"delete element harvester_lb_nat refuse4 {"concat":["192.0.2.10","tcp",80]}"#,
            r#"delete element harvester_lb_nat_15 dispatch4 {"concat":["192.0.2.10","tcp",80]}"#,
            r#"add element harvester_lb_nat refuse4 {"concat":["192.0.2.10","tcp",80]}"#,
            r#"add element harvester_lb_nat_15 dispatch4 [{"concat":["192.0.2.10","tcp",80]},{"goto":{"target":"l_tcp_80_192.0.2.10"}}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #0 [{"counter":"n_tcp_80_192.0.2.10_10.0.0.1"},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"dnat":{"addr":"10.0.0.1","family":"ip","port":30080}}]"#,
        ],
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
    let doc = transaction(&before, &TableObjects::default());
    // The listener's chain is one jhash lookup (no numgen); its map is
    // flushed and filled, every bucket to a backend chain.
    assert_lines(
        &rules_in(&doc, "l_tcp_80_192.0.2.10"),
        &[
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #0 [{"vmap":{"data":"@m_tcp_80_192.0.2.10","key":{"jhash":{"expr":{"payload":{"field":"saddr","protocol":"ip"}},"mod":4093,"seed":1751280738}}}}]"#,
        ],
    );
    let mut flushed_maps: Vec<String> = main_lines()
        .into_iter()
        .chain(table_lines("harvester_lb_nat_15"))
        .filter(|l| l.starts_with("flush map "))
        .collect();
    flushed_maps.push(
        r#"flush map harvester_lb_nat_15 m_tcp_80_192.0.2.10 {"map":"ipv4_addr","type":"ipv4_addr"}"#
            .to_string(),
    );
    assert_lines(
        &lines_where(&doc, |l| l.op == "flush" && l.kind == "map"),
        &flushed_maps,
    );
    let map = bucket_map(&l);
    let filled = written_buckets(&doc, &map);
    assert_eq!(filled.len(), 4093);
    assert_eq!(
        filled.values().collect::<BTreeSet<_>>(),
        members
            .iter()
            .map(|b| backend_chain(&l, ip(b)))
            .collect::<BTreeSet<_>>()
            .iter()
            .collect()
    );
    let script = prelude(&before, None, &TableObjects::default()).unwrap();
    assert_eq!(
        script,
        "add table inet harvester_lb_nat_15\nadd map inet harvester_lb_nat_15 m_tcp_80_192.0.2.10 { typeof numgen inc mod 4093 : verdict ; }\n"
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
    let deleted = element_ops(&doc, "delete")
        .into_iter()
        .filter(|(set, _)| *set == map)
        .count();
    assert_eq!(deleted, moved);
    assert_eq!(written_buckets(&doc, &map).len(), moved);
    // No flush of the map: the flushes are the listener's chains only.
    assert_lines(&lines_where(&doc, |l| l.op == "flush"), &REWRITTEN_CHAINS);

    // Back to round robin: the map goes, after the chain that used it.
    let mut rr = before.clone();
    rr.get_mut(&l).unwrap().pick = Algorithm::RoundRobin;
    assert_lines(
        &deletes(&partial_transaction(&rr, &before)),
        &[
            r#"delete map harvester_lb_nat_15 m_tcp_80_192.0.2.10 {"map":"ipv4_addr","type":"ipv4_addr"}"#,
            "delete chain harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.1",
            "delete chain harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.2",
            "delete chain harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.3",
        ],
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
    let doc = transaction(&d, &TableObjects::default());
    // The listener's chain is one jhash lookup of address and port (no
    // numgen).
    assert_lines(
        &rules_in(&doc, "l_tcp_80_192.0.2.10"),
        &[
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #0 [{"vmap":{"data":"@m_tcp_80_192.0.2.10","key":{"jhash":{"expr":{"concat":[{"payload":{"field":"saddr","protocol":"ip"}},{"payload":{"field":"sport","protocol":"th"}}]},"mod":4093,"seed":1751280738}}}}]"#,
        ],
    );
    // Its map is declared as source_ip's, and filled alike.
    let script = prelude(&d, None, &TableObjects::default()).unwrap();
    assert_eq!(
        script,
        "add table inet harvester_lb_nat_15\nadd map inet harvester_lb_nat_15 m_tcp_80_192.0.2.10 { typeof numgen inc mod 4093 : verdict ; }\n"
    );
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
    assert_lines(
        &lines_where(&doc, |l| l.name == "pickup4" && l.kind == "element"),
        &[r#"add element harvester_lb_nat_15 pickup4 {"concat":["192.0.2.10","tcp",80]}"#],
    );
    let skip: Vec<String> = table_lines("harvester_lb_nat_15")
        .into_iter()
        .filter(|l| l.starts_with("add rule harvester_lb_nat_15 prerouting #0 "))
        .collect();
    assert_lines(
        &lines_where(&doc, |l| {
            l.table == "harvester_lb_nat_15" && l.name == "prerouting" && l.place == Some(0)
        }),
        &skip,
    );
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
    // No flush of the map: the flushes are the listener's chains only.
    assert_lines(&lines_where(&doc, |l| l.op == "flush"), &REWRITTEN_CHAINS);
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
    let doc = transaction(&d, &TableObjects::default());
    assert_lines(
        &chain_of(&doc, "postrouting"),
        &[
            main_lines()
                .into_iter()
                .find(|l| l.starts_with(&format!("add chain {TABLE} postrouting ")))
                .unwrap(),
            main_lines()
                .into_iter()
                .find(|l| l.starts_with(&format!("flush chain {TABLE} postrouting ")))
                .unwrap(),
            postrouting_rule(0, SourceNat::Vip, true),
        ],
    );
    assert!(postrouting_rule(0, SourceNat::Vip, true).ends_with(
        r#"{"snat":{"addr":{"ct":{"dir":"original","key":"ip daddr"}},"family":"ip"}}]"#
    ));
    assert_lines(
        &lines_where(&doc, |l| l.kind == "element" && l.name.starts_with("snat")),
        &[
            r#"add element harvester_lb_nat snat4 {"concat":["192.0.2.10","10.0.0.1","tcp",30080]}"#,
            r#"add element harvester_lb_nat snat4 {"concat":["192.0.2.10","10.0.0.2","tcp",30080]}"#,
        ],
    );
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
    let doc = transaction(&d, &TableObjects::default());
    let script = prelude(&d, None, &TableObjects::default()).unwrap();
    assert_eq!(
        script,
        "add table inet harvester_lb_nat_15\n\
         add set inet harvester_lb_nat_15 a_tcp_80_192.0.2.10_10.0.0.1 { type ipv4_addr ; flags dynamic,timeout ; timeout 600s ; }\n\
         add set inet harvester_lb_nat_15 a_tcp_80_192.0.2.10_10.0.0.2 { type ipv4_addr ; flags dynamic,timeout ; timeout 600s ; }\n"
    );
    assert_eq!(
        prelude(&d, Some(&d), &TableObjects::of(&d)),
        None,
        "unchanged: nothing"
    );
    // Only the eligible backend's set is looked up, before the pick (one
    // eligible backend: a plain goto).
    assert_lines(
        &rules_in(&doc, "l_tcp_80_192.0.2.10"),
        &[
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #0 [{"match":{"left":{"payload":{"field":"saddr","protocol":"ip"}},"op":"==","right":"@a_tcp_80_192.0.2.10_10.0.0.1"}},{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0.1"}}]"#,
            r#"add rule harvester_lb_nat_15 l_tcp_80_192.0.2.10 #1 [{"goto":{"target":"b_tcp_80_192.0.2.10_10.0.0.1"}}]"#,
        ],
    );
    // Every backend chain remembers its clients; a backend out of the
    // choice loses them (its set flushed, the eligible one's kept).
    assert_lines(
        &lines_where(&doc, |l| l.kind == "rule" && l.name.starts_with("b_")),
        &[
            r#"add rule harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.1 #0 [{"set":{"elem":{"payload":{"field":"saddr","protocol":"ip"}},"op":"update","set":"@a_tcp_80_192.0.2.10_10.0.0.1"}},{"counter":"n_tcp_80_192.0.2.10_10.0.0.1"},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"dnat":{"addr":"10.0.0.1","family":"ip","port":30080}}]"#,
            r#"add rule harvester_lb_nat_15 b_tcp_80_192.0.2.10_10.0.0.2 #0 [{"set":{"elem":{"payload":{"field":"saddr","protocol":"ip"}},"op":"update","set":"@a_tcp_80_192.0.2.10_10.0.0.2"}},{"counter":"n_tcp_80_192.0.2.10_10.0.0.2"},{"match":{"left":{"meta":{"key":"l4proto"}},"op":"==","right":"tcp"}},{"dnat":{"addr":"10.0.0.2","family":"ip","port":30080}}]"#,
        ],
    );
    assert_lines(
        &lines_where(&doc, |l| {
            l.op == "flush" && l.kind == "set" && l.table != TABLE
        }),
        &[
            r#"flush set harvester_lb_nat_15 pickup4 {"type":[]}"#,
            r#"flush set harvester_lb_nat_15 pickup6 {"type":[]}"#,
            r#"flush set harvester_lb_nat_15 a_tcp_80_192.0.2.10_10.0.0.2 {"type":[]}"#,
        ],
    );
}

#[test]
fn postrouting_looks_up_only_the_source_nats_in_use() {
    let v4 = id("192.0.2.10", 80);
    let mut none = Desired::new();
    let mut l = listener(&["10.0.0.1"], &["10.0.0.1"]);
    l.source_nat = SourceNat::None;
    none.insert(v4, l.clone());
    // `none` only: the first packet of a new flow meets no rule there.
    let base: Vec<String> = main_lines()
        .into_iter()
        .filter(|l| {
            l.starts_with(&format!("add chain {TABLE} postrouting "))
                || l.starts_with(&format!("flush chain {TABLE} postrouting "))
        })
        .collect();
    assert_eq!(base.len(), 2, "{base:?}");
    let doc = transaction(&none, &TableObjects::default());
    assert_lines(&chain_of(&doc, "postrouting"), &base);
    // One IPv4 masquerade listener: one rule, the IPv4 masquerade.
    let mut masq = none.clone();
    masq.insert(id("192.0.2.10", 81), listener(&["10.0.0.1"], &["10.0.0.1"]));
    let doc = transaction(&masq, &TableObjects::default());
    let with = |rules: &[String]| [base.clone(), rules.to_vec()].concat();
    let masq4 = postrouting_rule(0, SourceNat::Masquerade, true);
    assert_lines(
        &chain_of(&doc, "postrouting"),
        &with(std::slice::from_ref(&masq4)),
    );
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
    let doc = transaction(&all, &TableObjects::default());
    assert_lines(
        &chain_of(&doc, "postrouting"),
        &with(&[
            postrouting_rule(0, SourceNat::Masquerade, true),
            postrouting_rule(1, SourceNat::Vip, true),
            postrouting_rule(2, SourceNat::Masquerade, false),
            postrouting_rule(3, SourceNat::Vip, false),
        ]),
    );
    // A partial sync rewrites the chain when the kinds change (a flush of
    // the chain by name, then the rules), and leaves it alone when they do
    // not.
    let flush = format!("flush chain {TABLE} postrouting");
    let doc = partial_transaction(&masq, &none);
    assert_lines(&chain_of(&doc, "postrouting"), &[flush.clone(), masq4]);
    let doc = partial_transaction(&none, &masq);
    assert_lines(&chain_of(&doc, "postrouting"), &[flush]);
    let mut flipped = masq.clone();
    flipped.get_mut(&v4).unwrap().eligible.clear();
    let doc = partial_transaction(&flipped, &masq);
    assert_lines(&chain_of(&doc, "postrouting"), &[] as &[String]);
    assert!(!lines(&doc).is_empty(), "the flip itself is written");
}

//! UDP listeners against real peers: dnsmasq instances queried with `dig`
//! through the VIP (answers correct, from the VIP, spread by the algorithm;
//! an instance stopped costs no query after detection), TCP and UDP on one
//! VIP:port, a long flow that keeps its backend across 20 reloads, the ICMP
//! re-pick, the flow bounds, datagrams of every size forwarded whole, and a
//! property test of the UDP keys of the config.
//!
//! dnsmasq and dig come from the Debian packages `dnsmasq-base` and
//! `bind9-dnsutils` (`.ci/run` installs them); a test that finds them
//! missing says so and skips.

use crate::support;

use std::collections::{HashMap, HashSet};
use std::net::{IpAddr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::*;
use tokio::net::UdpSocket;
use tokio::time::Instant;

const LB: &str = "kube-system/dns";

/// A dnsmasq answering `who.test` with its own address from a hosts file,
/// on UDP and TCP port 5353 of `ip`.
struct Dnsmasq {
    child: Child,
}

impl Dnsmasq {
    async fn start(net: &Subnet, ip: IpAddr, answer: &str) -> Self {
        let hosts = net.write(&format!("hosts-{ip}"), &format!("{answer} who.test\n"));
        let pid = net.dir().join(format!("dnsmasq-{ip}.pid"));
        let child = Command::new("dnsmasq")
            .args([
                "-k",
                "--conf-file=/dev/null",
                "--no-resolv",
                "--no-hosts",
                &format!("--addn-hosts={}", hosts.display()),
                &format!("--listen-address={ip}"),
                "--bind-interfaces",
                "--port=5353",
                "--user=root",
                &format!("--pid-file={}", pid.display()),
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start dnsmasq");
        // Ready when its TCP side accepts (both sides open together).
        let addr = SocketAddr::new(ip, 5353);
        wait_for(
            Duration::from_secs(10),
            "dnsmasq to listen",
            || async move { tokio::net::TcpStream::connect(addr).await.ok().map(|_| ()) },
        )
        .await;
        Self { child }
    }

    fn stop(mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Dnsmasq {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// `dig -b SRC @VIP -p 5353 who.test +short`: the answer, or `None` when no
/// answer came within a second (dig drops answers from another address
/// than the one it asked, so an answer is also proof of its source).
async fn dig(src: IpAddr, vip: IpAddr, tcp: bool) -> Option<String> {
    tokio::task::spawn_blocking(move || {
        let mut cmd = Command::new("dig");
        cmd.args([
            "-b",
            &src.to_string(),
            &format!("@{vip}"),
            "-p",
            "5353",
            "who.test",
            "+short",
            "+time=1",
            "+tries=1",
        ]);
        if tcp {
            cmd.arg("+tcp");
        }
        let out = cmd.output().ok()?;
        let text = String::from_utf8_lossy(&out.stdout).trim().to_string();
        (out.status.success() && !text.is_empty() && !text.starts_with(';')).then_some(text)
    })
    .await
    .ok()
    .flatten()
}

/// The DNS service on `.1:5353`: UDP and TCP to port 5353 of `backends`,
/// checked over TCP.
fn dns_config(net: &Subnet, backends: &[u8], extra: &str) -> Config {
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new(LB, net.ip(1))
        .backends(net.ips(backends))
        .keys("algorithm = \"round_robin\"")
        .keys(extra)
        .listener(Listener::new("dns", 5353, 5353).udp())
        .listener(Listener::new("dns-tcp", 5353, 5353).keys("  protocol = \"tcp\""))
        .health(
            "  port = 5353\n  period_seconds = 1\n  timeout_seconds = 1\n  failure_threshold = 2",
        ))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dns_through_the_vip_is_answered_from_the_vip_spread_and_survives_a_stopped_server() {
    if cannot_run(
        "dns through the vip",
        [
            missing_tool("dnsmasq", "dnsmasq-base"),
            missing_tool("dig", "bind9-dnsutils"),
        ],
    ) {
        return;
    }
    let net = Subnet::new();
    let answers: HashMap<u8, String> = [11u8, 12, 13]
        .iter()
        .map(|h| (*h, format!("10.9.0.{h}")))
        .collect();
    let mut servers = HashMap::new();
    for h in [11u8, 12, 13] {
        servers.insert(h, Dnsmasq::start(&net, net.ip(h), &answers[&h]).await);
    }
    let d = Daemon::start(&net, dns_config(&net, &[11, 12, 13], "udp_responses = 1")).await;
    let vip = net.ip(1);

    // Twelve queries from four source addresses: every answer is one of the
    // servers', and round robin reaches all three.
    let mut seen = HashSet::new();
    for i in 0..12u8 {
        let src = net.ip(100 + i % 4);
        let answer = dig(src, vip, false)
            .await
            .unwrap_or_else(|| panic!("query {i} from {src} got no answer"));
        assert!(
            answers.values().any(|a| *a == answer),
            "answer {answer:?} is none of the servers'"
        );
        seen.insert(answer);
    }
    assert_eq!(seen.len(), 3, "round robin spreads flows: {seen:?}");

    // The same VIP:port over TCP, served alongside.
    let over_tcp = dig(net.ip(100), vip, true)
        .await
        .expect("dig +tcp answered");
    assert!(answers.values().any(|a| *a == over_tcp));

    let (_, metrics) = d.get("/metrics").await;
    let labels = format!("cluster=\"kubernetes\",load_balancer=\"{LB}\",listener=\"dns\"");
    let sent = metric_value(
        &metrics,
        &format!("harvester_lb_udp_datagrams_total{{{labels},direction=\"client_to_backend\"}}"),
    );
    let back = metric_value(
        &metrics,
        &format!("harvester_lb_udp_datagrams_total{{{labels},direction=\"backend_to_client\"}}"),
    );
    assert!(
        sent >= 12.0 && back >= 12.0,
        "datagrams counted: {sent} / {back}"
    );
    let created = metric_value(
        &metrics,
        &format!("harvester_lb_udp_flows_created_total{{{labels}}}"),
    );
    assert!(created >= 12.0, "one flow per query: {created}");
    let bytes = metric_value(
        &metrics,
        &format!("harvester_lb_udp_bytes_total{{{labels},direction=\"backend_to_client\"}}"),
    );
    assert!(bytes >= 12.0 * 40.0, "answer bytes counted: {bytes}");
    assert!(
        !metrics.contains(&format!(
            "harvester_lb_connections_accepted_total{{{labels}}}"
        )),
        "a UDP listener has no connection series"
    );
    promtool_accepts(&metrics);

    // udp_responses = 1: every flow ended at its answer.
    wait_for(
        Duration::from_secs(5),
        "flows to end at their answer",
        || async {
            let status = d.status().await;
            let l = &status["load_balancers"][0]["listeners"];
            let udp = l
                .as_array()?
                .iter()
                .find(|x| x["protocol"] == "udp")?
                .clone();
            (udp["active_flows"] == 0).then_some(())
        },
    )
    .await;

    // One server stopped: the TCP check on its port marks it down; after
    // that no query is lost.
    servers.remove(&12).expect("running").stop();
    d.wait_health(LB, &net.ip_str(12), "unhealthy", Duration::from_secs(10))
        .await;
    let mut lost = 0;
    let mut by = HashSet::new();
    for i in 0..30u8 {
        match dig(net.ip(100 + i % 5), vip, false).await {
            Some(a) => {
                by.insert(a);
            }
            None => lost += 1,
        }
    }
    println!("FIGURE udp: 30 queries after detection of a stopped dnsmasq: {lost} lost");
    assert_eq!(
        lost, 0,
        "no query lost once the stopped server is marked down"
    );
    assert!(
        !by.contains(&answers[&12]),
        "nothing answered by the stopped one"
    );
    assert_eq!(by.len(), 2, "the two others share the flows");
    d.stop().await;
}

/// A UDP backend that answers every datagram with its name followed by
/// the datagram (so a client learns who answered and checks the bytes).
struct UdpServer {
    addr: SocketAddr,
    task: tokio::task::JoinHandle<()>,
}

impl UdpServer {
    async fn start(addr: SocketAddr, name: &'static str) -> Self {
        let socket = UdpSocket::bind(addr).await.expect("bind UDP backend");
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 65_536];
            loop {
                let Ok((n, from)) = socket.recv_from(&mut buf).await else {
                    continue;
                };
                let mut answer = name.as_bytes().to_vec();
                answer.push(b':');
                answer.extend_from_slice(&buf[..n.min(65_507 - answer.len())]);
                let _ = socket.send_to(&answer, from).await;
            }
        });
        Self { addr, task }
    }

    /// Closes its socket: the next datagram to it draws an ICMP port-unreachable.
    async fn stop(self) {
        self.task.abort();
        let _ = self.task.await;
        let _ = self.addr;
    }
}

/// Sends `payload` on `client` and waits up to `wait` for an answer, which
/// must come from `vip`.
async fn ask(
    client: &UdpSocket,
    vip: SocketAddr,
    payload: &[u8],
    wait: Duration,
) -> Option<Vec<u8>> {
    client.send_to(payload, vip).await.ok()?;
    let mut buf = vec![0u8; 65_536];
    let (n, from) = tokio::time::timeout(wait, client.recv_from(&mut buf))
        .await
        .ok()?
        .ok()?;
    assert_eq!(
        from, vip,
        "the answer comes from the VIP:port the client wrote to"
    );
    Some(buf[..n].to_vec())
}

fn who(answer: &[u8]) -> String {
    let s = String::from_utf8_lossy(answer);
    s.split(':').next().unwrap_or_default().to_string()
}

fn echo_config(net: &Subnet, backends: &[u8], extra: &str, proxy: &str) -> String {
    Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .proxy(proxy)
        .lb(Lb::new("default/udp", net.ip(1))
            .backends(net.ips(backends))
            .keys(extra)
            .listener(Listener::new("game", 7000, 30700).udp()))
        .to_string()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_long_flow_keeps_its_backend_across_twenty_reloads() {
    let net = Subnet::new();
    let _a = UdpServer::start(SocketAddr::new(net.ip(11), 30700), "a").await;
    let _b = UdpServer::start(SocketAddr::new(net.ip(12), 30700), "b").await;
    let _c = UdpServer::start(SocketAddr::new(net.ip(13), 30700), "c").await;
    let base = echo_config(&net, &[11, 12, 13], "", "");
    let d = Daemon::start(&net, &base).await;
    let vip = SocketAddr::new(net.ip(1), 7000);

    // The client: a datagram every 50 ms for 10 s, from one address and port.
    let client = tokio::spawn({
        let src = net.ip(100);
        async move {
            let socket = UdpSocket::bind(SocketAddr::new(src, 0)).await.unwrap();
            let mut answered: Vec<String> = Vec::new();
            let mut lost = 0;
            let mut tick = tokio::time::interval(Duration::from_millis(50));
            let end = Instant::now() + Duration::from_secs(10);
            let mut i = 0u32;
            while Instant::now() < end {
                tick.tick().await;
                match ask(
                    &socket,
                    vip,
                    format!("{i}").as_bytes(),
                    Duration::from_millis(500),
                )
                .await
                {
                    Some(a) => answered.push(who(&a)),
                    None => lost += 1,
                }
                i += 1;
            }
            (answered, lost)
        }
    });

    // Twenty reloads meanwhile, each a real change: another load balancer
    // comes and goes, and this one's idle timeout moves.
    for r in 0..20 {
        let extra = format!("udp_idle_timeout_seconds = {}", 60 + r % 2);
        let mut text = echo_config(&net, &[11, 12, 13], &extra, "");
        if r % 2 == 0 {
            let other = Lb::new("default/other", net.ip(2))
                .backends([net.ip(11)])
                .listener(Listener::new("o", 7001, 30701).udp());
            text = format!("{text}\n{other}");
        }
        std::fs::write(&d.config, text).unwrap();
        let (code, body) = http(d.admin, "POST", "/reload").await;
        assert_eq!(code, 200, "reload {r}: {body}");
        tokio::time::sleep(Duration::from_millis(400)).await;
    }
    let (answered, lost) = client.await.unwrap();
    let backends: HashSet<&String> = answered.iter().collect();
    println!(
        "FIGURE udp: long flow over 20 reloads: {} answered, {lost} lost, backends {backends:?}",
        answered.len()
    );
    assert_eq!(backends.len(), 1, "one backend for the whole flow");
    assert!(
        lost * 20 <= answered.len() + lost,
        "at most 5% lost on a busy machine: {lost} of {}",
        answered.len() + lost
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_port_unreachable_backend_moves_the_flow_and_is_counted() {
    let net = Subnet::new();
    let a = UdpServer::start(SocketAddr::new(net.ip(11), 30700), "a").await;
    let b = UdpServer::start(SocketAddr::new(net.ip(12), 30700), "b").await;
    // No health check: every backend is eligible, only ICMP tells.
    let d = Daemon::start(&net, &echo_config(&net, &[11, 12], "", "")).await;
    let vip = SocketAddr::new(net.ip(1), 7000);
    let client = UdpSocket::bind(SocketAddr::new(net.ip(100), 0))
        .await
        .unwrap();
    let first = who(&ask(&client, vip, b"1", Duration::from_secs(2))
        .await
        .expect("answered"));
    let (gone, other) = if first == "a" { (a, "b") } else { (b, "a") };
    let gone_ip = gone.addr.ip();
    gone.stop().await;
    // The datagram in flight to the stopped backend is lost (its ICMP
    // error marks the flow); the flow moves to the other one.
    let moved = wait_for(Duration::from_secs(10), "the flow to move", || async {
        ask(&client, vip, b"2", Duration::from_millis(300))
            .await
            .map(|a| who(&a))
    })
    .await;
    assert_eq!(moved, other);
    for i in 0..5 {
        let a = ask(
            &client,
            vip,
            format!("x{i}").as_bytes(),
            Duration::from_secs(2),
        )
        .await;
        assert_eq!(a.map(|a| who(&a)).as_deref(), Some(other), "it stays moved");
    }
    let icmp = d
        .metric(&format!(
            "harvester_lb_udp_backend_icmp_errors_total{{cluster=\"kubernetes\",load_balancer=\"default/udp\",listener=\"game\",backend=\"{gone_ip}\"}}"
        ))
        .await;
    assert!(icmp >= 1.0, "the ICMP error is counted per backend: {icmp}");
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flow_whose_backend_is_removed_or_drained_moves_at_its_next_datagram() {
    let net = Subnet::new();
    let _a = UdpServer::start(SocketAddr::new(net.ip(11), 30700), "a").await;
    let _b = UdpServer::start(SocketAddr::new(net.ip(12), 30700), "b").await;
    let _c = UdpServer::start(SocketAddr::new(net.ip(13), 30700), "c").await;
    let d = Daemon::start(&net, &echo_config(&net, &[11, 12, 13], "", "")).await;
    let vip = SocketAddr::new(net.ip(1), 7000);
    let client = UdpSocket::bind(SocketAddr::new(net.ip(100), 0))
        .await
        .unwrap();
    let ask_who = || async {
        who(&ask(&client, vip, b"q", Duration::from_secs(2))
            .await
            .expect("answered"))
    };
    let first = ask_who().await;
    assert_eq!(ask_who().await, first, "a flow keeps its backend");
    let host = |name: &str| match name {
        "a" => 11u8,
        "b" => 12,
        _ => 13,
    };
    // Drained: the very next datagram goes elsewhere, and stays there.
    let (code, body) = http_unix(
        &d.socket,
        "POST",
        "/backends/state",
        &format!(
            r#"{{"load_balancer":"default/udp","backend":"{}","state":"drain"}}"#,
            net.ip_str(host(&first))
        ),
    )
    .await;
    assert_eq!(code, 200, "{body}");
    let second = ask_who().await;
    assert_ne!(second, first, "no datagram to a drained backend");
    assert_eq!(ask_who().await, second);
    // Removed by a reload: the same.
    let rest: Vec<u8> = [11u8, 12, 13]
        .into_iter()
        .filter(|h| *h != host(&second))
        .collect();
    std::fs::write(&d.config, echo_config(&net, &rest, "", "")).unwrap();
    let (code, body) = http(d.admin, "POST", "/reload").await;
    assert_eq!(code, 200, "{body}");
    let third = ask_who().await;
    assert_ne!(third, second, "no datagram to a removed backend");
    d.stop().await;
}

/// One client socket on each of `sources`, on a port of its own.
async fn clients_on(sources: &[IpAddr]) -> Vec<UdpSocket> {
    let mut v = Vec::new();
    for ip in sources {
        v.push(UdpSocket::bind(SocketAddr::new(*ip, 0)).await.unwrap());
    }
    v
}

/// How many of `clients` get an answer to one datagram (300 ms each).
async fn answered(clients: &[UdpSocket], vip: SocketAddr) -> usize {
    let mut n = 0;
    for c in clients {
        if ask(c, vip, b"hello", Duration::from_millis(300))
            .await
            .is_some()
        {
            n += 1;
        }
    }
    n
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_flow_table_is_bounded_and_serves_again_when_flows_expire() {
    let net = Subnet::new();
    let _a = UdpServer::start(SocketAddr::new(net.ip(11), 30700), "a").await;
    let d = Daemon::start(
        &net,
        &echo_config(
            &net,
            &[11],
            "udp_idle_timeout_seconds = 4",
            "max_udp_flows = 4\nmax_udp_flows_per_source = 2",
        ),
    )
    .await;
    let vip = SocketAddr::new(net.ip(1), 7000);
    let labels = "cluster=\"kubernetes\",load_balancer=\"default/udp\",listener=\"game\"";

    // One source floods ports: two flows, the rest dropped as its share.
    let flood = clients_on(&[net.ip(100); 4]).await;
    assert_eq!(
        answered(&flood, vip).await,
        2,
        "one source gets its share, no more"
    );
    let share = d
        .metric(&format!(
            "harvester_lb_udp_flows_dropped_total{{{labels},reason=\"source_limit\"}}"
        ))
        .await;
    assert_eq!(share, 2.0);

    // More client addresses than the table holds: the excess is dropped
    // and counted; the table never holds more than its bound.
    let sources: Vec<IpAddr> = (101..=106u8).map(|h| net.ip(h)).collect();
    let clients = clients_on(&sources).await;
    assert_eq!(
        answered(&clients, vip).await,
        2,
        "two slots were left of four"
    );
    let full = d
        .metric(&format!(
            "harvester_lb_udp_flows_dropped_total{{{labels},reason=\"table_full\"}}"
        ))
        .await;
    assert_eq!(full, 4.0, "the excess is counted");
    let active = d
        .metric(&format!("harvester_lb_udp_flows_active{{{labels}}}"))
        .await;
    assert_eq!(active, 4.0);

    // Silence for the idle timeout frees the table; the refused are served.
    wait_for(Duration::from_secs(20), "flows to expire", || async {
        let n = d
            .metric(&format!("harvester_lb_udp_flows_active{{{labels}}}"))
            .await;
        (n == 0.0).then_some(())
    })
    .await;
    for s in clients.iter().rev().take(4) {
        assert!(
            ask(s, vip, b"again", Duration::from_secs(2))
                .await
                .is_some(),
            "served once flows expired"
        );
    }
    let status = d.status().await;
    let listener = &status["load_balancers"][0]["listeners"][0];
    assert_eq!(listener["protocol"], "udp");
    assert_eq!(listener["active_flows"], 4);
    assert_eq!(
        status["load_balancers"][0]["backends"][0]["active_flows"],
        4
    );
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn datagrams_of_every_size_up_to_65507_bytes_are_forwarded_whole() {
    let net = Subnet::new();
    let _echo = udp_echo(SocketAddr::new(net.ip(11), 30700)).await;
    let d = Daemon::start(&net, &echo_config(&net, &[11], "", "")).await;
    let vip = SocketAddr::new(net.ip(1), 7000);
    let client = UdpSocket::bind(SocketAddr::new(net.ip(100), 0))
        .await
        .unwrap();
    // Property: for random sizes (and the edges), the answer is byte-exact.
    let mut sizes = vec![0usize, 1, 1472, 1473, 9000, 65_507];
    let mut rng = Rng::new(0x2545_F491_4F6C_DD1D);
    for _ in 0..40 {
        sizes.push(rng.below(65_508));
    }
    let mut pattern = Rng::new(7);
    for size in sizes {
        let mut payload = vec![0u8; size];
        pattern.fill(&mut payload);
        let answer = wait_for(Duration::from_secs(5), "an echo", || {
            let client = &client;
            let payload = &payload;
            async move { ask(client, vip, payload, Duration::from_millis(500)).await }
        })
        .await;
        assert_eq!(answer.len(), size, "size {size} forwarded whole");
        assert!(answer == payload, "size {size} byte-exact");
    }
    d.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn ipv6_flows_answer_from_the_vip() {
    let net = Subnet::new();
    // ::1 is shared by every test process: ports the kernel hands out.
    let free_port = || {
        std::net::UdpSocket::bind("[::1]:0")
            .and_then(|s| s.local_addr())
            .map(|a| a.port())
            .expect("an IPv6 loopback port")
    };
    let (vip_port, backend_port) = (free_port(), free_port());
    let backend = SocketAddr::new("::1".parse().unwrap(), backend_port);
    let _echo = udp_echo(backend).await;
    let config = Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new("default/v6", "::1")
            .backends(["::1"])
            .listener(Listener::new("v6", vip_port, backend_port).udp()));
    let d = Daemon::start(&net, &config).await;
    let vip = SocketAddr::new("::1".parse().unwrap(), vip_port);
    let client = UdpSocket::bind("[::1]:0").await.unwrap();
    let answer = ask(&client, vip, b"over IPv6", Duration::from_secs(2)).await;
    assert_eq!(answer.as_deref(), Some(&b"over IPv6"[..]));
    d.stop().await;
}

#[test]
fn udp_keys_are_validated_with_their_key_paths() {
    let base = |listeners: Vec<Listener>, lb_keys: &str, proxy: &str| {
        let lb = listeners.into_iter().fold(
            Lb::new("a/b", "127.0.9.1")
                .backends(["127.0.9.11"])
                .keys(lb_keys),
            Lb::listener,
        );
        Config::new().proxy(proxy).lb(lb).to_string()
    };
    let l = |name: &str, proto: &str, more: &str| {
        Listener::new(name, 53, 30053)
            .keys(&format!("  protocol = {}", quote(proto)))
            .keys(more)
    };
    // TCP and UDP on one VIP:port: both valid.
    let ok = base(vec![l("t", "tcp", ""), l("u", "udp", "")], "", "");
    let loaded = harvester_lb::config::parse(&ok).expect("tcp and udp on one port");
    assert_eq!(loaded.config.load_balancers[0].listeners.len(), 2);
    assert_eq!(
        loaded.config.load_balancers[0].udp.idle_timeout,
        Duration::from_secs(60),
        "default idle timeout"
    );
    let two_udp = rendered(&base(vec![l("u1", "udp", ""), l("u2", "udp", "")], "", ""));
    assert!(
        two_udp.contains("load_balancer[0].listener[1].port")
            && two_udp.contains("127.0.9.1:53/udp is already a listener"),
        "{two_udp}"
    );
    let pp = rendered(&base(
        vec![l("u", "udp", "  proxy_protocol = \"v2\"")],
        "",
        "",
    ));
    assert!(
        pp.contains("load_balancer[0].listener[0].proxy_protocol") && pp.contains("UDP listener"),
        "{pp}"
    );
    let proto = rendered(&base(vec![l("u", "sctp", "")], "", ""));
    assert!(
        proto.contains("load_balancer[0].listener[0].protocol") && proto.contains("\"udp\""),
        "{proto}"
    );
    let idle = rendered(&base(
        vec![l("u", "udp", "")],
        "udp_idle_timeout_seconds = 0\nudp_responses = -1",
        "",
    ));
    assert!(
        idle.contains("load_balancer[0].udp_idle_timeout_seconds")
            && idle.contains("load_balancer[0].udp_responses"),
        "{idle}"
    );
    let flows = rendered(&base(
        vec![l("u", "udp", "")],
        "",
        "max_udp_flows = 0\nmax_udp_flows_per_source = \"x\"",
    ));
    assert!(
        flows.contains("proxy.max_udp_flows") && flows.contains("proxy.max_udp_flows_per_source"),
        "{flows}"
    );
}

#[test]
fn per_listener_checks_probe_tcp_nodeports_only() {
    let text = |listeners: Vec<Listener>| {
        let lb = listeners.into_iter().fold(
            Lb::new("a/b", "127.0.9.1")
                .backends(["127.0.9.11"])
                .health("  period_seconds = 1\n  timeout_seconds = 1"),
            Lb::listener,
        );
        Config::new().lb(lb).to_string()
    };
    let l = |name: &str, port: u16, proto: &str| {
        Listener::new(name, 53, port).keys(&format!("  protocol = {}", quote(proto)))
    };
    // A UDP nodeport answers no handshake: only the TCP listener's is checked.
    let mixed = harvester_lb::config::parse(&text(vec![
        l("dns", 30053, "udp"),
        l("dns-tcp", 30054, "tcp"),
    ]))
    .expect("valid");
    assert_eq!(mixed.config.load_balancers[0].checked_ports(), vec![30054]);
    assert!(mixed.warnings.is_empty());
    // Only UDP listeners and no check port: nothing could be checked; said so.
    let only_udp = harvester_lb::config::parse(&text(vec![l("dns", 30053, "udp")])).expect("valid");
    assert!(only_udp.config.load_balancers[0].checked_ports().is_empty());
    let warned: Vec<String> = only_udp.warnings.iter().map(|w| w.to_string()).collect();
    assert!(
        warned
            .iter()
            .any(|w| w.contains("load_balancer[0].health_check.port")
                && w.contains("only UDP listeners")),
        "{warned:?}"
    );
}

/// Property: whatever is done to a config with UDP listeners, `parse`
/// never panics, and what it accepts holds the UDP rules (one listener per
/// VIP, port and protocol; no PROXY header on UDP).
#[test]
fn mutated_udp_configs_never_panic_and_valid_ones_hold_the_rules() {
    let base = r#"
[proxy]
max_udp_flows = 1000
max_udp_flows_per_source = 10
[[load_balancer]]
name = "a/dns"
vip = "127.0.9.1"
backends = ["127.0.9.11", "127.0.9.12"]
udp_idle_timeout_seconds = 30
udp_responses = 1
  [[load_balancer.listener]]
  name = "dns"
  port = 53
  backend_port = 30053
  protocol = "udp"
  [[load_balancer.listener]]
  name = "dns-tcp"
  port = 53
  backend_port = 30053
  protocol = "tcp"
"#;
    assert!(harvester_lb::config::parse(base).is_ok());
    let tokens = [
        "\"udp\"",
        "\"tcp\"",
        "\"UDP\"",
        "0",
        "-1",
        "65536",
        "99999999999999999999",
        "proxy_protocol = \"v1\"\n",
        "protocol = \"udp\"\n",
        "port = 53\n",
        "[]",
        "\"\"",
    ];
    let mut rng = Rng::new(0x9E37_79B9_7F4A_7C15);
    let mut next = move || rng.next_u64();
    let (mut ok, mut rejected) = (0, 0);
    for i in 0..5_000 {
        let mut s: Vec<char> = base.chars().collect();
        for _ in 0..1 + next() % 3 {
            let at = (next() as usize) % (s.len() + 1);
            match next() % 3 {
                0 if !s.is_empty() => {
                    let at = at.min(s.len() - 1);
                    s[at] = char::from_u32((next() % 0x80) as u32).unwrap_or('x');
                }
                1 => {
                    let t = tokens[(next() as usize) % tokens.len()];
                    s.splice(at..at, t.chars());
                }
                _ => {
                    // Duplicate a listener block: same port, maybe same protocol.
                    let text: String = s.iter().collect();
                    if let Some(p) = text.find("  [[load_balancer.listener]]") {
                        let block: Vec<char> = text[p..].chars().take(100).collect();
                        s.extend(block);
                    }
                }
            }
        }
        let text: String = s.into_iter().collect();
        match std::panic::catch_unwind(|| harvester_lb::config::parse(&text)) {
            Ok(Ok(loaded)) => {
                ok += 1;
                let mut keys = HashSet::new();
                for lb in &loaded.config.load_balancers {
                    for l in &lb.listeners {
                        assert!(
                            keys.insert((lb.vip, l.port, l.protocol)),
                            "input {i}: two listeners on one VIP, port and protocol accepted:\n{text}"
                        );
                        if l.protocol == harvester_lb::config::Protocol::Udp {
                            assert!(
                                l.proxy_protocol.is_none(),
                                "input {i}: PROXY on UDP:\n{text}"
                            );
                        }
                    }
                }
            }
            Ok(Err(p)) => {
                assert!(!p.is_empty());
                rejected += 1;
            }
            Err(_) => panic!("config::parse panicked on input {i}:\n{text}"),
        }
    }
    println!("FIGURE udp config property test: {ok} valid, {rejected} rejected, 0 panics");
    assert!(ok > 0 && rejected > 0, "the mutations reach both outcomes");
}

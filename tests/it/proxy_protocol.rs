//! PROXY protocol to backends, judged by real consumers: nginx's
//! `listen … proxy_protocol` and HAProxy's `bind … accept-proxy` each answer
//! with the client address they took from the header, for clients on
//! different loopback sources and on `::1`, for v1 and v2.

use crate::support;

use std::net::{IpAddr, Ipv6Addr, SocketAddr};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use support::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// A peer process killed when the test ends, however it ends.
struct Peer {
    name: &'static str,
    child: Child,
    log: std::path::PathBuf,
}

impl Drop for Peer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Peer {
    fn spawn(name: &'static str, cmd: &mut Command, log: std::path::PathBuf) -> Peer {
        let out = std::fs::File::create(&log).expect("peer log");
        let child = cmd
            .stdout(out.try_clone().expect("log handle"))
            .stderr(out)
            .stdin(Stdio::null())
            .spawn()
            .unwrap_or_else(|e| panic!("cannot start {name}: {e}"));
        Peer { name, child, log }
    }

    /// Waits until every address accepts connections.
    async fn wait_listening(&mut self, addrs: &[SocketAddr]) {
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        for addr in addrs {
            while TcpStream::connect(addr).await.is_err() {
                if let Ok(Some(status)) = self.child.try_wait() {
                    panic!(
                        "{} exited ({status}): {}",
                        self.name,
                        std::fs::read_to_string(&self.log).unwrap_or_default()
                    );
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "{} not listening on {addr} after 10 s",
                    self.name
                );
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    }
}

/// `n` distinct free ports on `::1` (held together, then released: the
/// daemon and the peers bind them next), or `None` without IPv6.
fn free_ports_v6(n: usize) -> Option<Vec<u16>> {
    let held: Vec<std::net::TcpListener> = (0..n)
        .map(|_| std::net::TcpListener::bind((Ipv6Addr::LOCALHOST, 0)).ok())
        .collect::<Option<_>>()?;
    held.iter()
        .map(|l| l.local_addr().ok().map(|a| a.port()))
        .collect()
}

fn nginx(net: &Subnet, listen: &[SocketAddr]) -> Peer {
    let dir = net.dir().join("nginx");
    std::fs::create_dir_all(&dir).unwrap();
    let d = dir.display();
    let listens: String = listen
        .iter()
        .map(|a| format!("    listen {a} proxy_protocol;\n"))
        .collect();
    let conf = format!(
        "daemon off;\nmaster_process off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log;\nevents {{ worker_connections 64; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  server {{\n{listens}    location / {{ return 200 \"$proxy_protocol_addr:$proxy_protocol_port\\n\"; }}\n  }}\n}}\n"
    );
    let path = dir.join("nginx.conf");
    std::fs::write(&path, conf).unwrap();
    Peer::spawn(
        "nginx",
        Command::new("nginx")
            .arg("-e")
            .arg(dir.join("error.log"))
            .arg("-c")
            .arg(&path),
        dir.join("out.log"),
    )
}

fn haproxy(net: &Subnet, listen: &[SocketAddr]) -> Peer {
    let dir = net.dir().join("haproxy");
    std::fs::create_dir_all(&dir).unwrap();
    let binds: String = listen
        .iter()
        .map(|a| format!("  bind {a} accept-proxy\n"))
        .collect();
    let conf = format!(
        "global\n  log stdout format raw local0\ndefaults\n  mode http\n  log global\n  log-format \"%ci:%cp\"\n  timeout connect 2s\n  timeout client 5s\n  timeout server 5s\nfrontend fe\n{binds}  http-request return status 200 content-type text/plain lf-string \"%ci:%cp\\n\"\n"
    );
    let path = dir.join("haproxy.cfg");
    std::fs::write(&path, conf).unwrap();
    Peer::spawn(
        "haproxy",
        Command::new("haproxy").arg("-db").arg("-f").arg(&path),
        dir.join("out.log"),
    )
}

/// One HTTP/1.0 request from `from` through `vip`: the body's last line
/// (the address the consumer took from the header) and the client's own
/// address as the kernel gave it.
async fn ask(from: IpAddr, vip: SocketAddr) -> (String, SocketAddr) {
    let mut s = connect_from(from, vip)
        .await
        .unwrap_or_else(|e| panic!("connect {from} -> {vip}: {e}"));
    let me = s.local_addr().unwrap();
    s.write_all(b"GET / HTTP/1.0\r\nHost: pp\r\n\r\n")
        .await
        .unwrap();
    let mut text = String::new();
    tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut text))
        .await
        .unwrap_or_else(|_| panic!("no answer through {vip}"))
        .unwrap();
    let (code, body) = split_response(&text);
    assert_eq!(code, 200, "through {vip}: {text}");
    (body.trim().lines().last().unwrap_or("").to_string(), me)
}

/// Listener `name` that sends a PROXY header of `version`.
fn listener(name: &str, port: u16, backend_port: u16, version: &str) -> Listener {
    Listener::new(name, port, backend_port).keys(&format!("  proxy_protocol = \"{version}\""))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_and_haproxy_see_the_client_address_for_v1_and_v2() {
    if cannot_run(
        "proxy protocol consumers",
        ["nginx", "haproxy"].map(|binary| missing_tool(binary, binary)),
    ) {
        return;
    }
    let net = Subnet::new();
    let nginx_at = SocketAddr::new(net.ip(11), 30080);
    let haproxy_at = SocketAddr::new(net.ip(12), 30080);
    let v6 = |p: u16| SocketAddr::new(IpAddr::V6(Ipv6Addr::LOCALHOST), p);
    // VIP ports for nginx (v1) and HAProxy (v2) on ::1, and their own ports.
    let ipv6 = free_ports_v6(4);
    if ipv6.is_none() {
        skip_or_fail("proxy protocol over IPv6", "::1 is not available here");
    }
    let mut nginx_listen = vec![nginx_at];
    let mut haproxy_listen = vec![haproxy_at];
    if let Some(p) = &ipv6 {
        nginx_listen.push(v6(p[2]));
        haproxy_listen.push(v6(p[3]));
    }
    let mut ng = nginx(&net, &nginx_listen);
    let mut hp = haproxy(&net, &haproxy_listen);
    ng.wait_listening(&nginx_listen).await;
    hp.wait_listening(&haproxy_listen).await;

    let mut config = Config::new().admin(SocketAddr::new(net.ip(250), 9901));
    for (k, backend) in [(1u8, 11u8), (2, 12)] {
        config = config.lb(Lb::new(&format!("pp/{k}"), net.ip(k))
            .backends([net.ip(backend)])
            .listener(listener("v1", 8080, 30080, "v1"))
            .listener(listener("v2", 8081, 30080, "v2")));
    }
    if let Some(p) = &ipv6 {
        config = config.lb(Lb::new("pp/six", "::1")
            .backends(["::1"])
            .listener(listener("nginx-v1", p[0], p[2], "v1"))
            .listener(listener("haproxy-v2", p[1], p[3], "v2")));
    }
    let d = Daemon::start(&net, &config).await;

    for (consumer, lb) in [("nginx", 1u8), ("haproxy", 2)] {
        for (version, port) in [("v1", 8080), ("v2", 8081)] {
            for source in [101u8, 102] {
                let vip = SocketAddr::new(net.ip(lb), port);
                let (seen, me) = ask(net.ip(source), vip).await;
                assert_eq!(
                    seen,
                    me.to_string(),
                    "{consumer} behind a {version} listener saw {seen}, the client is {me}"
                );
            }
        }
    }
    if let Some(p) = &ipv6 {
        let local = IpAddr::V6(Ipv6Addr::LOCALHOST);
        for (consumer, port) in [("nginx (v1)", p[0]), ("haproxy (v2)", p[1])] {
            let (seen, me) = ask(local, v6(port)).await;
            // nginx writes `::1:port`, HAProxy `::1:port` too: no brackets.
            let want = format!("{}:{}", me.ip(), me.port());
            assert_eq!(
                seen, want,
                "{consumer} over IPv6 saw {seen}, the client is {me}"
            );
        }
    }
    d.stop().await;
}

/// A server that speaks first (SMTP, MySQL) gets the header at once: the
/// daemon does not wait for client bytes to send it with.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_header_goes_out_before_the_client_says_anything() {
    let net = Subnet::new();
    let node = TcpListener::bind(SocketAddr::new(net.ip(11), 30080))
        .await
        .unwrap();
    // The node reads the header line and sends it back as its greeting.
    let server = tokio::spawn(async move {
        let (mut s, _) = node.accept().await.unwrap();
        let mut got = Vec::new();
        let mut byte = [0u8; 1];
        while !got.ends_with(b"\r\n") && got.len() < 200 {
            if s.read(&mut byte).await.unwrap() == 0 {
                break;
            }
            got.push(byte[0]);
        }
        s.write_all(&got).await.unwrap();
        s.shutdown().await.unwrap();
    });
    let config = Config::new()
        .admin(SocketAddr::new(net.ip(250), 9901))
        .lb(Lb::new("pp/greeting", net.ip(1))
            .backends([net.ip(11)])
            .listener(listener("smtp", 2525, 30080, "v1")));
    let d = Daemon::start(&net, &config).await;
    let mut client = connect_from(net.ip(101), SocketAddr::new(net.ip(1), 2525))
        .await
        .unwrap();
    let me = client.local_addr().unwrap();
    let mut greeting = String::new();
    tokio::time::timeout(Duration::from_secs(5), client.read_to_string(&mut greeting))
        .await
        .expect("the header was held back waiting for the client")
        .unwrap();
    assert_eq!(
        greeting,
        format!(
            "PROXY TCP4 {} {} {} 2525\r\n",
            me.ip(),
            net.ip_str(1),
            me.port()
        )
    );
    server.await.unwrap();
    drop(client);
    assert_eq!(d.stop().await, 0, "connections cut at stop");
}

/// A node that sends back the first line it gets (the PROXY header, or the
/// client's own first line when there is none), then echoes.
async fn first_line_then_echo(addr: SocketAddr) -> tokio::task::JoinHandle<()> {
    let node = TcpListener::bind(addr).await.unwrap();
    tokio::spawn(async move {
        loop {
            let Ok((mut s, _)) = node.accept().await else {
                return;
            };
            tokio::spawn(async move {
                let mut line = Vec::new();
                let mut byte = [0u8; 1];
                while !line.ends_with(b"\r\n") && line.len() < 200 {
                    match s.read(&mut byte).await {
                        Ok(1) => line.push(byte[0]),
                        _ => return,
                    }
                }
                let (mut r, mut w) = s.split();
                if w.write_all(&line).await.is_ok() {
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                }
            });
        }
    })
}

/// Turning the header off on a kept listener is a reload like any other:
/// new connections go without it, the open one keeps going.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_reload_turns_the_header_off_for_new_connections_only() {
    let net = Subnet::new();
    let _node = first_line_then_echo(SocketAddr::new(net.ip(11), 30080)).await;
    let config = |pp: &str| {
        Config::new()
            .admin(SocketAddr::new(net.ip(250), 9901))
            .lb(Lb::new("pp/reload", net.ip(1))
                .backends([net.ip(11)])
                .listener(Listener::new("tcp", 8080, 30080).keys(pp)))
            .to_string()
    };
    let vip = SocketAddr::new(net.ip(1), 8080);
    let d = Daemon::start(&net, &config("  proxy_protocol = \"v1\"\n")).await;
    let status = d.status().await;
    assert_eq!(
        status["load_balancers"][0]["listeners"][0]["proxy_protocol"],
        "v1"
    );
    let mut open = connect_from(net.ip(101), vip).await.unwrap();
    let me = open.local_addr().unwrap();
    let first = read_crlf_line(&mut open).await;
    assert_eq!(
        first,
        format!(
            "PROXY TCP4 {} {} {} 8080\r\n",
            me.ip(),
            net.ip_str(1),
            me.port()
        )
    );

    std::fs::write(&d.config, config("")).unwrap();
    d.server().reload().await.unwrap();
    let mut fresh = connect_from(net.ip(102), vip).await.unwrap();
    fresh.write_all(b"hello\r\n").await.unwrap();
    assert_eq!(read_crlf_line(&mut fresh).await, "hello\r\n");
    // The connection opened before the reload still works.
    open.write_all(b"still here\r\n").await.unwrap();
    assert_eq!(read_crlf_line(&mut open).await, "still here\r\n");
    drop((open, fresh));
    assert_eq!(d.stop().await, 0, "connections cut at stop");
}

async fn read_crlf_line(s: &mut TcpStream) -> String {
    let mut line = Vec::new();
    let mut byte = [0u8; 1];
    while !line.ends_with(b"\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut byte))
            .await
            .expect("a line within 5 s")
            .unwrap();
        assert_eq!(n, 1, "closed after {:?}", String::from_utf8_lossy(&line));
        line.push(byte[0]);
    }
    String::from_utf8(line).unwrap()
}

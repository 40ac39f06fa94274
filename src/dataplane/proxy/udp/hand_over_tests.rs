//! Hand-over of UDP flows between two listeners of one process, on
//! loopback sockets: the flows the first hands over, the second adopts, and
//! each client keeps its backend.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use tokio::net::UdpSocket;

use super::{AdoptedFlows, FlowBudget, UdpListener};
use crate::config::UdpSettings;
use crate::dataplane::balancer::{Backend, LoadBalancer, Settings};
use crate::dataplane::proxy::Route;
use crate::metrics::stats::LbStats;

/// A backend at `ip`:`port` that answers each datagram with its own
/// address and the datagram, after 300 ms when the datagram starts with
/// `slow` (an answer still on its way during a hand-over).
async fn answerer(socket: UdpSocket) {
    let socket = Arc::new(socket);
    let me = socket.local_addr().unwrap();
    let mut buf = vec![0u8; 2048];
    while let Ok((n, from)) = socket.recv_from(&mut buf).await {
        let answer = format!("{}:{}", me.ip(), String::from_utf8_lossy(&buf[..n]));
        let socket = Arc::clone(&socket);
        let delay = if answer.contains(":slow") { 300 } else { 0 };
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(delay)).await;
            let _ = socket.send_to(answer.as_bytes(), from).await;
        });
    }
}

/// Two answering backends on 127.0.0.2 and 127.0.0.3, one port for both.
async fn two_backends() -> u16 {
    for _ in 0..20 {
        let first = UdpSocket::bind("127.0.0.2:0").await.unwrap();
        let port = first.local_addr().unwrap().port();
        if let Ok(second) = UdpSocket::bind(("127.0.0.3", port)).await {
            tokio::spawn(answerer(first));
            tokio::spawn(answerer(second));
            return port;
        }
    }
    panic!("no port free on both 127.0.0.2 and 127.0.0.3");
}

struct Bed {
    lb: Arc<LoadBalancer>,
    backends: Vec<Arc<Backend>>,
    port: u16,
    budget: Arc<FlowBudget>,
    /// The listener's socket, kept here as systemd's store keeps it.
    socket: std::net::UdpSocket,
}

impl Bed {
    async fn new() -> Self {
        let port = two_backends().await;
        let backends = vec![
            Backend::new([127, 0, 0, 2].into(), true),
            Backend::new([127, 0, 0, 3].into(), true),
        ];
        let lb = LoadBalancer::new(
            "ns/dns".into(),
            "c".into(),
            Settings::for_tests(),
            backends.clone(),
            LbStats::detached(),
        );
        let socket = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        socket.set_nonblocking(true).unwrap();
        Self {
            lb,
            backends,
            port,
            budget: FlowBudget::new(1000),
            socket,
        }
    }

    fn vip(&self) -> SocketAddr {
        self.socket.local_addr().unwrap()
    }

    /// A listener on (a descriptor of) the bed's socket, adopting `flows`.
    fn listener(&self, flows: Vec<super::HandedFlow>) -> (UdpListener, AdoptedFlows) {
        let route = Route {
            lb: Arc::clone(&self.lb),
            listener: "u".into(),
            backend_port: self.port,
            stats: self.lb.stats().udp_listener("u"),
            proxy_protocol: None,
        };
        let settings = UdpSettings {
            idle_timeout: Duration::from_secs(60),
            responses: None,
        };
        let socket = UdpSocket::from_std(self.socket.try_clone().unwrap()).unwrap();
        UdpListener::adopt(
            socket,
            route,
            settings,
            Arc::clone(&self.budget),
            100,
            flows,
        )
    }
}

/// Sends `query` to the VIP and returns the answer.
async fn ask(client: &UdpSocket, vip: SocketAddr, query: &str) -> String {
    client.send_to(query.as_bytes(), vip).await.unwrap();
    answer(client).await
}

async fn answer(client: &UdpSocket) -> String {
    let mut buf = vec![0u8; 2048];
    let (n, _) = tokio::time::timeout(Duration::from_secs(10), client.recv_from(&mut buf))
        .await
        .expect("no answer")
        .unwrap();
    String::from_utf8_lossy(&buf[..n]).into_owned()
}

/// A client's flow is handed over three times, each time with an answer
/// still on its way from the backend: that answer reaches the client, and
/// every datagram after goes to the same backend. Without the adoption
/// the client's next datagram is a new flow, and round robin gives it the
/// other backend (checked last).
#[tokio::test]
async fn a_udp_flow_keeps_its_backend_across_hand_overs() {
    let bed = Bed::new().await;
    let vip = bed.vip();
    let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let (mut listener, _) = bed.listener(Vec::new());
    let first = ask(&client, vip, "q").await;
    let (backend_ip, _) = first.split_once(':').unwrap();
    let backend_ip = backend_ip.to_owned();
    let backend = bed
        .backends
        .iter()
        .find(|b| b.addr.to_string() == backend_ip)
        .unwrap();
    assert_eq!(backend.active_connections(), 1);

    for round in 0..3 {
        let slow = format!("slow{round}");
        client.send_to(slow.as_bytes(), vip).await.unwrap();
        // Forwarded by this listener, or left in the shared socket for
        // the next one: either way on the flow.
        let flows = listener.hand_over().await;
        assert_eq!(flows.len(), 1, "round {round}");
        assert_eq!(flows[0].client, client.local_addr().unwrap());
        let (next, adopted) = bed.listener(flows);
        assert_eq!(
            adopted,
            AdoptedFlows {
                adopted: 1,
                dropped: 0
            }
        );
        listener = next;
        assert_eq!(listener.flows(), 1);
        assert_eq!(backend.active_connections(), 1);
        assert_eq!(answer(&client).await, format!("{backend_ip}:{slow}"));
        let again = format!("q{round}");
        assert_eq!(
            ask(&client, vip, &again).await,
            format!("{backend_ip}:{again}")
        );
    }

    // The control: handed over but not adopted, the flow is picked anew.
    let flows = listener.hand_over().await;
    assert_eq!(flows.len(), 1);
    drop(flows);
    assert_eq!(backend.active_connections(), 0);
    let (_listener, _) = bed.listener(Vec::new());
    let other = ask(&client, vip, "new").await;
    assert!(
        !other.starts_with(&format!("{backend_ip}:")),
        "a new flow went to the same backend ({other}); the test proves nothing"
    );
}

/// A flow whose backend left the config is not adopted: the client's next
/// datagram makes a new flow to a backend that is there.
#[tokio::test]
async fn a_flow_to_a_backend_gone_from_the_config_is_dropped_and_picked_anew() {
    let bed = Bed::new().await;
    let vip = bed.vip();
    let client = UdpSocket::bind("127.0.0.1:0").await.unwrap();
    let (listener, _) = bed.listener(Vec::new());
    let first = ask(&client, vip, "q").await;
    let (gone, _) = first.split_once(':').unwrap();
    let flows = listener.hand_over().await;
    let stay: Vec<_> = bed
        .backends
        .iter()
        .filter(|b| b.addr.to_string() != gone)
        .cloned()
        .collect();
    bed.lb.replace(Settings::for_tests(), stay);
    let (_listener, adopted) = bed.listener(flows);
    assert_eq!(
        adopted,
        AdoptedFlows {
            adopted: 0,
            dropped: 1
        }
    );
    let next = ask(&client, vip, "q2").await;
    assert!(!next.starts_with(&format!("{gone}:")), "{next}");
}

//! The driver and state machine on tokio's paused clock, against a
//! scripted server: every timer is exact and the tests take no time.

use std::sync::Mutex;

use dhcproto::v4::{DhcpOption, MessageType, OptionCode};

use super::*;
use crate::host::dhcp::client::Phase;
use crate::host::dhcp::wire::{self, ReplyKind, decode_request, server_reply};

const MAC: [u8; 6] = [2, 0, 0, 0, 0, 1];
const SERVER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 2);
const A: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 150);
const B: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 171);
/// The host's own address and its gateway, as its `host_view` says.
const HOST: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 3);
const GATEWAY: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 1);

/// What the fake network saw, and what it will deliver.
struct Log {
    /// (when, broadcast?, message type, xid, requested/ciaddr).
    sent: Vec<(Instant, bool, MessageType, u32, Ipv4Addr)>,
    address: Option<Ipv4Addr>,
    /// What `host_view` answers (`None`: an error).
    host: Option<HostView>,
    host_reads: usize,
    /// What `repair` answers, and how often it was asked.
    repair: Result<Vec<String>, String>,
    checks: usize,
}

impl Default for Log {
    fn default() -> Self {
        Log {
            sent: Vec::new(),
            address: None,
            host: None,
            host_reads: 0,
            repair: Ok(Vec::new()),
            checks: 0,
        }
    }
}

struct FakeNet {
    log: Arc<Mutex<Log>>,
    inbox: tokio::sync::mpsc::UnboundedReceiver<Vec<u8>>,
}

impl FakeNet {
    fn record(&self, p: &[u8], broadcast: bool) {
        let m = decode_request(p);
        let asked = match m.opts().get(OptionCode::RequestedIpAddress) {
            Some(DhcpOption::RequestedIpAddress(a)) => *a,
            _ => m.ciaddr(),
        };
        let ty = m.opts().msg_type().expect("message type");
        self.log
            .lock()
            .unwrap()
            .sent
            .push((Instant::now(), broadcast, ty, m.xid(), asked));
    }
}

impl Net for FakeNet {
    type Error = String;
    async fn broadcast(&mut self, p: &[u8]) -> std::io::Result<()> {
        self.record(p, true);
        Ok(())
    }
    async fn unicast(&mut self, p: &[u8], _: Ipv4Addr) -> std::io::Result<()> {
        self.record(p, false);
        Ok(())
    }
    async fn recv(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self.inbox.recv().await {
            Some(p) => {
                buf[..p.len()].copy_from_slice(&p);
                Ok(p.len())
            }
            None => std::future::pending().await,
        }
    }
    async fn set_address(&mut self, a: Option<(Ipv4Addr, u8)>) -> Result<(), String> {
        self.log.lock().unwrap().address = a.map(|(a, _)| a);
        Ok(())
    }
    async fn host_view(&mut self) -> Result<HostView, String> {
        let mut log = self.log.lock().unwrap();
        log.host_reads += 1;
        log.host
            .clone()
            .ok_or_else(|| "netlink says no".to_string())
    }
    async fn repair(&mut self) -> Result<Vec<String>, String> {
        let mut log = self.log.lock().unwrap();
        log.checks += 1;
        log.repair.clone()
    }
}

struct Harness {
    log: Arc<Mutex<Log>>,
    to_client: tokio::sync::mpsc::UnboundedSender<Vec<u8>>,
    stats: Arc<LeaseStats>,
    stop: CancellationToken,
    task: tokio::task::JoinHandle<Client>,
}

impl Harness {
    fn start(last: Option<Ipv4Addr>, servers: Vec<Ipv4Addr>) -> Harness {
        Self::start_with(last, servers, DhcpGuard::default())
    }

    fn start_with(last: Option<Ipv4Addr>, servers: Vec<Ipv4Addr>, guard: DhcpGuard) -> Harness {
        let log = Arc::new(Mutex::new(Log {
            host: Some(HostView {
                local: vec![HOST.into()],
                gateways: vec![GATEWAY],
            }),
            ..Log::default()
        }));
        let (to_client, inbox) = tokio::sync::mpsc::unbounded_channel();
        let stats = Arc::new(LeaseStats::default());
        let dir = std::env::temp_dir().join(format!("hlb-run-{}", std::process::id()));
        let ctx = Ctx {
            name: "default/web".into(),
            cluster: "kubernetes".into(),
            spec: DhcpSpec {
                interface: "eth0".into(),
                mac: MAC,
                hostname: "web".into(),
                servers: servers.clone(),
                requested: None,
                allowed_ranges: None,
                min_prefix_length: None,
            },
            state_file: state::path(&dir, MAC),
            stats: Arc::clone(&stats),
            host_repairs: Arc::default(),
            changed: Arc::new(Notify::new()),
            guard: Arc::new(ArcSwap::from_pointee(guard)),
        };
        let client = Client::new(
            Identity {
                mac: MAC,
                hostname: "web".into(),
            },
            servers,
            last,
            None,
            42,
            Instant::now(),
        );
        let stop = CancellationToken::new();
        let mut net = FakeNet {
            log: Arc::clone(&log),
            inbox,
        };
        let s2 = stop.clone();
        let task = tokio::spawn(async move { drive(client, &mut net, &ctx, &s2).await });
        Harness {
            log,
            to_client,
            stats,
            stop,
            task,
        }
    }

    fn sent(&self) -> Vec<(Instant, bool, MessageType, u32, Ipv4Addr)> {
        self.log.lock().unwrap().sent.clone()
    }

    fn last(&self) -> (Instant, bool, MessageType, u32, Ipv4Addr) {
        *self.sent().last().expect("something sent")
    }

    fn reply(&self, kind: ReplyKind, xid: u32, address: Ipv4Addr, from: Ipv4Addr) {
        let lease = (kind != ReplyKind::Nak).then_some(120);
        self.to_client
            .send(server_reply(kind, xid, MAC, address, from, lease))
            .unwrap();
    }

    fn address(&self) -> Option<Ipv4Addr> {
        self.log.lock().unwrap().address
    }

    fn phase(&self) -> &'static str {
        self.stats.phase_name()
    }
}

/// Lets the driver run everything that is due now.
async fn settle() {
    for _ in 0..20 {
        tokio::task::yield_now().await;
    }
}

async fn bind(h: &Harness, address: Ipv4Addr) {
    settle().await;
    let (_, _, ty, xid, _) = h.last();
    assert_eq!(ty, MessageType::Discover);
    h.reply(ReplyKind::Offer, xid, address, SERVER);
    settle().await;
    let (_, bcast, ty, xid2, asked) = h.last();
    assert_eq!(
        (bcast, ty, xid2, asked),
        (true, MessageType::Request, xid, address)
    );
    h.reply(ReplyKind::Ack, xid, address, SERVER);
    settle().await;
    assert_eq!(h.phase(), "bound");
    assert_eq!(h.address(), Some(address));
}

#[tokio::test(start_paused = true)]
async fn discover_offer_request_ack_then_renew_at_t1_and_rebind_at_t2() {
    let h = Harness::start(None, vec![]);
    let t0 = Instant::now();
    bind(&h, A).await;
    assert_eq!(h.stats.acquired.get(), 1);
    // Nothing until T1 = 60 s (half of 120).
    let before = h.sent().len();
    tokio::time::sleep(Duration::from_secs(59)).await;
    settle().await;
    assert_eq!(h.sent().len(), before);
    tokio::time::sleep(Duration::from_secs(2)).await;
    settle().await;
    let (at, bcast, ty, _, ciaddr) = h.last();
    assert_eq!(
        (bcast, ty, ciaddr),
        (false, MessageType::Request, A),
        "RENEW is unicast"
    );
    assert_eq!(at - t0, Duration::from_secs(60));
    assert_eq!(h.phase(), "renewing");
    // No answer: retransmitted, then at T2 = 105 s broadcast (REBIND).
    tokio::time::sleep(Duration::from_secs(46)).await;
    settle().await;
    let rebinds: Vec<_> = h
        .sent()
        .into_iter()
        .filter(|s| s.1 && s.4 == A && s.0 - t0 > Duration::from_secs(60))
        .collect();
    assert!(!rebinds.is_empty(), "{:?}", h.sent());
    assert_eq!(rebinds[0].0 - t0, Duration::from_secs(105));
    assert_eq!(h.phase(), "rebinding");
    // Any server's ACK extends it; same address, no VIP change.
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Ack, xid, A, SERVER);
    settle().await;
    assert_eq!(h.phase(), "bound");
    assert_eq!(h.stats.renewals.get(), 1);
    assert_eq!(h.stats.address_changes.get(), 0);
    h.stop.cancel();
    let mut client = h.task.await.unwrap();
    assert!(matches!(client.release(), Some(Output::Unicast(_, s)) if s == SERVER));
}

#[tokio::test(start_paused = true)]
async fn a_nak_on_renewal_starts_over_and_the_vip_changes() {
    let h = Harness::start(None, vec![]);
    bind(&h, A).await;
    tokio::time::sleep(Duration::from_secs(61)).await;
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Nak, xid, Ipv4Addr::UNSPECIFIED, SERVER);
    settle().await;
    assert_eq!(h.address(), None, "the VIP comes off at once");
    assert_eq!(h.stats.naks.get(), 1);
    assert_eq!(h.stats.address_changes.get(), 1);
    // After the pause, DISCOVER with a new transaction; a new lease.
    tokio::time::sleep(NAK_PAUSE_FOR_TESTS).await;
    bind(&h, B).await;
    assert_eq!(h.stats.address(), Some(B));
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_nobody_renews_expires() {
    let h = Harness::start(None, vec![]);
    bind(&h, A).await;
    tokio::time::sleep(Duration::from_secs(121)).await;
    settle().await;
    assert_eq!(h.address(), None);
    assert_eq!(h.phase(), "selecting");
    let (_, bcast, ty, _, asked) = h.last();
    assert_eq!(
        (bcast, ty, asked),
        (true, MessageType::Discover, A),
        "asks for the old address"
    );
}

#[tokio::test(start_paused = true)]
async fn init_reboot_asks_for_the_last_address_then_falls_back_to_discover() {
    let h = Harness::start(Some(A), vec![]);
    settle().await;
    let (_, bcast, ty, _, asked) = h.last();
    assert_eq!((bcast, ty, asked), (true, MessageType::Request, A));
    assert_eq!(h.phase(), "rebooting");
    // No answer to three tries (2 + 4 + 8 s): DISCOVER for the same address.
    tokio::time::sleep(Duration::from_secs(15)).await;
    settle().await;
    let reqs = h
        .sent()
        .iter()
        .filter(|s| s.2 == MessageType::Request)
        .count();
    assert_eq!(reqs, 3);
    let (_, _, ty, _, asked) = h.last();
    assert_eq!((ty, asked), (MessageType::Discover, A));

    // And when answered, the ACK binds at once.
    let h = Harness::start(Some(A), vec![]);
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Ack, xid, A, SERVER);
    settle().await;
    assert_eq!(h.phase(), "bound");
    assert_eq!(h.address(), Some(A));
}

#[tokio::test(start_paused = true)]
async fn foreign_malformed_and_rogue_packets_are_counted_never_obeyed() {
    let rogue = Ipv4Addr::new(198, 51, 100, 66);
    let h = Harness::start(None, vec![SERVER]);
    settle().await;
    let (_, _, _, xid, _) = h.last();
    // Another transaction, another client, junk, a server not allowed,
    // an offer of an unusable address.
    h.reply(ReplyKind::Offer, xid ^ 1, A, SERVER);
    h.to_client
        .send(server_reply(
            ReplyKind::Offer,
            xid,
            [2, 9, 9, 9, 9, 9],
            A,
            SERVER,
            Some(120),
        ))
        .unwrap();
    h.to_client.send(vec![1, 2, 3]).unwrap();
    h.reply(ReplyKind::Offer, xid, A, rogue);
    // An ACK while selecting: the right transaction, nothing to act on.
    h.reply(ReplyKind::Ack, xid, A, SERVER);
    settle().await;
    assert_eq!(h.phase(), "selecting");
    assert_eq!(h.address(), None);
    let ignored: Vec<u64> = h.stats.ignored.iter().map(|c| c.get()).collect();
    // malformed, xid, chaddr, rogue, unexpected, quarantined
    assert_eq!(ignored, vec![1, 1, 1, 1, 1, 0]);
    assert_eq!(h.log.lock().unwrap().host_reads, 0, "nothing to judge");
    // Bound, a NAK from a rogue server is ignored too.
    bind(&h, A).await;
    tokio::time::sleep(Duration::from_secs(61)).await;
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Nak, xid, Ipv4Addr::UNSPECIFIED, rogue);
    settle().await;
    assert_eq!(h.address(), Some(A));
    assert_eq!(h.stats.naks.get(), 0);
}

#[tokio::test(start_paused = true)]
async fn discover_backs_off_exponentially_up_to_the_cap() {
    let h = Harness::start(None, vec![]);
    tokio::time::sleep(Duration::from_secs(200)).await;
    settle().await;
    let times: Vec<Instant> = h.sent().iter().map(|s| s.0).collect();
    let gaps: Vec<u64> = times.windows(2).map(|w| (w[1] - w[0]).as_secs()).collect();
    assert_eq!(&gaps[..6], &[2, 4, 8, 16, 32, 32], "{gaps:?}");
    // One transaction for the whole DISCOVER phase.
    let xids: std::collections::HashSet<u32> = h.sent().iter().map(|s| s.3).collect();
    assert_eq!(xids.len(), 1);
    let _ = wire::MAX_LEASE;
}

/// `reply` with its subnet mask option replaced by `mask`.
fn with_mask(reply: Vec<u8>, mask: Ipv4Addr) -> Vec<u8> {
    use dhcproto::v4::{Decodable, Decoder, Encodable, Encoder, Message};
    let mut m = Message::decode(&mut Decoder::new(&reply)).unwrap();
    m.opts_mut().insert(DhcpOption::SubnetMask(mask));
    let mut buf = Vec::new();
    m.encode(&mut Encoder::new(&mut buf)).unwrap();
    buf
}

fn refused(h: &Harness) -> Vec<u64> {
    h.stats.refused.iter().map(|c| c.get()).collect()
}

const OTHER: Ipv4Addr = Ipv4Addr::new(198, 51, 100, 4);

#[tokio::test(start_paused = true)]
async fn an_offer_of_the_hosts_address_is_refused_and_its_server_held_off() {
    let h = Harness::start(None, vec![]);
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Offer, xid, HOST, SERVER);
    settle().await;
    assert_eq!(h.phase(), "selecting", "still selecting: others are heard");
    assert_eq!(h.address(), None);
    // reserved, mask_too_wide, outside_allowed_ranges, host_address, gateway, host_unreadable
    assert_eq!(refused(&h), vec![0, 0, 0, 1, 0, 0]);
    let last = h.stats.last_refusal().expect("kept for /status");
    assert_eq!(
        (last.server, last.address, last.reason),
        (SERVER, HOST, "host_address")
    );
    // The same server's next (good) offer is not listened to...
    h.reply(ReplyKind::Offer, xid, A, SERVER);
    settle().await;
    assert_eq!(h.phase(), "selecting");
    assert_eq!(h.stats.ignored[5].get(), 1, "quarantined");
    // ...another server's is.
    h.reply(ReplyKind::Offer, xid, B, OTHER);
    settle().await;
    assert_eq!(h.phase(), "requesting");
    h.reply(ReplyKind::Ack, xid, B, OTHER);
    settle().await;
    assert_eq!(h.address(), Some(B));
}

#[tokio::test(start_paused = true)]
async fn a_held_off_server_is_heard_again_after_the_quarantine() {
    let h = Harness::start(None, vec![SERVER]);
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Offer, xid, GATEWAY, SERVER);
    settle().await;
    assert_eq!(refused(&h), vec![0, 0, 0, 0, 1, 0]);
    tokio::time::sleep(crate::host::dhcp::client::QUARANTINE + Duration::from_secs(1)).await;
    settle().await;
    let (_, _, ty, xid, _) = h.last();
    assert_eq!(ty, MessageType::Discover, "DISCOVERs went on meanwhile");
    h.reply(ReplyKind::Offer, xid, A, SERVER);
    settle().await;
    assert_eq!(h.phase(), "requesting");
}

#[tokio::test(start_paused = true)]
async fn wide_masks_and_addresses_outside_the_ranges_are_refused() {
    let guard = DhcpGuard {
        allowed_ranges: vec!["198.51.100.128/26".parse().unwrap()],
        min_prefix_length: 16,
    };
    let h = Harness::start_with(None, vec![], guard);
    settle().await;
    let (_, _, _, xid, _) = h.last();
    let half_the_internet = with_mask(
        server_reply(ReplyKind::Offer, xid, MAC, A, SERVER, Some(120)),
        Ipv4Addr::new(128, 0, 0, 0),
    );
    h.to_client.send(half_the_internet).unwrap();
    h.reply(
        ReplyKind::Offer,
        xid,
        Ipv4Addr::new(198, 51, 100, 50),
        OTHER,
    );
    settle().await;
    assert_eq!(refused(&h), vec![0, 1, 1, 0, 0, 0]);
    assert_eq!(h.phase(), "selecting");
    assert_eq!(h.address(), None);
    // One reading of the host served both judgements.
    assert!(h.log.lock().unwrap().host_reads <= 1);
}

#[tokio::test(start_paused = true)]
async fn an_offer_is_not_taken_blind_and_the_server_is_not_blamed() {
    let h = Harness::start(None, vec![]);
    h.log.lock().unwrap().host = None;
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Offer, xid, A, SERVER);
    settle().await;
    assert_eq!(refused(&h), vec![0, 0, 0, 0, 0, 1]);
    assert_eq!(h.phase(), "selecting");
    // The host readable again: the same server's next offer is taken.
    h.log.lock().unwrap().host = Some(HostView::default());
    tokio::time::sleep(HOST_VIEW_MAX_AGE).await;
    h.reply(ReplyKind::Offer, xid, A, SERVER);
    settle().await;
    assert_eq!(h.phase(), "requesting");
}

#[tokio::test(start_paused = true)]
async fn a_renewal_that_moves_the_lease_to_the_gateway_loses_it() {
    let h = Harness::start(None, vec![]);
    bind(&h, A).await;
    tokio::time::sleep(Duration::from_secs(61)).await;
    settle().await;
    let (_, _, _, xid, _) = h.last();
    h.reply(ReplyKind::Ack, xid, GATEWAY, SERVER);
    settle().await;
    assert_eq!(h.address(), None, "nothing of that server's is kept");
    assert_eq!(h.phase(), "selecting");
    assert_eq!(refused(&h), vec![0, 0, 0, 0, 1, 0]);
    let (_, _, ty, _, asked) = h.last();
    assert_eq!(ty, MessageType::Discover);
    assert_eq!(asked, A, "asks for the old address, from other servers");
}

#[tokio::test(start_paused = true)]
async fn a_held_lease_is_read_back_every_check_interval_and_repairs_are_counted() {
    use crate::host::owned::CHECK_INTERVAL;
    let h = Harness::start(None, vec![]);
    settle().await;
    tokio::time::sleep(CHECK_INTERVAL + Duration::from_secs(1)).await;
    settle().await;
    assert_eq!(
        h.log.lock().unwrap().checks,
        0,
        "nothing to check without a lease"
    );
    bind(&h, A).await;
    tokio::time::sleep(CHECK_INTERVAL).await;
    settle().await;
    assert!(h.log.lock().unwrap().checks >= 1);
    assert_eq!(h.stats.repairs.get(), 0, "nothing differed");
    // Another program deleted the address: put back, counted once.
    h.log.lock().unwrap().repair = Ok(vec!["address missing".into()]);
    tokio::time::sleep(CHECK_INTERVAL).await;
    settle().await;
    assert_eq!(h.stats.repairs.get(), 1);
    // The repair fails: kept for /status until a check succeeds.
    h.log.lock().unwrap().repair = Err("netlink says no".into());
    tokio::time::sleep(CHECK_INTERVAL).await;
    settle().await;
    assert_eq!(h.stats.host_error().as_deref(), Some("netlink says no"));
    h.log.lock().unwrap().repair = Ok(vec![]);
    tokio::time::sleep(CHECK_INTERVAL).await;
    settle().await;
    assert_eq!(h.stats.host_error(), None);
    assert_eq!(h.stats.repairs.get(), 1);
}

const NAK_PAUSE_FOR_TESTS: Duration = crate::host::dhcp::client::NAK_PAUSE;

#[test]
fn renew_waits_follow_rfc_2131_for_long_leases_and_scale_for_short() {
    use crate::host::dhcp::client::renew_wait;
    let day = Duration::from_secs(86_400);
    assert_eq!(
        renew_wait(Duration::from_secs(3600), day),
        Duration::from_secs(1800)
    );
    assert_eq!(
        renew_wait(Duration::from_secs(100), day),
        Duration::from_secs(60)
    );
    assert_eq!(
        renew_wait(Duration::from_secs(30), day),
        Duration::from_secs(30)
    );
    let short = Duration::from_secs(120);
    assert_eq!(
        renew_wait(Duration::from_secs(20), short),
        Duration::from_secs(15)
    );
    let _ = Phase::Init;
}

//! The DHCPv4 client state machine (RFC 2131 §4.4), without I/O.
//!
//! [`Client`] is fed packets ([`Client::on_packet`]) and the passing of
//! time ([`Client::on_timeout`] once [`Client::deadline`] is reached) and
//! answers with [`Output`]s: packets to send and changes of the lease. The
//! driver ([`super::run`]) does the sending and the address changes; tests
//! drive this type on tokio's paused clock.
//!
//! What it must never do: change the lease because of a packet that is
//! not the answer to its own transaction from an acceptable server. Such
//! packets are returned as [`Ignored`] and counted by the driver. Nor take
//! an offer or an ACK that [`guard::judge`] refuses: the refusal is an
//! [`Output::Refused`] (logged and counted by the driver), and the server
//! that made it is not listened to for [`QUARANTINE`] (other servers are).

use std::net::Ipv4Addr;
use std::time::Duration;

use tokio::time::Instant;

use super::guard::{self, HostView, Refusal};
use super::wire::{self, Identity, NotReply, Reply, ReplyKind, Request};
use crate::config::DhcpGuard;

/// First retransmission delay of DISCOVER and REQUEST in SELECTING/REBOOTING;
/// doubled each time up to [`MAX_RETRANSMIT`] (RFC 2131 §4.1 starts at 4 s;
/// a VIP without an address serves nobody, so this starts sooner).
pub const FIRST_RETRANSMIT: Duration = Duration::from_secs(2);
/// Longest wait between two DISCOVERs (RFC 2131: 64 s).
pub const MAX_RETRANSMIT: Duration = Duration::from_secs(32);
/// REQUESTs sent for one offer before starting over with DISCOVER.
pub const REQUEST_TRIES: u32 = 4;
/// INIT-REBOOT REQUESTs sent before falling back to DISCOVER (asking for
/// the same address).
pub const REBOOT_TRIES: u32 = 3;
/// Pause after a NAK before the next DISCOVER, so a server that NAKs
/// everything is not answered with a tight loop.
pub const NAK_PAUSE: Duration = Duration::from_secs(1);
/// RFC 2131 §4.4.5: in RENEWING and REBINDING, wait half the time left,
/// but no less than this (scaled down for short leases, see [`renew_wait`]).
pub const MIN_RENEW_RETRANSMIT: Duration = Duration::from_secs(60);
/// How long a server whose offer or ACK was refused is not listened to:
/// long enough that a rogue server answering every DISCOVER first cannot
/// keep the client from hearing the others (the DISCOVERs go on meanwhile),
/// short enough that a server fixed by its operator is heard again soon.
pub const QUARANTINE: Duration = Duration::from_secs(60);
/// Servers held in quarantine at once: a forger inventing a new server
/// identifier per packet costs a bounded list (the soonest released goes).
pub const MAX_QUARANTINED: usize = 32;

/// RFC 2131's client states (INIT-REBOOT and REBOOTING are one here).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// About to DISCOVER.
    Init,
    /// DISCOVER sent, waiting for offers.
    Selecting,
    /// REQUEST for an offer sent.
    Requesting,
    /// REQUEST for the address held before a restart sent.
    Rebooting,
    /// Leased; nothing to do until T1.
    Bound,
    /// Past T1: REQUEST unicast to the leasing server.
    Renewing,
    /// Past T2: REQUEST broadcast to any server.
    Rebinding,
}

impl Phase {
    /// Index into [`crate::metrics::stats::LEASE_PHASES`].
    pub fn index(self) -> u8 {
        self as u8
    }
}

/// A lease in force.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Lease {
    /// The VIP.
    pub address: Ipv4Addr,
    /// Prefix length of its network (option 1; 32 when the server sent none).
    pub prefix: u8,
    /// The server that granted it (option 54).
    pub server: Ipv4Addr,
    /// When the ACK arrived.
    pub since: Instant,
    /// Lease time (option 51).
    pub duration: Duration,
    /// Renewal time T1 (option 58, default half the lease).
    pub t1: Duration,
    /// Rebinding time T2 (option 59, default 7/8 of the lease).
    pub t2: Duration,
}

impl Lease {
    /// When it expires unless extended.
    pub fn expires(&self) -> Instant {
        self.since + self.duration
    }
}

/// What the driver must do.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Output {
    /// Send `packet` to the broadcast address (port 67) on the interface.
    Broadcast(Vec<u8>),
    /// Send `packet` to the server (port 67), from the leased address.
    Unicast(Vec<u8>, Ipv4Addr),
    /// A lease is in force now: a new one (`previous` is `None` or another
    /// address) or the same address extended (`renewed`).
    Leased {
        /// The lease.
        lease: Lease,
        /// Whether it extends the lease of the same address.
        renewed: bool,
    },
    /// The lease is gone: the address must come off the interface.
    Lost {
        /// The address that was the VIP.
        address: Ipv4Addr,
        /// Why, for the log.
        reason: String,
    },
    /// A server said NAK (counted; a lease held is lost by a [`Output::Lost`]
    /// after this).
    Nak {
        /// The server and its message, for the log.
        reason: String,
    },
    /// An offer or ACK was refused by [`guard::judge`] (logged once and
    /// counted; a lease it would have changed is lost by an [`Output::Lost`]
    /// before this).
    Refused {
        /// The server that made it (quarantined, unless the refusal is
        /// [`Refusal::HostUnreadable`]).
        server: Ipv4Addr,
        /// The address offered or acknowledged.
        address: Ipv4Addr,
        /// Its prefix length (option 1), if sent.
        prefix: Option<u8>,
        /// Why.
        reason: Refusal,
    },
}

/// What offers and ACKs are judged against: the operator's guard and the
/// host as read just before (`None`: it could not be read).
#[derive(Debug, Clone, Copy)]
pub struct Judge<'a> {
    /// `dhcp.allowed_ranges` and `dhcp.min_prefix_length`.
    pub guard: &'a DhcpGuard,
    /// The host's addresses and gateways.
    pub host: Option<&'a HostView>,
}

/// Why a packet was ignored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Ignored {
    /// Not a DHCP message.
    Malformed,
    /// Another transaction's.
    Xid,
    /// Another client's.
    Chaddr,
    /// From a server not allowed, or offering what cannot be a VIP.
    Rogue,
    /// Right transaction, but nothing this phase acts on.
    Unexpected,
    /// From a server whose offer or ACK was refused less than
    /// [`QUARANTINE`] ago.
    Quarantined,
}

impl Ignored {
    /// Index into [`crate::metrics::stats::IGNORED_REASONS`].
    pub fn index(self) -> usize {
        self as usize
    }
}

/// The state machine.
#[derive(Debug)]
pub struct Client {
    id: Identity,
    /// Servers whose answers are taken; empty: all.
    servers: Vec<Ipv4Addr>,
    phase: Phase,
    xid: u32,
    /// State of the xorshift generator of transaction ids.
    rng: u64,
    /// When the next timeout fires.
    deadline: Instant,
    /// Packets sent in the current phase.
    tries: u32,
    /// The lease in force (Bound, Renewing, Rebinding).
    lease: Option<Lease>,
    /// The offer being requested.
    offer: Option<(Ipv4Addr, Ipv4Addr)>,
    /// The address to ask for: the last one held, or the configured hint.
    wanted: Option<Ipv4Addr>,
    /// Servers not listened to, until when (at most [`MAX_QUARANTINED`]).
    quarantine: Vec<(Ipv4Addr, Instant)>,
}

impl Client {
    /// A client that starts now: INIT-REBOOT when an address was held
    /// before (`last`), else DISCOVER asking for `hint` if any. `seed`
    /// varies transaction ids between clients and runs.
    pub fn new(
        id: Identity,
        servers: Vec<Ipv4Addr>,
        last: Option<Ipv4Addr>,
        hint: Option<Ipv4Addr>,
        seed: u64,
        now: Instant,
    ) -> Self {
        let mut c = Self {
            id,
            servers,
            phase: if last.is_some() {
                Phase::Rebooting
            } else {
                Phase::Init
            },
            xid: 0,
            rng: seed | 1,
            deadline: now,
            tries: 0,
            lease: None,
            offer: None,
            wanted: last.or(hint),
            quarantine: Vec::new(),
        };
        c.new_xid();
        c
    }

    /// The current phase.
    pub fn phase(&self) -> Phase {
        self.phase
    }

    /// The lease in force.
    pub fn lease(&self) -> Option<&Lease> {
        self.lease.as_ref()
    }

    /// The current transaction id.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// When [`Client::on_timeout`] must be called next.
    pub fn deadline(&self) -> Instant {
        self.deadline
    }

    fn new_xid(&mut self) {
        self.rng ^= self.rng << 13;
        self.rng ^= self.rng >> 7;
        self.rng ^= self.rng << 17;
        self.xid = self.rng as u32;
    }

    fn backoff(&self) -> Duration {
        let n = self.tries.saturating_sub(1).min(8);
        (FIRST_RETRANSMIT * 2u32.pow(n)).min(MAX_RETRANSMIT)
    }

    fn send(&self, kind: Request) -> Vec<u8> {
        wire::build(&self.id, self.xid, kind)
    }

    /// Time has reached [`Client::deadline`].
    pub fn on_timeout(&mut self, now: Instant) -> Vec<Output> {
        if now < self.deadline {
            return Vec::new();
        }
        let mut out = Vec::new();
        match self.phase {
            Phase::Init => {
                self.phase = Phase::Selecting;
                self.tries = 0;
                self.new_xid();
                self.discover(now, &mut out);
            }
            Phase::Selecting => self.discover(now, &mut out),
            Phase::Requesting => {
                if self.tries >= REQUEST_TRIES {
                    self.restart(now, &mut out);
                } else if let Some((address, server)) = self.offer {
                    self.tries += 1;
                    out.push(Output::Broadcast(
                        self.send(Request::Select { address, server }),
                    ));
                    self.deadline = now + self.backoff();
                }
            }
            Phase::Rebooting => match self.wanted {
                Some(a) if self.tries < REBOOT_TRIES => {
                    self.tries += 1;
                    out.push(Output::Broadcast(self.send(Request::Reboot(a))));
                    self.deadline = now + self.backoff();
                }
                _ => self.restart(now, &mut out),
            },
            Phase::Bound | Phase::Renewing | Phase::Rebinding => {
                let Some(lease) = self.lease else {
                    self.restart(now, &mut out);
                    return out;
                };
                if now >= lease.expires() {
                    self.lose(
                        format!(
                            "lease expired with no answer from {} or any other server",
                            lease.server
                        ),
                        &mut out,
                    );
                    self.restart(now, &mut out);
                } else if now >= lease.since + lease.t2 {
                    if self.phase != Phase::Rebinding {
                        self.phase = Phase::Rebinding;
                        self.new_xid();
                    }
                    out.push(Output::Broadcast(self.send(Request::Rebind(lease.address))));
                    self.deadline = now + renew_wait(lease.expires() - now, lease.duration);
                } else if now >= lease.since + lease.t1 {
                    if self.phase != Phase::Renewing {
                        self.phase = Phase::Renewing;
                        self.new_xid();
                    }
                    out.push(Output::Unicast(
                        self.send(Request::Renew(lease.address)),
                        lease.server,
                    ));
                    let t2 = lease.since + lease.t2;
                    self.deadline = now + renew_wait(t2 - now, lease.duration);
                } else {
                    self.deadline = lease.since + lease.t1;
                }
            }
        }
        out
    }

    fn discover(&mut self, now: Instant, out: &mut Vec<Output>) {
        self.tries += 1;
        out.push(Output::Broadcast(self.send(Request::Discover(self.wanted))));
        self.deadline = now + self.backoff();
    }

    /// Back to INIT with a new transaction, DISCOVER at once.
    fn restart(&mut self, now: Instant, out: &mut Vec<Output>) {
        self.phase = Phase::Selecting;
        self.offer = None;
        self.tries = 0;
        self.new_xid();
        self.discover(now, out);
    }

    fn lose(&mut self, reason: String, out: &mut Vec<Output>) {
        if let Some(lease) = self.lease.take() {
            self.wanted = Some(lease.address);
            out.push(Output::Lost {
                address: lease.address,
                reason,
            });
        }
    }

    fn allowed(&self, server: Option<Ipv4Addr>) -> bool {
        match server {
            None => false,
            Some(s) => self.servers.is_empty() || self.servers.contains(&s),
        }
    }

    fn quarantined(&self, server: Option<Ipv4Addr>, now: Instant) -> bool {
        server.is_some_and(|s| {
            self.quarantine
                .iter()
                .any(|&(q, until)| q == s && now < until)
        })
    }

    /// Stops listening to `server` for [`QUARANTINE`].
    fn hold_off(&mut self, server: Ipv4Addr, now: Instant) {
        self.quarantine
            .retain(|&(q, until)| q != server && now < until);
        if self.quarantine.len() >= MAX_QUARANTINED
            && let Some(soonest) = (0..self.quarantine.len()).min_by_key(|&i| self.quarantine[i].1)
        {
            self.quarantine.swap_remove(soonest);
        }
        self.quarantine.push((server, now + QUARANTINE));
    }

    /// A refusal of `reply` from `server`: the server is held off unless
    /// the fault is the host's own.
    fn refuse(&mut self, server: Ipv4Addr, reply: &Reply, reason: Refusal, now: Instant) -> Output {
        if reason != Refusal::HostUnreadable {
            self.hold_off(server, now);
        }
        Output::Refused {
            server,
            address: reply.address,
            prefix: reply.prefix,
            reason,
        }
    }

    /// Whether [`Client::on_reply`] would judge `reply` now (an offer or
    /// ACK for this transaction from a server listened to): the driver
    /// reads the host only then.
    pub fn judges(&self, reply: &Reply, now: Instant) -> bool {
        reply.chaddr == self.id.mac
            && reply.xid == self.xid
            && self.allowed(reply.server)
            && !self.quarantined(reply.server, now)
            && matches!(
                (self.phase, reply.kind),
                (Phase::Selecting, ReplyKind::Offer)
                    | (
                        Phase::Requesting | Phase::Rebooting | Phase::Renewing | Phase::Rebinding,
                        ReplyKind::Ack
                    )
            )
    }

    /// A packet arrived. Returns what to do, or why it was ignored.
    pub fn on_packet(
        &mut self,
        bytes: &[u8],
        now: Instant,
        judge: Judge<'_>,
    ) -> Result<Vec<Output>, Ignored> {
        self.on_reply(wire::parse(bytes), now, judge)
    }

    /// A packet arrived, already parsed. Returns what to do, or why it was
    /// ignored.
    pub fn on_reply(
        &mut self,
        reply: Result<Reply, NotReply>,
        now: Instant,
        judge: Judge<'_>,
    ) -> Result<Vec<Output>, Ignored> {
        let reply = reply.map_err(|e| match e {
            NotReply::Malformed => Ignored::Malformed,
            NotReply::Unexpected => Ignored::Unexpected,
        })?;
        if reply.chaddr != self.id.mac {
            return Err(Ignored::Chaddr);
        }
        if reply.xid != self.xid {
            return Err(Ignored::Xid);
        }
        if !self.allowed(reply.server) {
            return Err(Ignored::Rogue);
        }
        if self.quarantined(reply.server, now) {
            return Err(Ignored::Quarantined);
        }
        let mut out = Vec::new();
        match (self.phase, reply.kind) {
            (Phase::Selecting, ReplyKind::Offer) => {
                let server = reply.server.ok_or(Ignored::Rogue)?;
                if reply.lease.is_none_or(|l| l.is_zero()) {
                    return Err(Ignored::Rogue);
                }
                if let Err(reason) =
                    guard::judge(reply.address, reply.prefix, judge.guard, judge.host)
                {
                    // Still SELECTING: other servers' offers are taken.
                    return Ok(vec![self.refuse(server, &reply, reason, now)]);
                }
                // The first acceptable offer is taken (RFC 2131 allows any choice).
                self.offer = Some((reply.address, server));
                self.phase = Phase::Requesting;
                self.tries = 1;
                out.push(Output::Broadcast(self.send(Request::Select {
                    address: reply.address,
                    server,
                })));
                self.deadline = now + self.backoff();
            }
            (
                Phase::Requesting | Phase::Rebooting | Phase::Renewing | Phase::Rebinding,
                ReplyKind::Ack,
            ) => {
                let lease = self.lease_from(&reply, now).ok_or(Ignored::Rogue)?;
                if self.phase == Phase::Requesting
                    && self.offer.is_some_and(|(_, s)| Some(s) != reply.server)
                {
                    return Err(Ignored::Rogue);
                }
                if let Err(reason) =
                    guard::judge(reply.address, reply.prefix, judge.guard, judge.host)
                {
                    if reason == Refusal::HostUnreadable {
                        // Nothing changes; the retransmission asks again.
                        return Ok(vec![self.refuse(lease.server, &reply, reason, now)]);
                    }
                    // Nothing of this server's is kept: a lease it would
                    // extend or move goes, and the address is not asked for
                    // again.
                    self.lose(
                        format!(
                            "server {} acknowledged {}, which is refused: {}",
                            lease.server,
                            lease.address,
                            reason.label()
                        ),
                        &mut out,
                    );
                    if self.wanted == Some(reply.address) || self.phase == Phase::Rebooting {
                        self.wanted = None;
                    }
                    out.push(self.refuse(lease.server, &reply, reason, now));
                    self.restart(now, &mut out);
                    return Ok(out);
                }
                let renewed = self.lease.is_some_and(|l| l.address == lease.address);
                if !renewed {
                    self.lose(
                        format!(
                            "server {} moved the lease to {}",
                            lease.server, lease.address
                        ),
                        &mut out,
                    );
                }
                self.lease = Some(lease);
                self.wanted = Some(lease.address);
                self.offer = None;
                self.phase = Phase::Bound;
                self.tries = 0;
                self.deadline = lease.since + lease.t1;
                out.push(Output::Leased { lease, renewed });
            }
            (
                Phase::Requesting | Phase::Rebooting | Phase::Renewing | Phase::Rebinding,
                ReplyKind::Nak,
            ) => {
                let expected = match self.phase {
                    Phase::Requesting => self.offer.map(|(_, s)| s),
                    Phase::Renewing => self.lease.map(|l| l.server),
                    _ => None,
                };
                if expected.is_some() && expected != reply.server {
                    return Err(Ignored::Rogue);
                }
                let why = reply.message.as_deref().unwrap_or("no reason given");
                let server = reply.server.unwrap_or(Ipv4Addr::UNSPECIFIED);
                let reason = format!("NAK from {server}: {why}");
                out.push(Output::Nak {
                    reason: reason.clone(),
                });
                self.lose(reason, &mut out);
                if self.phase == Phase::Rebooting {
                    // The address held before is not ours to ask for again.
                    self.wanted = None;
                }
                self.phase = Phase::Init;
                self.offer = None;
                self.tries = 0;
                self.deadline = now + NAK_PAUSE;
            }
            _ => return Err(Ignored::Unexpected),
        }
        Ok(out)
    }

    /// A lease from an ACK, or `None` when the ACK cannot be one.
    fn lease_from(&self, reply: &Reply, now: Instant) -> Option<Lease> {
        let duration = reply.lease.filter(|d| !d.is_zero())?;
        let mut t1 = reply.t1.unwrap_or(duration / 2);
        let mut t2 = reply.t2.unwrap_or(duration * 7 / 8);
        if t2 >= duration || t2.is_zero() {
            t2 = duration * 7 / 8;
        }
        if t1 >= t2 || t1.is_zero() {
            t1 = (duration / 2).min(t2 / 2).max(Duration::from_millis(1));
        }
        Some(Lease {
            address: reply.address,
            prefix: reply.prefix.unwrap_or(32),
            server: reply.server?,
            since: now,
            duration,
            t1,
            t2,
        })
    }

    /// The DHCPRELEASE to send when giving the lease up (removal, clean
    /// stop), if one is held. The client is back in INIT afterwards.
    pub fn release(&mut self) -> Option<Output> {
        let lease = self.lease.take()?;
        self.phase = Phase::Init;
        self.new_xid();
        Some(Output::Unicast(
            self.send(Request::Release {
                address: lease.address,
                server: lease.server,
            }),
            lease.server,
        ))
    }
}

/// How long to wait before retransmitting in RENEWING or REBINDING, with
/// `left` until the next phase: half of it, but at least
/// [`MIN_RENEW_RETRANSMIT`] (an eighth of the lease for short leases) and
/// never past the phase's end.
pub fn renew_wait(left: Duration, lease: Duration) -> Duration {
    let floor = MIN_RENEW_RETRANSMIT
        .min(lease / 8)
        .max(Duration::from_millis(500));
    (left / 2)
        .max(floor)
        .min(left)
        .max(Duration::from_millis(1))
}

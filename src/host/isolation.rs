//! VIP isolation (`vip.isolate`): the port filter, one nftables table that
//! lets traffic addressed to a VIP reach only the ports of that VIP's
//! listeners. (Named for what the table does; not to be confused with
//! [`crate::host::vmnet::vmnet_filter`], which filters what enters from VM networks.)
//!
//! A VIP is one more address of the host, so every service the host runs on
//! a wildcard address (SSH on `0.0.0.0:22`, the Kubernetes API on `:6443`,
//! the kubelet) also answers on every VIP, to every client of every guest
//! cluster (harvester#3132, #6934). With `vip.isolate = true` the daemon owns
//! the table `inet harvester_lb`:
//!
//! ```text
//! table inet harvester_lb {
//!   set vips4 { type ipv4_addr; elements = { VIP, … } }
//!   set open4 { type ipv4_addr . inet_proto . inet_service; elements = { VIP . tcp . PORT, … } }
//!   (and vips6, open6)
//!   chain input {
//!     type filter hook input priority filter; policy accept;
//!     ip daddr . meta l4proto . th dport @open4 accept
//!     meta l4proto { icmp, ipv6-icmp } accept      # ping, PMTU, neighbour discovery
//!     ip daddr @vips4 drop                         # or: reject (a TCP reset)
//!   }
//! }
//! ```
//!
//! Traffic to any other address of the host never matches. The chain only
//! drops: its `accept` lets a packet go on to the host's other tables, so a
//! firewall of the host still applies to the open ports.
//!
//! The table is written whole in one `nft` transaction (create if missing,
//! delete, create with its contents), so there is never a moment with half
//! a table or none: at start (replacing whatever a crashed daemon left), at
//! every reload whose VIPs or ports changed, and deleted at a clean stop. A
//! crash leaves it in place, so nothing opens up while systemd restarts the
//! daemon.
//!
//! The daemon owns the table (see [`crate::host::owned`]): it keeps what the
//! kernel listed right after its write, and at every reload and every
//! [`crate::host::owned::CHECK_INTERVAL`] reads the table back; one that another
//! process changed or deleted (a second daemon started by hand, `nft flush
//! ruleset`) is written again whole, logged at warn with what differed and
//! counted (`vip_isolation_repairs_total`). `vip_isolation_up` is 1 only
//! while the kernel's table is the one written.
//!
//! It is applied through the `nftables` crate, which builds nft's JSON
//! schema as typed values and runs `nft -j -f -`: the kernel's own
//! userspace tool, present on every host that has nftables, and the one an
//! operator uses to inspect the result (`nft list table inet harvester_lb`).

use crate::metrics::HostKind;
use std::borrow::Cow;
use std::collections::{BTreeSet, HashMap};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::SystemTime;

use nftables::expr::{Expression, Meta, MetaKey, NamedExpression, Payload, PayloadField, SetItem};
use nftables::schema::{
    Chain, NfCmd, NfListObject, NfObject, Nftables, Rule, Set, SetType, SetTypeValue, Table,
};
use nftables::stmt::{Match, Operator, Reject, RejectType, Statement};
use nftables::types::{NfChainPolicy, NfChainType, NfFamily, NfHook, RejectCode};

use crate::config::{Config, IsolateAction, VipSettings};
use crate::host::owned::{Checked, Fingerprint, Guard, Owned};
use crate::metrics::Metrics;

/// The table's name, in family `inet`.
pub const TABLE: &str = "harvester_lb";

/// What the table lets through: every VIP, and each VIP's listener ports.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Openings {
    vips: BTreeSet<IpAddr>,
    /// VIP, nft's protocol name, port.
    open: BTreeSet<(IpAddr, &'static str, u16)>,
}

impl Openings {
    /// The VIPs and listener ports of `config`. A load balancer that
    /// leases its VIP (`[load_balancer.dhcp]`) is guarded at its address in
    /// `leased`, and not at all until it has one.
    pub fn of(config: &Config, leased: &HashMap<String, IpAddr>) -> Self {
        let mut o = Self::default();
        for lb in &config.load_balancers {
            let vip = match &lb.dhcp {
                Some(_) => match leased.get(&lb.name) {
                    Some(ip) => *ip,
                    None => continue,
                },
                None => lb.vip,
            };
            if vip.is_unspecified() {
                continue;
            }
            o.vips.insert(vip);
            for l in &lb.listeners {
                o.open.insert((vip, l.protocol.as_str(), l.port));
            }
        }
        o
    }

    /// How many VIPs are guarded.
    pub fn vips(&self) -> usize {
        self.vips.len()
    }

    /// How many VIP:port:protocol openings there are.
    pub fn ports(&self) -> usize {
        self.open.len()
    }
}

/// Why the table could not be written or removed.
#[derive(Debug, thiserror::Error)]
#[error(
    "could not {what} the nftables table inet {TABLE}: {detail} (it needs the `nft` command and CAP_NET_ADMIN: see systemd/vip.conf)"
)]
pub struct IsolationError {
    what: &'static str,
    detail: String,
}

/// Runs one `nft -j -f -` transaction (see [`crate::host::nft`]).
fn nft(what: &'static str, batch: &Nftables<'_>) -> Result<(), IsolationError> {
    let fail = |detail: String| IsolationError { what, detail };
    let json = serde_json::to_vec(batch).map_err(|e| fail(format!("cannot encode it: {e}")))?;
    crate::host::nft::run(&["-j", "-f", "-"], &json)
        .map(drop)
        .map_err(|e| fail(e.to_string()))
}

/// The table as the kernel lists it (`nft -j list table inet harvester_lb`);
/// `None` when there is none.
fn list() -> Result<Option<Fingerprint>, IsolationError> {
    let fail = |detail: String| IsolationError {
        what: "read back",
        detail,
    };
    match crate::host::nft::list_inet_table(TABLE).map_err(|e| fail(e.to_string()))? {
        Some(listed) => Fingerprint::of_nft_json(&listed)
            .map(Some)
            .map_err(|e| fail(e.to_string())),
        None => Ok(None),
    }
}

/// The port filter table as the daemon means it (the VIPs' open ports and
/// the action for the rest), as an [`Owned`] kernel object: how the
/// [`crate::host::owned::Guard`] writes it whole and reads it back.
struct PortFilterTable<'a>(&'a (Openings, IsolateAction));

impl Owned for PortFilterTable<'_> {
    const KIND: HostKind = HostKind::IsolationTable;
    type Error = IsolationError;
    fn read_back(&self) -> Result<Option<Fingerprint>, IsolationError> {
        list()
    }
    fn write(&self) -> Result<(), IsolationError> {
        nft("write", &ruleset(&self.0.0, self.0.1))
    }
    fn identity(&self) -> Option<(&str, u64)> {
        let json = serde_json::to_vec(&ruleset(&self.0.0, self.0.1)).ok()?;
        Some((TABLE, crate::host::owned::adopt::digest(&json)))
    }
}

/// Why the table was checked against the kernel: said in the repair's log line.
#[derive(Debug, Clone, Copy)]
pub enum CheckCause {
    /// A reload (or a DHCP lease change) that left the table's contents as they were.
    Reload,
    /// The periodic check.
    Timer,
}

/// What `/status` shows of the isolation.
#[derive(Debug, Clone, serde::Serialize)]
pub struct IsolationStatus {
    /// `vip.isolate`.
    pub enabled: bool,
    /// `inet harvester_lb`.
    pub table: String,
    /// Whether the table of the config in force is in the kernel.
    pub in_force: bool,
    /// `drop` or `reject`.
    pub action: &'static str,
    /// VIPs guarded.
    pub vips: usize,
    /// VIP:port:protocol openings.
    pub open_ports: usize,
    /// Unix time the table was last written.
    pub applied_unix: Option<u64>,
    /// The last failure to write it, if the last attempt failed.
    pub error: Option<String>,
}

#[derive(Debug, Default)]
struct State {
    /// What the config in force asks for (`None`: isolation off).
    wanted: Option<(Openings, IsolateAction)>,
    /// What the kernel has, as far as this process wrote it.
    applied: Option<(Openings, IsolateAction)>,
    /// How the kernel listed it right after the write.
    guard: Guard,
    applied_at: Option<SystemTime>,
    settings: VipSettings,
    error: Option<String>,
}

/// The daemon's side of the table: what it last wrote, writing it, and
/// checking that the kernel still has it. Sets `vip_isolation_up` and
/// counts repairs itself, so every path that writes or checks reports alike.
pub struct Isolation {
    state: Mutex<State>,
    metrics: Arc<Metrics>,
}

impl std::fmt::Debug for Isolation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Isolation")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Isolation {
    /// Nothing written yet; its state is reported in `metrics`.
    pub fn new(metrics: Arc<Metrics>) -> Self {
        Self {
            state: Mutex::default(),
            metrics,
        }
    }

    /// Makes the kernel's table match `config`: written whole when the VIPs,
    /// ports or action changed (or at the first call, replacing a table a
    /// crashed daemon left), deleted when isolation was turned off; when
    /// its contents are unchanged, read back and repaired if another
    /// process changed it. Blocking: it runs `nft`.
    pub fn reconcile(
        &self,
        config: &Config,
        leased: &HashMap<String, IpAddr>,
    ) -> Result<(), IsolationError> {
        let mut st = self.lock();
        st.settings = config.vip.clone();
        let result = if config.vip.isolate {
            st.wanted = Some((Openings::of(config, leased), config.vip.isolate_action));
            self.check_locked(&mut st, CheckCause::Reload)
        } else if st.applied.take().is_some() {
            st.wanted = None;
            st.guard.forget();
            delete().map(|()| st.applied_at = None)
        } else {
            st.wanted = None;
            Ok(())
        };
        self.settle(&mut st, result)
    }

    /// Reads the table back and writes it again if another process changed
    /// or deleted it (the periodic check); nothing when isolation is off.
    /// Blocking: it runs `nft`.
    pub fn check(&self) -> Result<(), IsolationError> {
        let mut st = self.lock();
        if !st.settings.isolate {
            return Ok(());
        }
        let result = self.check_locked(&mut st, CheckCause::Timer);
        self.settle(&mut st, result)
    }

    /// Writes the table when the kernel may not have the one wanted (its
    /// contents changed, or the last write or check failed); else reads it
    /// back and repairs it if it differs.
    fn check_locked(&self, st: &mut State, cause: CheckCause) -> Result<(), IsolationError> {
        let Some(wanted) = st.wanted.clone() else {
            return Ok(());
        };
        if st.applied.as_ref() != Some(&wanted) {
            st.applied = None;
            return st.guard.write(&PortFilterTable(&wanted)).map(|()| {
                st.applied = Some(wanted);
                st.applied_at = Some(SystemTime::now());
            });
        }
        match st
            .guard
            .check(&PortFilterTable(&wanted), &self.metrics.host_repairs)
        {
            Ok(Checked::Repaired(drift)) => {
                st.applied_at = Some(SystemTime::now());
                self.metrics.record_vip_isolation_repair();
                tracing::warn!(
                    table = %format!("inet {TABLE}"),
                    found = match cause {
                        CheckCause::Reload => "at reload",
                        CheckCause::Timer => "by the periodic check",
                    },
                    "the VIP isolation table in the kernel is not the one this daemon wrote ({drift}): another process changed it (a second harvester-lb, `nft flush ruleset`?); written again"
                );
                Ok(())
            }
            Ok(Checked::InPlace | Checked::NothingOwned) => Ok(()),
            Err(e) => {
                // Not known to be in place: written whole at the next check.
                st.applied = None;
                Err(e)
            }
        }
    }

    /// Records the outcome for `/status` and `vip_isolation_up`.
    fn settle(
        &self,
        st: &mut State,
        result: Result<(), IsolationError>,
    ) -> Result<(), IsolationError> {
        st.error = result.as_ref().err().map(ToString::to_string);
        self.metrics
            .set_vip_isolation(st.settings.isolate.then_some(result.is_ok()));
        result
    }

    /// Deletes the table if this process wrote it (a clean stop).
    pub fn remove(&self) -> Result<(), IsolationError> {
        let mut st = self.lock();
        st.guard.forget();
        st.wanted = None;
        if st.applied.take().is_none() {
            return Ok(());
        }
        st.applied_at = None;
        delete()
    }

    /// Whether the last write succeeded (1 when isolation is off).
    pub fn healthy(&self) -> bool {
        self.lock().error.is_none()
    }

    /// For `/status`.
    pub fn status(&self) -> IsolationStatus {
        let st = self.lock();
        let (vips, open_ports) = st
            .applied
            .as_ref()
            .map_or((0, 0), |(o, _)| (o.vips(), o.ports()));
        IsolationStatus {
            enabled: st.settings.isolate,
            table: format!("inet {TABLE}"),
            in_force: st.applied.is_some(),
            action: match st.settings.isolate_action {
                IsolateAction::Drop => "drop",
                IsolateAction::Reject => "reject",
            },
            vips,
            open_ports,
            applied_unix: st
                .applied_at
                .and_then(|t| t.duration_since(SystemTime::UNIX_EPOCH).ok())
                .map(|d| d.as_secs()),
            error: st.error.clone(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

fn delete() -> Result<(), IsolationError> {
    // "add" first, so that deleting a table that is already gone succeeds.
    let batch = Nftables {
        objects: Cow::Owned(vec![
            NfObject::CmdObject(NfCmd::Add(NfListObject::Table(table()))),
            NfObject::CmdObject(NfCmd::Delete(NfListObject::Table(table()))),
        ]),
    };
    nft("delete", &batch)
}

fn table() -> Table<'static> {
    Table {
        family: NfFamily::INet,
        name: TABLE.into(),
        handle: None,
    }
}

/// The whole table as one transaction: create it if missing, delete it,
/// and create it again with its sets, chain and rules.
pub fn ruleset(openings: &Openings, action: IsolateAction) -> Nftables<'static> {
    let mut cmds = vec![
        NfCmd::Add(NfListObject::Table(table())),
        NfCmd::Delete(NfListObject::Table(table())),
        NfCmd::Add(NfListObject::Table(table())),
    ];
    for (name, ty, elements) in [
        ("vips4", vips_type(false), vip_elements(openings, false)),
        ("vips6", vips_type(true), vip_elements(openings, true)),
        ("open4", open_type(false), open_elements(openings, false)),
        ("open6", open_type(true), open_elements(openings, true)),
    ] {
        cmds.push(NfCmd::Add(NfListObject::Set(Box::new(Set {
            family: NfFamily::INet,
            table: TABLE.into(),
            name: name.into(),
            set_type: ty,
            elem: (!elements.is_empty()).then(|| Cow::Owned(elements)),
            ..Set::default()
        }))));
    }
    cmds.push(NfCmd::Add(NfListObject::Chain(Chain {
        family: NfFamily::INet,
        table: TABLE.into(),
        name: "input".into(),
        _type: Some(NfChainType::Filter),
        hook: Some(NfHook::Input),
        prio: Some(0),
        policy: Some(NfChainPolicy::Accept),
        ..Chain::default()
    })));
    let mut rules: Vec<Vec<Statement<'static>>> = Vec::new();
    for v6 in [false, true] {
        rules.push(vec![
            Statement::Match(Match {
                left: Expression::Named(NamedExpression::Concat(vec![
                    daddr(v6),
                    Expression::Named(NamedExpression::Meta(Meta {
                        key: MetaKey::L4proto,
                    })),
                    payload("th", "dport"),
                ])),
                right: Expression::String(if v6 { "@open6" } else { "@open4" }.into()),
                op: Operator::EQ,
            }),
            Statement::Accept(None),
        ]);
    }
    rules.push(vec![
        Statement::Match(Match {
            left: Expression::Named(NamedExpression::Meta(Meta {
                key: MetaKey::L4proto,
            })),
            right: Expression::Named(NamedExpression::Set(vec![
                SetItem::Element(Expression::String("icmp".into())),
                SetItem::Element(Expression::String("ipv6-icmp".into())),
            ])),
            op: Operator::EQ,
        }),
        Statement::Accept(None),
    ]);
    for v6 in [false, true] {
        let to_vip = Statement::Match(Match {
            left: daddr(v6),
            right: Expression::String(if v6 { "@vips6" } else { "@vips4" }.into()),
            op: Operator::EQ,
        });
        match action {
            IsolateAction::Drop => rules.push(vec![to_vip, Statement::Drop(None)]),
            IsolateAction::Reject => {
                rules.push(vec![
                    to_vip.clone(),
                    Statement::Match(Match {
                        left: Expression::Named(NamedExpression::Meta(Meta {
                            key: MetaKey::L4proto,
                        })),
                        right: Expression::String("tcp".into()),
                        op: Operator::EQ,
                    }),
                    Statement::Reject(Some(Reject::new(Some(RejectType::TCPReset), None))),
                ]);
                rules.push(vec![
                    to_vip,
                    Statement::Reject(Some(Reject::new(
                        Some(RejectType::ICMPX),
                        Some(RejectCode::PortUnreach),
                    ))),
                ]);
            }
        }
    }
    for expr in rules {
        cmds.push(NfCmd::Add(NfListObject::Rule(Rule {
            family: NfFamily::INet,
            table: TABLE.into(),
            chain: "input".into(),
            expr: Cow::Owned(expr),
            handle: None,
            index: None,
            comment: None,
        })));
    }
    Nftables {
        objects: Cow::Owned(cmds.into_iter().map(NfObject::CmdObject).collect()),
    }
}

fn payload(protocol: &'static str, field: &'static str) -> Expression<'static> {
    Expression::Named(NamedExpression::Payload(Payload::PayloadField(
        PayloadField {
            protocol: protocol.into(),
            field: field.into(),
        },
    )))
}

fn daddr(v6: bool) -> Expression<'static> {
    payload(if v6 { "ip6" } else { "ip" }, "daddr")
}

fn vips_type(v6: bool) -> SetTypeValue<'static> {
    SetTypeValue::Single(if v6 {
        SetType::Ipv6Addr
    } else {
        SetType::Ipv4Addr
    })
}

fn open_type(v6: bool) -> SetTypeValue<'static> {
    SetTypeValue::Concatenated(Cow::Owned(vec![
        if v6 {
            SetType::Ipv6Addr
        } else {
            SetType::Ipv4Addr
        },
        SetType::InetProto,
        SetType::InetService,
    ]))
}

fn vip_elements(o: &Openings, v6: bool) -> Vec<Expression<'static>> {
    o.vips
        .iter()
        .filter(|ip| ip.is_ipv6() == v6)
        .map(|ip| Expression::String(ip.to_string().into()))
        .collect()
}

fn open_elements(o: &Openings, v6: bool) -> Vec<Expression<'static>> {
    o.open
        .iter()
        .filter(|(ip, _, _)| ip.is_ipv6() == v6)
        .map(|(ip, protocol, port)| {
            Expression::Named(NamedExpression::Concat(vec![
                Expression::String(ip.to_string().into()),
                Expression::String((*protocol).into()),
                Expression::Number(u32::from(*port)),
            ]))
        })
        .collect()
}

//! Keeping the kernel's NAT tables equal to the desired state: one transaction
//! per change, none when nothing changed, a full resync after a failure or
//! after a check found the tables changed by another process
//! ([`KernelTable::check`], see `check`); a refused write narrowed to the
//! owners whose listeners the kernel refuses, the rest written
//! ([`KernelTable::narrow`]).

use super::{Desired, KernelListener, ListenerId};
use std::collections::{BTreeMap, HashSet};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;

use super::build::{
    TableObjects, has_backend_chains, partial_transaction_json, prelude, transaction_json,
};
use super::check::{self, Compared, Expected, Impaired};
use super::commit;
use super::error::NftError;
use super::narrow::{self, MAX_CHECKS};
use super::netlink;
use super::read_back;

/// The listeners of `desired` whose backend choice alone differs from
/// `applied` (a health flip, a drain), when nothing else differs: then
/// only their chains are rewritten, over netlink. `None`: something else
/// changed (a listener, a member, a source range), which `nft` writes.
///
/// `among`: the listeners that may differ, when the caller knows (the
/// others are not compared: at 10,000 listeners the whole comparison took
/// ~2 ms of a flip); `None`: any.
fn only_choices_changed<'a>(
    desired: &'a Desired,
    applied: &Desired,
    among: Option<&[ListenerId]>,
) -> Option<Vec<(&'a ListenerId, &'a KernelListener)>> {
    if desired.len() != applied.len() {
        return None;
    }
    let candidates: Box<dyn Iterator<Item = (&'a ListenerId, &'a KernelListener)>> = match among {
        Some(ids) => Box::new(
            ids.iter()
                .map(|id| desired.get_key_value(id))
                .collect::<Option<Vec<_>>>()?
                .into_iter(),
        ),
        None => Box::new(desired.iter()),
    };
    let mut flipped = Vec::new();
    for (id, l) in candidates {
        let old = applied.get(id)?;
        if old == l {
            continue;
        }
        let same_objects = KernelListener {
            eligible: l.eligible.clone(),
            close_down: l.close_down.clone(),
            ..old.clone()
        } == *l;
        // A bucket map or affinity sets are edited with the chain: `nft`.
        if !same_objects || has_backend_chains(l) {
            return None;
        }
        flipped.push((id, l));
    }
    Some(flipped)
}

/// What a [`KernelTable::sync`] did.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Synced {
    /// The kernel already had it: no `nft` call.
    Unchanged,
    /// One transaction was applied, taking this long (`nft` included).
    Written(Duration),
}

#[derive(Debug, Default)]
struct State {
    /// What the kernel holds, as this process last wrote it; `None` at
    /// start and after a failure, when only a read-back can tell.
    applied: Option<Desired>,
    /// The last failure, while it stands.
    error: Option<NftError>,
    /// Removed at a clean stop: nothing is written any more.
    closed: bool,
    /// The flips' netlink socket, once opened; dropped after a failure.
    writer: Option<netlink::Writer>,
    /// What `applied` was when an `nft` write failed, until one succeeds:
    /// a refused transaction changes nothing, so the kernel still holds
    /// it. Narrowing ([`KernelTable::narrow`]) suspects only the owners
    /// whose listeners differ from it, and writes the rest from it.
    failed_from: Option<Desired>,
    /// What the checks compare the kernel's tables with.
    check: CheckMemory,
}

/// The check's memory of the tables (see [`KernelTable::check`]).
#[derive(Debug, Default)]
struct CheckMemory {
    /// What the tables must hold since the last write, and the rules of
    /// each chain as read back after it; `None` before the first write.
    expected: Option<Arc<Expected>>,
    /// Counts the writes: a read-back that a write crossed is not compared.
    writes: u64,
    /// The listeners the last check found not as written, until the write
    /// that repairs them.
    impaired: Impaired,
    /// The ruleset's generation a check last found the tables as written
    /// at, with `writes` then: while neither moved, nothing is read again.
    /// A check at rest costs one netlink request, not a dump of 10,000
    /// listeners.
    checked: Option<(u32, u64)>,
    /// A check found a difference: the next sync writes every object of
    /// the tables again, after reading them back.
    resync: bool,
    /// Chains in our tables that are not ours, found by the last check:
    /// deleted before the resync (which rewrites only what is ours).
    foreign: Vec<super::build::TableObject>,
    /// The read-backs' netlink socket, kept open (a closed one stalls the
    /// next commit) and opened in the tables' network namespace.
    reader: Arc<netlink::KeptSocket>,
}

impl State {
    /// A sync that only flips listeners' choices (or changes nothing),
    /// when the kernel is known to hold `applied`: the flipped chains are
    /// rewritten over netlink and only their entries of `applied`
    /// replaced. At 10,000 listeners a copy of the whole state per flip
    /// (and the drop of the old one) took more time than the kernel's
    /// commit. `None`: not a flip.
    fn flip(
        &mut self,
        desired: &Desired,
        among: Option<&[ListenerId]>,
    ) -> Option<Result<Synced, NftError>> {
        let applied = self.applied.as_mut().filter(|a| !a.is_empty())?;
        let flipped = only_choices_changed(desired, applied, among)?;
        if flipped.is_empty() {
            return Some(Ok(Synced::Unchanged));
        }
        let started = Instant::now();
        let writer = match self.writer.take() {
            Some(w) => Ok(w),
            None => netlink::Writer::open(),
        };
        let written = writer.and_then(|w| {
            w.rewrite_listeners(flipped.iter().copied())?;
            Ok(w)
        });
        match written {
            Ok(w) => {
                let chains: Vec<_> = flipped.iter().map(|(id, _)| **id).collect();
                for (id, l) in flipped {
                    applied.insert(*id, l.clone());
                }
                self.check.note_flip(&chains);
                self.writer = Some(w);
                self.error = None;
                Some(Ok(Synced::Written(started.elapsed())))
            }
            Err(e) => {
                // A refused batch changes nothing: see `failed_from`.
                self.failed_from = self.applied.take();
                self.error = Some(e.clone());
                Some(Err(e))
            }
        }
    }
}

/// The daemon's side of the tables `inet harvester_lb_nat` and its shards.
#[derive(Debug, Default)]
pub struct KernelTable {
    state: Mutex<State>,
    /// The owners whose listeners the kernel refused, by name, with when:
    /// apart from `state`, so that `/status` does not wait out a write.
    refused: Mutex<BTreeMap<String, (Refused, Instant)>>,
}

/// An owner (a load balancer) whose listeners the kernel refused to take
/// while it took everyone else's: its kernel listeners are served by the
/// proxy until a write with them succeeds.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "the kernel refused the NAT objects of load balancer {owner:?} ({detail}); its forwarding = \"kernel\" listeners are served by the proxy meanwhile, and the other load balancers' stay in the kernel"
)]
pub struct Refused {
    /// The owner's name.
    pub owner: String,
    /// The kernel's answer, in nft's words.
    detail: String,
}

/// What [`KernelTable::narrow`] found and did.
#[derive(Debug)]
pub struct Narrowed {
    /// The owners left out, each with the kernel's answer.
    pub refused: Vec<Refused>,
    /// Their listeners, none of which is in the kernel now.
    pub left_out: Vec<ListenerId>,
    /// The write of everything else.
    pub synced: Result<Synced, NftError>,
}

impl KernelTable {
    /// Nothing known of the kernel yet.
    pub fn new() -> Self {
        Self::default()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Makes the table `desired`. The first call (and the first after a
    /// failure) reads the table back and deletes what is not wanted any
    /// more, in the same transaction: a restarted daemon reconciles the
    /// rules a crash left, and never deletes the table under open flows.
    /// With no kernel listener and no table, it writes nothing. Blocking:
    /// it runs `nft`.
    pub fn sync(&self, desired: &Desired) -> Result<Synced, NftError> {
        let mut st = self.lock();
        if st.closed {
            return Ok(Synced::Unchanged);
        }
        st.take_resync();
        if let Some(flip) = st.flip(desired, None) {
            return flip;
        }
        if st.applied.as_ref() == Some(desired) {
            return Ok(Synced::Unchanged);
        }
        let started = Instant::now();
        let result = (|| {
            // Known to be in the kernel: only what differs is written.
            // (Nothing written yet, the table may not exist: a full write.)
            if let Some(applied) = st.applied.as_ref().filter(|a| !a.is_empty()) {
                commit::prepare(prelude(desired, Some(applied), &TableObjects::of(applied)))?;
                return commit::apply_json(&partial_transaction_json(desired, applied))
                    .map(|()| true);
            }
            // After a hand-over: the tables the previous process left,
            // wanted as they are, are taken as written (same handles, no
            // transaction).
            if st.applied.is_none() && crate::host::owned::adopt::inherited(ADOPT_KEY) {
                let now = nat_digest().ok().flatten();
                if crate::host::owned::adopt::adopt_digest(ADOPT_KEY, desired_digest(desired), now)
                {
                    // What the checks compare with: read back, as after a write.
                    st.note_write(desired, None);
                    return Ok(false);
                }
            }
            let present = match &st.applied {
                Some(applied) => TableObjects::of(applied),
                None => match read_back::read_back() {
                    Ok(p) => p,
                    // No `nft` and nothing to forward: nothing is wrong.
                    Err(_) if desired.is_empty() => return Ok(false),
                    Err(e) => return Err(e),
                },
            };
            if desired.is_empty() && present == TableObjects::default() {
                return Ok(false);
            }
            commit::prepare(prelude(desired, None, &present))?;
            commit::apply_json(&transaction_json(desired, &present)).map(|()| true)
        })();
        match result {
            Ok(written) => {
                let before = st.applied.replace(desired.clone());
                if written {
                    st.note_write(desired, before.as_ref());
                }
                st.error = None;
                st.failed_from = None;
                Ok(if written {
                    Synced::Written(started.elapsed())
                } else {
                    Synced::Unchanged
                })
            }
            Err(e) => {
                if let Some(applied) = st.applied.take() {
                    st.failed_from = Some(applied);
                }
                st.error = Some(e.clone());
                Err(e)
            }
        }
    }

    /// [`Self::sync`], told that `desired` differs from the state last
    /// given to a sync at most in the listeners `changed` (the caller
    /// rebuilt only those): a flip then compares only them. Anything that
    /// is not a flip of a state known to be in the kernel is a plain sync.
    pub fn sync_changed(
        &self,
        desired: &Desired,
        changed: &[ListenerId],
    ) -> Result<Synced, NftError> {
        let mut st = self.lock();
        if st.closed {
            return Ok(Synced::Unchanged);
        }
        st.take_resync();
        if let Some(flip) = st.flip(desired, Some(changed)) {
            return flip;
        }
        drop(st);
        self.sync(desired)
    }

    /// Whether `id` is forwarded by the kernel now: the last sync that
    /// included it succeeded, and the last check found its objects as
    /// written.
    pub fn forwards(&self, id: &ListenerId) -> bool {
        let st = self.lock();
        st.error.is_none()
            && st.applied.as_ref().is_some_and(|a| a.contains_key(id))
            && st.check.impaired.reason(id).is_none()
    }

    /// Every listener [`Self::forwards`] says is in the kernel, under one
    /// lock: for the readings that ask about all of them (10,000 lock
    /// acquisitions, each waiting out a write in progress, held the
    /// daemon's runtime thread).
    pub fn forwarded(&self) -> std::collections::HashSet<ListenerId> {
        let st = self.lock();
        match (&st.error, &st.applied) {
            (None, Some(applied)) if st.check.impaired.is_empty() => {
                applied.keys().copied().collect()
            }
            (None, Some(applied)) => applied
                .keys()
                .filter(|id| st.check.impaired.reason(id).is_none())
                .copied()
                .collect(),
            _ => Default::default(),
        }
    }

    /// The failure that stands, if the last sync failed.
    pub fn error(&self) -> Option<String> {
        self.lock().error.as_ref().map(|e| e.to_string())
    }

    /// Stops writing without removing anything (a hand-over to the next
    /// process, issue 41): the tables stay as they are, every later sync
    /// writes nothing, and the next process's first sync reads them back.
    ///
    /// When the tables are as this process wrote them (a check finds them
    /// in place), it records for the hand-over marker what they hold
    /// ([`crate::host::owned::adopt`]): the next process's first sync, wanting
    /// the same, takes them as written instead of writing them again.
    /// Blocking: it runs `nft`.
    pub fn leave(&self) {
        let in_place = matches!(self.check(), Ok(Checked::InPlace));
        let mut st = self.lock();
        st.closed = true;
        let Some(applied) = st.applied.clone().filter(|a| !a.is_empty() && in_place) else {
            return;
        };
        drop(st);
        if let Ok(now) = nat_digest() {
            crate::host::owned::adopt::record_digest(ADOPT_KEY, desired_digest(&applied), now);
        }
    }

    /// Deletes the table (a clean stop, after the drain): new connections
    /// go to the proxy's sockets until they close. Nothing when this
    /// process never had a kernel listener.
    pub fn remove(&self) -> Result<(), NftError> {
        let mut st = self.lock();
        st.closed = true;
        st.check.expected = None;
        st.check.impaired = Impaired::default();
        let wrote = st.error.is_some() || st.applied.as_ref().is_some_and(|a| !a.is_empty());
        if !wrote {
            return Ok(());
        }
        st.applied = None;
        commit::remove()
    }
}

/// The NAT tables' name in the hand-over marker ([`crate::host::owned::adopt`]):
/// every shard under one record.
const ADOPT_KEY: &str = "harvester_lb_nat*";

/// A digest of what a full write of `desired` writes.
fn desired_digest(desired: &Desired) -> u64 {
    crate::host::owned::adopt::digest(&transaction_json(desired, &TableObjects::default()))
}

/// A digest of every NAT table of ours as the kernel lists it, without
/// what traffic changes (handles aside, the named counters' values and the
/// elements of the affinity sets, which the packet path adds): `None` when
/// there is none.
fn nat_digest() -> Result<Option<u64>, NftError> {
    let mut h: Option<u64> = None;
    for shard in read_back::our_tables_now()? {
        let Some(listed) = crate::host::nft::list_inet_table(&shard.table())
            .map_err(|e| NftError::new("read", e.to_string()))?
        else {
            continue;
        };
        let mut doc: serde_json::Value = serde_json::from_str(&listed)
            .map_err(|e| NftError::new("read", format!("cannot parse nft's listing: {e}")))?;
        for o in doc["nftables"].as_array_mut().into_iter().flatten() {
            if let Some(c) = o
                .get_mut("counter")
                .and_then(serde_json::Value::as_object_mut)
            {
                c.remove("packets");
                c.remove("bytes");
            }
            for kind in ["set", "map"] {
                if let Some(s) = o.get_mut(kind).and_then(serde_json::Value::as_object_mut) {
                    let dynamic = s
                        .get("flags")
                        .and_then(serde_json::Value::as_array)
                        .is_some_and(|f| f.iter().any(|x| x == "dynamic"));
                    if dynamic {
                        s.remove("elem");
                    }
                }
            }
        }
        let print = crate::host::owned::Fingerprint::of_nft_json(&doc.to_string())
            .map_err(|e| NftError::new("read", e.to_string()))?;
        let d = print.digest() ^ crate::host::owned::adopt::digest(shard.table().as_bytes());
        h = Some(h.map_or(d, |h| h.wrapping_mul(0x0100_0000_01b3) ^ d));
    }
    Ok(h)
}

/// What a [`KernelTable::check`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// Nothing to compare: no kernel listener, no write yet, a failed
    /// write standing (its retry resyncs), or a clean stop.
    NothingOwned,
    /// The tables hold what was written.
    InPlace,
    /// A write crossed the read-back: nothing was compared; check again.
    Busy,
    /// The tables differ: what differs, for the log (the first few of
    /// each side, as [`crate::host::owned::Drift`] says them). The listeners it
    /// breaks are no longer reported as forwarded, and the next sync
    /// writes everything again: wake the writer.
    Repairing(String),
}

impl State {
    /// After a check found a difference: the next sync reads the tables
    /// back and writes every object again (the full path).
    fn take_resync(&mut self) {
        if std::mem::take(&mut self.check.resync) {
            self.applied = None;
        }
        for o in std::mem::take(&mut self.check.foreign) {
            let table = o.shard.table();
            let script = format!(
                "flush chain inet {table} {0}\ndelete chain inet {table} {0}\n",
                o.name
            );
            // Still there (referenced by a rule the resync removes): the
            // next check finds it again.
            if let Err(e) = commit::prepare(Some(script)) {
                tracing::warn!(
                    "deleting the chain {} of table inet {table}, which is not this daemon's: {e}",
                    o.name
                );
            }
        }
    }

    /// After an `nft` write that took the tables from `before` (known to
    /// be in the kernel; `None`: read back) to `desired`: what they must
    /// hold now, and the rules of the chains it wrote, read back. A
    /// failed read leaves those chains to be taken as they are at the next
    /// check.
    fn note_write(&mut self, desired: &Desired, before: Option<&Desired>) {
        self.check.writes += 1;
        self.check.impaired = Impaired::default();
        let mut expected = Expected::of(desired);
        let before = before.filter(|b| !b.is_empty());
        let reread = expected.carry(desired, before, self.check.expected.as_deref());
        match read_back::read_rules(&self.check.reader, reread.as_deref()) {
            Ok(rules) => expected.rules.extend(rules),
            Err(e) => tracing::debug!("after a write, reading the NAT tables back: {e}"),
        }
        self.check.expected = Some(Arc::new(expected));
    }
}

impl CheckMemory {
    /// After a flip rewrote the chains of `listeners`: their rules, read
    /// back (one dump per chain, or per table when many flipped).
    fn note_flip(&mut self, listeners: &[ListenerId]) {
        self.writes += 1;
        let Some(expected) = self.expected.as_mut() else {
            return;
        };
        let chains: Vec<_> = listeners
            .iter()
            .map(|id| super::build::TableObject {
                shard: super::Shard::of(id),
                name: super::names::listener_chain(id),
            })
            .collect();
        let expected = Arc::make_mut(expected);
        for c in &chains {
            expected.rules.remove(c);
        }
        match read_back::read_rules(&self.reader, Some(&chains)) {
            Ok(rules) => expected.rules.extend(rules),
            Err(e) => tracing::debug!("after a flip, reading its chains back: {e}"),
        }
    }
}

impl KernelTable {
    /// Reads the tables back and compares them with what this process
    /// wrote (see `check`): the read runs without the lock, so a flip is
    /// not delayed by it; a write that crossed it makes it [`Checked::Busy`].
    /// On a difference the listeners it breaks stop being reported as
    /// forwarded and the next sync repairs everything. Blocking: netlink
    /// dumps of our tables.
    pub fn check(&self) -> Result<Checked, NftError> {
        let (expected, writes, reader) = {
            let st = self.lock();
            let owned = !st.closed
                && st.error.is_none()
                && !st.check.resync
                && st.applied.as_ref().is_some_and(|a| !a.is_empty());
            match (&st.check.expected, owned) {
                (Some(e), true) if !e.is_empty() => {
                    (Arc::clone(e), st.check.writes, Arc::clone(&st.check.reader))
                }
                _ => return Ok(Checked::NothingOwned),
            }
        };
        // Read before the tables: a commit during their read moves it.
        let generation = read_back::generation(&reader)?;
        if self.lock().check.checked == Some((generation, writes)) {
            return Ok(Checked::InPlace);
        }
        let seen = read_back::read_seen(&reader)?;
        let Compared {
            differences,
            adopt,
            foreign,
        } = check::compare(&expected, &seen);
        drop(expected);
        let mut st = self.lock();
        if st.check.writes != writes || st.closed || st.error.is_some() {
            return Ok(Checked::Busy);
        }
        if differences.is_empty() {
            if !adopt.is_empty()
                && let Some(e) = st.check.expected.as_mut()
            {
                Arc::make_mut(e).rules.extend(adopt);
            }
            st.check.checked = Some((generation, writes));
            return Ok(Checked::InPlace);
        }
        st.check.impaired = Impaired::of(&differences);
        st.check.resync = true;
        st.check.foreign = foreign;
        Ok(Checked::Repairing(
            check::Differences(&differences).to_string(),
        ))
    }

    /// Why listener `id` is not forwarded as written although its last
    /// write succeeded: what the last check found of its objects, until
    /// the repair's write. `None`: nothing found.
    pub fn impaired(&self, id: &ListenerId) -> Option<String> {
        self.lock().check.impaired.reason(id).map(str::to_string)
    }
}

/// Narrowing a refused write to its owners (see `host::nat::narrow`).
impl KernelTable {
    /// After [`Self::sync`] of `desired` failed: finds the owners whose
    /// listeners the kernel refuses (`owners`: each owner's listeners; a
    /// load balancer's, for the daemon), leaves them out and writes the
    /// rest, so one tenant's objects cost no other tenant the kernel path.
    /// Only owners whose listeners differ from what the kernel held before
    /// the failure are suspects (all, when that is unknown). `None`: no
    /// owner's listeners are refused alone (the failure is the table's own,
    /// or `nft`'s), nothing written. Blocking: it runs `nft`; the state is
    /// not locked during the checks.
    pub fn narrow(
        &self,
        desired: &Desired,
        owners: &[(String, Vec<ListenerId>)],
    ) -> Option<Narrowed> {
        let before = {
            let st = self.lock();
            if st.closed {
                return None;
            }
            st.failed_from.clone()
        };
        let suspects: Vec<&(String, Vec<ListenerId>)> = owners
            .iter()
            .filter(|(_, ids)| {
                ids.iter().any(|id| match &before {
                    Some(b) => desired.get(id).is_some_and(|l| b.get(id) != Some(l)),
                    None => desired.contains_key(id),
                })
            })
            .collect();
        let of = |set: &[usize]| -> Desired {
            set.iter()
                .flat_map(|&i| &suspects[i].1)
                .filter_map(|id| desired.get_key_value(id))
                .map(|(id, l)| (*id, l.clone()))
                .collect()
        };
        // The table's own parts refused (no `nft`, no CAP_NET_ADMIN): no
        // owner is to blame.
        if suspects.is_empty() || check_alone(&Desired::new()).is_err() {
            return None;
        }
        let found = narrow::bisect(suspects.len(), MAX_CHECKS, |set| check_alone(&of(set)));
        if found.is_empty() {
            return None;
        }
        let left_out: HashSet<ListenerId> = found
            .iter()
            .flat_map(|(i, _)| suspects[*i].1.iter().copied())
            .collect();
        let rest: Desired = desired
            .iter()
            .filter(|(id, _)| !left_out.contains(id))
            .map(|(id, l)| (*id, l.clone()))
            .collect();
        let refused: Vec<Refused> = found
            .into_iter()
            .map(|(i, e)| Refused {
                owner: suspects[i].0.clone(),
                detail: e.detail().to_string(),
            })
            .collect();
        {
            // The refused write changed nothing: what is written now is
            // the difference from what the kernel held before it.
            let mut st = self.lock();
            if st.applied.is_none() {
                st.applied = st.failed_from.clone();
            }
        }
        let synced = self.sync(&rest);
        let now = Instant::now();
        let mut held = self.refusals();
        for r in &refused {
            held.insert(r.owner.clone(), (r.clone(), now));
        }
        Some(Narrowed {
            refused,
            left_out: left_out.into_iter().collect(),
            synced,
        })
    }

    fn refusals(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, (Refused, Instant)>> {
        self.refused.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Why the kernel refused `owner`'s listeners, while it stands.
    pub fn refusal(&self, owner: &str) -> Option<Refused> {
        self.refusals().get(owner).map(|(r, _)| r.clone())
    }

    /// Every refused owner, with when it was (last) refused.
    pub fn refused(&self) -> BTreeMap<String, Instant> {
        self.refusals()
            .iter()
            .map(|(o, (_, at))| (o.clone(), *at))
            .collect()
    }

    /// Forgets the refusals of `owners`: a write with their listeners
    /// succeeded, or they are gone from the config.
    pub fn accept<'a>(&self, owners: impl IntoIterator<Item = &'a str>) {
        let mut held = self.refusals();
        for o in owners {
            held.remove(o);
        }
    }
}

/// Whether the kernel takes `listeners` alone, as a full write of a table
/// that held nothing would put them (`nft --check`: through the kernel,
/// committing nothing). Their prelude is written: it declares empty maps
/// and sets, which change no packet's path.
fn check_alone(listeners: &Desired) -> Result<(), NftError> {
    commit::prepare(prelude(listeners, None, &TableObjects::default()))?;
    let json = transaction_json(listeners, &TableObjects::default());
    commit::run("check", &["-c", "-j", "-f", "-"], &json).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::Protocol;

    fn listener(eligible: &[&str]) -> KernelListener {
        super::super::test_listener(eligible, &["10.0.0.1", "10.0.0.2"])
    }

    fn id(port: u16) -> ListenerId {
        ("192.0.2.10".parse().unwrap(), Protocol::Tcp, port)
    }

    #[test]
    fn a_check_that_found_a_difference_hides_what_it_breaks_and_forces_a_full_write() {
        let both = ["10.0.0.1", "10.0.0.2"];
        let table = KernelTable::new();
        {
            let mut st = table.lock();
            st.applied = Some((1..=2).map(|p| (id(p), listener(&both))).collect());
            st.check.impaired = Impaired::of(&[check::Difference {
                scope: check::Scope::Listener(id(1)),
                missing: true,
                what: "chain inet t l_1".into(),
            }]);
            st.check.resync = true;
        }
        assert!(!table.forwards(&id(1)));
        assert!(table.forwards(&id(2)));
        assert_eq!(table.forwarded(), [id(2)].into_iter().collect());
        assert_eq!(
            table.impaired(&id(1)).as_deref(),
            Some("chain inet t l_1 is gone")
        );
        // Until the repair is written, a check compares nothing.
        assert_eq!(table.check(), Ok(Checked::NothingOwned));
        let mut st = table.lock();
        st.take_resync();
        assert!(
            st.applied.is_none(),
            "the next write reads back, writes all"
        );
    }

    #[test]
    fn a_flip_compares_only_the_listeners_it_is_told_may_differ() {
        let both = ["10.0.0.1", "10.0.0.2"];
        let applied: Desired = (1..=3).map(|p| (id(p), listener(&both))).collect();
        let mut desired = applied.clone();
        desired.insert(id(2), listener(&["10.0.0.1"]));
        desired.insert(id(3), listener(&["10.0.0.2"]));
        let flipped = |desired: &Desired, among: Option<&[ListenerId]>| {
            only_choices_changed(desired, &applied, among)
                .map(|f| f.into_iter().map(|(id, _)| id.2).collect::<Vec<_>>())
        };
        assert_eq!(flipped(&desired, None), Some(vec![2, 3]));
        assert_eq!(
            flipped(&desired, Some(&[id(1), id(2)])),
            Some(vec![2]),
            "3 not looked at"
        );
        assert_eq!(flipped(&desired, Some(&[])), Some(vec![]));
        // A listener named that is not in the state: not a flip.
        assert_eq!(flipped(&desired, Some(&[id(9)])), None);
        // Something else than the choice changed: not a flip.
        desired.get_mut(&id(2)).unwrap().backend_port = 30081;
        assert_eq!(flipped(&desired, Some(&[id(2)])), None);
    }
}

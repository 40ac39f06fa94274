//! Keeping the kernel's table equal to the desired state: one transaction
//! per change, none when nothing changed, a full resync after a failure;
//! a refused write narrowed to the owners whose listeners the kernel
//! refuses, the rest written ([`KernelTable::narrow`]).

use super::{Desired, KernelListener, ListenerId};
use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

use super::build::{
    Owned, has_backend_chains, partial_transaction_json, prelude, transaction_json,
};
use super::narrow::{self, MAX_CHECKS};
use super::netlink;
use super::nft::{self, NftError};

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
                for (id, l) in flipped {
                    applied.insert(*id, l.clone());
                }
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
                nft::prepare(prelude(desired, Some(applied), &Owned::of(applied)))?;
                return nft::apply_json(&partial_transaction_json(desired, applied)).map(|()| true);
            }
            let present = match &st.applied {
                Some(applied) => Owned::of(applied),
                None => match nft::read_back() {
                    Ok(p) => p,
                    // No `nft` and nothing to forward: nothing is wrong.
                    Err(_) if desired.is_empty() => return Ok(false),
                    Err(e) => return Err(e),
                },
            };
            if desired.is_empty() && present == Owned::default() {
                return Ok(false);
            }
            nft::prepare(prelude(desired, None, &present))?;
            nft::apply_json(&transaction_json(desired, &present)).map(|()| true)
        })();
        match result {
            Ok(written) => {
                st.applied = Some(desired.clone());
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
        if let Some(flip) = st.flip(desired, Some(changed)) {
            return flip;
        }
        drop(st);
        self.sync(desired)
    }

    /// Whether `id` is forwarded by the kernel now (the last sync that
    /// included it succeeded).
    pub fn forwards(&self, id: &ListenerId) -> bool {
        let st = self.lock();
        st.error.is_none() && st.applied.as_ref().is_some_and(|a| a.contains_key(id))
    }

    /// Every listener [`Self::forwards`] says is in the kernel, under one
    /// lock: for the readings that ask about all of them (10,000 lock
    /// acquisitions, each waiting out a write in progress, held the
    /// daemon's runtime thread).
    pub fn forwarded(&self) -> std::collections::HashSet<ListenerId> {
        let st = self.lock();
        match (&st.error, &st.applied) {
            (None, Some(applied)) => applied.keys().copied().collect(),
            _ => Default::default(),
        }
    }

    /// The failure that stands, if the last sync failed.
    pub fn error(&self) -> Option<String> {
        self.lock().error.as_ref().map(|e| e.to_string())
    }

    /// Deletes the table (a clean stop, after the drain): new connections
    /// go to the proxy's sockets until they close. Nothing when this
    /// process never had a kernel listener.
    pub fn remove(&self) -> Result<(), NftError> {
        let mut st = self.lock();
        st.closed = true;
        let wrote = st.error.is_some() || st.applied.as_ref().is_some_and(|a| !a.is_empty());
        if !wrote {
            return Ok(());
        }
        st.applied = None;
        nft::remove()
    }
}

/// Narrowing a refused write to its owners (see `kernel::narrow`).
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
    nft::prepare(prelude(listeners, None, &Owned::default()))?;
    let json = transaction_json(listeners, &Owned::default());
    nft::run("check", &["-c", "-j", "-f", "-"], &json).map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::{Algorithm, Protocol, SourceNat};
    use std::net::IpAddr;

    fn listener(eligible: &[&str]) -> KernelListener {
        let ips = |v: &[&str]| {
            v.iter()
                .map(|a| a.parse().unwrap())
                .collect::<Vec<IpAddr>>()
        };
        KernelListener {
            backend_port: 30080,
            members: ips(&["10.0.0.1", "10.0.0.2"]),
            eligible: ips(eligible),
            source_ranges: None,
            source_nat: SourceNat::Masquerade,
            close_down: Vec::new(),
            pick: Algorithm::RoundRobin,
            affinity: None,
        }
    }

    fn id(port: u16) -> ListenerId {
        ("192.0.2.10".parse().unwrap(), Protocol::Tcp, port)
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

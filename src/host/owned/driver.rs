//! One driver for every kind of keyed object the daemon writes into the
//! host: routes in the announce table, the VIPs' local routes on the
//! announcing interface, the VM networks' routes and rules, the bridged
//! networks' legs, the reply marks' table and rules (each kind a
//! [`Backend`]; a single whole object has a [`super::Guard`] instead).
//!
//! A kind says three things through its [`Backend`]: how to read the
//! kernel's copy of every object that could be ours, how to write one, how
//! to remove one. The [`Driver`] does the rest the same way for every kind,
//! the way kube-proxy's sync loop owns its table:
//!
//! 1. **Read back** every object ([`Backend::read`]); an object this
//!    process wrote that is gone or not as the kernel showed it right after
//!    the write has *drifted*: another process changed it.
//! 2. **Remove** what is ours and no longer wanted (what this process
//!    wrote, and, for a kind whose keys one daemon alone holds, what a dead
//!    predecessor left: [`Backend::REMOVES_STRAYS`]).
//! 3. **Write** what is wanted and not in place, a drifted object included
//!    (that is the repair: logged at warn with what differed, counted in
//!    [`Outcome::repaired`]). An object another program holds under the
//!    same key ([`Found::marked`] false) is never overwritten nor removed:
//!    it is reported ([`Outcome::foreign`]).
//! 4. **Read back again** and remember each written object as the kernel
//!    shows it: that, not the write's success, is what [`Driver::held`]
//!    (and so `/status`) reports. A failed read forgets everything: nothing
//!    is reported held that was not read back, and the next sync writes
//!    what is wanted again (writes are idempotent).
//!
//! Changes coalesce by construction: the caller hands [`Driver::sync`] the
//! whole wanted set as of now, however many flips led to it, and the
//! driver writes only the difference from what the kernel holds.
//!
//! Stop order: each kind says when its objects go ([`StopPhase`]): what
//! attracts traffic (announce routes) before the drain, so the router moves
//! new flows away while open ones finish; what accepts traffic (the VIP
//! addresses) after it. [`Driver::stop`] removes everything of ours.
//!
//! The driver does no I/O of its own and keeps no clock, so every branch
//! (create, change, drift and repair, failure and retry, foreign objects,
//! strays, stop) is unit-tested below against an in-memory backend; the
//! real backends (rtnetlink) are tested in network namespaces
//! (`tests/it/announce.rs`).

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::future::Future;
use std::sync::Arc;

use super::Drift;
use crate::metrics::HostKind;
use crate::metrics::HostRepairs;
use crate::metrics::by_label::Label;

/// When, at a clean stop, a kind's objects are removed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum StopPhase {
    /// Before the listeners drain: the object attracts traffic (an
    /// announce route); withdrawing it first lets the router move new flows
    /// away while open connections finish.
    BeforeDrain,
    /// After the drain: the object accepts traffic (a VIP's local route); removing
    /// it earlier would cut the open connections the drain waits for.
    AfterDrain,
}

/// An object as the kernel holds it, and whether it carries the daemon's
/// mark (routes and addresses of protocol [`crate::config::ROUTE_PROTOCOL`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Found<S> {
    /// What the kernel shows of it.
    pub seen: S,
    /// Whether it carries the daemon's mark: unmarked objects were put by
    /// another program (or by a kernel that drops the mark) and are never
    /// written over nor removed unless this process wrote them.
    pub marked: bool,
}

/// One kind of object the daemon writes into the host: how to read the
/// kernel's copy, write an object and remove one. Implemented by each real
/// backend (rtnetlink) and by the in-memory one of the tests.
pub trait Backend {
    /// The kind, one spelling for the log (`kind=…`) and for
    /// `harvester_lb_host_repairs_total{kind}`, which the driver counts
    /// itself: no caller counts a repair by hand.
    const KIND: HostKind;
    /// When a clean stop removes this kind's objects.
    const STOP: StopPhase;
    /// Whether a marked object this process did not write is removed when
    /// not wanted: true where one daemon alone holds the keys (a claimed
    /// announce table: a marked route there is a dead predecessor's);
    /// false where other daemons may hold marked objects too (addresses
    /// on a shared `lo`), so only what this process wrote is removed.
    const REMOVES_STRAYS: bool;
    /// What names one object (a VIP).
    type Key: Ord + Clone + fmt::Display + Send + Sync;
    /// What the daemon wants the object to be.
    type Want: Clone + PartialEq + fmt::Debug + Send + Sync;
    /// What the kernel shows of it.
    type Seen: Clone + PartialEq + fmt::Debug + Send + Sync;
    /// Why reading or writing failed, in words for the operator.
    type Error: fmt::Display + Send + Sync;

    /// Every object of this kind the kernel holds under a key the daemon
    /// could use, marked or not.
    fn read(&mut self) -> impl Future<Output = Result<Listing<Self>, Self::Error>> + Send;
    /// Writes one object (idempotent: one of ours already there is fine).
    fn write(
        &mut self,
        key: &Self::Key,
        want: &Self::Want,
    ) -> impl Future<Output = Result<(), Self::Error>> + Send;
    /// Removes one object of ours (absent is fine).
    fn remove(&mut self, key: &Self::Key) -> impl Future<Output = Result<(), Self::Error>> + Send;

    /// Whether a marked object the kernel already holds is exactly what
    /// writing `want` would make, so the driver takes it as written
    /// instead of writing it again: a restarted daemon adopts what its
    /// predecessor left (no route replaced, nothing in `ip monitor`).
    /// `false` (the default): always written.
    fn adoptable(&self, _want: &Self::Want, _seen: &Self::Seen) -> bool {
        false
    }
}

/// Every object of a kind the kernel holds, by key.
pub type Listing<B> = BTreeMap<<B as Backend>::Key, Found<<B as Backend>::Seen>>;

/// What went wrong with one object.
#[derive(Debug)]
pub enum Failure<E> {
    /// The backend refused the write.
    Write(E),
    /// The backend refused the removal (the object is still held).
    Remove(E),
    /// The write succeeded but the read-back does not show the object.
    Vanished,
}

impl<E: fmt::Display> fmt::Display for Failure<E> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Failure::Write(e) | Failure::Remove(e) => e.fmt(f),
            Failure::Vanished => write!(
                f,
                "written, but not in the kernel when read back (removed at once by another program?)"
            ),
        }
    }
}

/// What one [`Driver::sync`] or [`Driver::stop`] did.
#[derive(Debug)]
pub struct Outcome<B: Backend> {
    /// Objects written now that were not held before (created or changed).
    pub written: Vec<B::Key>,
    /// Objects of ours removed.
    pub removed: Vec<B::Key>,
    /// Wanted objects the kernel already held, marked and exactly as
    /// wanted (a predecessor's, [`Backend::adoptable`]): taken as written,
    /// not written again.
    pub adopted: Vec<B::Key>,
    /// Objects this process wrote that another process changed or deleted,
    /// with what differed; each was wanted and written again (see
    /// `failed` for one whose rewrite failed). Logged at warn by the driver.
    pub repaired: Vec<(B::Key, Drift)>,
    /// Objects that failed, each retried at the next sync.
    pub failed: Vec<(B::Key, Failure<B::Error>)>,
    /// Wanted keys another program holds (unmarked), as the kernel shows
    /// them: left alone.
    pub foreign: Vec<(B::Key, B::Seen)>,
    /// The read-back failed: nothing is known held, and nothing was
    /// written or removed (retried at the next sync).
    pub unread: Option<B::Error>,
}

impl<B: Backend> Default for Outcome<B> {
    fn default() -> Self {
        Self {
            written: Vec::new(),
            removed: Vec::new(),
            adopted: Vec::new(),
            repaired: Vec::new(),
            failed: Vec::new(),
            foreign: Vec::new(),
            unread: None,
        }
    }
}

impl<B: Backend> Outcome<B> {
    /// Whether something must be tried again (a failure or an unread state).
    pub fn needs_retry(&self) -> bool {
        !self.failed.is_empty() || self.unread.is_some()
    }

    /// The failure of `key`, if it failed.
    pub fn failure(&self, key: &B::Key) -> Option<&Failure<B::Error>> {
        self.failed.iter().find(|(k, _)| k == key).map(|(_, f)| f)
    }
}

/// One object this process wrote: what it wanted, and how the kernel
/// showed it right after the write.
#[derive(Debug, Clone)]
struct Record<W, S> {
    want: W,
    found: Found<S>,
}

/// Owns one kind of object in the host (see the module's text).
pub struct Driver<B: Backend> {
    backend: B,
    /// What this process wrote and the kernel held at the last read-back.
    written: BTreeMap<B::Key, Record<B::Want, B::Seen>>,
    /// Whether the last read-back succeeded: while it fails nothing is
    /// reported held (what `written` says is memory, not the kernel).
    read_ok: bool,
    /// Whether the kernel was ever read: a marked object that appears
    /// after the first read was put there by another process (a repair),
    /// one found at the first read is a dead predecessor's.
    read_once: bool,
    /// Where each repair is counted, under [`Backend::KIND`]
    /// (`host_repairs_total{kind}`).
    repairs: Arc<HostRepairs>,
}

impl<B: Backend> fmt::Debug for Driver<B> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Driver")
            .field("kind", &B::KIND.name())
            .field("held", &self.written.len())
            .finish_non_exhaustive()
    }
}

impl<B: Backend> Driver<B> {
    /// Owns nothing yet: the first sync writes what is wanted (and, where
    /// the kind says so, removes a dead predecessor's strays); each
    /// repair it makes is counted in `repairs` under [`Backend::KIND`].
    pub fn new(backend: B, repairs: Arc<HostRepairs>) -> Self {
        Self {
            backend,
            written: BTreeMap::new(),
            read_ok: false,
            read_once: false,
            repairs,
        }
    }

    /// The backend, for the kind's own reads (an interface's index…).
    pub fn backend(&self) -> &B {
        &self.backend
    }

    /// The objects of ours the kernel held at the last read-back; none
    /// while the kernel cannot be read.
    pub fn held(&self) -> impl Iterator<Item = &B::Key> {
        self.written.keys().filter(|_| self.read_ok)
    }

    /// Whether `key` was ours and in the kernel at the last read-back.
    pub fn holds(&self, key: &B::Key) -> bool {
        self.read_ok && self.written.contains_key(key)
    }

    /// Makes the kernel hold `wanted` (the whole set as of now): read
    /// back, repair, remove, write, read back again.
    pub async fn sync(&mut self, wanted: &BTreeMap<B::Key, B::Want>) -> Outcome<B> {
        let mut out = Outcome::default();
        let now = match self.backend.read().await {
            Ok(now) => now,
            Err(e) => {
                self.read_ok = false;
                out.unread = Some(e);
                return out;
            }
        };
        self.read_ok = true;
        let mut drifted = self.drifted(&now);
        let mut remove: BTreeSet<B::Key> = self
            .written
            .keys()
            .filter(|k| !wanted.contains_key(k))
            .cloned()
            .collect();
        if B::REMOVES_STRAYS {
            for (key, found) in &now {
                if found.marked && !wanted.contains_key(key) && !self.written.contains_key(key) {
                    remove.insert(key.clone());
                    if self.read_once {
                        // Not there at the last read: another process's.
                        let drift = Drift::Changed {
                            missing: Vec::new(),
                            unexpected: vec![describe(found)],
                        };
                        drifted.push((key.clone(), drift));
                    }
                }
            }
        }
        self.read_once = true;
        for key in remove {
            self.remove(key, &mut out).await;
        }
        let mut pending = Vec::new();
        for (key, want) in wanted {
            if self.written.get(key).is_some_and(|r| r.want == *want) {
                continue;
            }
            if !self.written.contains_key(key)
                && let Some(other) = now.get(key).filter(|f| !f.marked)
            {
                out.foreign.push((key.clone(), other.seen.clone()));
                continue;
            }
            if !self.written.contains_key(key)
                && let Some(found) = now
                    .get(key)
                    .filter(|f| f.marked && self.backend.adoptable(want, &f.seen))
                && !drifted.iter().any(|(k, _)| k == key)
            {
                self.written.insert(
                    key.clone(),
                    Record {
                        want: want.clone(),
                        found: found.clone(),
                    },
                );
                out.adopted.push(key.clone());
                continue;
            }
            match self.backend.write(key, want).await {
                Ok(()) => pending.push((key.clone(), want.clone())),
                // What was held before (an older version) is still held.
                Err(e) => out.failed.push((key.clone(), Failure::Write(e))),
            }
        }
        for (key, drift) in drifted {
            // A drifted object no longer wanted, or taken by another
            // program, needs no repair (the latter is reported as foreign).
            let unwanted_stray =
                matches!(&drift, Drift::Changed { missing, .. } if missing.is_empty());
            let wanted_here =
                wanted.contains_key(&key) && !out.foreign.iter().any(|(k, _)| *k == key);
            if wanted_here || unwanted_stray {
                tracing::warn!(
                    kind = B::KIND.name(),
                    object = %key,
                    "the kernel's copy is not what this daemon wrote ({drift}): another process changed it; repaired"
                );
                out.repaired.push((key, drift));
            }
        }
        if !out.repaired.is_empty() {
            self.repairs[B::KIND].increment(out.repaired.len() as u64);
        }
        if !pending.is_empty() {
            self.record(pending, &mut out).await;
        }
        out
    }

    /// Removes every object of ours (a clean stop, or the kind switched
    /// off); where the kind says so, a dead predecessor's strays too.
    pub async fn stop(&mut self) -> Outcome<B> {
        let mut out = Outcome::default();
        let mut remove: BTreeSet<B::Key> = self.written.keys().cloned().collect();
        if B::REMOVES_STRAYS {
            match self.backend.read().await {
                Ok(now) => remove.extend(now.into_iter().filter(|(_, f)| f.marked).map(|(k, _)| k)),
                Err(e) => out.unread = Some(e),
            }
        }
        for key in remove {
            self.remove(key, &mut out).await;
        }
        out
    }

    /// Forgets every object that is not in the kernel as it was written
    /// (so it is written again if wanted); returns what differed.
    fn drifted(&mut self, now: &BTreeMap<B::Key, Found<B::Seen>>) -> Vec<(B::Key, Drift)> {
        let mut drifted = Vec::new();
        self.written.retain(|key, record| {
            let drift = match now.get(key) {
                Some(found) if *found == record.found => return true,
                None => Drift::Gone,
                Some(found) => Drift::Changed {
                    missing: vec![describe(&record.found)],
                    unexpected: vec![describe(found)],
                },
            };
            drifted.push((key.clone(), drift));
            false
        });
        drifted
    }

    async fn remove(&mut self, key: B::Key, out: &mut Outcome<B>) {
        match self.backend.remove(&key).await {
            Ok(()) => {
                self.written.remove(&key);
                out.removed.push(key);
            }
            Err(e) => out.failed.push((key, Failure::Remove(e))),
        }
    }

    /// Reads back after writes and remembers each written object as the
    /// kernel shows it.
    async fn record(&mut self, pending: Vec<(B::Key, B::Want)>, out: &mut Outcome<B>) {
        let now = match self.backend.read().await {
            Ok(now) => now,
            Err(e) => {
                // Written, but not known held: written again next time.
                out.unread = Some(e);
                return;
            }
        };
        for (key, want) in pending {
            match now.get(&key) {
                Some(found) => {
                    self.written.insert(
                        key.clone(),
                        Record {
                            want,
                            found: found.clone(),
                        },
                    );
                    out.written.push(key);
                }
                None => out.failed.push((key, Failure::Vanished)),
            }
        }
    }
}

/// One object as the log names it.
fn describe<S: fmt::Debug>(found: &Found<S>) -> String {
    if found.marked {
        format!("{:?}", found.seen)
    } else {
        format!("{:?} (not marked as ours)", found.seen)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The kernel in memory: objects by key, and failures to inject.
    #[derive(Debug, Default)]
    struct Fake<const STRAYS: bool> {
        kernel: BTreeMap<u32, Found<String>>,
        fail_write: BTreeSet<u32>,
        fail_remove: BTreeSet<u32>,
        fail_read: bool,
        /// Writes that the "kernel" drops at once (another program races).
        swallow: BTreeSet<u32>,
        /// Writes come back without the mark (kernels before 5.18 and
        /// addresses' protocol).
        drop_mark: bool,
        /// Every write and removal, in order.
        ops: Vec<String>,
    }

    impl<const STRAYS: bool> Backend for Fake<STRAYS> {
        const KIND: HostKind = HostKind::AnnounceRoute;
        const STOP: StopPhase = StopPhase::AfterDrain;
        const REMOVES_STRAYS: bool = STRAYS;
        type Key = u32;
        type Want = String;
        type Seen = String;
        type Error = String;

        async fn read(&mut self) -> Result<BTreeMap<u32, Found<String>>, String> {
            if self.fail_read {
                return Err("cannot list".into());
            }
            Ok(self.kernel.clone())
        }

        async fn write(&mut self, key: &u32, want: &String) -> Result<(), String> {
            self.ops.push(format!("write {key}={want}"));
            if self.fail_write.contains(key) {
                return Err(format!("refused {key}"));
            }
            if !self.swallow.contains(key) {
                self.kernel.insert(
                    *key,
                    Found {
                        seen: want.clone(),
                        marked: !self.drop_mark,
                    },
                );
            }
            Ok(())
        }

        async fn remove(&mut self, key: &u32) -> Result<(), String> {
            self.ops.push(format!("remove {key}"));
            if self.fail_remove.contains(key) {
                return Err(format!("cannot remove {key}"));
            }
            self.kernel.remove(key);
            Ok(())
        }

        /// The kernel's copy is exactly what was wanted.
        fn adoptable(&self, want: &String, seen: &String) -> bool {
            want == seen
        }
    }

    type Owning = Fake<true>;
    type Sharing = Fake<false>;

    fn wanted(pairs: &[(u32, &str)]) -> BTreeMap<u32, String> {
        pairs.iter().map(|(k, v)| (*k, (*v).to_string())).collect()
    }

    fn held<B: Backend<Key = u32>>(d: &Driver<B>) -> Vec<u32> {
        d.held().copied().collect()
    }

    fn ours(seen: &str) -> Found<String> {
        Found {
            seen: seen.into(),
            marked: true,
        }
    }

    fn theirs(seen: &str) -> Found<String> {
        Found {
            seen: seen.into(),
            marked: false,
        }
    }

    fn block_on<F: Future>(f: F) -> F::Output {
        tokio::runtime::Builder::new_current_thread()
            .build()
            .expect("a runtime")
            .block_on(f)
    }

    #[test]
    fn creates_what_is_wanted_then_writes_only_differences() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            let out = d.sync(&wanted(&[(1, "a"), (2, "b")])).await;
            assert_eq!(out.written, vec![1, 2]);
            assert!(!out.needs_retry());
            assert_eq!(held(&d), vec![1, 2]);

            // Nothing changed: nothing written.
            d.backend.ops.clear();
            let out = d.sync(&wanted(&[(1, "a"), (2, "b")])).await;
            assert!(out.written.is_empty() && out.removed.is_empty());
            assert!(d.backend.ops.is_empty(), "{:?}", d.backend.ops);

            // One changed, one gone, one new: exactly those.
            let out = d.sync(&wanted(&[(1, "a2"), (3, "c")])).await;
            assert_eq!(out.written, vec![1, 3]);
            assert_eq!(out.removed, vec![2]);
            assert!(out.repaired.is_empty(), "our own change is no repair");
            assert_eq!(d.backend.ops, ["remove 2", "write 1=a2", "write 3=c"]);
            assert_eq!(d.backend.kernel.get(&1), Some(&ours("a2")));
            assert_eq!(held(&d), vec![1, 3]);
        });
    }

    #[test]
    fn each_repair_is_counted_by_the_driver_under_its_backend_s_kind() {
        block_on(async {
            let repairs: Arc<HostRepairs> = Arc::default();
            let mut d = Driver::new(Owning::default(), Arc::clone(&repairs));
            let want = wanted(&[(1, "a"), (2, "b"), (3, "c")]);
            d.sync(&want).await;
            d.backend.kernel.remove(&1);
            d.backend.kernel.insert(2, ours("tampered"));
            d.sync(&want).await;
            // Our own change and an unchanged sync count nothing.
            d.sync(&wanted(&[(1, "a"), (2, "b2"), (3, "c")])).await;
            d.sync(&wanted(&[(1, "a"), (2, "b2"), (3, "c")])).await;
            let counted = repairs.counted();
            assert_eq!(counted, [("announce_route", 2)]);
        });
    }

    #[test]
    fn another_process_s_change_is_repaired_and_reported() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            let want = wanted(&[(1, "a"), (2, "b"), (3, "c")]);
            d.sync(&want).await;
            d.backend.kernel.remove(&1);
            d.backend.kernel.insert(2, ours("tampered"));
            let out = d.sync(&want).await;
            let repaired: Vec<(u32, String)> = out
                .repaired
                .iter()
                .map(|(k, drift)| (*k, drift.to_string()))
                .collect();
            assert_eq!(repaired.len(), 2, "{repaired:?}");
            assert_eq!(repaired[0], (1, "it is gone".to_string()));
            assert_eq!(repaired[1].0, 2);
            assert!(
                repaired[1].1.contains("\"b\"") && repaired[1].1.contains("\"tampered\""),
                "{}",
                repaired[1].1
            );
            assert_eq!(out.written, vec![1, 2]);
            assert_eq!(d.backend.kernel.get(&2), Some(&ours("b")));
            assert_eq!(held(&d), vec![1, 2, 3]);

            // A drifted object no longer wanted is not rewritten.
            d.backend.kernel.remove(&3);
            let out = d.sync(&wanted(&[(1, "a"), (2, "b")])).await;
            assert!(out.repaired.is_empty() && out.written.is_empty());
            assert!(!d.backend.kernel.contains_key(&3));
        });
    }

    #[test]
    fn a_failed_write_is_not_held_and_is_retried() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            d.backend.fail_write.insert(2);
            let want = wanted(&[(1, "a"), (2, "b")]);
            let out = d.sync(&want).await;
            assert!(out.needs_retry());
            assert!(matches!(out.failure(&2), Some(Failure::Write(e)) if e == "refused 2"));
            assert_eq!(held(&d), vec![1]);

            d.backend.fail_write.clear();
            let out = d.sync(&want).await;
            assert_eq!(out.written, vec![2]);
            assert!(!out.needs_retry());
            assert_eq!(held(&d), vec![1, 2]);

            // A change that fails: the older version is still in the
            // kernel, still held, and the change is tried again.
            d.backend.fail_write.insert(1);
            let changed = wanted(&[(1, "a2"), (2, "b")]);
            let out = d.sync(&changed).await;
            assert!(out.failure(&1).is_some());
            assert_eq!(held(&d), vec![1, 2]);
            assert_eq!(d.backend.kernel.get(&1), Some(&ours("a")));
            d.backend.fail_write.clear();
            let out = d.sync(&changed).await;
            assert_eq!(out.written, vec![1]);
            assert_eq!(d.backend.kernel.get(&1), Some(&ours("a2")));
        });
    }

    #[test]
    fn a_write_the_kernel_does_not_keep_is_a_failure() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            d.backend.swallow.insert(1);
            let out = d.sync(&wanted(&[(1, "a")])).await;
            assert!(matches!(out.failure(&1), Some(Failure::Vanished)));
            assert!(
                out.failure(&1)
                    .unwrap()
                    .to_string()
                    .contains("not in the kernel")
            );
            assert_eq!(held(&d), Vec::<u32>::new());
        });
    }

    #[test]
    fn an_unreadable_kernel_holds_nothing_until_read_again() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            let want = wanted(&[(1, "a")]);
            d.sync(&want).await;
            d.backend.fail_read = true;
            let out = d.sync(&want).await;
            assert_eq!(out.unread.as_deref(), Some("cannot list"));
            assert_eq!(
                held(&d),
                Vec::<u32>::new(),
                "not read back: not reported held"
            );
            d.backend.fail_read = false;
            let out = d.sync(&want).await;
            assert!(
                out.written.is_empty() && out.repaired.is_empty(),
                "in place"
            );
            assert_eq!(held(&d), vec![1]);

            // What changed while unreadable is found at the next read.
            d.backend.fail_read = true;
            d.sync(&want).await;
            d.backend.kernel.clear();
            d.backend.fail_read = false;
            let out = d.sync(&want).await;
            assert_eq!(out.repaired.len(), 1);
            assert_eq!(held(&d), vec![1]);
        });
    }

    #[test]
    fn another_program_s_object_is_never_written_over_nor_removed() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            d.backend.kernel.insert(1, theirs("keepalived's"));
            let out = d.sync(&wanted(&[(1, "a"), (2, "b")])).await;
            assert_eq!(out.foreign, vec![(1, "keepalived's".to_string())]);
            assert_eq!(out.written, vec![2]);
            let out = d.sync(&wanted(&[])).await;
            assert_eq!(out.removed, vec![2]);
            let out = d.stop().await;
            assert!(out.removed.is_empty());
            assert_eq!(d.backend.kernel.get(&1), Some(&theirs("keepalived's")));

            // Ours replaced by another program's: reported, left alone.
            d.sync(&wanted(&[(3, "c")])).await;
            d.backend.kernel.insert(3, theirs("hijack"));
            let out = d.sync(&wanted(&[(3, "c")])).await;
            assert_eq!(out.foreign, vec![(3, "hijack".to_string())]);
            assert!(out.repaired.is_empty() && out.written.is_empty());
            assert_eq!(d.backend.kernel.get(&3), Some(&theirs("hijack")));
        });
    }

    #[test]
    fn a_kernel_that_drops_the_mark_still_leaves_ours_ours() {
        block_on(async {
            // Kernels before 5.18 drop an address's protocol: what this
            // process wrote reads back unmarked, and is still its own.
            let mut d = Driver::new(Sharing::default(), Arc::default());
            d.backend.drop_mark = true;
            let out = d.sync(&wanted(&[(1, "a")])).await;
            assert_eq!(out.written, vec![1]);
            assert_eq!(d.backend.kernel.get(&1), Some(&theirs("a")));
            let out = d.sync(&wanted(&[(1, "a")])).await;
            assert!(out.repaired.is_empty() && out.foreign.is_empty());
            assert_eq!(held(&d), vec![1]);
            let out = d.stop().await;
            assert_eq!(out.removed, vec![1]);
        });
    }

    #[test]
    fn a_predecessors_object_exactly_as_wanted_is_adopted_without_a_write() {
        block_on(async {
            let mut d = Driver::new(Owning::default(), Arc::default());
            d.backend.kernel.insert(1, ours("h"));
            d.backend.kernel.insert(2, ours("old"));
            d.backend.kernel.insert(
                3,
                Found {
                    seen: "h".into(),
                    marked: false,
                },
            );
            let out = d.sync(&wanted(&[(1, "h"), (2, "h"), (3, "h")])).await;
            assert_eq!(out.adopted, vec![1], "as wanted: taken, not written");
            assert_eq!(out.written, vec![2], "another value: written");
            assert_eq!(out.foreign.len(), 1, "not marked: never adopted");
            assert_eq!(d.backend.ops, vec!["write 2=h"]);
            assert!(d.holds(&1));
            // Adopted, then changed by another process: repaired as any of ours.
            d.backend.kernel.insert(1, ours("x"));
            let out = d.sync(&wanted(&[(1, "h"), (2, "h")])).await;
            assert_eq!(out.repaired.len(), 1);
            assert_eq!(out.written, vec![1]);
        });
    }

    #[test]
    fn strays_go_only_where_one_daemon_holds_the_keys() {
        block_on(async {
            let mut owning = Driver::new(Owning::default(), Arc::default());
            owning.backend.kernel.insert(7, ours("dead run's"));
            owning.backend.kernel.insert(8, ours("dead run's, wanted"));
            let out = owning.sync(&wanted(&[(8, "h")])).await;
            assert_eq!(out.removed, vec![7]);
            assert_eq!(out.written, vec![8], "adopted and written as wanted");
            assert!(
                out.repaired.is_empty(),
                "a dead run's leftovers are no repair"
            );

            // One that appears later was put there by another process.
            owning.backend.kernel.insert(6, ours("someone's"));
            let out = owning.sync(&wanted(&[(8, "h")])).await;
            assert_eq!(out.removed, vec![6]);
            assert_eq!(out.repaired.len(), 1);
            assert!(
                out.repaired[0].1.to_string().contains("1 not ours"),
                "{}",
                out.repaired[0].1
            );

            let mut sharing = Driver::new(Sharing::default(), Arc::default());
            sharing.backend.kernel.insert(7, ours("another daemon's"));
            sharing
                .backend
                .kernel
                .insert(8, ours("a dead run's, wanted"));
            let out = sharing.sync(&wanted(&[(8, "h")])).await;
            assert!(out.removed.is_empty());
            assert_eq!(out.written, vec![8]);
            let out = sharing.stop().await;
            assert_eq!(out.removed, vec![8]);
            assert!(sharing.backend.kernel.contains_key(&7));

            owning.backend.kernel.insert(9, ours("stray"));
            let out = owning.stop().await;
            assert_eq!(out.removed, vec![8, 9]);
            assert!(owning.backend.kernel.is_empty());
        });
    }

    #[test]
    fn a_failed_removal_stays_held_and_is_retried() {
        block_on(async {
            let mut d = Driver::new(Sharing::default(), Arc::default());
            d.sync(&wanted(&[(1, "a")])).await;
            d.backend.fail_remove.insert(1);
            let out = d.stop().await;
            assert!(matches!(out.failure(&1), Some(Failure::Remove(_))));
            assert_eq!(held(&d), vec![1], "still in the kernel: still reported");
            d.backend.fail_remove.clear();
            let out = d.sync(&wanted(&[])).await;
            assert_eq!(out.removed, vec![1]);
            assert!(d.backend.kernel.is_empty());
        });
    }
}

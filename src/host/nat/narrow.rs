//! Narrowing a write the kernel refused down to the owners (load
//! balancers) whose listeners it refuses, so that one tenant's objects do
//! not cost every other tenant the kernel path.
//!
//! One transaction holds every listener, and nft's JSON errors name no
//! command, so a refused write says nothing of whose objects were refused.
//! The candidates are bisected instead: each half's listeners alone,
//! written as a full table would write them, are checked by the kernel
//! without being committed (`nft --check` runs the batch through the
//! kernel and aborts it), and a half that fails is split again until single
//! owners remain. A half that fits is never looked at again; the whole set
//! is not checked (the refused write was it). With one refused owner among
//! n, that is about 2·log2(n) checks whose sizes add up to about three
//! full transactions; [`MAX_CHECKS`] bounds the work.
//!
//! Nothing here writes a packet's path: the checks commit nothing, and the
//! prelude each one needs ([`super::build::prelude`]: bucket maps and
//! affinity sets, declared empty) changes no packet's path. The caller
//! writes what fits afterwards.

/// The most checks one narrowing runs. Past it, every set still known to
/// fail is refused whole: its owners fall back to the proxy rather than
/// every owner.
pub(super) const MAX_CHECKS: usize = 64;

/// The owners, of `n` (indices `0..n`), that make a write fail, each with
/// the kernel's answer to the smallest set found failing with it in.
/// `fits(set)`: whether those owners' listeners alone are accepted.
/// Empty: none is to blame (each half of the whole fits alone, so what was
/// refused is no owner's objects, or only their sum).
///
/// Below the whole, a failing set whose halves each fit (two owners that
/// fail only together) is refused whole, as is any failing set left when
/// `max_checks` runs out.
pub(super) fn bisect<E: Clone>(
    n: usize,
    max_checks: usize,
    mut fits: impl FnMut(&[usize]) -> Result<(), E>,
) -> Vec<(usize, E)> {
    let mut run = Run {
        checks: 0,
        max_checks,
        refused: Vec::new(),
    };
    let all: Vec<usize> = (0..n).collect();
    run.split(&all, None, &mut fits);
    run.refused.sort_by_key(|(i, _)| *i);
    run.refused
}

/// One narrowing's bookkeeping.
struct Run<E> {
    checks: usize,
    max_checks: usize,
    refused: Vec<(usize, E)>,
}

impl<E: Clone> Run<E> {
    fn check(
        &mut self,
        set: &[usize],
        fits: &mut impl FnMut(&[usize]) -> Result<(), E>,
    ) -> Result<(), E> {
        self.checks += 1;
        fits(set)
    }

    /// `set`, known to fail with `failed` (`None`: the whole, not checked
    /// on its own).
    fn split(
        &mut self,
        set: &[usize],
        failed: Option<E>,
        fits: &mut impl FnMut(&[usize]) -> Result<(), E>,
    ) {
        let refuse_all = |run: &mut Self, e: Option<E>| {
            if let Some(e) = e {
                run.refused.extend(set.iter().map(|&i| (i, e.clone())));
            }
        };
        if set.is_empty() {
            return;
        }
        if self.checks >= self.max_checks {
            return refuse_all(self, failed);
        }
        if set.len() == 1 {
            let failed = match failed {
                Some(e) => Some(e),
                None => self.check(set, fits).err(),
            };
            return refuse_all(self, failed);
        }
        let (a, b) = set.split_at(set.len() / 2);
        let fa = self.check(a, fits).err();
        let fb = if self.checks < self.max_checks {
            self.check(b, fits).err()
        } else {
            // Out of checks, b untried: refused whole rather than left to
            // fail the write of everyone.
            failed.clone().or_else(|| fa.clone())
        };
        if fa.is_none() && fb.is_none() {
            // Each half fits alone: only together, or no owner's fault.
            return refuse_all(self, failed);
        }
        if let Some(e) = fa {
            self.split(a, Some(e), fits);
        }
        if let Some(e) = fb {
            self.split(b, Some(e), fits);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A kernel that refuses any set holding one of `bad`, or all of
    /// `together`.
    fn kernel(bad: &[usize], together: &[usize]) -> impl Fn(&[usize]) -> Result<(), String> {
        let (bad, together) = (bad.to_vec(), together.to_vec());
        move |set: &[usize]| {
            if let Some(b) = set.iter().find(|i| bad.contains(i)) {
                return Err(format!("owner {b}"));
            }
            if !together.is_empty() && together.iter().all(|t| set.contains(t)) {
                return Err("together".into());
            }
            Ok(())
        }
    }

    fn refused(n: usize, max: usize, bad: &[usize], together: &[usize]) -> (Vec<usize>, usize) {
        let k = kernel(bad, together);
        let mut checks = 0;
        let found = bisect(n, max, |set| {
            checks += 1;
            k(set)
        });
        for (i, e) in &found {
            if bad.contains(i) {
                assert_eq!(*e, format!("owner {i}"), "its own error");
            }
        }
        (found.into_iter().map(|(i, _)| i).collect(), checks)
    }

    #[test]
    fn one_refused_owner_among_many_is_found_in_about_two_log_n_checks() {
        let (found, checks) = refused(10_000, MAX_CHECKS, &[6_789], &[]);
        assert_eq!(found, [6_789]);
        assert!(checks <= 2 * 14, "{checks} checks");
        assert_eq!(refused(1, MAX_CHECKS, &[0], &[]).0, [0]);
        assert_eq!(refused(2, MAX_CHECKS, &[1], &[]).0, [1]);
    }

    #[test]
    fn several_refused_owners_are_each_found() {
        assert_eq!(
            refused(500, MAX_CHECKS, &[3, 250, 499], &[]).0,
            [3, 250, 499]
        );
        // All of them.
        assert_eq!(refused(4, MAX_CHECKS, &[0, 1, 2, 3], &[]).0, [0, 1, 2, 3]);
    }

    #[test]
    fn nothing_is_blamed_when_no_owner_is_refused() {
        // The failure was elsewhere (what was deleted, the kernel): each
        // half fits, nobody falls back.
        assert_eq!(refused(100, MAX_CHECKS, &[], &[]), (vec![], 2));
        assert_eq!(refused(1, MAX_CHECKS, &[], &[]), (vec![], 1));
        assert_eq!(refused(0, MAX_CHECKS, &[], &[]), (vec![], 0));
        // Two halves refused only together at the top: not one owner's.
        assert!(refused(100, MAX_CHECKS, &[], &[10, 90]).0.is_empty());
    }

    #[test]
    fn owners_refused_only_together_below_the_top_fall_back_together() {
        let (found, _) = refused(100, MAX_CHECKS, &[], &[10, 11]);
        assert!(found.contains(&10) && found.contains(&11), "{found:?}");
        assert!(found.len() <= 4, "a small set: {found:?}");
    }

    #[test]
    fn the_checks_are_bounded_and_what_is_left_failing_is_refused_whole() {
        let bad = [5, 600];
        let (found, checks) = refused(1000, 6, &bad, &[]);
        assert!(checks <= 6, "{checks}");
        for b in &bad {
            assert!(found.contains(b), "{b} must not stay in: {found:?}");
        }
        assert!(found.len() < 1000, "not every owner");
    }
}

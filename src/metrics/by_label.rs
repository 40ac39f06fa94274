//! Counter families with one counter per value of a label, indexed by an
//! enum of those values instead of a bare number and a comment.
//!
//! `labels!` declares the enum and the label texts together, in one
//! order, so the index a counter is incremented at and the text `/metrics`
//! writes for it cannot drift apart.

use std::marker::PhantomData;
use std::ops::Index;

use super::stats::Counter;

/// The values of one label of a counter family (a reason, a result, a
/// direction), each with its index into the family's counters.
pub trait Label: Copy {
    /// Every value's text, in index order: what `/metrics` writes.
    const NAMES: &'static [&'static str];
    /// This value's index into [`Label::NAMES`] and the counters.
    fn index(self) -> usize;
    /// This value's text, as `/metrics` writes it (and the log names it).
    fn name(self) -> &'static str {
        Self::NAMES[self.index()]
    }
}

/// One counter per value of `L` (`N` is `L::NAMES.len()`, checked when
/// made), read and written by `L` only.
#[derive(Debug)]
pub struct ByLabel<L, const N: usize> {
    counters: [Counter; N],
    label: PhantomData<fn(L)>,
}

impl<L: Label, const N: usize> ByLabel<L, N> {
    /// The counters in index order, beside [`Label::NAMES`].
    pub fn as_slice(&self) -> &[Counter] {
        &self.counters
    }

    /// Each value's text and count, those counted at least once, for
    /// tests that check what was counted where.
    #[cfg(test)]
    pub(crate) fn counted(&self) -> Vec<(&'static str, u64)> {
        L::NAMES
            .iter()
            .zip(&self.counters)
            .map(|(name, c)| (*name, c.get()))
            .filter(|(_, n)| *n > 0)
            .collect()
    }
}

impl<L: Label, const N: usize> Default for ByLabel<L, N> {
    fn default() -> Self {
        const { assert!(L::NAMES.len() == N, "one counter per label value") };
        Self {
            counters: std::array::from_fn(|_| Counter::default()),
            label: PhantomData,
        }
    }
}

impl<L: Label, const N: usize> Index<L> for ByLabel<L, N> {
    type Output = Counter;

    fn index(&self, label: L) -> &Counter {
        &self.counters[label.index()]
    }
}

/// Declares a label's values: an enum, and beside it the const array of
/// their texts (`NAMES`, in the enum's order) that documentation and
/// exposition read.
macro_rules! labels {
    (
        $(#[$meta:meta])*
        pub enum $name:ident;
        $(#[$names_meta:meta])*
        pub const $names:ident = {
            $( $(#[$variant_meta:meta])* $variant:ident = $text:literal ),+ $(,)?
        };
    ) => {
        $(#[$meta])*
        #[derive(Debug, Clone, Copy, PartialEq, Eq)]
        pub enum $name {
            $( $(#[$variant_meta])* $variant ),+
        }

        $(#[$names_meta])*
        pub const $names: [&str; [$($text),+].len()] = [$($text),+];

        impl $crate::metrics::by_label::Label for $name {
            const NAMES: &'static [&'static str] = &$names;
            fn index(self) -> usize {
                self as usize
            }
        }
    };
}
pub(crate) use labels;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::stats::{CHECK_RESULTS, CheckResult, FAILED_REASONS, FailedReason};

    #[test]
    fn a_label_counts_on_the_counter_exposition_names_it_by() {
        let failed: ByLabel<FailedReason, { FAILED_REASONS.len() }> = ByLabel::default();
        failed[FailedReason::ConnectTimeout].increment(2);
        let counted: Vec<(&str, u64)> = FailedReason::NAMES
            .iter()
            .zip(failed.as_slice())
            .map(|(name, c)| (*name, c.get()))
            .collect();
        assert_eq!(
            counted,
            [
                ("no_backend", 0),
                ("connect_refused", 0),
                ("connect_timeout", 2),
                ("connect_error", 0),
            ]
        );
        assert_eq!(
            CHECK_RESULTS[CheckResult::HttpStatus.index()],
            "http_status"
        );
    }
}

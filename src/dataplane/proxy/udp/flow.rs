//! The life of one UDP flow as one atomic word, so the listener (sending a
//! client's datagram) and the flow's task (receiving the backend's answers,
//! timing out) never disagree about whether the flow is still open.
//!
//! The rule that matters: once a flow is closed, no datagram is sent on it.
//! Otherwise an answer would come back to a socket already gone, and the
//! client would lose it. So the listener *opens a send* with a
//! compare-and-swap that fails on a closed flow (it then makes a new flow),
//! and the task closes with a compare-and-swap that fails if a send was
//! opened since it looked. Whoever wins the close retires the flow, once.

use std::sync::atomic::{AtomicU64, Ordering};

/// Set when the flow is closed; nothing changes after.
const CLOSED: u64 = 1 << 63;
/// The send sequence (bits 32..63): bumped by every send, so a close
/// decided before a send fails its compare-and-swap.
const SEQ_ONE: u64 = 1 << 32;
const SEQ_MASK: u64 = !CLOSED & !OUTSTANDING_MASK;
/// Answers still expected (bits 0..32), with `udp_responses` set.
const OUTSTANDING_MASK: u64 = 0xFFFF_FFFF;

/// A flow's open/closed state, send sequence and outstanding answers.
#[derive(Debug, Default)]
pub struct FlowState(AtomicU64);

impl FlowState {
    /// Opens one send of a client datagram expecting `answers` answers
    /// (0 without `udp_responses`). `false`: the flow is closed; make a new one.
    pub fn begin_send(&self, answers: u32) -> bool {
        self.0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                if v & CLOSED != 0 {
                    return None;
                }
                let seq = (v & SEQ_MASK).wrapping_add(SEQ_ONE) & SEQ_MASK;
                let out = (v & OUTSTANDING_MASK)
                    .saturating_add(u64::from(answers))
                    .min(OUTSTANDING_MASK);
                Some(seq | out)
            })
            .is_ok()
    }

    /// Records one answer from the backend. With `close_when_answered`
    /// (`udp_responses` set), the answer that leaves none outstanding closes
    /// the flow: returns `true` exactly then, and the caller retires it.
    pub fn answered(&self, close_when_answered: bool) -> bool {
        let mut closed_it = false;
        let _ = self
            .0
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
                closed_it = false;
                if v & CLOSED != 0 {
                    return None;
                }
                let out = (v & OUTSTANDING_MASK).saturating_sub(1);
                if close_when_answered && out == 0 {
                    closed_it = true;
                    Some(CLOSED)
                } else {
                    Some((v & !OUTSTANDING_MASK) | out)
                }
            });
        closed_it
    }

    /// The word now, for [`close_if_unchanged`](Self::close_if_unchanged).
    pub fn observe(&self) -> u64 {
        self.0.load(Ordering::Acquire)
    }

    /// Closes the flow if nothing was sent or answered since `observed`
    /// (the idle timeout). Returns whether this call closed it.
    pub fn close_if_unchanged(&self, observed: u64) -> bool {
        observed & CLOSED == 0
            && self
                .0
                .compare_exchange(observed, CLOSED, Ordering::AcqRel, Ordering::Acquire)
                .is_ok()
    }

    /// Closes the flow whatever its state (re-pick, listener stopped).
    /// Returns whether this call closed it.
    pub fn close(&self) -> bool {
        self.0.swap(CLOSED, Ordering::AcqRel) & CLOSED == 0
    }

    /// Whether it is closed.
    pub fn is_closed(&self) -> bool {
        self.0.load(Ordering::Acquire) & CLOSED != 0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_answer_per_datagram_closes_only_when_all_are_answered() {
        let s = FlowState::default();
        assert!(s.begin_send(1));
        assert!(s.begin_send(1));
        assert!(!s.answered(true), "one query still waits for its answer");
        assert!(s.answered(true), "the last answer closes the flow");
        assert!(s.is_closed());
        assert!(!s.begin_send(1), "nothing is sent on a closed flow");
        assert!(!s.answered(true) && !s.close(), "closed once only");
    }

    #[test]
    fn an_idle_close_loses_to_a_send_that_came_after_it_looked() {
        let s = FlowState::default();
        assert!(s.begin_send(0));
        let seen = s.observe();
        assert!(s.begin_send(0), "a datagram arrives while the timer fires");
        assert!(!s.close_if_unchanged(seen));
        assert!(!s.is_closed());
        let seen = s.observe();
        assert!(s.close_if_unchanged(seen));
        assert!(!s.begin_send(0));
    }

    #[test]
    fn without_udp_responses_answers_never_close() {
        let s = FlowState::default();
        assert!(s.begin_send(0));
        for _ in 0..5 {
            assert!(!s.answered(false));
        }
        assert!(!s.is_closed());
        assert!(s.close());
        assert!(!s.close());
    }

    #[test]
    fn an_unsolicited_answer_does_not_underflow() {
        let s = FlowState::default();
        assert!(!s.answered(false));
        assert!(s.begin_send(2));
        assert!(!s.answered(true));
        assert!(s.answered(true));
    }

    #[test]
    fn the_sequence_wraps_without_touching_the_other_fields() {
        let s = FlowState(AtomicU64::new(SEQ_MASK | 3));
        assert!(s.begin_send(1));
        let v = s.observe();
        assert_eq!(v & CLOSED, 0);
        assert_eq!(v & OUTSTANDING_MASK, 4);
    }
}

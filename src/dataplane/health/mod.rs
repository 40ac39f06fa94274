//! Active health checking: what a probe is ([`check`]), when probes run
//! ([`prober`]), and how results become a verdict ([`HealthState`]).
//!
//! The verdict is a small pure state machine with consecutive counters, as in
//! sozu and Pingora: thresholds in, transition out. Only transitions are
//! logged and counted; the prober then flips the backend and republishes the
//! load balancer's snapshot.

pub mod check;
pub mod prober;

use std::fmt;
use std::num::NonZeroU32;

use serde::Serialize;

use crate::config::InitialState;

/// Whether a backend takes new connections.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Health {
    /// Eligible.
    Healthy,
    /// Not eligible; open connections continue.
    Unhealthy,
}

impl fmt::Display for Health {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Health::Healthy => "healthy",
            Health::Unhealthy => "unhealthy",
        })
    }
}

/// Thresholds of the state machine (Harvester's `healthcheck-*-threshold`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Thresholds {
    /// Consecutive successes that make an unhealthy backend healthy.
    pub success: NonZeroU32,
    /// Consecutive failures that make a healthy backend unhealthy.
    pub failure: NonZeroU32,
}

/// A change of verdict.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Transition {
    /// The state before.
    pub from: Health,
    /// The state after.
    pub to: Health,
}

/// The verdict on one backend and the run of results behind it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct HealthState {
    /// The verdict.
    pub status: Health,
    /// Successes in a row, reset by a failure.
    pub consecutive_successes: u32,
    /// Failures in a row, reset by a success.
    pub consecutive_failures: u32,
}

impl HealthState {
    /// The state of a backend that has not been probed yet.
    pub fn new(initial: InitialState) -> Self {
        Self {
            status: match initial {
                InitialState::Healthy => Health::Healthy,
                InitialState::Unhealthy => Health::Unhealthy,
            },
            consecutive_successes: 0,
            consecutive_failures: 0,
        }
    }

    /// Records one probe result; returns the transition if the verdict flipped.
    pub fn observe(&mut self, success: bool, thresholds: Thresholds) -> Option<Transition> {
        let from = self.status;
        if success {
            self.consecutive_successes = self.consecutive_successes.saturating_add(1);
            self.consecutive_failures = 0;
            if from == Health::Unhealthy && self.consecutive_successes >= thresholds.success.get() {
                self.status = Health::Healthy;
            }
        } else {
            self.consecutive_failures = self.consecutive_failures.saturating_add(1);
            self.consecutive_successes = 0;
            if from == Health::Healthy && self.consecutive_failures >= thresholds.failure.get() {
                self.status = Health::Unhealthy;
            }
        }
        (self.status != from).then_some(Transition {
            from,
            to: self.status,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(success: u32, failure: u32) -> Thresholds {
        Thresholds {
            success: NonZeroU32::new(success).unwrap(),
            failure: NonZeroU32::new(failure).unwrap(),
        }
    }

    #[test]
    fn goes_down_after_exactly_failure_threshold_failures() {
        let mut s = HealthState::new(InitialState::Healthy);
        assert_eq!(s.observe(false, t(1, 3)), None);
        assert_eq!(s.observe(false, t(1, 3)), None);
        assert_eq!(
            s.observe(false, t(1, 3)),
            Some(Transition {
                from: Health::Healthy,
                to: Health::Unhealthy
            })
        );
        assert_eq!(s.observe(false, t(1, 3)), None, "only the flip is reported");
    }

    #[test]
    fn a_success_resets_the_failure_run() {
        let mut s = HealthState::new(InitialState::Healthy);
        for _ in 0..10 {
            assert_eq!(s.observe(false, t(1, 3)), None);
            assert_eq!(s.observe(false, t(1, 3)), None);
            assert_eq!(s.observe(true, t(1, 3)), None);
        }
        assert_eq!(s.status, Health::Healthy);
    }

    #[test]
    fn comes_back_after_exactly_success_threshold_successes() {
        let mut s = HealthState::new(InitialState::Unhealthy);
        assert_eq!(s.observe(true, t(2, 3)), None);
        assert_eq!(s.observe(false, t(2, 3)), None);
        assert_eq!(s.observe(true, t(2, 3)), None);
        assert_eq!(
            s.observe(true, t(2, 3)),
            Some(Transition {
                from: Health::Unhealthy,
                to: Health::Healthy
            })
        );
        assert_eq!(s.consecutive_successes, 2);
    }

    #[test]
    fn initial_state_is_the_configured_one() {
        assert_eq!(
            HealthState::new(InitialState::Healthy).status,
            Health::Healthy
        );
        assert_eq!(
            HealthState::new(InitialState::Unhealthy).status,
            Health::Unhealthy
        );
    }
}

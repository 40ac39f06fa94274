//! Whether one VIP should be announced now: a pure type with hysteresis,
//! fed the VIP's conditions and the time, returning transitions.
//!
//! Rules (issue 22): a VIP is announced only after its conditions have held
//! for the rise delay; it is withdrawn at once when they fail; and a VIP
//! that keeps being withdrawn for failing health waits longer each time
//! (damping), because every announce and withdraw moves flows at the
//! router. An operator's drain and a stopping daemon withdraw too, but are
//! not damped: they are meant.
//!
//! Time is `tokio::time::Instant`, so tests run on a paused clock.

use std::time::Duration;

use tokio::time::Instant;

/// A VIP withdrawn for failing health less than this after it was
/// announced raises its damping level; one that stays announced this long
/// is forgiven (level 0).
pub const DAMP_WINDOW: Duration = Duration::from_secs(60);
/// At most 2^3 = 8 × the rise delay.
pub const MAX_DAMP_LEVEL: u32 = 3;
/// The smallest delay damping doubles (a rise delay of 0 is still damped).
const MIN_DAMPED_BASE: Duration = Duration::from_secs(1);

/// Why a VIP's conditions do not hold.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Blocker {
    /// No listener of the VIP is bound with an eligible backend.
    NoEligibleBackend,
    /// The operator drained the VIP or the host.
    Drained,
    /// The daemon is stopping.
    Stopping,
}

/// Why a VIP is not announced now (`/status`, the reason gauge).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Reason {
    /// No listener of the VIP is bound with an eligible backend.
    NoEligibleBackend,
    /// Drained by the operator (the VIP or the whole host).
    Drained,
    /// The daemon is stopping.
    Stopping,
    /// Conditions hold; the rise delay, lengthened by damping, runs.
    Damped,
    /// Conditions hold; the rise delay runs.
    Waiting,
}

impl Reason {
    /// Every reason, in the order the metrics list them.
    pub const ALL: [Reason; 5] = [
        Reason::NoEligibleBackend,
        Reason::Drained,
        Reason::Stopping,
        Reason::Damped,
        Reason::Waiting,
    ];

    /// The name in `/status` and the metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Reason::NoEligibleBackend => "no_eligible_backend",
            Reason::Drained => "drained",
            Reason::Stopping => "stopping",
            Reason::Damped => "damped",
            Reason::Waiting => "waiting",
        }
    }
}

impl From<Blocker> for Reason {
    fn from(b: Blocker) -> Self {
        match b {
            Blocker::NoEligibleBackend => Reason::NoEligibleBackend,
            Blocker::Drained => Reason::Drained,
            Blocker::Stopping => Reason::Stopping,
        }
    }
}

/// A change of the decision.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transition {
    /// Write the route.
    Announce,
    /// Delete the route, for this reason.
    Withdraw(Blocker),
}

/// One VIP's decision over time. Starts withdrawn: a start (or a VIP new in
/// the file) waits the full rise delay.
#[derive(Debug, Clone)]
pub struct Hysteresis {
    announced: bool,
    /// Since when the conditions hold (`None`: they do not).
    holding_since: Option<Instant>,
    /// What blocks them now.
    blocker: Option<Blocker>,
    /// Doublings of the rise delay now in force.
    damp_level: u32,
    /// Announces plus withdrawals.
    transitions: u64,
    /// When `announced` last changed (or the start).
    since: Instant,
}

impl Hysteresis {
    /// Withdrawn, conditions not yet seen.
    pub fn new(now: Instant) -> Self {
        Self {
            announced: false,
            holding_since: None,
            blocker: Some(Blocker::NoEligibleBackend),
            damp_level: 0,
            transitions: 0,
            since: now,
        }
    }

    /// Announced already: a route the previous process handed over
    /// (issue 41), kept while the conditions hold and withdrawn at once
    /// when they fail, as if this process had announced it.
    pub fn adopted(now: Instant) -> Self {
        Self {
            announced: true,
            holding_since: Some(now),
            blocker: None,
            damp_level: 0,
            transitions: 0,
            since: now,
        }
    }

    /// Whether the decision is "announced".
    pub fn announced(&self) -> bool {
        self.announced
    }

    /// Announces plus withdrawals so far.
    pub fn transitions(&self) -> u64 {
        self.transitions
    }

    /// When the decision last changed.
    pub fn since(&self) -> Instant {
        self.since
    }

    /// The damping level now (0: none).
    pub fn damp_level(&self) -> u32 {
        self.damp_level
    }

    /// The rise delay in force for `base`: doubled per damping level.
    pub fn rise_delay(&self, base: Duration) -> Duration {
        if self.damp_level == 0 {
            base
        } else {
            base.max(MIN_DAMPED_BASE) * (1 << self.damp_level)
        }
    }

    /// Feeds the conditions at `now` (`Ok`: they hold); returns the
    /// transition to make, if any. `base` is the VIP's rise delay.
    pub fn observe(
        &mut self,
        now: Instant,
        conditions: Result<(), Blocker>,
        base: Duration,
    ) -> Option<Transition> {
        // Announced for a whole window: damping is forgotten.
        let stayed = now.saturating_duration_since(self.since) >= DAMP_WINDOW;
        if self.announced && stayed {
            self.damp_level = 0;
        }
        match conditions {
            Err(blocker) => {
                self.holding_since = None;
                self.blocker = Some(blocker);
                if !self.announced {
                    return None;
                }
                self.announced = false;
                self.transitions += 1;
                self.since = now;
                if blocker == Blocker::NoEligibleBackend && !stayed {
                    self.damp_level = (self.damp_level + 1).min(MAX_DAMP_LEVEL);
                }
                Some(Transition::Withdraw(blocker))
            }
            Ok(()) => {
                self.blocker = None;
                if self.announced {
                    return None;
                }
                let since = *self.holding_since.get_or_insert(now);
                if now.saturating_duration_since(since) < self.rise_delay(base) {
                    return None;
                }
                self.announced = true;
                self.transitions += 1;
                self.since = now;
                Some(Transition::Announce)
            }
        }
    }

    /// When [`Hysteresis::observe`] should be called again at the latest
    /// (the rise delay ends), if a time matters.
    pub fn deadline(&self, base: Duration) -> Option<Instant> {
        match (self.announced, self.holding_since) {
            (false, Some(since)) => Some(since + self.rise_delay(base)),
            _ => None,
        }
    }

    /// Why the VIP is not announced; `None` while it is.
    pub fn reason(&self) -> Option<Reason> {
        if self.announced {
            return None;
        }
        Some(match self.blocker {
            Some(b) => b.into(),
            None if self.damp_level > 0 => Reason::Damped,
            None => Reason::Waiting,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::time::advance;

    const BASE: Duration = Duration::from_secs(3);

    /// Feeds `conditions` now; returns the transition.
    fn at(h: &mut Hysteresis, conditions: Result<(), Blocker>) -> Option<Transition> {
        h.observe(Instant::now(), conditions, BASE)
    }

    #[tokio::test(start_paused = true)]
    async fn announces_only_after_the_conditions_held_for_the_delay() {
        let mut h = Hysteresis::new(Instant::now());
        assert_eq!(h.reason(), Some(Reason::NoEligibleBackend));
        assert_eq!(at(&mut h, Ok(())), None);
        assert_eq!(h.reason(), Some(Reason::Waiting));
        assert_eq!(h.deadline(BASE), Some(Instant::now() + BASE));
        advance(BASE - Duration::from_millis(1)).await;
        assert_eq!(at(&mut h, Ok(())), None);
        advance(Duration::from_millis(1)).await;
        assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
        assert!(h.announced());
        assert_eq!(h.reason(), None);
        assert_eq!(h.deadline(BASE), None);
        assert_eq!(at(&mut h, Ok(())), None, "announced once");
        assert_eq!(h.transitions(), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_blip_restarts_the_rise_delay() {
        let mut h = Hysteresis::new(Instant::now());
        at(&mut h, Ok(()));
        advance(Duration::from_secs(2)).await;
        assert_eq!(at(&mut h, Err(Blocker::NoEligibleBackend)), None);
        at(&mut h, Ok(()));
        advance(Duration::from_secs(2)).await;
        assert_eq!(at(&mut h, Ok(())), None, "held 2 s of 3 since the blip");
        advance(Duration::from_secs(1)).await;
        assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
    }

    #[tokio::test(start_paused = true)]
    async fn a_route_adopted_after_a_hand_over_stays_announced_and_withdraws_at_once() {
        let now = Instant::now();
        let mut h = Hysteresis::adopted(now);
        assert!(h.announced(), "no rise delay: it was announced before");
        assert_eq!(h.observe(now, Ok(()), BASE), None, "kept: nothing to write");
        assert_eq!(h.deadline(BASE), None);
        assert_eq!(
            h.observe(now, Err(Blocker::NoEligibleBackend), BASE),
            Some(Transition::Withdraw(Blocker::NoEligibleBackend)),
            "its conditions fail: withdrawn at once, as any announced VIP"
        );
    }

    #[tokio::test(start_paused = true)]
    async fn withdraws_at_once_with_the_reason() {
        let mut h = Hysteresis::new(Instant::now());
        at(&mut h, Ok(()));
        advance(BASE).await;
        assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
        for blocker in [
            Blocker::Drained,
            Blocker::Stopping,
            Blocker::NoEligibleBackend,
        ] {
            // Announced for longer than the damping window: not a flap.
            advance(DAMP_WINDOW).await;
            assert_eq!(
                at(&mut h, Err(blocker)),
                Some(Transition::Withdraw(blocker))
            );
            assert_eq!(h.reason(), Some(blocker.into()));
            assert_eq!(at(&mut h, Err(blocker)), None, "withdrawn once");
            at(&mut h, Ok(()));
            advance(BASE).await;
            assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
        }
        assert_eq!(h.transitions(), 7);
    }

    #[tokio::test(start_paused = true)]
    async fn repeated_health_withdrawals_are_damped_up_to_eight_times() {
        let mut h = Hysteresis::new(Instant::now());
        at(&mut h, Ok(()));
        advance(BASE).await;
        assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
        // Flap: each withdrawal within the window after an announce
        // doubles the next rise.
        let mut expected = [BASE * 2, BASE * 4, BASE * 8, BASE * 8].into_iter();
        for round in 0..4 {
            let want = expected.next().unwrap();
            assert!(at(&mut h, Err(Blocker::NoEligibleBackend)).is_some());
            assert_eq!(h.rise_delay(BASE), want, "round {round}");
            at(&mut h, Ok(()));
            assert_eq!(h.reason(), Some(Reason::Damped));
            advance(want - Duration::from_millis(1)).await;
            assert_eq!(at(&mut h, Ok(())), None, "round {round}: still damped");
            advance(Duration::from_millis(1)).await;
            assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
        }
        assert_eq!(h.damp_level(), MAX_DAMP_LEVEL);
        // A window announced forgets it: the next failure is a first one.
        advance(DAMP_WINDOW).await;
        assert_eq!(at(&mut h, Ok(())), None);
        assert_eq!(h.damp_level(), 0);
        assert!(at(&mut h, Err(Blocker::NoEligibleBackend)).is_some());
        assert_eq!(h.rise_delay(BASE), BASE);
        assert_eq!(h.reason(), Some(Reason::NoEligibleBackend));
        at(&mut h, Ok(()));
        assert_eq!(h.reason(), Some(Reason::Waiting));
    }

    /// docs/vip.md, "When a VIP comes back": time spent withdrawn forgives
    /// nothing; only 60 s announced does.
    #[tokio::test(start_paused = true)]
    async fn damping_is_not_forgiven_while_withdrawn() {
        let mut h = Hysteresis::new(Instant::now());
        at(&mut h, Ok(()));
        advance(BASE).await;
        assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
        advance(Duration::from_secs(2)).await;
        assert!(at(&mut h, Err(Blocker::NoEligibleBackend)).is_some());
        advance(Duration::from_secs(600)).await;
        assert_eq!(at(&mut h, Err(Blocker::NoEligibleBackend)), None);
        at(&mut h, Ok(()));
        assert_eq!(h.reason(), Some(Reason::Damped));
        assert_eq!(h.rise_delay(BASE), BASE * 2);
        assert_eq!(h.deadline(BASE), Some(Instant::now() + BASE * 2));
    }

    #[tokio::test(start_paused = true)]
    async fn operator_drains_and_stops_are_not_damped() {
        let mut h = Hysteresis::new(Instant::now());
        for _ in 0..4 {
            at(&mut h, Ok(()));
            advance(BASE).await;
            assert_eq!(at(&mut h, Ok(())), Some(Transition::Announce));
            assert!(at(&mut h, Err(Blocker::Drained)).is_some());
            assert_eq!(h.rise_delay(BASE), BASE);
        }
        assert_eq!(h.reason(), Some(Reason::Drained));
    }

    #[tokio::test(start_paused = true)]
    async fn a_zero_delay_announces_at_once_and_damping_still_waits() {
        let mut h = Hysteresis::new(Instant::now());
        let zero = Duration::ZERO;
        assert_eq!(
            h.observe(Instant::now(), Ok(()), zero),
            Some(Transition::Announce)
        );
        h.observe(Instant::now(), Err(Blocker::NoEligibleBackend), zero);
        assert_eq!(h.rise_delay(zero), Duration::from_secs(2));
        assert_eq!(h.observe(Instant::now(), Ok(()), zero), None);
    }
}

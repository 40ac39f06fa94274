//! Rate limits on log lines that one cause can repeat thousands of times a
//! second (2,000 listeners that cannot bind, retried every 2 s; a
//! connection cap hit at every accept).
//!
//! Per cause (a key), a window allows a few lines; the rest of the window
//! is counted, not written, and the first line of a later window says how
//! many were left out, so the operator sees every cause and its scale
//! without the journal filling. It never blocks: one short lock per call.

use std::collections::HashMap;
use std::hash::Hash;
use std::sync::Mutex;
use std::time::Duration;

use tokio::time::Instant;

/// Lines allowed per cause and window, and the window.
#[derive(Debug)]
pub struct LogLimit<K> {
    burst: u32,
    window: Duration,
    causes: Mutex<HashMap<K, Window>>,
}

#[derive(Debug)]
struct Window {
    started: Instant,
    written: u32,
    suppressed: u64,
}

/// What to do with one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Write it; `suppressed` lines of this cause were left out since the
    /// last one written (say so in the line when not 0).
    Write {
        /// Lines of this cause left out before this one.
        suppressed: u64,
    },
    /// Leave it out (counted for the next line written).
    Quiet,
}

impl<K: Hash + Eq> LogLimit<K> {
    /// At most `burst` lines per cause every `window`.
    pub fn new(burst: u32, window: Duration) -> Self {
        Self {
            burst: burst.max(1),
            window,
            causes: Mutex::new(HashMap::new()),
        }
    }

    /// Whether a line of `cause` may be written now.
    pub fn check(&self, cause: K) -> Verdict {
        let now = Instant::now();
        let mut causes = self.causes.lock().unwrap_or_else(|p| p.into_inner());
        // Causes quiet for a whole window are forgotten, so the map stays
        // as small as the set of causes seen recently.
        if causes.len() > 64 {
            let window = self.window;
            causes.retain(|_, w| now.duration_since(w.started) < window || w.suppressed > 0);
        }
        let w = causes.entry(cause).or_insert(Window {
            started: now,
            written: 0,
            suppressed: 0,
        });
        if now.duration_since(w.started) >= self.window {
            w.started = now;
            w.written = 0;
        }
        if w.written < self.burst {
            w.written += 1;
            Verdict::Write {
                suppressed: std::mem::take(&mut w.suppressed),
            }
        } else {
            w.suppressed += 1;
            Verdict::Quiet
        }
    }
}

/// ` (N similar lines left out …)` when `suppressed` is not 0: the tail of
/// a rate-limited line.
pub fn left_out(suppressed: u64) -> String {
    if suppressed == 0 {
        String::new()
    } else {
        format!(" ({suppressed} similar lines left out since the last one)")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test(start_paused = true)]
    async fn a_burst_per_cause_then_a_count_in_the_next_window() {
        let limit = LogLimit::new(2, Duration::from_secs(30));
        assert_eq!(limit.check("a"), Verdict::Write { suppressed: 0 });
        assert_eq!(limit.check("a"), Verdict::Write { suppressed: 0 });
        for _ in 0..1000 {
            assert_eq!(limit.check("a"), Verdict::Quiet);
        }
        // Another cause is not held back by the first.
        assert_eq!(limit.check("b"), Verdict::Write { suppressed: 0 });
        tokio::time::advance(Duration::from_secs(30)).await;
        assert_eq!(limit.check("a"), Verdict::Write { suppressed: 1000 });
        assert_eq!(limit.check("a"), Verdict::Write { suppressed: 0 });
        assert_eq!(limit.check("a"), Verdict::Quiet);
    }
}

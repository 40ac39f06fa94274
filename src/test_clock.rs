//! Test help for code on tokio's paused clock (`start_paused = true`):
//! waiting for real sockets without letting the clock move.

use std::time::Duration;

/// Runs the runtime until `done`, without moving the paused clock: a yield
/// polls the sockets but never advances time (a task that waits on a timer
/// would let tokio jump the clock to it, firing timeouts while a loopback
/// byte is still in flight). Short real pauses let the kernel's side land.
/// At most `rounds` rounds of a millisecond or more; whether `done` held.
pub(crate) async fn run_until(rounds: u32, mut done: impl FnMut() -> bool) -> bool {
    for _ in 0..rounds {
        if done() {
            return true;
        }
        tokio::task::yield_now().await;
        std::thread::sleep(Duration::from_millis(1));
    }
    done()
}

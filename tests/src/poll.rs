//! Waiting on an event, bounded: [`until`] for blocking code, [`eventually`]
//! from an async test. Both look at once, then at an interval, and give up
//! after a timeout; the caller says what it waited for and what it saw.

use std::time::{Duration, Instant};

/// Calls `look` every `every` until it gives a value; `None` when a look
/// that ends after `timeout` still gave none (at least one look is made).
/// A `look` that must stop the wait early (the awaited process exited)
/// gives `Some(Err(..))`.
pub fn until<T>(
    timeout: Duration,
    every: Duration,
    mut look: impl FnMut() -> Option<T>,
) -> Option<T> {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = look() {
            return Some(value);
        }
        if Instant::now() >= deadline {
            return None;
        }
        std::thread::sleep(every);
    }
}

/// Polls `check` every 100 ms until it yields, at most `timeout`; panics
/// with `what` and `context()` (the agent's log, say). For
/// `#[tokio::test(flavor = "multi_thread")]` tests: `check` runs under
/// `block_in_place`, so it may run commands or read files.
pub async fn eventually<T>(
    what: &str,
    timeout: Duration,
    mut check: impl FnMut() -> Option<T>,
    context: impl Fn() -> String,
) -> T {
    let deadline = Instant::now() + timeout;
    loop {
        if let Some(value) = tokio::task::block_in_place(&mut check) {
            return value;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: not within {timeout:?}\n{}",
            context()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

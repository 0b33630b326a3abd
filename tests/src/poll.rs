//! Waiting on an event from an async test: a blocking check polled on the
//! runtime's blocking-aware path, bounded, failing with what was seen.

use std::time::{Duration, Instant};

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

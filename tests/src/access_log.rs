//! The agent's access log as tests read it: one JSON line per connection
//! (`target` `shunt::access`), written once both sides closed.

use std::time::Duration;

use serde_json::Value;

use crate::{agent::Agent, poll::until};

/// How long an access-log line may take to appear.
const TIMEOUT: Duration = Duration::from_secs(30);

/// The access-log lines (JSON logs) of `direction`.
pub fn access_lines(logs: &str, direction: &str) -> Vec<Value> {
    logs.lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["target"] == "shunt::access" && l["fields"]["direction"] == direction)
        .collect()
}

/// Waits (bounded) for an access-log line of `direction` that `matches`:
/// the proxy writes it once both sides closed, which may be just after the
/// client has its answer. Panics with the lines seen.
pub fn wait_for_access_line(
    agent: &Agent,
    direction: &str,
    what: &str,
    matches: impl Fn(&Value) -> bool,
) {
    let found = until(TIMEOUT, Duration::from_millis(100), || {
        access_lines(&agent.logs(), direction)
            .iter()
            .any(&matches)
            .then_some(())
    });
    assert!(
        found.is_some(),
        "no {direction} access-log line: {what}; seen: {:?}",
        access_lines(&agent.logs(), direction)
    );
}

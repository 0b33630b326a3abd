//! Reading an agent's Prometheus exposition in kernel tests: one metric's
//! samples, and a bounded wait until the metrics say something.

use std::time::Duration;

use crate::{
    Node,
    agent::{Agent, http},
    poll::until,
};

/// How long [`wait_metrics`] waits.
const TIMEOUT: Duration = Duration::from_secs(30);

/// The sum of the samples of `name` carrying every label of `labels`
/// (`None`: no such sample).
pub fn sample(text: &str, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut found = None;
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(name) else {
            continue;
        };
        let (label_part, value) = match rest.strip_prefix('{') {
            Some(rest) => match rest.rsplit_once("} ") {
                Some(pair) => pair,
                None => continue,
            },
            None => match rest.strip_prefix(' ') {
                Some(value) => ("", value),
                None => continue,
            },
        };
        if labels
            .iter()
            .all(|(k, v)| label_part.contains(&format!("{k}=\"{v}\"")))
            && let Ok(value) = value.trim().parse::<f64>()
        {
            *found.get_or_insert(0.0) += value;
        }
    }
    found
}

/// `GET /metrics` of `agent`, from inside `node`'s netns.
pub fn metrics(node: &Node, agent: &Agent) -> String {
    let port = agent.endpoints().metrics.port();
    let (code, body) = http(node, "GET", port, "/metrics").expect("GET /metrics");
    assert_eq!(code, 200, "{body}");
    body
}

/// Polls the agent's metrics until `done` holds for them (bounded: fails
/// with the metrics and the agent's log).
pub fn wait_metrics(node: &Node, agent: &Agent, what: &str, done: impl Fn(&str) -> bool) -> String {
    let text = until(TIMEOUT, Duration::from_millis(100), || {
        Some(metrics(node, agent)).filter(|text| done(text))
    });
    text.unwrap_or_else(|| {
        panic!(
            "timed out waiting for {what}; metrics:\n{}\nagent log:\n{}",
            metrics(node, agent),
            agent.logs()
        )
    })
}

//! The proof: the client curls the server, and the agents' own counters
//! (`shunt status --json`) and metrics show the requests went through
//! HBONE; then how to look around.

use std::{
    collections::BTreeMap,
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};

use super::{
    AGENT_NAMESPACE, CLUSTER, CONTEXT, DEMO_NAMESPACE, REQUESTS, SERVER_PORT,
    agents::agent_pods,
    kubectl::{kubectl, show, shunt_in},
    samples::SamplePod,
};
use crate::util;

/// The agent's proxy counters (`shunt status --json`, field `proxy`).
fn proxy_counter(agent: &str, field: &str) -> anyhow::Result<u64> {
    let status = util::stdout(shunt_in(agent).args(["status", "--json"]))?;
    json_u64(&status, field).with_context(|| {
        format!(
            "agent {agent}: `shunt status --json` has no proxy counter {field} (is --capture=off in deploy/base/daemonset.yaml's args?)"
        )
    })
}

/// The number after `"key":` in a JSON text (the status is flat enough for
/// this; xtask has no JSON parser).
fn json_u64(text: &str, key: &str) -> Option<u64> {
    let quoted = format!("\"{key}\"");
    let at = text.find(&quoted)? + quoted.len();
    let rest = text[at..].trim_start().strip_prefix(':')?.trim_start();
    let digits: String = rest.chars().take_while(char::is_ascii_digit).collect();
    digits.parse().ok()
}

/// Curls the server's pod IP from the client, then checks that the
/// client's node's proxy sent them as HBONE and the server's node's proxy
/// received them as HBONE. Returns the agent pods by node.
pub(super) fn check_hbone(
    client: &SamplePod,
    server: &SamplePod,
) -> anyhow::Result<BTreeMap<String, String>> {
    let agents = agent_pods()?;
    let agent_of = |node: &str| {
        agents
            .get(node)
            .cloned()
            .with_context(|| format!("no agent pod on node {node}"))
    };
    let (client_agent, server_agent) = (agent_of(&client.node)?, agent_of(&server.node)?);
    let out_before = proxy_counter(&client_agent, "outbound_hbone")?;
    let passthrough_before = proxy_counter(&client_agent, "outbound_passthrough")?;
    let in_before = proxy_counter(&server_agent, "inbound_hbone")?;

    let url = format!("http://{}:{SERVER_PORT}/hostname", server.ip);
    for i in 1..=REQUESTS {
        let answer = util::stdout(kubectl().args([
            "exec",
            "-n",
            DEMO_NAMESPACE,
            &client.name,
            "-c",
            "client",
            "--",
            "curl",
            "-sS",
            "--max-time",
            "10",
            &url,
        ]))?;
        eprintln!("    {} $ curl {url} → {answer}", client.name);
        if answer != server.name {
            bail!(
                "request {i} answered {answer:?}; the server pod is {}",
                server.name
            );
        }
    }

    // The proxy counts a connection as it is set up; allow a moment anyway.
    let deadline = Instant::now() + Duration::from_secs(10);
    let (out, passthrough, inbound) = loop {
        // Saturating: an agent that restarted meanwhile starts from zero.
        let out = proxy_counter(&client_agent, "outbound_hbone")?.saturating_sub(out_before);
        let passthrough = proxy_counter(&client_agent, "outbound_passthrough")?
            .saturating_sub(passthrough_before);
        let inbound = proxy_counter(&server_agent, "inbound_hbone")?.saturating_sub(in_before);
        if (out >= REQUESTS && inbound >= REQUESTS) || Instant::now() > deadline {
            break (out, passthrough, inbound);
        }
        thread::sleep(Duration::from_secs(1));
    };
    eprintln!(
        "    {client_agent} (node {}): +{out} outbound HBONE, +{passthrough} passthrough",
        client.node
    );
    eprintln!(
        "    {server_agent} (node {}): +{inbound} inbound HBONE",
        server.node
    );
    if out < REQUESTS || inbound < REQUESTS {
        bail!(
            "{REQUESTS} requests reached the server, but the proxies counted {out} outbound and {inbound} inbound HBONE connections \
             ({passthrough} went out as plain TCP): the traffic did not go through HBONE. \
             `kubectl --context {CONTEXT} -n {AGENT_NAMESPACE} logs {client_agent} -c agent` has the access log."
        );
    }
    // The same seen in the agent's Prometheus metrics (best effort: shown,
    // not checked), through the API server's proxy to the agent's 15020.
    if let Ok(metrics) = util::stdout(kubectl().args([
        "get",
        "--raw",
        &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/pods/{server_agent}:15020/proxy/metrics"),
    ])) {
        for line in metrics.lines().filter(|l| {
            l.starts_with("istio_tcp_connections_opened_total") && l.contains(DEMO_NAMESPACE)
        }) {
            eprintln!("    metrics: {line}");
        }
    }
    eprintln!("---- shunt status on node {}", server.node);
    show(shunt_in(&server_agent).arg("status"));
    Ok(agents)
}

pub(super) fn look_around(
    client: &SamplePod,
    server: &SamplePod,
    agents: &BTreeMap<String, String>,
) {
    let agent = agents
        .get(&server.node)
        .map(String::as_str)
        .unwrap_or("<agent pod>");
    let k = format!("kubectl --context {CONTEXT}");
    eprintln!(
        "
shunt runs on every node of the kind cluster `{CLUSTER}`; {client} and {server} talk through HBONE.
Look around:

  {k} -n {AGENT_NAMESPACE} get pods -o wide                      # one agent per node
  {k} -n {AGENT_NAMESPACE} exec {agent} -- shunt status          # enrolled pods, hooks, counters
  {k} -n {AGENT_NAMESPACE} logs {agent} -c agent -f              # one access-log line per connection
  {k} -n {DEMO_NAMESPACE} exec {client} -- curl -sS http://{ip}:{SERVER_PORT}/hostname
  {k} -n {DEMO_NAMESPACE} exec {client} -- curl -sS http://server.{DEMO_NAMESPACE}/hostname   # a Service IP: plain TCP (not resolved yet)
  {k} -n {DEMO_NAMESPACE} get pods -o custom-columns=POD:.metadata.name,NODE:.spec.nodeName,REDIRECTION:.metadata.annotations.ambient\\.istio\\.io/redirection
  {k} get --raw /api/v1/namespaces/{AGENT_NAMESPACE}/pods/{agent}:15020/proxy/metrics   # Prometheus metrics
  {k} -n {AGENT_NAMESPACE} port-forward {agent} 15000   # then: curl localhost:15000/status, /config_dump, /debug/bpf
  {k} label namespace default istio.io/dataplane-mode=ambient   # enrol another namespace
  {k} -n {AGENT_NAMESPACE} edit daemonset shunt   # settings are the agent's args; saving rolls the agents

Remove it all: cargo xtask run --delete",
        client = client.name,
        server = server.name,
        ip = server.ip,
    );
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_numbers_from_the_status_json() {
        let status = r#"{"node":"n","proxy":{"outbound_hbone": 12,"inbound_hbone":3}}"#;
        assert_eq!(json_u64(status, "outbound_hbone"), Some(12));
        assert_eq!(json_u64(status, "inbound_hbone"), Some(3));
        assert_eq!(json_u64(status, "refused"), None);
        assert_eq!(json_u64(r#"{"proxy":null}"#, "outbound_hbone"), None);
    }
}

//! What the fast path's kernel tests check again and again: that the
//! proxy did no work while the kernel carried a flow, that flow 2's switch
//! and maps are as a test expects, and that a kernel-carried connection is
//! reported as the proxy would report it (Istio's TCP metrics, the access
//! log).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
    time::Duration,
};

use serde_json::Value;
use shunt_common::maps;

use crate::{
    Node, Pod,
    agent::{Agent, http},
    apps::{TestApp, local_of, via_the_proxy},
    poll::until,
    scrape::{sample, wait_metrics},
};

/// How long each wait here may take.
const TIMEOUT: Duration = Duration::from_secs(30);
/// How often the agent is asked.
const EVERY: Duration = Duration::from_millis(100);

/// Everything the proxy copied or carried, as one tuple (outbound HBONE,
/// inbound HBONE, outbound passthrough, inbound plaintext, bytes out,
/// bytes in): it must not move while the kernel carries a flow.
pub fn proxy_work(agent: &Agent) -> (u64, u64, u64, u64, u64, u64) {
    let p = agent.status().expect("status").proxy.expect("a proxy");
    (
        p.outbound_hbone,
        p.inbound_hbone,
        p.outbound_passthrough,
        p.inbound_plaintext,
        p.bytes_out,
        p.bytes_in,
    )
}

/// The SPIFFE identity `WorkloadSpec::for_pod` gives `pod` in `namespace`.
pub fn principal(pod: &Pod, namespace: &str) -> String {
    format!("spiffe://cluster.local/ns/{namespace}/sa/sa-{}", pod.name())
}

/// Waits until flow 2's switch (`shunt_fast_path_mesh_enabled`) is `on`.
pub fn mesh_enabled(node: &Node, agent: &Agent, on: bool) {
    let want = if on { 1.0 } else { 0.0 };
    wait_metrics(node, agent, "the same-node mesh fast path's switch", |m| {
        sample(m, "shunt_fast_path_mesh_enabled", &[]) == Some(want)
    });
}

/// Entries of every countable pinned map of the agent, by pin name, from
/// `GET /debug/bpf` (`None`: no such answer).
pub fn pinned_map_entries(node: &Node, agent: &Agent) -> Option<BTreeMap<String, u64>> {
    let admin = agent.endpoints().admin.port();
    let (code, body) = http(node, "GET", admin, "/debug/bpf").ok()?;
    if code != 200 {
        return None;
    }
    let dump: Value = serde_json::from_str(&body).ok()?;
    Some(
        dump["pinned"]["maps"]
            .as_array()?
            .iter()
            .filter_map(|m| {
                let pin = m["pin"].as_str()?;
                let name = pin.rsplit('/').next()?.to_string();
                Some((name, m["entries"].as_u64()?))
            })
            .collect(),
    )
}

/// Waits until flow 2 is on and its VIP map holds `n` entries.
pub fn vips_written(node: &Node, agent: &Agent, n: u64) {
    mesh_enabled(node, agent, true);
    let vips = || {
        pinned_map_entries(node, agent)?
            .get(maps::MESH_LOCAL_SERVICES)
            .copied()
    };
    assert!(
        until(TIMEOUT, EVERY, || (vips() == Some(n)).then_some(())).is_some(),
        "{} never held {n} entries (now {:?}): {}",
        maps::MESH_LOCAL_SERVICES,
        vips(),
        agent.logs()
    );
}

/// Waits until the agent's kernel authorization table was compiled, without
/// error, from exactly the policies `names`.
pub fn policies_compiled(agent: &Agent, names: &[&str]) {
    let compiled = until(TIMEOUT, EVERY, || {
        agent
            .status()
            .ok()?
            .kernel_authz
            .filter(|k| k.policies == names && k.error.is_none())
    });
    assert!(
        compiled.is_some(),
        "policies {names:?} never compiled: {}",
        agent.logs()
    );
}

/// Waits until the agent's proxy counted more outbound HBONE connections
/// than `before` (the first field of [`proxy_work`]).
pub fn outbound_hbone_counted(agent: &Agent, before: u64) {
    let counted = until(TIMEOUT, EVERY, || {
        (proxy_work(agent).0 > before).then_some(())
    });
    assert!(
        counted.is_some(),
        "no outbound HBONE counted: {}",
        agent.logs()
    );
}

/// `client` → `to` (an echo or a `HalfEcho`) went through the proxy: the
/// application's socket was redirected to its 15001, an answer came back,
/// and the proxy counted one more outbound HBONE connection.
pub fn carried_by_the_proxy(apps: &TestApp<'_>, agent: &Agent, client: &Pod, to: &str) {
    let before = proxy_work(agent).0;
    let report = apps.run(client, &["connect", to, "--send", "4096"]);
    assert_eq!(
        report["ok"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    assert!(
        report["received"].as_u64().is_some_and(|n| n > 0),
        "an answer came back: {report}"
    );
    assert!(via_the_proxy(&report), "redirected to the proxy: {report}");
    assert_eq!(
        report["peer"].as_str(),
        Some(to),
        "getpeername answers the destination dialled, not the proxy: {report}"
    );
    outbound_hbone_counted(agent, before);
}

/// Checks a `shunt-testapp connect --send bytes` report against a
/// `HalfEcho` server: the connect succeeded, half the bytes came back, and
/// the application's socket is connected to the destination, not the
/// proxy, from `client`'s own address. Returns that local address.
pub fn assert_direct(report: &Value, client: IpAddr, bytes: usize, agent: &Agent) -> SocketAddr {
    assert_eq!(
        report["ok"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    assert_eq!(
        report["received"].as_u64(),
        Some(bytes as u64 / 2),
        "{report}"
    );
    assert!(!via_the_proxy(report), "not via the proxy: {report}");
    let local = local_of(report);
    assert_eq!(local.ip(), client, "from the pod's own address: {report}");
    local
}

/// Waits until the one connection `labels` select is counted closed, then
/// checks that Istio's TCP metrics count it opened once, with `request`
/// bytes received and `response` bytes sent (Istio's convention: received
/// = the request, sent = the response). `what` names it in failures.
pub fn assert_istio_tcp_counted(
    node: &Node,
    agent: &Agent,
    labels: &[(&str, &str)],
    request: usize,
    response: usize,
    what: &str,
) {
    let text = wait_metrics(node, agent, &format!("{what} closed"), |m| {
        sample(m, "istio_tcp_connections_closed_total", labels) == Some(1.0)
    });
    assert_eq!(
        sample(&text, "istio_tcp_connections_opened_total", labels),
        Some(1.0),
        "{what}: {text}"
    );
    assert_eq!(
        sample(&text, "istio_tcp_received_bytes_total", labels),
        Some(request as f64),
        "{what}: {text}"
    );
    assert_eq!(
        sample(&text, "istio_tcp_sent_bytes_total", labels),
        Some(response as f64),
        "{what}: {text}"
    );
}

/// Whether an access-log line has `name=value` (quoted or not).
pub fn has_field(line: &str, name: &str, value: &str) -> bool {
    line.contains(&format!("{name}={value} "))
        || line.contains(&format!("{name}=\"{value}\""))
        || line.ends_with(&format!("{name}={value}"))
}

/// The agent's access-log line of a kernel-carried (`path=fast`)
/// connection in `direction` whose line has every one of `needles`.
pub fn fast_access_line(agent: &Agent, direction: &str, needles: &[&str]) -> String {
    let logs = agent.logs();
    logs.lines()
        .find(|l| {
            l.contains("connection complete")
                && has_field(l, "direction", direction)
                && has_field(l, "path", "fast")
                && needles.iter().all(|n| l.contains(n))
        })
        .map(str::to_string)
        .unwrap_or_else(|| panic!("no {direction} access log line with {needles:?}:\n{logs}"))
}

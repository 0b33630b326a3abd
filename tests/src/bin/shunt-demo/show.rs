//! What the demo prints: the introduction (namespaces, agent, flows, what
//! to try), the live table each second, and the closing summary.

use std::{
    io::{IsTerminal as _, Write as _},
    path::Path,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use shunt::api::NodeStatus;
use shunt_testbed::{
    NETNS_DIR, Topology,
    agent::{ADMIN_ADDR, Agent},
};

use super::{
    CLIENT, NODE, Pods, SERVER, pod_status,
    signals::{interrupted, sleep_unless_interrupted},
    traffic::{CONNECT_EVERY, FlowStats, Traffic, flow_specs},
};

pub(super) fn print_intro(
    topo: &Topology,
    agent: &Agent,
    pods: &Pods,
    shunt: &Path,
    duration: Duration,
) {
    let node_ns = topo
        .node(NODE)
        .map(|n| n.netns_name().to_string())
        .unwrap_or_default();
    let node_ip = topo
        .node(NODE)
        .map(|n| n.ip().to_string())
        .unwrap_or_default();
    let gateway = topo
        .node(NODE)
        .map(|n| n.gateway().to_string())
        .unwrap_or_default();
    let mut out = String::new();
    out.push_str(
        "shunt demo: one node, three pods, each its own network namespace (198.18.0.0/15 only)\n\n",
    );
    out.push_str(&format!(
        "  node {NODE:<9} netns {node_ns:<26} fabric {node_ip}, pod gateway {gateway} (br0)\n"
    ));
    for (pod, mesh) in [
        (&pods.client, "in the mesh (dataplaneMode: ambient)"),
        (&pods.server, "in the mesh (dataplaneMode: ambient)"),
        (&pods.outsider, "NOT in the mesh (dataplaneMode: none)"),
    ] {
        out.push_str(&format!(
            "  pod  {:<9} netns {:<26} {:<13} {mesh}\n",
            pod.name(),
            pod.netns_name(),
            pod.ip().to_string()
        ));
    }
    let pid = agent
        .pid()
        .map(|p| p.to_string())
        .unwrap_or_else(|| "?".into());
    out.push_str(&format!(
        "\n  agent pid {pid}, in {node_ns}; admin API {ADMIN_ADDR} there\n"
    ));
    out.push_str(&format!("    bpf pins   {}\n", agent.pin_dir().display()));
    out.push_str(&format!(
        "    workloads  {}\n",
        agent.workloads_path().display()
    ));
    out.push_str(&format!(
        "    cgroup     {}   (its --cgroup-root)\n",
        agent.cgroup_root().display()
    ));
    out.push_str(&format!(
        "    log        {}   (removed at the end unless the demo fails)\n",
        agent.log_path().display()
    ));
    out.push_str(&format!(
        "\ntraffic for {}s, one connection per flow every {} ms, 2-5 KiB each, echo checked byte for byte:\n",
        duration.as_secs(),
        CONNECT_EVERY.as_millis()
    ));
    for flow in flow_specs(pods) {
        out.push_str(&format!("  {:<20} {}\n", flow.name, flow.kind));
    }
    out.push_str("\ntry meanwhile, in another terminal:\n");
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{node_ns} {} status\n",
        shunt.display()
    ));
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{} tc filter show dev eth0 ingress\n",
        pods.client.netns_name()
    ));
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{} tc filter show dev eth0 egress\n",
        pods.server.netns_name()
    ));
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{} tc filter show dev eth0 ingress   # empty: not in the mesh\n",
        pods.outsider.netns_name()
    ));
    out.push_str(&format!("  ls {}\n", agent.pin_dir().display()));
    out.push_str(&format!("  tail -f {}\n", agent.log_path().display()));
    out.push_str("\nCtrl-C stops early; everything is torn down either way.\n");
    println!("{out}");
}

pub(super) fn live_table(
    agent: &Agent,
    traffic: &Traffic,
    duration: Duration,
    last_status: &mut Option<NodeStatus>,
    problems: &mut Vec<String>,
) {
    let terminal = std::io::stdout().is_terminal();
    let start = Instant::now();
    let mut failures_in_a_row = 0;
    for second in 1..=duration.as_secs() {
        let due = start + Duration::from_secs(second);
        if !sleep_unless_interrupted(due.saturating_duration_since(Instant::now())) {
            return;
        }
        let mut out = String::new();
        if terminal {
            out.push_str("\x1b[2J\x1b[H");
        } else {
            out.push('\n');
        }
        out.push_str(&format!(
            "== shunt demo: {second}s of {}s (Ctrl-C stops) ==\n",
            duration.as_secs()
        ));
        match agent.status() {
            Ok(status) => {
                failures_in_a_row = 0;
                out.push_str(&shunt::status::render_table(&status));
                *last_status = Some(status);
            }
            Err(e) => {
                failures_in_a_row += 1;
                out.push_str(&format!("agent status unavailable: {e}\n"));
            }
        }
        out.push_str("traffic\n");
        for flow in &traffic.flows {
            out.push_str(&flow.line());
            out.push('\n');
        }
        print!("{out}");
        let _ = std::io::stdout().flush();
        if failures_in_a_row >= 3 {
            problems.push("the agent stopped answering on its admin API".into());
            return;
        }
    }
}

/// The testbed's agent errors end with the whole agent log; the log is kept
/// and its path printed, so a problem line keeps only the first line.
pub(super) fn first_line(text: &str) -> String {
    match text.split_once('\n') {
        Some((first, _)) => format!("{first} (see the agent log)"),
        None => text.to_string(),
    }
}

pub(super) fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

pub(super) fn summary(flows: &[Arc<FlowStats>], status: Option<&NodeStatus>) -> String {
    let flows = flows
        .iter()
        .map(|f| {
            format!(
                "{} {} conns, {:.0} KiB echoed",
                f.name,
                f.ok.load(Ordering::Relaxed),
                f.bytes.load(Ordering::Relaxed) as f64 / 1024.0
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let counters = [CLIENT, SERVER]
        .iter()
        .filter_map(|name| {
            let c = status.and_then(|s| pod_status(s, name))?.counters?;
            Some(format!(
                "{name} counters in {} pkts / out {} pkts",
                c.packets_in, c.packets_out
            ))
        })
        .collect::<Vec<_>>()
        .join(", ");
    let verdict = match interrupted() {
        Some(signal) => format!("demo stopped by {signal}, torn down cleanly"),
        None => "demo ok".to_string(),
    };
    format!(
        "{verdict}: {flows}; {counters}; outsider: no counters (not in the mesh); every pod unenrolled, namespaces deleted"
    )
}

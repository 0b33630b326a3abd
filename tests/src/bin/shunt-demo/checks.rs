//! What the demo checks before it says "ok": every echo right, the
//! agent's counters and hooks for each pod, the proxy paths each flow took,
//! and nothing left in the pods once the agent stopped.

use std::{
    fs,
    sync::{Arc, atomic::Ordering},
};

use anyhow::{Context as _, bail};
use shunt::api::{NodeStatus, PodState};
use shunt_testbed::{Pod, agent::Agent};

use super::{CLIENT, OUTSIDER, SERVER, pod_status, show::indent, traffic::FlowStats};

pub(super) fn check_traffic(
    flows: &[Arc<FlowStats>],
    expect_activity: bool,
    problems: &mut Vec<String>,
) {
    println!("traffic totals");
    for flow in flows {
        println!("{}", flow.line());
        let wrong = flow.wrong.load(Ordering::Relaxed);
        let failed = flow.failed.load(Ordering::Relaxed);
        if wrong > 0 {
            problems.push(format!("{}: {wrong} echoes came back wrong", flow.name));
        }
        if failed > 0 {
            problems.push(format!("{}: {failed} connections failed", flow.name));
        }
        if expect_activity && flow.ok.load(Ordering::Relaxed) == 0 {
            problems.push(format!("{}: no connection succeeded", flow.name));
        }
    }
}

pub(super) fn check_counters(
    status: Option<&NodeStatus>,
    expect_activity: bool,
    problems: &mut Vec<String>,
) {
    let Some(status) = status else {
        problems.push("never got a status from the agent".into());
        return;
    };
    for name in [CLIENT, SERVER] {
        match pod_status(status, name) {
            None => problems.push(format!("pod {name} is missing from the agent's status")),
            Some(pod) => {
                let c = pod.counters.unwrap_or_default();
                if expect_activity && (c.packets_in == 0 || c.packets_out == 0) {
                    problems.push(format!(
                        "pod {name} is in the mesh but its counters stayed zero ({c:?})"
                    ));
                }
                if let Some(hook) = pod.hooks.iter().find(|h| !h.present) {
                    problems.push(format!("pod {name}: hook {} is missing", hook.name));
                }
            }
        }
    }
    // Each flow took its path through the proxy.
    if expect_activity {
        let proxy = status.proxy.clone().unwrap_or_default();
        for (path, count) in [
            ("HBONE out (client -> server)", proxy.outbound_hbone),
            ("HBONE in (client -> server)", proxy.inbound_hbone),
            ("plaintext in (outsider -> server)", proxy.inbound_plaintext),
            (
                "passthrough (client -> outsider)",
                proxy.outbound_passthrough,
            ),
        ] {
            if count == 0 {
                problems.push(format!("no connection went through the proxy's {path}"));
            }
        }
    }
    match pod_status(status, OUTSIDER) {
        None => problems.push("pod outsider is missing from the agent's status".into()),
        Some(pod) => {
            if pod.state != PodState::NotInMesh {
                problems.push(format!(
                    "pod outsider is not in the mesh but its state is {:?}",
                    pod.state
                ));
            }
            if pod.counters.is_some_and(|c| c != Default::default()) || !pod.hooks.is_empty() {
                problems.push(format!(
                    "pod outsider is not in the mesh but has counters {:?} / hooks {:?}",
                    pod.counters, pod.hooks
                ));
            }
        }
    }
}

/// `tc filter show dev eth0 ingress` and `egress` in the pod, concatenated.
pub(super) fn tc_filters(pod: &Pod) -> anyhow::Result<String> {
    let mut text = String::new();
    for direction in ["ingress", "egress"] {
        let out = pod
            .command("tc")
            .args(["filter", "show", "dev", pod.interface(), direction])
            .output()
            .context("cannot run tc")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "tc filter show {direction} in {} failed ({}): {}",
                pod.name(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        if !stdout.trim().is_empty() {
            text.push_str(&format!("[{direction}]\n{}\n", stdout.trim_end()));
        }
    }
    Ok(text.trim_end().to_string())
}

/// Copies the agent's log out of its temp dir (removed with the agent) and
/// returns where it is now.
pub(super) fn keep_log(agent: &Agent) -> String {
    let kept = std::env::temp_dir().join(format!("shunt-demo-{}-agent.log", std::process::id()));
    match fs::copy(agent.log_path(), &kept) {
        Ok(_) => kept.display().to_string(),
        Err(e) => format!(
            "{} (could not be kept: {e}; it is removed with the demo)",
            agent.log_path().display()
        ),
    }
}

/// After the agent stopped: no pod of `pods` keeps a TC filter (printed,
/// and a problem if one is left).
pub(super) fn check_filters_removed(pods: &[&Pod], problems: &mut Vec<String>) {
    for pod in pods {
        let after = tc_filters(pod);
        match after {
            Ok(text) if text.is_empty() => {
                println!(
                    "tc filters on {} eth0 after stop: none (unenrolled)",
                    pod.name()
                );
            }
            Ok(text) => {
                println!(
                    "tc filters on {} eth0 after stop:\n{}",
                    pod.name(),
                    indent(&text)
                );
                problems.push(format!(
                    "pod {} still has tc filters after the agent stopped",
                    pod.name()
                ));
            }
            Err(e) => problems.push(format!("listing tc filters of {}: {e}", pod.name())),
        }
    }
}

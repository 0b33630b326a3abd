//! The agent DaemonSet: applied (and restarted, so that it runs the image
//! just loaded), waited for on every node, and when it cannot start, the
//! pods, events, readiness answers and logs that say why.

use std::{
    collections::BTreeMap,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::bail;

use super::{
    AGENT_NAMESPACE, AGENT_SELECTOR, DAEMONSET, ROLLOUT_TIMEOUT,
    kubectl::{kubectl, quiet, show},
};
use crate::util;

pub(super) fn apply_agent(root: &Path) -> anyhow::Result<()> {
    let existed = quiet(kubectl().args(["get", "daemonset", DAEMONSET, "-n", AGENT_NAMESPACE]))?
        .status
        .success();
    util::run(kubectl().arg("apply").arg("-k").arg(root.join("deploy")))?;
    if existed {
        // Same tag, new image: running pods would keep the old one.
        eprintln!("    restarting the agents so that they run the image just loaded");
        util::run(kubectl().args([
            "rollout",
            "restart",
            "daemonset",
            DAEMONSET,
            "-n",
            AGENT_NAMESPACE,
        ]))?;
    }
    Ok(())
}

/// Waits until every node runs an updated, ready agent (what `kubectl
/// rollout status` waits for), printing progress, and stops early with the
/// agent's logs if one cannot start.
pub(super) fn wait_for_agents() -> anyhow::Result<()> {
    let deadline = Instant::now() + ROLLOUT_TIMEOUT;
    let mut last = String::new();
    loop {
        let fields = util::stdout(kubectl().args([
            "get",
            "daemonset",
            DAEMONSET,
            "-n",
            AGENT_NAMESPACE,
            "-o",
            "jsonpath={.metadata.generation} {.status.observedGeneration} {.status.desiredNumberScheduled} {.status.updatedNumberScheduled} {.status.numberAvailable} {.status.numberReady}",
        ]))?;
        let n: Vec<u64> = fields
            .split_whitespace()
            .map(|f| f.parse().unwrap_or(0))
            .chain(std::iter::repeat(0))
            .take(6)
            .collect();
        let (generation, observed, desired, updated, available, ready) =
            (n[0], n[1], n[2], n[3], n[4], n[5]);
        let line = format!(
            "{ready}/{desired} agents ready, {updated}/{desired} running the current version"
        );
        if line != last {
            eprintln!("    {line}");
            last = line;
        }
        if observed >= generation && desired > 0 && updated == desired && available == desired {
            return Ok(());
        }
        if let Some(problem) = failing_agent()? {
            diagnose_agents();
            bail!("{problem}");
        }
        if Instant::now() > deadline {
            diagnose_agents();
            bail!(
                "the agents are not all ready after {}s ({last}); see the pods, events and logs above",
                ROLLOUT_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_secs(2));
    }
}

/// Waiting reasons that will not go away by waiting.
const HOPELESS: &[&str] = &[
    "CrashLoopBackOff",
    "ErrImagePull",
    "ImagePullBackOff",
    "ErrImageNeverPull",
    "InvalidImageName",
    "CreateContainerConfigError",
    "CreateContainerError",
    "RunContainerError",
];

/// An agent pod stuck for good, if any.
fn failing_agent() -> anyhow::Result<Option<String>> {
    let pods = agent_pods_jsonpath(
        "{range .items[*]}{.metadata.name}{\"\\t\"}{.spec.nodeName}{\"\\t\"}{range .status.initContainerStatuses[*]}{.state.waiting.reason}{\" \"}{end}{range .status.containerStatuses[*]}{.state.waiting.reason}{\" \"}{end}{\"\\n\"}{end}",
    )?;
    for line in pods.lines() {
        let mut fields = line.split('\t');
        let (Some(pod), Some(node), reasons) = (fields.next(), fields.next(), fields.next()) else {
            continue;
        };
        if let Some(reason) = reasons
            .unwrap_or_default()
            .split_whitespace()
            .find(|r| HOPELESS.contains(r))
        {
            return Ok(Some(format!(
                "agent pod {pod} on node {node}: {reason} (its logs and events are above)"
            )));
        }
    }
    Ok(None)
}

/// Prints what explains a stuck rollout: pods, recent events, each agent's
/// readiness answer and last log lines. Best effort.
pub(super) fn diagnose_agents() {
    eprintln!("---- agent pods");
    show(kubectl().args(["get", "pods", "-n", AGENT_NAMESPACE, "-o", "wide"]));
    eprintln!("---- recent events in {AGENT_NAMESPACE}");
    if let Ok(out) = quiet(kubectl().args([
        "get",
        "events",
        "-n",
        AGENT_NAMESPACE,
        "--sort-by=.lastTimestamp",
    ])) {
        let text = String::from_utf8_lossy(&out.stdout);
        let lines: Vec<&str> = text.lines().collect();
        for line in &lines[lines.len().saturating_sub(15)..] {
            eprintln!("    {line}");
        }
    }
    for (node, pod) in agent_pods().unwrap_or_default() {
        eprintln!("---- {pod} (node {node}): readiness (15021 /healthz/ready)");
        show(kubectl().args([
            "get",
            "--raw",
            &format!("/api/v1/namespaces/{AGENT_NAMESPACE}/pods/{pod}:15021/proxy/healthz/ready"),
        ]));
        eprintln!("---- {pod}: init container log");
        show(kubectl().args(["logs", "-n", AGENT_NAMESPACE, &pod, "-c", "mount-bpffs"]));
        eprintln!("---- {pod}: agent log (last 25 lines; and of the previous run, if any)");
        for previous in [&[][..], &["--previous"][..]] {
            show(
                kubectl()
                    .args([
                        "logs",
                        "-n",
                        AGENT_NAMESPACE,
                        &pod,
                        "-c",
                        "agent",
                        "--tail=25",
                    ])
                    .args(previous),
            );
        }
    }
}

/// The current (not terminating) agent pod of each node.
pub(super) fn agent_pods() -> anyhow::Result<BTreeMap<String, String>> {
    let pods = agent_pods_jsonpath(
        "{range .items[*]}{.spec.nodeName}{\"\\t\"}{.metadata.name}{\"\\t\"}{.metadata.deletionTimestamp}{\"\\n\"}{end}",
    )?;
    Ok(pods
        .lines()
        .filter_map(|line| {
            let mut f = line.split('\t');
            let (node, pod, deleting) = (f.next()?, f.next()?, f.next().unwrap_or_default());
            (deleting.is_empty() && !node.is_empty()).then(|| (node.to_string(), pod.to_string()))
        })
        .collect())
}

/// The agent pods, printed with the kubectl JSONPath `template`.
fn agent_pods_jsonpath(template: &str) -> anyhow::Result<String> {
    util::stdout(kubectl().args([
        "get",
        "pods",
        "-n",
        AGENT_NAMESPACE,
        "-l",
        AGENT_SELECTOR,
        "-o",
        &format!("jsonpath={template}"),
    ]))
}

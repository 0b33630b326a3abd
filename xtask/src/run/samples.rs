//! The sample client and server (deploy/samples/): applied, and waited on
//! until the agent has annotated both `ambient.istio.io/redirection=enabled`.

use std::{
    collections::BTreeMap,
    path::Path,
    thread,
    time::{Duration, Instant},
};

use anyhow::bail;

use super::{
    DEMO_NAMESPACE, ENROLMENT_TIMEOUT,
    agents::agent_pods,
    kubectl::{kubectl, show, shunt_in},
};
use crate::util;

pub(super) fn apply_samples(root: &Path) -> anyhow::Result<()> {
    util::run(
        kubectl()
            .arg("apply")
            .arg("-k")
            .arg(root.join("deploy/samples")),
    )?;
    for deployment in ["server", "client"] {
        util::run(kubectl().args([
            "rollout",
            "status",
            "deployment",
            deployment,
            "-n",
            DEMO_NAMESPACE,
            "--timeout=300s",
        ]))?;
    }
    Ok(())
}

/// A sample pod as the API shows it.
#[derive(Clone, Debug)]
pub(super) struct SamplePod {
    pub(super) name: String,
    pub(super) node: String,
    pub(super) ip: String,
    /// The `ambient.istio.io/redirection` annotation the agent maintains.
    redirection: String,
}

/// The current client and server pods.
pub(super) fn sample_pods() -> anyhow::Result<BTreeMap<String, SamplePod>> {
    let pods = util::stdout(kubectl().args([
        "get",
        "pods",
        "-n",
        DEMO_NAMESPACE,
        "-o",
        "jsonpath={range .items[*]}{.metadata.labels.app}{\"\\t\"}{.metadata.name}{\"\\t\"}{.spec.nodeName}{\"\\t\"}{.status.podIP}{\"\\t\"}{.metadata.deletionTimestamp}{\"\\t\"}{.metadata.annotations.ambient\\.istio\\.io/redirection}{\"\\n\"}{end}",
    ]))?;
    let mut out = BTreeMap::new();
    for line in pods.lines() {
        let f: Vec<&str> = line.split('\t').collect();
        if f.len() < 6 || !f[4].is_empty() {
            continue;
        }
        out.insert(
            f[0].to_string(),
            SamplePod {
                name: f[1].to_string(),
                node: f[2].to_string(),
                ip: f[3].to_string(),
                redirection: f[5].to_string(),
            },
        );
    }
    Ok(out)
}

/// Waits until the agent has annotated both pods
/// `ambient.istio.io/redirection=enabled` (it does once their redirection
/// is in place).
pub(super) fn wait_for_enrolment() -> anyhow::Result<(SamplePod, SamplePod)> {
    let deadline = Instant::now() + ENROLMENT_TIMEOUT;
    let mut last = String::new();
    loop {
        let pods = sample_pods()?;
        let line = ["client", "server"]
            .iter()
            .map(|app| match pods.get(*app) {
                Some(p) => format!(
                    "{} on {}: redirection={}",
                    p.name,
                    p.node,
                    if p.redirection.is_empty() {
                        "(none yet)"
                    } else {
                        &p.redirection
                    }
                ),
                None => format!("{app}: no pod yet"),
            })
            .collect::<Vec<_>>()
            .join("; ");
        if line != last {
            eprintln!("    {line}");
            last = line;
        }
        if let (Some(client), Some(server)) = (pods.get("client"), pods.get("server"))
            && client.redirection == "enabled"
            && server.redirection == "enabled"
        {
            return Ok((client.clone(), server.clone()));
        }
        if Instant::now() > deadline {
            let agents = agent_pods().unwrap_or_default();
            for pod in pods.values() {
                if let Some(agent) = agents.get(&pod.node) {
                    eprintln!("---- agent {agent} on {}: shunt status", pod.node);
                    show(shunt_in(agent).arg("status"));
                }
            }
            bail!(
                "the sample pods are not both annotated ambient.istio.io/redirection=enabled after {}s ({last}); the agents' view is above",
                ENROLMENT_TIMEOUT.as_secs()
            );
        }
        thread::sleep(Duration::from_secs(2));
    }
}

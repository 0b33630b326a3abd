//! Upgrade or uninstall? What `--on-exit auto` asks the API server at
//! SIGTERM, as istio-cni's node agent does before it decides whether to
//! clean up (`ShouldStopCleanup`, cni/pkg/nodeagent/server.go):
//!
//! - the agent's own DaemonSet is there, not being deleted, and still
//!   selects this node: an **upgrade** (or a node reboot, or a rollout):
//!   everything stays for the next agent;
//! - the DaemonSet is gone (404), has a `deletionTimestamp`, or no longer
//!   selects this node (its pod template's `nodeSelector` or required node
//!   affinity does not match the Node's labels and name): an **uninstall**;
//! - the API server refuses us (401: the service account's token is gone
//!   with the release) or cannot answer within the bounded attempts: an
//!   uninstall too, istio-cni's default when its CNI config is not its own
//!   file (ours is an entry in the primary conflist).
//!
//! Limitation: taints and tolerations are not compared (a node tainted so
//! that the DaemonSet's pods no longer tolerate it counts as selected).

use std::time::Duration;

use k8s_openapi::api::apps::v1::DaemonSet;
use k8s_openapi::api::core::v1::Node;
use kube::{Api, Client};
use tracing::{info, warn};

use super::node_selection::selects;

/// What the agent does with the node at exit.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ExitDecision {
    /// Leave every pod enrolled and every program in place (a new agent of
    /// the same DaemonSet follows).
    Upgrade { why: String },
    /// Unenrol every pod and remove everything from the node.
    Uninstall { why: String },
}

/// Who the agent is: its DaemonSet and its node.
#[derive(Clone, Debug)]
pub struct SelfRef {
    pub daemonset_namespace: String,
    pub daemonset_name: String,
    pub node_name: String,
}

/// How many times the API is asked before the agent gives up and
/// uninstalls, and how long each attempt may take: the whole decision must
/// leave time for the unenrolment within the pod's grace period.
const ATTEMPTS: u32 = 3;
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(2);
const BETWEEN_ATTEMPTS: Duration = Duration::from_millis(500);

/// Asks the API server whether this exit is an upgrade or an uninstall.
pub async fn decide(client: Client, me: &SelfRef) -> ExitDecision {
    let mut last_error = String::new();
    for attempt in 1..=ATTEMPTS {
        match tokio::time::timeout(ATTEMPT_TIMEOUT, ask(client.clone(), me)).await {
            Ok(Ok(decision)) => return decision,
            Ok(Err(Final(decision))) => return decision,
            Ok(Err(Retry(e))) => last_error = e,
            Err(_) => last_error = format!("no answer within {ATTEMPT_TIMEOUT:?}"),
        }
        info!(attempt, error = %last_error, "cannot tell an upgrade from an uninstall yet");
        if attempt < ATTEMPTS {
            tokio::time::sleep(BETWEEN_ATTEMPTS).await;
        }
    }
    warn!(error = %last_error, "the API server did not say whether this is an upgrade; uninstalling, as istio-cni does");
    ExitDecision::Uninstall {
        why: format!(
            "DaemonSet {}/{} could not be read: {last_error}",
            me.daemonset_namespace, me.daemonset_name
        ),
    }
}

/// A decision the API's answer settles (404, 401), or an error worth
/// another attempt.
enum AskError {
    Final(ExitDecision),
    Retry(String),
}
use AskError::{Final, Retry};

async fn ask(client: Client, me: &SelfRef) -> Result<ExitDecision, AskError> {
    let ds_name = format!("{}/{}", me.daemonset_namespace, me.daemonset_name);
    let daemonsets: Api<DaemonSet> = Api::namespaced(client.clone(), &me.daemonset_namespace);
    let daemonset = match daemonsets.get_opt(&me.daemonset_name).await {
        Ok(Some(ds)) => ds,
        Ok(None) => {
            return Err(Final(ExitDecision::Uninstall {
                why: format!("DaemonSet {ds_name} is gone"),
            }));
        }
        Err(kube::Error::Api(status)) if status.code == 401 => {
            return Err(Final(ExitDecision::Uninstall {
                why: format!(
                    "the API server no longer accepts this agent's credentials (reading DaemonSet {ds_name}: {})",
                    status.message
                ),
            }));
        }
        Err(e) => return Err(Retry(format!("reading DaemonSet {ds_name}: {e}"))),
    };
    if daemonset.metadata.deletion_timestamp.is_some() {
        return Ok(ExitDecision::Uninstall {
            why: format!("DaemonSet {ds_name} is being deleted"),
        });
    }
    let nodes: Api<Node> = Api::all(client);
    let node = match nodes.get_opt(&me.node_name).await {
        Ok(Some(node)) => node,
        // The node is being removed from the cluster: nothing will
        // schedule here again.
        Ok(None) => {
            return Ok(ExitDecision::Uninstall {
                why: format!("Node {} is gone", me.node_name),
            });
        }
        Err(e) => return Err(Retry(format!("reading Node {}: {e}", me.node_name))),
    };
    let pod_spec = daemonset
        .spec
        .as_ref()
        .and_then(|spec| spec.template.spec.as_ref());
    let labels = node.metadata.labels.clone().unwrap_or_default();
    if let Some(spec) = pod_spec
        && !selects(spec, &labels, &me.node_name)
    {
        return Ok(ExitDecision::Uninstall {
            why: format!(
                "DaemonSet {ds_name} no longer selects node {} (nodeSelector or node affinity)",
                me.node_name
            ),
        });
    }
    Ok(ExitDecision::Upgrade {
        why: format!(
            "DaemonSet {ds_name} is present and selects node {}",
            me.node_name
        ),
    })
}

//! How the agent exits: what `--on-exit` asks of the node (for `auto`,
//! decided at SIGTERM from the API server, `control::kube::exit`), then the
//! proxy's drain.

use std::time::Duration;

use tracing::{info, warn};

use super::{AgentError, PodSource};
use crate::{
    agent::{Reconciler, StopAction},
    cli::{AgentArgs, OnExit},
    control::kube::exit::{ExitDecision, SelfRef, decide},
    proxy::Proxy,
};

/// What the agent will do at exit, fixed at start (so that a flag missing
/// for `auto` fails the start, not the exit).
pub(super) enum ExitPlan {
    Fixed(StopAction),
    /// Ask the API server at exit whether this is an upgrade.
    Ask {
        client: ::kube::Client,
        me: SelfRef,
    },
}

impl ExitPlan {
    pub(super) fn new(args: &AgentArgs, source: &PodSource) -> Result<Self, AgentError> {
        Ok(match args.on_exit {
            OnExit::Keep => Self::Fixed(StopAction::Keep),
            OnExit::Unenrol => Self::Fixed(StopAction::Unenrol),
            OnExit::Uninstall => Self::Fixed(StopAction::Uninstall),
            OnExit::Auto => {
                let PodSource::Kube(client) = source else {
                    return Err(AgentError::OnExit(
                        "decides from the Kubernetes API, which a --workloads file replaces: use keep, unenrol or uninstall",
                    ));
                };
                let Some(name) = args.daemonset_name.clone() else {
                    return Err(AgentError::OnExit(
                        "needs the agent's DaemonSet: set --daemonset-name (env DAEMONSET_NAME) and --daemonset-namespace (env DAEMONSET_NAMESPACE)",
                    ));
                };
                Self::Ask {
                    client: client.clone(),
                    me: SelfRef {
                        daemonset_namespace: args
                            .daemonset_namespace
                            .clone()
                            .unwrap_or_else(|| args.pod_namespace.clone()),
                        daemonset_name: name,
                        node_name: args.node_name.clone(),
                    },
                }
            }
        })
    }

    /// The action, asking the API server for `auto` (bounded: see
    /// `control::kube::exit`).
    pub(super) async fn decide(self) -> StopAction {
        match self {
            Self::Fixed(action) => action,
            Self::Ask { client, me } => match decide(client, &me).await {
                ExitDecision::Upgrade { why } => {
                    info!(%why, "--on-exit auto: an upgrade; leaving every pod enrolled for the next agent");
                    StopAction::Keep
                }
                ExitDecision::Uninstall { why } => {
                    info!(%why, "--on-exit auto: an uninstall; removing everything from the node");
                    StopAction::Uninstall
                }
            },
        }
    }
}

/// Does `action` to the node (unenrol or uninstall: shunt-cni's entry
/// removed, no new connection captured; keep: redirection left to the
/// next agent), then lets the proxy's
/// connections in flight finish within the grace period, and reports the
/// agent stopped.
pub(super) async fn shutdown(
    reconciler: Reconciler,
    action: StopAction,
    proxy: Option<Proxy>,
    args: &AgentArgs,
) -> Result<(), AgentError> {
    if action == StopAction::Keep {
        info!(
            "leaving every pod enrolled for the next agent; pods without a proxy fail closed until it starts"
        );
    } else {
        // Every path that takes the pods out of the mesh (unenrol,
        // uninstall) passes here. The CNI plugin's conflist entry goes
        // first, so that no new sandbox waits for this agent.
        super::cni::uninstall(args);
    }
    reconciler.stop_with(action).await;
    if let Some(proxy) = proxy {
        let cut = proxy.drain(Duration::from_secs(args.drain_seconds)).await;
        if cut > 0 {
            warn!(
                connections = cut,
                "connections still open after the drain period were cut"
            );
        }
    }
    info!("agent stopped");
    Ok(())
}

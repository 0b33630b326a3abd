//! The admin API (127.0.0.1:15000 in the agent's netns): read-only views of
//! what the agent owns. `shunt status` is its client.

use std::{net::IpAddr, path::PathBuf};

use axum::{Json, Router, extract::State, http::StatusCode, routing::get};
use serde::{Deserialize, Serialize};
use tracing::error;

use crate::{
    agent::{SharedAgent, lock},
    redirect::Hook,
};

/// `GET /status`: the node and every pod of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct NodeStatus {
    pub node: String,
    /// Redirection mode in use (`ebpf` or `iptables`).
    pub mode: String,
    pub trust_domain: String,
    /// The builtin proxy's counters (absent without one).
    #[serde(default)]
    pub proxy: Option<crate::proxy::ProxyStats>,
    pub pods: Vec<PodStatus>,
}

/// One pod of this node.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PodStatus {
    pub namespace: String,
    pub name: String,
    pub ips: Vec<IpAddr>,
    pub service_account: String,
    pub identity: String,
    pub dataplane_mode: String,
    pub state: PodState,
    pub netns: Option<PathBuf>,
    pub netns_cookie: Option<u64>,
    pub hooks: Vec<Hook>,
    /// Kernel counters; present while the pod is enrolled.
    pub counters: Option<Counters>,
}

/// What the agent did with a pod.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "state", content = "reason", rename_all = "kebab-case")]
pub enum PodState {
    /// Redirection is in place.
    Enrolled,
    /// The pod opts in but is not enrolled yet; the reason says why.
    Pending(String),
    /// The pod opted out (or never opted in); nothing was touched.
    NotInMesh,
    /// Something failed; the reason says what.
    Error(String),
}

/// Per-pod traffic counters as the TC programs on `eth0` saw them.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Counters {
    pub packets_in: u64,
    pub bytes_in: u64,
    pub packets_out: u64,
    pub bytes_out: u64,
}

impl From<shunt_common::PodCounters> for Counters {
    fn from(c: shunt_common::PodCounters) -> Self {
        Self {
            packets_in: c.packets_in,
            bytes_in: c.bytes_in,
            packets_out: c.packets_out,
            bytes_out: c.bytes_out,
        }
    }
}

/// Serves the admin API until the process exits.
pub async fn serve(listener: tokio::net::TcpListener, agent: SharedAgent) {
    let app = Router::new()
        .route("/status", get(status))
        .with_state(agent);
    if let Err(e) = axum::serve(listener, app).await {
        error!(error = %e, "admin API stopped");
    }
}

async fn status(
    State(agent): State<SharedAgent>,
) -> Result<Json<NodeStatus>, (StatusCode, String)> {
    // Reading hooks enters pod namespaces: blocking work.
    tokio::task::spawn_blocking(move || lock(&agent).status())
        .await
        .map(Json)
        .map_err(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("status failed: {e}"),
            )
        })
}

//! The admin API (127.0.0.1:15000 in the agent's netns): views of what the
//! agent owns, and the log filter. `shunt status` is its client.
//!
//! - `GET /status`: the node and its pods ([`NodeStatus`]);
//! - `GET /config_dump`: in ztunnel's shape (what `istioctl
//!   ztunnel-config` reads): workloads, services, policies, certificates,
//!   this node's captured pods; shunt's own facts (sources, istiod's
//!   connection, pod states, hooks) under `shunt` keys ([`ConfigDump`],
//!   built by [`config_dump::build`]);
//! - `GET /debug/bpf`: in eBPF mode the pinned maps (type, sizes, fill) and
//!   links; in iptables mode each pod's chains and rules ([`DebugBpf`]);
//! - `GET|POST /logging?level=FILTER`: replaces the log filter at run time
//!   (`RUST_LOG` syntax); `?reset` restores the one the agent started with;
//!   without parameters it shows the filter in force.
//!
//! Every answer comes from the reconciler's last snapshot (hooks and
//! counters as its verify pass read them), the workload store and the
//! proxy's registries: no request waits on a reconcile or enters a pod's
//! netns.

use std::{
    path::PathBuf,
    sync::{Arc, RwLock},
};

use axum::{
    Json, Router,
    extract::{Query, State},
    http::StatusCode,
    routing::get,
};
use serde::{Deserialize, Serialize};
use tracing::{debug, error, info};

pub mod config_dump;

use crate::{
    api::{
        CertificateStatus, KernelDenial, NodeStatus, PodStatus,
        config_dump::{ConfigDump, EnrolledDump},
    },
    authz::PolicySet,
    redirect::RedirectMode,
    snapshot::{NodeSnapshot, SnapshotReader},
    store::WorkloadStore,
};

/// `GET /status` from a snapshot: every pod of the node, with its hooks and
/// counters as last verified, its identity's certificate as it is now and
/// the authorization policies of `policies` that apply to it.
pub fn node_status(node: &NodeSnapshot, policies: Option<&PolicySet>) -> NodeStatus {
    let pods = node
        .pods
        .iter()
        .map(|pod| {
            let workload = &pod.workload;
            let identity = workload.identity(&node.trust_domain);
            let kernel = pod.kernel.as_ref();
            PodStatus {
                namespace: workload.namespace.clone(),
                name: workload.name.clone(),
                ips: workload.ips.clone(),
                service_account: workload.service_account.clone(),
                identity: identity.to_string(),
                dataplane_mode: workload.dataplane_mode.to_string(),
                state: pod.state.clone(),
                netns: workload.netns.clone(),
                netns_cookie: kernel.map(|k| k.netns_cookie),
                hooks: kernel.map(|k| k.hooks.clone()).unwrap_or_default(),
                counters: kernel.map(|k| k.counters.into()),
                certificate: node
                    .certificates
                    .get(&identity)
                    .map(|cert| CertificateStatus::from(cert.as_ref())),
                policies: policies
                    .map(|set| set.applicable_names(workload))
                    .unwrap_or_default(),
                kernel_denials: pod
                    .kernel_denials
                    .iter()
                    .map(|(policy, connects)| KernelDenial {
                        policy: policy.to_string(),
                        connects: *connects,
                    })
                    .collect(),
                fast_path_opt_out: workload.fast_path == Some(false),
                fast_path: None,
            }
        })
        .collect();
    NodeStatus {
        node: node.node.clone(),
        mode: node.mode.to_string(),
        trust_domain: node.trust_domain.to_string(),
        synced: node.synced,
        proxy: node.proxy.clone(),
        verify_passes: node.verify_passes,
        xds: None,
        kernel_authz: node.kernel_authz.clone(),
        fast_path: None,
        pods,
    }
}

/// What the admin API reads from: the reconciler's snapshots (never the
/// reconciler itself), the workload store (with the builtin proxy), the pin
/// dir.
#[derive(Clone)]
pub struct AdminState {
    pub reader: SnapshotReader,
    /// Every workload the proxy knows (absent without the builtin proxy).
    pub store: Option<Arc<RwLock<WorkloadStore>>>,
    /// The eBPF mode's pin dir (`--bpf-pin-dir`), for `/debug/bpf`.
    pub bpf_pin_dir: PathBuf,
    /// The fast path's published counters (read, never locked).
    pub fast_path: crate::metrics::FastPathMetrics,
}

impl AdminState {
    /// The policies the proxy enforces now (a shared, immutable set: the
    /// store's lock is held only to clone the pointer).
    fn policies(&self) -> Option<Arc<PolicySet>> {
        self.store.as_ref().map(|store| {
            store
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .policies()
                .clone()
        })
    }
}

/// Serves the admin API until the process exits.
pub async fn serve(listener: tokio::net::TcpListener, state: AdminState) {
    let app = Router::new()
        .route("/status", get(status))
        .route("/config_dump", get(config_dump))
        .route("/debug/bpf", get(debug_bpf))
        .route("/logging", get(logging).post(logging))
        .with_state(state)
        .layer(axum::middleware::map_response(crate::logging::flush_after));
    if let Err(e) = axum::serve(listener, app).await {
        error!(error = %e, "admin API stopped");
    }
}

async fn status(State(state): State<AdminState>) -> Json<NodeStatus> {
    debug!(target: "shunt::admin", request = "status", "admin request");
    let policies = state.policies();
    let node = state.reader.read();
    let mut status = node_status(&node, policies.as_deref());
    status.xds = state.reader.xds().map(|x| x.summary());
    if node.mode == RedirectMode::Ebpf {
        status.fast_path = Some(
            state
                .fast_path
                .status(node.mesh_local.as_ref(), node.kernel_authz.as_ref()),
        );
        // Per pod: what the fast path's reporter counted (vip).
        let per_pod = state.fast_path.per_pod();
        for pod in &mut status.pods {
            let key = crate::state::WorkloadKey::new(&pod.namespace, &pod.name);
            pod.fast_path = per_pod.get(&key).copied();
        }
    }
    Json(status)
}

async fn config_dump(State(state): State<AdminState>) -> Json<ConfigDump> {
    debug!(target: "shunt::admin", request = "config_dump", "admin request");
    let node = state.reader.read();
    let proxy = state.reader.proxy();
    let pending_identities = proxy
        .map(|p| p.identities().identities())
        .unwrap_or_default();
    let roots = proxy.map(|p| p.identities().roots()).unwrap_or_default();
    let proxied = proxy
        .map(|p| p.pods().iter().map(ToString::to_string).collect())
        .unwrap_or_default();
    // The store's read lock is held while the dump is built (copies of
    // what it holds; no I/O, no await): its one writer waits that long.
    let store = state
        .store
        .as_ref()
        .map(|s| s.read().unwrap_or_else(|p| p.into_inner()));
    Json(config_dump::build(&config_dump::DumpInputs {
        node: &node,
        store: store.as_deref(),
        pending_identities: &pending_identities,
        roots: &roots,
        proxied,
        log_filter: crate::logging::current_filter(),
        xds: state.reader.xds().map(|x| x.snapshot()),
        pod_source: state.reader.pod_source(),
    }))
}

/// `GET /debug/bpf`: the kernel objects behind redirection.
#[derive(Clone, Debug, Serialize)]
pub struct DebugBpf {
    pub mode: String,
    /// eBPF mode: what is pinned (maps with sizes and fill, links).
    pub pinned: Option<crate::redirect::ebpf::PinReport>,
    /// Per enrolled pod: its hooks (TC programs and socket-program links,
    /// or iptables chains with their rule counts and policy routes).
    pub pods: Vec<EnrolledDump>,
}

async fn debug_bpf(
    State(state): State<AdminState>,
) -> Result<Json<DebugBpf>, (StatusCode, String)> {
    debug!(target: "shunt::admin", request = "debug_bpf", "admin request");
    let node = state.reader.read();
    let mode = node.mode;
    let pods = node.enrolled().map(config_dump::enrolled_dump).collect();
    // Reading the pins opens files under bpffs (no netns): on a blocking
    // thread all the same, as it is file I/O.
    let pin_dir = state.bpf_pin_dir.clone();
    let pinned = tokio::task::spawn_blocking(move || {
        (mode == RedirectMode::Ebpf).then(|| crate::redirect::ebpf::pin_report(&pin_dir))
    })
    .await
    .map_err(|e| {
        (
            StatusCode::INTERNAL_SERVER_ERROR,
            format!("debug_bpf failed: {e}"),
        )
    })?;
    Ok(Json(DebugBpf {
        mode: mode.to_string(),
        pinned,
        pods,
    }))
}

#[derive(Debug, Deserialize)]
struct LoggingQuery {
    level: Option<String>,
    reset: Option<String>,
}

/// `/logging`: the answer names the filter in force.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct LoggingAnswer {
    pub filter: Option<String>,
}

async fn logging(
    Query(query): Query<LoggingQuery>,
) -> Result<Json<LoggingAnswer>, (StatusCode, String)> {
    let wanted = match (&query.level, &query.reset) {
        (Some(level), _) => Some(level.as_str()),
        (None, Some(_)) => None,
        (None, None) => {
            return Ok(Json(LoggingAnswer {
                filter: crate::logging::current_filter(),
            }));
        }
    };
    match crate::logging::set_filter(wanted) {
        Ok(filter) => {
            info!(%filter, "log filter changed through the admin API");
            Ok(Json(LoggingAnswer {
                filter: Some(filter),
            }))
        }
        Err(e @ crate::logging::SetFilterError::Invalid { .. }) => Err((
            StatusCode::BAD_REQUEST,
            format!(
                "{e}
"
            ),
        )),
        Err(e) => Err((
            StatusCode::INTERNAL_SERVER_ERROR,
            format!(
                "{e}
"
            ),
        )),
    }
}

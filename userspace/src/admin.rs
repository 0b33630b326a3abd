//! The admin API (127.0.0.1:15000 in the agent's netns): views of what the
//! agent owns, and the log filter. `shunt status` is its client.
//!
//! - `GET /status`: the node and its pods ([`NodeStatus`]);
//! - `GET /config_dump`: workloads, identities with their certificates,
//!   enrolled pods and their hooks ([`ConfigDump`]);
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
    collections::BTreeMap,
    net::IpAddr,
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

use crate::{
    api::{CertificateStatus, KernelDenial, NodeStatus, PodStatus},
    authz::PolicySet,
    redirect::{Hook, RedirectMode},
    snapshot::{NodeSnapshot, SnapshotReader},
    state::PodState,
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
        .with_state(state);
    if let Err(e) = axum::serve(listener, app).await {
        error!(error = %e, "admin API stopped");
    }
}

async fn status(State(state): State<AdminState>) -> Json<NodeStatus> {
    debug!(target: "shunt::admin", request = "status", "admin request");
    let policies = state.policies();
    let mut status = node_status(&state.reader.read(), policies.as_deref());
    status.xds = state.reader.xds().map(|x| x.summary());
    Json(status)
}

/// `GET /config_dump`: what the agent was given and what it made of it.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct ConfigDump {
    pub node: String,
    /// Redirection mode in use.
    pub mode: String,
    pub trust_domain: String,
    /// Whether the pod source has listed every pod.
    pub synced: bool,
    /// The log filter in force.
    pub log_filter: Option<String>,
    /// Every workload the agent knows (every node's with the builtin proxy,
    /// which needs them to find peers; else this node's).
    pub workloads: Vec<WorkloadDump>,
    /// Identities the proxy holds certificates for.
    pub identities: Vec<IdentityDump>,
    /// Pods the redirector has enrolled, with their hooks.
    pub enrolled: Vec<EnrolledDump>,
    /// Pods the proxy serves (listeners bound in their netns).
    pub proxied: Vec<String>,
    /// With `--xds-address`: istiod's connection (connected since, last
    /// ACK/NACK per type and why) and every resource it sent, with its
    /// version: where each workload, service and policy came from.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds: Option<crate::api::XdsStatus>,
    /// Every authorization policy the proxy enforces, in key order.
    #[serde(default)]
    pub policies: Vec<PolicyDump>,
}

/// An authorization policy, summarised.
#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct PolicyDump {
    pub namespace: String,
    pub name: String,
    /// `global`, `namespace` or `workload_selector`.
    pub scope: String,
    /// `ALLOW` or `DENY`.
    pub action: String,
    /// The selector's labels (workload-selector policies from the file or
    /// the Kubernetes API).
    pub selector: Option<BTreeMap<String, String>>,
    /// How many rules (an ALLOW with none allows nothing).
    pub rules: usize,
    pub dry_run: bool,
}

impl From<&crate::authz::Policy> for PolicyDump {
    fn from(p: &crate::authz::Policy) -> Self {
        Self {
            namespace: p.namespace.clone(),
            name: p.name.clone(),
            scope: match p.scope {
                crate::authz::Scope::Global => "global",
                crate::authz::Scope::Namespace => "namespace",
                crate::authz::Scope::WorkloadSelector => "workload_selector",
            }
            .into(),
            action: p.action.to_string(),
            selector: p.selector.clone(),
            rules: p.rules.len(),
            dry_run: p.dry_run,
        }
    }
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct WorkloadDump {
    pub namespace: String,
    pub name: String,
    pub service_account: String,
    pub identity: String,
    pub ips: Vec<IpAddr>,
    pub node: String,
    pub netns: Option<PathBuf>,
    pub dataplane_mode: String,
    /// What the agent did with it (this node's pods only).
    pub state: Option<PodState>,
    /// The authorization policies that apply to it (`namespace/name`).
    #[serde(default)]
    pub policies: Vec<String>,
    /// The source's id (xDS: the resource name, e.g.
    /// `Kubernetes//Pod/default/web-0`); empty when the source has none.
    #[serde(default)]
    pub uid: String,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct IdentityDump {
    pub identity: String,
    /// Absent while the first certificate is being issued.
    pub certificate: Option<CertificateStatus>,
}

#[derive(Clone, Debug, Serialize, Deserialize)]
pub struct EnrolledDump {
    pub namespace: String,
    pub name: String,
    pub netns: PathBuf,
    pub netns_cookie: u64,
    pub mode: String,
    pub hooks: Vec<Hook>,
}

async fn config_dump(State(state): State<AdminState>) -> Json<ConfigDump> {
    debug!(target: "shunt::admin", request = "config_dump", "admin request");
    let node = state.reader.read();
    let td = &node.trust_domain;
    let states: BTreeMap<_, _> = node
        .pods
        .iter()
        .map(|p| (p.workload.key(), p.state.clone()))
        .collect();
    let policy_set = state.policies();
    let dump = |w: &crate::state::Workload| WorkloadDump {
        policies: policy_set
            .as_ref()
            .map(|set| set.applicable_names(w))
            .unwrap_or_default(),
        namespace: w.namespace.clone(),
        name: w.name.clone(),
        service_account: w.service_account.clone(),
        identity: w.identity(td).to_string(),
        ips: w.ips.clone(),
        node: w.node.clone(),
        netns: w.netns.clone(),
        dataplane_mode: w.dataplane_mode.to_string(),
        state: states.get(&w.key()).cloned(),
        uid: w.uid.clone(),
    };
    let mut workloads: Vec<WorkloadDump> = match &state.store {
        Some(store) => store
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .map(dump)
            .collect(),
        None => node.pods.iter().map(|p| dump(&p.workload)).collect(),
    };
    workloads.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
    let identities = node
        .certificates
        .iter()
        .map(|(id, cert)| IdentityDump {
            identity: id.to_string(),
            certificate: Some(CertificateStatus::from(cert.as_ref())),
        })
        .chain(state.reader.proxy().into_iter().flat_map(|proxy| {
            // Identities registered but not issued yet.
            proxy
                .identities()
                .identities()
                .into_iter()
                .filter(|id| !node.certificates.contains_key(id))
                .map(|id| IdentityDump {
                    identity: id.to_string(),
                    certificate: None,
                })
        }))
        .collect();
    let proxied = state
        .reader
        .proxy()
        .map(|proxy| proxy.pods().iter().map(ToString::to_string).collect())
        .unwrap_or_default();
    Json(ConfigDump {
        node: node.node.clone(),
        mode: node.mode.to_string(),
        trust_domain: td.to_string(),
        synced: node.synced,
        log_filter: crate::logging::current_filter(),
        workloads,
        identities,
        enrolled: node.enrolled().cloned().map(EnrolledDump::from).collect(),
        proxied,
        policies: policy_set
            .iter()
            .flat_map(|set| set.iter().map(PolicyDump::from))
            .collect(),
        xds: state.reader.xds().map(|x| x.snapshot()),
    })
}

impl From<crate::redirect::EnrolledPod> for EnrolledDump {
    fn from(p: crate::redirect::EnrolledPod) -> Self {
        Self {
            namespace: p.key.namespace.clone(),
            name: p.key.name.clone(),
            netns: p.netns,
            netns_cookie: p.netns_cookie,
            mode: p.mode.to_string(),
            hooks: p.hooks,
        }
    }
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
    let pods = node.enrolled().cloned().map(EnrolledDump::from).collect();
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

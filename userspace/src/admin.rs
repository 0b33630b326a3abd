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

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, time::SystemTime};

use axum::{
    Json, Router,
    extract::{Query, State},
    http::StatusCode,
    routing::get,
};
use serde::{Deserialize, Serialize};
use tracing::{debug, error, info};

use crate::{
    agent::{SharedAgent, lock},
    redirect::{Hook, RedirectMode},
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
    /// The istiod connection, with `--xds-address`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds: Option<crate::xds::XdsSummary>,
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
    /// The current certificate of the pod's identity (with the builtin
    /// proxy, once issued).
    #[serde(default)]
    pub certificate: Option<CertificateStatus>,
}

/// A workload certificate's validity.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CertificateStatus {
    /// Seconds since the epoch.
    pub not_before: i64,
    pub not_after: i64,
}

impl From<&crate::identity::WorkloadCert> for CertificateStatus {
    fn from(cert: &crate::identity::WorkloadCert) -> Self {
        Self {
            not_before: crate::metrics::unix_seconds(cert.not_before()),
            not_after: crate::metrics::unix_seconds(cert.not_after()),
        }
    }
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
    /// Outbound connects rewritten to the proxy (eBPF mode).
    #[serde(default)]
    pub outbound_redirected: u64,
    /// Inbound connections steered to the proxy (eBPF mode).
    #[serde(default)]
    pub inbound_redirected: u64,
    /// Outbound connects refused because the proxy listener was missing.
    #[serde(default)]
    pub outbound_fail_closed: u64,
    /// Inbound packets dropped because the proxy listener was missing.
    #[serde(default)]
    pub inbound_fail_closed: u64,
    /// Payload bytes moved between app and proxy sockets by sk_msg.
    #[serde(default)]
    pub spliced_bytes: u64,
    /// Connection directions that stopped splicing (reader too far behind,
    /// or no peer to splice into) and went on over the TCP stack.
    #[serde(default)]
    pub splice_fallbacks: u64,
}

impl From<shunt_common::PodCounters> for Counters {
    fn from(c: shunt_common::PodCounters) -> Self {
        Self {
            packets_in: c.packets_in,
            bytes_in: c.bytes_in,
            packets_out: c.packets_out,
            bytes_out: c.bytes_out,
            outbound_redirected: c.outbound_redirected,
            inbound_redirected: c.inbound_redirected,
            outbound_fail_closed: c.outbound_fail_closed,
            inbound_fail_closed: c.inbound_fail_closed,
            spliced_bytes: c.spliced_bytes,
            splice_fallbacks: c.splice_fallbacks,
        }
    }
}

/// What the admin API reads from.
#[derive(Clone)]
pub struct AdminState {
    pub agent: SharedAgent,
    /// The eBPF mode's pin dir (`--bpf-pin-dir`), for `/debug/bpf`.
    pub bpf_pin_dir: PathBuf,
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

/// Runs `read` on a blocking thread (reading hooks enters pod namespaces).
async fn blocking<T: Send + 'static>(
    what: &'static str,
    read: impl FnOnce() -> T + Send + 'static,
) -> Result<Json<T>, (StatusCode, String)> {
    debug!(target: "shunt::admin", request = what, "admin request");
    tokio::task::spawn_blocking(read)
        .await
        .map(Json)
        .map_err(|e| {
            (
                StatusCode::INTERNAL_SERVER_ERROR,
                format!("{what} failed: {e}"),
            )
        })
}

async fn status(State(state): State<AdminState>) -> Result<Json<NodeStatus>, (StatusCode, String)> {
    blocking("status", move || lock(&state.agent).status()).await
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
    pub xds: Option<crate::xds::XdsStatus>,
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

async fn config_dump(
    State(state): State<AdminState>,
) -> Result<Json<ConfigDump>, (StatusCode, String)> {
    blocking("config_dump", move || {
        let agent = lock(&state.agent);
        let td = agent.trust_domain().clone();
        let states: BTreeMap<_, _> = agent.pods().map(|(w, s)| (w.key(), s.clone())).collect();
        let dump = |w: &crate::state::Workload| WorkloadDump {
            namespace: w.namespace.clone(),
            name: w.name.clone(),
            service_account: w.service_account.clone(),
            identity: w.identity(&td).to_string(),
            ips: w.ips.clone(),
            node: w.node.clone(),
            netns: w.netns.clone(),
            dataplane_mode: w.dataplane_mode.to_string(),
            state: states.get(&w.key()).cloned(),
            uid: w.uid.clone(),
        };
        let mut workloads: Vec<WorkloadDump> = match agent.proxy() {
            Some(handle) => handle
                .workloads
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .iter()
                .map(dump)
                .collect(),
            None => agent.pods().map(|(w, _)| dump(w)).collect(),
        };
        workloads.sort_by(|a, b| (&a.namespace, &a.name).cmp(&(&b.namespace, &b.name)));
        let (identities, proxied) = match agent.proxy() {
            Some(handle) => {
                let ids = handle.proxy.identities();
                (
                    ids.identities()
                        .into_iter()
                        .map(|id| IdentityDump {
                            certificate: ids.current(&id).as_deref().map(CertificateStatus::from),
                            identity: id.to_string(),
                        })
                        .collect(),
                    handle
                        .proxy
                        .pods()
                        .iter()
                        .map(ToString::to_string)
                        .collect(),
                )
            }
            None => (Vec::new(), Vec::new()),
        };
        let enrolled = agent
            .redirector()
            .list()
            .into_iter()
            .map(EnrolledDump::from)
            .collect();
        ConfigDump {
            node: agent.node().to_string(),
            mode: agent.redirector().mode().to_string(),
            trust_domain: td.to_string(),
            synced: agent.synced(),
            log_filter: crate::logging::current_filter(),
            workloads,
            identities,
            enrolled,
            proxied,
            xds: agent.xds().map(|x| x.snapshot()),
        }
    })
    .await
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
    pub pinned: Option<crate::bpf_debug::PinReport>,
    /// Per enrolled pod: its hooks (TC programs and socket-program links,
    /// or iptables chains with their rule counts and policy routes).
    pub pods: Vec<EnrolledDump>,
}

async fn debug_bpf(
    State(state): State<AdminState>,
) -> Result<Json<DebugBpf>, (StatusCode, String)> {
    blocking("debug_bpf", move || {
        let agent = lock(&state.agent);
        let mode = agent.redirector().mode();
        let pods = agent
            .redirector()
            .list()
            .into_iter()
            .map(EnrolledDump::from)
            .collect();
        DebugBpf {
            mode: mode.to_string(),
            pinned: (mode == RedirectMode::Ebpf)
                .then(|| crate::bpf_debug::inspect(&state.bpf_pin_dir)),
            pods,
        }
    })
    .await
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

/// Seconds from now until `unix` (negative when past).
pub fn seconds_until(unix: i64, now: SystemTime) -> i64 {
    unix - crate::metrics::unix_seconds(now)
}

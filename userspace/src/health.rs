//! Readiness (`/healthz/ready`, port 15021 by contract): the agent is ready
//! when
//!
//! - redirection is loaded (programs or rules) and every enrolled pod's
//!   hooks are in place;
//! - the pod source has listed every pod (mesh pods that could not be
//!   enrolled are named in the answer and counted in the metrics, but do
//!   not make the agent unready: one broken pod must not stall a DaemonSet
//!   rollout that waits for readiness node by node);
//! - every enrolled pod's identity has a valid certificate (when the builtin
//!   proxy runs; without it there is nothing to present);
//! - with `--xds-address`, istiod has sent workloads and policies once (a
//!   later disconnect keeps readiness: what it sent is kept).
//!
//! The answer is 200 or 503, with one line per check either way. It is
//! computed from the reconciler's last [`NodeSnapshot`]: answering enters no
//! pod's netns and waits on no reconcile.

use std::{fmt::Write as _, time::SystemTime};

use crate::{
    snapshot::{NodeSnapshot, SnapshotReader},
    state::PodState,
};

/// One condition of readiness.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Check {
    pub name: &'static str,
    pub ok: bool,
    pub detail: String,
}

/// Every condition, evaluated at one moment.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct Readiness {
    pub checks: Vec<Check>,
}

impl Readiness {
    /// Evaluates what the reconciler last published (hooks as its verify
    /// pass found them) and the certificates as they are now.
    pub fn evaluate(node: &NodeSnapshot) -> Self {
        let mut checks = Vec::with_capacity(3);

        let enrolled: Vec<_> = node.enrolled().collect();
        let missing: Vec<String> = enrolled
            .iter()
            .flat_map(|pod| {
                pod.hooks
                    .iter()
                    .filter(|h| !h.present)
                    .map(move |h| format!("{}: {} missing", pod.key, h.name))
            })
            .collect();
        checks.push(Check {
            name: "redirection",
            ok: missing.is_empty(),
            detail: if missing.is_empty() {
                format!("{} loaded; {} pod(s) redirected", node.mode, enrolled.len())
            } else {
                missing.join("; ")
            },
        });

        let synced = node.synced;
        let waiting: Vec<String> = node
            .pods
            .iter()
            .filter(|p| p.workload.captured() && p.workload.netns.is_some())
            .filter_map(|p| match &p.state {
                PodState::Enrolled => None,
                PodState::Pending(why) | PodState::Error(why) => {
                    Some(format!("{}: {why}", p.workload.key()))
                }
                PodState::NotInMesh => Some(format!("{}: not enrolled", p.workload.key())),
            })
            .collect();
        checks.push(Check {
            name: "pods",
            ok: synced,
            detail: if !synced {
                "the pod source has not listed the pods yet".into()
            } else if waiting.is_empty() {
                let mesh = node.pods.iter().filter(|p| p.workload.captured()).count();
                format!("pod source synced; {mesh} mesh pod(s) of this node enrolled")
            } else {
                format!(
                    "pod source synced; not enrolled yet: {}",
                    waiting.join("; ")
                )
            },
        });

        // A snapshot carries the proxy's counters exactly when a builtin
        // proxy runs.
        let certificates = if node.proxy.is_none() {
            Check {
                name: "certificates",
                ok: true,
                detail: "no builtin proxy: no certificate needed".into(),
            }
        } else {
            let now = SystemTime::now();
            let mut wanted: Vec<_> = node
                .pods
                .iter()
                .filter(|p| p.state == PodState::Enrolled)
                .map(|p| p.workload.identity(&node.trust_domain))
                .collect();
            wanted.sort();
            wanted.dedup();
            let lacking: Vec<String> = wanted
                .iter()
                .filter(|id| {
                    !node
                        .certificates
                        .get(*id)
                        .is_some_and(|cert| cert.is_valid_at(now))
                })
                .map(ToString::to_string)
                .collect();
            Check {
                name: "certificates",
                ok: lacking.is_empty(),
                detail: if lacking.is_empty() {
                    format!("{} identity(ies) with a valid certificate", wanted.len())
                } else {
                    format!("no valid certificate yet for {}", lacking.join(", "))
                },
            }
        };
        checks.push(certificates);
        Readiness { checks }
    }

    pub fn ready(&self) -> bool {
        self.checks.iter().all(|c| c.ok)
    }

    /// `ready` or `not ready`, then one line per check.
    pub fn render(&self) -> String {
        let mut out = String::from(if self.ready() {
            "ready\n"
        } else {
            "not ready\n"
        });
        for c in &self.checks {
            let _ = writeln!(
                out,
                "{}: {} ({})",
                c.name,
                if c.ok { "ok" } else { "FAIL" },
                c.detail
            );
        }
        out
    }
}

/// Whether istiod has sent both resource types once (`--xds-address`). A
/// later disconnect keeps readiness: what istiod sent is kept.
pub fn xds_check(xds: &crate::api::XdsStatusHandle) -> Check {
    let summary = xds.summary();
    Check {
        name: "xds",
        ok: summary.synced,
        detail: if summary.synced {
            format!(
                "istiod {}: {} workload(s), {} service(s), {} policy(ies){}",
                summary.address,
                summary.workloads,
                summary.services,
                summary.policies,
                if summary.connected {
                    ""
                } else {
                    "; reconnecting (keeping what it sent)"
                }
            )
        } else {
            format!(
                "waiting for istiod {} to send workloads and policies{}",
                summary.address,
                summary
                    .last_error
                    .map(|e| format!(": {e}"))
                    .unwrap_or_default()
            )
        },
    }
}

/// Serves `/healthz/ready` until the process exits.
pub async fn serve(listener: tokio::net::TcpListener, reader: SnapshotReader) {
    use axum::{Router, extract::State, http::StatusCode, routing::get};
    async fn ready(State(reader): State<SnapshotReader>) -> (StatusCode, String) {
        let mut readiness = Readiness::evaluate(&reader.read());
        if let Some(xds) = reader.xds() {
            readiness.checks.push(xds_check(xds));
        }
        let code = if readiness.ready() {
            StatusCode::OK
        } else {
            StatusCode::SERVICE_UNAVAILABLE
        };
        (code, readiness.render())
    }
    let app = Router::new()
        .route("/healthz/ready", get(ready))
        .with_state(reader)
        .layer(axum::middleware::map_response(crate::logging::flush_after));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "readiness endpoint stopped");
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::{
        redirect::{EnrolledPod, Hook, RedirectMode},
        snapshot::PodSnapshot,
        state::{DataplaneMode, TrustDomain, Workload, WorkloadKey},
    };

    fn node(hook_present: bool, state: PodState) -> NodeSnapshot {
        let workload = Workload {
            name: "web".into(),
            namespace: "default".into(),
            service_account: "web".into(),
            node: "node-a".into(),
            netns: Some("/var/run/netns/web".into()),
            dataplane_mode: DataplaneMode::Ambient,
            ..Default::default()
        };
        let kernel = (state == PodState::Enrolled).then(|| EnrolledPod {
            key: WorkloadKey::new("default", "web"),
            netns: "/var/run/netns/web".into(),
            netns_cookie: 7,
            mode: RedirectMode::Ebpf,
            hooks: vec![Hook {
                name: "tc ingress".into(),
                attachment: "shunt_tc_ingress".into(),
                present: hook_present,
            }],
            counters: Default::default(),
        });
        NodeSnapshot {
            synced: true,
            pods: Arc::from(vec![PodSnapshot {
                workload,
                state,
                kernel,
                kernel_denials: Vec::new(),
            }]),
            ..NodeSnapshot::empty("node-a", RedirectMode::Ebpf, TrustDomain::default())
        }
    }

    #[test]
    fn a_hook_missing_after_the_verify_pass_makes_the_agent_unready() {
        let readiness = Readiness::evaluate(&node(false, PodState::Enrolled));
        assert!(!readiness.ready());
        let text = readiness.render();
        assert!(text.starts_with("not ready\n"), "{text}");
        assert!(
            text.contains("redirection: FAIL (default/web: tc ingress missing)"),
            "{text}"
        );
        let readiness = Readiness::evaluate(&node(true, PodState::Enrolled));
        assert!(readiness.ready(), "{}", readiness.render());
        assert!(
            readiness
                .render()
                .contains("certificates: ok (no builtin proxy: no certificate needed)")
        );
    }

    #[test]
    fn a_pending_pod_is_named_without_making_the_agent_unready() {
        let readiness = Readiness::evaluate(&node(true, PodState::Pending("no eth0 yet".into())));
        assert!(readiness.ready(), "{}", readiness.render());
        assert!(
            readiness.render().contains(
                "pods: ok (pod source synced; not enrolled yet: default/web: no eth0 yet)"
            ),
            "{}",
            readiness.render()
        );
        let unsynced = NodeSnapshot {
            synced: false,
            ..node(true, PodState::Enrolled)
        };
        assert!(!Readiness::evaluate(&unsynced).ready());
    }
}

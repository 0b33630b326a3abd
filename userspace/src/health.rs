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
//! The answer is 200 or 503, with one line per check either way.

use std::{fmt::Write as _, time::SystemTime};

use crate::{
    admin::PodState,
    agent::{NodeAgent, SharedAgent, lock},
    redirect::EnrolledPod,
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
    /// Evaluates the agent; `enrolled` is its redirector's `list()` (passed
    /// in because reading it enters every pod's netns).
    pub fn evaluate(agent: &NodeAgent, enrolled: &[EnrolledPod]) -> Self {
        let mut checks = Vec::with_capacity(4);

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
                format!(
                    "{} loaded; {} pod(s) redirected",
                    agent.redirector().mode(),
                    enrolled.len()
                )
            } else {
                missing.join("; ")
            },
        });

        let synced = agent.synced();
        let waiting: Vec<String> = agent
            .pods()
            .filter(|(w, _)| w.wants_mesh() && w.netns.is_some())
            .filter_map(|(w, state)| match state {
                PodState::Enrolled => None,
                PodState::Pending(why) | PodState::Error(why) => {
                    Some(format!("{}: {why}", w.key()))
                }
                PodState::NotInMesh => Some(format!("{}: not enrolled", w.key())),
            })
            .collect();
        checks.push(Check {
            name: "pods",
            ok: synced,
            detail: if !synced {
                "the pod source has not listed the pods yet".into()
            } else if waiting.is_empty() {
                let mesh = agent.pods().filter(|(w, _)| w.wants_mesh()).count();
                format!("pod source synced; {mesh} mesh pod(s) of this node enrolled")
            } else {
                format!(
                    "pod source synced; not enrolled yet: {}",
                    waiting.join("; ")
                )
            },
        });

        let certificates = match agent.proxy() {
            None => Check {
                name: "certificates",
                ok: true,
                detail: "no builtin proxy: no certificate needed".into(),
            },
            Some(handle) => {
                let identities = handle.proxy.identities();
                let now = SystemTime::now();
                let mut wanted: Vec<_> = agent
                    .pods()
                    .filter(|(_, state)| **state == PodState::Enrolled)
                    .map(|(w, _)| w.identity(agent.trust_domain()))
                    .collect();
                wanted.sort();
                wanted.dedup();
                let lacking: Vec<String> = wanted
                    .iter()
                    .filter(|id| {
                        !identities
                            .current(id)
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
            }
        };
        checks.push(certificates);
        if let Some(xds) = agent.xds() {
            let summary = xds.summary();
            checks.push(Check {
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
            });
        }
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

/// Reads the agent (blocking: kernel reads).
pub fn readiness_blocking(agent: &SharedAgent) -> Readiness {
    let agent = lock(agent);
    let enrolled = agent.redirector().list();
    Readiness::evaluate(&agent, &enrolled)
}

/// Serves `/healthz/ready` until the process exits.
pub async fn serve(listener: tokio::net::TcpListener, agent: SharedAgent) {
    use axum::{Router, extract::State, http::StatusCode, routing::get};
    async fn ready(State(agent): State<SharedAgent>) -> (StatusCode, String) {
        match tokio::task::spawn_blocking(move || readiness_blocking(&agent)).await {
            Ok(r) if r.ready() => (StatusCode::OK, r.render()),
            Ok(r) => (StatusCode::SERVICE_UNAVAILABLE, r.render()),
            Err(e) => (
                StatusCode::SERVICE_UNAVAILABLE,
                format!("not ready\nreadiness check failed: {e}\n"),
            ),
        }
    }
    let app = Router::new()
        .route("/healthz/ready", get(ready))
        .with_state(agent);
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "readiness endpoint stopped");
    }
}

//! What the agent did with one pod of its node.

use serde::{Deserialize, Serialize};

/// What the agent did with a pod (the reconciler's verdict, shown by the
/// admin API, `shunt status`, readiness, metrics and the
/// `ambient.istio.io/redirection` annotation).
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

impl PodState {
    /// The state's name in metrics (`enrolled`, `pending`, `not_in_mesh`,
    /// `error`).
    pub fn metric_name(&self) -> &'static str {
        match self {
            PodState::Enrolled => "enrolled",
            PodState::Pending(_) => "pending",
            PodState::NotInMesh => "not_in_mesh",
            PodState::Error(_) => "error",
        }
    }
}

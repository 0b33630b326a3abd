//! The decision points for inbound connections, before the application is
//! reached:
//!
//! - plaintext (from outside the mesh, no peer identity, handed to the
//!   pod's 15006 listener): first the node-wide switch
//!   (`--inbound-plaintext allow|deny`), then Istio's authorization
//!   policies ([`authorize`]) — without a principal, so a policy requiring
//!   one never matches it;
//! - HBONE: the authorization policies, with the peer certificate's
//!   identity.

use std::net::SocketAddr;

use super::WorkloadLookup;
use crate::{
    authz::{Connection, PolicyKey},
    state::WorkloadKey,
};

/// What happens to inbound plaintext connections.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum InboundPlaintextPolicy {
    /// Delivered to the application (counted and logged): pods keep
    /// answering clients outside the mesh.
    #[default]
    Allow,
    /// Refused with a reset (counted and logged): only mesh (HBONE) traffic
    /// reaches enrolled pods.
    Deny,
}

impl std::fmt::Display for InboundPlaintextPolicy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Allow => "allow",
            Self::Deny => "deny",
        })
    }
}

/// The connection a decision is about.
#[derive(Clone, Copy, Debug)]
pub struct PlaintextConnection<'a> {
    /// The enrolled pod it is going to.
    pub pod: &'a WorkloadKey,
    pub src: SocketAddr,
    /// Its original destination (one of the pod's addresses).
    pub dst: SocketAddr,
}

/// The outcome of a policy check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Decision {
    /// Allowed; by this authorization policy, when one decided.
    Allow(Option<PolicyKey>),
    /// Refused; the reason goes to the access log. `policy`: the
    /// authorization policy that decided (`None`: the node-wide switch).
    Deny {
        reason: String,
        policy: Option<PolicyKey>,
    },
}

/// Checks `connection` to the local pod `pod` against the authorization
/// policies.
pub fn authorize(
    workloads: &dyn WorkloadLookup,
    pod: &WorkloadKey,
    connection: &Connection<'_>,
) -> Decision {
    let verdict = workloads.authorize(pod, connection);
    let policy = verdict.policy().cloned();
    if verdict.is_allowed() {
        Decision::Allow(policy)
    } else {
        Decision::Deny {
            reason: format!("to pod {pod}: {verdict}"),
            policy,
        }
    }
}

impl InboundPlaintextPolicy {
    pub fn decide(&self, connection: &PlaintextConnection<'_>) -> Decision {
        match self {
            Self::Allow => Decision::Allow(None),
            Self::Deny => Decision::Deny {
                reason: format!(
                    "inbound plaintext to pod {} denied by policy (--inbound-plaintext deny)",
                    connection.pod
                ),
                policy: None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn allow_delivers_and_deny_refuses_naming_the_pod() {
        let pod = WorkloadKey::new("default", "server");
        let connection = PlaintextConnection {
            pod: &pod,
            src: "198.18.1.9:40000".parse().expect("addr"),
            dst: "198.18.1.10:8080".parse().expect("addr"),
        };
        assert_eq!(
            InboundPlaintextPolicy::default(),
            InboundPlaintextPolicy::Allow
        );
        assert_eq!(
            InboundPlaintextPolicy::Allow.decide(&connection),
            Decision::Allow(None)
        );
        match InboundPlaintextPolicy::Deny.decide(&connection) {
            Decision::Deny { reason, policy } => {
                assert!(reason.contains("default/server"), "{reason}");
                assert_eq!(policy, None, "the switch is no authorization policy");
            }
            Decision::Allow(_) => panic!("deny allowed"),
        }
    }
}

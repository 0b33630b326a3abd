//! The decision point for inbound plaintext: connections from outside the
//! mesh (no HBONE, so no peer identity) to an enrolled pod, which the
//! redirection hands to the pod's 15006 listener.
//!
//! Today it is one node-wide switch (`--inbound-plaintext allow|deny`);
//! richer policy (per pod, per source range, Istio's
//! `AuthorizationPolicy`) plugs in here, at the one place every such
//! connection passes before the application is reached.

use std::net::SocketAddr;

use crate::state::WorkloadKey;

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
    Allow,
    /// Refused; the reason goes to the access log.
    Deny(String),
}

impl InboundPlaintextPolicy {
    pub fn decide(&self, connection: &PlaintextConnection<'_>) -> Decision {
        match self {
            Self::Allow => Decision::Allow,
            Self::Deny => Decision::Deny(format!(
                "inbound plaintext to pod {} denied by policy (--inbound-plaintext deny)",
                connection.pod
            )),
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
            Decision::Allow
        );
        match InboundPlaintextPolicy::Deny.decide(&connection) {
            Decision::Deny(reason) => assert!(reason.contains("default/server"), "{reason}"),
            Decision::Allow => panic!("deny allowed"),
        }
    }
}

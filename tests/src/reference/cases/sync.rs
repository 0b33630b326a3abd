//! Inbound before the first xDS update (issue 34 item 6): the peer starts
//! while istiod holds its responses; istiod's policy for the namespace is
//! deny-all (an ALLOW policy without rules). Connections made meanwhile,
//! and after the update, must not reach the server.

use shunt_proto::istio::security::Action;

use super::{Case, PLAINTEXT, SLEEP, row};
use crate::reference::{probe::Outcome::Refused, resources::ns_policy};

pub fn cases() -> Vec<Case> {
    let mut deny_all = Case::authz(
        "deny-all for the namespace, probed before and after the first update",
        vec![ns_policy("deny-all", Action::Allow, vec![])],
        vec![row(SLEEP, 8080, Refused), row(PLAINTEXT, 8080, Refused)],
    );
    deny_all.before_sync = vec![row(SLEEP, 8080, Refused), row(PLAINTEXT, 8080, Refused)];
    vec![deny_all]
}

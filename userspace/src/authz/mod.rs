//! Authorization: Istio's L4 `AuthorizationPolicy`, one model for every
//! source ([`model`]), evaluated by one engine ([`engine`]); [`crd`]
//! translates `security.istio.io/v1` objects into the model.
pub mod conformance;
pub mod crd;
pub mod engine;
pub mod kernel;
pub mod model;

pub use engine::{Connection, Destination, PolicySet, Verdict};
pub use model::{
    Action, Cidr, Clause, InvalidCidr, Match, Policy, PolicyKey, Rule, Scope, ServiceAccount,
    StringMatch,
};

/// Istio's root namespace (`meshConfig.rootNamespace`, `istio-system` by
/// default): a policy there without a selector applies to the whole mesh,
/// one with a selector to the matching workloads of every namespace.
pub const ROOT_NAMESPACE: &str = "istio-system";

#[cfg(test)]
mod conformance_tests;

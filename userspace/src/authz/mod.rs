//! Authorization: Istio's L4 `AuthorizationPolicy`, one model for every
//! source ([`model`]).
pub mod model;

pub use model::{
    Action, Cidr, Clause, InvalidCidr, Match, Policy, PolicyKey, Rule, Scope, StringMatch,
};

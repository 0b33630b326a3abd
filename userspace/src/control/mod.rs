//! Pod sources: where the agent learns which pods exist (a local file today; the Kubernetes watch next).
pub mod local;

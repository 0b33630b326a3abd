//! Pod sources: where the agent learns which pods exist — a local workloads
//! file ([`local`]) or the Kubernetes API ([`kube`]).
pub mod kube;
pub mod local;

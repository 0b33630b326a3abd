//! shunt: the node agent of a sidecarless service mesh.
//!
//! Data flows one way through the modules: a pod source (`control/`) says
//! which pods exist → the agent (`agent.rs`) reconciles this node's pods →
//! `proxy/` starts serving each (listeners in its netns, identities from
//! `identity/`) → `redirect/` enrols it in the kernel, so its traffic
//! reaches those listeners → the proxy carries it to its peer over HBONE.
//! `admin.rs`, `status.rs`, `metrics.rs` and `health.rs` only read.

pub mod admin;
pub mod agent;
pub mod authz;
pub mod bpf_debug;
pub mod cli;
pub mod control;
pub mod error;
pub mod health;
pub mod identity;
pub mod logging;
pub mod metrics;
pub mod netns;
pub mod proxy;
pub mod redirect;
pub mod state;
pub mod status;
pub mod tls;
pub mod xds;

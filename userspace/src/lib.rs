//! shunt: the node agent of a sidecarless service mesh.
//!
//! Data flows one way through the modules: a pod source (`control/`) says
//! which pods exist → the agent (`agent.rs`) reconciles this node's pods →
//! `redirect/` enrols each in the kernel → (later) `proxy/` carries the
//! traffic to its peer. `admin.rs` and `status.rs` only read.

pub mod admin;
pub mod agent;
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

//! shunt: the node agent of a sidecarless service mesh.
//!
//! Data flows one way through the modules: a pod source (`control/`) says
//! which pods are on this node → the agent (`agent.rs`) reconciles them →
//! `redirect/` enrols each in the kernel → (later) `proxy/` carries the
//! traffic to its peer.

pub mod control;
pub mod netns;
pub mod state;

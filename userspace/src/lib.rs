//! shunt: the node agent of a sidecarless service mesh.
//!
//! Data flows one way through the modules: sources (`control/`) push this
//! node's pods and the cluster-wide view through one interface
//! (`control::SourceSink`) → the reconciler (`agent.rs`) reconciles this
//! node's pods → `proxy/` starts serving each (listeners in its netns,
//! identities from `identity/`) → `redirect/` enrols it in the kernel, so
//! its traffic reaches those listeners → the proxy carries it to its peer
//! over HBONE. `app/` builds and wires the parts. The reconciler publishes a
//! `snapshot::NodeSnapshot`; `admin.rs`, `metrics/` and `health.rs` only
//! read that, `status.rs` reads the admin API (`api.rs`). See
//! docs/ARCHITECTURE.md.

pub mod admin;
pub mod agent;
pub mod api;
pub mod app;
pub mod authz;
pub mod cli;
pub mod control;
pub mod crypto;
pub mod dns;
pub mod error;
pub mod fastpath;
pub mod health;
pub mod identity;
pub mod inpod;
pub mod logging;
pub mod metrics;
pub mod netns;
pub mod proxy;
pub mod redirect;
pub mod shards;
pub mod snapshot;
pub mod state;
pub mod status;
pub mod store;
pub mod timers;
pub mod tls;
pub mod xds;

#[cfg(test)]
mod fuzz;

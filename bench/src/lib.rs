//! shunt's benchmark harness: the same workloads over direct (no mesh),
//! iptables + proxy and eBPF + proxy paths, same node and cross node,
//! passthrough and HBONE, in network namespaces on the real kernel.
//!
//! `shunt-bench run [--quick]` (what `cargo xtask bench` calls) builds the
//! topologies, starts the real agents, runs the load generator
//! (`shunt-bench client`, in the client pod) against the servers
//! (`shunt-bench server`, in the server pods), and writes
//! `bench/results/<name>.md`, `<name>.svg` and `raw/<name>.json`.

pub mod client;
pub mod harness;
pub mod pattern;
pub mod report;
pub mod server;
pub mod svg;
pub mod sys;

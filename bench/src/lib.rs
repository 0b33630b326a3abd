//! shunt's benchmark harness: the same workloads over direct (no mesh),
//! iptables + proxy and eBPF + proxy paths, same node and cross node,
//! passthrough and HBONE, in network namespaces on the real kernel.
//!
//! `shunt-bench run [--quick]` (what `cargo xtask bench` calls) builds the
//! topologies, starts the real agents, runs the load generator
//! (`shunt-bench client`, in the client pod) against the servers
//! (`shunt-bench server`, in the server pods), and writes
//! `bench/results/<name>.json` (every measurement, raw), and from it
//! `<name>.md` and `<name>.svg`; `shunt-bench render <name>.json` writes
//! those two again from the JSON alone.
//!
//! Modules, in the direction data flows: `client`/`server` (the load and
//! its report) → `measure` (the harness) → `model` (what a run recorded)
//! → `report`/`svg` (what a reader sees). `measure` and `report` both use
//! `model`; neither uses the other's internals (`measure` prints progress
//! with `report::one_line`, nothing goes back).

pub mod client;
pub mod measure;
pub mod model;
pub mod pattern;
pub mod report;
pub mod server;
pub mod svg;
pub mod sys;

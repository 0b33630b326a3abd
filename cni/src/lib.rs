//! shunt's chained CNI plugin (`shunt-cni`) and what the node agent shares
//! with it.
//!
//! - [`plugin`]: the CNI 1.0 commands (ADD, DEL, CHECK, VERSION) as the
//!   runtime calls them: `prevResult` passed through unchanged, errors as
//!   CNI error JSON. At ADD the plugin asks the node agent over a
//!   node-local unix socket to capture the sandbox and returns only once
//!   the agent answered.
//! - [`wire`]: the request and answer on that socket (one JSON document
//!   each way per connection), written by the plugin and read by the
//!   agent's server (`control::cni` in the `shunt` crate).
//! - [`conflist`]: shunt-cni's entry in the node's primary CNI network
//!   configuration list, added and removed by the agent, as istio-cni's
//!   installer does.
pub mod conflist;
pub mod plugin;
pub mod wire;

/// The plugin's `type` in a network configuration (and its binary's name).
pub const PLUGIN_TYPE: &str = "shunt-cni";

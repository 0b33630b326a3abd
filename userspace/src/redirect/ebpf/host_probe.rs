//! Kubelet's probes in the eBPF mode, the agent's side
//! (`ebpf/src/host_probe.rs` is the kernel's): the node netns's cookie,
//! written once at load (`--node-netns`; 0 turns the feature off), and the
//! enrolled pods' IPv4 addresses, kept with each slot's addresses, that
//! sockops checks a node socket's connect against. Nothing is written in
//! the node's netns itself. Counted in `SHUNT_HOST_PROBE_STATS`
//! (`bpftool map dump pinned <pin dir>/SHUNT_HOST_PROBE_STATS`).

use std::path::Path;

use aya::{
    Ebpf,
    maps::{Array, HashMap as BpfHashMap, MapData},
};
use shunt_common::{HostProbeNode, maps};
use tracing::{info, warn};

use super::{LoadError, load::take_map};
use crate::netns::NetNs;

/// The maps the agent writes for kubelet's probes.
pub(super) struct HostProbeMaps {
    targets: BpfHashMap<MapData, u32, u32>,
    /// Held: the programs loaded after this reference it by this fd.
    _node: Array<MapData, HostProbeNode>,
}

impl HostProbeMaps {
    /// Opens the maps and writes the node netns's cookie (or 0).
    pub(super) fn open(ebpf: &mut Ebpf, node_netns: Option<&Path>) -> Result<Self, LoadError> {
        let mut node: Array<MapData, HostProbeNode> = take_map(ebpf, maps::HOST_PROBE_NODE)?;
        let netns_cookie = match node_netns {
            Some(path) => NetNs::open(path)
                .and_then(|netns| netns.cookie())
                .map_err(|e| LoadError::Map {
                    name: maps::HOST_PROBE_NODE,
                    detail: format!("--node-netns {}: {e}", path.display()),
                })?,
            None => 0,
        };
        node.set(0, HostProbeNode { netns_cookie }, 0)
            .map_err(|e| LoadError::Map {
                name: maps::HOST_PROBE_NODE,
                detail: e.to_string(),
            })?;
        if let Some(path) = node_netns {
            info!(node_netns = %path.display(), "kubelet's probes: the node's connections to enrolled pods get the probe source");
        }
        Ok(Self {
            targets: take_map(ebpf, maps::PROBE_TARGETS)?,
            _node: node,
        })
    }

    /// A slot's IPv4 address changed (`old`, `new`: network order, 0 for
    /// none).
    pub(super) fn pod_addr_changed(&mut self, slot: u32, old: u32, new: u32) {
        if old != 0 && old != new {
            let _ = self.targets.remove(&old);
        }
        if new != 0
            && let Err(e) = self.targets.insert(new, slot, 0)
        {
            warn!(slot, error = %e, "cannot record an enrolled pod's address for kubelet's probes");
        }
    }
}

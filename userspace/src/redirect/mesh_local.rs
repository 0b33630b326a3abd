//! What flow 2 of the fast path may carry — same node, mesh to mesh, in
//! the kernel (`ebpf/src/mesh_local.rs`) — derived by the reconciler from
//! its enrolled pods and the store, and written through
//! [`super::Redirector::write_mesh_local`] right after the authorization
//! verdicts it depends on.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::IpAddr,
};

use crate::state::{TunnelProtocol, Workload};

/// The enrolled source pods whose verdicts the kernel holds, and the
/// eligible destination addresses of this node's pods with their slots.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalTable {
    pub sources: BTreeSet<u32>,
    pub destinations: BTreeMap<IpAddr, u32>,
}

impl MeshLocalTable {
    /// Every enrolled pod (slot, its workload as the store knows it) is a
    /// source, since the verdicts were compiled for each; a destination
    /// address qualifies when its pod is a mesh pod reached over HBONE
    /// without a waypoint, and the compiler knew its verdicts exactly
    /// (`inexact`: the addresses of pairs it left to the proxy, for which a
    /// missing entry does not mean "allowed"). Only IPv4 addresses: flow 2
    /// is carried by connect4 alone.
    pub fn derive(enrolled: &[(u32, &Workload)], inexact: &BTreeSet<IpAddr>) -> Self {
        let mut table = Self::default();
        for &(slot, workload) in enrolled {
            table.sources.insert(slot);
            if !workload.wants_mesh()
                || workload.waypoint.is_some()
                || workload.tunnel != TunnelProtocol::Hbone
            {
                continue;
            }
            for ip in &workload.ips {
                if ip.is_ipv4() && !inexact.contains(ip) {
                    table.destinations.insert(*ip, slot);
                }
            }
        }
        table
    }
}

/// What [`super::Redirector::write_mesh_local`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalWritten {
    /// Whether flow 2 is on now.
    pub on: bool,
    pub sources: usize,
    pub destinations: usize,
    /// A write that failed (flow 2 was left off).
    pub error: Option<String>,
}

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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{DataplaneMode, GatewayAddress, GatewayDestination};

    fn pod(name: &str, ips: &[&str]) -> Workload {
        Workload {
            name: name.into(),
            namespace: "default".into(),
            ips: ips.iter().map(|ip| ip.parse().expect("test IP")).collect(),
            dataplane_mode: DataplaneMode::Ambient,
            ..Default::default()
        }
    }

    #[test]
    fn only_exact_hbone_pods_without_a_waypoint_are_destinations() {
        let plain = pod("plain", &["198.18.1.10", "fd00::10"]);
        let mut waypointed = pod("waypointed", &["198.18.1.11"]);
        waypointed.waypoint = Some(GatewayAddress {
            destination: GatewayDestination::Address {
                network: String::new(),
                ip: "198.18.1.99".parse().expect("ip"),
            },
            hbone_mtls_port: 15008,
        });
        let mut no_tunnel = pod("no-tunnel", &["198.18.1.12"]);
        no_tunnel.tunnel = TunnelProtocol::None;
        let inexact_pod = pod("inexact", &["198.18.1.13"]);
        let mut outside = pod("outside", &["198.18.1.14"]);
        outside.dataplane_mode = DataplaneMode::None;
        let enrolled = [
            (0, &plain),
            (1, &waypointed),
            (2, &no_tunnel),
            (3, &inexact_pod),
            (4, &outside),
        ];
        let inexact: BTreeSet<IpAddr> = ["198.18.1.13".parse().expect("ip")].into();
        let table = MeshLocalTable::derive(&enrolled, &inexact);
        assert_eq!(table.sources, (0..5).collect());
        // IPv4 only (connect4 carries flow 2); the rest keep the proxy.
        assert_eq!(
            table.destinations,
            [("198.18.1.10".parse().expect("ip"), 0)].into()
        );
    }
}

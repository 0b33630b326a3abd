//! What flow 2 of the fast path may carry — same node, mesh to mesh, in
//! the kernel (`ebpf/src/mesh_local.rs`) — derived by the reconciler from
//! its enrolled pods and the store, and written through
//! [`super::Redirector::write_mesh_local`] right after the authorization
//! verdicts it depends on.

use std::{
    collections::{BTreeMap, BTreeSet},
    net::{IpAddr, SocketAddr},
};

use shunt_common::{MAX_MESH_LOCAL_SERVICES, MAX_MESH_SERVICE_ENDPOINTS};

use crate::state::{Service, TunnelProtocol, Workload};

/// The enrolled source pods whose verdicts the kernel holds, the eligible
/// destination addresses of this node's pods with their slots, and the
/// service VIPs and ports whose every ready endpoint is one of them.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalTable {
    pub sources: BTreeSet<u32>,
    pub destinations: BTreeMap<IpAddr, u32>,
    /// VIP:port → its endpoints (address and target port) with their
    /// weights, in the service's order.
    pub services: BTreeMap<SocketAddr, Vec<(SocketAddr, u32)>>,
    /// Service ports that qualified but did not fit
    /// (`MAX_MESH_LOCAL_SERVICES`): left to the proxy.
    pub services_left_out: usize,
    /// Each destination address's network, which a service endpoint at
    /// that address must share to be that pod (another network's
    /// endpoint may have the same address).
    destination_networks: BTreeMap<IpAddr, String>,
}

impl MeshLocalTable {
    /// Every enrolled pod (slot, its workload as the store knows it) is a
    /// source, since the verdicts were compiled for each; a destination
    /// address qualifies when its pod is a mesh pod reached over HBONE
    /// without a waypoint, and the compiler knew its verdicts exactly
    /// (`inexact`: the addresses of pairs it left to the proxy, for which a
    /// missing entry does not mean "allowed"). Both families: connect4
    /// and connect6 carry flow 2.
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
                if !inexact.contains(ip) {
                    table.destinations.insert(*ip, slot);
                    table
                        .destination_networks
                        .insert(*ip, workload.network.clone());
                }
            }
        }
        table
    }

    /// Adds every VIP and port of `services` that flow 2 may carry once
    /// [`MeshLocalTable::derive`] chose the destinations: the service has
    /// no waypoint, is load-balanced without locality (not `PASSTHROUGH`,
    /// `STRICT` or `FAILOVER`), its VIP is on the
    /// local network, and the port has 1 to `MAX_MESH_SERVICE_ENDPOINTS`
    /// ready endpoints (as the proxy chooses among them:
    /// `Service::ready_targets`), every one of them an eligible
    /// destination on that destination's network. A single ineligible
    /// endpoint (another node's or another network's, one with
    /// a waypoint, one outside the mesh, one whose verdicts are inexact)
    /// keeps the whole port on the proxy, which is how it stays balanced
    /// over every endpoint. Weights are the endpoints' capacities (all 1
    /// when every capacity is 0, as the proxy does; at most 65,536).
    pub fn add_services<'a>(&mut self, services: impl IntoIterator<Item = &'a Service>) {
        let services: Vec<&Service> = services.into_iter().collect();
        // A VIP and port two services share (ServiceEntries of two
        // namespaces) is the one the client's namespace sees: the proxy's
        // choice, like a service visible in its own namespace only.
        let mut claims: BTreeMap<SocketAddr, usize> = BTreeMap::new();
        for service in &services {
            for vip in &service.vips {
                for port in &service.ports {
                    *claims.entry(SocketAddr::new(*vip, port.port)).or_default() += 1;
                }
            }
        }
        for service in services {
            // Locality load balancing (STRICT / FAILOVER) depends on the
            // client, which the kernel's per-VIP choice does not know: the
            // proxy chooses for those.
            if service.has_waypoint()
                || service.is_passthrough()
                || service.ranks_by_locality()
                || service.visibility == crate::state::Visibility::Namespace
            {
                continue;
            }
            for vip in &service.vips {
                if service.vip_networks.contains_key(vip) {
                    continue;
                }
                for port in &service.ports {
                    let dialled = SocketAddr::new(*vip, port.port);
                    if claims.get(&dialled).is_some_and(|n| *n > 1) {
                        continue;
                    }
                    let targets = service.ready_targets(dialled);
                    if targets.is_empty()
                        || targets.len() > MAX_MESH_SERVICE_ENDPOINTS
                        || targets.iter().any(|(e, to)| {
                            self.destination_networks.get(&to.ip()) != Some(&e.network)
                        })
                    {
                        continue;
                    }
                    let weightless = targets.iter().all(|(e, _)| e.capacity == 0);
                    let endpoints = targets
                        .iter()
                        .map(|(e, to)| {
                            // Bounded so that 16 weights sum within a u32.
                            (
                                *to,
                                if weightless {
                                    1
                                } else {
                                    e.capacity.min(1 << 16)
                                },
                            )
                        })
                        .collect();
                    self.services.insert(dialled, endpoints);
                }
            }
        }
        while self.services.len() > MAX_MESH_LOCAL_SERVICES as usize {
            self.services.pop_last();
            self.services_left_out += 1;
        }
    }
}

/// What [`super::Redirector::write_mesh_local`] did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshLocalWritten {
    /// Whether flow 2 is on now.
    pub on: bool,
    pub sources: usize,
    pub destinations: usize,
    /// Service VIPs and ports carried to a same-node endpoint.
    pub services: usize,
    /// Service VIPs and ports that qualified but were not written (no
    /// room): their connects go through the proxy.
    pub services_left_out: usize,
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
        // Both families (connect4 and connect6); the rest keep the proxy.
        assert_eq!(
            table.destinations,
            [
                ("198.18.1.10".parse().expect("ip"), 0),
                ("fd00::10".parse().expect("ip"), 0)
            ]
            .into()
        );
    }

    fn service(name: &str, vip: &str, endpoints: &[&str]) -> Service {
        use crate::state::{Endpoint, ServicePort};
        Service {
            name: name.into(),
            namespace: "default".into(),
            vips: vec![vip.parse().expect("vip")],
            ports: vec![ServicePort {
                port: 80,
                target_port: Some(8080),
            }],
            endpoints: endpoints
                .iter()
                .map(|ip| Endpoint::new(ip.parse().expect("ip"), None))
                .collect(),
            ..Default::default()
        }
    }

    #[test]
    fn a_vip_is_carried_only_when_every_ready_endpoint_is_a_destination() {
        let local = pod("local", &["198.18.1.10"]);
        let other = pod("other", &["198.18.1.11"]);
        let enrolled = [(0, &local), (1, &other)];
        let mut table = MeshLocalTable::derive(&enrolled, &BTreeSet::new());
        let mut weighted = service("weighted", "198.19.100.1", &["198.18.1.10", "198.18.1.11"]);
        weighted.endpoints[1].capacity = 3;
        // One endpoint on another node (not a destination here).
        let spread = service("spread", "198.19.100.2", &["198.18.1.10", "198.18.2.10"]);
        let mut waypointed = service("waypointed", "198.19.100.3", &["198.18.1.10"]);
        waypointed.waypoint = Some(GatewayAddress {
            destination: GatewayDestination::Address {
                network: String::new(),
                ip: "198.18.1.99".parse().expect("ip"),
            },
            hbone_mtls_port: 15008,
        });
        // The remote one is not ready: only ready endpoints count.
        let mut ready_only = service(
            "ready-only",
            "198.19.100.4",
            &["198.18.1.11", "198.18.2.10"],
        );
        ready_only.endpoints[1].ready = false;
        let empty = service("empty", "198.19.100.5", &[]);
        // A weighted set of waypoints alone (a canary) binds it as well.
        let mut canary = service("canary", "198.19.100.7", &["198.18.1.10"]);
        canary.weighted_waypoints = vec![crate::state::WeightedWaypoint {
            destination: GatewayAddress {
                destination: GatewayDestination::Address {
                    network: String::new(),
                    ip: "198.18.1.98".parse().expect("ip"),
                },
                hbone_mtls_port: 15008,
            },
            weight: 1,
        }];
        // Two services at one VIP and port (two namespaces'), and one
        // visible in its own namespace only: the client's namespace
        // decides, so the proxy does.
        let shared_a = service("shared", "198.19.100.8", &["198.18.1.10"]);
        let mut shared_b = service("shared", "198.19.100.8", &["198.18.1.11"]);
        shared_b.namespace = "other".into();
        let mut private = service("private", "198.19.100.9", &["198.18.1.10"]);
        private.visibility = crate::state::Visibility::Namespace;
        // A workload of another network at a local pod's address: not
        // that pod.
        let mut elsewhere = service("elsewhere", "198.19.100.6", &["198.18.1.10"]);
        elsewhere.endpoints[0].network = "network2".into();
        table.add_services([
            &weighted,
            &spread,
            &waypointed,
            &ready_only,
            &empty,
            &elsewhere,
            &canary,
            &shared_a,
            &shared_b,
            &private,
        ]);
        let vip = |s: &str| -> SocketAddr { s.parse().expect("addr") };
        assert_eq!(
            table.services,
            [
                (
                    vip("198.19.100.1:80"),
                    vec![(vip("198.18.1.10:8080"), 1), (vip("198.18.1.11:8080"), 3)]
                ),
                (vip("198.19.100.4:80"), vec![(vip("198.18.1.11:8080"), 1)]),
            ]
            .into()
        );
    }
}

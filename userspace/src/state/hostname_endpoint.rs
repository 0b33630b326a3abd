//! Service endpoints istiod names by DNS name instead of address: a
//! `resolution: DNS` ServiceEntry's endpoints (or, when it lists none, its
//! hosts), sent as workloads with a `hostname` and no address. The proxy
//! resolves the name when a connection picks one (`proxy/on_demand_dns.rs`),
//! as ztunnel does; they are never in DNS answers or the kernel's tables.

use std::{collections::BTreeMap, net::SocketAddr};

use super::{Service, WorkloadKey, weighted_pick};

/// A backend of a service known by its DNS name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostnameEndpoint {
    /// The workload istiod sent for it.
    pub workload: WorkloadKey,
    /// What is resolved (the workload's `hostname`).
    pub hostname: String,
    pub ready: bool,
    /// Its weight among the service's hostname endpoints.
    pub capacity: u32,
    /// Service port → target port, where the workload gives it; wins over
    /// the service's.
    pub ports: BTreeMap<u16, u16>,
}

/// Where a connection picked a hostname endpoint: the name to resolve and
/// the port to dial at the address it resolves to.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct HostnameTarget {
    pub workload: WorkloadKey,
    pub hostname: String,
    pub port: u16,
}

impl Service {
    /// The hostname endpoint for connection number `n` to `dst` (one of
    /// the service's VIPs and ports): weighted round robin by capacity
    /// over the ready ones that serve the port. Unlike an addressed
    /// endpoint, its network does not matter (ztunnel's: it has an
    /// address, the name).
    pub fn pick_hostname(&self, dst: SocketAddr, n: usize) -> Option<HostnameTarget> {
        let candidates: Vec<(&HostnameEndpoint, u16)> = self
            .hostname_endpoints
            .iter()
            .filter(|e| e.ready)
            // A target port of 0 in either mapping: none.
            .filter_map(|e| {
                let port = self.target_port_with(&e.ports, dst.port())?;
                (port != 0).then_some((e, port))
            })
            .collect();
        let (endpoint, port) = weighted_pick(&candidates, |(e, _)| e.capacity, n)?;
        Some(HostnameTarget {
            workload: endpoint.workload.clone(),
            hostname: endpoint.hostname.clone(),
            port: *port,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::ServicePort;

    fn endpoint(name: &str, ready: bool, ports: &[(u16, u16)]) -> HostnameEndpoint {
        HostnameEndpoint {
            workload: WorkloadKey::new("default", name),
            hostname: format!("{name}.example.test"),
            ready,
            capacity: 1,
            ports: ports.iter().copied().collect(),
        }
    }

    fn api() -> Service {
        Service {
            namespace: "default".into(),
            hostname: "api.example.test".into(),
            vips: vec!["198.19.200.1".parse().expect("ip")],
            ports: vec![
                ServicePort {
                    port: 80,
                    target_port: Some(8080),
                },
                ServicePort {
                    port: 443,
                    target_port: None,
                },
            ],
            ..Service::default()
        }
    }

    fn dst(port: u16) -> SocketAddr {
        SocketAddr::new("198.19.200.1".parse().expect("ip"), port)
    }

    #[test]
    fn ready_endpoints_take_turns_with_their_target_port() {
        let mut service = api();
        service.hostname_endpoints = vec![
            endpoint("a", true, &[]),
            endpoint("down", false, &[]),
            endpoint("b", true, &[(80, 9090)]),
        ];
        let picks: Vec<(String, u16)> = (0..4)
            .filter_map(|n| service.pick_hostname(dst(80), n))
            .map(|t| (t.hostname, t.port))
            .collect();
        assert_eq!(
            picks,
            [
                ("a.example.test".to_owned(), 8080),
                ("b.example.test".to_owned(), 9090),
                ("a.example.test".to_owned(), 8080),
                ("b.example.test".to_owned(), 9090),
            ]
        );
    }

    #[test]
    fn a_port_no_endpoint_maps_has_no_hostname_target() {
        let mut service = api();
        service.hostname_endpoints =
            vec![endpoint("a", true, &[]), endpoint("b", true, &[(443, 0)])];
        // 443 has no numeric target port and no endpoint gives one.
        assert_eq!(service.pick_hostname(dst(443), 0), None);
        service.hostname_endpoints[1].ports.insert(443, 8443);
        assert_eq!(
            service.pick_hostname(dst(443), 0).map(|t| t.port),
            Some(8443)
        );
        // A port the service does not have.
        assert_eq!(service.pick_hostname(dst(25), 0), None);
    }
}

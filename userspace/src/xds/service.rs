//! `istio.workload.Service` → [`state::Service`](crate::state::Service),
//! and a service's endpoints from the workloads that name it.
//!
//! istiod sends no endpoint list: each workload's `services` map says which
//! services it backs (`namespace/hostname` → service port → target port).
//! A target port of 0 there means the service's own target port; a service
//! target port of 0 means "named port: ask each workload". An unhealthy
//! workload is an endpoint that is not ready (it gets no connection unless
//! the service's health policy allows unhealthy ones), so `/config_dump`
//! still lists it, as ztunnel's does.

use std::collections::BTreeMap;

use shunt_proto::istio::workload as pb;

use super::{FieldError, ip_from_bytes, port, workload::gateway};
use crate::state::{
    Endpoint, GatewayOnlyEndpoint, HealthPolicy, HostnameEndpoint, IpFamilies, LoadBalancing,
    LoadBalancingMode, LoadBalancingScope, Service, ServicePort, VipRange, Visibility,
    WeightedWaypoint, Workload, WorkloadStatus,
};

/// Translates one service (without endpoints: see [`attach_endpoints`]).
pub(crate) fn translate(s: pb::Service) -> Result<Service, FieldError> {
    for (field, value) in [
        ("name", &s.name),
        ("namespace", &s.namespace),
        ("hostname", &s.hostname),
    ] {
        if value.is_empty() {
            return Err(FieldError::new(field, "empty"));
        }
    }
    let mut vips = Vec::with_capacity(s.addresses.len());
    let mut vip_networks = BTreeMap::new();
    let mut vip_ranges = Vec::new();
    for (i, a) in s.addresses.iter().enumerate() {
        let ip = ip_from_bytes(&a.address, format!("addresses[{i}].address"))?;
        // A `length` short of the whole address: a range (a ServiceEntry's
        // CIDR), as ztunnel reads it.
        let whole = if ip.is_ipv4() { 32 } else { 128 };
        if let Some(length) = a.length.filter(|l| *l != whole) {
            let range = u8::try_from(length)
                .ok()
                .and_then(|prefix| VipRange::new(ip, prefix, a.network.clone()))
                .ok_or_else(|| {
                    FieldError::new(
                        format!("addresses[{i}].length"),
                        format!("{length} is longer than the address ({whole} bits)"),
                    )
                })?;
            vip_ranges.push(range);
            continue;
        }
        if let Some(first) = vips.iter().position(|known| *known == ip) {
            return Err(FieldError::new(
                format!("addresses[{i}].address"),
                format!("{ip} repeats addresses[{first}]"),
            ));
        }
        vips.push(ip);
        if !a.network.is_empty() {
            vip_networks.insert(ip, a.network.clone());
        }
    }
    let mut ports: Vec<ServicePort> = Vec::with_capacity(s.ports.len());
    for (i, p) in s.ports.iter().enumerate() {
        let service_port = port(p.service_port, false, format!("ports[{i}].service_port"))?;
        let target_port = port(p.target_port, true, format!("ports[{i}].target_port"))?;
        if ports.iter().any(|known| known.port == service_port) {
            return Err(FieldError::new(
                format!("ports[{i}].service_port"),
                format!("port {service_port} is listed twice"),
            ));
        }
        ports.push(ServicePort {
            port: service_port,
            target_port: (target_port != 0).then_some(target_port),
        });
    }
    let waypoint = s
        .waypoint
        .as_ref()
        .map(|g| gateway(g).map_err(|e| e.under("waypoint")))
        .transpose()?;
    // As ztunnel: an entry without a destination, or with one that does
    // not translate, refuses the service.
    let weighted_waypoints = s
        .weighted_waypoints
        .iter()
        .enumerate()
        .map(|(i, w)| {
            let field = format!("weighted_waypoints[{i}].destination");
            let destination = w
                .destination
                .as_ref()
                .ok_or_else(|| FieldError::new(field.clone(), "missing"))?;
            Ok(WeightedWaypoint {
                destination: gateway(destination).map_err(|e| e.under(&field))?,
                weight: w.weight,
            })
        })
        .collect::<Result<Vec<_>, FieldError>>()?;
    let load_balancing = s.load_balancing.as_ref().map(load_balancing).transpose()?;
    let ip_families = match pb::IpFamilies::try_from(s.ip_families) {
        Ok(pb::IpFamilies::Ipv4Only) => IpFamilies::V4Only,
        Ok(pb::IpFamilies::Ipv6Only) => IpFamilies::V6Only,
        Ok(pb::IpFamilies::Automatic | pb::IpFamilies::Dual) => IpFamilies::Any,
        Err(_) => {
            return Err(FieldError::new(
                "ip_families",
                format!("unknown value {}", s.ip_families),
            ));
        }
    };
    // An unknown value is public, never a refused service: ztunnel chose
    // to fail open here ("Safer ServiceEntry"), so the service stays
    // reachable on both.
    let visibility = match pb::service::Visibility::try_from(s.visibility) {
        Ok(pb::service::Visibility::Namespace) => Visibility::Namespace,
        Ok(pb::service::Visibility::Public) | Err(_) => Visibility::Public,
    };
    Ok(Service {
        name: s.name,
        namespace: s.namespace,
        vips,
        ports,
        endpoints: Vec::new(),
        hostname: s.hostname,
        vip_networks,
        vip_ranges,
        subject_alt_names: s.subject_alt_names,
        waypoint,
        weighted_waypoints,
        load_balancing,
        canonical: s.canonical,
        ip_families,
        visibility,
        gateway_only: Vec::new(),
        hostname_endpoints: Vec::new(),
    })
}

fn load_balancing(lb: &pb::LoadBalancing) -> Result<LoadBalancing, FieldError> {
    use pb::load_balancing::{HealthPolicy as PbHealthPolicy, Mode, Scope};
    let mode = match Mode::try_from(lb.mode) {
        Ok(Mode::UnspecifiedMode) => LoadBalancingMode::Unspecified,
        Ok(Mode::Strict) => LoadBalancingMode::Strict,
        Ok(Mode::Failover) => LoadBalancingMode::Failover,
        Ok(Mode::Passthrough) => LoadBalancingMode::Passthrough,
        Err(_) => {
            return Err(FieldError::new(
                "load_balancing.mode",
                format!("unknown value {}", lb.mode),
            ));
        }
    };
    let health_policy = match PbHealthPolicy::try_from(lb.health_policy) {
        Ok(PbHealthPolicy::OnlyHealthy) => HealthPolicy::OnlyHealthy,
        Ok(PbHealthPolicy::AllowAll) => HealthPolicy::AllowAll,
        Err(_) => {
            return Err(FieldError::new(
                "load_balancing.health_policy",
                format!("unknown value {}", lb.health_policy),
            ));
        }
    };
    let mut routing_preference = Vec::with_capacity(lb.routing_preference.len());
    for (i, value) in lb.routing_preference.iter().enumerate() {
        let scope = match Scope::try_from(*value) {
            Ok(Scope::Region) => LoadBalancingScope::Region,
            Ok(Scope::Zone) => LoadBalancingScope::Zone,
            Ok(Scope::Subzone) => LoadBalancingScope::Subzone,
            Ok(Scope::Node) => LoadBalancingScope::Node,
            Ok(Scope::Cluster) => LoadBalancingScope::Cluster,
            Ok(Scope::Network) => LoadBalancingScope::Network,
            Ok(Scope::UnspecifiedScope) | Err(_) => {
                return Err(FieldError::new(
                    format!("load_balancing.routing_preference[{i}]"),
                    format!("unknown scope {value}"),
                ));
            }
        };
        routing_preference.push(scope);
    }
    Ok(LoadBalancing {
        routing_preference,
        mode,
        health_policy,
    })
}

/// `namespace/hostname`: how workloads and xDS name a service.
pub(crate) fn service_key(s: &Service) -> String {
    format!("{}/{}", s.namespace, s.hostname)
}

/// Adds `w`'s addresses to `service`'s endpoints, `ports` being what `w`
/// says of the service (its `services` entry).
pub(crate) fn push_endpoints(service: &mut Service, w: &Workload, ports: &BTreeMap<u16, u16>) {
    let ready = w.status != WorkloadStatus::Unhealthy || service.allows_unhealthy();
    // A target port of 0 defers to the service's (ServicePort).
    let ports: BTreeMap<u16, u16> = ports
        .iter()
        .filter(|(_, target)| **target != 0)
        .map(|(p, t)| (*p, *t))
        .collect();
    // No address but a DNS name (a `resolution: DNS` ServiceEntry's):
    // resolved when a connection picks it. ztunnel counts the name as an
    // address, so such a workload never goes through a gateway.
    if w.ips.is_empty() && !w.hostname.is_empty() {
        service.hostname_endpoints.push(HostnameEndpoint {
            workload: w.key(),
            hostname: w.hostname.clone(),
            ready,
            capacity: w.capacity,
            ports: ports.clone(),
        });
        return;
    }
    // No address: only its network's gateway reaches it (ztunnel keeps
    // it only then, and uses it only from another network).
    if w.ips.is_empty()
        && let Some(gateway) = &w.network_gateway
    {
        service.gateway_only.push(GatewayOnlyEndpoint {
            ready,
            network: w.network.clone(),
            gateway: gateway.clone(),
            capacity: w.capacity,
            ports: ports.clone(),
        });
    }
    for ip in &w.ips {
        service.endpoints.push(Endpoint {
            ip: *ip,
            ready,
            pod: Some(w.key()),
            ports: ports.clone(),
            capacity: w.capacity,
            network: w.network.clone(),
        });
    }
}

/// The whole-list form of what `derived.rs` keeps per service (kept for
/// the tests of the translation).
///
/// Fills each service's endpoints from the workloads that name it (the
/// unhealthy ones not ready, unless the service allows them),
/// in workload order. Returns what could not be resolved, for the log and
/// `/config_dump` (a workload naming a service istiod has not sent (yet),
/// a waypoint naming an unknown service).
#[cfg(test)]
pub(crate) fn attach_endpoints<'a>(
    services: &mut [Service],
    workloads: impl IntoIterator<Item = &'a Workload>,
) -> Vec<String> {
    let mut warnings = Vec::new();
    let index: std::collections::HashMap<String, usize> = services
        .iter()
        .enumerate()
        .map(|(i, s)| (service_key(s), i))
        .collect();
    for w in workloads {
        for (key, ports) in &w.services {
            let Some(&i) = index.get(key) else {
                warnings.push(format!(
                    "workload {} ({}) names service {key}, which istiod has not sent",
                    w.key(),
                    w.uid
                ));
                continue;
            };
            push_endpoints(&mut services[i], w, ports);
        }
    }
    let waypoint_hosts: Vec<(usize, String)> = services
        .iter()
        .enumerate()
        .flat_map(|(i, s)| s.waypoint_hostnames().into_iter().map(move |h| (i, h)))
        .collect();
    for (i, waypoint) in waypoint_hosts {
        if !index.contains_key(&waypoint) {
            warnings.push(format!(
                "service {} names waypoint {waypoint}, which istiod has not sent",
                service_key(&services[i])
            ));
        }
    }
    warnings
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, SocketAddr};

    use super::*;

    fn proto() -> pb::Service {
        pb::Service {
            name: "web".into(),
            namespace: "default".into(),
            hostname: "web.default.svc.cluster.local".into(),
            addresses: vec![
                pb::NetworkAddress {
                    network: String::new(),
                    address: vec![198, 19, 100, 1],
                    ..Default::default()
                },
                pb::NetworkAddress {
                    network: "net-b".into(),
                    address: vec![198, 19, 100, 2],
                    ..Default::default()
                },
            ],
            ports: vec![
                pb::Port {
                    service_port: 80,
                    target_port: 8080,
                    ..Default::default()
                },
                pb::Port {
                    service_port: 443,
                    target_port: 0,
                    ..Default::default()
                },
            ],
            subject_alt_names: vec!["spiffe://cluster.local/ns/default/sa/other".into()],
            load_balancing: Some(pb::LoadBalancing {
                routing_preference: vec![pb::load_balancing::Scope::Zone as i32],
                mode: pb::load_balancing::Mode::Failover as i32,
                health_policy: 0,
            }),
            canonical: true,
            ..Default::default()
        }
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    fn backend(name: &str, addr: &str, ports: &[(u16, u16)], healthy: bool) -> Workload {
        Workload {
            name: name.into(),
            namespace: "default".into(),
            ips: vec![ip(addr)],
            status: if healthy {
                WorkloadStatus::Healthy
            } else {
                WorkloadStatus::Unhealthy
            },
            services: BTreeMap::from([(
                "default/web.default.svc.cluster.local".to_string(),
                ports.iter().copied().collect(),
            )]),
            ..Default::default()
        }
    }

    #[test]
    fn every_field_lands() {
        let s = translate(proto()).expect("valid");
        assert_eq!(s.key().to_string(), "default/web");
        assert_eq!(s.hostname, "web.default.svc.cluster.local");
        assert_eq!(s.vips, [ip("198.19.100.1"), ip("198.19.100.2")]);
        assert_eq!(
            s.vip_networks,
            BTreeMap::from([(ip("198.19.100.2"), "net-b".to_string())])
        );
        assert_eq!(
            s.ports[1],
            ServicePort {
                port: 443,
                target_port: None
            }
        );
        assert_eq!(s.subject_alt_names.len(), 1);
        let lb = s.load_balancing.expect("load balancing");
        assert_eq!(lb.mode, LoadBalancingMode::Failover);
        assert_eq!(lb.routing_preference, [LoadBalancingScope::Zone]);
        assert_eq!(lb.health_policy, HealthPolicy::OnlyHealthy);
        assert!(s.canonical);
    }

    #[test]
    fn a_weighted_set_of_waypoints_lands_and_a_bad_entry_refuses_the_service() {
        let waypoint = |host: &str| pb::GatewayAddress {
            destination: Some(pb::gateway_address::Destination::Hostname(
                pb::NamespacedHostname {
                    namespace: "default".into(),
                    hostname: host.into(),
                },
            )),
            hbone_mtls_port: 15008,
        };
        let mut p = proto();
        p.waypoint = Some(waypoint("primary.default.svc.cluster.local"));
        p.weighted_waypoints = vec![
            pb::WeightedWaypoint {
                destination: Some(waypoint("primary.default.svc.cluster.local")),
                weight: 90,
            },
            pb::WeightedWaypoint {
                destination: Some(waypoint("canary.default.svc.cluster.local")),
                weight: 10,
            },
        ];
        let s = translate(p.clone()).expect("valid");
        let weights: Vec<(String, u32)> = s
            .weighted_waypoints
            .iter()
            .map(|w| match &w.destination.destination {
                crate::state::GatewayDestination::Hostname {
                    namespace,
                    hostname,
                } => (format!("{namespace}/{hostname}"), w.weight),
                other => panic!("a hostname was sent, got {other:?}"),
            })
            .collect();
        assert_eq!(
            weights,
            [
                ("default/primary.default.svc.cluster.local".to_string(), 90),
                ("default/canary.default.svc.cluster.local".to_string(), 10)
            ]
        );
        assert!(s.waypoint.is_some() && s.has_waypoint());
        // Unsampled shares, for the warnings: both named once.
        let warnings = attach_endpoints(&mut [s], std::iter::empty());
        assert_eq!(warnings.len(), 2, "{warnings:?}");
        // As ztunnel: an entry without a destination, or with a bad one,
        // refuses the whole service, named.
        let mut missing = p.clone();
        missing.weighted_waypoints[1].destination = None;
        let e = translate(missing).expect_err("no destination");
        assert_eq!(
            (e.field.as_str(), e.reason.as_str()),
            ("weighted_waypoints[1].destination", "missing")
        );
        let mut bad = p;
        bad.weighted_waypoints[0].destination = Some(pb::GatewayAddress::default());
        let e = translate(bad).expect_err("no destination inside");
        assert!(
            e.field.starts_with("weighted_waypoints[0].destination."),
            "{e:?}"
        );
    }

    #[test]
    fn an_address_with_a_shorter_length_is_a_range() {
        let mut p = proto();
        p.addresses.push(pb::NetworkAddress {
            network: String::new(),
            address: vec![198, 19, 200, 0],
            length: Some(24),
        });
        // The whole address's length is a plain VIP.
        p.addresses.push(pb::NetworkAddress {
            network: String::new(),
            address: vec![198, 19, 100, 3],
            length: Some(32),
        });
        let s = translate(p.clone()).expect("valid");
        let ranges: Vec<String> = s.vip_ranges.iter().map(ToString::to_string).collect();
        assert_eq!(ranges, ["198.19.200.0/24"]);
        assert!(s.vips.contains(&"198.19.100.3".parse().expect("ip")));
        assert!(!s.vips.contains(&"198.19.200.0".parse().expect("ip")));
        p.addresses[2].length = Some(40);
        let e = translate(p).expect_err("longer than IPv4");
        assert_eq!(e.field, "addresses[2].length");
    }

    #[test]
    fn an_unknown_visibility_is_public_as_ztunnels() {
        let mut p = proto();
        p.visibility = 7;
        assert_eq!(translate(p).expect("kept").visibility, Visibility::Public);
    }

    #[test]
    fn allow_all_keeps_unhealthy_workloads_and_passthrough_is_kept() {
        let mut p = proto();
        p.load_balancing = Some(pb::LoadBalancing {
            routing_preference: Vec::new(),
            mode: pb::load_balancing::Mode::Passthrough as i32,
            health_policy: pb::load_balancing::HealthPolicy::AllowAll as i32,
        });
        let mut services = vec![translate(p).expect("valid")];
        assert!(services[0].is_passthrough());
        assert!(services[0].allows_unhealthy());
        let mut heavy = backend("heavy", "198.18.2.1", &[(80, 0)], true);
        heavy.capacity = 3;
        let workloads = [heavy, backend("sick", "198.18.2.3", &[(80, 0)], false)];
        attach_endpoints(&mut services, workloads.iter());
        let vip: SocketAddr = "198.19.100.1:80".parse().expect("addr");
        let targets: Vec<(SocketAddr, u32)> = services[0]
            .ready_targets(vip)
            .into_iter()
            .map(|(e, a)| (a, e.capacity))
            .collect();
        assert_eq!(
            targets,
            [
                ("198.18.2.1:8080".parse().expect("heavy"), 3),
                ("198.18.2.3:8080".parse().expect("sick"), 1)
            ],
            "ALLOW_ALL: the unhealthy workload is an endpoint; capacities carried"
        );
    }

    #[test]
    fn endpoints_come_from_healthy_workloads() {
        let mut services = vec![translate(proto()).expect("valid")];
        let workloads = [
            // Target 0: the service's own target port.
            backend("a", "198.18.2.1", &[(80, 0), (443, 8443)], true),
            backend("b", "198.18.2.2", &[(80, 9090)], true),
            backend("sick", "198.18.2.3", &[(80, 0)], false),
        ];
        let mut stray = backend("stray", "198.18.2.4", &[], true);
        stray.services = BTreeMap::from([(
            "default/gone.default.svc.cluster.local".into(),
            BTreeMap::new(),
        )]);
        let warnings = attach_endpoints(&mut services, workloads.iter().chain([&stray]));
        assert_eq!(warnings.len(), 1, "{warnings:?}");
        assert!(
            warnings[0].contains("default/gone.default.svc.cluster.local"),
            "{warnings:?}"
        );
        let web = &services[0];
        let vip: SocketAddr = "198.19.100.1:80".parse().expect("addr");
        let targets: Vec<SocketAddr> = web.ready_targets(vip).into_iter().map(|(_, a)| a).collect();
        assert_eq!(
            targets,
            [
                "198.18.2.1:8080".parse().expect("a"),
                "198.18.2.2:9090".parse().expect("b")
            ],
            "the unhealthy workload gets no connection"
        );
        let sick = web
            .endpoints
            .iter()
            .find(|e| e.ip == ip("198.18.2.3"))
            .expect("the unhealthy workload is still listed");
        assert!(!sick.ready);
        let tls: SocketAddr = "198.19.100.1:443".parse().expect("addr");
        let targets: Vec<SocketAddr> = web.ready_targets(tls).into_iter().map(|(_, a)| a).collect();
        assert_eq!(
            targets,
            ["198.18.2.1:8443".parse::<SocketAddr>().expect("a")]
        );
    }

    /// A `resolution: DNS` ServiceEntry's endpoint: a workload with a
    /// hostname and no address is an endpoint resolved when picked, even
    /// with a network gateway (the name is its address, as in ztunnel).
    #[test]
    fn a_workload_known_by_name_is_a_hostname_endpoint() {
        let mut services = vec![translate(proto()).expect("valid")];
        let mut named = backend("ext", "198.18.2.1", &[(80, 9090)], true);
        named.ips.clear();
        named.hostname = "api.example.test".into();
        named.network_gateway = Some(crate::state::GatewayAddress {
            destination: crate::state::GatewayDestination::Address {
                network: "net-b".into(),
                ip: ip("198.18.9.9"),
            },
            hbone_mtls_port: 15008,
        });
        named.capacity = 2;
        attach_endpoints(&mut services, [&named]);
        let web = &services[0];
        assert!(web.endpoints.is_empty() && web.gateway_only.is_empty());
        let vip: SocketAddr = "198.19.100.1:80".parse().expect("addr");
        let target = web.pick_hostname(vip, 0).expect("a hostname target");
        assert_eq!(
            (target.hostname.as_str(), target.port, target.workload),
            ("api.example.test", 9090, named.key())
        );
        assert_eq!(web.hostname_endpoints[0].capacity, 2);
    }

    #[test]
    fn errors_name_the_field() {
        let mut p = proto();
        p.addresses[1].address = vec![1, 2, 3, 4, 5];
        let err = translate(p).expect_err("5 bytes");
        assert_eq!(err.field, "addresses[1].address");
        let mut p = proto();
        p.ports[1].service_port = 80;
        assert_eq!(
            translate(p).expect_err("twice").field,
            "ports[1].service_port"
        );
        let mut p = proto();
        p.hostname.clear();
        assert_eq!(translate(p).expect_err("hostname").field, "hostname");
        let mut p = proto();
        p.load_balancing = Some(pb::LoadBalancing {
            routing_preference: vec![42],
            mode: 0,
            health_policy: 0,
        });
        let mut bad_policy = p.clone();
        bad_policy.load_balancing = Some(pb::LoadBalancing {
            routing_preference: Vec::new(),
            mode: 0,
            health_policy: 9,
        });
        assert_eq!(
            translate(bad_policy).expect_err("policy").field,
            "load_balancing.health_policy"
        );
        assert_eq!(
            translate(p).expect_err("scope").field,
            "load_balancing.routing_preference[0]"
        );
    }
}

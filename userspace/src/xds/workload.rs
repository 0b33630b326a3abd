//! `istio.workload.Workload` → [`state::Workload`](crate::state::Workload).
//!
//! Every field shunt has a place for is kept, including those later work
//! uses (waypoint, network gateway, policies, locality). A workload istiod
//! reaches over HBONE is a mesh workload (`DataplaneMode::Ambient`: the
//! proxy opens HBONE to it); one with tunnel protocol NONE is passthrough.

use std::collections::BTreeMap;

use shunt_proto::istio::workload as pb;

use super::{FieldError, ip_from_bytes, port};
use crate::state::{
    ApplicationTunnel, ApplicationTunnelProtocol, DataplaneMode, GatewayAddress,
    GatewayDestination, Locality, TrustDomain, TunnelProtocol, Workload, WorkloadStatus,
    WorkloadType,
};

/// The HBONE port when istiod leaves `hbone_mtls_port` at 0.
pub const DEFAULT_HBONE_PORT: u16 = 15008;

/// Translates one workload; `resource_name` stands in for a missing uid.
pub(crate) fn translate(w: pb::Workload, resource_name: &str) -> Result<Workload, FieldError> {
    if w.name.is_empty() {
        return Err(FieldError::new("name", "empty"));
    }
    if w.namespace.is_empty() {
        return Err(FieldError::new("namespace", "empty"));
    }
    let mut ips = Vec::with_capacity(w.addresses.len());
    for (i, bytes) in w.addresses.iter().enumerate() {
        let ip = ip_from_bytes(bytes, format!("addresses[{i}]"))?;
        if let Some(first) = ips.iter().position(|known| *known == ip) {
            return Err(FieldError::new(
                format!("addresses[{i}]"),
                format!("{ip} repeats addresses[{first}]"),
            ));
        }
        ips.push(ip);
    }
    let tunnel = match pb::TunnelProtocol::try_from(w.tunnel_protocol) {
        Ok(pb::TunnelProtocol::Hbone) => TunnelProtocol::Hbone,
        Ok(pb::TunnelProtocol::None) => TunnelProtocol::None,
        // ztunnel refuses it the same way: a sidecar's mTLS is not HBONE.
        Ok(pb::TunnelProtocol::LegacyIstioMtls) => {
            return Err(FieldError::new(
                "tunnel_protocol",
                "LEGACY_ISTIO_MTLS (a sidecar's mTLS) is not supported by a node proxy",
            ));
        }
        Err(_) => {
            return Err(FieldError::new(
                "tunnel_protocol",
                format!("unknown value {}", w.tunnel_protocol),
            ));
        }
    };
    let status = match pb::WorkloadStatus::try_from(w.status) {
        Ok(pb::WorkloadStatus::Healthy) => WorkloadStatus::Healthy,
        Ok(pb::WorkloadStatus::Unhealthy) => WorkloadStatus::Unhealthy,
        Err(_) => {
            return Err(FieldError::new(
                "status",
                format!("unknown value {}", w.status),
            ));
        }
    };
    let trust_domain = match w.trust_domain.as_str() {
        "" => None,
        name => Some(
            TrustDomain::new(name).map_err(|e| FieldError::new("trust_domain", e.to_string()))?,
        ),
    };
    let waypoint = w
        .waypoint
        .as_ref()
        .map(|g| gateway(g).map_err(|e| e.under("waypoint")))
        .transpose()?;
    let network_gateway = w
        .network_gateway
        .as_ref()
        .map(|g| gateway(g).map_err(|e| e.under("network_gateway")))
        .transpose()?;
    let mut services = BTreeMap::new();
    for (key, list) in &w.services {
        let field = format!("services[{key:?}]");
        if !is_namespaced_hostname(key) {
            return Err(FieldError::new(field, "not namespace/hostname"));
        }
        let mut ports = BTreeMap::new();
        for (i, p) in list.ports.iter().enumerate() {
            let service_port = port(
                p.service_port,
                false,
                format!("{field}.ports[{i}].service_port"),
            )?;
            let target_port = port(
                p.target_port,
                true,
                format!("{field}.ports[{i}].target_port"),
            )?;
            if ports.insert(service_port, target_port).is_some() {
                return Err(FieldError::new(
                    format!("{field}.ports[{i}].service_port"),
                    format!("port {service_port} is listed twice"),
                ));
            }
        }
        services.insert(key.clone(), ports);
    }
    let workload_type = match pb::WorkloadType::try_from(w.workload_type) {
        Ok(pb::WorkloadType::Deployment) => WorkloadType::Deployment,
        Ok(pb::WorkloadType::Cronjob) => WorkloadType::CronJob,
        Ok(pb::WorkloadType::Pod) => WorkloadType::Pod,
        Ok(pb::WorkloadType::Job) => WorkloadType::Job,
        Err(_) => {
            return Err(FieldError::new(
                "workload_type",
                format!("unknown value {}", w.workload_type),
            ));
        }
    };
    let application_tunnel = w
        .application_tunnel
        .as_ref()
        .map(application_tunnel)
        .transpose()?;
    let host_network = match pb::NetworkMode::try_from(w.network_mode) {
        Ok(pb::NetworkMode::Standard) => false,
        Ok(pb::NetworkMode::HostNetwork) => true,
        Err(_) => {
            return Err(FieldError::new(
                "network_mode",
                format!("unknown value {}", w.network_mode),
            ));
        }
    };
    let uid = if w.uid.is_empty() {
        resource_name.to_owned()
    } else {
        w.uid
    };
    Ok(Workload {
        name: w.name,
        namespace: w.namespace,
        // As ztunnel: a workload without one (a WorkloadEntry) speaks as
        // the namespace's `default` account, and belongs to `Kubernetes`.
        service_account: if w.service_account.is_empty() {
            crate::state::DEFAULT_SERVICE_ACCOUNT.into()
        } else {
            w.service_account
        },
        ips,
        node: w.node,
        // Only the node-local pod source knows where a pod's netns is.
        netns: None,
        dataplane_mode: match tunnel {
            TunnelProtocol::Hbone => DataplaneMode::Ambient,
            TunnelProtocol::None => DataplaneMode::None,
        },
        splice: None,
        // Only the pod source knows the pod's annotation.
        fast_path: None,
        dns_capture: None,
        uid,
        // istiod does not send labels: it resolves selectors itself.
        labels: BTreeMap::new(),
        trust_domain,
        tunnel,
        canonical_name: w.canonical_name,
        canonical_revision: w.canonical_revision,
        network: w.network,
        cluster_id: if w.cluster_id.is_empty() {
            crate::state::DEFAULT_CLUSTER_ID.into()
        } else {
            w.cluster_id
        },
        status,
        waypoint,
        authorization_policies: w.authorization_policies,
        services,
        network_gateway,
        locality: w.locality.map(|l| Locality {
            region: l.region,
            zone: l.zone,
            subzone: l.subzone,
        }),
        hostname: w.hostname,
        workload_name: w.workload_name,
        workload_type,
        native_tunnel: w.native_tunnel,
        // Unset means 1; an explicit 0 is kept (no new connections while a
        // peer has capacity).
        capacity: w.capacity.unwrap_or(1),
        application_tunnel,
        // istiod's `hostname` is a DNS name for address-less workloads,
        // not the pod's spec.hostname.
        pod_hostname: String::new(),
        pod_subdomain: String::new(),
        host_network,
    })
}

fn application_tunnel(t: &pb::ApplicationTunnel) -> Result<ApplicationTunnel, FieldError> {
    use pb::application_tunnel::Protocol;
    let protocol = match Protocol::try_from(t.protocol) {
        Ok(Protocol::None) => ApplicationTunnelProtocol::None,
        Ok(Protocol::Proxy) => ApplicationTunnelProtocol::Proxy,
        Err(_) => {
            return Err(FieldError::new(
                "application_tunnel.protocol",
                format!("unknown value {}", t.protocol),
            ));
        }
    };
    Ok(ApplicationTunnel {
        protocol,
        port: port(t.port, true, "application_tunnel.port")?,
    })
}

/// `namespace/hostname`, both parts non-empty.
pub(crate) fn is_namespaced_hostname(key: &str) -> bool {
    key.split_once('/')
        .is_some_and(|(ns, host)| !ns.is_empty() && !host.is_empty() && !host.contains('/'))
}

/// `istio.workload.GatewayAddress` (a waypoint or network gateway).
pub(crate) fn gateway(g: &pb::GatewayAddress) -> Result<GatewayAddress, FieldError> {
    let destination = match &g.destination {
        Some(pb::gateway_address::Destination::Hostname(h)) => {
            if h.namespace.is_empty() || h.hostname.is_empty() {
                return Err(FieldError::new(
                    "hostname",
                    "namespace and hostname must both be set",
                ));
            }
            GatewayDestination::Hostname {
                namespace: h.namespace.clone(),
                hostname: h.hostname.clone(),
            }
        }
        Some(pb::gateway_address::Destination::Address(a)) => GatewayDestination::Address {
            network: a.network.clone(),
            ip: ip_from_bytes(&a.address, "address.address")?,
        },
        None => {
            return Err(FieldError::new(
                "destination",
                "neither hostname nor address is set",
            ));
        }
    };
    let hbone_mtls_port = match port(g.hbone_mtls_port, true, "hbone_mtls_port")? {
        0 => DEFAULT_HBONE_PORT,
        port => port,
    };
    Ok(GatewayAddress {
        destination,
        hbone_mtls_port,
    })
}

#[cfg(test)]
mod tests {
    use std::collections::HashMap;

    use super::*;

    fn proto() -> pb::Workload {
        pb::Workload {
            uid: "Kubernetes//Pod/default/web-0".into(),
            name: "web-0".into(),
            namespace: "default".into(),
            addresses: vec![vec![198, 18, 2, 10]],
            network: "net-a".into(),
            tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
            trust_domain: "example.org".into(),
            service_account: "web".into(),
            waypoint: Some(pb::GatewayAddress {
                destination: Some(pb::gateway_address::Destination::Hostname(
                    pb::NamespacedHostname {
                        namespace: "default".into(),
                        hostname: "waypoint.default.svc.cluster.local".into(),
                    },
                )),
                hbone_mtls_port: 0,
            }),
            node: "node-b".into(),
            canonical_name: "web".into(),
            canonical_revision: "v1".into(),
            services: HashMap::from([(
                "default/web.default.svc.cluster.local".into(),
                pb::PortList {
                    ports: vec![pb::Port {
                        service_port: 80,
                        target_port: 8080,
                        ..Default::default()
                    }],
                },
            )]),
            authorization_policies: vec!["default/allow-sleep".into()],
            status: pb::WorkloadStatus::Unhealthy as i32,
            cluster_id: "Kubernetes".into(),
            locality: Some(pb::Locality {
                region: "r".into(),
                zone: "z".into(),
                subzone: String::new(),
            }),
            ..Default::default()
        }
    }

    #[test]
    fn every_field_lands() {
        let w = translate(proto(), "ignored").expect("valid");
        assert_eq!(w.key().to_string(), "default/web-0");
        assert_eq!(w.uid, "Kubernetes//Pod/default/web-0");
        assert_eq!(
            w.ips,
            ["198.18.2.10".parse::<std::net::IpAddr>().expect("ip")]
        );
        assert_eq!(w.tunnel, TunnelProtocol::Hbone);
        assert!(w.wants_mesh(), "HBONE workloads are mesh workloads");
        assert_eq!(
            w.identity(&TrustDomain::default()).as_str(),
            "spiffe://example.org/ns/default/sa/web"
        );
        assert_eq!(w.node, "node-b");
        assert_eq!(
            (w.canonical_name.as_str(), w.canonical_revision.as_str()),
            ("web", "v1")
        );
        assert_eq!(
            (w.network.as_str(), w.cluster_id.as_str()),
            ("net-a", "Kubernetes")
        );
        assert_eq!(w.status, WorkloadStatus::Unhealthy);
        assert_eq!(w.authorization_policies, ["default/allow-sleep"]);
        assert_eq!(
            w.services["default/web.default.svc.cluster.local"],
            BTreeMap::from([(80, 8080)])
        );
        let waypoint = w.waypoint.expect("waypoint");
        assert_eq!(waypoint.hbone_mtls_port, DEFAULT_HBONE_PORT);
        assert_eq!(w.locality.map(|l| l.zone), Some("z".into()));
    }

    #[test]
    fn no_service_account_or_cluster_are_ztunnels_defaults() {
        let mut p = proto();
        p.service_account.clear();
        p.cluster_id.clear();
        let w = translate(p, "res-name").expect("valid");
        assert_eq!(
            w.identity(&TrustDomain::default()).as_str(),
            "spiffe://example.org/ns/default/sa/default"
        );
        assert_eq!(w.cluster_id, "Kubernetes");
    }

    #[test]
    fn uid_defaults_to_the_resource_name_and_none_is_passthrough() {
        let mut p = proto();
        p.uid.clear();
        p.tunnel_protocol = pb::TunnelProtocol::None as i32;
        let w = translate(p, "res-name").expect("valid");
        assert_eq!(w.uid, "res-name");
        assert_eq!(w.tunnel, TunnelProtocol::None);
        assert!(!w.wants_mesh());
    }

    /// Bytes as istiod puts them on the wire, written by hand (not by our
    /// own encoder, which would agree with any numbering we declare):
    /// field 12 is the owner's type, 13 its name, 14 `native_tunnel`, 27
    /// `capacity` (a `UInt32Value` wrapper).
    #[test]
    fn istio_field_numbers_decode_into_the_owner_and_capacity() {
        use prost::Message;
        let mut wire = Vec::new();
        let mut field = |tag: u8, bytes: &[u8]| {
            wire.push(tag);
            wire.push(bytes.len() as u8);
            wire.extend_from_slice(bytes);
        };
        field(0x0a, b"ratings-v1-5d8f7b9c4-x2x7q"); // 1: name
        field(0x12, b"bookinfo"); // 2: namespace
        field(0x6a, b"ratings-v1"); // 13: workload_name
        wire.extend_from_slice(&[0x60, 0x01]); // 12: workload_type = CRONJOB
        wire.extend_from_slice(&[0x70, 0x01]); // 14: native_tunnel = true
        wire.extend_from_slice(&[0xda, 0x01, 0x02, 0x08, 0x05]); // 27: capacity {5}
        let decoded = pb::Workload::decode(wire.as_slice()).expect("Istio's numbering decodes");
        let w = translate(decoded, "r").expect("valid");
        assert_eq!(w.workload_name, "ratings-v1");
        assert_eq!(w.workload_type, WorkloadType::CronJob);
        assert_eq!(w.workload_type.as_str(), "cronjob");
        assert_eq!(w.owner(), (WorkloadType::CronJob, "ratings-v1"));
        assert!(w.native_tunnel);
        assert_eq!(w.capacity, 5);

        // Unset capacity is 1; an explicit 0 stays 0.
        let mut wire = Vec::new();
        wire.extend_from_slice(&[0x0a, 0x01, b'a', 0x12, 0x01, b'b']);
        let unset = translate(pb::Workload::decode(wire.as_slice()).expect("decodes"), "r");
        let unset = unset.expect("valid");
        assert_eq!(
            (unset.capacity, unset.workload_type, unset.native_tunnel),
            (1, WorkloadType::Deployment, false),
            "proto defaults: DEPLOYMENT is 0"
        );
        wire.extend_from_slice(&[0xda, 0x01, 0x00]);
        let zero = translate(pb::Workload::decode(wire.as_slice()).expect("decodes"), "r");
        assert_eq!(zero.expect("valid").capacity, 0);
    }

    #[test]
    fn application_tunnel_lands() {
        let mut p = proto();
        p.application_tunnel = Some(pb::ApplicationTunnel {
            protocol: pb::application_tunnel::Protocol::Proxy as i32,
            port: 15088,
        });
        let w = translate(p, "r").expect("valid");
        assert_eq!(
            w.application_tunnel,
            Some(ApplicationTunnel {
                protocol: ApplicationTunnelProtocol::Proxy,
                port: 15088
            })
        );
    }

    /// How a test case spoils a valid workload.
    type Breakage = Box<dyn Fn(&mut pb::Workload)>;

    #[test]
    fn errors_name_the_field() {
        let cases: Vec<(Breakage, &str, &str)> = vec![
            (
                Box::new(|p| p.addresses.push(vec![1, 2, 3, 4, 5])),
                "addresses[1]",
                "5 bytes",
            ),
            (
                Box::new(|p| p.addresses.push(vec![198, 18, 2, 10])),
                "addresses[1]",
                "repeats addresses[0]",
            ),
            (Box::new(|p| p.name.clear()), "name", "empty"),
            (
                Box::new(|p| p.trust_domain = "Bad/TD".into()),
                "trust_domain",
                "not a valid trust domain",
            ),
            (
                Box::new(|p| p.tunnel_protocol = 9),
                "tunnel_protocol",
                "unknown value 9",
            ),
            (Box::new(|p| p.status = 4), "status", "unknown value 4"),
            (
                Box::new(|p| p.tunnel_protocol = 2),
                "tunnel_protocol",
                "LEGACY_ISTIO_MTLS",
            ),
            (
                Box::new(|p| p.network_mode = 3),
                "network_mode",
                "unknown value 3",
            ),
            (
                Box::new(|p| p.workload_type = 7),
                "workload_type",
                "unknown value 7",
            ),
            (
                Box::new(|p| {
                    p.application_tunnel = Some(pb::ApplicationTunnel {
                        protocol: 0,
                        port: 70000,
                    })
                }),
                "application_tunnel.port",
                "not a port",
            ),
            (
                Box::new(|p| p.waypoint = Some(pb::GatewayAddress::default())),
                "waypoint.destination",
                "neither",
            ),
            (
                Box::new(|p| {
                    p.services
                        .insert("no-slash".into(), pb::PortList::default());
                }),
                "services[\"no-slash\"]",
                "namespace/hostname",
            ),
            (
                Box::new(|p| {
                    p.services.insert(
                        "a/b".into(),
                        pb::PortList {
                            ports: vec![pb::Port {
                                service_port: 70000,
                                target_port: 0,
                                ..Default::default()
                            }],
                        },
                    );
                }),
                "services[\"a/b\"].ports[0].service_port",
                "not a port",
            ),
        ];
        for (break_it, field, reason) in cases {
            let mut p = proto();
            break_it(&mut p);
            let err = translate(p, "r").expect_err(field);
            assert_eq!(err.field, field);
            assert!(err.reason.contains(reason), "{field}: {}", err.reason);
        }
    }
}

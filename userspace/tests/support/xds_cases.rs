//! xDS Address inputs real istiod output triggers (issue 34, items 3, 4
//! and 5), each with the outcome ztunnel gives it, as plain data: one
//! response's resources (on top of a synced state), which resources the
//! answer must NACK by name (none: an ACK), and what each probed address
//! reaches afterwards. Self-contained (prost and the protos only) so any
//! harness can replay the rows, e.g. against a stock ztunnel.

#![allow(dead_code)] // each harness uses what it probes

use prost::Message as _;
use shunt_proto::{envoy::service::discovery::v3::Resource, istio::workload as pb};

pub const ADDRESS_TYPE_URL: &str = "type.googleapis.com/istio.workload.Address";

/// What a connection to a probed address reaches.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Reaches {
    /// The workload of this uid, over HBONE (`true`) or plaintext.
    Workload { uid: &'static str, hbone: bool },
    /// A service of this hostname (its VIP).
    Service { hostname: &'static str },
    /// Nothing known: passthrough.
    Nothing,
}

pub struct Case {
    pub name: &'static str,
    pub resources: Vec<Resource>,
    /// Resource names the answer NACKs (empty: ACK).
    pub nacked: Vec<&'static str>,
    /// Address (`ip` for workloads, `ip:port` for VIPs) → outcome.
    pub probes: Vec<(&'static str, Reaches)>,
}

pub fn pod(name: &str, ip: [u8; 4]) -> pb::Workload {
    pb::Workload {
        uid: format!("Kubernetes//Pod/default/{name}"),
        name: name.into(),
        namespace: "default".into(),
        addresses: vec![ip.to_vec()],
        tunnel_protocol: pb::TunnelProtocol::Hbone as i32,
        service_account: "default".into(),
        node: "node-b".into(),
        cluster_id: "Kubernetes".into(),
        workload_type: pb::WorkloadType::Pod as i32,
        ..Default::default()
    }
}

pub fn host_network_pod(name: &str, node_ip: [u8; 4]) -> pb::Workload {
    pb::Workload {
        network_mode: pb::NetworkMode::HostNetwork as i32,
        tunnel_protocol: pb::TunnelProtocol::None as i32,
        ..pod(name, node_ip)
    }
}

pub fn service(name: &str, hostname: &str, vip: [u8; 4]) -> pb::Service {
    pb::Service {
        name: name.into(),
        namespace: "default".into(),
        hostname: hostname.into(),
        addresses: vec![pb::NetworkAddress {
            network: String::new(),
            address: vip.to_vec(),
            ..Default::default()
        }],
        ports: vec![pb::Port {
            service_port: 80,
            target_port: 8080,
            ..Default::default()
        }],
        ..Default::default()
    }
}

pub fn raw(name: &str, value: Vec<u8>) -> Resource {
    Resource {
        name: name.into(),
        version: "1".into(),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE_URL.into(),
            value,
        }),
        ..Default::default()
    }
}

pub fn workload(w: pb::Workload) -> Resource {
    let name = w.uid.clone();
    raw(
        &name,
        pb::Address {
            r#type: Some(pb::address::Type::Workload(w)),
        }
        .encode_to_vec(),
    )
}

/// Named `namespace/hostname`, as istiod names services.
pub fn service_resource(s: pb::Service) -> Resource {
    let name = format!("{}/{}", s.namespace, s.hostname);
    raw(
        &name,
        pb::Address {
            r#type: Some(pb::address::Type::Service(s)),
        }
        .encode_to_vec(),
    )
}

/// The rows. Addresses in 198.18.0.0/15.
pub fn cases() -> Vec<Case> {
    let new_service = || {
        service_resource(service(
            "fresh",
            "fresh.default.svc.cluster.local",
            [198, 19, 7, 1],
        ))
    };
    let fresh = (
        "198.19.7.1:80",
        Reaches::Service {
            hostname: "fresh.default.svc.cluster.local",
        },
    );
    vec![
        Case {
            name: "item 4: an undecodable resource is refused alone",
            resources: vec![
                raw("Kubernetes//Pod/default/broken", vec![0x0a, 0xff, 0xff]),
                new_service(),
                workload(pod("ok", [198, 18, 7, 2])),
            ],
            nacked: vec!["Kubernetes//Pod/default/broken"],
            probes: vec![
                fresh.clone(),
                (
                    "198.18.7.2",
                    Reaches::Workload {
                        uid: "Kubernetes//Pod/default/ok",
                        hbone: true,
                    },
                ),
            ],
        },
        Case {
            name: "item 4: LEGACY_ISTIO_MTLS is refused alone",
            resources: vec![
                workload(pb::Workload {
                    tunnel_protocol: pb::TunnelProtocol::LegacyIstioMtls as i32,
                    ..pod("sidecar", [198, 18, 7, 3])
                }),
                new_service(),
            ],
            nacked: vec!["Kubernetes//Pod/default/sidecar"],
            probes: vec![fresh.clone(), ("198.18.7.3", Reaches::Nothing)],
        },
        Case {
            name: "item 4: an unknown enum value is refused alone",
            resources: vec![
                workload(pb::Workload {
                    tunnel_protocol: 9,
                    ..pod("future", [198, 18, 7, 4])
                }),
                new_service(),
            ],
            nacked: vec!["Kubernetes//Pod/default/future"],
            probes: vec![fresh, ("198.18.7.4", Reaches::Nothing)],
        },
        Case {
            name: "item 3: two hostNetwork pods on one node: ACK, the node IP names none",
            resources: vec![
                workload(host_network_pod("kube-proxy", [198, 18, 7, 100])),
                workload(host_network_pod("cni-agent", [198, 18, 7, 100])),
                workload(pod("beside", [198, 18, 7, 5])),
            ],
            nacked: vec![],
            probes: vec![
                ("198.18.7.100", Reaches::Nothing),
                (
                    "198.18.7.5",
                    Reaches::Workload {
                        uid: "Kubernetes//Pod/default/beside",
                        hbone: true,
                    },
                ),
            ],
        },
        Case {
            name: "item 5: a WorkloadEntry named like a pod leaves the pod's HBONE",
            resources: vec![
                workload(pod("twin", [198, 18, 7, 10])),
                workload(pb::Workload {
                    uid: "Kubernetes/networking.istio.io/WorkloadEntry/default/twin".into(),
                    tunnel_protocol: pb::TunnelProtocol::None as i32,
                    workload_type: pb::WorkloadType::Deployment as i32,
                    ..pod("twin", [198, 18, 7, 11])
                }),
            ],
            nacked: vec![],
            probes: vec![
                (
                    "198.18.7.10",
                    Reaches::Workload {
                        uid: "Kubernetes//Pod/default/twin",
                        hbone: true,
                    },
                ),
                (
                    "198.18.7.11",
                    Reaches::Workload {
                        uid: "Kubernetes/networking.istio.io/WorkloadEntry/default/twin",
                        hbone: false,
                    },
                ),
            ],
        },
        Case {
            name: "item 5: a ServiceEntry's two hosts are two services",
            resources: vec![
                service_resource(service("ext", "a.ext.example.com", [198, 19, 7, 41])),
                service_resource(service("ext", "b.ext.example.com", [198, 19, 7, 42])),
            ],
            nacked: vec![],
            probes: vec![
                (
                    "198.19.7.41:80",
                    Reaches::Service {
                        hostname: "a.ext.example.com",
                    },
                ),
                (
                    "198.19.7.42:80",
                    Reaches::Service {
                        hostname: "b.ext.example.com",
                    },
                ),
            ],
        },
    ]
}

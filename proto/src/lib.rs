//! Protocol definitions shunt speaks, compiled from the `.proto` files next
//! to this crate with prost (messages) and tonic (gRPC client and server).
//!
//! - [`istio::ca`]: Istio's certificate signing service
//!   (`istio.v1.auth.IstioCertificateService`), used by `--ca istio`.
//! - [`istio::workload`], [`istio::security`]: the resources istiod serves
//!   a node proxy over xDS (workloads and services; L4 authorization).
//! - [`envoy::service::discovery::v3`]: the delta aggregated discovery
//!   service they travel in (with [`envoy::config::core::v3::Node`] and
//!   [`google::rpc::Status`]), used by `--xds-address`.
//! - [`cri`]: the Kubernetes container runtime's `runtime.v1.RuntimeService`
//!   (only the sandbox calls), used to find pods' network namespaces.
//! - [`istio::zds`]: ztunnel's ZDS messages (no service: they travel over a
//!   unix SEQPACKET socket), served by `--proxy ztunnel`.

pub mod istio {
    /// `istio.v1.auth`: the Istio CA's `CreateCertificate` call.
    pub mod ca {
        // Generated code: its docs come from the .proto comments.
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("istio.v1.auth");
    }

    /// `istio.workload.zds`: the messages ztunnel's in-pod mode exchanges
    /// with its node agent over a SEQPACKET socket (`--proxy ztunnel`).
    pub mod zds {
        // Generated code: its docs come from the .proto comments.
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("istio.workload.zds");
    }

    /// `istio.workload`: workloads and services (`Address`).
    pub mod workload {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("istio.workload");
    }

    /// `istio.security`: L4 authorization policies (`Authorization`).
    pub mod security {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("istio.security");
    }
}

/// Envoy's xDS API (the parts shunt speaks). The module tree follows the
/// package names: generated code refers across packages by relative path.
pub mod envoy {
    pub mod config {
        pub mod core {
            pub mod v3 {
                #![allow(clippy::all, missing_docs)]
                tonic::include_proto!("envoy.config.core.v3");
            }
        }
    }
    pub mod service {
        pub mod discovery {
            pub mod v3 {
                #![allow(clippy::all, missing_docs)]
                tonic::include_proto!("envoy.service.discovery.v3");
            }
        }
    }
}

/// `google.rpc.Status`, the error detail of an xDS NACK.
pub mod google {
    pub mod rpc {
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("google.rpc");
    }
}

/// `runtime.v1`: the pod sandbox subset of the Kubernetes CRI.
pub mod cri {
    // Generated code: its docs come from the .proto comments.
    #![allow(clippy::all, missing_docs)]
    tonic::include_proto!("runtime.v1");
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::istio::ca::{IstioCertificateRequest, IstioCertificateResponse};

    /// The field numbers are Istio's: an istiod must read what we send.
    #[test]
    fn wire_layout_matches_istio() {
        let request = IstioCertificateRequest {
            csr: "C".into(),
            validity_duration: 5,
            metadata: Some(prost_types::Struct::default()),
        };
        // csr = 1 (length-delimited), validity_duration = 3 (varint),
        // metadata = 4 (length-delimited, empty Struct).
        assert_eq!(request.encode_to_vec(), [0x0a, 1, b'C', 0x18, 5, 0x22, 0]);
        let response = IstioCertificateResponse {
            cert_chain: vec!["L".into(), "R".into()],
        };
        // cert_chain = 1, repeated string.
        assert_eq!(response.encode_to_vec(), [0x0a, 1, b'L', 0x0a, 1, b'R']);
    }

    /// The field numbers are Istio's zds.proto: a stock ztunnel must read
    /// what we send and we must read its hello and acks.
    #[test]
    fn zds_wire_layout_matches_istio() {
        use super::istio::zds::{
            Ack, AddWorkload, DelWorkload, KeepWorkload, SnapshotSent, Version, WorkloadInfo,
            WorkloadRequest, WorkloadResponse, ZdsHello, workload_request::Payload,
            workload_response,
        };
        let hello = ZdsHello {
            version: Version::V1 as i32,
        };
        assert_eq!(hello.encode_to_vec(), [0x08, 1]);
        let add = WorkloadRequest {
            payload: Some(Payload::Add(AddWorkload {
                uid: "u".into(),
                workload_info: Some(WorkloadInfo {
                    name: "n".into(),
                    namespace: "s".into(),
                    service_account: "a".into(),
                }),
            })),
        };
        // add = 1 { uid = 1, workload_info = 2 { name = 1, namespace = 2,
        // service_account = 3 } }.
        assert_eq!(
            add.encode_to_vec(),
            [
                0x0a, 14, 0x0a, 1, b'u', 0x12, 9, 0x0a, 1, b'n', 0x12, 1, b's', 0x1a, 1, b'a'
            ]
        );
        let keep = WorkloadRequest {
            payload: Some(Payload::Keep(KeepWorkload { uid: "u".into() })),
        };
        assert_eq!(keep.encode_to_vec(), [0x2a, 3, 0x0a, 1, b'u']);
        let del = WorkloadRequest {
            payload: Some(Payload::Del(DelWorkload { uid: "u".into() })),
        };
        // del = 2 { uid = 2 }.
        assert_eq!(del.encode_to_vec(), [0x12, 3, 0x12, 1, b'u']);
        let sent = WorkloadRequest {
            payload: Some(Payload::SnapshotSent(SnapshotSent {})),
        };
        assert_eq!(sent.encode_to_vec(), [0x1a, 0]);
        let ack = WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack { error: "e".into() })),
        };
        assert_eq!(ack.encode_to_vec(), [0x0a, 3, 0x0a, 1, b'e']);
    }

    #[test]
    fn service_path_matches_istio() {
        use super::istio::ca::istio_certificate_service_server::SERVICE_NAME;
        assert_eq!(SERVICE_NAME, "istio.v1.auth.IstioCertificateService");
    }

    /// The field numbers are the CRI's: containerd and CRI-O must read what
    /// we send.
    #[test]
    fn cri_wire_layout_matches_the_cri() {
        use std::collections::HashMap;

        use super::cri::{
            ListPodSandboxRequest, PodSandboxFilter, PodSandboxState, PodSandboxStateValue,
            PodSandboxStatusRequest,
        };
        let status = PodSandboxStatusRequest {
            pod_sandbox_id: "s".into(),
            verbose: true,
        };
        // pod_sandbox_id = 1 (length-delimited), verbose = 2 (varint).
        assert_eq!(status.encode_to_vec(), [0x0a, 1, b's', 0x10, 1]);
        let list = ListPodSandboxRequest {
            filter: Some(PodSandboxFilter {
                id: String::new(),
                state: Some(PodSandboxStateValue {
                    state: PodSandboxState::SandboxNotready as i32,
                }),
                label_selector: HashMap::from([("k".into(), "v".into())]),
            }),
        };
        // filter = 1 { state = 2 { state = 1 }, label_selector = 3 {1: k, 2: v} }.
        assert_eq!(
            list.encode_to_vec(),
            [
                0x0a, 12, 0x12, 2, 0x08, 1, 0x1a, 6, 0x0a, 1, b'k', 0x12, 1, b'v'
            ]
        );
    }

    /// Istio's field numbers: istiod's bytes must decode into the same
    /// fields.
    #[test]
    fn workload_wire_layout_matches_istio() {
        use std::collections::HashMap;

        use super::istio::workload::{Address, Port, PortList, Workload, address};
        let workload = Workload {
            uid: "u".into(),
            addresses: vec![vec![198, 18, 0, 1]],
            tunnel_protocol: super::istio::workload::TunnelProtocol::Hbone as i32,
            services: HashMap::from([(
                "s".into(),
                PortList {
                    ports: vec![Port {
                        service_port: 80,
                        ..Default::default()
                    }],
                },
            )]),
            ..Default::default()
        };
        let address = Address {
            r#type: Some(address::Type::Workload(workload)),
        };
        // Address.workload = 1 { addresses = 3, tunnel_protocol = 5 (varint 1),
        // uid = 20 (tag 0xa2 0x01), services = 22 (tag 0xb2 0x01) {key = 1,
        // value = 2 { ports = 1 { service_port = 1 } } } }.
        assert_eq!(
            address.encode_to_vec(),
            [
                0x0a, 24, 0x1a, 4, 198, 18, 0, 1, 0x28, 1, 0xa2, 0x01, 1, b'u', 0xb2, 0x01, 9,
                0x0a, 1, b's', 0x12, 4, 0x0a, 2, 0x08, 80
            ]
        );
    }

    #[test]
    fn authorization_wire_layout_matches_istio() {
        use super::istio::security::{
            Action, Authorization, Clause, Match, Rule, ServiceAccountMatch, StringMatch,
            string_match,
        };
        let policy = Authorization {
            name: "p".into(),
            action: Action::Deny as i32,
            rules: vec![Rule {
                clauses: vec![Clause {
                    matches: vec![Match {
                        principals: vec![StringMatch {
                            match_type: Some(string_match::MatchType::Presence(())),
                        }],
                        destination_ports: vec![80],
                        ..Default::default()
                    }],
                }],
            }],
            ..Default::default()
        };
        // name = 1, action = 4 (varint 1), rules = 5 { clauses = 1 {
        // matches = 2 { principals = 3 { presence = 4 {} },
        // destination_ports = 9 (packed) } } }.
        assert_eq!(
            policy.encode_to_vec(),
            [
                0x0a, 1, b'p', 0x20, 1, 0x2a, 11, 0x0a, 9, 0x12, 7, 0x1a, 2, 0x22, 0, 0x4a, 1, 80
            ]
        );
        // service_accounts = 11 { namespace = 1, serviceAccount = 2 }: the
        // field whose absence made `from.source.serviceAccounts` match all.
        let by_account = Match {
            service_accounts: vec![ServiceAccountMatch {
                namespace: "d".into(),
                service_account: "s".into(),
            }],
            ..Default::default()
        };
        assert_eq!(
            by_account.encode_to_vec(),
            [0x5a, 6, 0x0a, 1, b'd', 0x12, 1, b's']
        );
    }

    #[test]
    fn delta_discovery_layout_matches_envoy() {
        use super::envoy::service::discovery::v3::{
            DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
            aggregated_discovery_service_server::SERVICE_NAME,
        };
        assert_eq!(
            SERVICE_NAME,
            "envoy.service.discovery.v3.AggregatedDiscoveryService"
        );
        let request = DeltaDiscoveryRequest {
            type_url: "t".into(),
            response_nonce: "n".into(),
            error_detail: Some(super::google::rpc::Status {
                code: 3,
                ..Default::default()
            }),
            ..Default::default()
        };
        // type_url = 2, response_nonce = 6, error_detail = 7 { code = 1 }.
        assert_eq!(
            request.encode_to_vec(),
            [0x12, 1, b't', 0x32, 1, b'n', 0x3a, 2, 0x08, 3]
        );
        let response = DeltaDiscoveryResponse {
            resources: vec![Resource {
                name: "r".into(),
                version: "v".into(),
                ..Default::default()
            }],
            type_url: "t".into(),
            nonce: "n".into(),
            removed_resources: vec!["x".into()],
            ..Default::default()
        };
        // resources = 2 { version = 1, name = 3 }, type_url = 4, nonce = 5,
        // removed_resources = 6.
        assert_eq!(
            response.encode_to_vec(),
            [
                0x12, 6, 0x0a, 1, b'v', 0x1a, 1, b'r', 0x22, 1, b't', 0x2a, 1, b'n', 0x32, 1, b'x'
            ]
        );
    }

    #[test]
    fn cri_service_path_matches_the_cri() {
        use super::cri::runtime_service_server::SERVICE_NAME;
        assert_eq!(SERVICE_NAME, "runtime.v1.RuntimeService");
    }
}

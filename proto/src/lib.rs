//! Protocol definitions shunt speaks, compiled from the `.proto` files next
//! to this crate with prost (messages) and tonic (gRPC client and server).
//!
//! - [`istio::ca`]: Istio's certificate signing service
//!   (`istio.v1.auth.IstioCertificateService`), used by `--ca istio`.
//! - [`cri`]: the Kubernetes container runtime's `runtime.v1.RuntimeService`
//!   (only the sandbox calls), used to find pods' network namespaces.

pub mod istio {
    /// `istio.v1.auth`: the Istio CA's `CreateCertificate` call.
    pub mod ca {
        // Generated code: its docs come from the .proto comments.
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("istio.v1.auth");
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

    #[test]
    fn cri_service_path_matches_the_cri() {
        use super::cri::runtime_service_server::SERVICE_NAME;
        assert_eq!(SERVICE_NAME, "runtime.v1.RuntimeService");
    }
}

//! Protocol definitions shunt speaks, compiled from the `.proto` files next
//! to this crate with prost (messages) and tonic (gRPC client and server).
//!
//! - [`istio::ca`]: Istio's certificate signing service
//!   (`istio.v1.auth.IstioCertificateService`), used by `--ca istio`.

pub mod istio {
    /// `istio.v1.auth`: the Istio CA's `CreateCertificate` call.
    pub mod ca {
        // Generated code: its docs come from the .proto comments.
        #![allow(clippy::all, missing_docs)]
        tonic::include_proto!("istio.v1.auth");
    }
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
}

//! What both the identity manager (signing keys, issued certificates) and
//! HBONE's TLS (`tls.rs`) use: the one rustls crypto provider and reading a
//! certificate's URI SANs. A leaf module, so that `identity` and `tls` need
//! not import each other.

use std::sync::{Arc, OnceLock};

use rustls::crypto::CryptoProvider;

/// rustls' *ring* provider restricted to the TLS 1.3 AES-GCM suites.
pub fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: OnceLock<Arc<CryptoProvider>> = OnceLock::new();
    PROVIDER
        .get_or_init(|| {
            let mut provider = rustls::crypto::ring::default_provider();
            provider.cipher_suites = vec![
                rustls::crypto::ring::cipher_suite::TLS13_AES_256_GCM_SHA384,
                rustls::crypto::ring::cipher_suite::TLS13_AES_128_GCM_SHA256,
            ];
            Arc::new(provider)
        })
        .clone()
}

/// The URI SANs of a certificate, in order.
pub fn uri_sans<'a>(cert: &'a x509_parser::certificate::X509Certificate<'_>) -> Vec<&'a str> {
    let Ok(Some(san)) = cert.subject_alternative_name() else {
        return Vec::new();
    };
    san.value
        .general_names
        .iter()
        .filter_map(|n| match n {
            x509_parser::extensions::GeneralName::URI(u) => Some(*u),
            _ => None,
        })
        .collect()
}

//! TLS for HBONE, as ztunnel speaks it.
//!
//! - TLS 1.3 only, with AES-256-GCM and AES-128-GCM (no ChaCha20: ztunnel
//!   offers and accepts only the AES suites).
//! - ALPN `h2`; the client sends no SNI (the server picks its certificate by
//!   the IP the connection arrived on, see `proxy::inbound`).
//! - Both sides present SPIFFE certificates. The client accepts the server
//!   only if its chain reaches a mesh root and its URI SAN is exactly the
//!   destination workload's identity; the server accepts a client whose chain
//!   reaches a root and whose SPIFFE id is in our trust domain.
//!
//! Session resumption is off: a resumed session skips certificate checks,
//! and every connection must prove the identity it speaks for. Chains are
//! checked against the revocation lists in force (`identity::crl`).

use std::sync::Arc;

use rustls::{
    CertificateError, ClientConfig, DigitallySignedStruct, DistinguishedName, Error as TlsError,
    ServerConfig, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
    server::danger::{ClientCertVerified, ClientCertVerifier},
};
use rustls_pki_types::{CertificateDer, ServerName, TrustAnchor, UnixTime};

pub use crate::crypto::{provider, uri_sans};
use crate::{
    identity::{WorkloadCert, crl::Revocations},
    state::{SpiffeId, TrustDomain},
};

/// The only ALPN protocol HBONE uses.
pub const ALPN_H2: &[u8] = b"h2";

/// Errors building TLS configurations.
#[derive(Debug, thiserror::Error)]
pub enum TlsConfigError {
    #[error("invalid trust root: {0}")]
    BadRoot(String),
    #[error("no trust roots configured")]
    NoRoots,
    #[error("rustls: {0}")]
    Rustls(#[from] TlsError),
}

/// The mesh's trust anchors, parsed once per set, and the revocation lists
/// in force (none unless `--crl-path`: `identity::crl`). Clones share both:
/// [`TrustRoots::replace`] (a root rotation) reaches every verifier, and
/// each handshake reads the set in force when it checks a chain.
#[derive(Clone, Debug)]
pub struct TrustRoots {
    anchors: Arc<std::sync::RwLock<Arc<Vec<TrustAnchor<'static>>>>>,
    revocations: Arc<Revocations>,
}

impl TrustRoots {
    pub fn new(roots: &[CertificateDer<'_>]) -> Result<Self, TlsConfigError> {
        Ok(Self {
            anchors: Arc::new(std::sync::RwLock::new(Arc::new(anchors(roots)?))),
            revocations: Revocations::none(),
        })
    }

    /// Trusts `roots` from now on, instead of the set before (which stays
    /// if `roots` is unusable). Connections already open are not checked
    /// again.
    pub fn replace(&self, roots: &[CertificateDer<'_>]) -> Result<(), TlsConfigError> {
        let anchors = Arc::new(anchors(roots)?);
        *self.anchors.write().unwrap_or_else(|p| p.into_inner()) = anchors;
        Ok(())
    }

    fn current(&self) -> Arc<Vec<TrustAnchor<'static>>> {
        self.anchors
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// The same roots, checking chains against `revocations` too.
    pub fn with_revocations(self, revocations: Arc<Revocations>) -> Self {
        Self {
            revocations,
            ..self
        }
    }

    /// Whether a list can ever revoke a peer (`--crl-path` given).
    pub fn revokes(&self) -> bool {
        self.revocations.path().is_some()
    }
}

/// One connection's watch on the revocation lists: made before its TLS
/// handshake, so that a reload during the handshake is seen, then armed
/// with the chain the peer presented ([`until_revoked`]).
#[derive(Debug)]
pub struct RevocationWatch {
    roots: TrustRoots,
    reloads: tokio::sync::watch::Receiver<u64>,
    /// `client_auth` for an inbound peer, `server_auth` for an outbound one.
    usage: webpki::KeyUsage,
}

impl TrustRoots {
    /// A watch for one connection whose peer is checked for `usage`;
    /// `None` without `--crl-path` (nothing can be revoked).
    pub fn revocation_watch(&self, usage: webpki::KeyUsage) -> Option<RevocationWatch> {
        Some(RevocationWatch {
            roots: self.clone(),
            reloads: self.revocations.subscribe()?,
            usage,
        })
    }
}

/// Resolves once a reloaded list revokes a certificate of the chain the
/// peer presented in `tls` (as ztunnel: the whole chain, checked again at
/// the time of the handshake, so an expiry never ends a connection here);
/// never without a watch. The chain is copied only when watched.
///
/// Each open connection checks its own chain on a reload: lists change
/// seldom, and then every connection costs one chain verification.
pub fn until_revoked(
    watch: Option<RevocationWatch>,
    tls: &rustls::CommonState,
) -> impl std::future::Future<Output = ()> + Send + 'static + use<> {
    let armed = watch.and_then(|w| Some((w, tls.peer_certificates()?.to_vec())));
    until_chain_revoked(armed, UnixTime::now())
}

/// [`until_revoked`] of a chain (leaf first) accepted at `established`.
pub(crate) async fn until_chain_revoked(
    armed: Option<(RevocationWatch, Vec<CertificateDer<'static>>)>,
    established: UnixTime,
) {
    let Some((mut watch, chain)) = armed else {
        return std::future::pending().await;
    };
    let Some((leaf, intermediates)) = chain.split_first() else {
        return std::future::pending().await;
    };
    while watch.reloads.changed().await.is_ok() {
        let verdict = verify_chain(&watch.roots, leaf, intermediates, established, watch.usage);
        if matches!(
            verdict,
            Err(TlsError::InvalidCertificate(CertificateError::Revoked))
        ) {
            return;
        }
    }
    std::future::pending().await
}

/// Whether a handshake failed because this side found the peer's chain
/// revoked (ztunnel's `crl_policy_rejections`; not the peer's alert).
pub fn failed_on_revocation(e: &std::io::Error) -> bool {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<TlsError>())
        .is_some_and(|e| matches!(e, TlsError::InvalidCertificate(CertificateError::Revoked)))
}

fn anchors(roots: &[CertificateDer<'_>]) -> Result<Vec<TrustAnchor<'static>>, TlsConfigError> {
    if roots.is_empty() {
        return Err(TlsConfigError::NoRoots);
    }
    roots
        .iter()
        .map(|r| {
            webpki::anchor_from_trusted_cert(r)
                .map(|a| a.to_owned())
                .map_err(|e| TlsConfigError::BadRoot(e.to_string()))
        })
        .collect()
}

/// The SPIFFE id of a leaf certificate: its single `spiffe://` URI SAN.
pub fn spiffe_id_of(cert: &CertificateDer<'_>) -> Result<String, String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert)
        .map_err(|e| format!("unparsable certificate: {e}"))?;
    let spiffe: Vec<&str> = uri_sans(&parsed)
        .into_iter()
        .filter(|u| u.starts_with("spiffe://"))
        .collect();
    match spiffe.as_slice() {
        [one] => Ok((*one).to_owned()),
        [] => Err("no SPIFFE URI SAN".into()),
        _ => Err(format!("{} SPIFFE URI SANs (expected one)", spiffe.len())),
    }
}

/// The trust domain of a SPIFFE id string (`spiffe://TD/...`).
pub fn trust_domain_of(id: &str) -> Option<&str> {
    id.strip_prefix("spiffe://")?.split('/').next()
}

/// The peer's SPIFFE id after a handshake (the verifiers already checked it).
pub fn peer_identity(conn: &rustls::CommonState) -> Option<String> {
    conn.peer_certificates()
        .and_then(|certs| certs.first())
        .and_then(|leaf| spiffe_id_of(leaf).ok())
}

fn verify_chain(
    roots: &TrustRoots,
    end_entity: &CertificateDer<'_>,
    intermediates: &[CertificateDer<'_>],
    now: UnixTime,
    usage: webpki::KeyUsage,
) -> Result<(), TlsError> {
    let ee = webpki::EndEntityCert::try_from(end_entity)
        .map_err(|_| TlsError::InvalidCertificate(CertificateError::BadEncoding))?;
    let lists = roots.revocations.current();
    let lists: Vec<&webpki::CertRevocationList<'_>> = lists.iter().collect();
    // As ztunnel: the whole chain; a certificate no list speaks for
    // passes; an expired list still counts.
    let revocation = webpki::RevocationOptionsBuilder::new(&lists)
        .ok()
        .map(|options| {
            options
                .with_depth(webpki::RevocationCheckDepth::Chain)
                .with_status_policy(webpki::UnknownStatusPolicy::Allow)
                .with_expiration_policy(webpki::ExpirationPolicy::Ignore)
                .build()
        });
    ee.verify_for_usage(
        provider().signature_verification_algorithms.all,
        &roots.current(),
        intermediates,
        now,
        usage,
        revocation,
        None,
    )
    .map(|_| ())
    .map_err(webpki_to_rustls)
}

/// The verifiers' chain check alone, for tests: `Err` says why.
#[cfg(test)]
pub(crate) fn check_chain(
    roots: &TrustRoots,
    end_entity: &CertificateDer<'_>,
    now: UnixTime,
    usage: webpki::KeyUsage,
) -> Result<(), String> {
    verify_chain(roots, end_entity, &[], now, usage).map_err(|e| format!("{e:?}"))
}

fn webpki_to_rustls(e: webpki::Error) -> TlsError {
    use webpki::Error as E;
    TlsError::InvalidCertificate(match e {
        E::CertExpired { .. } => CertificateError::Expired,
        E::CertNotValidYet { .. } => CertificateError::NotValidYet,
        E::UnknownIssuer => CertificateError::UnknownIssuer,
        E::InvalidSignatureForPublicKey => CertificateError::BadSignature,
        E::CertRevoked => CertificateError::Revoked,
        other => CertificateError::Other(rustls::OtherError(Arc::new(other))),
    })
}

fn identity_error(reason: String) -> TlsError {
    TlsError::InvalidCertificate(CertificateError::Other(rustls::OtherError(Arc::new(
        IdentityMismatch(reason),
    ))))
}

#[derive(Debug, thiserror::Error)]
#[error("{0}")]
struct IdentityMismatch(String);

/// Client side: the server must be exactly the expected workload.
#[derive(Debug)]
struct SpiffeServerVerifier {
    roots: TrustRoots,
    expected: SpiffeId,
    /// Also accepted (a waypoint service's SANs); usually empty.
    also_accept: Vec<String>,
}

impl ServerCertVerifier for SpiffeServerVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp_response: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, TlsError> {
        verify_chain(
            &self.roots,
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::server_auth(),
        )?;
        let id = spiffe_id_of(end_entity).map_err(identity_error)?;
        if id != self.expected.as_str() && !self.also_accept.contains(&id) {
            return Err(identity_error(format!(
                "server identity {id} is not the destination's {}",
                self.expected
            )));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        verify_tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        supported_schemes()
    }
}

/// Server side: any workload of our trust domain whose chain reaches a root.
#[derive(Debug)]
struct SpiffeClientVerifier {
    roots: TrustRoots,
    trust_domain: TrustDomain,
}

impl ClientCertVerifier for SpiffeClientVerifier {
    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn client_auth_mandatory(&self) -> bool {
        true
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, TlsError> {
        verify_chain(
            &self.roots,
            end_entity,
            intermediates,
            now,
            webpki::KeyUsage::client_auth(),
        )?;
        let id = spiffe_id_of(end_entity).map_err(identity_error)?;
        if trust_domain_of(&id) != Some(self.trust_domain.as_str()) {
            return Err(identity_error(format!(
                "client identity {id} is not in trust domain {}",
                self.trust_domain
            )));
        }
        Ok(ClientCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        _message: &[u8],
        _cert: &CertificateDer<'_>,
        _dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        tls12_refused()
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, TlsError> {
        verify_tls13(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        supported_schemes()
    }
}

/// The server config presenting `cert` (the destination workload's) and
/// requiring a client of `trust_domain`.
pub fn server_config(
    cert: &WorkloadCert,
    roots: &TrustRoots,
    trust_domain: &TrustDomain,
) -> Result<Arc<ServerConfig>, TlsConfigError> {
    let verifier = Arc::new(SpiffeClientVerifier {
        roots: roots.clone(),
        trust_domain: trust_domain.clone(),
    });
    let mut config = ServerConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .with_client_cert_verifier(verifier)
        .with_cert_resolver(Arc::new(FixedCert(cert.certified_key())));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    // Tickets would only be useful for resumption, which is off.
    config.send_tls13_tickets = 0;
    config.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
    Ok(Arc::new(config))
}

/// The client config presenting `cert` (the source workload's) and accepting
/// only a server that is `expected`.
pub fn client_config(
    cert: &WorkloadCert,
    roots: &TrustRoots,
    expected: &SpiffeId,
) -> Result<Arc<ClientConfig>, TlsConfigError> {
    client_config_accepting(cert, roots, expected, &[])
}

/// [`client_config`] that also accepts a server presenting one of
/// `also_accept` (SPIFFE URIs): a waypoint is checked against its
/// workload's identity and the SANs istiod gives its service.
pub fn client_config_accepting(
    cert: &WorkloadCert,
    roots: &TrustRoots,
    expected: &SpiffeId,
    also_accept: &[String],
) -> Result<Arc<ClientConfig>, TlsConfigError> {
    let verifier = Arc::new(SpiffeServerVerifier {
        roots: roots.clone(),
        expected: expected.clone(),
        also_accept: also_accept.to_vec(),
    });
    let mut config = ClientConfig::builder_with_provider(provider())
        .with_protocol_versions(&[&rustls::version::TLS13])?
        .dangerous()
        .with_custom_certificate_verifier(verifier)
        .with_client_cert_resolver(Arc::new(FixedCert(cert.certified_key())));
    config.alpn_protocols = vec![ALPN_H2.to_vec()];
    config.enable_sni = false;
    config.resumption = rustls::client::Resumption::disabled();
    Ok(Arc::new(config))
}

/// Always presents one certificate: the workload's, chosen before the
/// handshake (by arrival IP on the server, by source pod on the client).
#[derive(Debug)]
struct FixedCert(Arc<rustls::sign::CertifiedKey>);

impl rustls::server::ResolvesServerCert for FixedCert {
    fn resolve(
        &self,
        _hello: rustls::server::ClientHello<'_>,
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
}

impl rustls::client::ResolvesClientCert for FixedCert {
    fn resolve(
        &self,
        _root_hint_subjects: &[&[u8]],
        _sigschemes: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }

    fn has_certs(&self) -> bool {
        true
    }
}

// Signature checks shared by both verifiers.

/// TLS 1.2 is never negotiated (TLS 1.3-only configs).
fn tls12_refused() -> Result<HandshakeSignatureValid, TlsError> {
    Err(TlsError::PeerIncompatible(
        rustls::PeerIncompatible::Tls12NotOffered,
    ))
}

fn verify_tls13(
    message: &[u8],
    cert: &CertificateDer<'_>,
    dss: &DigitallySignedStruct,
) -> Result<HandshakeSignatureValid, TlsError> {
    rustls::crypto::verify_tls13_signature(
        message,
        cert,
        dss,
        &provider().signature_verification_algorithms,
    )
}

fn supported_schemes() -> Vec<SignatureScheme> {
    provider()
        .signature_verification_algorithms
        .supported_schemes()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_aes_gcm_tls13_suites() {
        let names: Vec<_> = provider().cipher_suites.iter().map(|s| s.suite()).collect();
        assert_eq!(
            names,
            [
                rustls::CipherSuite::TLS13_AES_256_GCM_SHA384,
                rustls::CipherSuite::TLS13_AES_128_GCM_SHA256
            ]
        );
    }

    #[test]
    fn trust_domain_parsing() {
        assert_eq!(
            trust_domain_of("spiffe://cluster.local/ns/a/sa/b"),
            Some("cluster.local")
        );
        assert_eq!(trust_domain_of("https://x"), None);
    }
}

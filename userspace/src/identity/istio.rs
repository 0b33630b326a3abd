//! The Istio CA client (`--ca istio`): workload certificates signed by
//! istiod (or any server of `istio.v1.auth.IstioCertificateService`) over
//! gRPC, the way ztunnel gets them.
//!
//! Per certificate: one `CreateCertificate` call carrying the CSR the
//! manager made (its URI SAN is the workload's SPIFFE id), the requested
//! validity in seconds, and the workload's identity under
//! `ImpersonatedIdentity` in the request's `metadata` Struct — the node proxy
//! asks on behalf of the workloads it serves, which istiod allows only for
//! trusted node-proxy service accounts (`CA_TRUSTED_NODE_ACCOUNTS`, by default
//! `istio-system/ztunnel`). The caller authenticates with a bearer token
//! (`authorization: Bearer <token>`) read from a file before every call,
//! because projected service-account tokens are rotated on disk. The channel
//! is TLS, verified against the root certificate file (the mesh's root, which
//! is also what peers' certificates must chain to).
//!
//! The answer is not trusted blindly: the leaf must carry exactly the
//! requested SPIFFE id, certify the CSR's key and chain to the root file.
//!
//! The root file is read again when it changes ([`IstioCa::reload_roots`],
//! as ztunnel since its #1775): a root rotation (istiod's ConfigMap gaining
//! the new root beside the old) then reaches the channel to istiod and the
//! mesh's trust anchors without a restart.

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Mutex, RwLock},
    time::Duration,
};

use prost_types::{Struct, Value, value::Kind};
use rustls_pki_types::{CertificateDer, UnixTime};
use shunt_proto::istio::ca::{
    IstioCertificateRequest, istio_certificate_service_client::IstioCertificateServiceClient,
};
use tonic::{
    Code, Status,
    metadata::AsciiMetadataValue,
    transport::{Certificate, Channel, ClientTlsConfig, Endpoint},
};

use super::{
    CertificateAuthority, FileStamp, IdentityError, SignFuture, SignRequest, ca::parse_certs,
};
use crate::state::SpiffeId;

/// The metadata key under which ztunnel names the workload it asks for.
pub const IMPERSONATED_IDENTITY_KEY: &str = "ImpersonatedIdentity";

/// Where and how to reach the Istio CA.
#[derive(Clone, Debug)]
pub struct IstioCaConfig {
    /// The CA's URL, e.g. `https://istiod.istio-system.svc:15012`. A bare
    /// `host:port` means https. Its host name is what the CA's serving
    /// certificate is checked against.
    pub address: String,
    /// PEM root certificate(s) the CA's serving certificate must chain to;
    /// also the trust anchors for issued workload certificates.
    pub root_cert: PathBuf,
    /// File holding the bearer token (a Kubernetes service account token with
    /// the `istio-ca` audience), re-read before every call.
    pub token_file: PathBuf,
    /// Sent as the `ClusterID` request header when set: istiod uses it to pick
    /// the cluster whose API server validates the token (multi-cluster);
    /// without it istiod uses its own cluster.
    pub cluster_id: Option<String>,
    /// Limit for establishing the TCP+TLS connection.
    pub connect_timeout: Duration,
    /// Limit for one call. Below the identity manager's default sign timeout
    /// (10 s), so a slow CA surfaces as this client's error, which names the
    /// CA, rather than as a bare manager timeout.
    pub request_timeout: Duration,
}

impl IstioCaConfig {
    /// The defaults ztunnel uses for everything but the three settings.
    pub fn new(address: impl Into<String>, root_cert: PathBuf, token_file: PathBuf) -> Self {
        Self {
            address: address.into(),
            root_cert,
            token_file,
            cluster_id: None,
            connect_timeout: Duration::from_secs(5),
            request_timeout: Duration::from_secs(8),
        }
    }
}

/// Why the Istio CA could not be set up or did not sign.
#[derive(Debug, thiserror::Error)]
pub enum IstioCaError {
    #[error("Istio CA address {address:?}: {reason}")]
    Address { address: String, reason: String },
    #[error("Istio CA root certificate {path}: {source}")]
    RootCertFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Istio CA root certificate {path}: {reason}")]
    RootCertInvalid { path: PathBuf, reason: String },
    #[error("Istio CA {address}: TLS setup: {reason}")]
    Tls { address: String, reason: String },
    #[error("Istio CA token file {path}: {source}")]
    TokenFile {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("Istio CA token file {path}: {reason}")]
    TokenInvalid { path: PathBuf, reason: String },
    #[error("Istio CA {address} is unreachable (asking for {identity}): {detail}")]
    Unreachable {
        address: String,
        identity: SpiffeId,
        detail: String,
    },
    #[error(
        "Istio CA {address} refused to sign for {identity}: status {code:?} ({code}): {message}"
    )]
    Refused {
        address: String,
        identity: SpiffeId,
        code: Code,
        message: String,
    },
}

/// A client of the Istio CA. Cheap to share: tonic's channel multiplexes
/// calls over one HTTP/2 connection and reconnects by itself.
pub struct IstioCa {
    /// The channel and the roots it checks istiod against: replaced whole
    /// when the root file changes.
    trust: RwLock<Trust>,
    address: String,
    token_file: PathBuf,
    cluster_id: Option<AsciiMetadataValue>,
    root_file: PathBuf,
    /// The root file's modification time and length when last read.
    root_seen: Mutex<FileStamp>,
    connect_timeout: Duration,
    request_timeout: Duration,
}

struct Trust {
    client: IstioCertificateServiceClient<Channel>,
    roots: Vec<CertificateDer<'static>>,
}

/// The root file's stamp; an unreadable file counts as absent (the read
/// that follows names the error).
fn root_stamp(path: &std::path::Path) -> FileStamp {
    super::file_stamp(path).ok().flatten()
}

impl std::fmt::Debug for IstioCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IstioCa")
            .field("address", &self.address)
            .field("token_file", &self.token_file)
            .field("root_file", &self.root_file)
            .field("roots", &CertificateAuthority::roots(self).len())
            .finish_non_exhaustive()
    }
}

impl IstioCa {
    /// Reads the root certificate, prepares the TLS channel and tries to
    /// connect once. A CA that cannot be reached now is only a warning: the
    /// agent must be able to start before istiod (every call reconnects, and
    /// the identity manager retries), whereas a bad address or root file can
    /// never work and is an error.
    pub async fn connect(config: IstioCaConfig) -> Result<Self, IstioCaError> {
        let address = normalize_address(&config.address)?;
        let root_seen = root_stamp(&config.root_cert);
        let (root_pem, roots) = read_roots(&config.root_cert)?;

        let cluster_id = config
            .cluster_id
            .as_deref()
            .map(|id| {
                AsciiMetadataValue::try_from(id).map_err(|e| IstioCaError::Address {
                    address: address.clone(),
                    reason: format!("cluster id {id:?} is not a valid header value: {e}"),
                })
            })
            .transpose()?;

        let endpoint = endpoint(
            &address,
            &root_pem,
            config.connect_timeout,
            config.request_timeout,
        )?;
        let channel = match endpoint.connect().await {
            Ok(channel) => {
                tracing::info!(%address, root = %config.root_cert.display(), "connected to the Istio CA");
                channel
            }
            Err(e) => {
                tracing::warn!(%address, error = %error_chain(&e),
                    "Istio CA not reachable yet; certificates will be requested when it is");
                endpoint.connect_lazy()
            }
        };
        Ok(Self {
            trust: RwLock::new(Trust {
                client: IstioCertificateServiceClient::new(channel),
                roots,
            }),
            address,
            token_file: config.token_file,
            cluster_id,
            root_file: config.root_cert,
            root_seen: Mutex::new(root_seen),
            connect_timeout: config.connect_timeout,
            request_timeout: config.request_timeout,
        })
    }

    /// Reads the root file again if it changed since the last read:
    /// `Ok(true)` when its roots are now the ones istiod and the mesh's
    /// peers are checked against (the channel to istiod is made anew, and
    /// connects at its next call). A file that went away or does not parse
    /// is an error, reported once, and the last good roots stay.
    pub fn reload_roots(&self) -> Result<bool, IstioCaError> {
        let now = root_stamp(&self.root_file);
        {
            let mut seen = self.root_seen.lock().unwrap_or_else(|p| p.into_inner());
            if *seen == now {
                return Ok(false);
            }
            *seen = now;
        }
        let (root_pem, roots) = read_roots(&self.root_file)?;
        let endpoint = endpoint(
            &self.address,
            &root_pem,
            self.connect_timeout,
            self.request_timeout,
        )?;
        let client = IstioCertificateServiceClient::new(endpoint.connect_lazy());
        *self.trust.write().unwrap_or_else(|p| p.into_inner()) = Trust { client, roots };
        Ok(true)
    }

    /// The CA's URL as used.
    pub fn address(&self) -> &str {
        &self.address
    }

    /// `Bearer <token>`, from the token file as it is now.
    fn bearer(&self) -> Result<AsciiMetadataValue, IstioCaError> {
        let path = &self.token_file;
        let raw = std::fs::read(path).map_err(|source| IstioCaError::TokenFile {
            path: path.clone(),
            source,
        })?;
        let invalid = |reason: &str| IstioCaError::TokenInvalid {
            path: path.clone(),
            reason: reason.into(),
        };
        let token = std::str::from_utf8(&raw)
            .map_err(|_| invalid("not UTF-8 text"))?
            // Hand-written token files usually end in a newline, which is not
            // allowed in a header value and is not part of the token.
            .trim();
        if token.is_empty() {
            return Err(invalid("empty"));
        }
        // The value is never logged or put in an error: it is a credential.
        AsciiMetadataValue::try_from(format!("Bearer {token}"))
            .map_err(|_| invalid("contains characters not allowed in a header"))
    }

    async fn create_certificate(
        &self,
        request: &SignRequest,
    ) -> Result<Vec<String>, IdentityError> {
        let identity = &request.identity;
        let mut call = tonic::Request::new(IstioCertificateRequest {
            csr: request.csr_pem.clone(),
            validity_duration: i64::try_from(request.ttl.as_secs()).unwrap_or(i64::MAX),
            metadata: Some(Struct {
                fields: BTreeMap::from([(
                    IMPERSONATED_IDENTITY_KEY.to_string(),
                    Value {
                        kind: Some(Kind::StringValue(identity.to_string())),
                    },
                )]),
            }),
        });
        call.metadata_mut().insert("authorization", self.bearer()?);
        if let Some(cluster_id) = &self.cluster_id {
            // gRPC metadata keys are lower-case on the wire; istiod reads
            // "ClusterID" case-insensitively.
            call.metadata_mut().insert("clusterid", cluster_id.clone());
        }
        // The generated client needs `&mut self`; clones share the channel.
        let mut client = self
            .trust
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .client
            .clone();
        let response = client
            .create_certificate(call)
            .await
            .map_err(|status| self.call_error(identity, &status))?;
        Ok(response.into_inner().cert_chain)
    }

    fn call_error(&self, identity: &SpiffeId, status: &Status) -> IstioCaError {
        // tonic reports connect, TLS and timeout failures with their cause
        // as the status' source; a status without one is the CA's answer
        // (even `Unavailable`: istiod says that when it is not ready).
        if let Some(cause) = std::error::Error::source(status) {
            IstioCaError::Unreachable {
                address: self.address.clone(),
                identity: identity.clone(),
                // The cause alone: the status' own text adds only its code
                // and a Debug dump of the same cause.
                detail: error_chain(cause),
            }
        } else {
            IstioCaError::Refused {
                address: self.address.clone(),
                identity: identity.clone(),
                code: status.code(),
                message: status.message().to_string(),
            }
        }
    }

    /// Checks the CA's answer and turns it into leaf + intermediates.
    fn check_chain(
        &self,
        request: &SignRequest,
        pem_chain: &[String],
    ) -> Result<Vec<CertificateDer<'static>>, IdentityError> {
        let identity = &request.identity;
        let bad = |reason: String| IdentityError::BadIssuedCertificate {
            identity: identity.clone(),
            reason: format!("from Istio CA {}: {reason}", self.address),
        };
        // Istio sends one certificate per element; some CAs put a whole
        // bundle in one, so every CERTIFICATE block of every element counts.
        let mut chain = Vec::new();
        for (i, element) in pem_chain.iter().enumerate() {
            let certs = parse_certs(element)
                .map_err(|e| bad(format!("cert_chain[{i}] is not PEM: {e}")))?;
            chain.extend(certs);
        }
        let leaf = chain
            .first()
            .ok_or_else(|| bad("empty certificate chain".into()))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| bad(format!("unparsable leaf: {e}")))?;

        // A CA that maps the caller to a different identity (or ignores
        // ImpersonatedIdentity) must not make a workload speak as another.
        let uris = crate::crypto::uri_sans(&parsed);
        if uris != [identity.as_str()] {
            return Err(bad(format!(
                "leaf URI SANs are {uris:?}, expected exactly [{identity}]"
            )));
        }
        let csr = rcgen::CertificateSigningRequestParams::from_pem(&request.csr_pem)
            .map_err(|e| bad(format!("our own CSR does not parse: {e}")))?;
        if parsed.public_key().subject_public_key.data.as_ref()
            != rcgen::PublicKeyData::der_bytes(&csr.public_key)
        {
            return Err(bad(
                "the leaf certifies a different key than the CSR's".into()
            ));
        }

        // Peers verify against the same roots: a leaf that does not chain to
        // them would fail every handshake, so refuse it here, clearly.
        let roots = CertificateAuthority::roots(self);
        let anchors = roots
            .iter()
            .filter_map(|r| webpki::anchor_from_trusted_cert(r).ok())
            .collect::<Vec<_>>();
        let rest: Vec<CertificateDer<'static>> = chain[1..]
            .iter()
            .filter(|c| !roots.contains(c))
            .cloned()
            .collect();
        let end_entity = webpki::EndEntityCert::try_from(leaf)
            .map_err(|e| bad(format!("leaf rejected by webpki: {e}")))?;
        for (usage, name) in [
            (webpki::KeyUsage::server_auth(), "server"),
            (webpki::KeyUsage::client_auth(), "client"),
        ] {
            end_entity
                .verify_for_usage(
                    webpki::ALL_VERIFICATION_ALGS,
                    &anchors,
                    &rest,
                    UnixTime::now(),
                    usage,
                    None,
                    None,
                )
                .map_err(|e| {
                    bad(format!(
                        "leaf does not verify as a TLS {name} certificate against the roots in {}: {e}",
                        self.root_file.display()
                    ))
                })?;
        }

        // Same shape as the built-in CA's answer: roots are left out (peers
        // have them).
        let mut out = Vec::with_capacity(1 + rest.len());
        out.push(leaf.clone());
        out.extend(rest);
        Ok(out)
    }
}

impl CertificateAuthority for IstioCa {
    fn sign(&self, request: SignRequest) -> SignFuture<'_> {
        Box::pin(async move {
            let pem_chain = self.create_certificate(&request).await?;
            let chain = self.check_chain(&request, &pem_chain)?;
            tracing::debug!(identity = %request.identity, address = %self.address,
                certificates = chain.len(), "Istio CA signed");
            Ok(chain)
        })
    }

    fn roots(&self) -> Vec<CertificateDer<'static>> {
        self.trust
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .roots
            .clone()
    }

    fn reload_roots(&self) -> Result<bool, IdentityError> {
        Ok(IstioCa::reload_roots(self)?)
    }
}

/// The root file's PEM and its roots, each usable as a trust anchor.
fn read_roots(
    path: &std::path::Path,
) -> Result<(Vec<u8>, Vec<CertificateDer<'static>>), IstioCaError> {
    let root_pem = std::fs::read(path).map_err(|source| IstioCaError::RootCertFile {
        path: path.to_owned(),
        source,
    })?;
    let root_invalid = |reason: String| IstioCaError::RootCertInvalid {
        path: path.to_owned(),
        reason,
    };
    let roots = std::str::from_utf8(&root_pem)
        .map_err(|e| root_invalid(format!("not PEM text: {e}")))
        .and_then(|text| parse_certs(text).map_err(root_invalid))?;
    if roots.is_empty() {
        return Err(root_invalid("holds no CERTIFICATE block".into()));
    }
    // Each root must be usable as a webpki trust anchor, or every issued
    // certificate would later fail verification for an obscure reason.
    for (i, root) in roots.iter().enumerate() {
        webpki::anchor_from_trusted_cert(root)
            .map_err(|e| root_invalid(format!("certificate #{i} is not a usable root: {e}")))?;
    }
    Ok((root_pem, roots))
}

/// The channel's endpoint: TLS to `address` trusting only `root_pem`.
fn endpoint(
    address: &str,
    root_pem: &[u8],
    connect_timeout: Duration,
    request_timeout: Duration,
) -> Result<Endpoint, IstioCaError> {
    // Only the given roots: the CA is the mesh's, never a public one.
    let tls = ClientTlsConfig::new()
        .ca_certificate(Certificate::from_pem(root_pem))
        .timeout(connect_timeout);
    let endpoint =
        Endpoint::from_shared(address.to_owned()).map_err(|e| IstioCaError::Address {
            address: address.to_owned(),
            reason: error_chain(&e),
        })?;
    Ok(endpoint
        .tls_config(tls)
        .map_err(|e| IstioCaError::Tls {
            address: address.to_owned(),
            reason: error_chain(&e),
        })?
        .connect_timeout(connect_timeout)
        .timeout(request_timeout)
        // Notice a silently dead connection (a restarted istiod pod
        // behind a stale conntrack entry) before the next renewal.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_timeout(Duration::from_secs(10)))
}

/// `https://host:port` from what the user gave. Plain `http` is refused: the
/// bearer token would cross the network in the clear.
pub(crate) fn normalize_address(address: &str) -> Result<String, IstioCaError> {
    let err = |reason: &str| IstioCaError::Address {
        address: address.to_string(),
        reason: reason.into(),
    };
    let address = address.trim();
    if address.is_empty() {
        return Err(err("empty"));
    }
    let url = if address.contains("://") {
        address.to_string()
    } else {
        format!("https://{address}")
    };
    let uri: http::Uri = url
        .parse()
        .map_err(|e: http::uri::InvalidUri| err(&e.to_string()))?;
    match uri.scheme_str() {
        Some("https") => {}
        Some(other) => {
            return Err(err(&format!(
                "scheme {other:?} is not supported: only https (the token must not travel in the clear)"
            )));
        }
        None => return Err(err("no scheme")),
    }
    if uri.host().is_none_or(str::is_empty) {
        return Err(err("no host"));
    }
    Ok(url)
}

/// An error and its sources on one line ("a: b: c"), because tonic's own
/// messages ("transport error") say little without their causes.
pub(crate) fn error_chain(error: &(dyn std::error::Error + 'static)) -> String {
    let mut out = error.to_string();
    let mut source = error.source();
    while let Some(e) = source {
        let text = e.to_string();
        // Some layers repeat their source's message; skip the echo.
        if !out.ends_with(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        source = e.source();
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses() {
        assert_eq!(
            normalize_address("istiod.istio-system.svc:15012").expect("bare"),
            "https://istiod.istio-system.svc:15012"
        );
        assert_eq!(
            normalize_address("https://127.0.0.1:15012").expect("url"),
            "https://127.0.0.1:15012"
        );
        assert!(normalize_address("http://istiod:15010").is_err());
        assert!(normalize_address("").is_err());
        assert!(normalize_address("https://").is_err());
    }
}

//! Workload identities: one SPIFFE certificate per service account with pods
//! on this node.
//!
//! The node proxy speaks for many workloads at once, so it holds many
//! identities. The [`IdentityManager`] keeps a certificate for every identity
//! that has at least one registered pod, renews it at half-life and forgets
//! it when its last pod leaves. Certificates come from a
//! [`CertificateAuthority`]: the built-in one ([`ca::BuiltinCa`], `--ca
//! builtin`) or Istio's CA over gRPC ([`istio::IstioCa`], `--ca istio`);
//! [`ca_from_args`] picks one.
//!
//! Leaf keys are always ECDSA P-256 and generated here; only a CSR leaves the
//! process, so the same path serves both CAs.

pub mod ca;
pub mod crl;
pub mod istio;
mod manager;

pub use manager::{IdentityConfig, IdentityManager, WorkloadCert};

use std::{future::Future, path::Path, pin::Pin, sync::Arc, time::Duration};

use rustls_pki_types::CertificateDer;

use crate::state::{SpiffeId, TrustDomain};

/// A file's modification time and length, `None` while there is no file:
/// what says a watched file (the revocation lists, the CA's roots) changed.
pub(crate) type FileStamp = Option<(Option<std::time::SystemTime>, u64)>;

/// The [`FileStamp`] of `path` now.
pub(crate) fn file_stamp(path: &Path) -> std::io::Result<FileStamp> {
    match std::fs::metadata(path) {
        Ok(meta) => Ok(Some((meta.modified().ok(), meta.len()))),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Ok(None),
        Err(e) => Err(e),
    }
}

/// What the manager asks a CA for.
#[derive(Clone, Debug)]
pub struct SignRequest {
    /// The identity the certificate is for: its only URI SAN.
    pub identity: SpiffeId,
    /// A PKCS#10 CSR in PEM, signed by the leaf key.
    pub csr_pem: String,
    /// Requested validity (a CA may shorten it).
    pub ttl: Duration,
}

/// A future returned by a [`CertificateAuthority`].
pub type SignFuture<'a> =
    Pin<Box<dyn Future<Output = Result<Vec<CertificateDer<'static>>, IdentityError>> + Send + 'a>>;

/// Something that signs workload certificates.
///
/// A trait (not an enum) so tests can put a failing or slow CA behind the
/// manager, and the agent can choose the CA at start.
pub trait CertificateAuthority: Send + Sync + 'static {
    /// Signs `request`; returns the leaf first, then the intermediates that
    /// lead to a root (roots themselves may be omitted).
    fn sign(&self, request: SignRequest) -> SignFuture<'_>;
    /// The roots peers' chains must reach (the mesh's trust anchors).
    fn roots(&self) -> Vec<CertificateDer<'static>>;
    /// Reads the roots again if their source changed: `Ok(true)` when
    /// [`CertificateAuthority::roots`] has new ones. A CA whose roots never
    /// change keeps the default.
    fn reload_roots(&self) -> Result<bool, IdentityError> {
        Ok(false)
    }
}

/// Errors from issuing, loading or checking certificates.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    #[error("CA directory {dir}: {what}: {source}")]
    CaFiles {
        dir: std::path::PathBuf,
        what: String,
        #[source]
        source: std::io::Error,
    },
    #[error("CA directory {dir}: {what}")]
    CaInvalid {
        dir: std::path::PathBuf,
        what: String,
    },
    #[error("certificate generation for {identity}: {source}")]
    Rcgen {
        identity: String,
        #[source]
        source: rcgen::Error,
    },
    #[error("the CA returned an unusable certificate for {identity}: {reason}")]
    BadIssuedCertificate { identity: SpiffeId, reason: String },
    #[error("identity {0} is not registered (no pod on this node uses it)")]
    NotRegistered(SpiffeId),
    #[error("no certificate for {identity} after {waited:?}: {last_error}")]
    Unavailable {
        identity: SpiffeId,
        waited: Duration,
        last_error: String,
    },
    #[error("the CA refused to sign for {identity}: {reason}")]
    CaRefused { identity: SpiffeId, reason: String },
    #[error("rustls cannot use the key for {identity}: {source}")]
    Key {
        identity: SpiffeId,
        #[source]
        source: rustls::Error,
    },
    #[error(transparent)]
    IstioCa(#[from] istio::IstioCaError),
}

/// Which CA signs workload certificates (`--ca`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum CaKind {
    /// A CA inside the agent, its files in `--ca-dir`.
    #[default]
    Builtin,
    /// Istio's CA (istiod) over gRPC.
    Istio,
}

/// The CA the agent's flags ask for: the built-in one, loaded from (or
/// generated into) `ca_dir` for `trust_domain`, or a client of the Istio CA
/// described by `istio` (only used for [`CaKind::Istio`]).
pub async fn ca_from_args(
    kind: CaKind,
    ca_dir: &Path,
    trust_domain: &TrustDomain,
    istio: istio::IstioCaConfig,
) -> Result<Arc<dyn CertificateAuthority>, IdentityError> {
    Ok(match kind {
        CaKind::Builtin => Arc::new(ca::BuiltinCa::load_or_generate(ca_dir, trust_domain)?),
        CaKind::Istio => Arc::new(istio::IstioCa::connect(istio).await?),
    })
}

//! Keeps one certificate per registered identity, renewed at half-life.

use std::{
    collections::HashMap,
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use rcgen::{CertificateParams, DistinguishedName, KeyPair, SanType};
use rustls::sign::CertifiedKey;
use rustls_pki_types::{CertificateDer, PrivateKeyDer, PrivatePkcs8KeyDer};
use tokio::sync::watch;

use super::{CertificateAuthority, IdentityError, SignRequest};
use crate::state::SpiffeId;

/// The shortest wait between two issuances of one identity.
const MIN_RENEW_INTERVAL: Duration = Duration::from_millis(500);

/// How identities are issued and kept.
#[derive(Clone, Debug)]
pub struct IdentityConfig {
    /// Requested validity of workload certificates (Istio's default: 24 h).
    pub cert_ttl: Duration,
    /// How long one CA call may take before it counts as failed.
    pub sign_timeout: Duration,
    /// How long [`IdentityManager::certificate`] waits for a first
    /// certificate.
    pub wait_timeout: Duration,
    /// Retry backoff after a failed issuance, doubling up to `retry_max`.
    pub retry_min: Duration,
    pub retry_max: Duration,
}

impl Default for IdentityConfig {
    fn default() -> Self {
        Self {
            cert_ttl: Duration::from_secs(24 * 3600),
            sign_timeout: Duration::from_secs(10),
            wait_timeout: Duration::from_secs(15),
            retry_min: Duration::from_millis(500),
            retry_max: Duration::from_secs(30),
        }
    }
}

/// A workload's certificate chain and key, ready for rustls.
pub struct WorkloadCert {
    identity: SpiffeId,
    certified: Arc<CertifiedKey>,
    not_before: SystemTime,
    not_after: SystemTime,
}

impl std::fmt::Debug for WorkloadCert {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("WorkloadCert")
            .field("identity", &self.identity)
            .field("not_before", &self.not_before)
            .field("not_after", &self.not_after)
            .finish_non_exhaustive()
    }
}

impl WorkloadCert {
    /// Wraps a chain (leaf first) and its PKCS#8 key after checking that the
    /// leaf really is `identity`'s and matches the key: a CA answer is not
    /// trusted blindly.
    pub fn new(
        identity: SpiffeId,
        chain: Vec<CertificateDer<'static>>,
        key_pkcs8: Vec<u8>,
    ) -> Result<Self, IdentityError> {
        let bad = |reason: String| IdentityError::BadIssuedCertificate {
            identity: identity.clone(),
            reason,
        };
        let leaf = chain.first().ok_or_else(|| bad("empty chain".into()))?;
        let (_, parsed) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| bad(format!("unparsable leaf: {e}")))?;
        let uris = crate::crypto::uri_sans(&parsed);
        if uris != [identity.as_str()] {
            return Err(bad(format!(
                "URI SANs are {uris:?}, expected exactly [{identity}]"
            )));
        }
        let not_before = asn1_to_system(parsed.validity().not_before);
        let not_after = asn1_to_system(parsed.validity().not_after);
        let key = PrivateKeyDer::Pkcs8(PrivatePkcs8KeyDer::from(key_pkcs8));
        let signing_key = crate::crypto::provider()
            .key_provider
            .load_private_key(key)
            .map_err(|source| IdentityError::Key {
                identity: identity.clone(),
                source,
            })?;
        let certified = CertifiedKey::new(chain, signing_key);
        // rustls compares the leaf's SPKI with the key's.
        certified
            .keys_match()
            .map_err(|e| bad(format!("leaf does not match the key: {e}")))?;
        Ok(Self {
            identity,
            certified: Arc::new(certified),
            not_before,
            not_after,
        })
    }

    pub fn identity(&self) -> &SpiffeId {
        &self.identity
    }

    /// The chain (leaf first) and signing key, as rustls uses them.
    pub fn certified_key(&self) -> Arc<CertifiedKey> {
        self.certified.clone()
    }

    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.certified.cert
    }

    pub fn not_before(&self) -> SystemTime {
        self.not_before
    }

    pub fn not_after(&self) -> SystemTime {
        self.not_after
    }

    /// Half-way through the validity, as Istio renews.
    pub fn renew_at(&self) -> SystemTime {
        let life = self
            .not_after
            .duration_since(self.not_before)
            .unwrap_or_default();
        self.not_before + life / 2
    }

    pub fn is_valid_at(&self, t: SystemTime) -> bool {
        self.not_before <= t && t < self.not_after
    }
}

fn asn1_to_system(t: x509_parser::time::ASN1Time) -> SystemTime {
    let secs = t.timestamp();
    if secs >= 0 {
        SystemTime::UNIX_EPOCH + Duration::from_secs(secs.unsigned_abs())
    } else {
        SystemTime::UNIX_EPOCH - Duration::from_secs(secs.unsigned_abs())
    }
}

#[derive(Clone, Default)]
struct CertState {
    cert: Option<Arc<WorkloadCert>>,
    last_error: Option<String>,
}

struct Entry {
    /// Pods using the identity; the entry goes when this reaches zero.
    refs: usize,
    state: watch::Receiver<CertState>,
    task: tokio::task::JoinHandle<()>,
}

struct Inner {
    ca: Arc<dyn CertificateAuthority>,
    config: IdentityConfig,
    entries: Mutex<HashMap<SpiffeId, Entry>>,
    /// Where the certificates' tasks run: the runtime the manager was made
    /// on (the agent's control runtime), wherever `register` is called
    /// from (the proxy's `add_pod`, on the data path's), so that their
    /// renewal timers and CA calls stay off the data path (`timers.rs`).
    runtime: Option<tokio::runtime::Handle>,
}

impl Drop for Inner {
    fn drop(&mut self) {
        let entries = self.entries.get_mut().unwrap_or_else(|p| p.into_inner());
        for entry in entries.values() {
            entry.task.abort();
        }
    }
}

/// Issues, renews and drops workload certificates. Cheap to clone (shared).
#[derive(Clone)]
pub struct IdentityManager {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for IdentityManager {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IdentityManager")
            .field("identities", &self.identities())
            .finish_non_exhaustive()
    }
}

impl IdentityManager {
    pub fn new(ca: Arc<dyn CertificateAuthority>, config: IdentityConfig) -> Self {
        Self {
            inner: Arc::new(Inner {
                ca,
                config,
                entries: Mutex::new(HashMap::new()),
                runtime: tokio::runtime::Handle::try_current().ok(),
            }),
        }
    }

    fn entries(&self) -> std::sync::MutexGuard<'_, HashMap<SpiffeId, Entry>> {
        // A panic while holding the lock leaves the map consistent (every
        // update is a single insert/remove), so poisoning is ignored.
        self.inner.entries.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Counts one more pod using `identity`; the first starts issuing its
    /// certificate in the background, on the manager's runtime (a manager
    /// made outside any: the caller's, which then must be inside one).
    pub fn register(&self, identity: &SpiffeId) {
        let mut entries = self.entries();
        if let Some(entry) = entries.get_mut(identity) {
            entry.refs += 1;
            return;
        }
        let (tx, rx) = watch::channel(CertState::default());
        let keep = keep_certificate(
            self.inner.ca.clone(),
            self.inner.config.clone(),
            identity.clone(),
            tx,
        );
        let task = crate::shards::spawn_on(self.inner.runtime.as_ref(), keep);
        entries.insert(
            identity.clone(),
            Entry {
                refs: 1,
                state: rx,
                task,
            },
        );
    }

    /// Counts one pod less; when none is left the certificate is dropped and
    /// no longer renewed. Returns whether the identity is still held.
    pub fn unregister(&self, identity: &SpiffeId) -> bool {
        let mut entries = self.entries();
        let Some(entry) = entries.get_mut(identity) else {
            return false;
        };
        entry.refs = entry.refs.saturating_sub(1);
        if entry.refs > 0 {
            return true;
        }
        if let Some(entry) = entries.remove(identity) {
            entry.task.abort();
            tracing::info!(%identity, "identity dropped: its last pod left");
        }
        false
    }

    /// The current certificate of a registered identity, waiting (bounded)
    /// for the first one to be issued.
    pub async fn certificate(
        &self,
        identity: &SpiffeId,
    ) -> Result<Arc<WorkloadCert>, IdentityError> {
        let mut rx = match self.entries().get(identity) {
            Some(entry) => entry.state.clone(),
            None => return Err(IdentityError::NotRegistered(identity.clone())),
        };
        let waited = self.inner.config.wait_timeout;
        // Called on the data path (per connection): its runtime keeps no
        // timers.
        let outcome = crate::timers::timeout(
            waited,
            rx.wait_for(|s| {
                s.cert
                    .as_ref()
                    .is_some_and(|c| c.is_valid_at(SystemTime::now()))
            }),
        )
        .await
        .map(|r| r.map(|state| state.cert.clone()));
        match outcome {
            Ok(Ok(Some(cert))) => Ok(cert),
            // The sender went away: the identity was dropped meanwhile.
            Ok(Ok(None)) | Ok(Err(_)) => Err(IdentityError::NotRegistered(identity.clone())),
            Err(_) => Err(IdentityError::Unavailable {
                identity: identity.clone(),
                waited,
                last_error: rx
                    .borrow()
                    .last_error
                    .clone()
                    .unwrap_or_else(|| "still being issued".into()),
            }),
        }
    }

    /// The current certificate, if one has been issued (never waits).
    pub fn current(&self, identity: &SpiffeId) -> Option<Arc<WorkloadCert>> {
        self.entries()
            .get(identity)
            .and_then(|e| e.state.borrow().cert.clone())
    }

    /// The registered identities, sorted.
    pub fn identities(&self) -> Vec<SpiffeId> {
        let mut ids: Vec<_> = self.entries().keys().cloned().collect();
        ids.sort();
        ids
    }

    /// The trust roots of the mesh (from the CA).
    pub fn roots(&self) -> Vec<CertificateDer<'static>> {
        self.inner.ca.roots()
    }

    /// Has the CA read its roots again if their source changed; `Ok(true)`
    /// when [`IdentityManager::roots`] has new ones.
    pub fn reload_roots(&self) -> Result<bool, IdentityError> {
        self.inner.ca.reload_roots()
    }
}

/// The life of one identity: issue, wait until half-life, renew; on failure
/// retry with backoff while the previous certificate (if any) stays in use.
async fn keep_certificate(
    ca: Arc<dyn CertificateAuthority>,
    config: IdentityConfig,
    identity: SpiffeId,
    tx: watch::Sender<CertState>,
) {
    let mut backoff = config.retry_min;
    loop {
        let result =
            tokio::time::timeout(config.sign_timeout, issue(&*ca, &identity, config.cert_ttl))
                .await
                .unwrap_or_else(|_| {
                    Err(IdentityError::CaRefused {
                        identity: identity.clone(),
                        reason: format!("no answer within {:?}", config.sign_timeout),
                    })
                });
        match result {
            Ok(cert) => {
                // Floored so a CA handing out near-expired certificates
                // cannot make this loop spin.
                let renew_in = cert
                    .renew_at()
                    .duration_since(SystemTime::now())
                    .unwrap_or_default()
                    .max(MIN_RENEW_INTERVAL);
                tracing::info!(%identity, ?renew_in, not_after = ?cert.not_after(), "certificate issued");
                tx.send_modify(|s| {
                    s.cert = Some(Arc::new(cert));
                    s.last_error = None;
                });
                backoff = config.retry_min;
                tokio::time::sleep(renew_in).await;
            }
            Err(e) => {
                tracing::warn!(%identity, error = %e, retry_in = ?backoff, "certificate issuance failed");
                tx.send_modify(|s| s.last_error = Some(e.to_string()));
                tokio::time::sleep(backoff).await;
                backoff = (backoff * 2).min(config.retry_max);
            }
        }
    }
}

/// Generates an ECDSA P-256 key, asks the CA to sign a CSR for it, and
/// checks the answer.
pub(crate) async fn issue(
    ca: &dyn CertificateAuthority,
    identity: &SpiffeId,
    ttl: Duration,
) -> Result<WorkloadCert, IdentityError> {
    let rcgen_err = |source| IdentityError::Rcgen {
        identity: identity.to_string(),
        source,
    };
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(rcgen_err)?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(
        identity.as_str().to_owned().try_into().map_err(rcgen_err)?,
    )];
    let csr_pem = params
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .map_err(rcgen_err)?;
    let chain = ca
        .sign(SignRequest {
            identity: identity.clone(),
            csr_pem,
            ttl,
        })
        .await?;
    WorkloadCert::new(identity.clone(), chain, key.serialize_der())
}

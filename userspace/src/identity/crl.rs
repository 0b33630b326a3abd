//! Certificate revocation lists (ztunnel's `CRL_PATH`, Istio's
//! `istio-ca-crl`): a peer whose certificate, or any certificate of its
//! chain, a list revokes fails the TLS handshake, inbound and outbound.
//!
//! One file of PEM (or DER) CRLs, read at start (a file that cannot be
//! read or parsed stops the agent, named; an empty one revokes nothing)
//! and read again when it changes
//! ([`watch`]): a new list applies to new handshakes; a list that does not
//! parse is logged and the last good one stays. Checked as ztunnel checks
//! them (`tls/revocation.rs`): the whole chain, a certificate no list
//! speaks for passes, an expired list still counts.
//!
//! Limitation: connections already open when a list revokes their peer
//! stay open (ztunnel closes them).

use std::{
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::{Duration, SystemTime},
};

use rustls_pki_types::{CertificateRevocationListDer, pem::PemObject};
use webpki::{CertRevocationList, OwnedCertRevocationList};

/// What is wrong with a revocation list file.
#[derive(Debug, thiserror::Error)]
pub enum CrlError {
    #[error("reading the CRL file {path}: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("CRL file {path}: list {index} does not parse: {reason}")]
    Parse {
        path: PathBuf,
        index: usize,
        reason: String,
    },
}

/// The revocation lists in force, shared by every TLS verifier; replaced
/// whole on reload.
#[derive(Debug, Default)]
pub struct Revocations {
    lists: RwLock<Arc<Vec<CertRevocationList<'static>>>>,
    source: Option<Source>,
}

#[derive(Debug)]
struct Source {
    path: PathBuf,
    seen: RwLock<Stamp>,
}

/// A file's modification time and length: what says it changed.
type Stamp = (Option<SystemTime>, u64);

impl Revocations {
    /// No lists: nothing is revoked.
    pub fn none() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The lists in `path`, read now.
    pub fn load(path: &Path) -> Result<Arc<Self>, CrlError> {
        let (lists, seen) = read(path)?;
        Ok(Arc::new(Self {
            lists: RwLock::new(Arc::new(lists)),
            source: Some(Source {
                path: path.to_owned(),
                seen: RwLock::new(seen),
            }),
        }))
    }

    /// The lists in force now.
    pub fn current(&self) -> Arc<Vec<CertRevocationList<'static>>> {
        self.lists.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Reads the file again if it changed since the last read: `Ok(true)`
    /// when new lists are in force; on an error the last good ones stay.
    pub fn reload_if_changed(&self) -> Result<bool, CrlError> {
        let Some(source) = &self.source else {
            return Ok(false);
        };
        let now = stamp(&source.path)?;
        if *source.seen.read().unwrap_or_else(|p| p.into_inner()) == now {
            return Ok(false);
        }
        // Seen even when it does not parse: the same bad file is reported
        // once, not at every look.
        *source.seen.write().unwrap_or_else(|p| p.into_inner()) = now;
        let (lists, _) = read(&source.path)?;
        *self.lists.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(lists);
        Ok(true)
    }

    /// The file the lists come from, if any.
    pub fn path(&self) -> Option<&Path> {
        self.source.as_ref().map(|s| s.path.as_path())
    }
}

/// Looks at the file every `every` and applies a change, until the task
/// is dropped (it runs for the agent's life).
pub async fn watch(revocations: Arc<Revocations>, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        match revocations.reload_if_changed() {
            Ok(true) => tracing::info!(
                path = ?revocations.path(),
                lists = revocations.current().len(),
                "certificate revocation lists reloaded: new handshakes check them"
            ),
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "certificate revocation lists not reloaded; the last good ones stay in force")
            }
        }
    }
}

fn stamp(path: &Path) -> Result<Stamp, CrlError> {
    let meta = std::fs::metadata(path).map_err(|source| CrlError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok((meta.modified().ok(), meta.len()))
}

fn read(path: &Path) -> Result<(Vec<CertRevocationList<'static>>, Stamp), CrlError> {
    let seen = stamp(path)?;
    let bytes = std::fs::read(path).map_err(|source| CrlError::Read {
        path: path.to_owned(),
        source,
    })?;
    Ok((parse(path, &bytes)?, seen))
}

/// Every CRL in `bytes`: PEM blocks (`X509 CRL`), or one DER list.
fn parse(path: &Path, bytes: &[u8]) -> Result<Vec<CertRevocationList<'static>>, CrlError> {
    let bad = |index: usize, reason: String| CrlError::Parse {
        path: path.to_owned(),
        index,
        reason,
    };
    let ders: Vec<CertificateRevocationListDer<'static>> =
        if bytes.starts_with(b"-----") || bytes.iter().take(64).all(|b| b.is_ascii()) {
            CertificateRevocationListDer::pem_slice_iter(bytes)
                .enumerate()
                .map(|(i, der)| der.map_err(|e| bad(i, e.to_string())))
                .collect::<Result<_, _>>()?
        } else {
            vec![CertificateRevocationListDer::from(bytes.to_vec())]
        };
    // An empty file (a mounted ConfigMap key with no list yet) revokes
    // nothing.
    ders.iter()
        .enumerate()
        .map(|(i, der)| {
            OwnedCertRevocationList::from_der(der.as_ref())
                .map(CertRevocationList::from)
                .map_err(|e| bad(i, e.to_string()))
        })
        .collect()
}

#[cfg(test)]
#[path = "crl_tests.rs"]
mod tests;

//! Certificate revocation lists (ztunnel's `CRL_PATH`, Istio's
//! `istio-ca-crl`): a peer whose certificate, or any certificate of its
//! chain, a list revokes fails the TLS handshake, inbound and outbound,
//! and an open HBONE connection to or from it is closed when a reloaded
//! list revokes it (`tls::RevocationWatch`).
//!
//! One file of PEM (or DER) CRLs, read at start and read again when it
//! changes ([`watch`]). A file that is missing at start revokes nothing
//! until it appears (as ztunnel: the ConfigMap that holds it may be
//! mounted later); one that cannot be read or parsed at start is an error,
//! named, and revokes nothing until a good one is written
//! ([`Revocations::load_or_wait`]; ztunnel then runs without lists for
//! good; stopping the agent would stop the node's mesh traffic); an empty
//! one revokes nothing. A new list applies to new handshakes and open connections; a
//! list that does not parse, or a file that went away, is logged and the
//! last good lists stay. Checked as ztunnel checks them
//! (`tls/revocation.rs`): the whole chain, a certificate no list speaks
//! for passes, an expired list still counts.

use std::{
    io::ErrorKind,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use rustls_pki_types::{CertificateRevocationListDer, pem::PemObject};
use tokio::sync::watch;
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
    #[error("the CRL file {path} is gone")]
    Gone { path: PathBuf },
}

/// The revocation lists in force, shared by every TLS verifier; replaced
/// whole on reload.
#[derive(Debug)]
pub struct Revocations {
    lists: RwLock<Arc<Vec<CertRevocationList<'static>>>>,
    source: Option<Source>,
    /// Bumped on every reload that put new lists in force: open
    /// connections check their peer again ([`Revocations::subscribe`]).
    generation: watch::Sender<u64>,
}

impl Default for Revocations {
    fn default() -> Self {
        Self {
            lists: Default::default(),
            source: None,
            generation: watch::Sender::new(0),
        }
    }
}

#[derive(Debug)]
struct Source {
    path: PathBuf,
    seen: RwLock<Stamp>,
}

use super::FileStamp as Stamp;

impl Revocations {
    /// No lists: nothing is revoked.
    pub fn none() -> Arc<Self> {
        Arc::new(Self::default())
    }

    /// The lists in `path`, read now; none yet if there is no such file
    /// (see [`Revocations::waiting`]).
    pub fn load(path: &Path) -> Result<Arc<Self>, CrlError> {
        let (lists, seen) = match read(path) {
            Ok(read) => read,
            Err(CrlError::Read { source, .. }) if source.kind() == ErrorKind::NotFound => {
                (Vec::new(), None)
            }
            Err(e) => return Err(e),
        };
        Ok(Arc::new(Self {
            lists: RwLock::new(Arc::new(lists)),
            source: Some(Source {
                path: path.to_owned(),
                seen: RwLock::new(seen),
            }),
            generation: watch::Sender::new(0),
        }))
    }

    /// [`Revocations::load`], but a file that cannot be read or parsed
    /// revokes nothing for now, its error returned for the caller to
    /// report: the next change of the file is read as any reload.
    pub fn load_or_wait(path: &Path) -> (Arc<Self>, Option<CrlError>) {
        match Self::load(path) {
            Ok(loaded) => (loaded, None),
            Err(e) => (
                Arc::new(Self {
                    lists: RwLock::new(Arc::new(Vec::new())),
                    source: Some(Source {
                        path: path.to_owned(),
                        // Seen as it is: reported now, not at every look.
                        seen: RwLock::new(stamp(path).ok().flatten()),
                    }),
                    generation: watch::Sender::new(0),
                }),
                Some(e),
            ),
        }
    }

    /// Whether a file is named but has not been there yet (nothing is
    /// revoked until it appears).
    pub fn waiting(&self) -> bool {
        self.source
            .as_ref()
            .is_some_and(|s| s.seen.read().unwrap_or_else(|p| p.into_inner()).is_none())
            && self.current().is_empty()
    }

    /// The lists in force now.
    pub fn current(&self) -> Arc<Vec<CertRevocationList<'static>>> {
        self.lists.read().unwrap_or_else(|p| p.into_inner()).clone()
    }

    /// Told of every reload from now on; `None` without a file (nothing
    /// will ever be revoked).
    pub fn subscribe(&self) -> Option<watch::Receiver<u64>> {
        self.source.as_ref().map(|_| self.generation.subscribe())
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
        if now.is_none() {
            return Err(CrlError::Gone {
                path: source.path.clone(),
            });
        }
        let (lists, _) = read(&source.path)?;
        *self.lists.write().unwrap_or_else(|p| p.into_inner()) = Arc::new(lists);
        self.generation.send_modify(|g| *g += 1);
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
                "certificate revocation lists reloaded: new handshakes and open connections check them"
            ),
            Ok(false) => {}
            Err(e) => {
                tracing::error!(error = %e, "certificate revocation lists not reloaded; the last good ones stay in force")
            }
        }
    }
}

/// `None` when there is no file.
fn stamp(path: &Path) -> Result<Stamp, CrlError> {
    super::file_stamp(path).map_err(|source| CrlError::Read {
        path: path.to_owned(),
        source,
    })
}

fn read(path: &Path) -> Result<(Vec<CertRevocationList<'static>>, Stamp), CrlError> {
    // Before the read: a change between the two is read again at the next
    // look rather than missed.
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

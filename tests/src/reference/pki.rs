//! The mesh's one root for a comparison: the in-test istiod's serving
//! certificate, the certificates its CA issues to ztunnel, the agent's
//! `--ca-dir`, and the probes' client certificates all chain to it, so
//! either peer accepts the same probes.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use rcgen::{CertificateParams, CertificateSigningRequestParams, ExtendedKeyUsagePurpose, SanType};
use shunt::{
    identity::{
        CertificateAuthority as _,
        ca::{BuiltinCa, CaFiles},
    },
    state::{SpiffeId, TrustDomain},
};
use tonic::transport::Identity;

use crate::{
    Result, TestbedError,
    hbone::{Credentials, MeshCa},
};

/// The bearer token both peers present to istiod (and its CA).
pub const TOKEN: &str = "reference-peer-token";

/// A root CA and the files the peers read (root certificate, token).
#[derive(Clone)]
pub struct Pki {
    ca: Arc<BuiltinCa>,
    files: CaFiles,
    dir: Arc<tempfile::TempDir>,
}

fn invalid(what: &str, e: impl std::fmt::Display) -> TestbedError {
    TestbedError::Invalid(format!("reference PKI: {what}: {e}"))
}

impl Pki {
    pub fn new() -> Result<Pki> {
        let (ca, files) =
            BuiltinCa::generate(&TrustDomain::default()).map_err(|e| invalid("root", e))?;
        let dir = tempfile::tempdir().map_err(|e| TestbedError::io("a temp dir", e))?;
        let write = |name: &str, text: &str| {
            std::fs::write(dir.path().join(name), text)
                .map_err(|e| TestbedError::io(format!("writing {name}"), e))
        };
        write("root-cert.pem", &files.root_cert_pem)?;
        // No trailing newline: ztunnel sends the file as it is in a header.
        write("token", TOKEN)?;
        files
            .write_to(&dir.path().join("ca"))
            .map_err(|e| invalid("CA files", e))?;
        Ok(Pki {
            ca: Arc::new(ca),
            files,
            dir: Arc::new(dir),
        })
    }

    pub fn root_file(&self) -> PathBuf {
        self.dir.path().join("root-cert.pem")
    }

    pub fn token_file(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    /// Writes the CA into `dir`, an agent's `--ca-dir`, before it starts
    /// (the agent then issues from this root instead of making its own).
    pub fn install_ca(&self, dir: &Path) -> Result<()> {
        self.files
            .write_to(dir)
            .map_err(|e| invalid("installing the CA", e))
    }

    /// A probe's certificate for `namespace`/`service_account`.
    pub fn credentials(&self, namespace: &str, service_account: &str) -> Result<Credentials> {
        MeshCa::from_dir(&self.dir.path().join("ca"))?.credentials(&SpiffeId::for_service_account(
            &TrustDomain::default(),
            namespace,
            service_account,
        ))
    }

    /// istiod's serving certificate: IP SAN 127.0.0.1.
    pub fn serving_identity(&self) -> Result<Identity> {
        let key = rcgen::KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256)
            .map_err(|e| invalid("key", e))?;
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_string()]).map_err(|e| invalid("SAN", e))?;
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let der = self
            .ca
            .sign_params(&params, &key)
            .map_err(|e| invalid("serving certificate", e))?;
        let pem = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
        Ok(Identity::from_pem(pem, key.serialize_pem()))
    }

    /// Signs a CSR for the SPIFFE id in its URI SAN (trust domain
    /// `cluster.local` only): PEMs, leaf first, root last.
    pub fn sign_csr(
        &self,
        csr_pem: &str,
        validity_seconds: i64,
    ) -> std::result::Result<Vec<String>, String> {
        let csr =
            CertificateSigningRequestParams::from_pem(csr_pem).map_err(|e| format!("CSR: {e}"))?;
        let uri = csr
            .params
            .subject_alt_names
            .iter()
            .find_map(|san| match san {
                SanType::URI(uri) => Some(uri.as_str().to_string()),
                _ => None,
            })
            .ok_or("CSR has no URI SAN")?;
        let identity = parse_spiffe(&uri).ok_or_else(|| format!("{uri:?} is not a SPIFFE id"))?;
        let ttl = Duration::from_secs(validity_seconds.clamp(60, 86_400).unsigned_abs());
        let leaf = self
            .ca
            .issue(&identity, &csr.public_key, ttl)
            .map_err(|e| e.to_string())?;
        let mut chain = vec![leaf];
        chain.extend(self.ca.chain().iter().cloned());
        for root in self.ca.roots() {
            if !chain.contains(&root) {
                chain.push(root);
            }
        }
        Ok(chain
            .iter()
            .map(|der| pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec())))
            .collect())
    }
}

/// `spiffe://cluster.local/ns/<ns>/sa/<sa>`.
fn parse_spiffe(uri: &str) -> Option<SpiffeId> {
    let rest = uri.strip_prefix("spiffe://cluster.local/ns/")?;
    let (namespace, service_account) = rest.split_once("/sa/")?;
    Some(SpiffeId::for_service_account(
        &TrustDomain::default(),
        namespace,
        service_account,
    ))
}

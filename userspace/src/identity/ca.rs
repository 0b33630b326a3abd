//! The built-in CA (`--ca builtin`): signs workload certificates inside the
//! agent.
//!
//! It uses Istio's plug-in CA file layout in `--ca-dir`, so shunt can join an
//! existing mesh's trust root by being handed the same files istiod uses:
//!
//! | file | content |
//! |---|---|
//! | `ca-cert.pem` | the certificate that signs workload certificates |
//! | `ca-key.pem` | its key: RSA or ECDSA, PKCS#8, PKCS#1 or SEC1 |
//! | `root-cert.pem` | the root(s) peers trust |
//! | `cert-chain.pem` | the chain from `ca-cert` up to the root (optional) |
//!
//! When the directory holds none of them, a root is generated (ECDSA P-256:
//! *ring* cannot generate RSA keys) and persisted there, so an agent restart
//! keeps the mesh's trust root.

use std::{
    fs,
    io::Write,
    path::{Path, PathBuf},
    time::{Duration, SystemTime},
};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    Issuer, KeyPair, KeyUsagePurpose, PublicKeyData, SanType, SerialNumber,
};
use ring::rand::SecureRandom;
use rustls_pki_types::CertificateDer;

use super::{CertificateAuthority, IdentityError, SignFuture, SignRequest};
use crate::state::{SpiffeId, TrustDomain};

pub const CA_CERT_FILE: &str = "ca-cert.pem";
pub const CA_KEY_FILE: &str = "ca-key.pem";
pub const ROOT_CERT_FILE: &str = "root-cert.pem";
pub const CERT_CHAIN_FILE: &str = "cert-chain.pem";

/// Validity of a generated root (Istio's self-signed root: 10 years).
const ROOT_VALIDITY: Duration = Duration::from_secs(10 * 365 * 24 * 3600);
/// Leaves start this much in the past so a peer whose clock runs slightly
/// behind does not reject a fresh certificate as not yet valid.
const BACKDATE: Duration = Duration::from_secs(60);
/// The longest leaf the built-in CA issues, whatever is asked (Istio's
/// default maximum workload certificate TTL is 90 days).
pub const MAX_LEAF_TTL: Duration = Duration::from_secs(90 * 24 * 3600);

/// A CA holding its signing key in memory.
pub struct BuiltinCa {
    issuer: Issuer<'static, KeyPair>,
    /// Sent after each leaf: the signing certificate and any intermediates,
    /// never the roots (peers have those).
    chain: Vec<CertificateDer<'static>>,
    roots: Vec<CertificateDer<'static>>,
}

impl std::fmt::Debug for BuiltinCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("BuiltinCa")
            .field("chain", &self.chain.len())
            .field("roots", &self.roots.len())
            .finish_non_exhaustive()
    }
}

impl BuiltinCa {
    /// Loads the plug-in CA files from `dir`; if there are none, generates a
    /// root for `trust_domain` and writes it there (creating `dir`).
    pub fn load_or_generate(dir: &Path, trust_domain: &TrustDomain) -> Result<Self, IdentityError> {
        if let Some(ca) = Self::load(dir)? {
            tracing::info!(dir = %dir.display(), "loaded plug-in CA");
            return Ok(ca);
        }
        let (ca, files) = Self::generate(trust_domain)?;
        files.write_to(dir)?;
        tracing::info!(dir = %dir.display(), %trust_domain, "generated and persisted a new root CA");
        Ok(ca)
    }

    /// Loads the plug-in CA files from `dir`. `Ok(None)` when neither
    /// `ca-cert.pem` nor `ca-key.pem` exists; an error when only some of the
    /// files exist or one is unusable (never silently replaced: that would
    /// split the mesh's trust).
    pub fn load(dir: &Path) -> Result<Option<Self>, IdentityError> {
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let (has_cert, has_key) = (cert_path.exists(), key_path.exists());
        if !has_cert && !has_key {
            return Ok(None);
        }
        let invalid = |what: String| IdentityError::CaInvalid {
            dir: dir.to_path_buf(),
            what,
        };
        if !has_cert || !has_key {
            let missing = if has_cert { CA_KEY_FILE } else { CA_CERT_FILE };
            return Err(invalid(format!(
                "{missing} is missing (both {CA_CERT_FILE} and {CA_KEY_FILE} are needed)"
            )));
        }
        let read = |name: &str| -> Result<String, IdentityError> {
            fs::read_to_string(dir.join(name)).map_err(|source| IdentityError::CaFiles {
                dir: dir.to_path_buf(),
                what: format!("reading {name}"),
                source,
            })
        };
        let ca_cert_pem = read(CA_CERT_FILE)?;
        let ca_certs =
            parse_certs(&ca_cert_pem).map_err(|e| invalid(format!("{CA_CERT_FILE}: {e}")))?;
        let Some(ca_cert) = ca_certs.into_iter().next() else {
            return Err(invalid(format!("{CA_CERT_FILE} holds no certificate")));
        };
        let key =
            parse_key(&read(CA_KEY_FILE)?).map_err(|e| invalid(format!("{CA_KEY_FILE}: {e}")))?;
        check_key_matches_cert(&key, &ca_cert)
            .map_err(|e| invalid(format!("{CA_KEY_FILE} and {CA_CERT_FILE}: {e}")))?;

        // Without root-cert.pem the signing certificate is its own root (a
        // self-signed CA dir with only the first two files).
        let roots = if dir.join(ROOT_CERT_FILE).exists() {
            parse_certs(&read(ROOT_CERT_FILE)?)
                .map_err(|e| invalid(format!("{ROOT_CERT_FILE}: {e}")))?
        } else {
            vec![ca_cert.clone()]
        };
        if roots.is_empty() {
            return Err(invalid(format!("{ROOT_CERT_FILE} holds no certificate")));
        }
        let mut chain = if dir.join(CERT_CHAIN_FILE).exists() {
            parse_certs(&read(CERT_CHAIN_FILE)?)
                .map_err(|e| invalid(format!("{CERT_CHAIN_FILE}: {e}")))?
        } else {
            Vec::new()
        };
        if chain.first() != Some(&ca_cert) {
            chain.insert(0, ca_cert.clone());
        }
        chain.retain(|c| !roots.contains(c));

        let issuer = Issuer::from_ca_cert_der(&ca_cert, key)
            .map_err(|e| invalid(format!("{CA_CERT_FILE} cannot be used as an issuer: {e}")))?;
        let ca = Self {
            issuer,
            chain,
            roots,
        };
        // Prove the whole setup works (the key signs, the chain reaches a
        // root) now rather than at the first workload's handshake.
        ca.self_test()
            .map_err(|e| invalid(format!("test certificate does not verify: {e}")))?;
        Ok(Some(ca))
    }

    /// A new self-signed ECDSA P-256 root for `trust_domain`, and the files
    /// that persist it.
    pub fn generate(trust_domain: &TrustDomain) -> Result<(Self, CaFiles), IdentityError> {
        let rcgen_err = |source| IdentityError::Rcgen {
            identity: format!("root CA of {trust_domain}"),
            source,
        };
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(rcgen_err)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        // Istio's self-signed root carries the trust domain as organization.
        dn.push(DnType::OrganizationName, trust_domain.as_str());
        dn.push(DnType::CommonName, "shunt root CA");
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let now = SystemTime::now();
        params.not_before = (now - BACKDATE).into();
        params.not_after = (now + ROOT_VALIDITY).into();
        params.serial_number = Some(random_serial());
        let cert = params.self_signed(&key).map_err(rcgen_err)?;
        let files = CaFiles {
            ca_cert_pem: cert.pem(),
            ca_key_pem: key.serialize_pem(),
            root_cert_pem: cert.pem(),
            cert_chain_pem: String::new(),
        };
        let root = cert.der().clone();
        Ok((
            Self {
                issuer: Issuer::new(params, key),
                chain: Vec::new(),
                roots: vec![root],
            },
            files,
        ))
    }

    /// Signs a workload certificate for `identity` over `public_key`, valid
    /// from now (backdated a minute) for `ttl`.
    pub fn issue(
        &self,
        identity: &SpiffeId,
        public_key: &impl PublicKeyData,
        ttl: Duration,
    ) -> Result<CertificateDer<'static>, IdentityError> {
        let now = SystemTime::now();
        let ttl = ttl.min(MAX_LEAF_TTL);
        // Backdating a short-lived certificate by a whole minute would put
        // its half-life in the past; a quarter of its life at most.
        let backdate = BACKDATE.min(ttl / 4);
        let params = leaf_params(identity, now - backdate, now + ttl)?;
        self.sign_params(&params, public_key)
            .map_err(|source| IdentityError::Rcgen {
                identity: identity.to_string(),
                source,
            })
    }

    /// Signs arbitrary parameters. For tests that need certificates a
    /// correct CA would never issue (expired, no SPIFFE SAN, ...).
    pub fn sign_params(
        &self,
        params: &CertificateParams,
        public_key: &impl PublicKeyData,
    ) -> Result<CertificateDer<'static>, rcgen::Error> {
        Ok(params.signed_by(public_key, &self.issuer)?.der().clone())
    }

    /// The certificates to send after a leaf (signing CA and intermediates).
    pub fn chain(&self) -> &[CertificateDer<'static>] {
        &self.chain
    }

    fn self_test(&self) -> Result<(), String> {
        let key =
            KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).map_err(|e| e.to_string())?;
        let id =
            SpiffeId::for_service_account(&TrustDomain::default(), "shunt-system", "self-test");
        let leaf = self
            .issue(&id, &key, Duration::from_secs(300))
            .map_err(|e| e.to_string())?;
        let anchors = self
            .roots
            .iter()
            .map(|r| webpki::anchor_from_trusted_cert(r).map(|a| a.to_owned()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| format!("root: {e}"))?;
        let ee = webpki::EndEntityCert::try_from(&leaf).map_err(|e| e.to_string())?;
        let now = rustls_pki_types::UnixTime::now();
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &self.chain,
            now,
            webpki::KeyUsage::client_auth(),
            None,
            None,
        )
        .map(|_| ())
        .map_err(|e| e.to_string())
    }
}

impl CertificateAuthority for BuiltinCa {
    fn sign(&self, request: SignRequest) -> SignFuture<'_> {
        Box::pin(async move {
            let csr = rcgen::CertificateSigningRequestParams::from_pem(&request.csr_pem).map_err(
                |source| IdentityError::Rcgen {
                    identity: request.identity.to_string(),
                    source,
                },
            )?;
            // The CSR's own names are ignored: the certificate says exactly
            // the identity the manager (which knows the pod) asked for.
            let leaf = self.issue(&request.identity, &csr.public_key, request.ttl)?;
            let mut out = Vec::with_capacity(1 + self.chain.len());
            out.push(leaf);
            out.extend(self.chain.iter().cloned());
            Ok(out)
        })
    }

    fn roots(&self) -> Vec<CertificateDer<'static>> {
        self.roots.clone()
    }
}

/// The parameters of a workload certificate: the URI SAN is exactly the
/// SPIFFE id, EKU serverAuth+clientAuth, an empty subject (different from
/// any CA's, as peers require), not a CA.
pub fn leaf_params(
    identity: &SpiffeId,
    not_before: SystemTime,
    not_after: SystemTime,
) -> Result<CertificateParams, IdentityError> {
    let uri = identity
        .as_str()
        .to_owned()
        .try_into()
        .map_err(|source| IdentityError::Rcgen {
            identity: identity.to_string(),
            source,
        })?;
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(uri)];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    params.not_before = not_before.into();
    params.not_after = not_after.into();
    params.serial_number = Some(random_serial());
    params.use_authority_key_identifier_extension = true;
    Ok(params)
}

/// A random positive 128-bit serial (RFC 5280 wants unique serials; a random
/// one needs no state across restarts).
pub fn random_serial() -> SerialNumber {
    let mut bytes = [0u8; 16];
    // SystemRandom only fails if the OS RNG is unavailable; a fixed-but-
    // unique-enough fallback beats refusing to issue.
    if ring::rand::SystemRandom::new().fill(&mut bytes).is_err() {
        let nanos = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .unwrap_or_default()
            .as_nanos();
        bytes = nanos.to_be_bytes();
    }
    bytes[0] &= 0x7f;
    bytes[0] |= 0x01;
    SerialNumber::from_slice(&bytes)
}

/// The PEM files of a CA, as written to `--ca-dir`.
#[derive(Clone, Debug)]
pub struct CaFiles {
    pub ca_cert_pem: String,
    pub ca_key_pem: String,
    pub root_cert_pem: String,
    pub cert_chain_pem: String,
}

impl CaFiles {
    /// Writes the files into `dir` (mode 0700), the key with mode 0600. Each
    /// file is written to a temporary name and renamed, so a crash never
    /// leaves a half-written CA behind.
    pub fn write_to(&self, dir: &Path) -> Result<(), IdentityError> {
        use std::os::unix::fs::{DirBuilderExt, OpenOptionsExt};
        let io_err = |what: String| {
            let dir = dir.to_path_buf();
            move |source| IdentityError::CaFiles { dir, what, source }
        };
        fs::DirBuilder::new()
            .recursive(true)
            .mode(0o700)
            .create(dir)
            .map_err(io_err("creating the directory".into()))?;
        // The key last: its presence is what marks the directory as a CA.
        for (name, content, mode) in [
            (ROOT_CERT_FILE, &self.root_cert_pem, 0o644),
            (CERT_CHAIN_FILE, &self.cert_chain_pem, 0o644),
            (CA_CERT_FILE, &self.ca_cert_pem, 0o644),
            (CA_KEY_FILE, &self.ca_key_pem, 0o600),
        ] {
            let tmp: PathBuf = dir.join(format!(".{name}.tmp"));
            let mut file = fs::OpenOptions::new()
                .write(true)
                .create(true)
                .truncate(true)
                .mode(mode)
                .open(&tmp)
                .map_err(io_err(format!("creating {}", tmp.display())))?;
            file.write_all(content.as_bytes())
                .and_then(|()| file.sync_all())
                .map_err(io_err(format!("writing {}", tmp.display())))?;
            fs::rename(&tmp, dir.join(name)).map_err(io_err(format!("renaming {name}")))?;
        }
        Ok(())
    }
}

/// Every `CERTIFICATE` block of a PEM file, in order.
pub fn parse_certs(pem_text: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let blocks = pem::parse_many(pem_text).map_err(|e| e.to_string())?;
    Ok(blocks
        .into_iter()
        .filter(|b| b.tag() == "CERTIFICATE")
        .map(|b| CertificateDer::from(b.into_contents()))
        .collect())
}

/// A CA key from PEM: PKCS#8 (`PRIVATE KEY`), PKCS#1 (`RSA PRIVATE KEY`, what
/// `openssl genrsa` and Istio's tooling write) or SEC1 (`EC PRIVATE KEY`).
/// *ring* only reads PKCS#8, so the other two are wrapped first.
pub fn parse_key(pem_text: &str) -> Result<KeyPair, String> {
    let blocks = pem::parse_many(pem_text).map_err(|e| e.to_string())?;
    let block = blocks
        .iter()
        .find(|b| b.tag().ends_with("PRIVATE KEY"))
        .ok_or_else(|| "no PRIVATE KEY block".to_string())?;
    let err = |e: rcgen::Error| format!("{} block: {e}", block.tag());
    match block.tag() {
        "PRIVATE KEY" => KeyPair::try_from(block.contents()).map_err(err),
        "RSA PRIVATE KEY" => {
            let pkcs8 = pkcs8_wrap(&der_seq(&[RSA_ENCRYPTION_OID, DER_NULL]), block.contents());
            KeyPair::try_from(pkcs8.as_slice()).map_err(err)
        }
        "EC PRIVATE KEY" => {
            // The curve is not known without parsing SEC1's parameters; try
            // the two *ring* can sign with.
            let mut last = None;
            for curve in [P256_OID, P384_OID] {
                let alg = der_seq(&[EC_PUBLIC_KEY_OID, curve]);
                match KeyPair::try_from(pkcs8_wrap(&alg, block.contents()).as_slice()) {
                    Ok(key) => return Ok(key),
                    Err(e) => last = Some(e),
                }
            }
            Err(last.map(err).unwrap_or_default())
        }
        other => Err(format!("unsupported key type {other:?}")),
    }
}

fn check_key_matches_cert(key: &KeyPair, cert: &CertificateDer<'_>) -> Result<(), String> {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).map_err(|e| e.to_string())?;
    if parsed.public_key().subject_public_key.data.as_ref() != key.der_bytes() {
        return Err("the key is not the certificate's".into());
    }
    if !parsed.is_ca() {
        return Err("the certificate is not a CA (basicConstraints cA is false)".into());
    }
    Ok(())
}

const RSA_ENCRYPTION_OID: &[u8] = &[
    0x06, 0x09, 0x2a, 0x86, 0x48, 0x86, 0xf7, 0x0d, 0x01, 0x01, 0x01,
];
const DER_NULL: &[u8] = &[0x05, 0x00];
const EC_PUBLIC_KEY_OID: &[u8] = &[0x06, 0x07, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x02, 0x01];
const P256_OID: &[u8] = &[0x06, 0x08, 0x2a, 0x86, 0x48, 0xce, 0x3d, 0x03, 0x01, 0x07];
const P384_OID: &[u8] = &[0x06, 0x05, 0x2b, 0x81, 0x04, 0x00, 0x22];

/// `PrivateKeyInfo ::= SEQUENCE { version 0, algorithm, OCTET STRING key }`.
fn pkcs8_wrap(algorithm: &[u8], key: &[u8]) -> Vec<u8> {
    der_seq(&[&[0x02, 0x01, 0x00], algorithm, &der_tlv(0x04, key)])
}

fn der_seq(parts: &[&[u8]]) -> Vec<u8> {
    der_tlv(0x30, &parts.concat())
}

fn der_tlv(tag: u8, content: &[u8]) -> Vec<u8> {
    let mut out = vec![tag];
    let len = content.len();
    if len < 0x80 {
        out.push(len as u8);
    } else {
        let bytes = len.to_be_bytes();
        let skip = bytes.iter().take_while(|b| **b == 0).count();
        out.push(0x80 | (bytes.len() - skip) as u8);
        out.extend_from_slice(&bytes[skip..]);
    }
    out.extend_from_slice(content);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn der_lengths() {
        assert_eq!(der_tlv(0x04, &[1, 2]), vec![0x04, 2, 1, 2]);
        let long = vec![0u8; 300];
        let tlv = der_tlv(0x04, &long);
        assert_eq!(&tlv[..4], &[0x04, 0x82, 0x01, 0x2c]);
        assert_eq!(tlv.len(), 304);
    }

    #[test]
    fn generated_ca_issues_verifiable_leaves() {
        let (ca, files) = BuiltinCa::generate(&TrustDomain::default()).expect("generate");
        assert!(files.ca_key_pem.contains("PRIVATE KEY"));
        ca.self_test().expect("self test");
    }
}

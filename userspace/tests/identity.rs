//! The built-in CA and the identity manager: loading Istio plug-in CA files
//! (RSA and ECDSA, PKCS#1/SEC1/PKCS#8 keys), generating and persisting a
//! root, issuing SPIFFE leaves that verify, renewal at half-life, dropping
//! unused identities.

use std::{path::Path, process::Command, sync::Arc, time::Duration};

use rustls_pki_types::{CertificateDer, UnixTime};
use shunt::{
    identity::{
        CertificateAuthority, IdentityConfig, IdentityManager,
        ca::{BuiltinCa, CA_CERT_FILE, CA_KEY_FILE, CERT_CHAIN_FILE, ROOT_CERT_FILE, parse_certs},
    },
    state::{SpiffeId, TrustDomain},
};

fn id(ns: &str, sa: &str) -> SpiffeId {
    SpiffeId::for_service_account(&TrustDomain::default(), ns, sa)
}

fn openssl(dir: &Path, args: &[&str]) {
    let out = Command::new("openssl")
        .args(args)
        .current_dir(dir)
        .output()
        .expect("run openssl (needed to make RSA test CAs)");
    assert!(
        out.status.success(),
        "openssl {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Checks what peers (ztunnel) require of a leaf, and that it verifies up
/// to one of `roots` for both client and server use.
fn check_leaf(
    chain: &[CertificateDer<'static>],
    roots: &[CertificateDer<'static>],
    identity: &SpiffeId,
) {
    let leaf = &chain[0];
    let (_, parsed) = x509_parser::parse_x509_certificate(leaf).expect("leaf parses");
    assert_eq!(
        shunt::tls::uri_sans(&parsed),
        [identity.as_str()],
        "URI SAN is exactly the id"
    );
    let eku = parsed
        .extended_key_usage()
        .expect("eku parses")
        .expect("eku present")
        .value;
    assert!(
        eku.server_auth && eku.client_auth,
        "EKU serverAuth+clientAuth"
    );
    assert!(!parsed.is_ca());
    // ECDSA P-256 leaf key.
    assert_eq!(
        parsed.public_key().algorithm.algorithm.to_id_string(),
        "1.2.840.10045.2.1"
    );
    for root in roots {
        let (_, r) = x509_parser::parse_x509_certificate(root).expect("root parses");
        assert_ne!(
            parsed.subject().as_raw(),
            r.subject().as_raw(),
            "leaf subject differs from root's"
        );
    }
    let anchors: Vec<_> = roots
        .iter()
        .map(|r| {
            webpki::anchor_from_trusted_cert(r)
                .expect("anchor")
                .to_owned()
        })
        .collect();
    let ee = webpki::EndEntityCert::try_from(leaf).expect("ee");
    for usage in [
        webpki::KeyUsage::server_auth(),
        webpki::KeyUsage::client_auth(),
    ] {
        ee.verify_for_usage(
            webpki::ALL_VERIFICATION_ALGS,
            &anchors,
            &chain[1..],
            UnixTime::now(),
            usage,
            None,
            None,
        )
        .expect("leaf chains to the root");
    }
}

async fn issue_via_manager(
    ca: Arc<dyn CertificateAuthority>,
    identity: &SpiffeId,
) -> Vec<CertificateDer<'static>> {
    let manager = IdentityManager::new(ca, IdentityConfig::default());
    manager.register(identity);
    let cert = manager
        .certificate(identity)
        .await
        .expect("certificate issued");
    cert.chain().to_vec()
}

#[tokio::test]
async fn generates_persists_and_reloads_a_root() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca_dir = dir.path().join("ca");
    let td = TrustDomain::default();
    let ca = BuiltinCa::load_or_generate(&ca_dir, &td).expect("generate");
    for f in [CA_CERT_FILE, CA_KEY_FILE, ROOT_CERT_FILE, CERT_CHAIN_FILE] {
        assert!(ca_dir.join(f).exists(), "{f} written");
    }
    use std::os::unix::fs::PermissionsExt;
    let mode = std::fs::metadata(ca_dir.join(CA_KEY_FILE))
        .expect("key")
        .permissions()
        .mode();
    assert_eq!(mode & 0o077, 0, "CA key is private (mode {mode:o})");
    let roots = ca.roots();
    let again = BuiltinCa::load_or_generate(&ca_dir, &td).expect("reload");
    assert_eq!(again.roots(), roots, "a restart keeps the root");

    let identity = id("default", "sleep");
    let chain = issue_via_manager(Arc::new(again), &identity).await;
    check_leaf(&chain, &roots, &identity);
}

#[tokio::test]
async fn loads_an_istio_style_rsa_plugin_ca() {
    // Istio's plug-in layout: an RSA root, an RSA intermediate signing
    // workloads (PKCS#1 key, as `openssl genrsa -traditional` writes), and
    // cert-chain.pem = intermediate + root.
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    std::fs::write(
        d.join("ca.ext"),
        "basicConstraints=critical,CA:TRUE\nkeyUsage=critical,keyCertSign,cRLSign,digitalSignature\n",
    )
    .expect("ext");
    openssl(
        d,
        &["genrsa", "-traditional", "-out", "root-key.pem", "2048"],
    );
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            "root-key.pem",
            "-subj",
            "/O=Istio/CN=Root CA",
            "-days",
            "3650",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-out",
            ROOT_CERT_FILE,
        ],
    );
    openssl(d, &["genrsa", "-traditional", "-out", CA_KEY_FILE, "2048"]);
    openssl(
        d,
        &[
            "req",
            "-new",
            "-key",
            CA_KEY_FILE,
            "-subj",
            "/O=Istio/CN=Intermediate CA/L=node-a",
            "-out",
            "ca.csr",
        ],
    );
    openssl(
        d,
        &[
            "x509",
            "-req",
            "-in",
            "ca.csr",
            "-CA",
            ROOT_CERT_FILE,
            "-CAkey",
            "root-key.pem",
            "-CAcreateserial",
            "-days",
            "730",
            "-extfile",
            "ca.ext",
            "-out",
            CA_CERT_FILE,
        ],
    );
    let chain = format!(
        "{}{}",
        std::fs::read_to_string(d.join(CA_CERT_FILE)).expect("ca cert"),
        std::fs::read_to_string(d.join(ROOT_CERT_FILE)).expect("root")
    );
    std::fs::write(d.join(CERT_CHAIN_FILE), chain).expect("chain");
    assert!(
        std::fs::read_to_string(d.join(CA_KEY_FILE))
            .expect("key")
            .contains("BEGIN RSA PRIVATE KEY"),
        "the test uses a PKCS#1 key"
    );

    let ca = BuiltinCa::load(d).expect("loads").expect("present");
    assert_eq!(
        ca.chain().len(),
        1,
        "the intermediate is sent, the root is not"
    );
    let roots =
        parse_certs(&std::fs::read_to_string(d.join(ROOT_CERT_FILE)).expect("root")).expect("pem");
    assert_eq!(ca.roots(), roots);
    let identity = id("prod", "web");
    let chain = issue_via_manager(Arc::new(ca), &identity).await;
    assert_eq!(chain.len(), 2, "leaf + intermediate");
    check_leaf(&chain, &roots, &identity);

    // The same key as PKCS#8 loads too.
    openssl(
        d,
        &[
            "pkcs8",
            "-topk8",
            "-nocrypt",
            "-in",
            CA_KEY_FILE,
            "-out",
            "ca-key.p8",
        ],
    );
    std::fs::rename(d.join("ca-key.p8"), d.join(CA_KEY_FILE)).expect("rename");
    BuiltinCa::load(d)
        .expect("PKCS#8 RSA loads")
        .expect("present");
}

#[tokio::test]
async fn loads_an_ecdsa_sec1_self_signed_ca() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    openssl(
        d,
        &[
            "ecparam",
            "-genkey",
            "-name",
            "prime256v1",
            "-out",
            CA_KEY_FILE,
        ],
    );
    openssl(
        d,
        &[
            "req",
            "-x509",
            "-new",
            "-key",
            CA_KEY_FILE,
            "-subj",
            "/O=cluster.local",
            "-days",
            "365",
            "-addext",
            "basicConstraints=critical,CA:TRUE",
            "-addext",
            "keyUsage=critical,keyCertSign,cRLSign",
            "-out",
            CA_CERT_FILE,
        ],
    );
    assert!(
        std::fs::read_to_string(d.join(CA_KEY_FILE))
            .expect("key")
            .contains("BEGIN EC PRIVATE KEY")
    );
    // Only ca-cert.pem and ca-key.pem: the CA is its own root.
    let ca = BuiltinCa::load(d).expect("loads").expect("present");
    let roots = ca.roots();
    assert_eq!(roots.len(), 1);
    assert!(ca.chain().is_empty());
    let identity = id("default", "sleep");
    let chain = issue_via_manager(Arc::new(ca), &identity).await;
    check_leaf(&chain, &roots, &identity);
}

#[test]
fn broken_ca_dirs_are_named_errors() {
    let dir = tempfile::tempdir().expect("tempdir");
    let d = dir.path();
    assert!(BuiltinCa::load(d).expect("empty dir is fine").is_none());

    let (_, files) = BuiltinCa::generate(&TrustDomain::default()).expect("generate");
    std::fs::write(d.join(CA_CERT_FILE), &files.ca_cert_pem).expect("write");
    let err = BuiltinCa::load(d).expect_err("key missing").to_string();
    assert!(err.contains("ca-key.pem is missing"), "{err}");

    let (_, other) = BuiltinCa::generate(&TrustDomain::default()).expect("generate");
    std::fs::write(d.join(CA_KEY_FILE), &other.ca_key_pem).expect("write");
    let err = BuiltinCa::load(d).expect_err("mismatched key").to_string();
    assert!(err.contains("not the certificate's"), "{err}");

    std::fs::write(d.join(CA_KEY_FILE), "garbage").expect("write");
    let err = BuiltinCa::load(d).expect_err("garbage key").to_string();
    assert!(err.contains("ca-key.pem"), "{err}");
    // load_or_generate must not overwrite a broken CA (that would split
    // the mesh's trust).
    assert!(BuiltinCa::load_or_generate(d, &TrustDomain::default()).is_err());
}

#[tokio::test]
async fn renews_at_half_life_and_drops_unused_identities() {
    let (ca, _) = BuiltinCa::generate(&TrustDomain::default()).expect("generate");
    let config = IdentityConfig {
        cert_ttl: Duration::from_secs(4),
        ..IdentityConfig::default()
    };
    let manager = IdentityManager::new(Arc::new(ca), config);
    let a = id("default", "a");
    let b = id("default", "b");
    assert!(matches!(
        manager.certificate(&a).await,
        Err(shunt::identity::IdentityError::NotRegistered(_))
    ));
    manager.register(&a);
    manager.register(&a);
    manager.register(&b);
    assert_eq!(manager.identities(), [a.clone(), b.clone()]);

    let first = manager.certificate(&a).await.expect("first");
    let life = first
        .not_after()
        .duration_since(first.not_before())
        .expect("positive");
    assert!(
        life <= Duration::from_secs(6),
        "short TTL honoured: {life:?}"
    );
    // Renewal at half-life: a new certificate before the first expires.
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let renewed = loop {
        let now = manager.current(&a).expect("held");
        if now.chain()[0] != first.chain()[0] {
            break now;
        }
        assert!(std::time::Instant::now() < deadline, "not renewed in time");
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(
        std::time::SystemTime::now() < first.not_after(),
        "renewed before expiry"
    );
    assert!(renewed.not_after() > first.not_after());

    // Two pods use `a`: one leaving keeps it, the second drops it.
    assert!(manager.unregister(&a));
    assert!(manager.current(&a).is_some());
    assert!(!manager.unregister(&a));
    assert!(manager.current(&a).is_none());
    assert_eq!(manager.identities(), std::slice::from_ref(&b));
    assert!(!manager.unregister(&b));
    assert!(manager.identities().is_empty());
}

/// A CA that answers with someone else's certificate is not believed.
#[tokio::test]
async fn a_lying_ca_is_caught() {
    struct Liar(BuiltinCa);
    impl CertificateAuthority for Liar {
        fn sign(
            &self,
            mut request: shunt::identity::SignRequest,
        ) -> shunt::identity::SignFuture<'_> {
            request.identity = id("kube-system", "admin");
            self.0.sign(request)
        }
        fn roots(&self) -> Vec<CertificateDer<'static>> {
            self.0.roots()
        }
    }
    let (ca, _) = BuiltinCa::generate(&TrustDomain::default()).expect("generate");
    let manager = IdentityManager::new(
        Arc::new(Liar(ca)),
        IdentityConfig {
            wait_timeout: Duration::from_secs(2),
            ..IdentityConfig::default()
        },
    );
    let me = id("default", "sleep");
    manager.register(&me);
    let err = manager
        .certificate(&me)
        .await
        .expect_err("rejected")
        .to_string();
    assert!(err.contains("URI SANs"), "{err}");
}

/// The agent makes the manager on its control runtime and the proxy
/// registers a pod's identity from the data path's (`add_pod`): the
/// certificate is issued and kept by a task on the manager's runtime, so
/// neither its renewal timer nor its CA calls run on the data path, and it
/// does not end with the caller's runtime.
#[test]
fn certificates_are_kept_on_the_managers_runtime() {
    let dir = tempfile::tempdir().expect("tempdir");
    let ca = BuiltinCa::load_or_generate(&dir.path().join("ca"), &TrustDomain::default())
        .expect("generate");
    let roots = ca.roots();
    let control = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(1)
        .enable_all()
        .build()
        .expect("control runtime");
    let manager =
        control.block_on(async { IdentityManager::new(Arc::new(ca), IdentityConfig::default()) });
    let identity = id("default", "sleep");
    // A runtime that runs nothing after the registration and is gone
    // before the certificate is asked for.
    let data_path = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("data path runtime");
    data_path.block_on(async { manager.register(&identity) });
    drop(data_path);
    let cert = control
        .block_on(manager.certificate(&identity))
        .expect("issued by the manager's runtime");
    check_leaf(cert.chain(), &roots, &identity);
}

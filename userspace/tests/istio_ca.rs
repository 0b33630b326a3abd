//! `--ca istio`: the Istio CA client against an in-test
//! `istio.v1.auth.IstioCertificateService` (tonic over TLS on 127.0.0.1,
//! rooted in a test CA) that checks every request as istiod would — bearer
//! token, CSR SAN, impersonated identity, validity — and signs it.
//! Refusals: a wrong token, an unreachable CA, a CA answering with another
//! identity's certificate, a CA serving a certificate from another root.

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex},
    time::{Duration, SystemTime},
};

use rcgen::{
    CertificateParams, CertificateSigningRequestParams, DistinguishedName, ExtendedKeyUsagePurpose,
    IsCa, KeyPair, KeyUsagePurpose, SanType,
};
use shunt::{
    identity::{
        CaKind, CertificateAuthority, IdentityConfig, IdentityError, IdentityManager, SignRequest,
        ca::{BuiltinCa, CaFiles},
        ca_from_args,
        istio::{IMPERSONATED_IDENTITY_KEY, IstioCa, IstioCaConfig, IstioCaError},
    },
    state::{SpiffeId, TrustDomain},
};
use shunt_proto::istio::ca::{
    IstioCertificateRequest, IstioCertificateResponse,
    istio_certificate_service_server::{IstioCertificateService, IstioCertificateServiceServer},
};
use tonic::{
    Request, Response, Status,
    transport::{Identity, Server, ServerTlsConfig, server::TcpIncoming},
};

const TOKEN: &str = "test-token-of-the-node-proxy";

fn id(ns: &str, sa: &str) -> SpiffeId {
    SpiffeId::for_service_account(&TrustDomain::default(), ns, sa)
}

/// What the fake CA saw in one request.
#[derive(Clone, Debug)]
struct Seen {
    authorization: Option<String>,
    cluster_id: Option<String>,
    impersonated: Option<String>,
    csr_uris: Vec<String>,
    validity: i64,
}

/// How the fake CA answers a request it accepts.
#[derive(Clone, Copy, Debug)]
enum Answer {
    /// A certificate for the impersonated identity, as istiod issues.
    Honest,
    /// A certificate for another identity (a broken or hostile CA).
    OtherIdentity,
}

struct FakeIstiod {
    ca: Arc<BuiltinCa>,
    answer: Answer,
    seen: Arc<Mutex<Vec<Seen>>>,
}

#[tonic::async_trait]
impl IstioCertificateService for FakeIstiod {
    async fn create_certificate(
        &self,
        request: Request<IstioCertificateRequest>,
    ) -> Result<Response<IstioCertificateResponse>, Status> {
        let header = |name: &str| {
            request
                .metadata()
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_string)
        };
        let authorization = header("authorization");
        let cluster_id = header("clusterid");
        let body = request.get_ref();
        let impersonated = body
            .metadata
            .as_ref()
            .and_then(|m| m.fields.get(IMPERSONATED_IDENTITY_KEY))
            .and_then(|v| match &v.kind {
                Some(prost_types::value::Kind::StringValue(s)) => Some(s.clone()),
                _ => None,
            });
        let csr = CertificateSigningRequestParams::from_pem(&body.csr)
            .map_err(|e| Status::invalid_argument(format!("CSR: {e}")))?;
        let csr_uris: Vec<String> = csr
            .params
            .subject_alt_names
            .iter()
            .filter_map(|san| match san {
                SanType::URI(uri) => Some(uri.as_str().to_string()),
                _ => None,
            })
            .collect();
        self.seen.lock().expect("seen lock").push(Seen {
            authorization: authorization.clone(),
            cluster_id,
            impersonated: impersonated.clone(),
            csr_uris: csr_uris.clone(),
            validity: body.validity_duration,
        });

        // istiod's order: authenticate, then authorize the identity.
        if authorization.as_deref() != Some(&format!("Bearer {TOKEN}")) {
            return Err(Status::unauthenticated("authentication failure"));
        }
        let Some(identity) = impersonated else {
            return Err(Status::invalid_argument("no ImpersonatedIdentity"));
        };
        if csr_uris != [identity.as_str()] {
            return Err(Status::invalid_argument(format!(
                "CSR SANs {csr_uris:?} are not [{identity}]"
            )));
        }
        if body.validity_duration <= 0 {
            return Err(Status::invalid_argument("validity_duration must be > 0"));
        }
        let san = match self.answer {
            Answer::Honest => identity,
            Answer::OtherIdentity => id("default", "someone-else").to_string(),
        };
        let ttl = Duration::from_secs(body.validity_duration.unsigned_abs());
        let leaf = self
            .ca
            .sign_params(&leaf_params(&san, ttl), &csr.public_key)
            .map_err(|e| Status::internal(e.to_string()))?;
        // Istio's shape: leaf first, root last, one PEM per element.
        let cert_chain = std::iter::once(&leaf)
            .chain(self.ca.roots().iter())
            .map(|der| pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec())))
            .collect();
        Ok(Response::new(IstioCertificateResponse { cert_chain }))
    }
}

fn leaf_params(uri: &str, ttl: Duration) -> CertificateParams {
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(
        uri.to_string().try_into().expect("URI SAN is IA5"),
    )];
    params.is_ca = IsCa::ExplicitNoCa;
    params.key_usages = vec![
        KeyUsagePurpose::DigitalSignature,
        KeyUsagePurpose::KeyEncipherment,
    ];
    params.extended_key_usages = vec![
        ExtendedKeyUsagePurpose::ServerAuth,
        ExtendedKeyUsagePurpose::ClientAuth,
    ];
    let now = SystemTime::now();
    params.not_before = (now - Duration::from_secs(60)).into();
    params.not_after = (now + ttl).into();
    params
}

/// A test root, plus the files the client reads (root and token).
struct Pki {
    ca: Arc<BuiltinCa>,
    files: CaFiles,
    dir: tempfile::TempDir,
}

impl Pki {
    fn new() -> Self {
        let (ca, files) = BuiltinCa::generate(&TrustDomain::default()).expect("test root");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("root-cert.pem"), &files.root_cert_pem).expect("root");
        // A trailing newline, as `kubectl create token > file` leaves.
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).expect("token");
        Self {
            ca: Arc::new(ca),
            files,
            dir,
        }
    }

    fn root_file(&self) -> PathBuf {
        self.dir.path().join("root-cert.pem")
    }

    fn token_file(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    /// The CA's serving certificate: IP SAN 127.0.0.1, signed by the root.
    fn server_identity(&self) -> Identity {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let mut params =
            CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("server params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let der = self.ca.sign_params(&params, &key).expect("server cert");
        let pem = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
        Identity::from_pem(pem, key.serialize_pem())
    }

    fn config(&self, addr: SocketAddr) -> IstioCaConfig {
        let mut config = IstioCaConfig::new(
            format!("https://{addr}"),
            self.root_file(),
            self.token_file(),
        );
        // Short, so the refusal tests do not wait long.
        config.connect_timeout = Duration::from_secs(2);
        config.request_timeout = Duration::from_secs(4);
        config
    }
}

struct RunningCa {
    addr: SocketAddr,
    seen: Arc<Mutex<Vec<Seen>>>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for RunningCa {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl RunningCa {
    fn seen(&self) -> Vec<Seen> {
        self.seen.lock().expect("seen lock").clone()
    }
}

/// Serves the fake CA on 127.0.0.1 with TLS; `serving_pki` provides the
/// serving certificate, `signing_ca` signs the workload certificates.
async fn start_ca(serving_pki: &Pki, signing_ca: Arc<BuiltinCa>, answer: Answer) -> RunningCa {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind loopback");
    let addr = listener.local_addr().expect("local addr");
    let seen = Arc::new(Mutex::new(Vec::new()));
    let service = FakeIstiod {
        ca: signing_ca,
        answer,
        seen: seen.clone(),
    };
    let server = Server::builder()
        .tls_config(ServerTlsConfig::new().identity(serving_pki.server_identity()))
        .expect("server TLS")
        .add_service(IstioCertificateServiceServer::new(service));
    let task = tokio::spawn(async move {
        if let Err(e) = server
            .serve_with_incoming(TcpIncoming::from(listener))
            .await
        {
            eprintln!("fake istiod stopped: {e}");
        }
    });
    RunningCa { addr, seen, task }
}

/// A CSR as the identity manager makes it: ECDSA P-256, URI SAN = the id.
fn csr_for(identity: &SpiffeId) -> String {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let mut params = CertificateParams::default();
    params.distinguished_name = DistinguishedName::new();
    params.subject_alt_names = vec![SanType::URI(
        identity.as_str().to_string().try_into().expect("IA5"),
    )];
    params
        .serialize_request(&key)
        .and_then(|csr| csr.pem())
        .expect("CSR")
}

fn sign_request(identity: &SpiffeId, ttl: Duration) -> SignRequest {
    SignRequest {
        identity: identity.clone(),
        csr_pem: csr_for(identity),
        ttl,
    }
}

#[tokio::test]
async fn issues_through_the_istio_ca_with_the_request_ztunnel_sends() {
    let pki = Pki::new();
    let server = start_ca(&pki, pki.ca.clone(), Answer::Honest).await;
    let mut config = pki.config(server.addr);
    config.cluster_id = Some("Kubernetes".into());

    // Through the agent's constructor and the identity manager, as in the
    // agent: the manager makes the key and CSR, the client gets them signed.
    let ca = ca_from_args(
        CaKind::Istio,
        Path::new("/nonexistent-unused-for-istio"),
        &TrustDomain::default(),
        config,
    )
    .await
    .expect("Istio CA client");
    assert_eq!(ca.roots(), pki.ca.roots(), "roots come from --ca-root-cert");
    let manager = IdentityManager::new(
        ca,
        IdentityConfig {
            cert_ttl: Duration::from_secs(3600),
            ..IdentityConfig::default()
        },
    );
    let identity = id("shop", "checkout");
    manager.register(&identity);
    let cert = manager
        .certificate(&identity)
        .await
        .expect("certificate from the Istio CA");

    let chain = cert.chain();
    let (_, leaf) = x509_parser::parse_x509_certificate(&chain[0]).expect("leaf parses");
    assert_eq!(shunt::tls::uri_sans(&leaf), [identity.as_str()]);
    assert!(
        !chain.iter().any(|c| pki.ca.roots().contains(c)),
        "the root is left out of the chain sent to peers"
    );
    let life = cert
        .not_after()
        .duration_since(SystemTime::now())
        .expect("valid");
    assert!(
        life > Duration::from_secs(3500) && life <= Duration::from_secs(3600),
        "the requested validity was honoured: {life:?}"
    );

    let seen = server.seen();
    assert_eq!(seen.len(), 1, "one call: {seen:?}");
    let seen = &seen[0];
    assert_eq!(
        seen.authorization.as_deref(),
        Some(format!("Bearer {TOKEN}").as_str()),
        "bearer token from the file, newline trimmed"
    );
    assert_eq!(seen.cluster_id.as_deref(), Some("Kubernetes"));
    assert_eq!(seen.impersonated.as_deref(), Some(identity.as_str()));
    assert_eq!(seen.csr_uris, [identity.as_str()]);
    assert_eq!(seen.validity, 3600);
    assert!(
        pki.files.root_cert_pem.contains("BEGIN CERTIFICATE"),
        "test root written"
    );
}

#[tokio::test]
async fn wrong_token_is_refused_naming_the_ca_and_status_then_a_fixed_token_works() {
    let pki = Pki::new();
    let server = start_ca(&pki, pki.ca.clone(), Answer::Honest).await;
    std::fs::write(pki.token_file(), "not-the-token").expect("token");
    let ca = IstioCa::connect(pki.config(server.addr))
        .await
        .expect("client");
    let identity = id("shop", "cart");

    let err = ca
        .sign(sign_request(&identity, Duration::from_secs(600)))
        .await
        .expect_err("wrong token refused");
    let text = err.to_string();
    eprintln!("refusal: {text}");
    assert!(
        matches!(
            err,
            IdentityError::IstioCa(IstioCaError::Refused {
                code: tonic::Code::Unauthenticated,
                ..
            })
        ),
        "{err:?}"
    );
    assert!(
        text.contains(&server.addr.to_string()),
        "names the CA: {text}"
    );
    assert!(text.contains("Unauthenticated"), "names the status: {text}");
    assert!(
        text.contains(identity.as_str()),
        "names the identity: {text}"
    );
    assert!(
        !text.contains("not-the-token"),
        "never shows the token: {text}"
    );

    // The token is re-read for every call (projected tokens rotate).
    std::fs::write(pki.token_file(), TOKEN).expect("token");
    let chain = ca
        .sign(sign_request(&identity, Duration::from_secs(600)))
        .await
        .expect("signed with the rotated token");
    assert_eq!(chain.len(), 1, "leaf only: the root is left out");
    assert_eq!(server.seen().len(), 2);
}

#[tokio::test]
async fn unreachable_ca_is_a_clear_error() {
    let pki = Pki::new();
    // A port that was just free: nothing listens there now.
    let addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
        l.local_addr().expect("addr")
    };
    // Starting must not fail: the agent may come up before istiod.
    let ca = IstioCa::connect(pki.config(addr))
        .await
        .expect("client starts without its CA");
    let identity = id("shop", "payments");
    let err = ca
        .sign(sign_request(&identity, Duration::from_secs(600)))
        .await
        .expect_err("no CA there");
    let text = err.to_string();
    eprintln!("refusal: {text}");
    assert!(
        matches!(
            err,
            IdentityError::IstioCa(IstioCaError::Unreachable { .. })
        ),
        "{err:?}"
    );
    assert!(
        text.contains(&format!("https://{addr}")),
        "names the CA: {text}"
    );
    assert!(text.contains("unreachable"), "{text}");
    assert!(
        text.to_lowercase().contains("connect") || text.to_lowercase().contains("refused"),
        "says why: {text}"
    );
}

#[tokio::test]
async fn a_leaf_for_another_identity_is_rejected() {
    let pki = Pki::new();
    let server = start_ca(&pki, pki.ca.clone(), Answer::OtherIdentity).await;
    let ca = IstioCa::connect(pki.config(server.addr))
        .await
        .expect("client");
    let identity = id("shop", "checkout");
    let err = ca
        .sign(sign_request(&identity, Duration::from_secs(600)))
        .await
        .expect_err("wrong SAN rejected");
    let text = err.to_string();
    eprintln!("refusal: {text}");
    assert!(
        matches!(err, IdentityError::BadIssuedCertificate { .. }),
        "{err:?}"
    );
    assert!(text.contains(identity.as_str()), "{text}");
    assert!(
        text.contains("someone-else"),
        "shows what came back: {text}"
    );
    assert!(
        text.contains(&server.addr.to_string()),
        "names the CA: {text}"
    );
}

#[tokio::test]
async fn a_ca_from_another_root_is_refused() {
    let pki = Pki::new();
    let stranger = Pki::new();
    // The server presents a certificate the client's root does not sign.
    let server = start_ca(&stranger, stranger.ca.clone(), Answer::Honest).await;
    let ca = IstioCa::connect(pki.config(server.addr))
        .await
        .expect("client starts");
    let err = ca
        .sign(sign_request(&id("shop", "cart"), Duration::from_secs(600)))
        .await
        .expect_err("untrusted CA server");
    let text = err.to_string();
    eprintln!("refusal: {text}");
    assert!(text.contains(&server.addr.to_string()), "{text}");
    assert!(
        text.contains("certificate") || text.contains("UnknownIssuer"),
        "says the TLS check failed: {text}"
    );
    assert!(server.seen().is_empty(), "no request reached the stranger");
}

#[tokio::test]
async fn a_leaf_not_chaining_to_the_root_file_is_rejected() {
    let pki = Pki::new();
    let other_root = Pki::new();
    // TLS to the CA is fine, but it signs workloads with a root that peers
    // (who trust the root file) would not accept.
    let server = start_ca(&pki, other_root.ca.clone(), Answer::Honest).await;
    let ca = IstioCa::connect(pki.config(server.addr))
        .await
        .expect("client");
    let err = ca
        .sign(sign_request(&id("shop", "cart"), Duration::from_secs(600)))
        .await
        .expect_err("leaf from another root");
    let text = err.to_string();
    eprintln!("refusal: {text}");
    assert!(
        matches!(err, IdentityError::BadIssuedCertificate { .. }),
        "{err:?}"
    );
    assert!(
        text.contains("root-cert.pem"),
        "names the root file: {text}"
    );
}

#[tokio::test]
async fn setup_errors_name_the_file_or_address() {
    let pki = Pki::new();
    let addr: SocketAddr = "127.0.0.1:1".parse().expect("addr");

    let mut config = pki.config(addr);
    config.root_cert = pki.dir.path().join("missing-root.pem");
    let err = IstioCa::connect(config).await.expect_err("no root file");
    assert!(err.to_string().contains("missing-root.pem"), "{err}");

    let mut config = pki.config(addr);
    std::fs::write(pki.dir.path().join("empty.pem"), "").expect("write");
    config.root_cert = pki.dir.path().join("empty.pem");
    let err = IstioCa::connect(config).await.expect_err("empty root file");
    assert!(err.to_string().contains("no CERTIFICATE"), "{err}");

    let mut config = pki.config(addr);
    config.address = "http://127.0.0.1:15010".into();
    let err = IstioCa::connect(config).await.expect_err("plaintext");
    assert!(err.to_string().contains("only https"), "{err}");

    // A missing token is reported at the call, naming the file.
    let mut config = pki.config(addr);
    config.token_file = pki.dir.path().join("no-token");
    let ca = IstioCa::connect(config).await.expect("client");
    let err = ca
        .sign(sign_request(&id("a", "b"), Duration::from_secs(60)))
        .await
        .expect_err("no token");
    assert!(err.to_string().contains("no-token"), "{err}");
}

/// A root rotation without a restart (as ztunnel's root reload): the
/// client trusts the root file it started with; istiod now serves a
/// certificate of a new root, which it fails. The root file gains the new
/// root beside the old (how Istio's ConfigMap carries a rotation), and the
/// next call, over a channel made anew, is signed; `roots()` has both.
#[tokio::test]
async fn a_rotated_root_file_is_used_for_the_next_call() {
    let old = Pki::new();
    let new = Pki::new();
    let server = start_ca(&new, new.ca.clone(), Answer::Honest).await;
    let ca = IstioCa::connect(old.config(server.addr))
        .await
        .expect("client starts");
    let cart = id("shop", "cart");
    ca.sign(sign_request(&cart, Duration::from_secs(600)))
        .await
        .expect_err("istiod's certificate is of a root not yet trusted");
    assert!(!ca.reload_roots().expect("unchanged file"), "no change yet");

    let bundle = format!("{}{}", old.files.root_cert_pem, new.files.root_cert_pem);
    std::fs::write(old.root_file(), bundle).expect("rotate the root file");
    assert!(ca.reload_roots().expect("the new bundle parses"));
    assert_eq!(
        CertificateAuthority::roots(&ca).len(),
        2,
        "old and new root"
    );
    let chain = ca
        .sign(sign_request(&cart, Duration::from_secs(600)))
        .await
        .expect("signed once the new root is trusted");
    assert!(!chain.is_empty());
    assert!(!ca.reload_roots().expect("unchanged since"), "read once");

    // A broken file: named, and the bundle in force stays.
    std::fs::write(old.root_file(), "not a certificate").expect("break it");
    let e = ca.reload_roots().expect_err("does not parse");
    assert!(e.to_string().contains("root-cert.pem"), "{e}");
    assert_eq!(CertificateAuthority::roots(&ca).len(), 2, "still both");
    ca.sign(sign_request(&cart, Duration::from_secs(600)))
        .await
        .expect("still signed with the roots in force");
}

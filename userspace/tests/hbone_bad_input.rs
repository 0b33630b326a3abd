//! Bad input on 15008 gets a clear refusal, nothing panics, and the proxy's
//! open file descriptors return to where they were.
//!
//! One test function (this binary's only one) so the fd count of the
//! process is not disturbed by other tests running in parallel.

#[path = "support/mesh.rs"]
mod mesh;

use std::{
    net::SocketAddr,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    time::{Duration, SystemTime},
};

use bytes::Bytes;
use http::{Method, Request, StatusCode};
use mesh::{Mesh, pod};
use rcgen::{KeyPair, SanType};
use rustls::{
    ClientConfig, DigitallySignedStruct, SignatureScheme,
    client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier},
};
use rustls_pki_types::{CertificateDer, ServerName, UnixTime};
use shunt::{
    identity::{WorkloadCert, ca::BuiltinCa},
    proxy::ProxyConfig,
    state::{SpiffeId, TrustDomain},
    tls::{TrustRoots, client_config},
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// What a case must end with.
#[derive(Debug)]
enum Expect {
    /// The connection is refused before any stream: TLS or HTTP/2 fails.
    ConnectionRefused,
    /// The stream is answered with this status.
    Status(StatusCode),
    /// The server reset the stream (RST_STREAM) with this reason.
    StreamReset(Option<h2::Reason>),
    /// 200 and bytes flow.
    Ok,
}

enum Client {
    /// Raw bytes, no TLS.
    Raw(&'static [u8]),
    /// TLS with this config, then the request (or raw bytes after TLS).
    Tls(Arc<ClientConfig>, Req),
}

enum Req {
    Connect(String),
    ConnectWithHeader(String, usize),
    Get(String),
    Http1AfterTls,
    /// CONNECT, send data, then RST_STREAM in the middle of the transfer.
    ResetMidTransfer(String),
}

struct AcceptAnyServer;

impl std::fmt::Debug for AcceptAnyServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("AcceptAnyServer")
    }
}

impl ServerCertVerifier for AcceptAnyServer {
    fn verify_server_cert(
        &self,
        _: &CertificateDer<'_>,
        _: &[CertificateDer<'_>],
        _: &ServerName<'_>,
        _: &[u8],
        _: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }
    fn verify_tls12_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn verify_tls13_signature(
        &self,
        _: &[u8],
        _: &CertificateDer<'_>,
        _: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        Ok(HandshakeSignatureValid::assertion())
    }
    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        shunt::tls::provider()
            .signature_verification_algorithms
            .supported_schemes()
    }
}

/// A client config presenting a certificate with arbitrary content, signed
/// by `ca`.
fn client_with_cert(
    ca: &BuiltinCa,
    roots: &TrustRoots,
    server: &SpiffeId,
    sans: Vec<SanType>,
    not_before: SystemTime,
    not_after: SystemTime,
) -> Arc<ClientConfig> {
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let placeholder = SpiffeId::for_service_account(&TrustDomain::default(), "x", "x");
    let mut params =
        shunt::identity::ca::leaf_params(&placeholder, not_before, not_after).expect("params");
    params.subject_alt_names = sans;
    let leaf = ca.sign_params(&params, &key).expect("sign");
    let mut chain = vec![leaf];
    chain.extend(ca.chain().iter().cloned());
    // WorkloadCert checks the SAN, so build the rustls pieces directly.
    let signing = shunt::tls::provider()
        .key_provider
        .load_private_key(rustls_pki_types::PrivateKeyDer::Pkcs8(
            key.serialize_der().into(),
        ))
        .expect("signing key");
    let certified = Arc::new(rustls::sign::CertifiedKey::new(chain, signing));
    let good = good_client(ca, roots, server);
    let mut config = (*good).clone();
    config.client_auth_cert_resolver = Arc::new(Fixed(certified));
    Arc::new(config)
}

#[derive(Debug)]
struct Fixed(Arc<rustls::sign::CertifiedKey>);

impl rustls::client::ResolvesClientCert for Fixed {
    fn resolve(
        &self,
        _: &[&[u8]],
        _: &[SignatureScheme],
    ) -> Option<Arc<rustls::sign::CertifiedKey>> {
        Some(self.0.clone())
    }
    fn has_certs(&self) -> bool {
        true
    }
}

fn good_client(ca: &BuiltinCa, roots: &TrustRoots, server: &SpiffeId) -> Arc<ClientConfig> {
    let me = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sleep");
    let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
    let leaf = ca
        .issue(&me, &key, Duration::from_secs(3600))
        .expect("issue");
    let mut chain = vec![leaf];
    chain.extend(ca.chain().iter().cloned());
    let cert = WorkloadCert::new(me, chain, key.serialize_der()).expect("cert");
    client_config(&cert, roots, server).expect("client config")
}

/// Runs one case; returns what happened, as comparable text.
async fn run_case(m: &Mesh, target: SocketAddr, client: Client) -> Result<Expect, String> {
    let tcp = m
        .connect_direct("outsider", target)
        .await
        .map_err(|e| format!("tcp: {e}"))?;
    match client {
        Client::Raw(bytes) => {
            let mut tcp = tcp;
            let _ = tcp.write_all(bytes).await;
            let mut got = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(15), tcp.read_to_end(&mut got))
                .await
                .map_err(|_| "server kept a non-TLS connection open".to_string())?;
            if got.windows(3).any(|w| w == b"200") {
                return Err(format!("answered: {:?}", String::from_utf8_lossy(&got)));
            }
            Ok(Expect::ConnectionRefused)
        }
        Client::Tls(config, req) => {
            let tls = match tokio_rustls::TlsConnector::from(config)
                .connect(ServerName::IpAddress(target.ip().into()), tcp)
                .await
            {
                Ok(t) => t,
                Err(_) => return Ok(Expect::ConnectionRefused),
            };
            if let Req::Http1AfterTls = req {
                let mut tls = tls;
                let _ = tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n").await;
                let mut got = Vec::new();
                let _ = tokio::time::timeout(Duration::from_secs(15), tls.read_to_end(&mut got))
                    .await
                    .map_err(|_| "server kept an HTTP/1.1 connection open".to_string())?;
                return Ok(Expect::ConnectionRefused);
            }
            let (send, conn) = match h2::client::handshake(tls).await {
                Ok(x) => x,
                Err(_) => return Ok(Expect::ConnectionRefused),
            };
            let driver = tokio::spawn(async move {
                let _ = conn.await;
            });
            let result = tokio::time::timeout(Duration::from_secs(15), stream_case(send, req))
                .await
                .map_err(|_| "no answer in time".to_string())?;
            driver.abort();
            result
        }
    }
}

async fn stream_case(send: h2::client::SendRequest<Bytes>, req: Req) -> Result<Expect, String> {
    let mut send = match send.ready().await {
        Ok(s) => s,
        Err(_) => return Ok(Expect::ConnectionRefused),
    };
    let (request, reset) = match req {
        Req::Connect(a) => (
            Request::builder().method(Method::CONNECT).uri(a).body(()),
            false,
        ),
        Req::ConnectWithHeader(a, size) => (
            Request::builder()
                .method(Method::CONNECT)
                .uri(a)
                .header("x-big", "a".repeat(size))
                .body(()),
            false,
        ),
        Req::Get(a) => (
            Request::builder()
                .method(Method::GET)
                .uri(format!("http://{a}/"))
                .body(()),
            false,
        ),
        Req::ResetMidTransfer(a) => (
            Request::builder().method(Method::CONNECT).uri(a).body(()),
            true,
        ),
        Req::Http1AfterTls => unreachable!("handled before HTTP/2"),
    };
    let request = request.map_err(|e| e.to_string())?;
    let (response, mut body) = match send.send_request(request, false) {
        Ok(x) => x,
        Err(e) => return Err(format!("request not sent: {e}")),
    };
    let response = match response.await {
        Ok(r) => r,
        // Stream or connection refused before any answer.
        Err(e) if e.is_reset() && e.is_remote() => return Ok(Expect::StreamReset(e.reason())),
        Err(e) if e.is_reset() || e.is_go_away() || e.is_io() => {
            eprintln!("     (connection refused: {e})");
            return Ok(Expect::ConnectionRefused);
        }
        Err(e) => return Err(format!("response: {e}")),
    };
    if response.status() != StatusCode::OK {
        return Ok(Expect::Status(response.status()));
    }
    let mut recv = response.into_body();
    body.send_data(Bytes::from_static(b"ping"), !reset)
        .map_err(|e| e.to_string())?;
    if reset {
        body.send_data(Bytes::from(vec![7u8; 1024 * 1024]), false)
            .map_err(|e| e.to_string())?;
        let _ = recv.data().await;
        body.send_reset(h2::Reason::CANCEL);
        return Ok(Expect::Ok);
    }
    let mut got = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = recv.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    if got == b"ping" {
        Ok(Expect::Ok)
    } else {
        Err(format!("echo mismatch: {got:?}"))
    }
}

fn same(a: &Expect, b: &Expect) -> bool {
    match (a, b) {
        (Expect::ConnectionRefused, Expect::ConnectionRefused) | (Expect::Ok, Expect::Ok) => true,
        (Expect::Status(x), Expect::Status(y)) => x == y,
        (Expect::StreamReset(x), Expect::StreamReset(y)) => x == y,
        _ => false,
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_is_refused_cleanly() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        PANICS.fetch_add(1, Ordering::SeqCst);
        default_hook(info);
    }));

    let m = Mesh::new(
        "hbone-bad",
        vec![
            pod("node-a", "outsider", "legacy", false),
            pod("node-b", "server", "httpbin", true),
            pod("node-b", "neighbour", "httpbin", true),
        ],
        ProxyConfig::default(),
        shunt::identity::IdentityConfig::default(),
    )
    .await;
    m.echo_server("server", 8080);
    let target = m.addr("server", 15008);
    let app = m.addr("server", 8080).to_string();
    let server_id = m.identity("server");
    let roots =
        TrustRoots::new(&shunt::identity::CertificateAuthority::roots(&*m.ca)).expect("roots");
    let ca = &*m.ca;
    let good = good_client(ca, &roots, &server_id);
    let now = SystemTime::now();
    let hour = Duration::from_secs(3600);
    let uri = |s: &str| SanType::URI(s.to_string().try_into().expect("uri"));

    // Warm up (identity issued, tasks and threads started) and take the
    // baseline after the connection is gone.
    let warm = run_case(
        &m,
        target,
        Client::Tls(good.clone(), Req::Connect(app.clone())),
    )
    .await;
    assert!(matches!(warm, Ok(Expect::Ok)), "control case: {warm:?}");
    tokio::time::sleep(Duration::from_millis(500)).await;
    let baseline = mesh::fd_count();

    let (other_ca, _) = BuiltinCa::generate(&TrustDomain::default()).expect("other CA");
    let mut http11 = (*good).clone();
    http11.alpn_protocols = vec![b"http/1.1".to_vec()];
    let mut no_cert = ClientConfig::builder_with_provider(shunt::tls::provider())
        .with_protocol_versions(&[&rustls::version::TLS13])
        .expect("tls13")
        .dangerous()
        .with_custom_certificate_verifier(Arc::new(AcceptAnyServer))
        .with_no_client_auth();
    no_cert.alpn_protocols = vec![b"h2".to_vec()];
    no_cert.enable_sni = false;

    let cases: Vec<(&str, Client, Expect)> = vec![
        (
            "non-TLS bytes",
            Client::Raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            Expect::ConnectionRefused,
        ),
        (
            "TLS without a client certificate",
            Client::Tls(Arc::new(no_cert), Req::Connect(app.clone())),
            Expect::ConnectionRefused,
        ),
        (
            "client certificate without a SPIFFE SAN",
            Client::Tls(
                client_with_cert(
                    ca,
                    &roots,
                    &server_id,
                    vec![SanType::DnsName("sleep.default".try_into().expect("dns"))],
                    now - hour,
                    now + hour,
                ),
                Req::Connect(app.clone()),
            ),
            Expect::ConnectionRefused,
        ),
        (
            "wrong trust domain",
            Client::Tls(
                client_with_cert(
                    ca,
                    &roots,
                    &server_id,
                    vec![uri("spiffe://evil.example/ns/default/sa/sleep")],
                    now - hour,
                    now + hour,
                ),
                Req::Connect(app.clone()),
            ),
            Expect::ConnectionRefused,
        ),
        (
            "expired certificate",
            Client::Tls(
                client_with_cert(
                    ca,
                    &roots,
                    &server_id,
                    vec![uri("spiffe://cluster.local/ns/default/sa/sleep")],
                    now - 3 * hour,
                    now - hour,
                ),
                Req::Connect(app.clone()),
            ),
            Expect::ConnectionRefused,
        ),
        (
            "certificate from another CA",
            Client::Tls(
                client_with_cert(
                    &other_ca,
                    &roots,
                    &server_id,
                    vec![uri("spiffe://cluster.local/ns/default/sa/sleep")],
                    now - hour,
                    now + hour,
                ),
                Req::Connect(app.clone()),
            ),
            Expect::ConnectionRefused,
        ),
        (
            "ALPN http/1.1 instead of h2",
            Client::Tls(Arc::new(http11), Req::Connect(app.clone())),
            Expect::ConnectionRefused,
        ),
        (
            "HTTP/1.1 bytes after ALPN h2",
            Client::Tls(good.clone(), Req::Http1AfterTls),
            Expect::ConnectionRefused,
        ),
        (
            "malformed authority",
            Client::Tls(good.clone(), Req::Connect("not-an-ip:8080".into())),
            Expect::Status(StatusCode::BAD_REQUEST),
        ),
        (
            "IP not on this node",
            Client::Tls(good.clone(), Req::Connect("198.18.1.200:8080".into())),
            Expect::Status(StatusCode::UNAUTHORIZED),
        ),
        (
            "authority IP differs from the arrival IP",
            Client::Tls(
                good.clone(),
                Req::Connect(m.addr("neighbour", 8080).to_string()),
            ),
            Expect::Status(StatusCode::BAD_REQUEST),
        ),
        (
            "target port is the proxy's own",
            Client::Tls(
                good.clone(),
                Req::Connect(m.addr("server", 15008).to_string()),
            ),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
        ),
        (
            "application refuses",
            Client::Tls(good.clone(), Req::Connect(m.addr("server", 9).to_string())),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
        ),
        (
            "GET instead of CONNECT",
            Client::Tls(good.clone(), Req::Get(app.clone())),
            Expect::Status(shunt::proxy::NON_CONNECT_STATUS),
        ),
        (
            "oversized headers",
            Client::Tls(good.clone(), Req::ConnectWithHeader(app.clone(), 20 * 1024)),
            Expect::Status(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
        ),
        // Far over the limit, h2 drops the whole connection (GOAWAY
        // ENHANCE_YOUR_CALM) rather than decode it.
        (
            "hugely oversized headers",
            Client::Tls(
                good.clone(),
                Req::ConnectWithHeader(app.clone(), 256 * 1024),
            ),
            Expect::ConnectionRefused,
        ),
        (
            "stream reset mid-transfer",
            Client::Tls(good.clone(), Req::ResetMidTransfer(app.clone())),
            Expect::Ok,
        ),
        (
            "a good request still works",
            Client::Tls(good.clone(), Req::Connect(app.clone())),
            Expect::Ok,
        ),
    ];

    let mut failures = Vec::new();
    for (name, client, expect) in cases {
        let got = run_case(&m, target, client).await;
        match got {
            Ok(got) if same(&got, &expect) => eprintln!("ok   {name}: {got:?}"),
            other => failures.push(format!("{name}: expected {expect:?}, got {other:?}")),
        }
    }
    assert!(
        failures.is_empty(),
        "cases failed:\n{}",
        failures.join("\n")
    );

    let stats = m.nodes["node-b"].proxy.stats();
    assert!(stats.refused >= 14, "refusals counted: {stats:?}");
    let back = mesh::eventually(Duration::from_secs(20), || mesh::fd_count() <= baseline).await;
    assert!(
        back,
        "fds back to baseline {baseline}: now {}",
        mesh::fd_count()
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "nothing panicked");
}

//! Bad input on 15008 gets a clear refusal, nothing panics, and the proxy's
//! open file descriptors return to where they were.
//!
//! Each case asserts the specific refusal the client sees (the TLS alert,
//! the status, the GOAWAY reason, a close with no answer) and exactly what
//! the proxy counted for it (access-log lines, refused, failed), once the
//! case's tasks have ended.
//!
//! One test function (this binary's only one) so the fd count of the
//! process is not disturbed by other tests running in parallel.

#[path = "support/mesh.rs"]
mod mesh;

use std::{
    net::SocketAddr,
    pin::Pin,
    sync::{
        Arc,
        atomic::{AtomicUsize, Ordering},
    },
    task::{Context, Poll},
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
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, ReadBuf};

static PANICS: AtomicUsize = AtomicUsize::new(0);

/// What a case must end with, as the client sees it.
#[derive(Debug, PartialEq)]
enum Expect {
    /// The server answered non-TLS bytes with at most a TLS alert record,
    /// then closed: nothing an HTTP client could take for an answer.
    NotTls,
    /// The server refused the TLS session with this alert (rustls' name for
    /// it), during the handshake or, for a client certificate it rejects,
    /// right after it (TLS 1.3).
    TlsAlert(String),
    /// After TLS, the server closed without answering the request: only
    /// HTTP/2 connection frames (its SETTINGS, a GOAWAY) came back.
    ClosedWithoutAnswer,
    /// The server ended the connection with GOAWAY and this reason.
    GoAway(h2::Reason),
    /// The stream is answered with this status.
    Status(StatusCode),
    /// The server reset the stream (RST_STREAM) with this reason.
    StreamReset(Option<h2::Reason>),
    /// 200 and the bytes echoed.
    Ok,
    /// The client reset its stream mid-transfer: the application's
    /// connection behind it was closed, and a new stream on the same HBONE
    /// connection still works.
    ResetAbsorbed,
}

fn alert(name: &str) -> Expect {
    Expect::TlsAlert(name.to_string())
}

/// How the proxy must account for a case: access-log lines (inbound
/// connections or streams), of which refused and failed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counted {
    inbound: u64,
    refused: u64,
    failed: u64,
}

/// One refusal, counted.
const REFUSED: Counted = Counted {
    inbound: 1,
    refused: 1,
    failed: 0,
};
/// One stream served.
const SERVED: Counted = Counted {
    inbound: 1,
    refused: 0,
    failed: 0,
};
/// Refused by the h2 library itself before the proxy sees a request (431
/// for headers over the limit, GOAWAY far over it): the proxy has nothing
/// to count.
const REFUSED_BY_H2: Counted = Counted {
    inbound: 0,
    refused: 0,
    failed: 0,
};
/// The reset stream (failed) and the stream after it (served).
const RESET_THEN_SERVED: Counted = Counted {
    inbound: 2,
    refused: 0,
    failed: 1,
};

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
    /// CONNECT to the tracked application, move bytes, then RST_STREAM in
    /// the middle of a transfer; then CONNECT to the echo on the same
    /// connection.
    ResetMidTransfer {
        tracked: String,
        echo: String,
    },
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

/// The alert rustls reports receiving, by name, from an error's text
/// (`received fatal alert: CertificateRequired`): h2 keeps only the text
/// of the I/O error under it.
fn alert_in(text: &str) -> Option<String> {
    let rest = text.split("received fatal alert: ").nth(1)?;
    let name: String = rest
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric())
        .collect();
    (!name.is_empty()).then_some(name)
}

/// Reads until the server closes (EOF or a reset), bounded.
async fn read_until_closed(
    stream: &mut (impl tokio::io::AsyncRead + Unpin),
    what: &str,
) -> Result<Vec<u8>, String> {
    let mut got = Vec::new();
    let mut buf = [0u8; 4096];
    let read_all = async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => got.extend_from_slice(&buf[..n]),
            }
        }
    };
    tokio::time::timeout(Duration::from_secs(15), read_all)
        .await
        .map_err(|_| format!("server kept {what} open"))?;
    Ok(got)
}

/// The types of the HTTP/2 frames in `bytes`, which must be whole frames.
fn h2_frame_types(mut bytes: &[u8]) -> Result<Vec<u8>, String> {
    let mut types = Vec::new();
    while !bytes.is_empty() {
        if bytes.len() < 9 {
            return Err(format!("a partial HTTP/2 frame header: {bytes:?}"));
        }
        let len = u32::from_be_bytes([0, bytes[0], bytes[1], bytes[2]]) as usize;
        if bytes.len() < 9 + len {
            return Err(format!("a partial HTTP/2 frame: {bytes:?}"));
        }
        types.push(bytes[3]);
        bytes = &bytes[9 + len..];
    }
    Ok(types)
}

/// Runs one case; returns what the client saw.
async fn run_case(m: &Mesh, target: SocketAddr, client: Client) -> Result<Expect, String> {
    let mut tcp = m
        .connect_direct("outsider", target)
        .await
        .map_err(|e| format!("tcp: {e}"))?;
    let (config, req) = match client {
        Client::Raw(bytes) => {
            tcp.write_all(bytes)
                .await
                .map_err(|e| format!("write: {e}"))?;
            let got = read_until_closed(&mut tcp, "a non-TLS connection").await?;
            // A TLS alert record (content type 21, 2 bytes of payload), or
            // nothing at all.
            return match got.as_slice() {
                [] | [21, 3, _, 0, 2, _, _] => Ok(Expect::NotTls),
                other => Err(format!(
                    "answered non-TLS bytes with {:?}",
                    String::from_utf8_lossy(other)
                )),
            };
        }
        Client::Tls(config, req) => (config, req),
    };
    let tls = match tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::IpAddress(target.ip().into()), tcp)
        .await
    {
        Ok(t) => t,
        Err(e) => {
            return alert_in(&e.to_string())
                .map(Expect::TlsAlert)
                .ok_or(format!("TLS failed without an alert from the server: {e}"));
        }
    };
    // The server speaks first after the handshake: its HTTP/2 SETTINGS if it
    // accepted the session, else (TLS 1.3 checks the client's certificate
    // after the client finished) an alert. Waiting for that before sending
    // anything means a refusal is read as the alert it is, never seen as a
    // broken pipe on a write that raced it.
    let mut tls = tls;
    let mut first = vec![0u8; 16 * 1024];
    let n = match tokio::time::timeout(Duration::from_secs(15), tls.read(&mut first)).await {
        Err(_) => return Err("the server said nothing after the TLS handshake".into()),
        Ok(Ok(0)) => return Err("the server closed after the TLS handshake, no alert".into()),
        Ok(Ok(n)) => n,
        Ok(Err(e)) => {
            return alert_in(&e.to_string())
                .map(Expect::TlsAlert)
                .ok_or(format!("TLS failed without an alert from the server: {e}"));
        }
    };
    first.truncate(n);
    if let Req::Http1AfterTls = req {
        tls.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .map_err(|e| format!("write: {e}"))?;
        let mut got = first;
        got.extend(read_until_closed(&mut tls, "an HTTP/1.1 connection").await?);
        if got.starts_with(b"HTTP/") {
            return Err(format!(
                "answered HTTP/1.1: {:?}",
                String::from_utf8_lossy(&got)
            ));
        }
        // SETTINGS (4), PING (6), GOAWAY (7), WINDOW_UPDATE (8): the
        // connection's own frames; HEADERS or DATA would be an answer.
        let types = h2_frame_types(&got)?;
        return match types.iter().all(|t| [4, 6, 7, 8].contains(t)) {
            true => Ok(Expect::ClosedWithoutAnswer),
            false => Err(format!("answered with HTTP/2 frames of types {types:?}")),
        };
    }
    let tls = Rewind {
        prefix: Bytes::from(first),
        inner: tls,
    };
    let (send, conn) = h2::client::handshake(tls)
        .await
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
    let driver = tokio::spawn(conn);
    let result = tokio::time::timeout(Duration::from_secs(15), stream_case(send, req))
        .await
        .map_err(|_| "no answer in time".to_string())?;
    // A connection-level refusal (a TLS alert after the handshake, a
    // GOAWAY) is the connection's error; the stream only sees its shadow.
    match result {
        Err(StreamError::Connection(stream_error)) => {
            match tokio::time::timeout(Duration::from_secs(15), driver).await {
                Ok(Ok(Err(e))) => connection_refusal(&e),
                Ok(Ok(Ok(()))) => Err(format!(
                    "stream failed ({stream_error}), connection ended cleanly"
                )),
                Ok(Err(e)) => Err(format!("connection task: {e}")),
                Err(_) => Err(format!(
                    "stream failed ({stream_error}), connection still open"
                )),
            }
        }
        Err(StreamError::Other(e)) => {
            driver.abort();
            Err(e)
        }
        Ok(expect) => {
            driver.abort();
            Ok(expect)
        }
    }
}

/// A stream that first yields `prefix` (bytes already read from `inner`).
struct Rewind<S> {
    prefix: Bytes,
    inner: S,
}

impl<S: AsyncRead + Unpin> AsyncRead for Rewind<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        if !self.prefix.is_empty() {
            let n = self.prefix.len().min(buf.remaining());
            let head = self.prefix.split_to(n);
            buf.put_slice(&head);
            return Poll::Ready(Ok(()));
        }
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for Rewind<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        Pin::new(&mut self.inner).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

/// A connection's end as the client saw it: a TLS alert, or a GOAWAY.
fn connection_refusal(e: &h2::Error) -> Result<Expect, String> {
    if let Some(alert) = alert_in(&e.to_string()) {
        return Ok(Expect::TlsAlert(alert));
    }
    match (e.is_go_away(), e.is_remote(), e.reason()) {
        (true, true, Some(reason)) => Ok(Expect::GoAway(reason)),
        _ => Err(format!(
            "connection failed without a TLS alert or GOAWAY: {e}"
        )),
    }
}

enum StreamError {
    /// The connection under the stream failed: see its own error.
    Connection(h2::Error),
    Other(String),
}

impl From<String> for StreamError {
    fn from(e: String) -> Self {
        StreamError::Other(e)
    }
}

/// An h2 error on a stream: the server's RST_STREAM is the answer;
/// anything else is the connection's.
fn stream_error(e: h2::Error) -> Result<Expect, StreamError> {
    if e.is_reset() && e.is_remote() && !e.is_go_away() {
        Ok(Expect::StreamReset(e.reason()))
    } else {
        Err(StreamError::Connection(e))
    }
}

fn connect(authority: &str) -> Result<Request<()>, String> {
    Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .body(())
        .map_err(|e| e.to_string())
}

async fn stream_case(
    send: h2::client::SendRequest<Bytes>,
    req: Req,
) -> Result<Expect, StreamError> {
    let mut send = match send.ready().await {
        Ok(s) => s,
        Err(e) => return stream_error(e),
    };
    let request = match req {
        Req::Connect(a) => connect(&a)?,
        Req::ConnectWithHeader(a, size) => Request::builder()
            .method(Method::CONNECT)
            .uri(a)
            .header("x-big", "a".repeat(size))
            .body(())
            .map_err(|e| e.to_string())?,
        Req::Get(a) => Request::builder()
            .method(Method::GET)
            .uri(format!("http://{a}/"))
            .body(())
            .map_err(|e| e.to_string())?,
        Req::ResetMidTransfer { tracked, echo } => {
            return reset_mid_transfer(send, &tracked, &echo).await;
        }
        Req::Http1AfterTls => unreachable!("handled before HTTP/2"),
    };
    let (response, body) = match send.send_request(request, false) {
        Ok(x) => x,
        Err(e) => return stream_error(e),
    };
    let response = match response.await {
        Ok(r) => r,
        Err(e) => return stream_error(e),
    };
    if response.status() != StatusCode::OK {
        return Ok(Expect::Status(response.status()));
    }
    echo_ping(response.into_body(), body).await?;
    Ok(Expect::Ok)
}

/// Sends "ping", ends the stream, expects "ping" back and the end.
async fn echo_ping(
    mut recv: h2::RecvStream,
    mut body: h2::SendStream<Bytes>,
) -> Result<(), StreamError> {
    body.send_data(Bytes::from_static(b"ping"), true)
        .map_err(|e| e.to_string())?;
    let mut got = Vec::new();
    while let Some(chunk) = recv.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = recv.flow_control().release_capacity(chunk.len());
        got.extend_from_slice(&chunk);
    }
    match got == b"ping" {
        true => Ok(()),
        false => Err(format!("echo mismatch: {got:?}").into()),
    }
}

/// CONNECT to the tracked application; once bytes went there and back,
/// start a 1 MiB send and reset the stream in the middle of it. The
/// application must then see its connection closed, and the same HBONE
/// connection must still carry a new stream.
async fn reset_mid_transfer(
    mut send: h2::client::SendRequest<Bytes>,
    tracked: &str,
    echo: &str,
) -> Result<Expect, StreamError> {
    let closed_before = TRACKED_CLOSED.load(Ordering::SeqCst);
    let (response, mut body) = send
        .send_request(connect(tracked)?, false)
        .map_err(|e| format!("request: {e}"))?;
    let response = response.await.map_err(|e| format!("response: {e}"))?;
    if response.status() != StatusCode::OK {
        return Err(format!("tracked application answered {}", response.status()).into());
    }
    let mut recv = response.into_body();
    body.send_data(Bytes::from_static(b"ping"), false)
        .map_err(|e| e.to_string())?;
    match recv.data().await {
        Some(Ok(chunk)) if chunk.as_ref() == b"ping" => {
            let _ = recv.flow_control().release_capacity(chunk.len());
        }
        other => return Err(format!("no echo before the reset: {other:?}").into()),
    }
    body.send_data(Bytes::from(vec![7u8; 1024 * 1024]), false)
        .map_err(|e| e.to_string())?;
    body.send_reset(h2::Reason::CANCEL);
    let app_closed = mesh::eventually(Duration::from_secs(10), || {
        TRACKED_CLOSED.load(Ordering::SeqCst) > closed_before
    })
    .await;
    if !app_closed {
        return Err("the application's connection stayed open after the reset"
            .to_string()
            .into());
    }
    let mut send = send
        .ready()
        .await
        .map_err(|e| format!("the connection after the reset: {e}"))?;
    let (response, body) = send
        .send_request(connect(echo)?, false)
        .map_err(|e| format!("a new stream after the reset: {e}"))?;
    let response = response
        .await
        .map_err(|e| format!("a new stream after the reset: {e}"))?;
    if response.status() != StatusCode::OK {
        return Err(format!("a new stream after the reset: {}", response.status()).into());
    }
    echo_ping(response.into_body(), body).await?;
    Ok(Expect::ResetAbsorbed)
}

/// Connections of the tracked application that have ended.
static TRACKED_CLOSED: AtomicUsize = AtomicUsize::new(0);

/// An echo server on `pod`:`port` that counts its connections' ends (EOF
/// or a reset from the proxy) in [`TRACKED_CLOSED`].
fn tracked_echo_server(m: &Mesh, pod: &str, port: u16) {
    let listener = m.pod(pod).listen_tcp(m.addr(pod, port)).expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            tokio::spawn(async move {
                let (mut r, mut w) = s.split();
                let _ = tokio::io::copy(&mut r, &mut w).await;
                TRACKED_CLOSED.fetch_add(1, Ordering::SeqCst);
            });
        }
    });
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
    tracked_echo_server(&m, "server", 8081);
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
    let proxy = &m.nodes["node-b"].proxy;

    // Warm up (identity issued, tasks and threads started) and take the
    // baselines once the proxy has counted the stream and its task ended.
    let idle = proxy.stats().active;
    let warm = run_case(
        &m,
        target,
        Client::Tls(good.clone(), Req::Connect(app.clone())),
    )
    .await;
    assert_eq!(warm, Ok(Expect::Ok), "control case");
    let counted = mesh::eventually(Duration::from_secs(10), || {
        let s = proxy.stats();
        s.inbound_hbone == 1 && s.active == idle
    })
    .await;
    assert!(
        counted,
        "the control stream is counted: {:?}",
        proxy.stats()
    );
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

    let cases: Vec<(&str, Client, Expect, Counted)> = vec![
        (
            "non-TLS bytes",
            Client::Raw(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n"),
            Expect::NotTls,
            REFUSED,
        ),
        (
            "TLS without a client certificate",
            Client::Tls(Arc::new(no_cert), Req::Connect(app.clone())),
            alert("CertificateRequired"),
            REFUSED,
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
            alert("CertificateUnknown"),
            REFUSED,
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
            alert("CertificateUnknown"),
            REFUSED,
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
            alert("CertificateExpired"),
            REFUSED,
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
            // The other CA has the same name as the mesh's: the chain is
            // built to the mesh's root, whose key did not sign it.
            alert("DecryptError"),
            REFUSED,
        ),
        (
            "ALPN http/1.1 instead of h2",
            Client::Tls(Arc::new(http11), Req::Connect(app.clone())),
            alert("NoApplicationProtocol"),
            REFUSED,
        ),
        (
            "HTTP/1.1 bytes after ALPN h2",
            Client::Tls(good.clone(), Req::Http1AfterTls),
            Expect::ClosedWithoutAnswer,
            REFUSED,
        ),
        (
            "malformed authority",
            Client::Tls(good.clone(), Req::Connect("not-an-ip:8080".into())),
            Expect::Status(StatusCode::BAD_REQUEST),
            REFUSED,
        ),
        (
            "IP not on this node",
            Client::Tls(good.clone(), Req::Connect("198.18.1.200:8080".into())),
            Expect::Status(StatusCode::UNAUTHORIZED),
            REFUSED,
        ),
        (
            "authority IP differs from the arrival IP",
            Client::Tls(
                good.clone(),
                Req::Connect(m.addr("neighbour", 8080).to_string()),
            ),
            Expect::Status(StatusCode::BAD_REQUEST),
            REFUSED,
        ),
        (
            "target port is the proxy's own",
            Client::Tls(
                good.clone(),
                Req::Connect(m.addr("server", 15008).to_string()),
            ),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
            REFUSED,
        ),
        (
            "application refuses",
            Client::Tls(good.clone(), Req::Connect(m.addr("server", 9).to_string())),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
            REFUSED,
        ),
        (
            "GET instead of CONNECT",
            Client::Tls(good.clone(), Req::Get(app.clone())),
            Expect::Status(shunt::proxy::NON_CONNECT_STATUS),
            REFUSED,
        ),
        (
            "oversized headers",
            Client::Tls(good.clone(), Req::ConnectWithHeader(app.clone(), 20 * 1024)),
            Expect::Status(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
            REFUSED_BY_H2,
        ),
        // Far over the limit, h2 drops the whole connection rather than
        // decode it.
        (
            "hugely oversized headers",
            Client::Tls(
                good.clone(),
                Req::ConnectWithHeader(app.clone(), 256 * 1024),
            ),
            Expect::GoAway(h2::Reason::ENHANCE_YOUR_CALM),
            REFUSED_BY_H2,
        ),
        (
            "stream reset mid-transfer",
            Client::Tls(
                good.clone(),
                Req::ResetMidTransfer {
                    tracked: m.addr("server", 8081).to_string(),
                    echo: app.clone(),
                },
            ),
            Expect::ResetAbsorbed,
            RESET_THEN_SERVED,
        ),
        (
            "a good request still works",
            Client::Tls(good.clone(), Req::Connect(app.clone())),
            Expect::Ok,
            SERVED,
        ),
    ];

    // Each case's answer, and exactly what the proxy counted for it: once
    // its tasks have ended (active back to idle) the counters must have
    // moved by exactly the case's amounts, no more, no less.
    let mut failures = Vec::new();
    let mut expected = {
        let s = proxy.stats();
        Counted {
            inbound: s.inbound_hbone,
            refused: s.refused,
            failed: s.failed,
        }
    };
    for (name, client, expect, counts) in cases {
        let got = run_case(&m, target, client).await;
        match &got {
            Ok(got) if *got == expect => eprintln!("ok   {name}: {got:?}"),
            other => failures.push(format!("{name}: expected {expect:?}, got {other:?}")),
        }
        expected.inbound += counts.inbound;
        expected.refused += counts.refused;
        expected.failed += counts.failed;
        let now = || {
            let s = proxy.stats();
            let counted = Counted {
                inbound: s.inbound_hbone,
                refused: s.refused,
                failed: s.failed,
            };
            (counted, s.active)
        };
        let settled = mesh::eventually(Duration::from_secs(10), || now() == (expected, idle)).await;
        if !settled {
            let (counted, active) = now();
            failures.push(format!(
                "{name}: the proxy counted {counted:?} ({active} tasks active), expected {expected:?} ({idle} active)"
            ));
            expected = counted;
        }
    }
    assert!(
        failures.is_empty(),
        "cases failed:\n{}",
        failures.join("\n")
    );

    let back = mesh::eventually(Duration::from_secs(20), || mesh::fd_count() <= baseline).await;
    assert!(
        back,
        "fds back to baseline {baseline}: now {}",
        mesh::fd_count()
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "nothing panicked");
}

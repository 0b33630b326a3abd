//! Bad input on 15008 gets a clear refusal, nothing panics, and the proxy's
//! open file descriptors return to where they were.
//!
//! Each case asserts the specific refusal the client sees (the TLS alert,
//! the status, the GOAWAY reason, a close with no answer) and exactly what
//! the proxy counted for it (access-log lines, refused, failed), once the
//! case's tasks have ended.
//!
//! The tests of this binary run one at a time ([`serial`]) so that the fd
//! count of the process is not disturbed by another running in parallel.
//!
//! The limits a hostile peer cannot exhaust (issue 20 part 4) are here too:
//! the 101st concurrent stream, the per-source limit, rapid reset, and a
//! real agent under a low `RLIMIT_NOFILE` (that one needs the agent binary:
//! `cargo build -p shunt --bins`, `SHUNT_BIN`).

#[path = "support/agent_bed.rs"]
mod agent_bed;
#[path = "support/mesh.rs"]
mod mesh;

use std::{
    net::{SocketAddr, TcpStream as StdTcpStream},
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
    /// The connection was cut (reset, or a broken pipe) while the client
    /// was still writing: seen by the client, never expected by a case.
    Cut,
    /// GOAWAY with this reason, or [`Expect::Cut`]: a server that closes
    /// with the client's bytes unread makes the kernel answer with a
    /// reset, which can overtake its GOAWAY (the proxy's counters say
    /// which refusal it was).
    GoAwayOrCut(h2::Reason),
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
/// connections or streams), of which refused and failed, and the refusal
/// reason counted (`shunt_proxy_refusals_total{reason}`).
#[derive(Clone, Copy, Debug, Default, PartialEq)]
struct Counted {
    inbound: u64,
    refused: u64,
    failed: u64,
    reason: Option<&'static str>,
}

/// One refusal, counted under `reason`: whichever layer refused (TLS, the
/// proxy's checks, h2 itself), it is in the access log and the counters.
const fn refused(reason: &'static str) -> Counted {
    Counted {
        inbound: 1,
        refused: 1,
        failed: 0,
        reason: Some(reason),
    }
}
/// One stream served.
const SERVED: Counted = Counted {
    inbound: 1,
    refused: 0,
    failed: 0,
    reason: None,
};
/// The reset stream (failed) and the stream after it (served).
const RESET_THEN_SERVED: Counted = Counted {
    inbound: 2,
    refused: 0,
    failed: 1,
    reason: None,
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
    /// After TLS: the client preface, an empty SETTINGS, then these raw
    /// HTTP/2 frames; the answer is the first RST_STREAM or GOAWAY.
    Raw(Vec<u8>),
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

/// Runs one case from the outsider pod; returns what the client saw.
async fn run_case(m: &Mesh, target: SocketAddr, client: Client) -> Result<Expect, String> {
    run_case_from(m, "outsider", target, client).await
}

/// Runs one case from the pod `from`.
async fn run_case_from(
    m: &Mesh,
    from: &str,
    target: SocketAddr,
    client: Client,
) -> Result<Expect, String> {
    let mut tcp = m
        .connect_direct(from, target)
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
    if let Req::Raw(frames) = req {
        return raw_h2_case(tls, first, &frames).await;
    }
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

/// Whether the client's view `got` is what a case expects.
fn answers(got: &Expect, expect: &Expect) -> bool {
    match (got, expect) {
        (Expect::GoAway(got) | Expect::GoAwayOrCut(got), Expect::GoAwayOrCut(want)) => got == want,
        (Expect::Cut, Expect::GoAwayOrCut(_)) => true,
        _ => got == expect,
    }
}

/// A connection's end as the client saw it: a TLS alert, a GOAWAY, or a
/// cut.
fn connection_refusal(e: &h2::Error) -> Result<Expect, String> {
    if let Some(alert) = alert_in(&e.to_string()) {
        return Ok(Expect::TlsAlert(alert));
    }
    match (e.is_go_away(), e.is_remote(), e.reason()) {
        (true, true, Some(reason)) => Ok(Expect::GoAway(reason)),
        _ if e.get_io().is_some_and(|io| {
            matches!(
                io.kind(),
                std::io::ErrorKind::BrokenPipe | std::io::ErrorKind::ConnectionReset
            )
        }) =>
        {
            Ok(Expect::Cut)
        }
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
        Req::Http1AfterTls | Req::Raw(_) => unreachable!("handled before HTTP/2"),
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
    let _serial = serial().await;
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
            refused("tls"),
        ),
        (
            "TLS without a client certificate",
            Client::Tls(Arc::new(no_cert), Req::Connect(app.clone())),
            alert("CertificateRequired"),
            refused("tls"),
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
            refused("tls"),
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
            refused("tls"),
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
            refused("tls"),
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
            refused("tls"),
        ),
        (
            "ALPN http/1.1 instead of h2",
            Client::Tls(Arc::new(http11), Req::Connect(app.clone())),
            alert("NoApplicationProtocol"),
            refused("tls"),
        ),
        (
            "HTTP/1.1 bytes after ALPN h2",
            Client::Tls(good.clone(), Req::Http1AfterTls),
            Expect::ClosedWithoutAnswer,
            refused("request"),
        ),
        (
            "malformed authority (no port)",
            Client::Tls(good.clone(), Req::Connect("not-an-ip".into())),
            Expect::Status(StatusCode::BAD_REQUEST),
            refused("request"),
        ),
        // A hostname authority is a service's (waypoints send them), as
        // ztunnel takes it: one this node serves no service of is a 503.
        (
            "hostname of no service",
            Client::Tls(good.clone(), Req::Connect("no-such.example:8080".into())),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
            refused("request"),
        ),
        (
            "IP not on this node",
            Client::Tls(good.clone(), Req::Connect("198.18.1.200:8080".into())),
            Expect::Status(StatusCode::UNAUTHORIZED),
            refused("request"),
        ),
        (
            "authority IP differs from the arrival IP",
            Client::Tls(
                good.clone(),
                Req::Connect(m.addr("neighbour", 8080).to_string()),
            ),
            Expect::Status(StatusCode::BAD_REQUEST),
            refused("request"),
        ),
        (
            "target port is the proxy's own",
            Client::Tls(
                good.clone(),
                Req::Connect(m.addr("server", 15008).to_string()),
            ),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
            refused("request"),
        ),
        (
            "application refuses",
            Client::Tls(good.clone(), Req::Connect(m.addr("server", 9).to_string())),
            Expect::Status(StatusCode::SERVICE_UNAVAILABLE),
            refused("request"),
        ),
        (
            "GET instead of CONNECT",
            Client::Tls(good.clone(), Req::Get(app.clone())),
            Expect::Status(shunt::proxy::NON_CONNECT_STATUS),
            refused("request"),
        ),
        (
            "oversized headers",
            Client::Tls(good.clone(), Req::ConnectWithHeader(app.clone(), 20 * 1024)),
            Expect::Status(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE),
            refused("h2_headers_too_large"),
        ),
        // Far over the limit, h2 drops the whole connection rather than
        // decode it.
        (
            "hugely oversized headers",
            Client::Tls(
                good.clone(),
                Req::ConnectWithHeader(app.clone(), 256 * 1024),
            ),
            Expect::GoAwayOrCut(h2::Reason::ENHANCE_YOUR_CALM),
            refused("h2_header_flood"),
        ),
        // A request h2 itself finds malformed: reset by the codec, never
        // seen by the proxy's checks.
        (
            "unparsable :authority",
            Client::Tls(
                good.clone(),
                Req::Raw(connect_frame(1, b"bad authority", END_HEADERS)),
            ),
            Expect::StreamReset(Some(h2::Reason::PROTOCOL_ERROR)),
            refused("h2_malformed"),
        ),
        (
            "CONTINUATION flood",
            Client::Tls(good.clone(), Req::Raw(continuation_flood(1, 20))),
            Expect::GoAway(h2::Reason::ENHANCE_YOUR_CALM),
            refused("h2_continuation_flood"),
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
    let now = || {
        let s = proxy.stats();
        let counted = Counted {
            inbound: s.inbound_hbone,
            refused: s.refused,
            failed: s.failed,
            reason: None,
        };
        (counted, s.refusals, s.active)
    };
    let (mut expected, mut expected_reasons, _) = now();
    for (name, client, expect, counts) in cases {
        let got = run_case(&m, target, client).await;
        match &got {
            Ok(got) if answers(got, &expect) => eprintln!("ok   {name}: {got:?}"),
            other => failures.push(format!("{name}: expected {expect:?}, got {other:?}")),
        }
        expected.inbound += counts.inbound;
        expected.refused += counts.refused;
        expected.failed += counts.failed;
        if let Some(reason) = counts.reason {
            *expected_reasons.entry(reason.to_string()).or_default() += 1;
        }
        let settled = mesh::eventually(Duration::from_secs(10), || {
            now() == (expected, expected_reasons.clone(), idle)
        })
        .await;
        if !settled {
            let (counted, reasons, active) = now();
            failures.push(format!(
                "{name}: the proxy counted {counted:?} {reasons:?} ({active} tasks active), expected {expected:?} {expected_reasons:?} ({idle} active)"
            ));
            expected = counted;
            expected_reasons = reasons;
        }
    }
    assert!(
        failures.is_empty(),
        "cases failed:\n{}",
        failures.join("\n")
    );
    // h2's own refusals are on /metrics beside the others.
    let text = scrape(proxy);
    for line in [
        "shunt_proxy_refusals_total{reason=\"h2_headers_too_large\"} 1",
        "shunt_proxy_refusals_total{reason=\"h2_header_flood\"} 1",
        "shunt_proxy_refusals_total{reason=\"h2_malformed\"} 1",
        "shunt_proxy_refusals_total{reason=\"h2_continuation_flood\"} 1",
        "shunt_proxy_refusals_total{reason=\"tls\"} 7",
    ] {
        assert!(
            text.lines().any(|l| l == line),
            "{line:?} missing in\n{text}"
        );
    }

    let back = mesh::eventually(Duration::from_secs(20), || mesh::fd_count() <= baseline).await;
    assert!(
        back,
        "fds back to baseline {baseline}: now {}",
        mesh::fd_count()
    );
    assert_eq!(PANICS.load(Ordering::SeqCst), 0, "nothing panicked");
}

/// One test of this binary at a time (see the module doc).
async fn serial() -> tokio::sync::MutexGuard<'static, ()> {
    static SERIAL: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());
    SERIAL.lock().await
}

/// `/metrics` as the agent renders it, with this proxy's counters.
fn scrape(proxy: &shunt::proxy::Proxy) -> String {
    let node = shunt::metrics::NodeGauges {
        proxy: Some(proxy.stats()),
        ..Default::default()
    };
    shunt::metrics::Metrics::new().encode(Some(&node))
}

const END_HEADERS: u8 = 0x4;

/// One HTTP/2 frame.
fn h2_frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK: a literal field without indexing whose name is static-table
/// entry `index` (1 `:authority`, 2 `:method`), value under 127 bytes, no
/// Huffman coding.
fn hpack_literal(index: u8, value: &[u8]) -> Vec<u8> {
    let mut field = vec![index & 0x0f, value.len() as u8];
    field.extend_from_slice(value);
    field
}

/// A CONNECT's HEADERS frame with any `:authority` bytes (h2's client
/// refuses to send an invalid one; a hostile peer does not).
fn connect_frame(stream: u32, authority: &[u8], flags: u8) -> Vec<u8> {
    let mut block = hpack_literal(2, b"CONNECT");
    block.extend(hpack_literal(1, authority));
    h2_frame(0x1, flags, stream, &block)
}

/// HEADERS without END_HEADERS, its last field's value cut short, then
/// `count` one-byte CONTINUATION frames that never end the block.
fn continuation_flood(stream: u32, count: usize) -> Vec<u8> {
    let mut block = hpack_literal(2, b"CONNECT");
    // A new-name literal `x` whose value is 2,000 bytes (7-bit prefix 127,
    // then 1,873 as a varint): within the header list limit, so only the
    // frame count can stop it.
    block.extend_from_slice(&[0x00, 0x01, b'x', 0x7f, 0xd1, 0x0e]);
    let mut frames = h2_frame(0x1, 0, stream, &block);
    for _ in 0..count {
        frames.extend(h2_frame(0x9, 0, stream, b"a"));
    }
    frames
}

/// `count` CONNECT streams each reset by the client right after its
/// HEADERS, in one write: the rapid-reset attack.
fn rapid_reset(authority: &str, count: u32) -> Vec<u8> {
    let mut frames = Vec::new();
    for i in 0..count {
        let stream = 1 + 2 * i;
        frames.extend(connect_frame(stream, authority.as_bytes(), END_HEADERS));
        frames.extend(h2_frame(
            0x3,
            0,
            stream,
            &u32::from(h2::Reason::CANCEL).to_be_bytes(),
        ));
    }
    frames
}

/// Writes the client preface, an empty SETTINGS, an ACK of the server's,
/// and `frames`; reads the server's frames (`first` already read) until it
/// resets a stream or ends the connection with an error.
async fn raw_h2_case(
    mut tls: tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    first: Vec<u8>,
    frames: &[u8],
) -> Result<Expect, String> {
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(0x4, 0, 0, &[]));
    out.extend(h2_frame(0x4, 0x1, 0, &[]));
    out.extend_from_slice(frames);
    tls.write_all(&out)
        .await
        .map_err(|e| format!("write: {e}"))?;
    let mut got = first;
    let mut at = 0;
    let deadline = tokio::time::Instant::now() + Duration::from_secs(15);
    loop {
        while got.len() - at >= 9 {
            let head = &got[at..at + 9];
            let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
            if got.len() - at < 9 + len {
                break;
            }
            let kind = head[3];
            let payload = &got[at + 9..at + 9 + len];
            match kind {
                0x3 if len == 4 => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    return Ok(Expect::StreamReset(Some(code.into())));
                }
                0x7 if len >= 8 => {
                    let code = u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]);
                    if code != 0 {
                        return Ok(Expect::GoAway(code.into()));
                    }
                }
                _ => {}
            }
            at += 9 + len;
        }
        let mut buf = [0u8; 16 * 1024];
        match tokio::time::timeout_at(deadline, tls.read(&mut buf)).await {
            Err(_) => return Err("no RST_STREAM or GOAWAY in time".into()),
            Ok(Ok(0)) => return Err("closed without RST_STREAM or GOAWAY".into()),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => return Err(format!("read: {e}")),
        }
    }
}

/// A TLS connection from `from` to `target` with `config`.
async fn tls_from(
    m: &Mesh,
    from: &str,
    target: SocketAddr,
    config: Arc<ClientConfig>,
) -> tokio_rustls::client::TlsStream<tokio::net::TcpStream> {
    let tcp = m.connect_direct(from, target).await.expect("tcp");
    tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::IpAddress(target.ip().into()), tcp)
        .await
        .expect("tls")
}

/// The mesh of the limit tests: an outsider and another client on node-a,
/// the server (echo on 8080) on node-b.
async fn limits_mesh(name: &str, config: ProxyConfig) -> (Mesh, Arc<ClientConfig>) {
    let m = Mesh::new(
        name,
        vec![
            pod("node-a", "outsider", "legacy", false),
            pod("node-a", "other", "legacy", false),
            pod("node-b", "server", "httpbin", true),
        ],
        config,
        shunt::identity::IdentityConfig::default(),
    )
    .await;
    m.echo_server("server", 8080);
    let roots =
        TrustRoots::new(&shunt::identity::CertificateAuthority::roots(&*m.ca)).expect("roots");
    let good = good_client(&m.ca, &roots, &m.identity("server"));
    (m, good)
}

fn refusals(proxy: &shunt::proxy::Proxy, reason: &str) -> u64 {
    proxy.stats().refusals.get(reason).copied().unwrap_or(0)
}

/// The server's frames read so far, by what the test waits for.
#[derive(Default)]
struct Frames {
    /// Stream → the first byte of its response header block (0x88 is
    /// `:status 200`, HPACK's static entry 8).
    answered: std::collections::BTreeMap<u32, Option<u8>>,
    /// Stream → the reason of its RST_STREAM.
    reset: std::collections::BTreeMap<u32, h2::Reason>,
    /// Stream → DATA received, and whether it ended.
    data: std::collections::BTreeMap<u32, (Vec<u8>, bool)>,
}

/// Reads the server's frames into `frames` until `done` holds (bounded).
async fn read_frames(
    tls: &mut tokio_rustls::client::TlsStream<tokio::net::TcpStream>,
    pending: &mut Vec<u8>,
    frames: &mut Frames,
    done: impl Fn(&Frames) -> bool,
) -> Result<(), String> {
    let deadline = tokio::time::Instant::now() + Duration::from_secs(20);
    loop {
        while pending.len() >= 9 {
            let len = u32::from_be_bytes([0, pending[0], pending[1], pending[2]]) as usize;
            if pending.len() < 9 + len {
                break;
            }
            let (kind, flags) = (pending[3], pending[4]);
            let stream =
                u32::from_be_bytes([pending[5] & 0x7f, pending[6], pending[7], pending[8]]);
            let payload = pending[9..9 + len].to_vec();
            pending.drain(..9 + len);
            match kind {
                0x1 => {
                    frames.answered.insert(stream, payload.first().copied());
                }
                0x3 if len == 4 => {
                    let code = u32::from_be_bytes([payload[0], payload[1], payload[2], payload[3]]);
                    frames.reset.insert(stream, code.into());
                }
                0x0 => {
                    let entry = frames.data.entry(stream).or_default();
                    entry.0.extend_from_slice(&payload);
                    entry.1 |= flags & 0x1 != 0;
                }
                0x7 => return Err(format!("GOAWAY: {payload:?}")),
                _ => {}
            }
        }
        if done(frames) {
            return Ok(());
        }
        let mut buf = [0u8; 16 * 1024];
        match tokio::time::timeout_at(deadline, tls.read(&mut buf)).await {
            Err(_) => return Err("the awaited frames did not come in time".into()),
            Ok(Ok(0)) => return Err("the server closed the connection".into()),
            Ok(Ok(n)) => pending.extend_from_slice(&buf[..n]),
            Ok(Err(e)) => return Err(format!("read: {e}")),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_101st_concurrent_stream_is_refused_and_counted() {
    let _serial = serial().await;
    let (m, good) = limits_mesh("hbone-streams", ProxyConfig::default()).await;
    let proxy = &m.nodes["node-b"].proxy;
    let target = m.addr("server", 15008);
    let app = m.addr("server", 8080).to_string();
    let mut tls = tls_from(&m, "outsider", target, good).await;
    // The server's SETTINGS first (our ACK must follow it), then 101
    // CONNECTs at once: h2's own client would hold the 101st back, a
    // hostile one does not.
    let mut pending = Vec::new();
    let mut frames = Frames::default();
    let mut buf = [0u8; 16 * 1024];
    let n = tokio::time::timeout(Duration::from_secs(15), tls.read(&mut buf))
        .await
        .expect("server SETTINGS in time")
        .expect("read");
    pending.extend_from_slice(&buf[..n]);
    let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
    out.extend(h2_frame(0x4, 0, 0, &[]));
    out.extend(h2_frame(0x4, 0x1, 0, &[]));
    let streams: Vec<u32> = (0..101).map(|i| 1 + 2 * i).collect();
    for s in &streams {
        out.extend(connect_frame(*s, app.as_bytes(), END_HEADERS));
    }
    tls.write_all(&out).await.expect("write");
    let (first_100, last) = streams.split_at(100);
    let last = last[0];
    read_frames(&mut tls, &mut pending, &mut frames, |f| {
        f.reset.contains_key(&last) && first_100.iter().all(|s| f.answered.contains_key(s))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: answered {}, reset {:?}",
            frames.answered.len(),
            frames.reset
        )
    });
    assert_eq!(
        frames.reset.get(&last),
        Some(&h2::Reason::REFUSED_STREAM),
        "the 101st"
    );
    assert!(
        !frames.answered.contains_key(&last),
        "the 101st was answered"
    );
    for s in first_100 {
        assert_eq!(
            frames.answered.get(s),
            Some(&Some(0x88)),
            "stream {s} answered 200"
        );
        assert!(!frames.reset.contains_key(s), "stream {s} reset");
    }
    // The first 100, all open at once, each carry bytes.
    let mut out = Vec::new();
    for s in first_100 {
        out.extend(h2_frame(0x0, 0x1, *s, b"ping"));
    }
    tls.write_all(&out).await.expect("write");
    read_frames(&mut tls, &mut pending, &mut frames, |f| {
        first_100
            .iter()
            .all(|s| f.data.get(s).is_some_and(|(_, ended)| *ended))
    })
    .await
    .unwrap_or_else(|e| {
        panic!(
            "{e}: {} streams ended",
            frames.data.values().filter(|d| d.1).count()
        )
    });
    for s in first_100 {
        assert_eq!(frames.data[s].0, b"ping", "stream {s} echoed");
    }
    drop(tls);
    let counted = mesh::eventually(Duration::from_secs(10), || {
        let s = proxy.stats();
        s.active == 0 && s.inbound_hbone == 101 && s.refused == 1
    })
    .await;
    assert!(counted, "100 served and 1 refused: {:?}", proxy.stats());
    assert_eq!(refusals(proxy, "h2_refused_stream"), 1);
    let text = scrape(proxy);
    let line = "shunt_proxy_refusals_total{reason=\"h2_refused_stream\"} 1";
    assert!(
        text.lines().any(|l| l == line),
        "{line:?} missing in\n{text}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn connections_over_the_per_source_limit_are_refused_at_accept() {
    let _serial = serial().await;
    let config = ProxyConfig {
        limits: shunt::proxy::LimitsConfig {
            max_connections_per_source: 3,
            fd_reserve: 0,
        },
        // The held connections must outlive the test's steps.
        handshake_timeout: Duration::from_secs(120),
        ..ProxyConfig::default()
    };
    let (m, good) = limits_mesh("hbone-per-source", config).await;
    let proxy = &m.nodes["node-b"].proxy;
    let target = m.addr("server", 15008);
    let app = m.addr("server", 8080).to_string();

    let mut held = Vec::new();
    for _ in 0..3 {
        held.push(m.connect_direct("outsider", target).await.expect("tcp"));
    }
    // The kernel completes the fourth's handshake; the proxy resets it as
    // soon as it accepts it. The reset can land before connect() returns,
    // which then reports it.
    let fourth = match m.connect_direct("outsider", target).await {
        Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => Ok(0),
        Err(e) => panic!("the fourth connect failed otherwise: {e}"),
        Ok(mut fourth) => {
            let mut byte = [0u8; 1];
            tokio::time::timeout(Duration::from_secs(15), fourth.read(&mut byte))
                .await
                .expect("the fourth connection is closed by the proxy")
        }
    };
    assert!(
        matches!(fourth, Ok(0) | Err(_)),
        "the fourth connection got {fourth:?}"
    );
    let counted = mesh::eventually(Duration::from_secs(10), || {
        refusals(proxy, "source_limit") == 1
    })
    .await;
    assert!(counted, "refusal counted: {:?}", proxy.stats());
    // The held ones are still open (in their handshake): had the proxy
    // refused them, their resets would have come before the fourth's.
    for s in &held {
        let mut byte = [0u8; 1];
        match s.try_read(&mut byte) {
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {}
            other => panic!("a held connection was closed: {other:?}"),
        }
    }
    // Another source is not limited.
    let other = run_case_from(
        &m,
        "other",
        target,
        Client::Tls(good.clone(), Req::Connect(app.clone())),
    )
    .await;
    assert_eq!(other, Ok(Expect::Ok), "a client from another source");
    // A slot freed, the source gets through again.
    drop(held.pop());
    let mut again = Err(String::new());
    for _ in 0..50 {
        again = run_case_from(
            &m,
            "outsider",
            target,
            Client::Tls(good.clone(), Req::Connect(app.clone())),
        )
        .await;
        if again == Ok(Expect::Ok) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(again, Ok(Expect::Ok), "the source after closing one");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn rapid_reset_is_stopped_and_counted() {
    let _serial = serial().await;
    let (m, good) = limits_mesh("hbone-rapid-reset", ProxyConfig::default()).await;
    let proxy = &m.nodes["node-b"].proxy;
    let target = m.addr("server", 15008);
    let app = m.addr("server", 8080).to_string();
    let got = run_case(
        &m,
        target,
        Client::Tls(good.clone(), Req::Raw(rapid_reset(&app, 200))),
    )
    .await;
    assert_eq!(got, Ok(Expect::GoAway(h2::Reason::ENHANCE_YOUR_CALM)));
    let counted = mesh::eventually(Duration::from_secs(10), || {
        refusals(proxy, "h2_rapid_reset") == 1 && proxy.stats().active == 0
    })
    .await;
    assert!(counted, "rapid reset counted: {:?}", proxy.stats());
    // The proxy still serves.
    let after = run_case(&m, target, Client::Tls(good, Req::Connect(app))).await;
    assert_eq!(after, Ok(Expect::Ok));
}

/// A real agent whose hard open-files limit is 1,024: it raises its soft
/// limit (256) to it and says so; 1,000 idle handshakes from one client
/// (the per-source limit off, the handshake timeout 120 s so none is shed
/// by time) fill its fd table, yet a well-behaved client still gets
/// through: the oldest handshakes are shed to make room.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_good_client_gets_through_idle_handshakes_under_a_low_fd_limit() {
    let _serial = serial().await;
    agent_bed::raise_own_nofile();
    let args = [
        "--redirect",
        "iptables",
        "--max-connections-per-source",
        "0",
        "--handshake-timeout",
        "120",
    ];
    let mut bed = agent_bed::Bed::start("hbone-nofile", &args[2..]).await;
    bed.agent
        .restart_with_nofile((256, 1024), &args)
        .expect("restart under a low fd limit");
    bed.wait_enrolled();
    let logs = bed.agent.logs();
    assert!(
        logs.contains("open-files limit raised")
            && logs.contains("before=256")
            && logs.contains("soft=1024"),
        "the raise is logged with its figures:\n{logs}"
    );
    let ca = bed.ca();
    agent_bed::hbone_echo(&bed, &ca, &bed.good)
        .await
        .expect("before the idle handshakes");

    let flood_pod = bed.flood.clone();
    let hbone = bed.hbone();
    let idle = agent_bed::blocking(move || {
        flood_pod
            .run(move || {
                (0..1000)
                    .filter_map(|_| {
                        StdTcpStream::connect_timeout(&hbone, Duration::from_secs(5)).ok()
                    })
                    .collect::<Vec<_>>()
            })
            .expect("flood pod")
    })
    .await;
    assert!(!idle.is_empty(), "no idle connection could be opened");
    // The fd table reached the reserve: handshakes were shed to make room.
    let shed = agent_bed::eventually(Duration::from_secs(30), || {
        bed.refusals("handshake_evicted") > 0
    })
    .await;
    assert!(
        shed,
        "no handshake shed with {} idle connections (agent fds {})",
        idle.len(),
        bed.agent_fds()
    );
    // Well before any idle handshake times out, a good client gets through.
    let through = tokio::time::timeout(
        Duration::from_secs(60),
        agent_bed::hbone_echo(&bed, &ca, &bed.good),
    )
    .await;
    assert!(
        matches!(through, Ok(Ok(()))),
        "the good client: {through:?}; agent fds {}",
        bed.agent_fds()
    );
    let plaintext = tokio::time::timeout(
        Duration::from_secs(60),
        agent_bed::plaintext_echo(&bed, &bed.good),
    )
    .await;
    assert!(matches!(plaintext, Ok(Ok(()))), "plaintext: {plaintext:?}");
    assert!(bed.agent_fds() <= 1024);
    eprintln!(
        "nofile figures: {} idle connections opened, agent fds {}, handshakes shed {}, refused for fds {}",
        idle.len(),
        bed.agent_fds(),
        bed.refusals("handshake_evicted"),
        bed.refusals("fd_budget")
    );
    drop(idle);
}

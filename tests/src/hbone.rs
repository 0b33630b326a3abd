//! HBONE as the stand-ins speak it (the waypoint's, `waypoint.rs`, and
//! ztunnel's, `ztunnel.rs`): TLS 1.3 with the agent crate's own
//! configurations (`shunt::tls`: SPIFFE certificates both ways, ALPN h2),
//! one HTTP/2 CONNECT stream per connection with `:authority` the
//! destination `ip:port`, and the pumps that move bytes between such a
//! stream and another stream or a TCP socket.
//!
//! [`MeshCa`] issues the certificates for a stand-in that no agent serves
//! (the waypoint's come from an agent's `--ca-dir` instead).

use std::{sync::Arc, thread, time::Duration};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use http::{Method, Request, StatusCode};
use rustls_pki_types::ServerName;
use shunt::{
    identity::{
        CertificateAuthority, IdentityConfig, IdentityManager, WorkloadCert, ca::BuiltinCa,
    },
    state::{SpiffeId, TrustDomain},
    tls::{TrustRoots, client_config, server_config},
};
use tokio::{
    io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt},
    net::TcpStream,
};
use tokio_rustls::server::TlsStream;

use crate::{Result, TestbedError};

/// How long a handshake or a CONNECT answer may take.
const STEP: Duration = Duration::from_secs(20);

/// A server-side HBONE connection: accept its CONNECT streams with
/// `accept()` (which also drives the connection).
pub type ServerConnection = h2::server::Connection<TlsStream<TcpStream>, Bytes>;

/// A workload's HBONE credentials: its certificate and the mesh's roots.
#[derive(Clone)]
pub struct Credentials {
    pub cert: Arc<WorkloadCert>,
    pub roots: TrustRoots,
}

impl Credentials {
    pub fn identity(&self) -> &SpiffeId {
        self.cert.identity()
    }
}

/// A root CA of the default trust domain, in memory, for stand-ins that
/// no agent serves.
pub struct MeshCa {
    ca: Arc<BuiltinCa>,
}

impl MeshCa {
    pub fn generate() -> Result<MeshCa> {
        let (ca, _files) = BuiltinCa::generate(&TrustDomain::default())
            .map_err(|e| TestbedError::Invalid(format!("test CA: {e}")))?;
        Ok(MeshCa { ca: Arc::new(ca) })
    }

    /// The CA an agent keeps in `ca_dir` (its `--ca-dir`; an agent of the
    /// topology must have created it): certificates its peers accept.
    pub fn from_dir(ca_dir: &std::path::Path) -> Result<MeshCa> {
        let ca = BuiltinCa::load(ca_dir)
            .map_err(|e| TestbedError::Invalid(format!("CA in {}: {e}", ca_dir.display())))?
            .ok_or_else(|| {
                TestbedError::Invalid(format!(
                    "no CA in {} (start an agent first)",
                    ca_dir.display()
                ))
            })?;
        Ok(MeshCa { ca: Arc::new(ca) })
    }

    /// A certificate for `identity` issued by this CA (through the agent's
    /// identity manager, on a runtime of its own: callable from anywhere).
    pub fn credentials(&self, identity: &SpiffeId) -> Result<Credentials> {
        let ca: Arc<dyn CertificateAuthority> = self.ca.clone();
        let identity = identity.clone();
        thread::spawn(move || -> std::result::Result<Credentials, String> {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .map_err(|e| format!("runtime: {e}"))?;
            runtime.block_on(async move {
                let manager = IdentityManager::new(ca, IdentityConfig::default());
                manager.register(&identity);
                let cert = manager
                    .certificate(&identity)
                    .await
                    .map_err(|e| format!("certificate of {identity}: {e}"))?;
                let roots = TrustRoots::new(&manager.roots()).map_err(|e| format!("roots: {e}"))?;
                Ok(Credentials { cert, roots })
            })
        })
        .join()
        .map_err(|_| TestbedError::Invalid("test CA: issuing thread panicked".into()))?
        .map_err(TestbedError::Invalid)
    }
}

/// The server side of an HBONE connection on `tcp`: TLS presenting `cert`,
/// a client certificate of the default trust domain required, then the
/// HTTP/2 handshake. Returns the connection and the client's SPIFFE id.
pub async fn accept(
    tcp: TcpStream,
    cert: &WorkloadCert,
    roots: &TrustRoots,
) -> std::result::Result<(ServerConnection, Option<String>), String> {
    let tls_config =
        server_config(cert, roots, &TrustDomain::default()).map_err(|e| e.to_string())?;
    let tls = tokio::time::timeout(
        STEP,
        tokio_rustls::TlsAcceptor::from(tls_config).accept(tcp),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_string())?
    .map_err(|e| format!("TLS handshake: {e}"))?;
    let peer_identity = shunt::tls::peer_identity(tls.get_ref().1);
    let conn = h2::server::handshake(tls)
        .await
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
    Ok((conn, peer_identity))
}

/// The client side: TLS over `tcp` (connected to a peer's 15008)
/// presenting `cert` and accepting only a server that is `expected`, the
/// HTTP/2 handshake, one CONNECT to `authority` (`ip:port`, or
/// `hostname:port` as waypoints send). Returns the stream once the answer
/// is 200.
pub async fn connect(
    tcp: TcpStream,
    cert: &WorkloadCert,
    roots: &TrustRoots,
    expected: &SpiffeId,
    authority: impl std::fmt::Display,
) -> std::result::Result<(SendStream<Bytes>, RecvStream), String> {
    connect_with_headers(tcp, cert, roots, expected, authority, &[]).await
}

/// [`connect`], the CONNECT carrying `headers` too (e.g. `baggage`).
pub async fn connect_with_headers(
    tcp: TcpStream,
    cert: &WorkloadCert,
    roots: &TrustRoots,
    expected: &SpiffeId,
    authority: impl std::fmt::Display,
    headers: &[(&str, &str)],
) -> std::result::Result<(SendStream<Bytes>, RecvStream), String> {
    connect_to(tcp, cert, roots, expected, &authority.to_string(), headers).await
}

/// [`connect_with_headers`] to any `:authority`, e.g. a waypoint's
/// `hostname:port`. A refusal is `upstream answered <status>`.
pub async fn connect_to(
    tcp: TcpStream,
    cert: &WorkloadCert,
    roots: &TrustRoots,
    expected: &SpiffeId,
    authority: &str,
    headers: &[(&str, &str)],
) -> std::result::Result<(SendStream<Bytes>, RecvStream), String> {
    let (send, recv, _) = connect_answered(tcp, cert, roots, expected, authority, headers).await?;
    Ok((send, recv))
}

/// [`connect_to`], also returning the 200's headers (ztunnel's response
/// `baggage`).
pub async fn connect_answered(
    tcp: TcpStream,
    cert: &WorkloadCert,
    roots: &TrustRoots,
    expected: &SpiffeId,
    authority: &str,
    headers: &[(&str, &str)],
) -> std::result::Result<(SendStream<Bytes>, RecvStream, http::HeaderMap), String> {
    let peer = tcp.peer_addr().map_err(|e| e.to_string())?;
    let tls_config = client_config(cert, roots, expected).map_err(|e| e.to_string())?;
    let tls = tokio::time::timeout(
        STEP,
        tokio_rustls::TlsConnector::from(tls_config)
            .connect(ServerName::IpAddress(peer.ip().into()), tcp),
    )
    .await
    .map_err(|_| "TLS handshake timed out".to_string())?
    .map_err(|e| format!("TLS handshake with {peer}: {e}"))?;
    let tls = server_spoke(tls, peer).await?;
    let (send, connection) = h2::client::handshake(tls)
        .await
        .map_err(|e| format!("HTTP/2 handshake: {e}"))?;
    tokio::spawn(async move {
        let _ = connection.await;
    });
    let mut send = send.ready().await.map_err(|e| e.to_string())?;
    let mut request = Request::builder().method(Method::CONNECT).uri(authority);
    for (name, value) in headers {
        request = request.header(*name, *value);
    }
    let request = request.body(()).map_err(|e| e.to_string())?;
    let (response, stream) = send
        .send_request(request, false)
        .map_err(|e| e.to_string())?;
    let response = tokio::time::timeout(STEP, response)
        .await
        .map_err(|_| "CONNECT answer timed out".to_string())?
        .map_err(|e| e.to_string())?;
    if response.status() != StatusCode::OK {
        return Err(format!("upstream answered {}", response.status()));
    }
    let (parts, body) = response.into_parts();
    Ok((stream, body, parts.headers))
}

/// A client's TLS stream once the server has spoken: its first bytes (an
/// HTTP/2 server sends its SETTINGS at once), read before the client writes
/// anything, then handed back to the reader first. Why: in TLS 1.3 the
/// client's handshake ends before the server has checked the client's
/// certificate; a server that refuses it answers with an alert, and a
/// client that writes its preface first may meet the closed socket
/// (`broken pipe`) instead of reading that alert.
async fn server_spoke<S: AsyncRead + AsyncWrite + Unpin>(
    mut io: S,
    peer: std::net::SocketAddr,
) -> std::result::Result<impl AsyncRead + AsyncWrite + Unpin, String> {
    let mut first = vec![0u8; 16 * 1024];
    let n = tokio::time::timeout(STEP, io.read(&mut first))
        .await
        .map_err(|_| format!("{peer} said nothing after the TLS handshake"))?
        .map_err(|e| format!("TLS session with {peer}: {e}"))?;
    if n == 0 {
        return Err(format!("{peer} closed the TLS session at once"));
    }
    first.truncate(n);
    let (reader, writer) = tokio::io::split(io);
    Ok(tokio::io::join(
        std::io::Cursor::new(first).chain(reader),
        writer,
    ))
}

/// Sends `chunk` on `to` as flow control allows.
async fn send_all(to: &mut SendStream<Bytes>, mut chunk: Bytes) -> std::result::Result<(), String> {
    while !chunk.is_empty() {
        to.reserve_capacity(chunk.len());
        let granted = std::future::poll_fn(|cx| to.poll_capacity(cx))
            .await
            .ok_or_else(|| "stream closed".to_string())?
            .map_err(|e| e.to_string())?;
        let part = chunk.split_to(granted.min(chunk.len()));
        to.send_data(part, false).map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Moves one direction's bytes from an HTTP/2 stream to another, then
/// ends the sending stream.
pub async fn pump(
    mut from: RecvStream,
    mut to: SendStream<Bytes>,
) -> std::result::Result<(), String> {
    while let Some(chunk) = from.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = from.flow_control().release_capacity(chunk.len());
        send_all(&mut to, chunk).await?;
    }
    to.send_data(Bytes::new(), true).map_err(|e| e.to_string())
}

/// Moves bytes read from a socket onto a stream until the socket's EOF,
/// then ends the stream (END_STREAM: the half-close ztunnel passes on).
pub async fn pump_from_socket(
    mut from: impl AsyncRead + Unpin,
    mut to: SendStream<Bytes>,
) -> std::result::Result<(), String> {
    let mut buf = vec![0u8; 16 * 1024];
    loop {
        let n = from.read(&mut buf).await.map_err(|e| e.to_string())?;
        if n == 0 {
            break;
        }
        send_all(&mut to, Bytes::copy_from_slice(&buf[..n])).await?;
    }
    to.send_data(Bytes::new(), true).map_err(|e| e.to_string())
}

/// Moves a stream's bytes into a socket until END_STREAM, then half-closes
/// the socket.
pub async fn pump_to_socket(
    mut from: RecvStream,
    mut to: impl AsyncWrite + Unpin,
) -> std::result::Result<(), String> {
    while let Some(chunk) = from.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = from.flow_control().release_capacity(chunk.len());
        to.write_all(&chunk).await.map_err(|e| e.to_string())?;
    }
    to.shutdown().await.map_err(|e| e.to_string())
}

/// One HBONE stream from `node` to `hbone` (a pod's 15008) as `peer`,
/// expecting the server to be `server_id`, with CONNECT to `echo_at` (an
/// echo server): `Ok` when `ping` comes back, else why not (the handshake's
/// alert, the answer's status, the stream's end).
pub async fn ping_through(
    node: &crate::Node,
    hbone: std::net::SocketAddr,
    peer: &Credentials,
    server_id: &SpiffeId,
    echo_at: std::net::SocketAddr,
) -> std::result::Result<(), String> {
    let tcp = node.connect_tcp(hbone, STEP).map_err(|e| e.to_string())?;
    tcp.set_nonblocking(true).map_err(|e| e.to_string())?;
    let tcp = TcpStream::from_std(tcp).map_err(|e| e.to_string())?;
    let authority = echo_at.to_string();
    let (mut send, mut recv) =
        connect_to(tcp, &peer.cert, &peer.roots, server_id, &authority, &[]).await?;
    send.send_data(Bytes::from_static(b"ping"), false)
        .map_err(|e| e.to_string())?;
    let echoed = tokio::time::timeout(STEP, recv.data())
        .await
        .map_err(|_| "no echo in time".to_string())?
        .ok_or("stream ended")?
        .map_err(|e| e.to_string())?;
    (&echoed[..] == b"ping")
        .then_some(())
        .ok_or_else(|| format!("echoed {echoed:?}"))
}

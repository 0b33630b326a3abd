//! A stand-in waypoint for kernel tests of waypoint routing: what an Istio
//! waypoint's Envoy does on the wire, in a pod netns no agent enrols.
//!
//! - It is a real HBONE server on `podIP:15008`: TLS 1.3 presenting its own
//!   SPIFFE certificate, issued by the topology's CA (the agents' `--ca-dir`
//!   files), a client certificate of the mesh required, ALPN h2, HTTP/2
//!   CONNECT. It records every CONNECT's `:authority`, headers and the
//!   client's identity ([`Received`]).
//! - It forwards each stream as a real HBONE client with its own identity:
//!   it chooses the upstream for the authority itself (a service VIP's
//!   endpoint, or the pod the authority names), connects to its 15008,
//!   checks its certificate against the expected identity, sends CONNECT
//!   `endpointIP:port`, and relays bytes both ways.
//!
//! - As an east-west gateway ([`StandInWaypoint::start_gateway`]) it
//!   forwards a CONNECT whose `:authority` is one of its [`Tunnel`]s
//!   (`<service hostname>:<port>`, the outer CONNECT of double HBONE)
//!   unopened: the stream's bytes, the client's inner TLS, go over plain
//!   TCP to the tunnel's target (an endpoint's 15008), as Istio's
//!   east-west gateway passes them on.
//!
//! It uses the agent crate's TLS configurations (`shunt::tls`) and identity
//! manager, so it speaks HBONE exactly as the agents do. Dropping it (or
//! [`StandInWaypoint::stop`]) closes its listener: a waypoint that is down.

use std::{
    net::SocketAddr,
    path::Path,
    sync::{Arc, Mutex},
    thread,
    time::Duration,
};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use http::{Method, Request, Response, StatusCode};
use shunt::{
    identity::{IdentityConfig, IdentityManager, ca::BuiltinCa},
    state::SpiffeId,
    tls::TrustRoots,
};
use tokio::sync::oneshot;

use crate::{
    Pod, Result, TestbedError,
    hbone::{self, MeshCa, pump},
};

/// How long any step may take.
const STEP: Duration = Duration::from_secs(20);

/// Where the stand-in sends a CONNECT for `authority`: `target` (an
/// endpoint's `IP:port`), over HBONE to `target`'s IP:15008, expecting
/// `identity`.
#[derive(Clone, Debug)]
pub struct Upstream {
    pub authority: SocketAddr,
    pub target: SocketAddr,
    pub identity: SpiffeId,
}

/// An east-west gateway's route: a CONNECT for `authority`
/// (`hostname:port`) goes unopened to `target` over TCP.
#[derive(Clone, Debug)]
pub struct Tunnel {
    pub authority: String,
    pub target: SocketAddr,
}

/// One CONNECT the stand-in received.
#[derive(Clone, Debug)]
pub struct Received {
    pub authority: String,
    /// Every header, names lowercased, in order.
    pub headers: Vec<(String, String)>,
    /// The client's SPIFFE id (from its certificate).
    pub peer_identity: Option<String>,
    /// Whether the stream was forwarded and its upstream answered 200.
    pub forwarded: bool,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// A running stand-in waypoint.
pub struct StandInWaypoint {
    received: Arc<Mutex<Vec<Received>>>,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<thread::JoinHandle<()>>,
    identity: SpiffeId,
}

struct Config {
    pod: Pod,
    identity: SpiffeId,
    identities: IdentityManager,
    roots: TrustRoots,
    upstreams: Vec<Upstream>,
    tunnels: Vec<Tunnel>,
    received: Arc<Mutex<Vec<Received>>>,
}

impl StandInWaypoint {
    /// Starts serving HBONE on `pod`'s IP:15008 as `identity`, with a
    /// certificate from the CA in `ca_dir` (an agent of the topology must
    /// have created it), forwarding to `upstreams`. Returns once it
    /// listens and holds its certificate.
    pub fn start(
        pod: &Pod,
        ca_dir: &Path,
        identity: SpiffeId,
        upstreams: Vec<Upstream>,
    ) -> Result<StandInWaypoint> {
        Self::start_with(pod, ca_dir, identity, upstreams, Vec::new())
    }

    /// An east-west gateway on `pod`'s IP:15008 as `identity`: each CONNECT
    /// for one of `tunnels` goes unopened to its target.
    pub fn start_gateway(
        pod: &Pod,
        ca_dir: &Path,
        identity: SpiffeId,
        tunnels: Vec<Tunnel>,
    ) -> Result<StandInWaypoint> {
        Self::start_with(pod, ca_dir, identity, Vec::new(), tunnels)
    }

    fn start_with(
        pod: &Pod,
        ca_dir: &Path,
        identity: SpiffeId,
        upstreams: Vec<Upstream>,
        tunnels: Vec<Tunnel>,
    ) -> Result<StandInWaypoint> {
        let ca = BuiltinCa::load(ca_dir)
            .map_err(|e| TestbedError::Invalid(format!("stand-in waypoint: CA: {e}")))?
            .ok_or_else(|| {
                TestbedError::Invalid(format!(
                    "stand-in waypoint: no CA in {} (start an agent first)",
                    ca_dir.display()
                ))
            })?;
        let listen_addr = SocketAddr::new(pod.ip().into(), 15008);
        let listener = pod.listen_tcp(listen_addr)?;
        listener
            .set_nonblocking(true)
            .map_err(|e| TestbedError::io("stand-in waypoint: nonblocking listener", e))?;
        let received = Arc::new(Mutex::new(Vec::new()));
        let (stop_tx, stop_rx) = oneshot::channel();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel();
        let pod = pod.clone();
        let id = identity.clone();
        let rec = received.clone();
        let thread = thread::spawn(move || {
            let runtime = match tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
            {
                Ok(r) => r,
                Err(e) => {
                    let _ = ready_tx.send(Err(format!("runtime: {e}")));
                    return;
                }
            };
            runtime.block_on(async move {
                let identities = IdentityManager::new(Arc::new(ca), IdentityConfig::default());
                identities.register(&id);
                let roots = match TrustRoots::new(&identities.roots()) {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("roots: {e}")));
                        return;
                    }
                };
                if let Err(e) = identities.certificate(&id).await {
                    let _ = ready_tx.send(Err(format!("certificate: {e}")));
                    return;
                }
                let listener = match tokio::net::TcpListener::from_std(listener) {
                    Ok(l) => l,
                    Err(e) => {
                        let _ = ready_tx.send(Err(format!("listener: {e}")));
                        return;
                    }
                };
                let config = Arc::new(Config {
                    pod,
                    identity: id,
                    identities,
                    roots,
                    upstreams,
                    tunnels,
                    received: rec,
                });
                let _ = ready_tx.send(Ok(()));
                tokio::select! {
                    _ = stop_rx => {}
                    () = accept_loop(listener, config) => {}
                }
            });
            // Dropping the runtime ends every connection of the stand-in.
        });
        match ready_rx.recv_timeout(STEP) {
            Ok(Ok(())) => Ok(StandInWaypoint {
                received,
                stop: Some(stop_tx),
                thread: Some(thread),
                identity,
            }),
            Ok(Err(e)) => Err(TestbedError::Invalid(format!("stand-in waypoint: {e}"))),
            Err(e) => Err(TestbedError::Invalid(format!(
                "stand-in waypoint did not start: {e}"
            ))),
        }
    }

    pub fn identity(&self) -> &SpiffeId {
        &self.identity
    }

    /// Every CONNECT received so far.
    pub fn received(&self) -> Vec<Received> {
        self.received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    /// Stops it: the listener closes and its connections end (a waypoint
    /// that is down).
    pub fn stop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

impl Drop for StandInWaypoint {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Config {
    /// Records that CONNECT number `index` was forwarded (answered 200).
    fn mark_forwarded(&self, index: usize) {
        if let Some(r) = self
            .received
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get_mut(index)
        {
            r.forwarded = true;
        }
    }
}

/// A TCP connection from `pod`'s netns to `to`, ready for tokio.
async fn connect_from(
    pod: &Pod,
    to: SocketAddr,
) -> std::result::Result<tokio::net::TcpStream, String> {
    let pod = pod.clone();
    let tcp = tokio::task::spawn_blocking(move || pod.connect_tcp(to, STEP))
        .await
        .map_err(|e| e.to_string())?
        .map_err(|e| format!("connect {to}: {e}"))?;
    tcp.set_nonblocking(true).map_err(|e| e.to_string())?;
    tokio::net::TcpStream::from_std(tcp).map_err(|e| e.to_string())
}

async fn accept_loop(listener: tokio::net::TcpListener, config: Arc<Config>) {
    loop {
        let Ok((tcp, _)) = listener.accept().await else {
            continue;
        };
        let config = config.clone();
        tokio::spawn(async move {
            if let Err(e) = serve_connection(tcp, config).await {
                crate::warn(format_args!("stand-in waypoint: connection: {e}"));
            }
        });
    }
}

async fn serve_connection(
    tcp: tokio::net::TcpStream,
    config: Arc<Config>,
) -> std::result::Result<(), String> {
    let cert = config
        .identities
        .certificate(&config.identity)
        .await
        .map_err(|e| e.to_string())?;
    let (mut conn, peer_identity) = hbone::accept(tcp, &cert, &config.roots).await?;
    while let Some(request) = conn.accept().await {
        let (request, respond) = request.map_err(|e| format!("HTTP/2: {e}"))?;
        let config = config.clone();
        let peer_identity = peer_identity.clone();
        tokio::spawn(async move {
            serve_stream(request, respond, config, peer_identity).await;
        });
    }
    Ok(())
}

async fn serve_stream(
    request: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    config: Arc<Config>,
    peer_identity: Option<String>,
) {
    let authority = request
        .uri()
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let headers = request
        .headers()
        .iter()
        .map(|(n, v)| {
            (
                n.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect();
    let index = {
        let mut received = config.received.lock().unwrap_or_else(|p| p.into_inner());
        received.push(Received {
            authority: authority.clone(),
            headers,
            peer_identity,
            forwarded: false,
        });
        received.len() - 1
    };
    let tunnel = config
        .tunnels
        .iter()
        .find(|t| t.authority == authority)
        .cloned();
    if let (Some(tunnel), true) = (tunnel, request.method() == Method::CONNECT) {
        return tunnel_stream(request, respond, &config, &tunnel, index).await;
    }
    let upstream = authority
        .parse::<SocketAddr>()
        .ok()
        .and_then(|a| config.upstreams.iter().find(|u| u.authority == a).cloned());
    let answer = |status| Response::builder().status(status).body(()).ok();
    let (Some(upstream), true) = (upstream, request.method() == Method::CONNECT) else {
        if let Some(response) = answer(StatusCode::SERVICE_UNAVAILABLE) {
            let _ = respond.send_response(response, true);
        }
        return;
    };
    let (to_upstream, from_upstream) = match connect_upstream(&config, &upstream).await {
        Ok(pair) => pair,
        Err(e) => {
            crate::warn(format_args!(
                "stand-in waypoint: upstream {}: {e}",
                upstream.target
            ));
            if let Some(response) = answer(StatusCode::SERVICE_UNAVAILABLE) {
                let _ = respond.send_response(response, true);
            }
            return;
        }
    };
    let Some(response) = answer(StatusCode::OK) else {
        return;
    };
    let Ok(to_client) = respond.send_response(response, false) else {
        return;
    };
    config.mark_forwarded(index);
    let from_client = request.into_body();
    let _ = tokio::join!(
        pump(from_client, to_upstream),
        pump(from_upstream, to_client)
    );
}

/// An east-west gateway's stream: TCP from the gateway pod to the
/// tunnel's target, 200, then the stream's bytes both ways unopened.
async fn tunnel_stream(
    request: Request<RecvStream>,
    mut respond: h2::server::SendResponse<Bytes>,
    config: &Config,
    tunnel: &Tunnel,
    index: usize,
) {
    let target = tunnel.target;
    let tcp = connect_from(&config.pod, target).await;
    let status = if tcp.is_ok() {
        StatusCode::OK
    } else {
        StatusCode::SERVICE_UNAVAILABLE
    };
    let Ok(response) = Response::builder().status(status).body(()) else {
        return;
    };
    let tcp = match tcp {
        Ok(tcp) => tcp,
        Err(e) => {
            crate::warn(format_args!("stand-in gateway: tunnel {target}: {e}"));
            let _ = respond.send_response(response, true);
            return;
        }
    };
    let Ok(to_client) = respond.send_response(response, false) else {
        return;
    };
    config.mark_forwarded(index);
    let (read, write) = tcp.into_split();
    let _ = tokio::join!(
        hbone::pump_to_socket(request.into_body(), write),
        hbone::pump_from_socket(read, to_client)
    );
}

/// A CONNECT stream to `upstream` over a new HBONE connection from the
/// waypoint pod.
async fn connect_upstream(
    config: &Config,
    upstream: &Upstream,
) -> std::result::Result<(SendStream<Bytes>, RecvStream), String> {
    let hbone = SocketAddr::new(upstream.target.ip(), 15008);
    let tcp = connect_from(&config.pod, hbone).await?;
    let cert = config
        .identities
        .certificate(&config.identity)
        .await
        .map_err(|e| e.to_string())?;
    hbone::connect(
        tcp,
        &cert,
        &config.roots,
        &upstream.identity,
        upstream.target,
    )
    .await
}

/// One CONNECT from `pod`, a client no agent knows (in no workloads file,
/// not enrolled), to `target` over HBONE (its IP's port 15008) as
/// `identity` (a certificate from the CA in `ca_dir`), expecting the
/// destination's identity `expected`, with `headers` (e.g. `baggage`).
/// Sends `payload`, ends its side and returns what came back (an echo
/// server answers the payload).
pub fn hbone_exchange(
    pod: &Pod,
    ca_dir: &Path,
    (identity, expected): (&SpiffeId, &SpiffeId),
    target: SocketAddr,
    headers: &[(&str, &str)],
    payload: &[u8],
) -> Result<Vec<u8>> {
    let credentials = MeshCa::from_dir(ca_dir)?.credentials(identity)?;
    let tcp = pod.connect_tcp(SocketAddr::new(target.ip(), 15008), STEP)?;
    tcp.set_nonblocking(true)
        .map_err(|e| TestbedError::io("HBONE client: nonblocking socket", e))?;
    let expected = expected.clone();
    let headers: Vec<(String, String)> = headers
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_string()))
        .collect();
    let payload = Bytes::copy_from_slice(payload);
    let exchange = thread::spawn(move || -> std::result::Result<Vec<u8>, String> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| format!("runtime: {e}"))?;
        runtime.block_on(async move {
            let tcp = tokio::net::TcpStream::from_std(tcp).map_err(|e| e.to_string())?;
            let headers: Vec<(&str, &str)> = headers
                .iter()
                .map(|(n, v)| (n.as_str(), v.as_str()))
                .collect();
            let (mut send, mut recv) = hbone::connect_with_headers(
                tcp,
                &credentials.cert,
                &credentials.roots,
                &expected,
                target,
                &headers,
            )
            .await?;
            let want = payload.len();
            send.send_data(payload, true).map_err(|e| e.to_string())?;
            let mut got = Vec::new();
            while got.len() < want {
                match tokio::time::timeout(STEP, recv.data()).await {
                    Ok(Some(Ok(chunk))) => {
                        let _ = recv.flow_control().release_capacity(chunk.len());
                        got.extend_from_slice(&chunk);
                    }
                    Ok(Some(Err(e))) => return Err(format!("reading the answer: {e}")),
                    Ok(None) => break,
                    Err(_) => return Err("the answer timed out".into()),
                }
            }
            Ok(got)
        })
    });
    exchange
        .join()
        .map_err(|_| TestbedError::Invalid("HBONE client thread panicked".into()))?
        .map_err(|e| TestbedError::Invalid(format!("HBONE client to {target}: {e}")))
}

/// The workloads-file entries of the waypoint tests' mesh: the service
/// `web` (port 80 → 8080, endpoint `server`) bound to the waypoint, the
/// waypoint's own service (port 15008, endpoint `waypoint`), and the
/// waypoint itself serving `for_` (`service`, `workload` or `all`).
pub fn web_behind_waypoint(
    web_vip: std::net::Ipv4Addr,
    waypoint_vip: std::net::Ipv4Addr,
    for_: &str,
) -> String {
    format!(
        "services:
  - name: web
    namespace: default
    clusterIPs: [\"{web_vip}\"]
    ports: [{{port: 80, targetPort: 8080}}]
    endpoints: [server]
    labels: {{istio.io/use-waypoint: waypoint}}
  - name: waypoint
    namespace: default
    clusterIPs: [\"{waypoint_vip}\"]
    ports: [{{port: 15008}}]
    endpoints: [waypoint]
waypoints:
  - name: waypoint
    namespace: default
    for: {for_}
"
    )
}

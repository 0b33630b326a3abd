//! Outbound (127.0.0.1:15001 in the pod's netns): what a pod's application
//! connects to, after redirection.
//!
//! The original destination decides the path. A destination bound to a
//! waypoint (a service VIP whose service has one, a pod IP whose workload
//! has one) goes over HBONE to the waypoint, `:authority` the original
//! destination, or fails when the waypoint cannot be used (`waypoint.rs`).
//! Otherwise a service's VIP and port is first resolved to one of its ready endpoints (round robin), at the
//! endpoint's target port (an endpoint known by DNS name is resolved then:
//! `on_demand_dns.rs`); a VIP with no ready endpoint is refused (RST),
//! as there is nowhere to send it. Then a mesh workload gets HBONE to its
//! IP:15008 (presenting the source pod's identity, accepting only the
//! destination's, `:authority` the endpoint's IP and port), anything else
//! plain TCP from the pod's own netns. Same-node destinations take the HBONE
//! path too, so the inbound checks apply to them as well. Every CONNECT
//! carries ztunnel's `baggage`, `forwarded` and `traceparent` headers.

use std::{
    net::SocketAddr,
    sync::{Arc, atomic::Ordering},
    time::{Duration, Instant},
};

use bytes::Bytes;
use h2::client::SendRequest;
use http::{HeaderMap, Method, Request, StatusCode};
use rustls_pki_types::ServerName;
use shunt_common::PORT_HBONE;
use tokio::net::TcpStream;
use tracing::Instrument;

use crate::state::Service;

use super::{
    AccessLog, Failure, Outcome, PROXY_PORTS, PodState, Shared,
    h2::H2Stream,
    lookup::{NoEndpoint, Target},
    pool::{PoolKey, StreamGuard},
    reset,
    waypoint::{self, Bound, FailureReason, Route, WaypointFailure, WaypointHop},
};

/// Why an outbound HBONE stream could not be set up.
#[derive(Debug, thiserror::Error)]
pub(crate) enum OutboundError {
    #[error("no certificate for the source identity: {0}")]
    Identity(#[from] crate::identity::IdentityError),
    #[error("TLS configuration: {0}")]
    TlsConfig(#[from] crate::tls::TlsConfigError),
    #[error("connecting to {addr}: {source}")]
    Connect {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("TLS handshake with {addr}: {source}")]
    Handshake {
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("{addr} did not negotiate ALPN h2")]
    NoH2 { addr: SocketAddr },
    #[error("HTTP/2: {0}")]
    H2(#[from] h2::Error),
    #[error("{what} timed out after {after:?}")]
    Timeout { what: &'static str, after: Duration },
    #[error("the peer answered {0}")]
    Status(StatusCode),
    #[error("CONNECT authority {authority:?}: {reason}")]
    Authority { authority: String, reason: String },
}

impl OutboundError {
    /// What ztunnel's metrics call this failure, where they name it apart
    /// from a plain `CONNECT`.
    pub(super) fn failure(&self) -> Option<Failure> {
        match self {
            OutboundError::Identity(_) => Some(Failure::NoCertificate),
            OutboundError::TlsConfig(_) => Some(Failure::TlsConfig),
            // ztunnel's pool: a connect to 15008 that timed out.
            OutboundError::Connect { source, .. }
                if source.kind() == std::io::ErrorKind::TimedOut =>
            {
                Some(Failure::HbonePortTimedOut)
            }
            OutboundError::H2(_) | OutboundError::NoH2 { .. } => Some(Failure::Http2),
            _ => None,
        }
    }
}

pub(super) async fn serve(
    shared: Arc<Shared>,
    pod: Arc<PodState>,
    stream: TcpStream,
    peer: SocketAddr,
) {
    // Debug level: an enabled span is entered and left on every poll of the
    // connection (per transaction), and the access line names the pod.
    let span = tracing::debug_span!("outbound", pod = %pod.key, src = %peer);
    serve_inner(shared, pod, stream, peer)
        .instrument(span)
        .await
}

async fn serve_inner(shared: Arc<Shared>, pod: Arc<PodState>, stream: TcpStream, peer: SocketAddr) {
    let started = Instant::now();
    let mut log = AccessLog {
        src_identity: Some(pod.identity.as_str()),
        started,
        pod: Some(&pod.key),
        ..AccessLog::new("outbound", peer, peer)
    };
    let (mut app, dst) = match shared.original_dst_of(stream) {
        Ok(pair) => pair,
        Err(reason) => {
            log.reason = Some(reason);
            log.emit(&shared);
            return;
        }
    };
    // Waypoints first: they take the original destination, untranslated.
    let n = shared.service_picks.fetch_add(1, Ordering::Relaxed);
    let client = client_ip(&pod, peer);
    let waypoint::Plan { route, baggage } =
        shared
            .workloads
            .waypoint_plan(&shared.config.trust_domain, &pod.key, client, dst, n);
    let service = shared.workloads.service_at(dst, &pod.key.namespace);
    let headers = waypoint::connect_headers(
        baggage.as_deref(),
        SocketAddr::new(client, peer.port()),
        service.as_deref().map(|s| s.hostname.as_str()),
    );
    // What is only needed to open the stream is dropped (or moved into
    // `hbone`, which drops it) before the first await: anything still in
    // scope would stay allocated for the connection's whole life.
    drop(baggage);
    match route {
        Route::Direct => {}
        Route::ViaWaypoint(hop) => {
            drop(service);
            return via_waypoint(&shared, &pod, app, hop, headers, log).await;
        }
        Route::ThroughGateway(hop) => {
            log.dst_service = service.as_ref().map(|s| s.id());
            drop(service);
            return super::double_hbone::serve(&shared, &pod, app, hop, headers, log).await;
        }
        Route::Fail(failure) => {
            refuse_for_waypoint(&shared, &failure, &mut log, dst);
            reset(&app);
            return;
        }
    }
    let (dst, by_name) = match resolve_service(&shared, service, client, dst, n, &mut log) {
        Some(Target::Direct(dst)) => (dst, false),
        Some(Target::ThroughGateway(hop)) => {
            return super::double_hbone::serve(&shared, &pod, app, hop, headers, log).await;
        }
        Some(Target::Resolve(named)) => {
            match super::on_demand_dns::resolve(&shared, &pod, &named, dst, &mut log).await {
                Some(resolved) => (resolved, true),
                None => {
                    log.emit(&shared);
                    reset(&app);
                    return;
                }
            }
        }
        None => {
            log.emit(&shared);
            reset(&app);
            return;
        }
    };
    log.dst_addr = dst;
    // Redirected to ourselves would loop forever.
    if dst.ip().is_loopback() && PROXY_PORTS.contains(&dst.port()) {
        log.early = true;
        log.reason = Some("destination is the proxy itself".into());
        log.emit(&shared);
        return;
    }

    // An endpoint known by name is dialled as ztunnel dials one istiod
    // sends without a tunnel (a ServiceEntry's), whoever owns the address
    // it resolved to. Limitation: one sent with HBONE (a WorkloadEntry by
    // name) is dialled in plaintext too.
    let mesh_peer = if by_name {
        None
    } else {
        shared
            .workloads
            .workload_by_ip(dst.ip())
            .filter(|w| w.wants_mesh())
    };
    let Some(workload) = mesh_peer else {
        passthrough(&shared, &pod, app, dst, log).await;
        return;
    };
    let dst_identity = workload.identity(&shared.config.trust_domain);
    drop(workload);
    log.dst_identity = Some(dst_identity.as_str());
    let key = PoolKey {
        src: pod.identity.clone(),
        dst: dst_identity.clone(),
        dst_ip: dst.ip(),
        port: PORT_HBONE,
        also_accept: Vec::new(),
    };
    if let Err(e) = hbone(&shared, &pod, &mut app, key, dst, headers, &mut log).await {
        log.outcome = match e {
            OutboundError::Status(_) => Outcome::Refused,
            _ => Outcome::Failed,
        };
        log.failure = e.failure();
        log.reason = Some(e.to_string());
        log.emit(&shared);
        reset(&app);
    }
}

/// The client's address as the mesh knows it: the app's socket address
/// (connect4 binds a redirected socket to the pod's own), unless that is
/// loopback (the application bound it there itself), then the pod's own
/// address of the same family (`forwarded: for=`).
fn client_ip(pod: &PodState, peer: SocketAddr) -> std::net::IpAddr {
    if !peer.ip().is_loopback() {
        return peer.ip();
    }
    pod.ips
        .iter()
        .find(|ip| ip.is_ipv4() == peer.is_ipv4())
        .or(pod.ips.first())
        .copied()
        .unwrap_or(peer.ip())
}

/// Over HBONE to a waypoint: `:authority` the original destination, the
/// waypoint's identity checked. An unreachable waypoint fails the
/// connection (counted, logged with the service's or workload's name);
/// nothing goes around it.
async fn via_waypoint(
    shared: &Shared,
    pod: &PodState,
    mut app: TcpStream,
    hop: WaypointHop,
    headers: HeaderMap,
    mut log: AccessLog<'_>,
) {
    log.dst_addr = hop.authority;
    // As ztunnel's metrics and line: the destination is the waypoint.
    log.dst_workload = Some(hop.waypoint.clone());
    if hop.bound == Bound::Service {
        log.dst_service = Some(hop.target.clone());
    }
    log.dst_identity = Some(hop.identity.as_str());
    tracing::debug!(target_ = %hop.target, bound = hop.bound.as_str(), waypoint = %hop.waypoint, gateway = %hop.gateway, authority = %hop.authority, "via waypoint");
    let key = PoolKey {
        src: pod.identity.clone(),
        dst: hop.identity.clone(),
        dst_ip: hop.gateway.ip(),
        port: hop.gateway.port(),
        also_accept: hop.also_accept.clone(),
    };
    if let Err(e) = hbone(shared, pod, &mut app, key, hop.authority, headers, &mut log).await {
        let failure = WaypointFailure {
            bound: hop.bound,
            target: hop.target.clone(),
            reason: FailureReason::Unreachable,
            detail: format!("waypoint {} at {}: {e}", hop.waypoint, hop.gateway),
        };
        refuse_for_waypoint(shared, &failure, &mut log, hop.authority);
        reset(&app);
    }
}

/// Counts, logs (warning naming the service or workload) and writes the
/// access line of a connection refused for its waypoint.
fn refuse_for_waypoint(
    shared: &Shared,
    failure: &WaypointFailure,
    log: &mut AccessLog<'_>,
    dst: SocketAddr,
) {
    shared.waypoint_failures.count(failure);
    tracing::warn!(
        namespace = %failure.target.namespace,
        name = %failure.target.name,
        bound = failure.bound.as_str(),
        reason = failure.reason.as_str(),
        %dst,
        detail = %failure.detail,
        "connection refused: its waypoint cannot be used (never bypassed)"
    );
    if failure.bound == Bound::Service {
        log.dst_service = Some(failure.target.clone());
    }
    log.dst_addr = dst;
    // A waypoint that could not be chosen is ztunnel's early deny (no TCP
    // metrics); one chosen but unreachable is a failed connection.
    log.early = failure.reason != FailureReason::Unreachable;
    log.outcome = match failure.reason {
        FailureReason::Unreachable => Outcome::Failed,
        _ => Outcome::Refused,
    };
    log.reason = Some(failure.to_string());
    log.emit(shared);
}

/// Opens a CONNECT stream to `authority` over the pool of `key` and relays
/// `app` over it, writing the access line. An error before the stream is
/// up is returned for the caller to report (nothing written yet).
#[allow(clippy::too_many_arguments)]
async fn hbone(
    shared: &Shared,
    pod: &PodState,
    app: &mut TcpStream,
    key: PoolKey,
    authority: SocketAddr,
    headers: HeaderMap,
    log: &mut AccessLog<'_>,
) -> Result<(), OutboundError> {
    // Boxed, and so freed once the stream is open: opening it may take a
    // TLS and an HTTP/2 handshake, kilobytes of state that would otherwise
    // stay in the connection's task for its whole life (a future keeps
    // room for its largest state); see `task_sizes_tests.rs`. The key and
    // the headers go with it: the relay needs neither.
    let authority = authority.to_string();
    let opened = Box::pin(open_stream(shared, pod, &key, &authority, &headers)).await;
    drop((key, headers));
    let (mut h2s, guard) = opened?;
    let cut = super::cut_by_revocation(guard.conn.cert_revoked.as_ref());
    relay_logged(shared, app, &mut h2s, log, cut).await;
    Ok(())
}

/// Reports `app`'s connection open, relays it over `h2s` until both
/// directions end or `cut` resolves (the HBONE connection's peer revoked:
/// `proxy::cut_by_revocation`), and writes its access line (a failure
/// resets both sides).
pub(super) async fn relay_logged(
    shared: &Shared,
    app: &mut TcpStream,
    h2s: &mut H2Stream,
    log: &mut AccessLog<'_>,
    cut: impl Future<Output = ()>,
) {
    log.open(shared);
    // Polled only once it fired, not per relayed read.
    let cut = super::on_wake::OnWake::new(cut);
    let meter = super::observe::Meter::initiator_first(log.observed.as_deref());
    let relayed = tokio::select! {
        // The cut first: the connection's end, which follows it, must not
        // read as a plain failure.
        biased;
        () = cut => {
            h2s.reset(h2::Reason::CANCEL);
            reset(app);
            log.outcome = Outcome::Revoked;
            log.reason = Some(super::CERT_REVOKED.into());
            log.emit(shared);
            return;
        }
        relayed = super::relay::relay(app, h2s, meter) => relayed,
    };
    match relayed {
        Ok((sent, received)) => {
            log.bytes_sent = sent;
            log.bytes_received = received;
            log.outcome = Outcome::Success;
        }
        Err(e) => {
            h2s.reset(h2::Reason::CANCEL);
            reset(app);
            log.outcome = Outcome::Failed;
            log.reason = Some(e.to_string());
        }
    }
    log.emit(shared);
}

/// Where a connection to `dst` goes: `dst` itself, or, when it is a
/// service's VIP and port, one of its ready endpoints in turn (`n` counts
/// connections; named in the log), directly or through another network's
/// gateway. `None` when the service has no endpoint to take it (the log
/// says why).
fn resolve_service(
    shared: &Shared,
    service: Option<Arc<Service>>,
    client: std::net::IpAddr,
    dst: SocketAddr,
    n: usize,
    log: &mut AccessLog<'_>,
) -> Option<Target> {
    let Some(service) = service else {
        return Some(Target::Direct(dst));
    };
    log.dst_service = Some(service.id());
    if service.is_passthrough() {
        // Load-balancing mode PASSTHROUGH: no endpoint choice.
        return Some(Target::Direct(dst));
    }
    match shared
        .workloads
        .pick_endpoint(&shared.config.trust_domain, &service, client, dst, n)
    {
        Ok(target) => {
            tracing::debug!(service = %service.key(), vip = %dst, ?target, "service endpoint chosen");
            Some(target)
        }
        Err(why) => {
            // ztunnel: "no healthy upstream", or no valid destination for
            // an endpoint on another network without a gateway.
            let why = match why {
                NoEndpoint::NoneReady => "no ready endpoint".to_owned(),
                NoEndpoint::NotForThisClient => {
                    "no ready endpoint its load balancing allows this client".to_owned()
                }
                NoEndpoint::OnOtherNetworks(why) => why,
            };
            tracing::warn!(service = %service.key(), vip = %dst, "service has {why}; connection refused");
            log.early = true;
            log.dst_addr = dst;
            log.reason = Some(format!("service {} has {why} for {dst}", service.key()));
            None
        }
    }
}

async fn passthrough(
    shared: &Shared,
    pod: &PodState,
    mut app: TcpStream,
    dst: SocketAddr,
    mut log: AccessLog<'_>,
) {
    log.direction = "passthrough";
    // Boxed for the same reason as `open_stream` in `hbone`.
    let mut upstream = match Box::pin(pod.sockets.connect(dst, shared.config.connect_timeout)).await
    {
        Ok(s) => s,
        Err(e) => {
            log.outcome = Outcome::Failed;
            log.reason = Some(format!("connect to {dst}: {e}"));
            log.emit(shared);
            reset(&app);
            return;
        }
    };
    log.open(shared);
    let meter = super::observe::Meter::initiator_first(log.observed.as_deref());
    match super::relay::relay_tcp(&mut app, &mut upstream, meter).await {
        Ok((sent, received)) => {
            log.bytes_sent = sent;
            log.bytes_received = received;
            log.outcome = Outcome::Success;
        }
        Err(e) => {
            reset(&app);
            reset(&upstream);
            log.outcome = Outcome::Failed;
            log.reason = Some(e.to_string());
        }
    }
    log.emit(shared);
}

/// A CONNECT stream to `dst` over a pooled connection (opening one when
/// none has room). A pooled connection that fails before the stream exists
/// (GOAWAY, dead peer) is dropped and the stream retried once on a new one.
pub(super) async fn open_stream(
    shared: &Shared,
    pod: &PodState,
    key: &PoolKey,
    authority: &str,
    headers: &HeaderMap,
) -> Result<(H2Stream, StreamGuard), OutboundError> {
    let max = shared.config.h2.max_streams_per_connection;
    let mut last_err = None;
    for _attempt in 0..2 {
        let (send, guard) = match pod.pool.checkout(key, max) {
            Some(slot) => slot,
            None => {
                let _connecting = pod.pool.connect_lock(key).await;
                match pod.pool.checkout(key, max) {
                    Some(slot) => slot,
                    None => connect(shared, pod, key).await?,
                }
            }
        };
        match connect_stream(shared, send, authority, headers).await {
            Ok((h2s, _)) => return Ok((h2s, guard)),
            // A refusal is the peer's answer: retrying would get the same.
            Err(e @ OutboundError::Status(_)) => return Err(e),
            Err(e) => {
                tracing::debug!(conn = guard.conn.id, error = %e, "pooled connection failed; retrying on a new one");
                guard.conn.mark_closed();
                last_err = Some(e);
            }
        }
    }
    Err(last_err.unwrap_or(OutboundError::Timeout {
        what: "opening a stream",
        after: Duration::ZERO,
    }))
}

/// A CONNECT to `authority` (`IP:port`, or `hostname:port` through a
/// network gateway) on `send`'s connection, answered 200; and the
/// answer's headers (a peer's `baggage` naming its workload).
pub(super) async fn connect_stream(
    shared: &Shared,
    send: SendRequest<Bytes>,
    authority: &str,
    headers: &HeaderMap,
) -> Result<(H2Stream, HeaderMap), OutboundError> {
    let timeout = shared.config.connect_response_timeout;
    let timed_out = |what| OutboundError::Timeout {
        what,
        after: timeout,
    };
    // Waits for the peer's concurrency limit, if it has one.
    let mut send = crate::timers::timeout(timeout, send.ready())
        .await
        .map_err(|_| timed_out("waiting for a stream slot"))??;
    // Only :method and :authority (h2 omits :scheme and :path for CONNECT);
    // ztunnel resets a CONNECT carrying either. Then ztunnel's headers
    // (baggage, forwarded, traceparent).
    let mut request = Request::builder()
        .method(Method::CONNECT)
        .uri(authority)
        .body(())
        .map_err(|e| OutboundError::Authority {
            authority: authority.to_owned(),
            reason: e.to_string(),
        })?;
    request.headers_mut().extend(headers.clone());
    let (response, send_stream) = send.send_request(request, false)?;
    let response = crate::timers::timeout(timeout, response)
        .await
        .map_err(|_| timed_out("waiting for the CONNECT answer"))??;
    if response.status() != StatusCode::OK {
        return Err(OutboundError::Status(response.status()));
    }
    let (parts, body) = response.into_parts();
    Ok((H2Stream::new(send_stream, body), parts.headers))
}

/// An HBONE client connection, handshaken.
pub(super) struct Handshaken<IO, R> {
    pub send: SendRequest<Bytes>,
    pub connection: h2::client::Connection<tokio_rustls::client::TlsStream<IO>, Bytes>,
    /// The peer's SPIFFE id.
    pub peer: Option<String>,
    /// Resolves once a reloaded revocation list revokes the peer's chain:
    /// the connection must then be closed (`tls::until_revoked`).
    pub revoked: R,
}

/// HBONE's client handshakes over `io` (a TCP connection, or a CONNECT
/// stream for double HBONE's inner one) to the peer at `addr`: mTLS with
/// `config` (no SNI; ALPN h2 required), then HTTP/2, each bounded by the
/// handshake timeout and named by `what` when it runs out.
pub(super) async fn handshake<IO>(
    shared: &Shared,
    config: Arc<rustls::ClientConfig>,
    io: IO,
    addr: SocketAddr,
    what: (&'static str, &'static str),
) -> Result<Handshaken<IO, impl Future<Output = ()> + Send + 'static + use<IO>>, OutboundError>
where
    IO: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    let handshake_timeout = shared.config.handshake_timeout;
    let timed_out = |what| OutboundError::Timeout {
        what,
        after: handshake_timeout,
    };
    // Before the handshake: a list reloaded during it is seen.
    let revocation = shared
        .roots
        .revocation_watch(webpki::KeyUsage::server_auth());
    // No SNI is sent (enable_sni is off); the name only satisfies the API.
    let server_name = ServerName::IpAddress(addr.ip().into());
    let tls = crate::timers::timeout(
        handshake_timeout,
        tokio_rustls::TlsConnector::from(config).connect(server_name, io),
    )
    .await
    .map_err(|_| timed_out(what.0))?
    .map_err(|source| {
        if crate::tls::failed_on_revocation(&source) {
            shared.crl_rejections.outbound();
        }
        OutboundError::Handshake { addr, source }
    })?;
    if tls.get_ref().1.alpn_protocol() != Some(crate::tls::ALPN_H2) {
        return Err(OutboundError::NoH2 { addr });
    }
    let peer = crate::tls::peer_identity(tls.get_ref().1);
    let revoked = crate::tls::until_revoked(revocation, tls.get_ref().1);
    let (send, connection) =
        crate::timers::timeout(handshake_timeout, shared.config.h2.client().handshake(tls))
            .await
            .map_err(|_| timed_out(what.1))??;
    Ok(Handshaken {
        send,
        connection,
        peer,
        revoked,
    })
}

/// Opens a new HBONE connection from the pod to the destination's 15008 and
/// adds it to the pool, returning a stream slot on it.
async fn connect(
    shared: &Shared,
    pod: &PodState,
    key: &PoolKey,
) -> Result<(SendRequest<Bytes>, StreamGuard), OutboundError> {
    let addr = SocketAddr::new(key.dst_ip, key.port);
    let cert = shared.identities.certificate(&pod.identity).await?;
    let config =
        crate::tls::client_config_accepting(&cert, &shared.roots, &key.dst, &key.also_accept)?;
    let tcp = pod
        .sockets
        .connect(addr, shared.config.connect_timeout)
        .await
        .map_err(|source| OutboundError::Connect { addr, source })?;
    let Handshaken {
        send,
        mut connection,
        revoked,
        ..
    } = handshake(
        shared,
        config,
        tcp,
        addr,
        ("TLS handshake", "HTTP/2 handshake"),
    )
    .await?;
    let ping_pong = connection.ping_pong();
    tracing::debug!(dst = %key.dst, %addr, src = %key.src, "new HBONE connection");
    Ok(pod.pool.insert(
        key,
        send,
        connection,
        super::pool::Driving {
            ping_pong,
            settings: shared.config.h2.clone(),
            idle_timeout: shared.config.pool_idle_timeout,
            draining: shared.draining.clone(),
            abort: shared.abort.clone(),
            revoked,
            crl_rejections: shared.crl_rejections.clone(),
            cert_revoked: shared
                .roots
                .revokes()
                .then(tokio_util::sync::CancellationToken::new),
        },
    ))
}

#[cfg(test)]
mod tests {
    use std::io;

    use super::*;

    #[test]
    fn a_timed_out_connect_to_the_peer_is_named_as_ztunnel_names_it() {
        let addr: SocketAddr = "198.18.2.2:15008".parse().expect("addr");
        let connect = |kind| OutboundError::Connect {
            addr,
            source: io::Error::new(kind, "connect"),
        };
        assert_eq!(
            connect(io::ErrorKind::TimedOut).failure(),
            Some(Failure::HbonePortTimedOut)
        );
        // Refused is an answer, not a drop: a plain CONNECT.
        assert_eq!(connect(io::ErrorKind::ConnectionRefused).failure(), None);
        assert_eq!(OutboundError::NoH2 { addr }.failure(), Some(Failure::Http2));
        // A failed TLS handshake is an I/O error to ztunnel.
        let handshake = OutboundError::Handshake {
            addr,
            source: io::Error::other("bad certificate"),
        };
        assert_eq!(handshake.failure(), None);
        assert_eq!(OutboundError::Status(StatusCode::FORBIDDEN).failure(), None);
    }
}

//! Inbound HBONE (podIP:15008 in the pod's netns).
//!
//! TLS 1.3 with the certificate of the workload the connection arrived for
//! (chosen by arrival IP: clients send no SNI), a client certificate of our
//! trust domain required, ALPN h2. Each CONNECT stream is checked, then
//! connected to the application from inside the target pod's netns:
//!
//! | request | answer |
//! |---|---|
//! | not CONNECT | 400 ([`NON_CONNECT_STATUS`]) |
//! | `:authority` neither `ip:port` nor `host:port` | 400 |
//! | `host:port`: no service of that hostname (one in the arrival pod's namespace first) | 503 |
//! | `host:port`: the service gives no target port for it at the arrival pod | 503 |
//! | `host:port` | on to the arrival pod at that target port (below) |
//! | authority bound to a waypoint the arrival pod is (an enrolled waypoint) | on to the arrival pod's port for it (below) |
//! | IP not a workload served on this node (no open relay) | 401 |
//! | IP differs from the one the connection arrived on | 400 |
//! | port is one of the proxy's own (15001/15006/15008) | 503 |
//! | an authorization policy denies it (peer identity, source IP, target) | 401 |
//! | application refuses / unreachable | 503 |
//! | otherwise | 200 (with the target workload's `baggage`, as ztunnel's response baggage), then bytes both ways |
//!
//! A CONNECT whose authority is not the arrival address is accepted only
//! when the pod it arrived at is the named waypoint of that authority (a
//! service's `VIP:port` or a workload's `IP:port` bound to a waypoint whose
//! endpoint the pod is: the waypoint deployment itself may be enrolled). As
//! ztunnel's inbound without an application tunnel, it goes to the
//! waypoint pod's address, at the service port's target port (a workload's
//! port as is); the access line's `dst.addr` is the authority.
//!
//! A `host:port` authority (waypoints and gateways send a service's
//! hostname) is, as with ztunnel, always served by the pod the connection
//! arrived at: the hostname names a service (the one in the arrival pod's
//! namespace, else the canonical one, else the first by key), and only
//! gives the port: the arrival pod's own target port for that service
//! port (its endpoint's, else the service's numeric target port). The pod
//! need not be one of the service's endpoints (ztunnel does not check it
//! either); the access line's `dst.addr` is the arrival pod's address and
//! that port.
//!
//! Headers too large for `max_header_list_size` get 431 from h2 itself,
//! and a stream over [`MAX_CONCURRENT_STREAMS`](super::MAX_CONCURRENT_STREAMS)
//! `REFUSED_STREAM`: h2's refusals are counted and logged through
//! [`FrameTap`](super::h2_refusals::FrameTap). A connection that has not
//! sent its first CONNECT within the handshake timeout of its TLS
//! handshake's start is closed; until then it may be shed to make room
//! ([`limits`](super::limits)).

use std::{net::SocketAddr, sync::Arc, time::Instant};

use bytes::Bytes;
use h2::{RecvStream, server::SendResponse};
use http::{Method, Request, Response, StatusCode};
use tokio::net::TcpStream;
use tracing::Instrument;

use super::on_wake::OnWake;

use super::{
    AccessLog, Decision, Outcome, PROXY_PORTS, PodState, RefusalReason, Shared,
    h2::H2Stream,
    h2_refusals::FrameTap,
    limits::{Admission, H2Context},
    socket::SourcePort,
};

/// Answer to a request that is not CONNECT. DESIGN.md records ztunnel
/// answering 400 on the wire (issue 4 said 405); the observed wire contract
/// wins.
pub const NON_CONNECT_STATUS: StatusCode = StatusCode::BAD_REQUEST;

pub(super) async fn serve(
    shared: Arc<Shared>,
    pod: Arc<PodState>,
    tcp: TcpStream,
    peer: SocketAddr,
    admission: Option<Admission>,
) {
    // Debug level, as outbound's span (see there).
    let span = tracing::debug_span!("inbound", pod = %pod.key, src = %peer);
    serve_connection(shared, pod, tcp, peer, admission)
        .instrument(span)
        .await
}

/// Resolves when `admission` is shed to make room; never without one.
async fn evicted(admission: &Option<Admission>) {
    match admission {
        Some(a) => a.evicted().await,
        None => std::future::pending().await,
    }
}

async fn serve_connection(
    shared: Arc<Shared>,
    pod: Arc<PodState>,
    tcp: TcpStream,
    peer: SocketAddr,
    mut admission: Option<Admission>,
) {
    let started = Instant::now();
    let arrival = match tcp.local_addr() {
        Ok(a) => a,
        Err(_) => return,
    };
    let mut log = AccessLog {
        dst_identity: Some(pod.identity.as_str()),
        started,
        pod: Some(&pod.key),
        ..AccessLog::new("inbound", peer, arrival)
    };
    // The certificate is the arrival IP's workload's: the listener is bound
    // on that pod's IP, so it is this listener's pod.
    let cert = match shared.identities.certificate(&pod.identity).await {
        Ok(c) => c,
        Err(e) => {
            log.outcome = Outcome::Failed;
            log.reason = Some(format!("no certificate to present: {e}"));
            log.emit(&shared);
            return;
        }
    };
    // Clients must be of this pod's own trust domain (ztunnel checks the
    // trust domain of its own certificate), which istiod may set per
    // workload; the proxy's is the fallback.
    let trust_domain = crate::tls::trust_domain_of(pod.identity.as_str())
        .and_then(|td| crate::state::TrustDomain::new(td).ok())
        .unwrap_or_else(|| shared.config.trust_domain.clone());
    let config = match crate::tls::server_config(&cert, &shared.roots, &trust_domain) {
        Ok(c) => c,
        Err(e) => {
            log.outcome = Outcome::Failed;
            log.reason = Some(e.to_string());
            log.emit(&shared);
            return;
        }
    };
    let handshake_timeout = shared.config.handshake_timeout;
    // The first CONNECT must come within this (TLS, HTTP/2, then the
    // request): a connection is of no use before.
    let first_request_by = tokio::time::Instant::now() + handshake_timeout;
    // The handshakes are boxed, and so freed once done: the connection's
    // task then keeps only what serving its streams needs.
    // Before the handshake: a list reloaded during it is seen.
    let revocation = shared
        .roots
        .revocation_watch(webpki::KeyUsage::client_auth());
    // Cancelled before the connection is closed on a revocation: its
    // streams then say so (only with revocation lists).
    let cert_revoked = revocation
        .as_ref()
        .map(|_| tokio_util::sync::CancellationToken::new());
    let handshake = Box::pin(crate::timers::timeout(
        handshake_timeout,
        tokio_rustls::TlsAcceptor::from(config).accept(tcp),
    ));
    let handshake = tokio::select! {
        h = handshake => h,
        () = evicted(&admission) => {
            log.refusal = Some(RefusalReason::HandshakeEvicted);
            super::limits::quiet_unless_allowed(&shared, &mut log, "shed during its TLS handshake: file descriptors short, room made for a new connection".into());
            log.emit(&shared);
            return;
        }
    };
    let tls = match handshake {
        Ok(Ok(tls)) => tls,
        Ok(Err(e)) => {
            if crate::tls::failed_on_revocation(&e) {
                shared.crl_rejections.inbound();
            }
            log.refusal = Some(RefusalReason::Tls);
            log.reason = Some(format!("TLS handshake: {e}"));
            log.emit(&shared);
            return;
        }
        Err(_) => {
            log.refusal = Some(RefusalReason::HandshakeTimeout);
            log.reason = Some(format!(
                "TLS handshake timed out after {handshake_timeout:?}"
            ));
            log.emit(&shared);
            return;
        }
    };
    let peer_identity: Option<Arc<str>> = crate::tls::peer_identity(tls.get_ref().1).map(Arc::from);
    if tls.get_ref().1.alpn_protocol() != Some(crate::tls::ALPN_H2) {
        // A client that offered no ALPN at all (rustls only rejects a
        // mismatching offer).
        log.src_identity = peer_identity.as_deref();
        log.refusal = Some(RefusalReason::Tls);
        log.reason = Some("ALPN h2 not negotiated".into());
        log.emit(&shared);
        return;
    }
    log.src_identity = peer_identity.as_deref();
    // Polled only when a list was reloaded (`on_wake.rs`).
    let revoked = OnWake::new(crate::tls::until_revoked(revocation, tls.get_ref().1));
    tokio::pin!(revoked);
    // h2's own refusals are seen in the frames it writes.
    let context = H2Context {
        shared: shared.clone(),
        pod: pod.key.clone(),
        peer,
        arrival,
        peer_identity: peer_identity.clone(),
    };
    let tls = FrameTap::new(tls, move |refusal| context.refused(refusal));
    let mut conn = match Box::pin(crate::timers::timeout_at(
        first_request_by,
        shared.config.h2.server().handshake(tls),
    ))
    .await
    {
        Ok(Ok(c)) => c,
        Ok(Err(e)) => {
            log.reason = Some(format!("HTTP/2 handshake: {e}"));
            log.emit(&shared);
            return;
        }
        Err(_) => {
            log.refusal = Some(RefusalReason::HandshakeTimeout);
            log.reason = Some("HTTP/2 handshake timed out".into());
            log.emit(&shared);
            return;
        }
    };
    // Polled only when they woke (`on_wake.rs`), not per frame.
    let keepalive = OnWake::new(match conn.ping_pong() {
        Some(pp) => {
            futures::future::Either::Left(super::h2::keepalive(pp, shared.config.h2.clone()))
        }
        None => futures::future::Either::Right(std::future::pending()),
    });
    tokio::pin!(keepalive);
    let draining = OnWake::new(shared.draining.clone().cancelled_owned());
    tokio::pin!(draining);
    let mut going_away = false;
    let first_request = crate::timers::sleep_until(first_request_by);
    tokio::pin!(first_request);
    loop {
        let waiting_first = admission.as_ref().is_some_and(|a| !a.is_established());
        // In order, no random start: every branch but the connection's is
        // a cheap no-op until its own wake-up (`OnWake`, a timer, a
        // token), so the rare ones go first and cannot be starved by a busy
        // connection, and the per-frame wake-ups skip select!'s
        // thread-local random number.
        tokio::select! {
            biased;
            () = &mut first_request, if waiting_first => {
                log.refusal = Some(RefusalReason::HandshakeTimeout);
                log.reason = Some(format!("no CONNECT within {handshake_timeout:?} of the connection"));
                log.emit(&shared);
                break;
            }
            () = evicted(&admission), if waiting_first => {
                log.refusal = Some(RefusalReason::HandshakeEvicted);
                super::limits::quiet_unless_allowed(&shared, &mut log, "shed before its first CONNECT: file descriptors short, room made for a new connection".into());
                log.emit(&shared);
                break;
            }
            e = &mut keepalive => {
                tracing::info!(pod = %pod.key, src = %peer, error = %e, "HBONE connection dropped: keepalive failed");
                break;
            }
            () = &mut draining, if !going_away => {
                // GOAWAY: no new streams; those in flight continue.
                conn.graceful_shutdown();
                going_away = true;
            }
            () = &mut revoked => {
                // A security event, as ztunnel treats it: GOAWAY and the
                // streams in flight cut, not drained.
                shared.crl_rejections.inbound();
                if let Some(cut) = &cert_revoked {
                    cut.cancel();
                }
                tracing::warn!(pod = %pod.key, src = %peer, peer_identity = peer_identity.as_deref().unwrap_or("-"), "HBONE connection closed: a reloaded revocation list revokes the peer's certificate");
                conn.abrupt_shutdown(h2::Reason::NO_ERROR);
                // Bounded: a peer that reads nothing does not hold it open.
                let closed = std::future::poll_fn(|cx| conn.poll_closed(cx));
                let _ = crate::timers::timeout(GOAWAY_FLUSH, closed).await;
                break;
            }
            next = conn.accept() => match next {
                Some(Ok((request, respond))) => {
                    if let Some(a) = admission.as_mut() {
                        a.established();
                    }
                    let span = tracing::debug_span!("stream", peer_identity = peer_identity.as_deref().unwrap_or("-"));
                    let (shared2, peer_identity) = (shared.clone(), peer_identity.clone());
                    let cut = cert_revoked.clone();
                    super::accept::spawn_tracked(&shared, move || {
                        serve_stream(shared2, arrival, peer, peer_identity, cut, request, respond).instrument(span)
                    });
                }
                Some(Err(e)) => {
                    tracing::debug!(error = %e, "HBONE connection ended with an error");
                    break;
                }
                None => break,
            },
        }
    }
}

/// How long a connection closed on a revocation waits for its GOAWAY to
/// be written before the socket is dropped.
const GOAWAY_FLUSH: std::time::Duration = std::time::Duration::from_secs(1);

/// The 200 to a CONNECT: with the `baggage` of the workload at `target`
/// (ztunnel's response baggage, `ENABLE_RESPONSE_BAGGAGE`, on by
/// default), which a client that came through a network gateway names
/// the destination by (its address there is the gateway's).
fn answer_ok(shared: &Shared, target: SocketAddr) -> Response<()> {
    let mut response = Response::new(());
    let baggage = shared
        .workloads
        .workload_by_ip(target.ip())
        .map(|w| super::waypoint::baggage(&w))
        .and_then(|b| http::HeaderValue::from_str(&b).ok());
    if let Some(value) = baggage {
        response.headers_mut().insert("baggage", value);
    }
    response
}

/// Whether a CONNECT came through a network gateway: its
/// `x-forwarded-network` (set by the source's proxy on the inner CONNECT
/// of ztunnel's double HBONE) names another network than `local`, compared
/// as ztunnel compares it (ASCII case-insensitively).
pub(super) fn through_gateway(headers: &http::HeaderMap, local: &str) -> bool {
    headers
        .get(X_FORWARDED_NETWORK)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|network| !network.eq_ignore_ascii_case(local))
}

/// ztunnel's `X_FORWARDED_NETWORK_HEADER`.
pub(super) const X_FORWARDED_NETWORK: &str = "x-forwarded-network";

pub(super) async fn serve_stream(
    shared: Arc<Shared>,
    arrival: SocketAddr,
    peer: SocketAddr,
    peer_identity: Option<Arc<str>>,
    cert_revoked: Option<tokio_util::sync::CancellationToken>,
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
) {
    // What the source's proxy says of the source (for the metrics when the
    // source is not known by its address; never a reason to refuse).
    let derived_source = super::Baggage::from_headers(request.headers());
    let mut log = AccessLog {
        src_identity: peer_identity.as_deref(),
        derived_source: Some(&derived_source),
        src_through_gateway: through_gateway(request.headers(), &shared.config.network),
        ..AccessLog::new("inbound", peer, arrival)
    };
    let mut refuse = |status: StatusCode, reason: String, log: &mut AccessLog<'_>| {
        let response = Response::builder()
            .status(status)
            .body(())
            .unwrap_or_default();
        let _ = respond.send_response(response, true);
        log.reason = Some(format!("{} {reason}", status.as_u16()));
    };

    let checked = check_request(&shared, arrival, &request);
    let (target, upstream_addr, target_pod) = match checked {
        Ok(t) => t,
        Err((status, reason)) => {
            // No target (ztunnel's early deny): no TCP metrics.
            log.early = true;
            refuse(status, reason, &mut log);
            log.emit(&shared);
            return;
        }
    };
    log.dst_addr = target;
    log.dst_identity = Some(target_pod.identity.as_str());
    log.pod = Some(&target_pod.key);
    log.dst_service = shared.workloads.inbound_service(
        &target_pod.key,
        super::inbound_service::forwarded_host(request.headers()),
        upstream_addr.port(),
    );
    // Before the application is dialled: a denied peer never reaches it.
    // 401, as ztunnel answers a CONNECT its policies deny.
    let changes = shared.policy_changes.subscribe();
    let connection = crate::authz::Connection {
        src_ip: peer.ip(),
        src_identity: peer_identity.as_deref(),
        dst: upstream_addr,
    };
    let decision = super::authorize(shared.workloads.as_ref(), &target_pod.key, &connection);
    log.decided(&decision);
    if let Decision::Deny { reason, .. } = &decision {
        refuse(StatusCode::UNAUTHORIZED, reason.clone(), &mut log);
        log.emit(&shared);
        return;
    }
    // The client is the source of the HBONE connection: the source pod's
    // own address (shunt and ztunnel open HBONE from inside the source pod).
    // Boxed, and so freed once connected: the stream's task keeps only
    // what the relay needs for the stream's life (see `task_sizes_tests.rs`).
    let mut upstream = match Box::pin(target_pod.connect_app(
        &shared.config,
        upstream_addr,
        peer,
        SourcePort::AtConnect,
    ))
    .await
    {
        Ok(s) => s,
        Err(e) => {
            refuse(
                StatusCode::SERVICE_UNAVAILABLE,
                format!("application at {upstream_addr}: {e}"),
                &mut log,
            );
            log.emit(&shared);
            return;
        }
    };
    let send = match respond.send_response(answer_ok(&shared, upstream_addr), false) {
        Ok(s) => s,
        Err(e) => {
            log.outcome = Outcome::Failed;
            log.reason = Some(format!("answering 200: {e}"));
            log.emit(&shared);
            return;
        }
    };
    let mut h2s = H2Stream::new(send, request.into_body());
    log.open(&shared);
    // Polled only when the policies changed or the connection's peer was
    // revoked, not per relayed read.
    let revoked = OnWake::new(super::revoked(
        &shared,
        changes,
        &target_pod.key,
        connection,
    ));
    let cut = OnWake::new(super::cut_by_revocation(cert_revoked.as_ref()));
    // The relay's first socket is the one to the pod, the target.
    let meter = super::observe::Meter::target_first(log.observed.as_deref());
    let copied = tokio::select! {
        // The cut first: the connection's end, which follows it, must not
        // read as a plain failure.
        biased;
        () = cut => {
            h2s.reset(h2::Reason::CANCEL);
            super::reset(&upstream);
            log.outcome = Outcome::Revoked;
            log.reason = Some(super::CERT_REVOKED.into());
            log.emit(&shared);
            return;
        }
        // (application → peer, peer → application)
        copied = super::relay::relay(&mut upstream, &mut h2s, meter) => copied,
        decision = revoked => {
            // A policy change denies it now: cut both sides.
            h2s.reset(h2::Reason::CANCEL);
            super::reset(&upstream);
            log.decided(&decision);
            log.emit(&shared);
            return;
        }
    };
    match copied {
        Ok((received, sent)) => {
            log.bytes_sent = sent;
            log.bytes_received = received;
            log.outcome = Outcome::Success;
        }
        Err(e) => {
            h2s.reset(h2::Reason::CANCEL);
            super::reset(&upstream);
            log.outcome = Outcome::Failed;
            log.reason = Some(e.to_string());
        }
    }
    log.emit(&shared);
}

/// The checks of the table above, in that order: the authority, the
/// address the application is dialled at, and the local pod it is.
fn check_request(
    shared: &Shared,
    arrival: SocketAddr,
    request: &Request<RecvStream>,
) -> Result<(SocketAddr, SocketAddr, Arc<PodState>), (StatusCode, String)> {
    let target = match connect_target(request)? {
        ConnectTarget::Addr(target) => target,
        ConnectTarget::Host { hostname, port } => {
            return to_hostname(shared, arrival, &hostname, port);
        }
    };
    if target.ip() != arrival.ip()
        && let Some((port, pod)) = as_waypoint(shared, arrival, target)
    {
        return check_port(port).map(|()| (target, SocketAddr::new(arrival.ip(), port), pod));
    }
    let target_pod = shared.local_pod(target.ip()).ok_or_else(|| {
        (
            StatusCode::UNAUTHORIZED,
            format!("{} is not a workload on this node", target.ip()),
        )
    })?;
    if target.ip() != arrival.ip() {
        return Err((
            StatusCode::BAD_REQUEST,
            format!(
                "authority {target} does not match the arrival address {}",
                arrival.ip()
            ),
        ));
    }
    check_port(target.port())?;
    Ok((target, target, target_pod))
}

/// A CONNECT to `hostname:port`: to the arrival pod, at its target port
/// for that service port.
fn to_hostname(
    shared: &Shared,
    arrival: SocketAddr,
    hostname: &str,
    port: u16,
) -> Result<(SocketAddr, SocketAddr, Arc<PodState>), (StatusCode, String)> {
    let pod = shared.local_pod(arrival.ip()).ok_or_else(|| {
        (
            StatusCode::UNAUTHORIZED,
            format!("{} is not a workload on this node", arrival.ip()),
        )
    })?;
    let target_port = shared
        .workloads
        .hostname_inbound_port(&pod.key, arrival.ip(), hostname, port)
        .map_err(|reason| (StatusCode::SERVICE_UNAVAILABLE, reason))?;
    check_port(target_port)?;
    let upstream = SocketAddr::new(arrival.ip(), target_port);
    Ok((upstream, upstream, pod))
}

fn check_port(port: u16) -> Result<(), (StatusCode, String)> {
    if PROXY_PORTS.contains(&port) {
        return Err((
            StatusCode::SERVICE_UNAVAILABLE,
            format!("port {port} is the proxy's own"),
        ));
    }
    Ok(())
}

/// The local pod the connection arrived at and its port for `authority`,
/// when that pod is the waypoint `authority` is bound to.
fn as_waypoint(
    shared: &Shared,
    arrival: SocketAddr,
    authority: SocketAddr,
) -> Option<(u16, Arc<PodState>)> {
    let pod = shared.local_pod(arrival.ip())?;
    let port = shared
        .workloads
        .waypoint_inbound_port(&pod.key, authority)?;
    Some((port, pod))
}

/// What a CONNECT's `:authority` names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) enum ConnectTarget {
    /// `ip:port` (`[v6]:port`).
    Addr(SocketAddr),
    /// `host:port`: a service's hostname (what waypoints send).
    Host { hostname: String, port: u16 },
}

impl std::fmt::Display for ConnectTarget {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ConnectTarget::Addr(a) => a.fmt(f),
            ConnectTarget::Host { hostname, port } => write!(f, "{hostname}:{port}"),
        }
    }
}

/// The first checks of the table, on the request alone: a CONNECT whose
/// `:authority` is `ip:port` or `host:port` (a port is required either
/// way, as ztunnel requires it).
pub(crate) fn connect_target<B>(
    request: &Request<B>,
) -> Result<ConnectTarget, (StatusCode, String)> {
    if request.method() != Method::CONNECT {
        return Err((
            NON_CONNECT_STATUS,
            format!("method {} is not CONNECT", request.method()),
        ));
    }
    let authority = request
        .uri()
        .authority()
        .ok_or_else(|| (StatusCode::BAD_REQUEST, "no :authority".to_string()))?;
    if let Ok(addr) = authority.as_str().parse() {
        return Ok(ConnectTarget::Addr(addr));
    }
    let host = authority.host();
    match authority.port_u16() {
        // A bracketed host that is not an IPv6 address is no hostname.
        Some(port) if !host.is_empty() && !host.starts_with('[') => Ok(ConnectTarget::Host {
            hostname: host.to_owned(),
            port,
        }),
        _ => Err((
            StatusCode::BAD_REQUEST,
            format!(
                "authority {:?} is neither ip:port nor host:port",
                authority.as_str()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::through_gateway;

    #[test]
    fn a_connect_came_through_a_gateway_when_its_forwarded_network_is_another() {
        let with = |value: Option<&str>| {
            let mut headers = http::HeaderMap::new();
            if let Some(v) = value {
                headers.insert("x-forwarded-network", v.parse().expect("header value"));
            }
            headers
        };
        assert!(!through_gateway(&with(None), "network1"), "no header");
        assert!(!through_gateway(&with(Some("network1")), "network1"));
        assert!(
            !through_gateway(&with(Some("NETWORK1")), "network1"),
            "compared case-insensitively, as ztunnel"
        );
        assert!(through_gateway(&with(Some("network2")), "network1"));
        assert!(through_gateway(&with(Some("network2")), ""));
    }
}

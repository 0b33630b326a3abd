//! Inbound plaintext (0.0.0.0:15006, transparent, in the pod's netns):
//! connections from outside the mesh to an enrolled pod, handed over by the
//! TC program (`bpf_sk_assign`, which keeps the original destination as the
//! socket's local address) or iptables REDIRECT (local port 15006; the
//! redirector's [`OriginalDst`](crate::redirect::OriginalDst) knows where it
//! was going). The [`InboundPlaintextPolicy`](super::InboundPlaintextPolicy)
//! decides first, then the authorization policies (no principal: plaintext
//! has none); allowed connections are delivered to the application from
//! inside the pod's netns, denied ones reset. Both are counted and logged.

use std::{net::SocketAddr, sync::Arc};

use shunt_common::PORT_INBOUND_PLAINTEXT;
use tokio::net::TcpStream;
use tracing::Instrument;

use super::{
    AccessLog, Decision, Outcome, PROXY_PORTS, PlaintextConnection, PodState, Shared,
    socket::SourcePort,
};

pub(super) async fn serve(
    shared: Arc<Shared>,
    pod: Arc<PodState>,
    tcp: TcpStream,
    peer: SocketAddr,
) {
    // Debug level, as outbound's span (see there).
    let span = tracing::debug_span!("inbound_plaintext", pod = %pod.key, src = %peer);
    serve_inner(shared, pod, tcp, peer).instrument(span).await
}

async fn serve_inner(shared: Arc<Shared>, pod: Arc<PodState>, tcp: TcpStream, peer: SocketAddr) {
    let mut log = AccessLog {
        dst_identity: Some(pod.identity.as_str()),
        pod: Some(&pod.key),
        ..AccessLog::new("inbound_plaintext", peer, peer)
    };
    let (mut client, dst) = match destination(&shared, tcp) {
        Ok(pair) => pair,
        Err(reason) => {
            log.reason = Some(reason);
            log.emit(&shared);
            return;
        }
    };
    log.dst_addr = dst;
    if PROXY_PORTS.contains(&dst.port()) {
        log.reason = Some(format!("port {} is the proxy's own", dst.port()));
        log.emit(&shared);
        return;
    }
    // Only this pod's own addresses: the listener must not relay elsewhere.
    if !pod.ips.contains(&dst.ip()) {
        log.reason = Some(format!("{} is not this pod's address", dst.ip()));
        log.emit(&shared);
        return;
    }
    log.dst_service = shared.workloads.inbound_service(&pod.key, None, dst.port());
    let connection = PlaintextConnection {
        pod: &pod.key,
        src: peer,
        dst,
    };
    let changes = shared.policy_changes.subscribe();
    let authz_connection = crate::authz::Connection {
        src_ip: peer.ip(),
        src_identity: None,
        dst,
    };
    let mut decision = shared.config.inbound_plaintext.decide(&connection);
    if let Decision::Allow(_) = decision {
        decision = super::authorize(shared.workloads.as_ref(), &pod.key, &authz_connection);
    }
    log.decided(&decision);
    if let Decision::Deny { .. } = decision {
        // A reset, so the client sees a refusal rather than an empty answer.
        super::reset(&client);
        log.emit(&shared);
        return;
    }
    let mut upstream = match pod
        .connect_app(&shared.config, dst, peer, SourcePort::Except(peer.port()))
        .await
    {
        Ok(s) => s,
        Err(e) => {
            log.outcome = Outcome::Failed;
            log.reason = Some(format!("application at {dst}: {e}"));
            super::reset(&client);
            log.emit(&shared);
            return;
        }
    };
    log.open(&shared);
    let meter = super::observe::Meter::initiator_first(log.observed.as_deref());
    let copied = tokio::select! {
        copied = super::relay::relay_tcp(&mut client, &mut upstream, meter) => copied,
        decision = super::revoked(&shared, changes, &pod.key, authz_connection) => {
            // A policy change denies it now: cut both sides.
            super::reset(&client);
            super::reset(&upstream);
            log.decided(&decision);
            log.emit(&shared);
            return;
        }
    };
    match copied {
        Ok((sent, received)) => {
            log.bytes_sent = sent;
            log.bytes_received = received;
            log.outcome = Outcome::Success;
        }
        Err(e) => {
            log.outcome = Outcome::Failed;
            log.reason = Some(e.to_string());
        }
    }
    log.emit(&shared);
}

/// Where the connection was going: the local address itself (sk_assign,
/// TPROXY), or the redirector's record when it was REDIRECTed to 15006.
fn destination(shared: &Shared, tcp: TcpStream) -> Result<(TcpStream, SocketAddr), String> {
    let local = tcp
        .local_addr()
        .map_err(|e| format!("local address: {e}"))?;
    if local.port() != PORT_INBOUND_PLAINTEXT {
        return Ok((tcp, local));
    }
    shared.original_dst_of(tcp)
}

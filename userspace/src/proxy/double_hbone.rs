//! Outbound to another network: double HBONE through its east-west
//! gateway (`network_gateway.rs` chose the hop), as ztunnel sends it.
//!
//! 1. Outer: a pooled HBONE connection to the gateway (its identity
//!    checked), CONNECT `<service hostname>:<port>` with the usual headers.
//! 2. Inner, inside that stream and never pooled (the gateway picks an
//!    endpoint per stream; a pooled inner connection would always reach
//!    the same one): mTLS as the source pod, the destination checked
//!    against the service's SANs, HTTP/2, and CONNECT to the same
//!    authority with the usual headers and `x-forwarded-network` (this
//!    node's network), which the destination's proxy terminates.
//! 3. The application's bytes go over the inner stream.

use http::{HeaderMap, HeaderValue};
use tokio::net::TcpStream;

use super::{
    AccessLog, Outcome, PodState, Shared,
    h2::H2Stream,
    h2_io::H2Io,
    network_gateway::GatewayHop,
    outbound::{Handshaken, OutboundError, connect_stream, handshake, open_stream, relay_logged},
    pool::{PoolKey, StreamGuard},
    reset,
};

/// Carries `app` to `hop`'s service through the gateway, writing the access
/// line (the gateway as `dst.addr`, the destination's identity as the
/// inner handshake proved it).
pub(super) async fn serve(
    shared: &Shared,
    pod: &PodState,
    mut app: TcpStream,
    hop: Box<GatewayHop>,
    headers: HeaderMap,
    mut log: AccessLog<'_>,
) {
    log.dst_addr = hop.gateway;
    tracing::debug!(gateway = %hop.gateway, network = %hop.network, authority = %hop.authority, "through the network gateway");
    // Boxed: the handshakes' state is freed once the streams are open
    // (see `hbone` in outbound.rs).
    let opened = Box::pin(open(shared, pod, &hop, headers)).await;
    let Opened {
        mut inner,
        peer,
        answer,
        outer_guard,
        inner_cut,
    } = match opened {
        Ok(streams) => streams,
        Err(e) => {
            log.outcome = match e {
                OutboundError::Status(_) => Outcome::Refused,
                _ => Outcome::Failed,
            };
            log.failure = e.failure();
            log.reason = Some(format!(
                "through the gateway {} of network {}: {e}",
                hop.gateway, hop.network
            ));
            log.emit(shared);
            reset(&app);
            return;
        }
    };
    drop(hop);
    log.dst_identity = Some(&peer);
    // The destination's proxy names its workload in the answer's baggage
    // (ztunnel's derived destination): the metrics' destination, since
    // the address is the gateway's.
    let derived = answer
        .contains_key("baggage")
        .then(|| super::Baggage::from_headers(&answer));
    drop(answer);
    log.derived_destination = derived.as_ref();
    // Either hop's peer revoked (the gateway's or the destination's) cuts
    // the stream, as ztunnel races both.
    let outer_cut = outer_guard.conn.cert_revoked.clone();
    let cut = async {
        tokio::select! {
            () = super::cut_by_revocation(outer_cut.as_ref()) => {}
            () = super::cut_by_revocation(inner_cut.as_ref()) => {}
        }
    };
    relay_logged(shared, &mut app, &mut inner, &mut log, cut).await;
}

/// What [`open`] sets up.
struct Opened {
    /// The inner CONNECT stream.
    inner: H2Stream,
    /// The destination's identity, as the inner handshake proved it.
    peer: String,
    /// The headers of the inner CONNECT's answer.
    answer: HeaderMap,
    /// The outer stream's pool slot (held while the connection lives).
    outer_guard: StreamGuard,
    /// Cancelled when the inner connection is closed on a revocation of
    /// the destination (only with revocation lists).
    inner_cut: Option<tokio_util::sync::CancellationToken>,
}

async fn open(
    shared: &Shared,
    pod: &PodState,
    hop: &GatewayHop,
    headers: HeaderMap,
) -> Result<Opened, OutboundError> {
    let key = PoolKey {
        src: pod.identity.clone(),
        dst: hop.gateway_identity.clone(),
        dst_ip: hop.gateway.ip(),
        port: hop.gateway.port(),
        also_accept: hop.gateway_sans.clone(),
    };
    let (outer, guard) = open_stream(shared, pod, &key, &hop.authority, &headers).await?;

    let cert = shared.identities.certificate(&pod.identity).await?;
    let config = crate::tls::client_config_accepting(
        &cert,
        &shared.roots,
        &hop.final_identity,
        &hop.final_also_accept,
    )?;
    let Handshaken {
        send,
        connection,
        peer,
        revoked,
    } = handshake(
        shared,
        config,
        H2Io::new(outer),
        hop.gateway,
        ("inner TLS handshake", "inner HTTP/2 handshake"),
    )
    .await?;
    // The inner connection carries this one stream: it ends when the
    // stream and `send` are dropped, or with the outer stream, or when a
    // reloaded list revokes the destination's certificate.
    let crl_rejections = shared.crl_rejections.clone();
    let destination = hop.final_identity.clone();
    let inner_cut = shared
        .roots
        .revokes()
        .then(tokio_util::sync::CancellationToken::new);
    let cut = inner_cut.clone();
    tokio::spawn(async move {
        // Polled only when a list was reloaded, not per frame.
        let revoked = super::on_wake::OnWake::new(revoked);
        tokio::select! {
            ended = connection => if let Err(e) = ended {
                tracing::debug!(error = %e, "inner HBONE connection ended");
            },
            () = revoked => {
                crl_rejections.outbound();
                if let Some(cut) = &cut {
                    cut.cancel();
                }
                tracing::warn!(dst = %destination, "inner HBONE connection closed: a reloaded revocation list revokes the peer's certificate");
            }
        }
    });
    let mut inner_headers = headers;
    // ztunnel sends its network, empty or not, on the inner CONNECT only.
    if let Ok(network) = HeaderValue::from_str(&shared.config.network) {
        inner_headers.insert(super::inbound::X_FORWARDED_NETWORK, network);
    }
    let (inner, answer) = connect_stream(shared, send, &hop.authority, &inner_headers).await?;
    Ok(Opened {
        inner,
        peer: peer.unwrap_or_default(),
        answer,
        outer_guard: guard,
        inner_cut,
    })
}

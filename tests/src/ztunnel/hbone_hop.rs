//! The stand-in ztunnel's HBONE hop (see the parent module): outbound, its
//! client to a mesh workload's 15008; inbound, its 15008 server delivering
//! each CONNECT to the application. A connection thread runs each on a
//! runtime of its own, as the rest of the stand-in is plain threads.

use std::net::{SocketAddr, TcpStream};

use bytes::Bytes;
use h2::{RecvStream, server::SendResponse};
use http::{Method, Request, Response, StatusCode};
use shunt::state::SpiffeId;

use super::{Inbound, Mesh, OWN_PORTS, StandIn, lock};
use crate::hbone;

/// ztunnel's HBONE port on every pod.
const HBONE_PORT: u16 = 15008;

fn runtime() -> std::io::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
}

/// A std socket as a tokio one (inside a runtime).
fn tokio_tcp(tcp: TcpStream) -> Result<tokio::net::TcpStream, String> {
    tcp.set_nonblocking(true).map_err(|e| e.to_string())?;
    tokio::net::TcpStream::from_std(tcp).map_err(|e| e.to_string())
}

/// Carries `app` (accepted on 15001, bound for `destination`, a mesh
/// workload that is `identity`) over HBONE: a connection to the
/// destination's IP:15008 made in the client pod's netns with mark 0x539,
/// TLS with the pod's certificate, `CONNECT destination`. `record` gets
/// the outcome of the CONNECT before any byte is relayed.
pub(super) fn outbound(
    app: TcpStream,
    destination: SocketAddr,
    mesh: &Mesh,
    identity: &SpiffeId,
    stand_in: &StandIn,
    record: impl FnOnce(Option<Result<(), String>>),
) {
    let runtime = match runtime() {
        Ok(r) => r,
        Err(e) => return record(Some(Err(format!("runtime: {e}")))),
    };
    let peer = SocketAddr::new(destination.ip(), HBONE_PORT);
    let tcp = match stand_in.connect(peer, None) {
        Ok(tcp) => tcp,
        Err(e) => return record(Some(Err(format!("connect to {peer}: {e}")))),
    };
    runtime.block_on(async move {
        let opened = match tokio_tcp(tcp) {
            Ok(tcp) => {
                let credentials = &mesh.credentials;
                hbone::connect(
                    tcp,
                    &credentials.cert,
                    &credentials.roots,
                    identity,
                    destination,
                )
                .await
            }
            Err(e) => Err(e),
        };
        let (to_peer, from_peer) = match opened {
            Ok(stream) => {
                record(Some(Ok(())));
                stream
            }
            Err(e) => return record(Some(Err(e))),
        };
        let Ok(app) = tokio_tcp(app) else {
            return;
        };
        let (app_read, app_write) = app.into_split();
        let _ = tokio::join!(
            hbone::pump_from_socket(app_read, to_peer),
            hbone::pump_to_socket(from_peer, app_write)
        );
    });
}

/// The accepted HBONE connection a CONNECT arrived on.
#[derive(Clone)]
struct Arrival {
    local: SocketAddr,
    peer: SocketAddr,
    peer_identity: Option<String>,
}

/// Serves an HBONE connection accepted on 15008 (from `peer`): TLS with
/// the pod's certificate, then every CONNECT stream on it.
pub(super) fn inbound(tcp: TcpStream, peer: SocketAddr, stand_in: &StandIn) {
    let Some(mesh) = stand_in.mesh.as_ref().clone() else {
        return;
    };
    let Ok(runtime) = runtime() else {
        return;
    };
    let stand_in = stand_in.clone();
    runtime.block_on(async move {
        let Ok(tcp) = tokio_tcp(tcp) else {
            return;
        };
        let Ok(local) = tcp.local_addr() else {
            return;
        };
        let credentials = &mesh.credentials;
        let (mut conn, peer_identity) =
            match hbone::accept(tcp, &credentials.cert, &credentials.roots).await {
                Ok(accepted) => accepted,
                Err(e) => {
                    crate::warn(format_args!("stand-in ztunnel: HBONE from {peer}: {e}"));
                    return;
                }
            };
        let arrival = Arrival {
            local,
            peer,
            peer_identity,
        };
        let mut streams = Vec::new();
        // `accept` also drives the connection; it ends when the client
        // closed it.
        while let Some(Ok((request, respond))) = conn.accept().await {
            streams.push(tokio::spawn(serve_connect(
                request,
                respond,
                arrival.clone(),
                stand_in.clone(),
            )));
        }
        for stream in streams {
            let _ = stream.await;
        }
    });
}

/// One CONNECT, answered as ztunnel answers: 400 for anything but a
/// CONNECT to `ip:port` on the address the connection arrived on, 503 for
/// one of its own ports or an application that refused; else delivered to
/// the authority from the HBONE client's address (IP_TRANSPARENT, mark
/// 0x539, in the pod's netns), 200, and the bytes relayed.
async fn serve_connect(
    request: Request<RecvStream>,
    mut respond: SendResponse<Bytes>,
    arrival: Arrival,
    stand_in: StandIn,
) {
    let authority = request.uri().authority().map(|a| a.to_string());
    let target = authority
        .as_deref()
        .and_then(|a| a.parse::<SocketAddr>().ok());
    let checked = match target {
        _ if request.method() != Method::CONNECT => Err((
            StatusCode::BAD_REQUEST,
            format!("{} is no CONNECT", request.method()),
        )),
        None => Err((
            StatusCode::BAD_REQUEST,
            format!("authority {authority:?} is no ip:port"),
        )),
        Some(t) if t.ip().to_canonical() != arrival.local.ip().to_canonical() => Err((
            StatusCode::BAD_REQUEST,
            format!("authority {t} is not the address HBONE arrived on"),
        )),
        Some(t) if OWN_PORTS.contains(&t.port()) => Err((
            StatusCode::SERVICE_UNAVAILABLE,
            format!("{t} is one of the proxy's own ports"),
        )),
        Some(t) => Ok(t),
    };
    let delivered = match checked {
        Ok(to) => {
            let (stand_in, from) = (stand_in.clone(), arrival.peer.ip().to_canonical());
            match tokio::task::spawn_blocking(move || stand_in.connect(to, Some(from))).await {
                Ok(Ok(app)) => Ok(app),
                Ok(Err(e)) => Err((StatusCode::SERVICE_UNAVAILABLE, e.to_string())),
                Err(e) => Err((StatusCode::SERVICE_UNAVAILABLE, e.to_string())),
            }
        }
        Err(refused) => Err(refused),
    };
    lock(&stand_in.seen.inbound).push(Inbound {
        listener_port: HBONE_PORT,
        local: arrival.local,
        peer: arrival.peer,
        authority,
        peer_identity: arrival.peer_identity,
        destination: target.unwrap_or(arrival.local),
        delivered_from: match &delivered {
            Ok(app) => app.local_addr().map_err(|e| e.to_string()),
            Err((status, why)) => Err(format!("{status}: {why}")),
        },
    });
    let answer = |status| Response::builder().status(status).body(()).ok();
    let app = match delivered {
        Ok(app) => app,
        Err((status, _)) => {
            if let Some(response) = answer(status) {
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
    let Ok(app) = tokio_tcp(app) else {
        return;
    };
    let (app_read, app_write) = app.into_split();
    let _ = tokio::join!(
        hbone::pump_to_socket(request.into_body(), app_write),
        hbone::pump_from_socket(app_read, to_client)
    );
}

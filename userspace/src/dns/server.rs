//! The serving loops of one pod's server: a UDP socket (each datagram
//! answered by its own task, a bounded number at once) and a TCP listener
//! (each connection a task, length-prefixed messages answered in order).
//! Every task belongs to a `JoinSet` of the loop that started it, and each
//! loop to the server's handle, so stopping the server ends them all and
//! closes every socket.

use std::{sync::Arc, time::Duration};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream, UdpSocket},
    task::JoinSet,
};
use tokio_util::sync::CancellationToken;
use tracing::debug;

use super::{answer::Handler, metrics::Protocol};
use crate::timers::timeout;

/// Queries of one UDP socket being answered at once; more are dropped (the
/// client retries), so a flood cannot grow the agent without bound.
const MAX_UDP_IN_FLIGHT: usize = 1024;
/// TCP connections of one listener at once; more are closed on accept.
const MAX_TCP_CONNECTIONS: usize = 256;
/// How long a TCP connection may stay idle between messages (or take to
/// send one), as ztunnel's server allows.
const TCP_IDLE: Duration = Duration::from_secs(5);
/// The largest datagram a client can send.
const MAX_DATAGRAM: usize = 65_535;

pub(crate) async fn serve_udp(socket: UdpSocket, handler: Arc<Handler>, stop: CancellationToken) {
    let socket = Arc::new(socket);
    let mut in_flight = JoinSet::new();
    let mut buf = vec![0u8; MAX_DATAGRAM];
    loop {
        let received = tokio::select! {
            _ = stop.cancelled() => return,
            received = socket.recv_from(&mut buf) => received,
        };
        while in_flight.try_join_next().is_some() {}
        let (n, client) = match received {
            Ok(received) => received,
            // E.g. an ICMP error for an earlier answer: not this socket's end.
            Err(e) => {
                debug!(error = %e, "DNS UDP receive failed");
                continue;
            }
        };
        if in_flight.len() >= MAX_UDP_IN_FLIGHT {
            debug!(%client, "DNS UDP query dropped: too many in flight");
            continue;
        }
        let query = buf[..n].to_vec();
        let handler = handler.clone();
        let socket = socket.clone();
        in_flight.spawn(async move {
            if let Some(answer) = handler.handle(&query, Protocol::Udp).await
                && let Err(e) = socket.send_to(&answer, client).await
            {
                debug!(%client, error = %e, "DNS UDP answer not sent");
            }
        });
    }
}

pub(crate) async fn serve_tcp(
    listener: TcpListener,
    handler: Arc<Handler>,
    stop: CancellationToken,
) {
    let mut connections = JoinSet::new();
    loop {
        let accepted = tokio::select! {
            _ = stop.cancelled() => return,
            accepted = listener.accept() => accepted,
        };
        while connections.try_join_next().is_some() {}
        let (stream, client) = match accepted {
            Ok(accepted) => accepted,
            Err(e) => {
                debug!(error = %e, "DNS TCP accept failed");
                // E.g. out of file descriptors: let some close first.
                crate::timers::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        if connections.len() >= MAX_TCP_CONNECTIONS {
            debug!(%client, "DNS TCP connection closed: too many open");
            continue;
        }
        let handler = handler.clone();
        connections.spawn(async move {
            if let Err(e) = serve_connection(stream, &handler).await {
                debug!(%client, error = %e, "DNS TCP connection ended");
            }
        });
    }
}

/// Answers messages on one connection until the client closes it, stays
/// idle too long, or sends something that cannot be answered.
async fn serve_connection(mut stream: TcpStream, handler: &Handler) -> std::io::Result<()> {
    loop {
        let mut len = [0u8; 2];
        match timeout(TCP_IDLE, stream.read_exact(&mut len)).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(()),
            Ok(Err(e)) => return Err(e),
            Err(_) => return Ok(()),
        }
        let mut query = vec![0u8; u16::from_be_bytes(len) as usize];
        match timeout(TCP_IDLE, stream.read_exact(&mut query)).await {
            Ok(read) => read?,
            Err(_) => return Ok(()),
        };
        let Some(answer) = handler.handle(&query, Protocol::Tcp).await else {
            // Nothing to say (not a query): a TCP client would wait forever.
            return Ok(());
        };
        // `handle` keeps TCP answers within a frame.
        let Ok(len) = u16::try_from(answer.len()) else {
            return Ok(());
        };
        let mut framed = Vec::with_capacity(answer.len() + 2);
        framed.extend_from_slice(&len.to_be_bytes());
        framed.extend_from_slice(&answer);
        stream.write_all(&framed).await?;
    }
}

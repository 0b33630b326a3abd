//! The futures a connection's or stream's task is made of, measured: a
//! spawned future is allocated at its largest state's size for the task's
//! whole life, so what runs only while a connection is set up (TLS and
//! HTTP/2 handshakes, the pool, the netns socket request) must be boxed
//! and freed before the long relay phase (issue 19: idle memory per
//! connection, docs/BENCHMARKS.md). Before that change an outbound
//! connection's task took 18 KiB (release), an inbound stream's 4.7 KiB.
//!
//! `size_of_output` reads the size of the future a function returns from
//! its type alone, so nothing has to be constructed.

use std::{net::SocketAddr, sync::Arc};

use bytes::Bytes;
use h2::{RecvStream, server::SendResponse};
use http::Request;
use tokio::net::TcpStream;
use tokio_util::sync::CancellationToken;
use tracing::Instrument;

use super::super::{PodState, Shared, inbound, outbound};
use super::until_aborted;

/// An outbound connection's task, what each application connection of an
/// enrolled pod holds while open: 3,728 bytes in a debug build (7,184
/// before `until_aborted` made its future inside; release builds are
/// smaller).
const OUTBOUND_TASK_MAX: usize = 4096;
/// An inbound HBONE stream's task, one per CONNECT stream: 2,464 bytes in
/// a debug build (4,192 before).
const INBOUND_STREAM_TASK_MAX: usize = 3072;

fn size_of_output<A, B, C, D, F>(_: impl FnOnce(A, B, C, D) -> F) -> usize {
    std::mem::size_of::<F>()
}

#[test]
fn outbound_connection_task_keeps_no_handshake_state() {
    let size = size_of_output(
        |s: Arc<Shared>, p: Arc<PodState>, t: TcpStream, a: SocketAddr| {
            until_aborted(CancellationToken::new(), move || {
                outbound::serve(s, p, t, a)
            })
        },
    );
    eprintln!("outbound connection task: {size} bytes");
    assert!(
        size <= OUTBOUND_TASK_MAX,
        "an outbound connection's task is {size} bytes (bound {OUTBOUND_TASK_MAX}): \
         is a setup step (handshake, pool, connect) awaited without Box::pin?"
    );
}

#[test]
fn inbound_stream_task_keeps_no_setup_state() {
    type Stream = (Request<RecvStream>, SendResponse<Bytes>);
    let size = size_of_output(
        |s: Arc<Shared>, a: SocketAddr, p: Option<Arc<str>>, r: Stream| {
            until_aborted(CancellationToken::new(), move || {
                inbound::serve_stream(s, a, a, p, None, r.0, r.1).instrument(tracing::Span::none())
            })
        },
    );
    eprintln!("inbound stream task: {size} bytes");
    assert!(
        size <= INBOUND_STREAM_TASK_MAX,
        "an inbound HBONE stream's task is {size} bytes (bound {INBOUND_STREAM_TASK_MAX}): \
         is a setup step (connecting to the application) awaited without Box::pin?"
    );
}

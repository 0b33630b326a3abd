//! HTTP/2 for HBONE: ztunnel's settings, a CONNECT stream's halves (moved
//! by `relay`), and keepalive.

use std::{io, time::Duration};

use bytes::Bytes;
use h2::{Reason, RecvStream, SendStream};

/// HTTP/2 settings (DESIGN: ztunnel's, observed on the wire).
#[derive(Clone, Debug)]
pub struct H2Settings {
    pub stream_window: u32,
    pub connection_window: u32,
    pub max_frame_size: u32,
    /// Streams per pooled connection before the pool opens another.
    pub max_streams_per_connection: usize,
    /// A PING this often on every HBONE connection...
    pub keepalive_interval: Duration,
    /// ...and the connection is dropped when nothing (no PONG) came back for
    /// this long.
    pub keepalive_timeout: Duration,
    /// Largest header block accepted (an oversized one gets 431).
    pub max_header_list_size: u32,
}

impl Default for H2Settings {
    fn default() -> Self {
        Self {
            stream_window: 4 * 1024 * 1024,
            connection_window: 16 * 1024 * 1024,
            max_frame_size: 1024 * 1024,
            max_streams_per_connection: 100,
            keepalive_interval: Duration::from_secs(10),
            keepalive_timeout: Duration::from_secs(20),
            max_header_list_size: 16 * 1024,
        }
    }
}

impl H2Settings {
    pub(crate) fn client(&self) -> h2::client::Builder {
        let mut b = h2::client::Builder::new();
        b.initial_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window)
            .max_frame_size(self.max_frame_size)
            .max_header_list_size(self.max_header_list_size)
            .enable_push(false);
        b
    }

    pub(crate) fn server(&self) -> h2::server::Builder {
        let mut b = h2::server::Builder::new();
        // ztunnel's limit; beyond it h2 refuses the stream (counted through
        // h2_refusals.rs).
        b.max_concurrent_streams(super::limits::MAX_CONCURRENT_STREAMS);
        b.initial_window_size(self.stream_window)
            .initial_connection_window_size(self.connection_window)
            .max_frame_size(self.max_frame_size)
            .max_header_list_size(self.max_header_list_size);
        b
    }
}

/// Sends a PING every `interval` and fails when a PONG has not come back
/// within `timeout` of the last one. Runs until the connection is dropped.
pub(crate) async fn keepalive(mut ping_pong: h2::PingPong, settings: H2Settings) -> io::Error {
    loop {
        crate::timers::sleep(settings.keepalive_interval).await;
        let pong = crate::timers::timeout(
            settings.keepalive_timeout,
            ping_pong.ping(h2::Ping::opaque()),
        );
        match pong.await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return h2_to_io(e),
            Err(_) => {
                return io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!("no PING answer within {:?}", settings.keepalive_timeout),
                );
            }
        }
    }
}

/// One CONNECT stream, whose bytes `relay` moves to and from a TCP
/// connection: the peer's DATA frames in, DATA frames within flow control
/// out, END_STREAM as a TCP half-close on the far side.
pub(crate) struct H2Stream {
    pub(super) send: SendStream<Bytes>,
    pub(super) recv: RecvStream,
    /// Unwritten rest of the last DATA frame received.
    pub(super) pending: Bytes,
}

impl H2Stream {
    pub fn new(send: SendStream<Bytes>, recv: RecvStream) -> Self {
        Self {
            send,
            recv,
            pending: Bytes::new(),
        }
    }

    /// Resets the stream (after an error on the other side of the copy), so
    /// the peer sees a failure rather than a clean end.
    pub fn reset(&mut self, reason: Reason) {
        self.send.send_reset(reason);
    }
}

pub(crate) fn h2_to_io(e: h2::Error) -> io::Error {
    if e.is_io() {
        e.into_io()
            .unwrap_or_else(|| io::Error::other("h2 I/O error"))
    } else {
        io::Error::other(e)
    }
}

//! HTTP/2 for HBONE: ztunnel's settings, a byte-stream view of a CONNECT
//! stream, and keepalive.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
    time::Duration,
};

use bytes::{Buf, Bytes};
use h2::{Reason, RecvStream, SendStream};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

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
        tokio::time::sleep(settings.keepalive_interval).await;
        let pong = tokio::time::timeout(
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

/// One CONNECT stream as a byte stream: reads are the peer's DATA frames,
/// writes become DATA frames within flow control, shutdown sends
/// END_STREAM (a TCP half-close on the far side).
pub(crate) struct H2Stream {
    send: SendStream<Bytes>,
    recv: RecvStream,
    /// Unread rest of the last DATA frame.
    pending: Bytes,
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

impl AsyncRead for H2Stream {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        while self.pending.is_empty() {
            match ready!(self.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // Hand the window back as soon as the bytes are ours:
                    // the copy buffer, not h2, bounds what is in flight.
                    let len = data.len();
                    if let Err(e) = self.recv.flow_control().release_capacity(len) {
                        return Poll::Ready(Err(h2_to_io(e)));
                    }
                    self.pending = data;
                }
                // END_STREAM: EOF for the reader.
                None => return Poll::Ready(Ok(())),
                Some(Err(e)) => {
                    return Poll::Ready(match e.reason() {
                        // The peer finished abruptly but cleanly.
                        Some(Reason::NO_ERROR) | Some(Reason::CANCEL) => Err(io::Error::new(
                            io::ErrorKind::ConnectionReset,
                            e.to_string(),
                        )),
                        _ => Err(h2_to_io(e)),
                    });
                }
            }
        }
        let n = self.pending.len().min(buf.remaining());
        buf.put_slice(&self.pending[..n]);
        self.pending.advance(n);
        Poll::Ready(Ok(()))
    }
}

impl AsyncWrite for H2Stream {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        self.send.reserve_capacity(buf.len());
        // Errors from poll_capacity/send_data are reported by poll_reset,
        // which says why the stream died.
        let capacity = loop {
            match ready!(self.send.poll_capacity(cx)) {
                // Capacity rose and was used up again: wait for more (the
                // next poll registers the waker).
                Some(Ok(0)) => continue,
                other => break other,
            }
        };
        let written = match capacity {
            Some(Ok(0)) => None,
            Some(Ok(n)) => self
                .send
                .send_data(Bytes::copy_from_slice(&buf[..n]), false)
                .ok()
                .map(|()| n),
            Some(Err(_)) | None => None,
        };
        if let Some(n) = written {
            return Poll::Ready(Ok(n));
        }
        Poll::Ready(Err(match ready!(self.send.poll_reset(cx)) {
            Ok(reason) => io::Error::new(
                io::ErrorKind::BrokenPipe,
                format!("stream reset by peer: {reason}"),
            ),
            Err(e) => h2_to_io(e),
        }))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // h2 writes frames as the connection task gets to them.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // END_STREAM; an already-reset stream is a clean shutdown too.
        let _ = self.send.send_data(Bytes::new(), true);
        Poll::Ready(Ok(()))
    }
}

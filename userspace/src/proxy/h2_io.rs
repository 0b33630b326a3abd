//! A CONNECT stream as a byte stream (`AsyncRead` + `AsyncWrite`), for a
//! protocol carried inside it: the inner TLS of double HBONE
//! (`double_hbone.rs`). The relay (`relay.rs`) moves frames itself and
//! does not use this.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::h2::{H2Stream, h2_to_io};

/// Reads are the peer's DATA frames (their window handed back as they are
/// taken); writes are DATA frames within flow control; shutdown sends
/// END_STREAM.
pub(crate) struct H2Io {
    stream: H2Stream,
    /// END_STREAM has been sent.
    shut: bool,
}

impl H2Io {
    pub fn new(stream: H2Stream) -> Self {
        Self {
            stream,
            shut: false,
        }
    }
}

impl AsyncRead for H2Io {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        loop {
            if !this.stream.pending.is_empty() {
                let n = this.stream.pending.len().min(buf.remaining());
                buf.put_slice(&this.stream.pending[..n]);
                this.stream.pending.advance(n);
                return Poll::Ready(Ok(()));
            }
            match ready!(this.stream.recv.poll_data(cx)) {
                Some(Ok(data)) => {
                    // The window goes back as the frame is taken: h2's
                    // receive window bounds what waits here (one frame).
                    let _ = this.stream.recv.flow_control().release_capacity(data.len());
                    this.stream.pending = data;
                }
                Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
                // END_STREAM: EOF.
                None => return Poll::Ready(Ok(())),
            }
        }
    }
}

impl AsyncWrite for H2Io {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let this = self.get_mut();
        if buf.is_empty() {
            return Poll::Ready(Ok(0));
        }
        let send = &mut this.stream.send;
        send.reserve_capacity(buf.len());
        loop {
            match ready!(send.poll_capacity(cx)) {
                Some(Ok(0)) => continue,
                Some(Ok(n)) => {
                    let n = n.min(buf.len());
                    send.send_data(Bytes::copy_from_slice(&buf[..n]), false)
                        .map_err(h2_to_io)?;
                    return Poll::Ready(Ok(n));
                }
                Some(Err(e)) => return Poll::Ready(Err(h2_to_io(e))),
                None => {
                    return Poll::Ready(Err(io::Error::new(
                        io::ErrorKind::BrokenPipe,
                        "the CONNECT stream is closed",
                    )));
                }
            }
        }
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        // h2 writes out what it was given on its connection task.
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.shut {
            this.shut = true;
            // An already-reset stream has ended as well.
            let _ = this.stream.send.send_data(Bytes::new(), true);
        }
        Poll::Ready(Ok(()))
    }
}

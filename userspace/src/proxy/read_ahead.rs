//! The TCP stream under an HBONE connection's TLS: while bytes stream in,
//! it reads the socket in large pieces.
//!
//! rustls reads the socket into its record buffer at most one record
//! (≈ 18 KiB) at a time, so a bulk transfer arriving over HBONE cost about
//! four and a half `recvfrom` calls per 64 KiB (counted: 38,112 reads for
//! ≈ 525 MB on the receiving agent, against 8,445 of 62 KiB on the sending
//! agent's application socket). Each call pays the kernel's entry, the
//! socket lock and, as the window opens a little at a time, ACKs.
//!
//! So: a read that fills the caller's buffer whole means more is waiting;
//! the next read goes into a [`AHEAD`]-byte buffer of the stream's own and
//! is handed up from memory (one copy more in userspace, several system
//! calls fewer). A read into that buffer that comes back less than half
//! full ends it, and the buffer is freed once drained: request/response
//! traffic reads straight into the caller's buffer and an idle connection
//! holds nothing. Writes pass straight through.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, BytesMut};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

/// The read-ahead buffer's size: one read of a streaming connection.
pub(crate) const AHEAD: usize = 64 * 1024;

/// `io`, reading ahead while bytes stream in (see the module comment).
#[derive(Debug)]
pub(crate) struct ReadAhead<T> {
    io: T,
    /// Bytes read ahead and not yet handed up (no allocation when empty).
    buf: BytesMut,
    /// The last read filled what it was given: read ahead next.
    streaming: bool,
}

impl<T> ReadAhead<T> {
    pub(crate) fn new(io: T) -> Self {
        ReadAhead {
            io,
            buf: BytesMut::new(),
            streaming: false,
        }
    }

    /// Hands up what was read ahead; frees the buffer once it is drained.
    fn hand_up(&mut self, out: &mut ReadBuf<'_>) {
        let n = out.remaining().min(self.buf.len());
        out.put_slice(&self.buf[..n]);
        self.buf.advance(n);
        if self.buf.is_empty() {
            self.buf = BytesMut::new();
        }
    }

    /// Bytes read ahead and not yet handed up (for tests).
    #[cfg(test)]
    fn buffered(&self) -> usize {
        self.buf.len()
    }
}

impl<T: AsyncRead + Unpin> AsyncRead for ReadAhead<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        if !this.buf.is_empty() {
            this.hand_up(out);
            return Poll::Ready(Ok(()));
        }
        if out.remaining() == 0 {
            return Poll::Ready(Ok(()));
        }
        if !this.streaming || out.remaining() >= AHEAD {
            let before = out.filled().len();
            ready!(Pin::new(&mut this.io).poll_read(cx, out))?;
            this.streaming = out.filled().len() > before && out.remaining() == 0;
            return Poll::Ready(Ok(()));
        }
        // Uninitialised capacity, filled by the read (no zeroing).
        let mut buf = BytesMut::with_capacity(AHEAD);
        // On `Pending` the buffer is dropped: nothing held while waiting.
        let n = ready!(tokio_util::io::poll_read_buf(
            Pin::new(&mut this.io),
            cx,
            &mut buf
        ))?;
        this.streaming = n >= AHEAD / 2;
        if n > 0 {
            this.buf = buf;
            this.hand_up(out);
        }
        Poll::Ready(Ok(()))
    }
}

impl<T: AsyncWrite + Unpin> AsyncWrite for ReadAhead<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write(cx, buf)
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.get_mut().io).poll_write_vectored(cx, bufs)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.get_mut().io).poll_shutdown(cx)
    }
}

#[cfg(test)]
#[path = "read_ahead_tests.rs"]
mod tests;

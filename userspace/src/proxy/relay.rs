//! The HBONE data path: bytes between a TCP connection (the application's,
//! or the one to it) and a CONNECT stream, both directions in one task.
//!
//! Unlike a generic copy (`tokio::io::copy_bidirectional`, two 64 KiB
//! buffers per connection for its whole life), this keeps no buffer while a
//! connection is idle, and copies each byte once in userspace:
//!
//! - TCP → HTTP/2: when the socket is readable, one read into the worker
//!   thread's scratch buffer, and the bytes read are copied once into the
//!   `Bytes` handed to h2 (which h2 owns until it has framed and encrypted
//!   them). What flow control does not let through yet waits in that `Bytes`
//!   (at most one read, [`SCRATCH`] bytes), and the socket is not read again
//!   until it has gone. While a connection streams (its last read filled at
//!   least [`BULK`] bytes) it reads straight into a buffer of its own that
//!   h2 then owns, of [`SCRATCH`] bytes, or of [`BULK_READ`] while reads
//!   fill at least half of that ([`next_read`]): no copy at all, one
//!   allocation per read instead of a copy. A short read ends that, and the
//!   buffer with it.
//! - HTTP/2 → TCP: the DATA frames' `Bytes` (h2's own, from the decrypted
//!   records) are written to the socket as they are; no copy buffer at
//!   all. The frames ready at once, up to [`WRITE_BATCH`] bytes, are taken
//!   together and written with one `writev`; each frame's window is handed
//!   back as it is taken (the batch bounds what is held here, h2's receive
//!   window what is queued behind it).
//!
//! Half-close as before: EOF from TCP sends END_STREAM, END_STREAM shuts
//! the socket's write half; the relay ends when both directions have.
//! Each write is told to the connection's [`Meter`] (the metrics' bytes,
//! counted as they move).
//!
//! [`relay_tcp`] is the plaintext relay (passthrough, inbound plaintext)
//! between two TCP connections, with the same reads: nothing held while a
//! connection is idle, where `tokio::io::copy_bidirectional` keeps two
//! 64 KiB buffers per connection for its whole life (≈ 128 KiB per idle
//! passthrough connection, docs/BENCHMARKS.md).

use std::{
    cell::RefCell,
    collections::VecDeque,
    future::poll_fn,
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use bytes::{Buf, Bytes, BytesMut};
use h2::{Reason, RecvStream, SendStream};
use tokio::{
    io::{AsyncRead, AsyncWrite, ReadBuf},
    net::TcpStream,
};

use super::{
    h2::{H2Stream, h2_to_io},
    observe::Meter,
};

/// Largest single read from a TCP socket (the old per-connection copy
/// buffer's size: smaller capped throughput in measurements).
pub(crate) const SCRATCH: usize = 64 * 1024;

/// A read at least this large means the connection is streaming: the next
/// read goes straight into a buffer h2 will own (see the module comment).
/// Request/response traffic stays far below it and keeps no buffer.
const BULK: usize = SCRATCH / 2;

/// A streaming connection with more waiting than [`SCRATCH`] reads up to
/// this much at once (as ztunnel's largest copy buffer): a quarter of the
/// reads of 64 KiB ones, and fewer TLS flushes and wake-ups
/// (docs/BENCHMARKS.md, "Bulk: fewer, larger reads and writes").
const BULK_READ: usize = 256 * 1024;

/// DATA frames written to the socket in one `writev`, at most.
const BATCH_FRAMES: usize = 16;

/// Bytes of DATA frames gathered for one `writev`, at most (one frame more
/// can pass it).
const WRITE_BATCH: usize = 256 * 1024;

thread_local! {
    /// One read buffer per worker thread, shared by every connection it
    /// runs: a connection only uses it within one poll, to copy out what
    /// it read.
    static SCRATCH_BUFFER: RefCell<Box<[u8]>> = RefCell::new(vec![0u8; SCRATCH].into_boxed_slice());
}

/// Moves bytes both ways between `tcp` and `stream` until both directions
/// have ended, counting them into `meter` as they are written. Returns the
/// bytes TCP → HTTP/2 and HTTP/2 → TCP.
pub(crate) async fn relay(
    tcp: &mut TcpStream,
    stream: &mut H2Stream,
    meter: Meter<'_>,
) -> io::Result<(u64, u64)> {
    let mut up = Up::default();
    let mut down = Down::default();
    poll_fn(|cx| {
        let up_done = match up.poll(cx, tcp, &mut stream.send, meter) {
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => false,
        };
        let down_done = match down.poll(cx, tcp, &mut stream.recv, &mut stream.pending, meter) {
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => false,
        };
        if up_done && down_done {
            Poll::Ready(Ok((up.bytes, down.bytes)))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// TCP → HTTP/2.
#[derive(Default)]
struct Up {
    /// Read from TCP, not yet given to h2 (waiting for window).
    pending: Bytes,
    /// TCP said EOF; END_STREAM goes out once `pending` has.
    eof: bool,
    done: bool,
    bytes: u64,
    /// What the next read goes into (see [`next_read`]).
    read: ReadInto,
    /// The streaming read's buffer, kept only while that read waits for
    /// the socket (so a wake-up without data allocates nothing).
    own: Option<BytesMut>,
}

impl Up {
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        tcp: &mut TcpStream,
        send: &mut SendStream<Bytes>,
        meter: Meter<'_>,
    ) -> Poll<io::Result<()>> {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            if !self.pending.is_empty() {
                send.reserve_capacity(self.pending.len());
                match ready!(send.poll_capacity(cx)) {
                    // Capacity rose and was used up again: wait for more
                    // (the next poll registers the waker).
                    Some(Ok(0)) => continue,
                    Some(Ok(n)) => {
                        let chunk = self.pending.split_to(n.min(self.pending.len()));
                        let len = chunk.len() as u64;
                        if send.send_data(chunk, false).is_err() {
                            return Poll::Ready(Err(ready!(reset_error(send, cx))));
                        }
                        self.bytes += len;
                        meter.forward(len);
                        continue;
                    }
                    Some(Err(_)) | None => return Poll::Ready(Err(ready!(reset_error(send, cx)))),
                }
            }
            if self.eof {
                // END_STREAM; an already-reset stream is a clean end too.
                let _ = send.send_data(Bytes::new(), true);
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            // `poll_read`, not `poll_read_ready` + `try_read`: a read that
            // fills less than the buffer has drained the socket, and tokio
            // then clears the readiness itself, so the next poll waits for
            // epoll instead of paying a `recvfrom` that says EAGAIN (one
            // per request on a request/response connection).
            match ready!(poll_read_chunk(cx, tcp, self.read, &mut self.own)) {
                Ok(data) if data.is_empty() => self.eof = true,
                Ok(data) => {
                    self.read = next_read(self.read, data.len());
                    self.pending = data;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

/// Where a connection's next read goes.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) enum ReadInto {
    /// The worker thread's scratch buffer, copied out.
    #[default]
    Scratch,
    /// A buffer of the connection's own of this many bytes, which becomes
    /// the `Bytes` (no copy).
    Own(usize),
}

/// Where the read after one into `read` that returned `len` bytes goes:
/// the scratch buffer below [`BULK`] (request/response); a [`SCRATCH`]-sized
/// buffer of the connection's own while it streams; a [`BULK_READ`] one
/// after a read that filled a [`SCRATCH`] one, for as long as reads fill at
/// least half of it — so a buffer h2 holds is at least half used, as with
/// the smaller one, but for the read that ends a streak.
pub(super) fn next_read(read: ReadInto, len: usize) -> ReadInto {
    match read {
        _ if len < BULK => ReadInto::Scratch,
        ReadInto::Own(SCRATCH) if len == SCRATCH => ReadInto::Own(BULK_READ),
        ReadInto::Own(BULK_READ) if len >= BULK_READ / 2 => ReadInto::Own(BULK_READ),
        _ => ReadInto::Own(SCRATCH),
    }
}

/// One read from `tcp`: into the worker thread's scratch buffer, copied out
/// into a `Bytes` of exactly what came; or, while the connection streams,
/// into a buffer of its own that becomes the `Bytes` (no copy). On
/// `Pending` that buffer is kept in `own` for the next poll. An empty
/// `Bytes` is EOF.
fn poll_read_chunk(
    cx: &mut Context<'_>,
    tcp: &mut TcpStream,
    read: ReadInto,
    own: &mut Option<BytesMut>,
) -> Poll<io::Result<Bytes>> {
    let ReadInto::Own(size) = read else {
        return SCRATCH_BUFFER.with(|scratch| {
            let mut scratch = scratch.borrow_mut();
            let mut buf = ReadBuf::new(&mut scratch[..]);
            Pin::new(&mut *tcp)
                .poll_read(cx, &mut buf)
                .map_ok(|()| Bytes::copy_from_slice(buf.filled()))
        });
    };
    let mut buf = own.take().unwrap_or_else(|| BytesMut::with_capacity(size));
    match tokio_util::io::poll_read_buf(Pin::new(tcp), cx, &mut buf) {
        Poll::Pending => {
            *own = Some(buf);
            Poll::Pending
        }
        Poll::Ready(result) => Poll::Ready(result.map(|_| buf.freeze())),
    }
}

/// Writes `pending` to `tcp` until it is empty, counting into `bytes` and
/// telling `written` of each write.
fn poll_write_all(
    cx: &mut Context<'_>,
    tcp: &mut TcpStream,
    pending: &mut Bytes,
    bytes: &mut u64,
    written: impl Fn(u64),
) -> Poll<io::Result<()>> {
    while !pending.is_empty() {
        let n = ready!(Pin::new(&mut *tcp).poll_write(cx, pending))?;
        if n == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        *bytes += n as u64;
        written(n as u64);
        if n == pending.len() {
            // Not `advance`: an emptied `Bytes` still holds its share of
            // the buffer it came from (h2's read buffer, or a 64 KiB read),
            // for as long as the connection then stays idle.
            *pending = Bytes::new();
        } else {
            pending.advance(n);
        }
    }
    Poll::Ready(Ok(()))
}

/// Why sending on the stream failed: the peer's reset reason, or the
/// connection's error.
fn reset_error(send: &mut SendStream<Bytes>, cx: &mut Context<'_>) -> Poll<io::Error> {
    Poll::Ready(match ready!(send.poll_reset(cx)) {
        Ok(reason) => io::Error::new(
            io::ErrorKind::BrokenPipe,
            format!("stream reset by peer: {reason}"),
        ),
        Err(e) => h2_to_io(e),
    })
}

/// HTTP/2 → TCP.
#[derive(Default)]
struct Down {
    /// Frames taken after the first one (which waits in the stream's
    /// `pending`) when several were ready at once: written together, with
    /// one `writev`. Empty, and without a buffer, between bursts.
    rest: VecDeque<Bytes>,
    /// The stream failed after frames still to be written came: reported
    /// once they are.
    failed: Option<io::Error>,
    /// END_STREAM came; the socket's write half is shut once everything
    /// taken is written.
    eof: bool,
    done: bool,
    bytes: u64,
}

impl Down {
    fn poll(
        &mut self,
        cx: &mut Context<'_>,
        tcp: &mut TcpStream,
        recv: &mut RecvStream,
        pending: &mut Bytes,
        meter: Meter<'_>,
    ) -> Poll<io::Result<()>> {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        // h2 said Pending during this poll (its waker is set): once what was
        // taken is written there is nothing to ask it again for.
        let mut h2_waits = false;
        loop {
            ready!(poll_write_frames(
                cx,
                tcp,
                pending,
                &mut self.rest,
                &mut self.bytes,
                |n| { meter.back(n) }
            ))?;
            if let Some(e) = self.failed.take() {
                return Poll::Ready(Err(e));
            }
            if self.eof {
                ready!(Pin::new(&mut *tcp).poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            if h2_waits {
                return Poll::Pending;
            }
            // Take what is ready, up to a batch.
            let mut taken = 0;
            while taken < WRITE_BATCH && self.rest.len() < BATCH_FRAMES - 1 {
                match recv.poll_data(cx) {
                    Poll::Ready(Some(Ok(data))) => {
                        // Hand the window back as soon as the frame is
                        // ours: what waits here is bounded by the batch,
                        // and h2's window bounds what waits behind it.
                        if let Err(e) = recv.flow_control().release_capacity(data.len()) {
                            self.failed = Some(h2_to_io(e));
                            break;
                        }
                        taken += data.len();
                        if pending.is_empty() {
                            *pending = data;
                        } else if !data.is_empty() {
                            self.rest.push_back(data);
                        }
                    }
                    // END_STREAM: EOF.
                    Poll::Ready(None) => {
                        self.eof = true;
                        break;
                    }
                    Poll::Ready(Some(Err(e))) => {
                        self.failed = Some(match e.reason() {
                            // The peer finished abruptly but cleanly.
                            Some(Reason::NO_ERROR) | Some(Reason::CANCEL) => {
                                io::Error::new(io::ErrorKind::ConnectionReset, e.to_string())
                            }
                            _ => h2_to_io(e),
                        });
                        break;
                    }
                    Poll::Pending if taken == 0 => return Poll::Pending,
                    Poll::Pending => {
                        h2_waits = true;
                        break;
                    }
                }
            }
        }
    }
}

/// Writes `first`, then every frame of `rest`, to `tcp`: one `write` for a
/// lone frame, one `writev` for up to [`BATCH_FRAMES`] of them; counts into
/// `bytes` and tells `written` of each write.
fn poll_write_frames(
    cx: &mut Context<'_>,
    tcp: &mut TcpStream,
    first: &mut Bytes,
    rest: &mut VecDeque<Bytes>,
    bytes: &mut u64,
    written: impl Fn(u64) + Copy,
) -> Poll<io::Result<()>> {
    loop {
        if first.is_empty() {
            match rest.pop_front() {
                Some(next) => *first = next,
                None => break,
            }
        }
        if rest.is_empty() {
            ready!(poll_write_all(cx, tcp, first, bytes, written))?;
            continue;
        }
        let mut slices = [io::IoSlice::new(&[]); BATCH_FRAMES];
        slices[0] = io::IoSlice::new(first);
        let used = 1 + rest.len().min(BATCH_FRAMES - 1);
        for (slice, frame) in slices[1..used].iter_mut().zip(rest.iter()) {
            *slice = io::IoSlice::new(frame);
        }
        let mut n = ready!(Pin::new(&mut *tcp).poll_write_vectored(cx, &slices[..used]))?;
        if n == 0 {
            return Poll::Ready(Err(io::ErrorKind::WriteZero.into()));
        }
        *bytes += n as u64;
        written(n as u64);
        if n >= first.len() {
            n -= first.len();
            *first = Bytes::new();
            while let Some(front) = rest.front_mut() {
                if n < front.len() {
                    front.advance(n);
                    break;
                }
                n -= front.len();
                rest.pop_front();
            }
        } else {
            first.advance(n);
        }
    }
    // A burst is over: no buffer kept for an idle connection.
    if rest.capacity() > 0 {
        *rest = VecDeque::new();
    }
    Poll::Ready(Ok(()))
}

/// Moves bytes both ways between two TCP connections until both directions
/// have ended, honouring half-close (EOF from one side shuts the other's
/// write half), counting them into `meter` as they are written. Returns
/// the bytes `a` → `b` and `b` → `a`.
pub(crate) async fn relay_tcp(
    a: &mut TcpStream,
    b: &mut TcpStream,
    meter: Meter<'_>,
) -> io::Result<(u64, u64)> {
    let mut a_to_b = TcpToTcp::default();
    let mut b_to_a = TcpToTcp::default();
    poll_fn(|cx| {
        let forward_done = match a_to_b.poll(cx, a, b, |n| meter.forward(n)) {
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => false,
        };
        let back_done = match b_to_a.poll(cx, b, a, |n| meter.back(n)) {
            Poll::Ready(Ok(())) => true,
            Poll::Ready(Err(e)) => return Poll::Ready(Err(e)),
            Poll::Pending => false,
        };
        if forward_done && back_done {
            Poll::Ready(Ok((a_to_b.bytes, b_to_a.bytes)))
        } else {
            Poll::Pending
        }
    })
    .await
}

/// One direction of [`relay_tcp`]: what was read and not yet written is
/// held (at most one read), and the source is not read again until it has
/// gone.
#[derive(Default)]
pub(super) struct TcpToTcp {
    pending: Bytes,
    /// The source said EOF; the destination's write half is shut once
    /// `pending` is written.
    eof: bool,
    done: bool,
    /// Bytes written to the destination.
    pub(super) bytes: u64,
    /// What the next read goes into (see [`next_read`]).
    read: ReadInto,
    own: Option<BytesMut>,
}

impl TcpToTcp {
    /// Nothing read and unwritten, and no buffer kept for the next read.
    #[cfg(test)]
    pub(super) fn holds_nothing(&self) -> bool {
        self.pending.is_empty() && self.own.is_none()
    }

    pub(super) fn poll(
        &mut self,
        cx: &mut Context<'_>,
        from: &mut TcpStream,
        to: &mut TcpStream,
        written: impl Fn(u64),
    ) -> Poll<io::Result<()>> {
        if self.done {
            return Poll::Ready(Ok(()));
        }
        loop {
            ready!(poll_write_all(
                cx,
                to,
                &mut self.pending,
                &mut self.bytes,
                &written
            ))?;
            if self.eof {
                ready!(Pin::new(&mut *to).poll_shutdown(cx))?;
                self.done = true;
                return Poll::Ready(Ok(()));
            }
            match ready!(poll_read_chunk(cx, from, self.read, &mut self.own)) {
                Ok(data) if data.is_empty() => self.eof = true,
                Ok(data) => {
                    self.read = next_read(self.read, data.len());
                    self.pending = data;
                }
                Err(e) => return Poll::Ready(Err(e)),
            }
        }
    }
}

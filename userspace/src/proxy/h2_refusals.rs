//! The refusals h2 makes on its own, seen where they cannot be missed: in
//! the frames it writes.
//!
//! h2 answers much hostile input itself and tells the application nothing:
//! a stream over `SETTINGS_MAX_CONCURRENT_STREAMS` gets `RST_STREAM
//! (REFUSED_STREAM)`, headers over `max_header_list_size` a 431 and
//! `RST_STREAM(PROTOCOL_ERROR)`, a malformed request (an unparsable
//! `:authority`) `RST_STREAM(PROTOCOL_ERROR)`; floods (rapid reset,
//! CONTINUATION, headers far over the limit) a GOAWAY with
//! `ENHANCE_YOUR_CALM` and a debug string naming the flood. None of these
//! reaches `accept` as a request; only the GOAWAYs end `accept` with an
//! error, after the fact. So the server's side of the connection is written
//! through [`FrameTap`], which reads the frame headers h2 writes (nothing
//! is changed or delayed; payloads are skipped, except the few bytes of
//! RST_STREAM and GOAWAY) and reports each refusal.
//!
//! The proxy itself only ever resets a stream with `CANCEL` (a failed
//! copy, a revoked policy), and h2 resets with `CANCEL` streams the
//! application dropped: those are no refusal and not reported. A GOAWAY
//! with `NO_ERROR` is a graceful close (drain), not reported either.
//!
//! Not visible here: frames h2 ignores silently (on closed streams, unknown
//! types), and anything after the connection's transport failed (nothing
//! is written then).

use std::{
    io,
    pin::Pin,
    task::{Context, Poll, ready},
};

use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};

use super::limits::RefusalReason;

const FRAME_HEADER: usize = 9;
const TYPE_HEADERS: u8 = 0x1;
const TYPE_RST_STREAM: u8 = 0x3;
const TYPE_GOAWAY: u8 = 0x7;
const FLAG_END_STREAM: u8 = 0x1;
/// GOAWAY's last-stream-id and error code, then this much debug data.
const GOAWAY_KEPT: usize = 8 + 64;

/// A refusal h2 wrote.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct H2Refusal {
    pub reason: RefusalReason,
    /// What h2 sent, for the access log.
    pub detail: String,
}

/// Reads the frames written through it (see the module doc).
#[derive(Debug, Default)]
pub(crate) struct FrameParser {
    header: [u8; FRAME_HEADER],
    header_len: usize,
    /// Payload bytes of the current frame still to come.
    payload_left: usize,
    /// The current frame's kept payload (RST_STREAM, GOAWAY).
    kept: Vec<u8>,
    keep: usize,
    /// Streams h2 recently ended with a HEADERS frame (an answer with
    /// END_STREAM): a PROTOCOL_ERROR reset right after one is the reset that
    /// follows h2's own 431.
    ended_by_headers: [u32; 8],
    ended_next: usize,
}

impl FrameParser {
    /// Feeds bytes written (in order, each once); reports each refusal.
    pub fn feed(&mut self, mut bytes: &[u8], mut report: impl FnMut(H2Refusal)) {
        while !bytes.is_empty() {
            if self.header_len < FRAME_HEADER {
                let n = (FRAME_HEADER - self.header_len).min(bytes.len());
                self.header[self.header_len..self.header_len + n].copy_from_slice(&bytes[..n]);
                self.header_len += n;
                bytes = &bytes[n..];
                if self.header_len == FRAME_HEADER {
                    self.start_frame(&mut report);
                }
                continue;
            }
            let n = self.payload_left.min(bytes.len());
            if self.kept.len() < self.keep {
                let k = (self.keep - self.kept.len()).min(n);
                self.kept.extend_from_slice(&bytes[..k]);
            }
            self.payload_left -= n;
            bytes = &bytes[n..];
            if self.payload_left == 0 {
                self.end_frame(&mut report);
            }
        }
    }

    fn kind(&self) -> u8 {
        self.header[3]
    }

    fn stream_id(&self) -> u32 {
        u32::from_be_bytes([
            self.header[5] & 0x7f,
            self.header[6],
            self.header[7],
            self.header[8],
        ])
    }

    fn start_frame(&mut self, report: &mut impl FnMut(H2Refusal)) {
        self.payload_left =
            u32::from_be_bytes([0, self.header[0], self.header[1], self.header[2]]) as usize;
        self.kept.clear();
        self.keep = match self.kind() {
            TYPE_RST_STREAM => 4,
            TYPE_GOAWAY => GOAWAY_KEPT,
            _ => 0,
        };
        if self.kind() == TYPE_HEADERS && self.header[4] & FLAG_END_STREAM != 0 {
            self.ended_by_headers[self.ended_next] = self.stream_id();
            self.ended_next = (self.ended_next + 1) % self.ended_by_headers.len();
        }
        if self.payload_left == 0 {
            self.end_frame(report);
        }
    }

    fn end_frame(&mut self, report: &mut impl FnMut(H2Refusal)) {
        let refusal = match self.kind() {
            TYPE_RST_STREAM if self.kept.len() == 4 => self.rst_stream(),
            TYPE_GOAWAY if self.kept.len() >= 8 => self.goaway(),
            _ => None,
        };
        self.header_len = 0;
        self.kept.clear();
        if let Some(r) = refusal {
            report(r);
        }
    }

    fn rst_stream(&self) -> Option<H2Refusal> {
        let code = u32::from_be_bytes([self.kept[0], self.kept[1], self.kept[2], self.kept[3]]);
        let reason = h2::Reason::from(code);
        let stream = self.stream_id();
        let what = match reason {
            h2::Reason::NO_ERROR | h2::Reason::CANCEL => return None,
            h2::Reason::REFUSED_STREAM => RefusalReason::H2RefusedStream,
            h2::Reason::PROTOCOL_ERROR if self.ended_by_headers.contains(&stream) => {
                RefusalReason::H2HeadersTooLarge
            }
            h2::Reason::PROTOCOL_ERROR => RefusalReason::H2Malformed,
            _ => RefusalReason::H2StreamError,
        };
        let detail = match what {
            RefusalReason::H2RefusedStream => format!(
                "h2 refused stream {stream}: over SETTINGS_MAX_CONCURRENT_STREAMS (RST_STREAM {reason:?})"
            ),
            RefusalReason::H2HeadersTooLarge => format!(
                "h2 answered stream {stream} 431: request headers over max_header_list_size"
            ),
            RefusalReason::H2Malformed => {
                format!("h2 reset stream {stream}: malformed request (RST_STREAM {reason:?})")
            }
            _ => format!("h2 reset stream {stream}: RST_STREAM {reason:?}"),
        };
        Some(H2Refusal {
            reason: what,
            detail,
        })
    }

    fn goaway(&self) -> Option<H2Refusal> {
        let code = u32::from_be_bytes([self.kept[4], self.kept[5], self.kept[6], self.kept[7]]);
        let reason = h2::Reason::from(code);
        if reason == h2::Reason::NO_ERROR {
            return None;
        }
        let debug = String::from_utf8_lossy(&self.kept[8..]).into_owned();
        let what = match debug.as_str() {
            "too_many_resets" => RefusalReason::H2RapidReset,
            "too_many_continuations" => RefusalReason::H2ContinuationFlood,
            "header_list_way_too_large" => RefusalReason::H2HeaderFlood,
            _ => RefusalReason::H2GoAway,
        };
        let detail = match debug.is_empty() {
            true => format!("h2 closed the connection: GOAWAY {reason:?}"),
            false => format!("h2 closed the connection: GOAWAY {reason:?} ({debug})"),
        };
        Some(H2Refusal {
            reason: what,
            detail,
        })
    }
}

/// The server side of an HBONE connection, written through a
/// [`FrameParser`]; reads pass through untouched.
pub(crate) struct FrameTap<S, F> {
    inner: S,
    parser: FrameParser,
    report: F,
}

impl<S, F: FnMut(H2Refusal)> FrameTap<S, F> {
    pub fn new(inner: S, report: F) -> Self {
        Self {
            inner,
            parser: FrameParser::default(),
            report,
        }
    }
}

impl<S: AsyncRead + Unpin, F: Unpin> AsyncRead for FrameTap<S, F> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin, F: FnMut(H2Refusal) + Unpin> AsyncWrite for FrameTap<S, F> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut self.inner).poll_write(cx, buf))?;
        let this = &mut *self;
        this.parser.feed(&buf[..n], &mut this.report);
        Poll::Ready(Ok(n))
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let n = ready!(Pin::new(&mut self.inner).poll_write_vectored(cx, bufs))?;
        let this = &mut *self;
        let mut left = n;
        for b in bufs {
            if left == 0 {
                break;
            }
            let take = left.min(b.len());
            this.parser.feed(&b[..take], &mut this.report);
            left -= take;
        }
        Poll::Ready(Ok(n))
    }

    fn is_write_vectored(&self) -> bool {
        self.inner.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.inner).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
        let len = payload.len() as u32;
        let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
        f.extend_from_slice(&stream.to_be_bytes());
        f.extend_from_slice(payload);
        f
    }

    fn rst(stream: u32, reason: h2::Reason) -> Vec<u8> {
        frame(TYPE_RST_STREAM, 0, stream, &u32::from(reason).to_be_bytes())
    }

    fn goaway(reason: h2::Reason, debug: &str) -> Vec<u8> {
        let mut p = 7u32.to_be_bytes().to_vec();
        p.extend_from_slice(&u32::from(reason).to_be_bytes());
        p.extend_from_slice(debug.as_bytes());
        frame(TYPE_GOAWAY, 0, 0, &p)
    }

    /// Feeds `bytes` in pieces of `chunk`; the reasons reported.
    fn reasons(bytes: &[u8], chunk: usize) -> Vec<RefusalReason> {
        let mut parser = FrameParser::default();
        let mut got = Vec::new();
        for piece in bytes.chunks(chunk) {
            parser.feed(piece, |r| got.push(r.reason));
        }
        got
    }

    #[test]
    fn each_refusal_is_named_whatever_the_write_boundaries() {
        let mut bytes = frame(0x4, 0, 0, &[0; 12]); // SETTINGS
        bytes.extend(frame(0x0, 0, 1, &[7; 3000])); // DATA
        bytes.extend(rst(3, h2::Reason::CANCEL)); // ours: not a refusal
        bytes.extend(rst(5, h2::Reason::REFUSED_STREAM));
        bytes.extend(frame(TYPE_HEADERS, 0x5, 7, &[0x88])); // 431, END_STREAM
        bytes.extend(rst(7, h2::Reason::PROTOCOL_ERROR));
        bytes.extend(rst(9, h2::Reason::PROTOCOL_ERROR));
        bytes.extend(rst(11, h2::Reason::FLOW_CONTROL_ERROR));
        bytes.extend(goaway(h2::Reason::NO_ERROR, "")); // drain
        bytes.extend(goaway(h2::Reason::ENHANCE_YOUR_CALM, "too_many_resets"));
        bytes.extend(goaway(
            h2::Reason::ENHANCE_YOUR_CALM,
            "too_many_continuations",
        ));
        bytes.extend(goaway(
            h2::Reason::ENHANCE_YOUR_CALM,
            "header_list_way_too_large",
        ));
        bytes.extend(goaway(h2::Reason::PROTOCOL_ERROR, ""));
        let expected = vec![
            RefusalReason::H2RefusedStream,
            RefusalReason::H2HeadersTooLarge,
            RefusalReason::H2Malformed,
            RefusalReason::H2StreamError,
            RefusalReason::H2RapidReset,
            RefusalReason::H2ContinuationFlood,
            RefusalReason::H2HeaderFlood,
            RefusalReason::H2GoAway,
        ];
        for chunk in [1, 2, 9, 10, 13, 4096, bytes.len()] {
            assert_eq!(reasons(&bytes, chunk), expected, "in pieces of {chunk}");
        }
    }
}

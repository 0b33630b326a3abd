//! `ReadAhead` over a source that has everything available at once (as a
//! socket's receive queue during a bulk transfer), read as rustls reads:
//! through a buffer of one TLS record's size.

use std::{
    io,
    pin::Pin,
    task::{Context, Poll},
};

use tokio::io::{AsyncRead, AsyncReadExt, ReadBuf};

use super::{AHEAD, ReadAhead};

/// rustls's largest read (one record on the wire).
const RECORD: usize = 16 * 1024 + 2048 + 5;

/// An in-memory source that counts the reads it is asked for.
struct Counted {
    data: io::Cursor<Vec<u8>>,
    reads: usize,
}

impl AsyncRead for Counted {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        self.reads += 1;
        Pin::new(&mut self.data).poll_read(cx, buf)
    }
}

fn source(len: usize) -> (Vec<u8>, ReadAhead<Counted>) {
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let counted = Counted {
        data: io::Cursor::new(data.clone()),
        reads: 0,
    };
    (data, ReadAhead::new(counted))
}

/// Reads everything in `RECORD`-sized reads; returns the bytes and how
/// many reads the caller made.
async fn drain(stream: &mut ReadAhead<Counted>) -> (Vec<u8>, usize) {
    let (mut got, mut calls) = (Vec::new(), 0);
    let mut chunk = vec![0u8; RECORD];
    loop {
        calls += 1;
        let n = stream.read(&mut chunk).await.expect("read");
        if n == 0 {
            return (got, calls);
        }
        got.extend_from_slice(&chunk[..n]);
    }
}

#[tokio::test]
async fn a_bulk_transfer_arrives_whole_in_a_quarter_of_the_reads() {
    let (sent, mut stream) = source(4 << 20);
    let (got, calls) = drain(&mut stream).await;
    assert!(got == sent, "the bytes arrived intact and in order");
    let reads = stream.io.reads;
    // One direct read that fills the caller's buffer, then AHEAD at a time.
    let expected = 1 + (sent.len() - RECORD).div_ceil(AHEAD) + 1;
    assert!(
        reads <= expected,
        "{reads} reads of the source for {calls} reads of the caller (at most {expected})"
    );
    assert!(calls > 3 * reads, "{calls} caller reads, {reads} source reads");
    assert_eq!(stream.buffered(), 0);
}

#[tokio::test]
async fn small_messages_are_read_straight_through_and_hold_no_buffer() {
    let (sent, mut stream) = source(100);
    let mut chunk = vec![0u8; RECORD];
    let n = stream.read(&mut chunk).await.expect("read");
    assert_eq!(&chunk[..n], &sent[..]);
    assert_eq!(stream.io.reads, 1);
    assert!(!stream.streaming, "a short read is not a stream");
    assert_eq!(stream.buf.capacity(), 0, "no buffer held");
}

#[tokio::test]
async fn a_short_read_ahead_ends_streaming_and_frees_the_buffer() {
    // One record's worth fills the first read; what follows is under
    // half of AHEAD.
    let (sent, mut stream) = source(RECORD + AHEAD / 4);
    let (got, _) = drain(&mut stream).await;
    assert!(got == sent, "the bytes arrived intact and in order");
    assert!(!stream.streaming, "the short read ahead ended streaming");
    assert_eq!(stream.buf.capacity(), 0, "the drained buffer was freed");
    // Direct, ahead (short), and the read that says EOF.
    assert_eq!(stream.io.reads, 3);
}

//! Fuzzing the HBONE CONNECT request (see `crate::fuzz` for the method):
//! what a peer sends after TLS, mutated, through the real h2 server with
//! the proxy's settings, [`FrameTap`] and the proxy's request checks
//! ([`connect_target`]), which `proxy` exposes to tests for this.

use std::{
    sync::{Arc, Mutex},
    time::Duration,
};

use bytes::Bytes;
use proptest::prelude::*;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use super::{edits, mutate};
use crate::proxy::{FrameParser, FrameTap, H2Refusal, H2Settings, connect_target};

const PREFACE: &[u8] = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n";
const SENTINEL: &[u8; 8] = b"fuzzdone";

fn frame(kind: u8, flags: u8, stream: u32, payload: &[u8]) -> Vec<u8> {
    let len = payload.len() as u32;
    let mut f = vec![(len >> 16) as u8, (len >> 8) as u8, len as u8, kind, flags];
    f.extend_from_slice(&stream.to_be_bytes());
    f.extend_from_slice(payload);
    f
}

/// HPACK literal without indexing, static-table name `index`, raw value.
fn literal(index: u8, value: &[u8]) -> Vec<u8> {
    let mut f = vec![index & 0x0f, value.len() as u8];
    f.extend_from_slice(value);
    f
}

/// What a client sends after the preface: its SETTINGS, a CONNECT with an
/// extra header and a DATA frame, a second CONNECT (IPv6) reset at once, a
/// WINDOW_UPDATE and a PING.
fn seed() -> Vec<u8> {
    let mut out = frame(0x4, 0, 0, &[0, 3, 0, 0, 0, 100]);
    let mut block = literal(2, b"CONNECT");
    block.extend(literal(1, b"198.18.0.1:8080"));
    block.extend_from_slice(&[0x00, 0x03, b'x', b'-', b'a', 0x01, b'b']);
    out.extend(frame(0x1, 0x4, 1, &block));
    out.extend(frame(0x0, 0, 1, b"ping"));
    let mut block = literal(2, b"CONNECT");
    block.extend(literal(1, b"[fd00::1]:80"));
    out.extend(frame(0x1, 0x4, 3, &block));
    out.extend(frame(0x3, 0, 3, &8u32.to_be_bytes()));
    out.extend(frame(0x8, 0, 0, &1000u32.to_be_bytes()));
    out.extend(frame(0x6, 0, 0, &[1, 2, 3, 4, 5, 6, 7, 8]));
    out
}

/// What the server did with one input.
#[derive(Debug, Default)]
struct Outcome {
    /// Targets accepted and refusals (status, reason) of the proxy's checks.
    accepted: Vec<String>,
    refused: Vec<(u16, String)>,
    /// h2's own refusals, as the tap saw them.
    h2: Vec<H2Refusal>,
}

/// Serves `input` (the bytes after the preface) on an in-memory connection.
fn serve(input: Vec<u8>) -> Result<Outcome, String> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| e.to_string())?;
    runtime.block_on(async move {
        let (client, server) = tokio::io::duplex(64 * 1024);
        let h2_refusals = Arc::new(Mutex::new(Vec::new()));
        let seen = h2_refusals.clone();
        let tap = FrameTap::new(server, move |r| {
            seen.lock().unwrap_or_else(|p| p.into_inner()).push(r)
        });
        let server = tokio::spawn(async move {
            let mut outcome = Outcome::default();
            let Ok(mut conn) = H2Settings::default()
                .server()
                .handshake::<_, Bytes>(tap)
                .await
            else {
                return outcome;
            };
            while let Some(Ok((request, mut respond))) = conn.accept().await {
                let status = match connect_target(&request) {
                    Ok(target) => {
                        outcome.accepted.push(target.to_string());
                        http::StatusCode::OK
                    }
                    Err((status, reason)) => {
                        outcome.refused.push((status.as_u16(), reason));
                        status
                    }
                };
                let response = http::Response::builder()
                    .status(status)
                    .body(())
                    .unwrap_or_default();
                let _ = respond.send_response(response, true);
            }
            outcome
        });
        // The input, then a PING whose answer says the server read it all
        // (h2 handles frames in order): only then the end of the stream,
        // which would make h2 drop the requests it has not handed over yet.
        // A mutated frame length can swallow the PING: then the wait is
        // short and the end comes anyway.
        let (mut read, mut write) = tokio::io::split(client);
        let _ = write.write_all(PREFACE).await;
        let _ = write.write_all(&input).await;
        let _ = write.write_all(&frame(0x6, 0, 0, SENTINEL)).await;
        let pong = frame(0x6, 0x1, 0, SENTINEL);
        let mut answer = Vec::new();
        let _ = tokio::time::timeout(Duration::from_millis(200), async {
            let mut buf = [0u8; 4096];
            while let Ok(n) = read.read(&mut buf).await {
                if n == 0 {
                    break;
                }
                answer.extend_from_slice(&buf[..n]);
                if answer.windows(pong.len()).any(|w| w == pong.as_slice()) {
                    break;
                }
            }
        })
        .await;
        let _ = write.shutdown().await;
        let _ = tokio::time::timeout(Duration::from_secs(5), read.read_to_end(&mut answer)).await;
        let mut outcome = match tokio::time::timeout(Duration::from_secs(5), server).await {
            Ok(Ok(outcome)) => outcome,
            Ok(Err(e)) if e.is_panic() => return Err(format!("the server panicked: {e}")),
            Ok(Err(e)) => return Err(e.to_string()),
            Err(_) => return Err("the server did not finish".into()),
        };
        outcome.h2 = std::mem::take(&mut *h2_refusals.lock().unwrap_or_else(|p| p.into_inner()));
        Ok(outcome)
    })
}

#[test]
fn the_seed_is_served() {
    let outcome = serve(seed()).expect("served");
    assert_eq!(
        outcome.accepted.first().map(String::as_str),
        Some("198.18.0.1:8080"),
        "{outcome:?}"
    );
    assert!(outcome.h2.is_empty(), "{outcome:?}");
}

proptest! {
    /// Never a panic (h2, the tap, the checks); a refusal by the proxy
    /// names the method or the authority it refused; h2's refusals are
    /// counted under an h2 reason.
    #[test]
    fn a_mutated_connect_is_served_or_refused_by_name(edits in edits()) {
        let outcome = serve(mutate(&seed(), &edits)).map_err(TestCaseError::fail)?;
        for (status, reason) in &outcome.refused {
            prop_assert!(
                reason.contains("method") || reason.contains("authority"),
                "{status} {reason}"
            );
        }
        for r in &outcome.h2 {
            prop_assert!(r.reason.as_str().starts_with("h2_"), "{r:?}");
            prop_assert!(r.detail.starts_with("h2 "), "{r:?}");
        }
    }

    /// Whatever the bytes and however they are split into writes, the tap
    /// reports the same refusals.
    #[test]
    fn the_frame_tap_reads_any_bytes_the_same_in_any_pieces(
        bytes in prop::collection::vec(any::<u8>(), 0..512),
        piece in 1usize..64,
    ) {
        let whole = {
            let mut p = FrameParser::default();
            let mut got = Vec::new();
            p.feed(&bytes, |r| got.push(r));
            got
        };
        let mut p = FrameParser::default();
        let mut got = Vec::new();
        for chunk in bytes.chunks(piece) {
            p.feed(chunk, |r| got.push(r));
        }
        prop_assert_eq!(got, whole);
    }
}

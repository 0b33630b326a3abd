//! [`relay_tcp`](super::relay::relay_tcp) on real loopback sockets: every
//! byte both ways, half-close honoured, and nothing held once a
//! request/response exchange is done.

use std::{
    future::{Future, poll_fn},
    net::SocketAddr,
    task::Poll,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use super::relay::{TcpToTcp, relay_tcp};

/// A connected pair: what the proxy accepted, and the client's end.
async fn pair() -> (TcpStream, TcpStream) {
    let listener = TcpListener::bind(SocketAddr::from(([127, 0, 0, 1], 0)))
        .await
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let (client, accepted) = tokio::join!(TcpStream::connect(addr), listener.accept());
    (accepted.unwrap().0, client.unwrap())
}

/// Bytes that differ at every offset that matters (period 251).
fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len).map(|i| (i % 251) as u8 ^ seed).collect()
}

#[tokio::test]
async fn relays_every_byte_both_ways_and_passes_half_close_on() {
    let (mut proxy_side, mut client) = pair().await;
    let (mut upstream_side, mut server) = pair().await;
    let relay = tokio::spawn(async move {
        relay_tcp(&mut proxy_side, &mut upstream_side, Default::default()).await
    });

    // Large enough for the streaming reads (several 64 KiB reads in a row)
    // and for writes that wait on a full socket buffer.
    let request = pattern(3 * 1024 * 1024 + 17, 0x5a);
    let response = pattern(2 * 1024 * 1024 + 3, 0xa5);
    // Bounded: a relay that loses a half-close would leave both ends
    // waiting for EOF.
    let exchange = async {
        let request = request.clone();
        let response = response.clone();
        let client_task = tokio::spawn(async move {
            client.write_all(&request).await.unwrap();
            // Half-close: the server must see EOF and still answer.
            client.shutdown().await.unwrap();
            let mut back = Vec::new();
            client.read_to_end(&mut back).await.unwrap();
            back
        });
        let mut got = Vec::new();
        server.read_to_end(&mut got).await.unwrap();
        server.write_all(&response).await.unwrap();
        server.shutdown().await.unwrap();
        (client_task.await.unwrap(), got)
    };
    let (sent, server_got) = tokio::time::timeout(std::time::Duration::from_secs(60), exchange)
        .await
        .expect("the exchange did not finish within 60 s (a half-close lost?)");
    assert_eq!(server_got.len(), request.len());
    assert!(
        server_got == request,
        "the server received other bytes than the client sent"
    );
    assert_eq!(sent.len(), response.len());
    assert!(
        sent == response,
        "the client received other bytes than the server sent"
    );
    let (forward, back) = relay.await.unwrap().unwrap();
    assert_eq!(
        (forward, back),
        (request.len() as u64, response.len() as u64)
    );
}

#[tokio::test]
async fn holds_no_buffer_between_requests() {
    let (mut from, mut client) = pair().await;
    let (mut to, mut server) = pair().await;
    let mut direction = TcpToTcp::default();
    client.write_all(b"ping").await.unwrap();
    let mut got = [0u8; 4];
    // Poll the direction until the server has the request.
    let read = server.read_exact(&mut got);
    tokio::pin!(read);
    poll_fn(|cx| {
        let _ = direction.poll(cx, &mut from, &mut to, |_| {});
        match read.as_mut().poll(cx) {
            Poll::Ready(r) => Poll::Ready(r.map(|_| ())),
            Poll::Pending => Poll::Pending,
        }
    })
    .await
    .unwrap();
    assert_eq!(&got, b"ping");
    // Once more with nothing to read: the direction waits on the socket.
    poll_fn(|cx| {
        assert!(direction.poll(cx, &mut from, &mut to, |_| {}).is_pending());
        Poll::Ready(())
    })
    .await;
    assert_eq!(direction.bytes, 4);
    assert!(
        direction.holds_nothing(),
        "an idle direction keeps a buffer"
    );
}

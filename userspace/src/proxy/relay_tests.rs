//! [`relay_tcp`](super::relay::relay_tcp) and [`relay`](super::relay::relay)
//! on real loopback sockets (and a real HTTP/2 connection for `relay`):
//! every byte both ways, in order, half-close honoured, and nothing held
//! once a request/response exchange is done.

use std::{
    future::{Future, poll_fn},
    net::SocketAddr,
    task::Poll,
};

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::{TcpListener, TcpStream},
};

use bytes::Bytes;

use super::{
    h2::H2Stream,
    relay::{ReadInto, TcpToTcp, next_read, relay, relay_tcp},
};

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

/// Many DATA frames of odd sizes towards an application that reads a KiB at
/// a time: frames pile up while the socket is full, go out several per
/// `writev`, and writes end mid-frame. Every byte arrives, in order, and
/// END_STREAM still arrives as EOF after the last one.
#[tokio::test]
async fn frames_written_together_arrive_whole_and_in_order() {
    let (h2_server_side, h2_client_side) = pair().await;
    let (mut to_app, mut app) = pair().await;
    for socket in [&h2_server_side, &h2_client_side, &app] {
        socket.set_nodelay(true).unwrap();
    }
    // A small send buffer: a batch never fits in one write. No Nagle, as
    // on the proxy's sockets (it would hold each small rest for an ACK).
    socket2::SockRef::from(&to_app)
        .set_send_buffer_size(64 * 1024)
        .unwrap();
    to_app.set_nodelay(true).unwrap();
    // Sizes 1..=3000, varied: ≈ 3 MiB in all, far past one socket buffer.
    let sizes: Vec<usize> = (0..2000u64)
        .map(|i| (i.wrapping_mul(2_654_435_761) % 3000) as usize + 1)
        .collect();
    let total: usize = sizes.iter().sum();
    let body = pattern(total, 0x3c);

    let client = {
        let body = body.clone();
        tokio::spawn(async move {
            let (mut send_request, connection) =
                h2::client::handshake(h2_client_side).await.unwrap();
            tokio::spawn(connection);
            let request = http::Request::post("http://relay.test/").body(()).unwrap();
            let (response, mut stream) = send_request.send_request(request, false).unwrap();
            let mut at = 0;
            for size in sizes {
                stream.reserve_capacity(size);
                while stream.capacity() < size {
                    match poll_fn(|cx| stream.poll_capacity(cx)).await {
                        Some(Ok(_)) => {}
                        other => panic!("no capacity: {other:?}"),
                    }
                }
                stream
                    .send_data(Bytes::copy_from_slice(&body[at..at + size]), false)
                    .unwrap();
                at += size;
            }
            stream.send_data(Bytes::new(), true).unwrap();
            // The response's end: the relay saw the application's EOF.
            let mut response = response.await.unwrap().into_body();
            while let Some(data) = response.data().await {
                data.unwrap();
            }
        })
    };
    let proxy = tokio::spawn(async move {
        let mut connection = h2::server::handshake(h2_server_side).await.unwrap();
        let (request, mut respond) = connection.accept().await.unwrap().unwrap();
        tokio::spawn(async move { while connection.accept().await.is_some() {} });
        let send = respond
            .send_response(http::Response::new(()), false)
            .unwrap();
        let mut stream = H2Stream::new(send, request.into_body());
        relay(&mut to_app, &mut stream, Default::default()).await
    });
    let read_slowly = async {
        let mut got = Vec::with_capacity(total);
        let mut chunk = [0u8; 1024];
        loop {
            let n = app.read(&mut chunk).await.unwrap();
            if n == 0 {
                break;
            }
            got.extend_from_slice(&chunk[..n]);
            tokio::task::yield_now().await;
        }
        // EOF seen: end the other direction too.
        app.shutdown().await.unwrap();
        got
    };
    let got = tokio::time::timeout(std::time::Duration::from_secs(60), read_slowly)
        .await
        .expect("the application did not reach EOF within 60 s");
    assert_eq!(got.len(), total, "bytes lost or added");
    assert!(
        got == body,
        "the application received other bytes, or out of order"
    );
    let (up, down) = proxy.await.unwrap().expect("the relay failed");
    assert_eq!((up, down), (0, total as u64));
    client.await.unwrap();
}

/// Reads grow to 256 KiB only while they come at least half full, so a
/// buffer handed to h2 is mostly used; request/response stays on the
/// scratch buffer.
#[test]
fn reads_grow_while_the_socket_keeps_them_full() {
    const K: usize = 1024;
    let own = ReadInto::Own;
    let steps = [
        // (read into, bytes it returned, next read into)
        (ReadInto::Scratch, 1, ReadInto::Scratch),
        (ReadInto::Scratch, 31 * K, ReadInto::Scratch),
        (ReadInto::Scratch, 32 * K, own(64 * K)),
        (own(64 * K), 63 * K, own(64 * K)),
        (own(64 * K), 64 * K, own(256 * K)),
        (own(256 * K), 128 * K, own(256 * K)),
        (own(256 * K), 127 * K, own(64 * K)),
        (own(256 * K), 31 * K, ReadInto::Scratch),
        (own(64 * K), 1, ReadInto::Scratch),
    ];
    for (read, len, next) in steps {
        assert_eq!(
            next_read(read, len),
            next,
            "after {len} bytes into {read:?}"
        );
    }
}

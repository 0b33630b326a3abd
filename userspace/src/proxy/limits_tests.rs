//! Tests of `limits.rs` (`super`).

use super::*;

async fn pair() -> (tokio::net::TcpStream, SocketAddr) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("listen");
    let addr = listener.local_addr().expect("addr");
    let client = tokio::net::TcpStream::connect(addr).await.expect("connect");
    let (server, peer) = listener.accept().await.expect("accept");
    drop(client);
    (server, peer)
}

#[tokio::test]
async fn per_source_limit_refuses_the_next_and_frees_on_drop() {
    let limits = Limits::new(LimitsConfig {
        max_connections_per_source: 2,
        fd_reserve: 1,
    });
    let (s, peer) = pair().await;
    let a = limits.admit(Inbound::Plaintext, &s, peer).expect("first");
    let b = limits.admit(Inbound::Hbone, &s, peer).expect("second");
    match limits.admit(Inbound::Hbone, &s, peer) {
        Err(Refused::SourceLimit { open: 2, limit: 2 }) => {}
        other => panic!("expected the source limit, got {other:?}"),
    }
    drop(a);
    assert_eq!(limits.open_from(peer.ip()), 1);
    let c = limits
        .admit(Inbound::Hbone, &s, peer)
        .expect("after a close");
    drop((b, c));
    assert_eq!(limits.open_from(peer.ip()), 0);
}

#[tokio::test]
async fn fds_short_sheds_the_oldest_pending_handshake_first() {
    // A reserve as large as the limit: every accepted fd is "short".
    let limits = Limits::new(LimitsConfig {
        max_connections_per_source: 0,
        fd_reserve: u64::MAX / 2,
    });
    let (s, peer) = pair().await;
    // Nothing to shed: refused.
    assert!(matches!(
        limits.admit(Inbound::Hbone, &s, peer),
        Err(Refused::FdBudget { .. })
    ));
    assert_eq!(
        limits.open_from(peer.ip()),
        0,
        "the refusal gave its slot back"
    );
    // One HBONE connection in its handshake (registered as admit does
    // when fds are plentiful).
    let old = CancellationToken::new();
    let id = limits.state.next_pending.fetch_add(1, Ordering::Relaxed);
    limits
        .state
        .pending
        .lock()
        .expect("pending")
        .insert(id, old.clone());
    let mut newer = limits
        .admit(Inbound::Hbone, &s, peer)
        .expect("admitted by shedding the older handshake");
    assert!(old.is_cancelled(), "the oldest pending handshake was shed");
    newer.established();
    assert!(newer.is_established());
}

#[test]
fn every_reason_has_a_distinct_label() {
    let labels: std::collections::BTreeSet<_> =
        RefusalReason::ALL.iter().map(|r| r.as_str()).collect();
    assert_eq!(labels.len(), RefusalReason::ALL.len());
}

#[test]
fn backoff_doubles_to_a_second() {
    let mut d = None;
    for _ in 0..20 {
        d = Some(accept_backoff(d));
    }
    assert_eq!(d, Some(Duration::from_secs(1)));
    assert_eq!(accept_backoff(None), Duration::from_millis(5));
}

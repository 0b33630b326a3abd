//! Tests of `pool.rs` (`super`): when a pooled connection leaves the pool.
//! The clock is tokio's paused one: it jumps to the next timer whenever
//! every task waits, so the timeouts below cost no real time and the
//! outcome does not depend on the machine's speed.

use super::*;
use crate::state::TrustDomain;

const IDLE_TIMEOUT: Duration = Duration::from_secs(60);

fn key() -> PoolKey {
    let td = TrustDomain::default();
    PoolKey {
        src: SpiffeId::for_service_account(&td, "default", "client"),
        dst: SpiffeId::for_service_account(&td, "default", "server"),
        dst_ip: "198.18.2.10".parse().expect("ip"),
        port: 15008,
        also_accept: Vec::new(),
    }
}

/// A connection pooled with one stream taken (the guard), over an
/// in-memory pipe whose other end (returned, to keep open) never answers:
/// the connection neither fails nor closes by itself.
async fn pooled(
    pool: &Pool,
    draining: &CancellationToken,
) -> (StreamGuard, tokio::io::DuplexStream) {
    let (ours, theirs) = tokio::io::duplex(64 * 1024);
    let (send, connection) = h2::client::handshake(ours)
        .await
        .expect("an HTTP/2 client handshake over a pipe");
    let (_send, guard) = pool.insert(
        &key(),
        send,
        connection,
        Driving {
            ping_pong: None,
            settings: H2Settings::default(),
            idle_timeout: IDLE_TIMEOUT,
            draining: draining.clone(),
            abort: CancellationToken::new(),
            revoked: std::future::pending(),
            crl_rejections: Default::default(),
            cert_revoked: None,
        },
    );
    (guard, theirs)
}

/// Waits (bounded, in paused time) until the pool holds `want`
/// connections; returns how long that took.
async fn until_pooled(pool: &Pool, want: usize, within: Duration) -> Option<Duration> {
    let started = Instant::now();
    while started.elapsed() <= within {
        if pool.connection_count() == want {
            return Some(started.elapsed());
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    None
}

#[tokio::test(start_paused = true)]
async fn an_idle_connection_leaves_the_pool_after_the_idle_timeout() {
    let pool = Pool::new();
    let draining = CancellationToken::new();
    let (guard, _peer) = pooled(&pool, &draining).await;
    drop(guard);
    tokio::time::sleep(IDLE_TIMEOUT - Duration::from_secs(1)).await;
    assert_eq!(
        pool.connection_count(),
        1,
        "an idle connection stays pooled until the idle timeout"
    );
    let left = until_pooled(&pool, 0, Duration::from_secs(10)).await;
    assert!(
        left.is_some(),
        "an idle connection left the pool within 10 s past its idle timeout"
    );
    assert!(
        pool.checkout(&key(), 100).is_none(),
        "nothing to check out once it left"
    );
}

#[tokio::test(start_paused = true)]
async fn a_connection_with_a_live_stream_stays_pooled() {
    let pool = Pool::new();
    let draining = CancellationToken::new();
    let (guard, _peer) = pooled(&pool, &draining).await;
    tokio::time::sleep(IDLE_TIMEOUT * 3).await;
    assert_eq!(
        pool.connection_count(),
        1,
        "a connection carrying a stream is never idle"
    );
    // A second stream on it, then both end: idle from the last one's end.
    let (_send, second) = pool.checkout(&key(), 100).expect("room for a stream");
    drop(guard);
    tokio::time::sleep(IDLE_TIMEOUT * 2).await;
    assert_eq!(pool.connection_count(), 1, "one stream is still live");
    drop(second);
    tokio::time::sleep(IDLE_TIMEOUT - Duration::from_secs(1)).await;
    assert_eq!(
        pool.connection_count(),
        1,
        "idle for less than the timeout since its last stream ended"
    );
    assert!(
        until_pooled(&pool, 0, Duration::from_secs(10))
            .await
            .is_some(),
        "it leaves once idle for the timeout after its last stream"
    );
}

#[tokio::test(start_paused = true)]
async fn reused_before_the_deadline_the_idle_clock_starts_again() {
    let pool = Pool::new();
    let draining = CancellationToken::new();
    let (guard, _peer) = pooled(&pool, &draining).await;
    drop(guard);
    tokio::time::sleep(IDLE_TIMEOUT / 2).await;
    let (_send, again) = pool.checkout(&key(), 100).expect("the idle connection");
    tokio::time::sleep(IDLE_TIMEOUT / 4).await;
    drop(again);
    // Past the first idle deadline, before the second.
    tokio::time::sleep(IDLE_TIMEOUT / 2).await;
    assert_eq!(
        pool.connection_count(),
        1,
        "idle for half the timeout since its reuse ended"
    );
    assert!(
        until_pooled(&pool, 0, IDLE_TIMEOUT).await.is_some(),
        "it leaves at the second idle deadline"
    );
}

#[tokio::test(start_paused = true)]
async fn draining_drops_an_idle_connection_promptly() {
    let pool = Pool::new();
    let draining = CancellationToken::new();
    let (idle, _idle_peer) = pooled(&pool, &draining).await;
    drop(idle);
    tokio::time::sleep(Duration::from_secs(1)).await;
    assert_eq!(pool.connection_count(), 1);
    draining.cancel();
    let took = until_pooled(&pool, 0, Duration::from_secs(1)).await;
    assert!(
        took.is_some(),
        "a draining proxy dropped its idle connection within 1 s, not at the 60 s timeout"
    );
}

#[tokio::test(start_paused = true)]
async fn draining_keeps_a_busy_connection_until_its_stream_ends() {
    let pool = Pool::new();
    let draining = CancellationToken::new();
    let (busy, _peer) = pooled(&pool, &draining).await;
    draining.cancel();
    tokio::time::sleep(IDLE_TIMEOUT * 2).await;
    assert_eq!(
        pool.connection_count(),
        1,
        "a drain lets a live stream finish on its connection"
    );
    drop(busy);
    assert!(
        until_pooled(&pool, 0, Duration::from_secs(1))
            .await
            .is_some(),
        "the connection left within 1 s of its last stream's end while draining"
    );
}

//! Outbound HBONE connection pool.
//!
//! Streams to the same (source identity, destination identity, destination
//! IP) share HTTP/2 connections, at most `max_streams_per_connection` each;
//! a full set of connections gets one more. Each pod has its own pool:
//! connections are made from inside the pod's netns (with its source IP),
//! so sharing them across pods would misattribute traffic.
//!
//! A connection leaves the pool when it fails, stops answering PINGs, has
//! been idle for `pool_idle_timeout`, or the proxy drains and it is idle.
//!
//! The idle check costs no wake-up while nothing happens: the task driving
//! a connection sleeps until the idle deadline only while the connection
//! has no stream, and is woken otherwise by the stream that leaves it idle
//! (`StreamGuard`'s drop) or by the drain — not by a periodic tick, which
//! cost two wake-ups a second per pooled connection on an idle node.

use std::{
    collections::HashMap,
    future::Future,
    net::IpAddr,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering},
    },
    time::Duration,
};

use bytes::Bytes;
use h2::client::SendRequest;
use tokio::{sync::Notify, time::Instant};
use tokio_util::sync::CancellationToken;

use super::{
    h2::{H2Settings, keepalive},
    on_wake::OnWake,
    shared::ReporterCounters,
};
use crate::state::SpiffeId;

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub(crate) struct PoolKey {
    pub src: SpiffeId,
    pub dst: SpiffeId,
    pub dst_ip: IpAddr,
    /// The peer's HBONE port (15008, or a waypoint's `hbone_mtls_port`).
    pub port: u16,
    /// Identities accepted besides `dst` (a waypoint service's SANs).
    pub also_accept: Vec<String>,
}

pub(crate) struct PooledConn {
    pub id: u64,
    send: SendRequest<Bytes>,
    streams: AtomicUsize,
    closed: AtomicBool,
    /// Milliseconds since `epoch` when the last stream ended.
    idle_since_ms: AtomicU64,
    /// Told when the last stream ends (a permit is kept if the driving task
    /// is not waiting yet, so no end is missed).
    became_idle: Notify,
    epoch: Instant,
    /// Cancelled before the connection is dropped on a revocation of its
    /// peer, for its streams to say so (`proxy::cut_by_revocation`); only
    /// with revocation lists.
    pub cert_revoked: Option<CancellationToken>,
}

impl PooledConn {
    fn now_ms(&self) -> u64 {
        self.epoch.elapsed().as_millis() as u64
    }

    /// Marks the connection unusable for new streams (after an error on it).
    pub fn mark_closed(&self) {
        self.closed.store(true, Ordering::Release);
    }
}

/// Holds one stream slot on a pooled connection; dropping it frees the slot.
pub(crate) struct StreamGuard {
    pub conn: Arc<PooledConn>,
}

impl Drop for StreamGuard {
    fn drop(&mut self) {
        if self.conn.streams.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.conn
                .idle_since_ms
                .store(self.conn.now_ms(), Ordering::Release);
            self.conn.became_idle.notify_one();
        }
    }
}

/// What drives a pooled connection besides its frames.
pub(crate) struct Driving<R> {
    pub ping_pong: Option<h2::PingPong>,
    pub settings: H2Settings,
    pub idle_timeout: Duration,
    pub draining: CancellationToken,
    pub abort: CancellationToken,
    /// Resolves when a reloaded revocation list revokes the peer's chain
    /// (`tls::until_revoked`); counted in `crl_rejections`, and
    /// `cert_revoked` is cancelled.
    pub revoked: R,
    pub crl_rejections: Arc<ReporterCounters>,
    pub cert_revoked: Option<CancellationToken>,
}

#[derive(Default)]
struct KeyPool {
    conns: Mutex<Vec<Arc<PooledConn>>>,
    /// Held while opening a connection, so a burst of streams opens one
    /// connection at a time instead of one each.
    connecting: Arc<tokio::sync::Mutex<()>>,
}

#[derive(Default)]
pub(crate) struct Pool {
    keys: Arc<Mutex<HashMap<PoolKey, Arc<KeyPool>>>>,
    next_id: AtomicU64,
}

impl Pool {
    pub fn new() -> Self {
        Self::default()
    }

    fn key_pool(&self, key: &PoolKey) -> Arc<KeyPool> {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(key.clone())
            .or_default()
            .clone()
    }

    /// A stream slot on an existing connection with room, if any.
    pub fn checkout(
        &self,
        key: &PoolKey,
        max_streams: usize,
    ) -> Option<(SendRequest<Bytes>, StreamGuard)> {
        let kp = self.key_pool(key);
        let conns = kp.conns.lock().unwrap_or_else(|p| p.into_inner());
        for conn in conns.iter() {
            if conn.closed.load(Ordering::Acquire) {
                continue;
            }
            // Reserve a slot unless full (compare-and-swap: no overshoot
            // under concurrent checkouts).
            let reserved = conn
                .streams
                .fetch_update(Ordering::AcqRel, Ordering::Acquire, |n| {
                    (n < max_streams).then_some(n + 1)
                })
                .is_ok();
            if reserved {
                return Some((conn.send.clone(), StreamGuard { conn: conn.clone() }));
            }
        }
        None
    }

    /// Serializes connection establishment for `key`.
    pub async fn connect_lock(&self, key: &PoolKey) -> tokio::sync::OwnedMutexGuard<()> {
        let lock = self.key_pool(key).connecting.clone();
        lock.lock_owned().await
    }

    /// Adds a freshly handshaken connection, with one stream slot taken for
    /// the caller, and spawns the task that drives it.
    pub fn insert<C, R>(
        &self,
        key: &PoolKey,
        send: SendRequest<Bytes>,
        connection: C,
        driving: Driving<R>,
    ) -> (SendRequest<Bytes>, StreamGuard)
    where
        C: Future<Output = Result<(), h2::Error>> + Send + 'static,
        R: Future<Output = ()> + Send + 'static,
    {
        let Driving {
            ping_pong,
            settings,
            idle_timeout,
            draining,
            abort,
            revoked,
            crl_rejections,
            cert_revoked,
        } = driving;
        let conn = Arc::new(PooledConn {
            id: self.next_id.fetch_add(1, Ordering::Relaxed),
            send: send.clone(),
            streams: AtomicUsize::new(1),
            closed: AtomicBool::new(false),
            idle_since_ms: AtomicU64::new(0),
            became_idle: Notify::new(),
            epoch: Instant::now(),
            cert_revoked,
        });
        let kp = self.key_pool(key);
        kp.conns
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(conn.clone());
        let keys = self.keys.clone();
        let key = key.clone();
        let driven = conn.clone();
        tokio::spawn(async move {
            let ping = async move {
                match ping_pong {
                    Some(pp) => keepalive(pp, settings).await,
                    None => std::future::pending().await,
                }
            };
            let idle = idle_out(&driven, idle_timeout, &draining);
            // The connection is woken per frame, the rest seldom: polled
            // only when they woke (`on_wake.rs`).
            let rare = OnWake::new(async {
                tokio::select! {
                    e = ping => format!("keepalive: {e}"),
                    () = idle => "idle".to_string(),
                    _ = abort.cancelled() => "proxy stopped".to_string(),
                    () = revoked => {
                        // Dropped, not drained: the streams in flight are
                        // cut (a security event, as ztunnel treats it).
                        crl_rejections.outbound();
                        if let Some(cut) = &driven.cert_revoked {
                            cut.cancel();
                        }
                        tracing::warn!(dst = %key.dst, dst_ip = %key.dst_ip, src = %key.src, "HBONE connection closed: a reloaded revocation list revokes the peer's certificate");
                        "peer certificate revoked".to_string()
                    }
                }
            });
            // In order: the rare ones first (a no-op until they woke), so
            // that a busy connection cannot starve them and its per-frame
            // wake-ups skip select!'s random start.
            let why = tokio::select! {
                biased;
                why = rare => why,
                r = connection => match r {
                    Ok(()) => "closed by peer".to_string(),
                    Err(e) => format!("error: {e}"),
                },
            };
            driven.mark_closed();
            tracing::debug!(conn = driven.id, dst = %key.dst, dst_ip = %key.dst_ip, why, "pooled HBONE connection closed");
            // Leave the pool; forget the key when nothing else refers to it.
            let mut keys = keys.lock().unwrap_or_else(|p| p.into_inner());
            if let Some(kp) = keys.get(&key) {
                let mut conns = kp.conns.lock().unwrap_or_else(|p| p.into_inner());
                conns.retain(|c| !Arc::ptr_eq(c, &driven));
                let empty = conns.is_empty();
                drop(conns);
                if empty && Arc::strong_count(kp) == 1 {
                    keys.remove(&key);
                }
            }
        });
        (send, StreamGuard { conn })
    }

    /// Connections currently pooled (for stats and tests).
    pub fn connection_count(&self) -> usize {
        self.keys
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .map(|kp| kp.conns.lock().unwrap_or_else(|p| p.into_inner()).len())
            .sum()
    }
}

/// Returns once `conn` has had no stream for `idle_timeout`, or has none
/// while the proxy drains. Wakes only at an idle deadline, when the last
/// stream ends, and when the drain starts (a connection that gained a
/// stream meanwhile is seen at the deadline and waited on again).
async fn idle_out(conn: &PooledConn, idle_timeout: Duration, draining: &CancellationToken) {
    loop {
        if conn.streams.load(Ordering::Acquire) == 0 {
            if draining.is_cancelled() {
                return;
            }
            let idle_since = Duration::from_millis(conn.idle_since_ms.load(Ordering::Acquire));
            let deadline = conn.epoch + idle_since + idle_timeout;
            if Instant::now() >= deadline {
                return;
            }
            tokio::select! {
                () = crate::timers::sleep_until(deadline) => {}
                () = conn.became_idle.notified() => {}
                () = draining.cancelled() => {}
            }
        } else if draining.is_cancelled() {
            conn.became_idle.notified().await;
        } else {
            tokio::select! {
                () = conn.became_idle.notified() => {}
                () = draining.cancelled() => {}
            }
        }
    }
}

#[cfg(test)]
#[path = "pool_tests.rs"]
mod tests;

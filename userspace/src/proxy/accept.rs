//! A pod's listeners' accept loops: the inbound limits first, then one task
//! per connection (outbound, inbound plaintext or HBONE), tracked so a drain
//! can wait for them.

use std::{future::Future, sync::Arc};

use tokio_util::sync::CancellationToken;

use super::{
    PodState, Shared, inbound, inbound_plaintext, limits, outbound, shared::ReporterCounters,
};

#[derive(Clone, Copy, Debug)]
pub(super) enum Listener {
    Outbound,
    InboundPlaintext,
    Hbone,
}

impl Listener {
    /// The inbound listeners, which the limits apply to.
    fn inbound(self) -> Option<limits::Inbound> {
        match self {
            Listener::Outbound => None,
            Listener::InboundPlaintext => Some(limits::Inbound::Plaintext),
            Listener::Hbone => Some(limits::Inbound::Hbone),
        }
    }

    pub(super) fn as_str(self) -> &'static str {
        match self {
            Listener::Outbound => "outbound",
            Listener::InboundPlaintext => "inbound_plaintext",
            Listener::Hbone => "inbound",
        }
    }
}

pub(super) async fn accept_loop(
    shared: Arc<Shared>,
    pod: Arc<PodState>,
    kind: Listener,
    listener: std::net::TcpListener,
) {
    // Registered here, with the runtime that runs this loop (the pod's
    // shard), so that its readiness wakes no other thread.
    let listener = match tokio::net::TcpListener::from_std(listener) {
        Ok(l) => l,
        Err(e) => {
            // Dropped: the pod's connections to it are refused (fail closed).
            tracing::error!(pod = %pod.key, ?kind, error = %e, "cannot register the pod's listener; its connections are refused");
            return;
        }
    };
    let local = listener.local_addr().ok();
    let mut backoff = None;
    loop {
        let accepted = tokio::select! {
            _ = pod.listeners.cancelled() => break,
            accepted = listener.accept() => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(a) => {
                backoff = None;
                a
            }
            Err(e) => {
                // EMFILE and friends: shed a pending handshake and back off
                // instead of spinning; the backlog holds new connections
                // meanwhile.
                let wait = limits::accept_backoff(backoff);
                backoff = Some(wait);
                limits::accept_failed(&shared, &pod.key, kind.as_str(), &e, wait);
                crate::timers::sleep(wait).await;
                continue;
            }
        };
        // Inbound connections pass the limits first (refused ones are
        // reset, counted and logged there).
        let (stream, admission) = match kind.inbound() {
            None => (stream, None),
            Some(inbound) if !shared.cluster_synced() => {
                limits::refuse_unsynced(&shared, &pod, inbound, stream, peer);
                continue;
            }
            Some(inbound) => match limits::admit_or_refuse(&shared, &pod, inbound, stream, peer) {
                Some((stream, admission)) => (stream, Some(admission)),
                None => continue,
            },
        };
        shared.accepted_here();
        let _ = stream.set_nodelay(true);
        // One spawn per kind: a task's future is as large as the largest
        // state it can be in, for the connection's whole life, so an
        // outbound connection must not carry the room of an inbound HBONE
        // connection's handshakes.
        let (shared2, pod2) = (shared.clone(), pod.clone());
        match kind {
            Listener::Outbound => {
                let socket = OpenSocket::accepted(&shared, false);
                spawn_tracked(&shared, move || async move {
                    let _socket = socket;
                    outbound::serve(shared2, pod2, stream, peer).await
                })
            }
            Listener::InboundPlaintext => {
                let socket = OpenSocket::accepted(&shared, true);
                spawn_tracked(&shared, move || async move {
                    // Holds the connection's per-source slot until it ends.
                    let (_admission, _socket) = (admission, socket);
                    inbound_plaintext::serve(shared2, pod2, stream, peer).await
                })
            }
            Listener::Hbone => {
                let socket = OpenSocket::accepted(&shared, true);
                spawn_tracked(&shared, move || async move {
                    let _socket = socket;
                    inbound::serve(shared2, pod2, stream, peer, admission).await
                })
            }
        }
    }
    tracing::debug!(pod = %pod.key, ?kind, ?local, "listener closed");
}

/// A socket a listener accepted (`istio_tcp_sockets_open`, as ztunnel
/// counts them: the outbound listener's as `source`, the inbound plaintext
/// and HBONE listeners' as `destination`): counted accepted when made,
/// closed when its task ends or is cut.
struct OpenSocket {
    closed: Arc<ReporterCounters>,
    inbound: bool,
}

impl OpenSocket {
    fn accepted(shared: &Shared, inbound: bool) -> Self {
        if inbound {
            shared.sockets_accepted.inbound();
        } else {
            shared.sockets_accepted.outbound();
        }
        Self {
            closed: shared.sockets_closed.clone(),
            inbound,
        }
    }
}

impl Drop for OpenSocket {
    fn drop(&mut self) {
        if self.inbound {
            self.closed.inbound();
        } else {
            self.closed.outbound();
        }
    }
}

/// Spawns a connection's or stream's task, tracked (a drain waits for it)
/// and cut when the drain's grace period is over.
pub(super) fn spawn_tracked<C, F>(shared: &Shared, make: C)
where
    C: FnOnce() -> F + Send + 'static,
    F: Future<Output = ()> + Send + 'static,
{
    shared
        .tracker
        .spawn(until_aborted(shared.abort.clone(), make));
}

/// The future `make` returns, or nothing once `abort` is cancelled. It is
/// made inside, not passed in: a future passed to an async fn or block by
/// value is stored twice (the argument, and where it is polled), which
/// doubled every connection's task.
pub(super) async fn until_aborted<C, F>(abort: CancellationToken, make: C)
where
    C: FnOnce() -> F,
    F: Future<Output = ()>,
{
    // Polled only when it woke, not per wake-up of the connection.
    let aborted = super::on_wake::OnWake::new(abort.cancelled());
    // In order: the abort first (a no-op until it woke), no random start
    // on every wake-up of the task.
    tokio::select! {
        biased;
        _ = aborted => {}
        () = make() => {}
    }
}

#[cfg(test)]
#[path = "task_sizes_tests.rs"]
mod tests;

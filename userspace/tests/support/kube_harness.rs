//! What the tests of the Kubernetes sources share around the in-test API
//! server (`fake_apiserver.rs`): bounded waits, a workload store fed the
//! way the agent feeds it, and a GET on the agent's loopback ports.

#![allow(dead_code)] // not every binary uses all

use std::{
    io::{Read as _, Write as _},
    net::{SocketAddr, TcpStream},
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use shunt::{
    app::{AgentSink, Latest, own_store},
    control::SourceSink,
    store::WorkloadStore,
};
use tokio::sync::watch;

/// Waits until `check` holds, polling every 50 ms, for at most `timeout`.
pub async fn wait_for(what: &str, timeout: Duration, mut check: impl FnMut() -> bool) {
    let start = Instant::now();
    while !check() {
        assert!(
            start.elapsed() < timeout,
            "timed out after {timeout:?} waiting for: {what}"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// A workload store with the agent's own writer behind the agent's sink:
/// what a cluster source pushes lands there as it would in the agent.
pub fn cluster_store() -> (Arc<RwLock<WorkloadStore>>, Arc<dyn SourceSink>) {
    let store = Arc::new(RwLock::new(WorkloadStore::new()));
    let views = Arc::new(Latest::default());
    let (applied, _) = watch::channel(0);
    // No proxy here to re-check connections when policies change.
    tokio::spawn(own_store(store.clone(), views.clone(), applied, || {}));
    // No reconciler listens to this node's pods here.
    let (pods, _) = watch::channel(None);
    (store, Arc::new(AgentSink::new(pods, Some(views))))
}

/// `GET path` on one of the agent's loopback ports (admin, metrics), over
/// HTTP/1.0: the status code and the body.
pub fn http_get(addr: SocketAddr, path: &str) -> std::io::Result<(u16, String)> {
    let mut stream = TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
    stream.set_read_timeout(Some(Duration::from_secs(10)))?;
    write!(stream, "GET {path} HTTP/1.0\r\nHost: localhost\r\n\r\n")?;
    let mut raw = String::new();
    stream.read_to_string(&mut raw)?;
    let (head, body) = raw
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no header end in {raw:?}")))?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    Ok((code, body.to_owned()))
}

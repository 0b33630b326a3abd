//! An in-test Kubernetes API server: enough of the list/watch protocol, as
//! kube-rs' client and watcher speak it, to drive the agent's real
//! Kubernetes source on loopback.
//!
//! - `GET /api/v1/{pods,namespaces,services}` and
//!   `GET /apis/discovery.k8s.io/v1/endpointslices`: a JSON list with
//!   `metadata.resourceVersion`; `limit` and `continue` paginate (a continue
//!   token from before a change answers HTTP 410 Expired, as a real server
//!   does once the snapshot is gone); `fieldSelector` (`a.b=v`, `a.b!=v`,
//!   comma-separated) is honoured.
//! - `GET /apis/security.istio.io/v1/authorizationpolicies` and
//!   `GET /apis/gateway.networking.k8s.io/v1/gateways` likewise (list
//!   items keep `apiVersion` and `kind`, as a real server's custom-resource
//!   lists do), unless [`FakeApiServer::set_served`] took the CRD away: then
//!   `404 page not found` in plain text, what kube-apiserver answers for a
//!   group/version it does not serve.
//! - `GET /api/v1/namespaces/NS/pods/NAME`, `GET /api/v1/namespaces/NAME`,
//!   `GET /api/v1/nodes/NAME` and a DaemonSet by name: the object, or a
//!   `404` `Status`.
//! - `...?watch=true&resourceVersion=N`: newline-delimited
//!   `{"type":"ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR","object":…}`,
//!   replaying history after N, then live. A resource version older than the
//!   compacted history gets an `ERROR` event with a `410` Status and the
//!   stream ends (what a real API server does). Under a field selector, an
//!   object that stops (starts) matching is sent as DELETED (ADDED).
//!   Bookmarks go only to watches that asked (`allowWatchBookmarks=true`).
//! - `PATCH /api/v1/namespaces/NS/pods/NAME/status` with a JSON merge patch:
//!   applied, recorded for the test, and sent to watches as MODIFIED. A
//!   PATCH of the whole pod (`.../pods/NAME`) answers 403, as kube-apiserver
//!   does under the agent's ClusterRole (`patch` on `pods/status` only).
//! - Failure injection: [`FakeApiServer::stop`] closes the listener and every
//!   connection (the API server is gone), [`FakeApiServer::resume`] listens on
//!   the same port again; [`FakeApiServer::drop_watches`] cuts open watches
//!   mid-stream; [`FakeApiServer::send_gone`] sends `410` ERROR events;
//!   [`FakeApiServer::compact`] forgets history so that resuming watches get
//!   `410` and must relist; [`FakeApiServer::hold_watches`] makes a kind's
//!   watches lag behind what a GET sees.
//!
//! Objects are stored as raw JSON, so a test can serve malformed ones.
//! Listens on 127.0.0.1 only.
//!
//! This file holds the server's state and what tests do with it; the
//! requests are answered in `fake_apiserver/routes.rs`, watches streamed by
//! `watch.rs`, field selectors read by `selector.rs`, and `objects.rs`
//! builds the objects tests apply.

#![allow(dead_code)]

#[path = "fake_apiserver/objects.rs"]
mod objects;
#[path = "fake_apiserver/routes.rs"]
mod routes;
#[path = "fake_apiserver/selector.rs"]
mod selector;
#[path = "fake_apiserver/watch.rs"]
mod watch;

use std::{
    collections::BTreeMap,
    convert::Infallible,
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
};

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use hyper::body::Frame;
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::{
    net::TcpSocket,
    task::{JoinHandle, JoinSet},
};

pub use self::objects::*;
use self::{
    routes::handle,
    watch::{Watch, broadcast, event_line, gone_status},
};

type Body = BoxBody<Bytes, io::Error>;
type Chunk = Result<Frame<Bytes>, io::Error>;

/// The kinds of object served.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Kind {
    Pod,
    Namespace,
    Service,
    EndpointSlice,
    AuthorizationPolicy,
    /// `gateway.networking.k8s.io/v1` (a CRD, like `AuthorizationPolicy`).
    Gateway,
    /// `apps/v1`: the agent reads its own at exit (`--on-exit auto`).
    DaemonSet,
    /// Cluster-scoped: its labels decide whether a DaemonSet selects it.
    Node,
}

impl Kind {
    fn kind(self) -> &'static str {
        match self {
            Kind::Pod => "Pod",
            Kind::Namespace => "Namespace",
            Kind::Service => "Service",
            Kind::EndpointSlice => "EndpointSlice",
            Kind::AuthorizationPolicy => "AuthorizationPolicy",
            Kind::Gateway => "Gateway",
            Kind::DaemonSet => "DaemonSet",
            Kind::Node => "Node",
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::AuthorizationPolicy => "security.istio.io/v1",
            Kind::Gateway => "gateway.networking.k8s.io/v1",
            Kind::DaemonSet => "apps/v1",
            _ => "v1",
        }
    }

    /// A custom resource (its CRD may be absent; its list items keep
    /// `kind` and `apiVersion`).
    fn is_custom(self) -> bool {
        matches!(self, Kind::AuthorizationPolicy | Kind::Gateway)
    }
}

/// A PATCH the server received.
#[derive(Clone, Debug)]
pub struct PatchRecord {
    pub namespace: String,
    pub name: String,
    pub content_type: String,
    pub body: Value,
}

/// A request the server received: method, path and decoded query.
#[derive(Clone, Debug)]
pub struct RequestRecord {
    pub method: String,
    pub path: String,
    pub query: BTreeMap<String, String>,
}

type ObjectKey = (Kind, String, String);

#[derive(Default)]
struct Inner {
    rv: u64,
    uid_counter: u64,
    objects: BTreeMap<ObjectKey, Value>,
    /// (resource version, kind, event type, object before, object after).
    history: Vec<(u64, Kind, &'static str, Option<Value>, Value)>,
    /// Watches from a resource version below this get 410.
    compacted_below: u64,
    watches: Vec<Watch>,
    patches: Vec<PatchRecord>,
    requests: Vec<RequestRecord>,
    /// Kinds whose resource is not served (a CRD not installed).
    unserved: std::collections::BTreeSet<Kind>,
    /// Kinds whose open watches lag: their changes wait here, in order,
    /// until [`FakeApiServer::release_watches`].
    held: std::collections::BTreeSet<Kind>,
    held_changes: Vec<(Kind, &'static str, Option<Value>, Value)>,
}

impl Inner {
    /// A change made at resource version `rv`: kept in the history (for
    /// watches that resume from before it) and sent to every open watch it
    /// concerns.
    fn record(
        &mut self,
        rv: u64,
        kind: Kind,
        event: &'static str,
        before: Option<Value>,
        after: Value,
    ) {
        self.history
            .push((rv, kind, event, before.clone(), after.clone()));
        if self.held.contains(&kind) {
            self.held_changes.push((kind, event, before, after));
            return;
        }
        broadcast(self, kind, event, before.as_ref(), &after);
    }
}

/// The server. Dropping it stops it.
pub struct FakeApiServer {
    addr: SocketAddr,
    inner: Arc<Mutex<Inner>>,
    serving: Mutex<Option<JoinHandle<()>>>,
}

impl Drop for FakeApiServer {
    fn drop(&mut self) {
        self.stop();
    }
}

impl FakeApiServer {
    /// Listens on an ephemeral port of 127.0.0.1.
    pub async fn start() -> Self {
        let listener = bind(SocketAddr::from(([127, 0, 0, 1], 0)))
            .expect("bind the fake API server on loopback");
        let server = Self {
            addr: listener.local_addr().expect("local addr"),
            inner: Arc::new(Mutex::new(Inner {
                rv: 1,
                ..Inner::default()
            })),
            serving: Mutex::new(None),
        };
        server.serve(listener);
        server
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Writes a kubeconfig naming this server (plain HTTP, no credentials)
    /// into `dir` and returns its path.
    pub fn write_kubeconfig(&self, dir: &Path) -> PathBuf {
        let path = dir.join("kubeconfig");
        let config = format!(
            "apiVersion: v1\nkind: Config\nclusters:\n- name: fake\n  cluster:\n    server: {}\ncontexts:\n- name: fake\n  context:\n    cluster: fake\n    user: fake\ncurrent-context: fake\nusers:\n- name: fake\n  user: {{}}\n",
            self.url()
        );
        std::fs::write(&path, config).expect("write kubeconfig");
        path
    }

    /// A kube-rs client configured from a kubeconfig file naming this
    /// server, as `Client::try_default()` would with `KUBECONFIG` set (the
    /// environment variable itself is process-wide, so tests running in
    /// parallel read the file explicitly).
    pub async fn client(&self, dir: &Path) -> kube::Client {
        let path = self.write_kubeconfig(dir);
        let kubeconfig = kube::config::Kubeconfig::read_from(&path).expect("read kubeconfig");
        let config = kube::Config::from_custom_kubeconfig(
            kubeconfig,
            &kube::config::KubeConfigOptions::default(),
        )
        .await
        .expect("kubeconfig is usable");
        kube::Client::try_from(config).expect("client")
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    fn serve(&self, listener: tokio::net::TcpListener) {
        let inner = self.inner.clone();
        let task = tokio::spawn(async move {
            // Owned by this task: aborting it drops every connection.
            let mut connections = JoinSet::new();
            loop {
                let Ok((stream, _)) = listener.accept().await else {
                    tokio::time::sleep(std::time::Duration::from_millis(10)).await;
                    continue;
                };
                let inner = inner.clone();
                connections.spawn(async move {
                    let service = hyper::service::service_fn(move |req| {
                        let inner = inner.clone();
                        async move { Ok::<_, Infallible>(handle(&inner, req).await) }
                    });
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
                while connections.try_join_next().is_some() {}
            }
        });
        *self.serving.lock().unwrap_or_else(|p| p.into_inner()) = Some(task);
    }

    /// The API server goes away: the listener closes (connections are
    /// refused) and every open connection is cut.
    pub fn stop(&self) {
        if let Some(task) = self
            .serving
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .take()
        {
            task.abort();
        }
        self.lock().watches.clear();
    }

    /// The API server comes back on the same address. Retries the bind for
    /// up to 5 s (the aborted listener closes asynchronously).
    pub async fn resume(&self) {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(5);
        loop {
            match bind(self.addr) {
                Ok(listener) => return self.serve(listener),
                Err(_) if std::time::Instant::now() < deadline => {
                    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
                }
                Err(e) => panic!("cannot listen on {} again: {e}", self.addr),
            }
        }
    }

    /// Creates or replaces an object (raw JSON: it may be malformed, but
    /// must have metadata.name, and metadata.namespace for pods).
    pub fn apply(&self, kind: Kind, mut object: Value) {
        let mut inner = self.lock();
        inner.rv += 1;
        let rv = inner.rv;
        let name = object["metadata"]["name"]
            .as_str()
            .expect("object has a name")
            .to_owned();
        let namespace = object["metadata"]["namespace"]
            .as_str()
            .unwrap_or("")
            .to_owned();
        let key = (kind, namespace, name);
        let before = inner.objects.get(&key).cloned();
        object["apiVersion"] = json!(kind.api_version());
        object["kind"] = json!(kind.kind());
        if object["metadata"]["uid"].is_null() {
            object["metadata"]["uid"] = match &before {
                Some(b) => b["metadata"]["uid"].clone(),
                None => {
                    inner.uid_counter += 1;
                    json!(format!(
                        "00000000-0000-4000-8000-{:012x}",
                        inner.uid_counter
                    ))
                }
            };
        }
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let event = if before.is_some() {
            "MODIFIED"
        } else {
            "ADDED"
        };
        inner.objects.insert(key, object.clone());
        inner.record(rv, kind, event, before, object);
    }

    /// Changes a stored object in place (like `kubectl label` / `edit`:
    /// what others set, e.g. annotations, is kept). Panics if absent.
    pub fn update(&self, kind: Kind, namespace: &str, name: &str, change: impl FnOnce(&mut Value)) {
        let mut object = self
            .object(kind, namespace, name)
            .unwrap_or_else(|| panic!("no {kind:?} {namespace}/{name} to update"));
        change(&mut object);
        self.apply(kind, object);
    }

    /// Deletes an object, if present.
    pub fn delete(&self, kind: Kind, namespace: &str, name: &str) {
        let mut inner = self.lock();
        let Some(mut object) = inner.objects.remove(&(kind, namespace.into(), name.into())) else {
            return;
        };
        inner.rv += 1;
        let rv = inner.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        inner.record(rv, kind, "DELETED", Some(object.clone()), object);
    }

    /// The stored object, if any.
    pub fn object(&self, kind: Kind, namespace: &str, name: &str) -> Option<Value> {
        self.lock()
            .objects
            .get(&(kind, namespace.into(), name.into()))
            .cloned()
    }

    /// Forgets all history up to now: a watch resuming from an older
    /// resource version gets `410 Gone`.
    pub fn compact(&self) {
        let mut inner = self.lock();
        inner.compacted_below = inner.rv + 1;
        inner.history.clear();
    }

    /// Sends an ERROR event with a 410 Status to every open watch and ends
    /// those streams.
    pub fn send_gone(&self) {
        let mut inner = self.lock();
        let rv = inner.rv;
        for watch in inner.watches.drain(..) {
            let _ = watch
                .tx
                .send(Ok(Frame::data(event_line("ERROR", &gone_status(rv)))));
        }
    }

    /// Cuts every open watch mid-stream (the connection is aborted, not
    /// ended cleanly).
    pub fn drop_watches(&self) {
        for watch in self.lock().watches.drain(..) {
            let _ = watch.tx.send(Err(io::Error::new(
                io::ErrorKind::ConnectionReset,
                "watch dropped by the test",
            )));
        }
    }

    /// Sends a BOOKMARK at the current resource version to the watches that
    /// allowed bookmarks.
    pub fn bookmark(&self) {
        let mut inner = self.lock();
        let rv = inner.rv.to_string();
        inner.watches.retain(|w| {
            !w.bookmarks || {
                let object = json!({"kind": w.kind.kind(), "apiVersion": "v1",
                                    "metadata": {"resourceVersion": rv}});
                w.tx.send(Ok(Frame::data(event_line("BOOKMARK", &object))))
                    .is_ok()
            }
        });
    }

    /// Serves `kind` or not (installs or removes its CRD). Removing it
    /// also cuts its open watches, as the API server does.
    pub fn set_served(&self, kind: Kind, served: bool) {
        let mut inner = self.lock();
        if served {
            inner.unserved.remove(&kind);
        } else {
            inner.unserved.insert(kind);
            inner.watches.retain(|w| w.kind != kind);
        }
    }

    /// Makes the open watches of `kind` lag: changes are stored (a GET or
    /// a list sees them) but not streamed until [`Self::release_watches`].
    pub fn hold_watches(&self, kind: Kind) {
        self.lock().held.insert(kind);
    }

    /// Streams the changes held back, in order, and every later one.
    pub fn release_watches(&self) {
        let mut inner = self.lock();
        inner.held.clear();
        for (kind, event, before, after) in std::mem::take(&mut inner.held_changes) {
            broadcast(&mut inner, kind, event, before.as_ref(), &after);
        }
    }

    pub fn open_watches(&self) -> usize {
        self.lock().watches.len()
    }

    pub fn patches(&self) -> Vec<PatchRecord> {
        self.lock().patches.clone()
    }

    pub fn requests(&self) -> Vec<RequestRecord> {
        self.lock().requests.clone()
    }
}

fn bind(addr: SocketAddr) -> io::Result<tokio::net::TcpListener> {
    let socket = TcpSocket::new_v4()?;
    socket.set_reuseaddr(true)?;
    socket.bind(addr)?;
    socket.listen(128)
}

fn lock(inner: &Arc<Mutex<Inner>>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|p| p.into_inner())
}

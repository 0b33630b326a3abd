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
//! - `...?watch=true&resourceVersion=N`: newline-delimited
//!   `{"type":"ADDED"|"MODIFIED"|"DELETED"|"BOOKMARK"|"ERROR","object":…}`,
//!   replaying history after N, then live. A resource version older than the
//!   compacted history gets an `ERROR` event with a `410` Status and the
//!   stream ends (what a real API server does). Under a field selector, an
//!   object that stops (starts) matching is sent as DELETED (ADDED).
//!   Bookmarks go only to watches that asked (`allowWatchBookmarks=true`).
//! - `PATCH /api/v1/namespaces/NS/pods/NAME` with a JSON merge patch: applied,
//!   recorded for the test, and sent to watches as MODIFIED.
//! - Failure injection: [`FakeApiServer::stop`] closes the listener and every
//!   connection (the API server is gone), [`FakeApiServer::resume`] listens on
//!   the same port again; [`FakeApiServer::drop_watches`] cuts open watches
//!   mid-stream; [`FakeApiServer::send_gone`] sends `410` ERROR events;
//!   [`FakeApiServer::compact`] forgets history so that resuming watches get
//!   `410` and must relist.
//!
//! Objects are stored as raw JSON, so a test can serve malformed ones.
//! Listens on 127.0.0.1 only.

#![allow(dead_code)]

use std::{
    collections::BTreeMap,
    convert::Infallible,
    io,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full, StreamBody, combinators::BoxBody};
use hyper::{Method, Request, Response, StatusCode, body::Frame, body::Incoming};
use hyper_util::rt::TokioIo;
use serde_json::{Value, json};
use tokio::{
    net::TcpSocket,
    sync::mpsc,
    task::{JoinHandle, JoinSet},
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
        }
    }

    fn api_version(self) -> &'static str {
        match self {
            Kind::EndpointSlice => "discovery.k8s.io/v1",
            Kind::AuthorizationPolicy => "security.istio.io/v1",
            Kind::Gateway => "gateway.networking.k8s.io/v1",
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

struct Watch {
    kind: Kind,
    selector: Vec<FieldRequirement>,
    bookmarks: bool,
    tx: mpsc::UnboundedSender<Chunk>,
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
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
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
        inner
            .history
            .push((rv, kind, event, before.clone(), object.clone()));
        broadcast(&mut inner, kind, event, before.as_ref(), &object);
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
        inner
            .history
            .push((rv, kind, "DELETED", Some(object.clone()), object.clone()));
        broadcast(&mut inner, kind, "DELETED", Some(&object), &object);
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

fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": kind, "object": object})).expect("JSON serializes");
    line.push(b'\n');
    Bytes::from(line)
}

fn gone_status(rv: u64) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("too old resource version (current {rv})"),
           "reason": "Expired", "code": 410})
}

fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
    let body = json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
                      "message": message, "reason": reason, "code": code.as_u16()});
    json_response(code, &body)
}

fn json_response(code: StatusCode, body: &Value) -> Response<Body> {
    let bytes = Bytes::from(serde_json::to_vec(body).expect("JSON serializes"));
    Response::builder()
        .status(code)
        .header("content-type", "application/json")
        .body(Full::new(bytes).map_err(|never| match never {}).boxed())
        .expect("valid response")
}

/// Sends one change to every watch of `kind` it concerns.
fn broadcast(
    inner: &mut Inner,
    kind: Kind,
    event: &'static str,
    before: Option<&Value>,
    after: &Value,
) {
    inner.watches.retain(|w| {
        if w.kind != kind {
            return true;
        }
        match translate(&w.selector, event, before, after) {
            Some(event) => w.tx.send(Ok(Frame::data(event_line(event, after)))).is_ok(),
            None => !w.tx.is_closed(),
        }
    });
}

/// The event a watch under `selector` sees for a change (None: nothing).
fn translate(
    selector: &[FieldRequirement],
    event: &'static str,
    before: Option<&Value>,
    after: &Value,
) -> Option<&'static str> {
    let was = before.is_some_and(|b| matches(selector, b));
    let is = matches(selector, after);
    match event {
        "DELETED" => was.then_some("DELETED"),
        _ => match (was, is) {
            (true, true) => Some("MODIFIED"),
            (false, true) => Some("ADDED"),
            (true, false) => Some("DELETED"),
            (false, false) => None,
        },
    }
}

#[derive(Clone, Debug)]
struct FieldRequirement {
    pointer: String,
    value: String,
    equal: bool,
}

fn parse_selector(selector: &str) -> Vec<FieldRequirement> {
    selector
        .split(',')
        .filter(|s| !s.is_empty())
        .map(|term| {
            let (field, value, equal) = if let Some((f, v)) = term.split_once("!=") {
                (f, v, false)
            } else if let Some((f, v)) = term.split_once("==") {
                (f, v, true)
            } else {
                let (f, v) = term.split_once('=').expect("field selector term has =");
                (f, v, true)
            };
            FieldRequirement {
                pointer: format!("/{}", field.replace('.', "/")),
                value: value.to_owned(),
                equal,
            }
        })
        .collect()
}

fn matches(selector: &[FieldRequirement], object: &Value) -> bool {
    selector.iter().all(|r| {
        let actual = object
            .pointer(&r.pointer)
            .and_then(Value::as_str)
            .unwrap_or("");
        (actual == r.value) == r.equal
    })
}

fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'+' => out.push(b' '),
            b'%' if i + 2 < bytes.len() => {
                let hex = std::str::from_utf8(&bytes[i + 1..i + 3]).unwrap_or("");
                match u8::from_str_radix(hex, 16) {
                    Ok(b) => {
                        out.push(b);
                        i += 2;
                    }
                    Err(_) => out.push(b'%'),
                }
            }
            b => out.push(b),
        }
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

fn parse_query(query: Option<&str>) -> BTreeMap<String, String> {
    query
        .unwrap_or("")
        .split('&')
        .filter(|s| !s.is_empty())
        .map(|pair| {
            let (k, v) = pair.split_once('=').unwrap_or((pair, ""));
            (percent_decode(k), percent_decode(v))
        })
        .collect()
}

async fn handle(inner: &Arc<Mutex<Inner>>, req: Request<Incoming>) -> Response<Body> {
    let method = req.method().clone();
    let path = req.uri().path().to_owned();
    let query = parse_query(req.uri().query());
    let content_type = req
        .headers()
        .get("content-type")
        .and_then(|v| v.to_str().ok())
        .unwrap_or("")
        .to_owned();
    lock(inner).requests.push(RequestRecord {
        method: method.to_string(),
        path: path.clone(),
        query: query.clone(),
    });
    let segments: Vec<&str> = path.trim_matches('/').split('/').collect();
    match (&method, segments.as_slice()) {
        (&Method::GET, ["api", "v1", "pods"]) => list_or_watch(inner, Kind::Pod, &query),
        (&Method::GET, ["api", "v1", "namespaces"]) => {
            list_or_watch(inner, Kind::Namespace, &query)
        }
        (&Method::GET, ["api", "v1", "services"]) => list_or_watch(inner, Kind::Service, &query),
        (&Method::GET, ["apis", "discovery.k8s.io", "v1", "endpointslices"]) => {
            list_or_watch(inner, Kind::EndpointSlice, &query)
        }
        (&Method::GET, ["apis", "security.istio.io", "v1", "authorizationpolicies"]) => {
            custom_list_or_watch(inner, Kind::AuthorizationPolicy, &query)
        }
        (&Method::GET, ["apis", "gateway.networking.k8s.io", "v1", "gateways"]) => {
            custom_list_or_watch(inner, Kind::Gateway, &query)
        }
        (&Method::PATCH, ["api", "v1", "namespaces", ns, "pods", name]) => {
            let body = match req.into_body().collect().await {
                Ok(body) => body.to_bytes(),
                Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
            };
            patch_pod(inner, ns, name, &content_type, &body)
        }
        _ => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("no route for {method} {path}"),
        ),
    }
}

/// A custom resource's list or watch; while its CRD is not installed,
/// what kube-apiserver answers for a group/version it does not serve.
fn custom_list_or_watch(
    inner: &Arc<Mutex<Inner>>,
    kind: Kind,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    if lock(inner).unserved.contains(&kind) {
        return Response::builder()
            .status(StatusCode::NOT_FOUND)
            .header("content-type", "text/plain; charset=utf-8")
            .body(
                Full::new(Bytes::from_static(b"404 page not found\n"))
                    .map_err(|never| match never {})
                    .boxed(),
            )
            .expect("valid response");
    }
    list_or_watch(inner, kind, query)
}

fn lock(inner: &Arc<Mutex<Inner>>) -> MutexGuard<'_, Inner> {
    inner.lock().unwrap_or_else(|p| p.into_inner())
}

fn list_or_watch(
    inner: &Arc<Mutex<Inner>>,
    kind: Kind,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    let selector = parse_selector(query.get("fieldSelector").map(String::as_str).unwrap_or(""));
    if query.get("watch").is_some_and(|w| w == "true" || w == "1") {
        return watch(inner, kind, selector, query);
    }
    let inner = lock(inner);
    let items: Vec<&Value> = inner
        .objects
        .iter()
        .filter(|((k, _, _), v)| *k == kind && matches(&selector, v))
        .map(|(_, v)| v)
        .collect();
    let offset = match query.get("continue") {
        Some(token) if !token.is_empty() => {
            let parsed = token
                .split_once(':')
                .and_then(|(rv, off)| Some((rv.parse::<u64>().ok()?, off.parse::<usize>().ok()?)));
            match parsed {
                Some((rv, off)) if rv == inner.rv => off,
                _ => {
                    return status(
                        StatusCode::GONE,
                        "Expired",
                        "the provided continue parameter is too old to display a consistent list result",
                    );
                }
            }
        }
        _ => 0,
    };
    let limit = query
        .get("limit")
        .and_then(|l| l.parse::<usize>().ok())
        .filter(|l| *l > 0)
        .unwrap_or(usize::MAX);
    let page: Vec<Value> = items
        .iter()
        .skip(offset)
        .take(limit)
        .map(|v| {
            // Items of a built-in type's list carry no kind/apiVersion
            // (a custom resource's do).
            let mut v = (*v).clone();
            if let Some(o) = v.as_object_mut().filter(|_| !kind.is_custom()) {
                o.remove("kind");
                o.remove("apiVersion");
            }
            v
        })
        .collect();
    let mut metadata = json!({"resourceVersion": inner.rv.to_string()});
    if offset.saturating_add(page.len()) < items.len() {
        metadata["continue"] = json!(format!("{}:{}", inner.rv, offset + page.len()));
        metadata["remainingItemCount"] = json!(items.len() - offset - page.len());
    }
    json_response(
        StatusCode::OK,
        &json!({"apiVersion": kind.api_version(), "kind": format!("{}List", kind.kind()),
                "metadata": metadata, "items": page}),
    )
}

fn watch(
    inner: &Arc<Mutex<Inner>>,
    kind: Kind,
    selector: Vec<FieldRequirement>,
    query: &BTreeMap<String, String>,
) -> Response<Body> {
    let (tx, rx) = mpsc::unbounded_channel::<Chunk>();
    let mut guard = lock(inner);
    let from = query
        .get("resourceVersion")
        .map(String::as_str)
        .unwrap_or("");
    match from {
        "" | "0" => {
            // Synthetic ADDED for what exists, then live.
            for ((k, _, _), v) in &guard.objects {
                if *k == kind && matches(&selector, v) {
                    let _ = tx.send(Ok(Frame::data(event_line("ADDED", v))));
                }
            }
        }
        rv => match rv.parse::<u64>() {
            Ok(rv) if rv + 1 < guard.compacted_below => {
                let _ = tx.send(Ok(Frame::data(event_line("ERROR", &gone_status(guard.rv)))));
                drop(tx);
                return stream_response(rx);
            }
            Ok(rv) => {
                for (at, k, event, before, after) in &guard.history {
                    if *at > rv
                        && *k == kind
                        && let Some(event) = translate(&selector, event, before.as_ref(), after)
                    {
                        let _ = tx.send(Ok(Frame::data(event_line(event, after))));
                    }
                }
            }
            Err(_) => {
                return status(
                    StatusCode::BAD_REQUEST,
                    "BadRequest",
                    "resourceVersion is not a number",
                );
            }
        },
    }
    guard.watches.push(Watch {
        kind,
        selector,
        bookmarks: query
            .get("allowWatchBookmarks")
            .is_some_and(|b| b == "true"),
        tx,
    });
    stream_response(rx)
}

fn stream_response(rx: mpsc::UnboundedReceiver<Chunk>) -> Response<Body> {
    let stream = futures::stream::unfold(rx, |mut rx| async move {
        let item = rx.recv().await?;
        Some((item, rx))
    });
    Response::builder()
        .status(StatusCode::OK)
        .header("content-type", "application/json")
        .body(StreamBody::new(stream).boxed())
        .expect("valid response")
}

fn patch_pod(
    inner: &Arc<Mutex<Inner>>,
    namespace: &str,
    name: &str,
    content_type: &str,
    body: &[u8],
) -> Response<Body> {
    let patch: Value = match serde_json::from_slice(body) {
        Ok(p) => p,
        Err(e) => return status(StatusCode::BAD_REQUEST, "BadRequest", &e.to_string()),
    };
    if content_type != "application/merge-patch+json" {
        return status(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            "UnsupportedMediaType",
            &format!("this fake server only takes JSON merge patches, not {content_type}"),
        );
    }
    let mut guard = lock(inner);
    let key = (Kind::Pod, namespace.to_owned(), name.to_owned());
    let Some(before) = guard.objects.get(&key).cloned() else {
        return status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("pods \"{name}\" not found"),
        );
    };
    guard.patches.push(PatchRecord {
        namespace: namespace.to_owned(),
        name: name.to_owned(),
        content_type: content_type.to_owned(),
        body: patch.clone(),
    });
    let mut after = before.clone();
    merge_patch(&mut after, &patch);
    guard.rv += 1;
    let rv = guard.rv;
    after["metadata"]["resourceVersion"] = json!(rv.to_string());
    guard.objects.insert(key, after.clone());
    guard.history.push((
        rv,
        Kind::Pod,
        "MODIFIED",
        Some(before.clone()),
        after.clone(),
    ));
    broadcast(&mut guard, Kind::Pod, "MODIFIED", Some(&before), &after);
    json_response(StatusCode::OK, &after)
}

/// RFC 7386.
fn merge_patch(target: &mut Value, patch: &Value) {
    let Value::Object(patch) = patch else {
        *target = patch.clone();
        return;
    };
    if !target.is_object() {
        *target = json!({});
    }
    let Value::Object(target) = target else {
        return;
    };
    for (key, value) in patch {
        if value.is_null() {
            target.remove(key);
        } else {
            merge_patch(target.entry(key.clone()).or_insert(Value::Null), value);
        }
    }
}

/// A pod as the API server would serve it, on `node`, with `ip` (None: not
/// assigned yet) and `labels`.
pub fn pod(namespace: &str, name: &str, node: &str, ip: Option<&str>, labels: Value) -> Value {
    let mut pod = json!({
        "metadata": {"name": name, "namespace": namespace, "labels": labels},
        "spec": {"nodeName": node, "serviceAccountName": "sleep",
                 "containers": [{"name": "app", "image": "registry.invalid/app"}]},
        "status": {"phase": if ip.is_some() { "Running" } else { "Pending" }}
    });
    if let Some(ip) = ip {
        pod["status"]["podIP"] = json!(ip);
        pod["status"]["podIPs"] = json!([{"ip": ip}]);
    }
    pod
}

/// An `AuthorizationPolicy` with `spec`, as `kubectl apply` would store it.
pub fn authorization_policy(namespace: &str, name: &str, spec: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace, "generation": 1,
                     "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": spec
    })
}

/// A `Gateway` of class `class` with `labels` (a waypoint when the class
/// is `istio-waypoint`), as Istio's `istioctl waypoint apply` makes it.
pub fn gateway(namespace: &str, name: &str, class: &str, labels: Value) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace, "labels": labels,
                     "generation": 1, "creationTimestamp": "2026-12-01T00:00:00Z"},
        "spec": {"gatewayClassName": class,
                 "listeners": [{"name": "mesh", "port": 15008, "protocol": "HBONE"}]}
    })
}

/// A namespace with `labels`.
pub fn namespace(name: &str, labels: Value) -> Value {
    json!({"metadata": {"name": name, "labels": labels}})
}

/// A `ClusterIP` service with `vip`, whose port 80 goes to the endpoints'
/// port named `http` (resolved by the EndpointSlice).
pub fn service(namespace: &str, name: &str, vip: &str) -> Value {
    json!({
        "metadata": {"name": name, "namespace": namespace},
        "spec": {"type": "ClusterIP", "clusterIP": vip, "clusterIPs": [vip],
                 "ports": [{"name": "web", "port": 80, "protocol": "TCP", "targetPort": "http"}]}
    })
}

/// An EndpointSlice of `service`: each `(ip, ready, pod)` is one endpoint
/// listening on `port` for the service port `web`.
pub fn endpoint_slice(
    namespace: &str,
    name: &str,
    service: &str,
    port: u16,
    endpoints: &[(&str, bool, &str)],
) -> Value {
    let endpoints: Vec<Value> = endpoints
        .iter()
        .map(|(ip, ready, pod)| {
            json!({"addresses": [ip], "conditions": {"ready": ready},
                   "targetRef": {"kind": "Pod", "namespace": namespace, "name": pod}})
        })
        .collect();
    json!({
        "metadata": {"name": name, "namespace": namespace,
                     "labels": {"kubernetes.io/service-name": service}},
        "addressType": "IPv4",
        "ports": [{"name": "web", "port": port, "protocol": "TCP"}],
        "endpoints": endpoints
    })
}

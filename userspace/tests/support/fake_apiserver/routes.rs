//! The HTTP side: each request recorded, routed to a list (paginated,
//! field-selected), a watch, or a JSON merge patch of a pod's status
//! subresource; errors answered
//! as kube-apiserver's `Status` objects.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, Full};
use hyper::{Method, Request, Response, StatusCode, body::Incoming};
use serde_json::{Value, json};

use super::{
    Body, Inner, Kind, PatchRecord, RequestRecord, lock,
    selector::{matches, parse_selector},
    watch::watch,
};

pub(super) async fn handle(inner: &Arc<Mutex<Inner>>, req: Request<Incoming>) -> Response<Body> {
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
        (&Method::GET, ["apis", "apps", "v1", "namespaces", ns, "daemonsets", name]) => {
            get_one(inner, Kind::DaemonSet, ns, name)
        }
        (&Method::GET, ["api", "v1", "nodes", name]) => get_one(inner, Kind::Node, "", name),
        // What the agent reads at a CNI ADD for a pod its watch has not
        // shown yet.
        (&Method::GET, ["api", "v1", "namespaces", ns, "pods", name]) => {
            get_one(inner, Kind::Pod, ns, name)
        }
        (&Method::GET, ["api", "v1", "namespaces", name]) => {
            get_one(inner, Kind::Namespace, "", name)
        }
        // The agent's ClusterRole grants `patch` on `pods/status` only (as
        // istio-cni's): a patch of the whole pod is refused as kube-apiserver
        // refuses a call RBAC does not allow.
        (&Method::PATCH, ["api", "v1", "namespaces", _, "pods", name]) => status(
            StatusCode::FORBIDDEN,
            "Forbidden",
            &format!("pods \"{name}\" is forbidden: the agent may patch pods/status, not pods"),
        ),
        (&Method::PATCH, ["api", "v1", "namespaces", ns, "pods", name, "status"]) => {
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

/// One object by name, or kube-apiserver's 404 `Status`.
fn get_one(inner: &Arc<Mutex<Inner>>, kind: Kind, namespace: &str, name: &str) -> Response<Body> {
    let found = lock(inner)
        .objects
        .get(&(kind, namespace.to_owned(), name.to_owned()))
        .cloned();
    match found {
        Some(object) => json_response(StatusCode::OK, &object),
        None => status(
            StatusCode::NOT_FOUND,
            "NotFound",
            &format!("{kind:?} \"{name}\" not found"),
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
    guard.record(rv, Kind::Pod, "MODIFIED", Some(before), after.clone());
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

pub(super) fn status(code: StatusCode, reason: &str, message: &str) -> Response<Body> {
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

//! Watches: newline-delimited events, the history replayed after the
//! resource version asked (or a `410` ERROR when it was compacted away),
//! then every change as it is made.

use std::{
    collections::BTreeMap,
    sync::{Arc, Mutex},
};

use bytes::Bytes;
use http_body_util::{BodyExt as _, StreamBody};
use hyper::{Response, StatusCode, body::Frame};
use serde_json::{Value, json};
use tokio::sync::mpsc;

use super::{
    Body, Chunk, Inner, Kind, lock,
    routes::status,
    selector::{FieldRequirement, matches, translate},
};

/// An open watch: the kind and selector it asked for, whether it takes
/// bookmarks, and where its events go.
pub(super) struct Watch {
    pub(super) kind: Kind,
    pub(super) selector: Vec<FieldRequirement>,
    pub(super) bookmarks: bool,
    pub(super) tx: mpsc::UnboundedSender<Chunk>,
}

pub(super) fn event_line(kind: &str, object: &Value) -> Bytes {
    let mut line =
        serde_json::to_vec(&json!({"type": kind, "object": object})).expect("JSON serializes");
    line.push(b'\n');
    Bytes::from(line)
}

pub(super) fn gone_status(rv: u64) -> Value {
    json!({"kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
           "message": format!("too old resource version (current {rv})"),
           "reason": "Expired", "code": 410})
}

/// Sends one change to every watch of `kind` it concerns.
pub(super) fn broadcast(
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

/// A watch of `kind` under `selector`, from the resource version `query`
/// names (none or 0: what exists now, as ADDED events), then live.
pub(super) fn watch(
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

/// The response streaming what `rx` receives.
/// The response streaming what `rx` receives, until it closes.
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

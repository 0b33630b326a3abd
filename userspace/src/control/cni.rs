//! The node-local socket the CNI plugin (`shunt-cni`) asks at a sandbox's
//! ADD, DEL and CHECK (`--cni-socket`).
//!
//! ```text
//! shunt-cni ──unix socket──> serve (a task per connection)
//!                               │ CniCall (request + answer slot)
//!                               ▼
//!                 the pod source (control/kube) ── NodePods ──> reconciler
//!                               ▲                                  │
//!                               └──────── NodeSnapshot ────────────┘
//! ```
//!
//! The server decides nothing: each request goes to the pod source, the
//! one owner of this node's pods as the agent knows them, which adds the
//! sandbox to the list it pushes and answers once the reconciler's
//! snapshot shows the pod captured (or failed, or not in the mesh). So a
//! pod announced by the plugin and listed by the watch is one pod, enrolled
//! once. The answer is bounded by the server's deadline (`--cni-timeout`),
//! after which the ADD fails with what the pod was waiting for.

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use shunt_cni::wire::{MAX_MESSAGE, Reply, Request};
use tokio::{
    io::{AsyncReadExt as _, AsyncWriteExt as _},
    net::{UnixListener, UnixStream},
    sync::{mpsc, oneshot},
};
use tracing::{debug, info, warn};

/// One request of the plugin and where its answer goes.
#[derive(Debug)]
pub struct CniCall {
    pub request: Request,
    pub answer: oneshot::Sender<Reply>,
}

/// Why the socket could not be served.
#[derive(Debug, thiserror::Error)]
#[error("--cni-socket {path}: {source}")]
pub struct CniSocketError {
    pub path: PathBuf,
    pub source: std::io::Error,
}

/// Binds `path` (a stale socket file left by an earlier agent is replaced;
/// its directory is created).
pub fn bind(path: &Path) -> Result<UnixListener, CniSocketError> {
    let error = |source| CniSocketError {
        path: path.to_owned(),
        source,
    };
    if let Some(dir) = path.parent() {
        std::fs::create_dir_all(dir).map_err(error)?;
    }
    match std::fs::remove_file(path) {
        Ok(()) => debug!(socket = %path.display(), "removed a stale CNI socket"),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => return Err(error(e)),
    }
    UnixListener::bind(path).map_err(error)
}

/// Serves the plugin until the future is dropped: every request goes to
/// `calls` (the pod source); an answer not given within `timeout` is a
/// failure naming the wait.
pub async fn serve(listener: UnixListener, calls: mpsc::Sender<CniCall>, timeout: Duration) {
    info!("serving the CNI plugin");
    loop {
        let stream = match listener.accept().await {
            Ok((stream, _)) => stream,
            Err(error) => {
                warn!(%error, "CNI socket accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        let calls = calls.clone();
        tokio::spawn(async move {
            if let Err(error) = answer(stream, calls, timeout).await {
                warn!(%error, "a CNI plugin request could not be answered");
            }
        });
    }
}

async fn answer(
    mut stream: UnixStream,
    calls: mpsc::Sender<CniCall>,
    timeout: Duration,
) -> std::io::Result<()> {
    let mut body = Vec::new();
    // The plugin writes its request and shuts its write half.
    let mut limited = (&mut stream).take(MAX_MESSAGE);
    let read = limited.read_to_end(&mut body);
    let read = tokio::time::timeout(timeout, read).await;
    drop(limited);
    let reply = match read {
        Err(_) => Reply::Failed("the request did not arrive in time".into()),
        Ok(Err(error)) => return Err(error),
        Ok(Ok(_)) => match serde_json::from_slice::<Request>(&body) {
            Err(error) => Reply::Failed(format!("unreadable request: {error}")),
            Ok(request) => ask(request, &calls, timeout).await,
        },
    };
    let bytes = serde_json::to_vec(&reply).map_err(std::io::Error::other)?;
    stream.write_all(&bytes).await?;
    stream.shutdown().await
}

async fn ask(request: Request, calls: &mpsc::Sender<CniCall>, timeout: Duration) -> Reply {
    let pod = format!("{}/{}", request.pod_namespace, request.pod_name);
    let command = request.command;
    let (answer, answered) = oneshot::channel();
    if calls.send(CniCall { request, answer }).await.is_err() {
        return Reply::Failed("the agent's pod source has stopped".into());
    }
    let reply = match tokio::time::timeout(timeout, answered).await {
        Ok(Ok(reply)) => reply,
        Ok(Err(_)) => Reply::Failed("the agent's pod source dropped the request".into()),
        Err(_) => Reply::Failed(format!(
            "pod {pod} was not captured within {timeout:?} (see `shunt status` for its state)"
        )),
    };
    info!(pod, ?command, ?reply, "CNI plugin answered");
    reply
}

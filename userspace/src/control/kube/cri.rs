//! Finding a pod's network namespace through the container runtime (CRI).
//!
//! The runtime that made the pod's sandbox knows where its netns is pinned
//! (containerd: `/var/run/netns/cni-<uuid>`, CRI-O: `/var/run/netns/<uuid>`).
//! [`CriResolver`] asks it over the Kubernetes CRI gRPC API on the runtime's
//! unix socket, as `crictl inspectp` does:
//!
//! 1. `ListPodSandbox` filtered by the label `io.kubernetes.pod.uid` (which
//!    the kubelet puts on every sandbox) and state READY; the newest sandbox
//!    wins (a sandbox being replaced can briefly overlap its successor);
//! 2. `PodSandboxStatus` with `verbose: true`. A sandbox whose network
//!    namespace mode is NODE is a hostNetwork pod: it has no netns of its
//!    own and is never enrolled. Otherwise the verbose `info` map's `"info"`
//!    entry is a JSON document holding the sandbox's OCI runtime spec
//!    (`runtimeSpec.linux.namespaces[]`, the `network` entry's `path`).
//!    containerd (1.x and 2.x) and CRI-O both answer in that shape; other
//!    runtimes (or a containerd whose sandbox spec is not written yet) get a
//!    [`CriError::Sandbox`] naming what is missing, and the caller falls
//!    back to the `/proc` scan.
//!
//! Every call has a deadline ([`CriOptions`]), and so does a whole batch: a
//! hung runtime must never stall a reconcile. Pods not answered in time are
//! simply not found here.
//!
//! [`ChainResolver`] is what the agent uses: CRI first, then the `/proc`
//! scan for whatever CRI did not find.

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        atomic::{AtomicBool, Ordering},
        mpsc,
    },
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use serde::Deserialize;
use shunt_proto::cri::{
    ListPodSandboxRequest, NamespaceMode, PodSandbox, PodSandboxFilter, PodSandboxState,
    PodSandboxStateValue, PodSandboxStatusRequest, PodSandboxStatusResponse,
    runtime_service_client::RuntimeServiceClient,
};
use tokio::runtime::Handle;
use tonic::transport::{Channel, Endpoint};
use tracing::{debug, info, warn};

use super::netns::{NetnsResolver, PodRef, ProcScanResolver};
use crate::state::WorkloadKey;

/// The label the kubelet puts on every sandbox it asks a runtime for.
pub const POD_UID_LABEL: &str = "io.kubernetes.pod.uid";

/// Where runtimes listen by default, in the order `--cri-socket` auto-detection
/// tries them: containerd, then CRI-O.
pub const DEFAULT_SOCKETS: &[&str] =
    &["/run/containerd/containerd.sock", "/var/run/crio/crio.sock"];

/// The first of [`DEFAULT_SOCKETS`] that exists (a socket file: a runtime
/// may listen there).
pub fn detect_socket() -> Option<PathBuf> {
    use std::os::unix::fs::FileTypeExt as _;
    DEFAULT_SOCKETS
        .iter()
        .map(PathBuf::from)
        .find(|p| std::fs::metadata(p).is_ok_and(|m| m.file_type().is_socket()))
}

/// Why the runtime could not tell a pod's netns.
#[derive(Debug, thiserror::Error)]
pub enum CriError {
    #[error("CRI socket path {socket} cannot be used as an endpoint: {message}")]
    Endpoint { socket: PathBuf, message: String },
    #[error("CRI {call} on {socket} failed ({code:?}): {message}")]
    Call {
        socket: PathBuf,
        call: &'static str,
        code: tonic::Code,
        message: String,
    },
    #[error("CRI {call} on {socket} timed out after {after:?}")]
    Timeout {
        socket: PathBuf,
        call: &'static str,
        after: Duration,
    },
    #[error("CRI sandbox {sandbox} of pod {pod}: {what}")]
    Sandbox {
        sandbox: String,
        pod: WorkloadKey,
        what: String,
    },
}

impl CriError {
    /// Whether this says nothing about the pod, only that the runtime could
    /// not be reached (no socket, nobody listening, no answer in time).
    pub fn is_unreachable(&self) -> bool {
        match self {
            Self::Endpoint { .. } | Self::Timeout { .. } => true,
            // tonic reports transport failures (connect refused, no such
            // socket, connection reset) as UNAVAILABLE; a runtime too busy to
            // answer in its own deadline says nothing about the pod either.
            Self::Call { code, .. } => {
                matches!(
                    code,
                    tonic::Code::Unavailable | tonic::Code::DeadlineExceeded
                )
            }
            Self::Sandbox { .. } => false,
        }
    }
}

/// What the runtime says about one pod's network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum SandboxNetns {
    /// The pod's netns.
    Path(PathBuf),
    /// A hostNetwork pod: it shares the node's netns and is never enrolled.
    HostNetwork,
    /// No READY sandbox for the pod (not started yet, being torn down, or
    /// not run by this runtime).
    NotReady,
}

/// Deadlines of [`CriResolver`].
#[derive(Clone, Copy, Debug)]
pub struct CriOptions {
    /// Each gRPC call (connecting included).
    pub call_timeout: Duration,
    /// One [`NetnsResolver::resolve`] batch, however many pods it has.
    pub batch_timeout: Duration,
    /// Pods asked about at the same time.
    pub concurrency: usize,
}

impl Default for CriOptions {
    fn default() -> Self {
        Self {
            call_timeout: Duration::from_secs(2),
            batch_timeout: Duration::from_secs(5),
            concurrency: 8,
        }
    }
}

/// Asks the container runtime over its CRI socket. See the module docs.
///
/// The calls run on the tokio runtime behind the [`Handle`] it was built
/// with; [`NetnsResolver::resolve`] waits for them on the calling thread
/// (a blocking thread: it must not be one of the runtime's workers).
#[derive(Clone, Debug)]
pub struct CriResolver {
    socket: PathBuf,
    client: RuntimeServiceClient<Channel>,
    handle: Handle,
    options: CriOptions,
}

impl CriResolver {
    /// A resolver for the runtime listening on `socket`. Connects lazily: a
    /// runtime that is not up yet is tried again on every call.
    pub fn new(
        socket: impl Into<PathBuf>,
        handle: Handle,
        options: CriOptions,
    ) -> Result<Self, CriError> {
        let socket = socket.into();
        let endpoint_err = |message: String| CriError::Endpoint {
            socket: socket.clone(),
            message,
        };
        let Some(path) = socket.to_str() else {
            return Err(endpoint_err("not UTF-8".into()));
        };
        let endpoint = Endpoint::from_shared(format!("unix:{path}"))
            .map_err(|e| endpoint_err(e.to_string()))?
            // Calls are bounded by `call` itself (a tonic request timeout
            // would come back as CANCELLED, indistinguishable from others).
            .connect_timeout(options.call_timeout);
        // The lazy channel's worker is spawned on the current runtime.
        let channel = {
            let _entered = handle.enter();
            endpoint.connect_lazy()
        };
        Ok(Self {
            socket,
            client: RuntimeServiceClient::new(channel),
            handle,
            options,
        })
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// What the runtime says about the pod with UID `uid` (named `pod` in
    /// errors).
    pub async fn sandbox_netns(
        &self,
        pod: &WorkloadKey,
        uid: &str,
    ) -> Result<SandboxNetns, CriError> {
        let list = ListPodSandboxRequest {
            filter: Some(PodSandboxFilter {
                id: String::new(),
                state: Some(PodSandboxStateValue {
                    state: PodSandboxState::SandboxReady as i32,
                }),
                label_selector: HashMap::from([(POD_UID_LABEL.to_owned(), uid.to_owned())]),
            }),
        };
        let mut client = self.client.clone();
        let items = self
            .call("ListPodSandbox", client.list_pod_sandbox(list))
            .await?
            .items;
        // Filters are the runtime's to apply; checking again costs nothing
        // and keeps a lax runtime from handing us another pod's sandbox.
        let Some(sandbox) = items
            .into_iter()
            .filter(|s| is_ready_sandbox_of(s, uid))
            .max_by_key(|s| s.created_at)
        else {
            return Ok(SandboxNetns::NotReady);
        };
        let status = PodSandboxStatusRequest {
            pod_sandbox_id: sandbox.id.clone(),
            verbose: true,
        };
        let response = self
            .call("PodSandboxStatus", client.pod_sandbox_status(status))
            .await?;
        netns_from_status(pod, &sandbox.id, &response)
    }

    async fn call<T>(
        &self,
        call: &'static str,
        request: impl Future<Output = Result<tonic::Response<T>, tonic::Status>>,
    ) -> Result<T, CriError> {
        match tokio::time::timeout(self.options.call_timeout, request).await {
            Ok(Ok(response)) => Ok(response.into_inner()),
            Ok(Err(status)) => Err(CriError::Call {
                socket: self.socket.clone(),
                call,
                code: status.code(),
                message: status_message(&status),
            }),
            Err(_) => Err(CriError::Timeout {
                socket: self.socket.clone(),
                call,
                after: self.options.call_timeout,
            }),
        }
    }

    /// Asks about every pod of `pods` (several at a time) and returns the
    /// answers that came within the batch deadline, by pod UID. Pods missing
    /// from the result were not answered in time.
    pub fn lookup(&self, pods: &[PodRef<'_>]) -> HashMap<String, Result<SandboxNetns, CriError>> {
        let mut out = HashMap::new();
        if pods.is_empty() {
            return out;
        }
        let owned: Vec<(WorkloadKey, String)> = pods
            .iter()
            .map(|p| (p.key.clone(), p.uid.to_owned()))
            .collect();
        // Results come back one by one over a std channel, so that the
        // answers given before the deadline are kept and the calling thread
        // waits with a deadline of its own, whatever the runtime does.
        let (tx, rx) = mpsc::channel();
        let this = self.clone();
        let task = self.handle.spawn(async move {
            let concurrency = this.options.concurrency.max(1);
            let this = &this;
            let mut answers = futures::stream::iter(owned)
                .map(|(key, uid)| async move {
                    let answer = this.sandbox_netns(&key, &uid).await;
                    (uid, answer)
                })
                .buffer_unordered(concurrency);
            while let Some(answer) = answers.next().await {
                if tx.send(answer).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + self.options.batch_timeout;
        while out.len() < pods.len() {
            let left = deadline.saturating_duration_since(Instant::now());
            match rx.recv_timeout(left) {
                Ok((uid, answer)) => {
                    out.insert(uid, answer);
                }
                // Timed out, or the task ended (all sent, or it panicked).
                Err(_) => break,
            }
        }
        task.abort();
        out
    }
}

fn is_ready_sandbox_of(sandbox: &PodSandbox, uid: &str) -> bool {
    sandbox.state == PodSandboxState::SandboxReady as i32
        && sandbox.labels.get(POD_UID_LABEL).map(String::as_str) == Some(uid)
}

/// tonic's transport errors keep their cause in the source chain: a bare
/// "transport error" would hide "No such file or directory". (The status's
/// own Display adds details and metadata that say nothing here.)
fn status_message(status: &tonic::Status) -> String {
    let message = status.message();
    match std::error::Error::source(status).map(crate::error::chain) {
        Some(cause) if !message.contains(&cause) => format!("{message}: {cause}"),
        _ => message.to_owned(),
    }
}

/// The parts of the verbose `info` document we read. Both containerd and
/// CRI-O serialise the sandbox's OCI runtime spec under `runtimeSpec`.
#[derive(Deserialize)]
struct SandboxInfo {
    #[serde(rename = "runtimeSpec")]
    runtime_spec: Option<RuntimeSpec>,
    /// containerd only: the netns was already removed (the sandbox is
    /// going away).
    #[serde(rename = "netNamespaceClosed", default)]
    netns_closed: bool,
}

#[derive(Deserialize)]
struct RuntimeSpec {
    linux: Option<LinuxSpec>,
}

#[derive(Deserialize)]
struct LinuxSpec {
    namespaces: Option<Vec<LinuxNamespace>>,
}

#[derive(Deserialize)]
struct LinuxNamespace {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

/// The netns a sandbox's verbose status names. See the module docs.
pub(crate) fn netns_from_status(
    pod: &WorkloadKey,
    sandbox: &str,
    response: &PodSandboxStatusResponse,
) -> Result<SandboxNetns, CriError> {
    let bad = |what: String| CriError::Sandbox {
        sandbox: sandbox.to_owned(),
        pod: pod.clone(),
        what,
    };
    if let Some(status) = &response.status {
        if status.state != PodSandboxState::SandboxReady as i32 {
            return Ok(SandboxNetns::NotReady);
        }
        let network = status
            .linux
            .as_ref()
            .and_then(|l| l.namespaces.as_ref())
            .and_then(|n| n.options.as_ref())
            .map(|o| o.network);
        if network == Some(NamespaceMode::Node as i32) {
            return Ok(SandboxNetns::HostNetwork);
        }
    }
    let Some(info) = response.info.get("info") else {
        return Err(bad(
            "the verbose status has no \"info\" entry (not containerd or CRI-O?)".into(),
        ));
    };
    let info: SandboxInfo = serde_json::from_str(info)
        .map_err(|e| bad(format!("\"info\" is not the expected JSON: {e}")))?;
    if info.netns_closed {
        return Ok(SandboxNetns::NotReady);
    }
    let Some(namespaces) = info
        .runtime_spec
        .ok_or_else(|| bad("\"info\" has no runtimeSpec".into()))?
        .linux
        .and_then(|l| l.namespaces)
    else {
        return Err(bad("\"info\" has no runtimeSpec.linux.namespaces".into()));
    };
    // An OCI spec without a network namespace runs in the runtime's own:
    // the node's.
    let Some(network) = namespaces.into_iter().find(|n| n.kind == "network") else {
        return Ok(SandboxNetns::HostNetwork);
    };
    if network.path.is_empty() {
        return Err(bad("the runtimeSpec's network namespace has no path".into()));
    }
    let path = PathBuf::from(network.path);
    if !is_netns(&path) {
        return Err(bad(format!(
            "{} is not a network namespace here (is the runtime's netns directory mounted?)",
            path.display()
        )));
    }
    Ok(SandboxNetns::Path(path))
}

/// Whether `path` is a namespace file (a bind mount of nsfs, as runtimes
/// pin them): an unmounted leftover of a removed sandbox is not.
pub fn is_netns(path: &Path) -> bool {
    nix::sys::statfs::statfs(path)
        .is_ok_and(|fs| fs.filesystem_type() == nix::sys::statfs::NSFS_MAGIC)
}

impl NetnsResolver for CriResolver {
    fn resolve(&self, pods: &[PodRef<'_>]) -> HashMap<String, PathBuf> {
        let keys: HashMap<&str, &WorkloadKey> = pods.iter().map(|p| (p.uid, p.key)).collect();
        self.lookup(pods)
            .into_iter()
            .filter_map(|(uid, answer)| match answer {
                Ok(SandboxNetns::Path(path)) => Some((uid, path)),
                Ok(_) => None,
                Err(error) => {
                    let pod = keys.get(uid.as_str()).map(ToString::to_string);
                    debug!(pod, %error, "no netns from the container runtime");
                    None
                }
            })
            .collect()
    }

    fn still_valid(&self, _pod: PodRef<'_>, path: &Path) -> bool {
        // The runtime unmounts and deletes the pinned netns when the sandbox
        // goes; a recreated sandbox gets a new path.
        is_netns(path)
    }
}

/// Which resolver found a pod's netns.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NetnsSource {
    Cri,
    Proc,
}

/// The agent's resolver: the container runtime first (when there is one),
/// the `/proc` scan for every pod the runtime did not place (not reachable,
/// no answer in time, an `info` it cannot read, a runtime that does not run
/// the pod). A pod the runtime says is hostNetwork is not looked for further.
pub struct ChainResolver {
    cri: Option<CriResolver>,
    proc: ProcScanResolver,
    /// Whether the last batch found the runtime unreachable, so the warning
    /// is given once per outage, not once per reconcile.
    cri_down: AtomicBool,
}

impl ChainResolver {
    pub fn new(cri: Option<CriResolver>, proc: ProcScanResolver) -> Self {
        Self {
            cri,
            proc,
            cri_down: AtomicBool::new(false),
        }
    }

    /// Like [`NetnsResolver::resolve`], with the source of each path.
    pub fn resolve_with_source(
        &self,
        pods: &[PodRef<'_>],
    ) -> HashMap<String, (PathBuf, NetnsSource)> {
        let mut found = HashMap::new();
        if pods.is_empty() {
            return found;
        }
        let mut rest: Vec<PodRef<'_>> = Vec::new();
        match &self.cri {
            None => rest.extend_from_slice(pods),
            Some(cri) => {
                let mut answers = cri.lookup(pods);
                self.note_reachability(cri, &answers);
                for pod in pods {
                    match answers.remove(pod.uid) {
                        Some(Ok(SandboxNetns::Path(path))) => {
                            debug!(pod = %pod.key, uid = pod.uid, netns = %path.display(), source = "cri", "pod network namespace found by the container runtime");
                            found.insert(pod.uid.to_owned(), (path, NetnsSource::Cri));
                        }
                        Some(Ok(SandboxNetns::HostNetwork)) => {
                            debug!(pod = %pod.key, uid = pod.uid, "the container runtime says the pod uses the node's network: not enrolled");
                        }
                        Some(Ok(SandboxNetns::NotReady)) => rest.push(*pod),
                        Some(Err(error)) => {
                            if !error.is_unreachable() {
                                warn!(pod = %pod.key, uid = pod.uid, %error, "the container runtime's answer gives no netns; trying /proc");
                            }
                            rest.push(*pod);
                        }
                        None => rest.push(*pod),
                    }
                }
            }
        }
        if !rest.is_empty() {
            for (uid, path) in self.proc.resolve(&rest) {
                let pod = rest
                    .iter()
                    .find(|p| p.uid == uid)
                    .map(|p| p.key.to_string());
                debug!(pod, uid, netns = %path.display(), source = "proc", "pod network namespace found by scanning /proc");
                found.insert(uid, (path, NetnsSource::Proc));
            }
        }
        found
    }

    /// Warns when the runtime stops answering (once per outage) and says
    /// when it is back.
    fn note_reachability(
        &self,
        cri: &CriResolver,
        answers: &HashMap<String, Result<SandboxNetns, CriError>>,
    ) {
        let reached = answers
            .values()
            .any(|a| !matches!(a, Err(e) if e.is_unreachable()));
        if reached {
            if self.cri_down.swap(false, Ordering::Relaxed) {
                info!(socket = %cri.socket().display(), "the container runtime answers again");
            }
            return;
        }
        if self.cri_down.swap(true, Ordering::Relaxed) {
            return;
        }
        let socket = cri.socket().display();
        match answers.values().find_map(|a| a.as_ref().err()) {
            Some(error) => {
                warn!(%socket, %error, "the container runtime is unreachable; finding pods' netns through /proc")
            }
            None => {
                warn!(%socket, "the container runtime did not answer in time; finding pods' netns through /proc")
            }
        }
    }
}

impl NetnsResolver for ChainResolver {
    fn resolve(&self, pods: &[PodRef<'_>]) -> HashMap<String, PathBuf> {
        self.resolve_with_source(pods)
            .into_iter()
            .map(|(uid, (path, _))| (uid, path))
            .collect()
    }

    fn still_valid(&self, pod: PodRef<'_>, path: &Path) -> bool {
        if self.proc.owns(path) {
            self.proc.still_valid(pod, path)
        } else {
            is_netns(path)
        }
    }
}

#[cfg(test)]
#[path = "cri_tests.rs"]
mod tests;

//! An in-test container runtime: a tonic server of the CRI's
//! `runtime.v1.RuntimeService` (the two sandbox calls shunt makes) on a unix
//! socket, answering as containerd does: `ListPodSandbox` applies the
//! state and label filters, `PodSandboxStatus` with `verbose` puts the
//! sandbox's OCI runtime spec, JSON, under the `info` key. The netns paths
//! it hands out are whatever the test registers (real network namespaces).

#![allow(dead_code)]

use std::{
    collections::HashMap,
    path::{Path, PathBuf},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicUsize, Ordering},
    },
};

use serde_json::json;
use shunt_proto::cri;
use shunt_proto::cri::{
    LinuxPodSandboxStatus, ListPodSandboxRequest, ListPodSandboxResponse, Namespace, NamespaceMode,
    NamespaceOption, PodSandbox, PodSandboxMetadata, PodSandboxState, PodSandboxStatus,
    PodSandboxStatusRequest, PodSandboxStatusResponse,
    runtime_service_server::{RuntimeService, RuntimeServiceServer},
};
use tokio::{net::UnixListener, task::JoinHandle};
use tonic::{Request, Response, Status};

pub const POD_UID_LABEL: &str = "io.kubernetes.pod.uid";

/// One pod sandbox the fake runtime reports.
#[derive(Clone, Debug)]
pub struct Sandbox {
    pub id: String,
    pub pod_uid: String,
    pub name: String,
    pub namespace: String,
    pub ready: bool,
    pub created_at: i64,
    /// `None`: a hostNetwork sandbox (network mode NODE, no network
    /// namespace in its spec).
    pub netns: Option<PathBuf>,
    /// Replaces the whole `info` JSON (malformed answers).
    pub info: Option<String>,
}

impl Sandbox {
    /// A READY sandbox of pod `namespace/name` with UID `uid` in `netns`.
    pub fn ready(id: &str, uid: &str, namespace: &str, name: &str, netns: &Path) -> Self {
        Self {
            id: id.into(),
            pod_uid: uid.into(),
            name: name.into(),
            namespace: namespace.into(),
            ready: true,
            created_at: 1_700_000_000_000_000_000,
            netns: Some(netns.to_path_buf()),
            info: None,
        }
    }

    fn labels(&self) -> HashMap<String, String> {
        HashMap::from([
            (POD_UID_LABEL.to_owned(), self.pod_uid.clone()),
            ("io.kubernetes.pod.name".to_owned(), self.name.clone()),
            (
                "io.kubernetes.pod.namespace".to_owned(),
                self.namespace.clone(),
            ),
        ])
    }

    fn metadata(&self) -> PodSandboxMetadata {
        PodSandboxMetadata {
            name: self.name.clone(),
            uid: self.pod_uid.clone(),
            namespace: self.namespace.clone(),
            attempt: 0,
        }
    }

    fn state(&self) -> i32 {
        if self.ready {
            PodSandboxState::SandboxReady as i32
        } else {
            PodSandboxState::SandboxNotready as i32
        }
    }

    /// containerd's verbose `info` document (the fields it always writes;
    /// shunt reads `runtimeSpec.linux.namespaces`).
    fn info_json(&self) -> String {
        if let Some(info) = &self.info {
            return info.clone();
        }
        let mut namespaces = vec![
            json!({"type": "pid"}),
            json!({"type": "ipc"}),
            json!({"type": "uts"}),
            json!({"type": "mount"}),
        ];
        if let Some(netns) = &self.netns {
            namespaces.push(json!({"type": "network", "path": netns}));
        }
        json!({
            "pid": 4242,
            "processStatus": "running",
            "netNamespaceClosed": false,
            "image": "registry.k8s.io/pause:3.10",
            "snapshotKey": self.id,
            "snapshotter": "overlayfs",
            "runtimeHandler": "",
            "runtimeType": "io.containerd.runc.v2",
            "runtimeOptions": {"systemd_cgroup": true},
            "config": {
                "metadata": {"name": self.name, "uid": self.pod_uid, "namespace": self.namespace},
                "labels": self.labels(),
            },
            "runtimeSpec": {
                "ociVersion": "1.1.0",
                "process": {"args": ["/pause"], "cwd": "/"},
                "root": {"path": "rootfs", "readonly": true},
                "linux": {
                    "cgroupsPath": format!("kubepods-besteffort-pod{}.slice:cri-containerd:{}", self.pod_uid.replace('-', "_"), self.id),
                    "namespaces": namespaces,
                },
            },
            "cniResult": null,
        })
        .to_string()
    }
}

#[derive(Default)]
struct State {
    sandboxes: Mutex<Vec<Sandbox>>,
    /// Never answer (a hung runtime).
    hang: AtomicBool,
    lists: AtomicUsize,
    statuses: AtomicUsize,
}

#[derive(Clone)]
struct Service(Arc<State>);

#[tonic::async_trait]
impl RuntimeService for Service {
    // The kubelet's calls: the fake only answers netns discovery.
    async fn run_pod_sandbox(
        &self,
        _: Request<cri::RunPodSandboxRequest>,
    ) -> Result<Response<cri::RunPodSandboxResponse>, Status> {
        Err(Status::unimplemented("fake CRI: RunPodSandbox"))
    }
    async fn stop_pod_sandbox(
        &self,
        _: Request<cri::StopPodSandboxRequest>,
    ) -> Result<Response<cri::StopPodSandboxResponse>, Status> {
        Err(Status::unimplemented("fake CRI: StopPodSandbox"))
    }
    async fn remove_pod_sandbox(
        &self,
        _: Request<cri::RemovePodSandboxRequest>,
    ) -> Result<Response<cri::RemovePodSandboxResponse>, Status> {
        Err(Status::unimplemented("fake CRI: RemovePodSandbox"))
    }
    async fn create_container(
        &self,
        _: Request<cri::CreateContainerRequest>,
    ) -> Result<Response<cri::CreateContainerResponse>, Status> {
        Err(Status::unimplemented("fake CRI: CreateContainer"))
    }
    async fn start_container(
        &self,
        _: Request<cri::StartContainerRequest>,
    ) -> Result<Response<cri::StartContainerResponse>, Status> {
        Err(Status::unimplemented("fake CRI: StartContainer"))
    }
    async fn container_status(
        &self,
        _: Request<cri::ContainerStatusRequest>,
    ) -> Result<Response<cri::ContainerStatusResponse>, Status> {
        Err(Status::unimplemented("fake CRI: ContainerStatus"))
    }

    async fn pod_sandbox_status(
        &self,
        request: Request<PodSandboxStatusRequest>,
    ) -> Result<Response<PodSandboxStatusResponse>, Status> {
        self.0.statuses.fetch_add(1, Ordering::Relaxed);
        self.maybe_hang().await;
        let request = request.into_inner();
        let sandbox = self
            .0
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .find(|s| s.id == request.pod_sandbox_id)
            .cloned()
            .ok_or_else(|| {
                Status::not_found(format!(
                    "an error occurred when try to find sandbox: not found: {}",
                    request.pod_sandbox_id
                ))
            })?;
        let network = if sandbox.netns.is_some() {
            NamespaceMode::Pod
        } else {
            NamespaceMode::Node
        };
        let status = PodSandboxStatus {
            id: sandbox.id.clone(),
            metadata: Some(sandbox.metadata()),
            state: sandbox.state(),
            created_at: sandbox.created_at,
            network: None,
            linux: Some(LinuxPodSandboxStatus {
                namespaces: Some(Namespace {
                    options: Some(NamespaceOption {
                        network: network as i32,
                        pid: NamespaceMode::Pod as i32,
                        ipc: NamespaceMode::Pod as i32,
                    }),
                }),
            }),
            labels: sandbox.labels(),
        };
        let info = if request.verbose {
            HashMap::from([("info".to_owned(), sandbox.info_json())])
        } else {
            HashMap::new()
        };
        Ok(Response::new(PodSandboxStatusResponse {
            status: Some(status),
            info,
        }))
    }

    async fn list_pod_sandbox(
        &self,
        request: Request<ListPodSandboxRequest>,
    ) -> Result<Response<ListPodSandboxResponse>, Status> {
        self.0.lists.fetch_add(1, Ordering::Relaxed);
        self.maybe_hang().await;
        let filter = request.into_inner().filter.unwrap_or_default();
        let items = self
            .0
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .iter()
            .filter(|s| filter.id.is_empty() || s.id == filter.id)
            .filter(|s| filter.state.is_none_or(|want| want.state == s.state()))
            .filter(|s| {
                let labels = s.labels();
                filter
                    .label_selector
                    .iter()
                    .all(|(k, v)| labels.get(k) == Some(v))
            })
            .map(|s| PodSandbox {
                id: s.id.clone(),
                metadata: Some(s.metadata()),
                state: s.state(),
                created_at: s.created_at,
                labels: s.labels(),
            })
            .collect();
        Ok(Response::new(ListPodSandboxResponse { items }))
    }
}

impl Service {
    async fn maybe_hang(&self) {
        if self.0.hang.load(Ordering::Relaxed) {
            std::future::pending::<()>().await;
        }
    }
}

/// The fake runtime, serving until dropped.
pub struct FakeCri {
    state: Arc<State>,
    socket: PathBuf,
    task: JoinHandle<()>,
}

impl FakeCri {
    /// Listens on `socket` (a path in the test's temp dir).
    pub async fn start(socket: &Path) -> Self {
        let listener = UnixListener::bind(socket).expect("bind the fake CRI socket");
        let state = Arc::new(State::default());
        let service = RuntimeServiceServer::new(Service(state.clone()));
        let incoming = futures::stream::unfold(listener, |listener| async move {
            let next = listener.accept().await.map(|(stream, _)| stream);
            Some((next, listener))
        });
        let task = tokio::spawn(async move {
            let _ = tonic::transport::Server::builder()
                .add_service(service)
                .serve_with_incoming(incoming)
                .await;
        });
        Self {
            state,
            socket: socket.to_path_buf(),
            task,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    pub fn add(&self, sandbox: Sandbox) {
        self.state
            .sandboxes
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .push(sandbox);
    }

    pub fn hang(&self, hang: bool) {
        self.state.hang.store(hang, Ordering::Relaxed);
    }

    /// (ListPodSandbox, PodSandboxStatus) calls received.
    pub fn calls(&self) -> (usize, usize) {
        (
            self.state.lists.load(Ordering::Relaxed),
            self.state.statuses.load(Ordering::Relaxed),
        )
    }
}

impl Drop for FakeCri {
    fn drop(&mut self) {
        self.task.abort();
    }
}

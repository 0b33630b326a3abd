//! The agent's side of the Kubernetes source tests: in process, the
//! reconciler (real eBPF, or a recording redirector for the bulk tests)
//! with its published snapshots and the running Kubernetes source pushing
//! into it through the agent's own sink; or the `shunt agent` binary given
//! only a kubeconfig.

#![allow(dead_code)] // each binary uses what it needs

#[path = "loopback.rs"]
mod loopback;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::Arc,
    time::Duration,
};

use shunt::{
    agent::{NodeAgent, Reconciler, ReconcilerInputs},
    app::AgentSink,
    control::{
        SourceSink,
        kube::{KubeSource, SourceStats},
    },
    snapshot::NodeSnapshot,
    state::{PodState, WorkloadKey},
};
use tokio::{sync::watch, task::JoinHandle};

/// A reconciler and the Kubernetes source feeding it.
pub struct Agent {
    pub reconciler: Reconciler,
    pub snapshots: watch::Receiver<Arc<NodeSnapshot>>,
    pub source: JoinHandle<()>,
    pub stats: Arc<SourceStats>,
}

impl Agent {
    /// Starts a reconciler owning `agent` (verifying every `verify_every`)
    /// and `source` pushing into it.
    pub fn start(agent: NodeAgent, source: KubeSource, verify_every: Duration) -> Self {
        let (pods, pods_rx) = watch::channel(None);
        let reconciler = Reconciler::spawn(
            agent,
            ReconcilerInputs {
                pods: pods_rx,
                store_applied: None,
                verify_every,
            },
            tokio::runtime::Handle::current(),
        )
        .expect("reconcile thread");
        let sink: Arc<dyn SourceSink> = Arc::new(AgentSink::new(pods, None));
        let stats = source.stats();
        let snapshots = reconciler.snapshots();
        let source = tokio::spawn(source.run(sink, reconciler.snapshots()));
        Agent {
            reconciler,
            snapshots,
            source,
            stats,
        }
    }

    /// Stops the source. With `unenrol`, unenrols everything like a clean
    /// shutdown; without, leaves the kernel as a crashed agent would.
    pub async fn stop(self, unenrol: bool) {
        self.source.abort();
        let _ = self.source.await;
        self.reconciler.stop(unenrol).await;
    }

    pub fn state(&self, pod: &str, ns: &str) -> Option<PodState> {
        let key = WorkloadKey::new(ns, pod);
        self.snapshots.borrow().pod(&key).map(|p| p.state.clone())
    }

    pub fn enrolled(&self, pod: &str, ns: &str) -> bool {
        self.state(pod, ns) == Some(PodState::Enrolled)
    }

    /// The netns the agent's snapshot shows for pod `name`.
    pub async fn netns_of(&self, name: &str) -> Option<PathBuf> {
        self.snapshots
            .borrow()
            .pods
            .iter()
            .find(|p| p.workload.name == name)
            .unwrap_or_else(|| panic!("{name} in the snapshot"))
            .workload
            .netns
            .clone()
    }
}

/// Kills (by its PID) and reaps a child process when dropped, also when a
/// test fails.
pub struct ChildGuard(pub std::process::Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A bpf pin dir for one test agent, removed when dropped (also on panic).
pub struct PinDir(pub PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The `shunt agent` binary started by [`spawn_agent_binary`].
pub struct AgentProcess {
    pub child: ChildGuard,
    pub admin: SocketAddr,
    pub metrics: SocketAddr,
    pub log_path: PathBuf,
}

impl AgentProcess {
    /// What the agent wrote so far (stdout and stderr).
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log_path).unwrap_or_default()
    }
}

/// The `shunt agent` binary in eBPF mode on node `node`, given only
/// `kubeconfig`, its socket programs on `cgroup_root`, its pins in
/// `pin_dir`, its CA and log in `dir`; `extra` are more flags. It runs in
/// the test's own netns: every port it serves goes on a free loopback
/// port, never on the node-wide defaults.
pub fn spawn_agent_binary(
    node: &str,
    kubeconfig: &Path,
    pin_dir: &Path,
    cgroup_root: &Path,
    dir: &Path,
    extra: &[&str],
) -> AgentProcess {
    let free_port = loopback::private_addr;
    let (admin, metrics, readiness) = (free_port(), free_port(), free_port());
    let log_path = dir.join("agent.log");
    let log = std::fs::File::create(&log_path).expect("log file");
    let child = std::process::Command::new(env!("CARGO_BIN_EXE_shunt"))
        .arg("agent")
        .args(["--redirect", "ebpf", "--log-level", "info,shunt=debug"])
        .arg("--bpf-pin-dir")
        .arg(pin_dir)
        .arg("--cgroup-root")
        .arg(cgroup_root)
        .arg("--admin-addr")
        .arg(admin.to_string())
        .arg("--metrics-addr")
        .arg(metrics.to_string())
        .arg("--readiness-addr")
        .arg(readiness.to_string())
        .arg("--ca-dir")
        .arg(dir.join("ca"))
        .args(extra)
        .env("NODE_NAME", node)
        .env("KUBECONFIG", kubeconfig)
        .env_remove("KUBERNETES_SERVICE_HOST")
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .expect("start shunt agent");
    AgentProcess {
        child: ChildGuard(child),
        admin,
        metrics,
        log_path,
    }
}

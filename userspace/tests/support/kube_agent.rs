//! The agent's side of the Kubernetes source tests: the reconciler (real
//! eBPF, or a recording redirector for the bulk tests) with its published
//! snapshots, and the running Kubernetes source pushing into it through
//! the agent's own sink.

#![allow(dead_code)] // each binary uses what it needs

use std::{path::PathBuf, sync::Arc, time::Duration};

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

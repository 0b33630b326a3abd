//! [`AgentSink`]: the agent's [`SourceSink`]. It hands this node's pods to
//! the reconciler and the cluster-wide view to the workload store's owner;
//! both hand-overs only replace a value (the latest wins), so no source ever
//! waits on the agent.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::watch;
use tracing::info;

use super::store::Latest;
use crate::{
    agent::PodsUpdate,
    control::{ClusterView, NodePods, SourceSink},
};

/// Where every source of the agent pushes.
pub struct AgentSink {
    pods: watch::Sender<Option<PodsUpdate>>,
    /// `None` when nothing keeps a workload store (no builtin proxy): the
    /// cluster-wide view has no reader then.
    cluster: Option<Arc<Latest<(u64, ClusterView)>>>,
    cluster_views: AtomicU64,
}

impl AgentSink {
    pub fn new(
        pods: watch::Sender<Option<PodsUpdate>>,
        cluster: Option<Arc<Latest<(u64, ClusterView)>>>,
    ) -> Self {
        Self {
            pods,
            cluster,
            cluster_views: AtomicU64::new(0),
        }
    }
}

impl SourceSink for AgentSink {
    fn node_pods(&self, pods: NodePods) {
        let after_cluster_views = self.cluster_views.load(Ordering::SeqCst);
        self.pods.send_replace(Some(PodsUpdate {
            pods,
            after_cluster_views,
        }));
    }

    fn cluster(&self, view: ClusterView) {
        if let Some(cluster) = &self.cluster {
            let number = self.cluster_views.fetch_add(1, Ordering::SeqCst) + 1;
            cluster.put((number, view));
        }
    }

    fn synced(&self, source: &'static str) {
        info!(source, "source delivered its first complete view");
    }
}

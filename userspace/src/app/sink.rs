//! [`AgentSink`]: the agent's [`SourceSink`]. It hands this node's pods to
//! the reconciler and the cluster-wide view to the workload store's owner;
//! both hand-overs only replace a value (the latest wins; cluster updates
//! not taken yet are merged), so no source ever waits on the agent.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use tokio::sync::watch;
use tracing::info;

use super::store::Latest;
use crate::{
    agent::PodsUpdate,
    control::{ClusterDelta, ClusterUpdate, ClusterView, NodePods, SourceSink},
};

/// Where every source of the agent pushes.
pub struct AgentSink {
    pods: watch::Sender<Option<PodsUpdate>>,
    /// `None` when nothing keeps a workload store (no builtin proxy): the
    /// cluster-wide view has no reader then.
    cluster: Option<Arc<Latest<(u64, ClusterUpdate)>>>,
    cluster_views: AtomicU64,
}

impl AgentSink {
    pub fn new(
        pods: watch::Sender<Option<PodsUpdate>>,
        cluster: Option<Arc<Latest<(u64, ClusterUpdate)>>>,
    ) -> Self {
        Self {
            pods,
            cluster,
            cluster_views: AtomicU64::new(0),
        }
    }
}

impl AgentSink {
    /// Hands `update` to the store's owner, folded into the one it has not
    /// taken yet, if any (a delta must not be lost).
    fn push(&self, update: ClusterUpdate) {
        if let Some(cluster) = &self.cluster {
            let number = self.cluster_views.fetch_add(1, Ordering::SeqCst) + 1;
            cluster.put_merged((number, update), |(first, untaken), (number, next)| {
                (number.max(first), untaken.merge(next))
            });
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
        self.push(ClusterUpdate::Full(view));
    }

    fn cluster_delta(&self, delta: ClusterDelta) {
        self.push(ClusterUpdate::Delta(delta));
    }

    fn synced(&self, source: &'static str) {
        info!(source, "source delivered its first complete view");
    }
}

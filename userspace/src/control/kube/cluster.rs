//! Cluster-wide workload discovery: every pod's IPs, identity and node, for
//! the proxy (which must know who a peer IP is and where it runs), and every
//! service's VIPs and endpoints (see [`super::service`]).
//!
//! A pod watch without a field selector plus a namespace watch (for the
//! dataplane-mode label), reduced to facts like the node source's, and
//! debounced into full [`WorkloadStore`] snapshots published on a
//! `tokio::sync::watch` channel: readers borrow an immutable snapshot and
//! never lock against the writer. Pods without an IP yet are left out (there
//! is nothing to route to). Services join the snapshot once their two
//! watches have listed, independently of the pods: a cluster where the agent
//! may not list services (an older RBAC) still gets pod discovery. Kept
//! separate from the node source on purpose:
//! the node source must keep its narrow field-selected watch (what this node
//! enrols must not wait on a cluster-sized list), and a consumer that does
//! not need discovery (no proxy) does not pay for it.

use std::{sync::Arc, time::Duration};

use ::kube::Client;
use tokio::{sync::watch, time::Instant};
use tracing::{debug, info};

use super::{SourceStats, Step, Watches, service::ServiceWatches, sleep_until};
use crate::state::{Workload, WorkloadStore};

/// Keeps a [`WorkloadStore`] of every pod in the cluster.
pub struct ClusterWorkloads {
    client: Client,
    debounce: Duration,
    publish: watch::Sender<Arc<WorkloadStore>>,
    stats: Arc<SourceStats>,
}

impl ClusterWorkloads {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            debounce: Duration::from_millis(100),
            publish: watch::Sender::new(Arc::new(WorkloadStore::new())),
            stats: Arc::default(),
        }
    }

    /// A receiver of the current snapshot (empty until the first list).
    pub fn subscribe(&self) -> watch::Receiver<Arc<WorkloadStore>> {
        self.publish.subscribe()
    }

    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// Watches until the future is dropped.
    pub async fn run(self) {
        let mut watch = Watches::new(&self.client, None, self.stats.clone());
        let mut services = ServiceWatches::new(&self.client, self.stats.clone());
        let mut store = WorkloadStore::new();
        let mut deadline: Option<Instant> = None;
        loop {
            let armed = deadline;
            tokio::select! {
                step = watch.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                step = services.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                _ = sleep_until(armed), if armed.is_some() => {
                    deadline = None;
                    let mut changed = false;
                    if watch.view.listed() {
                        let view = &watch.view;
                        let workloads: Vec<Workload> = view
                            .pods
                            .values()
                            .filter(|facts| !facts.ips.is_empty())
                            .map(|facts| facts.to_workload(view.namespaces.get(&facts.key.namespace)))
                            .collect();
                        let changes = store.replace_all(workloads);
                        if !changes.is_empty() {
                            changed = true;
                            debug!(added = changes.added.len(), removed = changes.removed.len(), updated = changes.updated.len(), "cluster workloads changed");
                            if !store.is_empty() && changes.added.len() == store.len() {
                                info!(workloads = store.len(), "cluster workloads listed");
                            }
                        }
                    }
                    if services.listed() && store.replace_services(services.services()) {
                        changed = true;
                        debug!(services = store.services().len(), "cluster services changed");
                    }
                    if changed {
                        // Publish a copy: the store is this loop's, readers
                        // get an immutable snapshot.
                        self.publish.send_replace(Arc::new(store.clone()));
                    }
                }
            }
        }
    }
}

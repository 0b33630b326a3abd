//! Cluster-wide workload discovery: every pod's IPs, identity and node, for
//! the proxy (which must know who a peer IP is and where it runs), and every
//! service's VIPs and endpoints (see [`super::service`]).
//!
//! A pod watch without a field selector plus a namespace watch (for the
//! dataplane-mode label), reduced to facts like the node source's, and
//! debounced into complete [`ClusterView`]s pushed through the
//! [`SourceSink`] (the workload store's owner applies them). Pods without
//! an IP yet are left out (there is nothing to route to). Services join the
//! view once their two watches have listed, independently of the pods: a
//! cluster where the agent may not list services (an older RBAC) still gets
//! pod discovery. Kept separate from the node source on purpose: the node
//! source must keep its narrow field-selected watch (what this node enrols
//! must not wait on a cluster-sized list), and a consumer that does not need
//! discovery (no proxy) does not pay for it.

use std::{sync::Arc, time::Duration};

use ::kube::Client;
use tokio::time::Instant;
use tracing::{debug, info};

use super::{SourceStats, Step, Watches, service::ServiceWatches, sleep_until};
use crate::{
    control::{ClusterView, SourceSink},
    state::Workload,
};

/// Name of this source in readiness and logs.
pub const SOURCE: &str = "kubernetes-cluster";

/// Discovers every pod and service of the cluster.
pub struct ClusterWorkloads {
    client: Client,
    debounce: Duration,
    stats: Arc<SourceStats>,
}

impl ClusterWorkloads {
    pub fn new(client: Client) -> Self {
        Self {
            client,
            debounce: Duration::from_millis(100),
            stats: Arc::default(),
        }
    }

    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// Watches and pushes until the future is dropped.
    pub async fn run(self, sink: Arc<dyn SourceSink>) {
        let mut watch = Watches::new(&self.client, None, self.stats.clone());
        let mut services = ServiceWatches::new(&self.client, self.stats.clone());
        let mut last: Option<ClusterView> = None;
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
                    if !watch.view.listed() && !services.listed() {
                        continue;
                    }
                    let view = &watch.view;
                    let workloads: Vec<Workload> = if view.listed() {
                        view.pods
                            .values()
                            .filter(|facts| !facts.ips.is_empty())
                            .map(|facts| facts.to_workload(view.namespaces.get(&facts.key.namespace)))
                            .collect()
                    } else {
                        Vec::new()
                    };
                    let next = ClusterView {
                        workloads,
                        services: if services.listed() { services.services() } else { Vec::new() },
                        // Kubernetes' AuthorizationPolicy objects are not
                        // watched (yet).
                        policies: Vec::new(),
                    };
                    if last.as_ref() == Some(&next) {
                        continue;
                    }
                    debug!(workloads = next.workloads.len(), services = next.services.len(), "cluster view changed");
                    if last.is_none() {
                        info!(workloads = next.workloads.len(), services = next.services.len(), "cluster workloads listed");
                        sink.synced(SOURCE);
                    }
                    last = Some(next.clone());
                    sink.cluster(next);
                }
            }
        }
    }
}

//! The workloads-file source (`--workloads FILE`): a task that watches the
//! file and pushes what it says through the [`SourceSink`], as the
//! Kubernetes source pushes what the API server says.
//!
//! The file names every workload (of any node), the services and the trust
//! domain; this node's pods go out as [`NodePods`], everything as the
//! [`ClusterView`]. The file is re-read when its modification time or length
//! changes (checked every `reload_interval`); an edit that does not load is
//! logged and ignored, so a bad edit loses nothing that was enrolled.

use std::{
    path::{Path, PathBuf},
    sync::Arc,
    time::{Duration, SystemTime},
};

use tracing::{error, info};

use super::{ClusterView, NodePods, SourceSink, local, waypoint_allow};

/// Name of this source in readiness and logs.
pub const SOURCE: &str = "workloads-file";

/// Watches one workloads file.
pub struct FileSource {
    path: PathBuf,
    node: String,
    /// `--cluster-domain`: services are named in it.
    cluster_domain: String,
    reload_interval: Duration,
    /// What was loaded last (pushed first by [`FileSource::run`]).
    current: local::LocalWorkloads,
    /// `--auto-allow-waypoint-policy on` ([`super::waypoint_allow`]).
    waypoint_allow: bool,
}

impl FileSource {
    /// Loads the file now, so that an agent given a bad file fails to start
    /// rather than running with nothing.
    pub fn load(
        path: &Path,
        node: &str,
        cluster_domain: &str,
        reload_interval: Duration,
    ) -> Result<Self, local::WorkloadsFileError> {
        let current = local::load(path, node, cluster_domain)?;
        info!(
            file = %path.display(),
            workloads = current.workloads.len(),
            services = current.services.len(),
            node,
            "workloads file loaded"
        );
        Ok(Self {
            path: path.to_path_buf(),
            node: node.to_string(),
            cluster_domain: cluster_domain.to_string(),
            reload_interval: reload_interval.max(Duration::from_millis(100)),
            current,
            waypoint_allow: false,
        })
    }

    /// Adds istiod's implicit allow-from-waypoint policies
    /// ([`super::waypoint_allow`]) to what the file says.
    pub fn with_waypoint_allow(mut self, on: bool) -> Self {
        self.waypoint_allow = on;
        self
    }

    /// The trust domain the file names.
    pub fn trust_domain(&self) -> &crate::state::TrustDomain {
        &self.current.trust_domain
    }

    /// Pushes the loaded file, then every valid edit, until the future is
    /// dropped.
    pub async fn run(mut self, sink: Arc<dyn SourceSink>) {
        let mut seen = file_stamp(&self.path);
        self.push(sink.as_ref());
        sink.synced(SOURCE);
        let mut tick = tokio::time::interval(self.reload_interval);
        tick.tick().await;
        loop {
            tick.tick().await;
            let stamp = file_stamp(&self.path);
            if stamp == seen {
                continue;
            }
            seen = stamp;
            match local::load(&self.path, &self.node, &self.cluster_domain) {
                Ok(workloads) => {
                    info!(file = %self.path.display(), "workloads file changed; reconciling");
                    self.current = workloads;
                    self.push(sink.as_ref());
                }
                // Keep what is enrolled: a bad edit must lose nothing.
                Err(e) => {
                    error!(error = %e, "workloads file changed but is invalid; keeping the previous workloads")
                }
            }
        }
    }

    /// The cluster view first: a pod enrolled by this list may connect to
    /// a service of it at once.
    fn push(&self, sink: &dyn SourceSink) {
        let current = &self.current;
        let mut workloads = current.workloads.clone();
        let mut policies = current.policies.clone();
        if self.waypoint_allow {
            policies.extend(waypoint_allow::allow_from_waypoints(
                &mut workloads,
                &current.services,
                &current.trust_domain,
            ));
        }
        sink.cluster(ClusterView {
            workloads: workloads.into_iter().map(Into::into).collect(),
            services: current.services.iter().cloned().map(Into::into).collect(),
            policies,
        });
        sink.node_pods(NodePods {
            trust_domain: current.trust_domain.clone(),
            pods: current
                .workloads
                .iter()
                .filter(|w| w.node == self.node)
                .cloned()
                .collect(),
        });
    }
}

/// (modified time, length) of the file, to notice edits without a watcher.
fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

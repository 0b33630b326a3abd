//! Sources: where the agent learns which pods exist and what the cluster
//! looks like — a local workloads file ([`local`]), the Kubernetes API
//! ([`kube`]) or istiod (`crate::xds`).
//!
//! Every source pushes through one narrow interface, [`SourceSink`]: this
//! node's pods ([`NodePods`], what enrolment acts on) go to the reconciler,
//! the cluster-wide view ([`ClusterView`], what the proxy looks peers up in;
//! then [`ClusterDelta`]s from a source that keeps its view) goes to the one
//! task that owns the workload store. Sources never see the
//! agent, and nothing calls back into them.
pub mod cni;
mod delta;
pub mod file;
pub mod kube;
pub mod local;
/// Waypoints from Istio's labels, for the sources without istiod.
pub mod waypoint;
pub mod waypoint_allow;

pub use delta::{ClusterDelta, ClusterUpdate};

/// The cluster-wide view one discovery source knows: every workload of any
/// node, every service, every authorization policy. Entries are shared and
/// immutable: a source that keeps them (xDS) hands over pointers, and the
/// store replaces only the entries that are not the same.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterView {
    pub workloads: Vec<std::sync::Arc<crate::state::Workload>>,
    pub services: Vec<std::sync::Arc<crate::state::Service>>,
    pub policies: Vec<crate::authz::Policy>,
}

/// This node's pods as the pod source knows them (what enrolment acts on).
#[derive(Clone, Debug, PartialEq)]
pub struct NodePods {
    pub trust_domain: crate::state::TrustDomain,
    pub pods: Vec<crate::state::Workload>,
}

/// Where every source pushes. Sources hold an `Arc<dyn SourceSink>`; they
/// never see the agent. Calls are cheap and never block (they hand the value
/// to the owner's task).
pub trait SourceSink: Send + Sync + 'static {
    /// This node's pods changed (a complete list).
    fn node_pods(&self, pods: NodePods);
    /// The cluster-wide view changed (complete).
    fn cluster(&self, view: ClusterView);
    /// The cluster-wide view changed by `delta`, after a complete view
    /// pushed earlier (a source that keeps its view sends only changes).
    fn cluster_delta(&self, delta: ClusterDelta);
    /// Whether this source has delivered its first complete view (readiness).
    fn synced(&self, source: &'static str) {
        let _ = source;
    }
}

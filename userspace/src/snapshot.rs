//! [`NodeSnapshot`]: what the reconciler publishes, immutable, after every
//! reconcile and every verify pass, on a `tokio::sync::watch` channel.
//!
//! Observers — `/metrics`, `/healthz/ready`, the admin API (and through it
//! `shunt status`), the Kubernetes source's status annotations — read the
//! latest snapshot. They never lock the reconciler's state nor enter a pod's
//! network namespace: hooks and counters were read by the reconciler's
//! verify pass (or right after the pod's enrolment), on its own thread.
//!
//! Two parts change outside the reconciler and are read live by observers,
//! from registries the proxy owns (atomics and the identity manager's map,
//! never the reconciler's state): the proxy's counters and the identities'
//! certificates ([`SnapshotReader::read`]). The reconciler fills them too, so
//! that a snapshot is complete on its own.

use std::{collections::BTreeMap, sync::Arc};

use tokio::sync::watch;

use crate::{
    identity::WorkloadCert,
    proxy::{Proxy, ProxyStats},
    redirect::{EnrolledPod, RedirectMode},
    state::{PodState, SpiffeId, TrustDomain, Workload, WorkloadKey},
};

/// This node as the reconciler last saw it.
#[derive(Clone, Debug)]
pub struct NodeSnapshot {
    pub node: String,
    /// Redirection mode in use (`ebpf` or `iptables`).
    pub mode: RedirectMode,
    pub trust_domain: TrustDomain,
    /// Whether the pod source has handed over a complete list and it was
    /// reconciled (readiness).
    pub synced: bool,
    /// Every pod of this node, in key order.
    pub pods: Arc<[PodSnapshot]>,
    /// How many verify passes read the pods' hooks and counters so far.
    pub verify_passes: u64,
    /// The builtin proxy's counters (absent without one).
    pub proxy: Option<ProxyStats>,
    /// The current certificate of every identity the proxy holds.
    pub certificates: BTreeMap<SpiffeId, Arc<WorkloadCert>>,
    /// The kernel's authorization point, when there is one.
    pub kernel_authz: Option<crate::api::KernelAuthzStatus>,
    /// What the last write of the fast path's flow 2 maps did (eBPF mode
    /// with the kernel authorization point).
    pub mesh_local: Option<crate::redirect::MeshLocalWritten>,
}

/// One pod of this node.
#[derive(Clone, Debug)]
pub struct PodSnapshot {
    pub workload: Workload,
    pub state: PodState,
    /// The pod as the redirector last saw it (hooks, counters), while it is
    /// enrolled.
    pub kernel: Option<EnrolledPod>,
    /// Its connects the kernel's authorization point refused, per policy
    /// (as the last verify pass read them).
    pub kernel_denials: Vec<(crate::authz::PolicyKey, u64)>,
}

impl NodeSnapshot {
    /// Before the first reconcile: no pod, not synced.
    pub fn empty(node: impl Into<String>, mode: RedirectMode, trust_domain: TrustDomain) -> Self {
        Self {
            node: node.into(),
            mode,
            trust_domain,
            synced: false,
            pods: Arc::from(Vec::new()),
            verify_passes: 0,
            proxy: None,
            certificates: BTreeMap::new(),
            kernel_authz: None,
            mesh_local: None,
        }
    }

    pub fn pod(&self, key: &WorkloadKey) -> Option<&PodSnapshot> {
        self.pods
            .binary_search_by(|p| p.workload.key().cmp(key))
            .ok()
            .map(|i| &self.pods[i])
    }

    /// What the last reconcile did with each pod.
    pub fn pod_states(&self) -> BTreeMap<WorkloadKey, PodState> {
        self.pods
            .iter()
            .map(|p| (p.workload.key(), p.state.clone()))
            .collect()
    }

    /// The pods the redirector has enrolled, with their hooks and counters.
    pub fn enrolled(&self) -> impl Iterator<Item = &EnrolledPod> {
        self.pods.iter().filter_map(|p| p.kernel.as_ref())
    }

    /// Fills the parts the proxy owns from `proxy` as they are now.
    pub fn with_proxy(mut self, proxy: Option<&Proxy>) -> Self {
        match proxy {
            Some(proxy) => {
                self.proxy = Some(proxy.stats());
                self.certificates = certificates(proxy);
            }
            None => {
                self.proxy = None;
                self.certificates.clear();
            }
        }
        self
    }
}

/// The current certificate of every identity `proxy` holds.
fn certificates(proxy: &Proxy) -> BTreeMap<SpiffeId, Arc<WorkloadCert>> {
    let identities = proxy.identities();
    identities
        .identities()
        .into_iter()
        .filter_map(|id| {
            let cert = identities.current(&id)?;
            Some((id, cert))
        })
        .collect()
}

/// What observers hold: the reconciler's snapshots, and the proxy for the
/// parts it owns. Cheap to clone.
#[derive(Clone, Debug)]
pub struct SnapshotReader {
    snapshots: watch::Receiver<Arc<NodeSnapshot>>,
    proxy: Option<Proxy>,
    /// With `--xds-address`: istiod's connection and what it sent.
    xds: Option<crate::api::XdsStatusHandle>,
    /// Where this node's pods come from (`workloads-file`, `kubernetes`),
    /// for `/config_dump`.
    pod_source: &'static str,
}

impl SnapshotReader {
    pub fn new(snapshots: watch::Receiver<Arc<NodeSnapshot>>, proxy: Option<Proxy>) -> Self {
        Self {
            snapshots,
            proxy,
            xds: None,
            pod_source: "",
        }
    }

    /// Names where this node's pods come from (`workloads-file`,
    /// `kubernetes`).
    pub fn with_pod_source(mut self, name: &'static str) -> Self {
        self.pod_source = name;
        self
    }

    /// Where this node's pods come from.
    pub fn pod_source(&self) -> &'static str {
        self.pod_source
    }

    /// Also reads istiod's connection status (readiness, admin API).
    pub fn with_xds(mut self, xds: crate::api::XdsStatusHandle) -> Self {
        self.xds = Some(xds);
        self
    }

    /// istiod's connection, with `--xds-address`.
    pub fn xds(&self) -> Option<&crate::api::XdsStatusHandle> {
        self.xds.as_ref()
    }

    /// The latest snapshot, with the proxy's counters and certificates as
    /// they are now. Never waits on the reconciler.
    pub fn read(&self) -> NodeSnapshot {
        let latest = self.snapshots.borrow().clone();
        NodeSnapshot::clone(&latest).with_proxy(self.proxy.as_ref())
    }

    /// The builtin proxy (absent without one).
    pub fn proxy(&self) -> Option<&Proxy> {
        self.proxy.as_ref()
    }

    /// The channel itself (to wait for the next snapshot).
    pub fn subscribe(&self) -> watch::Receiver<Arc<NodeSnapshot>> {
        self.snapshots.clone()
    }
}

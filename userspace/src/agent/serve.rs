//! The proxy side of a reconcile: which pods the builtin proxy serves.
//!
//! A pod's listeners are bound before the redirector sends its traffic
//! there. Binding is the proxy's work (a thread in the pod's netns, a few
//! sockets, its identity registered) and waits on other threads, so a
//! reconcile that brings many pods at once — a cold start, the burst a
//! watch delivers — binds their listeners concurrently first
//! ([`NodeAgent::serve_all`], at most [`SERVE_AT_ONCE`] pods at a time),
//! then enrols pod by pod as before: a pod is still redirected only after
//! its own listeners are bound, and one whose listeners failed is still
//! enrolled and fails closed. The reconcile thread waits for the whole
//! batch; the redirector and every kernel object stay its own.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    path::Path,
    time::{Duration, Instant},
};

use futures::StreamExt as _;
use tracing::{error, info, warn};

use super::NodeAgent;
use crate::{
    netns::NsId,
    proxy::PodNet,
    state::{SpiffeId, Workload, WorkloadKey},
};

/// How many pods' listeners are being bound at once: enough to overlap
/// the waits of a burst (thread starts, round trips to the pods' socket
/// threads), few enough that the runtime's other work (connections, the
/// admin API) keeps its share.
pub(super) const SERVE_AT_ONCE: usize = 32;

/// What became of binding a pod's listeners in a batch.
pub(super) struct Served {
    /// `None` when they are bound, else why not (the pod fails closed).
    pub outcome: Option<String>,
    /// How long binding them took (part of the pod's enrolment latency).
    pub took: Duration,
}

impl NodeAgent {
    /// The pod as the proxy should serve it, if a builtin proxy runs, the
    /// pod is captured with a known netns, and the proxy does not serve it
    /// already as it should. A pod whose DNS capture changed, or whose
    /// netns is another namespace than the one its listeners live in (its
    /// sandbox was recreated: same pod, maybe the same path and IP, a new
    /// namespace), is served again: new sockets first, then the old ones
    /// close. Namespaces are compared by identity, never by path.
    fn to_serve(&self, key: &WorkloadKey, workload: &Workload, netns: &Path) -> Option<PodNet> {
        let handle = self.proxy.as_ref()?;
        let dns = self.captures_dns(workload);
        let identity = self.pod_identity(key, workload)?;
        if let Some(served) = handle.proxy.served(key) {
            // A path that cannot be read names no namespace to move to:
            // the listeners stay (the redirector reports the pod).
            let moved = NsId::of_path(netns).is_ok_and(|now| now != served.netns);
            if !moved && served.dns == dns && served.identity == identity {
                return None;
            }
        }
        Some(PodNet {
            key: key.clone(),
            netns: netns.to_path_buf(),
            ips: workload.ips.clone(),
            identity,
            dns,
        })
    }

    /// The identity a pod of this node is served with: its own trust
    /// domain when its workload names one, else the one istiod's workload
    /// for it carries (ztunnel takes each Workload's `trust_domain` from
    /// xDS), else the agent's (`--trust-domain`, or the workloads file's).
    pub(super) fn pod_identity(&self, key: &WorkloadKey, workload: &Workload) -> Option<SpiffeId> {
        self.proxy.as_ref()?;
        Some(
            self.with_trust_domain(key, workload)
                .identity(&self.trust_domain),
        )
    }

    /// `workload` with the trust domain the cluster view gives it, when it
    /// names none itself (what observers and the kernel's verdicts show).
    pub(super) fn with_trust_domain(&self, key: &WorkloadKey, workload: &Workload) -> Workload {
        let mut workload = workload.clone();
        if workload.trust_domain.is_none()
            && let Some(handle) = self.proxy.as_ref()
        {
            workload.trust_domain = handle.proxy.cluster_trust_domain(key, &workload.ips);
        }
        workload
    }

    /// Whether a served pod's identity would change now (the cluster view
    /// brought its trust domain): it is to be served again.
    pub(super) fn identity_changed(&self) -> bool {
        let Some(handle) = self.proxy.as_ref() else {
            return false;
        };
        self.pods.iter().any(|(key, entry)| {
            handle.proxy.served(key).is_some_and(|served| {
                self.pod_identity(key, &entry.workload)
                    .is_some_and(|identity| identity != served.identity)
            })
        })
    }

    /// Starts the proxy's listeners for the pod (if a proxy runs and does
    /// not serve it yet). Returns why it could not.
    pub(super) fn serve(
        &self,
        key: &WorkloadKey,
        workload: &Workload,
        netns: &Path,
    ) -> Option<String> {
        let handle = self.proxy.as_ref()?;
        let pod = self.to_serve(key, workload, netns)?;
        self.before_serving(key, netns);
        handle
            .runtime
            .block_on(handle.proxy.add_pod(pod))
            .err()
            .map(|e| {
                // Redirection still goes on: with no listener the pod fails
                // closed rather than talking around the mesh.
                error!(error = %e, "the proxy cannot serve the pod; its traffic fails closed");
                e.to_string()
            })
    }

    /// Binds the listeners of every pod of `workloads` that `converge`
    /// would serve, concurrently (at most [`SERVE_AT_ONCE`] at a time), and
    /// returns each one's outcome for `converge` to use instead of serving
    /// it then. Left out (served by `converge` one by one, as before): pods
    /// that share an address with another pod of the batch (the proxy
    /// refuses the second of two pods on one IP; which one is second must
    /// not depend on timing), and everything when pods are handed to
    /// ztunnel or no builtin proxy runs.
    pub(super) fn serve_all(&self, workloads: &[Workload]) -> HashMap<WorkloadKey, Served> {
        let Some(handle) = self.proxy.as_ref().filter(|_| self.ztunnel.is_none()) else {
            return HashMap::new();
        };
        let wanted: Vec<PodNet> = workloads
            .iter()
            .filter(|w| w.captured())
            .filter_map(|w| self.to_serve(&w.key(), w, w.netns.as_deref()?))
            .collect();
        let mut pods_per_ip: BTreeMap<IpAddr, usize> = BTreeMap::new();
        for ip in wanted.iter().flat_map(|pod| &pod.ips) {
            *pods_per_ip.entry(*ip).or_default() += 1;
        }
        let batch: Vec<PodNet> = wanted
            .into_iter()
            .filter(|pod| pod.ips.iter().all(|ip| pods_per_ip.get(ip) == Some(&1)))
            .collect();
        if batch.len() < 2 {
            // Nothing to overlap: `converge` serves it as it always did.
            return HashMap::new();
        }
        for pod in &batch {
            self.before_serving(&pod.key, &pod.netns);
        }
        let count = batch.len();
        let proxy = &handle.proxy;
        let outcomes: Vec<(WorkloadKey, Served)> = handle.runtime.block_on(
            futures::stream::iter(batch)
                .map(|pod| async move {
                    let key = pod.key.clone();
                    let started = Instant::now();
                    let outcome = proxy.add_pod(pod).await.err().map(|e| {
                        error!(pod = %key, error = %e, "the proxy cannot serve the pod; its traffic fails closed");
                        e.to_string()
                    });
                    let took = started.elapsed();
                    (key, Served { outcome, took })
                })
                .buffer_unordered(SERVE_AT_ONCE)
                .collect(),
        );
        let failed = outcomes.iter().filter(|(_, s)| s.outcome.is_some()).count();
        info!(
            pods = count,
            failed, "bound the listeners of a batch of pods before enrolling them"
        );
        outcomes.into_iter().collect()
    }

    /// What the redirector needs in place before a proxy accepts a
    /// connection for the pod (`Redirector::before_serving`). A failure
    /// is logged and the pod served all the same: its enrolment meets the
    /// same problem and says so.
    pub(super) fn before_serving(&self, key: &WorkloadKey, netns: &Path) {
        if let Err(e) = self.redirector.before_serving(key, netns) {
            warn!(pod = %key, error = %e, "cannot ready the pod's network namespace for the proxy");
        }
    }

    pub(super) fn stop_serving(&self, key: &WorkloadKey) {
        if let Some(handle) = &self.proxy
            && handle.proxy.remove_pod(key)
        {
            info!("proxy no longer serves the pod");
        }
    }
}

//! Pod sandboxes the CNI plugin announced (`control::cni`), kept by the pod
//! source beside what its watches say.
//!
//! At ADD the plugin gives what the API does not have yet: the sandbox's
//! netns path (`CNI_NETNS`) and its addresses (`prevResult`; the pod's
//! `status.podIPs` are written only after the sandbox is up). The source
//! judges the pod as it judges any pod (its facts from the watch, or read
//! from the API server when the watch has not shown it yet), and for a mesh
//! pod lists it with that netns and those addresses in the very next
//! `NodePods`; the request is answered once the reconciler's snapshot shows
//! the pod, in that netns, enrolled (or in error, or out of the mesh). A
//! pod keeps its sandbox's netns until DEL, so the watch's netns discovery
//! never gives the same pod a second one.

use std::{collections::HashMap, net::IpAddr, path::PathBuf};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use kube::Api;
use shunt_cni::wire::{Command, Reply, Request};
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use super::{
    KubeSource, Lenient, SyncState, View,
    pod::{NamespaceFacts, PodFacts},
};
use crate::control::{SourceSink, cni::CniCall};
use crate::{
    snapshot::NodeSnapshot,
    state::{PodState, WorkloadKey},
};

/// A sandbox the plugin announced at ADD, until its DEL.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Sandbox {
    pub(crate) container_id: String,
    pub(crate) netns: PathBuf,
    pub(crate) ips: Vec<IpAddr>,
}

/// An ADD (or CHECK) waiting for the reconciler's verdict.
#[derive(Debug)]
struct Waiter {
    key: WorkloadKey,
    netns: PathBuf,
    answer: oneshot::Sender<Reply>,
}

/// What the source knows from the plugin. See the module docs.
#[derive(Debug, Default)]
pub(crate) struct Sandboxes {
    pub(crate) by_pod: HashMap<WorkloadKey, Sandbox>,
    /// Pods read from the API for a sandbox the watch had not shown yet;
    /// dropped once the watch lists them.
    pub(crate) fetched: HashMap<WorkloadKey, PodFacts>,
    fetched_namespaces: HashMap<String, NamespaceFacts>,
    waiting: Vec<Waiter>,
}

/// Why a sandbox's pod could not be judged.
#[derive(Debug, thiserror::Error)]
pub(crate) enum LookupError {
    #[error("cannot read {what} from the API server: {source}")]
    Api {
        what: String,
        source: Box<kube::Error>,
    },
    #[error("{what} does not exist in the API server")]
    Missing { what: String },
    #[error("{what} cannot be read: {problem}")]
    Malformed { what: String, problem: String },
}

impl Sandboxes {
    /// The namespace facts fetched for a sandbox (used while the namespace
    /// watch has not shown the namespace).
    pub(crate) fn fetched_namespace(&self, name: &str) -> Option<&NamespaceFacts> {
        self.fetched_namespaces.get(name)
    }

    /// Reads the pod (and its namespace when `namespace_known` is false)
    /// from the API server, for a sandbox whose pod the watch has not shown.
    pub(crate) async fn fetch(
        &mut self,
        client: &kube::Client,
        key: &WorkloadKey,
        namespace_known: bool,
    ) -> Result<PodFacts, LookupError> {
        let pods: Api<Lenient<Pod>> = Api::namespaced(client.clone(), &key.namespace);
        let what = format!("pod {key}");
        let pod = get(&pods, &key.name, &what).await?;
        let facts = PodFacts::from_pod(&pod).map_err(|e| LookupError::Malformed {
            what: what.clone(),
            problem: e.to_string(),
        })?;
        if !namespace_known {
            let namespaces: Api<Lenient<Namespace>> = Api::all(client.clone());
            let what = format!("namespace {}", key.namespace);
            let namespace = get(&namespaces, &key.namespace, &what).await?;
            let ns =
                NamespaceFacts::from_namespace(&namespace).map_err(|e| LookupError::Malformed {
                    what,
                    problem: e.to_string(),
                })?;
            self.fetched_namespaces.insert(key.namespace.clone(), ns);
        }
        debug!(pod = %key, "read from the API server for its CNI ADD");
        self.fetched.insert(key.clone(), facts.clone());
        Ok(facts)
    }

    /// Records the sandbox of a mesh pod and waits for its capture.
    pub(crate) fn add(
        &mut self,
        key: WorkloadKey,
        request: &Request,
        answer: oneshot::Sender<Reply>,
    ) {
        let netns = PathBuf::from(&request.netns);
        let ips = request
            .ips
            .iter()
            .filter_map(|ip| {
                let address = ip.address.split('/').next().unwrap_or_default();
                address.parse().ok()
            })
            .collect();
        info!(pod = %key, netns = %netns.display(), sandbox = %request.container_id, "CNI ADD: capturing before the sandbox starts");
        self.by_pod.insert(
            key.clone(),
            Sandbox {
                container_id: request.container_id.clone(),
                netns: netns.clone(),
                ips,
            },
        );
        self.waiting.push(Waiter { key, netns, answer });
    }

    /// Forgets the sandbox `container_id` of `key` (DEL; idempotent).
    /// Returns whether anything changed.
    pub(crate) fn remove(&mut self, key: &WorkloadKey, container_id: &str) -> bool {
        let ours = self
            .by_pod
            .get(key)
            .is_some_and(|s| s.container_id == container_id);
        if ours {
            info!(pod = %key, sandbox = container_id, "CNI DEL: the sandbox is gone");
            self.by_pod.remove(key);
            self.fetched.remove(key);
        }
        ours
    }

    /// Drops fetched facts the watch has caught up with.
    pub(crate) fn forget_fetched(
        &mut self,
        listed: impl Fn(&WorkloadKey) -> bool,
        namespace_listed: impl Fn(&str) -> bool,
    ) {
        self.fetched.retain(|key, _| !listed(key));
        self.fetched_namespaces
            .retain(|name, _| !namespace_listed(name));
    }

    /// Answers every waiter the snapshot decides.
    pub(crate) fn answer(&mut self, snapshot: &NodeSnapshot) {
        for waiter in std::mem::take(&mut self.waiting) {
            if waiter.answer.is_closed() {
                continue;
            }
            match verdict(snapshot, &waiter.key, &waiter.netns) {
                Some(reply) => {
                    let _ = waiter.answer.send(reply);
                }
                None => self.waiting.push(waiter),
            }
        }
    }
}

impl KubeSource {
    /// One request of the CNI plugin: the pod judged as the watch would
    /// judge it; a mesh pod's sandbox listed at once (its answer comes with
    /// the snapshot that shows it captured); DEL forgets the sandbox.
    pub(super) async fn on_cni(
        &self,
        call: CniCall,
        sink: &dyn SourceSink,
        watch: &View,
        state: &mut SyncState,
        snapshot: &NodeSnapshot,
    ) {
        let request = &call.request;
        let key = WorkloadKey::new(&request.pod_namespace, &request.pod_name);
        match request.command {
            Command::Del => {
                let _ = call.answer.send(Reply::Released);
                if state.sandboxes.remove(&key, &request.container_id) {
                    self.sync(sink, watch, state).await;
                }
            }
            Command::Check => {
                let _ = call.answer.send(check(snapshot, &key));
            }
            Command::Add => {
                let known = watch
                    .pods
                    .get(&key.to_string())
                    .or_else(|| state.sandboxes.fetched.get(&key))
                    .cloned();
                let facts = match known {
                    Some(facts) => facts,
                    None => {
                        let namespace_known = watch.namespaces.get(&key.namespace).is_some();
                        match state
                            .sandboxes
                            .fetch(&self.client, &key, namespace_known)
                            .await
                        {
                            Ok(facts) => facts,
                            Err(error) => {
                                warn!(pod = %key, %error, "CNI ADD: cannot judge the pod");
                                let _ = call.answer.send(Reply::Failed(error.to_string()));
                                return;
                            }
                        }
                    }
                };
                let namespace = watch
                    .namespaces
                    .get(&key.namespace)
                    .or_else(|| state.sandboxes.fetched_namespace(&key.namespace));
                if !facts
                    .to_workload(namespace, &self.options.enablement)
                    .wants_mesh()
                    || facts.node != self.options.node
                {
                    debug!(pod = %key, "CNI ADD: not a mesh pod of this node; untouched");
                    let _ = call.answer.send(Reply::NotInMesh);
                    return;
                }
                state.sandboxes.add(key, request, call.answer);
                self.sync(sink, watch, state).await;
            }
        }
    }
}

/// What the snapshot says of the pod in `netns`; `None` while undecided.
fn verdict(snapshot: &NodeSnapshot, key: &WorkloadKey, netns: &std::path::Path) -> Option<Reply> {
    let pod = snapshot.pod(key)?;
    if pod.workload.netns.as_deref() != Some(netns) {
        // A state from before the list that carries this sandbox (an
        // earlier sandbox's, or the pod before it opted in): not a verdict
        // on this one.
        return None;
    }
    match &pod.state {
        PodState::Enrolled => Some(Reply::Captured),
        PodState::NotInMesh => Some(Reply::NotInMesh),
        PodState::Error(reason) => Some(Reply::Failed(reason.clone())),
        PodState::Pending(_) => None,
    }
}

/// CHECK: what the last snapshot says, without waiting.
pub(crate) fn check(snapshot: &NodeSnapshot, key: &WorkloadKey) -> Reply {
    match snapshot.pod(key).map(|p| &p.state) {
        None | Some(PodState::NotInMesh) => Reply::NotInMesh,
        Some(PodState::Enrolled) => Reply::Captured,
        Some(PodState::Pending(reason) | PodState::Error(reason)) => {
            Reply::Failed(format!("pod {key} is not captured: {reason}"))
        }
    }
}

async fn get<K>(api: &Api<Lenient<K>>, name: &str, what: &str) -> Result<K, LookupError>
where
    K: kube::Resource<DynamicType = ()> + serde::de::DeserializeOwned + Clone + std::fmt::Debug,
{
    match api.get_opt(name).await {
        Ok(Some(object)) => object
            .parsed()
            .cloned()
            .map_err(|e| LookupError::Malformed {
                what: what.to_owned(),
                problem: e.to_string(),
            }),
        Ok(None) => Err(LookupError::Missing {
            what: what.to_owned(),
        }),
        Err(source) => Err(LookupError::Api {
            what: what.to_owned(),
            source: Box::new(source),
        }),
    }
}

#[cfg(test)]
mod tests {
    use std::{path::Path, sync::Arc};

    use super::*;
    use crate::{
        redirect::RedirectMode,
        snapshot::PodSnapshot,
        state::{TrustDomain, Workload},
    };

    fn snapshot(netns: Option<&str>, state: PodState) -> NodeSnapshot {
        let mut snapshot =
            NodeSnapshot::empty("node-a", RedirectMode::Ebpf, TrustDomain::default());
        let workload = Workload {
            name: "web".into(),
            namespace: "shop".into(),
            netns: netns.map(PathBuf::from),
            ..Default::default()
        };
        snapshot.pods = Arc::from(vec![PodSnapshot {
            workload,
            state,
            kernel: None,
            kernel_denials: Vec::new(),
        }]);
        snapshot
    }

    #[test]
    fn only_a_state_of_this_sandboxs_netns_answers() {
        let key = WorkloadKey::new("shop", "web");
        let netns = Path::new("/run/netns/cni-1");
        // The pod as it was before the list with this sandbox (not yet in
        // the mesh, no netns): no verdict, or its ADD would pass uncaptured.
        assert_eq!(
            verdict(&snapshot(None, PodState::NotInMesh), &key, netns),
            None
        );
        let earlier = snapshot(Some("/run/netns/cni-0"), PodState::Enrolled);
        assert_eq!(verdict(&earlier, &key, netns), None, "an earlier sandbox");
        let ours = |state| verdict(&snapshot(Some("/run/netns/cni-1"), state), &key, netns);
        assert_eq!(ours(PodState::Enrolled), Some(Reply::Captured));
        assert_eq!(ours(PodState::NotInMesh), Some(Reply::NotInMesh));
        assert_eq!(ours(PodState::Pending("waiting for ztunnel".into())), None);
        assert_eq!(
            ours(PodState::Error("no listener".into())),
            Some(Reply::Failed("no listener".into()))
        );
    }
}

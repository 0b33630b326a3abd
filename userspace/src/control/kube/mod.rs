//! The Kubernetes pod source: watches the API server and pushes this
//! node's pods through the [`SourceSink`].
//!
//! ```text
//! watch pods (fieldSelector spec.nodeName=NODE) ─┐
//! watch namespaces (for their label) ────────────┼─> caches ─(debounce)─> NodePods ─> SourceSink::node_pods
//! resync timer (retries netns, annotations) ─────┘   of facts
//! reconciler's NodeSnapshot (watch channel) ─────────> annotations (merge patch)
//! ```
//!
//! - Two kube-rs watchers (list, then watch from the list's resource version;
//!   bookmarks on; `410 Gone` and dropped watches relist or resume by
//!   themselves) feed [`cache::ObjectCache`]s of [`pod::PodFacts`] and
//!   [`pod::NamespaceFacts`]. Watch errors are logged and retried with
//!   kube-rs' default backoff (0.8 s doubling up to 30 s).
//! - Nothing is reconciled until both watches have listed once: a fresh agent
//!   (e.g. restarted mid-stream) must not unenrol pods it simply has not
//!   heard of yet, nor judge a pod before its namespace's label is known.
//! - Each change arms a debounce timer (default 100 ms, not extended by later
//!   events, so the delay is bounded); when it fires, one full list of this
//!   node's pods is pushed ([`SourceSink::node_pods`]); the reconciler's
//!   apply is idempotent. A burst of 1000 events thus makes a handful of
//!   reconciles.
//! - A list identical to the previous one is not pushed. The resync timer
//!   (default 10 s) looks for the netns of pods that had none and retries
//!   failed annotation patches; verifying and repairing what is enrolled is
//!   the reconciler's own verify pass.
//! - While the API server is unreachable nothing changes: the caches keep the
//!   last complete view, so every enrolled pod stays enrolled; once it is
//!   back the watchers relist (or resume) and the agent catches up.
//! - After the first complete list, the reconciler removes pinned state
//!   that a previous agent left for pods no longer listed; pods still
//!   listed are re-adopted in place, so a restart flaps nothing.
//! - A pod's netns is found by a [`NetnsResolver`] (see [`netns`] and
//!   [`cri`]), once per pod UID, when the pod wants the mesh and has an IP.
//! - After each reconcile (each [`NodeSnapshot`] the reconciler publishes),
//!   pods whose `ambient.istio.io/redirection` annotation disagrees with
//!   their state are patched (see [`annotate`]). The states come from the
//!   snapshot: the source never reaches into the reconciler.
//!
//! Objects the agent cannot parse are logged with their name and skipped;
//! they never stop the watch (see [`lenient`]).
//!
//! Cluster-wide workload discovery (every pod's IPs and identity, for the
//! proxy) is [`ClusterWorkloads`]: a third watcher, on all pods, plus
//! watchers of Services and EndpointSlices ([`service`]) and of Istio's
//! `AuthorizationPolicy` objects ([`policy`]) and of waypoint `Gateway`s
//! ([`gateway`]; each service's and pod's waypoint from Istio's labels,
//! [`waypoints`]), that pushes the cluster-wide view
//! ([`SourceSink::cluster`]).

pub mod annotate;
mod cache;
mod cluster;
pub mod cri;
pub mod enablement;
pub mod exit;
pub mod gateway;
pub mod lenient;
pub mod netns;
mod node_selection;
mod optional_crd;
pub mod pod;
pub mod policy;
mod sandboxes;
pub mod service;
mod waypoints;

use std::{
    collections::{BTreeMap, HashMap},
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::Duration,
};

use tokio::sync::{mpsc, watch};

use ::kube::{
    Api, Client, Config,
    runtime::{WatchStreamExt as _, watcher},
};
use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::core::v1::{Namespace, Pod};
use tokio::time::{Instant, MissedTickBehavior};
use tracing::{Instrument as _, debug, error, info, info_span, warn};

pub use cluster::ClusterWorkloads;
pub use cri::{ChainResolver, CriOptions, CriResolver};
pub use enablement::Enablement;
pub use lenient::Lenient;
pub use netns::{MapResolver, NetnsResolver, PodRef, ProcScanResolver};

use super::{NodePods, SourceSink, cni::CniCall};
use crate::{
    snapshot::NodeSnapshot,
    state::{PodState, TrustDomain, Workload, WorkloadKey},
};
use cache::ObjectCache;
use pod::{NamespaceFacts, PodFacts};
use sandboxes::Sandboxes;

/// Why the Kubernetes source cannot start.
#[derive(Debug, thiserror::Error)]
pub enum KubeSourceError {
    #[error(
        "no Kubernetes API configuration: not running in a pod with a service account, and no usable KUBECONFIG or ~/.kube/config ({0})"
    )]
    Config(#[from] ::kube::config::InferConfigError),
    #[error("cannot create the Kubernetes client: {0}")]
    Client(#[source] ::kube::Error),
}

/// A client for the cluster the agent runs in: the in-cluster service
/// account, else `KUBECONFIG` (or `~/.kube/config`).
pub async fn client() -> Result<Client, KubeSourceError> {
    let config = Config::infer().await?;
    Client::try_from(config).map_err(KubeSourceError::Client)
}

/// How the source behaves; [`KubeOptions::new`] gives the defaults.
#[derive(Clone, Debug)]
pub struct KubeOptions {
    /// This node's name: only pods scheduled here are watched.
    pub node: String,
    pub trust_domain: TrustDomain,
    /// How long after a change the snapshot is taken (changes meanwhile are
    /// included).
    pub debounce: Duration,
    /// How often pods without a known netns are looked up again and failed
    /// annotation patches retried.
    pub resync: Duration,
    /// Whether to maintain the `ambient.istio.io/redirection` annotation.
    pub annotate: bool,
    /// How many annotation patches may be in flight at once.
    pub patch_concurrency: usize,
    /// Which pods join the mesh (`--enablement-selectors`,
    /// `--exclude-namespaces`).
    pub enablement: Arc<Enablement>,
}

/// Name of this source in readiness and logs.
pub const SOURCE: &str = "kubernetes";

impl KubeOptions {
    pub fn new(node: impl Into<String>) -> Self {
        Self {
            node: node.into(),
            trust_domain: TrustDomain::default(),
            debounce: Duration::from_millis(100),
            resync: Duration::from_secs(10),
            annotate: true,
            patch_concurrency: 16,
            enablement: Arc::default(),
        }
    }
}

/// Counters of what the source did (for tests, benchmarks and logs).
#[derive(Debug, Default)]
pub struct SourceStats {
    /// Lists of this node's pods pushed to the reconciler.
    pub reconciles: AtomicU64,
    /// Annotation patches that succeeded.
    pub patches: AtomicU64,
    /// Annotation patches that failed (retried at the next sync).
    pub patch_failures: AtomicU64,
    /// Watch errors (each retried after a backoff).
    pub watch_errors: AtomicU64,
}

/// The Kubernetes pod source of one node agent. See the module docs.
pub struct KubeSource {
    client: Client,
    options: KubeOptions,
    resolver: Arc<dyn NetnsResolver>,
    stats: Arc<SourceStats>,
    /// Requests of the CNI plugin (`--cni-socket`), when it is served.
    cni: Option<mpsc::Receiver<CniCall>>,
}

impl KubeSource {
    pub fn new(client: Client, options: KubeOptions, resolver: Arc<dyn NetnsResolver>) -> Self {
        Self {
            client,
            options,
            resolver,
            stats: Arc::default(),
            cni: None,
        }
    }

    /// Takes the CNI plugin's requests (see `control::cni`): sandboxes
    /// announced at ADD are listed with their netns at once and answered
    /// once captured.
    pub fn with_cni(mut self, calls: mpsc::Receiver<CniCall>) -> Self {
        self.cni = Some(calls);
        self
    }

    pub fn stats(&self) -> Arc<SourceStats> {
        self.stats.clone()
    }

    /// Watches and pushes until the future is dropped (the agent's
    /// shutdown); annotates pods after each snapshot the reconciler
    /// publishes on `snapshots`. Errors are logged and retried, never
    /// returned: a node agent must outlive API server trouble.
    pub async fn run(
        mut self,
        sink: Arc<dyn SourceSink>,
        mut snapshots: watch::Receiver<Arc<NodeSnapshot>>,
    ) {
        let pods_api: Api<Lenient<Pod>> = Api::all(self.client.clone());
        let mut watch = Watches::new(
            &self.client,
            Some(format!("spec.nodeName={}", self.options.node)),
            self.stats.clone(),
        );
        let mut state = SyncState {
            netns: Arc::new(Mutex::new(netns::NetnsCache::default())),
            last: None,
            sent: annotate::Sent::default(),
            pods_api,
            sandboxes: Sandboxes::default(),
        };
        let mut cni = self.cni.take();
        let mut reconciler_running = true;
        let mut resync = tokio::time::interval(self.options.resync);
        resync.set_missed_tick_behavior(MissedTickBehavior::Delay);
        resync.tick().await; // the first tick is immediate: nothing is listed yet
        let mut deadline: Option<Instant> = None;
        info!(node = %self.options.node, "watching the Kubernetes API for this node's pods");
        loop {
            let armed = deadline;
            tokio::select! {
                step = watch.step() => match step {
                    Step::Changed => {
                        deadline.get_or_insert_with(|| Instant::now() + self.options.debounce);
                    }
                    Step::Unchanged => {}
                    Step::Ended => return,
                },
                _ = sleep_until(armed), if armed.is_some() => {
                    deadline = None;
                    self.sync(sink.as_ref(), &watch.view, &mut state).await;
                }
                _ = resync.tick() => {
                    self.sync(sink.as_ref(), &watch.view, &mut state).await;
                    let states = snapshots.borrow().pod_states();
                    self.annotate(&watch.view, &mut state, &states).await;
                }
                changed = snapshots.changed(), if reconciler_running => {
                    if changed.is_err() {
                        reconciler_running = false;
                        continue;
                    }
                    let snapshot = snapshots.borrow_and_update().clone();
                    state.sandboxes.answer(&snapshot);
                    self.annotate(&watch.view, &mut state, &snapshot.pod_states()).await;
                }
                call = next_call(&mut cni) => match call {
                    Some(call) => {
                        let snapshot = snapshots.borrow().clone();
                        self.on_cni(call, sink.as_ref(), &watch.view, &mut state, &snapshot).await;
                        let snapshot = snapshots.borrow().clone();
                        state.sandboxes.answer(&snapshot);
                    }
                    None => cni = None,
                },
            }
        }
    }

    /// Takes this node's pods from the caches and pushes them, unless they
    /// are what was pushed last.
    async fn sync(&self, sink: &dyn SourceSink, watch: &View, state: &mut SyncState) {
        if !watch.listed() {
            debug!("not every watch has listed yet; nothing to reconcile");
            return;
        }
        state.sandboxes.forget_fetched(
            |key| watch.pods.get(&key.to_string()).is_some(),
            |name| watch.namespaces.get(name).is_some(),
        );
        let sandboxes = &state.sandboxes;
        // Pods the watch lists, then those read for a CNI ADD that it does
        // not list yet.
        let fetched = sandboxes
            .fetched
            .values()
            .filter(|f| watch.pods.get(&f.key.to_string()).is_none());
        let mut workloads = Vec::with_capacity(watch.pods.len());
        let mut wanted: Vec<(WorkloadKey, String)> = Vec::new();
        for facts in watch.pods.values().chain(fetched) {
            // The field selector already keeps other nodes' pods out.
            if facts.node != self.options.node {
                continue;
            }
            let namespace = watch
                .namespaces
                .get(&facts.key.namespace)
                .or_else(|| sandboxes.fetched_namespace(&facts.key.namespace));
            let mut workload = facts.to_workload(namespace, &self.options.enablement);
            let sandbox = sandboxes.by_pod.get(&facts.key);
            if let Some(sandbox) = sandbox
                && workload.ips.is_empty()
            {
                // Before the kubelet reports them, the chain's own result.
                workload.ips = sandbox.ips.clone();
            }
            match sandbox {
                // The sandbox the runtime is creating: no discovery.
                Some(sandbox) => workload.netns = Some(sandbox.netns.clone()),
                None if workload.wants_mesh() && !facts.ips.is_empty() => {
                    wanted.push((facts.key.clone(), facts.uid.clone()));
                }
                None => {}
            }
            workloads.push((facts.uid.clone(), workload));
        }
        let found = self.find_netns(&state.netns, wanted).await;
        let workloads: Vec<Workload> = workloads
            .into_iter()
            .map(|(uid, mut workload)| {
                if workload.netns.is_none() {
                    workload.netns = found.get(&uid).cloned();
                }
                workload
            })
            .collect();
        if state.last.as_ref() == Some(&workloads) {
            return;
        }
        let first = state.last.is_none();
        state.last = Some(workloads.clone());
        self.stats.reconciles.fetch_add(1, Ordering::Relaxed);
        debug!(pods = workloads.len(), "pushing this node's pods");
        sink.node_pods(NodePods {
            trust_domain: self.options.trust_domain.clone(),
            pods: workloads,
        });
        if first {
            sink.synced(SOURCE);
        }
    }

    async fn find_netns(
        &self,
        cache: &Arc<Mutex<netns::NetnsCache>>,
        wanted: Vec<(WorkloadKey, String)>,
    ) -> HashMap<String, std::path::PathBuf> {
        let cache = cache.clone();
        let resolver = self.resolver.clone();
        let found = tokio::task::spawn_blocking(move || {
            let refs: Vec<PodRef<'_>> = wanted
                .iter()
                .map(|(key, uid)| PodRef { key, uid })
                .collect();
            cache
                .lock()
                .unwrap_or_else(|poisoned| poisoned.into_inner())
                .lookup(resolver.as_ref(), &refs)
        })
        .await;
        found.unwrap_or_else(|error| {
            error!(%error, "netns discovery panicked");
            HashMap::new()
        })
    }

    async fn annotate(
        &self,
        watch: &View,
        state: &mut SyncState,
        states: &BTreeMap<WorkloadKey, PodState>,
    ) {
        let mut todo = Vec::new();
        for facts in watch.pods.values() {
            // A terminating pod is about to go: leave its object alone.
            if facts.terminating {
                continue;
            }
            let Some(pod_state) = states.get(&facts.key) else {
                continue;
            };
            let value = annotate::desired(pod_state);
            if state.sent.needed(
                &facts.key,
                facts.redirection.as_deref(),
                value,
                &facts.resource_version,
            ) {
                todo.push((facts.key.clone(), value, facts.resource_version.clone()));
            }
        }
        state.sent.retain(|key| states.contains_key(key));
        if todo.is_empty() {
            return;
        }
        // Owned clones in each future: a future borrowing from this
        // function's frame would not be `Send` for every lifetime, which
        // `tokio::spawn` of the source needs.
        let api = state.pods_api.clone();
        let patches: Vec<_> = todo
            .into_iter()
            .map(
                |(key, value, resource_version): (WorkloadKey, Option<&'static str>, String)| {
                    let span = info_span!("pod", pod = %key);
                    let api = api.clone();
                    async move {
                        let result = annotate::patch(&api, &key, value).await;
                        match &result {
                            Ok(()) => info!(
                                annotation = pod::REDIRECTION_ANNOTATION,
                                value = value.unwrap_or("<removed>"),
                                "pod annotated"
                            ),
                            // The pod went away meanwhile: nothing to annotate.
                            Err(::kube::Error::Api(e)) if e.code == 404 => {
                                debug!("pod gone before it could be annotated")
                            }
                            Err(error) => warn!(%error, "cannot annotate the pod; will retry"),
                        }
                        (key, value, resource_version, result.is_ok())
                    }
                    .instrument(span)
                },
            )
            .collect();
        let results: Vec<_> = futures::stream::iter(patches)
            .buffer_unordered(self.options.patch_concurrency.max(1))
            .collect()
            .await;
        for (key, value, resource_version, ok) in results {
            if ok {
                self.stats.patches.fetch_add(1, Ordering::Relaxed);
                state.sent.record(key, value, resource_version);
            } else {
                self.stats.patch_failures.fetch_add(1, Ordering::Relaxed);
            }
        }
    }
}

/// What the source's loop owns between syncs, besides the watches.
struct SyncState {
    netns: Arc<Mutex<netns::NetnsCache>>,
    /// The last list pushed.
    last: Option<Vec<Workload>>,
    sent: annotate::Sent,
    pods_api: Api<Lenient<Pod>>,
    /// What the CNI plugin announced (`control::cni`).
    sandboxes: Sandboxes,
}

/// A pod watch (optionally narrowed by a field selector) and a namespace
/// watch, each feeding its cache of facts.
pub(crate) struct Watches {
    pod_events: BoxStream<'static, Result<watcher::Event<Lenient<Pod>>, watcher::Error>>,
    namespace_events:
        BoxStream<'static, Result<watcher::Event<Lenient<Namespace>>, watcher::Error>>,
    /// Kept apart from the streams (which are not `Sync`) so that syncing
    /// can borrow it across awaits.
    pub(crate) view: View,
    stats: Arc<SourceStats>,
}

/// What the watches have seen so far.
pub(crate) struct View {
    pub(crate) pods: ObjectCache<PodFacts>,
    pub(crate) namespaces: ObjectCache<NamespaceFacts>,
}

impl View {
    /// Whether both watches have listed once (before that, what is missing
    /// may simply not have been heard of yet).
    pub(crate) fn listed(&self) -> bool {
        self.pods.listed() && self.namespaces.listed()
    }
}

/// The outcome of one watch event.
pub(crate) enum Step {
    /// The complete view changed.
    Changed,
    Unchanged,
    /// A watch stream ended (kube-rs' never do).
    Ended,
}

impl Watches {
    pub(crate) fn new(
        client: &Client,
        pod_fields: Option<String>,
        stats: Arc<SourceStats>,
    ) -> Self {
        let mut pod_config = watcher::Config::default();
        if let Some(fields) = &pod_fields {
            pod_config = pod_config.fields(fields);
        }
        Self {
            pod_events: watcher(Api::all(client.clone()), pod_config)
                .default_backoff()
                .boxed(),
            namespace_events: watcher(Api::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .boxed(),
            view: View {
                pods: ObjectCache::new("pod"),
                namespaces: ObjectCache::new("namespace"),
            },
            stats,
        }
    }

    /// Waits for the next event of either watch and applies it.
    /// Cancel-safe: an event is applied as soon as it is received.
    pub(crate) async fn step(&mut self) -> Step {
        tokio::select! {
            event = self.pod_events.next() => {
                apply_event("pods", event, &mut self.view.pods, PodFacts::from_pod, &self.stats)
            }
            event = self.namespace_events.next() => {
                apply_event("namespaces", event, &mut self.view.namespaces, NamespaceFacts::from_namespace, &self.stats)
            }
        }
    }
}

/// Applies what the watch `what` yielded to its cache (`facts` reduces each
/// object). Errors are logged and counted; kube-rs retries after a backoff.
pub(crate) fn apply_event<K, T, E>(
    what: &'static str,
    event: Option<Result<watcher::Event<Lenient<K>>, watcher::Error>>,
    cache: &mut ObjectCache<T>,
    facts: impl Fn(&K) -> Result<T, E>,
    stats: &SourceStats,
) -> Step
where
    T: Clone + PartialEq,
    E: std::fmt::Display,
{
    match event {
        Some(Ok(event)) => {
            if cache.apply(event, facts) {
                Step::Changed
            } else {
                Step::Unchanged
            }
        }
        Some(Err(error)) => {
            stats.watch_errors.fetch_add(1, Ordering::Relaxed);
            // 410 Gone is routine (the watch fell behind; kube-rs relists), as
            // are dropped connections (it resumes from the last version seen).
            warn!(watch = what, %error, "watch error; retrying after a backoff (the last complete view is kept: nothing is unenrolled or forgotten)");
            Step::Unchanged
        }
        None => {
            error!(watch = what, "the watch ended");
            Step::Ended
        }
    }
}

/// The next request of the CNI plugin, or never without one.
async fn next_call(calls: &mut Option<mpsc::Receiver<CniCall>>) -> Option<CniCall> {
    match calls {
        Some(calls) => calls.recv().await,
        None => std::future::pending().await,
    }
}

async fn sleep_until(deadline: Option<Instant>) {
    match deadline {
        Some(deadline) => tokio::time::sleep_until(deadline).await,
        None => std::future::pending().await,
    }
}

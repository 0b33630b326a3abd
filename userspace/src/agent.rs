//! The reconciler: the one owner of what this node enrols.
//!
//! Data flows one way: a source pushes this node's pods ([`NodePods`]) →
//! [`NodeAgent::apply`] decides, per pod, whether it belongs in the mesh →
//! the proxy starts serving it (listeners in its netns) → the
//! [`Redirector`] enrols it, so that its traffic reaches those listeners.
//! Leaving runs the other way: unenrol first, then the proxy lets go.
//!
//! The [`NodeAgent`] lives on one thread of its own ([`Reconciler::spawn`]):
//! nothing else holds it, so nothing locks it. After every reconcile and
//! every verify pass that thread publishes a [`NodeSnapshot`]; everything
//! that only looks (metrics, readiness, the admin API, the Kubernetes
//! source's annotations) reads that.

use std::{
    collections::BTreeMap,
    path::Path,
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use tokio::sync::{oneshot, watch};
use tracing::{error, info, info_span, warn};

use crate::{
    api::KernelAuthzStatus,
    authz::{
        PolicyKey,
        kernel::{KernelSource, KernelVerdict, VerdictKey, compile},
    },
    control::NodePods,
    inpod::{Answer, Answers, Wanted, ZdsPod, ZtunnelLink},
    proxy::{PodNet, Proxy},
    redirect::{
        Capture, EnrolledPod, MeshLocalTable, MeshLocalWritten, PodTarget, Redirector, Verification,
    },
    snapshot::{NodeSnapshot, PodSnapshot},
    state::{PodState, TrustDomain, Workload, WorkloadKey},
    store::WorkloadStore,
};

/// A pod's pending reason until ztunnel acknowledged it.
pub const WAITING_FOR_ZTUNNEL: &str = "waiting for ztunnel";

/// The proxy, as the reconciler drives it: reconcile runs on a thread of
/// its own, so proxy calls are run to completion on the runtime's handle.
#[derive(Clone)]
pub struct ProxyHandle {
    pub proxy: Proxy,
    pub runtime: tokio::runtime::Handle,
}

/// One pod of this node, with what became of it.
struct PodEntry {
    workload: Workload,
    state: PodState,
    /// Hooks and counters as last read (after its enrolment, or by the
    /// verify pass).
    kernel: Option<EnrolledPod>,
    /// Its connects the kernel's authorization point refused, per policy
    /// (read by the verify pass).
    kernel_denials: Vec<(PolicyKey, u64)>,
}

/// What the reconciler knows and owns for its node.
pub struct NodeAgent {
    node: String,
    trust_domain: TrustDomain,
    redirector: Box<dyn Redirector>,
    /// `None` when pods are only counted (`--capture off`) or an external
    /// proxy serves them.
    proxy: Option<ProxyHandle>,
    /// With `--proxy ztunnel`: which pods ztunnel should serve (this
    /// reconciler publishes them) and its answers (which gate enrolment).
    ztunnel: Option<ZtunnelLink>,
    /// What each enrolled pod sends to the proxy.
    capture: Capture,
    /// DNS capture: `None` when no DNS proxy serves the pods (never
    /// captured), else the node's default (`--dns-capture`), which a pod's
    /// own say overrides.
    dns_capture: Option<bool>,
    /// Every pod of this node, with what happened to it.
    pods: BTreeMap<WorkloadKey, PodEntry>,
    /// Whether a source has handed over a complete list (readiness).
    synced: bool,
    /// Whether a previous agent's leftovers were removed (once, after the
    /// first complete list).
    stale_removed: bool,
    verify_passes: u64,
    /// Enrolment latency and repairs are recorded here.
    metrics: crate::metrics::Metrics,
    /// The kernel's authorization point: the store its verdicts are
    /// compiled from (`None`: off, or this mode has none).
    kernel_authz: Option<Arc<RwLock<WorkloadStore>>>,
    /// What the last compile left in the kernel.
    kernel_authz_status: Option<KernelAuthzStatus>,
    /// The verdicts last written whole (flow 2 of the fast path is turned
    /// off before a different table is written).
    last_verdicts: Option<BTreeMap<VerdictKey, KernelVerdict>>,
    /// What the last flow-2 write did (logged when it changes).
    mesh_local_status: Option<MeshLocalWritten>,
}

impl NodeAgent {
    pub fn new(
        node: String,
        trust_domain: TrustDomain,
        redirector: Box<dyn Redirector>,
        capture: Capture,
    ) -> Self {
        Self {
            node,
            trust_domain,
            redirector,
            proxy: None,
            ztunnel: None,
            capture,
            dns_capture: None,
            pods: BTreeMap::new(),
            synced: false,
            stale_removed: false,
            verify_passes: 0,
            metrics: crate::metrics::Metrics::default(),
            kernel_authz: None,
            kernel_authz_status: None,
            last_verdicts: None,
            mesh_local_status: None,
        }
    }

    /// Compiles the authorization policies of `store` into the
    /// redirector's kernel enforcement point (if its mode has one) after
    /// every reconcile and every change the store owner applies.
    pub fn with_kernel_authz(mut self, store: Arc<RwLock<WorkloadStore>>) -> Self {
        self.kernel_authz = Some(store);
        self
    }

    /// Whether the verdicts are recompiled when the store changes.
    pub fn has_kernel_authz(&self) -> bool {
        self.kernel_authz.is_some()
    }

    /// Records enrolment latency and repairs into `metrics`.
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Captures the pods' DNS (a DNS proxy serves them): `default` unless a
    /// pod says otherwise (`ambient.istio.io/dns-capture`, `dnsCapture:`).
    pub fn with_dns_capture(mut self, default: Option<bool>) -> Self {
        self.dns_capture = default;
        self
    }

    /// Whether `workload`'s DNS goes to the DNS proxy in its netns: a DNS
    /// proxy serves the pods, its outbound traffic is captured, and its
    /// own say (or else the node's default) is on.
    fn captures_dns(&self, workload: &Workload) -> bool {
        self.capture.outbound
            && self
                .dns_capture
                .is_some_and(|default| workload.dns_capture.unwrap_or(default))
    }

    /// Hands the pods' traffic to `proxy` from now on.
    pub fn with_proxy(mut self, proxy: ProxyHandle) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Hands the pods to a stock ztunnel over ZDS: a pod is enrolled only
    /// once ztunnel has acknowledged it (its listeners are bound).
    pub fn with_ztunnel(mut self, link: ZtunnelLink) -> Self {
        self.ztunnel = Some(link);
        self
    }

    /// ztunnel's answers, when pods are handed to ztunnel: the reconcile
    /// loop converges again when they change.
    pub fn ztunnel_answers(&self) -> Option<watch::Receiver<Answers>> {
        self.ztunnel.as_ref().map(ZtunnelLink::answers)
    }

    /// Converges the last list again (after ztunnel answered).
    pub fn reconverge(&mut self) {
        if !self.synced {
            return;
        }
        let pods = NodePods {
            trust_domain: self.trust_domain.clone(),
            pods: self.pods.values().map(|e| e.workload.clone()).collect(),
        };
        self.apply(pods);
    }

    /// Brings the kernel in line with `pods` (this node's complete list).
    /// The first time, also removes what a previous agent left pinned for
    /// pods that are not listed.
    pub fn apply(&mut self, pods: NodePods) {
        let before: BTreeMap<WorkloadKey, (Workload, PodState)> = self
            .pods
            .iter()
            .map(|(key, e)| (key.clone(), (e.workload.clone(), e.state.clone())))
            .collect();
        self.converge_all(pods);
        // Read the kernel side of what changed (one netns each); the verify
        // pass reads every pod's.
        let changed: Vec<WorkloadKey> = self
            .pods
            .iter()
            .filter(|(key, e)| {
                e.kernel.is_none()
                    || before
                        .get(*key)
                        .is_none_or(|(w, s)| *w != e.workload || *s != e.state)
            })
            .map(|(key, _)| key.clone())
            .collect();
        for key in changed {
            let kernel = self.redirector.inspect(&key);
            if let Some(entry) = self.pods.get_mut(&key) {
                entry.kernel = kernel;
            }
        }
        let waiting_for_ztunnel = self
            .pods
            .values()
            .any(|e| e.state == PodState::Pending(WAITING_FOR_ZTUNNEL.into()));
        // A pod a previous agent left enrolled is adopted only when it is
        // enrolled again, which with ztunnel waits for its ack: until then
        // its pins are not leftovers.
        if !self.stale_removed && !waiting_for_ztunnel {
            // Every pod the source knows is enrolled now: anything else
            // pinned is a previous agent's leftover.
            self.stale_removed = true;
            let removed = self.redirector.remove_stale();
            if removed > 0 {
                info!(removed, "cleaned up pods a previous agent had enrolled");
            }
        }
        // Slots came or went: the kernel's verdicts follow.
        self.compile_verdicts();
    }

    /// The store owner applied a cluster view (policies or workloads may
    /// have changed): compiles the kernel's verdicts again.
    pub fn store_changed(&mut self) {
        self.compile_verdicts();
    }

    /// Compiles the verdicts of connects between this node's enrolled pods
    /// with the one engine and writes them into the kernel (a diff against
    /// what is there). The reconciler is the table's only writer: it alone
    /// knows the slots, and reads the policies and workloads from the
    /// store.
    fn compile_verdicts(&mut self) {
        let Some(store) = &self.kernel_authz else {
            return;
        };
        let enrolled: Vec<(&WorkloadKey, &PodEntry, u32)> = self
            .pods
            .iter()
            .filter(|(_, e)| e.state == PodState::Enrolled)
            .filter_map(|(key, e)| Some((key, e, self.redirector.slot(key)?)))
            .collect();
        // The source speaks with the identity its proxy presents; the
        // destination is judged as the proxy judges it: by the store's
        // workload, and only for addresses the store gives it (any other
        // destination is not a mesh peer to the proxy).
        let identities: Vec<String> = enrolled
            .iter()
            .map(|(_, e, _)| e.workload.identity(&self.trust_domain).to_string())
            .collect();
        let (policies, slotted) = {
            let store = store.read().unwrap_or_else(|p| p.into_inner());
            let slotted: Vec<(u32, Workload)> = enrolled
                .iter()
                .filter_map(|(key, _, slot)| Some((*slot, store.get(key)?.clone())))
                .filter(|(_, w)| w.wants_mesh())
                .collect();
            (store.policies().clone(), slotted)
        };
        let destinations: Vec<Workload> = slotted.iter().map(|(_, w)| w.clone()).collect();
        let sources: Vec<KernelSource<'_>> = enrolled
            .iter()
            .zip(&identities)
            .map(|((_, e, slot), identity)| KernelSource {
                slot: *slot,
                identity,
                ips: &e.workload.ips,
            })
            .collect();
        let destinations: Vec<&Workload> = destinations.iter().collect();
        let table = compile(&policies, &sources, &destinations);
        // Flow 2 of the fast path trusts this table (a missing entry means
        // "allowed"): off before it changes, on again only once it was
        // written whole (`redirect::mesh_local`).
        let verdicts_changed = self.last_verdicts.as_ref() != Some(&table.entries);
        if verdicts_changed {
            self.redirector.write_mesh_local(None);
        }
        let Some(written) = self.redirector.write_verdicts(&table) else {
            info!(
                mode = %self.redirector.mode(),
                "this redirection mode has no kernel enforcement point: the proxy alone enforces authorization"
            );
            self.kernel_authz = None;
            return;
        };
        let status = KernelAuthzStatus {
            policies: table.policies.iter().map(ToString::to_string).collect(),
            entries: written.entries,
            left_to_proxy: table.left_to_proxy + written.failed_pairs,
            error: written.error.clone(),
        };
        if let Some(error) = &written.error {
            warn!(
                %error,
                failed_pairs = written.failed_pairs,
                "the kernel's authorization table could not take every verdict; those pod pairs are left to the proxy, which enforces them"
            );
        }
        if written.inserted + written.deleted > 0
            || self.kernel_authz_status.as_ref() != Some(&status)
        {
            info!(
                entries = written.entries,
                inserted = written.inserted,
                deleted = written.deleted,
                policies = table.policies.len(),
                sources = sources.len(),
                left_to_proxy = status.left_to_proxy,
                "authorization verdicts compiled into the kernel"
            );
        }
        self.kernel_authz_status = Some(status);
        let complete = written.error.is_none();
        self.last_verdicts = complete.then(|| table.entries.clone());
        let mesh_local = complete.then(|| {
            let enrolled: Vec<(u32, &Workload)> =
                slotted.iter().map(|(slot, w)| (*slot, w)).collect();
            let mut mesh_local = MeshLocalTable::derive(&enrolled, &table.inexact);
            // Every enrolled pod was compiled as a source, including those
            // the store does not know yet (never destinations then).
            mesh_local.sources.extend(sources.iter().map(|s| s.slot));
            mesh_local
        });
        if let Some(result) = self.redirector.write_mesh_local(mesh_local.as_ref())
            && self.mesh_local_status.as_ref() != Some(&result)
        {
            match &result.error {
                Some(error) => warn!(
                    %error,
                    "same-node mesh fast path left off: those connections go through the proxy"
                ),
                None if result.on => info!(
                    sources = result.sources,
                    destinations = result.destinations,
                    "same-node mesh fast path on"
                ),
                None => info!(
                    "same-node mesh fast path off (the authorization table is incomplete, or --fast-path off)"
                ),
            }
            self.mesh_local_status = Some(result);
        }
    }

    /// Checks every pod of the last list again: repairs what someone
    /// removed (and counts it), retries pods left pending, then reads every
    /// enrolled pod's hooks and counters.
    pub fn verify(&mut self) {
        let slots_before = self.enrolled_slots();
        if self.synced {
            let pods = NodePods {
                trust_domain: self.trust_domain.clone(),
                pods: self.pods.values().map(|e| e.workload.clone()).collect(),
            };
            self.converge_all(pods);
        }
        let mut listed: BTreeMap<WorkloadKey, EnrolledPod> = self
            .redirector
            .list()
            .into_iter()
            .map(|p| (p.key.clone(), p))
            .collect();
        let mut denials = self.redirector.policy_denials();
        for (key, entry) in self.pods.iter_mut() {
            entry.kernel = listed.remove(key);
            entry.kernel_denials = denials.remove(key).unwrap_or_default();
        }
        // Pods retried above may have been enrolled (new slots), and a
        // table the kernel could not take whole is tried again. Otherwise
        // nothing the table is compiled from changed since `apply` or
        // `store_changed` compiled it: no work per pass.
        let retry = self
            .kernel_authz_status
            .as_ref()
            .is_none_or(|status| status.error.is_some());
        if retry || self.enrolled_slots() != slots_before {
            self.compile_verdicts();
        }
        self.verify_passes += 1;
    }

    /// Every enrolled pod with its slot (what the kernel's verdicts are
    /// keyed by).
    fn enrolled_slots(&self) -> Vec<(WorkloadKey, u32)> {
        self.pods
            .iter()
            .filter(|(_, e)| e.state == PodState::Enrolled)
            .filter_map(|(key, _)| Some((key.clone(), self.redirector.slot(key)?)))
            .collect()
    }

    fn converge_all(&mut self, pods: NodePods) {
        self.trust_domain = pods.trust_domain;
        let for_ztunnel: Option<Wanted> = self.ztunnel.as_ref().map(|_| {
            pods.pods
                .iter()
                .filter(|w| w.captured())
                .filter_map(|w| Some((w.key(), ZdsPod::new(w, w.netns.as_deref()?))))
                .collect()
        });
        let mut next = BTreeMap::new();
        for workload in pods.pods {
            let key = workload.key();
            let _span = info_span!("pod", pod = %key).entered();
            let state = self.converge(&key, &workload);
            let (kernel, kernel_denials) = self
                .pods
                .remove(&key)
                .map(|e| (e.kernel, e.kernel_denials))
                .unwrap_or_default();
            next.insert(
                key,
                PodEntry {
                    workload,
                    state,
                    kernel,
                    kernel_denials,
                },
            );
        }
        // What is left was not listed: the pod left this node.
        let gone: Vec<WorkloadKey> = self.pods.keys().cloned().collect();
        for key in gone {
            let _span = info_span!("pod", pod = %key).entered();
            if self.is_enrolled(&key) {
                match self.redirector.unenrol(&key) {
                    Ok(()) => info!("pod left this node's workload list; unenrolled"),
                    Err(e) => error!(error = %e, "pod left; unenrolling failed"),
                }
            }
            self.stop_serving(&key);
        }
        // After the unenrolments above: ztunnel lets go of a pod only once
        // its traffic no longer reaches it.
        if let (Some(link), Some(wanted)) = (&self.ztunnel, for_ztunnel) {
            link.publish(wanted);
        }
        self.pods = next;
        self.synced = true;
    }

    /// Starts the proxy's listeners for the pod (if a proxy runs and does
    /// not serve it yet). Returns why it could not.
    fn serve(&self, key: &WorkloadKey, workload: &Workload, netns: &Path) -> Option<String> {
        let handle = self.proxy.as_ref()?;
        let dns = self.captures_dns(workload);
        // A pod whose DNS capture changed is served again (new sockets
        // first, then the old ones close).
        if handle.proxy.serves(key) && handle.proxy.serves_dns(key) == dns {
            return None;
        }
        let pod = PodNet {
            key: key.clone(),
            netns: netns.to_path_buf(),
            ips: workload.ips.clone(),
            identity: workload.identity(&self.trust_domain),
            dns,
        };
        match handle.runtime.block_on(handle.proxy.add_pod(pod)) {
            Ok(()) => None,
            Err(e) => {
                // Redirection still goes on: with no listener the pod fails
                // closed rather than talking around the mesh.
                error!(error = %e, "the proxy cannot serve the pod; its traffic fails closed");
                Some(e.to_string())
            }
        }
    }

    fn stop_serving(&self, key: &WorkloadKey) {
        if let Some(handle) = &self.proxy
            && handle.proxy.remove_pod(key)
        {
            info!("proxy no longer serves the pod");
        }
    }

    fn converge(&mut self, key: &WorkloadKey, workload: &Workload) -> PodState {
        // A waypoint pod opts in but is never captured (`Workload::captured`).
        if !workload.captured() {
            if self.is_enrolled(key) {
                match self.redirector.unenrol(key) {
                    Ok(()) => info!("pod opted out of the mesh; unenrolled"),
                    Err(e) => {
                        error!(error = %e, "pod opted out; unenrolling failed");
                        return PodState::Error(e.to_string());
                    }
                }
            }
            self.stop_serving(key);
            return PodState::NotInMesh;
        }
        let Some(netns) = &workload.netns else {
            warn!("pod opts into the mesh but its network namespace is not known yet");
            return PodState::Pending("network namespace not known yet".into());
        };
        let was_enrolled = self.is_enrolled(key);
        if was_enrolled && let Ok(Verification::Missing(_)) = self.redirector.verify(key) {
            // The enrol below repairs it (and logs what was missing).
            self.metrics.repaired();
        }
        if let Some(link) = &self.ztunnel {
            match link.answer(key, &ZdsPod::new(workload, netns)) {
                Some(Answer::Acked) => {}
                Some(Answer::Failed(problem)) => return PodState::Pending(problem),
                // Redirecting now would send the pod's traffic to listeners
                // ztunnel has not bound yet.
                None => return PodState::Pending(WAITING_FOR_ZTUNNEL.into()),
            }
        }
        let started = Instant::now();
        let proxy_problem = self.serve(key, workload, netns);
        let target = PodTarget {
            key: key.clone(),
            netns: netns.clone(),
            ips: workload.ips.clone(),
            capture: Capture {
                splice: workload.splice,
                fast_path: workload.fast_path,
                dns: self.captures_dns(workload),
                ..self.capture.clone()
            },
        };
        match self.redirector.enrol(&target) {
            Ok(()) => match proxy_problem {
                None => {
                    if !was_enrolled {
                        self.metrics.enrolled(started.elapsed());
                    }
                    PodState::Enrolled
                }
                Some(problem) => PodState::Error(format!(
                    "enrolled, but the proxy cannot serve it (traffic fails closed): {problem}"
                )),
            },
            Err(e) => {
                error!(error = %e, "cannot enrol pod; will retry on the next change");
                PodState::Pending(e.to_string())
            }
        }
    }

    fn is_enrolled(&self, key: &WorkloadKey) -> bool {
        self.redirector.is_enrolled(key)
    }

    /// Unenrols every pod (agent shutdown). The proxy keeps serving what is
    /// in flight (the agent's shutdown drains it).
    pub fn unenrol_all(&mut self) {
        for pod in self.redirector.list() {
            let _span = info_span!("pod", pod = %pod.key).entered();
            if let Err(e) = self.redirector.unenrol(&pod.key) {
                error!(error = %e, "unenrolling on shutdown failed");
            }
        }
        for entry in self.pods.values_mut() {
            entry.kernel = None;
            if entry.state == PodState::Enrolled {
                entry.state = PodState::Pending("agent stopped".into());
            }
        }
    }

    /// What the agent knows now, for observers.
    pub fn snapshot(&self) -> NodeSnapshot {
        let pods: Vec<PodSnapshot> = self
            .pods
            .values()
            .map(|e| PodSnapshot {
                workload: e.workload.clone(),
                state: e.state.clone(),
                kernel: e.kernel.clone(),
                kernel_denials: e.kernel_denials.clone(),
            })
            .collect();
        NodeSnapshot {
            synced: self.synced,
            pods: Arc::from(pods),
            verify_passes: self.verify_passes,
            kernel_authz: self.kernel_authz_status.clone(),
            ..NodeSnapshot::empty(
                self.node.clone(),
                self.redirector.mode(),
                self.trust_domain.clone(),
            )
        }
        .with_proxy(self.proxy.as_ref().map(|h| &h.proxy))
    }
}

/// This node's pods as a source pushed them, with how many cluster views
/// had been pushed before: the reconciler lets the workload store catch up
/// with those first, so that a pod enrolled now finds the services and
/// peers its source announced with it.
#[derive(Clone, Debug)]
pub struct PodsUpdate {
    pub pods: NodePods,
    pub after_cluster_views: u64,
}

/// What the reconciler thread listens to.
pub struct ReconcilerInputs {
    /// The latest list of this node's pods (`None` until a source pushed).
    pub pods: watch::Receiver<Option<PodsUpdate>>,
    /// How many cluster views the workload store has applied (absent when
    /// nothing keeps a store: no proxy).
    pub store_applied: Option<watch::Receiver<u64>>,
    /// How often every pod is verified (and repaired), and its hooks and
    /// counters read.
    pub verify_every: Duration,
}

/// The running reconciler: a thread that owns the [`NodeAgent`].
pub struct Reconciler {
    snapshots: watch::Receiver<Arc<NodeSnapshot>>,
    stop: Option<oneshot::Sender<bool>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

/// How long a reconcile waits for the workload store to apply the cluster
/// views pushed before its pods (applying one takes milliseconds).
const STORE_CATCH_UP: Duration = Duration::from_secs(2);

impl Reconciler {
    /// Starts the reconciler thread; it publishes a snapshot at once (empty,
    /// not synced), then after every reconcile and verify pass.
    pub fn spawn(
        agent: NodeAgent,
        inputs: ReconcilerInputs,
        runtime: tokio::runtime::Handle,
    ) -> std::io::Result<Self> {
        let (publish, snapshots) = watch::channel(Arc::new(agent.snapshot()));
        let (stop, stopped) = oneshot::channel();
        let thread = std::thread::Builder::new()
            .name("reconcile".into())
            .spawn(move || reconcile_loop(agent, inputs, publish, stopped, runtime))?;
        Ok(Self {
            snapshots,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// The published snapshots.
    pub fn snapshots(&self) -> watch::Receiver<Arc<NodeSnapshot>> {
        self.snapshots.clone()
    }

    /// Stops the thread once it is done with what it is doing; with
    /// `unenrol`, it unenrols every pod first.
    pub async fn stop(mut self, unenrol: bool) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(unenrol);
        }
        if let Some(thread) = self.thread.take() {
            let joined = tokio::task::spawn_blocking(move || thread.join()).await;
            if !matches!(joined, Ok(Ok(()))) {
                error!("the reconcile thread panicked");
            }
        }
    }
}

impl Drop for Reconciler {
    /// Dropped without [`Reconciler::stop`]: the thread stops after what it
    /// is doing, leaving every pod as it is.
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(false);
        }
    }
}

enum Wake {
    Pods,
    StoreChanged,
    StoreGone,
    ZtunnelAnswered,
    ZtunnelGone,
    SourcesGone,
    Verify,
    Stop(bool),
}

fn reconcile_loop(
    mut agent: NodeAgent,
    mut inputs: ReconcilerInputs,
    publish: watch::Sender<Arc<NodeSnapshot>>,
    mut stop: oneshot::Receiver<bool>,
    runtime: tokio::runtime::Handle,
) {
    let verify_every = inputs.verify_every.max(Duration::from_millis(100));
    let mut next_verify = tokio::time::Instant::now() + verify_every;
    let mut sources_open = true;
    let mut ztunnel_answers = agent.ztunnel_answers();
    // The kernel's verdicts follow every view the store owner applies
    // (a receiver of its own: the catch-up wait below marks views seen).
    let mut store_changes = inputs
        .store_applied
        .clone()
        .filter(|_| agent.has_kernel_authz());
    loop {
        let wake = runtime.block_on(async {
            tokio::select! {
                biased;
                unenrol = &mut stop => Wake::Stop(unenrol.unwrap_or(false)),
                changed = inputs.pods.changed(), if sources_open => match changed {
                    Ok(()) => Wake::Pods,
                    Err(_) => Wake::SourcesGone,
                },
                changed = async {
                    match ztunnel_answers.as_mut() {
                        Some(answers) => answers.changed().await,
                        None => std::future::pending().await,
                    }
                } => match changed {
                    Ok(()) => Wake::ZtunnelAnswered,
                    Err(_) => Wake::ZtunnelGone,
                },
                changed = async {
                    match store_changes.as_mut() {
                        Some(applied) => applied.changed().await,
                        None => std::future::pending().await,
                    }
                } => match changed {
                    Ok(()) => Wake::StoreChanged,
                    Err(_) => Wake::StoreGone,
                },
                _ = tokio::time::sleep_until(next_verify) => Wake::Verify,
            }
        });
        match wake {
            Wake::Pods => {
                let update = inputs.pods.borrow_and_update().clone();
                let Some(update) = update else { continue };
                if let Some(applied) = inputs.store_applied.as_mut() {
                    let wanted = update.after_cluster_views;
                    // (The timer must be made inside the runtime's context.)
                    let caught_up = runtime.block_on(async {
                        let applied = applied.wait_for(|n| *n >= wanted);
                        matches!(
                            tokio::time::timeout(STORE_CATCH_UP, applied).await,
                            Ok(Ok(_))
                        )
                    });
                    if !caught_up {
                        warn!(
                            "the workload store has not applied the cluster view pushed before these pods; reconciling anyway"
                        );
                    }
                }
                agent.apply(update.pods);
            }
            // (`changed` marked the answers seen.)
            Wake::ZtunnelAnswered => agent.reconverge(),
            Wake::StoreChanged => agent.store_changed(),
            Wake::StoreGone => {
                store_changes = None;
                continue;
            }
            Wake::ZtunnelGone => {
                ztunnel_answers = None;
                continue;
            }
            Wake::SourcesGone => {
                sources_open = false;
                continue;
            }
            Wake::Verify => {
                agent.verify();
                next_verify = tokio::time::Instant::now() + verify_every;
            }
            Wake::Stop(unenrol) => {
                if unenrol {
                    info!("unenrolling every pod");
                    agent.unenrol_all();
                    publish.send_replace(Arc::new(agent.snapshot()));
                }
                return;
            }
        }
        publish.send_replace(Arc::new(agent.snapshot()));
    }
}

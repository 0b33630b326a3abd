//! The node agent: one owner for what this node enrols.
//!
//! Data flows one way: the pod source (a workloads file or the Kubernetes
//! watch) yields the workload list → [`NodeAgent::reconcile`] decides, per
//! pod of this node, whether it belongs in the mesh → the proxy starts
//! serving it (listeners in its netns) → the [`Redirector`] enrols it, so
//! that its traffic reaches those listeners. Leaving runs the other way:
//! unenrol first, then the proxy lets go. The admin API only reads
//! [`NodeAgent::status`].

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard, RwLock},
    time::{Duration, Instant, SystemTime},
};

use tokio::signal::unix::{SignalKind, signal};
use tracing::{Instrument as _, error, info, info_span, warn};

use crate::{
    admin::{self, NodeStatus, PodState, PodStatus},
    cli::{AgentArgs, CriSocket, OnExit, OnOff, ProxyKind},
    control::local,
    proxy::{PodNet, Proxy},
    redirect::{
        Capture, PodTarget, RedirectMode, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector, LoadError},
    },
    state::{Service, TrustDomain, Workload, WorkloadKey, WorkloadStore},
};

/// Errors that stop the agent from starting.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("Kubernetes pod source: {0}")]
    Kube(#[from] crate::control::kube::KubeSourceError),
    #[error(transparent)]
    Workloads(#[from] local::WorkloadsFileError),
    #[error("eBPF redirection: {0}")]
    Ebpf(#[from] LoadError),
    #[error("iptables redirection: {0}")]
    Iptables(#[from] crate::redirect::iptables::IptablesError),
    #[error("--cgroup-root {path}: {problem}")]
    CgroupRoot { path: PathBuf, problem: String },
    #[error("admin API on {addr}: {source}")]
    Admin {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("{what} endpoint on {addr}: {source}")]
    Serve {
        what: &'static str,
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
    #[error("identity: {0}")]
    Identity(crate::identity::IdentityError),
    #[error("proxy: {0}")]
    Proxy(crate::proxy::ProxyError),
    #[error("istiod xDS source: {0}")]
    Xds(#[from] crate::xds::XdsError),
    #[error(
        "--xds-address needs this agent's pod IP for its xDS node id: set --instance-ip (env INSTANCE_IP, from the downward API's status.podIP)"
    )]
    XdsNoInstanceIp,
}

/// The proxy, as the agent drives it: reconcile runs on a blocking thread,
/// so proxy calls are run to completion on the runtime's handle.
#[derive(Clone)]
pub struct ProxyHandle {
    pub proxy: Proxy,
    pub runtime: tokio::runtime::Handle,
    /// Every workload the source knows, for the proxy's destination lookups.
    pub workloads: Arc<RwLock<WorkloadStore>>,
    /// The store is fed by cluster-wide discovery (Kubernetes), not by the
    /// node's reconcile, which only sees this node's pods.
    pub cluster_discovery: bool,
}

/// What the agent knows and owns for its node.
pub struct NodeAgent {
    node: String,
    trust_domain: TrustDomain,
    redirector: Box<dyn Redirector>,
    /// `None` when pods are only counted (`--capture off`).
    proxy: Option<ProxyHandle>,
    /// What each enrolled pod sends to the proxy.
    capture: Capture,
    /// Every pod of this node, with what happened to it.
    pods: BTreeMap<WorkloadKey, (Workload, PodState)>,
    /// Whether the pod source has handed over a complete list (readiness).
    synced: bool,
    /// Enrolment latency and repairs are recorded here.
    metrics: crate::metrics::Metrics,
    /// With `--xds-address`: istiod's connection, for readiness and the
    /// admin API.
    xds: Option<crate::xds::XdsStatusHandle>,
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
            capture,
            pods: BTreeMap::new(),
            synced: false,
            metrics: crate::metrics::Metrics::default(),
            xds: None,
        }
    }

    /// The cluster view comes from istiod: readiness waits for it.
    pub fn with_xds(mut self, status: crate::xds::XdsStatusHandle) -> Self {
        self.xds = Some(status);
        self
    }

    /// Records enrolment latency and repairs into `metrics`.
    pub fn with_metrics(mut self, metrics: crate::metrics::Metrics) -> Self {
        self.metrics = metrics;
        self
    }

    /// Hands the pods' traffic to `proxy` from now on.
    pub fn with_proxy(mut self, proxy: ProxyHandle) -> Self {
        self.proxy = Some(proxy);
        self
    }

    /// Brings the kernel in line with `workloads` (all workloads the source
    /// knows; only this node's are acted on).
    pub fn reconcile(&mut self, trust_domain: TrustDomain, workloads: Vec<Workload>) {
        self.trust_domain = trust_domain;
        if let Some(handle) = self.proxy.as_ref().filter(|h| !h.cluster_discovery) {
            let changes = handle
                .workloads
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .replace_all(workloads.iter().cloned());
            if !changes.is_empty() {
                info!(
                    added = changes.added.len(),
                    removed = changes.removed.len(),
                    updated = changes.updated.len(),
                    "workload store updated"
                );
            }
        }
        let mut next = BTreeMap::new();
        let node = self.node.clone();
        for workload in workloads.into_iter().filter(|w| w.node == node) {
            let key = workload.key();
            let _span = info_span!("pod", pod = %key).entered();
            let state = self.converge(&key, &workload);
            next.insert(key, (workload, state));
        }
        let gone: Vec<WorkloadKey> = self
            .pods
            .keys()
            .filter(|key| !next.contains_key(*key))
            .cloned()
            .collect();
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
        self.pods = next;
        self.synced = true;
    }

    /// Makes `services` every service the proxy knows (the workloads file's;
    /// with Kubernetes, cluster discovery feeds the store instead).
    pub fn set_services(&mut self, services: Vec<Service>) {
        if let Some(handle) = self.proxy.as_ref().filter(|h| !h.cluster_discovery) {
            let count = services.len();
            let changed = handle
                .workloads
                .write()
                .unwrap_or_else(|p| p.into_inner())
                .replace_services(services);
            if changed {
                info!(services = count, "services updated");
            }
        }
    }

    /// Starts the proxy's listeners for the pod (if a proxy runs and does
    /// not serve it yet). Returns why it could not.
    fn serve(&self, key: &WorkloadKey, workload: &Workload, netns: &Path) -> Option<String> {
        let handle = self.proxy.as_ref()?;
        if handle.proxy.serves(key) {
            return None;
        }
        let pod = PodNet {
            key: key.clone(),
            netns: netns.to_path_buf(),
            ips: workload.ips.clone(),
            identity: workload.identity(&self.trust_domain),
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
        if !workload.wants_mesh() {
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
        if was_enrolled
            && let Ok(crate::redirect::Verification::Missing(_)) = self.redirector.verify(key)
        {
            // The enrol below repairs it (and logs what was missing).
            self.metrics.repaired();
        }
        let started = Instant::now();
        let proxy_problem = self.serve(key, workload, netns);
        let target = PodTarget {
            key: key.clone(),
            netns: netns.clone(),
            ips: workload.ips.clone(),
            capture: Capture {
                splice: workload.splice,
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

    /// Removes what a previous agent left for pods this one was not given.
    /// Call after the first full reconcile.
    pub fn remove_stale(&mut self) {
        let removed = self.redirector.remove_stale();
        if removed > 0 {
            info!(removed, "cleaned up pods a previous agent had enrolled");
        }
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
        for (_, state) in self.pods.values_mut() {
            if *state == PodState::Enrolled {
                *state = PodState::Pending("agent stopped".into());
            }
        }
    }

    /// What the last reconcile did with each pod of this node. Cheap (no
    /// kernel reads, unlike [`NodeAgent::status`]): the Kubernetes source
    /// reads it after every reconcile to set the pods' status annotation.
    pub fn pod_states(&self) -> BTreeMap<WorkloadKey, PodState> {
        self.pods
            .iter()
            .map(|(key, (_, state))| (key.clone(), state.clone()))
            .collect()
    }

    /// A snapshot for the admin API and `shunt status`.
    pub fn status(&self) -> NodeStatus {
        let mut enrolled: BTreeMap<WorkloadKey, crate::redirect::EnrolledPod> = self
            .redirector
            .list()
            .into_iter()
            .map(|p| (p.key.clone(), p))
            .collect();
        let pods = self
            .pods
            .iter()
            .map(|(key, (workload, state))| {
                let kernel = enrolled.remove(key);
                PodStatus {
                    namespace: workload.namespace.clone(),
                    name: workload.name.clone(),
                    ips: workload.ips.clone(),
                    service_account: workload.service_account.clone(),
                    identity: workload.identity(&self.trust_domain).to_string(),
                    dataplane_mode: workload.dataplane_mode.to_string(),
                    state: state.clone(),
                    netns: workload.netns.clone(),
                    netns_cookie: kernel.as_ref().map(|k| k.netns_cookie),
                    hooks: kernel.as_ref().map(|k| k.hooks.clone()).unwrap_or_default(),
                    counters: kernel.map(|k| k.counters.into()),
                    certificate: self.proxy.as_ref().and_then(|h| {
                        let id = workload.identity(&self.trust_domain);
                        h.proxy.identities().current(&id).as_deref().map(Into::into)
                    }),
                }
            })
            .collect();
        NodeStatus {
            node: self.node.clone(),
            mode: self.redirector.mode().to_string(),
            trust_domain: self.trust_domain.to_string(),
            proxy: self.proxy.as_ref().map(|h| h.proxy.stats()),
            xds: self.xds.as_ref().map(|x| x.summary()),
            pods,
        }
    }
}

/// Read access for the observability endpoints (admin, metrics, readiness).
impl NodeAgent {
    pub fn node(&self) -> &str {
        &self.node
    }

    pub fn trust_domain(&self) -> &TrustDomain {
        &self.trust_domain
    }

    pub fn redirector(&self) -> &dyn Redirector {
        self.redirector.as_ref()
    }

    pub fn proxy(&self) -> Option<&ProxyHandle> {
        self.proxy.as_ref()
    }

    /// istiod's connection, with `--xds-address`.
    pub fn xds(&self) -> Option<&crate::xds::XdsStatusHandle> {
        self.xds.as_ref()
    }

    /// Whether the pod source has handed over a complete list.
    pub fn synced(&self) -> bool {
        self.synced
    }

    /// This node's pods as of the last reconcile, with what became of them.
    pub fn pods(&self) -> impl Iterator<Item = (&Workload, &PodState)> {
        self.pods.values().map(|(w, s)| (w, s))
    }
}

/// Shared handle: the reconcile loop writes, the admin API reads.
pub type SharedAgent = Arc<Mutex<NodeAgent>>;

/// Locks the agent, recovering from a poisoned lock (a panic elsewhere must
/// not take the datapath's owner down with it).
pub fn lock(agent: &SharedAgent) -> MutexGuard<'_, NodeAgent> {
    agent
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `shunt agent`: runs until SIGINT or SIGTERM, then stops as `--on-exit`
/// says.
pub async fn run(args: AgentArgs) -> Result<(), AgentError> {
    let source = match args.workloads.clone() {
        Some(path) => {
            let initial = local::load(&path, &args.node_name)?;
            info!(
                file = %path.display(),
                workloads = initial.workloads.len(),
                services = initial.services.len(),
                node = %args.node_name,
                "workloads file loaded"
            );
            PodSource::File { path, initial }
        }
        // Configured before anything is loaded, so that a missing
        // configuration fails fast.
        None => PodSource::Kube(crate::control::kube::client().await?),
    };
    let trust_domain = match &source {
        PodSource::File { initial, .. } => initial.trust_domain.clone(),
        PodSource::Kube(_) => args.trust_domain.clone(),
    };
    // Checked before anything is set up, like the pod source.
    let xds = xds_source(&args)?;
    check_cgroup_root(args.cgroup_root.as_deref())?;

    let iptables = || -> Result<Box<dyn Redirector>, AgentError> {
        let mut options = crate::redirect::iptables::IptablesOptions::new(args.node_name.clone());
        options.probe_source = args.probe_source;
        let iptables = crate::redirect::iptables::IptablesRedirector::new(options)?;
        info!(mode = "iptables", requested = %args.redirect, backend = %iptables.backend(), "redirection ready: netfilter rules in each pod's netns");
        Ok(Box::new(iptables))
    };
    let redirector: Box<dyn Redirector> = match args.redirect {
        RedirectMode::Iptables => iptables()?,
        RedirectMode::Auto | RedirectMode::Ebpf => {
            let options = EbpfOptions {
                pin_dir: args.bpf_pin_dir.clone(),
                cgroup_root: args.cgroup_root.clone(),
                probe_source: args.probe_source,
                splice: args.splice,
                splice_backlog: args.splice_backlog,
                preserve_source: args.preserve_source == OnOff::On,
            };
            match EbpfRedirector::load(&options) {
                Ok(mut ebpf) => {
                    info!(mode = "ebpf", requested = %args.redirect, pin_dir = %args.bpf_pin_dir.display(), cgroup_root = %ebpf.cgroup_root().display(), "redirection ready: every eBPF hook it needs is available");
                    forward_kernel_logs(&mut ebpf);
                    Box::new(ebpf)
                }
                // Only a kernel that lacks a hook falls back; any other
                // failure (bpffs, pins, cgroup) is reported, not papered over.
                Err(LoadError::Features(missing)) if args.redirect == RedirectMode::Auto => {
                    warn!(reason = %missing, "eBPF redirection is not possible on this kernel; --redirect auto falls back to iptables");
                    iptables()?
                }
                Err(e) => return Err(e.into()),
            }
        }
    };

    let proxy = match (args.capture, args.proxy) {
        (OnOff::On, ProxyKind::Builtin) => {
            Some(start_proxy(&args, &trust_domain, redirector.original_dst_resolver()).await?)
        }
        (OnOff::On, ProxyKind::External) => {
            info!("captured traffic goes to an external proxy's listeners in each pod's netns");
            None
        }
        (OnOff::Off, _) => None,
    };
    let metrics = crate::metrics::Metrics::new();
    let mut node_agent = NodeAgent::new(
        args.node_name.clone(),
        trust_domain,
        redirector,
        args.capture.into(),
    )
    .with_metrics(metrics.clone());
    if let Some(proxy) = &proxy {
        proxy
            .proxy
            .set_observer(metrics.connection_observer(proxy.workloads.clone()));
        node_agent = node_agent.with_proxy(proxy.clone());
    }
    if let Some(source) = xds {
        // The cluster view (every workload, service, policy) from istiod;
        // this node's pods still come from the pod source below.
        node_agent = node_agent.with_xds(source.status());
        let feed = ClusterFeed::spawn(proxy.as_ref().map(|h| h.workloads.clone()));
        tokio::spawn(source.run(feed).instrument(info_span!("xds")));
    }
    let agent: SharedAgent = Arc::new(Mutex::new(node_agent));
    let listener = tokio::net::TcpListener::bind(args.admin_addr)
        .await
        .map_err(|source| AgentError::Admin {
            addr: args.admin_addr,
            source,
        })?;
    let admin_state = admin::AdminState {
        agent: agent.clone(),
        bpf_pin_dir: args.bpf_pin_dir.clone(),
    };
    tokio::spawn(admin::serve(listener, admin_state).instrument(info_span!("admin")));
    info!(addr = %args.admin_addr, "admin API listening");
    serve_observability(&args, &agent, &metrics).await?;

    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;

    let (workloads_path, initial) = match source {
        PodSource::File { path, initial } => (path, initial),
        PodSource::Kube(client) => {
            use crate::control::kube::{KubeOptions, KubeSource};
            let client_for_discovery = client.clone();
            let source = KubeSource::new(
                client,
                KubeOptions::new(args.node_name.clone()),
                Arc::new(netns_resolver(args.cri_socket.as_ref())),
            );
            metrics.watch_kube(source.stats());
            // The proxy must know every pod of the cluster (who a peer IP
            // is, which identity it speaks), not only this node's. With
            // --xds-address istiod tells it instead.
            if let Some(handle) = &proxy
                && args.xds_address.is_none()
            {
                let discovery =
                    crate::control::kube::ClusterWorkloads::new(client_for_discovery.clone());
                let mut snapshots = discovery.subscribe();
                tokio::spawn(discovery.run().instrument(info_span!("discovery")));
                let store = handle.workloads.clone();
                tokio::spawn(async move {
                    while snapshots.changed().await.is_ok() {
                        let snapshot = snapshots.borrow_and_update().clone();
                        let mut store = store.write().unwrap_or_else(|p| p.into_inner());
                        let changes = store.replace_all(snapshot.iter().cloned());
                        if !changes.is_empty() {
                            info!(
                                workloads = snapshot.len(),
                                added = changes.added.len(),
                                removed = changes.removed.len(),
                                "cluster workloads updated"
                            );
                        }
                        if store.replace_services(snapshot.services().iter().cloned()) {
                            info!(
                                services = snapshot.services().len(),
                                "cluster services updated"
                            );
                        }
                    }
                });
            }
            tokio::select! {
                _ = sigterm.recv() => info!("SIGTERM: stopping"),
                _ = sigint.recv() => info!("SIGINT: stopping"),
                _ = source.run(agent.clone()) => error!("the Kubernetes source stopped; stopping"),
            }
            return shutdown(agent, proxy, &args).await;
        }
    };
    let mut seen = file_stamp(&workloads_path);
    let mut current = initial.clone();
    apply(&agent, initial).await;
    // Every pod the source knows is enrolled now: anything else pinned is a
    // previous agent's leftover.
    let agent_for_cleanup = agent.clone();
    let _ = tokio::task::spawn_blocking(move || lock(&agent_for_cleanup).remove_stale()).await;
    let mut tick = tokio::time::interval(Duration::from_secs(args.reload_interval.max(1)));
    tick.tick().await;
    // The verifier re-applies the same workloads: reconcile checks every
    // enrolled pod and repairs (and counts) what someone removed.
    let mut verify = tokio::time::interval(Duration::from_secs(args.verify_interval.max(1)));
    verify.tick().await;
    loop {
        tokio::select! {
            _ = sigterm.recv() => { info!("SIGTERM: stopping"); break; }
            _ = sigint.recv() => { info!("SIGINT: stopping"); break; }
            _ = verify.tick() => apply(&agent, current.clone()).await,
            _ = tick.tick() => {
                let stamp = file_stamp(&workloads_path);
                if stamp == seen {
                    continue;
                }
                seen = stamp;
                match local::load(&workloads_path, &args.node_name) {
                    Ok(workloads) => {
                        info!(file = %workloads_path.display(), "workloads file changed; reconciling");
                        current = workloads.clone();
                        apply(&agent, workloads).await;
                    }
                    // Keep what is enrolled: a bad edit must lose nothing.
                    Err(e) => error!(error = %e, "workloads file changed but is invalid; keeping the previous workloads"),
                }
            }
        }
    }
    shutdown(agent, proxy, &args).await
}

/// Binds `/metrics` (--metrics-addr) and `/healthz/ready`
/// (--readiness-addr) and serves them in the background.
async fn serve_observability(
    args: &AgentArgs,
    agent: &SharedAgent,
    metrics: &crate::metrics::Metrics,
) -> Result<(), AgentError> {
    let bind = |what: &'static str, addr: std::net::SocketAddr| async move {
        tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|source| AgentError::Serve { what, addr, source })
    };
    let listener = bind("metrics", args.metrics_addr).await?;
    let serve = crate::metrics::serve(listener, agent.clone(), metrics.clone());
    tokio::spawn(serve.instrument(info_span!("metrics")));
    let listener = bind("readiness", args.readiness_addr).await?;
    tokio::spawn(crate::health::serve(listener, agent.clone()).instrument(info_span!("readiness")));
    info!(metrics = %args.metrics_addr, readiness = %args.readiness_addr, "metrics and readiness endpoints listening");
    Ok(())
}

/// The identity manager (with its CA) and the proxy on top of it.
async fn start_proxy(
    args: &AgentArgs,
    trust_domain: &TrustDomain,
    original_dst: Arc<dyn crate::redirect::OriginalDst>,
) -> Result<ProxyHandle, AgentError> {
    let istio = crate::identity::istio::IstioCaConfig::new(
        args.ca_address.clone(),
        args.ca_root_cert.clone(),
        args.ca_token_file.clone(),
    );
    let ca = crate::identity::ca_from_args(args.ca, &args.ca_dir, trust_domain, istio)
        .await
        .map_err(AgentError::Identity)?;
    let identities = crate::identity::IdentityManager::new(ca, Default::default());
    let workloads = Arc::new(RwLock::new(WorkloadStore::new()));
    let config = crate::proxy::ProxyConfig {
        trust_domain: trust_domain.clone(),
        inbound_plaintext: args.inbound_plaintext,
        preserve_source: args.preserve_source == OnOff::On,
        ..Default::default()
    };
    let proxy = Proxy::new(config, identities, workloads.clone(), original_dst)
        .map_err(AgentError::Proxy)?;
    info!(ca = ?args.ca, ca_dir = %args.ca_dir.display(), inbound_plaintext = %args.inbound_plaintext, preserve_source = ?args.preserve_source, "proxy ready: pods get listeners on 15001, 15006 and 15008 as they enrol");
    Ok(ProxyHandle {
        proxy,
        runtime: tokio::runtime::Handle::current(),
        workloads,
        cluster_discovery: args.workloads.is_none() || args.xds_address.is_some(),
    })
}

/// `--xds-address`: the istiod source, configured (not connected yet).
fn xds_source(args: &AgentArgs) -> Result<Option<crate::xds::XdsSource>, AgentError> {
    let Some(address) = &args.xds_address else {
        return Ok(None);
    };
    let node = crate::xds::XdsNode {
        ip: args.instance_ip.ok_or(AgentError::XdsNoInstanceIp)?,
        pod_name: args.pod_name.clone(),
        pod_namespace: args.pod_namespace.clone(),
        node_name: args.node_name.clone(),
        cluster_id: args.cluster_id.clone(),
    };
    let config = crate::xds::XdsConfig::new(
        address.clone(),
        args.xds_root_cert.clone(),
        args.xds_token.clone(),
        node,
    );
    let source = crate::xds::XdsSource::new(config)?;
    info!(address = %address, root = %args.xds_root_cert.display(), token = %args.xds_token.display(),
        "the cluster view (workloads, services, policies) comes from istiod over xDS");
    Ok(Some(source))
}

/// A cluster source's views into the proxy's store, on a task of its own so
/// that the source's calls never block (the latest view wins).
struct ClusterFeed {
    views: tokio::sync::watch::Sender<Option<crate::control::ClusterView>>,
}

impl ClusterFeed {
    fn spawn(store: Option<Arc<RwLock<WorkloadStore>>>) -> Arc<Self> {
        let (views, mut latest) =
            tokio::sync::watch::channel::<Option<crate::control::ClusterView>>(None);
        tokio::spawn(
            async move {
                while latest.changed().await.is_ok() {
                    let Some(view) = latest.borrow_and_update().clone() else {
                        continue;
                    };
                    // Without the builtin proxy nobody looks peers up.
                    let Some(store) = &store else { continue };
                    let (workloads, services, policies) = (
                        view.workloads.len(),
                        view.services.len(),
                        view.policies.len(),
                    );
                    let mut store = store.write().unwrap_or_else(|p| p.into_inner());
                    let changes = store.replace_all(view.workloads);
                    let services_changed = store.replace_services(view.services);
                    if !changes.is_empty() || services_changed {
                        info!(
                            workloads,
                            services,
                            policies,
                            added = changes.added.len(),
                            removed = changes.removed.len(),
                            updated = changes.updated.len(),
                            "cluster view updated"
                        );
                    }
                }
            }
            .instrument(info_span!("cluster-view")),
        );
        Arc::new(Self { views })
    }
}

impl crate::control::SourceSink for ClusterFeed {
    fn node_pods(&self, pods: crate::control::NodePods) {
        warn!(
            pods = pods.pods.len(),
            "a cluster-wide source sent node pods; ignored"
        );
    }

    fn cluster(&self, view: crate::control::ClusterView) {
        self.views.send_replace(Some(view));
    }

    fn synced(&self, source: &'static str) {
        info!(source, "cluster view synced");
    }
}

/// Where the agent learns its pods.
enum PodSource {
    /// `--workloads FILE`, loaded and validated.
    File {
        path: PathBuf,
        initial: local::LocalWorkloads,
    },
    /// The Kubernetes API (see `control::kube`).
    Kube(::kube::Client),
}

/// With `--on-exit unenrol`, unenrols every pod (no new connection is
/// captured); with `keep`, leaves redirection to the next agent. Then lets
/// the proxy's connections in flight finish within the grace period, and
/// reports the agent stopped.
async fn shutdown(
    agent: SharedAgent,
    proxy: Option<ProxyHandle>,
    args: &AgentArgs,
) -> Result<(), AgentError> {
    match args.on_exit {
        OnExit::Unenrol => {
            info!("unenrolling every pod");
            let _ = tokio::task::spawn_blocking(move || lock(&agent).unenrol_all()).await;
        }
        OnExit::Keep => info!(
            "leaving every pod enrolled for the next agent (--on-exit keep); pods without a proxy fail closed until it starts"
        ),
    }
    if let Some(handle) = proxy {
        let cut = handle
            .proxy
            .drain(Duration::from_secs(args.drain_seconds))
            .await;
        if cut > 0 {
            warn!(
                connections = cut,
                "connections still open after the drain period were cut"
            );
        }
    }
    info!("agent stopped");
    Ok(())
}

async fn apply(agent: &SharedAgent, workloads: local::LocalWorkloads) {
    let agent = agent.clone();
    let result = tokio::task::spawn_blocking(move || {
        let mut agent = lock(&agent);
        // Services first: a pod enrolled by this reconcile may connect to
        // one at once.
        agent.set_services(workloads.services);
        agent.reconcile(workloads.trust_domain, workloads.workloads)
    })
    .await;
    if let Err(e) = result {
        error!(error = %e, "reconcile panicked");
    }
}

/// (modified time, length) of the file, to notice edits without a watcher.
fn file_stamp(path: &Path) -> Option<(SystemTime, u64)> {
    let meta = std::fs::metadata(path).ok()?;
    Some((meta.modified().ok()?, meta.len()))
}

/// Pods' netns come from the container runtime when one is configured or
/// found, else (and for whatever it cannot place) from /proc (the agent
/// runs with hostPID).
fn netns_resolver(socket: Option<&CriSocket>) -> crate::control::kube::ChainResolver {
    use crate::control::kube::{ChainResolver, CriOptions, CriResolver, ProcScanResolver, cri};
    let socket = match socket {
        Some(CriSocket::None) => {
            info!("--cri-socket none: pods' network namespaces are found through /proc");
            None
        }
        Some(CriSocket::Path(path)) => {
            if !path.exists() {
                warn!(socket = %path.display(), "the --cri-socket does not exist (yet); until the runtime listens there, pods' network namespaces are found through /proc");
            }
            Some(path.clone())
        }
        None => {
            let found = cri::detect_socket();
            if found.is_none() {
                info!(tried = ?cri::DEFAULT_SOCKETS, "no container runtime socket found: pods' network namespaces are found through /proc");
            }
            found
        }
    };
    let cri = socket.and_then(|socket| {
        match CriResolver::new(&socket, tokio::runtime::Handle::current(), CriOptions::default()) {
            Ok(cri) => {
                info!(socket = %socket.display(), "pods' network namespaces are asked of the container runtime (CRI), then /proc");
                Some(cri)
            }
            Err(error) => {
                warn!(%error, "pods' network namespaces are found through /proc");
                None
            }
        }
    });
    ChainResolver::new(cri, ProcScanResolver::default())
}

fn check_cgroup_root(path: Option<&Path>) -> Result<(), AgentError> {
    let Some(path) = path else { return Ok(()) };
    const CGROUP2_SUPER_MAGIC: i64 = 0x63677270;
    let problem = |problem: &str| AgentError::CgroupRoot {
        path: path.to_path_buf(),
        problem: problem.to_string(),
    };
    match nix::sys::statfs::statfs(path) {
        Ok(fs) if fs.filesystem_type().0 == CGROUP2_SUPER_MAGIC => Ok(()),
        Ok(_) => Err(problem("not a directory of a cgroup v2 filesystem")),
        Err(e) => Err(problem(&e.to_string())),
    }
}

/// Forwards aya-log records from the eBPF programs into `tracing` (through
/// the `log` bridge the subscriber installed).
fn forward_kernel_logs(redirector: &mut EbpfRedirector) {
    let logger = match aya_log::EbpfLogger::init(redirector.ebpf_mut()) {
        Ok(logger) => logger,
        Err(e) => {
            warn!(error = %e, "kernel-side logs will not be shown");
            return;
        }
    };
    // SAFETY: the logger owns its ring buffer's fd and keeps it open, with
    // the same value, until it is dropped together with the AsyncFd.
    let registered = unsafe {
        tokio::io::unix::AsyncFd::register_with_interest(logger, tokio::io::Interest::READABLE)
    };
    let mut logger = match registered {
        Ok(fd) => fd,
        Err(e) => {
            warn!(error = %e, "kernel-side logs will not be shown");
            return;
        }
    };
    tokio::spawn(async move {
        loop {
            let Ok(mut guard) = logger.readable_mut().await else {
                return;
            };
            guard.get_inner_mut().flush();
            guard.clear_ready();
        }
    });
}

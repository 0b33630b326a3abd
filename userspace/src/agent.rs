//! The node agent: one owner for what this node enrols.
//!
//! Data flows one way: the pod source (the workloads file today) yields the
//! workload list → [`NodeAgent::reconcile`] decides, per pod of this node,
//! whether it belongs in the mesh → the [`Redirector`] enrols or unenrols it.
//! The admin API only reads [`NodeAgent::status`].

use std::{
    collections::BTreeMap,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, MutexGuard},
    time::{Duration, SystemTime},
};

use tokio::signal::unix::{SignalKind, signal};
use tracing::{Instrument as _, error, info, info_span, warn};

use crate::{
    admin::{self, NodeStatus, PodState, PodStatus},
    cli::AgentArgs,
    control::local,
    redirect::{
        PodTarget, RedirectMode, Redirector,
        ebpf::{EbpfRedirector, LoadError},
    },
    state::{TrustDomain, Workload, WorkloadKey},
};

/// Errors that stop the agent from starting.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error(
        "no pod source: the Kubernetes watch is not built yet; pass --workloads FILE (see `shunt agent --help`)"
    )]
    NoSource,
    #[error(transparent)]
    Workloads(#[from] local::WorkloadsFileError),
    #[error("eBPF redirection: {0}")]
    Ebpf(#[from] LoadError),
    #[error(
        "the iptables redirection mode is not implemented yet; use --redirect ebpf (or auto) on a kernel with eBPF support"
    )]
    IptablesNotImplemented,
    #[error("--cgroup-root {path}: {problem}")]
    CgroupRoot { path: PathBuf, problem: String },
    #[error("admin API on {addr}: {source}")]
    Admin {
        addr: std::net::SocketAddr,
        source: std::io::Error,
    },
    #[error("cannot install signal handlers: {0}")]
    Signals(std::io::Error),
}

/// What the agent knows and owns for its node.
pub struct NodeAgent {
    node: String,
    trust_domain: TrustDomain,
    redirector: Box<dyn Redirector>,
    /// Every pod of this node, with what happened to it.
    pods: BTreeMap<WorkloadKey, (Workload, PodState)>,
}

impl NodeAgent {
    pub fn new(node: String, trust_domain: TrustDomain, redirector: Box<dyn Redirector>) -> Self {
        Self {
            node,
            trust_domain,
            redirector,
            pods: BTreeMap::new(),
        }
    }

    /// Brings the kernel in line with `workloads` (all workloads the source
    /// knows; only this node's are acted on).
    pub fn reconcile(&mut self, trust_domain: TrustDomain, workloads: Vec<Workload>) {
        self.trust_domain = trust_domain;
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
        }
        self.pods = next;
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
            return PodState::NotInMesh;
        }
        let Some(netns) = &workload.netns else {
            warn!("pod opts into the mesh but its network namespace is not known yet");
            return PodState::Pending("network namespace not known yet".into());
        };
        let target = PodTarget {
            key: key.clone(),
            netns: netns.clone(),
        };
        match self.redirector.enrol(&target) {
            Ok(()) => PodState::Enrolled,
            Err(e) => {
                error!(error = %e, "cannot enrol pod; will retry on the next change");
                PodState::Pending(e.to_string())
            }
        }
    }

    fn is_enrolled(&self, key: &WorkloadKey) -> bool {
        self.redirector.list().iter().any(|p| &p.key == key)
    }

    /// Unenrols every pod (agent shutdown).
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
                }
            })
            .collect();
        NodeStatus {
            node: self.node.clone(),
            mode: self.redirector.mode().to_string(),
            trust_domain: self.trust_domain.to_string(),
            pods,
        }
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

/// `shunt agent`: runs until SIGINT or SIGTERM, then unenrols every pod.
pub async fn run(args: AgentArgs) -> Result<(), AgentError> {
    let workloads_path = args.workloads.clone().ok_or(AgentError::NoSource)?;
    let initial = local::load(&workloads_path, &args.node_name)?;
    info!(
        file = %workloads_path.display(),
        workloads = initial.workloads.len(),
        node = %args.node_name,
        "workloads file loaded"
    );
    check_cgroup_root(args.cgroup_root.as_deref())?;

    let mut redirector = match args.redirect {
        RedirectMode::Auto | RedirectMode::Ebpf => EbpfRedirector::load(&args.bpf_pin_dir)?,
        RedirectMode::Iptables => return Err(AgentError::IptablesNotImplemented),
    };
    info!(mode = "ebpf", requested = %args.redirect, pin_dir = %args.bpf_pin_dir.display(), "redirection ready: every eBPF hook it needs is available");
    forward_kernel_logs(&mut redirector);

    let agent: SharedAgent = Arc::new(Mutex::new(NodeAgent::new(
        args.node_name.clone(),
        initial.trust_domain.clone(),
        Box::new(redirector),
    )));
    let listener = tokio::net::TcpListener::bind(args.admin_addr)
        .await
        .map_err(|source| AgentError::Admin {
            addr: args.admin_addr,
            source,
        })?;
    tokio::spawn(admin::serve(listener, agent.clone()).instrument(info_span!("admin")));
    info!(addr = %args.admin_addr, "admin API listening");

    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;

    let mut seen = file_stamp(&workloads_path);
    apply(&agent, initial).await;
    let mut tick = tokio::time::interval(Duration::from_secs(args.reload_interval.max(1)));
    tick.tick().await;
    loop {
        tokio::select! {
            _ = sigterm.recv() => { info!("SIGTERM: unenrolling every pod"); break; }
            _ = sigint.recv() => { info!("SIGINT: unenrolling every pod"); break; }
            _ = tick.tick() => {
                let stamp = file_stamp(&workloads_path);
                if stamp == seen {
                    continue;
                }
                seen = stamp;
                match local::load(&workloads_path, &args.node_name) {
                    Ok(workloads) => {
                        info!(file = %workloads_path.display(), "workloads file changed; reconciling");
                        apply(&agent, workloads).await;
                    }
                    // Keep what is enrolled: a bad edit must lose nothing.
                    Err(e) => error!(error = %e, "workloads file changed but is invalid; keeping the previous workloads"),
                }
            }
        }
    }
    let agent_for_shutdown = agent.clone();
    let _ = tokio::task::spawn_blocking(move || lock(&agent_for_shutdown).unenrol_all()).await;
    info!("agent stopped");
    Ok(())
}

async fn apply(agent: &SharedAgent, workloads: local::LocalWorkloads) {
    let agent = agent.clone();
    let result = tokio::task::spawn_blocking(move || {
        lock(&agent).reconcile(workloads.trust_domain, workloads.workloads)
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

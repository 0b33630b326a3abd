//! The composition root (as ztunnel's `app.rs`): builds every part of the
//! agent and wires them; nothing else constructs or connects them.
//!
//! ```text
//!  sources (control/)                    AgentSink (SourceSink)
//!  file │ kube pods │ kube cluster ──┬─ node_pods ──> reconcile thread (agent::NodeAgent)
//!                                    │                  │  redirect/ (enrol, verify)
//!                                    │                  │  proxy/ (listeners per pod)
//!                                    │                  └─> NodeSnapshot (watch) ──> metrics, readiness,
//!                                    │                                               admin, annotations
//!                                    └─ cluster ────> store owner ──> WorkloadStore ──> proxy lookups
//! ```

mod cni;
mod exit;
mod kernel;
mod observers;
mod parts;
mod sink;
mod store;

use std::{
    path::PathBuf,
    sync::{Arc, RwLock},
    time::Duration,
};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
};
use tracing::{Instrument as _, error, info, info_span};

use kernel::{check_cgroup_root, redirector};
pub use observers::{ObserverAddrs, Observers};
use parts::{
    dns_capture_default, netns_resolver, open_fast_path, raise_open_files_limit, serve_zds,
    start_dns_names, start_fast_path, start_proxy, xds_source,
};
pub use sink::AgentSink;
pub use store::{Latest, apply as apply_cluster_view, own_store};

use crate::{
    agent::{NodeAgent, ProxyHandle, Reconciler, ReconcilerInputs},
    cli::{AgentArgs, OnOff, ProxyKind},
    control::{SourceSink, file::FileSource, kube},
    proxy::Proxy,
    redirect::{RedirectMode, ebpf::LoadError},
    snapshot::SnapshotReader,
    store::WorkloadStore,
};

/// Errors that stop the agent from starting.
#[derive(Debug, thiserror::Error)]
pub enum AgentError {
    #[error("Kubernetes pod source: {0}")]
    Kube(#[from] kube::KubeSourceError),
    #[error(transparent)]
    Workloads(#[from] crate::control::local::WorkloadsFileError),
    #[error("eBPF redirection: {0}")]
    Ebpf(#[from] LoadError),
    #[error("DNS: {0}")]
    Dns(#[from] crate::dns::DnsError),
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
    #[error("cannot start the reconcile thread: {0}")]
    Thread(std::io::Error),
    #[error("identity: {0}")]
    Identity(crate::identity::IdentityError),
    #[error("istiod xDS source: {0}")]
    Xds(#[from] crate::xds::XdsError),
    #[error(
        "--xds-address needs this agent's pod IP for its xDS node id: set --instance-ip (env INSTANCE_IP, from the downward API's status.podIP)"
    )]
    XdsNoInstanceIp,
    #[error("proxy: {0}")]
    Proxy(crate::proxy::ProxyError),
    #[error("ZDS (--proxy ztunnel): {0}")]
    Zds(#[from] crate::inpod::ZdsError),
    #[error(transparent)]
    Enablement(#[from] kube::enablement::EnablementError),
    #[error("CNI plugin: {0}")]
    Cni(#[from] crate::control::cni::CniSocketError),
    #[error(
        "--cni-socket needs the Kubernetes pod source: a workloads file (--workloads) names each pod's netns itself"
    )]
    CniWithoutKube,
    #[error("--on-exit auto: {0}")]
    OnExit(&'static str),
}

/// Where the agent learns its pods.
enum PodSource {
    /// `--workloads FILE`, loaded and validated.
    File(FileSource),
    /// The Kubernetes API (see `control::kube`).
    Kube(::kube::Client),
}

/// The builtin proxy and the store it looks workloads up in.
struct ProxyParts {
    proxy: Proxy,
    store: Arc<RwLock<WorkloadStore>>,
}

/// `shunt agent`: runs until SIGINT or SIGTERM, then stops as `--on-exit`
/// says. Runs on the control runtime; the builtin proxy serves its pods on
/// the `data_path` shards (see `main.rs`, `shards.rs`).
pub async fn run(args: AgentArgs, data_path: crate::shards::Shards) -> Result<(), AgentError> {
    raise_open_files_limit(&args);
    let source = match &args.workloads {
        Some(path) => PodSource::File(
            FileSource::load(
                path,
                &args.node_name,
                &args.cluster_domain,
                Duration::from_secs(args.reload_interval.max(1)),
            )?
            .with_waypoint_allow(args.auto_allow_waypoint_policy == OnOff::On),
        ),
        // Configured before anything is loaded, so that a missing
        // configuration fails fast.
        None => PodSource::Kube(kube::client().await?),
    };
    if args.cni_socket.is_some() && matches!(source, PodSource::File(_)) {
        return Err(AgentError::CniWithoutKube);
    }
    // Checked before anything is set up: how the agent will exit.
    let exit_plan = exit::ExitPlan::new(&args, &source)?;
    let trust_domain = match &source {
        PodSource::File(file) => file.trust_domain().clone(),
        PodSource::Kube(_) => args.trust_domain.clone(),
    };
    // Checked before anything is set up, like the pod source.
    let enablement = Arc::new(kube::Enablement::new(
        &args.enablement_selectors,
        args.exclude_namespaces.iter().cloned(),
    )?);
    let xds = xds_source(&args)?;
    check_cgroup_root(args.cgroup_root.as_deref())?;
    let redirector = redirector(&args)?;
    // Turned off before any pod is enrolled; on again (by its writer) after
    // the first cluster view, if --fast-path on.
    let fast_path = match redirector.mode() {
        RedirectMode::Ebpf => Some(open_fast_path(&args)?),
        _ => None,
    };

    let proxy = match (args.capture, args.proxy) {
        (OnOff::On, ProxyKind::Builtin) => {
            Some(start_proxy(&args, &trust_domain, redirector.original_dst_resolver()).await?)
        }
        (OnOff::On, ProxyKind::External) => {
            info!("captured traffic goes to an external proxy's listeners in each pod's netns");
            None
        }
        (OnOff::On, ProxyKind::Ztunnel) => {
            info!(
                "captured traffic goes to ztunnel's listeners in each pod's netns; pods are handed to it over ZDS"
            );
            None
        }
        (OnOff::Off, _) => None,
    };
    let metrics = crate::metrics::Metrics::new();
    let xds = xds.map(|source| source.with_metrics(metrics.xds().clone()));
    let mut node_agent = NodeAgent::new(
        args.node_name.clone(),
        trust_domain.clone(),
        redirector,
        args.capture.into(),
    )
    .with_metrics(metrics.clone())
    .with_dns_capture(dns_capture_default(&args));
    if (args.capture, args.proxy) == (OnOff::On, ProxyKind::Ztunnel) {
        node_agent = node_agent.with_ztunnel(serve_zds(&args.zds_socket, &metrics)?);
    }

    // The workload store and its one writer (only the builtin proxy reads it).
    let (cluster_views, store_applied) = match &proxy {
        Some(parts) => {
            parts.proxy.set_observer(
                metrics.connection_observer(parts.store.clone(), trust_domain.clone()),
            );
            // The reconcile thread runs the proxy's calls on the first
            // shard; each pod is then served on a shard of its own turn.
            let runtime = data_path
                .first()
                .unwrap_or_else(tokio::runtime::Handle::current);
            parts.proxy.set_shards(data_path.clone());
            node_agent = node_agent.with_proxy(ProxyHandle {
                proxy: parts.proxy.clone(),
                runtime,
            });
            if args.kernel_authz == OnOff::On {
                // The reconciler compiles the store's policies into the
                // kernel (a mode without a kernel point says so and stops).
                node_agent = node_agent.with_kernel_authz(parts.store.clone());
            }
            let views = Arc::new(Latest::default());
            let (applied, store_applied) = watch::channel(0);
            // The DNS proxy's names, from the store like the fast-path
            // table; the proxy hands these parts to each pod's server
            // (`proxy/dns_sockets.rs`).
            let dns = start_dns_names(&args, parts, store_applied.clone(), &metrics)?;
            parts.proxy.set_dns(dns);
            let proxy = parts.proxy.clone();
            if let Some(kernel) = fast_path {
                start_fast_path(
                    &args,
                    kernel,
                    parts,
                    store_applied.clone(),
                    &metrics,
                    &trust_domain,
                );
            }
            tokio::spawn(
                own_store(parts.store.clone(), views.clone(), applied, move || {
                    proxy.policies_changed()
                })
                .instrument(info_span!("store")),
            );
            // Inbound fails closed until the first view is in the store:
            // every source pushes only complete views (istiod's once both
            // types came, the discovery's once policies were listed).
            let proxy = parts.proxy.clone();
            let mut first_view = store_applied.clone();
            tokio::spawn(async move {
                if first_view.wait_for(|n| *n > 0).await.is_ok() {
                    proxy.cluster_view_applied();
                }
            });
            (Some(views), Some(store_applied))
        }
        None => (None, None),
    };

    // The reconciler, and the sink every source pushes through.
    let (pods, pods_rx) = watch::channel(None);
    let reconciler = Reconciler::spawn(
        node_agent,
        ReconcilerInputs {
            pods: pods_rx,
            store_applied,
            verify_every: Duration::from_secs(args.verify_interval.max(1)),
        },
        tokio::runtime::Handle::current(),
    )
    .map_err(AgentError::Thread)?;
    let sink: Arc<dyn SourceSink> = Arc::new(AgentSink::new(pods, cluster_views));
    // With istiod, the cluster view is istiod's alone: the pod source only
    // says which of this node's pods to enrol.
    let pod_sink: Arc<dyn SourceSink> = match &xds {
        Some(_) => Arc::new(NodePodsOnly(sink.clone())),
        None => sink.clone(),
    };

    // Observers: they read the published snapshots only.
    let mut reader = SnapshotReader::new(
        reconciler.snapshots(),
        proxy.as_ref().map(|p| p.proxy.clone()),
    );
    if let Some(xds) = &xds {
        reader = reader.with_xds(xds.status());
    }
    // config_dump (issue 14): where this node's pods come from.
    reader = reader.with_pod_source(match &source {
        PodSource::File(_) => "workloads-file",
        PodSource::Kube(_) => "kubernetes",
    });
    let observers = Observers {
        reader,
        store: proxy.as_ref().map(|p| p.store.clone()),
        metrics: metrics.clone(),
        bpf_pin_dir: args.bpf_pin_dir.clone(),
    };
    let bound = observers
        .serve(ObserverAddrs {
            admin: args.admin_addr,
            metrics: args.metrics_addr,
            readiness: args.readiness_addr,
        })
        .await?;
    info!(admin = %bound.admin, metrics = %bound.metrics, readiness = %bound.readiness, "admin API, metrics and readiness endpoints listening");

    // Sources.
    let mut sources = tokio::task::JoinSet::new();
    if let Some(xds) = xds {
        // Never returns: istiod away is waited out, keeping what it sent.
        sources.spawn(xds.run(sink.clone()).instrument(info_span!("xds")));
    }
    match source {
        PodSource::File(file) => {
            sources.spawn(
                file.run(pod_sink.clone())
                    .instrument(info_span!("workloads_file")),
            );
        }
        PodSource::Kube(client) => {
            let mut options = kube::KubeOptions::new(args.node_name.clone());
            options.trust_domain = trust_domain.clone();
            options.enablement = enablement.clone();
            let mut pods = kube::KubeSource::new(
                client.clone(),
                options,
                Arc::new(netns_resolver(args.cri_socket.as_ref())),
            );
            if let Some(socket) = &args.cni_socket {
                pods = pods.with_cni(cni::start(&args, socket)?);
            }
            metrics.watch_kube(pods.stats());
            sources.spawn(
                pods.run(pod_sink.clone(), reconciler.snapshots())
                    .instrument(info_span!("kube")),
            );
            // The proxy must know every pod of the cluster (who a peer IP
            // is, which identity it speaks), not only this node's. With
            // --xds-address istiod tells it instead.
            if proxy.is_some() && args.xds_address.is_none() {
                let discovery = kube::ClusterWorkloads::new(client)
                    .with_cluster_domain(&args.cluster_domain)
                    .with_enablement(enablement)
                    .with_waypoint_allow(
                        (args.auto_allow_waypoint_policy == OnOff::On)
                            .then(|| trust_domain.clone()),
                    );
                sources.spawn(
                    discovery
                        .run(sink.clone())
                        .instrument(info_span!("discovery")),
                );
            }
        }
    }

    let mut sigterm = signal(SignalKind::terminate()).map_err(AgentError::Signals)?;
    let mut sigint = signal(SignalKind::interrupt()).map_err(AgentError::Signals)?;
    tokio::select! {
        _ = sigterm.recv() => info!("SIGTERM: stopping"),
        _ = sigint.recv() => info!("SIGINT: stopping"),
        _ = sources.join_next() => error!("a pod source stopped; stopping"),
    }
    sources.abort_all();
    let action = exit_plan.decide().await;
    exit::shutdown(reconciler, action, proxy.map(|p| p.proxy), &args).await
}

/// A pod source's sink when another source (istiod) owns the cluster view:
/// this node's pods pass, the pod source's own cluster view does not.
struct NodePodsOnly(Arc<dyn SourceSink>);

impl SourceSink for NodePodsOnly {
    fn node_pods(&self, pods: crate::control::NodePods) {
        self.0.node_pods(pods);
    }

    fn cluster(&self, _view: crate::control::ClusterView) {}

    fn cluster_delta(&self, _delta: crate::control::ClusterDelta) {}

    fn synced(&self, source: &'static str) {
        self.0.synced(source);
    }
}

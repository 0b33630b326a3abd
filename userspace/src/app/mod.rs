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

mod sink;
mod store;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, RwLock},
    time::Duration,
};

use tokio::{
    signal::unix::{SignalKind, signal},
    sync::watch,
};
use tracing::{Instrument as _, error, info, info_span, warn};

pub use sink::AgentSink;
pub use store::{Latest, apply as apply_cluster_view, own_store};

use crate::{
    agent::{NodeAgent, ProxyHandle, Reconciler, ReconcilerInputs},
    cli::{AgentArgs, CriSocket, OnExit, OnOff, ProxyKind},
    control::{SourceSink, file::FileSource, kube},
    proxy::Proxy,
    redirect::{
        RedirectMode, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector, LoadError},
    },
    snapshot::SnapshotReader,
    state::TrustDomain,
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
/// says.
pub async fn run(args: AgentArgs) -> Result<(), AgentError> {
    raise_open_files_limit(&args);
    let source = match &args.workloads {
        Some(path) => PodSource::File(FileSource::load(
            path,
            &args.node_name,
            Duration::from_secs(args.reload_interval.max(1)),
        )?),
        // Configured before anything is loaded, so that a missing
        // configuration fails fast.
        None => PodSource::Kube(kube::client().await?),
    };
    let trust_domain = match &source {
        PodSource::File(file) => file.trust_domain().clone(),
        PodSource::Kube(_) => args.trust_domain.clone(),
    };
    // Checked before anything is set up, like the pod source.
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
    let mut node_agent = NodeAgent::new(
        args.node_name.clone(),
        trust_domain.clone(),
        redirector,
        args.capture.into(),
    )
    .with_metrics(metrics.clone())
    .with_dns_capture(dns_capture_default(&args));
    if (args.capture, args.proxy) == (OnOff::On, ProxyKind::Ztunnel) {
        node_agent = node_agent.with_ztunnel(serve_zds(&args.zds_socket)?);
    }

    // The workload store and its one writer (only the builtin proxy reads it).
    let (cluster_views, store_applied) = match &proxy {
        Some(parts) => {
            parts
                .proxy
                .set_observer(metrics.connection_observer(parts.store.clone()));
            node_agent = node_agent.with_proxy(ProxyHandle {
                proxy: parts.proxy.clone(),
                runtime: tokio::runtime::Handle::current(),
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
            let dns = start_dns_names(&args, parts, store_applied.clone(), &metrics);
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
            let pods = kube::KubeSource::new(
                client.clone(),
                options,
                Arc::new(netns_resolver(args.cri_socket.as_ref())),
            );
            metrics.watch_kube(pods.stats());
            sources.spawn(
                pods.run(pod_sink.clone(), reconciler.snapshots())
                    .instrument(info_span!("kube")),
            );
            // The proxy must know every pod of the cluster (who a peer IP
            // is, which identity it speaks), not only this node's. With
            // --xds-address istiod tells it instead.
            if proxy.is_some() && args.xds_address.is_none() {
                let discovery = kube::ClusterWorkloads::new(client);
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
    shutdown(reconciler, proxy.map(|p| p.proxy), &args).await
}

/// The node's default for DNS capture, when a DNS proxy serves the pods:
/// shunt's own (the builtin proxy) or ztunnel's. `None` (never captured):
/// `--capture off`, or an external proxy, which may serve no DNS.
fn dns_capture_default(args: &AgentArgs) -> Option<bool> {
    match (args.capture, args.proxy) {
        (OnOff::On, ProxyKind::Builtin | ProxyKind::Ztunnel) => Some(args.dns_capture == OnOff::On),
        _ => None,
    }
}

/// Whether pods get the passthrough fast path: `--fast-path on` with the
/// builtin proxy capturing (only its passthrough is what the fast path
/// replaces, and only its store feeds the table).
fn fast_path_wanted(args: &AgentArgs) -> bool {
    args.fast_path == OnOff::On && args.capture == OnOff::On && args.proxy == ProxyKind::Builtin
}

/// The fast path's kernel side, opened after the redirector pinned it: the
/// table (now off), the events, the counters.
struct FastPathKernel {
    table: crate::redirect::ebpf::DestinationTable,
    events: crate::redirect::ebpf::FastPathEvents,
    counters: crate::redirect::ebpf::FastPathCounters,
}

fn open_fast_path(args: &AgentArgs) -> Result<FastPathKernel, AgentError> {
    let pin_dir = &args.bpf_pin_dir;
    let table =
        crate::redirect::ebpf::DestinationTable::open(pin_dir, args.fast_path_max_destinations)?;
    Ok(FastPathKernel {
        table,
        events: crate::redirect::ebpf::FastPathEvents::open(pin_dir)?,
        counters: crate::redirect::ebpf::FastPathCounters::open(pin_dir)?,
    })
}

/// Starts the table writer (fed by the store owner's `applied` views) and
/// the reporter, when the fast path is wanted; otherwise the table stays
/// off.
fn start_fast_path(
    args: &AgentArgs,
    kernel: FastPathKernel,
    parts: &ProxyParts,
    applied: watch::Receiver<u64>,
    metrics: &crate::metrics::Metrics,
    trust_domain: &TrustDomain,
) {
    if !fast_path_wanted(args) {
        info!(
            "passthrough fast path off (--fast-path off): every connection of an enrolled pod goes through the proxy"
        );
        return;
    }
    info!(
        max_destinations = args.fast_path_max_destinations,
        "passthrough fast path on: enrolled pods' connects outside the mesh go direct once the destination table is written"
    );
    let fast = metrics.fast_path().clone();
    tokio::spawn(
        crate::fastpath::table::write_table(
            kernel.table,
            parts.store.clone(),
            applied,
            fast.clone(),
        )
        .instrument(info_span!("fast_path_table")),
    );
    let reporter = crate::fastpath::report::Reporter {
        observer: metrics.connection_observer(parts.store.clone()),
        store: parts.store.clone(),
        trust_domain: trust_domain.clone(),
        metrics: fast,
    };
    tokio::spawn(
        crate::fastpath::report::report_events(kernel.events, kernel.counters, reporter)
            .instrument(info_span!("fast_path_events")),
    );
}

/// The DNS proxy's shared parts: the one task that publishes the mesh's
/// names (fed by the store owner's `applied` views, as the fast-path table
/// writer is), the upstreams from `--dns-resolv-conf` (unreadable: logged,
/// and what the mesh does not know gets SERVFAIL), the metrics.
fn start_dns_names(
    args: &AgentArgs,
    parts: &ProxyParts,
    applied: watch::Receiver<u64>,
    metrics: &crate::metrics::Metrics,
) -> crate::dns::DnsShared {
    let (publish, names) = crate::dns::names_channel(&args.cluster_domain);
    tokio::spawn(
        crate::dns::publish_names(
            parts.store.clone(),
            applied,
            args.cluster_domain.clone(),
            publish,
        )
        .instrument(info_span!("dns_names")),
    );
    let forwarder =
        crate::dns::Forwarder::from_resolv_conf(&args.dns_resolv_conf, args.dns_upstream_timeout)
            .unwrap_or_else(|e| {
                warn!(error = %e, "DNS proxy without upstream resolvers: names the mesh does not know get SERVFAIL");
                crate::dns::Forwarder::new(Vec::new(), args.dns_upstream_timeout)
            });
    crate::dns::DnsShared {
        names,
        forwarder: Arc::new(forwarder),
        metrics: metrics.dns().clone(),
    }
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

/// A pod source's sink when another source (istiod) owns the cluster view:
/// this node's pods pass, the pod source's own cluster view does not.
struct NodePodsOnly(Arc<dyn SourceSink>);

impl SourceSink for NodePodsOnly {
    fn node_pods(&self, pods: crate::control::NodePods) {
        self.0.node_pods(pods);
    }

    fn cluster(&self, _view: crate::control::ClusterView) {}

    fn synced(&self, source: &'static str) {
        self.0.synced(source);
    }
}

/// The redirector `--redirect` asks for (`auto`: eBPF when the kernel has
/// every hook, else iptables).
fn redirector(args: &AgentArgs) -> Result<Box<dyn Redirector>, AgentError> {
    let iptables = || -> Result<Box<dyn Redirector>, AgentError> {
        let mut options = crate::redirect::iptables::IptablesOptions::new(args.node_name.clone());
        options.probe_source = args.probe_source;
        // --proxy ztunnel: Istio's own in-pod rules, as istio-cni installs
        // them, so a stock ztunnel finds what it expects.
        if args.proxy == ProxyKind::Ztunnel {
            options.rules = crate::redirect::iptables::InpodRules::Istio;
        }
        let iptables = crate::redirect::iptables::IptablesRedirector::new(options)?;
        info!(mode = "iptables", requested = %args.redirect, backend = %iptables.backend(), "redirection ready: netfilter rules in each pod's netns");
        Ok(Box::new(iptables))
    };
    Ok(match args.redirect {
        RedirectMode::Iptables => iptables()?,
        RedirectMode::Auto | RedirectMode::Ebpf => {
            let options = EbpfOptions {
                pin_dir: args.bpf_pin_dir.clone(),
                cgroup_root: args.cgroup_root.clone(),
                probe_source: args.probe_source,
                splice: args.splice,
                splice_backlog: args.splice_backlog,
                preserve_source: args.preserve_source == OnOff::On,
                fast_path: fast_path_wanted(args),
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
    })
}

/// Where the observers listen.
#[derive(Clone, Copy, Debug)]
pub struct ObserverAddrs {
    /// The admin API (`--admin-addr`).
    pub admin: SocketAddr,
    /// `/metrics` (`--metrics-addr`).
    pub metrics: SocketAddr,
    /// `/healthz/ready` (`--readiness-addr`).
    pub readiness: SocketAddr,
}

/// What the admin API, `/metrics` and `/healthz/ready` read: the
/// reconciler's snapshots, the workload store, the metrics registry, the pin
/// dir. Nothing here reaches the reconciler.
pub struct Observers {
    pub reader: SnapshotReader,
    /// Every workload the proxy knows (absent without the builtin proxy).
    pub store: Option<Arc<RwLock<WorkloadStore>>>,
    pub metrics: crate::metrics::Metrics,
    pub bpf_pin_dir: PathBuf,
}

impl Observers {
    /// Binds the three endpoints and serves them in the background; returns
    /// the addresses bound (port 0 picks a free one).
    pub async fn serve(self, addrs: ObserverAddrs) -> Result<ObserverAddrs, AgentError> {
        let listener = tokio::net::TcpListener::bind(addrs.admin)
            .await
            .map_err(|source| AgentError::Admin {
                addr: addrs.admin,
                source,
            })?;
        let admin = local_addr(&listener, "admin", addrs.admin)?;
        let admin_state = crate::admin::AdminState {
            reader: self.reader.clone(),
            store: self.store,
            bpf_pin_dir: self.bpf_pin_dir,
        };
        tokio::spawn(crate::admin::serve(listener, admin_state).instrument(info_span!("admin")));

        let listener = bind("metrics", addrs.metrics).await?;
        let metrics = local_addr(&listener, "metrics", addrs.metrics)?;
        let serve = crate::metrics::serve(listener, self.reader.clone(), self.metrics);
        tokio::spawn(serve.instrument(info_span!("metrics")));

        let listener = bind("readiness", addrs.readiness).await?;
        let readiness = local_addr(&listener, "readiness", addrs.readiness)?;
        tokio::spawn(
            crate::health::serve(listener, self.reader).instrument(info_span!("readiness")),
        );
        Ok(ObserverAddrs {
            admin,
            metrics,
            readiness,
        })
    }
}

async fn bind(what: &'static str, addr: SocketAddr) -> Result<tokio::net::TcpListener, AgentError> {
    tokio::net::TcpListener::bind(addr)
        .await
        .map_err(|source| AgentError::Serve { what, addr, source })
}

fn local_addr(
    listener: &tokio::net::TcpListener,
    what: &'static str,
    addr: SocketAddr,
) -> Result<SocketAddr, AgentError> {
    listener
        .local_addr()
        .map_err(|source| AgentError::Serve { what, addr, source })
}

/// The ZDS server ztunnel connects to, running; returns the reconciler's
/// end of the link (the reconciler tells it the pods, it tells the
/// reconciler ztunnel's acks).
fn serve_zds(socket: &Path) -> Result<crate::inpod::ZtunnelLink, AgentError> {
    let (server, link) = crate::inpod::bind(socket, crate::inpod::DEFAULT_ACK_TIMEOUT)?;
    tokio::spawn(server.run().instrument(info_span!("zds")));
    Ok(link)
}

/// The identity manager (with its CA) and the proxy on top of it.
async fn start_proxy(
    args: &AgentArgs,
    trust_domain: &TrustDomain,
    original_dst: Arc<dyn crate::redirect::OriginalDst>,
) -> Result<ProxyParts, AgentError> {
    let istio = crate::identity::istio::IstioCaConfig::new(
        args.ca_address.clone(),
        args.ca_root_cert.clone(),
        args.ca_token_file.clone(),
    );
    let ca = crate::identity::ca_from_args(args.ca, &args.ca_dir, trust_domain, istio)
        .await
        .map_err(AgentError::Identity)?;
    let identities = crate::identity::IdentityManager::new(ca, Default::default());
    let store = Arc::new(RwLock::new(WorkloadStore::new()));
    let config = crate::proxy::ProxyConfig {
        trust_domain: trust_domain.clone(),
        inbound_plaintext: args.inbound_plaintext,
        preserve_source: args.preserve_source == OnOff::On,
        limits: crate::proxy::LimitsConfig {
            max_connections_per_source: args.max_connections_per_source,
            fd_reserve: args.fd_reserve,
        },
        handshake_timeout: Duration::from_secs(args.handshake_timeout.max(1)),
        ..Default::default()
    };
    let proxy =
        Proxy::new(config, identities, store.clone(), original_dst).map_err(AgentError::Proxy)?;
    info!(ca = ?args.ca, ca_dir = %args.ca_dir.display(), inbound_plaintext = %args.inbound_plaintext, preserve_source = ?args.preserve_source, "proxy ready: pods get listeners on 15001, 15006 and 15008 as they enrol");
    Ok(ProxyParts { proxy, store })
}

/// Raises the soft open-files limit to the hard one (a proxy needs two fds
/// per connection and one more per HBONE stream) and logs the figures.
fn raise_open_files_limit(args: &AgentArgs) {
    let limits = crate::proxy::LimitsConfig {
        max_connections_per_source: args.max_connections_per_source,
        fd_reserve: args.fd_reserve,
    };
    match crate::proxy::raise_open_files_limit() {
        Ok(files) => info!(
            before = files.before,
            soft = files.soft,
            hard = files.hard,
            reserve = crate::proxy::fd_reserve_now(&limits),
            max_connections_per_source = args.max_connections_per_source,
            "open-files limit raised to the hard limit; fds kept in reserve for the listeners"
        ),
        Err(e) => {
            let (soft, hard) = crate::proxy::open_files_limit();
            warn!(soft, hard, error = %e, "cannot raise the open-files limit; the proxy makes do with the soft one")
        }
    }
}

/// With `--on-exit unenrol`, unenrols every pod (no new connection is
/// captured); with `keep`, leaves redirection to the next agent. Then lets
/// the proxy's connections in flight finish within the grace period, and
/// reports the agent stopped.
async fn shutdown(
    reconciler: Reconciler,
    proxy: Option<Proxy>,
    args: &AgentArgs,
) -> Result<(), AgentError> {
    let unenrol = match args.on_exit {
        OnExit::Unenrol => true,
        OnExit::Keep => {
            info!(
                "leaving every pod enrolled for the next agent (--on-exit keep); pods without a proxy fail closed until it starts"
            );
            false
        }
    };
    reconciler.stop(unenrol).await;
    if let Some(proxy) = proxy {
        let cut = proxy.drain(Duration::from_secs(args.drain_seconds)).await;
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

/// Pods' netns come from the container runtime when one is configured or
/// found, else (and for whatever it cannot place) from /proc (the agent
/// runs with hostPID).
fn netns_resolver(socket: Option<&CriSocket>) -> kube::ChainResolver {
    use kube::{ChainResolver, CriOptions, CriResolver, ProcScanResolver, cri};
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

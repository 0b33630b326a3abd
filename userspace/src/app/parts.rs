//! Building the agent's parts: the proxy (with its identities), the pod
//! source's netns resolver, the istiod source, the ZDS server for a stock
//! ztunnel, the DNS proxy's names and the fast path's tasks.

use std::{
    path::Path,
    sync::{Arc, RwLock},
    time::Duration,
};

use tokio::sync::watch;
use tracing::{Instrument as _, error, info, info_span, warn};

use super::{AgentError, ProxyParts};
use crate::{
    cli::{AgentArgs, CriSocket, OnOff, ProxyKind},
    control::kube,
    proxy::Proxy,
    state::TrustDomain,
    store::WorkloadStore,
};

/// The node's default for DNS capture, when a DNS proxy serves the pods:
/// shunt's own (the builtin proxy) or ztunnel's. `None` (never captured):
/// `--capture off`, or an external proxy, which may serve no DNS.
pub(super) fn dns_capture_default(args: &AgentArgs) -> Option<bool> {
    match (args.capture, args.proxy) {
        (OnOff::On, ProxyKind::Builtin | ProxyKind::Ztunnel) => Some(args.dns_capture == OnOff::On),
        _ => None,
    }
}

/// Whether pods get the passthrough fast path: `--fast-path on` with the
/// builtin proxy capturing (only its passthrough is what the fast path
/// replaces, and only its store feeds the table).
pub(super) fn fast_path_wanted(args: &AgentArgs) -> bool {
    args.fast_path == OnOff::On && args.capture == OnOff::On && args.proxy == ProxyKind::Builtin
}

/// The fast path's kernel side, opened after the redirector pinned it: the
/// table (now off), the events, the counters.
pub(super) struct FastPathKernel {
    table: crate::redirect::ebpf::DestinationTable,
    events: crate::redirect::ebpf::FastPathEvents,
    counters: crate::redirect::ebpf::FastPathCounters,
}

pub(super) fn open_fast_path(args: &AgentArgs) -> Result<FastPathKernel, AgentError> {
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
pub(super) fn start_fast_path(
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
    fast.enabled
        .store(true, std::sync::atomic::Ordering::Relaxed);
    let reporter_applied = applied.clone();
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
        observer: metrics.connection_observer(parts.store.clone(), trust_domain.clone()),
        connections: metrics.kernel_connections(parts.store.clone(), trust_domain.clone()),
        store: parts.store.clone(),
        trust_domain: trust_domain.clone(),
        metrics: fast,
        applied: reporter_applied,
    };
    tokio::spawn(
        crate::fastpath::report::report_events(kernel.events, kernel.counters, reporter)
            .instrument(info_span!("fast_path_events")),
    );
}

/// The DNS proxy's shared parts: the one task that publishes the mesh's
/// names (fed by the store owner's `applied` views, as the fast-path table
/// writer is), the upstreams from `--dns-resolv-conf` (unreadable: logged,
/// and what the mesh does not know gets SERVFAIL, hostname endpoints do
/// not resolve), the metrics.
pub(super) fn start_dns_names(
    args: &AgentArgs,
    parts: &ProxyParts,
    applied: watch::Receiver<u64>,
    metrics: &crate::metrics::Metrics,
) -> Result<crate::dns::DnsShared, AgentError> {
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
    let on_demand = match crate::dns::OnDemandResolver::from_resolv_conf(
        &args.dns_resolv_conf,
        args.dns_upstream_timeout,
    ) {
        Ok(resolver) => resolver,
        Err(e) => {
            warn!(error = %e, "no resolver for service endpoints named by hostname: connections to them fail");
            crate::dns::OnDemandResolver::without_upstream(args.dns_upstream_timeout)?
        }
    };
    Ok(crate::dns::DnsShared {
        names,
        forwarder: Arc::new(forwarder),
        metrics: metrics.dns().clone(),
        on_demand: Arc::new(on_demand),
    })
}

/// `--xds-address`: the istiod source, configured (not connected yet).
pub(super) fn xds_source(args: &AgentArgs) -> Result<Option<crate::xds::XdsSource>, AgentError> {
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

/// The ZDS server ztunnel connects to, running; returns the reconciler's
/// end of the link (the reconciler tells it the pods, it tells the
/// reconciler ztunnel's acks).
pub(super) fn serve_zds(
    socket: &Path,
    metrics: &crate::metrics::Metrics,
) -> Result<crate::inpod::ZtunnelLink, AgentError> {
    let config = crate::inpod::ZdsConfig {
        metrics: metrics.zds().clone(),
        ..Default::default()
    };
    let (server, link) = crate::inpod::bind(socket, config)?;
    tokio::spawn(server.run().instrument(info_span!("zds")));
    Ok(link)
}

/// The identity manager (with its CA) and the proxy on top of it.
pub(super) async fn start_proxy(
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
    let store = Arc::new(RwLock::new(WorkloadStore::on_network(&args.network)));
    let revocations = match &args.crl_path {
        Some(path) => {
            let (loaded, unusable) = crate::identity::crl::Revocations::load_or_wait(path);
            if let Some(e) = unusable {
                error!(error = %e, "certificate revocation lists unusable: nothing is revoked until a good file is written");
            } else if loaded.waiting() {
                warn!(path = %path.display(), "no certificate revocation list file yet: nothing is revoked until it appears");
            } else {
                info!(path = %path.display(), lists = loaded.current().len(), "certificate revocation lists loaded: every handshake checks them");
            }
            // Runs for the agent's life; a change applies to new handshakes
            // and open connections.
            tokio::spawn(crate::identity::crl::watch(
                loaded.clone(),
                CRL_RELOAD_EVERY,
            ));
            loaded
        }
        None => crate::identity::crl::Revocations::none(),
    };
    let config = crate::proxy::ProxyConfig {
        trust_domain: trust_domain.clone(),
        inbound_plaintext: args.inbound_plaintext,
        preserve_source: args.preserve_source == OnOff::On,
        limits: crate::proxy::LimitsConfig {
            max_connections_per_source: args.max_connections_per_source,
            fd_reserve: args.fd_reserve,
        },
        handshake_timeout: Duration::from_secs(args.handshake_timeout.max(1)),
        network: args.network.clone(),
        revocations,
        ..Default::default()
    };
    let proxy =
        Proxy::new(config, identities, store.clone(), original_dst).map_err(AgentError::Proxy)?;
    if args.ca == crate::identity::CaKind::Istio {
        // Runs for the agent's life: a root rotation (istiod's
        // istio-ca-root-cert gaining a new root) without a restart.
        tokio::spawn(watch_roots(proxy.clone(), ROOTS_RELOAD_EVERY));
    }
    info!(ca = ?args.ca, ca_dir = %args.ca_dir.display(), inbound_plaintext = %args.inbound_plaintext, preserve_source = ?args.preserve_source, "proxy ready: pods get listeners on 15001, 15006 and 15008 as they enrol");
    Ok(ProxyParts { proxy, store })
}

/// How often the revocation list file is looked at for a change.
const CRL_RELOAD_EVERY: Duration = Duration::from_secs(5);
/// How often the Istio CA's root file is looked at for a change.
const ROOTS_RELOAD_EVERY: Duration = Duration::from_secs(5);

/// Looks at the CA's root file every `every`; when it changed, the channel
/// to istiod and the proxy's trust anchors take its roots (as ztunnel's
/// root reload). A file that went away or does not parse is logged once and
/// the roots in force stay.
async fn watch_roots(proxy: Proxy, every: Duration) {
    let mut tick = tokio::time::interval(every);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tick.tick().await;
        let identities = proxy.identities();
        match identities.reload_roots() {
            Ok(false) => {}
            Ok(true) => {
                let roots = identities.roots();
                match proxy.replace_roots(&roots) {
                    Ok(()) => info!(
                        roots = roots.len(),
                        "mesh root certificates reloaded: istiod and new handshakes are checked against them"
                    ),
                    Err(e) => {
                        error!(error = %e, "mesh root certificates reloaded but unusable for handshakes; the ones in force stay")
                    }
                }
            }
            Err(e) => {
                error!(error = %e, "mesh root certificates not reloaded; the ones in force stay")
            }
        }
    }
}

/// Raises the soft open-files limit to the hard one (a proxy needs two fds
/// per connection and one more per HBONE stream) and logs the figures.
pub(super) fn raise_open_files_limit(args: &AgentArgs) {
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

/// Pods' netns come from the container runtime when one is configured or
/// found, else (and for whatever it cannot place) from /proc (the agent
/// runs with hostPID).
pub(super) fn netns_resolver(socket: Option<&CriSocket>) -> kube::ChainResolver {
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

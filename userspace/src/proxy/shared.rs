//! What every task of the proxy shares: its configuration, the pods it
//! serves (by key and by IP), its counters, and each served pod's state.

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr},
    sync::{
        Arc, OnceLock, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
};

use tokio_util::{sync::CancellationToken, task::TaskTracker};

use super::{ConnectionObserver, ProxyConfig, WorkloadLookup, limits, pool, socket, waypoint};
use crate::{
    identity::IdentityManager,
    redirect::OriginalDst,
    state::{SpiffeId, WorkloadKey},
    tls::TrustRoots,
};

/// Counters since start (read with [`Proxy::stats`]).
#[derive(Debug, Default)]
pub(super) struct Counters {
    pub(super) outbound_hbone: AtomicU64,
    pub(super) outbound_passthrough: AtomicU64,
    pub(super) inbound_hbone: AtomicU64,
    pub(super) inbound_plaintext: AtomicU64,
    pub(super) refused: AtomicU64,
    pub(super) failed: AtomicU64,
    pub(super) bytes_out: AtomicU64,
    pub(super) bytes_in: AtomicU64,
    /// Pods whose listeners were started (a re-serve counts again) and
    /// retired: ztunnel's `workload_manager_proxies_{started,stopped}`.
    pub(super) proxies_started: AtomicU64,
    pub(super) proxies_stopped: AtomicU64,
}

/// Events counted by Istio's `reporter`: this side as the client
/// (`reporter="source"`, outbound) or as the server (`"destination"`,
/// inbound). Shared with the pools' connection tasks.
#[derive(Debug, Default)]
pub(crate) struct ReporterCounters {
    as_source: AtomicU64,
    as_destination: AtomicU64,
}

impl ReporterCounters {
    /// One more as the client (`source`).
    pub fn outbound(&self) {
        self.as_source.fetch_add(1, Ordering::Relaxed);
    }

    /// One more as the server (`destination`).
    pub fn inbound(&self) {
        self.as_destination.fetch_add(1, Ordering::Relaxed);
    }

    pub fn snapshot(&self) -> super::ReporterCounts {
        super::ReporterCounts {
            source: self.as_source.load(Ordering::Relaxed),
            destination: self.as_destination.load(Ordering::Relaxed),
        }
    }
}

/// One enrolled pod's proxy state.
pub(crate) struct PodState {
    pub key: WorkloadKey,
    pub identity: SpiffeId,
    pub ips: Vec<IpAddr>,
    pub sockets: socket::PodSockets,
    pub pool: pool::Pool,
    /// Cancelled when the pod leaves: its listeners stop accepting.
    pub listeners: CancellationToken,
    /// Whether "cannot keep the client's source address" was logged for
    /// this pod: the cause (capabilities, family) is the same every time.
    pub source_warned: std::sync::atomic::AtomicBool,
    /// Whether its DNS proxy is served (see [`PodNet::dns`]).
    pub dns: bool,
    /// Which namespace its sockets live in (a pod whose netns is replaced
    /// is served again there: `agent/serve.rs`).
    pub netns: crate::netns::NsId,
}

impl PodState {
    /// Connects to this pod's application at `dst` for a client at
    /// `client`: from the client's address when
    /// [`ProxyConfig::preserve_source`] is on (so the application sees
    /// its real peer, as with ztunnel; its port as `port` says), else from
    /// the pod's own address.
    /// A client address that cannot be bound falls back to the pod's own,
    /// logged once per pod with the reason.
    pub async fn connect_app(
        &self,
        config: &ProxyConfig,
        dst: SocketAddr,
        client: SocketAddr,
        port: socket::SourcePort,
    ) -> std::io::Result<tokio::net::TcpStream> {
        // The pod's own address needs nothing special (a pod reaching itself
        // through the mesh).
        if !config.preserve_source || self.ips.contains(&client.ip()) {
            return self.sockets.connect(dst, config.connect_timeout).await;
        }
        match self
            .sockets
            .connect_transparent(dst, client.ip(), port, config.connect_timeout)
            .await
        {
            Ok(stream) => Ok(stream),
            Err(socket::SourceError::Connect(e)) => Err(e),
            Err(socket::SourceError::Bind(e)) => {
                if !self
                    .source_warned
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    tracing::warn!(pod = %self.key, client = %client, error = %e, "cannot connect to the application from the client's address; it sees the pod's own address instead (logged once per pod)");
                }
                self.sockets.connect(dst, config.connect_timeout).await
            }
        }
    }
}

/// State shared by every task of the proxy.
pub(crate) struct Shared {
    pub config: ProxyConfig,
    pub identities: IdentityManager,
    pub workloads: Arc<dyn WorkloadLookup>,
    pub original_dst: Arc<dyn OriginalDst>,
    pub roots: TrustRoots,
    pub(super) pods: RwLock<HashMap<WorkloadKey, Arc<PodState>>>,
    pub(super) pods_by_ip: RwLock<HashMap<IpAddr, Arc<PodState>>>,
    /// Every connection and stream task, for draining.
    pub tracker: TaskTracker,
    /// Cancelled when draining starts: listeners stop, HTTP/2 connections
    /// send GOAWAY.
    pub draining: CancellationToken,
    /// Cancelled when the drain grace period ends: everything stops.
    pub abort: CancellationToken,
    pub(super) counters: Counters,
    /// Connections this side refused or closed because a revocation list
    /// names the peer's chain (`istio_crl_policy_rejections_total`).
    pub(super) crl_rejections: Arc<ReporterCounters>,
    /// Sockets the listeners accepted, and closed: outbound from a local
    /// pod (`source`), inbound plaintext and HBONE (`destination`); their
    /// difference is ztunnel's `istio_tcp_sockets_open`.
    pub(super) sockets_accepted: ReporterCounters,
    pub(super) sockets_closed: Arc<ReporterCounters>,
    /// Per-source and fd limits on inbound connections; refusals by reason.
    pub(crate) limits: limits::Limits,
    /// Connections to service VIPs so far: which endpoint the next one gets
    /// (round robin; one counter for every service is enough to spread the
    /// load, and costs no per-service state).
    pub(super) service_picks: AtomicUsize,
    /// Refused connections to waypoint-bound destinations.
    pub(crate) waypoint_failures: waypoint::WaypointFailures,
    /// Told about every connection (metrics); set once, see
    /// [`Proxy::set_observer`].
    pub(super) observer: OnceLock<Arc<dyn ConnectionObserver>>,
    /// The data path's shards, each pod served on one
    /// ([`Proxy::set_shards`]). Unset: the current runtime.
    pub(super) shards: OnceLock<crate::shards::Shards>,
    /// Connections accepted on each shard, by its index.
    pub(super) accepted_by_shard: OnceLock<Box<[AtomicU64]>>,
    /// The DNS server's shared parts (names, upstreams, metrics):
    /// [`Proxy::set_dns`]. Unset: a pod's DNS proxy is not bound.
    pub(super) dns: OnceLock<crate::dns::DnsShared>,
    /// Bumped by [`Proxy::policies_changed`]: open inbound connections
    /// re-check their authorization.
    pub policy_changes: tokio::sync::watch::Sender<u64>,
    /// Whether a complete cluster view (workloads and policies) has been
    /// applied to the store once ([`Proxy::cluster_view_applied`]): until
    /// then inbound connections are refused, as no policy is known yet.
    ///
    /// [`Proxy::cluster_view_applied`]: super::Proxy::cluster_view_applied
    pub(super) cluster_synced: std::sync::atomic::AtomicBool,
}

impl Shared {
    /// Counts a connection accepted on the calling thread's shard.
    pub(super) fn accepted_here(&self) {
        if let (Some(index), Some(counts)) =
            (crate::shards::current(), self.accepted_by_shard.get())
            && let Some(count) = counts.get(index)
        {
            count.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// See [`Shared::cluster_synced`].
    pub fn cluster_synced(&self) -> bool {
        self.cluster_synced
            .load(std::sync::atomic::Ordering::Acquire)
    }

    /// Asks the redirector where a redirected connection was going.
    pub fn original_dst_of(
        &self,
        stream: tokio::net::TcpStream,
    ) -> Result<(tokio::net::TcpStream, std::net::SocketAddr), String> {
        // A borrowed view of the socket, not `into_std`: that would take
        // it out of the reactor and put it back (two epoll_ctl calls per
        // connection).
        use std::os::fd::{AsRawFd, FromRawFd};
        // SAFETY: the fd is open and owned by `stream`, which outlives the
        // view; ManuallyDrop keeps the view from closing it.
        let view = std::mem::ManuallyDrop::new(unsafe {
            std::net::TcpStream::from_raw_fd(stream.as_raw_fd())
        });
        match self.original_dst.original_dst(&view) {
            Ok(dst) => Ok((stream, dst)),
            Err(e) => Err(format!("no original destination: {e}")),
        }
    }

    /// The local (enrolled on this proxy) pod owning `ip`.
    pub fn local_pod(&self, ip: IpAddr) -> Option<Arc<PodState>> {
        self.pods_by_ip
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(&ip)
            .cloned()
    }

    pub(super) fn all_pods(&self) -> Vec<Arc<PodState>> {
        self.pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }
}

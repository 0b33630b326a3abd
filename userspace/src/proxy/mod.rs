//! The node proxy: per-pod listeners inside each enrolled pod's netns, and
//! HBONE between pods.
//!
//! ```text
//!  app ──▶ 127.0.0.1:15001 (outbound.rs) ──HBONE──▶ podIP:15008 (inbound.rs) ──▶ app
//!            │ not a mesh workload                          ▲ plaintext from outside
//!            └──▶ passthrough (plain TCP)      0.0.0.0:15006 (inbound_plaintext.rs) ──▶ app
//! ```
//!
//! The agent drives it: [`Proxy::add_pod`] when a pod is enrolled (binds the
//! three listeners inside the pod's netns, registers its identity),
//! [`Proxy::remove_pod`] when it leaves, [`Proxy::drain`] on SIGTERM. Every
//! socket the proxy opens carries `SO_MARK` 0x539 and listeners use
//! `SO_REUSEPORT`, so a new agent can bind while the old one drains.

// Timers come from `crate::timers` here: this runs on a runtime without a
// time driver (userspace/clippy.toml).
#![cfg_attr(not(test), warn(clippy::disallowed_methods))]

mod accept;
pub(crate) mod access_log;
mod baggage;
mod dns_sockets;
mod double_hbone;
mod h2;
mod h2_io;
mod h2_refusals;
mod inbound;
mod inbound_plaintext;
pub(crate) mod inbound_service;
mod limits;
mod lookup;
mod network_gateway;
mod observe;
mod on_demand_dns;
mod on_wake;
mod outbound;
mod pods;
mod policy;
mod pool;
mod relay;
#[cfg(test)]
mod relay_tests;
mod shared;
mod socket;
#[cfg(test)]
mod socket_tests;
pub mod waypoint;

pub use baggage::Baggage;
pub use h2::H2Settings;
pub use inbound::NON_CONNECT_STATUS;
pub use limits::{
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE, LimitsConfig, MAX_CONCURRENT_STREAMS, OpenFiles,
    RefusalReason, fd_reserve_now, open_files_limit, raise_open_files_limit,
};
pub use observe::{
    ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome, Direction, Failure,
    OpenConnection,
};
pub use pods::ServedPod;
pub use policy::{Decision, InboundPlaintextPolicy, PlaintextConnection, authorize};
pub use socket::PROXY_MARK;
pub use waypoint::WaypointFailureCount;
// What the HBONE fuzz target (`fuzz/hbone.rs`) drives: the proxy's own
// frame tap and request checks.
#[cfg(test)]
pub(crate) use {
    h2_refusals::{FrameParser, FrameTap, H2Refusal},
    inbound::connect_target,
};

use std::{
    net::{IpAddr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, OnceLock, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

pub(crate) use access_log::{AccessLog, Outcome};
pub use lookup::WorkloadLookup;
use pods::no_ipv6;
use shared::Counters;
pub(crate) use shared::{PodState, Shared};
use shunt_common::{PORT_HBONE, PORT_INBOUND_PLAINTEXT, PORT_OUTBOUND};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    identity::IdentityManager,
    redirect::OriginalDst,
    state::{SpiffeId, TrustDomain, WorkloadKey},
    tls::TrustRoots,
};

/// The proxy's own ports: a CONNECT or redirect to one of them would loop.
pub const PROXY_PORTS: [u16; 3] = [PORT_OUTBOUND, PORT_INBOUND_PLAINTEXT, PORT_HBONE];

/// Tuning of the proxy. `Default` is what the agent runs with.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub trust_domain: TrustDomain,
    pub h2: H2Settings,
    /// TCP connect to a peer's 15008, an application, or a passthrough
    /// destination.
    pub connect_timeout: Duration,
    /// TLS + HTTP/2 handshake of an HBONE connection.
    pub handshake_timeout: Duration,
    /// Waiting for the answer to a CONNECT.
    pub connect_response_timeout: Duration,
    /// A pooled connection with no stream for this long is closed.
    pub pool_idle_timeout: Duration,
    /// What happens to connections from outside the mesh to a pod.
    pub inbound_plaintext: InboundPlaintextPolicy,
    /// Inbound connections reach the application from the client's address
    /// (`IP_TRANSPARENT`) rather than the pod's own. Needs the pod's reply
    /// path, which the redirector installs.
    pub preserve_source: bool,
    /// Per-source connection limit and the fd reserve (`limits.rs`).
    pub limits: LimitsConfig,
    /// This node's Istio network (`--network`; empty: the default one).
    /// An inbound CONNECT whose `x-forwarded-network` names another came
    /// through that network's gateway.
    pub network: String,
    /// The certificate revocation lists every handshake checks
    /// (`--crl-path`; none by default).
    pub revocations: Arc<crate::identity::crl::Revocations>,
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            trust_domain: TrustDomain::default(),
            h2: H2Settings::default(),
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            connect_response_timeout: Duration::from_secs(15),
            pool_idle_timeout: Duration::from_secs(60),
            inbound_plaintext: InboundPlaintextPolicy::default(),
            preserve_source: false,
            limits: LimitsConfig::default(),
            network: String::new(),
            revocations: crate::identity::crl::Revocations::none(),
        }
    }
}

/// A pod the proxy serves, as the agent hands it over.
#[derive(Clone, Debug)]
pub struct PodNet {
    pub key: WorkloadKey,
    /// The pod's network namespace (`/var/run/netns/NAME`, `/proc/PID/ns/net`).
    pub netns: PathBuf,
    /// The pod's addresses: 15008 is bound on each.
    pub ips: Vec<IpAddr>,
    /// The identity the pod speaks with.
    pub identity: SpiffeId,
    /// Whether the pod's DNS is captured: the DNS proxy is bound on
    /// 127.0.0.1:15053 (and [::1]:15053) in its netns and serves it
    /// (`dns_sockets.rs`).
    pub dns: bool,
}

/// Errors from the proxy's control API.
#[derive(Debug, thiserror::Error)]
pub enum ProxyError {
    #[error("pod {pod}: cannot enter its network namespace {netns}: {source}")]
    NetNs {
        pod: WorkloadKey,
        netns: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("pod {pod}: cannot listen on {addr}: {source}")]
    Listen {
        pod: WorkloadKey,
        addr: SocketAddr,
        #[source]
        source: std::io::Error,
    },
    #[error("pod {pod} has no IP address")]
    NoIp { pod: WorkloadKey },
    #[error("pod {pod}: IP {ip} is already served for pod {other}")]
    IpTaken {
        pod: WorkloadKey,
        ip: IpAddr,
        other: WorkloadKey,
    },
    #[error("the mesh trust roots are unusable: {0}")]
    Roots(#[from] crate::tls::TlsConfigError),
    #[error("the proxy is draining; no new pods")]
    Draining,
}

/// A snapshot of the proxy's counters.
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ProxyStats {
    pub outbound_hbone: u64,
    pub outbound_passthrough: u64,
    pub inbound_hbone: u64,
    pub inbound_plaintext: u64,
    /// Connections or streams refused (bad input, policy, unknown target).
    pub refused: u64,
    /// Connections that failed after being accepted (upstream errors).
    pub failed: u64,
    /// Bytes from local applications towards peers, and back.
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Connections and streams being served now.
    pub active: usize,
    /// Connections the listeners accepted on each of the data path's shards
    /// (empty without shards).
    #[serde(default)]
    pub accepted_by_shard: Vec<u64>,
    /// HBONE connections in the outbound pools.
    pub pooled_connections: usize,
    /// Refusals by reason (every [`RefusalReason`], zeros included), each
    /// also counted in `refused`, except `accept_failed` and
    /// `handshake_evicted`'s connection, which are counted there once.
    #[serde(default)]
    pub refusals: std::collections::BTreeMap<String, u64>,
    /// Connections to waypoint-bound destinations refused
    /// (`shunt_waypoint_failures_total`), by service or workload and reason.
    #[serde(default)]
    pub waypoint_failures: Vec<WaypointFailureCount>,
    /// Connections refused or closed on a revoked peer chain
    /// (`istio_crl_policy_rejections_total`).
    #[serde(default)]
    pub crl_rejections: ReporterCounts,
    /// Sockets the listeners accepted and since closed, by reporter
    /// (`istio_tcp_sockets_open` is the difference).
    #[serde(default)]
    pub sockets_accepted: ReporterCounts,
    #[serde(default)]
    pub sockets_closed: ReporterCounts,
    /// Pods served now, and pods whose listeners were started and retired
    /// since the proxy started (`workload_manager_*`, ztunnel's names).
    #[serde(default)]
    pub pods_served: usize,
    #[serde(default)]
    pub proxies_started: u64,
    #[serde(default)]
    pub proxies_stopped: u64,
}

/// A count by Istio's `reporter`: this side as the client (`source`,
/// outbound) or the server (`destination`, inbound).
#[derive(Clone, Debug, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ReporterCounts {
    pub source: u64,
    pub destination: u64,
}

/// The proxy. Cheap to clone (shared); all methods take `&self`.
#[derive(Clone)]
pub struct Proxy {
    shared: Arc<Shared>,
}

impl std::fmt::Debug for Proxy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Proxy")
            .field("pods", &self.pods())
            .finish_non_exhaustive()
    }
}

impl Proxy {
    /// A proxy serving no pod yet. The trust roots are read from the
    /// identity manager's CA now.
    pub fn new(
        config: ProxyConfig,
        identities: IdentityManager,
        workloads: Arc<dyn WorkloadLookup>,
        original_dst: Arc<dyn OriginalDst>,
    ) -> Result<Self, ProxyError> {
        let roots =
            TrustRoots::new(&identities.roots())?.with_revocations(config.revocations.clone());
        let limits = limits::Limits::new(config.limits.clone());
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                identities,
                workloads,
                original_dst,
                roots,
                pods: RwLock::new(Default::default()),
                pods_by_ip: RwLock::new(Default::default()),
                tracker: TaskTracker::new(),
                draining: CancellationToken::new(),
                abort: CancellationToken::new(),
                counters: Counters::default(),
                crl_rejections: Default::default(),
                sockets_accepted: Default::default(),
                sockets_closed: Default::default(),
                limits,
                service_picks: AtomicUsize::new(0),
                waypoint_failures: Default::default(),
                observer: OnceLock::new(),
                shards: OnceLock::new(),
                accepted_by_shard: OnceLock::new(),
                dns: OnceLock::new(),
                policy_changes: tokio::sync::watch::Sender::new(0),
                cluster_synced: std::sync::atomic::AtomicBool::new(false),
            }),
        })
    }

    /// The authorization policies changed: every open inbound connection
    /// is checked again, and those now denied are closed (as ztunnel
    /// does).
    pub fn policies_changed(&self) {
        self.shared.policy_changes.send_modify(|n| *n += 1);
    }

    /// The store holds a complete cluster view (workloads and policies)
    /// from now on: inbound connections, refused until then (fail closed,
    /// counted as `not_synced`), are served. ztunnel likewise serves no pod
    /// before its first xDS update.
    pub fn cluster_view_applied(&self) {
        if !self.shared.cluster_synced.swap(true, Ordering::AcqRel) {
            tracing::info!("cluster view applied: inbound connections are served from now on");
        }
    }

    /// Serves the DNS of pods whose DNS is captured ([`PodNet::dns`]) with
    /// these parts from now on. Only the first call counts.
    pub fn set_dns(&self, dns: crate::dns::DnsShared) -> bool {
        self.shared.dns.set(dns).is_ok()
    }

    /// Serves each pod added from now on on one of `shards`, in turn (see
    /// `shards.rs`). Only the first call counts; without one, pods are
    /// served on the runtime `add_pod` runs on.
    pub fn set_shards(&self, shards: crate::shards::Shards) -> bool {
        let counts = (0..shards.len()).map(|_| AtomicU64::new(0)).collect();
        let _ = self.shared.accepted_by_shard.set(counts);
        self.shared.shards.set(shards).is_ok()
    }

    /// Hands every connection's open and close to `observer` from now on.
    /// Only the first observer set is kept; returns whether it was this one.
    pub fn set_observer(&self, observer: Arc<dyn ConnectionObserver>) -> bool {
        self.shared.observer.set(observer).is_ok()
    }

    /// The certificates of the identities the proxy speaks with.
    pub fn identities(&self) -> &IdentityManager {
        &self.shared.identities
    }

    /// Checks peers' chains against `roots` from now on (a root rotation:
    /// [`IdentityManager::reload_roots`]); an unusable set leaves the one
    /// in force.
    pub fn replace_roots(
        &self,
        roots: &[rustls_pki_types::CertificateDer<'_>],
    ) -> Result<(), crate::tls::TlsConfigError> {
        self.shared.roots.replace(roots)
    }

    pub fn stats(&self) -> ProxyStats {
        let c = &self.shared.counters;
        let load = |a: &AtomicU64| a.load(Ordering::Relaxed);
        ProxyStats {
            outbound_hbone: load(&c.outbound_hbone),
            outbound_passthrough: load(&c.outbound_passthrough),
            inbound_hbone: load(&c.inbound_hbone),
            inbound_plaintext: load(&c.inbound_plaintext),
            refused: load(&c.refused),
            failed: load(&c.failed),
            bytes_out: load(&c.bytes_out),
            bytes_in: load(&c.bytes_in),
            active: self.shared.tracker.len(),
            accepted_by_shard: self
                .shared
                .accepted_by_shard
                .get()
                .map(|counts| counts.iter().map(|c| c.load(Ordering::Relaxed)).collect())
                .unwrap_or_default(),
            pooled_connections: self
                .shared
                .all_pods()
                .iter()
                .map(|p| p.pool.connection_count())
                .sum(),
            refusals: self.shared.limits.refusals(),
            waypoint_failures: self.shared.waypoint_failures.snapshot(),
            crl_rejections: self.shared.crl_rejections.snapshot(),
            sockets_accepted: self.shared.sockets_accepted.snapshot(),
            sockets_closed: self.shared.sockets_closed.snapshot(),
            pods_served: self
                .shared
                .pods
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .len(),
            proxies_started: load(&c.proxies_started),
            proxies_stopped: load(&c.proxies_stopped),
        }
    }

    /// Graceful stop: every listener closes at once (a new agent bound with
    /// SO_REUSEPORT takes the new connections), HTTP/2 connections send
    /// GOAWAY, and streams in flight get `grace` to finish before being cut.
    /// Returns how many were still open when the grace period ended.
    pub async fn drain(&self, grace: Duration) -> usize {
        let started = Instant::now();
        self.shared.draining.cancel();
        self.shared.tracker.close();
        let open = self.shared.tracker.len();
        tracing::info!(open, ?grace, "draining");
        let finished = crate::timers::timeout(grace, self.shared.tracker.wait())
            .await
            .is_ok();
        let left = if finished {
            0
        } else {
            self.shared.tracker.len()
        };
        self.shared.abort.cancel();
        // Cut streams end promptly (they watch `abort`); bounded anyway.
        let _ = crate::timers::timeout(Duration::from_secs(5), self.shared.tracker.wait()).await;
        // The pods' identities stay registered until the process exits: a
        // connection accepted in the instant the listeners were cancelled
        // still gets its certificate (unregistering here failed one such
        // outbound in a surge handover).
        self.shared
            .pods
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        self.shared
            .pods_by_ip
            .write()
            .unwrap_or_else(|p| p.into_inner())
            .clear();
        tracing::info!(left, took = ?started.elapsed(), "drained");
        left
    }
}

/// Resolves when a policy change (seen through `changes`, subscribed
/// before the connection was first checked) denies `connection` to `pod`:
/// the new decision. Never resolves otherwise.
pub(crate) async fn revoked(
    shared: &Shared,
    mut changes: tokio::sync::watch::Receiver<u64>,
    pod: &WorkloadKey,
    connection: crate::authz::Connection<'_>,
) -> Decision {
    while changes.changed().await.is_ok() {
        let decision = authorize(shared.workloads.as_ref(), pod, &connection);
        if let Decision::Deny { reason, policy } = decision {
            return Decision::Deny {
                reason: format!("closed: the policies changed and now deny it ({reason})"),
                policy,
            };
        }
    }
    std::future::pending().await
}

/// Resolves once `cut` is cancelled: a reloaded revocation list revoked the
/// peer of the HBONE connection a stream rides on, which is closed next
/// (the stream's line and metrics then say `CERT_REVOKED`, as ztunnel's);
/// never without one (no `--crl-path`).
pub(crate) async fn cut_by_revocation(cut: Option<&CancellationToken>) {
    match cut {
        Some(cut) => cut.cancelled().await,
        None => std::future::pending().await,
    }
}

/// The access-log reason of a stream [`cut_by_revocation`].
pub(crate) const CERT_REVOKED: &str =
    "closed: a reloaded revocation list revokes the HBONE connection's peer certificate";

/// Makes `stream` close with RST, so the other side sees a failure rather
/// than a clean EOF.
pub(crate) fn reset(stream: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

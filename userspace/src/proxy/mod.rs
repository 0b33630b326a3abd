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

mod accept;
mod access_log;
mod dns_sockets;
mod h2;
mod h2_refusals;
mod inbound;
mod inbound_plaintext;
mod limits;
mod observe;
mod outbound;
mod policy;
mod pool;
mod relay;
mod socket;
pub mod waypoint;

pub use h2::H2Settings;
pub use inbound::NON_CONNECT_STATUS;
pub use limits::{
    DEFAULT_MAX_CONNECTIONS_PER_SOURCE, LimitsConfig, MAX_CONCURRENT_STREAMS, OpenFiles,
    RefusalReason, fd_reserve_now, open_files_limit, raise_open_files_limit,
};
pub use observe::{
    ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome, Direction,
};
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
    collections::HashMap,
    net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr},
    path::PathBuf,
    sync::{
        Arc, OnceLock, RwLock,
        atomic::{AtomicU64, AtomicUsize, Ordering},
    },
    time::{Duration, Instant},
};

use accept::{Listener, accept_loop};
pub(crate) use access_log::{AccessLog, Outcome};
use shunt_common::{PORT_HBONE, PORT_INBOUND_PLAINTEXT, PORT_OUTBOUND};
use tokio_util::{sync::CancellationToken, task::TaskTracker};

use crate::{
    identity::IdentityManager,
    redirect::OriginalDst,
    state::{Service, SpiffeId, TrustDomain, Workload, WorkloadKey},
    store::WorkloadStore,
    tls::TrustRoots,
};

/// The proxy's own ports: a CONNECT or redirect to one of them would loop.
pub const PROXY_PORTS: [u16; 3] = [PORT_OUTBOUND, PORT_INBOUND_PLAINTEXT, PORT_HBONE];

/// Tuning of the proxy. `Default` is what the agent runs with.
#[derive(Clone, Debug)]
pub struct ProxyConfig {
    pub trust_domain: TrustDomain,
    pub h2: H2Settings,
    /// Copy buffer per direction per connection. 64 KiB: tokio's default
    /// 8 KiB capped throughput in measurements (DESIGN); more costs memory
    /// per stream for little gain.
    pub copy_buffer: usize,
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
}

impl Default for ProxyConfig {
    fn default() -> Self {
        Self {
            trust_domain: TrustDomain::default(),
            h2: H2Settings::default(),
            copy_buffer: 64 * 1024,
            connect_timeout: Duration::from_secs(10),
            handshake_timeout: Duration::from_secs(10),
            connect_response_timeout: Duration::from_secs(15),
            pool_idle_timeout: Duration::from_secs(60),
            inbound_plaintext: InboundPlaintextPolicy::default(),
            preserve_source: false,
            limits: LimitsConfig::default(),
        }
    }
}

/// Where the proxy learns which workload owns an IP (for the destination's
/// identity and whether it is in the mesh), and which service a VIP is.
pub trait WorkloadLookup: Send + Sync {
    fn workload_by_ip(&self, ip: IpAddr) -> Option<Workload>;

    /// The service whose cluster IP and port `dst` is.
    fn service_at(&self, dst: SocketAddr) -> Option<Arc<Service>>;

    /// Checks `connection` to the local workload `dst` against the
    /// authorization policies.
    fn authorize(
        &self,
        dst: &WorkloadKey,
        connection: &crate::authz::Connection<'_>,
    ) -> crate::authz::Verdict;

    /// How the local pod `source` (at `client`) reaches `dst`: through a
    /// waypoint or not (`waypoint.rs`), and its `baggage`. `pick` spreads
    /// connections over a waypoint's replicas.
    fn waypoint_plan(
        &self,
        trust_domain: &TrustDomain,
        source: &WorkloadKey,
        client: IpAddr,
        dst: SocketAddr,
        pick: usize,
    ) -> waypoint::Plan;
}

impl WorkloadLookup for RwLock<WorkloadStore> {
    fn workload_by_ip(&self, ip: IpAddr) -> Option<Workload> {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .by_ip(ip)
            .cloned()
    }

    fn service_at(&self, dst: SocketAddr) -> Option<Arc<Service>> {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .services()
            .by_addr(dst)
            .cloned()
    }

    fn authorize(
        &self,
        dst: &WorkloadKey,
        connection: &crate::authz::Connection<'_>,
    ) -> crate::authz::Verdict {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        let policies = store.policies();
        match store.get(dst) {
            Some(workload) => policies.check(connection, crate::authz::Destination::of(workload)),
            // Served but gone from the store (a removal in flight): what
            // its namespace's and the mesh's policies say.
            None => {
                let labels = std::collections::BTreeMap::new();
                let destination = crate::authz::Destination {
                    namespace: &dst.namespace,
                    labels: &labels,
                    authorization_policies: &[],
                };
                policies.check(connection, destination)
            }
        }
    }

    fn waypoint_plan(
        &self,
        trust_domain: &TrustDomain,
        source: &WorkloadKey,
        client: IpAddr,
        dst: SocketAddr,
        pick: usize,
    ) -> waypoint::Plan {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        waypoint::plan(&store, trust_domain, source, client, dst, pick)
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

/// Counters since start (read with [`Proxy::stats`]).
#[derive(Debug, Default)]
struct Counters {
    outbound_hbone: AtomicU64,
    outbound_passthrough: AtomicU64,
    inbound_hbone: AtomicU64,
    inbound_plaintext: AtomicU64,
    refused: AtomicU64,
    failed: AtomicU64,
    bytes_out: AtomicU64,
    bytes_in: AtomicU64,
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
}

impl PodState {
    /// Connects to this pod's application at `dst` for a client at
    /// `client`: from the client's address when
    /// [`ProxyConfig::preserve_source`] is on (so the application sees
    /// its real peer, as with ztunnel), else from the pod's own address.
    /// A client address that cannot be bound falls back to the pod's own,
    /// logged once per pod with the reason.
    pub async fn connect_app(
        &self,
        config: &ProxyConfig,
        dst: SocketAddr,
        client: SocketAddr,
    ) -> std::io::Result<tokio::net::TcpStream> {
        // The pod's own address needs nothing special (a pod reaching itself
        // through the mesh).
        if !config.preserve_source || self.ips.contains(&client.ip()) {
            return self.sockets.connect(dst, config.connect_timeout).await;
        }
        match self
            .sockets
            .connect_transparent(dst, client.ip(), client.port(), config.connect_timeout)
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
    pods: RwLock<HashMap<WorkloadKey, Arc<PodState>>>,
    pods_by_ip: RwLock<HashMap<IpAddr, Arc<PodState>>>,
    /// Every connection and stream task, for draining.
    pub tracker: TaskTracker,
    /// Cancelled when draining starts: listeners stop, HTTP/2 connections
    /// send GOAWAY.
    pub draining: CancellationToken,
    /// Cancelled when the drain grace period ends: everything stops.
    pub abort: CancellationToken,
    counters: Counters,
    /// Per-source and fd limits on inbound connections; refusals by reason.
    pub(crate) limits: limits::Limits,
    /// Connections to service VIPs so far: which endpoint the next one gets
    /// (round robin; one counter for every service is enough to spread the
    /// load, and costs no per-service state).
    service_picks: AtomicUsize,
    /// Refused connections to waypoint-bound destinations.
    pub(crate) waypoint_failures: waypoint::WaypointFailures,
    /// Told about every connection (metrics); set once, see
    /// [`Proxy::set_observer`].
    observer: OnceLock<Arc<dyn ConnectionObserver>>,
    /// The DNS server's shared parts (names, upstreams, metrics):
    /// [`Proxy::set_dns`]. Unset: a pod's DNS proxy is not bound.
    dns: OnceLock<crate::dns::DnsShared>,
    /// Bumped by [`Proxy::policies_changed`]: open inbound connections
    /// re-check their authorization.
    pub policy_changes: tokio::sync::watch::Sender<u64>,
}

impl Shared {
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

    fn all_pods(&self) -> Vec<Arc<PodState>> {
        self.pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .values()
            .cloned()
            .collect()
    }
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
        let roots = TrustRoots::new(&identities.roots())?;
        let limits = limits::Limits::new(config.limits.clone());
        Ok(Self {
            shared: Arc::new(Shared {
                config,
                identities,
                workloads,
                original_dst,
                roots,
                pods: RwLock::new(HashMap::new()),
                pods_by_ip: RwLock::new(HashMap::new()),
                tracker: TaskTracker::new(),
                draining: CancellationToken::new(),
                abort: CancellationToken::new(),
                counters: Counters::default(),
                limits,
                service_picks: AtomicUsize::new(0),
                waypoint_failures: Default::default(),
                observer: OnceLock::new(),
                dns: OnceLock::new(),
                policy_changes: tokio::sync::watch::Sender::new(0),
            }),
        })
    }

    /// Starts serving `pod`: binds 127.0.0.1:15001, 0.0.0.0:15006 and
    /// podIP:15008 inside its netns — and [::1]:15001 and [::]:15006 where
    /// the netns has IPv6 — and registers its identity. Adding a pod that is
    /// already served replaces it (new listeners first, then the old ones
    /// stop).
    pub async fn add_pod(&self, pod: PodNet) -> Result<(), ProxyError> {
        if self.shared.draining.is_cancelled() {
            return Err(ProxyError::Draining);
        }
        if pod.ips.is_empty() {
            return Err(ProxyError::NoIp { pod: pod.key });
        }
        {
            let by_ip = self
                .shared
                .pods_by_ip
                .read()
                .unwrap_or_else(|p| p.into_inner());
            for ip in &pod.ips {
                if let Some(other) = by_ip.get(ip).filter(|o| o.key != pod.key) {
                    return Err(ProxyError::IpTaken {
                        pod: pod.key.clone(),
                        ip: *ip,
                        other: other.key.clone(),
                    });
                }
            }
        }
        let sockets =
            socket::PodSockets::start(&pod.netns).map_err(|source| ProxyError::NetNs {
                pod: pod.key.clone(),
                netns: pod.netns.clone(),
                source,
            })?;
        let spec = |kind, ip: IpAddr, port, transparent| {
            let addr = SocketAddr::new(ip, port);
            (kind, socket::ListenSpec { addr, transparent })
        };
        let mut specs = vec![
            spec(
                Listener::Outbound,
                Ipv4Addr::LOCALHOST.into(),
                PORT_OUTBOUND,
                false,
            ),
            spec(
                Listener::InboundPlaintext,
                Ipv4Addr::UNSPECIFIED.into(),
                PORT_INBOUND_PLAINTEXT,
                true,
            ),
        ];
        let ipv6 = [
            spec(
                Listener::Outbound,
                Ipv6Addr::LOCALHOST.into(),
                PORT_OUTBOUND,
                false,
            ),
            spec(
                Listener::InboundPlaintext,
                Ipv6Addr::UNSPECIFIED.into(),
                PORT_INBOUND_PLAINTEXT,
                true,
            ),
        ];
        for ip in &pod.ips {
            specs.push(spec(Listener::Hbone, *ip, PORT_HBONE, false));
        }
        let mut listeners = Vec::with_capacity(specs.len());
        for (kind, spec) in specs {
            let listener = sockets
                .listen(spec)
                .await
                .map_err(|source| ProxyError::Listen {
                    pod: pod.key.clone(),
                    addr: spec.addr,
                    source,
                })?;
            listeners.push((kind, listener));
        }
        // Native IPv6 connects are redirected to [::1]:15001 (connect6,
        // ip6tables); without these listeners they would be failed closed.
        // A netns without IPv6 (disabled, or no ::1 on lo) has no such
        // traffic to catch.
        for (kind, spec) in ipv6 {
            match sockets.listen(spec).await {
                Ok(listener) => listeners.push((kind, listener)),
                Err(e) if no_ipv6(&e) => {
                    tracing::info!(pod = %pod.key, addr = %spec.addr, error = %e, "no IPv6 in the pod's netns; serving IPv4 only");
                    break;
                }
                Err(source) => {
                    return Err(ProxyError::Listen {
                        pod: pod.key.clone(),
                        addr: spec.addr,
                        source,
                    });
                }
            }
        }

        // Bound before the redirector sends the pod's DNS here; stopped
        // with the pod's listeners.
        let listeners_token = self.shared.draining.child_token();
        if pod.dns {
            dns_sockets::start(
                self.shared.dns.get(),
                &sockets,
                &pod.key,
                listeners_token.clone(),
            )
            .await?;
        }
        self.shared.identities.register(&pod.identity);
        let state = Arc::new(PodState {
            key: pod.key.clone(),
            identity: pod.identity.clone(),
            ips: pod.ips.clone(),
            sockets,
            pool: pool::Pool::new(),
            listeners: listeners_token,
            source_warned: Default::default(),
            dns: pod.dns,
        });
        for (kind, listener) in listeners {
            let shared = self.shared.clone();
            let pod = state.clone();
            tokio::spawn(accept_loop(shared, pod, kind, listener));
        }
        let old = {
            let mut pods = self.shared.pods.write().unwrap_or_else(|p| p.into_inner());
            let mut by_ip = self
                .shared
                .pods_by_ip
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let old = pods.insert(pod.key.clone(), state.clone());
            if let Some(old) = &old {
                for ip in &old.ips {
                    by_ip.remove(ip);
                }
            }
            for ip in &pod.ips {
                by_ip.insert(*ip, state.clone());
            }
            old
        };
        if let Some(old) = old {
            retire(&self.shared, &old);
        }
        tracing::info!(pod = %pod.key, identity = %pod.identity, ips = ?pod.ips, "proxy serving pod");
        Ok(())
    }

    /// Stops serving the pod: its listeners close; streams in flight finish.
    /// Returns whether the pod was served.
    pub fn remove_pod(&self, key: &WorkloadKey) -> bool {
        let removed = {
            let mut pods = self.shared.pods.write().unwrap_or_else(|p| p.into_inner());
            let mut by_ip = self
                .shared
                .pods_by_ip
                .write()
                .unwrap_or_else(|p| p.into_inner());
            let removed = pods.remove(key);
            if let Some(pod) = &removed {
                for ip in &pod.ips {
                    if by_ip.get(ip).is_some_and(|p| Arc::ptr_eq(p, pod)) {
                        by_ip.remove(ip);
                    }
                }
            }
            removed
        };
        match removed {
            Some(pod) => {
                retire(&self.shared, &pod);
                tracing::info!(pod = %key, "proxy stopped serving pod");
                true
            }
            None => false,
        }
    }

    /// Whether the proxy serves `key`.
    pub fn serves(&self, key: &WorkloadKey) -> bool {
        self.shared
            .pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .contains_key(key)
    }

    /// Whether `key` is served with its DNS proxy (false when not served).
    pub fn serves_dns(&self, key: &WorkloadKey) -> bool {
        self.shared
            .pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .get(key)
            .is_some_and(|pod| pod.dns)
    }

    /// The pods being served, sorted.
    pub fn pods(&self) -> Vec<WorkloadKey> {
        let mut keys: Vec<_> = self
            .shared
            .pods
            .read()
            .unwrap_or_else(|p| p.into_inner())
            .keys()
            .cloned()
            .collect();
        keys.sort();
        keys
    }

    /// The authorization policies changed: every open inbound connection
    /// is checked again, and those now denied are closed (as ztunnel
    /// does).
    pub fn policies_changed(&self) {
        self.shared.policy_changes.send_modify(|n| *n += 1);
    }

    /// Serves the DNS of pods whose DNS is captured ([`PodNet::dns`]) with
    /// these parts from now on. Only the first call counts.
    pub fn set_dns(&self, dns: crate::dns::DnsShared) -> bool {
        self.shared.dns.set(dns).is_ok()
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
            pooled_connections: self
                .shared
                .all_pods()
                .iter()
                .map(|p| p.pool.connection_count())
                .sum(),
            refusals: self.shared.limits.refusals(),
            waypoint_failures: self.shared.waypoint_failures.snapshot(),
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
        let finished = tokio::time::timeout(grace, self.shared.tracker.wait())
            .await
            .is_ok();
        let left = if finished {
            0
        } else {
            self.shared.tracker.len()
        };
        self.shared.abort.cancel();
        // Cut streams end promptly (they watch `abort`); bounded anyway.
        let _ = tokio::time::timeout(Duration::from_secs(5), self.shared.tracker.wait()).await;
        for pod in self.shared.all_pods() {
            self.shared.identities.unregister(&pod.identity);
        }
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

/// Stops a replaced or removed pod's listeners and releases its identity.
fn retire(shared: &Shared, pod: &PodState) {
    pod.listeners.cancel();
    shared.identities.unregister(&pod.identity);
}

/// The errors binding an IPv6 address gives where the netns (or the
/// kernel) has no IPv6.
fn no_ipv6(e: &std::io::Error) -> bool {
    matches!(
        e.raw_os_error(),
        Some(libc::EAFNOSUPPORT) | Some(libc::EADDRNOTAVAIL)
    )
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

/// Copies both ways until both directions are done, honouring half-close
/// (EOF on one side shuts down the other side's write half). Returns the
/// bytes a→b and b→a, or the error with the counts so far unknown.
pub(crate) async fn copy_both<A, B>(
    a: &mut A,
    b: &mut B,
    buffer: usize,
) -> std::io::Result<(u64, u64)>
where
    A: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized,
    B: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin + ?Sized,
{
    tokio::io::copy_bidirectional_with_sizes(a, b, buffer, buffer).await
}

/// Makes `stream` close with RST, so the other side sees a failure rather
/// than a clean EOF.
pub(crate) fn reset(stream: &tokio::net::TcpStream) {
    let _ = socket2::SockRef::from(stream).set_linger(Some(Duration::ZERO));
}

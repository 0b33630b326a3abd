//! The DNS proxy's server (ztunnel's DNS proxy is the model; see
//! docs/DNS.md): each enrolled pod's DNS queries are answered from the
//! names the mesh knows, and forwarded to the upstream resolvers otherwise.
//!
//! Capture (port 53 to `127.0.0.1:15053` / `[::1]:15053`) and the per-pod
//! lifecycle are not here: the caller binds each pod's sockets inside the
//! pod's network namespace and hands them to [`serve`].
//!
//! # The API
//!
//! ```ignore
//! // Once per agent (app/): the names, fed by the store owner; the
//! // upstreams; the metrics (registered in the agent's registry).
//! let names: watch::Receiver<Arc<MeshNames>> = ...;    // app's DnsShared
//! let forwarder = Arc::new(Forwarder::from_resolv_conf(path, timeout)?);
//! let metrics: Arc<DnsMetrics> = agent_metrics.dns().clone();
//!
//! // Per enrolled pod, inside its netns:
//! let sockets = DnsSockets::bind(&[
//!     "127.0.0.1:15053".parse()?, "[::1]:15053".parse()?,
//! ])?;
//! let pod = PodDns::kubernetes("default", "cluster.local")
//!     .with_canonical("web", "v1");
//! let server: DnsServerHandle = serve(sockets, pod, names.clone(),
//!                                     forwarder.clone(), metrics.clone())?;
//! // ... the pod leaves:
//! server.shutdown().await;   // or drop(server): both close the sockets
//! ```
//!
//! - [`serve`] must be called inside a tokio runtime (an error otherwise);
//!   the sockets may be bound in any namespace: a socket keeps the
//!   namespace it was created in.
//! - [`MeshNames`] maps Services (`<svc>.<ns>.svc.<domain>` or their xDS
//!   `hostname`) → VIPs (a Kubernetes headless service: its ready
//!   endpoints), workloads with a `hostname` → their IPs. Built by
//!   [`MeshNames::build`] from the store; [`names::publish_names`] is the
//!   one task that publishes it, fed by the store owner (`app/`).
//! - [`PodDns`] holds the pod's namespace (short names), search domains (the
//!   kubelet's ClusterFirst list by default) and canonical name and
//!   revision (metrics labels).
//! - [`Forwarder`] holds the upstreams (a resolv.conf's `nameserver`s) and the
//!   timeout; an unanswered query gets SERVFAIL within it.
//! - [`DnsMetrics`] counts `istio_dns_requests_total`,
//!   `istio_dns_upstream_requests_total`,
//!   `istio_dns_upstream_failures_total`,
//!   `istio_dns_upstream_request_duration_seconds`, labelled as ztunnel
//!   labels them.

// Timers come from `crate::timers` here: this runs on a runtime without a
// time driver (userspace/clippy.toml).
#![cfg_attr(not(test), warn(clippy::disallowed_methods))]

mod answer;
pub mod forward;
pub mod metrics;
pub mod names;
pub mod on_demand;
pub mod resolv_conf;
mod server;

use std::{io, net::SocketAddr, path::PathBuf, sync::Arc};

use tokio::{sync::watch, task::JoinHandle};
use tokio_util::sync::CancellationToken;

pub use forward::{DEFAULT_UPSTREAM_TIMEOUT, ForwardError, Forwarder, UpstreamSockets};
pub use metrics::DnsMetrics;
pub use names::{MeshNames, names_channel, publish_names};
pub use on_demand::{OnDemandResolver, ResolveError};
pub use resolv_conf::ResolvConf;

/// The port a pod's DNS is captured to (Istio's).
pub const DNS_CAPTURE_PORT: u16 = 15053;
/// The TTL of the answers for mesh names (ztunnel's).
pub const DNS_TTL: u32 = 30;

#[derive(Debug, thiserror::Error)]
pub enum DnsError {
    #[error("reading resolv.conf {path}: {source}")]
    ResolvConf {
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("the resolver for hostname endpoints: {0}")]
    Resolver(String),
    #[error("DNS socket {what}: {source}")]
    Socket {
        what: String,
        #[source]
        source: io::Error,
    },
    #[error("no DNS socket to serve")]
    NoSockets,
    #[error("the DNS server needs a tokio runtime")]
    NoRuntime,
}

/// What every pod's server shares, built once by `app/`: the names (fed
/// by the store owner), the upstreams, the metrics. The per-pod lifecycle
/// passes clones of each to [`serve`].
#[derive(Clone, Debug)]
pub struct DnsShared {
    pub names: watch::Receiver<Arc<MeshNames>>,
    pub forwarder: Arc<Forwarder>,
    pub metrics: Arc<DnsMetrics>,
    /// Resolves the service endpoints istiod names by DNS name
    /// (`on_demand.rs`); the outbound proxy's, not the pods' DNS servers'.
    pub on_demand: Arc<OnDemandResolver>,
}

/// `--dns-upstream-timeout`: `5s`, `500ms`, or a bare number of seconds;
/// more than zero.
pub fn parse_timeout(value: &str) -> Result<std::time::Duration, String> {
    let value = value.trim();
    let (number, millis) = if let Some(ms) = value.strip_suffix("ms") {
        (ms, true)
    } else {
        (value.strip_suffix('s').unwrap_or(value), false)
    };
    let n: u64 = number
        .trim()
        .parse()
        .map_err(|_| format!("{value:?} is not a duration like 5s or 500ms"))?;
    let timeout = if millis {
        std::time::Duration::from_millis(n)
    } else {
        std::time::Duration::from_secs(n)
    };
    if timeout.is_zero() {
        return Err("the DNS upstream timeout must be more than zero".into());
    }
    Ok(timeout)
}

/// The sockets one pod's server answers on, bound by the caller (in the
/// pod's netns): UDP sockets and TCP listeners, v4 and/or v6.
#[derive(Debug, Default)]
pub struct DnsSockets {
    pub udp: Vec<std::net::UdpSocket>,
    pub tcp: Vec<std::net::TcpListener>,
}

/// How many UDP ports a port-0 bind tries before it gives up on finding
/// one whose TCP twin is free.
const PORT_0_ATTEMPTS: usize = 32;

impl DnsSockets {
    /// A UDP socket and a TCP listener on each of `addrs`, in the calling
    /// thread's network namespace. Port 0 binds TCP to the port UDP got.
    pub fn bind(addrs: &[SocketAddr]) -> Result<Self, DnsError> {
        let mut sockets = DnsSockets::default();
        for addr in addrs {
            let (udp, tcp) = bind_pair(*addr)?;
            sockets.udp.push(udp);
            sockets.tcp.push(tcp);
        }
        Ok(sockets)
    }
}

/// A UDP socket and a TCP listener on one address. With port 0 the kernel
/// picks UDP's port from the ephemeral range, where some TCP socket may
/// already hold the same number: that port is given back and another
/// tried, a bounded number of times.
fn bind_pair(addr: SocketAddr) -> Result<(std::net::UdpSocket, std::net::TcpListener), DnsError> {
    let attempts = if addr.port() == 0 { PORT_0_ATTEMPTS } else { 1 };
    let mut attempt = 0;
    loop {
        attempt += 1;
        let udp = std::net::UdpSocket::bind(addr).map_err(|source| DnsError::Socket {
            what: format!("bind udp {addr}"),
            source,
        })?;
        let bound = udp.local_addr().map_err(|source| DnsError::Socket {
            what: format!("udp {addr}"),
            source,
        })?;
        match std::net::TcpListener::bind(bound) {
            Ok(tcp) => return Ok((udp, tcp)),
            Err(e) if e.kind() == io::ErrorKind::AddrInUse && attempt < attempts => continue,
            Err(source) => {
                return Err(DnsError::Socket {
                    what: format!("bind tcp {bound} (attempt {attempt} of {attempts})"),
                    source,
                });
            }
        }
    }
}

/// Who is asking: one pod.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PodDns {
    /// The pod's namespace: `web` means `web.<namespace>.svc.<domain>`.
    pub namespace: String,
    /// The pod's name: its canonical service (metrics labels) is looked up
    /// by it in the published names; empty: not known.
    pub name: String,
    /// The search domains of the pod's resolv.conf, in order (no trailing
    /// dots): a query name ending in one may be a name plus it.
    pub search: Vec<String>,
    /// `service.istio.io/canonical-name` / `-revision` of the pod (metrics
    /// labels) when the published names do not know the pod; empty:
    /// `unknown`.
    pub canonical_name: String,
    pub canonical_revision: String,
}

impl PodDns {
    /// A pod with the kubelet's `ClusterFirst` search list:
    /// `<ns>.svc.<domain> svc.<domain> <domain>`.
    pub fn kubernetes(namespace: &str, cluster_domain: &str) -> Self {
        let domain = cluster_domain.trim_end_matches('.');
        Self {
            namespace: namespace.to_string(),
            search: vec![
                format!("{namespace}.svc.{domain}"),
                format!("svc.{domain}"),
                domain.to_string(),
            ],
            ..Self::default()
        }
    }

    /// Names the pod, so its metrics carry its canonical service from the
    /// store (see [`MeshNames::canonical`]).
    pub fn for_pod(mut self, name: &str) -> Self {
        self.name = name.to_string();
        self
    }

    pub fn with_canonical(mut self, name: &str, revision: &str) -> Self {
        self.canonical_name = name.to_string();
        self.canonical_revision = revision.to_string();
        self
    }
}

/// A running server. Dropping it stops it (its tasks are aborted, which
/// closes its sockets); [`DnsServerHandle::shutdown`] stops it and waits
/// until every socket is closed.
#[derive(Debug)]
pub struct DnsServerHandle {
    stop: CancellationToken,
    tasks: Vec<JoinHandle<()>>,
    udp: Vec<SocketAddr>,
    tcp: Vec<SocketAddr>,
}

impl DnsServerHandle {
    /// Where the UDP sockets are bound.
    pub fn udp_addrs(&self) -> &[SocketAddr] {
        &self.udp
    }

    /// Where the TCP listeners are bound.
    pub fn tcp_addrs(&self) -> &[SocketAddr] {
        &self.tcp
    }

    /// Stops serving and returns once every socket is closed (queries in
    /// flight are abandoned: their clients retry).
    pub async fn shutdown(mut self) {
        self.stop.cancel();
        for task in std::mem::take(&mut self.tasks) {
            let _ = task.await;
        }
    }
}

impl Drop for DnsServerHandle {
    fn drop(&mut self) {
        self.stop.cancel();
        for task in &self.tasks {
            task.abort();
        }
    }
}

/// Serves one pod's DNS on `sockets` until the handle is dropped or shut
/// down: A/AAAA for the names in `names` (the latest published, read per
/// query), everything else through `forwarder`, counted in `metrics`.
pub fn serve(
    sockets: DnsSockets,
    pod: PodDns,
    names: watch::Receiver<Arc<MeshNames>>,
    forwarder: Arc<Forwarder>,
    metrics: Arc<DnsMetrics>,
) -> Result<DnsServerHandle, DnsError> {
    if sockets.udp.is_empty() && sockets.tcp.is_empty() {
        return Err(DnsError::NoSockets);
    }
    let runtime = tokio::runtime::Handle::try_current().map_err(|_| DnsError::NoRuntime)?;
    let socket_err = |what: &str, source| DnsError::Socket {
        what: what.to_string(),
        source,
    };
    // Everything converted before anything is spawned: an error leaves no
    // half-started server.
    let mut udp = Vec::new();
    let mut udp_addrs = Vec::new();
    for socket in sockets.udp {
        socket
            .set_nonblocking(true)
            .map_err(|e| socket_err("udp nonblocking", e))?;
        udp_addrs.push(socket.local_addr().map_err(|e| socket_err("udp", e))?);
        let _guard = runtime.enter();
        udp.push(tokio::net::UdpSocket::from_std(socket).map_err(|e| socket_err("udp", e))?);
    }
    let mut tcp = Vec::new();
    let mut tcp_addrs = Vec::new();
    for listener in sockets.tcp {
        listener
            .set_nonblocking(true)
            .map_err(|e| socket_err("tcp nonblocking", e))?;
        tcp_addrs.push(listener.local_addr().map_err(|e| socket_err("tcp", e))?);
        let _guard = runtime.enter();
        tcp.push(tokio::net::TcpListener::from_std(listener).map_err(|e| socket_err("tcp", e))?);
    }
    let handler = Arc::new(answer::Handler {
        pod,
        names,
        forwarder,
        metrics,
    });
    let stop = CancellationToken::new();
    let mut tasks = Vec::new();
    for socket in udp {
        tasks.push(runtime.spawn(server::serve_udp(socket, handler.clone(), stop.clone())));
    }
    for listener in tcp {
        tasks.push(runtime.spawn(server::serve_tcp(listener, handler.clone(), stop.clone())));
    }
    Ok(DnsServerHandle {
        stop,
        tasks,
        udp: udp_addrs,
        tcp: tcp_addrs,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn timeouts_in_seconds_or_milliseconds() {
        assert_eq!(parse_timeout("5s"), Ok(Duration::from_secs(5)));
        assert_eq!(parse_timeout("7"), Ok(Duration::from_secs(7)));
        assert_eq!(parse_timeout("250ms"), Ok(Duration::from_millis(250)));
        assert!(parse_timeout("0s").is_err());
        assert!(parse_timeout("soon").is_err());
    }

    #[test]
    fn the_kubelets_search_list() {
        let pod = PodDns::kubernetes("shop", "cluster.local.");
        assert_eq!(
            pod.search,
            [
                "shop.svc.cluster.local",
                "svc.cluster.local",
                "cluster.local"
            ]
        );
    }

    #[test]
    fn serving_needs_sockets_and_a_runtime() {
        let (_tx, names) = names_channel("cluster.local");
        let forwarder = Arc::new(Forwarder::new(Vec::new(), DEFAULT_UPSTREAM_TIMEOUT));
        let metrics = Arc::new(DnsMetrics::default());
        let err = serve(
            DnsSockets::default(),
            PodDns::default(),
            names.clone(),
            forwarder.clone(),
            metrics.clone(),
        )
        .expect_err("no sockets");
        assert!(matches!(err, DnsError::NoSockets), "{err}");
        let sockets = DnsSockets::bind(&["127.0.0.1:0".parse().expect("addr")]).expect("bind");
        let err = serve(sockets, PodDns::default(), names, forwarder, metrics)
            .expect_err("outside a runtime");
        assert!(matches!(err, DnsError::NoRuntime), "{err}");
    }

    /// Port 0 gets UDP a port from the ephemeral range, which TCP sockets
    /// share: with hundreds of TCP ports held, some UDP port chosen is one
    /// of them, and the bind must try another rather than fail.
    #[test]
    fn port_0_binds_udp_and_tcp_to_one_port_even_where_tcp_ports_are_taken() {
        let any: SocketAddr = "127.0.0.1:0".parse().expect("addr");
        let held: Vec<std::net::TcpListener> = (0..400)
            .filter_map(|_| std::net::TcpListener::bind(any).ok())
            .collect();
        assert!(held.len() > 300, "only {} TCP ports held", held.len());
        for round in 0..600 {
            let sockets = DnsSockets::bind(&[any]).unwrap_or_else(|e| panic!("round {round}: {e}"));
            let udp = sockets.udp[0].local_addr().expect("udp addr");
            let tcp = sockets.tcp[0].local_addr().expect("tcp addr");
            assert_eq!(udp, tcp, "round {round}");
        }
    }

    #[test]
    fn a_fixed_port_taken_by_tcp_is_an_error_naming_it() {
        let taken = std::net::TcpListener::bind("127.0.0.1:0").expect("listener");
        let addr = taken.local_addr().expect("addr");
        match DnsSockets::bind(&[addr]) {
            Ok(_) => panic!("bound {addr} while a TCP listener holds it"),
            Err(e) => assert!(e.to_string().contains(&format!("bind tcp {addr}")), "{e}"),
        }
    }
}

//! The proxy's one hook for observers (metrics): told when a connection (or
//! an HBONE stream) opens and when it closes, with who talked to whom and
//! how many bytes went each way. The proxy knows nothing about what the
//! observer does with it; the access log line is written either way.

use std::{net::SocketAddr, time::Duration};

use crate::state::WorkloadKey;

/// Which path through the proxy a connection took.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Direction {
    /// A local pod's connect, carried as HBONE to a mesh peer.
    Outbound,
    /// A local pod's connect to a destination outside the mesh, plain TCP.
    Passthrough,
    /// An HBONE stream from a peer to a local pod.
    Inbound,
    /// A plaintext connection from outside the mesh to a local pod.
    InboundPlaintext,
    /// A local pod's connect to a mesh pod of the same node, carried in the
    /// kernel without the proxy (the fast path's flow 2), as its source
    /// reports it.
    KernelOutbound,
    /// The same connection as its destination reports it.
    KernelInbound,
}

impl Direction {
    pub fn as_str(self) -> &'static str {
        match self {
            Direction::Outbound => "outbound",
            Direction::Passthrough => "passthrough",
            Direction::Inbound => "inbound",
            Direction::InboundPlaintext => "inbound_plaintext",
            Direction::KernelOutbound => "outbound",
            Direction::KernelInbound => "inbound",
        }
    }

    /// Whether the local pod is the connection's source (else its target).
    pub fn local_is_source(self) -> bool {
        matches!(
            self,
            Direction::Outbound | Direction::Passthrough | Direction::KernelOutbound
        )
    }

    /// Whether the bytes crossed the network inside mutual TLS.
    pub fn mutual_tls(self) -> bool {
        matches!(self, Direction::Outbound | Direction::Inbound)
    }

    /// Istio's `connection_security_policy`: `mutual_tls` inside HBONE;
    /// `none` for a same-node mesh connection the kernel carried (known
    /// plaintext, between two pods of one node, never on a link);
    /// `unknown` for plaintext to or from outside the mesh, as the proxy
    /// has always labelled it.
    pub fn security_policy(self) -> &'static str {
        match self {
            Direction::Outbound | Direction::Inbound => "mutual_tls",
            Direction::KernelOutbound | Direction::KernelInbound => "none",
            Direction::Passthrough | Direction::InboundPlaintext => "unknown",
        }
    }

    pub(crate) fn from_log(direction: &str) -> Self {
        match direction {
            "outbound" => Direction::Outbound,
            "passthrough" => Direction::Passthrough,
            "inbound" => Direction::Inbound,
            _ => Direction::InboundPlaintext,
        }
    }
}

/// How a connection ended.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ConnectionOutcome {
    Success,
    /// Refused before any byte moved (bad input, unknown target, the
    /// node-wide plaintext switch).
    Refused,
    /// Refused by an authorization policy (`response_flags="DENY"`).
    Denied,
    /// Failed after being accepted (upstream unreachable, reset).
    Failed,
    /// Failed, for a reason Istio's metrics name apart.
    FailedWith(Failure),
    /// Cut because a reloaded revocation list revoked the peer of its
    /// HBONE connection (`response_flags="CERT_REVOKED"`, as ztunnel).
    Revoked,
}

/// Why an outbound connection failed, where ztunnel's metrics tell it
/// apart from a plain failure to connect (its `extract_failure_reason`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Failure {
    /// The TCP connect to the peer's HBONE port timed out, which ztunnel
    /// reads as a network policy dropping it (`NETWORK_POLICY`).
    HbonePortTimedOut,
    /// No certificate for the source's identity (`IDENTITY_ERROR`).
    NoCertificate,
    /// The peer's HTTP/2 failed: its handshake, ALPN or the connection
    /// (`H2_HANDSHAKE_FAILURE`).
    Http2,
    /// The TLS configuration could not be made (`TLS_FAILURE`; a failed
    /// TLS handshake is an I/O error to ztunnel, a plain failure).
    TlsConfig,
}

/// One connection, as the proxy knows it.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionInfo<'a> {
    pub direction: Direction,
    /// The local pod this proxy serves the connection for: the source of
    /// outbound and passthrough connections, the target of inbound ones
    /// (unknown when an inbound stream was refused before its target was).
    pub pod: Option<&'a WorkloadKey>,
    pub src_addr: SocketAddr,
    /// SPIFFE identity of the source: the local pod's (outbound), the peer
    /// certificate's (inbound HBONE), none for plaintext.
    pub src_identity: Option<&'a str>,
    pub dst_addr: SocketAddr,
    /// SPIFFE identity of the target: the one the proxy checked (outbound
    /// HBONE) or the local pod's (inbound).
    pub dst_identity: Option<&'a str>,
    /// The target workload when the proxy chose it by name, not address:
    /// a service endpoint known by DNS name (`dst_addr` is then what the
    /// name resolved to, which may be anyone's), or the waypoint a
    /// connection goes through (`dst_addr` the original destination).
    /// None elsewhere.
    pub dst_workload: Option<&'a WorkloadKey>,
    /// The service whose VIP the source connected to, by its id
    /// (`namespace/hostname`: a ServiceEntry's hosts are services of one
    /// name; `namespace/name` is understood too,
    /// [`crate::store::WorkloadStore::service_named`]);
    /// `dst_addr` is then the endpoint chosen (outbound and passthrough
    /// only: the destination's proxy sees the endpoint address).
    pub dst_service: Option<&'a WorkloadKey>,
    /// What the source's proxy said of the source workload (the inbound
    /// CONNECT's `baggage`; ztunnel's derived source), for the metrics'
    /// source labels when the source is not known by its address. None
    /// outside inbound HBONE.
    pub derived_source: Option<&'a super::Baggage>,
    /// The inbound CONNECT came through another network's gateway (its
    /// `x-forwarded-network` names that network): `src_addr` is the
    /// gateway's, so the source is known only from `derived_source`
    /// (ztunnel's `from_gateway`).
    pub src_through_gateway: bool,
    /// What the destination's proxy said of the destination workload (the
    /// `baggage` of its 200 to the inner CONNECT of double HBONE; ztunnel's
    /// derived destination): the destination labels then, since
    /// `dst_addr` is the gateway's. None elsewhere.
    pub derived_destination: Option<&'a super::Baggage>,
}

/// What is known once a connection closed.
#[derive(Clone, Copy, Debug)]
pub struct ConnectionClose {
    /// Bytes from the connection's initiator to its target (the request).
    pub bytes_to_target: u64,
    /// Bytes from the target back to the initiator (the response).
    pub bytes_from_target: u64,
    pub duration: Duration,
    pub outcome: ConnectionOutcome,
}

/// Told about every connection the proxy handles, once when it opens (a
/// connection refused early: at its close). Called on the proxy's tasks:
/// keep it cheap and never block.
pub trait ConnectionObserver: Send + Sync {
    /// What the observer keeps of the connection comes back with its
    /// close: the close is recorded as the open was, even if the workloads
    /// it names changed meanwhile (ztunnel keeps its labels the same way).
    fn opened(&self, connection: &ConnectionInfo<'_>) -> Box<dyn OpenConnection>;

    /// A connection from the local workload `pod` (its identity
    /// `principal`) picked a service endpoint known by `hostname`, which
    /// is resolved now (ztunnel's `istio_on_demand_dns_total`).
    fn resolved_on_demand(&self, pod: &WorkloadKey, principal: &str, hostname: &str) {
        let _ = (pod, principal, hostname);
    }
}

/// One connection an observer was told of, until it closes.
pub trait OpenConnection: Send + Sync {
    /// Bytes the relay just wrote, one way (to the connection's target)
    /// or the other: counted as they move, as ztunnel counts them, so a
    /// long connection's bytes show before it closes.
    fn moved(&self, to_target: u64, from_target: u64);
    /// `close` holds the connection's totals: what [`moved`] was not told
    /// of (a connection the proxy did not relay) is counted here.
    ///
    /// [`moved`]: OpenConnection::moved
    fn closed(self: Box<Self>, close: &ConnectionClose);
}

/// Where a relay counts the bytes it writes: into the open connection's
/// record, by which way they went. Copy, and empty when no observer is
/// set.
#[derive(Clone, Copy, Default)]
pub(crate) struct Meter<'a> {
    open: Option<&'a dyn OpenConnection>,
    /// The relay's first socket is the connection's target (inbound: the
    /// socket to the pod), not its initiator.
    first_is_target: bool,
}

impl<'a> Meter<'a> {
    /// For a relay whose first socket is the connection's initiator's.
    pub(crate) fn initiator_first(open: Option<&'a dyn OpenConnection>) -> Self {
        Self {
            open,
            first_is_target: false,
        }
    }

    /// For a relay whose first socket is the connection's target's.
    pub(crate) fn target_first(open: Option<&'a dyn OpenConnection>) -> Self {
        Self {
            open,
            first_is_target: true,
        }
    }

    /// `n` bytes written from the relay's first socket to its second.
    pub(crate) fn forward(self, n: u64) {
        if let Some(open) = self.open {
            if self.first_is_target {
                open.moved(0, n);
            } else {
                open.moved(n, 0);
            }
        }
    }

    /// `n` bytes written from the relay's second socket to its first.
    pub(crate) fn back(self, n: u64) {
        if let Some(open) = self.open {
            if self.first_is_target {
                open.moved(n, 0);
            } else {
                open.moved(0, n);
            }
        }
    }
}

//! The DNS proxy's sockets in a pod's netns: UDP and TCP on
//! 127.0.0.1:15053 and, where the netns has IPv6 loopback, [::1]:15053 —
//! where DNS capture (`ebpf/src/dns.rs`, or Istio's iptables rules) sends
//! the pod's queries.
//!
//! One owner: the proxy opens them with the pod's other listeners (on the
//! pod's socket thread, marked like every proxy socket) when it starts
//! serving a pod whose DNS is captured, and they close when it stops
//! serving it (its listeners' token).
//!
//! Handover: as the TCP listeners, they carry `SO_REUSEADDR` and
//! `SO_REUSEPORT`, so a new agent binds the same addresses while the old one
//! still serves; the kernel spreads queries over both (by the client's
//! address and port) until the old agent closes its sockets, and from then
//! on the new agent's get every query. Nothing is passed between agents: a
//! query sitting in the old agent's UDP receive queue when it closes is
//! lost and the client's resolver asks again after its timeout (TCP
//! connections queued on the old listener migrate, `tcp_migrate_req`).
//! The eBPF capture rewrites a query only while some socket is bound on
//! the proxy's address, so between agents DNS goes to the pod's own
//! resolvers rather than nowhere.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr};

use shunt_common::PORT_DNS_PROXY;

use super::{ProxyError, no_ipv6, socket::PodSockets};
use crate::state::WorkloadKey;

/// The DNS proxy's bound sockets for one pod.
#[derive(Debug)]
pub(crate) struct DnsSockets {
    /// UDP sockets, IPv4 first.
    pub udp: Vec<std::net::UdpSocket>,
    /// TCP listeners, IPv4 first.
    pub tcp: Vec<std::net::TcpListener>,
}

/// Binds the pod's DNS proxy addresses: 127.0.0.1:15053 must bind; [::1]
/// is skipped when the netns has no IPv6 (no such queries can be sent
/// there either).
pub(crate) async fn bind(
    sockets: &PodSockets,
    pod: &WorkloadKey,
) -> Result<DnsSockets, ProxyError> {
    let mut bound = DnsSockets {
        udp: Vec::with_capacity(2),
        tcp: Vec::with_capacity(2),
    };
    let addrs: [IpAddr; 2] = [Ipv4Addr::LOCALHOST.into(), Ipv6Addr::LOCALHOST.into()];
    for ip in addrs {
        let addr = SocketAddr::new(ip, PORT_DNS_PROXY);
        match sockets.dns(addr).await {
            Ok((udp, tcp)) => {
                bound.udp.push(udp);
                bound.tcp.push(tcp);
            }
            Err(e) if ip.is_ipv6() && no_ipv6(&e) => {
                tracing::debug!(pod = %pod, %addr, error = %e, "no IPv6 loopback in the pod's netns; DNS proxy on IPv4 only");
            }
            Err(source) => {
                return Err(ProxyError::Listen {
                    pod: pod.clone(),
                    addr,
                    source,
                });
            }
        }
    }
    Ok(bound)
}

/// Binds the pod's DNS proxy sockets and serves them with the agent's DNS
/// server until `stop` is cancelled (the pod's listeners' token: the
/// proxy stops serving the pod, or drains). `None` (logged) when the agent
/// has no DNS server: nothing is bound, and the eBPF capture leaves the
/// pod's DNS alone.
pub(crate) async fn start(
    shared: Option<&crate::dns::DnsShared>,
    sockets: &PodSockets,
    pod: &WorkloadKey,
    stop: tokio_util::sync::CancellationToken,
) -> Result<(), ProxyError> {
    let Some(shared) = shared else {
        tracing::warn!(pod = %pod, "the pod's DNS is captured but this agent runs no DNS server; its DNS goes to its own resolvers");
        return Ok(());
    };
    let bound = bind(sockets, pod).await?;
    let addrs: Vec<_> = bound
        .udp
        .iter()
        .filter_map(|s| s.local_addr().ok())
        .collect();
    let cluster_domain = shared.names.borrow().cluster_domain().to_string();
    let asker = crate::dns::PodDns::kubernetes(&pod.namespace, &cluster_domain).for_pod(&pod.name);
    let handle = crate::dns::serve(
        crate::dns::DnsSockets {
            udp: bound.udp,
            tcp: bound.tcp,
        },
        asker,
        shared.names.clone(),
        // Upstream queries from the pod's own netns (its IP), not the
        // agent's.
        std::sync::Arc::new(
            shared
                .forwarder
                .in_pod(std::sync::Arc::new(sockets.clone())),
        ),
        shared.metrics.clone(),
    )
    .map_err(|e| ProxyError::Listen {
        pod: pod.clone(),
        addr: SocketAddr::new(Ipv4Addr::LOCALHOST.into(), PORT_DNS_PROXY),
        source: std::io::Error::other(e.to_string()),
    })?;
    tracing::info!(pod = %pod, ?addrs, "DNS proxy serving the pod");
    let pod = pod.clone();
    tokio::spawn(async move {
        stop.cancelled().await;
        handle.shutdown().await;
        tracing::debug!(pod = %pod, "DNS proxy stopped serving the pod");
    });
    Ok(())
}

//! Other networks: a service endpoint on another network than the client's
//! is reached through that network's east-west gateway, as ztunnel reaches
//! it ("double HBONE"). The gateway is named by the endpoint workload's
//! `network_gateway` (an address on its network, or a service hostname).
//!
//! The outer HBONE connection goes to the gateway, checked against the
//! gateway's identity; its CONNECT names `<service hostname>:<port>`, which
//! is all the gateway routes by. Inside that stream the client opens a
//! second mTLS connection and CONNECT to the same authority, which the
//! gateway passes on unopened to an endpoint of the service, whose own
//! proxy terminates it; that inner TLS is checked against the service's
//! `subject_alt_names` (ztunnel's `final_sans`): the client cannot know
//! which endpoint the gateway picks.
//!
//! [`through_gateway`] is a pure function of the store, called under the
//! proxy's one read of it; `double_hbone.rs` carries the connection.

use std::net::{IpAddr, SocketAddr};

use crate::{
    state::{
        Endpoint, GatewayAddress, GatewayDestination, Service, SpiffeId, TrustDomain, weighted_pick,
    },
    store::WorkloadStore,
};

/// How a connection reaches a service endpoint on another network.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GatewayHop {
    /// `<service hostname>:<service port>`: the `:authority` of both
    /// CONNECTs.
    pub authority: String,
    /// The chosen endpoint's network.
    pub network: String,
    /// The gateway's `IP:hbone_mtls_port`...
    pub gateway: SocketAddr,
    /// ...the identity its certificate must carry...
    pub gateway_identity: SpiffeId,
    /// ...or one of these (its service's SANs, when it is named as one).
    pub gateway_sans: Vec<String>,
    /// What the destination's certificate (the inner TLS) must carry: the
    /// service's first SAN...
    pub final_identity: SpiffeId,
    /// ...or one of its others.
    pub final_also_accept: Vec<String>,
}

/// The gateway hop for connection number `n` from a client on
/// `client_network` to `dst`, one of `service`'s VIPs and ports, when
/// every ready endpoint is on another network: one of those whose
/// workload names a network gateway, weighted by capacity. `Err` says why
/// none can be used (for the access line).
pub fn through_gateway(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    service: &Service,
    dst: SocketAddr,
    client_network: &str,
    n: usize,
) -> Result<GatewayHop, String> {
    let remote: Vec<(&Endpoint, &GatewayAddress)> = service
        .ready_targets(dst)
        .into_iter()
        .filter(|(e, _)| e.network != client_network)
        .filter_map(|(e, _)| {
            let workload = store.by_network_ip(&e.network, e.ip)?;
            Some((e, workload.network_gateway.as_ref()?))
        })
        .collect();
    let Some(&(endpoint, gateway)) = weighted_pick(&remote, |(e, _)| e.capacity, n) else {
        let networks: Vec<&str> = service
            .ready_targets(dst)
            .iter()
            .map(|(e, _)| e.network.as_str())
            .collect();
        return Err(format!(
            "ready endpoints only on other networks ({}), none behind a network gateway",
            networks.join(", ")
        ));
    };
    if service.hostname.is_empty() {
        return Err(format!(
            "service {} has no hostname to name it to the gateway of network {}",
            service.key(),
            endpoint.network
        ));
    }
    let mut final_also_accept = service.san_uris();
    let final_identity = match final_also_accept.first().map(|san| SpiffeId::from_uri(san)) {
        Some(Some(first)) => first,
        // ztunnel goes on and fails the inner handshake (no SAN matches).
        _ => {
            return Err(format!(
                "service {} has no subject_alt_names: its endpoint behind the gateway of network {} cannot be verified",
                service.key(),
                endpoint.network
            ));
        }
    };
    final_also_accept.remove(0);
    let (gateway_addr, gateway_identity, gateway_sans) =
        resolve(store, trust_domain, gateway, dst.ip(), n)?;
    Ok(GatewayHop {
        authority: format!("{}:{}", service.hostname, dst.port()),
        network: endpoint.network.clone(),
        gateway: gateway_addr,
        gateway_identity,
        gateway_sans,
        final_identity,
        final_also_accept,
    })
}

/// The gateway's address and what its certificate must carry. An address
/// is a workload on the named network, or a service's VIP there; a
/// hostname a service. A service gateway is one of its ready endpoints of
/// `family`'s address family (the client's) where it has one.
fn resolve(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    gateway: &GatewayAddress,
    family: IpAddr,
    n: usize,
) -> Result<(SocketAddr, SpiffeId, Vec<String>), String> {
    let port = gateway.hbone_mtls_port;
    let (service, network) = match &gateway.destination {
        GatewayDestination::Address { network, ip } => {
            match store.services().by_addr(SocketAddr::new(*ip, port)) {
                Some(service) => (service.as_ref(), network.as_str()),
                None => {
                    let workload = store.by_network_ip(network, *ip).ok_or_else(|| {
                        format!(
                            "network gateway {ip} on network {network} is no workload or service istiod sent"
                        )
                    })?;
                    return Ok((
                        SocketAddr::new(*ip, port),
                        workload.identity(trust_domain),
                        Vec::new(),
                    ));
                }
            }
        }
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => {
            let service = store
                .services()
                .by_hostname(namespace, hostname)
                .ok_or_else(|| {
                    format!("network gateway service {namespace}/{hostname} is not known")
                })?;
            (service.as_ref(), "")
        }
    };
    let members: Vec<(SocketAddr, SpiffeId, u32)> = service
        .endpoints
        .iter()
        .filter(|e| e.ready)
        .filter_map(|e| {
            let workload = store.by_network_ip(&e.network, e.ip)?;
            let target = service
                .target_port(e, port)
                .filter(|p| *p != 0)
                .unwrap_or(port);
            Some((
                SocketAddr::new(e.ip, target),
                workload.identity(trust_domain),
                e.capacity,
            ))
        })
        .collect();
    let same_family: Vec<_> = members
        .iter()
        .filter(|(addr, _, _)| addr.is_ipv4() == family.is_ipv4())
        .cloned()
        .collect();
    let candidates = if same_family.is_empty() {
        members
    } else {
        same_family
    };
    let (addr, identity, _) = weighted_pick(&candidates, |(_, _, c)| *c, n)
        .cloned()
        .ok_or_else(|| {
            format!(
                "network gateway service {} has no ready endpoint{}",
                service.key(),
                if network.is_empty() {
                    String::new()
                } else {
                    format!(" (network {network})")
                }
            )
        })?;
    Ok((addr, identity, service.san_uris()))
}

#[cfg(test)]
#[path = "network_gateway_tests.rs"]
mod tests;

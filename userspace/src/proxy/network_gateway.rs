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
//! A service's waypoint on another network is reached the same way
//! ([`to_waypoint`]; ztunnel's "waypoint on remote network").
//!
//! Both are pure functions of the store, called under the proxy's one
//! read of it; `double_hbone.rs` carries the connection.

use std::net::{IpAddr, SocketAddr};

use crate::{
    state::{
        GatewayAddress, GatewayDestination, Service, SpiffeId, TrustDomain, Workload, WorkloadKey,
        weighted_pick,
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
/// workload names a network gateway, weighted by capacity; the inner TLS
/// checked against the service's SANs. `Err` says why none can be used
/// (for the access line).
pub fn through_gateway(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    service: &Service,
    dst: SocketAddr,
    client_network: &str,
    n: usize,
) -> Result<GatewayHop, String> {
    let addressed = service
        .ready_targets(dst)
        .into_iter()
        .filter(|(e, _)| e.network != client_network)
        .map(|(e, _)| Remote {
            network: &e.network,
            capacity: e.capacity,
            gateway: store
                .by_network_ip(&e.network, e.ip)
                .and_then(|w| w.network_gateway.as_ref()),
        });
    let remote: Vec<Remote<'_>> = addressed
        .chain(gateway_only(service, dst, client_network))
        .collect();
    hop(
        store,
        trust_domain,
        &remote,
        service,
        &service.san_uris(),
        dst,
        n,
    )
}

/// The hop to a service's waypoint whose healthy replicas `elsewhere` are
/// all on other networks (ztunnel: a service waypoint on a remote network
/// goes through the gateway; both CONNECTs name the service the client
/// addressed, `target`, and the inner TLS is checked against the
/// waypoint service's SANs, `waypoint_sans`).
pub fn to_waypoint(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    elsewhere: &[&Workload],
    target: &WorkloadKey,
    waypoint_sans: &[String],
    dst: SocketAddr,
    n: usize,
) -> Result<GatewayHop, String> {
    let service = store
        .services()
        .get(target)
        .ok_or_else(|| format!("service {target} is gone"))?;
    let remote: Vec<Remote<'_>> = elsewhere
        .iter()
        .map(|w| Remote {
            network: &w.network,
            capacity: w.capacity,
            gateway: w.network_gateway.as_ref(),
        })
        .collect();
    hop(store, trust_domain, &remote, service, waypoint_sans, dst, n)
}

/// `service`'s ready endpoints without an address that serve `dst`'s
/// port, on another network than `client_network` (ztunnel never uses one
/// on the client's own network: only the gateway reaches it).
fn gateway_only<'a>(
    service: &'a Service,
    dst: SocketAddr,
    client_network: &'a str,
) -> impl Iterator<Item = Remote<'a>> + 'a {
    let serves = move |ports: &std::collections::BTreeMap<u16, u16>| {
        ports.contains_key(&dst.port())
            || service
                .ports
                .iter()
                .any(|p| p.port == dst.port() && p.target_port.is_some_and(|t| t != 0))
    };
    service
        .gateway_only
        .iter()
        .filter(move |e| e.ready && e.network != client_network && serves(&e.ports))
        .map(|e| Remote {
            network: &e.network,
            capacity: e.capacity,
            gateway: Some(&e.gateway),
        })
}

/// Whether `service` has an endpoint only another network's gateway
/// reaches, for a client on `client_network` connecting to `dst`.
pub fn has_gateway_only(service: &Service, dst: SocketAddr, client_network: &str) -> bool {
    gateway_only(service, dst, client_network).next().is_some()
}

/// A member of a service (an endpoint, or a waypoint's replica) on
/// another network, and the gateway its workload names, if any.
struct Remote<'a> {
    network: &'a str,
    capacity: u32,
    gateway: Option<&'a GatewayAddress>,
}

/// The hop to one of `remote` (by capacity, among those with a gateway)
/// for a connection to `dst`, a VIP and port of `service` (whose hostname
/// both CONNECTs name), the inner TLS checked against `final_sans`:
/// `service`'s own SANs, or a waypoint service's (ztunnel's
/// `final_sans`).
fn hop(
    store: &WorkloadStore,
    trust_domain: &TrustDomain,
    remote: &[Remote<'_>],
    service: &Service,
    final_sans: &[String],
    dst: SocketAddr,
    n: usize,
) -> Result<GatewayHop, String> {
    let gatewayed: Vec<&Remote<'_>> = remote.iter().filter(|r| r.gateway.is_some()).collect();
    let Some(chosen) = weighted_pick(&gatewayed, |r| r.capacity, n) else {
        let networks: Vec<&str> = remote.iter().map(|r| r.network).collect();
        return Err(format!(
            "ready endpoints only on other networks ({}), none behind a network gateway",
            networks.join(", ")
        ));
    };
    let (network, Some(gateway)) = (chosen.network, chosen.gateway) else {
        return Err("no network gateway".into());
    };
    if service.hostname.is_empty() {
        return Err(format!(
            "service {} has no hostname to name it to the gateway of network {network}",
            service.key(),
        ));
    }
    let Some(final_identity) = final_sans.first().and_then(|san| SpiffeId::from_uri(san)) else {
        // ztunnel goes on and fails the inner handshake (no SAN matches).
        return Err(format!(
            "no subject_alt_names for service {}: what answers behind the gateway of network {network} cannot be verified",
            service.key(),
        ));
    };
    let (gateway_addr, gateway_identity, gateway_sans) =
        resolve(store, trust_domain, gateway, dst.ip(), n)?;
    Ok(GatewayHop {
        authority: format!("{}:{}", service.hostname, dst.port()),
        network: network.to_owned(),
        gateway: gateway_addr,
        gateway_identity,
        gateway_sans,
        final_identity,
        final_also_accept: final_sans[1..].to_vec(),
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

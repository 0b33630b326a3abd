//! Where the proxy looks up workloads, services, authorization and
//! waypoints: [`WorkloadLookup`], implemented by the agent's store.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{Arc, RwLock},
};

use super::{
    network_gateway::{self, GatewayHop},
    waypoint,
};
use crate::{
    state::{HostnameTarget, Place, Service, ServiceStore, TrustDomain, Workload, WorkloadKey},
    store::WorkloadStore,
};

/// Where the proxy learns which workload owns an IP (for the destination's
/// identity and whether it is in the mesh), and which service a VIP is.
pub trait WorkloadLookup: Send + Sync {
    /// Shared: a connection takes a pointer, not a copy.
    fn workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>>;

    /// The workload stored as `key` (shared, as [`Self::workload_by_ip`]).
    fn workload(&self, key: &WorkloadKey) -> Option<Arc<Workload>>;

    /// Istio's name for the service `key` ([`WorkloadStore::service_hostname`]).
    fn service_hostname(&self, key: &WorkloadKey) -> String;

    /// The service (by id) an inbound connection to the local workload
    /// `pod`'s `port` is counted for ([`super::inbound_service::guess`]).
    fn inbound_service(
        &self,
        pod: &WorkloadKey,
        forwarded_host: Option<&str>,
        port: u16,
    ) -> Option<WorkloadKey>;

    /// The service a client of namespace `client_ns` addresses at `dst`
    /// (a VIP and port, or an address in a service's range).
    fn service_at(&self, dst: SocketAddr, client_ns: &str) -> Option<Arc<Service>>;

    /// The target of connection number `n` from `client` (a local pod's
    /// address) to `dst`, one of `service`'s VIPs and ports: a ready
    /// endpoint on the client's network, as the service's load balancing
    /// (locality included) allows ([`Service::pick_for`]); when every
    /// ready endpoint is on another network, one of those through its
    /// network's gateway ([`network_gateway::through_gateway`]); or why
    /// there is none.
    fn pick_endpoint(
        &self,
        trust_domain: &TrustDomain,
        service: &Service,
        client: IpAddr,
        dst: SocketAddr,
        n: usize,
    ) -> Result<Target, NoEndpoint>;

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

    /// Inbound at the local pod `waypoint`: the port a CONNECT for
    /// `authority` (not the arrival address) goes to when this pod is the
    /// waypoint `authority` is bound to ([`waypoint::inbound_port`]).
    fn waypoint_inbound_port(&self, waypoint: &WorkloadKey, authority: SocketAddr) -> Option<u16>;

    /// Inbound at the local pod `pod` (arrived at `ip`): the port a CONNECT
    /// to the service `hostname` at `port` goes to ([`hostname_port`]), or
    /// why there is none.
    fn hostname_inbound_port(
        &self,
        pod: &WorkloadKey,
        ip: IpAddr,
        hostname: &str,
        port: u16,
    ) -> Result<u16, String>;
}

/// Where [`WorkloadLookup::pick_endpoint`] sends a connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// An endpoint on the client's network: dialled directly.
    Direct(SocketAddr),
    /// An endpoint on another network: through its network's gateway.
    ThroughGateway(Box<GatewayHop>),
    /// An endpoint known by DNS name: resolved, then dialled
    /// (`on_demand_dns.rs`).
    Resolve(Box<HostnameTarget>),
}

/// Why [`WorkloadLookup::pick_endpoint`] found no endpoint.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum NoEndpoint {
    /// The service has no ready endpoint for the port and family.
    NoneReady,
    /// Its locality load balancing (`STRICT`) leaves none for this client.
    NotForThisClient,
    /// Every ready endpoint is on another network than the client's, and
    /// none can be reached through a gateway: why.
    OnOtherNetworks(String),
}

/// The service `hostname` names for a client in `namespace`, ranked as
/// ztunnel ranks services sharing a hostname: the one in `namespace`, else
/// a canonical one, else the first (by key: ztunnel's is the first it was
/// sent); one of another namespace with visibility `NAMESPACE` is not
/// seen.
pub fn service_by_hostname<'a>(
    services: &'a ServiceStore,
    namespace: &str,
    hostname: &str,
) -> Option<&'a Service> {
    if let Some(service) = services.by_hostname(namespace, hostname) {
        return Some(service);
    }
    // Not in the client's namespace: a scan, only for this rarer case;
    // a service visible to its own namespace only is not a candidate.
    let mut named = services
        .iter()
        .filter(|s| s.hostname == hostname && s.visibility != crate::state::Visibility::Namespace);
    let first = named.next()?;
    Some(
        std::iter::once(first)
            .chain(named)
            .find(|s| s.canonical)
            .unwrap_or(first),
    )
}

/// Where a CONNECT to `hostname:port` arriving at the local pod `pod`
/// (at `ip`) goes, as ztunnel's inbound decides it: the service the
/// hostname names gives the port only: the pod's endpoint's target port
/// for `port`, else the service's numeric one.
pub fn hostname_port(
    store: &WorkloadStore,
    pod: &WorkloadKey,
    ip: IpAddr,
    hostname: &str,
    port: u16,
) -> Result<u16, String> {
    let service = service_by_hostname(store.services(), &pod.namespace, hostname)
        .ok_or_else(|| format!("no service has the hostname {hostname}"))?;
    let endpoint = service
        .endpoints
        .iter()
        .find(|e| e.pod.as_ref() == Some(pod) || e.ip == ip);
    let target = match endpoint {
        Some(endpoint) => service.target_port(endpoint, port),
        None => service
            .ports
            .iter()
            .find(|p| p.port == port)
            .and_then(|p| p.target_port),
    };
    target.filter(|t| *t != 0).ok_or_else(|| {
        format!(
            "service {} gives no target port for port {port} at {pod}",
            service.key()
        )
    })
}

impl WorkloadLookup for RwLock<WorkloadStore> {
    fn workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>> {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .by_ip_shared(ip)
            .cloned()
    }

    fn workload(&self, key: &WorkloadKey) -> Option<Arc<Workload>> {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .get_shared(key)
            .cloned()
    }

    fn service_hostname(&self, key: &WorkloadKey) -> String {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .service_hostname(key)
    }

    fn inbound_service(
        &self,
        pod: &WorkloadKey,
        forwarded_host: Option<&str>,
        port: u16,
    ) -> Option<WorkloadKey> {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        let target = store.get(pod)?;
        super::inbound_service::guess(&store, target, forwarded_host, port)
    }

    fn service_at(&self, dst: SocketAddr, client_ns: &str) -> Option<Arc<Service>> {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .service_for(dst, Some(client_ns))
            .cloned()
    }

    fn pick_endpoint(
        &self,
        trust_domain: &TrustDomain,
        service: &Service,
        client: IpAddr,
        dst: SocketAddr,
        n: usize,
    ) -> Result<Target, NoEndpoint> {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        // A client the store does not know compares as nowhere in
        // particular (every field empty, the network too).
        let client = store.by_ip(client).map(Place::of).unwrap_or_default();
        let picked = if service.ranks_by_locality() {
            service.pick_for(dst, n, &client, |e| store.by_ip(e.ip).map(Place::of))
        } else {
            service.pick(dst, client.network, n)
        };
        // ztunnel picks among named and addressed endpoints alike; shunt
        // takes a named one only when no addressed one on the client's
        // network is ready (a ServiceEntry has one kind or the other).
        if picked.is_none()
            && let Some(named) = service.pick_hostname(dst, n)
        {
            return Ok(Target::Resolve(Box::new(named)));
        }
        match picked {
            Some((_, target)) => Ok(Target::Direct(target)),
            // ztunnel picks among every network's endpoints alike; shunt
            // goes through a gateway only when its own network has none.
            None if service.only_on_other_networks(dst, client.network)
                || network_gateway::has_gateway_only(service, dst, client.network) =>
            {
                network_gateway::through_gateway(
                    &store,
                    trust_domain,
                    service,
                    dst,
                    client.network,
                    n,
                )
                .map(|hop| Target::ThroughGateway(Box::new(hop)))
                .map_err(NoEndpoint::OnOtherNetworks)
            }
            None if service.ranks_by_locality() && !service.ready_targets(dst).is_empty() => {
                Err(NoEndpoint::NotForThisClient)
            }
            None => Err(NoEndpoint::NoneReady),
        }
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

    fn waypoint_inbound_port(&self, waypoint: &WorkloadKey, authority: SocketAddr) -> Option<u16> {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        waypoint::inbound_port(&store, waypoint, authority)
    }

    fn hostname_inbound_port(
        &self,
        pod: &WorkloadKey,
        ip: IpAddr,
        hostname: &str,
        port: u16,
    ) -> Result<u16, String> {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        hostname_port(&store, pod, ip, hostname, port)
    }
}

#[cfg(test)]
#[path = "lookup_tests.rs"]
mod tests;

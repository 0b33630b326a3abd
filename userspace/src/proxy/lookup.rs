//! Where the proxy looks up workloads, services, authorization and
//! waypoints: [`WorkloadLookup`], implemented by the agent's store.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{Arc, RwLock},
};

use super::waypoint;
use crate::{
    state::{Service, TrustDomain, Workload, WorkloadKey},
    store::WorkloadStore,
};

/// Where the proxy learns which workload owns an IP (for the destination's
/// identity and whether it is in the mesh), and which service a VIP is.
pub trait WorkloadLookup: Send + Sync {
    /// Shared: a connection takes a pointer, not a copy.
    fn workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>>;

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

    /// Inbound at the local pod `waypoint`: the port a CONNECT for
    /// `authority` (not the arrival address) goes to when this pod is the
    /// waypoint `authority` is bound to ([`waypoint::inbound_port`]).
    fn waypoint_inbound_port(&self, waypoint: &WorkloadKey, authority: SocketAddr) -> Option<u16>;
}

impl WorkloadLookup for RwLock<WorkloadStore> {
    fn workload_by_ip(&self, ip: IpAddr) -> Option<Arc<Workload>> {
        self.read()
            .unwrap_or_else(|p| p.into_inner())
            .by_ip_shared(ip)
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

    fn waypoint_inbound_port(&self, waypoint: &WorkloadKey, authority: SocketAddr) -> Option<u16> {
        let store = self.read().unwrap_or_else(|p| p.into_inner());
        waypoint::inbound_port(&store, waypoint, authority)
    }
}

//! Locality-aware endpoint choice (`istio.workload.LoadBalancing`), as
//! ztunnel's `load_balance` does it: each endpoint is ranked by how many of
//! the service's routing preferences, in order, it shares with the client
//! (counting stops at the first it does not share); `STRICT` keeps only
//! endpoints that share them all, `FAILOVER` the best-ranked ones. When the
//! first preference is `NETWORK`, an endpoint on the client's network ranks
//! above every endpoint off it, and one off it is still ranked by the
//! other preferences. An unspecified mode is ztunnel's "standard": no
//! locality at all.

use super::{LoadBalancing, LoadBalancingMode, LoadBalancingScope, Workload};

/// Where a workload runs, as load balancing compares a client and an
/// endpoint. Empty strings are values too (two workloads with no zone
/// share the empty zone), as in ztunnel.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Place<'a> {
    pub region: &'a str,
    pub zone: &'a str,
    pub subzone: &'a str,
    pub node: &'a str,
    pub cluster: &'a str,
    pub network: &'a str,
}

impl<'a> Place<'a> {
    pub fn of(workload: &'a Workload) -> Self {
        let locality = workload.locality.as_ref();
        Self {
            region: locality.map_or("", |l| l.region.as_str()),
            zone: locality.map_or("", |l| l.zone.as_str()),
            subzone: locality.map_or("", |l| l.subzone.as_str()),
            node: &workload.node,
            cluster: &workload.cluster_id,
            network: &workload.network,
        }
    }
}

impl LoadBalancing {
    /// Whether endpoints are ranked by locality (`STRICT` or `FAILOVER`).
    pub fn ranks_by_locality(&self) -> bool {
        matches!(
            self.mode,
            LoadBalancingMode::Strict | LoadBalancingMode::Failover
        )
    }

    /// The rank of an endpoint at `endpoint` for a client at `client`
    /// (higher is preferred); `None` when `STRICT` excludes it.
    pub fn rank(&self, client: &Place<'_>, endpoint: &Place<'_>) -> Option<usize> {
        let scopes = &self.routing_preference;
        let network_first = scopes.first() == Some(&LoadBalancingScope::Network);
        let (mut rank, mut bonus) = (0, 0);
        for scope in scopes {
            let shared = match scope {
                LoadBalancingScope::Region => client.region == endpoint.region,
                LoadBalancingScope::Zone => client.zone == endpoint.zone,
                LoadBalancingScope::Subzone => client.subzone == endpoint.subzone,
                LoadBalancingScope::Node => client.node == endpoint.node,
                LoadBalancingScope::Cluster => client.cluster == endpoint.cluster,
                LoadBalancingScope::Network => {
                    let same = client.network == endpoint.network;
                    if network_first {
                        if !same {
                            // Ranked by the other preferences only.
                            continue;
                        }
                        bonus = scopes.len() - 1;
                    }
                    same
                }
            };
            if !shared {
                break;
            }
            rank += 1;
        }
        if self.mode == LoadBalancingMode::Strict && rank != scopes.len() {
            return None;
        }
        Some(rank + bonus)
    }
}

#[cfg(test)]
#[path = "locality_tests.rs"]
mod tests;

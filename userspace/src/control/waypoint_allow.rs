//! istiod's implicit "allow from the waypoint" policy, for the sources
//! without istiod (issue 34, item 9). With `PILOT_AUTO_ALLOW_WAYPOINT_POLICY`
//! (off by default) istiod sends, for each waypoint whose pods it knows, an
//! ALLOW policy `istio_allow_waypoint_<ns>_<gateway>` in the waypoint's
//! namespace whose one match is the principals of the waypoint pods'
//! service accounts, and names it in every workload the waypoint serves
//! (bound to it, or backing a service bound to it). Unless other ALLOW
//! policies admit more, traffic that skips the waypoint is refused.
//! `--auto-allow-waypoint-policy on` does the same here.
//!
//! Pure: no source's types, no I/O; both standalone sources share it.

use std::collections::{BTreeMap, BTreeSet};

use crate::{
    authz::{Action, Clause, Match, Policy, Rule, Scope, StringMatch},
    state::{GatewayAddress, GatewayDestination, Service, TrustDomain, Workload, WorkloadKey},
};

/// The label Kubernetes Gateway controllers put on a gateway's pods.
pub const GATEWAY_NAME_LABEL: &str = "gateway.networking.k8s.io/gateway-name";

/// The policy's name, as istiod makes it (`_` cannot be in a Kubernetes
/// name, so it cannot clash with a user's policy).
pub fn policy_name(namespace: &str, gateway: &str) -> String {
    format!("istio_allow_waypoint_{namespace}_{gateway}")
}

/// The waypoint `(namespace, gateway)` a [`GatewayAddress`] describes: the
/// service in front of a waypoint has the gateway's name.
fn waypoint_of(address: &GatewayAddress) -> Option<WorkloadKey> {
    match &address.destination {
        GatewayDestination::Hostname {
            namespace,
            hostname,
        } => hostname
            .split('.')
            .next()
            .filter(|name| !name.is_empty())
            .map(|name| WorkloadKey::new(namespace, name)),
        GatewayDestination::Address { .. } => None,
    }
}

/// Adds one policy per waypoint in use whose pods are among `workloads`,
/// and names it in each workload it serves. Returns the policies.
pub fn allow_from_waypoints(
    workloads: &mut [Workload],
    services: &[Service],
    trust_domain: &TrustDomain,
) -> Vec<Policy> {
    // Each waypoint's service accounts, from its pods.
    let mut accounts: BTreeMap<WorkloadKey, BTreeSet<String>> = BTreeMap::new();
    for w in workloads.iter() {
        if let Some(gateway) = w.labels.get(GATEWAY_NAME_LABEL) {
            accounts
                .entry(WorkloadKey::new(&w.namespace, gateway))
                .or_default()
                .insert(w.service_account.clone());
        }
    }
    if accounts.is_empty() {
        return Vec::new();
    }
    // Pods backing a service bound to a waypoint.
    let mut by_service: BTreeMap<WorkloadKey, BTreeSet<WorkloadKey>> = BTreeMap::new();
    for service in services {
        let Some(waypoint) = service.waypoint.as_ref().and_then(waypoint_of) else {
            continue;
        };
        for pod in service.endpoints.iter().filter_map(|e| e.pod.clone()) {
            by_service.entry(pod).or_default().insert(waypoint.clone());
        }
    }
    let mut used = BTreeSet::new();
    for w in workloads.iter_mut() {
        let own = w.waypoint.as_ref().and_then(waypoint_of);
        let served_by: BTreeSet<WorkloadKey> = own
            .into_iter()
            .chain(by_service.get(&w.key()).into_iter().flatten().cloned())
            .filter(|waypoint| accounts.contains_key(waypoint))
            .collect();
        for waypoint in served_by {
            let name = format!(
                "{}/{}",
                waypoint.namespace,
                policy_name(&waypoint.namespace, &waypoint.name)
            );
            if !w.authorization_policies.contains(&name) {
                w.authorization_policies.push(name);
            }
            used.insert(waypoint);
        }
    }
    accounts
        .into_iter()
        .filter(|(waypoint, _)| used.contains(waypoint))
        .map(|(waypoint, accounts)| {
            let principals = accounts
                .iter()
                .map(|sa| {
                    StringMatch::Exact(format!("{trust_domain}/ns/{}/sa/{sa}", waypoint.namespace))
                })
                .collect();
            Policy {
                name: policy_name(&waypoint.namespace, &waypoint.name),
                namespace: waypoint.namespace.clone(),
                // Bound by name in each workload, as istiod binds it.
                scope: Scope::WorkloadSelector,
                action: Action::Allow,
                rules: vec![Rule {
                    clauses: vec![Clause {
                        matches: vec![Match {
                            principals,
                            ..Default::default()
                        }],
                    }],
                }],
                dry_run: false,
                selector: None,
            }
        })
        .collect()
}

#[cfg(test)]
#[path = "waypoint_allow_tests.rs"]
mod tests;

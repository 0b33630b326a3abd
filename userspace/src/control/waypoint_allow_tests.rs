use std::sync::Arc;

use super::*;
use crate::{
    authz::{Connection, Destination, PolicySet},
    state::{Endpoint, tests::workload},
};

fn waypoint_address(namespace: &str, gateway: &str) -> GatewayAddress {
    GatewayAddress {
        destination: GatewayDestination::Hostname {
            namespace: namespace.into(),
            hostname: format!("{gateway}.{namespace}.svc.cluster.local"),
        },
        hbone_mtls_port: 15008,
    }
}

/// The waypoint's pod, a pod bound to it directly, a pod behind a service
/// bound to it, and a pod no waypoint serves.
fn mesh() -> (Vec<Workload>, Vec<Service>) {
    let mut waypoint = workload("apps", "waypoint-7d9", "198.18.0.10", "node-a");
    waypoint
        .labels
        .insert(GATEWAY_NAME_LABEL.into(), "waypoint".into());
    waypoint.service_account = "waypoint".into();
    let mut bound = workload("apps", "bound", "198.18.0.11", "node-a");
    bound.waypoint = Some(waypoint_address("apps", "waypoint"));
    let behind = workload("apps", "behind", "198.18.0.12", "node-a");
    let alone = workload("apps", "alone", "198.18.0.13", "node-a");
    let service = Service {
        name: "web".into(),
        namespace: "apps".into(),
        hostname: "web.apps.svc.cluster.local".into(),
        waypoint: Some(waypoint_address("apps", "waypoint")),
        endpoints: vec![Endpoint::new(
            "198.18.0.12".parse().expect("ip"),
            Some(WorkloadKey::new("apps", "behind")),
        )],
        ..Default::default()
    };
    (vec![waypoint, bound, behind, alone], vec![service])
}

fn verdict_for(policies: &PolicySet, dst: &Workload, identity: &str) -> bool {
    let connection = Connection {
        src_ip: "198.18.0.99".parse().expect("ip"),
        src_identity: Some(identity),
        dst: "198.18.0.11:8080".parse().expect("addr"),
    };
    policies
        .check(&connection, Destination::of(dst))
        .is_allowed()
}

#[test]
fn the_waypoint_alone_is_allowed_into_the_workloads_it_serves() {
    let (mut workloads, services) = mesh();
    let td = TrustDomain::new("example.org").expect("trust domain");
    let policies = allow_from_waypoints(&mut workloads, &services, &td);
    assert_eq!(policies.len(), 1, "{policies:?}");
    assert_eq!(policies[0].name, "istio_allow_waypoint_apps_waypoint");
    assert_eq!(policies[0].namespace, "apps");
    let set = PolicySet::new(policies);
    let by_name = |name: &str| {
        workloads
            .iter()
            .find(|w| w.name == name)
            .cloned()
            .map(Arc::new)
            .expect("workload")
    };
    for served in ["bound", "behind"] {
        let w = by_name(served);
        assert_eq!(
            w.authorization_policies,
            vec!["apps/istio_allow_waypoint_apps_waypoint".to_owned()],
            "{served}"
        );
        assert!(
            verdict_for(&set, &w, "spiffe://example.org/ns/apps/sa/waypoint"),
            "{served}: the waypoint's identity is allowed"
        );
        assert!(
            !verdict_for(&set, &w, "spiffe://example.org/ns/apps/sa/sleep"),
            "{served}: a client skipping the waypoint is refused"
        );
    }
    let alone = by_name("alone");
    assert!(alone.authorization_policies.is_empty());
    assert!(
        verdict_for(&set, &alone, "spiffe://example.org/ns/apps/sa/sleep"),
        "a workload no waypoint serves keeps no policy"
    );
}

#[test]
fn no_policy_for_a_waypoint_whose_pods_are_unknown() {
    let (mut workloads, services) = mesh();
    workloads.retain(|w| !w.labels.contains_key(GATEWAY_NAME_LABEL));
    let policies = allow_from_waypoints(&mut workloads, &services, &TrustDomain::default());
    assert!(policies.is_empty(), "{policies:?}");
    assert!(
        workloads
            .iter()
            .all(|w| w.authorization_policies.is_empty())
    );
}

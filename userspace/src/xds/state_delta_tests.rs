//! `XdsState::delta`: after the first complete view, the changes handed to
//! the store are exactly what the responses changed, and a store fed the
//! view then the deltas holds what a store fed a fresh complete view holds.
//! The status's resource list is kept the same way, per change.

use std::collections::HashMap;

use shunt_proto::envoy::service::discovery::v3::Resource;

use super::tests::{pod, response, service, service_resource, uid, workload_resource};
use super::*;
use crate::{
    control::ClusterView,
    state::{Service, Workload},
    store::WorkloadStore,
};

/// A view as sets (order is not part of it): workloads by id, services by
/// id, and the number of policies.
type Canonical = (Vec<(String, Workload)>, Vec<(String, Service)>, usize);

fn canonical(view: &ClusterView) -> Canonical {
    let mut workloads: Vec<(String, Workload)> = view
        .workloads
        .iter()
        .map(|w| (workload_id(w).into_owned(), Workload::clone(w)))
        .collect();
    workloads.sort_by(|a, b| a.0.cmp(&b.0));
    let mut services: Vec<(String, Service)> = view
        .services
        .iter()
        .map(|s| (s.id().to_string(), Service::clone(s)))
        .collect();
    services.sort_by(|a, b| a.0.cmp(&b.0));
    (workloads, services, view.policies.len())
}

fn backing(name: &str, ip: [u8; 4], service_key: &str, version: &str) -> Resource {
    let mut w = pod(name, ip);
    w.services = HashMap::from([(service_key.to_string(), workload_pb::PortList::default())]);
    workload_resource(w, version)
}

const WEB: &str = "default/web.default.svc.cluster.local";
const DB: &str = "default/db.default.svc.cluster.local";

#[test]
fn deltas_bring_the_store_where_a_complete_view_would() {
    let web = || {
        service(
            "default",
            "web",
            "web.default.svc.cluster.local",
            [198, 19, 0, 1],
        )
    };
    let db = || {
        service(
            "default",
            "db",
            "db.default.svc.cluster.local",
            [198, 19, 0, 2],
        )
    };
    // Each step one response; the expected delta's workload and service
    // ids after it.
    let steps: Vec<(DeltaDiscoveryResponse, &[&str], &[&str])> = vec![
        // A pod's IP changes: it, and the service it backs (endpoints).
        (
            response(vec![backing("a", [198, 18, 0, 9], WEB, "2")], &[]),
            &["Kubernetes//Pod/default/a"],
            &["default/web.default.svc.cluster.local"],
        ),
        // A pod moves from web to db: both services' endpoints.
        (
            response(vec![backing("b", [198, 18, 0, 2], DB, "2")], &[]),
            &["Kubernetes//Pod/default/b"],
            &[
                "default/web.default.svc.cluster.local",
                "default/db.default.svc.cluster.local",
            ],
        ),
        // A pod removed.
        (
            response(Vec::new(), &[&uid("a")]),
            &["Kubernetes//Pod/default/a"],
            &["default/web.default.svc.cluster.local"],
        ),
        // A service removed; a new pod outside any service.
        (
            response(
                vec![workload_resource(pod("c", [198, 18, 0, 3]), "1")],
                &["default/db.default.svc.cluster.local"],
            ),
            &["Kubernetes//Pod/default/c"],
            &["default/db.default.svc.cluster.local"],
        ),
        // The same resource again: nothing.
        (
            response(vec![workload_resource(pod("c", [198, 18, 0, 3]), "2")], &[]),
            &[],
            &[],
        ),
    ];

    let first = response(
        vec![
            backing("a", [198, 18, 0, 1], WEB, "1"),
            backing("b", [198, 18, 0, 2], WEB, "1"),
            service_resource(web()),
            service_resource(db()),
        ],
        &[],
    );
    let mut state = XdsState::new("istiod", "node");
    // Fed the same responses; asked for a complete view each time.
    let mut reference = XdsState::new("istiod", "node");
    state.apply(&first).expect("applies");
    reference.apply(&first).expect("applies");
    let (mut via_deltas, _) = state.view();
    let mut store = WorkloadStore::new();
    store.replace_all(via_deltas.workloads.clone());
    store.replace_services(via_deltas.services.clone());

    for (i, (step, workloads, services)) in steps.into_iter().enumerate() {
        state.apply(&step).expect("applies");
        reference.apply(&step).expect("applies");
        let (delta, _) = state.delta();
        let mut ids: Vec<&str> = delta.workloads.keys().map(String::as_str).collect();
        ids.sort();
        let mut expected: Vec<&str> = workloads.to_vec();
        expected.sort();
        assert_eq!(ids, expected, "step {i}: workloads in the delta");
        let mut ids: Vec<String> = delta.services.keys().map(ToString::to_string).collect();
        ids.sort();
        let mut expected: Vec<String> = services.iter().map(ToString::to_string).collect();
        expected.sort();
        assert_eq!(ids, expected, "step {i}: services in the delta");
        assert!(delta.policies.is_none(), "step {i}: no policy changed");

        let (whole, _) = reference.view();
        store.apply_delta(delta.workloads.clone(), delta.services.clone());
        via_deltas = via_deltas.with_delta(delta);
        assert_eq!(canonical(&via_deltas), canonical(&whole), "step {i}");
        // The store answers as one built from the complete view.
        let mut fresh = WorkloadStore::new();
        fresh.replace_all(whole.workloads.clone());
        fresh.replace_services(whole.services.clone());
        let as_seen = |store: &WorkloadStore| {
            let mut seen: Vec<String> = store.iter().map(|w| format!("{w:?}")).collect();
            seen.extend(store.services().iter().map(|s| format!("{s:?}")));
            seen.sort();
            seen
        };
        assert_eq!(as_seen(&store), as_seen(&fresh), "step {i}: the store");
    }
}

#[test]
fn a_policy_change_carries_every_policy() {
    let mut state = XdsState::new("istiod", "node");
    state
        .apply(&response(
            vec![workload_resource(pod("a", [198, 18, 0, 1]), "1")],
            &[],
        ))
        .expect("applies");
    let (_, _) = state.view();
    let policy = security_pb::Authorization {
        name: "deny-all".into(),
        namespace: "default".into(),
        scope: security_pb::Scope::Namespace as i32,
        action: security_pb::Action::Allow as i32,
        ..Default::default()
    };
    let authz = DeltaDiscoveryResponse {
        type_url: AUTHORIZATION_TYPE_URL.into(),
        resources: vec![Resource {
            name: "default/deny-all".into(),
            version: "1".into(),
            resource: Some(prost_types::Any {
                type_url: AUTHORIZATION_TYPE_URL.into(),
                value: policy.encode_to_vec(),
            }),
            ..Default::default()
        }],
        nonce: "p".into(),
        ..Default::default()
    };
    state.apply(&authz).expect("applies");
    let (delta, _) = state.delta();
    assert!(delta.workloads.is_empty() && delta.services.is_empty());
    let policies = delta.policies.expect("the policies changed");
    assert_eq!(policies.len(), 1);
    assert_eq!(policies[0].name, "deny-all");
    // Nothing more since.
    let (again, _) = state.delta();
    assert!(again.is_empty(), "{again:?}");
}

/// An authorization response adding `name` at `version` (or, with
/// `removed`, removing it).
fn authorization_response(name: &str, version: &str, removed: bool) -> DeltaDiscoveryResponse {
    let (namespace, policy) = name.split_once('/').unwrap_or(("default", name));
    let resource = Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: AUTHORIZATION_TYPE_URL.into(),
            value: security_pb::Authorization {
                name: policy.into(),
                namespace: namespace.into(),
                scope: security_pb::Scope::Namespace as i32,
                action: security_pb::Action::Allow as i32,
                ..Default::default()
            }
            .encode_to_vec(),
        }),
        ..Default::default()
    };
    DeltaDiscoveryResponse {
        type_url: AUTHORIZATION_TYPE_URL.into(),
        resources: if removed { vec![] } else { vec![resource] },
        removed_resources: if removed { vec![name.into()] } else { vec![] },
        nonce: "p".into(),
        ..Default::default()
    }
}

/// The status's resource list is changed per resource a response touched
/// (it is not rebuilt): after additions, a version bump, removals of both
/// types, it lists what is held, in `/config_dump`'s order (addresses by
/// name, then policies), counts it per kind and serializes as that list.
#[test]
fn the_status_lists_what_is_held_after_each_change() {
    let web = "default/web.default.svc.cluster.local";
    let mut state = XdsState::new("istiod", "node");
    state
        .apply(&response(
            vec![
                workload_resource(pod("b", [198, 18, 0, 2]), "1"),
                workload_resource(pod("a", [198, 18, 0, 1]), "1"),
                service_resource(service(
                    "default",
                    "web",
                    "web.default.svc.cluster.local",
                    [198, 19, 0, 1],
                )),
            ],
            &[],
        ))
        .expect("applies");
    state
        .apply(&authorization_response("default/allow-a", "3", false))
        .expect("applies");
    state
        .apply(&authorization_response("default/allow-b", "4", false))
        .expect("applies");
    let first = state.status().resources;
    state
        .apply(&response(
            vec![workload_resource(pod("a", [198, 18, 0, 1]), "2")],
            &[&uid("b")],
        ))
        .expect("applies");
    state
        .apply(&authorization_response("default/allow-b", "", true))
        .expect("applies");

    let listed = state.status().resources;
    let rows: Vec<(&str, &str, &str)> = listed
        .iter()
        .map(|r| (r.kind.as_str(), r.name.as_str(), r.version.as_str()))
        .collect();
    let a = uid("a");
    assert_eq!(
        rows,
        [
            ("workload", a.as_str(), "2"),
            ("service", web, "1"),
            ("authorization", "default/allow-a", "3"),
        ]
    );
    assert_eq!(
        [
            listed.count("workload"),
            listed.count("service"),
            listed.count("authorization")
        ],
        [1, 1, 1]
    );
    // What was published before stays as it was (a snapshot, not a view).
    assert_eq!(first.len(), 5);
    assert_eq!(first.count("workload"), 2);

    let json = serde_json::to_value(&listed).expect("serializes");
    assert_eq!(
        json,
        serde_json::json!([
            {"kind": "workload", "name": a, "version": "2"},
            {"kind": "service", "name": web, "version": "1"},
            {"kind": "authorization", "name": "default/allow-a", "version": "3"},
        ])
    );
    let back: ResourceList = serde_json::from_value(json).expect("deserializes");
    assert_eq!(back, listed);
}

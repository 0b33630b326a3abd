//! istiod's xDS resources (delta ADS): `istio.workload.Address` (a workload
//! or a service) and `istio.security.Authorization`, as protobuf bytes in a
//! `google.protobuf.Any`, applied a response at a time by [`XdsState`].

use proptest::prelude::*;
use prost::Message as _;
use shunt_proto::{
    envoy::service::discovery::v3::{DeltaDiscoveryResponse, Resource},
    istio::{security as security_pb, workload as workload_pb},
};

use super::{edits, mutate};
use crate::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, ResourceType, XdsState};

fn workload(name: &str, ip: [u8; 4]) -> Vec<u8> {
    workload_pb::Address {
        r#type: Some(workload_pb::address::Type::Workload(
            workload_pb::Workload {
                uid: name.into(),
                name: name.into(),
                namespace: "default".into(),
                service_account: "sleep".into(),
                node: "node-a".into(),
                addresses: vec![ip.to_vec()],
                tunnel_protocol: workload_pb::TunnelProtocol::Hbone as i32,
                authorization_policies: vec!["default/allow-sleep".into()],
                ..Default::default()
            },
        )),
    }
    .encode_to_vec()
}

fn service() -> Vec<u8> {
    workload_pb::Address {
        r#type: Some(workload_pb::address::Type::Service(workload_pb::Service {
            name: "web".into(),
            namespace: "default".into(),
            hostname: "web.default.svc.cluster.local".into(),
            addresses: vec![workload_pb::NetworkAddress {
                network: String::new(),
                address: vec![198, 19, 100, 1],
                ..Default::default()
            }],
            ports: vec![workload_pb::Port {
                service_port: 80,
                target_port: 8080,
                ..Default::default()
            }],
            ..Default::default()
        })),
    }
    .encode_to_vec()
}

fn policy() -> Vec<u8> {
    let exact = |s: &str| security_pb::StringMatch {
        match_type: Some(security_pb::string_match::MatchType::Exact(s.into())),
    };
    security_pb::Authorization {
        name: "allow-sleep".into(),
        namespace: "default".into(),
        scope: security_pb::Scope::WorkloadSelector as i32,
        action: security_pb::Action::Allow as i32,
        rules: vec![security_pb::Rule {
            clauses: vec![security_pb::Clause {
                matches: vec![security_pb::Match {
                    principals: vec![exact("cluster.local/ns/default/sa/sleep")],
                    source_ips: vec![security_pb::Address {
                        address: vec![198, 18, 0, 0],
                        length: 15,
                    }],
                    destination_ports: vec![8080],
                    ..Default::default()
                }],
            }],
        }],
        dry_run: false,
        ..Default::default()
    }
    .encode_to_vec()
}

fn resource(type_url: &str, name: &str, value: Vec<u8>) -> Resource {
    Resource {
        name: name.into(),
        version: "2".into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value,
        }),
        ..Default::default()
    }
}

fn response(type_url: &str, resources: Vec<Resource>) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: type_url.into(),
        resources,
        nonce: "n".into(),
        ..Default::default()
    }
}

/// A state holding version 1 of a workload and a policy.
fn held() -> XdsState {
    let mut state = XdsState::new("istiod", "node");
    let mut w = resource(
        ADDRESS_TYPE_URL,
        "Kubernetes//Pod/default/a",
        workload("a", [198, 18, 0, 1]),
    );
    w.version = "1".into();
    let mut p = resource(AUTHORIZATION_TYPE_URL, "default/allow-sleep", policy());
    p.version = "1".into();
    state
        .apply(&response(ADDRESS_TYPE_URL, vec![w]))
        .expect("seed workload");
    state
        .apply(&response(AUTHORIZATION_TYPE_URL, vec![p]))
        .expect("seed policy");
    state
}

#[test]
fn the_seeds_are_valid() {
    let mut state = held();
    state
        .apply(&response(
            ADDRESS_TYPE_URL,
            vec![
                resource(
                    ADDRESS_TYPE_URL,
                    "Kubernetes//Pod/default/b",
                    workload("b", [198, 18, 0, 2]),
                ),
                resource(
                    ADDRESS_TYPE_URL,
                    "default/web.default.svc.cluster.local",
                    service(),
                ),
            ],
        ))
        .expect("valid addresses");
    state
        .apply(&response(
            AUTHORIZATION_TYPE_URL,
            vec![resource(
                AUTHORIZATION_TYPE_URL,
                "default/allow-sleep",
                policy(),
            )],
        ))
        .expect("valid policy");
}

/// Which seed a mutated resource starts from.
fn seed(which: u8) -> (&'static str, &'static str, Vec<u8>) {
    match which % 3 {
        0 => (
            ADDRESS_TYPE_URL,
            "Kubernetes//Pod/default/b",
            workload("b", [198, 18, 0, 2]),
        ),
        1 => (
            ADDRESS_TYPE_URL,
            "default/web.default.svc.cluster.local",
            service(),
        ),
        _ => (AUTHORIZATION_TYPE_URL, "default/allow-sleep", policy()),
    }
}

proptest! {
    /// A response with one mutated resource beside a valid one: applied
    /// whole, or refused whole naming the resource, the state as it was.
    #[test]
    fn a_mutated_resource_applies_or_is_refused_whole(which in any::<u8>(), edits in edits()) {
        let (type_url, name, value) = seed(which);
        let mutated = mutate(&value, &edits);
        let mut resources = vec![resource(type_url, name, mutated)];
        if type_url == ADDRESS_TYPE_URL {
            resources.push(resource(type_url, "Kubernetes//Pod/default/c", workload("c", [198, 18, 0, 3])));
        }
        let mut state = held();
        let ty = ResourceType::from_type_url(type_url).expect("known type");
        let before = state.versions(ty);
        match state.apply(&response(type_url, resources)) {
            Ok(_) => {}
            Err(e) => {
                let text = e.to_string();
                // The mutated resource, or the valid one whose address it
                // now claims too.
                prop_assert!(
                    text.contains(name) || text.contains("Kubernetes//Pod/default/c"),
                    "the refusal names no resource: {text}"
                );
                prop_assert_eq!(state.versions(ty), before, "a refused response changed the state");
            }
        }
    }
}

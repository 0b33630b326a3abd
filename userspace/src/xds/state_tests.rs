//! `XdsState`: per-resource NACK, last good copies, versions held,
//! host-network workloads, keys as xDS names them, and deltas that share
//! what did not change. Each table row is one xDS input and the outcome a
//! user sees (NACK text, what is served).

use std::{collections::HashMap, net::IpAddr, sync::Arc};

use shunt_proto::envoy::service::discovery::v3::Resource;

use super::*;
use crate::store::WorkloadStore;

pub(super) fn pod(name: &str, ip: [u8; 4]) -> workload_pb::Workload {
    workload_pb::Workload {
        uid: format!("Kubernetes//Pod/default/{name}"),
        name: name.into(),
        namespace: "default".into(),
        addresses: vec![ip.to_vec()],
        tunnel_protocol: workload_pb::TunnelProtocol::Hbone as i32,
        node: "node-a".into(),
        ..Default::default()
    }
}

fn address_resource(name: &str, version: &str, address: workload_pb::address::Type) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: ADDRESS_TYPE_URL.into(),
            value: workload_pb::Address {
                r#type: Some(address),
            }
            .encode_to_vec(),
        }),
        ..Default::default()
    }
}

pub(super) fn workload_resource(w: workload_pb::Workload, version: &str) -> Resource {
    let uid = w.uid.clone();
    address_resource(&uid, version, workload_pb::address::Type::Workload(w))
}

pub(super) fn service(ns: &str, name: &str, hostname: &str, vip: [u8; 4]) -> workload_pb::Service {
    workload_pb::Service {
        name: name.into(),
        namespace: ns.into(),
        hostname: hostname.into(),
        addresses: vec![workload_pb::NetworkAddress {
            address: vip.to_vec(),
            ..Default::default()
        }],
        ports: vec![workload_pb::Port {
            service_port: 80,
            target_port: 8080,
            ..Default::default()
        }],
        ..Default::default()
    }
}

pub(super) fn service_resource(s: workload_pb::Service) -> Resource {
    let name = format!("{}/{}", s.namespace, s.hostname);
    address_resource(&name, "1", workload_pb::address::Type::Service(s))
}

pub(super) fn response(resources: Vec<Resource>, removed: &[&str]) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        type_url: ADDRESS_TYPE_URL.into(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
        nonce: "n".into(),
        ..Default::default()
    }
}

pub(super) fn uid(name: &str) -> String {
    format!("Kubernetes//Pod/default/{name}")
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

/// The store the proxy looks up in, after the view.
fn store_of(state: &mut XdsState) -> WorkloadStore {
    let (view, _) = state.view();
    let mut store = WorkloadStore::new();
    store.replace_all(view.workloads);
    store.replace_services(view.services);
    store
}

/// How a row spoils the resource `c` (and a new version of the held `a`).
type Spoil = fn(&mut Resource);

fn set_workload(r: &mut Resource, change: fn(&mut workload_pb::Workload)) {
    let Some(any) = r.resource.as_mut() else {
        return;
    };
    let mut address = workload_pb::Address::decode(any.value.as_slice()).expect("test resource");
    if let Some(workload_pb::address::Type::Workload(w)) = address.r#type.as_mut() {
        change(w);
    }
    any.value = address.encode_to_vec();
}

/// Each bad resource is NACKed alone, named with its field and reason;
/// the good resources of the same response apply; a refused new version
/// of a held resource leaves the last good copy serving, and only that
/// copy's version is reported on reconnect.
#[test]
fn each_bad_resource_is_refused_alone() {
    let rows: Vec<(&str, Spoil, &str)> = vec![
        (
            "does not decode",
            |r| {
                if let Some(any) = r.resource.as_mut() {
                    any.value = vec![0xff, 0xff];
                }
            },
            "resource.value: does not decode",
        ),
        (
            "unknown tunnel protocol",
            |r| set_workload(r, |w| w.tunnel_protocol = 9),
            "workload.tunnel_protocol: unknown value 9",
        ),
        (
            "LEGACY_ISTIO_MTLS",
            |r| set_workload(r, |w| w.tunnel_protocol = 2),
            "workload.tunnel_protocol: LEGACY_ISTIO_MTLS",
        ),
        (
            "unknown network mode",
            |r| set_workload(r, |w| w.network_mode = 7),
            "workload.network_mode: unknown value 7",
        ),
        (
            "wrong type URL",
            |r| {
                if let Some(any) = r.resource.as_mut() {
                    any.type_url = AUTHORIZATION_TYPE_URL.into();
                }
            },
            "resource.type_url",
        ),
    ];
    for (row, spoil, field_and_reason) in rows {
        let mut state = XdsState::new("istiod", "node");
        let first = state
            .apply(&response(
                vec![workload_resource(pod("a", [198, 18, 0, 1]), "1")],
                &[],
            ))
            .expect("subscribed type");
        assert_eq!(first.nack_reason(), None, "{row}");

        let mut a2 = workload_resource(pod("a", [198, 18, 0, 11]), "2");
        spoil(&mut a2);
        let mut c = workload_resource(pod("c", [198, 18, 0, 3]), "1");
        spoil(&mut c);
        let svc = service(
            "default",
            "web",
            "web.default.svc.cluster.local",
            [198, 19, 0, 1],
        );
        let applied = state
            .apply(&response(
                vec![
                    workload_resource(pod("b", [198, 18, 0, 2]), "1"),
                    a2,
                    c,
                    service_resource(svc),
                ],
                &[],
            ))
            .expect("subscribed type");
        let rejected: Vec<&str> = applied
            .rejected
            .iter()
            .map(|e| e.resource.as_str())
            .collect();
        let (a, c) = (uid("a"), uid("c"));
        assert_eq!(rejected, [a.as_str(), c.as_str()], "{row}");
        let reason = applied.nack_reason().expect("a NACK");
        assert!(
            reason.contains(&format!("resource {c:?}: {field_and_reason}")),
            "{row}: {reason}"
        );
        assert!(
            reason.starts_with("2 resource(s) rejected, the rest applied"),
            "{row}: {reason}"
        );

        let store = store_of(&mut state);
        assert_eq!(
            store.by_ip(ip("198.18.0.2")).map(|w| w.name.as_str()),
            Some("b"),
            "{row}: the good workload of the response applies"
        );
        assert!(
            store
                .services()
                .by_addr("198.19.0.1:80".parse().expect("addr"))
                .is_some(),
            "{row}: the new service of the response is served"
        );
        assert_eq!(
            store.by_ip(ip("198.18.0.1")).map(|w| w.name.as_str()),
            Some("a"),
            "{row}: the refused update keeps the last good copy"
        );
        assert!(store.by_ip(ip("198.18.0.11")).is_none(), "{row}");
        assert!(store.by_ip(ip("198.18.0.3")).is_none(), "{row}");

        let versions = state.versions(ResourceType::Address);
        assert_eq!(
            versions.get(&a),
            Some(&"1".to_string()),
            "{row}: last good version"
        );
        assert_eq!(versions.get(&c), None, "{row}: never held");
        assert_eq!(versions.get(&uid("b")), Some(&"1".to_string()), "{row}");
    }
}

/// Refusals that are about the response's shape, not one resource's body.
#[test]
fn names_are_checked_per_resource() {
    let mut state = XdsState::new("istiod", "node");
    let mut nameless = workload_resource(pod("x", [198, 18, 0, 9]), "1");
    nameless.name.clear();
    let applied = state
        .apply(&response(
            vec![
                workload_resource(pod("a", [198, 18, 0, 1]), "1"),
                workload_resource(pod("a", [198, 18, 0, 5]), "1"),
                nameless,
                workload_resource(pod("gone", [198, 18, 0, 6]), "1"),
            ],
            &["Kubernetes//Pod/default/gone"],
        ))
        .expect("subscribed type");
    let got: Vec<(String, String)> = applied
        .rejected
        .iter()
        .map(|e| (e.resource.clone(), e.field.clone()))
        .collect();
    assert_eq!(
        got,
        [
            (uid("a"), "name".to_string()),
            ("resources[2]".to_string(), "name".to_string()),
            (uid("gone"), "removed_resources".to_string()),
        ]
    );
    let store = store_of(&mut state);
    assert_eq!(store.len(), 1, "the first `a` only");
    assert!(store.by_ip(ip("198.18.0.1")).is_some());

    let mut r = response(vec![], &[]);
    r.type_url = "type.googleapis.com/envoy.config.cluster.v3.Cluster".into();
    assert!(matches!(state.apply(&r), Err(Rejected::UnknownType(_))));
}

/// Two host-network pods of one node share its IP: no NACK, both kept as
/// workloads, neither owns the IP; a pod sharing an IP with another
/// (e.g. a reused IP) is ACKed too, the pod-in-mesh ranked first.
#[test]
fn host_network_workloads_share_the_node_ip() {
    let mut state = XdsState::new("istiod", "node");
    let host = |name: &str| {
        let mut w = pod(name, [198, 18, 0, 100]);
        w.network_mode = workload_pb::NetworkMode::HostNetwork as i32;
        w.tunnel_protocol = workload_pb::TunnelProtocol::None as i32;
        workload_resource(w, "1")
    };
    let applied = state
        .apply(&response(
            vec![
                host("kube-proxy"),
                host("cni-agent"),
                workload_resource(pod("web", [198, 18, 0, 7]), "1"),
            ],
            &[],
        ))
        .expect("subscribed type");
    assert_eq!(applied.nack_reason(), None);
    let (view, warnings) = state.view();
    assert!(warnings.is_empty(), "{warnings:?}");
    assert_eq!(view.workloads.len(), 3);
    let store = store_of(&mut state);
    assert!(
        store.by_ip(ip("198.18.0.100")).is_none(),
        "the node's IP names no pod"
    );
    assert!(
        store
            .get(&crate::state::WorkloadKey::new("default", "kube-proxy"))
            .is_some_and(|w| w.host_network)
    );
    assert_eq!(
        store.by_ip(ip("198.18.0.7")).map(|w| w.name.as_str()),
        Some("web")
    );

    // One IP in two non-host-network workloads: applied, warned, ranked.
    let mut plain = pod("old", [198, 18, 0, 7]);
    plain.tunnel_protocol = workload_pb::TunnelProtocol::None as i32;
    let applied = state
        .apply(&response(vec![workload_resource(plain, "1")], &[]))
        .expect("subscribed type");
    assert_eq!(applied.nack_reason(), None);
    let (_, warnings) = state.view();
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("198.18.0.7"), "{warnings:?}");
    let store = store_of(&mut state);
    assert_eq!(
        store.by_ip(ip("198.18.0.7")).map(|w| w.name.as_str()),
        Some("web"),
        "the pod in the mesh first"
    );
}

/// Resources are keyed as xDS names them: a WorkloadEntry named like a
/// pod is another workload (the pod keeps its address and HBONE), and a
/// ServiceEntry's two hosts are two services of one name.
#[test]
fn keys_are_uid_and_namespace_hostname() {
    let mut state = XdsState::new("istiod", "node");
    let mut entry = pod("server", [198, 18, 0, 50]);
    entry.uid = "Kubernetes/networking.istio.io/WorkloadEntry/default/server".into();
    entry.tunnel_protocol = workload_pb::TunnelProtocol::None as i32;
    let applied = state
        .apply(&response(
            vec![
                workload_resource(pod("server", [198, 18, 0, 10]), "1"),
                workload_resource(entry, "1"),
                service_resource(service(
                    "default",
                    "ext",
                    "a.ext.example.com",
                    [198, 19, 0, 41],
                )),
                service_resource(service(
                    "default",
                    "ext",
                    "b.ext.example.com",
                    [198, 19, 0, 42],
                )),
            ],
            &[],
        ))
        .expect("subscribed type");
    assert_eq!(applied.nack_reason(), None);
    let store = store_of(&mut state);
    let at = |s: &str| store.by_ip(ip(s)).map(|w| (w.uid.clone(), w.wants_mesh()));
    assert_eq!(
        at("198.18.0.10"),
        Some((uid("server"), true)),
        "the pod keeps HBONE"
    );
    assert_eq!(
        at("198.18.0.50").map(|(u, _)| u),
        Some("Kubernetes/networking.istio.io/WorkloadEntry/default/server".to_string())
    );
    assert_eq!(
        store
            .get(&crate::state::WorkloadKey::new("default", "server"))
            .map(|w| w.uid.clone()),
        Some(uid("server")),
        "by name: the pod"
    );
    for (vip, host) in [
        ("198.19.0.41:80", "a.ext.example.com"),
        ("198.19.0.42:80", "b.ext.example.com"),
    ] {
        let served = store.services().by_addr(vip.parse().expect("addr"));
        assert_eq!(served.map(|s| s.hostname.as_str()), Some(host));
    }
}

/// A one-workload delta replaces that workload's entry and the services it
/// backs; everything else is the same shared entry.
#[test]
fn a_delta_shares_what_did_not_change() {
    let mut state = XdsState::new("istiod", "node");
    let backing = |name: &str, ip: [u8; 4], revision: &str| {
        let mut w = pod(name, ip);
        w.canonical_revision = revision.into();
        w.services = HashMap::from([(
            "default/web.default.svc.cluster.local".to_string(),
            workload_pb::PortList::default(),
        )]);
        workload_resource(w, revision)
    };
    state
        .apply(&response(
            vec![
                backing("a", [198, 18, 0, 1], "v1"),
                backing("b", [198, 18, 0, 2], "v1"),
                workload_resource(pod("c", [198, 18, 0, 3]), "1"),
                service_resource(service(
                    "default",
                    "web",
                    "web.default.svc.cluster.local",
                    [198, 19, 0, 1],
                )),
                service_resource(service(
                    "default",
                    "db",
                    "db.default.svc.cluster.local",
                    [198, 19, 0, 2],
                )),
            ],
            &[],
        ))
        .expect("subscribed type");
    let (before, _) = state.view();
    let web = &before
        .services
        .iter()
        .find(|s| s.name == "web")
        .expect("web")
        .endpoints;
    assert_eq!(web.len(), 2);

    // A revision change: the workload is new, its service's endpoints equal.
    state
        .apply(&response(vec![backing("a", [198, 18, 0, 1], "v2")], &[]))
        .expect("subscribed type");
    let (after, _) = state.view();
    let same = |v: &ClusterView, w: &ClusterView, name: &str| {
        let find = |v: &ClusterView| v.workloads.iter().find(|x| x.name == name).cloned();
        Arc::ptr_eq(&find(v).expect("before"), &find(w).expect("after"))
    };
    assert!(!same(&before, &after, "a"));
    assert!(same(&before, &after, "b") && same(&before, &after, "c"));
    assert!(
        before
            .services
            .iter()
            .zip(&after.services)
            .all(|(x, y)| Arc::ptr_eq(x, y)),
        "endpoints did not change: the services are the same entries"
    );

    // An address change: web's endpoints follow, db is the same entry.
    state
        .apply(&response(vec![backing("a", [198, 18, 0, 9], "v2")], &[]))
        .expect("subscribed type");
    let (moved, _) = state.view();
    let find = |v: &ClusterView, n: &str| {
        v.services
            .iter()
            .find(|s| s.name == n)
            .cloned()
            .expect("svc")
    };
    assert!(Arc::ptr_eq(&find(&after, "db"), &find(&moved, "db")));
    let ips: Vec<IpAddr> = find(&moved, "web").endpoints.iter().map(|e| e.ip).collect();
    assert_eq!(ips, [ip("198.18.0.9"), ip("198.18.0.2")]);

    // Removal of a backer and of a service.
    state
        .apply(&response(
            vec![],
            &[&uid("b"), "default/db.default.svc.cluster.local"],
        ))
        .expect("subscribed type");
    let (removed, _) = state.view();
    assert_eq!(removed.services.len(), 1);
    assert_eq!(find(&removed, "web").endpoints.len(), 1);
    assert_eq!(removed.workloads.len(), 2);
}

#[test]
fn warnings_follow_what_is_held() {
    let mut state = XdsState::new("istiod", "node");
    let mut w = pod("a", [198, 18, 0, 1]);
    w.services = HashMap::from([(
        "default/late.default.svc.cluster.local".to_string(),
        workload_pb::PortList::default(),
    )]);
    w.authorization_policies = vec!["default/allow".into()];
    state
        .apply(&response(vec![workload_resource(w, "1")], &[]))
        .expect("subscribed type");
    let (_, new) = state.view();
    assert_eq!(new.len(), 2, "{new:?}");
    assert_eq!(state.status().warnings.len(), 2);
    state
        .apply(&response(
            vec![service_resource(service(
                "default",
                "late",
                "late.default.svc.cluster.local",
                [198, 19, 0, 9],
            ))],
            &[],
        ))
        .expect("subscribed type");
    let (view, new) = state.view();
    assert!(new.is_empty(), "{new:?}");
    assert_eq!(
        view.services[0].endpoints.len(),
        1,
        "the late service gets its endpoint"
    );
    let warnings = state.status().warnings;
    assert_eq!(warnings.len(), 1, "{warnings:?}");
    assert!(warnings[0].contains("policy default/allow"), "{warnings:?}");
}

#[test]
fn unknown_type_and_versions() {
    let mut state = XdsState::new("a", "n");
    state
        .apply(&response(
            vec![workload_resource(pod("a", [198, 18, 0, 1]), "1")],
            &[],
        ))
        .expect("valid");
    assert_eq!(
        state.versions(ResourceType::Address),
        HashMap::from([(uid("a"), "1".into())])
    );
    assert!(!state.synced());
    state.record_ack(ADDRESS_TYPE_URL, "n1", "v");
    state.record_ack(AUTHORIZATION_TYPE_URL, "n2", "v");
    assert!(state.synced());
    let status = state.status();
    assert_eq!(status.resources.len(), 1);
    assert_eq!(status.types.len(), 2);
}

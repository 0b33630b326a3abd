//! Waypoints in the workloads file: `namespaces:` (their labels),
//! `waypoints:` (the file's waypoint `Gateway`s) and the
//! `istio.io/use-waypoint` labels of namespaces, services and workloads,
//! decided by [`crate::control::waypoint`] exactly as the Kubernetes watch
//! decides them, so the proxy routes the same with or without istiod.
//!
//! ```yaml
//! namespaces:                          # optional: labels of namespaces
//!   - name: shop
//!     labels: {istio.io/use-waypoint: shop-waypoint}
//! waypoints:                           # optional: waypoint Gateways
//!   - name: shop-waypoint              # its service has this name
//!     namespace: shop
//!     for: service                     # service (default), workload, all or none
//! services:
//!   - name: shop-waypoint              # the waypoint's service: required;
//!     namespace: shop                  # its endpoints are the waypoint's pods
//!     clusterIPs: ["198.19.0.9"]
//!     ports: [{port: 15008}]
//!     endpoints: [shop-waypoint-0]
//!   - name: web
//!     namespace: shop
//!     labels: {istio.io/use-waypoint: none}   # opts out of the namespace's
//!     ...
//! ```
//!
//! A workload's `labels` bind it the same way. Unlike Istio, which gives no
//! waypoint to an object bound to a gateway that does not exist, the file
//! rejects such a binding (a typo would silently bypass L7 policy); so does
//! it a service's or workload's own binding to a waypoint that does not
//! serve its kind. A namespace's binding to a waypoint of one kind is
//! normal: objects of the other kind simply get none. The waypoint's pods
//! (the endpoints of its service) and its service get no waypoint.

use std::collections::{BTreeMap, HashMap, HashSet};

use serde::Deserialize;

use super::{Entry, NameRule, Problem};
use crate::{
    control::waypoint::{
        self, BoundBy, Kind, Resolution, Subject, WaypointFor, WaypointGateway, Waypoints,
    },
    state::{Service, Workload, WorkloadKey},
};

/// An entry of `namespaces:`.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a namespace (a mapping with `name` and optionally `labels`)"
)]
pub(super) struct RawNamespace {
    name: String,
    #[serde(default)]
    labels: BTreeMap<String, String>,
}

/// An entry of `waypoints:`.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    expecting = "a waypoint (a mapping with `name`, `namespace` and optionally `for`)"
)]
pub(super) struct RawWaypoint {
    name: String,
    namespace: String,
    /// Kept as text so a bad value is reported with its entry.
    #[serde(rename = "for")]
    waypoint_for: Option<String>,
}

/// The field a binding problem is reported on.
const FIELD: &str = "labels[istio.io/use-waypoint]";

/// Everything of the file the waypoint rules read besides the new lists.
pub(super) struct Inputs<'a> {
    /// `--cluster-domain`: waypoint hostnames end in it.
    pub cluster_domain: &'a str,
    /// Every `workloads` entry's key, in file order (for entry indexes).
    pub workload_order: &'a [WorkloadKey],
    /// Every `services` entry's key and labels, in file order.
    pub service_labels: &'a [(WorkloadKey, BTreeMap<String, String>)],
}

/// Checks `namespaces` and `waypoints` and every binding, and sets the
/// waypoint of each workload and service (the results are only used when
/// no problem was found).
pub(super) fn check(
    namespaces: Vec<RawNamespace>,
    raw_waypoints: Vec<RawWaypoint>,
    inputs: Inputs<'_>,
    workloads: &mut [Workload],
    services: &mut [Service],
    problems: &mut Vec<Problem>,
) {
    let mut namespace_labels: HashMap<String, (usize, BTreeMap<String, String>)> = HashMap::new();
    for (index, raw) in namespaces.into_iter().enumerate() {
        let entry = Entry {
            list: "namespaces",
            index,
            label: Some(raw.name.clone()).filter(|n| !n.is_empty()),
        };
        if let Some(message) = NameRule::Label.check(&raw.name) {
            problems.push(problem(entry, "name", message));
            continue;
        }
        match namespace_labels.get(&raw.name) {
            Some((first, _)) => problems.push(problem(
                entry,
                "name",
                format!("{} is already defined by namespaces[{first}]", raw.name),
            )),
            None => {
                namespace_labels.insert(raw.name, (index, raw.labels));
            }
        }
    }

    let service_keys: HashSet<&WorkloadKey> =
        inputs.service_labels.iter().map(|(k, _)| k).collect();
    let mut gateways: Vec<WaypointGateway> = Vec::new();
    let mut seen: HashMap<WorkloadKey, usize> = HashMap::new();
    for (index, raw) in raw_waypoints.into_iter().enumerate() {
        let entry = Entry::new("waypoints", index, Some(&raw.namespace), Some(&raw.name));
        let before = problems.len();
        let mut report =
            |field: &str, message: String| problems.push(problem(entry.clone(), field, message));
        // The waypoint's name is its service's: a DNS-1123 label.
        for (field, value) in [("name", &raw.name), ("namespace", &raw.namespace)] {
            if let Some(message) = NameRule::Label.check(value) {
                report(field, message);
            }
        }
        let waypoint_for = match raw.waypoint_for.as_deref().map(str::parse::<WaypointFor>) {
            None => WaypointFor::default(),
            Some(Ok(value)) => value,
            Some(Err(e)) => {
                report("for", e.to_string());
                WaypointFor::default()
            }
        };
        let key = WorkloadKey::new(&raw.namespace, &raw.name);
        let valid = problems.len() == before;
        let mut report =
            |field: &str, message: String| problems.push(problem(entry.clone(), field, message));
        if let Some(first) = seen.get(&key) {
            report(
                "name",
                format!("{key} is already defined by waypoints[{first}]"),
            );
        } else if valid {
            if !service_keys.contains(&key) {
                report(
                    "name",
                    format!(
                        "no service {key}: a waypoint is reached through the service of its \
                         name, whose endpoints are its pods (add it to `services`, port 15008)"
                    ),
                );
            }
            seen.insert(key, index);
        }
        gateways.push(WaypointGateway {
            namespace: raw.namespace,
            name: raw.name,
            waypoint_for,
        });
    }
    let known = Waypoints::new(gateways, inputs.cluster_domain);
    let unknown = |gateway: &WorkloadKey| {
        format!(
            "no waypoint {gateway} in `waypoints` (the value names a waypoint of the object's \
             namespace, or of the one istio.io/use-waypoint-namespace names; `none` opts out)"
        )
    };

    // A namespace's binding is reported once, at the namespace.
    for (name, (index, labels)) in &namespace_labels {
        if let Some(gateway) = waypoint::bound_gateway(labels, name)
            && known.get(&gateway).is_none()
        {
            let entry = Entry {
                list: "namespaces",
                index: *index,
                label: Some(name.clone()),
            };
            problems.push(problem(entry, FIELD, unknown(&gateway)));
        }
    }
    let not_served = |gateway: &WorkloadKey, waypoint_for: WaypointFor, kind: Kind| {
        format!(
            "waypoint {gateway} is `for: {waypoint_for}`: it serves no {kind} (a {kind} is \
             served by a waypoint for {kind} or all)"
        )
    };
    let ns_labels = |namespace: &str| namespace_labels.get(namespace).map(|(_, labels)| labels);

    for (index, (key, labels)) in inputs.service_labels.iter().enumerate() {
        let subject = Subject {
            kind: Kind::Service,
            namespace: &key.namespace,
            name: &key.name,
            labels,
            namespace_labels: ns_labels(&key.namespace),
        };
        let entry = Entry::new("services", index, Some(&key.namespace), Some(&key.name));
        match known.resolve(&subject) {
            Resolution::Waypoint(address) => {
                if let Some(service) = services.iter_mut().find(|s| s.key() == *key) {
                    service.waypoint = Some(address);
                }
            }
            Resolution::UnknownGateway {
                gateway,
                bound_by: BoundBy::Object,
            } => problems.push(problem(entry, FIELD, unknown(&gateway))),
            Resolution::NotServed {
                gateway,
                waypoint_for,
                bound_by: BoundBy::Object,
            } => problems.push(problem(
                entry,
                FIELD,
                not_served(&gateway, waypoint_for, Kind::Service),
            )),
            _ => {}
        }
    }

    // The waypoints' own pods: the endpoints of their services.
    let waypoint_pods: HashSet<WorkloadKey> = services
        .iter()
        .filter(|s| known.get(&s.key()).is_some())
        .flat_map(|s| s.endpoints.iter().filter_map(|e| e.pod.clone()))
        .collect();
    for workload in workloads.iter_mut() {
        let key = workload.key();
        if waypoint_pods.contains(&key) {
            continue;
        }
        let subject = Subject {
            kind: Kind::Workload,
            namespace: &key.namespace,
            name: &key.name,
            labels: &workload.labels,
            namespace_labels: ns_labels(&key.namespace),
        };
        let index = inputs
            .workload_order
            .iter()
            .position(|k| *k == key)
            .unwrap_or_default();
        let entry = Entry::new("workloads", index, Some(&key.namespace), Some(&key.name));
        match known.resolve(&subject) {
            Resolution::Waypoint(address) => workload.waypoint = Some(address),
            Resolution::UnknownGateway {
                gateway,
                bound_by: BoundBy::Object,
            } => problems.push(problem(entry, FIELD, unknown(&gateway))),
            Resolution::NotServed {
                gateway,
                waypoint_for,
                bound_by: BoundBy::Object,
            } => problems.push(problem(
                entry,
                FIELD,
                not_served(&gateway, waypoint_for, Kind::Workload),
            )),
            _ => {}
        }
    }
}

fn problem(entry: Entry, field: &str, message: String) -> Problem {
    Problem {
        entry: Some(entry),
        field: Some(field.to_owned()),
        message,
        location: None,
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::state::{GatewayAddress, GatewayDestination};

    use super::super::{parse, parse_in};

    /// A namespace bound to waypoint `shop/wp` (`for` as given), its
    /// service and pod, a service and workloads of the namespace; `extra`
    /// is appended to the file.
    fn file(waypoint_for: &str, extra: &str) -> String {
        format!(
            "\
workloads:
  - {{name: wp-0, namespace: shop, serviceAccount: wp, ips: [198.18.3.1], node: node-a}}
  - {{name: client, namespace: shop, serviceAccount: sleep, ips: [198.18.3.2], node: node-a}}
  - name: opted-out
    namespace: shop
    serviceAccount: sleep
    ips: [198.18.3.3]
    node: node-a
    labels: {{istio.io/use-waypoint: none}}
  - {{name: elsewhere, namespace: other, serviceAccount: sleep, ips: [198.18.3.4], node: node-a}}
services:
  - {{name: wp, namespace: shop, clusterIPs: [198.19.3.1], ports: [{{port: 15008}}], endpoints: [wp-0]}}
  - {{name: web, namespace: shop, clusterIPs: [198.19.3.2], ports: [{{port: 80}}], endpoints: [client]}}
  - name: db
    namespace: shop
    clusterIPs: [198.19.3.3]
    ports: [{{port: 5432}}]
    labels: {{istio.io/use-waypoint: none}}
  - {{name: api, namespace: other, clusterIPs: [198.19.3.4], ports: [{{port: 80}}]}}
namespaces:
  - name: shop
    labels: {{istio.io/use-waypoint: wp}}
  - name: other
waypoints:
  - {{name: wp, namespace: shop, for: {waypoint_for}}}
{extra}"
        )
    }

    fn error(text: &str) -> String {
        match parse(Path::new("workloads.yaml"), text) {
            Ok(parsed) => panic!("accepted bad input {text}: {parsed:?}"),
            Err(e) => e.to_string(),
        }
    }

    fn wp() -> Option<GatewayAddress> {
        Some(GatewayAddress {
            destination: GatewayDestination::Hostname {
                namespace: "shop".into(),
                hostname: "wp.shop.svc.cluster.local".into(),
            },
            hbone_mtls_port: 15008,
        })
    }

    #[test]
    fn a_namespace_binding_reaches_its_services_and_workloads_but_not_the_waypoint() {
        let parsed = parse(Path::new("w.yaml"), &file("all", "")).expect("valid");
        let service = |name: &str| {
            let s = parsed.services.iter().find(|s| s.name == name);
            s.expect("listed").waypoint.clone()
        };
        let workload = |name: &str| {
            let w = parsed.workloads.iter().find(|w| w.name == name);
            w.expect("listed").waypoint.clone()
        };
        assert_eq!(service("web"), wp());
        assert_eq!(service("db"), None, "opted out with none");
        assert_eq!(service("wp"), None, "the waypoint's own service");
        assert_eq!(service("api"), None, "another namespace");
        assert_eq!(workload("client"), wp());
        assert_eq!(workload("opted-out"), None);
        assert_eq!(workload("wp-0"), None, "the waypoint's own pod");
        assert_eq!(workload("elsewhere"), None);
        let web = parsed.services.iter().find(|s| s.name == "web");
        assert_eq!(
            web.map(|s| s.hostname.as_str()),
            Some("web.shop.svc.cluster.local")
        );
    }

    #[test]
    fn services_and_waypoints_are_named_in_the_configured_cluster_domain() {
        let parsed =
            parse_in(Path::new("w.yaml"), &file("all", ""), "corp.example").expect("valid");
        let web = parsed.services.iter().find(|s| s.name == "web");
        assert_eq!(
            web.map(|s| s.hostname.as_str()),
            Some("web.shop.svc.corp.example")
        );
        let client = parsed.workloads.iter().find(|w| w.name == "client");
        assert_eq!(
            client.and_then(|w| w.waypoint.clone()),
            Some(GatewayAddress {
                destination: GatewayDestination::Hostname {
                    namespace: "shop".into(),
                    hostname: "wp.shop.svc.corp.example".into(),
                },
                hbone_mtls_port: 15008,
            })
        );
    }

    #[test]
    fn for_decides_which_kinds_the_namespace_binding_reaches() {
        let parsed = parse(Path::new("w.yaml"), &file("service", "")).expect("valid");
        let web = parsed.services.iter().find(|s| s.name == "web");
        assert_eq!(web.and_then(|s| s.waypoint.clone()), wp());
        let client = parsed.workloads.iter().find(|w| w.name == "client");
        assert_eq!(client.and_then(|w| w.waypoint.clone()), None);

        let parsed = parse(Path::new("w.yaml"), &file("workload", "")).expect("valid");
        let web = parsed.services.iter().find(|s| s.name == "web");
        assert_eq!(web.and_then(|s| s.waypoint.clone()), None);
        let client = parsed.workloads.iter().find(|w| w.name == "client");
        assert_eq!(client.and_then(|w| w.waypoint.clone()), wp());

        // `for` defaults to service.
        let text = file("all", "").replace(", for: all", "");
        let parsed = parse(Path::new("w.yaml"), &text).expect("valid");
        let client = parsed.workloads.iter().find(|w| w.name == "client");
        assert_eq!(client.and_then(|w| w.waypoint.clone()), None);
    }

    /// (case, file text, fragment the message must contain).
    #[test]
    fn bad_bindings_and_waypoints_are_named_with_entry_and_field() {
        let cases: Vec<(&str, String, &str)> = vec![
            (
                "unknown waypoint on a namespace",
                file("all", "").replace("{istio.io/use-waypoint: wp}", "{istio.io/use-waypoint: wpp}"),
                "workloads.yaml: namespaces[0] (shop): field `labels[istio.io/use-waypoint]`: no waypoint shop/wpp in `waypoints`",
            ),
            (
                "unknown waypoint on a service",
                file("all", "").replace(
                    "ports: [{port: 5432}]\n    labels: {istio.io/use-waypoint: none}",
                    "ports: [{port: 5432}]\n    labels: {istio.io/use-waypoint: wp, istio.io/use-waypoint-namespace: infra}",
                ),
                "workloads.yaml: services[2] (shop/db): field `labels[istio.io/use-waypoint]`: no waypoint infra/wp in `waypoints`",
            ),
            (
                "unknown waypoint on a workload",
                file("all", "").replace(
                    "node: node-a\n    labels: {istio.io/use-waypoint: none}",
                    "node: node-a\n    labels: {istio.io/use-waypoint: nope}",
                ),
                "workloads.yaml: workloads[2] (shop/opted-out): field `labels[istio.io/use-waypoint]`: no waypoint shop/nope",
            ),
            (
                "a workload's own binding to a waypoint for services",
                file("service", "").replace(
                    "node: node-a\n    labels: {istio.io/use-waypoint: none}",
                    "node: node-a\n    labels: {istio.io/use-waypoint: wp}",
                ),
                "workloads[2] (shop/opted-out): field `labels[istio.io/use-waypoint]`: waypoint shop/wp is `for: service`: it serves no workload",
            ),
            (
                "bad for",
                file("Service", ""),
                "workloads.yaml: waypoints[0] (shop/wp): field `for`: unknown value \"Service\"; expected service, workload, all or none",
            ),
            (
                "a waypoint without its service",
                file("all", "  - {name: wp2, namespace: shop}\n"),
                "workloads.yaml: waypoints[1] (shop/wp2): field `name`: no service shop/wp2: a waypoint is reached through the service of its name",
            ),
            (
                "a waypoint listed twice",
                file("all", "  - {name: wp, namespace: shop}\n"),
                "waypoints[1] (shop/wp): field `name`: shop/wp is already defined by waypoints[0]",
            ),
            (
                "a namespace listed twice",
                file("all", "").replace("  - name: other\n", "  - name: shop\n"),
                "workloads.yaml: namespaces[1] (shop): field `name`: shop is already defined by namespaces[0]",
            ),
            (
                "a bad namespace name",
                file("all", "").replace("  - name: other\n", "  - name: Other\n"),
                "namespaces[1] (Other): field `name`: \"Other\" is not a DNS-1123 label",
            ),
            (
                "unknown field in a waypoint",
                file("all", "  - {name: wp2, namespace: shop, fro: all}\n"),
                "workloads.yaml: waypoints[1] (shop/wp2): field `fro`: unknown field; expected one of `name`, `namespace`, `for`",
            ),
            (
                "unknown field in a namespace",
                file("all", "").replace("  - name: other\n", "  - name: other\n    label: {}\n"),
                "workloads.yaml: namespaces[1]: field `label`: unknown field; expected `name` or `labels`",
            ),
        ];
        for (case, text, fragment) in cases {
            let message = error(&text);
            assert!(message.contains(fragment), "{case}: {message}");
            assert!(message.starts_with("workloads.yaml: "), "{case}: {message}");
        }
    }
}

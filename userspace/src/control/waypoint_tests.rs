use super::*;

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn waypoints(gateways: &[(&str, &str, WaypointFor)]) -> Waypoints {
    Waypoints::new(
        gateways.iter().map(|(ns, name, f)| WaypointGateway {
            namespace: ns.to_string(),
            name: name.to_string(),
            waypoint_for: *f,
        }),
        DEFAULT_CLUSTER_DOMAIN,
    )
}

fn hostname(resolution: Resolution) -> Option<String> {
    match resolution.waypoint()? {
        GatewayAddress {
            destination:
                GatewayDestination::Hostname {
                    namespace,
                    hostname,
                },
            hbone_mtls_port,
        } => Some(format!("{namespace} {hostname}:{hbone_mtls_port}")),
        other => panic!("not a hostname: {other:?}"),
    }
}

fn resolve(
    wp: &Waypoints,
    kind: Kind,
    own: &[(&str, &str)],
    namespace: Option<&[(&str, &str)]>,
) -> Resolution {
    let own = labels(own);
    let ns = namespace.map(labels);
    wp.resolve(&Subject {
        kind,
        namespace: "shop",
        name: "web",
        labels: &own,
        namespace_labels: ns.as_ref(),
    })
}

const USE: &str = USE_WAYPOINT_LABEL;

#[test]
fn namespace_binding_gives_istiods_address() {
    let wp = waypoints(&[("shop", "wp", WaypointFor::Service)]);
    let got = resolve(&wp, Kind::Service, &[], Some(&[(USE, "wp")]));
    assert_eq!(
        got,
        Resolution::Waypoint(GatewayAddress {
            destination: GatewayDestination::Hostname {
                namespace: "shop".into(),
                hostname: "wp.shop.svc.cluster.local".into(),
            },
            hbone_mtls_port: 15008,
        })
    );
}

#[test]
fn the_waypoint_hostname_ends_in_the_configured_cluster_domain() {
    let wp = Waypoints::new(
        [WaypointGateway {
            namespace: "shop".into(),
            name: "wp".into(),
            waypoint_for: WaypointFor::Service,
        }],
        "corp.example",
    );
    let got = resolve(&wp, Kind::Service, &[], Some(&[(USE, "wp")]));
    assert_eq!(
        hostname(got).as_deref(),
        Some("shop wp.shop.svc.corp.example:15008")
    );
}

#[test]
fn the_objects_label_wins_over_its_namespaces() {
    let wp = waypoints(&[
        ("shop", "ns-wp", WaypointFor::All),
        ("shop", "own-wp", WaypointFor::All),
    ]);
    for kind in [Kind::Service, Kind::Workload] {
        assert_eq!(
            hostname(resolve(
                &wp,
                kind,
                &[(USE, "own-wp")],
                Some(&[(USE, "ns-wp")])
            )),
            Some("shop own-wp.shop.svc.cluster.local:15008".into()),
            "{kind}"
        );
        assert_eq!(
            hostname(resolve(&wp, kind, &[(USE, "own-wp")], None)),
            Some("shop own-wp.shop.svc.cluster.local:15008".into()),
            "{kind}, namespace unknown"
        );
    }
}

#[test]
fn none_opts_out_of_the_namespaces_binding() {
    let wp = waypoints(&[("shop", "wp", WaypointFor::All)]);
    for kind in [Kind::Service, Kind::Workload] {
        assert_eq!(
            resolve(&wp, kind, &[(USE, "none")], Some(&[(USE, "wp")])),
            Resolution::Unbound,
            "{kind}"
        );
    }
    assert_eq!(
        resolve(&wp, Kind::Service, &[], Some(&[(USE, "none")])),
        Resolution::Unbound,
        "none on the namespace binds nothing"
    );
    assert_eq!(
        resolve(&wp, Kind::Service, &[], Some(&[])),
        Resolution::Unbound
    );
    assert_eq!(resolve(&wp, Kind::Service, &[], None), Resolution::Unbound);
}

#[test]
fn use_waypoint_namespace_names_another_namespace() {
    let wp = waypoints(&[("infra", "wp", WaypointFor::All)]);
    let other = [(USE, "wp"), (USE_WAYPOINT_NAMESPACE_LABEL, "infra")];
    assert_eq!(
        hostname(resolve(&wp, Kind::Service, &other, None)),
        Some("infra wp.infra.svc.cluster.local:15008".into())
    );
    assert_eq!(
        hostname(resolve(&wp, Kind::Workload, &[], Some(&other))),
        Some("infra wp.infra.svc.cluster.local:15008".into()),
        "on the namespace too"
    );
    // Without the namespace label, the object's own namespace.
    assert_eq!(
        resolve(&wp, Kind::Service, &[(USE, "wp")], None),
        Resolution::UnknownGateway {
            gateway: WorkloadKey::new("shop", "wp"),
            bound_by: BoundBy::Object
        }
    );
}

#[test]
fn waypoint_for_decides_which_kinds_a_binding_applies_to() {
    let cases = [
        (WaypointFor::Service, true, false),
        (WaypointFor::Workload, false, true),
        (WaypointFor::All, true, true),
        (WaypointFor::None, false, false),
    ];
    for (waypoint_for, service, workload) in cases {
        let wp = waypoints(&[("shop", "wp", waypoint_for)]);
        for (kind, expected) in [(Kind::Service, service), (Kind::Workload, workload)] {
            let got = resolve(&wp, kind, &[], Some(&[(USE, "wp")]));
            if expected {
                assert!(
                    matches!(got, Resolution::Waypoint(_)),
                    "{waypoint_for} {kind}: {got:?}"
                );
            } else {
                assert_eq!(
                    got,
                    Resolution::NotServed {
                        gateway: WorkloadKey::new("shop", "wp"),
                        waypoint_for,
                        bound_by: BoundBy::Namespace,
                    },
                    "{waypoint_for} {kind}"
                );
            }
        }
    }
    assert_eq!(WaypointFor::default(), WaypointFor::Service);
}

#[test]
fn a_specific_binding_to_a_waypoint_of_another_kind_does_not_fall_back() {
    let wp = waypoints(&[
        ("shop", "services-only", WaypointFor::Service),
        ("shop", "ns-wp", WaypointFor::All),
    ]);
    let got = resolve(
        &wp,
        Kind::Workload,
        &[(USE, "services-only")],
        Some(&[(USE, "ns-wp")]),
    );
    assert!(
        matches!(
            got,
            Resolution::NotServed {
                bound_by: BoundBy::Object,
                ..
            }
        ),
        "{got:?}"
    );
}

#[test]
fn an_unknown_gateway_gives_none_and_says_which() {
    let wp = waypoints(&[("shop", "wp", WaypointFor::All)]);
    assert_eq!(
        resolve(&wp, Kind::Workload, &[], Some(&[(USE, "typo")])),
        Resolution::UnknownGateway {
            gateway: WorkloadKey::new("shop", "typo"),
            bound_by: BoundBy::Namespace,
        }
    );
    assert_eq!(
        resolve(&wp, Kind::Workload, &[], Some(&[(USE, "typo")])).waypoint(),
        None
    );
}

#[test]
fn a_waypoint_is_never_bound_to_itself() {
    let wp = waypoints(&[("shop", "wp", WaypointFor::All)]);
    let managed = [(MANAGED_LABEL, MANAGED_BY_MESH_CONTROLLER)];
    for kind in [Kind::Service, Kind::Workload] {
        assert_eq!(
            resolve(&wp, kind, &managed, Some(&[(USE, "wp")])),
            Resolution::Unbound,
            "{kind} managed by the mesh controller"
        );
    }
    // The waypoint's own service, unlabelled, in a bound namespace.
    let own = Subject {
        kind: Kind::Service,
        namespace: "shop",
        name: "wp",
        labels: &BTreeMap::new(),
        namespace_labels: Some(&labels(&[(USE, "wp")])),
    };
    assert_eq!(wp.resolve(&own), Resolution::Unbound);
    // A pod of the same name is not the service.
    let pod = Subject {
        kind: Kind::Workload,
        ..own
    };
    assert!(matches!(wp.resolve(&pod), Resolution::Waypoint(_)));
}

#[test]
fn waypoint_for_values_parse_as_istio_spells_them() {
    for value in ["service", "workload", "all", "none"] {
        let parsed: WaypointFor = value.parse().expect("Istio's value");
        assert_eq!(parsed.as_str(), value);
    }
    assert_eq!(
        "Service".parse::<WaypointFor>().map_err(|e| e.to_string()),
        Err("unknown value \"Service\"; expected service, workload, all or none".into())
    );
}

#[test]
fn binding_labels_keep_only_what_the_rules_read() {
    let all = labels(&[
        ("app", "web"),
        (USE, "wp"),
        (USE_WAYPOINT_NAMESPACE_LABEL, "infra"),
        (MANAGED_LABEL, MANAGED_BY_MESH_CONTROLLER),
    ]);
    let kept = binding_labels(&all);
    assert_eq!(kept.len(), 3);
    assert!(!kept.contains_key("app"));
}

#[test]
fn an_unknown_gateway_is_said_once_while_it_lasts() {
    let unknown = Resolution::UnknownGateway {
        gateway: WorkloadKey::new("shop", "typo"),
        bound_by: BoundBy::Object,
    };
    let mut log = UnknownGatewayLog::default();
    assert!(log.note("service shop/web", &unknown));
    assert!(!log.note("service shop/web", &Resolution::Unbound));
    log.finish();
    assert!(!log.note("service shop/web", &unknown), "said already");
    log.finish();
    log.finish(); // a recompute where it was fixed
    assert!(log.note("service shop/web", &unknown), "broken again");
}

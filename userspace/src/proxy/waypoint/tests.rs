//! The routing decision against ztunnel's behaviour, and the headers'
//! formats.

use super::*;
use crate::state::{DataplaneMode, Endpoint, Service, ServicePort, WeightedWaypoint};

const WAYPOINT_HOST: &str = "waypoint.default.svc.cluster.local";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("test address")
}

fn workload(name: &str, sa: &str, ip_: &str) -> Workload {
    Workload {
        name: name.into(),
        namespace: "default".into(),
        service_account: sa.into(),
        ips: vec![ip(ip_)],
        node: "node-a".into(),
        dataplane_mode: DataplaneMode::Ambient,
        ..Default::default()
    }
}

fn service(name: &str, vip: &str, port: u16, endpoints: &[&str]) -> Service {
    Service {
        name: name.into(),
        namespace: "default".into(),
        vips: vec![ip(vip)],
        ports: vec![ServicePort {
            port,
            target_port: Some(port),
        }],
        endpoints: endpoints
            .iter()
            .map(|e| Endpoint::new(ip(e), None))
            .collect(),
        ..Default::default()
    }
}

fn by_hostname(hostname: &str) -> GatewayAddress {
    GatewayAddress {
        destination: GatewayDestination::Hostname {
            namespace: "default".into(),
            hostname: hostname.into(),
        },
        hbone_mtls_port: 15008,
    }
}

fn by_address(ip_: &str) -> GatewayAddress {
    GatewayAddress {
        destination: GatewayDestination::Address {
            network: String::new(),
            ip: ip(ip_),
        },
        hbone_mtls_port: 15008,
    }
}

/// client, server (workload waypoint: none), two waypoint replicas behind
/// the `waypoint` service, and `web` (VIP 198.19.100.1:80 → server) bound
/// to it.
struct Bed {
    workloads: Vec<Workload>,
    services: Vec<Service>,
}

impl Bed {
    fn new() -> Self {
        let mut waypoint_svc = service(
            "waypoint",
            "198.19.100.9",
            15008,
            &["198.18.3.10", "198.18.3.11"],
        );
        waypoint_svc.hostname = WAYPOINT_HOST.into();
        waypoint_svc.subject_alt_names = vec!["cluster.local/ns/default/sa/waypoint-extra".into()];
        let mut web = service("web", "198.19.100.1", 80, &["198.18.2.10"]);
        web.waypoint = Some(by_hostname(WAYPOINT_HOST));
        Self {
            workloads: vec![
                workload("client", "sleep", "198.18.1.10"),
                workload("server", "httpbin", "198.18.2.10"),
                workload("waypoint-1", "waypoint", "198.18.3.10"),
                workload("waypoint-2", "waypoint", "198.18.3.11"),
            ],
            services: vec![
                waypoint_svc,
                web,
                service("plain", "198.19.100.2", 80, &["198.18.2.10"]),
            ],
        }
    }

    fn store(&self) -> WorkloadStore {
        let mut store = WorkloadStore::new();
        store.replace_all(self.workloads.clone());
        store.replace_services(self.services.clone());
        store
    }

    fn workload_mut(&mut self, name: &str) -> &mut Workload {
        self.workloads
            .iter_mut()
            .find(|w| w.name == name)
            .expect("test workload")
    }

    fn service_mut(&mut self, name: &str) -> &mut Service {
        self.services
            .iter_mut()
            .find(|s| s.name == name)
            .expect("test service")
    }
}

fn route_from(store: &WorkloadStore, source: &str, dst: &str, pick: usize) -> Route {
    let td = TrustDomain::default();
    let key = WorkloadKey::new("default", source);
    plan(store, &td, &key, ip("198.18.9.9"), addr(dst), pick).route
}

fn hop(route: Route) -> WaypointHop {
    match route {
        Route::ViaWaypoint(hop) => hop,
        other => panic!("expected a waypoint hop, got {other:?}"),
    }
}

fn failure(route: Route) -> WaypointFailure {
    match route {
        Route::Fail(f) => f,
        other => panic!("expected a failure, got {other:?}"),
    }
}

#[test]
fn a_service_vip_with_a_waypoint_goes_to_it_with_the_vip_as_authority() {
    let store = Bed::new().store();
    let hop = hop(route_from(&store, "client", "198.19.100.1:80", 0));
    assert_eq!(hop.bound, Bound::Service);
    assert_eq!(hop.target, WorkloadKey::new("default", "web"));
    assert_eq!(
        hop.gateway,
        addr("198.18.3.10:15008"),
        "waypoint IP, HBONE port"
    );
    assert_eq!(
        hop.authority,
        addr("198.19.100.1:80"),
        "the VIP, untranslated"
    );
    assert_eq!(hop.waypoint, WorkloadKey::new("default", "waypoint-1"));
    assert_eq!(
        hop.identity.as_str(),
        "spiffe://cluster.local/ns/default/sa/waypoint"
    );
    assert_eq!(
        hop.also_accept,
        ["spiffe://cluster.local/ns/default/sa/waypoint-extra"],
        "the waypoint service's SANs, with the scheme"
    );
}

#[test]
fn several_waypoint_endpoints_are_taken_in_turn_and_only_healthy_ones() {
    let mut bed = Bed::new();
    let store = bed.store();
    let gateways: Vec<SocketAddr> = (0..4)
        .map(|n| hop(route_from(&store, "client", "198.19.100.1:80", n)).gateway)
        .collect();
    assert_eq!(
        gateways,
        [
            addr("198.18.3.10:15008"),
            addr("198.18.3.11:15008"),
            addr("198.18.3.10:15008"),
            addr("198.18.3.11:15008"),
        ]
    );
    // An unhealthy workload and a not-ready endpoint are skipped.
    bed.workload_mut("waypoint-1").status = WorkloadStatus::Unhealthy;
    let store = bed.store();
    for n in 0..3 {
        let hop = hop(route_from(&store, "client", "198.19.100.1:80", n));
        assert_eq!(hop.gateway, addr("198.18.3.11:15008"));
        assert_eq!(hop.waypoint, WorkloadKey::new("default", "waypoint-2"));
    }
    bed.workload_mut("waypoint-1").status = WorkloadStatus::Healthy;
    bed.service_mut("waypoint").endpoints[1].ready = false;
    let store = bed.store();
    for n in 0..3 {
        assert_eq!(
            hop(route_from(&store, "client", "198.19.100.1:80", n)).gateway,
            addr("198.18.3.10:15008")
        );
    }
}

#[test]
fn a_pod_ip_with_a_workload_waypoint_goes_to_it_with_the_pod_as_authority() {
    let mut bed = Bed::new();
    bed.workload_mut("server").waypoint = Some(by_address("198.18.3.11"));
    let store = bed.store();
    let first = hop(route_from(&store, "client", "198.18.2.10:8080", 0));
    assert_eq!(first.bound, Bound::Workload);
    assert_eq!(first.target, WorkloadKey::new("default", "server"));
    assert_eq!(first.gateway, addr("198.18.3.11:15008"));
    assert_eq!(first.authority, addr("198.18.2.10:8080"));
    assert_eq!(first.waypoint, WorkloadKey::new("default", "waypoint-2"));
    assert!(
        first.also_accept.is_empty(),
        "a pod address has no service SANs"
    );
    // The waypoint's address may be its service's VIP too.
    bed.workload_mut("server").waypoint = Some(by_address("198.19.100.9"));
    let second = hop(route_from(&bed.store(), "client", "198.18.2.10:8080", 1));
    assert_eq!(second.gateway, addr("198.18.3.11:15008"));
    assert_eq!(second.also_accept.len(), 1);
}

#[test]
fn a_service_without_a_waypoint_goes_direct_whatever_its_endpoints_waypoint() {
    let mut bed = Bed::new();
    bed.workload_mut("server").waypoint = Some(by_address("198.18.3.10"));
    let store = bed.store();
    assert_eq!(
        route_from(&store, "client", "198.19.100.2:80", 0),
        Route::Direct
    );
}

#[test]
fn the_waypoint_itself_is_not_sent_back_to_the_waypoint() {
    let mut bed = Bed::new();
    bed.workload_mut("server").waypoint = Some(by_address("198.18.3.10"));
    let store = bed.store();
    // Either replica of the service waypoint.
    for source in ["waypoint-1", "waypoint-2"] {
        assert_eq!(
            route_from(&store, source, "198.19.100.1:80", 0),
            Route::Direct,
            "{source} → VIP"
        );
    }
    // The workload named by address.
    assert_eq!(
        route_from(&store, "waypoint-1", "198.18.2.10:8080", 0),
        Route::Direct
    );
    // An unknown source is found by its IP.
    let td = TrustDomain::default();
    let unknown = WorkloadKey::new("default", "gone");
    assert_eq!(
        plan(
            &store,
            &td,
            &unknown,
            ip("198.18.3.11"),
            addr("198.19.100.1:80"),
            0
        )
        .route,
        Route::Direct
    );
    // Anyone else still goes through it.
    assert!(matches!(
        route_from(&store, "client", "198.18.2.10:8080", 0),
        Route::ViaWaypoint(_)
    ));
}

#[test]
fn no_waypoint_routes_as_before() {
    let store = Bed::new().store();
    for dst in [
        "198.18.2.10:8080",
        "198.19.100.2:80",
        "198.18.7.7:80",
        "198.19.100.1:81",
    ] {
        assert_eq!(route_from(&store, "client", dst, 0), Route::Direct, "{dst}");
    }
}

#[test]
fn an_unknown_waypoint_or_one_without_healthy_endpoint_fails_never_bypasses() {
    let mut bed = Bed::new();
    bed.service_mut("web").waypoint = Some(by_hostname("missing.default.svc.cluster.local"));
    bed.workload_mut("server").waypoint = Some(by_address("198.18.7.7"));
    let store = bed.store();
    let f = failure(route_from(&store, "client", "198.19.100.1:80", 0));
    assert_eq!(f.reason, FailureReason::Unresolved);
    assert_eq!(f.target, WorkloadKey::new("default", "web"));
    assert_eq!(
        f.to_string(),
        "waypoint of service default/web: waypoint service default/missing.default.svc.cluster.local is not known"
    );
    let f = failure(route_from(&store, "client", "198.18.2.10:8080", 0));
    assert_eq!(f.reason, FailureReason::Unresolved);
    assert_eq!(
        (f.bound, f.target.to_string()),
        (Bound::Workload, "default/server".into())
    );

    let mut bed = Bed::new();
    bed.service_mut("waypoint")
        .endpoints
        .iter_mut()
        .for_each(|e| e.ready = false);
    let f = failure(route_from(&bed.store(), "client", "198.19.100.1:80", 0));
    assert_eq!(f.reason, FailureReason::NoHealthyEndpoint);
    assert!(
        f.detail
            .contains("default/waypoint has no healthy endpoint"),
        "{f}"
    );
    // An endpoint with no workload behind it has no identity to check.
    let mut bed = Bed::new();
    bed.service_mut("waypoint").endpoints = vec![Endpoint::new(ip("198.18.7.8"), None)];
    let f = failure(route_from(&bed.store(), "client", "198.19.100.1:80", 0));
    assert_eq!(f.reason, FailureReason::NoHealthyEndpoint);
}

#[test]
fn a_waypoint_on_another_network_goes_through_its_gateway_and_is_never_dialled_directly() {
    // Both replicas on another network than the client's (the node's):
    // only that network's gateway reaches them; without one, refused.
    let mut bed = Bed::new();
    bed.workload_mut("client").network = "net-a".into();
    for name in ["waypoint-1", "waypoint-2"] {
        bed.workload_mut(name).network = "net-b".into();
    }
    let store = bed.store();
    let f = failure(route_from(&store, "client", "198.19.100.1:80", 0));
    assert_eq!(f.reason, FailureReason::OtherNetwork);
    assert_eq!(f.reason.as_str(), "other_network");
    assert_eq!(
        f.to_string(),
        "waypoint of service default/web: waypoint default/waypoint is on network net-b: \
         ready endpoints only on other networks (net-b, net-b), none behind a network gateway"
    );
    // With net-b's gateway named (a workload there): double HBONE to it,
    // both CONNECTs for the service addressed, the inner TLS checked
    // against the waypoint service's SANs (ztunnel's final_sans).
    let mut gateway = workload("eastwest", "eastwest-gw", "198.18.9.1");
    gateway.network = "net-b".into();
    bed.workloads.push(gateway);
    for name in ["waypoint-1", "waypoint-2"] {
        bed.workload_mut(name).network_gateway = Some(GatewayAddress {
            destination: GatewayDestination::Address {
                network: "net-b".into(),
                ip: ip("198.18.9.1"),
            },
            hbone_mtls_port: 15008,
        });
    }
    bed.service_mut("web").hostname = "web.default.svc.cluster.local".into();
    let Route::ThroughGateway(through) = route_from(&bed.store(), "client", "198.19.100.1:80", 0)
    else {
        panic!("not through the gateway");
    };
    assert_eq!(through.authority, "web.default.svc.cluster.local:80");
    assert_eq!(through.gateway, addr("198.18.9.1:15008"));
    assert_eq!(
        through.gateway_identity.as_str(),
        "spiffe://cluster.local/ns/default/sa/eastwest-gw"
    );
    assert_eq!(
        through.final_identity.as_str(),
        "spiffe://cluster.local/ns/default/sa/waypoint-extra"
    );
    for name in ["waypoint-1", "waypoint-2"] {
        bed.workload_mut(name).network_gateway = None;
    }
    // One replica on our network: only that one is used.
    bed.workload_mut("waypoint-2").network = "net-a".into();
    let store = bed.store();
    for pick in 0..4 {
        let hop = hop(route_from(&store, "client", "198.19.100.1:80", pick));
        assert_eq!(hop.gateway, addr("198.18.3.11:15008"));
    }
    // No network on either side (a mesh without networks): all local.
    let bed = Bed::new();
    hop(route_from(&bed.store(), "client", "198.19.100.1:80", 0));

    // A waypoint named by an address on another network.
    let mut bed = Bed::new();
    bed.workload_mut("client").network = "net-a".into();
    bed.workload_mut("waypoint-1").network = "net-b".into();
    bed.workload_mut("server").waypoint = Some(GatewayAddress {
        destination: GatewayDestination::Address {
            network: "net-b".into(),
            ip: ip("198.18.3.10"),
        },
        hbone_mtls_port: 15008,
    });
    let f = failure(route_from(&bed.store(), "client", "198.18.2.10:8080", 0));
    assert_eq!(f.reason, FailureReason::OtherNetwork);
    assert_eq!(f.target, WorkloadKey::new("default", "server"));
    assert!(f.detail.contains("on network net-b"), "{f}");
    // The same address on our network is dialled.
    bed.workload_mut("waypoint-1").network = "net-a".into();
    bed.workload_mut("server").waypoint = Some(GatewayAddress {
        destination: GatewayDestination::Address {
            network: "net-a".into(),
            ip: ip("198.18.3.10"),
        },
        hbone_mtls_port: 15008,
    });
    let hop = hop(route_from(&bed.store(), "client", "198.18.2.10:8080", 0));
    assert_eq!(hop.gateway, addr("198.18.3.10:15008"));
}

/// The bed with a canary waypoint service (`canary`, one replica
/// `canary-1` at 198.18.3.20) and `web`'s weighted set giving `weights`
/// to `[waypoint, canary]`; `web.waypoint` stays the primary, as istiod
/// sends it.
fn with_canary(weights: [u32; 2]) -> Bed {
    let mut bed = Bed::new();
    let mut canary = service("canary", "198.19.100.8", 15008, &["198.18.3.20"]);
    canary.hostname = "canary.default.svc.cluster.local".into();
    bed.services.push(canary);
    bed.workloads
        .push(workload("canary-1", "canary-waypoint", "198.18.3.20"));
    bed.service_mut("web").weighted_waypoints = [WAYPOINT_HOST, "canary.default.svc.cluster.local"]
        .into_iter()
        .zip(weights)
        .map(|(host, weight)| WeightedWaypoint {
            destination: by_hostname(host),
            weight,
        })
        .collect();
    bed
}

#[test]
fn an_address_in_a_services_range_goes_to_its_waypoint_unless_a_workload_owns_it() {
    // A ServiceEntry's CIDR bound to the waypoint (an egress waypoint).
    let mut bed = Bed::new();
    bed.services.push(Service {
        name: "egress".into(),
        namespace: "default".into(),
        hostname: "egress.example.com".into(),
        ports: vec![ServicePort {
            port: 443,
            target_port: Some(443),
        }],
        vip_ranges: vec![
            crate::state::VipRange::new(ip("198.18.0.0"), 16, String::new()).expect("range"),
        ],
        waypoint: Some(by_hostname(WAYPOINT_HOST)),
        ..Default::default()
    });
    let store = bed.store();
    let hop = hop(route_from(&store, "client", "198.18.77.7:443", 0));
    assert_eq!(hop.target, WorkloadKey::new("default", "egress"));
    assert_eq!(hop.authority, addr("198.18.77.7:443"));
    assert_eq!(hop.gateway, addr("198.18.3.10:15008"));
    // A port the service does not serve: not it.
    assert_eq!(
        route_from(&store, "client", "198.18.77.7:80", 0),
        Route::Direct
    );
    // Its waypoint, if enrolled here, takes such a CONNECT in.
    let replica = WorkloadKey::new("default", "waypoint-1");
    assert_eq!(
        inbound_port(&store, &replica, addr("198.18.77.7:443")),
        Some(443)
    );
    // The server's own address is in the range too: the workload wins,
    // as in ztunnel's lookup (workloads, then VIPs, then ranges).
    assert_eq!(
        route_from(&store, "client", "198.18.2.10:443", 0),
        Route::Direct
    );
}

#[test]
fn a_weighted_set_of_waypoints_shares_connections_by_weight() {
    // 3 : 1 over eight connections: six to the primary, taking its two
    // replicas in turn, two to the canary.
    let store = with_canary([3, 1]).store();
    let gateways: Vec<String> = (0..8)
        .map(|n| hop(route_from(&store, "client", "198.19.100.1:80", n)).gateway)
        .map(|g| g.ip().to_string())
        .collect();
    let count = |ip: &str| gateways.iter().filter(|g| *g == ip).count();
    assert_eq!(
        (
            count("198.18.3.10"),
            count("198.18.3.11"),
            count("198.18.3.20")
        ),
        (3, 3, 2),
        "{gateways:?}"
    );
    // The canary's hop is checked against the canary's identity, with the
    // VIP as authority.
    let canary = (0..4)
        .map(|n| hop(route_from(&store, "client", "198.19.100.1:80", n)))
        .find(|h| h.gateway == addr("198.18.3.20:15008"))
        .expect("a connection to the canary");
    assert_eq!(
        canary.identity.as_str(),
        "spiffe://cluster.local/ns/default/sa/canary-waypoint"
    );
    assert_eq!(canary.authority, addr("198.19.100.1:80"));
    assert_eq!(canary.target, WorkloadKey::new("default", "web"));
    // All on the canary.
    let store = with_canary([0, 5]).store();
    for n in 0..4 {
        let hop = hop(route_from(&store, "client", "198.19.100.1:80", n));
        assert_eq!(hop.gateway, addr("198.18.3.20:15008"), "connection {n}");
    }
    // Every weight 0: not sampled, the primary alone (ztunnel).
    let store = with_canary([0, 0]).store();
    for n in 0..4 {
        let hop = hop(route_from(&store, "client", "198.19.100.1:80", n));
        assert_ne!(hop.gateway, addr("198.18.3.20:15008"), "connection {n}");
    }
}

#[test]
fn a_waypoint_of_the_set_sends_to_its_service_directly() {
    // Either waypoint of the set, whichever one the connection would take.
    let store = with_canary([1, 1]).store();
    for source in ["canary-1", "waypoint-1"] {
        for n in 0..4 {
            assert_eq!(
                route_from(&store, source, "198.19.100.1:80", n),
                Route::Direct,
                "{source}, connection {n}"
            );
        }
    }
}

#[test]
fn a_chosen_canary_istiod_did_not_send_fails_never_bypasses() {
    let mut bed = with_canary([0, 1]);
    bed.services.retain(|s| s.name != "canary");
    let f = failure(route_from(&bed.store(), "client", "198.19.100.1:80", 0));
    assert_eq!(f.reason, FailureReason::Unresolved);
    assert_eq!(f.target, WorkloadKey::new("default", "web"));
}

#[test]
fn a_pod_here_that_reuses_a_remote_waypoints_address_is_not_the_waypoint() {
    // The waypoint's replicas are on net-b; net-a (ours) reuses
    // 198.18.3.10 for an unrelated pod. That pod is neither dialled and
    // trusted as the waypoint nor let past it as one of its replicas.
    let mut bed = Bed::new();
    bed.workload_mut("client").network = "net-a".into();
    let mut gateway = workload("eastwest", "eastwest-gw", "198.18.9.1");
    gateway.network = "net-b".into();
    bed.workloads.push(gateway);
    for name in ["waypoint-1", "waypoint-2"] {
        let replica = bed.workload_mut(name);
        replica.network = "net-b".into();
        replica.network_gateway = Some(GatewayAddress {
            destination: GatewayDestination::Address {
                network: "net-b".into(),
                ip: ip("198.18.9.1"),
            },
            hbone_mtls_port: 15008,
        });
    }
    for e in &mut bed.service_mut("waypoint").endpoints {
        e.network = "net-b".into();
    }
    bed.service_mut("web").hostname = "web.default.svc.cluster.local".into();
    let mut impostor = workload("local-pod", "local-sa", "198.18.3.10");
    impostor.network = "net-a".into();
    bed.workloads.push(impostor);
    // This node is on net-a: a lookup by address alone prefers net-a's pod.
    let on_net_a = |bed: &Bed| {
        let mut store = WorkloadStore::on_network("net-a");
        store.replace_all(bed.workloads.clone());
        store.replace_services(bed.services.clone());
        store
    };
    let store = on_net_a(&bed);
    for pick in 0..4 {
        let Route::ThroughGateway(through) = route_from(&store, "client", "198.19.100.1:80", pick)
        else {
            panic!("pick {pick}: not through net-b's gateway");
        };
        assert_eq!(through.gateway, addr("198.18.9.1:15008"));
    }
    let Route::ThroughGateway(_) = route_from(&store, "local-pod", "198.19.100.1:80", 0) else {
        panic!("the pod that reuses a replica's address went around the waypoint");
    };
    // The same pod named by address on net-b is not ours either.
    bed.workload_mut("server").waypoint = Some(GatewayAddress {
        destination: GatewayDestination::Address {
            network: "net-b".into(),
            ip: ip("198.18.3.10"),
        },
        hbone_mtls_port: 15008,
    });
    let f = failure(route_from(&on_net_a(&bed), "client", "198.18.2.10:8080", 0));
    assert_eq!(f.reason, FailureReason::OtherNetwork);
    assert!(f.detail.contains("default/waypoint-1"), "{f}");
}

#[test]
fn an_enrolled_waypoint_accepts_only_what_is_bound_to_it() {
    let mut bed = Bed::new();
    bed.service_mut("web").ports = vec![ServicePort {
        port: 80,
        target_port: Some(8080),
    }];
    bed.workload_mut("server").waypoint = Some(by_hostname(WAYPOINT_HOST));
    let store = bed.store();
    let key = |name: &str| WorkloadKey::new("default", name);
    // A service VIP bound to it: the service port's target port.
    for replica in ["waypoint-1", "waypoint-2"] {
        assert_eq!(
            inbound_port(&store, &key(replica), addr("198.19.100.1:80")),
            Some(8080),
            "{replica}"
        );
    }
    // A pod bound to it: the port as is.
    assert_eq!(
        inbound_port(&store, &key("waypoint-1"), addr("198.18.2.10:9000")),
        Some(9000)
    );
    // Not its waypoint, a service without one, an unknown address or port.
    assert_eq!(
        inbound_port(&store, &key("client"), addr("198.19.100.1:80")),
        None
    );
    assert_eq!(
        inbound_port(&store, &key("waypoint-1"), addr("198.19.100.2:80")),
        None
    );
    assert_eq!(
        inbound_port(&store, &key("waypoint-1"), addr("198.18.7.7:80")),
        None
    );
    assert_eq!(
        inbound_port(&store, &key("waypoint-1"), addr("198.19.100.1:81")),
        None
    );
}

#[test]
fn waypoint_replicas_are_picked_by_capacity() {
    let mut bed = Bed::new();
    bed.workload_mut("waypoint-1").capacity = 3;
    let store = bed.store();
    let picks: Vec<String> = (0..8)
        .map(|n| {
            hop(route_from(&store, "client", "198.19.100.1:80", n))
                .waypoint
                .name
        })
        .collect();
    assert_eq!(
        picks,
        [
            "waypoint-1",
            "waypoint-2",
            "waypoint-1",
            "waypoint-1",
            "waypoint-1",
            "waypoint-2",
            "waypoint-1",
            "waypoint-1"
        ],
        "3:1, interleaved"
    );
    // Equal capacities (whatever their value) keep plain round robin.
    bed.workload_mut("waypoint-2").capacity = 3;
    let store = bed.store();
    let picks: Vec<String> = (0..4)
        .map(|n| {
            hop(route_from(&store, "client", "198.19.100.1:80", n))
                .waypoint
                .name
        })
        .collect();
    assert_eq!(
        picks,
        ["waypoint-1", "waypoint-2", "waypoint-1", "waypoint-2"]
    );
}

#[test]
fn an_allow_all_waypoint_service_keeps_unhealthy_replicas() {
    let mut bed = Bed::new();
    bed.workload_mut("waypoint-1").status = WorkloadStatus::Unhealthy;
    bed.workload_mut("waypoint-2").status = WorkloadStatus::Unhealthy;
    let only_healthy = route_from(&bed.store(), "client", "198.19.100.1:80", 0);
    assert_eq!(
        failure(only_healthy).reason,
        FailureReason::NoHealthyEndpoint
    );
    bed.service_mut("waypoint").load_balancing = Some(crate::state::LoadBalancing {
        health_policy: crate::state::HealthPolicy::AllowAll,
        ..Default::default()
    });
    let hop = hop(route_from(&bed.store(), "client", "198.19.100.1:80", 1));
    assert_eq!(hop.waypoint, WorkloadKey::new("default", "waypoint-2"));
}

#[test]
fn a_waypoint_hostname_that_differs_from_the_service_name_is_found_by_index() {
    let mut bed = Bed::new();
    // istiod names waypoints by hostname; the service's name need not be
    // its first label.
    bed.service_mut("waypoint").name = "wp-gateway".into();
    let store = bed.store();
    let hop = hop(route_from(&store, "client", "198.19.100.1:80", 0));
    assert_eq!(hop.waypoint, WorkloadKey::new("default", "waypoint-1"));
    assert_eq!(
        store
            .services()
            .by_hostname("default", WAYPOINT_HOST)
            .map(|s| s.key()),
        Some(WorkloadKey::new("default", "wp-gateway"))
    );
    assert!(
        store
            .services()
            .by_hostname("other", WAYPOINT_HOST)
            .is_none(),
        "the namespace is part of the name"
    );
}

#[test]
fn a_hostname_waypoint_is_found_by_plain_name_where_the_source_gives_no_hostname() {
    let mut bed = Bed::new();
    bed.service_mut("waypoint").hostname.clear();
    bed.service_mut("web").waypoint = Some(by_hostname("waypoint"));
    let hop = hop(route_from(&bed.store(), "client", "198.19.100.1:80", 0));
    assert_eq!(hop.waypoint, WorkloadKey::new("default", "waypoint-1"));
}

#[test]
fn failures_are_counted_by_namespace_name_and_reason() {
    let counts = WaypointFailures::default();
    let f = WaypointFailure {
        bound: Bound::Service,
        target: WorkloadKey::new("default", "web"),
        reason: FailureReason::Unreachable,
        detail: String::new(),
    };
    counts.count(&f);
    counts.count(&f);
    assert_eq!(
        counts.snapshot(),
        [WaypointFailureCount {
            namespace: "default".into(),
            name: "web".into(),
            reason: "unreachable".into(),
            count: 2,
        }]
    );
}

#[test]
fn baggage_describes_the_source_workload() {
    let mut w = workload("client-7f9", "sleep", "198.18.1.10");
    w.canonical_name = "client".into();
    w.canonical_revision = "v1".into();
    assert_eq!(
        baggage(&w),
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.pod.name=client-7f9,service.name=client,service.version=v1"
    );
    w.cluster_id = "east".into();
    assert!(baggage(&w).starts_with("k8s.cluster.name=east,"));
}

#[test]
fn baggage_names_the_owner_by_its_type() {
    let mut w = workload("ratings-v1-5d8f7b9c4-x2x7q", "ratings", "198.18.1.10");
    w.canonical_name = "ratings".into();
    w.canonical_revision = "v1".into();
    w.workload_name = "ratings-v1".into();
    w.workload_type = crate::state::WorkloadType::Deployment;
    assert_eq!(
        baggage(&w),
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.deployment.name=ratings-v1,service.name=ratings,service.version=v1"
    );
    w.workload_name = "nightly".into();
    w.workload_type = crate::state::WorkloadType::CronJob;
    assert!(
        baggage(&w).contains(",k8s.cronjob.name=nightly,"),
        "{}",
        baggage(&w)
    );
    assert!(!baggage(&w).contains("k8s.pod.name"), "one owner key only");
}

#[test]
fn baggage_carries_the_locality_and_istios_canonical_fallbacks() {
    let mut w = workload("web-0", "web", "198.18.1.10");
    w.labels.insert("app".into(), "web".into());
    w.labels.insert("version".into(), "v3".into());
    w.locality = Some(crate::state::Locality {
        region: "r1".into(),
        zone: String::new(),
        subzone: "s1".into(),
    });
    assert_eq!(
        baggage(&w),
        "k8s.cluster.name=Kubernetes,k8s.namespace.name=default,k8s.pod.name=web-0,service.name=web,service.version=v3,cloud.region=r1",
        "the app and version labels, the region, no empty zone"
    );
}

#[test]
fn forwarded_names_the_client_and_port_quoted_and_the_service_host() {
    let at = |s: &str| s.parse::<SocketAddr>().expect("test address");
    assert_eq!(
        forwarded(at("198.18.1.10:40162"), None),
        "for=\"198.18.1.10:40162\""
    );
    assert_eq!(
        forwarded(at("[2001:db8::1]:80"), None),
        "for=\"[2001:db8::1]:80\""
    );
    assert_eq!(
        forwarded(at("[::ffff:198.18.1.10]:80"), Some("")),
        "for=\"198.18.1.10:80\""
    );
    assert_eq!(
        forwarded(at("198.18.1.10:80"), Some("web.default.svc.cluster.local")),
        "for=\"198.18.1.10:80\";host=web.default.svc.cluster.local"
    );
}

#[test]
fn traceparent_is_w3c_version_00_not_sampled_as_ztunnels() {
    let mut random = [0u8; 24];
    for (i, b) in random.iter_mut().enumerate() {
        *b = 0xa0 + i as u8;
    }
    assert_eq!(
        traceparent(random),
        "00-a0a1a2a3a4a5a6a7a8a9aaabacadaeaf-b0b1b2b3b4b5b6b7-00"
    );
    assert_eq!(
        traceparent([0; 24]),
        "00-00000000000000000000000000000001-0000000000000001-00",
        "all-zero ids are invalid"
    );
}

#[test]
fn connect_headers_carry_all_three_and_a_fresh_trace_each_time() {
    let at = |s: &str| s.parse::<SocketAddr>().expect("test address");
    let a = connect_headers(
        Some("k8s.cluster.name=Kubernetes"),
        at("[2001:db8::1]:5000"),
        None,
    );
    let b = connect_headers(None, at("198.18.1.10:5000"), Some("web.default.svc"));
    assert_eq!(a["baggage"], "k8s.cluster.name=Kubernetes");
    assert_eq!(a["forwarded"], "for=\"[2001:db8::1]:5000\"");
    assert_eq!(
        b["forwarded"],
        "for=\"198.18.1.10:5000\";host=web.default.svc"
    );
    assert!(b.get("baggage").is_none());
    let trace = |h: &HeaderMap| h["traceparent"].to_str().expect("ascii").to_owned();
    let (ta, tb) = (trace(&a), trace(&b));
    assert_ne!(ta, tb);
    for t in [ta, tb] {
        let parts: Vec<&str> = t.split('-').collect();
        assert_eq!(parts.len(), 4, "{t}");
        assert_eq!((parts[0], parts[3]), ("00", "00"), "{t}");
        assert_eq!((parts[1].len(), parts[2].len()), (32, 16), "{t}");
        assert!(
            t.chars()
                .all(|c| c == '-' || c.is_ascii_digit() || ('a'..='f').contains(&c)),
            "{t}"
        );
    }
}

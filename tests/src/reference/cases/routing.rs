//! Endpoint choice by locality (issue 34 item 7): a Service whose only
//! endpoint (the server, on node-b) is on another node than the client
//! (node-a), reached through the client's proxy; and by network: the
//! server on another network than the client, with and without a network
//! gateway (one that does not answer: neither peer gets through it); and
//! a service's weighted set of waypoints (a waypoint canary); and an
//! address in a ServiceEntry's CIDR bound to a waypoint.

use shunt_proto::istio::workload::{self as wl, load_balancing};

use super::{Case, OutboundRow};
use crate::reference::{
    bed::{
        CANARY_AUTHORITY, GATEWAY_IP, GATEWAY_SA, RANGE_AUTHORITY, SERVER_IP, SERVER_SA, TUNNELED,
        TUNNELED_ADDRESSLESS, TUNNELED_TO_WAYPOINT,
    },
    probe::Outcome::{self, Allowed, Refused},
    resources::{encode, named_endpoint, pod, service},
};

/// A Service `default/<name>` at `vip` choosing endpoints by `mode` with
/// the scopes `NODE`, the server its endpoint.
fn case(
    name: &'static str,
    service_name: &'static str,
    key: &'static str,
    vip: [u8; 4],
    mode: Option<load_balancing::Mode>,
    expect: Outcome,
) -> Case {
    let mut address = service(
        service_name,
        &format!("{service_name}.default.svc.cluster.local"),
        vip,
    );
    if let (Some(wl::address::Type::Service(svc)), Some(mode)) = (&mut address.r#type, mode) {
        svc.load_balancing = Some(wl::LoadBalancing {
            routing_preference: vec![load_balancing::Scope::Node as i32],
            mode: mode as i32,
            ..Default::default()
        });
    }
    let mut case = Case::authz(name, Vec::new(), Vec::new());
    case.addresses = vec![encode(address)];
    case.server_services = vec![key];
    case.outbound = vec![OutboundRow {
        dst: vip,
        port: 80,
        expect,
    }];
    case
}

pub fn cases() -> Vec<Case> {
    vec![
        case(
            "no load balancing: the endpoint on the other node",
            "anywhere",
            "default/anywhere.default.svc.cluster.local",
            [198, 19, 100, 44],
            None,
            Allowed,
        ),
        // istiod's internalTrafficPolicy: Local.
        case(
            "STRICT by NODE, the only endpoint on another node",
            "local",
            "default/local.default.svc.cluster.local",
            [198, 19, 100, 45],
            Some(load_balancing::Mode::Strict),
            Refused,
        ),
        // trafficDistribution: falls back to the other node.
        case(
            "FAILOVER by NODE, the only endpoint on another node",
            "nearby",
            "default/nearby.default.svc.cluster.local",
            [198, 19, 100, 46],
            Some(load_balancing::Mode::Failover),
            Allowed,
        ),
        on_network(
            "the only endpoint on another network, no gateway",
            "remote",
            "default/remote.default.svc.cluster.local",
            [198, 19, 100, 47],
            None,
        ),
        on_network(
            "the only endpoint on another network, behind its gateway",
            "gatewayed",
            "default/gatewayed.default.svc.cluster.local",
            [198, 19, 100, 50],
            Some([198, 19, 100, 51]),
        ),
        through_known_gateway(),
        waypoint_through_gateway(),
        addressless_through_gateway(),
        same_address_elsewhere(),
        weighted_waypoints(
            "a weighted set of waypoints, all on the canary",
            [0, 1],
            Allowed,
        ),
        weighted_waypoints(
            "a weighted set of waypoints, every weight 0: the primary alone",
            [0, 0],
            Refused,
        ),
        range_through_waypoint(),
        shared_vip(),
        resolved_by_name(),
    ]
}

/// A `resolution: DNS` ServiceEntry as istiod sends it: a service at a
/// VIP whose endpoint is a workload with a `hostname` and no address
/// ([`named_endpoint`]). The client's proxy resolves the name when the connection
/// comes (the bed's DNS server answers the server pod's address) and
/// connects there in plaintext; a second one's name has no address, and
/// its connection is refused.
fn resolved_by_name() -> Case {
    let (vip, unresolved_vip) = ([198, 19, 100, 62], [198, 19, 100, 63]);
    let mut case = Case::authz(
        "a DNS-resolved ServiceEntry: the endpoint's name resolved by the client's proxy",
        Vec::new(),
        Vec::new(),
    );
    case.addresses = vec![
        encode(service("api", "api.example.com", vip)),
        encode(named_endpoint("api.example.com", "backend.example.com")),
        encode(service("gone", "gone.example.com", unresolved_vip)),
        encode(named_endpoint("gone.example.com", "nowhere.example.com")),
    ];
    case.resolves = vec![("backend.example.com", SERVER_IP.octets())];
    case.outbound = vec![
        OutboundRow {
            dst: vip,
            port: 80,
            expect: Allowed,
        },
        OutboundRow {
            dst: unresolved_vip,
            port: 80,
            expect: Refused,
        },
    ];
    case
}

/// Two namespaces' ServiceEntries for one host at one VIP, as istiod sends
/// them: `other`'s is bound to a waypoint istiod does not know (a
/// connection there fails), the client's own namespace's (`default`) has
/// the server as endpoint. ztunnel takes the client's namespace's.
fn shared_vip() -> Case {
    let vip = [198, 19, 100, 60];
    let key = "default/shared.example.com";
    let mut case = case(
        "two namespaces' ServiceEntries at one VIP: the client's namespace's",
        "shared",
        key,
        vip,
        None,
        Allowed,
    );
    case.addresses = vec![encode(service("shared", "shared.example.com", vip))];
    let mut elsewhere = service("shared", "shared.example.com", vip);
    if let Some(wl::address::Type::Service(svc)) = &mut elsewhere.r#type {
        svc.namespace = "other".into();
        svc.waypoint = Some(wl::GatewayAddress {
            destination: Some(wl::gateway_address::Destination::Hostname(
                wl::NamespacedHostname {
                    namespace: "other".into(),
                    hostname: "missing-waypoint.other.svc.cluster.local".into(),
                },
            )),
            hbone_mtls_port: 15008,
        });
    }
    case.addresses.push(encode(elsewhere));
    case
}

/// A service (`canary-target`, the server its endpoint) whose primary
/// `waypoint` is `wp-primary`, a waypoint service without endpoints
/// (connections there fail on both peers), and whose weighted set (as
/// istiod sends a waypoint canary) gives `weights` to `[wp-primary,
/// wp-canary]`. The canary's only endpoint is the bed's stand-in, here a
/// workload of the client's network: it sees each CONNECT the client's
/// proxy sends it and passes the stream on to the server's echo port. A
/// set whose weights are all 0 is not sampled: the primary alone (ztunnel's
/// `sample_weighted_waypoint`).
fn weighted_waypoints(name: &'static str, weights: [u32; 2], expect: Outcome) -> Case {
    let key = "default/canary-target.default.svc.cluster.local";
    let vip = [198, 19, 100, 56];
    debug_assert_eq!(CANARY_AUTHORITY, "198.19.100.56:80");
    let mut case = case(name, "canary-target", key, vip, None, expect);
    let by_host = |host: &str| wl::GatewayAddress {
        destination: Some(wl::gateway_address::Destination::Hostname(
            wl::NamespacedHostname {
                namespace: "default".into(),
                hostname: host.into(),
            },
        )),
        hbone_mtls_port: 15008,
    };
    let (primary, canary) = ("wp-primary.default.svc.cluster.local", STAND_IN_WAYPOINT);
    let mut target = service(
        "canary-target",
        "canary-target.default.svc.cluster.local",
        vip,
    );
    if let Some(wl::address::Type::Service(svc)) = &mut target.r#type {
        svc.waypoint = Some(by_host(primary));
        svc.weighted_waypoints = [primary, canary]
            .into_iter()
            .zip(weights)
            .map(|(host, weight)| wl::WeightedWaypoint {
                destination: Some(by_host(host)),
                weight,
            })
            .collect();
    }
    case.addresses = vec![
        encode(target),
        encode(waypoint_service("wp-primary", primary, [198, 19, 100, 57])),
    ];
    case.addresses.extend(stand_in_waypoint());
    if expect == Allowed {
        case.gateway_authority = Some(CANARY_AUTHORITY);
        case.forwarded_host = Some("canary-target.default.svc.cluster.local");
    }
    case
}

/// The host of the waypoint service whose only endpoint is the bed's
/// stand-in.
const STAND_IN_WAYPOINT: &str = "wp-canary.default.svc.cluster.local";

/// A waypoint service (HBONE port 15008) at `vip`.
fn waypoint_service(name: &str, host: &str, vip: [u8; 4]) -> wl::Address {
    let mut address = service(name, host, vip);
    if let Some(wl::address::Type::Service(svc)) = &mut address.r#type {
        svc.ports = vec![wl::Port {
            service_port: 15008,
            target_port: 15008,
            ..Default::default()
        }];
    }
    address
}

/// The waypoint service [`STAND_IN_WAYPOINT`] and its one replica, the
/// bed's stand-in: a workload of the client's network that sees each
/// CONNECT sent to it and passes the stream on to the server's echo port.
fn stand_in_waypoint() -> Vec<shunt_proto::envoy::service::discovery::v3::Resource> {
    let mut stand_in = pod("wp-canary-0", GATEWAY_SA, GATEWAY_IP, "node-b");
    stand_in.uid = "Kubernetes//Pod/istio-system/wp-canary-0".into();
    stand_in.namespace = "istio-system".into();
    stand_in.services.insert(
        format!("default/{STAND_IN_WAYPOINT}"),
        wl::PortList {
            ports: vec![wl::Port {
                service_port: 15008,
                target_port: 15008,
                ..Default::default()
            }],
        },
    );
    vec![
        encode(waypoint_service(
            "wp-canary",
            STAND_IN_WAYPOINT,
            [198, 19, 100, 58],
        )),
        encode(wl::Address {
            r#type: Some(wl::address::Type::Workload(stand_in)),
        }),
    ]
}

/// A ServiceEntry's CIDR (198.19.200.0/24, which istiod sends as an
/// address of length 24) bound to a waypoint, the bed's stand-in: as an
/// egress waypoint, it gets the client's connection to an address in the
/// range (CONNECT for that address), which no workload owns and no VIP
/// names. ztunnel matches the range; shunt too, and its kernel fast path
/// must not send the connect around the proxy.
fn range_through_waypoint() -> Case {
    let mut case = Case::authz(
        "an address in a ServiceEntry's CIDR, bound to a waypoint",
        Vec::new(),
        Vec::new(),
    );
    let mut entry = service("cidr-egress", "cidr.example.com", [198, 19, 200, 0]);
    if let Some(wl::address::Type::Service(svc)) = &mut entry.r#type {
        svc.addresses[0].length = Some(24);
        svc.waypoint = Some(wl::GatewayAddress {
            destination: Some(wl::gateway_address::Destination::Hostname(
                wl::NamespacedHostname {
                    namespace: "default".into(),
                    hostname: STAND_IN_WAYPOINT.into(),
                },
            )),
            hbone_mtls_port: 15008,
        });
    }
    case.addresses = vec![encode(entry)];
    case.addresses.extend(stand_in_waypoint());
    debug_assert_eq!(RANGE_AUTHORITY, "198.19.200.7:80");
    case.outbound = vec![OutboundRow {
        dst: [198, 19, 200, 7],
        port: 80,
        expect: Allowed,
    }];
    case.gateway_authority = Some(RANGE_AUTHORITY);
    case.forwarded_host = Some("cidr.example.com");
    case
}

/// The server on `network2` behind the bed's east-west gateway (a
/// workload istiod sends, on that network), the service naming the
/// server's identity in its SANs: double HBONE. The client's proxy opens
/// HBONE to the gateway (CONNECT `<hostname>:80`, which the gateway
/// tunnels to the server's 15008), and inside it HBONE to the server's
/// proxy.
pub fn through_known_gateway() -> Case {
    let hostname = "through-gateway.default.svc.cluster.local";
    let vip = [198, 19, 100, 52];
    let mut case = on_network(
        "the only endpoint on another network, behind a gateway istiod names",
        "through-gateway",
        "default/through-gateway.default.svc.cluster.local",
        vip,
        Some(GATEWAY_IP.octets()),
    );
    let mut service_address = service("through-gateway", hostname, vip);
    if let Some(wl::address::Type::Service(svc)) = &mut service_address.r#type {
        svc.subject_alt_names = vec![format!("spiffe://cluster.local/ns/default/sa/{SERVER_SA}")];
    }
    case.addresses = vec![encode(service_address), encode(eastwest())];
    case.outbound[0].expect = Allowed;
    case.gateway_authority = Some(TUNNELED);
    debug_assert_eq!(TUNNELED, format!("{hostname}:80"));
    case
}

/// A service whose waypoint (the service `wp-server`, whose only
/// endpoint is the server) is on `network2` behind the bed's gateway:
/// ztunnel sends it through the gateway (double HBONE), both CONNECTs
/// naming the service addressed, the inner TLS checked against the
/// waypoint service's SANs.
fn waypoint_through_gateway() -> Case {
    let vip = [198, 19, 100, 53];
    let mut case = on_network(
        "a service whose waypoint is on another network, behind a gateway istiod names",
        "wp-through-gateway",
        "default/wp-through-gateway.default.svc.cluster.local",
        vip,
        Some(GATEWAY_IP.octets()),
    );
    let mut target = service(
        "wp-through-gateway",
        "wp-through-gateway.default.svc.cluster.local",
        vip,
    );
    if let Some(wl::address::Type::Service(svc)) = &mut target.r#type {
        svc.waypoint = Some(wl::GatewayAddress {
            destination: Some(wl::gateway_address::Destination::Hostname(
                wl::NamespacedHostname {
                    namespace: "default".into(),
                    hostname: "wp-server.default.svc.cluster.local".into(),
                },
            )),
            hbone_mtls_port: 15008,
        });
    }
    let mut waypoint = service(
        "wp-server",
        "wp-server.default.svc.cluster.local",
        [198, 19, 100, 54],
    );
    if let Some(wl::address::Type::Service(svc)) = &mut waypoint.r#type {
        svc.ports = vec![wl::Port {
            service_port: 15008,
            target_port: 15008,
            ..Default::default()
        }];
        svc.subject_alt_names = vec![format!("spiffe://cluster.local/ns/default/sa/{SERVER_SA}")];
    }
    case.server_services
        .push("default/wp-server.default.svc.cluster.local");
    case.addresses = vec![encode(target), encode(waypoint), encode(eastwest())];
    case.outbound[0].expect = Allowed;
    case.gateway_authority = Some(TUNNELED_TO_WAYPOINT);
    case
}

/// A service whose only endpoint is a WorkloadEntry of `network2` that
/// istiod sends without an address (reachable only through the gateway,
/// which tunnels the service's authority to the server's proxy; the
/// server is no endpoint and serves it by hostname).
fn addressless_through_gateway() -> Case {
    let hostname = "addressless.default.svc.cluster.local";
    let vip = [198, 19, 100, 55];
    let key = "default/addressless.default.svc.cluster.local";
    let mut case = case(
        "the only endpoint has no address, on another network behind a gateway",
        "addressless",
        key,
        vip,
        None,
        Allowed,
    );
    case.server_services = Vec::new();
    let mut target = service("addressless", hostname, vip);
    if let Some(wl::address::Type::Service(svc)) = &mut target.r#type {
        svc.subject_alt_names = vec![format!("spiffe://cluster.local/ns/default/sa/{SERVER_SA}")];
    }
    let mut entry = pod("remote-addressless", SERVER_SA, GATEWAY_IP, "");
    entry.uid = "Kubernetes/networking.istio.io/WorkloadEntry/default/remote-addressless".into();
    entry.addresses = Vec::new();
    entry.workload_type = wl::WorkloadType::Pod as i32;
    entry.network = "network2".into();
    entry.network_gateway = Some(wl::GatewayAddress {
        destination: Some(wl::gateway_address::Destination::Address(
            wl::NetworkAddress {
                network: "network2".into(),
                address: GATEWAY_IP.octets().to_vec(),
                length: None,
            },
        )),
        hbone_mtls_port: 15008,
    });
    entry.services.insert(
        key.into(),
        wl::PortList {
            ports: vec![wl::Port {
                service_port: 80,
                target_port: 8080,
                ..Default::default()
            }],
        },
    );
    case.addresses = vec![
        encode(target),
        encode(wl::Address {
            r#type: Some(wl::address::Type::Workload(entry)),
        }),
        encode(eastwest()),
    ];
    case.gateway_authority = Some(TUNNELED_ADDRESSLESS);
    case
}

/// The bed's east-west gateway as istiod sends it: a pod of
/// `istio-system` on `network2`.
fn eastwest() -> wl::Address {
    let mut gateway = pod("eastwest", GATEWAY_SA, GATEWAY_IP, "node-b");
    gateway.uid = "Kubernetes//Pod/istio-system/eastwest".into();
    gateway.namespace = "istio-system".into();
    gateway.network = "network2".into();
    wl::Address {
        r#type: Some(wl::address::Type::Workload(gateway)),
    }
}

/// A pod of another network at the server's address (pod CIDRs of two
/// networks may overlap), with another identity and the greater uid: the
/// address still names the server, on the client's network. ztunnel keys
/// workloads by network and address.
fn same_address_elsewhere() -> Case {
    let mut elsewhere = pod("zz-elsewhere", "sa-elsewhere", SERVER_IP, "node-remote");
    elsewhere.network = "network2".into();
    let mut case = Case::authz(
        "another network's pod at the server's address",
        Vec::new(),
        Vec::new(),
    );
    case.addresses = vec![encode(wl::Address {
        r#type: Some(wl::address::Type::Workload(elsewhere)),
    })];
    case.outbound = vec![OutboundRow {
        dst: SERVER_IP.octets(),
        port: 8080,
        expect: Allowed,
    }];
    case
}

/// A Service `default/<name>` at `vip` whose only endpoint, the server,
/// is on `network2` with `gateway` (the client on the default network).
/// ztunnel refuses: without a gateway there is no valid destination, and
/// its gateway's address is no workload it knows. shunt refuses too (no
/// endpoint behind a gateway; an unknown gateway); before, it dialled the
/// server directly.
fn on_network(
    name: &'static str,
    service_name: &'static str,
    key: &'static str,
    vip: [u8; 4],
    gateway: Option<[u8; 4]>,
) -> Case {
    let mut case = case(name, service_name, key, vip, None, Refused);
    case.server_network = "network2";
    case.server_gateway = gateway;
    case
}

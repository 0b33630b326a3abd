//! Locality load balancing, rows as plain data (service's mode and
//! preferences, the client's place, the ready endpoints' places, the
//! endpoints connections may go to) following ztunnel's `load_balance`, so
//! a harness running the real ztunnel can reuse them. One difference: an
//! endpoint on another network than the client's is never chosen (ztunnel
//! would send it through that network's gateway; shunt has none), and
//! the row where that matters says so.

use std::{
    collections::BTreeSet,
    net::{IpAddr, SocketAddr},
};

use super::Place;
use crate::state::{
    Endpoint, LoadBalancing, LoadBalancingMode as Mode, LoadBalancingScope as Scope, Service,
    ServicePort,
};

/// (region, zone, subzone, node, cluster, network).
type At = (
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
    &'static str,
);

/// (what, mode, preferences, client, endpoints (last octet of
/// 198.18.2.x, place), the octets connections may go to; empty: refused).
pub type Row = (
    &'static str,
    Mode,
    &'static [Scope],
    At,
    &'static [(u8, At)],
    &'static [u8],
);

const HERE: At = ("r1", "z1", "s1", "node-a", "c1", "n1");
const OTHER_NODE: At = ("r1", "z1", "s1", "node-b", "c1", "n1");
const OTHER_ZONE: At = ("r1", "z2", "s1", "node-c", "c1", "n1");
const OTHER_REGION: At = ("r2", "z1", "s1", "node-d", "c1", "n1");
const OTHER_NETWORK: At = ("r1", "z1", "s1", "node-e", "c1", "n2");

pub const LOCALITY_ROWS: &[Row] = &[
    (
        "STRICT NODE (internalTrafficPolicy: Local), only endpoint elsewhere: refused",
        Mode::Strict,
        &[Scope::Node],
        HERE,
        &[(11, OTHER_NODE)],
        &[],
    ),
    (
        "STRICT NODE: only the endpoint on the client's node",
        Mode::Strict,
        &[Scope::Node],
        HERE,
        &[(10, HERE), (11, OTHER_NODE)],
        &[10],
    ),
    (
        "FAILOVER NODE: the local endpoint first",
        Mode::Failover,
        &[Scope::Node],
        HERE,
        &[(10, HERE), (11, OTHER_NODE)],
        &[10],
    ),
    (
        "FAILOVER NODE, none local: any",
        Mode::Failover,
        &[Scope::Node],
        HERE,
        &[(11, OTHER_NODE), (12, OTHER_ZONE)],
        &[11, 12],
    ),
    (
        "FAILOVER region, zone (PreferClose): same zone before same region",
        Mode::Failover,
        &[Scope::Region, Scope::Zone],
        HERE,
        &[(11, OTHER_NODE), (12, OTHER_ZONE), (13, OTHER_REGION)],
        &[11],
    ),
    (
        "FAILOVER region, zone: same region before other regions",
        Mode::Failover,
        &[Scope::Region, Scope::Zone],
        HERE,
        &[(12, OTHER_ZONE), (13, OTHER_REGION)],
        &[12],
    ),
    (
        "FAILOVER zone, region: counting stops at the first mismatch",
        Mode::Failover,
        &[Scope::Zone, Scope::Region],
        HERE,
        &[(12, OTHER_ZONE), (13, OTHER_REGION)],
        &[13],
    ),
    (
        "STRICT region, zone: only all-matching",
        Mode::Strict,
        &[Scope::Region, Scope::Zone],
        HERE,
        &[(12, OTHER_ZONE), (13, OTHER_REGION)],
        &[],
    ),
    (
        "FAILOVER network first: the client's network above a closer zone elsewhere",
        Mode::Failover,
        &[Scope::Network, Scope::Region, Scope::Zone],
        HERE,
        &[(12, OTHER_ZONE), (14, OTHER_NETWORK)],
        &[12],
    ),
    (
        // ztunnel: 14, ranked by the others, through n2's gateway.
        "FAILOVER network first, none on the network: none without a network gateway",
        Mode::Failover,
        &[Scope::Network, Scope::Zone],
        HERE,
        &[
            (14, OTHER_NETWORK),
            (15, ("r1", "z2", "s1", "node-f", "c1", "n2")),
        ],
        &[],
    ),
    (
        "unspecified mode (standard): preferences ignored",
        Mode::Unspecified,
        &[Scope::Node],
        HERE,
        &[(10, HERE), (11, OTHER_NODE)],
        &[10, 11],
    ),
];

fn place(at: &At) -> Place<'static> {
    let (region, zone, subzone, node, cluster, network) = *at;
    Place {
        region,
        zone,
        subzone,
        node,
        cluster,
        network,
    }
}

fn ip(octet: u8) -> IpAddr {
    IpAddr::from([198, 18, 2, octet])
}

#[test]
fn endpoints_are_chosen_by_locality_as_ztunnel_chooses_them() {
    let dst: SocketAddr = "198.19.100.1:80".parse().expect("VIP");
    for (what, mode, scopes, client, endpoints, expected) in LOCALITY_ROWS {
        let service = Service {
            name: "web".into(),
            namespace: "default".into(),
            vips: vec![dst.ip()],
            ports: vec![ServicePort {
                port: 80,
                target_port: Some(8080),
            }],
            endpoints: endpoints
                .iter()
                .map(|(octet, at)| Endpoint {
                    network: place(at).network.into(),
                    ..Endpoint::new(ip(*octet), None)
                })
                .collect(),
            load_balancing: Some(LoadBalancing {
                routing_preference: scopes.to_vec(),
                mode: *mode,
                ..Default::default()
            }),
            ..Default::default()
        };
        let place_of = |e: &Endpoint| {
            endpoints
                .iter()
                .find(|(octet, _)| ip(*octet) == e.ip)
                .map(|(_, at)| place(at))
        };
        let chosen: BTreeSet<u8> = (0..8)
            .filter_map(|n| service.pick_for(dst, n, &place(client), place_of))
            .map(|(e, _)| match e.ip {
                IpAddr::V4(v4) => v4.octets()[3],
                IpAddr::V6(_) => 0,
            })
            .collect();
        let expected: BTreeSet<u8> = expected.iter().copied().collect();
        assert_eq!(chosen, expected, "{what}");
    }
}

#[test]
fn an_endpoint_with_no_known_workload_is_not_chosen_under_a_locality_policy() {
    let dst: SocketAddr = "198.19.100.1:80".parse().expect("VIP");
    let service = Service {
        vips: vec![dst.ip()],
        ports: vec![ServicePort {
            port: 80,
            target_port: Some(8080),
        }],
        // On the client's network: only the unknown place keeps it out.
        endpoints: vec![Endpoint {
            network: place(&HERE).network.into(),
            ..Endpoint::new(ip(10), None)
        }],
        load_balancing: Some(LoadBalancing {
            routing_preference: vec![Scope::Node],
            mode: Mode::Failover,
            ..Default::default()
        }),
        ..Default::default()
    };
    assert_eq!(service.pick_for(dst, 0, &place(&HERE), |_| None), None);
}

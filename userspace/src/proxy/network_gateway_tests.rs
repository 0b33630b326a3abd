//! Which gateway, identity and authority a connection to a service whose
//! endpoints are all on another network goes through, and why none.

use std::{net::SocketAddr, sync::Arc};

use super::through_gateway;
use crate::{
    state::{
        Endpoint, GatewayAddress, GatewayDestination, Service, ServicePort, TrustDomain, Workload,
        tests::workload,
    },
    store::WorkloadStore,
};

const VIP: &str = "198.19.100.50:80";
const SERVER_IP: &str = "198.18.2.10";
const GATEWAY_IP: &str = "198.18.2.11";

fn addr(s: &str) -> SocketAddr {
    s.parse().expect("test address")
}

/// The server (an endpoint of `web`, on network2 behind `gateway`, if
/// any), the service (with `sans`) and, when `gateway_known`, the gateway
/// pod `istio-system/eastwest` at its address on network2.
fn store(gateway: Option<GatewayDestination>, sans: &[&str], gateway_known: bool) -> WorkloadStore {
    let mut server = workload("default", "server", SERVER_IP, "node-b");
    server.network = "network2".into();
    server.network_gateway = gateway.map(|destination| GatewayAddress {
        destination,
        hbone_mtls_port: 15008,
    });
    let mut store = WorkloadStore::new();
    store.insert(Arc::new(server));
    if gateway_known {
        let mut gw: Workload = workload("istio-system", "eastwest", GATEWAY_IP, "node-b");
        gw.service_account = "istio-eastwestgateway".into();
        gw.network = "network2".into();
        store.insert(Arc::new(gw));
    }
    let mut endpoint = Endpoint::new(SERVER_IP.parse().expect("ip"), None);
    endpoint.network = "network2".into();
    store.replace_services([web(vec![endpoint], sans)]);
    store
}

fn web(endpoints: Vec<Endpoint>, sans: &[&str]) -> Service {
    Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        vips: vec![addr(VIP).ip()],
        ports: vec![ServicePort {
            port: 80,
            target_port: Some(8080),
        }],
        endpoints,
        subject_alt_names: sans.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn at_address(network: &str) -> Option<GatewayDestination> {
    Some(GatewayDestination::Address {
        network: network.into(),
        ip: GATEWAY_IP.parse().expect("ip"),
    })
}

fn hop_for(store: &WorkloadStore) -> Result<super::GatewayHop, String> {
    let service = store
        .services()
        .by_addr(addr(VIP))
        .cloned()
        .expect("the service");
    through_gateway(store, &TrustDomain::default(), &service, addr(VIP), "", 0)
}

#[test]
fn a_known_gateway_address_gives_the_double_hbone_hop() {
    let store = store(
        at_address("network2"),
        &["cluster.local/ns/default/sa/server"],
        true,
    );
    let hop = hop_for(&store).expect("a hop");
    assert_eq!(hop.authority, "web.default.svc.cluster.local:80");
    assert_eq!(hop.gateway, addr("198.18.2.11:15008"));
    assert_eq!(hop.network, "network2");
    assert_eq!(
        hop.gateway_identity.as_str(),
        "spiffe://cluster.local/ns/istio-system/sa/istio-eastwestgateway"
    );
    assert_eq!(
        hop.final_identity.as_str(),
        "spiffe://cluster.local/ns/default/sa/server"
    );
    assert!(hop.final_also_accept.is_empty());
}

#[test]
fn a_gateway_address_on_another_network_than_the_workload_is_not_it() {
    // The gateway pod is on network2; an address named on network3 is
    // nothing istiod sent.
    let err = hop_for(&store(
        at_address("network3"),
        &["cluster.local/ns/default/sa/server"],
        true,
    ))
    .expect_err("unknown gateway");
    assert!(
        err.contains("network gateway 198.18.2.11 on network network3"),
        "{err}"
    );
}

#[test]
fn no_gateway_no_hostname_or_no_sans_say_why() {
    let sans = &["cluster.local/ns/default/sa/server"];
    let err = hop_for(&store(None, sans, true)).expect_err("no gateway");
    assert!(err.contains("none behind a network gateway"), "{err}");
    assert!(err.contains("network2"), "{err}");

    let err = hop_for(&store(at_address("network2"), sans, false)).expect_err("unknown");
    assert!(err.contains("no workload or service istiod sent"), "{err}");

    let err = hop_for(&store(at_address("network2"), &[], true)).expect_err("no SANs");
    assert!(
        err.contains("no subject_alt_names for service default/web"),
        "{err}"
    );
}

#[test]
fn a_gateway_service_by_hostname_is_one_of_its_ready_endpoints() {
    let mut store = store(
        Some(GatewayDestination::Hostname {
            namespace: "istio-system".into(),
            hostname: "eastwest.istio-system.svc.cluster.local".into(),
        }),
        &["cluster.local/ns/default/sa/server"],
        true,
    );
    let mut member = Endpoint::new(GATEWAY_IP.parse().expect("ip"), None);
    member.network = "network2".into();
    let gateway_service = Service {
        name: "eastwest".into(),
        namespace: "istio-system".into(),
        hostname: "eastwest.istio-system.svc.cluster.local".into(),
        vips: vec!["198.19.100.60".parse().expect("ip")],
        ports: vec![ServicePort {
            port: 15008,
            target_port: Some(15008),
        }],
        endpoints: vec![member],
        subject_alt_names: vec!["cluster.local/ns/istio-system/sa/gateway-extra".into()],
        ..Default::default()
    };
    let web = store.services().by_addr(addr(VIP)).cloned().expect("web");
    store.replace_services([(*web).clone(), gateway_service]);
    let hop = hop_for(&store).expect("a hop");
    assert_eq!(hop.gateway, addr("198.18.2.11:15008"));
    assert_eq!(
        hop.gateway_sans,
        ["spiffe://cluster.local/ns/istio-system/sa/gateway-extra"]
    );
}

/// Through the proxy's lookup: a ready endpoint on the client's network
/// is always preferred; only when there is none does a connection go
/// through another network's gateway.
#[test]
fn the_lookup_goes_through_a_gateway_only_when_its_own_network_has_no_endpoint() {
    use super::super::lookup::{Target, WorkloadLookup};
    let store = store(
        at_address("network2"),
        &["cluster.local/ns/default/sa/server"],
        true,
    );
    let web = store.services().by_addr(addr(VIP)).cloned().expect("web");
    let client = "198.18.1.10".parse().expect("ip");
    let td = TrustDomain::default();
    let lookup = std::sync::RwLock::new(store);
    let target = lookup.pick_endpoint(&td, &web, client, addr(VIP), 0);
    assert!(
        matches!(&target, Ok(Target::ThroughGateway(hop)) if hop.gateway == addr("198.18.2.11:15008")),
        "{target:?}"
    );
    let mut local = Endpoint::new("198.18.1.20".parse().expect("ip"), None);
    local.network = String::new();
    let mut with_local = (*web).clone();
    with_local.endpoints.push(local);
    for n in 0..4 {
        let target = lookup.pick_endpoint(&td, &with_local, client, addr(VIP), n);
        assert_eq!(
            target,
            Ok(Target::Direct(addr("198.18.1.20:8080"))),
            "connection {n}"
        );
    }
}

/// An endpoint without an address (a WorkloadEntry of network2 istiod
/// sends with none) is reached only through its gateway, from another
/// network; from its own network it is nothing.
#[test]
fn an_addressless_endpoint_is_reached_through_its_gateway_only_from_another_network() {
    use super::super::lookup::{NoEndpoint, Target, WorkloadLookup};
    let mut store = store(None, &["cluster.local/ns/default/sa/server"], true);
    let mut web = (*store.services().by_addr(addr(VIP)).cloned().expect("web")).clone();
    web.endpoints.clear();
    web.gateway_only.push(crate::state::GatewayOnlyEndpoint {
        ready: true,
        network: "network2".into(),
        gateway: GatewayAddress {
            destination: at_address("network2").expect("destination"),
            hbone_mtls_port: 15008,
        },
        capacity: 1,
        ports: Default::default(),
    });
    store.replace_services([web.clone()]);
    let td = TrustDomain::default();
    let lookup = std::sync::RwLock::new(store);
    let from_default = "198.18.1.10".parse().expect("ip");
    let target = lookup.pick_endpoint(&td, &web, from_default, addr(VIP), 0);
    assert!(
        matches!(&target, Ok(Target::ThroughGateway(hop))
            if hop.gateway == addr("198.18.2.11:15008") && hop.network == "network2"),
        "{target:?}"
    );
    // A port the service does not have is not served.
    let other_port = lookup.pick_endpoint(&td, &web, from_default, addr("198.19.100.50:81"), 0);
    assert_eq!(other_port, Err(NoEndpoint::NoneReady));
    // A client on network2 (the client workload known there) gets none.
    let mut client: Workload = workload("default", "client", "198.18.1.10", "node-a");
    client.network = "network2".into();
    lookup
        .write()
        .expect("lock")
        .insert(std::sync::Arc::new(client));
    let target = lookup.pick_endpoint(&td, &web, from_default, addr(VIP), 0);
    assert_eq!(target, Err(NoEndpoint::NoneReady));
}

//! Endpoint choice by locality (issue 34 item 7): a Service whose only
//! endpoint (the server, on node-b) is on another node than the client
//! (node-a), reached through the client's proxy.

use shunt_proto::istio::workload::{self as wl, load_balancing};

use super::{Case, OutboundRow};
use crate::reference::{
    probe::Outcome::{self, Allowed, Refused},
    resources::{encode, service},
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
    ]
}

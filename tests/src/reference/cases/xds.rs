//! What real istiod output does to the address feed (issue 34 items 3, 4
//! and 5), seen from the server side: the server workload names a
//! WORKLOAD_SELECTOR policy denying `default/sleep`, so the policy holds
//! exactly when the server's own workload resource was applied. Each case
//! adds resources to the same response as the server's workload; after a
//! NACK, a later ACKed push shows whether the rest of the NACKed response
//! was applied.

use shunt::xds::ADDRESS_TYPE_URL;
use shunt_proto::istio::{
    security::{Action, Match, Scope},
    workload as wl,
};

use super::{Case, OTHER, OutboundRow, PLAINTEXT, SLEEP, XdsAnswer, row};
use crate::reference::{
    bed::{NODE_B_IP, SERVER_IP},
    probe::Outcome::{Allowed, Refused},
    resources::{any_resource, authorization, encode, exact, pod, rule, service, workload},
};

const FRESH_VIP: [u8; 4] = [198, 19, 100, 43];
const EXT_A_VIP: [u8; 4] = [198, 19, 100, 41];
const EXT_B_VIP: [u8; 4] = [198, 19, 100, 42];
const LATER_VIP: [u8; 4] = [198, 19, 100, 59];

fn to(dst: [u8; 4], expect: crate::reference::probe::Outcome) -> OutboundRow {
    OutboundRow {
        dst,
        port: 80,
        expect,
    }
}

/// The policy allowing only the client, for the cases that name it.
pub const ALLOWED: &str = "default/allow-client-selected";

/// The policy the server workload names.
pub const SELECTED: &str = "default/deny-sleep-selected";

fn case(name: &'static str, addresses: Vec<wl::Address>, answer: XdsAnswer) -> Case {
    raw_case(name, addresses.into_iter().map(encode).collect(), answer)
}

fn raw_case(
    name: &'static str,
    addresses: Vec<shunt_proto::envoy::service::discovery::v3::Resource>,
    answer: XdsAnswer,
) -> Case {
    Case {
        name,
        addresses,
        // After a NACK, a later push (an unrelated pod) that is ACKed.
        then_addresses: match answer {
            XdsAnswer::Ack => Vec::new(),
            XdsAnswer::NackNaming(_) => vec![workload(pod(
                "later",
                "later",
                [198, 18, 1, 70].into(),
                "node-a",
            ))],
        },
        server_policies: vec![SELECTED],
        server_services: Vec::new(),
        authorizations: vec![authorization(
            "deny-sleep-selected",
            Scope::WorkloadSelector,
            Action::Deny,
            vec![rule(vec![vec![Match {
                principals: vec![exact("cluster.local/ns/default/sa/sleep")],
                ..Default::default()
            }]])],
        )],
        addresses_answer: answer,
        rows: vec![row(SLEEP, 8080, Refused), row(OTHER, 8080, Allowed)],
        before_sync: Vec::new(),
        outbound: Vec::new(),
        dns: Vec::new(),
        client_network: "",
        server_network: "",
        server_gateway: None,
        gateway_authority: None,
        forwarded_host: None,
        deployed: false,
        hbone_port_dropped: false,
        resolves: Vec::new(),
    }
}

fn as_workload(w: wl::Workload) -> wl::Address {
    wl::Address {
        r#type: Some(wl::address::Type::Workload(w)),
    }
}

/// A hostNetwork pod of kube-system on node-b, as istiod sends one.
fn host_network(name: &str) -> wl::Address {
    let mut w = pod(name, name, NODE_B_IP, "node-b");
    w.uid = format!("Kubernetes//Pod/kube-system/{name}");
    w.namespace = "kube-system".into();
    w.network_mode = wl::NetworkMode::HostNetwork as i32;
    w.tunnel_protocol = wl::TunnelProtocol::None as i32;
    as_workload(w)
}

pub fn cases() -> Vec<Case> {
    let mut legacy = pod("legacy", "legacy", [198, 18, 2, 60].into(), "node-b");
    legacy.tunnel_protocol = wl::TunnelProtocol::LegacyIstioMtls as i32;
    let mut entry = pod("server", "sa-entry", [198, 18, 2, 50].into(), "node-b");
    entry.uid = "Kubernetes/networking.istio.io/WorkloadEntry/default/server".into();
    let mut undecodable = raw_case(
        "one undecodable resource and a new Service in the response",
        vec![
            any_resource(
                "default/broken",
                ADDRESS_TYPE_URL,
                vec![0x0a, 0xff, 0xff, 0xff],
            ),
            encode(service(
                "fresh",
                "fresh.default.svc.cluster.local",
                FRESH_VIP,
            )),
        ],
        XdsAnswer::NackNaming("default/broken"),
    );
    undecodable.server_services = vec!["default/fresh.default.svc.cluster.local"];
    undecodable.outbound = vec![to(FRESH_VIP, Allowed)];
    let mut two_hosts = case(
        "two ServiceEntry hosts as Services default/ext",
        vec![
            service("ext", "a.ext.example.com", EXT_A_VIP),
            service("ext", "b.ext.example.com", EXT_B_VIP),
        ],
        XdsAnswer::Ack,
    );
    two_hosts.server_services = vec!["default/a.ext.example.com", "default/b.ext.example.com"];
    two_hosts.outbound = vec![to(EXT_A_VIP, Allowed), to(EXT_B_VIP, Allowed)];
    // A visibility istiod may add later: ztunnel keeps the service,
    // public (it fails open there), and ACKs.
    let mut unknown_visibility = service("later", "later.default.svc.cluster.local", LATER_VIP);
    if let Some(wl::address::Type::Service(svc)) = &mut unknown_visibility.r#type {
        svc.visibility = 7;
    }
    let mut later_visibility = case(
        "a Service with a visibility value from a later istiod",
        vec![unknown_visibility],
        XdsAnswer::Ack,
    );
    later_visibility.server_services = vec!["default/later.default.svc.cluster.local"];
    later_visibility.outbound = vec![to(LATER_VIP, Allowed)];
    // Item 5: the client calls the pod by IP; only mutual TLS with the
    // client's identity is allowed in, so a lost HBONE mapping shows.
    let mut entry_then_call = case(
        "a WorkloadEntry named like the server pod; the client calls the pod",
        vec![as_workload(entry.clone())],
        XdsAnswer::Ack,
    );
    entry_then_call.server_policies = vec![ALLOWED];
    entry_then_call.authorizations = vec![authorization(
        "allow-client-selected",
        Scope::WorkloadSelector,
        Action::Allow,
        vec![rule(vec![vec![Match {
            principals: vec![exact("cluster.local/ns/default/sa/sa-client")],
            ..Default::default()
        }]])],
    )];
    entry_then_call.rows = vec![row(OTHER, 8080, Refused), row(PLAINTEXT, 8080, Refused)];
    entry_then_call.outbound = vec![OutboundRow {
        dst: SERVER_IP.octets(),
        port: 8080,
        expect: Allowed,
    }];
    vec![
        case("the server's workload alone", vec![], XdsAnswer::Ack),
        // Item 3: kube-proxy and a CNI agent, both on the node's IP.
        case(
            "two hostNetwork pods on the node's IP",
            vec![host_network("kube-proxy"), host_network("cni-agent")],
            XdsAnswer::Ack,
        ),
        // Item 4: the response also carries a resource that does not decode;
        // the new Service in it must still be served.
        undecodable,
        // Item 4: a workload ztunnel cannot serve.
        case(
            "a LEGACY_ISTIO_MTLS workload in the response",
            vec![as_workload(legacy)],
            XdsAnswer::NackNaming("Kubernetes//Pod/default/legacy"),
        ),
        // Item 5: a WorkloadEntry with the pod's namespace/name, other IP.
        case(
            "a WorkloadEntry named like the server pod",
            vec![as_workload(entry)],
            XdsAnswer::Ack,
        ),
        entry_then_call,
        // Item 5: one Service per ServiceEntry host, same namespace/name:
        // both VIPs reach the server.
        two_hosts,
        later_visibility,
    ]
}

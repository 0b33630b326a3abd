//! Kubernetes Services, end to end on the real kernel, in both redirection
//! modes: a client pod connects to a service VIP that no interface holds
//! (connect4, or iptables REDIRECT, hands the connect to the proxy anyway),
//! and the proxy sends it to one of the service's
//! endpoints — over HBONE to a mesh pod on another node, as plain TCP to a
//! pod outside the mesh, or nowhere (RST) when the service has no endpoint.

use std::{net::Ipv4Addr, time::Duration};

use serde_json::Value;
use shunt_testbed::{
    Cgroup, Topology,
    access_log::wait_for_access_line,
    agent::{Agent, ServiceSpec, WorkloadSpec, mesh_pods_enrolled, services_yaml, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);

fn service(name: &str, vip: Ipv4Addr, endpoints: &[&str]) -> ServiceSpec {
    ServiceSpec {
        name: name.into(),
        namespace: "default".into(),
        vip,
        port: 80,
        target_port: 8080,
        endpoints: endpoints.iter().map(|e| e.to_string()).collect(),
    }
}

fn service_vips_end_to_end(mode: &str) {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(&format!("svc-{mode}")).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let outsider = topo.add_pod("node-b", "outsider").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    // VIPs in the test range that no node, pod or route holds.
    let mesh_vip = Ipv4Addr::new(198, 19, 100, 1);
    let plain_vip = Ipv4Addr::new(198, 19, 100, 2);
    let empty_vip = Ipv4Addr::new(198, 19, 100, 3);
    let outsider_ip = outsider.ip().to_string();
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]) + &services_yaml(&[
        service("web", mesh_vip, &["server"]),
        // Named by IP: an endpoint outside the mesh.
        service("plain", plain_vip, &[&outsider_ip]),
        service("empty", empty_vip, &[]),
    ]);
    let args = ["--redirect", mode, "--log-format", "json"];
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let mut agent_a = Agent::start(&topo, &node_a, &yaml, &args).expect("agent a");
    let mut agent_b = Agent::start(&topo, &node_b, &yaml, &args).expect("agent b");
    for agent in [&mut agent_a, &mut agent_b] {
        agent
            .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
            .expect("enrolled");
    }
    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let outsider_app = EchoServer::on(&outsider, 8080).expect("echo");

    // VIP → mesh endpoint on node-b: HBONE to server:15008 for server:8080.
    let report = apps.run(
        &client,
        &["connect", &format!("{mesh_vip}:80"), "--send", "262144"],
    );
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent_a.logs()
    );
    assert_eq!(
        server_app.peers().len(),
        1,
        "the endpoint got the connection"
    );
    let client_id = "spiffe://cluster.local/ns/default/sa/sa-client";
    let to_server = format!("{}:8080", server.ip());
    wait_for_access_line(
        &agent_b,
        "inbound",
        "node-b's proxy saw an HBONE stream from the client to the endpoint",
        |l| {
            l["fields"]["src.identity"] == client_id
                && l["fields"]["dst.addr"] == to_server.as_str()
                && l["fields"]["result"] == "success"
        },
    );
    wait_for_access_line(
        &agent_a,
        "outbound",
        "node-a's access log names the service and the endpoint",
        |l| {
            l["fields"]["dst.service"] == "web.default.svc.cluster.local"
                && l["fields"]["dst.addr"] == to_server.as_str()
        },
    );

    // VIP → endpoint outside the mesh: plain TCP from the client's own IP
    // to outsider:8080.
    let report = apps.run(
        &client,
        &["connect", &format!("{plain_vip}:80"), "--send", "65536"],
    );
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent_a.logs()
    );
    let peers = outsider_app.peers();
    assert_eq!(peers.len(), 1, "the endpoint got the connection");
    assert_eq!(peers[0].ip(), client.ip(), "passthrough keeps the pod's IP");
    let to_outsider = format!("{outsider_ip}:8080");
    wait_for_access_line(
        &agent_a,
        "passthrough",
        "node-a's access log names the service and the endpoint",
        |l| {
            l["fields"]["dst.service"] == "plain.default.svc.cluster.local"
                && l["fields"]["dst.addr"] == to_outsider.as_str()
        },
    );

    // A VIP with no endpoint: refused (RST), the log naming the service.
    let report = apps.run(
        &client,
        &[
            "connect",
            &format!("{empty_vip}:80"),
            "--timeout-ms",
            "3000",
        ],
    );
    assert_ne!(report["intact"], Value::Bool(true), "{report}");
    wait_for_access_line(&agent_a, "outbound", "the refusal names the service", |l| {
        l["fields"]["dst.service"] == "empty.default.svc.cluster.local"
            && l["fields"]["result"] == "refused"
            && l["fields"]["reason"]
                .as_str()
                .is_some_and(|r| r.contains("no ready endpoint"))
    });

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

#[test]
fn a_service_vip_reaches_its_endpoint_in_ebpf_mode() {
    service_vips_end_to_end("ebpf");
}

/// The same through iptables REDIRECT (the VIP is routed by the pod's
/// default route before the nat rule rewrites it).
#[test]
fn a_service_vip_reaches_its_endpoint_in_iptables_mode() {
    service_vips_end_to_end("iptables");
}

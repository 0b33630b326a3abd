//! The whole node, end to end, in both redirection modes: real agents (one
//! per node, sharing a trust root), real redirection, real HBONE between
//! them, real application processes. Nothing stands in for anything.
//!
//! Each mode runs with source preservation (`--preserve-source`, the
//! default: applications accept inbound connections from the client's own
//! address, which only works if the pod's reply path brings the answers
//! back to the proxy) and without it (from their own pod's address).

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use serde_json::Value;
use shunt_testbed::{
    Cgroup, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
/// The agent's warning when it cannot bind the client's address.
const FALLBACK_WARNING: &str = "cannot connect to the application from the client's address";

fn proxy_stat(agent: &Agent, pick: impl Fn(&shunt::proxy::ProxyStats) -> u64) -> u64 {
    agent
        .status()
        .expect("status")
        .proxy
        .map(|p| pick(&p))
        .unwrap_or(0)
}

/// The peer an application should see for a client at `client`, the app
/// being in the pod at `own`.
fn expected_peer(preserve: bool, client: Ipv4Addr, own: Ipv4Addr) -> IpAddr {
    IpAddr::V4(if preserve { client } else { own })
}

fn mesh_end_to_end(mode: &str, preserve: bool) {
    require_root().expect("kernel tests need root");
    let flag = if preserve { "on" } else { "off" };
    let mut topo = Topology::new(&format!("mesh-{mode}-{flag}")).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let neighbour = topo.add_pod("node-a", "neighbour").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let outsider = topo.add_pod("node-b", "outsider").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&neighbour, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    let args = ["--redirect", mode, "--preserve-source", flag];
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let mut agent_a = Agent::start(&topo, &node_a, &yaml, &args).expect("agent a");
    let mut agent_b = Agent::start(&topo, &node_b, &yaml, &args).expect("agent b");
    for agent in [&mut agent_a, &mut agent_b] {
        let status = agent
            .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
            .expect("enrolled");
        assert_eq!(status.mode, mode);
    }
    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let neighbour_app = EchoServer::on(&neighbour, 8080).expect("echo");
    let outsider_app = EchoServer::on(&outsider, 8080).expect("echo");

    // Cross-node, mesh to mesh: HBONE from node-a's proxy to node-b's. The
    // client pod's IP is the source of the HBONE connection; 1 MiB echoed
    // back means every reply segment took the reply path.
    let to_server = format!("{}:8080", server.ip());
    let report = apps.run(&client, &["connect", &to_server, "--send", "1048576"]);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent_a.logs()
    );
    assert!(proxy_stat(&agent_a, |p| p.outbound_hbone) >= 1);
    assert!(proxy_stat(&agent_b, |p| p.inbound_hbone) >= 1);
    let peers = server_app.peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(
        peers[0].ip(),
        expected_peer(preserve, client.ip(), server.ip()),
        "cross-node HBONE peer\n{}",
        agent_b.logs()
    );

    // Same node, mesh to mesh: still HBONE, through the inbound checks.
    let to_neighbour = format!("{}:8080", neighbour.ip());
    let report = apps.run(&client, &["connect", &to_neighbour, "--send", "65536"]);
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(proxy_stat(&agent_a, |p| p.inbound_hbone) >= 1);
    let peers = neighbour_app.peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(
        peers[0].ip(),
        expected_peer(preserve, client.ip(), neighbour.ip()),
        "same-node HBONE peer"
    );

    // Mesh to a pod outside the mesh: plain TCP from the client's own IP.
    let to_outsider = format!("{}:8080", outsider.ip());
    let report = apps.run(&client, &["connect", &to_outsider, "--send", "65536"]);
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(proxy_stat(&agent_a, |p| p.outbound_passthrough) >= 1);
    let peers = outsider_app.peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(
        peers[0].ip(),
        IpAddr::V4(client.ip()),
        "passthrough keeps the pod's IP"
    );

    // From outside the mesh to a mesh pod: inbound plaintext through 15006.
    let report = apps.run(&outsider, &["connect", &to_server, "--send", "65536"]);
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(proxy_stat(&agent_b, |p| p.inbound_plaintext) >= 1);
    let peers = server_app.peers();
    assert_eq!(peers.len(), 2);
    assert_eq!(
        peers[1].ip(),
        expected_peer(preserve, outsider.ip(), server.ip()),
        "inbound plaintext peer"
    );

    for agent in [&mut agent_a, &mut agent_b] {
        assert!(
            !agent.logs().contains(FALLBACK_WARNING),
            "no fallback to the pod's own address:\n{}",
            agent.logs()
        );
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

#[test]
fn mesh_traffic_flows_through_hbone_in_ebpf_mode() {
    mesh_end_to_end("ebpf", true);
}

#[test]
fn mesh_traffic_flows_through_hbone_in_iptables_mode() {
    mesh_end_to_end("iptables", true);
}

#[test]
fn without_source_preservation_apps_see_their_own_address_in_ebpf_mode() {
    mesh_end_to_end("ebpf", false);
}

#[test]
fn without_source_preservation_apps_see_their_own_address_in_iptables_mode() {
    mesh_end_to_end("iptables", false);
}

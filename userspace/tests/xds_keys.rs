//! End to end on the real kernel: resources keyed as xDS names them
//! (issue 34, item 5). Two nodes; node-a's agent takes its cluster view
//! from an in-test istiod. istiod sends the server pod
//! (`Kubernetes//Pod/default/server`) and a WorkloadEntry of the same
//! namespace/name at another address, and a ServiceEntry's two hosts as
//! two services `default/ext` (a.ext.example.com, b.ext.example.com), each
//! with its VIP and the server pod as endpoint. The client's connection to
//! the pod's IP still goes over HBONE (node-b's proxy logs the client's
//! identity), and both VIPs reach the pod.
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt --test xds_keys`.

#[path = "support/fake_istiod.rs"]
mod fake_istiod;

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use fake_istiod::{FakeIstiod, Pki, agent_args, pod, response, service, workload};
use shunt::state::PodState;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::istio::workload as workload_pb;
use shunt_testbed::{
    Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    apps::EchoServer,
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(30);
const VIP_A: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 41);
const VIP_B: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 42);
/// The WorkloadEntry's address: assigned to nothing.
const ENTRY_IP: [u8; 4] = [198, 18, 250, 7];

fn echo(client: &shunt_testbed::Pod, to: SocketAddr, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut conn = client
        .connect_tcp(to, Duration::from_secs(5))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    conn.set_read_timeout(Some(Duration::from_secs(5)))?;
    conn.write_all(payload)?;
    conn.shutdown(std::net::Shutdown::Write)?;
    let mut back = Vec::new();
    conn.read_to_end(&mut back)?;
    Ok(back)
}

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// `default/ext` with one of its hosts at `vip`: port 80 to 8080.
fn ext(host: &str, vip: Ipv4Addr) -> workload_pb::Service {
    workload_pb::Service {
        name: "ext".into(),
        namespace: "default".into(),
        hostname: host.into(),
        addresses: vec![workload_pb::NetworkAddress {
            network: String::new(),
            address: vip.octets().to_vec(),
            ..Default::default()
        }],
        ports: vec![workload_pb::Port {
            service_port: 80,
            target_port: 8080,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// node-b's inbound HBONE access lines carrying `identity`.
fn hbone_arrivals(agent: &Agent, identity: &str) -> usize {
    agent
        .logs()
        .lines()
        .filter(|l| l.contains("shunt::access") && l.contains("inbound") && l.contains(identity))
        .count()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_workload_entry_named_like_a_pod_keeps_hbone_and_both_hosts_are_served() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("xds-keys").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();

    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let xds_address = istiod.addr.to_string();

    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
    ]);
    let common = ["--redirect", "iptables", "--log-format", "json"];
    let xds = agent_args(&xds_address, &pki);
    let mut xds_args = common.to_vec();
    xds_args.extend(xds.iter().map(String::as_str));
    let mut agent_a = blocking(|| Agent::start(&topo, &node_a, &yaml, &xds_args)).expect("agent a");
    let mut agent_b = blocking(|| Agent::start(&topo, &node_b, &yaml, &common)).expect("agent b");
    istiod.initial_requests(1).await;

    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    let mut server_pb = pod("default", server.name(), server.ip().octets(), "node-b");
    server_pb.service_account = "sa-server".into();
    for host in ["a.ext.example.com", "b.ext.example.com"] {
        server_pb.services.insert(
            format!("default/{host}"),
            workload_pb::PortList {
                ports: vec![workload_pb::Port {
                    service_port: 80,
                    target_port: 0,
                    ..Default::default()
                }],
            },
        );
    }
    // The WorkloadEntry `default/<server>`: another workload, plaintext.
    let mut entry_pb = pod("default", server.name(), ENTRY_IP, "");
    entry_pb.uid = format!(
        "Kubernetes/networking.istio.io/WorkloadEntry/default/{}",
        server.name()
    );
    entry_pb.tunnel_protocol = workload_pb::TunnelProtocol::None as i32;
    entry_pb.workload_type = workload_pb::WorkloadType::Deployment as i32;
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(client_pb, "1"),
            workload(server_pb, "1"),
            workload(entry_pb, "1"),
            service(ext("a.ext.example.com", VIP_A), "1"),
            service(ext("b.ext.example.com", VIP_B), "1"),
        ],
        &[],
    ));
    istiod.push(response(AUTHORIZATION_TYPE_URL, "p1", vec![], &[]));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);
    for agent in [&mut agent_a, &mut agent_b] {
        blocking(|| {
            agent.wait_for("mesh pods enrolled and synced", TIMEOUT, |s| {
                s.pods.iter().all(|p| p.state == PodState::Enrolled)
                    && s.xds.as_ref().is_none_or(|x| x.synced)
            })
        })
        .expect("enrolled");
    }
    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let client_id = "spiffe://cluster.local/ns/default/sa/sa-client";

    // To the pod's own IP, then to each VIP: every one over HBONE.
    let targets = [
        SocketAddr::from((server.ip(), 8080)),
        SocketAddr::from((VIP_A, 80)),
        SocketAddr::from((VIP_B, 80)),
    ];
    for (i, to) in targets.into_iter().enumerate() {
        let before = hbone_arrivals(&agent_b, client_id);
        let payload = vec![i as u8; 4096];
        let back = blocking(|| echo(&client, to, &payload))
            .unwrap_or_else(|e| panic!("connect to {to}: {e}\n{}", agent_a.logs()));
        assert_eq!(back, payload, "echo via {to}");
        let deadline = Instant::now() + TIMEOUT;
        while hbone_arrivals(&agent_b, client_id) <= before {
            assert!(
                Instant::now() < deadline,
                "{to}: no inbound HBONE line with the client's identity on node-b (plaintext?):\n{}",
                agent_b.logs()
            );
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    assert_eq!(
        server_app.peers().len(),
        3,
        "each connection reached the pod"
    );

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = blocking(|| agent.stop()).expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

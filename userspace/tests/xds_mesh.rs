//! End to end on the real kernel: a Service that exists only in istiod's
//! xDS pushes. Two nodes in the netns testbed; the agent of node-a takes its
//! cluster view from an in-test istiod (TLS, token, node id checked) that
//! listens inside node-a's netns; enrolment still comes from the workloads
//! file, which names no service. A connect from the client pod to the VIP
//! lands on the healthy endpoint on node-b over HBONE, never on the
//! unhealthy one; after a delta push removes the endpoint, new connections
//! are refused.
//!
//! Run as root: `cargo build -p shunt --bins && SHUNT_BIN=… cargo test -p
//! shunt --test xds_mesh`.

#[path = "support/fake_istiod.rs"]
mod fake_istiod;

use std::{
    io::{Read as _, Write as _},
    net::{Ipv4Addr, SocketAddr},
    time::{Duration, Instant},
};

use fake_istiod::{FakeIstiod, Pki, pod, response, service, workload};
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
const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 1);
const WEB: &str = "default/web.default.svc.cluster.local";

/// A workload for a testbed pod, as istiod would send it: the service
/// account the workloads file gives it, backing `web` on port 80 (target
/// port 0: the service's).
fn backend(p: &shunt_testbed::Pod, healthy: bool) -> workload_pb::Workload {
    let mut w = pod("default", p.name(), p.ip().octets(), p.node().name());
    w.service_account = format!("sa-{}", p.name());
    w.services.insert(
        WEB.into(),
        workload_pb::PortList {
            ports: vec![workload_pb::Port {
                service_port: 80,
                target_port: 0,
            }],
        },
    );
    if !healthy {
        w.status = workload_pb::WorkloadStatus::Unhealthy as i32;
    }
    w
}

/// One echo round trip through the VIP from the client pod's netns;
/// `Err` when the connection is refused or reset.
fn echo_via_vip(client: &shunt_testbed::Pod, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut conn = client
        .connect_tcp(SocketAddr::from((VIP, 80)), Duration::from_secs(5))
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_known_only_from_istiod_reaches_its_endpoint_over_hbone() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("xds-mesh").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let sick = topo.add_pod("node-b", "sick").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();

    // istiod, reachable from node-a's netns on its loopback.
    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let xds_address = istiod.addr.to_string();
    let root = pki.root_file().display().to_string();
    let token = pki.token_file().display().to_string();

    // The file enrols the pods; it names no service.
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&sick, true),
    ]);
    let common = ["--redirect", "iptables", "--log-format", "json"];
    let mut xds_args = common.to_vec();
    xds_args.extend([
        "--xds-address",
        &xds_address,
        "--xds-root-cert",
        &root,
        "--xds-token",
        &token,
        "--instance-ip",
        "198.18.0.5",
        "--pod-name",
        "shunt-x1",
        "--pod-namespace",
        "istio-system",
    ]);
    let mut agent_a = blocking(|| Agent::start(&topo, &node_a, &yaml, &xds_args)).expect("agent a");
    let mut agent_b = blocking(|| Agent::start(&topo, &node_b, &yaml, &common)).expect("agent b");

    // Not ready until istiod has sent both types.
    let initial = istiod.initial_requests(1).await;
    assert_eq!(initial.len(), 2);
    let (code, body) = blocking(|| agent_a.readiness()).expect("readiness");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("xds: FAIL"), "{body}");

    let service_pb = workload_pb::Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        addresses: vec![workload_pb::NetworkAddress {
            network: String::new(),
            address: VIP.octets().to_vec(),
        }],
        ports: vec![workload_pb::Port {
            service_port: 80,
            target_port: 8080,
        }],
        ..Default::default()
    };
    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(client_pb, "1"),
            workload(backend(&server, true), "1"),
            workload(backend(&sick, false), "1"),
            service(service_pb, "1"),
        ],
        &[],
    ));
    istiod.push(response(AUTHORIZATION_TYPE_URL, "p1", vec![], &[]));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);

    for agent in [&mut agent_a, &mut agent_b] {
        blocking(|| {
            agent.wait_for("mesh pods enrolled", TIMEOUT, |s| {
                s.pods.iter().all(|p| p.state == PodState::Enrolled)
            })
        })
        .expect("enrolled");
    }
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let (code, body) = blocking(|| agent_a.readiness()).expect("readiness");
        if code == 200 {
            assert!(body.contains("xds: ok"), "{body}");
            break;
        }
        assert!(Instant::now() < deadline, "agent a never ready: {body}");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let sick_app = EchoServer::on(&sick, 8080).expect("echo");
    for i in 0..4u8 {
        let payload = vec![i; 65536];
        let back = blocking(|| echo_via_vip(&client, &payload))
            .unwrap_or_else(|e| panic!("connect {i} to the VIP: {e}\n{}", agent_a.logs()));
        assert_eq!(back, payload, "echo through the VIP");
    }
    assert_eq!(
        server_app.peers().len(),
        4,
        "every connection on the healthy endpoint"
    );
    assert!(
        sick_app.peers().is_empty(),
        "the unhealthy workload is not an endpoint"
    );

    // HBONE: node-b's proxy received the streams from the client's identity.
    let client_id = "spiffe://cluster.local/ns/default/sa/sa-client";
    let deadline = Instant::now() + TIMEOUT;
    while !agent_b
        .logs()
        .lines()
        .any(|l| l.contains("shunt::access") && l.contains("inbound") && l.contains(client_id))
    {
        assert!(
            Instant::now() < deadline,
            "no inbound HBONE access line:\n{}",
            agent_b.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    // A delta push removes the endpoint: new connections are refused.
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "rm1",
        vec![],
        &[&format!("Kubernetes//Pod/default/{}", server.name())],
    ));
    assert_eq!(istiod.answer_to("rm1").await.error_detail, None);
    let deadline = Instant::now() + TIMEOUT;
    loop {
        // Refused: reset, or closed without an answer.
        if !matches!(blocking(|| echo_via_vip(&client, b"x")), Ok(back) if back == b"x") {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the VIP still answers after the removal"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(
        server_app.peers().len(),
        4,
        "no new connection reached the removed endpoint"
    );

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = blocking(|| agent.stop()).expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

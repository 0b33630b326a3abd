//! Waypoints end to end on the real kernel (issue 21): a client pod's
//! connections to a service bound to a waypoint, and to a pod bound to
//! one, go over HBONE to a stand-in waypoint (`shunt_testbed::waypoint`: a
//! real HBONE server and client with its own SPIFFE identity, in a pod no
//! agent enrols), which forwards them to the destination over HBONE; the
//! destination's agent sees the waypoint's identity. When the waypoint is
//! down the connection fails and nothing reaches the server: the waypoint
//! is never bypassed, and the failure is counted and logged with the
//! service's name.
//!
//! The bindings come from the workloads file's waypoint syntax
//! (`istio.io/use-waypoint` labels and `waypoints:`, `control/local.rs`).

use std::{
    net::{Ipv4Addr, SocketAddr},
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::{
    api::{NodeStatus, PodState},
    state::{SpiffeId, TrustDomain},
};
use shunt_testbed::{
    Cgroup, Topology,
    access_log::wait_for_access_line,
    agent::{Agent, WorkloadSpec, http, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
    waypoint::{Received, StandInWaypoint, Upstream, web_behind_waypoint},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 1);
const WAYPOINT_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 9);

fn identity(sa: &str) -> SpiffeId {
    SpiffeId::for_service_account(&TrustDomain::default(), "default", sa)
}

/// Every pod that opts in is enrolled, except the waypoint, which must
/// not be.
fn enrolled_but_the_waypoint(status: &NodeStatus) -> bool {
    status
        .pods
        .iter()
        .filter(|p| p.dataplane_mode == "ambient")
        .all(|p| {
            if p.name == "waypoint" {
                p.state == PodState::NotInMesh
            } else {
                p.state == PodState::Enrolled
            }
        })
}

/// The workloads file: client and the waypoint on node-a; server (behind
/// service `web`, bound to the waypoint) and backend (bound to it itself)
/// on node-b; the waypoint's service and Gateway.
fn workloads_file(pods: &[&shunt_testbed::Pod]) -> String {
    let specs: Vec<WorkloadSpec> = pods
        .iter()
        .map(|p| WorkloadSpec::for_pod(p, true))
        .collect();
    let mut yaml = String::new();
    // Labels after each entry of workloads_yaml's output (its entries end
    // with their netns line).
    for line in workloads_yaml(&specs).lines() {
        yaml.push_str(line);
        yaml.push('\n');
        if line.trim_start().starts_with("netns:") {
            if line.contains("-waypoint") {
                yaml.push_str("    labels: {gateway.istio.io/managed: istio.io-mesh-controller, gateway.networking.k8s.io/gateway-name: waypoint}\n");
            } else if line.contains("-backend") {
                yaml.push_str("    labels: {istio.io/use-waypoint: waypoint}\n");
            }
        }
    }
    yaml.push_str(&web_behind_waypoint(WEB_VIP, WAYPOINT_VIP, "all"));
    yaml
}

/// Waits (bounded) until the stand-in has recorded `n` CONNECTs.
fn wait_received(waypoint: &StandInWaypoint, n: usize) -> Vec<Received> {
    let start = Instant::now();
    loop {
        let received = waypoint.received();
        if received.len() >= n {
            return received;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "the waypoint received {received:?}, expected {n} CONNECTs"
        );
        thread::sleep(Duration::from_millis(50));
    }
}

/// What the waypoint must see of a client's CONNECT: the original
/// destination as authority, ztunnel's headers, the client's identity.
fn assert_connect(
    received: &Received,
    authority: &str,
    client_ip: Ipv4Addr,
    service_host: Option<&str>,
) {
    assert_eq!(received.authority, authority, "{received:?}");
    assert_eq!(
        received.peer_identity.as_deref(),
        Some(identity("sa-client").as_str()),
        "the client's proxy presents the client's identity: {received:?}"
    );
    let baggage = received.header("baggage").unwrap_or_default();
    for part in [
        "k8s.cluster.name=Kubernetes",
        "k8s.namespace.name=default",
        "k8s.pod.name=client",
    ] {
        assert!(
            baggage.split(',').any(|p| p == part),
            "baggage {baggage:?} lacks {part}"
        );
    }
    // ztunnel's form: the client's address and port quoted, and the
    // service's hostname for a connection addressed to a service.
    let forwarded = received.header("forwarded").unwrap_or_default();
    let (client, host) = forwarded
        .strip_prefix(&format!("for=\"{client_ip}:"))
        .and_then(|rest| rest.split_once('"'))
        .unwrap_or_else(|| panic!("forwarded {forwarded:?} names no client {client_ip}:port"));
    assert!(client.parse::<u16>().is_ok(), "forwarded {forwarded:?}");
    assert_eq!(
        host,
        service_host.map_or(String::new(), |h| format!(";host={h}")),
        "{received:?}"
    );
    let traceparent = received.header("traceparent").unwrap_or_default();
    let parts: Vec<&str> = traceparent.split('-').collect();
    assert!(
        parts.len() == 4
            && parts[0] == "00"
            && parts[1].len() == 32
            && parts[2].len() == 16
            && parts[3] == "00"
            && traceparent
                .chars()
                .all(|c| c == '-' || c.is_ascii_hexdigit() && !c.is_ascii_uppercase()),
        "traceparent {traceparent:?}"
    );
    assert!(
        received.forwarded,
        "the waypoint reached the destination: {received:?}"
    );
}

fn waypoint_end_to_end(mode: &str) {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(&format!("wp-{mode}")).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let waypoint_pod = topo.add_pod("node-a", "waypoint").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let backend = topo.add_pod("node-b", "backend").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_file(&[&client, &waypoint_pod, &server, &backend]);
    let args = ["--redirect", mode, "--log-format", "json"];
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let mut agent_a = Agent::start(&topo, &node_a, &yaml, &args).expect("agent a");
    let mut agent_b = Agent::start(&topo, &node_b, &yaml, &args).expect("agent b");
    for agent in [&mut agent_a, &mut agent_b] {
        agent
            .wait_for(
                "mesh pods enrolled, the waypoint not",
                TIMEOUT,
                enrolled_but_the_waypoint,
            )
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.logs()));
    }
    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let backend_app = EchoServer::on(&backend, 8080).expect("echo");
    let waypoint_id = identity("sa-waypoint");
    let mut waypoint = StandInWaypoint::start(
        &waypoint_pod,
        agent_a.ca_dir(),
        waypoint_id.clone(),
        vec![
            Upstream {
                authority: SocketAddr::from((WEB_VIP, 80)),
                target: SocketAddr::from((server.ip(), 8080)),
                identity: identity("sa-server"),
            },
            Upstream {
                authority: SocketAddr::from((backend.ip(), 8080)),
                target: SocketAddr::from((backend.ip(), 8080)),
                identity: identity("sa-backend"),
            },
        ],
    )
    .expect("stand-in waypoint");

    // client → web's VIP → the waypoint (authority the VIP) → server.
    let to_vip = format!("{WEB_VIP}:80");
    let report = apps.run(&client, &["connect", &to_vip, "--send", "65536"]);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent_a.logs()
    );
    let received = wait_received(&waypoint, 1);
    assert_connect(
        &received[0],
        &to_vip,
        client.ip(),
        Some("web.default.svc.cluster.local"),
    );
    let peers = server_app.peers();
    assert_eq!(peers.len(), 1, "the server got the connection");
    assert_eq!(
        peers[0].ip(),
        waypoint_pod.ip(),
        "from the waypoint (its agent keeps the HBONE client's address)"
    );
    let to_server = format!("{}:8080", server.ip());
    wait_for_access_line(
        &agent_b,
        "inbound",
        "node-b's proxy saw the waypoint's identity as the peer",
        |l| {
            l["fields"]["src.identity"] == waypoint_id.as_str()
                && l["fields"]["dst.addr"] == to_server.as_str()
                && l["fields"]["result"] == "success"
        },
    );
    wait_for_access_line(
        &agent_a,
        "outbound",
        "node-a's access line names the service, the VIP and the waypoint",
        |l| {
            l["fields"]["dst.service"] == "web.default.svc.cluster.local"
                && l["fields"]["dst.addr"] == to_vip.as_str()
                && l["fields"]["dst.identity"] == waypoint_id.as_str()
                && l["fields"]["result"] == "success"
        },
    );

    // client → backend's pod IP (a workload waypoint) → the waypoint
    // (authority the pod address) → backend.
    let to_backend = format!("{}:8080", backend.ip());
    let report = apps.run(&client, &["connect", &to_backend, "--send", "65536"]);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent_a.logs()
    );
    let received = wait_received(&waypoint, 2);
    assert_connect(&received[1], &to_backend, client.ip(), None);
    let peers = backend_app.peers();
    assert_eq!(peers.len(), 1, "the backend got the connection");
    assert_eq!(peers[0].ip(), waypoint_pod.ip());
    wait_for_access_line(
        &agent_b,
        "inbound",
        "node-b's proxy saw the waypoint's identity towards the backend",
        |l| {
            l["fields"]["src.identity"] == waypoint_id.as_str()
                && l["fields"]["dst.addr"] == to_backend.as_str()
        },
    );

    // The waypoint down: the connection fails, nothing reaches the server,
    // and the failure names the service.
    waypoint.stop();
    let report = apps.run(
        &client,
        &["connect", &to_vip, "--send", "1024", "--timeout-ms", "5000"],
    );
    assert_ne!(report["intact"], Value::Bool(true), "{report}");
    wait_for_access_line(
        &agent_a,
        "outbound",
        "the failure names the service and its waypoint",
        |l| {
            l["fields"]["dst.service"] == "web.default.svc.cluster.local"
                && l["fields"]["result"] == "failed"
                && l["fields"]["reason"]
                    .as_str()
                    .is_some_and(|r| r.starts_with("waypoint of service default/web"))
        },
    );
    let (code, metrics) = http(
        &node_a,
        "GET",
        agent_a.endpoints().metrics.port(),
        "/metrics",
    )
    .expect("metrics");
    assert_eq!(code, 200);
    assert!(
        metrics.contains(
            "shunt_waypoint_failures_total{namespace=\"default\",name=\"web\",reason=\"unreachable\"} 1"
        ),
        "{metrics}"
    );
    assert_eq!(
        server_app.peers().len(),
        1,
        "no connection reached the server around the waypoint"
    );

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

#[test]
fn connections_to_waypoint_bound_destinations_go_through_the_waypoint_in_ebpf_mode() {
    waypoint_end_to_end("ebpf");
}

#[test]
fn connections_to_waypoint_bound_destinations_go_through_the_waypoint_in_iptables_mode() {
    waypoint_end_to_end("iptables");
}

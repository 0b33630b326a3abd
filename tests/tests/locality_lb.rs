//! Locality load balancing from istiod (issue 34, item 7), end to end:
//! node-a's agent takes the `web` service from the in-test istiod
//! (`userspace/tests/support/fake_istiod.rs`), node-b's serves its pods
//! from the workloads file. A client on node-a connects to the VIP:
//! - no load-balancing policy: it reaches the only endpoint, on node-b;
//! - `STRICT` + `[NODE]` (istiod's `internalTrafficPolicy: Local`) with
//!   that endpoint still the only one: refused, as ztunnel refuses ("no
//!   healthy upstream"); the endpoint sees no new connection;
//! - `FAILOVER` + `[NODE]` with an endpoint on node-a too: every
//!   connection goes to node-a's (the kernel fast path leaves such a VIP to
//!   the proxy, which knows the client).
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt-testbed --test locality_lb`.

#[path = "../../userspace/tests/support/fake_istiod.rs"]
mod fake_istiod;

use std::{
    net::Ipv4Addr,
    time::{Duration, Instant},
};

use fake_istiod::{
    FakeIstiod, Pki, agent_args, pod, response, service, web_backend, web_service, workload,
};
use serde_json::Value;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::istio::workload as workload_pb;
use shunt_testbed::{
    Cgroup, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp, ok},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 7);

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

fn web_with(
    mode: workload_pb::load_balancing::Mode,
    scopes: &[workload_pb::load_balancing::Scope],
) -> workload_pb::Service {
    let mut web = web_service(VIP.octets());
    web.load_balancing = Some(workload_pb::LoadBalancing {
        routing_preference: scopes.iter().map(|s| *s as i32).collect(),
        mode: mode as i32,
        ..Default::default()
    });
    web
}

async fn locality_decides_the_endpoint(redirect: &str) {
    use workload_pb::load_balancing::{Mode, Scope};
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(&format!("lb-{redirect}")).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let near = topo.add_pod("node-a", "near").expect("pod");
    let far = topo.add_pod("node-b", "far").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);

    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let xds_address = istiod.addr.to_string();
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&near, true),
        WorkloadSpec::for_pod(&far, true),
    ]);
    let common = ["--redirect", redirect];
    let xds = agent_args(&xds_address, &pki);
    let mut xds_args = common.to_vec();
    xds_args.extend(xds.iter().map(String::as_str));
    let mut agent_a = blocking(|| Agent::start(&topo, &node_a, &yaml, &xds_args)).expect("agent a");
    let mut agent_b = blocking(|| Agent::start(&topo, &node_b, &yaml, &common)).expect("agent b");

    istiod.initial_requests(1).await;
    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    let far_pb = web_backend(far.name(), far.ip().octets(), "node-b", "sa-far", true);
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(client_pb, "1"),
            workload(far_pb.clone(), "1"),
            service(web_service(VIP.octets()), "1"),
        ],
        &[],
    ));
    istiod.push(response(AUTHORIZATION_TYPE_URL, "p1", vec![], &[]));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);
    for agent in [&mut agent_a, &mut agent_b] {
        blocking(|| agent.wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled))
            .expect("enrolled");
    }
    let near_app = EchoServer::on(&near, 8080).expect("echo");
    let far_app = EchoServer::on(&far, 8080).expect("echo");
    let to_vip = format!("{VIP}:80");
    let connect = || blocking(|| apps.run(&client, &["connect", &to_vip, "--timeout-ms", "3000"]));
    // Polls (bounded) until `done` says the pushed view shows.
    let until = |what: &str, done: &dyn Fn(&Value) -> bool| {
        let deadline = Instant::now() + TIMEOUT;
        loop {
            let report = connect();
            if done(&report) {
                return;
            }
            assert!(
                Instant::now() < deadline,
                "{what}: {report}\n{}",
                agent_a.logs()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    };

    // No policy: the only endpoint, across nodes.
    until("the VIP reaches node-b's endpoint", &|r| ok(r));
    assert!(!far_app.peers().is_empty());

    // STRICT NODE, the only endpoint elsewhere: refused.
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a2",
        vec![service(web_with(Mode::Strict, &[Scope::Node]), "2")],
        &[],
    ));
    assert_eq!(istiod.answer_to("a2").await.error_detail, None);
    until("STRICT NODE refuses", &|r| !ok(r));
    let far_seen = far_app.peers().len();
    for i in 0..3 {
        let report = connect();
        assert!(
            !ok(&report),
            "connect {i} crossed nodes under STRICT NODE: {report}"
        );
    }
    assert_eq!(
        far_app.peers().len(),
        far_seen,
        "no new connection on node-b"
    );

    // FAILOVER NODE with an endpoint on node-a too: always node-a's.
    let near_pb = web_backend(near.name(), near.ip().octets(), "node-a", "sa-near", true);
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a3",
        vec![
            workload(near_pb, "1"),
            service(web_with(Mode::Failover, &[Scope::Node]), "3"),
        ],
        &[],
    ));
    assert_eq!(istiod.answer_to("a3").await.error_detail, None);
    until("FAILOVER NODE reaches node-a's endpoint", &|r| ok(r));
    let (near_seen, far_seen) = (near_app.peers().len(), far_app.peers().len());
    assert!(near_seen >= 1 && far_seen >= 1, "{near_seen} {far_seen}");
    for i in 0..4 {
        let report = connect();
        assert!(ok(&report), "connect {i} under FAILOVER NODE: {report}");
    }
    assert_eq!(
        (near_app.peers().len(), far_app.peers().len()),
        (near_seen + 4, far_seen),
        "every connection on the client's node"
    );

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = blocking(|| agent.stop()).expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_and_failover_by_node_in_ebpf_mode() {
    locality_decides_the_endpoint("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn strict_and_failover_by_node_in_iptables_mode() {
    locality_decides_the_endpoint("iptables").await;
}

//! The trust domain comes from istiod, as ztunnel takes it: each xDS
//! `Workload` carries its `trust_domain`, and ztunnel derives the workload's
//! identity (the certificate it asks for, the server SAN it expects, the
//! trust domain its clients must be of) from it. Here istiod says
//! `example.org` while the agents' own setting (the workloads file's
//! `trustDomain`) is cluster.local: the client's certificate, the server's,
//! and the identity checks on both sides are `spiffe://example.org/...`, so
//! the connection goes over HBONE with those identities.
//!
//! Run as root: `cargo build -p shunt --bins && SHUNT_BIN=… cargo test -p
//! shunt-testbed --test xds_trust_domain`.

#[path = "../../userspace/tests/support/fake_istiod.rs"]
mod fake_istiod;

use std::time::Duration;

use fake_istiod::{FakeIstiod, Pki, agent_args, pod, response, workload};
use serde_json::Value;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_testbed::{
    Cgroup, Topology,
    access_log::access_lines,
    agent::{Agent, WorkloadSpec, http, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    poll::eventually,
    require_root,
};
use tokio::task::block_in_place as blocking;

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT_ID: &str = "spiffe://example.org/ns/default/sa/sa-client";
const SERVER_ID: &str = "spiffe://example.org/ns/default/sa/sa-server";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn identities_take_the_trust_domain_istiod_gives_each_workload() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("xds-td").expect("topology");
    topo.add_node("node-a").expect("node");
    // Both pods on the node whose agent istiod feeds (the in-test istiod
    // admits node-a's agent only): the client's proxy still reaches the
    // server's over HBONE (podIP:15008 in the server's netns).
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);

    // istiod on node-a's loopback; the agent's own trust domain (the
    // workloads file's) is cluster.local.
    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let address = istiod.addr.to_string();
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
    ]);
    assert!(yaml.contains("trustDomain: cluster.local"), "{yaml}");
    let xds = agent_args(&address, &pki);
    let args: Vec<&str> = ["--redirect", "ebpf", "--log-format", "json"]
        .into_iter()
        .chain(xds.iter().map(String::as_str))
        .collect();
    let mut agent = blocking(|| Agent::start(&topo, &node_a, &yaml, &args)).expect("agent");

    // The workloads istiod sends, in trust domain example.org.
    istiod.initial_requests(1).await;
    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    client_pb.trust_domain = "example.org".into();
    let mut server_pb = pod("default", server.name(), server.ip().octets(), "node-a");
    server_pb.service_account = "sa-server".into();
    server_pb.trust_domain = "example.org".into();
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![workload(client_pb, "1"), workload(server_pb, "1")],
        &[],
    ));
    // (No policy: the cluster view is complete once both types came.)
    istiod.push(response(AUTHORIZATION_TYPE_URL, "p1", vec![], &[]));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);
    blocking(|| agent.wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled))
        .expect("enrolled");

    // Each pod's certificate is of istiod's trust domain.
    let admin = agent.endpoints().admin.port();
    for id in [CLIENT_ID, SERVER_ID] {
        eventually(
            &format!("{id}'s certificate available"),
            TIMEOUT,
            || {
                let (code, body) = http(&node_a, "GET", admin, "/config_dump").ok()?;
                let dump: Value = serde_json::from_str(&body).ok().filter(|_| code == 200)?;
                dump["certificates"]
                    .as_array()?
                    .iter()
                    .any(|c| c["identity"] == id && c["state"] == "Available")
                    .then_some(())
            },
            || agent.logs(),
        )
        .await;
    }

    // Over HBONE: the client's outbound expects the server's example.org
    // SAN, the server's inbound accepts an example.org client.
    let _server_app = EchoServer::on(&server, 8080).expect("echo");
    let to_server = format!("{}:8080", server.ip());
    let report = blocking(|| apps.run(&client, &["connect", &to_server, "--send", "4096"]));
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    eventually(
        "the inbound side took the client's example.org identity",
        TIMEOUT,
        || {
            access_lines(&agent.logs(), "inbound")
                .iter()
                .any(|l| {
                    l["fields"]["src.identity"] == CLIENT_ID
                        && l["fields"]["dst.identity"] == SERVER_ID
                        && l["fields"]["result"] == "success"
                })
                .then_some(())
        },
        || agent.logs(),
    )
    .await;
    eventually(
        "the outbound side named the server's example.org identity",
        TIMEOUT,
        || {
            access_lines(&agent.logs(), "outbound")
                .iter()
                .any(|l| {
                    l["fields"]["dst.identity"] == SERVER_ID && l["fields"]["result"] == "success"
                })
                .then_some(())
        },
        || agent.logs(),
    )
    .await;

    let exit = blocking(|| agent.stop()).expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

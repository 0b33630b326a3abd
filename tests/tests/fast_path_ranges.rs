//! The passthrough fast path beside a ServiceEntry's CIDR (eBPF mode): a
//! service addressed by a range (istiod's `Service.addresses` with a
//! `length` short of the address) no longer turns the fast path off for
//! the whole node. The kernel looks a connect's destination up in the
//! range table (`SHUNT_FP_RANGES`, longest prefix) after the address
//! table: a connect into the range goes to the proxy, which names the
//! service; one to any other address outside the mesh still goes direct;
//! once istiod removes the service, the range goes too.
//!
//! Run as root: `cargo build -p shunt --bins && SHUNT_BIN=… cargo test -p
//! shunt-testbed --test fast_path_ranges`.

#[path = "../../userspace/tests/support/fake_istiod.rs"]
mod fake_istiod;

use std::{
    net::{IpAddr, Ipv4Addr},
    time::Duration,
};

use fake_istiod::{FakeIstiod, Pki, agent_args, pod, response, service};
use serde_json::Value;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::istio::workload as workload_pb;
use shunt_testbed::{
    Cgroup, Node, Pod, Topology,
    access_log::wait_for_access_line,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp, local_of, via_the_proxy},
    require_root,
    scrape::{sample, wait_metrics},
};
use tokio::task::block_in_place as blocking;

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
/// The ServiceEntry's resource name (`namespace/hostname`).
const EGRESS: &str = "default/egress.example.com";

/// A ServiceEntry as istiod sends it for `addresses: [<net>/28]`,
/// resolution NONE: the range, its port, load balancing PASSTHROUGH (the
/// connection keeps the address dialled).
fn egress_service(net: Ipv4Addr) -> workload_pb::Service {
    workload_pb::Service {
        name: "egress.example.com".into(),
        namespace: "default".into(),
        hostname: "egress.example.com".into(),
        addresses: vec![workload_pb::NetworkAddress {
            network: String::new(),
            address: net.octets().to_vec(),
            length: Some(28),
        }],
        ports: vec![workload_pb::Port {
            service_port: 8080,
            target_port: 8080,
            ..Default::default()
        }],
        load_balancing: Some(workload_pb::LoadBalancing {
            mode: workload_pb::load_balancing::Mode::Passthrough as i32,
            ..Default::default()
        }),
        ..Default::default()
    }
}

/// One connect from `client` to `dst`:8080 with 4 KiB echoed; whether it
/// went through the proxy. Either way the bytes come back intact and the
/// server sees the client pod's address.
fn connect(apps: &TestApp<'_>, agent: &Agent, client: &Pod, dst: &Pod, echo: &EchoServer) -> bool {
    let to = format!("{}:8080", dst.ip());
    let report = apps.run(client, &["connect", &to, "--send", "4096"]);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{to}: {report}\n{}",
        agent.logs()
    );
    assert_eq!(
        echo.peers().last().map(|p| p.ip()),
        Some(IpAddr::V4(client.ip())),
        "{to}: the server saw the client pod"
    );
    let proxied = via_the_proxy(&report);
    if !proxied {
        assert_eq!(
            echo.peers().last(),
            Some(&local_of(&report)),
            "{to}: direct, from the app's own socket"
        );
    }
    proxied
}

fn ranges_in_table(node: &Node, agent: &Agent, ranges: f64) {
    wait_metrics(
        node,
        agent,
        &format!("{ranges} range(s) in the fast-path table"),
        |m| {
            sample(m, "shunt_fast_path_table_valid", &[]) == Some(1.0)
                && sample(m, "shunt_fast_path_ranges", &[]) == Some(ranges)
        },
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cidr_service_entry_keeps_its_range_on_the_proxy_and_the_rest_direct() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("fp-ranges").expect("topology");
    topo.add_node("node-a").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let [a, b, c, _] = client.ip().octets();
    // 198.18.x.100 is in the ServiceEntry's 198.18.x.96/28; .200 is not.
    let inside = topo
        .add_pod_with_ip("node-a", "inside", Ipv4Addr::new(a, b, c, 100))
        .expect("pod");
    let outside = topo
        .add_pod_with_ip("node-a", "outside", Ipv4Addr::new(a, b, c, 200))
        .expect("pod");
    let node = client.node().clone();
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);

    let pki = Pki::new();
    let listener = node
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let xds_address = istiod.addr.to_string();
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(&client, true)]);
    let xds = agent_args(&xds_address, &pki);
    let args: Vec<&str> = [
        "--redirect",
        "ebpf",
        "--fast-path",
        "on",
        "--log-format",
        "json",
    ]
    .into_iter()
    .chain(xds.iter().map(String::as_str))
    .collect();
    let mut agent = blocking(|| Agent::start(&topo, &node, &yaml, &args)).expect("agent");
    istiod.initial_requests(1).await;
    let client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            fake_istiod::workload(client_pb, "1"),
            service(egress_service(Ipv4Addr::new(a, b, c, 96)), "1"),
        ],
        &[],
    ));
    // The first view is applied once istiod sent both types.
    istiod.push(response(AUTHORIZATION_TYPE_URL, "p1", vec![], &[]));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);
    blocking(|| agent.wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled))
        .expect("enrolled");
    // On with the range in it, where it used to be off for the whole node.
    blocking(|| ranges_in_table(&node, &agent, 1.0));

    let echo_inside = EchoServer::on(&inside, 8080).expect("echo");
    let echo_outside = EchoServer::on(&outside, 8080).expect("echo");
    assert!(
        blocking(|| connect(&apps, &agent, &client, &inside, &echo_inside)),
        "a connect into the CIDR goes through the proxy"
    );
    let to_inside = format!("{}:8080", inside.ip());
    blocking(|| {
        wait_for_access_line(
            &agent,
            "passthrough",
            "the proxy's line names the ServiceEntry",
            |l| {
                l["fields"]["dst.service"] == "egress.example.com"
                    && l["fields"]["dst.addr"] == to_inside.as_str()
            },
        )
    });
    assert!(
        !blocking(|| connect(&apps, &agent, &client, &outside, &echo_outside)),
        "a connect outside it goes direct"
    );

    // istiod removes the ServiceEntry: its range leaves the table, and the
    // address inside goes direct as well.
    istiod.push(response(ADDRESS_TYPE_URL, "rm1", vec![], &[EGRESS]));
    assert_eq!(istiod.answer_to("rm1").await.error_detail, None);
    blocking(|| ranges_in_table(&node, &agent, 0.0));
    assert!(
        !blocking(|| connect(&apps, &agent, &client, &inside, &echo_inside)),
        "without the ServiceEntry, direct"
    );

    let exit = blocking(|| agent.stop()).expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

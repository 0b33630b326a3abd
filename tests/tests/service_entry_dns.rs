//! A `resolution: DNS` ServiceEntry, as istiod sends it to ztunnel: a
//! service with a VIP (Istio's auto-allocated address, here in the test
//! range) whose endpoint is a workload with a `hostname` and no address
//! (`shunt_testbed::reference::resources::named_endpoint`, as the
//! reference table sends it to the real ztunnel).
//! The agent resolves the name with its own resolver (`--dns-resolv-conf`
//! naming an in-test DNS server in another pod) when a connection to the
//! VIP picks it, as ztunnel does:
//! - the client's connection to the VIP reaches the host the name
//!   resolves to, at the endpoint's target port, as plain TCP (the host is
//!   not in the mesh); the DNS server was asked for the name;
//! - `istio_on_demand_dns_total` counts it with ztunnel's labels (the
//!   source workload, the hostname);
//! - a name that does not resolve refuses the connection, and the access
//!   line says why.
//!
//! Run as root: `SHUNT_BIN=… cargo test -p shunt-testbed --test
//! service_entry_dns` (or `cargo xtask test service_entry_dns`).

#[path = "../../userspace/tests/support/fake_istiod.rs"]
mod fake_istiod;

use std::{
    collections::BTreeMap,
    net::{Ipv4Addr, SocketAddr},
    time::Duration,
};

use fake_istiod::{FakeIstiod, Pki, agent_args, pod, response, workload};
use serde_json::Value;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_testbed::{
    Cgroup, Topology,
    access_log::access_lines,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    dns::DnsResponder,
    poll::eventually,
    reference::resources::{encode, named_endpoint, service},
    require_root,
    scrape::{metrics, sample},
};
use tokio::task::block_in_place as blocking;

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
/// The ServiceEntry's address (Istio would allocate one from 240.240/16);
/// no interface, route or pod holds it.
const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 120, 1);
const HOST: &str = "api.example.test";
/// What the endpoint is named by, and what the DNS server answers for it.
const ENDPOINT_NAME: &str = "backend.example.test";
/// A second ServiceEntry whose endpoint's name has no address.
const GONE_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 120, 2);
const GONE_HOST: &str = "gone.example.test";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_entry_endpoint_known_by_name_is_resolved_and_reached() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("se-dns").expect("topology");
    topo.add_node("node-a").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let resolver = topo.add_pod("node-a", "resolver").expect("pod");
    let backend = topo.add_pod("node-a", "backend").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);

    // The agent's resolver: a DNS server in its own pod that knows the
    // endpoint's name.
    let zone = BTreeMap::from([(ENDPOINT_NAME.to_owned(), vec![backend.ip().into()])]);
    let dns = DnsResponder::start(
        &resolver,
        SocketAddr::new(resolver.ip().into(), 53),
        zone,
        false,
    )
    .expect("DNS server");
    let resolv_conf = tempfile::NamedTempFile::new().expect("resolv.conf");
    std::fs::write(
        resolv_conf.path(),
        format!("nameserver {}\n", resolver.ip()),
    )
    .expect("write resolv.conf");
    let backend_app = EchoServer::on(&backend, 8080).expect("echo");

    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(&client, true)]);
    let resolv_conf_path = resolv_conf.path().display().to_string();
    let xds = agent_args(&istiod.addr.to_string(), &pki);
    let mut args = vec![
        "--redirect",
        "ebpf",
        "--log-format",
        "json",
        "--dns-resolv-conf",
        &resolv_conf_path,
    ];
    args.extend(xds.iter().map(String::as_str));
    let mut agent = blocking(|| Agent::start(&topo, &node_a, &yaml, &args)).expect("agent");

    istiod.initial_requests(1).await;
    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(client_pb, "1"),
            encode(named_endpoint(HOST, ENDPOINT_NAME)),
            encode(service("api", HOST, VIP.octets())),
            encode(named_endpoint(GONE_HOST, "nowhere.example.test")),
            encode(service("gone", GONE_HOST, GONE_VIP.octets())),
        ],
        &[],
    ));
    istiod.push(response(AUTHORIZATION_TYPE_URL, "p1", vec![], &[]));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);
    blocking(|| agent.wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled))
        .expect("enrolled");
    eventually(
        "the agent ready once istiod sent both types",
        TIMEOUT,
        || (agent.readiness().ok()?.0 == 200).then_some(()),
        || agent.logs(),
    )
    .await;

    let to_vip = format!("{VIP}:80");
    for i in 0..2 {
        let report = blocking(|| apps.run(&client, &["connect", &to_vip, "--send", "4096"]));
        assert_eq!(
            report["intact"],
            Value::Bool(true),
            "connect {i} to the ServiceEntry's VIP: {report}\n{}",
            agent.logs()
        );
    }
    assert_eq!(
        backend_app.peers().len(),
        2,
        "both connections reached the host the name resolves to"
    );
    assert!(
        !dns.seen_for(ENDPOINT_NAME).is_empty(),
        "the agent asked its resolver: {:?}",
        dns.seen()
    );

    let text = blocking(|| metrics(&node_a, &agent));
    let counted = sample(
        &text,
        "istio_on_demand_dns_total",
        &[
            ("hostname", ENDPOINT_NAME),
            ("source_workload_namespace", "default"),
            (
                "source_principal",
                "spiffe://cluster.local/ns/default/sa/sa-client",
            ),
        ],
    );
    assert_eq!(counted, Some(2.0), "one per connection:\n{text}");

    // A name with no address: the connection is refused, and said why.
    let report = blocking(|| {
        apps.run(
            &client,
            &["connect", &format!("{GONE_VIP}:80"), "--timeout-ms", "5000"],
        )
    });
    assert_ne!(report["intact"], Value::Bool(true), "{report}");
    eventually(
        "the refused connection's access line names the name",
        TIMEOUT,
        || {
            access_lines(&agent.logs(), "outbound")
                .iter()
                .any(|l| {
                    l["fields"]["reason"]
                        .as_str()
                        .is_some_and(|r| r.contains("nowhere.example.test"))
                })
                .then_some(())
        },
        || agent.logs(),
    )
    .await;
    assert_eq!(
        backend_app.peers().len(),
        2,
        "nothing else reached the host"
    );

    let exit = blocking(|| agent.stop()).expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

//! istiod's xDS feed end to end in the eBPF mode: the agent of node-a
//! takes its cluster view (workloads, services, policies) from an in-test
//! istiod (tonic delta ADS over TLS; token, node id and metadata checked;
//! `userspace/tests/support/fake_istiod.rs`, shared by path) listening in
//! node-a's netns; the workloads file only enrols the pods and names no
//! service. The client runs in the pods' cgroup (connect4 sees it):
//! - a connect to a Service VIP that exists only in xDS lands on the healthy
//!   endpoint on node-b over HBONE (node-b's proxy logs the client's SPIFFE
//!   identity, mutual TLS), never on the unhealthy workload;
//! - `/config_dump` shows all of it in ztunnel's shape (what `istioctl
//!   ztunnel-config` reads), with where each object came from;
//! - a delta push removing the endpoint stops new connections to it.
//!
//! Run as root: `cargo build -p shunt --bins && SHUNT_BIN=… cargo test -p
//! shunt-testbed --test xds` (or `cargo xtask test xds`).

#[path = "../../userspace/tests/support/fake_istiod.rs"]
mod fake_istiod;

use std::{net::Ipv4Addr, time::Duration};

use fake_istiod::{
    FakeIstiod, Pki, WEB, agent_args, pod, policy, principal_policy, response, service,
    web_backend, web_service, workload,
};
use serde_json::Value;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::istio::security as security_pb;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    access_log::access_lines,
    agent::{Agent, WorkloadSpec, http, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    poll::eventually,
    require_root,
    scrape::{metrics, sample},
};
use tokio::task::block_in_place as blocking;

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
/// In the test range; no interface, route or pod holds it.
const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 1);
const CLIENT_ID: &str = "spiffe://cluster.local/ns/default/sa/sa-client";

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_service_known_only_from_istiod_reaches_its_endpoint_over_hbone_in_ebpf_mode() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("xds-ebpf").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let sick = topo.add_pod("node-b", "sick").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);

    // istiod, on node-a's loopback.
    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let xds_address = istiod.addr.to_string();

    // The file enrols the pods; it names no service.
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&sick, true),
    ]);
    let common = ["--redirect", "ebpf", "--log-format", "json"];
    let xds = agent_args(&xds_address, &pki);
    let mut xds_args = common.to_vec();
    xds_args.extend(xds.iter().map(String::as_str));
    let mut agent_a = blocking(|| Agent::start(&topo, &node_a, &yaml, &xds_args)).expect("agent a");
    let mut agent_b = blocking(|| Agent::start(&topo, &node_b, &yaml, &common)).expect("agent b");

    istiod.initial_requests(1).await;
    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(client_pb, "1"),
            workload(
                web_backend(
                    server.name(),
                    server.ip().octets(),
                    server.node().name(),
                    &format!("sa-{}", server.name()),
                    true,
                ),
                "1",
            ),
            workload(
                web_backend(
                    sick.name(),
                    sick.ip().octets(),
                    sick.node().name(),
                    &format!("sa-{}", sick.name()),
                    false,
                ),
                "1",
            ),
            service(web_service(VIP.octets()), "4"),
        ],
        &[],
    ));
    istiod.push(response(
        AUTHORIZATION_TYPE_URL,
        "p1",
        vec![policy(
            principal_policy(
                "deny-nobody",
                security_pb::Scope::Namespace,
                security_pb::Action::Deny,
                "cluster.local/ns/default/sa/nobody",
                &[9],
            ),
            "2",
        )],
        &[],
    ));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);
    for agent in [&mut agent_a, &mut agent_b] {
        blocking(|| agent.wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled))
            .expect("enrolled");
    }
    eventually(
        "agent a ready once istiod sent both types",
        TIMEOUT,
        || {
            let (code, body) = agent_a.readiness().ok()?;
            (code == 200).then_some(body)
        },
        || agent_a.logs(),
    )
    .await;

    // What Istio's ztunnel dashboard charts, under ztunnel's names: the
    // node proxy's version, its pod proxies, the xDS stream's messages.
    let text = blocking(|| metrics(&node_a, &agent_a));
    for (name, labels, value) in [
        ("istio_build", vec![("component", "ztunnel")], Some(1.0)),
        ("workload_manager_active_proxy_count", vec![], Some(1.0)),
        ("workload_manager_proxies_started_total", vec![], Some(1.0)),
        ("workload_manager_pending_proxy_count", vec![], Some(0.0)),
        (
            "istio_xds_message_total",
            vec![("url", ADDRESS_TYPE_URL)],
            Some(1.0),
        ),
    ] {
        assert_eq!(sample(&text, name, &labels), value, "{name}:\n{text}");
    }

    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let sick_app = EchoServer::on(&sick, 8080).expect("echo");
    let to_vip = format!("{VIP}:80");
    for i in 0..4 {
        let report = blocking(|| apps.run(&client, &["connect", &to_vip, "--send", "65536"]));
        assert_eq!(
            report["intact"],
            Value::Bool(true),
            "connect {i} through the VIP: {report}\n{}",
            agent_a.logs()
        );
    }
    assert_eq!(
        server_app.peers().len(),
        4,
        "every connection on the healthy endpoint"
    );
    assert!(
        sick_app.peers().is_empty(),
        "the unhealthy workload gets no connection"
    );
    // Over HBONE: node-b's proxy took mutual-TLS streams from the client's
    // identity to the endpoint; node-a's outbound line names the service.
    let to_server = format!("{}:8080", server.ip());
    eventually(
        "node-b's proxy saw the client's HBONE streams",
        TIMEOUT,
        || {
            let lines = access_lines(&agent_b.logs(), "inbound");
            let hbone = lines.iter().filter(|l| {
                l["fields"]["src.identity"] == CLIENT_ID
                    && l["fields"]["dst.addr"] == to_server.as_str()
                    && l["fields"]["result"] == "success"
            });
            (hbone.count() == 4).then_some(())
        },
        || agent_b.logs(),
    )
    .await;
    eventually(
        "node-a's access log names the xDS service",
        TIMEOUT,
        || {
            access_lines(&agent_a.logs(), "outbound")
                .iter()
                .any(|l| {
                    l["fields"]["dst.service"] == "web.default.svc.cluster.local"
                        && l["fields"]["dst.addr"] == to_server.as_str()
                })
                .then_some(())
        },
        || agent_a.logs(),
    )
    .await;

    // /config_dump in ztunnel's shape.
    let admin = agent_a.endpoints().admin.port();
    let dump: Value = eventually(
        "the client's certificate in /config_dump",
        TIMEOUT,
        || {
            let (code, body) = http(&node_a, "GET", admin, "/config_dump").ok()?;
            let dump: Value = serde_json::from_str(&body).ok().filter(|_| code == 200)?;
            let available = dump["certificates"]
                .as_array()?
                .iter()
                .any(|c| c["identity"] == CLIENT_ID && c["state"] == "Available");
            available.then_some(dump)
        },
        || agent_a.logs(),
    )
    .await;
    assert_config_dump(&dump, &client, &server, &sick);

    // A delta push removes the endpoint: new connections no longer reach it.
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "rm1",
        vec![],
        &[&format!("Kubernetes//Pod/default/{}", server.name())],
    ));
    assert_eq!(istiod.answer_to("rm1").await.error_detail, None);
    eventually(
        "the VIP refuses once its endpoint is removed",
        TIMEOUT,
        || {
            let report = apps.run(&client, &["connect", &to_vip, "--timeout-ms", "3000"]);
            (report["intact"] != Value::Bool(true)).then_some(())
        },
        || agent_a.logs(),
    )
    .await;
    assert_eq!(
        server_app.peers().len(),
        4,
        "no new connection reached the removed endpoint"
    );
    assert!(sick_app.peers().is_empty(), "nor the unhealthy workload");
    let (_, body) = blocking(|| http(&node_a, "GET", admin, "/config_dump")).expect("dump");
    let dump: Value = serde_json::from_str(&body).expect("JSON");
    let web = &dump["services"][0];
    let left: Vec<&Value> = web["endpoints"]
        .as_object()
        .map(|e| e.values().collect())
        .unwrap_or_default();
    assert_eq!(left.len(), 1, "only the unhealthy endpoint is left: {web}");
    assert_eq!(left[0]["status"], "Unhealthy", "{web}");

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = blocking(|| agent.stop()).expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

/// What istioctl reads from the dump, for what istiod sent.
fn assert_config_dump(dump: &Value, client: &Pod, server: &Pod, sick: &Pod) {
    let workload = |name: &str| {
        dump["workloads"]
            .as_array()
            .and_then(|w| w.iter().find(|w| w["name"] == name))
            .unwrap_or_else(|| panic!("workload {name} in {dump}"))
    };
    let server_dump = workload("server");
    let server_uid = "Kubernetes//Pod/default/server";
    assert_eq!(server_dump["uid"], server_uid, "{server_dump}");
    assert_eq!(server_dump["workloadIps"][0], server.ip().to_string());
    assert_eq!(server_dump["protocol"], "HBONE");
    assert_eq!(server_dump["namespace"], "default");
    assert_eq!(server_dump["serviceAccount"], "sa-server");
    assert_eq!(server_dump["node"], "node-b");
    assert_eq!(server_dump["clusterId"], "Kubernetes");
    assert_eq!(server_dump["status"], "Healthy");
    assert_eq!(
        server_dump["services"],
        serde_json::json!([WEB]),
        "{server_dump}"
    );
    assert_eq!(
        server_dump["shunt"]["servicePorts"][WEB]["80"], 0,
        "{server_dump}"
    );
    assert_eq!(server_dump["networkMode"], "Standard");
    assert_eq!(server_dump["shunt"]["source"], "istiod");
    assert_eq!(server_dump["shunt"]["version"], "1");
    assert_eq!(workload("sick")["status"], "Unhealthy");
    assert_eq!(workload("client")["shunt"]["state"]["state"], "enrolled");

    let services = dump["services"].as_array().expect("services");
    assert_eq!(services.len(), 1, "{dump}");
    let web = &services[0];
    assert_eq!(web["name"], "web");
    assert_eq!(web["namespace"], "default");
    assert_eq!(web["hostname"], "web.default.svc.cluster.local");
    assert_eq!(web["vips"], serde_json::json!([format!("/{VIP}")]));
    assert_eq!(web["ports"], serde_json::json!({"80": 8080}));
    assert_eq!(web["ipFamilies"], "IPv4");
    assert_eq!(
        web["shunt"],
        serde_json::json!({"source": "istiod", "version": "4"})
    );
    let endpoints = web["endpoints"].as_object().expect("endpoints");
    let key = format!("{server_uid}:/{}", server.ip());
    let sick_key = format!("Kubernetes//Pod/default/{}:/{}", sick.name(), sick.ip());
    let mut keys: Vec<&String> = endpoints.keys().collect();
    keys.sort();
    let mut expected = [&key, &sick_key];
    expected.sort();
    assert_eq!(
        keys, expected,
        "both endpoints, the unhealthy one too (as ztunnel lists it): {web}"
    );
    let endpoint = &endpoints[&key];
    assert_eq!(endpoint["workloadUid"], server_uid);
    assert_eq!(endpoint["service"], WEB);
    assert_eq!(endpoint["address"], format!("/{}", server.ip()));
    assert_eq!(endpoint["port"], serde_json::json!({"80": 8080}));
    assert_eq!(endpoint["status"], "Healthy", "{web}");
    assert_eq!(endpoints[&sick_key]["status"], "Unhealthy", "{web}");

    let policies = dump["policies"].as_array().expect("policies");
    assert_eq!(policies.len(), 1, "{dump}");
    let deny = &policies[0];
    assert_eq!(deny["name"], "deny-nobody");
    assert_eq!(deny["namespace"], "default");
    assert_eq!(deny["scope"], "Namespace");
    assert_eq!(deny["action"], "Deny");
    assert_eq!(
        deny["rules"],
        serde_json::json!([[[{
            "principals": [{"Exact": "cluster.local/ns/default/sa/nobody"}],
            "destinationPorts": [9],
        }]]]),
        "{deny}"
    );
    assert_eq!(deny["shunt"]["version"], "2");

    let certificate = dump["certificates"]
        .as_array()
        .and_then(|c| c.iter().find(|c| c["identity"] == CLIENT_ID))
        .expect("the client's certificate");
    assert_eq!(certificate["state"], "Available");
    let chain = certificate["certChain"].as_array().expect("certChain");
    assert!(chain.len() >= 2, "leaf and root: {certificate}");
    for cert in chain {
        let serial = cert["serialNumber"].as_str().expect("serialNumber");
        assert!(
            !serial.is_empty() && serial.bytes().all(|b| b.is_ascii_digit()),
            "decimal serial: {cert}"
        );
        let (from, to) = (
            cert["validFrom"].as_str().expect("validFrom"),
            cert["expirationTime"].as_str().expect("expirationTime"),
        );
        for date in [from, to] {
            assert!(
                date.len() == 20 && date.ends_with('Z') && date.as_bytes()[10] == b'T',
                "RFC 3339: {date}"
            );
        }
        assert!(from < to, "{cert}");
    }

    let client_uid = workload("client")["uid"].as_str().expect("uid").to_owned();
    let state = &dump["workloadState"][&client_uid];
    assert_eq!(state["state"], "Up", "{dump}");
    assert_eq!(state["info"]["name"], client.name());
    assert_eq!(state["info"]["serviceAccount"], "sa-client");
    assert_eq!(state["info"]["trustDomain"], "cluster.local");

    // shunt's own: the sources, and istiod's connection.
    let shunt = &dump["shunt"];
    assert_eq!(
        shunt["sources"],
        serde_json::json!({"pods": "workloads-file", "cluster": "istiod"})
    );
    assert_eq!(shunt["xds"]["connected"], true, "{shunt}");
    assert!(shunt["xds"]["connected_since"].is_i64(), "{shunt}");
}

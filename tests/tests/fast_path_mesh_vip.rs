//! Flow 2 of the fast path through a Service VIP (issue 18): a client
//! pod's connect to the clusterIP of a service whose every ready endpoint
//! is a mesh pod of the same node is sent by connect4 straight to an
//! endpoint and carried in the kernel — the proxy copies nothing, the
//! server sees the client's own address, the application's `getpeername`
//! still answers the VIP it dialled, and both ends report it with the bytes
//! moved, the source's report naming the service. A policy that denies the
//! endpoint refuses the connect at connect(); a service with an endpoint on
//! another node keeps the proxy (HBONE).

use std::{
    net::{IpAddr, Ipv4Addr, SocketAddr},
    time::Duration,
};

use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{ServiceSpec, WorkloadSpec, services_yaml, start_enrolled, workloads_yaml},
    apps::{EchoServer, HalfEcho, TestApp},
    fast_path::{
        assert_direct, assert_istio_tcp_counted, carried_by_the_proxy, fast_access_line, has_field,
        policies_compiled, principal, proxy_work, vips_written,
    },
    require_root,
    scrape::{sample, wait_metrics},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const FAST: [&str; 4] = ["--redirect", "ebpf", "--fast-path", "on"];
/// connect() failing with EPERM: the kernel refused it.
const EPERM: i64 = 1;
/// VIPs in the test range that no node, pod or route holds.
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 1);
const SPREAD_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 2);

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

/// The workloads file: the pods (the server labelled `app: server`), the
/// services, and `policies` (YAML list items).
fn workloads_file(pods: &[&Pod], server: &Pod, policies: &str) -> String {
    let specs: Vec<WorkloadSpec> = pods
        .iter()
        .map(|p| WorkloadSpec::for_pod(p, true))
        .collect();
    let mut yaml = workloads_yaml(&specs);
    let server_entry = format!("  - name: {}\n", server.name());
    let at = yaml.find(&server_entry).expect("server entry");
    yaml.insert_str(at + server_entry.len(), "    labels: {app: server}\n");
    yaml += &services_yaml(&[
        service("web", WEB_VIP, &["server"]),
        // One endpoint on another node: the proxy balances it.
        service("spread", SPREAD_VIP, &["server", "remote"]),
    ]);
    if !policies.is_empty() {
        yaml.push_str("authorizationPolicies:\n");
        yaml.push_str(policies);
    }
    yaml
}

const DENY_CLIENT: &str = "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: deny-client, namespace: default}
    spec:
      selector: {matchLabels: {app: server}}
      action: DENY
      rules: [{from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]}]
";

#[test]
fn a_service_vip_with_same_node_endpoints_is_carried_in_the_kernel() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("fpvip").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let remote = topo.add_pod("node-b", "remote").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let pods = [&client, &server, &remote];
    let yaml = workloads_file(&pods, &server, "");
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let [mut agent_a, mut agent_b] =
        start_enrolled(&topo, [&node_a, &node_b], &yaml, &FAST, TIMEOUT).expect("agents enrolled");
    // Only "web": "spread" has an endpoint on node b.
    vips_written(&node_a, &agent_a, 1);
    let half = HalfEcho::on(&server, 8080);
    let _remote_echo = EchoServer::on(&remote, 8080).expect("echo");

    // The VIP: carried in the kernel to the same-node endpoint.
    const BYTES: usize = 1_048_576;
    let before = proxy_work(&agent_a);
    let to = format!("{WEB_VIP}:80");
    let report = apps.run(&client, &["connect", &to, "--send", &BYTES.to_string()]);
    let local = assert_direct(&report, IpAddr::V4(client.ip()), BYTES, &agent_a);
    assert_eq!(
        report["peer"].as_str(),
        Some(to.as_str()),
        "getpeername answers the VIP the application dialled: {report}"
    );
    assert!(
        half.peers().contains(&local),
        "the endpoint saw the client's own address and port {local}: {:?}",
        half.peers()
    );
    let client_id = principal(&client, "default");
    let server_id = principal(&server, "default");
    let endpoint = SocketAddr::from((server.ip(), 8080));
    for (reporter, service) in [("source", "web"), ("destination", "unknown")] {
        let labels = [
            ("reporter", reporter),
            ("source_workload", "client"),
            ("source_principal", client_id.as_str()),
            ("destination_workload", "server"),
            ("destination_principal", server_id.as_str()),
            ("destination_service_name", service),
            ("connection_security_policy", "none"),
        ];
        assert_istio_tcp_counted(
            &node_a,
            &agent_a,
            &labels,
            BYTES,
            BYTES / 2,
            &format!("the VIP connection ({reporter})"),
        );
    }
    assert_eq!(proxy_work(&agent_a), before, "the proxy carried nothing");
    // `/status` counts it for each pod: out of the client, into the server.
    let status = agent_a.status().expect("status");
    let counted = |name: &str| {
        status
            .pods
            .iter()
            .find(|p| p.name == name)
            .and_then(|p| p.fast_path)
            .unwrap_or_default()
    };
    assert_eq!(counted("client").mesh_outbound, 1, "{status:?}");
    assert_eq!(counted("client").mesh_inbound, 0, "{status:?}");
    assert_eq!(counted("server").mesh_inbound, 1, "{status:?}");
    let line = fast_access_line(&agent_a, "outbound", &[&local.to_string()]);
    assert!(
        has_field(&line, "dst.service", "web.default.svc.cluster.local"),
        "{line}"
    );
    assert!(line.contains(&endpoint.to_string()), "{line}");

    // A service with an endpoint on another node: the proxy, HBONE.
    carried_by_the_proxy(&apps, &agent_a, &client, &format!("{SPREAD_VIP}:80"));

    // A policy that denies the client at the endpoint: refused at connect
    // through the VIP, counted; not a byte reaches the server.
    agent_a
        .write_workloads(&workloads_file(&pods, &server, DENY_CLIENT))
        .expect("write the file");
    policies_compiled(&agent_a, &["default/deny-client"]);
    vips_written(&node_a, &agent_a, 1);
    let seen = half.peers().len();
    let report = apps.run(&client, &["connect", &to, "--send", "4096"]);
    assert_eq!(report["errno"].as_i64(), Some(EPERM), "{report}");
    assert_eq!(half.peers().len(), seen, "not a byte reached the server");
    wait_metrics(&node_a, &agent_a, "the kernel's denial counted", |m| {
        sample(
            m,
            "shunt_pod_policy_denials_total",
            &[("pod", "client"), ("policy", "default/deny-client")],
        )
        .is_some_and(|n| n >= 1.0)
    });

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

//! The passthrough fast path (`--fast-path on`, eBPF mode): an enrolled
//! pod's connect to a destination outside the mesh goes direct — the proxy
//! never sees it, the destination sees the pod's own address and port — and
//! is still reported as the proxy would have (Istio's TCP metrics with the
//! bytes the applications moved, an access log line). Mesh destinations
//! keep HBONE; the flag, the per-pod opt-out and a table that cannot be
//! complete keep flows on the proxy.

use std::{
    net::SocketAddr,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt_testbed::{
    Cgroup, Node, Pod, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, start_enrolled, workloads_yaml},
    apps::{EchoServer, HalfEcho, TestApp, local_of, via_the_proxy},
    fast_path::{assert_istio_tcp_counted, principal},
    require_root,
    scrape::{metrics, sample, wait_metrics},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const FAST: [&str; 4] = ["--redirect", "ebpf", "--fast-path", "on"];

fn proxy_passthrough(agent: &Agent) -> u64 {
    agent
        .status()
        .expect("status")
        .proxy
        .map_or(0, |p| p.outbound_passthrough)
}

/// Polls the proxy's counters until `pick` reaches `at_least` (the proxy
/// counts a connection when it finished copying, just after the app).
fn wait_proxy(
    agent: &Agent,
    what: &str,
    at_least: u64,
    pick: impl Fn(&shunt::proxy::ProxyStats) -> u64,
) {
    let start = Instant::now();
    loop {
        let now = agent
            .status()
            .expect("status")
            .proxy
            .map_or(0, |p| pick(&p));
        if now >= at_least {
            return;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "timed out waiting for {what} ({now} < {at_least}); agent log:\n{}",
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The labels of the proxy's passthrough report from `client` to `dst`
/// (a workload the mesh knows, whose identity is `dst_principal`). As
/// ztunnel's: no source principal without a TLS handshake, the
/// destination workload's identity whatever the connection's security.
fn passthrough_labels<'a>(
    client: &'a str,
    dst: &'a str,
    dst_principal: &'a str,
) -> [(&'a str, &'a str); 6] {
    [
        ("reporter", "source"),
        ("source_workload", client),
        ("source_principal", "unknown"),
        ("destination_workload", dst),
        ("destination_principal", dst_principal),
        ("connection_security_policy", "unknown"),
    ]
}

/// Sends `bytes` from `client` to `dst`'s server, which answers with
/// `answer` bytes (the echo: `bytes`; [`HalfEcho`]: half), and checks the
/// fast path carried it: the answer arrived intact, the server saw the
/// client's own address and port, the proxy saw nothing, and the node's
/// Istio metrics count exactly this connection with the bytes moved each
/// way.
#[allow(clippy::too_many_arguments)]
fn carried_directly(
    apps: &TestApp<'_>,
    agent: &Agent,
    node: &Node,
    client: &Pod,
    dst: &Pod,
    peers: &dyn Fn() -> Vec<SocketAddr>,
    bytes: usize,
    answer: usize,
) {
    let proxied_before = proxy_passthrough(agent);
    let to = format!("{}:8080", dst.ip());
    let report = apps.run(client, &["connect", &to, "--send", &bytes.to_string()]);
    assert_eq!(
        report["ok"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    assert_eq!(report["received"].as_u64(), Some(answer as u64), "{report}");
    if answer == bytes {
        assert_eq!(report["intact"], Value::Bool(true), "{report}");
    }
    assert!(!via_the_proxy(&report), "not via the proxy: {report}");
    let local = local_of(&report);
    assert_eq!(
        local.ip(),
        client.ip(),
        "the app's socket is the pod's own: {report}"
    );
    assert!(
        peers().contains(&local),
        "the destination saw the client's own address and port {local}: {:?}",
        peers()
    );
    let dst_id = principal(dst, "default");
    let labels = passthrough_labels(client.name(), dst.name(), &dst_id);
    assert_istio_tcp_counted(
        node,
        agent,
        &labels,
        bytes,
        answer,
        "the fast-path connection",
    );
    assert_eq!(
        proxy_passthrough(agent),
        proxied_before,
        "the proxy carried no passthrough connection"
    );
    let logs = agent.logs();
    let line = logs
        .lines()
        .find(|l| {
            l.contains("connection complete")
                && l.contains("passthrough")
                && l.contains("fast")
                && l.contains(&to)
        })
        .unwrap_or_else(|| panic!("no access log line for {to}:\n{logs}"));
    assert!(line.contains(&bytes.to_string()), "{line}");
}

#[test]
fn passthrough_goes_direct_and_is_reported_as_the_proxy_would() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("fastpath-direct").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let plain_a = topo.add_pod("node-a", "plain-a").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let plain_b = topo.add_pod("node-b", "plain-b").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&plain_a, false),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&plain_b, false),
    ]);
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let [mut agent_a, mut agent_b] =
        start_enrolled(&topo, [&node_a, &node_b], &yaml, &FAST, TIMEOUT).expect("agents enrolled");
    wait_metrics(&node_a, &agent_a, "the fast-path table in use", |m| {
        sample(m, "shunt_fast_path_table_valid", &[]) == Some(1.0)
    });
    let echo_a = EchoServer::on(&plain_a, 8080).expect("echo");
    let half_b = HalfEcho::on(&plain_b, 8080);
    let echo_server = EchoServer::on(&server, 8080).expect("echo");

    // Same node, then across nodes: direct, reported with the bytes moved.
    carried_directly(
        &apps,
        &agent_a,
        &node_a,
        &client,
        &plain_a,
        &|| echo_a.peers(),
        300_000,
        300_000,
    );
    carried_directly(
        &apps,
        &agent_a,
        &node_a,
        &client,
        &plain_b,
        &|| half_b.peers(),
        1_048_576,
        524_288,
    );
    let text = wait_metrics(
        &node_a,
        &agent_a,
        "the kernel's direct connects counted",
        |m| sample(m, "shunt_fast_path_connections_total", &[]).is_some_and(|n| n >= 2.0),
    );
    assert_eq!(
        sample(&text, "shunt_fast_path_events_dropped_total", &[]),
        Some(0.0),
        "{text}"
    );

    // A mesh destination on another node is still HBONE through both
    // proxies.
    let hbone_before = agent_a
        .status()
        .expect("status")
        .proxy
        .map_or(0, |p| p.outbound_hbone);
    let to_server = format!("{}:8080", server.ip());
    let report = apps.run(&client, &["connect", &to_server, "--send", "65536"]);
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(via_the_proxy(&report), "redirected to the proxy: {report}");
    wait_proxy(
        &agent_a,
        "the outbound HBONE connection",
        hbone_before + 1,
        |p| p.outbound_hbone,
    );
    wait_proxy(&agent_b, "the inbound HBONE connection", 1, |p| {
        p.inbound_hbone
    });
    assert_eq!(echo_server.peers().len(), 1);
    wait_metrics(
        &node_a,
        &agent_a,
        "the HBONE connection reported as mTLS",
        |m| {
            sample(
                m,
                "istio_tcp_connections_closed_total",
                &[
                    ("destination_workload", "server"),
                    ("connection_security_policy", "mutual_tls"),
                ],
            ) == Some(1.0)
        },
    );

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

/// A connect from `client` to `dst` that went through the proxy: the app's
/// socket was redirected to 127.0.0.1:15001, the proxy counted one more
/// passthrough, the destination still saw the pod's IP.
fn carried_by_the_proxy(
    apps: &TestApp<'_>,
    agent: &Agent,
    client: &Pod,
    dst: &Pod,
    echo: &EchoServer,
) {
    let before = proxy_passthrough(agent);
    let to = format!("{}:8080", dst.ip());
    let report = apps.run(client, &["connect", &to, "--send", "4096"]);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    assert!(via_the_proxy(&report), "redirected to the proxy: {report}");
    wait_proxy(agent, "the proxy's passthrough", before + 1, |p| {
        p.outbound_passthrough
    });
    assert_eq!(proxy_passthrough(agent), before + 1, "exactly one");
    let peers = echo.peers();
    assert_eq!(
        peers.last().map(SocketAddr::ip),
        Some(std::net::IpAddr::V4(client.ip())),
        "{peers:?}"
    );
}

#[test]
fn the_opt_outs_and_an_incomplete_table_keep_flows_on_the_proxy() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("fastpath-optout", &["client", "keeper", "server", "plain"])
            .expect("topology");
    let [client, keeper, server, plain] = [0, 1, 2, 3].map(|i| pods[i].clone());
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec {
            fast_path: Some(false),
            ..WorkloadSpec::for_pod(&keeper, true)
        },
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&plain, false),
    ]);
    let node = client.node().clone();
    let echo = EchoServer::on(&plain, 8080).expect("echo");

    // --fast-path on: the client goes direct, the pod that opted out
    // (fastPath: false) through the proxy.
    let mut agent = Agent::start(&topo, &node, &yaml, &FAST).expect("agent");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    wait_metrics(&node, &agent, "the fast-path table in use", |m| {
        sample(m, "shunt_fast_path_table_valid", &[]) == Some(1.0)
    });
    carried_by_the_proxy(&apps, &agent, &keeper, &plain, &echo);
    carried_directly(
        &apps,
        &agent,
        &node,
        &client,
        &plain,
        &|| echo.peers(),
        8192,
        8192,
    );
    agent.stop().expect("stop");

    // A table too small for the view (3 mesh IPs, room for 1): turned off,
    // counted, and every flow back through the proxy.
    agent
        .restart(&[
            "--redirect",
            "ebpf",
            "--fast-path",
            "on",
            "--fast-path-max-destinations",
            "1",
        ])
        .expect("restart");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    wait_metrics(&node, &agent, "the table turned off as too large", |m| {
        sample(
            m,
            "shunt_fast_path_table_invalidations_total",
            &[("reason", "too_large")],
        )
        .is_some_and(|n| n >= 1.0)
            && sample(m, "shunt_fast_path_table_valid", &[]) == Some(0.0)
    });
    carried_by_the_proxy(&apps, &agent, &client, &plain, &echo);
    wait_metrics(&node, &agent, "the proxied connect counted", |m| {
        sample(
            m,
            "shunt_fast_path_proxied_connections_total",
            &[("reason", "table_invalid")],
        )
        .is_some_and(|n| n >= 1.0)
    });
    agent.stop().expect("stop");

    // --fast-path off: the proxy carries everything.
    agent
        .restart(&["--redirect", "ebpf", "--fast-path", "off"])
        .expect("restart");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    carried_by_the_proxy(&apps, &agent, &client, &plain, &echo);
    let text = metrics(&node, &agent);
    assert_eq!(
        sample(&text, "shunt_fast_path_table_valid", &[]),
        Some(0.0),
        "{text}"
    );
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

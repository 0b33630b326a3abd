//! Inbound fails closed until the first complete cluster view (issue 34,
//! item 6). The agent starts with its istiod unreachable (nothing listens at
//! `--xds-address` yet); the workloads file enrols the pods. Meanwhile a
//! mesh client and a client outside the mesh both reach the server's
//! captured port (HBONE / plaintext inbound) and are refused at once,
//! counted as `shunt_proxy_refusals_total{reason="not_synced"}`; the
//! application sees nothing. Then the in-test istiod
//! (`userspace/tests/support/fake_istiod.rs`) comes up in the node's netns
//! and sends the workloads and an ALLOW policy naming only the mesh
//! client: the mesh client passes, the outsider is refused by that policy.
//! ztunnel likewise serves no pod before its first xDS update.
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt-testbed --test inbound_sync`.

#[path = "../../userspace/tests/support/fake_istiod.rs"]
mod fake_istiod;

use std::time::{Duration, Instant};

use fake_istiod::{FakeIstiod, Pki, agent_args, pod, policy, principal_policy, response, workload};
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::istio::security as security_pb;
use shunt_testbed::{
    Cgroup, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp, ok},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
/// Where istiod will listen, in the node's own (fresh) netns; nothing does
/// until the test starts it.
const ISTIOD: &str = "127.0.0.1:15012";
/// The agent's first retries back off 1 s, 2 s, 4 s… (at most 30 s).
const RECONNECT_TIMEOUT: Duration = Duration::from_secs(60);

fn blocking<T>(f: impl FnOnce() -> T) -> T {
    tokio::task::block_in_place(f)
}

/// `shunt_proxy_refusals_total{reason}` as the agent's `/metrics` says.
fn refusals(metrics: &str, reason: &str) -> Option<u64> {
    let prefix = format!("shunt_proxy_refusals_total{{reason=\"{reason}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(&prefix))
        .and_then(|v| v.trim().parse().ok())
}

async fn fails_closed_until_istiod_sends_policies(mode: &str) {
    require_root().expect("kernel tests need root");
    let pki = Pki::new();
    let mut topo = Topology::new(&format!("sync-{mode}")).expect("topology");
    // node-a and shunt-x1: the names the in-test istiod expects.
    topo.add_node("node-a").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let outsider = topo.add_pod("node-a", "outsider").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    let xds = agent_args(ISTIOD, &pki);
    let args: Vec<&str> = ["--redirect", mode, "--log-format", "json"]
        .into_iter()
        .chain(xds.iter().map(String::as_str))
        .collect();
    let mut agent = blocking(|| Agent::start(&topo, &node, &yaml, &args)).expect("agent");
    blocking(|| agent.wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled))
        .expect("enrolled");
    let (client, server, outsider) = (&client, &server, &outsider);
    let apps = TestApp::new(TESTAPP, &apps);
    let echo = EchoServer::on(server, 8080).expect("echo");
    let to_server = format!("{}:8080", server.ip());

    // Before istiod: both refused, the application sees neither.
    let (code, body) = blocking(|| agent.readiness()).expect("readiness");
    assert_eq!(code, 503, "not ready before istiod: {body}");
    for (who, from) in [("mesh client", client), ("outsider", outsider)] {
        let report = blocking(|| apps.run(from, &["connect", &to_server, "--send", "1024"]));
        assert!(
            !ok(&report),
            "{who} reached the server with no policy known: {report}\n{}",
            agent.logs()
        );
    }
    assert!(
        echo.accepted().is_empty(),
        "the application saw a connection before the first sync: {:?}",
        echo.accepted()
    );
    let status = blocking(|| {
        agent.wait_for("both refusals counted", TIMEOUT, |s| {
            s.proxy
                .as_ref()
                .and_then(|p| p.refusals.get("not_synced"))
                .is_some_and(|n| *n >= 2)
        })
    })
    .expect("counted");
    let proxy = status.proxy.expect("proxy stats");
    assert_eq!(proxy.refusals.get("policy"), Some(&0), "{proxy:?}");
    let (_, metrics) = blocking(|| agent.metrics()).expect("metrics");
    assert!(
        refusals(&metrics, "not_synced").is_some_and(|n| n >= 2),
        "not_synced on /metrics:\n{metrics}"
    );

    // istiod comes up: the workloads, and an ALLOW naming the mesh client
    // only (so a deny for everyone else in the namespace).
    let listener = node
        .listen_tcp(ISTIOD.parse().expect("addr"))
        .expect("istiod's listener in the node");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let deadline = Instant::now() + RECONNECT_TIMEOUT;
    while istiod.connections() == 0 {
        assert!(
            Instant::now() < deadline,
            "the agent never reached istiod:\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    istiod.initial_requests(1).await;
    let mut client_pb = pod("default", client.name(), client.ip().octets(), "node-a");
    client_pb.service_account = "sa-client".into();
    let mut server_pb = pod("default", server.name(), server.ip().octets(), "node-a");
    server_pb.service_account = "sa-server".into();
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![workload(client_pb, "1"), workload(server_pb, "1")],
        &[],
    ));
    istiod.push(response(
        AUTHORIZATION_TYPE_URL,
        "p1",
        vec![policy(
            principal_policy(
                "only-client",
                security_pb::Scope::Namespace,
                security_pb::Action::Allow,
                "cluster.local/ns/default/sa/sa-client",
                &[],
            ),
            "1",
        )],
        &[],
    ));
    assert_eq!(istiod.answer_to("a1").await.error_detail, None);
    assert_eq!(istiod.answer_to("p1").await.error_detail, None);

    // The allowed caller passes once the view is applied...
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let report = blocking(|| apps.run(client, &["connect", &to_server, "--send", "4096"]));
        if ok(&report) {
            break;
        }
        assert!(
            Instant::now() < deadline,
            "the mesh client never passed after the sync: {report}\n{}",
            agent.logs()
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    // ...and the outsider is refused by istiod's policy, not by the gate.
    let before = blocking(|| agent.status())
        .expect("status")
        .proxy
        .and_then(|p| p.refusals.get("not_synced").copied());
    let report = blocking(|| apps.run(outsider, &["connect", &to_server, "--send", "1024"]));
    assert!(!ok(&report), "the policy let the outsider in: {report}");
    let status = blocking(|| {
        agent.wait_for("the policy's refusal counted", TIMEOUT, |s| {
            s.proxy
                .as_ref()
                .and_then(|p| p.refusals.get("policy"))
                .is_some_and(|n| *n >= 1)
        })
    })
    .expect("policy refusal");
    assert_eq!(
        status
            .proxy
            .and_then(|p| p.refusals.get("not_synced").copied()),
        before,
        "no connection refused by the gate after the sync"
    );
    assert_eq!(
        echo.accepted().len(),
        1,
        "only the allowed caller reached the application"
    );

    let exit = blocking(|| agent.stop()).expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_fails_closed_until_the_first_sync_in_ebpf_mode() {
    fails_closed_until_istiod_sends_policies("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn inbound_fails_closed_until_the_first_sync_in_iptables_mode() {
    fails_closed_until_istiod_sends_policies("iptables").await;
}

//! End to end on the real kernel: a Service that exists only in istiod's
//! xDS pushes. Two nodes in the netns testbed; the agent of node-a takes its
//! cluster view from an in-test istiod (TLS, token, node id checked) that
//! listens inside node-a's netns; enrolment still comes from the workloads
//! file, which names no service. A connect from the client pod to the VIP
//! lands on the healthy endpoint on node-b over HBONE, never on the
//! unhealthy one; after a delta push removes the endpoint, new connections
//! are refused; once it is back and istiod goes away, nothing is
//! unenrolled, the VIP keeps answering and readiness holds. Then
//! authorization from istiod alone: an `Authorization` resource (ALLOW for
//! one principal) bound to a pod makes its proxy answer another identity's
//! CONNECT with 401 while the allowed one passes, until istiod removes it.
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

use fake_istiod::{
    FakeIstiod, Pki, pod, policy, principal_policy, response, service, web_backend, web_service,
    workload,
};
use serde_json::Value;
use shunt::state::PodState;
use shunt::xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL};
use shunt_proto::istio::security as security_pb;
use shunt_testbed::{
    Topology,
    agent::{Agent, WorkloadSpec, http, workloads_yaml},
    apps::EchoServer,
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(30);
const VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 100, 1);

/// One echo round trip through the VIP from the client pod's netns;
/// `Err` when the connection is refused or reset.
fn echo_via_vip(client: &shunt_testbed::Pod, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    echo(client, SocketAddr::from((VIP, 80)), payload)
}

/// One echo round trip to `to` from the client pod's netns; `Err` when the
/// connection is refused or reset.
fn echo(client: &shunt_testbed::Pod, to: SocketAddr, payload: &[u8]) -> std::io::Result<Vec<u8>> {
    let mut conn = client
        .connect_tcp(to, Duration::from_secs(5))
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

/// Iptables mode: the test connects from its own threads entered into the
/// client's netns, which the eBPF mode's cgroup hooks would not see (its
/// tests run applications in the hooked cgroup, `tests/tests/services.rs`).
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
    let mut istiod = FakeIstiod::start_on(&pki, listener);
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
    let xds_args = xds_args(&common, &xds_address, &root, &token);
    let mut agent_a = blocking(|| Agent::start(&topo, &node_a, &yaml, &xds_args)).expect("agent a");
    let mut agent_b = blocking(|| Agent::start(&topo, &node_b, &yaml, &common)).expect("agent b");

    // Not ready until istiod has sent both types.
    let initial = istiod.initial_requests(1).await;
    assert_eq!(initial.len(), 2);
    let (code, body) = blocking(|| agent_a.readiness()).expect("readiness");
    assert_eq!(code, 503, "{body}");
    assert!(body.contains("xds: FAIL"), "{body}");

    let service_pb = web_service(VIP.octets());
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
        "the unhealthy workload gets no connection"
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

    // The endpoint comes back; then istiod goes away. What it sent stays:
    // no pod is unenrolled, the VIP keeps answering, readiness holds.
    istiod.push(response(
        ADDRESS_TYPE_URL,
        "a2",
        vec![workload(
            web_backend(
                server.name(),
                server.ip().octets(),
                server.node().name(),
                &format!("sa-{}", server.name()),
                true,
            ),
            "2",
        )],
        &[],
    ));
    assert_eq!(istiod.answer_to("a2").await.error_detail, None);
    let deadline = Instant::now() + TIMEOUT;
    while !matches!(blocking(|| echo_via_vip(&client, b"back")), Ok(back) if back == b"back") {
        assert!(
            Instant::now() < deadline,
            "the VIP never answered again after the endpoint came back:\n{}",
            agent_a.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let before_away = server_app.peers().len();
    istiod.stop();
    let away = blocking(|| {
        agent_a.wait_for("the istiod connection lost", TIMEOUT, |s| {
            s.xds.as_ref().is_some_and(|x| !x.connected)
        })
    })
    .expect("disconnected");
    assert!(
        away.pods.iter().all(|p| p.state == PodState::Enrolled),
        "a pod left the mesh while istiod was away: {:?}",
        away.pods
    );
    for i in 0..4u8 {
        let payload = vec![i; 4096];
        let back = blocking(|| echo_via_vip(&client, &payload)).unwrap_or_else(|e| {
            panic!(
                "connect {i} to the VIP with istiod away: {e}\n{}",
                agent_a.logs()
            )
        });
        assert_eq!(back, payload, "echo through the VIP with istiod away");
    }
    assert_eq!(
        server_app.peers().len(),
        before_away + 4,
        "each connection with istiod away reached the endpoint"
    );
    let (code, body) = blocking(|| agent_a.readiness()).expect("readiness");
    assert_eq!(code, 200, "readiness kept with istiod away: {body}");

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = blocking(|| agent.stop()).expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

/// The agent's start arguments with `--xds-address` (istiod on `istiod`,
/// its root and token from `pki`), as the fake istiod checks them.
fn xds_args<'a>(
    common: &[&'a str],
    istiod: &'a str,
    root: &'a str,
    token: &'a str,
) -> Vec<&'a str> {
    let mut args = common.to_vec();
    args.extend([
        "--xds-address",
        istiod,
        "--xds-root-cert",
        root,
        "--xds-token",
        token,
        "--instance-ip",
        "198.18.0.5",
        "--pod-name",
        "shunt-x1",
        "--pod-namespace",
        "istio-system",
    ]);
    args
}

/// The access-log lines (JSON) of `agent` for inbound HBONE.
fn inbound_lines(agent: &Agent) -> Vec<Value> {
    agent
        .logs()
        .lines()
        .filter_map(|l| serde_json::from_str::<Value>(l).ok())
        .filter(|l| l["target"] == "shunt::access" && l["fields"]["direction"] == "inbound")
        .collect()
}

fn field<'a>(line: &'a Value, name: &str) -> &'a str {
    line["fields"][name].as_str().unwrap_or("")
}

/// Authorization from istiod alone, end to end in iptables mode: the
/// server (node-a, whose agent takes its cluster view from istiod) is bound
/// to an ALLOW for the client's principal. A client with another identity
/// (node-b) gets 401 on its CONNECT (the app never sees it; node-a's access
/// log names the policy), the allowed one passes; once istiod removes the
/// policy (and the agent says so in /config_dump), the other client passes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_istiod_policy_answers_other_identities_with_401_until_removed() {
    let policy = principal_policy(
        "allow-client",
        security_pb::Scope::WorkloadSelector,
        security_pb::Action::Allow,
        "cluster.local/ns/default/sa/sa-client",
        &[],
    );
    istiod_allow_policy("xds-authz", policy).await;
}

/// The same with the policy istiod sends for `from.source.serviceAccounts`
/// (`Match` field 11): before the field was known it arrived as `{}` and
/// every identity passed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_istiod_service_account_policy_answers_other_accounts_with_401() {
    let mut policy = principal_policy(
        "allow-client",
        security_pb::Scope::WorkloadSelector,
        security_pb::Action::Allow,
        "-",
        &[],
    );
    policy.rules[0].clauses[0].matches[0] = security_pb::Match {
        service_accounts: vec![security_pb::ServiceAccountMatch {
            namespace: "default".into(),
            service_account: "sa-client".into(),
        }],
        ..Default::default()
    };
    istiod_allow_policy("xds-authz-sa", policy).await;
}

/// `allow_client` (named `default/allow-client`, admitting the client and
/// not the other pod) bound to the server by istiod.
async fn istiod_allow_policy(test: &str, allow_client: security_pb::Authorization) {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(test).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let client = topo.add_pod("node-b", "client").expect("pod");
    let other = topo.add_pod("node-b", "other").expect("pod");
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();

    let pki = Pki::new();
    let listener = node_a
        .listen_tcp("127.0.0.1:0".parse().expect("addr"))
        .expect("listener in node-a");
    let istiod = FakeIstiod::start_on(&pki, listener);
    let (address, root, token) = (
        istiod.addr.to_string(),
        pki.root_file().display().to_string(),
        pki.token_file().display().to_string(),
    );
    // The file enrols the pods (service accounts sa-<pod>); it names no
    // policy.
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&other, true),
    ]);
    let common = ["--redirect", "iptables", "--log-format", "json"];
    let args_a = xds_args(&common, &address, &root, &token);
    let mut agent_a = blocking(|| Agent::start(&topo, &node_a, &yaml, &args_a)).expect("agent a");
    let mut agent_b = blocking(|| Agent::start(&topo, &node_b, &yaml, &common)).expect("agent b");
    istiod.initial_requests(1).await;

    // istiod: the three pods, the server bound to the policy, and the policy.
    let mut server_pb = pod("default", server.name(), server.ip().octets(), "node-a");
    server_pb.service_account = "sa-server".into();
    server_pb.authorization_policies = vec!["default/allow-client".into()];
    let mut pods = vec![workload(server_pb, "1")];
    for p in [&client, &other] {
        let mut w = pod("default", p.name(), p.ip().octets(), "node-b");
        w.service_account = format!("sa-{}", p.name());
        pods.push(workload(w, "1"));
    }
    istiod.push(response(ADDRESS_TYPE_URL, "a1", pods, &[]));
    istiod.push(response(
        AUTHORIZATION_TYPE_URL,
        "p1",
        vec![policy(allow_client, "1")],
        &[],
    ));
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
    let policies_on_a = |agent: &Agent| -> Option<Vec<String>> {
        let (code, body) = http(
            &node_a,
            "GET",
            agent.endpoints().admin.port(),
            "/config_dump",
        )
        .ok()?;
        let dump: Value = serde_json::from_str(&body).ok().filter(|_| code == 200)?;
        Some(
            dump["policies"]
                .as_array()?
                .iter()
                .map(|p| {
                    format!(
                        "{}/{}",
                        p["namespace"].as_str().unwrap_or(""),
                        p["name"].as_str().unwrap_or("")
                    )
                })
                .collect(),
        )
    };
    let deadline = Instant::now() + TIMEOUT;
    while blocking(|| policies_on_a(&agent_a)).as_deref()
        != Some(&["default/allow-client".to_owned()][..])
    {
        assert!(
            Instant::now() < deadline,
            "istiod's policy never applied on node-a:\n{}",
            agent_a.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }

    let app = EchoServer::on(&server, 8080).expect("echo");
    let to = SocketAddr::from((server.ip(), 8080));
    let payload = vec![7u8; 4096];
    let back = blocking(|| echo(&client, to, &payload))
        .unwrap_or_else(|e| panic!("the allowed client: {e}\n{}", agent_a.logs()));
    assert_eq!(back, payload, "the allowed principal passes");
    let denied = blocking(|| echo(&other, to, &payload));
    assert!(
        !matches!(&denied, Ok(back) if *back == payload),
        "another identity got through: {denied:?}"
    );
    assert_eq!(app.peers().len(), 1, "the app saw only the allowed client");
    let other_id = "spiffe://cluster.local/ns/default/sa/sa-other";
    let deadline = Instant::now() + TIMEOUT;
    let line = loop {
        if let Some(line) = inbound_lines(&agent_a)
            .into_iter()
            .find(|l| field(l, "src.identity") == other_id && field(l, "result") == "denied")
        {
            break line;
        }
        assert!(
            Instant::now() < deadline,
            "no denied inbound line on node-a:\n{}",
            agent_a.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(field(&line, "reason").starts_with("401 "), "{line}");
    assert_eq!(field(&line, "policy"), "default/allow-client", "{line}");

    // istiod removes the policy: once node-a has applied the removal, the
    // other identity passes.
    istiod.push(response(
        AUTHORIZATION_TYPE_URL,
        "p2",
        vec![],
        &["default/allow-client"],
    ));
    assert_eq!(istiod.answer_to("p2").await.error_detail, None);
    let deadline = Instant::now() + TIMEOUT;
    while blocking(|| policies_on_a(&agent_a)).as_deref() != Some(&[][..]) {
        assert!(
            Instant::now() < deadline,
            "the removal never applied on node-a:\n{}",
            agent_a.logs()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    let back = blocking(|| echo(&other, to, &payload)).unwrap_or_else(|e| {
        panic!(
            "the other client after the removal: {e}\n{}",
            agent_a.logs()
        )
    });
    assert_eq!(back, payload, "no policy: every identity passes");
    assert_eq!(app.peers().len(), 2);

    drop(app);
    for agent in [&mut agent_a, &mut agent_b] {
        let exit = blocking(|| agent.stop()).expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

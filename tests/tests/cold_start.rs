//! A cold start with many pods listed at once (issue 20 §6), through the
//! real `shunt agent` binary on the real kernel: the agent binds the pods'
//! listeners as one concurrent batch before enrolling them
//! (`userspace/src/agent/serve.rs`). What a user sees must not change:
//! every pod ends up enrolled and reachable through its own listeners, and
//! a pod whose listeners cannot be bound is reported with the reason and
//! fails closed while the others are enrolled.

use std::{net::SocketAddr, time::Duration};

use serde_json::Value;
use shunt::api::{NodeStatus, PodState};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
/// More pods than one would enrol one after another in a test, fewer than
/// the batch's bound (32): all of them are bound at once.
const PODS: usize = 12;
const APP_PORT: u16 = 8080;

fn topology(test: &str) -> (Topology, Vec<Pod>) {
    require_root().expect("kernel tests need root");
    let names: Vec<String> = (0..PODS).map(|i| format!("p{i:02}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    Topology::single_node(test, &names).expect("topology")
}

/// Starts the agent with every pod in the mesh, each its own service
/// account (so each its own certificate), as one list.
fn start_agent(topo: &Topology, pods: &[Pod]) -> Agent {
    let specs: Vec<WorkloadSpec> = pods
        .iter()
        .map(|p| WorkloadSpec::for_pod(p, true))
        .collect();
    let node = topo.node("node-a").expect("node-a").clone();
    Agent::start(
        topo,
        &node,
        &workloads_yaml(&specs),
        &["--redirect", "ebpf"],
    )
    .expect("agent")
}

fn state_of<'a>(status: &'a NodeStatus, pod: &Pod) -> Option<&'a PodState> {
    status
        .pods
        .iter()
        .find(|p| p.name == pod.name())
        .map(|p| &p.state)
}

fn inbound_hbone(agent: &Agent) -> u64 {
    agent
        .status()
        .expect("status")
        .proxy
        .map(|p| p.inbound_hbone)
        .unwrap_or_default()
}

/// `client`'s application connects to `server`:8080 and sends 4 KiB; the
/// report says whether the echo came back intact.
fn exchange(apps: &TestApp<'_>, client: &Pod, server: &Pod) -> Value {
    let to = format!("{}:{APP_PORT}", server.ip());
    apps.run(client, &["connect", &to, "--send", "4096"])
}

#[test]
fn many_pods_listed_at_once_are_all_enrolled_and_each_is_served() {
    let (topo, pods) = topology("coldmany");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let mut agent = start_agent(&topo, &pods);
    let status = agent
        .wait_for("every pod enrolled", TIMEOUT, |s| {
            pods.iter()
                .all(|p| state_of(s, p) == Some(&PodState::Enrolled))
        })
        .expect("every pod listed at once is enrolled");
    assert_eq!(status.pods.len(), PODS, "status lists every pod once");
    let _servers: Vec<EchoServer> = pods
        .iter()
        .map(|p| EchoServer::on(p, APP_PORT).expect("echo server"))
        .collect();
    // Every pod's own listeners serve it: its outbound listener (as a
    // client) and its HBONE listener (as the next pod's server), each
    // exchange one more HBONE stream into a pod.
    for (i, client) in pods.iter().enumerate() {
        let server = &pods[(i + 1) % pods.len()];
        let before = inbound_hbone(&agent);
        let report = exchange(&apps, client, server);
        assert_eq!(
            report["intact"],
            Value::Bool(true),
            "{} → {}: {report}\n{}",
            client.name(),
            server.name(),
            agent.logs()
        );
        assert!(
            inbound_hbone(&agent) > before,
            "{} → {} went through HBONE",
            client.name(),
            server.name()
        );
    }
    // Each its own identity: every pod's certificate was issued.
    agent
        .wait_for("every pod's certificate issued", TIMEOUT, |s| {
            s.pods.len() == PODS && s.pods.iter().all(|p| p.certificate.is_some())
        })
        .expect("a certificate for every pod");
    agent.stop().expect("stop");
}

#[test]
fn a_pod_whose_listener_cannot_bind_fails_closed_while_the_others_are_enrolled() {
    let (topo, pods) = topology("coldbind");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let blocked = &pods[3];
    // Something in the pod already holds 0.0.0.0:15006 (without
    // SO_REUSEPORT): the proxy cannot bind its inbound plaintext listener.
    let squatter = blocked
        .listen_tcp(SocketAddr::from(([0, 0, 0, 0], 15006)))
        .expect("squat on 15006");
    let mut agent = start_agent(&topo, &pods);
    let status = agent
        .wait_for(
            "the others enrolled and the blocked pod in error",
            TIMEOUT,
            |s| {
                pods.iter()
                    .filter(|p| p.name() != blocked.name())
                    .all(|p| state_of(s, p) == Some(&PodState::Enrolled))
                    && matches!(state_of(s, blocked), Some(PodState::Error(_)))
            },
        )
        .expect("status");
    let Some(PodState::Error(reason)) = state_of(&status, blocked) else {
        unreachable!("waited for it");
    };
    assert!(
        reason.contains("0.0.0.0:15006") && reason.contains("fails closed"),
        "the reason names the address that could not be bound and says the pod fails closed: {reason}"
    );
    let server = &pods[4];
    let _server = EchoServer::on(server, APP_PORT).expect("echo server");
    // Fails closed: its connections are redirected to a proxy listener
    // that is not there, never sent around the mesh.
    let report = exchange(&apps, blocked, server);
    assert_ne!(
        report["intact"],
        Value::Bool(true),
        "the blocked pod's connection went around the mesh: {report}"
    );
    // The others are served: a neighbour reaches the same server.
    let report = exchange(&apps, &pods[2], server);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    // Once the address is free, a later pass serves the pod.
    drop(squatter);
    agent
        .wait_for(
            "the blocked pod enrolled once 15006 is free",
            TIMEOUT,
            |s| state_of(s, blocked) == Some(&PodState::Enrolled),
        )
        .expect("the pod is served once it can be");
    let report = exchange(&apps, blocked, server);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent.logs()
    );
    agent.stop().expect("stop");
}

//! Graceful restart, and the DaemonSet rollout that uses it: a new agent
//! takes over a node from a running one with no failed new connection. The new agent starts beside the old (same pin
//! dir, same workloads), adopts the pinned redirection, binds its pod
//! listeners next to the old ones (`SO_REUSEPORT`) and becomes ready; the
//! old one gets SIGTERM, stops accepting, drains and exits leaving
//! redirection in place (`--on-exit keep`). Meanwhile applications open new
//! connections continuously, through both the outbound/HBONE path (mesh
//! client to mesh server) and the inbound plaintext path (a pod outside the
//! mesh to the mesh server), and every single one must work.
//!
//! The same sequence runs in two layouts. `HostNetwork`: both agents in the
//! node's netns, so the new one needs other admin/metrics/readiness ports.
//! `PodNetwork`: the exact sequence a DaemonSet rollout with `maxSurge: 1,
//! maxUnavailable: 0` produces now that the agent runs in a pod netns of its
//! own (deploy/base/daemonset.yaml): the surge pod (a second agent pod netns
//! on the node's bridge, its own IP) starts with the same ports as the old
//! one (15000/15020/15021: they no longer collide), is probed ready on its
//! pod IP:15021 as the kubelet does, and only then the old pod gets SIGTERM.

use std::{
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::proxy::ProxyStats;
use shunt_testbed::{
    agent::{Agent, AgentNetns, Endpoints, MeshNode, http, mesh_pods_enrolled},
    apps::{Churn, EchoServer, TestApp},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);

fn stats(agent: &Agent) -> ProxyStats {
    agent
        .status()
        .ok()
        .and_then(|s| s.proxy)
        .unwrap_or_default()
}

/// Waits (bounded) until `agent`'s proxy counters satisfy `done`.
fn wait_for_stats(agent: &mut Agent, what: &str, done: impl Fn(&ProxyStats) -> bool) {
    agent
        .wait_for(what, TIMEOUT, |s| s.proxy.as_ref().is_some_and(&done))
        .expect("counters");
}

/// Where the agents run.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Layout {
    /// In the node's netns (`hostNetwork`).
    HostNetwork,
    /// Each in a pod netns of its own (the DaemonSet's layout).
    PodNetwork,
}

/// Waits (bounded) until `agent` answers ready on its readiness endpoint,
/// from the node as the kubelet probes it.
fn wait_ready(agent: &Agent) {
    let start = Instant::now();
    loop {
        match agent.readiness() {
            Ok((200, _)) => return,
            last => assert!(
                start.elapsed() < TIMEOUT,
                "the new agent never became ready: {last:?}\n{}",
                agent.logs()
            ),
        }
        thread::sleep(Duration::from_millis(100));
    }
}

/// `GET /metrics` answered 200 at the agent's own address, seen from the
/// node (the agent pod's IP in the pod layout): a Prometheus scrape.
fn assert_metrics_answer(agent: &Agent, which: &str) {
    let addr = agent.reachable_from_node(agent.endpoints().metrics.port());
    let (code, body) = agent
        .metrics()
        .unwrap_or_else(|e| panic!("the {which} agent's metrics at {addr}: {e}"));
    assert_eq!(code, 200, "the {which} agent's metrics at {addr}: {body}");
    assert!(
        body.contains("shunt_"),
        "the {which} agent's metrics at {addr} hold no shunt metric:\n{body}"
    );
}

fn handover_without_failed_connections(mode: &str, layout: Layout) {
    require_root().expect("kernel tests need root");
    // Both agents verify (and would repair) every pod each second while
    // they overlap: neither may see the other's state as drift.
    let args = [
        "--redirect",
        mode,
        "--on-exit",
        "keep",
        "--verify-interval",
        "1",
    ];
    let name = format!("handover-{mode}-{layout:?}");
    let mut bed = match layout {
        Layout::HostNetwork => MeshNode::start(&name, &args),
        Layout::PodNetwork => MeshNode::start_in_agent_pod(&name, "agent-old", &args),
    }
    .expect("node with the old agent");
    let (client, server, outsider) = (&bed.client, &bed.server, &bed.outsider);
    let topo = &bed.topology;
    let mut old = bed.agent;
    let apps = TestApp::new(TESTAPP, &bed.apps);
    // The proxy asked each mesh pod's kernel to hand a closing listener's
    // queued connections to the other agent's listener (without it, this
    // test's churn saw resets when the old agent closed its listeners).
    for pod in [client, server] {
        let migrate = pod
            .run(|| std::fs::read_to_string("/proc/sys/net/ipv4/tcp_migrate_req"))
            .expect("enter pod")
            .expect("read tcp_migrate_req");
        assert_eq!(migrate.trim(), "1", "tcp_migrate_req in {}", pod.name());
    }
    let _echo = EchoServer::on(server, 8080).expect("echo");
    let to_server = format!("{}:8080", server.ip());
    let stop_dir = std::env::temp_dir();
    let mesh = Churn::start(
        &apps,
        client,
        &to_server,
        stop_dir.join(format!("{}-mesh.stop", topo.prefix())),
    );
    let plaintext = Churn::start(
        &apps,
        outsider,
        &to_server,
        stop_dir.join(format!("{}-plaintext.stop", topo.prefix())),
    );

    // The old agent serves both paths.
    wait_for_stats(&mut old, "the old agent to serve both paths", |s| {
        s.outbound_hbone >= 100 && s.inbound_plaintext >= 100
    });

    // The new agent starts beside it and becomes ready: in the node's
    // netns on other ports, or (a surge pod) in a pod netns of its own on
    // the same ports.
    let mut new = match layout {
        Layout::HostNetwork => old.successor(Endpoints::with_ports(15100, 15120, 15121), &args),
        Layout::PodNetwork => {
            let surge_pod = bed
                .topology
                .add_pod(client.node().name(), "agent-new")
                .expect("the surge pod's netns");
            old.successor_in(AgentNetns::Pod(surge_pod), Endpoints::standard(), &args)
        }
    }
    .expect("new agent");
    new.wait_for(
        "mesh pods enrolled by the new agent",
        TIMEOUT,
        mesh_pods_enrolled,
    )
    .expect("enrolled");
    wait_ready(&new);
    // What proves the layout: both agents answer their metrics while both
    // run, each at its own address, and in the pod layout on the same
    // port, none of which the node itself holds.
    assert_metrics_answer(&old, "old");
    assert_metrics_answer(&new, "new");
    if layout == Layout::PodNetwork {
        assert_eq!(
            old.endpoints().metrics.port(),
            new.endpoints().metrics.port()
        );
        assert_ne!(
            old.reachable_from_node(15020),
            new.reachable_from_node(15020)
        );
        let node = client.node();
        for port in [15000, 15020, 15021] {
            assert!(
                http(node, "GET", port, "/").is_err(),
                "nothing listens on the node's own port {port}: no host port in the pod layout"
            );
        }
    }
    // Both serve new connections while both run (the kernel spreads them
    // over both agents' listeners).
    wait_for_stats(&mut new, "the new agent to serve both paths", |s| {
        s.outbound_hbone >= 20 && s.inbound_plaintext >= 20
    });
    let old_before = stats(&old);
    assert!(old_before.outbound_hbone > 0 && old_before.inbound_plaintext > 0);

    // The old agent stops: drains, exits, leaves redirection in place.
    let exit = old.stop().expect("old agent stops");
    assert!(exit.success(), "{}", old.logs());
    let old_logs = old.logs();
    assert!(
        old_logs.contains("leaving every pod enrolled for the next agent"),
        "{old_logs}"
    );
    assert!(!old_logs.contains("pod unenrolled"), "{old_logs}");
    // Its metrics address went with it; the new agent's still answers.
    assert!(
        old.metrics().is_err(),
        "the old agent's metrics address still answers after it exited"
    );
    assert_metrics_answer(&new, "new");

    // The new agent carries on alone.
    let after_exit = stats(&new);
    wait_for_stats(&mut new, "the new agent to serve alone", |s| {
        s.outbound_hbone >= after_exit.outbound_hbone + 300
            && s.inbound_plaintext >= after_exit.inbound_plaintext + 300
    });
    let mesh = mesh.finish();
    let plaintext = plaintext.finish();
    for (path, report) in [("mesh", &mesh), ("plaintext", &plaintext)] {
        assert_eq!(
            report["failed"],
            Value::from(0),
            "{path} connections failed during the handover: {report}\nold agent:\n{old_logs}\nnew agent:\n{}",
            new.logs()
        );
        assert_eq!(report["ok"], Value::Bool(true), "{path}: {report}");
    }
    let new_logs = new.logs();
    for (agent, logs) in [("old", &old_logs), ("new", &new_logs)] {
        assert!(
            !logs.contains("repairing") && !logs.contains("drifted"),
            "the {agent} agent saw the other's redirection as damage:\n{logs}"
        );
    }
    let status = new.status().expect("status");
    assert!(mesh_pods_enrolled(&status), "{status:?}");
    let final_stats = status.proxy.expect("proxy stats");
    assert_eq!(final_stats.failed, 0, "{final_stats:?}\n{}", new.logs());
    eprintln!(
        "handover ({mode}, {layout:?}): mesh {mesh}, plaintext {plaintext}; old agent served {} outbound and {} inbound plaintext, new agent {} and {}",
        old_before.outbound_hbone,
        old_before.inbound_plaintext,
        final_stats.outbound_hbone,
        final_stats.inbound_plaintext
    );
    let exit = new.stop().expect("new agent stops");
    assert!(exit.success(), "{}", new.logs());
}

#[test]
fn agent_handover_fails_no_new_connection_in_ebpf_mode() {
    handover_without_failed_connections("ebpf", Layout::HostNetwork);
}

#[test]
fn agent_handover_fails_no_new_connection_in_iptables_mode() {
    handover_without_failed_connections("iptables", Layout::HostNetwork);
}

#[test]
fn daemonset_surge_rollout_fails_no_new_connection_in_ebpf_mode() {
    handover_without_failed_connections("ebpf", Layout::PodNetwork);
}

#[test]
fn daemonset_surge_rollout_fails_no_new_connection_in_iptables_mode() {
    handover_without_failed_connections("iptables", Layout::PodNetwork);
}

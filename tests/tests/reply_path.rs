//! The reply path of source preservation in the eBPF mode, on the real
//! kernel: an application answering a connection the proxy made from the
//! client's address gets its answers back to the proxy, while TC egress
//! looks up only the packets that can be such answers (pod flag
//! `REPLY_BY_MARK`: `tcp_fwmark_accept` on in the pod's netns marks the
//! application's end of every proxy connection).
//!
//! The end-to-end check is user-visible: long transfers through the proxy,
//! from the mesh (HBONE) and from outside it (plaintext), are echoed back
//! intact and closed cleanly (the client reads to EOF, so the application's
//! FIN made it back), and the application sees the client's address. The
//! kernel state behind it is asserted too: the sysctl and the pod's flag,
//! at enrolment, at unenrolment, and when an agent adopts a pod whose
//! sysctl was off.

use std::{net::IpAddr, time::Duration};

use serde_json::Value;
use shunt::api::{NodeStatus, PodState};
use shunt_common::PodConfig;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    apps::{EchoServer, TestApp},
    inspect, require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const FWMARK_ACCEPT: &str = "/proc/sys/net/ipv4/tcp_fwmark_accept";
const ARGS: [&str; 4] = ["--redirect", "ebpf", "--preserve-source", "on"];
/// Long enough for many windows of data and ACKs each way.
const LONG: &str = "8388608";

struct Bed {
    client: Pod,
    server: Pod,
    outsider: Pod,
    apps: Cgroup,
    topology: Topology,
}

/// One node: `client` and `server` in the mesh, `outsider` not.
fn bed(test: &str) -> Bed {
    require_root().expect("kernel tests need root");
    let (topology, pods) =
        Topology::single_node(test, &["client", "server", "outsider"]).expect("topology");
    let apps = Cgroup::create(&topology, "apps").expect("cgroup");
    Bed {
        client: pods[0].clone(),
        server: pods[1].clone(),
        outsider: pods[2].clone(),
        apps,
        topology,
    }
}

fn yaml(bed: &Bed, server_in_mesh: bool) -> String {
    workloads_yaml(&[
        WorkloadSpec::for_pod(&bed.client, true),
        WorkloadSpec::for_pod(&bed.server, server_in_mesh),
        WorkloadSpec::for_pod(&bed.outsider, false),
    ])
}

/// Whether both mesh pods are enrolled (named: an agent that has not
/// listed its pods yet has none to be pending).
fn mesh_pods_in(bed: &Bed) -> impl Fn(&NodeStatus) -> bool + '_ {
    |status| {
        [&bed.client, &bed.server].iter().all(|pod| {
            status
                .pods
                .iter()
                .any(|p| p.name == pod.name() && p.state == PodState::Enrolled)
        })
    }
}

fn fwmark_accept(pod: &Pod) -> String {
    pod.run(|| std::fs::read_to_string(FWMARK_ACCEPT))
        .expect("enter pod")
        .expect("read tcp_fwmark_accept")
        .trim()
        .to_string()
}

fn set_fwmark_accept(pod: &Pod, value: &str) {
    pod.run(|| std::fs::write(FWMARK_ACCEPT, value))
        .expect("enter pod")
        .expect("write tcp_fwmark_accept");
}

/// The settings the programs read for `pod`.
fn pod_flags(agent: &Agent, status: &NodeStatus, pod: &Pod) -> u32 {
    let cookie = status
        .pods
        .iter()
        .find(|p| p.name == pod.name())
        .and_then(|p| p.netns_cookie)
        .unwrap_or_else(|| panic!("no cookie for {} in {status:?}", pod.name()));
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("enrolment map");
    let slot = *entries.get(&cookie).expect("the pod's enrolment entry");
    inspect::slot_config(agent.pin_dir(), slot)
        .expect("settings")
        .flags
}

/// A long echo from the mesh client (HBONE) and one from the outsider
/// (plaintext through 15006) to the server's application: both intact,
/// read to EOF, and the application saw each client's own address.
fn exchanges_keep_the_clients_address(bed: &Bed, agent: &Agent) {
    let echo = EchoServer::on(&bed.server, 8080).expect("echo");
    let apps = TestApp::new(TESTAPP, &bed.apps);
    let to_server = format!("{}:8080", bed.server.ip());
    for (n, from) in [&bed.client, &bed.outsider].into_iter().enumerate() {
        let report = apps.run(from, &["connect", &to_server, "--send", LONG]);
        assert_eq!(
            report["intact"],
            Value::Bool(true),
            "from {}: {report}\n{}",
            from.name(),
            agent.logs()
        );
        let peers = echo.peers();
        assert_eq!(peers.len(), n + 1, "{peers:?}");
        assert_eq!(
            peers[n].ip(),
            IpAddr::V4(from.ip()),
            "the application sees {}'s address",
            from.name()
        );
    }
}

#[test]
fn enrolment_marks_accepted_connections_and_replies_reach_the_proxy() {
    let bed = bed("replymark");
    // A fresh namespace's default, which the agent changes.
    assert_eq!(fwmark_accept(&bed.server), "0");
    let node = bed.topology.node("node-a").expect("node").clone();
    let mut agent = Agent::start(&bed.topology, &node, &yaml(&bed, true), &ARGS).expect("agent");
    let status = agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_in(&bed))
        .expect("enrolled");
    assert_eq!(fwmark_accept(&bed.server), "1");
    let flags = pod_flags(&agent, &status, &bed.server);
    let wanted = PodConfig::REPLY_TO_PROXY | PodConfig::REPLY_BY_MARK;
    assert_eq!(flags & wanted, wanted, "flags {flags:#x}");

    exchanges_keep_the_clients_address(&bed, &agent);

    // Leaving the mesh leaves the sysctl on (`reply.rs` says why).
    agent.write_workloads(&yaml(&bed, false)).expect("rewrite");
    agent
        .wait_for("server unenrolled", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| p.name == bed.server.name() && p.state == PodState::NotInMesh)
        })
        .expect("unenrolled");
    assert_eq!(fwmark_accept(&bed.server), "1");
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

/// An agent adopting a pod whose `tcp_fwmark_accept` is off (as a pod
/// enrolled by an earlier release has it: its proxy may hold connections
/// the application accepted unmarked) turns the sysctl on but does not set
/// the flag; a pod whose sysctl stayed on keeps it. Replies flow either way.
#[test]
fn an_adopted_pod_whose_sysctl_was_off_is_looked_up_packet_by_packet() {
    let bed = bed("replyadopt");
    let node = bed.topology.node("node-a").expect("node").clone();
    let mut agent = Agent::start(&bed.topology, &node, &yaml(&bed, true), &ARGS).expect("agent");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_in(&bed))
        .expect("enrolled");
    agent.kill().expect("kill -9");
    set_fwmark_accept(&bed.server, "0");

    agent.restart(&ARGS).expect("restart");
    let status = agent
        .wait_for("mesh pods adopted", TIMEOUT, mesh_pods_in(&bed))
        .expect("adopted");
    assert_eq!(fwmark_accept(&bed.server), "1");
    let server = pod_flags(&agent, &status, &bed.server);
    assert_ne!(server & PodConfig::REPLY_TO_PROXY, 0, "flags {server:#x}");
    assert_eq!(server & PodConfig::REPLY_BY_MARK, 0, "flags {server:#x}");
    let client = pod_flags(&agent, &status, &bed.client);
    assert_ne!(client & PodConfig::REPLY_BY_MARK, 0, "flags {client:#x}");

    exchanges_keep_the_clients_address(&bed, &agent);
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

/// `tcp_fwmark_accept` turned off under an enrolled pod: the verifier
/// reports it, and the repair turns it back on and drops the flag for good
/// (sockets accepted meanwhile carry no mark). Replies flow throughout.
#[test]
fn turning_the_sysctl_off_under_an_enrolled_pod_drops_the_flag() {
    let bed = bed("replyoff");
    let node = bed.topology.node("node-a").expect("node").clone();
    let args = [&ARGS[..], &["--verify-interval", "1"]].concat();
    let mut agent = Agent::start(&bed.topology, &node, &yaml(&bed, true), &args).expect("agent");
    let status = agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_in(&bed))
        .expect("enrolled");
    let flags = pod_flags(&agent, &status, &bed.server);
    assert_ne!(flags & PodConfig::REPLY_BY_MARK, 0, "flags {flags:#x}");

    set_fwmark_accept(&bed.server, "0");
    let pin_dir = agent.pin_dir().to_path_buf();
    let cookie = status
        .pods
        .iter()
        .find(|p| p.name == bed.server.name())
        .and_then(|p| p.netns_cookie)
        .expect("cookie");
    let slot = *inspect::enrolled_entries(&pin_dir)
        .expect("map")
        .get(&cookie)
        .expect("entry");
    agent
        .wait_for("the repair: flag dropped, sysctl on", TIMEOUT, |_| {
            inspect::slot_config(&pin_dir, slot)
                .is_ok_and(|c| c.flags & PodConfig::REPLY_BY_MARK == 0)
                && fwmark_accept(&bed.server) == "1"
        })
        .expect("repaired");
    assert!(
        agent.logs().contains("tcp_fwmark_accept was turned off"),
        "{}",
        agent.logs()
    );

    exchanges_keep_the_clients_address(&bed, &agent);
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

/// More connections from one mesh client than the server pod has ephemeral
/// ports, over three of the application's ports: every one keeps the
/// client's address. The proxy's end of each closes first (the client
/// shuts its side, the proxy passes that on) and stays in TIME_WAIT,
/// holding its port for that destination. A port chosen at `connect`
/// (`IP_BIND_ADDRESS_NO_PORT`) is still free for the other destinations;
/// one chosen at `bind` was taken for all of them, so past the range the
/// fifth connection failed (no port for the client's address, nor for the
/// pod's own).
#[test]
fn the_clients_address_outlasts_the_server_pods_port_range() {
    const PORTS: [u16; 3] = [8080, 8081, 8082];
    const RANGE: &str = "40000 40003";
    let bed = bed("replyports");
    bed.server
        .run(|| std::fs::write("/proc/sys/net/ipv4/ip_local_port_range", RANGE))
        .expect("enter pod")
        .expect("narrow the server's port range");
    let node = bed.topology.node("node-a").expect("node").clone();
    let mut agent = Agent::start(&bed.topology, &node, &yaml(&bed, true), &ARGS).expect("agent");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_in(&bed))
        .expect("enrolled");
    let echoes: Vec<EchoServer> = PORTS
        .iter()
        .map(|&port| EchoServer::on(&bed.server, port).expect("echo"))
        .collect();
    let apps = TestApp::new(TESTAPP, &bed.apps);
    // Nine connections, three per port: more than the four ports.
    for round in 0..3 {
        for port in PORTS {
            let to = format!("{}:{port}", bed.server.ip());
            let report = apps.run(&bed.client, &["connect", &to, "--send", "64"]);
            assert_eq!(
                report["intact"],
                Value::Bool(true),
                "round {round}, port {port}: {report}\n{}",
                agent.logs()
            );
        }
    }
    for (echo, port) in echoes.iter().zip(PORTS) {
        let peers = echo.peers();
        assert_eq!(peers.len(), 3, "port {port}: {peers:?}");
        for peer in &peers {
            assert_eq!(
                peer.ip(),
                IpAddr::V4(bed.client.ip()),
                "port {port}: the application sees the client's address ({peers:?})\n{}",
                agent.logs()
            );
        }
    }
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

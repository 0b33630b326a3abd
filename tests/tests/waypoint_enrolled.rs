//! An enrolled waypoint on the real kernel (issue 21): "the waypoint
//! deployment itself may be enrolled". The waypoint pod is an ordinary
//! ambient pod here, so its node's agent serves its HBONE port and
//! captures what it connects to:
//!
//! - client → `web`'s VIP → (client's agent) HBONE to the waypoint pod,
//!   `:authority` the VIP → (the waypoint's agent) accepted because this pod
//!   is `web`'s waypoint, on to the pod's port for it (the service's target
//!   port) → the stand-in waypoint (`shunt-waypoint-forward`, the waypoint's
//!   application), which connects onwards to `web`'s VIP as a waypoint does;
//! - that connect is captured by the waypoint's agent, which sees the
//!   source is `web`'s waypoint itself (the from-waypoint exemption) and
//!   carries it to the server directly, over HBONE with the waypoint's
//!   identity — never back to the waypoint. Exactly one connection reaches
//!   the waypoint per client connection: no loop.
//!
//! And ztunnel's derived source: a client no agent knows (not in the
//! workloads file) connects to the server over HBONE with a `baggage`
//! header; the server's `istio_tcp_connections_opened_total` names the
//! source as the baggage describes it.

use std::{
    io::{BufRead, BufReader},
    net::{Ipv4Addr, SocketAddr},
    process::{Child, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::state::{SpiffeId, TrustDomain};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    access_log::{access_lines, wait_for_access_line},
    agent::{Agent, WorkloadSpec, http, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
    waypoint::{hbone_exchange, web_behind_waypoint},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const FORWARD: &str = env!("CARGO_BIN_EXE_shunt-waypoint-forward");
const TIMEOUT: Duration = Duration::from_secs(30);
const WEB_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 101, 1);
const WAYPOINT_VIP: Ipv4Addr = Ipv4Addr::new(198, 19, 101, 9);

fn identity(sa: &str) -> SpiffeId {
    SpiffeId::for_service_account(&TrustDomain::default(), "default", sa)
}

/// client and the waypoint (an ordinary ambient pod, enrolled) on node-a,
/// server on node-b; `web` (port 80 → 8080) bound to the waypoint.
fn workloads_file(pods: &[&Pod]) -> String {
    let specs: Vec<WorkloadSpec> = pods
        .iter()
        .map(|p| WorkloadSpec::for_pod(p, true))
        .collect();
    let mut yaml = workloads_yaml(&specs);
    yaml.push_str(&web_behind_waypoint(WEB_VIP, WAYPOINT_VIP, "service"));
    yaml
}

/// The stand-in waypoint's application, and the connections it accepted.
struct Forwarder {
    child: Child,
    accepted: Arc<Mutex<Vec<String>>>,
}

impl Forwarder {
    fn start(apps: &Cgroup, pod: &Pod, listen: SocketAddr, to: SocketAddr) -> Forwarder {
        let mut cmd = pod.command(FORWARD);
        cmd.args([listen.to_string(), to.to_string()])
            .stdout(Stdio::piped());
        apps.place(&mut cmd);
        let mut child = cmd.spawn().expect("start the stand-in waypoint");
        let stdout = child.stdout.take().expect("piped stdout");
        let accepted = Arc::new(Mutex::new(Vec::new()));
        let (listening_tx, listening_rx) = std::sync::mpsc::channel();
        let seen = accepted.clone();
        thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                let Ok(v) = serde_json::from_str::<Value>(&line) else {
                    continue;
                };
                if v.get("listening").is_some() {
                    let _ = listening_tx.send(());
                } else if let Some(peer) = v["accepted"].as_str() {
                    seen.lock().expect("lock").push(peer.to_string());
                }
            }
        });
        listening_rx
            .recv_timeout(TIMEOUT)
            .expect("the stand-in waypoint listens");
        Forwarder { child, accepted }
    }

    fn accepted(&self) -> Vec<String> {
        self.accepted.lock().expect("lock").clone()
    }

    /// Waits (bounded) until `n` connections reached it.
    fn wait_accepted(&self, n: usize) -> Vec<String> {
        let start = Instant::now();
        loop {
            let accepted = self.accepted();
            if accepted.len() >= n {
                return accepted;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "the waypoint accepted {accepted:?}, expected {n}"
            );
            thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        // Our own child, by its PID.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The inbound access lines of `agent` for CONNECTs with `authority` (a
/// VIP: only the waypoint accepts those), once there are `n` (bounded).
fn waypoint_connects(agent: &Agent, authority: &str, n: usize) -> Vec<Value> {
    let start = Instant::now();
    loop {
        let lines: Vec<Value> = access_lines(&agent.logs(), "inbound")
            .into_iter()
            .filter(|l| l["fields"]["dst.addr"] == authority)
            .collect();
        if lines.len() >= n || start.elapsed() > TIMEOUT {
            return lines;
        }
        thread::sleep(Duration::from_millis(100));
    }
}

fn enrolled_waypoint(mode: &str) {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(&format!("wpe-{mode}")).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let waypoint = topo.add_pod("node-a", "waypoint").expect("pod");
    let stranger = topo.add_pod("node-a", "stranger").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let cgroup = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &cgroup);
    // The stranger is in no workloads file: no agent knows its address.
    let yaml = workloads_file(&[&client, &waypoint, &server]);
    let args = ["--redirect", mode, "--log-format", "json"];
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let mut agent_a = Agent::start(&topo, &node_a, &yaml, &args).expect("agent a");
    let mut agent_b = Agent::start(&topo, &node_b, &yaml, &args).expect("agent b");
    for agent in [&mut agent_a, &mut agent_b] {
        agent
            .wait_for("every ambient pod enrolled", TIMEOUT, mesh_pods_enrolled)
            .unwrap_or_else(|e| panic!("{e}\n{}", agent.logs()));
    }
    let server_app = EchoServer::on(&server, 8080).expect("echo");
    let to_vip = SocketAddr::from((WEB_VIP, 80));
    let forwarder = Forwarder::start(
        &cgroup,
        &waypoint,
        SocketAddr::from((waypoint.ip(), 8080)),
        to_vip,
    );
    let waypoint_id = identity("sa-waypoint");

    for n in 1..=2 {
        let report = apps.run(
            &client,
            &["connect", &to_vip.to_string(), "--send", "65536"],
        );
        assert_eq!(
            report["intact"],
            Value::Bool(true),
            "connection {n}: {report}\n{}",
            agent_a.logs()
        );
        let accepted = forwarder.wait_accepted(n);
        assert_eq!(
            accepted.len(),
            n,
            "exactly one connection reaches the waypoint per client connection (no loop): {accepted:?}"
        );
        assert!(
            accepted[n - 1].starts_with(&format!("{}:", client.ip())),
            "the waypoint's agent hands it the client's connection: {accepted:?}"
        );
    }
    // The waypoint's agent accepted the client's CONNECTs (authority the
    // VIP) as web's waypoint, and no other CONNECT for the VIP.
    let connects = waypoint_connects(&agent_a, &to_vip.to_string(), 2);
    assert_eq!(
        connects.len(),
        2,
        "one CONNECT to the waypoint per client connection: {connects:?}"
    );
    assert!(
        connects.iter().all(|l| {
            l["fields"]["src.identity"] == identity("sa-client").as_str()
                && l["fields"]["result"] == "success"
        }),
        "every CONNECT to the waypoint came from the client, none from the waypoint itself: {connects:?}"
    );
    // The waypoint's own connect went to the server directly.
    wait_for_access_line(
        &agent_a,
        "outbound",
        "the waypoint's connect to the VIP went to the server, not back to the waypoint",
        |l| {
            l["fields"]["dst.service"] == "web.default.svc.cluster.local"
                && l["fields"]["src.identity"] == waypoint_id.as_str()
                && l["fields"]["dst.identity"] == identity("sa-server").as_str()
                && l["fields"]["result"] == "success"
        },
    );
    let peers = server_app.peers();
    assert_eq!(peers.len(), 2, "the server got both connections");
    assert!(
        peers.iter().all(|p| p.ip() == waypoint.ip()),
        "from the waypoint: {peers:?}"
    );
    let to_server = format!("{}:8080", server.ip());
    wait_for_access_line(
        &agent_b,
        "inbound",
        "the server's agent saw the waypoint's identity as the peer",
        |l| {
            l["fields"]["src.identity"] == waypoint_id.as_str()
                && l["fields"]["dst.addr"] == to_server.as_str()
                && l["fields"]["result"] == "success"
        },
    );

    derived_source_from_baggage(&agent_a, &agent_b, &stranger, &server);

    drop(forwarder);
    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

/// A client whose address the server's agent does not know, with ztunnel's
/// `baggage`: the server's metrics name the source as the baggage says.
fn derived_source_from_baggage(agent_a: &Agent, agent_b: &Agent, stranger: &Pod, server: &Pod) {
    let payload = vec![7u8; 4096];
    let baggage = "k8s.cluster.name=east,k8s.namespace.name=shop,k8s.deployment.name=productpage-v1,service.name=productpage,service.version=v1";
    let echoed = hbone_exchange(
        stranger,
        agent_a.ca_dir(),
        (&identity("sa-stranger"), &identity("sa-server")),
        SocketAddr::from((server.ip(), 8080)),
        &[("baggage", baggage)],
        &payload,
    )
    .unwrap_or_else(|e| panic!("{e}\n{}", agent_b.logs()));
    assert_eq!(echoed, payload, "the server echoed the stranger's bytes");
    let node_b = server.node();
    let labels = [
        "reporter=\"destination\"",
        "source_workload=\"productpage-v1\"",
        "source_canonical_service=\"productpage\"",
        "source_canonical_revision=\"v1\"",
        "source_workload_namespace=\"shop\"",
        "source_app=\"productpage-v1\"",
        "source_version=\"v1\"",
        "source_cluster=\"east\"",
        "destination_workload=\"server\"",
    ];
    let principal = format!("source_principal=\"{}\"", identity("sa-stranger"));
    let start = Instant::now();
    loop {
        let (code, metrics) = http(
            node_b,
            "GET",
            agent_b.endpoints().metrics.port(),
            "/metrics",
        )
        .expect("metrics");
        assert_eq!(code, 200);
        let found = metrics.lines().any(|l| {
            l.starts_with("istio_tcp_connections_opened_total{")
                && l.contains(&principal)
                && labels.iter().all(|m| l.contains(m))
        });
        if found {
            return;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "no istio_tcp_connections_opened_total with the baggage's source labels and {principal}:\n{}",
            metrics
                .lines()
                .filter(|l| l.starts_with("istio_tcp_connections_opened_total{"))
                .collect::<Vec<_>>()
                .join("\n")
        );
        thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn an_enrolled_waypoint_forwards_to_the_workload_not_back_to_itself_in_ebpf_mode() {
    enrolled_waypoint("ebpf");
}

#[test]
fn an_enrolled_waypoint_forwards_to_the_workload_not_back_to_itself_in_iptables_mode() {
    enrolled_waypoint("iptables");
}

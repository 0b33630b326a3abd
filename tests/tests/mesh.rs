//! The whole node, end to end, in both redirection modes: real agents (one
//! per node, sharing a trust root), real redirection, real HBONE between
//! them, real application processes. Nothing stands in for anything.

use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::admin::{NodeStatus, PodState};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);

/// Echoes every connection; records each peer address.
struct Echo {
    peers: Arc<Mutex<Vec<SocketAddr>>>,
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Echo {
    fn start(pod: &Pod, port: u16) -> Echo {
        let listener: TcpListener = pod
            .listen_tcp(SocketAddr::from((pod.ip(), port)))
            .expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        let peers = Arc::new(Mutex::new(Vec::new()));
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let (peers, stop) = (peers.clone(), stop.clone());
            thread::spawn(move || {
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(300) {
                    match listener.accept() {
                        Ok((stream, peer)) => {
                            peers.lock().expect("lock").push(peer);
                            thread::spawn(move || echo(stream));
                        }
                        Err(_) => thread::sleep(Duration::from_millis(5)),
                    }
                }
            })
        };
        Echo {
            peers,
            stop,
            thread: Some(thread),
        }
    }

    fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("lock").clone()
    }
}

impl Drop for Echo {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

fn echo(mut stream: TcpStream) {
    let _ = stream.set_nonblocking(false);
    let _ = stream.set_read_timeout(Some(TIMEOUT));
    let mut buf = [0u8; 64 * 1024];
    while let Ok(n) = stream.read(&mut buf) {
        if n == 0 || stream.write_all(&buf[..n]).is_err() {
            break;
        }
    }
}

fn app(apps: &Cgroup, pod: &Pod, args: &[&str]) -> Value {
    let mut cmd = pod.command(TESTAPP);
    cmd.args(args);
    apps.place(&mut cmd);
    let out = cmd.output().expect("run testapp");
    let stdout = String::from_utf8_lossy(&out.stdout);
    serde_json::from_str(stdout.lines().last().unwrap_or("{}"))
        .unwrap_or_else(|e| panic!("testapp printed {stdout:?}: {e}"))
}

fn all_enrolled(status: &NodeStatus) -> bool {
    status
        .pods
        .iter()
        .filter(|p| p.dataplane_mode == "ambient")
        .all(|p| p.state == PodState::Enrolled)
}

fn proxy_stat(agent: &Agent, pick: impl Fn(&shunt::proxy::ProxyStats) -> u64) -> u64 {
    agent
        .status()
        .expect("status")
        .proxy
        .map(|p| pick(&p))
        .unwrap_or(0)
}

fn mesh_end_to_end(mode: &str) {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(&format!("mesh-{mode}")).expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let neighbour = topo.add_pod("node-a", "neighbour").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let outsider = topo.add_pod("node-b", "outsider").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&neighbour, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    let args = ["--redirect", mode];
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let mut agent_a = Agent::start(&topo, &node_a, &yaml, &args).expect("agent a");
    let mut agent_b = Agent::start(&topo, &node_b, &yaml, &args).expect("agent b");
    for agent in [&mut agent_a, &mut agent_b] {
        let status = agent
            .wait_for("mesh pods enrolled", TIMEOUT, all_enrolled)
            .expect("enrolled");
        assert_eq!(status.mode, mode);
    }
    let server_app = Echo::start(&server, 8080);
    let neighbour_app = Echo::start(&neighbour, 8080);
    let outsider_app = Echo::start(&outsider, 8080);

    // Cross-node, mesh to mesh: HBONE from node-a's proxy to node-b's.
    let to_server = format!("{}:8080", server.ip());
    let report = app(
        &apps,
        &client,
        &["connect", &to_server, "--send", "1048576"],
    );
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{report}\n{}",
        agent_a.logs()
    );
    assert!(proxy_stat(&agent_a, |p| p.outbound_hbone) >= 1);
    assert!(proxy_stat(&agent_b, |p| p.inbound_hbone) >= 1);
    assert_eq!(server_app.peers().len(), 1);

    // Same node, mesh to mesh: still HBONE, through the inbound checks.
    let to_neighbour = format!("{}:8080", neighbour.ip());
    let report = app(
        &apps,
        &client,
        &["connect", &to_neighbour, "--send", "65536"],
    );
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(proxy_stat(&agent_a, |p| p.inbound_hbone) >= 1);
    assert_eq!(neighbour_app.peers().len(), 1);

    // Mesh to a pod outside the mesh: plain TCP from the client's own IP.
    let to_outsider = format!("{}:8080", outsider.ip());
    let report = app(
        &apps,
        &client,
        &["connect", &to_outsider, "--send", "65536"],
    );
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(proxy_stat(&agent_a, |p| p.outbound_passthrough) >= 1);
    let peers = outsider_app.peers();
    assert_eq!(peers.len(), 1);
    assert_eq!(
        peers[0].ip(),
        IpAddr::V4(client.ip()),
        "passthrough keeps the pod's IP"
    );

    // From outside the mesh to a mesh pod: inbound plaintext through 15006.
    let report = app(
        &apps,
        &outsider,
        &["connect", &to_server, "--send", "65536"],
    );
    assert_eq!(report["intact"], Value::Bool(true), "{report}");
    assert!(proxy_stat(&agent_b, |p| p.inbound_plaintext) >= 1);
    assert_eq!(server_app.peers().len(), 2);

    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

#[test]
fn mesh_traffic_flows_through_hbone_in_ebpf_mode() {
    mesh_end_to_end("ebpf");
}

#[test]
fn mesh_traffic_flows_through_hbone_in_iptables_mode() {
    mesh_end_to_end("iptables");
}

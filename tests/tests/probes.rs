//! Kubelet's probes under a policy that refuses every other plaintext
//! client (issue 36 item 2): with `--node-netns`, TCP that a socket of the
//! node's netns (where kubelet runs) opens to an enrolled pod gets Istio's
//! probe source 169.254.7.127 and reaches the application — a TCP connect
//! probe and an HTTP GET, from the node's netns, as kubelet sends them —
//! while a plaintext connection from another pod is still refused
//! (`--inbound-plaintext deny`, what STRICT mTLS does to plaintext). The
//! agent runs in a pod netns of its own (the DaemonSet's layout), so the
//! node's rules are made from outside it. `--on-exit uninstall` removes
//! them again.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    path::Path,
    process::{Command, Stdio},
    sync::{Arc, Mutex},
    thread,
    time::Duration,
};

use serde_json::Value;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, AgentNetns, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{TestApp, ok},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const APP_PORT: u16 = 8080;
const PROBE_SOURCE: &str = "169.254.7.127";

/// The application: an HTTP/1.1 server on the pod's IP that answers
/// `GET /healthz` with 200 and records each connection's peer (a TCP probe
/// connects and closes without a request).
struct HealthServer {
    peers: Arc<Mutex<Vec<SocketAddr>>>,
}

impl HealthServer {
    fn on(pod: &Pod) -> HealthServer {
        let listener: TcpListener = pod
            .listen_tcp(SocketAddr::from((pod.ip(), APP_PORT)))
            .expect("listen in the server pod");
        let peers = Arc::new(Mutex::new(Vec::new()));
        let seen = peers.clone();
        thread::spawn(move || {
            for stream in listener.incoming() {
                let Ok(mut stream) = stream else { return };
                if let Ok(peer) = stream.peer_addr() {
                    seen.lock().expect("peers").push(peer);
                }
                thread::spawn(move || {
                    let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    // Bounded: a request's headers, or EOF.
                    while request.len() < 16 * 1024 && !request.ends_with(b"\r\n\r\n") {
                        match stream.read(&mut buf) {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let _ = stream.write_all(
                        b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nConnection: close\r\n\r\nok",
                    );
                });
            }
        });
        HealthServer { peers }
    }

    fn peers(&self) -> Vec<SocketAddr> {
        self.peers.lock().expect("peers").clone()
    }
}

/// A program run in the node's netns, in `cgroup` (kubelet's processes
/// live below the cgroup root the socket programs attach to).
fn on_node(topo: &Topology, cgroup: &Cgroup, program: &str, args: &[&str]) -> (bool, String) {
    let node = topo.node("node-a").expect("node");
    let mut cmd = node.command("timeout");
    cmd.arg("10").arg(program).args(args);
    cmd.stdin(Stdio::null());
    let out = cgroup.place(&mut cmd).output().expect("run on the node");
    (
        out.status.success(),
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        ),
    )
}

/// The node's nat table, as `iptables-save` prints it.
fn node_nat(node_netns: &Path) -> String {
    let mut net = std::ffi::OsString::from("--net=");
    net.push(node_netns);
    let out = Command::new("nsenter")
        .arg(net)
        .args(["--", "iptables-save", "-c", "-t", "nat"])
        .output()
        .expect("iptables-save");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn probes_pass_a_policy_that_refuses_plaintext(mode: &str) {
    require_root().expect("kernel tests need root");
    let (mut topo, pods) =
        Topology::single_node(&format!("probe-{mode}"), &["server", "outsider"]).expect("topology");
    let [server, outsider] = [pods[0].clone(), pods[1].clone()];
    let node = server.node().clone();
    let node_netns = node.netns_path();
    let apps = Cgroup::create(&topo, "apps").expect("apps cgroup");
    let kubelet = Cgroup::create(&topo, "kubelet").expect("kubelet cgroup");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    let agent_pod = topo.add_pod(node.name(), "shunt").expect("agent pod");
    let node_netns_arg = node_netns.display().to_string();
    let mut agent = Agent::start_in(
        &topo,
        &node,
        AgentNetns::Pod(agent_pod),
        &yaml,
        &[
            "--redirect",
            mode,
            "--inbound-plaintext",
            "deny",
            "--node-netns",
            &node_netns_arg,
            "--on-exit",
            "uninstall",
        ],
        &[],
    )
    .expect("agent");
    agent
        .wait_for("the server enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    let app = HealthServer::on(&server);
    let target = format!("{}:{APP_PORT}", server.ip());

    // Another pod's plaintext connection: refused, the application never
    // sees it.
    let report = TestApp::new(TESTAPP, &apps).run(&outsider, &["connect", &target, "--send", "16"]);
    assert!(
        !ok(&report) || report["received"] == Value::Null,
        "plaintext from another pod got through: {report}"
    );
    assert!(
        app.peers().is_empty(),
        "the application saw {:?}",
        app.peers()
    );

    // Kubelet's TCP probe: a connect from the node's netns.
    let script = format!("exec 3<>/dev/tcp/{}/{APP_PORT}", server.ip());
    let (connected, output) = on_node(&topo, &kubelet, "bash", &["-c", &script]);
    assert!(
        connected,
        "TCP probe from the node: {output}\n{}",
        agent.logs()
    );
    // Kubelet's HTTP probe.
    let url = format!("http://{target}/healthz");
    let (got, body) = on_node(&topo, &kubelet, "curl", &["-sS", "--max-time", "5", &url]);
    assert!(
        got && body == "ok",
        "HTTP probe from the node: {body}\n{}",
        agent.logs()
    );
    let peers = app.peers();
    assert_eq!(peers.len(), 2, "{peers:?}");
    assert!(
        peers.iter().all(|p| p.ip().to_string() == PROBE_SOURCE),
        "the application sees the probes from {PROBE_SOURCE}: {peers:?}"
    );

    // Counted where an operator looks.
    if mode == "ebpf" {
        let (connections, packets) =
            shunt_testbed::inspect::host_probe_stats(agent.pin_dir()).expect("probe counters");
        assert_eq!(connections, 2, "the node's two connections recorded");
        assert!(
            packets >= 4,
            "both ways of both connections rewritten: {packets}"
        );
    }
    if mode == "iptables" {
        let nat = node_nat(&node_netns);
        let rule = nat
            .lines()
            .find(|l| {
                l.contains(&format!("-d {}/32", server.ip())) && l.contains("SHUNT_PROBE_SNAT")
            })
            .unwrap_or_else(|| panic!("the node's probe rule for the server:\n{nat}"));
        assert!(!rule.starts_with("[0:"), "its counters moved: {rule}");
    }

    // Uninstall: the node's rules (iptables) or the pins (eBPF) go too.
    let pin_dir = agent.pin_dir().to_path_buf();
    agent.stop().expect("agent stopped");
    if mode == "iptables" {
        let nat = node_nat(&node_netns);
        assert!(!nat.contains("SHUNT_PROBE_SNAT"), "{nat}");
    } else {
        assert!(!pin_dir.exists(), "{} removed", pin_dir.display());
    }
}

#[test]
fn kubelet_probes_reach_the_app_under_a_refusing_policy_in_ebpf_mode() {
    probes_pass_a_policy_that_refuses_plaintext("ebpf");
}

#[test]
fn kubelet_probes_reach_the_app_under_a_refusing_policy_in_iptables_mode() {
    probes_pass_a_policy_that_refuses_plaintext("iptables");
}

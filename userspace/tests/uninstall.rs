//! Uninstall vs upgrade (issue 36 item 3): the `shunt agent` binary with
//! `--on-exit auto`, its pods from the in-test API server
//! (`support/fake_apiserver.rs`), decides at SIGTERM as istio-cni does.
//!
//! - Its DaemonSet deleted (or no longer selecting the node): every pod is
//!   unenrolled, the socket programs leave the cgroup root, the pins and
//!   the TC filters or iptables rules are gone, and the pod reaches its peer
//!   directly.
//! - Its DaemonSet present: an upgrade; the pod stays captured (its
//!   connects meet the absent proxy and fail closed) and every pin and
//!   program stays for the next agent (the handover tests, tests/tests/
//!   handover.rs, show the next agent takes over without a failed
//!   connection).
//!
//! The agent runs in the test's own netns on free loopback ports (as in
//! kube_watch.rs), the pods are testbed netns with a process each (found
//! through /proc), the peer is an echo server in a pod outside the mesh.

#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;
#[path = "support/loopback.rs"]
mod loopback;

use std::{
    path::{Path, PathBuf},
    process::{Child, Command, Stdio},
    time::{Duration, Instant},
};

use fake_apiserver::{FakeApiServer, Kind, namespace, pod};
use serde_json::{Value, json};
use shunt::control::kube::pod::REDIRECTION_ANNOTATION;
use shunt_testbed::{Cgroup, Topology, apps::EchoServer, inspect, require_root};

const NODE: &str = "node-a";
const DS_NAMESPACE: &str = "shunt-system";
const DS_NAME: &str = "shunt";
const MESH_NS: &str = "shop";
const PEER_PORT: u16 = 8080;
const TIMEOUT: Duration = Duration::from_secs(30);

/// What happens to the DaemonSet before the agent gets SIGTERM.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Before {
    /// `kubectl delete daemonset` / `helm uninstall`.
    DeleteDaemonSet,
    /// The Node's label no longer matches the DaemonSet's nodeSelector.
    UnlabelNode,
    /// Nothing: a rollout (`kubectl rollout restart`, a new image).
    Nothing,
}

/// Kills (by its PID) and reaps a child process when dropped.
struct ChildGuard(Child);

impl Drop for ChildGuard {
    fn drop(&mut self) {
        if let Ok(None) = self.0.try_wait() {
            let _ = self.0.kill();
            let _ = self.0.wait();
        }
    }
}

/// A pin dir removed when dropped (also on panic): removing the pins of
/// an agent that kept them detaches its links.
struct PinDir(PathBuf);

impl Drop for PinDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct Bed {
    server: FakeApiServer,
    dir: tempfile::TempDir,
    apps: Cgroup,
    _peer_app: EchoServer,
    // Dropped in this order: processes, then their cgroups, then pins,
    // then the topology (the pods' netns).
    _client_process: ChildGuard,
    _client_cgroup: Cgroup,
    pin_dir: PinDir,
    topo: Topology,
}

impl Bed {
    async fn start(test: &str) -> Bed {
        require_root().expect("kernel tests need root");
        let mut topo = Topology::new(test).expect("topology");
        topo.add_node(NODE).expect("node");
        topo.add_pod(NODE, "client").expect("pod");
        topo.add_pod(NODE, "peer").expect("pod");
        let pin_dir = PinDir(PathBuf::from(format!(
            "/sys/fs/bpf/{}-agent",
            topo.prefix()
        )));
        let apps = Cgroup::create(&topo, "apps").expect("apps cgroup");
        let server = FakeApiServer::start().await;
        let dir = tempfile::tempdir().expect("temp dir");

        // The client: a process in the pod's netns, in a cgroup named after
        // the pod's UID (how the agent finds its netns through /proc).
        // Unique per test: the agents of tests running side by side scan
        // the same /proc.
        static NEXT: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let uid = format!("{:08x}-0000-4000-8000-{n:012x}", std::process::id());
        let client_cgroup = Cgroup::create(&topo, &format!("pod{uid}")).expect("pod cgroup");
        let client = topo.pod("client").expect("client").clone();
        let mut sleep = client.command("sleep");
        sleep.arg("300");
        let client_process = ChildGuard(
            client_cgroup
                .place(&mut sleep)
                .spawn()
                .expect("start the client's process"),
        );
        let peer = topo.pod("peer").expect("peer").clone();
        let peer_app = EchoServer::on(&peer, PEER_PORT).expect("echo server");

        server.apply(
            Kind::Namespace,
            namespace(MESH_NS, json!({"istio.io/dataplane-mode": "ambient"})),
        );
        server.apply(Kind::Namespace, namespace("plain", json!({})));
        let mut object = pod(
            MESH_NS,
            "client",
            NODE,
            Some(&client.ip().to_string()),
            json!({}),
        );
        object["metadata"]["uid"] = json!(uid);
        server.apply(Kind::Pod, object);
        server.apply(
            Kind::Pod,
            pod(
                "plain",
                "peer",
                NODE,
                Some(&peer.ip().to_string()),
                json!({}),
            ),
        );
        server.apply(
            Kind::Node,
            json!({"metadata": {"name": NODE, "labels": {"kubernetes.io/os": "linux", "shunt.io/node": "on"}}}),
        );
        server.apply(Kind::DaemonSet, daemonset());
        Bed {
            server,
            dir,
            apps,
            _peer_app: peer_app,
            _client_process: client_process,
            _client_cgroup: client_cgroup,
            pin_dir,
            topo,
        }
    }

    fn netns(&self, pod: &str) -> PathBuf {
        self.topo.pod(pod).expect("testbed pod").netns_path()
    }

    /// The agent binary, as the DaemonSet runs it (`--on-exit auto`, its
    /// DaemonSet's name and namespace), on this test's pins and cgroup.
    fn start_agent(&self, mode: &str) -> (ChildGuard, PathBuf) {
        let kubeconfig = self.server.write_kubeconfig(self.dir.path());
        let free_port = loopback::private_addr;
        let log_path = self.dir.path().join("agent.log");
        let log = std::fs::File::create(&log_path).expect("log file");
        let child = Command::new(env!("CARGO_BIN_EXE_shunt"))
            .arg("agent")
            .args(["--redirect", mode, "--log-level", "info,shunt=debug"])
            .args(["--on-exit", "auto", "--cri-socket", "none"])
            // Captured connects go to the proxy (the passthrough fast path
            // would send this peer, outside the mesh, direct in the kernel).
            .args(["--fast-path", "off"])
            .arg("--bpf-pin-dir")
            .arg(&self.pin_dir.0)
            .arg("--cgroup-root")
            .arg(self.topo.cgroup_root().expect("topology cgroup"))
            .arg("--admin-addr")
            .arg(free_port().to_string())
            .arg("--metrics-addr")
            .arg(free_port().to_string())
            .arg("--readiness-addr")
            .arg(free_port().to_string())
            .arg("--ca-dir")
            .arg(self.dir.path().join("ca"))
            .env("NODE_NAME", NODE)
            .env("DAEMONSET_NAME", DS_NAME)
            .env("DAEMONSET_NAMESPACE", DS_NAMESPACE)
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start shunt agent");
        (ChildGuard(child), log_path)
    }

    fn annotation(&self) -> Option<String> {
        self.server
            .object(Kind::Pod, MESH_NS, "client")
            .and_then(|p| {
                p["metadata"]["annotations"][REDIRECTION_ANNOTATION]
                    .as_str()
                    .map(str::to_owned)
            })
    }

    /// Whether the client, from its pod and a cgroup below the agent's
    /// cgroup root, opens a connection to the peer's echo server and gets
    /// its line back.
    fn client_reaches_peer(&self) -> bool {
        let peer = self.topo.pod("peer").expect("peer").ip();
        let script = format!(
            "exec 3<>/dev/tcp/{peer}/{PEER_PORT} && echo hello >&3 && read -t 5 line <&3 && [ \"$line\" = hello ]"
        );
        let mut cmd = self.topo.pod("client").expect("client").command("timeout");
        cmd.args(["10", "bash", "-c", &script])
            .stdout(Stdio::null())
            .stderr(Stdio::null());
        self.apps
            .place(&mut cmd)
            .status()
            .expect("run bash in the client pod")
            .success()
    }

    /// The programs attached to the topology's cgroup root, as `bpftool
    /// cgroup show` lists them.
    fn cgroup_programs(&self) -> Vec<Value> {
        let root = self.topo.cgroup_root().expect("topology cgroup");
        let out = Command::new("bpftool")
            .args(["-j", "cgroup", "show"])
            .arg(&root)
            .output()
            .expect("bpftool");
        assert!(out.status.success(), "bpftool cgroup show {root:?} failed");
        let text = String::from_utf8_lossy(&out.stdout);
        if text.trim().is_empty() {
            return Vec::new();
        }
        serde_json::from_str::<Vec<Value>>(&text).expect("bpftool's JSON")
    }
}

fn daemonset() -> Value {
    json!({
        "metadata": {"name": DS_NAME, "namespace": DS_NAMESPACE},
        "spec": {
            "selector": {"matchLabels": {"app": "shunt"}},
            "template": {
                "metadata": {"labels": {"app": "shunt"}},
                "spec": {
                    "nodeSelector": {"kubernetes.io/os": "linux", "shunt.io/node": "on"},
                    "containers": [{"name": "agent", "image": "shunt:dev"}]
                }
            }
        }
    })
}

/// Whether the pod's eth0 has any TC filter (ingress or egress).
fn tc_filters_present(netns: &Path) -> bool {
    ["ingress", "egress"].iter().any(|hook| {
        inspect::tc_filters(netns, "eth0", hook).is_ok_and(|filters| !filters.is_empty())
    })
}

/// The pod netns's nat table, as `iptables-save` prints it.
fn nat_rules(netns: &Path) -> String {
    let mut net = std::ffi::OsString::from("--net=");
    net.push(netns);
    let out = Command::new("nsenter")
        .arg(net)
        .args(["--", "iptables-save", "-t", "nat"])
        .output()
        .expect("iptables-save");
    String::from_utf8_lossy(&out.stdout).into_owned()
}

fn redirected(mode: &str, netns: &Path) -> bool {
    match mode {
        "ebpf" => tc_filters_present(netns),
        _ => nat_rules(netns).contains("--to-ports 15001"),
    }
}

async fn sigterm_after(test: &str, mode: &str, before: Before) {
    let bed = Bed::start(test).await;
    let (mut agent, log_path) = bed.start_agent(mode);
    let agent_log = || std::fs::read_to_string(&log_path).unwrap_or_default();
    let client_netns = bed.netns("client");
    let start = Instant::now();
    while !(bed.annotation().as_deref() == Some("enabled") && redirected(mode, &client_netns)) {
        assert!(
            start.elapsed() < TIMEOUT,
            "the agent did not enrol the client within {TIMEOUT:?}; its log:\n{}",
            agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(
        bed.client_reaches_peer(),
        "through the agent's proxy; log:\n{}",
        agent_log()
    );
    if mode == "ebpf" {
        assert!(
            !bed.cgroup_programs().is_empty(),
            "socket programs on the cgroup root"
        );
    }
    if mode == "ebpf" {
        assert!(bed.pin_dir.0.exists(), "the agent pinned its state");
    }

    match before {
        Before::DeleteDaemonSet => bed.server.delete(Kind::DaemonSet, DS_NAMESPACE, DS_NAME),
        Before::UnlabelNode => bed.server.update(Kind::Node, "", NODE, |node| {
            node["metadata"]["labels"]["shunt.io/node"] = json!("off")
        }),
        Before::Nothing => {}
    }
    let pid = nix::unistd::Pid::from_raw(agent.0.id() as i32);
    nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM).expect("SIGTERM");
    let start = Instant::now();
    let exit = loop {
        if let Some(exit) = agent.0.try_wait().expect("wait") {
            break exit;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "agent still running after SIGTERM:\n{}",
            agent_log()
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    assert!(exit.success(), "agent exit {exit:?}; log:\n{}", agent_log());

    let uninstalled = before != Before::Nothing;
    let log = agent_log();
    assert_eq!(
        log.contains("an uninstall; removing everything from the node"),
        uninstalled,
        "the agent's decision; log:\n{log}"
    );
    assert_eq!(
        redirected(mode, &client_netns),
        !uninstalled,
        "the client's redirection (TC filters or nat rules); log:\n{log}"
    );
    if mode == "ebpf" {
        assert_eq!(
            bed.pin_dir.0.exists(),
            !uninstalled,
            "the pin dir {}; log:\n{log}",
            bed.pin_dir.0.display()
        );
        assert_eq!(
            bed.cgroup_programs().is_empty(),
            uninstalled,
            "socket programs on the cgroup root: {:?}",
            bed.cgroup_programs()
        );
    }
    // What the pod sees: after an uninstall it reaches its peer directly;
    // after an upgrade it is still captured and, with no proxy until the
    // next agent starts, fails closed.
    assert_eq!(
        bed.client_reaches_peer(),
        uninstalled,
        "the client's connection to its peer after the agent exited"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_daemonset_uninstalls_at_sigterm_in_ebpf_mode() {
    sigterm_after("uninst-del-ebpf", "ebpf", Before::DeleteDaemonSet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_daemonset_uninstalls_at_sigterm_in_iptables_mode() {
    sigterm_after("uninst-del-ipt", "iptables", Before::DeleteDaemonSet).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_no_longer_selected_uninstalls_at_sigterm() {
    sigterm_after("uninst-sel-ebpf", "ebpf", Before::UnlabelNode).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_present_daemonset_keeps_pods_captured_at_sigterm_in_ebpf_mode() {
    sigterm_after("uninst-keep-ebpf", "ebpf", Before::Nothing).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_present_daemonset_keeps_pods_captured_at_sigterm_in_iptables_mode() {
    sigterm_after("uninst-keep-ipt", "iptables", Before::Nothing).await;
}

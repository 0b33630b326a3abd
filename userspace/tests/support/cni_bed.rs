//! The CNI plugin's bed: a testbed topology (node-a runs containerd and the
//! agent; node-b holds `peer`, a mesh pod whose HBONE port is an in-test
//! HBONE terminator and whose port 9000 answers plaintext), the in-test
//! API server, and the `shunt agent` binary serving `--cni-socket`,
//! chaining shunt-cni into containerd's CNI configuration.

#![allow(dead_code)]

#[path = "loopback.rs"]
mod loopback;

use std::{
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use bytes::Bytes;
use serde_json::{Value, json};
use shunt::{
    api::NodeStatus,
    state::{SpiffeId, TrustDomain},
};
use shunt_testbed::{Cgroup, Pod, Topology, hbone, require_root};
use tokio::sync::mpsc;

use super::containerd::{CniNetwork, Containerd};
use super::fake_apiserver::{FakeApiServer, Kind, namespace, pod};

pub const NODE: &str = "node-a";
pub const MESH_NS: &str = "shop";
pub const PLAIN_NS: &str = "plain";
pub const PEER_PORT: u16 = 9000;
pub const TIMEOUT: Duration = Duration::from_secs(30);

/// What the peer's HBONE terminator received on one CONNECT.
#[derive(Debug)]
pub struct Received {
    pub authority: String,
    pub client_identity: Option<String>,
    pub bytes: Vec<u8>,
}

pub struct CniBed {
    pub api: FakeApiServer,
    pub agent: Option<Child>,
    pub admin: SocketAddr,
    pub agent_log: PathBuf,
    pub cni_socket: PathBuf,
    pub ca_dir: PathBuf,
    pub ctd: Option<Containerd>,
    pub peer: Pod,
    pub received: mpsc::UnboundedReceiver<Received>,
    pub dir: tempfile::TempDir,
    _cgroup: Cgroup,
    /// Where runc puts the sandboxes' and containers' cgroups (the kubelet's
    /// `cgroup_parent`): below the agent's `--cgroup-root`, so that the
    /// socket programs see their sockets.
    pods_cgroup: Cgroup,
    pin_dir: PathBuf,
    // Dropped last: the namespaces.
    pub topo: Topology,
}

/// The agent's arguments for the mode under test.
pub fn agent_args(mode: &str) -> Vec<String> {
    match mode {
        "ztunnel" => vec![
            "--redirect".into(),
            "ebpf".into(),
            "--proxy".into(),
            "ztunnel".into(),
        ],
        other => vec!["--redirect".into(), other.into()],
    }
}

impl CniBed {
    /// Everything up, the agent started with `extra` arguments; returns once
    /// shunt-cni is in containerd's CNI configuration.
    pub async fn start(test: &str, extra: &[String]) -> CniBed {
        Self::start_with(test, extra, true).await
    }

    /// As [`CniBed::start`]; without `cni` the agent neither serves the
    /// plugin nor chains it (today's watch-driven capture).
    pub async fn start_with(test: &str, extra: &[String], cni: bool) -> CniBed {
        require_root().expect("these tests create namespaces and run containerd: run as root");
        let mut topo = Topology::new(test).expect("topology");
        let node = topo.add_node(NODE).expect("node");
        topo.add_node("node-b").expect("node");
        let peer = topo.add_pod("node-b", "peer").expect("pod");
        let dir = tempfile::tempdir().expect("temp dir");
        let api = FakeApiServer::start().await;
        api.apply(
            Kind::Namespace,
            namespace(MESH_NS, json!({"istio.io/dataplane-mode": "ambient"})),
        );
        api.apply(Kind::Namespace, namespace(PLAIN_NS, json!({})));
        api.apply(
            Kind::Pod,
            pod(
                MESH_NS,
                "peer",
                "node-b",
                Some(&peer.ip().to_string()),
                json!({}),
            ),
        );
        let cgroup = Cgroup::create(&topo, "containerd").expect("cgroup");
        let pods_cgroup = Cgroup::create(&topo, "pods").expect("cgroup");
        let ctd = Containerd::start(&node, &cgroup, &CniNetwork::on(&node)).await;

        let free_port = loopback::private_addr;
        let (admin, metrics, readiness) = (free_port(), free_port(), free_port());
        let pin_dir = PathBuf::from(format!("/sys/fs/bpf/{}-cni", topo.prefix()));
        let ca_dir = dir.path().join("ca");
        let cni_socket = dir.path().join("cni.sock");
        let agent_log = dir.path().join("agent.log");
        let log = std::fs::File::create(&agent_log).expect("log file");
        let kubeconfig = api.write_kubeconfig(dir.path());
        let mut command = std::process::Command::new(env!("CARGO_BIN_EXE_shunt"));
        command.arg("agent");
        if cni {
            command
                .arg("--cni-socket")
                .arg(&cni_socket)
                .arg("--cni-conf-dir")
                .arg(&ctd.conf_dir)
                .arg("--cni-bin-dir")
                .arg(&ctd.bin_dir)
                .arg("--cni-plugin")
                .arg(plugin_binary());
        }
        let agent = command
            .args(extra)
            .args(["--log-level", "info,shunt=debug", "--verify-interval", "1"])
            .arg("--bpf-pin-dir")
            .arg(&pin_dir)
            .arg("--cgroup-root")
            .arg(topo.cgroup_root().expect("topology cgroup"))
            .args(["--admin-addr", &admin.to_string()])
            .args(["--metrics-addr", &metrics.to_string()])
            .args(["--readiness-addr", &readiness.to_string()])
            .arg("--ca-dir")
            .arg(&ca_dir)
            .arg("--cri-socket")
            .arg(&ctd.socket)
            .args(if extra.iter().any(|a| a == "--cni-timeout") {
                &[][..]
            } else {
                &["--cni-timeout", "10"][..]
            })
            .arg("--zds-socket")
            .arg(dir.path().join("zds.sock"))
            .env("NODE_NAME", NODE)
            .env("KUBECONFIG", &kubeconfig)
            .env_remove("KUBERNETES_SERVICE_HOST")
            .stdin(Stdio::null())
            .stdout(log.try_clone().expect("log"))
            .stderr(log)
            .spawn()
            .expect("start shunt agent");
        let (tx, received) = mpsc::unbounded_channel();
        let mut bed = CniBed {
            api,
            agent: Some(agent),
            admin,
            agent_log,
            cni_socket,
            ca_dir,
            ctd: Some(ctd),
            peer,
            received,
            dir,
            _cgroup: cgroup,
            pods_cgroup,
            pin_dir,
            topo,
        };
        if cni {
            bed.wait(
                "shunt-cni chained into containerd's CNI configuration",
                |bed| bed.conflist().contains("\"shunt-cni\""),
            )
            .await;
        }
        // With a stock proxy (`--proxy ztunnel`) the agent keeps no CA:
        // the peer answers plaintext only.
        let builtin_proxy = !extra.iter().any(|a| a == "ztunnel");
        bed.serve_peer(tx, builtin_proxy).await;
        bed
    }

    /// The `cgroup_parent` of every sandbox config.
    pub fn pods_cgroup(&self) -> &Path {
        self.pods_cgroup.path()
    }

    pub fn cgroup_parent(&self) -> String {
        self.pods_cgroup.hierarchy_path()
    }

    /// A sandbox configuration for `ns/name` as the kubelet writes it.
    pub fn sandbox_config(
        &self,
        ns: &str,
        name: &str,
        uid: &str,
    ) -> shunt_proto::cri::PodSandboxConfig {
        let parent = self.cgroup_parent();
        self.ctd
            .as_ref()
            .expect("containerd running")
            .sandbox_config(ns, name, uid, &parent)
    }

    pub fn ctd(&mut self) -> &mut Containerd {
        self.ctd.as_mut().expect("containerd running")
    }

    pub fn conflist(&self) -> String {
        let ctd = self.ctd.as_ref().expect("containerd running");
        std::fs::read_to_string(ctd.conf_dir.join("10-pods.conflist")).unwrap_or_default()
    }

    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.agent_log).unwrap_or_default()
    }

    /// Waits (bounded) for `check`; the agent's log on failure.
    pub async fn wait(&mut self, what: &str, mut check: impl FnMut(&mut Self) -> bool) {
        let start = Instant::now();
        while !check(self) {
            if let Some(Some(exit)) = self.agent.as_mut().map(|a| a.try_wait().ok().flatten()) {
                panic!(
                    "the agent exited ({exit}) waiting for {what}; its log:\n{}",
                    self.log()
                );
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "timed out after {TIMEOUT:?} waiting for: {what}; the agent's log:\n{}",
                self.log()
            );
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Waits until two verify passes that started after this call have
    /// finished (one under way at the call counts once).
    pub async fn wait_verify_passes(&mut self, what: &str) {
        let passes = self.status().expect("status").verify_passes;
        self.wait(what, |bed| {
            bed.status().is_some_and(|s| s.verify_passes >= passes + 2)
        })
        .await;
    }

    /// The paths the agent read by name from the API server (GETs without
    /// a query: not a list or a watch), in order.
    pub fn reads_by_name(&self) -> Vec<String> {
        self.api
            .requests()
            .into_iter()
            .filter(|r| r.method == "GET" && r.query.is_empty())
            .map(|r| r.path)
            .collect()
    }

    /// The agent's `/status` (through `shunt status --json`).
    pub fn status(&self) -> Option<NodeStatus> {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_shunt"))
            .args(["status", "--json", "--admin-addr", &self.admin.to_string()])
            .output()
            .ok()?;
        serde_json::from_slice(&out.stdout).ok()
    }

    /// A pod of the agent's status, by namespace and name.
    pub fn pod_status(&self, ns: &str, name: &str) -> Option<shunt::api::PodStatus> {
        self.status()?
            .pods
            .into_iter()
            .find(|p| p.namespace == ns && p.name == name)
    }

    /// Serves `ns/name` on node-a, without an IP yet (the kubelet writes it
    /// once the sandbox is up). Returns its uid.
    pub fn add_pod(&self, ns: &str, name: &str, labels: Value) -> String {
        self.api.apply(Kind::Pod, pod(ns, name, NODE, None, labels));
        self.uid(ns, name)
    }

    pub fn uid(&self, ns: &str, name: &str) -> String {
        self.api
            .object(Kind::Pod, ns, name)
            .and_then(|p| p["metadata"]["uid"].as_str().map(str::to_owned))
            .expect("a served pod has a uid")
    }

    /// What the kubelet does once a sandbox is up: the pod's IP in its status.
    pub fn report_ip(&self, ns: &str, name: &str, ip: &str) {
        self.api.update(Kind::Pod, ns, name, |pod| {
            pod["status"]["phase"] = json!("Running");
            pod["status"]["podIP"] = json!(ip);
            pod["status"]["podIPs"] = json!([{ "ip": ip }]);
        });
    }

    pub fn peer_addr(&self) -> SocketAddr {
        SocketAddr::from((self.peer.ip(), PEER_PORT))
    }

    /// `peer`'s two faces: HBONE on 15008 with the mesh identity of
    /// `shop/sleep` (a certificate of the agent's CA), answering
    /// `captured:<bytes>` and reporting each CONNECT on `tx`; plaintext on
    /// 9000 answering `direct:<bytes>`.
    async fn serve_peer(&mut self, tx: mpsc::UnboundedSender<Received>, hbone: bool) {
        if hbone {
            self.serve_peer_hbone(tx).await;
        }
        let plain = self
            .peer
            .listen_tcp(SocketAddr::from((self.peer.ip(), PEER_PORT)))
            .expect("peer plaintext listener");
        plain.set_nonblocking(true).expect("nonblocking");
        let plain = tokio::net::TcpListener::from_std(plain).expect("tokio listener");
        tokio::spawn(async move {
            use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
            while let Ok((mut tcp, _)) = plain.accept().await {
                tokio::spawn(async move {
                    let mut got = Vec::new();
                    if tcp.read_to_end(&mut got).await.is_ok() {
                        let mut answer = b"direct:".to_vec();
                        answer.extend_from_slice(&got);
                        let _ = tcp.write_all(&answer).await;
                    }
                });
            }
        });
    }

    async fn serve_peer_hbone(&mut self, tx: mpsc::UnboundedSender<Received>) {
        let ca_dir = self.ca_dir.clone();
        // The agent writes its CA at start (bounded wait: 20 s).
        let mut ca = None;
        for _ in 0..400 {
            if let Ok(found) = hbone::MeshCa::from_dir(&ca_dir) {
                ca = Some(found);
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let ca = ca.expect("the agent's CA readable");
        let identity = SpiffeId::for_service_account(&TrustDomain::default(), MESH_NS, "sleep");
        let credentials = tokio::task::spawn_blocking(move || ca.credentials(&identity))
            .await
            .expect("issuing thread")
            .expect("peer credentials");
        let hbone = self
            .peer
            .listen_tcp(SocketAddr::from((self.peer.ip(), 15008)))
            .expect("peer HBONE listener");
        hbone.set_nonblocking(true).expect("nonblocking");
        let hbone = tokio::net::TcpListener::from_std(hbone).expect("tokio listener");
        tokio::spawn(async move {
            while let Ok((tcp, _)) = hbone.accept().await {
                let credentials = credentials.clone();
                let tx = tx.clone();
                tokio::spawn(async move {
                    if let Ok(received) = terminate(tcp, &credentials).await {
                        let _ = tx.send(received);
                    }
                });
            }
        });
    }

    /// SIGTERM to the agent (our child, by PID); waits for its exit.
    pub async fn stop_agent(&mut self) {
        let Some(mut agent) = self.agent.take() else {
            return;
        };
        let pid = nix::unistd::Pid::from_raw(agent.id() as i32);
        let _ = nix::sys::signal::kill(pid, nix::sys::signal::Signal::SIGTERM);
        let start = Instant::now();
        loop {
            if let Ok(Some(exit)) = agent.try_wait() {
                assert!(exit.success(), "agent exit {exit}; log:\n{}", self.log());
                return;
            }
            if start.elapsed() > TIMEOUT {
                let _ = agent.kill();
                let _ = agent.wait();
                panic!("agent still running after SIGTERM; log:\n{}", self.log());
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }

    /// Sandboxes removed, containerd and the agent stopped.
    pub async fn shutdown(mut self) {
        if let Some(ctd) = self.ctd.take() {
            ctd.shutdown().await;
        }
        self.stop_agent().await;
    }
}

impl Drop for CniBed {
    fn drop(&mut self) {
        // Containerd first (it drops its own), then what it started and a
        // failed test left running (shims, sandboxes' and containers'
        // processes: in our two cgroups, by PID), then the agent.
        self.ctd.take();
        for cgroup in [&self._cgroup, &self.pods_cgroup] {
            for pid in descendants_pids(cgroup.path()) {
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
            }
        }
        // Bounded wait for them to be gone, so that their cgroups can go.
        let start = Instant::now();
        while start.elapsed() < Duration::from_secs(5)
            && [&self._cgroup, &self.pods_cgroup]
                .iter()
                .any(|c| !descendants_pids(c.path()).is_empty())
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        if let Some(mut agent) = self.agent.take() {
            let _ = agent.kill();
            let _ = agent.wait();
        }
        let _ = std::fs::remove_dir_all(&self.pin_dir);
        // runc made the cgroup parent in every cgroup v1 hierarchy too (a
        // hybrid host); the testbed removes only the cgroup2 side.
        let parent = self.cgroup_parent();
        if let Ok(hierarchies) = std::fs::read_dir("/sys/fs/cgroup") {
            for hierarchy in hierarchies.flatten() {
                let base = hierarchy.path();
                if base.ends_with("unified") {
                    continue;
                }
                let mut dir = base.join(parent.trim_start_matches('/'));
                // What a sandbox left there (a failed test never removed it).
                if let Ok(children) = std::fs::read_dir(&dir) {
                    for child in children.flatten() {
                        if child.path().is_dir() {
                            let _ = std::fs::remove_dir(child.path());
                        }
                    }
                }
                // Up to the `shunt-test` dir, which runc made there too
                // (removed only once empty: another test may use it).
                for _ in 0..3 {
                    let _ = std::fs::remove_dir(&dir);
                    if !dir.pop() {
                        break;
                    }
                }
            }
        }
    }
}

/// Every process in the cgroup at `dir` or below it.
fn descendants_pids(dir: &Path) -> Vec<u32> {
    let mut pids: Vec<u32> = std::fs::read_to_string(dir.join("cgroup.procs"))
        .unwrap_or_default()
        .lines()
        .filter_map(|l| l.trim().parse().ok())
        .collect();
    if let Ok(children) = std::fs::read_dir(dir) {
        for child in children.flatten() {
            if child.path().is_dir() {
                pids.extend(descendants_pids(&child.path()));
            }
        }
    }
    pids
}

/// One HBONE connection served: its first CONNECT's bytes, answered
/// `captured:<bytes>`.
async fn terminate(
    tcp: tokio::net::TcpStream,
    credentials: &hbone::Credentials,
) -> Result<Received, String> {
    let (mut conn, client_identity) =
        hbone::accept(tcp, &credentials.cert, &credentials.roots).await?;
    let (request, mut respond) = conn
        .accept()
        .await
        .ok_or("no CONNECT")?
        .map_err(|e| e.to_string())?;
    // The connection is driven by its own task from here on.
    tokio::spawn(async move { while let Some(Ok(_)) = conn.accept().await {} });
    let authority = request
        .uri()
        .authority()
        .map(|a| a.to_string())
        .unwrap_or_default();
    let mut send = respond
        .send_response(http::Response::new(()), false)
        .map_err(|e| e.to_string())?;
    let mut body = request.into_body();
    let mut bytes = Vec::new();
    while let Some(chunk) = body.data().await {
        let chunk = chunk.map_err(|e| e.to_string())?;
        let _ = body.flow_control().release_capacity(chunk.len());
        bytes.extend_from_slice(&chunk);
    }
    let mut answer = b"captured:".to_vec();
    answer.extend_from_slice(&bytes);
    send.send_data(Bytes::from(answer), true)
        .map_err(|e| e.to_string())?;
    Ok(Received {
        authority,
        client_identity,
        bytes,
    })
}

/// The shunt-cni binary: `SHUNT_CNI_BIN` (`cargo xtask test` sets it), else
/// beside the agent binary (built by `cargo build -p shunt-cni`).
pub fn plugin_binary() -> PathBuf {
    let path = std::env::var_os("SHUNT_CNI_BIN")
        .map(PathBuf::from)
        .unwrap_or_else(|| Path::new(env!("CARGO_BIN_EXE_shunt")).with_file_name(shunt_cni_name()));
    assert!(
        path.exists(),
        "the shunt-cni binary is missing at {}: `cargo build -p shunt-cni` (cargo xtask test builds it)",
        path.display()
    );
    path
}

fn shunt_cni_name() -> &'static str {
    "shunt-cni"
}

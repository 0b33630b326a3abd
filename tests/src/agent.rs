//! Running the real `shunt agent` binary inside a node of a [`Topology`]:
//! start it on a workloads file, read its status through its admin API, stop
//! it with SIGTERM or SIGKILL. Everything it leaves (its pin dir, its temp
//! dir) goes when the [`Agent`] is dropped. Its command line is built in
//! `agent/spawn.rs`, its bounded waits are `agent/waits.rs`, its pin dirs
//! `agent/pin_dir.rs`.

use std::{
    fs,
    io::Write as _,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, ExitStatus},
    time::Duration,
};

use nix::{
    sys::signal::{Signal, kill},
    unistd::Pid,
};
use shunt::api::NodeStatus;

use crate::{Cgroup, Node, Result, TestbedError, Topology, poll::until};

mod layout;
mod mesh_node;
mod pin_dir;
mod spawn;
mod waits;
mod workloads;

pub use layout::{AgentNetns, http, http_at, http_over};
pub use mesh_node::MeshNode;
use pin_dir::sweep_stale_pins;
pub use pin_dir::{BPF_ROOT, PinDir};
pub use workloads::{ServiceSpec, WorkloadSpec, services_yaml, workloads_yaml};

/// Where the agent's admin API listens (in its node's netns).
pub const ADMIN_ADDR: &str = "127.0.0.1:15000";

/// The `shunt` binary under test: `$SHUNT_BIN` (set by `cargo xtask test`),
/// else `target/debug/shunt` of this workspace.
pub fn shunt_binary() -> Result<PathBuf> {
    let path = match std::env::var_os("SHUNT_BIN") {
        Some(path) => PathBuf::from(path),
        None => {
            let target = std::env::var_os("CARGO_TARGET_DIR")
                .map(PathBuf::from)
                .unwrap_or_else(|| Path::new(env!("CARGO_MANIFEST_DIR")).join("../target"));
            target.join("debug/shunt")
        }
    };
    if path.exists() {
        Ok(path)
    } else {
        Err(TestbedError::Invalid(format!(
            "the shunt binary is not at {}: build it with `cargo build -p shunt` (cargo xtask test does) or set SHUNT_BIN",
            path.display()
        )))
    }
}

/// Where an agent's admin, metrics and readiness endpoints listen (in its
/// node's netns). Two agents of one node running at once (a handover) need
/// different ones.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Endpoints {
    pub admin: SocketAddr,
    pub metrics: SocketAddr,
    pub readiness: SocketAddr,
}

impl Endpoints {
    /// The contract's ports: admin 127.0.0.1:15000, metrics 15020,
    /// readiness 15021.
    pub fn standard() -> Self {
        Self::with_ports(15000, 15020, 15021)
    }

    /// Admin on loopback, metrics and readiness on every address.
    pub fn with_ports(admin: u16, metrics: u16, readiness: u16) -> Self {
        Self {
            admin: SocketAddr::from(([127, 0, 0, 1], admin)),
            metrics: SocketAddr::from(([0, 0, 0, 0], metrics)),
            readiness: SocketAddr::from(([0, 0, 0, 0], readiness)),
        }
    }
}

/// A running `shunt agent` of a node: in the node's netns, or in a pod
/// netns of its own ([`AgentNetns`]).
pub struct Agent {
    child: Option<Child>,
    node: Node,
    /// Where the process runs (and its endpoints listen).
    netns: AgentNetns,
    dir: PathBuf,
    pin_dir: PathBuf,
    cgroup_root: PathBuf,
    /// The agent's own cgroup, below `cgroup_root` as on a real node (where
    /// the root is the whole hierarchy): the sockets its proxy accepts are
    /// then seen by the socket programs, which splice them.
    cgroup: Cgroup,
    ca_dir: PathBuf,
    env: Vec<(String, String)>,
    endpoints: Endpoints,
    /// Whether dropping this agent removes the pin dir and CA dir it shares
    /// with a successor (only the last agent of a handover does).
    owns_shared: bool,
    /// `RLIMIT_NOFILE` (soft, hard) the agent process starts with, if set.
    nofile: Option<(u64, u64)>,
}

/// Makes agent cgroup names unique within a topology.
static AGENT_SEQ: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

impl Agent {
    /// Starts the agent for `node` on a workloads file with `yaml`, and waits
    /// (bounded) until its admin API answers.
    pub fn start(
        topology: &Topology,
        node: &Node,
        yaml: &str,
        extra_args: &[&str],
    ) -> Result<Agent> {
        Self::start_with_env(topology, node, yaml, extra_args, &[])
    }

    /// [`Agent::start`] with extra environment variables for the agent
    /// process (e.g. fault injection), kept for restarts.
    pub fn start_with_env(
        topology: &Topology,
        node: &Node,
        yaml: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Agent> {
        Self::start_in(topology, node, AgentNetns::Node, yaml, extra_args, env)
    }

    /// [`Agent::start_with_env`] in the network namespace `netns`, with the
    /// contract's ports (in the pod layout they are the agent pod's own).
    pub fn start_in(
        topology: &Topology,
        node: &Node,
        netns: AgentNetns,
        yaml: &str,
        extra_args: &[&str],
        env: &[(&str, &str)],
    ) -> Result<Agent> {
        sweep_stale_pins();
        let dir = std::env::temp_dir().join(format!("{}-{}", topology.prefix(), node.name()));
        fs::create_dir_all(&dir)
            .map_err(|e| TestbedError::io(format!("creating {}", dir.display()), e))?;
        let pin_dir = Path::new(BPF_ROOT).join(format!("{}-{}", topology.prefix(), node.name()));
        // The socket programs attach to the topology's own cgroup, never to
        // the machine's root.
        let cgroup_root = topology.cgroup_root()?;
        let seq = AGENT_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let cgroup = Cgroup::create(topology, &format!("agent-{}-{seq}", node.name()))?;
        let ca_dir = std::env::temp_dir().join(format!("{}-ca", topology.prefix()));
        let mut agent = Agent {
            child: None,
            node: node.clone(),
            netns,
            dir,
            pin_dir,
            cgroup_root,
            cgroup,
            ca_dir,
            env: env
                .iter()
                .map(|(k, v)| (k.to_string(), v.to_string()))
                .collect(),
            endpoints: Endpoints::standard(),
            owns_shared: true,
            nofile: None,
        };
        agent.write_workloads(yaml)?;
        agent.spawn(extra_args)?;
        agent.wait_for("the admin API to answer", Duration::from_secs(20), |_| true)?;
        Ok(agent)
    }

    /// Starts a second agent for the same node while this one runs (a
    /// handover): same workloads (a copy of the file), pin dir, cgroup root,
    /// CA and environment; its own log and the given `endpoints`. Waits
    /// (bounded) until its admin API answers. The successor takes over
    /// removing the shared pin dir and CA dir, so this agent can be stopped
    /// and dropped first.
    pub fn successor(&mut self, endpoints: Endpoints, extra_args: &[&str]) -> Result<Agent> {
        self.successor_in(AgentNetns::Node, endpoints, extra_args)
    }

    /// [`Agent::successor`] in the network namespace `netns` (a surge pod
    /// of the DaemonSet: another pod netns of the same node, where the
    /// contract's ports are free again).
    pub fn successor_in(
        &mut self,
        netns: AgentNetns,
        endpoints: Endpoints,
        extra_args: &[&str],
    ) -> Result<Agent> {
        let yaml = fs::read_to_string(self.workloads_path())
            .map_err(|e| TestbedError::io("reading the workloads file", e))?;
        let dir = self.dir.with_file_name(format!(
            "{}-successor-{}",
            self.dir
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default(),
            AGENT_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
        ));
        fs::create_dir_all(&dir)
            .map_err(|e| TestbedError::io(format!("creating {}", dir.display()), e))?;
        let mut successor = Agent {
            child: None,
            node: self.node.clone(),
            netns,
            dir,
            pin_dir: self.pin_dir.clone(),
            cgroup_root: self.cgroup_root.clone(),
            cgroup: Cgroup::create(
                self.cgroup_root.as_path(),
                &format!(
                    "agent-{}-{}",
                    self.node.name(),
                    AGENT_SEQ.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
                ),
            )?,
            ca_dir: self.ca_dir.clone(),
            env: self.env.clone(),
            endpoints,
            owns_shared: self.owns_shared,
            nofile: self.nofile,
        };
        self.owns_shared = false;
        successor.write_workloads(&yaml)?;
        successor.spawn(extra_args)?;
        successor.wait_for("the admin API to answer", Duration::from_secs(20), |_| true)?;
        Ok(successor)
    }

    pub fn endpoints(&self) -> Endpoints {
        self.endpoints
    }

    /// Sets (`Some`) or removes (`None`) an environment variable of the
    /// agent's later starts ([`Agent::restart`], [`Agent::successor`]),
    /// e.g. the upgrade test's switch back from an "older release".
    pub fn set_env(&mut self, name: &str, value: Option<&str>) {
        self.env.retain(|(k, _)| k != name);
        if let Some(value) = value {
            self.env.push((name.to_string(), value.to_string()));
        }
    }

    /// Stops the agent and starts it again with `RLIMIT_NOFILE` set to
    /// (soft, hard) from its first instruction (set between fork and exec),
    /// kept for later restarts.
    pub fn restart_with_nofile(&mut self, nofile: (u64, u64), extra_args: &[&str]) -> Result<()> {
        let _stopped = self.stop()?;
        self.nofile = Some(nofile);
        self.restart(extra_args)
    }

    /// `GET /healthz/ready` on the agent's readiness endpoint, from its
    /// node's netns as the kubelet probes it (the agent pod's IP in the pod
    /// layout): the status code and body.
    pub fn readiness(&self) -> Result<(u16, String)> {
        let addr = self.reachable_from_node(self.endpoints.readiness.port());
        http_at(&self.node, addr, "GET", "/healthz/ready")
            .map_err(|e| TestbedError::io(format!("GET {addr}/healthz/ready"), e))
    }

    /// `GET /metrics` on the agent's metrics endpoint, from its node's
    /// netns as Prometheus scrapes it (the agent pod's IP in the pod
    /// layout): the status code and body.
    pub fn metrics(&self) -> Result<(u16, String)> {
        let addr = self.reachable_from_node(self.endpoints.metrics.port());
        http_at(&self.node, addr, "GET", "/metrics")
            .map_err(|e| TestbedError::io(format!("GET {addr}/metrics"), e))
    }

    /// Where the node reaches the agent's `port` (see
    /// [`AgentNetns::reachable_from_node`]).
    pub fn reachable_from_node(&self, port: u16) -> SocketAddr {
        self.netns.reachable_from_node(port)
    }

    /// The network namespace the agent runs in.
    pub fn netns(&self) -> &AgentNetns {
        &self.netns
    }

    /// Starts the agent again (after [`Agent::kill`] or [`Agent::stop`]), on
    /// the same workloads file and pin dir.
    pub fn restart(&mut self, extra_args: &[&str]) -> Result<()> {
        self.spawn(extra_args)?;
        self.wait_for("the admin API to answer", Duration::from_secs(20), |_| true)?;
        Ok(())
    }

    pub fn workloads_path(&self) -> PathBuf {
        self.dir.join("workloads.yaml")
    }

    pub fn log_path(&self) -> PathBuf {
        self.dir.join("agent.log")
    }

    /// The CA directory (`--ca-dir`) the topology's agents share; it holds
    /// the plug-in CA files once an agent has started.
    pub fn ca_dir(&self) -> &Path {
        &self.ca_dir
    }

    pub fn pin_dir(&self) -> &Path {
        &self.pin_dir
    }

    /// The cgroup the agent's socket programs are attached to; processes
    /// placed below it (see [`crate::Cgroup`]) are captured.
    pub fn cgroup_root(&self) -> &Path {
        &self.cgroup_root
    }

    pub fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Replaces the workloads file (atomically, so the agent never reads a
    /// half-written file).
    pub fn write_workloads(&self, yaml: &str) -> Result<()> {
        let tmp = self.dir.join("workloads.yaml.tmp");
        let write = || -> std::io::Result<()> {
            let mut file = fs::File::create(&tmp)?;
            file.write_all(yaml.as_bytes())?;
            file.sync_all()?;
            fs::rename(&tmp, self.workloads_path())
        };
        write().map_err(|e| TestbedError::io("writing the workloads file", e))
    }

    /// Everything the agent logged so far.
    pub fn logs(&self) -> String {
        fs::read_to_string(self.log_path()).unwrap_or_default()
    }

    /// `GET path` on the agent's admin API (loopback of its netns): the
    /// status code and body.
    pub fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        let (addr, target) = (self.endpoints.admin, path.to_owned());
        self.netns
            .run(&self.node, move || {
                let stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(5))?;
                http_over(stream, "GET", &target)
            })?
            .map_err(|e| TestbedError::io(format!("GET {addr}{path}"), e))
    }

    /// The agent's view of its node, from its admin API.
    pub fn status(&self) -> Result<NodeStatus> {
        let addr = self.endpoints.admin;
        self.netns
            .run(&self.node, move || shunt::status::fetch(addr))?
            .map_err(|e| TestbedError::Invalid(e.to_string()))
    }

    /// SIGTERM, then waits (bounded) for a clean exit.
    pub fn stop(&mut self) -> Result<ExitStatus> {
        self.signal_and_wait(Signal::SIGTERM, Duration::from_secs(15))
    }

    /// SIGKILL: the agent gets no chance to clean up.
    pub fn kill(&mut self) -> Result<ExitStatus> {
        self.signal_and_wait(Signal::SIGKILL, Duration::from_secs(5))
    }

    fn signal_and_wait(&mut self, signal: Signal, timeout: Duration) -> Result<ExitStatus> {
        let Some(mut child) = self.child.take() else {
            return Err(TestbedError::Invalid("the agent is not running".into()));
        };
        let pid = Pid::from_raw(child.id() as i32);
        let _ = kill(pid, signal);
        match until(timeout, Duration::from_millis(50), || {
            child.try_wait().transpose()
        }) {
            Some(Ok(status)) => Ok(status),
            _ => {
                let _ = child.kill();
                let _ = child.wait();
                Err(TestbedError::Invalid(format!(
                    "the agent did not exit within {timeout:?} of {signal}; log:\n{}",
                    self.logs()
                )))
            }
        }
    }
}

impl Drop for Agent {
    fn drop(&mut self) {
        if let Some(mut child) = self.child.take() {
            // Our own child, by PID.
            let _ = child.kill();
            let _ = child.wait();
        }
        let _ = fs::remove_dir_all(&self.dir);
        if !self.owns_shared {
            // A successor still uses them.
            return;
        }
        if let Err(e) = fs::remove_dir_all(&self.pin_dir)
            && e.kind() != std::io::ErrorKind::NotFound
        {
            crate::warn(format_args!(
                "cannot remove pin dir {}: {e}",
                self.pin_dir.display()
            ));
        }
        let _ = fs::remove_dir_all(&self.ca_dir);
    }
}

/// Starts an agent on each of `nodes`, all on the workloads file `yaml`
/// with `extra_args`, then waits (each bounded by `timeout`) until every
/// one has enrolled its node's mesh pods.
pub fn start_enrolled<const N: usize>(
    topology: &Topology,
    nodes: [&Node; N],
    yaml: &str,
    extra_args: &[&str],
    timeout: Duration,
) -> Result<[Agent; N]> {
    let mut agents = Vec::with_capacity(N);
    for node in nodes {
        agents.push(Agent::start(topology, node, yaml, extra_args)?);
    }
    for agent in &mut agents {
        agent.wait_for("mesh pods enrolled", timeout, mesh_pods_enrolled)?;
    }
    agents
        .try_into()
        .map_err(|_| TestbedError::Invalid("one agent per node".into()))
}

/// Whether every pod of `status` that opts into the mesh is enrolled.
pub fn mesh_pods_enrolled(status: &NodeStatus) -> bool {
    status
        .pods
        .iter()
        .filter(|p| p.dataplane_mode == "ambient")
        .all(|p| p.state == shunt::api::PodState::Enrolled)
}

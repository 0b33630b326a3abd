//! One topology per redirection mode: its pods (tuned alike), its agents
//! (moved into a cgroup of their own so their CPU is measured) and a
//! `shunt-bench server` in every server pod; everything it started is
//! stopped when it is dropped.

use std::{
    collections::BTreeMap,
    io::{BufRead, BufReader},
    path::Path,
    process::{Child, Stdio},
    sync::mpsc,
    time::{Duration, Instant},
};

use anyhow::{Context as _, anyhow, bail};
use shunt::api::PodState;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, WorkloadSpec as PodSpec, workloads_yaml},
};

use super::ztunnel;
use crate::model::{Dest, ECHO_PORT, Locality, Mode, PathSpec, SINK_PORT};

pub(super) const CLIENT: &str = "client";
/// The client pod's identity as policies name it (`WorkloadSpec::for_pod`
/// gives it service account `sa-client`).
const CLIENT_PRINCIPAL: &str = "cluster.local/ns/default/sa/sa-client";
/// The server pods in the mesh: what `--policies` guards.
const MESH_SERVERS: [&str; 2] = ["same-mesh", "cross-mesh"];

/// The agent's `--redirect` mode for `mode` (and what its status reports).
fn redirect_mode(mode: Mode) -> &'static str {
    match mode {
        Mode::Direct | Mode::Ztunnel => "none",
        Mode::Iptables => "iptables",
        Mode::Ebpf | Mode::EbpfSplice | Mode::EbpfFastPath => "ebpf",
    }
}

/// The agent's own periodic work at its defaults (`cli.rs`), not the test
/// harness's every second: a verify pass and a workloads-file check each
/// second on the measured CPU are not what users run (the test
/// `agent_intervals_are_the_agents_defaults` holds them to the agent's).
const AGENT_DEFAULT_INTERVALS: [&str; 4] = ["--verify-interval", "10", "--reload-interval", "2"];

fn agent_args(mode: Mode) -> Vec<&'static str> {
    let mut args = vec!["--redirect", redirect_mode(mode), "--drain-seconds", "1"];
    if mode == Mode::EbpfSplice {
        // Its check reads the kernel's splice counter, which a verify pass
        // refreshes (`client_spliced_bytes`): every second, as the harness.
        args.extend(["--splice", "on", "--verify-interval", "1"]);
        args.extend(&AGENT_DEFAULT_INTERVALS[2..]);
    } else {
        args.extend(AGENT_DEFAULT_INTERVALS);
    }
    // Only the fast-path mode takes passthrough flows around the proxy;
    // the others measure the proxy path.
    args.extend([
        "--fast-path",
        if mode == Mode::EbpfFastPath {
            "on"
        } else {
            "off"
        },
    ]);
    args
}

/// Waits (bounded) until the agent's fast-path table is in use, so that the
/// first measurement is not of connects sent to the proxy meanwhile.
fn wait_fast_path(node: &shunt_testbed::Node, node_name: &str) -> anyhow::Result<()> {
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    loop {
        let (_, body) = shunt_testbed::agent::http(node, "GET", 15020, "/metrics")
            .with_context(|| format!("metrics of the agent on {node_name}"))?;
        // Both flows: the passthrough table and the same-node mesh switch.
        if body.lines().any(|l| l == "shunt_fast_path_table_valid 1")
            && body.lines().any(|l| l == "shunt_fast_path_mesh_enabled 1")
        {
            return Ok(());
        }
        if std::time::Instant::now() >= deadline {
            bail!("the fast-path table of the agent on {node_name} was not in use within 30 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    }
}

/// The server pod `path` ends at.
pub(super) fn target_pod(path: &PathSpec) -> &'static str {
    match (path.locality, path.mode, path.dest) {
        (Locality::Same, Mode::Direct, _) | (Locality::Same, _, Dest::Plain) => "same-plain",
        (Locality::Same, _, Dest::Hbone) => "same-mesh",
        (Locality::Cross, Mode::Direct, _) | (Locality::Cross, _, Dest::Plain) => "cross-plain",
        (Locality::Cross, _, Dest::Hbone) => "cross-mesh",
    }
}

/// A child process killed (by its PID, which we own) when dropped.
pub(super) struct Owned(pub(super) Child);

impl Drop for Owned {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// One topology with its agents and servers. Field order is drop order:
/// servers, then agents, then the cgroup, then the namespaces.
pub(super) struct Bed {
    pub(super) mode: Mode,
    pub(super) servers: BTreeMap<&'static str, Owned>,
    /// The ztunnel topology's proxies, one per mesh pod (by pod name).
    pub(super) ztunnels: Vec<(&'static str, Owned)>,
    /// Their config and logs (removed after them).
    ztunnel_dir: Option<ScratchDir>,
    pub(super) agents: Vec<(String, Agent)>,
    /// The agents' processes, moved here (below the cgroup root their
    /// programs attach to, a sibling of the apps' cgroup, as on a real node
    /// where the root is the whole hierarchy) so their CPU is measured from
    /// `cpu.stat`.
    pub(super) agents_cgroup: Option<AgentsCgroup>,
    pub(super) apps: Cgroup,
    pub(super) pods: BTreeMap<&'static str, Pod>,
    /// The agents' workloads file as first written (empty without agents).
    workloads: String,
    /// Owns the namespaces (dropped last).
    _topo: Topology,
}

const MESH_PODS: &[(&str, &str, bool)] = &[
    ("node-a", CLIENT, true),
    ("node-a", "same-mesh", true),
    ("node-a", "same-plain", false),
    ("node-b", "cross-mesh", true),
    ("node-b", "cross-plain", false),
];
const DIRECT_PODS: &[(&str, &str, bool)] = &[
    ("node-a", CLIENT, false),
    ("node-a", "same-plain", false),
    ("node-b", "cross-plain", false),
];

impl Bed {
    pub(super) fn build(
        mode: Mode,
        bench_bin: &Path,
        ztunnel: Option<&super::ZtunnelRun>,
    ) -> anyhow::Result<Bed> {
        let mut topo = Topology::new(&format!("bench-{}", mode.name()))?;
        topo.add_node("node-a")?;
        topo.add_node("node-b")?;
        let layout = if mode == Mode::Direct {
            DIRECT_PODS
        } else {
            MESH_PODS
        };
        let mut pods = BTreeMap::new();
        for &(node, name, _) in layout {
            let pod = topo.add_pod(node, name)?;
            tune_pod(&pod)?;
            pods.insert(name, pod);
        }
        let apps = Cgroup::create(&topo, "apps")?;
        let mut agents = Vec::new();
        let mut workloads = String::new();
        let mut ztunnels = Vec::new();
        let mut ztunnel_dir = None;
        if mode == Mode::Ztunnel {
            let run = ztunnel.ok_or_else(|| anyhow!("a ztunnel path without --ztunnel"))?;
            let dir = ScratchDir::create(
                std::env::temp_dir().join(format!("{}-ztunnel", topo.prefix())),
            )?;
            ztunnels = start_ztunnels(&dir.0, &pods, layout, run)?;
            ztunnel_dir = Some(dir);
        } else if mode != Mode::Direct {
            let specs: Vec<PodSpec> = layout
                .iter()
                .map(|&(_, name, ambient)| PodSpec::for_pod(&pods[name], ambient))
                .collect();
            let yaml = workloads_yaml(&specs);
            workloads = yaml.clone();
            for node_name in ["node-a", "node-b"] {
                let node = topo
                    .node(node_name)
                    .ok_or_else(|| anyhow!("no node {node_name}"))?
                    .clone();
                let mut agent = Agent::start(&topo, &node, &yaml, &agent_args(mode))?;
                let status =
                    agent.wait_for("mesh pods enrolled", Duration::from_secs(60), |s| {
                        s.pods
                            .iter()
                            .filter(|p| p.dataplane_mode == "ambient")
                            .all(|p| p.state == PodState::Enrolled)
                    })?;
                if status.mode != redirect_mode(mode) {
                    bail!(
                        "agent on {node_name} runs in {} mode, not {}",
                        status.mode,
                        redirect_mode(mode)
                    );
                }
                if mode == Mode::EbpfFastPath {
                    wait_fast_path(&node, node_name)?;
                }
                agents.push((node_name.to_string(), agent));
            }
        }
        let agents_cgroup = if agents.is_empty() && ztunnels.is_empty() {
            None
        } else {
            let cgroup = AgentsCgroup::create(&topo)?;
            for (_, agent) in &agents {
                let pid = agent.pid().ok_or_else(|| anyhow!("an agent has no pid"))?;
                cgroup.add_pid(pid)?;
            }
            for (_, ztunnel) in &ztunnels {
                cgroup.add_pid(ztunnel.0.id())?;
            }
            Some(cgroup)
        };
        let mut bed = Bed {
            mode,
            servers: BTreeMap::new(),
            ztunnels,
            ztunnel_dir,
            agents,
            agents_cgroup,
            apps,
            pods,
            workloads,
            _topo: topo,
        };
        for &(_, name, _) in layout {
            if name != CLIENT {
                let server = bed.start_server(name, bench_bin)?;
                bed.servers.insert(name, server);
            }
        }
        Ok(bed)
    }

    fn start_server(&self, pod: &str, bench_bin: &Path) -> anyhow::Result<Owned> {
        let mut cmd = self.pods[pod].command(bench_bin);
        cmd.args([
            "server",
            "--echo-port",
            &ECHO_PORT.to_string(),
            "--sink-port",
            &SINK_PORT.to_string(),
            "--max-seconds",
            "14400",
        ])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit());
        self.apps.place(&mut cmd);
        let mut child = Owned(
            cmd.spawn()
                .with_context(|| format!("starting the server in {pod}"))?,
        );
        let stdout = child.0.stdout.take().ok_or_else(|| anyhow!("no stdout"))?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        match rx.recv_timeout(Duration::from_secs(20)) {
            Ok(line) if line.trim() == "ready" => Ok(child),
            Ok(line) => bail!("the server in {pod} said {line:?} instead of ready"),
            Err(_) => bail!("the server in {pod} did not get ready within 20 s"),
        }
    }

    /// Rewrites every agent's workloads file with `count` generated
    /// policies on the mesh servers (see [`super::policies`]) and waits
    /// (bounded) until each agent's status shows exactly them on its server
    /// pod. Nothing to do without agents.
    pub(super) fn set_policies(&self, count: usize) -> anyhow::Result<()> {
        let yaml = super::policies::workloads_with_policies(
            &self.workloads,
            &MESH_SERVERS,
            CLIENT_PRINCIPAL,
            count,
        );
        for (_, agent) in &self.agents {
            agent.write_workloads(&yaml)?;
        }
        let deadline = Instant::now() + Duration::from_secs(60);
        for (node, agent) in &self.agents {
            loop {
                let status = agent.status()?;
                let servers: Vec<usize> = status
                    .pods
                    .iter()
                    .filter(|p| MESH_SERVERS.contains(&p.name.as_str()))
                    .map(|p| p.policies.len())
                    .collect();
                if !servers.is_empty() && servers.iter().all(|&n| n == count) {
                    break;
                }
                if Instant::now() > deadline {
                    bail!(
                        "the agent on {node} shows {servers:?} policies on its server pod, not {count}, after 60 s"
                    );
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        }
        Ok(())
    }

    /// The path's proxies: the shunt agents, or the ztunnels.
    pub(super) fn agent_pids(&self) -> Vec<u32> {
        self.agents
            .iter()
            .filter_map(|(_, a)| a.pid())
            .chain(self.ztunnels.iter().map(|(_, z)| z.0.id()))
            .collect()
    }

    pub(super) fn agent_on(&self, node: &str) -> Option<&Agent> {
        self.agents.iter().find(|(n, _)| n == node).map(|(_, a)| a)
    }

    /// The ztunnels' log files (pod name, path).
    pub(super) fn ztunnel_logs(&self) -> Vec<(&'static str, std::path::PathBuf)> {
        let Some(dir) = &self.ztunnel_dir else {
            return Vec::new();
        };
        self.ztunnels
            .iter()
            .map(|(pod, _)| (*pod, dir.0.join(format!("{pod}.log"))))
            .collect()
    }

    pub(super) fn stop_agents(&mut self) {
        for (pod, ztunnel) in &mut self.ztunnels {
            if let Err(e) = ztunnel::stop(&mut ztunnel.0) {
                eprintln!("shunt-bench: stopping the ztunnel of {pod}: {e}");
            }
        }
        for (node, agent) in &mut self.agents {
            if let Err(e) = agent.stop() {
                eprintln!("shunt-bench: stopping the agent on {node}: {e}");
            }
        }
    }
}

/// A directory of the harness's own, removed when dropped.
pub(super) struct ScratchDir(pub(super) std::path::PathBuf);

impl ScratchDir {
    fn create(path: std::path::PathBuf) -> anyhow::Result<ScratchDir> {
        std::fs::create_dir_all(&path).with_context(|| format!("creating {}", path.display()))?;
        Ok(ScratchDir(path))
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// One ztunnel per mesh pod of `layout`, all reading one local config in
/// `dir` (their logs beside it).
fn start_ztunnels(
    dir: &Path,
    pods: &BTreeMap<&'static str, Pod>,
    layout: &[(&str, &'static str, bool)],
    run: &super::ZtunnelRun,
) -> anyhow::Result<Vec<(&'static str, Owned)>> {
    let members: Vec<ztunnel::ZtunnelPod> = layout
        .iter()
        .map(|&(_, name, mesh)| ztunnel::ZtunnelPod {
            pod: &pods[name],
            mesh,
        })
        .collect();
    let config = dir.join("local-xds.yaml");
    std::fs::write(&config, ztunnel::local_config(&members))
        .with_context(|| format!("writing {}", config.display()))?;
    let mut started = Vec::new();
    for &(_, name, mesh) in layout {
        if mesh {
            let log = dir.join(format!("{name}.log"));
            let child = ztunnel::start(&run.binary, &pods[name], &config, &run.log, &log)?;
            started.push((name, child));
        }
    }
    Ok(started)
}

/// `<topology's cgroup root>/agents`. The agents must stay below the root:
/// the sockets their proxies accept are then seen by the socket programs
/// (the splice needs both ends). Removed when dropped (the agents it holds
/// are moved back where they came from, if still running).
pub(super) struct AgentsCgroup {
    cgroup: Option<Cgroup>,
}

impl AgentsCgroup {
    fn create(topo: &Topology) -> anyhow::Result<AgentsCgroup> {
        Ok(AgentsCgroup {
            cgroup: Some(Cgroup::create(topo, "agents")?),
        })
    }

    fn add_pid(&self, pid: u32) -> anyhow::Result<()> {
        if let Some(cgroup) = &self.cgroup {
            cgroup.add_pid(pid)?;
        }
        Ok(())
    }

    pub(super) fn path(&self) -> Option<&Path> {
        self.cgroup.as_ref().map(Cgroup::path)
    }
}

/// Sysctls of a pod's netns so that connection churn never runs out of
/// ports: the same on every path (TIME_WAIT reuse for outgoing connections,
/// a wide ephemeral range).
fn tune_pod(pod: &Pod) -> anyhow::Result<()> {
    let results = pod.run(|| {
        [
            ("/proc/sys/net/ipv4/tcp_tw_reuse", "1"),
            ("/proc/sys/net/ipv4/ip_local_port_range", "10000 65000"),
        ]
        .iter()
        .map(|(file, value)| std::fs::write(file, value).map_err(|e| format!("{file}: {e}")))
        .collect::<Vec<_>>()
    })?;
    for r in results {
        r.map_err(|e| anyhow!("tuning pod {}: {e}", pod.name()))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;
    use shunt::cli::{Cli, Command};

    use super::AGENT_DEFAULT_INTERVALS;

    #[test]
    fn agent_intervals_are_the_agents_defaults() {
        let cli = Cli::try_parse_from(["shunt", "agent", "--node-name", "n"]).expect("parses");
        let Command::Agent(agent) = cli.command else {
            panic!("not the agent command");
        };
        let given = AGENT_DEFAULT_INTERVALS;
        assert_eq!(
            given[1],
            agent.verify_interval.to_string(),
            "--verify-interval"
        );
        assert_eq!(
            given[3],
            agent.reload_interval.to_string(),
            "--reload-interval"
        );
    }
}

//! What redirection itself costs, apart from the proxy: the time to enrol
//! (and unenrol) a pod in each mode, and the connect latency an outbound
//! redirect adds. Run as root:
//!
//! `cargo run --release -p shunt-bench --bin shunt-enrol-bench -- --pods 100 --connects 2000`
//!
//! Connect latency is measured by a child process (this binary again, in
//! `connect-loop` mode) that runs inside the client pod's netns and in a
//! cgroup below the redirector's cgroup root, as a pod's application would;
//! it connects to a listener that accepts and closes. "direct" goes to the
//! listener's own address with the pod not enrolled; "ebpf" goes to the same
//! address with the pod enrolled (connect4 rewrites it to 127.0.0.1:15001,
//! where a second listener stands in for the proxy); "iptables" the same
//! through nat OUTPUT REDIRECT.

use std::{
    net::{SocketAddr, TcpListener, TcpStream},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    thread,
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Parser;
use shunt::{
    redirect::{
        Capture, PodTarget, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector},
        iptables::{IptablesOptions, IptablesRedirector},
    },
    state::{PodState, WorkloadKey},
};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::{Agent, PinDir, WorkloadSpec, workloads_yaml},
    require_root,
};

/// Pods per testbed node (its pod subnet is a /24).
const PODS_PER_NODE: usize = 200;
/// The most pods one run enrols (a node's worth, as `MAX_PODS` allows).
const MAX_PODS: usize = 1000;

#[derive(Parser)]
struct Args {
    /// Pods to enrol and unenrol per mode.
    #[arg(long, default_value_t = 100)]
    pods: usize,
    /// Connects per path for the latency figure.
    #[arg(long, default_value_t = 2000)]
    connects: usize,
    /// Instead of the redirectors alone: start the agent (`$SHUNT_BIN`, else
    /// target/release/shunt) on a workloads file that lists every pod, in
    /// eBPF mode, and time its cold start until every pod is enrolled —
    /// the burst a watch delivers after a node reboot. (Not iptables: its
    /// first pass over 1,000 pods outlasts the testbed's 20 s wait for a
    /// first status.)
    #[arg(long)]
    agent: bool,
    /// With `--agent`: copy the agent's log (RUST_LOG debug for shunt,
    /// with timestamps) to this file, for a breakdown of where the time
    /// went.
    #[arg(long, requires = "agent")]
    agent_log: Option<std::path::PathBuf>,
    /// Internal: run the connect loop (inside a pod) and print latencies.
    #[arg(long, hide = true, num_args = 2, value_names = ["ADDR", "N"])]
    connect_loop: Option<Vec<String>>,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if let Some(loop_args) = &args.connect_loop {
        return connect_loop(loop_args);
    }
    require_root()?;
    let mut topo = Topology::new("enrolbench")?;
    // A testbed node's pod subnet is a /24: spread the pods over as many
    // nodes as they need (one redirector enrols them all, as on one node).
    let count = args.pods.clamp(2, MAX_PODS);
    let nodes: Vec<String> = (0..count.div_ceil(PODS_PER_NODE))
        .map(|i| format!("node-{i}"))
        .collect();
    for node in &nodes {
        topo.add_node(node)?;
    }
    let pods: Vec<Pod> = (0..count)
        .map(|i| topo.add_pod(&nodes[i / PODS_PER_NODE], &format!("p{i}")))
        .collect::<Result<_, _>>()?;
    if args.agent {
        return agent_cold_start(&topo, &nodes[0], &pods, args.agent_log.as_deref());
    }
    let apps = Cgroup::create(&topo, "apps")?;
    let pin = PinDir::new(&topo, "bench");

    println!("enrolment time per pod ({} pods):", pods.len());
    let mut options = EbpfOptions::new(pin.path());
    options.cgroup_root = Some(topo.cgroup_root()?);
    let mut ebpf = EbpfRedirector::load(&options).context("loading the eBPF redirector")?;
    let (enrol, unenrol) = enrol_all(&mut ebpf, &pods)?;
    println!(
        "  ebpf      enrol {}   unenrol {}   all {} pods enrolled in {:.2?}",
        summary(&enrol),
        summary(&unenrol),
        pods.len(),
        enrol.iter().sum::<Duration>()
    );
    println!("            {}", by_tenth(&enrol));
    let mut iptables = IptablesRedirector::new(IptablesOptions::new("bench"))?;
    let (enrol, unenrol) = enrol_all(&mut iptables, &pods)?;
    println!(
        "  iptables  enrol {}   unenrol {}   all {} pods enrolled in {:.2?}",
        summary(&enrol),
        summary(&unenrol),
        pods.len(),
        enrol.iter().sum::<Duration>()
    );
    println!("            {}", by_tenth(&enrol));

    // Connect latency: the client is pods[0], the destination pods[1].
    let (client, server) = (&pods[0], &pods[1]);
    let target = SocketAddr::from((server.ip(), 8080));
    let _server = Acceptor::start(server.listen_tcp(target)?);
    let _proxy = Acceptor::start(client.listen_tcp("127.0.0.1:15001".parse()?)?);
    println!(
        "connect() latency, {} connects per path (accept and close):",
        args.connects
    );
    let direct = measure(&apps, client, target, args.connects)?;
    println!("  direct    {}", summary(&direct));
    ebpf.enrol(&pod_target(client))?;
    let redirected = measure(&apps, client, target, args.connects)?;
    ebpf.unenrol(&key(client))?;
    println!("  ebpf      {}", summary(&redirected));
    iptables.enrol(&pod_target(client))?;
    let nat = measure(&apps, client, target, args.connects)?;
    iptables.unenrol(&key(client))?;
    println!("  iptables  {}", summary(&nat));
    Ok(())
}

/// Starts the agent for the first node with every pod listed as that
/// node's ambient pod (their netns paths given; the testbed spreads them
/// over several /24 nodes), and prints how long it took from the spawn to
/// its first status (after the first reconcile pass) and to every pod
/// enrolled, in eBPF mode.
fn agent_cold_start(
    topo: &Topology,
    node: &str,
    pods: &[Pod],
    keep_log: Option<&std::path::Path>,
) -> anyhow::Result<()> {
    if std::env::var_os("SHUNT_BIN").is_none() {
        // SAFETY: single-threaded here; the testbed reads it when spawning.
        unsafe { std::env::set_var("SHUNT_BIN", "target/release/shunt") };
    }
    let specs: Vec<WorkloadSpec> = pods
        .iter()
        .map(|pod| WorkloadSpec {
            node: node.to_owned(),
            ..WorkloadSpec::for_pod(pod, true)
        })
        .collect();
    let yaml = workloads_yaml(&specs);
    let node = topo.node(node).context("the first node")?.clone();
    println!(
        "agent cold start, {} pods listed in its workloads file:",
        pods.len()
    );
    let mode = "ebpf";
    let start = Instant::now();
    let mut agent = Agent::start(topo, &node, &yaml, &["--redirect", mode])?;
    let answering = start.elapsed();
    agent.wait_for("every pod enrolled", Duration::from_secs(600), |status| {
        status.pods.len() == pods.len() && status.pods.iter().all(|p| p.state == PodState::Enrolled)
    })?;
    let enrolled = start.elapsed();
    // On-CPU time against the wall clock: how much of the start was work
    // and how much waiting.
    let cpu = agent.pid().and_then(cpu_time);
    println!(
        "  {mode:<9} first status after {answering:.2?}, all {} pods enrolled after {enrolled:.2?}{}",
        pods.len(),
        cpu.map(|cpu| format!(" (agent CPU time so far {cpu:.2?})"))
            .unwrap_or_default()
    );
    agent.stop()?;
    if let Some(path) = keep_log {
        std::fs::copy(agent.log_path(), path)
            .with_context(|| format!("copying the agent log to {}", path.display()))?;
    }
    Ok(())
}

/// User + system CPU time of process `pid` (all its threads), from
/// `/proc/PID/stat`.
fn cpu_time(pid: u32) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // The fields after the command (which may hold spaces) in parentheses.
    let rest = stat.get(stat.rfind(')')? + 2..)?;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line (11 and 12
    // after the state).
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    // SAFETY: sysconf has no preconditions.
    let per_second = unsafe { libc::sysconf(libc::_SC_CLK_TCK) };
    let per_second = u64::try_from(per_second).ok().filter(|n| *n > 0)?;
    Some(Duration::from_nanos(ticks * 1_000_000_000 / per_second))
}

fn key(pod: &Pod) -> WorkloadKey {
    WorkloadKey::new("bench", pod.name())
}

fn pod_target(pod: &Pod) -> PodTarget {
    PodTarget {
        key: key(pod),
        netns: pod.netns_path(),
        ips: vec![pod.ip().into()],
        capture: Capture::all(),
    }
}

/// Enrols then unenrols every pod, timing each call.
fn enrol_all(
    redirector: &mut dyn Redirector,
    pods: &[Pod],
) -> anyhow::Result<(Vec<Duration>, Vec<Duration>)> {
    let mut enrol = Vec::with_capacity(pods.len());
    for pod in pods {
        let start = Instant::now();
        redirector.enrol(&pod_target(pod))?;
        enrol.push(start.elapsed());
    }
    let mut unenrol = Vec::with_capacity(pods.len());
    for pod in pods {
        let start = Instant::now();
        redirector.unenrol(&key(pod))?;
        unenrol.push(start.elapsed());
    }
    Ok((enrol, unenrol))
}

/// Runs the connect loop in `pod`, in the apps cgroup; returns latencies.
fn measure(
    apps: &Cgroup,
    pod: &Pod,
    target: SocketAddr,
    n: usize,
) -> anyhow::Result<Vec<Duration>> {
    let mut cmd = pod.command(std::env::current_exe()?);
    cmd.arg("--connect-loop")
        .arg(target.to_string())
        .arg(n.to_string());
    apps.place(&mut cmd);
    let out = cmd.output().context("running the connect loop")?;
    if !out.status.success() {
        bail!(
            "connect loop failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(String::from_utf8_lossy(&out.stdout)
        .lines()
        .filter_map(|l| l.trim().parse::<u64>().ok())
        .map(Duration::from_nanos)
        .collect())
}

/// The child: `n` connects, one line of nanoseconds each.
fn connect_loop(args: &[String]) -> anyhow::Result<()> {
    let target: SocketAddr = args[0].parse()?;
    let n: usize = args[1].parse()?;
    let mut lines = String::new();
    for _ in 0..n.min(100_000) {
        let start = Instant::now();
        let stream = TcpStream::connect_timeout(&target, Duration::from_secs(5))?;
        let elapsed = start.elapsed();
        drop(stream);
        lines.push_str(&format!("{}\n", elapsed.as_nanos()));
    }
    print!("{lines}");
    Ok(())
}

/// Accepts and closes connections until dropped.
struct Acceptor {
    stop: Arc<AtomicBool>,
    thread: Option<thread::JoinHandle<()>>,
}

impl Acceptor {
    fn start(listener: TcpListener) -> Acceptor {
        let stop = Arc::new(AtomicBool::new(false));
        let _ = listener.set_nonblocking(true);
        let thread = {
            let stop = stop.clone();
            thread::spawn(move || {
                let start = Instant::now();
                while !stop.load(Ordering::Relaxed) && start.elapsed() < Duration::from_secs(600) {
                    match listener.accept() {
                        Ok((stream, _)) => drop(stream),
                        Err(_) => thread::sleep(Duration::from_micros(200)),
                    }
                }
            })
        };
        Acceptor {
            stop,
            thread: Some(thread),
        }
    }
}

impl Drop for Acceptor {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(thread) = self.thread.take() {
            let _ = thread.join();
        }
    }
}

/// The median enrolment of the first and of the last tenth of the pods:
/// whether a pod's cost grows with the pods enrolled before it.
fn by_tenth(samples: &[Duration]) -> String {
    let tenth = (samples.len() / 10).max(1);
    let median = |part: &[Duration]| {
        let mut sorted = part.to_vec();
        sorted.sort();
        sorted.get(sorted.len() / 2).copied().unwrap_or_default()
    };
    format!(
        "enrol p50 of the first tenth {:.1?}, of the last tenth {:.1?}",
        median(&samples[..tenth.min(samples.len())]),
        median(&samples[samples.len().saturating_sub(tenth)..])
    )
}

fn summary(samples: &[Duration]) -> String {
    let mut sorted: Vec<Duration> = samples.to_vec();
    sorted.sort();
    let at = |q: f64| sorted[((sorted.len() as f64 - 1.0) * q).round() as usize];
    if sorted.is_empty() {
        return "no samples".into();
    }
    format!(
        "p50 {:>9.1?}  p99 {:>9.1?}  max {:>9.1?}",
        at(0.5),
        at(0.99),
        at(1.0)
    )
}

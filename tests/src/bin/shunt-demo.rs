//! `shunt-demo`, the driver behind `cargo xtask demo`: builds one node with
//! three pods in network namespaces, runs the real `shunt agent` on it, sends
//! echo traffic between the pods while showing the agent's live status table,
//! then tears everything down (also on Ctrl-C / SIGTERM) and checks what it saw.
//!
//! Exit status: 0 when every check passed, 1 when one failed (the agent's log is
//! kept and its path printed), 128+N when stopped by signal N after a clean
//! teardown.

use std::{
    fs,
    io::{IsTerminal as _, Read as _, Write as _},
    net::{Shutdown, SocketAddr, TcpListener, TcpStream},
    path::{Path, PathBuf},
    process::ExitCode,
    sync::{
        Arc, Mutex,
        atomic::{AtomicBool, AtomicI32, AtomicU64, AtomicUsize, Ordering},
    },
    thread::{self, JoinHandle},
    time::{Duration, Instant},
};

use anyhow::{Context as _, bail};
use clap::Parser;
use nix::sys::signal::{SaFlags, SigAction, SigHandler, SigSet, Signal, sigaction};
use shunt::api::{NodeStatus, PodState, PodStatus};
use shunt_testbed::{
    Cgroup, NETNS_DIR, Pod, Topology,
    agent::{ADMIN_ADDR, Agent, WorkloadSpec, workloads_yaml},
};

const NODE: &str = "node-a";
const CLIENT: &str = "client";
const SERVER: &str = "server";
const OUTSIDER: &str = "outsider";
const ECHO_PORT: u16 = 8080;

/// One new connection per flow this often.
const CONNECT_EVERY: Duration = Duration::from_millis(100);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// Read/write timeout of every traffic socket, so no thread blocks for long.
const IO_TIMEOUT: Duration = Duration::from_secs(5);
/// Bytes an echo handler serves on one connection before hanging up.
const MAX_ECHO_BYTES: usize = 1 << 20;
/// Concurrent connections an echo server handles; more are refused.
const MAX_HANDLERS: usize = 16;
/// How long the agent gets to enrol the mesh pods.
const ENROL_TIMEOUT: Duration = Duration::from_secs(20);
/// Traffic threads stop at the latest this long after the requested duration.
const TRAFFIC_GRACE: Duration = Duration::from_secs(5);

/// `cargo xtask demo`'s driver: a local node in network namespaces, the shunt
/// agent at work on it, and live traffic between its pods.
#[derive(Parser)]
#[command(name = "shunt-demo")]
struct Args {
    /// The `shunt` binary to run as the agent.
    #[arg(long)]
    shunt: PathBuf,
    /// How long to show live traffic, in seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

/// The signal (SIGINT/SIGTERM) that asked us to stop, 0 while none did.
static STOP_SIGNAL: AtomicI32 = AtomicI32::new(0);

fn interrupted() -> Option<Signal> {
    match STOP_SIGNAL.load(Ordering::SeqCst) {
        0 => None,
        raw => Signal::try_from(raw).ok(),
    }
}

fn main() -> ExitCode {
    let args = Args::parse();
    let shunt = match args.shunt.canonicalize() {
        Ok(path) => path,
        Err(e) => {
            eprintln!(
                "shunt-demo: the shunt binary {} is not usable ({e}); build it with `cargo build -p shunt`",
                args.shunt.display()
            );
            return ExitCode::from(2);
        }
    };
    // SAFETY: no other thread exists yet (the signal thread and every traffic
    // thread are spawned below), so nothing can read the environment while it
    // changes. The testbed's `Agent` reads SHUNT_BIN to find the agent binary.
    unsafe { std::env::set_var("SHUNT_BIN", &shunt) };
    if let Err(e) = catch_stop_signals() {
        eprintln!("shunt-demo: {e:#}");
        return ExitCode::FAILURE;
    }
    match demo(&shunt, Duration::from_secs(args.seconds)) {
        Ok(()) => match interrupted() {
            Some(signal) => ExitCode::from(128 + signal as u8),
            None => ExitCode::SUCCESS,
        },
        Err(e) => {
            eprintln!("shunt-demo: {e:#}");
            ExitCode::FAILURE
        }
    }
}

/// Records SIGINT/SIGTERM in [`STOP_SIGNAL`]; the main loop notices and tears
/// down. Only an atomic store happens here, which is async-signal-safe.
extern "C" fn on_stop_signal(signal: libc::c_int) {
    let _ = STOP_SIGNAL.compare_exchange(0, signal, Ordering::SeqCst, Ordering::SeqCst);
}

/// Installs [`on_stop_signal`] for SIGINT and SIGTERM. A handler, not a
/// blocked mask and a `sigwait` thread: children inherit the signal mask
/// (std's `Command` no longer resets it), so the agent would never see its
/// SIGTERM, while handlers are reset to the default by `execve`.
fn catch_stop_signals() -> anyhow::Result<()> {
    let action = SigAction::new(
        SigHandler::Handler(on_stop_signal),
        SaFlags::SA_RESTART,
        SigSet::empty(),
    );
    for signal in [Signal::SIGINT, Signal::SIGTERM] {
        // SAFETY: the handler only does an atomic compare-exchange, which is
        // async-signal-safe, and it is a plain `extern "C" fn` that lives for
        // the whole process.
        unsafe { sigaction(signal, &action) }
            .with_context(|| format!("cannot install a handler for {signal}"))?;
    }
    Ok(())
}

/// Sleeps `duration` in short steps; false if a stop signal came meanwhile.
fn sleep_unless_interrupted(duration: Duration) -> bool {
    let until = Instant::now() + duration;
    while interrupted().is_none() {
        let now = Instant::now();
        if now >= until {
            return true;
        }
        thread::sleep((until - now).min(Duration::from_millis(50)));
    }
    false
}

fn demo(shunt: &Path, duration: Duration) -> anyhow::Result<()> {
    let mut topo = Topology::new("demo").context("cannot create the demo topology")?;
    let node = topo.add_node(NODE).context("cannot create the node")?;
    let client = topo
        .add_pod(NODE, CLIENT)
        .context("cannot create pod client")?;
    let server = topo
        .add_pod(NODE, SERVER)
        .context("cannot create pod server")?;
    let outsider = topo
        .add_pod(NODE, OUTSIDER)
        .context("cannot create pod outsider")?;
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&outsider, false),
    ]);
    // Declared after `topo`, so dropped before it on every path: the agent
    // goes before its namespaces do.
    // The library runs the agent with `--cgroup-root` set to the topology's
    // own cgroup, so its socket programs affect nothing else on the machine.
    let mut agent = Agent::start(&topo, &node, &yaml, &[]).context("cannot start the agent")?;

    let mut problems: Vec<String> = Vec::new();
    let mut last_status = None;
    match agent.wait_for(
        "pods client and server to be enrolled",
        ENROL_TIMEOUT,
        |status| {
            [CLIENT, SERVER]
                .iter()
                .all(|name| pod_status(status, name).is_some_and(|p| p.state == PodState::Enrolled))
        },
    ) {
        Ok(status) => last_status = Some(status),
        Err(e) => problems.push(first_line(&e.to_string())),
    }

    let pods = Pods {
        client,
        server,
        outsider,
    };
    let mut traffic = None;
    let mut tc_before = None;
    // The demo's own threads play the pods' applications, so the demo
    // process joins a cgroup below the agent's cgroup root, as a pod's
    // containers sit below a node's: the socket programs then see its
    // connects (and act on those made from enrolled pods only). The
    // topology moves it back when dropped.
    let apps = Cgroup::create(&topo, "apps").context("cannot create the apps cgroup")?;
    apps.add_pid(std::process::id())
        .context("cannot join the apps cgroup")?;
    if problems.is_empty() && interrupted().is_none() {
        print_intro(&topo, &agent, &pods, shunt, duration);
        match Traffic::start(&pods, duration) {
            Ok(t) => {
                live_table(&agent, &t, duration, &mut last_status, &mut problems);
                traffic = Some(t);
            }
            Err(e) => problems.push(format!("{e:#}")),
        }
        tc_before = Some(tc_filters(&pods.client));
    }

    // Teardown, whatever happened above.
    match interrupted() {
        Some(signal) => println!("\n== {signal}: stopping traffic and tearing down =="),
        None => println!("\n== teardown =="),
    }
    let flows = traffic.map(Traffic::stop).unwrap_or_default();
    let final_status = agent.status().ok().or(last_status);
    let counted_traffic = !flows.is_empty() && interrupted().is_none();
    check_traffic(&flows, counted_traffic, &mut problems);
    check_counters(final_status.as_ref(), counted_traffic, &mut problems);

    if let Some(before) = &tc_before {
        println!(
            "tc filters on client eth0 while enrolled:\n{}",
            indent(match before.as_deref() {
                Ok("") => "(none: already unenrolled)",
                Ok(text) => text,
                Err(_) => "(could not list them)",
            })
        );
    }
    match agent.stop() {
        Ok(status) if status.success() => println!("agent stopped (SIGTERM): {status}"),
        Ok(status) => problems.push(format!("the agent exited with {status} on SIGTERM")),
        Err(e) => problems.push(format!(
            "stopping the agent: {}",
            first_line(&e.to_string())
        )),
    }
    for pod in [&pods.client, &pods.server] {
        let after = tc_filters(pod);
        match after {
            Ok(text) if text.is_empty() => {
                println!(
                    "tc filters on {} eth0 after stop: none (unenrolled)",
                    pod.name()
                );
            }
            Ok(text) => {
                println!(
                    "tc filters on {} eth0 after stop:\n{}",
                    pod.name(),
                    indent(&text)
                );
                problems.push(format!(
                    "pod {} still has tc filters after the agent stopped",
                    pod.name()
                ));
            }
            Err(e) => problems.push(format!("listing tc filters of {}: {e}", pod.name())),
        }
    }
    match fs::read_dir(agent.pin_dir()) {
        Ok(entries) => {
            let names: Vec<String> = entries
                .flatten()
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .collect();
            println!(
                "pin dir {} after stop: {} (removed with the demo)",
                agent.pin_dir().display(),
                if names.is_empty() {
                    "empty".to_string()
                } else {
                    names.join(", ")
                }
            );
        }
        Err(_) => println!("pin dir {}: gone", agent.pin_dir().display()),
    }

    let kept_log = if problems.is_empty() {
        None
    } else {
        Some(keep_log(&agent))
    };
    drop(agent);
    let netns: Vec<String> = topo.netns_names().to_vec();
    drop(topo);
    let left: Vec<&String> = netns
        .iter()
        .filter(|name| Path::new(NETNS_DIR).join(name).exists())
        .collect();
    if left.is_empty() {
        println!(
            "deleted {} network namespaces: {}",
            netns.len(),
            netns.join(" ")
        );
    } else {
        problems.push(format!("network namespaces left behind: {left:?}"));
    }

    if !problems.is_empty() {
        let mut message = format!("demo FAILED:\n  - {}", problems.join("\n  - "));
        if let Some(log) = kept_log {
            message.push_str(&format!("\nagent log: {log}"));
        }
        bail!(message);
    }
    println!("{}", summary(&flows, final_status.as_ref()));
    Ok(())
}

struct Pods {
    client: Pod,
    server: Pod,
    outsider: Pod,
}

fn pod_status<'a>(status: &'a NodeStatus, name: &str) -> Option<&'a PodStatus> {
    status.pods.iter().find(|p| p.name == name)
}

fn print_intro(topo: &Topology, agent: &Agent, pods: &Pods, shunt: &Path, duration: Duration) {
    let node_ns = topo
        .node(NODE)
        .map(|n| n.netns_name().to_string())
        .unwrap_or_default();
    let node_ip = topo
        .node(NODE)
        .map(|n| n.ip().to_string())
        .unwrap_or_default();
    let gateway = topo
        .node(NODE)
        .map(|n| n.gateway().to_string())
        .unwrap_or_default();
    let mut out = String::new();
    out.push_str(
        "shunt demo: one node, three pods, each its own network namespace (198.18.0.0/15 only)\n\n",
    );
    out.push_str(&format!(
        "  node {NODE:<9} netns {node_ns:<26} fabric {node_ip}, pod gateway {gateway} (br0)\n"
    ));
    for (pod, mesh) in [
        (&pods.client, "in the mesh (dataplaneMode: ambient)"),
        (&pods.server, "in the mesh (dataplaneMode: ambient)"),
        (&pods.outsider, "NOT in the mesh (dataplaneMode: none)"),
    ] {
        out.push_str(&format!(
            "  pod  {:<9} netns {:<26} {:<13} {mesh}\n",
            pod.name(),
            pod.netns_name(),
            pod.ip().to_string()
        ));
    }
    let pid = agent
        .pid()
        .map(|p| p.to_string())
        .unwrap_or_else(|| "?".into());
    out.push_str(&format!(
        "\n  agent pid {pid}, in {node_ns}; admin API {ADMIN_ADDR} there\n"
    ));
    out.push_str(&format!("    bpf pins   {}\n", agent.pin_dir().display()));
    out.push_str(&format!(
        "    workloads  {}\n",
        agent.workloads_path().display()
    ));
    out.push_str(&format!(
        "    cgroup     {}   (its --cgroup-root)\n",
        agent.cgroup_root().display()
    ));
    out.push_str(&format!(
        "    log        {}   (removed at the end unless the demo fails)\n",
        agent.log_path().display()
    ));
    out.push_str(&format!(
        "\ntraffic for {}s, one connection per flow every {} ms, 2-5 KiB each, echo checked byte for byte:\n",
        duration.as_secs(),
        CONNECT_EVERY.as_millis()
    ));
    for flow in flow_specs(pods) {
        out.push_str(&format!("  {:<20} {}\n", flow.name, flow.kind));
    }
    out.push_str("\ntry meanwhile, in another terminal:\n");
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{node_ns} {} status\n",
        shunt.display()
    ));
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{} tc filter show dev eth0 ingress\n",
        pods.client.netns_name()
    ));
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{} tc filter show dev eth0 egress\n",
        pods.server.netns_name()
    ));
    out.push_str(&format!(
        "  nsenter --net={NETNS_DIR}/{} tc filter show dev eth0 ingress   # empty: not in the mesh\n",
        pods.outsider.netns_name()
    ));
    out.push_str(&format!("  ls {}\n", agent.pin_dir().display()));
    out.push_str(&format!("  tail -f {}\n", agent.log_path().display()));
    out.push_str("\nCtrl-C stops early; everything is torn down either way.\n");
    println!("{out}");
}

// ---------------------------------------------------------------------------
// Traffic

struct FlowSpec {
    name: String,
    kind: &'static str,
    from: Pod,
    to: SocketAddr,
}

fn flow_specs(pods: &Pods) -> Vec<FlowSpec> {
    let to = |pod: &Pod| SocketAddr::from((pod.ip(), ECHO_PORT));
    vec![
        FlowSpec {
            name: format!("{CLIENT} -> {SERVER}"),
            kind: "mesh -> mesh: connect4 -> proxy :15001 -> HBONE (mTLS, HTTP/2 CONNECT) -> :15008 -> app",
            from: pods.client.clone(),
            to: to(&pods.server),
        },
        FlowSpec {
            name: format!("{OUTSIDER} -> {SERVER}"),
            kind: "outside the mesh -> mesh: TC sk_assign -> proxy :15006 -> app",
            from: pods.outsider.clone(),
            to: to(&pods.server),
        },
        FlowSpec {
            name: format!("{CLIENT} -> {OUTSIDER}"),
            kind: "mesh -> outside the mesh: connect4 -> proxy :15001 -> plain TCP from the pod's IP",
            from: pods.client.clone(),
            to: to(&pods.outsider),
        },
    ]
}

/// Totals of one flow, updated by its thread.
#[derive(Default)]
struct FlowStats {
    name: String,
    ok: AtomicU64,
    failed: AtomicU64,
    /// Echoes that came back different from what was sent.
    wrong: AtomicU64,
    bytes: AtomicU64,
    last_error: Mutex<Option<String>>,
}

impl FlowStats {
    fn line(&self) -> String {
        let mut line = format!(
            "  {:<20} {:>4} ok  {:>3} failed  {:>3} wrong  {:>7.1} KiB echoed",
            self.name,
            self.ok.load(Ordering::Relaxed),
            self.failed.load(Ordering::Relaxed),
            self.wrong.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed) as f64 / 1024.0
        );
        if let Some(e) = self.last_error.lock().ok().and_then(|e| e.clone()) {
            line.push_str(&format!("  (last error: {e})"));
        }
        line
    }

    fn fail(&self, error: String) {
        self.failed.fetch_add(1, Ordering::Relaxed);
        if let Ok(mut last) = self.last_error.lock() {
            *last = Some(error);
        }
    }
}

struct Traffic {
    stop: Arc<AtomicBool>,
    servers: Vec<JoinHandle<()>>,
    clients: Vec<JoinHandle<()>>,
    flows: Vec<Arc<FlowStats>>,
}

impl Traffic {
    /// Echo servers in `server` and `outsider`, then one client thread per flow.
    fn start(pods: &Pods, duration: Duration) -> anyhow::Result<Traffic> {
        let stop = Arc::new(AtomicBool::new(false));
        let mut traffic = Traffic {
            stop: stop.clone(),
            servers: Vec::new(),
            clients: Vec::new(),
            flows: Vec::new(),
        };
        // On an error below, whatever started is stopped before returning.
        let result = (|| -> anyhow::Result<()> {
            for pod in [&pods.server, &pods.outsider] {
                let addr = SocketAddr::from((pod.ip(), ECHO_PORT));
                let listener = pod
                    .listen_tcp(addr)
                    .with_context(|| format!("echo server in {}", pod.name()))?;
                listener
                    .set_nonblocking(true)
                    .context("making the echo listener non-blocking")?;
                let stop = stop.clone();
                let handle = thread::Builder::new()
                    .name(format!("echo-{}", pod.name()))
                    .spawn(move || echo_server(listener, &stop))
                    .context("cannot start an echo server thread")?;
                traffic.servers.push(handle);
            }
            // Hard bound on the client loops, even if nobody sets `stop`.
            let deadline = Instant::now() + duration + TRAFFIC_GRACE;
            let max_conns = (duration + TRAFFIC_GRACE).as_millis() / CONNECT_EVERY.as_millis() + 1;
            for (index, spec) in flow_specs(pods).into_iter().enumerate() {
                let stats = Arc::new(FlowStats {
                    name: spec.name.clone(),
                    ..FlowStats::default()
                });
                traffic.flows.push(stats.clone());
                let stop = stop.clone();
                let handle = thread::Builder::new()
                    .name(format!("flow-{index}"))
                    .spawn(move || {
                        client_loop(
                            &spec,
                            index as u64,
                            &stats,
                            &stop,
                            deadline,
                            max_conns as u64,
                        );
                    })
                    .context("cannot start a traffic thread")?;
                traffic.clients.push(handle);
            }
            Ok(())
        })();
        match result {
            Ok(()) => Ok(traffic),
            Err(e) => {
                traffic.stop();
                Err(e)
            }
        }
    }

    /// Stops every thread (each is bounded by timeouts) and returns the totals.
    fn stop(self) -> Vec<Arc<FlowStats>> {
        self.stop.store(true, Ordering::SeqCst);
        for handle in self.clients.into_iter().chain(self.servers) {
            let _ = handle.join();
        }
        self.flows
    }
}

/// The bytes sent on connection `n` of flow `flow`: 2-5 KiB, content unique
/// enough that a mixed-up or shifted echo is caught.
fn payload(flow: u64, n: u64) -> Vec<u8> {
    let len = 2048 + (n % 4) as usize * 1024;
    (0..len)
        .map(|i| ((i as u64).wrapping_mul(31).wrapping_add(n * 7 + flow * 101) % 251) as u8)
        .collect()
}

fn client_loop(
    spec: &FlowSpec,
    flow: u64,
    stats: &FlowStats,
    stop: &AtomicBool,
    deadline: Instant,
    max_conns: u64,
) {
    for n in 0..max_conns {
        if stop.load(Ordering::SeqCst) || Instant::now() >= deadline {
            break;
        }
        let started = Instant::now();
        let sent = payload(flow, n);
        match exchange(spec, &sent) {
            Ok(back) if back == sent => {
                stats.ok.fetch_add(1, Ordering::Relaxed);
                stats.bytes.fetch_add(back.len() as u64, Ordering::Relaxed);
            }
            Ok(back) => {
                stats.wrong.fetch_add(1, Ordering::Relaxed);
                if let Ok(mut last) = stats.last_error.lock() {
                    *last = Some(format!(
                        "connection {n}: sent {} bytes, got back {} different ones",
                        sent.len(),
                        back.len()
                    ));
                }
            }
            Err(e) => stats.fail(format!("connection {n}: {e:#}")),
        }
        if let Some(rest) = CONNECT_EVERY.checked_sub(started.elapsed()) {
            thread::sleep(rest);
        }
    }
}

/// One connection: send `sent`, half-close, read the echo until EOF.
fn exchange(spec: &FlowSpec, sent: &[u8]) -> anyhow::Result<Vec<u8>> {
    let mut stream = spec.from.connect_tcp(spec.to, CONNECT_TIMEOUT)?;
    stream.set_read_timeout(Some(IO_TIMEOUT))?;
    stream.set_write_timeout(Some(IO_TIMEOUT))?;
    stream.write_all(sent).context("sending")?;
    stream.shutdown(Shutdown::Write).context("half-closing")?;
    let mut back = Vec::with_capacity(sent.len());
    // One byte more than sent, so an over-long echo shows as wrong.
    (&mut stream)
        .take(sent.len() as u64 + 1)
        .read_to_end(&mut back)
        .context("reading the echo")?;
    Ok(back)
}

/// Accepts until `stop`, one bounded handler thread per connection, at most
/// [`MAX_HANDLERS`] at once; joins them all before returning.
fn echo_server(listener: TcpListener, stop: &AtomicBool) {
    let active = Arc::new(AtomicUsize::new(0));
    let mut handlers: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::SeqCst) {
        match listener.accept() {
            Ok((conn, _peer)) => {
                handlers.retain(|h| !h.is_finished());
                if active.load(Ordering::SeqCst) >= MAX_HANDLERS {
                    drop(conn);
                    continue;
                }
                active.fetch_add(1, Ordering::SeqCst);
                let active_in = active.clone();
                let spawned = thread::Builder::new()
                    .name("echo-conn".into())
                    .spawn(move || {
                        echo_one(conn);
                        active_in.fetch_sub(1, Ordering::SeqCst);
                    });
                match spawned {
                    Ok(handle) => handlers.push(handle),
                    Err(_) => {
                        active.fetch_sub(1, Ordering::SeqCst);
                    }
                }
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                thread::sleep(Duration::from_millis(10));
            }
            Err(_) => thread::sleep(Duration::from_millis(50)),
        }
    }
    for handle in handlers {
        let _ = handle.join();
    }
}

/// Echoes until EOF, an error, [`MAX_ECHO_BYTES`] or [`IO_TIMEOUT`] of silence.
fn echo_one(mut conn: TcpStream) {
    if conn.set_nonblocking(false).is_err()
        || conn.set_read_timeout(Some(IO_TIMEOUT)).is_err()
        || conn.set_write_timeout(Some(IO_TIMEOUT)).is_err()
    {
        return;
    }
    let mut buf = [0u8; 16 * 1024];
    let mut total = 0;
    while total < MAX_ECHO_BYTES {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => {
                if conn.write_all(&buf[..n]).is_err() {
                    break;
                }
                total += n;
            }
        }
    }
}

// ---------------------------------------------------------------------------
// Live table and checks

fn live_table(
    agent: &Agent,
    traffic: &Traffic,
    duration: Duration,
    last_status: &mut Option<NodeStatus>,
    problems: &mut Vec<String>,
) {
    let terminal = std::io::stdout().is_terminal();
    let start = Instant::now();
    let mut failures_in_a_row = 0;
    for second in 1..=duration.as_secs() {
        let due = start + Duration::from_secs(second);
        if !sleep_unless_interrupted(due.saturating_duration_since(Instant::now())) {
            return;
        }
        let mut out = String::new();
        if terminal {
            out.push_str("\x1b[2J\x1b[H");
        } else {
            out.push('\n');
        }
        out.push_str(&format!(
            "== shunt demo: {second}s of {}s (Ctrl-C stops) ==\n",
            duration.as_secs()
        ));
        match agent.status() {
            Ok(status) => {
                failures_in_a_row = 0;
                out.push_str(&shunt::status::render_table(&status));
                *last_status = Some(status);
            }
            Err(e) => {
                failures_in_a_row += 1;
                out.push_str(&format!("agent status unavailable: {e}\n"));
            }
        }
        out.push_str("traffic\n");
        for flow in &traffic.flows {
            out.push_str(&flow.line());
            out.push('\n');
        }
        print!("{out}");
        let _ = std::io::stdout().flush();
        if failures_in_a_row >= 3 {
            problems.push("the agent stopped answering on its admin API".into());
            return;
        }
    }
}

fn check_traffic(flows: &[Arc<FlowStats>], expect_activity: bool, problems: &mut Vec<String>) {
    println!("traffic totals");
    for flow in flows {
        println!("{}", flow.line());
        let wrong = flow.wrong.load(Ordering::Relaxed);
        let failed = flow.failed.load(Ordering::Relaxed);
        if wrong > 0 {
            problems.push(format!("{}: {wrong} echoes came back wrong", flow.name));
        }
        if failed > 0 {
            problems.push(format!("{}: {failed} connections failed", flow.name));
        }
        if expect_activity && flow.ok.load(Ordering::Relaxed) == 0 {
            problems.push(format!("{}: no connection succeeded", flow.name));
        }
    }
}

fn check_counters(status: Option<&NodeStatus>, expect_activity: bool, problems: &mut Vec<String>) {
    let Some(status) = status else {
        problems.push("never got a status from the agent".into());
        return;
    };
    for name in [CLIENT, SERVER] {
        match pod_status(status, name) {
            None => problems.push(format!("pod {name} is missing from the agent's status")),
            Some(pod) => {
                let c = pod.counters.unwrap_or_default();
                if expect_activity && (c.packets_in == 0 || c.packets_out == 0) {
                    problems.push(format!(
                        "pod {name} is in the mesh but its counters stayed zero ({c:?})"
                    ));
                }
                if let Some(hook) = pod.hooks.iter().find(|h| !h.present) {
                    problems.push(format!("pod {name}: hook {} is missing", hook.name));
                }
            }
        }
    }
    // Each flow took its path through the proxy.
    if expect_activity {
        let proxy = status.proxy.clone().unwrap_or_default();
        for (path, count) in [
            ("HBONE out (client -> server)", proxy.outbound_hbone),
            ("HBONE in (client -> server)", proxy.inbound_hbone),
            ("plaintext in (outsider -> server)", proxy.inbound_plaintext),
            (
                "passthrough (client -> outsider)",
                proxy.outbound_passthrough,
            ),
        ] {
            if count == 0 {
                problems.push(format!("no connection went through the proxy's {path}"));
            }
        }
    }
    match pod_status(status, OUTSIDER) {
        None => problems.push("pod outsider is missing from the agent's status".into()),
        Some(pod) => {
            if pod.state != PodState::NotInMesh {
                problems.push(format!(
                    "pod outsider is not in the mesh but its state is {:?}",
                    pod.state
                ));
            }
            if pod.counters.is_some_and(|c| c != Default::default()) || !pod.hooks.is_empty() {
                problems.push(format!(
                    "pod outsider is not in the mesh but has counters {:?} / hooks {:?}",
                    pod.counters, pod.hooks
                ));
            }
        }
    }
}

/// `tc filter show dev eth0 ingress` and `egress` in the pod, concatenated.
fn tc_filters(pod: &Pod) -> anyhow::Result<String> {
    let mut text = String::new();
    for direction in ["ingress", "egress"] {
        let out = pod
            .command("tc")
            .args(["filter", "show", "dev", pod.interface(), direction])
            .output()
            .context("cannot run tc")?;
        let stdout = String::from_utf8_lossy(&out.stdout);
        if !out.status.success() {
            bail!(
                "tc filter show {direction} in {} failed ({}): {}",
                pod.name(),
                out.status,
                String::from_utf8_lossy(&out.stderr).trim()
            );
        }
        if !stdout.trim().is_empty() {
            text.push_str(&format!("[{direction}]\n{}\n", stdout.trim_end()));
        }
    }
    Ok(text.trim_end().to_string())
}

/// The testbed's agent errors end with the whole agent log; the log is kept
/// and its path printed, so a problem line keeps only the first line.
fn first_line(text: &str) -> String {
    match text.split_once('\n') {
        Some((first, _)) => format!("{first} (see the agent log)"),
        None => text.to_string(),
    }
}

fn indent(text: &str) -> String {
    text.lines()
        .map(|l| format!("    {l}"))
        .collect::<Vec<_>>()
        .join("\n")
}

/// Copies the agent's log out of its temp dir (removed with the agent) and
/// returns where it is now.
fn keep_log(agent: &Agent) -> String {
    let kept = std::env::temp_dir().join(format!("shunt-demo-{}-agent.log", std::process::id()));
    match fs::copy(agent.log_path(), &kept) {
        Ok(_) => kept.display().to_string(),
        Err(e) => format!(
            "{} (could not be kept: {e}; it is removed with the demo)",
            agent.log_path().display()
        ),
    }
}

fn summary(flows: &[Arc<FlowStats>], status: Option<&NodeStatus>) -> String {
    let flows = flows
        .iter()
        .map(|f| {
            format!(
                "{} {} conns, {:.0} KiB echoed",
                f.name,
                f.ok.load(Ordering::Relaxed),
                f.bytes.load(Ordering::Relaxed) as f64 / 1024.0
            )
        })
        .collect::<Vec<_>>()
        .join("; ");
    let counters = [CLIENT, SERVER]
        .iter()
        .filter_map(|name| {
            let c = status.and_then(|s| pod_status(s, name))?.counters?;
            Some(format!(
                "{name} counters in {} pkts / out {} pkts",
                c.packets_in, c.packets_out
            ))
        })
        .collect::<Vec<_>>()
        .join(", ");
    let verdict = match interrupted() {
        Some(signal) => format!("demo stopped by {signal}, torn down cleanly"),
        None => "demo ok".to_string(),
    };
    format!(
        "{verdict}: {flows}; {counters}; outsider: no counters (not in the mesh); every pod unenrolled, namespaces deleted"
    )
}

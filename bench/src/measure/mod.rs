//! Measuring (the harness): builds one topology per redirection mode (two nodes, a
//! client pod and four server pods each), starts the real agents, starts a
//! server in every server pod, then runs every workload over every path,
//! interleaved, for every placement and repetition. Each measurement is one
//! load-generator process in the client pod (and in the apps cgroup below
//! the agent's cgroup root); each is checked (bytes and content by the load
//! generator and the sink, connections and bytes by the proxy's counters).
//!
//! ```text
//!   node-a: client (mesh)  same-mesh (mesh)  same-plain (not in the mesh)
//!   node-b:                cross-mesh (mesh) cross-plain (not in the mesh)
//! ```
//!
//! The direct topology has no agent at all: it is the physical limit.
//!
//! With `--policies N,M,…` every repetition measures each workload and path
//! once per count of AuthorizationPolicies on the destination (see
//! [`policies`]), applied through the agents' workloads files before the
//! paths run, so the counts are interleaved like the paths.

mod bed;
mod fd_limit;
mod policies;
mod ztunnel;

use std::{
    collections::BTreeMap,
    io::Read,
    path::{Path, PathBuf},
    process::{Command, Stdio},
    time::{Duration, Instant, SystemTime, UNIX_EPOCH},
};

use anyhow::{Context as _, bail};
use bed::{AgentsCgroup, Bed, CLIENT, Owned, target_pod};
use shunt::proxy::ProxyStats;
use shunt_testbed::agent::Agent;

use crate::{
    client::{ClientReport, WorkloadKind},
    model::{
        Dest, ECHO_PORT, Mode, PathSpec, Placement, ProxyCheck, Record, RunResults, SINK_PORT,
        Workload, workloads,
    },
    sys::{self, Machine},
};

#[derive(Clone, Debug)]
pub struct Options {
    pub quick: bool,
    pub reps: usize,
    pub placements: Vec<Placement>,
    pub pin_cpu: usize,
    /// Path ids to run (empty: all).
    pub only_paths: Vec<String>,
    /// Workload ids to run (empty: all).
    pub only_workloads: Vec<String>,
    /// This binary (run again as client and server inside the pods).
    pub bench_bin: PathBuf,
    pub workspace: PathBuf,
    /// Where to keep the agents' logs when a measurement fails (they go
    /// with the topology otherwise).
    pub logs_dir: Option<PathBuf>,
    /// Numbers of AuthorizationPolicies on the destination to measure
    /// with, in turn (empty: none, and the agents' files name none).
    pub policies: Vec<usize>,
    /// A stock ztunnel to measure beside shunt (its paths are added).
    pub ztunnel: Option<ZtunnelRun>,
}

/// The reference ztunnel (`--ztunnel`).
#[derive(Clone, Debug)]
pub struct ZtunnelRun {
    pub binary: PathBuf,
    /// Its log filter (`RUST_LOG`).
    pub log: String,
}

fn proxy_stats(agent: &Agent) -> Option<ProxyStats> {
    agent.status().ok().and_then(|s| s.proxy)
}

/// Payload bytes the kernel spliced between the client pod and its proxy.
///
/// The agent reads kernel counters on its verify passes, not per request:
/// `fresh` waits for a pass that started after this call (what the bytes
/// just moved need); otherwise the last pass's figure is taken (enough for
/// the baseline, which the previous measurement's fresh read left current).
fn client_spliced_bytes(agent: &Agent, fresh: bool) -> Option<u64> {
    let status = if fresh {
        agent.status_after_verify(Duration::from_secs(15)).ok()?
    } else {
        agent.status().ok()?
    };
    let client = status.pods.iter().find(|p| p.name == CLIENT)?;
    Some(client.counters?.spliced_bytes)
}

fn cpus_for(placement: Placement, pin_cpu: usize) -> Vec<usize> {
    match placement {
        Placement::Pinned => vec![pin_cpu],
        Placement::Scheduler => (0..sys::cpu_count()).collect(),
    }
}

/// Runs the whole benchmark; the caller writes the reports.
pub fn run(options: &Options) -> anyhow::Result<RunResults> {
    shunt_testbed::require_root()?;
    let started = Instant::now();
    let started_unix = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    let ncpu = sys::cpu_count();
    if options.pin_cpu >= ncpu {
        bail!(
            "--pin-cpu {} but the machine has {ncpu} CPUs",
            options.pin_cpu
        );
    }
    let machine = Machine::probe(&options.workspace);
    let shunt_binary = shunt_testbed::agent::shunt_binary()?;
    let load_average_start = sys::load_average();
    let workloads: Vec<Workload> = workloads(options.quick)
        .into_iter()
        .filter(|w| options.only_workloads.is_empty() || options.only_workloads.contains(&w.id))
        .collect();
    if let Some(run) = &options.ztunnel {
        ztunnel::check_binary(&run.binary)?;
    }
    let ztunnel_paths = if options.ztunnel.is_some() {
        PathSpec::ztunnel()
    } else {
        Vec::new()
    };
    let paths: Vec<PathSpec> = PathSpec::all()
        .into_iter()
        .chain(ztunnel_paths)
        .filter(|p| options.only_paths.is_empty() || options.only_paths.contains(&p.id()))
        .collect();
    if workloads.is_empty() || paths.is_empty() {
        bail!("nothing to run: no workload or no path matches the filters");
    }
    if !options.policies.is_empty() && paths.iter().any(|p| p.mode == Mode::Direct) {
        bail!("--policies needs mesh paths only: a direct path has no agent to enforce them");
    }
    // `None`: the run does not vary policies.
    let levels: Vec<Option<usize>> = if options.policies.is_empty() {
        vec![None]
    } else {
        options.policies.iter().copied().map(Some).collect()
    };
    eprintln!(
        "shunt-bench: {} paths × {} workloads × {} placements × {} repetitions; agent {} (log wrapper)",
        paths.len(),
        workloads.len(),
        options.placements.len(),
        options.reps,
        shunt_binary.display()
    );

    let mut modes: Vec<Mode> = paths.iter().map(|p| p.mode).collect();
    modes.sort();
    modes.dedup();
    let mut beds = BTreeMap::new();
    for mode in modes {
        let t = Instant::now();
        let bed = Bed::build(mode, &options.bench_bin, options.ztunnel.as_ref())
            .with_context(|| format!("building the {} topology", mode.name()))?;
        // The proxies' pids, for profiles taken around the run.
        let pids: Vec<String> = bed.agent_pids().iter().map(u32::to_string).collect();
        eprintln!(
            "shunt-bench: {} topology ready ({:.1}s); proxy pids: {}",
            mode.name(),
            t.elapsed().as_secs_f64(),
            pids.join(" ")
        );
        beds.insert(mode, bed);
    }

    // Measurements the proxies' descriptor limits cannot hold: skipped,
    // each said once.
    let mut notes = Vec::new();
    let mut skipped = Vec::new();
    for workload in &workloads {
        for &path in &paths {
            let limits: Vec<(u32, u64)> = beds[&path.mode]
                .agent_pids()
                .into_iter()
                .filter_map(|pid| fd_limit::hard_nofile(pid).map(|l| (pid, l)))
                .collect();
            if let Some(reason) = fd_limit::skip_reason(path, workload, &limits) {
                eprintln!("shunt-bench: {reason}");
                notes.push(reason);
                skipped.push((workload.id.clone(), path));
            }
        }
    }
    let is_skipped =
        |w: &Workload, p: &PathSpec| skipped.iter().any(|(id, sp)| *id == w.id && sp == p);
    let cpu_start = sys::CpuTimes::read().unwrap_or_default();
    let per_pass: usize = workloads
        .iter()
        .map(|w| paths.iter().filter(|p| !is_skipped(w, p)).count())
        .sum();
    let total = options.reps * options.placements.len() * levels.len() * per_pass;
    let mut records = Vec::with_capacity(total);
    let measuring = Instant::now();
    for rep in 0..options.reps {
        for &placement in &options.placements {
            for &level in &levels {
                if let Some(count) = level {
                    for bed in beds.values() {
                        bed.set_policies(count).with_context(|| {
                            format!(
                                "applying {count} policies in the {} topology",
                                bed.mode.name()
                            )
                        })?;
                    }
                }
                for (wi, workload) in workloads.iter().enumerate() {
                    // Paths interleaved, in an order that rotates between
                    // workloads and repetitions so none always goes first.
                    let shift = (rep * 3 + wi) % paths.len();
                    let order: Vec<PathSpec> = paths[shift..]
                        .iter()
                        .chain(&paths[..shift])
                        .copied()
                        .collect();
                    for path in order.into_iter().filter(|p| !is_skipped(workload, p)) {
                        let bed = &beds[&path.mode];
                        let mut record = measure(options, bed, path, workload, placement, rep);
                        record.policies = level;
                        let done = records.len() + 1;
                        let eta =
                            measuring.elapsed().as_secs_f64() / done as f64 * (total - done) as f64;
                        eprintln!(
                            "[{done}/{total} rep {} {} {}{}] {:<20} {}{}",
                            rep + 1,
                            placement.name(),
                            workload.id,
                            level.map(|n| format!(" {n} policies")).unwrap_or_default(),
                            path.id(),
                            crate::report::one_line(&record, workload),
                            if done % 10 == 0 {
                                format!("  (eta {:.0}s)", eta)
                            } else {
                                String::new()
                            }
                        );
                        records.push(record);
                    }
                }
            }
        }
    }
    // Leave every process unpinned.
    set_placement(&beds, Placement::Scheduler, options.pin_cpu);
    if records.iter().any(|r| !r.verified)
        && let Some(dir) = &options.logs_dir
    {
        keep_agent_logs(&beds, dir);
    }
    let cpu_end = sys::CpuTimes::read().unwrap_or_default();
    for bed in beds.values_mut() {
        bed.stop_agents();
    }
    drop(beds);
    Ok(RunResults {
        name: String::new(),
        quick: options.quick,
        started_unix,
        duration_s: started.elapsed().as_secs_f64(),
        machine,
        shunt_binary: shunt_binary.display().to_string(),
        reps: options.reps,
        pin_cpu: options.pin_cpu,
        placements: options.placements.clone(),
        workloads,
        paths,
        load_average_start,
        load_average_end: sys::load_average(),
        machine_cpu: cpu_end.delta(&cpu_start),
        records,
        notes,
        policies: options.policies.clone(),
    })
}

/// Copies every agent's log to `dir` (`<mode>-<node>.log`).
fn keep_agent_logs(beds: &BTreeMap<Mode, Bed>, dir: &Path) {
    if let Err(e) = std::fs::create_dir_all(dir) {
        eprintln!(
            "shunt-bench: cannot keep agent logs in {}: {e}",
            dir.display()
        );
        return;
    }
    for bed in beds.values() {
        for (pod, log) in bed.ztunnel_logs() {
            let file = dir.join(format!("ztunnel-{pod}.log"));
            match std::fs::copy(&log, &file) {
                Ok(_) => eprintln!("shunt-bench: ztunnel log kept in {}", file.display()),
                Err(e) => eprintln!("shunt-bench: cannot copy {}: {e}", log.display()),
            }
        }
        for (node, agent) in &bed.agents {
            let file = dir.join(format!("{}-{node}.log", bed.mode.name()));
            match std::fs::write(&file, agent.logs()) {
                Ok(()) => eprintln!("shunt-bench: agent log kept in {}", file.display()),
                Err(e) => eprintln!("shunt-bench: cannot write {}: {e}", file.display()),
            }
        }
    }
}

fn set_placement(beds: &BTreeMap<Mode, Bed>, placement: Placement, pin_cpu: usize) {
    let cpus = cpus_for(placement, pin_cpu);
    for bed in beds.values() {
        for pid in bed.agent_pids() {
            let _ = sys::set_affinity_all_threads(pid, &cpus);
        }
        for server in bed.servers.values() {
            let _ = sys::set_affinity_all_threads(server.0.id(), &cpus);
        }
    }
    let _ = sys::set_affinity_all_threads(std::process::id(), &harness_cpus(placement, pin_cpu));
}

/// Where the harness itself runs: off the pinned CPU when pinning (it only
/// waits, but it should not share the measured CPU).
fn harness_cpus(placement: Placement, pin_cpu: usize) -> Vec<usize> {
    let all: Vec<usize> = (0..sys::cpu_count()).collect();
    match placement {
        Placement::Pinned if all.len() > 1 => all.into_iter().filter(|&c| c != pin_cpu).collect(),
        _ => all,
    }
}

fn measure(
    options: &Options,
    bed: &Bed,
    path: PathSpec,
    workload: &Workload,
    placement: Placement,
    rep: usize,
) -> Record {
    let mut problems = Vec::new();
    let cpus = cpus_for(placement, options.pin_cpu);
    let target = target_pod(&path);
    // Place the path's processes: its agents (every thread) and its server.
    for pid in bed.agent_pids() {
        if let Err(e) = sys::set_affinity_all_threads(pid, &cpus) {
            problems.push(format!("cannot place agent {pid}: {e}"));
        }
    }
    if let Some(server) = bed.servers.get(target)
        && let Err(e) = sys::set_affinity_all_threads(server.0.id(), &cpus)
    {
        problems.push(format!("cannot place the server: {e}"));
    }
    let _ = sys::set_affinity_all_threads(
        std::process::id(),
        &harness_cpus(placement, options.pin_cpu),
    );

    let client_node = "node-a";
    let target_node = bed.pods[target].node().name().to_string();
    let before_client = bed.agent_on(client_node).and_then(proxy_stats);
    let before_server = bed.agent_on(&target_node).and_then(proxy_stats);
    let before_ztunnel =
        (bed.mode == Mode::Ztunnel).then(|| ztunnel::source_connections(&bed.pods[CLIENT]));
    let spliced_before = bed
        .agent_on(client_node)
        .and_then(|agent| client_spliced_bytes(agent, false));

    let port = if workload.kind == WorkloadKind::Stream {
        SINK_PORT
    } else {
        ECHO_PORT
    };
    let addr = format!("{}:{port}", bed.pods[target].ip());
    let report = match run_client(options, bed, workload, &addr, &cpus) {
        Ok(report) => report,
        Err(e) => ClientReport {
            error: Some(format!("{e:#}")),
            ..Default::default()
        },
    };
    if !report.ok {
        problems.push(format!(
            "load generator: {}",
            report.error.clone().unwrap_or_else(|| "failed".into())
        ));
    }
    if report.bytes_sent == 0 || report.bytes_received == 0 {
        problems.push("no bytes moved".into());
    }

    let proxy = if bed.mode == Mode::Direct {
        None
    } else if bed.mode == Mode::Ztunnel {
        Some(ztunnel::check(
            &bed.pods[CLIENT],
            before_ztunnel,
            &report,
            &mut problems,
        ))
    } else if bed.mode == Mode::EbpfFastPath {
        Some(check_around_proxy(
            bed,
            client_node,
            before_client,
            &mut problems,
        ))
    } else {
        let mut check = check_proxy(
            bed,
            path,
            &report,
            client_node,
            &target_node,
            before_client,
            before_server,
            &mut problems,
        );
        // Only the splice path waits for a verify pass: elsewhere nothing
        // is ever spliced, and the last pass's zero is the answer.
        let spliced_after = bed
            .agent_on(client_node)
            .and_then(|agent| client_spliced_bytes(agent, bed.mode == Mode::EbpfSplice));
        check.spliced_bytes = spliced_after
            .zip(spliced_before)
            .map_or(0, |(after, before)| after.saturating_sub(before));
        // Each path must be what it claims: spliced exactly when splice is on.
        match (bed.mode == Mode::EbpfSplice, check.spliced_bytes) {
            (true, 0) => problems.push("splice is on but no byte was spliced".into()),
            (false, n) if n > 0 => {
                problems.push(format!("splice is off but {n} bytes were spliced"))
            }
            _ => {}
        }
        Some(check)
    };
    let memory: Vec<(u64, u64)> = bed
        .agent_pids()
        .into_iter()
        .filter_map(sys::process_memory_kib)
        .collect();
    Record {
        path,
        path_id: path.id(),
        workload: workload.id.clone(),
        placement,
        rep,
        verified: problems.is_empty(),
        report,
        proxy,
        agent_rss_kib: memory.iter().map(|m| m.0).collect(),
        agent_hwm_kib: memory.iter().map(|m| m.1).collect(),
        load_average: sys::load_average(),
        problems,
        policies: None,
    }
}

/// The fast path must take every connection around the proxy: its
/// counters must not move (the kernel's own count of direct connects is in
/// the agent's metrics; the load generator checked the bytes).
fn check_around_proxy(
    bed: &Bed,
    client_node: &str,
    before_client: Option<ProxyStats>,
    problems: &mut Vec<String>,
) -> ProxyCheck {
    let after = bed.agent_on(client_node).and_then(proxy_stats);
    let (Some(before), Some(after)) = (before_client, after) else {
        problems.push("cannot read the agents' proxy counters".into());
        return ProxyCheck::default();
    };
    let check = ProxyCheck {
        // Passthrough (flow 1) and same-node mesh (flow 2) alike.
        client_side: (after.outbound_passthrough + after.outbound_hbone)
            .saturating_sub(before.outbound_passthrough + before.outbound_hbone),
        bytes_out: after.bytes_out.saturating_sub(before.bytes_out),
        bytes_in: after.bytes_in.saturating_sub(before.bytes_in),
        ..ProxyCheck::default()
    };
    if check.client_side > 0 {
        problems.push(format!(
            "the fast path is on but the proxy carried {} connections",
            check.client_side
        ));
    }
    check
}

/// Waits (bounded) until the proxies' counters account for every connection
/// and byte of the run; records what they saw either way.
#[allow(clippy::too_many_arguments)]
fn check_proxy(
    bed: &Bed,
    path: PathSpec,
    report: &ClientReport,
    client_node: &str,
    target_node: &str,
    before_client: Option<ProxyStats>,
    before_server: Option<ProxyStats>,
    problems: &mut Vec<String>,
) -> ProxyCheck {
    let (Some(before_client), Some(before_server)) = (before_client, before_server) else {
        problems.push("cannot read the agents' proxy counters".into());
        return ProxyCheck::default();
    };
    let deadline = Instant::now() + Duration::from_secs(5);
    let mut check = ProxyCheck::default();
    // Bounded by the deadline (and a count, should the clock stall).
    for _ in 0..200 {
        let after_client = bed.agent_on(client_node).and_then(proxy_stats);
        let after_server = bed.agent_on(target_node).and_then(proxy_stats);
        if let (Some(a), Some(b)) = (after_client, after_server) {
            let client_side = match path.dest {
                Dest::Plain => a
                    .outbound_passthrough
                    .saturating_sub(before_client.outbound_passthrough),
                Dest::Hbone => a
                    .outbound_hbone
                    .saturating_sub(before_client.outbound_hbone),
            };
            let server_side = match path.dest {
                Dest::Plain => 0,
                Dest::Hbone => b.inbound_hbone.saturating_sub(before_server.inbound_hbone),
            };
            let same_agent = client_node == target_node;
            check = ProxyCheck {
                client_side,
                server_side,
                bytes_out: a.bytes_out.saturating_sub(before_client.bytes_out),
                bytes_in: a.bytes_in.saturating_sub(before_client.bytes_in),
                refused: (a.refused.saturating_sub(before_client.refused))
                    + if same_agent {
                        0
                    } else {
                        b.refused.saturating_sub(before_server.refused)
                    },
                failed: (a.failed.saturating_sub(before_client.failed))
                    + if same_agent {
                        0
                    } else {
                        b.failed.saturating_sub(before_server.failed)
                    },
                spliced_bytes: 0,
            };
            let complete = check.client_side >= report.connections
                && (path.dest == Dest::Plain || check.server_side >= report.connections)
                && check.bytes_out >= report.bytes_sent
                && check.bytes_in >= report.bytes_received;
            if complete || Instant::now() >= deadline {
                break;
            }
        } else if Instant::now() >= deadline {
            break;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    if check.client_side < report.connections {
        problems.push(format!(
            "the client's proxy completed {} {} for {} connections: traffic went around it",
            check.client_side,
            match path.dest {
                Dest::Plain => "passthrough connections",
                Dest::Hbone => "HBONE streams",
            },
            report.connections
        ));
    }
    if path.dest == Dest::Hbone && check.server_side < report.connections {
        problems.push(format!(
            "the destination's proxy completed {} inbound HBONE streams for {} connections",
            check.server_side, report.connections
        ));
    }
    if check.bytes_out < report.bytes_sent || check.bytes_in < report.bytes_received {
        problems.push(format!(
            "the proxy carried {}/{} bytes out/in, the load generator {}/{}",
            check.bytes_out, check.bytes_in, report.bytes_sent, report.bytes_received
        ));
    }
    if check.refused + check.failed > 0 {
        problems.push(format!(
            "the proxies refused {} and failed {} connections",
            check.refused, check.failed
        ));
    }
    check
}

fn run_client(
    options: &Options,
    bed: &Bed,
    workload: &Workload,
    addr: &str,
    cpus: &[usize],
) -> anyhow::Result<ClientReport> {
    let kind = match workload.kind {
        WorkloadKind::Rr => "rr",
        WorkloadKind::Crr => "crr",
        WorkloadKind::Stream => "stream",
        WorkloadKind::Rate => "rate",
        WorkloadKind::Idle => "idle",
    };
    let cpu_list: Vec<String> = cpus.iter().map(usize::to_string).collect();
    let mut cmd: Command = bed.pods[CLIENT].command(&options.bench_bin);
    cmd.args([
        "client",
        "--workload",
        kind,
        "--addr",
        addr,
        "--seconds",
        &workload.seconds.to_string(),
        "--warmup",
        &workload.warmup.to_string(),
        "--size",
        &workload.size.to_string(),
        "--conns",
        &workload.conns.to_string(),
        "--rate",
        &workload.rate.to_string(),
        "--cpus",
        &cpu_list.join(","),
    ]);
    cmd.arg("--apps-cgroup").arg(bed.apps.path());
    if let Some(path) = bed.agents_cgroup.as_ref().and_then(AgentsCgroup::path) {
        cmd.arg("--agents-cgroup").arg(path);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    bed.apps.place(&mut cmd);
    let mut child = Owned(cmd.spawn().context("starting the load generator")?);
    let stdout = child.0.stdout.take();
    let stderr = child.0.stderr.take();
    let out_reader = std::thread::spawn(move || read_all(stdout));
    let err_reader = std::thread::spawn(move || read_all(stderr));
    let bound = Duration::from_secs_f64(workload.seconds + workload.warmup + 45.0);
    let start = Instant::now();
    let mut status = None;
    // Bounded by time (and a count, should the clock stall).
    for _ in 0..((bound.as_millis() / 5) as usize + 10) {
        if let Some(s) = child.0.try_wait()? {
            status = Some(s);
            break;
        }
        if start.elapsed() > bound {
            break;
        }
        std::thread::sleep(Duration::from_millis(5));
    }
    let Some(status) = status else {
        drop(child);
        bail!("the load generator did not finish within {bound:?} and was killed");
    };
    let out = out_reader.join().unwrap_or_default();
    let err = err_reader.join().unwrap_or_default();
    let line = out.lines().last().unwrap_or("");
    serde_json::from_str(line)
        .with_context(|| format!("the load generator ({status}) printed {out:?}; stderr: {err}"))
}

fn read_all(pipe: Option<impl Read>) -> String {
    let mut text = String::new();
    if let Some(mut pipe) = pipe {
        let _ = pipe.read_to_string(&mut text);
    }
    text
}

//! `shunt-bench run | client | server`: see the crate docs.

use std::{
    path::{Path, PathBuf},
    process::ExitCode,
};

use anyhow::{Context as _, bail};
use clap::{Args, Parser, Subcommand};
use shunt_bench::{
    client::{self, ClientArgs, WorkloadKind},
    measure,
    model::{self, Placement, RunResults},
    report, server, svg, sys,
};

#[derive(Parser)]
#[command(
    name = "shunt-bench",
    about = "Benchmarks shunt: direct vs iptables+proxy vs eBPF+proxy, in network namespaces"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Build the topologies, start the agents, run every workload over every
    /// path and write the report (needs root).
    Run(RunArgs),
    /// The load generator (started by `run` inside the client pod).
    Client(ClientCli),
    /// The server (started by `run` inside each server pod).
    Server(ServerCli),
    /// Write the Markdown report and the chart again from a run's raw JSON
    /// (`<name>.json` beside the report): every figure comes from it.
    Render(RenderArgs),
}

#[derive(Args)]
struct RenderArgs {
    /// A `<name>.json` written by `run`.
    json: PathBuf,
    /// Where the reports go (default: beside the JSON).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print the README's Benchmarks tables instead of writing the reports.
    #[arg(long)]
    readme: bool,
    /// Add a note about the run (kept in the JSON, shown in the report).
    #[arg(long)]
    note: Vec<String>,
}

#[derive(Args)]
struct RunArgs {
    /// One short repetition of everything (about a minute): proves the
    /// harness works; its numbers are not measurements.
    #[arg(long)]
    quick: bool,
    /// Repetitions (default 5, or 1 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// Placements to run: pinned (all on one CPU), scheduler, or both.
    #[arg(long, value_delimiter = ',', default_value = "pinned,scheduler")]
    placements: Vec<String>,
    /// The CPU everything is pinned to in the pinned placement (default:
    /// the last one).
    #[arg(long)]
    pin_cpu: Option<usize>,
    /// Only these paths (e.g. `direct/same,ebpf/cross/hbone`).
    #[arg(long, value_delimiter = ',')]
    paths: Vec<String>,
    /// Only these workloads (rr1, rr1k, crr, stream, rate).
    #[arg(long, value_delimiter = ',')]
    workloads: Vec<String>,
    /// Where the reports go (default: bench/results of this workspace, or
    /// bench/results/raw/quick with --quick, which git ignores).
    #[arg(long)]
    out: Option<PathBuf>,
    /// Report name: `<out>/<name>.json` (the raw results), `.md`, `.svg`
    /// (default `latest`, or `quick` with --quick).
    #[arg(long)]
    name: Option<String>,
    /// The shunt binary (default: $SHUNT_BIN, else target/release/shunt,
    /// else target/debug/shunt).
    #[arg(long)]
    shunt: Option<PathBuf>,
    /// The agents' log filter (RUST_LOG). The default is the agent's own
    /// default, access log included.
    #[arg(long, default_value = "info")]
    agent_log: String,
    /// Measure with these numbers of AuthorizationPolicies on the
    /// destination, in turn (e.g. `0,10,1000`): generated ALLOW policies
    /// selecting the server pods, applied through the workloads file; only
    /// the last one admits the client, so each check evaluates them all.
    /// Mesh paths only; reported in a table of its own.
    #[arg(long, value_delimiter = ',')]
    policies: Vec<usize>,
    /// A stock Istio ztunnel binary (default: $SHUNT_ZTUNNEL_BIN): adds the
    /// ztunnel paths (one ztunnel per mesh pod in dedicated mode, captured
    /// by iptables), measured interleaved with shunt's and reported as
    /// shunt/ztunnel ratios. Without one the run has no ztunnel paths.
    #[arg(long)]
    ztunnel: Option<PathBuf>,
    /// ztunnel's log filter (RUST_LOG; default: the same as --agent-log,
    /// so that both write the same lines: ztunnel's access log is info too).
    #[arg(long)]
    ztunnel_log: Option<String>,
}

#[derive(Args)]
struct ClientCli {
    #[arg(long, value_enum)]
    workload: WorkloadKind,
    #[arg(long)]
    addr: std::net::SocketAddr,
    #[arg(long, default_value_t = 2.0)]
    seconds: f64,
    #[arg(long, default_value_t = 0.2)]
    warmup: f64,
    #[arg(long, default_value_t = 1)]
    size: usize,
    #[arg(long, default_value_t = 1)]
    conns: usize,
    #[arg(long, default_value_t = 1000.0)]
    rate: f64,
    /// Pin to these CPUs.
    #[arg(long, value_delimiter = ',')]
    cpus: Vec<usize>,
    /// The cgroup v2 dir of the load generator and servers (CPU measured).
    #[arg(long)]
    apps_cgroup: Option<PathBuf>,
    /// The cgroup v2 dir of the path's agents (CPU measured).
    #[arg(long)]
    agents_cgroup: Option<PathBuf>,
}

#[derive(Args)]
struct ServerCli {
    #[arg(long, default_value_t = model::ECHO_PORT)]
    echo_port: u16,
    #[arg(long, default_value_t = model::SINK_PORT)]
    sink_port: u16,
    #[arg(long, default_value_t = 4 * 3600)]
    max_seconds: u64,
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match cli.command {
        Command::Client(c) => {
            let report = client::run(ClientArgs {
                workload: c.workload,
                addr: c.addr,
                seconds: c.seconds,
                warmup: c.warmup,
                size: c.size,
                conns: c.conns,
                rate: c.rate,
                cpus: (!c.cpus.is_empty()).then_some(c.cpus),
                apps_cgroup: c.apps_cgroup,
                agents_cgroup: c.agents_cgroup,
            });
            let ok = report.ok;
            match serde_json::to_string(&report) {
                Ok(json) => println!("{json}"),
                Err(e) => {
                    eprintln!("shunt-bench client: {e}");
                    return ExitCode::FAILURE;
                }
            }
            if ok {
                ExitCode::SUCCESS
            } else {
                ExitCode::FAILURE
            }
        }
        Command::Server(s) => match server::run(server::ServerArgs {
            echo_port: s.echo_port,
            sink_port: s.sink_port,
            max_seconds: s.max_seconds,
        }) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("shunt-bench server: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Render(args) => match render(args) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("shunt-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
        Command::Run(args) => match run(args) {
            Ok(true) => ExitCode::SUCCESS,
            Ok(false) => ExitCode::FAILURE,
            Err(e) => {
                eprintln!("shunt-bench: {e:#}");
                ExitCode::FAILURE
            }
        },
    }
}

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .map(Path::to_path_buf)
        .unwrap_or_else(|| PathBuf::from("."))
}

fn shunt_binary(args: &RunArgs, workspace: &Path) -> anyhow::Result<PathBuf> {
    let candidates = [
        args.shunt.clone(),
        std::env::var_os("SHUNT_BIN").map(PathBuf::from),
        Some(workspace.join("target/release/shunt")),
        Some(workspace.join("target/debug/shunt")),
    ];
    for candidate in candidates.into_iter().flatten() {
        if candidate.exists() {
            return candidate
                .canonicalize()
                .with_context(|| format!("resolving {}", candidate.display()));
        }
    }
    bail!("no shunt binary: build it with `cargo build --release -p shunt` or pass --shunt")
}

/// `--ztunnel`, else `$SHUNT_ZTUNNEL_BIN` (unset or empty: none).
fn ztunnel_binary(args: &RunArgs) -> anyhow::Result<Option<PathBuf>> {
    let Some(path) = args.ztunnel.clone().or_else(|| {
        std::env::var_os("SHUNT_ZTUNNEL_BIN")
            .filter(|v| !v.is_empty())
            .map(PathBuf::from)
    }) else {
        return Ok(None);
    };
    let path = path
        .canonicalize()
        .with_context(|| format!("the ztunnel binary {}", path.display()))?;
    Ok(Some(path))
}

/// The raw results, compact (one line): what the reports are computed from.
fn write_json(results: &RunResults, path: &Path) -> anyhow::Result<()> {
    let mut text = serde_json::to_string(results)?;
    text.push('\n');
    std::fs::write(path, text).with_context(|| format!("writing {}", path.display()))
}

fn write_reports(results: &RunResults, out: &Path) -> anyhow::Result<()> {
    let svg_name = format!("{}.svg", results.name);
    std::fs::write(out.join(&svg_name), svg::chart(results))?;
    std::fs::write(
        out.join(format!("{}.md", results.name)),
        report::markdown(results, &svg_name),
    )?;
    Ok(())
}

fn read_json(path: &Path) -> anyhow::Result<RunResults> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("reading {}", path.display()))?;
    serde_json::from_str(&text).with_context(|| format!("parsing {}", path.display()))
}

fn render(args: RenderArgs) -> anyhow::Result<()> {
    let mut results = read_json(&args.json)?;
    if !args.note.is_empty() {
        results.notes.extend(args.note.iter().cloned());
        write_json(&results, &args.json)?;
    }
    if args.readme {
        print!(
            "{}",
            report::readme_section(&results, &format!("bench/results/{}.md", results.name))
        );
        return Ok(());
    }
    let out = match args.out {
        Some(out) => out,
        None => args
            .json
            .parent()
            .map(Path::to_path_buf)
            .unwrap_or_else(|| PathBuf::from(".")),
    };
    write_reports(&results, &out)
}

/// Runs the benchmark and writes the reports; false if any measurement
/// failed its checks.
fn run(args: RunArgs) -> anyhow::Result<bool> {
    let workspace = workspace_root();
    let shunt = shunt_binary(&args, &workspace)?;
    let mut placements = Vec::new();
    for p in &args.placements {
        placements.push(match p.as_str() {
            "pinned" => Placement::Pinned,
            "scheduler" => Placement::Scheduler,
            other => bail!("unknown placement {other:?} (pinned, scheduler)"),
        });
    }
    // The agents run through a wrapper that fixes their log filter (the
    // testbed's harness asks for debug logs, which are not what users run).
    let scratch = std::env::temp_dir().join(format!("shunt-bench-{}", std::process::id()));
    std::fs::create_dir_all(&scratch)?;
    let wrapper = scratch.join("shunt");
    std::fs::write(
        &wrapper,
        format!(
            "#!/bin/sh\nRUST_LOG='{}' exec '{}' \"$@\"\n",
            args.agent_log.replace('\'', ""),
            shunt.display()
        ),
    )?;
    {
        use std::os::unix::fs::PermissionsExt as _;
        std::fs::set_permissions(&wrapper, std::fs::Permissions::from_mode(0o755))?;
    }
    // SAFETY: no other thread exists yet.
    unsafe { std::env::set_var("SHUNT_BIN", &wrapper) };

    let name = args
        .name
        .clone()
        .unwrap_or_else(|| if args.quick { "quick" } else { "latest" }.to_string());
    let out = args.out.clone().unwrap_or_else(|| {
        if args.quick {
            workspace.join("bench/results/raw/quick")
        } else {
            workspace.join("bench/results")
        }
    });
    let options = measure::Options {
        quick: args.quick,
        reps: args.reps.unwrap_or(if args.quick { 1 } else { 5 }).max(1),
        placements,
        pin_cpu: args.pin_cpu.unwrap_or(sys::cpu_count().saturating_sub(1)),
        only_paths: args.paths.clone(),
        only_workloads: args.workloads.clone(),
        bench_bin: std::env::current_exe()?,
        workspace: workspace.clone(),
        logs_dir: Some(out.join("raw").join(format!("{name}-agent-logs"))),
        policies: args.policies.clone(),
        ztunnel: ztunnel_binary(&args)?.map(|binary| measure::ZtunnelRun {
            binary,
            log: args
                .ztunnel_log
                .clone()
                .unwrap_or_else(|| args.agent_log.clone()),
        }),
    };
    let result = measure::run(&options);
    let _ = std::fs::remove_dir_all(&scratch);
    let mut results = result?;
    results.shunt_binary = shunt.display().to_string();
    results.name = name.clone();
    std::fs::create_dir_all(&out)?;
    let json = out.join(format!("{name}.json"));
    write_json(&results, &json)?;
    // The reports come from the JSON as written, exactly as `render` makes
    // them, so every figure in them can be re-derived from it.
    let results = read_json(&json)?;
    write_reports(&results, &out)?;
    let failed = results.records.iter().filter(|r| !r.verified).count();
    eprintln!(
        "shunt-bench: {} measurements, {failed} failed; report in {}",
        results.records.len(),
        out.join(format!("{name}.md")).display()
    );
    Ok(failed == 0)
}

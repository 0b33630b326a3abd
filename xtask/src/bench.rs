//! `cargo xtask bench [--quick]`: builds the agent and the harness in
//! release mode, then runs the harness (`shunt-bench run`, in bench/), which
//! builds the topologies in network namespaces, starts the real agents and
//! writes bench/results/latest.json (the raw results) and, from it,
//! latest.md and its SVG chart (bench/results/README.md).

use std::process::Command;

use anyhow::bail;
use clap::Args;

use crate::util;

#[derive(Args)]
pub struct BenchArgs {
    /// One short repetition of every path and workload (about a minute): a
    /// smoke test of the harness, not a measurement. Writes
    /// bench/results/raw/quick/quick.{json,md,svg} (ignored by git).
    #[arg(long)]
    quick: bool,
    /// Repetitions (default 5; 1 with --quick).
    #[arg(long)]
    reps: Option<usize>,
    /// A stock Istio ztunnel binary to measure beside shunt (default:
    /// $SHUNT_ZTUNNEL_BIN): adds its paths and the shunt/ztunnel ratios.
    #[arg(long)]
    ztunnel: Option<std::path::PathBuf>,
    /// Extra arguments for `shunt-bench run` (after `--`), e.g.
    /// `-- --paths direct/same,ebpf/same/plain --workloads rr1`.
    #[arg(last = true)]
    harness_args: Vec<String>,
}

pub fn run(args: BenchArgs) -> anyhow::Result<()> {
    if !util::is_root() {
        bail!(
            "the benchmark needs root: it creates network namespaces and loads eBPF programs; run `sudo -E cargo xtask bench`"
        );
    }
    let root = util::workspace_root();
    eprintln!("building the agent and the harness (release)…");
    util::run(
        Command::new("cargo")
            .args([
                "build",
                "--release",
                "-q",
                "-p",
                "shunt",
                "-p",
                "shunt-bench",
                "--bins",
            ])
            .current_dir(&root),
    )?;
    let mut harness = Command::new(util::target_dir().join("release/shunt-bench"));
    harness
        .arg("run")
        .arg("--shunt")
        .arg(util::target_dir().join("release/shunt"))
        .current_dir(&root);
    if args.quick {
        harness.arg("--quick");
    }
    if let Some(reps) = args.reps {
        harness.args(["--reps", &reps.to_string()]);
    }
    if let Some(ztunnel) = &args.ztunnel {
        harness.arg("--ztunnel").arg(ztunnel);
    }
    harness.args(&args.harness_args);
    util::run(&mut harness)
}

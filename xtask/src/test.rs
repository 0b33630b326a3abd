//! `cargo xtask test` and `cargo xtask lint`.

use std::process::Command;

use anyhow::bail;
use clap::Args;

use crate::util;

/// Every workspace crate but the eBPF one, which builds only for the BPF
/// target (through userspace/build.rs).
const HOST_CRATES: &[&str] = &["--workspace", "--exclude", "shunt-ebpf"];

#[derive(Args)]
pub struct TestArgs {
    /// Only run tests whose name contains this.
    filter: Option<String>,
    /// Extra arguments for the test binaries (after `--`).
    #[arg(last = true)]
    test_args: Vec<String>,
}

pub fn run(args: TestArgs) -> anyhow::Result<()> {
    if !util::is_root() {
        bail!(
            "the kernel tests need root: they create network namespaces and veth pairs, load eBPF programs and attach them; run `sudo -E cargo xtask test` (no test was run)"
        );
    }
    let mut cmd = build_agent_then_test()?;
    // Every test binary runs even when an earlier one fails: one report.
    cmd.arg("--no-fail-fast");
    cmd.args(HOST_CRATES);
    if let Some(filter) = &args.filter {
        cmd.arg(filter);
    }
    if !args.test_args.is_empty() {
        cmd.arg("--").args(&args.test_args);
    }
    util::run(&mut cmd)
}

/// `cargo xtask soak`: the churn soak's long form, one mode at a time, its
/// figures printed.
pub fn soak() -> anyhow::Result<()> {
    if !util::is_root() {
        bail!("the soak needs root (network namespaces, eBPF): run `sudo -E cargo xtask soak`");
    }
    let mut cmd = build_agent_then_test()?;
    cmd.args(["-p", "shunt-testbed", "--test", "soak"]);
    for (name, default) in [("SHUNT_SOAK_PODS", "50"), ("SHUNT_SOAK_ROUNDS", "10")] {
        if std::env::var_os(name).is_none() {
            cmd.env(name, default);
        }
    }
    cmd.args(["--", "--nocapture", "--test-threads", "1"]);
    util::run(&mut cmd)
}

/// Builds the agent binary the end-to-end tests start, and returns a
/// `cargo test` command that finds it (`SHUNT_BIN`).
fn build_agent_then_test() -> anyhow::Result<Command> {
    let root = util::workspace_root();
    // The end-to-end tests start the real agent binary (and the CNI plugin
    // binary), with the test seams they use (the same feature `cargo test` below unifies in through
    // tests/'s dev-dependency, so both builds are the same binary).
    util::run(
        Command::new("cargo")
            .args([
                "build",
                "-p",
                "shunt",
                "-p",
                "shunt-cni",
                "--bins",
                "--features",
                "shunt/test-seams",
            ])
            .current_dir(&root),
    )?;
    let mut cmd = Command::new("cargo");
    cmd.arg("test").current_dir(&root);
    // Where cargo put the binary just built: CARGO_TARGET_DIR if set.
    let target_dir = std::env::var_os("CARGO_TARGET_DIR")
        .map(std::path::PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                root.join(dir)
            }
        })
        .unwrap_or_else(|| root.join("target"));
    cmd.env("SHUNT_BIN", target_dir.join("debug/shunt"));
    // The CNI plugin the containerd tests chain (userspace/tests/cni_*.rs).
    cmd.env("SHUNT_CNI_BIN", target_dir.join("debug/shunt-cni"));
    Ok(cmd)
}

pub fn lint() -> anyhow::Result<()> {
    let root = util::workspace_root();
    util::run(
        Command::new("cargo")
            .args(["fmt", "--all", "--", "--check"])
            .current_dir(&root),
    )?;
    let mut clippy = Command::new("cargo");
    clippy.arg("clippy").current_dir(&root);
    clippy.args(HOST_CRATES);
    clippy.args(["--tests", "--", "-D", "warnings"]);
    util::run(&mut clippy)
}

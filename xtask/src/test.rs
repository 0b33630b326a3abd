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
    let root = util::workspace_root();
    // The end-to-end tests start the real agent binary, with the test seams
    // they use (the same feature `cargo test` below unifies in through
    // tests/'s dev-dependency, so both builds are the same binary).
    util::run(
        Command::new("cargo")
            .args(["build", "-p", "shunt", "--bins", "--features", "test-seams"])
            .current_dir(&root),
    )?;
    let mut cmd = Command::new("cargo");
    // Every test binary runs even when an earlier one fails: one report.
    cmd.args(["test", "--no-fail-fast"]).current_dir(&root);
    cmd.args(HOST_CRATES);
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
    if let Some(filter) = &args.filter {
        cmd.arg(filter);
    }
    if !args.test_args.is_empty() {
        cmd.arg("--").args(&args.test_args);
    }
    util::run(&mut cmd)
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

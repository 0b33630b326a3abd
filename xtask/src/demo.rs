//! `cargo xtask demo`: builds the agent and the demo driver, then runs the
//! driver (`shunt-testbed`'s `shunt-demo` binary), which builds a local node in
//! network namespaces and shows the agent at work.

use std::process::Command;

use anyhow::bail;
use clap::Args;

use crate::util;

#[derive(Args)]
pub struct DemoArgs {
    /// How long to show live traffic, in seconds.
    #[arg(long, default_value_t = 10)]
    seconds: u64,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    if !util::is_root() {
        bail!(
            "the demo needs root: it creates network namespaces and loads eBPF programs; run `sudo -E cargo xtask demo`"
        );
    }
    let root = util::workspace_root();
    eprintln!("building the agent and the demo driver…");
    util::run(
        Command::new("cargo")
            .args([
                "build",
                "-q",
                "-p",
                "shunt",
                "-p",
                "shunt-testbed",
                "--bins",
            ])
            .current_dir(&root),
    )?;
    util::run(
        Command::new(root.join("target/debug/shunt-demo"))
            .arg("--shunt")
            .arg(root.join("target/debug/shunt"))
            .arg("--seconds")
            .arg(args.seconds.to_string()),
    )
}

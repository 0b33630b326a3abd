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
    let mut demo = Command::new(util::target_dir().join("debug/shunt-demo"));
    demo.arg("--shunt")
        .arg(util::target_dir().join("debug/shunt"))
        .arg("--seconds")
        .arg(args.seconds.to_string());
    let mut child = demo
        .spawn()
        .map_err(|e| anyhow::anyhow!("cannot start {}: {e}", util::describe(&demo)))?;
    // Ctrl-C reaches the whole process group: the demo tears down on it and
    // exits; xtask must outlive it to report how that went.
    // SAFETY: SIG_IGN installs no handler code.
    unsafe {
        let _ = nix::sys::signal::signal(
            nix::sys::signal::Signal::SIGINT,
            nix::sys::signal::SigHandler::SigIgn,
        );
    }
    let status = child.wait()?;
    match status.code() {
        Some(0) => Ok(()),
        Some(130) => {
            eprintln!("demo interrupted; everything it created was removed");
            Ok(())
        }
        _ => bail!("the demo failed ({status})"),
    }
}

//! Small helpers shared by the tasks: running commands with clear errors and
//! timing steps.

use std::{
    path::PathBuf,
    process::{Command, Output},
    time::Instant,
};

use anyhow::{Context as _, bail};

/// The workspace root (xtask lives one level below it).
pub fn workspace_root() -> PathBuf {
    let manifest_dir = PathBuf::from(env!("CARGO_MANIFEST_DIR"));
    manifest_dir
        .parent()
        .map(PathBuf::from)
        .unwrap_or(manifest_dir)
}

/// Where cargo puts build output: `CARGO_TARGET_DIR` if set (relative to
/// the workspace), else `<workspace>/target`.
pub fn target_dir() -> PathBuf {
    let root = workspace_root();
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .map(|dir| {
            if dir.is_absolute() {
                dir
            } else {
                root.join(dir)
            }
        })
        .unwrap_or_else(|| root.join("target"))
}

/// Runs `cmd`, streaming its output; fails naming the command when it fails.
pub fn run(cmd: &mut Command) -> anyhow::Result<()> {
    let status = cmd
        .status()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !status.success() {
        bail!("{} failed ({status})", describe(cmd));
    }
    Ok(())
}

/// Runs `cmd` capturing its output; fails with its stderr when it fails.
pub fn output(cmd: &mut Command) -> anyhow::Result<Output> {
    let out = cmd
        .output()
        .with_context(|| format!("cannot start {}", describe(cmd)))?;
    if !out.status.success() {
        bail!(
            "{} failed ({}): {}",
            describe(cmd),
            out.status,
            String::from_utf8_lossy(&out.stderr).trim()
        );
    }
    Ok(out)
}

/// Captured stdout as a trimmed string.
pub fn stdout(cmd: &mut Command) -> anyhow::Result<String> {
    Ok(String::from_utf8_lossy(&output(cmd)?.stdout)
        .trim()
        .to_string())
}

pub fn describe(cmd: &Command) -> String {
    let mut s = cmd.get_program().to_string_lossy().into_owned();
    for arg in cmd.get_args() {
        s.push(' ');
        s.push_str(&arg.to_string_lossy());
    }
    s
}

/// Prints a step's name, runs it, prints how long it took.
pub fn step<T>(name: &str, f: impl FnOnce() -> anyhow::Result<T>) -> anyhow::Result<T> {
    let start = Instant::now();
    let result = f();
    let elapsed = start.elapsed();
    match &result {
        Ok(_) => eprintln!("  [ok]   {name} ({:.1}s)", elapsed.as_secs_f64()),
        Err(_) => eprintln!("  [FAIL] {name} ({:.1}s)", elapsed.as_secs_f64()),
    }
    result.with_context(|| format!("setup step '{name}'"))
}

pub fn is_root() -> bool {
    nix::unistd::geteuid().is_root()
}

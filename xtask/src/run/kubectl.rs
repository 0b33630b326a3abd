//! Running the commands: kubectl always on the context `kind-shunt`, `shunt`
//! inside an agent pod, and commands whose output is captured or shown
//! whatever their exit status.

use std::process::{Command, Output};

use anyhow::Context as _;

use super::{AGENT_NAMESPACE, CONTEXT};
use crate::util;

pub(super) fn kubectl() -> Command {
    let mut cmd = Command::new("kubectl");
    cmd.args(["--context", CONTEXT]);
    cmd
}

/// Runs `cmd` with its output captured, whatever its exit status.
pub(super) fn quiet(cmd: &mut Command) -> anyhow::Result<Output> {
    cmd.output()
        .with_context(|| format!("cannot start {}", util::describe(cmd)))
}

pub(super) fn first_line(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes)
        .lines()
        .find(|l| !l.trim().is_empty())
        .unwrap_or("")
        .trim()
        .to_string()
}

/// `kubectl exec` of `shunt` in the agent container of `agent`; the
/// caller adds its arguments (`status`, `status --json`).
pub(super) fn shunt_in(agent: &str) -> Command {
    let mut cmd = kubectl();
    cmd.args([
        "exec",
        "-n",
        AGENT_NAMESPACE,
        agent,
        "-c",
        "agent",
        "--",
        "shunt",
    ]);
    cmd
}

/// Runs `cmd` and prints its output indented, whatever happens.
pub(super) fn show(cmd: &mut Command) {
    match cmd.output() {
        Ok(out) => {
            for line in String::from_utf8_lossy(&out.stdout)
                .lines()
                .chain(String::from_utf8_lossy(&out.stderr).lines())
            {
                eprintln!("    {line}");
            }
        }
        Err(e) => eprintln!("    ({}: {e})", util::describe(cmd)),
    }
}

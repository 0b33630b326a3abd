//! The agent's process: its command line (the testbed's defaults, then the
//! test's arguments), environment, limits, cgroup and log.

use std::{fs, process::Stdio};

use super::{Agent, shunt_binary};
use crate::{Result, TestbedError};

impl Agent {
    pub(super) fn spawn(&mut self, extra_args: &[&str]) -> Result<()> {
        let log = fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.log_path())
            .map_err(|e| TestbedError::io("opening the agent log", e))?;
        let log_err = log
            .try_clone()
            .map_err(|e| TestbedError::io("opening the agent log", e))?;
        let binary = shunt_binary()?;
        let mut cmd = self.netns.command(&self.node, &binary)?;
        self.cgroup.place(&mut cmd);
        if let Some((soft, hard)) = self.nofile {
            let limit = libc::rlimit {
                rlim_cur: soft as libc::rlim_t,
                rlim_max: hard as libc::rlim_t,
            };
            // SAFETY: setrlimit is async-signal-safe; the struct is built
            // before the fork.
            unsafe {
                std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        cmd.arg("agent")
            .args(["--node-name", self.node.name()])
            .arg("--workloads")
            .arg(self.workloads_path())
            .arg("--bpf-pin-dir")
            .arg(&self.pin_dir)
            .arg("--cgroup-root")
            .arg(&self.cgroup_root)
            // One CA per topology: its agents trust each other.
            .arg("--ca-dir")
            .arg(&self.ca_dir)
            // Every second here (unless the caller chooses): file edits
            // reach the agent without waiting.
            .args(
                (!extra_args.contains(&"--reload-interval"))
                    .then_some(["--reload-interval", "1"])
                    .into_iter()
                    .flatten(),
            )
            // Hooks and counters in the agent's status are as its last
            // verify pass read them: every second here (unless the test
            // chooses), so that `status_after_verify` waits little.
            .args(
                (!extra_args.contains(&"--verify-interval"))
                    .then_some(["--verify-interval", "1"])
                    .into_iter()
                    .flatten(),
            )
            // Tests written for the proxy path keep it: the passthrough
            // fast path (on by default in the agent) is only on where a
            // test asks for it.
            .args(
                (!extra_args.contains(&"--fast-path"))
                    .then_some(["--fast-path", "off"])
                    .into_iter()
                    .flatten(),
            )
            .arg("--admin-addr")
            .arg(self.endpoints.admin.to_string())
            .arg("--metrics-addr")
            .arg(self.endpoints.metrics.to_string())
            .arg("--readiness-addr")
            .arg(self.endpoints.readiness.to_string())
            .args(extra_args)
            .env("RUST_LOG", "info,shunt=debug,shunt_ebpf=debug")
            .envs(self.env.iter().map(|(k, v)| (k.as_str(), v.as_str())))
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err);
        let child = cmd.spawn().map_err(|source| TestbedError::Spawn {
            command: format!("{} agent", binary.display()),
            source,
        })?;
        self.child = Some(child);
        Ok(())
    }
}

//! The programs `cargo xtask run` needs, checked before anything starts:
//! each missing one named with what it is for and how to get it; the
//! docker daemon and BuildKit; what this host's kernel will make fail.

use std::{
    fs,
    os::unix::fs::PermissionsExt as _,
    path::{Path, PathBuf},
    process::{Command, Output},
};

use anyhow::bail;

use super::kubectl::{first_line, quiet};

/// A program `cargo xtask run` needs, what for, and how to get it.
pub(super) struct Tool {
    name: &'static str,
    why: &'static str,
    how: &'static str,
}

pub(super) const DOCKER: Tool = Tool {
    name: "docker",
    why: "builds the image and runs kind's nodes as containers",
    how: "install Docker Engine (https://docs.docker.com/engine/install/) with its buildx plugin, or Docker Desktop",
};
pub(super) const KIND: Tool = Tool {
    name: "kind",
    why: "creates the local Kubernetes cluster",
    how: "`go install sigs.k8s.io/kind@latest`, or a release binary from https://kind.sigs.k8s.io/docs/user/quick-start/#installation",
};
pub(super) const KUBECTL: Tool = Tool {
    name: "kubectl",
    why: "applies deploy/ and talks to the cluster",
    how: "see https://kubernetes.io/docs/tasks/tools/#kubectl (a release binary, or the pkgs.k8s.io apt repository)",
};
pub(super) const OPENSSL: Tool = Tool {
    name: "openssl",
    why: "creates the mesh's CA certificate and key",
    how: "`apt-get install openssl` (or your system's package)",
};

/// Fails naming every missing tool at once.
pub(super) fn require_tools(tools: &[Tool]) -> anyhow::Result<()> {
    let mut missing = Vec::new();
    for tool in tools {
        match find_in_path(tool.name) {
            Some(path) => eprintln!("    {:<8} {}", tool.name, path.display()),
            None => missing.push(tool),
        }
    }
    if missing.is_empty() {
        return Ok(());
    }
    let mut message = format!(
        "missing: {}",
        missing
            .iter()
            .map(|t| t.name)
            .collect::<Vec<_>>()
            .join(", ")
    );
    for tool in missing {
        message.push_str(&format!(
            "\n  {}: not found on PATH; it {}. Install: {}",
            tool.name, tool.why, tool.how
        ));
    }
    bail!(message)
}

pub(super) fn find_in_path(name: &str) -> Option<PathBuf> {
    let path = std::env::var_os("PATH")?;
    std::env::split_paths(&path)
        .map(|dir| dir.join(name))
        .find(|candidate| {
            fs::metadata(candidate)
                .is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0)
        })
}

/// The docker CLI alone is not enough: its daemon must answer, and the
/// Dockerfile's cache mounts need BuildKit (buildx).
pub(super) fn docker_ready() -> anyhow::Result<()> {
    let out = docker_daemon_version()?;
    if !out.status.success() {
        bail!(
            "docker is installed but its daemon does not answer: {}\n  \
             Start it (`sudo systemctl start docker`, or Docker Desktop), or check DOCKER_HOST \
             and your access to /var/run/docker.sock (the `docker` group).",
            first_line(&out.stderr)
        );
    }
    eprintln!(
        "    docker daemon {}",
        String::from_utf8_lossy(&out.stdout).trim()
    );
    let buildx = quiet(Command::new("docker").args(["buildx", "version"]))?;
    if !buildx.status.success() {
        bail!(
            "docker's buildx plugin (BuildKit) is missing: deploy/Dockerfile uses BuildKit cache mounts.\n  \
             Install docker-buildx-plugin from Docker's apt repository (or use Docker Desktop)."
        );
    }
    Ok(())
}

/// `docker version` asking the daemon for its version: fails when the
/// daemon does not answer (the output says why).
pub(super) fn docker_daemon_version() -> anyhow::Result<Output> {
    quiet(Command::new("docker").args(["version", "--format", "{{.Server.Version}}"]))
}

/// kind's nodes run on this machine's kernel: say early what will bite.
pub(super) fn host_warnings() {
    let remote = std::env::var("DOCKER_HOST").is_ok_and(|h| !h.starts_with("unix://"));
    if remote {
        return;
    }
    if !Path::new("/sys/kernel/btf/vmlinux").exists() {
        eprintln!(
            "    warning: this kernel has no BTF (/sys/kernel/btf/vmlinux); kind's nodes share it and shunt's eBPF programs need it"
        );
    }
    // kind's known-issues page: multi-node clusters exhaust the default
    // inotify instances ("too many open files" in kubelet or pods).
    let instances = fs::read_to_string("/proc/sys/fs/inotify/max_user_instances")
        .ok()
        .and_then(|s| s.trim().parse::<u64>().ok());
    if instances.is_some_and(|n| n < 512) {
        eprintln!(
            "    warning: fs.inotify.max_user_instances is {}; kind recommends 512 for multi-node clusters (`sudo sysctl fs.inotify.max_user_instances=512`)",
            instances.unwrap_or_default()
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn missing_tools_are_all_named_with_how_to_get_them() {
        let absent = Tool {
            name: "shunt-no-such-tool",
            why: "is needed",
            how: "somehow",
        };
        let also = Tool {
            name: "shunt-no-such-tool-2",
            why: "is needed too",
            how: "some other way",
        };
        let message = require_tools(&[absent, also]).unwrap_err().to_string();
        assert!(message.starts_with("missing: shunt-no-such-tool, shunt-no-such-tool-2"));
        assert!(message.contains("Install: somehow"));
        assert!(message.contains("Install: some other way"));
    }
}

//! Which network namespace an agent process runs in, and how the testbed
//! reaches it there.
//!
//! Two layouts, as a cluster runs the DaemonSet:
//! - [`AgentNetns::Node`]: the agent in its node's netns (`hostNetwork`).
//!   Its admin, metrics and readiness ports are the node's, so two agents
//!   of one node need different ports.
//! - [`AgentNetns::Pod`]: the agent in a pod netns of its own (a veth on
//!   the node's bridge, its own 198.18.x.y, loopback up), as the DaemonSet
//!   runs it now. Its ports are its own: two agents of one node (a surge)
//!   both use 15000/15020/15021. It still reaches every pod's netns through
//!   the paths in the workloads file, and bpffs and cgroup2 through the
//!   mounts it shares with the test (it is entered with `setns` before
//!   exec, which, unlike `ip netns exec`, remounts nothing).

use std::{
    io::{Read as _, Write as _},
    net::SocketAddr,
    path::Path,
    process::Command,
    time::Duration,
};

use crate::{Node, Pod, Result, TestbedError};

/// Where an agent process runs.
#[derive(Clone, Debug)]
pub enum AgentNetns {
    /// In its node's netns (the `hostNetwork` layout).
    Node,
    /// In this pod's netns, a netns of its own on its node's bridge (the
    /// DaemonSet's layout: no host network, no host port).
    Pod(Pod),
}

impl AgentNetns {
    /// A command that runs `binary` in this netns of `node`. The pod
    /// layout enters the netns with `setns(CLONE_NEWNET)` in the child
    /// between fork and exec.
    pub(super) fn command(&self, node: &Node, binary: &Path) -> Result<Command> {
        let pod = match self {
            AgentNetns::Node => return Ok(node.command(binary)),
            AgentNetns::Pod(pod) => pod,
        };
        let path = pod.netns_path();
        let netns = std::fs::File::open(&path)
            .map_err(|e| TestbedError::io(format!("opening {}", path.display()), e))?;
        let mut cmd = Command::new(binary);
        // SAFETY: setns is a plain syscall (async-signal-safe) on an fd
        // opened before the fork; the closure owns the file, so the fd is
        // open when the child runs it (and closed at exec: O_CLOEXEC).
        unsafe {
            std::os::unix::process::CommandExt::pre_exec(&mut cmd, move || {
                let fd = std::os::fd::AsRawFd::as_raw_fd(&netns);
                if libc::setns(fd, libc::CLONE_NEWNET) == 0 {
                    Ok(())
                } else {
                    Err(std::io::Error::last_os_error())
                }
            });
        }
        Ok(cmd)
    }

    /// Runs `f` on a thread inside the agent's netns (where its admin API
    /// listens on loopback).
    pub(super) fn run<T: Send>(&self, node: &Node, f: impl FnOnce() -> T + Send) -> Result<T> {
        match self {
            AgentNetns::Node => node.run(f),
            AgentNetns::Pod(pod) => pod.run(f),
        }
    }

    /// The address the node reaches the agent's `port` at, as the kubelet
    /// (readiness) and Prometheus (metrics) do: loopback of the node's
    /// netns in the node layout, the agent pod's IP in the pod layout.
    pub fn reachable_from_node(&self, port: u16) -> SocketAddr {
        match self {
            AgentNetns::Node => SocketAddr::from(([127, 0, 0, 1], port)),
            AgentNetns::Pod(pod) => SocketAddr::from((pod.ip(), port)),
        }
    }
}

/// Plain HTTP/1.0 (no chunking, the server closes at the end) to
/// 127.0.0.1:`port` inside `node`'s netns, where an agent's endpoints
/// listen in the node layout: the status code and body.
pub fn http(node: &Node, method: &str, port: u16, path: &str) -> std::io::Result<(u16, String)> {
    http_at(node, SocketAddr::from(([127, 0, 0, 1], port)), method, path)
}

/// [`http`] to any `addr` the node's netns can reach (an agent pod's IP).
pub fn http_at(
    node: &Node,
    addr: SocketAddr,
    method: &str,
    path: &str,
) -> std::io::Result<(u16, String)> {
    let stream = node
        .connect_tcp(addr, Duration::from_secs(5))
        .map_err(|e| std::io::Error::other(e.to_string()))?;
    http_over(stream, method, path)
}

/// One plain HTTP/1.0 exchange on a connected `stream` (see [`http`]).
pub fn http_over(
    mut stream: std::net::TcpStream,
    method: &str,
    path: &str,
) -> std::io::Result<(u16, String)> {
    stream.set_read_timeout(Some(Duration::from_secs(20)))?;
    write!(
        stream,
        "{method} {path} HTTP/1.0\r\nHost: localhost\r\nContent-Length: 0\r\n\r\n"
    )?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw)?;
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text
        .split_once("\r\n\r\n")
        .ok_or_else(|| std::io::Error::other(format!("no header end in {text:?}")))?;
    let code = head
        .split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| std::io::Error::other(format!("bad status line in {head:?}")))?;
    Ok((code, body.to_string()))
}

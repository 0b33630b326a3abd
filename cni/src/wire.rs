//! The plugin ⇄ agent exchange on the agent's node-local unix socket
//! (`--cni-socket`; the plugin's `agent_socket`).
//!
//! One request per connection: the plugin writes one JSON [`Request`] and
//! shuts its write half; the agent answers one JSON [`Reply`] and closes.
//! istio-cni carries the same facts (netns, pod name and namespace, the
//! IPs of `prevResult`) as an HTTP POST on its `pluginevent.sock`; both
//! ends here are shunt's, so the framing is the simplest that is still
//! bounded and self-delimiting.

use std::{
    io::{Read as _, Write as _},
    os::unix::net::UnixStream,
    path::Path,
    time::Duration,
};

use serde::{Deserialize, Serialize};

/// At most this many bytes are read for a request or an answer.
pub const MAX_MESSAGE: u64 = 1 << 20;

/// What the runtime asked the plugin.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "UPPERCASE")]
pub enum Command {
    /// Capture the sandbox (an ambient pod) before the answer.
    Add,
    /// The sandbox is going away (called again with an empty netns).
    Del,
    /// Is the sandbox still captured as the agent wants it?
    Check,
}

/// One address of `prevResult` (`ips[]` of the CNI result).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct IpConfig {
    /// CIDR form, as the result carries it (`198.18.0.5/24`).
    pub address: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub gateway: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub interface: Option<u32>,
}

/// A sandbox, as the runtime described it to the plugin.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Request {
    pub command: Command,
    /// `CNI_CONTAINERID`: the sandbox's id.
    pub container_id: String,
    /// `CNI_NETNS`: the sandbox's netns path (empty on a second DEL).
    pub netns: String,
    /// `CNI_IFNAME`.
    pub if_name: String,
    /// `K8S_POD_NAMESPACE` and `K8S_POD_NAME` from `CNI_ARGS`.
    pub pod_namespace: String,
    pub pod_name: String,
    /// `K8S_POD_UID` from `CNI_ARGS`, when the runtime passes it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pod_uid: Option<String>,
    /// The addresses the earlier plugins of the chain gave the sandbox.
    #[serde(default)]
    pub ips: Vec<IpConfig>,
}

/// The agent's answer.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "outcome", content = "reason", rename_all = "kebab-case")]
pub enum Reply {
    /// The pod is in the mesh and its traffic is captured (with
    /// `--proxy ztunnel`: ztunnel acknowledged it).
    Captured,
    /// The pod is not in the mesh: nothing was touched.
    NotInMesh,
    /// DEL: the agent forgot the sandbox.
    Released,
    /// The pod is in the mesh but could not be captured; the reason says
    /// why. ADD fails (the runtime tries again).
    Failed(String),
}

/// Why the exchange with the agent failed.
#[derive(Debug, thiserror::Error)]
pub enum WireError {
    #[error("cannot reach the shunt agent at {socket}: {source}")]
    Connect {
        socket: String,
        source: std::io::Error,
    },
    #[error("talking to the shunt agent at {socket}: {source}")]
    Io {
        socket: String,
        source: std::io::Error,
    },
    #[error("the shunt agent at {socket} answered something unreadable: {source}")]
    Decode {
        socket: String,
        source: serde_json::Error,
    },
}

impl WireError {
    /// Whether the agent could not be reached at all (as opposed to a
    /// connection that broke after the request was sent).
    pub fn is_unreachable(&self) -> bool {
        matches!(self, WireError::Connect { .. })
    }
}

/// Sends `request` to the agent on `socket` and waits (at most `timeout`
/// in all) for its answer. Blocking: the plugin is a short-lived process.
pub fn exchange(socket: &Path, request: &Request, timeout: Duration) -> Result<Reply, WireError> {
    let name = socket.display().to_string();
    let io = |source| WireError::Io {
        socket: name.clone(),
        source,
    };
    let mut stream = UnixStream::connect(socket).map_err(|source| WireError::Connect {
        socket: name.clone(),
        source,
    })?;
    stream.set_write_timeout(Some(timeout)).map_err(io)?;
    stream.set_read_timeout(Some(timeout)).map_err(io)?;
    let body = serde_json::to_vec(request).map_err(|source| WireError::Decode {
        socket: name.clone(),
        source,
    })?;
    stream.write_all(&body).map_err(io)?;
    stream.shutdown(std::net::Shutdown::Write).map_err(io)?;
    let mut answer = Vec::new();
    stream
        .take(MAX_MESSAGE)
        .read_to_end(&mut answer)
        .map_err(io)?;
    serde_json::from_slice(&answer).map_err(|source| WireError::Decode {
        socket: name,
        source,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reply_has_a_stable_json_form() {
        let failed = serde_json::to_string(&Reply::Failed("no netns".into())).unwrap();
        assert_eq!(failed, r#"{"outcome":"failed","reason":"no netns"}"#);
        let captured = serde_json::to_string(&Reply::Captured).unwrap();
        assert_eq!(captured, r#"{"outcome":"captured"}"#);
        assert_eq!(
            serde_json::from_str::<Reply>(r#"{"outcome":"not-in-mesh"}"#).unwrap(),
            Reply::NotInMesh
        );
    }

    #[test]
    fn unreachable_agent_is_told_apart() {
        let dir = tempfile::tempdir().unwrap();
        let request = Request {
            command: Command::Add,
            container_id: "c".into(),
            netns: "/var/run/netns/x".into(),
            if_name: "eth0".into(),
            pod_namespace: "ns".into(),
            pod_name: "p".into(),
            pod_uid: None,
            ips: vec![],
        };
        let error = exchange(
            &dir.path().join("none.sock"),
            &request,
            Duration::from_secs(1),
        )
        .unwrap_err();
        assert!(error.is_unreachable(), "{error}");
    }
}

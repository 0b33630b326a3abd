//! The real ztunnel as the node's in-pod proxy: the binary from
//! `SHUNT_ZTUNNEL_BIN` in shared mode (its default: in-pod, served over
//! ZDS), run in a netns of its own (its pod), fed by the in-test
//! [`Istiod`] on that netns' loopback, connecting to the agent's ZDS
//! socket (`INPOD_UDS`). It starts its ZDS client after its first xDS
//! update; `/healthz/ready` says 200 once it has a snapshot over ZDS and
//! no pod pending.

use std::{path::Path, time::Duration};

use super::{istiod::Istiod, pki::Pki, ztunnel_process::ZtunnelProcess};
use crate::{Cgroup, Pod, Result};

/// A running ztunnel in shared mode; killed (by its PID) when dropped.
pub struct ZtunnelNode {
    process: ZtunnelProcess,
}

impl ZtunnelNode {
    /// Starts `binary` in `pod` (ztunnel's own pod), against `istiod` and
    /// the ZDS socket `zds_socket`; returns once its admin port answers.
    pub fn start(
        binary: &Path,
        pod: &Pod,
        istiod: &Istiod,
        pki: &Pki,
        zds_socket: &Path,
    ) -> Result<ZtunnelNode> {
        Self::start_in(binary, pod, None, istiod, pki, zds_socket)
    }

    /// [`ZtunnelNode::start`], the process in `cgroup` (as a node's
    /// ztunnel pod sits under the cgroup root the node agent's socket
    /// programs are attached to: its own connects reach them, marked).
    pub fn start_in(
        binary: &Path,
        pod: &Pod,
        cgroup: Option<&Cgroup>,
        istiod: &Istiod,
        pki: &Pki,
        zds_socket: &Path,
    ) -> Result<ZtunnelNode> {
        let env = [("INPOD_UDS", zds_socket)];
        let process = ZtunnelProcess::start(binary, pod, cgroup, istiod, pki, env, None)?;
        Ok(ZtunnelNode { process })
    }

    /// Its log so far (stdout and stderr).
    pub fn logs(&self) -> String {
        self.process.logs()
    }

    /// Readiness's answer now, if it answers.
    pub fn readiness(&self) -> Option<u16> {
        self.process.readiness()
    }

    /// Waits (bounded) until readiness says 200.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        self.process.wait_until(timeout, |code| code == 200)
    }

    /// Waits (bounded) until its log has a line containing every part.
    pub fn wait_log(&self, parts: &[&str], timeout: Duration) -> Result<String> {
        self.process.wait_log(parts, timeout)
    }
}

//! The real ztunnel as the node's in-pod proxy: the binary from
//! `SHUNT_ZTUNNEL_BIN` in shared mode (its default: in-pod, served over
//! ZDS), run in a netns of its own (its pod), fed by the in-test
//! [`Istiod`] on that netns' loopback, connecting to the agent's ZDS
//! socket (`INPOD_UDS`). It starts its ZDS client after its first xDS
//! update; `/healthz/ready` says 200 once it has a snapshot over ZDS and
//! no pod pending.

use std::{
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use nix::{sys::signal::Signal, unistd::Pid};

use super::{istiod::Istiod, pki::Pki, ztunnel_peer::ready_in_netns};
use crate::{Pod, Result, TestbedError};

/// A running ztunnel in shared mode; killed (by its PID) when dropped.
pub struct ZtunnelNode {
    child: Child,
    pod: Pod,
    log: PathBuf,
    _dir: tempfile::TempDir,
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
        let dir = tempfile::tempdir().map_err(|e| TestbedError::io("a temp dir", e))?;
        let log = dir.path().join("ztunnel.log");
        let out = fs::File::create(&log).map_err(|e| TestbedError::io("ztunnel log", e))?;
        let err = out
            .try_clone()
            .map_err(|e| TestbedError::io("ztunnel log", e))?;
        let istiod_url = format!("https://{}", istiod.addr);
        let child = pod
            .command(binary)
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("XDS_ADDRESS", &istiod_url)
            .env("CA_ADDRESS", &istiod_url)
            .env("XDS_ROOT_CA", pki.root_file())
            .env("CA_ROOT_CA", pki.root_file())
            .env("AUTH_TOKEN", pki.token_file())
            .env("INPOD_UDS", zds_socket)
            .env("INSTANCE_IP", pod.ip().to_string())
            .env("NODE_NAME", pod.node().name())
            .env("CLUSTER_ID", "Kubernetes")
            .env("IPV6_ENABLED", "false")
            .env("ZTUNNEL_WORKER_THREADS", "1")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| TestbedError::io(format!("starting {}", binary.display()), e))?;
        let mut ztunnel = ZtunnelNode {
            child,
            pod: pod.clone(),
            log,
            _dir: dir,
        };
        ztunnel.wait_until(Duration::from_secs(30), |_| true)?;
        Ok(ztunnel)
    }

    /// Its log so far (stdout and stderr).
    pub fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Readiness's answer now, if it answers.
    pub fn readiness(&self) -> Option<u16> {
        let readiness = SocketAddr::from(([127, 0, 0, 1], 15021));
        self.pod.run(move || ready_in_netns(readiness)).ok()?.ok()
    }

    /// Waits (bounded) until readiness says 200.
    pub fn wait_ready(&mut self, timeout: Duration) -> Result<()> {
        self.wait_until(timeout, |code| code == 200)
    }

    /// Waits (bounded) until its log has a line containing every part.
    pub fn wait_log(&self, parts: &[&str], timeout: Duration) -> Result<String> {
        let deadline = Instant::now() + timeout;
        loop {
            let logs = self.logs();
            if let Some(line) = logs.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
                return Ok(line.to_string());
            }
            if Instant::now() >= deadline {
                return Err(TestbedError::Invalid(format!(
                    "no ztunnel log line with {parts:?} within {timeout:?}:\n{logs}"
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }

    /// Polls readiness (bounded) until its status code passes `done`.
    fn wait_until(&mut self, timeout: Duration, done: impl Fn(u16) -> bool) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let readiness = SocketAddr::from(([127, 0, 0, 1], 15021));
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(TestbedError::Invalid(format!(
                    "ztunnel exited ({status}):\n{}",
                    self.logs()
                )));
            }
            let last = match self.pod.run(move || ready_in_netns(readiness))? {
                Ok(code) if done(code) => return Ok(()),
                Ok(code) => format!("readiness answered {code}"),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(TestbedError::Invalid(format!(
                    "ztunnel not there within {timeout:?} ({last}):\n{}",
                    self.logs()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

impl Drop for ZtunnelNode {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

//! One run of the real ztunnel binary inside a pod's netns, whatever its
//! mode: the environment every test gives it (the in-test [`Istiod`] for
//! xDS and certificates, one worker, no IPv6), its log, its readiness
//! port, and its end by PID. [`super::ztunnel_peer`] (dedicated mode) and
//! [`super::ztunnel_node`] (shared mode over ZDS) add their own settings.

use std::{
    ffi::OsStr,
    fs,
    net::SocketAddr,
    path::{Path, PathBuf},
    process::{Child, Stdio},
    time::Duration,
};

use nix::{sys::signal::Signal, unistd::Pid};

use super::{istiod::Istiod, pki::Pki};
use crate::{Cgroup, Pod, Result, TestbedError, poll::until};

/// ztunnel's readiness port, on the pod netns' loopback.
const READINESS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 15021);

/// ztunnel's admin port (`/config_dump`), on the pod netns' loopback.
const ADMIN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 15000);

/// ztunnel's stats port (`/metrics`), on the pod netns' loopback.
const STATS: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::LOCALHOST), 15020);

/// How often its readiness port or log is looked at.
const EVERY: Duration = Duration::from_millis(50);

/// How long it may take until its readiness port answers at all.
const START: Duration = Duration::from_secs(30);

/// A running ztunnel; killed (by its PID) when stopped or dropped.
pub(super) struct ZtunnelProcess {
    child: Child,
    pod: Pod,
    log: PathBuf,
    stopped: bool,
    _dir: tempfile::TempDir,
}

impl ZtunnelProcess {
    /// Starts `binary` in `pod` (and in `cgroup`, if given) against
    /// `istiod` with the common settings and `env` on top, and waits
    /// (bounded) until readiness answers. With `resolv_conf`, that file is
    /// its `/etc/resolv.conf` ([`with_resolv_conf`]).
    pub(super) fn start<'a, V: AsRef<OsStr> + 'a>(
        binary: &Path,
        pod: &Pod,
        cgroup: Option<&Cgroup>,
        istiod: &Istiod,
        pki: &Pki,
        env: impl IntoIterator<Item = (&'a str, V)>,
        resolv_conf: Option<&Path>,
    ) -> Result<ZtunnelProcess> {
        // ztunnel reads a few defaults relative to its working directory
        // (`./etc/istio/...`, `./var/run/secrets/...`): an empty one.
        let dir = tempfile::tempdir().map_err(|e| TestbedError::io("a temp dir", e))?;
        let log = dir.path().join("ztunnel.log");
        let out = fs::File::create(&log).map_err(|e| TestbedError::io("ztunnel log", e))?;
        let err = out
            .try_clone()
            .map_err(|e| TestbedError::io("ztunnel log", e))?;
        let istiod_url = format!("https://{}", istiod.addr);
        let mut command = match resolv_conf {
            Some(conf) => with_resolv_conf(pod, binary, conf),
            None => pod.command(binary),
        };
        if let Some(cgroup) = cgroup {
            cgroup.place(&mut command);
        }
        command
            .current_dir(dir.path())
            .env_clear()
            .env("PATH", "/usr/sbin:/usr/bin:/sbin:/bin")
            .env("XDS_ADDRESS", &istiod_url)
            .env("CA_ADDRESS", &istiod_url)
            .env("XDS_ROOT_CA", pki.root_file())
            .env("CA_ROOT_CA", pki.root_file())
            .env("AUTH_TOKEN", pki.token_file())
            .env("INSTANCE_IP", pod.ip().to_string())
            .env("NODE_NAME", pod.node().name())
            .env("CLUSTER_ID", "Kubernetes")
            // The topologies have no IPv6.
            .env("IPV6_ENABLED", "false")
            .env("ZTUNNEL_WORKER_THREADS", "1")
            .env("RUST_LOG", "info");
        for (name, value) in env {
            command.env(name, value);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| TestbedError::io(format!("starting {}", binary.display()), e))?;
        let mut ztunnel = ZtunnelProcess {
            child,
            pod: pod.clone(),
            log,
            stopped: false,
            _dir: dir,
        };
        ztunnel.wait_until(START, |_| true)?;
        Ok(ztunnel)
    }

    /// Its log so far (stdout and stderr).
    pub(super) fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Readiness's answer now, if it answers.
    pub(super) fn readiness(&self) -> Option<u16> {
        self.pod.run(|| ready_in_netns(READINESS)).ok()?.ok()
    }

    /// `GET path` on its admin port (127.0.0.1:15000 in its pod): the
    /// status code and body.
    pub(super) fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        let stream = self.pod.connect_tcp(ADMIN, Duration::from_secs(2))?;
        crate::agent::http_over(stream, "GET", path)
            .map_err(|e| TestbedError::io(format!("GET {ADMIN}{path}"), e))
    }

    /// `GET /metrics` on its stats port (15020 in its pod).
    pub(super) fn metrics_get(&self) -> Result<(u16, String)> {
        let stream = self.pod.connect_tcp(STATS, Duration::from_secs(2))?;
        crate::agent::http_over(stream, "GET", "/metrics")
            .map_err(|e| TestbedError::io(format!("GET {STATS}/metrics"), e))
    }

    /// Polls readiness (bounded) until its status code passes `done`;
    /// fails at once, with its log, if it exited.
    pub(super) fn wait_until(
        &mut self,
        timeout: Duration,
        done: impl Fn(u16) -> bool,
    ) -> Result<()> {
        let mut last = String::from("no answer yet");
        let seen = until(timeout, EVERY, || {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Some(Err(TestbedError::Invalid(format!(
                    "ztunnel exited ({status}):\n{}",
                    self.logs()
                ))));
            }
            match self.pod.run(|| ready_in_netns(READINESS)) {
                Err(e) => return Some(Err(e)),
                Ok(Ok(code)) if done(code) => return Some(Ok(())),
                Ok(Ok(code)) => last = format!("readiness answered {code}"),
                Ok(Err(e)) => last = e,
            }
            None
        });
        seen.unwrap_or_else(|| {
            Err(TestbedError::Invalid(format!(
                "ztunnel not there within {timeout:?} ({last}):\n{}",
                self.logs()
            )))
        })
    }

    /// Waits (bounded) until its log has a line containing every part.
    pub(super) fn wait_log(&self, parts: &[&str], timeout: Duration) -> Result<String> {
        let line = until(timeout, EVERY, || {
            let logs = self.logs();
            logs.lines()
                .find(|l| parts.iter().all(|p| l.contains(p)))
                .map(str::to_owned)
        });
        line.ok_or_else(|| {
            TestbedError::Invalid(format!(
                "no ztunnel log line with {parts:?} within {timeout:?}:\n{}",
                self.logs()
            ))
        })
    }

    /// Kills it (by its PID) and reaps it; again does nothing.
    pub(super) fn stop(&mut self) {
        if std::mem::replace(&mut self.stopped, true) {
            return;
        }
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
        let _ = self.child.wait();
    }
}

impl Drop for ZtunnelProcess {
    fn drop(&mut self) {
        self.stop();
    }
}

/// `binary` in `pod`'s netns and in a mount namespace of its own whose
/// `/etc/resolv.conf` is `conf`: ztunnel resolves with the system's
/// resolver, which reads that path. `unshare` and `nsenter` exec, so the
/// child's PID is ztunnel's.
fn with_resolv_conf(pod: &Pod, binary: &Path, conf: &Path) -> std::process::Command {
    let mut command = std::process::Command::new("unshare");
    command
        .args(["--mount", "--propagation", "private", "--", "sh", "-c"])
        .arg(r#"mount --bind "$1" /etc/resolv.conf && shift && exec "$@""#)
        .arg("sh")
        .arg(conf)
        .arg("nsenter")
        .arg(format!("--net={}", pod.netns_path().display()))
        .arg("--")
        .arg(binary);
    command
}

/// GET /healthz/ready on `addr` from the current thread's netns.
fn ready_in_netns(addr: SocketAddr) -> std::result::Result<u16, String> {
    use std::io::{Read as _, Write as _};
    let mut stream = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(2))
        .map_err(|e| format!("connecting {addr}: {e}"))?;
    stream
        .set_read_timeout(Some(Duration::from_secs(5)))
        .map_err(|e| e.to_string())?;
    stream
        .write_all(b"GET /healthz/ready HTTP/1.0\r\nHost: localhost\r\n\r\n")
        .map_err(|e| e.to_string())?;
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).map_err(|e| e.to_string())?;
    let text = String::from_utf8_lossy(&raw);
    text.split(' ')
        .nth(1)
        .and_then(|c| c.parse().ok())
        .ok_or_else(|| format!("bad answer {text:?}"))
}

//! The real ztunnel as a peer: the binary from `SHUNT_ZTUNNEL_BIN`, run in
//! dedicated mode (`PROXY_MODE=dedicated`, one workload) inside that
//! workload's pod netns, fed by the in-test [`Istiod`] over TLS for both
//! xDS and certificates. Its admin and readiness ports are the pod netns'
//! own loopback ones; it is up once `:15021` answers and ready when
//! `/healthz/ready` says 200 (ztunnel stays unready while the first
//! response of a type was NACKed, though it applied the rest).
//!
//! Plaintext reaches it as istio-cni sends it in the pod: a `nat` REDIRECT
//! of the pod's inbound TCP (all but 15008) to 15006, and, for a client's
//! ztunnel, of the pod's own TCP to the test range to 15001. The rules go
//! with the ztunnel.

use std::{
    fs,
    net::SocketAddr,
    path::PathBuf,
    process::{Child, Stdio},
    time::{Duration, Instant},
};

use nix::{sys::signal::Signal, unistd::Pid};

use super::istiod::Istiod;
use super::pki::Pki;
use crate::{Pod, Result, TestbedError};

/// The variable naming the ztunnel binary; the comparison skips ztunnel
/// without it.
pub const ZTUNNEL_BIN_ENV: &str = "SHUNT_ZTUNNEL_BIN";

/// The ztunnel binary, or why there is none.
pub fn ztunnel_binary() -> std::result::Result<PathBuf, String> {
    let path = std::env::var_os(ZTUNNEL_BIN_ENV)
        .map(PathBuf::from)
        .ok_or_else(|| format!("{ZTUNNEL_BIN_ENV} is not set"))?;
    if path.is_file() {
        Ok(path)
    } else {
        Err(format!(
            "{ZTUNNEL_BIN_ENV}={} is not a file",
            path.display()
        ))
    }
}

/// A running ztunnel serving one pod; killed when dropped.
pub struct Ztunnel {
    child: Child,
    pod: Pod,
    log: PathBuf,
    /// The `nat` rules it added to the pod, removed when it goes.
    rules: Vec<String>,
    _dir: tempfile::TempDir,
}

impl Ztunnel {
    /// Starts `binary` for the workload `namespace/name/service_account` in
    /// `pod`, against `istiod` (listening on the pod netns' loopback), and
    /// waits (bounded) until its readiness endpoint answers. With
    /// `capture_outbound` (a CIDR), the pod's own connections there go to
    /// it too. `network` is the proxy's network (`NETWORK`).
    pub fn start(
        binary: &std::path::Path,
        pod: &Pod,
        workload: (&str, &str, &str),
        istiod: &Istiod,
        pki: &Pki,
        capture_outbound: Option<&str>,
        network: &str,
    ) -> Result<Ztunnel> {
        let mut rules = vec![inbound_plaintext_rule()];
        if let Some(cidr) = capture_outbound {
            rules.push(outbound_rule(cidr));
        }
        for rule in &rules {
            nat_rule(pod, "-A", rule)?;
        }
        // ztunnel reads a few defaults relative to its working directory
        // (`./etc/istio/...`, `./var/run/secrets/...`): an empty one.
        let dir = tempfile::tempdir().map_err(|e| TestbedError::io("a temp dir", e))?;
        let log = dir.path().join("ztunnel.log");
        let out = fs::File::create(&log).map_err(|e| TestbedError::io("ztunnel log", e))?;
        let err = out
            .try_clone()
            .map_err(|e| TestbedError::io("ztunnel log", e))?;
        let istiod_url = format!("https://{}", istiod.addr);
        let (namespace, name, service_account) = workload;
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
            .env("PROXY_MODE", "dedicated")
            .env(
                "PROXY_WORKLOAD_INFO",
                format!("{namespace}/{name}/{service_account}"),
            )
            .env("INSTANCE_IP", pod.ip().to_string())
            .env("NODE_NAME", pod.node().name())
            .env("CLUSTER_ID", "Kubernetes")
            .env("NETWORK", network)
            // The topology has no IPv6; nothing may bind the pod's source
            // address on ztunnel's side (no policy routing here).
            .env("IPV6_ENABLED", "false")
            .env("ENABLE_ORIG_SRC", "false")
            .env("ZTUNNEL_WORKER_THREADS", "1")
            .env("RUST_LOG", "info")
            .stdin(Stdio::null())
            .stdout(out)
            .stderr(err)
            .spawn()
            .map_err(|e| TestbedError::io(format!("starting {}", binary.display()), e))?;
        let mut ztunnel = Ztunnel {
            child,
            pod: pod.clone(),
            log,
            rules,
            _dir: dir,
        };
        ztunnel.wait_until(Duration::from_secs(30), |_| true)?;
        Ok(ztunnel)
    }

    /// Its log so far (stdout and stderr).
    pub fn logs(&self) -> String {
        fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// Waits (bounded) until readiness says 200; false if it does not.
    pub fn wait_ready(&mut self, timeout: Duration) -> bool {
        self.wait_until(timeout, |code| code == 200).is_ok()
    }

    /// Readiness's answer now, if it answers.
    pub fn readiness(&self) -> Option<u16> {
        let readiness = SocketAddr::from(([127, 0, 0, 1], 15021));
        self.pod.run(move || ready_in_netns(readiness)).ok()?.ok()
    }

    /// Polls readiness (bounded) until its status code passes `done`.
    fn wait_until(&mut self, timeout: Duration, done: impl Fn(u16) -> bool) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let readiness = SocketAddr::from(([127, 0, 0, 1], 15021));
        loop {
            if let Ok(Some(status)) = self.child.try_wait() {
                return Err(TestbedError::Invalid(format!(
                    "ztunnel exited ({status}) before it was ready:\n{}",
                    self.logs()
                )));
            }
            let pod = &self.pod;
            let last = match pod.run(move || ready_in_netns(readiness))? {
                Ok(code) if done(code) => return Ok(()),
                Ok(code) => format!("readiness answered {code}"),
                Err(e) => e,
            };
            if Instant::now() >= deadline {
                return Err(TestbedError::Invalid(format!(
                    "ztunnel not up within {timeout:?} ({last}):\n{}",
                    self.logs()
                )));
            }
            std::thread::sleep(Duration::from_millis(50));
        }
    }
}

/// GET /healthz/ready on `addr` from the current thread's netns.
pub(super) fn ready_in_netns(addr: SocketAddr) -> std::result::Result<u16, String> {
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

/// The pod's inbound TCP, except HBONE's 15008, to ztunnel's plaintext
/// inbound port 15006 (as istio-cni sends it in the pod).
fn inbound_plaintext_rule() -> String {
    format!(
        "PREROUTING -i {} -p tcp ! --dport 15008 -j REDIRECT --to-ports 15006",
        crate::POD_IF
    )
}

/// The pod's own TCP to `cidr` (the test range: VIPs and pods), except
/// to HBONE's 15008, to ztunnel's outbound port 15001. ztunnel's own
/// connections (HBONE to 15008, istiod on loopback) are not caught again.
fn outbound_rule(cidr: &str) -> String {
    format!("OUTPUT -p tcp -d {cidr} ! --dport 15008 -j REDIRECT --to-ports 15001")
}

/// Appends (`-A`) or deletes (`-D`) `rule` (chain first, words separated
/// by spaces) in the pod's `nat` table; appending a rule that is there
/// already does nothing.
fn nat_rule(pod: &Pod, op: &str, rule: &str) -> Result<()> {
    let iptables = |op: &str| {
        let mut args = vec!["-t", "nat", op];
        args.extend(rule.split(' '));
        pod.command("iptables")
            .args(&args)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .status()
            .map_err(|e| TestbedError::io("running iptables", e))
    };
    if op == "-A" && iptables("-C")?.success() {
        return Ok(());
    }
    let status = iptables(op)?;
    if status.success() {
        Ok(())
    } else {
        Err(TestbedError::Invalid(format!(
            "iptables -t nat {op} {rule} in {}: {status}",
            pod.name()
        )))
    }
}

impl Drop for Ztunnel {
    fn drop(&mut self) {
        let pid = Pid::from_raw(self.child.id() as i32);
        let _ = nix::sys::signal::kill(pid, Signal::SIGKILL);
        let _ = self.child.wait();
        for rule in &self.rules {
            if let Err(e) = nat_rule(&self.pod, "-D", rule) {
                crate::warn(format_args!("removing a ztunnel rule: {e}"));
            }
        }
    }
}

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

use std::{path::PathBuf, process::Stdio, time::Duration};

use super::{istiod::Istiod, pki::Pki, ztunnel_process::ZtunnelProcess};
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
    process: ZtunnelProcess,
    pod: Pod,
    /// The `nat` rules it added to the pod, removed when it goes.
    rules: Vec<String>,
}

/// What a peer's ztunnel is given besides its workload.
#[derive(Clone, Copy, Debug, Default)]
pub struct PeerSettings<'a> {
    /// A CIDR: the pod's own connections there go to it too.
    pub capture_outbound: Option<&'a str>,
    /// The proxy's network (`NETWORK`).
    pub network: &'a str,
    /// The resolv.conf it resolves with instead of the system's (its
    /// hostname endpoints, the DNS it forwards).
    pub resolv_conf: Option<&'a std::path::Path>,
}

impl Ztunnel {
    /// Starts `binary` for the workload `namespace/name/service_account` in
    /// `pod`, against `istiod` (listening on the pod netns' loopback), and
    /// waits (bounded) until its readiness endpoint answers, with
    /// `settings`.
    pub fn start(
        binary: &std::path::Path,
        pod: &Pod,
        workload: (&str, &str, &str),
        istiod: &Istiod,
        pki: &Pki,
        settings: PeerSettings<'_>,
    ) -> Result<Ztunnel> {
        let PeerSettings {
            capture_outbound,
            network,
            resolv_conf,
        } = settings;
        let mut wanted = vec![inbound_plaintext_rule()];
        if let Some(cidr) = capture_outbound {
            wanted.push(outbound_rule(cidr));
        }
        let (namespace, name, service_account) = workload;
        let env = [
            ("PROXY_MODE", "dedicated".to_string()),
            (
                "PROXY_WORKLOAD_INFO",
                format!("{namespace}/{name}/{service_account}"),
            ),
            ("NETWORK", network.to_string()),
            ("PACKET_MARK", MARK.to_string()),
            // Nothing may bind the pod's source address on ztunnel's side
            // (no policy routing here).
            ("ENABLE_ORIG_SRC", "false".to_string()),
        ];
        let mut added = Vec::new();
        let started = (|| {
            for rule in wanted {
                nat_rule(pod, "-A", &rule)?;
                added.push(rule);
            }
            ZtunnelProcess::start(binary, pod, None, istiod, pki, env, resolv_conf)
        })();
        match started {
            Ok(process) => Ok(Ztunnel {
                process,
                pod: pod.clone(),
                rules: added,
            }),
            Err(e) => {
                remove_rules(pod, &added);
                Err(e)
            }
        }
    }

    /// Its log so far (stdout and stderr).
    pub fn logs(&self) -> String {
        self.process.logs()
    }

    /// Waits (bounded) until readiness says 200; false if it does not.
    pub fn wait_ready(&mut self, timeout: Duration) -> bool {
        self.process.wait_until(timeout, |code| code == 200).is_ok()
    }

    /// Readiness's answer now, if it answers.
    pub fn readiness(&self) -> Option<u16> {
        self.process.readiness()
    }

    /// `GET path` on its admin port: the status code and body.
    pub fn admin_get(&self, path: &str) -> Result<(u16, String)> {
        self.process.admin_get(path)
    }

    /// `GET /metrics` on its stats port: the status code and body.
    pub fn metrics_get(&self) -> Result<(u16, String)> {
        self.process.metrics_get()
    }
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
/// to HBONE's 15008 and ztunnel's own (its [`MARK`], as istio-cni's rules
/// skip it), to ztunnel's outbound port 15001: ztunnel's connections
/// (HBONE, plain TCP to an endpoint outside the mesh) are not caught
/// again.
fn outbound_rule(cidr: &str) -> String {
    format!(
        "OUTPUT -p tcp -d {cidr} ! --dport 15008 -m mark ! --mark {MARK:#x}/0xfff -j REDIRECT --to-ports 15001"
    )
}

/// The mark ztunnel puts on its sockets (`PACKET_MARK`; Istio's 0x539).
const MARK: u32 = 1337;

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

/// Deletes `rules` from the pod's `nat` table, warning about any left.
fn remove_rules(pod: &Pod, rules: &[String]) {
    for rule in rules {
        if let Err(e) = nat_rule(pod, "-D", rule) {
            crate::warn(format_args!("removing a ztunnel rule: {e}"));
        }
    }
}

impl Drop for Ztunnel {
    fn drop(&mut self) {
        self.process.stop();
        remove_rules(&self.pod, &self.rules);
    }
}

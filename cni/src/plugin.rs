//! The CNI commands, as the runtime runs the plugin: the command and the
//! sandbox in `CNI_*` environment variables, the network configuration
//! (with `prevResult` when chained) on stdin, the result or a CNI error on
//! stdout (CNI spec 1.0, "Execution protocol").
//!
//! - VERSION: the versions this plugin speaks.
//! - ADD: a Kubernetes pod (`K8S_POD_NAMESPACE`/`K8S_POD_NAME` in
//!   `CNI_ARGS`) outside `exclude_namespaces` is handed to the agent, which
//!   answers once the pod is captured or found not to be in the mesh; then
//!   `prevResult` is printed unchanged (byte for byte). A capture that
//!   failed fails the ADD (the runtime retries the sandbox).
//! - DEL: the agent is told (best effort: DEL never fails, and it comes a
//!   second time with an empty `CNI_NETNS`).
//! - CHECK: the agent says whether a mesh pod is still captured.
//!
//! An unreachable agent fails ADD and CHECK, except for the agent's own pod
//! (`agent_namespace` + `agent_pod_prefix`): the plugin cannot tell an
//! ambient pod from another without the agent (istio-cni's plugin asks the
//! API server itself and fails closed for ambient pods, and with
//! `enable_ambient_detection_retry` for pods it cannot judge; here every
//! pod is one it cannot judge). See docs/ISTIO.md, "The CNI plugin".

use std::{collections::BTreeMap, path::PathBuf, time::Duration};

use serde::Deserialize;
use serde_json::value::RawValue;

use crate::wire::{self, Command, IpConfig, Reply, Request};

/// The CNI versions this plugin reads and writes (results are passed
/// through, so any of these works).
pub const SUPPORTED_VERSIONS: &[&str] = &["0.3.0", "0.3.1", "0.4.0", "1.0.0"];

/// Default wait for the agent's answer at ADD (capture, and with
/// `--proxy ztunnel` ztunnel's acknowledgement).
pub const DEFAULT_TIMEOUT_SECONDS: u64 = 30;

/// CNI's well-known error codes (spec, "Error").
pub mod code {
    pub const INCOMPATIBLE_VERSION: u32 = 1;
    pub const INVALID_ENVIRONMENT: u32 = 4;
    pub const DECODING_FAILURE: u32 = 6;
    pub const INVALID_CONFIG: u32 = 7;
    pub const TRY_AGAIN_LATER: u32 = 11;
    /// Plugin-specific (100 and up): the agent could not capture the pod.
    pub const CAPTURE_FAILED: u32 = 100;
}

/// shunt-cni's entry in a conflist (what the agent installs), with the
/// `prevResult` the runtime adds.
#[derive(Debug, Deserialize)]
pub struct NetConf {
    #[serde(rename = "cniVersion")]
    pub cni_version: String,
    #[serde(default)]
    pub name: String,
    #[serde(rename = "type")]
    pub plugin_type: String,
    /// The agent's socket (`--cni-socket`).
    pub agent_socket: PathBuf,
    #[serde(default = "default_timeout")]
    pub timeout_seconds: u64,
    /// Pods of these namespaces pass without asking the agent.
    #[serde(default)]
    pub exclude_namespaces: Vec<String>,
    /// The agent's own pods (namespace, name prefix) pass when the agent
    /// is unreachable: it cannot start otherwise.
    #[serde(default)]
    pub agent_namespace: Option<String>,
    #[serde(default)]
    pub agent_pod_prefix: Option<String>,
    #[serde(rename = "prevResult", default)]
    pub prev_result: Option<Box<RawValue>>,
}

fn default_timeout() -> u64 {
    DEFAULT_TIMEOUT_SECONDS
}

/// What the process prints on stdout and exits with.
#[derive(Debug, PartialEq, Eq)]
pub struct Outcome {
    pub stdout: String,
    pub exit_code: i32,
    /// One line for stderr (the runtime shows it with a failure).
    pub log: Option<String>,
}

impl Outcome {
    fn ok(stdout: String) -> Self {
        Self {
            stdout,
            exit_code: 0,
            log: None,
        }
    }

    fn error(version: &str, code: u32, msg: impl Into<String>, details: impl Into<String>) -> Self {
        let msg = msg.into();
        let details = details.into();
        let body = serde_json::json!({
            "cniVersion": version,
            "code": code,
            "msg": msg,
            "details": details,
        });
        Self {
            stdout: body.to_string(),
            exit_code: 1,
            log: Some(format!("shunt-cni: {msg}: {details}")),
        }
    }

    fn logged(mut self, line: String) -> Self {
        self.log = Some(line);
        self
    }
}

/// Runs one CNI command: `env` holds the process's environment, `stdin`
/// what the runtime wrote.
pub fn run(env: &BTreeMap<String, String>, stdin: &[u8]) -> Outcome {
    let var = |name: &str| env.get(name).map(String::as_str).unwrap_or("");
    let command = var("CNI_COMMAND");
    if command == "VERSION" {
        return Outcome::ok(
            serde_json::json!({
                "cniVersion": "1.0.0",
                "supportedVersions": SUPPORTED_VERSIONS,
            })
            .to_string(),
        );
    }
    let conf: NetConf = match serde_json::from_slice(stdin) {
        Ok(conf) => conf,
        Err(error) => {
            return Outcome::error(
                "1.0.0",
                code::DECODING_FAILURE,
                "cannot read the network configuration on stdin",
                error.to_string(),
            );
        }
    };
    let version = conf.cni_version.clone();
    if !SUPPORTED_VERSIONS.contains(&version.as_str()) {
        return Outcome::error(
            &version,
            code::INCOMPATIBLE_VERSION,
            format!("cniVersion {version} is not supported"),
            format!("supported: {}", SUPPORTED_VERSIONS.join(", ")),
        );
    }
    let command = match command {
        "ADD" => Command::Add,
        "DEL" => Command::Del,
        "CHECK" => Command::Check,
        // CNI 1.1's GC and STATUS: nothing of ours to collect, and the
        // agent's readiness is its own probe's.
        "GC" | "STATUS" => return Outcome::ok(String::new()),
        other => {
            return Outcome::error(
                &version,
                code::INVALID_ENVIRONMENT,
                "unknown CNI_COMMAND",
                format!("{other:?}"),
            );
        }
    };
    let args = cni_args(var("CNI_ARGS"));
    let pod_namespace = args.get("K8S_POD_NAMESPACE").cloned().unwrap_or_default();
    let pod_name = args.get("K8S_POD_NAME").cloned().unwrap_or_default();
    // What ADD prints when it lets the sandbox through.
    let pass = || match &conf.prev_result {
        Some(raw) => raw.get().to_owned(),
        None => serde_json::json!({ "cniVersion": version }).to_string(),
    };
    let quiet = |command: Command| match command {
        Command::Add => Outcome::ok(pass()),
        Command::Del | Command::Check => Outcome::ok(String::new()),
    };
    if pod_namespace.is_empty() || pod_name.is_empty() {
        // Not a Kubernetes pod: nothing of the mesh's.
        return quiet(command);
    }
    if conf.exclude_namespaces.contains(&pod_namespace) {
        return quiet(command);
    }
    let ips = match &conf.prev_result {
        Some(raw) => prev_result_ips(raw.get()),
        None => Vec::new(),
    };
    let request = Request {
        command,
        container_id: var("CNI_CONTAINERID").to_owned(),
        netns: var("CNI_NETNS").to_owned(),
        if_name: var("CNI_IFNAME").to_owned(),
        pod_namespace: pod_namespace.clone(),
        pod_name: pod_name.clone(),
        pod_uid: args.get("K8S_POD_UID").cloned(),
        ips,
    };
    if command == Command::Add && request.netns.is_empty() {
        return Outcome::error(
            &version,
            code::INVALID_ENVIRONMENT,
            "ADD without CNI_NETNS",
            format!("pod {pod_namespace}/{pod_name}"),
        );
    }
    // The agent answers at its own deadline; a little more here lets its
    // answer (which says what it waited for) arrive first.
    let timeout = Duration::from_secs(conf.timeout_seconds.max(1) + 5);
    let pod = format!("{pod_namespace}/{pod_name}");
    match wire::exchange(&conf.agent_socket, &request, timeout) {
        Ok(Reply::Captured | Reply::NotInMesh | Reply::Released) => quiet(command),
        Ok(Reply::Failed(reason)) => match command {
            Command::Del => quiet(command).logged(format!("shunt-cni: DEL of {pod}: {reason}")),
            _ => Outcome::error(
                &version,
                code::CAPTURE_FAILED,
                format!("the shunt agent could not capture pod {pod}"),
                reason,
            ),
        },
        Err(error) => {
            let own_pod = conf.agent_namespace.as_deref() == Some(pod_namespace.as_str())
                && conf
                    .agent_pod_prefix
                    .as_deref()
                    .is_some_and(|prefix| !prefix.is_empty() && pod_name.starts_with(prefix));
            match command {
                // DEL never fails: the agent's pod watch cleans up after it.
                Command::Del => quiet(command).logged(format!("shunt-cni: DEL of {pod}: {error}")),
                _ if own_pod && error.is_unreachable() => quiet(command)
                    .logged(format!("shunt-cni: {pod} is the agent's own pod: {error}")),
                _ => Outcome::error(
                    &version,
                    code::TRY_AGAIN_LATER,
                    format!("cannot tell whether pod {pod} is in the mesh"),
                    error.to_string(),
                ),
            }
        }
    }
}

/// `CNI_ARGS`: `KEY=VALUE` pairs separated by `;`.
fn cni_args(raw: &str) -> BTreeMap<String, String> {
    raw.split(';')
        .filter_map(|pair| pair.split_once('='))
        .map(|(k, v)| (k.trim().to_owned(), v.trim().to_owned()))
        .collect()
}

/// The `ips` of a result (any supported version: 0.3.0 and later carry
/// `ips[].address`). An unreadable result gives none: the agent then
/// takes the pod's addresses from the API.
fn prev_result_ips(raw: &str) -> Vec<IpConfig> {
    #[derive(Deserialize)]
    struct Result {
        #[serde(default)]
        ips: Vec<IpConfig>,
    }
    serde_json::from_str::<Result>(raw)
        .map(|r| r.ips)
        .unwrap_or_default()
}

#[cfg(test)]
#[path = "plugin_tests.rs"]
mod tests;

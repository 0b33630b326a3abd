//! The CNI plugin's node side (`--cni-socket`, `--cni-conf-dir`,
//! `--cni-bin-dir`): the socket served, the plugin binary and its entry in
//! the node's primary CNI configuration installed once the socket serves,
//! and the entry removed when the agent exits with `--on-exit unenrol`.

use std::{path::PathBuf, time::Duration};

use shunt_cni::conflist::{self, ConflistError, Entry};
use tokio::sync::mpsc;
use tracing::{Instrument as _, info, info_span, warn};

use crate::{
    cli::AgentArgs,
    control::cni::{self, CniCall, CniSocketError},
};

/// Requests queued for the pod source at most (the plugin retries).
const QUEUE: usize = 256;

/// How often the entry's install is tried while the node has no CNI
/// configuration yet (the network plugin installs its own first).
const INSTALL_RETRY: Duration = Duration::from_secs(2);

/// Binds `--cni-socket` and serves it; the pod source takes the requests
/// from the returned receiver. Then installs the plugin (in a task that
/// waits for the node's primary CNI configuration).
pub(super) fn start(
    args: &AgentArgs,
    socket: &std::path::Path,
) -> Result<mpsc::Receiver<CniCall>, CniSocketError> {
    let listener = cni::bind(socket)?;
    let (calls, requests) = mpsc::channel(QUEUE);
    let timeout = Duration::from_secs(args.cni_timeout.max(1));
    tokio::spawn(cni::serve(listener, calls, timeout).instrument(info_span!("cni")));
    if let Some(conf_dir) = args.cni_conf_dir.clone() {
        let entry = Entry {
            agent_socket: socket.to_owned(),
            timeout_seconds: args.cni_timeout.max(1),
            // The plugin lets these through without asking: the same list the
            // agent never enrols (kube-system's pods must start for the agent to).
            exclude_namespaces: args.exclude_namespaces.clone(),
            agent_namespace: args.cni_agent_namespace.clone().or_else(own_namespace),
            agent_pod_prefix: Some(args.cni_agent_pod_prefix.clone()),
        };
        let binary = args
            .cni_bin_dir
            .clone()
            .map(|dir| (plugin_binary(args), dir));
        tokio::spawn(install(conf_dir, entry, binary).instrument(info_span!("cni_install")));
    }
    Ok(requests)
}

/// The agent pod's namespace, from its service account (in a cluster).
fn own_namespace() -> Option<String> {
    std::fs::read_to_string("/var/run/secrets/kubernetes.io/serviceaccount/namespace")
        .ok()
        .map(|ns| ns.trim().to_owned())
        .filter(|ns| !ns.is_empty())
}

/// The plugin binary to copy: `--cni-plugin`, else `shunt-cni` beside the
/// agent's executable.
fn plugin_binary(args: &AgentArgs) -> PathBuf {
    args.cni_plugin.clone().unwrap_or_else(|| {
        std::env::current_exe()
            .ok()
            .and_then(|exe| exe.parent().map(|dir| dir.join(shunt_cni::PLUGIN_TYPE)))
            .unwrap_or_else(|| PathBuf::from(shunt_cni::PLUGIN_TYPE))
    })
}

async fn install(conf_dir: PathBuf, entry: Entry, binary: Option<(PathBuf, PathBuf)>) {
    if let Some((from, bin_dir)) = &binary {
        match conflist::install_binary(from, bin_dir) {
            Ok(to) => info!(plugin = %to.display(), "CNI plugin binary installed"),
            // Without its binary the entry would fail every sandbox.
            Err(error) => {
                warn!(%error, "cannot install the CNI plugin binary; its entry is not added");
                return;
            }
        }
    }
    let mut told = false;
    loop {
        match conflist::install(&conf_dir, &entry) {
            Ok(path) => {
                info!(conflist = %path.display(), "shunt-cni chained into the node's CNI configuration");
                return;
            }
            Err(ConflistError::NoPrimary { .. }) => {
                if !told {
                    info!(dir = %conf_dir.display(), "no CNI configuration yet; shunt-cni is chained once the network plugin writes one");
                    told = true;
                }
            }
            Err(error) => {
                warn!(%error, "cannot chain shunt-cni into the node's CNI configuration; retrying");
            }
        }
        tokio::time::sleep(INSTALL_RETRY).await;
    }
}

/// Removes shunt-cni's entry from every configuration list of
/// `--cni-conf-dir` (and its binary from `--cni-bin-dir`): new sandboxes
/// no longer wait for an agent that is leaving. Errors are logged.
pub(super) fn uninstall(args: &AgentArgs) {
    let Some(conf_dir) = &args.cni_conf_dir else {
        return;
    };
    match conflist::uninstall(conf_dir) {
        Ok(changed) => {
            for path in changed {
                info!(conflist = %path.display(), "shunt-cni removed from the node's CNI configuration");
            }
        }
        Err(error) => warn!(%error, "cannot remove shunt-cni from the node's CNI configuration"),
    }
    if let Some(bin_dir) = &args.cni_bin_dir {
        let binary = bin_dir.join(shunt_cni::PLUGIN_TYPE);
        match std::fs::remove_file(&binary) {
            Ok(()) => info!(plugin = %binary.display(), "CNI plugin binary removed"),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(error) => {
                warn!(plugin = %binary.display(), %error, "cannot remove the CNI plugin binary")
            }
        }
    }
}

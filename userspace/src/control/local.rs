//! The local workloads file (`--workloads FILE`): the pod source that needs no
//! cluster (tests, the demo, the bench).
//!
//! ```yaml
//! trustDomain: cluster.local       # optional, default cluster.local
//! workloads:
//!   - name: client                 # pod name (DNS-1123 subdomain)
//!     namespace: default           # DNS-1123 label
//!     serviceAccount: sleep
//!     ips: ["198.18.1.2"]          # at least one; no IP in two entries
//!     node: node-a
//!     netns: /var/run/netns/client # required for this node's ambient pods
//!     dataplaneMode: ambient       # or none; optional, default none
//!     labels: {app: client}        # optional; what policy selectors see,
//!                                  # and istio.io/use-waypoint
//! services:                        # optional
//!   - name: web                    # service name (DNS-1123 label)
//!     namespace: default
//!     clusterIPs: ["198.19.100.1"] # the VIPs; no workload's IP
//!     ports:
//!       - port: 80                 # what clients connect to
//!         targetPort: 8080         # optional, default: port
//!     endpoints: [server, 198.18.2.3]  # pods of the namespace, or IPs
//!     labels: {istio.io/use-waypoint: none}  # optional (waypoint bindings)
//! namespaces:                      # optional: namespaces' labels
//!   - name: default
//!     labels: {istio.io/use-waypoint: waypoint}
//! waypoints:                       # optional: waypoint Gateways; each needs
//!   - name: waypoint               # a `services` entry of its name whose
//!     namespace: default           # endpoints are its pods (port 15008)
//!     for: service                 # service (default), workload, all, none
//! authorizationPolicies:           # optional: security.istio.io/v1 objects
//!   - apiVersion: security.istio.io/v1
//!     kind: AuthorizationPolicy
//!     metadata: {name: allow-client, namespace: default}
//!     spec:
//!       selector: {matchLabels: {app: server}}
//!       rules: [{from: [{source: {principals: [cluster.local/ns/default/sa/client]}}]}]
//! ```
//!
//! Waypoint bindings follow Istio's `istio.io/use-waypoint` rules (see
//! [`waypoints`]); a binding to a waypoint not listed is a problem.
//!
//! A bad authorization policy does not make the file invalid: it is
//! reported (file, entry, field) and replaced by a fail-closed stand-in
//! (see [`policies`]), the others apply.
//!
//! `dataplaneMode` defaults to `none` because the mesh is opt-in, as in Istio.
//! A service's endpoints are always ready; a pod name stands for each of its
//! IPs, and an IP that no workload owns is a backend outside the mesh.
//! One file can describe a whole (simulated) cluster: each agent enrols the
//! pods of its own node and needs the others' IPs and identities as peers.
//!
//! [`parse`] checks everything that does not depend on the machine and reports
//! every problem at once (except YAML syntax and structure errors, which stop
//! parsing); [`validate_for_node`] then checks what the agent of one node needs;
//! [`load`] does both.

use std::{
    fs, io,
    path::{Path, PathBuf},
};

mod entries;
pub mod policies;
mod problems;
mod raw;
mod waypoints;

use entries::{NameRule, check_entries, check_services};
use problems::structure_problem;
pub use problems::{Entry, Problem, WorkloadsFileError};
use raw::RawFile;

use crate::state::{Service, TrustDomain, Workload, WorkloadKey};

/// The content of a valid workloads file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct LocalWorkloads {
    /// The file it came from, named in error messages.
    pub source: PathBuf,
    pub trust_domain: TrustDomain,
    /// In file order, so `workloads[i]` in messages is `workloads[i]` here.
    pub workloads: Vec<Workload>,
    /// In file order (`services[i]`); empty when the file has none.
    pub services: Vec<Service>,
    /// The authorization policies (with stand-ins for the bad ones).
    pub policies: Vec<crate::authz::Policy>,
    /// What was wrong with `authorizationPolicies` (those entries are
    /// replaced by stand-ins), and what the node proxy cannot enforce:
    /// logged by [`load`], not fatal.
    pub policy_findings: policies::Findings,
}

/// Reads the workloads file at `path` and checks it for the agent of `node`:
/// [`parse_in`] (services named in `cluster_domain`, `--cluster-domain`),
/// then [`validate_for_node`].
pub fn load(
    path: &Path,
    node: &str,
    cluster_domain: &str,
) -> Result<LocalWorkloads, WorkloadsFileError> {
    let text = fs::read_to_string(path).map_err(|source| WorkloadsFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    let local = parse_in(path, &text, cluster_domain)?;
    validate_for_node(&local, node)?;
    local.policy_findings.log(path);
    Ok(local)
}

/// [`parse_in`] the default cluster domain (`cluster.local`).
pub fn parse(path: &Path, text: &str) -> Result<LocalWorkloads, WorkloadsFileError> {
    parse_in(path, text, crate::control::waypoint::DEFAULT_CLUSTER_DOMAIN)
}

/// Parses and checks a workloads file; `path` only names it in messages.
/// Services (and the waypoints reached through them) are named
/// `<name>.<namespace>.svc.<cluster_domain>`.
pub fn parse_in(
    path: &Path,
    text: &str,
    cluster_domain: &str,
) -> Result<LocalWorkloads, WorkloadsFileError> {
    let invalid = |problems| WorkloadsFileError::Invalid {
        path: path.to_owned(),
        problems,
    };
    let raw: RawFile =
        serde_yaml::from_str(text).map_err(|e| invalid(vec![structure_problem(&e, text)]))?;

    let mut problems = Vec::new();
    let trust_domain = match raw.trust_domain.as_deref().map(TrustDomain::new) {
        None => TrustDomain::default(),
        Some(Ok(td)) => td,
        Some(Err(e)) => {
            problems.push(Problem {
                entry: None,
                field: Some("trustDomain".into()),
                message: e.to_string(),
                location: None,
            });
            TrustDomain::default()
        }
    };
    let workload_order: Vec<WorkloadKey> = raw
        .workloads
        .iter()
        .map(|w| WorkloadKey::new(&w.namespace, &w.name))
        .collect();
    let service_labels: Vec<_> = raw
        .services
        .iter()
        .map(|s| (WorkloadKey::new(&s.namespace, &s.name), s.labels.clone()))
        .collect();
    let mut workloads = check_entries(raw.workloads, &mut problems);
    let mut services = check_services(raw.services, &workloads, cluster_domain, &mut problems);
    let inputs = waypoints::Inputs {
        cluster_domain,
        workload_order: &workload_order,
        service_labels: &service_labels,
    };
    waypoints::check(
        raw.namespaces,
        raw.waypoints,
        inputs,
        &mut workloads,
        &mut services,
        &mut problems,
    );
    let (policies, policy_findings) = policies::check(raw.authorization_policies);
    if problems.is_empty() {
        Ok(LocalWorkloads {
            source: path.to_owned(),
            trust_domain,
            workloads,
            services,
            policies,
            policy_findings,
        })
    } else {
        Err(invalid(problems))
    }
}

/// Checks what the agent of `node` needs: each of its pods that opts into the
/// mesh names a network namespace that exists, since capture happens there.
pub fn validate_for_node(local: &LocalWorkloads, node: &str) -> Result<(), WorkloadsFileError> {
    let why = format!(
        "the pod runs on this node, {node}, and opts into the mesh, so its network namespace is required"
    );
    let problems: Vec<Problem> = local
        .workloads
        .iter()
        .enumerate()
        .filter(|(_, w)| w.node == node && w.wants_mesh())
        .filter_map(|(index, w)| {
            let message = match &w.netns {
                None => format!("missing ({why})"),
                Some(netns) => match fs::metadata(netns) {
                    Ok(_) => return None,
                    Err(e) if e.kind() == io::ErrorKind::NotFound => {
                        format!("{} does not exist ({why})", netns.display())
                    }
                    Err(e) => format!("cannot access {}: {e} ({why})", netns.display()),
                },
            };
            let entry = Entry::new("workloads", index, Some(&w.namespace), Some(&w.name));
            Some(Problem {
                entry: Some(entry),
                field: Some("netns".into()),
                message,
                location: None,
            })
        })
        .collect();
    if problems.is_empty() {
        Ok(())
    } else {
        Err(WorkloadsFileError::Invalid {
            path: local.source.clone(),
            problems,
        })
    }
}

#[cfg(test)]
mod tests;

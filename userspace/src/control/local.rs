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
    collections::HashMap,
    fmt, fs, io,
    net::IpAddr,
    path::{Path, PathBuf},
};

use serde::Deserialize;

pub mod policies;
mod waypoints;

use crate::state::{
    DataplaneMode, Endpoint, Service, ServicePort, TrustDomain, Workload, WorkloadKey,
};

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

/// Why a workloads file cannot be used. Displays one line per problem, each
/// starting with the file's path.
#[derive(Debug, thiserror::Error)]
pub enum WorkloadsFileError {
    #[error("{}: cannot read the workloads file: {source}", path.display())]
    Read { path: PathBuf, source: io::Error },
    #[error("{}", show_problems(path, problems))]
    Invalid {
        path: PathBuf,
        problems: Vec<Problem>,
    },
}

/// One thing wrong in a workloads file.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Problem {
    /// The entry of `workloads` or `services` concerned, if any.
    pub entry: Option<Entry>,
    /// The field concerned as written in the file (`ips`, `ips[1]`,
    /// `ports[0].port`, `trustDomain`), if known.
    pub field: Option<String>,
    pub message: String,
    /// 1-based line and column, when the YAML parser knows them.
    pub location: Option<(usize, usize)>,
}

/// An entry of `workloads` or `services`: the list, its index, and
/// `namespace/name` when the entry has both (valid or not: it is there to
/// find the entry in the file).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// `workloads` or `services`.
    pub list: &'static str,
    pub index: usize,
    pub label: Option<String>,
}

/// The file's lists of entries.
const LISTS: [&str; 4] = ["workloads", "services", "namespaces", "waypoints"];

impl Entry {
    fn new(list: &'static str, index: usize, namespace: Option<&str>, name: Option<&str>) -> Self {
        let label = match (namespace, name) {
            (Some(ns), Some(name)) if !ns.is_empty() && !name.is_empty() => {
                Some(format!("{ns}/{name}"))
            }
            _ => None,
        };
        Self { list, index, label }
    }
}

impl fmt::Display for Entry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[{}]", self.list, self.index)?;
        match &self.label {
            Some(label) => write!(f, " ({label})"),
            None => Ok(()),
        }
    }
}

impl fmt::Display for Problem {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if let Some(entry) = &self.entry {
            write!(f, "{entry}: ")?;
        }
        if let Some(field) = &self.field {
            write!(f, "field `{field}`: ")?;
        }
        f.write_str(&self.message)?;
        if let Some((line, column)) = self.location {
            write!(f, " (line {line}, column {column})")?;
        }
        Ok(())
    }
}

fn show_problems(path: &Path, problems: &[Problem]) -> String {
    let lines: Vec<String> = problems
        .iter()
        .map(|p| format!("{}: {p}", path.display()))
        .collect();
    lines.join("\n")
}

/// Reads the workloads file at `path` and checks it for the agent of `node`:
/// [`parse`], then [`validate_for_node`].
pub fn load(path: &Path, node: &str) -> Result<LocalWorkloads, WorkloadsFileError> {
    let text = fs::read_to_string(path).map_err(|source| WorkloadsFileError::Read {
        path: path.to_owned(),
        source,
    })?;
    let local = parse(path, &text)?;
    validate_for_node(&local, node)?;
    local.policy_findings.log(path);
    Ok(local)
}

/// Parses and checks a workloads file; `path` only names it in messages.
pub fn parse(path: &Path, text: &str) -> Result<LocalWorkloads, WorkloadsFileError> {
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
    let mut services = check_services(raw.services, &workloads, &mut problems);
    let inputs = waypoints::Inputs {
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

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a mapping with `workloads` and optionally `trustDomain`, `services`, `authorizationPolicies`, `namespaces` and `waypoints`"
)]
struct RawFile {
    trust_domain: Option<String>,
    workloads: Vec<RawWorkload>,
    #[serde(default)]
    services: Vec<RawService>,
    /// Kept untyped here: each is checked on its own ([`policies`]), so
    /// one bad policy does not reject the file.
    #[serde(default)]
    authorization_policies: Vec<serde_yaml::Value>,
    #[serde(default)]
    namespaces: Vec<waypoints::RawNamespace>,
    #[serde(default)]
    waypoints: Vec<waypoints::RawWaypoint>,
}

/// Strings rather than parsed types, so that [`check_entries`] can report
/// every bad value with its entry instead of serde stopping at the first.
#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a workload (a mapping)"
)]
struct RawWorkload {
    name: String,
    namespace: String,
    service_account: String,
    ips: Vec<String>,
    node: String,
    netns: Option<PathBuf>,
    dataplane_mode: Option<String>,
    /// Whether to splice this pod's connections (default: as `--splice`).
    splice: Option<bool>,
    /// `false` keeps this pod's connections on the proxy path (default: as
    /// `--fast-path`).
    fast_path: Option<bool>,
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a service (a mapping)"
)]
struct RawService {
    name: String,
    namespace: String,
    // Kubernetes' spelling, which `camelCase` would not produce.
    #[serde(rename = "clusterIPs")]
    cluster_ips: Vec<String>,
    ports: Vec<RawServicePort>,
    #[serde(default)]
    endpoints: Vec<String>,
    /// Read by the waypoint rules only (`istio.io/use-waypoint`).
    #[serde(default)]
    labels: std::collections::BTreeMap<String, String>,
}

#[derive(Deserialize)]
#[serde(
    deny_unknown_fields,
    rename_all = "camelCase",
    expecting = "a service port (a mapping with `port` and optionally `targetPort`)"
)]
struct RawServicePort {
    port: u16,
    target_port: Option<u16>,
}

/// Turns the error of parsing `text` as a [`RawFile`] into a problem naming
/// the entry and field.
///
/// serde_yaml exposes the location but not the path (`workloads[1].ips`)
/// except in its message, `PATH: MESSAGE at line L column C`; serde_yaml 0.9
/// is frozen, so that format is stable (and pinned by the tests).
fn structure_problem(typed_error: &serde_yaml::Error, text: &str) -> Problem {
    // Text that is not valid YAML (bad syntax, duplicate keys) gets the YAML
    // parser's own error: the typed parse may stop earlier on a misleading
    // one (a field "missing" because it was misindented).
    let yaml_error;
    let (err, doc) = match serde_yaml::from_str::<serde_yaml::Value>(text) {
        Ok(doc) => (typed_error, Some(doc)),
        Err(e) => {
            yaml_error = e;
            (&yaml_error, None)
        }
    };
    let location = err.location().map(|l| (l.line(), l.column()));
    let mut message = err.to_string();
    if let Some((line, column)) = location {
        message = message.replacen(&format!(" at line {line} column {column}"), "", 1);
    }
    let (path, message) = match message.split_once(": ") {
        Some((path, rest)) if is_path(path) => (path, rest),
        _ => ("", message.as_str()),
    };
    let in_list = LISTS.iter().find_map(|list| {
        let (index, rest) = path
            .strip_prefix(list)?
            .strip_prefix('[')?
            .split_once(']')?;
        Some((*list, index.parse::<usize>().ok()?, rest))
    });
    let (index, mut field) = match in_list {
        Some((list, index, rest)) => (
            Some((list, index)),
            rest.strip_prefix('.').map(str::to_owned),
        ),
        None => (None, Some(path.to_owned()).filter(|p| !p.is_empty())),
    };
    if path.is_empty() && doc.is_none() {
        return Problem {
            entry: None,
            field: None,
            message: format!("invalid YAML: {message}"),
            location,
        };
    }
    let entry = index.map(|(list, index)| {
        let item = doc
            .as_ref()
            .and_then(|d| d.get(list))
            .and_then(|w| w.get(index));
        let get = |key| item.and_then(|i| i.get(key)).and_then(|v| v.as_str());
        Entry::new(list, index, get("namespace"), get("name"))
    });

    // Lift the field out of serde's own wording so every message has the
    // same shape: `field `x`: what is wrong`.
    let message = if let Some((name, rest)) = quoted_after(message, "unknown field ") {
        field = Some(join_field(field, name));
        format!("unknown field; {}", rest.trim_start_matches(", "))
    } else if let Some((name, _)) = quoted_after(message, "missing field ") {
        field = Some(join_field(field, name));
        "required, but missing".to_owned()
    } else if let Some(key) = message.strip_prefix("duplicate entry with key ") {
        field = Some(join_field(field, key.trim_matches('"')));
        "given twice".to_owned()
    } else {
        message.to_owned()
    };
    Problem {
        entry,
        field,
        message,
        location,
    }
}

/// Whether `s` looks like a serde_yaml path (`workloads[1].ips`), as opposed
/// to the start of a message such as `invalid type`.
fn is_path(s: &str) -> bool {
    !s.is_empty()
        && s.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '[' | ']' | '_' | '-' | '?'))
}

/// For a message `PREFIX`name`REST`, returns `(name, REST)`.
fn quoted_after<'a>(message: &'a str, prefix: &str) -> Option<(&'a str, &'a str)> {
    message
        .strip_prefix(prefix)?
        .strip_prefix('`')?
        .split_once('`')
}

fn join_field(parent: Option<String>, name: &str) -> String {
    match parent {
        Some(parent) => format!("{parent}.{name}"),
        None => name.to_owned(),
    }
}

/// Checks the entries' values; returns the workloads and adds a problem for
/// each bad value (the result is only used when no problem was found).
fn check_entries(raw: Vec<RawWorkload>, problems: &mut Vec<Problem>) -> Vec<Workload> {
    let mut keys: HashMap<WorkloadKey, Entry> = HashMap::new();
    let mut ip_owners: HashMap<IpAddr, Entry> = HashMap::new();
    let mut workloads = Vec::with_capacity(raw.len());
    for (index, raw) in raw.into_iter().enumerate() {
        let entry = Entry::new("workloads", index, Some(&raw.namespace), Some(&raw.name));
        let before = problems.len();
        let mut report = |field: &str, message: String| {
            problems.push(Problem {
                entry: Some(entry.clone()),
                field: Some(field.to_owned()),
                message,
                location: None,
            })
        };

        let names = [
            ("name", &raw.name, NameRule::Subdomain),
            ("namespace", &raw.namespace, NameRule::Label),
            ("serviceAccount", &raw.service_account, NameRule::Subdomain),
            ("node", &raw.node, NameRule::Subdomain),
        ];
        for (field, value, rule) in names {
            if let Some(message) = rule.check(value) {
                report(field, message);
            }
        }

        if raw.ips.is_empty() {
            report("ips", "must list at least one IP address".into());
        }
        let mut ips = Vec::with_capacity(raw.ips.len());
        for text in &raw.ips {
            let Ok(ip) = text.parse::<IpAddr>() else {
                report("ips", format!("{text:?} is not an IP address"));
                continue;
            };
            if let Some(why) = unusable_pod_ip(ip) {
                report("ips", format!("{ip} cannot be a pod address ({why})"));
            } else if ips.contains(&ip) {
                report("ips", format!("{ip} is listed twice"));
            } else if let Some(owner) = ip_owners.get(&ip) {
                report("ips", format!("{ip} is already used by {owner}"));
            } else {
                ip_owners.insert(ip, entry.clone());
            }
            ips.push(ip);
        }

        if let Some(netns) = &raw.netns {
            if netns.as_os_str().is_empty() {
                report("netns", "must not be empty (omit it instead)".into());
            } else if !netns.is_absolute() {
                report(
                    "netns",
                    format!("{} must be an absolute path", netns.display()),
                );
            }
        }

        let dataplane_mode = match raw.dataplane_mode.as_deref().map(str::parse) {
            None => DataplaneMode::default(),
            Some(Ok(mode)) => mode,
            Some(Err(e)) => {
                report("dataplaneMode", e.to_string());
                DataplaneMode::default()
            }
        };

        let workload = Workload {
            name: raw.name,
            namespace: raw.namespace,
            service_account: raw.service_account,
            ips,
            node: raw.node,
            netns: raw.netns,
            dataplane_mode,
            splice: raw.splice,
            fast_path: raw.fast_path,
            labels: raw.labels,
            ..Default::default()
        };
        match keys.get(&workload.key()) {
            Some(first) => report(
                "name",
                format!(
                    "{} is already defined by workloads[{}]",
                    workload.key(),
                    first.index
                ),
            ),
            None => {
                keys.insert(workload.key(), entry.clone());
            }
        }
        if problems.len() == before {
            workloads.push(workload);
        }
    }
    workloads
}

/// Checks the services against each other and the (valid) workloads; returns
/// the services and adds a problem for each bad value.
fn check_services(
    raw: Vec<RawService>,
    workloads: &[Workload],
    problems: &mut Vec<Problem>,
) -> Vec<Service> {
    let workload_ips: HashMap<IpAddr, WorkloadKey> = workloads
        .iter()
        .flat_map(|w| w.ips.iter().map(move |ip| (*ip, w.key())))
        .collect();
    let by_key: HashMap<WorkloadKey, &Workload> = workloads.iter().map(|w| (w.key(), w)).collect();
    let mut keys: HashMap<WorkloadKey, usize> = HashMap::new();
    let mut addrs: HashMap<std::net::SocketAddr, Entry> = HashMap::new();
    let mut services = Vec::with_capacity(raw.len());
    for (index, raw) in raw.into_iter().enumerate() {
        let entry = Entry::new("services", index, Some(&raw.namespace), Some(&raw.name));
        let before = problems.len();
        let mut report = |field: String, message: String| {
            problems.push(Problem {
                entry: Some(entry.clone()),
                field: Some(field),
                message,
                location: None,
            })
        };
        for (field, value) in [("name", &raw.name), ("namespace", &raw.namespace)] {
            if let Some(message) = NameRule::Label.check(value) {
                report(field.into(), message);
            }
        }
        let key = WorkloadKey::new(&raw.namespace, &raw.name);
        match keys.get(&key) {
            Some(first) => report(
                "name".into(),
                format!("{key} is already defined by services[{first}]"),
            ),
            None => {
                keys.insert(key.clone(), index);
            }
        }

        if raw.cluster_ips.is_empty() {
            report(
                "clusterIPs".into(),
                "must list at least one IP address".into(),
            );
        }
        let mut vips = Vec::with_capacity(raw.cluster_ips.len());
        for (i, text) in raw.cluster_ips.iter().enumerate() {
            let field = format!("clusterIPs[{i}]");
            match text.parse::<IpAddr>() {
                Err(_) => report(field, format!("{text:?} is not an IP address")),
                Ok(ip) => {
                    if let Some(why) = unusable_pod_ip(ip) {
                        report(field, format!("{ip} cannot be a service address ({why})"));
                    } else if vips.contains(&ip) {
                        report(field, format!("{ip} is listed twice"));
                    } else if let Some(owner) = workload_ips.get(&ip) {
                        report(field, format!("{ip} is the address of workload {owner}"));
                    }
                    vips.push(ip);
                }
            }
        }

        if raw.ports.is_empty() {
            report("ports".into(), "must list at least one port".into());
        }
        let mut ports: Vec<ServicePort> = Vec::with_capacity(raw.ports.len());
        for (i, p) in raw.ports.iter().enumerate() {
            if p.port == 0 {
                report(format!("ports[{i}].port"), "must not be 0".into());
            } else if ports.iter().any(|known| known.port == p.port) {
                report(
                    format!("ports[{i}].port"),
                    format!("{} is listed twice", p.port),
                );
            }
            if p.target_port == Some(0) {
                report(format!("ports[{i}].targetPort"), "must not be 0".into());
            }
            ports.push(ServicePort {
                port: p.port,
                target_port: Some(p.target_port.unwrap_or(p.port)),
            });
            for vip in &vips {
                let addr = std::net::SocketAddr::new(*vip, p.port);
                match addrs.get(&addr) {
                    Some(owner) if *owner != entry => report(
                        format!("ports[{i}].port"),
                        format!("{addr} is already served by {owner}"),
                    ),
                    _ => {
                        addrs.insert(addr, entry.clone());
                    }
                }
            }
        }

        let mut endpoints: Vec<Endpoint> = Vec::new();
        for (i, text) in raw.endpoints.iter().enumerate() {
            let field = format!("endpoints[{i}]");
            let found: Vec<Endpoint> = match text.parse::<IpAddr>() {
                Ok(ip) => match unusable_pod_ip(ip) {
                    Some(why) => {
                        report(field, format!("{ip} cannot be an endpoint ({why})"));
                        continue;
                    }
                    None => vec![Endpoint::new(ip, workload_ips.get(&ip).cloned())],
                },
                Err(_) => {
                    let pod = WorkloadKey::new(&raw.namespace, text);
                    match by_key.get(&pod) {
                        Some(w) => w
                            .ips
                            .iter()
                            .map(|ip| Endpoint::new(*ip, Some(pod.clone())))
                            .collect(),
                        None => {
                            report(
                                field,
                                format!(
                                    "no workload {pod} (an endpoint is the name of a pod in the service's namespace, or an IP address)"
                                ),
                            );
                            continue;
                        }
                    }
                }
            };
            for endpoint in found {
                if endpoints.iter().any(|e| e.ip == endpoint.ip) {
                    report(
                        format!("endpoints[{i}]"),
                        format!("{} is listed twice", endpoint.ip),
                    );
                } else {
                    endpoints.push(endpoint);
                }
            }
        }

        if problems.len() == before {
            services.push(Service {
                hostname: crate::control::waypoint::service_hostname(
                    &raw.namespace,
                    &raw.name,
                    crate::control::waypoint::CLUSTER_DOMAIN,
                ),
                name: raw.name,
                namespace: raw.namespace,
                vips,
                ports,
                endpoints,
                ..Default::default()
            });
        }
    }
    services
}

/// Addresses that can never be a pod's own, and would confuse lookups by IP.
fn unusable_pod_ip(ip: IpAddr) -> Option<&'static str> {
    if ip.is_unspecified() {
        Some("unspecified")
    } else if ip.is_loopback() {
        Some("loopback")
    } else if ip.is_multicast() {
        Some("multicast")
    } else if ip == IpAddr::from([255, 255, 255, 255]) {
        Some("broadcast")
    } else {
        None
    }
}

/// The Kubernetes naming rules the file's names must follow, as the API
/// server would enforce them, so a file never holds what a cluster could not.
#[derive(Clone, Copy)]
enum NameRule {
    /// DNS-1123 label: namespaces.
    Label,
    /// DNS-1123 subdomain: pods, service accounts, nodes.
    Subdomain,
}

impl NameRule {
    /// A message saying what is wrong with `name`, if anything.
    fn check(self, name: &str) -> Option<String> {
        // Each label (dot-separated part, for subdomains): [a-z0-9]([-a-z0-9]*[a-z0-9])?
        let label_ok = |l: &str| {
            !l.is_empty()
                && l.bytes()
                    .all(|b| b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-')
                && !l.starts_with('-')
                && !l.ends_with('-')
        };
        let (ok, rule) = match self {
            Self::Label => (
                name.len() <= 63 && label_ok(name),
                "a DNS-1123 label: at most 63 lowercase letters, digits and '-', \
                 starting and ending with a letter or digit",
            ),
            Self::Subdomain => (
                name.len() <= 253 && name.split('.').all(label_ok),
                "a DNS-1123 subdomain: at most 253 lowercase letters, digits, '-' and '.', \
                 each dot-separated part starting and ending with a letter or digit",
            ),
        };
        if name.is_empty() {
            Some("must not be empty".into())
        } else if !ok {
            Some(format!("{name:?} is not {rule}"))
        } else {
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const GOOD: &str = "\
trustDomain: example.org
workloads:
  - name: client
    namespace: default
    serviceAccount: sleep
    ips: [\"198.18.1.2\"]
    node: node-a
    netns: /var/run/netns/client
    dataplaneMode: ambient
  - name: server
    namespace: default
    serviceAccount: httpbin
    ips: [\"198.18.2.2\", \"2001:db8::2\"]
    node: node-b
    dataplaneMode: none
  - name: db
    namespace: data
    serviceAccount: db
    ips: [198.18.2.3]
    node: node-b
";

    fn file() -> &'static Path {
        Path::new("workloads.yaml")
    }

    fn error(text: &str) -> String {
        match parse(file(), text) {
            Ok(parsed) => panic!("accepted bad input {text:?}: {parsed:?}"),
            Err(e) => e.to_string(),
        }
    }

    /// One entry; `extra` lines are appended, `drop` names a field to omit
    /// and `set` overrides one field's line.
    fn entry(name: &str, ip: &str, set: Option<&str>, drop: Option<&str>) -> String {
        let mut fields = vec![
            format!("name: {name}"),
            "namespace: default".to_owned(),
            "serviceAccount: sa".to_owned(),
            format!("ips: [\"{ip}\"]"),
            "node: node-a".to_owned(),
            "dataplaneMode: none".to_owned(),
        ];
        if let Some(set) = set {
            let key = set.split(':').next().unwrap_or_default();
            fields.retain(|f| !f.starts_with(&format!("{key}:")));
            fields.push(set.to_owned());
        }
        if let Some(drop) = drop {
            fields.retain(|f| !f.starts_with(&format!("{drop}:")));
        }
        let mut text = String::new();
        for (i, f) in fields.iter().enumerate() {
            text += if i == 0 { "  - " } else { "    " };
            text += f;
            text += "\n";
        }
        text
    }

    /// A file whose entry 1 (`default/second`) is changed by `set`/`drop`.
    fn with_second(set: Option<&str>, drop: Option<&str>) -> String {
        format!(
            "workloads:\n{}{}",
            entry("first", "198.18.1.1", None, None),
            entry("second", "198.18.1.2", set, drop)
        )
    }

    #[test]
    fn good_file_parses_to_workloads() {
        let parsed = parse(file(), GOOD).expect("good file");
        assert_eq!(parsed.source, file());
        assert_eq!(parsed.trust_domain.as_str(), "example.org");
        let ip = |s: &str| s.parse::<IpAddr>().expect("test IP");
        assert_eq!(
            parsed.workloads,
            [
                Workload {
                    name: "client".into(),
                    namespace: "default".into(),
                    service_account: "sleep".into(),
                    ips: vec![ip("198.18.1.2")],
                    node: "node-a".into(),
                    netns: Some("/var/run/netns/client".into()),
                    dataplane_mode: DataplaneMode::Ambient,
                    splice: None,
                    ..Default::default()
                },
                Workload {
                    name: "server".into(),
                    namespace: "default".into(),
                    service_account: "httpbin".into(),
                    ips: vec![ip("198.18.2.2"), ip("2001:db8::2")],
                    node: "node-b".into(),
                    netns: None,
                    dataplane_mode: DataplaneMode::None,
                    splice: None,
                    ..Default::default()
                },
                Workload {
                    name: "db".into(),
                    namespace: "data".into(),
                    service_account: "db".into(),
                    ips: vec![ip("198.18.2.3")],
                    node: "node-b".into(),
                    netns: None,
                    dataplane_mode: DataplaneMode::None,
                    splice: None,
                    ..Default::default()
                },
            ]
        );
        assert_eq!(
            parsed.workloads[0].identity(&parsed.trust_domain).as_str(),
            "spiffe://example.org/ns/default/sa/sleep"
        );
    }

    #[test]
    fn fast_path_gives_the_workloads_own_say() {
        let parsed = parse(file(), &with_second(Some("fastPath: false"), None)).expect("valid");
        assert_eq!(parsed.workloads[1].fast_path, Some(false));
        assert_eq!(
            parsed.workloads[0].fast_path, None,
            "as --fast-path by default"
        );
        let typo = error(&with_second(Some("fastPath: nope"), None));
        assert!(
            typo.contains("workloads[1] (default/second): field `fastPath`"),
            "{typo}"
        );
    }

    #[test]
    fn splice_gives_the_workloads_own_say() {
        let parsed = parse(file(), &with_second(Some("splice: false"), None)).expect("valid");
        assert_eq!(parsed.workloads[1].splice, Some(false));
        assert_eq!(parsed.workloads[0].splice, None, "as --splice by default");
        let typo = error(&with_second(Some("splice: nope"), None));
        assert!(
            typo.contains("workloads[1] (default/second): field `splice`"),
            "{typo}"
        );
    }

    #[test]
    fn defaults() {
        let parsed = parse(file(), &with_second(None, Some("dataplaneMode"))).expect("valid");
        assert_eq!(parsed.trust_domain, TrustDomain::default());
        assert_eq!(parsed.workloads[1].dataplane_mode, DataplaneMode::None);
        let empty = parse(file(), "workloads: []").expect("no workloads is valid");
        assert!(empty.workloads.is_empty());
    }

    #[test]
    fn load_reads_the_fixture_and_names_unreadable_files() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/workloads/two-nodes.yaml");
        // No pod on node-c, so no netns needs to exist on this machine.
        let loaded = load(&fixture, "node-c").expect("fixture is valid");
        assert_eq!(loaded.workloads.len(), 3);
        assert_eq!(loaded.services.len(), 1);
        assert_eq!(loaded.services[0].endpoints.len(), 2);

        let missing = Path::new("/nonexistent/shunt/workloads.yaml");
        let err = load(missing, "node-a")
            .expect_err("missing file")
            .to_string();
        assert!(
            err.starts_with("/nonexistent/shunt/workloads.yaml: cannot read the workloads file: "),
            "{err}"
        );
    }

    /// (case, file text, fragments the one-line message must contain). Every
    /// message must also start with the file name.
    #[test]
    fn bad_files_get_messages_naming_file_entry_and_field() {
        let e1 = "workloads[1] (default/second): ";
        let cases: Vec<(&str, String, Vec<&str>)> = vec![
            (
                "unknown field",
                with_second(Some("serviceAcount: sa"), None),
                vec![
                    e1,
                    "field `serviceAcount`: unknown field; expected one of `name`",
                    "(line 14, column 5)",
                ],
            ),
            (
                "unknown top-level field",
                format!("trustdomain: x\n{}", with_second(None, None)),
                vec![
                    "workloads.yaml: field `trustdomain`: unknown field; expected one of `trustDomain`, `workloads`, `services`, `authorizationPolicies`, `namespaces`, `waypoints` (line 1, column 1)",
                ],
            ),
            (
                "missing field",
                with_second(None, Some("node")),
                vec![e1, "field `node`: required, but missing", "(line"],
            ),
            (
                "missing name: entry named by index only",
                with_second(None, Some("name")),
                vec!["workloads.yaml: workloads[1]: field `name`: required, but missing"],
            ),
            (
                "missing workloads",
                "trustDomain: cluster.local\n".into(),
                vec!["workloads.yaml: field `workloads`: required, but missing"],
            ),
            (
                "duplicate field",
                with_second(Some("node: node-b"), None) + "    node: node-c\n",
                // The document is not a valid `Value` then, so the entry has no label.
                vec!["workloads.yaml: workloads[1]: field `node`: given twice (line"],
            ),
            (
                "wrong type",
                with_second(Some("ips: 198.18.1.2"), None),
                vec![
                    e1,
                    "field `ips`: invalid type: string \"198.18.1.2\", expected a sequence",
                    "(line",
                ],
            ),
            (
                "wrong type in a list",
                with_second(Some("ips: [[1]]"), None),
                vec![
                    e1,
                    "field `ips[0]`: invalid type: sequence, expected a string",
                ],
            ),
            (
                "entry is not a mapping",
                "workloads:\n  - just-a-name\n".into(),
                vec![
                    "workloads.yaml: workloads[0]: invalid type: string \"just-a-name\", expected a workload (a mapping)",
                ],
            ),
            (
                "file is not a mapping",
                "- a\n".into(),
                vec!["workloads.yaml: invalid type: sequence, expected a mapping with `workloads`"],
            ),
            (
                "invalid YAML",
                "workloads:\n  - name: a\n   namespace: b\n".into(),
                vec!["workloads.yaml: invalid YAML: ", "(line 3, column"],
            ),
            (
                "empty file",
                "".into(),
                vec!["workloads.yaml: field `workloads`: required, but missing"],
            ),
            (
                "bad IP",
                with_second(Some("ips: [\"198.18.1.300\"]"), None),
                vec![e1, "field `ips`: \"198.18.1.300\" is not an IP address"],
            ),
            (
                "empty ips",
                with_second(Some("ips: []"), None),
                vec![e1, "field `ips`: must list at least one IP address"],
            ),
            (
                "IP of another entry",
                with_second(Some("ips: [\"198.18.1.1\"]"), None),
                vec![
                    e1,
                    "field `ips`: 198.18.1.1 is already used by workloads[0] (default/first)",
                ],
            ),
            (
                "IP twice in one entry",
                with_second(Some("ips: [\"198.18.1.2\", \"198.18.1.2\"]"), None),
                vec![e1, "field `ips`: 198.18.1.2 is listed twice"],
            ),
            (
                "loopback IP",
                with_second(Some("ips: [\"127.0.0.1\"]"), None),
                vec![
                    e1,
                    "field `ips`: 127.0.0.1 cannot be a pod address (loopback)",
                ],
            ),
            (
                "unknown dataplane mode",
                with_second(Some("dataplaneMode: ambiant"), None),
                vec![
                    e1,
                    "field `dataplaneMode`: unknown value \"ambiant\"; expected ambient or none",
                ],
            ),
            (
                "empty name",
                with_second(Some("name: \"\""), None),
                vec!["workloads.yaml: workloads[1]: field `name`: must not be empty"],
            ),
            (
                "empty service account",
                with_second(Some("serviceAccount: \"\""), None),
                vec![e1, "field `serviceAccount`: must not be empty"],
            ),
            (
                "empty node",
                with_second(Some("node: \"\""), None),
                vec![e1, "field `node`: must not be empty"],
            ),
            (
                "empty namespace",
                with_second(Some("namespace: \"\""), None),
                vec!["workloads.yaml: workloads[1]: field `namespace`: must not be empty"],
            ),
            (
                "namespace not a label",
                with_second(Some("namespace: my.ns"), None),
                vec![
                    "workloads[1] (my.ns/second): field `namespace`: \"my.ns\" is not a DNS-1123 label",
                ],
            ),
            (
                "name not a subdomain",
                with_second(Some("name: Second_1"), None),
                vec![
                    "workloads[1] (default/Second_1): field `name`: \"Second_1\" is not a DNS-1123 subdomain",
                ],
            ),
            (
                "duplicate namespace/name",
                with_second(Some("name: first"), None),
                vec![
                    "workloads[1] (default/first): field `name`: default/first is already defined by workloads[0]",
                ],
            ),
            (
                "relative netns",
                with_second(Some("netns: netns/second"), None),
                vec![e1, "field `netns`: netns/second must be an absolute path"],
            ),
            (
                "invalid trust domain",
                format!("trustDomain: Cluster.Local\n{}", with_second(None, None)),
                vec![
                    "workloads.yaml: field `trustDomain`: \"Cluster.Local\" is not a valid trust domain",
                ],
            ),
        ];
        for (case, text, fragments) in cases {
            let message = error(&text);
            assert!(message.starts_with("workloads.yaml: "), "{case}: {message}");
            assert_eq!(message.lines().count(), 1, "{case}: {message}");
            for fragment in fragments {
                assert!(
                    message.contains(fragment),
                    "{case}: {message:?} lacks {fragment:?}"
                );
            }
        }
    }

    #[test]
    fn all_value_problems_are_reported_at_once() {
        let text = format!(
            "trustDomain: \"\"\nworkloads:\n{}{}{}",
            entry("a", "198.18.1.300", None, None),
            entry("b", "198.18.1.2", Some("dataplaneMode: on"), None),
            entry("c", "198.18.1.2", None, None),
        );
        let Err(WorkloadsFileError::Invalid { problems, .. }) = parse(file(), &text) else {
            panic!("expected problems");
        };
        let lines: Vec<String> = problems.iter().map(Problem::to_string).collect();
        assert_eq!(
            lines,
            [
                "field `trustDomain`: \"\" is not a valid trust domain: it is empty",
                "workloads[0] (default/a): field `ips`: \"198.18.1.300\" is not an IP address",
                "workloads[1] (default/b): field `dataplaneMode`: unknown value \"on\"; expected ambient or none",
                "workloads[2] (default/c): field `ips`: 198.18.1.2 is already used by workloads[1] (default/b)",
            ]
        );
        assert_eq!(error(&text).lines().count(), 4);
    }

    #[test]
    fn netns_is_checked_for_this_nodes_ambient_pods_only() {
        let dir = std::env::temp_dir().join(format!("shunt-local-test-{}", std::process::id()));
        fs::create_dir_all(&dir).expect("temp dir");
        let gone = dir.join("no-such-netns");
        let text = format!(
            "workloads:\n{}{}{}{}{}",
            entry("here", "198.18.1.1", Some("dataplaneMode: ambient"), None)
                + "    netns: /proc/self/ns/net\n",
            entry("gone", "198.18.1.2", Some("dataplaneMode: ambient"), None)
                + &format!("    netns: {}\n", gone.display()),
            entry("unset", "198.18.1.3", Some("dataplaneMode: ambient"), None),
            entry("opted-out", "198.18.1.4", None, None),
            entry("elsewhere", "198.18.1.5", Some("node: node-b"), None)
                .replace("dataplaneMode: none", "dataplaneMode: ambient"),
        );
        let parsed = parse(file(), &text);
        let _ = fs::remove_dir_all(&dir);
        let parsed = parsed.expect("node-independent checks pass");

        let err = validate_for_node(&parsed, "node-a").expect_err("netns problems");
        let why = "(the pod runs on this node, node-a, and opts into the mesh, so its network namespace is required)";
        assert_eq!(
            err.to_string(),
            format!(
                "workloads.yaml: workloads[1] (default/gone): field `netns`: {} does not exist {why}\n\
                 workloads.yaml: workloads[2] (default/unset): field `netns`: missing {why}",
                gone.display()
            )
        );
        let err = validate_for_node(&parsed, "node-b").expect_err("node-b's pod lacks a netns");
        assert!(
            err.to_string().starts_with(
                "workloads.yaml: workloads[4] (default/elsewhere): field `netns`: missing ("
            ),
            "{err}"
        );
        validate_for_node(&parsed, "node-c").expect("nothing on node-c");
    }

    const SERVICES: &str = "\
services:
  - name: web
    namespace: default
    clusterIPs: [\"198.19.100.1\"]
    ports:
      - port: 80
        targetPort: 8080
      - port: 8443
    endpoints: [server, 198.18.9.9, 198.18.2.3]
";

    #[test]
    fn services_resolve_pods_and_ips() {
        let parsed = parse(file(), &format!("{GOOD}{SERVICES}")).expect("good file");
        let [web] = parsed.services.as_slice() else {
            panic!("{:?}", parsed.services)
        };
        assert_eq!(web.key(), WorkloadKey::new("default", "web"));
        let ip = |s: &str| s.parse::<IpAddr>().expect("test IP");
        assert_eq!(web.vips, [ip("198.19.100.1")]);
        assert_eq!(
            web.ports,
            [
                ServicePort {
                    port: 80,
                    target_port: Some(8080)
                },
                ServicePort {
                    port: 8443,
                    target_port: Some(8443)
                },
            ]
        );
        let server = Some(WorkloadKey::new("default", "server"));
        assert_eq!(
            web.endpoints,
            [
                Endpoint::new(ip("198.18.2.2"), server.clone()),
                Endpoint::new(ip("2001:db8::2"), server),
                Endpoint::new(ip("198.18.9.9"), None),
                // An IP of a workload of another namespace is that workload.
                Endpoint::new(ip("198.18.2.3"), Some(WorkloadKey::new("data", "db"))),
            ]
        );
        let none = parse(file(), GOOD).expect("services are optional");
        assert!(none.services.is_empty());
    }

    #[test]
    fn bad_services_get_messages_naming_file_entry_and_field() {
        let s0 = "workloads.yaml: services[0] (default/web): ";
        let cases: Vec<(&str, String, &str)> = vec![
            (
                "typo in a field",
                SERVICES.replace("clusterIPs", "clusterIps"),
                "field `clusterIps`: unknown field; expected one of `name`, `namespace`, `clusterIPs`",
            ),
            (
                "typo in a port field",
                SERVICES.replace("targetPort", "targetport"),
                "field `ports[0].targetport`: unknown field; expected `port` or `targetPort`",
            ),
            (
                "port out of range",
                SERVICES.replace("port: 80\n", "port: 70000\n"),
                "field `ports[0].port`: invalid value: integer `70000`, expected u16",
            ),
            (
                "missing ports",
                SERVICES.replace(
                    "    ports:\n      - port: 80\n        targetPort: 8080\n      - port: 8443\n",
                    "",
                ),
                "field `ports`: required, but missing",
            ),
            (
                "bad VIP",
                SERVICES.replace("198.19.100.1", "198.19.100.300"),
                "field `clusterIPs[0]`: \"198.19.100.300\" is not an IP address",
            ),
            (
                "VIP of a workload",
                SERVICES.replace("198.19.100.1", "198.18.2.2"),
                "field `clusterIPs[0]`: 198.18.2.2 is the address of workload default/server",
            ),
            (
                "unknown pod",
                SERVICES.replace("[server,", "[sever,"),
                "field `endpoints[0]`: no workload default/sever (an endpoint is the name of a pod",
            ),
            (
                "endpoint twice",
                SERVICES.replace("198.18.9.9", "198.18.2.2"),
                "field `endpoints[1]`: 198.18.2.2 is listed twice",
            ),
            (
                "port twice",
                SERVICES.replace("port: 8443", "port: 80"),
                "field `ports[1].port`: 80 is listed twice",
            ),
            (
                "target port 0",
                SERVICES.replace("targetPort: 8080", "targetPort: 0"),
                "field `ports[0].targetPort`: must not be 0",
            ),
            (
                "VIP and port of another service",
                SERVICES.to_owned()
                    + &SERVICES
                        .replace("services:\n", "")
                        .replace("name: web", "name: web2")
                        .replace("      - port: 8443\n", ""),
                "workloads.yaml: services[1] (default/web2): field `ports[0].port`: 198.19.100.1:80 is already served by services[0] (default/web)",
            ),
        ];
        for (case, services, fragment) in cases {
            let message = error(&format!("{GOOD}{services}"));
            assert!(message.starts_with("workloads.yaml: "), "{case}: {message}");
            assert_eq!(message.lines().count(), 1, "{case}: {message}");
            assert!(
                message.contains(fragment),
                "{case}: {message:?} lacks {fragment:?}"
            );
            if !fragment.starts_with("workloads.yaml") {
                assert!(message.starts_with(s0), "{case}: {message}");
            }
        }
    }

    #[test]
    fn serde_yaml_error_format_is_as_expected() {
        // structure_problem relies on it: `PATH: MESSAGE at line L column C`.
        let err = serde_yaml::from_str::<RawFile>("workloads:\n  - nme: x\n")
            .err()
            .map(|e| e.to_string());
        assert_eq!(
            err.as_deref(),
            Some(
                "workloads[0]: unknown field `nme`, expected one of `name`, `namespace`, \
                 `serviceAccount`, `ips`, `node`, `netns`, `dataplaneMode`, `splice`, `fastPath`, `labels` at line 2 column 5"
            )
        );
    }
}

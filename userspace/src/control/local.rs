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
    /// DNS capture for this pod (default: as `--dns-capture`).
    dns_capture: Option<bool>,
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
            dns_capture: raw.dns_capture,
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
mod tests;

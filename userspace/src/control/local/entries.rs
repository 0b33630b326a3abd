//! The checks of the file's `workloads` and `services` entries: each bad
//! value is a [`Problem`] naming its entry and field; what is valid becomes
//! the agent's [`Workload`]s and [`Service`]s.

use std::{collections::HashMap, net::IpAddr};

use super::{
    Entry, Problem,
    raw::{RawService, RawWorkload},
};
use crate::state::{
    DataplaneMode, Endpoint, Service, ServicePort, Workload, WorkloadKey, WorkloadType,
};

/// Checks the entries' values; returns the workloads and adds a problem for
/// each bad value (the result is only used when no problem was found).
pub(super) fn check_entries(raw: Vec<RawWorkload>, problems: &mut Vec<Problem>) -> Vec<Workload> {
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

        let owner = owner(&raw, &mut report);
        for (field, value) in [("hostname", &raw.hostname), ("subdomain", &raw.subdomain)] {
            if let Some(message) = value.as_deref().and_then(|v| NameRule::Label.check(v)) {
                report(field, message);
            }
        }

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
            workload_type: owner.0,
            workload_name: owner.1,
            pod_hostname: raw.hostname.unwrap_or_default(),
            pod_subdomain: raw.subdomain.unwrap_or_default(),
            capacity: raw.capacity.unwrap_or(1),
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

/// The entry's owner (`workloadType`, `workloadName`): both or neither;
/// without them the pod is its own owner, as `Workload::owner` says.
fn owner(raw: &RawWorkload, report: &mut impl FnMut(&str, String)) -> (WorkloadType, String) {
    let kind = match raw.workload_type.as_deref() {
        None => None,
        Some(name) => match WorkloadType::from_name(name) {
            Some(kind) => Some(kind),
            None => {
                report(
                    "workloadType",
                    format!("{name:?} is not one of deployment, cronjob, job, pod"),
                );
                None
            }
        },
    };
    match (&raw.workload_name, raw.workload_type.is_some()) {
        (Some(name), _) => {
            if let Some(message) = NameRule::Subdomain.check(name) {
                report("workloadName", message);
            }
            (kind.unwrap_or_default(), name.clone())
        }
        (None, true) => {
            report(
                "workloadType",
                "names the owner's kind: give `workloadName` too".into(),
            );
            (WorkloadType::default(), String::new())
        }
        (None, false) => (WorkloadType::default(), String::new()),
    }
}

/// Checks the services against each other and the (valid) workloads; returns
/// the services and adds a problem for each bad value.
pub(super) fn check_services(
    raw: Vec<RawService>,
    workloads: &[Workload],
    cluster_domain: &str,
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
                    cluster_domain,
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
pub(super) enum NameRule {
    /// DNS-1123 label: namespaces.
    Label,
    /// DNS-1123 subdomain: pods, service accounts, nodes.
    Subdomain,
}

impl NameRule {
    /// A message saying what is wrong with `name`, if anything.
    pub(super) fn check(self, name: &str) -> Option<String> {
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

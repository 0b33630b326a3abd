//! The names the mesh answers for, derived from the workload store, and how
//! a pod's query finds one (search-domain stripping and Kubernetes short
//! forms, as ztunnel's DNS proxy matches them).
//!
//! [`MeshNames`] is an immutable view: [`publish_names`] (one task, fed by
//! the store owner like the fast-path table writer) rebuilds it after each
//! cluster view the store owner applied and publishes it on a `watch`;
//! every pod's DNS server reads the latest one per query, without a lock on
//! the store.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::{Arc, RwLock},
};

use tokio::sync::watch;
use tracing::debug;

use super::PodDns;
use crate::{state::Visibility, store::WorkloadStore};

/// Names the mesh knows, each with its addresses.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MeshNames {
    /// `cluster.local`: the Kubernetes short forms expand into it.
    cluster_domain: String,
    /// Service hostnames (lowercase, no trailing dot; `*.example.com` for a
    /// wildcard ServiceEntry host) → one entry per namespace that declares
    /// it, sorted by namespace.
    services: HashMap<String, Vec<MeshHost>>,
    /// Workloads with a `hostname`, and pods with a hostname and subdomain
    /// of a headless service, the same way.
    workloads: HashMap<String, Vec<MeshHost>>,
    /// Each workload's canonical service and revision, by namespace then
    /// name: the DNS metrics' `source_canonical_*` labels.
    canonical: HashMap<String, HashMap<String, (String, String)>>,
    /// Each workload's network when it is not the default (empty) one, by
    /// namespace then name: which service VIPs its queries are answered.
    networks: HashMap<String, HashMap<String, String>>,
}

/// A name's addresses as declared in one namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MeshHost {
    pub namespace: String,
    /// Both families; a query takes those of its own.
    pub addrs: Vec<IpAddr>,
    /// The network of each service VIP (empty: the default network): a
    /// VIP is answered only to a client on that network, as ztunnel
    /// answers. Addresses not listed (a headless service's endpoints, a
    /// workload's own) are answered to any client.
    pub networks: BTreeMap<IpAddr, String>,
    /// Only pods of `namespace` may resolve it (a service's visibility
    /// `NAMESPACE`); others' queries go upstream, as with ztunnel.
    pub namespace_only: bool,
}

impl MeshHost {
    /// The addresses answered to a client on `network`.
    pub fn addrs_for<'a>(&'a self, network: &'a str) -> impl Iterator<Item = &'a IpAddr> + 'a {
        self.addrs
            .iter()
            .filter(move |a| self.networks.get(*a).is_none_or(|n| n == network))
    }
}

/// How a query name found a mesh name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NameMatch<'a> {
    pub host: &'a MeshHost,
    /// Set when the query name was a name plus one of the pod's search
    /// domains (`web.default.svc.cluster.local.ns.svc.cluster.local`):
    /// the name without that domain, which the answer's records carry
    /// (behind a CNAME from the query name), as ztunnel answers.
    pub stripped: Option<String>,
    /// Matched a wildcard host (`*.example.com`): records carry the query
    /// name.
    pub wildcard: bool,
}

impl MeshNames {
    /// No names yet; short forms expand into `cluster_domain`.
    pub fn new(cluster_domain: &str) -> Self {
        Self {
            cluster_domain: normalize(cluster_domain),
            ..Self::default()
        }
    }

    /// The names of every service and named workload in `store`:
    /// - a Service: its `hostname` (xDS; a ServiceEntry's host) or, when the
    ///   source gives none (the Kubernetes watch),
    ///   `<name>.<namespace>.svc.<cluster domain>`; its VIPs, each
    ///   answered to clients on its network only; a Kubernetes headless
    ///   service (no VIP) its ready endpoints' IPs; any other service
    ///   without a VIP is left to the upstream resolvers, as ztunnel
    ///   leaves it; only the families of its `ip_families`; resolvable
    ///   from its own namespace only when its visibility is `NAMESPACE`;
    /// - a workload with a `hostname`: its IPs;
    /// - a pod with `spec.hostname` and `spec.subdomain` where the subdomain
    ///   is a headless service of its namespace that has the pod as a
    ///   ready endpoint: `<hostname>.<subdomain>.<ns>.svc.<cluster domain>`
    ///   → those of its IPs (Kubernetes' pod records, which ztunnel serves
    ///   too).
    pub fn build(store: &WorkloadStore, cluster_domain: &str) -> Self {
        let mut names = Self::new(cluster_domain);
        let kube_suffix = format!(".svc.{}", names.cluster_domain);
        for service in store.services().iter() {
            let hostname = if service.hostname.is_empty() {
                format!(
                    "{}.{}.svc.{}",
                    service.name, service.namespace, names.cluster_domain
                )
            } else {
                normalize(&service.hostname)
            };
            let mut networks = BTreeMap::new();
            let mut addrs: Vec<IpAddr> = if !service.vips.is_empty() {
                for vip in &service.vips {
                    let network = service.vip_networks.get(vip).cloned().unwrap_or_default();
                    networks.insert(*vip, network);
                }
                service.vips.clone()
            } else if hostname.ends_with(&kube_suffix) {
                let mut ips: Vec<IpAddr> = service
                    .endpoints
                    .iter()
                    .filter(|e| e.ready)
                    .map(|e| e.ip)
                    .collect();
                ips.sort();
                ips.dedup();
                ips
            } else {
                continue;
            };
            // A single-family service answers nothing of the other family
            // (ztunnel: a headless v4-only service's dual-stack pods).
            addrs.retain(|a| service.ip_families.allows(a));
            networks.retain(|a, _| service.ip_families.allows(a));
            insert(
                &mut names.services,
                &hostname,
                MeshHost {
                    namespace: service.namespace.clone(),
                    addrs,
                    networks,
                    namespace_only: service.visibility == Visibility::Namespace,
                },
            );
        }
        for workload in store.iter().filter(|w| !w.hostname.is_empty()) {
            names.insert_workload(
                &workload.hostname,
                &workload.namespace,
                workload.ips.clone(),
            );
        }
        for workload in store.iter() {
            if let Some((hostname, ips)) = pod_record(store, workload, &names.cluster_domain) {
                names.insert_workload(&hostname, &workload.namespace, ips);
            }
            if !workload.network.is_empty() {
                names
                    .networks
                    .entry(workload.namespace.clone())
                    .or_default()
                    .insert(workload.name.clone(), workload.network.clone());
            }
            let (service, revision) = workload.canonical_service();
            names
                .canonical
                .entry(workload.namespace.clone())
                .or_default()
                .insert(
                    workload.name.clone(),
                    (service.to_string(), revision.to_string()),
                );
        }
        names
    }

    /// The canonical service and revision of pod `namespace/name`, if the
    /// store knows it.
    pub fn canonical(&self, namespace: &str, name: &str) -> Option<(&str, &str)> {
        self.canonical
            .get(namespace)?
            .get(name)
            .map(|(s, r)| (s.as_str(), r.as_str()))
    }

    /// The network of pod `namespace/name` (empty: the default one).
    pub fn network(&self, namespace: &str, name: &str) -> &str {
        self.networks
            .get(namespace)
            .and_then(|by_name| by_name.get(name))
            .map_or("", String::as_str)
    }

    /// Adds (or extends) a service name, answered on every network.
    pub fn insert_service(&mut self, hostname: &str, namespace: &str, addrs: Vec<IpAddr>) {
        insert(
            &mut self.services,
            hostname,
            MeshHost::anywhere(namespace, addrs),
        );
    }

    /// Adds (or extends) a workload name.
    pub fn insert_workload(&mut self, hostname: &str, namespace: &str, addrs: Vec<IpAddr>) {
        insert(
            &mut self.workloads,
            hostname,
            MeshHost::anywhere(namespace, addrs),
        );
    }

    pub fn cluster_domain(&self) -> &str {
        &self.cluster_domain
    }

    /// How many names (services and workloads).
    pub fn len(&self) -> usize {
        self.services.len() + self.workloads.len()
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The mesh name `query` (as asked, any case, with or without the
    /// trailing dot) means for `pod`, if any. Tried in order, first match
    /// wins: the name itself, its Kubernetes expansions (`web` →
    /// `web.<ns>.svc.<domain>`, `web.ns2` → `web.ns2.svc.<domain>`,
    /// `web.ns2.svc` → `web.ns2.svc.<domain>`), then for each of the pod's
    /// search domains that ends the name, the name without it and its
    /// expansions. For each candidate: a service host (exact, then
    /// wildcards of decreasing specificity), then a workload host. Among
    /// several namespaces declaring a host, the pod's own wins, else the
    /// first by name.
    pub fn resolve<'a>(&'a self, query: &str, pod: &PodDns) -> Option<NameMatch<'a>> {
        let name = normalize(query);
        if name.is_empty() {
            return None;
        }
        for alias in self.aliases(&name, pod) {
            for (i, candidate) in wildcards(&alias.name).into_iter().enumerate() {
                if let Some(host) = pick(self.services.get(&candidate), &pod.namespace) {
                    return Some(NameMatch {
                        host,
                        stripped: alias.stripped,
                        wildcard: i > 0,
                    });
                }
            }
            if let Some(host) = pick(self.workloads.get(&alias.name), &pod.namespace) {
                return Some(NameMatch {
                    host,
                    stripped: alias.stripped,
                    wildcard: false,
                });
            }
        }
        None
    }

    /// The candidates for `name` (normalized), in the order tried.
    fn aliases(&self, name: &str, pod: &PodDns) -> Vec<Alias> {
        let mut out: Vec<Alias> = Vec::new();
        let mut add = |alias: Alias| {
            if !out.iter().any(|a| a.name == alias.name) {
                out.push(alias);
            }
        };
        add(Alias {
            name: name.to_string(),
            stripped: None,
        });
        for expanded in self.kube_fqdns(name, &pod.namespace) {
            add(Alias {
                name: expanded,
                stripped: None,
            });
        }
        for search in &pod.search {
            let search = normalize(search);
            let Some(stripped) = name
                .strip_suffix(search.as_str())
                .and_then(|rest| rest.strip_suffix('.'))
                .filter(|rest| !rest.is_empty() && !search.is_empty())
            else {
                continue;
            };
            add(Alias {
                name: stripped.to_string(),
                stripped: Some(stripped.to_string()),
            });
            for expanded in self.kube_fqdns(stripped, &pod.namespace) {
                add(Alias {
                    name: expanded,
                    stripped: Some(stripped.to_string()),
                });
            }
        }
        out
    }

    /// The Kubernetes service FQDN a short form stands for: `<svc>` (the
    /// pod's namespace), `<svc>.<ns>`, `<svc>.<ns>.svc`.
    fn kube_fqdns(&self, name: &str, namespace: &str) -> Vec<String> {
        let domain = &self.cluster_domain;
        let labels = name.split('.').count();
        match labels {
            1 if !namespace.is_empty() => vec![format!("{name}.{namespace}.svc.{domain}")],
            2 => vec![format!("{name}.svc.{domain}")],
            3 if name.ends_with(".svc") => vec![format!("{name}.{domain}")],
            _ => Vec::new(),
        }
    }
}

/// A pod's own DNS record, `<hostname>.<subdomain>.<ns>.svc.<domain>`, and
/// its addresses: only when its subdomain names a headless service of its
/// namespace (no VIP) of which the pod is a ready endpoint, as Kubernetes
/// publishes it.
fn pod_record(
    store: &WorkloadStore,
    workload: &crate::state::Workload,
    cluster_domain: &str,
) -> Option<(String, Vec<IpAddr>)> {
    if workload.pod_hostname.is_empty() || workload.pod_subdomain.is_empty() {
        return None;
    }
    let key = crate::state::WorkloadKey::new(&workload.namespace, &workload.pod_subdomain);
    let service = store.services().get(&key)?;
    if !service.vips.is_empty() {
        return None;
    }
    let ips: Vec<IpAddr> = workload
        .ips
        .iter()
        .filter(|ip| service.endpoints.iter().any(|e| e.ready && e.ip == **ip))
        .copied()
        .collect();
    if ips.is_empty() {
        return None;
    }
    let hostname = format!(
        "{}.{}.{}.svc.{cluster_domain}",
        workload.pod_hostname, workload.pod_subdomain, workload.namespace
    );
    Some((hostname, ips))
}

#[derive(Debug)]
struct Alias {
    name: String,
    stripped: Option<String>,
}

impl MeshHost {
    fn anywhere(namespace: &str, addrs: Vec<IpAddr>) -> Self {
        Self {
            namespace: namespace.to_string(),
            addrs,
            networks: BTreeMap::new(),
            namespace_only: false,
        }
    }
}

fn insert(map: &mut HashMap<String, Vec<MeshHost>>, hostname: &str, new: MeshHost) {
    let hosts = map.entry(normalize(hostname)).or_default();
    match hosts.iter_mut().find(|h| h.namespace == new.namespace) {
        Some(host) => {
            for addr in new.addrs {
                if !host.addrs.contains(&addr) {
                    host.addrs.push(addr);
                }
            }
            host.networks.extend(new.networks);
            // Visible when either declaration is.
            host.namespace_only &= new.namespace_only;
        }
        None => {
            hosts.push(new);
            hosts.sort_by(|a, b| a.namespace.cmp(&b.namespace));
        }
    }
}

/// The pod's namespace's host if declared there, else the first visible
/// to it.
fn pick<'a>(hosts: Option<&'a Vec<MeshHost>>, namespace: &str) -> Option<&'a MeshHost> {
    let hosts = hosts?;
    hosts
        .iter()
        .find(|h| h.namespace == namespace)
        .or_else(|| hosts.iter().find(|h| !h.namespace_only))
}

/// `a.b.c` → `a.b.c`, `*.b.c`, `*.c`.
fn wildcards(name: &str) -> Vec<String> {
    let mut out = vec![name.to_string()];
    let mut rest = name;
    while let Some((_, parent)) = rest.split_once('.') {
        out.push(format!("*.{parent}"));
        rest = parent;
    }
    out
}

/// Lowercase, without the trailing dot: how names are compared.
pub(crate) fn normalize(name: &str) -> String {
    name.trim_end_matches('.').to_ascii_lowercase()
}

/// The channel every pod's server reads names from, starting empty.
pub fn names_channel(
    cluster_domain: &str,
) -> (
    watch::Sender<Arc<MeshNames>>,
    watch::Receiver<Arc<MeshNames>>,
) {
    watch::channel(Arc::new(MeshNames::new(cluster_domain)))
}

/// Rebuilds the names after each cluster view the store owner applied
/// (`applied` carries the view's number, 0: none yet) and publishes them
/// when they changed, until `applied` closes. The only writer of `names`.
pub async fn publish_names(
    store: Arc<RwLock<WorkloadStore>>,
    mut applied: watch::Receiver<u64>,
    cluster_domain: String,
    names: watch::Sender<Arc<MeshNames>>,
) {
    loop {
        let view = *applied.borrow_and_update();
        if view > 0 {
            let built = MeshNames::build(
                &store.read().unwrap_or_else(|p| p.into_inner()),
                &cluster_domain,
            );
            let count = built.len();
            let changed = names.send_if_modified(|current| {
                if **current == built {
                    return false;
                }
                *current = Arc::new(built);
                true
            });
            if changed {
                debug!(view, names = count, "DNS names published");
            }
        }
        if applied.changed().await.is_err() {
            return;
        }
    }
}

#[cfg(test)]
#[path = "names_tests.rs"]
mod tests;

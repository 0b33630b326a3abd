//! The store: every workload, service and authorization policy the agent
//! knows, indexed for the lookups the agent makes. It sits above `state`
//! (the domain types) and `authz` (the policy engine, which reads
//! `state::Workload`), so the model layer has no import circle.

use std::{
    collections::{BTreeMap, HashMap},
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use crate::authz::{Policy, PolicySet};
use crate::state::{Service, ServiceStore, TunnelProtocol, Workload, WorkloadKey};

/// All known workloads, by id, by namespace/name and by IP, and the
/// services they back.
///
/// Workloads are identified as xDS names them: by the source's uid (a
/// pod's and a WorkloadEntry of the same namespace/name are two
/// workloads), or by namespace/name when a source gives no uid. Entries
/// are shared and immutable (`Arc`): a lookup per connection clones a
/// pointer, and an update replaces only what changed.
///
/// One owner (the reconcile loop, or cluster discovery) mutates it; readers
/// elsewhere get snapshots or lookups through that owner, so there is no
/// locking here.
#[derive(Clone, Debug, Default)]
pub struct WorkloadStore {
    by_id: HashMap<String, Arc<Workload>>,
    /// namespace/name → the workloads so named (usually one), for the
    /// node's own pods, which the pod source knows by name.
    by_name: BTreeMap<WorkloadKey, Vec<Arc<Workload>>>,
    /// IP → the workloads claiming it (usually one); host-network
    /// workloads are left out: their IP is the node's.
    by_ip: HashMap<IpAddr, Vec<Arc<Workload>>>,
    services: ServiceStore,
    /// Shared with checks in flight: a change swaps in a new set.
    policies: Arc<PolicySet>,
    /// Bumped by every change of the policies (open connections are
    /// re-checked when it moves).
    policy_generation: u64,
    /// This node's Istio network (`--network`; empty: the default one):
    /// of workloads claiming one IP, one on it is the one the IP names.
    local_network: String,
}

/// What [`WorkloadStore::replace_all`] changed, each list sorted by key.
///
/// Keys only: the new versions are in the store, and whoever acts on a
/// removal (e.g. un-enrolment) keeps its own record of what it set up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WorkloadChanges {
    pub added: Vec<WorkloadKey>,
    pub removed: Vec<WorkloadKey>,
    /// Present before and after, with some field changed.
    pub updated: Vec<WorkloadKey>,
}

impl WorkloadChanges {
    pub fn is_empty(&self) -> bool {
        self.added.is_empty() && self.removed.is_empty() && self.updated.is_empty()
    }
}

/// The difference between the store and a complete list of workloads
/// ([`WorkloadStore::diff`]), to apply with [`WorkloadStore::apply_diff`].
/// Computing it only reads the store, so its owner can do that without
/// holding the write lock the proxy's lookups wait on.
#[derive(Clone, Debug, Default)]
pub struct WorkloadDiff {
    upserts: Vec<Arc<Workload>>,
    removals: Vec<String>,
}

impl WorkloadDiff {
    pub fn is_empty(&self) -> bool {
        self.upserts.is_empty() && self.removals.is_empty()
    }
}

/// The id a workload is stored under: the source's uid, else
/// namespace/name.
pub fn workload_id(w: &Workload) -> std::borrow::Cow<'_, str> {
    if w.uid.is_empty() {
        std::borrow::Cow::Owned(w.key().to_string())
    } else {
        std::borrow::Cow::Borrowed(&w.uid)
    }
}

/// Of several workloads with one IP (or name), the one it means: one on
/// `local_network` first (pod CIDRs of two networks may overlap; ztunnel
/// keys workloads by network and address and looks up its own network's),
/// then as ztunnel ranks them: a pod over anything else (a WorkloadEntry
/// can claim any address), then one in the mesh; then the greater id, so
/// the choice does not depend on the order updates came in.
fn preferred<'a>(claimants: &'a [Arc<Workload>], local_network: &str) -> Option<&'a Arc<Workload>> {
    match claimants {
        [only] => Some(only),
        _ => claimants.iter().max_by_key(|w| rank(w, local_network)),
    }
}

/// [`preferred`]'s order: greater is preferred.
fn rank<'a>(w: &'a Workload, local_network: &str) -> (bool, bool, bool, std::borrow::Cow<'a, str>) {
    let here = w.network == local_network;
    let is_pod = w.uid.contains("//Pod/");
    let in_mesh = w.tunnel == TunnelProtocol::Hbone;
    (here, is_pod, in_mesh, workload_id(w))
}

impl WorkloadStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty store for a node on `network` (`--network`).
    pub fn on_network(network: &str) -> Self {
        Self {
            local_network: network.to_owned(),
            ..Self::default()
        }
    }

    /// Makes `workloads` the whole content of the store (a full resync, as
    /// after loading a file or relisting from the API server).
    ///
    /// Of two entries with one id the later is kept (with a warning). Two
    /// workloads may claim one IP (a pod and a WorkloadEntry, or a watch
    /// briefly showing a pod's IP on its successor): both are kept, and
    /// the IP names the one [`preferred`] ranks first, whatever the order.
    pub fn replace_all<W: Into<Arc<Workload>>>(
        &mut self,
        workloads: impl IntoIterator<Item = W>,
    ) -> WorkloadChanges {
        let diff = self.diff(workloads);
        self.apply_diff(diff)
    }

    /// What makes `workloads` the store's whole content; reads only.
    pub fn diff<W: Into<Arc<Workload>>>(
        &self,
        workloads: impl IntoIterator<Item = W>,
    ) -> WorkloadDiff {
        let workloads: Vec<Arc<Workload>> = workloads.into_iter().map(Into::into).collect();
        let ids: Vec<std::borrow::Cow<'_, str>> =
            workloads.iter().map(|w| workload_id(w)).collect();
        let mut last: HashMap<&str, usize> = HashMap::with_capacity(ids.len());
        for (i, id) in ids.iter().enumerate() {
            if last.insert(id, i).is_some() {
                tracing::warn!(workload = %workloads[i].key(), id = %id, "workload listed twice; keeping the last");
            }
        }
        let mut diff = WorkloadDiff::default();
        let mut kept = 0;
        for (i, (w, id)) in workloads.iter().zip(&ids).enumerate() {
            if last.get(id.as_ref()) != Some(&i) {
                continue;
            }
            match self.by_id.get(id.as_ref()) {
                Some(held) => {
                    kept += 1;
                    if !Arc::ptr_eq(held, w) && held != w {
                        diff.upserts.push(w.clone());
                    }
                }
                None => diff.upserts.push(w.clone()),
            }
        }
        if kept != self.by_id.len() {
            diff.removals = self
                .by_id
                .keys()
                .filter(|id| !last.contains_key(id.as_str()))
                .cloned()
                .collect();
        }
        diff
    }

    /// Applies a [`WorkloadDiff`]: only what it names is touched.
    pub fn apply_diff(&mut self, diff: WorkloadDiff) -> WorkloadChanges {
        let mut changes = WorkloadChanges::default();
        for id in diff.removals {
            if let Some(old) = self.remove(&id) {
                changes.removed.push(old.key());
            }
        }
        for w in diff.upserts {
            match self.insert(w.clone()) {
                Some(_) => changes.updated.push(w.key()),
                None => changes.added.push(w.key()),
            }
        }
        changes.added.sort();
        changes.removed.sort();
        changes.updated.sort();
        changes
    }

    /// Adds or replaces one workload (by id); returns the one replaced.
    pub fn insert(&mut self, w: Arc<Workload>) -> Option<Arc<Workload>> {
        let id = workload_id(&w).into_owned();
        let old = self.remove(&id);
        if !w.host_network {
            for ip in &w.ips {
                self.by_ip.entry(*ip).or_default().push(w.clone());
            }
        }
        self.by_name.entry(w.key()).or_default().push(w.clone());
        self.by_id.insert(id, w);
        old
    }

    /// Removes the workload stored under `id` (see [`workload_id`]).
    pub fn remove(&mut self, id: &str) -> Option<Arc<Workload>> {
        let old = self.by_id.remove(id)?;
        for ip in &old.ips {
            if let Some(claimants) = self.by_ip.get_mut(ip) {
                claimants.retain(|w| !Arc::ptr_eq(w, &old));
                if claimants.is_empty() {
                    self.by_ip.remove(ip);
                }
            }
        }
        let key = old.key();
        if let Some(named) = self.by_name.get_mut(&key) {
            named.retain(|w| !Arc::ptr_eq(w, &old));
            if named.is_empty() {
                self.by_name.remove(&key);
            }
        }
        Some(old)
    }

    /// Applies the workload and service changes of `delta` (policies are
    /// the caller's: [`WorkloadStore::set_policies`]), touching only the
    /// ids it names. Returns the workload changes and whether any service
    /// changed.
    pub fn apply_delta(
        &mut self,
        workloads: impl IntoIterator<Item = (String, Option<Arc<Workload>>)>,
        services: impl IntoIterator<Item = (WorkloadKey, Option<Arc<Service>>)>,
    ) -> (WorkloadChanges, bool) {
        let mut changes = WorkloadChanges::default();
        for (id, w) in workloads {
            match w {
                Some(w) => {
                    if self.by_id.get(&id).is_some_and(|held| **held == *w) {
                        continue;
                    }
                    let key = w.key();
                    match self.insert(w) {
                        Some(_) => changes.updated.push(key),
                        None => changes.added.push(key),
                    }
                }
                None => {
                    if let Some(old) = self.remove(&id) {
                        changes.removed.push(old.key());
                    }
                }
            }
        }
        let mut services_changed = false;
        for (id, s) in services {
            services_changed |= match s {
                Some(s) => self.services.upsert(s),
                None => self.services.remove(&id).is_some(),
            };
        }
        (changes, services_changed)
    }

    /// Makes `services` every service known (a full resync); returns whether
    /// anything changed. Kept apart from [`WorkloadStore::replace_all`]:
    /// sources list services and pods separately, and either may be late.
    pub fn replace_services<S: Into<Arc<Service>>>(
        &mut self,
        services: impl IntoIterator<Item = S>,
    ) -> bool {
        self.services.replace_all(services)
    }

    /// Swaps in `services` (built with [`ServiceStore::from_services`]
    /// outside the lock); returns whether anything changed.
    pub fn set_services(&mut self, services: ServiceStore) -> bool {
        if self.services.same_as(&services) {
            return false;
        }
        self.services = services;
        true
    }

    /// Makes `policies` every authorization policy known (a full resync);
    /// returns whether anything changed.
    pub fn replace_policies(&mut self, policies: impl IntoIterator<Item = Policy>) -> bool {
        self.set_policies(PolicySet::new(policies))
    }

    /// Swaps in `policies` (built with [`PolicySet::new`] outside the
    /// lock); returns whether anything changed.
    pub fn set_policies(&mut self, policies: PolicySet) -> bool {
        if policies == *self.policies {
            return false;
        }
        self.policies = Arc::new(policies);
        self.policy_generation += 1;
        true
    }

    /// The authorization policies, indexed for checks.
    pub fn policies(&self) -> &Arc<PolicySet> {
        &self.policies
    }

    /// How many times the policies changed.
    pub fn policy_generation(&self) -> u64 {
        self.policy_generation
    }

    /// The services, looked up by `VIP:port` (see [`ServiceStore`]).
    pub fn services(&self) -> &ServiceStore {
        &self.services
    }

    /// The service a connection names (`ConnectionInfo::dst_service`):
    /// by its id (namespace/hostname, [`Service::id`]: one of a
    /// ServiceEntry's hosts), else by namespace/name.
    pub fn service_named(&self, key: &WorkloadKey) -> Option<&Arc<Service>> {
        self.services.by_id(key).or_else(|| self.services.get(key))
    }

    /// Istio's name for the service `key` ([`Self::service_named`]; its
    /// `destination_service`, ztunnel's `dst.service`): its hostname; for
    /// a service the store no longer knows, or knows without one, its DNS
    /// name in the default cluster domain.
    pub fn service_hostname(&self, key: &WorkloadKey) -> String {
        Self::hostname_of(key, self.service_named(key).map(Arc::as_ref))
    }

    /// [`Self::service_hostname`] of `key`, `service` being what
    /// [`Self::service_named`] found for it.
    pub fn hostname_of(key: &WorkloadKey, service: Option<&Service>) -> String {
        service
            .map(|s| s.hostname.clone())
            .filter(|h| !h.is_empty())
            .unwrap_or_else(|| {
                crate::control::waypoint::service_hostname(
                    &key.namespace,
                    &key.name,
                    crate::control::waypoint::DEFAULT_CLUSTER_DOMAIN,
                )
            })
    }

    /// The service a connection to `dst` from a client in `client_ns`
    /// addresses, as ztunnel finds it: a VIP's (of the services sharing
    /// it, those the client may see, its own namespace's first); else,
    /// when no workload owns the address, one whose address range holds it
    /// (a ServiceEntry's CIDR). `None` namespace: any (inbound).
    pub fn service_for(&self, dst: SocketAddr, client_ns: Option<&str>) -> Option<&Arc<Service>> {
        self.services.by_addr_from(dst, client_ns).or_else(|| {
            if !self.services.has_ranges() || self.by_ip.contains_key(&dst.ip()) {
                return None;
            }
            self.services.by_range(dst, client_ns)
        })
    }

    /// The workload named `key`; of several (a pod and a WorkloadEntry of
    /// one name), the pod ([`preferred`]).
    pub fn get(&self, key: &WorkloadKey) -> Option<&Workload> {
        self.get_shared(key).map(Arc::as_ref)
    }

    /// As [`WorkloadStore::get`], shared.
    pub fn get_shared(&self, key: &WorkloadKey) -> Option<&Arc<Workload>> {
        self.by_name
            .get(key)
            .and_then(|named| preferred(named, &self.local_network))
    }

    /// The workload stored under `id` (its uid; see [`workload_id`]).
    pub fn by_id(&self, id: &str) -> Option<&Arc<Workload>> {
        self.by_id.get(id)
    }

    /// The workload that owns `ip`, if any.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.by_ip_shared(ip).map(Arc::as_ref)
    }

    /// As [`WorkloadStore::by_ip`], shared: what the proxy takes per
    /// connection (a pointer clone, no allocation).
    pub fn by_ip_shared(&self, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_ip
            .get(&ip)
            .and_then(|claimants| preferred(claimants, &self.local_network))
    }

    /// The workload at `ip` on exactly `network` (another network's
    /// address may also be one of ours: pod CIDRs may overlap), ranked as
    /// [`WorkloadStore::by_ip`] ranks claimants.
    pub fn by_network_ip(&self, network: &str, ip: IpAddr) -> Option<&Arc<Workload>> {
        self.by_ip
            .get(&ip)?
            .iter()
            .filter(|w| w.network == network)
            .max_by_key(|w| rank(w, network))
    }

    /// The workload behind an address that comes with its network (a
    /// service endpoint's, a waypoint's or gateway's address): exactly on
    /// `network`, never another network's pod that reuses the address; as
    /// [`WorkloadStore::by_ip`] where no network is named.
    pub fn by_ip_on(&self, network: &str, ip: IpAddr) -> Option<&Workload> {
        if network.is_empty() {
            self.by_ip(ip)
        } else {
            self.by_network_ip(network, ip).map(Arc::as_ref)
        }
    }

    /// The workloads scheduled on `node`, in key order.
    pub fn on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Workload> + 'a {
        self.iter().filter(move |w| w.node == node)
    }

    /// All workloads, in key (namespace/name) order.
    pub fn iter(&self) -> impl Iterator<Item = &Workload> {
        self.by_name.values().flatten().map(Arc::as_ref)
    }

    pub fn len(&self) -> usize {
        self.by_id.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::{DataplaneMode, tests::workload};

    fn key(ns: &str, name: &str) -> WorkloadKey {
        WorkloadKey::new(ns, name)
    }

    fn ip(s: &str) -> IpAddr {
        s.parse().expect("test IP")
    }

    #[test]
    fn lookups() {
        let mut store = WorkloadStore::new();
        assert!(store.is_empty());
        store.replace_all(vec![
            workload("default", "client", "198.18.1.2", "node-a"),
            workload("default", "server", "198.18.2.2", "node-b"),
            workload("other", "db", "198.18.1.3", "node-a"),
        ]);
        assert_eq!(store.len(), 3);
        assert_eq!(
            store
                .get(&key("default", "server"))
                .map(|w| w.node.as_str()),
            Some("node-b")
        );
        assert_eq!(store.get(&key("default", "nope")), None);
        assert_eq!(
            store.by_ip(ip("198.18.1.3")).map(Workload::key),
            Some(key("other", "db"))
        );
        assert_eq!(store.by_ip(ip("198.18.9.9")), None);
        let on_a: Vec<_> = store.on_node("node-a").map(Workload::key).collect();
        assert_eq!(on_a, [key("default", "client"), key("other", "db")]);
        assert_eq!(store.on_node("node-c").count(), 0);
        assert_eq!(store.iter().count(), 3);
    }

    #[test]
    fn replace_all_reports_changes() {
        let mut store = WorkloadStore::new();
        let first = store.replace_all(vec![
            workload("default", "a", "198.18.1.1", "node-a"),
            workload("default", "b", "198.18.1.2", "node-a"),
            workload("default", "c", "198.18.1.3", "node-a"),
        ]);
        assert_eq!(
            first.added,
            [
                key("default", "a"),
                key("default", "b"),
                key("default", "c")
            ]
        );
        assert!(first.removed.is_empty() && first.updated.is_empty());

        let mut b = workload("default", "b", "198.18.1.2", "node-a");
        b.dataplane_mode = DataplaneMode::None;
        let second = store.replace_all(vec![
            workload("default", "d", "198.18.1.4", "node-a"),
            b,
            workload("default", "a", "198.18.1.1", "node-a"),
        ]);
        assert_eq!(
            second,
            WorkloadChanges {
                added: vec![key("default", "d")],
                removed: vec![key("default", "c")],
                updated: vec![key("default", "b")],
            }
        );
        assert_eq!(
            store.by_ip(ip("198.18.1.3")),
            None,
            "removed workload's IP is gone"
        );

        let same: Vec<_> = store.iter().cloned().collect();
        assert!(store.replace_all(same).is_empty());
    }

    #[test]
    fn replace_policies_reports_changes() {
        use crate::authz::{Action, Scope};
        let policy = |action| Policy {
            name: "p".into(),
            namespace: "default".into(),
            scope: Scope::Namespace,
            action,
            rules: vec![],
            dry_run: false,
            selector: None,
        };
        let mut store = WorkloadStore::new();
        assert!(store.policies().is_empty());
        assert!(store.replace_policies([policy(Action::Allow)]));
        assert_eq!(store.policy_generation(), 1);
        assert!(!store.replace_policies([policy(Action::Allow)]), "same set");
        assert!(store.replace_policies([policy(Action::Deny)]));
        assert_eq!(store.policies().len(), 1);
        assert!(store.replace_policies([]));
        assert!(store.policies().is_empty());
        assert_eq!(store.policy_generation(), 3);
    }

    #[test]
    fn conflicting_input_keeps_the_store_consistent() {
        let mut store = WorkloadStore::new();
        store.replace_all(vec![
            workload("default", "old", "198.18.1.1", "node-a"),
            workload("default", "new", "198.18.1.1", "node-a"),
            workload("default", "twice", "198.18.1.7", "node-a"),
            workload("default", "twice", "198.18.1.8", "node-a"),
        ]);
        let owner = store.by_ip(ip("198.18.1.1")).map(Workload::key);
        assert_eq!(
            owner,
            Some(key("default", "old")),
            "of equal rank, the greater id names the IP"
        );
        assert!(
            store.get(&key("default", "new")).is_some(),
            "the other claimant stays a workload"
        );
        assert_eq!(store.by_ip(ip("198.18.1.7")), None);
        assert_eq!(
            store.by_ip(ip("198.18.1.8")).map(Workload::key),
            Some(key("default", "twice"))
        );
        assert_eq!(store.len(), 3);
        // The owner leaves: the IP falls to the other claimant.
        store.remove("default/old");
        assert_eq!(
            store.by_ip(ip("198.18.1.1")).map(Workload::key),
            Some(key("default", "new"))
        );
    }

    /// Two networks' pods at one address: the address names the one on
    /// the node's network (`--network`), whatever the uids say.
    #[test]
    fn an_ip_names_the_pod_on_this_nodes_network() {
        let mut here = workload("default", "server", "198.18.1.1", "node-b");
        here.uid = "Kubernetes//Pod/default/server".into();
        let mut elsewhere = workload("default", "zz-remote", "198.18.1.1", "node-x");
        elsewhere.uid = "Kubernetes//Pod/default/zz-remote".into();
        elsewhere.network = "network2".into();
        let named = |store: &mut WorkloadStore| {
            store.replace_all(vec![here.clone(), elsewhere.clone()]);
            store.by_ip(ip("198.18.1.1")).map(Workload::key)
        };
        assert_eq!(
            named(&mut WorkloadStore::new()),
            Some(key("default", "server")),
            "the default network's, though the other uid is greater"
        );
        assert_eq!(
            named(&mut WorkloadStore::on_network("network2")),
            Some(key("default", "zz-remote"))
        );
    }

    /// Keyed by uid; an IP and a name mean the pod before anything else
    /// (ztunnel's ranking); host-network workloads own no IP.
    #[test]
    fn uids_ranking_and_host_network() {
        let mut pod = workload("default", "server", "198.18.1.1", "node-b");
        pod.uid = "Kubernetes//Pod/default/server".into();
        let mut entry = workload("default", "server", "198.18.1.1", "node-b");
        entry.uid = "Kubernetes/networking.istio.io/WorkloadEntry/default/server".into();
        let mut host_a = workload("kube-system", "kube-proxy", "198.18.0.2", "node-b");
        host_a.uid = "Kubernetes//Pod/kube-system/kube-proxy".into();
        host_a.host_network = true;
        let mut host_b = host_a.clone();
        host_b.name = "cni".into();
        host_b.uid = "Kubernetes//Pod/kube-system/cni".into();
        let mut store = WorkloadStore::new();
        let changes = store.replace_all(vec![entry.clone(), pod.clone(), host_a, host_b]);
        assert_eq!(changes.added.len(), 4);
        assert_eq!(store.len(), 4);
        let uid_at = |s: &WorkloadStore| s.by_ip(ip("198.18.1.1")).map(|w| w.uid.clone());
        assert_eq!(
            uid_at(&store),
            Some(pod.uid.clone()),
            "the pod, not the entry"
        );
        assert_eq!(
            store.get(&key("default", "server")).map(|w| w.uid.clone()),
            Some(pod.uid.clone())
        );
        assert_eq!(
            store.by_ip(ip("198.18.0.2")),
            None,
            "the node's IP names no pod"
        );
        assert!(store.get(&key("kube-system", "cni")).is_some());
        assert!(
            store
                .by_id("Kubernetes//Pod/kube-system/kube-proxy")
                .is_some()
        );

        // Same content again: nothing changes; the shared entries are kept.
        let held = store.by_ip_shared(ip("198.18.1.1")).cloned().expect("pod");
        let same: Vec<Arc<Workload>> = store.iter().cloned().map(Arc::new).collect();
        assert!(store.replace_all(same).is_empty());
        assert!(Arc::ptr_eq(
            &held,
            store.by_ip_shared(ip("198.18.1.1")).expect("pod")
        ));
        // The pod goes: the entry is what the IP names now.
        let changes = store.replace_all(vec![entry.clone()]);
        assert_eq!(changes.removed.len(), 3);
        assert_eq!(uid_at(&store), Some(entry.uid));
    }
}

//! The store: every workload, service and authorization policy the agent
//! knows, indexed for the lookups the agent makes. It sits above `state`
//! (the domain types) and `authz` (the policy engine, which reads
//! `state::Workload`), so the model layer has no import circle.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::Arc,
};

use crate::authz::{Policy, PolicySet};
use crate::state::{Service, ServiceStore, Workload, WorkloadKey};

/// All known workloads, by key and by IP, and the services they back.
///
/// One owner (the reconcile loop, or cluster discovery) mutates it; readers
/// elsewhere get snapshots or lookups through that owner, so there is no
/// locking here.
#[derive(Clone, Debug, Default)]
pub struct WorkloadStore {
    by_key: BTreeMap<WorkloadKey, Workload>,
    by_ip: HashMap<IpAddr, WorkloadKey>,
    services: ServiceStore,
    /// Shared with checks in flight: a change swaps in a new set.
    policies: Arc<PolicySet>,
    /// Bumped by every change of the policies (open connections are
    /// re-checked when it moves).
    policy_generation: u64,
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

impl WorkloadStore {
    pub fn new() -> Self {
        Self::default()
    }

    /// Makes `workloads` the whole content of the store (a full resync, as
    /// after loading a file or relisting from the API server).
    ///
    /// Sources should not send two workloads with one key or one IP, but a
    /// watch can briefly show a pod's IP on its successor too. The store then
    /// stays consistent and logs a warning: of two entries with one key the
    /// later is kept; an IP claimed twice stays with the greater key
    /// (arbitrary, but the same whatever the order of a relist) and is dropped
    /// from the other workload's `ips`, so every IP maps to exactly one
    /// workload that lists it.
    pub fn replace_all(
        &mut self,
        workloads: impl IntoIterator<Item = Workload>,
    ) -> WorkloadChanges {
        let mut next = BTreeMap::new();
        for w in workloads {
            if let Some(old) = next.insert(w.key(), w) {
                tracing::warn!(workload = %old.key(), "workload listed twice; keeping the last");
            }
        }
        let mut by_ip = HashMap::new();
        for (key, w) in &next {
            for ip in &w.ips {
                if let Some(other) = by_ip.insert(*ip, key.clone()) {
                    tracing::warn!(%ip, workload = %key, other = %other, "IP claimed by two workloads");
                }
            }
        }
        for (key, w) in next.iter_mut() {
            w.ips.retain(|ip| by_ip.get(ip) == Some(key));
        }

        let mut changes = WorkloadChanges::default();
        for (key, w) in &next {
            match self.by_key.get(key) {
                None => changes.added.push(key.clone()),
                Some(old) if old != w => changes.updated.push(key.clone()),
                Some(_) => {}
            }
        }
        changes.removed = self
            .by_key
            .keys()
            .filter(|k| !next.contains_key(*k))
            .cloned()
            .collect();

        self.by_key = next;
        self.by_ip = by_ip;
        changes
    }

    /// Makes `services` every service known (a full resync); returns whether
    /// anything changed. Kept apart from [`WorkloadStore::replace_all`]:
    /// sources list services and pods separately, and either may be late.
    pub fn replace_services(&mut self, services: impl IntoIterator<Item = Service>) -> bool {
        self.services.replace_all(services)
    }

    /// Makes `policies` every authorization policy known (a full resync);
    /// returns whether anything changed.
    pub fn replace_policies(&mut self, policies: impl IntoIterator<Item = Policy>) -> bool {
        let next = PolicySet::new(policies);
        if next == *self.policies {
            return false;
        }
        self.policies = Arc::new(next);
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

    pub fn get(&self, key: &WorkloadKey) -> Option<&Workload> {
        self.by_key.get(key)
    }

    /// The workload that owns `ip`, if any.
    pub fn by_ip(&self, ip: IpAddr) -> Option<&Workload> {
        self.by_ip.get(&ip).and_then(|key| self.by_key.get(key))
    }

    /// The workloads scheduled on `node`, in key order.
    pub fn on_node<'a>(&'a self, node: &'a str) -> impl Iterator<Item = &'a Workload> + 'a {
        self.by_key.values().filter(move |w| w.node == node)
    }

    /// All workloads, in key order.
    pub fn iter(&self) -> impl Iterator<Item = &Workload> {
        self.by_key.values()
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
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
            "the greater key keeps the IP"
        );
        assert!(
            store
                .get(&key("default", "new"))
                .is_some_and(|w| w.ips.is_empty())
        );
        assert_eq!(store.by_ip(ip("198.18.1.7")), None);
        assert_eq!(
            store.by_ip(ip("198.18.1.8")).map(Workload::key),
            Some(key("default", "twice"))
        );
        assert_eq!(store.len(), 3);
    }
}

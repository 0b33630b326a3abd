//! What the held Address resources imply, kept current one change at a
//! time: each service with its endpoints, and the warnings about what
//! could not be resolved. A response touches only the services its
//! workloads name and the resources near them, so a one-workload delta at
//! 10,000 workloads does not rebuild every service (issue 34, item 11).

use std::{
    collections::{BTreeMap, BTreeSet, HashMap, HashSet},
    net::IpAddr,
    sync::Arc,
};

use super::service::{push_endpoints, service_key};
use crate::state::{Service, Workload};

/// One Address resource before and after a response (`None`: absent).
pub(super) struct Change {
    pub name: String,
    pub old: Option<Entry>,
    pub new: Option<Entry>,
}

/// A held Address resource: shared, never changed in place.
#[derive(Clone, Debug, PartialEq)]
pub(super) enum Entry {
    Workload(Arc<Workload>),
    /// As istiod sent it, without endpoints.
    Service(Arc<Service>),
}

#[derive(Debug, Default)]
pub(super) struct Derived {
    /// `namespace/hostname` → the name of the service resource holding it.
    services_by_key: HashMap<String, String>,
    /// `namespace/hostname` → the workloads (resource names) naming it.
    backers: HashMap<String, BTreeSet<String>>,
    /// Service resource name → the service with its endpoints.
    attached: BTreeMap<String, Arc<Service>>,
    /// (network, IP) → the workloads claiming it; host-network workloads
    /// share their node's IP and are left out.
    claims: HashMap<(String, IpAddr), BTreeSet<String>>,
    /// Resource name → what is wrong around it.
    warnings: BTreeMap<String, Vec<String>>,
    /// Service resources whose copy with endpoints was replaced or dropped
    /// since [`Derived::take_touched`] (what a delta must carry).
    touched: HashSet<String>,
}

impl Derived {
    /// Brings everything up to date with `changes` (already applied to
    /// `held`); `policies_changed`: the set of policy names moved (every
    /// workload's policy warnings are re-checked). Returns the warnings
    /// that are new.
    pub fn update(
        &mut self,
        held: &BTreeMap<String, Entry>,
        policy_known: &dyn Fn(&str) -> bool,
        changes: Vec<Change>,
        policies_changed: bool,
    ) -> Vec<String> {
        let mut dirty_keys: HashSet<String> = HashSet::new();
        let mut dirty_names: HashSet<String> = HashSet::new();
        let mut services_came_or_went = false;
        for change in &changes {
            match &change.old {
                Some(Entry::Workload(w)) => {
                    for key in w.services.keys() {
                        if let Some(set) = self.backers.get_mut(key) {
                            set.remove(&change.name);
                            if set.is_empty() {
                                self.backers.remove(key);
                            }
                        }
                        dirty_keys.insert(key.clone());
                    }
                    for claim in claims_of(w) {
                        if let Some(set) = self.claims.get_mut(&claim) {
                            set.remove(&change.name);
                            dirty_names.extend(set.iter().cloned());
                            if set.is_empty() {
                                self.claims.remove(&claim);
                            }
                        }
                    }
                }
                Some(Entry::Service(s)) => {
                    let key = service_key(s);
                    if self.services_by_key.get(&key) == Some(&change.name) {
                        self.services_by_key.remove(&key);
                    }
                    self.attached.remove(&change.name);
                    self.touched.insert(change.name.clone());
                    services_came_or_went = true;
                    dirty_keys.insert(key);
                }
                None => {}
            }
            match &change.new {
                Some(Entry::Workload(w)) => {
                    for key in w.services.keys() {
                        self.backers
                            .entry(key.clone())
                            .or_default()
                            .insert(change.name.clone());
                        dirty_keys.insert(key.clone());
                    }
                    for claim in claims_of(w) {
                        let set = self.claims.entry(claim).or_default();
                        dirty_names.extend(set.iter().cloned());
                        set.insert(change.name.clone());
                    }
                    dirty_names.insert(change.name.clone());
                }
                Some(Entry::Service(s)) => {
                    let key = service_key(s);
                    self.services_by_key
                        .insert(key.clone(), change.name.clone());
                    services_came_or_went = true;
                    dirty_keys.insert(key);
                    dirty_names.insert(change.name.clone());
                }
                None => {
                    self.warnings.remove(&change.name);
                }
            }
        }
        for key in &dirty_keys {
            if let Some(backers) = self.backers.get(key) {
                // Their "names a service istiod has not sent" may change.
                dirty_names.extend(backers.iter().cloned());
            }
            let Some(name) = self.services_by_key.get(key) else {
                continue;
            };
            let Some(Entry::Service(bare)) = held.get(name) else {
                continue;
            };
            let mut service = Service::clone(bare);
            for backer in self.backers.get(key).into_iter().flatten() {
                if let Some(Entry::Workload(w)) = held.get(backer)
                    && let Some(ports) = w.services.get(key)
                {
                    push_endpoints(&mut service, w, ports);
                }
            }
            match self.attached.get(name) {
                Some(old) if **old == service => {}
                _ => {
                    self.attached.insert(name.clone(), Arc::new(service));
                    self.touched.insert(name.clone());
                }
            }
        }
        if services_came_or_went {
            // A waypoint may name a service that came or went.
            dirty_names.extend(
                held.iter()
                    .filter(|(_, e)| matches!(e, Entry::Service(_)))
                    .map(|(n, _)| n.clone()),
            );
        }
        if policies_changed {
            dirty_names.extend(
                held.iter()
                    .filter(|(_, e)| matches!(e, Entry::Workload(_)))
                    .map(|(n, _)| n.clone()),
            );
        }
        let mut new = Vec::new();
        for name in dirty_names {
            let Some(entry) = held.get(&name) else {
                self.warnings.remove(&name);
                continue;
            };
            let warnings = self.warnings_of(&name, entry, policy_known);
            let before = self.warnings.get(&name);
            new.extend(
                warnings
                    .iter()
                    .filter(|w| before.is_none_or(|b| !b.contains(w)))
                    .cloned(),
            );
            if warnings.is_empty() {
                self.warnings.remove(&name);
            } else {
                self.warnings.insert(name, warnings);
            }
        }
        new.sort();
        new
    }

    fn warnings_of(
        &self,
        name: &str,
        entry: &Entry,
        policy_known: &dyn Fn(&str) -> bool,
    ) -> Vec<String> {
        let mut out = Vec::new();
        match entry {
            Entry::Workload(w) => {
                for key in w.services.keys() {
                    if !self.services_by_key.contains_key(key) {
                        out.push(format!(
                            "workload {} ({}) names service {key}, which istiod has not sent",
                            w.key(),
                            w.uid
                        ));
                    }
                }
                for claim in claims_of(w) {
                    let first = self
                        .claims
                        .get(&claim)
                        .and_then(|set| set.iter().next())
                        .filter(|first| first.as_str() != name);
                    if let Some(first) = first {
                        out.push(format!(
                            "address {} (network {:?}) is claimed by workloads {first} and {name}",
                            claim.1, claim.0
                        ));
                    }
                }
                for p in w.authorization_policies.iter().filter(|p| !policy_known(p)) {
                    out.push(format!(
                        "workload {} ({}) names policy {p}, which istiod has not sent",
                        w.key(),
                        w.uid
                    ));
                }
            }
            Entry::Service(s) => {
                for waypoint in s.waypoint_hostnames() {
                    if !self.services_by_key.contains_key(&waypoint) {
                        out.push(format!(
                            "service {} names waypoint {waypoint}, which istiod has not sent",
                            service_key(s)
                        ));
                    }
                }
            }
        }
        out
    }

    /// Every service with its endpoints, by resource name.
    pub fn services(&self) -> impl Iterator<Item = &Arc<Service>> {
        self.attached.values()
    }

    /// The service resource `name` with its endpoints.
    pub fn service(&self, name: &str) -> Option<&Arc<Service>> {
        self.attached.get(name)
    }

    /// The service resources whose copy with endpoints changed since the
    /// last call.
    pub fn take_touched(&mut self) -> HashSet<String> {
        std::mem::take(&mut self.touched)
    }

    /// Every warning, by resource name.
    pub fn warnings(&self) -> impl Iterator<Item = &String> {
        self.warnings.values().flatten()
    }
}

/// The (network, IP)s a workload claims for its own.
fn claims_of(w: &Workload) -> impl Iterator<Item = (String, IpAddr)> + '_ {
    w.ips
        .iter()
        .filter(|_| !w.host_network)
        .map(|ip| (w.network.clone(), *ip))
}

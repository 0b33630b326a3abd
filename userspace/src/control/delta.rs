//! [`ClusterDelta`]: what changed in a source's cluster view, so the store's
//! owner applies a one-workload change without being handed (and without
//! diffing) every workload of the mesh (issue 34, item 11). A source that
//! keeps its view (istiod's) sends one complete [`ClusterView`] first and
//! deltas after; the sink folds updates not yet taken into one
//! ([`ClusterUpdate::merge`]), so none is lost and none waits.

use std::{collections::HashMap, sync::Arc};

use super::ClusterView;
use crate::{
    authz::Policy,
    state::{Service, Workload, WorkloadKey},
    store::workload_id,
};

/// Changes to a cluster view, by the id each entry is stored under: a
/// workload's uid (or namespace/name, [`workload_id`]), a service's
/// [`Service::id`]. `None`: removed.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct ClusterDelta {
    pub workloads: HashMap<String, Option<Arc<Workload>>>,
    pub services: HashMap<WorkloadKey, Option<Arc<Service>>>,
    /// Every policy, when any changed (a policy change re-checks every
    /// open connection anyway, so the set is replaced whole).
    pub policies: Option<Vec<Policy>>,
}

impl ClusterDelta {
    pub fn is_empty(&self) -> bool {
        self.workloads.is_empty() && self.services.is_empty() && self.policies.is_none()
    }

    /// `next` applied after `self`: the later change of an id wins.
    pub fn then(mut self, next: ClusterDelta) -> ClusterDelta {
        self.workloads.extend(next.workloads);
        self.services.extend(next.services);
        if next.policies.is_some() {
            self.policies = next.policies;
        }
        self
    }
}

impl ClusterView {
    /// This view with `delta` applied (what the store holds after a full
    /// view then a delta). Order is kept; new entries go last.
    pub fn with_delta(self, delta: ClusterDelta) -> ClusterView {
        let ClusterDelta {
            mut workloads,
            mut services,
            policies,
        } = delta;
        let mut next_workloads = Vec::with_capacity(self.workloads.len() + workloads.len());
        for w in self.workloads {
            match workloads.remove(workload_id(&w).as_ref()) {
                Some(Some(new)) => next_workloads.push(new),
                Some(None) => {}
                None => next_workloads.push(w),
            }
        }
        next_workloads.extend(workloads.into_values().flatten());
        let mut next_services = Vec::with_capacity(self.services.len() + services.len());
        for s in self.services {
            match services.remove(&s.id()) {
                Some(Some(new)) => next_services.push(new),
                Some(None) => {}
                None => next_services.push(s),
            }
        }
        next_services.extend(services.into_values().flatten());
        ClusterView {
            workloads: next_workloads,
            services: next_services,
            policies: policies.unwrap_or(self.policies),
        }
    }
}

/// What the store's owner is handed: a complete view, or the changes since
/// the last one handed.
#[derive(Clone, Debug, PartialEq)]
pub enum ClusterUpdate {
    Full(ClusterView),
    Delta(ClusterDelta),
}

impl ClusterUpdate {
    /// One update equivalent to `self` then `next` (the owner had not taken
    /// `self` yet).
    pub fn merge(self, next: ClusterUpdate) -> ClusterUpdate {
        match (self, next) {
            (_, ClusterUpdate::Full(view)) => ClusterUpdate::Full(view),
            (ClusterUpdate::Full(view), ClusterUpdate::Delta(delta)) => {
                ClusterUpdate::Full(view.with_delta(delta))
            }
            (ClusterUpdate::Delta(first), ClusterUpdate::Delta(then)) => {
                ClusterUpdate::Delta(first.then(then))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::state::tests::workload;

    fn w(name: &str, ip: &str) -> Arc<Workload> {
        let mut w = workload("default", name, ip, "node-a");
        w.uid = format!("uid-{name}");
        Arc::new(w)
    }

    #[test]
    fn a_delta_replaces_removes_and_adds_by_id() {
        let view = ClusterView {
            workloads: vec![w("a", "198.18.0.1"), w("b", "198.18.0.2")],
            ..Default::default()
        };
        let mut delta = ClusterDelta::default();
        delta
            .workloads
            .insert("uid-a".into(), Some(w("a", "198.18.0.9")));
        delta.workloads.insert("uid-b".into(), None);
        delta
            .workloads
            .insert("uid-c".into(), Some(w("c", "198.18.0.3")));
        let next = view.with_delta(delta);
        let names: Vec<(String, String)> = next
            .workloads
            .iter()
            .map(|w| (w.name.clone(), w.ips[0].to_string()))
            .collect();
        assert_eq!(
            names,
            vec![
                ("a".into(), "198.18.0.9".into()),
                ("c".into(), "198.18.0.3".into())
            ]
        );
    }

    #[test]
    fn merged_updates_keep_every_change_and_the_last_wins() {
        let mut first = ClusterDelta::default();
        first.workloads.insert("uid-a".into(), None);
        first
            .workloads
            .insert("uid-b".into(), Some(w("b", "198.18.0.2")));
        let mut second = ClusterDelta::default();
        second
            .workloads
            .insert("uid-a".into(), Some(w("a", "198.18.0.1")));
        second.policies = Some(Vec::new());
        let ClusterUpdate::Delta(merged) =
            ClusterUpdate::Delta(first).merge(ClusterUpdate::Delta(second))
        else {
            panic!("two deltas merge into a delta");
        };
        assert!(merged.workloads["uid-a"].is_some(), "the later change wins");
        assert!(merged.workloads["uid-b"].is_some(), "the earlier is kept");
        assert_eq!(merged.policies, Some(Vec::new()));

        let full = ClusterUpdate::Full(ClusterView::default());
        let mut removal = ClusterDelta::default();
        removal
            .workloads
            .insert("uid-x".into(), Some(w("x", "198.18.0.7")));
        let ClusterUpdate::Full(view) = full.merge(ClusterUpdate::Delta(removal)) else {
            panic!("a delta on a full view stays full");
        };
        assert_eq!(view.workloads.len(), 1);
    }
}

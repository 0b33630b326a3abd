//! The workload store's owner: the one task that writes the
//! [`WorkloadStore`] the proxy looks peers, services and authorization
//! policies up in. It applies each [`ClusterUpdate`] a source pushed: a
//! complete [`ClusterView`] (diffed against the store), or a
//! [`ClusterDelta`] (only the ids it names are touched).

use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{Notify, watch};
use tracing::info;

use crate::{
    authz::PolicySet,
    control::{ClusterDelta, ClusterUpdate, ClusterView},
    state::ServiceStore,
    store::WorkloadStore,
};

/// A slot holding the latest value: putting replaces what was not taken
/// yet, and never waits.
pub struct Latest<T> {
    slot: Mutex<Option<T>>,
    notify: Notify,
}

impl<T> Default for Latest<T> {
    fn default() -> Self {
        Self {
            slot: Mutex::new(None),
            notify: Notify::new(),
        }
    }
}

impl<T> Latest<T> {
    pub fn put(&self, value: T) {
        self.put_merged(value, |_, next| next);
    }

    /// Puts `value`, folded with `merge(untaken, value)` into what was not
    /// taken yet (for values that are changes: none may be lost).
    pub fn put_merged(&self, value: T, merge: impl FnOnce(T, T) -> T) {
        let mut slot = self.slot.lock().unwrap_or_else(|p| p.into_inner());
        let next = match slot.take() {
            Some(untaken) => merge(untaken, value),
            None => value,
        };
        *slot = Some(next);
        drop(slot);
        self.notify.notify_one();
    }

    /// Waits for a value and takes it.
    pub async fn take(&self) -> T {
        loop {
            if let Some(value) = self.slot.lock().unwrap_or_else(|p| p.into_inner()).take() {
                return value;
            }
            self.notify.notified().await;
        }
    }
}

/// Applies every cluster update put in `views` to `store`, until the future
/// is dropped; after each, publishes the update's number on `applied` (the
/// reconciler waits for it before enrolling pods pushed after that view).
/// `policies_changed` runs after a view changed the policies (the proxy
/// re-checks its open connections then).
pub async fn own_store(
    store: Arc<RwLock<WorkloadStore>>,
    views: Arc<Latest<(u64, ClusterUpdate)>>,
    applied: watch::Sender<u64>,
    policies_changed: impl Fn() + Send + 'static,
) {
    loop {
        let (number, update) = views.take().await;
        let changed = match update {
            ClusterUpdate::Full(view) => apply(&store, view),
            ClusterUpdate::Delta(delta) => apply_delta(&store, delta),
        };
        if changed {
            policies_changed();
        }
        applied.send_replace(number);
    }
}

/// Makes `view` the store's whole content. The single place where a
/// cluster view reaches the store. Returns whether the policies changed.
///
/// What changed is worked out under the read lock (this task is the one
/// writer, so the store cannot move meanwhile); the write lock the proxy's
/// lookups wait on is held only to apply that difference.
pub fn apply(store: &RwLock<WorkloadStore>, view: ClusterView) -> bool {
    let ClusterView {
        workloads,
        services,
        policies,
    } = view;
    let count = (workloads.len(), services.len(), policies.len());
    let diff = store
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .diff(workloads);
    let services = ServiceStore::from_services(services);
    let mut store = store.write().unwrap_or_else(|p| p.into_inner());
    let changes = store.apply_diff(diff);
    if !changes.is_empty() {
        info!(
            workloads = count.0,
            added = changes.added.len(),
            removed = changes.removed.len(),
            updated = changes.updated.len(),
            "workload store updated"
        );
    }
    if store.set_services(services) {
        info!(services = count.1, "services updated");
    }
    // Policies with the workloads they select, under one write lock: a
    // connection is never checked against half of a view.
    let policies_changed = store.replace_policies(policies);
    if policies_changed {
        info!(policies = count.2, "authorization policies updated");
    }
    policies_changed
}

/// Applies `delta` to the store: the write lock is held for the entries it
/// names (and to swap in policies, when they changed, indexed before).
/// Returns whether the policies changed.
pub fn apply_delta(store: &RwLock<WorkloadStore>, delta: ClusterDelta) -> bool {
    let ClusterDelta {
        workloads,
        services,
        policies,
    } = delta;
    let policies = policies.map(|p| (p.len(), PolicySet::new(p)));
    let mut store = store.write().unwrap_or_else(|p| p.into_inner());
    let (changes, services_changed) = store.apply_delta(workloads, services);
    let policies_changed = policies.is_some_and(|(count, set)| {
        let changed = store.set_policies(set);
        if changed {
            info!(policies = count, "authorization policies updated");
        }
        changed
    });
    drop(store);
    if !changes.is_empty() {
        info!(
            added = changes.added.len(),
            removed = changes.removed.len(),
            updated = changes.updated.len(),
            "workload store updated"
        );
    }
    if services_changed {
        info!("services updated");
    }
    policies_changed
}

//! The workload store's owner: the one task that writes the
//! [`WorkloadStore`] the proxy looks peers, services and authorization
//! policies up in. It applies each [`ClusterView`] a source pushed, whole.

use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{Notify, watch};
use tracing::info;

use crate::{control::ClusterView, state::ServiceStore, store::WorkloadStore};

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
        *self.slot.lock().unwrap_or_else(|p| p.into_inner()) = Some(value);
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

/// Applies every cluster view put in `views` to `store`, until the future
/// is dropped; after each, publishes the view's number on `applied` (the
/// reconciler waits for it before enrolling pods pushed after that view).
/// `policies_changed` runs after a view changed the policies (the proxy
/// re-checks its open connections then).
pub async fn own_store(
    store: Arc<RwLock<WorkloadStore>>,
    views: Arc<Latest<(u64, ClusterView)>>,
    applied: watch::Sender<u64>,
    policies_changed: impl Fn() + Send + 'static,
) {
    loop {
        let (number, view) = views.take().await;
        if apply(&store, view) {
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

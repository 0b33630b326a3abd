//! The workload store's owner: the one task that writes the
//! [`WorkloadStore`] the proxy looks peers, services (and, with the
//! authorization work, policies) up in. It applies each [`ClusterView`] a
//! source pushed, whole.

use std::sync::{Arc, Mutex, RwLock};

use tokio::sync::{Notify, watch};
use tracing::info;

use crate::{control::ClusterView, state::WorkloadStore};

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
pub async fn own_store(
    store: Arc<RwLock<WorkloadStore>>,
    views: Arc<Latest<(u64, ClusterView)>>,
    applied: watch::Sender<u64>,
) {
    loop {
        let (number, view) = views.take().await;
        apply(&store, view);
        applied.send_replace(number);
    }
}

/// Makes `view` the store's whole content. The single place where a
/// cluster view reaches the store.
pub fn apply(store: &RwLock<WorkloadStore>, view: ClusterView) {
    let ClusterView {
        workloads,
        services,
        policies,
    } = view;
    let count = (workloads.len(), services.len());
    let mut store = store.write().unwrap_or_else(|p| p.into_inner());
    let changes = store.replace_all(workloads);
    if !changes.is_empty() {
        info!(
            workloads = count.0,
            added = changes.added.len(),
            removed = changes.removed.len(),
            updated = changes.updated.len(),
            "workload store updated"
        );
    }
    if store.replace_services(services) {
        info!(services = count.1, "services updated");
    }
    // Authorization policies join the store here once it keeps them.
    drop(policies);
}

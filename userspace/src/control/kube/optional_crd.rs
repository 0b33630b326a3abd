//! The watch of a custom resource that may not be installed (Istio's
//! `AuthorizationPolicy`, the Gateway API's `Gateway`): what
//! `policy.rs` and `gateway.rs` share.
//!
//! A cluster-wide kube-rs watcher (list, then watch; the backoff, relist
//! and last-complete-view rules of the other watches) feeds a cache of
//! each object's facts. While the API server answers 404 (the CRD is not
//! served) the agent runs without those objects, says so once, and kube-rs
//! keeps retrying the list with its backoff (0.8 s doubling up to 30 s);
//! once the CRD appears they apply. A 403 (a ClusterRole without the
//! resource) is said once likewise. Neither ever holds back readiness or
//! the workload and service discovery.

use std::sync::Arc;

use ::kube::{
    Api, Client, Resource,
    runtime::{WatchStreamExt as _, watcher},
};
use futures::{StreamExt as _, stream::BoxStream};
use serde::de::DeserializeOwned;
use tracing::{debug, info, warn};

use super::{SourceStats, Step, apply_event, cache::ObjectCache, lenient::Lenient};

/// Which custom resource a watch is of, and how its logs name what the
/// agent goes without while it is not served.
pub(crate) struct OptionalCrd {
    /// `PLURAL.GROUP`, as RBAC grants it (`authorizationpolicies.security.istio.io`).
    pub resource: &'static str,
    /// The CRD as the 404 line names it (`AuthorizationPolicy CRD (security.istio.io/v1)`).
    pub crd: &'static str,
    /// What the agent runs without (`Kubernetes authorization policies`).
    pub without: &'static str,
    /// What applies once it is served (`Kubernetes authorization policies apply`).
    pub served: &'static str,
    /// The watch's name in watch-error lines (`authorizationpolicies`).
    pub watch: &'static str,
    /// The object kind in the cache's lines (`authorizationpolicy`).
    pub cache: &'static str,
}

/// The watch of an optional CRD: objects `K`, each cached as the facts
/// `facts` makes of it (`None`: an object that does not count).
pub(crate) struct OptionalCrdWatch<K: 'static, V, E> {
    crd: &'static OptionalCrd,
    events: BoxStream<'static, Result<watcher::Event<Lenient<K>>, watcher::Error>>,
    objects: ObjectCache<Option<V>>,
    facts: fn(&K) -> Result<Option<V>, E>,
    /// The API server answers 404: the CRD is not installed (said once per
    /// time it goes missing).
    absent: bool,
    /// The API server answered 403 (said once).
    forbidden: bool,
    /// The watch failed at least once: discovery goes ahead without
    /// waiting for these objects (see [`Self::settled`]).
    failed: bool,
    stats: Arc<SourceStats>,
}

impl<K, V, E> OptionalCrdWatch<K, V, E>
where
    K: 'static,
    Lenient<K>: Resource<DynamicType = ()> + Clone + DeserializeOwned + std::fmt::Debug + Send,
    V: Clone + PartialEq,
    E: std::fmt::Display,
{
    pub(crate) fn watch(
        crd: &'static OptionalCrd,
        client: &Client,
        stats: Arc<SourceStats>,
        facts: fn(&K) -> Result<Option<V>, E>,
    ) -> Self {
        Self {
            crd,
            events: watcher(Api::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .boxed(),
            objects: ObjectCache::new(crd.cache),
            facts,
            absent: false,
            forbidden: false,
            failed: false,
            stats,
        }
    }

    /// Whether the first cluster view may go out: the objects are listed,
    /// or known not to come (not installed, forbidden, failing). Until then
    /// discovery holds its first view back (bounded, see `cluster.rs`), so
    /// that a workload is not served without its policies by a mere race
    /// between two lists.
    pub(crate) fn settled(&self) -> bool {
        self.objects.listed() || self.absent || self.forbidden || self.failed
    }

    /// The objects' facts: none while the CRD is not served.
    pub(crate) fn values(&self) -> Vec<V> {
        if self.absent {
            return Vec::new();
        }
        self.objects.values().flatten().cloned().collect()
    }

    /// Waits for the next event of the watch and applies it.
    /// Cancel-safe: an event is applied as soon as it is received.
    pub(crate) async fn step(&mut self) -> Step {
        let event = self.events.next().await;
        let before = self.settled();
        let mut revived = false;
        let crd = self.crd;
        match &event {
            Some(Err(error)) => {
                self.failed = true;
                match api_code(error) {
                    Some(404) => return self.not_served(before),
                    Some(403) if !self.forbidden => {
                        self.forbidden = true;
                        warn!(
                            "the agent may not list {} (403): running without {}; grant list \
                             and watch on them (deploy/base/rbac.yaml)",
                            crd.resource, crd.without
                        );
                        return Step::Changed;
                    }
                    _ => {}
                }
            }
            Some(Ok(watcher::Event::InitDone)) if self.absent || self.forbidden => {
                info!("{} is served now: {}", crd.resource, crd.served);
                self.absent = false;
                self.forbidden = false;
                revived = true;
            }
            _ => {}
        }
        let step = apply_event(crd.watch, event, &mut self.objects, self.facts, &self.stats);
        match step {
            // Settling is a change too (the held-back first view may go),
            // and so is a CRD served again (its objects apply again).
            Step::Unchanged if revived || (!before && self.settled()) => Step::Changed,
            step => step,
        }
    }

    /// A 404: the CRD is not installed (or was removed, with its objects).
    fn not_served(&mut self, was_settled: bool) -> Step {
        if self.absent {
            debug!(
                "{} still not served; retrying after a backoff",
                self.crd.resource
            );
            return Step::Unchanged;
        }
        let had = !self.values().is_empty();
        self.absent = true;
        info!(
            "the {} is not installed: running without {}; retrying the list with a backoff \
             (up to 30 s)",
            self.crd.crd, self.crd.without
        );
        if had || !was_settled {
            Step::Changed
        } else {
            Step::Unchanged
        }
    }
}

/// The HTTP status the API server answered a watcher's request with, if it
/// answered at all.
pub(crate) fn api_code(error: &watcher::Error) -> Option<u16> {
    match error {
        watcher::Error::InitialListFailed(::kube::Error::Api(e))
        | watcher::Error::WatchStartFailed(::kube::Error::Api(e))
        | watcher::Error::WatchFailed(::kube::Error::Api(e)) => Some(e.code),
        watcher::Error::WatchError(e) => Some(e.code),
        _ => None,
    }
}

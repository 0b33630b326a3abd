//! A watch's view of one kind of object, fed by kube-rs watcher events.
//!
//! Like kube-rs' reflector store, but it holds each object's *facts* (see
//! [`super::pod`]), keeps serving the previous complete list while a relist
//! is in progress (so a relist never makes pods look gone for a moment), and
//! handles malformed objects: logged by name and skipped, keeping the last
//! good version of that object if there was one.

use std::collections::BTreeMap;

use ::kube::runtime::watcher::Event;
use tracing::warn;

use super::lenient::Lenient;

/// The objects of one watch, by `namespace/name`.
pub(crate) struct ObjectCache<T> {
    /// What kind of object (for logs): `pod`, `namespace`.
    kind: &'static str,
    objects: BTreeMap<String, T>,
    /// A relist in progress: replaces `objects` when complete.
    relisting: Option<BTreeMap<String, T>>,
    /// Whether a first complete list has been received. Until then the
    /// cache does not know what exists and must not be acted upon.
    listed: bool,
}

impl<T: Clone + PartialEq> ObjectCache<T> {
    pub(crate) fn new(kind: &'static str) -> Self {
        Self {
            kind,
            objects: BTreeMap::new(),
            relisting: None,
            listed: false,
        }
    }

    pub(crate) fn listed(&self) -> bool {
        self.listed
    }

    pub(crate) fn get(&self, key: &str) -> Option<&T> {
        self.objects.get(key)
    }

    pub(crate) fn values(&self) -> impl Iterator<Item = &T> {
        self.objects.values()
    }

    pub(crate) fn len(&self) -> usize {
        self.objects.len()
    }

    /// Applies one watcher event, reducing objects with `facts`. Returns
    /// whether the complete view changed (a relist's progress does not count
    /// until it is done).
    pub(crate) fn apply<K, E>(
        &mut self,
        event: Event<Lenient<K>>,
        facts: impl Fn(&K) -> Result<T, E>,
    ) -> bool
    where
        E: std::fmt::Display,
    {
        match event {
            Event::Init => {
                self.relisting = Some(BTreeMap::new());
                false
            }
            Event::InitApply(object) => {
                let Some(key) = self.key_of(&object) else {
                    return false;
                };
                let parsed = self.facts_of(&object, &facts);
                let Some(relisting) = self.relisting.as_mut() else {
                    // kube-rs always sends Init first; be safe anyway.
                    warn!(kind = self.kind, object = %object, "listed object outside a relist; ignored");
                    return false;
                };
                // A malformed object keeps its last good version, so a bad
                // edit does not unenrol a running pod.
                if let Some(value) = parsed.or_else(|| self.objects.get(&key).cloned()) {
                    relisting.insert(key, value);
                }
                false
            }
            Event::InitDone => {
                let next = self.relisting.take().unwrap_or_default();
                let changed = !self.listed || next != self.objects;
                self.objects = next;
                self.listed = true;
                changed
            }
            Event::Apply(object) => {
                let Some(key) = self.key_of(&object) else {
                    return false;
                };
                match self.facts_of(&object, &facts) {
                    Some(value) => self.objects.insert(key, value.clone()) != Some(value),
                    None => false,
                }
            }
            Event::Delete(object) => {
                // Even a malformed object can be deleted by name.
                let Some(key) = self.key_of(&object) else {
                    return false;
                };
                self.objects.remove(&key).is_some()
            }
        }
    }

    fn key_of<K>(&self, object: &Lenient<K>) -> Option<String> {
        let meta = object.metadata();
        match &meta.name {
            Some(name) => Some(match &meta.namespace {
                Some(ns) => format!("{ns}/{name}"),
                None => name.clone(),
            }),
            None => {
                warn!(kind = self.kind, "object without a name skipped");
                None
            }
        }
    }

    fn facts_of<K, E: std::fmt::Display>(
        &self,
        object: &Lenient<K>,
        facts: &impl Fn(&K) -> Result<T, E>,
    ) -> Option<T> {
        match object.parsed() {
            Ok(parsed) => match facts(parsed) {
                Ok(value) => Some(value),
                Err(error) => {
                    warn!(kind = self.kind, object = %object, %error, "unusable object skipped");
                    None
                }
            },
            Err(error) => {
                warn!(kind = self.kind, object = %object, %error, "malformed object skipped");
                None
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Namespace;
    use serde_json::json;

    fn ns(name: &str, label: Option<&str>) -> Lenient<Namespace> {
        let labels = label.map(|l| json!({"istio.io/dataplane-mode": l}));
        serde_json::from_value(json!({"metadata": {"name": name, "labels": labels}}))
            .expect("parses")
    }

    fn malformed(name: &str) -> Lenient<Namespace> {
        serde_json::from_value(json!({"metadata": {"name": name, "labels": "oops"}}))
            .expect("parses")
    }

    fn facts(n: &Namespace) -> Result<Option<String>, std::convert::Infallible> {
        Ok(n.metadata
            .labels
            .as_ref()
            .and_then(|l| l.get("istio.io/dataplane-mode").cloned()))
    }

    #[test]
    fn relist_replaces_atomically_and_keeps_serving_meanwhile() {
        let mut cache = ObjectCache::new("namespace");
        assert!(!cache.listed());
        assert!(!cache.apply(Event::Init, facts));
        assert!(!cache.apply(Event::InitApply(ns("a", Some("ambient"))), facts));
        assert!(!cache.apply(Event::InitApply(ns("b", None)), facts));
        assert!(
            cache.apply(Event::InitDone, facts),
            "first list is a change"
        );
        assert!(cache.listed());
        assert_eq!(cache.len(), 2);

        assert!(cache.apply(Event::Apply(ns("b", Some("ambient"))), facts));
        assert!(
            !cache.apply(Event::Apply(ns("b", Some("ambient"))), facts),
            "no-op"
        );

        // Relist: until done, the old view is served.
        cache.apply(Event::Init, facts);
        cache.apply(Event::InitApply(ns("b", Some("ambient"))), facts);
        assert_eq!(cache.len(), 2);
        assert!(cache.get("a").is_some());
        assert!(cache.apply(Event::InitDone, facts), "a is gone");
        assert!(cache.get("a").is_none());
        cache.apply(Event::Init, facts);
        cache.apply(Event::InitApply(ns("b", Some("ambient"))), facts);
        assert!(!cache.apply(Event::InitDone, facts), "same content");

        assert!(cache.apply(Event::Delete(ns("b", None)), facts));
        assert!(!cache.apply(Event::Delete(ns("b", None)), facts));
    }

    #[test]
    fn malformed_objects_keep_their_last_good_version() {
        let mut cache = ObjectCache::new("namespace");
        cache.apply(Event::Init, facts);
        cache.apply(Event::InitApply(ns("a", Some("ambient"))), facts);
        cache.apply(Event::InitApply(malformed("new")), facts);
        cache.apply(Event::InitDone, facts);
        assert_eq!(
            cache.len(),
            1,
            "a malformed object never seen good is skipped"
        );

        assert!(!cache.apply(Event::Apply(malformed("a")), facts));
        assert_eq!(cache.get("a"), Some(&Some("ambient".to_owned())));
        cache.apply(Event::Init, facts);
        cache.apply(Event::InitApply(malformed("a")), facts);
        assert!(!cache.apply(Event::InitDone, facts));
        assert_eq!(cache.get("a"), Some(&Some("ambient".to_owned())));
        assert!(cache.apply(Event::Delete(malformed("a")), facts));
        assert_eq!(cache.len(), 0);
    }
}

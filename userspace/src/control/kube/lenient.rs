//! [`Lenient`]: a Kubernetes object that always deserializes.
//!
//! kube-rs parses a whole list response (and every watch event) into the
//! watched type. With `Pod` itself, one object the agent cannot parse (a field
//! of an unexpected type, from a newer API server or a buggy admission hook)
//! would fail the whole list, and the watcher would retry that list forever:
//! one bad pod would blind the agent to every other pod on its node.
//! `Lenient<K>` parses each object on its own instead: a malformed one is
//! kept as an error carrying whatever identity could be read from it, so the
//! source can log it by name and skip it while the rest flows on.

use std::{borrow::Cow, fmt};

use ::kube::Resource;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer, de::DeserializeOwned};
use serde_json::Value;

/// A `K` as the API server sent it, or why it could not be parsed.
#[derive(Clone, Debug)]
pub struct Lenient<K> {
    /// The object's metadata: `K`'s when parsed, else the fields that could
    /// be read one by one (name, namespace, uid, resourceVersion), so the
    /// watcher can still track resource versions and the log can name it.
    meta: ObjectMeta,
    parsed: Result<K, Malformed>,
}

/// Why an object could not be parsed as its type.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Malformed(pub String);

impl<K> Lenient<K> {
    /// The parsed object, or why it is malformed.
    pub fn parsed(&self) -> Result<&K, &Malformed> {
        self.parsed.as_ref()
    }

    /// The metadata (see the field's docs), without needing `K: Resource`.
    pub fn metadata(&self) -> &ObjectMeta {
        &self.meta
    }

    /// `namespace/name` as far as it could be read, for logs.
    pub fn display_name(&self) -> String {
        let name = self.meta.name.as_deref().unwrap_or("<no name>");
        match &self.meta.namespace {
            Some(ns) => format!("{ns}/{name}"),
            None => name.to_owned(),
        }
    }
}

impl<K: Resource> Lenient<K> {
    /// Wraps a parsed object (tests, and objects built in memory).
    pub fn new(object: K) -> Self {
        Self {
            meta: object.meta().clone(),
            parsed: Ok(object),
        }
    }
}

impl<'de, K> Deserialize<'de> for Lenient<K>
where
    K: Resource + DeserializeOwned,
{
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        // Anything that is JSON at all is accepted here; only broken JSON
        // (which kube-rs reports as a stream error) fails.
        let value = Value::deserialize(deserializer)?;
        match serde_json::from_value::<K>(value.clone()) {
            Ok(object) => Ok(Self::new(object)),
            Err(error) => Ok(Self {
                meta: salvage_meta(&value),
                parsed: Err(Malformed(error.to_string())),
            }),
        }
    }
}

/// The identity fields of an object whose metadata as a whole may not parse.
fn salvage_meta(value: &Value) -> ObjectMeta {
    let text = |pointer: &str| {
        value
            .pointer(pointer)
            .and_then(Value::as_str)
            .map(str::to_owned)
    };
    ObjectMeta {
        name: text("/metadata/name"),
        namespace: text("/metadata/namespace"),
        uid: text("/metadata/uid"),
        resource_version: text("/metadata/resourceVersion"),
        ..ObjectMeta::default()
    }
}

impl<K: Resource<DynamicType = ()>> Resource for Lenient<K> {
    type DynamicType = ();
    type Scope = K::Scope;

    fn kind(dt: &()) -> Cow<'_, str> {
        K::kind(dt)
    }

    fn group(dt: &()) -> Cow<'_, str> {
        K::group(dt)
    }

    fn version(dt: &()) -> Cow<'_, str> {
        K::version(dt)
    }

    fn plural(dt: &()) -> Cow<'_, str> {
        K::plural(dt)
    }

    fn meta(&self) -> &ObjectMeta {
        &self.meta
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.meta
    }
}

impl<K> fmt::Display for Lenient<K> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.display_name())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use k8s_openapi::api::core::v1::Pod;

    #[test]
    fn a_malformed_pod_in_a_list_does_not_fail_the_others() {
        let list = serde_json::json!([
            {"metadata": {"name": "good", "namespace": "default", "resourceVersion": "3"},
             "spec": {"containers": [{"name": "c"}], "nodeName": "node-a"}},
            {"metadata": {"name": "bad", "namespace": "default", "uid": "u-1", "resourceVersion": "4"},
             "spec": {"containers": "not a list"}},
        ]);
        let pods: Vec<Lenient<Pod>> = serde_json::from_value(list).expect("always parses");
        assert_eq!(pods.len(), 2);
        let good = pods[0].parsed().expect("valid pod");
        assert_eq!(good.metadata.name.as_deref(), Some("good"));
        let bad = pods[1].parsed().expect_err("malformed");
        assert!(bad.0.contains("invalid type"), "{bad}");
        assert_eq!(pods[1].display_name(), "default/bad");
        assert_eq!(pods[1].meta().resource_version.as_deref(), Some("4"));
        assert_eq!(pods[1].meta().uid.as_deref(), Some("u-1"));
    }

    #[test]
    fn broken_metadata_still_yields_the_name() {
        let value = serde_json::json!({
            "metadata": {"name": "odd", "namespace": "ns", "labels": 7},
            "spec": {"containers": []}
        });
        let pod: Lenient<Pod> = serde_json::from_value(value).expect("always parses");
        assert!(pod.parsed().is_err());
        assert_eq!(pod.to_string(), "ns/odd");
        assert_eq!(Lenient::<Pod>::plural(&()), "pods");
        assert_eq!(
            Lenient::<Pod>::url_path(&(), Some("ns")),
            "/api/v1/namespaces/ns/pods"
        );
    }
}

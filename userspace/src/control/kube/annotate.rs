//! The `ambient.istio.io/redirection` status annotation.
//!
//! After each reconcile the source compares, for every pod of this node, the
//! annotation the pod carries with what the agent did with it, and patches
//! only the pods that differ: `enabled` once redirection is in place,
//! `pending` while the pod wants the mesh but is not redirected yet, removed
//! when it is not in the mesh. A JSON merge patch touching only that key,
//! sent to the pod's `status` subresource as istio-cni sends it: both
//! `pods` and `pods/status` may change a pod's metadata, but `pods/status`
//! cannot change its spec, so the agent's RBAC grants `patch` on
//! `pods/status` only.

use std::collections::HashMap;

use ::kube::{
    Api,
    api::{Patch, PatchParams},
};
use k8s_openapi::api::core::v1::Pod;
use serde_json::{Value, json};

use super::{lenient::Lenient, pod::REDIRECTION_ANNOTATION};
use crate::state::{PodState, WorkloadKey};

/// The annotation's value once the pod's traffic is redirected.
pub const ENABLED: &str = "enabled";
/// The annotation's value while the pod wants the mesh but is not redirected.
pub const PENDING: &str = "pending";

/// The annotation value a pod in `state` should carry (`None`: no annotation).
pub fn desired(state: &PodState) -> Option<&'static str> {
    match state {
        PodState::Enrolled => Some(ENABLED),
        PodState::Pending(_) | PodState::Error(_) => Some(PENDING),
        PodState::NotInMesh => None,
    }
}

/// The merge patch that sets (or, with `None`, removes) the annotation.
pub fn merge_patch(value: Option<&str>) -> Value {
    json!({ "metadata": { "annotations": { REDIRECTION_ANNOTATION: value } } })
}

/// Sends the patch (to `pods/NAME/status`).
pub async fn patch(
    api: &Api<Lenient<Pod>>,
    pod: &WorkloadKey,
    value: Option<&str>,
) -> Result<(), ::kube::Error> {
    let api = Api::<Lenient<Pod>>::namespaced(api.clone().into_client(), &pod.namespace);
    api.patch_status(
        &pod.name,
        &PatchParams::default(),
        &Patch::Merge(merge_patch(value)),
    )
    .await
    .map(drop)
}

/// What was last patched per pod: the value sent and the pod's resource
/// version when it was sent. Until the watch delivers the patched pod (a
/// newer resource version), the cache still shows the old annotation; this
/// keeps the source from sending the same patch again meanwhile.
#[derive(Default)]
pub(crate) struct Sent {
    by_pod: HashMap<WorkloadKey, (Option<&'static str>, String)>,
}

impl Sent {
    /// Whether `value` must be sent to `pod`, which currently carries
    /// `current` at `resource_version`.
    pub(crate) fn needed(
        &self,
        pod: &WorkloadKey,
        current: Option<&str>,
        value: Option<&'static str>,
        resource_version: &str,
    ) -> bool {
        if current == value {
            return false;
        }
        self.by_pod
            .get(pod)
            .is_none_or(|(sent, at)| *sent != value || at != resource_version)
    }

    pub(crate) fn record(
        &mut self,
        pod: WorkloadKey,
        value: Option<&'static str>,
        resource_version: String,
    ) {
        self.by_pod.insert(pod, (value, resource_version));
    }

    /// Forgets pods for which `keep` is false (gone from the node).
    pub(crate) fn retain(&mut self, keep: impl Fn(&WorkloadKey) -> bool) {
        self.by_pod.retain(|pod, _| keep(pod));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn desired_follows_the_pod_state() {
        assert_eq!(desired(&PodState::Enrolled), Some("enabled"));
        assert_eq!(
            desired(&PodState::Pending("no netns".into())),
            Some("pending")
        );
        assert_eq!(desired(&PodState::Error("boom".into())), Some("pending"));
        assert_eq!(desired(&PodState::NotInMesh), None);
    }

    #[test]
    fn merge_patch_sets_or_removes_only_the_annotation() {
        assert_eq!(
            merge_patch(Some("enabled")),
            json!({"metadata": {"annotations": {"ambient.istio.io/redirection": "enabled"}}})
        );
        assert_eq!(
            merge_patch(None),
            json!({"metadata": {"annotations": {"ambient.istio.io/redirection": null}}})
        );
    }

    #[test]
    fn a_patch_is_not_repeated_until_the_watch_catches_up() {
        let pod = WorkloadKey::new("default", "a");
        let mut sent = Sent::default();
        assert!(!sent.needed(&pod, Some("enabled"), Some("enabled"), "5"));
        assert!(sent.needed(&pod, None, Some("enabled"), "5"));
        sent.record(pod.clone(), Some("enabled"), "5".into());
        assert!(!sent.needed(&pod, None, Some("enabled"), "5"), "in flight");
        assert!(
            sent.needed(&pod, None, Some("pending"), "5"),
            "a different value"
        );
        assert!(
            sent.needed(&pod, None, Some("enabled"), "9"),
            "the pod changed since and still lacks it (someone removed it)"
        );
        sent.retain(|_| false);
        assert!(sent.needed(&pod, None, Some("enabled"), "5"));
    }
}

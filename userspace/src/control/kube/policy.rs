//! Istio `AuthorizationPolicy` objects (`security.istio.io/v1`) from the
//! Kubernetes API, for cluster discovery's [`ClusterView`](crate::control::ClusterView).
//!
//! A cluster-wide kube-rs watcher (list, then watch; the same backoff,
//! relist and last-complete-view rules as the pod and service watches)
//! feeds a cache of translated policies. Each object is translated by
//! [`crd::translate`], the code the workloads file uses, so both sources
//! mean the same thing by the same YAML:
//!
//! - a bad object (unknown field, invalid CIDR, empty selector, unknown
//!   action…) is named in an error line (`namespace/name`, the field, what
//!   is wrong and what takes its place) and replaced by its fail-closed
//!   stand-in ([`PolicyError::stand_in`](crate::authz::crd::PolicyError::stand_in));
//!   the other policies apply;
//! - what a node proxy cannot enforce (L7 parts, AUDIT, CUSTOM,
//!   `targetRef(s)`) gets one warning line per object version.
//!
//! Istio may not be installed: while the API server answers 404 (the CRD is
//! not served) the agent runs without Kubernetes policies, says so once, and
//! kube-rs keeps retrying the list with its backoff (0.8 s doubling up to
//! 30 s); once the CRD appears the policies apply. A 403 (a ClusterRole
//! without `authorizationpolicies`) is said once likewise. Neither ever
//! holds back readiness or the workload and service discovery.

use std::{borrow::Cow, convert::Infallible, sync::Arc};

use ::kube::{Client, Resource};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::{Deserialize, Deserializer, de::Error as _};
use serde_json::Value;
use tracing::{error, info, warn};

use super::{
    SourceStats,
    optional_crd::{OptionalCrd, OptionalCrdWatch},
};
use crate::authz::{
    Policy,
    crd::{self, Translated},
};

/// The API group, version and resource (plural) watched. The manifest test
/// (`xtask/tests/deploy_manifests.rs`) reads `GROUP` and `PLURAL` to check
/// the ClusterRole grants them.
pub const GROUP: &str = "security.istio.io";
pub const VERSION: &str = "v1";
pub const PLURAL: &str = "authorizationpolicies";

/// Namespace of an object without one (never, from the API server).
const DEFAULT_NAMESPACE: &str = "default";

/// An `AuthorizationPolicy` as the API server sent it: its metadata (for
/// the watcher's resource versions and for naming it) and the whole object,
/// which [`crd::translate`] reads. Not parsed further here: a field the
/// translation does not know must be reported by it, with its path.
#[derive(Clone, Debug)]
pub struct AuthorizationPolicyObject {
    metadata: ObjectMeta,
    object: Value,
}

impl<'de> Deserialize<'de> for AuthorizationPolicyObject {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let object = Value::deserialize(deserializer)?;
        let metadata = match object.get("metadata") {
            Some(meta) => ObjectMeta::deserialize(meta).map_err(D::Error::custom)?,
            None => return Err(D::Error::missing_field("metadata")),
        };
        Ok(Self { metadata, object })
    }
}

impl Resource for AuthorizationPolicyObject {
    type DynamicType = ();
    type Scope = k8s_openapi::NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        crd::KIND.into()
    }

    fn group(_: &()) -> Cow<'_, str> {
        GROUP.into()
    }

    fn version(_: &()) -> Cow<'_, str> {
        VERSION.into()
    }

    fn plural(_: &()) -> Cow<'_, str> {
        PLURAL.into()
    }

    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }

    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

/// Translates one object for the cache: the policy to apply (the stand-in
/// of a bad one), `None` for one a node proxy does not enforce. Logs what
/// needs saying.
pub(crate) fn translate(object: &AuthorizationPolicyObject) -> Option<Policy> {
    let mut value = object.object.clone();
    // Items of a list may come without kind and apiVersion: they are the
    // watched resource's.
    if let Some(fields) = value.as_object_mut() {
        fields
            .entry("apiVersion")
            .or_insert_with(|| Value::from(format!("{GROUP}/{VERSION}")));
        fields
            .entry("kind")
            .or_insert_with(|| Value::from(crd::KIND));
    }
    let value = match serde_yaml::to_value(&value) {
        Ok(value) => value,
        // JSON always converts; be safe anyway (fail closed as for any bad
        // object: with no readable action, nothing is known to allow).
        Err(e) => {
            error!(policy = %name_of(object), error = %e, "AuthorizationPolicy cannot be read; ignored");
            return None;
        }
    };
    match crd::translate(&value, DEFAULT_NAMESPACE) {
        Ok(Translated::Policy { policy, notes }) => {
            if !notes.is_empty() {
                warn!(policy = %policy.key(), "AuthorizationPolicy {}: {}", policy.key(), notes.join("; "));
            }
            Some(policy)
        }
        Ok(Translated::Skipped { policy, reason }) => {
            info!(%policy, "AuthorizationPolicy {policy}: not enforced: {reason}");
            None
        }
        Err(e) => {
            error!(policy = %e.policy, field = %e.field, "{e}; the policy is ignored and {}", e.instead());
            e.stand_in.map(|p| *p)
        }
    }
}

fn name_of(object: &AuthorizationPolicyObject) -> String {
    format!(
        "{}/{}",
        object
            .metadata
            .namespace
            .as_deref()
            .unwrap_or(DEFAULT_NAMESPACE),
        object.metadata.name.as_deref().unwrap_or("(no name)")
    )
}

/// The `AuthorizationPolicy` CRD, for [`OptionalCrdWatch`].
static CRD: OptionalCrd = OptionalCrd {
    resource: "authorizationpolicies.security.istio.io",
    crd: "AuthorizationPolicy CRD (security.istio.io/v1)",
    without: "Kubernetes authorization policies",
    served: "Kubernetes authorization policies apply",
    watch: "authorizationpolicies",
    cache: "authorizationpolicy",
};

/// The `AuthorizationPolicy` watch of cluster discovery.
pub(crate) type PolicyWatch = OptionalCrdWatch<AuthorizationPolicyObject, Policy, Infallible>;

impl PolicyWatch {
    pub(crate) fn new(client: &Client, stats: Arc<SourceStats>) -> Self {
        Self::watch(&CRD, client, stats, |object| Ok(translate(object)))
    }

    /// The policies to apply: none while the CRD is not served.
    pub(crate) fn policies(&self) -> Vec<Policy> {
        self.values()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::authz::{Action, Scope};
    use serde_json::json;

    fn object(value: Value) -> AuthorizationPolicyObject {
        serde_json::from_value(value).expect("an object with metadata")
    }

    #[test]
    fn the_crd_is_named_as_rbac_grants_it() {
        assert_eq!(CRD.resource, format!("{PLURAL}.{GROUP}"));
        assert_eq!(
            CRD.crd,
            format!("AuthorizationPolicy CRD ({GROUP}/{VERSION})")
        );
    }

    #[test]
    fn a_listed_object_without_kind_translates_like_the_file() {
        let listed = object(json!({
            "metadata": {"name": "allow-client", "namespace": "shop", "uid": "u",
                          "resourceVersion": "7", "generation": 1,
                          "creationTimestamp": "2026-12-01T00:00:00Z",
                          "annotations": {"kubectl.kubernetes.io/last-applied-configuration": "{}"}},
            "spec": {"selector": {"matchLabels": {"app": "web"}},
                     "rules": [{"from": [{"source": {"principals": ["cluster.local/ns/shop/sa/client"]}}]}]},
        }));
        let policy = translate(&listed).expect("an enforced policy");
        assert_eq!(
            (policy.namespace.as_str(), policy.name.as_str()),
            ("shop", "allow-client")
        );
        assert_eq!(
            (policy.action, policy.scope, policy.rules.len()),
            (Action::Allow, Scope::WorkloadSelector, 1)
        );
        assert_eq!(
            AuthorizationPolicyObject::url_path(&(), Some("shop")),
            "/apis/security.istio.io/v1/namespaces/shop/authorizationpolicies"
        );
    }

    #[test]
    fn a_bad_object_becomes_its_stand_in_and_audit_is_skipped() {
        let bad = object(json!({
            "apiVersion": "security.istio.io/v1", "kind": "AuthorizationPolicy",
            "metadata": {"name": "bad", "namespace": "shop"},
            "spec": {"action": "DENY", "rules": [{"from": [{"source": {"ipBlocks": ["10.0.0.0/99"]}}]}]},
        }));
        let stand_in = translate(&bad).expect("a stand-in");
        assert_eq!(
            (stand_in.action, stand_in.scope, stand_in.rules.len()),
            (Action::Deny, Scope::Namespace, 1),
            "a broken DENY denies all in its namespace"
        );
        let audit = object(json!({
            "metadata": {"name": "audit", "namespace": "shop"},
            "spec": {"action": "AUDIT"},
        }));
        assert_eq!(translate(&audit), None);
    }
}

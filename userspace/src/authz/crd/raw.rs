//! The `AuthorizationPolicy` object as the API server and `kubectl apply`
//! give it: serde's view, strict (`deny_unknown_fields`) so that a typo is
//! named, never ignored. [`super`] translates it into the model.

use std::collections::BTreeMap;

use serde::{Deserialize, de::IgnoredAny};

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawPolicy {
    pub(super) api_version: String,
    pub(super) kind: String,
    pub(super) metadata: RawMeta,
    #[serde(default)]
    pub(super) spec: RawSpec,
    /// Written by istiod; ignored.
    #[serde(default)]
    #[allow(dead_code)]
    pub(super) status: Option<IgnoredAny>,
}

/// Kubernetes' `ObjectMeta`: every field is known; only the name, the
/// namespace and the dry-run annotation matter here.
#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
#[allow(dead_code)]
pub(super) struct RawMeta {
    pub(super) name: String,
    #[serde(default)]
    pub(super) namespace: Option<String>,
    #[serde(default)]
    pub(super) labels: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub(super) annotations: Option<BTreeMap<String, String>>,
    #[serde(default)]
    pub(super) uid: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) resource_version: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) generation: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) generate_name: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) creation_timestamp: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) deletion_timestamp: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) deletion_grace_period_seconds: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) finalizers: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) owner_references: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) managed_fields: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) self_link: Option<IgnoredAny>,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawSpec {
    #[serde(default)]
    pub(super) selector: Option<RawSelector>,
    #[serde(default)]
    pub(super) target_ref: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) target_refs: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) action: Option<String>,
    /// CUSTOM's ext-authz provider.
    #[serde(default)]
    #[allow(dead_code)]
    pub(super) provider: Option<IgnoredAny>,
    #[serde(default)]
    pub(super) rules: Option<Vec<RawRule>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawSelector {
    #[serde(default)]
    pub(super) match_labels: Option<BTreeMap<String, String>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawRule {
    #[serde(default)]
    pub(super) from: Option<Vec<RawFrom>>,
    #[serde(default)]
    pub(super) to: Option<Vec<RawTo>>,
    #[serde(default)]
    pub(super) when: Option<Vec<RawCondition>>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawFrom {
    #[serde(default)]
    pub(super) source: RawSource,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawSource {
    #[serde(default)]
    pub(super) principals: Vec<String>,
    #[serde(default)]
    pub(super) not_principals: Vec<String>,
    #[serde(default)]
    pub(super) request_principals: Vec<String>,
    #[serde(default)]
    pub(super) not_request_principals: Vec<String>,
    #[serde(default)]
    pub(super) namespaces: Vec<String>,
    #[serde(default)]
    pub(super) not_namespaces: Vec<String>,
    #[serde(default)]
    pub(super) service_accounts: Vec<String>,
    #[serde(default)]
    pub(super) not_service_accounts: Vec<String>,
    #[serde(default)]
    pub(super) ip_blocks: Vec<String>,
    #[serde(default)]
    pub(super) not_ip_blocks: Vec<String>,
    #[serde(default)]
    pub(super) remote_ip_blocks: Vec<String>,
    #[serde(default)]
    pub(super) not_remote_ip_blocks: Vec<String>,
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawTo {
    #[serde(default)]
    pub(super) operation: RawOperation,
}

#[derive(Default, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawOperation {
    #[serde(default)]
    pub(super) hosts: Vec<String>,
    #[serde(default)]
    pub(super) not_hosts: Vec<String>,
    #[serde(default)]
    pub(super) ports: Vec<RawPort>,
    #[serde(default)]
    pub(super) not_ports: Vec<RawPort>,
    #[serde(default)]
    pub(super) methods: Vec<String>,
    #[serde(default)]
    pub(super) not_methods: Vec<String>,
    #[serde(default)]
    pub(super) paths: Vec<String>,
    #[serde(default)]
    pub(super) not_paths: Vec<String>,
}

/// The CRD's ports are strings (`"8080"`); a bare number is accepted too.
#[derive(Clone, Deserialize)]
#[serde(untagged)]
pub(super) enum RawPort {
    Number(u64),
    Text(String),
}

impl RawPort {
    pub(super) fn show(&self) -> String {
        match self {
            Self::Number(n) => n.to_string(),
            Self::Text(s) => format!("{s:?}"),
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields, rename_all = "camelCase")]
pub(super) struct RawCondition {
    pub(super) key: String,
    #[serde(default)]
    pub(super) values: Vec<String>,
    #[serde(default)]
    pub(super) not_values: Vec<String>,
}

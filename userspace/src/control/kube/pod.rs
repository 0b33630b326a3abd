//! From Kubernetes objects to the agent's model: Istio's enrolment rule and
//! the few facts of a pod or namespace the agent keeps.
//!
//! Objects are reduced to these facts as they arrive, so the watch caches
//! hold a few hundred bytes per pod instead of whole `Pod`s, and a problem in
//! an object (no name, an IP that does not parse) is logged once, when it
//! arrives, not at every reconcile.

use std::{collections::BTreeMap, net::IpAddr};

use k8s_openapi::api::core::v1::{Namespace, Pod};
use tracing::warn;

use super::enablement::Enablement;

use crate::state::{
    DEFAULT_SERVICE_ACCOUNT, DNS_CAPTURE_ANNOTATION, DataplaneMode, FAST_PATH_ANNOTATION,
    SPLICE_ANNOTATION, Workload, WorkloadKey,
};

/// The label that puts a pod (or every pod of a namespace) in the mesh.
pub const DATAPLANE_MODE_LABEL: &str = "istio.io/dataplane-mode";
/// The annotation that tells users (and Istio's tooling) whether a pod's
/// traffic is redirected: `enabled` or `pending`; absent when not in the mesh.
pub const REDIRECTION_ANNOTATION: &str = "ambient.istio.io/redirection";
/// Present on pods that run an Istio sidecar: those are never captured here
/// (their sidecar already captures them), as in Istio.
pub const SIDECAR_STATUS_ANNOTATION: &str = "sidecar.istio.io/status";

/// What the agent needs to know about one pod.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PodFacts {
    pub key: WorkloadKey,
    /// Finds the pod's processes (cgroup paths contain it) and its netns.
    pub uid: String,
    pub resource_version: String,
    pub has_sidecar: bool,
    pub host_network: bool,
    pub service_account: String,
    pub ips: Vec<IpAddr>,
    pub node: String,
    /// Phase `Succeeded` or `Failed`: no container will run again, nothing
    /// to capture.
    pub finished: bool,
    /// Has a deletion timestamp: still running while it drains.
    pub terminating: bool,
    /// The current value of [`REDIRECTION_ANNOTATION`].
    pub redirection: Option<String>,
    /// [`SPLICE_ANNOTATION`]: `on` or `off`.
    pub splice: Option<bool>,
    /// [`FAST_PATH_ANNOTATION`]: `on` or `off`.
    pub fast_path: Option<bool>,
    /// [`DNS_CAPTURE_ANNOTATION`]: `"true"` or `"false"`.
    pub dns_capture: Option<bool>,
    /// The pod's labels (authorization policies select pods by them).
    pub labels: BTreeMap<String, String>,
    /// What owns the pod, from its controller reference
    /// ([`crate::state::pod_owner`]).
    pub owner: (crate::state::WorkloadType, String),
    /// `spec.hostname` and `spec.subdomain` (DNS pod records).
    pub pod_hostname: String,
    pub pod_subdomain: String,
}

/// What the agent needs to know about one namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceFacts {
    pub name: String,
    /// The namespace's labels (enablement selectors' `namespaceSelector`).
    pub labels: BTreeMap<String, String>,
    /// The namespace's [`FAST_PATH_ANNOTATION`]: `off` keeps every pod of
    /// the namespace on the proxy path.
    pub fast_path: Option<bool>,
    /// The namespace's waypoint labels (`istio.io/use-waypoint` and
    /// friends, [`crate::control::waypoint::LABELS`]).
    pub waypoint_labels: BTreeMap<String, String>,
}

/// Why an object was skipped.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FactsError {
    #[error("it has no {0}")]
    Missing(&'static str),
}

impl PodFacts {
    /// Extracts the facts of `pod`. An IP that does not parse is logged and
    /// left out (the pod still counts, with its other IPs).
    pub fn from_pod(pod: &Pod) -> Result<Self, FactsError> {
        let meta = &pod.metadata;
        let name = meta.name.clone().ok_or(FactsError::Missing("name"))?;
        let namespace = meta
            .namespace
            .clone()
            .ok_or(FactsError::Missing("namespace"))?;
        let key = WorkloadKey::new(namespace, name);
        let uid = meta.uid.clone().ok_or(FactsError::Missing("uid"))?;
        let spec = pod.spec.as_ref();
        let status = pod.status.as_ref();
        // status.podIPs lists every family; status.podIP is its first entry
        // and the only one older API servers fill in.
        let mut raw_ips: Vec<&str> = status
            .and_then(|s| s.pod_ips.as_ref())
            .map(|ips| ips.iter().map(|ip| ip.ip.as_str()).collect())
            .unwrap_or_default();
        if raw_ips.is_empty()
            && let Some(ip) = status.and_then(|s| s.pod_ip.as_deref())
        {
            raw_ips.push(ip);
        }
        let mut ips = Vec::with_capacity(raw_ips.len());
        for raw in raw_ips {
            match raw.parse::<IpAddr>() {
                Ok(ip) if !ips.contains(&ip) => ips.push(ip),
                Ok(_) => {}
                Err(_) => warn!(pod = %key, ip = raw, "pod IP does not parse; ignoring it"),
            }
        }
        let annotations = meta.annotations.as_ref();
        let controller = meta
            .owner_references
            .as_ref()
            .and_then(|refs| refs.iter().find(|r| r.controller == Some(true)))
            .map(|r| (r.kind.as_str(), r.name.as_str()));
        let owner = crate::state::pod_owner(
            &key.name,
            controller,
            meta.labels
                .as_ref()
                .and_then(|l| l.get("pod-template-hash"))
                .map(String::as_str),
        );
        Ok(Self {
            owner,
            pod_hostname: spec.and_then(|s| s.hostname.clone()).unwrap_or_default(),
            pod_subdomain: spec.and_then(|s| s.subdomain.clone()).unwrap_or_default(),
            uid,
            resource_version: meta.resource_version.clone().unwrap_or_default(),
            labels: meta.labels.clone().unwrap_or_default(),
            has_sidecar: annotations.is_some_and(|a| a.contains_key(SIDECAR_STATUS_ANNOTATION)),
            host_network: spec.and_then(|s| s.host_network).unwrap_or(false),
            service_account: spec
                .and_then(|s| s.service_account_name.clone())
                .filter(|sa| !sa.is_empty())
                .unwrap_or_else(|| DEFAULT_SERVICE_ACCOUNT.to_owned()),
            ips,
            node: spec.and_then(|s| s.node_name.clone()).unwrap_or_default(),
            finished: matches!(
                status.and_then(|s| s.phase.as_deref()),
                Some("Succeeded" | "Failed")
            ),
            terminating: meta.deletion_timestamp.is_some(),
            redirection: annotations.and_then(|a| a.get(REDIRECTION_ANNOTATION).cloned()),
            fast_path: on_off(annotations, FAST_PATH_ANNOTATION, &key.to_string()),
            dns_capture: true_false(annotations, DNS_CAPTURE_ANNOTATION, &key.to_string()),
            splice: match annotations.and_then(|a| a.get(SPLICE_ANNOTATION)) {
                None => None,
                Some(value) if value == "on" => Some(true),
                Some(value) if value == "off" => Some(false),
                Some(value) => {
                    warn!(pod = %key, annotation = SPLICE_ANNOTATION, value = %value, "unknown value (expected on or off); ignored, the agent's --splice decides");
                    None
                }
            },
            key,
        })
    }

    /// Istio's enrolment rule, as istio-cni applies it: an enablement
    /// selector matches the pod and its namespace's labels (by default the
    /// `istio.io/dataplane-mode` rule), the namespace is not excluded, and
    /// the pod neither shares the node's network nor runs a sidecar. A
    /// finished pod has no traffic left to capture. `namespace` is `None`
    /// when the namespace is not (yet) known: it has no labels then.
    pub fn dataplane_mode(
        &self,
        namespace: Option<&NamespaceFacts>,
        enablement: &Enablement,
    ) -> DataplaneMode {
        let no_labels = BTreeMap::new();
        let ns_labels = namespace.map_or(&no_labels, |ns| &ns.labels);
        if enablement.selects(&self.labels, ns_labels)
            && !enablement.excludes(&self.key.namespace)
            && !self.host_network
            && !self.has_sidecar
            && !self.finished
        {
            DataplaneMode::Ambient
        } else {
            DataplaneMode::None
        }
    }

    /// The pod as the agent's model sees it; the netns is filled in by
    /// discovery, for this node's mesh pods only.
    pub fn to_workload(
        &self,
        namespace: Option<&NamespaceFacts>,
        enablement: &Enablement,
    ) -> Workload {
        Workload {
            name: self.key.name.clone(),
            namespace: self.key.namespace.clone(),
            service_account: self.service_account.clone(),
            ips: self.ips.clone(),
            node: self.node.clone(),
            netns: None,
            dataplane_mode: self.dataplane_mode(namespace, enablement),
            splice: self.splice,
            // Off on either the pod or its namespace keeps the pod on the
            // proxy path.
            fast_path: match (self.fast_path, namespace.and_then(|ns| ns.fast_path)) {
                (Some(false), _) | (_, Some(false)) => Some(false),
                (pod, namespace) => pod.or(namespace),
            },
            dns_capture: self.dns_capture,
            labels: self.labels.clone(),
            workload_type: self.owner.0,
            workload_name: self.owner.1.clone(),
            pod_hostname: self.pod_hostname.clone(),
            pod_subdomain: self.pod_subdomain.clone(),
            ..Default::default()
        }
    }
}

impl NamespaceFacts {
    pub fn from_namespace(namespace: &Namespace) -> Result<Self, FactsError> {
        Ok(Self {
            name: namespace
                .metadata
                .name
                .clone()
                .ok_or(FactsError::Missing("name"))?,
            labels: namespace.metadata.labels.clone().unwrap_or_default(),
            fast_path: on_off(
                namespace.metadata.annotations.as_ref(),
                FAST_PATH_ANNOTATION,
                namespace.metadata.name.as_deref().unwrap_or_default(),
            ),
            waypoint_labels: namespace
                .metadata
                .labels
                .as_ref()
                .map(crate::control::waypoint::binding_labels)
                .unwrap_or_default(),
        })
    }
}

/// An `on`/`off` annotation; any other value is logged and ignored (the
/// agent's flag decides).
fn on_off(
    annotations: Option<&BTreeMap<String, String>>,
    annotation: &str,
    object: &str,
) -> Option<bool> {
    match annotations
        .and_then(|a| a.get(annotation))
        .map(String::as_str)
    {
        None => None,
        Some("on") => Some(true),
        Some("off") => Some(false),
        Some(value) => {
            warn!(
                object,
                annotation, value, "unknown value (expected on or off); ignored"
            );
            None
        }
    }
}

/// A `"true"`/`"false"` annotation (Istio's own, e.g.
/// [`DNS_CAPTURE_ANNOTATION`]); any other value is logged and ignored (the
/// agent's flag decides).
fn true_false(
    annotations: Option<&BTreeMap<String, String>>,
    annotation: &str,
    object: &str,
) -> Option<bool> {
    match annotations
        .and_then(|a| a.get(annotation))
        .map(String::as_str)
    {
        None => None,
        Some("true") => Some(true),
        Some("false") => Some(false),
        Some(value) => {
            warn!(
                object,
                annotation, value, "unknown value (expected true or false); ignored"
            );
            None
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn pod(value: serde_json::Value) -> PodFacts {
        let pod: Pod = serde_json::from_value(value).expect("test pod parses");
        PodFacts::from_pod(&pod).expect("test pod has facts")
    }

    fn basic(labels: serde_json::Value) -> serde_json::Value {
        json!({
            "metadata": {"name": "web-0", "namespace": "prod", "uid": "1111-2222",
                          "resourceVersion": "7", "labels": labels},
            "spec": {"containers": [{"name": "app"}], "nodeName": "node-a",
                     "serviceAccountName": "web"},
            "status": {"phase": "Running", "podIP": "198.18.1.10",
                       "podIPs": [{"ip": "198.18.1.10"}, {"ip": "fd00::10"}]}
        })
    }

    fn ns(label: Option<&str>) -> NamespaceFacts {
        NamespaceFacts {
            name: "prod".into(),
            labels: label
                .map(|l| BTreeMap::from([(DATAPLANE_MODE_LABEL.to_owned(), l.to_owned())]))
                .unwrap_or_default(),
            fast_path: None,
            waypoint_labels: BTreeMap::new(),
        }
    }

    #[test]
    fn the_owner_and_dns_names_come_from_the_pod() {
        let mut value = basic(json!({"pod-template-hash": "5d8f7b9c4"}));
        value["metadata"]["ownerReferences"] = json!([
            {"apiVersion": "v1", "kind": "Node", "name": "ignored", "uid": "u0"},
            {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "ratings-v1-5d8f7b9c4",
             "uid": "u1", "controller": true}
        ]);
        value["spec"]["hostname"] = json!("db-0");
        value["spec"]["subdomain"] = json!("db");
        let w = pod(value).to_workload(None, &Enablement::default());
        assert_eq!(
            (w.workload_type.as_str(), w.workload_name.as_str()),
            ("deployment", "ratings-v1")
        );
        assert_eq!(
            (w.pod_hostname.as_str(), w.pod_subdomain.as_str()),
            ("db-0", "db")
        );
        let bare = pod(basic(json!({}))).to_workload(None, &Enablement::default());
        assert_eq!(bare.owner(), (crate::state::WorkloadType::Pod, "web-0"));
    }

    #[test]
    fn facts_of_a_running_pod() {
        let facts = pod(basic(json!({})));
        assert_eq!(facts.key, WorkloadKey::new("prod", "web-0"));
        assert_eq!(facts.uid, "1111-2222");
        assert_eq!(facts.resource_version, "7");
        assert_eq!(facts.service_account, "web");
        assert_eq!(facts.node, "node-a");
        assert_eq!(
            facts.ips,
            vec![
                "198.18.1.10".parse::<IpAddr>().expect("ip"),
                "fd00::10".parse().expect("ip")
            ]
        );
        assert!(!facts.finished && !facts.terminating && !facts.host_network);
        let w = facts.to_workload(Some(&ns(None)), &Enablement::default());
        assert_eq!(w.key(), facts.key);
        assert_eq!(w.dataplane_mode, DataplaneMode::None, "opt-in only");
        assert_eq!(w.netns, None);
    }

    #[test]
    fn labels_reach_the_workload_for_policy_selectors() {
        let facts = pod(basic(json!({"app": "web", "version": "v1"})));
        let w = facts.to_workload(None, &Enablement::default());
        assert_eq!(w.labels.get("app").map(String::as_str), Some("web"));
        assert_eq!(w.labels.get("version").map(String::as_str), Some("v1"));
        assert!(
            pod(basic(json!({})))
                .to_workload(None, &Enablement::default())
                .labels
                .is_empty()
        );
    }

    #[test]
    fn fast_path_off_on_the_pod_or_its_namespace_keeps_the_pod_on_the_proxy() {
        let annotated = |value: Option<&str>, namespace: Option<&str>| {
            let mut object = basic(json!({}));
            if let Some(value) = value {
                object["metadata"]["annotations"] = json!({ FAST_PATH_ANNOTATION: value });
            }
            let mut ns_object: Namespace =
                serde_json::from_value(json!({"metadata": {"name": "prod"}})).expect("namespace");
            if let Some(value) = namespace {
                ns_object.metadata.annotations =
                    Some([(FAST_PATH_ANNOTATION.to_string(), value.to_string())].into());
            }
            let ns = NamespaceFacts::from_namespace(&ns_object).expect("facts");
            pod(object)
                .to_workload(Some(&ns), &Enablement::default())
                .fast_path
        };
        assert_eq!(annotated(Some("off"), None), Some(false));
        assert_eq!(annotated(None, Some("off")), Some(false));
        assert_eq!(annotated(Some("on"), Some("off")), Some(false));
        assert_eq!(annotated(Some("on"), None), Some(true));
        assert_eq!(
            annotated(Some("maybe"), None),
            None,
            "unknown: --fast-path decides"
        );
        assert_eq!(annotated(None, None), None);
    }

    #[test]
    fn dns_capture_annotation_is_istios_true_or_false() {
        let annotated = |value: &str| {
            let mut object = basic(json!({}));
            object["metadata"]["annotations"] = json!({ DNS_CAPTURE_ANNOTATION: value });
            pod(object)
                .to_workload(None, &Enablement::default())
                .dns_capture
        };
        assert_eq!(annotated("false"), Some(false));
        assert_eq!(annotated("true"), Some(true));
        assert_eq!(annotated("off"), None, "unknown: --dns-capture decides");
        assert_eq!(
            pod(basic(json!({})))
                .to_workload(None, &Enablement::default())
                .dns_capture,
            None
        );
    }

    #[test]
    fn splice_annotation_is_the_pods_say() {
        let annotated = |value: &str| {
            let mut object = basic(json!({}));
            object["metadata"]["annotations"] = json!({ SPLICE_ANNOTATION: value });
            pod(object).to_workload(None, &Enablement::default()).splice
        };
        assert_eq!(annotated("off"), Some(false));
        assert_eq!(annotated("on"), Some(true));
        assert_eq!(
            annotated("maybe"),
            None,
            "unknown values leave it to --splice"
        );
        assert_eq!(
            pod(basic(json!({})))
                .to_workload(None, &Enablement::default())
                .splice,
            None
        );
    }

    #[test]
    fn istio_enrolment_rule() {
        use DataplaneMode::{Ambient, None as Off};
        let cases: [(Option<&str>, Option<&str>, DataplaneMode); 9] = [
            (Some("ambient"), None, Ambient),
            (None, Some("ambient"), Ambient),
            (Some("ambient"), Some("ambient"), Ambient),
            (Some("none"), Some("ambient"), Off),
            (Some("other"), Some("ambient"), Ambient),
            (None, None, Off),
            (None, Some("none"), Off),
            (Some("Ambient"), None, Off),
            (Some("ambient"), Some("none"), Ambient),
        ];
        for (pod_label, ns_label, want) in cases {
            let labels = match pod_label {
                Some(v) => json!({ DATAPLANE_MODE_LABEL: v }),
                None => json!({}),
            };
            let got =
                pod(basic(labels)).dataplane_mode(Some(&ns(ns_label)), &Enablement::default());
            assert_eq!(
                got, want,
                "pod label {pod_label:?}, namespace label {ns_label:?}"
            );
        }
        // An unknown namespace: only the pod's label counts.
        let labelled = pod(basic(json!({ DATAPLANE_MODE_LABEL: "ambient" })));
        assert_eq!(
            labelled.dataplane_mode(None, &Enablement::default()),
            Ambient
        );
        assert_eq!(
            pod(basic(json!({}))).dataplane_mode(None, &Enablement::default()),
            Off
        );
    }

    #[test]
    fn excluded_namespaces_and_selectors_decide_as_in_istio_cni() {
        let labelled = pod(basic(json!({ DATAPLANE_MODE_LABEL: "ambient" })));
        let excluding = Enablement::new(
            crate::control::kube::enablement::ISTIO_DEFAULT_SELECTORS,
            ["prod".to_string()],
        )
        .expect("parses");
        assert_eq!(
            labelled.dataplane_mode(Some(&ns(Some("ambient"))), &excluding),
            DataplaneMode::None,
            "an excluded namespace is never enrolled"
        );
        let by_team =
            Enablement::new("[{podSelector: {matchLabels: {team: web}}}]", []).expect("parses");
        assert_eq!(
            labelled.dataplane_mode(Some(&ns(Some("ambient"))), &by_team),
            DataplaneMode::None,
            "the labels count only through the selectors"
        );
        let team = pod(basic(json!({"team": "web"})));
        assert_eq!(team.dataplane_mode(None, &by_team), DataplaneMode::Ambient);
    }

    #[test]
    fn host_network_sidecar_and_finished_pods_never_join() {
        let mut host = basic(json!({ DATAPLANE_MODE_LABEL: "ambient" }));
        host["spec"]["hostNetwork"] = json!(true);
        assert_eq!(
            pod(host).dataplane_mode(Some(&ns(Some("ambient"))), &Enablement::default()),
            DataplaneMode::None
        );

        let mut sidecar = basic(json!({}));
        sidecar["metadata"]["annotations"] = json!({ SIDECAR_STATUS_ANNOTATION: "{}" });
        assert_eq!(
            pod(sidecar).dataplane_mode(Some(&ns(Some("ambient"))), &Enablement::default()),
            DataplaneMode::None
        );

        for phase in ["Succeeded", "Failed"] {
            let mut done = basic(json!({ DATAPLANE_MODE_LABEL: "ambient" }));
            done["status"]["phase"] = json!(phase);
            let facts = pod(done);
            assert!(facts.finished);
            assert_eq!(
                facts.dataplane_mode(None, &Enablement::default()),
                DataplaneMode::None,
                "{phase}"
            );
        }
    }

    #[test]
    fn defaults_and_odd_values() {
        let facts = pod(json!({
            "metadata": {"name": "p", "namespace": "n", "uid": "u",
                          "deletionTimestamp": "2024-01-01T00:00:00Z",
                          "annotations": { REDIRECTION_ANNOTATION: "enabled" }},
            "spec": {"containers": [], "serviceAccountName": ""},
            "status": {"podIP": "not-an-ip"}
        }));
        assert_eq!(facts.service_account, DEFAULT_SERVICE_ACCOUNT);
        assert!(facts.ips.is_empty(), "a bad IP is dropped");
        assert!(facts.terminating);
        assert_eq!(facts.redirection.as_deref(), Some("enabled"));
        // podIP is used when podIPs is absent.
        let old = pod(json!({
            "metadata": {"name": "p", "namespace": "n", "uid": "u"},
            "spec": {"containers": []},
            "status": {"podIP": "198.18.1.3"}
        }));
        assert_eq!(old.ips, vec!["198.18.1.3".parse::<IpAddr>().expect("ip")]);
    }

    #[test]
    fn objects_without_identity_are_rejected() {
        let no_uid: Pod = serde_json::from_value(json!({
            "metadata": {"name": "p", "namespace": "n"}, "spec": {"containers": []}
        }))
        .expect("parses");
        assert_eq!(PodFacts::from_pod(&no_uid), Err(FactsError::Missing("uid")));
        let no_name = Namespace::default();
        assert_eq!(
            NamespaceFacts::from_namespace(&no_name),
            Err(FactsError::Missing("name"))
        );
    }
}

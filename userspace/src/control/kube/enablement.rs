//! Which pods join the mesh: istio-cni's `ambient.enablementSelectors` and
//! `excludeNamespaces`, with istio-cni's meaning.
//!
//! A pod is enrolled when any selector matches it (its `podSelector` on the
//! pod's labels and its `namespaceSelector` on its namespace's labels; an
//! empty selector matches everything), it neither shares the node's network
//! nor runs a sidecar, and its namespace is not excluded. Istio's default
//! selectors are the `istio.io/dataplane-mode` rule: the pod labelled
//! `ambient`, or its namespace labelled `ambient` and the pod not `none`.

use std::collections::{BTreeMap, BTreeSet};

use ::kube::core::{Selector, SelectorExt as _};
use k8s_openapi::apimachinery::pkg::apis::meta::v1::LabelSelector;
use serde::Deserialize;

/// Istio's default `ambient.enablementSelectors` (istio-cni's chart), as
/// `--enablement-selectors` takes them (YAML or JSON).
pub const ISTIO_DEFAULT_SELECTORS: &str = r#"[{"podSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}},{"podSelector":{"matchExpressions":[{"key":"istio.io/dataplane-mode","operator":"NotIn","values":["none"]}]},"namespaceSelector":{"matchLabels":{"istio.io/dataplane-mode":"ambient"}}}]"#;

/// istio-cni's default `excludeNamespaces`.
pub const DEFAULT_EXCLUDED_NAMESPACES: &str = "kube-system";

/// One entry of `ambient.enablementSelectors`, as istio-cni reads it.
/// Limitation: an unknown key inside a selector (`matchLabel:`) is ignored,
/// as k8s-openapi's `LabelSelector` (and Kubernetes' own Go type) ignores it;
/// an unknown key here is refused.
#[derive(Clone, Debug, Default, Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct EnablementSelector {
    #[serde(default)]
    pub pod_selector: LabelSelector,
    #[serde(default)]
    pub namespace_selector: LabelSelector,
}

/// Why `--enablement-selectors` was refused.
#[derive(Debug, thiserror::Error)]
pub enum EnablementError {
    #[error(
        "--enablement-selectors: not a list of {{podSelector, namespaceSelector}} label selectors: {0}"
    )]
    Parse(#[source] serde_yaml::Error),
    #[error("--enablement-selectors entry {index}: its {which}: {reason}")]
    Selector {
        index: usize,
        which: &'static str,
        reason: String,
    },
}

/// The compiled rule.
#[derive(Clone, Debug)]
pub struct Enablement {
    /// (pod selector, namespace selector), any of which enrols.
    selectors: Vec<(Selector, Selector)>,
    excluded_namespaces: BTreeSet<String>,
}

impl Default for Enablement {
    /// Istio's defaults: its selectors, kube-system excluded.
    fn default() -> Self {
        Self::new(
            ISTIO_DEFAULT_SELECTORS,
            DEFAULT_EXCLUDED_NAMESPACES.split(',').map(str::to_owned),
        )
        .unwrap_or_else(|e| unreachable!("the built-in default selectors parse: {e}"))
    }
}

impl Enablement {
    /// From `--enablement-selectors` (a YAML or JSON list) and the excluded
    /// namespaces.
    pub fn new(
        selectors: &str,
        excluded_namespaces: impl IntoIterator<Item = String>,
    ) -> Result<Self, EnablementError> {
        let parsed: Vec<EnablementSelector> =
            serde_yaml::from_str(selectors).map_err(EnablementError::Parse)?;
        let mut compiled = Vec::with_capacity(parsed.len());
        for (index, selector) in parsed.into_iter().enumerate() {
            let compile = |which: &'static str, s: LabelSelector| {
                Selector::try_from(s).map_err(|e| EnablementError::Selector {
                    index,
                    which,
                    reason: e.to_string(),
                })
            };
            compiled.push((
                compile("podSelector", selector.pod_selector)?,
                compile("namespaceSelector", selector.namespace_selector)?,
            ));
        }
        Ok(Self {
            selectors: compiled,
            excluded_namespaces: excluded_namespaces
                .into_iter()
                .map(|n| n.trim().to_owned())
                .filter(|n| !n.is_empty())
                .collect(),
        })
    }

    /// Whether `namespace` is in `excludeNamespaces`: its pods are never
    /// enrolled, whatever their labels.
    pub fn excludes(&self, namespace: &str) -> bool {
        self.excluded_namespaces.contains(namespace)
    }

    /// Whether a pod with `pod_labels`, in a namespace with
    /// `namespace_labels`, is selected (exclusions and the pod's other
    /// disqualifiers are the caller's).
    pub fn selects(
        &self,
        pod_labels: &BTreeMap<String, String>,
        namespace_labels: &BTreeMap<String, String>,
    ) -> bool {
        self.selectors
            .iter()
            .any(|(pod, ns)| pod.matches(pod_labels) && ns.matches(namespace_labels))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    const MODE: &str = "istio.io/dataplane-mode";

    #[test]
    fn istios_default_selectors_are_the_dataplane_mode_rule() {
        let e = Enablement::default();
        let none = labels(&[]);
        let ambient = labels(&[(MODE, "ambient")]);
        let off = labels(&[(MODE, "none")]);
        assert!(e.selects(&ambient, &none), "pod labelled");
        assert!(e.selects(&none, &ambient), "namespace labelled");
        assert!(e.selects(&ambient, &ambient));
        assert!(!e.selects(&off, &ambient), "pod opts out");
        assert!(!e.selects(&none, &none));
        assert!(e.excludes("kube-system"));
        assert!(!e.excludes("default"));
    }

    #[test]
    fn custom_selectors_and_exclusions() {
        let e = Enablement::new(
            "- podSelector:\n    matchLabels: {team: a}\n  namespaceSelector:\n    matchExpressions:\n    - {key: env, operator: In, values: [prod]}\n",
            ["x".to_string(), " ".to_string()],
        )
        .expect("parses");
        assert!(e.selects(&labels(&[("team", "a")]), &labels(&[("env", "prod")])));
        assert!(!e.selects(&labels(&[("team", "a")]), &labels(&[("env", "dev")])));
        assert!(!e.selects(&labels(&[(MODE, "ambient")]), &labels(&[])));
        assert!(e.excludes("x"));
        assert!(!e.excludes("kube-system"));
        let empty = Enablement::new("[{}]", []).expect("parses");
        assert!(
            empty.selects(&labels(&[]), &labels(&[])),
            "{{}} selects all"
        );
    }

    #[test]
    fn bad_selectors_are_refused_with_where() {
        let err = Enablement::new("[{podSelectors: {}}]", []).expect_err("typo");
        assert!(err.to_string().contains("podSelectors"), "{err}");
        let err = Enablement::new(
            "[{}, {namespaceSelector: {matchExpressions: [{key: a, operator: Near}]}}]",
            [],
        )
        .expect_err("operator");
        assert!(
            err.to_string().contains("entry 1: its namespaceSelector"),
            "{err}"
        );
    }
}

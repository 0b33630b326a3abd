//! Whether a DaemonSet's pods may run on a node, as the scheduler decides
//! from the pod template: its `nodeSelector` and its required node
//! affinity (`--on-exit auto`, `exit.rs`).
//!
//! Limitation: taints and tolerations are not compared.

use std::collections::BTreeMap;

use k8s_openapi::api::core::v1::{
    NodeSelector, NodeSelectorRequirement, NodeSelectorTerm, PodSpec,
};

/// Whether a pod of this spec may be scheduled on the node: its
/// `nodeSelector` (every label equal) and its required node affinity (any
/// term whose requirements all hold), as the scheduler decides.
pub fn selects(spec: &PodSpec, labels: &BTreeMap<String, String>, node_name: &str) -> bool {
    let selector_holds = spec
        .node_selector
        .iter()
        .flatten()
        .all(|(key, value)| labels.get(key) == Some(value));
    let affinity = spec
        .affinity
        .as_ref()
        .and_then(|a| a.node_affinity.as_ref())
        .and_then(|a| {
            a.required_during_scheduling_ignored_during_execution
                .as_ref()
        });
    selector_holds && affinity.is_none_or(|required| any_term(required, labels, node_name))
}

/// The terms are ORed; an empty list (or a term without requirements)
/// matches no node, as in Kubernetes.
fn any_term(selector: &NodeSelector, labels: &BTreeMap<String, String>, node_name: &str) -> bool {
    selector
        .node_selector_terms
        .iter()
        .any(|term| term_holds(term, labels, node_name))
}

fn term_holds(term: &NodeSelectorTerm, labels: &BTreeMap<String, String>, node_name: &str) -> bool {
    let expressions = term.match_expressions.as_deref().unwrap_or_default();
    let fields = term.match_fields.as_deref().unwrap_or_default();
    if expressions.is_empty() && fields.is_empty() {
        return false;
    }
    let name_fields: BTreeMap<String, String> =
        BTreeMap::from([("metadata.name".to_string(), node_name.to_string())]);
    expressions.iter().all(|r| requirement_holds(r, labels))
        && fields.iter().all(|r| {
            // Only `metadata.name` is a node field the API accepts here.
            r.key == "metadata.name" && requirement_holds(r, &name_fields)
        })
}

fn requirement_holds(req: &NodeSelectorRequirement, labels: &BTreeMap<String, String>) -> bool {
    let values = req.values.as_deref().unwrap_or_default();
    let value = labels.get(&req.key);
    match req.operator.as_str() {
        "In" => value.is_some_and(|v| values.contains(v)),
        "NotIn" => value.is_none_or(|v| !values.contains(v)),
        "Exists" => value.is_some(),
        "DoesNotExist" => value.is_none(),
        // One integer value; a label that is not an integer fails.
        "Gt" | "Lt" => {
            let (Some(label), [bound]) = (value.and_then(|v| v.parse::<i64>().ok()), values) else {
                return false;
            };
            let Ok(bound) = bound.parse::<i64>() else {
                return false;
            };
            if req.operator == "Gt" {
                label > bound
            } else {
                label < bound
            }
        }
        // An operator the API server would have refused: matches nothing.
        _ => false,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn spec(value: serde_json::Value) -> PodSpec {
        serde_json::from_value(value).expect("a pod spec")
    }

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    #[test]
    fn a_spec_without_constraints_selects_every_node() {
        assert!(selects(
            &spec(json!({"containers": []})),
            &labels(&[]),
            "n1"
        ));
    }

    #[test]
    fn the_node_selector_needs_every_label() {
        let s = spec(json!({"containers": [], "nodeSelector": {"mesh": "on", "zone": "a"}}));
        assert!(selects(
            &s,
            &labels(&[("mesh", "on"), ("zone", "a"), ("x", "y")]),
            "n1"
        ));
        assert!(!selects(&s, &labels(&[("mesh", "on")]), "n1"));
        assert!(!selects(
            &s,
            &labels(&[("mesh", "off"), ("zone", "a")]),
            "n1"
        ));
    }

    #[test]
    fn required_affinity_terms_are_ored_and_their_requirements_anded() {
        let s = spec(json!({"containers": [], "affinity": {"nodeAffinity": {
        "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [
            {"matchExpressions": [
                {"key": "mesh", "operator": "In", "values": ["on"]},
                {"key": "cordoned", "operator": "DoesNotExist"}]},
            {"matchFields": [{"key": "metadata.name", "operator": "In", "values": ["special"]}]}
        ]}}}}));
        assert!(selects(&s, &labels(&[("mesh", "on")]), "n1"));
        assert!(!selects(
            &s,
            &labels(&[("mesh", "on"), ("cordoned", "")]),
            "n1"
        ));
        assert!(!selects(&s, &labels(&[("mesh", "off")]), "n1"));
        assert!(selects(&s, &labels(&[]), "special"));
    }

    #[test]
    fn operators_match_as_in_kubernetes() {
        let req = |op: &str, values: &[&str]| NodeSelectorRequirement {
            key: "gen".into(),
            operator: op.into(),
            values: Some(values.iter().map(|v| v.to_string()).collect()),
        };
        let three = labels(&[("gen", "3")]);
        let none = labels(&[]);
        assert!(requirement_holds(&req("Gt", &["2"]), &three));
        assert!(!requirement_holds(&req("Gt", &["3"]), &three));
        assert!(requirement_holds(&req("Lt", &["4"]), &three));
        assert!(!requirement_holds(&req("Lt", &["4"]), &none));
        assert!(requirement_holds(&req("NotIn", &["1"]), &three));
        assert!(requirement_holds(&req("NotIn", &["1"]), &none));
        assert!(!requirement_holds(&req("NotIn", &["3"]), &three));
        assert!(requirement_holds(&req("Exists", &[]), &three));
        assert!(!requirement_holds(&req("Exists", &[]), &none));
        assert!(!requirement_holds(&req("Bogus", &[]), &three));
    }

    #[test]
    fn an_empty_term_matches_no_node() {
        let s = spec(json!({"containers": [], "affinity": {"nodeAffinity": {
            "requiredDuringSchedulingIgnoredDuringExecution": {"nodeSelectorTerms": [{}]}}}}));
        assert!(!selects(&s, &labels(&[("a", "b")]), "n1"));
    }
}

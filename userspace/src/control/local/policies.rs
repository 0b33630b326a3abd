//! `authorizationPolicies:` of the workloads file: `security.istio.io/v1`
//! `AuthorizationPolicy` objects, exactly as `kubectl apply` takes them,
//! translated by [`crate::authz::crd`].
//!
//! Unlike the rest of the file, a bad policy does not reject the file: one
//! broken policy must not stop the others (nor the workloads) from applying.
//! It is reported like any problem of the file (file, entry, field), and
//! replaced by the fail-closed stand-in of
//! [`PolicyError::stand_in`](crate::authz::crd::PolicyError::stand_in).

use std::path::Path;

use super::{Entry, Problem};
use crate::authz::{
    Policy,
    crd::{self, Translated},
};

/// Namespace of an object without `metadata.namespace`, as `kubectl apply`.
const DEFAULT_NAMESPACE: &str = "default";

/// What the file's policies need said, beyond the policies themselves.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Findings {
    /// Bad entries; each replaced by its stand-in (named in the message).
    pub problems: Vec<Problem>,
    /// Policies (or rules) the node proxy enforces differently from
    /// written, or not at all (L7 parts, AUDIT, CUSTOM, targetRefs): one
    /// line per policy.
    pub notes: Vec<(Entry, String)>,
}

impl Findings {
    /// Logs each problem as an error and each note as a warning, the file
    /// named first as in every message about it.
    pub fn log(&self, path: &Path) {
        for problem in &self.problems {
            tracing::error!("{}: {problem}", path.display());
        }
        for (entry, note) in &self.notes {
            tracing::warn!("{}: {entry}: {note}", path.display());
        }
    }
}

/// Translates every entry; returns the policies to apply (stand-ins
/// included) and what to report.
pub(super) fn check(raw: Vec<serde_yaml::Value>) -> (Vec<Policy>, Findings) {
    let mut policies = Vec::with_capacity(raw.len());
    let mut findings = Findings::default();
    for (index, object) in raw.iter().enumerate() {
        let meta = object.get("metadata");
        let get = |key| meta.and_then(|m| m.get(key)).and_then(|v| v.as_str());
        let entry = Entry::new(
            "authorizationPolicies",
            index,
            Some(get("namespace").unwrap_or(DEFAULT_NAMESPACE)),
            get("name"),
        );
        match crd::translate(object, DEFAULT_NAMESPACE) {
            Ok(Translated::Policy { policy, notes }) => {
                if !notes.is_empty() {
                    findings.notes.push((entry, notes.join("; ")));
                }
                policies.push(policy);
            }
            Ok(Translated::Skipped { reason, .. }) => {
                findings
                    .notes
                    .push((entry, format!("not enforced: {reason}")));
            }
            Err(e) => {
                let instead = e.instead();
                findings.problems.push(Problem {
                    entry: Some(entry),
                    field: Some(e.field.clone()),
                    message: format!("{}; the policy is ignored and {instead}", e.message),
                    location: None,
                });
                policies.extend(e.stand_in.map(|p| *p));
            }
        }
    }
    (policies, findings)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use crate::{
        authz::{Action, PolicyKey, Scope},
        control::local::parse,
    };

    const WORKLOADS: &str = "
workloads:
  - name: server
    namespace: default
    serviceAccount: server
    ips: [198.18.2.3]
    node: node-a
    labels: {app: server, version: v1}
";

    #[test]
    fn policies_and_labels_from_the_file() {
        let text = format!(
            "{WORKLOADS}authorizationPolicies:
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: allow-client, namespace: default}}
    spec:
      selector: {{matchLabels: {{app: server}}}}
      rules: [{{from: [{{source: {{principals: [cluster.local/ns/default/sa/client]}}}}]}}]
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: no-get, namespace: default}}
    spec:
      action: DENY
      rules: [{{to: [{{operation: {{methods: [GET], ports: ['8080']}}}}]}}]
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: audit}}
    spec: {{action: AUDIT}}
"
        );
        let local = parse(Path::new("w.yaml"), &text).expect("valid");
        assert_eq!(
            local.workloads[0].labels.get("app").map(String::as_str),
            Some("server")
        );
        let keys: Vec<PolicyKey> = local.policies.iter().map(|p| p.key()).collect();
        assert_eq!(
            keys,
            [
                PolicyKey::new("default", "allow-client"),
                PolicyKey::new("default", "no-get")
            ]
        );
        assert!(local.policy_findings.problems.is_empty());
        let notes: Vec<String> = local
            .policy_findings
            .notes
            .iter()
            .map(|(e, n)| format!("{e}: {n}"))
            .collect();
        assert_eq!(notes.len(), 2, "{notes:?}");
        assert!(
            notes[0].starts_with("authorizationPolicies[1] (default/no-get): spec.rules[0]")
                && notes[0].contains("applied without them"),
            "{notes:?}"
        );
        assert!(
            notes[1].starts_with("authorizationPolicies[2] (default/audit): not enforced"),
            "{notes:?}"
        );
    }

    #[test]
    fn a_bad_policy_is_reported_and_replaced_the_others_apply() {
        let text = format!(
            "{WORKLOADS}authorizationPolicies:
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: good, namespace: default}}
    spec: {{action: DENY, rules: [{{to: [{{operation: {{ports: ['22']}}}}]}}]}}
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: typo, namespace: default}}
    spec:
      selector: {{matchLabels: {{app: server}}}}
      rules: [{{from: [{{source: {{principal: [x]}}}}]}}]
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: bad-cidr, namespace: prod}}
    spec: {{action: DENY, rules: [{{from: [{{source: {{ipBlocks: [198.18.0.0/40]}}}}]}}]}}
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: empty-selector, namespace: default}}
    spec: {{selector: {{matchLabels: {{}}}}}}
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: what, namespace: default}}
    spec: {{action: ALLOWED}}
"
        );
        let local = parse(Path::new("w.yaml"), &text).expect("bad policies do not reject the file");
        let problems: Vec<String> = local
            .policy_findings
            .problems
            .iter()
            .map(ToString::to_string)
            .collect();
        assert_eq!(problems.len(), 4, "{problems:#?}");
        for (problem, want) in problems.iter().zip([
            "authorizationPolicies[1] (default/typo): field `spec.rules[0].from[0].source.principal`: unknown field",
            "authorizationPolicies[2] (prod/bad-cidr): field `spec.rules[0].from[0].source.ipBlocks[0]`: \"198.18.0.0/40\"",
            "authorizationPolicies[3] (default/empty-selector): field `spec.selector.matchLabels`: empty",
            "authorizationPolicies[4] (default/what): field `spec.action`: unknown action \"ALLOWED\"",
        ]) {
            assert!(problem.starts_with(want), "{problem}\nwanted: {want}");
        }
        assert!(
            problems[0].ends_with("an ALLOW policy with no rule (allows nothing) takes its place for the workloads labelled app=server"),
            "{}",
            problems[0]
        );
        assert!(
            problems[1].ends_with(
                "a DENY-all policy takes its place for every workload of namespace prod"
            ),
            "{}",
            problems[1]
        );
        let applied: Vec<(String, Action, Scope, usize)> = local
            .policies
            .iter()
            .map(|p| (p.name.clone(), p.action, p.scope, p.rules.len()))
            .collect();
        assert_eq!(
            applied,
            [
                ("good".into(), Action::Deny, Scope::Namespace, 1),
                ("typo".into(), Action::Allow, Scope::WorkloadSelector, 0),
                ("bad-cidr".into(), Action::Deny, Scope::Namespace, 1),
                ("empty-selector".into(), Action::Allow, Scope::Namespace, 0),
                ("what".into(), Action::Deny, Scope::Namespace, 1),
            ]
        );
    }

    #[test]
    fn labels_must_be_strings() {
        let text = "
workloads:
  - name: server
    namespace: default
    serviceAccount: server
    ips: [198.18.2.3]
    node: node-a
    labels: {app: [x]}
";
        let err = parse(Path::new("w.yaml"), text).expect_err("a list is no label value");
        assert!(
            err.to_string()
                .contains("workloads[0] (default/server): field `labels.app`")
                || err
                    .to_string()
                    .contains("workloads[0] (default/server): field `labels`"),
            "{err}"
        );
    }
}

//! `security.istio.io/v1` `AuthorizationPolicy` objects (as `kubectl apply`
//! takes them) translated into the [model](super::model), the way istiod
//! translates them for ztunnel:
//!
//! - scope: no selector in the root namespace → [`Scope::Global`]; no
//!   selector → [`Scope::Namespace`]; a selector →
//!   [`Scope::WorkloadSelector`] (with its labels);
//! - `spec: {}` (or no rule) is an ALLOW policy with no rule: it allows
//!   nothing to the workloads of its scope; `rules: [{}]` allows all;
//! - what a node proxy cannot see (L7: `hosts`, `methods`, `paths`, request
//!   principals, `remoteIpBlocks`, `when` keys other than `source.ip`,
//!   `source.namespace`, `source.principal`, `destination.ip`,
//!   `destination.port`): an ALLOW rule needing it matches nothing; a DENY
//!   rule is applied without it, exactly as istiod sends it: a `to`/`from`
//!   entry or `when` condition left with no L4 attribute becomes an empty
//!   match, which matches nothing (ztunnel skips it), so such a DENY rule
//!   denies *less* than written, not more (istiod's "more restrictive"
//!   warning notwithstanding; see docs/authz.md); each policy so
//!   translated carries a note, for one log line;
//! - `AUDIT`, `CUSTOM` and `targetRef(s)` policies are for other
//!   enforcement points (waypoints, ext-authz): skipped, with the reason.
//!
//! Bad input (an unknown field, an invalid CIDR or port, an empty selector,
//! an unknown action, a wrong kind) is a [`PolicyError`] naming the policy
//! and the field. The policy is then not applied as written, but its place
//! is taken by a fail-closed stand-in for the same scope (see
//! [`PolicyError::stand_in`] for which and why).

use std::collections::BTreeMap;

mod raw;

use raw::{RawCondition, RawOperation, RawPolicy, RawPort, RawRule, RawSource};

use super::{
    ROOT_NAMESPACE,
    model::{Action, Cidr, Clause, Match, Policy, Rule, Scope, ServiceAccount, StringMatch},
};

/// The API versions whose `AuthorizationPolicy` has this schema.
pub const API_VERSIONS: [&str; 2] = ["security.istio.io/v1", "security.istio.io/v1beta1"];
pub const KIND: &str = "AuthorizationPolicy";
/// The annotation that makes a policy dry-run (logged, not enforced).
pub const DRY_RUN_ANNOTATION: &str = "istio.io/dry-run";

/// The `when` keys istiod translates for ztunnel; any other is L7.
const L4_WHEN_KEYS: [&str; 5] = [
    "source.ip",
    "source.namespace",
    "source.principal",
    "destination.ip",
    "destination.port",
];

/// A policy translated.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Translated {
    /// Enforced by the node proxy. `notes` say what it could not see and
    /// how that was handled (empty when the policy is pure L4).
    Policy { policy: Policy, notes: Vec<String> },
    /// Not for a node proxy; why.
    Skipped { policy: String, reason: String },
}

/// A policy that cannot be used as written.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("AuthorizationPolicy {policy}: field `{field}`: {message}")]
pub struct PolicyError {
    /// `namespace/name`, as far as the object says.
    pub policy: String,
    /// Where, as a path into the object (`spec.rules[0].from[0].source.ipBlocks[1]`).
    pub field: String,
    pub message: String,
    /// What is applied instead, so that a broken policy fails closed:
    ///
    /// - an ALLOW policy (or one without `action`, which means ALLOW)
    ///   becomes an ALLOW policy with no rule for the same scope: its
    ///   workloads accept only what other, valid ALLOW policies allow.
    ///   That is exactly "this policy matches nothing" — what istiod does
    ///   with an ALLOW rule it cannot translate — so the breakage never
    ///   opens anything, and never takes away what the valid policies
    ///   grant;
    /// - a DENY policy, or one whose action is unreadable, becomes a
    ///   DENY-all for the same scope: what a broken DENY meant to deny is
    ///   unknown, and denying everything is the only stand-in sure to cover
    ///   it (an outage the operator sees in the log, rather than a hole);
    /// - `AUDIT` and `CUSTOM` are not enforced by a node proxy: `None`.
    ///
    /// The scope is the policy's own when its selector is readable; with a
    /// broken or empty selector it becomes the policy's namespace (a
    /// superset of what it could have selected there). In the root
    /// namespace, where a selector picks workloads of every namespace, a
    /// broken selector confines the stand-in to the root namespace's own
    /// workloads: a broken policy never becomes a mesh-wide deny unless it
    /// was written mesh-wide (no selector in the root namespace).
    pub stand_in: Option<Box<Policy>>,
}

impl PolicyError {
    /// What takes the broken policy's place, in words, for the line that
    /// reports it (every source says it the same way).
    pub fn instead(&self) -> String {
        match self.stand_in.as_deref() {
            Some(p) if p.action == Action::Allow => format!(
                "an ALLOW policy with no rule (allows nothing) takes its place for {}",
                scope_in_words(p)
            ),
            Some(p) => format!(
                "a DENY-all policy takes its place for {}",
                scope_in_words(p)
            ),
            None => "nothing takes its place (a node proxy does not enforce its action)".into(),
        }
    }
}

/// The workloads a policy's scope covers, in words.
fn scope_in_words(p: &Policy) -> String {
    match (&p.scope, &p.selector) {
        (Scope::Global, _) => "every workload of the mesh".into(),
        (Scope::WorkloadSelector, Some(labels)) => {
            let labels: Vec<String> = labels.iter().map(|(k, v)| format!("{k}={v}")).collect();
            format!("the workloads labelled {}", labels.join(","))
        }
        _ => format!("every workload of namespace {}", p.namespace),
    }
}

/// Translates one object; `default_namespace` is the namespace of an
/// object without `metadata.namespace` (`default`, as `kubectl apply`).
pub fn translate(
    object: &serde_yaml::Value,
    default_namespace: &str,
) -> Result<Translated, PolicyError> {
    let peek = Peek::of(object, default_namespace);
    let raw: RawPolicy = serde_path_to_error::deserialize(object).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner().to_string();
        peek.error(&path, inner)
    })?;
    Translator { peek: &peek }.policy(raw)
}

/// What can be read of an object even when it does not parse: enough to
/// name it and to build its stand-in.
struct Peek {
    name: String,
    namespace: String,
    action: Option<String>,
    selector: Option<BTreeMap<String, String>>,
    /// `spec.selector` is there, readable or not.
    has_selector: bool,
    dry_run: bool,
}

impl Peek {
    fn of(object: &serde_yaml::Value, default_namespace: &str) -> Self {
        let text = |v: Option<&serde_yaml::Value>| v.and_then(|v| v.as_str()).map(str::to_owned);
        let meta = object.get("metadata");
        let spec = object.get("spec");
        let selector = spec
            .and_then(|s| s.get("selector"))
            .and_then(|s| s.get("matchLabels"))
            .and_then(|l| serde_yaml::from_value::<BTreeMap<String, String>>(l.clone()).ok())
            .filter(|l| !l.is_empty());
        let dry_run = meta
            .and_then(|m| m.get("annotations"))
            .and_then(|a| a.get(DRY_RUN_ANNOTATION))
            .and_then(|v| v.as_str())
            == Some("true");
        Self {
            name: text(meta.and_then(|m| m.get("name"))).unwrap_or_else(|| "(no name)".into()),
            namespace: text(meta.and_then(|m| m.get("namespace")))
                .filter(|ns| !ns.is_empty())
                .unwrap_or_else(|| default_namespace.to_owned()),
            action: text(spec.and_then(|s| s.get("action"))),
            selector,
            has_selector: spec.and_then(|s| s.get("selector")).is_some(),
            dry_run,
        }
    }

    fn label(&self) -> String {
        format!("{}/{}", self.namespace, self.name)
    }

    fn error(&self, field: &str, message: String) -> PolicyError {
        let field = if field.is_empty() || field == "." {
            "(the object)".to_owned()
        } else {
            field.to_owned()
        };
        PolicyError {
            policy: self.label(),
            field,
            message,
            stand_in: self.stand_in().map(Box::new),
        }
    }

    /// See [`PolicyError::stand_in`].
    fn stand_in(&self) -> Option<Policy> {
        let (action, rules) = match self.action.as_deref() {
            None | Some("ALLOW") => (Action::Allow, vec![]),
            Some("AUDIT" | "CUSTOM") => return None,
            Some(_) => (Action::Deny, vec![Rule::default()]),
        };
        let (scope, selector) = match &self.selector {
            Some(labels) => (Scope::WorkloadSelector, Some(labels.clone())),
            // Written mesh-wide: its own scope.
            None if self.namespace == ROOT_NAMESPACE && !self.has_selector => (Scope::Global, None),
            // A selector that cannot be read: its namespace's workloads.
            // In the root namespace that is the root namespace's own, never
            // the whole mesh (what a broken policy meant to select is
            // unknown, and a mesh-wide outage is not its own scope).
            None => (Scope::Namespace, None),
        };
        Some(Policy {
            name: self.name.clone(),
            namespace: self.namespace.clone(),
            scope,
            action,
            rules,
            dry_run: self.dry_run,
            selector,
        })
    }
}

struct Translator<'a> {
    peek: &'a Peek,
}

impl Translator<'_> {
    fn policy(&self, raw: RawPolicy) -> Result<Translated, PolicyError> {
        let err = |field: &str, message: String| Err(self.peek.error(field, message));
        if !API_VERSIONS.contains(&raw.api_version.as_str()) {
            return err(
                "apiVersion",
                format!(
                    "{:?} is not one of {}",
                    raw.api_version,
                    API_VERSIONS.join(", ")
                ),
            );
        }
        if raw.kind != KIND {
            return err("kind", format!("{:?} is not {KIND}", raw.kind));
        }
        if raw.metadata.name.is_empty() {
            return err("metadata.name", "must not be empty".into());
        }
        let spec = raw.spec;
        let action = match spec.action.as_deref() {
            None | Some("ALLOW") => Action::Allow,
            Some("DENY") => Action::Deny,
            Some(other @ ("AUDIT" | "CUSTOM")) => {
                return Ok(Translated::Skipped {
                    policy: self.peek.label(),
                    reason: format!("action {other} is not enforced by a node proxy"),
                });
            }
            Some(other) => {
                return err(
                    "spec.action",
                    format!("unknown action {other:?}; expected ALLOW, DENY, AUDIT or CUSTOM"),
                );
            }
        };
        let (scope, selector) = match spec.selector {
            None if self.peek.namespace == ROOT_NAMESPACE => (Scope::Global, None),
            None => (Scope::Namespace, None),
            Some(selector) => match selector.match_labels {
                Some(labels) if !labels.is_empty() => (Scope::WorkloadSelector, Some(labels)),
                _ => {
                    return err(
                        "spec.selector.matchLabels",
                        "empty: a selector must name at least one label (omit `selector` to \
                         apply the policy to its whole namespace)"
                            .into(),
                    );
                }
            },
        };
        if spec.target_ref.is_some() || spec.target_refs.is_some() {
            return Ok(Translated::Skipped {
                policy: self.peek.label(),
                reason: "a policy with targetRef(s) is enforced by the waypoint or gateway it \
                         names, not by a node proxy"
                    .into(),
            });
        }
        let mut notes = Vec::new();
        let mut rules = Vec::new();
        for (i, rule) in spec.rules.unwrap_or_default().into_iter().enumerate() {
            let at = format!("spec.rules[{i}]");
            if let Some(rule) = self.rule(action, &at, rule, &mut notes)? {
                rules.push(rule);
            }
        }
        Ok(Translated::Policy {
            policy: Policy {
                name: raw.metadata.name,
                namespace: self.peek.namespace.clone(),
                scope,
                action,
                rules,
                dry_run: self.peek.dry_run,
                selector,
            },
            notes,
        })
    }

    /// One rule; `None` for an ALLOW rule that needs L7 attributes (it
    /// matches nothing, so it is left out).
    fn rule(
        &self,
        action: Action,
        at: &str,
        raw: RawRule,
        notes: &mut Vec<String>,
    ) -> Result<Option<Rule>, PolicyError> {
        // Checked in full first: a rule dropped for L7 may still be invalid.
        let mut l7: Vec<String> = Vec::new();
        let mut clauses = Vec::new();
        if let Some(to) = raw.to {
            let mut matches = Vec::new();
            for (j, to) in to.into_iter().enumerate() {
                let at = format!("{at}.to[{j}].operation");
                matches.push(self.operation(&at, to.operation, &mut l7)?);
            }
            clauses.push(Clause { matches });
        }
        if let Some(from) = raw.from {
            let mut matches = Vec::new();
            for (j, from) in from.into_iter().enumerate() {
                let at = format!("{at}.from[{j}].source");
                matches.push(self.source(&at, from.source, &mut l7)?);
            }
            clauses.push(Clause { matches });
        }
        for (j, when) in raw.when.unwrap_or_default().into_iter().enumerate() {
            let at = format!("{at}.when[{j}]");
            let m = self.condition(&at, when, &mut l7)?;
            clauses.push(Clause { matches: vec![m] });
        }
        if l7.is_empty() {
            return Ok(Some(Rule { clauses }));
        }
        let what = l7.join(", ");
        Ok(match action {
            Action::Allow => {
                notes.push(format!(
                    "{at} needs attributes a node proxy cannot see ({what}): this ALLOW rule matches nothing"
                ));
                None
            }
            Action::Deny => {
                notes.push(format!(
                    "{at} needs attributes a node proxy cannot see ({what}): this DENY rule is applied without them, and an entry left with no L4 attribute matches nothing (as ztunnel reads istiod's translation)"
                ));
                Some(Rule { clauses })
            }
        })
    }

    fn operation(
        &self,
        at: &str,
        op: RawOperation,
        l7: &mut Vec<String>,
    ) -> Result<Match, PolicyError> {
        for (name, values) in [
            ("hosts", &op.hosts),
            ("notHosts", &op.not_hosts),
            ("methods", &op.methods),
            ("notMethods", &op.not_methods),
            ("paths", &op.paths),
            ("notPaths", &op.not_paths),
        ] {
            if !values.is_empty() {
                l7.push(format!("{at}.{name}"));
            }
        }
        Ok(Match {
            destination_ports: self.ports(&format!("{at}.ports"), &op.ports)?,
            not_destination_ports: self.ports(&format!("{at}.notPorts"), &op.not_ports)?,
            ..Default::default()
        })
    }

    fn source(&self, at: &str, src: RawSource, l7: &mut Vec<String>) -> Result<Match, PolicyError> {
        for (name, values) in [
            ("requestPrincipals", &src.request_principals),
            ("notRequestPrincipals", &src.not_request_principals),
            ("remoteIpBlocks", &src.remote_ip_blocks),
            ("notRemoteIpBlocks", &src.not_remote_ip_blocks),
        ] {
            if !values.is_empty() {
                l7.push(format!("{at}.{name}"));
            }
        }
        // Validated though never matched: Istio rejects them too.
        self.cidrs(&format!("{at}.remoteIpBlocks"), &src.remote_ip_blocks)?;
        self.cidrs(
            &format!("{at}.notRemoteIpBlocks"),
            &src.not_remote_ip_blocks,
        )?;
        let accounts = !src.service_accounts.is_empty() || !src.not_service_accounts.is_empty();
        if accounts && (!src.principals.is_empty() || !src.namespaces.is_empty()) {
            return Err(self.peek.error(
                &format!("{at}.serviceAccounts"),
                "cannot be set together with principals or namespaces".into(),
            ));
        }
        Ok(Match {
            namespaces: self.strings(&format!("{at}.namespaces"), &src.namespaces)?,
            not_namespaces: self.strings(&format!("{at}.notNamespaces"), &src.not_namespaces)?,
            service_accounts: self
                .accounts(&format!("{at}.serviceAccounts"), &src.service_accounts)?,
            not_service_accounts: self.accounts(
                &format!("{at}.notServiceAccounts"),
                &src.not_service_accounts,
            )?,
            principals: self.strings(&format!("{at}.principals"), &src.principals)?,
            not_principals: self.strings(&format!("{at}.notPrincipals"), &src.not_principals)?,
            source_ips: self.cidrs(&format!("{at}.ipBlocks"), &src.ip_blocks)?,
            not_source_ips: self.cidrs(&format!("{at}.notIpBlocks"), &src.not_ip_blocks)?,
            ..Default::default()
        })
    }

    /// A `when` condition: a match for the L4 keys, an empty one (which
    /// matches nothing) and a note for the others.
    fn condition(
        &self,
        at: &str,
        when: RawCondition,
        l7: &mut Vec<String>,
    ) -> Result<Match, PolicyError> {
        if when.values.is_empty() && when.not_values.is_empty() {
            return Err(self.peek.error(
                &format!("{at}.values"),
                "a condition needs values or notValues".into(),
            ));
        }
        let key = when.key.as_str();
        if !L4_WHEN_KEYS.contains(&key) {
            if !known_l7_key(key) {
                return Err(self.peek.error(
                    &format!("{at}.key"),
                    format!("unknown condition key {key:?}"),
                ));
            }
            l7.push(format!("{at} (key {key})"));
            // istiod sends such a condition as an empty match, which
            // ztunnel skips: the rule it is in never matches.
            return Ok(Match::default());
        }
        let (pos, neg) = (format!("{at}.values"), format!("{at}.notValues"));
        let mut m = Match::default();
        match key {
            "source.ip" => {
                m.source_ips = self.cidrs(&pos, &when.values)?;
                m.not_source_ips = self.cidrs(&neg, &when.not_values)?;
            }
            "destination.ip" => {
                m.destination_ips = self.cidrs(&pos, &when.values)?;
                m.not_destination_ips = self.cidrs(&neg, &when.not_values)?;
            }
            "destination.port" => {
                let ports = |v: &[String]| v.iter().cloned().map(RawPort::Text).collect::<Vec<_>>();
                m.destination_ports = self.ports(&pos, &ports(&when.values))?;
                m.not_destination_ports = self.ports(&neg, &ports(&when.not_values))?;
            }
            "source.namespace" => {
                m.namespaces = self.strings(&pos, &when.values)?;
                m.not_namespaces = self.strings(&neg, &when.not_values)?;
            }
            _ => {
                m.principals = self.strings(&pos, &when.values)?;
                m.not_principals = self.strings(&neg, &when.not_values)?;
            }
        }
        Ok(m)
    }

    fn strings(&self, at: &str, values: &[String]) -> Result<Vec<StringMatch>, PolicyError> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let stars = v.matches('*').count();
                let well_placed =
                    v == "*" || (stars == 1 && (v.starts_with('*') || v.ends_with('*')));
                if v.is_empty() {
                    Err(self
                        .peek
                        .error(&format!("{at}[{i}]"), "must not be empty".into()))
                } else if stars > 0 && !well_placed {
                    Err(self.peek.error(
                        &format!("{at}[{i}]"),
                        format!("{v:?}: `*` is allowed alone, or once at the start or the end"),
                    ))
                } else {
                    Ok(StringMatch::from_istio(v))
                }
            })
            .collect()
    }

    /// `namespace/account`, or a bare `account` of the policy's own
    /// namespace (as istiod reads them) → the model's service accounts,
    /// matched in any trust domain.
    fn accounts(&self, at: &str, values: &[String]) -> Result<Vec<ServiceAccount>, PolicyError> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let (ns, sa) = v
                    .split_once('/')
                    .unwrap_or((self.peek.namespace.as_str(), v.as_str()));
                if ns.is_empty() || sa.is_empty() || sa.contains('/') {
                    return Err(self.peek.error(
                        &format!("{at}[{i}]"),
                        format!("{v:?} is not `namespace/serviceaccount` or `serviceaccount`"),
                    ));
                }
                Ok(ServiceAccount::new(ns, sa))
            })
            .collect()
    }

    fn cidrs(&self, at: &str, values: &[String]) -> Result<Vec<Cidr>, PolicyError> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                v.parse::<Cidr>()
                    .map_err(|e| self.peek.error(&format!("{at}[{i}]"), e.to_string()))
            })
            .collect()
    }

    fn ports(&self, at: &str, values: &[RawPort]) -> Result<Vec<u16>, PolicyError> {
        values
            .iter()
            .enumerate()
            .map(|(i, v)| {
                let port = match v {
                    RawPort::Number(n) => u16::try_from(*n).ok(),
                    RawPort::Text(s) => s.parse::<u16>().ok(),
                };
                port.filter(|p| *p != 0).ok_or_else(|| {
                    self.peek.error(
                        &format!("{at}[{i}]"),
                        format!("{} is not a port (1 to 65535)", v.show()),
                    )
                })
            })
            .collect()
    }
}

/// Condition keys Istio accepts that a node proxy cannot check.
fn known_l7_key(key: &str) -> bool {
    const EXACT: [&str; 6] = [
        "remote.ip",
        "request.auth.principal",
        "request.auth.audiences",
        "request.auth.presenter",
        "connection.sni",
        "request.auth.claims",
    ];
    const BRACKETED: [&str; 2] = ["request.headers[", "request.auth.claims["];
    EXACT.contains(&key)
        || BRACKETED
            .iter()
            .any(|p| key.starts_with(p) && key.ends_with(']') && key.len() > p.len() + 1)
        || key.starts_with("experimental.envoy.filters.")
}

#[cfg(test)]
#[path = "crd_tests.rs"]
mod tests;

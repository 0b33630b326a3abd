//! Evaluation of Istio's L4 authorization, as ztunnel does it for a node
//! proxy.
//!
//! Which policies apply to a destination workload:
//! - [`Scope::Global`]: every workload;
//! - [`Scope::Namespace`]: the workloads of the policy's namespace;
//! - [`Scope::WorkloadSelector`]: the workloads whose labels include all of
//!   the policy's selector (in the policy's namespace, or in every namespace
//!   when the policy is in the root namespace, as Istio does), or that list
//!   the policy (`namespace/name`) in `authorization_policies` (istiod's
//!   binding, the only one xDS sends).
//!
//! The order of the decision:
//! 1. dry-run policies are evaluated and logged only;
//! 2. any matching DENY policy denies;
//! 3. no ALLOW policy applies: allowed;
//! 4. any matching ALLOW policy allows;
//! 5. otherwise denied.
//!
//! A [`PolicySet`] indexes the policies by scope and namespace, so a check
//! looks only at the global policies, those of the destination's namespace
//! (and of the root namespace's selectors) and the ones the workload names,
//! however many policies other namespaces hold. A check allocates nothing.

use std::{
    collections::{BTreeMap, HashMap},
    fmt,
    net::{IpAddr, SocketAddr},
    sync::Arc,
};

use super::{
    ROOT_NAMESPACE,
    model::{Action, Clause, Match, Policy, PolicyKey, Rule, Scope, ServiceAccount, StringMatch},
};

/// The connection a check is about, as the destination's proxy sees it.
#[derive(Clone, Copy, Debug)]
pub struct Connection<'a> {
    pub src_ip: IpAddr,
    /// The peer certificate's SPIFFE identity (with or without
    /// `spiffe://`); `None` for plaintext.
    pub src_identity: Option<&'a str>,
    /// The original destination (a local workload's address and port).
    pub dst: SocketAddr,
}

impl<'a> Connection<'a> {
    /// The identity as policies name it: without `spiffe://`.
    fn principal(&self) -> Option<&'a str> {
        self.src_identity
            .map(|id| id.strip_prefix("spiffe://").unwrap_or(id))
    }
}

/// A connection as the matches read it, parsed once per check rather than
/// once per match (the identity is split for every policy otherwise).
struct Source<'a> {
    ip: IpAddr,
    principal: Option<&'a str>,
    /// The source namespace and service account, when the identity is a
    /// Kubernetes SPIFFE id.
    account: Option<(&'a str, &'a str)>,
    dst: SocketAddr,
}

impl<'a> Source<'a> {
    fn of(connection: &Connection<'a>) -> Self {
        let principal = connection.principal();
        Self {
            ip: connection.src_ip,
            principal,
            account: principal.and_then(kubernetes_account),
            dst: connection.dst,
        }
    }

    /// Plaintext (or an identity that is not a Kubernetes one) has the
    /// empty namespace, as in ztunnel: only presence tells it apart.
    fn namespace(&self) -> &'a str {
        self.account.map_or("", |(ns, _)| ns)
    }
}

/// The namespace and service account of a Kubernetes SPIFFE id
/// (`<trust domain>/ns/<namespace>/sa/<account>`, exactly five segments,
/// as ztunnel parses one).
fn kubernetes_account(principal: &str) -> Option<(&str, &str)> {
    let mut parts = principal.split('/');
    let (_td, ns_key, ns, sa_key, sa) = (
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
        parts.next()?,
    );
    (parts.next().is_none() && ns_key == "ns" && sa_key == "sa").then_some((ns, sa))
}

/// What a check needs to know of the destination workload.
#[derive(Clone, Copy, Debug)]
pub struct Destination<'a> {
    pub namespace: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    /// Policies istiod bound to it, as `namespace/name`.
    pub authorization_policies: &'a [String],
}

impl<'a> Destination<'a> {
    pub fn of(workload: &'a crate::state::Workload) -> Self {
        Self {
            namespace: &workload.namespace,
            labels: &workload.labels,
            authorization_policies: &workload.authorization_policies,
        }
    }
}

/// The outcome of a check, naming the policy that decided (logs, metrics).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    /// No ALLOW policy applies to the destination (and no DENY matched).
    AllowedWithoutPolicy,
    /// This ALLOW policy matched.
    Allowed(PolicyKey),
    /// This DENY policy matched.
    Denied(PolicyKey),
    /// ALLOW policies apply and none matched; `first` is one of them (by
    /// key order), named so that the log points somewhere.
    NotAllowed {
        allow_policies: usize,
        first: PolicyKey,
    },
}

impl Verdict {
    pub fn is_allowed(&self) -> bool {
        matches!(self, Self::AllowedWithoutPolicy | Self::Allowed(_))
    }

    /// The policy that decided: the matching one, or for
    /// [`Verdict::NotAllowed`] the first ALLOW policy that did not match.
    pub fn policy(&self) -> Option<&PolicyKey> {
        match self {
            Self::AllowedWithoutPolicy => None,
            Self::Allowed(key) | Self::Denied(key) => Some(key),
            Self::NotAllowed { first, .. } => Some(first),
        }
    }
}

impl fmt::Display for Verdict {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::AllowedWithoutPolicy => f.write_str("allowed: no ALLOW policy applies"),
            Self::Allowed(key) => write!(f, "allowed by policy {key}"),
            Self::Denied(key) => write!(f, "denied by policy {key} (DENY matched)"),
            Self::NotAllowed {
                allow_policies,
                first,
            } => write!(
                f,
                "denied: no ALLOW policy matched ({allow_policies} apply, e.g. policy {first})"
            ),
        }
    }
}

/// Every known policy, indexed for [`PolicySet::check`]. Immutable: a
/// change builds a new set (sources send complete lists).
#[derive(Clone, Debug, Default)]
pub struct PolicySet {
    /// In key order (what listings show).
    by_key: BTreeMap<PolicyKey, Arc<Policy>>,
    /// The same by `namespace/name`, looked up without building a key.
    by_name: HashMap<String, Arc<Policy>>,
    global: Vec<Arc<Policy>>,
    /// [`Scope::Namespace`] policies by namespace.
    namespace_wide: HashMap<String, Vec<Arc<Policy>>>,
    /// [`Scope::WorkloadSelector`] policies with labels, by namespace.
    selecting: HashMap<String, Vec<Arc<Policy>>>,
}

impl PartialEq for PolicySet {
    fn eq(&self, other: &Self) -> bool {
        self.by_key == other.by_key
    }
}

impl PolicySet {
    /// Indexes `policies`. Of two with one key the later is kept (logged).
    pub fn new(policies: impl IntoIterator<Item = Policy>) -> Self {
        let mut by_key = BTreeMap::new();
        for policy in policies {
            if let Some(old) = by_key.insert(policy.key(), Arc::new(policy)) {
                tracing::warn!(policy = %old.key(), "authorization policy listed twice; keeping the last");
            }
        }
        let mut set = Self {
            by_key,
            ..Self::default()
        };
        for policy in set.by_key.values() {
            set.by_name.insert(policy.key().to_string(), policy.clone());
            match policy.scope {
                Scope::Global => set.global.push(policy.clone()),
                Scope::Namespace => set
                    .namespace_wide
                    .entry(policy.namespace.clone())
                    .or_default()
                    .push(policy.clone()),
                Scope::WorkloadSelector if policy.selector.is_some() => set
                    .selecting
                    .entry(policy.namespace.clone())
                    .or_default()
                    .push(policy.clone()),
                // Bound by name only (xDS): found through the workload.
                Scope::WorkloadSelector => {}
            }
        }
        set
    }

    pub fn len(&self) -> usize {
        self.by_key.len()
    }

    pub fn is_empty(&self) -> bool {
        self.by_key.is_empty()
    }

    pub fn get(&self, key: &PolicyKey) -> Option<&Policy> {
        self.by_key.get(key).map(|p| &**p)
    }

    /// Every policy, in key order.
    pub fn iter(&self) -> impl Iterator<Item = &Policy> {
        self.by_key.values().map(|p| &**p)
    }

    /// The policies that apply to `dst`, each once, in no set order.
    pub fn applicable<'a>(&'a self, dst: Destination<'a>) -> impl Iterator<Item = &'a Policy> + 'a {
        let picked = move |p: &&Arc<Policy>| {
            p.selector
                .as_ref()
                .is_some_and(|selector| selects(selector, dst.labels))
        };
        let own_ns = self
            .selecting
            .get(dst.namespace)
            .into_iter()
            .flatten()
            .filter(picked);
        // Root-namespace selectors apply in every namespace (once, when the
        // destination is itself in the root namespace).
        let root_ns = (dst.namespace != ROOT_NAMESPACE)
            .then(|| self.selecting.get(ROOT_NAMESPACE))
            .flatten()
            .into_iter()
            .flatten()
            .filter(picked);
        let bound = dst
            .authorization_policies
            .iter()
            .filter_map(|name| self.by_name(name))
            // Already counted when its selector picked the workload.
            .filter(move |p| {
                !(p.selector.as_ref().is_some_and(|s| selects(s, dst.labels))
                    && (p.namespace == dst.namespace || p.namespace == ROOT_NAMESPACE))
            });
        self.global
            .iter()
            .chain(self.namespace_wide.get(dst.namespace).into_iter().flatten())
            .chain(own_ns)
            .chain(root_ns)
            .chain(bound)
            .map(|p| &**p)
    }

    /// A policy by `namespace/name` (how workloads name them).
    fn by_name(&self, name: &str) -> Option<&Arc<Policy>> {
        self.by_name.get(name)
    }

    /// The keys (`namespace/name`) of the policies that apply to
    /// `workload`, sorted (status and config dumps).
    pub fn applicable_names(&self, workload: &crate::state::Workload) -> Vec<String> {
        let mut names: Vec<String> = self
            .applicable(Destination::of(workload))
            .map(|p| p.key().to_string())
            .collect();
        names.sort();
        names
    }

    /// Decides whether `connection` may reach `dst`.
    pub fn check(&self, connection: &Connection<'_>, dst: Destination<'_>) -> Verdict {
        let mut allow_policies = 0usize;
        let mut first_allow: Option<&Policy> = None;
        let mut allowed_by: Option<&Policy> = None;
        // Parsed at the first applying policy: most destinations have none.
        let mut source = None;
        for policy in self.applicable(dst) {
            let source = source.get_or_insert_with(|| Source::of(connection));
            let matched = policy.matches_source(source);
            if policy.dry_run {
                tracing::info!(
                    policy = %policy.key(),
                    action = %policy.action,
                    matched,
                    src = %connection.src_ip,
                    src.identity = connection.src_identity.unwrap_or("-"),
                    dst = %connection.dst,
                    "dry-run authorization policy (not enforced)"
                );
                continue;
            }
            match policy.action {
                Action::Deny if matched => return Verdict::Denied(policy.key()),
                Action::Deny => {}
                Action::Allow => {
                    allow_policies += 1;
                    if first_allow.is_none_or(|f| before(policy, f)) {
                        first_allow = Some(policy);
                    }
                    if matched && allowed_by.is_none_or(|a| before(policy, a)) {
                        allowed_by = Some(policy);
                    }
                }
            }
        }
        match (allowed_by, first_allow) {
            (Some(policy), _) => Verdict::Allowed(policy.key()),
            (None, None) => Verdict::AllowedWithoutPolicy,
            (None, Some(first)) => Verdict::NotAllowed {
                allow_policies,
                first: first.key(),
            },
        }
    }
}

/// Key order without building keys (the verdict names the first policy
/// by key, whatever order the index yields them in).
fn before(a: &Policy, b: &Policy) -> bool {
    (&a.namespace, &a.name) < (&b.namespace, &b.name)
}

/// Whether `labels` include every label of `selector`.
fn selects(selector: &BTreeMap<String, String>, labels: &BTreeMap<String, String>) -> bool {
    selector.iter().all(|(k, v)| labels.get(k) == Some(v))
}

impl Policy {
    /// Whether any rule matches (OR). A policy without rules matches
    /// nothing.
    pub fn matches(&self, connection: &Connection<'_>) -> bool {
        self.matches_source(&Source::of(connection))
    }

    fn matches_source(&self, source: &Source<'_>) -> bool {
        self.rules.iter().any(|rule| rule.matches(source))
    }
}

impl Rule {
    /// Whether every clause matches (AND); a rule without clauses matches
    /// everything (`rules: [{}]`).
    fn matches(&self, source: &Source<'_>) -> bool {
        self.clauses.iter().all(|clause| clause.matches(source))
    }
}

impl Clause {
    /// Whether any match matches (OR). A clause with no match imposes
    /// nothing; an empty match (`{}`) is skipped, as ztunnel does, so a
    /// clause of only `{}` matches nothing (istiod sends one for a `to` of
    /// only HTTP attributes).
    fn matches(&self, source: &Source<'_>) -> bool {
        self.matches.is_empty()
            || self
                .matches
                .iter()
                .any(|m| !m.is_empty() && m.matches(source))
    }
}

impl Match {
    /// Whether every field set matches (AND): some value of each positive
    /// field, none of each negative one. Says nothing of an empty match
    /// (see [`Clause::matches`]).
    fn matches(&self, source: &Source<'_>) -> bool {
        let namespace = Some(source.namespace());
        let dst = source.dst;
        field(&self.namespaces, &self.not_namespaces, |m: &StringMatch| {
            m.matches(namespace)
        }) && field(
            &self.service_accounts,
            &self.not_service_accounts,
            |sa: &ServiceAccount| source.account == Some((sa.namespace.as_str(), sa.name.as_str())),
        ) && field(&self.principals, &self.not_principals, |m: &StringMatch| {
            m.matches(source.principal)
        }) && field(&self.source_ips, &self.not_source_ips, |c| {
            c.contains(source.ip)
        }) && field(&self.destination_ips, &self.not_destination_ips, |c| {
            c.contains(dst.ip())
        }) && field(
            &self.destination_ports,
            &self.not_destination_ports,
            |p: &u16| *p == dst.port(),
        )
    }
}

/// One field and its negation: some of `positive` (when any is given) and
/// none of `negative`.
fn field<T>(positive: &[T], negative: &[T], matches: impl Fn(&T) -> bool) -> bool {
    (positive.is_empty() || positive.iter().any(&matches)) && !negative.iter().any(&matches)
}

#[cfg(test)]
#[path = "engine_tests.rs"]
mod tests;

//! Istio's L4 authorization model, source-independent.
//!
//! This is the shape istiod sends ztunnel as `istio.security.Authorization`
//! (`proto/istio/authorization.proto`), which is also what a
//! `security.istio.io/v1` `AuthorizationPolicy` becomes for a node proxy.
//! Every source (xDS, the Kubernetes watch, the workloads file) translates
//! into these types; the engine evaluates only these.
//!
//! Logic, as Istio defines it:
//! - a policy's [`Rule`]s are OR'd (`rules` in the proto and in the CRD);
//! - a rule's [`Clause`]s are AND'd (the CRD's `from`, `to`, `when`);
//! - a clause's [`Match`]es are OR'd (the entries of one `from` or `to` list);
//! - the fields set inside a [`Match`] are AND'd, the values inside one
//!   field OR'd, and each `not_` field must match none of its values.
//!
//! Empty parts, as ztunnel reads them: a policy with no rule matches
//! nothing; a rule with no clause and a clause with no match match
//! everything; a [`Match`] with no field set never matches (it is skipped),
//! so a clause holding only `{}` matches nothing.
//!
//! Principals are compared without the `spiffe://` prefix, as Istio does.

use std::{collections::BTreeMap, fmt, net::IpAddr, str::FromStr};

/// Identifies a policy: `namespace/name` (how workloads and logs name it).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PolicyKey {
    pub namespace: String,
    pub name: String,
}

impl PolicyKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for PolicyKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// One authorization policy.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Policy {
    pub name: String,
    pub namespace: String,
    pub scope: Scope,
    pub action: Action,
    /// OR'd. An ALLOW policy with no rule allows nothing; a DENY policy
    /// with no rule denies nothing (Istio's semantics for an empty spec
    /// are expressed by the translation, not here).
    pub rules: Vec<Rule>,
    /// Only logged, never enforced.
    pub dry_run: bool,
    /// For [`Scope::WorkloadSelector`] from the standalone sources: the
    /// labels a pod must carry (all of them). `None` from xDS, where istiod
    /// names the policies that bind a workload in the workload itself
    /// (`Workload::authorization_policies`).
    pub selector: Option<BTreeMap<String, String>>,
}

impl Policy {
    pub fn key(&self) -> PolicyKey {
        PolicyKey::new(&self.namespace, &self.name)
    }
}

/// Which workloads a policy applies to (`istio.security.Scope`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Scope {
    /// Every workload of the mesh (a policy in the root namespace without a
    /// selector).
    #[default]
    Global,
    /// Every workload of the policy's namespace.
    Namespace,
    /// The workloads its selector picks (or that istiod bound it to).
    WorkloadSelector,
}

/// What a matching policy does (`istio.security.Action`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Action {
    #[default]
    Allow,
    Deny,
}

impl fmt::Display for Action {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Allow => "ALLOW",
            Self::Deny => "DENY",
        })
    }
}

/// AND of its clauses (`istio.security.Rule`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Rule {
    pub clauses: Vec<Clause>,
}

/// OR of its matches (`istio.security.Clause`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Clause {
    pub matches: Vec<Match>,
}

/// AND of the fields that are set (`istio.security.Match`). An empty field
/// imposes nothing; a match with no field set never matches
/// ([`Match::is_empty`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Match {
    pub namespaces: Vec<StringMatch>,
    pub not_namespaces: Vec<StringMatch>,
    /// `from.source.serviceAccounts`: the peer identity's namespace and
    /// service account, in any trust domain; plaintext never matches.
    pub service_accounts: Vec<ServiceAccount>,
    pub not_service_accounts: Vec<ServiceAccount>,
    /// Compared against the peer identity without `spiffe://`.
    pub principals: Vec<StringMatch>,
    pub not_principals: Vec<StringMatch>,
    pub source_ips: Vec<Cidr>,
    pub not_source_ips: Vec<Cidr>,
    pub destination_ips: Vec<Cidr>,
    pub not_destination_ips: Vec<Cidr>,
    pub destination_ports: Vec<u16>,
    pub not_destination_ports: Vec<u16>,
}

impl Match {
    /// No field set: ztunnel skips such a match (it matches nothing), where
    /// "no condition" might suggest the opposite.
    pub fn is_empty(&self) -> bool {
        let Self {
            namespaces,
            not_namespaces,
            service_accounts,
            not_service_accounts,
            principals,
            not_principals,
            source_ips,
            not_source_ips,
            destination_ips,
            not_destination_ips,
            destination_ports,
            not_destination_ports,
        } = self;
        namespaces.is_empty()
            && not_namespaces.is_empty()
            && service_accounts.is_empty()
            && not_service_accounts.is_empty()
            && principals.is_empty()
            && not_principals.is_empty()
            && source_ips.is_empty()
            && not_source_ips.is_empty()
            && destination_ips.is_empty()
            && not_destination_ips.is_empty()
            && destination_ports.is_empty()
            && not_destination_ports.is_empty()
    }
}

/// A Kubernetes service account (`istio.security.ServiceAccountMatch`):
/// matched exactly against the `ns/<namespace>/sa/<account>` of a peer
/// identity, whatever its trust domain.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ServiceAccount {
    pub namespace: String,
    pub name: String,
}

impl ServiceAccount {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

impl fmt::Display for ServiceAccount {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// How one string value is matched (`istio.security.StringMatch`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum StringMatch {
    Exact(String),
    Prefix(String),
    Suffix(String),
    /// Any value, as long as there is one (`*` in the CRD).
    Presence,
}

impl StringMatch {
    /// Whether `value` (absent: `None`) matches.
    pub fn matches(&self, value: Option<&str>) -> bool {
        let Some(value) = value else { return false };
        match self {
            Self::Exact(s) => value == s,
            Self::Prefix(s) => value.starts_with(s.as_str()),
            Self::Suffix(s) => value.ends_with(s.as_str()),
            Self::Presence => !value.is_empty(),
        }
    }

    /// Istio's CRD notation: `*` is presence, `abc*` a prefix, `*abc` a
    /// suffix, anything else exact.
    pub fn from_istio(value: &str) -> Self {
        if value == "*" {
            Self::Presence
        } else if let Some(prefix) = value.strip_suffix('*') {
            Self::Prefix(prefix.to_owned())
        } else if let Some(suffix) = value.strip_prefix('*') {
            Self::Suffix(suffix.to_owned())
        } else {
            Self::Exact(value.to_owned())
        }
    }
}

/// An address range (`istio.security.Address`: bytes and a prefix length).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Cidr {
    addr: IpAddr,
    prefix_len: u8,
}

/// A CIDR that is not one.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{value:?} is not an IP address or CIDR: {reason}")]
pub struct InvalidCidr {
    pub value: String,
    pub reason: &'static str,
}

impl Cidr {
    /// Rejects a prefix longer than the address family allows.
    pub fn new(addr: IpAddr, prefix_len: u8) -> Result<Self, InvalidCidr> {
        let max = if addr.is_ipv4() { 32 } else { 128 };
        if prefix_len > max {
            return Err(InvalidCidr {
                value: format!("{addr}/{prefix_len}"),
                reason: "the prefix length is longer than the address",
            });
        }
        Ok(Self { addr, prefix_len })
    }

    /// One address.
    pub fn host(addr: IpAddr) -> Self {
        let prefix_len = if addr.is_ipv4() { 32 } else { 128 };
        Self { addr, prefix_len }
    }

    pub fn addr(&self) -> IpAddr {
        self.addr
    }

    pub fn prefix_len(&self) -> u8 {
        self.prefix_len
    }

    /// Whether `ip` is in the range. An IPv4-mapped IPv6 address is compared
    /// as the IPv4 address it carries; otherwise families never match.
    pub fn contains(&self, ip: IpAddr) -> bool {
        let ip = match ip {
            IpAddr::V6(v6) => v6.to_ipv4_mapped().map(IpAddr::V4).unwrap_or(ip),
            v4 => v4,
        };
        match (self.addr, ip) {
            (IpAddr::V4(net), IpAddr::V4(ip)) => {
                let mask = u32::MAX
                    .checked_shl(32 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                u32::from(net) & mask == u32::from(ip) & mask
            }
            (IpAddr::V6(net), IpAddr::V6(ip)) => {
                let mask = u128::MAX
                    .checked_shl(128 - u32::from(self.prefix_len))
                    .unwrap_or(0);
                u128::from(net) & mask == u128::from(ip) & mask
            }
            _ => false,
        }
    }
}

/// `1.2.3.4`, `1.2.3.0/24`, `2001:db8::/32`.
impl FromStr for Cidr {
    type Err = InvalidCidr;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let invalid = |reason| InvalidCidr {
            value: s.to_owned(),
            reason,
        };
        match s.split_once('/') {
            None => s
                .parse::<IpAddr>()
                .map(Self::host)
                .map_err(|_| invalid("not an IP address")),
            Some((addr, len)) => {
                let addr = addr
                    .parse::<IpAddr>()
                    .map_err(|_| invalid("the part before '/' is not an IP address"))?;
                let len = len
                    .parse::<u8>()
                    .map_err(|_| invalid("the prefix length is not a number from 0 to 128"))?;
                Self::new(addr, len).map_err(|e| invalid(e.reason))
            }
        }
    }
}

impl fmt::Display for Cidr {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.addr, self.prefix_len)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cidr_contains_by_prefix_and_family() {
        let net: Cidr = "198.18.0.0/15".parse().expect("valid");
        assert!(net.contains("198.19.255.1".parse().expect("ip")));
        assert!(!net.contains("198.20.0.1".parse().expect("ip")));
        assert!(net.contains("::ffff:198.18.0.9".parse().expect("ip")));
        assert!(!net.contains("2001:db8::1".parse().expect("ip")));
        let all: Cidr = "0.0.0.0/0".parse().expect("valid");
        assert!(all.contains("203.0.113.1".parse().expect("ip")));
        let host: Cidr = "198.18.0.1".parse().expect("valid");
        assert!(host.contains("198.18.0.1".parse().expect("ip")));
        assert!(!host.contains("198.18.0.2".parse().expect("ip")));
        let v6: Cidr = "2001:db8::/32".parse().expect("valid");
        assert!(v6.contains("2001:db8:1::1".parse().expect("ip")));
        assert!(!v6.contains("2001:db9::1".parse().expect("ip")));
    }

    #[test]
    fn cidr_errors_name_the_value() {
        for bad in ["198.18.0.0/33", "198.18.0/24", "x", "::/129", "1.2.3.4/a"] {
            let err = bad.parse::<Cidr>().expect_err(bad);
            assert!(err.to_string().contains(bad), "{err}");
        }
    }

    #[test]
    fn istio_string_notation() {
        assert_eq!(StringMatch::from_istio("*"), StringMatch::Presence);
        assert_eq!(
            StringMatch::from_istio("cluster.local/ns/*"),
            StringMatch::Prefix("cluster.local/ns/".into())
        );
        assert_eq!(
            StringMatch::from_istio("*/sa/sleep"),
            StringMatch::Suffix("/sa/sleep".into())
        );
        assert!(StringMatch::Presence.matches(Some("x")));
        assert!(!StringMatch::Presence.matches(None));
        assert!(StringMatch::Suffix("/sa/sleep".into()).matches(Some("td/ns/a/sa/sleep")));
        assert!(!StringMatch::Exact("a".into()).matches(Some("ab")));
    }
}

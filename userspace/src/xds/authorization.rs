//! `istio.security.Authorization` → [`authz::Policy`](crate::authz::Policy).
//!
//! The shapes are the same (rules, clauses, matches), so
//! this only checks values: CIDRs, ports, enum values and string matches.
//! Workload selection is istiod's: it names the policies that bind each
//! workload in `Workload::authorization_policies`, so `selector` is `None`.

use shunt_proto::istio::security as pb;

use super::{FieldError, ip_from_bytes, port};
use crate::authz::{Action, Cidr, Clause, Match, Policy, Rule, Scope, ServiceAccount, StringMatch};

pub(crate) fn translate(a: pb::Authorization) -> Result<Policy, FieldError> {
    if a.name.is_empty() {
        return Err(FieldError::new("name", "empty"));
    }
    if a.namespace.is_empty() {
        return Err(FieldError::new("namespace", "empty"));
    }
    let scope = match pb::Scope::try_from(a.scope) {
        Ok(pb::Scope::Global) => Scope::Global,
        Ok(pb::Scope::Namespace) => Scope::Namespace,
        Ok(pb::Scope::WorkloadSelector) => Scope::WorkloadSelector,
        Err(_) => {
            return Err(FieldError::new(
                "scope",
                format!("unknown value {}", a.scope),
            ));
        }
    };
    let action = match pb::Action::try_from(a.action) {
        Ok(pb::Action::Allow) => Action::Allow,
        Ok(pb::Action::Deny) => Action::Deny,
        Err(_) => {
            return Err(FieldError::new(
                "action",
                format!("unknown value {}", a.action),
            ));
        }
    };
    let mut rules = Vec::with_capacity(a.rules.len());
    for (g, rule) in a.rules.iter().enumerate() {
        let mut clauses = Vec::with_capacity(rule.clauses.len());
        for (r, clause) in rule.clauses.iter().enumerate() {
            let mut matches = Vec::with_capacity(clause.matches.len());
            for (m, one) in clause.matches.iter().enumerate() {
                let path = format!("rules[{g}].clauses[{r}].matches[{m}]");
                matches.push(translate_match(one).map_err(|e| e.under(&path))?);
            }
            clauses.push(Clause { matches });
        }
        rules.push(Rule { clauses });
    }
    Ok(Policy {
        name: a.name,
        namespace: a.namespace,
        scope,
        action,
        rules,
        dry_run: a.dry_run,
        selector: None,
    })
}

fn translate_match(m: &pb::Match) -> Result<Match, FieldError> {
    Ok(Match {
        namespaces: strings(&m.namespaces, "namespaces")?,
        not_namespaces: strings(&m.not_namespaces, "not_namespaces")?,
        service_accounts: accounts(&m.service_accounts),
        not_service_accounts: accounts(&m.not_service_accounts),
        principals: strings(&m.principals, "principals")?,
        not_principals: strings(&m.not_principals, "not_principals")?,
        source_ips: cidrs(&m.source_ips, "source_ips")?,
        not_source_ips: cidrs(&m.not_source_ips, "not_source_ips")?,
        destination_ips: cidrs(&m.destination_ips, "destination_ips")?,
        not_destination_ips: cidrs(&m.not_destination_ips, "not_destination_ips")?,
        destination_ports: ports(&m.destination_ports, "destination_ports")?,
        not_destination_ports: ports(&m.not_destination_ports, "not_destination_ports")?,
    })
}

fn strings(values: &[pb::StringMatch], field: &str) -> Result<Vec<StringMatch>, FieldError> {
    use pb::string_match::MatchType;
    values
        .iter()
        .enumerate()
        .map(|(i, v)| match &v.match_type {
            Some(MatchType::Exact(s)) => Ok(StringMatch::Exact(s.clone())),
            Some(MatchType::Prefix(s)) => Ok(StringMatch::Prefix(s.clone())),
            Some(MatchType::Suffix(s)) => Ok(StringMatch::Suffix(s.clone())),
            Some(MatchType::Presence(())) => Ok(StringMatch::Presence),
            None => Err(FieldError::new(
                format!("{field}[{i}]"),
                "no match type (exact, prefix, suffix or presence)",
            )),
        })
        .collect()
}

/// Taken as they are, as ztunnel does: an empty namespace or account
/// matches no Kubernetes identity, never everything.
fn accounts(values: &[pb::ServiceAccountMatch]) -> Vec<ServiceAccount> {
    values
        .iter()
        .map(|a| ServiceAccount::new(&a.namespace, &a.service_account))
        .collect()
}

fn cidrs(values: &[pb::Address], field: &str) -> Result<Vec<Cidr>, FieldError> {
    values
        .iter()
        .enumerate()
        .map(|(i, a)| {
            let ip = ip_from_bytes(&a.address, format!("{field}[{i}].address"))?;
            let len = u8::try_from(a.length).unwrap_or(u8::MAX);
            Cidr::new(ip, len).map_err(|e| {
                FieldError::new(
                    format!("{field}[{i}].length"),
                    format!("{}: {}", a.length, e.reason),
                )
            })
        })
        .collect()
}

fn ports(values: &[u32], field: &str) -> Result<Vec<u16>, FieldError> {
    values
        .iter()
        .enumerate()
        .map(|(i, p)| port(*p, false, format!("{field}[{i}]")))
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn exact(s: &str) -> pb::StringMatch {
        pb::StringMatch {
            match_type: Some(pb::string_match::MatchType::Exact(s.into())),
        }
    }

    fn proto() -> pb::Authorization {
        pb::Authorization {
            name: "allow-sleep".into(),
            namespace: "default".into(),
            scope: pb::Scope::WorkloadSelector as i32,
            action: pb::Action::Deny as i32,
            rules: vec![pb::Rule {
                clauses: vec![
                    pb::Clause {
                        matches: vec![pb::Match {
                            principals: vec![exact("cluster.local/ns/default/sa/sleep")],
                            source_ips: vec![pb::Address {
                                address: vec![198, 18, 0, 0],
                                length: 15,
                            }],
                            ..Default::default()
                        }],
                    },
                    pb::Clause {
                        matches: vec![pb::Match {
                            destination_ports: vec![8080],
                            not_namespaces: vec![pb::StringMatch {
                                match_type: Some(pb::string_match::MatchType::Presence(())),
                            }],
                            service_accounts: vec![pb::ServiceAccountMatch {
                                namespace: "default".into(),
                                service_account: "sleep".into(),
                            }],
                            not_service_accounts: vec![pb::ServiceAccountMatch {
                                namespace: "default".into(),
                                service_account: "curl".into(),
                            }],
                            ..Default::default()
                        }],
                    },
                ],
            }],
            dry_run: true,
            ..Default::default()
        }
    }

    #[test]
    fn every_field_lands() {
        let p = translate(proto()).expect("valid");
        assert_eq!(p.key().to_string(), "default/allow-sleep");
        assert_eq!(
            (p.scope, p.action, p.dry_run),
            (Scope::WorkloadSelector, Action::Deny, true)
        );
        assert_eq!(p.rules.len(), 1);
        let clauses = &p.rules[0].clauses;
        assert_eq!(
            clauses.len(),
            2,
            "a group's rules are the rule's AND'd clauses"
        );
        let first = &clauses[0].matches[0];
        assert_eq!(
            first.principals,
            [StringMatch::Exact(
                "cluster.local/ns/default/sa/sleep".into()
            )]
        );
        assert_eq!(
            first.source_ips,
            ["198.18.0.0/15".parse::<Cidr>().expect("cidr")]
        );
        let second = &clauses[1].matches[0];
        assert_eq!(second.destination_ports, [8080]);
        assert_eq!(second.not_namespaces, [StringMatch::Presence]);
        assert_eq!(
            second.service_accounts,
            [ServiceAccount::new("default", "sleep")]
        );
        assert_eq!(
            second.not_service_accounts,
            [ServiceAccount::new("default", "curl")]
        );
        assert_eq!(p.selector, None);
    }

    #[test]
    fn errors_name_the_field() {
        let mut p = proto();
        p.rules[0].clauses[0].matches[0].source_ips[0].length = 33;
        let err = translate(p).expect_err("prefix");
        assert_eq!(
            err.field,
            "rules[0].clauses[0].matches[0].source_ips[0].length"
        );
        let mut p = proto();
        p.rules[0].clauses[1].matches[0]
            .destination_ports
            .push(65536);
        let err = translate(p).expect_err("port");
        assert_eq!(
            err.field,
            "rules[0].clauses[1].matches[0].destination_ports[1]"
        );
        let mut p = proto();
        p.rules[0].clauses[0].matches[0]
            .principals
            .push(pb::StringMatch::default());
        let err = translate(p).expect_err("no match type");
        assert_eq!(err.field, "rules[0].clauses[0].matches[0].principals[1]");
        let mut p = proto();
        p.action = 7;
        assert_eq!(translate(p).expect_err("action").field, "action");
    }
}

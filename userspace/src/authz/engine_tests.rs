//! The engine's tables: every field and its negation, every string match,
//! the rule/clause/match logic, scopes, dry run and the decision order.

use super::*;
use crate::authz::model::Cidr;

const SLEEP: &str = "spiffe://cluster.local/ns/foo/sa/sleep";
const CURL: &str = "spiffe://cluster.local/ns/bar/sa/curl";

fn conn<'a>(src: &str, identity: Option<&'a str>, dst: &str) -> Connection<'a> {
    Connection {
        src_ip: src.parse().expect("test IP"),
        src_identity: identity,
        dst: dst.parse().expect("test address"),
    }
}

fn exact(s: &str) -> StringMatch {
    StringMatch::Exact(s.into())
}

fn cidr(s: &str) -> Cidr {
    s.parse().expect("test CIDR")
}

fn policy(ns: &str, name: &str, scope: Scope, action: Action, rules: Vec<Rule>) -> Policy {
    Policy {
        name: name.into(),
        namespace: ns.into(),
        scope,
        action,
        rules,
        dry_run: false,
        selector: None,
    }
}

/// A rule of one clause of one match.
fn rule(m: Match) -> Rule {
    Rule {
        clauses: vec![Clause { matches: vec![m] }],
    }
}

/// The rule that matches everything (`rules: [{}]`).
fn any() -> Rule {
    Rule::default()
}

#[test]
fn every_field_and_its_negation() {
    // From foo/sleep (198.18.1.2) to 198.18.2.3:8080, unless said otherwise.
    let mesh = conn("198.18.1.2", Some(SLEEP), "198.18.2.3:8080");
    let plain = conn("198.18.1.2", None, "198.18.2.3:8080");
    let bare = conn(
        "198.18.1.2",
        Some("cluster.local/ns/foo/sa/sleep"),
        "198.18.2.3:8080",
    );
    let other_td = conn(
        "198.18.1.2",
        Some("spiffe://example.org/ns/foo/sa/sleep"),
        "198.18.2.3:8080",
    );
    let sa = |ns: &str, name: &str| ServiceAccount::new(ns, name);
    let cases: Vec<(&str, Match, Connection<'_>, bool)> = vec![
        // principals, compared without spiffe://
        (
            "principal exact",
            Match {
                principals: vec![exact("cluster.local/ns/foo/sa/sleep")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "principal exact, identity given without spiffe://",
            Match {
                principals: vec![exact("cluster.local/ns/foo/sa/sleep")],
                ..Default::default()
            },
            bare,
            true,
        ),
        (
            "principal spelled with spiffe:// never matches",
            Match {
                principals: vec![exact(SLEEP)],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "principal other",
            Match {
                principals: vec![exact("cluster.local/ns/bar/sa/curl")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "principals are OR'd",
            Match {
                principals: vec![
                    exact("cluster.local/ns/bar/sa/curl"),
                    exact("cluster.local/ns/foo/sa/sleep"),
                ],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "principal prefix",
            Match {
                principals: vec![StringMatch::Prefix("cluster.local/ns/foo/".into())],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "principal prefix other",
            Match {
                principals: vec![StringMatch::Prefix("cluster.local/ns/bar/".into())],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "principal suffix",
            Match {
                principals: vec![StringMatch::Suffix("/sa/sleep".into())],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "principal suffix other",
            Match {
                principals: vec![StringMatch::Suffix("/sa/curl".into())],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "principal presence",
            Match {
                principals: vec![StringMatch::Presence],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "principal presence: plaintext has none",
            Match {
                principals: vec![StringMatch::Presence],
                ..Default::default()
            },
            plain,
            false,
        ),
        (
            "principal exact: plaintext has none",
            Match {
                principals: vec![exact("cluster.local/ns/foo/sa/sleep")],
                ..Default::default()
            },
            plain,
            false,
        ),
        (
            "notPrincipals excludes",
            Match {
                not_principals: vec![exact("cluster.local/ns/foo/sa/sleep")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notPrincipals other passes",
            Match {
                not_principals: vec![exact("cluster.local/ns/bar/sa/curl")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "notPrincipals presence excludes every mesh peer",
            Match {
                not_principals: vec![StringMatch::Presence],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notPrincipals presence passes plaintext",
            Match {
                not_principals: vec![StringMatch::Presence],
                ..Default::default()
            },
            plain,
            true,
        ),
        (
            "principals and notPrincipals together",
            Match {
                principals: vec![StringMatch::Prefix("cluster.local/ns/foo/".into())],
                not_principals: vec![StringMatch::Suffix("/sa/sleep".into())],
                ..Default::default()
            },
            mesh,
            false,
        ),
        // namespaces, from the identity's ns/<namespace>
        (
            "namespace exact",
            Match {
                namespaces: vec![exact("foo")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "namespace other",
            Match {
                namespaces: vec![exact("bar")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "namespace prefix",
            Match {
                namespaces: vec![StringMatch::Prefix("fo".into())],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "namespace suffix",
            Match {
                namespaces: vec![StringMatch::Suffix("oo".into())],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "namespace suffix other",
            Match {
                namespaces: vec![StringMatch::Suffix("ar".into())],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "namespace presence",
            Match {
                namespaces: vec![StringMatch::Presence],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "namespace: plaintext has none",
            Match {
                namespaces: vec![StringMatch::Presence],
                ..Default::default()
            },
            plain,
            false,
        ),
        (
            "notNamespaces excludes",
            Match {
                not_namespaces: vec![exact("foo")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notNamespaces other passes",
            Match {
                not_namespaces: vec![exact("bar")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "notNamespaces passes plaintext",
            Match {
                not_namespaces: vec![exact("foo")],
                ..Default::default()
            },
            plain,
            true,
        ),
        // service accounts: namespace and account of the identity
        (
            "serviceAccounts exact",
            Match {
                service_accounts: vec![sa("foo", "sleep")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "serviceAccounts without spiffe://",
            Match {
                service_accounts: vec![sa("foo", "sleep")],
                ..Default::default()
            },
            bare,
            true,
        ),
        (
            "serviceAccounts any trust domain",
            Match {
                service_accounts: vec![sa("foo", "sleep")],
                ..Default::default()
            },
            other_td,
            true,
        ),
        (
            "serviceAccounts other account",
            Match {
                service_accounts: vec![sa("foo", "curl")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "serviceAccounts same account, other namespace",
            Match {
                service_accounts: vec![sa("bar", "sleep")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "serviceAccounts OR'd",
            Match {
                service_accounts: vec![sa("bar", "x"), sa("foo", "sleep")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "serviceAccounts never plaintext",
            Match {
                service_accounts: vec![sa("foo", "sleep")],
                ..Default::default()
            },
            plain,
            false,
        ),
        (
            "notServiceAccounts excludes",
            Match {
                not_service_accounts: vec![sa("foo", "sleep")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notServiceAccounts other",
            Match {
                not_service_accounts: vec![sa("bar", "sleep")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "notServiceAccounts passes plaintext",
            Match {
                not_service_accounts: vec![sa("foo", "sleep")],
                ..Default::default()
            },
            plain,
            true,
        ),
        // source IPs
        (
            "ipBlocks CIDR",
            Match {
                source_ips: vec![cidr("198.18.1.0/24")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "ipBlocks host",
            Match {
                source_ips: vec![cidr("198.18.1.2")],
                ..Default::default()
            },
            plain,
            true,
        ),
        (
            "ipBlocks other",
            Match {
                source_ips: vec![cidr("198.18.9.0/24")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notIpBlocks excludes",
            Match {
                not_source_ips: vec![cidr("198.18.0.0/15")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notIpBlocks other passes",
            Match {
                not_source_ips: vec![cidr("198.18.9.0/24")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        // destination IPs
        (
            "destination IP",
            Match {
                destination_ips: vec![cidr("198.18.2.3")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "destination IP other",
            Match {
                destination_ips: vec![cidr("198.18.2.4")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "not destination IP",
            Match {
                not_destination_ips: vec![cidr("198.18.2.0/24")],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "not destination IP other",
            Match {
                not_destination_ips: vec![cidr("198.18.3.0/24")],
                ..Default::default()
            },
            mesh,
            true,
        ),
        // destination ports
        (
            "port",
            Match {
                destination_ports: vec![8080],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "ports OR'd",
            Match {
                destination_ports: vec![80, 8080],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "port other",
            Match {
                destination_ports: vec![9090],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notPorts excludes",
            Match {
                not_destination_ports: vec![8080],
                ..Default::default()
            },
            mesh,
            false,
        ),
        (
            "notPorts other passes",
            Match {
                not_destination_ports: vec![9090],
                ..Default::default()
            },
            mesh,
            true,
        ),
        // fields AND'd
        (
            "fields AND'd: all match",
            Match {
                principals: vec![StringMatch::Suffix("/sa/sleep".into())],
                source_ips: vec![cidr("198.18.1.0/24")],
                destination_ports: vec![8080],
                ..Default::default()
            },
            mesh,
            true,
        ),
        (
            "fields AND'd: one fails",
            Match {
                principals: vec![StringMatch::Suffix("/sa/sleep".into())],
                source_ips: vec![cidr("198.18.1.0/24")],
                destination_ports: vec![9090],
                ..Default::default()
            },
            mesh,
            false,
        ),
    ];
    let mut failures = Vec::new();
    for (name, m, c, want) in &cases {
        if m.matches(&Source::of(c)) != *want {
            failures.push(format!("{name}: expected {want}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
fn source_account_is_the_identitys_ns_and_sa_segments() {
    for (identity, account) in [
        (Some(SLEEP), Some(("foo", "sleep"))),
        (Some("cluster.local/ns/bar/sa/x"), Some(("bar", "x"))),
        (Some("spiffe://example.org/ns/ns/sa/ns"), Some(("ns", "ns"))),
        (Some("spiffe://td/sa/x"), None),
        (Some("spiffe://td/ns/a/sa/x/y"), None),
        (Some("spiffe://td/x/a/sa/x"), None),
        (None, None),
    ] {
        assert_eq!(
            Source::of(&conn("198.18.1.2", identity, "198.18.2.3:80")).account,
            account,
            "{identity:?}"
        );
    }
}

#[test]
fn rules_or_clauses_and_matches_or() {
    let mesh = conn("198.18.1.2", Some(SLEEP), "198.18.2.3:8080");
    let yes = Match {
        destination_ports: vec![8080],
        ..Default::default()
    };
    let empty = Match::default();
    let no = Match {
        destination_ports: vec![1],
        ..Default::default()
    };
    let clause = |ms: Vec<&Match>| Clause {
        matches: ms.into_iter().cloned().collect(),
    };
    let cases: Vec<(&str, Vec<Rule>, bool)> = vec![
        ("no rule: nothing", vec![], false),
        ("an empty rule: everything", vec![any()], true),
        (
            "rules OR'd",
            vec![rule(no.clone()), rule(yes.clone())],
            true,
        ),
        (
            "rules OR'd, none",
            vec![rule(no.clone()), rule(no.clone())],
            false,
        ),
        (
            "clauses AND'd (from and to)",
            vec![Rule {
                clauses: vec![clause(vec![&yes]), clause(vec![&no])],
            }],
            false,
        ),
        (
            "clauses AND'd, both",
            vec![Rule {
                clauses: vec![clause(vec![&yes]), clause(vec![&yes])],
            }],
            true,
        ),
        (
            "matches OR'd within a clause",
            vec![Rule {
                clauses: vec![clause(vec![&no, &yes])],
            }],
            true,
        ),
        (
            "an empty clause imposes nothing",
            vec![Rule {
                clauses: vec![clause(vec![]), clause(vec![&yes])],
            }],
            true,
        ),
        (
            "an empty match is skipped: a clause of only {} matches nothing",
            vec![rule(empty.clone())],
            false,
        ),
        (
            "{} beside a match that matches: the other decides",
            vec![Rule {
                clauses: vec![clause(vec![&empty, &yes])],
            }],
            true,
        ),
        (
            "a {} clause AND'd with a matching one: nothing",
            vec![Rule {
                clauses: vec![clause(vec![&yes]), clause(vec![&empty])],
            }],
            false,
        ),
    ];
    for (name, rules, want) in cases {
        let p = policy("foo", "p", Scope::Namespace, Action::Allow, rules);
        assert_eq!(p.matches(&mesh), want, "{name}");
    }
}

fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
    pairs
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

fn selector(p: Policy, pairs: &[(&str, &str)]) -> Policy {
    Policy {
        selector: Some(labels(pairs)),
        ..p
    }
}

#[test]
fn which_policies_apply() {
    let deny_all = |ns: &str, name: &str, scope| policy(ns, name, scope, Action::Deny, vec![any()]);
    let set = PolicySet::new([
        deny_all(ROOT_NAMESPACE, "global", Scope::Global),
        deny_all("foo", "ns-wide", Scope::Namespace),
        deny_all("bar", "other-ns", Scope::Namespace),
        selector(
            deny_all("foo", "by-app", Scope::WorkloadSelector),
            &[("app", "web")],
        ),
        selector(
            deny_all("foo", "by-app-and-version", Scope::WorkloadSelector),
            &[("app", "web"), ("version", "v2")],
        ),
        selector(
            deny_all("bar", "selector-other-ns", Scope::WorkloadSelector),
            &[("app", "web")],
        ),
        selector(
            deny_all(ROOT_NAMESPACE, "root-selector", Scope::WorkloadSelector),
            &[("app", "web")],
        ),
        // From xDS: no labels, bound by name.
        deny_all("foo", "bound", Scope::WorkloadSelector),
    ]);
    let web = labels(&[("app", "web"), ("version", "v1")]);
    let bound = vec!["foo/bound".to_string(), "foo/missing".to_string()];
    let dst = Destination {
        namespace: "foo",
        labels: &web,
        authorization_policies: &bound,
    };
    let mut names: Vec<String> = set.applicable(dst).map(|p| p.key().to_string()).collect();
    names.sort();
    assert_eq!(
        names,
        [
            "foo/bound",
            "foo/by-app",
            "foo/ns-wide",
            "istio-system/global",
            "istio-system/root-selector"
        ]
    );

    // Selected by label and bound by name: counted once.
    let both = vec!["foo/by-app".to_string()];
    let dst = Destination {
        authorization_policies: &both,
        ..dst
    };
    assert_eq!(
        set.applicable(dst).filter(|p| p.name == "by-app").count(),
        1
    );

    // In the root namespace itself: its selectors once, the global once.
    let none = BTreeMap::new();
    let root = Destination {
        namespace: ROOT_NAMESPACE,
        labels: &web,
        authorization_policies: &[],
    };
    let mut names: Vec<String> = set.applicable(root).map(|p| p.key().to_string()).collect();
    names.sort();
    assert_eq!(names, ["istio-system/global", "istio-system/root-selector"]);

    // An unlabelled workload elsewhere: the global policy only.
    let plain = Destination {
        namespace: "baz",
        labels: &none,
        authorization_policies: &[],
    };
    let names: Vec<String> = set.applicable(plain).map(|p| p.key().to_string()).collect();
    assert_eq!(names, ["istio-system/global"]);
}

#[test]
fn the_decision_order() {
    let from_sleep = Match {
        principals: vec![exact("cluster.local/ns/foo/sa/sleep")],
        ..Default::default()
    };
    let port = |p| Match {
        destination_ports: vec![p],
        ..Default::default()
    };
    let allow = |name: &str, rules| policy("foo", name, Scope::Namespace, Action::Allow, rules);
    let deny = |name: &str, rules| policy("foo", name, Scope::Namespace, Action::Deny, rules);
    let dry = |p: Policy| Policy { dry_run: true, ..p };
    let key = |name: &str| PolicyKey::new("foo", name);
    let sleep = conn("198.18.1.2", Some(SLEEP), "198.18.2.3:8080");
    let curl = conn("198.18.1.3", Some(CURL), "198.18.2.3:8080");
    let cases: Vec<(&str, Vec<Policy>, Connection<'_>, Verdict)> = vec![
        (
            "no policy: allowed",
            vec![],
            sleep,
            Verdict::AllowedWithoutPolicy,
        ),
        (
            "a matching ALLOW allows",
            vec![allow("a", vec![rule(from_sleep.clone())])],
            sleep,
            Verdict::Allowed(key("a")),
        ),
        (
            "ALLOW policies apply, none matches: denied",
            vec![allow("a", vec![rule(from_sleep.clone())])],
            curl,
            Verdict::NotAllowed {
                allow_policies: 1,
                first: key("a"),
            },
        ),
        (
            "allow-nothing (no rule) denies everything",
            vec![allow("nothing", vec![])],
            sleep,
            Verdict::NotAllowed {
                allow_policies: 1,
                first: key("nothing"),
            },
        ),
        (
            "allow-all",
            vec![allow("all", vec![any()])],
            curl,
            Verdict::Allowed(key("all")),
        ),
        (
            "a DENY that does not match leaves it allowed",
            vec![deny("d", vec![rule(port(9090))])],
            sleep,
            Verdict::AllowedWithoutPolicy,
        ),
        (
            "a DENY with no rule denies nothing",
            vec![deny("d", vec![])],
            sleep,
            Verdict::AllowedWithoutPolicy,
        ),
        (
            "DENY wins over a matching ALLOW",
            vec![allow("a", vec![any()]), deny("d", vec![rule(port(8080))])],
            sleep,
            Verdict::Denied(key("d")),
        ),
        (
            "any ALLOW matching is enough",
            vec![
                allow("a", vec![rule(port(9090))]),
                allow("b", vec![rule(from_sleep.clone())]),
            ],
            sleep,
            Verdict::Allowed(key("b")),
        ),
        (
            "a dry-run DENY is not enforced",
            vec![dry(deny("d", vec![any()]))],
            sleep,
            Verdict::AllowedWithoutPolicy,
        ),
        (
            "a dry-run ALLOW does not make ALLOW policies apply",
            vec![dry(allow("a", vec![rule(from_sleep.clone())]))],
            curl,
            Verdict::AllowedWithoutPolicy,
        ),
        (
            "a dry-run ALLOW does not allow either",
            vec![
                allow("a", vec![rule(from_sleep.clone())]),
                dry(allow("b", vec![any()])),
            ],
            curl,
            Verdict::NotAllowed {
                allow_policies: 1,
                first: key("a"),
            },
        ),
    ];
    for (name, policies, c, want) in cases {
        let set = PolicySet::new(policies);
        let none = BTreeMap::new();
        let dst = Destination {
            namespace: "foo",
            labels: &none,
            authorization_policies: &[],
        };
        let verdict = set.check(&c, dst);
        assert_eq!(verdict.is_allowed(), want.is_allowed(), "{name}: {verdict}");
        assert_eq!(verdict, want, "{name}");
    }
}

#[test]
fn scopes_decide_who_is_affected() {
    // deny-all in namespace foo; allow-nothing for app=db in bar; a global
    // DENY of port 22.
    let set = PolicySet::new([
        policy(
            "foo",
            "deny-all",
            Scope::Namespace,
            Action::Deny,
            vec![any()],
        ),
        selector(
            policy(
                "bar",
                "db-nothing",
                Scope::WorkloadSelector,
                Action::Allow,
                vec![],
            ),
            &[("app", "db")],
        ),
        policy(
            ROOT_NAMESPACE,
            "no-ssh",
            Scope::Global,
            Action::Deny,
            vec![rule(Match {
                destination_ports: vec![22],
                ..Default::default()
            })],
        ),
    ]);
    let db = labels(&[("app", "db")]);
    let web = labels(&[("app", "web")]);
    let at = |ns, labels| Destination {
        namespace: ns,
        labels,
        authorization_policies: &[],
    };
    let to = |port: u16| format!("198.18.2.3:{port}");
    let c80 = to(80);
    let c22 = to(22);
    let http = conn("198.18.1.2", Some(SLEEP), &c80);
    let ssh = conn("198.18.1.2", Some(SLEEP), &c22);
    let cases = [
        ("foo is denied", at("foo", &web), http, false),
        ("bar's db allows nothing", at("bar", &db), http, false),
        ("bar's web has no policy", at("bar", &web), http, true),
        (
            "the global DENY reaches every namespace",
            at("bar", &web),
            ssh,
            false,
        ),
        (
            "baz is untouched but for the global",
            at("baz", &web),
            http,
            true,
        ),
    ];
    for (name, dst, c, allowed) in cases {
        let verdict = set.check(&c, dst);
        assert_eq!(verdict.is_allowed(), allowed, "{name}: {verdict}");
    }
    assert_eq!(
        set.check(&ssh, at("baz", &web)).policy(),
        Some(&PolicyKey::new(ROOT_NAMESPACE, "no-ssh"))
    );
}

#[test]
fn a_thousand_policies_elsewhere_do_not_apply() {
    // 1,000 namespace-wide DENY-all policies in other namespaces, and one
    // ALLOW here: the check sees only this namespace's.
    let mut policies: Vec<Policy> = (0..1000)
        .map(|i| {
            policy(
                &format!("ns-{i}"),
                "deny-all",
                Scope::Namespace,
                Action::Deny,
                vec![any()],
            )
        })
        .collect();
    policies.push(policy(
        "foo",
        "allow-sleep",
        Scope::Namespace,
        Action::Allow,
        vec![rule(Match {
            principals: vec![exact("cluster.local/ns/foo/sa/sleep")],
            ..Default::default()
        })],
    ));
    let set = PolicySet::new(policies);
    assert_eq!(set.len(), 1001);
    let none = BTreeMap::new();
    let dst = Destination {
        namespace: "foo",
        labels: &none,
        authorization_policies: &[],
    };
    assert_eq!(set.applicable(dst).count(), 1);
    let c = conn("198.18.1.2", Some(SLEEP), "198.18.2.3:80");
    assert_eq!(
        set.check(&c, dst),
        Verdict::Allowed(PolicyKey::new("foo", "allow-sleep"))
    );
}

#[test]
fn a_key_listed_twice_keeps_the_last() {
    let set = PolicySet::new([
        policy("foo", "p", Scope::Namespace, Action::Deny, vec![any()]),
        policy("foo", "p", Scope::Namespace, Action::Allow, vec![any()]),
    ]);
    assert_eq!(set.len(), 1);
    let none = BTreeMap::new();
    let dst = Destination {
        namespace: "foo",
        labels: &none,
        authorization_policies: &[],
    };
    let c = conn("198.18.1.2", None, "198.18.2.3:80");
    assert!(set.check(&c, dst).is_allowed());
}

//! Authorization (issue 34 items 1 and 2, and ztunnel's own semantics):
//! namespace-scoped policies in `default`, where the server runs as
//! `default/sa-server`; callers `default/sleep`, `default/other`,
//! `foreign/sleep` over HBONE, and plaintext.

use shunt_proto::istio::security::{Action, Match};

use super::{Case, FOREIGN, OTHER, PLAINTEXT, SLEEP, row};
use crate::reference::{
    probe::Outcome::{Allowed, Refused},
    resources::{exact, ns_policy, rule, service_account},
};

fn sa_match(namespace: &str, sa: &str) -> Match {
    Match {
        service_accounts: vec![service_account(namespace, sa)],
        ..Default::default()
    }
}

pub fn cases() -> Vec<Case> {
    vec![
        Case::authz(
            "no policy: everyone",
            vec![],
            vec![
                row(SLEEP, 8080, Allowed),
                row(OTHER, 8080, Allowed),
                row(PLAINTEXT, 8080, Allowed),
            ],
        ),
        // Item 1: source.serviceAccounts (Match field 11).
        Case::authz(
            "ALLOW serviceAccounts [default/sleep]",
            vec![ns_policy(
                "allow-sleep",
                Action::Allow,
                vec![rule(vec![vec![sa_match("default", "sleep")]])],
            )],
            vec![
                row(SLEEP, 8080, Allowed),
                row(OTHER, 8080, Refused),
                row(FOREIGN, 8080, Refused),
                row(PLAINTEXT, 8080, Refused),
            ],
        ),
        Case::authz(
            "DENY serviceAccounts [default/sleep]",
            vec![ns_policy(
                "deny-sleep",
                Action::Deny,
                vec![rule(vec![vec![sa_match("default", "sleep")]])],
            )],
            vec![
                row(SLEEP, 8080, Refused),
                row(OTHER, 8080, Allowed),
                row(FOREIGN, 8080, Allowed),
                row(PLAINTEXT, 8080, Allowed),
            ],
        ),
        // Item 1: notServiceAccounts (Match field 12).
        Case::authz(
            "ALLOW notServiceAccounts [default/sleep]",
            vec![ns_policy(
                "allow-not-sleep",
                Action::Allow,
                vec![rule(vec![vec![Match {
                    not_service_accounts: vec![service_account("default", "sleep")],
                    ..Default::default()
                }]])],
            )],
            vec![
                row(SLEEP, 8080, Refused),
                row(OTHER, 8080, Allowed),
                row(PLAINTEXT, 8080, Allowed),
            ],
        ),
        Case::authz(
            "ALLOW principals [cluster.local/ns/default/sa/sleep]",
            vec![ns_policy(
                "allow-principal",
                Action::Allow,
                vec![rule(vec![vec![Match {
                    principals: vec![exact("cluster.local/ns/default/sa/sleep")],
                    ..Default::default()
                }]])],
            )],
            vec![
                row(SLEEP, 8080, Allowed),
                row(OTHER, 8080, Refused),
                row(PLAINTEXT, 8080, Refused),
            ],
        ),
        // Item 2: an empty Match never matches.
        Case::authz(
            "ALLOW with clause [{}]",
            vec![ns_policy(
                "allow-empty-match",
                Action::Allow,
                vec![rule(vec![vec![Match::default()]])],
            )],
            vec![row(SLEEP, 8080, Refused), row(PLAINTEXT, 8080, Refused)],
        ),
        // Item 2: a rule without clauses matches everything.
        Case::authz(
            "ALLOW with a rule of no clauses",
            vec![ns_policy(
                "allow-empty-clause",
                Action::Allow,
                vec![rule(vec![])],
            )],
            vec![row(SLEEP, 8080, Allowed), row(PLAINTEXT, 8080, Allowed)],
        ),
        // A policy without rules matches nothing.
        Case::authz(
            "ALLOW with no rules",
            vec![ns_policy("allow-nothing", Action::Allow, vec![])],
            vec![row(SLEEP, 8080, Refused), row(PLAINTEXT, 8080, Refused)],
        ),
        // Item 2: istiod's translation of a DENY whose `to` is only L7
        // (`operation.methods: [GET]`) is `{}`: ztunnel denies nothing.
        Case::authz(
            "DENY L7-only (clause [{}])",
            vec![ns_policy(
                "deny-get",
                Action::Deny,
                vec![rule(vec![vec![Match::default()]])],
            )],
            vec![row(SLEEP, 8080, Allowed), row(PLAINTEXT, 8080, Allowed)],
        ),
        // Item 2: [{ports: [9090]}] AND [{}]: the second clause never
        // matches, so neither does the rule.
        Case::authz(
            "DENY [{ports 9090}] AND [{}]",
            vec![ns_policy(
                "deny-9090-and-empty",
                Action::Deny,
                vec![rule(vec![
                    vec![Match {
                        destination_ports: vec![9090],
                        ..Default::default()
                    }],
                    vec![Match::default()],
                ])],
            )],
            vec![row(SLEEP, 9090, Allowed), row(SLEEP, 8080, Allowed)],
        ),
        Case::authz(
            "DENY [{ports 9090}]",
            vec![ns_policy(
                "deny-9090",
                Action::Deny,
                vec![rule(vec![vec![Match {
                    destination_ports: vec![9090],
                    ..Default::default()
                }]])],
            )],
            vec![
                row(SLEEP, 9090, Refused),
                row(SLEEP, 8080, Allowed),
                row(PLAINTEXT, 9090, Refused),
            ],
        ),
        Case::authz(
            "DENY namespaces [foreign] before ALLOW everyone",
            vec![
                ns_policy(
                    "deny-foreign",
                    Action::Deny,
                    vec![rule(vec![vec![Match {
                        namespaces: vec![exact("foreign")],
                        ..Default::default()
                    }]])],
                ),
                ns_policy("allow-all", Action::Allow, vec![rule(vec![])]),
            ],
            vec![
                row(FOREIGN, 8080, Refused),
                row(SLEEP, 8080, Allowed),
                row(PLAINTEXT, 8080, Allowed),
            ],
        ),
    ]
}

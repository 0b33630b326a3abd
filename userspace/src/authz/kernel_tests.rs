//! The kernel compiler: ports folded into "any other port", exactness
//! against the engine on every port, dry run never compiled, pairs the
//! kernel cannot know left to the proxy.

use super::*;
use crate::{
    authz::model::{Action, Cidr, Clause, Match, Rule, Scope, ServiceAccount, StringMatch},
    state::{DataplaneMode, GatewayAddress, GatewayDestination},
};

const CLIENT: &str = "spiffe://cluster.local/ns/default/sa/client";
const INTRUDER: &str = "spiffe://cluster.local/ns/other/sa/intruder";
const CLIENT_IP: &str = "198.18.1.2";
const INTRUDER_IP: &str = "198.18.1.3";
const SERVER_IP: &str = "198.18.1.4";

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

fn server() -> Workload {
    Workload {
        name: "server".into(),
        namespace: "default".into(),
        service_account: "server".into(),
        ips: vec![ip(SERVER_IP)],
        node: "node-a".into(),
        dataplane_mode: DataplaneMode::Ambient,
        labels: [("app".to_string(), "server".to_string())].into(),
        ..Default::default()
    }
}

fn policy(name: &str, action: Action, rules: Vec<Rule>) -> Policy {
    Policy {
        name: name.into(),
        namespace: "default".into(),
        scope: Scope::Namespace,
        action,
        rules,
        dry_run: false,
        selector: None,
    }
}

fn rule(m: Match) -> Rule {
    Rule {
        clauses: vec![Clause { matches: vec![m] }],
    }
}

fn principal(id: &str) -> Match {
    Match {
        principals: vec![StringMatch::Exact(
            id.trim_start_matches("spiffe://").into(),
        )],
        ..Default::default()
    }
}

fn key(name: &str) -> PolicyKey {
    PolicyKey::new("default", name)
}

/// The client in slot 1 and the intruder in slot 2, both to the server.
fn compile_for(policies: Vec<Policy>) -> VerdictTable {
    let client_ips = [ip(CLIENT_IP)];
    let intruder_ips = [ip(INTRUDER_IP)];
    let sources = [
        KernelSource {
            slot: 1,
            identity: CLIENT,
            ips: &client_ips,
        },
        KernelSource {
            slot: 2,
            identity: INTRUDER,
            ips: &intruder_ips,
        },
    ];
    let server = server();
    compile(&PolicySet::new(policies), &sources, &[&server])
}

fn entry(slot: u32, port: u16, verdict: KernelVerdict) -> (VerdictKey, KernelVerdict) {
    (
        VerdictKey {
            slot,
            dst: ip(SERVER_IP),
            port,
        },
        verdict,
    )
}

#[test]
fn named_ports_fold_into_any_other_port() {
    // ALLOW the client on 8080 and 9090: for the client every other port
    // is denied (not allowed), the two named ones are allowed; for the
    // intruder every port is denied, which one entry says.
    let allow = policy(
        "allow-client",
        Action::Allow,
        vec![rule(Match {
            destination_ports: vec![8080, 9090],
            ..principal(CLIENT)
        })],
    );
    let table = compile_for(vec![allow]);
    let deny = KernelVerdict::Deny(key("allow-client"));
    let expected: BTreeMap<_, _> = [
        entry(1, ANY_OTHER_PORT, deny.clone()),
        entry(1, 8080, KernelVerdict::Allow),
        entry(1, 9090, KernelVerdict::Allow),
        entry(2, ANY_OTHER_PORT, deny.clone()),
    ]
    .into();
    assert_eq!(table.entries, expected);
    assert_eq!(table.lookup(1, ip(SERVER_IP), 8080), &KernelVerdict::Allow);
    assert_eq!(table.lookup(1, ip(SERVER_IP), 22), &deny);
    assert_eq!(table.lookup(2, ip(SERVER_IP), 8080), &deny);
    assert_eq!(table.policies, [key("allow-client")]);
}

#[test]
fn a_port_no_policy_names_keeps_the_default() {
    // DENY 9090 only: one entry per source for 9090, none for other ports
    // (allowed: absent), nothing for another destination address.
    let deny = policy(
        "no-9090",
        Action::Deny,
        vec![rule(Match {
            destination_ports: vec![9090],
            ..Default::default()
        })],
    );
    let table = compile_for(vec![deny]);
    let no_9090 = KernelVerdict::Deny(key("no-9090"));
    let expected: BTreeMap<_, _> =
        [entry(1, 9090, no_9090.clone()), entry(2, 9090, no_9090)].into();
    assert_eq!(table.entries, expected);
    assert_eq!(table.lookup(1, ip(SERVER_IP), 8080), &KernelVerdict::Allow);
    assert_eq!(
        table.lookup(1, ip("198.18.9.9"), 9090),
        &KernelVerdict::Allow
    );
}

#[test]
fn dry_run_and_no_policy_compile_nothing() {
    assert_eq!(compile_for(vec![]).entries, BTreeMap::new());
    let mut deny_all = policy("deny-all", Action::Deny, vec![Rule::default()]);
    deny_all.dry_run = true;
    let table = compile_for(vec![deny_all.clone()]);
    assert!(table.entries.is_empty(), "{table:?}");
    assert!(table.policies.is_empty(), "dry run is not compiled");
    deny_all.dry_run = false;
    assert_eq!(compile_for(vec![deny_all]).entries.len(), 2);
}

#[test]
fn deny_beats_allow_and_namespaces_are_the_identitys() {
    let allow_ns = policy(
        "same-namespace",
        Action::Allow,
        vec![rule(Match {
            namespaces: vec![StringMatch::Exact("default".into())],
            ..Default::default()
        })],
    );
    let deny_client_8080 = policy(
        "no-client-8080",
        Action::Deny,
        vec![rule(Match {
            destination_ports: vec![8080],
            ..principal(CLIENT)
        })],
    );
    let table = compile_for(vec![allow_ns, deny_client_8080]);
    let server = ip(SERVER_IP);
    assert_eq!(
        table.lookup(1, server, 8080),
        &KernelVerdict::Deny(key("no-client-8080"))
    );
    assert_eq!(table.lookup(1, server, 9090), &KernelVerdict::Allow);
    assert_eq!(
        table.lookup(2, server, 9090),
        &KernelVerdict::Deny(key("same-namespace")),
        "namespace other is not allowed"
    );
}

#[test]
fn service_accounts_compile_exactly_never_to_everything() {
    // ALLOW default/client by service account: the client passes, the
    // intruder is refused on every port (an unread field would have made
    // this `{}`: everything, or nothing).
    let allow = policy(
        "allow-client-sa",
        Action::Allow,
        vec![rule(Match {
            service_accounts: vec![ServiceAccount::new("default", "client")],
            ..Default::default()
        })],
    );
    let table = compile_for(vec![allow]);
    let server = ip(SERVER_IP);
    let refused = KernelVerdict::Deny(key("allow-client-sa"));
    assert_eq!(
        table.entries,
        [entry(2, ANY_OTHER_PORT, refused.clone())].into()
    );
    assert_eq!(table.lookup(1, server, 8080), &KernelVerdict::Allow);
    assert_eq!(table.lookup(2, server, 8080), &refused);

    // The DENY of the same shape refuses the client only.
    let deny = policy(
        "deny-client-sa",
        Action::Deny,
        vec![rule(Match {
            service_accounts: vec![ServiceAccount::new("default", "client")],
            ..Default::default()
        })],
    );
    let table = compile_for(vec![deny]);
    assert_eq!(
        table.lookup(1, server, 8080),
        &KernelVerdict::Deny(key("deny-client-sa"))
    );
    assert_eq!(table.lookup(2, server, 8080), &KernelVerdict::Allow);

    // notServiceAccounts the other way round.
    let allow_not = policy(
        "allow-not-client-sa",
        Action::Allow,
        vec![rule(Match {
            not_service_accounts: vec![ServiceAccount::new("default", "client")],
            ..Default::default()
        })],
    );
    let table = compile_for(vec![allow_not]);
    assert_eq!(
        table.lookup(1, server, 8080),
        &KernelVerdict::Deny(key("allow-not-client-sa"))
    );
    assert_eq!(table.lookup(2, server, 8080), &KernelVerdict::Allow);
}

#[test]
fn an_empty_match_compiles_to_what_ztunnel_does() {
    // ALLOW `[{}]`: matches nothing, so every source is refused; DENY
    // `[{}]`: denies nothing, so no entry at all.
    let empty = || rule(Match::default());
    let table = compile_for(vec![policy("allow-empty", Action::Allow, vec![empty()])]);
    let refused = KernelVerdict::Deny(key("allow-empty"));
    assert_eq!(
        table.entries,
        [
            entry(1, ANY_OTHER_PORT, refused.clone()),
            entry(2, ANY_OTHER_PORT, refused)
        ]
        .into()
    );
    let table = compile_for(vec![policy("deny-empty", Action::Deny, vec![empty()])]);
    assert!(table.entries.is_empty(), "{table:?}");
}

/// The table answers exactly what the engine answers, on every port, for
/// policy sets using each L4 field.
#[test]
fn the_table_agrees_with_the_engine_on_every_port() {
    let cidr = |s: &str| s.parse::<Cidr>().expect("test CIDR");
    let sets: Vec<Vec<Policy>> = vec![
        vec![policy(
            "a",
            Action::Allow,
            vec![rule(Match {
                not_destination_ports: vec![22, 23],
                ..principal(CLIENT)
            })],
        )],
        vec![
            policy(
                "b",
                Action::Allow,
                vec![rule(Match {
                    source_ips: vec![cidr("198.18.1.3/32")],
                    destination_ports: vec![80, 443],
                    ..Default::default()
                })],
            ),
            policy(
                "c",
                Action::Deny,
                vec![rule(Match {
                    destination_ips: vec![cidr(SERVER_IP)],
                    destination_ports: vec![443],
                    not_namespaces: vec![StringMatch::Exact("other".into())],
                    ..Default::default()
                })],
            ),
        ],
        vec![
            policy(
                "e",
                Action::Allow,
                vec![rule(Match {
                    service_accounts: vec![ServiceAccount::new("other", "intruder")],
                    destination_ports: vec![8080],
                    ..Default::default()
                })],
            ),
            policy(
                "f",
                Action::Deny,
                vec![Rule {
                    clauses: vec![
                        Clause {
                            matches: vec![Match {
                                destination_ports: vec![9090],
                                ..Default::default()
                            }],
                        },
                        Clause {
                            matches: vec![Match::default()],
                        },
                    ],
                }],
            ),
        ],
        vec![policy(
            "d",
            Action::Allow,
            vec![rule(Match {
                not_destination_ips: vec![cidr("198.18.0.0/15")],
                ..Default::default()
            })],
        )],
    ];
    let server = server();
    for policies in sets {
        let set = PolicySet::new(policies.clone());
        let table = compile_for(policies);
        for (slot, identity, src) in [(1, CLIENT, CLIENT_IP), (2, INTRUDER, INTRUDER_IP)] {
            for port in (1..=1024).chain([8080, 65535]) {
                let connection = Connection {
                    src_ip: ip(src),
                    src_identity: Some(identity),
                    dst: SocketAddr::new(ip(SERVER_IP), port),
                };
                let engine = KernelVerdict::of(&set.check(&connection, Destination::of(&server)));
                assert_eq!(
                    table.lookup(slot, ip(SERVER_IP), port),
                    &engine,
                    "slot {slot} port {port}: {table:?}"
                );
            }
        }
    }
}

#[test]
fn pairs_the_kernel_cannot_know_are_left_to_the_proxy() {
    // The source has two addresses and the policy tells them apart.
    let allow_one_ip = policy(
        "one-ip",
        Action::Allow,
        vec![rule(Match {
            source_ips: vec!["198.18.1.2/32".parse().expect("CIDR")],
            ..Default::default()
        })],
    );
    let ips = [ip(CLIENT_IP), ip("198.18.1.20")];
    let sources = [KernelSource {
        slot: 1,
        identity: CLIENT,
        ips: &ips,
    }];
    let server = server();
    let set = PolicySet::new([allow_one_ip]);
    let table = compile(&set, &sources, &[&server]);
    assert!(table.entries.is_empty(), "{table:?}");
    assert_eq!(table.left_to_proxy, 1);

    // A destination behind a waypoint: its proxy sees the waypoint.
    let mut behind = server.clone();
    behind.waypoint = Some(GatewayAddress {
        destination: GatewayDestination::Address {
            network: String::new(),
            ip: ip("198.18.1.99"),
        },
        hbone_mtls_port: 15008,
    });
    let single = [ip(CLIENT_IP)];
    let sources = [KernelSource {
        slot: 1,
        identity: CLIENT,
        ips: &single,
    }];
    let deny_all = PolicySet::new([policy("deny-all", Action::Deny, vec![Rule::default()])]);
    let table = compile(&deny_all, &sources, &[&behind]);
    assert!(table.entries.is_empty(), "{table:?}");
    assert_eq!(table.left_to_proxy, 1);
    // The same without the waypoint is compiled.
    assert_eq!(compile(&deny_all, &sources, &[&server]).entries.len(), 1);
}

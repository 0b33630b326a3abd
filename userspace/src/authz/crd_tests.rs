//! The translation, checked through the engine: Istio's AuthorizationPolicy
//! documentation examples that a node proxy can enforce, the L7 rules it
//! cannot, and bad input.

use std::collections::BTreeMap;

use super::*;
use crate::authz::{Connection, Destination, PolicyKey, PolicySet, Verdict};

fn yaml(text: &str) -> serde_yaml::Value {
    serde_yaml::from_str(text).expect("test YAML")
}

fn ok(text: &str) -> (Policy, Vec<String>) {
    match translate(&yaml(text), "default") {
        Ok(Translated::Policy { policy, notes }) => (policy, notes),
        other => panic!("expected a policy from {text}: {other:?}"),
    }
}

fn err(text: &str) -> PolicyError {
    match translate(&yaml(text), "default") {
        Err(e) => e,
        Ok(t) => panic!("expected an error from {text}: {t:?}"),
    }
}

const SLEEP: &str = "spiffe://cluster.local/ns/default/sa/sleep";
const DEV: &str = "spiffe://cluster.local/ns/dev/sa/tester";
const FOO: &str = "spiffe://cluster.local/ns/foo/sa/client";

/// Whether a connection from `src` (identity `id`) to `dst` is allowed to
/// a workload of `namespace` labelled `labels`, under `policies`.
fn allowed(
    policies: &[Policy],
    namespace: &str,
    labels: &[(&str, &str)],
    src: &str,
    id: Option<&str>,
    dst: &str,
) -> bool {
    let set = PolicySet::new(policies.iter().cloned());
    let labels: BTreeMap<String, String> = labels
        .iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect();
    let c = Connection {
        src_ip: src.parse().expect("ip"),
        src_identity: id,
        dst: dst.parse().expect("addr"),
    };
    set.check(
        &c,
        Destination {
            namespace,
            labels: &labels,
            authorization_policies: &[],
        },
    )
    .is_allowed()
}

#[test]
fn allow_nothing_spec_is_empty() {
    let (p, notes) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: allow-nothing
  namespace: foo
spec: {}
");
    assert_eq!(
        (p.action, p.scope, p.rules.len()),
        (Action::Allow, Scope::Namespace, 0)
    );
    assert!(notes.is_empty());
    assert!(!allowed(
        std::slice::from_ref(&p),
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        std::slice::from_ref(&p),
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
    // Its namespace only.
    assert!(allowed(
        &[p],
        "bar",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
}

#[test]
fn deny_all_and_allow_all() {
    let (deny, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: deny-all, namespace: foo}
spec:
  action: DENY
  rules:
  - {}
");
    assert!(!allowed(
        std::slice::from_ref(&deny),
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    let (allow, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-all, namespace: foo}
spec:
  action: ALLOW
  rules:
  - {}
");
    assert!(allowed(
        std::slice::from_ref(&allow),
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
    // DENY first.
    assert!(!allowed(
        &[allow, deny],
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
}

#[test]
fn allow_by_principal_and_by_namespace() {
    let (p, notes) = ok(r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: httpbin
  namespace: foo
spec:
  action: ALLOW
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/default/sa/sleep"]
    - source:
        namespaces: ["dev"]
"#);
    assert!(notes.is_empty());
    let p = [p];
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(DEV),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(FOO),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
}

#[test]
fn deny_not_namespaces() {
    // The docs' DENY example: requests not from namespace foo.
    let (p, _) = ok(r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: httpbin
  namespace: foo
spec:
  action: DENY
  rules:
  - from:
    - source:
        notNamespaces: ["foo"]
"#);
    let p = [p];
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(FOO),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    // Plaintext has no namespace, so it is "not foo": denied.
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
}

#[test]
fn ip_blocks_ports_and_not_principals() {
    let (p, _) = ok(r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: ips, namespace: foo}
spec:
  rules:
  - from:
    - source:
        ipBlocks: ["198.18.1.2", "198.18.5.0/24"]
        notIpBlocks: ["198.18.5.7"]
    to:
    - operation:
        ports: ["8000"]
"#);
    let p = [p];
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:8000"
    ));
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.5.9",
        None,
        "198.18.2.3:8000"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.5.7",
        None,
        "198.18.2.3:8000"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.3",
        None,
        "198.18.2.3:8000"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:8001"
    ));

    let (p, _) = ok(r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: not-sleep, namespace: foo}
spec:
  action: DENY
  rules:
  - from:
    - source:
        notPrincipals: ["*"]
    to:
    - operation:
        notPorts: [9090]
"#);
    let p = [p];
    // DENY everything without a principal except on port 9090.
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:9090"
    ));
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
}

#[test]
fn scopes_root_namespace_and_selector() {
    let (global, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: mesh-deny, namespace: istio-system}
spec:
  action: DENY
  rules:
  - to:
    - operation: {ports: ['22']}
");
    assert_eq!(global.scope, Scope::Global);
    let (selecting, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: products, namespace: default}
spec:
  selector:
    matchLabels: {app: products}
  rules:
  - from:
    - source: {namespaces: [default]}
");
    assert_eq!(selecting.scope, Scope::WorkloadSelector);
    assert_eq!(
        selecting.selector,
        Some(BTreeMap::from([(
            "app".to_string(),
            "products".to_string()
        )]))
    );
    let all = [global, selecting];
    assert!(!allowed(
        &all,
        "bar",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:22"
    ));
    assert!(allowed(
        &all,
        "default",
        &[("app", "products")],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &all,
        "default",
        &[("app", "products")],
        "198.18.1.2",
        Some(FOO),
        "198.18.2.3:80"
    ));
    // Other labels: the selector does not pick it.
    assert!(allowed(
        &all,
        "default",
        &[("app", "reviews")],
        "198.18.1.2",
        Some(FOO),
        "198.18.2.3:80"
    ));
}

#[test]
fn l7_allow_rules_match_nothing_and_l7_deny_rules_drop_the_l7_part() {
    // The docs' first example: L7 in the `to` and `when`.
    let text = |action: &str| {
        format!(
            r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: httpbin, namespace: foo}}
spec:
  action: {action}
  rules:
  - from:
    - source:
        principals: ["cluster.local/ns/default/sa/sleep"]
    to:
    - operation:
        methods: ["GET"]
    when:
    - key: request.auth.claims[iss]
      values: ["https://accounts.google.com"]
  - to:
    - operation:
        ports: ["9000"]
"#
        )
    };
    let (allow, notes) = ok(&text("ALLOW"));
    assert_eq!(allow.rules.len(), 1, "the L7 rule is left out: {allow:?}");
    assert_eq!(notes.len(), 1, "{notes:?}");
    assert!(
        notes[0].contains("spec.rules[0]") && notes[0].contains("matches nothing"),
        "{notes:?}"
    );
    assert!(
        notes[0].contains("methods") && notes[0].contains("request.auth.claims[iss]"),
        "{notes:?}"
    );
    assert!(!allowed(
        std::slice::from_ref(&allow),
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(allowed(
        &[allow],
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:9000"
    ));

    let (deny, notes) = ok(&text("DENY"));
    assert_eq!(deny.rules.len(), 2);
    assert!(notes[0].contains("applied without them"), "{notes:?}");
    // As istiod translates it for ztunnel: the `to` of only `methods` and
    // the L7 `when` become empty matches, which ztunnel skips, so the first
    // rule denies nothing (not "every connection from sleep").
    assert_eq!(deny.rules[0].clauses.len(), 3, "{deny:?}");
    assert!(deny.rules[0].clauses[0].matches[0].is_empty());
    assert!(deny.rules[0].clauses[2].matches[0].is_empty());
    let deny = [deny];
    let check = |dst: &str| allowed(&deny, "foo", &[], "198.18.1.2", Some(SLEEP), dst);
    assert!(check("198.18.2.3:80"), "the L7 rule denies nothing");
    assert!(!check("198.18.2.3:9000"), "the L4 rule denies");
}

#[test]
fn request_principals_and_remote_ip_blocks_are_l7() {
    for field in [
        "requestPrincipals: ['*']",
        "remoteIpBlocks: ['198.18.0.0/15']",
        "notRequestPrincipals: ['x']",
    ] {
        let text = format!(
            "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: p, namespace: foo}}
spec:
  rules:
  - from:
    - source: {{{field}}}
"
        );
        let (p, notes) = ok(&text);
        assert!(p.rules.is_empty(), "{field}");
        assert_eq!(notes.len(), 1, "{field}");
    }
}

#[test]
fn l4_when_keys_translate() {
    let (p, notes) = ok(r#"
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: when, namespace: foo}
spec:
  rules:
  - when:
    - key: source.ip
      values: ["198.18.1.0/24"]
    - key: source.namespace
      notValues: ["dev"]
    - key: source.principal
      values: ["*/sa/sleep"]
    - key: destination.ip
      values: ["198.18.2.3"]
    - key: destination.port
      values: ["80", "443"]
      notValues: ["443"]
"#);
    assert!(notes.is_empty(), "{notes:?}");
    assert_eq!(p.rules[0].clauses.len(), 5);
    let p = [p];
    assert!(allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:443"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.4:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.9.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some("spiffe://cluster.local/ns/dev/sa/sleep"),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(FOO),
        "198.18.2.3:80"
    ));
}

#[test]
fn service_accounts_as_istiod_sends_them() {
    let (p, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: sa, namespace: foo}
spec:
  rules:
  - from:
    - source: {serviceAccounts: [default/sleep, client]}
    - source: {notServiceAccounts: [dev/tester]}
");
    // The model istiod's xDS carries: service accounts, not principals; a
    // bare account is of the policy's namespace.
    let from = &p.rules[0].clauses[0].matches;
    assert_eq!(
        from[0].service_accounts,
        [
            ServiceAccount::new("default", "sleep"),
            ServiceAccount::new("foo", "client")
        ]
    );
    assert!(from[0].principals.is_empty());
    assert_eq!(
        from[1].not_service_accounts,
        [ServiceAccount::new("dev", "tester")]
    );
    let p = [p];
    let check =
        |identity: Option<&str>| allowed(&p, "foo", &[], "198.18.1.2", identity, "198.18.2.3:80");
    assert!(check(Some(SLEEP)));
    assert!(
        check(Some("spiffe://example.org/ns/default/sa/sleep")),
        "any trust domain"
    );
    assert!(
        check(Some(FOO)),
        "a bare account is the policy's namespace's"
    );
    assert!(!check(Some(DEV)), "neither source admits dev/tester");
    assert!(check(None), "plaintext passes notServiceAccounts alone");

    let (only, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: sa, namespace: foo}
spec:
  rules:
  - from:
    - source: {serviceAccounts: [default/sleep]}
");
    let only = [only];
    let check = |identity: Option<&str>| {
        allowed(&only, "foo", &[], "198.18.1.2", identity, "198.18.2.3:80")
    };
    assert!(check(Some(SLEEP)));
    assert!(!check(Some(DEV)));
    assert!(!check(None), "plaintext never has a service account");

    for bad in ["/sleep", "default/", "a/b/c", "\"\""] {
        let e = err(&format!(
            "
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {{name: sa, namespace: foo}}
spec:
  rules:
  - from:
    - source: {{serviceAccounts: [ok, {bad}]}}
"
        ));
        assert_eq!(
            e.field, "spec.rules[0].from[0].source.serviceAccounts[1]",
            "{bad}"
        );
    }
}

#[test]
fn dry_run_annotation_and_default_namespace() {
    let (p, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata:
  name: dry
  annotations: {istio.io/dry-run: 'true'}
spec:
  action: DENY
  rules: [{}]
");
    assert!(p.dry_run);
    assert_eq!(p.key(), PolicyKey::new("default", "dry"));
    assert!(allowed(
        &[p],
        "default",
        &[],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
}

#[test]
fn audit_custom_and_target_refs_are_skipped() {
    for spec in [
        "action: AUDIT\n  rules: [{}]",
        "action: CUSTOM\n  provider: {name: ext}\n  rules: [{}]",
        "targetRefs: [{kind: Gateway, group: gateway.networking.k8s.io, name: waypoint}]\n  rules: [{}]",
    ] {
        let text = format!(
            "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {{name: p, namespace: foo}}\nspec:\n  {spec}\n"
        );
        match translate(&yaml(&text), "default") {
            Ok(Translated::Skipped { policy, reason }) => {
                assert_eq!(policy, "foo/p");
                assert!(!reason.is_empty());
            }
            other => panic!("{spec}: {other:?}"),
        }
    }
}

#[test]
fn bad_input_names_the_policy_and_field_and_fails_closed() {
    let head = "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: bad, namespace: foo}\n";
    // (spec, field named, stand-in action: None when there is none)
    let cases: Vec<(&str, &str, Option<Action>)> = vec![
        (
            "spec:\n  rules:\n  - from:\n    - source: {principal: [x]}\n",
            "spec.rules[0].from[0].source.principal",
            Some(Action::Allow),
        ),
        (
            "spec:\n  action: DENY\n  rules:\n  - from:\n    - source: {ipBlocks: ['198.18.0.0/33']}\n",
            "spec.rules[0].from[0].source.ipBlocks[0]",
            Some(Action::Deny),
        ),
        (
            "spec:\n  rules:\n  - from:\n    - source: {notIpBlocks: ['198.18.0/24']}\n",
            "spec.rules[0].from[0].source.notIpBlocks[0]",
            Some(Action::Allow),
        ),
        (
            "spec:\n  selector: {matchLabels: {}}\n  rules: [{}]\n",
            "spec.selector.matchLabels",
            Some(Action::Allow),
        ),
        (
            "spec:\n  action: REJECT\n  rules: [{}]\n",
            "spec.action",
            Some(Action::Deny),
        ),
        (
            "spec:\n  rules:\n  - to:\n    - operation: {ports: ['http']}\n",
            "spec.rules[0].to[0].operation.ports[0]",
            Some(Action::Allow),
        ),
        (
            "spec:\n  rules:\n  - to:\n    - operation: {ports: [70000]}\n",
            "spec.rules[0].to[0].operation.ports[0]",
            Some(Action::Allow),
        ),
        (
            "spec:\n  rules:\n  - when:\n    - {key: source.color, values: [red]}\n",
            "spec.rules[0].when[0].key",
            Some(Action::Allow),
        ),
        (
            "spec:\n  rules:\n  - when:\n    - {key: source.ip}\n",
            "spec.rules[0].when[0].values",
            Some(Action::Allow),
        ),
        (
            "spec:\n  rules:\n  - from:\n    - source: {principals: ['a*b']}\n",
            "spec.rules[0].from[0].source.principals[0]",
            Some(Action::Allow),
        ),
        (
            "spec:\n  rules:\n  - from:\n    - source: {namespaces: ['']}\n",
            "spec.rules[0].from[0].source.namespaces[0]",
            Some(Action::Allow),
        ),
        (
            "spec:\n  action: AUDIT\n  rules: [{frm: []}]\n",
            "spec.rules[0].frm",
            None,
        ),
        (
            "spec:\n  action: DENY\n  rule: []\n",
            "spec.rule",
            Some(Action::Deny),
        ),
    ];
    for (spec, field, stand_in) in cases {
        let e = err(&format!("{head}{spec}"));
        assert_eq!(e.policy, "foo/bad", "{spec}");
        assert_eq!(e.field, field, "{spec}: {e}");
        assert!(
            e.to_string().contains("foo/bad") && e.to_string().contains(field),
            "{e}"
        );
        assert_eq!(e.stand_in.as_ref().map(|p| p.action), stand_in, "{spec}");
        if let Some(p) = &e.stand_in {
            assert_eq!(p.key(), PolicyKey::new("foo", "bad"));
            // Fail closed: nothing reaches a workload of foo.
            assert!(
                !allowed(
                    &[(**p).clone()],
                    "foo",
                    &[],
                    "198.18.1.2",
                    Some(SLEEP),
                    "198.18.2.3:80"
                ),
                "{spec}"
            );
            assert!(
                allowed(
                    &[(**p).clone()],
                    "bar",
                    &[],
                    "198.18.1.2",
                    Some(SLEEP),
                    "198.18.2.3:80"
                ),
                "{spec}"
            );
        }
    }

    // A wrong kind, an unknown top-level field.
    let e = err(
        "apiVersion: security.istio.io/v1\nkind: PeerAuthentication\nmetadata: {name: x, namespace: foo}\n",
    );
    assert_eq!(e.field, "kind");
    let e = err(
        "apiVersion: security.istio.io/v2\nkind: AuthorizationPolicy\nmetadata: {name: x, namespace: foo}\n",
    );
    assert_eq!(e.field, "apiVersion");
    let e = err(
        "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: x, namespace: foo}\nspecs: {}\n",
    );
    assert_eq!(e.field, "specs", "{e}");

    // A readable selector keeps the stand-in to the workloads it picks.
    let e = err(&format!(
        "{head}spec:\n  selector: {{matchLabels: {{app: db}}}}\n  rules: [{{from: [{{source: {{ipBlocks: [nope]}}}}]}}]\n"
    ));
    let stand_in = *e.stand_in.expect("ALLOW stand-in");
    assert_eq!(stand_in.scope, Scope::WorkloadSelector);
    assert!(!allowed(
        std::slice::from_ref(&stand_in),
        "foo",
        &[("app", "db")],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
    assert!(allowed(
        &[stand_in],
        "foo",
        &[("app", "web")],
        "198.18.1.2",
        None,
        "198.18.2.3:80"
    ));
}

#[test]
fn a_broken_deny_never_becomes_mesh_wide_unless_written_so() {
    // A root-namespace DENY whose selector cannot be read: its stand-in
    // is confined to the root namespace's own workloads, not the mesh.
    let e = err("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: broken, namespace: istio-system}
spec:
  action: DENY
  selector: {matchLabels: {}}
  rules: [{}]
");
    let stand_in = *e.stand_in.clone().expect("DENY stand-in");
    assert_eq!(
        (stand_in.action, stand_in.scope),
        (Action::Deny, Scope::Namespace)
    );
    assert!(
        e.instead()
            .contains("every workload of namespace istio-system"),
        "{}",
        e.instead()
    );
    let p = [stand_in];
    assert!(allowed(
        &p,
        "default",
        &[("app", "x")],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &p,
        "istio-system",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));

    // An unknown field in a namespace's DENY: that namespace only.
    let e = err("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: typo, namespace: foo}
spec:
  action: DENY
  rules: [{from: [{source: {principalz: [x]}}]}]
");
    assert_eq!(e.field, "spec.rules[0].from[0].source.principalz");
    let p = [*e.stand_in.expect("DENY stand-in")];
    assert!(!allowed(
        &p,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(allowed(
        &p,
        "bar",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));

    // Written mesh-wide (no selector in the root namespace): its own scope.
    let e = err("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: mesh, namespace: istio-system}
spec:
  action: DENY
  rulez: []
");
    assert_eq!(e.stand_in.expect("stand-in").scope, Scope::Global);
}

#[test]
fn the_stand_in_allows_what_valid_allow_policies_grant() {
    let (valid, _) = ok("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: allow-sleep, namespace: foo}
spec:
  rules:
  - from: [{source: {principals: [cluster.local/ns/default/sa/sleep]}}]
");
    let e = err("
apiVersion: security.istio.io/v1
kind: AuthorizationPolicy
metadata: {name: broken, namespace: foo}
spec:
  rules:
  - from: [{source: {principals: [cluster.local/ns/dev/sa/tester]}}]
    to: [{operation: {ports: ['x']}}]
");
    let all = [valid, *e.stand_in.expect("stand-in")];
    assert!(allowed(
        &all,
        "foo",
        &[],
        "198.18.1.2",
        Some(SLEEP),
        "198.18.2.3:80"
    ));
    assert!(!allowed(
        &all,
        "foo",
        &[],
        "198.18.1.2",
        Some(DEV),
        "198.18.2.3:80"
    ));
    let set = PolicySet::new(all.iter().cloned());
    let none = BTreeMap::new();
    let c = Connection {
        src_ip: "198.18.1.2".parse().expect("ip"),
        src_identity: Some(DEV),
        dst: "198.18.2.3:80".parse().expect("addr"),
    };
    let verdict = set.check(
        &c,
        Destination {
            namespace: "foo",
            labels: &none,
            authorization_policies: &[],
        },
    );
    assert!(
        matches!(
            verdict,
            Verdict::NotAllowed {
                allow_policies: 2,
                ..
            }
        ),
        "{verdict:?}"
    );
}

/// Objects whose translation istiod makes in a way that surprises, checked
/// through the engine: (what, policy spec in namespace foo, identity,
/// port, allowed).
#[test]
fn istiods_model_for_the_surprising_cases() {
    let head = "apiVersion: security.istio.io/v1\nkind: AuthorizationPolicy\nmetadata: {name: p, namespace: foo}\n";
    let other_td = Some("spiffe://example.org/ns/default/sa/sleep");
    let cases: [(&str, &str, Option<&str>, u16, bool); 8] = [
        (
            "an ALLOW from an empty source allows nothing ({} is skipped)",
            "spec:\n  rules: [{from: [{source: {}}]}]\n",
            Some(SLEEP),
            80,
            false,
        ),
        (
            "a DENY from only request principals denies nothing",
            "spec:\n  action: DENY\n  rules: [{from: [{source: {requestPrincipals: ['*']}}]}]\n",
            Some(SLEEP),
            80,
            true,
        ),
        (
            "a DENY on only an L7 `when` denies nothing",
            "spec:\n  action: DENY\n  rules: [{when: [{key: 'request.headers[x]', values: [y]}]}]\n",
            None,
            80,
            true,
        ),
        (
            "a DENY of methods OR a port: the port is denied",
            "spec:\n  action: DENY\n  rules: [{to: [{operation: {methods: [GET]}}, {operation: {ports: ['80']}}]}]\n",
            Some(SLEEP),
            80,
            false,
        ),
        (
            "... and no other port",
            "spec:\n  action: DENY\n  rules: [{to: [{operation: {methods: [GET]}}, {operation: {ports: ['80']}}]}]\n",
            Some(SLEEP),
            81,
            true,
        ),
        (
            "principals are compared verbatim: cluster.local is not another trust domain",
            "spec:\n  rules: [{from: [{source: {principals: [cluster.local/ns/default/sa/sleep]}}]}]\n",
            other_td,
            80,
            false,
        ),
        (
            "serviceAccounts hold in any trust domain",
            "spec:\n  rules: [{from: [{source: {serviceAccounts: [default/sleep]}}]}]\n",
            other_td,
            80,
            true,
        ),
        (
            "a DENY of notServiceAccounts refuses plaintext",
            "spec:\n  action: DENY\n  rules: [{from: [{source: {notServiceAccounts: [default/sleep]}}]}]\n",
            None,
            80,
            false,
        ),
    ];
    let mut failures = Vec::new();
    for (what, spec, identity, port, want) in cases {
        let (p, _) = ok(&format!("{head}{spec}"));
        let got = allowed(
            &[p],
            "foo",
            &[],
            "198.18.1.2",
            identity,
            &format!("198.18.2.3:{port}"),
        );
        if got != want {
            failures.push(format!("{what}: allowed {got}, want {want}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

//! Istio `AuthorizationPolicy` objects from the Kubernetes API (the
//! standalone kube mode's cluster discovery), against the in-test API server
//! (`support/fake_apiserver.rs`) with the real kube-rs client and watcher.
//!
//! - The `shunt agent` binary, given only a kubeconfig: policies created,
//!   modified and deleted show in its `/config_dump` (what an operator
//!   reads), a bad policy is named in its log (namespace/name and field)
//!   and replaced by its fail-closed stand-in while the good one applies.
//! - Cluster discovery in process, with the CRD not installed (404): pods
//!   are discovered anyway, the absence is said once however often the list
//!   is retried, and once the CRD is served its policies reach the store.
//!
//! Every wait is bounded; the API server listens on 127.0.0.1 only.

#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;
#[path = "support/kube_agent.rs"]
mod kube_agent;
#[path = "support/kube_harness.rs"]
mod kube_harness;

use std::{
    net::SocketAddr,
    path::PathBuf,
    sync::RwLock,
    time::{Duration, Instant},
};

use fake_apiserver::{FakeApiServer, Kind, authorization_policy, namespace, pod};
use kube_agent::{PinDir, spawn_agent_binary};
use kube_harness::{cluster_store, http_get as admin_get, wait_for};
use serde_json::{Value, json};
use shunt::{api::config_dump::ConfigDump, control::kube::ClusterWorkloads, store::WorkloadStore};
use shunt_testbed::{Topology, require_root};

/// Upper bound for anything the agent should do after a change.
const TIMEOUT: Duration = Duration::from_secs(20);
const POLICIES_PATH: &str = "/apis/security.istio.io/v1/authorizationpolicies";

// ---------------------------------------------------------------- logging

#[path = "support/captured_logs.rs"]
mod captured_logs;
use captured_logs::log_lines_with;

fn init_logging() {
    captured_logs::init_logging("info,shunt=debug");
}

// ---------------------------------------------------------------- policies

const CLIENT: &str = "cluster.local/ns/shop/sa/client";

/// ALLOW the client's principal to the pods labelled `app: web`.
fn allow_client() -> Value {
    authorization_policy(
        "shop",
        "allow-client",
        json!({"selector": {"matchLabels": {"app": "web"}},
               "action": "ALLOW",
               "rules": [{"from": [{"source": {"principals": [CLIENT]}}]}]}),
    )
}

/// A typo (`principal`): an unknown field.
fn typo() -> Value {
    authorization_policy(
        "shop",
        "typo",
        json!({"selector": {"matchLabels": {"app": "web"}},
               "rules": [{"from": [{"source": {"principal": ["x"]}}]}]}),
    )
}

// ---------------------------------------------------------------- the binary

/// `(namespace/name, action, rules)` of each policy `/config_dump` lists,
/// and the policies it says apply to workload `shop/web`.
type Seen = (Vec<(String, String, usize)>, Vec<String>);

fn config_dump(admin: SocketAddr) -> Option<Seen> {
    let (code, body) = admin_get(admin, "/config_dump").ok()?;
    if code != 200 {
        return None;
    }
    let dump: ConfigDump = serde_json::from_str(&body).ok()?;
    let policies = dump
        .policies
        .iter()
        .map(|p| {
            (
                format!("{}/{}", p.namespace, p.name),
                p.action.clone(),
                p.rules.len(),
            )
        })
        .collect();
    let web = dump
        .workloads
        .iter()
        .find(|w| w.namespace == "shop" && w.name == "web")?
        .shunt
        .policies
        .clone();
    Some((policies, web))
}

/// The `shunt agent` binary without `--workloads` takes its cluster view,
/// policies included, from the Kubernetes API named by `KUBECONFIG`:
/// created, modified and deleted policies show in `/config_dump`; a bad one
/// is named in the log with its field, and its stand-in (an ALLOW with no
/// rule: fail closed) applies beside the good one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kube_policies_follow_create_modify_delete_in_config_dump() {
    require_root().expect("the agent binary loads eBPF: run as root");
    let topo = Topology::new("kube-authz").expect("topology");
    let pin_dir = PinDir(PathBuf::from(format!("/sys/fs/bpf/{}-kube", topo.prefix())));
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.apply(
        Kind::Namespace,
        namespace("shop", json!({"istio.io/dataplane-mode": "ambient"})),
    );
    // On another node: discovered, never enrolled here.
    server.apply(
        Kind::Pod,
        pod(
            "shop",
            "web",
            "node-b",
            Some("198.18.2.10"),
            json!({"app": "web"}),
        ),
    );
    server.apply(Kind::AuthorizationPolicy, allow_client());
    server.apply(Kind::AuthorizationPolicy, typo());

    let kubeconfig = server.write_kubeconfig(dir.path());
    let agent = spawn_agent_binary(
        "node-a",
        &kubeconfig,
        &pin_dir.0,
        &topo.cgroup_root().expect("topology cgroup"),
        dir.path(),
        &[],
    );
    let (admin, agent_log) = (agent.admin, || agent.log());
    let wait_dump = |what: &str, want: Seen| {
        let start = Instant::now();
        let mut last = None;
        loop {
            let seen = config_dump(admin);
            if seen.as_ref() == Some(&want) {
                return;
            }
            if seen.is_some() {
                last = seen;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "{what}: /config_dump shows {last:?}, wanted {want:?}; the agent's log:\n{}",
                agent_log()
            );
            std::thread::sleep(Duration::from_millis(100));
        }
    };
    let entry =
        |name: &str, action: &str, rules: usize| (name.to_owned(), action.to_owned(), rules);

    tokio::task::block_in_place(|| {
        wait_dump(
            "both policies listed",
            (
                vec![
                    entry("shop/allow-client", "Allow", 1),
                    // The stand-in of the broken ALLOW: allows nothing.
                    entry("shop/typo", "Allow", 0),
                ],
                vec!["shop/allow-client".into(), "shop/typo".into()],
            ),
        )
    });
    let log = agent_log();
    let named: Vec<&str> = log
        .lines()
        .filter(|l| {
            l.contains(
                "AuthorizationPolicy shop/typo: field `spec.rules[0].from[0].source.principal`: unknown field",
            )
        })
        .collect();
    assert!(!named.is_empty(), "the bad policy is named: {log}");
    assert!(
        named[0].contains(
            "the policy is ignored and an ALLOW policy with no rule (allows nothing) takes its place for the workloads labelled app=web"
        ),
        "{}",
        named[0]
    );

    // Modified: now a DENY with two rules.
    server.update(Kind::AuthorizationPolicy, "shop", "allow-client", |p| {
        p["spec"]["action"] = json!("DENY");
        p["spec"]["rules"] = json!([
            {"to": [{"operation": {"ports": ["22"]}}]},
            {"from": [{"source": {"namespaces": ["untrusted"]}}]}
        ]);
    });
    tokio::task::block_in_place(|| {
        wait_dump(
            "the modification applied",
            (
                vec![
                    entry("shop/allow-client", "Deny", 2),
                    entry("shop/typo", "Allow", 0),
                ],
                vec!["shop/allow-client".into(), "shop/typo".into()],
            ),
        )
    });

    // Deleted: gone from the dump and from the workload's list.
    server.delete(Kind::AuthorizationPolicy, "shop", "allow-client");
    tokio::task::block_in_place(|| {
        wait_dump(
            "the deletion applied",
            (
                vec![entry("shop/typo", "Allow", 0)],
                vec!["shop/typo".into()],
            ),
        )
    });
}

// ---------------------------------------------------------------- no CRD

fn policy_names(store: &RwLock<WorkloadStore>) -> Vec<String> {
    store
        .read()
        .unwrap_or_else(|p| p.into_inner())
        .policies()
        .iter()
        .map(|p| p.key().to_string())
        .collect()
}

/// Istio not installed (the API server answers 404 for the CRD's group):
/// discovery goes on without policies (pods reach the store), the absence
/// is said once while the list is retried; once the CRD is served, its
/// policies apply.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_crd_discovery_goes_on_and_policies_come_when_it_is_installed() {
    init_logging();
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.set_served(Kind::AuthorizationPolicy, false);
    server.apply(Kind::Namespace, namespace("shop", json!({})));
    server.apply(
        Kind::Pod,
        pod(
            "shop",
            "web",
            "node-b",
            Some("198.18.2.10"),
            json!({"app": "web"}),
        ),
    );
    let discovery = ClusterWorkloads::new(server.client(dir.path()).await);
    let (store, sink) = cluster_store();
    let task = tokio::spawn(discovery.run(sink));

    wait_for("the pod discovered without the CRD", TIMEOUT, || {
        store.read().unwrap_or_else(|p| p.into_inner()).len() == 1
    })
    .await;
    let list_attempts = || {
        server
            .requests()
            .iter()
            .filter(|r| r.path == POLICIES_PATH)
            .count()
    };
    wait_for("the policy list retried twice", TIMEOUT, || {
        list_attempts() >= 3
    })
    .await;
    let absent = log_lines_with(&["AuthorizationPolicy CRD", "is not installed"]);
    assert_eq!(
        absent.len(),
        1,
        "said once over {} attempts: {absent:#?}",
        list_attempts()
    );
    assert!(policy_names(&store).is_empty());

    // Istio is installed, with a policy: it applies at the next retry.
    server.set_served(Kind::AuthorizationPolicy, true);
    server.apply(Kind::AuthorizationPolicy, allow_client());
    wait_for(
        "the policy in the store once the CRD is served",
        TIMEOUT,
        || policy_names(&store) == ["shop/allow-client"],
    )
    .await;
    assert_eq!(
        log_lines_with(&["authorizationpolicies.security.istio.io is served now"]).len(),
        1
    );
    assert_eq!(
        store.read().unwrap_or_else(|p| p.into_inner()).len(),
        1,
        "the pod stayed"
    );
    task.abort();
}

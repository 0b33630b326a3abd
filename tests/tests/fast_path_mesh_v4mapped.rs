//! A dual-stack socket's IPv4-mapped connect (`::ffff:198.18.x.y`) from an
//! enrolled pod to a mesh pod of the same node, with the fast path on:
//! connect6 sees it (not connect4), and it must never be carried around
//! the authorization policies — carried in the kernel only when the
//! destination's verdict allows it, refused at connect() (EPERM) when it
//! denies it, exactly as the plain IPv4 connect is.

use serde_json::Value;
use shunt_testbed::{
    Pod,
    agent::Agent,
    apps::{HalfEcho, TestApp, local_of, via_the_proxy},
    authz_bed::{AuthzBed, policy_file},
    fast_path::{mesh_enabled, policies_compiled},
    scrape::{sample, wait_metrics},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
/// connect() failing with EPERM: the kernel refused it.
const EPERM: i64 = 1;

const ALLOW_CLIENT_ONLY: &str = "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: allow-client, namespace: default}
    spec:
      selector: {matchLabels: {app: server}}
      action: ALLOW
      rules: [{from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]}]
";

/// The bed's agent with policies `policies` written, once the kernel's
/// table was compiled from `names`.
fn apply_policies(bed: &AuthzBed, policies: &str, names: &[&str]) {
    bed.agent
        .write_workloads(&policy_file(bed.pods(), policies))
        .expect("write the file");
    policies_compiled(&bed.agent, names);
}

/// `from`'s application connects to the server's 8080 through a dual-stack
/// socket, at the server's IPv4 address mapped into IPv6.
fn connect_mapped(apps: &TestApp<'_>, from: &Pod, server: &Pod) -> Value {
    let to = format!("[::ffff:{}]:8080", server.ip());
    apps.run(
        from,
        &["connect", &to, "--send", "4096", "--timeout-ms", "5000"],
    )
}

fn proxy_streams(agent: &Agent) -> (u64, u64) {
    let p = agent.status().expect("status").proxy.expect("a proxy");
    (p.outbound_hbone, p.inbound_hbone)
}

#[test]
fn a_v4_mapped_connect_to_a_same_node_mesh_pod_is_never_carried_around_policy() {
    let bed = AuthzBed::start(
        "fpmapped",
        TESTAPP,
        "",
        &[
            "--redirect",
            "ebpf",
            "--verify-interval",
            "1",
            "--fast-path",
            "on",
        ],
    );
    let node = bed.client.node().clone();
    let apps = TestApp::new(TESTAPP, &bed.apps);
    mesh_enabled(&node, &bed.agent, true);
    let half = HalfEcho::on(&bed.server, 8080);

    // No policy: the mapped connect works (the server answers half of
    // what it read).
    let report = connect_mapped(&apps, &bed.intruder, &bed.server);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(report["received"].as_u64(), Some(2048), "{report}");

    // A policy that allows only the client: the intruder's mapped connect
    // reaches nothing — refused by the kernel at connect(), or by the
    // server's proxy; never carried to the application.
    apply_policies(&bed, ALLOW_CLIENT_ONLY, &["default/allow-client"]);
    mesh_enabled(&node, &bed.agent, true);
    let seen = half.peers().len();
    let streams = proxy_streams(&bed.agent);
    let report = connect_mapped(&apps, &bed.intruder, &bed.server);
    assert_ne!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(
        half.peers().len(),
        seen,
        "the denied mapped connect reached the server's application: {report}"
    );
    // Where: the kernel refused it (the fast path checked the verdict).
    assert_eq!(report["errno"].as_i64(), Some(EPERM), "{report}");
    assert_eq!(
        proxy_streams(&bed.agent),
        streams,
        "refused before any proxy"
    );
    wait_metrics(&node, &bed.agent, "the kernel's denial counted", |m| {
        sample(
            m,
            "shunt_pod_policy_denials_total",
            &[("pod", "intruder"), ("policy", "default/allow-client")],
        )
        .is_some_and(|n| n >= 1.0)
    });

    // The allowed client's mapped connect still works, carried in the
    // kernel from its own address.
    let report = connect_mapped(&apps, &bed.client, &bed.server);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(report["received"].as_u64(), Some(2048), "{report}");
    assert!(!via_the_proxy(&report), "carried in the kernel: {report}");
    let local = local_of(&report);
    let local_v4 = match local.ip() {
        std::net::IpAddr::V6(v6) => v6.to_ipv4_mapped(),
        std::net::IpAddr::V4(v4) => Some(v4),
    };
    assert_eq!(local_v4, Some(bed.client.ip()), "{report}");
}

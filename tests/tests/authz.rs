//! Istio L4 authorization on the real kernel: `AuthorizationPolicy` objects
//! from the workloads file, enforced by the destination's proxy on inbound
//! HBONE (401 on the CONNECT, before the application is dialled) and on
//! inbound plaintext (reset; plaintext has no principal), counted in
//! `/metrics` with `response_flags="DENY"` and logged with the policy's name.
//!
//! One node, pods `client` and `server` (namespace default), `intruder`
//! (namespace other, its own service account) in the mesh, `outsider` not.

use std::{
    process::Stdio,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt_testbed::{
    agent::http,
    apps::{EchoServer, TestApp, ok},
    authz_bed::{AuthzBed, policy_file},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT: &str = "cluster.local/ns/default/sa/sa-client";
const INTRUDER: &str = "spiffe://cluster.local/ns/other/sa/sa-intruder";

/// The shared bed; this file's own helpers are on `Bed`.
struct Bed(AuthzBed);

impl std::ops::Deref for Bed {
    type Target = AuthzBed;
    fn deref(&self) -> &AuthzBed {
        &self.0
    }
}

impl std::ops::DerefMut for Bed {
    fn deref_mut(&mut self) -> &mut AuthzBed {
        &mut self.0
    }
}

impl Bed {
    fn start(test: &str, mode: &str, policies: &str) -> Bed {
        // These tests are about the proxy's enforcement point (401, access
        // log, DENY metrics): the kernel's, which would refuse these
        // same-node connects first, is tested in authz_kernel.rs.
        let args = [
            "--redirect",
            mode,
            "--log-format",
            "json",
            "--kernel-authz",
            "off",
        ];
        Bed(AuthzBed::start(test, TESTAPP, policies, &args))
    }

    fn metrics(&self) -> String {
        let port = self.agent.endpoints().metrics.port();
        let (code, body) = http(self.client.node(), "GET", port, "/metrics").expect("GET /metrics");
        assert_eq!(code, 200, "{body}");
        body
    }

    /// Waits (bounded) for a `/metrics` sample of `name` carrying every
    /// label of `labels`, with a value of at least `at_least`.
    fn wait_for_sample(&self, name: &str, labels: &[&str], at_least: f64) {
        let start = Instant::now();
        loop {
            let text = self.metrics();
            let value = text
                .lines()
                .filter(|l| l.starts_with(&format!("{name}{{")))
                .filter(|l| labels.iter().all(|m| l.contains(m)))
                .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
                .sum::<f64>();
            if value >= at_least {
                return;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "no {name} with {labels:?} >= {at_least}:\n{text}"
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    /// Waits (bounded) for an access-log line of `direction` that
    /// `matches`; returns it.
    fn wait_for_access_line(
        &self,
        direction: &str,
        what: &str,
        matches: impl Fn(&Value) -> bool,
    ) -> Value {
        let start = Instant::now();
        loop {
            let logs = self.agent.logs();
            let lines: Vec<Value> = logs
                .lines()
                .filter_map(|l| serde_json::from_str::<Value>(l).ok())
                .filter(|l| l["target"] == "shunt::access" && l["fields"]["direction"] == direction)
                .collect();
            if let Some(line) = lines.iter().find(|l| matches(l)) {
                return line.clone();
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "no {direction} access-log line: {what}; seen: {lines:#?}"
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn stop(mut self) {
        let exit = self.agent.stop().expect("stop");
        assert!(exit.success(), "{}", self.agent.logs());
    }
}

fn field<'a>(line: &'a Value, name: &str) -> &'a str {
    line["fields"][name].as_str().unwrap_or("")
}

/// An ALLOW by principal (selecting the server by label) lets the client
/// in and keeps the intruder (another service account) and plaintext out:
/// the intruder's CONNECT gets 401 (its app sees the connection fail), the
/// denial is counted with `response_flags="DENY"` and logged naming the
/// policy; plaintext from outside the mesh has no principal, so it is
/// reset. A broken policy in the same file is reported, file, entry and
/// field, and the others still apply.
fn allow_by_principal(mode: &str) {
    let policies = format!(
        "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: allow-client, namespace: default}}
    spec:
      selector: {{matchLabels: {{app: server}}}}
      action: ALLOW
      rules:
      - from:
        - source: {{principals: [\"{CLIENT}\"]}}
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: typo, namespace: default}}
    spec:
      selector: {{matchLabels: {{app: server}}}}
      rules: [{{from: [{{source: {{principal: [x]}}}}]}}]
"
    );
    let bed = Bed::start(&format!("authz-principal-{mode}"), mode, &policies);
    let echo = EchoServer::on(&bed.server, 8080).expect("echo");
    let logs = bed.agent.logs();
    assert!(
        logs.contains("authorizationPolicies[1] (default/typo): field `spec.rules[0].from[0].source.principal`: unknown field"),
        "the broken policy is reported: {logs}"
    );

    // `shunt status` and `/config_dump` name the policies guarding the
    // server (the broken one by its stand-in).
    let status = bed.agent.status().expect("status");
    let server = status
        .pods
        .iter()
        .find(|p| p.name == "server")
        .expect("server in status");
    assert_eq!(server.policies, ["default/allow-client", "default/typo"]);
    let admin = bed.agent.endpoints().admin.port();
    let (code, body) = http(bed.client.node(), "GET", admin, "/config_dump").expect("config_dump");
    assert_eq!(code, 200, "{body}");
    let dump: Value = serde_json::from_str(&body).expect("config_dump is JSON");
    let listed: Vec<(&str, &str, u64)> = dump["policies"]
        .as_array()
        .expect("policies listed")
        .iter()
        .map(|p| {
            (
                p["name"].as_str().unwrap_or(""),
                p["action"].as_str().unwrap_or(""),
                p["rules"].as_array().map_or(99, |r| r.len() as u64),
            )
        })
        .collect();
    assert_eq!(
        listed,
        [("allow-client", "Allow", 1), ("typo", "Allow", 0)],
        "{body}"
    );

    let report = bed.connect(&bed.client, 8080);
    assert!(
        ok(&report),
        "the client is allowed: {report}\n{}",
        bed.agent.logs()
    );
    assert_eq!(echo.accepted().len(), 1);
    let line = bed.wait_for_access_line("inbound", "the client's stream, allowed", |l| {
        field(l, "src.identity") == format!("spiffe://{CLIENT}") && field(l, "result") == "success"
    });
    assert_eq!(field(&line, "policy"), "default/allow-client", "{line}");

    let report = bed.connect(&bed.intruder, 8080);
    assert!(!ok(&report), "the intruder got through: {report}");
    assert_eq!(report["received"], Value::Null, "{report}");
    assert_eq!(
        echo.accepted().len(),
        1,
        "the application saw a denied peer"
    );
    let line = bed.wait_for_access_line("inbound", "the intruder's stream, denied", |l| {
        field(l, "src.identity") == INTRUDER && field(l, "result") == "denied"
    });
    assert_eq!(field(&line, "policy"), "default/allow-client", "{line}");
    assert!(field(&line, "reason").starts_with("401 "), "{line}");
    bed.wait_for_sample(
        "istio_tcp_connections_closed_total",
        &[
            "reporter=\"destination\"",
            &format!("source_principal=\"{INTRUDER}\""),
            "response_flags=\"DENY\"",
        ],
        1.0,
    );
    bed.wait_for_sample(
        "istio_tcp_connections_opened_total",
        &[&format!("source_principal=\"{INTRUDER}\"")],
        1.0,
    );

    // Plaintext from outside the mesh: no principal, never allowed here.
    let report = bed.connect(&bed.outsider, 8080);
    assert!(!ok(&report), "plaintext got through: {report}");
    assert_eq!(echo.accepted().len(), 1, "the application saw plaintext");
    let line = bed.wait_for_access_line("inbound_plaintext", "the plaintext, denied", |l| {
        field(l, "result") == "denied"
    });
    assert_eq!(field(&line, "policy"), "default/allow-client", "{line}");
    bed.wait_for_sample(
        "istio_tcp_connections_closed_total",
        &["source_principal=\"unknown\"", "response_flags=\"DENY\""],
        1.0,
    );
    drop(echo);
    bed.stop();
}

#[test]
fn allow_by_principal_keeps_others_out_in_ebpf_mode() {
    allow_by_principal("ebpf");
}

#[test]
fn allow_by_principal_keeps_others_out_in_iptables_mode() {
    allow_by_principal("iptables");
}

/// `source.serviceAccounts` (a bare account is of the policy's namespace):
/// the client's account is let in, the intruder's (another namespace and
/// account) gets 401, and plaintext, which has no service account, is
/// reset — where an unread field would have opened the server to all.
/// An L7-only DENY beside it (`to: methods`) denies nothing, as ztunnel
/// reads istiod's translation of it.
fn allow_by_service_account(mode: &str) {
    let policies = "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: allow-client-sa, namespace: default}
    spec:
      selector: {matchLabels: {app: server}}
      rules: [{from: [{source: {serviceAccounts: [sa-client]}}]}]
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: no-get, namespace: default}
    spec:
      action: DENY
      rules: [{to: [{operation: {methods: [GET]}}]}]
";
    let bed = Bed::start(&format!("authz-sa-{mode}"), mode, policies);
    let echo = EchoServer::on(&bed.server, 8080).expect("echo");

    let report = bed.connect(&bed.client, 8080);
    assert!(
        ok(&report),
        "the client's service account is allowed: {report}\n{}",
        bed.agent.logs()
    );
    assert_eq!(echo.accepted().len(), 1);
    let line = bed.wait_for_access_line("inbound", "the client, allowed", |l| {
        field(l, "src.identity") == format!("spiffe://{CLIENT}") && field(l, "result") == "success"
    });
    assert_eq!(field(&line, "policy"), "default/allow-client-sa", "{line}");

    let report = bed.connect(&bed.intruder, 8080);
    assert!(
        !ok(&report),
        "another service account got through: {report}"
    );
    let line = bed.wait_for_access_line("inbound", "the intruder, denied", |l| {
        field(l, "src.identity") == INTRUDER && field(l, "result") == "denied"
    });
    assert_eq!(field(&line, "policy"), "default/allow-client-sa", "{line}");
    assert!(field(&line, "reason").starts_with("401 "), "{line}");

    let report = bed.connect(&bed.outsider, 8080);
    assert!(!ok(&report), "plaintext got through: {report}");
    let line = bed.wait_for_access_line("inbound_plaintext", "the plaintext, denied", |l| {
        field(l, "result") == "denied"
    });
    assert_eq!(field(&line, "policy"), "default/allow-client-sa", "{line}");
    assert_eq!(
        echo.accepted().len(),
        1,
        "the application saw a denied peer"
    );
    drop(echo);
    bed.stop();
}

#[test]
fn allow_by_service_account_in_ebpf_mode() {
    allow_by_service_account("ebpf");
}

#[test]
fn allow_by_service_account_in_iptables_mode() {
    allow_by_service_account("iptables");
}

/// Namespace-wide policies (no selector): a DENY of port 9090, and an
/// ALLOW from namespace default or from the outsider's address. The client
/// reaches 8080 but not 9090; the intruder (namespace other) reaches
/// nothing; plaintext from the outsider is allowed by its IP block.
fn namespace_wide_and_deny_by_port(mode: &str) {
    // The outsider's IP is known only once the topology exists: start
    // without policies, then write them (a live update of the file).
    let bed = Bed::start(&format!("authz-ns-{mode}"), mode, "");
    let policies = format!(
        "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: no-9090, namespace: default}}
    spec:
      action: DENY
      rules: [{{to: [{{operation: {{ports: [\"9090\"]}}}}]}}]
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: same-namespace, namespace: default}}
    spec:
      rules:
      - from: [{{source: {{namespaces: [default]}}}}]
      - from: [{{source: {{ipBlocks: [\"{}/32\"]}}}}]
",
        bed.outsider.ip()
    );
    bed.agent
        .write_workloads(&policy_file(bed.pods(), &policies))
        .expect("write the file");
    let start = Instant::now();
    while !bed.agent.logs().contains("authorization policies updated") {
        assert!(
            start.elapsed() < TIMEOUT,
            "policies never applied: {}",
            bed.agent.logs()
        );
        thread::sleep(Duration::from_millis(100));
    }
    let web = EchoServer::on(&bed.server, 8080).expect("echo");
    let admin = EchoServer::on(&bed.server, 9090).expect("echo");

    let report = bed.connect(&bed.client, 8080);
    assert!(ok(&report), "{report}\n{}", bed.agent.logs());
    let report = bed.connect(&bed.client, 9090);
    assert!(!ok(&report), "port 9090 is denied: {report}");
    assert!(admin.accepted().is_empty());
    let line = bed.wait_for_access_line("inbound", "the DENY of 9090", |l| {
        field(l, "result") == "denied" && field(l, "dst.addr").ends_with(":9090")
    });
    assert_eq!(field(&line, "policy"), "default/no-9090", "{line}");

    let report = bed.connect(&bed.intruder, 8080);
    assert!(!ok(&report), "namespace other is not allowed: {report}");
    let line = bed.wait_for_access_line("inbound", "the intruder, not allowed", |l| {
        field(l, "result") == "denied" && field(l, "src.identity") == INTRUDER
    });
    assert_eq!(field(&line, "policy"), "default/same-namespace", "{line}");

    let report = bed.connect(&bed.outsider, 8080);
    assert!(
        ok(&report),
        "the outsider's IP block is allowed: {report}\n{}",
        bed.agent.logs()
    );
    assert_eq!(web.accepted().len(), 2, "the client and the outsider");
    let line = bed.wait_for_access_line("inbound_plaintext", "the outsider, allowed", |l| {
        field(l, "result") == "success"
    });
    assert_eq!(field(&line, "policy"), "default/same-namespace", "{line}");
    drop((web, admin));
    bed.stop();
}

#[test]
fn namespace_wide_and_deny_by_port_in_ebpf_mode() {
    namespace_wide_and_deny_by_port("ebpf");
}

#[test]
fn namespace_wide_and_deny_by_port_in_iptables_mode() {
    namespace_wide_and_deny_by_port("iptables");
}

/// A DENY added while a connection is open closes it (the policy is
/// re-checked on every change, as ztunnel does); the log says why.
#[test]
fn a_policy_added_closes_an_open_connection_it_denies() {
    let bed = Bed::start("authz-revoke", "ebpf", "");
    let _echo = EchoServer::on(&bed.server, 8080).expect("echo");
    let apps = TestApp::new(TESTAPP, &bed.apps);
    let to = format!("{}:8080", bed.server.ip());
    let mut hold = apps
        .command(&bed.client, &["hold", &to, "--seconds", "60"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("hold");
    // Open once the server's proxy reports the stream open.
    bed.wait_for_sample(
        "istio_tcp_connections_opened_total",
        &[
            "reporter=\"destination\"",
            &format!("source_principal=\"spiffe://{CLIENT}\""),
        ],
        1.0,
    );
    let deny = format!(
        "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {{name: no-client, namespace: default}}
    spec:
      action: DENY
      rules: [{{from: [{{source: {{principals: [\"{CLIENT}\"]}}}}]}}]
"
    );
    bed.agent
        .write_workloads(&policy_file(bed.pods(), &deny))
        .expect("write the file");
    let start = Instant::now();
    let exit = loop {
        if let Some(status) = hold.try_wait().expect("wait") {
            break status;
        }
        if start.elapsed() > TIMEOUT {
            let _ = hold.kill();
            panic!("the held connection stayed open: {}", bed.agent.logs());
        }
        thread::sleep(Duration::from_millis(100));
    };
    let output = hold.wait_with_output().expect("hold output");
    let report = String::from_utf8_lossy(&output.stdout);
    assert!(!exit.success(), "hold ended cleanly: {report}");
    assert!(report.contains("\"ok\":false"), "{report}");
    let line = bed.wait_for_access_line("inbound", "the held stream, closed", |l| {
        field(l, "result") == "denied"
    });
    assert_eq!(field(&line, "policy"), "default/no-client", "{line}");
    assert!(
        field(&line, "reason").contains("policies changed"),
        "{line}"
    );
    bed.stop();
}

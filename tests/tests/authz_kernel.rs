//! The kernel's authorization point (issue 15): the engine's verdicts for
//! connects between enrolled pods of one node, compiled into
//! `SHUNT_POLICY_VERDICTS` and checked by connect4/6. One engine, two
//! enforcement points: every case runs against the kernel (a denied
//! connect fails with EPERM) and against the proxy alone
//! (`--kernel-authz off`: the CONNECT gets 401 and the app's connection is
//! reset), and both must give the expected verdict.
//!
//! One node, pods `client` (namespace default), `intruder` (namespace
//! other, its own service account), `server` (labelled `app: server`) in
//! the mesh, `outsider` not.

use std::{
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt_testbed::{
    Pod,
    agent::http,
    apps::{EchoServer, ok},
    authz_bed::{AuthzBed, policy_file},
    inspect,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const CLIENT: &str = "cluster.local/ns/default/sa/sa-client";
/// connect() failing with EPERM: the kernel refused it.
const EPERM: i64 = 1;

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
    fn start(test: &str, extra: &[&str]) -> Bed {
        let mut args = vec!["--redirect", "ebpf", "--verify-interval", "1"];
        args.extend_from_slice(extra);
        Bed(AuthzBed::start(test, TESTAPP, "", &args))
    }

    /// The policies the proxy's store holds, from `/config_dump`.
    fn store_policies(&self) -> Vec<String> {
        let admin = self.agent.endpoints().admin.port();
        let (code, body) =
            http(self.client.node(), "GET", admin, "/config_dump").expect("config_dump");
        assert_eq!(code, 200, "{body}");
        let dump: Value = serde_json::from_str(&body).expect("config_dump is JSON");
        let mut names: Vec<String> = dump["policies"]
            .as_array()
            .map(|policies| {
                policies
                    .iter()
                    .map(|p| {
                        format!(
                            "{}/{}",
                            p["namespace"].as_str().unwrap_or(""),
                            p["name"].as_str().unwrap_or("")
                        )
                    })
                    .collect()
            })
            .unwrap_or_default();
        names.sort();
        names
    }

    /// Writes `policies` into the file and waits (bounded) until the
    /// store holds exactly `names` and, with the kernel point, until the
    /// kernel's table was compiled from them.
    fn apply_policies(&self, policies: &str, names: &[String], kernel: bool) {
        self.agent
            .write_workloads(&policy_file(self.pods(), policies))
            .expect("write the file");
        let start = Instant::now();
        loop {
            let stored = self.store_policies() == names;
            let compiled = !kernel
                || self.agent.status().ok().is_some_and(|s| {
                    s.kernel_authz
                        .is_some_and(|k| k.policies == names && k.error.is_none())
                });
            if stored && compiled {
                return;
            }
            assert!(
                start.elapsed() < TIMEOUT,
                "policies {names:?} never applied (stored: {stored}, compiled: {compiled}): {}",
                self.agent.logs()
            );
            thread::sleep(Duration::from_millis(100));
        }
    }

    fn metrics(&self) -> String {
        let port = self.agent.endpoints().metrics.port();
        let (code, body) = http(self.client.node(), "GET", port, "/metrics").expect("GET /metrics");
        assert_eq!(code, 200, "{body}");
        body
    }

    /// The enrolment slot of `pod` (its netns cookie from `/status`, its
    /// slot from the pinned enrolment map).
    fn slot(&self, pod: &Pod) -> u32 {
        let status = self.agent.status().expect("status");
        let cookie = status
            .pods
            .iter()
            .find(|p| p.name == pod.name())
            .and_then(|p| p.netns_cookie)
            .expect("an enrolled pod has a netns cookie");
        let entries = inspect::enrolled_entries(self.agent.pin_dir()).expect("enrolment map");
        *entries.get(&cookie).expect("the pod's enrolment entry")
    }

    fn stop(mut self) {
        let exit = self.agent.stop().expect("stop");
        assert!(exit.success(), "{}", self.agent.logs());
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Who {
    Client,
    Intruder,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Outcome {
    Allowed,
    /// connect() failed with EPERM.
    RefusedByKernel,
    /// The connection failed otherwise (the proxy's 401 or reset).
    RefusedByProxy,
}

struct Case {
    what: &'static str,
    /// YAML items under `authorizationPolicies:`; `{n}` is the case's
    /// number, so each case's policies have names of their own.
    policies: &'static str,
    names: &'static [&'static str],
    /// (from, port, allowed)
    probes: &'static [(Who, u16, bool)],
}

const CASES: &[Case] = &[
    Case {
        what: "ALLOW by principal",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-allow-client, namespace: default}
    spec:
      selector: {matchLabels: {app: server}}
      action: ALLOW
      rules: [{from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]}]
",
        names: &["c{n}-allow-client"],
        probes: &[(Who::Client, 8080, true), (Who::Intruder, 8080, false)],
    },
    Case {
        what: "DENY by port",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-no-9090, namespace: default}
    spec:
      action: DENY
      rules: [{to: [{operation: {ports: [\"9090\"]}}]}]
",
        names: &["c{n}-no-9090"],
        probes: &[(Who::Client, 9090, false), (Who::Client, 8080, true)],
    },
    Case {
        what: "namespace-wide ALLOW of namespace default",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-same-namespace, namespace: default}
    spec:
      rules: [{from: [{source: {namespaces: [default]}}]}]
",
        names: &["c{n}-same-namespace"],
        probes: &[(Who::Client, 8080, true), (Who::Intruder, 8080, false)],
    },
    Case {
        what: "DENY beats ALLOW",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-allow-client, namespace: default}
    spec:
      rules: [{from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]}]
  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-deny-client-8080, namespace: default}
    spec:
      action: DENY
      rules:
      - from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]
        to: [{operation: {ports: [\"8080\"]}}]
",
        names: &["c{n}-allow-client", "c{n}-deny-client-8080"],
        probes: &[(Who::Client, 8080, false), (Who::Client, 9090, true)],
    },
    Case {
        what: "a port no policy names",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-client-8080, namespace: default}
    spec:
      rules:
      - from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]
        to: [{operation: {ports: [\"8080\"]}}]
",
        names: &["c{n}-client-8080"],
        probes: &[
            (Who::Client, 8080, true),
            (Who::Client, 9090, false),
            (Who::Intruder, 8080, false),
        ],
    },
    Case {
        what: "ALLOW by service account",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-allow-client-sa, namespace: default}
    spec:
      selector: {matchLabels: {app: server}}
      rules: [{from: [{source: {serviceAccounts: [default/sa-client]}}]}]
",
        names: &["c{n}-allow-client-sa"],
        probes: &[(Who::Client, 8080, true), (Who::Intruder, 8080, false)],
    },
    Case {
        what: "DENY by service account (bare: the policy's namespace)",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-deny-client-sa, namespace: default}
    spec:
      action: DENY
      rules: [{from: [{source: {serviceAccounts: [sa-client]}}]}]
",
        names: &["c{n}-deny-client-sa"],
        probes: &[(Who::Client, 8080, false), (Who::Intruder, 8080, true)],
    },
    Case {
        what: "a DENY of only HTTP attributes denies nothing (ztunnel skips `{}`)",
        policies: "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: c{n}-no-get, namespace: default}
    spec:
      action: DENY
      rules: [{to: [{operation: {methods: [GET]}}]}]
",
        names: &["c{n}-no-get"],
        probes: &[(Who::Client, 8080, true), (Who::Intruder, 9090, true)],
    },
    Case {
        what: "no policy",
        policies: "",
        names: &[],
        probes: &[(Who::Client, 8080, true), (Who::Intruder, 9090, true)],
    },
];

/// Every case, in order, against one agent: the kernel point on (`kernel`)
/// or off.
fn run_cases(kernel: bool) {
    let test = if kernel {
        "authz-kernel-point"
    } else {
        "authz-proxy-point"
    };
    let extra: &[&str] = if kernel {
        &[]
    } else {
        &["--kernel-authz", "off"]
    };
    let bed = Bed::start(test, extra);
    let web = EchoServer::on(&bed.server, 8080).expect("echo 8080");
    let admin = EchoServer::on(&bed.server, 9090).expect("echo 9090");
    for (n, case) in CASES.iter().enumerate() {
        let policies = case.policies.replace("{n}", &n.to_string());
        let mut names: Vec<String> = case
            .names
            .iter()
            .map(|name| format!("default/{}", name.replace("{n}", &n.to_string())))
            .collect();
        names.sort();
        bed.apply_policies(&policies, &names, kernel);
        for &(who, port, allowed) in case.probes {
            let from = match who {
                Who::Client => &bed.client,
                Who::Intruder => &bed.intruder,
            };
            let seen_before = web.accepted().len() + admin.accepted().len();
            let report = bed.connect(from, port);
            let outcome = if ok(&report) {
                Outcome::Allowed
            } else if report["errno"].as_i64() == Some(EPERM) {
                Outcome::RefusedByKernel
            } else {
                Outcome::RefusedByProxy
            };
            let expected = match (allowed, kernel) {
                (true, _) => Outcome::Allowed,
                (false, true) => Outcome::RefusedByKernel,
                (false, false) => Outcome::RefusedByProxy,
            };
            assert_eq!(
                outcome,
                expected,
                "case {n} ({}): {who:?} to port {port}: {report}\n{}",
                case.what,
                bed.agent.logs()
            );
            let seen = web.accepted().len() + admin.accepted().len();
            assert_eq!(
                seen,
                seen_before + usize::from(allowed),
                "case {n} ({}): the application sees exactly the allowed connections",
                case.what
            );
        }
    }
    drop((web, admin));
    bed.stop();
}

#[test]
fn every_case_is_refused_in_the_kernel_with_eperm() {
    run_cases(true);
}

#[test]
fn every_case_is_refused_by_the_proxy_without_the_kernel_point() {
    run_cases(false);
}

/// A policy added takes effect in the kernel: the entry is written (read
/// from the pinned map), the next connect fails with EPERM, and the denial
/// is counted per pod and policy in `/metrics` and `shunt status`. Taking
/// the policy away deletes the entry and the connect goes through again.
#[test]
fn a_policy_change_reaches_the_kernel_and_its_denials_are_counted() {
    let bed = Bed::start("authz-kernel-change", &[]);
    let web = EchoServer::on(&bed.server, 8080).expect("echo");
    let report = bed.connect(&bed.client, 8080);
    assert!(ok(&report), "no policy yet: {report}");

    let slot = bed.slot(&bed.client);
    let entry = (slot, bed.server.ip(), 0);
    let verdicts = inspect::policy_verdicts(bed.agent.pin_dir()).expect("verdict map");
    assert!(verdicts.is_empty(), "no policy, no entry: {verdicts:?}");
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
    loop {
        let verdicts = inspect::policy_verdicts(bed.agent.pin_dir()).expect("verdict map");
        if verdicts.get(&entry).is_some_and(|(denied, _)| *denied) {
            break;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "no DENY entry {entry:?}: {verdicts:?}\n{}",
            bed.agent.logs()
        );
        thread::sleep(Duration::from_millis(50));
    }
    let report = bed.connect(&bed.client, 8080);
    assert_eq!(report["errno"].as_i64(), Some(EPERM), "{report}");
    assert_eq!(web.accepted().len(), 1, "the application saw the refusal");
    // The intruder is not denied: its connects have no entry.
    let report = bed.connect(&bed.intruder, 8080);
    assert!(ok(&report), "{report}");

    let sample = "shunt_pod_policy_denials_total{namespace=\"default\",pod=\"client\",policy=\"default/no-client\"} 1";
    let start = Instant::now();
    while !bed.metrics().lines().any(|l| l == sample) {
        assert!(
            start.elapsed() < TIMEOUT,
            "no {sample} in /metrics:\n{}",
            bed.metrics()
        );
        thread::sleep(Duration::from_millis(100));
    }
    let status = bed.agent.status().expect("status");
    let client = status
        .pods
        .iter()
        .find(|p| p.name == "client")
        .expect("client in status");
    assert_eq!(client.kernel_denials.len(), 1, "{client:?}");
    assert_eq!(client.kernel_denials[0].policy, "default/no-client");
    assert_eq!(client.kernel_denials[0].connects, 1);
    let kernel = status.kernel_authz.expect("the kernel point in /status");
    assert_eq!(kernel.policies, ["default/no-client"]);
    assert!(kernel.entries >= 1, "{kernel:?}");

    // The policy goes: so does the entry, and the connect goes through.
    bed.agent
        .write_workloads(&policy_file(bed.pods(), ""))
        .expect("write the file");
    let start = Instant::now();
    loop {
        let verdicts = inspect::policy_verdicts(bed.agent.pin_dir()).expect("verdict map");
        if verdicts.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "entries left: {verdicts:?}\n{}",
            bed.agent.logs()
        );
        thread::sleep(Duration::from_millis(50));
    }
    let report = bed.connect(&bed.client, 8080);
    assert!(ok(&report), "the policy is gone: {report}");
    drop(web);
    bed.stop();
}

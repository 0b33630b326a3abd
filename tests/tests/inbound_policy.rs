//! The inbound plaintext policy: with `--inbound-plaintext deny`, a client
//! outside the mesh cannot reach an enrolled pod (the connection is reset,
//! the application never sees it), and the refusal is counted and logged;
//! mesh (HBONE) traffic to the same pod still flows.

use std::time::Duration;

use serde_json::Value;
use shunt_testbed::{
    agent::MeshNode,
    apps::{EchoServer, TestApp, ok},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);

fn deny_refuses_plaintext_and_counts_it(mode: &str) {
    require_root().expect("kernel tests need root");
    let bed = MeshNode::start(
        &format!("policy-{mode}"),
        &["--redirect", mode, "--inbound-plaintext", "deny"],
    )
    .expect("node");
    let (client, server, outsider) = (&bed.client, &bed.server, &bed.outsider);
    let mut agent = bed.agent;
    let apps = TestApp::new(TESTAPP, &bed.apps);
    let echo = EchoServer::on(server, 8080).expect("echo");
    let to_server = format!("{}:8080", server.ip());

    let report = apps.run(outsider, &["connect", &to_server, "--send", "1024"]);
    assert!(
        !ok(&report),
        "plaintext got through a deny policy: {report}"
    );
    assert_eq!(report["received"], Value::Null, "{report}");
    assert!(
        echo.accepted().is_empty(),
        "the application saw a denied connection: {:?}",
        echo.accepted()
    );
    // Counted as it is logged, just after the reset the client saw.
    let status = agent
        .wait_for("the refusal counted", TIMEOUT, |s| {
            s.proxy.as_ref().is_some_and(|p| p.refused >= 1)
        })
        .expect("counted");
    let stats = status.proxy.expect("proxy");
    assert_eq!(stats.inbound_plaintext, 1, "{stats:?}");
    assert_eq!(stats.refused, 1, "{stats:?}");
    let logs = agent.logs();
    assert!(
        logs.contains("inbound plaintext to pod default/server denied by policy"),
        "{logs}"
    );

    // Mesh traffic to the same pod is not plaintext: it still flows.
    let report = apps.run(client, &["connect", &to_server, "--send", "4096"]);
    assert!(ok(&report), "{report}\n{}", agent.logs());
    assert_eq!(echo.accepted().len(), 1);

    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

#[test]
fn inbound_plaintext_deny_refuses_and_counts_in_ebpf_mode() {
    deny_refuses_plaintext_and_counts_it("ebpf");
}

#[test]
fn inbound_plaintext_deny_refuses_and_counts_in_iptables_mode() {
    deny_refuses_plaintext_and_counts_it("iptables");
}

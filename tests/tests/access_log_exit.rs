//! The access log survives the agent's exit: its lines are batched in
//! memory (issue 19: no proxy task writes to stderr per line), and the lines
//! of the last connections before SIGTERM still reach the log.
//!
//! The batch interval is set far beyond the test, so nothing reaches stderr
//! by time: only the exit's flush can write these lines (without it this
//! test sees none of them).

use shunt_testbed::{
    agent::MeshNode,
    apps::{EchoServer, TestApp, ok},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const CONNECTIONS: usize = 3;

#[test]
fn access_lines_of_the_last_connections_before_sigterm_are_in_the_log() {
    require_root().expect("kernel tests need root");
    let bed = MeshNode::start(
        "acclog-exit",
        &["--redirect", "ebpf", "--log-batch-interval-ms", "3600000"],
    )
    .expect("node");
    let (client, server) = (&bed.client, &bed.server);
    let mut agent = bed.agent;
    let apps = TestApp::new(TESTAPP, &bed.apps);
    let _echo = EchoServer::on(server, 8080).expect("echo");
    let to_server = format!("{}:8080", server.ip());
    for i in 0..CONNECTIONS {
        let report = apps.run(client, &["connect", &to_server, "--send", "1024"]);
        assert!(ok(&report), "connection {i}: {report}\n{}", agent.logs());
    }

    // No status, metrics or readiness request in between: those would
    // write the buffered lines themselves.
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());

    let logs = agent.logs();
    for direction in ["outbound", "inbound"] {
        let lines = logs
            .lines()
            .filter(|l| {
                l.contains("connection complete")
                    && l.contains(&format!("direction=\"{direction}\""))
                    && l.contains(&to_server)
                    && l.contains("result=\"success\"")
            })
            .count();
        assert_eq!(
            lines, CONNECTIONS,
            "{direction} access lines of the connections before SIGTERM:\n{logs}"
        );
    }
}

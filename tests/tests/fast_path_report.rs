//! What the fast path reports (issue 18): N connections that went direct
//! make exactly N opened, N closed and N access log lines, with the bytes
//! the applications moved — although the kernel wakes the agent only once a
//! batch of events is waiting — and `shunt status` shows the fast path: flow
//! 1's table, flow 2's switch (and why it is off), the connections each
//! carried, the events lost, and the pods that opted out.

use std::time::{Duration, Instant};

use serde_json::Value;
use shunt::api::NodeStatus;
use shunt_testbed::{
    Cgroup, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
    scrape::{sample, wait_metrics},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(60);
const FAST: [&str; 4] = ["--redirect", "ebpf", "--fast-path", "on"];
/// Bytes each connection sends (and gets back).
const SEND: u64 = 64;

/// The agent's CPU time so far (user + system, clock ticks of 10 ms).
fn agent_cpu(agent: &Agent) -> Option<Duration> {
    let stat = std::fs::read_to_string(format!("/proc/{}/stat", agent.pid()?)).ok()?;
    // Fields after the command's closing parenthesis: utime is the 12th.
    let rest = stat.rsplit_once(')')?.1;
    let fields: Vec<&str> = rest.split_whitespace().collect();
    let ticks: u64 = fields.get(11)?.parse::<u64>().ok()? + fields.get(12)?.parse::<u64>().ok()?;
    Some(Duration::from_millis(ticks * 10))
}

/// Polls `/status` until `done` holds.
fn wait_status(agent: &Agent, what: &str, done: impl Fn(&NodeStatus) -> bool) -> NodeStatus {
    let start = Instant::now();
    loop {
        let status = agent.status().expect("status");
        if done(&status) {
            return status;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "timed out waiting for {what}: {status:?}\n{}",
            agent.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

#[test]
fn n_direct_connections_make_n_reports_and_status_shows_the_fast_path() {
    require_root().expect("kernel tests need root");
    // FAST_PATH_REPORT_CONNECTIONS=5000 to measure the agent's CPU per
    // connection (printed, not asserted: performance goes to benchmarks).
    let connections: u64 = std::env::var("FAST_PATH_REPORT_CONNECTIONS")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(300);
    let (topo, pods) = Topology::single_node("fpreport", &["client", "keeper", "server", "plain"])
        .expect("topology");
    let [client, keeper, server, plain] = [0, 1, 2, 3].map(|i| pods[i].clone());
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec {
            fast_path: Some(false),
            ..WorkloadSpec::for_pod(&keeper, true)
        },
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec::for_pod(&plain, false),
    ]);
    let node = client.node().clone();
    let _echo = EchoServer::on(&plain, 8080).expect("echo");
    let _echo_server = EchoServer::on(&server, 8080).expect("echo");
    // FAST_PATH_REPORT_RUST_LOG (e.g. `info,shunt::access=warn`) to see
    // what the access lines cost; they are counted below only at info.
    let log_filter = std::env::var("FAST_PATH_REPORT_RUST_LOG").ok();
    let env: Vec<(&str, &str)> = log_filter
        .as_deref()
        .map(|f| vec![("RUST_LOG", f)])
        .unwrap_or_default();
    let mut agent = Agent::start_with_env(&topo, &node, &yaml, &FAST, &env).expect("agent");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    wait_metrics(&node, &agent, "both flows on", |m| {
        sample(m, "shunt_fast_path_table_valid", &[]) == Some(1.0)
            && sample(m, "shunt_fast_path_mesh_enabled", &[]) == Some(1.0)
    });

    // N connections outside the mesh (flow 1), each 64 bytes each way.
    let cpu_before = agent_cpu(&agent);
    let started = Instant::now();
    let to = format!("{}:8080", plain.ip());
    let report = apps.run(
        &client,
        &[
            "many",
            &to,
            "--count",
            &connections.to_string(),
            "--workers",
            "4",
            "--send",
            &SEND.to_string(),
        ],
    );
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(report["succeeded"].as_u64(), Some(connections), "{report}");
    // As ztunnel labels a plaintext connection to a workload it knows:
    // no source principal, the destination's identity.
    let principal = format!("spiffe://cluster.local/ns/default/sa/sa-{}", plain.name());
    let labels = [
        ("reporter", "source"),
        ("source_workload", client.name()),
        ("source_principal", "unknown"),
        ("destination_workload", plain.name()),
        ("destination_principal", principal.as_str()),
        ("response_flags", "-"),
    ];
    let text = wait_metrics(&node, &agent, "every connection counted closed", |m| {
        sample(m, "istio_tcp_connections_closed_total", &labels) == Some(connections as f64)
    });
    let elapsed = started.elapsed();
    if let (Some(before), Some(after)) = (cpu_before, agent_cpu(&agent)) {
        let cpu = after.saturating_sub(before);
        eprintln!(
            "agent CPU for {connections} direct connections: {cpu:?} ({:.1} µs per connection, over {elapsed:?})",
            cpu.as_secs_f64() * 1e6 / connections as f64
        );
    }
    for (name, want) in [
        ("istio_tcp_connections_opened_total", connections),
        ("istio_tcp_received_bytes_total", connections * SEND),
        ("istio_tcp_sent_bytes_total", connections * SEND),
    ] {
        assert_eq!(
            sample(&text, name, &labels),
            Some(want as f64),
            "{name}\n{text}"
        );
    }
    // One access line per connection (each names the destination).
    let start = Instant::now();
    while log_filter.is_none() {
        let logs = agent.logs();
        let lines = logs
            .lines()
            .filter(|l| {
                l.contains("connection complete")
                    && (l.contains("path=\"fast\"") || l.contains("path=fast"))
                    && l.contains(&to)
            })
            .count() as u64;
        if lines == connections {
            break;
        }
        assert!(
            lines < connections && start.elapsed() < TIMEOUT,
            "{lines} access lines for {connections} connections"
        );
        std::thread::sleep(Duration::from_millis(100));
    }

    // One same-node mesh connection (flow 2).
    let report = apps.run(
        &client,
        &[
            "connect",
            &format!("{}:8080", server.ip()),
            "--send",
            "4096",
        ],
    );
    assert_eq!(report["intact"], Value::Bool(true), "{report}");

    // What a user sees in `shunt status`.
    let status = wait_status(&agent, "the fast path's counters published", |s| {
        s.fast_path.as_ref().is_some_and(|f| {
            f.passthrough_connections >= connections && f.mesh_local_connections >= 1
        })
    });
    let fast = status.fast_path.clone().expect("fast path status");
    assert!(fast.enabled && fast.table_valid, "{fast:?}");
    assert!(fast.destinations >= 3, "the three mesh pods' IPs: {fast:?}");
    assert!(fast.mesh_local_on, "{fast:?}");
    assert_eq!(fast.mesh_local_off_reason, None, "{fast:?}");
    assert_eq!(fast.events_dropped, 0, "{fast:?}");
    let opt_out = |name: &str| {
        status
            .pods
            .iter()
            .find(|p| p.name == name)
            .map(|p| p.fast_path_opt_out)
    };
    assert_eq!(opt_out(keeper.name()), Some(true), "{status:?}");
    assert_eq!(opt_out(client.name()), Some(false), "{status:?}");
    let table = shunt::status::render_table(&status);
    let line = table
        .lines()
        .find(|l| l.starts_with("fast path: "))
        .unwrap_or_else(|| panic!("no fast path line:\n{table}"));
    for part in [
        "passthrough table valid",
        "same-node mesh on",
        "events lost 0",
    ] {
        assert!(line.contains(part), "{part:?} not in {line:?}");
    }
    assert!(
        table.contains("fast path opted out (through the proxy): default/keeper"),
        "{table}"
    );
    agent.stop().expect("stop");

    // --fast-path off: status says so, and why flow 2 is off.
    agent
        .restart(&["--redirect", "ebpf", "--fast-path", "off"])
        .expect("restart");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    let status = agent.status().expect("status");
    let fast = status.fast_path.clone().expect("fast path status");
    assert!(
        !fast.enabled && !fast.table_valid && !fast.mesh_local_on,
        "{fast:?}"
    );
    assert_eq!(
        fast.mesh_local_off_reason.as_deref(),
        Some("--fast-path off"),
        "{fast:?}"
    );
    let table = shunt::status::render_table(&status);
    assert!(
        table.contains("fast path: off (--fast-path off)"),
        "{table}"
    );
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

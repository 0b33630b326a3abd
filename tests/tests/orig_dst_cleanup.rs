//! The original destination of a redirected connection (`SHUNT_ORIG_DST`)
//! lives only as long as the connection: the kernel deletes the entry when
//! the proxy's accepted end closes (`ebpf/src/sockops.rs`). Before, the LRU
//! kept every closed connection's entry, and under churn dead entries could
//! evict live ones. Through the real `shunt agent` binary on the real
//! kernel, reading the pinned map as an operator would.

use std::{
    path::Path,
    process::Stdio,
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use serde_json::Value;
use shunt::api::{NodeStatus, PodState};
use shunt_common::{OriginalDst, SockKey, maps};
use shunt_testbed::{
    Cgroup, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    apps::{EchoServer, TestApp},
    require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const APP_PORT: u16 = 8080;
/// Connections closed gracefully, one process each.
const GRACEFUL: usize = 10;
/// Connections closed with a reset (`SO_LINGER` 0).
const RESET: usize = 40;

/// The `SHUNT_ORIG_DST` entries of the netns with cookie `netns`.
fn entries_for(pin_dir: &Path, netns: u64) -> Vec<(SockKey, OriginalDst)> {
    let path = pin_dir.join(maps::ORIGINAL_DST);
    let data = MapData::from_pin(&path).expect("open the pinned map");
    let map: BpfHashMap<MapData, SockKey, OriginalDst> =
        BpfHashMap::try_from(Map::LruHashMap(data)).expect("an LRU hash");
    map.iter()
        .filter_map(Result::ok)
        .filter(|(key, _)| key.netns_cookie == netns)
        .collect()
}

/// Waits (bounded) until `pred` holds for the netns's entries.
fn wait_entries(
    pin_dir: &Path,
    netns: u64,
    what: &str,
    pred: impl Fn(&[(SockKey, OriginalDst)]) -> bool,
) {
    let deadline = Instant::now() + TIMEOUT;
    loop {
        let entries = entries_for(pin_dir, netns);
        if pred(&entries) {
            return;
        }
        assert!(
            Instant::now() < deadline,
            "{what}: {} entries left for netns {netns}: {:?}",
            entries.len(),
            entries.iter().map(|(k, _)| k.port).collect::<Vec<_>>()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
}

fn cookie(status: &NodeStatus, name: &str) -> Option<u64> {
    status
        .pods
        .iter()
        .find(|p| p.name == name && p.state == PodState::Enrolled)
        .and_then(|p| p.netns_cookie)
}

#[test]
fn closed_connections_leave_no_original_destination_behind() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("origdst", &["client", "outsider"]).expect("topology");
    let [client, outsider] = [&pods[0], &pods[1]];
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(outsider, false),
    ]);
    let node = topo.node("node-a").expect("node").clone();
    // Fast path off: a destination outside the mesh goes through the
    // proxy (passthrough), whose accept reads the entry.
    let mut agent = Agent::start(
        &topo,
        &node,
        &yaml,
        &["--redirect", "ebpf", "--fast-path", "off"],
    )
    .expect("agent");
    let status = agent
        .wait_for("client enrolled", TIMEOUT, |s| {
            cookie(s, "client").is_some()
        })
        .expect("enrolled");
    let netns = cookie(&status, client.name()).expect("cookie");
    let _echo = EchoServer::on(outsider, APP_PORT).expect("echo");
    let target = format!("{}:{APP_PORT}", outsider.ip());
    let passthrough = || {
        agent
            .status()
            .expect("status")
            .proxy
            .map(|p| p.outbound_passthrough)
            .unwrap_or_default()
    };

    // A live connection has its entry (the map is read right).
    let held = apps
        .command(client, &["hold", &target, "--seconds", "8"])
        .stdout(Stdio::piped())
        .spawn()
        .expect("hold");
    wait_entries(agent.pin_dir(), netns, "the held connection's entry", |e| {
        e.len() == 1
    });
    let out = held.wait_with_output().expect("hold ends");
    let report: Value = serde_json::from_str(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .unwrap_or(""),
    )
    .expect("hold report");
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    wait_entries(agent.pin_dir(), netns, "after the held connection", |e| {
        e.is_empty()
    });

    // Many connections, closed gracefully and with resets, each through
    // the proxy with its bytes checked.
    let before = passthrough();
    for _ in 0..GRACEFUL {
        let report = apps.run(client, &["connect", &target, "--send", "4096"]);
        assert_eq!(report["intact"], Value::Bool(true), "{report}");
    }
    let count = RESET.to_string();
    let report = apps.run(
        client,
        &[
            "many",
            &target,
            "--count",
            &count,
            "--workers",
            "4",
            "--send",
            "512",
        ],
    );
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert!(
        passthrough() >= before + (GRACEFUL + RESET) as u64,
        "every connection went through the proxy"
    );
    wait_entries(
        agent.pin_dir(),
        netns,
        "after every connection closed",
        |e| e.is_empty(),
    );
}

//! Enrolment on the real kernel, through the real `shunt agent` binary: a pod
//! that opts in gets TC programs on its `eth0` (inside its netns) that count
//! exactly what crosses it; a pod that does not is never touched; leaving the
//! mesh, or stopping the agent, leaves nothing behind.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpListener},
    process::Command,
    thread,
    time::Duration,
};

use shunt::api::{NodeStatus, PodState, PodStatus};
use shunt_testbed::{
    Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    inspect::{self, LinkStats},
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(20);

fn topology(test: &str, pods: &[&str]) -> (Topology, Vec<Pod>) {
    require_root().expect("kernel tests need root");
    Topology::single_node(test, pods).expect("topology")
}

fn pod_status<'a>(status: &'a NodeStatus, pod: &Pod) -> &'a PodStatus {
    status
        .pods
        .iter()
        .find(|p| p.name == pod.name())
        .unwrap_or_else(|| panic!("pod {} missing from status {status:?}", pod.name()))
}

fn is_enrolled(status: &NodeStatus, pod: &Pod) -> bool {
    status
        .pods
        .iter()
        .any(|p| p.name == pod.name() && p.state == PodState::Enrolled)
}

/// Accepts one connection and echoes it back until EOF.
fn echo_once(listener: TcpListener) -> thread::JoinHandle<u64> {
    thread::spawn(move || {
        let (mut conn, _) = listener.accept().expect("accept");
        conn.set_read_timeout(Some(TIMEOUT)).expect("timeout");
        let mut total = 0u64;
        let mut buf = [0u8; 16 * 1024];
        loop {
            let n = conn.read(&mut buf).expect("read");
            if n == 0 {
                break;
            }
            conn.write_all(&buf[..n]).expect("echo");
            total += n as u64;
        }
        total
    })
}

/// Sends `len` bytes from `client` to `server`:`port`, reads the echo back and
/// checks it byte for byte.
fn echo_roundtrip(client: &Pod, server: &Pod, port: u16, len: usize) {
    let addr = SocketAddr::from((server.ip(), port));
    let listener = server.listen_tcp(addr).expect("listen");
    let echoed = echo_once(listener);
    let mut conn = client.connect_tcp(addr, TIMEOUT).expect("connect");
    conn.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    let payload: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    let writer = {
        let mut conn = conn.try_clone().expect("clone");
        let payload = payload.clone();
        thread::spawn(move || {
            conn.write_all(&payload).expect("send");
            conn.shutdown(std::net::Shutdown::Write).expect("shutdown");
        })
    };
    let mut back = Vec::with_capacity(len);
    conn.read_to_end(&mut back).expect("read echo");
    writer.join().expect("writer");
    assert_eq!(echoed.join().expect("echo thread"), len as u64);
    assert!(back == payload, "echoed bytes differ from what was sent");
}

fn link(pod: &Pod) -> LinkStats {
    inspect::link_stats(&pod.netns_path(), pod.interface()).expect("link stats")
}

/// The interface's counters once nothing has crossed it for 200 ms (late
/// ACKs of closing connections land at their own pace on a loaded machine):
/// bounded to 5 s.
fn quiet_link(pod: &Pod) -> LinkStats {
    let mut last = link(pod);
    for _ in 0..25 {
        thread::sleep(Duration::from_millis(200));
        let now = link(pod);
        if now == last {
            return now;
        }
        last = now;
    }
    last
}

fn shunt_filters(pod: &Pod) -> Vec<String> {
    ["ingress", "egress"]
        .iter()
        .flat_map(|hook| {
            inspect::tc_filters(&pod.netns_path(), pod.interface(), hook).expect("tc filter show")
        })
        .filter_map(|f| f.program)
        .collect()
}

/// One verified instance of the TC programs serves every pod (#20 part 6:
/// enrolment loads no program): both pods' filters run the same program, and
/// each filter names its pod's slot in its classid (minor = slot + 1), which
/// is how the shared program finds the pod's counters and settings.
#[test]
fn every_pod_runs_the_one_tc_program_with_its_slot_in_the_classid() {
    let (topo, pods) = topology("shared-tc", &["client", "server"]);
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&pods[0], true),
        WorkloadSpec::for_pod(&pods[1], true),
    ]);
    let mut agent = Agent::start(&topo, node, &yaml, &[]).expect("agent");
    let status = agent
        .wait_for("both pods enrolled", TIMEOUT, |s| {
            pods.iter().all(|pod| is_enrolled(s, pod))
        })
        .expect("enrolled");
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("map");
    for hook in ["ingress", "egress"] {
        let mut program_ids = Vec::new();
        for pod in &pods {
            let cookie = pod_status(&status, pod).netns_cookie.expect("cookie");
            let slot = *entries.get(&cookie).expect("the pod's entry");
            let filters =
                inspect::tc_filters(&pod.netns_path(), pod.interface(), hook).expect("tc");
            let [filter] = filters.as_slice() else {
                panic!(
                    "{} {hook}: expected one filter, found {filters:?}",
                    pod.name()
                );
            };
            assert_eq!(
                filter.classid_minor,
                Some(slot + 1),
                "{} {hook}: the classid names the pod's slot {slot}",
                pod.name()
            );
            program_ids.push(filter.program_id.expect("program id"));
        }
        assert_eq!(
            program_ids[0], program_ids[1],
            "{hook}: both pods run the same program instance"
        );
    }
    // And each pod's traffic lands in its own counters through it.
    echo_roundtrip(&pods[0], &pods[1], 7010, 16 * 1024);
    for pod in &pods {
        let cookie = pod_status(&status, pod).netns_cookie.expect("cookie");
        let slot = *entries.get(&cookie).expect("entry");
        let counters = inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
        assert!(
            counters.bytes_out >= 16 * 1024 && counters.bytes_in >= 16 * 1024,
            "{}: {counters:?}",
            pod.name()
        );
    }
}

#[test]
fn enrolled_pod_counts_exactly_what_crosses_eth0() {
    let (topo, pods) = topology("counts", &["client", "server", "outsider"]);
    let [client, server, outsider] = [&pods[0], &pods[1], &pods[2]];
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(server, true),
        WorkloadSpec::for_pod(outsider, false),
    ]);
    let node = topo.node("node-a").expect("node");
    let mut agent = Agent::start(&topo, node, &yaml, &[]).expect("agent");
    let status = agent
        .wait_for("both mesh pods enrolled", TIMEOUT, |s| {
            is_enrolled(s, client) && is_enrolled(s, server)
        })
        .expect("enrolled");
    assert_eq!(pod_status(&status, outsider).state, PodState::NotInMesh);

    // The TC programs count what the interface itself counts: read both
    // counts at the same moment, once nothing has crossed the interface for
    // 200 ms (the kernel's counters straight from the pinned map: the
    // status shows them only as of the last verify pass, seconds apart from
    // the interface's reading, and a stray packet in between made the
    // comparison flaky), move real bytes both ways, compare deltas.
    let cookie = pod_status(&status, client).netns_cookie.expect("cookie");
    let slot = *inspect::enrolled_entries(agent.pin_dir())
        .expect("map")
        .get(&cookie)
        .expect("client's entry");
    let kernel_counters = || inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
    let before = quiet_link(client);
    let before_counters = kernel_counters();
    echo_roundtrip(client, server, 7001, 256 * 1024);
    echo_roundtrip(outsider, client, 7002, 64 * 1024);
    // Let the last ACKs of the closing handshakes land before both counts
    // are read, so neither side of the comparison misses them.
    let after = quiet_link(client);
    let counters = kernel_counters();
    // `shunt status` shows those counters (as of its last verify pass).
    let status = agent.status_after_verify(TIMEOUT).expect("status");
    let shown = pod_status(&status, client).counters.expect("counters");
    assert!(
        shown.bytes_out >= counters.bytes_out && shown.bytes_in >= counters.bytes_in,
        "status {shown:?} behind the kernel's {counters:?}"
    );
    let delta = |a: u64, b: u64| a - b;
    assert_eq!(
        delta(counters.bytes_out, before_counters.bytes_out),
        delta(after.tx_bytes, before.tx_bytes),
        "bytes out: TC counter vs interface; counters {counters:?}, link {before:?} -> {after:?}"
    );
    assert_eq!(
        delta(counters.bytes_in, before_counters.bytes_in),
        delta(after.rx_bytes, before.rx_bytes),
        "bytes in"
    );
    assert_eq!(
        delta(counters.packets_out, before_counters.packets_out),
        delta(after.tx_packets, before.tx_packets),
        "packets out"
    );
    assert_eq!(
        delta(counters.packets_in, before_counters.packets_in),
        delta(after.rx_packets, before.rx_packets),
        "packets in"
    );
    // And at least the payload went each way (256 KiB + 64 KiB echoed back).
    assert!(counters.bytes_out >= (256 + 64) * 1024, "{counters:?}");
    assert!(counters.bytes_in >= (256 + 64) * 1024, "{counters:?}");

    // The server counted the same client flow from its side.
    let server_counters = pod_status(&status, server)
        .counters
        .expect("server counters");
    assert!(
        server_counters.bytes_in >= 256 * 1024,
        "{server_counters:?}"
    );

    // Hooks are where `tc` shows them, with shunt's priority.
    for hook in ["ingress", "egress"] {
        let filters = inspect::tc_filters(&client.netns_path(), "eth0", hook).expect("tc");
        assert_eq!(filters.len(), 1, "{hook}: {filters:?}");
        assert_eq!(filters[0].priority, 49);
        assert!(
            filters[0]
                .program
                .as_deref()
                .unwrap_or("")
                .starts_with("shunt_tc_"),
            "{filters:?}"
        );
    }

    // The pod outside the mesh was never touched: no clsact, no filter, no
    // counters.
    assert!(shunt_filters(outsider).is_empty());
    let qdiscs = inspect::qdisc_kinds(&outsider.netns_path(), "eth0").expect("qdiscs");
    assert!(!qdiscs.iter().any(|k| k == "clsact"), "{qdiscs:?}");
    assert!(pod_status(&status, outsider).counters.is_none());
    assert_eq!(
        inspect::enrolled_entries(agent.pin_dir())
            .expect("map")
            .len(),
        2,
        "exactly the two mesh pods are in the enrolment map"
    );

    // The programs' own log lines (aya-log) come out in the agent's log:
    // the echo round trips above opened TCP connections the TC programs saw.
    agent
        .wait_for_log("an aya-log line from the TC programs", TIMEOUT, |logs| {
            logs.lines()
                .any(|l| l.contains("shunt_ebpf") && l.contains("new TCP connection"))
        })
        .expect("aya-log lines in the agent log");
}

#[test]
fn leaving_the_mesh_removes_programs_entry_and_stops_counting() {
    let (topo, pods) = topology("leave", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let node = topo.node("node-a").expect("node");
    let mesh = |client_in: bool| {
        workloads_yaml(&[
            WorkloadSpec::for_pod(client, client_in),
            WorkloadSpec::for_pod(server, false),
        ])
    };
    let mut agent = Agent::start(&topo, node, &mesh(true), &[]).expect("agent");
    let status = agent
        .wait_for("client enrolled", TIMEOUT, |s| is_enrolled(s, client))
        .expect("enrolled");
    let cookie = pod_status(&status, client).netns_cookie.expect("cookie");
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("map");
    let slot = *entries.get(&cookie).expect("client's entry");
    echo_roundtrip(client, server, 7003, 32 * 1024);
    assert!(
        inspect::slot_counters(agent.pin_dir(), slot)
            .expect("counters")
            .bytes_out
            > 0
    );

    // Opt the client out by editing the workloads file.
    agent.write_workloads(&mesh(false)).expect("rewrite");
    let status = agent
        .wait_for("client unenrolled", TIMEOUT, |s| {
            s.pods
                .iter()
                .any(|p| p.name == client.name() && p.state == PodState::NotInMesh)
        })
        .expect("unenrolled");
    assert!(pod_status(&status, client).counters.is_none());
    assert!(shunt_filters(client).is_empty(), "filters left behind");
    assert!(
        inspect::enrolled_entries(agent.pin_dir())
            .expect("map")
            .is_empty(),
        "enrolment entry left behind"
    );

    // Traffic after leaving is not counted any more.
    let frozen = inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
    echo_roundtrip(client, server, 7004, 32 * 1024);
    assert_eq!(
        inspect::slot_counters(agent.pin_dir(), slot).expect("counters"),
        frozen
    );
}

#[test]
fn sigterm_unenrols_every_pod() {
    let (topo, pods) = topology("sigterm", &["a", "b", "c"]);
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(
        &pods
            .iter()
            .map(|p| WorkloadSpec::for_pod(p, true))
            .collect::<Vec<_>>(),
    );
    let mut agent = Agent::start(&topo, node, &yaml, &[]).expect("agent");
    agent
        .wait_for("all enrolled", TIMEOUT, |s| {
            pods.iter().all(|p| is_enrolled(s, p))
        })
        .expect("enrolled");
    for pod in &pods {
        assert_eq!(shunt_filters(pod).len(), 2, "pod {}", pod.name());
    }
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "agent exit: {exit}\n{}", agent.logs());
    for pod in &pods {
        assert!(
            shunt_filters(pod).is_empty(),
            "pod {} keeps filters",
            pod.name()
        );
    }
    assert!(
        inspect::enrolled_entries(agent.pin_dir())
            .expect("map")
            .is_empty()
    );
    assert!(
        agent.logs().contains("unenrolling every pod"),
        "{}",
        agent.logs()
    );
}

#[test]
fn killed_agent_leaves_counting_in_place_and_a_restart_adopts_it() {
    let (topo, pods) = topology("restart", &["client", "server"]);
    let [client, server] = [&pods[0], &pods[1]];
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(server, false),
    ]);
    let mut agent = Agent::start(&topo, node, &yaml, &[]).expect("agent");
    agent
        .wait_for("client enrolled", TIMEOUT, |s| is_enrolled(s, client))
        .expect("enrolled");
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("map");
    let slot = *entries.values().next().expect("one entry");

    agent.kill().expect("kill -9");
    // Nothing was cleaned up: the kernel keeps counting for the pod.
    assert_eq!(shunt_filters(client).len(), 2);
    let before = inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
    echo_roundtrip(client, server, 7005, 64 * 1024);
    let during = inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
    assert!(
        during.bytes_out >= before.bytes_out + 64 * 1024,
        "{before:?} -> {during:?}"
    );

    // A new agent adopts the pod: same slot, counters carry on, one filter
    // per hook (nothing doubled).
    agent.restart(&[]).expect("restart");
    let status = agent
        .wait_for("client enrolled again", TIMEOUT, |s| is_enrolled(s, client))
        .expect("re-enrolled");
    let counters = pod_status(&status, client).counters.expect("counters");
    assert!(
        counters.bytes_out >= during.bytes_out,
        "counters were reset: {counters:?}"
    );
    assert_eq!(
        inspect::enrolled_entries(agent.pin_dir()).expect("map"),
        entries
    );
    assert_eq!(
        shunt_filters(client).len(),
        2,
        "{:?}",
        shunt_filters(client)
    );
}

#[test]
fn agent_refuses_a_bad_workloads_file_naming_file_entry_and_field() {
    require_root().expect("kernel tests need root");
    let dir = std::env::temp_dir().join(format!("shunt-badfile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("dir");
    let file = dir.join("workloads.yaml");
    std::fs::write(
        &file,
        "workloads:\n  - name: web\n    namespace: shop\n    serviceAcount: web\n    ips: [\"198.18.1.10\"]\n    node: node-a\n",
    )
    .expect("write");
    let out = Command::new(shunt_testbed::agent::shunt_binary().expect("binary"))
        .args(["agent", "--node-name", "node-a", "--workloads"])
        .arg(&file)
        .args(["--bpf-pin-dir", "/sys/fs/bpf/shunt-badfile-never-created"])
        .output()
        .expect("run agent");
    let _ = std::fs::remove_dir_all(&dir);
    assert!(!out.status.success(), "the agent accepted a bad file");
    let stderr = String::from_utf8_lossy(&out.stderr);
    for needle in [
        "workloads.yaml",
        "workloads[0]",
        "shop/web",
        "serviceAcount",
    ] {
        assert!(
            stderr.contains(needle),
            "error does not name {needle}: {stderr}"
        );
    }
    assert!(
        !std::path::Path::new("/sys/fs/bpf/shunt-badfile-never-created").exists(),
        "the agent touched the kernel before validating its input"
    );
}

#[test]
fn the_verifier_repairs_a_pod_whose_programs_were_removed() {
    let (topo, pods) = topology("verifier", &["client"]);
    let client = &pods[0];
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(client, true)]);
    let mut agent = Agent::start(&topo, node, &yaml, &["--verify-interval", "1"]).expect("agent");
    agent
        .wait_for("client enrolled", TIMEOUT, |s| is_enrolled(s, client))
        .expect("enrolled");
    // Someone removes shunt's filter by hand.
    let out = client
        .command("tc")
        .args(["filter", "del", "dev", "eth0", "ingress", "pref", "49"])
        .output()
        .expect("tc filter del");
    assert!(out.status.success(), "{out:?}");
    assert_eq!(shunt_filters(client).len(), 1);
    let deadline = std::time::Instant::now() + TIMEOUT;
    while shunt_filters(client).len() < 2 && std::time::Instant::now() < deadline {
        thread::sleep(Duration::from_millis(200));
    }
    assert_eq!(
        shunt_filters(client).len(),
        2,
        "not repaired:\n{}",
        agent.logs()
    );
    // The log is written by its own thread: the line may land after the
    // filter is back.
    agent
        .wait_for_log("the repair logged", TIMEOUT, |logs| {
            logs.contains("not fully redirected; repairing")
        })
        .expect("the repair is logged");
}

#[test]
fn on_exit_keep_leaves_pods_enrolled_for_the_next_agent() {
    let (topo, pods) = topology("keep", &["client"]);
    let client = &pods[0];
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(client, true)]);
    let mut agent = Agent::start(&topo, node, &yaml, &["--on-exit", "keep"]).expect("agent");
    agent
        .wait_for("client enrolled", TIMEOUT, |s| is_enrolled(s, client))
        .expect("enrolled");
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("map");
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
    assert_eq!(
        shunt_filters(client).len(),
        2,
        "SIGTERM with keep removed the filters"
    );
    assert_eq!(
        inspect::enrolled_entries(agent.pin_dir()).expect("map"),
        entries
    );
    agent.restart(&["--on-exit", "keep"]).expect("restart");
    agent
        .wait_for("client enrolled again", TIMEOUT, |s| is_enrolled(s, client))
        .expect("re-enrolled");
    assert_eq!(
        inspect::enrolled_entries(agent.pin_dir()).expect("map"),
        entries
    );
    assert_eq!(shunt_filters(client).len(), 2);
}

#[test]
fn redirect_auto_falls_back_to_iptables_when_a_kernel_feature_is_missing() {
    let (topo, pods) = topology("autofallback", &["client"]);
    let client = &pods[0];
    let node = topo.node("node-a").expect("node");
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(client, true)]);
    // The probe is told to report sk_assign missing (a test seam, compiled
    // only with the agent's `test-seams` feature).
    let env = [(shunt::redirect::probe::PRETEND_MISSING_ENV, "bpf_sk_assign")];
    let mut agent =
        Agent::start_with_env(&topo, node, &yaml, &["--redirect", "auto"], &env).expect("agent");
    let status = agent
        .wait_for("client enrolled", TIMEOUT, |s| is_enrolled(s, client))
        .expect("enrolled");
    assert!(
        agent
            .logs()
            .contains("test seam SHUNT_PROBE_PRETEND_MISSING"),
        "the agent binary ignored the probe's test seam: build it with `cargo build -p shunt --bins --features test-seams` (as `cargo xtask test` does)"
    );
    assert_eq!(status.mode, "iptables");
    assert!(
        shunt_filters(client).is_empty(),
        "eBPF programs were attached"
    );
    let logs = agent.logs();
    assert!(
        logs.contains("falls back to iptables") && logs.contains("bpf_sk_assign"),
        "the fallback is not explained in the log:\n{logs}"
    );
}

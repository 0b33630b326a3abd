//! Churn soak (issue 20, part 3): pods enter and leave the mesh over and
//! over while connections run, and nothing the agent made for them stays
//! behind.
//!
//! One node, a steady mesh pair (client → server, both enrolled for the
//! whole run, carrying a continuous stream of new connections) and `PODS`
//! churn pods that the workloads file moves into the mesh and out again,
//! `ROUNDS` times: every round is `PODS` enrolments and `PODS`
//! unenrolments. After a warm-up round the agent's footprint is recorded;
//! after the last round it must be back where it was:
//!
//! - every pinned hash map (per-pod state: slots, configs, verdicts …) holds
//!   the same number of entries, and the pinned links are the same
//!   (eBPF mode); LRU and socket maps, whose fill follows live traffic, are
//!   printed, not compared;
//! - no TC filter on a churn pod's `eth0`, no iptables chain in its netns,
//!   no socket left listening in it (TCP or UDP);
//! - the agent's fds and threads back to the warm-up figure (plus a small
//!   allowance for the runtime's pools, waited for, not slept on) and its
//!   RSS within [`RSS_GROWTH_MAX_KIB`] of it;
//! - the steady pair's connections never failed.
//!
//! The suite runs the short form (`PODS`=6, `ROUNDS`=3: 36 enrol/unenrol
//! cycles per mode). `cargo xtask soak` runs the long one (50 pods,
//! 10 rounds: 1,000 cycles per mode) and prints the figures
//! (`SHUNT_SOAK_PODS`, `SHUNT_SOAK_ROUNDS` override either).

use std::{
    collections::BTreeMap,
    time::{Duration, Instant},
};

use shunt::api::{NodeStatus, PodState};
use shunt_testbed::{
    Pod, Topology,
    agent::{Agent, WorkloadSpec, workloads_yaml},
    apps::{Churn, EchoServer, TestApp},
    inspect, require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(60);
/// What a churn round may take per pod beyond [`TIMEOUT`].
const PER_POD: Duration = Duration::from_secs(3);
/// How far the agent's RSS may grow across the churn (after the warm-up).
const RSS_GROWTH_MAX_KIB: u64 = 32 * 1024;
/// Fds and threads the runtime may hold beyond the warm-up figure (its
/// blocking pool, a connection of the steady load in flight).
const FDS_SLACK: usize = 16;
const THREADS_SLACK: usize = 4;

fn setting(name: &str, default: usize) -> usize {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// What the agent holds, as the kernel and `/proc` count it.
#[derive(Debug)]
struct Footprint {
    /// Pinned hash maps (not LRU, not socket maps): name → entries.
    hash_maps: BTreeMap<String, u32>,
    /// Every other countable pinned map: name → entries (printed only).
    traffic_maps: BTreeMap<String, u32>,
    links: usize,
    fds: usize,
    threads: usize,
    rss_kib: u64,
}

fn footprint(agent: &Agent) -> Footprint {
    let pid = agent.pid().expect("the agent runs");
    let (mut hash_maps, mut traffic_maps) = (BTreeMap::new(), BTreeMap::new());
    let report = shunt::redirect::ebpf::pin_report(agent.pin_dir());
    for map in &report.maps {
        if let Some(entries) = map.entries {
            let into = if matches!(map.map_type.as_str(), "Hash" | "PerCpuHash") {
                &mut hash_maps
            } else {
                &mut traffic_maps
            };
            into.insert(map.name.clone(), entries);
        }
    }
    let count = |dir: String| std::fs::read_dir(&dir).map(|d| d.count()).unwrap_or(0);
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap_or_default();
    let rss_kib = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .unwrap_or(0);
    Footprint {
        hash_maps,
        traffic_maps,
        links: report.links.len(),
        fds: count(format!("/proc/{pid}/fd")),
        threads: count(format!("/proc/{pid}/task")),
        rss_kib,
    }
}

/// What the agent left in a pod's netns: TC filters on `eth0`, iptables
/// lines naming a chain of shunt's or Istio's, listening sockets.
fn leftovers(pod: &Pod) -> Vec<String> {
    let mut found = Vec::new();
    for hook in ["ingress", "egress"] {
        let filters = inspect::tc_filters(&pod.netns_path(), "eth0", hook).expect("tc");
        if !filters.is_empty() {
            found.push(format!("{hook} filters {filters:?}"));
        }
    }
    for save in ["iptables-save", "ip6tables-save"] {
        let out = pod.command(save).output().expect(save);
        let text = String::from_utf8_lossy(&out.stdout);
        found.extend(
            text.lines()
                .filter(|l| l.contains("SHUNT") || l.contains("ISTIO"))
                .map(|l| format!("{save}: {l}")),
        );
    }
    let out = pod.command("ss").args(["-Htuln"]).output().expect("ss");
    found.extend(
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .filter(|l| !l.trim().is_empty())
            .map(|l| format!("listening: {l}")),
    );
    found
}

fn churn_pods_are(agent: &mut Agent, pods: &[Pod], enrolled: bool) -> NodeStatus {
    let names: Vec<&str> = pods.iter().map(|p| p.name()).collect();
    let what = if enrolled { "enrolled" } else { "out" };
    // Each eBPF enrolment loads and verifies the pod's TC programs: tens of
    // milliseconds idle, seconds on a loaded machine.
    let timeout = TIMEOUT + PER_POD * pods.len() as u32;
    agent
        .wait_for(&format!("churn pods {what}"), timeout, |s: &NodeStatus| {
            names.iter().all(|name| {
                s.pods.iter().any(|p| {
                    p.name == *name
                        && if enrolled {
                            p.state == PodState::Enrolled
                        } else {
                            p.state == PodState::NotInMesh
                        }
                })
            })
        })
        .expect("churn pods settled")
}

/// Polls (bounded) until `done` holds for the agent's footprint, and
/// returns the last one read (the caller's assertions say what was wrong).
fn settle(agent: &Agent, done: impl Fn(&Footprint) -> bool) -> Footprint {
    let start = Instant::now();
    loop {
        let now = footprint(agent);
        if done(&now) || start.elapsed() > TIMEOUT {
            return now;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
}

fn soak(mode: &str, test: &str) {
    require_root().expect("kernel tests need root");
    let pods = setting("SHUNT_SOAK_PODS", 6);
    let rounds = setting("SHUNT_SOAK_ROUNDS", 3);
    let mut names = vec!["client".to_string(), "server".to_string()];
    names.extend((0..pods).map(|i| format!("churn{i}")));
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let (topo, all) = Topology::single_node(test, &names).expect("topology");
    let (client, server, churn) = (&all[0], &all[1], &all[2..]);
    let node = topo.node("node-a").expect("node").clone();
    let apps = shunt_testbed::Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);

    let yaml = |churn_in: bool| {
        let mut specs = vec![
            WorkloadSpec::for_pod(client, true),
            WorkloadSpec::for_pod(server, true),
        ];
        specs.extend(churn.iter().map(|p| WorkloadSpec::for_pod(p, churn_in)));
        workloads_yaml(&specs)
    };
    let args = ["--redirect", mode, "--log-format", "json"];
    let mut agent = Agent::start(&topo, &node, &yaml(false), &args).expect("agent");
    churn_pods_are(&mut agent, churn, false);
    agent
        .wait_for("the steady pair enrolled", TIMEOUT, |s| {
            s.pods
                .iter()
                .filter(|p| p.name == "client" || p.name == "server")
                .all(|p| p.state == PodState::Enrolled)
        })
        .expect("steady pair");
    let _server_app = EchoServer::on(server, 8080).expect("echo");
    let stop_file = std::env::temp_dir().join(format!("shunt-{test}-{}.stop", std::process::id()));
    let load = Churn::start_for(
        &apps,
        client,
        &format!("{}:8080", server.ip()),
        stop_file,
        Duration::from_secs(3600),
    );

    let started = Instant::now();
    let cycle = |agent: &mut Agent| {
        agent.write_workloads(&yaml(true)).expect("write");
        churn_pods_are(agent, churn, true);
        agent.write_workloads(&yaml(false)).expect("write");
        churn_pods_are(agent, churn, false);
    };
    // Warm-up: the first enrolment of a pod may fill pools for good.
    cycle(&mut agent);
    let before = footprint(&agent);
    for round in 0..rounds {
        cycle(&mut agent);
        if round % 5 == 4 {
            println!(
                "{mode}: round {} of {rounds} after {:?}",
                round + 1,
                started.elapsed()
            );
        }
    }
    let cycles = 2 * pods * rounds;
    let after = settle(&agent, |now| {
        now.fds <= before.fds + FDS_SLACK && now.threads <= before.threads + THREADS_SLACK
    });
    let load = load.finish();
    println!(
        "{mode}: {cycles} enrol/unenrol cycles over {pods} pods in {:?}; steady load {load}",
        started.elapsed()
    );
    println!("{mode}: before {before:?}");
    println!("{mode}: after  {after:?}");
    println!(
        "{mode}: traffic maps before {:?}, after {:?}",
        before.traffic_maps, after.traffic_maps
    );

    assert_eq!(
        load["failed"],
        serde_json::Value::from(0),
        "a steady connection failed during the churn: {load}\n{}",
        agent.logs()
    );
    assert!(
        load["succeeded"].as_u64().unwrap_or(0) > 0,
        "the steady load made no connection: {load}"
    );
    for pod in churn {
        let left = leftovers(pod);
        assert!(
            left.is_empty(),
            "{} still holds what the agent made for it: {left:#?}",
            pod.name()
        );
    }
    assert_eq!(
        after.hash_maps, before.hash_maps,
        "pinned hash maps' entries changed across {cycles} cycles"
    );
    assert_eq!(after.links, before.links, "pinned links");
    assert!(
        after.fds <= before.fds + FDS_SLACK,
        "fds grew from {} to {} across {cycles} cycles",
        before.fds,
        after.fds
    );
    assert!(
        after.threads <= before.threads + THREADS_SLACK,
        "threads grew from {} to {}",
        before.threads,
        after.threads
    );
    assert!(
        after.rss_kib <= before.rss_kib + RSS_GROWTH_MAX_KIB,
        "RSS grew from {} KiB to {} KiB across {cycles} cycles",
        before.rss_kib,
        after.rss_kib
    );
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

#[test]
fn churn_leaves_nothing_behind_ebpf() {
    soak("ebpf", "soak-ebpf");
}

#[test]
fn churn_leaves_nothing_behind_iptables() {
    soak("iptables", "soak-ipt");
}

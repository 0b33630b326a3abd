//! Upgrades: an agent of a new release, started on the pins an older
//! release's agent left, puts its own programs in place without a gap and
//! migrates the maps whose definition changed; a plain restart replaces
//! nothing.
//!
//! The "older release" is a fixture object (`ebpf/src/fixture.rs`, built
//! for test-seams agents and chosen by `SHUNT_TEST_EBPF_OBJECT`): its TC
//! programs and connect4 differ by an instruction (their kernel tags
//! differ) and its `SHUNT_ENROLLED` holds 2,048 entries instead of 4,096.
//! The test's listener stands in for the proxy (`--proxy external`), so
//! that a connection through the redirection outlives a `kill -9`.

use std::{
    io::{Read, Write},
    net::{SocketAddr, TcpStream},
    path::Path,
    sync::Arc,
    thread,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::redirect::{OriginalDst, ebpf::EbpfOriginalDst};
use shunt_testbed::{
    Cgroup, Node, Pod, Topology,
    agent::{Agent, WorkloadSpec, http, workloads_yaml},
    apps::{EchoServer, ok},
    inspect, require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const OBJECT_ENV: &str = "SHUNT_TEST_EBPF_OBJECT";
const FIXTURE: &str = "previous-release-fixture";
const ARGS: [&str; 6] = [
    "--capture",
    "on",
    "--proxy",
    "external",
    "--on-exit",
    "keep",
];

struct Bed {
    topo: Topology,
    client: Pod,
    server: Pod,
    apps: Cgroup,
}

impl Bed {
    fn start(test: &str) -> Bed {
        require_root().expect("kernel tests need root");
        let (topo, pods) = Topology::single_node(test, &["client", "server"]).expect("topology");
        let apps = Cgroup::create(&topo, "apps").expect("cgroup");
        Bed {
            client: pods[0].clone(),
            server: pods[1].clone(),
            topo,
            apps,
        }
    }

    fn node(&self) -> &Node {
        self.topo.node("node-a").expect("node")
    }

    fn yaml(&self) -> String {
        workloads_yaml(&[
            WorkloadSpec::for_pod(&self.client, true),
            WorkloadSpec::for_pod(&self.server, false),
        ])
    }

    /// `shunt-testapp connect` from the client pod (in the apps cgroup,
    /// which the socket programs see).
    fn connect(&self, to: &str) -> Value {
        let mut app = self.client.command(TESTAPP);
        app.args(["connect", to]);
        self.apps.place(&mut app);
        let out = app.output().expect("run testapp");
        serde_json::from_slice(&out.stdout).unwrap_or(Value::Null)
    }
}

fn wait_enrolled(agent: &mut Agent, pod: &str) {
    agent
        .wait_for("the client enrolled", TIMEOUT, |s| {
            s.pods.iter().any(|p| p.name == pod && p.counters.is_some())
        })
        .expect("enrolled");
}

/// `GET /debug/bpf`.
fn debug_bpf(node: &Node, agent: &Agent) -> Value {
    let (code, body) =
        http(node, "GET", agent.endpoints().admin.port(), "/debug/bpf").expect("GET /debug/bpf");
    assert_eq!(code, 200, "{body}");
    serde_json::from_str(&body).expect("JSON")
}

/// The program id the pinned link `name` runs, from `/debug/bpf`.
fn link_program(dump: &Value, name: &str) -> u64 {
    dump["pinned"]["links"]
        .as_array()
        .expect("links")
        .iter()
        .find(|l| l["pin"].as_str().is_some_and(|p| p.ends_with(name)))
        .and_then(|l| l["program_id"].as_u64())
        .unwrap_or_else(|| panic!("no link {name}: {dump}"))
}

/// The pinned map `name`'s report, from `/debug/bpf`.
fn pinned_map<'a>(dump: &'a Value, name: &str) -> &'a Value {
    dump["pinned"]["maps"]
        .as_array()
        .expect("maps")
        .iter()
        .find(|m| m["pin"].as_str().is_some_and(|p| p.ends_with(name)))
        .unwrap_or_else(|| panic!("no map {name}: {dump}"))
}

/// The upgrade report's entry for `attachment` running `program`.
fn change<'a>(dump: &'a Value, attachment: &str, program: &str) -> &'a Value {
    dump["pinned"]["upgrade"]["programs"]
        .as_array()
        .expect("upgrade report")
        .iter()
        .find(|p| p["attachment"] == attachment && p["program"] == program)
        .unwrap_or_else(|| panic!("no {attachment} {program} in the upgrade report: {dump}"))
}

/// (program id, classid minor) of shunt's filter on the pod's `eth0` `hook`.
fn tc_filter(netns: &Path, hook: &str) -> (u64, u32) {
    let filters = inspect::tc_filters(netns, "eth0", hook).expect("tc filters");
    let filter = filters
        .iter()
        .find(|f| f.priority == u64::from(shunt::redirect::ebpf::TC_PRIORITY))
        .unwrap_or_else(|| panic!("no shunt filter on {hook}: {filters:?}"));
    (
        filter.program_id.expect("a BPF filter"),
        filter.classid_minor.expect("a classid"),
    )
}

/// One 1 KiB echo over the held connection.
fn echo_once(held: &mut TcpStream) {
    let chunk = [7u8; 1024];
    held.write_all(&chunk).expect("send on the held connection");
    let mut back = [0u8; 1024];
    held.read_exact(&mut back)
        .expect("echo on the held connection");
    assert_eq!(back, chunk);
}

#[test]
fn an_upgrade_replaces_older_programs_without_a_gap_and_migrates_a_resized_map() {
    let bed = Bed::start("upgrade");
    let (client, server, node) = (&bed.client, &bed.server, bed.node());
    let mut agent = Agent::start_with_env(
        &bed.topo,
        node,
        &bed.yaml(),
        &ARGS,
        &[(OBJECT_ENV, FIXTURE)],
    )
    .expect("agent of the older release");
    wait_enrolled(&mut agent, client.name());
    assert!(
        agent.logs().contains("previous-release fixture"),
        "{}",
        agent.logs()
    );
    let resolver: Arc<dyn OriginalDst> =
        Arc::new(EbpfOriginalDst::open(agent.pin_dir()).expect("open pinned map"));
    let proxy = EchoServer::start(
        client
            .listen_tcp("127.0.0.1:15001".parse().expect("addr"))
            .expect("listen"),
        Some(resolver),
    );
    let _real = EchoServer::on(server, 8080).expect("echo");
    let to = format!("{}:8080", server.ip());
    let netns = client.netns_path();

    // The older release at work: its programs on the pod's eth0 and the
    // cgroup, its smaller map.
    let old = debug_bpf(node, &agent);
    assert_eq!(
        pinned_map(&old, "SHUNT_ENROLLED")["max_entries"],
        2048,
        "{old}"
    );
    let (old_ingress, minor) = tc_filter(&netns, "ingress");
    let (old_egress, _) = tc_filter(&netns, "egress");
    let old_connect4 = link_program(&old, "shunt_connect4");
    assert!(ok(&bed.connect(&to)), "captured connect, older release");
    // A connection held open across the upgrade, through the pod's eth0
    // (opened by the test in the pod's netns, outside the apps cgroup: not
    // captured, but every packet runs the pod's TC programs).
    let mut held = client
        .connect_tcp(to.parse::<SocketAddr>().expect("addr"), TIMEOUT)
        .expect("held connection");
    held.set_read_timeout(Some(TIMEOUT)).expect("timeout");
    echo_once(&mut held);

    // kill -9, then this release's agent on the same pins.
    agent.kill().expect("kill -9");
    agent.set_env(OBJECT_ENV, None);
    agent.restart(&ARGS).expect("restart");
    wait_enrolled(&mut agent, client.name());
    let new = debug_bpf(node, &agent);

    // The changed map was migrated, its entry copied.
    let enrolled = &new["pinned"]["upgrade"]["maps"]
        .as_array()
        .expect("maps report")
        .iter()
        .find(|m| m["map"] == "SHUNT_ENROLLED")
        .unwrap_or_else(|| panic!("SHUNT_ENROLLED not in the report: {new}"))
        .clone();
    assert_eq!(enrolled["action"], "migrated", "{enrolled}");
    assert_eq!(enrolled["copied"], 1, "{enrolled}");
    assert_eq!(enrolled["dropped"], 0, "{enrolled}");
    assert_eq!(enrolled["differs"], "max_entries 2048 → 4096", "{enrolled}");
    assert_eq!(
        pinned_map(&new, "SHUNT_ENROLLED")["max_entries"],
        4096,
        "{new}"
    );
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("enrolled map");
    assert_eq!(entries.len(), 1, "{entries:?}");
    let slot = *entries.values().next().expect("one entry");

    // The TC filters run this release's program now, for the same slot.
    for (hook, old_id) in [("ingress", old_ingress), ("egress", old_egress)] {
        let (id, now_minor) = tc_filter(&netns, hook);
        let report = change(&new, &format!("tc {hook}"), &format!("shunt_tc_{hook}"));
        assert_eq!(report["action"], "replaced", "{report}");
        assert_ne!(report["old_tag"], report["new_tag"], "{report}");
        assert_eq!(report["old_id"], old_id, "{report}");
        assert_eq!(
            report["id"], id,
            "the filter runs the reported program: {report}"
        );
        assert_ne!(id, old_id, "{hook} still runs the older release's program");
        assert_eq!(now_minor, minor, "{hook}'s classid");
        assert_eq!(now_minor, slot + 1, "{hook}'s classid names the pod's slot");
    }
    // The cgroup link runs this release's connect4 (switched in place).
    let connect4 = change(&new, "cgroup", "shunt_connect4");
    assert_eq!(connect4["action"], "replaced", "{connect4}");
    assert_ne!(connect4["old_tag"], connect4["new_tag"], "{connect4}");
    let now_connect4 = link_program(&new, "shunt_connect4");
    assert_ne!(now_connect4, old_connect4);
    assert_eq!(connect4["id"], now_connect4, "{connect4}");
    // Same instructions, but it used the old SHUNT_ENROLLED: replaced too.
    let dns = change(&new, "cgroup", "shunt_dns_sendmsg4");
    assert_eq!(dns["old_tag"], dns["new_tag"], "{dns}");
    assert_eq!(dns["action"], "replaced", "{dns}");
    // Same instructions, only maps that were kept (SHUNT_ORIG_DST): left
    // alone.
    let getsockopt = change(&new, "cgroup", "shunt_getsockopt");
    assert_eq!(getsockopt["action"], "kept", "{getsockopt}");
    assert!(
        agent.logs().contains("program replaced by this release's"),
        "{}",
        agent.logs()
    );

    // The held connection still carries bytes, counted by the new TC
    // programs under the pod's slot.
    let before = inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
    echo_once(&mut held);
    let after = inspect::slot_counters(agent.pin_dir(), slot).expect("counters");
    assert!(
        after.packets_out > before.packets_out && after.packets_in > before.packets_in,
        "the held connection's packets were not counted: {before:?} → {after:?}"
    );
    // New connections take the new connect4, which finds the pod in the
    // migrated map: they land on the proxy with their original destination.
    let accepted_before = proxy.accepted().len();
    assert!(ok(&bed.connect(&to)), "captured connect after the upgrade");
    let accepted = proxy.accepted();
    assert_eq!(accepted.len(), accepted_before + 1, "{accepted:?}");
    assert_eq!(
        accepted.last().and_then(|a| a.original),
        Some(to.parse().expect("addr"))
    );

    // A plain restart of the same release replaces nothing.
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
    agent.restart(&ARGS).expect("restart");
    wait_enrolled(&mut agent, client.name());
    let again = debug_bpf(node, &agent);
    let programs = again["pinned"]["upgrade"]["programs"]
        .as_array()
        .expect("upgrade report");
    assert!(!programs.is_empty(), "{again}");
    for program in programs {
        assert!(
            program["action"] == "kept" || program["attachment"] == "sockhash",
            "a restart changed {program}"
        );
    }
    for map in again["pinned"]["upgrade"]["maps"]
        .as_array()
        .expect("maps report")
    {
        assert_eq!(map["action"], "reused", "{map}");
    }
    let (ingress, _) = tc_filter(&netns, "ingress");
    assert_eq!(
        change(&new, "tc ingress", "shunt_tc_ingress")["id"],
        ingress
    );
    assert_eq!(link_program(&again, "shunt_connect4"), now_connect4);
    echo_once(&mut held);
    let start = Instant::now();
    while !ok(&bed.connect(&to)) {
        assert!(start.elapsed() < TIMEOUT, "connect after a plain restart");
        thread::sleep(Duration::from_millis(100));
    }
}

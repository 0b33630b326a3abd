//! Flow 2 of the fast path (issue 18): a connect between two enrolled mesh
//! pods of one node that the authorization policies allow is carried in
//! the kernel — the proxy copies nothing, no HBONE stream — and is still
//! reported by both ends with both identities and the bytes moved. A
//! denied connect fails at connect(); a verdict table that could not be
//! written whole (a full map) keeps flows on the proxy; the flag and the
//! per-pod opt-out keep them on the proxy; another node's mesh pod is still
//! reached over HBONE. And no fast-path map keeps an entry once 100,000
//! connections through it have closed.

use std::{
    io::{Read, Write},
    net::{IpAddr, SocketAddr},
    sync::{
        Arc,
        atomic::{AtomicBool, Ordering},
    },
    time::{Duration, Instant},
};

use aya::maps::{HashMap as BpfHashMap, Map, MapData};
use serde_json::Value;
use shunt_common::{PolicyVerdict, PolicyVerdictKey, maps};
use shunt_testbed::{
    Cgroup, Node, Pod, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, start_enrolled, workloads_yaml},
    apps::{EchoServer, HalfEcho, TestApp, local_of, via_the_proxy},
    authz_bed::{AuthzBed, policy_file},
    fast_path::{
        assert_direct, assert_istio_tcp_counted, carried_by_the_proxy, fast_access_line, has_field,
        mesh_enabled, pinned_map_entries, policies_compiled, principal, proxy_work,
    },
    require_root,
    scrape::{metrics, sample, wait_metrics},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const FAST: [&str; 4] = ["--redirect", "ebpf", "--fast-path", "on"];
/// connect() failing with EPERM: the kernel refused it.
const EPERM: i64 = 1;

/// The labels both ends report a same-node kernel-carried connection with.
fn mesh_labels<'a>(
    reporter: &'a str,
    client: &'a str,
    client_principal: &'a str,
    server: &'a str,
    server_principal: &'a str,
) -> [(&'a str, &'a str); 6] {
    [
        ("reporter", reporter),
        ("source_workload", client),
        ("source_principal", client_principal),
        ("destination_workload", server),
        ("destination_principal", server_principal),
        ("connection_security_policy", "none"),
    ]
}

/// `client` sends `bytes` to `server`'s [`HalfEcho`] on 8080: the kernel
/// carried it (the app's socket is the pod's own, the server saw it, the
/// proxy did nothing) and both ends' Istio metrics count it once with the
/// bytes each way, as does the access log.
fn carried_in_kernel(
    apps: &TestApp<'_>,
    agent: &Agent,
    client: &Pod,
    server: &Pod,
    half: &HalfEcho,
    bytes: usize,
) {
    let node = client.node();
    let before = proxy_work(agent);
    let to = format!("{}:8080", server.ip());
    let report = apps.run(client, &["connect", &to, "--send", &bytes.to_string()]);
    let local = assert_direct(&report, IpAddr::V4(client.ip()), bytes, agent);
    assert!(
        half.peers().contains(&local),
        "the server saw the client's own address and port {local}: {:?}",
        half.peers()
    );
    let (client_id, server_id) = (principal(client, "default"), principal(server, "default"));
    for reporter in ["source", "destination"] {
        let labels = mesh_labels(
            reporter,
            client.name(),
            &client_id,
            server.name(),
            &server_id,
        );
        assert_istio_tcp_counted(
            node,
            agent,
            &labels,
            bytes,
            bytes / 2,
            &format!("the kernel-carried connection ({reporter})"),
        );
    }
    assert_eq!(proxy_work(agent), before, "the proxy carried nothing");
    for direction in ["outbound", "inbound"] {
        let line = fast_access_line(agent, direction, &[&to, &local.to_string()]);
        assert!(
            line.contains(&client_id) && line.contains(&server_id),
            "{line}"
        );
        assert!(has_field(&line, "bytes_sent", &bytes.to_string()), "{line}");
        // Both ends named as ztunnel's line names them.
        assert!(
            has_field(&line, "src.workload", client.name())
                && has_field(&line, "dst.workload", server.name())
                && has_field(&line, "dst.namespace", "default"),
            "{line}"
        );
    }
}

/// `client` → `dst`:8080 (an echo or a [`HalfEcho`]) went through the
/// proxy as HBONE.
fn via_proxy(apps: &TestApp<'_>, agent: &Agent, client: &Pod, dst: &Pod) {
    carried_by_the_proxy(apps, agent, client, &format!("{}:8080", dst.ip()));
}

#[test]
fn same_node_mesh_flows_are_carried_in_the_kernel_and_reported_by_both_ends() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("fpmesh-carry").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let keeper = topo.add_pod("node-a", "keeper").expect("pod");
    let remote = topo.add_pod("node-b", "remote").expect("pod");
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
        WorkloadSpec {
            fast_path: Some(false),
            ..WorkloadSpec::for_pod(&keeper, true)
        },
        WorkloadSpec::for_pod(&remote, true),
    ]);
    let node_a = topo.node("node-a").expect("node").clone();
    let node_b = topo.node("node-b").expect("node").clone();
    let [mut agent_a, mut agent_b] =
        start_enrolled(&topo, [&node_a, &node_b], &yaml, &FAST, TIMEOUT).expect("agents enrolled");
    mesh_enabled(&node_a, &agent_a, true);
    let half = HalfEcho::on(&server, 8080);
    let _keeper_echo = EchoServer::on(&keeper, 8080).expect("echo");
    let _remote_echo = EchoServer::on(&remote, 8080).expect("echo");

    carried_in_kernel(&apps, &agent_a, &client, &server, &half, 1_048_576);
    let text = metrics(&node_a, &agent_a);
    assert!(
        sample(&text, "shunt_fast_path_mesh_connections_total", &[]).is_some_and(|n| n >= 1.0),
        "{text}"
    );

    // The pod that opted out keeps mTLS, as a source and as a destination.
    via_proxy(&apps, &agent_a, &keeper, &server);
    via_proxy(&apps, &agent_a, &client, &keeper);

    // Another node's mesh pod: HBONE through both proxies.
    let inbound_b = proxy_work(&agent_b).1;
    via_proxy(&apps, &agent_a, &client, &remote);
    let start = Instant::now();
    while proxy_work(&agent_b).1 <= inbound_b {
        assert!(start.elapsed() < TIMEOUT, "no inbound HBONE on node b");
        std::thread::sleep(Duration::from_millis(100));
    }

    // --fast-path off: same node, through the proxy again.
    agent_a.stop().expect("stop");
    agent_a
        .restart(&["--redirect", "ebpf", "--fast-path", "off"])
        .expect("restart");
    agent_a
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    via_proxy(&apps, &agent_a, &client, &server);
    assert_eq!(
        sample(
            &metrics(&node_a, &agent_a),
            "shunt_fast_path_mesh_enabled",
            &[]
        ),
        Some(0.0)
    );
    for agent in [&mut agent_a, &mut agent_b] {
        let exit = agent.stop().expect("stop");
        assert!(exit.success(), "{}", agent.logs());
    }
}

/// The bed's agent with policies `policies` written, once its store holds
/// `names` and the kernel's table was compiled from them.
fn apply_policies(bed: &AuthzBed, policies: &str, names: &[&str]) {
    bed.agent
        .write_workloads(&policy_file(bed.pods(), policies))
        .expect("write the file");
    policies_compiled(&bed.agent, names);
}

const ALLOW_CLIENT_ONLY: &str = "  - apiVersion: security.istio.io/v1
    kind: AuthorizationPolicy
    metadata: {name: allow-client, namespace: default}
    spec:
      selector: {matchLabels: {app: server}}
      action: ALLOW
      rules: [{from: [{source: {principals: [\"cluster.local/ns/default/sa/sa-client\"]}}]}]
";

/// Fills the pinned verdict map with entries of a slot no pod has, to its
/// limit; returns them (to take them out again).
fn fill_verdicts(pin_dir: &std::path::Path) -> Vec<PolicyVerdictKey> {
    let data = MapData::from_pin(pin_dir.join(maps::POLICY_VERDICTS)).expect("verdict pin");
    let mut map: BpfHashMap<MapData, PolicyVerdictKey, PolicyVerdict> =
        BpfHashMap::try_from(Map::HashMap(data)).expect("a hash map");
    let mut keys = Vec::new();
    for n in 0..shunt_common::MAX_POLICY_VERDICTS {
        let key = PolicyVerdictKey {
            slot: shunt_common::MAX_PODS - 1,
            port: 1 + (n % 60000) as u16,
            family: 2,
            addr: [
                u32::from_ne_bytes([198, 19, 255, (n / 60000) as u8]),
                0,
                0,
                0,
            ],
        };
        if map.insert(key, PolicyVerdict::default(), 0).is_err() {
            break;
        }
        keys.push(key);
    }
    keys
}

fn empty_verdicts(pin_dir: &std::path::Path, keys: &[PolicyVerdictKey]) {
    let data = MapData::from_pin(pin_dir.join(maps::POLICY_VERDICTS)).expect("verdict pin");
    let mut map: BpfHashMap<MapData, PolicyVerdictKey, PolicyVerdict> =
        BpfHashMap::try_from(Map::HashMap(data)).expect("a hash map");
    for key in keys {
        let _ = map.remove(key);
    }
}

#[test]
fn policy_decides_at_connect_and_an_incomplete_table_keeps_the_proxy() {
    let mut bed = AuthzBed::start(
        "fpmesh-policy",
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

    // No policy: the intruder's connect is carried too.
    let report = bed.connect(&bed.intruder, 8080);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(local_of(&report).ip(), bed.intruder.ip(), "{report}");
    assert!(!via_the_proxy(&report), "carried in the kernel: {report}");

    // A policy that allows only the client: the intruder is refused at
    // connect, and counted; the client is still carried in the kernel.
    apply_policies(&bed, ALLOW_CLIENT_ONLY, &["default/allow-client"]);
    mesh_enabled(&node, &bed.agent, true);
    let seen = half.peers().len();
    let report = bed.connect(&bed.intruder, 8080);
    assert_eq!(report["errno"].as_i64(), Some(EPERM), "{report}");
    assert_eq!(half.peers().len(), seen, "not a byte reached the server");
    wait_metrics(&node, &bed.agent, "the kernel's denial counted", |m| {
        sample(
            m,
            "shunt_pod_policy_denials_total",
            &[("pod", "intruder"), ("policy", "default/allow-client")],
        )
        .is_some_and(|n| n >= 1.0)
    });
    carried_in_kernel(&apps, &bed.agent, &bed.client, &bed.server, &half, 65_536);

    // The policy goes: the intruder is carried again.
    apply_policies(&bed, "", &[]);
    mesh_enabled(&node, &bed.agent, true);
    let report = bed.connect(&bed.intruder, 8080);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(local_of(&report).ip(), bed.intruder.ip(), "{report}");
    assert!(!via_the_proxy(&report), "carried in the kernel: {report}");

    // The verdict map full: the policy cannot be compiled whole, so flow 2
    // goes off and the client's connect goes through the proxy (HBONE).
    let pin_dir = bed.agent.pin_dir().to_path_buf();
    let junk = fill_verdicts(&pin_dir);
    bed.agent
        .write_workloads(&policy_file(bed.pods(), ALLOW_CLIENT_ONLY))
        .expect("write the file");
    let start = Instant::now();
    let incomplete = |bed: &AuthzBed| {
        bed.agent
            .status()
            .ok()
            .and_then(|s| s.kernel_authz)
            .is_some_and(|k| k.error.is_some())
    };
    while !incomplete(&bed) {
        assert!(
            start.elapsed() < TIMEOUT,
            "the full map was never hit: {}",
            bed.agent.logs()
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    mesh_enabled(&node, &bed.agent, false);
    via_proxy(&apps, &bed.agent, &bed.client, &bed.server);
    wait_metrics(&node, &bed.agent, "the connect counted as proxied", |m| {
        sample(
            m,
            "shunt_fast_path_proxied_connections_total",
            &[("reason", "mesh_off")],
        )
        .is_some_and(|n| n >= 1.0)
    });
    // Room again: the verify pass writes the table whole, flow 2 comes back.
    empty_verdicts(&pin_dir, &junk);
    mesh_enabled(&node, &bed.agent, true);
    let report = bed.connect(&bed.client, 8080);
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(local_of(&report).ip(), bed.client.ip(), "{report}");
    assert!(!via_the_proxy(&report), "carried in the kernel: {report}");

    let exit = bed.agent.stop().expect("stop");
    assert!(exit.success(), "{}", bed.agent.logs());
}

/// Entries of every countable pinned map of the agent, by pin name.
fn map_entries(node: &Node, agent: &Agent) -> std::collections::BTreeMap<String, u64> {
    pinned_map_entries(node, agent).expect("GET /debug/bpf with the pinned maps")
}

/// An echo server for `many`: reads exactly `size` bytes of each
/// connection, echoes them, then waits for the client's reset. Several
/// threads accept.
struct Echoes {
    stop: Arc<AtomicBool>,
    threads: Vec<std::thread::JoinHandle<()>>,
}

impl Echoes {
    fn on(pod: &Pod, port: u16, size: usize, threads: usize) -> Echoes {
        let listener = pod
            .listen_tcp(SocketAddr::from((pod.ip(), port)))
            .expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        let stop = Arc::new(AtomicBool::new(false));
        let threads = (0..threads)
            .map(|_| {
                let listener = listener.try_clone().expect("clone listener");
                let stop = stop.clone();
                std::thread::spawn(move || {
                    let start = Instant::now();
                    let mut buf = vec![0u8; size];
                    while !stop.load(Ordering::Relaxed)
                        && start.elapsed() < Duration::from_secs(300)
                    {
                        let Ok((mut stream, _)) = listener.accept() else {
                            std::thread::sleep(Duration::from_micros(200));
                            continue;
                        };
                        let _ = stream.set_nonblocking(false);
                        let _ = stream.set_read_timeout(Some(Duration::from_secs(10)));
                        if stream.read_exact(&mut buf).is_ok() && stream.write_all(&buf).is_ok() {
                            let mut rest = [0u8; 64];
                            while matches!(stream.read(&mut rest), Ok(n) if n > 0) {}
                        }
                    }
                })
            })
            .collect();
        Echoes { stop, threads }
    }
}

impl Drop for Echoes {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        for thread in self.threads.drain(..) {
            let _ = thread.join();
        }
    }
}

#[test]
fn no_fast_path_map_keeps_an_entry_after_100k_connections() {
    require_root().expect("kernel tests need root");
    const CONNECTIONS: u64 = 100_000;
    let (topo, pods) =
        Topology::single_node("fpmesh-leak", &["client", "server"]).expect("topology");
    let [client, server] = [0, 1].map(|i| pods[i].clone());
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(&client, true),
        WorkloadSpec::for_pod(&server, true),
    ]);
    let node = client.node().clone();
    // Access lines at warn: 200,000 info lines would only slow the agent.
    let mut agent = Agent::start_with_env(
        &topo,
        &node,
        &yaml,
        &FAST,
        &[("RUST_LOG", "info,shunt::access=warn")],
    )
    .expect("agent");
    agent
        .wait_for("mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    mesh_enabled(&node, &agent, true);
    let _echoes = Echoes::on(&server, 8080, 64, 8);
    let baseline = map_entries(&node, &agent);
    assert!(
        baseline.contains_key(maps::MESH_LOCAL_FLOWS)
            && baseline.contains_key(maps::FAST_PATH_SOCKS),
        "{baseline:?}"
    );
    let carried_before = sample(
        &metrics(&node, &agent),
        "shunt_fast_path_mesh_connections_total",
        &[],
    )
    .unwrap_or(0.0);

    let to = format!("{}:8080", server.ip());
    let report = apps.run(
        &client,
        &[
            "many",
            &to,
            "--count",
            &CONNECTIONS.to_string(),
            "--workers",
            "8",
            "--send",
            "64",
        ],
    );
    assert_eq!(report["ok"], Value::Bool(true), "{report}");
    assert_eq!(report["succeeded"].as_u64(), Some(CONNECTIONS), "{report}");

    // Every one was carried in the kernel (none fell back to the proxy).
    wait_metrics(
        &node,
        &agent,
        "the kernel's count of carried connects",
        |m| {
            sample(m, "shunt_fast_path_mesh_connections_total", &[])
                .is_some_and(|n| n - carried_before >= CONNECTIONS as f64)
        },
    );
    // Every map back where it was (bounded wait: closes are synchronous,
    // the reading is not).
    let start = Instant::now();
    loop {
        let now = map_entries(&node, &agent);
        let changed: Vec<(&String, u64, Option<&u64>)> = baseline
            .iter()
            .filter(|(name, n)| name.starts_with("SHUNT_") && now.get(*name) != Some(*n))
            .map(|(name, n)| (name, *n, now.get(name)))
            .collect();
        if changed.is_empty() {
            break;
        }
        assert!(
            start.elapsed() < TIMEOUT,
            "maps not back to their baseline after {CONNECTIONS} connections (name, before, now): {changed:?}"
        );
        std::thread::sleep(Duration::from_millis(200));
    }
    let exit = agent.stop().expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

//! A pod whose network namespace is replaced — same pod, same IP, maybe
//! the same path, a new namespace: what kubelet does after a sandbox dies,
//! a node reboot or a CNI re-add — is served and enrolled again in the new
//! one, through the real `shunt agent` binary on the real kernel: the
//! proxy's listeners move to the new namespace (the old ones close), the
//! redirector enrols the new namespace and forgets the old one's entries,
//! and mesh traffic (HBONE) flows again both ways — into the pod on the
//! first try, although the client's proxy still pools an HBONE connection
//! into the dead namespace (`proxy/outbound.rs::open_stream` opens the
//! stream again on a new connection). Another path naming
//! the same namespace changes nothing.

use std::{
    net::{Ipv4Addr, SocketAddr, TcpStream},
    path::{Path, PathBuf},
    process::Command,
    time::{Duration, Instant},
};

use serde_json::Value;
use shunt::{
    api::{NodeStatus, PodState},
    netns::NetNs,
};
use shunt_testbed::{
    Cgroup, NETNS_DIR, Pod, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp},
    inspect, require_root,
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);
const APP_PORT: u16 = 8080;
/// The proxy's line once a pod's listeners moved to its new namespace.
const RESERVED: &str = "proxy re-served the pod in its new network namespace";
/// The redirector's line once it forgot the old namespace.
const REENROLLED: &str = "the pod's network namespace changed";

fn cookie_of(path: &Path) -> u64 {
    NetNs::open(path)
        .expect("open netns")
        .cookie()
        .expect("netns cookie")
}

fn pod_cookie(status: &NodeStatus, pod: &Pod) -> Option<u64> {
    status
        .pods
        .iter()
        .find(|p| p.name == pod.name() && p.state == PodState::Enrolled)
        .and_then(|p| p.netns_cookie)
}

fn hbone(agent: &Agent) -> (u64, u64) {
    let proxy = agent.status().expect("status").proxy.expect("proxy stats");
    (proxy.outbound_hbone, proxy.inbound_hbone)
}

/// `from`'s application sends 64 KiB to `to`:8080 and checks the echo.
fn exchange(apps: &TestApp<'_>, from: &Pod, to: &Pod, agent: &Agent) {
    let target = format!("{}:{APP_PORT}", to.ip());
    let report = apps.run(from, &["connect", &target, "--send", "65536"]);
    assert_eq!(
        report["intact"],
        Value::Bool(true),
        "{} -> {}: {report}\nagent log:\n{}",
        from.name(),
        to.name(),
        agent.logs()
    );
}

/// How many pooled HBONE connections to `pod` the proxy has dropped.
fn stale_pool_closed(log: &str, pod: &Pod) -> usize {
    let dst = format!("dst_ip={}", pod.ip());
    log.lines()
        .filter(|line| line.contains("pooled HBONE connection closed") && line.contains(&dst))
        .count()
}

/// Whether anything listens on 127.0.0.1:15001 in `netns`.
fn outbound_listener_in(netns: &NetNs) -> bool {
    let addr = SocketAddr::from((Ipv4Addr::LOCALHOST, 15001));
    netns
        .run(|| TcpStream::connect_timeout(&addr, Duration::from_secs(2)).is_ok())
        .expect("enter netns")
}

#[test]
fn a_pod_whose_netns_is_recreated_is_served_and_enrolled_in_the_new_one() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("nsrenew", &["client", "server"]).expect("topology");
    let [client, server] = [&pods[0], &pods[1]];
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let yaml = workloads_yaml(&[
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(server, true),
    ]);
    let node = topo.node("node-a").expect("node").clone();
    // Same-node mesh traffic through the proxies (HBONE), not flow 2.
    let mut agent = Agent::start(
        &topo,
        &node,
        &yaml,
        &["--redirect", "ebpf", "--fast-path", "off"],
    )
    .expect("agent");
    let status = agent
        .wait_for("both pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    let old_cookie = pod_cookie(&status, server).expect("server's cookie");
    assert_eq!(old_cookie, cookie_of(&server.netns_path()));

    let client_app = EchoServer::on(client, APP_PORT).expect("echo on client");
    let server_app = EchoServer::on(server, APP_PORT).expect("echo on server");
    exchange(&apps, client, server, &agent);
    exchange(&apps, server, client, &agent);
    let (out_before, in_before) = hbone(&agent);
    assert!(out_before >= 2 && in_before >= 2, "HBONE both ways first");

    // The sandbox is recreated: same name (so the same path), same IP.
    let stale_before = stale_pool_closed(&agent.logs(), server);
    let old_netns = NetNs::open(server.netns_path()).expect("hold the old netns");
    drop(server_app);
    server.recreate_sandbox().expect("recreate the sandbox");
    let new_cookie = cookie_of(&server.netns_path());
    assert_ne!(new_cookie, old_cookie, "a new namespace");
    // The source says it again (same content: the path did not change).
    agent.write_workloads(&yaml).expect("workloads");

    agent
        .wait_for("the server enrolled in its new netns", TIMEOUT, |s| {
            pod_cookie(s, server) == Some(new_cookie) && mesh_pods_enrolled(s)
        })
        .expect("re-enrolled");
    let logs = agent
        .wait_for_log("the proxy re-served the server", TIMEOUT, |log| {
            log.contains(RESERVED) && log.contains(REENROLLED)
        })
        .expect("re-served");
    assert_eq!(
        logs.matches(RESERVED).count(),
        1,
        "re-served once, not on every pass"
    );

    // The old namespace's enrolment entry is gone; the new one's is there.
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("enrolled map");
    assert!(
        !entries.contains_key(&old_cookie),
        "the old netns is still enrolled: {entries:?}"
    );
    assert!(entries.contains_key(&new_cookie), "{entries:?}");
    assert_eq!(entries.len(), 2, "one entry per pod: {entries:?}");
    // And its listeners closed (bounded: the accept loops end on their own).
    let deadline = Instant::now() + TIMEOUT;
    while outbound_listener_in(&old_netns) {
        assert!(
            Instant::now() < deadline,
            "the old netns still has the proxy's 15001 listener"
        );
        std::thread::sleep(Duration::from_millis(100));
    }
    // The new namespace has them, and its traffic is captured: both ways
    // through the mesh again, every byte echoed.
    let new_netns = NetNs::open(server.netns_path()).expect("new netns");
    assert!(outbound_listener_in(&new_netns));
    let _server_app = EchoServer::on(server, APP_PORT).expect("echo on the new server");
    // Into it at once, on the first try: the client's proxy still pools
    // the HBONE connection it had to the old namespace (whose socket died
    // with it) and may send the stream on it; the new namespace resets
    // that connection and the proxy opens the stream again on a new one.
    // The application never sees the stale connection.
    exchange(&apps, client, server, &agent);
    exchange(&apps, server, client, &agent);
    // And the stale connection has left the pool (dropped by that stream's
    // failure, or by its next keepalive).
    agent
        .wait_for_log("the stale pooled connection dropped", TIMEOUT, |log| {
            stale_pool_closed(log, server) > stale_before
        })
        .expect("pool");
    let (out_after, in_after) = hbone(&agent);
    assert!(
        out_after >= out_before + 2 && in_after >= in_before + 2,
        "HBONE both ways after the change: out {out_before} -> {out_after}, in {in_before} -> {in_after}"
    );
    drop(client_app);
}

/// A bind mount of the pod's netns under another name, removed on drop.
struct Alias(PathBuf);

impl Drop for Alias {
    fn drop(&mut self) {
        // Lazily: the agent may still hold the namespace open through it.
        let _ = Command::new("umount").arg("--lazy").arg(&self.0).status();
        let _ = std::fs::remove_file(&self.0);
    }
}

#[test]
fn another_path_to_the_same_netns_changes_nothing() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("nsalias", &["client", "server"]).expect("topology");
    let [client, server] = [&pods[0], &pods[1]];
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(TESTAPP, &apps);
    let node = topo.node("node-a").expect("node").clone();
    let specs = [
        WorkloadSpec::for_pod(client, true),
        WorkloadSpec::for_pod(server, true),
    ];
    let mut agent = Agent::start(
        &topo,
        &node,
        &workloads_yaml(&specs),
        &["--redirect", "ebpf", "--fast-path", "off"],
    )
    .expect("agent");
    let status = agent
        .wait_for("both pods enrolled", TIMEOUT, mesh_pods_enrolled)
        .expect("enrolled");
    let cookie = pod_cookie(&status, server).expect("cookie");

    // The same namespace under a second name (the topology's prefix, so a
    // killed run's sweep removes it too).
    let alias = Alias(Path::new(NETNS_DIR).join(format!("{}-alias", topo.prefix())));
    std::fs::File::create(&alias.0).expect("mount point");
    let mounted = Command::new("mount")
        .arg("--bind")
        .arg(server.netns_path())
        .arg(&alias.0)
        .status()
        .expect("mount");
    assert!(mounted.success());
    let mut moved = specs.clone();
    moved[1].netns = Some(alias.0.clone());
    agent
        .write_workloads(&workloads_yaml(&moved))
        .expect("workloads");
    agent
        .wait_for_log("the new file read", TIMEOUT, |log| {
            log.contains("workloads file changed; reconciling")
        })
        .expect("reconciled");
    let status = agent.status_after_verify(TIMEOUT).expect("verify pass");
    assert_eq!(pod_cookie(&status, server), Some(cookie));
    let logs = agent.logs();
    assert!(
        !logs.contains(RESERVED) && !logs.contains(REENROLLED) && !logs.contains("pod unenrolled"),
        "one namespace under two names is not a new namespace (nothing is redone):\n{logs}"
    );
    let entries = inspect::enrolled_entries(agent.pin_dir()).expect("enrolled map");
    assert!(
        entries.contains_key(&cookie) && entries.len() == 2,
        "{entries:?}"
    );
    let _client_app = EchoServer::on(client, APP_PORT).expect("echo");
    exchange(&apps, server, client, &agent);
}

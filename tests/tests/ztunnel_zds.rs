//! ZDS as a stock ztunnel expects it from its node agent (issue 36 items
//! 5–7), on the kernel with the agent's reconciler, its ZDS server and the
//! stand-in ztunnel's ZDS client (`shunt_testbed::ztunnel::ZdsClient`):
//!
//! - a pod whose `AddWorkload` ztunnel refuses stays pending (status says
//!   so, with the attempt), is redirected meanwhile so that its traffic
//!   fails closed (eBPF: the connect hook finds no listener on 15001 and
//!   refuses the connect with EPERM; iptables: Istio's REDIRECT meets no
//!   listener, ECONNREFUSED; nothing reaches the server), and is sent
//!   again on the same connection with back-off (counted) until ztunnel
//!   acks it;
//! - a second ztunnel connection (a surge) gets its snapshot and the new
//!   pods while the first keeps its own: neither is closed nor sent a new
//!   snapshot; dels go to both; after the first closes the second is
//!   still served; when the newest closes instead, the older one is served
//!   again and gets what it missed;
//! - the netns sent is the one captured: after another namespace is
//!   mounted over the pod's netns path, the next snapshot's fd is still
//!   the original namespace (the stand-in checks its inode).
//!
//! The same with a stock ztunnel binary: `ztunnel_stock.rs`.

mod ztunnel_harness;

use std::{
    net::TcpListener,
    os::fd::{AsRawFd, OwnedFd},
    os::unix::fs::MetadataExt,
    path::Path,
    time::Duration,
};

use nix::sched::{CloneFlags, setns};
use prost::Message as _;
use shunt::{
    redirect::{
        Redirector,
        iptables::{InpodRules, IptablesOptions, IptablesRedirector},
    },
    state::{DataplaneMode, PodState, WorkloadKey},
};
use shunt_proto::istio::zds::{
    Ack, WorkloadResponse, workload_request::Payload, workload_response,
};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::PinDir,
    apps::{EchoServer, TestApp, ok},
    mount::BindMount,
    require_root,
    ztunnel::ZdsClient,
};
use ztunnel_harness::{Agent, AgentOptions, TESTAPP, ebpf_redirector, workload};

/// connect() failing with EPERM: the eBPF connect hook found no listener
/// on 15001 in the pod and refused it (fail closed, counted).
const EPERM: i64 = 1;
/// connect() failing with ECONNREFUSED: Istio's REDIRECT to 15001 met no
/// listener (iptables mode).
const ECONNREFUSED: i64 = 111;

/// Known to the agent, not handed to ztunnel yet (connecting before would
/// get an empty snapshot and the pod after it).
fn waiting() -> PodState {
    PodState::Pending(shunt::agent::WAITING_FOR_ZTUNNEL.into())
}

/// ztunnel's answer when a proxy fails to start (as its inpod/ words it).
fn refuse(zds: &ZdsClient, error: &str) {
    zds.send(
        &WorkloadResponse {
            payload: Some(workload_response::Payload::Ack(Ack {
                error: error.into(),
            })),
        }
        .encode_to_vec(),
    )
    .expect("send the refusal");
}

/// The next request, which must be an `AddWorkload` for `uid` with one fd.
fn expect_add(zds: &ZdsClient, uid: &str) -> OwnedFd {
    let (payload, mut fds) = zds.recv().expect("a request");
    match payload {
        Payload::Add(ref add) if add.uid == uid => {}
        other => panic!("expected AddWorkload for {uid}, got {other:?}"),
    }
    assert_eq!(fds.len(), 1, "one netns fd with the AddWorkload");
    fds.remove(0)
}

fn expect_del(zds: &ZdsClient, uid: &str) {
    let (payload, fds) = zds.recv().expect("a request");
    match payload {
        Payload::Del(ref del) if del.uid == uid => {}
        other => panic!("expected DelWorkload for {uid}, got {other:?}"),
    }
    assert!(fds.is_empty());
}

fn expect_snapshot_sent(zds: &ZdsClient) {
    let (payload, _) = zds.recv().expect("a request");
    assert!(
        matches!(payload, Payload::SnapshotSent(_)),
        "expected SnapshotSent, got {payload:?}"
    );
}

/// A namespace's identity: its nsfs device and inode.
fn identity_of_fd(fd: &OwnedFd) -> (u64, u64) {
    let st = nix::sys::stat::fstat(fd.as_raw_fd()).expect("fstat the fd");
    (st.st_dev, st.st_ino)
}

fn identity_of_path(path: &Path) -> (u64, u64) {
    let meta = std::fs::metadata(path).expect("stat the netns");
    (meta.dev(), meta.ino())
}

/// Binds ztunnel's outbound listener inside the netns `netns`.
fn bind_outbound_in(netns: OwnedFd) -> TcpListener {
    std::thread::spawn(move || {
        setns(&netns, CloneFlags::CLONE_NEWNET).expect("enter the pod's netns");
        TcpListener::bind("127.0.0.1:15001").expect("bind in the pod's netns")
    })
    .join()
    .expect("listener thread")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_pod_fails_closed_and_is_sent_again_until_ztunnel_acks_ebpf() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zds-refuse", &["client", "server"]).expect("topology");
    let pin = PinDir::new(&topo, "zds-refuse");
    let redirector = ebpf_redirector(&topo, &pin);
    refused_pod_fails_closed(&topo, &pods, redirector, EPERM).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_refused_pod_fails_closed_and_is_sent_again_until_ztunnel_acks_iptables() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zds-refuse-ipt", &["client", "server"]).expect("topology");
    let mut options = IptablesOptions::new(format!("{}-node-a", topo.prefix()));
    options.rules = InpodRules::Istio;
    let redirector = IptablesRedirector::new(options).expect("iptables redirector");
    refused_pod_fails_closed(&topo, &pods, Box::new(redirector), ECONNREFUSED).await;
}

/// The refusal, with `redirector`; a connect while refused fails with
/// `errno`.
async fn refused_pod_fails_closed(
    topo: &Topology,
    pods: &[Pod],
    redirector: Box<dyn Redirector>,
    errno: i64,
) {
    let [client, server] = [&pods[0], &pods[1]];
    let apps = Cgroup::create(topo, "apps").expect("cgroup");
    let agent = Agent::start_with(
        topo,
        redirector,
        vec![
            workload(client, DataplaneMode::Ambient),
            workload(server, DataplaneMode::None),
        ],
        AgentOptions {
            retry_initial: Duration::from_millis(200),
            ..AgentOptions::default()
        },
    );
    let real = EchoServer::start(
        server
            .listen_tcp("0.0.0.0:8080".parse().expect("addr"))
            .expect("listen"),
        None,
    );
    let app = TestApp::new(TESTAPP, &apps);
    let to = format!("{}:8080", server.ip());
    let key = WorkloadKey::new("default", "client");
    let refused_with = |attempt: u32| {
        let key = key.clone();
        move |s: &shunt::snapshot::NodeSnapshot| {
            s.pods.iter().any(|p| {
                p.workload.key() == key
                    && p.kernel.is_some()
                    && matches!(&p.state, PodState::Pending(text)
                        if text.contains("ztunnel refused the pod: failure to start proxy")
                            && text.contains(&format!("attempt {attempt};"))
                            && text.contains("fails closed"))
            })
        }
    };

    agent.wait_for("client", waiting()).await;
    let zds = tokio::task::block_in_place(|| {
        let zds = ZdsClient::connect(&agent.socket).expect("connect");
        zds.hello().expect("hello");
        expect_add(&zds, "uid-client");
        refuse(&zds, "failure to start proxy : address in use");
        expect_snapshot_sent(&zds);
        zds.ack().expect("ack");
        zds
    });
    // Pending with ztunnel's words, and redirected: its traffic fails
    // closed for want of ztunnel's listener, instead of going out.
    agent
        .wait_until("client refused (attempt 1), redirected", refused_with(1))
        .await;
    tokio::task::block_in_place(|| {
        let report = app.run(client, &["connect", &to, "--send", "1000"]);
        assert!(!ok(&report), "{report}");
        assert_eq!(report["errno"], errno, "{report}");
        assert!(real.accepted().is_empty(), "nothing reached the server");
        // Sent again on the same connection (no reconnect), refused again.
        expect_add(&zds, "uid-client");
        refuse(&zds, "failure to start proxy : address in use");
    });
    agent
        .wait_until("client refused (attempt 2)", refused_with(2))
        .await;
    assert_eq!(agent.metric("shunt_ztunnel_add_refusals_total"), Some(2.0));
    assert_eq!(agent.metric("shunt_ztunnel_add_retries_total"), Some(1.0));

    // ztunnel serves it on the next attempt: enrolled, and its connects
    // reach ztunnel's listener.
    let outbound = tokio::task::block_in_place(|| {
        let netns = expect_add(&zds, "uid-client");
        let listener = bind_outbound_in(netns);
        zds.ack().expect("ack");
        EchoServer::start(listener, None)
    });
    agent.wait_for("client", PodState::Enrolled).await;
    assert_eq!(agent.metric("shunt_ztunnel_add_retries_total"), Some(2.0));
    tokio::task::block_in_place(|| {
        let report = app.run(client, &["connect", &to, "--send", "1000"]);
        assert!(ok(&report), "{report}");
    });
    assert_eq!(outbound.accepted().len(), 1, "through ztunnel's 15001");
    assert!(real.accepted().is_empty());
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_second_ztunnel_connection_is_served_and_the_first_keeps_its_pods() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("zds-surge", &["a", "b"]).expect("topology");
    let [a, b] = [&pods[0], &pods[1]];
    let pin = PinDir::new(&topo, "zds-surge");
    let agent = Agent::start(
        &topo,
        ebpf_redirector(&topo, &pin),
        vec![workload(a, DataplaneMode::Ambient)],
    );
    agent.wait_for("a", waiting()).await;
    let first = tokio::task::block_in_place(|| {
        let first = ZdsClient::connect(&agent.socket).expect("connect");
        first.hello().expect("hello");
        expect_add(&first, "uid-a");
        first.ack().expect("ack");
        expect_snapshot_sent(&first);
        first.ack().expect("ack");
        first
    });
    agent.wait_for("a", PodState::Enrolled).await;

    // The surge: a second ztunnel gets a snapshot of its own.
    let second = tokio::task::block_in_place(|| {
        let second = ZdsClient::connect(&agent.socket).expect("connect");
        second.hello().expect("hello");
        expect_add(&second, "uid-a");
        second.ack().expect("ack");
        expect_snapshot_sent(&second);
        second.ack().expect("ack");
        second
    });
    assert_eq!(agent.metric("shunt_ztunnel_connections"), Some(2.0));
    agent.wait_for("a", PodState::Enrolled).await;

    // A new pod goes to the newest connection only.
    agent.push(vec![
        workload(a, DataplaneMode::Ambient),
        workload(b, DataplaneMode::Ambient),
    ]);
    tokio::task::block_in_place(|| {
        expect_add(&second, "uid-b");
        second.ack().expect("ack");
    });
    agent.wait_for("b", PodState::Enrolled).await;

    // a leaves: both are told. The first's next request is that del: it
    // was neither closed nor sent a fresh snapshot, nor b.
    agent.push(vec![workload(b, DataplaneMode::Ambient)]);
    tokio::task::block_in_place(|| {
        expect_del(&first, "uid-a");
        first.ack().expect("ack");
        expect_del(&second, "uid-a");
        second.ack().expect("ack");
    });

    // The old ztunnel goes; the second is still served.
    drop(first);
    agent.wait_metric("shunt_ztunnel_connections", 1.0).await;
    agent.push(vec![
        workload(a, DataplaneMode::Ambient),
        workload(b, DataplaneMode::Ambient),
    ]);
    tokio::task::block_in_place(|| {
        expect_add(&second, "uid-a");
        second.ack().expect("ack");
    });
    agent.wait_for("a", PodState::Enrolled).await;
    assert_eq!(
        agent.snapshot_state("b"),
        Some(PodState::Enrolled),
        "b untouched"
    );
    drop(second);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_netns_sent_is_the_one_captured_even_after_another_is_mounted_at_its_path() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("zds-held", &["p", "other"]).expect("topology");
    let [p, other] = [&pods[0], &pods[1]];
    let pin = PinDir::new(&topo, "zds-held");
    let dir = tempfile::tempdir().expect("temp dir");
    // The pod's netns path is a mount the test can point elsewhere.
    let path = dir.path().join("p-netns");
    let mount = BindMount::new(&p.netns_path(), &path);
    let captured = identity_of_path(&p.netns_path());
    let mut wl = workload(p, DataplaneMode::Ambient);
    wl.netns = Some(path.clone());
    // No verify pass in the window below (it would look at the path again
    // and rightly take the new namespace for a recreated sandbox).
    let agent = Agent::start_with(
        &topo,
        ebpf_redirector(&topo, &pin),
        vec![wl],
        AgentOptions {
            verify_every: Duration::from_secs(3600),
            ..AgentOptions::default()
        },
    );
    agent.wait_for("p", waiting()).await;
    let first = tokio::task::block_in_place(|| {
        let first = ZdsClient::connect(&agent.socket).expect("connect");
        first.hello().expect("hello");
        let fd = expect_add(&first, "uid-p");
        assert_eq!(identity_of_fd(&fd), captured, "p's namespace");
        first.ack().expect("ack");
        expect_snapshot_sent(&first);
        first.ack().expect("ack");
        first
    });
    agent.wait_for("p", PodState::Enrolled).await;

    // Another namespace at the same path.
    drop(mount);
    let _replaced = BindMount::new(&other.netns_path(), &path);
    let replacement = identity_of_path(&other.netns_path());
    assert_eq!(
        identity_of_path(&path),
        replacement,
        "the path names other's"
    );
    assert_ne!(replacement, captured);

    // A new ztunnel's snapshot carries the namespace captured.
    tokio::task::block_in_place(|| {
        let second = ZdsClient::connect(&agent.socket).expect("connect");
        second.hello().expect("hello");
        let fd = expect_add(&second, "uid-p");
        assert_eq!(
            identity_of_fd(&fd),
            captured,
            "the fd sent is the namespace captured, not the one at the path now ({replacement:?})"
        );
        second.ack().expect("ack");
        expect_snapshot_sent(&second);
        second.ack().expect("ack");
    });
    drop(first);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn when_the_newest_connection_closes_the_older_is_caught_up_and_served() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("zds-fallback", &["a", "b"]).expect("topology");
    let [a, b] = [&pods[0], &pods[1]];
    let pin = PinDir::new(&topo, "zds-fallback");
    let agent = Agent::start(
        &topo,
        ebpf_redirector(&topo, &pin),
        vec![workload(a, DataplaneMode::Ambient)],
    );
    agent.wait_for("a", waiting()).await;
    let (old, new) = tokio::task::block_in_place(|| {
        let mut connections = Vec::new();
        for _ in 0..2 {
            let zds = ZdsClient::connect(&agent.socket).expect("connect");
            zds.hello().expect("hello");
            expect_add(&zds, "uid-a");
            zds.ack().expect("ack");
            expect_snapshot_sent(&zds);
            zds.ack().expect("ack");
            connections.push(zds);
        }
        let new = connections.pop().expect("two");
        (connections.pop().expect("two"), new)
    });
    agent.wait_for("a", PodState::Enrolled).await;
    // b arrives while the new connection is served: only it gets b.
    agent.push(vec![
        workload(a, DataplaneMode::Ambient),
        workload(b, DataplaneMode::Ambient),
    ]);
    tokio::task::block_in_place(|| {
        expect_add(&new, "uid-b");
        new.ack().expect("ack");
    });
    agent.wait_for("b", PodState::Enrolled).await;

    // The new ztunnel goes: the old one is served again and gets b.
    drop(new);
    tokio::task::block_in_place(|| {
        expect_add(&old, "uid-b");
        old.ack().expect("ack");
    });
    agent.wait_metric("shunt_ztunnel_connections", 1.0).await;
    assert_eq!(agent.snapshot_state("a"), Some(PodState::Enrolled));
    assert_eq!(agent.snapshot_state("b"), Some(PodState::Enrolled));
    drop(old);
    agent.stop().await;
}

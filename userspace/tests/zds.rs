//! ZDS, the protocol a stock ztunnel speaks with its node agent, against
//! shunt's server (`--proxy ztunnel`), with the real protocol: an in-test
//! ztunnel-side client connects over a SEQPACKET unix socket, says hello,
//! receives each pod's `AddWorkload` with the pod's network namespace as
//! the packet's one SCM_RIGHTS fd (checked: it is a netns, and that pod's),
//! and acks. The pods are testbed network namespaces, enrolled by the real
//! eBPF redirector through the agent's own reconciler thread, whose
//! published snapshots show what a user sees (`shunt status`). A pod whose
//! namespace is replaced under the same path (its sandbox recreated) is
//! sent again: `DelWorkload`, then `AddWorkload` with the new namespace.
//!
//! Every wait is bounded.

use std::{
    io::{IoSlice, IoSliceMut},
    os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd},
    os::unix::fs::MetadataExt,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use nix::sys::{
    socket::{
        AddressFamily, ControlMessageOwned, MsgFlags, SockFlag, SockType, UnixAddr, connect,
        recvmsg, sendmsg, setsockopt, socket, sockopt::ReceiveTimeout,
    },
    stat::fstat,
    time::TimeVal,
};
use prost::Message as _;
use shunt::{
    agent::{NodeAgent, Reconciler, ReconcilerInputs, WAITING_FOR_ZTUNNEL},
    app::AgentSink,
    control::{NodePods, SourceSink},
    netns::NetNs,
    redirect::{
        Capture,
        ebpf::{EbpfOptions, EbpfRedirector},
    },
    snapshot::NodeSnapshot,
    state::{DataplaneMode, PodState, TrustDomain, Workload, WorkloadKey},
};
use shunt_proto::istio::zds::{
    Ack, Version, WorkloadRequest, WorkloadResponse, ZdsHello, workload_request::Payload,
    workload_response,
};
use shunt_testbed::{Pod, Topology, agent::PinDir, require_root};
use tokio::sync::watch;

const NODE: &str = "node-a";
/// Upper bound for anything the test waits on.
const TIMEOUT: Duration = Duration::from_secs(30);
/// The server's ack timeout in these tests (short: one test waits it out).
const ACK_TIMEOUT: Duration = Duration::from_secs(2);

// ---- the agent's log, captured (tests assert what an operator reads) ----

#[derive(Clone, Default)]
struct Log(Arc<Mutex<Vec<u8>>>);

impl std::io::Write for Log {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn log() -> &'static Log {
    static LOG: OnceLock<Log> = OnceLock::new();
    LOG.get_or_init(|| {
        let log = Log::default();
        let writer = log.clone();
        tracing_subscriber::fmt()
            .with_ansi(false)
            .with_writer(move || writer.clone())
            .init();
        log
    })
}

/// Waits (bounded) for a log line containing every one of `parts`.
fn wait_for_log(parts: &[&str]) -> String {
    let deadline = std::time::Instant::now() + TIMEOUT;
    loop {
        let text = String::from_utf8_lossy(&log().0.lock().unwrap_or_else(|p| p.into_inner()))
            .into_owned();
        if let Some(line) = text.lines().find(|l| parts.iter().all(|p| l.contains(p))) {
            return line.to_string();
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no log line with {parts:?} within {TIMEOUT:?}; log:\n{text}"
        );
        std::thread::sleep(Duration::from_millis(20));
    }
}

// ---- the ztunnel side, as ztunnel's inpod/ speaks it ----

/// One request as ztunnel receives it, with the descriptors it carried.
struct Received {
    payload: Payload,
    fds: Vec<OwnedFd>,
}

struct Ztunnel {
    fd: OwnedFd,
}

impl Ztunnel {
    fn connect(path: &Path) -> Ztunnel {
        let fd = socket(
            AddressFamily::Unix,
            SockType::SeqPacket,
            SockFlag::SOCK_CLOEXEC,
            None,
        )
        .expect("ztunnel socket");
        let deadline = std::time::Instant::now() + TIMEOUT;
        let addr = UnixAddr::new(path).expect("socket address");
        // The agent binds its socket when it starts.
        while let Err(e) = connect(fd.as_raw_fd(), &addr) {
            assert!(
                std::time::Instant::now() < deadline,
                "cannot connect to {}: {e}",
                path.display()
            );
            std::thread::sleep(Duration::from_millis(20));
        }
        setsockopt(
            &fd,
            ReceiveTimeout,
            &TimeVal::new(TIMEOUT.as_secs() as i64, 0),
        )
        .expect("receive timeout");
        Ztunnel { fd }
    }

    fn send(&self, bytes: &[u8]) {
        sendmsg::<UnixAddr>(
            self.fd.as_raw_fd(),
            &[IoSlice::new(bytes)],
            &[],
            MsgFlags::MSG_NOSIGNAL,
            None,
        )
        .expect("send to the agent");
    }

    fn hello(&self) {
        self.send(
            &ZdsHello {
                version: Version::V1 as i32,
            }
            .encode_to_vec(),
        );
    }

    fn ack(&self) {
        self.send(
            &WorkloadResponse {
                payload: Some(workload_response::Payload::Ack(Ack::default())),
            }
            .encode_to_vec(),
        );
    }

    /// The next request; `None` when the agent closed the connection.
    fn recv(&self) -> Option<Received> {
        let mut buf = vec![0u8; 64 * 1024];
        let mut space = nix::cmsg_space!([RawFd; 4]);
        let (len, fds) = {
            let mut iov = [IoSliceMut::new(&mut buf)];
            let msg = recvmsg::<UnixAddr>(
                self.fd.as_raw_fd(),
                &mut iov,
                Some(&mut space),
                MsgFlags::MSG_CMSG_CLOEXEC,
            )
            .expect("receive from the agent (within the timeout)");
            let mut fds = Vec::new();
            for cmsg in msg.cmsgs().expect("control messages") {
                if let ControlMessageOwned::ScmRights(raw) = cmsg {
                    // SAFETY: SCM_RIGHTS installed these descriptors for us.
                    fds.extend(
                        raw.into_iter()
                            .map(|fd| unsafe { OwnedFd::from_raw_fd(fd) }),
                    );
                }
            }
            (msg.bytes, fds)
        };
        if len == 0 {
            return None;
        }
        let request = WorkloadRequest::decode(&buf[..len]).expect("a WorkloadRequest");
        Some(Received {
            payload: request.payload.expect("a request with a payload"),
            fds,
        })
    }

    fn expect(&self) -> Received {
        self.recv()
            .expect("a request, not the end of the connection")
    }

    /// Receives an `AddWorkload` for `pod` and checks its fd: exactly one,
    /// a network namespace, the pod's own.
    fn expect_add(&self, pod: &TestPod) {
        let received = self.expect();
        let Payload::Add(add) = received.payload else {
            panic!(
                "expected AddWorkload for {}, got {:?}",
                pod.name, received.payload
            )
        };
        assert_eq!(add.uid, pod.uid);
        let info = add
            .workload_info
            .expect("AddWorkload carries workload_info");
        assert_eq!(
            (
                info.name.as_str(),
                info.namespace.as_str(),
                info.service_account.as_str()
            ),
            (pod.name.as_str(), "zds", "sa")
        );
        assert_eq!(received.fds.len(), 1, "exactly one fd with AddWorkload");
        let fd = &received.fds[0];
        // NS_GET_NSTYPE (_IO(0xb7, 0x3)): the kind of namespace.
        // SAFETY: an ioctl without argument on a descriptor we own.
        let kind = unsafe { libc::ioctl(fd.as_raw_fd(), 0xb703) };
        assert_eq!(kind, libc::CLONE_NEWNET, "the fd is a network namespace");
        let st = fstat(fd.as_raw_fd()).expect("fstat the fd");
        let expected = std::fs::metadata(&pod.netns).expect("the pod's netns");
        assert_eq!(
            (st.st_dev, st.st_ino),
            (expected.dev(), expected.ino()),
            "the fd is {}'s network namespace",
            pod.name
        );
    }

    fn expect_snapshot_sent(&self) {
        let received = self.expect();
        assert!(
            matches!(received.payload, Payload::SnapshotSent(_)),
            "expected SnapshotSent, got {:?}",
            received.payload
        );
        assert!(received.fds.is_empty());
    }

    fn expect_closed(&self) {
        if let Some(received) = self.recv() {
            panic!(
                "expected the agent to close the connection, got {:?}",
                received.payload
            );
        }
    }
}

// ---- the agent side: real netns, real eBPF, the real reconciler ----

struct TestPod {
    name: String,
    uid: String,
    netns: PathBuf,
    workload: Workload,
    /// The testbed's pod (its sandbox can be recreated).
    pod: Pod,
}

struct Harness {
    socket: PathBuf,
    sink: AgentSink,
    reconciler: Reconciler,
    pods: Vec<TestPod>,
    // Dropped last: the netns and pins outlive the agent.
    _dir: tempfile::TempDir,
    _pin_dir: PinDir,
    _topo: Topology,
}

impl Harness {
    fn start(test: &str, pods: &[&str]) -> Harness {
        require_root().expect("kernel tests need root");
        log();
        let mut topo = Topology::new(test).expect("topology");
        topo.add_node(NODE).expect("node");
        let pods: Vec<TestPod> = pods
            .iter()
            .map(|name| {
                let pod = topo.add_pod(NODE, name).expect("pod");
                let uid = format!("uid-{name}");
                TestPod {
                    name: name.to_string(),
                    uid: uid.clone(),
                    netns: pod.netns_path(),
                    workload: Workload {
                        name: name.to_string(),
                        namespace: "zds".into(),
                        service_account: "sa".into(),
                        ips: vec![pod.ip().into()],
                        node: NODE.into(),
                        netns: Some(pod.netns_path()),
                        dataplane_mode: DataplaneMode::Ambient,
                        uid,
                        ..Default::default()
                    },
                    pod,
                }
            })
            .collect();
        let pin_dir = PinDir::new(&topo, "zds");
        let options = EbpfOptions {
            cgroup_root: Some(topo.cgroup_root().expect("topology cgroup")),
            ..EbpfOptions::new(pin_dir.path())
        };
        let redirector = EbpfRedirector::load(&options).expect("load eBPF");
        let dir = tempfile::tempdir().expect("socket dir");
        let socket = dir.path().join("ztunnel.sock");
        let config = shunt::inpod::ZdsConfig {
            ack_timeout: ACK_TIMEOUT,
            retry_initial: Duration::from_millis(200),
            retry_max: Duration::from_secs(1),
            ..Default::default()
        };
        let (server, link) = shunt::inpod::bind(&socket, config).expect("ZDS socket");
        tokio::spawn(server.run());
        let agent = NodeAgent::new(
            NODE.into(),
            TrustDomain::default(),
            Box::new(redirector),
            Capture::all(),
        )
        .with_ztunnel(link);
        let (pods_tx, pods_rx) = watch::channel(None);
        let reconciler = Reconciler::spawn(
            agent,
            ReconcilerInputs {
                pods: pods_rx,
                store_applied: None,
                verify_every: Duration::from_secs(1),
            },
            tokio::runtime::Handle::current(),
        )
        .expect("reconcile thread");
        Harness {
            socket,
            sink: AgentSink::new(pods_tx, None),
            reconciler,
            pods,
            _dir: dir,
            _pin_dir: pin_dir,
            _topo: topo,
        }
    }

    fn pod(&self, name: &str) -> &TestPod {
        self.pods
            .iter()
            .find(|p| p.name == name)
            .expect("a test pod")
    }

    /// The source pushes these pods (by name) as this node's list.
    fn push(&self, names: &[&str]) {
        self.sink.node_pods(NodePods {
            trust_domain: TrustDomain::default(),
            pods: names.iter().map(|n| self.pod(n).workload.clone()).collect(),
        });
    }

    /// Waits (bounded) until a published snapshot satisfies `check`.
    fn wait(&self, what: &str, check: impl Fn(&NodeSnapshot) -> bool) {
        let mut snapshots = self.reconciler.snapshots();
        let found = tokio::task::block_in_place(|| {
            tokio::runtime::Handle::current().block_on(async {
                tokio::time::timeout(TIMEOUT, async {
                    snapshots.wait_for(|s| check(s)).await.is_ok()
                })
                .await
            })
        });
        let last = self.reconciler.snapshots().borrow().clone();
        assert_eq!(
            found,
            Ok(true),
            "{what}: not within {TIMEOUT:?}; pods: {:#?}",
            states(&last)
        );
    }

    fn state(&self, name: &str) -> Option<PodState> {
        let snapshot = self.reconciler.snapshots().borrow().clone();
        let key = WorkloadKey::new("zds", name);
        snapshot
            .pods
            .iter()
            .find(|p| p.workload.key() == key)
            .map(|p| p.state.clone())
    }

    fn wait_state(&self, name: &str, state: PodState) {
        let key = WorkloadKey::new("zds", name);
        self.wait(&format!("{name} {state:?}"), |s| {
            s.pods
                .iter()
                .any(|p| p.workload.key() == key && p.state == state)
        });
    }

    /// The netns cookie `name` is enrolled with, once it is enrolled.
    fn enrolled_cookie(&self, name: &str) -> Option<u64> {
        let snapshot = self.reconciler.snapshots().borrow().clone();
        let key = WorkloadKey::new("zds", name);
        snapshot
            .pods
            .iter()
            .find(|p| p.workload.key() == key && p.state == PodState::Enrolled)
            .and_then(|p| Some(p.kernel.as_ref()?.netns_cookie))
    }

    fn wait_gone(&self, name: &str) {
        let key = WorkloadKey::new("zds", name);
        self.wait(&format!("{name} gone"), |s| {
            s.pods.iter().all(|p| p.workload.key() != key)
        });
    }
}

fn states(snapshot: &NodeSnapshot) -> Vec<(String, PodState, bool)> {
    snapshot
        .pods
        .iter()
        .map(|p| (p.workload.name.clone(), p.state.clone(), p.kernel.is_some()))
        .collect()
}

fn waiting() -> PodState {
    PodState::Pending(WAITING_FOR_ZTUNNEL.into())
}

fn connect_ztunnel(h: &Harness) -> Ztunnel {
    tokio::task::block_in_place(|| Ztunnel::connect(&h.socket))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn snapshot_add_del_and_a_fresh_snapshot_after_reconnect() {
    let h = Harness::start("zds-snapshot", &["a", "b", "c", "d"]);
    // c is on this node but not in the mesh: ztunnel never hears of it.
    let mut c = h.pod("c").workload.clone();
    c.dataplane_mode = DataplaneMode::None;
    h.sink.node_pods(NodePods {
        trust_domain: TrustDomain::default(),
        pods: vec![h.pod("a").workload.clone(), h.pod("b").workload.clone(), c],
    });
    // No ztunnel yet: the mesh pods wait for it, redirected already (their
    // traffic fails closed, as behind istio-cni's rules, never unmeshed).
    h.wait_state("a", waiting());
    h.wait_state("b", waiting());
    h.wait_state("c", PodState::NotInMesh);
    let snapshot = h.reconciler.snapshots().borrow().clone();
    assert_eq!(
        states(&snapshot),
        vec![
            ("a".to_string(), waiting(), true),
            ("b".to_string(), waiting(), true),
            ("c".to_string(), PodState::NotInMesh, false),
        ],
        "mesh pods redirected while waiting for ztunnel"
    );

    tokio::task::block_in_place(|| {
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("a"));
        // Not acked yet: a stays pending (its listeners may not be bound).
        assert_eq!(h.state("a"), Some(waiting()));
        z.ack();
        z.expect_add(h.pod("b"));
        z.ack();
        z.expect_snapshot_sent();
        z.ack();
        h.wait_state("a", PodState::Enrolled);
        h.wait_state("b", PodState::Enrolled);

        // b leaves the node: unenrolled, then ztunnel is told.
        h.push(&["a"]);
        let del = z.expect();
        match del.payload {
            Payload::Del(del) => assert_eq!(del.uid, h.pod("b").uid),
            other => panic!("expected DelWorkload for b, got {other:?}"),
        }
        z.ack();
        h.wait_gone("b");

        // ztunnel goes away; d arrives meanwhile and is queued, pending.
        drop(z);
        wait_for_log(&["ztunnel disconnected"]);
        h.push(&["a", "d"]);
        h.wait_state("d", waiting());

        // ztunnel is back: a fresh snapshot (a, d; not b), then d enrols.
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("a"));
        z.ack();
        z.expect_add(h.pod("d"));
        assert_eq!(h.state("d"), Some(waiting()));
        z.ack();
        z.expect_snapshot_sent();
        z.ack();
        h.wait_state("d", PodState::Enrolled);
        assert_eq!(h.state("a"), Some(PodState::Enrolled), "a stayed enrolled");

        // A second ztunnel connection gets a snapshot of its own; the
        // first stays open (a surge: `tests/tests/ztunnel_zds.rs`).
        let surge = Ztunnel::connect(&h.socket);
        surge.hello();
        surge.expect_add(h.pod("a"));
        surge.ack();
        surge.expect_add(h.pod("d"));
        surge.ack();
        surge.expect_snapshot_sent();
        surge.ack();
        drop(z);
    });
    h.reconciler.stop(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_ztunnel_that_never_acks_leaves_the_pod_pending() {
    let h = Harness::start("zds-noack", &["silent"]);
    h.push(&["silent"]);
    h.wait_state("silent", waiting());
    let z = connect_ztunnel(&h);
    tokio::task::block_in_place(|| {
        z.hello();
        z.expect_add(h.pod("silent"));
        // No ack: after the timeout the agent gives up on this connection.
        z.expect_closed();
    });
    let line = tokio::task::block_in_place(|| {
        wait_for_log(&[
            "did not acknowledge AddWorkload for zds/silent",
            "stays pending",
        ])
    });
    assert!(line.contains("ERROR"), "{line}");
    let snapshot = h.reconciler.snapshots().borrow().clone();
    assert_eq!(
        states(&snapshot),
        vec![("silent".to_string(), waiting(), true)],
        "pending, and redirected: its traffic fails closed"
    );
    h.reconciler.stop(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn malformed_messages_reset_the_connection_and_the_pod_stays_pending() {
    let h = Harness::start("zds-malformed", &["m"]);
    h.push(&["m"]);
    h.wait_state("m", waiting());
    tokio::task::block_in_place(|| {
        // Not a hello.
        let z = Ztunnel::connect(&h.socket);
        z.send(&[0xff, 0xff, 0xff]);
        z.expect_closed();
        wait_for_log(&["the first message is not a ZdsHello"]);

        // A hello of another version.
        let z = Ztunnel::connect(&h.socket);
        z.send(&ZdsHello { version: 7 }.encode_to_vec());
        z.expect_closed();
        wait_for_log(&["ZdsHello version 7 is not V1"]);

        // Garbage instead of the ack: the add is not taken as acked.
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("m"));
        z.send(&[0x0a, 0x09]);
        z.expect_closed();
        wait_for_log(&["malformed WorkloadResponse"]);

        // A response without an ack (only a field this protocol does not
        // have; an empty packet reads as the end of the connection).
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("m"));
        z.send(&[0x10, 0x01]);
        z.expect_closed();
        wait_for_log(&["WorkloadResponse without an ack"]);
    });
    let snapshot = h.reconciler.snapshots().borrow().clone();
    assert_eq!(
        states(&snapshot),
        vec![("m".to_string(), waiting(), true)],
        "nothing taken as acked: pending (redirected, failing closed)"
    );

    // A well-behaved ztunnel then gets the pod enrolled.
    tokio::task::block_in_place(|| {
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("m"));
        z.ack();
        z.expect_snapshot_sent();
        z.ack();
        h.wait_state("m", PodState::Enrolled);
    });
    h.reconciler.stop(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn refused_pods_are_sent_again_and_a_gone_netns_path_still_sends_the_captured_one() {
    let mut h = Harness::start("zds-keep", &["k", "r"]);
    // k's netns is reached through a bind mount the test can take away,
    // as when a pod's sandbox is torn down while ztunnel still serves it.
    let mount = h._dir.path().join("k-netns");
    std::fs::File::create(&mount).expect("mount point");
    nix::mount::mount(
        Some(&h.pod("k").netns),
        &mount,
        None::<&str>,
        nix::mount::MsFlags::MS_BIND,
        None::<&str>,
    )
    .expect("bind-mount k's netns");
    let captured = std::fs::metadata(&mount).expect("k's netns");
    let k = h.pods.iter_mut().find(|p| p.name == "k").expect("k");
    k.netns = mount.clone();
    k.workload.netns = Some(mount.clone());
    h.push(&["k", "r"]);
    h.wait_state("k", waiting());
    tokio::task::block_in_place(|| {
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("k"));
        z.ack();
        z.expect_add(h.pod("r"));
        // ztunnel refuses r (e.g. a port in its netns is taken).
        let refuse = || {
            z.send(
                &WorkloadResponse {
                    payload: Some(workload_response::Payload::Ack(Ack {
                        error: "failure to start proxy".into(),
                    })),
                }
                .encode_to_vec(),
            )
        };
        refuse();
        z.expect_snapshot_sent();
        z.ack();
        h.wait_state("k", PodState::Enrolled);
        h.wait_state(
            "r",
            PodState::Pending(
                "ztunnel refused the pod: failure to start proxy (attempt 1; sent again in 200ms; its traffic fails closed meanwhile)".into(),
            ),
        );
        wait_for_log(&["ztunnel refused the pod", "failure to start proxy"]);
        // Sent again on the same connection; acked this time.
        z.expect_add(h.pod("r"));
        z.ack();
        h.wait_state("r", PodState::Enrolled);

        // k's netns path goes away; ztunnel reconnects: k is still added,
        // with the namespace held since its capture.
        // Lazily: the redirector may hold the netns open meanwhile.
        nix::mount::umount2(&mount, nix::mount::MntFlags::MNT_DETACH).expect("unmount k's netns");
        std::fs::remove_file(&mount).expect("remove the mount point");
        drop(z);
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        let add = z.expect();
        match add.payload {
            Payload::Add(ref add) => assert_eq!(add.uid, h.pod("k").uid),
            ref other => panic!("expected AddWorkload for k, got {other:?}"),
        }
        assert_eq!(add.fds.len(), 1, "one fd with AddWorkload");
        let st = fstat(add.fds[0].as_raw_fd()).expect("fstat the fd");
        assert_eq!(
            (st.st_dev, st.st_ino),
            ns_identity(&captured),
            "k's namespace, captured"
        );
        z.ack();
        z.expect_add(h.pod("r"));
        z.ack();
        z.expect_snapshot_sent();
        z.ack();
        assert_eq!(h.state("k"), Some(PodState::Enrolled));
    });
    h.reconciler.stop(true).await;
}

/// A namespace's identity: its nsfs device and inode.
fn ns_identity(meta: &std::fs::Metadata) -> (u64, u64) {
    (meta.dev(), meta.ino())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_netns_replaced_under_the_same_path_is_sent_again_and_enrolled_after_the_ack() {
    let h = Harness::start("zds-renew", &["renewed", "steady"]);
    h.push(&["renewed", "steady"]);
    h.wait_state("renewed", waiting());
    tokio::task::block_in_place(|| {
        let z = Ztunnel::connect(&h.socket);
        z.hello();
        z.expect_add(h.pod("renewed"));
        z.ack();
        z.expect_add(h.pod("steady"));
        z.ack();
        z.expect_snapshot_sent();
        z.ack();
        h.wait_state("renewed", PodState::Enrolled);
        h.wait_state("steady", PodState::Enrolled);
        let renewed = h.pod("renewed");
        let old_cookie = h
            .enrolled_cookie("renewed")
            .expect("enrolled with a cookie");
        let old = std::fs::metadata(&renewed.netns).expect("the old netns");

        // The sandbox is recreated under the same path (same pod, same IP),
        // and the source lists the pods again: nothing in the list changed.
        renewed
            .pod
            .recreate_sandbox()
            .expect("recreate the sandbox");
        let new = std::fs::metadata(&renewed.netns).expect("the new netns");
        assert_ne!(ns_identity(&old), ns_identity(&new), "a new namespace");
        h.push(&["renewed", "steady"]);

        // ztunnel lets go of the old namespace, then gets the new one.
        let del = z.expect();
        match del.payload {
            Payload::Del(del) => assert_eq!(del.uid, renewed.uid),
            other => panic!("expected DelWorkload for renewed, got {other:?}"),
        }
        z.ack();
        let add = z.expect();
        let Payload::Add(ref added) = add.payload else {
            panic!("expected AddWorkload for renewed, got {:?}", add.payload)
        };
        assert_eq!(added.uid, renewed.uid);
        assert_eq!(add.fds.len(), 1, "one fd with AddWorkload");
        let st = fstat(add.fds[0].as_raw_fd()).expect("fstat the fd");
        assert_eq!(
            (st.st_dev, st.st_ino),
            ns_identity(&new),
            "the fd is the pod's new network namespace (the old one is {:?})",
            ns_identity(&old)
        );
        // Not redirected again before ztunnel's listeners are bound there.
        h.wait_state("renewed", waiting());
        z.ack();
        h.wait_state("renewed", PodState::Enrolled);
        let new_cookie = NetNs::open(&renewed.netns)
            .expect("open the new netns")
            .cookie()
            .expect("netns cookie");
        assert_ne!(new_cookie, old_cookie);
        h.wait("renewed enrolled with its new namespace's cookie", |s| {
            s.pods.iter().any(|p| {
                p.workload.name == "renewed"
                    && p.state == PodState::Enrolled
                    && p.kernel.as_ref().map(|k| k.netns_cookie) == Some(new_cookie)
            })
        });
        assert_eq!(h.state("steady"), Some(PodState::Enrolled), "untouched");
    });
    h.reconciler.stop(true).await;
}

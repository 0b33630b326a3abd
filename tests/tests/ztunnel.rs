//! `--proxy ztunnel` end to end on the kernel, with a stand-in ztunnel
//! (`shunt_testbed::ztunnel`) that uses only what a stock ztunnel uses: it
//! connects to the agent's ZDS socket, receives each pod's network
//! namespace as the `AddWorkload`'s SCM_RIGHTS fd, binds its listeners
//! inside it (15001; 15006 and 15008 with IP_TRANSPARENT) and acks; it reads
//! an outbound connection's original destination with
//! `getsockopt(SO_ORIGINAL_DST)`, carries it to another stand-in as HBONE
//! (TLS 1.3 with SPIFFE certificates both ways, HTTP/2 CONNECT to the
//! destination pod's IP:15008) or as plaintext TCP, and delivers inbound
//! connections to the application with IP_TRANSPARENT from the client's
//! address, every socket it opens marked 0x539.
//!
//! Covered, in the eBPF mode and in the iptables mode with Istio's rules:
//! the pod redirected only after the ack; bytes both ways through the
//! client's stand-in (original destination from `SO_ORIGINAL_DST`, IPv4
//! and v4-mapped IPv6, on a `127.0.0.1:15001` listener and on a dual-stack
//! `[::]:15001` one) and the server's; inbound HBONE: the client's
//! stand-in's marked connection to the server pod's 15008 reaches the
//! server's stand-in's 15008 listener as sent (never redirected), which
//! delivers the CONNECT's authority (the original destination) from the
//! client's address, the application sees the client's address and its
//! replies come back; inbound plaintext (a mesh client's stand-in speaking
//! plain TCP, and a pod outside the mesh) to 15006, the same;
//! `SO_ORIGINAL_DST` on a connection that was not redirected answers the
//! kernel's error (eBPF) or its own destination (conntrack), never another
//! connection's.
//!
//! Not covered: a real ztunnel binary (the stand-in checks no
//! authorization and only the peer's chain and trust domain, not the
//! client's identity against a policy).

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr, TcpListener},
    os::fd::OwnedFd,
    path::PathBuf,
    time::Duration,
};

use nix::sched::{CloneFlags, setns};
use shunt::{
    agent::{NodeAgent, Reconciler, ReconcilerInputs},
    app::AgentSink,
    control::{NodePods, SourceSink},
    redirect::{
        Capture, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector},
        iptables::{InpodRules, IptablesOptions, IptablesRedirector},
    },
    snapshot::NodeSnapshot,
    state::{DataplaneMode, PodState, SpiffeId, TrustDomain, Workload, WorkloadKey},
};
use shunt_proto::istio::zds::workload_request::Payload;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::PinDir,
    apps::{EchoServer, TestApp, ok},
    hbone::MeshCa,
    require_root,
    ztunnel::{InPodProxy, Mesh, Options, ZdsClient},
};

const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
const TIMEOUT: Duration = Duration::from_secs(30);

/// Binds ztunnel's in-pod listeners inside the netns `netns` (a thread
/// enters it; the sockets stay there).
fn bind_in(netns: OwnedFd) -> Vec<TcpListener> {
    std::thread::spawn(move || {
        setns(&netns, CloneFlags::CLONE_NEWNET).expect("enter the pod's netns");
        ["127.0.0.1:15001", "0.0.0.0:15006", "0.0.0.0:15008"]
            .iter()
            .map(|addr| TcpListener::bind(addr).expect("bind in the pod's netns"))
            .collect()
    })
    .join()
    .expect("listener thread")
}

fn workload(pod: &Pod, mode: DataplaneMode) -> Workload {
    Workload {
        name: pod.name().to_string(),
        namespace: "default".into(),
        service_account: "sa".into(),
        ips: vec![pod.ip().into()],
        node: "node-a".into(),
        netns: Some(pod.netns_path()),
        dataplane_mode: mode,
        uid: format!("uid-{}", pod.name()),
        ..Default::default()
    }
}

fn ebpf_redirector(topo: &Topology, pin: &PinDir) -> Box<dyn Redirector> {
    let mut options = EbpfOptions::new(pin.path());
    options.cgroup_root = Some(topo.cgroup_root().expect("cgroup root"));
    Box::new(EbpfRedirector::load(&options).expect("load eBPF"))
}

/// What the stand-ins need to speak HBONE to each other: a CA for their
/// certificates and the mesh workloads' identities by IP (what a ztunnel
/// gets from its CA and from istiod).
struct HboneSetup {
    ca: MeshCa,
    workloads: BTreeMap<IpAddr, SpiffeId>,
}

/// The agent's reconciler with a ZDS server on a socket of the test's own.
struct Agent {
    reconciler: Reconciler,
    socket: PathBuf,
    socket_dir: PathBuf,
}

impl Agent {
    fn start(topo: &Topology, redirector: Box<dyn Redirector>, pods: Vec<Workload>) -> Agent {
        let socket_dir = PathBuf::from(format!("/tmp/{}-zds", topo.prefix()));
        let socket = socket_dir.join("ztunnel.sock");
        let (server_task, link) =
            shunt::inpod::bind(&socket, Duration::from_secs(5)).expect("ZDS socket");
        tokio::spawn(server_task.run());
        let agent = NodeAgent::new(
            "node-a".into(),
            TrustDomain::default(),
            redirector,
            Capture::all(),
        )
        .with_ztunnel(link);
        let (pods_tx, pods_rx) = tokio::sync::watch::channel(None);
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
        AgentSink::new(pods_tx, None).node_pods(NodePods {
            trust_domain: TrustDomain::default(),
            pods,
        });
        Agent {
            reconciler,
            socket,
            socket_dir,
        }
    }

    /// Waits (bounded) for a snapshot where `pod` is in `state`.
    async fn wait_for(&self, pod: &str, state: PodState) -> NodeSnapshot {
        let key = WorkloadKey::new("default", pod);
        let mut snapshots = self.reconciler.snapshots();
        let found = tokio::time::timeout(TIMEOUT, async {
            snapshots
                .wait_for(|s| {
                    s.pods
                        .iter()
                        .any(|p| p.workload.key() == key && p.state == state)
                })
                .await
                .map(|s| (**s).clone())
        })
        .await;
        match found {
            Ok(Ok(snapshot)) => snapshot,
            _ => panic!(
                "{pod} not {state:?} within {TIMEOUT:?}: {:?}",
                self.reconciler.snapshots().borrow().pods
            ),
        }
    }

    /// Connects a stand-in ztunnel and serves requests until it holds a
    /// proxy for each of `expected` pods (its in-pod proxy started, then
    /// the ack) and has seen `SnapshotSent`. A stand-in that connects
    /// before the agent knows the pods gets an empty snapshot and the pods'
    /// `AddWorkload`s after it, so both orders are served. With `hbone`
    /// each pod's stand-in speaks HBONE to the others, with the identity
    /// its `workload_info` names, and binds its outbound listener dual
    /// stack (`[::]:15001`), as ztunnel does with IPv6 on.
    fn serve_with_stand_in(
        &self,
        cgroup: &Cgroup,
        expected: usize,
        hbone: Option<&HboneSetup>,
    ) -> (ZdsClient, BTreeMap<String, InPodProxy>) {
        let zds = ZdsClient::connect(&self.socket).expect("connect to the ZDS socket");
        zds.hello().expect("hello");
        let mut proxies = BTreeMap::new();
        let mut snapshot_sent = false;
        // Bounded: a few pods and SnapshotSent (each `recv` has its own
        // timeout).
        for _ in 0..16 {
            let (payload, mut fds) = zds.recv().expect("a request from the agent");
            match payload {
                Payload::Add(add) => {
                    assert_eq!(fds.len(), 1, "one netns fd with {add:?}");
                    let mut options = Options::new(Some(cgroup.path().to_path_buf()));
                    if let Some(hbone) = hbone {
                        let info = add.workload_info.as_ref().expect("workload_info");
                        let identity = SpiffeId::for_service_account(
                            &TrustDomain::default(),
                            &info.namespace,
                            &info.service_account,
                        );
                        options.mesh = Some(Mesh {
                            credentials: hbone.ca.credentials(&identity).expect("certificate"),
                            workloads: hbone.workloads.clone(),
                        });
                        options.outbound = "[::]:15001".parse().expect("addr");
                    }
                    let proxy =
                        InPodProxy::start_with(fds.remove(0), options).expect("bind in the pod");
                    proxies.insert(add.uid, proxy);
                    zds.ack().expect("ack");
                }
                Payload::SnapshotSent(_) => {
                    zds.ack().expect("ack");
                    snapshot_sent = true;
                }
                other => panic!("unexpected request {other:?}"),
            }
            if snapshot_sent && proxies.len() == expected {
                return (zds, proxies);
            }
        }
        panic!(
            "after 16 requests: snapshot sent {snapshot_sent}, {} of {expected} pods added",
            proxies.len()
        );
    }

    async fn stop(self) {
        self.reconciler.stop(true).await;
        let _ = std::fs::remove_dir_all(&self.socket_dir);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_is_redirected_to_the_stand_in_only_after_its_ack() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("ztunnel-e2e", &["client", "server"]).expect("topology");
    let [client, server] = [&pods[0], &pods[1]];
    let apps = Cgroup::create(&topo, "apps").expect("cgroup");
    let pin = PinDir::new(&topo, "ztunnel");
    let agent = Agent::start(
        &topo,
        ebpf_redirector(&topo, &pin),
        vec![
            workload(client, DataplaneMode::Ambient),
            workload(server, DataplaneMode::None),
        ],
    );
    agent
        .wait_for("client", PodState::Pending("waiting for ztunnel".into()))
        .await;
    let real = EchoServer::start(
        server
            .listen_tcp("0.0.0.0:8080".parse().expect("addr"))
            .expect("listen"),
        None,
    );
    let app = TestApp::new(TESTAPP, &apps);
    let to = format!("{}:8080", server.ip());

    let (zds, listeners) = tokio::task::block_in_place(|| {
        // No ztunnel has the pod: its connect is not redirected.
        let report = app.run(client, &["connect", &to, "--send", "1000"]);
        assert!(ok(&report), "{report}");
        assert_eq!(real.accepted().len(), 1, "reached the server directly");

        let zds = ZdsClient::connect(&agent.socket).expect("connect");
        zds.hello().expect("hello");
        let (payload, mut fds) = zds.recv().expect("an add");
        assert!(
            matches!(payload, Payload::Add(ref add) if add.uid == "uid-client"),
            "{payload:?}"
        );
        assert_eq!(fds.len(), 1, "one netns fd");
        let listeners = bind_in(fds.remove(0));
        zds.ack().expect("ack");
        let (payload, _) = zds.recv().expect("snapshot sent");
        assert!(matches!(payload, Payload::SnapshotSent(_)), "{payload:?}");
        zds.ack().expect("ack");
        (zds, listeners)
    });
    agent.wait_for("client", PodState::Enrolled).await;

    let mut listeners = listeners.into_iter();
    let outbound = EchoServer::start(listeners.next().expect("15001"), None);
    tokio::task::block_in_place(|| {
        let report = app.run(client, &["connect", &to, "--send", "100000"]);
        assert!(ok(&report), "{report}");
    });
    let accepted = outbound.accepted();
    assert_eq!(accepted.len(), 1, "{accepted:?}");
    assert_eq!(accepted[0].local, "127.0.0.1:15001".parse().expect("addr"));
    assert_eq!(
        real.accepted().len(),
        1,
        "the server was not reached directly again"
    );

    agent.stop().await;
    drop(zds);
}

/// What the kernel may answer `SO_ORIGINAL_DST` on a connection that was
/// not redirected.
enum NotRedirected {
    /// eBPF mode: nothing was NATed and conntrack does not track the pod:
    /// ENOENT (conntrack loaded) or ENOPROTOOPT (not loaded).
    KernelError,
    /// iptables mode: conntrack tracked it un-NATed and answers its own
    /// destination.
    OwnDestination,
}

/// The traffic of both end-to-end tests: `client` and `server` in the mesh
/// (each served by its own stand-in), `outsider` not.
async fn bytes_flow_through_the_stand_ins(
    topo: &Topology,
    pods: &[Pod],
    redirector: Box<dyn Redirector>,
    not_redirected: NotRedirected,
) -> Agent {
    let [client, server, outsider] = [&pods[0], &pods[1], &pods[2]];
    let apps = Cgroup::create(topo, "apps").expect("cgroup");
    // The stand-in's sockets belong below the agent's cgroup root, as a
    // real ztunnel pod's do.
    let ztunnel_cgroup = Cgroup::create(topo, "ztunnel").expect("cgroup");
    let agent = Agent::start(
        topo,
        redirector,
        vec![
            workload(client, DataplaneMode::Ambient),
            workload(server, DataplaneMode::Ambient),
            workload(outsider, DataplaneMode::None),
        ],
    );
    let (zds, proxies) =
        tokio::task::block_in_place(|| agent.serve_with_stand_in(&ztunnel_cgroup, 2, None));
    for pod in ["client", "server"] {
        let snapshot = agent.wait_for(pod, PodState::Enrolled).await;
        let entry = snapshot
            .pods
            .iter()
            .find(|p| p.workload.name == pod)
            .expect("pod in the snapshot");
        let hooks = &entry.kernel.as_ref().expect("kernel view").hooks;
        assert!(
            !hooks.is_empty() && hooks.iter().all(|h| h.present),
            "{pod}: {hooks:#?}"
        );
    }
    let client_proxy = &proxies["uid-client"];
    let server_proxy = &proxies["uid-server"];
    let real = EchoServer::on(server, 8080).expect("echo server");
    let app = TestApp::new(TESTAPP, &apps);
    let to: SocketAddr = SocketAddr::new(server.ip().into(), 8080);

    tokio::task::block_in_place(|| {
        // Mesh to mesh: the client's stand-in (outbound) and the server's
        // (inbound, transparent) both carry it.
        let report = app.run(client, &["connect", &to.to_string(), "--send", "100000"]);
        assert!(
            ok(&report),
            "{report}; client's stand-in: {:?}; server's: {:?}",
            client_proxy.outbound(),
            server_proxy.inbound()
        );
        assert_eq!(report["received"], 100000, "{report}");
        let out = client_proxy.outbound();
        assert_eq!(out.len(), 1, "{out:?}");
        assert_eq!(out[0].original, Ok(to), "SO_ORIGINAL_DST: {out:?}");
        let inbound = server_proxy.inbound();
        assert_eq!(inbound.len(), 1, "{inbound:?}");
        assert_eq!(inbound[0].destination, to, "{inbound:?}");
        assert_eq!(inbound[0].peer.ip(), client.ip(), "{inbound:?}");
        assert_eq!(
            inbound[0].delivered_from.as_ref().map(|a| a.ip()),
            Ok(client.ip().into()),
            "{inbound:?}"
        );
        // The application saw the client's address, and its replies came
        // back to the stand-in's transparent socket (else no echo).
        let peers = real.peers();
        assert_eq!(peers.len(), 1, "{peers:?}");
        assert_eq!(peers[0].ip(), client.ip(), "{peers:?}");

        // A dual-stack socket reaching IPv4.
        let mapped = format!("[::ffff:{}]:8080", server.ip());
        let report = app.run(client, &["connect", &mapped, "--send", "5000"]);
        assert!(ok(&report), "{report}");
        let out = client_proxy.outbound();
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(
            out[1].original,
            Ok(to),
            "v4-mapped SO_ORIGINAL_DST: {out:?}"
        );

        // Inbound plaintext from outside the mesh.
        let report = app.run(outsider, &["connect", &to.to_string(), "--send", "5000"]);
        assert!(ok(&report), "{report}");
        let inbound = server_proxy.inbound();
        assert!(
            inbound.iter().any(|i| i.peer.ip() == outsider.ip()
                && i.destination == to
                && i.delivered_from.as_ref().map(|a| a.ip()) == Ok(outsider.ip().into())),
            "{inbound:?}"
        );
        assert!(
            real.peers().iter().any(|p| p.ip() == outsider.ip()),
            "{:?}",
            real.peers()
        );

        // A connection to the outbound listener that was not redirected.
        let _ = app.run(client, &["connect", "127.0.0.1:15001", "--send", "10"]);
        let out = client_proxy.outbound();
        assert_eq!(out.len(), 3, "{out:?}");
        let own: SocketAddr = "127.0.0.1:15001".parse().expect("addr");
        match &not_redirected {
            NotRedirected::KernelError => assert!(
                matches!(out[2].original, Err(e) if e == libc::ENOENT || e == libc::ENOPROTOOPT),
                "{out:?}"
            ),
            NotRedirected::OwnDestination => {
                assert!(matches!(out[2].original, Ok(a) if a == own), "{out:?}")
            }
        }

        // eBPF mode: a record outlives its connection (LRU), so a later
        // connection made straight to 15001 from the same local address and
        // port must still not get the earlier connection's destination.
        // (Not in the iptables mode: a connect bound to 127.0.0.1 towards
        // another host fails its route lookup before NAT could redirect it.)
        if matches!(not_redirected, NotRedirected::KernelError) {
            stale_record_is_never_the_answer(&app, client, client_proxy, to);
        }
    });
    drop(zds);
    agent
}

/// Connection A redirected from 127.0.0.1:P, then B straight to
/// 127.0.0.1:15001 from the same 127.0.0.1:P (A's TIME_WAIT reused):
/// `SO_ORIGINAL_DST` on B's accepted end is the kernel's error, not A's
/// destination.
fn stale_record_is_never_the_answer(
    app: &TestApp,
    client: &Pod,
    proxy: &InPodProxy,
    to: SocketAddr,
) {
    let local = format!("127.0.0.1:{}", 40000 + std::process::id() % 20000);
    let before = proxy.outbound().len();
    let report = app.run(
        client,
        &[
            "connect",
            &to.to_string(),
            "--send",
            "100",
            "--bind",
            &local,
        ],
    );
    assert!(ok(&report), "{report}");
    let out = proxy.outbound();
    assert_eq!(out.len(), before + 1, "{out:?}");
    assert_eq!(out[before].peer.to_string(), local, "{out:?}");
    assert_eq!(out[before].original, Ok(to), "{out:?}");
    // A bound connect reuses A's TIME_WAIT (timestamps); bounded retries in
    // case the kernel needs a moment.
    let mut reused = None;
    for _ in 0..25 {
        let _ = app.run(
            client,
            &[
                "connect",
                "127.0.0.1:15001",
                "--send",
                "10",
                "--bind",
                &local,
            ],
        );
        let out = proxy.outbound();
        if let Some(b) = out[before + 1..]
            .iter()
            .find(|o| o.peer.to_string() == local)
        {
            reused = Some(b.clone());
            break;
        }
        std::thread::sleep(Duration::from_millis(200));
    }
    let reused = reused.expect("a direct connection from the same local port");
    assert!(
        matches!(reused.original, Err(e) if e == libc::ENOENT || e == libc::ENOPROTOOPT),
        "not the kernel's error (A's destination was {to}): {reused:?}"
    );
}

/// Mesh to mesh over HBONE, as two ztunnels carry it: the client's
/// stand-in takes the application's connection on 15001 and opens TLS +
/// HTTP/2 CONNECT to the server pod's IP:15008 (marked 0x539, from the
/// client pod's netns); the server's stand-in, on its 15008 listener,
/// delivers it to the application from the client's address.
async fn hbone_flows_between_the_stand_ins(
    topo: &Topology,
    pods: &[Pod],
    redirector: Box<dyn Redirector>,
) -> Agent {
    let [client, server] = [&pods[0], &pods[1]];
    let apps = Cgroup::create(topo, "apps").expect("cgroup");
    let ztunnel_cgroup = Cgroup::create(topo, "ztunnel").expect("cgroup");
    let account = |sa: &str| SpiffeId::for_service_account(&TrustDomain::default(), "default", sa);
    let (client_id, server_id) = (account("sleep"), account("httpbin"));
    let agent = Agent::start(
        topo,
        redirector,
        vec![
            Workload {
                service_account: "sleep".into(),
                ..workload(client, DataplaneMode::Ambient)
            },
            Workload {
                service_account: "httpbin".into(),
                ..workload(server, DataplaneMode::Ambient)
            },
        ],
    );
    let hbone = HboneSetup {
        ca: MeshCa::generate().expect("test CA"),
        workloads: BTreeMap::from([
            (IpAddr::from(client.ip()), client_id.clone()),
            (IpAddr::from(server.ip()), server_id),
        ]),
    };
    let (zds, proxies) =
        tokio::task::block_in_place(|| agent.serve_with_stand_in(&ztunnel_cgroup, 2, Some(&hbone)));
    for pod in ["client", "server"] {
        agent.wait_for(pod, PodState::Enrolled).await;
    }
    let client_proxy = &proxies["uid-client"];
    let server_proxy = &proxies["uid-server"];
    let real = EchoServer::on(server, 8080).expect("echo server");
    let app = TestApp::new(TESTAPP, &apps);
    let to = SocketAddr::new(server.ip().into(), 8080);

    tokio::task::block_in_place(|| {
        let report = app.run(client, &["connect", &to.to_string(), "--send", "100000"]);
        assert!(
            ok(&report),
            "{report}; client's stand-in: {:?}; server's: {:?}",
            client_proxy.outbound(),
            server_proxy.inbound()
        );
        assert_eq!(report["received"], 100000, "{report}");

        // The client's stand-in: accepted on its dual-stack listener (the
        // application's address v4-mapped: 127.0.0.1 in the eBPF mode, the
        // pod's own with REDIRECT), the IPv4 original destination
        // from SO_ORIGINAL_DST at SOL_IP, carried over HBONE (CONNECT
        // answered 200).
        let out = client_proxy.outbound();
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(
            matches!(out[0].peer.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped().is_some()),
            "not accepted on the dual-stack listener: {out:?}"
        );
        assert_eq!(out[0].original, Ok(to), "SO_ORIGINAL_DST: {out:?}");
        assert_eq!(out[0].hbone, Some(Ok(())), "{out:?}");

        // The server's stand-in: the HBONE connection reached its 15008
        // listener as sent (not taken to 15006: no other record), from the
        // client pod, with the client's certificate; the CONNECT's
        // authority is the original destination; delivered from the
        // client's address.
        let inbound = server_proxy.inbound();
        assert_eq!(inbound.len(), 1, "{inbound:?}");
        let stream = &inbound[0];
        assert_eq!(stream.listener_port, 15008, "{inbound:?}");
        assert_eq!(
            stream.local,
            SocketAddr::new(server.ip().into(), 15008),
            "{inbound:?}"
        );
        assert_eq!(stream.peer.ip(), client.ip(), "{inbound:?}");
        assert_eq!(
            stream.peer_identity.as_deref(),
            Some(client_id.as_str()),
            "{inbound:?}"
        );
        assert_eq!(
            stream.authority.as_deref(),
            Some(to.to_string().as_str()),
            "{inbound:?}"
        );
        assert_eq!(stream.destination, to, "{inbound:?}");
        assert_eq!(
            stream.delivered_from.as_ref().map(|a| a.ip()),
            Ok(client.ip().into()),
            "{inbound:?}"
        );
        // The application saw the client's address, and its replies came
        // back to the stand-in's transparent socket (else no echo).
        let peers = real.peers();
        assert_eq!(peers.len(), 1, "{peers:?}");
        assert_eq!(peers[0].ip(), client.ip(), "{peers:?}");

        // A dual-stack application socket reaching IPv4: the same HBONE
        // hop, the authority in IPv4 form.
        let mapped = format!("[::ffff:{}]:8080", server.ip());
        let report = app.run(client, &["connect", &mapped, "--send", "5000"]);
        assert!(ok(&report), "{report}; {:?}", server_proxy.inbound());
        let out = client_proxy.outbound();
        assert_eq!(out.len(), 2, "{out:?}");
        assert_eq!(out[1].original, Ok(to), "{out:?}");
        assert_eq!(out[1].hbone, Some(Ok(())), "{out:?}");
        let inbound = server_proxy.inbound();
        assert_eq!(inbound.len(), 2, "{inbound:?}");
        assert_eq!(
            inbound[1].authority.as_deref(),
            Some(to.to_string().as_str()),
            "{inbound:?}"
        );
        assert_eq!(real.peers().len(), 2, "{:?}", real.peers());
        assert!(
            real.peers().iter().all(|p| p.ip() == client.ip()),
            "{:?}",
            real.peers()
        );
    });
    drop(zds);
    agent
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ebpf_mode_carries_hbone_between_two_stand_in_ztunnels() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zt-hb-ebpf", &["client", "server"]).expect("topology");
    let pin = PinDir::new(&topo, "zthb");
    let agent = hbone_flows_between_the_stand_ins(&topo, &pods, ebpf_redirector(&topo, &pin)).await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn iptables_mode_carries_hbone_between_two_stand_in_ztunnels() {
    require_root().expect("kernel tests need root");
    let (topo, pods) = Topology::single_node("zt-hb-ipt", &["client", "server"]).expect("topology");
    let mut options = IptablesOptions::new(format!("{}-node-a", topo.prefix()));
    options.rules = InpodRules::Istio;
    let redirector = IptablesRedirector::new(options).expect("iptables redirector");
    let agent = hbone_flows_between_the_stand_ins(&topo, &pods, Box::new(redirector)).await;
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ebpf_mode_carries_bytes_through_a_stand_in_ztunnel_both_ways() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zt-ebpf", &["client", "server", "outsider"]).expect("topology");
    let pin = PinDir::new(&topo, "zt");
    let agent = bytes_flow_through_the_stand_ins(
        &topo,
        &pods,
        ebpf_redirector(&topo, &pin),
        NotRedirected::KernelError,
    )
    .await;
    // The answer came from the getsockopt program, which is pinned.
    assert!(
        pin.path().join("links/shunt_getsockopt").exists(),
        "link not pinned"
    );
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn iptables_mode_applies_istios_rules_for_a_stand_in_ztunnel_and_removes_them() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zt-ipt", &["client", "server", "outsider"]).expect("topology");
    let mut options = IptablesOptions::new(format!("{}-node-a", topo.prefix()));
    options.rules = InpodRules::Istio;
    let redirector = IptablesRedirector::new(options).expect("iptables redirector");
    let agent = bytes_flow_through_the_stand_ins(
        &topo,
        &pods,
        Box::new(redirector),
        NotRedirected::OwnDestination,
    )
    .await;
    let server = &pods[1];
    let read = |program: &str, args: &[&str]| {
        let out = server
            .command(program)
            .args(args)
            .output()
            .expect("run in the pod");
        String::from_utf8_lossy(&out.stdout).into_owned()
    };
    let saved = read("iptables-save", &[]);
    for rule in [
        "-A ISTIO_PRERT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j TPROXY --on-port 15006 --on-ip 0.0.0.0 --tproxy-mark 0x111/0xfff",
        "-A ISTIO_OUTPUT ! -d 127.0.0.1/32 -p tcp -m mark ! --mark 0x539/0xfff -j REDIRECT --to-ports 15001",
        "-A ISTIO_PRERT -m mark --mark 0x539/0xfff -j CONNMARK --set-xmark 0x111/0xfff",
    ] {
        assert!(saved.contains(rule), "missing {rule}:\n{saved}");
    }
    let rules = read("ip", &["rule"]);
    assert!(rules.contains("fwmark 0x111/0xfff lookup 100"), "{rules}");
    assert!(
        read("ip", &["route", "show", "table", "100"]).contains("local default dev lo"),
        "no local route in table 100"
    );

    agent.stop().await;
    let saved = read("iptables-save", &[]);
    assert!(!saved.contains("ISTIO_"), "left behind:\n{saved}");
    let rules = read("ip", &["rule"]);
    assert!(!rules.contains("lookup 100"), "left behind: {rules}");
}

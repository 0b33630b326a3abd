//! `--proxy ztunnel` end to end on the kernel, with a stand-in ztunnel
//! (`shunt_testbed::ztunnel`) that uses only what a stock ztunnel uses: it
//! connects to the agent's ZDS socket, receives each pod's network
//! namespace as the `AddWorkload`'s SCM_RIGHTS fd, binds its listeners
//! inside it (15001; 15006 and 15008 with IP_TRANSPARENT) and acks; it reads
//! an outbound connection's original destination with
//! `getsockopt(SO_ORIGINAL_DST)`, carries it to another stand-in (here as
//! plaintext TCP; as HBONE in `ztunnel_hbone.rs`) and delivers inbound
//! connections to the application with IP_TRANSPARENT from the client's
//! address, every socket it opens marked 0x539.
//!
//! Covered, in the eBPF mode and in the iptables mode with Istio's rules:
//! the pod redirected before ztunnel has it, its connect failing closed
//! until the ack (eBPF: with `tcp_fwmark_accept` on in its netns before
//! ztunnel is handed it); bytes both ways through the
//! client's stand-in (original destination from `SO_ORIGINAL_DST`, IPv4
//! and v4-mapped IPv6) and the server's (inbound plaintext on 15006: the
//! application sees the client's address and its replies come back);
//! inbound plaintext from a pod outside the mesh; `SO_ORIGINAL_DST` on a
//! connection that was not redirected answers the kernel's error (eBPF)
//! or its own destination (conntrack), never another connection's.
//! Inbound HBONE, and `SO_ORIGINAL_DST` on a dual-stack `[::]:15001`
//! listener: `ztunnel_hbone.rs`.
//!
//! The stand-in checks no authorization and only the peer's chain and
//! trust domain; the stock ztunnel, with a policy, is in
//! `ztunnel_stock_traffic.rs`.

mod ztunnel_harness;

use std::{
    net::{SocketAddr, TcpListener},
    os::fd::OwnedFd,
    time::Duration,
};

use nix::sched::{CloneFlags, setns};
use shunt::{
    redirect::{
        Redirector,
        iptables::{InpodRules, IptablesOptions, IptablesRedirector},
    },
    state::{DataplaneMode, PodState},
};
use shunt_proto::istio::zds::workload_request::Payload;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::PinDir,
    apps::{EchoServer, TestApp, ok},
    require_root,
    ztunnel::{InPodProxy, ZdsClient},
};
use ztunnel_harness::{Agent, TESTAPP, ebpf_redirector, workload};

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

/// connect() failing with EPERM: the eBPF connect hook found no listener
/// on 15001 in the pod and refused it (fail closed).
const EPERM: i64 = 1;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_pod_fails_closed_until_its_ack_then_reaches_the_stand_in() {
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
        // No ztunnel has the pod yet: redirected all the same (as behind
        // istio-cni's rules), its connect fails closed instead of going
        // out unmeshed.
        let report = app.run(client, &["connect", &to, "--send", "1000"]);
        assert_eq!(report["errno"], EPERM, "{report}");
        assert!(real.accepted().is_empty(), "reached the server unmeshed");

        let zds = ZdsClient::connect(&agent.socket).expect("connect");
        zds.hello().expect("hello");
        let (payload, mut fds) = zds.recv().expect("an add");
        assert!(
            matches!(payload, Payload::Add(ref add) if add.uid == "uid-client"),
            "{payload:?}"
        );
        assert_eq!(fds.len(), 1, "one netns fd");
        // Handed to ztunnel, which may accept connections for the pod from
        // now on (a peer's HBONE to podIP:15008 needs no redirect), and
        // not enrolled yet: the application must already take the mark of
        // the proxy's connections, which the pod's `REPLY_BY_MARK` relies
        // on once enrolled (reply_path.rs).
        let fwmark_accept = client
            .run(|| std::fs::read_to_string("/proc/sys/net/ipv4/tcp_fwmark_accept"))
            .expect("enter the pod")
            .expect("read tcp_fwmark_accept");
        assert_eq!(
            fwmark_accept.trim(),
            "1",
            "net.ipv4.tcp_fwmark_accept in the pod before ztunnel may serve it"
        );
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
    assert!(
        real.accepted().is_empty(),
        "the server was never reached directly"
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

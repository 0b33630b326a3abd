//! `--proxy ztunnel` end to end on the kernel: inbound HBONE between two
//! stand-in ztunnels (`shunt_testbed::ztunnel`, given a `Mesh`), in the
//! eBPF mode and in the iptables mode with Istio's rules. The client pod's
//! stand-in accepts the application's connection on its dual-stack
//! `[::]:15001` listener (as ztunnel binds it with IPv6 on), reads the
//! original destination with `getsockopt(SO_ORIGINAL_DST)` and carries it
//! as ztunnel does: TLS 1.3 with SPIFFE certificates both ways and an
//! HTTP/2 CONNECT, `:authority` the original destination, to the server
//! pod's IP:15008 from a socket made in the client pod's netns with mark
//! 0x539. The server pod's stand-in accepts it on its own 15008 listener
//! and delivers it to the application with IP_TRANSPARENT from the
//! client's address.
//!
//! Covered: bytes both ways; `SO_ORIGINAL_DST` at `SOL_IP` on the
//! v4-mapped accepted socket gives the IPv4 destination; the HBONE
//! connection is not redirected (it reaches the 15008 listener as sent,
//! nothing reaches 15006); the authority the server's stand-in received is
//! the original destination, the client's certificate came with it; the
//! application sees the client's address and its replies come back (the
//! reply path of a transparent socket); the same for a v4-mapped IPv6
//! connect, the authority in IPv4 form.
//!
//! The stock ztunnel itself carries traffic behind both captures in
//! `ztunnel_stock_traffic.rs`.

mod ztunnel_harness;

use std::{
    collections::BTreeMap,
    net::{IpAddr, SocketAddr},
};

use shunt::{
    redirect::{
        Redirector,
        iptables::{InpodRules, IptablesOptions, IptablesRedirector},
    },
    state::{PodState, SpiffeId, TrustDomain},
};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::PinDir,
    apps::{EchoServer, TestApp, ok},
    hbone::MeshCa,
    require_root,
};
use ztunnel_harness::{Agent, HboneSetup, TESTAPP, ebpf_redirector, sleep_and_httpbin};

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
    let agent = Agent::start(topo, redirector, sleep_and_httpbin(client, server));
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

        // The client's stand-in: accepted on its dual-stack listener from
        // the application's address, the pod's own v4-mapped (REDIRECT
        // keeps it; the eBPF connect hook binds it), the IPv4 original
        // destination from SO_ORIGINAL_DST at SOL_IP, carried over HBONE
        // (CONNECT answered 200).
        let out = client_proxy.outbound();
        assert_eq!(out.len(), 1, "{out:?}");
        assert!(
            matches!(out[0].peer.ip(), IpAddr::V6(v6) if v6.to_ipv4_mapped() == Some(client.ip())),
            "not accepted on the dual-stack listener from the pod's address: {out:?}"
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

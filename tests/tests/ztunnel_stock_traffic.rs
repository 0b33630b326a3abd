//! Traffic through a stock ztunnel in `--proxy ztunnel` mode: the binary
//! named by `SHUNT_ZTUNNEL_BIN` (built from Istio's source; skipped, with
//! the reason printed, without it) in shared mode, in a pod and a cgroup of
//! its own under the agent's cgroup root, fed workloads, a policy and
//! certificates by an in-test istiod, handed the mesh pods over the
//! agent's ZDS server, with the agent's capture in front of it — eBPF, and
//! iptables with Istio's in-pod rules. What the stand-in ztunnel of
//! `ztunnel.rs` and `ztunnel_hbone.rs` only imitates, ztunnel itself does
//! here:
//!
//! - mesh to mesh: the client's connect reaches ztunnel's 15001 in its pod
//!   from the pod's own address (as behind istio-cni's `REDIRECT`); ztunnel
//!   reads the original destination (shunt's `SO_ORIGINAL_DST`),
//!   opens HBONE (mTLS with the pod's own identity, marked 0x539) to the
//!   server pod's 15008, where ztunnel checks the server's policy against
//!   the client's identity and delivers from the client's address (the
//!   reply path of its transparent socket); both ends log the identities;
//! - a pod outside the mesh to a mesh pod: plaintext to ztunnel's 15006,
//!   allowed on the port the policy opens to anyone, refused by ztunnel
//!   on the port it opens to the client's identity only — so nothing
//!   reaches the application around ztunnel;
//! - kubelet's probe (`--node-netns`): a connect from the node's netns to
//!   that client-only port reaches the application from Istio's probe
//!   source, past ztunnel, whose policy would refuse it;
//! - a mesh pod to a destination outside the mesh: ztunnel's passthrough;
//! - DNS (`--dns-capture`): a mesh pod's query to its nameserver, over UDP
//!   and TCP, is answered by ztunnel's DNS proxy on its 15053 with the VIP
//!   of a ServiceEntry host it learnt from istiod, from the address the pod
//!   asked (as a resolver requires); the nameserver never sees it.

mod ztunnel_harness;

use std::{net::SocketAddr, time::Duration};

use shunt::{
    redirect::{
        Redirector,
        ebpf::{EbpfOptions, EbpfRedirector},
        iptables::{InpodRules, IptablesOptions, IptablesRedirector},
    },
    state::PodState,
};
use shunt_proto::istio::security::{Action, Match};
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::PinDir,
    apps::{EchoServer, TestApp, ok},
    dns::{DnsResponder, Zone},
    poll::until,
    reference::{
        istiod::{Istiod, Snapshot},
        pki::Pki,
        resources::{self, ns_policy, rule, service_account},
        ztunnel_node::ZtunnelNode,
        ztunnel_peer::ztunnel_binary,
    },
    require_root,
};
use ztunnel_harness::{Agent, AgentOptions, TESTAPP, sleep_and_httpbin};

const READY: Duration = Duration::from_secs(30);
const LOGGED: Duration = Duration::from_secs(10);

/// The port the policy opens to anyone, and the one it opens to the
/// client's service account only.
const OPEN: u16 = 8080;
const CLIENT_ONLY: u16 = 9090;

/// A ServiceEntry host istiod sends as a Service (the name ztunnel's DNS
/// proxy answers), and its VIP.
const HOST: &str = "reviews.example.com";
const VIP: [u8; 4] = [198, 19, 60, 1];

const DIG: &str = env!("CARGO_BIN_EXE_shunt-dig");

/// Istio's source for kubelet's probes (`--probe-source`).
const PROBE_SOURCE: &str = "169.254.7.127";

/// What istiod sends: the two mesh pods on the node, and a namespace
/// ALLOW policy (anyone to [`OPEN`]; `default/sleep` to any port).
fn istio_config(node: &str, client: &Pod, server: &Pod) -> Snapshot {
    let policy = ns_policy(
        "allow-open-port-and-sleep",
        Action::Allow,
        vec![
            rule(vec![vec![Match {
                destination_ports: vec![OPEN.into()],
                ..Default::default()
            }]]),
            rule(vec![vec![Match {
                service_accounts: vec![service_account("default", "sleep")],
                ..Default::default()
            }]]),
        ],
    );
    Snapshot {
        addresses: vec![
            resources::workload(resources::pod("client", "sleep", client.ip(), node)),
            resources::workload(resources::pod("server", "httpbin", server.ip(), node)),
            resources::encode(resources::service("reviews", HOST, VIP)),
        ],
        authorizations: vec![resources::policy(policy)],
        ..Default::default()
    }
}

/// Runs `connect <to> --send <bytes>` in `pod`; true when every byte came
/// back and the application's getpeername named `to` (REDIRECT's NAT
/// answers it; in the eBPF mode shunt's getpeername hook does).
fn echoed(app: &TestApp<'_>, pod: &Pod, to: SocketAddr, bytes: usize) -> (bool, String) {
    let report = app.run(
        pod,
        &["connect", &to.to_string(), "--send", &bytes.to_string()],
    );
    let done = ok(&report)
        && report["received"] == bytes
        && report["peer"].as_str() == Some(to.to_string().as_str());
    (done, report.to_string())
}

async fn traffic_through_a_stock_ztunnel(
    topo: &Topology,
    pods: &[Pod],
    redirector: Box<dyn Redirector>,
) {
    let binary = match ztunnel_binary() {
        Ok(binary) => binary,
        Err(reason) => {
            eprintln!("skipping: no stock ztunnel: {reason}");
            return;
        }
    };
    let [zt_pod, client, server, outside] = [&pods[0], &pods[1], &pods[2], &pods[3]];
    let node = zt_pod.node().name().to_string();
    let pki = Pki::new().expect("pki");
    let istiod = Istiod::serve(
        &pki,
        zt_pod
            .listen_tcp("127.0.0.1:0".parse().expect("addr"))
            .expect("istiod listener"),
        istio_config(&node, client, server),
    )
    .expect("in-test istiod");
    let agent = Agent::start_with(
        topo,
        redirector,
        sleep_and_httpbin(client, server),
        AgentOptions {
            dns_capture: Some(true),
            ..AgentOptions::default()
        },
    );
    let zt_cgroup = Cgroup::create(topo, "ztunnel").expect("cgroup");
    let mut ztunnel = tokio::task::block_in_place(|| {
        ZtunnelNode::start_in(
            &binary,
            zt_pod,
            Some(&zt_cgroup),
            &istiod,
            &pki,
            &agent.socket,
        )
        .expect("ztunnel")
    });
    for pod in ["client", "server"] {
        agent.wait_for(pod, PodState::Enrolled).await;
    }
    tokio::task::block_in_place(|| ztunnel.wait_ready(READY).expect("ztunnel ready"));

    let apps = Cgroup::create(topo, "apps").expect("cgroup");
    let app = TestApp::new(TESTAPP, &apps);
    let open = EchoServer::on(server, OPEN).expect("echo server");
    let client_only = EchoServer::on(server, CLIENT_ONLY).expect("echo server");
    let beyond = EchoServer::on(outside, OPEN).expect("echo server");
    let to = |pod: &Pod, port: u16| SocketAddr::new(pod.ip().into(), port);
    let sleep = "src.identity=\"spiffe://cluster.local/ns/default/sa/sleep\"";
    let httpbin = "dst.identity=\"spiffe://cluster.local/ns/default/sa/httpbin\"";

    tokio::task::block_in_place(|| {
        // Mesh to mesh, on the port only the client's identity may use.
        let (done, report) = echoed(&app, client, to(server, CLIENT_ONLY), 100_000);
        assert!(done, "client to server: {report}\n{}", ztunnel.logs());
        let hbone_addr = format!("dst.hbone_addr={}", to(server, CLIENT_ONLY));
        // ztunnel saw the application's connection from the pod's own
        // address, as behind istio-cni's REDIRECT (in the eBPF mode the
        // connect hook binds it), and the HBONE connection came from there.
        let from_client = format!("src.addr={}:", client.ip());
        for direction in ["direction=\"outbound\"", "direction=\"inbound\""] {
            let parts = [
                "connection complete",
                direction,
                &from_client,
                sleep,
                httpbin,
                &hbone_addr,
            ];
            let line = ztunnel
                .wait_log(&parts, LOGGED)
                .expect("ztunnel's access line for the HBONE connection");
            eprintln!("{line}");
        }
        let peers = client_only.peers();
        assert_eq!(peers.len(), 1, "{peers:?}");
        assert_eq!(
            peers[0].ip(),
            client.ip(),
            "delivered from the client's address"
        );

        // From outside the mesh: plaintext through ztunnel's 15006.
        let (done, report) = echoed(&app, outside, to(server, OPEN), 5_000);
        assert!(
            done,
            "outside to the open port: {report}\n{}",
            ztunnel.logs()
        );
        let src = format!("src.addr={}:", outside.ip());
        let dst = format!("dst.addr={}", to(server, OPEN));
        let line = ztunnel
            .wait_log(
                &["connection complete", "direction=\"inbound\"", &src, &dst],
                LOGGED,
            )
            .expect("ztunnel's access line for the plaintext connection");
        eprintln!("{line}");
        assert_eq!(open.peers().len(), 1, "{:?}", open.peers());
        assert_eq!(open.peers()[0].ip(), outside.ip());

        // ... refused by ztunnel's policy on the client-only port: nothing
        // reaches the application around it.
        let (done, report) = echoed(&app, outside, to(server, CLIENT_ONLY), 5_000);
        assert!(!done, "outside to the client-only port: {report}");
        let dst = format!("dst.addr={}", to(server, CLIENT_ONLY));
        let line = ztunnel
            .wait_log(
                &["connection complete", "policy rejection", &src, &dst],
                LOGGED,
            )
            .expect("ztunnel's refusal");
        eprintln!("{line}");
        assert_eq!(client_only.peers().len(), 1, "{:?}", client_only.peers());

        // Kubelet's probe (a connect from the node's netns) to the
        // client-only port: it gets Istio's probe source and goes to the
        // application, not to ztunnel, whose policy would refuse it.
        let kubelet = Cgroup::create(topo, "kubelet").expect("cgroup");
        let probe = format!("exec 3<>/dev/tcp/{}/{CLIENT_ONLY}", server.ip());
        let mut command = server.node().command("bash");
        kubelet.place(&mut command);
        let status = command
            .args(["-c", &probe])
            .status()
            .expect("run the probe");
        assert!(status.success(), "the probe's connect failed");
        let accepted = || (client_only.peers().len() == 2).then_some(());
        until(LOGGED, Duration::from_millis(20), accepted);
        let peers = client_only.peers();
        assert_eq!(peers.len(), 2, "{peers:?}");
        assert_eq!(peers[1].ip().to_string(), PROBE_SOURCE, "{peers:?}");

        // A mesh pod to a destination outside the mesh: passthrough.
        let (done, report) = echoed(&app, client, to(outside, OPEN), 5_000);
        assert!(done, "client to outside: {report}\n{}", ztunnel.logs());
        let dst = format!("dst.addr={}", to(outside, OPEN));
        let line = ztunnel
            .wait_log(
                &[
                    "connection complete",
                    "direction=\"outbound\"",
                    &from_client,
                    &dst,
                ],
                LOGGED,
            )
            .expect("ztunnel's access line for the passthrough");
        eprintln!("{line}");
        assert_eq!(beyond.peers().len(), 1, "{:?}", beyond.peers());
        assert_eq!(beyond.peers()[0].ip(), client.ip());

        // DNS: the pod asks its nameserver (outside the mesh); ztunnel's
        // DNS proxy answers the ServiceEntry host, from the address asked.
        let nameserver = DnsResponder::start(
            outside,
            SocketAddr::new(outside.ip().into(), 53),
            Zone::new(),
            false,
        )
        .expect("nameserver");
        let asked = nameserver.addr().to_string();
        for transport in [&[][..], &["--tcp"][..]] {
            let mut args = vec![asked.as_str(), HOST, "--timeout-ms", "5000"];
            args.extend_from_slice(transport);
            let answer = TestApp::new(DIG, &apps).run(client, &args);
            assert_eq!(answer["ok"], true, "{answer}\n{}", ztunnel.logs());
            assert_eq!(
                answer["answers"],
                serde_json::json!([std::net::Ipv4Addr::from(VIP).to_string()]),
                "ztunnel's answer: {answer}"
            );
            assert_eq!(answer["from"], asked, "from the address asked: {answer}");
        }
        assert!(
            nameserver.seen().is_empty(),
            "the nameserver was asked: {:?}",
            nameserver.seen()
        );
    });
    drop(ztunnel);
    agent.stop().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn ebpf_capture_carries_traffic_through_a_stock_ztunnel() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zt-real-ebpf", &["ztunnel", "client", "server", "outside"])
            .expect("topology");
    let pin = PinDir::new(&topo, "ztreal");
    let mut options = EbpfOptions::new(pin.path());
    options.cgroup_root = Some(topo.cgroup_root().expect("cgroup root"));
    options.node_netns = Some(pods[0].node().netns_path());
    let redirector = EbpfRedirector::load(&options).expect("load eBPF");
    traffic_through_a_stock_ztunnel(&topo, &pods, Box::new(redirector)).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn istio_iptables_capture_carries_traffic_through_a_stock_ztunnel() {
    require_root().expect("kernel tests need root");
    let (topo, pods) =
        Topology::single_node("zt-real-ipt", &["ztunnel", "client", "server", "outside"])
            .expect("topology");
    let mut options = IptablesOptions::new(format!("{}-node-a", topo.prefix()));
    options.rules = InpodRules::Istio;
    options.node_netns = Some(pods[0].node().netns_path());
    let redirector = IptablesRedirector::new(options).expect("iptables redirector");
    traffic_through_a_stock_ztunnel(&topo, &pods, Box::new(redirector)).await;
}

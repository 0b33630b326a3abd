//! HBONE CONNECT to a hostname authority (issue 34, item 10), as
//! waypoints send it: a peer presenting a mesh certificate opens HBONE to
//! the server pod's 15008 and asks for `web.default.svc.cluster.local:80`.
//! As with ztunnel, the hostname names a service and gives only the port:
//! the stream reaches the pod it arrived at, at the service's target port
//! (8080). A hostname no service has, or a port the service lacks, is
//! answered 503; the application sees none of those.
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt-testbed --test hbone_hostname`.

use std::{net::SocketAddr, time::Duration};

use bytes::Bytes;
use shunt::state::{SpiffeId, TrustDomain};
use shunt_testbed::{
    Topology,
    agent::{Agent, ServiceSpec, WorkloadSpec, mesh_pods_enrolled, services_yaml, workloads_yaml},
    apps::EchoServer,
    hbone::{MeshCa, connect_to},
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(30);
const WEB: &str = "web.default.svc.cluster.local";

/// (`:authority`, expected: `Ok(())` a 200 that echoes, `Err(status)`).
const ROWS: &[(&str, Result<(), u16>)] = &[
    ("web.default.svc.cluster.local:80", Ok(())),
    ("web.default.svc.cluster.local:81", Err(503)),
    ("db.default.svc.cluster.local:80", Err(503)),
];

async fn hostname_authority_reaches_the_arrival_pod(mode: &str) {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(&format!("hbhost-{mode}")).expect("topology");
    topo.add_node("node-a").expect("node");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let mut yaml = workloads_yaml(&[WorkloadSpec::for_pod(&server, true)]);
    yaml.push_str(&services_yaml(&[ServiceSpec {
        name: "web".into(),
        namespace: "default".into(),
        vip: "198.19.100.2".parse().expect("VIP"),
        port: 80,
        target_port: 8080,
        endpoints: vec!["server".into()],
    }]));
    let mut agent = tokio::task::block_in_place(|| {
        let mut agent = Agent::start(&topo, &node, &yaml, &["--redirect", mode])?;
        agent.wait_for("the server enrolled", TIMEOUT, mesh_pods_enrolled)?;
        Ok::<_, shunt_testbed::TestbedError>(agent)
    })
    .expect("agent");
    let echo = EchoServer::on(&server, 8080).expect("echo");
    let ca = MeshCa::from_dir(agent.ca_dir()).expect("the agent's CA");
    let waypoint = ca
        .credentials(&SpiffeId::for_service_account(
            &TrustDomain::default(),
            "default",
            "waypoint",
        ))
        .expect("waypoint certificate");
    let server_id = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sa-server");
    let hbone = SocketAddr::from((server.ip(), 15008));

    for (authority, expected) in ROWS {
        let tcp = node.connect_tcp(hbone, TIMEOUT).expect("TCP to 15008");
        tcp.set_nonblocking(true).expect("non-blocking");
        let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio stream");
        let answer = connect_to(
            tcp,
            &waypoint.cert,
            &waypoint.roots,
            &server_id,
            authority,
            &[],
        )
        .await;
        match (expected, answer) {
            (Ok(()), Ok((mut send, mut recv))) => {
                send.send_data(Bytes::from_static(b"ping"), false)
                    .expect("send");
                let echoed = tokio::time::timeout(TIMEOUT, recv.data())
                    .await
                    .expect("echo in time")
                    .expect("a chunk")
                    .expect("data");
                assert_eq!(&echoed[..], b"ping", "{authority}");
            }
            (Err(status), Err(e)) => assert_eq!(
                e,
                format!(
                    "upstream answered {}",
                    http::StatusCode::from_u16(*status).expect("status")
                ),
                "{authority}\n{}",
                agent.logs()
            ),
            (expected, got) => panic!(
                "{authority}: expected {expected:?}, got {:?}\n{}",
                got.map(|_| "200"),
                agent.logs()
            ),
        }
    }
    let accepted = echo.accepted();
    assert_eq!(
        accepted.len(),
        1,
        "only the {WEB}:80 stream reached the application: {accepted:?}"
    );

    let exit = tokio::task::block_in_place(|| agent.stop()).expect("stop");
    assert!(exit.success(), "{}", agent.logs());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostname_connect_reaches_the_arrival_pod_in_ebpf_mode() {
    hostname_authority_reaches_the_arrival_pod("ebpf").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hostname_connect_reaches_the_arrival_pod_in_iptables_mode() {
    hostname_authority_reaches_the_arrival_pod("iptables").await;
}

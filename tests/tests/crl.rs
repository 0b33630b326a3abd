//! Certificate revocation lists (`--crl-path`, ztunnel's `CRL_PATH`): the
//! real agent starts with an empty list file; two peers holding mesh
//! certificates both reach the server pod over HBONE. A CRL of the mesh
//! CA revoking one of them is written to the file; once the agent says it
//! reloaded, that peer's handshake fails and the other's still passes.
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt-testbed --test crl`.

use std::{net::SocketAddr, time::Duration};

use bytes::Bytes;
use rcgen::{
    CertificateRevocationListParams, Issuer, KeyIdMethod, KeyPair, RevokedCertParams, SerialNumber,
    date_time_ymd,
};
use shunt::state::{SpiffeId, TrustDomain};
use shunt_testbed::{
    Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::EchoServer,
    hbone::{Credentials, MeshCa, connect_to},
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(30);

/// One HBONE stream from `peer` to the server's echo port: `Ok` when it
/// echoes, else why not.
async fn reach(
    node: &shunt_testbed::Node,
    hbone: SocketAddr,
    peer: &Credentials,
    server_id: &SpiffeId,
    echo_at: SocketAddr,
) -> Result<(), String> {
    let tcp = node
        .connect_tcp(hbone, TIMEOUT)
        .map_err(|e| e.to_string())?;
    tcp.set_nonblocking(true).map_err(|e| e.to_string())?;
    let tcp = tokio::net::TcpStream::from_std(tcp).map_err(|e| e.to_string())?;
    let authority = echo_at.to_string();
    let (mut send, mut recv) =
        connect_to(tcp, &peer.cert, &peer.roots, server_id, &authority, &[]).await?;
    send.send_data(Bytes::from_static(b"ping"), false)
        .map_err(|e| e.to_string())?;
    let echoed = tokio::time::timeout(TIMEOUT, recv.data())
        .await
        .map_err(|_| "no echo in time".to_string())?
        .ok_or("stream ended")?
        .map_err(|e| e.to_string())?;
    (&echoed[..] == b"ping")
        .then_some(())
        .ok_or_else(|| format!("echoed {echoed:?}"))
}

/// A CRL of the agent's CA (its `--ca-dir` files) revoking `serial`, PEM.
fn crl_revoking(ca_dir: &std::path::Path, serial: SerialNumber) -> String {
    let read = |name: &str| std::fs::read_to_string(ca_dir.join(name)).expect("CA file");
    let key = KeyPair::from_pem(&read(shunt::identity::ca::CA_KEY_FILE)).expect("CA key");
    let issuer =
        Issuer::from_ca_cert_pem(&read(shunt::identity::ca::CA_CERT_FILE), key).expect("issuer");
    CertificateRevocationListParams {
        this_update: date_time_ymd(2020, 1, 1),
        next_update: date_time_ymd(2100, 1, 1),
        crl_number: SerialNumber::from(1u64),
        issuing_distribution_point: None,
        revoked_certs: vec![RevokedCertParams {
            serial_number: serial,
            revocation_time: date_time_ymd(2021, 1, 1),
            reason_code: None,
            invalidity_date: None,
        }],
        key_identifier_method: KeyIdMethod::Sha256,
    }
    .signed_by(&issuer)
    .expect("CRL")
    .pem()
    .expect("PEM")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_revoked_peer_is_refused_once_the_list_names_it() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("crl").expect("topology");
    topo.add_node("node-a").expect("node");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let lists = tempfile::tempdir().expect("dir");
    let crl_file = lists.path().join("ca-crl.pem");
    std::fs::write(&crl_file, "").expect("empty list file");
    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(&server, true)]);
    let crl_arg = crl_file.display().to_string();
    let mut agent = tokio::task::block_in_place(|| {
        let mut agent = Agent::start(
            &topo,
            &node,
            &yaml,
            &["--redirect", "ebpf", "--crl-path", &crl_arg],
        )?;
        agent.wait_for("the server enrolled", TIMEOUT, mesh_pods_enrolled)?;
        Ok::<_, shunt_testbed::TestbedError>(agent)
    })
    .expect("agent");
    let _echo = EchoServer::on(&server, 8080).expect("echo");
    let ca = MeshCa::from_dir(agent.ca_dir()).expect("the agent's CA");
    let peer = |sa: &str| {
        ca.credentials(&SpiffeId::for_service_account(
            &TrustDomain::default(),
            "default",
            sa,
        ))
        .expect("certificate")
    };
    let (revoked, kept) = (peer("revoked"), peer("kept"));
    let server_id = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sa-server");
    let hbone = SocketAddr::from((server.ip(), 15008));
    let echo_at = SocketAddr::from((server.ip(), 8080));
    for (name, who) in [("revoked", &revoked), ("kept", &kept)] {
        reach(&node, hbone, who, &server_id, echo_at)
            .await
            .unwrap_or_else(|e| panic!("{name} before the list: {e}\n{}", agent.logs()));
    }

    let (_, parsed) = x509_parser::parse_x509_certificate(&revoked.cert.chain()[0])
        .expect("the peer's certificate parses");
    let serial = SerialNumber::from(parsed.tbs_certificate.raw_serial().to_vec());
    std::fs::write(&crl_file, crl_revoking(agent.ca_dir(), serial)).expect("write the list");
    tokio::task::block_in_place(|| {
        agent.wait_for_log("the list reloaded", TIMEOUT, |logs| {
            logs.contains("certificate revocation lists reloaded")
        })
    })
    .expect("reload");

    let refused = reach(&node, hbone, &revoked, &server_id, echo_at).await;
    let why = refused.expect_err("the revoked peer got through");
    // The agent's alert: the handshake ends on the revocation.
    assert!(why.contains("CertificateRevoked"), "{why}");
    // Counted as a refused TLS handshake, as any other.
    let tls_refusals = |agent: &Agent| -> Option<u64> {
        let (_, metrics) = agent.metrics().ok()?;
        metrics
            .lines()
            .find_map(|l| l.strip_prefix("shunt_proxy_refusals_total{reason=\"tls\"} "))
            .and_then(|v| v.trim().parse().ok())
    };
    assert_eq!(
        tokio::task::block_in_place(|| tls_refusals(&agent)),
        Some(1),
        "{}",
        agent.logs()
    );
    reach(&node, hbone, &kept, &server_id, echo_at)
        .await
        .unwrap_or_else(|e| panic!("kept after the list: {e}\n{}", agent.logs()));
}

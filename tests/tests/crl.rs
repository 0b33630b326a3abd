//! Certificate revocation lists (`--crl-path`, ztunnel's `CRL_PATH`) on
//! the real agent:
//!
//! - started with a file that does not parse, the agent names it and
//!   serves; two peers holding mesh certificates both reach the server pod
//!   over HBONE; a CRL of the mesh CA revoking one of them is written to
//!   the file; once the agent says it reloaded, that peer's handshake fails
//!   and the other's still passes;
//! - inbound (an empty file at start): both peers hold a stream open; the
//!   list revokes one, and its connection is closed while the other's
//!   keeps echoing (`istio_crl_policy_rejections_total{reporter=
//!   "destination"}`);
//! - outbound: a pod's pooled HBONE connection to a server on another node
//!   (a stand-in HBONE server, no agent there) carries an open connection
//!   of the pod; the list revokes the server's certificate, and the pooled
//!   connection is closed, the pod's connection with it, and the next one
//!   is refused at the handshake (`reporter="source"`).
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt-testbed --test crl`.

use std::{net::SocketAddr, time::Duration};

use bytes::Bytes;
use h2::{RecvStream, SendStream};
use rcgen::{
    CertificateRevocationListParams, Issuer, KeyIdMethod, KeyPair, RevokedCertParams, SerialNumber,
    date_time_ymd,
};
use rustls_pki_types::CertificateDer;
use shunt::state::{SpiffeId, TrustDomain};
use shunt_testbed::{
    Cgroup, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp, ok},
    hbone::{Credentials, MeshCa, connect_to, ping_through},
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(30);

/// A PEM block that is no CRL (a ConfigMap written wrong).
const NOT_A_LIST: &str = "-----BEGIN X509 CRL-----\nbm90IGEgY3Js\n-----END X509 CRL-----\n";

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
    let mut bed = server_bed("crl", NOT_A_LIST);
    let (node, server) = (bed.node.clone(), bed.server.clone());
    let (revoked, kept, server_id) = (bed.revoked.clone(), bed.kept.clone(), bed.server_id.clone());
    let agent = &mut bed.agent;
    // A list that does not parse at start is named, and revokes nothing:
    // the agent serves (stopping would stop the node's mesh traffic).
    assert!(
        agent
            .logs()
            .contains("certificate revocation lists unusable"),
        "{}",
        agent.logs()
    );
    let hbone = SocketAddr::from((server.ip(), 15008));
    let echo_at = SocketAddr::from((server.ip(), 8080));
    for (name, who) in [("revoked", &revoked), ("kept", &kept)] {
        ping_through(&node, hbone, who, &server_id, echo_at)
            .await
            .unwrap_or_else(|e| panic!("{name} before the list: {e}\n{}", agent.logs()));
    }

    revoke(agent, &bed.crl_file, &revoked.cert.chain()[0]);

    let refused = ping_through(&node, hbone, &revoked, &server_id, echo_at).await;
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
        tokio::task::block_in_place(|| tls_refusals(agent)),
        Some(1),
        "{}",
        agent.logs()
    );
    // And as ztunnel counts a revocation.
    assert_eq!(
        crl_rejections(agent, "destination"),
        Some(1),
        "{}",
        agent.logs()
    );
    ping_through(&node, hbone, &kept, &server_id, echo_at)
        .await
        .unwrap_or_else(|e| panic!("kept after the list: {e}\n{}", agent.logs()));
}

/// One node whose agent (`--crl-path`, an empty list now) serves a
/// server pod with an echo on 8080, and two mesh peers of the agent's CA
/// that reach it from the node.
struct ServerBed {
    // Dropped in this order: the agent first, the topology last.
    agent: Agent,
    _echo: EchoServer,
    node: shunt_testbed::Node,
    server: shunt_testbed::Pod,
    crl_file: std::path::PathBuf,
    revoked: Credentials,
    kept: Credentials,
    server_id: SpiffeId,
    _lists: tempfile::TempDir,
    _topo: Topology,
}

fn server_bed(name: &str, initial_list: &str) -> ServerBed {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new(name).expect("topology");
    topo.add_node("node-a").expect("node");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let lists = tempfile::tempdir().expect("dir");
    let crl_file = lists.path().join("ca-crl.pem");
    let agent = start_agent(
        &topo,
        &node,
        &[WorkloadSpec::for_pod(&server, true)],
        &crl_file,
        initial_list,
    );
    let echo = EchoServer::on(&server, 8080).expect("echo");
    let ca = MeshCa::from_dir(agent.ca_dir()).expect("the agent's CA");
    ServerBed {
        revoked: mesh_peer(&ca, "revoked"),
        kept: mesh_peer(&ca, "kept"),
        server_id: SpiffeId::for_service_account(&TrustDomain::default(), "default", "sa-server"),
        agent,
        _echo: echo,
        node,
        server,
        crl_file,
        _lists: lists,
        _topo: topo,
    }
}

/// Credentials of service account `sa` in `default`, from `ca`.
fn mesh_peer(ca: &MeshCa, sa: &str) -> Credentials {
    ca.credentials(&SpiffeId::for_service_account(
        &TrustDomain::default(),
        "default",
        sa,
    ))
    .expect("certificate")
}

/// An agent on `node` serving `workloads`, reading `crl_file`, which
/// holds `initial` now.
fn start_agent(
    topo: &Topology,
    node: &shunt_testbed::Node,
    workloads: &[WorkloadSpec],
    crl_file: &std::path::Path,
    initial: &str,
) -> Agent {
    std::fs::write(crl_file, initial).expect("list file");
    let yaml = workloads_yaml(workloads);
    let crl_arg = crl_file.display().to_string();
    tokio::task::block_in_place(|| {
        let mut agent = Agent::start(
            topo,
            node,
            &yaml,
            &["--redirect", "ebpf", "--crl-path", &crl_arg],
        )?;
        agent.wait_for("the mesh pods enrolled", TIMEOUT, mesh_pods_enrolled)?;
        Ok::<_, shunt_testbed::TestbedError>(agent)
    })
    .expect("agent")
}

/// Writes a list revoking `cert` and waits for the agent to say it
/// reloaded it.
fn revoke(agent: &mut Agent, crl_file: &std::path::Path, cert: &CertificateDer<'_>) {
    let (_, parsed) = x509_parser::parse_x509_certificate(cert).expect("the certificate parses");
    let serial = SerialNumber::from(parsed.tbs_certificate.raw_serial().to_vec());
    std::fs::write(crl_file, crl_revoking(agent.ca_dir(), serial)).expect("write the list");
    tokio::task::block_in_place(|| {
        agent.wait_for_log("the list reloaded", TIMEOUT, |logs| {
            logs.contains("certificate revocation lists reloaded")
        })
    })
    .expect("reload");
}

/// `istio_crl_policy_rejections_total{reporter=…}` on the agent's
/// `/metrics`; `None` while the series is absent.
fn crl_rejections(agent: &Agent, reporter: &str) -> Option<u64> {
    let (_, metrics) = tokio::task::block_in_place(|| agent.metrics()).ok()?;
    let series = format!("istio_crl_policy_rejections_total{{reporter=\"{reporter}\"}} ");
    metrics
        .lines()
        .find_map(|l| l.strip_prefix(series.as_str()))
        .and_then(|v| v.trim().parse().ok())
}

/// `istio_tcp_connections_closed_total` of `reporter` with
/// `response_flags="CERT_REVOKED"` (ztunnel's flag for a stream cut on a
/// revoked certificate), summed; `None` while there is no such series.
fn cut_on_revocation(agent: &Agent, reporter: &str) -> Option<u64> {
    let (_, metrics) = tokio::task::block_in_place(|| agent.metrics()).ok()?;
    let reporter = format!("reporter=\"{reporter}\"");
    let counts: Vec<u64> = metrics
        .lines()
        .filter(|l| l.starts_with("istio_tcp_connections_closed_total{"))
        .filter(|l| l.contains(&reporter) && l.contains("response_flags=\"CERT_REVOKED\""))
        .filter_map(|l| l.rsplit(' ').next()?.parse().ok())
        .collect();
    (!counts.is_empty()).then(|| counts.iter().sum())
}

/// Sends `ping` and waits for it back: `Ok` when echoed, else how the
/// stream ended.
async fn ping(send: &mut SendStream<Bytes>, recv: &mut RecvStream) -> Result<(), String> {
    send.send_data(Bytes::from_static(b"ping"), false)
        .map_err(|e| format!("send: {e}"))?;
    match tokio::time::timeout(TIMEOUT, recv.data()).await {
        Err(_) => Err("no answer in time".into()),
        Ok(None) => Err("stream ended".into()),
        Ok(Some(Err(e))) => Err(format!("stream failed: {e}")),
        Ok(Some(Ok(echoed))) => {
            let _ = recv.flow_control().release_capacity(echoed.len());
            (&echoed[..] == b"ping")
                .then_some(())
                .ok_or_else(|| format!("echoed {echoed:?}"))
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_open_connection_from_a_revoked_peer_is_closed_on_reload() {
    let mut bed = server_bed("crl-open", "");
    let (node, server) = (bed.node.clone(), bed.server.clone());
    let (revoked, kept, server_id) = (bed.revoked.clone(), bed.kept.clone(), bed.server_id.clone());
    let agent = &mut bed.agent;
    let hbone = SocketAddr::from((server.ip(), 15008));
    let echo_at = SocketAddr::from((server.ip(), 8080)).to_string();
    let mut open = Vec::new();
    for who in [&revoked, &kept] {
        let tcp = node.connect_tcp(hbone, TIMEOUT).expect("connect");
        tcp.set_nonblocking(true).expect("nonblocking");
        let tcp = tokio::net::TcpStream::from_std(tcp).expect("tokio");
        let (mut send, mut recv) =
            connect_to(tcp, &who.cert, &who.roots, &server_id, &echo_at, &[])
                .await
                .unwrap_or_else(|e| panic!("CONNECT: {e}\n{}", agent.logs()));
        ping(&mut send, &mut recv).await.expect("echo before");
        open.push((send, recv));
    }
    let (mut kept_send, mut kept_recv) = open.pop().expect("kept");
    let (mut revoked_send, mut revoked_recv) = open.pop().expect("revoked");
    assert_eq!(crl_rejections(agent, "destination"), None);

    revoke(agent, &bed.crl_file, &revoked.cert.chain()[0]);
    // The event: the revoked peer's stream ends without an answer.
    let ended = ping(&mut revoked_send, &mut revoked_recv).await;
    let why = ended.expect_err("the revoked peer's open stream still echoes");
    assert!(!why.contains("in time"), "{why}\n{}", agent.logs());
    ping(&mut kept_send, &mut kept_recv)
        .await
        .unwrap_or_else(|e| panic!("the kept peer's stream: {e}\n{}", agent.logs()));
    assert_eq!(
        crl_rejections(agent, "destination"),
        Some(1),
        "{}",
        agent.logs()
    );
    assert!(
        agent
            .logs()
            .contains("a reloaded revocation list revokes the peer's certificate"),
        "{}",
        agent.logs()
    );
    // The stream's own record says why it ended, as ztunnel's does.
    assert_eq!(
        cut_on_revocation(agent, "destination"),
        Some(1),
        "{}",
        agent.logs()
    );
    assert!(
        agent.logs().contains("result=\"revoked\""),
        "{}",
        agent.logs()
    );
}

/// The stand-in server's side of one HBONE connection: each CONNECT is
/// answered 200 and echoed; `events` is told `"data"` when bytes arrive
/// and `"closed"` when the connection ends.
async fn serve_hbone(
    tcp: tokio::net::TcpStream,
    me: Credentials,
    events: tokio::sync::mpsc::UnboundedSender<&'static str>,
) {
    let Ok((mut conn, _)) = shunt_testbed::hbone::accept(tcp, &me.cert, &me.roots).await else {
        return;
    };
    while let Some(Ok((request, mut respond))) = conn.accept().await {
        let events = events.clone();
        tokio::spawn(async move {
            let Ok(mut send) = respond.send_response(http::Response::new(()), false) else {
                return;
            };
            let mut recv = request.into_body();
            while let Some(Ok(data)) = recv.data().await {
                let _ = events.send("data");
                let _ = recv.flow_control().release_capacity(data.len());
                if send.send_data(data, false).is_err() {
                    break;
                }
            }
        });
    }
    let _ = events.send("closed");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_pooled_connection_to_a_revoked_server_is_closed_on_reload() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("crl-pool").expect("topology");
    topo.add_node("node-a").expect("node");
    topo.add_node("node-b").expect("node");
    let client = topo.add_pod("node-a", "client").expect("pod");
    let server = topo.add_pod("node-b", "server").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let cgroup = Cgroup::create(&topo, "apps").expect("cgroup");
    let apps = TestApp::new(env!("CARGO_BIN_EXE_shunt-testapp"), &cgroup);
    let lists = tempfile::tempdir().expect("dir");
    let crl_file = lists.path().join("ca-crl.pem");
    // node-b runs no agent: its pod's 15008 is the stand-in below.
    let mut agent = start_agent(
        &topo,
        &node,
        &[
            WorkloadSpec::for_pod(&client, true),
            WorkloadSpec::for_pod(&server, true),
        ],
        &crl_file,
        "",
    );
    let ca = MeshCa::from_dir(agent.ca_dir()).expect("the agent's CA");
    let server_creds = mesh_peer(&ca, "sa-server");
    let listener = server
        .listen_tcp(SocketAddr::from((server.ip(), 15008)))
        .expect("listen");
    listener.set_nonblocking(true).expect("nonblocking");
    let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
    let (events_tx, mut events) = tokio::sync::mpsc::unbounded_channel();
    let me = server_creds.clone();
    let _server = AbortOnDrop(tokio::spawn(async move {
        while let Ok((tcp, _)) = listener.accept().await {
            tokio::spawn(serve_hbone(tcp, me.clone(), events_tx.clone()));
        }
    }));

    // The client's application holds a connection to the server open
    // through the agent's pooled HBONE connection (an echo every 50 ms).
    let to = SocketAddr::from((server.ip(), 8080)).to_string();
    let hold = apps
        .command(&client, &["hold", &to, "--seconds", "60"])
        .stdout(std::process::Stdio::piped())
        .spawn()
        .expect("testapp");
    let hold = KillOnDrop(Some(hold));
    assert_eq!(
        next_event(&mut events).await,
        Some("data"),
        "the held connection reached the stand-in\n{}",
        agent.logs()
    );
    assert_eq!(crl_rejections(&agent, "source"), None);

    revoke(&mut agent, &crl_file, &server_creds.cert.chain()[0]);
    // The events: the stand-in sees its connection closed, and the held
    // application connection over it fails.
    let mut closed = false;
    while let Some(event) = next_event(&mut events).await {
        if event == "closed" {
            closed = true;
            break;
        }
    }
    assert!(
        closed,
        "the pooled connection stayed open\n{}",
        agent.logs()
    );
    let report = hold.finish(TIMEOUT).await;
    assert!(
        report.contains("\"ok\":false"),
        "the held connection survived its HBONE connection: {report}"
    );
    assert_eq!(
        crl_rejections(&agent, "source"),
        Some(1),
        "{}",
        agent.logs()
    );
    assert_eq!(
        cut_on_revocation(&agent, "source"),
        Some(1),
        "{}",
        agent.logs()
    );
    // A new connection: the agent refuses the server at the handshake.
    let report =
        tokio::task::block_in_place(|| apps.run(&client, &["connect", &to, "--send", "64"]));
    assert!(
        !ok(&report),
        "the revoked server was reached again: {report}"
    );
    assert_eq!(
        crl_rejections(&agent, "source"),
        Some(2),
        "{}",
        agent.logs()
    );
}

/// The stand-in's next event, or `None` after [`TIMEOUT`].
async fn next_event(
    events: &mut tokio::sync::mpsc::UnboundedReceiver<&'static str>,
) -> Option<&'static str> {
    tokio::time::timeout(TIMEOUT, events.recv())
        .await
        .ok()
        .flatten()
}

/// A child process the test started, killed (by its PID) if the test
/// ends before it does.
struct KillOnDrop(Option<std::process::Child>);

impl KillOnDrop {
    /// Its output once it exits, within `timeout` (killed after that).
    async fn finish(mut self, timeout: Duration) -> String {
        let Some(child) = self.0.take() else {
            return String::new();
        };
        let pid = child.id();
        let waited = tokio::task::spawn_blocking(move || child.wait_with_output());
        match tokio::time::timeout(timeout, waited).await {
            Ok(Ok(Ok(out))) => String::from_utf8_lossy(&out.stdout).into_owned(),
            Ok(other) => format!("not waited for: {other:?}"),
            Err(_) => {
                // Still running: end it (ours, by PID).
                let _ = nix::sys::signal::kill(
                    nix::unistd::Pid::from_raw(pid as i32),
                    nix::sys::signal::Signal::SIGKILL,
                );
                "still running after the timeout".into()
            }
        }
    }
}

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        if let Some(child) = &mut self.0 {
            let _ = child.kill();
            let _ = child.wait();
        }
    }
}

/// Aborts the task when dropped (the stand-in stops with the test).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

//! A mesh root rotation without a restart (`--ca istio`; as ztunnel's root
//! reload): the real agent gets its pods' certificates from an in-test
//! istiod (Istio's CA service over TLS) and trusts the root file it was
//! started with. A peer whose certificate is of a new root is refused at
//! the server pod's HBONE port. The root file then gains the new root
//! beside the old one (how istiod's `istio-ca-root-cert` carries a
//! rotation); once the agent says it reloaded the roots, that peer is
//! served, and a peer of the old root still is.
//!
//! Run as root: `cargo build -p shunt --bins --features test-seams &&
//! SHUNT_BIN=… cargo test -p shunt-testbed --test root_rotation`.

use std::{net::SocketAddr, time::Duration};

use shunt::state::{SpiffeId, TrustDomain};
use shunt_testbed::{
    Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::EchoServer,
    hbone::{Credentials, ping_through},
    reference::{
        istiod::{Istiod, Snapshot},
        pki::Pki,
    },
    require_root,
};

const TIMEOUT: Duration = Duration::from_secs(30);

/// One HBONE stream from `peer` to the server's echo port: `Ok` when it
/// echoes, else why not.
async fn reach(
    node: &shunt_testbed::Node,
    server: &shunt_testbed::Pod,
    peer: &Credentials,
) -> Result<(), String> {
    let server_id = SpiffeId::for_service_account(&TrustDomain::default(), "default", "sa-server");
    ping_through(
        node,
        SocketAddr::from((server.ip(), 15008)),
        peer,
        &server_id,
        SocketAddr::from((server.ip(), 8080)),
    )
    .await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_root_in_the_root_file_is_trusted_without_a_restart() {
    require_root().expect("kernel tests need root");
    let mut topo = Topology::new("roots").expect("topology");
    topo.add_node("node-a").expect("node");
    let server = topo.add_pod("node-a", "server").expect("pod");
    let node = topo.node("node-a").expect("node").clone();
    let (old, new) = (Pki::new().expect("old root"), Pki::new().expect("new root"));
    // istiod signs with the old root, on loopback of the agent's netns.
    let listener = node
        .listen_tcp(([127, 0, 0, 1], 0).into())
        .expect("istiod's port");
    let istiod = Istiod::serve(&old, listener, Snapshot::default()).expect("in-test istiod");
    let roots = tempfile::tempdir().expect("dir");
    let root_file = roots.path().join("root-cert.pem");
    std::fs::copy(old.root_file(), &root_file).expect("the old root");
    let old_root = std::fs::read_to_string(old.root_file()).expect("old root");
    let new_root = std::fs::read_to_string(new.root_file()).expect("new root");

    let yaml = workloads_yaml(&[WorkloadSpec::for_pod(&server, true)]);
    let (address, root_arg, token) = (
        istiod.addr.to_string(),
        root_file.display().to_string(),
        old.token_file().display().to_string(),
    );
    let mut agent = tokio::task::block_in_place(|| {
        let mut agent = Agent::start(
            &topo,
            &node,
            &yaml,
            &[
                "--redirect",
                "ebpf",
                "--ca",
                "istio",
                "--ca-address",
                &address,
                "--ca-root-cert",
                &root_arg,
                "--ca-token-file",
                &token,
            ],
        )?;
        agent.wait_for("the server enrolled", TIMEOUT, mesh_pods_enrolled)?;
        Ok::<_, shunt_testbed::TestbedError>(agent)
    })
    .expect("agent");
    let _echo = EchoServer::on(&server, 8080).expect("echo");
    let known = old.credentials("default", "known").expect("certificate");
    // Of the new root, and trusting the server's (old) one.
    let stranger = Credentials {
        cert: new
            .credentials("default", "stranger")
            .expect("certificate")
            .cert,
        roots: known.roots.clone(),
    };
    reach(&node, &server, &known)
        .await
        .unwrap_or_else(|e| panic!("a peer of the old root: {e}\n{}", agent.logs()));
    let refused = reach(&node, &server, &stranger).await;
    let why = refused.expect_err("a peer of a root not in the file was served");
    // Refused by the agent's chain check (both test roots share a subject
    // name, so the signature check is what fails: alert decrypt_error).
    assert!(why.contains("fatal alert"), "{why}");

    std::fs::write(&root_file, format!("{old_root}{new_root}")).expect("rotate");
    tokio::task::block_in_place(|| {
        agent.wait_for_log("the roots reloaded", TIMEOUT, |logs| {
            logs.contains("mesh root certificates reloaded")
        })
    })
    .expect("reload");
    reach(&node, &server, &stranger)
        .await
        .unwrap_or_else(|e| panic!("a peer of the new root: {e}\n{}", agent.logs()));
    reach(&node, &server, &known)
        .await
        .unwrap_or_else(|e| panic!("a peer of the old root after: {e}\n{}", agent.logs()));
}

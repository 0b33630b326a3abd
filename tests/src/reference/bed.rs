//! The comparison bed: two nodes, a client pod on node-a (not in the mesh:
//! the probes speak HBONE themselves) and the server workload
//! `default/server` (service account `sa-server`) on node-b with echo
//! servers on 8080 and 9090. A case runs against a fresh peer serving the
//! server: the real ztunnel in the server's pod netns, or the shunt agent
//! of node-b; both are fed by an [`Istiod`] serving the same [`Snapshot`].

use std::{path::Path, time::Duration};

use shunt_proto::envoy::service::discovery::v3::Resource;

use super::{
    cases::{Case, Row},
    istiod::{Answer, Istiod, Snapshot},
    pki::Pki,
    probe::{Observed, probe},
    resources::{pod, policy, workload},
    ztunnel_peer::Ztunnel,
};
use crate::{
    Pod, Result, TestbedError, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::EchoServer,
};

pub const SERVER_SA: &str = "sa-server";
/// node-b's address on the fabric: the IP istiod gives its hostNetwork
/// pods (the topology's addressing is fixed: see lib.rs).
pub const NODE_B_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 19, 0, 2);
const WAIT: Duration = Duration::from_secs(30);

/// Which implementation serves the server workload.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Peer {
    Shunt,
    Ztunnel,
}

/// What one case gave on one peer.
#[derive(Debug)]
pub struct Run {
    pub addresses: Answer,
    pub authorizations: Answer,
    /// The answer to the second address response, if one was sent.
    pub then_addresses: Option<Answer>,
    pub observed: Vec<(Row, Observed)>,
    /// Whether the peer said ready before the probes: waited for (bounded)
    /// when it ACKed both types, one look otherwise.
    pub ready: bool,
    /// The peer's log, for failure messages.
    pub logs: String,
}

pub struct Bed {
    pki: Pki,
    client: Pod,
    server: Pod,
    _echo: [EchoServer; 2],
    topology: Topology,
}

impl Bed {
    pub fn new(test_name: &str) -> Result<Bed> {
        let mut topology = Topology::new(test_name)?;
        topology.add_node("node-a")?;
        topology.add_node("node-b")?;
        let client = topology.add_pod("node-a", "client")?;
        let server = topology.add_pod("node-b", "server")?;
        let echo = [
            EchoServer::on(&server, 8080)?,
            EchoServer::on(&server, 9090)?,
        ];
        Ok(Bed {
            pki: Pki::new()?,
            client,
            server,
            _echo: echo,
            topology,
        })
    }

    /// The workloads istiod sends besides a case's own: the server
    /// (naming `server_policies`) and the client.
    pub fn base_addresses(&self, server_policies: &[&str]) -> Vec<Resource> {
        let mut server = pod(
            self.server.name(),
            SERVER_SA,
            self.server.ip(),
            self.server.node().name(),
        );
        server.authorization_policies = server_policies.iter().map(|p| p.to_string()).collect();
        vec![
            workload(server),
            workload(pod(
                self.client.name(),
                "sleep",
                self.client.ip(),
                self.client.node().name(),
            )),
        ]
    }

    fn snapshot(&self, case: &Case) -> Snapshot {
        Snapshot {
            addresses: self
                .base_addresses(&case.server_policies)
                .into_iter()
                .chain(case.addresses.iter().cloned())
                .collect(),
            then_addresses: case.then_addresses.clone(),
            authorizations: case.authorizations.iter().cloned().map(policy).collect(),
        }
    }

    /// Runs `case` on a fresh `peer` (`ztunnel` is the binary, for
    /// [`Peer::Ztunnel`]).
    pub async fn run(&self, peer: Peer, ztunnel: Option<&Path>, case: &Case) -> Result<Run> {
        let snapshot = self.snapshot(case);
        match peer {
            Peer::Ztunnel => {
                let binary = ztunnel.ok_or_else(|| {
                    TestbedError::Invalid("no ztunnel binary for a ztunnel run".into())
                })?;
                let listener = self.server.listen_tcp(([127, 0, 0, 1], 0).into())?;
                let istiod = Istiod::serve(&self.pki, listener, snapshot)?;
                let workload = ("default", self.server.name(), SERVER_SA);
                let (pki, server) = (self.pki.clone(), self.server.clone());
                let binary = binary.to_path_buf();
                let mut zt = tokio::task::block_in_place(|| {
                    Ztunnel::start(&binary, &server, workload, &istiod, &pki)
                })?;
                let (addresses, authorizations, then_addresses) =
                    istiod.wait_for_answers(WAIT).await?;
                let ready = if settled(&addresses, &authorizations, then_addresses.as_ref()) {
                    tokio::task::block_in_place(|| zt.wait_ready(WAIT))
                } else {
                    zt.readiness() == Some(200)
                };
                let observed = self.probe_all(case).await;
                Ok(Run {
                    addresses,
                    authorizations,
                    then_addresses,
                    observed,
                    ready,
                    logs: zt.logs(),
                })
            }
            Peer::Shunt => {
                let node = self.server.node().clone();
                let listener = node.listen_tcp(([127, 0, 0, 1], 0).into())?;
                let istiod = Istiod::serve(&self.pki, listener, snapshot)?;
                let agent = tokio::task::block_in_place(|| self.start_agent(&istiod))?;
                let (addresses, authorizations, then_addresses) =
                    istiod.wait_for_answers(WAIT).await?;
                // A peer that never gets ready is still probed (what a
                // user would meet).
                let ready = if settled(&addresses, &authorizations, then_addresses.as_ref()) {
                    tokio::task::block_in_place(|| wait_ready(&agent, WAIT))
                } else {
                    matches!(agent.readiness(), Ok((200, _)))
                };
                let observed = self.probe_all(case).await;
                Ok(Run {
                    addresses,
                    authorizations,
                    then_addresses,
                    observed,
                    ready,
                    logs: agent.logs(),
                })
            }
        }
    }

    fn start_agent(&self, istiod: &Istiod) -> Result<Agent> {
        let yaml = workloads_yaml(&[WorkloadSpec::for_pod(&self.server, true)]);
        // The agent's --ca-dir (see agent.rs): the bed's root, installed
        // before it starts, so it trusts the probes' certificates.
        let ca_dir = std::env::temp_dir().join(format!("{}-ca", self.topology.prefix()));
        self.pki.install_ca(&ca_dir)?;
        let address = istiod.addr.to_string();
        let root = self.pki.root_file().display().to_string();
        let token = self.pki.token_file().display().to_string();
        let node = self.server.node();
        let mut agent = Agent::start(
            &self.topology,
            node,
            &yaml,
            &[
                "--redirect",
                "ebpf",
                "--xds-address",
                &address,
                "--xds-root-cert",
                &root,
                "--xds-token",
                &token,
                "--instance-ip",
                "198.18.0.5",
                "--pod-name",
                "shunt-x1",
                "--pod-namespace",
                "istio-system",
            ],
        )?;
        agent.wait_for("the server pod enrolled", WAIT, mesh_pods_enrolled)?;
        Ok(agent)
    }

    async fn probe_all(&self, case: &Case) -> Vec<(Row, Observed)> {
        let mut observed = Vec::new();
        for row in &case.rows {
            let seen = probe(
                &self.pki,
                &self.client,
                &self.server,
                SERVER_SA,
                row.caller,
                row.port,
            )
            .await;
            observed.push((*row, seen));
        }
        observed
    }
}

/// Whether the last response of each type was ACKed.
fn settled(addresses: &Answer, authorizations: &Answer, then: Option<&Answer>) -> bool {
    then.unwrap_or(addresses).error.is_none() && authorizations.error.is_none()
}

/// Polls the agent's readiness (bounded); false when it never says 200.
fn wait_ready(agent: &Agent, timeout: Duration) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if matches!(agent.readiness(), Ok((200, _))) {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

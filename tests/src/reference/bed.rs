//! The comparison bed: two nodes, a client pod on node-a (not in the mesh:
//! the probes speak HBONE themselves) and the server workload
//! `default/server` (service account `sa-server`) on node-b with echo
//! servers on 8080 and 9090. A case runs against a fresh peer serving the
//! server: the real ztunnel in the server's pod netns, or the shunt agent
//! of node-b; both are fed by an [`Istiod`] serving the same [`Snapshot`].

use std::{
    path::{Path, PathBuf},
    time::Duration,
};

use shunt_proto::envoy::service::discovery::v3::Resource;

use super::{
    cases::{Case, DnsRow, OutboundRow, Row},
    istiod::{Answer, Istiod, Snapshot},
    pki::Pki,
    probe::{Observed, Outcome, dns_a, probe},
    resolver::CaseResolver,
    resources::{pod, policy, workload},
    ztunnel_peer::{PeerSettings, Ztunnel},
};
use crate::{
    Cgroup, Pod, Result, TestbedError, Topology,
    agent::{Agent, WorkloadSpec, mesh_pods_enrolled, workloads_yaml},
    apps::{EchoServer, TestApp, ok},
    waypoint::{Received, StandInWaypoint, Tunnel},
};
use shunt::state::{SpiffeId, TrustDomain};

pub const SERVER_SA: &str = "sa-server";
/// The client's service account (as the testbed's workloads file names it).
pub const CLIENT_SA: &str = "sa-client";
/// What the client's ztunnel captures: the topology's range (VIPs and
/// pods).
pub const CAPTURED: &str = "198.18.0.0/15";
/// The server pod's address (the topology's addressing is fixed: the
/// first pod of the second node).
pub const SERVER_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 2, 10);
/// The client pod's address (the first pod of the first node).
pub const CLIENT_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 1, 10);
/// node-b's address on the fabric (its InternalIP): the IP istiod gives
/// its hostNetwork pods (the topology's addressing is fixed: see lib.rs).
pub const NODE_B_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 19, 0, 2);
/// The east-west gateway pod's address (node-b's second pod), where a
/// stand-in gateway serves HBONE on 15008 as [`GATEWAY_SA`] of
/// `istio-system`.
pub const GATEWAY_IP: std::net::Ipv4Addr = std::net::Ipv4Addr::new(198, 18, 2, 11);
pub const GATEWAY_SA: &str = "istio-eastwestgateway";
/// The authorities the gateway tunnels (to the server's 15008): the outer
/// CONNECT of double HBONE for these services' port 80 (the second's
/// waypoint is behind the gateway).
pub const TUNNELED: &str = "through-gateway.default.svc.cluster.local:80";
pub const TUNNELED_TO_WAYPOINT: &str = "wp-through-gateway.default.svc.cluster.local:80";
/// A service whose only endpoint has no address (the gateway reaches it).
pub const TUNNELED_ADDRESSLESS: &str = "addressless.default.svc.cluster.local:80";
/// A service's VIP and port whose canary waypoint, in a weighted set, is
/// the bed's stand-in: as a waypoint, it passes the CONNECT's stream on
/// to the server's echo port (plain TCP, as a waypoint's L4 forward).
pub const CANARY_AUTHORITY: &str = "198.19.100.56:80";
/// An address in a service's range (a ServiceEntry's CIDR) whose waypoint
/// is the stand-in, and its port.
pub const RANGE_AUTHORITY: &str = "198.19.200.7:80";
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
    /// The rows probed before the first xDS update.
    pub before_sync: Vec<(Row, Observed)>,
    pub outbound: Vec<(OutboundRow, Observed)>,
    /// Each DNS row's answer: the addresses, or why none came.
    pub dns: Vec<(DnsRow, std::result::Result<Vec<std::net::Ipv4Addr>, String>)>,
    /// The CONNECTs the east-west gateway received during the case.
    pub through_gateway: Vec<Received>,
    /// Whether the peer said ready before the probes: waited for (bounded)
    /// when it ACKed both types, one look otherwise.
    pub ready: bool,
    /// The server-side proxy's `/config_dump` once it settled (what
    /// `istioctl ztunnel-config` reads), or why there is none.
    pub config_dump: std::result::Result<serde_json::Value, String>,
    /// The server-side proxy's `/metrics` after the rows, or why there is
    /// none.
    pub metrics: std::result::Result<String, String>,
    /// The client-side proxy's, after the outbound and DNS rows (`None`:
    /// the case has none, so no client proxy ran).
    pub client_metrics: Option<std::result::Result<String, String>>,
    /// The peer's log, for failure messages.
    pub logs: String,
}

pub struct Bed {
    pki: Pki,
    /// `shunt-testapp`, the client application of outbound probes, and
    /// the cgroup it runs in (where the agent's socket programs see it).
    testapp: PathBuf,
    apps: Cgroup,
    client: Pod,
    server: Pod,
    _echo: [EchoServer; 2],
    gateway: StandInWaypoint,
    /// Where a case's names are served (`resolver.rs`).
    gateway_pod: Pod,
    topology: Topology,
}

impl Bed {
    /// `testapp` is `env!("CARGO_BIN_EXE_shunt-testapp")` in this crate's
    /// tests.
    pub fn new(test_name: &str, testapp: &Path) -> Result<Bed> {
        let mut topology = Topology::new(test_name)?;
        topology.add_node("node-a")?;
        topology.add_node("node-b")?;
        let client = topology.add_pod("node-a", "client")?;
        let server = topology.add_pod("node-b", "server")?;
        let echo = [
            EchoServer::on(&server, 8080)?,
            EchoServer::on(&server, 9090)?,
        ];
        if client.ip() != CLIENT_IP || server.ip() != SERVER_IP || server.node().ip() != NODE_B_IP {
            return Err(TestbedError::Invalid(format!(
                "the client is at {}, the server pod at {} on a node at {}; the tables expect {CLIENT_IP}, {SERVER_IP} on {NODE_B_IP}",
                client.ip(),
                server.ip(),
                server.node().ip()
            )));
        }
        let gateway_pod = topology.add_pod("node-b", "eastwest")?;
        if gateway_pod.ip() != GATEWAY_IP {
            return Err(TestbedError::Invalid(format!(
                "the gateway pod is at {}, the tables expect {GATEWAY_IP}",
                gateway_pod.ip()
            )));
        }
        let apps = Cgroup::create(&topology, "apps")?;
        let pki = Pki::new()?;
        let gateway_ca = std::env::temp_dir().join(format!("{}-gw-ca", topology.prefix()));
        pki.install_ca(&gateway_ca)?;
        let gateway = StandInWaypoint::start_gateway(
            &gateway_pod,
            &gateway_ca,
            SpiffeId::for_service_account(&TrustDomain::default(), "istio-system", GATEWAY_SA),
            [TUNNELED, TUNNELED_TO_WAYPOINT, TUNNELED_ADDRESSLESS]
                .into_iter()
                .map(|authority| (authority, 15008))
                .chain([(CANARY_AUTHORITY, 8080), (RANGE_AUTHORITY, 8080)])
                .map(|(authority, port)| Tunnel {
                    authority: authority.into(),
                    target: (SERVER_IP, port).into(),
                })
                .collect(),
        );
        // The stand-in holds its CA in memory once started: the files go,
        // whether it started or not.
        let _ = std::fs::remove_dir_all(&gateway_ca);
        let gateway = gateway?;
        Ok(Bed {
            pki,
            testapp: testapp.to_path_buf(),
            apps,
            client,
            server,
            _echo: echo,
            gateway,
            gateway_pod,
            topology,
        })
    }

    /// The workloads istiod sends besides a case's own: the server
    /// (naming `server_policies`, an endpoint of `server_services`) and the
    /// client.
    pub fn base_addresses(&self, case: &Case) -> Vec<Resource> {
        let (server_policies, server_services) = (&case.server_policies, &case.server_services);
        let mut client = pod(
            self.client.name(),
            CLIENT_SA,
            self.client.ip(),
            self.client.node().name(),
        );
        client.network = case.client_network.into();
        let mut server = pod(
            self.server.name(),
            SERVER_SA,
            self.server.ip(),
            self.server.node().name(),
        );
        server.network = case.server_network.into();
        if case.deployed {
            deployed(&mut client, "sleep", "v1", "zone-a1");
            deployed(&mut server, "httpbin", "v2", "zone-a2");
        }
        server.network_gateway = case.server_gateway.map(|ip| {
            use shunt_proto::istio::workload as wl;
            wl::GatewayAddress {
                destination: Some(wl::gateway_address::Destination::Address(
                    wl::NetworkAddress {
                        network: case.server_network.into(),
                        address: ip.to_vec(),
                        length: None,
                    },
                )),
                hbone_mtls_port: 15008,
            }
        });
        server.authorization_policies = server_policies.iter().map(|p| p.to_string()).collect();
        for key in server_services {
            let port = shunt_proto::istio::workload::Port {
                service_port: 80,
                target_port: 8080,
                ..Default::default()
            };
            server.services.insert(
                key.to_string(),
                shunt_proto::istio::workload::PortList { ports: vec![port] },
            );
        }
        vec![workload(server), workload(client)]
    }

    fn snapshot(&self, case: &Case) -> Snapshot {
        Snapshot {
            addresses: self
                .base_addresses(case)
                .into_iter()
                .chain(case.addresses.iter().cloned())
                .collect(),
            then_addresses: case.then_addresses.clone(),
            hold: !case.before_sync.is_empty(),
            authorizations: case.authorizations.iter().cloned().map(policy).collect(),
        }
    }

    /// Runs `case` on a fresh `peer` (`ztunnel` is the binary, for
    /// [`Peer::Ztunnel`]): the server's proxy first (its istiod holding
    /// the snapshot while the before-sync rows run), then, for outbound
    /// or DNS rows, the client's.
    pub async fn run(&self, peer: Peer, ztunnel: Option<&Path>, case: &Case) -> Result<Run> {
        self.run_pair(peer, peer, ztunnel, case).await
    }

    /// [`Bed::run`] with `server` serving the server and `client` the
    /// client (interop: one peer's HBONE terminated by the other).
    pub async fn run_pair(
        &self,
        server: Peer,
        client: Peer,
        ztunnel: Option<&Path>,
        case: &Case,
    ) -> Result<Run> {
        let mut server_side = tokio::task::block_in_place(|| {
            self.start_side(server, ztunnel, &self.server, case, Role::Server, None)
        })?;
        let before_sync = self.probe_rows(&case.before_sync).await;
        server_side.istiod.release();
        let (addresses, authorizations, then_addresses, ready) = server_side.settle().await?;
        let observed = self.probe_rows(&case.rows).await;
        let config_dump = tokio::task::block_in_place(|| server_side.proxy.config_dump());
        let metrics = tokio::task::block_in_place(|| server_side.proxy.settled_metrics());
        let mut logs = server_side.proxy.logs();
        let (mut outbound, mut dns, mut client_metrics) = (Vec::new(), Vec::new(), None);
        let gateway_before = self.gateway.received().len();
        if !case.outbound.is_empty() || !case.dns.is_empty() {
            let resolver = match case.resolves.as_slice() {
                [] => None,
                names => Some(CaseResolver::start(&self.gateway_pod, names)?),
            };
            let resolv_conf = resolver.as_ref().map(CaseResolver::conf);
            let mut client_side = tokio::task::block_in_place(|| {
                self.start_side(
                    client,
                    ztunnel,
                    &self.client,
                    case,
                    Role::Client,
                    resolv_conf,
                )
            })?;
            client_side.settle().await?;
            let _dropped = if case.hbone_port_dropped {
                Some(HbonePortDropped::new(&self.client, SERVER_IP)?)
            } else {
                None
            };
            outbound = self.probe_outbound(case);
            dns = self.probe_dns(case);
            client_metrics = Some(tokio::task::block_in_place(|| {
                client_side.proxy.settled_metrics()
            }));
            logs.push_str("\n--- the client's proxy:\n");
            logs.push_str(&client_side.proxy.logs());
        }
        Ok(Run {
            addresses,
            authorizations,
            then_addresses,
            observed,
            before_sync,
            outbound,
            dns,
            through_gateway: {
                let mut seen = self.gateway.received();
                seen.split_off(gateway_before.min(seen.len()))
            },
            ready,
            config_dump,
            metrics,
            client_metrics,
            logs,
        })
    }

    /// A fresh `peer` serving `pod` and the istiod feeding it the case's
    /// snapshot (held, on the server side, until released), resolving
    /// with `resolv_conf` when given.
    fn start_side(
        &self,
        peer: Peer,
        ztunnel: Option<&Path>,
        pod: &Pod,
        case: &Case,
        role: Role,
        resolv_conf: Option<&Path>,
    ) -> Result<Side> {
        let on_loopback = ([127, 0, 0, 1], 0).into();
        let listener = match peer {
            // ztunnel runs in the pod's netns, the agent in its node's.
            Peer::Ztunnel => pod.listen_tcp(on_loopback)?,
            Peer::Shunt => pod.node().listen_tcp(on_loopback)?,
        };
        let istiod = Istiod::serve(&self.pki, listener, self.snapshot(case))?;
        if role == Role::Client {
            // The client's view is not the subject of the before-sync rows.
            istiod.release();
        }
        let proxy = match peer {
            Peer::Ztunnel => {
                let binary = ztunnel.ok_or_else(|| {
                    TestbedError::Invalid("no ztunnel binary for a ztunnel run".into())
                })?;
                let (service_account, capture_outbound, network) = match role {
                    Role::Server => (SERVER_SA, None, ""),
                    Role::Client => (CLIENT_SA, Some(CAPTURED), case.client_network),
                };
                let workload = ("default", pod.name(), service_account);
                let settings = PeerSettings {
                    capture_outbound,
                    network,
                    resolv_conf,
                };
                Proxy::Ztunnel(Box::new(Ztunnel::start(
                    binary, pod, workload, &istiod, &self.pki, settings,
                )?))
            }
            Peer::Shunt => Proxy::Shunt(Box::new(self.start_agent(&istiod, pod, resolv_conf)?)),
        };
        Ok(Side { istiod, proxy })
    }

    /// The agent of `pod`'s node, on the in-test istiod and the bed's root
    /// (and `resolv_conf`'s resolvers, when given).
    fn start_agent(&self, istiod: &Istiod, pod: &Pod, resolv_conf: Option<&Path>) -> Result<Agent> {
        let yaml = workloads_yaml(&[
            WorkloadSpec::for_pod(&self.server, true),
            WorkloadSpec {
                dns_capture: Some(true),
                ..WorkloadSpec::for_pod(&self.client, true)
            },
        ]);
        // The agent's --ca-dir (see agent.rs): the bed's root, installed
        // before it starts, so it trusts the probes' certificates.
        let ca_dir = std::env::temp_dir().join(format!("{}-ca", self.topology.prefix()));
        self.pki.install_ca(&ca_dir)?;
        let address = istiod.addr.to_string();
        let root = self.pki.root_file().display().to_string();
        let token = self.pki.token_file().display().to_string();
        let node = pod.node();
        let resolv_conf = resolv_conf.map(|p| p.display().to_string());
        let resolvers = resolv_conf
            .iter()
            .flat_map(|conf| ["--dns-resolv-conf", conf.as_str()]);
        let args: Vec<&str> = [
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
            // The agent's default (the harness turns it off unless a
            // test says): the kernel may send a connect around the
            // proxy, and the outcomes must still be ztunnel's.
            "--fast-path",
            "on",
        ]
        .into_iter()
        .chain(resolvers)
        .collect();
        let mut agent = Agent::start(&self.topology, node, &yaml, &args)?;
        agent.wait_for("its pod enrolled", WAIT, mesh_pods_enrolled)?;
        Ok(agent)
    }

    async fn probe_rows(&self, rows: &[Row]) -> Vec<(Row, Observed)> {
        let mut observed = Vec::new();
        for row in rows {
            let seen = probe(
                &self.pki,
                &self.client,
                &self.server,
                SERVER_SA,
                row.caller,
                row.host,
                row.port,
            )
            .await;
            observed.push((*row, seen));
        }
        observed
    }
}

impl Bed {
    /// Each DNS row asked in the client pod.
    fn probe_dns(
        &self,
        case: &Case,
    ) -> Vec<(DnsRow, std::result::Result<Vec<std::net::Ipv4Addr>, String>)> {
        case.dns
            .iter()
            .map(|row| {
                (
                    *row,
                    tokio::task::block_in_place(|| dns_a(&self.client, row.name)),
                )
            })
            .collect()
    }

    /// The client application connects to each VIP row (through whatever
    /// proxy serves the client) and sends bytes the server echoes.
    fn probe_outbound(&self, case: &Case) -> Vec<(OutboundRow, Observed)> {
        let app = TestApp::new(&self.testapp, &self.apps);
        case.outbound
            .iter()
            .map(|row| {
                let to = std::net::SocketAddrV4::new(row.dst.into(), row.port).to_string();
                // A dropped HBONE port fails the connection only when the
                // proxy's connect times out (≈ 3 s): wait for that, so the
                // metrics scraped next have counted it.
                let timeout = if case.hbone_port_dropped {
                    "15000"
                } else {
                    "5000"
                };
                let report = tokio::task::block_in_place(|| {
                    app.run(
                        &self.client,
                        &["connect", &to, "--send", "4096", "--timeout-ms", timeout],
                    )
                });
                let outcome = if ok(&report) {
                    Outcome::Allowed
                } else {
                    Outcome::Refused
                };
                let detail = report.to_string();
                (
                    *row,
                    Observed {
                        outcome,
                        detail,
                        answer_baggage: None,
                    },
                )
            })
            .collect()
    }
}

/// A pod's packets to a peer's HBONE port dropped (its `OUTPUT` chain),
/// and its SYNs retried once, until dropped: what a NetworkPolicy that
/// does not allow 15008 does to the proxy's connect, in ≈ 3 s.
struct HbonePortDropped {
    netns: PathBuf,
    rule: Vec<String>,
    syn_retries: String,
}

impl HbonePortDropped {
    fn new(pod: &Pod, peer: std::net::Ipv4Addr) -> Result<Self> {
        let netns = pod.netns_path();
        let syn_retries = in_netns(&netns, &["sysctl", "-n", "net.ipv4.tcp_syn_retries"])?
            .trim()
            .to_owned();
        let rule: Vec<String> = ["OUTPUT", "-p", "tcp", "-d", &peer.to_string()]
            .into_iter()
            .chain(["--dport", "15008", "-j", "DROP"])
            .map(str::to_owned)
            .collect();
        let dropped = Self {
            netns,
            rule,
            syn_retries,
        };
        in_netns(
            &dropped.netns,
            &["sysctl", "-w", "net.ipv4.tcp_syn_retries=1"],
        )?;
        let mut add = vec!["iptables", "-A"];
        add.extend(dropped.rule.iter().map(String::as_str));
        in_netns(&dropped.netns, &add)?;
        Ok(dropped)
    }
}

impl Drop for HbonePortDropped {
    fn drop(&mut self) {
        let mut delete = vec!["iptables", "-D"];
        delete.extend(self.rule.iter().map(String::as_str));
        let restore = format!("net.ipv4.tcp_syn_retries={}", self.syn_retries);
        for args in [delete, vec!["sysctl", "-w", &restore]] {
            if let Err(e) = in_netns(&self.netns, &args) {
                eprintln!("restoring the client pod's HBONE port: {e}");
            }
        }
    }
}

/// `args` run in the network namespace at `netns`.
fn in_netns(netns: &Path, args: &[&str]) -> Result<String> {
    let net = format!("--net={}", netns.display());
    let mut all = vec![net.as_str(), "--"];
    all.extend_from_slice(args);
    crate::cmd::run("nsenter", &all)
}

/// Which end of the probes a proxy serves.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Role {
    Server,
    Client,
}

/// A running proxy of either implementation.
enum Proxy {
    Ztunnel(Box<Ztunnel>),
    Shunt(Box<Agent>),
}

impl Proxy {
    /// Waits (bounded) for readiness 200; false if it does not come.
    fn wait_ready(&mut self) -> bool {
        match self {
            Proxy::Ztunnel(zt) => tokio::task::block_in_place(|| zt.wait_ready(WAIT)),
            Proxy::Shunt(agent) => tokio::task::block_in_place(|| wait_ready(agent, WAIT)),
        }
    }

    /// Whether readiness says 200 now.
    fn is_ready(&self) -> bool {
        match self {
            Proxy::Ztunnel(zt) => zt.readiness() == Some(200),
            Proxy::Shunt(agent) => matches!(agent.readiness(), Ok((200, _))),
        }
    }

    fn logs(&self) -> String {
        match self {
            Proxy::Ztunnel(zt) => zt.logs(),
            Proxy::Shunt(agent) => agent.logs(),
        }
    }

    /// Its `/metrics` text once every TCP connection it counted open is
    /// counted closed too (bounded by [`WAIT`]; then as it is): a proxy
    /// counts a close when its side of the connection has ended, which
    /// can come a moment after the application saw its answer and the
    /// probe returned.
    fn settled_metrics(&self) -> std::result::Result<String, String> {
        // The last scrape, settled or not, when the wait runs out.
        let mut last = String::new();
        let settled = crate::poll::until(WAIT, Duration::from_millis(20), || {
            let text = match self.metrics() {
                Ok(text) => text,
                Err(e) => return Some(Err(e)),
            };
            let total = |family: &str| -> f64 {
                text.lines()
                    .filter(|line| line.starts_with(family))
                    .filter_map(|line| line.rsplit_once(' '))
                    .filter_map(|(_, value)| value.trim().parse::<f64>().ok())
                    .sum()
            };
            let open = total("istio_tcp_connections_opened_total")
                - total("istio_tcp_connections_closed_total");
            if open <= 0.0 {
                return Some(Ok(text));
            }
            last = text;
            None
        });
        settled.unwrap_or(Ok(last))
    }

    /// Its `/metrics` text.
    fn metrics(&self) -> std::result::Result<String, String> {
        let (code, body) = match self {
            Proxy::Ztunnel(zt) => zt.metrics_get(),
            Proxy::Shunt(agent) => agent.metrics(),
        }
        .map_err(|e| e.to_string())?;
        if code != 200 {
            return Err(format!("GET /metrics: {code} {body}"));
        }
        Ok(body)
    }

    /// Its `/config_dump`, parsed.
    fn config_dump(&self) -> std::result::Result<serde_json::Value, String> {
        let (code, body) = match self {
            Proxy::Ztunnel(zt) => zt.admin_get("/config_dump"),
            Proxy::Shunt(agent) => agent.admin_get("/config_dump"),
        }
        .map_err(|e| e.to_string())?;
        if code != 200 {
            return Err(format!("GET /config_dump: {code} {body}"));
        }
        serde_json::from_str(&body).map_err(|e| format!("/config_dump is not JSON: {e}"))
    }
}

/// A proxy and the istiod feeding it (dropped proxy first).
struct Side {
    proxy: Proxy,
    istiod: Istiod,
}

impl Side {
    /// Waits for the answers to what istiod sent, then readiness: waited
    /// for (bounded) when the last response of each type was ACKed, one
    /// look otherwise (a peer never ready is still probed: what a user
    /// would meet).
    async fn settle(&mut self) -> Result<(Answer, Answer, Option<Answer>, bool)> {
        let (addresses, authorizations, then) = self.istiod.wait_for_answers(WAIT).await?;
        let acked =
            then.as_ref().unwrap_or(&addresses).error.is_none() && authorizations.error.is_none();
        let ready = if acked {
            self.proxy.wait_ready()
        } else {
            self.proxy.is_ready()
        };
        Ok((addresses, authorizations, then, ready))
    }
}

/// `w` as istiod sends a pod of Deployment `app` labelled `app` and
/// `version`, in region `region-a` and `zone`.
fn deployed(w: &mut shunt_proto::istio::workload::Workload, app: &str, version: &str, zone: &str) {
    w.workload_name = app.into();
    w.workload_type = shunt_proto::istio::workload::WorkloadType::Deployment as i32;
    w.canonical_name = app.into();
    w.canonical_revision = version.into();
    w.locality = Some(shunt_proto::istio::workload::Locality {
        region: "region-a".into(),
        zone: zone.into(),
        subzone: String::new(),
    });
}

/// Polls the agent's readiness (bounded); false when it never says 200.
/// Ready, it then waits for its fast-path table in use: otherwise every
/// connect would still go to the proxy, and a row could not show the
/// kernel sending one around it.
fn wait_ready(agent: &Agent, timeout: Duration) -> bool {
    crate::poll::until(timeout, Duration::from_millis(50), || {
        matches!(agent.readiness(), Ok((200, _))).then_some(())
    })
    .is_some()
        && crate::poll::until(timeout, Duration::from_millis(50), || {
            let fast = agent.status().ok()?.fast_path?;
            (!fast.enabled || fast.table_valid).then_some(())
        })
        .is_some()
}

//! The harness of the `--proxy ztunnel` kernel tests (`ztunnel.rs`,
//! `ztunnel_hbone.rs`): the agent's reconciler with its ZDS server in the
//! test process, and a stand-in ztunnel serving what it is handed.

// Each test target uses part of it.
#![allow(dead_code)]

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf, time::Duration};

use shunt::{
    agent::{NodeAgent, Reconciler, ReconcilerInputs},
    app::AgentSink,
    control::{NodePods, SourceSink},
    inpod::ZdsConfig,
    metrics::Metrics,
    redirect::{
        Capture, Redirector,
        ebpf::{EbpfOptions, EbpfRedirector},
    },
    snapshot::NodeSnapshot,
    state::{DataplaneMode, PodState, SpiffeId, TrustDomain, Workload, WorkloadKey},
};
use shunt_proto::istio::zds::workload_request::Payload;
use shunt_testbed::{
    Cgroup, Pod, Topology,
    agent::PinDir,
    hbone::MeshCa,
    ztunnel::{InPodProxy, Mesh, Options, ZdsClient},
};

pub const TESTAPP: &str = env!("CARGO_BIN_EXE_shunt-testapp");
pub const TIMEOUT: Duration = Duration::from_secs(30);

pub fn workload(pod: &Pod, mode: DataplaneMode) -> Workload {
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

/// `client` (service account `sleep`) and `server` (`httpbin`), both in
/// the mesh: the workloads the HBONE tests hand the agent.
pub fn sleep_and_httpbin(client: &Pod, server: &Pod) -> Vec<Workload> {
    vec![
        Workload {
            service_account: "sleep".into(),
            ..workload(client, DataplaneMode::Ambient)
        },
        Workload {
            service_account: "httpbin".into(),
            ..workload(server, DataplaneMode::Ambient)
        },
    ]
}

pub fn ebpf_redirector(topo: &Topology, pin: &PinDir) -> Box<dyn Redirector> {
    let mut options = EbpfOptions::new(pin.path());
    options.cgroup_root = Some(topo.cgroup_root().expect("cgroup root"));
    Box::new(EbpfRedirector::load(&options).expect("load eBPF"))
}

/// What the stand-ins need to speak HBONE to each other: a CA for their
/// certificates and the mesh workloads' identities by IP (what a ztunnel
/// gets from its CA and from istiod).
pub struct HboneSetup {
    pub ca: MeshCa,
    pub workloads: BTreeMap<IpAddr, SpiffeId>,
}

/// How the harness's agent runs.
pub struct AgentOptions {
    /// How often the reconciler's verify pass runs (and looks at the pods'
    /// netns paths again).
    pub verify_every: Duration,
    /// The ZDS server's wait before sending a refused pod again.
    pub retry_initial: Duration,
    /// `--dns-capture`: the pods' DNS to ztunnel's 15053 (None: off).
    pub dns_capture: Option<bool>,
}

impl Default for AgentOptions {
    fn default() -> Self {
        Self {
            verify_every: Duration::from_secs(1),
            retry_initial: Duration::from_secs(1),
            dns_capture: None,
        }
    }
}

/// The agent's reconciler with a ZDS server on a socket of the test's own.
pub struct Agent {
    reconciler: Reconciler,
    sink: AgentSink,
    metrics: Metrics,
    pub socket: PathBuf,
    socket_dir: PathBuf,
}

impl Agent {
    pub fn start(topo: &Topology, redirector: Box<dyn Redirector>, pods: Vec<Workload>) -> Agent {
        Self::start_with(topo, redirector, pods, AgentOptions::default())
    }

    pub fn start_with(
        topo: &Topology,
        redirector: Box<dyn Redirector>,
        pods: Vec<Workload>,
        options: AgentOptions,
    ) -> Agent {
        let socket_dir = PathBuf::from(format!("/tmp/{}-zds", topo.prefix()));
        let socket = socket_dir.join("ztunnel.sock");
        let metrics = Metrics::new();
        let config = ZdsConfig {
            ack_timeout: Duration::from_secs(5),
            retry_initial: options.retry_initial,
            retry_max: options.retry_initial * 4,
            metrics: metrics.zds().clone(),
        };
        let (server_task, link) = shunt::inpod::bind(&socket, config).expect("ZDS socket");
        tokio::spawn(server_task.run());
        let agent = NodeAgent::new(
            "node-a".into(),
            TrustDomain::default(),
            redirector,
            Capture::all(),
        )
        .with_metrics(metrics.clone())
        .with_dns_capture(options.dns_capture)
        .with_ztunnel(link);
        let (pods_tx, pods_rx) = tokio::sync::watch::channel(None);
        let reconciler = Reconciler::spawn(
            agent,
            ReconcilerInputs {
                pods: pods_rx,
                store_applied: None,
                verify_every: options.verify_every,
            },
            tokio::runtime::Handle::current(),
        )
        .expect("reconcile thread");
        let sink = AgentSink::new(pods_tx, None);
        let agent = Agent {
            reconciler,
            sink,
            metrics,
            socket,
            socket_dir,
        };
        agent.push(pods);
        agent
    }

    /// The source lists these pods as the node's, from now on.
    pub fn push(&self, pods: Vec<Workload>) {
        self.sink.node_pods(NodePods {
            trust_domain: TrustDomain::default(),
            pods,
        });
    }

    /// The value of metric `name` (no labels) on a scrape now.
    pub fn metric(&self, name: &str) -> Option<f64> {
        let text = self.metrics.encode(None);
        text.lines().find_map(|line| {
            let (key, value) = line.split_once(' ')?;
            (key == name).then(|| value.parse().ok())?
        })
    }

    /// Waits (bounded by [`TIMEOUT`]) until metric `name` reads `value`.
    pub async fn wait_metric(&self, name: &str, value: f64) {
        shunt_testbed::poll::eventually(
            &format!("{name} reads {value}"),
            TIMEOUT,
            || (self.metric(name) == Some(value)).then_some(()),
            || format!("{name} is {:?}", self.metric(name)),
        )
        .await
    }

    /// Waits (bounded) for a snapshot that passes `check`; returns it.
    pub async fn wait_until(
        &self,
        what: &str,
        check: impl Fn(&NodeSnapshot) -> bool,
    ) -> NodeSnapshot {
        let mut snapshots = self.reconciler.snapshots();
        let found = tokio::time::timeout(TIMEOUT, async {
            snapshots
                .wait_for(|s| check(s))
                .await
                .map(|s| (**s).clone())
        })
        .await;
        match found {
            Ok(Ok(snapshot)) => snapshot,
            _ => panic!(
                "{what}: not within {TIMEOUT:?}: {:?}",
                self.reconciler.snapshots().borrow().pods
            ),
        }
    }

    /// `pod`'s state in the last snapshot published.
    pub fn snapshot_state(&self, pod: &str) -> Option<PodState> {
        let key = WorkloadKey::new("default", pod);
        let snapshot = self.reconciler.snapshots().borrow().clone();
        snapshot
            .pods
            .iter()
            .find(|p| p.workload.key() == key)
            .map(|p| p.state.clone())
    }

    /// Waits (bounded) for a snapshot where `pod` is in `state`.
    pub async fn wait_for(&self, pod: &str, state: PodState) -> NodeSnapshot {
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
    pub fn serve_with_stand_in(
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

    pub async fn stop(self) {
        self.reconciler.stop(true).await;
        let _ = std::fs::remove_dir_all(&self.socket_dir);
    }
}

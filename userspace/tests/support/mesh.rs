//! A small mesh for proxy tests: testbed nodes and pods, one `Proxy` per
//! node sharing one built-in CA, a workload store, and a map-based
//! `OriginalDst` (the tests play the redirector: before connecting to
//! 127.0.0.1:15001 they record where the connection "was going").
#![allow(dead_code)]

use std::{
    collections::HashMap,
    net::{IpAddr, SocketAddr, TcpStream as StdTcpStream},
    sync::{Arc, Mutex, RwLock},
    time::Duration,
};

use shunt::{
    identity::{IdentityConfig, IdentityManager, ca::BuiltinCa},
    proxy::{PodNet, Proxy, ProxyConfig},
    redirect::{OriginalDst, OriginalDstError},
    state::{DataplaneMode, SpiffeId, TrustDomain, Workload},
    store::WorkloadStore,
};
use shunt_testbed::{Pod, Topology};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Original destinations keyed by the application socket's address (the
/// proxy sees it as the peer).
#[derive(Default)]
pub struct MapOriginalDst(Mutex<HashMap<SocketAddr, SocketAddr>>);

impl MapOriginalDst {
    pub fn insert(&self, app: SocketAddr, dst: SocketAddr) {
        self.0.lock().expect("map").insert(app, dst);
    }
}

impl OriginalDst for MapOriginalDst {
    fn original_dst(&self, accepted: &StdTcpStream) -> Result<SocketAddr, OriginalDstError> {
        let peer = accepted.peer_addr()?;
        self.0
            .lock()
            .map_err(|_| OriginalDstError::NotRedirected { peer })?
            .get(&peer)
            .copied()
            .ok_or(OriginalDstError::NotRedirected { peer })
    }
}

pub struct NodeProxy {
    pub proxy: Proxy,
    pub odst: Arc<MapOriginalDst>,
    pub identities: IdentityManager,
}

pub struct PodSpec {
    pub node: &'static str,
    pub name: &'static str,
    pub service_account: &'static str,
    pub mesh: bool,
}

pub const fn pod(
    node: &'static str,
    name: &'static str,
    service_account: &'static str,
    mesh: bool,
) -> PodSpec {
    PodSpec {
        node,
        name,
        service_account,
        mesh,
    }
}

pub struct Mesh {
    /// Each node proxy's data-path shards (`Mesh::with_shards`), stopped
    /// when the mesh is dropped.
    pub data_paths: Vec<shunt::shards::DataPath>,
    pub topo: Topology,
    pub ca: Arc<BuiltinCa>,
    pub store: Arc<RwLock<WorkloadStore>>,
    pub nodes: HashMap<String, NodeProxy>,
    pub specs: Vec<PodSpec>,
}

pub fn td() -> TrustDomain {
    TrustDomain::default()
}

impl Mesh {
    pub async fn new(
        test: &str,
        specs: Vec<PodSpec>,
        config: ProxyConfig,
        identity: IdentityConfig,
    ) -> Mesh {
        Mesh::with_shards(test, specs, config, identity, 0).await
    }

    /// As [`Mesh::new`], each node's proxy serving its pods on `shards`
    /// data-path shards of its own (none: on the test's runtime).
    pub async fn with_shards(
        test: &str,
        specs: Vec<PodSpec>,
        config: ProxyConfig,
        identity: IdentityConfig,
        shards: usize,
    ) -> Mesh {
        let mut data_paths = Vec::new();
        let mut topo = Topology::new(test).expect("topology (run as root)");
        let mut node_names: Vec<&str> = specs.iter().map(|s| s.node).collect();
        node_names.dedup();
        for n in &node_names {
            if topo.node(n).is_none() {
                topo.add_node(n).expect("node");
            }
        }
        let mut workloads = Vec::new();
        for s in &specs {
            let p = topo.add_pod(s.node, s.name).expect("pod");
            workloads.push(Workload {
                name: s.name.into(),
                namespace: "default".into(),
                service_account: s.service_account.into(),
                ips: vec![IpAddr::V4(p.ip())],
                node: s.node.into(),
                netns: Some(p.netns_path()),
                dataplane_mode: if s.mesh {
                    DataplaneMode::Ambient
                } else {
                    DataplaneMode::None
                },
                splice: None,
                ..Default::default()
            });
        }
        let store = Arc::new(RwLock::new(WorkloadStore::new()));
        store.write().expect("store").replace_all(workloads.clone());
        let (ca, _) = BuiltinCa::generate(&td()).expect("CA");
        let ca = Arc::new(ca);
        let mut nodes = HashMap::new();
        for n in &node_names {
            let identities = IdentityManager::new(ca.clone(), identity.clone());
            let odst = Arc::new(MapOriginalDst::default());
            let proxy = Proxy::new(
                config.clone(),
                identities.clone(),
                store.clone(),
                odst.clone(),
            )
            .expect("proxy");
            // The store above is complete: inbound is served.
            proxy.cluster_view_applied();
            if shards > 0 {
                let data_path = shunt::shards::DataPath::start(shards).expect("shards");
                proxy.set_shards(data_path.shards());
                data_paths.push(data_path);
            }
            for w in workloads.iter().filter(|w| w.node == *n && w.wants_mesh()) {
                proxy
                    .add_pod(PodNet {
                        key: w.key(),
                        netns: w.netns.clone().expect("netns"),
                        ips: w.ips.clone(),
                        identity: w.identity(&td()),
                        dns: false,
                    })
                    .await
                    .expect("add pod");
            }
            nodes.insert(
                n.to_string(),
                NodeProxy {
                    proxy,
                    odst,
                    identities,
                },
            );
        }
        Mesh {
            data_paths,
            topo,
            ca,
            store,
            nodes,
            specs,
        }
    }

    pub fn pod(&self, name: &str) -> &Pod {
        self.topo.pod(name).expect("pod exists")
    }

    pub fn node_of(&self, pod: &str) -> &NodeProxy {
        let node = self.pod(pod).node().name().to_string();
        &self.nodes[&node]
    }

    pub fn identity(&self, pod: &str) -> SpiffeId {
        let sa = self
            .specs
            .iter()
            .find(|s| s.name == pod)
            .expect("spec")
            .service_account;
        SpiffeId::for_service_account(&td(), "default", sa)
    }

    pub fn addr(&self, pod: &str, port: u16) -> SocketAddr {
        SocketAddr::new(IpAddr::V4(self.pod(pod).ip()), port)
    }

    /// What a redirected application connection looks like to the proxy:
    /// from inside `from`'s netns to its 127.0.0.1:15001, recorded as going
    /// to `dst`.
    pub async fn connect_via_proxy(&self, from: &str, dst: SocketAddr) -> tokio::net::TcpStream {
        let odst = self.node_of(from).odst.clone();
        let std = self
            .pod(from)
            .run(move || -> std::io::Result<StdTcpStream> {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
                s.bind(&SocketAddr::from(([127, 0, 0, 1], 0)).into())?;
                let local = s
                    .local_addr()?
                    .as_socket()
                    .ok_or_else(|| std::io::Error::other("no addr"))?;
                odst.insert(local, dst);
                // A blocking connect (bounded by SO_SNDTIMEO) succeeds once
                // the handshake completes; connect_timeout polls and then
                // reads SO_ERROR, which may already hold the reset of a
                // proxy that refused the connection in the meantime.
                s.set_write_timeout(Some(Duration::from_secs(5)))?;
                s.connect(&SocketAddr::from(([127, 0, 0, 1], 15001)).into())?;
                s.set_nonblocking(true)?;
                Ok(s.into())
            })
            .expect("netns")
            .expect("connect to 15001");
        tokio::net::TcpStream::from_std(std).expect("tokio")
    }

    /// A connection from `from` to `to` that the node proxy of `recorded_on`
    /// will believe was going to `dst` (recorded before connecting).
    pub async fn connect_recorded(
        &self,
        from: &str,
        to: SocketAddr,
        recorded_on: &str,
        dst: SocketAddr,
    ) -> tokio::net::TcpStream {
        let odst = self.node_of(recorded_on).odst.clone();
        let local_ip = self.pod(from).ip();
        let std = self
            .pod(from)
            .run(move || -> std::io::Result<StdTcpStream> {
                let s = socket2::Socket::new(socket2::Domain::IPV4, socket2::Type::STREAM, None)?;
                s.bind(&SocketAddr::from((local_ip, 0)).into())?;
                let local = s
                    .local_addr()?
                    .as_socket()
                    .ok_or_else(|| std::io::Error::other("no addr"))?;
                odst.insert(local, dst);
                // Blocking, bounded by SO_SNDTIMEO (see `connect_via_proxy`).
                s.set_write_timeout(Some(Duration::from_secs(5)))?;
                s.connect(&to.into())?;
                s.set_nonblocking(true)?;
                Ok(s.into())
            })
            .expect("netns")
            .expect("connect");
        tokio::net::TcpStream::from_std(std).expect("tokio")
    }

    /// A plain connection from inside `from`'s netns.
    pub async fn connect_direct(
        &self,
        from: &str,
        dst: SocketAddr,
    ) -> std::io::Result<tokio::net::TcpStream> {
        let std = self
            .pod(from)
            .run(move || -> std::io::Result<StdTcpStream> {
                let s = StdTcpStream::connect_timeout(&dst, Duration::from_secs(5))?;
                s.set_nonblocking(true)?;
                Ok(s)
            })
            .expect("netns")?;
        tokio::net::TcpStream::from_std(std)
    }

    /// An echo server on `pod`:`port`, serving until the test ends.
    pub fn echo_server(&self, pod: &str, port: u16) {
        let listener = self
            .pod(pod)
            .listen_tcp(self.addr(pod, port))
            .expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let (mut r, mut w) = s.split();
                    let _ = tokio::io::copy(&mut r, &mut w).await;
                    let _ = w.shutdown().await;
                });
            }
        });
    }

    /// A server that hashes everything it receives and answers the SHA-256
    /// (32 bytes) after the client's EOF (which also proves half-close).
    pub fn hash_server(&self, pod: &str, port: u16) {
        let listener = self
            .pod(pod)
            .listen_tcp(self.addr(pod, port))
            .expect("listen");
        listener.set_nonblocking(true).expect("nonblocking");
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio");
        tokio::spawn(async move {
            while let Ok((mut s, _)) = listener.accept().await {
                tokio::spawn(async move {
                    let mut ctx = ring::digest::Context::new(&ring::digest::SHA256);
                    let mut buf = vec![0u8; 256 * 1024];
                    loop {
                        match s.read(&mut buf).await {
                            Ok(0) => break,
                            Ok(n) => ctx.update(&buf[..n]),
                            Err(_) => return,
                        }
                    }
                    let _ = s.write_all(ctx.finish().as_ref()).await;
                    let _ = s.shutdown().await;
                });
            }
        });
    }
}

/// Writes `data`, reads the echo back, checks it.
pub async fn echo_roundtrip(s: &mut tokio::net::TcpStream, data: &[u8]) {
    s.write_all(data).await.expect("write");
    let mut back = vec![0u8; data.len()];
    tokio::time::timeout(Duration::from_secs(20), s.read_exact(&mut back))
        .await
        .expect("echo in time")
        .expect("read echo");
    assert_eq!(back, data);
}

/// The number of open fds of this process.
pub fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd")
        .map(|d| d.count())
        .unwrap_or(0)
}

/// Polls `cond` every 50 ms until it holds or `within` passes.
pub async fn eventually(within: Duration, mut cond: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + within;
    loop {
        if cond() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

impl Mesh {
    /// Waits (bounded, 10 s) until `done` holds for the proxies' stats by
    /// node: a connection is counted when its task finishes, which may be
    /// just after the client saw its EOF.
    pub async fn wait_for_stats(
        &self,
        what: &str,
        done: impl Fn(&HashMap<String, shunt::proxy::ProxyStats>) -> bool,
    ) {
        let start = std::time::Instant::now();
        loop {
            let stats: HashMap<String, shunt::proxy::ProxyStats> = self
                .nodes
                .iter()
                .map(|(name, node)| (name.clone(), node.proxy.stats()))
                .collect();
            if done(&stats) {
                return;
            }
            assert!(
                start.elapsed() < std::time::Duration::from_secs(10),
                "{what}: not after 10 s: {stats:?}"
            );
            tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        }
    }

    /// Waits until a connection from `from` to `dst` is refused (or, with
    /// `open`, accepted), bounded.
    pub async fn wait_listening(&self, from: &str, dst: SocketAddr, open: bool) -> bool {
        let deadline = std::time::Instant::now() + Duration::from_secs(5);
        loop {
            if self.connect_direct(from, dst).await.is_ok() == open {
                return true;
            }
            if std::time::Instant::now() >= deadline {
                return false;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    }
}

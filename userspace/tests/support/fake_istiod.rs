//! An in-test istiod for the xDS source: a tonic
//! `envoy.service.discovery.v3.AggregatedDiscoveryService` over TLS on
//! 127.0.0.1, rooted in a test CA, that checks what istiod checks of a
//! ztunnel (bearer token, node id and metadata on the first request),
//! records every request, and sends the responses a test pushes on the
//! stream that is open.
#![allow(dead_code)]

use std::{
    collections::HashMap,
    net::SocketAddr,
    path::PathBuf,
    pin::Pin,
    sync::{
        Arc, Mutex,
        atomic::{AtomicU64, Ordering},
    },
    time::{Duration, Instant},
};

use futures::{Stream, StreamExt as _, channel::mpsc};
use prost::Message as _;
use rcgen::{CertificateParams, ExtendedKeyUsagePurpose, KeyPair};
use shunt::{
    identity::ca::BuiltinCa,
    state::TrustDomain,
    xds::{ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, XdsConfig, XdsNode},
};
use shunt_proto::{
    envoy::service::discovery::v3::{
        DeltaDiscoveryRequest, DeltaDiscoveryResponse, Resource,
        aggregated_discovery_service_server::{
            AggregatedDiscoveryService, AggregatedDiscoveryServiceServer,
        },
    },
    istio::{security as security_pb, workload as workload_pb},
};
use tonic::{
    Request, Response, Status, Streaming,
    transport::{Identity, Server, ServerTlsConfig, server::TcpIncoming},
};

pub const TOKEN: &str = "node-proxy-token";

/// The agent as the tests name it.
pub fn node() -> XdsNode {
    XdsNode {
        ip: "198.18.0.5".parse().expect("node IP"),
        pod_name: "shunt-x1".into(),
        pod_namespace: "istio-system".into(),
        node_name: "node-a".into(),
        cluster_id: "Kubernetes".into(),
    }
}

/// The agent's arguments that point it at an istiod on `address` as
/// [`node`], with `pki`'s root and token files.
pub fn agent_args(address: &str, pki: &Pki) -> Vec<String> {
    let node = node();
    [
        "--xds-address",
        address,
        "--xds-root-cert",
        &pki.root_file().display().to_string(),
        "--xds-token",
        &pki.token_file().display().to_string(),
        "--instance-ip",
        &node.ip.to_string(),
        "--pod-name",
        &node.pod_name,
        "--pod-namespace",
        &node.pod_namespace,
    ]
    .map(str::to_owned)
    .to_vec()
}

pub const NODE_ID: &str = "ztunnel~198.18.0.5~shunt-x1.istio-system~istio-system.svc.cluster.local";

/// A test root; the root and token files the agent reads.
pub struct Pki {
    pub ca: Arc<BuiltinCa>,
    pub dir: tempfile::TempDir,
}

impl Pki {
    pub fn new() -> Self {
        let (ca, files) = BuiltinCa::generate(&TrustDomain::default()).expect("test root");
        let dir = tempfile::tempdir().expect("tempdir");
        std::fs::write(dir.path().join("root-cert.pem"), &files.root_cert_pem).expect("root");
        // A trailing newline, as `kubectl create token > file` leaves.
        std::fs::write(dir.path().join("token"), format!("{TOKEN}\n")).expect("token");
        Self {
            ca: Arc::new(ca),
            dir,
        }
    }

    pub fn root_file(&self) -> PathBuf {
        self.dir.path().join("root-cert.pem")
    }

    pub fn token_file(&self) -> PathBuf {
        self.dir.path().join("token")
    }

    /// istiod's serving certificate: IP SAN 127.0.0.1, signed by the root.
    pub fn server_identity(&self) -> Identity {
        let key = KeyPair::generate_for(&rcgen::PKCS_ECDSA_P256_SHA256).expect("key");
        let mut params = CertificateParams::new(vec!["127.0.0.1".to_string()]).expect("params");
        params.extended_key_usages = vec![ExtendedKeyUsagePurpose::ServerAuth];
        let der = self.ca.sign_params(&params, &key).expect("server cert");
        let pem = pem::encode(&pem::Pem::new("CERTIFICATE", der.to_vec()));
        Identity::from_pem(pem, key.serialize_pem())
    }

    /// The source's settings against `addr`, with short waits for tests.
    pub fn config(&self, addr: SocketAddr) -> XdsConfig {
        let mut config = XdsConfig::new(
            addr.to_string(),
            self.root_file(),
            self.token_file(),
            node(),
        );
        config.connect_timeout = Duration::from_secs(2);
        config.backoff_initial = Duration::from_millis(50);
        config.backoff_max = Duration::from_millis(400);
        config
    }
}

/// One request as the server received it, with the stream it came on
/// (1 for the first connection).
#[derive(Clone, Debug)]
pub struct Seen {
    pub connection: u64,
    pub request: DeltaDiscoveryRequest,
}

type Outgoing = mpsc::UnboundedSender<Result<DeltaDiscoveryResponse, Status>>;

#[derive(Default)]
struct Shared {
    seen: Mutex<Vec<Seen>>,
    refused: Mutex<Vec<String>>,
    current: Mutex<Option<(u64, Outgoing)>>,
    connections: AtomicU64,
}

struct Ads(Arc<Shared>);

#[tonic::async_trait]
impl AggregatedDiscoveryService for Ads {
    type DeltaAggregatedResourcesStream =
        Pin<Box<dyn Stream<Item = Result<DeltaDiscoveryResponse, Status>> + Send>>;

    async fn delta_aggregated_resources(
        &self,
        request: Request<Streaming<DeltaDiscoveryRequest>>,
    ) -> Result<Response<Self::DeltaAggregatedResourcesStream>, Status> {
        let shared = self.0.clone();
        let authorization = request
            .metadata()
            .get("authorization")
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned);
        if authorization.as_deref() != Some(&format!("Bearer {TOKEN}")) {
            shared.refused.lock().expect("lock").push("token".into());
            return Err(Status::unauthenticated("authentication failure"));
        }
        let connection = shared.connections.fetch_add(1, Ordering::SeqCst) + 1;
        let (tx, rx) = mpsc::unbounded();
        *shared.current.lock().expect("lock") = Some((connection, tx.clone()));
        let mut incoming = request.into_inner();
        tokio::spawn(async move {
            let mut first = true;
            while let Some(Ok(request)) = incoming.next().await {
                if first {
                    first = false;
                    // istiod's checks of a ztunnel's first request.
                    if let Err(why) = check_node(&request) {
                        shared.refused.lock().expect("lock").push(why.clone());
                        let _ = tx.unbounded_send(Err(Status::permission_denied(why)));
                        return;
                    }
                }
                shared.seen.lock().expect("lock").push(Seen {
                    connection,
                    request,
                });
            }
        });
        Ok(Response::new(Box::pin(rx)))
    }
}

fn check_node(request: &DeltaDiscoveryRequest) -> Result<(), String> {
    let node = request
        .node
        .as_ref()
        .ok_or("no node on the first request")?;
    if node.id != NODE_ID {
        return Err(format!("node id {:?}", node.id));
    }
    let metadata = node.metadata.as_ref().ok_or("no node metadata")?;
    let string = |key: &str| match metadata.fields.get(key).and_then(|v| v.kind.as_ref()) {
        Some(prost_types::value::Kind::StringValue(s)) => s.clone(),
        _ => String::new(),
    };
    let expected = [
        ("NAME", "shunt-x1"),
        ("NAMESPACE", "istio-system"),
        ("INSTANCE_IPS", "198.18.0.5"),
        ("NODE_NAME", "node-a"),
        ("CLUSTER_ID", "Kubernetes"),
    ];
    for (key, value) in expected {
        if string(key) != value {
            return Err(format!(
                "metadata {key} = {:?}, expected {value:?}",
                string(key)
            ));
        }
    }
    Ok(())
}

/// A running fake istiod.
pub struct FakeIstiod {
    pub addr: SocketAddr,
    shared: Arc<Shared>,
    task: Option<tokio::task::JoinHandle<()>>,
}

impl Drop for FakeIstiod {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
    }
}

impl FakeIstiod {
    /// Serves on a new loopback port.
    pub async fn start(pki: &Pki) -> Self {
        Self::start_at(pki, "127.0.0.1:0".parse().expect("addr"), Arc::default()).await
    }

    /// Serves on `listener` (e.g. one bound inside a test node's netns,
    /// where the agent under test runs).
    pub fn start_on(pki: &Pki, listener: std::net::TcpListener) -> Self {
        listener.set_nonblocking(true).expect("non-blocking");
        let listener = tokio::net::TcpListener::from_std(listener).expect("tokio listener");
        Self::serve(pki, listener, Arc::default())
    }

    async fn start_at(pki: &Pki, addr: SocketAddr, shared: Arc<Shared>) -> Self {
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .expect("bind loopback");
        Self::serve(pki, listener, shared)
    }

    fn serve(pki: &Pki, listener: tokio::net::TcpListener, shared: Arc<Shared>) -> Self {
        let addr = listener.local_addr().expect("local addr");
        let server = Server::builder()
            .tls_config(ServerTlsConfig::new().identity(pki.server_identity()))
            .expect("server TLS")
            .add_service(AggregatedDiscoveryServiceServer::new(Ads(shared.clone())));
        let task = tokio::spawn(async move {
            if let Err(e) = server
                .serve_with_incoming(TcpIncoming::from(listener))
                .await
            {
                eprintln!("fake istiod stopped: {e}");
            }
        });
        Self {
            addr,
            shared,
            task: Some(task),
        }
    }

    /// Goes away: stops listening and breaks the open stream.
    pub fn stop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        self.disconnect();
    }

    /// Comes back on the same address, with the same record.
    pub async fn restart(&mut self, pki: &Pki) {
        let again = Self::start_at(pki, self.addr, self.shared.clone()).await;
        self.task = again.task_handle();
    }

    fn task_handle(mut self) -> Option<tokio::task::JoinHandle<()>> {
        self.task.take()
    }

    /// Ends the open stream as an istiod restart would (UNAVAILABLE).
    pub fn disconnect(&self) {
        if let Some((_, tx)) = self.shared.current.lock().expect("lock").take() {
            let _ = tx.unbounded_send(Err(Status::unavailable("istiod is restarting")));
        }
    }

    /// Streams opened with a valid token.
    pub fn connections(&self) -> u64 {
        self.shared.connections.load(Ordering::SeqCst)
    }

    pub fn seen(&self) -> Vec<Seen> {
        self.shared.seen.lock().expect("lock").clone()
    }

    pub fn refused(&self) -> Vec<String> {
        self.shared.refused.lock().expect("lock").clone()
    }

    /// Sends `response` on the open stream.
    pub fn push(&self, response: DeltaDiscoveryResponse) {
        let current = self.shared.current.lock().expect("lock");
        let (_, tx) = current.as_ref().expect("a stream is open");
        tx.unbounded_send(Ok(response)).expect("stream open");
    }

    /// Waits (bounded) for a request answering `nonce`.
    pub async fn answer_to(&self, nonce: &str) -> DeltaDiscoveryRequest {
        wait_for(&format!("an answer to nonce {nonce}"), || {
            self.seen()
                .into_iter()
                .find(|s| s.request.response_nonce == nonce)
                .map(|s| s.request)
        })
        .await
    }

    /// Waits (bounded) for the initial requests of stream `connection`, one
    /// per type, keyed by type URL.
    pub async fn initial_requests(
        &self,
        connection: u64,
    ) -> HashMap<String, DeltaDiscoveryRequest> {
        wait_for(
            &format!("both initial requests on stream {connection}"),
            || {
                let initial: HashMap<String, DeltaDiscoveryRequest> = self
                    .seen()
                    .into_iter()
                    .filter(|s| s.connection == connection && s.request.response_nonce.is_empty())
                    .map(|s| (s.request.type_url.clone(), s.request))
                    .collect();
                (initial.len() == 2).then_some(initial)
            },
        )
        .await
    }
}

/// Polls `check` until it yields, for at most 10 s.
pub async fn wait_for<T>(what: &str, mut check: impl FnMut() -> Option<T>) -> T {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        if let Some(value) = check() {
            return value;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

// --- Resources, as istiod encodes them ---

pub fn any_resource(name: &str, version: &str, type_url: &str, value: Vec<u8>) -> Resource {
    Resource {
        name: name.into(),
        version: version.into(),
        resource: Some(prost_types::Any {
            type_url: type_url.into(),
            value,
        }),
        ..Default::default()
    }
}

/// A workload resource named by its uid, as istiod names them.
pub fn workload(w: workload_pb::Workload, version: &str) -> Resource {
    let name = w.uid.clone();
    let address = workload_pb::Address {
        r#type: Some(workload_pb::address::Type::Workload(w)),
    };
    any_resource(&name, version, ADDRESS_TYPE_URL, address.encode_to_vec())
}

/// A service resource named `namespace/hostname`.
pub fn service(s: workload_pb::Service, version: &str) -> Resource {
    let name = format!("{}/{}", s.namespace, s.hostname);
    let address = workload_pb::Address {
        r#type: Some(workload_pb::address::Type::Service(s)),
    };
    any_resource(&name, version, ADDRESS_TYPE_URL, address.encode_to_vec())
}

/// A policy resource named `namespace/name`.
pub fn policy(p: security_pb::Authorization, version: &str) -> Resource {
    let name = format!("{}/{}", p.namespace, p.name);
    any_resource(&name, version, AUTHORIZATION_TYPE_URL, p.encode_to_vec())
}

pub fn response(
    type_url: &str,
    nonce: &str,
    resources: Vec<Resource>,
    removed: &[&str],
) -> DeltaDiscoveryResponse {
    DeltaDiscoveryResponse {
        system_version_info: format!("v-{nonce}"),
        type_url: type_url.into(),
        nonce: nonce.into(),
        resources,
        removed_resources: removed.iter().map(|s| s.to_string()).collect(),
    }
}

/// A pod workload: `uid` is `Kubernetes//Pod/<ns>/<name>`.
pub fn pod(ns: &str, name: &str, ip: [u8; 4], node: &str) -> workload_pb::Workload {
    workload_pb::Workload {
        uid: format!("Kubernetes//Pod/{ns}/{name}"),
        name: name.into(),
        namespace: ns.into(),
        addresses: vec![ip.to_vec()],
        tunnel_protocol: workload_pb::TunnelProtocol::Hbone as i32,
        service_account: "default".into(),
        node: node.into(),
        cluster_id: "Kubernetes".into(),
        workload_type: workload_pb::WorkloadType::Pod as i32,
        ..Default::default()
    }
}

/// The `web` service's key (`namespace/hostname`), as istiod names it.
pub const WEB: &str = "default/web.default.svc.cluster.local";

/// A pod workload backing `web` on port 80 (target port 0: the service's
/// own), running as `service_account`, healthy or not.
pub fn web_backend(
    name: &str,
    ip: [u8; 4],
    node: &str,
    service_account: &str,
    healthy: bool,
) -> workload_pb::Workload {
    let mut w = pod("default", name, ip, node);
    w.service_account = service_account.into();
    w.services.insert(
        WEB.into(),
        workload_pb::PortList {
            ports: vec![workload_pb::Port {
                service_port: 80,
                target_port: 0,
                ..Default::default()
            }],
        },
    );
    if !healthy {
        w.status = workload_pb::WorkloadStatus::Unhealthy as i32;
    }
    w
}

/// The `web` service ([`WEB`]) at `vip`: port 80 to target port 8080.
pub fn web_service(vip: [u8; 4]) -> workload_pb::Service {
    workload_pb::Service {
        name: "web".into(),
        namespace: "default".into(),
        hostname: "web.default.svc.cluster.local".into(),
        addresses: vec![workload_pb::NetworkAddress {
            network: String::new(),
            address: vip.to_vec(),
            ..Default::default()
        }],
        ports: vec![workload_pb::Port {
            service_port: 80,
            target_port: 8080,
            ..Default::default()
        }],
        ..Default::default()
    }
}

/// A policy `name` in namespace `default` with one rule: exactly
/// `principal`, and one of `ports` when any are given.
pub fn principal_policy(
    name: &str,
    scope: security_pb::Scope,
    action: security_pb::Action,
    principal: &str,
    ports: &[u32],
) -> security_pb::Authorization {
    security_pb::Authorization {
        name: name.into(),
        namespace: "default".into(),
        scope: scope as i32,
        action: action as i32,
        rules: vec![security_pb::Rule {
            clauses: vec![security_pb::Clause {
                matches: vec![security_pb::Match {
                    principals: vec![security_pb::StringMatch {
                        match_type: Some(security_pb::string_match::MatchType::Exact(
                            principal.into(),
                        )),
                    }],
                    destination_ports: ports.to_vec(),
                    ..Default::default()
                }],
            }],
        }],
        dry_run: false,
        ..Default::default()
    }
}

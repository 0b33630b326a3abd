//! The Kubernetes sources in bulk, against an in-test API server
//! (`support/fake_apiserver.rs`) with the real kube-rs client and watcher,
//! but without the kernel: a redirector that only records, so what is
//! measured is the control loop (debouncing a burst of 1,000 pod events)
//! and the cluster-wide views (every pod's IP and identity, services and
//! EndpointSlices). The kernel-backed tests are in `kube_watch.rs`.
//!
//! Every wait is bounded; the API server listens on 127.0.0.1 only.

// By path, not through `support/mod.rs`: other test files share `support/`
// with modules of their own.
#[path = "support/captured_logs.rs"]
mod captured_logs;
#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;
#[path = "support/kube_agent.rs"]
mod kube_agent;
#[path = "support/kube_harness.rs"]
mod kube_harness;

use std::{
    collections::BTreeMap,
    path::PathBuf,
    sync::{Arc, RwLock},
    time::{Duration, Instant},
};

use fake_apiserver::{FakeApiServer, Kind, endpoint_slice, namespace, pod, service};
use kube_agent::Agent;
use kube_harness::{cluster_store, wait_for};
use serde_json::{Value, json};
use shunt::{
    agent::NodeAgent,
    control::kube::{ClusterWorkloads, KubeOptions, KubeSource, MapResolver},
    redirect::{
        Capture, EnrolledPod, OriginalDst, OriginalDstError, PodTarget, RedirectError,
        RedirectMode, Redirector, Verification,
    },
    state::{PodState, TrustDomain, WorkloadKey},
    store::WorkloadStore,
};

const NODE: &str = "node-a";
/// Upper bound for anything the agent should do after a change.
const TIMEOUT: Duration = Duration::from_secs(20);

fn init_logging() {
    captured_logs::init_logging("info,shunt=debug,kube=info");
}

fn ambient() -> Value {
    json!({"istio.io/dataplane-mode": "ambient"})
}

fn opt_out() -> Value {
    json!({"istio.io/dataplane-mode": "none"})
}

/// A redirector that only records (for measuring the control loop alone).
#[derive(Default)]
struct RecordingRedirector {
    enrolled: BTreeMap<WorkloadKey, PathBuf>,
    enrols: Arc<std::sync::atomic::AtomicU64>,
}

impl Redirector for RecordingRedirector {
    fn mode(&self) -> RedirectMode {
        RedirectMode::Ebpf
    }

    fn enrol(&mut self, pod: &PodTarget) -> Result<(), RedirectError> {
        self.enrols
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        self.enrolled.insert(pod.key.clone(), pod.netns.clone());
        Ok(())
    }

    fn unenrol(&mut self, pod: &WorkloadKey) -> Result<(), RedirectError> {
        self.enrolled
            .remove(pod)
            .map(drop)
            .ok_or_else(|| RedirectError::NotEnrolled(pod.clone()))
    }

    fn verify(&self, _pod: &WorkloadKey) -> Result<Verification, RedirectError> {
        Ok(Verification::Redirected)
    }

    fn inspect(&self, pod: &WorkloadKey) -> Option<EnrolledPod> {
        let (key, netns) = self.enrolled.get_key_value(pod)?;
        Some(EnrolledPod {
            key: key.clone(),
            netns: netns.clone(),
            netns_cookie: 0,
            mode: RedirectMode::Ebpf,
            hooks: Vec::new(),
            counters: Default::default(),
        })
    }

    fn list(&self) -> Vec<EnrolledPod> {
        self.enrolled
            .iter()
            .map(|(key, netns)| EnrolledPod {
                key: key.clone(),
                netns: netns.clone(),
                netns_cookie: 0,
                mode: RedirectMode::Ebpf,
                hooks: Vec::new(),
                counters: Default::default(),
            })
            .collect()
    }

    fn is_enrolled(&self, pod: &WorkloadKey) -> bool {
        self.enrolled.contains_key(pod)
    }

    fn remove_stale(&mut self) -> usize {
        0
    }

    fn original_dst_resolver(&self) -> Arc<dyn OriginalDst> {
        Arc::new(NoOriginalDst)
    }
}

struct NoOriginalDst;

impl OriginalDst for NoOriginalDst {
    fn original_dst(
        &self,
        accepted: &std::net::TcpStream,
    ) -> Result<std::net::SocketAddr, OriginalDstError> {
        Err(OriginalDstError::NotRedirected {
            peer: accepted.peer_addr()?,
        })
    }
}

fn rss_kib() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("VmRSS:"))
                .and_then(|l| l.split_whitespace().nth(1))
                .and_then(|v| v.parse().ok())
        })
        .unwrap_or(0)
}

/// 1000 pods appear at once: a handful of reconciles (debounced), not 1000;
/// prints the time until all are enrolled and annotated, and the RSS.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn burst_of_1000_pod_events_is_debounced() {
    init_logging();
    const PODS: usize = 1000;
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    // The recording redirector never opens the path; it must only exist.
    let netns: PathBuf = dir.path().join("netns");
    std::fs::write(&netns, "").expect("write");
    let resolver = MapResolver::new();
    server.apply(Kind::Namespace, namespace("burst", ambient()));
    let redirector = RecordingRedirector::default();
    let enrols = redirector.enrols.clone();
    let agent = NodeAgent::new(
        NODE.into(),
        TrustDomain::default(),
        Box::new(redirector),
        Capture::default(),
    );
    let source = KubeSource::new(
        server.client(dir.path()).await,
        KubeOptions::new(NODE),
        Arc::new(resolver.clone()),
    );
    let agent = Agent::start(agent, source, Duration::from_secs(10));
    let stats = agent.stats.clone();
    wait_for("watches open", TIMEOUT, || server.open_watches() >= 2).await;
    let rss_before = rss_kib();

    let start = Instant::now();
    for i in 0..PODS {
        let name = format!("p{i:04}");
        // Distinct netns paths: one netns per pod.
        let path = dir.path().join(&name);
        std::fs::write(&path, "").expect("write");
        resolver.insert(WorkloadKey::new("burst", &name), path);
        let ip = format!("198.18.{}.{}", 10 + i / 250, 1 + i % 250);
        server.apply(Kind::Pod, pod("burst", &name, NODE, Some(&ip), json!({})));
    }
    let all_enrolled = |agent: &Agent| {
        let states = agent.snapshots.borrow().pod_states();
        states.len() == PODS && states.values().all(|s| *s == PodState::Enrolled)
    };
    wait_for("1000 pods enrolled", Duration::from_secs(60), || {
        all_enrolled(&agent)
    })
    .await;
    let enrolled_after = start.elapsed();
    wait_for("1000 pods annotated", Duration::from_secs(120), || {
        stats.patches.load(std::sync::atomic::Ordering::Relaxed) >= PODS as u64
    })
    .await;
    let annotated_after = start.elapsed();
    let reconciles = stats.reconciles.load(std::sync::atomic::Ordering::Relaxed);
    let rss_after = rss_kib();
    println!(
        "burst of {PODS} pod events: all enrolled after {enrolled_after:?}, all annotated after {annotated_after:?}; {reconciles} reconciles, {} enrol calls; test process RSS {rss_before} KiB before, {rss_after} KiB after",
        enrols.load(std::sync::atomic::Ordering::Relaxed)
    );
    assert!(
        reconciles <= 50,
        "{reconciles} reconciles for {PODS} events: not debounced"
    );
    // Once settled, the annotations' own MODIFIED events cause no reconcile:
    // a change the watch delivers after all of them makes exactly one.
    let settled = stats.reconciles.load(std::sync::atomic::Ordering::Relaxed);
    server.update(Kind::Pod, "burst", "p0000", |pod| {
        pod["metadata"]["annotations"]["shunt.io/splice"] = json!("off")
    });
    wait_for("the marker change reconciled", TIMEOUT, || {
        stats.reconciles.load(std::sync::atomic::Ordering::Relaxed) > settled
    })
    .await;
    assert_eq!(
        stats.reconciles.load(std::sync::atomic::Ordering::Relaxed),
        settled + 1,
        "the annotations' MODIFIED events were reconciled"
    );
    assert_eq!(server.patches().len(), PODS, "exactly one patch per pod");
    agent.stop(false).await;
}

/// Cluster-wide discovery: every pod with an IP, on any node, with its
/// identity, in a `WorkloadStore` snapshot that follows changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_workloads_track_every_pods_ip_and_identity() {
    init_logging();
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.apply(Kind::Namespace, namespace("shop", ambient()));
    server.apply(
        Kind::Pod,
        pod("shop", "a", "node-a", Some("198.18.1.10"), json!({})),
    );
    server.apply(
        Kind::Pod,
        pod("shop", "b", "node-b", Some("198.18.2.10"), opt_out()),
    );
    server.apply(Kind::Pod, pod("shop", "unscheduled", "", None, json!({})));
    let discovery = ClusterWorkloads::new(server.client(dir.path()).await);
    let (store, sink) = cluster_store();
    let task = tokio::spawn(discovery.run(sink));
    let ip = |s: &str| s.parse::<std::net::IpAddr>().expect("ip");
    wait_for("both pods discovered", TIMEOUT, || read(&store).len() == 2).await;
    {
        let store = read(&store);
        let a = store.by_ip(ip("198.18.1.10")).expect("a by IP");
        assert_eq!((a.name.as_str(), a.node.as_str()), ("a", "node-a"));
        assert!(a.wants_mesh());
        assert_eq!(
            a.identity(&TrustDomain::default()).as_str(),
            "spiffe://cluster.local/ns/shop/sa/sleep"
        );
        let b = store.by_ip(ip("198.18.2.10")).expect("b by IP");
        assert!(!b.wants_mesh(), "b opted out");
    }
    server.delete(Kind::Pod, "shop", "a");
    wait_for("a gone from discovery", TIMEOUT, || {
        read(&store).by_ip(ip("198.18.1.10")).is_none()
    })
    .await;
    task.abort();
}

/// Service discovery: a Service and its EndpointSlice from the watch land in
/// the store, looked up by VIP and port, the named target port resolved from
/// the slice; a headless service and a malformed one are skipped without
/// stopping the others; a relist after `410 Gone` picks up what changed; and
/// deleting the slice, then the service, removes them.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn cluster_services_follow_services_and_endpointslices() {
    init_logging();
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.apply(Kind::Namespace, namespace("shop", ambient()));
    server.apply(
        Kind::Pod,
        pod("shop", "web-0", "node-b", Some("198.18.2.10"), json!({})),
    );
    server.apply(Kind::Service, service("shop", "web", "198.19.100.1"));
    server.apply(
        Kind::EndpointSlice,
        endpoint_slice(
            "shop",
            "web-abc",
            "web",
            8080,
            &[
                ("198.18.2.10", true, "web-0"),
                ("198.18.2.11", false, "web-1"),
            ],
        ),
    );
    let mut headless = service("shop", "headless", "None");
    headless["spec"]["clusterIPs"] = json!(["None"]);
    server.apply(Kind::Service, headless);
    let mut malformed = service("shop", "broken", "198.19.100.9");
    malformed["spec"]["ports"] = json!("not a list");
    server.apply(Kind::Service, malformed);

    let discovery = ClusterWorkloads::new(server.client(dir.path()).await);
    let (store, sink) = cluster_store();
    let task = tokio::spawn(discovery.run(sink));
    let addr = |s: &str| s.parse::<std::net::SocketAddr>().expect("addr");
    wait_for("service web discovered", TIMEOUT, || {
        read(&store)
            .services()
            .by_addr(addr("198.19.100.1:80"))
            .is_some()
    })
    .await;
    {
        let store = read(&store);
        assert_eq!(store.services().len(), 1, "headless and malformed skipped");
        let web = store
            .services()
            .by_addr(addr("198.19.100.1:80"))
            .expect("web");
        assert_eq!((web.namespace.as_str(), web.name.as_str()), ("shop", "web"));
        let targets: Vec<_> = web
            .ready_targets(addr("198.19.100.1:80"))
            .into_iter()
            .map(|(endpoint, target)| (target, endpoint.pod.as_ref().map(ToString::to_string)))
            .collect();
        assert_eq!(
            targets,
            [(addr("198.18.2.10:8080"), Some("shop/web-0".to_owned()))],
            "the ready endpoint only, at the port the slice names"
        );
        assert_eq!(web.endpoints.len(), 2);
        // The endpoint is a mesh workload: the proxy will use HBONE.
        assert!(
            store
                .by_ip("198.18.2.10".parse().expect("ip"))
                .is_some_and(|w| w.wants_mesh())
        );
    }

    // The watch falls behind (410 on resume): the relist brings the change.
    server.compact();
    server.drop_watches();
    server.update(Kind::EndpointSlice, "shop", "web-abc", |slice| {
        slice["endpoints"][1]["conditions"]["ready"] = json!(true);
    });
    wait_for("second endpoint ready after the relist", TIMEOUT, || {
        read(&store)
            .services()
            .by_addr(addr("198.19.100.1:80"))
            .is_some_and(|web| web.ready_targets(addr("198.19.100.1:80")).len() == 2)
    })
    .await;

    server.delete(Kind::EndpointSlice, "shop", "web-abc");
    wait_for("endpoints gone with their slice", TIMEOUT, || {
        read(&store)
            .services()
            .by_addr(addr("198.19.100.1:80"))
            .is_some_and(|web| web.endpoints.is_empty())
    })
    .await;
    server.delete(Kind::Service, "shop", "web");
    wait_for("service gone", TIMEOUT, || {
        read(&store).services().is_empty()
    })
    .await;
    assert_eq!(
        read(&store).len(),
        1,
        "the pod is still known: services and pods are separate"
    );
    task.abort();
}

fn read(store: &RwLock<WorkloadStore>) -> std::sync::RwLockReadGuard<'_, WorkloadStore> {
    store.read().unwrap_or_else(|p| p.into_inner())
}

//! Waypoints without istiod, from the Kubernetes API (the standalone kube
//! mode's cluster discovery), against the in-test API server
//! (`support/fake_apiserver.rs`) with the real kube-rs client and watcher,
//! the agent's own sink and store owner: what lands in the workload store
//! is what the proxy routes by.
//!
//! - A namespace labelled `istio.io/use-waypoint` and its waypoint Gateway
//!   (class `istio-waypoint`): the namespace's service and pod get the
//!   waypoint as istiod describes it (hostname `<gw>.<ns>.svc.cluster.local`,
//!   port 15008); a pod labelled `none` opts out; the waypoint's own service
//!   and pods get none; relabelling the Gateway's `istio.io/waypoint-for`
//!   and deleting it take the waypoint away (the dangling binding named in
//!   the log).
//! - The Gateway API not installed (404): discovery goes on, nothing gets
//!   a waypoint, the absence is said once; once the CRD is served with the
//!   Gateway, the waypoint applies.
//!
//! Every wait is bounded; the API server listens on 127.0.0.1 only.

#[path = "support/fake_apiserver.rs"]
mod fake_apiserver;

#[path = "support/captured_logs.rs"]
mod captured_logs;

#[path = "support/kube_harness.rs"]
mod kube_harness;

use std::{
    net::{IpAddr, SocketAddr},
    sync::RwLock,
    time::Duration,
};

use captured_logs::log_lines_with;
use fake_apiserver::{FakeApiServer, Kind, endpoint_slice, gateway, namespace, pod, service};
use kube_harness::{cluster_store, wait_for};
use serde_json::json;
use shunt::{
    control::kube::ClusterWorkloads,
    state::{GatewayAddress, GatewayDestination},
    store::WorkloadStore,
};

/// Upper bound for anything the agent should do after a change.
const TIMEOUT: Duration = Duration::from_secs(20);
const GATEWAYS_PATH: &str = "/apis/gateway.networking.k8s.io/v1/gateways";

fn init_logging() {
    captured_logs::init_logging("info,shunt=debug");
}

/// The waypoint istiod gives for Gateway `namespace/name`.
fn waypoint(namespace: &str, name: &str) -> Option<GatewayAddress> {
    Some(GatewayAddress {
        destination: GatewayDestination::Hostname {
            namespace: namespace.into(),
            hostname: format!("{name}.{namespace}.svc.cluster.local"),
        },
        hbone_mtls_port: 15008,
    })
}

/// What the store says: the waypoint of the service at `vip:80`, `None`
/// while that service is not in the store.
fn service_waypoint(store: &RwLock<WorkloadStore>, vip: &str) -> Option<Option<GatewayAddress>> {
    let addr: SocketAddr = format!("{vip}:80").parse().expect("addr");
    let store = store.read().unwrap_or_else(|p| p.into_inner());
    Some(store.services().by_addr(addr)?.waypoint.clone())
}

/// The waypoint of the workload with `ip`, `None` while it is not in the
/// store.
fn pod_waypoint(store: &RwLock<WorkloadStore>, ip: &str) -> Option<Option<GatewayAddress>> {
    let ip: IpAddr = ip.parse().expect("ip");
    let store = store.read().unwrap_or_else(|p| p.into_inner());
    Some(store.by_ip(ip)?.waypoint.clone())
}

const MANAGED: &str = "istio.io-mesh-controller";

/// Namespace `shop` bound to waypoint `shop/wp`: its service and pods get
/// it; a pod labelled `none` and the waypoint's own service and pods do
/// not; `istio.io/waypoint-for` and the Gateway's deletion are followed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespace_bound_to_a_waypoint_gateway_routes_its_service_through_it() {
    init_logging();
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.apply(
        Kind::Namespace,
        namespace(
            "shop",
            json!({"istio.io/dataplane-mode": "ambient", "istio.io/use-waypoint": "wp"}),
        ),
    );
    server.apply(
        Kind::Gateway,
        gateway(
            "shop",
            "wp",
            "istio-waypoint",
            json!({"istio.io/waypoint-for": "all"}),
        ),
    );
    // A Gateway of another class is no waypoint.
    server.apply(
        Kind::Gateway,
        gateway("shop", "ingress", "istio", json!(null)),
    );
    server.apply(Kind::Service, service("shop", "web", "198.19.100.1"));
    server.apply(
        Kind::EndpointSlice,
        endpoint_slice(
            "shop",
            "web-1",
            "web",
            8080,
            &[("198.18.1.10", true, "client")],
        ),
    );
    let mut own = service("shop", "wp", "198.19.100.9");
    own["metadata"]["labels"] = json!({"gateway.istio.io/managed": MANAGED});
    server.apply(Kind::Service, own);
    let mut ingress_bound = service("shop", "shop-front", "198.19.100.2");
    ingress_bound["metadata"]["labels"] = json!({"istio.io/use-waypoint": "ingress"});
    server.apply(Kind::Service, ingress_bound);
    server.apply(
        Kind::Pod,
        pod("shop", "client", "node-a", Some("198.18.1.10"), json!({})),
    );
    server.apply(
        Kind::Pod,
        pod(
            "shop",
            "opted-out",
            "node-a",
            Some("198.18.1.11"),
            json!({"istio.io/use-waypoint": "none"}),
        ),
    );
    server.apply(
        Kind::Pod,
        pod(
            "shop",
            "wp-0",
            "node-b",
            Some("198.18.1.12"),
            json!({"gateway.istio.io/managed": MANAGED,
                   "gateway.networking.k8s.io/gateway-name": "wp"}),
        ),
    );

    let discovery = ClusterWorkloads::new(server.client(dir.path()).await);
    let (store, sink) = cluster_store();
    let task = tokio::spawn(discovery.run(sink));

    wait_for("service web with the waypoint", TIMEOUT, || {
        service_waypoint(&store, "198.19.100.1") == Some(waypoint("shop", "wp"))
    })
    .await;
    wait_for("every pod discovered", TIMEOUT, || {
        store.read().unwrap_or_else(|p| p.into_inner()).len() == 3
    })
    .await;
    assert_eq!(
        pod_waypoint(&store, "198.18.1.10"),
        Some(waypoint("shop", "wp")),
        "the namespace's pod: the waypoint serves workloads too (all)"
    );
    assert_eq!(
        pod_waypoint(&store, "198.18.1.11"),
        Some(None),
        "none on the pod opts out"
    );
    assert_eq!(
        pod_waypoint(&store, "198.18.1.12"),
        Some(None),
        "the waypoint's own pod"
    );
    assert_eq!(
        service_waypoint(&store, "198.19.100.9"),
        Some(None),
        "the waypoint's own service"
    );
    assert_eq!(
        service_waypoint(&store, "198.19.100.2"),
        Some(None),
        "bound to a Gateway that is not a waypoint"
    );
    let not_waypoint =
        log_lines_with(&["service shop/shop-front is bound to waypoint shop/ingress"]);
    assert_eq!(not_waypoint.len(), 1, "said once: {not_waypoint:#?}");

    // For services only: the pod loses it, the service keeps it.
    server.update(Kind::Gateway, "shop", "wp", |g| {
        g["metadata"]["labels"]["istio.io/waypoint-for"] = json!("service");
    });
    wait_for("the pod without the waypoint", TIMEOUT, || {
        pod_waypoint(&store, "198.18.1.10") == Some(None)
    })
    .await;
    assert_eq!(
        service_waypoint(&store, "198.19.100.1"),
        Some(waypoint("shop", "wp"))
    );

    // The pod binds itself too (its own label), then the Gateway serves
    // workloads only: the pod has it again, the service (bound by its
    // namespace) no longer.
    server.update(Kind::Pod, "shop", "client", |p| {
        p["metadata"]["labels"] = json!({"istio.io/use-waypoint": "wp"});
    });
    server.update(Kind::Gateway, "shop", "wp", |g| {
        g["metadata"]["labels"]["istio.io/waypoint-for"] = json!("workload");
    });
    wait_for("the service without the waypoint", TIMEOUT, || {
        service_waypoint(&store, "198.19.100.1") == Some(None)
    })
    .await;
    wait_for("the pod with the waypoint again", TIMEOUT, || {
        pod_waypoint(&store, "198.18.1.10") == Some(waypoint("shop", "wp"))
    })
    .await;

    // Deleted: nothing is sent to it any more, and the dangling binding
    // is named.
    server.delete(Kind::Gateway, "shop", "wp");
    wait_for(
        "the pod without the waypoint once it is gone",
        TIMEOUT,
        || pod_waypoint(&store, "198.18.1.10") == Some(None),
    )
    .await;
    assert_eq!(service_waypoint(&store, "198.19.100.1"), Some(None));
    wait_for("the dangling binding named", TIMEOUT, || {
        !log_lines_with(&[
            "pod shop/client is bound to waypoint shop/wp",
            "no waypoint Gateway shop/wp",
        ])
        .is_empty()
    })
    .await;
    task.abort();
}

/// The Gateway API not installed: discovery goes on without waypoints and
/// says so once; once the CRD is served, the waypoint applies.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_the_gateway_crd_nothing_gets_a_waypoint_until_it_is_installed() {
    init_logging();
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.set_served(Kind::Gateway, false);
    server.apply(
        Kind::Namespace,
        namespace("store", json!({"istio.io/use-waypoint": "store-wp"})),
    );
    server.apply(Kind::Service, service("store", "web", "198.19.101.1"));
    server.apply(
        Kind::Pod,
        pod("store", "web-0", "node-b", Some("198.18.2.10"), json!({})),
    );
    let discovery = ClusterWorkloads::new(server.client(dir.path()).await);
    let (store, sink) = cluster_store();
    let task = tokio::spawn(discovery.run(sink));

    wait_for("the service discovered without the CRD", TIMEOUT, || {
        service_waypoint(&store, "198.19.101.1").is_some()
    })
    .await;
    let list_attempts = || {
        server
            .requests()
            .iter()
            .filter(|r| r.path == GATEWAYS_PATH)
            .count()
    };
    wait_for("the Gateway list retried twice", TIMEOUT, || {
        list_attempts() >= 3
    })
    .await;
    assert_eq!(service_waypoint(&store, "198.19.101.1"), Some(None));
    assert_eq!(pod_waypoint(&store, "198.18.2.10"), Some(None));
    let absent = log_lines_with(&["Gateway API CRD", "is not installed"]);
    assert_eq!(
        absent.len(),
        1,
        "said once over {} attempts: {absent:#?}",
        list_attempts()
    );

    server.set_served(Kind::Gateway, true);
    server.apply(
        Kind::Gateway,
        gateway("store", "store-wp", "istio-waypoint", json!(null)),
    );
    wait_for(
        "the waypoint applied once the CRD is served",
        TIMEOUT,
        || service_waypoint(&store, "198.19.101.1") == Some(waypoint("store", "store-wp")),
    )
    .await;
    assert_eq!(
        pod_waypoint(&store, "198.18.2.10"),
        Some(None),
        "waypoint-for defaults to service"
    );
    assert_eq!(
        log_lines_with(&["gateways.gateway.networking.k8s.io is served now"]).len(),
        1
    );
    task.abort();
}

/// `--auto-allow-waypoint-policy on` (istiod's
/// PILOT_AUTO_ALLOW_WAYPOINT_POLICY): the pods a waypoint serves get an
/// ALLOW policy for the waypoint pods' identity, named as istiod names it;
/// a client that skips the waypoint is refused, the waypoint is allowed.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_implicit_allow_from_waypoint_policy_admits_the_waypoint_only() {
    init_logging();
    let server = FakeApiServer::start().await;
    let dir = tempfile::tempdir().expect("temp dir");
    server.apply(
        Kind::Namespace,
        namespace(
            "shop",
            json!({"istio.io/dataplane-mode": "ambient", "istio.io/use-waypoint": "wp"}),
        ),
    );
    server.apply(
        Kind::Gateway,
        gateway(
            "shop",
            "wp",
            "istio-waypoint",
            json!({"istio.io/waypoint-for": "all"}),
        ),
    );
    server.apply(Kind::Service, service("shop", "web", "198.19.100.1"));
    server.apply(
        Kind::Pod,
        pod("shop", "web-0", "node-a", Some("198.18.1.10"), json!({})),
    );
    let mut waypoint_pod = pod(
        "shop",
        "wp-0",
        "node-b",
        Some("198.18.1.12"),
        json!({"gateway.istio.io/managed": MANAGED,
               "gateway.networking.k8s.io/gateway-name": "wp"}),
    );
    waypoint_pod["spec"]["serviceAccountName"] = json!("wp");
    server.apply(Kind::Pod, waypoint_pod);

    let trust_domain = shunt::state::TrustDomain::new("example.org").expect("trust domain");
    let discovery = ClusterWorkloads::new(server.client(dir.path()).await)
        .with_waypoint_allow(Some(trust_domain));
    let (store, sink) = cluster_store();
    let task = tokio::spawn(discovery.run(sink));

    let policy = "shop/istio_allow_waypoint_shop_wp";
    wait_for(
        "the pod bound to the waypoint names its policy",
        TIMEOUT,
        || {
            store
                .read()
                .unwrap_or_else(|p| p.into_inner())
                .by_ip(ip("198.18.1.10"))
                .is_some_and(|w| w.authorization_policies == vec![policy.to_owned()])
        },
    )
    .await;
    let store = store.read().unwrap_or_else(|p| p.into_inner());
    let web = store.by_ip(ip("198.18.1.10")).expect("web-0");
    let check = |identity: &str| {
        let connection = shunt::authz::Connection {
            src_ip: ip("198.18.1.99"),
            src_identity: Some(identity),
            dst: "198.18.1.10:8080".parse().expect("addr"),
        };
        store
            .policies()
            .check(&connection, shunt::authz::Destination::of(web))
    };
    assert!(
        check("spiffe://example.org/ns/shop/sa/wp").is_allowed(),
        "the waypoint's identity"
    );
    let skipped = check("spiffe://example.org/ns/shop/sa/sleep");
    assert!(
        !skipped.is_allowed(),
        "a client skipping the waypoint: {skipped}"
    );
    let waypoint_itself = store.by_ip(ip("198.18.1.12")).expect("wp-0");
    assert!(
        waypoint_itself.authorization_policies.is_empty(),
        "the waypoint's own pod is not served by itself"
    );
    drop(store);
    task.abort();
}

fn ip(s: &str) -> IpAddr {
    s.parse().expect("test IP")
}

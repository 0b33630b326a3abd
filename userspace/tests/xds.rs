//! The istiod discovery source against an in-test istiod: real gRPC
//! (`DeltaAggregatedResources`) over real TLS on 127.0.0.1, the server
//! checking token and node id as istiod does.
//!
//! What a user would see: what lands in the cluster view the agent uses
//! (workloads with their identities, services with their endpoints,
//! policies), readiness, and what the agent tells istiod (ACK / NACK with a
//! reason) and `/config_dump` (status).

#[path = "support/fake_istiod.rs"]
mod fake_istiod;
#[path = "support/xds_cases.rs"]
mod xds_cases;

use std::{
    collections::HashMap,
    net::SocketAddr,
    sync::{Arc, Mutex},
};

use fake_istiod::{
    FakeIstiod, NODE_ID, Pki, any_resource, pod, policy, principal_policy, response, service,
    wait_for, web_backend, web_service, workload,
};
use shunt::{
    authz::{Action, PolicyKey, Scope},
    control::{ClusterDelta, ClusterView, NodePods, SourceSink},
    state::{TrustDomain, TunnelProtocol, WorkloadStatus},
    xds::{
        ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL, XdsConfig, XdsMetrics, XdsSource, XdsStatus,
        XdsStatusHandle,
    },
};
use shunt_proto::istio::{security as security_pb, workload as workload_pb};

/// Records what the source publishes, as the agent's sink would receive it.
#[derive(Default)]
struct Recorder {
    views: Mutex<Vec<ClusterView>>,
    synced: Mutex<Vec<&'static str>>,
}

impl SourceSink for Recorder {
    fn node_pods(&self, _pods: NodePods) {
        panic!("the xDS source publishes no node pods");
    }

    fn cluster(&self, view: ClusterView) {
        self.views.lock().expect("lock").push(view);
    }

    /// The view the store would hold after it: the last one with the
    /// delta applied.
    fn cluster_delta(&self, delta: ClusterDelta) {
        let mut views = self.views.lock().expect("lock");
        let last = views
            .last()
            .cloned()
            .expect("a delta only after a complete view");
        views.push(last.with_delta(delta));
    }

    fn synced(&self, source: &'static str) {
        self.synced.lock().expect("lock").push(source);
    }
}

impl Recorder {
    fn published(&self) -> usize {
        self.views.lock().expect("lock").len()
    }

    fn last(&self) -> Option<ClusterView> {
        self.views.lock().expect("lock").last().cloned()
    }

    fn is_synced(&self) -> bool {
        self.synced.lock().expect("lock").contains(&"xds")
    }

    /// Waits for a published view that satisfies `check`.
    async fn view_where(&self, what: &str, check: impl Fn(&ClusterView) -> bool) -> ClusterView {
        wait_for(what, || self.last().filter(|v| check(v))).await
    }
}

struct Running {
    sink: Arc<Recorder>,
    status: XdsStatusHandle,
    task: tokio::task::JoinHandle<()>,
    /// The source's metrics, registered as the agent registers them.
    metrics: prometheus_client::registry::Registry,
}

impl Drop for Running {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Running {
    fn status(&self) -> XdsStatus {
        self.status.snapshot()
    }

    /// The value of the series `line_start` (name and labels) in the
    /// source's exposition, 0 when absent.
    fn sample(&self, line_start: &str) -> u64 {
        let mut text = String::new();
        prometheus_client::encoding::text::encode(&mut text, &self.metrics).expect("encode");
        text.lines()
            .find_map(|l| l.strip_prefix(line_start)?.strip_prefix(' ')?.parse().ok())
            .unwrap_or(0)
    }
}

fn start_source(config: XdsConfig) -> Running {
    let xds_metrics = Arc::new(XdsMetrics::default());
    let mut metrics = prometheus_client::registry::Registry::default();
    xds_metrics.register(metrics.sub_registry_with_prefix("istio"));
    let source = XdsSource::new(config)
        .expect("valid xDS settings")
        .with_metrics(xds_metrics);
    let status = source.status();
    let sink = Arc::new(Recorder::default());
    let task = tokio::spawn(source.run(sink.clone()));
    Running {
        sink,
        status,
        task,
        metrics,
    }
}

fn vip() -> SocketAddr {
    "198.19.100.1:80".parse().expect("VIP")
}

fn endpoint_targets(view: &ClusterView) -> Vec<SocketAddr> {
    view.services
        .iter()
        .find(|s| s.name == "web")
        .map(|s| s.ready_targets(vip()).into_iter().map(|(_, a)| a).collect())
        .unwrap_or_default()
}

/// The first push of both types, ACKed; returns the source once synced.
async fn synced_source(pki: &Pki, server: &FakeIstiod, config: XdsConfig) -> Running {
    let running = start_source(config);
    server.initial_requests(1).await;
    server.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(pod("default", "client", [198, 18, 1, 2], "node-a"), "1"),
            workload(
                web_backend("web-0", [198, 18, 2, 10], "node-b", "web", true),
                "1",
            ),
            workload(
                web_backend("web-1", [198, 18, 2, 11], "node-b", "web", false),
                "1",
            ),
            service(web_service([198, 19, 100, 1]), "1"),
        ],
        &[],
    ));
    server.push(response(
        AUTHORIZATION_TYPE_URL,
        "p1",
        vec![policy(
            principal_policy(
                "deny-evil",
                security_pb::Scope::Namespace,
                security_pb::Action::Deny,
                "cluster.local/ns/evil/sa/default",
                &[],
            ),
            "1",
        )],
        &[],
    ));
    server.answer_to("p1").await;
    wait_for("synced", || running.sink.is_synced().then_some(())).await;
    let _ = pki;
    running
}

#[tokio::test]
async fn initial_push_lands_in_the_view_with_acks_and_readiness() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;
    let running = start_source(pki.config(server.addr));

    // The subscription ztunnel makes: both types, wildcard, nothing held.
    let initial = server.initial_requests(1).await;
    for type_url in [ADDRESS_TYPE_URL, AUTHORIZATION_TYPE_URL] {
        let request = &initial[type_url];
        assert_eq!(request.node.as_ref().map(|n| n.id.as_str()), Some(NODE_ID));
        assert!(request.resource_names_subscribe.is_empty(), "wildcard");
        assert!(request.initial_resource_versions.is_empty());
    }
    assert!(server.refused().is_empty(), "{:?}", server.refused());

    let mut plain = pod("other", "legacy", [198, 18, 3, 1], "node-c");
    plain.tunnel_protocol = workload_pb::TunnelProtocol::None as i32;
    plain.trust_domain = "example.org".into();
    server.push(response(
        ADDRESS_TYPE_URL,
        "a1",
        vec![
            workload(pod("default", "client", [198, 18, 1, 2], "node-a"), "1"),
            workload(
                web_backend("web-0", [198, 18, 2, 10], "node-b", "web", true),
                "1",
            ),
            workload(
                web_backend("web-1", [198, 18, 2, 11], "node-b", "web", false),
                "1",
            ),
            workload(plain, "1"),
            service(web_service([198, 19, 100, 1]), "1"),
        ],
        &[],
    ));
    let ack = server.answer_to("a1").await;
    assert_eq!(ack.type_url, ADDRESS_TYPE_URL);
    assert_eq!(ack.error_detail, None, "an ACK carries no error");
    // Workloads without policies are no view to serve with: nothing is
    // published before both types came (inbound fails closed until then).
    assert_eq!(
        running.sink.published(),
        0,
        "a view was published before the policies: {:?}",
        running.sink.last()
    );
    assert!(
        !running.sink.is_synced(),
        "not ready before policies were received"
    );

    server.push(response(
        AUTHORIZATION_TYPE_URL,
        "p1",
        vec![policy(
            principal_policy(
                "deny-evil",
                security_pb::Scope::Namespace,
                security_pb::Action::Deny,
                "cluster.local/ns/evil/sa/default",
                &[],
            ),
            "1",
        )],
        &[],
    ));
    assert_eq!(server.answer_to("p1").await.error_detail, None);
    wait_for("synced", || running.sink.is_synced().then_some(())).await;
    let view = running
        .sink
        .view_where("the workloads and the policy", |v| {
            v.workloads.len() == 4 && v.policies.len() == 1
        })
        .await;
    assert_eq!(running.sink.published(), 1, "one complete view");

    let client = view
        .workloads
        .iter()
        .find(|w| w.name == "client")
        .expect("client");
    assert_eq!(
        client.identity(&TrustDomain::default()).as_str(),
        "spiffe://cluster.local/ns/default/sa/default"
    );
    assert_eq!(
        (client.tunnel, client.node.as_str()),
        (TunnelProtocol::Hbone, "node-a")
    );
    assert!(client.wants_mesh() && client.netns.is_none());
    let legacy = view
        .workloads
        .iter()
        .find(|w| w.name == "legacy")
        .expect("legacy");
    assert_eq!(legacy.tunnel, TunnelProtocol::None);
    assert!(!legacy.wants_mesh(), "passthrough: no HBONE to it");
    assert_eq!(
        legacy.identity(&TrustDomain::default()).as_str(),
        "spiffe://example.org/ns/other/sa/default"
    );
    let sick = view
        .workloads
        .iter()
        .find(|w| w.name == "web-1")
        .expect("web-1");
    assert_eq!(sick.status, WorkloadStatus::Unhealthy);
    // Target port 0 in the workload: the service's 8080. The unhealthy
    // backend gets no connection.
    assert_eq!(
        endpoint_targets(&view),
        ["198.18.2.10:8080".parse::<SocketAddr>().expect("addr")]
    );
    let web = view.services.iter().find(|s| s.name == "web").expect("web");
    assert_eq!(web.hostname, "web.default.svc.cluster.local");

    let p = &view.policies[0];
    assert_eq!(p.key(), PolicyKey::new("default", "deny-evil"));
    assert_eq!((p.scope, p.action), (Scope::Namespace, Action::Deny));

    let status = running.status();
    assert!(status.connected && status.synced && status.connected_since.is_some());
    assert_eq!(status.node_id, NODE_ID);
    let acks: HashMap<&str, &str> = status
        .types
        .iter()
        .filter_map(|t| Some((t.type_url.as_str(), t.last_ack.as_ref()?.nonce.as_str())))
        .collect();
    assert_eq!(
        acks,
        HashMap::from([(ADDRESS_TYPE_URL, "a1"), (AUTHORIZATION_TYPE_URL, "p1")])
    );
    assert!(
        status
            .resources
            .iter()
            .any(|r| r.kind == "service" && r.name == "default/web.default.svc.cluster.local")
    );
}

/// What a probed address reaches in `view`, as the proxy looks it up.
fn reaches(view: &ClusterView, probe: &str) -> String {
    let mut store = shunt::store::WorkloadStore::new();
    store.replace_all(view.workloads.clone());
    store.replace_services(view.services.clone());
    if let Ok(vip) = probe.parse::<SocketAddr>() {
        return match store.services().by_addr(vip) {
            Some(s) => format!(
                "{:?}",
                xds_cases::Reaches::Service {
                    hostname: leak(&s.hostname)
                }
            ),
            None => format!("{:?}", xds_cases::Reaches::Nothing),
        };
    }
    let ip = probe.parse().expect("probe address");
    match store.by_ip(ip) {
        Some(w) => format!(
            "{:?}",
            xds_cases::Reaches::Workload {
                uid: leak(&w.uid),
                hbone: w.wants_mesh()
            }
        ),
        None => format!("{:?}", xds_cases::Reaches::Nothing),
    }
}

fn leak(s: &str) -> &'static str {
    Box::leak(s.to_owned().into_boxed_str())
}

/// The rows of `support/xds_cases.rs` (items 3, 4, 5 of issue 34), one
/// response each on a synced source: the answer NACKs exactly the rows'
/// bad resources by name (or ACKs), and every probe reaches what ztunnel
/// reaches.
#[tokio::test]
async fn xds_cases_are_taken_as_ztunnel_takes_them() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;
    let running = synced_source(&pki, &server, pki.config(server.addr)).await;
    for (i, case) in xds_cases::cases().into_iter().enumerate() {
        let nonce = format!("case{i}");
        server.push(response(ADDRESS_TYPE_URL, &nonce, case.resources, &[]));
        let answer = server.answer_to(&nonce).await;
        match (&answer.error_detail, case.nacked.is_empty()) {
            (None, true) => {}
            (Some(detail), false) => {
                assert!(
                    detail.message.starts_with(&format!(
                        "{} resource(s) rejected, the rest applied",
                        case.nacked.len()
                    )),
                    "{}: {}",
                    case.name,
                    detail.message
                );
                for name in &case.nacked {
                    assert!(
                        detail.message.contains(&format!("resource {name:?}: ")),
                        "{}: {}",
                        case.name,
                        detail.message
                    );
                }
                let last = running
                    .status()
                    .types
                    .into_iter()
                    .find(|t| t.type_url == ADDRESS_TYPE_URL);
                let reason = last.and_then(|t| t.last_nack).map(|n| n.reason);
                assert_eq!(
                    reason.as_deref(),
                    Some(detail.message.as_str()),
                    "{}: status",
                    case.name
                );
            }
            (detail, _) => panic!(
                "{}: expected NACK of {:?}, got {detail:?}",
                case.name, case.nacked
            ),
        }
        let expected: Vec<(&str, String)> = case
            .probes
            .iter()
            .map(|(probe, outcome)| (*probe, format!("{outcome:?}")))
            .collect();
        let view = running
            .sink
            .view_where(case.name, |v| {
                expected
                    .iter()
                    .all(|(probe, outcome)| reaches(v, probe) == *outcome)
            })
            .await;
        // The synced state is still served beside the case's resources.
        assert_eq!(endpoint_targets(&view).len(), 1, "{}", case.name);
    }
}

/// A refused new version of a held resource keeps its last good copy, and
/// a reconnect reports only that copy's version as held.
#[tokio::test]
async fn a_refused_update_keeps_the_last_good_copy() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;
    let running = synced_source(&pki, &server, pki.config(server.addr)).await;
    let before = running.sink.last().expect("a view");

    // web-0 again, version 2, with a 5-byte address; and a newcomer.
    let mut five = web_backend("web-0", [198, 18, 2, 10], "node-b", "web", true);
    five.addresses = vec![vec![198, 18, 2, 13, 7]];
    let newcomer = workload(
        web_backend("web-2", [198, 18, 2, 12], "node-b", "web", true),
        "2",
    );
    server.push(response(
        ADDRESS_TYPE_URL,
        "bad2",
        vec![workload(five, "2"), newcomer],
        &[],
    ));
    let detail = server.answer_to("bad2").await.error_detail.expect("NACK");
    assert!(
        detail.message.contains("\"Kubernetes//Pod/default/web-0\"")
            && detail.message.contains("workload.addresses[0]")
            && detail.message.contains("5 bytes")
            && !detail.message.contains("web-2"),
        "{}",
        detail.message
    );
    let view = running
        .sink
        .view_where("web-2", |v| v.workloads.iter().any(|w| w.name == "web-2"))
        .await;
    assert_eq!(endpoint_targets(&before).len(), 1);
    assert_eq!(
        endpoint_targets(&view),
        [
            "198.18.2.10:8080".parse().expect("addr"),
            "198.18.2.12:8080".parse().expect("addr")
        ],
        "web-0's last good copy and the newcomer"
    );
    let status = running.status();
    let address = status
        .types
        .iter()
        .find(|t| t.type_url == ADDRESS_TYPE_URL)
        .expect("type");
    assert_eq!(
        address.last_nack.as_ref().map(|n| n.nonce.as_str()),
        Some("bad2")
    );

    // Reconnect: web-0 is held at version 1 (the good copy), web-2 at 2.
    server.disconnect();
    let initial = server.initial_requests(2).await;
    let held = &initial
        .get(ADDRESS_TYPE_URL)
        .expect("an Address subscription")
        .initial_resource_versions;
    assert_eq!(
        held.get("Kubernetes//Pod/default/web-0")
            .map(String::as_str),
        Some("1")
    );
    assert_eq!(
        held.get("Kubernetes//Pod/default/web-2")
            .map(String::as_str),
        Some("2")
    );
}

#[tokio::test]
async fn a_delta_removal_takes_the_endpoint_out() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;
    let running = synced_source(&pki, &server, pki.config(server.addr)).await;
    assert_eq!(
        endpoint_targets(&running.sink.last().expect("view")).len(),
        1
    );

    server.push(response(
        ADDRESS_TYPE_URL,
        "rm1",
        vec![],
        &["Kubernetes//Pod/default/web-0"],
    ));
    assert_eq!(server.answer_to("rm1").await.error_detail, None);
    let view = running
        .sink
        .view_where("web-0 gone", |v| {
            !v.workloads.iter().any(|w| w.name == "web-0")
        })
        .await;
    assert!(
        endpoint_targets(&view).is_empty(),
        "no endpoint left for new connections"
    );
    assert_eq!(view.services.len(), 1, "the service itself stays");

    server.push(response(
        AUTHORIZATION_TYPE_URL,
        "rm2",
        vec![],
        &["default/deny-evil"],
    ));
    running
        .sink
        .view_where("policy gone", |v| v.policies.is_empty())
        .await;
}

#[tokio::test]
async fn a_reconnect_sends_the_versions_held_and_applies_only_the_difference() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;
    let running = synced_source(&pki, &server, pki.config(server.addr)).await;
    let address_messages = format!("istio_xds_message_total{{url=\"{ADDRESS_TYPE_URL}\"}}");
    let address_bytes = format!("istio_xds_message_bytes_total{{url=\"{ADDRESS_TYPE_URL}\"}}");
    assert_eq!(running.sample(&address_messages), 1, "one Address push");
    assert!(running.sample(&address_bytes) > 100, "its four resources");

    server.disconnect();
    let initial = server.initial_requests(2).await;
    // UNAVAILABLE without a transport reason: ztunnel's "Error".
    assert_eq!(
        running.sample("istio_xds_connection_terminations_total{reason=\"Error\"}"),
        1
    );
    let versions = &initial[ADDRESS_TYPE_URL].initial_resource_versions;
    let expected: HashMap<String, String> = [
        "Kubernetes//Pod/default/client",
        "Kubernetes//Pod/default/web-0",
        "Kubernetes//Pod/default/web-1",
        "default/web.default.svc.cluster.local",
    ]
    .into_iter()
    .map(|n| (n.to_string(), "1".to_string()))
    .collect();
    assert_eq!(versions, &expected);
    assert_eq!(
        initial[AUTHORIZATION_TYPE_URL].initial_resource_versions,
        HashMap::from([("default/deny-evil".to_string(), "1".to_string())])
    );

    // istiod sends what changed meanwhile: one new backend, one removal.
    server.push(response(
        ADDRESS_TYPE_URL,
        "a2",
        vec![workload(
            web_backend("web-2", [198, 18, 2, 12], "node-b", "web", true),
            "2",
        )],
        &["Kubernetes//Pod/default/web-1"],
    ));
    assert_eq!(server.answer_to("a2").await.error_detail, None);
    let view = running
        .sink
        .view_where("the difference applied", |v| {
            v.workloads.iter().any(|w| w.name == "web-2")
        })
        .await;
    let mut names: Vec<&str> = view.workloads.iter().map(|w| w.name.as_str()).collect();
    names.sort();
    assert_eq!(
        names,
        ["client", "web-0", "web-2"],
        "kept what was held, applied the delta"
    );
    assert_eq!(view.policies.len(), 1, "policies held across the reconnect");
    assert_eq!(running.status().connections, 2);
    assert_eq!(
        running.sample(&address_messages),
        2,
        "counted across streams"
    );
}

#[tokio::test]
async fn while_istiod_is_away_nothing_is_dropped() {
    let pki = Pki::new();
    let mut server = FakeIstiod::start(&pki).await;
    let running = synced_source(&pki, &server, pki.config(server.addr)).await;
    let before = running.sink.last().expect("view");
    let published = running.sink.published();

    server.stop();
    // Retries fail (connection refused) for a while.
    wait_for("a failed reconnect", || {
        let status = running.status();
        (!status.connected
            && status
                .last_error
                .as_deref()
                .is_some_and(|e| e.contains("cannot connect")))
        .then_some(())
    })
    .await;
    assert_eq!(
        running.sink.published(),
        published,
        "nothing republished while away"
    );
    assert!(
        running.sample("istio_xds_connection_terminations_total{reason=\"ConnectionError\"}") >= 1,
        "a refused connect is a connection error"
    );
    assert_eq!(running.sink.last().as_ref(), Some(&before));
    assert!(running.sink.is_synced(), "readiness kept");

    server.restart(&pki).await;
    let initial = server.initial_requests(2).await;
    assert_eq!(initial[ADDRESS_TYPE_URL].initial_resource_versions.len(), 4);
    server.push(response(AUTHORIZATION_TYPE_URL, "p2", vec![], &[]));
    server.answer_to("p2").await;
    assert_eq!(
        running.sink.last().as_ref(),
        Some(&before),
        "an empty delta changes nothing"
    );
    assert!(running.status().connected);
}

#[tokio::test]
async fn token_root_and_node_are_what_istiod_checks() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;

    // A wrong token: refused; the file is re-read on every reconnect.
    std::fs::write(pki.token_file(), "stale-token\n").expect("token");
    let running = start_source(pki.config(server.addr));
    wait_for("the refusal", || {
        running
            .status()
            .last_error
            .filter(|e| e.contains("Unauthenticated"))
    })
    .await;
    assert_eq!(server.connections(), 0);
    std::fs::write(pki.token_file(), format!("{}\n", fake_istiod::TOKEN)).expect("token");
    server.initial_requests(1).await;
    drop(running);

    // A server whose certificate chains to another root is not istiod.
    let other = Pki::new();
    let impostor = FakeIstiod::start(&other).await;
    let running = start_source(pki.config(impostor.addr));
    let error = wait_for("a TLS failure", || running.status().last_error).await;
    assert!(
        error.contains("certificate") || error.contains("UnknownIssuer"),
        "{error}"
    );
    assert_eq!(
        impostor.connections(),
        0,
        "no stream opened to an untrusted server"
    );
    drop(running);

    // The node id is istiod's to check: a pod name it does not expect is
    // refused (the fake checks the whole id and metadata).
    let mut config = pki.config(server.addr);
    config.node.pod_name = "someone-else".into();
    let before = server.refused().len();
    let running = start_source(config);
    wait_for("the node refusal", || {
        running
            .status()
            .last_error
            .filter(|e| e.contains("PermissionDenied"))
    })
    .await;
    assert!(
        server.refused()[before..]
            .iter()
            .any(|r| r.contains("node id"))
    );
}

#[tokio::test]
async fn bad_input_is_named_never_half_applied() {
    let pki = Pki::new();
    let server = FakeIstiod::start(&pki).await;
    let mut config = pki.config(server.addr);
    config.max_message_bytes = 64 * 1024;
    let running = synced_source(&pki, &server, config).await;

    // An unknown type URL.
    server.push(response(
        "type.googleapis.com/envoy.config.cluster.v3.Cluster",
        "u1",
        vec![],
        &[],
    ));
    let detail = server.answer_to("u1").await.error_detail.expect("NACK");
    assert!(
        detail.message.contains("unknown type URL") && detail.message.contains("Cluster"),
        "{}",
        detail.message
    );

    // Two workloads claiming one address in one response: applied (as
    // ztunnel does), the address named in the warnings.
    server.push(response(
        ADDRESS_TYPE_URL,
        "d1",
        vec![
            workload(pod("default", "twin-a", [198, 18, 4, 1], "node-b"), "2"),
            workload(pod("default", "twin-b", [198, 18, 4, 1], "node-b"), "2"),
        ],
        &[],
    ));
    assert_eq!(server.answer_to("d1").await.error_detail, None);
    wait_for("the shared-address warning", || {
        running
            .status()
            .warnings
            .into_iter()
            .find(|w| w.contains("198.18.4.1"))
    })
    .await;
    server.push(response(
        ADDRESS_TYPE_URL,
        "d2",
        vec![],
        &[
            "Kubernetes//Pod/default/twin-a",
            "Kubernetes//Pod/default/twin-b",
        ],
    ));
    assert_eq!(server.answer_to("d2").await.error_detail, None);
    let before = running
        .sink
        .view_where("twins gone", |v| {
            !v.workloads.iter().any(|w| w.name.starts_with("twin"))
        })
        .await;
    assert_eq!(before.workloads.len(), 3);

    // A resource whose Any is of another type.
    let mislabeled = any_resource("default/p", "2", AUTHORIZATION_TYPE_URL, vec![]);
    server.push(response(ADDRESS_TYPE_URL, "t1", vec![mislabeled], &[]));
    let detail = server.answer_to("t1").await.error_detail.expect("NACK");
    assert!(
        detail.message.contains("resource.type_url"),
        "{}",
        detail.message
    );
    assert_eq!(running.sink.last().as_ref(), Some(&before));

    // Names of things istiod has not sent: applied (they may come later),
    // and named in the status.
    let mut orphan = pod("default", "orphan", [198, 18, 4, 2], "node-b");
    orphan.services.insert(
        "default/ghost.default.svc.cluster.local".into(),
        workload_pb::PortList::default(),
    );
    orphan.authorization_policies.push("default/nope".into());
    server.push(response(
        ADDRESS_TYPE_URL,
        "w1",
        vec![workload(orphan, "2")],
        &[],
    ));
    assert_eq!(server.answer_to("w1").await.error_detail, None);
    let warnings = wait_for("the warnings", || {
        let w = running.status().warnings;
        (w.len() == 2).then_some(w)
    })
    .await;
    assert!(
        warnings
            .iter()
            .any(|w| w.contains("ghost.default.svc.cluster.local")),
        "{warnings:?}"
    );
    assert!(
        warnings.iter().any(|w| w.contains("default/nope")),
        "{warnings:?}"
    );

    // An oversized message cannot be read, so it cannot be NACKed: the
    // stream ends with the limit named, nothing changes, the source
    // reconnects.
    let view = running.sink.last().expect("view");
    let big = any_resource("big", "3", ADDRESS_TYPE_URL, vec![0; 100 * 1024]);
    server.push(response(ADDRESS_TYPE_URL, "big1", vec![big], &[]));
    let error = wait_for("the size error", || {
        running
            .status()
            .last_error
            .filter(|e| e.contains("too large"))
    })
    .await;
    assert!(error.contains("65536"), "{error}");
    server.initial_requests(2).await;
    assert_eq!(running.sink.last().as_ref(), Some(&view));
    assert!(
        server
            .seen()
            .iter()
            .all(|s| s.request.response_nonce != "big1")
    );
}

//! Prometheus metrics, served as OpenMetrics text on `/metrics` (port 15020
//! by contract).
//!
//! Two kinds:
//!
//! - recorded as things happen: Istio's standard TCP metrics
//!   (`istio_tcp_connections_opened_total`, `..._closed_total`,
//!   `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`, with
//!   Istio's labels so existing dashboards work), fed by the proxy through
//!   [`ConnectionObserver`]; the enrolment latency histogram and redirection
//!   repairs, fed by the agent;
//! - read at scrape time from the reconciler's last [`NodeSnapshot`]
//!   ([`NodeGauges`]): pods by state and mode, each enrolled pod's kernel
//!   counters (as its verify pass read them from the redirector's maps or
//!   rules), certificate expiry per identity, the pod source's health,
//!   readiness. A scrape enters no netns and waits on no reconcile.
//!
//! Istio's conventions, as ztunnel follows them: `reporter` is `source` on
//! the client's node and `destination` on the server's (a connection between
//! two nodes is reported once by each); `received_bytes` counts the request
//! direction (initiator → target) and `sent_bytes` the response, whoever
//! reports; a label whose value is not known is `unknown`. Bytes are counted
//! when a connection closes.

use std::{
    collections::BTreeMap,
    sync::{Arc, OnceLock, RwLock},
    time::Duration,
};

use prometheus_client::{
    encoding::{EncodeLabelSet, text},
    metrics::{counter::Counter, family::Family, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

pub use crate::api::unix_seconds;
use crate::{
    control::kube::SourceStats,
    health::Readiness,
    proxy::{ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome, ProxyStats},
    redirect::EnrolledPod,
    snapshot::{NodeSnapshot, SnapshotReader},
    state::{Workload, WorkloadKey, WorkloadStore},
};

/// The content type of an OpenMetrics text exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// Istio's value for a label it cannot fill.
const UNKNOWN: &str = "unknown";
/// Istio's cluster name when none is configured.
const CLUSTER: &str = "Kubernetes";
/// Istio's canonical revision when a workload has no revision label.
const REVISION: &str = "latest";

/// The metrics of one agent. Cheap to clone (shared).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    /// Everything recorded as it happens (never modified after `new`;
    /// families synchronise themselves).
    registry: Registry,
    tcp: TcpMetrics,
    enrolment_seconds: Histogram,
    repairs: Counter,
    /// The Kubernetes source's counters, once it runs.
    kube: OnceLock<Arc<SourceStats>>,
}

#[derive(Clone, Default)]
struct TcpMetrics {
    opened: Family<TcpLabels, Counter>,
    closed: Family<TcpLabels, Counter>,
    received_bytes: Family<TcpLabels, Counter>,
    sent_bytes: Family<TcpLabels, Counter>,
}

/// Istio's standard labels of its TCP metrics (as ztunnel writes them,
/// without locality).
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    pub reporter: String,
    pub source_workload: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
    pub source_workload_namespace: String,
    pub source_principal: String,
    pub source_app: String,
    pub source_version: String,
    pub source_cluster: String,
    pub destination_service: String,
    pub destination_service_namespace: String,
    pub destination_service_name: String,
    pub destination_workload: String,
    pub destination_canonical_service: String,
    pub destination_canonical_revision: String,
    pub destination_workload_namespace: String,
    pub destination_principal: String,
    pub destination_app: String,
    pub destination_version: String,
    pub destination_cluster: String,
    pub request_protocol: String,
    pub response_flags: String,
    pub connection_security_policy: String,
}

impl Default for Metrics {
    fn default() -> Self {
        Self::new()
    }
}

impl std::fmt::Debug for Metrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Metrics").finish_non_exhaustive()
    }
}

impl Metrics {
    pub fn new() -> Self {
        let mut registry = Registry::default();
        let tcp = TcpMetrics::default();
        let istio = registry.sub_registry_with_prefix("istio");
        istio.register(
            "tcp_connections_opened",
            "The total number of TCP connections opened",
            tcp.opened.clone(),
        );
        istio.register(
            "tcp_connections_closed",
            "The total number of TCP connections closed",
            tcp.closed.clone(),
        );
        istio.register(
            "tcp_received_bytes",
            "The size of total bytes received during request in case of a TCP connection",
            tcp.received_bytes.clone(),
        );
        istio.register(
            "tcp_sent_bytes",
            "The size of total bytes sent during response in case of a TCP connection",
            tcp.sent_bytes.clone(),
        );
        let enrolment_seconds = Histogram::new([
            0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
        ]);
        let repairs = Counter::default();
        let shunt = registry.sub_registry_with_prefix("shunt");
        shunt.register(
            "enrolment_duration_seconds",
            "Time to enrol a pod that was not enrolled: proxy listeners plus redirection",
            enrolment_seconds.clone(),
        );
        shunt.register(
            "redirection_repairs",
            "Enrolled pods found not (fully) redirected and repaired",
            repairs.clone(),
        );
        Self {
            inner: Arc::new(Inner {
                registry,
                tcp,
                enrolment_seconds,
                repairs,
                kube: OnceLock::new(),
            }),
        }
    }

    /// A pod was enrolled (it was not before) in `took`.
    pub fn enrolled(&self, took: Duration) {
        self.inner.enrolment_seconds.observe(took.as_secs_f64());
    }

    /// An enrolled pod was found not fully redirected (and is repaired).
    pub fn repaired(&self) {
        self.inner.repairs.inc();
    }

    /// Reports the Kubernetes source's health from now on.
    pub fn watch_kube(&self, stats: Arc<SourceStats>) {
        let _ = self.inner.kube.set(stats);
    }

    /// The proxy's observer: records Istio's TCP metrics, naming workloads
    /// from `workloads` (every workload the source knows).
    pub fn connection_observer(
        &self,
        workloads: Arc<RwLock<WorkloadStore>>,
    ) -> Arc<dyn ConnectionObserver> {
        Arc::new(TcpObserver {
            tcp: self.inner.tcp.clone(),
            workloads,
        })
    }

    /// The whole exposition: what was recorded, then `snapshot` (read from
    /// the node's snapshot just before), then the EOF marker.
    pub fn encode(&self, snapshot: Option<&NodeGauges>) -> String {
        let mut out = String::new();
        // Writing into a String cannot fail.
        let _ = text::encode_registry(&mut out, &self.inner.registry);
        if let Some(snapshot) = snapshot {
            let registry = snapshot.registry(self.inner.kube.get().map(Arc::as_ref));
            let _ = text::encode_registry(&mut out, &registry);
        }
        let _ = text::encode_eof(&mut out);
        out
    }

    /// Encodes everything, the node's part from `node`.
    pub fn scrape(&self, node: &NodeSnapshot) -> String {
        self.encode(Some(&NodeGauges::of(node)))
    }
}

/// Feeds Istio's TCP metrics from the proxy's connections.
struct TcpObserver {
    tcp: TcpMetrics,
    workloads: Arc<RwLock<WorkloadStore>>,
}

impl TcpObserver {
    fn labels(&self, c: &ConnectionInfo<'_>, flags: &str) -> TcpLabels {
        let store = self.workloads.read().unwrap_or_else(|p| p.into_inner());
        let local = c.pod.and_then(|key| store.get(key));
        let (src, dst) = if c.direction.local_is_source() {
            (
                local.or_else(|| store.by_ip(c.src_addr.ip())),
                store.by_ip(c.dst_addr.ip()),
            )
        } else {
            (
                store.by_ip(c.src_addr.ip()),
                local.or_else(|| store.by_ip(c.dst_addr.ip())),
            )
        };
        let (src, dst) = (Named::of(src), Named::of(dst));
        let principal = |id: Option<&str>| id.unwrap_or(UNKNOWN).to_string();
        TcpLabels {
            reporter: if c.direction.local_is_source() {
                "source"
            } else {
                "destination"
            }
            .into(),
            source_workload: src.workload.clone(),
            source_canonical_service: src.workload.clone(),
            source_canonical_revision: src.revision.clone(),
            source_workload_namespace: src.namespace,
            source_principal: principal(c.src_identity),
            source_app: src.workload,
            source_version: src.revision,
            source_cluster: src.cluster,
            destination_service: c
                .dst_service
                .map_or_else(|| UNKNOWN.into(), service_hostname),
            destination_service_namespace: c
                .dst_service
                .map_or_else(|| UNKNOWN.into(), |s| s.namespace.clone()),
            destination_service_name: c
                .dst_service
                .map_or_else(|| UNKNOWN.into(), |s| s.name.clone()),
            destination_workload: dst.workload.clone(),
            destination_canonical_service: dst.workload.clone(),
            destination_canonical_revision: dst.revision.clone(),
            destination_workload_namespace: dst.namespace,
            destination_principal: principal(c.dst_identity),
            destination_app: dst.workload,
            destination_version: dst.revision,
            destination_cluster: dst.cluster,
            request_protocol: "tcp".into(),
            response_flags: flags.into(),
            connection_security_policy: if c.direction.mutual_tls() {
                "mutual_tls"
            } else {
                UNKNOWN
            }
            .into(),
        }
    }
}

/// Istio's `destination_service`: the service's cluster DNS name (Istio's
/// default cluster domain; the agent is not told another).
fn service_hostname(service: &WorkloadKey) -> String {
    format!("{}.{}.svc.cluster.local", service.name, service.namespace)
}

/// A workload's label values (`unknown` when not known).
struct Named {
    workload: String,
    namespace: String,
    revision: String,
    cluster: String,
}

impl Named {
    fn of(workload: Option<&Workload>) -> Self {
        match workload {
            // Pods carry no owner or app labels here: the pod name stands
            // for the workload and its canonical service.
            Some(w) => Named {
                workload: w.name.clone(),
                namespace: w.namespace.clone(),
                revision: REVISION.into(),
                cluster: CLUSTER.into(),
            },
            None => Named {
                workload: UNKNOWN.into(),
                namespace: UNKNOWN.into(),
                revision: UNKNOWN.into(),
                cluster: UNKNOWN.into(),
            },
        }
    }
}

impl ConnectionObserver for TcpObserver {
    fn opened(&self, connection: &ConnectionInfo<'_>) {
        self.tcp
            .opened
            .get_or_create(&self.labels(connection, "-"))
            .inc();
    }

    fn closed(&self, connection: &ConnectionInfo<'_>, close: &ConnectionClose) {
        // As ztunnel: bytes carry the labels the connection opened with;
        // the close carries how it ended.
        let open = self.labels(connection, "-");
        self.tcp
            .received_bytes
            .get_or_create(&open)
            .inc_by(close.bytes_to_target);
        self.tcp
            .sent_bytes
            .get_or_create(&open)
            .inc_by(close.bytes_from_target);
        let flags = match close.outcome {
            ConnectionOutcome::Success => "-",
            // No authorization policy yet: every refusal or failure is one
            // of reaching the target.
            ConnectionOutcome::Refused | ConnectionOutcome::Failed => "CONNECT",
        };
        let labels = if flags == "-" {
            open
        } else {
            TcpLabels {
                response_flags: flags.into(),
                ..open
            }
        };
        self.tcp.closed.get_or_create(&labels).inc();
    }
}

/// The node's part of the exposition, taken from its snapshot.
#[derive(Clone, Debug, Default)]
pub struct NodeGauges {
    /// Redirection mode in use.
    pub mode: String,
    /// Pods of this node by state (`enrolled`, `pending`, `not_in_mesh`,
    /// `error`).
    pub pods_by_state: BTreeMap<&'static str, i64>,
    pub enrolled: Vec<EnrolledPod>,
    /// Certificate expiry (seconds since the epoch) per identity held.
    pub certificates: BTreeMap<String, i64>,
    pub proxy: Option<ProxyStats>,
    pub synced: bool,
    pub ready: bool,
}

impl NodeGauges {
    pub fn of(node: &NodeSnapshot) -> Self {
        let mut pods_by_state: BTreeMap<&'static str, i64> =
            ["enrolled", "pending", "not_in_mesh", "error"]
                .into_iter()
                .map(|s| (s, 0))
                .collect();
        for pod in node.pods.iter() {
            *pods_by_state.entry(pod.state.metric_name()).or_default() += 1;
        }
        let certificates = node
            .certificates
            .iter()
            .map(|(id, cert)| (id.to_string(), unix_seconds(cert.not_after())))
            .collect();
        Self {
            mode: node.mode.to_string(),
            pods_by_state,
            enrolled: node.enrolled().cloned().collect(),
            certificates,
            proxy: node.proxy.clone(),
            synced: node.synced,
            ready: Readiness::evaluate(node).ready(),
        }
    }

    fn registry(&self, kube: Option<&SourceStats>) -> Registry {
        let mut registry = Registry::with_prefix("shunt");

        let by_state = Family::<StateLabels, Gauge>::default();
        for (state, count) in &self.pods_by_state {
            by_state
                .get_or_create(&StateLabels {
                    state: (*state).into(),
                })
                .set(*count);
        }
        registry.register("pods", "Pods of this node by state", by_state);

        let by_mode = Family::<ModeLabels, Gauge>::default();
        by_mode
            .get_or_create(&ModeLabels {
                mode: self.mode.clone(),
            })
            .set(self.enrolled.len() as i64);
        registry.register(
            "enrolled_pods",
            "Pods whose traffic is redirected, by redirection mode",
            by_mode,
        );

        let not_redirected = Gauge::<i64>::default();
        not_redirected.set(
            self.enrolled
                .iter()
                .filter(|p| p.hooks.iter().any(|h| !h.present))
                .count() as i64,
        );
        registry.register(
            "pods_not_redirected",
            "Enrolled pods with a hook (program, link or rule) missing when last verified",
            not_redirected,
        );

        let packets = Family::<PodDirection, Counter>::default();
        let bytes = Family::<PodDirection, Counter>::default();
        let redirected = Family::<PodDirection, Counter>::default();
        let fail_closed = Family::<PodDirection, Counter>::default();
        let spliced = Family::<PodLabels, Counter>::default();
        let splice_fallbacks = Family::<PodLabels, Counter>::default();
        for pod in &self.enrolled {
            let c = &pod.counters;
            let at = |direction: &str| PodDirection {
                namespace: pod.key.namespace.clone(),
                pod: pod.key.name.clone(),
                direction: direction.into(),
            };
            packets.get_or_create(&at("in")).inc_by(c.packets_in);
            packets.get_or_create(&at("out")).inc_by(c.packets_out);
            bytes.get_or_create(&at("in")).inc_by(c.bytes_in);
            bytes.get_or_create(&at("out")).inc_by(c.bytes_out);
            redirected
                .get_or_create(&at("in"))
                .inc_by(c.inbound_redirected);
            redirected
                .get_or_create(&at("out"))
                .inc_by(c.outbound_redirected);
            fail_closed
                .get_or_create(&at("in"))
                .inc_by(c.inbound_fail_closed);
            fail_closed
                .get_or_create(&at("out"))
                .inc_by(c.outbound_fail_closed);
            let labels = PodLabels {
                namespace: pod.key.namespace.clone(),
                pod: pod.key.name.clone(),
            };
            spliced.get_or_create(&labels).inc_by(c.spliced_bytes);
            splice_fallbacks
                .get_or_create(&labels)
                .inc_by(c.splice_fallbacks);
        }
        registry.register(
            "pod_packets",
            "Packets through an enrolled pod's eth0 (kernel counters; reset when the pod is enrolled anew)",
            packets,
        );
        registry.register(
            "pod_bytes",
            "Bytes through an enrolled pod's eth0 (kernel counters)",
            bytes,
        );
        registry.register(
            "pod_redirected_connections",
            "Connections the kernel steered to the proxy (out: connects rewritten, in: SYNs assigned)",
            redirected,
        );
        registry.register(
            "pod_fail_closed",
            "Connections or packets dropped because the pod's proxy listener was missing",
            fail_closed,
        );
        registry.register(
            "pod_spliced_bytes",
            "Payload bytes moved between app and proxy sockets by sk_msg",
            spliced,
        );
        registry.register(
            "pod_splice_fallbacks",
            "Connection directions that stopped splicing (reader more than --splice-backlog behind, or no peer socket to splice into) and went on over the TCP stack",
            splice_fallbacks,
        );

        let expiry = Family::<IdentityLabels, Gauge>::default();
        for (identity, not_after) in &self.certificates {
            expiry
                .get_or_create(&IdentityLabels {
                    identity: identity.clone(),
                })
                .set(*not_after);
        }
        registry.register(
            "certificate_expiry_timestamp_seconds",
            "When the current certificate of each identity held expires (seconds since the epoch)",
            expiry,
        );

        if let Some(proxy) = &self.proxy {
            let active = Gauge::<i64>::default();
            active.set(proxy.active as i64);
            registry.register(
                "proxy_active_connections",
                "Connections and streams the proxy serves now",
                active,
            );
            let pooled = Gauge::<i64>::default();
            pooled.set(proxy.pooled_connections as i64);
            registry.register(
                "proxy_pooled_connections",
                "HBONE connections in the outbound pools",
                pooled,
            );
        }

        let synced = Gauge::<i64>::default();
        synced.set(self.synced.into());
        registry.register(
            "pod_source_synced",
            "1 once the pod source (workloads file or Kubernetes) has listed every pod",
            synced,
        );
        let ready = Gauge::<i64>::default();
        ready.set(self.ready.into());
        registry.register("ready", "1 when /healthz/ready answers 200", ready);

        if let Some(kube) = kube {
            use std::sync::atomic::Ordering::Relaxed;
            let counter = |value: u64| {
                let c = Counter::<u64>::default();
                c.inc_by(value);
                c
            };
            registry.register(
                "kube_watch_errors",
                "Kubernetes watch errors (each retried after a backoff)",
                counter(kube.watch_errors.load(Relaxed)),
            );
            registry.register(
                "kube_reconciles",
                "Snapshots of this node's pods reconciled",
                counter(kube.reconciles.load(Relaxed)),
            );
            let patches = Family::<ResultLabels, Counter>::default();
            patches
                .get_or_create(&ResultLabels {
                    result: "success".into(),
                })
                .inc_by(kube.patches.load(Relaxed));
            patches
                .get_or_create(&ResultLabels {
                    result: "failure".into(),
                })
                .inc_by(kube.patch_failures.load(Relaxed));
            registry.register(
                "kube_annotation_patches",
                "Patches of pods' ambient.istio.io/redirection annotation",
                patches,
            );
        }
        registry
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct StateLabels {
    state: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ModeLabels {
    mode: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodLabels {
    namespace: String,
    pod: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct PodDirection {
    namespace: String,
    pod: String,
    direction: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IdentityLabels {
    identity: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

/// Serves `/metrics` until the process exits.
pub async fn serve(listener: tokio::net::TcpListener, reader: SnapshotReader, metrics: Metrics) {
    use axum::{
        Router,
        extract::State,
        http::{StatusCode, header},
        response::IntoResponse,
        routing::get,
    };
    async fn scrape(
        State((reader, metrics)): State<(SnapshotReader, Metrics)>,
    ) -> impl IntoResponse {
        let body = metrics.scrape(&reader.read());
        (StatusCode::OK, [(header::CONTENT_TYPE, CONTENT_TYPE)], body)
    }
    let app = Router::new()
        .route("/metrics", get(scrape))
        .with_state((reader, metrics));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "metrics endpoint stopped");
    }
}

#[cfg(test)]
mod tests {
    use std::net::{IpAddr, SocketAddr};

    use super::*;
    use crate::{
        proxy::Direction,
        state::{DataplaneMode, WorkloadKey},
    };

    fn workload(name: &str, ip: &str, node: &str) -> Workload {
        Workload {
            name: name.into(),
            namespace: "default".into(),
            service_account: format!("sa-{name}"),
            ips: vec![ip.parse::<IpAddr>().unwrap()],
            node: node.into(),
            netns: None,
            dataplane_mode: DataplaneMode::Ambient,
            splice: None,
            ..Default::default()
        }
    }

    fn store() -> Arc<RwLock<WorkloadStore>> {
        let mut store = WorkloadStore::new();
        store.replace_all([
            workload("client", "198.18.1.2", "a"),
            workload("server", "198.18.2.2", "b"),
        ]);
        Arc::new(RwLock::new(store))
    }

    fn sample<'a>(text: &'a str, name: &str, must: &[&str]) -> Option<&'a str> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .find(|l| must.iter().all(|m| l.contains(m)))
            .and_then(|l| l.rsplit(' ').next())
    }

    #[test]
    fn a_connection_moves_istio_tcp_metrics_with_istio_labels() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store());
        let client = WorkloadKey::new("default", "client");
        let web = WorkloadKey::new("default", "web");
        let info = ConnectionInfo {
            direction: Direction::Outbound,
            pod: Some(&client),
            src_addr: SocketAddr::from(([127, 0, 0, 1], 40000)),
            src_identity: Some("spiffe://cluster.local/ns/default/sa/sa-client"),
            dst_addr: "198.18.2.2:8080".parse().unwrap(),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            // The client connected to the service web's VIP.
            dst_service: Some(&web),
        };
        observer.opened(&info);
        let text = metrics.encode(None);
        let labels = [
            "reporter=\"source\"",
            "source_workload=\"client\"",
            "source_workload_namespace=\"default\"",
            "source_principal=\"spiffe://cluster.local/ns/default/sa/sa-client\"",
            "destination_workload=\"server\"",
            "destination_principal=\"spiffe://cluster.local/ns/default/sa/sa-server\"",
            "destination_service=\"web.default.svc.cluster.local\"",
            "destination_service_name=\"web\"",
            "destination_service_namespace=\"default\"",
            "connection_security_policy=\"mutual_tls\"",
            "request_protocol=\"tcp\"",
        ];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &labels),
            Some("1"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "istio_tcp_connections_closed_total", &labels),
            None
        );
        observer.closed(
            &info,
            &ConnectionClose {
                bytes_to_target: 1000,
                bytes_from_target: 10,
                duration: Duration::from_millis(5),
                outcome: ConnectionOutcome::Success,
            },
        );
        let text = metrics.encode(None);
        assert_eq!(
            sample(&text, "istio_tcp_connections_closed_total", &labels),
            Some("1")
        );
        assert_eq!(
            sample(&text, "istio_tcp_received_bytes_total", &labels),
            Some("1000")
        );
        assert_eq!(
            sample(&text, "istio_tcp_sent_bytes_total", &labels),
            Some("10")
        );
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn inbound_plaintext_is_reported_by_the_destination_without_mtls() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store());
        let server = WorkloadKey::new("default", "server");
        let info = ConnectionInfo {
            direction: Direction::InboundPlaintext,
            pod: Some(&server),
            src_addr: "198.18.9.9:5000".parse().unwrap(),
            src_identity: None,
            dst_addr: "198.18.2.2:8080".parse().unwrap(),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_service: None,
        };
        // Refused before it was reported open: both at close.
        observer.closed(
            &info,
            &ConnectionClose {
                bytes_to_target: 0,
                bytes_from_target: 0,
                duration: Duration::ZERO,
                outcome: ConnectionOutcome::Failed,
            },
        );
        let text = metrics.encode(None);
        let labels = [
            "reporter=\"destination\"",
            "source_workload=\"unknown\"",
            "source_principal=\"unknown\"",
            "destination_workload=\"server\"",
            "connection_security_policy=\"unknown\"",
        ];
        assert_eq!(
            sample(
                &text,
                "istio_tcp_connections_closed_total",
                &[&labels[..], &["response_flags=\"CONNECT\""]].concat()
            ),
            Some("1"),
            "{text}"
        );
        // Opened is reported by the close when nothing opened it (the
        // observer contract); here only `closed` was called directly.
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &labels),
            None
        );
    }

    #[test]
    fn snapshot_metrics_are_typed_and_labelled() {
        let metrics = Metrics::new();
        metrics.enrolled(Duration::from_millis(3));
        metrics.repaired();
        let snapshot = NodeGauges {
            mode: "ebpf".into(),
            pods_by_state: [("enrolled", 1), ("not_in_mesh", 2)].into_iter().collect(),
            enrolled: vec![EnrolledPod {
                key: WorkloadKey::new("default", "client"),
                netns: "/var/run/netns/x".into(),
                netns_cookie: 7,
                mode: crate::redirect::RedirectMode::Ebpf,
                hooks: vec![],
                counters: shunt_common::PodCounters {
                    packets_in: 3,
                    outbound_redirected: 2,
                    ..Default::default()
                },
            }],
            certificates: [("spiffe://cluster.local/ns/default/sa/a".to_string(), 1234)]
                .into_iter()
                .collect(),
            proxy: None,
            synced: true,
            ready: true,
        };
        let kube = Arc::new(SourceStats::default());
        kube.watch_errors
            .store(2, std::sync::atomic::Ordering::Relaxed);
        metrics.watch_kube(kube);
        let text = metrics.encode(Some(&snapshot));
        for line in [
            "shunt_kube_watch_errors_total 2",
            "shunt_kube_annotation_patches_total{result=\"failure\"} 0",
            "# TYPE shunt_enrolment_duration_seconds histogram",
            "shunt_enrolment_duration_seconds_count 1",
            "shunt_redirection_repairs_total 1",
            "shunt_enrolled_pods{mode=\"ebpf\"} 1",
            "shunt_pods{state=\"not_in_mesh\"} 2",
            "shunt_pod_packets_total{namespace=\"default\",pod=\"client\",direction=\"in\"} 3",
            "shunt_pod_redirected_connections_total{namespace=\"default\",pod=\"client\",direction=\"out\"} 2",
            "shunt_certificate_expiry_timestamp_seconds{identity=\"spiffe://cluster.local/ns/default/sa/a\"} 1234",
            "shunt_pod_source_synced 1",
            "shunt_ready 1",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        assert_eq!(text.matches("# EOF").count(), 1);
    }
}

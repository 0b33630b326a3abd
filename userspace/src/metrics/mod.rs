//! Prometheus metrics, served as OpenMetrics text on `/metrics` (port 15020
//! by contract).
//!
//! Two kinds:
//!
//! - recorded as things happen: Istio's standard TCP metrics
//!   (`istio_tcp_connections_opened_total`, `..._closed_total`,
//!   `..._failed_total`, `istio_tcp_sent_bytes_total`, `istio_tcp_received_bytes_total`, with
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
//!
//! [`istio_tcp`] records the Istio TCP metrics, [`node`] turns a snapshot
//! into the node's gauges and counters.

mod fast_path;
mod istio_tcp;
mod node;
mod on_demand_dns;

use std::{
    sync::{Arc, OnceLock, RwLock},
    time::Duration,
};

use prometheus_client::{
    encoding::text,
    metrics::{counter::Counter, gauge::Gauge, histogram::Histogram},
    registry::Registry,
};

pub use crate::api::unix_seconds;
use crate::{
    control::kube::SourceStats,
    proxy::ConnectionObserver,
    snapshot::{NodeSnapshot, SnapshotReader},
    state::TrustDomain,
    store::WorkloadStore,
};
pub use fast_path::{FastPathMetrics, KernelConnections, PodFastPathKind, TcpSeries};
pub use istio_tcp::TcpLabels;
use istio_tcp::{TcpMetrics, TcpObserver};
pub use node::NodeGauges;

/// The content type of an OpenMetrics text exposition.
pub const CONTENT_TYPE: &str = "application/openmetrics-text; version=1.0.0; charset=utf-8";

/// The metrics of one agent. Cheap to clone (shared).
#[derive(Clone)]
pub struct Metrics {
    inner: Arc<Inner>,
}

struct Inner {
    /// Everything recorded as it happens (never modified after `new`;
    /// families synchronise themselves).
    registry: Registry,
    tcp: Arc<TcpMetrics>,
    enrolment_seconds: Histogram,
    repairs: Counter,
    fast_path: FastPathMetrics,
    /// The DNS proxy's (`crate::dns` records them, ztunnel's names).
    dns: Arc<crate::dns::DnsMetrics>,
    /// The ZDS server's (`--proxy ztunnel`; `crate::inpod` records them).
    zds: crate::inpod::ZdsMetrics,
    /// The istiod stream's (`crate::xds` records them, ztunnel's names).
    xds: Arc<crate::xds::XdsMetrics>,
    /// The Kubernetes source's counters, once it runs.
    kube: OnceLock<Arc<SourceStats>>,
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
        let tcp = Arc::new(TcpMetrics::default());
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
            "tcp_connections_failed",
            "The total number of TCP connections that failed to establish (unstable)",
            tcp.failed.clone(),
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
        istio.register(
            "on_demand_dns",
            "The total number of requests that used on-demand DNS (unstable)",
            tcp.on_demand_dns.clone(),
        );
        let dns = Arc::new(crate::dns::DnsMetrics::default());
        dns.register(istio);
        let xds = Arc::new(crate::xds::XdsMetrics::default());
        xds.register(istio);
        register_build(istio);
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
        let fast_path = FastPathMetrics::default();
        fast_path.register(shunt);
        let zds = crate::inpod::ZdsMetrics::default();
        zds.register(shunt);
        Self {
            inner: Arc::new(Inner {
                registry,
                tcp,
                enrolment_seconds,
                repairs,
                fast_path,
                dns,
                zds,
                xds,
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

    /// The passthrough fast path's metrics (`fastpath/` records them).
    pub fn fast_path(&self) -> &FastPathMetrics {
        &self.inner.fast_path
    }

    /// The ZDS server's metrics (`--proxy ztunnel`).
    pub fn zds(&self) -> &crate::inpod::ZdsMetrics {
        &self.inner.zds
    }

    /// The istiod stream's metrics (`--xds-address`).
    pub fn xds(&self) -> &Arc<crate::xds::XdsMetrics> {
        &self.inner.xds
    }

    /// The DNS proxy's metrics, shared by every pod's DNS server.
    pub fn dns(&self) -> &Arc<crate::dns::DnsMetrics> {
        &self.inner.dns
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
        trust_domain: TrustDomain,
    ) -> Arc<dyn ConnectionObserver> {
        Arc::new(TcpObserver {
            tcp: self.inner.tcp.clone(),
            workloads,
            trust_domain,
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
            let _ = text::encode_registry(&mut out, &snapshot.istio_registry());
            let _ = text::encode_registry(&mut out, &snapshot.workload_manager_registry());
        }
        // The log writer's drops (issue 19: it never blocks the data path).
        let mut log = Registry::default();
        let dropped = Counter::<u64>::default();
        dropped.inc_by(crate::logging::dropped_lines());
        log.sub_registry_with_prefix("shunt").register(
            "log_lines_dropped",
            "Log lines (access lines included) dropped because the log writer's buffer was full",
            dropped,
        );
        let _ = text::encode_registry(&mut out, &log);
        let _ = text::encode_eof(&mut out);
        out
    }

    /// Encodes everything, the node's part from `node`.
    pub fn scrape(&self, node: &NodeSnapshot) -> String {
        self.encode(Some(&NodeGauges::of(node)))
    }
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, prometheus_client::encoding::EncodeLabelSet)]
struct BuildLabels {
    component: &'static str,
    tag: &'static str,
}

/// `istio_build{component="ztunnel",tag}` 1, as ztunnel: shunt fills the
/// node proxy's role, and Istio's dashboards list the node proxies'
/// versions by that component. The tag is shunt's own version, so a
/// reader sees which implementation runs.
fn register_build(istio: &mut Registry) {
    let build = prometheus_client::metrics::family::Family::<BuildLabels, Gauge>::default();
    build
        .get_or_create(&BuildLabels {
            component: "ztunnel",
            tag: concat!("shunt-", env!("CARGO_PKG_VERSION")),
        })
        .set(1);
    istio.register("build", "Istio component build info", build);
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
        .with_state((reader, metrics))
        .layer(axum::middleware::map_response(crate::logging::flush_after));
    if let Err(e) = axum::serve(listener, app).await {
        tracing::error!(error = %e, "metrics endpoint stopped");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{redirect::EnrolledPod, state::WorkloadKey};

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
            kernel_denials: vec![(
                WorkloadKey::new("default", "client"),
                "default/allow-client".into(),
                5,
            )],
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
            "shunt_pod_policy_denials_total{namespace=\"default\",pod=\"client\",policy=\"default/allow-client\"} 5",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        assert_eq!(text.matches("# EOF").count(), 1);
        assert!(
            !text.contains("workload_manager_"),
            "no pod proxies without the builtin proxy:\n{text}"
        );
    }

    #[test]
    fn the_node_proxy_reports_as_ztunnel_does() {
        let metrics = Metrics::new();
        let snapshot = NodeGauges {
            mode: "ebpf".into(),
            pods_by_state: [("enrolled", 2), ("pending", 1)].into_iter().collect(),
            enrolled: vec![],
            certificates: Default::default(),
            proxy: Some(crate::proxy::ProxyStats {
                pods_served: 2,
                proxies_started: 3,
                proxies_stopped: 1,
                sockets_accepted: crate::proxy::ReporterCounts {
                    source: 3,
                    destination: 0,
                },
                sockets_closed: crate::proxy::ReporterCounts {
                    source: 1,
                    destination: 0,
                },
                ..Default::default()
            }),
            synced: true,
            ready: true,
            kernel_denials: vec![],
        };
        let text = metrics.encode(Some(&snapshot));
        let build = format!(
            "istio_build{{component=\"ztunnel\",tag=\"shunt-{}\"}} 1",
            env!("CARGO_PKG_VERSION")
        );
        for line in [
            build.as_str(),
            "workload_manager_active_proxy_count 2",
            "workload_manager_pending_proxy_count 1",
            "workload_manager_proxies_started_total 3",
            "workload_manager_proxies_stopped_total 1",
            "istio_tcp_sockets_open{reporter=\"source\"} 2",
        ] {
            assert!(
                text.lines().any(|l| l == line),
                "{line:?} missing in\n{text}"
            );
        }
        // No series for a reporter before its first socket, as ztunnel.
        assert!(
            !text.contains("istio_tcp_sockets_open{reporter=\"destination\"}"),
            "{text}"
        );
    }
}

//! Istio's standard TCP metrics (`istio_tcp_connections_opened_total`,
//! `..._closed_total`, `istio_tcp_sent_bytes_total`,
//! `istio_tcp_received_bytes_total`), with Istio's labels as ztunnel writes
//! them, fed by the proxy through [`ConnectionObserver`].

use std::sync::{Arc, RwLock};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
};

use crate::{
    proxy::{ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome},
    state::{Workload, WorkloadKey},
    store::WorkloadStore,
};

/// Istio's value for a label it cannot fill.
const UNKNOWN: &str = "unknown";
/// Istio's cluster name when none is configured.
const CLUSTER: &str = "Kubernetes";
/// Istio's canonical revision when a workload has no revision label.
const REVISION: &str = "latest";

#[derive(Clone, Default)]
pub(super) struct TcpMetrics {
    pub(super) opened: Family<TcpLabels, Counter>,
    pub(super) closed: Family<TcpLabels, Counter>,
    pub(super) received_bytes: Family<TcpLabels, Counter>,
    pub(super) sent_bytes: Family<TcpLabels, Counter>,
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

/// Feeds Istio's TCP metrics from the proxy's connections.
pub(super) struct TcpObserver {
    pub(super) tcp: TcpMetrics,
    pub(super) workloads: Arc<RwLock<WorkloadStore>>,
}

impl TcpObserver {
    pub(super) fn labels(&self, c: &ConnectionInfo<'_>, flags: &str) -> TcpLabels {
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
            connection_security_policy: c.direction.security_policy().into(),
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
            // Istio's flag for a connection an authorization policy denied.
            ConnectionOutcome::Denied => "DENY",
            // Any other refusal or failure is one of reaching the target.
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

#[cfg(test)]
mod tests {
    use std::{
        net::{IpAddr, SocketAddr},
        time::Duration,
    };

    use super::*;
    use crate::{metrics::Metrics, proxy::Direction, state::DataplaneMode};

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
    fn a_denied_connection_closes_with_response_flags_deny() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store());
        let server = WorkloadKey::new("default", "server");
        let info = ConnectionInfo {
            direction: Direction::Inbound,
            pod: Some(&server),
            src_addr: "198.18.1.2:5000".parse().expect("addr"),
            src_identity: Some("spiffe://cluster.local/ns/default/sa/intruder"),
            dst_addr: "198.18.2.2:8080".parse().expect("addr"),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_service: None,
        };
        observer.opened(&info);
        let denied = ConnectionClose {
            bytes_to_target: 0,
            bytes_from_target: 0,
            duration: Duration::ZERO,
            outcome: ConnectionOutcome::Denied,
        };
        observer.closed(&info, &denied);
        let text = metrics.encode(None);
        let principal = "source_principal=\"spiffe://cluster.local/ns/default/sa/intruder\"";
        assert_eq!(
            sample(
                &text,
                "istio_tcp_connections_closed_total",
                &[principal, "response_flags=\"DENY\""]
            ),
            Some("1"),
            "{text}"
        );
        assert_eq!(
            sample(
                &text,
                "istio_tcp_connections_opened_total",
                &[principal, "response_flags=\"-\""]
            ),
            Some("1"),
            "{text}"
        );
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
}

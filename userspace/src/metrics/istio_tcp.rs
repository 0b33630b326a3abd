//! Istio's standard TCP metrics (`istio_tcp_connections_opened_total`,
//! `..._closed_total`, `istio_tcp_sent_bytes_total`,
//! `istio_tcp_received_bytes_total`), with Istio's labels as ztunnel writes
//! them, fed by the proxy through [`ConnectionObserver`].

use std::{
    borrow::{Borrow, Cow},
    collections::HashSet,
    hash::{BuildHasher, Hash, Hasher},
    sync::{
        Arc, Mutex, OnceLock, RwLock,
        atomic::{AtomicBool, AtomicU64, Ordering},
    },
};

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family},
};

use crate::{
    proxy::{
        Baggage, ConnectionClose, ConnectionInfo, ConnectionObserver, ConnectionOutcome, Failure,
        OpenConnection,
    },
    state::{TrustDomain, Workload, WorkloadKey},
    store::WorkloadStore,
};

use super::on_demand_dns::OnDemandDnsLabels;

/// Istio's value for a label it cannot fill.
const UNKNOWN: &str = "unknown";

/// A label value: most are constants (`unknown`, the reporter, the
/// protocol), borrowed rather than allocated twice per connection.
pub type Label = Cow<'static, str>;
/// Istio's cluster name when none is configured.
const CLUSTER: &str = "Kubernetes";
/// Istio's canonical revision when a workload has none.
const REVISION: &str = "latest";

/// How many distinct sources named by their baggage alone the metrics
/// keep apart. ztunnel keeps every one, but the baggage is whatever a peer
/// with a valid mesh certificate chooses to send: without a bound such a
/// peer could mint label sets (never removed) until the agent runs out of
/// memory. Past it, a further baggage-named source is reported `unknown`.
const MAX_DERIVED_SOURCES: usize = 1024;

#[derive(Clone, Default)]
pub(super) struct TcpMetrics {
    pub(super) opened: Family<TcpLabels, Counter>,
    pub(super) closed: Family<TcpLabels, Counter>,
    /// The closes that carry a failure flag (ztunnel's
    /// `istio_tcp_connections_failed_total`).
    pub(super) failed: Family<TcpLabels, Counter>,
    pub(super) received_bytes: Family<TcpLabels, Counter>,
    pub(super) sent_bytes: Family<TcpLabels, Counter>,
    /// `istio_on_demand_dns_total` (the proxy's, as ztunnel's is).
    pub(super) on_demand_dns: Family<OnDemandDnsLabels, Counter>,
    derived: DerivedSources,
    /// Every label set a connection opened with, once.
    series: Arc<RwLock<HashSet<SharedSeries>>>,
}

impl TcpMetrics {
    /// The series of `labels`, made at the first connection that opens
    /// with them and shared by every later one.
    fn series(&self, labels: TcpLabels) -> Arc<Series> {
        let known = self.series.read().unwrap_or_else(|p| p.into_inner());
        if let Some(SharedSeries(series)) = known.get(&labels) {
            return series.clone();
        }
        drop(known);
        let mut known = self.series.write().unwrap_or_else(|p| p.into_inner());
        if let Some(SharedSeries(series)) = known.get(&labels) {
            return series.clone();
        }
        let series = Arc::new(Series {
            opened: self.opened.get_or_create(&labels).clone(),
            // As ztunnel: the byte series exist from the open on.
            received: self.received_bytes.get_or_create(&labels).clone(),
            sent: self.sent_bytes.get_or_create(&labels).clone(),
            closed: OnceLock::new(),
            labels,
        });
        known.insert(SharedSeries(series.clone()));
        series
    }
}

/// One label set's counters. An open connection keeps a pointer to them
/// rather than its own copy of the 27 label values: a copy per connection
/// cost each agent ≈ 1.2 KiB per idle connection (`idle10k`, issue 35).
/// Like the metric families, these are never removed.
struct Series {
    labels: TcpLabels,
    opened: Counter,
    /// `istio_tcp_received_bytes_total` (bytes to the target) and
    /// `istio_tcp_sent_bytes_total` (from it).
    received: Counter,
    sent: Counter,
    /// `..._closed_total` without a flag, made at the first close (a
    /// series appears when ztunnel's would).
    closed: OnceLock<Counter>,
}

/// A [`Series`] in the set, found by its label set.
struct SharedSeries(Arc<Series>);

impl Borrow<TcpLabels> for SharedSeries {
    fn borrow(&self) -> &TcpLabels {
        &self.0.labels
    }
}

impl Hash for SharedSeries {
    fn hash<H: Hasher>(&self, state: &mut H) {
        self.0.labels.hash(state);
    }
}

impl PartialEq for SharedSeries {
    fn eq(&self, other: &Self) -> bool {
        self.0.labels == other.0.labels
    }
}

impl Eq for SharedSeries {}

/// The baggage-named sources seen so far (at most `limit`).
#[derive(Clone)]
struct DerivedSources {
    seen: Arc<Mutex<HashSet<Named>>>,
    limit: usize,
    warned: Arc<AtomicBool>,
}

impl Default for DerivedSources {
    fn default() -> Self {
        Self {
            seen: Arc::default(),
            limit: MAX_DERIVED_SOURCES,
            warned: Arc::default(),
        }
    }
}

impl DerivedSources {
    /// `named` when it was seen before or there is room for it, else the
    /// unknown source (logged once, when the bound is first reached).
    fn admit(&self, named: Named) -> Named {
        let mut seen = self.seen.lock().unwrap_or_else(|p| p.into_inner());
        if seen.contains(&named) {
            return named;
        }
        if seen.len() < self.limit {
            seen.insert(named.clone());
            return named;
        }
        if !self.warned.swap(true, Ordering::Relaxed) {
            tracing::warn!(
                limit = self.limit,
                "more distinct sources named only by their baggage than the metrics keep apart; further ones are reported as unknown"
            );
        }
        Named::of(None)
    }
}

/// Istio's standard labels of its TCP metrics, as ztunnel writes them
/// (its `CommonTrafficLabels`, locality last).
#[derive(Clone, Debug, PartialEq, Eq, EncodeLabelSet)]
pub struct TcpLabels {
    pub reporter: Label,
    pub source_workload: Label,
    pub source_canonical_service: Label,
    pub source_canonical_revision: Label,
    pub source_workload_namespace: Label,
    pub source_principal: Label,
    pub source_app: Label,
    pub source_version: Label,
    pub source_cluster: Label,
    pub destination_service: Label,
    pub destination_service_namespace: Label,
    pub destination_service_name: Label,
    pub destination_workload: Label,
    pub destination_canonical_service: Label,
    pub destination_canonical_revision: Label,
    pub destination_workload_namespace: Label,
    pub destination_principal: Label,
    pub destination_app: Label,
    pub destination_version: Label,
    pub destination_cluster: Label,
    pub request_protocol: Label,
    pub response_flags: Label,
    pub connection_security_policy: Label,
    #[prometheus(flatten)]
    pub locality: LocalityLabels,
}

/// `source_region`, `source_zone`, `destination_region` and
/// `destination_zone`: present, as in ztunnel, once either end is known
/// (a workload of the store, or one its baggage names), each `unknown`
/// when that end or its locality is not; absent otherwise.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct LocalityLabels(Option<[Label; 4]>);

impl EncodeLabelSet for LocalityLabels {
    fn encode(
        &self,
        encoder: &mut prometheus_client::encoding::LabelSetEncoder,
    ) -> Result<(), std::fmt::Error> {
        let Some(
            [
                source_region,
                source_zone,
                destination_region,
                destination_zone,
            ],
        ) = &self.0
        else {
            return Ok(());
        };
        [
            ("source_region", source_region.as_ref()),
            ("source_zone", source_zone.as_ref()),
            ("destination_region", destination_region.as_ref()),
            ("destination_zone", destination_zone.as_ref()),
        ]
        .encode(encoder)
    }
}

/// The 23 labels go through foldhash, and the metric family's map (std's
/// SipHash, not configurable in `prometheus_client`) hashes the one word
/// that gives: SipHash over every label, four lookups a connection, was
/// ≈ 6 % of a connection's instructions (issue 35, docs/BENCHMARKS.md).
/// Equal label sets give equal words, as `Hash` must. foldhash's seed is
/// random per process, as SipHash's key: label values a peer sends
/// (`baggage`) cannot be chosen to collide.
impl Hash for TcpLabels {
    fn hash<H: Hasher>(&self, state: &mut H) {
        static SEED: OnceLock<foldhash::fast::RandomState> = OnceLock::new();
        let mut fast = SEED.get_or_init(Default::default).build_hasher();
        self.reporter.hash(&mut fast);
        self.source_workload.hash(&mut fast);
        self.source_canonical_service.hash(&mut fast);
        self.source_canonical_revision.hash(&mut fast);
        self.source_workload_namespace.hash(&mut fast);
        self.source_principal.hash(&mut fast);
        self.source_app.hash(&mut fast);
        self.source_version.hash(&mut fast);
        self.source_cluster.hash(&mut fast);
        self.destination_service.hash(&mut fast);
        self.destination_service_namespace.hash(&mut fast);
        self.destination_service_name.hash(&mut fast);
        self.destination_workload.hash(&mut fast);
        self.destination_canonical_service.hash(&mut fast);
        self.destination_canonical_revision.hash(&mut fast);
        self.destination_workload_namespace.hash(&mut fast);
        self.destination_principal.hash(&mut fast);
        self.destination_app.hash(&mut fast);
        self.destination_version.hash(&mut fast);
        self.destination_cluster.hash(&mut fast);
        self.request_protocol.hash(&mut fast);
        self.response_flags.hash(&mut fast);
        self.connection_security_policy.hash(&mut fast);
        self.locality.hash(&mut fast);
        state.write_u64(fast.finish());
    }
}

/// Feeds Istio's TCP metrics from the proxy's connections.
pub(super) struct TcpObserver {
    pub(super) tcp: Arc<TcpMetrics>,
    pub(super) workloads: Arc<RwLock<WorkloadStore>>,
    /// The mesh's, for a destination workload's identity.
    pub(super) trust_domain: TrustDomain,
}

impl TcpObserver {
    pub(super) fn labels(&self, c: &ConnectionInfo<'_>, flags: &'static str) -> TcpLabels {
        let store = self.workloads.read().unwrap_or_else(|p| p.into_inner());
        let local = c.pod.and_then(|key| store.get(key));
        let (src, dst) = if c.direction.local_is_source() {
            let chosen = c.dst_workload.and_then(|key| store.get(key));
            (
                local.or_else(|| store.by_ip(c.src_addr.ip())),
                chosen.or_else(|| store.by_ip(c.dst_addr.ip())),
            )
        } else {
            // Through a network gateway the address is the gateway's.
            let by_address = (!c.src_through_gateway).then(|| store.by_ip(c.src_addr.ip()));
            (
                by_address.flatten(),
                local.or_else(|| store.by_ip(c.dst_addr.ip())),
            )
        };
        // As ztunnel: the source the baggage describes, overridden by the
        // workload found by the source address when there is one ("source
        // is more reliable"); the principal is always the TLS identity.
        let src = match (src, c.derived_source) {
            (None, Some(derived)) => self.tcp.derived.admit(Named::derived(derived)),
            (known, _) => Named::of(known),
        };
        // ztunnel's principals: the source's only from a mutual-TLS
        // handshake (not a plaintext connection's local pod); the
        // destination's the one checked, else the destination workload's
        // identity, whatever the connection's security.
        let mtls_source = c.direction.security_policy() != "unknown";
        let src_identity = c.src_identity.filter(|_| mtls_source);
        let dst_principal = match (c.dst_identity, c.derived_destination, dst) {
            (Some(id), _, _) => Some(Cow::Owned(id.to_owned())),
            (None, None, Some(w)) => Some(Cow::Owned(w.identity(&self.trust_domain).to_string())),
            _ => None,
        };
        // ztunnel's derived destination (double HBONE): the address is the
        // gateway's, the destination's proxy named the workload.
        let dst = match c.derived_destination {
            Some(derived) => self.tcp.derived.admit(Named::derived(derived)),
            None => Named::of(dst),
        };
        // The service, looked up once: its hostname, namespace and name
        // (of a ServiceEntry's host: the entry's).
        let service = c
            .dst_service
            .map(|key| (key, store.service_named(key).map(Arc::as_ref)));
        let destination_service =
            service.map(|(key, found)| WorkloadStore::hostname_of(key, found));
        let service_named = service.map(|(key, found)| {
            found.map_or((&key.namespace, &key.name), |s| (&s.namespace, &s.name))
        });
        let principal = |id: Option<&str>| -> Label {
            id.map_or(Cow::Borrowed(UNKNOWN), |id| Cow::Owned(id.to_owned()))
        };
        TcpLabels {
            reporter: if c.direction.local_is_source() {
                "source"
            } else {
                "destination"
            }
            .into(),
            locality: LocalityLabels((src.known || dst.known).then(|| {
                [
                    src.region.clone(),
                    src.zone.clone(),
                    dst.region.clone(),
                    dst.zone.clone(),
                ]
            })),
            source_workload: src.workload,
            source_canonical_service: src.canonical_service,
            source_canonical_revision: src.revision,
            source_workload_namespace: src.namespace,
            source_principal: principal(src_identity),
            source_app: src.app,
            source_version: src.version,
            source_cluster: src.cluster,
            destination_service: destination_service.map_or(UNKNOWN.into(), Cow::Owned),
            destination_service_namespace: service_named
                .map_or(UNKNOWN.into(), |(namespace, _)| namespace.clone().into()),
            destination_service_name: service_named
                .map_or(UNKNOWN.into(), |(_, name)| name.clone().into()),
            destination_workload: dst.workload,
            destination_canonical_service: dst.canonical_service,
            destination_canonical_revision: dst.revision,
            destination_workload_namespace: dst.namespace,
            destination_principal: dst_principal.unwrap_or(Cow::Borrowed(UNKNOWN)),
            destination_app: dst.app,
            destination_version: dst.version,
            destination_cluster: dst.cluster,
            request_protocol: "tcp".into(),
            response_flags: flags.into(),
            connection_security_policy: c.direction.security_policy().into(),
        }
    }
}

/// A workload's label values (`unknown` when not known), as ztunnel
/// takes them from a workload (`with_source`, `with_destination`) or
/// from its baggage (`with_derived_source`, `with_derived_destination`).
#[derive(Clone, Hash, PartialEq, Eq)]
pub(super) struct Named {
    /// Whether a workload (or its baggage) was found at all.
    known: bool,
    pub(super) workload: Label,
    pub(super) canonical_service: Label,
    pub(super) namespace: Label,
    pub(super) revision: Label,
    pub(super) app: Label,
    pub(super) version: Label,
    pub(super) cluster: Label,
    region: Label,
    zone: Label,
}

impl Named {
    pub(super) fn of(workload: Option<&Workload>) -> Self {
        let Some(w) = workload else {
            return Named {
                known: false,
                workload: UNKNOWN.into(),
                canonical_service: UNKNOWN.into(),
                namespace: UNKNOWN.into(),
                revision: UNKNOWN.into(),
                app: UNKNOWN.into(),
                version: UNKNOWN.into(),
                cluster: UNKNOWN.into(),
                region: UNKNOWN.into(),
                zone: UNKNOWN.into(),
            };
        };
        // Values every connection repeats (`latest`, the default cluster)
        // are borrowed, not allocated four times a connection.
        let text = |v: &str| -> Label {
            match v {
                "" => UNKNOWN.into(),
                REVISION => REVISION.into(),
                CLUSTER => CLUSTER.into(),
                _ => Cow::Owned(v.to_owned()),
            }
        };
        // The owner (a Deployment's name: istiod's `workload_name`, the
        // kube source's controller reference; the pod when none), and
        // the canonical service and revision as Istio derives them.
        let (canonical, revision) = w.canonical_service();
        let locality = w.locality.as_ref();
        Named {
            known: true,
            workload: text(w.owner().1),
            canonical_service: text(canonical),
            namespace: text(&w.namespace),
            revision: text(revision),
            app: text(canonical),
            version: text(revision),
            cluster: if w.cluster_id.is_empty() {
                CLUSTER.into()
            } else {
                text(&w.cluster_id)
            },
            region: text(locality.map_or("", |l| l.region.as_str())),
            zone: text(locality.map_or("", |l| l.zone.as_str())),
        }
    }

    /// ztunnel's `with_derived_source`: the source as its `baggage`
    /// describes it (`source_app` is the workload name, `source_version`
    /// the revision, as there).
    fn derived(baggage: &Baggage) -> Self {
        let value = |v: &Option<String>| -> Label { v.clone().map_or(UNKNOWN.into(), Cow::Owned) };
        Named {
            known: true,
            workload: value(&baggage.workload_name),
            canonical_service: value(&baggage.service_name),
            namespace: value(&baggage.namespace),
            revision: value(&baggage.revision),
            app: value(&baggage.workload_name),
            version: value(&baggage.revision),
            cluster: value(&baggage.cluster_id),
            region: value(&baggage.region),
            zone: value(&baggage.zone),
        }
    }
}

impl ConnectionObserver for TcpObserver {
    fn opened(&self, connection: &ConnectionInfo<'_>) -> Box<dyn OpenConnection> {
        let series = self.tcp.series(self.labels(connection, "-"));
        series.opened.inc();
        Box::new(OpenTcp {
            series,
            tcp: self.tcp.clone(),
            moved_to_target: AtomicU64::new(0),
            moved_from_target: AtomicU64::new(0),
        })
    }

    fn resolved_on_demand(&self, pod: &WorkloadKey, principal: &str, hostname: &str) {
        let source = {
            let store = self.workloads.read().unwrap_or_else(|p| p.into_inner());
            Named::of(store.get(pod))
        };
        let labels = OnDemandDnsLabels::new(source, principal.to_owned().into(), hostname);
        self.tcp.on_demand_dns.get_or_create(&labels).inc();
    }
}

/// An open connection's series, kept for its close: `..._opened_total`
/// minus `..._closed_total` of a series is then its open connections, even
/// when a workload it names changed or left meanwhile.
struct OpenTcp {
    series: Arc<Series>,
    tcp: Arc<TcpMetrics>,
    /// What [`OpenConnection::moved`] counted, so the close adds the rest.
    moved_to_target: AtomicU64,
    moved_from_target: AtomicU64,
}

impl OpenConnection for OpenTcp {
    fn moved(&self, to_target: u64, from_target: u64) {
        if to_target > 0 {
            self.series.received.inc_by(to_target);
            self.moved_to_target.fetch_add(to_target, Ordering::Relaxed);
        }
        if from_target > 0 {
            self.series.sent.inc_by(from_target);
            self.moved_from_target
                .fetch_add(from_target, Ordering::Relaxed);
        }
    }

    fn closed(self: Box<Self>, close: &ConnectionClose) {
        let Self {
            series,
            tcp,
            moved_to_target,
            moved_from_target,
        } = *self;
        // As ztunnel: bytes carry the labels the connection opened with;
        // the close carries how it ended.
        series.received.inc_by(
            close
                .bytes_to_target
                .saturating_sub(moved_to_target.into_inner()),
        );
        series.sent.inc_by(
            close
                .bytes_from_target
                .saturating_sub(moved_from_target.into_inner()),
        );
        let flags = match close.outcome {
            ConnectionOutcome::Success => {
                series
                    .closed
                    .get_or_init(|| tcp.closed.get_or_create(&series.labels).clone())
                    .inc();
                return;
            }
            // Istio's flag for a connection an authorization policy denied.
            ConnectionOutcome::Denied => "DENY",
            // Any other refusal or failure is one of reaching the target.
            ConnectionOutcome::Refused | ConnectionOutcome::Failed => "CONNECT",
            ConnectionOutcome::FailedWith(failure) => match failure {
                Failure::HbonePortTimedOut => "NETWORK_POLICY",
                Failure::NoCertificate => "IDENTITY_ERROR",
                Failure::Http2 => "H2_HANDSHAKE_FAILURE",
                Failure::TlsConfig => "TLS_FAILURE",
            },
            // ztunnel's flag for a connection cut on a revoked certificate.
            ConnectionOutcome::Revoked => "CERT_REVOKED",
        };
        let labels = TcpLabels {
            response_flags: flags.into(),
            ..series.labels.clone()
        };
        tcp.closed.get_or_create(&labels).inc();
        tcp.failed.get_or_create(&labels).inc();
    }
}

#[cfg(test)]
mod tests {
    use std::{
        net::{IpAddr, SocketAddr},
        time::Duration,
    };

    use super::*;
    use crate::{
        metrics::Metrics,
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

    /// `client`'s outbound HBONE connection to the server (through the
    /// service `via`'s VIP, when given), as the proxy reports it.
    fn client_to_server<'a>(
        client: &'a WorkloadKey,
        via: Option<&'a WorkloadKey>,
    ) -> ConnectionInfo<'a> {
        ConnectionInfo {
            direction: Direction::Outbound,
            pod: Some(client),
            src_addr: "198.18.1.2:40000".parse().expect("addr"),
            src_identity: Some("spiffe://cluster.local/ns/default/sa/sa-client"),
            dst_addr: "198.18.2.2:8080".parse().expect("addr"),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_workload: None,
            dst_service: via,
            derived_source: None,
            src_through_gateway: false,
            derived_destination: None,
        }
    }

    fn sample<'a>(text: &'a str, name: &str, must: &[&str]) -> Option<&'a str> {
        text.lines()
            .filter(|l| l.starts_with(&format!("{name}{{")))
            .find(|l| must.iter().all(|m| l.contains(m)))
            .and_then(|l| l.rsplit(' ').next())
    }

    /// A ServiceEntry's two hosts are two services of one name: the
    /// connection names the one its VIP is (by id), each its own series.
    #[test]
    fn each_host_of_a_service_entry_is_its_own_destination_service() {
        let workloads = store();
        {
            let mut store = workloads.write().expect("store");
            store.replace_services(["a.ext.example.com", "b.ext.example.com"].map(|host| {
                crate::state::Service {
                    name: "ext".into(),
                    namespace: "default".into(),
                    hostname: host.into(),
                    vips: vec!["198.19.100.9".parse().expect("ip")],
                    ..Default::default()
                }
            }));
        }
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(workloads, TrustDomain::default());
        let client = WorkloadKey::new("default", "client");
        let hosts = ["a.ext.example.com", "b.ext.example.com"];
        let ids = hosts.map(|host| WorkloadKey::new("default", host));
        for id in &ids {
            observer.opened(&client_to_server(&client, Some(id)));
        }
        let text = metrics.encode(None);
        for host in hosts {
            let labels = [
                &format!("destination_service=\"{host}\"") as &str,
                "destination_service_name=\"ext\"",
                "destination_service_namespace=\"default\"",
            ];
            assert_eq!(
                sample(&text, "istio_tcp_connections_opened_total", &labels),
                Some("1"),
                "{host}: {text}"
            );
        }
    }

    #[test]
    fn a_connection_moves_istio_tcp_metrics_with_istio_labels() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let client = WorkloadKey::new("default", "client");
        // The client connected to the service web's VIP.
        let web = WorkloadKey::new("default", "web");
        let info = client_to_server(&client, Some(&web));
        let open = observer.opened(&info);
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
        open.closed(&ConnectionClose {
            bytes_to_target: 1000,
            bytes_from_target: 10,
            duration: Duration::from_millis(5),
            outcome: ConnectionOutcome::Success,
        });
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
        assert!(
            !text.contains("istio_tcp_connections_failed_total{"),
            "a success is no failure: {text}"
        );
        assert!(text.ends_with("# EOF\n"));
    }

    #[test]
    fn connections_with_one_label_set_share_its_series() {
        let observer = TcpObserver {
            tcp: Arc::default(),
            workloads: store(),
            trust_domain: TrustDomain::default(),
        };
        let (client, service) = (
            WorkloadKey::new("default", "client"),
            WorkloadKey::new("default", "svc"),
        );
        let direct = client_to_server(&client, None);
        let via_service = client_to_server(&client, Some(&service));
        let open = [
            observer.opened(&direct),
            observer.opened(&direct),
            observer.opened(&via_service),
        ];
        // One copy of each label set, however many connections hold it.
        let known = observer.tcp.series.read().expect("series");
        assert_eq!(known.len(), 2);
        let opened = |info: &ConnectionInfo<'_>| {
            known
                .get(&observer.labels(info, "-"))
                .map(|SharedSeries(series)| series.opened.get())
        };
        assert_eq!(opened(&direct), Some(2));
        assert_eq!(opened(&via_service), Some(1));
        drop(known);
        drop(open);
    }

    #[test]
    fn bytes_count_as_they_move_and_the_close_adds_only_the_rest() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let client = WorkloadKey::new("default", "client");
        let info = client_to_server(&client, None);
        let open = observer.opened(&info);
        let series = ["destination_workload=\"server\""];
        let bytes = |text: &str| {
            (
                sample(text, "istio_tcp_received_bytes_total", &series).map(str::to_owned),
                sample(text, "istio_tcp_sent_bytes_total", &series).map(str::to_owned),
            )
        };
        // The series exist from the open on, as ztunnel's.
        let text = metrics.encode(None);
        assert_eq!(bytes(&text), (Some("0".into()), Some("0".into())), "{text}");
        open.moved(5, 0);
        open.moved(0, 2);
        open.moved(1, 0);
        let text = metrics.encode(None);
        assert_eq!(bytes(&text), (Some("6".into()), Some("2".into())), "{text}");
        // The close's totals include what was counted already.
        open.closed(&ConnectionClose {
            bytes_to_target: 7,
            bytes_from_target: 3,
            duration: Duration::from_millis(5),
            outcome: ConnectionOutcome::Success,
        });
        let text = metrics.encode(None);
        assert_eq!(bytes(&text), (Some("7".into()), Some("3".into())), "{text}");
    }

    #[test]
    fn failures_ztunnel_names_apart_carry_its_flags() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let client = WorkloadKey::new("default", "client");
        for failure in [
            Failure::HbonePortTimedOut,
            Failure::NoCertificate,
            Failure::Http2,
            Failure::TlsConfig,
        ] {
            observer
                .opened(&client_to_server(&client, None))
                .closed(&ConnectionClose {
                    bytes_to_target: 0,
                    bytes_from_target: 0,
                    duration: Duration::ZERO,
                    outcome: ConnectionOutcome::FailedWith(failure),
                });
        }
        let text = metrics.encode(None);
        for flag in [
            "NETWORK_POLICY",
            "IDENTITY_ERROR",
            "H2_HANDSHAKE_FAILURE",
            "TLS_FAILURE",
        ] {
            let labels = [&format!("response_flags=\"{flag}\"")[..]];
            for family in [
                "istio_tcp_connections_closed_total",
                "istio_tcp_connections_failed_total",
            ] {
                assert_eq!(sample(&text, family, &labels), Some("1"), "{flag}: {text}");
            }
        }
    }

    #[test]
    fn a_connection_closes_in_the_series_it_opened_in_though_its_peer_left() {
        let metrics = Metrics::new();
        let workloads = store();
        let observer = metrics.connection_observer(workloads.clone(), TrustDomain::default());
        let client = WorkloadKey::new("default", "client");
        let info = client_to_server(&client, None);
        let open = observer.opened(&info);
        // The destination pod is deleted while the connection lives.
        let gone = workloads.write().expect("store").remove("default/server");
        assert!(gone.is_some(), "the store held the server");
        open.closed(&ConnectionClose {
            bytes_to_target: 7,
            bytes_from_target: 3,
            duration: Duration::from_millis(5),
            outcome: ConnectionOutcome::Failed,
        });
        let text = metrics.encode(None);
        let server = ["destination_workload=\"server\""];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &server),
            Some("1"),
            "{text}"
        );
        // Closed, as it ended, in the series it opened in: a dashboard's
        // opened minus closed is its open connections, zero now.
        let closed = [server[0], "response_flags=\"CONNECT\""];
        assert_eq!(
            sample(&text, "istio_tcp_connections_closed_total", &closed),
            Some("1"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "istio_tcp_received_bytes_total", &server),
            Some("7")
        );
        assert_eq!(
            sample(&text, "istio_tcp_sent_bytes_total", &server),
            Some("3")
        );
        assert!(
            !text.contains("destination_workload=\"unknown\""),
            "no series for a peer unknown at the close: {text}"
        );
    }

    #[test]
    fn a_deployment_pod_is_named_by_its_owner_canonical_service_and_locality() {
        let mut client = workload("client-7d9f-x2", "198.18.1.2", "a");
        client.workload_name = "sleep".into();
        client.canonical_name = "sleep-svc".into();
        client.canonical_revision = "v1".into();
        client.cluster_id = "east".into();
        client.locality = Some(crate::state::Locality {
            region: "r1".into(),
            zone: "z1".into(),
            subzone: String::new(),
        });
        let mut store = WorkloadStore::new();
        store.replace_all([client]);
        let metrics = Metrics::new();
        let observer =
            metrics.connection_observer(Arc::new(RwLock::new(store)), TrustDomain::default());
        let pod = WorkloadKey::new("default", "client-7d9f-x2");
        let mut info = ConnectionInfo {
            direction: Direction::Outbound,
            pod: Some(&pod),
            src_addr: SocketAddr::from(([127, 0, 0, 1], 40000)),
            src_identity: None,
            dst_addr: "198.18.9.9:80".parse().expect("addr"),
            dst_identity: None,
            dst_workload: None,
            dst_service: None,
            derived_source: None,
            src_through_gateway: false,
            derived_destination: None,
        };
        observer.opened(&info);
        let text = metrics.encode(None);
        let labels = [
            "source_workload=\"sleep\"",
            "source_canonical_service=\"sleep-svc\"",
            "source_canonical_revision=\"v1\"",
            "source_app=\"sleep-svc\"",
            "source_version=\"v1\"",
            "source_cluster=\"east\"",
            "source_region=\"r1\",source_zone=\"z1\",destination_region=\"unknown\",destination_zone=\"unknown\"}",
        ];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &labels),
            Some("1"),
            "{text}"
        );
        // Neither end known: no locality labels at all, as ztunnel.
        info.pod = None;
        info.src_addr = "198.18.9.8:5000".parse().expect("addr");
        observer.opened(&info);
        let text = metrics.encode(None);
        let unknown = text
            .lines()
            .find(|l| l.contains("source_workload=\"unknown\""))
            .unwrap_or_else(|| panic!("no series of unknown ends:\n{text}"));
        assert!(!unknown.contains("region"), "{unknown}");
    }

    #[test]
    fn a_denied_connection_closes_with_response_flags_deny() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let server = WorkloadKey::new("default", "server");
        let info = ConnectionInfo {
            direction: Direction::Inbound,
            pod: Some(&server),
            src_addr: "198.18.1.2:5000".parse().expect("addr"),
            src_identity: Some("spiffe://cluster.local/ns/default/sa/intruder"),
            dst_addr: "198.18.2.2:8080".parse().expect("addr"),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_workload: None,
            dst_service: None,
            derived_source: None,
            src_through_gateway: false,
            derived_destination: None,
        };
        let denied = ConnectionClose {
            bytes_to_target: 0,
            bytes_from_target: 0,
            duration: Duration::ZERO,
            outcome: ConnectionOutcome::Denied,
        };
        observer.opened(&info).closed(&denied);
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
        // And counted failed, as ztunnel counts every flagged close.
        assert_eq!(
            sample(
                &text,
                "istio_tcp_connections_failed_total",
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

    /// Double HBONE: the address is the gateway's (here `client`'s, a
    /// workload the store knows), the destination's proxy named the
    /// workload in its answer's baggage, which the labels take.
    #[test]
    fn through_a_gateway_the_source_reporter_names_the_destination_by_its_answer() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let client = WorkloadKey::new("default", "client");
        let baggage = Baggage {
            cluster_id: Some("west".into()),
            namespace: Some("default".into()),
            workload_name: Some("server".into()),
            service_name: Some("server".into()),
            revision: Some("latest".into()),
            ..Baggage::default()
        };
        observer.opened(&ConnectionInfo {
            direction: Direction::Outbound,
            pod: Some(&client),
            src_addr: "198.18.1.2:5000".parse().expect("addr"),
            src_identity: Some("spiffe://cluster.local/ns/default/sa/sa-client"),
            dst_addr: "198.18.1.2:15008".parse().expect("addr"),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_workload: None,
            dst_service: None,
            derived_source: None,
            src_through_gateway: false,
            derived_destination: Some(&baggage),
        });
        let text = metrics.encode(None);
        let derived = [
            "reporter=\"source\"",
            "destination_workload=\"server\"",
            "destination_canonical_revision=\"latest\"",
            "destination_cluster=\"west\"",
        ];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &derived),
            Some("1"),
            "{text}"
        );
    }

    #[test]
    fn the_destination_names_an_unknown_source_by_its_baggage_a_known_one_by_its_address() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let server = WorkloadKey::new("default", "server");
        let baggage = Baggage {
            cluster_id: Some("east".into()),
            namespace: Some("shop".into()),
            workload_name: Some("productpage-v1".into()),
            service_name: Some("productpage".into()),
            revision: Some("v1".into()),
            ..Baggage::default()
        };
        let from = |src: &str| ConnectionInfo {
            direction: Direction::Inbound,
            pod: Some(&server),
            src_addr: src.parse().expect("addr"),
            src_identity: Some("spiffe://cluster.local/ns/shop/sa/productpage"),
            dst_addr: "198.18.2.2:8080".parse().expect("addr"),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_workload: None,
            dst_service: None,
            derived_source: Some(&baggage),
            src_through_gateway: false,
            derived_destination: None,
        };
        // 198.18.9.9 is no workload the store knows: the baggage names it.
        observer.opened(&from("198.18.9.9:5000"));
        // 198.18.1.2 is `client`: its address wins over what it says.
        observer.opened(&from("198.18.1.2:5000"));
        let text = metrics.encode(None);
        let principal = "source_principal=\"spiffe://cluster.local/ns/shop/sa/productpage\"";
        let derived = [
            "reporter=\"destination\"",
            "source_workload=\"productpage-v1\"",
            "source_canonical_service=\"productpage\"",
            "source_canonical_revision=\"v1\"",
            "source_workload_namespace=\"shop\"",
            principal,
            "source_app=\"productpage-v1\"",
            "source_version=\"v1\"",
            "source_cluster=\"east\"",
            "destination_workload=\"server\"",
        ];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &derived),
            Some("1"),
            "{text}"
        );
        let known = [
            "source_workload=\"client\"",
            "source_canonical_service=\"client\"",
            "source_workload_namespace=\"default\"",
            "source_cluster=\"Kubernetes\"",
            principal,
        ];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &known),
            Some("1"),
            "{text}"
        );
        // Through another network's gateway, `client`'s address is the
        // gateway's: the baggage names the source.
        observer.opened(&ConnectionInfo {
            src_through_gateway: true,
            derived_destination: None,
            ..from("198.18.1.2:5001")
        });
        let text = metrics.encode(None);
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &derived),
            Some("2"),
            "{text}"
        );
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &known),
            Some("1"),
            "{text}"
        );
        // Absent values print `unknown`.
        let partial = Baggage {
            namespace: Some("shop".into()),
            ..Baggage::default()
        };
        observer.opened(&ConnectionInfo {
            derived_source: Some(&partial),
            src_through_gateway: false,
            derived_destination: None,
            ..from("198.18.9.8:5000")
        });
        let text = metrics.encode(None);
        let unknown = [
            "source_workload=\"unknown\"",
            "source_canonical_service=\"unknown\"",
            "source_workload_namespace=\"shop\"",
            "source_cluster=\"unknown\"",
        ];
        assert_eq!(
            sample(&text, "istio_tcp_connections_opened_total", &unknown),
            Some("1"),
            "{text}"
        );
    }

    #[test]
    fn sources_named_by_baggage_alone_are_bounded() {
        let metrics = Metrics::new();
        let observer = TcpObserver {
            tcp: Arc::new(TcpMetrics {
                derived: DerivedSources {
                    limit: 2,
                    ..DerivedSources::default()
                },
                ..TcpMetrics::clone(&metrics.inner.tcp)
            }),
            workloads: store(),
            trust_domain: TrustDomain::default(),
        };
        let server = WorkloadKey::new("default", "server");
        let open = |workload: &str| {
            let baggage = Baggage {
                namespace: Some("shop".into()),
                workload_name: Some(workload.into()),
                ..Baggage::default()
            };
            observer.opened(&ConnectionInfo {
                direction: Direction::Inbound,
                pod: Some(&server),
                // No workload the store knows: only the baggage names it.
                src_addr: "198.18.9.9:5000".parse().expect("addr"),
                src_identity: Some("spiffe://cluster.local/ns/shop/sa/any"),
                dst_addr: "198.18.2.2:8080".parse().expect("addr"),
                dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
                dst_workload: None,
                dst_service: None,
                derived_source: Some(&baggage),
                src_through_gateway: false,
                derived_destination: None,
            });
        };
        for workload in ["first", "second", "third", "fourth", "first"] {
            open(workload);
        }
        let text = metrics.encode(None);
        let opened = |workload: &str| {
            sample(
                &text,
                "istio_tcp_connections_opened_total",
                &[&format!("source_workload=\"{workload}\"")],
            )
            .map(str::to_string)
        };
        // The first two keep their names (a known one still after the
        // bound); the third and fourth are folded into `unknown`.
        assert_eq!(opened("first").as_deref(), Some("2"), "{text}");
        assert_eq!(opened("second").as_deref(), Some("1"), "{text}");
        assert_eq!(opened("third"), None, "{text}");
        assert_eq!(opened("fourth"), None, "{text}");
        assert_eq!(opened("unknown").as_deref(), Some("2"), "{text}");
    }

    #[test]
    fn inbound_plaintext_is_reported_by_the_destination_without_mtls() {
        let metrics = Metrics::new();
        let observer = metrics.connection_observer(store(), TrustDomain::default());
        let server = WorkloadKey::new("default", "server");
        let info = ConnectionInfo {
            direction: Direction::InboundPlaintext,
            pod: Some(&server),
            src_addr: "198.18.9.9:5000".parse().unwrap(),
            src_identity: None,
            dst_addr: "198.18.2.2:8080".parse().unwrap(),
            dst_identity: Some("spiffe://cluster.local/ns/default/sa/sa-server"),
            dst_workload: None,
            dst_service: None,
            derived_source: None,
            src_through_gateway: false,
            derived_destination: None,
        };
        // Refused before it was reported open: both at close.
        observer.opened(&info).closed(&ConnectionClose {
            bytes_to_target: 0,
            bytes_from_target: 0,
            duration: Duration::ZERO,
            outcome: ConnectionOutcome::Failed,
        });
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
        // Counted open too, in the series it closed in (flags aside).
        assert_eq!(
            sample(
                &text,
                "istio_tcp_connections_opened_total",
                &[&labels[..], &["response_flags=\"-\""]].concat()
            ),
            Some("1")
        );
    }
}

//! The DNS proxy's metrics, as ztunnel exports them (names, help texts,
//! labels, histogram buckets), under the `istio_` prefix: registered in the
//! agent's registry by the metrics module's `Metrics`.

use std::time::Duration;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, histogram::Histogram},
    registry::Registry,
};

/// ztunnel's buckets for the upstream duration, in its order (0.005 before
/// 0.001 is ztunnel's; kept so that dashboards see the same series).
pub const UPSTREAM_DURATION_BUCKETS: [f64; 6] = [0.005, 0.001, 0.01, 0.1, 1.0, 5.0];

/// The label value of something not known, as in Istio's other metrics.
const UNKNOWN: &str = "unknown";

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct DnsLabels {
    /// The query type, lowercase (`a`, `aaaa`, `srv`...).
    pub request_query_type: String,
    /// `udp` or `tcp`.
    pub request_protocol: String,
    pub source_canonical_service: String,
    pub source_canonical_revision: String,
}

impl DnsLabels {
    pub fn new(
        query_type: &str,
        protocol: Protocol,
        canonical_service: &str,
        canonical_revision: &str,
    ) -> Self {
        Self {
            request_query_type: query_type.to_ascii_lowercase(),
            request_protocol: protocol.as_str().to_string(),
            source_canonical_service: or_unknown(canonical_service),
            source_canonical_revision: or_unknown(canonical_revision),
        }
    }
}

fn or_unknown(value: &str) -> String {
    if value.is_empty() {
        UNKNOWN.to_string()
    } else {
        value.to_string()
    }
}

/// The transport a query came on.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Protocol {
    Udp,
    Tcp,
}

impl Protocol {
    pub fn as_str(self) -> &'static str {
        match self {
            Protocol::Udp => "udp",
            Protocol::Tcp => "tcp",
        }
    }
}

type HistogramFamily = Family<DnsLabels, Histogram, fn() -> Histogram>;

fn upstream_histogram() -> Histogram {
    Histogram::new(UPSTREAM_DURATION_BUCKETS)
}

/// Shared by every pod's server (families synchronise themselves).
#[derive(Clone)]
pub struct DnsMetrics {
    requests: Family<DnsLabels, Counter>,
    upstream_requests: Family<DnsLabels, Counter>,
    upstream_failures: Family<DnsLabels, Counter>,
    upstream_duration: HistogramFamily,
}

impl Default for DnsMetrics {
    fn default() -> Self {
        Self {
            requests: Family::default(),
            upstream_requests: Family::default(),
            upstream_failures: Family::default(),
            upstream_duration: Family::new_with_constructor(upstream_histogram),
        }
    }
}

impl std::fmt::Debug for DnsMetrics {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DnsMetrics").finish_non_exhaustive()
    }
}

impl DnsMetrics {
    /// Registers the families in `istio` (the registry with the `istio`
    /// prefix), with ztunnel's names and help texts.
    pub fn register(&self, istio: &mut Registry) {
        istio.register(
            "dns_requests",
            "Total number of DNS requests (unstable)",
            self.requests.clone(),
        );
        istio.register(
            "dns_upstream_requests",
            "Total number of DNS requests forwarded to upstream (unstable)",
            self.upstream_requests.clone(),
        );
        istio.register(
            "dns_upstream_failures",
            "Total number of DNS requests that failed to forward upstream (unstable)",
            self.upstream_failures.clone(),
        );
        istio.register(
            "dns_upstream_request_duration_seconds",
            "Total time in seconds Istio takes to get DNS response from upstream (unstable)",
            self.upstream_duration.clone(),
        );
    }

    /// A query was received (answered here or forwarded).
    pub fn request(&self, labels: &DnsLabels) {
        self.requests.get_or_create(labels).inc();
    }

    /// A query was forwarded; it took `took` and failed if `failed`.
    pub fn forwarded(&self, labels: &DnsLabels, took: Duration, failed: bool) {
        self.upstream_requests.get_or_create(labels).inc();
        self.upstream_duration
            .get_or_create(labels)
            .observe(took.as_secs_f64());
        if failed {
            self.upstream_failures.get_or_create(labels).inc();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn labels_as_ztunnel_writes_them() {
        let l = DnsLabels::new("AAAA", Protocol::Tcp, "", "v1");
        assert_eq!(l.request_query_type, "aaaa");
        assert_eq!(l.request_protocol, "tcp");
        assert_eq!(l.source_canonical_service, "unknown");
        assert_eq!(l.source_canonical_revision, "v1");
    }

    #[test]
    fn exposition_names() {
        let m = DnsMetrics::default();
        let mut registry = Registry::default();
        m.register(registry.sub_registry_with_prefix("istio"));
        let l = DnsLabels::new("A", Protocol::Udp, "web", "v1");
        m.request(&l);
        m.forwarded(&l, Duration::from_millis(2), true);
        let mut out = String::new();
        prometheus_client::encoding::text::encode(&mut out, &registry).expect("encode");
        for want in [
            "istio_dns_requests_total{request_query_type=\"a\",request_protocol=\"udp\",source_canonical_service=\"web\",source_canonical_revision=\"v1\"} 1",
            "istio_dns_upstream_requests_total{",
            "istio_dns_upstream_failures_total{",
            "istio_dns_upstream_request_duration_seconds_bucket{",
            "le=\"0.005\"",
        ] {
            assert!(out.contains(want), "{want} missing in\n{out}");
        }
    }
}

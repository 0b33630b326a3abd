//! `istio_on_demand_dns_total`: connections whose service endpoint was a
//! DNS name the proxy resolved (`proxy/on_demand_dns.rs`), labelled as
//! ztunnel labels it (its `OnDemandDnsLabels`: the source, and the name).

use prometheus_client::encoding::EncodeLabelSet;

use super::istio_tcp::{Label, Named};

/// ztunnel's labels, in its order.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct OnDemandDnsLabels {
    pub source_workload: Label,
    pub source_canonical_service: Label,
    pub source_canonical_revision: Label,
    pub source_workload_namespace: Label,
    pub source_principal: Label,
    pub source_app: Label,
    pub source_version: Label,
    pub source_cluster: Label,
    pub hostname: Label,
}

impl OnDemandDnsLabels {
    /// For a connection from `source` (its TLS identity `principal`) to a
    /// workload named `hostname`.
    pub(super) fn new(source: Named, principal: Label, hostname: &str) -> Self {
        OnDemandDnsLabels {
            source_workload: source.workload,
            source_canonical_service: source.canonical_service,
            source_canonical_revision: source.revision,
            source_workload_namespace: source.namespace,
            source_principal: principal,
            source_app: source.app,
            source_version: source.version,
            source_cluster: source.cluster,
            hostname: hostname.to_owned().into(),
        }
    }
}

//! shunt's own metrics of the passthrough fast path (`fastpath/`):
//! whether the destination table is in use, its size, why it was turned
//! off, and the kernel's counters (connects that went direct, that went to
//! the proxy because the table was off or the connection could not be
//! tracked, events lost). The connections themselves are counted in
//! Istio's TCP metrics, as the proxy counts them.

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
pub struct ReasonLabel {
    pub reason: String,
}

/// Cheap to clone (shared).
#[derive(Clone, Default)]
pub struct FastPathMetrics {
    pub table_valid: Gauge,
    pub destinations: Gauge,
    pub invalidations: Family<ReasonLabel, Counter>,
    pub direct: Counter,
    pub proxied: Family<ReasonLabel, Counter>,
    pub events_dropped: Counter,
    /// Flow 2: same-node mesh connections carried in the kernel.
    pub mesh_local: Counter,
    pub mesh_local_on: Gauge,
}

impl FastPathMetrics {
    pub(super) fn register(&self, shunt: &mut Registry) {
        shunt.register(
            "fast_path_table_valid",
            "1 while the fast-path destination table is complete and in use; 0: every connect of an enrolled pod goes through the proxy",
            self.table_valid.clone(),
        );
        shunt.register(
            "fast_path_destinations",
            "Destinations (mesh workload IPs, service VIPs) in the fast-path table",
            self.destinations.clone(),
        );
        shunt.register(
            "fast_path_table_invalidations",
            "Times the fast-path table was turned off (every flow back through the proxy), by reason",
            self.invalidations.clone(),
        );
        shunt.register(
            "fast_path_connections",
            "Connects of enrolled pods that went direct (the passthrough fast path)",
            self.direct.clone(),
        );
        shunt.register(
            "fast_path_proxied_connections",
            "Connects the fast path would have taken that went to the proxy: table_invalid (the table was off), untracked (no record could be kept); same-node mesh: mesh_off (flow 2 off), mesh_untracked (no record), mesh_flow_unrecorded (the SYN's entry could not be written: the destination's proxy got it as plaintext)",
            self.proxied.clone(),
        );
        shunt.register(
            "fast_path_mesh_connections",
            "Connects between mesh pods of this node carried in the kernel without the proxy (no mTLS: the fast path's flow 2)",
            self.mesh_local.clone(),
        );
        shunt.register(
            "fast_path_mesh_enabled",
            "1 while same-node mesh connections may be carried in the kernel (the authorization verdicts are compiled whole); 0: they go through the proxy",
            self.mesh_local_on.clone(),
        );
        shunt.register(
            "fast_path_events_dropped",
            "Fast-path connection events lost because the kernel's ring buffer was full (their connections are missing from the Istio TCP metrics)",
            self.events_dropped.clone(),
        );
    }

    /// The table was turned off for `reason`.
    pub fn invalidated(&self, reason: &str) {
        self.table_valid.set(0);
        self.invalidations
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .inc();
    }

    pub fn proxied_for(&self, reason: &str) -> Counter {
        self.proxied
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .clone()
    }
}

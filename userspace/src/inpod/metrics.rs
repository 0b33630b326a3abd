//! What the ZDS server counts: ztunnel's refusals of `AddWorkload`, the
//! adds sent again after one (with back-off), and the ztunnel connections
//! open now (istio-cni's `ztunnel_connected`).

use prometheus_client::{
    metrics::{counter::Counter, gauge::Gauge},
    registry::Registry,
};

#[derive(Clone, Debug, Default)]
pub struct ZdsMetrics {
    refusals: Counter,
    retries: Counter,
    connections: Gauge,
}

impl ZdsMetrics {
    /// Registers the metrics under `shunt` (`shunt_ztunnel_*`).
    pub fn register(&self, shunt: &mut Registry) {
        shunt.register(
            "ztunnel_add_refusals",
            "AddWorkload requests ztunnel answered with an error (the pod stays pending, redirected so that its traffic fails closed, and is sent again with back-off)",
            self.refusals.clone(),
        );
        shunt.register(
            "ztunnel_add_retries",
            "AddWorkload requests sent again after ztunnel refused the pod",
            self.retries.clone(),
        );
        shunt.register(
            "ztunnel_connections",
            "ztunnel connections open on the ZDS socket (the newest is served)",
            self.connections.clone(),
        );
    }

    pub(super) fn refused(&self) {
        self.refusals.inc();
    }

    pub(super) fn retried(&self) {
        self.retries.inc();
    }

    pub(super) fn set_connections(&self, open: usize) {
        self.connections
            .set(i64::try_from(open).unwrap_or(i64::MAX));
    }
}

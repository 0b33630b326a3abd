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
    pub ranges: Gauge,
    pub invalidations: Family<ReasonLabel, Counter>,
    pub direct: Counter,
    pub proxied: Family<ReasonLabel, Counter>,
    pub events_dropped: Counter,
    /// Flow 2: same-node mesh connections carried in the kernel.
    pub mesh_local: Counter,
    pub mesh_local_on: Gauge,
    /// Set once the fast path's tasks started (`--fast-path on`): read by
    /// `shunt status`.
    pub enabled: std::sync::Arc<std::sync::atomic::AtomicBool>,
    /// Connections carried per local pod; written by the reporter only
    /// (`fastpath::report`), read by `/status`.
    per_pod: std::sync::Arc<std::sync::Mutex<PerPod>>,
}

/// Local pods' fast-path connection counts, at most [`MAX_COUNTED_PODS`].
type PerPod = std::collections::BTreeMap<crate::state::WorkloadKey, crate::api::PodFastPath>;

/// Pods counted per pod: as many as the kernel has slots (a pod that left
/// keeps its line until the agent restarts; past the bound, new pods go
/// uncounted here, never in the Istio metrics).
const MAX_COUNTED_PODS: usize = shunt_common::MAX_PODS as usize;

/// Which of a pod's counts an opened connection adds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PodFastPathKind {
    Passthrough,
    MeshOutbound,
    MeshInbound,
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
            "fast_path_ranges",
            "Address ranges (ServiceEntry CIDRs) in the fast-path table: a connect into one goes through the proxy",
            self.ranges.clone(),
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

    /// What `shunt status` shows of the fast path: these counters, and flow
    /// 2's last write (`mesh_local`) with the kernel authorization point's
    /// (`authz`) to say why it is off.
    pub fn status(
        &self,
        mesh_local: Option<&crate::redirect::MeshLocalWritten>,
        authz: Option<&crate::api::KernelAuthzStatus>,
    ) -> crate::api::FastPathStatus {
        let enabled = self.enabled.load(std::sync::atomic::Ordering::Relaxed);
        let mesh_local_on = enabled && self.mesh_local_on.get() == 1;
        let mesh_local_off_reason = (!mesh_local_on).then(|| {
            if !enabled {
                "--fast-path off".to_string()
            } else if let Some(error) = mesh_local.and_then(|m| m.error.as_ref()) {
                format!("its maps could not be written: {error}")
            } else if let Some(error) = authz.and_then(|a| a.error.as_ref()) {
                format!("the authorization verdicts are not all in the kernel: {error}")
            } else if authz.is_none() {
                "the authorization verdicts are not compiled (--kernel-authz off, or not yet)"
                    .to_string()
            } else {
                "not yet written".to_string()
            }
        });
        crate::api::FastPathStatus {
            enabled,
            table_valid: enabled && self.table_valid.get() == 1,
            destinations: u64::try_from(self.destinations.get()).unwrap_or(0),
            ranges: u64::try_from(self.ranges.get()).unwrap_or(0),
            mesh_local_on,
            mesh_local_off_reason,
            passthrough_connections: self.direct.get(),
            mesh_local_connections: self.mesh_local.get(),
            events_dropped: self.events_dropped.get(),
        }
    }

    /// One more connection of `pod` carried by the fast path.
    pub fn count_pod(&self, pod: &crate::state::WorkloadKey, kind: PodFastPathKind) {
        let mut per_pod = self.per_pod.lock().unwrap_or_else(|p| p.into_inner());
        if !per_pod.contains_key(pod) && per_pod.len() >= MAX_COUNTED_PODS {
            return;
        }
        let counts = per_pod.entry(pod.clone()).or_default();
        match kind {
            PodFastPathKind::Passthrough => counts.passthrough += 1,
            PodFastPathKind::MeshOutbound => counts.mesh_outbound += 1,
            PodFastPathKind::MeshInbound => counts.mesh_inbound += 1,
        }
    }

    /// Every counted pod's connections (a copy).
    pub fn per_pod(&self) -> PerPod {
        self.per_pod
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }

    pub fn proxied_for(&self, reason: &str) -> Counter {
        self.proxied
            .get_or_create(&ReasonLabel {
                reason: reason.to_string(),
            })
            .clone()
    }
}

/// Istio's TCP metrics for the connections the kernel carried, resolved
/// once per label set: the fast path's reporter keeps a [`TcpSeries`] per
/// (source, destination) instead of taking the store's lock, building the
/// 23 labels and looking the series up for every event. The labels are the
/// proxy's observer's, by construction.
pub struct KernelConnections {
    observer: super::istio_tcp::TcpObserver,
}

impl super::Metrics {
    /// Istio's TCP metrics for the fast path's reporter, naming workloads
    /// from `workloads`.
    pub fn kernel_connections(
        &self,
        workloads: std::sync::Arc<std::sync::RwLock<crate::store::WorkloadStore>>,
        trust_domain: crate::state::TrustDomain,
    ) -> KernelConnections {
        KernelConnections {
            observer: super::istio_tcp::TcpObserver {
                tcp: self.inner.tcp.clone(),
                workloads,
                trust_domain,
            },
        }
    }
}

impl KernelConnections {
    /// The series `connection` counts in (a successful one: a failure goes
    /// through the proxy's observer).
    pub fn series(&self, connection: &crate::proxy::ConnectionInfo<'_>) -> TcpSeries {
        TcpSeries {
            labels: self.observer.labels(connection, "-"),
            tcp: self.observer.tcp.clone(),
            opened: None,
            closed: None,
        }
    }
}

/// One label set's counters, each looked up on first use (so that a series
/// appears when the proxy's would: opened at the open, the rest at the
/// close) and then kept.
pub struct TcpSeries {
    labels: super::istio_tcp::TcpLabels,
    tcp: std::sync::Arc<super::istio_tcp::TcpMetrics>,
    opened: Option<Counter>,
    closed: Option<[Counter; 3]>,
}

impl TcpSeries {
    pub fn opened(&mut self) {
        let (tcp, labels) = (&self.tcp, &self.labels);
        self.opened
            .get_or_insert_with(|| tcp.opened.get_or_create(labels).clone())
            .inc();
    }

    /// A successful close, with the bytes as the proxy's observer counts
    /// them (received: to the target; sent: from it).
    pub fn closed(&mut self, bytes_to_target: u64, bytes_from_target: u64) {
        let (tcp, labels) = (&self.tcp, &self.labels);
        let [closed, received, sent] = self.closed.get_or_insert_with(|| {
            [
                tcp.closed.get_or_create(labels).clone(),
                tcp.received_bytes.get_or_create(labels).clone(),
                tcp.sent_bytes.get_or_create(labels).clone(),
            ]
        });
        received.inc_by(bytes_to_target);
        sent.inc_by(bytes_from_target);
        closed.inc();
    }
}

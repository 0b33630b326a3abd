//! The access log: one line per connection or stream (who talked to whom,
//! how much, how long, how it ended), which also feeds the counters and the
//! observers' records.

use std::{
    net::{IpAddr, SocketAddr},
    sync::{Arc, atomic::Ordering},
    time::Instant,
};

use super::{
    Baggage, ConnectionClose, ConnectionInfo, ConnectionOutcome, Decision, OpenConnection,
    RefusalReason, Shared, lookup::WorkloadLookup, observe,
};
use crate::state::{Workload, WorkloadKey};

/// The access line's target, for its writers and readers.
pub(crate) const TARGET: &str = "shunt::access";

/// Istio's cluster name when a workload names none.
const DEFAULT_CLUSTER: &str = "Kubernetes";

/// One end of a connection as ztunnel's access line names it
/// (`src.workload`, `src.namespace`, `src.cluster` and the `dst.` ones):
/// the workload, the one its baggage describes, or none (the fields are
/// then left out, as ztunnel leaves them out).
pub(crate) enum End<'a> {
    Workload(Arc<Workload>),
    Baggage(&'a Baggage),
    Unknown,
}

impl<'a> End<'a> {
    /// The source: the workload at its address (unless that address is a
    /// gateway's, `None`), else the one its baggage names.
    pub(crate) fn source(
        workloads: &dyn WorkloadLookup,
        addr: Option<IpAddr>,
        baggage: Option<&'a Baggage>,
    ) -> Self {
        match (addr.and_then(|ip| workloads.workload_by_ip(ip)), baggage) {
            (Some(w), _) => End::Workload(w),
            (None, Some(b)) => End::Baggage(b),
            (None, None) => End::Unknown,
        }
    }

    /// The workload `key`, when the proxy chose it by name
    /// ([`ConnectionInfo::dst_workload`]).
    pub(crate) fn named(workloads: &dyn WorkloadLookup, key: &WorkloadKey) -> Self {
        workloads.workload(key).map_or(End::Unknown, End::Workload)
    }

    /// The destination: the one its proxy named in its baggage (through a
    /// gateway, whose address it is), else the workload at its address.
    pub(crate) fn destination(
        workloads: &dyn WorkloadLookup,
        addr: IpAddr,
        baggage: Option<&'a Baggage>,
    ) -> Self {
        match baggage {
            Some(b) => End::Baggage(b),
            None => workloads
                .workload_by_ip(addr)
                .map_or(End::Unknown, End::Workload),
        }
    }

    /// The pod's name, as ztunnel writes it (not the owner the metrics
    /// name); the baggage's workload name.
    pub(crate) fn workload(&self) -> Option<&str> {
        match self {
            End::Workload(w) => non_empty(&w.name),
            End::Baggage(b) => b.workload_name.as_deref(),
            End::Unknown => None,
        }
    }

    pub(crate) fn namespace(&self) -> Option<&str> {
        match self {
            End::Workload(w) => non_empty(&w.namespace),
            End::Baggage(b) => b.namespace.as_deref(),
            End::Unknown => None,
        }
    }

    pub(crate) fn cluster(&self) -> Option<&str> {
        match self {
            End::Workload(w) => Some(non_empty(&w.cluster_id).unwrap_or(DEFAULT_CLUSTER)),
            End::Baggage(b) => b.cluster_id.as_deref(),
            End::Unknown => None,
        }
    }
}

fn non_empty(s: &str) -> Option<&str> {
    (!s.is_empty()).then_some(s)
}

/// Whether a line would be written (`info` for a success, `warn`
/// otherwise): its ends are looked up only then.
pub(crate) fn line_enabled(success: bool) -> bool {
    if success {
        tracing::enabled!(target: TARGET, tracing::Level::INFO)
    } else {
        tracing::enabled!(target: TARGET, tracing::Level::WARN)
    }
}

/// A duration as ztunnel's line writes it: `duration="12ms"`.
pub(crate) fn duration_field(duration: std::time::Duration) -> String {
    format!("{}ms", duration.as_millis())
}

/// How a connection or stream ended, for the access log.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Outcome {
    Success,
    Refused,
    /// Refused by an authorization policy.
    Denied,
    Failed,
    /// Cut because a reloaded revocation list revoked the HBONE
    /// connection's peer (ztunnel's `CERT_REVOKED`).
    Revoked,
}

impl Outcome {
    fn as_str(self) -> &'static str {
        match self {
            Outcome::Success => "success",
            Outcome::Refused => "refused",
            Outcome::Denied => "denied",
            Outcome::Failed => "failed",
            Outcome::Revoked => "revoked",
        }
    }
}

/// One access-log line: who talked to whom, how much, how long, and how it
/// ended. Also feeds the counters.
pub(crate) struct AccessLog<'a> {
    pub direction: &'static str,
    pub src_addr: SocketAddr,
    pub src_identity: Option<&'a str>,
    pub dst_addr: SocketAddr,
    pub dst_identity: Option<&'a str>,
    /// The service whose VIP the source connected to, when it did.
    pub dst_service: Option<WorkloadKey>,
    /// See [`ConnectionInfo::dst_workload`].
    pub dst_workload: Option<WorkloadKey>,
    pub started: Instant,
    /// Bytes from the connection's initiator to its target, and back.
    pub bytes_sent: u64,
    pub bytes_received: u64,
    pub outcome: Outcome,
    /// Why it failed, where the metrics name it (with `Outcome::Failed`).
    pub failure: Option<observe::Failure>,
    pub reason: Option<String>,
    /// The local pod served (see [`ConnectionInfo::pod`]).
    pub pod: Option<&'a WorkloadKey>,
    /// Whether [`AccessLog::open`] reported the connection open.
    pub opened: bool,
    /// The observer's record of the open connection, told of its close.
    pub observed: Option<Box<dyn OpenConnection>>,
    /// The authorization policy that allowed or denied it, if one did.
    pub policy: Option<crate::authz::PolicyKey>,
    /// Why it was refused, for the refusal counter; unset: the proxy's own
    /// checks (`request`), or `policy` for a denial.
    pub refusal: Option<RefusalReason>,
    /// Counted, but no line written (rate-limited refusals).
    pub quiet: bool,
    /// Refused before any target was chosen, as ztunnel's early deny (no
    /// endpoint, a name that does not resolve, a waypoint that cannot be
    /// chosen, a call to the proxy itself, an inbound CONNECT without a
    /// target, inbound before the first sync): the line says `connection
    /// failed`, and Istio's metrics do not count it (ztunnel's do not).
    pub early: bool,
    /// See [`ConnectionInfo::derived_source`].
    pub derived_source: Option<&'a super::Baggage>,
    /// See [`ConnectionInfo::src_through_gateway`].
    pub src_through_gateway: bool,
    /// See [`ConnectionInfo::derived_destination`].
    pub derived_destination: Option<&'a super::Baggage>,
}

impl<'a> AccessLog<'a> {
    /// A connection from `src` to `dst` that has moved nothing yet and is
    /// refused unless the handler says otherwise.
    pub fn new(direction: &'static str, src_addr: SocketAddr, dst_addr: SocketAddr) -> Self {
        Self {
            direction,
            src_addr,
            src_identity: None,
            dst_addr,
            dst_identity: None,
            dst_service: None,
            dst_workload: None,
            started: Instant::now(),
            bytes_sent: 0,
            bytes_received: 0,
            outcome: Outcome::Refused,
            failure: None,
            reason: None,
            pod: None,
            opened: false,
            observed: None,
            policy: None,
            refusal: None,
            quiet: false,
            early: false,
            derived_source: None,
            src_through_gateway: false,
            derived_destination: None,
        }
    }

    /// Records an authorization decision: the deciding policy, and for a
    /// denial the outcome and reason.
    pub fn decided(&mut self, decision: &Decision) {
        match decision {
            Decision::Allow(policy) => self.policy = policy.clone(),
            Decision::Deny { reason, policy } => {
                self.policy = policy.clone();
                self.reason = Some(reason.clone());
                // The node-wide switch is no authorization policy: a plain
                // refusal, as before policies existed.
                self.outcome = if policy.is_some() {
                    Outcome::Denied
                } else {
                    Outcome::Refused
                };
            }
        }
    }

    fn info(&self) -> ConnectionInfo<'_> {
        ConnectionInfo {
            direction: observe::Direction::from_log(self.direction),
            pod: self.pod,
            src_addr: self.src_addr,
            src_identity: self.src_identity,
            dst_addr: self.dst_addr,
            dst_identity: self.dst_identity,
            dst_workload: self.dst_workload.as_ref(),
            dst_service: self.dst_service.as_ref(),
            derived_source: self.derived_source,
            src_through_gateway: self.src_through_gateway,
            derived_destination: self.derived_destination,
        }
    }

    /// Reports the connection open (its target is known and reached).
    pub fn open(&mut self, shared: &Shared) {
        if !self.opened {
            self.opened = true;
            if let Some(observer) = shared.observer.get() {
                self.observed = Some(observer.opened(&self.info()));
            }
        }
    }

    pub fn emit(&mut self, shared: &Shared) {
        // The line first: whoever sees the connection counted (status,
        // metrics; they flush the log first) finds it in the log.
        self.write_line(shared.workloads.as_ref());
        if let Some(observer) = shared.observer.get().filter(|_| !self.early) {
            let observed = match self.observed.take() {
                Some(observed) => Some(observed),
                // Refused before it opened: reported open at its close.
                None if !self.opened => Some(observer.opened(&self.info())),
                // Opened before the observer was set: not recorded.
                None => None,
            };
            let close = ConnectionClose {
                bytes_to_target: self.bytes_sent,
                bytes_from_target: self.bytes_received,
                duration: self.started.elapsed(),
                outcome: match self.outcome {
                    Outcome::Success => ConnectionOutcome::Success,
                    Outcome::Refused => ConnectionOutcome::Refused,
                    Outcome::Denied => ConnectionOutcome::Denied,
                    Outcome::Failed => match self.failure {
                        Some(failure) => ConnectionOutcome::FailedWith(failure),
                        None => ConnectionOutcome::Failed,
                    },
                    Outcome::Revoked => ConnectionOutcome::Revoked,
                },
            };
            if let Some(observed) = observed {
                observed.closed(&close);
            }
        }
        self.opened = true;
        let c = &shared.counters;
        let counter = match self.direction {
            "outbound" => &c.outbound_hbone,
            "passthrough" => &c.outbound_passthrough,
            "inbound" => &c.inbound_hbone,
            _ => &c.inbound_plaintext,
        };
        counter.fetch_add(1, Ordering::Relaxed);
        match self.outcome {
            Outcome::Success => {}
            Outcome::Refused | Outcome::Denied => {
                c.refused.fetch_add(1, Ordering::Relaxed);
                shared
                    .limits
                    .count(self.refusal.unwrap_or(match self.outcome {
                        Outcome::Denied => RefusalReason::Policy,
                        _ => RefusalReason::Request,
                    }));
            }
            Outcome::Failed | Outcome::Revoked => {
                c.failed.fetch_add(1, Ordering::Relaxed);
            }
        }
        if matches!(self.direction, "outbound" | "passthrough") {
            c.bytes_out.fetch_add(self.bytes_sent, Ordering::Relaxed);
            c.bytes_in.fetch_add(self.bytes_received, Ordering::Relaxed);
        }
    }

    /// Writes the line (unless quiet, or filtered out: the ends are
    /// looked up only for a line that is written).
    fn write_line(&self, workloads: &dyn WorkloadLookup) {
        if self.quiet || !line_enabled(self.outcome == Outcome::Success) {
            return;
        }
        let src = End::source(
            workloads,
            (!self.src_through_gateway).then_some(self.src_addr.ip()),
            self.derived_source,
        );
        let dst = match &self.dst_workload {
            Some(key) => End::named(workloads, key),
            None => End::destination(workloads, self.dst_addr.ip(), self.derived_destination),
        };
        let duration = duration_field(self.started.elapsed());
        // As ztunnel: the identities of a mutual-TLS connection only, and
        // left out when unknown.
        let mtls = matches!(self.direction, "outbound" | "inbound");
        let src_identity = self.src_identity.filter(|_| mtls);
        let dst_identity = self.dst_identity.filter(|_| mtls);
        let reason = self.reason.as_deref().unwrap_or("");
        // Formatted only by the writer that takes the line: nothing is
        // allocated for them per connection (or at all when filtered out).
        // ztunnel's: the service's hostname, left out when there is none.
        let dst_service = self
            .dst_service
            .as_ref()
            .map(|key| workloads.service_hostname(key));
        let policy: &dyn std::fmt::Display = match &self.policy {
            Some(key) => key,
            None => &"-",
        };
        // The served pod: the connection's span, which named it, is debug
        // level (outbound.rs).
        let pod: &dyn std::fmt::Display = match self.pod {
            Some(key) => key,
            None => &"-",
        };
        macro_rules! line {
            ($level:ident, $message:literal) => {
                tracing::$level!(
                    target: TARGET,
                    direction = self.direction,
                    pod = %pod,
                    src.addr = %self.src_addr,
                    src.workload = src.workload(),
                    src.namespace = src.namespace(),
                    src.identity = src_identity,
                    src.cluster = src.cluster(),
                    dst.addr = %self.dst_addr,
                    dst.service = dst_service.as_deref(),
                    dst.workload = dst.workload(),
                    dst.namespace = dst.namespace(),
                    dst.identity = dst_identity,
                    dst.cluster = dst.cluster(),
                    bytes_sent = self.bytes_sent,
                    bytes_recv = self.bytes_received,
                    duration = duration.as_str(),
                    result = self.outcome.as_str(),
                    policy = %policy,
                    reason,
                    $message
                )
            };
        }
        match self.outcome {
            Outcome::Success => line!(info, "connection complete"),
            _ if self.early => line!(warn, "connection failed"),
            _ => line!(warn, "connection complete"),
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::RwLock;

    use super::*;
    use crate::store::WorkloadStore;

    fn store() -> RwLock<WorkloadStore> {
        let mut store = WorkloadStore::new();
        store.replace_all([Workload {
            name: "client-7d9f".into(),
            namespace: "shop".into(),
            ips: vec!["198.18.1.2".parse().expect("ip")],
            ..Default::default()
        }]);
        RwLock::new(store)
    }

    fn names(end: &End<'_>) -> [Option<String>; 3] {
        [end.workload(), end.namespace(), end.cluster()].map(|v| v.map(str::to_owned))
    }

    #[test]
    fn an_end_is_named_as_ztunnels_access_line_names_it() {
        let store = store();
        let (known, other) = (
            "198.18.1.2".parse().expect("ip"),
            "198.18.9.9".parse().expect("ip"),
        );
        let baggage = Baggage {
            workload_name: Some("reviews".into()),
            namespace: Some("bookinfo".into()),
            cluster_id: Some("east".into()),
            ..Default::default()
        };
        // A workload by its address: the pod's name, its namespace, and
        // Istio's default cluster when it names none.
        let by_address =
            [Some("client-7d9f"), Some("shop"), Some("Kubernetes")].map(|v| v.map(String::from));
        assert_eq!(names(&End::source(&store, Some(known), None)), by_address);
        // The address wins over the baggage for a source ...
        assert_eq!(
            names(&End::source(&store, Some(known), Some(&baggage))),
            by_address
        );
        // ... which names a source the store does not know, or one through
        // a gateway (whose address is not the source's).
        let by_baggage =
            [Some("reviews"), Some("bookinfo"), Some("east")].map(|v| v.map(String::from));
        assert_eq!(
            names(&End::source(&store, Some(other), Some(&baggage))),
            by_baggage
        );
        assert_eq!(
            names(&End::source(&store, None, Some(&baggage))),
            by_baggage
        );
        // A destination's baggage (double HBONE) wins over its address.
        assert_eq!(
            names(&End::destination(&store, known, Some(&baggage))),
            by_baggage
        );
        assert_eq!(names(&End::destination(&store, known, None)), by_address);
        // Unknown: every field left out.
        assert_eq!(
            names(&End::destination(&store, other, None)),
            [None, None, None]
        );
    }
}

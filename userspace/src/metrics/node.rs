//! The node's part of `/metrics`, read from the reconciler's
//! [`NodeSnapshot`] at scrape time: pods by state and mode, each enrolled
//! pod's kernel counters, certificate expiry per identity, the pod source's
//! health, readiness.

use std::collections::BTreeMap;

use prometheus_client::{
    encoding::EncodeLabelSet,
    metrics::{counter::Counter, family::Family, gauge::Gauge},
    registry::Registry,
};

use super::unix_seconds;
use crate::{
    control::kube::SourceStats, health::Readiness, proxy::ProxyStats, redirect::EnrolledPod,
    snapshot::NodeSnapshot, state::WorkloadKey,
};

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
    /// Connects the kernel's authorization point refused: (source pod,
    /// `namespace/name` of the deciding policy, count).
    pub kernel_denials: Vec<(WorkloadKey, String, u64)>,
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
            kernel_denials: node
                .pods
                .iter()
                .flat_map(|pod| {
                    let key = pod.workload.key();
                    pod.kernel_denials
                        .iter()
                        .map(move |(policy, n)| (key.clone(), policy.to_string(), *n))
                })
                .collect(),
        }
    }

    /// The proxy's series of Istio's own names: ztunnel's
    /// `istio_crl_policy_rejections_total{reporter}`, a series once a
    /// reporter counted one, as ztunnel's family.
    pub(super) fn istio_registry(&self) -> Registry {
        let mut registry = Registry::with_prefix("istio");
        let rejections = Family::<ReporterLabels, Counter>::default();
        if let Some(proxy) = &self.proxy {
            let counts = &proxy.crl_rejections;
            for (reporter, count) in [
                ("source", counts.source),
                ("destination", counts.destination),
            ] {
                if count > 0 {
                    rejections
                        .get_or_create(&ReporterLabels {
                            reporter: reporter.into(),
                        })
                        .inc_by(count);
                }
            }
        }
        registry.register(
            "crl_policy_rejections",
            "The total number of connections rejected due to CRL certificate revocation (unstable)",
            rejections,
        );
        // A reporter's series appears with its first socket, as ztunnel's.
        let sockets = Family::<ReporterLabels, Gauge>::default();
        if let Some(proxy) = &self.proxy {
            let (accepted, closed) = (&proxy.sockets_accepted, &proxy.sockets_closed);
            for (reporter, accepted, closed) in [
                ("source", accepted.source, closed.source),
                ("destination", accepted.destination, closed.destination),
            ] {
                if accepted > 0 {
                    sockets
                        .get_or_create(&ReporterLabels {
                            reporter: reporter.into(),
                        })
                        .set(i64::try_from(accepted.saturating_sub(closed)).unwrap_or(i64::MAX));
                }
            }
        }
        registry.register(
            "tcp_sockets_open",
            "The current number of open TCP sockets (unstable)",
            sockets,
        );
        registry
    }

    /// ztunnel's `workload_manager_*` (its pod proxies, which Istio's
    /// ztunnel dashboard charts): the pods the builtin proxy serves, those
    /// waiting to be enrolled, and the proxies started and stopped. Empty
    /// without the builtin proxy (`--proxy ztunnel`: the stock ztunnel
    /// reports its own).
    pub(super) fn workload_manager_registry(&self) -> Registry {
        let mut registry = Registry::with_prefix("workload_manager");
        let Some(proxy) = &self.proxy else {
            return registry;
        };
        let gauge = |value: i64| {
            let g = Gauge::<i64>::default();
            g.set(value);
            g
        };
        let counter = |value: u64| {
            let c = Counter::<u64>::default();
            c.inc_by(value);
            c
        };
        registry.register(
            "active_proxy_count",
            "The total number current workloads with active proxies (unstable)",
            gauge(i64::try_from(proxy.pods_served).unwrap_or(i64::MAX)),
        );
        registry.register(
            "pending_proxy_count",
            "The total number current workloads with pending proxies (unstable)",
            gauge(self.pods_by_state.get("pending").copied().unwrap_or(0)),
        );
        registry.register(
            "proxies_started",
            "The total number of proxies that were started (unstable)",
            counter(proxy.proxies_started),
        );
        registry.register(
            "proxies_stopped",
            "The total number of proxies that were stopped (unstable)",
            counter(proxy.proxies_stopped),
        );
        registry
    }

    pub(super) fn registry(&self, kube: Option<&SourceStats>) -> Registry {
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

        let denials = Family::<PodPolicyLabels, Counter>::default();
        for (pod, policy, count) in &self.kernel_denials {
            denials
                .get_or_create(&PodPolicyLabels {
                    namespace: pod.namespace.clone(),
                    pod: pod.name.clone(),
                    policy: policy.clone(),
                })
                .inc_by(*count);
        }
        registry.register(
            "pod_policy_denials",
            "Connects from an enrolled pod that the kernel refused (EPERM) on an authorization policy's verdict, by the deciding policy (the proxy's denials are istio_tcp_connections_closed_total with response_flags=\"DENY\")",
            denials,
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
            let refusals = Family::<ReasonLabels, Counter>::default();
            for (reason, count) in &proxy.refusals {
                refusals
                    .get_or_create(&ReasonLabels {
                        reason: reason.clone(),
                    })
                    .inc_by(*count);
            }
            registry.register(
                "proxy_refusals",
                "Connections and streams the proxy refused, by the layer and reason (limits, TLS, HTTP/2, the CONNECT checks, policy)",
                refusals,
            );
            let waypoint_failures = Family::<WaypointFailureLabels, Counter>::default();
            for f in &proxy.waypoint_failures {
                waypoint_failures
                    .get_or_create(&WaypointFailureLabels {
                        namespace: f.namespace.clone(),
                        name: f.name.clone(),
                        reason: f.reason.clone(),
                    })
                    .inc_by(f.count);
            }
            registry.register(
                "waypoint_failures",
                "Connections to a waypoint-bound service or workload refused because its waypoint could not be used (unresolved, no_healthy_endpoint, unreachable); never sent around it",
                waypoint_failures,
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
struct PodPolicyLabels {
    namespace: String,
    pod: String,
    policy: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct IdentityLabels {
    identity: String,
}

/// `shunt_waypoint_failures_total`: the service's (or workload's)
/// namespace and name, and why.
#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct WaypointFailureLabels {
    namespace: String,
    name: String,
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReporterLabels {
    reporter: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ReasonLabels {
    reason: String,
}

#[derive(Clone, Debug, Hash, PartialEq, Eq, EncodeLabelSet)]
struct ResultLabels {
    result: String,
}

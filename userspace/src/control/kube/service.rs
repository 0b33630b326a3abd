//! Service discovery: every Service with a cluster IP and the EndpointSlices
//! behind it, joined into [`crate::state::Service`]s for the proxy.
//!
//! Two cluster-wide kube-rs watchers (same robustness as the pod watches:
//! backoff, relist on `410 Gone`, malformed objects logged by name and
//! skipped, the last complete view kept while relisting) feed caches of
//! facts; [`ServiceWatches::services`] joins them. Services without a
//! cluster IP (headless, `ExternalName`) have no VIP to capture and are
//! skipped (logged at debug). `NodePort` and `LoadBalancer` services are kept:
//! their cluster IP behaves exactly like a `ClusterIP` service's.
//!
//! A named `targetPort` is resolved per endpoint, as Kubernetes does: an
//! EndpointSlice lists, under each service port's name, the number its
//! endpoints listen on.

use std::{
    collections::{BTreeMap, HashMap},
    net::IpAddr,
    sync::Arc,
};

use ::kube::{
    Api, Client,
    runtime::{WatchStreamExt as _, watcher},
};
use futures::{StreamExt as _, stream::BoxStream};
use k8s_openapi::api::core::v1::Service as KubeService;
use k8s_openapi::api::discovery::v1::EndpointSlice;
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tracing::debug;

use super::{SourceStats, Step, apply_event, cache::ObjectCache, lenient::Lenient};
use crate::{
    control::waypoint,
    state::{Endpoint, Service, ServicePort, WorkloadKey},
};

/// The label tying an EndpointSlice to its Service.
pub const SERVICE_NAME_LABEL: &str = "kubernetes.io/service-name";

/// Why a Service or EndpointSlice cannot be used (logged with its name).
#[derive(Debug, thiserror::Error)]
pub enum UnusableObject {
    #[error("{field}: {value:?} is not an IP address")]
    BadIp { field: &'static str, value: String },
    #[error("{field}: {value} is not a port number")]
    BadPort { field: &'static str, value: i64 },
}

/// What the proxy needs of a Service.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct ServiceFacts {
    key: WorkloadKey,
    vips: Vec<IpAddr>,
    ports: Vec<PortFacts>,
    /// Its waypoint labels ([`crate::control::waypoint::LABELS`]).
    waypoint_labels: BTreeMap<String, String>,
}

#[derive(Clone, Debug, PartialEq, Eq)]
struct PortFacts {
    /// `""` for the one unnamed port a service may have (the slice's port
    /// is unnamed too).
    name: String,
    port: u16,
    /// `None`: named, resolved per endpoint from the slices.
    target_port: Option<u16>,
}

impl ServiceFacts {
    /// `Ok(None)` for a service the proxy has nothing to do with.
    pub(crate) fn from_service(service: &KubeService) -> Result<Option<Self>, UnusableObject> {
        let key = WorkloadKey::new(
            service.metadata.namespace.as_deref().unwrap_or_default(),
            service.metadata.name.as_deref().unwrap_or_default(),
        );
        let Some(spec) = &service.spec else {
            return Ok(None);
        };
        if spec.type_.as_deref() == Some("ExternalName") {
            debug!(service = %key, "ExternalName service: no cluster IP to capture; skipped");
            return Ok(None);
        }
        // `clusterIPs` holds `clusterIP` first; older servers set only the
        // latter.
        let ips: Vec<&String> = match &spec.cluster_ips {
            Some(ips) if !ips.is_empty() => ips.iter().collect(),
            _ => spec.cluster_ip.iter().collect(),
        };
        if ips.is_empty() || ips.iter().any(|ip| ip.as_str() == "None") {
            debug!(service = %key, "headless or unallocated service: no cluster IP; skipped");
            return Ok(None);
        }
        let mut vips = Vec::with_capacity(ips.len());
        for ip in ips {
            vips.push(ip.parse().map_err(|_| UnusableObject::BadIp {
                field: "spec.clusterIPs",
                value: ip.clone(),
            })?);
        }
        let mut ports = Vec::new();
        for p in spec.ports.iter().flatten() {
            // The proxy carries TCP only; other protocols are not captured.
            if p.protocol.as_deref().is_some_and(|proto| proto != "TCP") {
                continue;
            }
            let port = port_number("spec.ports.port", p.port)?;
            let target_port = match &p.target_port {
                None => Some(port),
                Some(IntOrString::Int(n)) => Some(port_number("spec.ports.targetPort", *n)?),
                Some(IntOrString::String(_)) => None,
            };
            ports.push(PortFacts {
                name: p.name.clone().unwrap_or_default(),
                port,
                target_port,
            });
        }
        let waypoint_labels = service
            .metadata
            .labels
            .as_ref()
            .map(waypoint::binding_labels)
            .unwrap_or_default();
        Ok(Some(Self {
            key,
            vips,
            ports,
            waypoint_labels,
        }))
    }
}

/// What the proxy needs of an EndpointSlice.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct SliceFacts {
    /// The service it belongs to.
    service: WorkloadKey,
    /// Port name → the endpoints' port number.
    ports: BTreeMap<String, u16>,
    endpoints: Vec<(IpAddr, bool, Option<WorkloadKey>)>,
}

impl SliceFacts {
    /// `Ok(None)` for a slice of no service, or of FQDN addresses.
    pub(crate) fn from_slice(slice: &EndpointSlice) -> Result<Option<Self>, UnusableObject> {
        let namespace = slice.metadata.namespace.clone().unwrap_or_default();
        let Some(service) = slice
            .metadata
            .labels
            .as_ref()
            .and_then(|l| l.get(SERVICE_NAME_LABEL))
        else {
            return Ok(None);
        };
        if !matches!(slice.address_type.as_str(), "IPv4" | "IPv6") {
            return Ok(None);
        }
        let mut ports = BTreeMap::new();
        for p in slice.ports.iter().flatten() {
            if p.protocol.as_deref().is_some_and(|proto| proto != "TCP") {
                continue;
            }
            // No port: "all ports", which only headless services use.
            if let Some(port) = p.port {
                ports.insert(
                    p.name.clone().unwrap_or_default(),
                    port_number("ports.port", port)?,
                );
            }
        }
        let mut endpoints = Vec::new();
        for e in &slice.endpoints {
            // Kubernetes: an unknown readiness is to be read as ready.
            let ready = e.conditions.as_ref().and_then(|c| c.ready).unwrap_or(true);
            let pod = e
                .target_ref
                .as_ref()
                .filter(|r| r.kind.as_deref() == Some("Pod"))
                .and_then(|r| {
                    let ns = r.namespace.as_deref().unwrap_or(&namespace);
                    Some(WorkloadKey::new(ns, r.name.as_deref()?))
                });
            for address in &e.addresses {
                let ip = address.parse().map_err(|_| UnusableObject::BadIp {
                    field: "endpoints.addresses",
                    value: address.clone(),
                })?;
                endpoints.push((ip, ready, pod.clone()));
            }
        }
        Ok(Some(Self {
            service: WorkloadKey::new(namespace, service.as_str()),
            ports,
            endpoints,
        }))
    }
}

fn port_number(field: &'static str, n: i32) -> Result<u16, UnusableObject> {
    u16::try_from(n)
        .ok()
        .filter(|p| *p != 0)
        .ok_or(UnusableObject::BadPort {
            field,
            value: n.into(),
        })
}

/// Joins services with their slices. An endpoint listed by two slices (a
/// brief state while one replaces the other) counts once, ready if either
/// says so.
pub(crate) fn join<'a>(
    services: impl Iterator<Item = &'a ServiceFacts>,
    slices: impl Iterator<Item = &'a SliceFacts>,
    cluster_domain: &str,
) -> Vec<Service> {
    let mut by_service: HashMap<&WorkloadKey, Vec<&SliceFacts>> = HashMap::new();
    for slice in slices {
        by_service.entry(&slice.service).or_default().push(slice);
    }
    services
        .map(|facts| {
            let mut endpoints: Vec<Endpoint> = Vec::new();
            for slice in by_service.get(&facts.key).into_iter().flatten() {
                let ports: BTreeMap<u16, u16> = facts
                    .ports
                    .iter()
                    .filter_map(|p| Some((p.port, *slice.ports.get(&p.name)?)))
                    .collect();
                for (ip, ready, pod) in &slice.endpoints {
                    match endpoints.iter_mut().find(|e| e.ip == *ip) {
                        Some(known) => known.ready |= *ready,
                        None => endpoints.push(Endpoint {
                            ip: *ip,
                            ready: *ready,
                            pod: pod.clone(),
                            ports: ports.clone(),
                            capacity: 1,
                            // The API server's endpoints are this
                            // cluster's: the local network.
                            network: String::new(),
                        }),
                    }
                }
            }
            Service {
                hostname: waypoint::service_hostname(
                    &facts.key.namespace,
                    &facts.key.name,
                    cluster_domain,
                ),
                name: facts.key.name.clone(),
                namespace: facts.key.namespace.clone(),
                vips: facts.vips.clone(),
                ports: facts
                    .ports
                    .iter()
                    .map(|p| ServicePort {
                        port: p.port,
                        target_port: p.target_port,
                    })
                    .collect(),
                endpoints,
                ..Default::default()
            }
        })
        .collect()
}

/// The Service and EndpointSlice watches of cluster discovery.
pub(crate) struct ServiceWatches {
    service_events:
        BoxStream<'static, Result<watcher::Event<Lenient<KubeService>>, watcher::Error>>,
    slice_events:
        BoxStream<'static, Result<watcher::Event<Lenient<EndpointSlice>>, watcher::Error>>,
    services: ObjectCache<Option<ServiceFacts>>,
    slices: ObjectCache<Option<SliceFacts>>,
    stats: Arc<SourceStats>,
}

impl ServiceWatches {
    pub(crate) fn new(client: &Client, stats: Arc<SourceStats>) -> Self {
        Self {
            service_events: watcher(Api::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .boxed(),
            slice_events: watcher(Api::all(client.clone()), watcher::Config::default())
                .default_backoff()
                .boxed(),
            services: ObjectCache::new("service"),
            slices: ObjectCache::new("endpointslice"),
            stats,
        }
    }

    /// Whether both watches have listed once (before that, a service
    /// without endpoints may only be missing its slices).
    pub(crate) fn listed(&self) -> bool {
        self.services.listed() && self.slices.listed()
    }

    /// Every usable service with its endpoints, named in `cluster_domain`.
    pub(crate) fn services(&self, cluster_domain: &str) -> Vec<Service> {
        join(
            self.services.values().flatten(),
            self.slices.values().flatten(),
            cluster_domain,
        )
    }

    /// Every usable service's waypoint labels (for
    /// [`super::waypoints`]).
    pub(crate) fn waypoint_labels(&self) -> HashMap<WorkloadKey, BTreeMap<String, String>> {
        self.services
            .values()
            .flatten()
            .map(|facts| (facts.key.clone(), facts.waypoint_labels.clone()))
            .collect()
    }

    /// Waits for the next event of either watch and applies it.
    /// Cancel-safe: an event is applied as soon as it is received.
    pub(crate) async fn step(&mut self) -> Step {
        tokio::select! {
            event = self.service_events.next() => {
                apply_event("services", event, &mut self.services, ServiceFacts::from_service, &self.stats)
            }
            event = self.slice_events.next() => {
                apply_event("endpointslices", event, &mut self.slices, SliceFacts::from_slice, &self.stats)
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn service(value: serde_json::Value) -> KubeService {
        serde_json::from_value(value).expect("service")
    }

    fn slice(value: serde_json::Value) -> EndpointSlice {
        serde_json::from_value(value).expect("slice")
    }

    #[test]
    fn services_without_a_cluster_ip_are_skipped() {
        let meta = json!({"name": "s", "namespace": "ns"});
        for spec in [
            json!({"type": "ExternalName", "externalName": "example.invalid"}),
            json!({"clusterIP": "None", "clusterIPs": ["None"]}),
            json!({}),
        ] {
            let facts =
                ServiceFacts::from_service(&service(json!({"metadata": meta, "spec": spec})));
            assert!(matches!(facts, Ok(None)), "{spec}: {facts:?}");
        }
        let bad = ServiceFacts::from_service(&service(
            json!({"metadata": meta, "spec": {"clusterIPs": ["10.0.0.300"]}}),
        ));
        assert_eq!(
            bad.map_err(|e| e.to_string()).err().as_deref(),
            Some("spec.clusterIPs: \"10.0.0.300\" is not an IP address")
        );
    }

    #[test]
    fn named_target_ports_resolve_per_slice_and_udp_is_ignored() {
        let svc = service(json!({
            "metadata": {"name": "web", "namespace": "shop"},
            "spec": {"type": "NodePort", "clusterIP": "198.19.100.1", "ports": [
                {"name": "http", "port": 80, "targetPort": "web"},
                {"name": "admin", "port": 9000, "targetPort": 9001},
                {"name": "dns", "port": 53, "protocol": "UDP"},
            ]}
        }));
        let facts = ServiceFacts::from_service(&svc)
            .expect("usable")
            .expect("has a VIP");
        let slice = |name: &str, port: u16, ip: &str, ready: Option<bool>| {
            SliceFacts::from_slice(&slice(json!({
                "metadata": {"name": name, "namespace": "shop",
                             "labels": {SERVICE_NAME_LABEL: "web"}},
                "addressType": "IPv4",
                "ports": [{"name": "http", "port": port}],
                "endpoints": [{"addresses": [ip], "conditions": {"ready": ready},
                               "targetRef": {"kind": "Pod", "name": name}}],
            })))
            .expect("usable")
            .expect("of a service")
        };
        let a = slice("a", 8080, "198.18.2.10", Some(true));
        let b = slice("b", 8081, "198.18.2.11", None);
        let c = slice("c", 8082, "198.18.2.12", Some(false));
        let services = join(
            [&facts].into_iter(),
            [&a, &b, &c].into_iter(),
            "corp.example",
        );
        let [web] = services.as_slice() else {
            panic!("{services:?}")
        };
        assert_eq!(
            web.hostname, "web.shop.svc.corp.example",
            "named in the configured cluster domain (--cluster-domain)"
        );
        assert_eq!(web.vips, ["198.19.100.1".parse::<IpAddr>().expect("ip")]);
        assert_eq!(web.ports.len(), 2, "UDP left out");
        let targets: Vec<String> = web
            .ready_targets("198.19.100.1:80".parse().expect("addr"))
            .into_iter()
            .map(|(e, addr)| {
                format!(
                    "{addr} {}",
                    e.pod.as_ref().map(|p| p.to_string()).unwrap_or_default()
                )
            })
            .collect();
        assert_eq!(
            targets,
            ["198.18.2.10:8080 shop/a", "198.18.2.11:8081 shop/b"]
        );
        let admin = web.ready_targets("198.19.100.1:9000".parse().expect("addr"));
        assert_eq!(admin.len(), 2, "numeric target ports need no slice port");
    }
}

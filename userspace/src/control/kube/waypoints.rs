//! Waypoints in cluster discovery: each service's and pod's waypoint
//! decided from the `istio.io/use-waypoint` labels of the pod, the service
//! and their namespace, and the waypoint `Gateway`s ([`super::gateway`]),
//! by the rules the workloads file uses too ([`crate::control::waypoint`]).
//!
//! Recomputed for the whole view whenever any input changes (a label of a
//! pod, service or namespace, a Gateway created, relabelled or deleted):
//! the view is rebuilt from the caches at every debounced change anyway,
//! and the decision is a map lookup per object.

use std::collections::{BTreeMap, HashMap};

use tracing::warn;

use super::{cache::ObjectCache, pod::NamespaceFacts};
use crate::{
    control::waypoint::{Kind, Resolution, Subject, UnknownGatewayLog, Waypoints},
    state::{Service, Workload, WorkloadKey},
};

/// What the caches say, for one recompute.
pub(crate) struct Inputs<'a> {
    pub(crate) waypoints: &'a Waypoints,
    pub(crate) namespaces: &'a ObjectCache<NamespaceFacts>,
    /// Each service's waypoint labels.
    pub(crate) service_labels: &'a HashMap<WorkloadKey, BTreeMap<String, String>>,
}

/// Sets the waypoint of every workload and service; a binding to a
/// gateway that does not exist is logged once (naming the object and the
/// gateway) while it lasts.
pub(crate) fn assign(
    inputs: &Inputs<'_>,
    workloads: &mut [Workload],
    services: &mut [Service],
    log: &mut UnknownGatewayLog,
) {
    let no_labels = BTreeMap::new();
    let namespace_labels = |namespace: &str| {
        inputs
            .namespaces
            .get(namespace)
            .map(|ns| &ns.waypoint_labels)
    };
    for service in services.iter_mut() {
        let labels = inputs
            .service_labels
            .get(&service.key())
            .unwrap_or(&no_labels);
        let subject = Subject {
            kind: Kind::Service,
            namespace: &service.namespace,
            name: &service.name,
            labels,
            namespace_labels: namespace_labels(&service.namespace),
        };
        let resolution = inputs.waypoints.resolve(&subject);
        say(log, &format!("service {}", service.key()), &resolution);
        service.waypoint = resolution.waypoint();
    }
    for workload in workloads.iter_mut() {
        let subject = Subject {
            kind: Kind::Workload,
            namespace: &workload.namespace,
            name: &workload.name,
            labels: &workload.labels,
            namespace_labels: namespace_labels(&workload.namespace),
        };
        let resolution = inputs.waypoints.resolve(&subject);
        say(log, &format!("pod {}", workload.key()), &resolution);
        workload.waypoint = resolution.waypoint();
    }
    log.finish();
}

fn say(log: &mut UnknownGatewayLog, what: &str, resolution: &Resolution) {
    if log.note(what, resolution)
        && let Resolution::UnknownGateway { gateway, bound_by } = resolution
    {
        warn!(
            object = what,
            gateway = %gateway,
            "{what} is bound to waypoint {gateway} by {bound_by} (istio.io/use-waypoint), \
             but no waypoint Gateway {gateway} (class istio-waypoint) exists: it gets no \
             waypoint until one does"
        );
    }
}

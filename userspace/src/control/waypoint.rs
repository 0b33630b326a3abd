//! Waypoints without istiod: which waypoint serves a service or a workload,
//! decided from Istio's labels, as istiod decides it, so that the standalone
//! sources (the workloads file, the Kubernetes watch) fill
//! [`Service::waypoint`](crate::state::Service::waypoint) and
//! [`Workload::waypoint`](crate::state::Workload::waypoint) exactly as the
//! xDS source does.
//!
//! Istio's rules (the contract):
//!
//! - [`USE_WAYPOINT_LABEL`] on a namespace, a service or a pod binds it to the
//!   waypoint `Gateway` of that name, in the labelled object's namespace
//!   unless [`USE_WAYPOINT_NAMESPACE_LABEL`] (on the same object) names
//!   another. The object's own label wins over its namespace's; the value
//!   [`NO_WAYPOINT`] opts an object out of its namespace's binding.
//! - The waypoint `Gateway` (class [`WAYPOINT_GATEWAY_CLASS`]) says what it
//!   serves with [`WAYPOINT_FOR_LABEL`]: `service` (when absent),
//!   `workload`, `all` or `none`. A binding gives a service a waypoint only
//!   if it serves services, a pod only if it serves workloads; the more
//!   specific label decides even when its waypoint does not serve the kind
//!   (no fall-back to the namespace's).
//! - A binding to a gateway that does not exist gives no waypoint
//!   ([`Resolution::UnknownGateway`], which the sources report).
//! - A waypoint is never bound to itself: objects labelled
//!   [`MANAGED_LABEL`]`: `[`MANAGED_BY_MESH_CONTROLLER`] (the pods and
//!   service Istio creates for a waypoint) and the waypoint's own service
//!   (the service with the gateway's name) get none.
//! - The waypoint is described as istiod describes it: by the hostname of
//!   the service in front of it (it has the gateway's name), port 15008:
//!   `GatewayAddress { hostname: {namespace, "<gw>.<ns>.svc.<cluster
//!   domain>"}, hbone_mtls_port: 15008 }`. The proxy resolves the hostname
//!   through the services to the waypoint's endpoints.
//!
//! Pure: no source's types, no I/O, so both sources share it and it is
//! tested on its own.

use std::{
    collections::{BTreeMap, BTreeSet},
    fmt,
    str::FromStr,
};

use crate::state::{GatewayAddress, GatewayDestination, WorkloadKey};

/// Binds a namespace, service or pod to the waypoint of that name.
pub const USE_WAYPOINT_LABEL: &str = "istio.io/use-waypoint";
/// The namespace of the waypoint [`USE_WAYPOINT_LABEL`] names, when it is
/// not the labelled object's.
pub const USE_WAYPOINT_NAMESPACE_LABEL: &str = "istio.io/use-waypoint-namespace";
/// On a waypoint `Gateway`: which traffic it serves ([`WaypointFor`]).
pub const WAYPOINT_FOR_LABEL: &str = "istio.io/waypoint-for";
/// On the objects Istio creates for a waypoint (its pods, its service).
pub const MANAGED_LABEL: &str = "gateway.istio.io/managed";
/// [`MANAGED_LABEL`]'s value on a waypoint's objects.
pub const MANAGED_BY_MESH_CONTROLLER: &str = "istio.io-mesh-controller";
/// The `gatewayClassName` of waypoint `Gateway`s.
pub const WAYPOINT_GATEWAY_CLASS: &str = "istio-waypoint";
/// [`USE_WAYPOINT_LABEL`]'s value that opts out of a namespace's binding.
pub const NO_WAYPOINT: &str = "none";
/// The waypoint's HBONE port, as istiod gives it.
pub const WAYPOINT_HBONE_PORT: u16 = 15008;
/// The default of `--cluster-domain`: the cluster's DNS domain, in service
/// hostnames. The sources are given the flag's value; this is only its
/// default (and what `control::local::parse` assumes).
pub const DEFAULT_CLUSTER_DOMAIN: &str = "cluster.local";

/// The labels the rules read, so a source can keep only these of an
/// object's labels.
pub const LABELS: [&str; 3] = [
    USE_WAYPOINT_LABEL,
    USE_WAYPOINT_NAMESPACE_LABEL,
    MANAGED_LABEL,
];

/// `<name>.<namespace>.svc.<cluster domain>`: a Kubernetes service's DNS
/// name, which istiod uses as the service's hostname.
pub fn service_hostname(namespace: &str, name: &str, cluster_domain: &str) -> String {
    format!("{name}.{namespace}.svc.{cluster_domain}")
}

/// Only the labels the rules read ([`LABELS`]).
pub fn binding_labels(labels: &BTreeMap<String, String>) -> BTreeMap<String, String> {
    LABELS
        .iter()
        .filter_map(|key| Some((key.to_string(), labels.get(*key)?.clone())))
        .collect()
}

/// What a waypoint serves (Istio's [`WAYPOINT_FOR_LABEL`] values).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WaypointFor {
    /// Traffic to services (their VIPs); Istio's default.
    #[default]
    Service,
    /// Traffic to workloads (pod IPs).
    Workload,
    All,
    /// Nothing: a binding to it never applies.
    None,
}

impl WaypointFor {
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Service => "service",
            Self::Workload => "workload",
            Self::All => "all",
            Self::None => "none",
        }
    }

    /// Whether a binding of an object of `kind` to this waypoint applies.
    pub fn serves(self, kind: Kind) -> bool {
        matches!(
            (self, kind),
            (Self::All, _) | (Self::Service, Kind::Service) | (Self::Workload, Kind::Workload)
        )
    }
}

impl fmt::Display for WaypointFor {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A [`WAYPOINT_FOR_LABEL`] value Istio does not define.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown value {0:?}; expected service, workload, all or none")]
pub struct UnknownWaypointFor(pub String);

impl FromStr for WaypointFor {
    type Err = UnknownWaypointFor;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "service" => Ok(Self::Service),
            "workload" => Ok(Self::Workload),
            "all" => Ok(Self::All),
            "none" => Ok(Self::None),
            other => Err(UnknownWaypointFor(other.to_owned())),
        }
    }
}

/// Which kind of object a waypoint is being decided for.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Kind {
    Service,
    /// A pod.
    Workload,
}

impl fmt::Display for Kind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Service => "service",
            Self::Workload => "workload",
        })
    }
}

/// A waypoint `Gateway`: its name and namespace (its service's too) and
/// what it serves.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct WaypointGateway {
    pub namespace: String,
    pub name: String,
    pub waypoint_for: WaypointFor,
}

/// The object a waypoint is decided for: its kind, name and labels, and its
/// namespace's labels (`None` when the namespace is not known: only the
/// object's own labels count then).
#[derive(Clone, Copy, Debug)]
pub struct Subject<'a> {
    pub kind: Kind,
    pub namespace: &'a str,
    pub name: &'a str,
    pub labels: &'a BTreeMap<String, String>,
    pub namespace_labels: Option<&'a BTreeMap<String, String>>,
}

/// Whose label made a binding.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BoundBy {
    /// The object's own label.
    Object,
    /// Its namespace's label.
    Namespace,
}

impl fmt::Display for BoundBy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Object => "its own label",
            Self::Namespace => "its namespace's label",
        })
    }
}

/// What the labels say about one object.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolution {
    /// No binding applies: no label, [`NO_WAYPOINT`], or the object is
    /// (part of) a waypoint.
    Unbound,
    /// Served by this waypoint.
    Waypoint(GatewayAddress),
    /// Bound to a waypoint that does not serve this kind of object
    /// (Istio gives none).
    NotServed {
        gateway: WorkloadKey,
        waypoint_for: WaypointFor,
        bound_by: BoundBy,
    },
    /// Bound to a gateway that does not exist, or is not a waypoint (Istio
    /// gives none; the sources report it).
    UnknownGateway {
        gateway: WorkloadKey,
        bound_by: BoundBy,
    },
}

impl Resolution {
    /// The waypoint, if one serves the object.
    pub fn waypoint(self) -> Option<GatewayAddress> {
        match self {
            Self::Waypoint(address) => Some(address),
            _ => None,
        }
    }
}

/// The waypoint an object's (or a namespace's) own labels bind it to:
/// `None` without [`USE_WAYPOINT_LABEL`] or with [`NO_WAYPOINT`].
/// `namespace` is the object's (a namespace's: its name).
pub fn bound_gateway(labels: &BTreeMap<String, String>, namespace: &str) -> Option<WorkloadKey> {
    match label(labels, namespace) {
        Label::Bound(gateway) => Some(gateway),
        Label::Absent | Label::OptOut => None,
    }
}

/// What an object's (or namespace's) [`USE_WAYPOINT_LABEL`] says.
enum Label {
    Absent,
    /// [`NO_WAYPOINT`].
    OptOut,
    Bound(WorkloadKey),
}

/// Reads the binding labels of an object in (or, for a namespace, named)
/// `namespace`.
fn label(labels: &BTreeMap<String, String>, namespace: &str) -> Label {
    match labels.get(USE_WAYPOINT_LABEL) {
        None => Label::Absent,
        Some(value) if value == NO_WAYPOINT => Label::OptOut,
        Some(value) => {
            let namespace = labels
                .get(USE_WAYPOINT_NAMESPACE_LABEL)
                .map_or(namespace, String::as_str);
            Label::Bound(WorkloadKey::new(namespace, value))
        }
    }
}

/// The known waypoint gateways, and the cluster domain their hostnames are
/// in: decides the waypoint of any object.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Waypoints {
    gateways: BTreeMap<WorkloadKey, WaypointFor>,
    cluster_domain: String,
}

impl Waypoints {
    /// Of two gateways with one name the later is kept (a source never
    /// gives two).
    pub fn new(gateways: impl IntoIterator<Item = WaypointGateway>, cluster_domain: &str) -> Self {
        Self {
            gateways: gateways
                .into_iter()
                .map(|g| (WorkloadKey::new(g.namespace, g.name), g.waypoint_for))
                .collect(),
            cluster_domain: cluster_domain.to_owned(),
        }
    }

    /// The known waypoints, by `namespace/name`.
    pub fn gateways(&self) -> impl Iterator<Item = (&WorkloadKey, WaypointFor)> {
        self.gateways.iter().map(|(k, f)| (k, *f))
    }

    /// What the waypoint `gateway` serves, if it is known.
    pub fn get(&self, gateway: &WorkloadKey) -> Option<WaypointFor> {
        self.gateways.get(gateway).copied()
    }

    /// The address istiod gives for the waypoint `gateway`.
    pub fn address(&self, gateway: &WorkloadKey) -> GatewayAddress {
        GatewayAddress {
            destination: GatewayDestination::Hostname {
                namespace: gateway.namespace.clone(),
                hostname: service_hostname(&gateway.namespace, &gateway.name, &self.cluster_domain),
            },
            hbone_mtls_port: WAYPOINT_HBONE_PORT,
        }
    }

    /// Istio's decision for `subject` (see the module docs).
    pub fn resolve(&self, subject: &Subject<'_>) -> Resolution {
        if subject
            .labels
            .get(MANAGED_LABEL)
            .is_some_and(|v| v == MANAGED_BY_MESH_CONTROLLER)
        {
            return Resolution::Unbound;
        }
        let (gateway, bound_by) = match label(subject.labels, subject.namespace) {
            Label::OptOut => return Resolution::Unbound,
            Label::Bound(gateway) => (gateway, BoundBy::Object),
            Label::Absent => {
                let Some(ns_labels) = subject.namespace_labels else {
                    return Resolution::Unbound;
                };
                match label(ns_labels, subject.namespace) {
                    Label::Absent | Label::OptOut => return Resolution::Unbound,
                    Label::Bound(gateway) => (gateway, BoundBy::Namespace),
                }
            }
        };
        // The waypoint's own service is never sent to itself.
        if subject.kind == Kind::Service
            && subject.namespace == gateway.namespace
            && subject.name == gateway.name
        {
            return Resolution::Unbound;
        }
        match self.gateways.get(&gateway) {
            None => Resolution::UnknownGateway { gateway, bound_by },
            Some(waypoint_for) if !waypoint_for.serves(subject.kind) => Resolution::NotServed {
                gateway,
                waypoint_for: *waypoint_for,
                bound_by,
            },
            Some(_) => Resolution::Waypoint(self.address(&gateway)),
        }
    }
}

/// Says each binding to an unknown gateway once (while it lasts): the
/// sources recompute every object's waypoint on every change, and a line
/// per recompute would drown the log.
#[derive(Debug, Default)]
pub struct UnknownGatewayLog {
    said: BTreeSet<(String, WorkloadKey)>,
    seen: BTreeSet<(String, WorkloadKey)>,
}

impl UnknownGatewayLog {
    /// Records `resolution` of the object `what` (e.g. `service shop/web`);
    /// returns whether an unknown gateway is to be said now (the first
    /// time since the pair last went away).
    pub fn note(&mut self, what: &str, resolution: &Resolution) -> bool {
        let Resolution::UnknownGateway { gateway, .. } = resolution else {
            return false;
        };
        let pair = (what.to_owned(), gateway.clone());
        self.seen.insert(pair.clone());
        self.said.insert(pair)
    }

    /// Ends one recompute: pairs not noted during it are forgotten, so a
    /// binding that breaks again is said again.
    pub fn finish(&mut self) {
        self.said = std::mem::take(&mut self.seen);
    }
}

#[cfg(test)]
#[path = "waypoint_tests.rs"]
mod tests;

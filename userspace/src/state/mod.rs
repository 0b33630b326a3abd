//! What the agent knows about workloads (pods) and services in the mesh.
//!
//! These types are the agent's own model, independent of the source that
//! produced them (the local workloads file or the Kubernetes watch),
//! so that reconciling, enrolment and the proxy never see a source's format.

mod hostname_endpoint;
mod locality;
mod owner;
mod pod_state;
mod service;
mod service_store;
mod weighted;

pub use hostname_endpoint::{HostnameEndpoint, HostnameTarget};
pub use locality::Place;
pub use owner::{ApplicationTunnel, ApplicationTunnelProtocol, WorkloadType, pod_owner};
pub use pod_state::PodState;
pub use service::{
    Endpoint, GatewayOnlyEndpoint, HealthPolicy, IpFamilies, LoadBalancing, LoadBalancingMode,
    LoadBalancingScope, Service, ServicePort, VipRange, Visibility, WeightedWaypoint,
};
pub use service_store::ServiceStore;
pub use weighted::{weighted_pick, weighted_pick_counted};

use std::{collections::BTreeMap, fmt, net::IpAddr, path::PathBuf, str::FromStr};

/// The trust domain of SPIFFE identities (`cluster.local` unless configured).
///
/// Validated on construction, because it is pasted into every identity and
/// a stray `/` or capital letter would yield IDs that peers never match.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct TrustDomain(String);

impl TrustDomain {
    /// Istio's default, used when nothing else is configured.
    pub const DEFAULT: &str = "cluster.local";

    /// Accepts 1–255 characters from SPIFFE's trust-domain set: lowercase
    /// letters, digits, `.`, `-` and `_`.
    pub fn new(name: &str) -> Result<Self, InvalidTrustDomain> {
        let invalid = |reason| InvalidTrustDomain {
            name: name.to_owned(),
            reason,
        };
        if name.is_empty() {
            return Err(invalid("it is empty"));
        }
        if name.len() > 255 {
            return Err(invalid("it is longer than 255 characters"));
        }
        let allowed = |c: char| matches!(c, 'a'..='z' | '0'..='9' | '.' | '-' | '_');
        if !name.chars().all(allowed) {
            return Err(invalid(
                "only lowercase letters, digits, '.', '-' and '_' are allowed",
            ));
        }
        Ok(Self(name.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl Default for TrustDomain {
    fn default() -> Self {
        Self(Self::DEFAULT.to_owned())
    }
}

impl FromStr for TrustDomain {
    type Err = InvalidTrustDomain;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        Self::new(s)
    }
}

impl fmt::Display for TrustDomain {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// A string that is not a valid trust domain.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{name:?} is not a valid trust domain: {reason}")]
pub struct InvalidTrustDomain {
    pub name: String,
    pub reason: &'static str,
}

/// A workload's SPIFFE identity, `spiffe://<trust-domain>/ns/<namespace>/sa/<service-account>`
/// (the URI SAN of its certificate, compared byte for byte by peers).
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct SpiffeId(String);

impl SpiffeId {
    /// The identity Istio gives the pods of a Kubernetes service account.
    pub fn for_service_account(
        trust_domain: &TrustDomain,
        namespace: &str,
        service_account: &str,
    ) -> Self {
        Self(format!(
            "spiffe://{trust_domain}/ns/{namespace}/sa/{service_account}"
        ))
    }

    /// An identity given as a URI (a service's `subject_alt_names`, after
    /// [`Service::san_uris`]); `None` unless it is `spiffe://…`.
    pub fn from_uri(uri: &str) -> Option<Self> {
        uri.starts_with("spiffe://").then(|| Self(uri.to_owned()))
    }

    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Display for SpiffeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

/// Identifies a workload across updates: its namespace and pod name.
///
/// Ordered by namespace then name, so listings and change sets are stable.
#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct WorkloadKey {
    pub namespace: String,
    pub name: String,
}

impl WorkloadKey {
    pub fn new(namespace: impl Into<String>, name: impl Into<String>) -> Self {
        Self {
            namespace: namespace.into(),
            name: name.into(),
        }
    }
}

/// `namespace/name`, as `kubectl` users write it.
impl fmt::Display for WorkloadKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}/{}", self.namespace, self.name)
    }
}

/// Whether a pod's traffic goes through the mesh (Istio's
/// `istio.io/dataplane-mode` values).
///
/// Defaults to [`DataplaneMode::None`]: the mesh is opt-in, as in Istio, so
/// forgetting the setting never captures a pod's traffic by surprise.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum DataplaneMode {
    /// Captured and carried over HBONE.
    Ambient,
    /// Left alone.
    #[default]
    None,
}

impl DataplaneMode {
    /// The label value (`ambient` or `none`).
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Ambient => "ambient",
            Self::None => "none",
        }
    }
}

impl FromStr for DataplaneMode {
    type Err = UnknownDataplaneMode;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s {
            "ambient" => Ok(Self::Ambient),
            "none" => Ok(Self::None),
            _ => Err(UnknownDataplaneMode(s.to_owned())),
        }
    }
}

impl fmt::Display for DataplaneMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

/// A dataplane mode value other than `ambient` or `none`.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("unknown value {0:?}; expected ambient or none")]
pub struct UnknownDataplaneMode(pub String);

/// A pod as the agent sees it.
///
/// The fields after `splice` come from the richer sources (istiod's
/// `istio.workload.Workload`, the Kubernetes watch); a source that does not
/// know one leaves its default, which means what the simple sources always
/// meant (the mesh's trust domain, HBONE, healthy, no waypoint, the pod
/// as its own owner, capacity 1).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Workload {
    /// Pod name.
    pub name: String,
    pub namespace: String,
    /// Determines the pod's identity.
    pub service_account: String,
    /// The pod's addresses; each belongs to this pod only.
    pub ips: Vec<IpAddr>,
    /// The node the pod is scheduled on.
    pub node: String,
    /// The pod's network namespace; known (and needed) only for pods on the
    /// agent's own node, where capture happens.
    pub netns: Option<PathBuf>,
    pub dataplane_mode: DataplaneMode,
    /// The pod's own say on splicing its connections
    /// ([`SPLICE_ANNOTATION`], or `splice:` in a workloads file); `None`
    /// leaves it to the agent's `--splice`. Off is for applications that
    /// read sockets in blocking mode, which a spliced socket can fail with
    /// EAGAIN (`ebpf/src/splice.rs`).
    pub splice: Option<bool>,
    /// The pod's own say on the passthrough fast path
    /// ([`FAST_PATH_ANNOTATION`] on the pod or its namespace, or
    /// `fastPath:` in a workloads file); `Some(false)` keeps every
    /// connection of the pod on the proxy path whatever `--fast-path` says.
    pub fast_path: Option<bool>,
    /// The pod's own say on DNS capture ([`DNS_CAPTURE_ANNOTATION`], or
    /// `dnsCapture:` in a workloads file); `None` leaves it to the agent's
    /// `--dns-capture`, `Some` wins over it (as in istio-cni).
    pub dns_capture: Option<bool>,
    /// The source's stable id (a pod's UID; xDS: `cluster//Pod/ns/name`).
    pub uid: String,
    /// The pod's labels (authorization selectors, canonical names).
    pub labels: BTreeMap<String, String>,
    /// The trust domain of its identity when it is not the mesh's (xDS
    /// `trust_domain`).
    pub trust_domain: Option<TrustDomain>,
    /// How peers reach it.
    pub tunnel: TunnelProtocol,
    /// `service.istio.io/canonical-name` and `-revision` (metrics labels);
    /// empty when unknown.
    pub canonical_name: String,
    pub canonical_revision: String,
    /// Istio's network and cluster ids; empty: the local ones.
    pub network: String,
    pub cluster_id: String,
    pub status: WorkloadStatus,
    /// The waypoint that serves it (L7), if any.
    pub waypoint: Option<GatewayAddress>,
    /// Policies istiod bound to it by selector, as `namespace/name`.
    pub authorization_policies: Vec<String>,
    /// The services it backs, by `namespace/hostname`: service port →
    /// target port (0: the service's own target port).
    pub services: BTreeMap<String, BTreeMap<u16, u16>>,
    /// The gateway that reaches it from other networks (xDS
    /// `network_gateway`), if any.
    pub network_gateway: Option<GatewayAddress>,
    /// Where it runs (xDS `locality`; locality-aware load balancing).
    pub locality: Option<Locality>,
    /// Its DNS name, for workloads known by name rather than address (xDS
    /// `hostname`); empty otherwise.
    pub hostname: String,
    /// The name of what owns it (xDS `workload_name`; the kube source
    /// derives it from the controller reference, [`pod_owner`]); empty:
    /// not known, the pod is named (see [`Workload::owner`]).
    pub workload_name: String,
    /// The kind of that owner (xDS `workload_type`).
    pub workload_type: WorkloadType,
    /// It speaks HBONE itself, with no node proxy in front (xDS
    /// `native_tunnel`). Stored; the proxy does not act on it yet.
    pub native_tunnel: bool,
    /// Its weight in endpoint and waypoint choice, relative to its peers
    /// (xDS `capacity`; 1 when unset or from other sources). 0 takes no new
    /// connections while a peer has capacity (see [`weighted_pick`]).
    pub capacity: u32,
    /// How the proxy should wrap what it delivers (xDS
    /// `application_tunnel`). Stored; not acted on yet.
    pub application_tunnel: Option<ApplicationTunnel>,
    /// The pod's `spec.hostname` and `spec.subdomain`: with a headless
    /// service named like the subdomain, the pod answers to
    /// `<hostname>.<subdomain>.<ns>.svc.<domain>` in DNS. Empty: not set.
    pub pod_hostname: String,
    pub pod_subdomain: String,
    /// It shares its node's network namespace (xDS `network_mode:
    /// HOST_NETWORK`): its IPs are the node's, claimed by every such pod
    /// of the node, so they name none of them (kept out of the store's
    /// address index, as ztunnel does).
    pub host_network: bool,
}

impl Default for Workload {
    /// Spelled out because `capacity` defaults to 1, not 0.
    fn default() -> Self {
        Self {
            name: String::new(),
            namespace: String::new(),
            service_account: String::new(),
            ips: Vec::new(),
            node: String::new(),
            netns: None,
            dataplane_mode: DataplaneMode::default(),
            splice: None,
            fast_path: None,
            dns_capture: None,
            uid: String::new(),
            labels: BTreeMap::new(),
            trust_domain: None,
            tunnel: TunnelProtocol::default(),
            canonical_name: String::new(),
            canonical_revision: String::new(),
            network: String::new(),
            cluster_id: String::new(),
            status: WorkloadStatus::default(),
            waypoint: None,
            authorization_policies: Vec::new(),
            services: BTreeMap::new(),
            network_gateway: None,
            locality: None,
            hostname: String::new(),
            workload_name: String::new(),
            workload_type: WorkloadType::default(),
            native_tunnel: false,
            capacity: 1,
            application_tunnel: None,
            pod_hostname: String::new(),
            pod_subdomain: String::new(),
            host_network: false,
        }
    }
}

/// A workload's region, zone and subzone (`istio.workload.Locality`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct Locality {
    pub region: String,
    pub zone: String,
    pub subzone: String,
}

/// How peers reach a workload (`istio.workload.TunnelProtocol`).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum TunnelProtocol {
    /// HTTP/2 CONNECT over mutual TLS on port 15008.
    #[default]
    Hbone,
    /// Plain TCP: not captured by a mesh proxy (passthrough).
    None,
}

/// Whether a workload may receive connections as a service endpoint.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum WorkloadStatus {
    #[default]
    Healthy,
    Unhealthy,
}

/// Where a waypoint (or other gateway) is reached
/// (`istio.workload.GatewayAddress`).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct GatewayAddress {
    pub destination: GatewayDestination,
    /// Its HBONE port (15008 unless istiod says otherwise).
    pub hbone_mtls_port: u16,
}

#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum GatewayDestination {
    /// An address on a network (empty: the local one).
    Address { network: String, ip: IpAddr },
    /// A service, by `namespace/hostname`, resolved through the services.
    Hostname { namespace: String, hostname: String },
}

/// A workload's service account when its source names none: what
/// Kubernetes gives a pod, and ztunnel a workload istiod sends without one.
pub const DEFAULT_SERVICE_ACCOUNT: &str = "default";

/// The cluster a workload belongs to when its source names none (ztunnel's
/// `CLUSTER_ID` default).
pub const DEFAULT_CLUSTER_ID: &str = "Kubernetes";

/// The label Istio puts on the pods of a waypoint it deploys (label, value).
/// istio-cni and ztunnel never capture such a pod, whatever its dataplane
/// mode: the waypoint's own Envoy serves HBONE on 15008.
pub const WAYPOINT_MANAGED_LABEL: (&str, &str) =
    ("gateway.istio.io/managed", "istio.io-mesh-controller");

/// The pod annotation that opts a pod's connections out of the splice
/// (`"off"`: with `--splice on`) or in (`"on"`: with `--splice opt-in`).
pub const SPLICE_ANNOTATION: &str = "shunt.io/splice";

/// The pod (or namespace) annotation that keeps a pod's connections on the
/// proxy path (`"off"`), out of the passthrough fast path.
pub const FAST_PATH_ANNOTATION: &str = "shunt.io/fast-path";

/// Istio's pod annotation turning DNS capture off (`"false"`) or on
/// (`"true"`) for one pod, whatever the node's default (`--dns-capture`).
pub const DNS_CAPTURE_ANNOTATION: &str = "ambient.istio.io/dns-capture";

impl Workload {
    pub fn key(&self) -> WorkloadKey {
        WorkloadKey::new(&self.namespace, &self.name)
    }

    /// The SPIFFE identity the pod speaks with (and peers expect of it).
    /// `trust_domain` is the mesh's; a workload with its own wins.
    pub fn identity(&self, trust_domain: &TrustDomain) -> SpiffeId {
        let trust_domain = self.trust_domain.as_ref().unwrap_or(trust_domain);
        SpiffeId::for_service_account(trust_domain, &self.namespace, &self.service_account)
    }

    /// What owns it, as telemetry names it (`k8s.<type>.name=<name>`): the
    /// source's owner, or the pod itself when the source named none.
    pub fn owner(&self) -> (WorkloadType, &str) {
        if self.workload_name.is_empty() {
            (WorkloadType::Pod, &self.name)
        } else {
            (self.workload_type, &self.workload_name)
        }
    }

    /// Its canonical service and revision as Istio derives them (metrics
    /// labels): the source's values (istiod sends them), else the labels
    /// `service.istio.io/canonical-name`, `app.kubernetes.io/name`, `app`,
    /// else the owner's name; the revision from
    /// `service.istio.io/canonical-revision`, `app.kubernetes.io/version`,
    /// `version`, else `latest`.
    pub fn canonical_service(&self) -> (&str, &str) {
        let label = |keys: [&str; 3]| {
            keys.iter()
                .find_map(|k| self.labels.get(*k).filter(|v| !v.is_empty()))
                .map(String::as_str)
        };
        let name = if self.canonical_name.is_empty() {
            label([
                "service.istio.io/canonical-name",
                "app.kubernetes.io/name",
                "app",
            ])
            .unwrap_or(self.owner().1)
        } else {
            &self.canonical_name
        };
        let revision = if self.canonical_revision.is_empty() {
            label([
                "service.istio.io/canonical-revision",
                "app.kubernetes.io/version",
                "version",
            ])
            .unwrap_or("latest")
        } else {
            &self.canonical_revision
        };
        (name, revision)
    }

    /// Whether the pod opted into the mesh (it is then a mesh peer,
    /// reached over HBONE).
    pub fn wants_mesh(&self) -> bool {
        self.dataplane_mode == DataplaneMode::Ambient
    }

    /// Whether it is a waypoint Istio deployed ([`WAYPOINT_MANAGED_LABEL`]).
    pub fn is_managed_waypoint(&self) -> bool {
        let (label, value) = WAYPOINT_MANAGED_LABEL;
        self.labels.get(label).is_some_and(|v| v == value)
    }

    /// Whether the node agent enrols (captures) the pod: it opted into the
    /// mesh and is not a waypoint, which serves its own HBONE listener (as
    /// istio-cni and ztunnel skip it). The one enrolment decision, whatever
    /// the source.
    pub fn captured(&self) -> bool {
        self.wants_mesh() && !self.is_managed_waypoint()
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn workload(ns: &str, name: &str, ip: &str, node: &str) -> Workload {
        Workload {
            name: name.into(),
            namespace: ns.into(),
            service_account: "sleep".into(),
            ips: vec![ip.parse().expect("test IP")],
            node: node.into(),
            netns: None,
            dataplane_mode: DataplaneMode::Ambient,
            splice: None,
            ..Default::default()
        }
    }

    #[test]
    fn identity_follows_istio_format() {
        let w = workload("default", "client", "198.18.1.2", "node-a");
        assert_eq!(
            w.identity(&TrustDomain::default()).to_string(),
            "spiffe://cluster.local/ns/default/sa/sleep"
        );
        let td = TrustDomain::new("example.org").expect("valid");
        assert_eq!(
            w.identity(&td).as_str(),
            "spiffe://example.org/ns/default/sa/sleep"
        );
    }

    #[test]
    fn key_displays_as_namespace_slash_name() {
        let w = workload("prod", "web-0", "198.18.1.2", "node-a");
        assert_eq!(w.key(), WorkloadKey::new("prod", "web-0"));
        assert_eq!(w.key().to_string(), "prod/web-0");
    }

    #[test]
    fn trust_domain_validation() {
        for good in ["cluster.local", "a", "td_1-x.example"] {
            assert_eq!(
                TrustDomain::new(good).map(|t| t.to_string()),
                Ok(good.into())
            );
        }
        for bad in [
            "",
            "Cluster.local",
            "a/b",
            "spiffe://x",
            "a b",
            &"a".repeat(256),
        ] {
            let err = TrustDomain::new(bad).expect_err(bad);
            assert!(
                err.to_string().contains("not a valid trust domain"),
                "{err}"
            );
        }
    }

    #[test]
    fn dataplane_mode_is_opt_in() {
        assert_eq!(DataplaneMode::default(), DataplaneMode::None);
        assert_eq!("ambient".parse(), Ok(DataplaneMode::Ambient));
        assert_eq!("none".parse(), Ok(DataplaneMode::None));
        let err = "Ambient"
            .parse::<DataplaneMode>()
            .expect_err("case matters");
        assert_eq!(
            err.to_string(),
            r#"unknown value "Ambient"; expected ambient or none"#
        );
        let mut w = workload("default", "client", "198.18.1.2", "node-a");
        assert!(w.wants_mesh());
        w.dataplane_mode = DataplaneMode::None;
        assert!(!w.wants_mesh());
    }

    #[test]
    fn canonical_service_follows_istios_fallbacks() {
        let mut w = workload("default", "ratings-v1-5d8-x2", "198.18.1.2", "node-a");
        assert_eq!(w.canonical_service(), ("ratings-v1-5d8-x2", "latest"));
        w.workload_name = "ratings-v1".into();
        w.workload_type = WorkloadType::Deployment;
        assert_eq!(w.canonical_service(), ("ratings-v1", "latest"));
        w.labels.insert("app".into(), "ratings".into());
        w.labels.insert("version".into(), "v1".into());
        assert_eq!(w.canonical_service(), ("ratings", "v1"));
        w.labels
            .insert("service.istio.io/canonical-name".into(), "stars".into());
        assert_eq!(w.canonical_service(), ("stars", "v1"));
        w.canonical_name = "from-istiod".into();
        w.canonical_revision = "r9".into();
        assert_eq!(w.canonical_service(), ("from-istiod", "r9"));
    }

    #[test]
    fn a_managed_waypoint_is_a_mesh_peer_but_never_captured() {
        let mut w = workload("default", "waypoint-5d8", "198.18.1.2", "node-a");
        assert!(w.captured());
        w.labels
            .insert("gateway.istio.io/managed".into(), "something-else".into());
        assert!(w.captured(), "only Istio's mesh controller value counts");
        w.labels.insert(
            "gateway.istio.io/managed".into(),
            "istio.io-mesh-controller".into(),
        );
        assert!(w.is_managed_waypoint());
        assert!(w.wants_mesh(), "still reached over HBONE");
        assert!(!w.captured(), "its Envoy listens on 15008 itself");
    }
}

//! `GET /config_dump` in the shape ztunnel serves it, so that Istio's
//! tools (`istioctl ztunnel-config workloads|services|policies|
//! certificates|all`) read shunt as they read ztunnel: the keys and value
//! formats of istioctl's `configdump` types (camelCase keys; `network/ip`
//! addresses; `Healthy`/`Unhealthy`; `Allow`/`Deny`; capitalised string
//! matches). What shunt knows beyond ztunnel — where each object came
//! from, what the reconciler did with each pod, istiod's connection, the
//! kernel's hooks — sits under extra `shunt` keys, which istioctl ignores;
//! no ztunnel key changes meaning.

use std::{collections::BTreeMap, net::IpAddr, path::PathBuf};

use serde::{Deserialize, Serialize};

use crate::{redirect::Hook, state::PodState};

/// The whole answer.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ConfigDump {
    /// Every workload the agent knows (every node's with the builtin proxy,
    /// which needs them to find peers; else this node's), by namespace and
    /// name.
    pub workloads: Vec<WorkloadDump>,
    /// Every service, by namespace and name.
    pub services: Vec<ServiceDump>,
    /// Every authorization policy the proxy enforces, by namespace and name.
    pub policies: Vec<PolicyDump>,
    /// One per identity the proxy holds or is being issued.
    pub certificates: Vec<CertsDump>,
    /// This node's captured pods, by workload uid.
    pub workload_state: BTreeMap<String, WorkloadStateDump>,
    /// shunt's own view of the node and its sources.
    pub shunt: NodeDump,
}

/// A workload (ztunnel's `Workload`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadDump {
    /// The source's id; for a source without one (the workloads file),
    /// ztunnel's form `<cluster>//Pod/<namespace>/<name>`.
    pub uid: String,
    pub workload_ips: Vec<IpAddr>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<GatewayDump>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub network_gateway: Option<GatewayDump>,
    /// `HBONE` or `TCP`.
    pub protocol: String,
    /// `Standard`, or `HostNetwork` for a pod on its node's network.
    pub network_mode: String,
    pub name: String,
    pub namespace: String,
    pub service_account: String,
    /// The owning workload's name and kind (`deployment`, `cronjob`, `job`,
    /// or the pod itself: `pod`).
    pub workload_name: String,
    pub workload_type: String,
    pub canonical_name: String,
    pub canonical_revision: String,
    pub cluster_id: String,
    /// Its own trust domain, when it is not the mesh's.
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub trust_domain: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub locality: Option<LocalityDump>,
    pub node: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub network: String,
    /// `Healthy` or `Unhealthy`.
    pub status: String,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    pub hostname: String,
    /// The policies istiod bound to it by selector (`namespace/name`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub authorization_policies: Vec<String>,
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub native_tunnel: bool,
    /// How deliveries to it are wrapped (istiod's `application_tunnel`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub application_tunnel: Option<ApplicationTunnelDump>,
    /// Its weight in endpoint and waypoint choice (istiod's `capacity`; 1
    /// when unset).
    pub capacity: u32,
    /// The services it backs, `namespace/hostname` (a list, as ztunnel's
    /// dump and the tools that read it have it; the ports are under
    /// `shunt.servicePorts`).
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub services: Vec<String>,
    pub shunt: WorkloadExtra,
}

/// A waypoint or network gateway: `destination` is `network/ip` or
/// `namespace/hostname`; `hboneMtlsPort` its HBONE port (ztunnel's keys).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct GatewayDump {
    pub destination: String,
    pub hbone_mtls_port: u16,
}

/// An address range of a service: `cidr` as `addr/prefix`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct CidrDump {
    pub network: String,
    pub cidr: String,
}

/// One waypoint of a service's weighted set.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WeightedWaypointDump {
    pub destination: GatewayDump,
    pub weight: u32,
}

/// `protocol` is `NONE` or `PROXY`; `port` 0 means the connection's own.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ApplicationTunnelDump {
    pub protocol: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LocalityDump {
    pub region: String,
    pub zone: String,
    pub subzone: String,
}

/// shunt's own facts about a workload.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadExtra {
    /// The SPIFFE identity it speaks with.
    pub identity: String,
    /// `ambient` or `none`.
    pub dataplane_mode: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub netns: Option<PathBuf>,
    /// What the reconciler did with it (this node's pods only).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub state: Option<PodState>,
    /// Every authorization policy that applies to it (`namespace/name`),
    /// whatever its scope.
    #[serde(default)]
    pub policies: Vec<String>,
    /// The services it backs: `namespace/hostname` → service port → target
    /// port (0: the service's own).
    #[serde(default, skip_serializing_if = "BTreeMap::is_empty")]
    pub service_ports: BTreeMap<String, BTreeMap<u16, u16>>,
    #[serde(flatten)]
    pub origin: Origin,
}

/// Where an object came from: `istiod` (with the version of the xDS
/// resource), `workloads-file` or `kubernetes`.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Origin {
    pub source: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub version: Option<String>,
}

/// A service (ztunnel's `Service`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceDump {
    pub name: String,
    pub namespace: String,
    pub hostname: String,
    /// `network/ip` (`/10.96.0.10` on the local network).
    pub vips: Vec<String>,
    /// Address ranges (a ServiceEntry's CIDR), as ztunnel dumps them.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub cidr_vips: Vec<CidrDump>,
    /// Service port → target port (0: each endpoint's own).
    pub ports: BTreeMap<u16, u16>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub load_balancer: Option<LoadBalancerDump>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub waypoint: Option<GatewayDump>,
    /// The weighted set (a canary between waypoints), as ztunnel dumps it.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub weighted_waypoints: Vec<WeightedWaypointDump>,
    /// Keyed `<workload uid>:<network>/<ip>`.
    pub endpoints: BTreeMap<String, EndpointDump>,
    /// Always present, empty too (ztunnel's).
    #[serde(default)]
    pub subject_alt_names: Vec<String>,
    /// `IPv4`, `IPv6` or `Dual`, from the VIPs.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ip_families: Option<String>,
    /// It owns its hostname when several services share it (istiod's).
    #[serde(default)]
    pub canonical: bool,
    /// Who may resolve it by name: `Public` or `Namespace`.
    #[serde(default)]
    pub visibility: String,
    pub shunt: Origin,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LoadBalancerDump {
    /// `Standard`, `Strict` or `Failover`.
    pub mode: String,
    /// `Region`, `Zone`, `Subzone`, `Node`, `Cluster`, `Network`.
    pub routing_preferences: Vec<String>,
    /// shunt sends to healthy endpoints only: `OnlyHealthy`.
    pub health_policy: String,
}

/// One endpoint of a service.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointDump {
    pub workload_uid: String,
    /// `namespace/hostname` of the service.
    pub service: String,
    /// `network/ip`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub address: Option<String>,
    /// Service port → this endpoint's target port (0: unknown).
    pub port: BTreeMap<u16, u16>,
    /// `Healthy` (gets connections) or `Unhealthy`.
    pub status: String,
}

/// An authorization policy (ztunnel's `Authorization`).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyDump {
    pub name: String,
    pub namespace: String,
    /// `Global`, `Namespace` or `WorkloadSelector`.
    pub scope: String,
    /// `Allow` or `Deny`.
    pub action: String,
    /// Rules (OR'd) → clauses (AND'd) → matches (OR'd).
    pub rules: Vec<Vec<Vec<MatchDump>>>,
    #[serde(default)]
    pub dry_run: bool,
    pub shunt: PolicyExtra,
}

/// shunt's own facts about a policy.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct PolicyExtra {
    /// The labels a pod must carry (workload-selector policies from the
    /// file or the Kubernetes API; istiod binds them in the workload).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub selector: Option<BTreeMap<String, String>>,
    #[serde(flatten)]
    pub origin: Origin,
}

/// One match: the fields set are AND'd, the values of one field OR'd.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct MatchDump {
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub namespaces: Vec<StringMatchDump>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_namespaces: Vec<StringMatchDump>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub service_accounts: Vec<ServiceAccountDump>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_service_accounts: Vec<ServiceAccountDump>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub principals: Vec<StringMatchDump>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_principals: Vec<StringMatchDump>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub source_ips: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_source_ips: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ips: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ips: Vec<String>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub destination_ports: Vec<u16>,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub not_destination_ports: Vec<u16>,
}

/// `{"namespace": "ns", "serviceAccount": "sa"}`, as ztunnel writes it.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct ServiceAccountDump {
    pub namespace: String,
    pub service_account: String,
}

/// `{"Exact": "v"}`, `{"Prefix": "v"}`, `{"Suffix": "v"}` or
/// `{"Presence": {}}`, as ztunnel writes them.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum StringMatchDump {
    Exact(String),
    Prefix(String),
    Suffix(String),
    Presence {},
}

/// An identity's certificates (ztunnel's `CertsDump`).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertsDump {
    /// `spiffe://<trust domain>/ns/<namespace>/sa/<service account>`.
    pub identity: String,
    /// `Available` or `Initializing` (being issued).
    pub state: String,
    /// Leaf first, then the intermediates and the mesh's roots.
    #[serde(default)]
    pub cert_chain: Vec<CertDump>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct CertDump {
    pub pem: String,
    /// Decimal.
    pub serial_number: String,
    /// RFC 3339, UTC (`2023-03-21T13:02:57Z`).
    pub valid_from: String,
    pub expiration_time: String,
}

/// One captured pod of this node (ztunnel's per-pod state).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadStateDump {
    /// `Up` once enrolled, else `Pending` or `Error` (the reason is in
    /// `shunt.state`).
    pub state: String,
    pub info: WorkloadInfoDump,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WorkloadInfoDump {
    pub name: String,
    pub namespace: String,
    pub trust_domain: String,
    pub service_account: String,
}

/// shunt's view of its node (the top-level `shunt` key).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct NodeDump {
    pub node: String,
    /// Redirection mode in use (`ebpf` or `iptables`).
    pub mode: String,
    pub trust_domain: String,
    /// Whether the pod source has listed every pod.
    pub synced: bool,
    /// The log filter in force.
    pub log_filter: Option<String>,
    /// Where this node's pods (enrolment) and the cluster view (workloads,
    /// services, policies) come from.
    pub sources: SourcesDump,
    /// Pods the redirector has enrolled, with their hooks.
    pub enrolled: Vec<EnrolledDump>,
    /// Pods the proxy serves (listeners bound in their netns).
    pub proxied: Vec<String>,
    /// With `--xds-address`: istiod's connection (connected since, last
    /// ACK/NACK per type and why) and every resource it sent, with its
    /// version.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub xds: Option<super::XdsStatus>,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct SourcesDump {
    /// `workloads-file` or `kubernetes`.
    pub pods: String,
    /// `istiod`, `workloads-file` or `kubernetes`.
    pub cluster: String,
}

/// An enrolled pod and its hooks.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
#[serde(rename_all = "camelCase")]
pub struct EnrolledDump {
    pub namespace: String,
    pub name: String,
    pub netns: PathBuf,
    pub netns_cookie: u64,
    pub mode: String,
    pub hooks: Vec<Hook>,
}
